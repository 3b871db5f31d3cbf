// The Hopper forward's traits (fwd_sm90.cuh): tiles, shared-memory layouts and TMA views per
// (dtype, head-dim bucket, key tile), the shared storage, the kernel's parameters and the warp
// roles.
#pragma once

#include "cuda/sm90/common.h"
#include "cuda/sm90/fwd_trace.h"
#include "cuda/sm90/tile_scheduler.h"

namespace jax_varlen::cuda::sm90 {

// kBlockN_: keys per tile (plan/limits.h, fwd_sm90_block_n; the plan picks one per call).
template <typename Element_, int kHeadDim_, int kBlockN_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // bucket of max(D, Dv): 64, 128, 256
  static constexpr int kBlockM = sm90::kBlockM;  // query rows per unit, 64 per consumer warpgroup
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = 2;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kConsumerThreads = kWarpgroupThreads * kConsumerWarpgroups;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kThreads = kWarpgroupThreads + kConsumerThreads;
  static constexpr int kProducerWarps = 4;  // warpgroup 0: warp 0 loads; all 4 gather a paged call's pages
  // 128 * producer + 256 * consumer registers <= the launch's 64512 (common.h, register_pool);
  // wider key tiles need the last 8.
  static constexpr int kProducerRegs = kBlockN > 128 ? 24 : 40;
  static constexpr int kConsumerRegs = kBlockN > 128 ? 240 : 232;
  static_assert(kWarpgroupThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= register_pool(kThreads),
                "setmaxnreg past the launch's registers deadlocks (common.h, register_pool)");
  // Whether lean kernels (idle warpgroups, unit hand-over) exist for these traits: plan/limits.h
  // decides, for the plan too (the others would spill inside the mainloop, benchmarks/NOTES.md).
  static constexpr bool kLeanKernels = ::jax_varlen::cuda::fwd_sm90_lean_kernels(kHeadDim, kBlockN);
  // Whether the unpaged kernels have the loop of plain tiles (FwdMma::mma; limits.h).
  static constexpr bool kPlainKernels = ::jax_varlen::cuda::fwd_sm90_plain_kernels(kHeadDim);
  // Batches up to this size are sorted heaviest-first (plan/limits.h).
  static constexpr int kMaxSortedBatch = ::jax_varlen::cuda::kFwdMaxSortedBatch;
  using Scheduler = TileScheduler<kBlockM, kBlockN, kMaxSortedBatch, kThreads>;
  // A last tile of at most kHalfN keys (the largest multiple of 16 <= kBlockN / 2) runs on
  // narrower products: 64 of 128, 80 of 176, 32 of 80.
  static constexpr int kHalfN = kBlockN / 2 / 16 * 16;

  using TileQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // S [M, N] = Q [M, D] K^T
  using TilePV = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;  // O [M, Dv] += P [M, N] V
  using AtomLayout = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;  // warpgroups split M
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileQK>(), AtomLayout{}));
  // S of a last tile of at most kHalfN keys (see the consumer).
  using TiledMmaQKHalf = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kHalfN>, Int<kHeadDim>>>(),
      AtomLayout{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TilePV, GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayout{}));

  // Q [kBlockM, kHeadDim] and K [kBlockN, kHeadDim] x stages, head dim contiguous (K-major);
  // V^T [kHeadDim, kBlockN] x stages, head dim contiguous (MN-major): V lands as it is in HBM.
  using SmemLayoutQ = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDim>>(),
      Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>(),
      Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutVt = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::MN, Element, Int<kHeadDim>, Int<kBlockN>>(),
      Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{}));

  // Global tensors as TMA sees them: (rows, head dim, heads, batch), head dim contiguous; V as
  // (head dim, rows, heads, batch) to match V^T.
  using Shape4 = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideRows = Stride<int64_t, _1, int64_t, int64_t>;
  using StrideCols = Stride<_1, int64_t, int64_t, int64_t>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), Shape4{}, StrideRows{}),
      SmemLayoutQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), Shape4{}, StrideRows{}),
      take<0, 2>(SmemLayoutK{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), Shape4{}, StrideCols{}),
      take<0, 2>(SmemLayoutVt{}), Shape<Int<kHeadDim>, Int<kBlockN>>{}, _1{}));

  // Whether the epilogue stages O through shared memory (fwd_epilogue.h, store_staged: each warp
  // its 16 rows, 64 columns at a time, in a 2 KB slab of its own): where the slabs fit beside Q
  // and the K/V stages -- d64 and d128 (the 176-key tiles fill the 227 KB exactly), not d256.
  static constexpr bool kStagedO = kHeadDim <= 128;
  static constexpr int kOutSlabCols = 64;  // columns per slab: 128-byte rows

  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);  // one K or V tile
};

// The epilogue's O slabs where Tr::kStagedO, one [16, kOutSlabCols] per consumer warp (an empty
// base otherwise: no byte of shared memory).
template <typename Tr, bool = Tr::kStagedO>
struct FwdOutStorage {};
template <typename Tr>
struct FwdOutStorage<Tr, true> {
  cute::array_aligned<typename Tr::Element, Tr::kConsumerWarps * 16 * Tr::kOutSlabCols, 1024> o;
};

// Shared memory. Every tile buffer is a multiple of 1 KB and 1 KB aligned (the 128-byte
// swizzle repeats every 1 KB, and TMA and wgmma agree on it only from an aligned base).
template <typename Tr>
struct alignas(1024) FwdSharedStorage : FwdOutStorage<Tr> {
  cute::array_aligned<typename Tr::Element, cosize_v<typename Tr::SmemLayoutQ>, 1024> q;
  cute::array_aligned<typename Tr::Element, cosize_v<typename Tr::SmemLayoutK>, 1024> k;
  cute::array_aligned<typename Tr::Element, cosize_v<typename Tr::SmemLayoutVt>, 1024> v;
  uint64_t full_k[Tr::kStages], full_v[Tr::kStages];    // producer -> consumers: tile landed
  uint64_t empty_k[Tr::kStages], empty_v[Tr::kStages];  // consumers -> producer: stage free
  uint64_t full_q, empty_q;
  UnitQueue units;  // dynamic units (unit_queue.h): the producer hands them to the consumers
  typename Tr::Scheduler::SharedStorage sched;  // the batch's heaviest-first order
  Unit lean_unit[2];  // lean units (UnitHandover): the units themselves, decoded by the producer
};

template <typename Tr>
struct FwdKernelParams {
  typename Tr::TmaQ tma_q;
  typename Tr::TmaK tma_k;
  typename Tr::TmaV tma_v;
  AttentionParams p;
  int num_m_blocks;  // ceil(seqlen_q / kBlockM)
  int num_units;     // batch * num_heads * num_m_blocks: the list's slots (tile_scheduler.h)
  JV_FWD_TRACE(int64_t* trace;)  // fwd_trace.h: a profiling build's unit trace
};

// Thread roles: warpgroup 0 is the producer's -- its warp 0 loads (fwd_load.h; all four warps
// gather a paged call's pages by cp.async), its warps 1-3 otherwise fill (zero the packed
// layout's unowned query rows, then exit) --, warpgroups 1 and 2 are the consumers (fwd_mma.h).
enum class FwdRole { kProducer, kFill, kConsumer };
template <bool kPaged>
__device__ __forceinline__ FwdRole fwd_role() {
  if (threadIdx.x >= kWarpgroupThreads) return FwdRole::kConsumer;
  return kPaged || threadIdx.x < 32 ? FwdRole::kProducer : FwdRole::kFill;
}

}  // namespace jax_varlen::cuda::sm90
