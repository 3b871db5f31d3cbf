// The split-KV kernel's block order (fwd_split.cuh): which (sequence, split, kv head x row
// block) a block of the grid takes. The grid is the rectangle (splits, kv heads x row blocks,
// sequences) whatever the order; its blocks are dispatched in linear order, x fastest, so an
// order is a bijection from the linear block index onto that rectangle.
//   kRectangular  splits fastest (the grid's own coordinates): a sequence's splits side by side,
//                 those past its keys exiting among the rest.
//   kHeadsFastest kv heads x row blocks fastest, then splits, then sequences: the blocks that
//                 read the same keys of different kv heads (adjacent 256-byte rows of one
//                 cache row) run at the same time.
//   kLongestFirst kv heads x row blocks fastest over units (sequence, split) ordered as whole
//                 chunks first, then each sequence's last partial chunk, then the splits past
//                 a sequence's keys: longest processing time first, so that the grid's tail
//                 holds the short blocks, and the empty ones come after every real one. Each
//                 block finds its unit from every sequence's key count (a block-wide scan;
//                 kMaxLongestFirstBatch sequences at most, the plan's condition).
// A benchmark knob (JAX_VARLEN_SPLIT_ORDER, plan.h): the order moves no bit of the result.
#pragma once

#include "core/seqlen.h"

namespace jax_varlen::cuda::sm80 {

// Thread t of the 128 counts sequences t * per on (per = ceil(batch / 128) <= 4).
constexpr int64_t kMaxLongestFirstBatch = 512;

enum class SplitOrder : int { kRectangular = 0, kLongestFirst = 1, kHeadsFastest = 2 };

struct SplitBlock {
  int64_t split, head_rb, b;  // split, kv head x row block (g + kv_num_heads * rb), sequence
};

// The unit of linear index u in the longest-first order: every thread of the block must call it.
// Thread t counts sequences [t * per, (t + 1) * per) (per = ceil(batch / kThreads)).
template <int kThreads>
__device__ SplitBlock longest_first_unit(const AttentionParams& p, int64_t u, int64_t splits) {
  constexpr int kWarps = kThreads / 32;
  __shared__ int warp_sums[3][kWarps];
  __shared__ long long found[2];
  const int64_t per = (p.batch + kThreads - 1) / kThreads;
  const int64_t b0 = threadIdx.x * per, b1 = b0 + per < p.batch ? b0 + per : p.batch;
  // A sequence of n keys has n / split_keys whole chunks, then one partial chunk when the
  // split_keys do not divide n, then splits - ceil(n / split_keys) empty splits.
  auto counts = [&](int64_t b, int& whole, int& partial) {
    const int64_t n = SeqlenInfo(p, b).seqlen_k;
    const int64_t w = n / p.split_keys, c = (n + p.split_keys - 1) / p.split_keys;
    whole = int(w < splits ? w : splits);
    partial = int((c < splits ? c : splits) - whole);
  };
  int mine[3] = {0, 0, 0};  // this thread's whole, partial and empty units
  for (int64_t b = b0; b < b1; ++b) {
    int whole, partial;
    counts(b, whole, partial);
    mine[0] += whole;
    mine[1] += partial;
    mine[2] += int(splits) - whole - partial;
  }
  // Block-wide exclusive scans of the three counts: within the warp, then over the warps.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int incl[3];
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    incl[k] = mine[k];
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffff, incl[k], d);
      if (lane >= d) incl[k] += v;
    }
    if (lane == 31) warp_sums[k][warp] = incl[k];
  }
  __syncthreads();
  int before[3], total[3];
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    before[k] = incl[k] - mine[k];
    total[k] = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) before[k] += warp_sums[k][w];
      total[k] += warp_sums[k][w];
    }
  }
  // The unit's kind (0 whole, 1 partial, 2 empty) and its index among the units of that kind
  // (selected without indexing the arrays by it, which would put them in local memory).
  const int kind = u < total[0] ? 0 : (u < total[0] + total[1] ? 1 : 2);
  const int64_t at = u - (kind >= 1 ? total[0] : 0) - (kind == 2 ? total[1] : 0);
  const int first = kind == 0 ? before[0] : (kind == 1 ? before[1] : before[2]);
  const int count = kind == 0 ? mine[0] : (kind == 1 ? mine[1] : mine[2]);
  if (at >= first && at < first + count) {  // exactly one thread holds it
    int64_t left = at - first;
    for (int64_t b = b0; b < b1; ++b) {
      int whole, partial;
      counts(b, whole, partial);
      const int here = kind == 0 ? whole : (kind == 1 ? partial : int(splits) - whole - partial);
      if (left < here) {
        found[0] = b;
        found[1] = kind == 0 ? left : (kind == 1 ? whole : whole + partial + left);
        break;
      }
      left -= here;
    }
  }
  __syncthreads();
  return {found[1], 0, found[0]};
}

// The block's (split, kv head x row block, sequence) under `order`; every thread of the block
// must call it (the longest-first order syncs the block).
template <int kThreads>
__device__ SplitBlock split_block(const AttentionParams& p, SplitOrder order) {
  if (order == SplitOrder::kRectangular) return {blockIdx.x, blockIdx.y, blockIdx.z};
  const int64_t splits = gridDim.x, head_rbs = gridDim.y;
  const int64_t linear = blockIdx.x + gridDim.x * (blockIdx.y + int64_t(gridDim.y) * blockIdx.z);
  const int64_t head_rb = linear % head_rbs, u = linear / head_rbs;
  if (order == SplitOrder::kHeadsFastest) return {u % splits, head_rb, u / splits};
  SplitBlock blk = longest_first_unit<kThreads>(p, u, splits);
  blk.head_rb = head_rb;
  return blk;
}

}  // namespace jax_varlen::cuda::sm80
