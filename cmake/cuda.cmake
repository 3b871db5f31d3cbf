# CUDA part of the extension: the FFI handler, the dispatch table, and generated .cu files that
# instantiate the kernels: one per entry point (all its dtypes and head-dim buckets) on a machine
# with few cores, one per instantiation on one with many (JAX_VARLEN_CUDA_UNITS below).
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

# Machine code for sm_80 (Ampere) and sm_90a (Hopper), plus compute_80 PTX so that newer GPUs
# can JIT the kernels. JAX_VARLEN_CUDA_ARCHS overrides the list (e.g. "90a-real" for a quick
# build on one H100/H200).
set(JAX_VARLEN_CUDA_ARCHS "80-real;90a-real;80-virtual" CACHE STRING "CUDA architectures to build")
set(CMAKE_CUDA_ARCHITECTURES ${JAX_VARLEN_CUDA_ARCHS})
set(CMAKE_CUDA_STANDARD 17)

# The head-dim buckets come from the header the dispatch table reads (kHeadDimBuckets), so the
# instantiations and the table cannot disagree.
file(STRINGS "${CMAKE_CURRENT_SOURCE_DIR}/ffi/plan/limits.h" buckets_line REGEX "kHeadDimBuckets\\[\\] =")
string(REGEX MATCHALL "[0-9]+" head_dim_buckets "${buckets_line}")

set(instantiation_dir "${CMAKE_CURRENT_BINARY_DIR}/instantiations")

# Translation units. Each .cu file pays its header's parse once: measured on the 2-core machine
# (nvcc 13.0, 2026-12-05), an sm90 file that instantiates nothing costs 32 s of CPU (cudafe++
# 18 s, cicc 10 s), and each Hopper instantiation about 13 s more. One file per instantiation
# spends 530 s of CPU on the ten Hopper ones, one file per entry point 173 s (the sm80 kernels:
# 118 s -> about 90 s), which is what a 2-core machine needs; with many cores, one file per
# instantiation finishes sooner (the longest file is 55 s instead of 100 s).
cmake_host_system_information(RESULT host_cores QUERY NUMBER_OF_LOGICAL_CORES)
if(host_cores LESS 8)
  set(default_units "entry-point")
else()
  set(default_units "instantiation")
endif()
set(JAX_VARLEN_CUDA_UNITS "${default_units}" CACHE STRING
    "One generated .cu file per entry-point or per instantiation (default: by core count)")
set_property(CACHE JAX_VARLEN_CUDA_UNITS PROPERTY STRINGS entry-point instantiation)
if(NOT JAX_VARLEN_CUDA_UNITS MATCHES "^(entry-point|instantiation)$")
  message(FATAL_ERROR "JAX_VARLEN_CUDA_UNITS must be entry-point or instantiation, "
                      "got '${JAX_VARLEN_CUDA_UNITS}'")
endif()

