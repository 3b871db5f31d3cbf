// The one dispatch table of the CUDA kernels, forward and backward: a path (what the device and
// the call allow) picks a row of kernels, the dtype and the head-dim bucket pick the entry.
//
// Forward:
//   path          device                 takes                                      kernels
//   sm80 split    compute capability 8+  f16/bf16, D and Dv multiples of 8, 16-byte  sm80::run_fwd_split
//                                        aligned buffers, the caller sized a split
//                                        workspace (short queries)
//   sm90 one pass compute capability 9,  the same, no workspace, strides TMA can     sm90::run_fwd_sm90
//                 built with sm_90a      take (sm90_takes)
//   sm80 one pass compute capability 8+  the same, no workspace                     sm80::run_fwd_tc
//   portable      any                    everything else (float32 on an exact fp32  sm80::run_fwd_simt
//                                        path, odd head sizes, unaligned buffers)
// Packed calls (cu_seqlens set) run common/packed_fill.cuh first (the rows no sequence owns),
// then the same kernels as padded ones (every kernel reads sequences through SeqlenInfo).
// Backward (after common/bwd_preprocess.cuh, for every path):
//   sm90          compute capability 9,  the sm80 tensor-core condition, sm90_takes,  sm90::run_bwd_sm90
//                 built with sm_90a      a bucket up to kBwdSm90MaxHeadDim, Sq >= 1,
//                                        the caller sized the dQ workspace
//   sm80 tensor   compute capability 8+  f16/bf16, D and Dv multiples of 8, 16-byte  sm80::run_bwd_tc
//   cores                                aligned buffers
//   portable      any                    everything else                            sm80::run_bwd_simt
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "cuda/common/bwd_preprocess.cuh"
#include "cuda/common/packed_fill.cuh"
#include "cuda/launch.h"

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

// The Hopper kernels take the call: at least one key row (Skv = 0 is all zero rows, left to
// the sm80 kernel; packed: max_seqlen_k >= 1, so a pack has a key row too), every stride a
// multiple of 16 bytes (TMA), and extents and unit counts within their 32-bit coordinates.
bool sm90_takes(const AttentionParams& p) {
  if (p.seqlen_k == 0) return false;
  const int64_t strides[] = {p.q_batch_stride,   p.q_row_stride,   p.q_head_stride,
                             p.k_batch_stride,   p.k_row_stride,   p.k_head_stride,
                             p.v_batch_stride,   p.v_row_stride,   p.v_head_stride,
                             p.out_batch_stride, p.out_row_stride, p.out_head_stride};
  for (int64_t s : strides)
    if (s < 0 || s % 8 != 0) return false;  // 8 elements of 2 bytes
  const int64_t m_blocks = (p.seqlen_q + sm90::kBlockM - 1) / sm90::kBlockM;
  return p.pack_rows_q <= INT32_MAX && p.pack_rows_k <= INT32_MAX && p.num_packs <= INT32_MAX &&
         p.batch * p.num_heads * m_blocks <= INT32_MAX;
}

// The Hopper backward: buckets up to kBwdSm90MaxHeadDim (null entries above).
constexpr BwdPathKernels kBwdSm90 = tensor_core_path<BwdFn>([](auto elem, auto dim) -> BwdFn {
  if constexpr (decltype(dim)::value <= kBwdSm90MaxHeadDim)
    return &sm90::run_bwd_sm90<typename decltype(elem)::type, decltype(dim)::value>;
  else
    return nullptr;
});
#endif

// The portable kernels take every head size: one entry per dtype, in every bucket.
constexpr PathKernels kPortable = every_bucket<FwdFn>(&sm80::run_fwd_simt<float>, &sm80::run_fwd_simt<__half>,
                                                      &sm80::run_fwd_simt<__nv_bfloat16>);
constexpr BwdPathKernels kBwdSm80 = tensor_core_path<BwdFn>(
    [](auto elem, auto dim) { return &sm80::run_bwd_tc<typename decltype(elem)::type, decltype(dim)::value>; });
constexpr BwdPathKernels kBwdPortable = every_bucket<BwdFn>(
    &sm80::run_bwd_simt<float>, &sm80::run_bwd_simt<__half>, &sm80::run_bwd_simt<__nv_bfloat16>);
