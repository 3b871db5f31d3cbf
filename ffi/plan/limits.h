// Constants of the CUDA path: buckets, tiles, limits and the workspaces' row arithmetic. The
// plan (ffi/plan/plan.h) reads them to decide a call, the kernels to size their tiles, and
// cmake/cuda.cmake the buckets. Plain C++ with no CUDA headers, so the CPU-only build (which
// exports the plan to Python) compiles them too.
#pragma once

#include <cstdint>

namespace jax_varlen::cuda {

// Head-dim buckets of the tensor-core kernels: max(D, Dv) rounds up to the first bucket that
// holds it; each (path, dtype, bucket) is one instantiation (cmake/cuda.cmake).
constexpr int kHeadDimBuckets[] = {64, 128, 256};
constexpr int kNumHeadDimBuckets = sizeof(kHeadDimBuckets) / sizeof(kHeadDimBuckets[0]);
// Largest head size (D and Dv) of every CUDA kernel, the portable one included.
constexpr int kMaxHeadDim = kHeadDimBuckets[kNumHeadDimBuckets - 1];

// Split-KV (decode) path: taken for tensor-core calls with seqlen_q <= kSplitMaxSeqlenQ (the
// plan); each sequence's keys are cut into chunks of kSplitKeys. The chunk is a constant, never
// derived from the batch, so a sequence's result does not depend on its batch-mates.
constexpr int kSplitMaxSeqlenQ = 16;
constexpr int kSplitKeys = 1024;
// Its workspace (layout: params.h, indices: sm80/split_layout.h) holds one partial per
// (sequence, kv head, split, packed row), the packed rows (seqlen_q * group, group = num_heads /
// kv_num_heads) rounded up to whole kSplitRowBlock-row blocks: the split kernel's MMA tile.
// Worked example, seqlen_q 3, group 8: 24 rows, padded to 32.
constexpr int kSplitRowBlock = 16;
constexpr int64_t split_rows_padded(int64_t seqlen_q, int64_t group) {
  return (seqlen_q * group + kSplitRowBlock - 1) / kSplitRowBlock * kSplitRowBlock;
}
constexpr int64_t split_max_splits(int64_t seqlen_k, int64_t split_keys) {
  return (seqlen_k + split_keys - 1) / split_keys;
}
// Row blocks of one sequence, each with an arrival counter after the partials (the split
// kernel's last block of a row block merges it: sm80/fwd_split.cuh): [kv_num_heads,
// rows_padded / kSplitRowBlock] int32.
constexpr int64_t split_counters_per_seq(int64_t seqlen_q, int64_t num_heads, int64_t kv_num_heads) {
  return kv_num_heads * (split_rows_padded(seqlen_q, num_heads / kv_num_heads) / kSplitRowBlock);
}
// Partials of one sequence: [kv_num_heads, max_splits, rows_padded].
constexpr int64_t split_partials_per_seq(int64_t seqlen_q, int64_t seqlen_k, int64_t num_heads,
                                         int64_t kv_num_heads, int64_t split_keys) {
  return kv_num_heads * split_max_splits(seqlen_k, split_keys) *
         split_rows_padded(seqlen_q, num_heads / kv_num_heads);
}

// Paged caches (params.h): the split-KV kernel reads pages in place when each holds a multiple
// of kPagedRun rows (the plan's condition; vLLM's page sizes 16, 32, ... all qualify), loading a
// key tile in runs of kPagedRun rows; so does the Hopper forward when JAX_VARLEN_PAGED_SM90=1
// (plan.h: longer query runs, on the sm90 one-pass path). Other page sizes, and calls that
// neither path takes, are gathered into dense keys first (jax_varlen/_paged_api.py).
constexpr int kPagedRun = 16;
// Block-table entries one split-KV block may need: a chunk of at most 8192 keys
// (JAX_VARLEN_SPLIT_KEYS' limit, plan.h) on pages of at least kPagedRun rows, not aligned to them.
constexpr int kMaxSplitPages = 8192 / kPagedRun + 2;

// Hopper forward (sm90/fwd_sm90.cuh): query rows of one work unit, at every head size.
constexpr int kFwdSm90BlockM = 128;
// Batches up to this size are ranked heaviest-first inside each CTA (sm90/tile_scheduler.h,
// sort_sequences; order and lengths in shared memory); larger ones keep their own order.
constexpr int kFwdMaxSortedBatch = 384;
// Its keys per tile (the plan's fwd_block_n): the widest that fits shared memory (Q + 2 stages
// of K and V: 96, 208 and 224 KB) and registers (S, P and O of 64 rows per consumer thread) --
// 128, 176, 80 at buckets 64, 128, 256 -- except that a banded call (causal or a local window)
// at bucket 128 takes 128, as FlashAttention-3 does: its diagonal and window-edge tiles are
// masked and partly wasted, and a 128-key tile lines up with the 128-row query tile, where a
// 176-key one straddles the diagonal (two masked tiles, ~50 keys of waste per row).
constexpr int fwd_sm90_block_n(int bucket, bool banded) {
  return bucket <= 64 ? 128 : (bucket <= 128 ? (banded ? 128 : 176) : 80);
}
// Whether lean kernels (the plan's lean_units: idle warpgroups and the unit hand-over,
// sm90/fwd_sm90.cuh) exist for bucket and block_n: the others (d128 at 176 keys, d256) would
// spill inside the mainloop with the idle path (benchmarks/NOTES.md).
constexpr bool fwd_sm90_lean_kernels(int bucket, int block_n) { return bucket <= 128 && block_n <= 128; }
// Whether the unpaged kernels run the tiles that need no mask in a loop of their own without a
// branch (the plan's fwd_plain_tiles; sm90/fwd_mma.h, FwdMma::mma): the same arithmetic, so
// the same bits, with more of the softmax ahead of the wait on this warpgroup's P V in the SASS.
// Measured on an H100 (benchmarks/NOTES.md, session 2026-12-07 j): d128-full +2.6%,
// d128-causal-skewed +4.0%, docs-causal +2.1%, d128-skewed level (JAX_VARLEN_FWD_PLAIN=0 turns
// it off per process). The loop is compiled into the unpaged kernels of buckets up to 128 (d64
// and d128 at 128 keys: the lean ones; d128 at 176 keys: its only spills are in the code that
// zeroes a partial tile's V rows, once per unit); at bucket 256 it would spill inside the loop.
constexpr bool kFwdPlainTiles = true;
constexpr bool fwd_sm90_plain_kernels(int bucket) { return bucket <= 128; }

// Hopper backward (sm90/bwd_sm90.cuh): key blocks of bwd_block_n(bucket) keys per CTA, steps of
// bwd_block_m(bucket) query rows, every head bucket (at 256 the wide consumers,
// sm90/bwd_mma_wide.h). Its dQ workspace (float32
// elements, an XLA output the CUDA backward always gets, sized by the plan, ffi/plan/plan.h):
//   dq_accum     [packs, num_heads, slots, block_m * bucket]   slots = bwd_dq_slots(...)
//                (each row block's tile in the consumers' register order, bwd_sm90.cuh)
//   dq_semaphore [packs, num_heads, slots] int32, right after it
//   seq_order    [packs, pack_seqs] int32, right after that: the sequences heaviest first
//                (sm90/seq_order.cuh), flat over the batch
// bucket = the head-dim bucket of max(D, Dv); 0 elements when the plan gives the call no Hopper
// backward (float32, no query or key row, ...).
// Sequence s of a pack (params.h) keeps its row blocks in slots (q_start + s * block_m) /
// block_m on, so no two sequences share one: ceil(pack_rows_q / block_m) + pack_seqs - 1
// slots per (pack, head); ceil(Sq / block_m) in the padded batch (a pack per sequence).
// block_m * bucket = 8192 floats at buckets 64 and 128, 16384 at 256.
// Rows per step: 128 at bucket 64 (there a step's products are half the size and its fixed
// costs -- waits, barriers, the dQ hand-off -- are not), 64 at buckets 128 and 256.
constexpr int bwd_block_m(int bucket) { return bucket <= 64 ? 128 : 64; }
// Keys per CTA: 128 (64 per consumer warpgroup), 64 at bucket 256, where the warpgroups split
// the head dim of dK and dV instead (128 keys x 256 would not fit their registers).
constexpr int bwd_block_n(int bucket) { return bucket <= 128 ? 128 : 64; }
constexpr long long bwd_dq_slots(long long pack_rows_q, long long pack_seqs, int block_m) {
  return pack_seqs < 1 ? 0 : (pack_rows_q + block_m - 1) / block_m + pack_seqs - 1;
}

}  // namespace jax_varlen::cuda
