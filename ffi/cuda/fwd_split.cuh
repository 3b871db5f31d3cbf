// Split-KV forward for short queries (decode, speculative decode): memory-bound, so the goal
// is to stream each valid K/V byte once with every SM busy.
//
// Grid: (split, kv head x 16-row block of packed rows, sequence). Packed rows put the query
// heads of a kv-head group side by side (tile_scheduler.h), so each K/V byte is read once per
// kv head. A block takes the keys [split * split_keys, (split + 1) * split_keys) of its
// sequence, clipped to the block's last allowed key; splits past it exit at once. Inside the
// block each warp streams its own tiles (warp w takes tiles w, w + 4, ...) through a private
// cp.async pipeline, with Q held in registers; the four warps' softmax states are merged in
// shared memory, and the block writes a normalized fp32 partial output and a base-2 lse.
// fwd_combine_kernel then merges the splits of each row in a fixed order: deterministic, and
// since split_keys is a constant, independent of the batch.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "cuda/ptx.h"
#include "cuda/softmax.h"
#include "cuda/tile.h"
#include "cuda/fwd_split_layout.h"
#include "cuda/tile_scheduler.h"

namespace jax_varlen::cuda {

template <int kHeadDim_>
struct SplitTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 16;                            // packed rows per block (one MMA tile)
  static constexpr int kBlockN = kHeadDim <= 128 ? 32 : 16;  // keys per warp tile
  static constexpr int kStages = 2;                           // tiles in flight per warp
  static constexpr int kChunks = kHeadDim / 8;
  // Three 68 KB blocks per SM for D <= 128 (12 warps streaming; registers capped at 170).
  static constexpr int kMinBlocksPerSm = kHeadDim <= 128 ? 3 : 1;
  static constexpr int kTileElems = kBlockN * kHeadDim;
  // sQ [kRows, kHeadDim] then, per warp and stage, sK and sV [kBlockN, kHeadDim] (16-bit).
  // After the loop the stage area holds the warps' states: o [kWarps, kRows, kHeadDim] fp32,
  // m and l [kWarps, kRows] fp32.
  static constexpr size_t kStageBytes = size_t(kWarps) * kStages * 2 * kTileElems * 2;
  static constexpr size_t kMergeBytes = size_t(kWarps) * kRows * (kHeadDim + 2) * 4;
  static constexpr size_t kSmemBytes =
      size_t(kRows) * kHeadDim * 2 + (kStageBytes > kMergeBytes ? kStageBytes : kMergeBytes);
};

