// What a launch reads of the live device (DESIGN.md: launch geometry from the device, read once).
#pragma once

#include <cuda_runtime.h>

namespace jax_varlen::cuda {

// Number of SMs of the current device, read once per device: the persistent grids' size (the
// Hopper forward, the split-KV kernel on a persistent grid).
inline int sm_count() {
  constexpr int kMaxDevices = 64;
  static int count[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= kMaxDevices) return 1;
  if (count[dev] == 0) cudaDeviceGetAttribute(&count[dev], cudaDevAttrMultiProcessorCount, dev);
  return count[dev] > 0 ? count[dev] : 1;
}

}  // namespace jax_varlen::cuda
