// Producer role of the Hopper backward (bwd_sm90.cuh): warp 0 of warpgroup 0. Its lane 0 issues
// the TMA copies: K and V of the CTA's key block once (full_kv), then, for every step (query
// head h of the group, row block m that sees the block), Q[m] and dO[m] of head h into a
// kStages-deep ring on mbarriers (full / empty). All 32 lanes stage each step's lse (base 2) and
// delta rows in shared memory beside them (+inf and 0 past the sequence's rows), so that the
// consumers read them while the step's first products run.
#pragma once

#include "cuda/sm90/bwd_traits.h"

namespace jax_varlen::cuda::sm90 {

// One lane of the producer warp; the TMA views are built where they are used.
template <typename Tr>
struct BwdLoad {
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;

  const BwdKernelParams<Tr>& kp;
  BwdSharedStorage<Tr>& ss;
  int lane;
  bool leader;  // lane 0: the TMA copies and their barriers' arrivals

  __device__ __forceinline__ BwdLoad(const BwdKernelParams<Tr>& kp, BwdSharedStorage<Tr>& ss)
      : kp(kp), ss(ss), lane(threadIdx.x % 32), leader(threadIdx.x % 32 == 0) {}

  // K and V of the block (its rows [key0, key0 + kBlockN) of sequence b, kv head g) on full_kv.
  __device__ __forceinline__ void load_kv(const BwdBlock<kBlockM, kBlockN>& blk) const {
    if (!leader) return;
    const AttentionParams& p = kp.bp.fwd;
    const int rows_k = int(p.pack_rows_k), packs = int(p.num_packs);
    Tensor mK = kp.tma_k.get_tma_tensor(make_shape(rows_k, int(p.head_dim), int(p.kv_num_heads), packs));
    Tensor mV = kp.tma_v.get_tma_tensor(make_shape(rows_k, int(p.head_dim_v), int(p.kv_num_heads), packs));
    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutK{});
    auto at_k = [&](auto m) { return domain_offset(make_coord(blk.k_start, 0), m); };  // b's rows
    auto tma_k = kp.tma_k.get_slice(0);
    auto tma_v = kp.tma_v.get_slice(0);
    using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
    TxBarrier::arrive_and_expect_tx(&ss.full_kv, 2 * Tr::kBytesKV);
    copy(kp.tma_k.with(ss.full_kv),
         tma_k.partition_S(local_tile(at_k(mK(_, _, blk.g, blk.pack)), TileKV{}, make_coord(blk.n_block, 0))),
         tma_k.partition_D(sK(_, _, 0)));
    copy(kp.tma_v.with(ss.full_kv),
         tma_v.partition_S(local_tile(at_k(mV(_, _, blk.g, blk.pack)), TileKV{}, make_coord(blk.n_block, 0))),
         tma_v.partition_D(sV(_, _, 0)));
  }

  // Every step of the block, in the consumers' order (heads of the group, then row blocks).
  __device__ __forceinline__ void load_steps(const BwdBlock<kBlockM, kBlockN>& blk, PipelineState<Tr::kStages>& pipe) const {
    const AttentionParams& p = kp.bp.fwd;
    const int rows_q = int(p.pack_rows_q), packs = int(p.num_packs);
    Tensor mQ = kp.tma_q.get_tma_tensor(make_shape(rows_q, int(p.head_dim), int(p.num_heads), packs));
    Tensor mdO = kp.tma_d_out.get_tma_tensor(make_shape(rows_q, int(p.head_dim_v), int(p.num_heads), packs));
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(ss.d_out.data()), typename Tr::SmemLayoutQ{});
    auto at_q = [&](auto m) { return domain_offset(make_coord(blk.q_start, 0), m); };  // b's rows
    auto tma_q = kp.tma_q.get_slice(0);
    auto tma_do = kp.tma_d_out.get_slice(0);
    using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
    const float kLog2e = 1.4426950408889634f;
    for (int h = blk.h0; h < blk.h0 + blk.group; ++h) {
      const int64_t rows_h = blk.lse_index(p, h, 0);
      for (int m = blk.m_lo; m < blk.m_hi; ++m) {
        const int stage = pipe.stage;
        Barrier::wait(&ss.empty[stage], pipe.phase ^ 1);
#pragma unroll
        for (int r = lane; r < kBlockM; r += 32) {
          const int row = m * kBlockM + r;
          const bool real = row < blk.len_q;
          ss.lse2[stage][r] = real ? p.lse[rows_h + row] * kLog2e : INFINITY;
          ss.delta[stage][r] = real ? kp.bp.delta[rows_h + row] : 0.0f;
        }
        __syncwarp();
        if (leader) {
          TxBarrier::arrive_and_expect_tx(&ss.full[stage], 2 * Tr::kBytesQ);
          copy(kp.tma_q.with(ss.full[stage]),
               tma_q.partition_S(local_tile(at_q(mQ(_, _, h, blk.pack)), TileQ{}, make_coord(m, 0))),
               tma_q.partition_D(sQ(_, _, stage)));
          copy(kp.tma_d_out.with(ss.full[stage]),
               tma_do.partition_S(local_tile(at_q(mdO(_, _, h, blk.pack)), TileQ{}, make_coord(m, 0))),
               tma_do.partition_D(sdO(_, _, stage)));
        }
        pipe.advance();
      }
    }
  }
};

}  // namespace jax_varlen::cuda::sm90
