// One plain struct that describes a forward attention problem, shared by every handler
// (CPU and CUDA) and every kernel. Handlers fill it once from the XLA buffers; kernels read it
// (per sequence through SeqlenInfo, seqlen.h). mask.h comes along: every kernel that reads the
// params needs the mask predicate too.
#pragma once

#include <cstdint>

#include "core/mask.h"

namespace jax_varlen {

enum class DType : int { kF32, kF16, kBF16 };

struct AttentionParams {
  // Inputs. The last dim is contiguous; the others are given by the element strides below.
  // Shapes of the padded batch; the packed layout's are [num_packs, pack_rows_q or pack_rows_k,
  // heads, dim] (below).
  const void* q;                    // [batch, seqlen_q, num_heads, head_dim]
  const void* k;                    // [batch, seqlen_k, kv_num_heads, head_dim]
  const void* v;                    // [batch, seqlen_k, kv_num_heads, head_dim_v]
  const int32_t* nonpad_kv_seqlen;  // [batch]; kernels clamp each n_b into [0, seqlen_k]
                                    // (nullptr in the packed layout: every key is valid)
  // Attention sinks (gpt-oss): one logit per query head, float32 [num_heads], or nullptr. Every
  // real row's softmax denominator gains exp(sinks[h]): lse = log(exp(sinks[h]) + sum_j
  // exp(s_j)), out = sum_j exp(s_j - lse) v_j; a real row with no allowed key gives out = 0 and
  // lse = sinks[h]. The kernels finish each row through finish_row (core/sinks.h); the
  // backward is unchanged (given this lse and out, its P and delta already include the sink).
  const float* sinks;
  // Outputs:
  void* out;   // [batch, seqlen_q, num_heads, head_dim_v], dtype of q
  float* lse;  // [batch, num_heads, seqlen_q] (packed: [num_packs, num_heads, pack_rows_q]),
               // natural log; -inf where no key is allowed

  // Element strides of (batch, row, head). Kernels that walk rows address row r of sequence b
  // as (SeqlenInfo::q_offset + r) * row_stride, so the tensors are read as stacks of rows
  // ([batch * seqlen, heads, dim], packed: [num_packs * pack_rows, heads, dim]); the batch
  // stride (of a sequence, packed: of a pack) is for consumers that need the 4-D view (TMA
  // descriptors). make_params fills the dense layout: batch = seqlen * row, row = heads * head,
  // head = dim.
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t out_batch_stride, out_row_stride, out_head_stride;

  // Packed layout (make_packed_params; nullptr for the padded batch): cumulative row offsets
  // [num_packs, pack_seqs + 1], each row starting at 0. Sequence s of pack e owns query rows
  // [cu_seqlens_q[e, s], cu_seqlens_q[e, s + 1]) and key rows [cu_seqlens_k[e, s],
  // cu_seqlens_k[e, s + 1]) of that pack. See SeqlenInfo.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;

  // Paged keys (make_paged_params; nullptr: k and v are dense as above): k and v are caches
  // [num_pages, page_size, kv_num_heads, dim], and key j of sequence b is row j % page_size of
  // page block_table[b, j / page_size] (clamped into [0, num_pages): never an out-of-bounds
  // read), i.e. row page * page_size + j % page_size of the caches read as stacks of rows
  // (paged_key_row, seqlen.h). The split-KV kernel reads pages, and the Hopper one-pass
  // forward when JAX_VARLEN_PAGED_SM90=1 (plan.h; the plan takes a paged call nowhere else);
  // seqlen_k = max_pages * page_size is the keys' extent.
  // Worked example, page_size 16, block_table[b] = [7, 2]: keys 0-15 are rows 112-127, keys
  // 16-31 rows 32-47.
  const int32_t* block_table;  // [batch, max_pages]
  int64_t max_pages, page_size, num_pages;

  // Packs: the tensors are num_packs blocks of pack_rows_q query rows (q, out) and pack_rows_k
  // key rows (k, v), one after another, and pack e holds sequences [e * pack_seqs,
  // (e + 1) * pack_seqs) of the batch. Padded batch: every sequence is a pack of its own
  // (num_packs = batch, pack_seqs = 1, pack_rows = seqlen_q / seqlen_k). Packed: one pack of
  // Tq / Tk rows holding B sequences, or several under vmap (one pack per vmapped element, still
  // one launch). lse is [num_packs, num_heads, pack_rows_q] in both layouts.
  // Worked example, a vmap of 2 over a pack of Tq = 8 rows, cu_seqlens_q = [[0, 3, 5], [0, 6, 6]]:
  // batch = 4 sequences, owning query rows [0, 3), [3, 5), [8, 14) and [14, 14) of the 16; rows
  // 5-7 and 14-15 belong to no sequence (the handlers zero them, lse = -inf).
  int64_t num_packs;
  int64_t pack_seqs;
  int64_t pack_rows_q;
  int64_t pack_rows_k;

  DType dtype;
  int64_t batch;     // sequences (packed: in all packs), the grids' sequence extent
  int64_t seqlen_q;  // Sq: padded query extent (packed: max_seqlen_q, the grids' row extent)
  int64_t seqlen_k;  // Skv: padded key extent (packed: max_seqlen_k)
  int64_t num_heads;
  int64_t kv_num_heads;  // divides num_heads; query head h reads kv head h / (num_heads / kv_num_heads)
  int64_t head_dim;      // D of q and k
  int64_t head_dim_v;    // Dv of v and out

