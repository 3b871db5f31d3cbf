#include "cpu/backward_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/numeric.h"
#include "seqlen.h"

// This file is compiled once per instruction set (CMakeLists.txt): JV_CPU_ISA names the
// namespace of this copy, e.g. jax_varlen::cpu::avx2 built with -mavx2 -mfma. Everything below
// is in that namespace (the helpers in an anonymous one), so the copies never mix at link time.
namespace jax_varlen::cpu::JV_CPU_ISA {
namespace {

constexpr int64_t kDeltaRows = 64;  // query rows of one delta item (all heads)
constexpr int64_t kKeyBlock = 64;   // keys of one d_key/d_value item
constexpr int64_t kRowStep = 64;    // query rows per step of a d_key/d_value item
constexpr int64_t kRowBlock = 64;   // query rows of one d_query item
constexpr int64_t kKeyStep = 64;    // keys per step of a d_query item
constexpr int64_t kLanes = 16;      // the column tile of gemm(): two 8-float vectors

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---------------------------------------------------------------------------------------------
// A small float32 matrix product, the one kernel of every product below:
//   C[m * ldc + n] (+)= sum_{k < K} A[m * am + k * ak] * B[k * ldb + n],  m < M, n < N,
// with N a multiple of kLanes. A is read one scalar at a time (any strides), B and C by rows.
// Each C element sums its K products in order k = 0, 1, ... (fixed rounding, no dependence on
// the tiling), so results are the same on every run.

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
#else  // plain arrays: the same arithmetic, left to the compiler to vectorize
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

// Rows of A per register tile: 6 x 16 accumulators fill 12 of AVX's 16 vector registers; the
// baseline (SSE: two registers per f32x8, 16 in all) takes 2.
#if defined(__AVX__)
constexpr int kTileRows = 6;
#else
constexpr int kTileRows = 2;
#endif

template <int MR>
JV_ALWAYS_INLINE void gemm_tile(int64_t K, const float* A, int64_t am, int64_t ak,
                                const float* B, int64_t ldb, float* C, int64_t ldc,
                                bool accumulate) {
  f32x8 c0[MR], c1[MR];
  for (int m = 0; m < MR; ++m) {
    if (accumulate) {
      c0[m] = load8(C + m * ldc);
      c1[m] = load8(C + m * ldc + 8);
    } else {
      c0[m] = splat8(0.0f);
      c1[m] = splat8(0.0f);
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    const f32x8 b0 = load8(B + k * ldb), b1 = load8(B + k * ldb + 8);
    const float* a = A + k * ak;
    for (int m = 0; m < MR; ++m) {
      const f32x8 am_k = splat8(a[m * am]);
      c0[m] += am_k * b0;
      c1[m] += am_k * b1;
    }
  }
  for (int m = 0; m < MR; ++m) {
    store8(C + m * ldc, c0[m]);
    store8(C + m * ldc + 8, c1[m]);
  }
}

template <int MR>
void gemm_rows(int64_t M, int64_t K, const float* A, int64_t am, int64_t ak, const float* B,
               int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    gemm_tile<MR>(K, A + m * am, am, ak, B, ldb, C + m * ldc, ldc, accumulate);
  if constexpr (MR > 1) {
    if (m < M) gemm_rows<MR - 1>(M - m, K, A + m * am, am, ak, B, ldb, C + m * ldc, ldc,
                                 accumulate);
  }
}

void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t am, int64_t ak,
          const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  // Column strips of B (K x 16, in cache) are reused across every row tile of A.
  for (int64_t n = 0; n < N; n += kLanes)
    gemm_rows<kTileRows>(M, K, A, am, ak, B + n, ldb, C + n, ldc, accumulate);
}

// ---------------------------------------------------------------------------------------------
// Loads and the elementwise step.

// dst[r * ld + c] = float(src[r * row_stride + c]) for r < rows, c < cols; columns [cols, ld)
// of each row are zeroed (the padding the gemm's column tiles read).
template <typename T>
void load_rows(const T* src, int64_t row_stride, int64_t rows, int64_t cols, float* dst,
               int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * row_stride;
    float* d = dst + r * ld;
    for (int64_t c = 0; c < cols; ++c) d[c] = to_float(s[c]);
    std::fill(d + cols, d + ld, 0.0f);
  }
}

// dst[c * ld + r] = float(src[r * row_stride + c]): rows r < rows become columns; columns
// [rows, ld) are zeroed.
template <typename T>
void load_transposed(const T* src, int64_t row_stride, int64_t rows, int64_t cols, float* dst,
                     int64_t ld) {
  for (int64_t c = 0; c < cols; ++c) std::fill(dst + c * ld + rows, dst + (c + 1) * ld, 0.0f);
  // Blocks of 16 rows: each pass over a block's columns writes whole cache lines of dst
  // while the block's 16 source rows stay in cache.
  constexpr int64_t kBlock = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    const int64_t r1 = std::min(rows, r0 + kBlock);
    for (int64_t c = 0; c < cols; ++c) {
      float* d = dst + c * ld;
      for (int64_t r = r0; r < r1; ++r) d[r] = to_float(src[r * row_stride + c]);
    }
  }
}

