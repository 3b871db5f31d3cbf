// Split-KV forward for short queries (decode, speculative decode): memory-bound, so the goal
// is to stream each valid K/V byte once with every SM busy.
//
// Grid: (split, kv head x 16-row block of packed rows, sequence). Packed rows put the query
// heads of a kv-head group side by side (block_info.h), so each K/V byte is read once per
// kv head. A block takes the keys [split * split_keys, (split + 1) * split_keys) of its
// sequence, clipped to the block's last allowed key; splits past it exit at once. Inside the
// block each warp is its own mainloop team (mainloop.h): warp w takes tiles w, w + 4, ...
// through a private two-stage cp.async ring, with Q held in registers. The four warps' softmax
// states are merged in shared memory, and the block writes a normalized fp32 partial output
// and a base-2 lse (layout: sm80/split_layout.h), then counts itself on its row block's
// counter; the last of the row block's splits to arrive merges the splits of each of its rows
// in a fixed order (fwd_combine.cuh, combine_row): deterministic, and since split_keys is a
// constant, independent of the batch. (A separate merge kernel took 9.9 us of decode-paged's
// 232, H100, benchmarks/NOTES.md, session 2026-12-07 m.) A row block with a single split (its
// keys within one chunk: most of a ragged decode batch's) skips the partial and the count: its
// block finishes the rows itself with the merge's arithmetic for one partial
// (fwd_combine.cuh, finish_one_split), bitwise the same. kPaged: the keys are a paged cache's
// (params.h), read in place through the block table (mainloop.h, KvSource).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdlib>

#include "cuda/sm80/softmax.h"
#include "cuda/sm80/split_layout.h"
#include "cuda/sm80/block_info.h"
#include "cuda/device_info.h"
#include "plan/limits.h"
#include "cuda/sm80/fwd_combine.cuh"
#include "cuda/sm80/mainloop.h"
#include "cuda/sm80/ptx.h"
#include "cuda/sm80/tile.h"

namespace jax_varlen::cuda::sm80 {

template <int kHeadDim_, int kBlockN_ = (kHeadDim_ <= 64 ? 32 : 16)>
struct SplitTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 16;                           // packed rows per block (one MMA tile)
  static_assert(kRows == kSplitRowBlock, "the workspace pads rows to whole blocks (limits.h)");
  static constexpr int kBlockN = kBlockN_;  // keys per warp tile
  // Registers capped at 170 for D <= 128 (three blocks' worth); 68 KB blocks (kBlockN * kHeadDim
  // <= 2048: d64 on 32-key tiles, d128 on 16) fit three per SM. d128 on 32-key tiles was 132 KB,
  // one block per SM, and 1.06x slower on decode-paged (H100, benchmarks/NOTES.md, call f1).
  static constexpr int kMinBlocksPerSm = kHeadDim <= 128 ? 3 : 1;
  // Each warp is a team with a two-stage ring, Q in registers.
  using Mainloop = MainloopTraits<kHeadDim, /*kMTiles=*/1, kBlockN, /*kKeyStep=*/kWarps * kBlockN, /*kStages=*/2,
                                  /*kTeamThreads=*/32, /*kQInRegisters=*/true>;
  // sQ [kRows, kHeadDim] 16-bit, then the warps' rings. After the loop the ring area holds the
  // warps' states: o [kWarps, kRows, kHeadDim] fp32, m and l [kWarps, kRows] fp32.
  static constexpr size_t kRingsBytes = size_t(kWarps) * Mainloop::kRingBytes;
  static constexpr size_t kMergeBytes = size_t(kWarps) * kRows * (kHeadDim + 2) * 4;
  static constexpr size_t kSmemBytes =
      size_t(kRows) * kHeadDim * 2 + (kRingsBytes > kMergeBytes ? kRingsBytes : kMergeBytes);
  // A full split gives every warp the same number of tiles.
  static_assert(kSplitKeys % (kWarps * kBlockN) == 0);
};

