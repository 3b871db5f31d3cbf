// Where sequence b's queries and keys are, and how many of them count: the one place that turns
// nonpad_kv_seqlen (padded batch) or cu_seqlens (packed) into offsets and lengths, so the
// kernels serve both front doors unchanged. Host and device.
#pragma once

#include "params.h"

namespace jax_varlen {

struct SeqlenInfo {
  int64_t b;
  int64_t q_offset;  // first query row of sequence b, in rows of q and out
  int64_t seqlen_q;  // its query rows
  int64_t k_offset;  // first key row, in rows of k and v
  int64_t seqlen_k;  // its valid keys, clamped into the sequence's key rows: keys [0, seqlen_k)

  // Padded batch: rows b * seqlen_q and b * seqlen_k on, every query row, n_b valid keys.
  // Packed: the cu_seqlens bounds (lengths clamped into [0, seqlen_q] and [0, seqlen_k], the
  // extents the grids are sized for).
  JV_HOST_DEVICE SeqlenInfo(const AttentionParams& p, int64_t b_) : b(b_) {
    if (p.cu_seqlens_q != nullptr) {
      q_offset = p.cu_seqlens_q[b];
      seqlen_q = clamp_seqlen(p.cu_seqlens_q[b + 1] - q_offset, p.seqlen_q);
    } else {
      q_offset = b * p.seqlen_q;
      seqlen_q = p.seqlen_q;
    }
    if (p.cu_seqlens_k != nullptr) {
      k_offset = p.cu_seqlens_k[b];
      seqlen_k = clamp_seqlen(p.cu_seqlens_k[b + 1] - k_offset, p.seqlen_k);
    } else {
      k_offset = b * p.seqlen_k;
      seqlen_k = clamp_seqlen(p.nonpad_kv_seqlen[b], p.seqlen_k);
    }
  }

  // Element offsets of (query row i, head h) in q and out, and of (key j, kv head g) in k and v.
  JV_HOST_DEVICE int64_t q_index(const AttentionParams& p, int64_t i, int64_t h) const {
    return (q_offset + i) * p.q_row_stride + h * p.q_head_stride;
  }
  JV_HOST_DEVICE int64_t out_index(const AttentionParams& p, int64_t i, int64_t h) const {
    return (q_offset + i) * p.out_row_stride + h * p.out_head_stride;
  }
  JV_HOST_DEVICE int64_t k_index(const AttentionParams& p, int64_t j, int64_t g) const {
    return (k_offset + j) * p.k_row_stride + g * p.k_head_stride;
  }
  JV_HOST_DEVICE int64_t v_index(const AttentionParams& p, int64_t j, int64_t g) const {
    return (k_offset + j) * p.v_row_stride + g * p.v_head_stride;
  }
  // Element offset of (head h, query row i) in lse [batch, num_heads, seqlen_q].
  JV_HOST_DEVICE int64_t lse_index(const AttentionParams& p, int64_t h, int64_t i) const {
    return (b * p.num_heads + h) * p.seqlen_q + i;
  }
};

}  // namespace jax_varlen
