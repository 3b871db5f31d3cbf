// Hopper forward (sm_90a): TMA loads into swizzled shared memory, QK^T and PV on wgmma with
// fp32 accumulators, warp specialization, and a persistent grid that walks the ragged batch
// heaviest-first.
//
// One CTA = 3 warpgroups (384 threads):
//   warpgroup 0, warp 0: the producer. It issues the TMA copies of Q, K and V (kStages-deep
//     K and V rings on mbarriers). Tiles past a unit's last allowed key are never loaded; the
//     last tile, when partial, lands whole, and the consumers zero its V rows past the last
//     key before using it (padding may hold NaN, and 0 * NaN would poison P V), while its K
//     rows only feed scores that the mask replaces by -inf.
//   warpgroups 1 and 2: the consumers, 64 query rows each of a kBlockM = 128 row tile. Each
//     runs S = Q K^T (SS wgmma), the online softmax in registers, and O += P V (RS wgmma, P from
//     registers). Inside a warpgroup, the softmax of tile t overlaps the PV product of tile
//     t + 1 (key tiles are walked from the last one down); between the two warpgroups a pair of
//     named barriers hands over the turn to issue GEMMs (ping-pong), so one warpgroup's softmax
//     (and, in short units, its epilogue) runs under the other's GEMMs.
// setmaxnreg moves registers from the producer warpgroup to the consumers.
//
// Work unit = (sequence b, query head h, block of kBlockM query rows), taken heaviest-first
// in a snake over the persistent grid (tile_scheduler.h): the order depends only on the
// lengths; each unit is computed whole by one CTA, in the same way wherever it runs, so
// results are bitwise deterministic and batch invariant.
//
// Both layouts (params.h): TMA sees the tensors as (rows of a pack, dim, heads, packs) and a
// unit's tiles start at its sequence's first row in the pack (SeqlenInfo; 0 in the padded
// batch, where each sequence is a pack). Tiles may reach past the sequence: query rows past its
// length are computed and never stored, keys past it are masked and their V rows zeroed, as
// for padding.
#pragma once

#include "cuda/sm90/common.h"
#include "cuda/sm90/tile_scheduler.h"
#include "core/sinks.h"

namespace jax_varlen::cuda::sm90 {

// Keys per tile: the widest that fits shared memory (Q + 2 stages of K and V: 96, 208 and 224 KB)
// and registers (S, P and O of 64 rows per consumer thread group).
template <int kHeadDim>
constexpr int default_block_n() { return kHeadDim <= 64 ? 128 : (kHeadDim <= 128 ? 176 : 80); }

template <typename Element_, int kHeadDim_, int kBlockN_ = default_block_n<kHeadDim_>()>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // bucket of max(D, Dv): 64, 128, 256
  static constexpr int kBlockM = sm90::kBlockM;  // query rows per unit, 64 per consumer warpgroup
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = 2;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kThreads = 128 + kConsumerThreads;
  // 128 * producer + 256 * consumer registers <= 64K; wider key tiles need the last 8.
  static constexpr int kProducerRegs = kBlockN > 128 ? 24 : 40;
  static constexpr int kConsumerRegs = kBlockN > 128 ? 240 : 232;
  // Batches up to this size are sorted heaviest-first (order and lengths kept in shared
  // memory); larger ones keep their own order and read lengths from global memory.
  static constexpr int kMaxSortedBatch = 384;
  using Scheduler = HeaviestFirstScheduler<kBlockM, kBlockN, kMaxSortedBatch, kThreads>;
  // A last tile of at most kHalfN keys (the largest multiple of 16 <= kBlockN / 2) runs on
  // narrower products: 64 of 128, 80 of 176, 32 of 80.
  static constexpr int kHalfN = kBlockN / 2 / 16 * 16;

