// Glue shared by the CPU and CUDA handlers: turn XLA buffers and attributes into one
// AttentionParams, checking every shape. Python already checked the arguments; these checks
// are the second line of defence for callers that reach the FFI target directly.
#pragma once

#include <string>

#include "params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_varlen {

namespace ffi = xla::ffi;

inline std::string dims_string(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline ffi::ErrorOr<DType> to_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::F16: return DType::kF16;
    case ffi::DataType::BF16: return DType::kBF16;
    default:
      return ffi::Unexpected(ffi::Error::InvalidArgument(
          "jax_varlen: query must be float32, float16 or bfloat16"));
  }
}

// query [B, Sq, H, D], key [B, Skv, Hkv, D], value [B, Skv, Hkv, Dv], nonpad_kv_seqlen [B],
// out [B, Sq, H, Dv], lse [B, H, Sq].
inline ffi::ErrorOr<AttentionParams> make_params(
    ffi::AnyBuffer query, ffi::AnyBuffer key, ffi::AnyBuffer value,
    ffi::Buffer<ffi::S32> nonpad_kv_seqlen, ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse,
    float scale, bool is_causal, float softcap) {
  auto bad = [](std::string what) {
    return ffi::Unexpected(ffi::Error::InvalidArgument("jax_varlen: " + what));
  };
  const auto qd = query.dimensions(), kd = key.dimensions(), vd = value.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return bad("query, key and value must have rank 4, got " + dims_string(qd) + ", " +
               dims_string(kd) + ", " + dims_string(vd));
  if (key.element_type() != query.element_type() || value.element_type() != query.element_type() ||
      out.element_type() != query.element_type())
    return bad("query, key, value and out must share one dtype");
  auto dtype = to_dtype(query.element_type());
  if (!dtype) return ffi::Unexpected(dtype.error());

  AttentionParams p{};
  p.q = query.untyped_data();
  p.k = key.untyped_data();
  p.v = value.untyped_data();
  p.nonpad_kv_seqlen = nonpad_kv_seqlen.typed_data();
  p.out = out.untyped_data();
  p.lse = lse.typed_data();
  p.dtype = *dtype;
  p.batch = qd[0];
  p.seqlen_q = qd[1];
  p.num_heads = qd[2];
  p.head_dim = qd[3];
  p.seqlen_k = kd[1];
  p.kv_num_heads = kd[2];
  p.head_dim_v = vd[3];
  // Dense row-major layouts (the last dim contiguous); cu_seqlens stay null (padded batch).
  p.q_head_stride = p.head_dim;
  p.q_row_stride = p.num_heads * p.q_head_stride;
  p.q_batch_stride = p.seqlen_q * p.q_row_stride;
  p.k_head_stride = p.head_dim;
  p.k_row_stride = p.kv_num_heads * p.k_head_stride;
  p.k_batch_stride = p.seqlen_k * p.k_row_stride;
  p.v_head_stride = p.head_dim_v;
  p.v_row_stride = p.kv_num_heads * p.v_head_stride;
  p.v_batch_stride = p.seqlen_k * p.v_row_stride;
  p.out_head_stride = p.head_dim_v;
  p.out_row_stride = p.num_heads * p.out_head_stride;
  p.out_batch_stride = p.seqlen_q * p.out_row_stride;
  p.scale = scale;
  p.softcap = softcap;
  p.is_causal = is_causal;

  if (kd[0] != p.batch || vd[0] != p.batch || nonpad_kv_seqlen.element_count() != size_t(p.batch))
    return bad("batch extents differ: query " + dims_string(qd) + ", key " + dims_string(kd) +
               ", value " + dims_string(vd) + ", nonpad_kv_seqlen " +
               dims_string(nonpad_kv_seqlen.dimensions()));
  if (vd[1] != p.seqlen_k || vd[2] != p.kv_num_heads)
    return bad("key " + dims_string(kd) + " and value " + dims_string(vd) + " disagree");
  if (kd[3] != p.head_dim)
    return bad("key head size " + std::to_string(kd[3]) + " != query head size " +
               std::to_string(p.head_dim));
  if (p.kv_num_heads <= 0 || p.num_heads % p.kv_num_heads != 0)
    return bad("kv_num_heads " + std::to_string(p.kv_num_heads) + " must divide num_heads " +
               std::to_string(p.num_heads));
  const auto od = out.dimensions(), ld = lse.dimensions();
  if (od.size() != 4 || od[0] != p.batch || od[1] != p.seqlen_q || od[2] != p.num_heads ||
      od[3] != p.head_dim_v)
    return bad("out has shape " + dims_string(od));
  if (ld.size() != 3 || ld[0] != p.batch || ld[1] != p.num_heads || ld[2] != p.seqlen_q)
    return bad("lse has shape " + dims_string(ld));
  if (!(softcap >= 0.0f)) return bad("softcap must be >= 0");
  return p;
}

