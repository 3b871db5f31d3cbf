// Entry points of the CUDA kernels, by architecture. Each (path, dtype, head-dim bucket) is one
// instantiation in a one-line .cu file that CMake generates (cmake/cuda.cmake), so they compile
// in parallel; dispatch.cu holds the one table that chooses among them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "core/params.h"
#include "plan/limits.h"
#include "cuda/launch_record.h"
#include "plan/plan.h"

namespace jax_varlen::cuda {

namespace sm80 {
// mma.sync/ldmatrix/cp.async kernels (sm_80+), Elem __half or __nv_bfloat16, kHeadDim a bucket
// (limits.h). One pass over the keys:
template <typename Elem, int kHeadDim>
cudaError_t run_fwd_tc(const AttentionParams& p, cudaStream_t stream);
// Split-KV decode path (p.split_keys > 0): partials into p.workspace, merged in the same kernel
// by each row block's last split block (fwd_combine.cuh, combine_row).
template <typename Elem, int kHeadDim>
cudaError_t run_fwd_split(const AttentionParams& p, cudaStream_t stream);
// Backward, after the preprocess (portable/bwd_preprocess.cuh) wrote bp.delta: dK/dV and dQ
// kernels (bwd_tc.cuh).
template <typename Elem, int kHeadDim>
cudaError_t run_bwd_tc(const BackwardParams& bp, cudaStream_t stream);
}  // namespace sm80

namespace portable {
// SIMT kernels (ffi/cuda/portable/; any sm, Elem float, __half or __nv_bfloat16, any head size
// up to kMaxHeadDim): exact fp32, odd head sizes, unaligned buffers. Forward (fwd_simt.cuh), and
// the backward's dK/dV and dQ kernels after the preprocess (bwd_simt.cuh).
template <typename Elem>
cudaError_t run_fwd_simt(const AttentionParams& p, cudaStream_t stream);
template <typename Elem>
cudaError_t run_bwd_simt(const BackwardParams& bp, cudaStream_t stream);
}  // namespace portable

namespace sm90 {
// Hopper one-pass path (sm_90a only, ffi/cuda/sm90/, its own object library), Elem __half or
// __nv_bfloat16, kHeadDim a bucket. dispatch.cu decides which calls it takes.
constexpr int kBlockM = kFwdSm90BlockM;  // query rows of one work unit, at every head size
template <typename Elem, int kHeadDim>
cudaError_t run_fwd_sm90(const AttentionParams& p, cudaStream_t stream);
// Hopper backward (bwd_sm90.cuh), after the preprocess, at every head-dim bucket (the plan
// takes the call, plan.h): one kernel, dQ summed in a fixed order through bp.dq_accum.
template <typename Elem, int kHeadDim>
cudaError_t run_bwd_sm90(const BackwardParams& bp, cudaStream_t stream);
}  // namespace sm90

// Compute capability major of the current device (read once per device; 0 if it cannot be read):
// the handlers plan with it.
int device_major();
// Launch the kernels of the plan's path (made for this call and device_major()) on stream, or
// the path the buffers' alignment leaves (dispatch.cu).
cudaError_t run_fwd(const AttentionParams& p, const Plan& plan, cudaStream_t stream);
cudaError_t run_bwd(const BackwardParams& bp, const Plan& plan, cudaStream_t stream);


}  // namespace jax_varlen::cuda
