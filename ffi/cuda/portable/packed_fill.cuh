// The packed layout's rows that no sequence owns (seqlen.h, row_owned: rows past a pack's last
// offset, or cut off by a clamped length): the kernels never write them, so dispatch.cu runs
// these kernels first, on the same stream -- but for the unpaged Hopper forward, whose idle
// producer warps zero its query rows while the consumers compute (fill_out_by_grid). Each
// thread decides the ownership of one row (a binary search over the pack's offsets); then its
// warp zeroes the warp's unowned rows one by one, all lanes on a row (coalesced, 16-byte stores
// where the layout allows). Valid offsets leave only a pack's tail unowned, so for most rows
// the fill is the test alone.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "core/seqlen.h"

namespace jax_varlen::cuda {

constexpr int kFillThreads = 256;

// Zero `bytes` bytes at `dst` (a multiple of 2: every dtype's zero is all-zero bits) with the
// warp: 16-byte stores where the address and the size allow (the dense layouts' rows: a query
// row of d128 bf16 with 32 heads is 8 KB, 16 stores a lane), 2-byte ones otherwise.
__device__ __forceinline__ void zero_span(char* dst, int64_t bytes, int lane) {
  if ((reinterpret_cast<uintptr_t>(dst) | uintptr_t(bytes)) % 16 == 0) {
    uint4* chunks = reinterpret_cast<uint4*>(dst);
    for (int64_t e = lane; e < bytes / 16; e += 32) chunks[e] = make_uint4(0, 0, 0, 0);
    return;
  }
  uint16_t* halves = reinterpret_cast<uint16_t*>(dst);
  for (int64_t e = lane; e < bytes / 2; e += 32) halves[e] = 0;
}

// What a fill writes: the forward's out and lse, the backward's d_query (both over the query
// rows), or its d_key and d_value (over the key rows).
enum class Fill { kOut, kDQuery, kDKeyValue };

// The warp's rows mine - lane .. mine - lane + 31 (mine: this lane's; rows past the packs' are
// none): zero_row(r) for each that no sequence owns, in order, the whole warp on each.
template <bool kKeys, typename ZeroRow>
__device__ __forceinline__ void for_unowned_rows(const AttentionParams& p, int64_t mine, int lane, ZeroRow zero_row) {
  const int64_t rows = p.num_packs * (kKeys ? p.pack_rows_k : p.pack_rows_q);
  // Bit l: the row of lane l belongs to no sequence.
  for (unsigned unowned = __ballot_sync(0xffffffff, mine < rows && !row_owned(p, mine, kKeys));
       unowned != 0; unowned &= unowned - 1)
    zero_row(mine - lane + __ffs(int(unowned)) - 1);
}

// Row r of a [rows, heads, dim] buffer with the given strides (elements), by the warp: one span
// when the heads lie back to back (head_stride = dim), else head by head.
__device__ __forceinline__ void zero_row_heads(void* base, int elem_bytes, int64_t r, int64_t row_stride, int64_t heads,
                                               int64_t head_stride, int64_t dim, int lane) {
  char* row = static_cast<char*>(base) + r * row_stride * elem_bytes;
  if (head_stride == dim) {
    zero_span(row, heads * dim * elem_bytes, lane);
    return;
  }
  for (int64_t h = 0; h < heads; ++h) zero_span(row + h * head_stride * elem_bytes, dim * elem_bytes, lane);
}

// The fill kFill on the warp's rows mine - lane .. mine - lane + 31: the forward's unowned query
// rows get out = 0 and lse = -inf (lse [num_packs, num_heads, pack_rows_q]: row r is (pack
// r / rows, row r % rows)), the backward's d_query = 0, or its unowned key rows d_key = d_value
// = 0. bp: the backward's buffers (unused by kOut, which a forward kernel runs without one).
template <Fill kFill>
__device__ __forceinline__ void fill_warp(const AttentionParams& p, const BackwardParams* bp, int64_t mine, int lane) {
  const int bytes = p.dtype == DType::kF32 ? 4 : 2;
  if constexpr (kFill == Fill::kDKeyValue) {
    for_unowned_rows<true>(p, mine, lane, [&](int64_t r) {
      zero_row_heads(bp->d_k, bytes, r, p.k_row_stride, p.kv_num_heads, p.k_head_stride, p.head_dim, lane);
      zero_row_heads(bp->d_v, bytes, r, p.v_row_stride, p.kv_num_heads, p.v_head_stride, p.head_dim_v, lane);
    });
  } else if constexpr (kFill == Fill::kDQuery) {
    for_unowned_rows<false>(p, mine, lane, [&](int64_t r) {
      zero_row_heads(bp->d_q, bytes, r, p.q_row_stride, p.num_heads, p.q_head_stride, p.head_dim, lane);
    });
  } else {
    for_unowned_rows<false>(p, mine, lane, [&](int64_t r) {
      zero_row_heads(p.out, bytes, r, p.out_row_stride, p.num_heads, p.out_head_stride, p.head_dim_v, lane);
      const int64_t pack = r / p.pack_rows_q, local = r % p.pack_rows_q;
      for (int64_t h = lane; h < p.num_heads; h += 32) p.lse[(pack * p.num_heads + h) * p.pack_rows_q + local] = -INFINITY;
    });
  }
}

// The forward's fill from inside its Hopper kernel (sm90/fwd_sm90.cuh), whose idle producer
// warps run it while the consumers compute (dispatch.cu then runs no fill kernel for the
// call): warp w of `warps` in every CTA of the grid takes every (gridDim.x * warps)-th run of
// 32 query rows.
__device__ __forceinline__ void fill_out_by_grid(const AttentionParams& p, int w, int warps) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = p.num_packs * p.pack_rows_q, step = int64_t(gridDim.x) * warps * 32;
  for (int64_t base = (int64_t(blockIdx.x) * warps + w) * 32; base < rows; base += step)
    fill_warp<Fill::kOut>(p, nullptr, base + lane, lane);
}

