# CUDA part of the extension: the FFI handler, the kernel dispatch, and one generated .cu file
# per kernel instantiation, so instantiations compile in parallel and a change to one bucket
# rebuilds one file.
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

# Machine code for sm_80 (Ampere) and sm_90a (Hopper; the target wgmma will need), plus
# compute_80 PTX so that newer GPUs can JIT the kernels.
# JAX_VARLEN_CUDA_ARCHS overrides the list (e.g. "90a-real" for a quick build on one H100/H200).
set(JAX_VARLEN_CUDA_ARCHS "80-real;90a-real;80-virtual" CACHE STRING "CUDA architectures to build")
set(CMAKE_CUDA_ARCHITECTURES ${JAX_VARLEN_CUDA_ARCHS})
set(CMAKE_CUDA_STANDARD 17)

set(instantiation_dir "${CMAKE_CURRENT_BINARY_DIR}/instantiations")
set(instantiations "")
foreach(elem IN ITEMS "__half:f16" "__nv_bfloat16:bf16")
  string(REPLACE ":" ";" pair "${elem}")
  list(GET pair 0 ctype)
  list(GET pair 1 tag)
  foreach(dim IN ITEMS 64 128 256)
    foreach(kernel IN ITEMS tc split)
      set(file "${instantiation_dir}/fwd_${kernel}_${tag}_d${dim}.cu")
      file(CONFIGURE OUTPUT "${file}" CONTENT
        "#include \"cuda/fwd_${kernel}.cuh\"\ntemplate cudaError_t jax_varlen::cuda::run_fwd_${kernel}<${ctype}, ${dim}>(const jax_varlen::AttentionParams&, cudaStream_t);\n")
      list(APPEND instantiations "${file}")
    endforeach()
  endforeach()
endforeach()
foreach(elem IN ITEMS "float:f32" "__half:f16" "__nv_bfloat16:bf16")
  string(REPLACE ":" ";" pair "${elem}")
  list(GET pair 0 ctype)
  list(GET pair 1 tag)
  set(file "${instantiation_dir}/fwd_simt_${tag}.cu")
  file(CONFIGURE OUTPUT "${file}" CONTENT
    "#include \"cuda/fwd_simt.cuh\"\ntemplate cudaError_t jax_varlen::cuda::run_fwd_simt<${ctype}>(const jax_varlen::AttentionParams&, cudaStream_t);\n")
  list(APPEND instantiations "${file}")
endforeach()

target_sources(_jax_varlen PRIVATE ffi/cuda/handler.cu ffi/cuda/dispatch.cu ${instantiations})
target_compile_definitions(_jax_varlen PRIVATE JAX_VARLEN_WITH_CUDA)
target_compile_options(_jax_varlen PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -O3>)
target_link_libraries(_jax_varlen PRIVATE CUDA::cudart_static)
set_target_properties(_jax_varlen PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
message(STATUS "jax_varlen: building CUDA kernels for ${CMAKE_CUDA_ARCHITECTURES}")
