#include "cpu/backward_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/load.h"
#include "cpu/numeric.h"
#include "core/seqlen.h"

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
static_assert(kRowBlock % kLanes == 0, "the per-row arrays hold rows_ld <= kRowBlock");

// ---------------------------------------------------------------------------------------------
// The elementwise step: P_rj and dS_rj (without the outer scale) from s = <q_r, k_j> and
// dp = <d_out_r, v_j>, in place; exactly 0 where key j is not allowed for row r (by a select,
// never by a product, whatever the products held). Two layouts of the same math: rows of s
// are query rows (d_key/d_value items) or keys (d_query items).

#if defined(JV_VECTOR_EXP)
// Eight pairs; lse and delta of their rows.
JV_ALWAYS_INLINE void weights8(float scale, float cap, const i32x8& allowed, const f32x8& lse,
                               const f32x8& delta, float* s, float* dp) {
  f32x8 x = load8(s) * splat8(scale);
  f32x8 grad_cap = splat8(1.0f);
  if (cap > 0.0f) {
    const f32x8 t = tanh8(x / splat8(cap));
    x = splat8(cap) * t;
    grad_cap = splat8(1.0f) - t * t;  // d/dx of cap * tanh(x / cap)
  }
  const f32x8 pj = exp_nonpositive8(x - lse);
  const f32x8 ds = pj * (load8(dp) - delta) * grad_cap;
  store8(s, allowed ? pj : splat8(0.0f));
  store8(dp, allowed ? ds : splat8(0.0f));
}
#else
// One allowed pair.
inline void weights1(float scale, float cap, float lse, float delta, float* s, float* dp) {
  if (cap > 0.0f) {
    const float t = std::tanh(*s * scale / cap);  // as the forward rounds it
    *s = exp_nonpositive(cap * t - lse);
    *dp = *s * (*dp - delta) * (1.0f - t * t);  // d/dx of cap * tanh(x / cap)
  } else {
    *s = exp_nonpositive(*s * scale - lse);
    *dp = *s * (*dp - delta);
  }
}
#endif

// Rows of s are query rows r < rows, columns keys j0 + j, j < cols (a multiple of kLanes);
// row r's allowed keys are [begin[r], limit[r]).
void weights_by_rows(const AttentionParams& p, int64_t rows, int64_t cols, int64_t j0,
                     const int32_t* begin, const int32_t* limit, const float* lse,
                     const float* delta, float* s, float* dp, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * ld;
    float* dr = dp + r * ld;
    const int64_t start = std::clamp<int64_t>(begin[r] - j0, 0, cols);
    const int64_t count = std::clamp<int64_t>(limit[r] - j0, start, cols);
#if defined(JV_VECTOR_EXP)
    for (int64_t j = 0; j < cols; j += 8)
      weights8(p.scale, p.softcap, lanes_below(j, count) & ~lanes_below(j, start),
               splat8(lse[r]), splat8(delta[r]), sr + j, dr + j);
#else
    for (int64_t j = start; j < count; ++j)
      weights1(p.scale, p.softcap, lse[r], delta[r], sr + j, dr + j);
    std::fill(sr, sr + start, 0.0f);
    std::fill(dr, dr + start, 0.0f);
    std::fill(sr + count, sr + cols, 0.0f);
    std::fill(dr + count, dr + cols, 0.0f);
#endif
  }
}

