// Hopper backward (sm_90a): TMA loads, the five products on wgmma with fp32 accumulators, a
// producer warp, and a deterministic dQ that needs no separate pass and no float atomics.
//
// One CTA = (sequence b, kv head g, key block n of kBlockN = 128 keys), 3 warpgroups (the
// sequences heaviest first, seq_order.cuh):
//   warpgroup 0, warp 0: the producer. K and V of the block land once; then, for every query
//     head h of g's group and every row block m (kBlockM rows: 64 at head-dim bucket 128, 128
//     at 64, limits.h) that sees the block, Q[m]
//     and dO[m] of head h land in a kStages-deep ring on mbarriers.
//   warpgroups 1 and 2: the consumers, 64 keys each. Per step (h, m), with S^T = K Q^T
//     [keys, rows] so that the keys run along the accumulators' rows:
//       S^T = K Q^T and dP^T = V dO^T            (SS wgmma, K-major operands)
//       P^T = exp(S^T - lse), masked; dS^T = P^T (dP^T - delta) (times 1 - t^2 with softcap)
//       dV += P^T dO and dK += dS^T Q            (RS wgmma: P^T, dS^T from registers; Q, dO
//                                                 read MN-major through transposed views)
//       dS^T -> shared memory (stmatrix; as dS, transposed, at 128 rows); dQ_part = dS K
//       (SS; the warpgroups split D at 64 rows, the rows at 128), issued before dK
//       so that each warpgroup's half of dQ_part goes to shared memory, for the dQ writer,
//       while dK runs
//   dK and dV stay in registers for the whole walk and sum over the group's query heads.
//   The producer warp also stages each step's lse (base 2) and delta rows in shared memory;
//   the consumers load them into registers while the step's first products run.
// warpgroup 0, warp 1: the dQ writer (below).
//
// dQ: row block m of head h gets one partial per key block that it sees (n < nvis(m)); they
// are summed in a fixed order, key blocks descending, into dq_accum (fp32) with a counter per
// (b, h, m) in dq_semaphore: the writer of block n waits until the counter reaches
// nvis(m) - 1 - n, bulk-copies each warpgroup's half from shared memory (the first partial) or
// bulk-adds it (cp.reduce.async.bulk, the others) -- one 16 KB op per half, in the order the
// registers hold it --, waits for it to land, and counts itself (a release add). The consumers
// never wait on the counter: they hand the halves over through two shared buffers, so they
// fill one while the writer drains the other. A last
// kernel writes d_q = scale * dq_accum in the input dtype (zero rows where no block sees the
// row block). The order depends only on the lengths, so d_q is bitwise deterministic. Every
// wait is on a block of higher n of the same (b, g), which has a lower blockIdx.x (a pair's key
// blocks are side by side, in reverse, whatever the sequences' order) and so was dispatched earlier: no deadlock whatever the
// residency. Co-resident blocks are mostly one pair's key blocks, so Q, dO and the dq_accum
// tiles they add into are read from L2 (measured: 1.12x on d128-full against a grid with the
// pairs fastest, benchmarks/NOTES.md); the cost is a short ripple along the order at the start.
//
// Padding: keys at or past n_b are never used -- their P and dS are selected to 0, their K rows
// are zeroed in shared memory before dS K (0 * NaN would poison dQ), and their dK and dV rows
// are written as zeros; key blocks wholly past n_b only write those zeros. Query rows past Sq
// land as zeros (TMA) and are masked out.
//
// Both layouts (params.h): TMA sees (rows of a pack, dim, heads, packs), and a sequence's tiles
// start at its first row in the pack (SeqlenInfo). Packed, the rows past a sequence's end are
// the next sequence's (or the unowned tail, which may hold NaN): keys there are treated as
// padding (never written: the sequence owns no key row past its length), and query rows there
// are zeroed in shared memory before the step's products (0 * NaN would poison dK and dV).
// dq_accum holds a sequence's row blocks from slot (q_start + s * kBlockM) / kBlockM of its
// (pack, head) on (s: its index in the pack), so no two sequences share a slot (limits.h).
#pragma once

#include <climits>

#include "cuda/sm90/common.h"
#include "cuda/sm90/seq_order.cuh"

