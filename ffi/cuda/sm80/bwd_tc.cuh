// Tensor-core backward (FlashAttention-2 scheme, mma.sync m16n8k16, sm_80+), after the
// preprocess wrote delta (portable/bwd_preprocess.cuh). Two kernels, each output element written
// by one thread in a fixed order, so the gradients are bitwise deterministic (no atomics):
//
//   dK/dV  a block per (64 keys, kv head, sequence). K and V stay in shared memory; the block
//          walks the packed query rows of the kv head's group (block_info.h: every query
//          head of a GQA group, so dK and dV come out summed over the group) that see its keys,
//          64 rows a step through a 2-stage cp.async ring of (Q, dO, lse, delta). Warp w owns
//          keys 16w .. 16w + 15 and computes the transposed products
//            S^T = K Q^T, dP^T = V dO^T          [16 keys, 64 rows]
//            P^T = exp(scale S^T - lse),  dS^T = P^T (dP^T - delta)   (masked; softcap factor)
//            dV += P^T dO,  dK += dS^T Q         [16 keys, head dim]
//          Blocks at or past n_b only write zeros: padded keys get exactly zero gradient and
//          are never read.
//   dQ     a block per (64 packed query rows, kv head, sequence), like the forward: Q and dO
//          stay in shared memory, K/V tiles of 64 keys stream through a 2-stage ring up to the
//          block's last allowed key, and dQ += dS K (S and dP recomputed: two more products
//          than a dQ accumulated with atomics, the price of determinism).
//
// Everything is fp32 in registers; P and dS are rounded to the element type as MMA operands.
// At head size 256 the dK and dV accumulators together do not fit a thread's registers: the
// dK/dV kernel then runs twice, once per gradient (kSplitKvPasses).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/sm80/softmax.h"
#include "cuda/sm80/block_info.h"
#include "cuda/sm80/ptx.h"
#include "cuda/sm80/tile.h"
#include "core/params.h"

namespace jax_varlen::cuda::sm80 {

enum class KvGrads { kBoth, kValue, kKey };

template <int kHeadDim_>
struct BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;  // bucket of max(D, Dv): 64, 128 or 256
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockN = 16 * kWarps;  // keys of a dK/dV block (16 per warp), keys per dQ step
  static constexpr int kBlockM = 64;           // packed rows per dK/dV step, rows of a dQ block (16 per warp)
  static_assert(kBlockN == 64 && kBlockM == 64, "the smem layouts below assume 64-row tiles");
  static constexpr int kTileElems = 64 * kHeadDim;  // one [64, kHeadDim] 16-bit swizzled tile
  static constexpr int kMinBlocksPerSm = kHeadDim <= 128 ? 2 : 1;
  static constexpr bool kSplitKvPasses = kHeadDim > 128;
  // dK/dV: sK, sV, 2 stages of (sQ, sdO), then 2 stages of (lse, delta) fp32 [kBlockM].
  static constexpr size_t kDkdvSmemBytes = size_t(6) * kTileElems * 2 + 2 * 2 * kBlockM * 4;
  // dQ: sQ, sdO, then 2 stages of (sK, sV).
  static constexpr size_t kDqSmemBytes = size_t(6) * kTileElems * 2;
};