template <typename Elem, int kHeadDim, bool kSoftcap>
__global__ void __launch_bounds__(SplitTraits<kHeadDim>::kThreads, SplitTraits<kHeadDim>::kMinBlocksPerSm)
    fwd_split_kernel(const __grid_constant__ AttentionParams p) {
  using Tr = SplitTraits<kHeadDim>;
  constexpr int kNT = Tr::kBlockN / 8, kDT = kHeadDim / 8, kKS = kHeadDim / 16;
  extern __shared__ __align__(128) unsigned char smem[];
  Elem* sQ = reinterpret_cast<Elem*>(smem);
  Elem* stages = sQ + Tr::kRows * kHeadDim;

  const int64_t split = blockIdx.x, g = blockIdx.y % p.kv_num_heads, rb = blockIdx.y / p.kv_num_heads;
  const int64_t b = blockIdx.z;
  const int64_t group = p.num_heads / p.kv_num_heads;
  const BlockInfo blk(p, b, rb, Tr::kRows);
  const int64_t key_begin = split * p.split_keys;
  const int64_t key_end = blk.max_limit < key_begin + p.split_keys ? blk.max_limit : key_begin + p.split_keys;
  if (key_begin >= key_end) return;  // past this row block's last allowed key: never merged
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Q tile: packed rows -> (query position, head), zeros past the last row and past head_dim.
  const Elem* q = static_cast<const Elem*>(p.q);
  for (int idx = threadIdx.x; idx < Tr::kRows * Tr::kChunks; idx += Tr::kThreads) {
    const int row = idx / Tr::kChunks, chunk = idx % Tr::kChunks;
    const int64_t r = blk.row_begin + row;
    const bool valid = r < blk.row_end && chunk * 8 < p.head_dim;
    const int64_t off = valid ? ((b * p.seqlen_q + r / group) * p.num_heads + g * group + r % group) * p.head_dim + chunk * 8 : 0;
    cp_async_16(sQ + swizzle<kHeadDim>(row, chunk), q + off, valid);
  }
  cp_async_commit();

  int limit[2];  // allowed keys of this thread's rows lane/4 and lane/4 + 8
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int64_t r = blk.row_begin + lane / 4 + 8 * rr;
    limit[rr] = r < blk.row_end ? int(allowed_keys(r / group, blk.n, p.seqlen_q, p.is_causal)) : 0;
  }

  const Elem* k_base = static_cast<const Elem*>(p.k) + (b * p.seqlen_k * p.kv_num_heads + g) * p.head_dim;
  const Elem* v_base = static_cast<const Elem*>(p.v) + (b * p.seqlen_k * p.kv_num_heads + g) * p.head_dim_v;
  const int64_t k_stride = p.kv_num_heads * p.head_dim, v_stride = p.kv_num_heads * p.head_dim_v;
  Elem* my_stages = stages + warp * Tr::kStages * 2 * Tr::kTileElems;
  const int n_tiles = int((key_end - key_begin + Tr::kBlockN - 1) / Tr::kBlockN);
  const int my_tiles = n_tiles > warp ? (n_tiles - warp + Tr::kWarps - 1) / Tr::kWarps : 0;
  // Tile `it` of this warp: keys key_begin + (warp + kWarps * it) * kBlockN + [0, kBlockN).
  // A lane always copies the same 16-byte chunk of rows row0 + i * kRowStep, so the addresses
  // advance by one add per row (kChunks is 8, 16 or 32: it divides the warp).
  constexpr int kRowStep = 32 / Tr::kChunks;
  const int chunk = lane % Tr::kChunks, row0 = lane / Tr::kChunks;
  const bool k_col = chunk * 8 < p.head_dim, v_col = chunk * 8 < p.head_dim_v;
  auto load = [&](int it) {
    Elem* sK = my_stages + (it % Tr::kStages) * 2 * Tr::kTileElems;
    Elem* sV = sK + Tr::kTileElems;
    const int64_t n0 = key_begin + int64_t(warp + Tr::kWarps * it) * Tr::kBlockN;
    const int rows = int(key_end - n0 < Tr::kBlockN ? key_end - n0 : Tr::kBlockN);
    const Elem* k_from = k_base + (n0 + row0) * k_stride + chunk * 8;
    const Elem* v_from = v_base + (n0 + row0) * v_stride + chunk * 8;
#pragma unroll
    for (int i = 0; i < Tr::kBlockN / kRowStep; ++i) {
      const int row = row0 + i * kRowStep;
      const bool k_ok = row < rows && k_col, v_ok = row < rows && v_col;
      cp_async_16(sK + swizzle<kHeadDim>(row, chunk), k_ok ? k_from : k_base, k_ok);
      cp_async_16(sV + swizzle<kHeadDim>(row, chunk), v_ok ? v_from : v_base, v_ok);
      k_from += kRowStep * k_stride;
      v_from += kRowStep * v_stride;
    }
  };
#pragma unroll
  for (int s = 0; s < Tr::kStages; ++s) {
    if (s < my_tiles) load(s);
    cp_async_commit();  // empty groups keep the wait counts uniform
  }
  // The first K/V tiles are in flight before the block waits for Q (the oldest group).
  cp_async_wait<Tr::kStages>();
  __syncthreads();
  uint32_t qa[kKS][4];  // Q as MMA A fragments, kept in registers for the whole loop