constexpr BwdFn kBwdPreprocess[] = {&run_bwd_preprocess<float>, &run_bwd_preprocess<__half>,
                                    &run_bwd_preprocess<__nv_bfloat16>};

// Compute capability major of the current device, read once per device.
int device_major() {
  constexpr int kMaxDevices = 64;
  static int major[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= kMaxDevices) return 0;
  if (major[dev] == 0) cudaDeviceGetAttribute(&major[dev], cudaDevAttrComputeCapabilityMajor, dev);
  return major[dev];
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The tensor-core kernels' common condition: 16-bit inputs in 16-byte chunks.
bool tensor_cores(const AttentionParams& p, int major) {
  return major >= 8 && p.dtype != DType::kF32 && p.head_dim % 8 == 0 && p.head_dim_v % 8 == 0 &&
         aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.out);
}

const PathKernels& choose_path(const AttentionParams& p, int major) {
  if (!tensor_cores(p, major)) return kPortable;
  if (p.split_keys > 0) return kSm80Split;
#if defined(JAX_VARLEN_WITH_SM90)
  if (major == 9 && sm90_takes(p)) return kSm90OnePass;
#endif
  return kSm80OnePass;
}

// First bucket that holds max(D, Dv) (the handler checked it is at most kMaxHeadDim).
int bucket(const AttentionParams& p) {
  const int64_t dim = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  int i = 0;
  while (i + 1 < kNumHeadDimBuckets && dim > kHeadDimBuckets[i]) ++i;
  return i;
}

}  // namespace

cudaError_t run_fwd(const AttentionParams& p, cudaStream_t stream) {
  const FwdFn fn = choose_path(p, device_major())[int(p.dtype)][bucket(p)];
  if (fn == nullptr) return cudaErrorInvalidValue;
  if (p.cu_seqlens_q != nullptr) {
    const cudaError_t err = run_packed_fill(p, stream);
    if (err != cudaSuccess) return err;
  }
  if (p.batch == 0 || p.seqlen_q == 0) return cudaSuccess;  // no sequence has a query row
  return fn(p, stream);
}

#if defined(JAX_VARLEN_WITH_SM90)
// The Hopper backward's dQ workspace (limits.h): its (pack, head, slot) units, each a tile of
// block_m * bucket floats and one counter; 0 units when it does not apply.
struct BwdSm90Workspace {
  int64_t units = 0, tile = 0;
  explicit BwdSm90Workspace(const AttentionParams& p) {
    const int dim = kHeadDimBuckets[bucket(p)];
    if (dim > kBwdSm90MaxHeadDim) return;
    const int block_m = bwd_block_m(dim);
    units = p.num_packs * p.num_heads * bwd_dq_slots(p.pack_rows_q, p.pack_seqs, block_m);
    tile = int64_t(block_m) * dim;
  }
  int64_t elements() const { return units * (tile + 1); }  // float32: the tiles, then the counters
};
#endif

cudaError_t run_bwd(const BackwardParams& bp, cudaStream_t stream) {
  const AttentionParams& p = bp.fwd;
  const int major = device_major();
  const bool tc = tensor_cores(p, major) && aligned16(bp.d_out) && aligned16(bp.d_q) &&
                  aligned16(bp.d_k) && aligned16(bp.d_v);
  BwdFn fn = (tc ? kBwdSm80 : kBwdPortable)[int(p.dtype)][bucket(p)];
  BackwardParams args = bp;
#if defined(JAX_VARLEN_WITH_SM90)
  const BwdSm90Workspace ws(p);
  const int64_t need = ws.elements();
  const int64_t n_blocks = (p.seqlen_k + kBwdBlockN - 1) / kBwdBlockN;  // its grid: n_blocks x B x Hkv
  if (tc && major == 9 && sm90_takes(p) && p.seqlen_q > 0 && need > 0 && bp.dq_elements >= need &&
      aligned16(bp.dq_accum) && n_blocks * p.batch * p.kv_num_heads <= INT32_MAX) {
    fn = kBwdSm90[int(p.dtype)][bucket(p)];
    args.dq_semaphore = reinterpret_cast<int32_t*>(bp.dq_accum + ws.units * ws.tile);
  }
#endif
  if (fn == nullptr) return cudaErrorInvalidValue;
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
