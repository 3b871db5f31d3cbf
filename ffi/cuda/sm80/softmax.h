// Online softmax on the mma.sync accumulator fragments of one 16-row tile (the m16n8 layout),
// used by the sm80 mainloop (sm80/mainloop.h). Scores live in base 2: z = s * scale * log2(e),
// or with softcap z = softcap * log2(e) * tanh(s * scale / softcap), so exp becomes one
// ex2.approx; the running max m is kept in those base-2 units.
#pragma once

#include <cmath>

namespace jax_varlen::cuda {

__device__ __forceinline__ float exp2_approx(float x) {  // ex2.approx: exp2(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Scale factors of the scores (see above): z = z_scale * s, then z_cap * tanh(z) if softcap.
struct ScoreScale {
  float z_scale;
  float z_cap;
  __device__ ScoreScale(float scale, float softcap)
      : z_scale(softcap > 0.0f ? scale / softcap : scale * 1.4426950408889634f),
        z_cap(softcap * 1.4426950408889634f) {}
};

// s: [kNT][4] fragments of scores for 8 * kNT keys; this thread holds rows lane/4 (rr = 0)
// and lane/4 + 8 (rr = 1), element e of fragment nt at key offset nt*8 + 2*(lane%4) + e%2 and
// row rr = e / 2. Turns s into unnormalized probabilities exp2(z - m), and updates the running
// max m (quad-wide), this thread's partial row sums l, and rescales the accumulator o.
// When `masked` (uniform across the warp, true only for tiles at a row's limit), keys with
// masked_out(key_offset, rr) true get probability 0; the common unmasked tile runs no
// compare at all. The passes are separate so that each is a straight run of independent
// instructions.
template <bool kSoftcap, int kNT, int kDT, typename MaskedOut>
__device__ __forceinline__ void online_softmax(float (&s)[kNT][4], float (&m)[2], float (&l)[2],
                                               float (&o)[kDT][4], const ScoreScale& scale,
                                               bool masked, MaskedOut masked_out) {
  const int lane = threadIdx.x % 32;
  // With a positive scale and no softcap the scores stay raw and the scale rides in the exp's
  // FFMA, exp2(s * z_scale - m); the max is taken on raw scores, since scaling by z_scale > 0
  // is monotonic (also after rounding): max(s) * z_scale is exactly max(s * z_scale).
  // Otherwise (softcap, or a scale <= 0) the scores are transformed to base 2 first.
  float factor = scale.z_scale;
  if (kSoftcap || !(scale.z_scale > 0.0f)) {
    factor = 1.0f;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float z = s[nt][e] * scale.z_scale;
        if constexpr (kSoftcap) z = scale.z_cap * tanhf(z);
        s[nt][e] = z;
      }
  }
  if (masked) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (masked_out(nt * 8 + 2 * (lane & 3) + (e & 1), e / 2)) s[nt][e] = -INFINITY;
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * rr], s[nt][2 * rr + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    mx = fmaxf(m[rr], mx * factor);                   // base 2
    const float m_use = mx == -INFINITY ? 0.0f : mx;  // a row with nothing allowed yet
    const float alpha = exp2_approx(m[rr] - m_use);    // 0 while m[rr] is still -inf
    m[rr] = mx;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 2 * rr; e < 2 * rr + 2; ++e) {
        s[nt][e] = exp2_approx(fmaf(s[nt][e], factor, -m_use));
        sum += s[nt][e];
      }
    l[rr] = l[rr] * alpha + sum;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      o[dt][2 * rr] *= alpha;
      o[dt][2 * rr + 1] *= alpha;
    }
  }
}

}  // namespace jax_varlen::cuda
