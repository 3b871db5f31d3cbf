// Types of the Hopper backward (bwd_sm90.cuh): its traits (tiles, MMAs, shared-memory layouts,
// TMA), shared storage and kernel parameters; the key block a CTA owns (BwdBlock: its sequence,
// the row blocks that see it, where its dQ partials go); the named barriers and warp roles.
#pragma once

#include "cuda/sm90/common.h"
#include "cuda/sm90/tile_scheduler.h"

namespace jax_varlen::cuda::sm90 {

template <typename Element_, int kHeadDim_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;  // bucket of max(D, Dv): 64, 128 or 256
  // kWide (bucket 256, bwd_mma_wide.h): dK and dV of 128 keys would not fit the consumers'
  // registers, so a CTA owns 64 keys, one warpgroup computes S^T and the other dP^T, and both
  // split the head dim of dK, dV and dQ. There the consumers add their dQ partials to the
  // workspace from registers, in the order the writer warp gives them (bwd_dq.h), instead of
  // staging them in shared memory for its bulk adds: the 64 KB the staging would take hold Q
  // and dO's second stage, and a step moves 128 KB less through shared memory.
  static constexpr bool kWide = kHeadDim_ > 128;
  static constexpr int kBlockM = bwd_block_m(kHeadDim_);  // query rows per step
  static constexpr int kBlockN = bwd_block_n(kHeadDim_);  // keys per CTA (64 per warpgroup unless kWide)
  static constexpr int kStages = 2;
  static constexpr bool kDqStaged = !kWide;  // dQ partials go through shared memory to the writer
  static constexpr int kDqBuffers = 2;       // kDqStaged: dQ partial buffers between consumers and writer
  static constexpr int kConsumerThreads = 2 * kWarpgroupThreads;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kThreads = kWarpgroupThreads + kConsumerThreads;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(kWarpgroupThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= register_pool(kThreads),
                "setmaxnreg past the launch's registers deadlocks (common.h, register_pool)");
  // The key-block list, one unit per CTA (tile_scheduler.h), ranked before the launch.
  using Scheduler = TileScheduler<kBlockM, kBlockN, /*kMaxSortedBatch=*/0, kThreads>;

  using SplitM = Layout<Shape<_2, _1, _1>>;  // warpgroups split the keys
  using SplitN = Layout<Shape<_1, _2, _1>>;  // warpgroups split D (dQ; dK and dV if kWide)
  using OneWg = Layout<Shape<_1, _1, _1>>;   // one warpgroup's tile (kWide: S^T or dP^T)
  // S^T [keys, rows] = K Q^T; dP^T = V dO^T (Dv <= kHeadDim, zero-padded).
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>>(),
      std::conditional_t<kWide, OneWg, SplitM>{}));
  // dV [keys, Dv] += P^T dO; dK [keys, D] += dS^T Q, B MN-major: A from registers, or (kWide)
  // from shared memory, where the other warpgroup's half of the head dim reads it too.
  using TiledMmadKV = std::conditional_t<kWide,
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kHeadDim / 2>, Int<kBlockM>>,
                               GMMA::Major::K, GMMA::Major::MN>(),
          SplitN{})),
      decltype(make_tiled_mma(
          GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>,
                               GMMA::Major::K, GMMA::Major::MN>(),
          SplitM{}))>;
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
  // kWide keeps P^T in buffer 0 and dS^T in buffer 1 (one step's each: the wgmma A operands of
  // dV and dK, and of dQ as dS, for both warpgroups).
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
  // dQ partials [buffer][consumer warpgroup's half] (kDqStaged; else one unused float4 each)
  alignas(128) float d_q[Tr::kDqBuffers][2][Tr::kDqStaged ? Tr::kDqHalf : 4];
  float lse2[Tr::kStages][Tr::kBlockM];   // lse * log2 e of the step's rows, +inf past Sq
  float delta[Tr::kStages][Tr::kBlockM];  // delta of the step's rows, 0 past Sq
  uint64_t full_kv;                  // K and V landed
  uint64_t full[Tr::kStages];        // Q, dO, lse and delta of a step landed
  uint64_t empty[Tr::kStages];       // the consumers are done with the stage
  uint64_t full_dq[Tr::kDqBuffers][2], empty_dq[Tr::kDqBuffers][2];  // [buffer][w]: consumer warpgroup w <-> dQ writer
  // kWide: the S^T warpgroup's P (times 1 - tanh^2 with softcap) for the dP^T warpgroup's dS, fp32
  // in the accumulators' register order (value v of thread t at (v / 4) * 512 + 4 t + v % 4).
  // Last, so that it moves nothing else where it is unused.
  alignas(16) float p_mul[Tr::kWide ? Tr::kBlockN * Tr::kBlockM : 4];
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

