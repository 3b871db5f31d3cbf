// Consumer epilogue of the Hopper forward (fwd_sm90.cuh): a unit's O / l to out and its
// log-sum-exp to lse, straight from the registers of the mainloop (fwd_mma.h), the attention
// sinks through core/sinks.h's finish_row; a unit of which no row sees a key (no tile, never
// loaded) gets zero rows instead. Query rows past the sequence's length are computed and never
// stored.
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
  int ct;
  int lane;
  // (row, column) of this thread's O elements.
  decltype(std::declval<const ThrPV&>().partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}))) cO;
  Element* out;

  __device__ __forceinline__ FwdEpilogue(const AttentionParams& p, int ct)
      : p(p), ct(ct), lane(threadIdx.x % 32),
        cO(typename Tr::TiledMmaPV{}.get_thread_slice(ct).partition_C(
            make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}))),
        out(static_cast<Element*>(p.out)) {}

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

  // Unit w after its mainloop (fwd_mma.h) on rows r: tOrO holds O unnormalized, softmax the
  // rows' max and partial sums. O / l rounded once; a row decides "no allowed key" by its range,
  // never by its sum, so NaN or Inf in real data propagates (SPEC: non-finite real data).
  template <bool kSoftcap, typename FragO>
  __device__ __forceinline__ void store(const Unit& w, const FwdRows& r, const FwdUnitOut<Element>& dst,
                                        const RowSoftmax<kSoftcap>& softmax, const FragO& tOrO) const {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float sum = softmax.l[rr];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      if (r.row_of[rr] >= w.len_q) continue;
      // The row's head (Unit::row_head) from its tile row in the wgmma accumulator layout: 16
      // rows per warp, lane / 4, + 8 for rr = 1.
      const int dh = w.row_head(int64_t(w.m_block) * kBlockM + ct / 32 * 16 + lane / 4 + 8 * rr).dh;
      const int head = w.h + dh;
      const bool any = r.limit[rr] > r.first[rr];
      const RowFinish fin =  // core/sinks.h: 1 / l and lse, with the sink in the denominator
          any ? finish_row</*kBase2=*/true>(softmax.m[rr], sum, sink_of(p, head)) : RowFinish{0.0f, empty_row_lse(p, head)};
      const float inv = fin.inv;
      // The row's first column of this thread; the others at constant offsets from it (their
      // column differences fold to constants, where each column's own 64-bit address would cost
      // four instructions a store).
      const int col0 = get<1>(cO(2 * rr));
      Element* o = dst.out + int64_t(r.row_of[rr]) * p.out_row_stride + dh * p.out_head_stride + col0;
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
      if ((lane & 3) == 0) dst.lse[dh * dst.lse_head_stride + r.row_of[rr]] = fin.lse;
    }
  }
};

}  // namespace jax_varlen::cuda::sm90
