// First kernel of every CUDA backward: delta_i = <d_out_i, out_i> - d_lse_i for each (sequence,
// query row, head), fp32, into BackwardParams::delta ([batch, num_heads, seqlen_q], lse's
// layout). The main kernels read it for dS = P * (dP - delta) (params.h has the math).
// One warp per row: lane l adds dims l, l + 32, ... and a butterfly sum gives every lane the same
// bits, so the result is deterministic.
#pragma once

#include <cuda_runtime.h>

#include "cuda/portable/convert.h"
#include "core/seqlen.h"

namespace jax_varlen::cuda {

constexpr int kPreprocessWarps = 8;

// Grid (ceil(seqlen_q * num_heads / kPreprocessWarps), batch); warp w of block x owns row
// r = x * kPreprocessWarps + w of the sequence: query position r / num_heads, head r % num_heads.
template <typename Elem>
__global__ void __launch_bounds__(32 * kPreprocessWarps) bwd_preprocess_kernel(const __grid_constant__ BackwardParams bp) {
  const AttentionParams& p = bp.fwd;
  const SeqlenInfo seq(p, blockIdx.y);
  const int64_t r = int64_t(blockIdx.x) * kPreprocessWarps + threadIdx.x / 32;
  if (r >= seq.seqlen_q * p.num_heads) return;
  const int64_t i = r / p.num_heads, h = r % p.num_heads;
  const int lane = threadIdx.x % 32;
  const Elem* o = static_cast<const Elem*>(p.out) + seq.out_index(p, i, h);
  const Elem* d_o = static_cast<const Elem*>(bp.d_out) + seq.out_index(p, i, h);
  float sum = 0.0f;
  for (int64_t e = lane; e < p.head_dim_v; e += 32) sum += load_float(d_o + e) * load_float(o + e);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
  if (lane == 0) {
    const int64_t at = seq.lse_index(p, h, i);
    bp.delta[at] = sum - bp.d_lse[at];
  }
}

template <typename Elem>
cudaError_t run_bwd_preprocess(const BackwardParams& bp, cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  const dim3 grid(unsigned((p.seqlen_q * p.num_heads + kPreprocessWarps - 1) / kPreprocessWarps), unsigned(p.batch));
  bwd_preprocess_kernel<Elem><<<grid, 32 * kPreprocessWarps, 0, stream>>>(bp);
  return cudaGetLastError();
}

}  // namespace jax_varlen::cuda
