// The split-KV workspace (layout in params.h, sizes in plan/limits.h): the index of one partial,
// which a split block writes and its row block's last block reads (fwd_split.cuh), and of
// each row block's arrival counter. Its size is the plan's (plan/plan.h), which the handler
// checks against the buffer XLA allocated.
#pragma once

#include "plan/limits.h"
#include "core/params.h"

namespace jax_varlen::cuda {

JV_HOST_DEVICE int64_t rows_padded(const AttentionParams& p) {
  return split_rows_padded(p.seqlen_q, p.num_heads / p.kv_num_heads);
}
JV_HOST_DEVICE int64_t max_splits(const AttentionParams& p) { return split_max_splits(p.seqlen_k, p.split_keys); }
// Partials in the workspace: one per (sequence, kv head, split, padded packed row).
JV_HOST_DEVICE int64_t split_partials(const AttentionParams& p) {
  return p.batch * split_partials_per_seq(p.seqlen_q, p.seqlen_k, p.num_heads, p.kv_num_heads, p.split_keys);
}

// Index of the partial of (sequence b, kv head g, split s, packed row r); split s + 1 of the same
// row is rows_padded(p) partials further.
JV_HOST_DEVICE int64_t split_partial(const AttentionParams& p, int64_t b, int64_t g, int64_t s, int64_t r) {
  return ((b * p.kv_num_heads + g) * max_splits(p) + s) * rows_padded(p) + r;
}
JV_HOST_DEVICE float* split_o_part(const AttentionParams& p) { return p.workspace; }
JV_HOST_DEVICE float* split_lse_part(const AttentionParams& p) {
  return p.workspace + split_partials(p) * p.head_dim_v;
}
// The split kernel's grid (fwd_split.cuh): splits (at least one: with no key at all, split 0
// still writes the empty rows) x (kv head x kSplitRowBlock-row block) x sequences. The launch
// sizes its grid by it and the persistent grid walks it.
struct SplitGrid {
  int64_t splits, head_rbs, batch;
  JV_HOST_DEVICE int64_t blocks() const { return splits * head_rbs * batch; }
};
JV_HOST_DEVICE SplitGrid split_grid(const AttentionParams& p) {
  const int64_t splits = max_splits(p);
  return {splits > 0 ? splits : 1, p.kv_num_heads * (rows_padded(p) / kSplitRowBlock), p.batch};
}
// Arrival counters, one per (sequence, kv head, kSplitRowBlock-row block of packed rows).
JV_HOST_DEVICE int64_t split_counters(const AttentionParams& p) {
  return p.batch * split_counters_per_seq(p.seqlen_q, p.num_heads, p.kv_num_heads);
}
JV_HOST_DEVICE int* split_counter(const AttentionParams& p, int64_t b, int64_t g, int64_t row_block) {
  int* counters = reinterpret_cast<int*>(split_lse_part(p) + split_partials(p));
  return counters + (b * p.kv_num_heads + g) * (rows_padded(p) / kSplitRowBlock) + row_block;
}

}  // namespace jax_varlen::cuda