# jax_varlen_instantiate(<list> <header> <function> ELEMS <ctype:tag>... [DIMS <bucket>...]
#                        [PARAMS <struct>] [PER_ELEM])
# instantiates the entry point <function><ctype[, bucket]>(const <struct>&, cudaStream_t)
# defined in <header> (struct: AttentionParams unless given, BackwardParams for the backward)
# for every dtype (and head-dim bucket, when DIMS is given), in generated .cu files appended to
# <list>: one file for them all (<name>.cu) or one each (<name>_<tag>[_d<bucket>].cu), as
# JAX_VARLEN_CUDA_UNITS says; PER_ELEM: at least one per dtype (<name>_<tag>.cu), for an entry
# point so long to compile that one file would be the build's longest pole.
function(jax_varlen_instantiate out_var header function)
  cmake_parse_arguments(PARSE_ARGV 3 arg "PER_ELEM" "PARAMS" "ELEMS;DIMS")
  if(NOT arg_PARAMS)
    set(arg_PARAMS AttentionParams)
  endif()
  string(REGEX REPLACE ".*::" "" name "${function}")
  set(files ${${out_var}})
  set(lines "")
  foreach(elem IN LISTS arg_ELEMS)
    string(REPLACE ":" ";" pair "${elem}")
    list(GET pair 0 ctype)
    list(GET pair 1 tag)
    set(variants "")
    if(arg_DIMS)
      foreach(dim IN LISTS arg_DIMS)
        list(APPEND variants "${ctype}, ${dim}|${tag}_d${dim}")
      endforeach()
    else()
      list(APPEND variants "${ctype}|${tag}")
    endif()
    foreach(variant IN LISTS variants)
      string(REPLACE "|" ";" variant "${variant}")
      list(GET variant 0 targs)
      list(GET variant 1 suffix)
      set(line "template cudaError_t ${function}<${targs}>(const jax_varlen::${arg_PARAMS}&, cudaStream_t);\n")
      if(JAX_VARLEN_CUDA_UNITS STREQUAL "instantiation")
        set(file "${instantiation_dir}/${name}_${suffix}.cu")
        file(CONFIGURE OUTPUT "${file}" CONTENT "#include \"${header}\"\n${line}")
        list(APPEND files "${file}")
      else()
        string(APPEND lines "${line}")
      endif()
    endforeach()
    if(arg_PER_ELEM AND JAX_VARLEN_CUDA_UNITS STREQUAL "entry-point")
      set(file "${instantiation_dir}/${name}_${tag}.cu")
      file(CONFIGURE OUTPUT "${file}" CONTENT "#include \"${header}\"\n${lines}")
      list(APPEND files "${file}")
      set(lines "")
    endif()
  endforeach()
  if(JAX_VARLEN_CUDA_UNITS STREQUAL "entry-point" AND NOT arg_PER_ELEM)
    set(file "${instantiation_dir}/${name}.cu")
    file(CONFIGURE OUTPUT "${file}" CONTENT "#include \"${header}\"\n${lines}")
    list(APPEND files "${file}")
  endif()
  set(${out_var} ${files} PARENT_SCOPE)
endfunction()

# The sm80 kernels (ffi/cuda/sm80/) and the portable ones (ffi/cuda/portable/), compiled for
# every target architecture.
set(tensor_core_elems "__half:f16" "__nv_bfloat16:bf16")
set(sm80_sources "")
jax_varlen_instantiate(sm80_sources cuda/sm80/fwd_tc.cuh jax_varlen::cuda::sm80::run_fwd_tc
                       ELEMS ${tensor_core_elems} DIMS ${head_dim_buckets})
jax_varlen_instantiate(sm80_sources cuda/sm80/fwd_split.cuh jax_varlen::cuda::sm80::run_fwd_split
                       ELEMS ${tensor_core_elems} DIMS ${head_dim_buckets})
jax_varlen_instantiate(sm80_sources cuda/portable/fwd_simt.cuh jax_varlen::cuda::portable::run_fwd_simt
                       ELEMS "float:f32" ${tensor_core_elems})
jax_varlen_instantiate(sm80_sources cuda/sm80/bwd_tc.cuh jax_varlen::cuda::sm80::run_bwd_tc
                       ELEMS ${tensor_core_elems} DIMS ${head_dim_buckets} PARAMS BackwardParams)
jax_varlen_instantiate(sm80_sources cuda/portable/bwd_simt.cuh jax_varlen::cuda::portable::run_bwd_simt
                       ELEMS "float:f32" ${tensor_core_elems} PARAMS BackwardParams)
# Static libraries of kernels rather than sources of the module: the archive step puts each
# kernel file one edge further from the module than the module's own files, so Ninja (1.12
# on, critical-path order) starts the kernel files -- the build's longest -- first and the
# short host files fill the cores at the end. Started last, as the module's sources were, the
# longest (the Hopper forward's) ran alone at the end: benchmarks/NOTES.md has the timings.
add_library(jax_varlen_sm80 STATIC ${sm80_sources})
target_include_directories(jax_varlen_sm80 PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}/ffi")
target_compile_options(jax_varlen_sm80 PRIVATE --expt-relaxed-constexpr -O3)
set_target_properties(jax_varlen_sm80 PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}"
                                                 POSITION_INDEPENDENT_CODE ON)

