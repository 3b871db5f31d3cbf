// make_plan: every decision about a CUDA call that its static shapes fix, made once, here --
// the forward's and the backward's paths, the head-dim bucket, split-KV, and the size of every
// workspace. The Python lowering asks it (xla/bindings.cc exports it as plan()) and adds the
// workspaces it gives to the FFI call; the CUDA handler asks it again for the same shapes and the
// device's compute capability, rejects buffers of any other size (xla/cuda.cu), and runs its path
// (dispatch.cu, where the buffers' alignment, known only at run time, may still choose the
// portable kernels). CUTLASS's can_implement / get_workspace_size per kernel is the model.
// Plain C++17 with no CUDA headers: the CPU-only build exports it too.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

#include "plan/limits.h"
#include "core/params.h"

namespace jax_varlen {

// The forward's and the backward's kernel rows of dispatch.cu's table.
enum class FwdPath : int { kPortable, kSm80Split, kSm80OnePass, kSm90OnePass };
enum class BwdPath : int { kPortable, kSm80, kSm90 };

// Whether this build carries the Hopper kernels (cmake/cuda.cmake defines JAX_VARLEN_WITH_SM90
// for the extension when it compiles them for sm_90a).
#if defined(JAX_VARLEN_WITH_SM90)
inline constexpr bool kWithSm90 = true;
#else
inline constexpr bool kWithSm90 = false;
#endif

// The static facts of a call, named as in AttentionParams (params.h). The padded batch is a pack
// per sequence: pack_seqs = 1, seqlen_q/k = pack_rows_q/k = Sq/Skv. Packed: pack_seqs = B,
// pack_rows_q/k = Tq/Tk, seqlen_q/k = the max_seqlen_q/k hints (the grids' extents).
struct PlanInputs {
  DType dtype = DType::kF32;
  int64_t num_packs = 1;  // N; only the kernels' extent limits read it (workspaces are per pack)
  int64_t pack_seqs = 1;
  int64_t pack_rows_q = 0, pack_rows_k = 0;
  int64_t seqlen_q = 0, seqlen_k = 0;
  int64_t num_heads = 1, kv_num_heads = 1;
  int64_t head_dim = 0, head_dim_v = 0;
  // Paged keys (params.h): the cache's rows per page; 0 = dense keys. A paged call is planned
  // with seqlen_k = pack_rows_k = max_pages * page_size (the keys' extent).
  int64_t page_size = 0;
  // A paged call whose padded queries stand for packed query runs (paged_attention with
  // cu_seqlens_q, padded to seqlen_q = max_seqlen_q rows): the in-place kernels give every
  // sequence seqlen_q queries, the last of its keys, so they read such a call's pages only at
  // seqlen_q = 1 (the lowering gathers the pages otherwise).
  bool packed_queries = false;
  // The mask (params.h): the Hopper forward's key tile depends on whether it has a band.
  bool is_causal = false;
  int64_t window_left = -1, window_right = -1;
  // Compute capability major of the device that runs the call; 0 = unknown (the lowering, which
  // cannot see it): the path then is the best one this build has (an sm_90 device's with the
  // Hopper kernels built, else an sm_80 one's).
  int compute_major = 0;
};

struct Plan {
  // Why the CUDA kernels cannot take the call ("" when they can); then nothing below is set.
  std::string unsupported;
  int bucket = 0;  // index into cuda::kHeadDimBuckets: the first bucket that holds max(D, Dv)
  FwdPath fwd_path = FwdPath::kPortable;
  BwdPath bwd_path = BwdPath::kPortable;
  // Split-KV: keys per chunk (0: the one-pass kernels). The forward's workspace, float32
  // elements per pack: split-KV's partials (layout: params.h), else one word for the Hopper
  // forward's unit counter (dynamic units) wherever an sm_90 device could take the call, else 0.
  int64_t split_keys = 0;
  int64_t fwd_workspace_per_pack = 0;
  // Split-KV on a persistent grid (JAX_VARLEN_SPLIT_PERSISTENT=1, an experiment; default off):
  // the blocks of the split kernel's grid, in the same order, walked by a few CTAs per SM
  // (sm80/fwd_split.cuh) instead of launched one by one; the same results bit for bit.
  bool split_persistent = false;
  // The Hopper forward hands out its units by an atomic counter (fwd_sm90.cuh) instead of the
  // static snake: every unpaged call it takes (+15% on mixed-serve, H100, benchmarks/NOTES.md;
  // a paged call's kernel keeps the snake).
  bool dynamic_units = false;
  // Pack-GQA on the Hopper forward (params.h): the call may pack the query heads of a kv-head
  // group into one tile for its short sequences (JAX_VARLEN_PACK_GQA=0 turns it off, to compare);
  // it sizes no workspace.
  bool pack_gqa = false;
  // The Hopper forward's keys per tile (limits.h, fwd_sm90_block_n); 0 on other paths. A paged
  // call keeps the bucket's widest (its kernels are compiled for that alone).
  int fwd_block_n = 0;
  // Lean units (+5% on mixed-serve, +7% docs-causal-d64, H100): with dynamic units, on the
  // kernels of limits.h's fwd_sm90_lean_kernels -- the only unpaged kernels of those traits --,
  // the producer decodes each unit once for the consumers, and a consumer warpgroup whose rows
  // all lie past a unit's only follows the barriers for it (sm90/fwd_sm90.cuh).
  bool lean_units = false;
  // Plain tiles (limits.h, kFwdPlainTiles): the unpaged kernels of fwd_sm90_plain_kernels run
  // the tiles that need no mask in a loop without a branch; only with dynamic_units.
  bool fwd_plain_tiles = false;
  // Mixed order (JAX_VARLEN_FWD_MIXED_ORDER=1, an experiment, off by default; the Hopper forward):
  // a sorted packed list interleaves the units of the sequences of few tile rows (decode rows,
  // speculative tokens: each unit streams its keys for a few rows, bound by bandwidth) with the
  // others' (bound by the tensor cores) instead of ranking all by keys, which runs the long
  // decode rows in a wave of their own (sm90/tile_scheduler.h). It moves no bit.
  bool fwd_mixed_order = false;
  // Hopper backward: query rows per dQ step, row-block slots per (pack, head), and the dQ
  // workspace, float32 elements per pack (tiles and counters, layout: plan/limits.h); all 0
  // when the call never takes that kernel.
  int bwd_block_m = 0;
  int64_t dq_slots = 0;
  int64_t dq_workspace_per_pack = 0;
  // Both workspaces are affine in pack_seqs, the rest fixed: per pack = its value at one
  // sequence + (pack_seqs - 1) * per_seq (split-KV's partials and counters per sequence; one
  // more dQ slot per sequence, and its sequence-order word). A lowering with a symbolic number
  // of sequences (jax.export) sizes them from these.
  int64_t fwd_workspace_per_seq = 0;
  int64_t dq_workspace_per_seq = 0;

