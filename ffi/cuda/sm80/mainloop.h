// The key loop of the sm80 tensor-core kernels, one template for the one-pass (fwd_tc.cuh) and
// the split-KV (fwd_split.cuh) paths: K and V tiles of kBlockN keys stream through a
// kStages-deep cp.async ring, S = Q K^T and O += P V run on mma.sync m16n8k16 with fp32
// accumulators, and the softmax between them is online (sm80/softmax.h). A warp owns
// 16 * kMTiles query rows; a team of warps shares each K/V tile. What differs between the two
// kernels is a parameter:
//
//                        fwd_tc                          fwd_split
//   team (shares K/V)    the block, 4 warps              one warp (4 teams per block)
//   rows of a warp       16 * kMTiles of its own          the block's 16 rows, like every warp
//   key tiles (kKeyStep) 0, kBlockN, 2 kBlockN, ...       split start + w kBlockN, then every 4 kBlockN
//   kStages              1 (smem: 2 blocks per SM)        2 (bytes in flight: decode is memory-bound)
//   Q operand            ldmatrix from smem every k-step  registers, loaded once (kQInRegisters)
//
// Pipeline (K[t] and V[t] are separate cp.async groups, committed K0 V0 K1 V1 ... K[S-1] first):
//   wait K[t]; team sync (K[t] visible; the team is done with V[t-1])  -> issue V[t + S - 1]
//   S = Q K[t]^T; masked online softmax
//   wait V[t]; team sync (V[t] visible; the team is done with K[t])    -> issue K[t + S]
//   O += P V[t]
// With S = 1: V[t] lands under QK^T of tile t, K[t + 1] under its PV. Tiles past the team's
// last one commit empty groups, so the wait counts stay uniform (2S - 2 younger groups).
// (An L2 prefetch of the tiles past a warp's ring made the split-KV kernel slower, as it did the
// Hopper forward: benchmarks/NOTES.md, sessions 2026-12-07 l and m.)
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/sm80/softmax.h"
#include "cuda/sm80/ptx.h"
#include "cuda/sm80/tile.h"
#include "core/seqlen.h"
#include "plan/limits.h"

