// XLA FFI handler of the CPU forward: validate, fill AttentionParams, and run the work items
// on XLA's intra-op thread pool (the calling thread works too).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "cpu/attention_cpu.h"
#include "handler_common.h"

namespace jax_varlen {
namespace {

// Items are claimed from a shared counter; the caller waits until every item is done.
// The state is shared-owned, so a pool task that starts late finds no work and touches
// nothing else.
struct ParallelState {
  AttentionParams params;
  int64_t num_items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void work() {
    for (int64_t i; (i = next.fetch_add(1)) < num_items;) {
      cpu::run_work_item(params, i);
      if (done.fetch_add(1) + 1 == num_items) {
        std::lock_guard<std::mutex> lock(mu);
        all_done.notify_all();
      }
    }
  }
};

ffi::Error attention_fwd_cpu(ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key,
                             ffi::AnyBuffer value, ffi::Buffer<ffi::S32> nonpad_kv_seqlen,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                             float scale, bool is_causal, float softcap) {
  auto params = make_params(query, key, value, nonpad_kv_seqlen, *out, *lse, scale, is_causal,
                            softcap);
  if (!params) return params.error();
  auto state = std::make_shared<ParallelState>();
  state->params = *params;
  state->num_items = cpu::num_work_items(*params);
  if (state->num_items == 0) return ffi::Error::Success();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), state->num_items - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state] { state->work(); });
  state->work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->all_done.wait(lock, [&] { return state->done.load() == state->num_items; });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_varlen

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_varlen_attention_fwd_cpu, jax_varlen::attention_fwd_cpu,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::ThreadPool>()                    // XLA's intra-op pool
        .Arg<xla::ffi::AnyBuffer>()                     // query [B, Sq, H, D]
        .Arg<xla::ffi::AnyBuffer>()                     // key [B, Skv, Hkv, D]
        .Arg<xla::ffi::AnyBuffer>()                     // value [B, Skv, Hkv, Dv]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // nonpad_kv_seqlen [B]
        .Ret<xla::ffi::AnyBuffer>()                     // out [B, Sq, H, Dv]
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // lse [B, H, Sq]
        .Attr<float>("scale")                           // multiplies <q, k>
        .Attr<bool>("is_causal")                        // tail-aligned causal mask
        .Attr<float>("softcap"));                       // 0 = off
