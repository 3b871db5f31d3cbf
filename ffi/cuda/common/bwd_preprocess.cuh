// First kernel of every CUDA backward: delta_i = <d_out_i, out_i> - d_lse_i for each (sequence,
// query row, head), fp32, into BackwardParams::delta ([batch, num_heads, seqlen_q], lse's
// layout). The main kernels read it for dS = P * (dP - delta) (params.h has the math).
//
// A warp takes kPreprocessRows rows at a time; lane l owns elements [8 l, 8 l + 8) of each row
// (Dv <= kMaxHeadDim = 256 = 32 * 8). It issues every load of its rows first -- one 16-byte
// load per row and tensor where the rows are 16-byte chunks (kVec), element loads otherwise --
// so that enough bytes are in flight to stream O and dO at HBM speed (one element per lane and
// row kept ~2.3 TB/s: 232 us on d128-full). Each lane sums its 8 products in order, a
// butterfly sums the lanes; both variants add in the same order, so the result has the same
// bits whichever ran, and is deterministic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/convert.h"
#include "cuda/limits.h"
#include "seqlen.h"

namespace jax_varlen::cuda {

constexpr int kPreprocessWarps = 8;
constexpr int kPreprocessRows = 4;  // rows per warp whose loads are in flight together
static_assert(kMaxHeadDim <= 32 * 8, "a lane owns 8 elements of a row");

// 8 consecutive elements of a row as floats; those at or past `valid` are 0.
template <typename Elem, bool kVec>
__device__ __forceinline__ void load8(const Elem* src, int valid, float (&x)[8]) {
  if constexpr (kVec) {  // 16-bit elements, a whole 16-byte chunk (valid >= 8 or <= 0)
    if (valid > 0) {
      const uint4 raw = *reinterpret_cast<const uint4*>(src);
      const Elem* e = reinterpret_cast<const Elem*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = load_float(e + j);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = 0.0f;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = j < valid ? load_float(src + j) : 0.0f;
  }
}

// Grid (ceil(seqlen_q * num_heads / (kPreprocessWarps * kPreprocessRows)), batch); warp w of
// block x owns rows r = (x * kPreprocessWarps + w) * kPreprocessRows + [0, kPreprocessRows) of
// the sequence: query position r / num_heads, head r % num_heads.
template <typename Elem, bool kVec>
__global__ void __launch_bounds__(32 * kPreprocessWarps) bwd_preprocess_kernel(const __grid_constant__ BackwardParams bp) {
  const AttentionParams& p = bp.fwd;
  const SeqlenInfo seq(p, blockIdx.y);
  const int64_t rows = seq.seqlen_q * p.num_heads;
  const int64_t r0 = (int64_t(blockIdx.x) * kPreprocessWarps + threadIdx.x / 32) * kPreprocessRows;
  if (r0 >= rows) return;
  const int lane = threadIdx.x % 32;
  const int valid = int(p.head_dim_v) - 8 * lane;  // of this lane's 8 elements
  float o[kPreprocessRows][8], d_o[kPreprocessRows][8];
#pragma unroll
  for (int k = 0; k < kPreprocessRows; ++k) {
    const int64_t r = r0 + k;
    const int64_t at = r < rows ? seq.out_index(p, r / p.num_heads, r % p.num_heads) + 8 * lane : 0;
    const int v = r < rows ? valid : 0;
    load8<Elem, kVec>(static_cast<const Elem*>(p.out) + at, v, o[k]);
    load8<Elem, kVec>(static_cast<const Elem*>(bp.d_out) + at, v, d_o[k]);
  }
#pragma unroll
  for (int k = 0; k < kPreprocessRows; ++k) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) sum = fmaf(d_o[k][j], o[k][j], sum);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
    const int64_t r = r0 + k;
    if (lane == 0 && r < rows) {
      const int64_t at = seq.lse_index(p, r % p.num_heads, r / p.num_heads);
      bp.delta[at] = sum - bp.d_lse[at];
    }
  }
}

template <typename Elem>
cudaError_t run_bwd_preprocess(const BackwardParams& bp, cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  constexpr int64_t kRowsPerBlock = kPreprocessWarps * kPreprocessRows;
  const dim3 grid(unsigned((p.seqlen_q * p.num_heads + kRowsPerBlock - 1) / kRowsPerBlock), unsigned(p.batch));
  // 16-byte chunks: 16-bit elements, Dv and every stride of O (d_out shares them) multiples of
  // 8 elements, both buffers 16-byte aligned.
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const bool vec = sizeof(Elem) == 2 && p.head_dim_v % 8 == 0 && p.out_row_stride % 8 == 0 &&
                   p.out_head_stride % 8 == 0 && p.out_batch_stride % 8 == 0 && aligned(p.out) &&
                   aligned(bp.d_out);
  if constexpr (sizeof(Elem) == 2) {
    if (vec) {
      bwd_preprocess_kernel<Elem, true><<<grid, 32 * kPreprocessWarps, 0, stream>>>(bp);
      return cudaGetLastError();
    }
  }
  bwd_preprocess_kernel<Elem, false><<<grid, 32 * kPreprocessWarps, 0, stream>>>(bp);
  return cudaGetLastError();
}

}  // namespace jax_varlen::cuda