#pragma unroll
  for (int ks = 0; ks < kKS; ++ks) ldmatrix_x4(qa[ks], sQ + swizzle<kHeadDim>(lane & 15, ks * 2 + (lane >> 4)));

  const ScoreScale scale(p.scale, p.softcap);
  float o[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  for (int it = 0; it < my_tiles; ++it) {
    cp_async_wait<Tr::kStages - 1>();
    __syncwarp();
    const Elem* sK = my_stages + (it % Tr::kStages) * 2 * Tr::kTileElems;
    const Elem* sV = sK + Tr::kTileElems;
    const int64_t n0 = key_begin + int64_t(warp + Tr::kWarps * it) * Tr::kBlockN;

    float s[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kKS; ++ks) {
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t bk[4];
        const int mi = lane >> 3;
        ldmatrix_x4(bk, sK + swizzle<kHeadDim>(np * 16 + (mi >> 1) * 8 + (lane & 7), ks * 2 + (mi & 1)));
        mma_16816<Elem>(s[2 * np], qa[ks], bk[0], bk[1]);
        mma_16816<Elem>(s[2 * np + 1], qa[ks], bk[2], bk[3]);
      }
    }
    // Keys at or past key_end belong to the next split; keys past a row's limit are masked.
    const bool masked = n0 + Tr::kBlockN > blk.min_limit || n0 + Tr::kBlockN > key_end;
    online_softmax<kSoftcap>(s, m, l, o, scale, masked, [&](int key, int rr) {
      return n0 + key >= limit[rr] || n0 + key >= key_end;
    });
#pragma unroll
    for (int kk = 0; kk < kNT / 2; ++kk) {
      uint32_t a[4] = {pack2<Elem>(s[2 * kk][0], s[2 * kk][1]), pack2<Elem>(s[2 * kk][2], s[2 * kk][3]),
                       pack2<Elem>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                       pack2<Elem>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < kDT / 2; ++dp) {
        uint32_t bv[4];
        const int mi = lane >> 3;
        ldmatrix_x4_trans(bv, sV + swizzle<kHeadDim>(kk * 16 + (mi & 1) * 8 + (lane & 7), dp * 2 + (mi >> 1)));
        mma_16816<Elem>(o[2 * dp], a, bv[0], bv[1]);
        mma_16816<Elem>(o[2 * dp + 1], a, bv[2], bv[3]);
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
    if (it + Tr::kStages < my_tiles) load(it + Tr::kStages);
    cp_async_commit();
  }

  // Merge the four warps: each writes (m, l, o) of its 16 rows, then the block combines.
  cp_async_wait_all();
  __syncthreads();
  float* so = reinterpret_cast<float*>(stages);           // [kWarps, kRows, kHeadDim]
  float* sm = so + Tr::kWarps * Tr::kRows * kHeadDim;      // [kWarps, kRows]
  float* sl = sm + Tr::kWarps * Tr::kRows;                 // [kWarps, kRows]
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float sum = l[rr];
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    const int row = lane / 4 + 8 * rr;
    if ((lane & 3) == 0) {
      sm[warp * Tr::kRows + row] = m[rr];
      sl[warp * Tr::kRows + row] = sum;
    }
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      const int col = dt * 8 + 2 * (lane & 3);
      so[(warp * Tr::kRows + row) * kHeadDim + col] = o[dt][2 * rr];
      so[(warp * Tr::kRows + row) * kHeadDim + col + 1] = o[dt][2 * rr + 1];
    }
  }
  __syncthreads();

  const int64_t rows_pad = rows_padded(p);
  const int64_t part = ((b * p.kv_num_heads + g) * max_splits(p) + split) * rows_pad + blk.row_begin;
  float* o_part = p.workspace + part * p.head_dim_v;
  float* lse_part = p.workspace + p.batch * p.kv_num_heads * max_splits(p) * rows_pad * p.head_dim_v + part;
  const int rows_here = int(blk.row_end - blk.row_begin);  // padding rows are never read
  for (int idx = threadIdx.x; idx < rows_here * p.head_dim_v; idx += Tr::kThreads) {
    const int row = idx / int(p.head_dim_v), col = idx % int(p.head_dim_v);
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) mx = fmaxf(mx, sm[w * Tr::kRows + row]);
    // A warp that saw no allowed key has l = 0 and m = -inf: weight 0. A row with no allowed
    // key in this split sums to exactly 0 (zero partial, lse -inf); NaN in real data keeps
    // the sum NaN and propagates (SPEC: non-finite real data).
    const float m_use = mx == -INFINITY ? 0.0f : mx;
    float sum = 0.0f, acc = 0.0f;
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) {
      const float wgt = exp2_approx(sm[w * Tr::kRows + row] - m_use);
      sum += sl[w * Tr::kRows + row] * wgt;
      acc += so[(w * Tr::kRows + row) * kHeadDim + col] * wgt;
    }
    o_part[int64_t(row) * p.head_dim_v + col] = sum == 0.0f ? 0.0f : acc / sum;
    if (col == 0) lse_part[row] = sum == 0.0f ? -INFINITY : mx + log2f(sum);
  }
}

// max that keeps NaN (fmaxf drops it): a NaN partial lse must reach the merged row.
__device__ __forceinline__ float max_nan(float a, float b) { return a != a ? a : (b != b ? b : fmaxf(a, b)); }

// Sum (or max) of one value per thread over the block, in a fixed order: a butterfly inside
// each warp, then the warps' results in warp order. `red` is kCombineWarps floats of smem.
constexpr int kCombineWarps = 4;
template <bool kMax>
__device__ __forceinline__ float combine_reduce(float x, float* red) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) {
    const float y = __shfl_xor_sync(0xffffffff, x, mask);
    x = kMax ? max_nan(x, y) : x + y;
  }
  __syncthreads();  // red is free (an earlier reduction's readers are done)
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  x = red[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) x = kMax ? max_nan(x, red[w]) : x + red[w];
  return x;
}

