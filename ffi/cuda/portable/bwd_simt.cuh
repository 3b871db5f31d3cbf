// Portable backward for what the tensor-core backward does not take: float32 (exact fp32, no
// TF32), head sizes that are not a multiple of 8, unaligned buffers. Two kernels after the
// preprocess (portable/bwd_preprocess.cuh wrote delta), each output element written by one warp
// in a fixed order, so the gradients are deterministic:
//   dQ:    one warp per packed query row (block_info.h), walking its allowed keys;
//   dK/dV: one warp per (key, kv head, sequence), walking the query rows (of every head of
//          the group) that see the key; keys at or past n_b get zeros and read nothing.
// Lane l holds dims l, l + 32, ... of the row vectors; dot products are butterfly sums.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "cuda/portable/convert.h"
#include "plan/limits.h"
#include "core/seqlen.h"

namespace jax_varlen::cuda::portable {

constexpr int kBwdSimtWarps = 4;
constexpr int kBwdSimtPerLane = kMaxHeadDim / 32;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffff, x, off);
  return x;
}

// P_ij and dS_ij / scale-free of one allowed pair from the raw dot product <q_i, k_j>, the row's
// lse and delta, and dp = <d_out_i, v_j> (params.h).
struct PairGrad {
  float p, ds;
  __device__ PairGrad(float dot, float dp, float lse, float delta, float scale, float softcap) {
    float s = dot * scale, dcap = 1.0f;
    if (softcap > 0.0f) {
      const float t = tanhf(s / softcap);
      s = softcap * t;
      dcap = 1.0f - t * t;
    }
    p = expf(s - lse);
    ds = p * (dp - delta) * dcap;
  }
};

// Grid (ceil(seqlen_q * group / kBwdSimtWarps), kv_num_heads, batch).
template <typename Elem>
__global__ void __launch_bounds__(32 * kBwdSimtWarps) bwd_dq_simt_kernel(const __grid_constant__ BackwardParams bp) {
  const AttentionParams& p = bp.fwd;
  const int64_t g = blockIdx.y, group = p.num_heads / p.kv_num_heads;
  const int64_t r = int64_t(blockIdx.x) * kBwdSimtWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const SeqlenInfo seq(p, blockIdx.z);
  if (r >= seq.seqlen_q * group) return;
  const int64_t i = r / group, h = g * group + r % group;
  const Range keys = key_range(p.mask(), i, seq.seqlen_k, seq.seqlen_q);
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  const Elem* q = static_cast<const Elem*>(p.q) + seq.q_index(p, i, h);
  const Elem* d_o = static_cast<const Elem*>(bp.d_out) + seq.out_index(p, i, h);
  const Elem* k = static_cast<const Elem*>(p.k) + seq.k_index(p, 0, g);
  const Elem* v = static_cast<const Elem*>(p.v) + seq.v_index(p, 0, g);
  float qf[kBwdSimtPerLane], dof[kBwdSimtPerLane], dq[kBwdSimtPerLane];
#pragma unroll
  for (int c = 0; c < kBwdSimtPerLane; ++c) {
    const int64_t d = lane + 32 * c;
    qf[c] = d < D ? load_float(q + d) : 0.0f;
    dof[c] = d < Dv ? load_float(d_o + d) : 0.0f;
    dq[c] = 0.0f;
  }
  const float lse = keys.empty() ? 0.0f : p.lse[seq.lse_index(p, h, i)];
  const float delta = keys.empty() ? 0.0f : bp.delta[seq.lse_index(p, h, i)];
  for (int64_t j = keys.begin; j < keys.end; ++j) {
    const Elem* kj = k + j * p.k_row_stride;
    const Elem* vj = v + j * p.v_row_stride;
    float dot = 0.0f, dp = 0.0f;
#pragma unroll
    for (int c = 0; c < kBwdSimtPerLane; ++c) {
      if (lane + 32 * c < D) dot += qf[c] * load_float(kj + lane + 32 * c);
      if (lane + 32 * c < Dv) dp += dof[c] * load_float(vj + lane + 32 * c);
    }
    const PairGrad pg(warp_sum(dot), warp_sum(dp), lse, delta, p.scale, p.softcap);
#pragma unroll
    for (int c = 0; c < kBwdSimtPerLane; ++c)
      if (lane + 32 * c < D) dq[c] += pg.ds * load_float(kj + lane + 32 * c);
  }
  Elem* out = static_cast<Elem*>(bp.d_q) + seq.q_index(p, i, h);
#pragma unroll
  for (int c = 0; c < kBwdSimtPerLane; ++c)
    if (lane + 32 * c < D) out[lane + 32 * c] = store_float<Elem>(dq[c] * p.scale);
}