namespace jax_varlen::cuda::sm90 {

template <typename Element_, int kHeadDim_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // bucket of max(D, Dv): 64 or 128
  static constexpr int kBlockM = bwd_block_m(kHeadDim_);  // query rows per step
  static constexpr int kBlockN = kBwdBlockN;  // keys per CTA, 64 per consumer warpgroup
  static constexpr int kStages = 2;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  using SplitM = Layout<Shape<_2, _1, _1>>;  // warpgroups split the keys
  using SplitN = Layout<Shape<_1, _2, _1>>;  // warpgroups split D (dQ)
  // S^T [keys, rows] = K Q^T; dP^T = V dO^T (Dv <= kHeadDim, zero-padded).
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>>(),
      SplitM{}));
  // dV [keys, Dv] += P^T dO; dK [keys, D] += dS^T Q: A from registers, B MN-major.
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      SplitM{}));
  // dQ [rows, D] = dS K, each warpgroup D / 2 columns of 64 rows, or 64 of 128 rows with all of
  // D. K^T is MN-major (K as TMA landed it); dS K-major (keys contiguous) at 128 rows, where
  // it is 13% faster on d64-full than MN-major (rows contiguous), and MN-major at 64 rows,
  // where K-major was 3% slower on d128-full (benchmarks/NOTES.md, session 14).
  static constexpr bool kDqSplitsRows = kBlockM == 128;
  static constexpr bool kDsKMajor = kDqSplitsRows;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockM>, Int<kDqSplitsRows ? kHeadDim : kHeadDim / 2>, Int<kBlockN>>,
                           kDsKMajor ? GMMA::Major::K : GMMA::Major::MN, GMMA::Major::MN>(),
      std::conditional_t<kDqSplitsRows, SplitM, SplitN>{}));
  // lse and delta of a thread's rows go to registers while the step's first products run at 64
  // rows (16 values each); at 128 rows (32 each) they do not fit and are read at use. There
  // the registers also set the order: dV is issued after dS, when S^T's and dP^T's fp32 values
  // are dead, instead of between P and dS.
  static constexpr bool kStatsInRegs = kBlockM == 64;

  template <int kRows, int kCols, int kDepth>
  using KMajor = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kRows>, Int<kCols>>(),
      Shape<Int<kRows>, Int<kCols>, Int<kDepth>>{}));
  // Q and dO [rows, dim] x stages, K and V [keys, dim]: dim contiguous, as TMA lands them.
  // dS x 2 buffers: [rows, keys] keys contiguous (kDsKMajor: a transposing stmatrix turns the
  // accumulator's dS^T around, as FlashAttention-3 does), else dS^T [keys, rows] rows contiguous.
  using SmemLayoutQ = KMajor<kBlockM, kHeadDim, kStages>;
  using SmemLayoutK = KMajor<kBlockN, kHeadDim, 1>;
  // Transposed views of the same bytes: Q^T and dO^T [dim, rows] and K^T [dim, keys] for the
  // MN-major operands; dS [rows, keys] or dS^T [keys, rows], whichever is not the stored one.
  using SmemLayoutQt = decltype(composition(SmemLayoutQ{},
      make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                  Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutKt = decltype(composition(SmemLayoutK{},
      make_layout(Shape<Int<kHeadDim>, Int<kBlockN>, _1>{}, Stride<Int<kBlockN>, _1, Int<kBlockN * kHeadDim>>{})));
  using SmemLayoutdSStored = std::conditional_t<kDsKMajor, KMajor<kBlockM, kBlockN, 2>, KMajor<kBlockN, kBlockM, 2>>;
  using SmemLayoutdS = std::conditional_t<kDsKMajor, SmemLayoutdSStored,
      decltype(composition(SmemLayoutdSStored{}, make_layout(Shape<Int<kBlockM>, Int<kBlockN>, _2>{},
                                                             Stride<Int<kBlockN>, _1, Int<kBlockN * kBlockM>>{})))>;
  using SmemLayoutdSt = std::conditional_t<!kDsKMajor, SmemLayoutdSStored,
      decltype(composition(SmemLayoutdSStored{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>, _2>{},
                                                             Stride<Int<kBlockM>, _1, Int<kBlockN * kBlockM>>{})))>;
  using CopyAtomdS = Copy_Atom<std::conditional_t<kDsKMajor, SM90_U16x8_STSM_T, SM90_U32x4_STSM_N>, Element>;

  using Shape4 = Shape<int32_t, int32_t, int32_t, int32_t>;  // (rows, dim, heads, batch)
  using StrideRows = Stride<int64_t, _1, int64_t, int64_t>;
  template <int kRows>
  using Tma = decltype(make_tma_copy(SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), Shape4{}, StrideRows{}),
      take<0, 2>(KMajor<kRows, kHeadDim, 1>{}), Shape<Int<kRows>, Int<kHeadDim>>{}, _1{}));
  using TmaQ = Tma<kBlockM>;   // Q and dO
  using TmaKV = Tma<kBlockN>;  // K and V

  // dQ partial: each consumer warpgroup's half of the [kBlockM, kHeadDim] tile, in its
  // accumulator's register order: value v of consumer thread t at (v / 4) * 512 + 4 t + v % 4
  // (float4 stores of consecutive threads to consecutive 16 bytes: no bank conflicts). The
  // workspace keeps that order, so one bulk op per half moves it; bwd_sm90_dq_kernel undoes it
  // through the same MMA partition.
  static constexpr int kDqHalf = kBlockM * kHeadDim / 2;  // floats per warpgroup half
  static constexpr uint32_t kBytesDqHalf = kDqHalf * sizeof(float);
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);   // one Q or dO tile
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);  // one K or V tile
};

template <typename Tr>
struct alignas(1024) BwdSharedStorage {
  cute::array_aligned<typename Tr::Element, cosize_v<typename Tr::SmemLayoutQ>, 1024> q;
  cute::array_aligned<typename Tr::Element, cosize_v<typename Tr::SmemLayoutQ>, 1024> d_out;
  cute::array_aligned<typename Tr::Element, cosize_v<typename Tr::SmemLayoutK>, 1024> k;
  cute::array_aligned<typename Tr::Element, cosize_v<typename Tr::SmemLayoutK>, 1024> v;
  cute::array_aligned<typename Tr::Element, cosize_v<typename Tr::SmemLayoutdSStored>, 1024> d_s;
  alignas(128) float d_q[2][2][Tr::kDqHalf];  // dQ partials [buffer][consumer warpgroup's half]
  float lse2[Tr::kStages][Tr::kBlockM];   // lse * log2 e of the step's rows, +inf past Sq
  float delta[Tr::kStages][Tr::kBlockM];  // delta of the step's rows, 0 past Sq
  uint64_t full_kv;                  // K and V landed
  uint64_t full[Tr::kStages];        // Q, dO, lse and delta of a step landed
  uint64_t empty[Tr::kStages];       // the consumers are done with the stage
  uint64_t full_dq[2][2], empty_dq[2][2];  // [buffer][w]: consumer warpgroup w <-> dQ writer
};

