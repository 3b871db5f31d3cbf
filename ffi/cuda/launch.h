// Entry points of the CUDA kernels, one instantiation per (dtype, head-dim bucket); each lives
// in a one-line .cu file that CMake generates (cmake/cuda.cmake), so they compile in parallel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "params.h"

namespace jax_varlen::cuda {

// Head-dim buckets of the tensor-core kernel: max(D, Dv) rounds up to one of these.
constexpr int kHeadDimBuckets[] = {64, 128, 256};

template <typename Elem, int kHeadDim>
cudaError_t run_fwd_tc(const AttentionParams& p, cudaStream_t stream);

// Split-KV decode path (p.split_keys > 0): partials into p.workspace, then a merge kernel.
template <typename Elem, int kHeadDim>
cudaError_t run_fwd_split(const AttentionParams& p, cudaStream_t stream);

template <typename Elem>
cudaError_t run_fwd_simt(const AttentionParams& p, cudaStream_t stream);

namespace sm90 {
// Hopper path (sm_90a only, ffi/cuda/sm90/): TMA + wgmma, warp-specialized, persistent. Built
// when CMake finds the CUTLASS headers and sm_90a is among the targets (JAX_VARLEN_WITH_SM90).
template <typename Elem, int kHeadDim>
cudaError_t run_fwd_sm90(const AttentionParams& p, cudaStream_t stream);
}  // namespace sm90

// Picks the kernel for p on the current device and launches it on stream.
cudaError_t run_fwd(const AttentionParams& p, cudaStream_t stream);

}  // namespace jax_varlen::cuda
