// The Python extension: registrations() maps FFI target names to handler capsules, per platform.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" XLA_FFI_Error* jax_varlen_attention_fwd_cpu(XLA_FFI_CallFrame*);
#ifdef JAX_VARLEN_WITH_CUDA
extern "C" XLA_FFI_Error* jax_varlen_attention_fwd_cuda(XLA_FFI_CallFrame*);
#endif

namespace {

template <typename Fn>
nb::capsule capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jax_varlen, m) {
  // {"cpu": {target: capsule}, "cuda": {target: capsule}}; "cuda" only in a CUDA build.
  m.def("registrations", []() {
    nb::dict platforms, cpu;
    cpu["jax_varlen_attention_fwd_cpu"] = capsule(jax_varlen_attention_fwd_cpu);
    platforms["cpu"] = cpu;
#ifdef JAX_VARLEN_WITH_CUDA
    nb::dict cuda;
    cuda["jax_varlen_attention_fwd_cuda"] = capsule(jax_varlen_attention_fwd_cuda);
    platforms["cuda"] = cuda;
#endif
    return platforms;
  });
  m.attr("with_cuda") =
#ifdef JAX_VARLEN_WITH_CUDA
      true;
#else
      false;
#endif
}
