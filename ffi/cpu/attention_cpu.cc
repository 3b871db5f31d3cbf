#include "cpu/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/load.h"
#include "cpu/numeric.h"
#include "core/seqlen.h"
#include "core/sinks.h"

// This file is compiled once per instruction set (CMakeLists.txt): JV_CPU_ISA names the
// namespace of this copy, e.g. jax_varlen::cpu::avx2 built with -mavx2 -mfma.
namespace jax_varlen::cpu::JV_CPU_ISA {
namespace {

constexpr int64_t kRowsPerItem = 64;  // query rows of one work item
constexpr int64_t kKeys = 64;         // keys per online-softmax step
static_assert(kRowsPerItem % kLanes == 0, "the per-row arrays hold rows_ld <= kRowsPerItem");

// Scratch of one thread, reused across items (sized up, never down).
struct Scratch {
  std::vector<float> key;      // [keys, D]: the item's keys, unless read in place (rows_as_float)
  std::vector<float> value;    // [keys, Dvp]: its values, columns padded to kLanes, or in place
  std::vector<float> query_t;  // [D, rows_ld]: one head's query rows transposed (columns = rows)
  std::vector<float> score_t;  // [kKeys, rows_ld]: one step's scores, then probabilities
  std::vector<float> acc;      // [rows, Dvp]: unnormalized outputs
};

// One online-softmax step over the keys j0 + j, j < step, of query rows r < rows_ld (columns of
// s, row stride ld, a multiple of 8): on entry s[j * ld + r] = <k_j, q_r>; on exit it holds
// row r's weight of key j0 + j, exp(x - m_r) with x the scaled (and capped) score and m_r the
// running max, or exactly 0 where the key is not allowed (outside [begin[r], limit[r]), by a
// select). m, l and alpha are per row: running max and sum, rescaled here, and alpha the
// factor the row's accumulator must take (1 for a row that sees no key in the step: it is
// left as it was).
void softmax_step(const AttentionParams& p, int64_t rows_ld, int64_t step, int64_t j0,
                  const int32_t* begin, const int32_t* limit, float* s, int64_t ld, float* m,
                  float* l, float* alpha) {
  const float scale = p.scale, cap = p.softcap;
  const float minus_inf = -std::numeric_limits<float>::infinity();
#if defined(JV_VECTOR_EXP)
  // Eight rows per vector; keys that are not allowed become -inf (max) and exactly 0 (weights,
  // sum) by selects, never by arithmetic on what the products gave.
  for (int64_t r = 0; r < rows_ld; r += 8) {
    i32x8 beg, lim;
    std::memcpy(&beg, begin + r, sizeof beg);
    std::memcpy(&lim, limit + r, sizeof lim);
    f32x8 vmax = splat8(minus_inf);
    for (int64_t j = 0; j < step; ++j) {
      f32x8 x = load8(s + j * ld + r) * splat8(scale);
      if (cap > 0.0f) x = splat8(cap) * tanh8(x / splat8(cap));
      const int32_t key = int32_t(j0 + j);
      x = (beg <= key) & (key < lim) ? x : splat8(minus_inf);
      store8(s + j * ld + r, x);
      vmax = vmax < x ? x : vmax;
    }
    // Rows whose allowed keys meet [j0, j0 + step) (begin < limit for every row here).
    const i32x8 any = (beg < int32_t(j0 + step)) & (int32_t(j0) < lim);
    const f32x8 m_old = load8(m + r);
    const f32x8 m_new = any ? (m_old < vmax ? vmax : m_old) : m_old;
    f32x8 sum = splat8(0.0f);
    for (int64_t j = 0; j < step; ++j) {
      const f32x8 e = exp_nonpositive8(load8(s + j * ld + r) - m_new);
      const int32_t key = int32_t(j0 + j);
      const f32x8 w = (beg <= key) & (key < lim) ? e : splat8(0.0f);
      store8(s + j * ld + r, w);
      sum += w;
    }
    const f32x8 a = any ? exp_nonpositive8(m_old - m_new) : splat8(1.0f);  // 0 on a first step
    store8(l + r, load8(l + r) * a + sum);
    store8(m + r, m_new);
    store8(alpha + r, a);
  }
#else
  for (int64_t r = 0; r < rows_ld; ++r) {
    alpha[r] = 1.0f;
    const int64_t start = std::clamp<int64_t>(begin[r] - j0, 0, step);
    const int64_t count = std::clamp<int64_t>(limit[r] - j0, 0, step);
    if (count <= start) continue;
    float step_max = minus_inf;
    for (int64_t j = start; j < count; ++j) {
      float x = s[j * ld + r] * scale;
      if (cap > 0.0f) x = cap * std::tanh(x / cap);
      s[j * ld + r] = x;
      step_max = std::max(step_max, x);
    }
    const float m_new = std::max(m[r], step_max);
    float sum = 0.0f;
    for (int64_t j = 0; j < step; ++j) {
      const float w = start <= j && j < count ? exp_nonpositive(s[j * ld + r] - m_new) : 0.0f;
      s[j * ld + r] = w;
      sum += w;
    }
    alpha[r] = exp_nonpositive(m[r] - m_new);  // 0 on the first step (m = -inf)
    l[r] = l[r] * alpha[r] + sum;
    m[r] = m_new;
  }
#endif
}

// Item = (sequence b, kv head g, block of kRowsPerItem query rows), sequence-major. Blocks past
// the sequence's query rows (a packed batch's grid covers the longest one) do nothing.
// Per query head of the group and step of kKeys keys, with the keys as the rows of the score
// product (the operand read in place for float input; the transposed one is the query block,
// loaded once per head and reused by every step):
//   score_t [step, rows_ld]  = key [step, D] x query_t [D, rows_ld]
//   score_t -> weights (softmax_step); acc rows times alpha
//   acc [rows, Dvp]         += weights^T [rows, step] x value [step, Dvp], row r over its keys
// The steps cover the keys some row of the block may see (mask.h, key_range of the block),
// from its first one: key blocks outside a local window are never visited.
template <typename T>
void run_item(const AttentionParams& p, int64_t item) {
  const int64_t Hkv = p.kv_num_heads, D = p.head_dim, Dv = p.head_dim_v;
  const int64_t blocks = (p.seqlen_q + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t block = item % blocks;
  const int64_t g = (item / blocks) % Hkv;
  const SeqlenInfo seq(p, item / blocks / Hkv);
  const int64_t Sq = seq.seqlen_q, n = seq.seqlen_k;
  const MaskSpec mask = p.mask();
  const int64_t i0 = block * kRowsPerItem, i1 = std::min(Sq, i0 + kRowsPerItem);
  if (i0 >= i1) return;
  // The rows that see no key are leading ones (mask.h): rows [i0, i0 + first) are written as
  // empty and left out of the products.
  const int64_t first = std::clamp(first_row_with_keys(mask, n, Sq), i0, i1) - i0;
  const int64_t rows = i1 - i0 - first, rows_ld = round_up(rows, kLanes);
  // Keys [kb, ke): those some row of the block may see.
  const Range block_keys = key_range(mask, i0 + first, i1, n, Sq);
  const int64_t kb = block_keys.begin, keys = block_keys.end - kb;
  int32_t begin[kRowsPerItem], limit[kRowsPerItem];  // allowed keys [begin, limit) of row
                                                     // i0 + first + r, relative to kb; empty
                                                     // ([0, 0)) for r >= rows
  int64_t start[kRowsPerItem], count[kRowsPerItem];  // ... of them in the current step
  for (int64_t r = 0; r < rows_ld; ++r) {
    const Range k = r < rows ? key_range(mask, i0 + first + r, n, Sq) : Range{kb, kb};
    begin[r] = int32_t(k.begin - kb);
    limit[r] = int32_t(k.end - kb);
  }

  thread_local Scratch w;
  const int64_t Dvp = round_up(Dv, kLanes);
  ensure(w.query_t, D * rows_ld);
  ensure(w.score_t, kKeys * rows_ld);
  ensure(w.acc, rows * Dvp);
  // Only the keys [kb, ke) of this kv head are read (padding never), once for the group.
  int64_t key_ld, value_ld;
  const float* key = rows_as_float(static_cast<const T*>(p.k) + seq.k_index(p, kb, g),
                                   p.k_row_stride, keys, D, D, w.key, &key_ld);
  const float* value = rows_as_float(static_cast<const T*>(p.v) + seq.v_index(p, kb, g),
                                     p.v_row_stride, keys, Dv, Dvp, w.value, &value_ld);

  const int64_t group = p.num_heads / Hkv;
  float* query_t = w.query_t.data();
  float* score_t = w.score_t.data();
  float* acc = w.acc.data();
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    T* out = static_cast<T*>(p.out) + seq.out_index(p, i0, h);
    float* lse = p.lse + seq.lse_index(p, h, i0);  // rows i0, i0 + 1, ... are consecutive
    for (int64_t r = 0; r < first; ++r) {
      std::fill(out + r * p.out_row_stride, out + r * p.out_row_stride + Dv, from_float<T>(0.0f));
      lse[r] = empty_row_lse(p, h);  // -inf, or the sink's logit
    }
    if (rows == 0) continue;
    out += first * p.out_row_stride;
    lse += first;

    float m[kRowsPerItem], l[kRowsPerItem], alpha[kRowsPerItem];
    std::fill(m, m + rows_ld, -std::numeric_limits<float>::infinity());
    std::fill(l, l + rows_ld, 0.0f);
    std::fill(acc, acc + rows * Dvp, 0.0f);
    load_transposed(static_cast<const T*>(p.q) + seq.q_index(p, i0 + first, h), p.q_row_stride,
                    rows, D, query_t, rows_ld);
    for (int64_t j0 = 0; j0 < keys; j0 += kKeys) {
      const int64_t step = std::min(kKeys, keys - j0);
      gemm(step, rows_ld, D, key + j0 * key_ld, key_ld, 1, query_t, rows_ld, score_t, rows_ld,
           false);
      softmax_step(p, rows_ld, step, j0, begin, limit, score_t, rows_ld, m, l, alpha);
      for (int64_t r = 0; r < rows; ++r) {
        start[r] = std::clamp<int64_t>(begin[r] - j0, 0, step);
        count[r] = std::clamp<int64_t>(limit[r] - j0, 0, step);
        float* __restrict a = acc + r * Dvp;
        for (int64_t e = 0; e < Dvp; ++e) a[e] *= alpha[r];
      }
      gemm(rows, Dvp, step, score_t, 1, rows_ld, value + j0 * value_ld, value_ld, acc, Dvp,
           true, count, start);
    }

    // A row is empty by its count of allowed keys (the rows before `first`), never by the
    // value of l: every row here sees a key, so l >= 1 (its largest score weighs exp(0)) or l
    // is NaN (a NaN or Inf in its query or allowed keys), and that NaN must reach out and lse.
    for (int64_t r = 0; r < rows; ++r) {
      T* o = out + r * p.out_row_stride;
      const float* a = acc + r * Dvp;
      const RowFinish fin = finish_row</*kBase2=*/false>(m[r], l[r], sink_of(p, h));
      for (int64_t e = 0; e < Dv; ++e) o[e] = from_float<T>(a[e] * fin.inv);
      lse[r] = fin.lse;
    }
  }
}

}  // namespace

int64_t num_work_items(const AttentionParams& p) {
  return p.batch * p.kv_num_heads * ((p.seqlen_q + kRowsPerItem - 1) / kRowsPerItem);
}

void run_work_item(const AttentionParams& p, int64_t item) {
  switch (p.dtype) {
    case DType::kF32: return run_item<float>(p, item);
    case DType::kF16: return run_item<half_t>(p, item);
    case DType::kBF16: return run_item<bf16_t>(p, item);
  }
}

}  // namespace jax_varlen::cpu::JV_CPU_ISA