  int head_dim_bucket() const { return cuda::kHeadDimBuckets[bucket]; }
  // The dQ workspace's tiles ([num_packs, num_heads, dq_slots, bwd_block_m * bucket] floats);
  // its int32 counters start right after them.
  int64_t dq_accum_floats(int64_t num_packs, int64_t num_heads) const {
    return num_packs * num_heads * dq_slots * bwd_block_m * head_dim_bucket();
  }
};

// Runtime switches (benchmarks/NOTES.md), environment variables read when a call is planned:
// JAX_VARLEN_PACK_GQA=0 turns Plan::pack_gqa off (on by default); JAX_VARLEN_PAGED_SM90=1 lets
// paged calls with more than kSplitMaxSeqlenQ queries read pages in the Hopper forward;
// JAX_VARLEN_SPLIT_PERSISTENT=1 puts split-KV on a persistent grid (Plan::split_persistent);
// JAX_VARLEN_FWD_MIXED_ORDER=1 turns Plan::fwd_mixed_order on.
inline bool switch_is(const char* name, char value) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] == value && v[1] == '\0';
}
inline bool pack_gqa_enabled() { return !switch_is("JAX_VARLEN_PACK_GQA", '0'); }
inline bool paged_sm90_enabled() { return switch_is("JAX_VARLEN_PAGED_SM90", '1'); }
inline bool split_persistent_enabled() { return switch_is("JAX_VARLEN_SPLIT_PERSISTENT", '1'); }
inline bool fwd_mixed_order_enabled() { return switch_is("JAX_VARLEN_FWD_MIXED_ORDER", '1'); }
// JAX_VARLEN_FWD_PLAIN=1 / 0 turns the Hopper forward's plain-tile loop on / off (a benchmark
// knob: it moves no bit); unset or anything else: limits.h's kFwdPlainTiles (on).
inline bool fwd_plain_enabled() {
  return switch_is("JAX_VARLEN_FWD_PLAIN", '1') || (cuda::kFwdPlainTiles && !switch_is("JAX_VARLEN_FWD_PLAIN", '0'));
}
// The integer in environment variable `name` when it is one whole number in [lo, hi] and a
// multiple of `step`; unset or anything else: `fallback`.
inline long long int_setting(const char* name, long long lo, long long hi, long long step, long long fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return end != v && *end == '\0' && n >= lo && n <= hi && n % step == 0 ? n : fallback;
}
// JAX_VARLEN_SPLIT_KEYS=n, a multiple of 128 in [128, 8192], sets the split-KV chunk (a
// benchmark knob: the chunk stays one constant per process, so results stay batch invariant).
inline int64_t split_keys_setting() { return int_setting("JAX_VARLEN_SPLIT_KEYS", 128, 8192, 128, cuda::kSplitKeys); }

