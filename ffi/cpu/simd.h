// Eight-lane float vectors and the elementwise math of the CPU loops (exp, tanh) on them.
// Included only by the files that are compiled once per instruction set (attention_cpu.cc,
// backward_cpu.cc), so everything here lives in that copy's namespace (JV_CPU_ISA, e.g.
// jax_varlen::cpu::avx2) and the copies never mix at link time.
#pragma once

#include <cstdint>
#include <cstring>

namespace jax_varlen::cpu::JV_CPU_ISA {

#if defined(__GNUC__) || defined(__clang__)
// Without AVX, GCC warns that passing such vectors changes the ABI; these helpers are always
// inlined and never cross a translation unit, so there is no ABI to change.
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float f32x8 __attribute__((vector_size(32)));
#define JV_ALWAYS_INLINE inline __attribute__((always_inline))
JV_ALWAYS_INLINE f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
JV_ALWAYS_INLINE void store8(float* p, const f32x8& v) { std::memcpy(p, &v, sizeof v); }
JV_ALWAYS_INLINE f32x8 splat8(float a) { return f32x8{a, a, a, a, a, a, a, a}; }
#define JV_VECTOR_EXP 1
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// Lane l is allowed iff j + l < count (a key step's columns j.. of a row with `count` allowed
// keys in the step).
JV_ALWAYS_INLINE i32x8 lanes_below(int64_t j, int64_t count) {
  const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  return (lane + int32_t(j)) < int32_t(count);
}

// The largest lane (max as std::max: a NaN lane never wins over a number) and the sum of the
// lanes, each reduced in a fixed order.
JV_ALWAYS_INLINE float max_lanes(const f32x8& v) {
  float m = v[0];
  for (int l = 1; l < 8; ++l) m = m < v[l] ? v[l] : m;
  return m;
}
JV_ALWAYS_INLINE float sum_lanes(const f32x8& v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// exp_nonpositive (numeric.h) on eight lanes, with the same operations: 0 below -87.3 (and for
// -inf), NaN for NaN. Written with vector operations because GCC does not vectorize the scalar
// version's selects.
JV_ALWAYS_INLINE f32x8 exp_nonpositive8(const f32x8& x) {
  const f32x8 lo = splat8(-87.3f);
  const i32x8 under = x < lo;  // false for NaN: NaN stays NaN
  const f32x8 xc = under ? lo : x;
  const f32x8 t = xc * splat8(1.44269504088896341f) + splat8(12582912.0f);
  const f32x8 n = t - splat8(12582912.0f);
  const f32x8 r = (xc - n * splat8(0.693359375f)) + n * splat8(2.12194440e-4f);
  f32x8 p = splat8(1.9875691500e-4f);
  p = p * r + splat8(1.3981999507e-3f);
  p = p * r + splat8(8.3334519073e-3f);
  p = p * r + splat8(4.1665795894e-2f);
  p = p * r + splat8(1.6666665459e-1f);
  p = p * r + splat8(5.0000001201e-1f);
  p = p * r * r + r + splat8(1.0f);
  const u32x8 pow2n = ((u32x8)t - 0x4B400000u + 127u) << 23;
  const f32x8 result = p * (f32x8)pow2n;
  return under ? splat8(0.0f) : result;
}

// tanh on eight lanes (Cephes tanhf, about 2 ulp): an odd polynomial below |x| = 0.625,
// (1 - e) / (1 + e) with e = exp(-2|x|) above; +-1 for +-inf, NaN for NaN.
JV_ALWAYS_INLINE f32x8 tanh8(const f32x8& x) {
  const i32x8 negative = x < splat8(0.0f);
  const f32x8 a = negative ? -x : x;
  const f32x8 z = a * a;
  f32x8 poly = splat8(-5.70498872745e-3f);
  poly = poly * z + splat8(2.06390887954e-2f);
  poly = poly * z - splat8(5.37397155531e-2f);
  poly = poly * z + splat8(1.33314422036e-1f);
  poly = poly * z - splat8(3.33332819422e-1f);
  const f32x8 small = poly * z * a + a;
  const f32x8 e = exp_nonpositive8(splat8(-2.0f) * a);
  const f32x8 large = (splat8(1.0f) - e) / (splat8(1.0f) + e);
  const f32x8 t = a < splat8(0.625f) ? small : large;
  return negative ? -t : t;
}
#else  // plain arrays: the matrix products' arithmetic, left to the compiler to vectorize
struct f32x8 {
  float x[8];
  f32x8& operator+=(const f32x8& o) {
    for (int l = 0; l < 8; ++l) x[l] += o.x[l];
    return *this;
  }
  friend f32x8 operator*(const f32x8& a, const f32x8& b) {
    f32x8 r;
    for (int l = 0; l < 8; ++l) r.x[l] = a.x[l] * b.x[l];
    return r;
  }
};
#define JV_ALWAYS_INLINE inline
JV_ALWAYS_INLINE f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(v.x, p, sizeof v.x);
  return v;
}
JV_ALWAYS_INLINE void store8(float* p, const f32x8& v) { std::memcpy(p, v.x, sizeof v.x); }
JV_ALWAYS_INLINE f32x8 splat8(float a) {
  f32x8 v;
  for (int l = 0; l < 8; ++l) v.x[l] = a;
  return v;
}
#endif

}  // namespace jax_varlen::cpu::JV_CPU_ISA