  // Split-KV (decode) path: each sequence's allowed keys are cut into chunks of split_keys
  // keys (a constant, never derived from the batch), each chunk's normalized partial output
  // and base-2 lse go to `workspace`, and the last block of each row block to finish merges
  // them in chunk order.
  // split_keys = 0 selects the one-pass kernels; the CUDA handler sets both from the plan
  // (plan/plan.h). Layout, rows_pad = seqlen_q * group rounded up to whole kSplitRowBlock-row
  // blocks (plan/limits.h):
  //   o_part   [batch, kv_num_heads, max_splits, rows_pad, head_dim_v] fp32
  //   lse_part [batch, kv_num_heads, max_splits, rows_pad] fp32, right after o_part
  //   counters [batch, kv_num_heads, rows_pad / kSplitRowBlock] int32, right after lse_part
  //            (zeroed before the launch; absent when there is no partial)
  // (indices: cuda/sm80/split_layout.h). Without split-KV, the Hopper forward's unit counter
  // (dynamic_units below) is the workspace's first word, read as an int32.
  float* workspace;
  int64_t split_keys;
  // Split-KV on a persistent grid (the plan sets it, plan/plan.h: an experiment, off by default).
  bool split_persistent = false;
  // Pack-GQA (the Hopper forward; the plan sets it, plan/plan.h): a sequence of the packed list
  // whose query rows are short (sm90/tile_scheduler.h, heads_of) takes units of one kv head and
  // kBlockM rows of (query row, query head of the group) pairs, so a decode row costs one tile
  // per kv head instead of one per query head and its keys are read once per group.
  bool pack_gqa = false;
  // Dynamic units (the Hopper forward; the plan sets it): units handed out in the list's order by
  // an atomic counter, workspace's first int32 (zeroed before the launch), instead of the
  // static snake over the persistent grid.
  bool dynamic_units = false;
  // The Hopper forward's keys per tile (the plan sets it: limits.h, fwd_sm90_block_n); it
  // launches the kernel compiled for it, or fails.
  int fwd_block_n = 0;
  // Lean units (the plan sets it, plan/plan.h; with dynamic_units): the Hopper forward's lean
  // kernels, compiled for the traits of limits.h's fwd_sm90_lean_kernels alone.
  bool lean_units = false;
  // The unpaged Hopper kernels' loop of plain tiles (the plan sets it: limits.h, kFwdPlainTiles;
  // the softcap kernels have none).
  bool fwd_plain_tiles = false;
  // Mixed order (the plan sets it, plan/plan.h: JAX_VARLEN_FWD_MIXED_ORDER=1, an experiment, off
  // by default): the Hopper forward's sorted packed list ranks the sequences of few tile rows
  // (decode rows: bandwidth-bound) apart from the others and interleaves the two classes' units
  // (sm90/tile_scheduler.h). It moves no bit: each unit is computed whole.
  bool fwd_mixed_order = false;

  float scale;    // multiplies <q, k>
  float softcap;  // 0 = off; else s = softcap * tanh(s / softcap)
  bool is_causal;  // tail-aligned: key j allowed for query i iff j <= i + n - len_q (len_q: the
                   // sequence's query rows, seqlen_q in the padded batch)
  // Local window (mask.h, MaskSpec): keys p - window_left .. p + window_right of the row's
  // tail-aligned position p; -1 = that side unbounded.
  int64_t window_left = -1, window_right = -1;

  JV_HOST_DEVICE MaskSpec mask() const { return {is_causal, window_left, window_right}; }
};

// The backward of one forward problem: the forward's inputs, out and lse (the residuals), the
// cotangents, and the gradients. For an allowed key j of query row i (mask.h):
//   s_ij  = scale * <q_i, k_j>, then with softcap c: t_ij = tanh(s_ij / c), s_ij = c * t_ij
//   P_ij  = exp(s_ij - lse_i)                  (0 for keys that are not allowed)
//   delta_i = <d_out_i, out_i> - d_lse_i       (written to `delta`, fp32)
//   dS_ij = P_ij * (<d_out_i, v_j> - delta_i)   (times 1 - t_ij^2 with softcap)
//   d_q_i = scale * sum_j dS_ij k_j
//   d_k_j = scale * sum_i dS_ij q_i,   d_v_j = sum_i P_ij d_out_i
// d_k and d_v sum over the query heads of the kv head's group. Keys at or past n_b get exactly
// zero gradient and are never read; rows with no allowed key contribute nothing. Packed: rows
// that no sequence owns get zero gradients (the handlers write them before the kernels run).
struct BackwardParams {
  AttentionParams fwd;  // q, k, v, nonpad_kv_seqlen, out, lse, sizes, strides, scale, mask
  const void* d_out;    // [batch, seqlen_q, num_heads, head_dim_v], out's strides and dtype
  const float* d_lse;   // [batch, num_heads, seqlen_q]
  void* d_q;            // [batch, seqlen_q, num_heads, head_dim], q's strides and dtype
  void* d_k;            // [batch, seqlen_k, kv_num_heads, head_dim], k's strides
  void* d_v;            // [batch, seqlen_k, kv_num_heads, head_dim_v], v's strides
  float* delta;         // [batch, num_heads, seqlen_q] fp32 workspace (an XLA output)
  // The Hopper kernel's dQ workspace (plan/limits.h has the layout, the plan its size;
  // dispatch.cu points dq_semaphore and seq_order past the tiles); nullptr on the CPU.
  float* dq_accum;
  int32_t* dq_semaphore;
  int32_t* seq_order;  // [batch]: the sequences heaviest first (sm90/seq_order.cuh), after the counters
};

}  // namespace jax_varlen
