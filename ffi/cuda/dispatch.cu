// The one dispatch table of the CUDA kernels, forward and backward: the plan's path (plan/plan.h,
// made by the handler for the call's static shapes and the device's compute capability) picks a
// row of kernels, the dtype and the head-dim bucket pick the entry.
//
// Forward, as the plan decides it:
//   path          device                 takes                                      kernels
//   sm80 split    compute capability 8+  f16/bf16, D and Dv multiples of 8, Sq <=    sm80::run_fwd_split
//                                        kSplitMaxSeqlenQ (short queries; the plan
//                                        sized its workspace)
//   sm90 one pass compute capability 9,  the same with longer queries, Skv >= 1,     sm90::run_fwd_sm90
//                 built with sm_90a      extents within 32-bit coordinates
//   sm80 one pass compute capability 8+  the same with longer queries                sm80::run_fwd_tc
//   portable      any                    everything else (float32 on an exact fp32  portable::run_fwd_simt
//                                        path, odd head sizes)
// Paged calls (block_table set) take the sm80 split row, or the sm90 one pass where the plan
// allows it (JAX_VARLEN_PAGED_SM90): both kernels read the pages in place.
// Packed calls (cu_seqlens set) run portable/packed_fill.cuh first (the rows no sequence owns;
// the unpaged Hopper forward zeroes its query rows from idle warps instead), then the same
// kernels as padded ones (every kernel reads sequences through SeqlenInfo).
// Backward (after portable/bwd_preprocess.cuh, for every path):
//   sm90          compute capability 9,  the tensor-core shapes, Sq, Skv >= 1,      sm90::run_bwd_sm90
//                 built with sm_90a      extents within 32-bit coordinates (the plan
//                                        sized its dQ workspace)
//   sm80 tensor   compute capability 8+  f16/bf16, D and Dv multiples of 8           sm80::run_bwd_tc
//   cores
//   portable      any                    everything else                            portable::run_bwd_simt
// The plan's path is the one that runs: a workspace of another size than the plan's, or a
// tensor-core path's buffer (or the sm90 backward's dQ workspace) that is not 16-byte aligned,
// never gets here: the handler rejects them (xla/cuda.cu).
#include <array>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "cuda/portable/bwd_preprocess.cuh"
#include "cuda/portable/packed_fill.cuh"
#include "cuda/launch.h"
#ifdef JAX_VARLEN_FWD_TRACE
#include "cuda/sm90/fwd_trace.h"
#endif