// One block of the grid (split, kv head x row block, sequence) = (split, head_rb, b): the body of
// fwd_split_kernel. Every exit is block-uniform.
template <typename Elem, int kHeadDim, bool kSoftcap, bool kPaged, typename Tr>
__device__ __forceinline__ void split_block(const AttentionParams& p, int64_t split, int64_t head_rb, int64_t b) {
  using Ml = typename Tr::Mainloop;
  constexpr int kDT = kHeadDim / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  Elem* sQ = reinterpret_cast<Elem*>(smem);
  Elem* rings = sQ + Tr::kRows * kHeadDim;

  const int64_t g = head_rb % p.kv_num_heads, rb = head_rb / p.kv_num_heads;
  const int64_t group = p.num_heads / p.kv_num_heads;
  // Paged: the block-table entries of the split's pages, read before the sequence's length
  // (they do not depend on it) so that the two loads overlap, and kept in shared memory for the
  // mainloop's tiles (mainloop.h, KvSource): no table read left on a tile's path. Clamped into
  // [0, num_pages) as paged_key_row does (seqlen.h).
  constexpr int kPageSlots = kPaged ? kMaxSplitPages : 1, kPagesPerThread = (kPageSlots + Tr::kThreads - 1) / Tr::kThreads;
  __shared__ int pages[kPageSlots];
  const int64_t page0 = kPaged ? split * p.split_keys / p.page_size : 0;
  int page_entry[kPagesPerThread];
  if constexpr (kPaged) {
    const int64_t last = ((split + 1) * p.split_keys - 1) / p.page_size;  // the split's last key's page
    const int64_t count = (last < p.max_pages ? last + 1 : p.max_pages) - page0;
#pragma unroll
    for (int i = 0; i < kPagesPerThread; ++i) {
      const int t = int(threadIdx.x) + i * Tr::kThreads;
      page_entry[i] = t < count ? p.block_table[b * p.max_pages + page0 + t] : 0;
    }
  }
  const BlockInfo blk(p, b, rb, Tr::kRows);
  if (blk.past_end()) return;
  const SeqlenInfo& seq = blk.seq;
  // This split's keys [split_begin, split_end), cut to the block's (mask.h): its tiles start at
  // the block's first allowed key (rounded down to a tile) and stop at its last.
  const int64_t split_begin = split * p.split_keys, split_end = split_begin + p.split_keys;
  const int64_t first_tile = blk.min_first / Tr::kBlockN * Tr::kBlockN;
  const int64_t key_begin = first_tile > split_begin ? first_tile : split_begin;
  const int64_t key_end = blk.max_limit < split_end ? blk.max_limit : split_end;
  // The row block's splits with a key: those that meet [first_tile, max_limit). They all
  // arrive on the counter, and the last one merges; with none, split 0 merges (every row of
  // the block is empty: zeros, lse -inf or the sink's logit).
  const int splits_here = first_tile < blk.max_limit
      ? int((blk.max_limit + p.split_keys - 1) / p.split_keys - first_tile / p.split_keys) : 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto merge_rows = [&] {  // warp w merges the block's rows w, w + kWarps, ...
    for (int64_t r = blk.row_begin + warp; r < blk.row_end; r += Tr::kWarps)
      combine_row<Elem, kHeadDim>(p, b, g, r, lane);
  };
  if (key_begin >= key_end) {  // no key of this row block in the split: no partial, no arrival
    if (split == 0 && splits_here == 0) merge_rows();
    return;
  }

  // Q tile: packed rows -> (query position, head), zeros past the last row and past head_dim.
  const Elem* q = static_cast<const Elem*>(p.q);
  load_tile<kHeadDim, Tr::kRows, Tr::kThreads>(sQ, q, p.head_dim, threadIdx.x, [&](int row) {
    const int64_t r = blk.row_begin + row;
    return r < blk.row_end ? q + seq.q_index(p, r / group, g * group + r % group) : nullptr; });
  cp_async_commit();

  // Allowed keys [first, limit) of this thread's rows lane/4 and lane/4 + 8, the limit clipped
  // to the split: keys at or past key_end belong to the next split. Whether a row has a key in
  // this split at all is decided by its range, never by a sum (SPEC: non-finite real data
  // propagates); the merge below reads it from has_keys, the combine visits the same splits.
  __shared__ bool has_keys[Tr::kRows];
  int first[1][2], limit[1][2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int64_t r = blk.row_begin + lane / 4 + 8 * rr;
    const Range row = r < blk.row_end ? key_range(p.mask(), r / group, seq.seqlen_k, seq.seqlen_q) : Range{0, 0};
    limit[0][rr] = int(row.end < key_end ? row.end : key_end);
    first[0][rr] = int(row.begin);
    if (warp == 0 && (lane & 3) == 0)
      has_keys[lane / 4 + 8 * rr] = (row.end < split_end ? row.end : split_end) > (row.begin > split_begin ? row.begin : split_begin);
  }
  const int min_limit = int(blk.min_limit < key_end ? blk.min_limit : key_end);

  if constexpr (kPaged) {
#pragma unroll
    for (int i = 0; i < kPagesPerThread; ++i) {
      const int t = int(threadIdx.x) + i * Tr::kThreads;
      const int e = page_entry[i];
      if (t < kPageSlots) pages[t] = e < 0 ? 0 : (e >= p.num_pages ? int(p.num_pages) - 1 : e);
    }
    __syncthreads();  // the mainloop's first loads read them
  }
  const KvSource<Elem, kPaged> kv{p, kPaged ? page0 : seq.k_offset, int(g), pages};
  const KeyTiles keys{int(key_begin) + warp * Tr::kBlockN, int(key_end)};  // warp w: tiles w, w + 4, ...
  Accumulators<Ml> acc;
  mainloop<Ml, kSoftcap>(sQ, 0, rings + warp * (Ml::kRingBytes / sizeof(Elem)), kv, keys, first, limit, min_limit,
                         int(blk.max_first), ScoreScale(p.scale, p.softcap), acc);

  // Merge the four warps: each writes (m, l, o) of its 16 rows, then the block combines.
  cp_async_wait_all();
  __syncthreads();
  float* so = reinterpret_cast<float*>(rings);         // [kWarps, kRows, kHeadDim]
  float* sm = so + Tr::kWarps * Tr::kRows * kHeadDim;  // [kWarps, kRows]
  float* sl = sm + Tr::kWarps * Tr::kRows;             // [kWarps, kRows]
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float sum = acc.l[0][rr];
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    const int row = lane / 4 + 8 * rr;
    if ((lane & 3) == 0) {
      sm[warp * Tr::kRows + row] = acc.m[0][rr];
      sl[warp * Tr::kRows + row] = sum;
    }
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      const int col = dt * 8 + 2 * (lane & 3);
      so[(warp * Tr::kRows + row) * kHeadDim + col] = acc.o[0][dt][2 * rr];
      so[(warp * Tr::kRows + row) * kHeadDim + col + 1] = acc.o[0][dt][2 * rr + 1];
    }
  }
  __syncthreads();

  // Row `row`'s state over the block's warps, normalized, at column col: (o / l, base-2 lse). A
  // warp that saw no allowed key has l = 0 and m = -inf: weight 0. NaN in real data keeps sum
  // and o NaN, and the combine propagates it. A sum of exactly 0 (every score of the split
  // -inf, e.g. from an Inf key) is a partial of weight 0: lse -inf, and o 0 rather than 0/0,
  // so that it adds nothing to a row whose other splits have keys.
  auto merged = [&](int row, int col, float& o_n, float& lse_n) {
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) mx = fmaxf(mx, sm[w * Tr::kRows + row]);
    const float m_use = mx == -INFINITY ? 0.0f : mx;
    float sum = 0.0f, o = 0.0f;
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) {
      const float wgt = exp2_approx(sm[w * Tr::kRows + row] - m_use);
      sum += sl[w * Tr::kRows + row] * wgt;
      o += so[(w * Tr::kRows + row) * kHeadDim + col] * wgt;
    }
    o_n = sum == 0.0f ? 0.0f : o / sum;
    lse_n = mx + log2f(sum);
  };
  const int rows_here = int(blk.row_end - blk.row_begin);  // padding rows are never read
  if (splits_here == 1) {
    // The only split of its row block (a sequence's keys within one chunk, as most of a ragged
    // decode batch's are) writes out and lse itself (fwd_combine.cuh, finish_one_split).
    for (int idx = threadIdx.x; idx < rows_here * p.head_dim_v; idx += Tr::kThreads) {
      const int row = idx / int(p.head_dim_v), col = idx % int(p.head_dim_v);
      float o_n = 0.0f, lse_n = 0.0f;
      if (has_keys[row]) merged(row, col, o_n, lse_n);
      finish_one_split<Elem>(p, seq, g, blk.row_begin + row, col, has_keys[row], o_n, lse_n);
    }
    return;
  }
  const int64_t part = split_partial(p, b, g, split, blk.row_begin);
  float* o_part = split_o_part(p) + part * p.head_dim_v;
  float* lse_part = split_lse_part(p) + part;
  for (int idx = threadIdx.x; idx < rows_here * p.head_dim_v; idx += Tr::kThreads) {
    const int row = idx / int(p.head_dim_v), col = idx % int(p.head_dim_v);
    if (!has_keys[row]) continue;  // never read: the combine visits a row's own splits only
    float o_n, lse_n;
    merged(row, col, o_n, lse_n);
    o_part[int64_t(row) * p.head_dim_v + col] = o_n;
    if (col == 0) lse_part[row] = lse_n;
  }

  // Arrive: the partial is written (each thread's stores visible GPU-wide before the count, as
  // in CUDA's threadFenceReduction sample); the block that counts last merges the row block.
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(split_counter(p, b, g, rb), 1) == splits_here - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other splits' partials are read after their counts
  merge_rows();
}

