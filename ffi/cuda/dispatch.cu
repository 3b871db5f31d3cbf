// Chooses a kernel for one call: the tensor-core kernels (sm_80+, f16/bf16, head sizes that are
// multiples of 8, 16-byte aligned buffers) with max(D, Dv) rounded up to a bucket -- split-KV
// when the caller sized a workspace for it (short queries), else one pass: the Hopper kernel
// on compute capability 9.x when it was built, the mma.sync kernel otherwise -- or the
// portable SIMT kernel (float32 on an exact fp32 path, odd head sizes).
#include <cstdint>

#include "cuda/launch.h"

namespace jax_varlen::cuda {
namespace {

// Compute capability major of the current device, read once per device.
int device_major() {
  constexpr int kMaxDevices = 64;
  static int major[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= kMaxDevices) return 0;
  if (major[dev] == 0) cudaDeviceGetAttribute(&major[dev], cudaDevAttrComputeCapabilityMajor, dev);
  return major[dev];
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename Elem>
cudaError_t run_fwd_typed(const AttentionParams& p, cudaStream_t stream) {
  const int64_t dim = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  const bool tensor_cores = device_major() >= 8 && p.head_dim % 8 == 0 && p.head_dim_v % 8 == 0 &&
                            aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.out);
  if (!tensor_cores) return run_fwd_simt<Elem>(p, stream);
#if defined(JAX_VARLEN_WITH_SM90)
  if (p.split_keys == 0 && device_major() == 9) {
    if (dim <= 64) return sm90::run_fwd_sm90<Elem, 64>(p, stream);
    if (dim <= 128) return sm90::run_fwd_sm90<Elem, 128>(p, stream);
    return sm90::run_fwd_sm90<Elem, 256>(p, stream);
  }
#endif
  if (p.split_keys > 0) {
    if (dim <= 64) return run_fwd_split<Elem, 64>(p, stream);
    if (dim <= 128) return run_fwd_split<Elem, 128>(p, stream);
    return run_fwd_split<Elem, 256>(p, stream);
  }
  if (dim <= 64) return run_fwd_tc<Elem, 64>(p, stream);
  if (dim <= 128) return run_fwd_tc<Elem, 128>(p, stream);
  return run_fwd_tc<Elem, 256>(p, stream);
}

}  // namespace

cudaError_t run_fwd(const AttentionParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kF32: return run_fwd_simt<float>(p, stream);
    case DType::kF16: return run_fwd_typed<__half>(p, stream);
    case DType::kBF16: return run_fwd_typed<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_varlen::cuda
