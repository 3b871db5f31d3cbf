// Glue shared by the CPU and CUDA handlers: turn XLA buffers and attributes into one
// AttentionParams, checking every shape. Python already checked the arguments; these checks
// are the second line of defence for callers that reach the FFI target directly.
#pragma once

#include <string>
#include <utility>

#include "core/params.h"
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

inline ffi::Unexpected<ffi::Error> bad_argument(const std::string& what) {
  return ffi::Unexpected(ffi::Error::InvalidArgument("jax_varlen: " + what));
}

// The FFI signatures, one helper for every target (forward and backward, padded and packed,
// CPU and CUDA), in the order the Python lowerings pass buffers (_primitive.py, _backward.py):
//   operands  query, key, value ([B, Sq, H, D], [B, Skv, Hkv, D], [B, Skv, Hkv, Dv]; packed:
//             [N, Tq, H, D], [N, Tk, Hkv, D], [N, Tk, Hkv, Dv]),
//             then nonpad_kv_seqlen [B] (packed: cu_seqlens_q, cu_seqlens_k [N, B + 1]), int32,
//             on the device; paged (CUDA forward only): key and value are the caches
//             [num_pages, page_size, Hkv, D / Dv], then seqlens_k [B] and block_table
//             [B, max_pages] (make_paged_params);
//             forward with sinks (the *_sinks targets): then sinks [H], float32 (with_sinks);
//             backward only: out, lse [B, H, Sq] (f32), d_out (out's dtype), d_lse (f32);
//   results   forward: out, lse; backward: d_query, d_key, d_value, delta (f32, lse's shape: a
//             workspace); then, with kWorkspace (CUDA), the plan's f32 workspace [N, per pack]
//             (split-KV partials; the Hopper backward's dQ tiles, counters and sequence order);
//   attributes  one dictionary (CallAttrs, below).
// Ctx is the platform's context: the CPU's intra-op thread pool, or XLA's CUDA stream.
// (Bindings are builders whose steps consume the last and cannot be moved otherwise: every
// helper appends at least one entry, so each returns a fresh builder.)
enum class Lengths { kPadded, kPacked, kPaged };
template <Lengths kLengths, typename B>
auto bind_lengths_only(B&& b) {
  if constexpr (kLengths == Lengths::kPaged)
    return std::move(b).template Arg<ffi::Buffer<ffi::S32>>().template Arg<ffi::Buffer<ffi::S32>>();  // seqlens_k, block_table
  else if constexpr (kLengths == Lengths::kPacked)
    return std::move(b).template Arg<ffi::Buffer<ffi::S32>>().template Arg<ffi::Buffer<ffi::S32>>();  // cu_seqlens_q, _k
  else
    return std::move(b).template Arg<ffi::Buffer<ffi::S32>>();  // nonpad_kv_seqlen
}
// The lengths, then with kSinks the sinks [H] (float32).
template <Lengths kLengths, bool kSinks, typename B>
auto bind_lengths(B&& b) {
  if constexpr (kSinks)
    return bind_lengths_only<kLengths>(std::move(b)).template Arg<ffi::Buffer<ffi::F32>>();  // sinks
  else
    return bind_lengths_only<kLengths>(std::move(b));
}
template <bool kBackward, typename B>
auto bind_outputs(B&& b) {
  if constexpr (kBackward)
    return std::move(b)
        .template Arg<ffi::AnyBuffer>()         // out
        .template Arg<ffi::Buffer<ffi::F32>>()  // lse
        .template Arg<ffi::AnyBuffer>()         // d_out
        .template Arg<ffi::Buffer<ffi::F32>>()  // d_lse
        .template Ret<ffi::AnyBuffer>()         // d_query
        .template Ret<ffi::AnyBuffer>()         // d_key
        .template Ret<ffi::AnyBuffer>()         // d_value
        .template Ret<ffi::Buffer<ffi::F32>>();  // delta
  else
    return std::move(b).template Ret<ffi::AnyBuffer>().template Ret<ffi::Buffer<ffi::F32>>();  // out, lse
}
template <bool kWorkspace, typename B>
auto bind_attrs(B&& b) {
  if constexpr (kWorkspace) return std::move(b).template Ret<ffi::Buffer<ffi::F32>>().Attrs();  // the plan's
  else return std::move(b).Attrs();
}
template <typename Ctx, Lengths kLengths, bool kBackward, bool kWorkspace, bool kSinks>
auto bind_attention() {
  return bind_attrs<kWorkspace>(bind_outputs<kBackward>(bind_lengths<kLengths, kSinks>(ffi::Ffi::Bind()
                                                                                   .Ctx<Ctx>()
                                                                                   .template Arg<ffi::AnyBuffer>()  // query
                                                                                   .template Arg<ffi::AnyBuffer>()  // key
                                                                                   .template Arg<ffi::AnyBuffer>()  // value
                                                                                   )));
}

