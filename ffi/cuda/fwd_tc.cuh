// Tensor-core forward (FlashAttention-2 class, sm_80+): one thread block owns kBlockM packed
// query rows of one (sequence, kv head); the Q tile stays in shared memory, K and V tiles
// stream through cp.async (V[t] lands while QK^T of tile t runs, K[t+1] while PV runs), both
// products run on mma.sync m16n8k16 with fp32 accumulators, and the softmax is online in fp32
// base 2 with the scale folded in. The key loop stops at the block's last allowed key, so
// padding (and causal tiles past the frontier) is never loaded.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "cuda/ptx.h"
#include "cuda/softmax.h"
#include "cuda/tile.h"
#include "cuda/tile_scheduler.h"

namespace jax_varlen::cuda {

template <int kHeadDim_>
struct TcTraits {
  static constexpr int kHeadDim = kHeadDim_;            // bucket: 64, 128 or 256
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kMTiles = kHeadDim <= 128 ? 2 : 1;  // 16-row MMA tiles per warp
  static constexpr int kBlockM = 16 * kMTiles * kWarps;    // packed query rows per block
  static constexpr int kBlockN = 64;                       // keys per tile
  static constexpr int kChunks = kHeadDim / 8;             // 16-byte chunks per smem row
  static constexpr int kMinBlocksPerSm = kHeadDim <= 128 ? 2 : 1;
  // sQ [kBlockM, kHeadDim], sK and sV [kBlockN, kHeadDim], 16-bit elements
  static constexpr size_t kSmemBytes = size_t(kBlockM + 2 * kBlockN) * kHeadDim * 2;
};

// Copies kRows rows of `dim` elements into a swizzled [kRows, kHeadDim] tile; row r comes from
// src(r), or is zeros when src(r) is null. Columns past dim are zeros too. Zero-filling copies
// read nothing; they are handed `base` (any valid address) only to keep the operand sane.
template <typename Tr, int kRows, typename Elem, typename Src>
__device__ __forceinline__ void load_tile(Elem* tile, const Elem* base, int64_t dim, Src src) {
#pragma unroll
  for (int idx = threadIdx.x; idx < kRows * Tr::kChunks; idx += Tr::kThreads) {
    const int row = idx / Tr::kChunks, chunk = idx % Tr::kChunks;
    const Elem* from = src(row);
    const bool valid = from != nullptr && chunk * 8 < dim;
    cp_async_16(tile + swizzle<Tr::kHeadDim>(row, chunk), valid ? from + chunk * 8 : base, valid);
  }
}

// The K or V tile of keys [n0, n0 + kBlockN): rows from `first` (key n0's row) on, `stride`
// elements apart; rows at or past `rows` and columns past `dim` are zeros. A thread always
// copies the same 16-byte chunk of rows threadIdx.x / kChunks + i * kRowStep, so the address
// is one add per row (this runs every tile).
template <typename Tr, typename Elem>
__device__ __forceinline__ void load_kv_tile(Elem* tile, const Elem* first, int64_t stride, int rows,
                                             int64_t dim) {
  constexpr int kRowStep = Tr::kThreads / Tr::kChunks;
  static_assert(Tr::kThreads % Tr::kChunks == 0 && Tr::kBlockN % kRowStep == 0);
  const int chunk = threadIdx.x % Tr::kChunks, row0 = threadIdx.x / Tr::kChunks;
  const bool col_ok = chunk * 8 < dim;
  const Elem* from = first + row0 * stride + chunk * 8;
#pragma unroll
  for (int i = 0; i < Tr::kBlockN / kRowStep; ++i) {
    const int row = row0 + i * kRowStep;
    const bool valid = col_ok && row < rows;
    cp_async_16(tile + swizzle<Tr::kHeadDim>(row, chunk), valid ? from : first, valid);
    from += kRowStep * stride;
  }
}

// kSoftcap is a template policy: the tanh path costs registers the plain path needs.
template <typename Elem, int kHeadDim, bool kSoftcap>
__global__ void __launch_bounds__(TcTraits<kHeadDim>::kThreads, TcTraits<kHeadDim>::kMinBlocksPerSm)
    fwd_tc_kernel(const __grid_constant__ AttentionParams p) {
  using Tr = TcTraits<kHeadDim>;
  constexpr int kMT = Tr::kMTiles, kNT = Tr::kBlockN / 8, kDT = kHeadDim / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  Elem* sQ = reinterpret_cast<Elem*>(smem);
  Elem* sK = sQ + Tr::kBlockM * kHeadDim;
  Elem* sV = sK + Tr::kBlockN * kHeadDim;

  const int64_t m_block = gridDim.x - 1 - blockIdx.x;  // causal: the longest rows start first
  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int64_t group = p.num_heads / p.kv_num_heads;
  const BlockInfo blk(p, b, m_block, Tr::kBlockM);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Elem* q = static_cast<const Elem*>(p.q);
  Elem* out = static_cast<Elem*>(p.out);

  // Packed row -> (query position, head); see tile_scheduler.h.
  auto q_offset = [&](int64_t r) { return (b * p.seqlen_q + r / group) * p.num_heads + g * group + r % group; };
  auto lse_offset = [&](int64_t r) { return (b * p.num_heads + g * group + r % group) * p.seqlen_q + r / group; };

  if (blk.max_limit <= 0) {  // no row of this block may see a key: zero rows, lse = -inf
    const int64_t chunks = p.head_dim_v / 8;  // 16-byte stores: head_dim_v % 8 == 0 here
    for (int64_t idx = threadIdx.x; idx < (blk.row_end - blk.row_begin) * chunks; idx += Tr::kThreads) {
      const int64_t r = blk.row_begin + idx / chunks, chunk = idx % chunks;
      *reinterpret_cast<uint4*>(out + q_offset(r) * p.head_dim_v + chunk * 8) = make_uint4(0, 0, 0, 0);
      if (chunk == 0) p.lse[lse_offset(r)] = -INFINITY;
    }
    return;
  }

  // Rows of this thread: local row warp*16*kMT + mt*16 + lane/4 + 8*rr, for mt < kMT, rr < 2.
  int limit[kMT][2];  // allowed keys of each row (lengths fit in int32)
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int64_t r = blk.row_begin + warp * 16 * kMT + mt * 16 + lane / 4 + 8 * rr;
      limit[mt][rr] = r < blk.row_end ? int(allowed_keys(r / group, blk.n, p.seqlen_q, p.is_causal)) : 0;
    }

