// Where sequence b's queries and keys are, and how many of them count: the one place that turns
// nonpad_kv_seqlen (padded batch) or cu_seqlens (packed) into offsets and lengths, so the
// kernels serve both front doors unchanged. Host and device.
#pragma once

#include "core/params.h"

namespace jax_varlen {

struct SeqlenInfo {
  int64_t b;
  int64_t pack;      // the pack that holds sequence b (params.h): b in the padded batch
  int64_t q_start;   // first query row of sequence b within its pack (0 in the padded batch)
  int64_t q_offset;  // first query row of sequence b, in rows of q and out
  int64_t seqlen_q;  // its query rows
  int64_t k_start;   // first key row of sequence b within its pack (0 in the padded batch)
  int64_t k_offset;  // first key row, in rows of k and v
  int64_t k_rows;    // key rows it owns: Skv in the padded batch (padding included), else seqlen_k
  int64_t seqlen_k;  // its valid keys, clamped into the sequence's key rows: keys [0, seqlen_k)

  // Padded batch: rows b * seqlen_q and b * seqlen_k on, every query row, n_b valid keys.
  // Packed: the cu_seqlens bounds of sequence b % pack_seqs of pack b / pack_seqs, clamped so
  // that nothing outside the pack (or past the extents the grids are sized for) is ever read,
  // whatever the offsets hold: start into [0, pack_rows], length into [0, min(seqlen_q,
  // pack_rows - start)] (seqlen_k for keys).
  JV_HOST_DEVICE SeqlenInfo(const AttentionParams& p, int64_t b_) : b(b_) {
    if (p.cu_seqlens_q == nullptr) {
      pack = b;
      q_start = 0;
      q_offset = b * p.seqlen_q;
      seqlen_q = p.seqlen_q;
      k_start = 0;
      k_offset = b * p.seqlen_k;
      k_rows = p.seqlen_k;
      seqlen_k = clamp_seqlen(p.nonpad_kv_seqlen[b], p.seqlen_k);
      return;
    }
    pack = p.num_packs == 1 ? 0 : b / p.pack_seqs;  // one pack (no vmap): no 64-bit division
    const int64_t at = b + pack;  // row `pack` of cu_seqlens [num_packs, pack_seqs + 1], entry b % pack_seqs
    q_start = clamp_seqlen(p.cu_seqlens_q[at], p.pack_rows_q);
    q_offset = pack * p.pack_rows_q + q_start;
    seqlen_q = clamp_seqlen(p.cu_seqlens_q[at + 1] - q_start, min_extent(p.seqlen_q, p.pack_rows_q - q_start));
    k_start = clamp_seqlen(p.cu_seqlens_k[at], p.pack_rows_k);
    k_offset = pack * p.pack_rows_k + k_start;
    seqlen_k = clamp_seqlen(p.cu_seqlens_k[at + 1] - k_start, min_extent(p.seqlen_k, p.pack_rows_k - k_start));
    k_rows = seqlen_k;
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
  // Element offset of (head h, query row i) in lse (and delta, d_lse): [batch, num_heads,
  // seqlen_q] in the padded batch, [num_packs, num_heads, pack_rows_q] packed; one formula,
  // since a padded sequence is a pack of its own (params.h).
  JV_HOST_DEVICE int64_t lse_index(const AttentionParams& p, int64_t h, int64_t i) const {
    return (pack * p.num_heads + h) * p.pack_rows_q + q_start + i;
  }

 private:
  JV_HOST_DEVICE static int64_t min_extent(int64_t a, int64_t b) { return a < b ? a : b; }
};

// Paged keys (params.h): the row of the caches (read as stacks of rows, k_row_stride apart)
// that holds key j of sequence b. The block-table entry is clamped into [0, num_pages), so
// any table reads inside the caches; j must lie in [0, max_pages * page_size).
JV_HOST_DEVICE int64_t paged_key_row(const AttentionParams& p, int64_t b, int j) {
  const int page_size = int(p.page_size);
  int64_t page = p.block_table[b * p.max_pages + j / page_size];
  page = page < 0 ? 0 : (page >= p.num_pages ? p.num_pages - 1 : page);
  return page * page_size + j % page_size;
}

// Packed layout: whether row r (of all num_packs * pack_rows rows of q, or of k when `keys`)
// belongs to some sequence. Rows past a pack's last offset, and rows that a clamped length cuts
// off (invalid input), belong to none: the kernels never write them, so the handlers zero them
// (lse = -inf) before the kernels run. A binary search for the last sequence of r's pack that
// starts at or before r; offsets that decrease (invalid input) give some answer, never an
// out-of-bounds read, and any row a kernel then writes is written after the zeros.
// Worked example, pack_rows_q = 8, cu_seqlens_q = [0, 3, 5]: rows 0-4 are owned, 5-7 are not.
JV_HOST_DEVICE bool row_owned(const AttentionParams& p, int64_t r, bool keys) {
  const int64_t rows = keys ? p.pack_rows_k : p.pack_rows_q;
  const int32_t* cu = keys ? p.cu_seqlens_k : p.cu_seqlens_q;
  const int64_t pack = r / rows, local = r % rows;
  const int32_t* offsets = cu + pack * (p.pack_seqs + 1);
  if (p.pack_seqs == 0 || offsets[0] > local) return false;
  int64_t lo = 0, hi = p.pack_seqs - 1;  // invariant: offsets[lo] <= local
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= local) lo = mid; else hi = mid - 1;
  }
  const SeqlenInfo seq(p, pack * p.pack_seqs + lo);
  const int64_t first = keys ? seq.k_offset : seq.q_offset;
  return r >= first && r < first + (keys ? seq.seqlen_k : seq.seqlen_q);
}

}  // namespace jax_varlen