// Grid (ceil(seqlen_k / kBwdSimtWarps), kv_num_heads, batch): warp w of block x owns key
// j = x * kBwdSimtWarps + w of kv head blockIdx.y.
template <typename Elem>
__global__ void __launch_bounds__(32 * kBwdSimtWarps) bwd_dkdv_simt_kernel(const __grid_constant__ BackwardParams bp) {
  const AttentionParams& p = bp.fwd;
  const int64_t g = blockIdx.y, group = p.num_heads / p.kv_num_heads;
  const int64_t j = int64_t(blockIdx.x) * kBwdSimtWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const SeqlenInfo seq(p, blockIdx.z);
  if (j >= seq.k_rows) return;  // past the sequence's key rows (padded: Skv)
  const int64_t D = p.head_dim, Dv = p.head_dim_v, n = seq.seqlen_k, Sq = seq.seqlen_q;
  float kf[kBwdSimtPerLane], vf[kBwdSimtPerLane], dk[kBwdSimtPerLane], dv[kBwdSimtPerLane];
  const Elem* k = static_cast<const Elem*>(p.k) + seq.k_index(p, j, g);
  const Elem* v = static_cast<const Elem*>(p.v) + seq.v_index(p, j, g);
#pragma unroll
  for (int c = 0; c < kBwdSimtPerLane; ++c) {
    const int64_t d = lane + 32 * c;
    kf[c] = j < n && d < D ? load_float(k + d) : 0.0f;  // padded keys are never read
    vf[c] = j < n && d < Dv ? load_float(v + d) : 0.0f;
    dk[c] = dv[c] = 0.0f;
  }
  // Query rows that see key j (none for a padded key, j >= n).
  const Range rows = row_range(p.mask(), j, j + 1, n, Sq);
  for (int64_t h = g * group; h < (g + 1) * group; ++h)
    for (int64_t i = rows.begin; i < rows.end; ++i) {
      const Elem* q = static_cast<const Elem*>(p.q) + seq.q_index(p, i, h);
      const Elem* d_o = static_cast<const Elem*>(bp.d_out) + seq.out_index(p, i, h);
      float dot = 0.0f, dp = 0.0f;
#pragma unroll
      for (int c = 0; c < kBwdSimtPerLane; ++c) {
        if (lane + 32 * c < D) dot += kf[c] * load_float(q + lane + 32 * c);
        if (lane + 32 * c < Dv) dp += vf[c] * load_float(d_o + lane + 32 * c);
      }
      const int64_t at = seq.lse_index(p, h, i);
      const PairGrad pg(warp_sum(dot), warp_sum(dp), p.lse[at], bp.delta[at], p.scale, p.softcap);
#pragma unroll
      for (int c = 0; c < kBwdSimtPerLane; ++c) {
        if (lane + 32 * c < D) dk[c] += pg.ds * load_float(q + lane + 32 * c);
        if (lane + 32 * c < Dv) dv[c] += pg.p * load_float(d_o + lane + 32 * c);
      }
    }
  Elem* dk_out = static_cast<Elem*>(bp.d_k) + seq.k_index(p, j, g);
  Elem* dv_out = static_cast<Elem*>(bp.d_v) + seq.v_index(p, j, g);
#pragma unroll
  for (int c = 0; c < kBwdSimtPerLane; ++c) {
    if (lane + 32 * c < D) dk_out[lane + 32 * c] = store_float<Elem>(dk[c] * p.scale);
    if (lane + 32 * c < Dv) dv_out[lane + 32 * c] = store_float<Elem>(dv[c]);
  }
}

template <typename Elem>
cudaError_t run_bwd_simt(const BackwardParams& bp, cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  const int64_t group = p.num_heads / p.kv_num_heads;
  const dim3 dq_grid(unsigned((p.seqlen_q * group + kBwdSimtWarps - 1) / kBwdSimtWarps), unsigned(p.kv_num_heads),
                     unsigned(p.batch));
  if (p.seqlen_q * group > 0) bwd_dq_simt_kernel<Elem><<<dq_grid, 32 * kBwdSimtWarps, 0, stream>>>(bp);
  if (p.seqlen_k > 0) {
    const dim3 kv_grid(unsigned((p.seqlen_k + kBwdSimtWarps - 1) / kBwdSimtWarps), unsigned(p.kv_num_heads),
                       unsigned(p.batch));
    bwd_dkdv_simt_kernel<Elem><<<kv_grid, 32 * kBwdSimtWarps, 0, stream>>>(bp);
  }
  return cudaGetLastError();
}

}  // namespace jax_varlen::cuda::portable