  const Elem* k_base = static_cast<const Elem*>(p.k) + (b * p.seqlen_k * p.kv_num_heads + g) * p.head_dim;
  const Elem* v_base = static_cast<const Elem*>(p.v) + (b * p.seqlen_k * p.kv_num_heads + g) * p.head_dim_v;
  const int64_t k_stride = p.kv_num_heads * p.head_dim, v_stride = p.kv_num_heads * p.head_dim_v;
  const int64_t key_end = blk.max_limit;  // keys at or past it are zero-filled, never read
  auto rows_left = [&](int64_t n0) { return int(key_end - n0 < Tr::kBlockN ? key_end - n0 : Tr::kBlockN); };
  auto load_k = [&](int64_t n0) { load_kv_tile<Tr>(sK, k_base + n0 * k_stride, k_stride, rows_left(n0), p.head_dim); };
  auto load_v = [&](int64_t n0) { load_kv_tile<Tr>(sV, v_base + n0 * v_stride, v_stride, rows_left(n0), p.head_dim_v); };

  load_tile<Tr, Tr::kBlockM>(sQ, q, p.head_dim, [&](int row) {
    const int64_t r = blk.row_begin + row;
    return r < blk.row_end ? q + q_offset(r) * p.head_dim : nullptr; });
  load_k(0);
  cp_async_commit();

