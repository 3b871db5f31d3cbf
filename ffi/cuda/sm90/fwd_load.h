// Producer role of the Hopper forward (fwd_sm90.cuh): warp 0 of warpgroup 0 issues the TMA
// copies of Q, K and V (kStages-deep K and V rings on mbarriers), lane 0 alone; the Q tile of a
// pack-GQA unit (tile_scheduler.h), whose rows interleave query rows and heads, comes by cp.async
// from all 32 lanes instead (a TMA box cannot interleave them at a runtime group). A paged call
// (params.h, block_table) has its K and V tiles gathered from the cache's pages by cp.async, all
// four warps of the producer warpgroup sharing each tile (kProducerWarps arrivals per stage
// barrier), up to two tiles in flight per warp (PagedCommit). Tiles past a
// unit's last allowed key are never loaded; the last tile, when partial, lands whole, and the
// consumers zero its V rows past the last key before using it (fwd_mma.h), while its K rows only
// feed scores that the mask replaces by -inf.
#pragma once

#include "cuda/sm90/common.h"
#include "cuda/sm90/fwd_traits.h"

namespace jax_varlen::cuda::sm90 {


// One thread of the producer warp. The constructor builds, once before the unit loop, the TMA
// views of the global tensors and the TMA partitions of the shared buffers; load() issues the
// copies of one unit.
// Where a producer warp's cp.async tiles stand (paged calls): the group last committed and
// the stage barrier it completes. A tile's barrier is signalled once the next tile's group is
// committed and this one has landed (cp.async.wait_group 1), or at flush(), so two tiles are in
// flight; each thread fences its own landed writes for wgmma (the async proxy) before its warp's
// lane 0 arrives.
struct PagedCommit {
  uint64_t* pending = nullptr;

  __device__ void signal(uint64_t* bar) const {
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    if (threadIdx.x % 32 == 0) cutlass::arch::ClusterBarrier::arrive(bar);
  }
  __device__ void commit(uint64_t* bar) {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    if (pending != nullptr) {
      asm volatile("cp.async.wait_group 1;\n" ::: "memory");
      signal(pending);
    }
    pending = bar;
  }
  // Before the producer waits on the consumers (a unit's end): every committed tile signalled.
  __device__ void flush() {
    if (pending == nullptr) return;
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    signal(pending);
    pending = nullptr;
  }
};

// One 16-byte cp.async, or 16 zero bytes (src-size 0) where !real.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool real) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(cute::cast_smem_ptr_to_uint(smem)),
               "l"(gmem), "r"(real ? 16 : 0) : "memory");
}

// kPaged: K and V from a paged cache (params.h, block_table), a kernel of its own so that the
// TMA path's producer keeps its few registers to itself.
template <typename Tr, bool kPaged>
struct FwdLoad {
  using Element = typename Tr::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  static constexpr int kProducerWarps = Tr::kProducerWarps;

