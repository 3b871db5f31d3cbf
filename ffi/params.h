// One plain struct that describes a forward attention problem, shared by every handler
// (CPU and CUDA) and every kernel. Handlers fill it once from the XLA buffers; kernels read it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JV_HOST_DEVICE inline
#endif

namespace jax_varlen {

enum class DType : int { kF32, kF16, kBF16 };

struct AttentionParams {
  // Inputs, dense and row-major (the layout XLA hands the custom call):
  const void* q;                    // [batch, seqlen_q, num_heads, head_dim]
  const void* k;                    // [batch, seqlen_k, kv_num_heads, head_dim]
  const void* v;                    // [batch, seqlen_k, kv_num_heads, head_dim_v]
  const int32_t* nonpad_kv_seqlen;  // [batch]; kernels clamp each n_b into [0, seqlen_k]
  // Outputs:
  void* out;   // [batch, seqlen_q, num_heads, head_dim_v], dtype of q
  float* lse;  // [batch, num_heads, seqlen_q], natural log; -inf where no key is allowed

  DType dtype;
  int64_t batch;
  int64_t seqlen_q;  // Sq: padded query extent
  int64_t seqlen_k;  // Skv: padded key extent
  int64_t num_heads;
  int64_t kv_num_heads;  // divides num_heads; query head h reads kv head h / (num_heads / kv_num_heads)
  int64_t head_dim;      // D of q and k
  int64_t head_dim_v;    // Dv of v and out

  // Split-KV (decode) path: each sequence's allowed keys are cut into chunks of split_keys
  // keys (a constant, never derived from the batch), each chunk's normalized partial output
  // and base-2 lse go to `workspace`, and a second kernel merges them in chunk order.
  // split_keys = 0 selects the one-pass kernels. Layout, rows_pad = ceil(seqlen_q * group / 16) * 16:
  //   o_part   [batch, kv_num_heads, max_splits, rows_pad, head_dim_v] fp32
  //   lse_part [batch, kv_num_heads, max_splits, rows_pad] fp32, right after o_part
  float* workspace;
  int64_t split_keys;

  float scale;    // multiplies <q, k>
  float softcap;  // 0 = off; else s = softcap * tanh(s / softcap)
  bool is_causal;  // tail-aligned: key j allowed for query i iff j <= i + n - seqlen_q
};

// Clamp a (possibly invalid, traced) length into [0, seqlen_k]: memory past the buffers is
// never read, whatever the caller passed.
JV_HOST_DEVICE int64_t clamp_seqlen(int64_t n, int64_t seqlen_k) {
  return n < 0 ? 0 : (n > seqlen_k ? seqlen_k : n);
}

// Number of keys query row i may attend to, given n valid keys: keys [0, limit) are allowed.
// Worked example, tail-aligned causal, seqlen_q = 4, n = 6: rows 0..3 see 3, 4, 5, 6 keys;
// with n = 2: rows 0..3 see -1 -> 0, 0, 1, 2 keys (the leading two rows are all-zero).
JV_HOST_DEVICE int64_t allowed_keys(int64_t i, int64_t n, int64_t seqlen_q, bool is_causal) {
  if (!is_causal) return n;
  int64_t limit = i + n - seqlen_q + 1;
  return limit < 0 ? 0 : (limit > n ? n : limit);
}

}  // namespace jax_varlen
