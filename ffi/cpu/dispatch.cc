// Picks the CPU loops for this machine once: AVX2 + FMA where the processor has them.
#include "cpu/attention_cpu.h"
#include "cpu/backward_cpu.h"

namespace jax_varlen::cpu {
namespace {

bool use_avx2() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

}  // namespace

int64_t num_work_items(const AttentionParams& p) { return baseline::num_work_items(p); }

void run_work_item(const AttentionParams& p, int64_t item) {
#if defined(__x86_64__)
  if (use_avx2()) return avx2::run_work_item(p, item);
#endif
  baseline::run_work_item(p, item);
}

int64_t num_bwd_delta_items(const BackwardParams& p) { return baseline::num_bwd_delta_items(p); }

void run_bwd_delta_item(const BackwardParams& p, int64_t item) {
#if defined(__x86_64__)
  if (use_avx2()) return avx2::run_bwd_delta_item(p, item);
#endif
  baseline::run_bwd_delta_item(p, item);
}

int64_t num_bwd_grad_items(const BackwardParams& p) { return baseline::num_bwd_grad_items(p); }

void run_bwd_grad_item(const BackwardParams& p, int64_t item) {
#if defined(__x86_64__)
  if (use_avx2()) return avx2::run_bwd_grad_item(p, item);
#endif
  baseline::run_bwd_grad_item(p, item);
}

}  // namespace jax_varlen::cpu
