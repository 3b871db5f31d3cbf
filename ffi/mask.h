// The one mask predicate of the op, shared by the CPU loops and every CUDA kernel (host and
// device): which keys a query row may attend to, and the clamp that keeps lengths inside the
// buffers.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JV_HOST_DEVICE inline
#endif

namespace jax_varlen {

// Clamp a (possibly invalid, traced) length into [0, extent]: memory past the buffers is never
// read, whatever the caller passed.
JV_HOST_DEVICE int64_t clamp_seqlen(int64_t n, int64_t extent) {
  return n < 0 ? 0 : (n > extent ? extent : n);
}

// Number of keys query row i (of seqlen_q rows) may attend to, given n valid keys: keys
// [0, limit) are allowed. Causal is tail-aligned: the queries are the last seqlen_q of the n
// positions. Worked example, seqlen_q = 4, n = 6: rows 0..3 see 3, 4, 5, 6 keys; with n = 2:
// rows 0..3 see -1 -> 0, 0, 1, 2 keys (the leading two rows are empty: zeros, lse = -inf).
JV_HOST_DEVICE int64_t allowed_keys(int64_t i, int64_t n, int64_t seqlen_q, bool is_causal) {
  if (!is_causal) return n;
  int64_t limit = i + n - seqlen_q + 1;
  return limit < 0 ? 0 : (limit > n ? n : limit);
}

}  // namespace jax_varlen
