// Scalar conversions between the op's element types and fp32, for the SIMT kernels and the
// backward's preprocess (the tensor-core kernels convert in pairs: sm80/ptx.h pack2).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace jax_varlen::cuda {

__device__ __forceinline__ float load_float(const float* p) { return *p; }
__device__ __forceinline__ float load_float(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }
template <typename Elem> __device__ __forceinline__ Elem store_float(float x) { return Elem(x); }
template <> __device__ __forceinline__ float store_float<float>(float x) { return x; }

}  // namespace jax_varlen::cuda
