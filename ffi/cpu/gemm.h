// The one matrix-product kernel of the CPU loops (forward and backward), float32:
//   C[m * ldc + n] (+)= sum_{K0_m <= k < K_m} A[m * am + k * ak] * B[k * ldb + n],   m < M, n < N,
// with N a multiple of kLanes, K0_m = 0 or k_begin[m], and K_m = K or min(K, k_end[m]) when
// per-row bounds are given (a causal or windowed tile: row m's products run over its allowed
// keys only, so a NaN or Inf in a key or value it may not see never meets its zero weight). A
// is read one scalar at a time (any strides), B and C by rows.
//
// Register tiles of kTileRows x kLanes accumulators walk C; each sums its products in the
// order k = K0_m, K0_m + 1, ... starting from 0 (or from C), so an element's bits depend on
// neither the tiling, nor M, nor N: the same row gives the same bits in any tile, item or batch.
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

// One MR x 16 tile of C. k_begin, k_end (or nullptr): the tile's rows' bounds, see above.
template <int MR>
JV_ALWAYS_INLINE void gemm_tile(int64_t K, const float* A, int64_t am, int64_t ak,
                                const float* B, int64_t ldb, float* C, int64_t ldc,
                                bool accumulate, const int64_t* k_begin, const int64_t* k_end) {
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
  // Row m's products run over [b_m, e_m). Rows take part alone while some row of the tile
  // has not begun (k < b_hi) or has ended (k >= e_lo); in between, all rows together. Causal
  // and windowed tiles: consecutive rows' bounds differ by one, so the parts taken alone are
  // at most MR - 1 steps long at each end (worked example, MR = 2, rows [3, 9) and [4, 10):
  // k = 3 row 0 alone, 4..8 both, 9 row 1 alone).
  int64_t b[MR], e[MR];
  int64_t b_lo = 0, b_hi = 0, e_lo = K, e_hi = K;
  for (int m = 0; m < MR; ++m) {
    b[m] = k_begin == nullptr ? 0 : std::max<int64_t>(0, k_begin[m]);
    e[m] = k_end == nullptr ? K : std::min(K, k_end[m]);
    b_lo = m ? std::min(b_lo, b[m]) : b[m];
    b_hi = m ? std::max(b_hi, b[m]) : b[m];
    e_lo = m ? std::min(e_lo, e[m]) : e[m];
    e_hi = m ? std::max(e_hi, e[m]) : e[m];
  }
  auto alone = [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const f32x8 b0 = load8(B + k * ldb), b1 = load8(B + k * ldb + 8);
      const float* a = A + k * ak;
      for (int m = 0; m < MR; ++m) {
        if (k < b[m] || k >= e[m]) continue;
        const f32x8 am_k = splat8(a[m * am]);
        c0[m] += am_k * b0;
        c1[m] += am_k * b1;
      }
    }
  };
  alone(b_lo, std::min(b_hi, e_hi));
  for (int64_t k = b_hi; k < e_lo; ++k) {
    const f32x8 b0 = load8(B + k * ldb), b1 = load8(B + k * ldb + 8);
    const float* a = A + k * ak;
    for (int m = 0; m < MR; ++m) {
      const f32x8 am_k = splat8(a[m * am]);
      c0[m] += am_k * b0;
      c1[m] += am_k * b1;
    }
  }
  alone(std::max(b_hi, e_lo), e_hi);
  for (int m = 0; m < MR; ++m) {
    store8(C + m * ldc, c0[m]);
    store8(C + m * ldc + 8, c1[m]);
  }
}

// Rows [0, M) of one 16-column strip: tiles of MR rows, the remainder with smaller tiles.
template <int MR>
void gemm_rows(int64_t M, int64_t K, const float* A, int64_t am, int64_t ak, const float* B,
               int64_t ldb, float* C, int64_t ldc, bool accumulate, const int64_t* k_begin,
               const int64_t* k_end) {
  auto at = [](const int64_t* bound, int64_t m) { return bound == nullptr ? nullptr : bound + m; };
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    gemm_tile<MR>(K, A + m * am, am, ak, B, ldb, C + m * ldc, ldc, accumulate, at(k_begin, m),
                  at(k_end, m));
  if constexpr (MR > 1) {
    if (m < M)
      gemm_rows<MR - 1>(M - m, K, A + m * am, am, ak, B, ldb, C + m * ldc, ldc, accumulate,
                        at(k_begin, m), at(k_end, m));
  }
}

inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t am, int64_t ak,
                 const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate,
                 const int64_t* k_end = nullptr, const int64_t* k_begin = nullptr) {
  // Column strips of B (K x 16, in cache) are reused across every row tile of A.
  for (int64_t n = 0; n < N; n += kLanes)
    gemm_rows<kTileRows>(M, K, A, am, ak, B + n, ldb, C + n, ldc, accumulate, k_begin, k_end);
}

}  // namespace jax_varlen::cpu::JV_CPU_ISA