// acc[16 rows, 8 kNT cols] += A[a_row0 .. a_row0 + 16, :] B[0 .. 8 kNT, :]^T over kHeadDim,
// A and B swizzled smem tiles (tile.h).
template <int kHeadDim, int kNT, typename Elem>
__device__ __forceinline__ void gemm_abt(float (&acc)[kNT][4], const Elem* sA, int a_row0, const Elem* sB) {
  const int lane = threadIdx.x % 32, mi = lane >> 3;
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    uint32_t a[4];
    ldmatrix_x4(a, sA + swizzle<kHeadDim>(a_row0 + (lane & 15), ks * 2 + (lane >> 4)));
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
      uint32_t b[4];  // matrices (rows 0-7 | 8-15 of B) x (k 0-7 | 8-15)
      ldmatrix_x4(b, sB + swizzle<kHeadDim>(np * 16 + (mi >> 1) * 8 + (lane & 7), ks * 2 + (mi & 1)));
      mma_16816<Elem>(acc[2 * np], a, b[0], b[1]);
      mma_16816<Elem>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// acc[16 rows, kHeadDim] += X[16 rows, 8 kNT] B[0 .. 8 kNT, :kHeadDim]: X in accumulator
// fragments (rounded to Elem as the A operand), B a swizzled smem tile read transposed.
template <int kHeadDim, int kNT, typename Elem>
__device__ __forceinline__ void gemm_xb(float (&acc)[kHeadDim / 8][4], const float (&x)[kNT][4], const Elem* sB) {
  const int lane = threadIdx.x % 32, mi = lane >> 3;
#pragma unroll
  for (int kk = 0; kk < kNT / 2; ++kk) {
    uint32_t a[4];
    a[0] = pack2<Elem>(x[2 * kk][0], x[2 * kk][1]);
    a[1] = pack2<Elem>(x[2 * kk][2], x[2 * kk][3]);
    a[2] = pack2<Elem>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
    a[3] = pack2<Elem>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
#pragma unroll
    for (int dp = 0; dp < kHeadDim / 16; ++dp) {
      uint32_t b[4];  // transposed: matrices (k 0-7 | 8-15) x (cols 0-7 | 8-15)
      ldmatrix_x4_trans(b, sB + swizzle<kHeadDim>(kk * 16 + (mi & 1) * 8 + (lane & 7), dp * 2 + (mi >> 1)));
      mma_16816<Elem>(acc[2 * dp], a, b[0], b[1]);
      mma_16816<Elem>(acc[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// P and dS of one score from its raw dot product s, the row's lse * log2(e) and delta, and
// dp = <d_out_i, v_j>: P = exp(scale s - lse) (base 2 with the scale folded, softmax.h),
// dS = P (dp - delta), times 1 - tanh^2 under softcap. Neither carries `scale` (the epilogues
// apply it to dQ and dK).
template <bool kSoftcap>
__device__ __forceinline__ float pair_prob(float s, float lse2, const ScoreScale& sc, float& dcap) {
  float z = s * sc.z_scale;
  dcap = 1.0f;
  if constexpr (kSoftcap) {
    const float t = tanhf(z);
    z = sc.z_cap * t;
    dcap = 1.0f - t * t;
  }
  return exp2_approx(z - lse2);
}

constexpr float kLog2e = 1.4426950408889634f;

// Zeros into rows [row_begin, row_end) of a [rows, dim] gradient (16-byte stores; dim % 8 == 0).
template <typename Elem, typename RowPtr>
__device__ __forceinline__ void zero_rows(int64_t row_begin, int64_t row_end, int64_t dim, RowPtr row_ptr) {
  const int64_t chunks = dim / 8;
  for (int64_t idx = threadIdx.x; idx < (row_end - row_begin) * chunks; idx += blockDim.x)
    *reinterpret_cast<uint4*>(row_ptr(row_begin + idx / chunks) + (idx % chunks) * 8) = make_uint4(0, 0, 0, 0);
}

// Grid (ceil(seqlen_k / 64), kv_num_heads, batch).
template <typename Elem, int kHeadDim, bool kSoftcap, KvGrads kGrads>
__global__ void __launch_bounds__(BwdTraits<kHeadDim>::kThreads, BwdTraits<kHeadDim>::kMinBlocksPerSm)
    bwd_dkdv_kernel(const __grid_constant__ BackwardParams bp) {
  using Tr = BwdTraits<kHeadDim>;
  constexpr int kBN = Tr::kBlockN, kBM = Tr::kBlockM, kNT = kBM / 8, kDT = kHeadDim / 8;
  constexpr bool kDv = kGrads != KvGrads::kKey, kDk = kGrads != KvGrads::kValue;
  const AttentionParams& p = bp.fwd;
  extern __shared__ __align__(128) unsigned char smem[];
  Elem* sK = reinterpret_cast<Elem*>(smem);
  Elem* sV = sK + Tr::kTileElems;
  auto sQ = [&](int st) { return sK + Tr::kTileElems * (2 + 2 * st); };
  auto sdO = [&](int st) { return sK + Tr::kTileElems * (3 + 2 * st); };
  float* rows_smem = reinterpret_cast<float*>(sK + Tr::kTileElems * 6);
  auto sLse = [&](int st) { return rows_smem + st * 2 * kBM; };
  auto sDelta = [&](int st) { return rows_smem + st * 2 * kBM + kBM; };

  const int64_t g = blockIdx.y, group = p.num_heads / p.kv_num_heads;
  const SeqlenInfo seq(p, blockIdx.z);
  const int n = int(seq.seqlen_k);
  const int64_t Sq = seq.seqlen_q, rows = Sq * group;
  const int j0 = blockIdx.x * kBN;
  // Key rows this block writes: the sequence's own (padded: Skv, padding included); none for a
  // block past them (a packed batch's grid covers the longest sequence).
  const int j_end = j0 + kBN < seq.k_rows ? j0 + kBN : int(seq.k_rows);
  if (j0 >= j_end) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned tid = threadIdx.x;
  Elem* d_k = static_cast<Elem*>(bp.d_k);
  Elem* d_v = static_cast<Elem*>(bp.d_v);
  if (j0 >= n) {  // padding only: zeros, nothing read
    if constexpr (kDk) zero_rows<Elem>(j0, j_end, p.head_dim, [&](int64_t j) { return d_k + seq.k_index(p, j, g); });
    if constexpr (kDv) zero_rows<Elem>(j0, j_end, p.head_dim_v, [&](int64_t j) { return d_v + seq.v_index(p, j, g); });
    return;
  }

  const Elem* q = static_cast<const Elem*>(p.q);
  const Elem* d_o = static_cast<const Elem*>(bp.d_out);
  const Elem* k = static_cast<const Elem*>(p.k) + seq.k_index(p, j0, g);
  const Elem* v = static_cast<const Elem*>(p.v) + seq.v_index(p, j0, g);
  // Packed row r -> query position r / group, head g * group + r % group.
  auto q_row = [&](int64_t r) { return q + seq.q_index(p, r / group, g * group + r % group); };
  auto do_row = [&](int64_t r) { return d_o + seq.out_index(p, r / group, g * group + r % group); };
  auto row_index = [&](int64_t r) { return seq.lse_index(p, g * group + r % group, r / group); };

  load_rows<kHeadDim, kBN, Tr::kThreads>(sK, k, p.k_row_stride, n - j0, p.head_dim, tid);
  load_rows<kHeadDim, kBN, Tr::kThreads>(sV, v, p.v_row_stride, n - j0, p.head_dim_v, tid);
  cp_async_commit();

  // Rows [r0, r0 + kBM) into stage st (rows past the end are zeros); always one commit.
  auto load_step = [&](int st, int64_t r0) {
    if (r0 < rows) {
      load_tile<kHeadDim, kBM, Tr::kThreads>(sQ(st), q, p.head_dim, tid, [&](int row) {
        return r0 + row < rows ? q_row(r0 + row) : nullptr; });
      load_tile<kHeadDim, kBM, Tr::kThreads>(sdO(st), d_o, p.head_dim_v, tid, [&](int row) {
        return r0 + row < rows ? do_row(r0 + row) : nullptr; });
      if (tid < kBM) {
        const bool ok = r0 + tid < rows;
        const int64_t at = ok ? row_index(r0 + tid) : 0;
        cp_async_4(sLse(st) + tid, p.lse + at, ok);
        cp_async_4(sDelta(st) + tid, bp.delta + at, ok);
      }
    }
    cp_async_commit();
  };

  // The steps of kBM packed rows that hold a row seeing a key of this block (mask.h, row_range:
  // query positions [i_begin, i_end), packed rows [i_begin * group, i_end * group); tiles_of).
  const MaskSpec mask = p.mask();
  const Range seen = row_range(mask, j0, j0 + kBN, n, Sq);
  const Range steps = tiles_of<kBM>(Range{seen.begin * group, seen.end * group});
  const int64_t r_begin = steps.empty() ? rows : steps.begin * kBM;
  const int64_t r_end = steps.empty() ? rows : steps.end * kBM;
  const ScoreScale sc(p.scale, p.softcap);

  float dk[kDk ? kDT : 1][4] = {};
  float dv[kDv ? kDT : 1][4] = {};
  load_step(0, r_begin);
  int st = 0;
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kBM, st ^= 1) {
    load_step(st ^ 1, r0 + kBM);
    cp_async_wait<1>();
    __syncthreads();  // this step's tiles (and K, V) landed

    float s[kNT][4] = {};
    gemm_abt<kHeadDim, kNT>(s, sK, warp * 16, sQ(st));
    float dp[kDk ? kNT : 1][4] = {};
    if constexpr (kDk) gemm_abt<kHeadDim, kNT>(dp, sV, warp * 16, sdO(st));

    // Mask only steps with a pair outside the allowed ones: the block's last valid key, the
    // rows' end, the causal diagonal, a window's edges (mask.h, tile_needs_mask, over the step's
    // query positions: its last packed row is past the real ones iff its query position is).
    const bool masked = tile_needs_mask<int64_t>(mask, r0 / group, (r0 + kBM - 1) / group + 1, j0, j0 + kBN, n, Sq);
    const float* lse = sLse(st);
    const float* delta = sDelta(st);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * (lane & 3) + (e & 1);  // row r0 + col of the step
        float dcap;
        float pr = pair_prob<kSoftcap>(s[nt][e], lse[col] * kLog2e, sc, dcap);
        bool ok = true;
        if (masked) {
          const int64_t r = r0 + col;
          const int j = j0 + warp * 16 + lane / 4 + 8 * (e / 2);
          ok = r < rows && key_allowed(mask, r / group, j, n, Sq);
        }
        if constexpr (kDk) dp[nt][e] = ok ? pr * (dp[nt][e] - delta[col]) * dcap : 0.0f;
        s[nt][e] = ok ? pr : 0.0f;
      }
    if constexpr (kDv) gemm_xb<kHeadDim, kNT>(dv, s, sdO(st));
    if constexpr (kDk) gemm_xb<kHeadDim, kNT>(dk, dp, sQ(st));
    __syncthreads();  // the block is done with stage st before the next step refills it
  }

  cp_async_wait_all();  // K and V are still in flight when no row sees this block

  // Keys j0 + 16 warp + lane / 4 + 8 rr; keys at or past n get zeros.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int j = j0 + warp * 16 + lane / 4 + 8 * rr;
    if (j >= j_end) continue;
    const bool real = j < n;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      const int col = dt * 8 + 2 * (lane & 3);
      if constexpr (kDk)
        if (col < p.head_dim)
          *reinterpret_cast<uint32_t*>(d_k + seq.k_index(p, j, g) + col) =
              real ? pack2<Elem>(dk[dt][2 * rr] * p.scale, dk[dt][2 * rr + 1] * p.scale) : 0u;
      if constexpr (kDv)
        if (col < p.head_dim_v)
          *reinterpret_cast<uint32_t*>(d_v + seq.v_index(p, j, g) + col) =
              real ? pack2<Elem>(dv[dt][2 * rr], dv[dt][2 * rr + 1]) : 0u;
    }
  }
}

// Grid (ceil(seqlen_q * group / 64), kv_num_heads, batch); causal: longest rows first.
template <typename Elem, int kHeadDim, bool kSoftcap>
__global__ void __launch_bounds__(BwdTraits<kHeadDim>::kThreads, BwdTraits<kHeadDim>::kMinBlocksPerSm)
    bwd_dq_kernel(const __grid_constant__ BackwardParams bp) {
  using Tr = BwdTraits<kHeadDim>;
  constexpr int kBN = Tr::kBlockN, kBM = Tr::kBlockM, kNT = kBN / 8, kDT = kHeadDim / 8;
  const AttentionParams& p = bp.fwd;
  extern __shared__ __align__(128) unsigned char smem[];
  Elem* sQ = reinterpret_cast<Elem*>(smem);
  Elem* sdO = sQ + Tr::kTileElems;
  auto sK = [&](int st) { return sQ + Tr::kTileElems * (2 + 2 * st); };
  auto sV = [&](int st) { return sQ + Tr::kTileElems * (3 + 2 * st); };

  const int64_t g = blockIdx.y, group = p.num_heads / p.kv_num_heads;
  const BlockInfo blk(p, blockIdx.z, gridDim.x - 1 - blockIdx.x, kBM);
  if (blk.past_end()) return;
  const SeqlenInfo& seq = blk.seq;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned tid = threadIdx.x;
  Elem* d_q = static_cast<Elem*>(bp.d_q);
  auto dq_row = [&](int64_t r) { return d_q + seq.q_index(p, r / group, g * group + r % group); };
  if (blk.max_limit <= blk.min_first) {  // no row sees a key: zero gradient
    zero_rows<Elem>(blk.row_begin, blk.row_end, p.head_dim, dq_row);
    return;
  }
  const Elem* q = static_cast<const Elem*>(p.q);
  const Elem* d_o = static_cast<const Elem*>(bp.d_out);
  load_tile<kHeadDim, kBM, Tr::kThreads>(sQ, q, p.head_dim, tid, [&](int row) {
    const int64_t r = blk.row_begin + row;
    return r < blk.row_end ? q + seq.q_index(p, r / group, g * group + r % group) : nullptr; });
  load_tile<kHeadDim, kBM, Tr::kThreads>(sdO, d_o, p.head_dim_v, tid, [&](int row) {
    const int64_t r = blk.row_begin + row;
    return r < blk.row_end ? d_o + seq.out_index(p, r / group, g * group + r % group) : nullptr; });
  cp_async_commit();

  // This thread's rows: local 16 warp + lane / 4 + 8 rr.
  int first[2], limit[2];  // allowed keys [first, limit) of each row (mask.h, key_range)
  float lse2[2], delta[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int64_t r = blk.row_begin + warp * 16 + lane / 4 + 8 * rr;
    const Range row = r < blk.row_end ? key_range(p.mask(), r / group, seq.seqlen_k, seq.seqlen_q) : Range{0, 0};
    first[rr] = int(row.begin);
    limit[rr] = int(row.end);
    const int64_t at = row.empty() ? 0 : seq.lse_index(p, g * group + r % group, r / group);
    lse2[rr] = row.empty() ? 0.0f : p.lse[at] * kLog2e;
    delta[rr] = row.empty() ? 0.0f : bp.delta[at];
  }

  const int key_end = int(blk.max_limit);  // keys at or past it are zero-filled, never read
  const Elem* k = static_cast<const Elem*>(p.k) + seq.k_index(p, 0, g);
  const Elem* v = static_cast<const Elem*>(p.v) + seq.v_index(p, 0, g);
  auto load_kv = [&](int st, int n0) {
    if (n0 < key_end) {
      load_rows<kHeadDim, kBN, Tr::kThreads>(sK(st), k + n0 * p.k_row_stride, p.k_row_stride, key_end - n0,
                                              p.head_dim, tid);
      load_rows<kHeadDim, kBN, Tr::kThreads>(sV(st), v + n0 * p.v_row_stride, p.v_row_stride, key_end - n0,
                                              p.head_dim_v, tid);
    }
    cp_async_commit();
  };
  const ScoreScale sc(p.scale, p.softcap);

  float dq[kDT][4] = {};
  const int key_begin = int(blk.min_first / kBN * kBN);  // the first allowed key's tile
  load_kv(0, key_begin);
  int st = 0;
  for (int n0 = key_begin; n0 < key_end; n0 += kBN, st ^= 1) {
    load_kv(st ^ 1, n0 + kBN);
    cp_async_wait<1>();
    __syncthreads();  // this tile (and, the first time, Q and dO) landed

    float s[kNT][4] = {}, dp[kNT][4] = {};
    gemm_abt<kHeadDim, kNT>(s, sQ, warp * 16, sK(st));
    gemm_abt<kHeadDim, kNT>(dp, sdO, warp * 16, sV(st));
    const bool masked = n0 + kBN > blk.min_limit || n0 < blk.max_first;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rr = e / 2;
        float dcap;
        const float pr = pair_prob<kSoftcap>(s[nt][e], lse2[rr], sc, dcap);
        const int key = n0 + nt * 8 + 2 * (lane & 3) + (e & 1);
        const bool ok = !masked || (key < limit[rr] && key >= first[rr]);
        dp[nt][e] = ok ? pr * (dp[nt][e] - delta[rr]) * dcap : 0.0f;
      }
    gemm_xb<kHeadDim, kNT>(dq, dp, sK(st));
    __syncthreads();  // the block is done with stage st before the next tile refills it
  }

#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int64_t r = blk.row_begin + warp * 16 + lane / 4 + 8 * rr;
    if (r >= blk.row_end) continue;
    Elem* row = dq_row(r);
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      const int col = dt * 8 + 2 * (lane & 3);
      if (col < p.head_dim)
        *reinterpret_cast<uint32_t*>(row + col) = pack2<Elem>(dq[dt][2 * rr] * p.scale, dq[dt][2 * rr + 1] * p.scale);
    }
  }
}