template <typename Tr>
struct BwdKernelParams {
  typename Tr::TmaQ tma_q, tma_d_out;
  typename Tr::TmaKV tma_k, tma_v;
  BackwardParams bp;
  int num_m_blocks;  // ceil(seqlen_q / kBlockM)
  int num_n_blocks;  // ceil(seqlen_k / kBlockN)
  int num_slots;     // row-block slots of one (pack, head) in dq_accum (limits.h)
};

// Sequence b of the CTA: where it lies (SeqlenInfo, in 32-bit coordinates of its pack) and its
// steps: row blocks [m_lo, m_hi) of each query head of the group (those with a row that sees a
// key of the block: mask.h, row_range), and the key blocks that row block m sees (mask.h,
// key_range: the dQ order runs over them).
template <int kBlockM>
struct BwdBlock {
  int b, g, n_block;
  int pack, q_start, k_start;  // the pack of b (b padded) and b's first query and key row in it
  int len_q, k_rows;           // b's query rows, and the key rows it owns (padded: Skv)
  int n;                       // valid keys of sequence b, clamped
  int m_lo, m_hi;              // the row blocks that see a key of this block (set by the kernel)
  int m_end;                   // ceil(len_q / M): b's row blocks
  int slot0;                   // dq_accum slot of b's first row block

  __device__ void locate(const AttentionParams& p, int b_) {
    b = b_;
    const SeqlenInfo seq(p, b);
    pack = int(seq.pack);
    q_start = int(seq.q_start);
    k_start = int(seq.k_start);
    len_q = int(seq.seqlen_q);
    k_rows = int(seq.k_rows);
    n = int(seq.seqlen_k);
    m_end = (len_q + kBlockM - 1) / kBlockM;
    slot0 = int((seq.q_start + (b - seq.pack * p.pack_seqs) * kBlockM) / kBlockM);
  }
  // Key blocks [lo, hi) that row block m (< m_end) sees: those holding a key of the union of
  // its rows' ranges, which is contiguous (a row with no key lies before or after the others)
  // -- exactly the blocks whose CTA visits m (row_range is exact). Empty: hi <= lo.
  __device__ int2 key_blocks(const AttentionParams& p, int m) const {
    const int last = m * kBlockM + kBlockM - 1;
    const Range keys = key_range(p.mask(), m * kBlockM, last < len_q ? last + 1 : len_q, n, len_q);
    if (keys.empty()) return make_int2(0, 0);
    return make_int2(int(keys.begin / kBwdBlockN), int((keys.end + kBwdBlockN - 1) / kBwdBlockN));
  }
  // Element offset of (head h, row i of b) in lse and delta: [packs, heads, pack_rows_q].
  __device__ int64_t lse_index(const AttentionParams& p, int h, int i) const {
    return (int64_t(pack) * p.num_heads + h) * p.pack_rows_q + q_start + i;
  }
  // (pack, head h, slot of row block m): the tile and counter of dq_accum and dq_semaphore.
  __device__ int64_t dq_unit(const AttentionParams& p, int num_slots, int h, int m) const {
    return (int64_t(pack) * p.num_heads + h) * num_slots + slot0 + m;
  }
};