  using TileQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // S [M, N] = Q [M, D] K^T
  using TilePV = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;  // O [M, Dv] += P [M, N] V
  using AtomLayout = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;  // warpgroups split M
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileQK>(), AtomLayout{}));
  // S of a last tile of at most kHalfN keys (see the consumer).
  using TiledMmaQKHalf = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kHalfN>, Int<kHeadDim>>>(),
      AtomLayout{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TilePV, GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayout{}));

  // Q [kBlockM, kHeadDim] and K [kBlockN, kHeadDim] x stages, head dim contiguous (K-major);
  // V^T [kHeadDim, kBlockN] x stages, head dim contiguous (MN-major): V lands as it is in HBM.
  using SmemLayoutQ = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDim>>(),
      Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>(),
      Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutVt = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::MN, Element, Int<kHeadDim>, Int<kBlockN>>(),
      Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{}));

  // Global tensors as TMA sees them: (rows, head dim, heads, batch), head dim contiguous; V as
  // (head dim, rows, heads, batch) to match V^T.
  using Shape4 = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideRows = Stride<int64_t, _1, int64_t, int64_t>;
  using StrideCols = Stride<_1, int64_t, int64_t, int64_t>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), Shape4{}, StrideRows{}),
      SmemLayoutQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), Shape4{}, StrideRows{}),
      take<0, 2>(SmemLayoutK{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), Shape4{}, StrideCols{}),
      take<0, 2>(SmemLayoutVt{}), Shape<Int<kHeadDim>, Int<kBlockN>>{}, _1{}));

  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);  // one K or V tile
};

// Shared memory. Every tile buffer is a multiple of 1 KB and 1 KB aligned (the 128-byte
// swizzle repeats every 1 KB, and TMA and wgmma agree on it only from an aligned base).
template <typename Tr>
struct alignas(1024) SharedStorage {
  cute::array_aligned<typename Tr::Element, cosize_v<typename Tr::SmemLayoutQ>, 1024> q;
  cute::array_aligned<typename Tr::Element, cosize_v<typename Tr::SmemLayoutK>, 1024> k;
  cute::array_aligned<typename Tr::Element, cosize_v<typename Tr::SmemLayoutVt>, 1024> v;
  uint64_t full_k[Tr::kStages], full_v[Tr::kStages];    // producer -> consumers: tile landed
  uint64_t empty_k[Tr::kStages], empty_v[Tr::kStages];  // consumers -> producer: stage free
  uint64_t full_q, empty_q;
  typename Tr::Scheduler::SharedStorage sched;  // the batch's heaviest-first order
};

template <typename Tr>
struct KernelParams {
  typename Tr::TmaQ tma_q;
  typename Tr::TmaK tma_k;
  typename Tr::TmaV tma_v;
  AttentionParams p;
  int num_m_blocks;  // ceil(seqlen_q / kBlockM)
  int num_units;     // batch * num_heads * num_m_blocks
};

// Named barriers (bar.sync ids; 0 is __syncthreads): the consumer ping-pong (warpgroup i waits
// on kSchedWg0 + i), and each consumer warpgroup's own barrier after it zeroed a V tail.
enum class FwdBarrier : int { kSchedWg0 = 1, kSchedWg1 = 2, kZeroWg0 = 3, kZeroWg1 = 4 };
// Thread roles: warpgroup 0 is the producer's (its warp 0 loads, the others exit), warpgroups
// 1 and 2 are the consumers.
enum class FwdRole { kProducer, kConsumer };
// Units of at most this many key tiles hand over turns for every GEMM (see the consumer).
constexpr int kShortUnitTiles = 4;

// Online softmax of one consumer thread's rows. Scores live in base 2 (z = s * scale * log2 e,
// or softcap * log2 e * tanh(s * scale / softcap)), so exp is one ex2.approx; m is the running
// max in those units. The thread holds rows rr = 0, 1 (row, row + 8) of its warp; element
// 4j + 2rr + c of a fragment is (row rr, column 8j + 2 * (lane % 4) + c).
template <bool kSoftcap>
struct RowSoftmax {
  float m[2], l[2];  // running max (base 2) and this thread's partial row sums
  float z_scale, z_cap;

  __device__ RowSoftmax(float scale, float softcap)
      : z_scale(softcap > 0.0f ? scale / softcap : scale * 1.4426950408889634f),
        z_cap(softcap * 1.4426950408889634f) {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
  }

