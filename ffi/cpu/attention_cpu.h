// The CPU forward: online softmax over the valid keys only, fp32 accumulation.
// Work is cut into independent items (sequence, kv head, block of query rows) so that a
// handler can spread them over threads; each item writes disjoint outputs, and its result
// does not depend on which thread runs it or on the batch, so runs are bitwise identical.
#pragma once

#include <cstdint>

#include "params.h"

namespace jax_varlen::cpu {

int64_t num_work_items(const AttentionParams& p);

// Computes out and lse for one work item; items in [0, num_work_items(p)) cover everything.
void run_work_item(const AttentionParams& p, int64_t item);

}  // namespace jax_varlen::cpu
