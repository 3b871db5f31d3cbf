// TileScheduler: the one heaviest-first list of work units of the Hopper kernels, and where a
// CTA takes its units from (its placement). The forward and the backward both walk it.
//
// Units. The forward's unit (Unit below) = (sequence b, query head h, block of kBlockM query
// rows), or, for a short sequence under pack-GQA (params.h; heads_of below), (sequence b, kv
// head, block of kBlockM rows of (query row, query head of the group) pairs, the heads fastest).
// The backward's (KeyBlockUnit) = (sequence b, kv head g, block of kBlockN keys): its CTA walks
// every row block of the group's heads that sees the block (bwd_sm90.cuh).
//
// Order: heaviest first, deterministic. Sequences are ranked by the work of their heaviest unit,
// descending, ties by index (heavier): a row-block list by the sequence's valid keys (its last
// row block sees the most under a causal mask, every block all of them without), a key-block
// list by the rows that see its first key block, then its keys (mask.h, row_range). Within a
// sequence: a row-block list its row blocks from the last, the heaviest under a causal mask
// (heads fastest; its empty slots last, a packed sequence with fewer than seqlen_q query rows);
// a key-block list its kv heads, each with its key blocks side by side from the last -- the dQ
// order (bwd_dq.h) adds a sequence's partials key block descending, so a block waits only on
// blocks started before it, although under a causal mask the first key block is the heaviest;
// co-resident blocks of one pair share Q and dO in L2. The order depends only on the lengths;
// each unit is computed whole by one CTA, in the same way wherever it runs, so results are
// bitwise deterministic and batch invariant.
//
// Mixed order (params.h, fwd_mixed_order; a sorted packed row-block list): the sequences whose
// units have at most kFewRows tile rows (decode rows, speculative tokens, tiny chunks: each unit
// streams its keys for a few rows, bound by bandwidth) are ranked apart from the others (bound
// by the tensor cores), each class heaviest first as above, and the list interleaves the two
// classes' units in proportion to their counts (mixed_position), so that the short rows' units
// run beside the others' from the list's start to its end instead of in a wave of their own.
//
// Ranking. A row-block list is ranked inside each CTA of the forward (sort_sequences: batches up
// to kMaxSortedBatch, order and lengths in shared memory; larger ones keep their own order); a
// key-block list by a pass before the backward's launch (seq_order.cuh: any batch, into the
// workspace's seq_order), since each of its many short-lived CTAs would otherwise sort again.
//
// Placements, behind the same list (a unit's index u in it):
// - grid: one unit per CTA, u = blockIdx.x (grid_unit): the hardware starts CTAs in blockIdx
//   order, so the list's order is the start order (the backward: a persistent backward on the
//   counter measured 1.4-3% slower, benchmarks/NOTES.md, session 2026-12-06 g);
// - snake: a persistent grid of G CTAs, CTA c takes units c, 2G - 1 - c, 2G + c, ...
//   (unit_of_round; the forward's paged kernel);
// - counter: a persistent CTA takes the next unit from an atomic counter (unit_queue.h,
//   UnitQueue; the forward's other kernels).
//
// The row-block list, by rank, within a sequence the row blocks from the last, heads fastest:
// - padded batch: num_heads * num_m_blocks units per sequence (num_m_blocks = ceil(seqlen_q /
//   kBlockM): every sequence has seqlen_q query rows);
// - packed batch (packed_attention, or attention with nonpad_q_seqlen), sorted: work-
//   proportional, num_heads / heads * ceil(len_q * heads / kBlockM) units per sequence (len_q
//   its real query rows, heads = heads_of(len_q): 1, or the group under pack-GQA), first_unit
//   (an exclusive prefix sum by rank, in shared memory) saying where each sequence's units
//   start: a serving step (chunks and decode rows) walks no empty slots;
// - unsorted (more than kMaxSortedBatch sequences): num_heads * num_m_blocks slots per
//   sequence, those past its blocks empty.
// Only its four constants tie it to a kernel, and a unit's key bounds come from the mask
// (mask.h), so another kernel over units of query rows can take it as is.
#pragma once

#include "cuda/sm90/common.h"
#include "cuda/sm90/unit_queue.h"