namespace jax_varlen::cuda {
namespace {

using FwdFn = cudaError_t (*)(const AttentionParams&, cudaStream_t);
using BwdFn = cudaError_t (*)(const BackwardParams&, cudaStream_t);
// A path's kernels: [dtype, in DType order: f32, f16, bf16][head-dim bucket, kHeadDimBuckets].
template <typename Fn>
using PathTable = std::array<std::array<Fn, kNumHeadDimBuckets>, 3>;
using PathKernels = PathTable<FwdFn>;
using BwdPathKernels = PathTable<BwdFn>;

template <typename T> struct ElemTag { using type = T; };
template <int kDim> using DimTag = std::integral_constant<int, kDim>;

// entry(ElemTag<Elem>, DimTag<kHeadDim>) -> the path's kernel for that dtype and bucket.
template <typename Fn, typename Elem, typename Entry, size_t... kBucket>
constexpr std::array<Fn, kNumHeadDimBuckets> buckets(Entry entry, std::index_sequence<kBucket...>) {
  return {entry(ElemTag<Elem>{}, DimTag<kHeadDimBuckets[kBucket]>{})...};
}
// A tensor-core path: f16 and bf16 only (float32 never takes one, so its entries stay null).
template <typename Fn = FwdFn, typename Entry>
constexpr PathTable<Fn> tensor_core_path(Entry entry) {
  constexpr auto all = std::make_index_sequence<kNumHeadDimBuckets>{};
  return {{{}, buckets<Fn, __half>(entry, all), buckets<Fn, __nv_bfloat16>(entry, all)}};
}
// A path of one kernel per dtype whatever the head size (the portable ones).
template <typename Fn>
constexpr PathTable<Fn> every_bucket(Fn f32, Fn f16, Fn bf16) {
  PathTable<Fn> t{};
  for (auto& e : t[0]) e = f32;
  for (auto& e : t[1]) e = f16;
  for (auto& e : t[2]) e = bf16;
  return t;
}

constexpr PathKernels kSm80Split = tensor_core_path(
    [](auto elem, auto dim) { return &sm80::run_fwd_split<typename decltype(elem)::type, decltype(dim)::value>; });
constexpr PathKernels kSm80OnePass = tensor_core_path(
    [](auto elem, auto dim) { return &sm80::run_fwd_tc<typename decltype(elem)::type, decltype(dim)::value>; });
#if defined(JAX_VARLEN_WITH_SM90)
constexpr PathKernels kSm90OnePass = tensor_core_path(
    [](auto elem, auto dim) { return &sm90::run_fwd_sm90<typename decltype(elem)::type, decltype(dim)::value>; });

constexpr BwdPathKernels kBwdSm90 = tensor_core_path<BwdFn>(
    [](auto elem, auto dim) -> BwdFn { return &sm90::run_bwd_sm90<typename decltype(elem)::type, decltype(dim)::value>; });
#endif

// The portable kernels take every head size: one entry per dtype, in every bucket.
constexpr PathKernels kPortable = every_bucket<FwdFn>(&portable::run_fwd_simt<float>, &portable::run_fwd_simt<__half>,
                                                      &portable::run_fwd_simt<__nv_bfloat16>);
constexpr BwdPathKernels kBwdSm80 = tensor_core_path<BwdFn>(
    [](auto elem, auto dim) { return &sm80::run_bwd_tc<typename decltype(elem)::type, decltype(dim)::value>; });
constexpr BwdPathKernels kBwdPortable = every_bucket<BwdFn>(
    &portable::run_bwd_simt<float>, &portable::run_bwd_simt<__half>, &portable::run_bwd_simt<__nv_bfloat16>);
constexpr BwdFn kBwdPreprocess[] = {&run_bwd_preprocess<float>, &run_bwd_preprocess<__half>,
                                    &run_bwd_preprocess<__nv_bfloat16>};

// The paths' rows, in FwdPath and BwdPath order (no sm90 rows in a build without the Hopper
// kernels, whose plans never choose them).
constexpr const PathKernels* kFwdPaths[] = {&kPortable, &kSm80Split, &kSm80OnePass,
#if defined(JAX_VARLEN_WITH_SM90)
                                            &kSm90OnePass
#else
                                            nullptr
#endif
};
constexpr const BwdPathKernels* kBwdPaths[] = {&kBwdPortable, &kBwdSm80,
#if defined(JAX_VARLEN_WITH_SM90)
                                               &kBwdSm90
#else
                                               nullptr
#endif
};

}  // namespace

namespace {
// The last launch (launch_record.h), one word per field; relaxed: a test reads it after the call.
std::atomic<int> last_fwd_path{-1}, last_bwd_path{-1};
std::atomic<int64_t> last_split_keys{0};
std::atomic<bool> last_split_persistent{false};
std::atomic<bool> last_paged{false}, last_pack_gqa{false}, last_dynamic_units{false};
std::atomic<int> last_fwd_block_n{0};
std::atomic<bool> last_lean_units{false};
std::atomic<bool> last_fwd_plain_tiles{false};
std::atomic<bool> last_fwd_mixed_order{false};
}  // namespace

LaunchRecord last_launch() {
  LaunchRecord r;
  r.fwd_path = last_fwd_path.load(std::memory_order_relaxed);
  r.bwd_path = last_bwd_path.load(std::memory_order_relaxed);
  r.split_keys = last_split_keys.load(std::memory_order_relaxed);
  r.split_persistent = last_split_persistent.load(std::memory_order_relaxed);
  r.paged = last_paged.load(std::memory_order_relaxed);
  r.pack_gqa = last_pack_gqa.load(std::memory_order_relaxed);
  r.dynamic_units = last_dynamic_units.load(std::memory_order_relaxed);
  r.fwd_block_n = last_fwd_block_n.load(std::memory_order_relaxed);
  r.lean_units = last_lean_units.load(std::memory_order_relaxed);
  r.fwd_plain_tiles = last_fwd_plain_tiles.load(std::memory_order_relaxed);
  r.fwd_mixed_order = last_fwd_mixed_order.load(std::memory_order_relaxed);
  return r;
}

#ifdef JAX_VARLEN_FWD_TRACE
// The Hopper forward's unit trace (sm90/fwd_trace.h; a profiling build): one buffer for the
// process and its current device, allocated by the first fwd_trace_read -- from Python before
// the traced calls, never inside a handler (XLA may be capturing a CUDA graph there); a launch
// before it traces nothing.
namespace sm90 {
namespace {
constexpr size_t kTraceBytes = sizeof(int64_t) * kTraceValues;
std::atomic<int64_t*> trace_buffer{nullptr};
}  // namespace
int64_t* fwd_trace_device_buffer() { return trace_buffer.load(std::memory_order_acquire); }
bool fwd_trace_read(int64_t* host) {
  int64_t* b = trace_buffer.load(std::memory_order_acquire);
  if (b == nullptr) {
    if (cudaMalloc(&b, kTraceBytes) != cudaSuccess || cudaMemset(b, 0xff, kTraceBytes) != cudaSuccess) return false;
    trace_buffer.store(b, std::memory_order_release);
  }
  return cudaDeviceSynchronize() == cudaSuccess &&
         cudaMemcpy(host, b, kTraceBytes, cudaMemcpyDeviceToHost) == cudaSuccess &&
         cudaMemset(b, 0xff, kTraceBytes) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
}
}  // namespace sm90
#endif

int device_major() {
  constexpr int kCachedDevices = 64;
  static int cached[kCachedDevices] = {};
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev < kCachedDevices && cached[dev] != 0) return cached[dev];
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return 0;
  if (dev < kCachedDevices) cached[dev] = major;
  return major;
}

