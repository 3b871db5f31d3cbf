// First kernel of every CUDA backward: delta_i = <d_out_i, out_i> - d_lse_i for each (sequence,
// query row, head), fp32, into BackwardParams::delta ([batch, num_heads, seqlen_q], lse's
// layout). The main kernels read it for dS = P * (dP - delta) (params.h has the math).
//
// It is a pure read of out and d_out (2 x rows x head_dim_v elements), so its floor is HBM
// bandwidth: on prefill-right-padded (16,466 rows x 32 heads x 128, bf16) 270 MB, ~63 us at
// 4.3 TB/s. A row is read in vectors of kVec elements (16 bytes where the row's alignment
// allows), `lanes` lanes per row (the row's vectors rounded up to a power of two, at most 32),
// several rows per warp, and each thread issues the loads of kPreprocessIters rows before it
// adds any of them. Every lane adds its own vectors' products in element order, then an xor
// butterfly over the row's lanes gives them all the same bits: the result depends only on the
// row and the vector width, which the host picks from the dtype, head_dim_v, the strides and
// the buffers' alignment (the same for a sequence alone or in any batch).
#pragma once

#include <cuda_runtime.h>

#include "cuda/portable/convert.h"
#include "core/seqlen.h"

namespace jax_varlen::cuda {

constexpr int kPreprocessWarps = 8;
constexpr int kPreprocessIters = 4;  // rows per thread whose loads are in flight together

// A row's split over a warp: `lanes` lanes (a power of two <= 32), each adding `per_lane`
// vectors (lane l of the row: vectors l, l + lanes, ...).
struct PreprocessSplit {
  int lanes_log2;
  int per_lane;
};

inline PreprocessSplit preprocess_split(int64_t vecs) {
  int lanes_log2 = 0;
  while (lanes_log2 < 5 && (int64_t(1) << lanes_log2) < vecs) ++lanes_log2;
  return {lanes_log2, int((vecs + (1 << lanes_log2) - 1) >> lanes_log2)};
}

template <typename Elem, int kVec>
struct alignas(sizeof(Elem) * kVec) PreprocessVec {
  Elem e[kVec];
};

// Grid (ceil(seqlen_q * num_heads / rows per block), batch), blockIdx.y = the sequence. Block x
// owns kPreprocessIters passes of kPreprocessWarps * (32 >> lanes_log2) consecutive rows r of
// the sequence (query position r / num_heads, head r % num_heads), from r0 on; rows past the
// sequence's seqlen_q * num_heads are not read.
template <typename Elem, int kVec>
__global__ void __launch_bounds__(32 * kPreprocessWarps)
    bwd_preprocess_kernel(const __grid_constant__ BackwardParams bp, const PreprocessSplit split) {
  using Vec = PreprocessVec<Elem, kVec>;
  const AttentionParams& p = bp.fwd;
  const SeqlenInfo seq(p, blockIdx.y);
  const int64_t rows = seq.seqlen_q * p.num_heads;
  const int rows_per_warp = 32 >> split.lanes_log2;
  const int rows_per_pass = kPreprocessWarps * rows_per_warp;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_pass * kPreprocessIters;
  if (r0 >= rows) return;  // the whole block is past the sequence's rows
  const int lane = threadIdx.x % 32, sub = lane & ((1 << split.lanes_log2) - 1);
  const int heads = int(p.num_heads), vecs = int(p.head_dim_v / kVec);
  const int64_t i0 = r0 / heads;  // the block's first row: (i0, h0)
  const int h0 = int(r0 - i0 * heads);
  const int local0 = threadIdx.x / 32 * rows_per_warp + (lane >> split.lanes_log2);
  int64_t i[kPreprocessIters];
  int h[kPreprocessIters];
  bool real[kPreprocessIters];
#pragma unroll
  for (int it = 0; it < kPreprocessIters; ++it) {
    const int local = h0 + local0 + it * rows_per_pass;  // from (i0, 0): small, 32-bit
    i[it] = i0 + local / heads;
    h[it] = local % heads;
    real[it] = r0 + (local - h0) < rows;
  }
  const Elem* out = static_cast<const Elem*>(p.out);
  const Elem* d_out = static_cast<const Elem*>(bp.d_out);
  float sum[kPreprocessIters] = {};
  for (int k = 0; k < split.per_lane; ++k) {
    const int v = sub + (k << split.lanes_log2);
    Vec o[kPreprocessIters], d_o[kPreprocessIters];
#pragma unroll
    for (int it = 0; it < kPreprocessIters; ++it) {  // every load first
      if (real[it] && v < vecs) {
        const int64_t at = seq.out_index(p, i[it], h[it]);
        o[it] = reinterpret_cast<const Vec*>(out + at)[v];
        d_o[it] = reinterpret_cast<const Vec*>(d_out + at)[v];
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) o[it].e[e] = d_o[it].e[e] = Elem(0.0f);
      }
    }
#pragma unroll
    for (int it = 0; it < kPreprocessIters; ++it)
#pragma unroll
      for (int e = 0; e < kVec; ++e) sum[it] += load_float(&d_o[it].e[e]) * load_float(&o[it].e[e]);
  }
#pragma unroll
  for (int it = 0; it < kPreprocessIters; ++it) {
    for (int off = (1 << split.lanes_log2) >> 1; off > 0; off >>= 1)
      sum[it] += __shfl_xor_sync(0xffffffff, sum[it], off);
    if (sub == 0 && real[it]) {
      const int64_t at = seq.lse_index(p, h[it], i[it]);
      bp.delta[at] = sum[it] - bp.d_lse[at];
    }
  }
}

// The widest vector (16 bytes down to one element) that divides head_dim_v and both strides of
// out (d_out shares them) and fits both buffers' alignment.
template <typename Elem, int kVec>
cudaError_t launch_bwd_preprocess(const BackwardParams& bp, cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  if constexpr (kVec > 1) {
    const bool fits = p.head_dim_v % kVec == 0 && p.out_row_stride % kVec == 0 && p.out_head_stride % kVec == 0 &&
                      reinterpret_cast<uintptr_t>(p.out) % (kVec * sizeof(Elem)) == 0 &&
                      reinterpret_cast<uintptr_t>(bp.d_out) % (kVec * sizeof(Elem)) == 0;
    if (!fits) return launch_bwd_preprocess<Elem, kVec / 2>(bp, stream);
  }
  const PreprocessSplit split = preprocess_split(p.head_dim_v / kVec);
  const int64_t rows_per_block = int64_t(kPreprocessWarps) * (32 >> split.lanes_log2) * kPreprocessIters;
  const dim3 grid(unsigned((p.seqlen_q * p.num_heads + rows_per_block - 1) / rows_per_block), unsigned(p.batch));
  bwd_preprocess_kernel<Elem, kVec><<<grid, 32 * kPreprocessWarps, 0, stream>>>(bp, split);
  return cudaGetLastError();
}

template <typename Elem>
cudaError_t run_bwd_preprocess(const BackwardParams& bp, cudaStream_t stream) {
  return launch_bwd_preprocess<Elem, int(16 / sizeof(Elem))>(bp, stream);
}

}  // namespace jax_varlen::cuda