__device__ __forceinline__ int load_acquire(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

constexpr int kBwdPairBarrier = 1;  // both consumer warpgroups: K tail zeroed, dS^T written
constexpr int kBwdOwnBarrier = 2;   // + w: consumer warpgroup w alone (Q and dO tails zeroed)

template <typename Tr, bool kSoftcap>
__global__ void __launch_bounds__(Tr::kThreads, 1) bwd_sm90_kernel(const __grid_constant__ BwdKernelParams<Tr> kp) {
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim, kStages = Tr::kStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ss = *reinterpret_cast<BwdSharedStorage<Tr>*>(smem_raw);
  const BackwardParams& bp = kp.bp;
  const AttentionParams& p = bp.fwd;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

  BwdBlock<kBlockM> blk;
  {  // blockIdx.x = (rank * kv_num_heads + g) * num_n_blocks + num_n_blocks - 1 - n, sequence
     // b = seq_order[rank] (heaviest first, seq_order.cuh): the key blocks of one (b, g) pair
     // side by side, descending, so that co-resident blocks share Q, dO and dq_accum tiles in L2
    const int pair = int(blockIdx.x) / kp.num_n_blocks;
    blk.n_block = kp.num_n_blocks - 1 - int(blockIdx.x) % kp.num_n_blocks;
    blk.g = pair % int(p.kv_num_heads);
    blk.locate(p, bp.seq_order[pair / int(p.kv_num_heads)]);
  }
  const int key0 = blk.n_block * kBlockN;
  {  // the rows that see a key of this block (mask.h; none for a block past n_b)
    const Range rows = row_range(p.mask(), key0, key0 + kBlockN, blk.n, blk.len_q);
    blk.m_lo = rows.empty() ? 0 : int(rows.begin / kBlockM);
    blk.m_hi = rows.empty() ? 0 : int((rows.end + kBlockM - 1) / kBlockM);
  }
  const int group = int(p.num_heads / p.kv_num_heads);
  const int h0 = blk.g * group;
  Element* d_k = static_cast<Element*>(bp.d_k) + int64_t(blk.pack) * p.k_batch_stride +
                 int64_t(blk.k_start) * p.k_row_stride + blk.g * p.k_head_stride;
  Element* d_v = static_cast<Element*>(bp.d_v) + int64_t(blk.pack) * p.v_batch_stride +
                 int64_t(blk.k_start) * p.v_row_stride + blk.g * p.v_head_stride;
  if (key0 >= blk.n || blk.m_lo >= blk.m_hi) {  // a block wholly past n_b (its rows of Skv; none
                                                 // packed) or that no row sees: zero gradients
    const int rows = blk.k_rows - key0 < kBlockN ? blk.k_rows - key0 : kBlockN;
    const int ck = int(p.head_dim / 8), cv = int(p.head_dim_v / 8);
    for (int idx = threadIdx.x; idx < rows * (ck + cv); idx += Tr::kThreads) {
      const int r = idx / (ck + cv), c = idx % (ck + cv);
      Element* dst = c < ck ? d_k + (key0 + r) * p.k_row_stride + c * 8
                            : d_v + (key0 + r) * p.v_row_stride + (c - ck) * 8;
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
    return;
  }

  if (threadIdx.x == 0) {
    Barrier::init(&ss.full_kv, 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&ss.full[s], 1);
      Barrier::init(&ss.empty[s], Tr::kConsumerWarps);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      Barrier::init(&ss.full_dq[i / 2][i % 2], Tr::kConsumerWarps / 2);
      Barrier::init(&ss.empty_dq[i / 2][i % 2], 1);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.d_out.data()), typename Tr::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutK{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.d_s.data()), typename Tr::SmemLayoutdSt{});

  if (threadIdx.x < 128) {  // ---------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Tr::kProducerRegs>();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 1) {  // the dQ writer
      int step = 0;
      for (int h = h0; h < h0 + group; ++h)
        for (int m = blk.m_lo; m < blk.m_hi; ++m, ++step) {
          const int buf = step & 1, phase_dq = (step >> 1) & 1;
          const int rank = blk.key_blocks(p, m).y - 1 - blk.n_block;  // >= 0
          const int64_t unit = blk.dq_unit(p, kp.num_slots, h, m);
          int* sem = bp.dq_semaphore + unit;
          float* acc = bp.dq_accum + unit * (kBlockM * kHeadDim);
          // The halves in warpgroup order, each once its warpgroup handed it over; the first
          // waits for the block ahead in the order.
#pragma unroll
          for (int w = 0; w < 2; ++w) {
            Barrier::wait(&ss.full_dq[buf][w], phase_dq);
            if (w == 0) {
              if (lane == 0 && rank > 0)
                while (load_acquire(sem) < rank) {
                }
              __syncwarp();
              asm volatile("fence.proxy.async.global;" ::: "memory");
            }
            if (lane == 0) {
              const uint32_t src = cute::cast_smem_ptr_to_uint(ss.d_q[buf][w]);
              float* dst = acc + w * Tr::kDqHalf;
              if (rank == 0)
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                             :: "l"(dst), "r"(src), "r"(Tr::kBytesDqHalf) : "memory");
              else
                asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                             :: "l"(dst), "r"(src), "r"(Tr::kBytesDqHalf) : "memory");
              asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            }
          }
          if (lane == 0) {
            // Both halves read: the consumers may refill the buffer (they write the other one
            // meanwhile). Then landed: the next block in the order may add (release).
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            Barrier::arrive(&ss.empty_dq[buf][0]);
            Barrier::arrive(&ss.empty_dq[buf][1]);
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
            asm volatile("fence.proxy.async.global;" ::: "memory");
            asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(sem) : "memory");
          }
          __syncwarp();
        }
      return;
    }
    if (warp != 0) return;
    const bool leader = lane == 0;
    const int rows_q = int(p.pack_rows_q), rows_k = int(p.pack_rows_k), packs = int(p.num_packs);
    Tensor mQ = kp.tma_q.get_tma_tensor(make_shape(rows_q, int(p.head_dim), int(p.num_heads), packs));
    Tensor mdO = kp.tma_d_out.get_tma_tensor(make_shape(rows_q, int(p.head_dim_v), int(p.num_heads), packs));
    Tensor mK = kp.tma_k.get_tma_tensor(make_shape(rows_k, int(p.head_dim), int(p.kv_num_heads), packs));
    Tensor mV = kp.tma_v.get_tma_tensor(make_shape(rows_k, int(p.head_dim_v), int(p.kv_num_heads), packs));
    auto at_q = [&](auto m) { return domain_offset(make_coord(blk.q_start, 0), m); };  // b's rows
    auto at_k = [&](auto m) { return domain_offset(make_coord(blk.k_start, 0), m); };
    auto tma_q = kp.tma_q.get_slice(0);
    auto tma_do = kp.tma_d_out.get_slice(0);
    auto tma_k = kp.tma_k.get_slice(0);
    auto tma_v = kp.tma_v.get_slice(0);
    using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
    if (leader) {
      TxBarrier::arrive_and_expect_tx(&ss.full_kv, 2 * Tr::kBytesKV);
      copy(kp.tma_k.with(ss.full_kv),
           tma_k.partition_S(local_tile(at_k(mK(_, _, blk.g, blk.pack)), TileKV{}, make_coord(blk.n_block, 0))),
           tma_k.partition_D(sK(_, _, 0)));
      copy(kp.tma_v.with(ss.full_kv),
           tma_v.partition_S(local_tile(at_k(mV(_, _, blk.g, blk.pack)), TileKV{}, make_coord(blk.n_block, 0))),
           tma_v.partition_D(sV(_, _, 0)));
    }
    using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
    const float kLog2e = 1.4426950408889634f;
    int stage = 0, phase = 0;
    for (int h = h0; h < h0 + group; ++h) {
      const int64_t rows_h = blk.lse_index(p, h, 0);
      for (int m = blk.m_lo; m < blk.m_hi; ++m) {
        Barrier::wait(&ss.empty[stage], phase ^ 1);
#pragma unroll
        for (int r = lane; r < kBlockM; r += 32) {
          const int row = m * kBlockM + r;
          const bool real = row < blk.len_q;
          ss.lse2[stage][r] = real ? p.lse[rows_h + row] * kLog2e : INFINITY;
          ss.delta[stage][r] = real ? bp.delta[rows_h + row] : 0.0f;
        }
        __syncwarp();
        if (leader) {
          TxBarrier::arrive_and_expect_tx(&ss.full[stage], 2 * Tr::kBytesQ);
          copy(kp.tma_q.with(ss.full[stage]),
               tma_q.partition_S(local_tile(at_q(mQ(_, _, h, blk.pack)), TileQ{}, make_coord(m, 0))),
               tma_q.partition_D(sQ(_, _, stage)));
          copy(kp.tma_d_out.with(ss.full[stage]),
               tma_do.partition_S(local_tile(at_q(mdO(_, _, h, blk.pack)), TileQ{}, make_coord(m, 0))),
               tma_do.partition_D(sdO(_, _, stage)));
        }
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      }
    }
    return;
  }

  // ------------------------------------------------------------------------------- consumers
  cutlass::arch::warpgroup_reg_alloc<Tr::kConsumerRegs>();
  const int ct = threadIdx.x - 128;  // 0..255: warpgroup ct / 128 owns keys [64 * (ct / 128), +64)
                                   // of the block and dQ columns [D / 2 * (ct / 128), +D / 2)
  const int lane = threadIdx.x % 32;
  const int wg = ct / 128;
  typename Tr::TiledMmaSdP mma_sdp;
  typename Tr::TiledMmadKV mma_dkv;
  typename Tr::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(ct);
  auto thr_dkv = mma_dkv.get_thread_slice(ct);
  auto thr_dq = mma_dq.get_thread_slice(ct);
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.d_out.data()), typename Tr::SmemLayoutQt{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.d_s.data()), typename Tr::SmemLayoutdS{});
  Tensor tSrK = thr_sdp.partition_fragment_A(sK(_, _, 0));
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);     // (MMA, N, K, stages)
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV(_, _, 0));
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, N, K, stages)
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);     // (MMA, M, K, buffers)
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKt(_, _, 0));
  // dS^T to shared memory by stmatrix: 8x8 tiles of the accumulator (transposed if kDsKMajor).
  auto copy_ds = make_tiled_copy_C(typename Tr::CopyAtomdS{}, mma_sdp);
  auto thr_copy_ds = copy_ds.get_thread_slice(ct);
  Tensor tdSsdS = thr_copy_ds.partition_D(sdSt);  // (copy, keys, rows, buffers)
  // (key, row) of this thread's S^T elements and (key, column) of its dK/dV elements.
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
  Tensor cKV = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(tdVrdV);
  clear(tdKrdK);
  constexpr int kS = decltype(size(cS))::value;  // 32 elements of S^T per thread
  const float kLog2e = 1.4426950408889634f;
  // z = s * scale * log2 e, or softcap * log2 e * tanh(s * scale / softcap) (base 2 exponents).
  const float z_scale = kSoftcap ? p.scale / p.softcap : p.scale * kLog2e;
  const float z_cap = p.softcap * kLog2e;
  auto release = [&](uint64_t* bar) { __syncwarp(); if (lane == 0) Barrier::arrive(bar); };

  Barrier::wait(&ss.full_kv, 0);
  if (key0 + kBlockN > blk.n) {  // zero K rows past n_b: dS K must not meet padding
    const int rows = blk.n - key0;
    constexpr int kChunks = kHeadDim / 8;
    for (int idx = ct; idx < (kBlockN - rows) * kChunks; idx += Tr::kConsumerThreads)
      *reinterpret_cast<uint4*>(&sK(rows + idx / kChunks, (idx % kChunks) * 8, 0)) = make_uint4(0, 0, 0, 0);
    cutlass::arch::fence_view_async_shared();
    named_sync(kBwdPairBarrier, Tr::kConsumerThreads);
  }

  // Packed: Q and dO rows [rows, kBlockM) of stage s hold another sequence's rows (or NaN of the
  // unowned tail): zeros before the products. Both warpgroups write the same zeros (so neither
  // waits for the other), then each fences its writes for wgmma and syncs its own 128 threads.
  const bool packed = p.cu_seqlens_q != nullptr;
  auto zero_q_tail = [&](int s, int rows) {
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks of one row
    for (int idx = ct % 128; idx < (kBlockM - rows) * kChunks; idx += 128) {
      const int r = rows + idx / kChunks, c = (idx % kChunks) * 8;
      *reinterpret_cast<uint4*>(&sQ(r, c, s)) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(&sdO(r, c, s)) = make_uint4(0, 0, 0, 0);
    }
    cutlass::arch::fence_view_async_shared();
    named_sync(kBwdOwnBarrier + wg, 128);
  };

  // An allowed pair of a real row i and a real key j has lo_off <= j - i <= hi_off (mask.h, at
  // position p = i + shift: j <= p causal, p - left <= j <= p + right), in 32 bits.
  const MaskSpec mask = p.mask();
  const int64_t shift = blk.n - blk.len_q;
  int64_t hi64 = INT_MAX, lo64 = INT_MIN;
  if (mask.causal) hi64 = shift;
  if (mask.right >= 0 && shift + mask.right < hi64) hi64 = shift + mask.right;
  if (mask.left >= 0) lo64 = shift - mask.left;
  const int hi_off = int(hi64 < INT_MIN ? INT_MIN : hi64);
  const int lo_off = int(lo64 < INT_MIN ? INT_MIN : (lo64 > INT_MAX ? INT_MAX : lo64));
  int stage = 0, phase = 0, step = 0;
  for (int h = h0; h < h0 + group; ++h) {
    for (int m = blk.m_lo; m < blk.m_hi; ++m, ++step) {
      const int row0 = m * kBlockM;
      const int buf = step & 1;  // of dS^T and of the dQ partial
      Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      Barrier::wait(&ss.full[stage], phase);
      if (packed && row0 + kBlockM > blk.len_q) zero_q_tail(stage, blk.len_q - row0);
      wgmma_issue<true>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
      wgmma_issue<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), tdPrdP);
      // Masking: needed unless every row of the block is real and sees every key of this block
      // (both bounds of a row's keys grow with the row: the first row's end, the last's begin).
      const bool masked = row0 + kBlockM > blk.len_q || key_range(mask, row0, blk.n, blk.len_q).end < key0 + kBlockN ||
                          key_range(mask, row0 + kBlockM - 1, blk.n, blk.len_q).begin > key0;
      // The rows' lse into registers while the products run (from shared memory after the
      // wait, their latency stalled every warp: 8% of the samples, benchmarks/NOTES.md).
      // Element i = c + 2 h + 4 j of the accumulator (column pair c, row half h, 8-column group
      // j: common.h) is at row get<1>(cS(4 j)) + c, so one 8-byte load per j serves four.
      constexpr bool kInRegs = Tr::kStatsInRegs;
      float2 lse2[kInRegs ? kS / 4 : 1], delta[kInRegs ? kS / 4 : 1];
      auto stat = [&](const float2 (&v)[kInRegs ? kS / 4 : 1], const float* row, int i) {
        if constexpr (kInRegs) return i % 2 == 0 ? v[i / 4].x : v[i / 4].y;
        else return row[get<1>(cS(i))];
      };
      if constexpr (kInRegs) {
#pragma unroll
        for (int j = 0; j < kS / 4; ++j) lse2[j] = *reinterpret_cast<const float2*>(&ss.lse2[stage][get<1>(cS(4 * j))]);
      }
      warpgroup_wait<1>();
      // P^T in place of S^T (with softcap, t = tanh(s / softcap) kept for dS).
      float tanh_t[kSoftcap ? kS : 1];
