// Consumer mainloop of the Hopper forward (fwd_sm90.cuh): warpgroups 1 and 2, 64 query rows each
// of a kBlockM = 128 row tile. Each runs S = Q K^T (SS wgmma), the online softmax in registers
// (fwd_softmax.h), and O += P V (RS wgmma, P from registers). Inside a warpgroup, the softmax of
// tile t overlaps the PV product of tile t + 1 (key tiles are walked from the last one down);
// between the two warpgroups a pair of named barriers hands over the turn to issue GEMMs
// (ping-pong), so one warpgroup's softmax (and, in short units, its epilogue, fwd_epilogue.h)
// runs under the other's GEMMs. A partial last tile lands whole (fwd_load.h): its V rows past the
// last key are zeroed before its P V (padding may hold NaN, and 0 * NaN would poison P V), while
// its K rows only feed scores that the mask replaces by -inf.
#pragma once

#include "cuda/sm90/common.h"
#include "cuda/sm90/fwd_softmax.h"
#include "cuda/sm90/fwd_traits.h"

namespace jax_varlen::cuda::sm90 {


// Named barriers (bar.sync ids; 0 is __syncthreads): the consumer ping-pong (warpgroup i waits
// on kSchedWg0 + i), and each consumer warpgroup's own barrier after it zeroed a V tail.
enum class FwdBarrier : int { kSchedWg0 = 1, kSchedWg1 = 2, kZeroWg0 = 3, kZeroWg1 = 4 };
// Units of at most this many key tiles hand over turns for every GEMM (see FwdMma::mma).
constexpr int kShortUnitTiles = 4;

// This thread's two rows of a unit (tile rows get<0>(cS(0)) and + 8): their query rows
// (Unit::row_head) and their allowed keys [first, limit) (mask.h, key_range; empty for rows past
// the sequence). The epilogue derives each row's head (not kept here: registers across the
// mainloop).
struct FwdRows {
  int first[2], limit[2];
  int row_of[2];  // query rows of the sequence (len_q for tile rows past it: never stored)
};

// One consumer thread (ct = 0..255 over both warpgroups). The constructor builds, once before the
// unit loop, the tiled MMAs, the wgmma descriptors of Q, K and V in shared memory and the
// coordinates of S; rows() and mma() then run per unit.
template <typename Tr, bool kSoftcap>
struct FwdMma {
  using Element = typename Tr::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim, kStages = Tr::kStages;
  static constexpr int kNT = kBlockN / 8, kDT = kHeadDim / 8;
  using ShapeKh = Shape<Int<Tr::kHalfN>, Int<kHeadDim>, Int<kStages>>;

