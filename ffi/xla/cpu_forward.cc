// XLA FFI handlers of the CPU forward, padded and packed, with and without sinks: validate, fill AttentionParams, and
// run the work items on XLA's intra-op thread pool (the calling thread works too).
#include "cpu/attention_cpu.h"
#include "cpu/packed_fill.h"
#include "cpu/parallel.h"
#include "xla/handler_common.h"

namespace jax_varlen {
namespace {

ffi::Error run_fwd(ffi::ThreadPool& pool, const ffi::ErrorOr<AttentionParams>& params) {
  if (!params) return params.error();
  const AttentionParams p = *params;
  // Packed: the rows no sequence owns first (the items never write them).
  if (p.cu_seqlens_q != nullptr)
    cpu::parallel_for(pool, cpu::num_fwd_fill_items(p),
                      [p](int64_t item) { cpu::run_fwd_fill_item(p, item); });
  cpu::parallel_for(pool, cpu::num_work_items(p),
                    [p](int64_t item) { cpu::run_work_item(p, item); });
  return ffi::Error::Success();
}

ffi::Error attention_fwd_cpu(ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key,
                             ffi::AnyBuffer value, ffi::Buffer<ffi::S32> nonpad_kv_seqlen,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                             ffi::Dictionary attrs) {
  const auto a = read_attrs(attrs, /*packed=*/false);
  if (!a) return a.error();
  return run_fwd(pool, make_params(query, key, value, nonpad_kv_seqlen, *out, *lse, *a));
}

ffi::Error packed_attention_fwd_cpu(ffi::ThreadPool pool, ffi::AnyBuffer query,
                                    ffi::AnyBuffer key, ffi::AnyBuffer value,
                                    ffi::Buffer<ffi::S32> cu_seqlens_q,
                                    ffi::Buffer<ffi::S32> cu_seqlens_k,
                                    ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                    ffi::Dictionary attrs) {
  const auto a = read_attrs(attrs, /*packed=*/true);
  if (!a) return a.error();
  return run_fwd(pool, make_packed_params(query, key, value, cu_seqlens_q, cu_seqlens_k, *out,
                                          *lse, *a));
}

// With attention sinks (params.h): the same, and sinks [H] after the lengths.
ffi::Error attention_fwd_sinks_cpu(ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key,
                                   ffi::AnyBuffer value, ffi::Buffer<ffi::S32> nonpad_kv_seqlen,
                                   ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> out,
                                   ffi::Result<ffi::Buffer<ffi::F32>> lse, ffi::Dictionary attrs) {
  const auto a = read_attrs(attrs, /*packed=*/false);
  if (!a) return a.error();
  return run_fwd(pool, with_sinks(make_params(query, key, value, nonpad_kv_seqlen, *out, *lse, *a), sinks));
}

ffi::Error packed_attention_fwd_sinks_cpu(ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key,
                                          ffi::AnyBuffer value, ffi::Buffer<ffi::S32> cu_seqlens_q,
                                          ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::Buffer<ffi::F32> sinks,
                                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                          ffi::Dictionary attrs) {
  const auto a = read_attrs(attrs, /*packed=*/true);
  if (!a) return a.error();
  return run_fwd(pool, with_sinks(make_packed_params(query, key, value, cu_seqlens_q, cu_seqlens_k, *out, *lse, *a),
                                  sinks));
}

}  // namespace
}  // namespace jax_varlen

JV_DEFINE_CPU_HANDLER(attention_fwd, kPadded, /*backward=*/false, /*sinks=*/false);
JV_DEFINE_CPU_HANDLER(packed_attention_fwd, kPacked, /*backward=*/false, /*sinks=*/false);
JV_DEFINE_CPU_HANDLER(attention_fwd_sinks, kPadded, /*backward=*/false, /*sinks=*/true);
JV_DEFINE_CPU_HANDLER(packed_attention_fwd_sinks, kPacked, /*backward=*/false, /*sinks=*/true);