// The backward's buffers (ffi/params.h, BackwardParams): the forward's residuals query, key,
// value, nonpad_kv_seqlen, out, lse; the cotangents d_out (out's shape and dtype) and d_lse
// (lse's shape); the gradients d_query, d_key, d_value (their inputs' shapes and dtype) and the
// delta workspace (lse's shape).
inline ffi::ErrorOr<BackwardParams> make_bwd_params(
    ffi::AnyBuffer query, ffi::AnyBuffer key, ffi::AnyBuffer value,
    ffi::Buffer<ffi::S32> nonpad_kv_seqlen, ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse,
    ffi::AnyBuffer d_out, ffi::Buffer<ffi::F32> d_lse, ffi::AnyBuffer d_query,
    ffi::AnyBuffer d_key, ffi::AnyBuffer d_value, ffi::Buffer<ffi::F32> delta, float scale,
    bool is_causal, float softcap) {
  auto fwd = make_params(query, key, value, nonpad_kv_seqlen, out, lse, scale, is_causal, softcap);
  if (!fwd) return ffi::Unexpected(fwd.error());
  auto same_dims = [](ffi::AnyBuffer::Dimensions ad, ffi::AnyBuffer::Dimensions bd) {
    if (ad.size() != bd.size()) return false;
    for (size_t i = 0; i < ad.size(); ++i)
      if (ad[i] != bd[i]) return false;
    return true;
  };
  auto same = [&](ffi::AnyBuffer a, ffi::AnyBuffer b) {
    return a.element_type() == b.element_type() && same_dims(a.dimensions(), b.dimensions());
  };
  auto bad = [](std::string name, ffi::AnyBuffer::Dimensions got, ffi::AnyBuffer::Dimensions want) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "jax_varlen: " + name + " has shape " + dims_string(got) + ", expected " +
        dims_string(want) + " in the dtype of its primal"));
  };
  if (!same(d_out, out)) return bad("d_out", d_out.dimensions(), out.dimensions());
  if (!same(d_query, query)) return bad("d_query", d_query.dimensions(), query.dimensions());
  if (!same(d_key, key)) return bad("d_key", d_key.dimensions(), key.dimensions());
  if (!same(d_value, value)) return bad("d_value", d_value.dimensions(), value.dimensions());
  if (!same_dims(d_lse.dimensions(), lse.dimensions()))
    return bad("d_lse", d_lse.dimensions(), lse.dimensions());
  if (!same_dims(delta.dimensions(), lse.dimensions()))
    return bad("delta", delta.dimensions(), lse.dimensions());
  BackwardParams p{};
  p.fwd = *fwd;
  p.d_out = d_out.untyped_data();
  p.d_lse = d_lse.typed_data();
  p.d_q = d_query.untyped_data();
  p.d_k = d_key.untyped_data();
  p.d_v = d_value.untyped_data();
  p.delta = delta.typed_data();
  return p;
}

}  // namespace jax_varlen
