// The one matrix-product kernel of the CPU loops (forward and backward), float32:
//   C[m * ldc + n] (+)= sum_{k < K_m} A[m * am + k * ak] * B[k * ldb + n],   m < M, n < N,
// with N a multiple of kLanes, and K_m = K, or min(K, k_end[m]) when per-row ends are given
// (a causal tile: row m's products stop at its last allowed key, so a NaN or Inf in a key or
// value it may not see never meets its zero weight). A is read one scalar at a time (any
// strides), B and C by rows.
//
// Register tiles of kTileRows x kLanes accumulators walk C; each sums its K products in the
// order k = 0, 1, ... starting from 0 (or from C), so an element's bits depend on neither the
// tiling, nor M, nor N: the same row gives the same bits in any tile, item or batch.
// Included only by the per-instruction-set files (simd.h says why).
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/simd.h"

namespace jax_varlen::cpu::JV_CPU_ISA {

constexpr int64_t kLanes = 16;  // the column tile: two 8-float vectors

// Rows of A per register tile: 6 x 16 accumulators fill 12 of AVX's 16 vector registers
// (2 for B, 1 for the broadcast of A); the baseline (SSE: two registers per f32x8, 16 in all)
// takes 2.
#if defined(__AVX__)
constexpr int kTileRows = 6;
#else
constexpr int kTileRows = 2;
#endif

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// One MR x 16 tile of C. k_end (or nullptr): the tile's rows' ends, see above.
template <int MR>
JV_ALWAYS_INLINE void gemm_tile(int64_t K, const float* A, int64_t am, int64_t ak,
                                const float* B, int64_t ldb, float* C, int64_t ldc,
                                bool accumulate, const int64_t* k_end) {
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
  // Every row runs to k_lo; rows with a longer end continue alone to k_hi (causal tiles:
  // consecutive rows' ends differ by one, so this tail is at most MR - 1 steps long).
  int64_t k_lo = K, k_hi = K;
  if (k_end != nullptr) {
    k_lo = k_hi = std::min(K, k_end[0]);
    for (int m = 1; m < MR; ++m) {
      k_lo = std::min(k_lo, std::min(K, k_end[m]));
      k_hi = std::max(k_hi, std::min(K, k_end[m]));
    }
  }
  int64_t k = 0;
  for (; k < k_lo; ++k) {
    const f32x8 b0 = load8(B + k * ldb), b1 = load8(B + k * ldb + 8);
    const float* a = A + k * ak;
    for (int m = 0; m < MR; ++m) {
      const f32x8 am_k = splat8(a[m * am]);
      c0[m] += am_k * b0;
      c1[m] += am_k * b1;
    }
  }
  for (; k < k_hi; ++k) {
    const f32x8 b0 = load8(B + k * ldb), b1 = load8(B + k * ldb + 8);
    const float* a = A + k * ak;
    for (int m = 0; m < MR; ++m) {
      if (k >= k_end[m]) continue;
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

// Rows [0, M) of one 16-column strip: tiles of MR rows, the remainder with smaller tiles.
template <int MR>
void gemm_rows(int64_t M, int64_t K, const float* A, int64_t am, int64_t ak, const float* B,
               int64_t ldb, float* C, int64_t ldc, bool accumulate, const int64_t* k_end) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    gemm_tile<MR>(K, A + m * am, am, ak, B, ldb, C + m * ldc, ldc, accumulate,
                  k_end == nullptr ? nullptr : k_end + m);
  if constexpr (MR > 1) {
    if (m < M)
      gemm_rows<MR - 1>(M - m, K, A + m * am, am, ak, B, ldb, C + m * ldc, ldc, accumulate,
                        k_end == nullptr ? nullptr : k_end + m);
  }
}

inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t am, int64_t ak,
                 const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate,
                 const int64_t* k_end = nullptr) {
  // Column strips of B (K x 16, in cache) are reused across every row tile of A.
  for (int64_t n = 0; n < N; n += kLanes)
    gemm_rows<kTileRows>(M, K, A, am, ak, B + n, ldb, C + n, ldc, accumulate, k_end);
}

}  // namespace jax_varlen::cpu::JV_CPU_ISA
