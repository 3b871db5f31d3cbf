// Hopper backward (sm_90a): TMA loads, the five products on wgmma with fp32 accumulators, a
// producer warp, and a deterministic dQ that needs no separate pass and no float atomics.
//
// One CTA = (sequence b, kv head g, key block n of kBlockN = 128 keys; 64 at head dim 256) = 3
// warpgroups, by role (bwd_traits.h, BwdRole):
//   warpgroup 0, warp 0: the producer (bwd_load.h, BwdLoad). K and V of the block land once;
//     then, for every query head h of g's group and every row block m (kBlockM rows: 64 at
//     head-dim bucket 128, 128 at 64, limits.h) that sees the block, Q[m], dO[m], lse and delta
//     of head h land in a kStages-deep ring on mbarriers.
//   warpgroup 0, warp 1: the dQ writer (bwd_dq.h, BwdDqWriter): each step's dQ partial, added in
//     a fixed order into a float workspace that bwd_sm90_dq_kernel turns into d_q.
//   warpgroups 1 and 2: the consumers, 64 keys each: the mainloop (bwd_mma.h, BwdMma: S^T, dP^T,
//     P^T, dS^T, dV += P^T dO, dK += dS^T Q, the dQ partial dS K) and the epilogue
//     (bwd_epilogue.h, BwdEpilogue: dK and dV from registers). At head dim 256 (Tr::kWide,
//     bwd_mma_wide.h, BwdMmaWide) one computes S^T and P^T, the other dP^T and dS^T, and each
//     takes half of the head dim of dV, dK and dQ.
// setmaxnreg moves registers from the producer warpgroup to the consumers.
//
// The grid: one CTA per unit of the scheduler's key-block list (tile_scheduler.h, TileScheduler:
// the grid placement), blockIdx.x = (rank * kv_num_heads + g) * num_n_blocks + num_n_blocks - 1 -
// n, sequence b = seq_order[rank] (heaviest first, ranked before the launch: seq_order.cuh): the
// key blocks of one (b, g) pair side by side, descending -- the dQ order (bwd_dq.h) waits only on
// lower blockIdx.x -- so that
// co-resident blocks are mostly one pair's and read Q, dO and the dq_accum tiles they add into
// from L2 (measured: 1.12x on d128-full against a grid with the pairs fastest,
// benchmarks/NOTES.md); the cost is a short ripple along the order at the start.
//
// Both layouts (params.h): TMA sees (rows of a pack, dim, heads, packs), and a sequence's tiles
// start at its first row in the pack (SeqlenInfo). Packed, the rows past a sequence's end are
// the next sequence's (or the unowned tail): keys there are treated as padding (never written:
// the sequence owns no key row past its length), and query rows there are zeroed before use
// (bwd_mma.h). dq_accum holds a sequence's row blocks from slot (q_start + s * kBlockM) /
// kBlockM of its (pack, head) on (s: its index in the pack), so no two sequences share a slot
// (limits.h).
#pragma once

#include "cuda/sm90/bwd_dq.h"
#include "cuda/sm90/bwd_epilogue.h"
#include "cuda/sm90/bwd_load.h"
#include "cuda/sm90/bwd_mma.h"
#include "cuda/sm90/bwd_mma_wide.h"
#include "cuda/sm90/bwd_traits.h"
#include "cuda/sm90/seq_order.cuh"
#include "cuda/sm90/tile_scheduler.h"