// One block per packed row: merges the row's splits (normalized partial o, base-2 lse) into
// out and lse. Splits are spread over the threads (a long cache has hundreds), but every sum
// has a fixed shape that depends only on the row's own split count: deterministic and
// batch-invariant. Warp w accumulates splits w, w + 4, ...; the warps are added in order.
template <typename Elem, int kHeadDim>
__global__ void __launch_bounds__(32 * kCombineWarps) fwd_combine_kernel(const __grid_constant__ AttentionParams p) {
  __shared__ float red[kCombineWarps];
  __shared__ float part[kCombineWarps][kHeadDim];  // per-warp sums over its splits (Dv <= kHeadDim)
  const int64_t r = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int64_t group = p.num_heads / p.kv_num_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const BlockInfo blk(p, b, r / 16, 16);  // the split kernel's row block of r
  const int splits = int((blk.max_limit + p.split_keys - 1) / p.split_keys);
  const int64_t rows_pad = rows_padded(p);
  const int64_t first = (b * p.kv_num_heads + g) * max_splits(p) * rows_pad + r;  // split 0
  const float* o_part = p.workspace + first * p.head_dim_v;  // split s at + s * rows_pad * Dv
  const float* lse_part = p.workspace + p.batch * p.kv_num_heads * max_splits(p) * rows_pad * p.head_dim_v + first;

  float mx = -INFINITY;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) mx = max_nan(mx, lse_part[s * rows_pad]);
  mx = combine_reduce<true>(mx, red);
  float sum = 0.0f;
  if (mx != -INFINITY)
    for (int s = threadIdx.x; s < splits; s += blockDim.x) sum += exp2_approx(lse_part[s * rows_pad] - mx);
  sum = combine_reduce<false>(sum, red);

  constexpr int kCols = kHeadDim / 32;  // columns lane, lane + 32, ... of this lane
  float acc[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) acc[c] = 0.0f;
  if (mx != -INFINITY) {
#pragma unroll 4
    for (int s = warp; s < splits; s += kCombineWarps) {
      const float wgt = exp2_approx(lse_part[s * rows_pad] - mx);
      const float* o_s = o_part + int64_t(s) * rows_pad * p.head_dim_v;
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        if (lane + 32 * c < p.head_dim_v) acc[c] += wgt * o_s[lane + 32 * c];
    }
  }
#pragma unroll
  for (int c = 0; c < kCols; ++c) part[warp][lane + 32 * c] = acc[c];
  __syncthreads();

  const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;  // 0: no split saw a key; NaN propagates
  const int64_t i = r / group, h = g * group + r % group;
  Elem* out = static_cast<Elem*>(p.out) + ((b * p.seqlen_q + i) * p.num_heads + h) * p.head_dim_v;
  for (int col = threadIdx.x; col < p.head_dim_v; col += blockDim.x) {
    float total = part[0][col];
#pragma unroll
    for (int w = 1; w < kCombineWarps; ++w) total += part[w][col];
    out[col] = Elem(total * inv);
  }
  if (threadIdx.x == 0)
    p.lse[(b * p.num_heads + h) * p.seqlen_q + i] = sum == 0.0f ? -INFINITY : (mx + log2f(sum)) * 0.6931471805599453f;
}

template <typename Elem, int kHeadDim>
cudaError_t run_fwd_split(const AttentionParams& p, cudaStream_t stream) {
  using Tr = SplitTraits<kHeadDim>;
  const int64_t group = p.num_heads / p.kv_num_heads;
  const int64_t row_blocks = rows_padded(p) / 16;
  const dim3 grid(unsigned(max_splits(p)), unsigned(p.kv_num_heads * row_blocks), unsigned(p.batch));
  auto kernel = p.softcap > 0.0f ? fwd_split_kernel<Elem, kHeadDim, true> : fwd_split_kernel<Elem, kHeadDim, false>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Tr::kSmemBytes));
  if (err != cudaSuccess) return err;
  if (grid.x > 0) kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);  // Skv = 0: merge only
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  const dim3 combine_grid(unsigned(p.seqlen_q * group), unsigned(p.kv_num_heads), unsigned(p.batch));
  fwd_combine_kernel<Elem, kHeadDim><<<combine_grid, 32 * kCombineWarps, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_varlen::cuda