// Grid (ceil(rows / kFillThreads)), rows = num_packs * pack_rows_q (or pack_rows_k for
// kDKeyValue); thread t of block x tests row x * kFillThreads + t.
template <Fill kFill>
__global__ void __launch_bounds__(kFillThreads) packed_fill_kernel(const __grid_constant__ BackwardParams bp) {
  fill_warp<kFill>(bp.fwd, &bp, int64_t(blockIdx.x) * kFillThreads + threadIdx.x, int(threadIdx.x % 32));
}

inline unsigned fill_blocks(int64_t rows) { return unsigned((rows + kFillThreads - 1) / kFillThreads); }

// Forward: unowned query rows get out = 0 and lse = -inf.
inline cudaError_t run_packed_fill(const AttentionParams& p, cudaStream_t stream) {
  const int64_t rows = p.num_packs * p.pack_rows_q;
  BackwardParams bp{};
  bp.fwd = p;
  if (rows > 0) packed_fill_kernel<Fill::kOut><<<fill_blocks(rows), kFillThreads, 0, stream>>>(bp);
  return cudaGetLastError();
}

// Backward: unowned query rows get d_query = 0, unowned key rows d_key = d_value = 0.
inline cudaError_t run_packed_fill(const BackwardParams& bp, cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  const int64_t q_rows = p.num_packs * p.pack_rows_q, k_rows = p.num_packs * p.pack_rows_k;
  if (q_rows > 0) packed_fill_kernel<Fill::kDQuery><<<fill_blocks(q_rows), kFillThreads, 0, stream>>>(bp);
  if (k_rows > 0) packed_fill_kernel<Fill::kDKeyValue><<<fill_blocks(k_rows), kFillThreads, 0, stream>>>(bp);
  return cudaGetLastError();
}

}  // namespace jax_varlen::cuda