  const ScoreScale scale(p.scale, p.softcap);

  float o[kMT][kDT][4];  // [rows, head_dim_v] fp32 accumulator fragments
  float m[kMT][2], l[kMT][2];  // running max (base 2) and this thread's partial row sums
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.0f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.0f;
  }

  const int n_tiles = int((key_end + Tr::kBlockN - 1) / Tr::kBlockN);
  const int min_limit = int(blk.min_limit);
  for (int t = 0; t < n_tiles; ++t) {
    const int n0 = t * Tr::kBlockN;
    cp_async_wait_all();
    __syncthreads();  // K[t] (and Q) landed; every warp is done reading V[t-1]
    load_v(n0);
    cp_async_commit();

    // s = Q K[t]^T: [16 * kMT rows of this warp, kBlockN keys]. The loops are fully unrolled
    // (no early exit for a rounded-up bucket: its extra columns are zeros in sQ, sK and sV),
    // so ptxas can issue the ldmatrix of the next step under the MMAs of this one.
    float s[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
        ldmatrix_x4(a[mt], sQ + swizzle<kHeadDim>(warp * 16 * kMT + mt * 16 + (lane & 15), ks * 2 + (lane >> 4)));
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

    // Mask only tiles that reach past some row's limit (the last tile, the causal diagonal).
    const bool masked = n0 + Tr::kBlockN > min_limit;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
      online_softmax<kSoftcap>(s[mt], m[mt], l[mt], o[mt], scale, masked,
                               [&](int key, int rr) { return n0 + key >= limit[mt][rr]; });

    cp_async_wait_all();
    __syncthreads();  // V[t] landed; every warp is done reading K[t]
    if (t + 1 < n_tiles) {
      load_k(n0 + Tr::kBlockN);
      cp_async_commit();
    }

    // o += P V[t]: P's accumulator fragments are reused as A operands (16 keys per step).
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
          mma_16816<Elem>(o[mt][2 * dp], a[mt], bv[0], bv[1]);
          mma_16816<Elem>(o[mt][2 * dp + 1], a[mt], bv[2], bv[3]);
        }
      }
    }
  }

  // Epilogue: o / l rounded once to Elem; rows with nothing allowed give 0 and lse = -inf.
  const float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float sum = l[mt][rr];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      const int64_t r = blk.row_begin + warp * 16 * kMT + mt * 16 + lane / 4 + 8 * rr;
      if (r >= blk.row_end) continue;
      // "No allowed key" is decided by the row's limit, never by its sum, so NaN/Inf in real
      // data propagates (SPEC: non-finite real data).
      const bool any = limit[mt][rr] > 0;
      const float inv = any ? 1.0f / sum : 0.0f;
      Elem* row = out + q_offset(r) * p.head_dim_v;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        const int col = dt * 8 + 2 * (lane & 3);
        if (col < p.head_dim_v)
          *reinterpret_cast<uint32_t*>(row + col) = pack2<Elem>(o[mt][dt][2 * rr] * inv, o[mt][dt][2 * rr + 1] * inv);
      }
      if ((lane & 3) == 0) p.lse[lse_offset(r)] = any ? m[mt][rr] * kLn2 + logf(sum) : -INFINITY;
    }
}

template <typename Elem, int kHeadDim>
cudaError_t run_fwd_tc(const AttentionParams& p, cudaStream_t stream) {
  using Tr = TcTraits<kHeadDim>;
  const int64_t group = p.num_heads / p.kv_num_heads;
  const dim3 grid(unsigned((p.seqlen_q * group + Tr::kBlockM - 1) / Tr::kBlockM), unsigned(p.kv_num_heads),
                  unsigned(p.batch));
  auto kernel = p.softcap > 0.0f ? fwd_tc_kernel<Elem, kHeadDim, true> : fwd_tc_kernel<Elem, kHeadDim, false>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Tr::kSmemBytes));
  if (err != cudaSuccess) return err;
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_varlen::cuda
