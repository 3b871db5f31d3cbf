// The Hopper forward's online softmax, used by its mainloop (fwd_mma.h) and its epilogue
// (fwd_epilogue.h): one consumer thread's two rows of a score tile, in base 2 so that each exp is
// one ex2.approx.
#pragma once

#include "cuda/sm90/common.h"

namespace jax_varlen::cuda::sm90 {

// Online softmax of one consumer thread's rows. Scores live in base 2 (z = s * scale * log2 e,
// or softcap * log2 e * tanh(s * scale / softcap)), so exp is one ex2.approx; m is the running
// max in those units. The thread holds rows rr = 0, 1 (row, row + 8) of its warp; element
// 4j + 2rr + c of a fragment is (row rr, column 8j + 2 * (lane % 4) + c).
template <bool kSoftcap>
struct RowSoftmax {
  float m[2], l[2];  // running max (base 2) and this thread's partial row sums
  float z_scale, z_cap;

  __device__ RowSoftmax(float scale, float softcap)
      : z_scale(softcap > 0.0f ? scale / softcap : scale * 1.4426950408889634f),
        z_cap(softcap * 1.4426950408889634f) {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
  }
  // Whether the max may be taken on raw scores (no softcap, positive scale).
  __device__ __forceinline__ bool scaled_max() const { return !kSoftcap && z_scale > 0.0f; }

  // s [kNT * 4] raw scores of 8 * kNT keys -> unnormalized probabilities exp2(z - m). Elements i with
  // masked_out(i) get probability 0 when `masked` (uniform; only limit tiles). Returns in
  // alpha the factor the output rows must be multiplied by (0 while nothing was allowed yet).
  // kPlain: the caller knows that the tile needs no mask and that scaled_max() holds, so the
  // step has no branch (see FwdMma::mma for why that matters).
  template <int kNT, bool kPlain = false, typename MaskedOut>
  __device__ __forceinline__ void step(float* s, bool masked, MaskedOut masked_out, float (&alpha)[2]) {
    // With a positive scale and no softcap, the max is taken on raw scores and the scale rides in
    // the exp's FFMA (scaling by z_scale > 0 is monotonic, also after rounding).
    float factor = z_scale;
    if (!kPlain && !scaled_max()) {
      factor = 1.0f;
#pragma unroll
      for (int i = 0; i < kNT * 4; ++i) {
        float z = s[i] * z_scale;
        if constexpr (kSoftcap) z = z_cap * tanhf(z);
        s[i] = z;
      }
    }
    if (!kPlain && masked) {
#pragma unroll
      for (int i = 0; i < kNT * 4; ++i)
        if (masked_out(i)) s[i] = -INFINITY;
    }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kNT; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * rr], s[4 * j + 2 * rr + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      mx = fmaxf(m[rr], mx * factor);
      const float m_use = mx == -INFINITY ? 0.0f : mx;
      alpha[rr] = ex2_approx(m[rr] - m_use);
      m[rr] = mx;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& x = s[4 * j + 2 * rr + c];
          x = ex2_approx(fmaf(x, factor, -m_use));
          sum += x;
        }
      l[rr] = l[rr] * alpha[rr] + sum;
    }
  }
};

template <int kN>
__device__ __forceinline__ void rescale_rows(float* o, const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) o[i] *= alpha[(i / 2) & 1];
}

}  // namespace jax_varlen::cuda::sm90