  template <typename Layout0>
  using SmemTensor = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), Layout0{}));
  template <typename Tma>
  using GmemTensor = decltype(std::declval<const Tma&>().get_tma_tensor(typename Tr::Shape4{}));
  template <typename Tma>
  using Slice = decltype(std::declval<const Tma&>().get_slice(0));
  template <typename Tma, typename Layout0>
  using SmemPart = decltype(std::declval<const Slice<Tma>&>().partition_D(std::declval<SmemTensor<Layout0>&>()));

  const FwdKernelParams<Tr>& kp;
  FwdSharedStorage<Tr>& ss;
  int group;    // query heads per kv head
  bool leader;  // lane 0 of warp 0
  int warp;     // 0..kProducerWarps - 1 (only warp 0 unless paged)
  PagedCommit paged_commit;
  JV_FWD_TRACE(int64_t* trace = nullptr;)  // fwd_trace.h: this unit's row (thread 0)
  GmemTensor<typename Tr::TmaQ> mQ;   // (rows of a pack, dim, heads, packs)
  GmemTensor<typename Tr::TmaK> mK;
  GmemTensor<typename Tr::TmaV> mVt;  // (dim, rows of a pack, heads, packs)
  Slice<typename Tr::TmaQ> tma_q;
  Slice<typename Tr::TmaK> tma_k;
  Slice<typename Tr::TmaV> tma_v;
  SmemPart<typename Tr::TmaQ, typename Tr::SmemLayoutQ> tQsQ;
  SmemPart<typename Tr::TmaK, typename Tr::SmemLayoutK> tKsK;   // (TMA, 1, 1, stages)
  SmemPart<typename Tr::TmaV, typename Tr::SmemLayoutVt> tVsV;  // (TMA, 1, 1, stages)

  __device__ __forceinline__ FwdLoad(const FwdKernelParams<Tr>& kp, FwdSharedStorage<Tr>& ss)
      : kp(kp), ss(ss), group(int(kp.p.num_heads / kp.p.kv_num_heads)), leader(threadIdx.x == 0),
        warp(threadIdx.x / 32),
        mQ(kp.tma_q.get_tma_tensor(make_shape(int(kp.p.pack_rows_q), int(kp.p.head_dim), int(kp.p.num_heads),
                                              int(kp.p.num_packs)))),
        mK(kp.tma_k.get_tma_tensor(make_shape(int(kp.p.pack_rows_k), int(kp.p.head_dim), int(kp.p.kv_num_heads),
                                              int(kp.p.num_packs)))),
        mVt(kp.tma_v.get_tma_tensor(make_shape(int(kp.p.head_dim_v), int(kp.p.pack_rows_k), int(kp.p.kv_num_heads),
                                               int(kp.p.num_packs)))),
        tma_q(kp.tma_q.get_slice(0)),
        tma_k(kp.tma_k.get_slice(0)),
        tma_v(kp.tma_v.get_slice(0)),
        tQsQ(tma_q.partition_D(make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{}))),
        tKsK(tma_k.partition_D(make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{}))),
        tVsV(tma_v.partition_D(make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutVt{}))) {}

  // Tile t of a paged call's unit w into stage s of K (kIsV false) or V: key j of sequence b is
  // cache row paged_key_row(p, b, j) (seqlen.h; the page clamped), and a run of kPagedRun keys
  // from a multiple of kPagedRun lies on one page (plan: page_size is a multiple of it), so lane
  // r looks up run r's first row once and the others take it by shuffle. Keys at or past the
  // unit's key_end are zero-filled and never read: no page past the sequence's keys is touched.
  // This warp's 16-byte chunks: every kProducerWarps-th group of 32.
  template <bool kIsV>
  __device__ void load_tile_paged(const Unit& w, int t, int s) {
    constexpr int kChunks = kHeadDim / 8;
    constexpr int kRuns = kBlockN / cuda::kPagedRun;
    static_assert(kBlockN % cuda::kPagedRun == 0 && kRuns <= 32, "a tile's runs, one per lane");
    static_assert(kBlockN * kChunks % (32 * kProducerWarps) == 0, "every lane takes each shuffle");
    const AttentionParams& p = kp.p;
    const int lane = threadIdx.x % 32, key0 = t * kBlockN, g = w.h / group;
    long long run_row = 0;  // cache row of run `lane`'s first key
    if (lane < kRuns && key0 + lane * cuda::kPagedRun < w.key_end)
      run_row = paged_key_row(p, w.b, key0 + lane * cuda::kPagedRun);
    const Element* base = static_cast<const Element*>(kIsV ? p.v : p.k) + g * (kIsV ? p.v_head_stride : p.k_head_stride);
    const int64_t row_stride = kIsV ? p.v_row_stride : p.k_row_stride;
    const int dim = int(kIsV ? p.head_dim_v : p.head_dim);
    for (int idx = warp * 32 + lane; idx < kBlockN * kChunks; idx += 32 * kProducerWarps) {
      const int i = idx / kChunks, col = idx % kChunks * 8;
      const long long row = __shfl_sync(0xffffffff, run_row, i / cuda::kPagedRun) + i % cuda::kPagedRun;
      const bool real = key0 + i < w.key_end && col < dim;
      void* dst = kIsV ? static_cast<void*>(&sVt()(col, i, s)) : static_cast<void*>(&sK()(i, col, s));
      cp_async_16(dst, real ? base + row * row_stride + col : base, real);
    }
    paged_commit.commit(kIsV ? &ss.full_v[s] : &ss.full_k[s]);
  }

  __device__ __forceinline__ auto sK() const {
    return make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
  }
  __device__ __forceinline__ auto sVt() const {
    return make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutVt{});
  }

  // Tile t of unit w (keys [t * kBlockN, +kBlockN)) into stage s of K (kIsV false) or V.
  template <bool kIsV>
  __device__ void load_tile(const Unit& w, int t, int s) {
    if constexpr (kPaged) return load_tile_paged<kIsV>(w, t, s);
    if (!leader) return;
    const int g = w.h / group;  // the kv head
    if constexpr (kIsV) {
      TxBarrier::arrive_and_expect_tx(&ss.full_v[s], Tr::kBytesKV);
      Tensor gV = local_tile(domain_offset(make_coord(0, w.k_start), mVt(_, _, g, w.pack)),
                             Shape<Int<kHeadDim>, Int<kBlockN>>{}, make_coord(0, t));
      copy(kp.tma_v.with(ss.full_v[s]), tma_v.partition_S(gV), tVsV(_, _, _, s));
    } else {
      TxBarrier::arrive_and_expect_tx(&ss.full_k[s], Tr::kBytesKV);
      Tensor gK = local_tile(domain_offset(make_coord(w.k_start, 0), mK(_, _, g, w.pack)),
                             Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(t, 0));
      copy(kp.tma_k.with(ss.full_k[s]), tma_k.partition_S(gK), tKsK(_, _, _, s));
    }
  }

  // The Q tile of a pack-GQA unit (w.heads > 1), each tile row's query row and head from
  // Unit::row_head; 16-byte cp.async chunks (all lanes, 2 rows per pass), zero-filled past the
  // unit's rows and past head_dim (as TMA fills them), into the same swizzled layout TMA
  // writes. Completed by finish_q_packed.
  __device__ void load_q_packed(const Unit& w) const {
    constexpr int kChunks = kHeadDim / 8;
    const AttentionParams& p = kp.p;
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
    const Element* q = static_cast<const Element*>(p.q) + int64_t(w.pack) * p.q_batch_stride +
                       int64_t(w.q_start) * p.q_row_stride + int64_t(w.h) * p.q_head_stride;
    const int64_t row0 = int64_t(w.m_block) * kBlockM;
    for (int idx = threadIdx.x % 32; idx < kBlockM * kChunks; idx += 32) {
      const int i = idx / kChunks, col = idx % kChunks * 8;
      const bool real = i < w.rows && col < p.head_dim;
      const Unit::RowHead at = w.row_head(row0 + i);
      cp_async_16(&sQ(i, col), real ? q + at.row * p.q_row_stride + at.dh * p.q_head_stride + col : q, real);
    }
  }
  // The packed Q tile has landed: made visible to wgmma (the async proxy), then full_q. (A
  // paged call's tiles are never in flight with it: the padded batch never packs.)
  __device__ void finish_q_packed() const {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    if (leader) Barrier::arrive(&ss.full_q);
  }

  // The copies of unit w (n_tiles > 0), by every producer warp that runs (warp 0 alone unless
  // paged: then all kProducerWarps, warp 0 also loading Q). pipe: the producer's place in the K
  // and V rings; q_iter: the Q tiles loaded so far. (An L2 prefetch of the tiles 1-2 ahead of
  // these loads made mixed-serve 6-10% slower: benchmarks/NOTES.md, session 2026-12-07 m.)
  __device__ __forceinline__ void load(const Unit& w, PipelineState<Tr::kStages>& pipe, int& q_iter) {
    // Q, once the consumers are done with the previous unit's.
    const bool q_warp = !kPaged || warp == 0;  // only warp 0 runs unless paged
    if (q_warp) {
      Barrier::wait(&ss.empty_q, (q_iter & 1) ^ 1);
      if (w.heads > 1) {
        load_q_packed(w);
      } else if (leader) {
        TxBarrier::arrive_and_expect_tx(&ss.full_q, Tr::kBytesQ);
        Tensor gQ = local_tile(domain_offset(make_coord(w.q_start, 0), mQ(_, _, w.h, w.pack)),
                               Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(w.m_block, 0));
        copy(kp.tma_q.with(ss.full_q), tma_q.partition_S(gQ), tQsQ);
      }
    }
    JV_FWD_TRACE(trace_mark(trace, kTraceQIssued);)
    ++q_iter;
    // K[t] then V[t + 1] (the consumers use V one step behind K), from the last tile down to
    // t_begin; a packed Q is completed after the first K copy is on its way.
    int t = w.n_tiles - 1;
    Barrier::wait(&ss.empty_k[pipe.stage], pipe.phase ^ 1);
    load_tile<false>(w, t, pipe.stage);
    if (q_warp && w.heads > 1) finish_q_packed();
    for (; t > w.t_begin; --t) {
      const int stage_v = pipe.stage, phase_v = pipe.phase;
      pipe.advance();
      Barrier::wait(&ss.empty_k[pipe.stage], pipe.phase ^ 1);
      load_tile<false>(w, t - 1, pipe.stage);
      Barrier::wait(&ss.empty_v[stage_v], phase_v ^ 1);
      load_tile<true>(w, t, stage_v);
    }
    Barrier::wait(&ss.empty_v[pipe.stage], pipe.phase ^ 1);
    load_tile<true>(w, w.t_begin, pipe.stage);
    pipe.advance();
    if constexpr (kPaged) paged_commit.flush();  // the consumers finish the unit before the next Q loads
  }
};

}  // namespace jax_varlen::cuda::sm90
