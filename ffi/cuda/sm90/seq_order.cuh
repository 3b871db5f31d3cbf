// The ranking pass of a key-block list (tile_scheduler.h, TileScheduler): the backward's
// sequences heaviest first, decided on the device before its main kernel.
//
// bwd_sm90_kernel runs one CTA per unit (sequence, kv head, key block) of the list (the grid
// placement), and the hardware dispatches CTAs in blockIdx order. In batch order a long
// sequence near the end of the batch leaves its heaviest key blocks (the lowest under causal,
// which every query row sees) for the last wave: on prefill-right-padded, [4096, 1800, 650,
// 3000, 120, 2400, 900, 3500], a list-scheduling simulation over 132 SMs keeps the GPU 84% busy
// in batch order and 94% heaviest first (benchmarks/NOTES.md). So this pass writes
// seq_order[rank] = b by TileScheduler::key_block_weight, ranked with `heavier`. It depends only
// on the lengths, so the order -- and with it which CTA adds its dQ partial when -- never depends
// on timing; the sums' order is the dQ chain's (key blocks descending within a sequence), whatever
// the sequences' order. O(B^2) compares spread over ceil(B / 256) blocks: ~B / 256 x 256 per
// thread. (The forward's many fewer, persistent CTAs rank in the CTA instead: sort_sequences.)
#pragma once

#include "cuda/sm90/tile_scheduler.h"

namespace jax_varlen::cuda::sm90 {

constexpr int kSeqOrderThreads = 256;

// A template on the scheduler, so that the translation units of every dtype of a bucket that
// include this header share one definition (inline linkage): a plain __global__ here is defined
// once per unit, which the link rejects when the build compiles one unit per instantiation
// (cmake/cuda.cmake, 8 or more cores).
template <typename Sched>
__global__ void __launch_bounds__(kSeqOrderThreads) seq_order_kernel(const __grid_constant__ AttentionParams p,
                                                                     int32_t* seq_order) {
  __shared__ int64_t tile[kSeqOrderThreads];
  const int64_t batch = p.batch;
  const int64_t b = int64_t(blockIdx.x) * kSeqOrderThreads + threadIdx.x;
  const int64_t own = b < batch ? Sched::key_block_weight(p, b) : 0;
  int64_t rank = 0;
  for (int64_t base = 0; base < batch; base += kSeqOrderThreads) {
    __syncthreads();
    const int64_t j = base + threadIdx.x;
    tile[threadIdx.x] = j < batch ? Sched::key_block_weight(p, j) : -1;
    __syncthreads();
    const int64_t count = batch - base < kSeqOrderThreads ? batch - base : kSeqOrderThreads;
    for (int i = 0; i < count; ++i) rank += heavier(tile[i], base + i, own, b);
  }
  if (b < batch) seq_order[rank] = int32_t(b);
}

template <typename Sched>
cudaError_t run_seq_order(const AttentionParams& p, int32_t* seq_order, cudaStream_t stream) {
  const unsigned blocks = unsigned((p.batch + kSeqOrderThreads - 1) / kSeqOrderThreads);
  seq_order_kernel<Sched><<<blocks, kSeqOrderThreads, 0, stream>>>(p, seq_order);
  return cudaGetLastError();
}

}  // namespace jax_varlen::cuda::sm90
