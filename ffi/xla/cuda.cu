// XLA FFI handlers of the CUDA forward (padded, packed, paged; with and without sinks) and
// backward (padded and packed). Lengths and offsets stay
// on the device (kernels read them), nothing is allocated and nothing synchronizes, so XLA may
// capture the calls into a CUDA graph.
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "cuda/launch.h"
#include "xla/handler_common.h"

namespace jax_varlen {
namespace {

// The plan of a call (plan/plan.h) on the current device, or why CUDA cannot take it.
ffi::ErrorOr<Plan> plan_call(const AttentionParams& p) {
  const int major = cuda::device_major();
  if (major == 0)
    return ffi::Unexpected(ffi::Error::Internal("jax_varlen: cannot read the CUDA device's compute capability"));
  Plan plan = make_plan(plan_inputs(p, major));
  if (!plan.unsupported.empty()) return ffi::Unexpected(ffi::Error::InvalidArgument(plan.unsupported));
  return plan;
}

// A workspace XLA allocated has the size the lowering asked for, from the same plan; any other
// size (an exported call from another jax_varlen, a caller of the FFI target) is an error, never
// another kernel.
ffi::Error check_workspace(const char* name, size_t given, int64_t num_packs, int64_t per_pack) {
  if (given == size_t(num_packs * per_pack)) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string("jax_varlen: ") + name + " has " + std::to_string(given) +
                                     " float32 elements, the plan expects " + std::to_string(num_packs) +
                                     " x " + std::to_string(per_pack) + " (packs x per pack)");
}

// The tensor-core kernels (every path but the portable one) move 16-byte chunks: a buffer they
// read or write at another alignment is an error naming it, never another kernel. (XLA's
// buffers are aligned; a caller of the FFI target may not be.)
ffi::Error check_aligned(std::initializer_list<std::pair<const char*, const void*>> buffers) {
  for (const auto& [name, ptr] : buffers)
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
      return ffi::Error::InvalidArgument(std::string("jax_varlen: ") + name +
                                         " must be 16-byte aligned for the tensor-core kernels; its address is " +
                                         std::to_string(reinterpret_cast<uintptr_t>(ptr) % 16) + " bytes past a multiple of 16");
  return ffi::Error::Success();
}

// The forward of either layout, once its params are made: the plan, its split-KV workspace, the
// launch.
ffi::Error run_fwd(ffi::ErrorOr<AttentionParams> params, cudaStream_t stream,
                   ffi::Result<ffi::Buffer<ffi::F32>> workspace) {
  if (!params) return params.error();
  AttentionParams& p = *params;
  const auto plan = plan_call(p);
  if (!plan) return plan.error();
  if (auto err = check_workspace("the forward's workspace", workspace->element_count(), p.num_packs,
                                 plan->fwd_workspace_per_pack);
      err.failure())
    return err;
  const bool paged = p.block_table != nullptr;  // the keys are key_cache and value_cache
  if (plan->fwd_path != FwdPath::kPortable)
    if (auto err = check_aligned({{"query", p.q}, {paged ? "key_cache" : "key", p.k},
                                  {paged ? "value_cache" : "value", p.v}, {"out", p.out}});
        err.failure())
      return err;
  p.workspace = workspace->typed_data();
  p.split_keys = plan->split_keys;
  p.split_persistent = plan->split_persistent;
  p.pack_gqa = plan->pack_gqa;
  p.dynamic_units = plan->dynamic_units;
  p.fwd_block_n = plan->fwd_block_n;
  p.lean_units = plan->lean_units;
  p.fwd_plain_tiles = plan->fwd_plain_tiles;
  p.fwd_mixed_order = plan->fwd_mixed_order;
  if (p.num_packs * p.pack_rows_q == 0 || p.num_heads == 0) return ffi::Error::Success();  // no output
  const cudaError_t err = cuda::run_fwd(p, *plan, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_varlen: CUDA forward failed: ") +
                                cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error attention_fwd_cuda(cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer key,
                              ffi::AnyBuffer value, ffi::Buffer<ffi::S32> nonpad_kv_seqlen,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::Buffer<ffi::F32>> lse,
                              ffi::Result<ffi::Buffer<ffi::F32>> workspace, ffi::Dictionary attrs) {
  const auto a = read_attrs(attrs, /*packed=*/false);
  if (!a) return a.error();
  return run_fwd(make_params(query, key, value, nonpad_kv_seqlen, *out, *lse, *a), stream, workspace);
}

ffi::Error packed_attention_fwd_cuda(cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer key,
                                     ffi::AnyBuffer value, ffi::Buffer<ffi::S32> cu_seqlens_q,
                                     ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::Result<ffi::AnyBuffer> out,
                                     ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                     ffi::Result<ffi::Buffer<ffi::F32>> workspace, ffi::Dictionary attrs) {
  const auto a = read_attrs(attrs, /*packed=*/true);
  if (!a) return a.error();
  return run_fwd(make_packed_params(query, key, value, cu_seqlens_q, cu_seqlens_k, *out, *lse, *a), stream,
                 workspace);
}

// With attention sinks (params.h): the same, and sinks [H] after the lengths.
ffi::Error attention_fwd_sinks_cuda(cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer key,
                                    ffi::AnyBuffer value, ffi::Buffer<ffi::S32> nonpad_kv_seqlen,
                                    ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                    ffi::Result<ffi::Buffer<ffi::F32>> workspace, ffi::Dictionary attrs) {
  const auto a = read_attrs(attrs, /*packed=*/false);
  if (!a) return a.error();
  return run_fwd(with_sinks(make_params(query, key, value, nonpad_kv_seqlen, *out, *lse, *a), sinks), stream,
                 workspace);
}

ffi::Error packed_attention_fwd_sinks_cuda(cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer key,
                                           ffi::AnyBuffer value, ffi::Buffer<ffi::S32> cu_seqlens_q,
                                           ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::Buffer<ffi::F32> sinks,
                                           ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                           ffi::Result<ffi::Buffer<ffi::F32>> workspace, ffi::Dictionary attrs) {
  const auto a = read_attrs(attrs, /*packed=*/true);
  if (!a) return a.error();
  return run_fwd(
      with_sinks(make_packed_params(query, key, value, cu_seqlens_q, cu_seqlens_k, *out, *lse, *a), sinks),
      stream, workspace);
}

// The paged forward (make_paged_params): the split-KV kernel reads the caches' pages in place,
// and so does the Hopper forward for longer query runs when JAX_VARLEN_PAGED_SM90=1 (plan.h).
// The plan takes it or says why not (the Python lowering asks first and gathers the pages into
// dense keys instead); caches that are not 16-byte aligned are an error (run_fwd), never
// another kernel.
ffi::Error paged_attention_fwd_cuda(cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                                    ffi::AnyBuffer value_cache, ffi::Buffer<ffi::S32> seqlens_k,
                                    ffi::Buffer<ffi::S32> block_table, ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                    ffi::Result<ffi::Buffer<ffi::F32>> workspace, ffi::Dictionary attrs) {
  const auto a = read_attrs(attrs, /*packed=*/false);
  if (!a) return a.error();
  return run_fwd(make_paged_params(query, key_cache, value_cache, seqlens_k, block_table, *out, *lse, *a), stream,
                 workspace);
}

// The backward of either layout (params.h, BackwardParams): d_query, d_key, d_value and the
// delta workspace. Every element of the gradients is written, padded keys' rows (and packed
// rows no sequence owns) with zeros.
ffi::Error run_bwd(ffi::ErrorOr<BackwardParams> params, cudaStream_t stream,
                   ffi::Result<ffi::Buffer<ffi::F32>> dq_workspace) {
  if (!params) return params.error();
  BackwardParams bp = *params;
  const auto plan = plan_call(bp.fwd);
  if (!plan) return plan.error();
  if (auto err = check_workspace("the dQ workspace", dq_workspace->element_count(), bp.fwd.num_packs,
                                 plan->dq_workspace_per_pack);
      err.failure())
    return err;
  bp.dq_accum = dq_workspace->typed_data();
  const AttentionParams& p = bp.fwd;
  if (plan->bwd_path != BwdPath::kPortable)
    if (auto err = check_aligned({{"query", p.q}, {"key", p.k}, {"value", p.v}, {"out", p.out}, {"d_out", bp.d_out},
                                  {"d_query", bp.d_q}, {"d_key", bp.d_k}, {"d_value", bp.d_v}});
        err.failure())
      return err;
  if (plan->bwd_path == BwdPath::kSm90)
    if (auto err = check_aligned({{"the dQ workspace", bp.dq_accum}}); err.failure()) return err;
  if (bp.fwd.num_packs == 0 || bp.fwd.num_heads == 0) return ffi::Error::Success();
  const cudaError_t err = cuda::run_bwd(bp, *plan, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_varlen: CUDA backward failed: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error attention_bwd_cuda(cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer key,
                              ffi::AnyBuffer value, ffi::Buffer<ffi::S32> nonpad_kv_seqlen,
                              ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer d_out,
                              ffi::Buffer<ffi::F32> d_lse, ffi::Result<ffi::AnyBuffer> d_query,
                              ffi::Result<ffi::AnyBuffer> d_key, ffi::Result<ffi::AnyBuffer> d_value,
                              ffi::Result<ffi::Buffer<ffi::F32>> delta,
                              ffi::Result<ffi::Buffer<ffi::F32>> dq_workspace, ffi::Dictionary attrs) {
  const auto a = read_attrs(attrs, /*packed=*/false);
  if (!a) return a.error();
  auto fwd = make_params(query, key, value, nonpad_kv_seqlen, out, lse, *a);
  return run_bwd(make_bwd_params(fwd, query, key, value, out, lse, d_out, d_lse, *d_query, *d_key, *d_value, *delta),
                 stream, dq_workspace);
}

ffi::Error packed_attention_bwd_cuda(cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer key,
                                     ffi::AnyBuffer value, ffi::Buffer<ffi::S32> cu_seqlens_q,
                                     ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::AnyBuffer out,
                                     ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer d_out, ffi::Buffer<ffi::F32> d_lse,
                                     ffi::Result<ffi::AnyBuffer> d_query, ffi::Result<ffi::AnyBuffer> d_key,
                                     ffi::Result<ffi::AnyBuffer> d_value, ffi::Result<ffi::Buffer<ffi::F32>> delta,
                                     ffi::Result<ffi::Buffer<ffi::F32>> dq_workspace, ffi::Dictionary attrs) {
  const auto a = read_attrs(attrs, /*packed=*/true);
  if (!a) return a.error();
  auto fwd = make_packed_params(query, key, value, cu_seqlens_q, cu_seqlens_k, out, lse, *a);
  return run_bwd(make_bwd_params(fwd, query, key, value, out, lse, d_out, d_lse, *d_query, *d_key, *d_value, *delta),
                 stream, dq_workspace);
}

}  // namespace
}  // namespace jax_varlen

JV_DEFINE_CUDA_HANDLER(attention_fwd, kPadded, /*backward=*/false, /*sinks=*/false);
JV_DEFINE_CUDA_HANDLER(paged_attention_fwd, kPaged, /*backward=*/false, /*sinks=*/false);
JV_DEFINE_CUDA_HANDLER(attention_bwd, kPadded, /*backward=*/true, /*sinks=*/false);
JV_DEFINE_CUDA_HANDLER(packed_attention_fwd, kPacked, /*backward=*/false, /*sinks=*/false);
JV_DEFINE_CUDA_HANDLER(packed_attention_bwd, kPacked, /*backward=*/true, /*sinks=*/false);
JV_DEFINE_CUDA_HANDLER(attention_fwd_sinks, kPadded, /*backward=*/false, /*sinks=*/true);
JV_DEFINE_CUDA_HANDLER(packed_attention_fwd_sinks, kPacked, /*backward=*/false, /*sinks=*/true);
