#include "cpu/packed_fill.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/seqlen.h"

namespace jax_varlen::cpu {
namespace {

constexpr int64_t kFillRows = 256;  // rows of one item

int64_t blocks(int64_t rows) { return (rows + kFillRows - 1) / kFillRows; }

int64_t elem_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// Zero bits are 0.0 in every float dtype: row r of a [rows, heads, dim] tensor, all heads.
void zero_row(void* base, const AttentionParams& p, int64_t r, int64_t row_stride,
              int64_t heads, int64_t head_stride, int64_t dim) {
  const int64_t bytes = elem_bytes(p.dtype);
  for (int64_t h = 0; h < heads; ++h)
    std::memset(static_cast<char*>(base) + (r * row_stride + h * head_stride) * bytes, 0,
                dim * bytes);
}

// Rows [first, last) of block `item` among `rows` rows.
void block_rows(int64_t item, int64_t rows, int64_t& first, int64_t& last) {
  first = item * kFillRows;
  last = std::min(rows, first + kFillRows);
}

}  // namespace

int64_t num_fwd_fill_items(const AttentionParams& p) {
  return blocks(p.num_packs * p.pack_rows_q);
}

void run_fwd_fill_item(const AttentionParams& p, int64_t item) {
  int64_t first, last;
  block_rows(item, p.num_packs * p.pack_rows_q, first, last);
  for (int64_t r = first; r < last; ++r) {
    if (row_owned(p, r, /*keys=*/false)) continue;
    zero_row(p.out, p, r, p.out_row_stride, p.num_heads, p.out_head_stride, p.head_dim_v);
    // lse [num_packs, num_heads, pack_rows_q]: row r is (pack r / rows, row r % rows).
    const int64_t pack = r / p.pack_rows_q, local = r % p.pack_rows_q;
    for (int64_t h = 0; h < p.num_heads; ++h)
      p.lse[(pack * p.num_heads + h) * p.pack_rows_q + local] =
          -std::numeric_limits<float>::infinity();
  }
}

int64_t num_bwd_fill_items(const BackwardParams& bp) {
  const AttentionParams& p = bp.fwd;
  return blocks(p.num_packs * p.pack_rows_q) + blocks(p.num_packs * p.pack_rows_k);
}

void run_bwd_fill_item(const BackwardParams& bp, int64_t item) {
  const AttentionParams& p = bp.fwd;
  const int64_t q_items = blocks(p.num_packs * p.pack_rows_q);
  int64_t first, last;
  if (item < q_items) {
    block_rows(item, p.num_packs * p.pack_rows_q, first, last);
    for (int64_t r = first; r < last; ++r)
      if (!row_owned(p, r, /*keys=*/false))
        zero_row(bp.d_q, p, r, p.q_row_stride, p.num_heads, p.q_head_stride, p.head_dim);
    return;
  }
  block_rows(item - q_items, p.num_packs * p.pack_rows_k, first, last);
  for (int64_t r = first; r < last; ++r) {
    if (row_owned(p, r, /*keys=*/true)) continue;
    zero_row(bp.d_k, p, r, p.k_row_stride, p.kv_num_heads, p.k_head_stride, p.head_dim);
    zero_row(bp.d_v, p, r, p.v_row_stride, p.kv_num_heads, p.v_head_stride, p.head_dim_v);
  }
}

}  // namespace jax_varlen::cpu
