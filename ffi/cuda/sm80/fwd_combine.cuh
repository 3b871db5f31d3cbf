// The split-KV path's merge (fwd_split.cuh): each packed row's partials -- normalized fp32
// outputs and base-2 lses, one per split of split_keys keys -- into out and lse, in a fixed
// order. The last split block of a row block to finish runs it for the block's rows. A row
// visits exactly the splits that hold one of its allowed keys (its count of allowed keys
// decides, never a sum), so a row with no allowed key gives exact zeros and lse = -inf, while a
// NaN partial reaches the row. The sums' shapes depend only on the row's own split count:
// deterministic and, split_keys being a constant, independent of the batch and of which block
// merges.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "cuda/sm80/softmax.h"
#include "cuda/sm80/split_layout.h"
#include "core/seqlen.h"
#include "core/sinks.h"

namespace jax_varlen::cuda::sm80 {

// max that keeps NaN (fmaxf drops it): a NaN partial lse must reach the merged row.
__device__ __forceinline__ float max_nan(float a, float b) { return a != a ? a : (b != b ? b : fmaxf(a, b)); }

// Max or sum of one value per lane over the warp, in a fixed order (a butterfly).
template <bool kMax>
__device__ __forceinline__ float warp_reduce(float x) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) {
    const float y = __shfl_xor_sync(0xffffffff, x, mask);
    x = kMax ? max_nan(x, y) : x + y;
  }
  return x;
}

// Packed row r of (sequence b, kv head g), by one warp: lane l takes splits l, l + 32, ... for
// the max and the weights' sum (then a butterfly), and the output columns l, l + 32, ...
// summed over the splits in order. The partials are read through the L2 (ld.global.cg): other
// blocks wrote them during this kernel.
template <typename Elem, int kHeadDim>
__device__ __forceinline__ void combine_row(const AttentionParams& p, int64_t b, int64_t g, int64_t r, int lane) {
  const int64_t group = p.num_heads / p.kv_num_heads;
  const SeqlenInfo seq(p, b);
  const int64_t i = r / group, h = g * group + r % group;
  Elem* out = static_cast<Elem*>(p.out) + seq.out_index(p, i, h);
  // The row's splits: those that hold one of its allowed keys [keys.begin, keys.end).
  const Range keys = key_range(p.mask(), i, seq.seqlen_k, seq.seqlen_q);
  const int64_t split0 = keys.begin / p.split_keys;
  const int splits = keys.empty() ? 0 : int((keys.end + p.split_keys - 1) / p.split_keys - split0);
  if (splits == 0) {  // no allowed key: zeros, lse = -inf (the sink's logit)
    for (int col = lane; col < p.head_dim_v; col += 32) out[col] = Elem(0.0f);
    if (lane == 0) p.lse[seq.lse_index(p, h, i)] = empty_row_lse(p, h);
    return;
  }
  const int64_t rows_pad = rows_padded(p);
  const int64_t first = split_partial(p, b, g, split0, r);
  const float* o_part = split_o_part(p) + first * p.head_dim_v;  // split split0 + s at + s * rows_pad * Dv
  const float* lse_part = split_lse_part(p) + first;             // split split0 + s at + s * rows_pad

  // Weights exp2(lse_s - mx); a partial of weight 0 (lse -inf) has o = 0 and adds nothing. When
  // every partial is -inf, m_use = 0 keeps the weights 0 and the row gives 0/0 = NaN, lse -inf,
  // as the one-pass kernel does for a row whose every score is -inf.
  float mx = -INFINITY;
  for (int s = lane; s < splits; s += 32) mx = max_nan(mx, __ldcg(lse_part + s * rows_pad));
  mx = warp_reduce<true>(mx);
  const float m_use = mx == -INFINITY ? 0.0f : mx;
  float sum = 0.0f;
  for (int s = lane; s < splits; s += 32) sum += exp2_approx(__ldcg(lse_part + s * rows_pad) - m_use);
  sum = warp_reduce<false>(sum);

  constexpr int kCols = kHeadDim / 32;  // columns lane, lane + 32, ... of this lane
  float acc[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) acc[c] = 0.0f;
#pragma unroll 4
  for (int s = 0; s < splits; ++s) {
    const float wgt = exp2_approx(__ldcg(lse_part + s * rows_pad) - m_use);
    const float* o_s = o_part + int64_t(s) * rows_pad * p.head_dim_v;
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      if (lane + 32 * c < p.head_dim_v) acc[c] += wgt * __ldcg(o_s + lane + 32 * c);
  }

  // The splits' partials are normalized, so the row's (m, l) in base 2 is (mx, sum) and its
  // accumulator the weighted sum of the partials: finish_row adds the sink (core/sinks.h).
  const RowFinish fin = finish_row</*kBase2=*/true>(mx, sum, sink_of(p, h));
#pragma unroll
  for (int c = 0; c < kCols; ++c)
    if (lane + 32 * c < p.head_dim_v) out[lane + 32 * c] = Elem(acc[c] * fin.inv);
  if (lane == 0) p.lse[seq.lse_index(p, h, i)] = fin.lse;
}

// Column col of packed row r of (sequence b, kv head g) when its row block's keys all lie in one
// split: combine_row's arithmetic for a row of one split, on the split block's own normalized
// partial o_part and base-2 lse_part (or of none: has_keys false), so that out and lse are
// bitwise what writing the partial and merging it would give, without the partial's store, the
// fence, the count and the re-read (four dependent steps of every short sequence's block).
template <typename Elem>
__device__ __forceinline__ void finish_one_split(const AttentionParams& p, const SeqlenInfo& seq, int64_t g,
                                                 int64_t r, int col, bool has_keys, float o_part, float lse_part) {
  const int64_t group = p.num_heads / p.kv_num_heads;
  const int64_t i = r / group, h = g * group + r % group;
  Elem* out = static_cast<Elem*>(p.out) + seq.out_index(p, i, h);
  if (!has_keys) {  // no allowed key: zeros, lse = -inf (the sink's logit)
    out[col] = Elem(0.0f);
    if (col == 0) p.lse[seq.lse_index(p, h, i)] = empty_row_lse(p, h);
    return;
  }
  const float mx = max_nan(-INFINITY, lse_part);  // combine_row's max and sum over one split
  const float m_use = mx == -INFINITY ? 0.0f : mx;
  const float wgt = exp2_approx(lse_part - m_use);
  float acc = 0.0f;
  acc += wgt * o_part;
  const RowFinish fin = finish_row</*kBase2=*/true>(mx, 0.0f + wgt, sink_of(p, h));
  out[col] = Elem(acc * fin.inv);
  if (col == 0) p.lse[seq.lse_index(p, h, i)] = fin.lse;
}

}  // namespace jax_varlen::cuda::sm80