  // s [kNT * 4] raw scores of 8 * kNT keys -> unnormalized probabilities exp2(z - m). Elements i with
  // masked_out(i) get probability 0 when `masked` (uniform; only limit tiles). Returns in
  // alpha the factor the output rows must be multiplied by (0 while nothing was allowed yet).
  template <int kNT, typename MaskedOut>
  __device__ __forceinline__ void step(float* s, bool masked, MaskedOut masked_out, float (&alpha)[2]) {
    // With a positive scale and no softcap, the max is taken on raw scores and the scale rides in
    // the exp's FFMA (scaling by z_scale > 0 is monotonic, also after rounding).
    float factor = z_scale;
    if (kSoftcap || !(z_scale > 0.0f)) {
      factor = 1.0f;
#pragma unroll
      for (int i = 0; i < kNT * 4; ++i) {
        float z = s[i] * z_scale;
        if constexpr (kSoftcap) z = z_cap * tanhf(z);
        s[i] = z;
      }
    }
    if (masked) {
#pragma unroll
      for (int i = 0; i < kNT * 4; ++i)
        if (masked_out(i)) s[i] = -INFINITY;
    }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kNT; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * rr], s[4 * j + 2 * rr + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      mx = fmaxf(m[rr], mx * factor);
      const float m_use = mx == -INFINITY ? 0.0f : mx;
      alpha[rr] = ex2_approx(m[rr] - m_use);
      m[rr] = mx;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& x = s[4 * j + 2 * rr + c];
          x = ex2_approx(fmaf(x, factor, -m_use));
          sum += x;
        }
      l[rr] = l[rr] * alpha[rr] + sum;
    }
  }
};

template <int kN>
__device__ __forceinline__ void rescale_rows(float* o, const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) o[i] *= alpha[(i / 2) & 1];
}