  template <typename Layout0>
  using SmemTensor = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), Layout0{}));
  template <typename Mma>
  using ThrMma = decltype(std::declval<const Mma&>().get_thread_slice(0));
  using SQ = SmemTensor<typename Tr::SmemLayoutQ>;
  using SK = SmemTensor<typename Tr::SmemLayoutK>;
  using SVt = SmemTensor<typename Tr::SmemLayoutVt>;
  using ThrQK = ThrMma<typename Tr::TiledMmaQK>;
  using ThrQKh = ThrMma<typename Tr::TiledMmaQKHalf>;
  using ThrPV = ThrMma<typename Tr::TiledMmaPV>;

  FwdSharedStorage<Tr>& ss;
  int ct;
  int cwg;           // consumer warpgroup: rows [64 * cwg, +64) of the unit
  bool warp_leader;  // lane 0
  SVt sVt;
  typename Tr::TiledMmaQK mma_qk;
  typename Tr::TiledMmaQKHalf mma_qk_half;
  typename Tr::TiledMmaPV mma_pv;
  decltype(std::declval<const ThrQK&>().partition_fragment_A(std::declval<SQ&>())) tSrQ;  // descriptors
  decltype(std::declval<const ThrQK&>().partition_fragment_B(std::declval<SK&>())) tSrK;  // (MMA, MMA_N, MMA_K, stages)
  decltype(std::declval<const ThrQKh&>().partition_fragment_A(std::declval<SQ&>())) tSrQh;
  decltype(std::declval<const ThrQKh&>().partition_fragment_B(
      local_tile(std::declval<SK&>(), ShapeKh{}, make_coord(0, 0, 0)))) tSrKh;
  decltype(std::declval<const ThrPV&>().partition_fragment_B(std::declval<SVt&>())) tOrV;  // (MMA, MMA_N, MMA_K, stages)
  // (row, column) of this thread's S elements, the same as O's row-wise.
  decltype(std::declval<const ThrQK&>().partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}))) cS;
  JV_FWD_TRACE(int64_t* trace = nullptr; int trace_wg = 0;)  // fwd_trace.h: this unit's row, this warpgroup's marks

  // The operands' shared-memory descriptors depend on the warpgroup alone: they are built from
  // its first thread, a warp-uniform value (the shuffle says so to the compiler), so they stay
  // in uniform registers instead of being copied there before every product (R2UR).
  __device__ __forceinline__ FwdMma(FwdSharedStorage<Tr>& ss, int ct)
      : FwdMma(ss, ct, __shfl_sync(0xffffffff, ct / kWarpgroupThreads, 0) * kWarpgroupThreads) {}
  __device__ __forceinline__ FwdMma(FwdSharedStorage<Tr>& ss, int ct, int wg_thread0)
      : ss(ss), ct(ct), cwg(ct / kWarpgroupThreads), warp_leader(threadIdx.x % 32 == 0),
        sVt(make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutVt{})),
        tSrQ(mma_qk.get_thread_slice(wg_thread0).partition_fragment_A(sQ())),
        tSrK(mma_qk.get_thread_slice(wg_thread0).partition_fragment_B(sK())),
        tSrQh(mma_qk_half.get_thread_slice(wg_thread0).partition_fragment_A(sQ())),
        tSrKh(mma_qk_half.get_thread_slice(wg_thread0).partition_fragment_B(  // the first kHalfN rows of each K stage
            local_tile(sK(), ShapeKh{}, make_coord(0, 0, 0)))),
        tOrV(mma_pv.get_thread_slice(wg_thread0).partition_fragment_B(sVt)),
        cS(mma_qk.get_thread_slice(ct).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}))) {}

  __device__ __forceinline__ SQ sQ() const { return make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{}); }
  __device__ __forceinline__ SK sK() const { return make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{}); }

  // Warpgroup 0 issues first.
  __device__ __forceinline__ void begin_turns() const {
    if (cwg == 0) named_arrive(int(FwdBarrier::kSchedWg0), Tr::kConsumerThreads);
  }
  __device__ void sched_wait() const { named_sync(int(FwdBarrier::kSchedWg0) + cwg, Tr::kConsumerThreads); }
  __device__ void sched_pass() const {
    named_arrive(int(FwdBarrier::kSchedWg0) + (1 - cwg), Tr::kConsumerThreads);
  }
  __device__ void release(uint64_t* bar) const {
    __syncwarp();
    if (warp_leader) Barrier::arrive(bar);
  }
  // Zero V rows [rows, end) of stage s. Both warpgroups write the same zeros (so neither
  // waits for the other), then each fences its writes for wgmma and syncs its own 128 threads.
  __device__ void zero_v_tail(int s, int rows, int end) const {
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks of one V row
    for (int idx = ct % kWarpgroupThreads; idx < (end - rows) * kChunks; idx += kWarpgroupThreads)
      *reinterpret_cast<uint4*>(&sVt((idx % kChunks) * 8, rows + idx / kChunks, s)) = make_uint4(0, 0, 0, 0);
    cutlass::arch::fence_view_async_shared();
    named_sync(int(FwdBarrier::kZeroWg0) + cwg, kWarpgroupThreads);
  }

  __device__ __forceinline__ FwdRows thread_rows(const AttentionParams& p, const Unit& w) const {
    const int64_t row_base = int64_t(w.m_block) * kBlockM;  // the unit's first tile row
    FwdRows r;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int64_t row = w.row_head(row_base + get<0>(cS(2 * rr))).row;
      r.row_of[rr] = int(row < w.len_q ? row : w.len_q);
      const Range keys = r.row_of[rr] < w.len_q ? key_range(p.mask(), r.row_of[rr], w.n, w.len_q) : Range{0, 0};
      r.first[rr] = int(keys.begin);
      r.limit[rr] = int(keys.end);
    }
    return r;
  }

  // The mainloop of unit w (n_tiles > 0) on rows r: O unnormalized into tOrO (its old value
  // unused), the rows' max and partial sums into softmax. pipe: this thread's place in the K and
  // V rings; q_iter: the Q tiles consumed so far. kPlainLoop: the kernel has the loop of plain
  // tiles (the unpaged kernels of Tr::kPlainKernels, fwd_sm90.cuh; only without softcap), which
  // plain_tiles (params.h, fwd_plain_tiles) turns on.
  template <bool kPlainLoop, typename FragS, typename FragO, typename FragP>
  __device__ __forceinline__ void mma(const Unit& w, const FwdRows& r, PipelineState<kStages>& pipe, int& q_iter,
                                      RowSoftmax<kSoftcap>& softmax, FragS& tSrS, FragO& tOrO, FragP& tOrP,
                                      bool plain_tiles) {
    // Element i of S is key n0 + its column, of row half (i / 2) % 2. Without softcap the rows'
    // bounds are moved once per tile by the thread's first column, so that each element
    // compares its column offset -- a constant of the fragment layout -- with them (bf16 d128:
    // 60-90 fewer instructions in the mainloop); the softcap kernels, short of registers there
    // (the moved bounds made them spill inside the loop), compute each element's key.
    auto masked_out_at = [&](int n0) {
      if constexpr (kSoftcap) {
        return [&, n0](int i) {
          const int key = n0 + int(get<1>(cS(i)));
          return key >= r.limit[(i / 2) & 1] || key < r.first[(i / 2) & 1];
        };
      } else {
        const int col0 = n0 + int(get<1>(cS(0)));
        const int limit[2] = {r.limit[0] - col0, r.limit[1] - col0}, first[2] = {r.first[0] - col0, r.first[1] - col0};
        return [=](int i) {
          const int c = int(get<1>(cS(i))) - int(get<1>(cS(0)));
          return c >= limit[(i / 2) & 1] || c < first[(i / 2) & 1];
        };
      }
    };
    // Tiles that reach past some row's limit or start before some row's first key are masked.
    auto needs_mask = [&](int n0) { return n0 + kBlockN > w.min_limit || n0 < w.max_first; };
    static_assert(decltype(size(tSrS))::value == kNT * 4 && decltype(size(tOrO))::value == kDT * 4);
    auto convert_p = [&] {  // P = S rounded to Element, element by element in register order
      cutlass::NumericArrayConverter<Element, float, kNT * 4> convert;
      *reinterpret_cast<cutlass::Array<Element, kNT * 4>*>(tOrP.data()) =
          convert(*reinterpret_cast<const cutlass::Array<float, kNT * 4>*>(tSrS.data()));
    };
    float alpha[2];

    Barrier::wait(&ss.full_q, q_iter & 1);
    JV_FWD_TRACE(trace_mark(trace, kTraceQ + trace_wg);)
    ++q_iter;
    // The last tile t = n_tiles - 1 first (masked). When it is partial its V rows past key_end
    // are zeroed before its P V. When it holds at most kHalfN keys it runs whole on
    // half-width products, and the next tile starts the overlapped loop instead.
    int t = w.n_tiles - 1;
    const int last_rows = w.key_end - t * kBlockN;  // in (0, kBlockN]
    const bool half = last_rows <= Tr::kHalfN;
    // Short units also take turns for their first and last GEMMs, so that one warpgroup's
    // epilogue runs under the other's GEMMs; long units issue those two at once (measured
    // faster there). Both warpgroups see the same unit, so the turns stay paired.
    const bool edge_turns = w.n_tiles - w.t_begin <= kShortUnitTiles;
    auto edge_wait = [&] { if (edge_turns) sched_wait(); };
    auto edge_pass = [&] { if (edge_turns) sched_pass(); };
    if (half) {
      constexpr int kHalfNT = Tr::kHalfN / 8;
      Tensor tSrSh = partition_fragment_C(mma_qk_half, Shape<Int<kBlockM>, Int<Tr::kHalfN>>{});
      Barrier::wait(&ss.full_k[pipe.stage], pipe.phase);
      edge_wait();
      wgmma_issue<true>(mma_qk_half, tSrQh, tSrKh(_, _, _, pipe.stage), tSrSh);
      edge_pass();
      warpgroup_wait<0>();
      release(&ss.empty_k[pipe.stage]);
      softmax.template step<kHalfNT>(tSrSh.data(), true, masked_out_at(t * kBlockN), alpha);
      Tensor tOrPh = make_tensor_like<Element>(make_tensor(tSrSh.data(), acc_to_a_layout(tSrSh.layout())));
      cutlass::NumericArrayConverter<Element, float, kHalfNT * 4> convert;
      *reinterpret_cast<cutlass::Array<Element, kHalfNT * 4>*>(tOrPh.data()) =
          convert(*reinterpret_cast<const cutlass::Array<float, kHalfNT * 4>*>(tSrSh.data()));
      Barrier::wait(&ss.full_v[pipe.stage], pipe.phase);
      zero_v_tail(pipe.stage, last_rows, Tr::kHalfN);
      edge_wait();
      wgmma_issue<true>(mma_pv, tOrPh, tOrV(_, _, _, pipe.stage), tOrO);  // the k-blocks of tOrPh only
      edge_pass();
      warpgroup_wait<0>();
      release(&ss.empty_v[pipe.stage]);
      pipe.advance();
      --t;
    }
    if (!half) clear(tOrO);
    if (t >= w.t_begin) {  // S, softmax and P of tile t; its P V is the loop's (or the final) product
      Barrier::wait(&ss.full_k[pipe.stage], pipe.phase);
      edge_wait();
      wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, pipe.stage), tSrS);
      edge_pass();
      warpgroup_wait<0>();
      release(&ss.empty_k[pipe.stage]);
      softmax.template step<kNT>(tSrS.data(), true, masked_out_at(t * kBlockN), alpha);
      rescale_rows<kDT * 4>(tOrO.data(), alpha);
      convert_p();
    }
    // One step of the overlapped loop: S = Q K[t-1]^T and O += P V[t], issued back to back; the
    // softmax of S runs under this warpgroup's P V. plain: tile t - 1 needs no mask and the max
    // is taken on raw scores -- a step without a branch, the same arithmetic as the other. With
    // branches between the two waits ptxas places the second one (wait<0>) ahead of the whole
    // softmax, which then waits for P V; without, at d64 the row max and some of the exponents
    // run under P V as in FA3, at d128 one row's max (35 of 64 FMNMX at 128 keys, 46 of 88 at
    // 176: ptxas puts the wait after the first row's shuffles; benchmarks/NOTES.md, sessions
    // 2026-12-06 i and 2026-12-07 j, and results/2026-12-06-i-sass-overlap.txt).
    auto overlapped = [&](int t, auto plain) {
      const int stage_v = pipe.stage, phase_v = pipe.phase;
      if (!decltype(plain)::value && t == w.n_tiles - 1 && last_rows < kBlockN && !half) {
        Barrier::wait(&ss.full_v[stage_v], phase_v);
        zero_v_tail(stage_v, last_rows, kBlockN);
      }
      pipe.advance();
      Barrier::wait(&ss.full_k[pipe.stage], pipe.phase);
      sched_wait();
      wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, pipe.stage), tSrS);
      Barrier::wait(&ss.full_v[stage_v], phase_v);
      wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, stage_v), tOrO);
      sched_pass();
      warpgroup_wait<1>();
      release(&ss.empty_k[pipe.stage]);
      const int n0 = (t - 1) * kBlockN;
      softmax.template step<kNT, decltype(plain)::value>(tSrS.data(), needs_mask(n0), masked_out_at(n0), alpha);
      warpgroup_wait<0>();
      release(&ss.empty_v[stage_v]);
      rescale_rows<kDT * 4>(tOrO.data(), alpha);
      convert_p();
    };
    if constexpr (kPlainLoop && !kSoftcap) {
      // Tiles walk down: masked ones (the diagonal, a partial last tile), a run of plain ones,
      // and masked ones again (a window's left edge). The first tile (t == n_tiles - 1) never
      // runs plain: it may zero a V tail.
      const bool plain = plain_tiles && softmax.scaled_max();
      while (t > w.t_begin) {
        if (plain && t < w.n_tiles - 1 && !needs_mask((t - 1) * kBlockN)) {
          do {
            overlapped(t, cute::true_type{});
            --t;
          } while (t > w.t_begin && !needs_mask((t - 1) * kBlockN));
        } else {
          overlapped(t, cute::false_type{});
          --t;
        }
      }
    } else {
      for (; t > w.t_begin; --t) overlapped(t, cute::false_type{});
    }
    release(&ss.empty_q);  // the last Q K^T of this unit is done: the producer may load the next Q
    JV_FWD_TRACE(trace_mark(trace, kTraceLoop + trace_wg);)
    if (t == w.t_begin) {  // P V of the first tile
      Barrier::wait(&ss.full_v[pipe.stage], pipe.phase);
      if (w.n_tiles - w.t_begin == 1 && !half && last_rows < kBlockN) zero_v_tail(pipe.stage, last_rows, kBlockN);
      edge_wait();
      wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, pipe.stage), tOrO);
      edge_pass();
      warpgroup_wait<0>();
      release(&ss.empty_v[pipe.stage]);
      pipe.advance();
    }
  }

  // The lean units' part (fwd_mma_lean.h): whether this warpgroup's rows all lie past unit w's,
  // and the barriers of mma() without its products.
  __device__ __forceinline__ bool idle(const Unit& w) const;
  __device__ void follow(const Unit& w, PipelineState<kStages>& pipe, int& q_iter) const;
};

}  // namespace jax_varlen::cuda::sm90

#include "cuda/sm90/fwd_mma_lean.h"