// Key block n_block of kv head g of sequence b, the CTA's: where b lies (SeqlenInfo, in 32-bit
// coordinates of its pack) and the block's steps: row blocks [m_lo, m_hi) of each query head of
// the group (those with a row that sees a key of the block: mask.h, row_range), and the key
// blocks that row block m sees (mask.h, key_range: the dQ order runs over them).
template <int kBlockM, int kBlockN>
struct BwdBlock {
  int b, g, n_block;
  int pack, q_start, k_start;  // the pack of b (b padded) and b's first query and key row in it
  int len_q, k_rows;           // b's query rows, and the key rows it owns (padded: Skv)
  int n;                       // valid keys of sequence b, clamped
  int m_lo, m_hi;              // the row blocks that see a key of this block (own)
  int m_end;                   // ceil(len_q / M): b's row blocks
  int slot0;                   // dq_accum slot of b's first row block
  int h0, group;               // the query heads of kv head g: [h0, h0 + group)

  // The CTA's block: key block n_block of kv head g of sequence b (after locate), and the row
  // blocks that see a key of it (mask.h, row_range; none for a block past n_b).
  __device__ void own(const AttentionParams& p, int g_, int n_block_) {
    g = g_;
    n_block = n_block_;
    group = int(p.num_heads / p.kv_num_heads);
    h0 = g * group;
    const Range tiles = row_tiles<kBlockM>(p.mask(), key0(), key0() + kBlockN, n, len_q);
    m_lo = int(tiles.begin);
    m_hi = int(tiles.end);
  }
  // The block's first key (a row of b's keys), and whether it has work: some of its keys are
  // b's (not wholly past n_b, in its rows of Skv; never so packed) and some row sees one.
  __device__ int key0() const { return n_block * kBlockN; }
  __device__ bool has_work() const { return key0() < n && m_lo < m_hi; }
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
    const Range tiles = key_tiles<kBlockN>(p.mask(), m * kBlockM, last < len_q ? last + 1 : len_q, n, len_q);
    return make_int2(int(tiles.begin), int(tiles.end));
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

// Named barriers (bar.sync ids; 0 is __syncthreads): both consumer warpgroups (K tail zeroed,
// dS^T written; kWide: the step's shared tiles free), and each consumer warpgroup's own (kOwnWg0 +
// w: its Q and dO tails zeroed); kWide's hand-overs, arrived at by one warpgroup and waited on
// by the other: P^T and P's multiplier written (kPReady), dS^T written (kDsReady); and, between
// the writer warp and both consumer warpgroups (kDqThreads), the dQ order at kWide (bwd_dq.h):
// the writer arrives at kDqTurn once the block ahead has added the step's row block, the
// consumers at kDqDone once they have.
enum class BwdBarrier : int { kConsumers = 1, kOwnWg0 = 2, kOwnWg1 = 3, kPReady = 4, kDsReady = 5, kDqTurn = 6, kDqDone = 7 };
template <typename Tr>
constexpr int kDqThreads = Tr::kConsumerThreads + 32;

// Thread roles: warpgroup 0 is the producer's -- its warp 0 loads (bwd_load.h), its warp 1 writes
// the dQ partials (bwd_dq.h), warps 2 and 3 exit --, warpgroups 1 and 2 are the consumers
// (bwd_mma.h).
enum class BwdRole { kProducer, kDqWriter, kIdle, kConsumer };
__device__ __forceinline__ BwdRole bwd_role() {
  if (threadIdx.x >= kWarpgroupThreads) return BwdRole::kConsumer;
  const int warp = threadIdx.x / 32;
  return warp == 0 ? BwdRole::kProducer : warp == 1 ? BwdRole::kDqWriter : BwdRole::kIdle;
}

}  // namespace jax_varlen::cuda::sm90