template <typename Tr, bool kSoftcap>
__global__ void __launch_bounds__(Tr::kThreads, 1) fwd_sm90_kernel(const __grid_constant__ KernelParams<Tr> kp) {
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim, kStages = Tr::kStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<SharedStorage<Tr>*>(smem_raw);
  const AttentionParams& p = kp.p;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&ss.full_k[s], 1);
      Barrier::init(&ss.full_v[s], 1);
      Barrier::init(&ss.empty_k[s], Tr::kConsumerWarps);
      Barrier::init(&ss.empty_v[s], Tr::kConsumerWarps);
    }
    Barrier::init(&ss.full_q, 1);
    Barrier::init(&ss.empty_q, Tr::kConsumerWarps);
    cutlass::arch::fence_barrier_init();
  }
  Tr::Scheduler::sort_sequences(p, ss.sched);
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutVt{});
  const int group = int(p.num_heads / p.kv_num_heads);

  const FwdRole role = threadIdx.x < 128 ? FwdRole::kProducer : FwdRole::kConsumer;
  if (role == FwdRole::kProducer) {  // ---------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    const bool leader = lane == 0;
    const int rows_q = int(p.pack_rows_q), rows_k = int(p.pack_rows_k), packs = int(p.num_packs);
    Tensor mQ = kp.tma_q.get_tma_tensor(make_shape(rows_q, int(p.head_dim), int(p.num_heads), packs));
    Tensor mK = kp.tma_k.get_tma_tensor(make_shape(rows_k, int(p.head_dim), int(p.kv_num_heads), packs));
    Tensor mVt = kp.tma_v.get_tma_tensor(make_shape(int(p.head_dim_v), rows_k, int(p.kv_num_heads), packs));
    auto tma_q = kp.tma_q.get_slice(0);
    auto tma_k = kp.tma_k.get_slice(0);
    auto tma_v = kp.tma_v.get_slice(0);
    Tensor tQsQ = tma_q.partition_D(sQ);
    Tensor tKsK = tma_k.partition_D(sK);    // (TMA, 1, 1, stages)
    Tensor tVsV = tma_v.partition_D(sVt);   // (TMA, 1, 1, stages)

    // Tile t of unit w (keys [t * kBlockN, +kBlockN)) into stage s of K (kIsV false) or V.
    auto load_tile = [&](const Unit& w, int t, int s, auto is_v) {
      if (!leader) return;
      const int g = w.h / group;
      if constexpr (decltype(is_v)::value) {
        TxBarrier::arrive_and_expect_tx(&ss.full_v[s], Tr::kBytesKV);
        Tensor gV = local_tile(domain_offset(make_coord(0, w.k_start), mVt(_, _, g, w.pack)),
                               Shape<Int<kHeadDim>, Int<kBlockN>>{}, make_coord(0, t));
        copy(kp.tma_v.with(ss.full_v[s]), tma_v.partition_S(gV), tVsV(_, _, _, s));
      } else {
        TxBarrier::arrive_and_expect_tx(&ss.full_k[s], Tr::kBytesKV);
        Tensor gK = local_tile(domain_offset(make_coord(w.k_start, 0), mK(_, _, g, w.pack)),
                               Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(t, 0));
        copy(kp.tma_k.with(ss.full_k[s]), tma_k.partition_S(gK), tKsK(_, _, _, s));
      }
    };

    int stage = 0, phase = 0, q_iter = 0;
    auto advance = [&] { if (++stage == kStages) { stage = 0; phase ^= 1; } };
    for (int r = 0;; ++r) {
      const int u = Tr::Scheduler::unit_of_round(r, kp.num_units);
      if (u < 0) break;
      const Unit w = Tr::Scheduler::decode_unit(p, kp.num_m_blocks, ss.sched, u);
      if (w.n_tiles == 0) continue;  // no row may see a key: the consumers write zeros
      // Q, once the consumers are done with the previous unit's.
      Barrier::wait(&ss.empty_q, (q_iter & 1) ^ 1);
      if (leader) {
        TxBarrier::arrive_and_expect_tx(&ss.full_q, Tr::kBytesQ);
        Tensor gQ = local_tile(domain_offset(make_coord(w.q_start, 0), mQ(_, _, w.h, w.pack)),
                               Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(w.m_block, 0));
        copy(kp.tma_q.with(ss.full_q), tma_q.partition_S(gQ), tQsQ);
      }
      ++q_iter;
      // K[t] then V[t + 1] (the consumers use V one step behind K), from the last tile down to
      // t_begin.
      int t = w.n_tiles - 1;
      Barrier::wait(&ss.empty_k[stage], phase ^ 1);
      load_tile(w, t, stage, cute::false_type{});
      for (; t > w.t_begin; --t) {
        const int stage_v = stage, phase_v = phase;
        advance();
        Barrier::wait(&ss.empty_k[stage], phase ^ 1);
        load_tile(w, t - 1, stage, cute::false_type{});
        Barrier::wait(&ss.empty_v[stage_v], phase_v ^ 1);
        load_tile(w, t, stage_v, cute::true_type{});
      }
      Barrier::wait(&ss.empty_v[stage], phase ^ 1);
      load_tile(w, w.t_begin, stage, cute::true_type{});
      advance();
    }
    return;
  }

  // ------------------------------------------------------------------------------- consumers
  cutlass::arch::warpgroup_reg_alloc<Tr::kConsumerRegs>();
  const int ct = threadIdx.x - 128;  // 0..255
  const int cwg = ct / 128;          // consumer warpgroup: rows [64 * cwg, +64) of the unit
  const int lane = threadIdx.x % 32;
  const bool warp_leader = lane == 0;
  typename Tr::TiledMmaQK mma_qk;
  typename Tr::TiledMmaQKHalf mma_qk_half;
  typename Tr::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(ct);
  auto thr_qk_half = mma_qk_half.get_thread_slice(ct);
  auto thr_pv = mma_pv.get_thread_slice(ct);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // descriptors
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stages)
  Tensor tSrQh = thr_qk_half.partition_fragment_A(sQ);
  Tensor tSrKh = thr_qk_half.partition_fragment_B(  // the first kHalfN rows of each K stage
      local_tile(sK, Shape<Int<Tr::kHalfN>, Int<kHeadDim>, Int<kStages>>{}, make_coord(0, 0, 0)));
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stages)
  // (row, column) of this thread's accumulator elements, the same for S and O row-wise.
  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  constexpr int kNT = kBlockN / 8, kDT = kHeadDim / 8;
  Element* out = static_cast<Element*>(p.out);

  if (cwg == 0) named_arrive(int(FwdBarrier::kSchedWg0), Tr::kConsumerThreads);  // warpgroup 0 issues first
  auto sched_wait = [&] { named_sync(int(FwdBarrier::kSchedWg0) + cwg, Tr::kConsumerThreads); };
  auto sched_pass = [&] { named_arrive(int(FwdBarrier::kSchedWg0) + (1 - cwg), Tr::kConsumerThreads); };
  auto release = [&](uint64_t* bar) { __syncwarp(); if (warp_leader) Barrier::arrive(bar); };
  // Zero V rows [rows, end) of stage s. Both warpgroups write the same zeros (so neither
  // waits for the other), then each fences its writes for wgmma and syncs its own 128 threads.
  auto zero_v_tail = [&](int s, int rows, int end) {
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks of one V row
    for (int idx = ct % 128; idx < (end - rows) * kChunks; idx += 128)
      *reinterpret_cast<uint4*>(&sVt((idx % kChunks) * 8, rows + idx / kChunks, s)) = make_uint4(0, 0, 0, 0);
    cutlass::arch::fence_view_async_shared();
    named_sync(int(FwdBarrier::kZeroWg0) + cwg, 128);
  };

  int stage = 0, phase = 0, q_iter = 0;
  auto advance = [&] { if (++stage == kStages) { stage = 0; phase ^= 1; } };
  for (int r = 0;; ++r) {
    const int u = Tr::Scheduler::unit_of_round(r, kp.num_units);
    if (u < 0) break;
    const Unit w = Tr::Scheduler::decode_unit(p, kp.num_m_blocks, ss.sched, u);
    const int64_t row_base = int64_t(w.m_block) * kBlockM;  // of the sequence
    // This thread's two rows (local rows get<0>(cS(0)) and + 8) and their allowed keys [first,
    // limit) (mask.h, key_range).
    int first[2], limit[2];
    int64_t row_of[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      row_of[rr] = row_base + get<0>(cS(2 * rr));
      const Range keys = row_of[rr] < w.len_q ? key_range(p.mask(), row_of[rr], w.n, w.len_q) : Range{0, 0};
      first[rr] = int(keys.begin);
      limit[rr] = int(keys.end);
    }
    // Row i of the sequence, head h: out row q_start + i of the pack; lse [packs, heads, pack_rows_q].
    Element* out_unit = out + int64_t(w.pack) * p.out_batch_stride + int64_t(w.q_start) * p.out_row_stride +
                        w.h * p.out_head_stride;
    float* lse_unit = p.lse + (int64_t(w.pack) * p.num_heads + w.h) * p.pack_rows_q + w.q_start;
    auto out_row = [&](int rr) { return out_unit + row_of[rr] * p.out_row_stride; };

    if (w.n_tiles == 0) {  // no row of the unit sees a key: zero rows (16-byte stores), lse = -inf (the sink)
      const int chunks = int(p.head_dim_v / 8);
      Element* o = out_unit + row_base * p.out_row_stride;
      for (int idx = ct; idx < w.rows * chunks; idx += Tr::kConsumerThreads)
        *reinterpret_cast<uint4*>(o + (idx / chunks) * p.out_row_stride + (idx % chunks) * 8) = make_uint4(0, 0, 0, 0);
      const float empty_lse = empty_row_lse(p, w.h);  // -inf, or the sink's logit
      for (int r = ct; r < w.rows; r += Tr::kConsumerThreads) lse_unit[row_base + r] = empty_lse;
      continue;
    }

    RowSoftmax<kSoftcap> softmax(p.scale, p.softcap);
    auto masked_out_at = [&](int n0) {  // element i of S: key n0 + its column, row half (i / 2) % 2
      return [&, n0](int i) {
        const int key = n0 + int(get<1>(cS(i)));
        return key >= limit[(i / 2) & 1] || key < first[(i / 2) & 1];
      };
    };
    // Tiles that reach past some row's limit or start before some row's first key are masked.
    auto needs_mask = [&](int n0) { return n0 + kBlockN > w.min_limit || n0 < w.max_first; };
    Tensor tSrS = partition_fragment_C(mma_qk, select<0, 1>(typename Tr::TileQK{}));
    Tensor tOrO = partition_fragment_C(mma_pv, select<0, 1>(typename Tr::TilePV{}));
    static_assert(decltype(size(tSrS))::value == kNT * 4 && decltype(size(tOrO))::value == kDT * 4);
    Tensor tOrP = make_tensor_like<Element>(make_tensor(tSrS.data(), acc_to_a_layout(tSrS.layout())));
    auto convert_p = [&] {  // P = S rounded to Element, element by element in register order
      cutlass::NumericArrayConverter<Element, float, kNT * 4> convert;
      *reinterpret_cast<cutlass::Array<Element, kNT * 4>*>(tOrP.data()) =
          convert(*reinterpret_cast<const cutlass::Array<float, kNT * 4>*>(tSrS.data()));
    };
    float alpha[2];

    Barrier::wait(&ss.full_q, q_iter & 1);
    ++q_iter;
    // The last tile t = n_tiles - 1 first (masked). When it is partial its V rows past key_end
    // are zeroed before its P V. When it holds at most kHalfN keys it runs whole on
    // half-width products, and the next tile starts the overlapped loop instead.
    int t = w.n_tiles - 1;
    const int last_rows = w.key_end - t * kBlockN;  // in (0, kBlockN]
    const bool half = last_rows <= Tr::kHalfN;
    // Short units also take turns for their first and last GEMMs, so that one warpgroup's
    // epilogue runs under the other's GEMMs; long units issue those two at once (measured
    // faster there). Both warpgroups see the same unit, so the turns stay paired.
    const bool edge_turns = w.n_tiles - w.t_begin <= kShortUnitTiles;
    auto edge_wait = [&] { if (edge_turns) sched_wait(); };
    auto edge_pass = [&] { if (edge_turns) sched_pass(); };
    if (half) {
      constexpr int kHalfNT = Tr::kHalfN / 8;
      Tensor tSrSh = partition_fragment_C(mma_qk_half, Shape<Int<kBlockM>, Int<Tr::kHalfN>>{});
      Barrier::wait(&ss.full_k[stage], phase);
      edge_wait();
      wgmma_issue<true>(mma_qk_half, tSrQh, tSrKh(_, _, _, stage), tSrSh);
      edge_pass();
      warpgroup_wait<0>();
      release(&ss.empty_k[stage]);
      softmax.template step<kHalfNT>(tSrSh.data(), true, masked_out_at(t * kBlockN), alpha);
      Tensor tOrPh = make_tensor_like<Element>(make_tensor(tSrSh.data(), acc_to_a_layout(tSrSh.layout())));
      cutlass::NumericArrayConverter<Element, float, kHalfNT * 4> convert;
      *reinterpret_cast<cutlass::Array<Element, kHalfNT * 4>*>(tOrPh.data()) =
          convert(*reinterpret_cast<const cutlass::Array<float, kHalfNT * 4>*>(tSrSh.data()));
      Barrier::wait(&ss.full_v[stage], phase);
      zero_v_tail(stage, last_rows, Tr::kHalfN);
      edge_wait();
      wgmma_issue<true>(mma_pv, tOrPh, tOrV(_, _, _, stage), tOrO);  // the k-blocks of tOrPh only
      edge_pass();
      warpgroup_wait<0>();
      release(&ss.empty_v[stage]);
      advance();
      --t;
    }
    if (!half) clear(tOrO);
    if (t >= w.t_begin) {  // S, softmax and P of tile t; its P V is the loop's (or the final) product
      Barrier::wait(&ss.full_k[stage], phase);
      edge_wait();
      wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, stage), tSrS);
      edge_pass();
      warpgroup_wait<0>();
      release(&ss.empty_k[stage]);
      softmax.template step<kNT>(tSrS.data(), true, masked_out_at(t * kBlockN), alpha);
      rescale_rows<kDT * 4>(tOrO.data(), alpha);
      convert_p();
    }
    for (; t > w.t_begin; --t) {
      // S = Q K[t-1]^T and O += P V[t], issued back to back; the softmax of S runs under PV.
      const int stage_v = stage, phase_v = phase;
      if (t == w.n_tiles - 1 && last_rows < kBlockN && !half) {
        Barrier::wait(&ss.full_v[stage_v], phase_v);
        zero_v_tail(stage_v, last_rows, kBlockN);
      }
      advance();
      Barrier::wait(&ss.full_k[stage], phase);
      sched_wait();
      wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, stage), tSrS);
      Barrier::wait(&ss.full_v[stage_v], phase_v);
      wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, stage_v), tOrO);
      sched_pass();
      warpgroup_wait<1>();
      release(&ss.empty_k[stage]);
      const int n0 = (t - 1) * kBlockN;
      softmax.template step<kNT>(tSrS.data(), needs_mask(n0), masked_out_at(n0), alpha);
      warpgroup_wait<0>();
      release(&ss.empty_v[stage_v]);
      rescale_rows<kDT * 4>(tOrO.data(), alpha);
      convert_p();
    }
    release(&ss.empty_q);  // the last Q K^T of this unit is done: the producer may load the next Q
    if (t == w.t_begin) {  // P V of the first tile
      Barrier::wait(&ss.full_v[stage], phase);
      if (w.n_tiles - w.t_begin == 1 && !half && last_rows < kBlockN) zero_v_tail(stage, last_rows, kBlockN);
      edge_wait();
      wgmma_issue<false>(mma_pv, tOrP, tOrV(_, _, _, stage), tOrO);
      edge_pass();
      warpgroup_wait<0>();
      release(&ss.empty_v[stage]);
      advance();
    }

    // Epilogue: O / l rounded once; a row decides "no allowed key" by its range, never by its
    // sum, so NaN or Inf in real data propagates (SPEC: non-finite real data).
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float sum = softmax.l[rr];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      if (row_of[rr] >= w.len_q) continue;
      const bool any = limit[rr] > first[rr];
      const RowFinish fin =  // core/sinks.h: 1 / l and lse, with the sink in the denominator
          any ? finish_row</*kBase2=*/true>(softmax.m[rr], sum, sink_of(p, w.h)) : RowFinish{0.0f, empty_row_lse(p, w.h)};
      const float inv = fin.inv;
      Element* o = out_row(rr);