#pragma unroll
      for (int i = 0; i < kS; ++i) {
        const int row = row0 + int(get<1>(cS(i)));
        float z = tSrS(i) * z_scale;
        if constexpr (kSoftcap) {
          tanh_t[i] = tanhf(z);
          z = z_cap * tanh_t[i];
        }
        float prob = ex2_approx(z - stat(lse2, ss.lse2[stage], i));
        if (masked) {  // key_allowed() in 32 bits: real row, real key, inside [lo_off, hi_off]
          const int key = key0 + int(get<0>(cS(i)));
          if (row >= blk.len_q || key >= blk.n || key - row > hi_off || key - row < lo_off) prob = 0.0f;
        }
        tSrS(i) = prob;
      }
      Tensor tdVrP = make_tensor_like<Element>(make_tensor(tSrS.data(), acc_to_a_layout(tSrS.layout())));
      auto issue_dv = [&] {  // P^T to Element, then dV += P^T dO
        cutlass::NumericArrayConverter<Element, float, kS> convert;
        *reinterpret_cast<cutlass::Array<Element, kS>*>(tdVrP.data()) =
            convert(*reinterpret_cast<const cutlass::Array<float, kS>*>(tSrS.data()));
        wgmma_issue<false>(mma_dkv, tdVrP, tdVrdOt(_, _, _, stage), tdVrdV);
      };
      if constexpr (kInRegs) {
        issue_dv();
#pragma unroll
        for (int j = 0; j < kS / 4; ++j) delta[j] = *reinterpret_cast<const float2*>(&ss.delta[stage][get<1>(cS(4 * j))]);
        warpgroup_wait<1>();  // dP^T (dV in flight)
      } else {
        warpgroup_wait<0>();  // dP^T
      }
      // dS^T in place of dP^T; exactly 0 wherever P is (masked keys, padding, rows past Sq):
      // there dP^T may be NaN (V rows past n_b), so a masked step selects. In the others every
      // key and row of the block is real, dP^T finite, and 0 * dP^T is 0 anyway (with softcap
      // the select stays: a second copy of the loop costs registers there).
      auto ds_of = [&](int i) {
        float ds = tSrS(i) * (tdPrdP(i) - stat(delta, ss.delta[stage], i));
        if constexpr (kSoftcap) ds *= 1.0f - tanh_t[i] * tanh_t[i];
        return ds;
      };
      if (kSoftcap || masked) {
#pragma unroll
        for (int i = 0; i < kS; ++i) tdPrdP(i) = tSrS(i) == 0.0f ? 0.0f : ds_of(i);
      } else {
#pragma unroll
        for (int i = 0; i < kS; ++i) tdPrdP(i) = ds_of(i);
      }
      if constexpr (!kInRegs) issue_dv();
      Tensor rdS = make_tensor_like<Element>(tdPrdP);  // dS^T in the accumulator's layout
      {
        cutlass::NumericArrayConverter<Element, float, kS> convert;
        *reinterpret_cast<cutlass::Array<Element, kS>*>(rdS.data()) =
            convert(*reinterpret_cast<const cutlass::Array<float, kS>*>(tdPrdP.data()));
      }
      Tensor tdKrdS = make_tensor(rdS.data(), acc_to_a_layout(tdPrdP.layout()));
      // dS^T to shared memory (buffer `buf`) for dQ of the row block from both halves; dQ is
      // issued before dK so that its partial goes out while dK runs.
      copy(copy_ds, thr_copy_ds.retile_S(rdS), tdSsdS(_, _, _, buf));
      cutlass::arch::fence_view_async_shared();
      named_sync(kBwdPairBarrier, Tr::kConsumerThreads);
      Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      wgmma_issue<true>(mma_dq, tdQrdS(_, _, _, buf), tdQrKt, tdQrdQ);
      wgmma_issue<false>(mma_dkv, tdKrdS, tdKrQt(_, _, _, stage), tdKrdK);
      warpgroup_wait<1>();  // dQ (dK in flight)
      warpgroup_fence_operand(tdQrdQ);
      // The dQ partial to this warpgroup's half of buffer `buf`, once the writer has read what
      // it held two steps ago.
      Barrier::wait(&ss.empty_dq[buf][wg], ((step >> 1) & 1) ^ 1);
      {
        constexpr int kQ = decltype(size(tdQrdQ))::value;  // kDqHalf / 128
        float* dst = ss.d_q[buf][wg] + 4 * (ct % 128);
#pragma unroll
        for (int i = 0; i < kQ; i += 4)
          *reinterpret_cast<float4*>(dst + i * 128) = make_float4(tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2), tdQrdQ(i + 3));
      }
      cutlass::arch::fence_view_async_shared();
      release(&ss.full_dq[buf][wg]);
      warpgroup_wait<0>();  // dK
      warpgroup_fence_operand(tdKrdK);
      warpgroup_fence_operand(tdKrdS);  // its registers stay live until dK has read them
      release(&ss.empty[stage]);
      if (++stage == kStages) { stage = 0; phase ^= 1; }
    }
  }

  // Epilogue: dK (scaled) and dV of the block's keys, zeros past n_b.
  constexpr int kKV = decltype(size(cKV))::value;