// Turns scores into probabilities and score gradients, in place, for rows r < rows and
// columns j < cols (key j0 + j): on entry s holds <q_r, k_j> and dp holds <d_out_r, v_j>; on
// exit s holds P_rj and dp holds dS_rj (without the outer scale). Entries past a row's allowed
// keys (limit[r]) are exactly 0, whatever the products held.
void probabilities(const AttentionParams& p, int64_t rows, int64_t cols, int64_t j0,
                   const int64_t* limit, const float* lse, const float* delta, float* s,
                   float* dp, int64_t ld) {
  const float scale = p.scale, cap = p.softcap;
  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict sr = s + r * ld;
    float* __restrict dr = dp + r * ld;
    const int64_t count = std::clamp<int64_t>(limit[r] - j0, 0, cols);
    const float l = lse[r], d = delta[r];
#if defined(JV_VECTOR_EXP)
    // cols is a multiple of kLanes (<= 64), so the columns are whole 8-lane vectors; lanes at
    // or past count are set to exactly 0 by a select (never by a product).
    const i32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int64_t j = 0; j < cols; j += 8) {
      const i32x8 allowed = (lane + int32_t(j)) < int32_t(count);
      f32x8 x = load8(sr + j) * splat8(scale);
      f32x8 grad_cap = splat8(1.0f);
      if (cap > 0.0f) {
        const f32x8 t = tanh8(x / splat8(cap));
        x = splat8(cap) * t;
        grad_cap = splat8(1.0f) - t * t;  // d/dx of cap * tanh(x / cap)
      }
      const f32x8 pj = exp_nonpositive8(x - splat8(l));
      const f32x8 ds = pj * (load8(dr + j) - splat8(d)) * grad_cap;
      store8(sr + j, allowed ? pj : splat8(0.0f));
      store8(dr + j, allowed ? ds : splat8(0.0f));
    }
#else
    if (cap > 0.0f) {
      for (int64_t j = 0; j < count; ++j) {
        const float t = std::tanh(sr[j] * scale / cap);  // as the forward rounds it
        const float pj = exp_nonpositive(cap * t - l);
        sr[j] = pj;
        dr[j] = pj * (dr[j] - d) * (1.0f - t * t);  // d/dx of cap * tanh(x / cap)
      }
    } else {
      for (int64_t j = 0; j < count; ++j) {
        const float pj = exp_nonpositive(sr[j] * scale - l);
        sr[j] = pj;
        dr[j] = pj * (dr[j] - d);
      }
    }
    std::fill(sr + count, sr + cols, 0.0f);
    std::fill(dr + count, dr + cols, 0.0f);
#endif
  }
}

// Scratch of one thread, reused across items (sized up, never down).
struct Scratch {
  std::vector<float> key_t;    // [D, key_ld]: keys transposed (score products run over keys)
  std::vector<float> value_t;  // [Dv, key_ld]
  std::vector<float> key;      // [keys, Dp]: keys by rows (the d_query product runs over D)
  std::vector<float> query;    // [rows, D]
  std::vector<float> d_out;    // [rows, Dv]
  std::vector<float> score;    // [rows, 64]: scores, then P
  std::vector<float> d_score;  // [rows, 64]: <d_out, v>, then dS
  std::vector<float> acc_a;    // d_key transposed [D, 64], or d_query [rows, Dp]
  std::vector<float> acc_b;    // d_value transposed [Dv, 64]
  std::vector<float> lse, delta;
  std::vector<int64_t> limit;
};

template <typename V>
void ensure(V& v, int64_t size) {
  if (int64_t(v.size()) < size) v.resize(size);
}

