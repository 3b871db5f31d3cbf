// The backward's sequence order: heaviest first, decided on the device before the main kernel.
//
// bwd_sm90_kernel runs one CTA per (sequence, kv head, key block), and the hardware dispatches
// CTAs in blockIdx order. In batch order a long sequence near the end of the batch leaves its
// heaviest key blocks (the lowest under causal, which every query row sees) for the last wave:
// on prefill-right-padded, [4096, 1800, 650, 3000, 120, 2400, 900, 3500], a list-scheduling
// simulation over 132 SMs keeps the GPU 84% busy in batch order and 94% heaviest first
// (benchmarks/NOTES.md). The grid therefore takes sequences in the order this kernel writes:
// seq_order[rank] = b, by the query rows that see a key of the sequence's first key block (mask.h,
// row_range: all of them without a mask, min(n_q, n_k) under the tail-aligned causal mask, the
// window's width and the block's under a local window -- the rows of its heaviest key block),
// then by its keys (key blocks), descending, ties by index. It depends only on the lengths, so the order --
// and with it which CTA adds its dQ partial when -- never depends on timing; the sums' order is
// the dQ chain's (key blocks descending within a sequence), whatever the sequences' order.
// O(B^2) compares spread over ceil(B / 256) blocks: ~B / 256 x 256 per thread.
#pragma once

#include "core/seqlen.h"

namespace jax_varlen::cuda::sm90 {

// Sort key of sequence b: rows that see its first block of block_n keys (high 32 bits), then
// its keys.
__device__ __forceinline__ int64_t bwd_seq_weight(const AttentionParams& p, int64_t b, int block_n) {
  const SeqlenInfo seq(p, b);
  if (seq.seqlen_k == 0) return 0;
  const Range rows = row_range(p.mask(), 0, block_n, seq.seqlen_k, seq.seqlen_q);
  return (rows.empty() ? 0 : rows.end - rows.begin) << 32 | seq.seqlen_k;
}

constexpr int kSeqOrderThreads = 256;

// A template (never instantiated but with its default) so that the translation units of every
// (dtype, bucket) that include this header share one definition (inline linkage): a plain
// __global__ here is defined once per unit, which the link rejects when the build compiles one
// unit per instantiation (cmake/cuda.cmake, 8 or more cores).
template <int kUnused = 0>
__global__ void __launch_bounds__(kSeqOrderThreads) bwd_seq_order_kernel(const __grid_constant__ AttentionParams p,
                                                                         int block_n, int32_t* seq_order) {
  __shared__ int64_t tile[kSeqOrderThreads];
  const int64_t batch = p.batch;
  const int64_t b = int64_t(blockIdx.x) * kSeqOrderThreads + threadIdx.x;
  const int64_t own = b < batch ? bwd_seq_weight(p, b, block_n) : 0;
  int64_t rank = 0;
  for (int64_t base = 0; base < batch; base += kSeqOrderThreads) {
    __syncthreads();
    const int64_t j = base + threadIdx.x;
    tile[threadIdx.x] = j < batch ? bwd_seq_weight(p, j, block_n) : -1;
    __syncthreads();
    const int64_t count = batch - base < kSeqOrderThreads ? batch - base : kSeqOrderThreads;
    for (int i = 0; i < count; ++i) {
      const int64_t w = tile[i];
      rank += (w > own) || (w == own && base + i < b);
    }
  }
  if (b < batch) seq_order[rank] = int32_t(b);
}

inline cudaError_t run_bwd_seq_order(const AttentionParams& p, int block_n, int32_t* seq_order, cudaStream_t stream) {
  const unsigned blocks = unsigned((p.batch + kSeqOrderThreads - 1) / kSeqOrderThreads);
  bwd_seq_order_kernel<><<<blocks, kSeqOrderThreads, 0, stream>>>(p, block_n, seq_order);
  return cudaGetLastError();
}

}  // namespace jax_varlen::cuda::sm90