namespace jax_varlen::cuda::sm90 {

// Whether sequence j (sort key wj) ranks before sequence b (sort key wb): heavier first, ties
// by index. Every ranking of the list uses it.
template <typename W, typename I>
__device__ __forceinline__ bool heavier(W wj, I j, W wb, I b) {
  return wj > wb || (wj == wb && j < b);
}

// One unit of work (see the top of the file) and the keys it needs.
struct Unit {
  int b, m_block;
  int h;          // the first query head of the unit (its only one unless heads > 1)
  int heads;      // query heads of the unit: 1, or the group (pack-GQA): tile row i is query
                  // row (m_block * kBlockM + i) / heads of head h + (m_block * kBlockM + i) % heads
  int pack;       // the pack of sequence b (b in the padded batch): TMA's fourth coordinate
  int q_start;    // first query row and first key row of sequence b in its pack (0 padded)
  int k_start;
  int len_q;      // query rows of sequence b (seqlen_q in the padded batch)
  int rows;       // tile rows of the unit: 0 for an empty slot
  int n;          // valid keys of sequence b, clamped into [0, seqlen_k]
  // Its rows' allowed keys (mask.h, key_range; both bounds grow with the row):
  int min_limit;  // end of the first row's keys: tiles that end at or before it need no right mask
  int max_first;  // first key of the last row: tiles that start at or after it need no left mask
  int key_end;    // end of the last row's keys: key tiles at or past it are never loaded
  int n_tiles;    // ceil(key_end / kBlockN): one past the last tile
  int t_begin;    // the first row's first key / kBlockN: tiles below it are never loaded

  // Tile row `tile_row` of the sequence's tile rows (m_block * kBlockM + i for row i of the
  // unit's tile): its query row and its head's offset from h. A pack-GQA unit's tile rows are
  // few (under kBlockM * group): 32-bit division there.
  struct RowHead {
    int64_t row;
    int dh;
  };
  __device__ __forceinline__ RowHead row_head(int64_t tile_row) const {
    if (heads == 1) return {tile_row, 0};
    return {int(tile_row) / heads, int(tile_row) % heads};
  }
};

// One unit of the backward's key-block list: key block n_block of kv head g of sequence b.
struct KeyBlockUnit {
  int b, g, n_block;
};

// kBlockM query rows per row block, kBlockN keys per key tile (the forward's: Unit's tile bounds)
// or key block (the backward's), kThreads threads per CTA (all of them sort). Row-block lists
// of batches up to kMaxSortedBatch are ranked in the CTA (sort_sequences); a kernel that walks a
// key-block list (ranked before its launch, seq_order.cuh) passes 0.
template <int kBlockM, int kBlockN, int kMaxSortedBatch, int kThreads>
struct TileScheduler {
  static constexpr int kSortSlots = kMaxSortedBatch > 0 ? kMaxSortedBatch : 1;
  struct SharedStorage {
    union {
      int32_t sorted_len[kSortSlots];  // padded: clamped lengths, heaviest first
      int32_t first_unit[kSortSlots];  // packed: the first unit of each rank
    };
    int32_t packed_units;             // packed: the units of the whole list
    int32_t long_units;               // packed, mixed order: the units of the long class (ranked first)
    uint16_t order[kSortSlots];       // the sequence of each rank (while ranking, the mixed order's class of each b)
  };
  // Mixed order: a sequence whose units have at most this many tile rows (one consumer
  // warpgroup's) is of the short class.
  static constexpr int kFewRows = kBlockM / 2;

  // Query heads per unit of a sequence of the sorted packed list with len_q query rows
  // (Unit::heads): the group when pack-GQA is on and the sequence is shorter than a tile and
  // fills fewer tiles with the group's heads packed (ceil(len_q * group / kBlockM) per kv head)
  // than without (group per kv head); else 1. A decode row packs (1 tile instead of group), a
  // chunk of a full tile or more never does (it keeps the TMA path for Q).
  static __device__ __forceinline__ int heads_of(const AttentionParams& p, int len_q) {
    const int group = int(p.num_heads / p.kv_num_heads);
    if (!p.pack_gqa || group == 1 || len_q >= kBlockM) return 1;
    return (len_q * group + kBlockM - 1) / kBlockM < group ? group : 1;
  }

