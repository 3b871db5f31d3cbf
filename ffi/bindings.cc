// The Python extension: registrations() maps FFI target names to handler capsules, per platform;
// constants() gives Python the CUDA path's limits from the headers that define them.
#include <nanobind/nanobind.h>

#include "cuda/limits.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" XLA_FFI_Error* jax_varlen_attention_fwd_cpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* jax_varlen_attention_bwd_cpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* jax_varlen_packed_attention_fwd_cpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* jax_varlen_packed_attention_bwd_cpu(XLA_FFI_CallFrame*);
#ifdef JAX_VARLEN_WITH_CUDA
extern "C" XLA_FFI_Error* jax_varlen_attention_fwd_cuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* jax_varlen_attention_bwd_cuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* jax_varlen_packed_attention_fwd_cuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* jax_varlen_packed_attention_bwd_cuda(XLA_FFI_CallFrame*);
#endif

namespace {

template <typename Fn>
nb::capsule capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jax_varlen, m) {
  // {"cpu": {target: capsule}, "cuda": {target: capsule}}; "cuda" only in a CUDA build. Per
  // platform: the padded and the packed forward and backward.
  m.def("registrations", []() {
    nb::dict platforms, cpu;
    cpu["jax_varlen_attention_fwd_cpu"] = capsule(jax_varlen_attention_fwd_cpu);
    cpu["jax_varlen_attention_bwd_cpu"] = capsule(jax_varlen_attention_bwd_cpu);
    cpu["jax_varlen_packed_attention_fwd_cpu"] = capsule(jax_varlen_packed_attention_fwd_cpu);
    cpu["jax_varlen_packed_attention_bwd_cpu"] = capsule(jax_varlen_packed_attention_bwd_cpu);
    platforms["cpu"] = cpu;
#ifdef JAX_VARLEN_WITH_CUDA
    nb::dict cuda;
    cuda["jax_varlen_attention_fwd_cuda"] = capsule(jax_varlen_attention_fwd_cuda);
    cuda["jax_varlen_attention_bwd_cuda"] = capsule(jax_varlen_attention_bwd_cuda);
    cuda["jax_varlen_packed_attention_fwd_cuda"] = capsule(jax_varlen_packed_attention_fwd_cuda);
    cuda["jax_varlen_packed_attention_bwd_cuda"] = capsule(jax_varlen_packed_attention_bwd_cuda);
    platforms["cuda"] = cuda;
#endif
    return platforms;
  });
  // The CUDA path's limits (ffi/cuda/limits.h), also in a CPU-only build: Python decides the
  // lowering with them, so they must not be repeated there.
  m.def("constants", []() {
    namespace c = jax_varlen::cuda;
    nb::list buckets, bwd_block_m;
    for (int d : c::kHeadDimBuckets) {
      buckets.append(d);
      bwd_block_m.append(d <= c::kBwdSm90MaxHeadDim ? c::bwd_block_m(d) : 0);
    }
    nb::dict d;
    d["head_dim_buckets"] = nb::tuple(buckets);  // max(D, Dv) rounds up to one of these
    d["cuda_max_head_dim"] = c::kMaxHeadDim;     // largest D and Dv of the CUDA kernels
    d["split_max_seqlen_q"] = c::kSplitMaxSeqlenQ;  // split-KV path for seqlen_q up to this
    d["split_keys"] = c::kSplitKeys;                // keys per split-KV chunk
    d["bwd_block_m"] = nb::tuple(bwd_block_m);      // Hopper backward: rows per dQ block, per bucket (0: none)
    d["bwd_sm90_max_head_dim"] = c::kBwdSm90MaxHeadDim;  // its largest bucket
    return d;
  });
  m.attr("with_cuda") =
#ifdef JAX_VARLEN_WITH_CUDA
      true;
#else
      false;
#endif
}
