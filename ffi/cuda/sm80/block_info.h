// Which rows a thread block owns, and how many key tiles it must visit.
//
// The query heads of one kv-head group are packed into the row (M) dimension, so a K/V tile
// loaded once serves every query head that reads it (GQA/MQA):
//   packed row r in [0, seqlen_q * group)  ->  query position i = r / group,
//                                              query head h = kv_head * group + r % group.
// Example, group = 4 (H = 32, Hkv = 8), Sq = 1 (decode): one 16-row tile holds the 4 heads
// of a group instead of 1 useful row out of 16.
#pragma once

#include "core/seqlen.h"

namespace jax_varlen::cuda {

struct BlockInfo {
  SeqlenInfo seq;     // the block's sequence: offsets, seqlen_q, valid keys seqlen_k
  int64_t row_begin;  // first packed row of the block
  int64_t row_end;    // one past the last packed row (<= seq.seqlen_q * group)
  // The rows' allowed keys (mask.h, key_range; both bounds grow with the row):
  int64_t min_first;  // first allowed key of the block's first row: tiles below it are never loaded
  int64_t max_first;  // first allowed key of its last row: tiles at or past it need no left mask
  int64_t min_limit;  // end of the block's first row's keys: tiles before it need no right mask
  int64_t max_limit;  // end of its last row's keys: tiles at or past it are never loaded

  __device__ BlockInfo(const AttentionParams& p, int64_t b, int64_t m_block, int block_m) : seq(p, b) {
    const int64_t group = p.num_heads / p.kv_num_heads;
    const int64_t rows = seq.seqlen_q * group;
    row_begin = m_block * block_m;
    row_end = row_begin + block_m < rows ? row_begin + block_m : rows;
    const Range first = key_range(p.mask(), row_begin / group, seq.seqlen_k, seq.seqlen_q);
    const Range last = key_range(p.mask(), (row_end - 1) / group, seq.seqlen_k, seq.seqlen_q);
    min_first = first.begin;
    max_first = last.begin;
    min_limit = first.end;
    max_limit = last.end;
  }

  // True for a block past its sequence's rows (a packed batch's grid covers the longest one).
  __device__ bool past_end() const { return row_begin >= row_end; }
};

}  // namespace jax_varlen::cuda