// Query rows [i, i + rows) of head h: their inputs (float), lse, delta and allowed-key counts.
template <typename T>
void load_query_rows(const BackwardParams& bp, const SeqlenInfo& seq, int64_t h, int64_t i,
                     int64_t rows, Scratch& w) {
  const AttentionParams& p = bp.fwd;
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  load_rows(static_cast<const T*>(p.q) + seq.q_index(p, i, h), p.q_row_stride, rows, D,
            w.query.data(), D);
  load_rows(static_cast<const T*>(bp.d_out) + seq.out_index(p, i, h), p.out_row_stride, rows,
            Dv, w.d_out.data(), Dv);
  for (int64_t r = 0; r < rows; ++r) {
    w.lse[r] = p.lse[seq.lse_index(p, h, i + r)];
    w.delta[r] = bp.delta[seq.lse_index(p, h, i + r)];
    w.limit[r] = allowed_keys(i + r, seq.seqlen_k, seq.seqlen_q, p.is_causal);
  }
}

// ---------------------------------------------------------------------------------------------
// The items.

template <typename T>
void delta_item(const BackwardParams& bp, int64_t item) {
  const AttentionParams& p = bp.fwd;
  const int64_t blocks = (p.seqlen_q + kDeltaRows - 1) / kDeltaRows;
  const SeqlenInfo seq(p, item / blocks);
  const int64_t i0 = item % blocks * kDeltaRows;
  const int64_t i1 = std::min(seq.seqlen_q, i0 + kDeltaRows);
  const int64_t Dv = p.head_dim_v;
  const T* out = static_cast<const T*>(p.out);
  const T* d_out = static_cast<const T*>(bp.d_out);
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t h = 0; h < p.num_heads; ++h) {
      const T* o = out + seq.out_index(p, i, h);
      const T* g = d_out + seq.out_index(p, i, h);
      float part[8] = {};  // eight partial sums in a fixed order, then added in a fixed order
      int64_t e = 0;
      for (; e + 8 <= Dv; e += 8)
        for (int l = 0; l < 8; ++l) part[l] += to_float(g[e + l]) * to_float(o[e + l]);
      for (; e < Dv; ++e) part[e % 8] += to_float(g[e]) * to_float(o[e]);
      const float dot = ((part[0] + part[1]) + (part[2] + part[3])) +
                        ((part[4] + part[5]) + (part[6] + part[7]));
      const int64_t at = seq.lse_index(p, h, i);
      bp.delta[at] = dot - bp.d_lse[at];
    }
  }
}