// Rows of s are keys j0 + j, j < step, columns query rows r < rows_ld (a multiple of kLanes);
// row r's allowed keys are [begin[r], limit[r]) (empty past the real rows).
void weights_by_keys(const AttentionParams& p, int64_t rows_ld, int64_t step, int64_t j0,
                     const int32_t* begin, const int32_t* limit, const float* lse,
                     const float* delta, float* s, float* dp, int64_t ld) {
#if defined(JV_VECTOR_EXP)
  for (int64_t r = 0; r < rows_ld; r += 8) {
    i32x8 beg, lim;
    std::memcpy(&beg, begin + r, sizeof beg);
    std::memcpy(&lim, limit + r, sizeof lim);
    const f32x8 l = load8(lse + r), d = load8(delta + r);
    for (int64_t j = 0; j < step; ++j) {
      const int32_t key = int32_t(j0 + j);
      weights8(p.scale, p.softcap, (beg <= key) & (key < lim), l, d, s + j * ld + r,
               dp + j * ld + r);
    }
  }
#else
  for (int64_t j = 0; j < step; ++j) {
    for (int64_t r = 0; r < rows_ld; ++r) {
      float* sj = s + j * ld + r;
      float* dj = dp + j * ld + r;
      if (begin[r] <= j0 + j && j0 + j < limit[r]) {
        weights1(p.scale, p.softcap, lse[r], delta[r], sj, dj);
      } else {
        *sj = 0.0f;
        *dj = 0.0f;
      }
    }
  }
#endif
}

// Scratch of one thread, reused across items (sized up, never down).
struct Scratch {
  // d_key/d_value items: the key block transposed (its columns are the block's keys) and the
  // query rows of one step, unless read in place (rows_as_float).
  std::vector<float> key_t;    // [D, cols]
  std::vector<float> value_t;  // [Dv, cols]
  std::vector<float> query;    // [kRowStep, D]
  std::vector<float> d_out;    // [kRowStep, Dv]
  // d_query items: the keys by rows, unless read in place, and one head's rows transposed
  // (their columns are the rows).
  std::vector<float> key;      // [keys, D]
  std::vector<float> key_p;    // [keys, Dp]: columns padded to kLanes (when D is not)
  std::vector<float> value;    // [keys, Dv]
  std::vector<float> query_t;  // [D, rows_ld]
  std::vector<float> d_out_t;  // [Dv, rows_ld]
  // Both: scores then P, <d_out, v> then dS, of one step (64 x 64); the accumulators.
  std::vector<float> score;
  std::vector<float> d_score;
  std::vector<float> acc_a;  // d_key transposed [D, cols], or d_query [rows, Dp]
  std::vector<float> acc_b;  // d_value transposed [Dv, cols]
};

// lse and delta of query rows [i, i + rows) of head h, into arrays whose entries [rows, ld)
// get 0.
void load_row_stats(const BackwardParams& bp, const SeqlenInfo& seq, int64_t h, int64_t i,
                    int64_t rows, int64_t ld, float* lse, float* delta) {
  const AttentionParams& p = bp.fwd;
  for (int64_t r = 0; r < ld; ++r) {
    const bool real = r < rows;
    lse[r] = real ? p.lse[seq.lse_index(p, h, i + r)] : 0.0f;
    delta[r] = real ? bp.delta[seq.lse_index(p, h, i + r)] : 0.0f;
  }
}

