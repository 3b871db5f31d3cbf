// Shared-memory tiles of the sm80 tensor-core kernels: the swizzled [rows, kHeadDim] layout that
// ldmatrix reads without bank conflicts, and the cp.async copies that fill it.
#pragma once

#include <cstdint>

#include "cuda/sm80/ptx.h"

namespace jax_varlen::cuda::sm80 {

// Element offset of (row, 16-byte chunk) in a [rows, kHeadDim] smem tile. Chunks are XOR-
// swizzled by row % 8, so the 8 rows one ldmatrix reads land in 8 different bank groups.
template <int kHeadDim>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

// Copies kRows rows of `dim` elements into a swizzled [kRows, kHeadDim] tile with kThreads
// threads (tid in [0, kThreads)); row r comes from src(r), or is zeros when src(r) is null.
// Columns past dim are zeros too. Zero-filling copies read nothing; they are handed `base` (any
// valid address) only to keep the operand sane. Used for Q, whose packed rows are not evenly
// spaced (sm80/block_info.h).
template <int kHeadDim, int kRows, int kThreads, typename Elem, typename Src>
__device__ __forceinline__ void load_tile(Elem* tile, const Elem* base, int64_t dim, unsigned tid, Src src) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
#pragma unroll
  for (int idx = tid; idx < kRows * kChunks; idx += kThreads) {
    const int row = idx / kChunks, chunk = idx % kChunks;
    const Elem* from = src(row);
    const bool valid = from != nullptr && chunk * 8 < dim;
    cp_async_16(tile + swizzle<kHeadDim>(row, chunk), valid ? from + chunk * 8 : base, valid);
  }
}

// A K or V tile of kRows keys: rows from `first` on, `stride` elements apart, copied by kThreads
// threads (tid in [0, kThreads), unsigned so that / and % stay shifts); rows at or past `rows`
// and columns past `dim` are zeros (and never read). A thread always copies the same 16-byte
// chunk, of rows tid / kChunks + i * kRowStep, so the address is one add per row (this runs
// every tile).
template <int kHeadDim, int kRows, int kThreads, typename Elem>
__device__ __forceinline__ void load_rows(Elem* tile, const Elem* first, int64_t stride, int rows, int64_t dim,
                                          unsigned tid) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRows % kRowStep == 0);
  const int chunk = tid % kChunks, row0 = tid / kChunks;
  const bool col_ok = chunk * 8 < dim;
  const Elem* from = first + row0 * stride + chunk * 8;
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i) {
    const int row = row0 + i * kRowStep;
    const bool valid = col_ok && row < rows;
    cp_async_16(tile + swizzle<kHeadDim>(row, chunk), valid ? from : first, valid);
    from += kRowStep * stride;
  }
}

// load_rows for keys that lie in runs of kRun consecutive rows `stride` apart, each run
// anywhere (the pages of a paged cache): run_start(r) gives the address of row r of the tile for
// r a multiple of kRun below `rows`. A thread's rows tid / kChunks + i * kRowStep stay in the
// run of i * kRowStep (kRowStep divides kRun), so each run's start is asked once per thread.
// `any` is a valid address (the tensor's base), the operand of the zero-filling copies.
template <int kHeadDim, int kRows, int kThreads, int kRun, typename Elem, typename RunStart>
__device__ __forceinline__ void load_runs(Elem* tile, RunStart run_start, const Elem* any, int64_t stride, int rows,
                                          int64_t dim, unsigned tid) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRun % kRowStep == 0 && kRows % kRun == 0);
  const int chunk = tid % kChunks, row0 = tid / kChunks;
  const bool col_ok = chunk * 8 < dim;
#pragma unroll
  for (int run = 0; run < kRows; run += kRun) {
    if (run >= rows) {  // a run past the keys: zeros, and no block-table read
#pragma unroll
      for (int i = 0; i < kRun / kRowStep; ++i)
        cp_async_16(tile + swizzle<kHeadDim>(run + row0 + i * kRowStep, chunk), any, false);
      continue;
    }
    const Elem* from = run_start(run) + row0 * stride + chunk * 8;
#pragma unroll
    for (int i = 0; i < kRun / kRowStep; ++i) {
      const int row = run + row0 + i * kRowStep;
      const bool valid = col_ok && row < rows;
      cp_async_16(tile + swizzle<kHeadDim>(row, chunk), valid ? from : any, valid);
      from += kRowStep * stride;
    }
  }
}

}  // namespace jax_varlen::cuda::sm80