// d_key and d_value of keys [j0, j0 + kKeyBlock) of kv head g: summed over the group's query
// heads, then over the query rows that see key j0 (all rows; under causal, rows from
// j0 - n + Sq on), in that order. Keys at or past n (the padding of the sequence's key rows)
// get zeros and are never read; blocks past its key rows (a packed batch's items cover the
// longest sequence) do nothing.
template <typename T>
void dkv_item(const BackwardParams& bp, const SeqlenInfo& seq, int64_t g, int64_t j0) {
  const AttentionParams& p = bp.fwd;
  const int64_t D = p.head_dim, Dv = p.head_dim_v, G = p.num_heads / p.kv_num_heads;
  const int64_t Sq = seq.seqlen_q, n = seq.seqlen_k;
  const int64_t j1 = std::min(seq.k_rows, j0 + kKeyBlock);
  if (j0 >= j1) return;
  const int64_t keys = std::clamp<int64_t>(n - j0, 0, j1 - j0);  // real keys in the block
  T* d_k = static_cast<T*>(bp.d_k);
  T* d_v = static_cast<T*>(bp.d_v);
  for (int64_t j = j0 + keys; j < j1; ++j) {  // padding: exactly zero
    std::fill(d_k + seq.k_index(p, j, g), d_k + seq.k_index(p, j, g) + D, from_float<T>(0.0f));
    std::fill(d_v + seq.v_index(p, j, g), d_v + seq.v_index(p, j, g) + Dv, from_float<T>(0.0f));
  }
  if (keys == 0) return;

  thread_local Scratch w;
  const int64_t cols = round_up(keys, kLanes);
  ensure(w.key_t, D * cols);
  ensure(w.value_t, Dv * cols);
  ensure(w.query, kRowStep * D);
  ensure(w.d_out, kRowStep * Dv);
  ensure(w.score, kRowStep * cols);
  ensure(w.d_score, kRowStep * cols);
  ensure(w.acc_a, D * cols);
  ensure(w.acc_b, Dv * cols);
  ensure(w.lse, kRowStep);
  ensure(w.delta, kRowStep);
  ensure(w.limit, kRowStep);
  load_transposed(static_cast<const T*>(p.k) + seq.k_index(p, j0, g), p.k_row_stride, keys, D,
                  w.key_t.data(), cols);
  load_transposed(static_cast<const T*>(p.v) + seq.v_index(p, j0, g), p.v_row_stride, keys, Dv,
                  w.value_t.data(), cols);
  float* acc_k = w.acc_a.data();  // [D, cols]
  float* acc_v = w.acc_b.data();  // [Dv, cols]
  std::fill(acc_k, acc_k + D * cols, 0.0f);
  std::fill(acc_v, acc_v + Dv * cols, 0.0f);

  const int64_t first_row = p.is_causal ? std::max<int64_t>(0, j0 - n + Sq) : 0;
  for (int64_t h = g * G; h < (g + 1) * G; ++h) {
    for (int64_t i = first_row; i < Sq; i += kRowStep) {
      const int64_t rows = std::min(kRowStep, Sq - i);
      load_query_rows<T>(bp, seq, h, i, rows, w);
      const float* q = w.query.data();
      const float* g_out = w.d_out.data();
      float* s = w.score.data();
      float* ds = w.d_score.data();
      gemm(rows, cols, D, q, D, 1, w.key_t.data(), cols, s, cols, false);          // q k^T
      gemm(rows, cols, Dv, g_out, Dv, 1, w.value_t.data(), cols, ds, cols, false);  // dO v^T
      probabilities(p, rows, cols, j0, w.limit.data(), w.lse.data(), w.delta.data(), s, ds,
                    cols);
      gemm(Dv, cols, rows, g_out, 1, Dv, s, cols, acc_v, cols, true);  // d_v^T += dO^T P
      gemm(D, cols, rows, q, 1, D, ds, cols, acc_k, cols, true);       // d_k^T += q^T dS
    }
  }
  for (int64_t j = 0; j < keys; ++j) {
    T* dk = d_k + seq.k_index(p, j0 + j, g);
    T* dv = d_v + seq.v_index(p, j0 + j, g);
    for (int64_t d = 0; d < D; ++d) dk[d] = from_float<T>(p.scale * acc_k[d * cols + j]);
    for (int64_t e = 0; e < Dv; ++e) dv[e] = from_float<T>(acc_v[e * cols + j]);
  }
}

