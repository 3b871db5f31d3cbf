#include "cpu/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/numeric.h"
#include "seqlen.h"

// This file is compiled once per instruction set (CMakeLists.txt): JV_CPU_ISA names the
// namespace of this copy, e.g. jax_varlen::cpu::avx2 built with -mavx2 -mfma.
namespace jax_varlen::cpu::JV_CPU_ISA {
namespace {

constexpr int64_t kRowsPerItem = 64;  // query rows of one work item
constexpr int64_t kRows = 4;          // query rows that share each loaded key and value
constexpr int64_t kKeys = 64;         // keys per online-softmax step

// Scratch of one thread, reused across items (sized up, never down).
struct Scratch {
  std::vector<float> key_t;  // [head_dim, keys_stride]: keys transposed, so score loops run over j
  std::vector<float> value;  // [keys, head_dim_v]
  std::vector<float> query;  // [kRows, head_dim]
  std::vector<float> score;  // [kRows, kKeys]
  std::vector<float> acc;    // [kRows, head_dim_v]
};

// Online softmax state of kRows query rows of one head.
template <typename T>
void attend_rows(const AttentionParams& p, Scratch& w, const T* q_rows, int64_t q_row_stride,
                 const int64_t* limit, int64_t keys_stride, T* out_rows,
                 int64_t out_row_stride, float* lse_rows) {
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  float* __restrict query = w.query.data();
  float* __restrict score = w.score.data();
  float* __restrict acc = w.acc.data();
  const float* __restrict key_t = w.key_t.data();
  const float* __restrict value = w.value.data();
  float m[kRows], l[kRows];
  int64_t max_limit = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
    max_limit = std::max(max_limit, limit[r]);
    for (int64_t d = 0; d < D; ++d)
      query[r * D + d] = limit[r] > 0 ? to_float(q_rows[r * q_row_stride + d]) : 0.0f;
    std::fill(acc + r * Dv, acc + (r + 1) * Dv, 0.0f);
  }

  for (int64_t j0 = 0; j0 < max_limit; j0 += kKeys) {
    const int64_t jn = std::min(kKeys, max_limit - j0);
    // score[r, j] = <q_r, k_{j0+j}>, summed over d in order (fixed rounding, vectorized over j).
    std::fill(score, score + kRows * kKeys, 0.0f);
    for (int64_t d = 0; d < D; ++d) {
      const float* __restrict kd = key_t + d * keys_stride + j0;
      for (int64_t r = 0; r < kRows; ++r) {
        const float qd = query[r * D + d];
        float* __restrict s = score + r * kKeys;
        for (int64_t j = 0; j < jn; ++j) s[j] += qd * kd[j];
      }
    }
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t count = std::min(jn, limit[r] - j0);  // allowed keys of row r in this step
      if (count <= 0) continue;
      float* __restrict s = score + r * kKeys;
      float step_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < count; ++j) {
        float x = s[j] * p.scale;
        if (p.softcap > 0.0f) x = p.softcap * std::tanh(x / p.softcap);
        s[j] = x;
        step_max = std::max(step_max, x);
      }
      const float m_new = std::max(m[r], step_max);
      const float alpha = exp_nonpositive(m[r] - m_new);  // 0 on the first step (m = -inf)
      float sum = 0.0f;
      for (int64_t j = 0; j < count; ++j) {
        s[j] = exp_nonpositive(s[j] - m_new);
        sum += s[j];
      }
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
      float* __restrict a = acc + r * Dv;
      for (int64_t e = 0; e < Dv; ++e) a[e] *= alpha;
      for (int64_t j = 0; j < count; ++j) {
        const float pj = s[j];
        const float* __restrict vj = value + (j0 + j) * Dv;
        for (int64_t e = 0; e < Dv; ++e) a[e] += pj * vj[e];
      }
    }
  }

  for (int64_t r = 0; r < kRows; ++r) {
    if (limit[r] < 0) continue;  // past the last query row
    // A row is empty by its count of allowed keys, never by the value of l: a NaN or Inf in
    // a row's query or allowed keys makes l NaN, and that NaN must reach out and lse.
    const bool any = limit[r] > 0;
    const float inv_l = any ? 1.0f / l[r] : 0.0f;
    for (int64_t e = 0; e < Dv; ++e)
      out_rows[r * out_row_stride + e] = from_float<T>(any ? acc[r * Dv + e] * inv_l : 0.0f);
    lse_rows[r] = any ? m[r] + std::log(l[r]) : -std::numeric_limits<float>::infinity();
  }
}

// Item = (sequence b, kv head g, block of kRowsPerItem query rows), sequence-major. Blocks past
// the sequence's query rows (a packed batch's grid covers the longest one) do nothing.
template <typename T>
void run_item(const AttentionParams& p, int64_t item) {
  const int64_t Hkv = p.kv_num_heads, D = p.head_dim, Dv = p.head_dim_v;
  const int64_t blocks = (p.seqlen_q + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t block = item % blocks;
  const int64_t g = (item / blocks) % Hkv;
  const SeqlenInfo seq(p, item / blocks / Hkv);
  const int64_t Sq = seq.seqlen_q, n = seq.seqlen_k;
  const int64_t i0 = block * kRowsPerItem, i1 = std::min(Sq, i0 + kRowsPerItem);
  if (i0 >= i1) return;
  const int64_t keys = allowed_keys(i1 - 1, n, Sq, p.is_causal);  // the most any row here sees

  thread_local Scratch w;
  const int64_t keys_stride = keys;
  if (int64_t(w.key_t.size()) < D * keys) w.key_t.resize(D * keys);
  if (int64_t(w.value.size()) < keys * Dv) w.value.resize(keys * Dv);
  w.query.resize(kRows * D);
  w.score.resize(kRows * kKeys);
  w.acc.resize(kRows * Dv);

  // Only the allowed keys of this kv head are read: padding is never touched.
  const T* k = static_cast<const T*>(p.k) + seq.k_index(p, 0, g);
  const T* v = static_cast<const T*>(p.v) + seq.v_index(p, 0, g);
  for (int64_t j = 0; j < keys; ++j) {
    for (int64_t d = 0; d < D; ++d) w.key_t[d * keys_stride + j] = to_float(k[j * p.k_row_stride + d]);
    for (int64_t e = 0; e < Dv; ++e) w.value[j * Dv + e] = to_float(v[j * p.v_row_stride + e]);
  }

  const int64_t group = p.num_heads / Hkv;
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (int64_t i = i0; i < i1; i += kRows) {
      int64_t limit[kRows];
      for (int64_t r = 0; r < kRows; ++r)
        limit[r] = i + r < i1 ? allowed_keys(i + r, n, Sq, p.is_causal) : -1;
      const T* q = static_cast<const T*>(p.q) + seq.q_index(p, i, h);
      T* out = static_cast<T*>(p.out) + seq.out_index(p, i, h);
      // lse rows i, i + 1, ... of head h are consecutive in both layouts (seqlen.h).
      attend_rows<T>(p, w, q, p.q_row_stride, limit, keys_stride, out, p.out_row_stride,
                     p.lse + seq.lse_index(p, h, i));
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