// The allowed keys [begin[r], limit[r]) of query rows i + r, r < rows (mask.h, key_range),
// relative to key j0; entries [rows, ld) get [0, 0) (no key, so their weights are 0).
void load_row_keys(const AttentionParams& p, const SeqlenInfo& seq, int64_t i, int64_t rows,
                   int64_t ld, int64_t j0, int32_t* begin, int32_t* limit) {
  const MaskSpec mask = p.mask();
  for (int64_t r = 0; r < ld; ++r) {
    const Range k = r < rows ? key_range(mask, i + r, seq.seqlen_k, seq.seqlen_q) : Range{j0, j0};
    begin[r] = int32_t(k.begin - j0);
    limit[r] = int32_t(k.end - j0);
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
// heads, then over the query rows that may see some key of the block (mask.h, row_range: all
// rows; under causal, rows from j0 - n + Sq on; in a local window, the rows whose window meets
// the block), in that order: row blocks outside a window are never visited. Keys at or past n (the padding of the sequence's key rows)
// get zeros and are never read; blocks past its key rows (a packed batch's items cover the
// longest sequence) do nothing. Per head and step of kRowStep query rows, the key block is
// the transposed operand (loaded once per item) and the rows are read in place:
//   score [rows, cols]  = query [rows, D] x key_t [D, cols],   d_score = d_out x value_t
//   -> P, dS (weights_by_rows)
//   acc_v [Dv, cols]   += d_out^T [Dv, rows] x P,              acc_k [D, cols] += query^T x dS
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
  ensure(w.score, kRowStep * cols);
  ensure(w.d_score, kRowStep * cols);
  ensure(w.acc_a, D * cols);
  ensure(w.acc_b, Dv * cols);
  load_transposed(static_cast<const T*>(p.k) + seq.k_index(p, j0, g), p.k_row_stride, keys, D,
                  w.key_t.data(), cols);
  load_transposed(static_cast<const T*>(p.v) + seq.v_index(p, j0, g), p.v_row_stride, keys, Dv,
                  w.value_t.data(), cols);
  float* acc_k = w.acc_a.data();  // [D, cols]
  float* acc_v = w.acc_b.data();  // [Dv, cols]
  std::fill(acc_k, acc_k + D * cols, 0.0f);
  std::fill(acc_v, acc_v + Dv * cols, 0.0f);
  float* s = w.score.data();
  float* ds = w.d_score.data();

  const Range block_rows = row_range(p.mask(), j0, j0 + keys, n, Sq);
  for (int64_t h = g * G; h < (g + 1) * G; ++h) {
    for (int64_t i = block_rows.begin; i < block_rows.end; i += kRowStep) {
      const int64_t rows = std::min(kRowStep, block_rows.end - i);
      float lse[kRowStep], delta[kRowStep];
      int32_t begin[kRowStep], limit[kRowStep];  // allowed keys of row i + r
      load_row_stats(bp, seq, h, i, rows, rows, lse, delta);
      load_row_keys(p, seq, i, rows, rows, 0, begin, limit);
      int64_t q_ld, o_ld;
      const float* q = rows_as_float(static_cast<const T*>(p.q) + seq.q_index(p, i, h),
                                     p.q_row_stride, rows, D, D, w.query, &q_ld);
      const float* g_out = rows_as_float(static_cast<const T*>(bp.d_out) + seq.out_index(p, i, h),
                                         p.out_row_stride, rows, Dv, Dv, w.d_out, &o_ld);
      gemm(rows, cols, D, q, q_ld, 1, w.key_t.data(), cols, s, cols, false);
      gemm(rows, cols, Dv, g_out, o_ld, 1, w.value_t.data(), cols, ds, cols, false);
      weights_by_rows(p, rows, cols, j0, begin, limit, lse, delta, s, ds, cols);
      gemm(Dv, cols, rows, g_out, 1, o_ld, s, cols, acc_v, cols, true);
      gemm(D, cols, rows, q, 1, q_ld, ds, cols, acc_k, cols, true);
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
// each row's allowed keys in order (and only those: a NaN in a key the row may not see never
// meets its zero weight). Rows with no allowed key get zeros; blocks past the sequence's query
// rows do nothing. Per head and step of kKeyStep keys, the query rows are the transposed
// operand (loaded once per head) and the keys are read in place:
//   score_t [step, rows_ld] = key [step, D] x query_t [D, rows_ld],   d_score_t = value x d_out_t
//   -> P, dS (weights_by_keys)
//   acc [rows, Dp]         += dS [rows, step] x key [step, Dp], row r over its keys
// The steps cover the keys some row of the block may see (mask.h, key_range of the block),
// from its first one, as in the forward.
template <typename T>
void dq_item(const BackwardParams& bp, const SeqlenInfo& seq, int64_t g, int64_t i0) {
  const AttentionParams& p = bp.fwd;
  const int64_t D = p.head_dim, Dv = p.head_dim_v, G = p.num_heads / p.kv_num_heads;
  const int64_t Sq = seq.seqlen_q, n = seq.seqlen_k;
  const int64_t i1 = std::min(Sq, i0 + kRowBlock);
  if (i0 >= i1) return;
  // The rows that see no key are leading ones (as in the forward): rows [i0, i0 + first) get
  // zeros and are left out of the products.
  const MaskSpec mask = p.mask();
  const int64_t first = std::clamp(first_row_with_keys(mask, n, Sq), i0, i1) - i0;
  const int64_t rows = i1 - i0 - first, rows_ld = round_up(rows, kLanes);
  T* d_q = static_cast<T*>(bp.d_q);
  for (int64_t h = g * G; h < (g + 1) * G; ++h)
    for (int64_t i = i0; i < i0 + first; ++i)
      std::fill(d_q + seq.q_index(p, i, h), d_q + seq.q_index(p, i, h) + D, from_float<T>(0.0f));
  if (rows == 0) return;
  // Keys [kb, kb + keys): those some row of the block may see.
  const Range block_keys = key_range(mask, i0 + first, i1, n, Sq);
  const int64_t kb = block_keys.begin, keys = block_keys.end - kb;

  thread_local Scratch w;
  const int64_t Dp = round_up(D, kLanes);
  ensure(w.query_t, D * rows_ld);
  ensure(w.d_out_t, Dv * rows_ld);
  ensure(w.score, kKeyStep * rows_ld);
  ensure(w.d_score, kKeyStep * rows_ld);
  ensure(w.acc_a, rows * Dp);
  // Only the keys some row here may attend to are read (never padding), once for the group.
  const T* k = static_cast<const T*>(p.k) + seq.k_index(p, kb, g);
  int64_t key_ld, value_ld;
  const float* key = rows_as_float(k, p.k_row_stride, keys, D, D, w.key, &key_ld);
  int64_t key_p_ld = key_ld;  // the d_query product's operand: columns padded to kLanes
  const float* key_p = key;
  if (Dp != D) key_p = rows_as_float(k, p.k_row_stride, keys, D, Dp, w.key_p, &key_p_ld);
  const float* value = rows_as_float(static_cast<const T*>(p.v) + seq.v_index(p, kb, g),
                                     p.v_row_stride, keys, Dv, Dv, w.value, &value_ld);

  float* acc = w.acc_a.data();  // [rows, Dp]
  float* s = w.score.data();
  float* ds = w.d_score.data();
  for (int64_t h = g * G; h < (g + 1) * G; ++h) {
    const int64_t i = i0 + first;
    float lse[kRowBlock], delta[kRowBlock];
    int32_t begin[kRowBlock], limit[kRowBlock];  // allowed keys of row i + r, relative to kb
    int64_t start[kRowBlock], count[kRowBlock];  // ... of them in the current step
    load_row_stats(bp, seq, h, i, rows, rows_ld, lse, delta);
    load_row_keys(p, seq, i, rows, rows_ld, kb, begin, limit);
    load_transposed(static_cast<const T*>(p.q) + seq.q_index(p, i, h), p.q_row_stride, rows, D,
                    w.query_t.data(), rows_ld);
    load_transposed(static_cast<const T*>(bp.d_out) + seq.out_index(p, i, h), p.out_row_stride,
                    rows, Dv, w.d_out_t.data(), rows_ld);
    std::fill(acc, acc + rows * Dp, 0.0f);
    for (int64_t j0 = 0; j0 < keys; j0 += kKeyStep) {
      const int64_t step = std::min(kKeyStep, keys - j0);
      gemm(step, rows_ld, D, key + j0 * key_ld, key_ld, 1, w.query_t.data(), rows_ld, s,
           rows_ld, false);
      gemm(step, rows_ld, Dv, value + j0 * value_ld, value_ld, 1, w.d_out_t.data(), rows_ld, ds,
           rows_ld, false);
      weights_by_keys(p, rows_ld, step, j0, begin, limit, lse, delta, s, ds, rows_ld);
      for (int64_t r = 0; r < rows; ++r) {
        start[r] = std::clamp<int64_t>(begin[r] - j0, 0, step);
        count[r] = std::clamp<int64_t>(limit[r] - j0, 0, step);
      }
      gemm(rows, Dp, step, ds, 1, rows_ld, key_p + j0 * key_p_ld, key_p_ld, acc, Dp, true, count,
           start);
    }
    for (int64_t r = 0; r < rows; ++r) {
      T* dq = d_q + seq.q_index(p, i + r, h);
      for (int64_t d = 0; d < D; ++d) dq[d] = from_float<T>(p.scale * acc[r * Dp + d]);
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