template <typename Kernel>
cudaError_t launch_bwd(Kernel kernel, dim3 grid, size_t smem_bytes, const BackwardParams& bp, cudaStream_t stream) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_bytes));
  if (err != cudaSuccess) return err;
  kernel<<<grid, 128, smem_bytes, stream>>>(bp);
  return cudaGetLastError();
}

template <typename Elem, int kHeadDim>
cudaError_t run_bwd_tc(const BackwardParams& bp, cudaStream_t stream) {
  using Tr = BwdTraits<kHeadDim>;
  const AttentionParams& p = bp.fwd;
  const int64_t group = p.num_heads / p.kv_num_heads;
  const bool softcap = p.softcap > 0.0f;
  cudaError_t err = cudaSuccess;
  if (p.seqlen_k > 0) {
    const dim3 grid(unsigned((p.seqlen_k + Tr::kBlockN - 1) / Tr::kBlockN), unsigned(p.kv_num_heads),
                    unsigned(p.batch));
    auto pass = [&](auto grads) {
      constexpr KvGrads kGrads = decltype(grads)::value;
      return launch_bwd(softcap ? bwd_dkdv_kernel<Elem, kHeadDim, true, kGrads> : bwd_dkdv_kernel<Elem, kHeadDim, false, kGrads>,
                        grid, Tr::kDkdvSmemBytes, bp, stream);
    };
    using Both = std::integral_constant<KvGrads, KvGrads::kBoth>;
    using Value = std::integral_constant<KvGrads, KvGrads::kValue>;
    using Key = std::integral_constant<KvGrads, KvGrads::kKey>;
    if constexpr (Tr::kSplitKvPasses) {
      err = pass(Value{});
      if (err == cudaSuccess) err = pass(Key{});
    } else {
      err = pass(Both{});
    }
    if (err != cudaSuccess) return err;
  }
  if (p.seqlen_q * group > 0) {
    const dim3 grid(unsigned((p.seqlen_q * group + Tr::kBlockM - 1) / Tr::kBlockM), unsigned(p.kv_num_heads),
                    unsigned(p.batch));
    err = launch_bwd(softcap ? bwd_dq_kernel<Elem, kHeadDim, true> : bwd_dq_kernel<Elem, kHeadDim, false>, grid,
                     Tr::kDqSmemBytes, bp, stream);
  }
  return err;
}

}  // namespace jax_varlen::cuda::sm80