// One FFI handler symbol per line: JV_DEFINE_<PLATFORM>_HANDLER(name, lengths, backward, sinks)
// defines jax_varlen_<name>_<platform> (the name bindings.cc registers) for the handler
// jax_varlen::<name>_<platform>, with bind_attention's signature (the compiler checks the
// handler's parameters against it). CPU handlers run on XLA's thread pool; CUDA ones on the
// call's stream with the plan's workspace, capturable into command buffers (no host sync, no
// allocation). Used at global scope, after the handlers.
#define JV_DEFINE_CPU_HANDLER(name, lengths, backward, sinks)                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_varlen_##name##_cpu, jax_varlen::name##_cpu,                     \
                                (jax_varlen::bind_attention<xla::ffi::ThreadPool, jax_varlen::Lengths::lengths, \
                                                            backward, /*kWorkspace=*/false, sinks>()))
#define JV_DEFINE_CUDA_HANDLER(name, lengths, backward, sinks)                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_varlen_##name##_cuda, jax_varlen::name##_cuda,                   \
                                (jax_varlen::bind_attention<xla::ffi::PlatformStream<cudaStream_t>,  \
                                                            jax_varlen::Lengths::lengths, backward,  \
                                                            /*kWorkspace=*/true, sinks>()),          \
                                {xla::ffi::Traits::kCmdBufferCompatible})

// The static attributes of a call, the same for every handler (forward and backward, CPU and
// CUDA, padded and packed):
//   scale (f32): multiplies <q, k>;  is_causal (bool): tail-aligned causal mask;
//   softcap (f32): 0 = off;
//   max_seqlen_q, max_seqlen_k (i64): the packed layout only: the longest query and key runs;
//   window_left, window_right (i64): optional, the local window's sides (mask.h, MaskSpec),
//     -1 = that side unbounded, and -1 when absent.
// The handlers bind them as one dictionary (Bind().Attrs()): XLA FFI binds named attributes
// only when a call carries exactly those, and calls lowered before the window existed (issue
// 34: serialized exports, direct callers of the targets) carry no window_left/right.
struct CallAttrs {
  float scale = 0.0f;
  bool is_causal = false;
  float softcap = 0.0f;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  int64_t window_left = -1, window_right = -1;
};

template <typename T>
ffi::Error read_attr(const ffi::Dictionary& attrs, const char* name, bool required, T* value) {
  if (!attrs.contains(name))
    return required ? ffi::Error::InvalidArgument(std::string("jax_varlen: missing attribute ") + name)
                    : ffi::Error::Success();
  auto v = attrs.get<T>(name);
  if (!v) return ffi::Error::InvalidArgument(std::string("jax_varlen: attribute ") + name + ": " +
                                             v.error().message());
  *value = *v;
  return ffi::Error::Success();
}

inline ffi::ErrorOr<CallAttrs> read_attrs(const ffi::Dictionary& attrs, bool packed) {
  CallAttrs a;
  for (ffi::Error err : {read_attr(attrs, "scale", true, &a.scale),
                         read_attr(attrs, "is_causal", true, &a.is_causal),
                         read_attr(attrs, "softcap", true, &a.softcap),
                         read_attr(attrs, "max_seqlen_q", packed, &a.max_seqlen_q),
                         read_attr(attrs, "max_seqlen_k", packed, &a.max_seqlen_k),
                         read_attr(attrs, "window_left", false, &a.window_left),
                         read_attr(attrs, "window_right", false, &a.window_right)})
    if (err.failure()) return ffi::Unexpected(err);
  return a;
}