// Workspaces are sized from the static shapes alone, never from the device or the build: the
// lowering cannot see the device, and an exported call may run on any build. A device or build
// that does not take the path a workspace serves leaves it unused (an sm_80 device, say, with
// the Hopper backward's dQ workspace). Nor does a workspace depend on num_packs: a lowering
// with a symbolic batch asks for one pack, and each workspace is [num_packs, per pack].
inline Plan make_plan(const PlanInputs& in) {
  namespace c = cuda;
  Plan plan;
  constexpr int64_t kMaxGridYZ = 65535;
  // The handlers' params (handler_common.h) never break these; a caller of the Python binding may.
  if (in.num_packs < 0 || in.pack_seqs < 0 || in.pack_rows_q < 0 || in.pack_rows_k < 0 || in.seqlen_q < 0 ||
      in.seqlen_k < 0 || in.seqlen_q > in.pack_rows_q || in.seqlen_k > in.pack_rows_k || in.num_heads < 0 ||
      in.kv_num_heads < 1 || in.num_heads % in.kv_num_heads != 0 || in.head_dim < 1 || in.head_dim_v < 1) {
    plan.unsupported = "jax_varlen: no plan for these shapes (sizes must be >= 0, kv_num_heads must divide "
                       "num_heads, head sizes >= 1, seqlen_q/k <= pack_rows_q/k)";
    return plan;
  }
  if (in.head_dim > c::kMaxHeadDim || in.head_dim_v > c::kMaxHeadDim) {
    plan.unsupported = "jax_varlen on CUDA supports head sizes up to " + std::to_string(c::kMaxHeadDim) +
                       "; got query/key head size " + std::to_string(in.head_dim) +
                       " and value head size " + std::to_string(in.head_dim_v);
    return plan;
  }
  const int64_t batch = in.num_packs * in.pack_seqs;  // sequences: the grids' extent
  if (batch > kMaxGridYZ || in.kv_num_heads > kMaxGridYZ) {
    plan.unsupported = "jax_varlen on CUDA supports up to " + std::to_string(kMaxGridYZ) +
                       " sequences and kv heads; got " + std::to_string(batch) + " sequences and " +
                       std::to_string(in.kv_num_heads) + " kv heads";
    return plan;
  }
  const int64_t dim = in.head_dim > in.head_dim_v ? in.head_dim : in.head_dim_v;
  while (plan.bucket + 1 < c::kNumHeadDimBuckets && dim > c::kHeadDimBuckets[plan.bucket]) ++plan.bucket;
  const int bucket = plan.head_dim_bucket();

  // The tensor-core kernels (every path but the portable one) take 16-bit inputs in 16-byte
  // chunks: f16/bf16 with D and Dv multiples of 8 (and 16-byte aligned buffers: dispatch.cu).
  // Those head sizes also make every stride of the dense layouts (handler_common.h) a multiple
  // of 16 bytes, which the Hopper kernels' TMA needs.
  const bool tensor_core_shapes = in.dtype != DType::kF32 && in.head_dim % 8 == 0 && in.head_dim_v % 8 == 0;
  const int major = in.compute_major != 0 ? in.compute_major : (kWithSm90 ? 9 : 8);
  const bool tensor_cores = tensor_core_shapes && major >= 8;
  const bool hopper = kWithSm90 && major == 9;
  // The Hopper kernels index in 32-bit coordinates, and TMA needs a key row to load (Skv = 0 is
  // all zero rows, left to the sm80 kernel; packed: max_seqlen_k >= 1, so a pack has one too).
  const int64_t fwd_units = batch * in.num_heads * ((in.seqlen_q + c::kFwdSm90BlockM - 1) / c::kFwdSm90BlockM);
  const bool sm90_extents = in.seqlen_k >= 1 && in.pack_rows_q <= INT32_MAX && in.pack_rows_k <= INT32_MAX &&
                            in.num_packs <= INT32_MAX && fwd_units <= INT32_MAX;

  // Forward. Short queries (decode) take split-KV: its chunks spread a long key range over the
  // GPU where a one-pass grid would have a block or two per sequence.
  if (tensor_core_shapes && in.seqlen_q <= c::kSplitMaxSeqlenQ) {
    plan.split_keys = split_keys_setting();
    plan.split_persistent = split_persistent_enabled();
    const int64_t partials =
        c::split_partials_per_seq(in.seqlen_q, in.seqlen_k, in.num_heads, in.kv_num_heads, plan.split_keys);
    // o_part [.., head_dim_v], then lse_part, then (when there is a partial) the row blocks'
    // arrival counters
    plan.fwd_workspace_per_seq =
        partials * (in.head_dim_v + 1) +
        (partials > 0 ? c::split_counters_per_seq(in.seqlen_q, in.num_heads, in.kv_num_heads) : 0);
    plan.fwd_workspace_per_pack = in.pack_seqs * plan.fwd_workspace_per_seq;
  } else if (tensor_core_shapes && sm90_extents) {
    plan.fwd_workspace_per_pack = 1;  // the unit counter (an int32 in pack 0's word)
  }
  if (!tensor_cores) plan.fwd_path = FwdPath::kPortable;
  else if (plan.split_keys > 0) plan.fwd_path = FwdPath::kSm80Split;
  else if (hopper && sm90_extents) plan.fwd_path = FwdPath::kSm90OnePass;
  else plan.fwd_path = FwdPath::kSm80OnePass;
  plan.pack_gqa = plan.fwd_path == FwdPath::kSm90OnePass && in.num_heads > in.kv_num_heads && pack_gqa_enabled();
  plan.dynamic_units = plan.fwd_path == FwdPath::kSm90OnePass && in.page_size == 0;
  if (plan.fwd_path == FwdPath::kSm90OnePass) {
    const bool banded = in.is_causal || in.window_left >= 0 || in.window_right >= 0;
    plan.fwd_block_n = c::fwd_sm90_block_n(bucket, banded && in.page_size == 0);
    plan.lean_units = plan.dynamic_units && c::fwd_sm90_lean_kernels(bucket, plan.fwd_block_n);
    plan.fwd_plain_tiles = plan.dynamic_units && c::fwd_sm90_plain_kernels(bucket) && fwd_plain_enabled();
    plan.fwd_mixed_order = fwd_mixed_order_enabled();
  }

  // Backward. The Hopper kernel takes every bucket and needs a query and a key row; its dQ
  // workspace is sized whenever an sm_90 device could take the call.
  if (tensor_core_shapes && in.seqlen_q >= 1 && in.seqlen_k >= 1 && in.pack_seqs >= 1) {
    plan.bwd_block_m = c::bwd_block_m(bucket);
    plan.dq_slots = c::bwd_dq_slots(in.pack_rows_q, in.pack_seqs, plan.bwd_block_m);
    plan.dq_workspace_per_pack = in.num_heads * plan.dq_slots * (int64_t(plan.bwd_block_m) * bucket + 1) +
                                 in.pack_seqs;
    plan.dq_workspace_per_seq = in.num_heads * (int64_t(plan.bwd_block_m) * bucket + 1) + 1;  // dq_slots' + 1
  }
  const int64_t bwd_block_n = c::bwd_block_n(bucket);
  const int64_t bwd_ctas = (in.seqlen_k + bwd_block_n - 1) / bwd_block_n * batch * in.kv_num_heads;
  if (!tensor_cores) plan.bwd_path = BwdPath::kPortable;
  else if (hopper && plan.dq_workspace_per_pack > 0 && sm90_extents && bwd_ctas <= INT32_MAX)
    plan.bwd_path = BwdPath::kSm90;
  else plan.bwd_path = BwdPath::kSm80;

  // Paged keys: the split-KV kernel reads pages in place (limits.h, kPagedRun), and the Hopper
  // forward too when JAX_VARLEN_PAGED_SM90=1 (longer queries: chunked prefill; correct on an
  // H100 but 2.6x slower than gathering the pages first, benchmarks/NOTES.md, hence opt-in). A
  // paged call has no backward (forward only: no dQ workspace).
  if (in.page_size != 0) {
    const bool reads_pages = plan.fwd_path == FwdPath::kSm80Split ||
                             (plan.fwd_path == FwdPath::kSm90OnePass && paged_sm90_enabled());
    if (!reads_pages || in.page_size % c::kPagedRun != 0 || (in.packed_queries && in.seqlen_q > 1)) {
      Plan none;
      none.unsupported = "jax_varlen: the paged kernel (split-KV) takes float16/bfloat16 with head sizes that are "
                         "multiples of 8, at most " + std::to_string(c::kSplitMaxSeqlenQ) +
                         " queries per sequence (more on Hopper with JAX_VARLEN_PAGED_SM90=1; packed queries: "
                         "one per sequence) and pages of a "
                         "multiple of " + std::to_string(c::kPagedRun) +
                         " rows; got " + std::to_string(in.seqlen_q) + " queries per sequence, head sizes " +
                         std::to_string(in.head_dim) + " and " + std::to_string(in.head_dim_v) +
                         ", page_size " + std::to_string(in.page_size);
      return none;
    }
    plan.bwd_path = BwdPath::kPortable;
    plan.bwd_block_m = 0;
    plan.dq_slots = plan.dq_workspace_per_pack = plan.dq_workspace_per_seq = 0;
  }
  return plan;
}

// The plan of a call whose params a handler made (handler_common.h), on a device of compute
// capability major `compute_major`.
inline PlanInputs plan_inputs(const AttentionParams& p, int compute_major) {
  PlanInputs in;
  in.dtype = p.dtype;
  in.num_packs = p.num_packs;
  in.pack_seqs = p.pack_seqs;
  in.pack_rows_q = p.pack_rows_q;
  in.pack_rows_k = p.pack_rows_k;
  in.seqlen_q = p.seqlen_q;
  in.seqlen_k = p.seqlen_k;
  in.num_heads = p.num_heads;
  in.kv_num_heads = p.kv_num_heads;
  in.head_dim = p.head_dim;
  in.head_dim_v = p.head_dim_v;
  in.page_size = p.block_table != nullptr ? p.page_size : 0;
  in.is_causal = p.is_causal;
  in.window_left = p.window_left;
  in.window_right = p.window_right;
  in.compute_major = compute_major;
  return in;
}

}  // namespace jax_varlen
