// The packed layout's rows that no sequence owns (seqlen.h, row_owned: rows past a pack's last
// offset, or cut off by a clamped length): the kernels never write them, so the handlers zero
// them first. Work items of kFillRows rows for parallel_for, each writing only its own rows.
#pragma once

#include <cstdint>

#include "core/params.h"

namespace jax_varlen::cpu {

// Forward: items over the query rows; unowned rows get out = 0 and lse = -inf (every head).
int64_t num_fwd_fill_items(const AttentionParams& p);
void run_fwd_fill_item(const AttentionParams& p, int64_t item);

// Backward: items over the query rows (d_query = 0), then over the key rows (d_key = d_value =
// 0), for unowned rows.
int64_t num_bwd_fill_items(const BackwardParams& bp);
void run_bwd_fill_item(const BackwardParams& bp, int64_t item);

}  // namespace jax_varlen::cpu
