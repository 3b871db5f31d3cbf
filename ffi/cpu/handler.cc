// XLA FFI handler of the CPU forward: validate, fill AttentionParams, and run the work items
// on XLA's intra-op thread pool (the calling thread works too).
#include "cpu/attention_cpu.h"
#include "cpu/parallel.h"
#include "handler_common.h"

namespace jax_varlen {
namespace {

ffi::Error attention_fwd_cpu(ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key,
                             ffi::AnyBuffer value, ffi::Buffer<ffi::S32> nonpad_kv_seqlen,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                             float scale, bool is_causal, float softcap) {
  auto params = make_params(query, key, value, nonpad_kv_seqlen, *out, *lse, scale, is_causal,
                            softcap);
  if (!params) return params.error();
  const AttentionParams p = *params;
  cpu::parallel_for(pool, cpu::num_work_items(p),
                    [p](int64_t item) { cpu::run_work_item(p, item); });
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