// What both layouts share: query [N, Sq, H, D], key [N, Skv, Hkv, D], value [N, Skv, Hkv, Dv],
// out [N, Sq, H, Dv] (dense, last dim contiguous), lse [N, H, Sq], the attributes, and every
// check between them. N is the batch (padded) or the packs (packed, with Sq = Tq and Skv = Tk);
// make_params and make_packed_params then say how N splits into sequences. `paged`: key and
// value are caches [num_pages, page_size, Hkv, D / Dv] whose leading extents are their own
// (make_paged_params).
inline ffi::ErrorOr<AttentionParams> make_dense_params(ffi::AnyBuffer query, ffi::AnyBuffer key,
                                                       ffi::AnyBuffer value, ffi::AnyBuffer out,
                                                       ffi::Buffer<ffi::F32> lse,
                                                       const CallAttrs& attrs, bool paged = false) {
  const auto qd = query.dimensions(), kd = key.dimensions(), vd = value.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return bad_argument("query, key and value must have rank 4, got " + dims_string(qd) + ", " +
                        dims_string(kd) + ", " + dims_string(vd));
  if (key.element_type() != query.element_type() || value.element_type() != query.element_type() ||
      out.element_type() != query.element_type())
    return bad_argument("query, key, value and out must share one dtype");
  auto dtype = to_dtype(query.element_type());
  if (!dtype) return ffi::Unexpected(dtype.error());

  AttentionParams p{};
  p.q = query.untyped_data();
  p.k = key.untyped_data();
  p.v = value.untyped_data();
  p.out = out.untyped_data();
  p.lse = lse.typed_data();
  p.dtype = *dtype;
  p.num_packs = qd[0];
  p.pack_rows_q = qd[1];
  p.num_heads = qd[2];
  p.head_dim = qd[3];
  p.pack_rows_k = kd[1];
  p.kv_num_heads = kd[2];
  p.head_dim_v = vd[3];
  // Dense row-major layouts (the last dim contiguous).
  p.q_head_stride = p.head_dim;
  p.q_row_stride = p.num_heads * p.q_head_stride;
  p.q_batch_stride = p.pack_rows_q * p.q_row_stride;
  p.k_head_stride = p.head_dim;
  p.k_row_stride = p.kv_num_heads * p.k_head_stride;
  p.k_batch_stride = p.pack_rows_k * p.k_row_stride;
  p.v_head_stride = p.head_dim_v;
  p.v_row_stride = p.kv_num_heads * p.v_head_stride;
  p.v_batch_stride = p.pack_rows_k * p.v_row_stride;
  p.out_head_stride = p.head_dim_v;
  p.out_row_stride = p.num_heads * p.out_head_stride;
  p.out_batch_stride = p.pack_rows_q * p.out_row_stride;
  p.scale = attrs.scale;
  p.softcap = attrs.softcap;
  p.is_causal = attrs.is_causal;
  p.window_left = attrs.window_left;
  p.window_right = attrs.window_right;

  if (vd[0] != kd[0] || (!paged && kd[0] != p.num_packs))
    return bad_argument("leading extents differ: query " + dims_string(qd) + ", key " +
                        dims_string(kd) + ", value " + dims_string(vd));
  if (vd[1] != p.pack_rows_k || vd[2] != p.kv_num_heads)
    return bad_argument("key " + dims_string(kd) + " and value " + dims_string(vd) + " disagree");
  if (kd[3] != p.head_dim)
    return bad_argument("key head size " + std::to_string(kd[3]) + " != query head size " +
                        std::to_string(p.head_dim));
  if (p.kv_num_heads <= 0 || p.num_heads % p.kv_num_heads != 0)
    return bad_argument("kv_num_heads " + std::to_string(p.kv_num_heads) +
                        " must divide num_heads " + std::to_string(p.num_heads));
  const auto od = out.dimensions(), ld = lse.dimensions();
  if (od.size() != 4 || od[0] != p.num_packs || od[1] != p.pack_rows_q || od[2] != p.num_heads ||
      od[3] != p.head_dim_v)
    return bad_argument("out has shape " + dims_string(od));
  if (ld.size() != 3 || ld[0] != p.num_packs || ld[1] != p.num_heads || ld[2] != p.pack_rows_q)
    return bad_argument("lse has shape " + dims_string(ld));
  if (!(p.softcap >= 0.0f)) return bad_argument("softcap must be >= 0");
  if (p.window_left < -1 || p.window_right < -1)
    return bad_argument("window_left " + std::to_string(p.window_left) + " and window_right " +
                        std::to_string(p.window_right) + " must be >= 0, or -1 for no bound");
  return p;
}

