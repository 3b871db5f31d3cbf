// Input rows (any of the three dtypes) as float32 operands for gemm.h: read in place (float),
// converted by rows, or transposed into a thread's scratch; and the sizing of that scratch.
// Included only by the per-instruction-set files (simd.h says why).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu/numeric.h"

namespace jax_varlen::cpu::JV_CPU_ISA {

// Grows a thread's scratch vector to at least `size` elements (never shrinks it).
template <typename V>
void ensure(V& v, int64_t size) {
  if (int64_t(v.size()) < size) v.resize(size);
}

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

// A float32 view of rows r < rows, columns c < cols of src (row stride row_stride), with row
// stride ld >= cols and columns [cols, ld) zero: float input with ld == cols is read in place
// (no copy: the products read it directly); anything else is converted into scratch. Returns
// the view; *view_ld gets its row stride.
template <typename T>
const float* rows_as_float(const T* src, int64_t row_stride, int64_t rows, int64_t cols,
                           int64_t ld, std::vector<float>& scratch, int64_t* view_ld) {
  if constexpr (std::is_same_v<T, float>) {
    if (ld == cols) {
      *view_ld = row_stride;
      return src;
    }
  }
  ensure(scratch, rows * ld);
  load_rows(src, row_stride, rows, cols, scratch.data(), ld);
  *view_ld = ld;
  return scratch.data();
}

}  // namespace jax_varlen::cpu::JV_CPU_ISA
