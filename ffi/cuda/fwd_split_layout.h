// Sizes of the split-KV workspace (layout in params.h), shared by the handler, which checks
// the buffer XLA allocated, and the kernels, which index it.
#pragma once

#include "params.h"

namespace jax_varlen::cuda {

JV_HOST_DEVICE int64_t rows_padded(const AttentionParams& p) {
  const int64_t rows = p.seqlen_q * (p.num_heads / p.kv_num_heads);
  return (rows + 15) / 16 * 16;
}
JV_HOST_DEVICE int64_t max_splits(const AttentionParams& p) {
  return (p.seqlen_k + p.split_keys - 1) / p.split_keys;
}
// Workspace floats: o_part then lse_part (layout in params.h).
JV_HOST_DEVICE int64_t split_workspace_floats(const AttentionParams& p) {
  return p.batch * p.kv_num_heads * max_splits(p) * rows_padded(p) * (p.head_dim_v + 1);
}

}  // namespace jax_varlen::cuda