// The padded batch: query [B, Sq, H, D], key [B, Skv, Hkv, D], value [B, Skv, Hkv, Dv],
// nonpad_kv_seqlen [B], out [B, Sq, H, Dv], lse [B, H, Sq]. Every sequence is a pack of its own
// (params.h); cu_seqlens stay null.
inline ffi::ErrorOr<AttentionParams> make_params(
    ffi::AnyBuffer query, ffi::AnyBuffer key, ffi::AnyBuffer value,
    ffi::Buffer<ffi::S32> nonpad_kv_seqlen, ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse,
    const CallAttrs& attrs) {
  auto params = make_dense_params(query, key, value, out, lse, attrs);
  if (!params) return params;
  AttentionParams& p = *params;
  p.nonpad_kv_seqlen = nonpad_kv_seqlen.typed_data();
  p.batch = p.num_packs;
  p.pack_seqs = 1;
  p.seqlen_q = p.pack_rows_q;
  p.seqlen_k = p.pack_rows_k;
  if (nonpad_kv_seqlen.element_count() != size_t(p.batch))
    return bad_argument("nonpad_kv_seqlen has shape " + dims_string(nonpad_kv_seqlen.dimensions()) +
                        ", expected [" + std::to_string(p.batch) + "] (the batch of query " +
                        dims_string(query.dimensions()) + ")");
  return p;
}

// The packed layout: query [N, Tq, H, D], key [N, Tk, Hkv, D], value [N, Tk, Hkv, Dv],
// cu_seqlens_q and cu_seqlens_k [N, B + 1], out [N, Tq, H, Dv], lse [N, H, Tq]: N packs
// (1, or the vmapped extent) of B sequences each (params.h). max_seqlen_q/k (in [0, Tq] and
// [0, Tk]) bound the sequences' lengths and size the grids; longer ones are clamped (SeqlenInfo).
inline ffi::ErrorOr<AttentionParams> make_packed_params(
    ffi::AnyBuffer query, ffi::AnyBuffer key, ffi::AnyBuffer value,
    ffi::Buffer<ffi::S32> cu_seqlens_q, ffi::Buffer<ffi::S32> cu_seqlens_k, ffi::AnyBuffer out,
    ffi::Buffer<ffi::F32> lse, const CallAttrs& attrs) {
  auto params = make_dense_params(query, key, value, out, lse, attrs);
  if (!params) return params;
  AttentionParams& p = *params;
  const auto cq = cu_seqlens_q.dimensions(), ck = cu_seqlens_k.dimensions();
  if (cq.size() != 2 || cq[0] != p.num_packs || cq[1] < 1 || ck.size() != 2 || ck[0] != cq[0] ||
      ck[1] != cq[1])
    return bad_argument("cu_seqlens_q " + dims_string(cq) + " and cu_seqlens_k " + dims_string(ck) +
                        " must both be [N, B + 1] with N = " + std::to_string(p.num_packs) +
                        " (the packs of query " + dims_string(query.dimensions()) + ")");
  const int64_t max_seqlen_q = attrs.max_seqlen_q, max_seqlen_k = attrs.max_seqlen_k;
  if (max_seqlen_q < 0 || max_seqlen_q > p.pack_rows_q || max_seqlen_k < 0 ||
      max_seqlen_k > p.pack_rows_k)
    return bad_argument("max_seqlen_q " + std::to_string(max_seqlen_q) + " and max_seqlen_k " +
                        std::to_string(max_seqlen_k) + " must lie in [0, Tq = " +
                        std::to_string(p.pack_rows_q) + "] and [0, Tk = " +
                        std::to_string(p.pack_rows_k) + "]");
  p.cu_seqlens_q = cu_seqlens_q.typed_data();
  p.cu_seqlens_k = cu_seqlens_k.typed_data();
  p.pack_seqs = cq[1] - 1;
  p.batch = p.num_packs * p.pack_seqs;
  p.seqlen_q = max_seqlen_q;
  p.seqlen_k = max_seqlen_k;
  return p;
}

