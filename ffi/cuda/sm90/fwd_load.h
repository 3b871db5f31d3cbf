// Producer role of the Hopper forward (fwd_sm90.cuh): warp 0 of warpgroup 0 issues the TMA
// copies of Q, K and V (kStages-deep K and V rings on mbarriers), lane 0 alone; the Q tile of a
// pack-GQA unit (tile_scheduler.h), whose rows interleave query rows and heads, comes by cp.async
// from all 32 lanes instead (a TMA box cannot interleave them at a runtime group). Tiles past a
// unit's last allowed key are never loaded; the last tile, when partial, lands whole, and the
// consumers zero its V rows past the last key before using it (fwd_mma.h), while its K rows only
// feed scores that the mask replaces by -inf.
#pragma once

#include "cuda/sm90/common.h"
#include "cuda/sm90/tile_scheduler.h"

namespace jax_varlen::cuda::sm90 {

template <typename Tr> struct SharedStorage;  // fwd_sm90.cuh
template <typename Tr> struct KernelParams;   // fwd_sm90.cuh

// One thread of the producer warp. The constructor builds, once before the unit loop, the TMA
// views of the global tensors and the TMA partitions of the shared buffers; load() issues the
// copies of one unit.
template <typename Tr>
struct FwdLoad {
  using Element = typename Tr::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;

  template <typename Layout0>
  using SmemTensor = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), Layout0{}));
  template <typename Tma>
  using GmemTensor = decltype(std::declval<const Tma&>().get_tma_tensor(typename Tr::Shape4{}));
  template <typename Tma>
  using Slice = decltype(std::declval<const Tma&>().get_slice(0));
  template <typename Tma, typename Layout0>
  using SmemPart = decltype(std::declval<const Slice<Tma>&>().partition_D(std::declval<SmemTensor<Layout0>&>()));

  const KernelParams<Tr>& kp;
  SharedStorage<Tr>& ss;
  int group;    // query heads per kv head
  bool leader;  // lane 0
  GmemTensor<typename Tr::TmaQ> mQ;   // (rows of a pack, dim, heads, packs)
  GmemTensor<typename Tr::TmaK> mK;
  GmemTensor<typename Tr::TmaV> mVt;  // (dim, rows of a pack, heads, packs)
  Slice<typename Tr::TmaQ> tma_q;
  Slice<typename Tr::TmaK> tma_k;
  Slice<typename Tr::TmaV> tma_v;
  SmemPart<typename Tr::TmaQ, typename Tr::SmemLayoutQ> tQsQ;
  SmemPart<typename Tr::TmaK, typename Tr::SmemLayoutK> tKsK;   // (TMA, 1, 1, stages)
  SmemPart<typename Tr::TmaV, typename Tr::SmemLayoutVt> tVsV;  // (TMA, 1, 1, stages)

  __device__ __forceinline__ FwdLoad(const KernelParams<Tr>& kp, SharedStorage<Tr>& ss)
      : kp(kp), ss(ss), group(int(kp.p.num_heads / kp.p.kv_num_heads)), leader(threadIdx.x == 0),
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

  // Tile t of unit w (keys [t * kBlockN, +kBlockN)) into stage s of K (kIsV false) or V.
  template <bool kIsV>
  __device__ void load_tile(const Unit& w, int t, int s) const {
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

  // The Q tile of a pack-GQA unit (w.heads > 1): tile row i is query row (row0 + i) / heads of
  // head h + (row0 + i) % heads, row0 = m_block * kBlockM; 16-byte cp.async chunks (all lanes,
  // 2 rows per pass), zero-filled past the unit's rows and past head_dim (as TMA fills them),
  // into the same swizzled layout TMA writes. Completed by finish_q_packed.
  __device__ void load_q_packed(const Unit& w) const {
    constexpr int kChunks = kHeadDim / 8;
    const AttentionParams& p = kp.p;
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
    const Element* q = static_cast<const Element*>(p.q) + int64_t(w.pack) * p.q_batch_stride +
                       int64_t(w.q_start) * p.q_row_stride + int64_t(w.h) * p.q_head_stride;
    const int row0 = w.m_block * kBlockM;
    for (int idx = threadIdx.x % 32; idx < kBlockM * kChunks; idx += 32) {
      const int i = idx / kChunks, col = idx % kChunks * 8;
      const bool real = i < w.rows && col < p.head_dim;
      const int r = row0 + i;
      const Element* src = real ? q + int64_t(r / w.heads) * p.q_row_stride + (r % w.heads) * p.q_head_stride + col : q;
      const uint32_t dst = cute::cast_smem_ptr_to_uint(&sQ(i, col));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(real ? 16 : 0) : "memory");
    }
  }
  // The packed Q tile has landed: made visible to wgmma (the async proxy), then full_q.
  __device__ void finish_q_packed() const {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    if (leader) Barrier::arrive(&ss.full_q);
  }

  // The copies of unit w (n_tiles > 0). pipe: the producer's place in the K and V rings; q_iter:
  // the Q tiles loaded so far.
  __device__ __forceinline__ void load(const Unit& w, PipelineState<Tr::kStages>& pipe, int& q_iter) {
    // Q, once the consumers are done with the previous unit's.
    Barrier::wait(&ss.empty_q, (q_iter & 1) ^ 1);
    if (w.heads > 1) {
      load_q_packed(w);
    } else if (leader) {
      TxBarrier::arrive_and_expect_tx(&ss.full_q, Tr::kBytesQ);
      Tensor gQ = local_tile(domain_offset(make_coord(w.q_start, 0), mQ(_, _, w.h, w.pack)),
                             Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(w.m_block, 0));
      copy(kp.tma_q.with(ss.full_q), tma_q.partition_S(gQ), tQsQ);
    }
    ++q_iter;
    // K[t] then V[t + 1] (the consumers use V one step behind K), from the last tile down to
    // t_begin; a packed Q is completed after the first K copy is on its way.
    int t = w.n_tiles - 1;
    Barrier::wait(&ss.empty_k[pipe.stage], pipe.phase ^ 1);
    load_tile<false>(w, t, pipe.stage);
    if (w.heads > 1) finish_q_packed();
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
  }
};

}  // namespace jax_varlen::cuda::sm90