// d_query of query rows [i0, i0 + kRowBlock) of the query heads of kv head g: summed over
// each row's allowed keys in order. Rows with no allowed key get zeros; blocks past the
// sequence's query rows do nothing.
template <typename T>
void dq_item(const BackwardParams& bp, const SeqlenInfo& seq, int64_t g, int64_t i0) {
  const AttentionParams& p = bp.fwd;
  const int64_t D = p.head_dim, Dv = p.head_dim_v, G = p.num_heads / p.kv_num_heads;
  const int64_t Sq = seq.seqlen_q, n = seq.seqlen_k;
  const int64_t i1 = std::min(Sq, i0 + kRowBlock), rows = i1 - i0;
  if (rows <= 0) return;
  const int64_t keys = allowed_keys(i1 - 1, n, Sq, p.is_causal);  // the most any row here sees
  T* d_q = static_cast<T*>(bp.d_q);
  if (keys == 0) {
    for (int64_t h = g * G; h < (g + 1) * G; ++h)
      for (int64_t i = i0; i < i1; ++i)
        std::fill(d_q + seq.q_index(p, i, h), d_q + seq.q_index(p, i, h) + D,
                  from_float<T>(0.0f));
    return;
  }

  thread_local Scratch w;
  const int64_t key_ld = round_up(keys, kLanes), Dp = round_up(D, kLanes);
  ensure(w.key_t, D * key_ld);
  ensure(w.value_t, Dv * key_ld);
  ensure(w.key, keys * Dp);
  ensure(w.query, rows * D);
  ensure(w.d_out, rows * Dv);
  ensure(w.score, rows * kKeyStep);
  ensure(w.d_score, rows * kKeyStep);
  ensure(w.acc_a, rows * Dp);
  ensure(w.lse, rows);
  ensure(w.delta, rows);
  ensure(w.limit, rows);
  // Only the keys some row here may attend to are read (never padding), once for the group.
  const T* k = static_cast<const T*>(p.k) + seq.k_index(p, 0, g);
  load_transposed(k, p.k_row_stride, keys, D, w.key_t.data(), key_ld);
  load_transposed(static_cast<const T*>(p.v) + seq.v_index(p, 0, g), p.v_row_stride, keys, Dv,
                  w.value_t.data(), key_ld);
  load_rows(k, p.k_row_stride, keys, D, w.key.data(), Dp);

  float* acc = w.acc_a.data();  // [rows, Dp]
  for (int64_t h = g * G; h < (g + 1) * G; ++h) {
    load_query_rows<T>(bp, seq, h, i0, rows, w);
    std::fill(acc, acc + rows * Dp, 0.0f);
    float* s = w.score.data();
    float* ds = w.d_score.data();
    for (int64_t j0 = 0; j0 < keys; j0 += kKeyStep) {
      const int64_t step = std::min(kKeyStep, keys - j0), cols = round_up(step, kLanes);
      gemm(rows, cols, D, w.query.data(), D, 1, w.key_t.data() + j0, key_ld, s, kKeyStep,
           false);
      gemm(rows, cols, Dv, w.d_out.data(), Dv, 1, w.value_t.data() + j0, key_ld, ds, kKeyStep,
           false);
      probabilities(p, rows, cols, j0, w.limit.data(), w.lse.data(), w.delta.data(), s, ds,
                    kKeyStep);
      gemm(rows, Dp, step, ds, kKeyStep, 1, w.key.data() + j0 * Dp, Dp, acc, Dp, true);  // dS k
    }
    for (int64_t r = 0; r < rows; ++r) {
      T* dq = d_q + seq.q_index(p, i0 + r, h);
      const bool any = w.limit[r] > 0;  // empty rows: zero, even if a key is NaN
      for (int64_t d = 0; d < D; ++d)
        dq[d] = from_float<T>(any ? p.scale * acc[r * Dp + d] : 0.0f);
    }
  }
}

int64_t key_blocks(const AttentionParams& p) { return (p.seqlen_k + kKeyBlock - 1) / kKeyBlock; }
int64_t row_blocks(const AttentionParams& p) { return (p.seqlen_q + kRowBlock - 1) / kRowBlock; }

// Items [0, B * Hkv * row_blocks) are d_query items, the rest d_key/d_value items; within
// each kind, sequence-major, then kv head, then block.
template <typename T>
void grad_item(const BackwardParams& bp, int64_t item) {
  const AttentionParams& p = bp.fwd;
  const int64_t Hkv = p.kv_num_heads;
  const int64_t dq_items = p.batch * Hkv * row_blocks(p);
  if (item < dq_items) {
    const int64_t blocks = row_blocks(p);
    const SeqlenInfo seq(p, item / blocks / Hkv);
    return dq_item<T>(bp, seq, item / blocks % Hkv, item % blocks * kRowBlock);
  }
  item -= dq_items;
  const int64_t blocks = key_blocks(p);
  const SeqlenInfo seq(p, item / blocks / Hkv);
  dkv_item<T>(bp, seq, item / blocks % Hkv, item % blocks * kKeyBlock);
}

}  // namespace

int64_t num_bwd_delta_items(const BackwardParams& bp) {
  return bp.fwd.batch * ((bp.fwd.seqlen_q + kDeltaRows - 1) / kDeltaRows);
}

void run_bwd_delta_item(const BackwardParams& bp, int64_t item) {
  switch (bp.fwd.dtype) {
    case DType::kF32: return delta_item<float>(bp, item);
    case DType::kF16: return delta_item<half_t>(bp, item);
    case DType::kBF16: return delta_item<bf16_t>(bp, item);
  }
}

int64_t num_bwd_grad_items(const BackwardParams& bp) {
  const AttentionParams& p = bp.fwd;
  return p.batch * p.kv_num_heads * (row_blocks(p) + key_blocks(p));
}

void run_bwd_grad_item(const BackwardParams& bp, int64_t item) {
  switch (bp.fwd.dtype) {
    case DType::kF32: return grad_item<float>(bp, item);
    case DType::kF16: return grad_item<half_t>(bp, item);
    case DType::kBF16: return grad_item<bf16_t>(bp, item);
  }
}

}  // namespace jax_varlen::cpu::JV_CPU_ISA
