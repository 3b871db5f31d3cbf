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

# The Hopper path (ffi/cuda/sm90/): CuTe/CUTLASS headers from the nvidia-cutlass package (a build
# requirement), compiled for sm_90a only, as its own object library, when 90a is a target.
set(sm90_objects "")
if(JAX_VARLEN_CUDA_ARCHS MATCHES "90a")
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
    OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE CUTLASS_INCLUDE_DIR RESULT_VARIABLE cutlass_found)
  if(cutlass_found EQUAL 0 AND EXISTS "${CUTLASS_INCLUDE_DIR}/cute/tensor.hpp")
    set(sm90_instantiations "")
    foreach(elem IN ITEMS "__half:f16" "__nv_bfloat16:bf16")
      string(REPLACE ":" ";" pair "${elem}")
      list(GET pair 0 ctype)
      list(GET pair 1 tag)
      foreach(dim IN ITEMS 64 128 256)
        set(file "${instantiation_dir}/fwd_sm90_${tag}_d${dim}.cu")
        file(CONFIGURE OUTPUT "${file}" CONTENT
          "#include \"cuda/sm90/fwd_sm90.cuh\"\ntemplate cudaError_t jax_varlen::cuda::sm90::run_fwd_sm90<${ctype}, ${dim}>(const jax_varlen::AttentionParams&, cudaStream_t);\n")
        list(APPEND sm90_instantiations "${file}")
      endforeach()
    endforeach()
    add_library(jax_varlen_sm90 OBJECT ${sm90_instantiations})
    target_include_directories(jax_varlen_sm90 PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}/ffi" "${CUTLASS_INCLUDE_DIR}")
    target_compile_options(jax_varlen_sm90 PRIVATE --expt-relaxed-constexpr -O3)
    set_target_properties(jax_varlen_sm90 PROPERTIES CUDA_ARCHITECTURES "90a-real" POSITION_INDEPENDENT_CODE ON)
    set(sm90_objects $<TARGET_OBJECTS:jax_varlen_sm90>)
    target_compile_definitions(_jax_varlen PRIVATE JAX_VARLEN_WITH_SM90)
    message(STATUS "jax_varlen: Hopper (sm_90a) path with CUTLASS headers from ${CUTLASS_INCLUDE_DIR}")
  else()
    message(WARNING "jax_varlen: nvidia-cutlass not importable; building without the Hopper path")
  endif()
endif()

target_sources(_jax_varlen PRIVATE ffi/cuda/handler.cu ffi/cuda/dispatch.cu ${instantiations} ${sm90_objects})
target_compile_definitions(_jax_varlen PRIVATE JAX_VARLEN_WITH_CUDA)
target_compile_options(_jax_varlen PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -O3>)
target_link_libraries(_jax_varlen PRIVATE CUDA::cudart_static)
set_target_properties(_jax_varlen PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
message(STATUS "jax_varlen: building CUDA kernels for ${CMAKE_CUDA_ARCHITECTURES}")
