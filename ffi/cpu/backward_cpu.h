// The CPU backward (math: BackwardParams in params.h), in two passes of independent work items
// that a handler spreads over threads:
//   pass 1  delta[b, h, i] = <d_out_i, out_i> - d_lse_i, items (sequence, block of query rows);
//   pass 2  items (sequence, kv head, block of keys) computing d_key and d_value of the block
//           over its group's query heads and the query rows that see it, and items (sequence,
//           kv head, block of query rows) computing d_query over the allowed keys.
// Every output element is written by exactly one item, each item sums in a fixed order that
// depends only on its own sequence (never on the batch, the thread or the timing), and only the
// valid keys are read: runs are bitwise identical and a sequence's gradients do not depend on
// its batch-mates. Accumulation is float32 for every dtype (inputs upcast).
#pragma once

#include <cstdint>

#include "core/params.h"

namespace jax_varlen::cpu {

// One copy of the loops per instruction set (backward_cpu.cc is compiled for each).
#define JV_DECLARE_CPU_BWD_LOOPS(isa)                                  \
  namespace isa {                                                      \
  int64_t num_bwd_delta_items(const BackwardParams& p);                \
  void run_bwd_delta_item(const BackwardParams& p, int64_t item);      \
  int64_t num_bwd_grad_items(const BackwardParams& p);                 \
  void run_bwd_grad_item(const BackwardParams& p, int64_t item);       \
  }
JV_DECLARE_CPU_BWD_LOOPS(baseline)
#if defined(__x86_64__)
JV_DECLARE_CPU_BWD_LOOPS(avx2)
#endif
#undef JV_DECLARE_CPU_BWD_LOOPS

// Pass 1: items [0, num_bwd_delta_items(p)) write delta.
int64_t num_bwd_delta_items(const BackwardParams& p);
void run_bwd_delta_item(const BackwardParams& p, int64_t item);

// Pass 2 (after pass 1 is complete: it reads delta): items [0, num_bwd_grad_items(p)) write
// d_query, d_key and d_value, padded keys' rows included (exactly zero).
int64_t num_bwd_grad_items(const BackwardParams& p);
void run_bwd_grad_item(const BackwardParams& p, int64_t item);

}  // namespace jax_varlen::cpu