#pragma unroll
  for (int i = 0; i < kKV; i += 2) {
    const int key = key0 + int(get<0>(cKV(i))), c = int(get<1>(cKV(i)));
    if (key >= blk.k_rows) continue;
    const bool real = key < blk.n;
    if (c < p.head_dim) {
      cutlass::Array<Element, 2> pair;
      pair[0] = Element(real ? tdKrdK(i) * p.scale : 0.0f);
      pair[1] = Element(real ? tdKrdK(i + 1) * p.scale : 0.0f);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(d_k + key * p.k_row_stride + c) = pair;
    }
    if (c < p.head_dim_v) {
      cutlass::Array<Element, 2> pair;
      pair[0] = Element(real ? tdVrdV(i) : 0.0f);
      pair[1] = Element(real ? tdVrdV(i + 1) : 0.0f);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(d_v + key * p.v_row_stride + c) = pair;
    }
  }
}

// d_q [b, i, h, :D] = scale * dq_accum of (b, h, row block of i), zero where no key block sees
// that row block. One CTA per (b, h, row block < ceil(seqlen_q / kBlockM)), nothing to do past
// the sequence's own row blocks; its 256 threads laid out as the consumers: thread t reads the
// values it wrote in the main kernel (coalesced float4s in register order), finds their (row,
// column) through the same MMA partition and puts them, scaled and converted, in a shared
// [kBlockM, kHeadDim] tile; then the tile goes out in 16-byte row chunks (a 4-byte store per
// value pair wrote each 32-byte sector half: 0.72 ms of the 12.5 ms backward on d128-full).
template <typename Tr>
__global__ void __launch_bounds__(Tr::kConsumerThreads) bwd_sm90_dq_kernel(const __grid_constant__ BackwardParams bp,
                                                                          int num_m_blocks, int num_slots) {
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM, kHeadDim = Tr::kHeadDim;
  constexpr int kPitch = kHeadDim + 8;  // elements per shared row: the 8 rows of a store phase on distinct banks
  __shared__ alignas(16) Element tile[kBlockM * kPitch];
  const AttentionParams& p = bp.fwd;
  const int64_t unit = blockIdx.x;  // (b, h, m)
  const int m = int(unit % num_m_blocks);
  const int h = int(unit / num_m_blocks % p.num_heads);
  const int b = int(unit / num_m_blocks / p.num_heads);
  const int ct = threadIdx.x;
  typename Tr::TiledMmadQ mma_dq;
  Tensor cQ = mma_dq.get_thread_slice(ct).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  constexpr int kQ = decltype(size(cQ))::value;
  BwdBlock<kBlockM> blk{};
  blk.locate(p, b);
  if (m >= blk.m_end) return;
  const int2 seen_blocks = blk.key_blocks(p, m);
  const bool seen = seen_blocks.y > seen_blocks.x;
  const float* src = bp.dq_accum + blk.dq_unit(p, num_slots, h, m) * (kBlockM * kHeadDim) +
                     (ct / 128) * Tr::kDqHalf + 4 * (ct % 128);
#pragma unroll
  for (int i = 0; i < kQ; i += 4) {
    const float4 v = seen ? __ldcs(reinterpret_cast<const float4*>(src + i * 128)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float vals[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j += 2) {  // values i + j and i + j + 1: adjacent columns of one row
      cutlass::Array<Element, 2> pair;
      pair[0] = Element(vals[j] * p.scale);
      pair[1] = Element(vals[j + 1] * p.scale);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(&tile[int(get<0>(cQ(i + j))) * kPitch + int(get<1>(cQ(i + j)))]) = pair;
    }
  }
  __syncthreads();
  const int64_t row0 = int64_t(m) * kBlockM;
  const int rows = blk.len_q - row0 < kBlockM ? int(blk.len_q - row0) : kBlockM;
  Element* d_q = static_cast<Element*>(bp.d_q) + int64_t(blk.pack) * p.q_batch_stride +
                 (blk.q_start + row0) * p.q_row_stride + h * p.q_head_stride;
  // 16-byte chunks of a tile row: the path's conditions (dispatch.cu: D a multiple of 8, strides
  // of whole chunks, d_q 16-byte aligned) make every chunk whole.
  constexpr int kChunks = kHeadDim / 8;
  for (int idx = ct; idx < rows * kChunks; idx += Tr::kConsumerThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    if (c < p.head_dim)
      *reinterpret_cast<uint4*>(d_q + r * p.q_row_stride + c) = *reinterpret_cast<const uint4*>(&tile[r * kPitch + c]);
  }
}

template <typename Elem, int kHeadDim>
cudaError_t run_bwd_sm90(const BackwardParams& bp, cudaStream_t stream) {
  using Element = typename CutlassElem<Elem>::type;
  using Tr = BwdTraits<Element, kHeadDim>;
  const AttentionParams& p = bp.fwd;
  auto view = [](const void* ptr, int64_t rows, int64_t dim, int64_t heads, int64_t batch, int64_t row_stride,
                 int64_t head_stride, int64_t batch_stride) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                       make_shape(int(rows), int(dim), int(heads), int(batch)),
                       make_stride(row_stride, _1{}, head_stride, batch_stride));
  };
  // [packs, pack rows, heads, dim] (plan/plan.h: pack rows >= 1, TMA strides).
  auto mQ = view(p.q, p.pack_rows_q, p.head_dim, p.num_heads, p.num_packs, p.q_row_stride, p.q_head_stride,
                 p.q_batch_stride);
  auto mdO = view(bp.d_out, p.pack_rows_q, p.head_dim_v, p.num_heads, p.num_packs, p.out_row_stride,
                  p.out_head_stride, p.out_batch_stride);
  auto mK = view(p.k, p.pack_rows_k, p.head_dim, p.kv_num_heads, p.num_packs, p.k_row_stride, p.k_head_stride,
                 p.k_batch_stride);
  auto mV = view(p.v, p.pack_rows_k, p.head_dim_v, p.kv_num_heads, p.num_packs, p.v_row_stride, p.v_head_stride,
                 p.v_batch_stride);
  using LQ = decltype(take<0, 2>(typename Tr::SmemLayoutQ{}));
  using LK = decltype(take<0, 2>(typename Tr::SmemLayoutK{}));
  using TileQ = Shape<Int<Tr::kBlockM>, Int<kHeadDim>>;
  using TileK = Shape<Int<Tr::kBlockN>, Int<kHeadDim>>;
  BwdKernelParams<Tr> kp{make_tma_copy(SM90_TMA_LOAD{}, mQ, LQ{}, TileQ{}, _1{}),
                         make_tma_copy(SM90_TMA_LOAD{}, mdO, LQ{}, TileQ{}, _1{}),
                         make_tma_copy(SM90_TMA_LOAD{}, mK, LK{}, TileK{}, _1{}),
                         make_tma_copy(SM90_TMA_LOAD{}, mV, LK{}, TileK{}, _1{}),
                         bp, int((p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM),
                         int((p.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN),
                         int(bwd_dq_slots(p.pack_rows_q, p.pack_seqs, Tr::kBlockM))};
  const size_t sems = size_t(p.num_packs * p.num_heads * kp.num_slots) * sizeof(int);
  cudaError_t err = cudaMemsetAsync(bp.dq_semaphore, 0, sems, stream);
  if (err != cudaSuccess) return err;
  err = run_bwd_seq_order(p, bp.seq_order, stream);
  if (err != cudaSuccess) return err;
  auto kernel = p.softcap > 0.0f ? bwd_sm90_kernel<Tr, true> : bwd_sm90_kernel<Tr, false>;
  constexpr size_t kSmem = sizeof(BwdSharedStorage<Tr>);
  static_assert(kSmem <= 232448, "the backward's shared memory exceeds sm_90's 227 KB");
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem));
  if (err != cudaSuccess) return err;
  const dim3 grid(unsigned(kp.num_n_blocks * p.batch * p.kv_num_heads));
  kernel<<<grid, Tr::kThreads, kSmem, stream>>>(kp);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t units = p.batch * p.num_heads * kp.num_m_blocks;
  bwd_sm90_dq_kernel<Tr><<<unsigned(units), Tr::kConsumerThreads, 0, stream>>>(bp, kp.num_m_blocks, kp.num_slots);
  return cudaGetLastError();
}

}  // namespace jax_varlen::cuda::sm90
