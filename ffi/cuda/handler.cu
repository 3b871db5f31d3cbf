// XLA FFI handlers of the CUDA forward and backward, padded and packed. Lengths and offsets stay
// on the device (kernels read them), nothing is allocated and nothing synchronizes, so XLA may
// capture the calls into a CUDA graph.
#include <cuda_runtime.h>

#include <string>

#include "cuda/common/split_layout.h"
#include "cuda/launch.h"
#include "cuda/limits.h"
#include "handler_common.h"

namespace jax_varlen {
namespace {

constexpr int64_t kMaxGridYZ = 65535;

ffi::Error check_cuda_limits(const AttentionParams& p);

// The forward of either layout, once its params are made: the split-KV workspace, the limits,
// the launch.
ffi::Error run_fwd(ffi::ErrorOr<AttentionParams> params, cudaStream_t stream, float* workspace,
                   size_t workspace_floats, int64_t split_keys) {
  if (!params) return params.error();
  AttentionParams& p = *params;
  p.workspace = workspace;
  p.split_keys = split_keys;
  if (split_keys < 0 || (split_keys > 0 && workspace_floats != size_t(cuda::split_workspace_floats(p))))
    return ffi::Error::InvalidArgument(
        "jax_varlen: split-KV workspace has " + std::to_string(workspace_floats) +
        " floats, expected " + std::to_string(split_keys > 0 ? cuda::split_workspace_floats(p) : 0));
  if (auto err = check_cuda_limits(p); err.failure()) return err;
  if (p.num_packs * p.pack_rows_q == 0 || p.num_heads == 0) return ffi::Error::Success();  // no output
  const cudaError_t err = cuda::run_fwd(p, stream);
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_varlen: CUDA forward failed: ") +
                                cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error attention_fwd_cuda(cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer key,
                              ffi::AnyBuffer value, ffi::Buffer<ffi::S32> nonpad_kv_seqlen,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::Buffer<ffi::F32>> lse,
                              ffi::Result<ffi::Buffer<ffi::F32>> workspace, float scale,
                              bool is_causal, float softcap, int64_t split_keys) {
  return run_fwd(make_params(query, key, value, nonpad_kv_seqlen, *out, *lse, scale, is_causal, softcap),
                 stream, workspace->typed_data(), workspace->element_count(), split_keys);
}

ffi::Error packed_attention_fwd_cuda(cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer key,
                                     ffi::AnyBuffer value, ffi::Buffer<ffi::S32> cu_seqlens_q,
                                     ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::Result<ffi::AnyBuffer> out,
                                     ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                     ffi::Result<ffi::Buffer<ffi::F32>> workspace, float scale,
                                     bool is_causal, float softcap, int64_t max_seqlen_q,
                                     int64_t max_seqlen_k, int64_t split_keys) {
  return run_fwd(make_packed_params(query, key, value, cu_seqlens_q, cu_seqlens_k, *out, *lse, scale, is_causal,
                                    softcap, max_seqlen_q, max_seqlen_k),
                 stream, workspace->typed_data(), workspace->element_count(), split_keys);
}

// Limits shared by both directions: head sizes of the kernels, grid y/z extents.
ffi::Error check_cuda_limits(const AttentionParams& p) {
  if (p.head_dim > cuda::kMaxHeadDim || p.head_dim_v > cuda::kMaxHeadDim)
    return ffi::Error::InvalidArgument(
        "jax_varlen: CUDA head sizes must be <= " + std::to_string(cuda::kMaxHeadDim) +
        ", got head_dim " + std::to_string(p.head_dim) + " and head_dim_v " + std::to_string(p.head_dim_v));
  if (p.batch > kMaxGridYZ || p.kv_num_heads > kMaxGridYZ)
    return ffi::Error::InvalidArgument(
        "jax_varlen: CUDA supports batch and kv_num_heads up to 65535, got " +
        std::to_string(p.batch) + " and " + std::to_string(p.kv_num_heads));
  return ffi::Error::Success();
}

// The backward of either layout (params.h, BackwardParams): d_query, d_key, d_value and the
// delta workspace. Every element of the gradients is written, padded keys' rows (and packed
// rows no sequence owns) with zeros.
ffi::Error run_bwd(ffi::ErrorOr<BackwardParams> params, cudaStream_t stream,
                   ffi::Result<ffi::Buffer<ffi::F32>> dq_workspace) {
  if (!params) return params.error();
  BackwardParams bp = *params;
  bp.dq_accum = dq_workspace->typed_data();
  bp.dq_elements = int64_t(dq_workspace->element_count());
  if (auto err = check_cuda_limits(bp.fwd); err.failure()) return err;
  if (bp.fwd.num_packs == 0 || bp.fwd.num_heads == 0) return ffi::Error::Success();
  const cudaError_t err = cuda::run_bwd(bp, stream);
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
                              ffi::Result<ffi::Buffer<ffi::F32>> dq_workspace, float scale, bool is_causal,
                              float softcap) {
  auto fwd = make_params(query, key, value, nonpad_kv_seqlen, out, lse, scale, is_causal, softcap);
  return run_bwd(make_bwd_params(fwd, query, key, value, out, lse, d_out, d_lse, *d_query, *d_key, *d_value, *delta),
                 stream, dq_workspace);
}

ffi::Error packed_attention_bwd_cuda(cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer key,
                                     ffi::AnyBuffer value, ffi::Buffer<ffi::S32> cu_seqlens_q,
                                     ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::AnyBuffer out,
                                     ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer d_out, ffi::Buffer<ffi::F32> d_lse,
                                     ffi::Result<ffi::AnyBuffer> d_query, ffi::Result<ffi::AnyBuffer> d_key,
                                     ffi::Result<ffi::AnyBuffer> d_value, ffi::Result<ffi::Buffer<ffi::F32>> delta,
                                     ffi::Result<ffi::Buffer<ffi::F32>> dq_workspace, float scale,
                                     bool is_causal, float softcap, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  auto fwd = make_packed_params(query, key, value, cu_seqlens_q, cu_seqlens_k, out, lse, scale, is_causal,
                                softcap, max_seqlen_q, max_seqlen_k);
  return run_bwd(make_bwd_params(fwd, query, key, value, out, lse, d_out, d_lse, *d_query, *d_key, *d_value, *delta),
                 stream, dq_workspace);
}

}  // namespace
}  // namespace jax_varlen

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_varlen_attention_fwd_cuda, jax_varlen::attention_fwd_cuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this computation
        .Arg<xla::ffi::AnyBuffer>()                     // query [B, Sq, H, D]
        .Arg<xla::ffi::AnyBuffer>()                     // key [B, Skv, Hkv, D]
        .Arg<xla::ffi::AnyBuffer>()                     // value [B, Skv, Hkv, Dv]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // nonpad_kv_seqlen [B], on the device
        .Ret<xla::ffi::AnyBuffer>()                     // out [B, Sq, H, Dv]
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // lse [B, H, Sq]
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // workspace: split-KV partials (params.h)
        .Attr<float>("scale")                           // multiplies <q, k>
        .Attr<bool>("is_causal")                        // tail-aligned causal mask
        .Attr<float>("softcap")                         // 0 = off
        .Attr<int64_t>("split_keys"),                   // 0 = one pass; else keys per split
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_varlen_attention_bwd_cuda, jax_varlen::attention_bwd_cuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this computation
        .Arg<xla::ffi::AnyBuffer>()                     // query [B, Sq, H, D]
        .Arg<xla::ffi::AnyBuffer>()                     // key [B, Skv, Hkv, D]
        .Arg<xla::ffi::AnyBuffer>()                     // value [B, Skv, Hkv, Dv]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // nonpad_kv_seqlen [B], on the device
        .Arg<xla::ffi::AnyBuffer>()                     // out [B, Sq, H, Dv]
        .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // lse [B, H, Sq]
        .Arg<xla::ffi::AnyBuffer>()                     // d_out [B, Sq, H, Dv]
        .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // d_lse [B, H, Sq]
        .Ret<xla::ffi::AnyBuffer>()                     // d_query [B, Sq, H, D]
        .Ret<xla::ffi::AnyBuffer>()                     // d_key [B, Skv, Hkv, D]
        .Ret<xla::ffi::AnyBuffer>()                     // d_value [B, Skv, Hkv, Dv]
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // delta [B, H, Sq]: workspace
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // dQ workspace of the Hopper kernel (limits.h)
        .Attr<float>("scale")                           // multiplies <q, k>
        .Attr<bool>("is_causal")                        // tail-aligned causal mask
        .Attr<float>("softcap"),                        // 0 = off
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_varlen_packed_attention_fwd_cuda, jax_varlen::packed_attention_fwd_cuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this computation
        .Arg<xla::ffi::AnyBuffer>()                     // query [N, Tq, H, D]: N packs
        .Arg<xla::ffi::AnyBuffer>()                     // key [N, Tk, Hkv, D]
        .Arg<xla::ffi::AnyBuffer>()                     // value [N, Tk, Hkv, Dv]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // cu_seqlens_q [N, B + 1], on the device
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // cu_seqlens_k [N, B + 1], on the device
        .Ret<xla::ffi::AnyBuffer>()                     // out [N, Tq, H, Dv]
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // lse [N, H, Tq]
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // workspace: split-KV partials (params.h)
        .Attr<float>("scale")                           // multiplies <q, k>
        .Attr<bool>("is_causal")                        // tail-aligned per sequence
        .Attr<float>("softcap")                         // 0 = off
        .Attr<int64_t>("max_seqlen_q")                  // longest query run: the grids' rows
        .Attr<int64_t>("max_seqlen_k")                  // longest key run
        .Attr<int64_t>("split_keys"),                   // 0 = one pass; else keys per split
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jax_varlen_packed_attention_bwd_cuda, jax_varlen::packed_attention_bwd_cuda,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this computation
        .Arg<xla::ffi::AnyBuffer>()                     // query [N, Tq, H, D]: N packs
        .Arg<xla::ffi::AnyBuffer>()                     // key [N, Tk, Hkv, D]
        .Arg<xla::ffi::AnyBuffer>()                     // value [N, Tk, Hkv, Dv]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // cu_seqlens_q [N, B + 1], on the device
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // cu_seqlens_k [N, B + 1], on the device
        .Arg<xla::ffi::AnyBuffer>()                     // out [N, Tq, H, Dv]
        .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // lse [N, H, Tq]
        .Arg<xla::ffi::AnyBuffer>()                     // d_out [N, Tq, H, Dv]
        .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // d_lse [N, H, Tq]
        .Ret<xla::ffi::AnyBuffer>()                     // d_query [N, Tq, H, D]
        .Ret<xla::ffi::AnyBuffer>()                     // d_key [N, Tk, Hkv, D]
        .Ret<xla::ffi::AnyBuffer>()                     // d_value [N, Tk, Hkv, Dv]
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // delta [N, H, Tq]: workspace
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // dQ workspace: empty (no Hopper path)
        .Attr<float>("scale")                           // multiplies <q, k>
        .Attr<bool>("is_causal")                        // tail-aligned per sequence
        .Attr<float>("softcap")                         // 0 = off
        .Attr<int64_t>("max_seqlen_q")                  // longest query run: the grids' rows
        .Attr<int64_t>("max_seqlen_k"),                 // longest key run
    {xla::ffi::Traits::kCmdBufferCompatible});
