// Which rows a thread block owns, and how many key tiles it must visit.
//
// The query heads of one kv-head group are packed into the row (M) dimension, so a K/V tile
// loaded once serves every query head that reads it (GQA/MQA):
//   packed row r in [0, seqlen_q * group)  ->  query position i = r / group,
//                                              query head h = kv_head * group + r % group.
// Example, group = 4 (H = 32, Hkv = 8), Sq = 1 (decode): one 16-row tile holds the 4 heads
// of a group instead of 1 useful row out of 16.
#pragma once

#include "params.h"

namespace jax_varlen::cuda {

struct BlockInfo {
  int64_t n;          // valid keys of this sequence, clamped into [0, seqlen_k]
  int64_t row_begin;  // first packed row of the block
  int64_t row_end;    // one past the last packed row (<= seqlen_q * group)
  int64_t min_limit;  // allowed keys of the block's first row (limits grow with the row)
  int64_t max_limit;  // allowed keys of the block's last row: tiles past it are never loaded

  __device__ BlockInfo(const AttentionParams& p, int64_t b, int64_t m_block, int block_m) {
    const int64_t group = p.num_heads / p.kv_num_heads;
    n = clamp_seqlen(p.nonpad_kv_seqlen[b], p.seqlen_k);
    row_begin = m_block * block_m;
    row_end = row_begin + block_m < p.seqlen_q * group ? row_begin + block_m : p.seqlen_q * group;
    min_limit = allowed_keys(row_begin / group, n, p.seqlen_q, p.is_causal);
    max_limit = allowed_keys((row_end - 1) / group, n, p.seqlen_q, p.is_causal);
  }
};

}  // namespace jax_varlen::cuda
