// Hopper forward (sm_90a): TMA loads into swizzled shared memory, QK^T and PV on wgmma with
// fp32 accumulators, warp specialization, and a persistent grid that walks the ragged batch
// heaviest-first.
//
// One CTA = 3 warpgroups (384 threads), by role:
//   warpgroup 0, warp 0: the producer (fwd_load.h, FwdLoad). It issues the TMA copies of Q, K
//     and V (kStages-deep K and V rings on mbarriers), from a unit's last key tile down; for a
//     paged call all four of its warps gather K and V from the pages by cp.async instead.
//   warpgroups 1 and 2: the consumers, 64 query rows each of a kBlockM = 128 row tile: the
//     mainloop (fwd_mma.h, FwdMma: S = Q K^T, the online softmax, O += P V, the two warpgroups
//     taking turns to issue GEMMs) and the epilogue (fwd_epilogue.h, FwdEpilogue: O / l and lse).
// setmaxnreg moves registers from the producer warpgroup to the consumers. The kernel below
// assigns the roles and runs each role's persistent loop over units; the roles' state (TMA
// views, wgmma descriptors, coordinates) is built once, before that loop.
//
// Work unit = (sequence b, query head h, block of kBlockM query rows) -- or, for a short sequence
// under pack-GQA, (sequence b, kv head, kBlockM rows of (query row, head of the group)) --, taken
// heaviest-first (tile_scheduler.h) by the CTAs of the persistent grid from a counter (a paged
// call's kernel: in a snake): the order depends only on the lengths; each unit is computed
// whole by one CTA, in the same way wherever it runs, so results are bitwise deterministic and
// batch invariant. In an unpaged call the producer warpgroup's other warps zero the packed
// layout's unowned query rows meanwhile.
//
// Both layouts (params.h): TMA sees the tensors as (rows of a pack, dim, heads, packs) and a
// unit's tiles start at its sequence's first row in the pack (SeqlenInfo; 0 in the padded
// batch, where each sequence is a pack). Tiles may reach past the sequence: query rows past its
// length are computed and never stored, keys past it are masked and their V rows zeroed, as
// for padding.
#pragma once

#include "cuda/portable/packed_fill.cuh"
#include "cuda/sm90/common.h"
#include "cuda/sm90/fwd_epilogue.h"
#include "cuda/sm90/fwd_load.h"
#include "cuda/sm90/fwd_mma.h"
#include "cuda/sm90/fwd_traits.h"
#include "cuda/sm90/tile_scheduler.h"