namespace jax_varlen::cuda::sm80 {

template <int kHeadDim_, int kMTiles_, int kBlockN_, int kKeyStep_, int kStages_, int kTeamThreads_,
          bool kQInRegisters_>
struct MainloopTraits {
  static constexpr int kHeadDim = kHeadDim_;            // bucket of max(D, Dv): 64, 128 or 256
  static constexpr int kMTiles = kMTiles_;              // 16-row MMA tiles per warp
  static constexpr int kBlockN = kBlockN_;              // keys per tile
  static constexpr int kKeyStep = kKeyStep_;            // keys from one tile of a team to its next
  static constexpr int kStages = kStages_;              // K/V tiles of a team in the ring
  static constexpr int kTeamThreads = kTeamThreads_;    // threads sharing a tile: 32 or the block
  static constexpr bool kQInRegisters = kQInRegisters_;
  static constexpr int kTileElems = kBlockN * kHeadDim;
  // One team's ring: kStages x (K tile, V tile), each [kBlockN, kHeadDim] 16-bit, swizzled.
  static constexpr size_t kRingBytes = size_t(kStages) * 2 * kTileElems * 2;
};

// Where a team's K and V tiles come from: key rows row0 + key (row0 = SeqlenInfo::k_offset) of
// kv head `head`, with the strides and real head sizes of the params (the rest of the bucket is
// zeros). Addresses are rebuilt per tile from these, the strides staying in the constant bank:
// two 64-bit base pointers fewer in the loop's registers (the one-pass kernel at D = 128 runs
// at the 255-register cap).
// kPaged (the split-KV kernel on a paged cache, params.h): key j is row pages[j / page_size -
// row0] * page_size + j % page_size of the caches, `pages` the block's copy of its keys' block-
// table entries in shared memory (clamped, fwd_split.cuh) and row0 the page of its first.
// Pages hold a multiple of kPagedRun rows (the plan's condition, limits.h), so the kPagedRun
// keys from any multiple of kPagedRun on are consecutive rows: a tile is loaded in runs of
// kPagedRun, one shared-memory read each.
template <typename Elem, bool kPaged_ = false>
struct KvSource {
  static constexpr bool kPaged = kPaged_;
  const AttentionParams& p;
  int64_t row0;
  int head;
  const int* pages = nullptr;
  __device__ int64_t row(int key) const {
    if constexpr (kPaged) {
      const int page_size = int(p.page_size);
      return int64_t(pages[key / page_size - row0]) * page_size + key % page_size;
    } else {
      return row0 + key;
    }
  }
  __device__ const Elem* k(int key) const {
    return static_cast<const Elem*>(p.k) + row(key) * p.k_row_stride + head * p.k_head_stride;
  }
  __device__ const Elem* v(int key) const {
    return static_cast<const Elem*>(p.v) + row(key) * p.v_row_stride + head * p.v_head_stride;
  }
};

// The key tiles of a team: keys [n0, n0 + kBlockN) for n0 = first, first + kKeyStep, ... < end;
// keys at or past `end` are zero-filled (never read) and must be masked by the row limits.
struct KeyTiles {
  int first, end;
};

// The softmax state of a warp's rows: o [16 * kMTiles, head_dim_v] fp32 accumulator fragments,
// m the running row max (base 2), l this thread's partial row sums (a quad adds them up).
template <class Ml>
struct Accumulators {
  float o[Ml::kMTiles][Ml::kHeadDim / 8][4];
  float m[Ml::kMTiles][2];
  float l[Ml::kMTiles][2];
};

template <class Ml>
__device__ __forceinline__ void team_sync() {
  if constexpr (Ml::kTeamThreads == 32) __syncwarp();
  else __syncthreads();  // a team wider than a warp is the whole block
}

// Runs the team's key tiles over this warp's rows and leaves their softmax state in acc.
//   sQ      the block's Q tile [rows, kHeadDim], swizzled; this warp's rows start at q_row0.
//           Its cp.async group is committed before the call (the oldest group).
//   ring    this team's K/V ring (Ml::kRingBytes of smem).
//   kv      where the keys are: a KvSource, dense or paged.
//   first, limit  the allowed keys [first, limit) of this thread's rows (mt, rr): local rows
//           q_row0 + mt * 16 + lane / 4 + 8 * rr (mask.h, key_range); keys outside get
//           probability 0. Limits must not pass keys.end.
//   min_limit, max_first  the smallest limit and the largest first of the block (or less /
//           more): tiles in [max_first, min_limit) are allowed whole and skip the masking pass.
// Every warp of the block must call it (kQInRegisters syncs the block once, before the loop).
template <class Ml, bool kSoftcap, typename Elem, typename KV>
__device__ __forceinline__ void mainloop(const Elem* sQ, int q_row0, Elem* ring, const KV& kv,
                                         const KeyTiles& keys, const int (&first)[Ml::kMTiles][2],
                                         const int (&limit)[Ml::kMTiles][2], int min_limit, int max_first,
                                         const ScoreScale& scale, Accumulators<Ml>& acc) {
  constexpr int kHeadDim = Ml::kHeadDim, kBlockN = Ml::kBlockN, kStages = Ml::kStages;
  constexpr int kMT = Ml::kMTiles, kNT = kBlockN / 8, kDT = kHeadDim / 8, kKS = kHeadDim / 16;
  // Q read from smem in the loop is made visible by the first team sync: the team is the block.
  static_assert(Ml::kQInRegisters || Ml::kTeamThreads > 32);
  const int lane = threadIdx.x % 32;
  const unsigned tid = threadIdx.x % Ml::kTeamThreads;  // unsigned: the loaders' / and % are shifts

  // Tile n0's K and V go to ring slot `slot`; tiles at or past keys.end only commit (an empty
  // group).
  auto k_tile = [&](int slot) { return ring + slot * 2 * Ml::kTileElems; };
  auto v_tile = [&](int slot) { return ring + slot * 2 * Ml::kTileElems + Ml::kTileElems; };
  auto rows_left = [&](int n0) { return keys.end - n0 < kBlockN ? keys.end - n0 : kBlockN; };
  auto load_k = [&](int slot, int n0) {
    if (n0 < keys.end) {
      if constexpr (KV::kPaged)
        load_runs<kHeadDim, kBlockN, Ml::kTeamThreads, kPagedRun>(
            k_tile(slot), [&](int r) { return kv.k(n0 + r); }, static_cast<const Elem*>(kv.p.k), kv.p.k_row_stride,
            rows_left(n0), kv.p.head_dim, tid);
      else
        load_rows<kHeadDim, kBlockN, Ml::kTeamThreads>(k_tile(slot), kv.k(n0), kv.p.k_row_stride, rows_left(n0),
                                                        kv.p.head_dim, tid);
    }
    cp_async_commit();
  };
  auto load_v = [&](int slot, int n0) {
    if (n0 < keys.end) {
      if constexpr (KV::kPaged)
        load_runs<kHeadDim, kBlockN, Ml::kTeamThreads, kPagedRun>(
            v_tile(slot), [&](int r) { return kv.v(n0 + r); }, static_cast<const Elem*>(kv.p.v), kv.p.v_row_stride,
            rows_left(n0), kv.p.head_dim_v, tid);
      else
        load_rows<kHeadDim, kBlockN, Ml::kTeamThreads>(v_tile(slot), kv.v(n0), kv.p.v_row_stride, rows_left(n0),
                                                        kv.p.head_dim_v, tid);
    }
    cp_async_commit();
  };

#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    load_k(s, keys.first + s * Ml::kKeyStep);
    if (s + 1 < kStages) load_v(s, keys.first + s * Ml::kKeyStep);
  }