// split_block behind a call, for the persistent loop: inlined into it, its thread-invariant
// addresses were hoisted out of the loop and spilled (d128: 120-152 bytes of stack, 45 local
// loads); behind a call, 56-72 bytes and ~31 local loads, most of them in the prologue (d64: none).
template <typename Elem, int kHeadDim, bool kSoftcap, bool kPaged, typename Tr>
__device__ __noinline__ void split_block_call(const AttentionParams& p, int64_t split, int64_t head_rb, int64_t b) {
  split_block<Elem, kHeadDim, kSoftcap, kPaged, Tr>(p, split, head_rb, b);
}

// kPersistent = false: one block per grid block. kPersistent (Plan::split_persistent, an
// experiment): a grid of a few CTAs per SM walks the same blocks in the same order (the launch's
// linear order, x fastest), gridDim.x apart, so that no block is launched per (split, row
// block) -- a split past its sequence's keys costs a length read, not a launch. A block's work
// and its place in the merge order are the same either way: the results are bitwise equal.
template <typename Elem, int kHeadDim, bool kSoftcap, bool kPaged, bool kPersistent, typename Tr = SplitTraits<kHeadDim>>
__global__ void __launch_bounds__(Tr::kThreads, Tr::kMinBlocksPerSm)
    fwd_split_kernel(const __grid_constant__ AttentionParams p) {
  if constexpr (!kPersistent) {
    split_block<Elem, kHeadDim, kSoftcap, kPaged, Tr>(p, blockIdx.x, blockIdx.y, blockIdx.z);
  } else {
    const SplitGrid rect = split_grid(p);
    const int64_t blocks = rect.blocks();
    for (int64_t i = blockIdx.x; i < blocks; i += gridDim.x) {
      split_block_call<Elem, kHeadDim, kSoftcap, kPaged, Tr>(p, i % rect.splits, i / rect.splits % rect.head_rbs,
                                                             i / (rect.splits * rect.head_rbs));
      __syncthreads();  // the next block's Q and rings overwrite the shared memory this one merged in
    }
  }
}