namespace jax_varlen::cuda::sm90 {

template <typename Tr, bool kSoftcap>
__global__ void __launch_bounds__(Tr::kThreads, 1) bwd_sm90_kernel(const __grid_constant__ BwdKernelParams<Tr> kp) {
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<BwdSharedStorage<Tr>*>(smem_raw);
  const BackwardParams& bp = kp.bp;
  const AttentionParams& p = bp.fwd;
  using Barrier = cutlass::arch::ClusterBarrier;

  using Sched = typename Tr::Scheduler;
  BwdBlock<kBlockM, kBlockN> blk;
  {  // this CTA's unit of the key-block list (the grid placement, above)
    const KeyBlockUnit u = Sched::decode_key_block(p, bp.seq_order, kp.num_n_blocks, Sched::grid_unit());
    blk.locate(p, u.b);
    blk.own(p, u.g, u.n_block);
  }
  using Epilogue = BwdEpilogue<Tr>;
  const typename Epilogue::Dst dst = Epilogue::dst(p, bp, blk);
  if (!blk.has_work()) {  // zero gradients (its keys past n_b, or no row sees them)
    Epilogue::store_zeros(p, blk, dst);
    return;
  }

  if (threadIdx.x == 0) {
    Barrier::init(&ss.full_kv, 1);
#pragma unroll
    for (int s = 0; s < Tr::kStages; ++s) {
      Barrier::init(&ss.full[s], 1);
      Barrier::init(&ss.empty[s], Tr::kConsumerWarps);
    }
#pragma unroll
    for (int i = 0; i < (Tr::kDqStaged ? 2 * Tr::kDqBuffers : 0); ++i) {
      Barrier::init(&ss.full_dq[i / 2][i % 2], Tr::kConsumerWarps / 2);
      Barrier::init(&ss.empty_dq[i / 2][i % 2], 1);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const BwdRole role = bwd_role();
  if (role != BwdRole::kConsumer) {
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    if (role == BwdRole::kDqWriter) {
      BwdDqWriter<Tr>::run(kp, ss, blk);
    } else if (role == BwdRole::kProducer) {
      const BwdLoad<Tr> load(kp, ss);
      load.load_kv(blk);
      PipelineState<Tr::kStages> pipe;
      load.load_steps(blk, pipe);
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Tr::kConsumerRegs>();
  const std::conditional_t<Tr::kWide, BwdMmaWide<Tr, kSoftcap>, BwdMma<Tr, kSoftcap>> mainloop(kp, ss);
  Tensor tdVrdV = partition_fragment_C(typename Tr::TiledMmadKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tdKrdK = partition_fragment_C(typename Tr::TiledMmadKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(tdVrdV);
  clear(tdKrdK);
  PipelineState<Tr::kStages> pipe;
  mainloop.mma(blk, pipe, tdKrdK, tdVrdV);
  Epilogue::store(p, blk, dst, mainloop.ct, tdKrdK, tdVrdV);
}

template <typename Elem, int kHeadDim>
cudaError_t run_bwd_sm90(const BackwardParams& bp, cudaStream_t stream) {
  using Element = typename CutlassElem<Elem>::type;
  using Tr = BwdTraits<Element, kHeadDim>;
  const AttentionParams& p = bp.fwd;
  auto view = [](const void* ptr, int64_t rows, int64_t dim, int64_t heads, int64_t batch, int64_t row_stride,
                 int64_t head_stride, int64_t batch_stride) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                       make_shape(int(rows), int(dim), int(heads), int(batch)),
                       make_stride(row_stride, _1{}, head_stride, batch_stride));
  };
  // [packs, pack rows, heads, dim] (plan/plan.h: pack rows >= 1, TMA strides).
  auto mQ = view(p.q, p.pack_rows_q, p.head_dim, p.num_heads, p.num_packs, p.q_row_stride, p.q_head_stride,
                 p.q_batch_stride);
  auto mdO = view(bp.d_out, p.pack_rows_q, p.head_dim_v, p.num_heads, p.num_packs, p.out_row_stride,
                  p.out_head_stride, p.out_batch_stride);
  auto mK = view(p.k, p.pack_rows_k, p.head_dim, p.kv_num_heads, p.num_packs, p.k_row_stride, p.k_head_stride,
                 p.k_batch_stride);
  auto mV = view(p.v, p.pack_rows_k, p.head_dim_v, p.kv_num_heads, p.num_packs, p.v_row_stride, p.v_head_stride,
                 p.v_batch_stride);
  using LQ = decltype(take<0, 2>(typename Tr::SmemLayoutQ{}));
  using LK = decltype(take<0, 2>(typename Tr::SmemLayoutK{}));
  using TileQ = Shape<Int<Tr::kBlockM>, Int<kHeadDim>>;
  using TileK = Shape<Int<Tr::kBlockN>, Int<kHeadDim>>;
  BwdKernelParams<Tr> kp{make_tma_copy(SM90_TMA_LOAD{}, mQ, LQ{}, TileQ{}, _1{}),
                         make_tma_copy(SM90_TMA_LOAD{}, mdO, LQ{}, TileQ{}, _1{}),
                         make_tma_copy(SM90_TMA_LOAD{}, mK, LK{}, TileK{}, _1{}),
                         make_tma_copy(SM90_TMA_LOAD{}, mV, LK{}, TileK{}, _1{}),
                         bp, int((p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM),
                         int((p.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN),
                         int(bwd_dq_slots(p.pack_rows_q, p.pack_seqs, Tr::kBlockM))};
  const size_t sems = size_t(p.num_packs * p.num_heads * kp.num_slots) * sizeof(int);
  cudaError_t err = cudaMemsetAsync(bp.dq_semaphore, 0, sems, stream);
  if (err != cudaSuccess) return err;
  err = run_seq_order<typename Tr::Scheduler>(p, bp.seq_order, stream);
  if (err != cudaSuccess) return err;
  auto kernel = p.softcap > 0.0f ? bwd_sm90_kernel<Tr, true> : bwd_sm90_kernel<Tr, false>;
  constexpr size_t kSmem = sizeof(BwdSharedStorage<Tr>);
  static_assert(kSmem <= 232448, "the backward's shared memory exceeds sm_90's 227 KB");
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem));
  if (err != cudaSuccess) return err;
  const dim3 grid(unsigned(kp.num_n_blocks * p.batch * p.kv_num_heads));
  kernel<<<grid, Tr::kThreads, kSmem, stream>>>(kp);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t units = p.batch * p.num_heads * kp.num_m_blocks;
  bwd_sm90_dq_kernel<Tr><<<unsigned(units), Tr::kConsumerThreads, 0, stream>>>(bp, kp.num_m_blocks, kp.num_slots);
  return cudaGetLastError();
}

}  // namespace jax_varlen::cuda::sm90