cudaError_t run_fwd(const AttentionParams& p, const Plan& plan, cudaStream_t stream) {
  const FwdPath path = plan.fwd_path;
  // Pages are read by the split-KV kernel and the Hopper forward alone (the plan takes a paged
  // call nowhere else; the handler rejects unaligned caches before this point).
  if (p.block_table != nullptr && path != FwdPath::kSm80Split && path != FwdPath::kSm90OnePass)
    return cudaErrorInvalidValue;
  const PathKernels* kernels = kFwdPaths[int(path)];
  const FwdFn fn = kernels == nullptr ? nullptr : (*kernels)[int(p.dtype)][plan.bucket];
  if (fn == nullptr) return cudaErrorInvalidValue;
  last_fwd_path.store(int(path), std::memory_order_relaxed);
  last_split_keys.store(path == FwdPath::kSm80Split ? p.split_keys : 0, std::memory_order_relaxed);
  last_split_persistent.store(path == FwdPath::kSm80Split && p.split_persistent, std::memory_order_relaxed);
  last_paged.store(p.block_table != nullptr, std::memory_order_relaxed);
  last_pack_gqa.store(path == FwdPath::kSm90OnePass && p.pack_gqa, std::memory_order_relaxed);
  // The plan gives dynamic units to unpaged calls only, and lean units to dynamic ones only.
  last_dynamic_units.store(path == FwdPath::kSm90OnePass && p.dynamic_units, std::memory_order_relaxed);
  last_fwd_block_n.store(path == FwdPath::kSm90OnePass ? p.fwd_block_n : 0, std::memory_order_relaxed);
  last_lean_units.store(path == FwdPath::kSm90OnePass && p.lean_units, std::memory_order_relaxed);
  // The plain loop runs where the plan turns it on, in the kernels without softcap, for a
  // positive scale (fwd_softmax.h: the max on raw scores).
  last_fwd_plain_tiles.store(path == FwdPath::kSm90OnePass && p.fwd_plain_tiles && !(p.softcap > 0.0f) && p.scale > 0.0f,
                             std::memory_order_relaxed);
  // The mixed order ranks a sorted packed list: at most kFwdMaxSortedBatch sequences (sm90/tile_scheduler.h).
  last_fwd_mixed_order.store(path == FwdPath::kSm90OnePass && p.fwd_mixed_order && p.cu_seqlens_q != nullptr &&
                                 p.batch <= kFwdMaxSortedBatch,
                             std::memory_order_relaxed);
  // The packed layout's unowned query rows (portable/packed_fill.cuh): the Hopper forward's
  // idle producer warps zero them while it computes (not when all four gather pages); any
  // other call runs the fill kernel first.
  const bool launches = p.batch > 0 && p.seqlen_q > 0;  // else no sequence has a query row
  const bool fills_itself = launches && path == FwdPath::kSm90OnePass && p.block_table == nullptr;
  if (p.cu_seqlens_q != nullptr && !fills_itself) {
    const cudaError_t err = run_packed_fill(p, stream);
    if (err != cudaSuccess) return err;
  }
  if (!launches) return cudaSuccess;
  return fn(p, stream);
}

cudaError_t run_bwd(const BackwardParams& bp, const Plan& plan, cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  const BwdPath path = plan.bwd_path;
  const BwdPathKernels* kernels = kBwdPaths[int(path)];
  const BwdFn fn = kernels == nullptr ? nullptr : (*kernels)[int(p.dtype)][plan.bucket];
  if (fn == nullptr) return cudaErrorInvalidValue;
  last_bwd_path.store(int(path), std::memory_order_relaxed);
  BackwardParams args = bp;
  if (path == BwdPath::kSm90) {  // its counters follow the tiles, the sequence order them (limits.h)
    args.dq_semaphore = reinterpret_cast<int32_t*>(bp.dq_accum + plan.dq_accum_floats(p.num_packs, p.num_heads));
    args.seq_order = args.dq_semaphore + p.num_packs * p.num_heads * plan.dq_slots;
  }
  if (p.cu_seqlens_q != nullptr) {
    const cudaError_t err = run_packed_fill(bp, stream);
    if (err != cudaSuccess) return err;
  }
  if (p.batch == 0) return cudaSuccess;  // no sequence
  if (p.seqlen_q * p.num_heads > 0) {  // delta; nothing to do without query rows
    const cudaError_t err = kBwdPreprocess[int(p.dtype)](args, stream);
    if (err != cudaSuccess) return err;
  }
  return fn(args, stream);
}

}  // namespace jax_varlen::cuda