  // Sequences sorted by clamped length, descending, ties by index: order[rank] = b, and
  // sorted_len[rank] = n_b (padded) or first_unit[rank] = the units of the ranks before
  // (num_heads / heads * ceil(len_q * heads / kBlockM) each) and packed_units (packed). All
  // threads; sorted_len holds the lengths by b while ranking. The caller syncs the CTA before
  // reading them.
  // A packed list in the mixed order (p.fwd_mixed_order) ranks the long class first, then the
  // short one (see the top of the file), each by length as above, and long_units says where the
  // short class starts.
  static __device__ void sort_sequences(const AttentionParams& p, SharedStorage& ss) {
    static_assert(kMaxSortedBatch > 0, "a key-block list is ranked before the launch (seq_order.cuh)");
    const int batch = int(p.batch);
    if (batch > kMaxSortedBatch) return;
    constexpr int kPer = (kMaxSortedBatch + kThreads - 1) / kThreads;
    const bool packed = p.cu_seqlens_q != nullptr, mixed = packed && p.fwd_mixed_order;
    for (int b = threadIdx.x; b < batch; b += kThreads) {
      const SeqlenInfo seq(p, b);
      ss.sorted_len[b] = int(seq.seqlen_k);
      if (mixed) ss.order[b] = uint16_t(short_rows(p, int(seq.seqlen_q)));  // its class, until ranked
    }
    __syncthreads();
    int rank[kPer], len[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int b = threadIdx.x + i * kThreads;
      rank[i] = 0;
      len[i] = b < batch ? ss.sorted_len[b] : 0;
      if (b < batch && !mixed)
        for (int j = 0; j < batch; ++j) {
          const int nj = ss.sorted_len[j];
          rank[i] += heavier(nj, j, len[i], b);
        }
      if (b < batch && mixed) {
        const int cls = ss.order[b];
        for (int j = 0; j < batch; ++j) {
          const int nj = ss.sorted_len[j], cj = ss.order[j];
          rank[i] += cj < cls || (cj == cls && heavier(nj, j, len[i], b));
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int b = threadIdx.x + i * kThreads;
      if (b < batch) {
        ss.order[rank[i]] = uint16_t(b);
        if (packed) {  // its units, summed below (times 2 plus its class in the mixed order)
          const int len_q = int(SeqlenInfo(p, b).seqlen_q), heads = heads_of(p, len_q);
          const int units = int(p.num_heads) / heads * ((len_q * heads + kBlockM - 1) / kBlockM);
          ss.first_unit[rank[i]] = mixed ? units * 2 + short_rows(p, len_q) : units;
        } else {
          ss.sorted_len[rank[i]] = len[i];
        }
      }
    }
    if (!packed) return;
    // first_unit: an inclusive scan by rank (Hillis-Steele, rank = thread), then each rank's own
    // units subtracted.
    static_assert(kThreads >= kMaxSortedBatch, "one rank per thread");
    const int r = threadIdx.x;
    __syncthreads();
    int own = r < batch ? ss.first_unit[r] : 0;
    // Mixed order: this rank's class and the rank before's (read before the scan writes), then
    // the units alone back in first_unit, which the scan reads (units * 2 + class until then).
    const bool short_rank = mixed && (own & 1), after_long = r == 0 || !(ss.first_unit[r - 1] & 1);
    if (mixed) {
      own >>= 1;
      __syncthreads();
      if (r < batch) ss.first_unit[r] = own;
      __syncthreads();
    }
    int sum = own;
    for (int offset = 1; offset < batch; offset *= 2) {
      const int add = r < batch && r >= offset ? ss.first_unit[r - offset] : 0;
      __syncthreads();
      sum += add;
      if (r < batch) ss.first_unit[r] = sum;
      __syncthreads();
    }
    if (r < batch) ss.first_unit[r] = sum - own;
    if (r == (batch > 0 ? batch - 1 : 0)) ss.packed_units = sum;  // 0 for an empty batch
    // long_units: the first unit of the short class's first rank, or every unit when that class
    // is empty. One writer: the first short rank's thread, else the last rank's.
    if (short_rank && after_long) ss.long_units = sum - own;
    if (mixed && !short_rank && r == (batch > 0 ? batch - 1 : 0)) ss.long_units = sum;
  }

  // Mixed order: whether a sequence with len_q query rows is of the short class (its units have
  // at most kFewRows tile rows).
  static __device__ __forceinline__ bool short_rows(const AttentionParams& p, int len_q) {
    return int64_t(len_q) * heads_of(p, len_q) <= kFewRows;
  }

  // Mixed order: the unit at position u of the interleaved list, as an index of the list ranked
  // by class (long_units long units, then the short ones): position u is a long unit when the
  // count of long units before it, floor(u * long / total), grows at u + 1 -- the two classes'
  // units spread evenly over the list, each class's in its own order.
  static __device__ __forceinline__ int mixed_position(const SharedStorage& ss, int u) {
    const int64_t longs = ss.long_units, total = ss.packed_units;
    const int before = int(u * longs / total), through = int((u + 1) * longs / total);
    return through > before ? before : int(longs) + (u - before);
  }

  // How many units the list holds: the packed sorted batch's count, else `slots` = batch *
  // num_heads * num_m_blocks (an unsorted packed batch's empty slots included). After
  // sort_sequences and a sync.
  static __device__ __forceinline__ int num_units(const AttentionParams& p, int slots, const SharedStorage& ss) {
    return p.batch <= kMaxSortedBatch && p.cu_seqlens_q != nullptr ? ss.packed_units : slots;
  }

  // The r-th unit of this CTA, or -1 past the end: a snake over the heaviest-first list.
  static __device__ __forceinline__ int unit_of_round(int r, int num_units) {
    const int g = int(gridDim.x), c = int(blockIdx.x);
    const int u = r * g + ((r & 1) ? g - 1 - c : c);
    return u < num_units ? u : -1;
  }

  // The grid placement: the unit of this CTA, one per CTA.
  static __device__ __forceinline__ int grid_unit() { return int(blockIdx.x); }

  // Sort key of sequence b in a key-block list (seq_order.cuh ranks by it): the rows that see
  // its first block of kBlockN keys (mask.h, row_range: all of them without a mask, min(n_q,
  // n_k) under the tail-aligned causal mask, the window's width and the block's under a local
  // window -- the rows of its heaviest key block) in the high 32 bits, then its keys.
  static __device__ __forceinline__ int64_t key_block_weight(const AttentionParams& p, int64_t b) {
    const SeqlenInfo seq(p, b);
    if (seq.seqlen_k == 0) return 0;
    const Range rows = row_range(p.mask(), 0, kBlockN, seq.seqlen_k, seq.seqlen_q);
    return (rows.empty() ? 0 : rows.end - rows.begin) << 32 | seq.seqlen_k;
  }

  // Unit u of a key-block list with num_n_blocks key blocks per (sequence, kv head) (the
  // padded key length's): u = (rank * kv_num_heads + g) * num_n_blocks + num_n_blocks - 1 -
  // n_block, sequence b = seq_order[rank]. Blocks past a sequence's keys are units without work.
  static __device__ __forceinline__ KeyBlockUnit decode_key_block(const AttentionParams& p, const int32_t* seq_order,
                                                                  int num_n_blocks, int u) {
    const int pair = u / num_n_blocks;
    return {seq_order[pair / int(p.kv_num_heads)], pair % int(p.kv_num_heads), num_n_blocks - 1 - u % num_n_blocks};
  }

  // Unit u < num_units of the list (num_m_blocks row blocks per sequence and head where the
  // list has slots of equal size).
  static __device__ __forceinline__ Unit decode_unit(const AttentionParams& p, int num_m_blocks,
                                                     const SharedStorage& ss, int u) {
    const bool sorted = p.batch <= kMaxSortedBatch;
    int rank, rem;
    if (sorted && p.cu_seqlens_q != nullptr) {
      // The last rank whose first unit is <= u: the one that owns u (a rank without units
      // shares its first unit with the next, and the last rank at or below u has units).
      if (p.fwd_mixed_order) u = mixed_position(ss, u);
      int lo = 0, hi = int(p.batch) - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (ss.first_unit[mid] <= u) lo = mid; else hi = mid - 1;
      }
      rank = lo;
      rem = u - ss.first_unit[rank];
    } else {
      const int per_seq = int(p.num_heads) * num_m_blocks;
      rank = u / per_seq;
      rem = u % per_seq;
    }
    Unit w;
    w.b = sorted ? ss.order[rank] : rank;
    if (sorted && p.cu_seqlens_q == nullptr) {  // padded: its length is in shared memory
      w.n = ss.sorted_len[rank];
      w.pack = w.b;
      w.q_start = w.k_start = 0;
      w.len_q = int(p.seqlen_q);
    } else {
      const SeqlenInfo seq(p, w.b);
      w.n = int(seq.seqlen_k);
      w.pack = int(seq.pack);
      w.q_start = int(seq.q_start);
      w.k_start = int(seq.k_start);
      w.len_q = int(seq.seqlen_q);
    }
    // Row blocks from the sequence's last, heads (or kv heads, packed) fastest; slots past its
    // first block (an unsorted packed batch) are empty.
    w.heads = sorted && p.cu_seqlens_q != nullptr ? heads_of(p, w.len_q) : 1;  // only this list packs
    const int tile_rows = w.len_q * w.heads;  // < kBlockM * group when heads > 1
    const int blocks = (tile_rows + kBlockM - 1) / kBlockM;
    const int unit_heads = int(p.num_heads) / w.heads;
    w.m_block = blocks - 1 - rem / unit_heads;
    w.h = rem % unit_heads * w.heads;
    if (w.m_block < 0) {
      w.rows = w.min_limit = w.max_first = w.key_end = w.n_tiles = w.t_begin = 0;
      return w;
    }
    const int row0 = w.m_block * kBlockM;
    w.rows = tile_rows - row0 < kBlockM ? tile_rows - row0 : kBlockM;
    // The unit's query rows: from its first tile row's to its last's.
    const Range first = key_range(p.mask(), w.row_head(row0).row, w.n, w.len_q);
    const Range last = key_range(p.mask(), w.row_head(row0 + w.rows - 1).row, w.n, w.len_q);
    w.min_limit = int(first.end);
    w.max_first = int(last.begin);
    w.key_end = int(last.end);
    // The key tiles of the union of its rows' ranges (mask.h, tiles_of): none when no row may
    // see a key.
    const Range tiles = tiles_of<kBlockN>(Range{first.begin, last.end});
    w.t_begin = int(tiles.begin);
    w.n_tiles = int(tiles.end);
    return w;
  }
};

}  // namespace jax_varlen::cuda::sm90
