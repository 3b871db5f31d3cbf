// Consumer epilogue of the Hopper forward (fwd_sm90.cuh): a unit's O / l to out and its
// log-sum-exp to lse, the attention sinks through core/sinks.h's finish_row; a unit of which no
// row sees a key (no tile, never loaded) gets zero rows instead. Query rows past the sequence's
// length are computed and never stored. O goes out straight from the mainloop's registers
// (fwd_mma.h), or, where the traits have room (Tr::kStagedO), through shared memory: a register
// fragment's 4-byte pieces lie on eight rows per warp store (16 bytes a row), while a row staged
// by stmatrix leaves in 128-byte runs, four rows per warp store (as FA3's varlen epilogue).
#pragma once

#include "cuda/sm90/common.h"
#include "cuda/sm90/fwd_mma.h"
#include "cuda/sm90/tile_scheduler.h"
#include "core/sinks.h"

namespace jax_varlen::cuda::sm90 {

// Where a unit's rows go: row i of the sequence, head h, is out row q_start + i of the pack;
// lse [packs, heads, pack_rows_q]. A pack-GQA unit's heads are h + 0 .. heads - 1.
template <typename Element>
struct FwdUnitOut {
  Element* out;  // the sequence's row 0, head h
  float* lse;
  int64_t lse_head_stride;  // pack_rows_q
};

// One consumer thread (ct = 0..255 over both warpgroups). The constructor builds, once before the
// unit loop, the coordinates of O; unit_out() runs per unit before the mainloop, then store() or,
// for a unit with no tile, store_zeros().
template <typename Tr>
struct FwdEpilogue {
  using Element = typename Tr::Element;
  static constexpr int kBlockM = Tr::kBlockM, kHeadDim = Tr::kHeadDim, kDT = kHeadDim / 8;
  using ThrPV = decltype(std::declval<const typename Tr::TiledMmaPV&>().get_thread_slice(0));