// The paged forward: query [B, Sq, H, D], key_cache [num_pages, page_size, Hkv, D],
// value_cache [num_pages, page_size, Hkv, Dv], seqlens_k [B], block_table [B, max_pages],
// out [B, Sq, H, Dv], lse [B, H, Sq] (params.h: paged keys). The padded batch of sequences
// with max_pages * page_size key rows each, whose rows are found through the block table; each
// sequence's Sq queries are the last of its seqlens_k[b] keys.
inline ffi::ErrorOr<AttentionParams> make_paged_params(
    ffi::AnyBuffer query, ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
    ffi::Buffer<ffi::S32> seqlens_k, ffi::Buffer<ffi::S32> block_table, ffi::AnyBuffer out,
    ffi::Buffer<ffi::F32> lse, const CallAttrs& attrs) {
  auto params = make_dense_params(query, key_cache, value_cache, out, lse, attrs, /*paged=*/true);
  if (!params) return params;
  AttentionParams& p = *params;
  const auto kd = key_cache.dimensions(), td = block_table.dimensions();
  if (kd[0] < 1 || kd[1] < 1)
    return bad_argument("key_cache " + dims_string(kd) + " must hold a page of at least one row");
  if (td.size() != 2 || td[0] != p.num_packs || td[1] < 1)
    return bad_argument("block_table has shape " + dims_string(td) + ", expected [" +
                        std::to_string(p.num_packs) + ", max_pages >= 1] (the batch of query " +
                        dims_string(query.dimensions()) + ")");
  if (seqlens_k.element_count() != size_t(p.num_packs))
    return bad_argument("seqlens_k has shape " + dims_string(seqlens_k.dimensions()) + ", expected [" +
                        std::to_string(p.num_packs) + "] (the batch of query " +
                        dims_string(query.dimensions()) + ")");
  p.num_pages = kd[0];
  p.page_size = kd[1];
  p.max_pages = td[1];
  p.block_table = block_table.typed_data();
  p.nonpad_kv_seqlen = seqlens_k.typed_data();
  p.batch = p.num_packs;
  p.pack_seqs = 1;
  p.seqlen_q = p.pack_rows_q;
  p.seqlen_k = p.pack_rows_k = p.max_pages * p.page_size;  // the keys' extent, read through pages
  p.k_batch_stride = p.page_size * p.k_row_stride;          // a page
  p.v_batch_stride = p.page_size * p.v_row_stride;
  return p;
}

// Attention sinks for params of either layout: sinks [H] float32, one logit per query head.
inline ffi::ErrorOr<AttentionParams> with_sinks(ffi::ErrorOr<AttentionParams> params, ffi::Buffer<ffi::F32> sinks) {
  if (!params) return params;
  const auto sd = sinks.dimensions();
  if (sd.size() != 1 || sd[0] != params->num_heads)
    return bad_argument("sinks has shape " + dims_string(sd) + ", expected [" + std::to_string(params->num_heads) +
                        "] (one logit per query head)");
  params->sinks = sinks.typed_data();
  return params;
}

// The backward's buffers (ffi/core/params.h, BackwardParams), for the forward's params `fwd` (either
// layout): the residuals out and lse; the cotangents d_out (out's shape and dtype) and d_lse
// (lse's shape); the gradients d_query, d_key, d_value (their inputs' shapes and dtype) and the
// delta workspace (lse's shape).
inline ffi::ErrorOr<BackwardParams> make_bwd_params(
    ffi::ErrorOr<AttentionParams> fwd, ffi::AnyBuffer query, ffi::AnyBuffer key,
    ffi::AnyBuffer value, ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer d_out,
    ffi::Buffer<ffi::F32> d_lse, ffi::AnyBuffer d_query, ffi::AnyBuffer d_key,
    ffi::AnyBuffer d_value, ffi::Buffer<ffi::F32> delta) {
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
