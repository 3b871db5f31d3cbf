// XLA FFI handlers of the CPU backward, padded and packed: validate, fill BackwardParams, and
// run the passes of work items (backward_cpu.h) on XLA's intra-op thread pool, one after the
// other.
#include "cpu/backward_cpu.h"
#include "cpu/packed_fill.h"
#include "cpu/parallel.h"
#include "xla/handler_common.h"

namespace jax_varlen {
namespace {

ffi::Error run_bwd(ffi::ThreadPool& pool, const ffi::ErrorOr<BackwardParams>& params) {
  if (!params) return params.error();
  const BackwardParams p = *params;
  // Packed: the rows no sequence owns first (the items never write them).
  if (p.fwd.cu_seqlens_q != nullptr)
    cpu::parallel_for(pool, cpu::num_bwd_fill_items(p),
                      [p](int64_t item) { cpu::run_bwd_fill_item(p, item); });
  cpu::parallel_for(pool, cpu::num_bwd_delta_items(p),
                    [p](int64_t item) { cpu::run_bwd_delta_item(p, item); });
  cpu::parallel_for(pool, cpu::num_bwd_grad_items(p),
                    [p](int64_t item) { cpu::run_bwd_grad_item(p, item); });
  return ffi::Error::Success();
}

ffi::Error attention_bwd_cpu(ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key,
                             ffi::AnyBuffer value, ffi::Buffer<ffi::S32> nonpad_kv_seqlen,
                             ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer d_out,
                             ffi::Buffer<ffi::F32> d_lse, ffi::Result<ffi::AnyBuffer> d_query,
                             ffi::Result<ffi::AnyBuffer> d_key,
                             ffi::Result<ffi::AnyBuffer> d_value,
                             ffi::Result<ffi::Buffer<ffi::F32>> delta, ffi::Dictionary attrs) {
  const auto a = read_attrs(attrs, /*packed=*/false);
  if (!a) return a.error();
  auto fwd = make_params(query, key, value, nonpad_kv_seqlen, out, lse, *a);
  return run_bwd(pool, make_bwd_params(fwd, query, key, value, out, lse, d_out, d_lse, *d_query,
                                       *d_key, *d_value, *delta));
}

ffi::Error packed_attention_bwd_cpu(
    ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key, ffi::AnyBuffer value,
    ffi::Buffer<ffi::S32> cu_seqlens_q, ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::AnyBuffer out,
    ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer d_out, ffi::Buffer<ffi::F32> d_lse,
    ffi::Result<ffi::AnyBuffer> d_query, ffi::Result<ffi::AnyBuffer> d_key,
    ffi::Result<ffi::AnyBuffer> d_value, ffi::Result<ffi::Buffer<ffi::F32>> delta,
    ffi::Dictionary attrs) {
  const auto a = read_attrs(attrs, /*packed=*/true);
  if (!a) return a.error();
  auto fwd = make_packed_params(query, key, value, cu_seqlens_q, cu_seqlens_k, out, lse, *a);
  return run_bwd(pool, make_bwd_params(fwd, query, key, value, out, lse, d_out, d_lse, *d_query,
                                       *d_key, *d_value, *delta));
}

}  // namespace
}  // namespace jax_varlen

JV_DEFINE_CPU_HANDLER(attention_bwd, kPadded, /*backward=*/true, /*sinks=*/false);
JV_DEFINE_CPU_HANDLER(packed_attention_bwd, kPacked, /*backward=*/true, /*sinks=*/false);
