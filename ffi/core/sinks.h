// How a forward kernel finishes a row: from its running max m and sum l over the allowed keys
// (l = sum_j exp(s_j - m), or exp2 in base-2 units), the factor that multiplies the row's
// accumulator and its lse (natural log), with or without an attention sink (params.h: sinks).
// One place for every kernel, CPU and CUDA. Host and device.
#pragma once

#include <math.h>

#include "core/params.h"

namespace jax_varlen {

JV_HOST_DEVICE float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}
JV_HOST_DEVICE float fast_log2(float x) {
#if defined(__CUDA_ARCH__)
  return __log2f(x);
#else
  return log2f(x);
#endif
}

struct RowFinish {
  float inv;  // out = accumulator * inv
  float lse;  // natural log
};

// A row with at least one allowed key. kBase2: m and the scores are in base-2 units (exp2), as
// in the tensor-core kernels; else natural (exp). sink: the row's head's sink logit (natural
// units), or nullptr. With a sink the denominator is l * exp(m - mm) + exp(sink - mm) for
// mm = max(m, sink) (no overflow whatever their gap); NaN in l (non-finite real data) reaches
// both results. Without one, inv = 1 / l and lse = m + log(l) (m * ln 2 + log(l) in base 2),
// as the kernels always computed it.
// (On the device the sink's terms use the hardware's approximate exp2 and log2, as the
// kernels' softmax does: fewer registers in epilogues that run at the register cap.)
template <bool kBase2>
JV_HOST_DEVICE RowFinish finish_row(float m, float l, const float* sink) {
  constexpr float kLn2 = 0.6931471805599453f, kLog2e = 1.4426950408889634f;
  if (sink == nullptr) return {1.0f / l, kBase2 ? m * kLn2 + logf(l) : m + logf(l)};
  // In base 2 either way: m2, s2 and the denominator d in units of exp2(mm).
  const float m2 = kBase2 ? m : m * kLog2e, s2 = *sink * kLog2e;
  const float mm = fmaxf(m2, s2);  // m = -inf (every score -inf): the sink alone
  const float a = fast_exp2(m2 - mm);
  const float d = l * a + fast_exp2(s2 - mm);
  return {a / d, (mm + fast_log2(d)) * kLn2};
}

// lse of a real row with no allowed key: -inf, or the sink's logit (its out is 0 either way).
JV_HOST_DEVICE float empty_row_lse(const AttentionParams& p, int64_t h) {
  return p.sinks == nullptr ? -INFINITY : p.sinks[h];
}

// The sink of head h for finish_row: nullptr without sinks.
JV_HOST_DEVICE const float* sink_of(const AttentionParams& p, int64_t h) {
  return p.sinks == nullptr ? nullptr : p.sinks + h;
}

}  // namespace jax_varlen
