// The split-KV workspace (layout in params.h): its size, which the handler checks against the
// buffer XLA allocated, and the index of one partial, which the split kernel writes and the
// combine kernel reads.
#pragma once

#include "params.h"

namespace jax_varlen::cuda {

// Packed rows (seqlen_q * group, see tile_scheduler.h) rounded up to whole 16-row blocks.
JV_HOST_DEVICE int64_t rows_padded(const AttentionParams& p) {
  const int64_t rows = p.seqlen_q * (p.num_heads / p.kv_num_heads);
  return (rows + 15) / 16 * 16;
}
JV_HOST_DEVICE int64_t max_splits(const AttentionParams& p) {
  return (p.seqlen_k + p.split_keys - 1) / p.split_keys;
}
// Partials in the workspace: one per (sequence, kv head, split, padded packed row).
JV_HOST_DEVICE int64_t split_partials(const AttentionParams& p) {
  return p.batch * p.kv_num_heads * max_splits(p) * rows_padded(p);
}
// Workspace floats: o_part [partials, head_dim_v] then lse_part [partials].
JV_HOST_DEVICE int64_t split_workspace_floats(const AttentionParams& p) {
  return split_partials(p) * (p.head_dim_v + 1);
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

}  // namespace jax_varlen::cuda
