// XLA FFI handler of the CPU backward: validate, fill BackwardParams, and run the two passes
// of work items (backward_cpu.h) on XLA's intra-op thread pool, one after the other.
#include "cpu/backward_cpu.h"
#include "cpu/parallel.h"
#include "handler_common.h"

namespace jax_varlen {
namespace {

ffi::Error attention_bwd_cpu(ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key,
                             ffi::AnyBuffer value, ffi::Buffer<ffi::S32> nonpad_kv_seqlen,
                             ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer d_out,
                             ffi::Buffer<ffi::F32> d_lse, ffi::Result<ffi::AnyBuffer> d_query,
                             ffi::Result<ffi::AnyBuffer> d_key,
                             ffi::Result<ffi::AnyBuffer> d_value,
                             ffi::Result<ffi::Buffer<ffi::F32>> delta, float scale,
                             bool is_causal, float softcap) {
  auto params = make_bwd_params(query, key, value, nonpad_kv_seqlen, out, lse, d_out, d_lse,
                                *d_query, *d_key, *d_value, *delta, scale, is_causal, softcap);
  if (!params) return params.error();
  const BackwardParams p = *params;
  cpu::parallel_for(pool, cpu::num_bwd_delta_items(p),
                    [p](int64_t item) { cpu::run_bwd_delta_item(p, item); });
  cpu::parallel_for(pool, cpu::num_bwd_grad_items(p),
                    [p](int64_t item) { cpu::run_bwd_grad_item(p, item); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_varlen

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_varlen_attention_bwd_cpu, jax_varlen::attention_bwd_cpu,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::ThreadPool>()                    // XLA's intra-op pool
        .Arg<xla::ffi::AnyBuffer>()                     // query [B, Sq, H, D]
        .Arg<xla::ffi::AnyBuffer>()                     // key [B, Skv, Hkv, D]
        .Arg<xla::ffi::AnyBuffer>()                     // value [B, Skv, Hkv, Dv]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // nonpad_kv_seqlen [B]
        .Arg<xla::ffi::AnyBuffer>()                     // out [B, Sq, H, Dv]
        .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // lse [B, H, Sq]
        .Arg<xla::ffi::AnyBuffer>()                     // d_out [B, Sq, H, Dv], out's dtype
        .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // d_lse [B, H, Sq]
        .Ret<xla::ffi::AnyBuffer>()                     // d_query [B, Sq, H, D]
        .Ret<xla::ffi::AnyBuffer>()                     // d_key [B, Skv, Hkv, D]
        .Ret<xla::ffi::AnyBuffer>()                     // d_value [B, Skv, Hkv, Dv]
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // delta [B, H, Sq], workspace
        .Attr<float>("scale")                           // multiplies <q, k>
        .Attr<bool>("is_causal")                        // tail-aligned causal mask
        .Attr<float>("softcap"));                       // 0 = off