  const AttentionParams& p;
  Element* slabs;  // the consumer warps' O slabs (Tr::kStagedO; store_staged), else nullptr
  int ct;
  int lane;
  // (row, column) of this thread's O elements.
  decltype(std::declval<const ThrPV&>().partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}))) cO;
  Element* out;

  __device__ __forceinline__ FwdEpilogue(const AttentionParams& p, FwdSharedStorage<Tr>& ss, int ct)
      : p(p), slabs(out_slabs(ss)), ct(ct), lane(threadIdx.x % 32),
        cO(typename Tr::TiledMmaPV{}.get_thread_slice(ct).partition_C(
            make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}))),
        out(static_cast<Element*>(p.out)) {}

  static __device__ __forceinline__ Element* out_slabs(FwdSharedStorage<Tr>& ss) {
    if constexpr (Tr::kStagedO) return ss.o.data();
    return nullptr;
  }

  __device__ __forceinline__ FwdUnitOut<Element> unit_out(const Unit& w) const {
    return {out + int64_t(w.pack) * p.out_batch_stride + int64_t(w.q_start) * p.out_row_stride +
                w.h * p.out_head_stride,
            p.lse + (int64_t(w.pack) * p.num_heads + w.h) * p.pack_rows_q + w.q_start, p.pack_rows_q};
  }

  // Unit w has no tile: no row of the unit sees a key: zero rows (16-byte stores), lse = -inf
  // (or the sink's logit); each tile row's query row and head from Unit::row_head.
  __device__ __forceinline__ void store_zeros(const Unit& w, const FwdUnitOut<Element>& dst) const {
    const int64_t row_base = int64_t(w.m_block) * kBlockM;
    const int chunks = int(p.head_dim_v / 8);
    for (int idx = ct; idx < w.rows * chunks; idx += Tr::kConsumerThreads) {
      const Unit::RowHead at = w.row_head(row_base + idx / chunks);
      *reinterpret_cast<uint4*>(dst.out + at.row * p.out_row_stride + at.dh * p.out_head_stride + (idx % chunks) * 8) =
          make_uint4(0, 0, 0, 0);
    }
    for (int i = ct; i < w.rows; i += Tr::kConsumerThreads) {
      const Unit::RowHead at = w.row_head(row_base + i);
      dst.lse[at.dh * dst.lse_head_stride + at.row] = empty_row_lse(p, w.h + at.dh);
    }
  }

  // Row rr of this thread's two (FwdRows) after the mainloop: its sum over the quad, then, for a
  // row of the sequence, 1 / l and lse (core/sinks.h's finish_row: the sink in the denominator;
  // lse stored here) and its head's offset from w.h; `stored` false past the sequence's rows.
  struct RowOut {
    float inv;
    int dh;
    bool stored;
  };
  template <bool kSoftcap>
  __device__ __forceinline__ RowOut finish(const Unit& w, const FwdRows& r, const FwdUnitOut<Element>& dst,
                                           const RowSoftmax<kSoftcap>& softmax, int rr) const {
    float sum = softmax.l[rr];
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    if (r.row_of[rr] >= w.len_q) return {0.0f, 0, false};
    // The row's head (Unit::row_head) from its tile row in the wgmma accumulator layout: 16 rows
    // per warp, lane / 4, + 8 for rr = 1.
    const int dh = w.row_head(int64_t(w.m_block) * kBlockM + ct / 32 * 16 + lane / 4 + 8 * rr).dh;
    const int head = w.h + dh;
    const bool any = r.limit[rr] > r.first[rr];
    const RowFinish fin =
        any ? finish_row</*kBase2=*/true>(softmax.m[rr], sum, sink_of(p, head)) : RowFinish{0.0f, empty_row_lse(p, head)};
    if ((lane & 3) == 0) dst.lse[dh * dst.lse_head_stride + r.row_of[rr]] = fin.lse;
    return {fin.inv, dh, true};
  }

  // Unit w after its mainloop (fwd_mma.h) on rows r: tOrO holds O unnormalized, softmax the
  // rows' max and partial sums. O / l rounded once; a row decides "no allowed key" by its range,
  // never by its sum, so NaN or Inf in real data propagates (SPEC: non-finite real data).
  template <bool kSoftcap, typename FragO>
  __device__ __forceinline__ void store(const Unit& w, const FwdRows& r, const FwdUnitOut<Element>& dst,
                                        const RowSoftmax<kSoftcap>& softmax, const FragO& tOrO) const {
    if constexpr (Tr::kStagedO) {
      store_staged(w, r, dst, softmax, tOrO);
    } else {
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const RowOut row = finish(w, r, dst, softmax, rr);
        if (!row.stored) continue;
        const float inv = row.inv;
        // The row's first column of this thread; the others at constant offsets from it (their
        // column differences fold to constants, where each column's own 64-bit address would cost
        // four instructions a store).
        const int col0 = get<1>(cO(2 * rr));
        Element* o = dst.out + int64_t(r.row_of[rr]) * p.out_row_stride + row.dh * p.out_head_stride + col0;
        auto store_pair = [&](int j) {
          const int i = 4 * j + 2 * rr;
          cutlass::Array<Element, 2> pair;
          pair[0] = Element(tOrO(i) * inv);
          pair[1] = Element(tOrO(i + 1) * inv);
          *reinterpret_cast<cutlass::Array<Element, 2>*>(o + (get<1>(cO(i)) - col0)) = pair;
        };
        if (p.head_dim_v == kHeadDim) {  // every column is real: stores at constant offsets from o
#pragma unroll
          for (int j = 0; j < kDT; ++j) store_pair(j);
        } else {
#pragma unroll
          for (int j = 0; j < kDT; ++j)
            if (get<1>(cO(4 * j + 2 * rr)) < p.head_dim_v) store_pair(j);
        }
      }
    }
  }

  // store() through shared memory (Tr::kStagedO): this thread's O / l rounded as store() rounds
  // it. Each warp owns 16 rows of the unit (wgmma's layout) and a slab of 16 rows x
  // kOutSlabCols of its own, so it needs no barrier beyond its own __syncwarp: per slab of
  // columns, stmatrix (four 8x8 blocks per instruction, a fragment's pair of columns per lane
  // per block, as wgmma leaves them) writes the rows, then each lane reads 16-byte chunks of
  // whole rows back and stores them, 8 lanes a 128-byte row. Slab rows are 128 bytes; chunk c of
  // row r lies at chunk c ^ (r % 8), so that neither the stmatrix rows nor the reads collide in
  // banks.
  template <bool kSoftcap, typename FragO>
  __device__ __forceinline__ void store_staged(const Unit& w, const FwdRows& r, const FwdUnitOut<Element>& dst,
                                               const RowSoftmax<kSoftcap>& softmax, const FragO& tOrO) const {
    const float inv[2] = {finish(w, r, dst, softmax, 0).inv, finish(w, r, dst, softmax, 1).inv};  // 0: never stored
    // Columns 8j + 2 (lane % 4) + {0, 1} of row lane / 4 + 8 rr, rounded and packed: element
    // 4j + 2rr + {0, 1} of the fragment (fwd_softmax.h), which is stmatrix's lane layout.
    auto packed = [&](int j, int rr) {
      cutlass::Array<Element, 2> pair;
      pair[0] = Element(tOrO(4 * j + 2 * rr) * inv[rr]);
      pair[1] = Element(tOrO(4 * j + 2 * rr + 1) * inv[rr]);
      return reinterpret_cast<const uint32_t&>(pair);
    };
    constexpr int kSlabCols = Tr::kOutSlabCols, kSlabChunks = kSlabCols / 8, kSlabs = kHeadDim / kSlabCols;
    static_assert(kHeadDim % kSlabCols == 0 && kSlabChunks == 8, "128-byte slab rows, 8 chunks");
    const int warp = ct / 32;
    const uint32_t slab = cute::cast_smem_ptr_to_uint(slabs) + warp * 16 * kSlabCols * sizeof(Element);
    auto at = [&](int row, int chunk) { return slab + row * 128 + ((chunk ^ (row & 7)) << 4); };
    // stmatrix: lane L gives the address of row L % 8 of block L / 8 = (rows 8 (L / 8 % 2) + .., chunk
    // 2q + L / 16) for the q-th instruction of a slab. Reads: lane L, chunk L % 8 of rows L / 8 + 4k.
    const int m = lane / 8, row_w = 8 * (m % 2) + lane % 8;
    const int chunks_v = int(p.head_dim_v / 8);
    const int64_t row0 = int64_t(w.m_block) * kBlockM + warp * 16;  // the warp's first tile row
#pragma unroll
    for (int s = 0; s < kSlabs; ++s) {
      __syncwarp();  // the slab's last reads (the previous slab or unit) are done
#pragma unroll
      for (int q = 0; q < kSlabChunks / 2; ++q) {
        const int j = s * kSlabChunks + 2 * q;
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(at(row_w, 2 * q + m / 2)),
                     "r"(packed(j, 0)), "r"(packed(j, 1)), "r"(packed(j + 1, 0)), "r"(packed(j + 1, 1)));
      }
      __syncwarp();
      const int chunk = lane % 8, c = s * kSlabChunks + chunk;  // this lane's 16-byte chunk of the row
      auto read = [&](int k) {  // row lane / 8 + 4k of the warp's 16
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(at(lane / 8 + 4 * k, chunk)));
        return v;
      };
      auto write = [](Element* o, uint4 v) {  // 16-byte aligned: D, Dv and the strides are multiples of 8 (plan)
        asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(o), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                     : "memory");
      };
      const int rows_left = w.rows - warp * 16 - lane / 8;  // this lane's rows real below it
      if (c >= chunks_v) continue;  // past Dv: never stored
      if (w.heads == 1) {  // tile row i is query row row0 + i: 4 rows apart in out as well
        Element* o = dst.out + (row0 + lane / 8) * p.out_row_stride + c * 8;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint4 v = read(k);
          if (4 * k < rows_left) write(o + 4 * k * p.out_row_stride, v);
        }
      } else {  // pack-GQA: each tile row's query row and head (Unit::row_head)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint4 v = read(k);
          if (4 * k >= rows_left) break;
          const Unit::RowHead rh = w.row_head(row0 + lane / 8 + 4 * k);
          write(dst.out + rh.row * p.out_row_stride + rh.dh * p.out_head_stride + c * 8, v);
        }
      }
    }
  }
};

}  // namespace jax_varlen::cuda::sm90