namespace jax_varlen::cuda::sm90 {

// Where each role's r-th unit comes from. Static (a paged call's kernel): the scheduler's snake
// (unit_of_round), which both roles compute alike. Dynamic (params.h, dynamic_units: every
// other call): the unit queue (tile_scheduler.h) on the workspace's first word.
template <typename Tr, bool kDynamic>
struct UnitSource {
  using Sched = typename Tr::Scheduler;
  // Everything is read where it is used (kernel parameters, shared memory): no register stays
  // live across a unit for it.
  // The producer warp's r-th unit, or -1 past the end (every lane).
  static __device__ int producer_next(const FwdKernelParams<Tr>& kp, FwdSharedStorage<Tr>& ss, int num_units, int r) {
    if constexpr (!kDynamic) return Sched::unit_of_round(r, num_units);
    const int u = ss.units.claim(reinterpret_cast<int*>(kp.p.workspace), num_units, r);
    ss.units.publish(r, u);
    return u;
  }
  // A consumer thread's r-th unit, or -1 past the end.
  static __device__ int consumer_next(const FwdKernelParams<Tr>& kp, FwdSharedStorage<Tr>& ss, int num_units, int r) {
    if constexpr (!kDynamic) return Sched::unit_of_round(r, num_units);
    return ss.units.read(r);
  }
};

// Lean units (params.h, lean_units; the unpaged kernels of Tr::kLeanKernels):
// dynamic units whose producer decodes each unit once and hands the decoded Unit (15 ints) to
// the consumers beside its index in the queue's slot (lean_unit), so a unit starts on
// a few shared loads instead of every consumer thread searching the list and reading the
// sequence's offsets from global memory while both warpgroups' GEMMs wait. Same list, same
// counter, same units as UnitSource<Tr, true>.
template <typename Tr>
struct UnitHandover {
  using Sched = typename Tr::Scheduler;
  // The producer warp's r-th unit into w (every lane); false past the end.
  static __device__ bool producer_next(const FwdKernelParams<Tr>& kp, FwdSharedStorage<Tr>& ss, int num_units, int r,
                                       Unit& w) {
    const int u = ss.units.claim(reinterpret_cast<int*>(kp.p.workspace), num_units, r);
    if (u >= 0) w = Sched::decode_unit(kp.p, kp.num_m_blocks, ss.sched, u);
    if (threadIdx.x == 0 && u >= 0) ss.lean_unit[r & 1] = w;
    ss.units.publish(r, u);
    return u >= 0;
  }
  // A consumer thread's r-th unit into w; false past the end.
  static __device__ bool consumer_next(FwdSharedStorage<Tr>& ss, int r, Unit& w) {
    return ss.units.read(r, [&](int slot, int u) {
      if (u >= 0) w = ss.lean_unit[slot];
    }) >= 0;
  }
};

// kPaged: K and V gathered from a paged cache (fwd_load.h), static units (the snake);
// otherwise dynamic units (the counter, UnitSource), and where Tr has lean kernels lean units
// (UnitHandover) and idle warpgroups (FwdMma::follow).
template <typename Tr, bool kSoftcap, bool kPaged>
__global__ void __launch_bounds__(Tr::kThreads, 1) fwd_sm90_kernel(const __grid_constant__ FwdKernelParams<Tr> kp) {
  constexpr bool kDynamic = !kPaged, kLean = kDynamic && Tr::kLeanKernels;
  using Element = typename Tr::Element;
  using Sched = typename Tr::Scheduler;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<FwdSharedStorage<Tr>*>(smem_raw);
  const AttentionParams& p = kp.p;
  using Barrier = cutlass::arch::ClusterBarrier;

  // A paged call's K and V tiles land by cp.async from every producer warp (fwd_load.h), each
  // arriving once; otherwise by TMA, one arrival with its transaction bytes.
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < Tr::kStages; ++s) {
      Barrier::init(&ss.full_k[s], kPaged ? Tr::kProducerWarps : 1);
      Barrier::init(&ss.full_v[s], kPaged ? Tr::kProducerWarps : 1);
      Barrier::init(&ss.empty_k[s], Tr::kConsumerWarps);
      Barrier::init(&ss.empty_v[s], Tr::kConsumerWarps);
    }
    Barrier::init(&ss.full_q, 1);
    Barrier::init(&ss.empty_q, Tr::kConsumerWarps);
    ss.units.init(Tr::kConsumerWarps);
    cutlass::arch::fence_barrier_init();
  }
  Sched::sort_sequences(p, ss.sched);
  __syncthreads();
  const int num_units = Sched::num_units(p, kp.num_units, ss.sched);  // work-proportional
  JV_FWD_TRACE(if (threadIdx.x == 0) trace_header(kp.trace, num_units);)
  using Units = UnitSource<Tr, kDynamic>;

  const FwdRole role = fwd_role<kPaged>();
  if (role != FwdRole::kConsumer) {
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    if (role == FwdRole::kFill) {
      // Warps 1-3 have no load to issue: they zero the packed layout's unowned query rows (out,
      // lse) while the consumers compute, so dispatch.cu runs no fill kernel before this one.
      if (p.cu_seqlens_q != nullptr) fill_out_by_grid(p, threadIdx.x / 32 - 1, Tr::kProducerWarps - 1);
      return;
    }
    FwdLoad<Tr, kPaged> load(kp, ss);
    PipelineState<Tr::kStages> pipe;
    int q_iter = 0;
    if constexpr (kLean) {
      Unit w;
      for (int r = 0; UnitHandover<Tr>::producer_next(kp, ss, num_units, r, w); ++r) {
        JV_FWD_TRACE(int64_t* const row = threadIdx.x == 0 ? trace_row(kp.trace, r) : nullptr;
                     trace_mark(row, kTraceClaim); load.trace = row;)
        if (w.n_tiles > 0) load.load(w, pipe, q_iter);  // else the consumers write zeros
        JV_FWD_TRACE(trace_mark(row, kTraceLoaded);)
      }
    } else {
      for (int r = 0;; ++r) {
        const int u = Units::producer_next(kp, ss, num_units, r);
        if (u < 0) break;
        const Unit w = Sched::decode_unit(p, kp.num_m_blocks, ss.sched, u);
        JV_FWD_TRACE(int64_t* const row = threadIdx.x == 0 ? trace_row(kp.trace, r) : nullptr;
                     trace_mark(row, kTraceClaim); load.trace = row;)
        if (w.n_tiles == 0) continue;  // no row may see a key: the consumers write zeros
        load.load(w, pipe, q_iter);
        JV_FWD_TRACE(trace_mark(row, kTraceLoaded);)
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Tr::kConsumerRegs>();
  const int ct = threadIdx.x - kWarpgroupThreads;  // 0..255
  FwdMma<Tr, kSoftcap> mainloop(ss, ct);
  const FwdEpilogue<Tr> epilogue(p, ss, ct);
  mainloop.begin_turns();
  PipelineState<Tr::kStages> pipe;
  int q_iter = 0;
  for (int r = 0;; ++r) {
    Unit w;
    // A warpgroup's first thread marks its steps of the unit (fwd_trace.h; a profiling build).
    JV_FWD_TRACE(int64_t* const row = ct % kWarpgroupThreads == 0 ? trace_row(kp.trace, r) : nullptr;
                 const int wg_mark = kTraceWarpgroupStride * (ct / kWarpgroupThreads); mainloop.trace = row;
                 mainloop.trace_wg = wg_mark;)
    if constexpr (kLean) {
      if (!UnitHandover<Tr>::consumer_next(ss, r, w)) break;
      JV_FWD_TRACE(trace_mark(row, kTraceGot + wg_mark);)
      if (w.n_tiles > 0 && mainloop.idle(w)) {  // rows all past the unit's: the barriers' part only
        mainloop.follow(w, pipe, q_iter);
        JV_FWD_TRACE(trace_mark(row, kTraceStored + wg_mark);)
        continue;
      }
    } else {
      const int u = Units::consumer_next(kp, ss, num_units, r);
      if (u < 0) break;
      w = Sched::decode_unit(p, kp.num_m_blocks, ss.sched, u);
      JV_FWD_TRACE(trace_mark(row, kTraceGot + wg_mark);)
    }
    JV_FWD_TRACE(if (ct == 0) {
      trace_set(row, kTraceSeq, w.b);
      trace_set(row, kTraceTiles, w.n_tiles - w.t_begin);
      trace_set(row, kTraceRows, w.rows);
    })
    if (w.n_tiles == 0) {
      epilogue.store_zeros(w, epilogue.unit_out(w));
      JV_FWD_TRACE(trace_mark(row, kTraceStored + wg_mark);)
      continue;
    }
    const FwdRows rows = mainloop.thread_rows(p, w);
    RowSoftmax<kSoftcap> softmax(p.scale, p.softcap);
    Tensor tSrS = partition_fragment_C(mainloop.mma_qk, select<0, 1>(typename Tr::TileQK{}));
    Tensor tOrO = partition_fragment_C(typename Tr::TiledMmaPV{}, select<0, 1>(typename Tr::TilePV{}));
    Tensor tOrP = make_tensor_like<Element>(make_tensor(tSrS.data(), acc_to_a_layout(tSrS.layout())));
    mainloop.template mma<kDynamic && Tr::kPlainKernels>(w, rows, pipe, q_iter, softmax, tSrS, tOrO, tOrP,
                                                         p.fwd_plain_tiles);
    JV_FWD_TRACE(trace_mark(row, kTraceMma + wg_mark);)
    epilogue.store(w, rows, epilogue.unit_out(w), softmax, tOrO);  // addresses after the mainloop: fewer live registers there
    JV_FWD_TRACE(trace_mark(row, kTraceStored + wg_mark);)
  }
  JV_FWD_TRACE(if (ct == 0) trace_footer(kp.trace);)
}

// One launch of the kernels of traits Tr; kWithPaged: Tr's paged kernel is compiled (the
// bucket's widest tile only; the plan never gives a paged call another).
template <typename Tr, bool kWithPaged>
cudaError_t launch_fwd_sm90(const AttentionParams& p, cudaStream_t stream) {
  using Element = typename Tr::Element;
  constexpr int kHeadDim = Tr::kHeadDim;
  // [packs, pack rows, heads, dim] views from the params' element strides, which TMA can take
  // (plan/plan.h); V is read transposed, (dim, key). Pack rows >= 1 (the plan).
  auto q_stride = make_stride(p.q_row_stride, _1{}, p.q_head_stride, p.q_batch_stride);
  auto k_stride = make_stride(p.k_row_stride, _1{}, p.k_head_stride, p.k_batch_stride);
  auto v_stride = make_stride(_1{}, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
  Tensor mQ = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.q)),
                          make_shape(int(p.pack_rows_q), int(p.head_dim), int(p.num_heads), int(p.num_packs)), q_stride);
  Tensor mK = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.k)),
                          make_shape(int(p.pack_rows_k), int(p.head_dim), int(p.kv_num_heads), int(p.num_packs)), k_stride);
  Tensor mVt = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.v)),
                           make_shape(int(p.head_dim_v), int(p.pack_rows_k), int(p.kv_num_heads), int(p.num_packs)), v_stride);
  FwdKernelParams<Tr> kp{
      make_tma_copy(SM90_TMA_LOAD{}, mQ, typename Tr::SmemLayoutQ{}, Shape<Int<Tr::kBlockM>, Int<kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename Tr::SmemLayoutK{}), Shape<Int<Tr::kBlockN>, Int<kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mVt, take<0, 2>(typename Tr::SmemLayoutVt{}), Shape<Int<kHeadDim>, Int<Tr::kBlockN>>{}, _1{}),
      p, 0, 0 JV_FWD_TRACE(, fwd_trace_device_buffer())};  // a trace build: nullptr traces nothing
  kp.num_m_blocks = int((p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM);
  const int64_t units = p.batch * p.num_heads * kp.num_m_blocks;
  if (units > INT32_MAX) return cudaErrorInvalidValue;
  kp.num_units = int(units);
  const int grid = kp.num_units < sm_count() ? kp.num_units : sm_count();
  // Two kernels per softcap flavour: a paged call's (pages gathered by the producer warps,
  // fwd_load.h; static units) and every other call's (dynamic units; lean units where Tr has
  // lean kernels). The plan's dynamic_units and lean_units must say the same: any other
  // combination is an error, never another kernel.
  const bool paged = p.block_table != nullptr;
  if (paged ? (!kWithPaged || p.dynamic_units) : (!p.dynamic_units || p.lean_units != Tr::kLeanKernels))
    return cudaErrorInvalidValue;
  const bool dynamic = !paged;
  auto pick = [&](auto softcap) {
    constexpr bool kSoftcap = decltype(softcap)::value;
    if constexpr (kWithPaged)
      if (paged) return fwd_sm90_kernel<Tr, kSoftcap, true>;
    return fwd_sm90_kernel<Tr, kSoftcap, false>;
  };
  auto kernel = p.softcap > 0.0f ? pick(std::true_type{}) : pick(std::false_type{});
  constexpr size_t kSmem = sizeof(FwdSharedStorage<Tr>);
  static_assert(kSmem <= 227 * 1024, "shared memory of one sm_90 CTA");
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem));
  if (err != cudaSuccess) return err;
  if (dynamic) {  // the unit counter (UnitSource) starts at 0 (a memset node under capture)
    err = cudaMemsetAsync(p.workspace, 0, sizeof(int), stream);
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, Tr::kThreads, kSmem, stream>>>(kp);
  return cudaGetLastError();
}

// The forward of one (dtype, head-dim bucket): the kernels of the plan's key tile (p.fwd_block_n,
// plan/limits.h): the bucket's widest, or at bucket 128 the banded calls' 128. Any other value
// is an error, never another kernel.
template <typename Elem, int kHeadDim>
cudaError_t run_fwd_sm90(const AttentionParams& p, cudaStream_t stream) {
  using Element = typename CutlassElem<Elem>::type;
  constexpr int kWidest = ::jax_varlen::cuda::fwd_sm90_block_n(kHeadDim, false);
  if (p.fwd_block_n == kWidest) return launch_fwd_sm90<FwdTraits<Element, kHeadDim, kWidest>, true>(p, stream);
  constexpr int kBanded = ::jax_varlen::cuda::fwd_sm90_block_n(kHeadDim, true);
  if constexpr (kBanded != kWidest)
    if (p.fwd_block_n == kBanded) return launch_fwd_sm90<FwdTraits<Element, kHeadDim, kBanded>, false>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace jax_varlen::cuda::sm90

