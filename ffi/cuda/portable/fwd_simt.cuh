// Portable forward for what the tensor-core kernel does not take: float32 inputs (exact fp32,
// no TF32), head sizes that are not a multiple of 8, and unaligned buffers. One warp owns one
// packed query row (see sm80/block_info.h); lane l holds dims l, l + 32, ... of q and of the
// output accumulator. Keys are visited in order; a butterfly sum gives every lane the same
// bits, so the result is deterministic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "cuda/portable/convert.h"
#include "plan/limits.h"
#include "core/seqlen.h"
#include "core/sinks.h"

namespace jax_varlen::cuda::portable {

constexpr int kSimtWarps = 4;
constexpr int kSimtPerLane = kMaxHeadDim / 32;  // dims of q and of the accumulator per lane

template <typename Elem>
__global__ void __launch_bounds__(32 * kSimtWarps) fwd_simt_kernel(const __grid_constant__ AttentionParams p) {
  const int64_t g = blockIdx.y;
  const int64_t group = p.num_heads / p.kv_num_heads;
  const int64_t r = int64_t(blockIdx.x) * kSimtWarps + threadIdx.x / 32;  // packed row
  const int lane = threadIdx.x % 32;
  const SeqlenInfo seq(p, blockIdx.z);
  if (r >= seq.seqlen_q * group) return;
  const int64_t i = r / group, h = g * group + r % group;
  const Range keys = key_range(p.mask(), i, seq.seqlen_k, seq.seqlen_q);
  const int64_t D = p.head_dim, Dv = p.head_dim_v;

  const Elem* q = static_cast<const Elem*>(p.q) + seq.q_index(p, i, h);
  const Elem* k = static_cast<const Elem*>(p.k) + seq.k_index(p, 0, g);
  const Elem* v = static_cast<const Elem*>(p.v) + seq.v_index(p, 0, g);
  float qf[kSimtPerLane], acc[kSimtPerLane];
#pragma unroll
  for (int c = 0; c < kSimtPerLane; ++c) {
    const int64_t d = lane + 32 * c;
    qf[c] = d < D ? load_float(q + d) : 0.0f;
    acc[c] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int64_t j = keys.begin; j < keys.end; ++j) {
    const Elem* kj = k + j * p.k_row_stride;
    const Elem* vj = v + j * p.v_row_stride;
    float dot = 0.0f;
#pragma unroll
    for (int c = 0; c < kSimtPerLane; ++c)
      if (lane + 32 * c < D) dot += qf[c] * load_float(kj + lane + 32 * c);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffff, dot, off);
    float s = dot * p.scale;
    if (p.softcap > 0.0f) s = p.softcap * tanhf(s / p.softcap);
    const float m_new = fmaxf(m, s);
    const float alpha = expf(m - m_new);  // 0 on the first key (m = -inf)
    const float pj = expf(s - m_new);
    l = l * alpha + pj;
    m = m_new;
#pragma unroll
    for (int c = 0; c < kSimtPerLane; ++c)
      if (lane + 32 * c < Dv) acc[c] = acc[c] * alpha + pj * load_float(vj + lane + 32 * c);
  }
  Elem* out = static_cast<Elem*>(p.out) + seq.out_index(p, i, h);
  // "No allowed key" is decided by the row's key range, never by l, so NaN/Inf in real data
  // propagates (SPEC: non-finite real data).
  const bool any = !keys.empty();
  const RowFinish fin = any ? finish_row</*kBase2=*/false>(m, l, sink_of(p, h)) : RowFinish{0.0f, empty_row_lse(p, h)};
#pragma unroll
  for (int c = 0; c < kSimtPerLane; ++c)
    if (lane + 32 * c < Dv) out[lane + 32 * c] = store_float<Elem>(acc[c] * fin.inv);
  if (lane == 0) p.lse[seq.lse_index(p, h, i)] = fin.lse;
}

template <typename Elem>
cudaError_t run_fwd_simt(const AttentionParams& p, cudaStream_t stream) {
  const int64_t group = p.num_heads / p.kv_num_heads;
  const dim3 grid(unsigned((p.seqlen_q * group + kSimtWarps - 1) / kSimtWarps), unsigned(p.kv_num_heads),
                  unsigned(p.batch));
  fwd_simt_kernel<Elem><<<grid, 32 * kSimtWarps, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_varlen::cuda::portable
