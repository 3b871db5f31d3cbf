// Pieces that the Hopper kernels (fwd_sm90.cuh, bwd_sm90.cuh) share: the CuTe/CUTLASS includes,
// dtype mapping, named barriers, ex2, the accumulator-to-A-operand register view, one wgmma
// issue helper, the place in a ring of pipeline stages, and the SM count.
#pragma once

// The 64xNx16 wgmma shapes with N not a multiple of 32 (N = 80 key tiles at head dim 256).
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "cuda/device_info.h"
#include "cuda/launch.h"
#include "core/seqlen.h"

namespace jax_varlen::cuda::sm90 {

using namespace cute;

// Threads of a warpgroup (the unit of wgmma, setmaxnreg and the kernels' roles).
constexpr int kWarpgroupThreads = cutlass::NumThreadsPerWarpGroup;

template <typename Elem> struct CutlassElem;
template <> struct CutlassElem<__half> { using type = cutlass::half_t; };
template <> struct CutlassElem<__nv_bfloat16> { using type = cutlass::bfloat16_t; };

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Arrives on the mbarrier at bar when pred holds (a warp's leader for a barrier counted per
// warp), as one predicated instruction: no branch. With `if (lane == 0) arrive` in the forward
// consumers' unit read (tile_scheduler.h, UnitQueue::read), ptxas put the lean d64 kernel's
// second wgmma wait ahead of its whole softmax; with this, the softmax's max runs under P V
// (SASS, benchmarks/NOTES.md, session 2026-12-06 i). Not in FwdMma::release: there the
// branch compiles to a predicated arrive already, and this form made the SASS worse.
__device__ __forceinline__ void arrive_if(uint64_t* bar, bool pred) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %1, 0;\n @p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(
          cute::cast_smem_ptr_to_uint(bar)),
      "r"(int(pred))
      : "memory");
}
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The registers setmaxnreg can hand out in a CTA of `threads` threads launched one per SM: the
// launch gives each thread 65536 / threads rounded down to a multiple of 8 (168 at 384 threads:
// a pool of 64512, not 64K), and a warpgroup's setmaxnreg.inc past the pool waits forever.
constexpr int register_pool(int threads) { return 65536 / threads / 8 * 8 * threads; }

// acc ((2, 2, N/8), 1, 1) fp32 of an m64nNk16 wgmma -> A operand ((2, 2, 2), 1, N/16) of the next
// one: the same registers in the same order (the element of row half h, column pair c, 8-column
// group j sits at index c + 2h + 4j in both), only regrouped by 16 columns.
template <typename Layout0>
__device__ __forceinline__ auto acc_to_a_layout(Layout0 acc) {
  auto l = logical_divide(get<0, 2>(acc), Tile<_2>{});
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(l)), get<1>(acc),
                     coalesce(make_layout(get<0, 1>(l), get<2>(acc))));
}

// Issues C (+)= A B on the warpgroup (no wait): every K step of the tiled MMA, then commit.
template <bool kZeroInit, typename Mma, typename TA, typename TB, typename TC>
__device__ __forceinline__ void wgmma_issue(Mma& mma, TA const& a, TB const& b, TC& c) {
  constexpr bool kRegsA = !cute::is_base_of<GMMA::DescriptorIterator, typename Mma::FrgTypeA>::value;
  if constexpr (kRegsA) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegsA) warpgroup_fence_operand(const_cast<TA&>(a));
}

// Where a kStages-deep ring of mbarrier-guarded buffers stands: the stage, and the parity of
// the phase its barriers are in. Producer and consumers each keep one and advance it alike.
// (The rings are raw ClusterBarriers rather than CUTLASS's PipelineTmaAsync: the forward's K
// and V stages have barriers of their own, so that K is released before P V and refilled under
// it; a paged call's stages fill by cp.async from four producer warps, one arrival each, where
// PipelineTmaAsync counts TMA transaction bytes; the consumers release per warp; and the
// arrives' exact form moved the schedule ptxas chose, see arrive_if.)
template <int kStages>
struct PipelineState {
  int stage = 0, phase = 0;
  __device__ void advance() {
    if (++stage == kStages) { stage = 0; phase ^= 1; }
  }
};

}  // namespace jax_varlen::cuda::sm90