# The Hopper path (ffi/cuda/sm90/): CuTe/CUTLASS headers from the nvidia-cutlass package (a build
# requirement), compiled for sm_90a only, as its own object library, when 90a is a target.
set(sm90_library "")
if(JAX_VARLEN_CUDA_ARCHS MATCHES "90a")
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
    OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE CUTLASS_INCLUDE_DIR RESULT_VARIABLE cutlass_found)
  if(cutlass_found EQUAL 0 AND EXISTS "${CUTLASS_INCLUDE_DIR}/cute/tensor.hpp")
    set(sm90_sources "")
    jax_varlen_instantiate(sm90_sources cuda/sm90/fwd_sm90.cuh jax_varlen::cuda::sm90::run_fwd_sm90
                           ELEMS ${tensor_core_elems} DIMS ${head_dim_buckets} PER_ELEM)
    # The backward at every bucket (256: the wide consumers, sm90/bwd_mma_wide.h), one file per
    # element type: the d256 kernels would otherwise lengthen the longest file of the build.
    jax_varlen_instantiate(sm90_sources cuda/sm90/bwd_sm90.cuh jax_varlen::cuda::sm90::run_bwd_sm90
                           ELEMS ${tensor_core_elems} DIMS ${head_dim_buckets} PARAMS BackwardParams PER_ELEM)
    add_library(jax_varlen_sm90 STATIC ${sm90_sources})  # a static library: see jax_varlen_sm80
    target_include_directories(jax_varlen_sm90 PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}/ffi" "${CUTLASS_INCLUDE_DIR}")
    target_compile_options(jax_varlen_sm90 PRIVATE --expt-relaxed-constexpr -O3)
    set_target_properties(jax_varlen_sm90 PROPERTIES CUDA_ARCHITECTURES "90a-real" POSITION_INDEPENDENT_CODE ON)
    set(sm90_library jax_varlen_sm90)
    target_compile_definitions(_jax_varlen PRIVATE JAX_VARLEN_WITH_SM90)
    message(STATUS "jax_varlen: Hopper (sm_90a) path with CUTLASS headers from ${CUTLASS_INCLUDE_DIR}")
  else()
    message(WARNING "jax_varlen: nvidia-cutlass not importable; building without the Hopper path")
  endif()
endif()

# A profiling build: the Hopper forward records when each step of each unit ran
# (ffi/cuda/sm90/fwd_trace.h, benchmarks/unit_trace.py). Off: the kernels are the same as without it.
option(JAX_VARLEN_FWD_TRACE "Build the Hopper forward's unit trace (profiling only)" OFF)
if(JAX_VARLEN_FWD_TRACE)
  if(NOT sm90_library)
    message(FATAL_ERROR "JAX_VARLEN_FWD_TRACE needs the Hopper path (90a in JAX_VARLEN_CUDA_ARCHS, nvidia-cutlass)")
  endif()
  target_compile_definitions(jax_varlen_sm90 PRIVATE JAX_VARLEN_FWD_TRACE)
  target_compile_definitions(_jax_varlen PRIVATE JAX_VARLEN_FWD_TRACE)
endif()

target_sources(_jax_varlen PRIVATE ffi/xla/cuda.cu ffi/cuda/dispatch.cu)
target_compile_definitions(_jax_varlen PRIVATE JAX_VARLEN_WITH_CUDA)
target_compile_options(_jax_varlen PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -O3>)
target_link_libraries(_jax_varlen PRIVATE jax_varlen_sm80 ${sm90_library} CUDA::cudart_static)
set_target_properties(_jax_varlen PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
message(STATUS "jax_varlen: building CUDA kernels for ${CMAKE_CUDA_ARCHITECTURES}, one .cu file "
               "per ${JAX_VARLEN_CUDA_UNITS} (${host_cores} cores)")
