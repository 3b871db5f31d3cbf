// Shared-memory tile addressing and the softmax's exp, common to the tensor-core kernels.
#pragma once

namespace jax_varlen::cuda {

// Element offset of (row, 16-byte chunk) in a [rows, kHeadDim] smem tile. Chunks are XOR-
// swizzled by row % 8, so the 8 rows one ldmatrix reads land in 8 different bank groups.
template <int kHeadDim>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

__device__ __forceinline__ float exp2_approx(float x) {  // ex2.approx: exp2(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace jax_varlen::cuda