template <typename Elem, int kHeadDim, typename Tr>
cudaError_t run_fwd_split_with(const AttentionParams& p, cudaStream_t stream) {
  const SplitGrid rect = split_grid(p);
  dim3 grid(unsigned(rect.splits), unsigned(rect.head_rbs), unsigned(rect.batch));
  const bool paged = p.block_table != nullptr;
  auto pick = [&](auto persistent) {
    constexpr bool kPersistent = decltype(persistent)::value;
    return p.softcap > 0.0f ? (paged ? fwd_split_kernel<Elem, kHeadDim, true, true, kPersistent, Tr>
                                     : fwd_split_kernel<Elem, kHeadDim, true, false, kPersistent, Tr>)
                            : (paged ? fwd_split_kernel<Elem, kHeadDim, false, true, kPersistent, Tr>
                                     : fwd_split_kernel<Elem, kHeadDim, false, false, kPersistent, Tr>);
  };
  auto kernel = p.split_persistent ? pick(std::true_type{}) : pick(std::false_type{});
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Tr::kSmemBytes));
  if (err != cudaSuccess) return err;
  if (p.split_persistent) {  // as many CTAs as fit at once, at most one per block
    // CTAs per SM of each (softcap, paged) kernel, asked once: not a query per launch.
    static std::atomic<int> fits[4];
    std::atomic<int>& fit_of = fits[(p.softcap > 0.0f ? 2 : 0) + (paged ? 1 : 0)];
    int per_sm = fit_of.load(std::memory_order_relaxed);
    if (per_sm == 0) {
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Tr::kThreads, Tr::kSmemBytes);
      if (err != cudaSuccess) return err;
      fit_of.store(per_sm, std::memory_order_relaxed);
    }
    const int64_t fit = int64_t(per_sm > 0 ? per_sm : 1) * sm_count();
    grid = dim3(unsigned(rect.blocks() < fit ? rect.blocks() : fit), grid.y > 0 && grid.z > 0 ? 1u : 0u, 1u);
  }
  if (max_splits(p) > 0) {  // the row blocks' arrival counters start at 0 (none without a partial)
    err = cudaMemsetAsync(split_counter(p, 0, 0, 0), 0, size_t(split_counters(p)) * sizeof(int), stream);
    if (err != cudaSuccess) return err;
  }
  if (grid.y > 0 && grid.z > 0) kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename Elem, int kHeadDim>
cudaError_t run_fwd_split(const AttentionParams& p, cudaStream_t stream) {
  return run_fwd_split_with<Elem, kHeadDim, SplitTraits<kHeadDim>>(p, stream);
}

}  // namespace jax_varlen::cuda::sm80
