// The CPU forward: online softmax over the valid keys only, fp32 accumulation, its inner
// products blocked matrix products (gemm.h).
// Work is cut into independent items (sequence, kv head, block of query rows) so that a
// handler can spread them over threads; each item writes disjoint outputs, and its result
// does not depend on which thread runs it or on the batch, so runs are bitwise identical.
#pragma once

#include <cstdint>

#include "core/params.h"

namespace jax_varlen::cpu {

// One copy of the loops per instruction set (attention_cpu.cc is compiled for each).
#define JV_DECLARE_CPU_LOOPS(isa)                                   \
  namespace isa {                                                   \
  int64_t num_work_items(const AttentionParams& p);                 \
  void run_work_item(const AttentionParams& p, int64_t item);       \
  }
JV_DECLARE_CPU_LOOPS(baseline)
#if defined(__x86_64__)
JV_DECLARE_CPU_LOOPS(avx2)  // AVX2 + FMA: about 5x the baseline (SSE) here (benchmarks/NOTES.md)
#endif
#undef JV_DECLARE_CPU_LOOPS

int64_t num_work_items(const AttentionParams& p);

// Computes out and lse for one work item; items in [0, num_work_items(p)) cover everything.
// Runs the widest copy of the loops this machine supports (results are bitwise the same on a
// given machine; FMA may round differently from the baseline copy on another).
void run_work_item(const AttentionParams& p, int64_t item);

}  // namespace jax_varlen::cpu