  // Q as MMA A fragments for the whole loop, when they live in registers: the Q group is older
  // than the 2S - 1 groups just committed.
  uint32_t qa[Ml::kQInRegisters ? kMT : 1][Ml::kQInRegisters ? kKS : 1][4];
  if constexpr (Ml::kQInRegisters) {
    cp_async_wait<2 * kStages - 1>();
    __syncthreads();  // Q was copied by the whole block
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int ks = 0; ks < kKS; ++ks)
        ldmatrix_x4(qa[mt][ks], sQ + swizzle<kHeadDim>(q_row0 + mt * 16 + (lane & 15), ks * 2 + (lane >> 4)));
  }

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) acc.o[mt][dt][0] = acc.o[mt][dt][1] = acc.o[mt][dt][2] = acc.o[mt][dt][3] = 0.0f;
    acc.m[mt][0] = acc.m[mt][1] = -INFINITY;
    acc.l[mt][0] = acc.l[mt][1] = 0.0f;
  }

  for (int t = 0, n0 = keys.first; n0 < keys.end; ++t, n0 += Ml::kKeyStep) {
    cp_async_wait<2 * kStages - 2>();
    team_sync<Ml>();  // K[t] (and, on the first tile, Q) landed; the team is done with V[t-1]
    load_v((t + kStages - 1) % kStages, n0 + (kStages - 1) * Ml::kKeyStep);

    // s = Q K[t]^T: [16 * kMT rows of this warp, kBlockN keys]. The loops are fully unrolled
    // (no early exit for a rounded-up bucket: its extra columns are zeros in sQ, sK and sV),
    // so ptxas can issue the ldmatrix of the next step under the MMAs of this one.
    const Elem* sK = k_tile(t % kStages);
    float s[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kKS; ++ks) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        if constexpr (Ml::kQInRegisters) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mt][i] = qa[mt][ks][i];
        } else {
          ldmatrix_x4(a[mt], sQ + swizzle<kHeadDim>(q_row0 + mt * 16 + (lane & 15), ks * 2 + (lane >> 4)));
        }
      }
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t bk[4];  // matrices (keys 0-7 | 8-15) x (dims 0-7 | 8-15) of this 16-key slice
        const int mi = lane >> 3;
        ldmatrix_x4(bk, sK + swizzle<kHeadDim>(np * 16 + (mi >> 1) * 8 + (lane & 7), ks * 2 + (mi & 1)));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_16816<Elem>(s[mt][2 * np], a[mt], bk[0], bk[1]);
          mma_16816<Elem>(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
        }
      }
    }

    // Mask only tiles that reach past some row's limit (the last tile, the causal diagonal) or
    // start before some row's first key (a local window's left edge).
    const bool masked = n0 + kBlockN > min_limit || n0 < max_first;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
      online_softmax<kSoftcap>(s[mt], acc.m[mt], acc.l[mt], acc.o[mt], scale, masked, [&](int key, int rr) {
        return n0 + key >= limit[mt][rr] || n0 + key < first[mt][rr];
      });

    cp_async_wait<2 * kStages - 2>();
    team_sync<Ml>();  // V[t] landed; the team is done with K[t]
    load_k(t % kStages, n0 + kStages * Ml::kKeyStep);

    // o += P V[t]: P's accumulator fragments are reused as A operands (16 keys per step).
    const Elem* sV = v_tile(t % kStages);
#pragma unroll
    for (int kk = 0; kk < kNT / 2; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        a[mt][0] = pack2<Elem>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<Elem>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<Elem>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<Elem>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < kDT / 2; ++dp) {
        uint32_t bv[4];  // transposed: matrices (keys 0-7 | 8-15) x (dims 0-7 | 8-15)
        const int mi = lane >> 3;
        ldmatrix_x4_trans(bv, sV + swizzle<kHeadDim>(kk * 16 + (mi & 1) * 8 + (lane & 7), dp * 2 + (mi >> 1)));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_16816<Elem>(acc.o[mt][2 * dp], a[mt], bv[0], bv[1]);
          mma_16816<Elem>(acc.o[mt][2 * dp + 1], a[mt], bv[2], bv[3]);
        }
      }
    }
  }
}

}  // namespace jax_varlen::cuda::sm80