#pragma unroll
      for (int j = 0; j < kDT; ++j) {
        const int i = 4 * j + 2 * rr;
        const int col = get<1>(cO(i));
        if (col < p.head_dim_v) {
          cutlass::Array<Element, 2> pair;
          pair[0] = Element(tOrO(i) * inv);
          pair[1] = Element(tOrO(i + 1) * inv);
          *reinterpret_cast<cutlass::Array<Element, 2>*>(o + col) = pair;
        }
      }
      if ((lane & 3) == 0) lse_unit[row_of[rr]] = fin.lse;
    }
  }
}

template <typename Elem, int kHeadDim>
cudaError_t run_fwd_sm90(const AttentionParams& p, cudaStream_t stream) {
  using Element = typename CutlassElem<Elem>::type;
  using Tr = FwdTraits<Element, kHeadDim>;
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
  KernelParams<Tr> kp{
      make_tma_copy(SM90_TMA_LOAD{}, mQ, typename Tr::SmemLayoutQ{}, Shape<Int<Tr::kBlockM>, Int<kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename Tr::SmemLayoutK{}), Shape<Int<Tr::kBlockN>, Int<kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mVt, take<0, 2>(typename Tr::SmemLayoutVt{}), Shape<Int<kHeadDim>, Int<Tr::kBlockN>>{}, _1{}),
      p, 0, 0};
  kp.num_m_blocks = int((p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM);
  const int64_t units = p.batch * p.num_heads * kp.num_m_blocks;
  if (units > INT32_MAX) return cudaErrorInvalidValue;
  kp.num_units = int(units);
  const int grid = kp.num_units < sm_count() ? kp.num_units : sm_count();
  auto kernel = p.softcap > 0.0f ? fwd_sm90_kernel<Tr, true> : fwd_sm90_kernel<Tr, false>;
  constexpr size_t kSmem = sizeof(SharedStorage<Tr>);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem));
  if (err != cudaSuccess) return err;
  kernel<<<grid, Tr::kThreads, kSmem, stream>>>(kp);
  return cudaGetLastError();
}

}  // namespace jax_varlen::cuda::sm90

