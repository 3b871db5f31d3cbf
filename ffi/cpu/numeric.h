// Scalar helpers for the CPU loops: 16-bit float conversions (round to nearest even, as the
// GPU does) and an exp that the compiler can vectorize.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace jax_varlen::cpu {

// Storage types of the 16-bit formats; arithmetic always happens in float.
struct half_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) { return bits_float(uint32_t(x.bits) << 16); }
inline float to_float(half_t x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  const uint32_t exp = (x.bits >> 10) & 0x1fu;
  const uint32_t mant = x.bits & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float mag = float(mant) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

template <typename T> T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }
template <> inline bf16_t from_float<bf16_t>(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40u)};  // quiet nan
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{uint16_t(u >> 16)};
}
template <> inline half_t from_float<half_t>(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return half_t{uint16_t(sign | 0x7e00u)};  // nan
  if (mag >= 0x477ff000u) return half_t{uint16_t(sign | 0x7c00u)};  // >= 65520 rounds to inf
  if (mag < 0x38800000u) {  // below 2^-14: subnormal half, round(|f| * 2^24) to nearest even
    return half_t{uint16_t(sign | uint16_t(std::nearbyint(std::fabs(f) * 16777216.0f)))};
  }
  uint32_t h = ((((mag >> 23) - 112u) << 10) | ((mag >> 13) & 0x3ffu));
  const uint32_t rest = mag & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return half_t{uint16_t(sign | h)};
}

// exp(x) for x <= 0 (softmax numerators), about 2 ulp; 0 for x < -87.3 (and for -inf); NaN
// for NaN (non-finite real data propagates). Branch-free arithmetic so that loops over it
// vectorize; same bits on every run.
inline float exp_nonpositive(float x) {
  const float xc = x < -87.3f ? -87.3f : x;  // NaN stays NaN
  const float t = xc * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: rounds to an integer
  const float n = t - 12582912.0f;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;  // Cody-Waite: xc - n ln 2
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n from t's bits: t = 1.5 * 2^23 + n (n in [-126, 0]) has the bits 0x4B400000 + n, so no
  // float-to-int conversion (undefined for NaN) is needed; for NaN, p is NaN and so is the
  // product, whatever these bits are.
  const uint32_t pow2n = (float_bits(t) - 0x4B400000u + 127u) << 23;
  const float result = p * bits_float(pow2n);
  return x < -87.3f ? 0.0f : result;
}

}  // namespace jax_varlen::cpu
