// Tensor-core forward (FlashAttention-2 class, sm_80+): one thread block owns kBlockM packed
// query rows of one (sequence, kv head); the Q tile stays in shared memory and the block's four
// warps share each K/V tile of the mainloop (mainloop.h: cp.async, mma.sync m16n8k16, online
// softmax in fp32 base 2 with the scale folded in). The key loop stops at the block's last
// allowed key, so padding (and causal tiles past the frontier) is never loaded.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "cuda/sm80/softmax.h"
#include "cuda/sm80/block_info.h"
#include "cuda/sm80/mainloop.h"
#include "cuda/sm80/ptx.h"
#include "cuda/sm80/tile.h"
#include "core/sinks.h"

namespace jax_varlen::cuda::sm80 {

template <int kHeadDim_>
struct TcTraits {
  static constexpr int kHeadDim = kHeadDim_;               // bucket: 64, 128 or 256
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kMTiles = kHeadDim <= 128 ? 2 : 1;  // 16-row MMA tiles per warp
  static constexpr int kBlockM = 16 * kMTiles * kWarps;    // packed query rows per block
  static constexpr int kBlockN = 64;                       // keys per tile
  static constexpr int kMinBlocksPerSm = kHeadDim <= 128 ? 2 : 1;
  // The block is one team with a single-stage ring: V[t] lands under QK^T, K[t+1] under PV.
  using Mainloop = MainloopTraits<kHeadDim, kMTiles, kBlockN, /*kKeyStep=*/kBlockN, /*kStages=*/1, kThreads,
                                  /*kQInRegisters=*/false>;
  // sQ [kBlockM, kHeadDim] 16-bit, then the ring (sK, sV [kBlockN, kHeadDim]).
  static constexpr size_t kSmemBytes = size_t(kBlockM) * kHeadDim * 2 + Mainloop::kRingBytes;
};

// kSoftcap is a template policy: the tanh path costs registers the plain path needs.
template <typename Elem, int kHeadDim, bool kSoftcap>
__global__ void __launch_bounds__(TcTraits<kHeadDim>::kThreads, TcTraits<kHeadDim>::kMinBlocksPerSm)
    fwd_tc_kernel(const __grid_constant__ AttentionParams p) {
  using Tr = TcTraits<kHeadDim>;
  using Ml = typename Tr::Mainloop;
  constexpr int kMT = Tr::kMTiles, kDT = kHeadDim / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  Elem* sQ = reinterpret_cast<Elem*>(smem);
  Elem* ring = sQ + Tr::kBlockM * kHeadDim;

  const int64_t g = blockIdx.y;
  const int64_t group = p.num_heads / p.kv_num_heads;
  const BlockInfo blk(p, blockIdx.z, gridDim.x - 1 - blockIdx.x, Tr::kBlockM);  // causal: longest rows first
  if (blk.past_end()) return;
  const SeqlenInfo& seq = blk.seq;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Elem* q = static_cast<const Elem*>(p.q);
  Elem* out = static_cast<Elem*>(p.out);

  // Packed row r -> query position r / group, head g * group + r % group (block_info.h).
  auto q_row = [&](int64_t r) { return q + seq.q_index(p, r / group, g * group + r % group); };
  auto out_row = [&](int64_t r) { return out + seq.out_index(p, r / group, g * group + r % group); };
  auto lse_at = [&](int64_t r) -> float& { return p.lse[seq.lse_index(p, g * group + r % group, r / group)]; };

  if (blk.max_limit <= blk.min_first) {  // no row of this block may see a key: zero rows, lse = -inf (the sink)
    const int64_t chunks = p.head_dim_v / 8;  // 16-byte stores: head_dim_v % 8 == 0 here
    for (int64_t idx = threadIdx.x; idx < (blk.row_end - blk.row_begin) * chunks; idx += Tr::kThreads) {
      const int64_t r = blk.row_begin + idx / chunks, chunk = idx % chunks;
      *reinterpret_cast<uint4*>(out_row(r) + chunk * 8) = make_uint4(0, 0, 0, 0);
      if (chunk == 0) lse_at(r) = empty_row_lse(p, g * group + r % group);
    }
    return;
  }

  // Rows of this thread: local row warp*16*kMT + mt*16 + lane/4 + 8*rr, for mt < kMT, rr < 2.
  int first[kMT][2], limit[kMT][2];  // allowed keys [first, limit) of each row (lengths fit in int32)
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int64_t r = blk.row_begin + warp * 16 * kMT + mt * 16 + lane / 4 + 8 * rr;
      const Range row = r < blk.row_end ? key_range(p.mask(), r / group, seq.seqlen_k, seq.seqlen_q) : Range{0, 0};
      first[mt][rr] = int(row.begin);
      limit[mt][rr] = int(row.end);
    }

  load_tile<kHeadDim, Tr::kBlockM, Tr::kThreads>(sQ, q, p.head_dim, threadIdx.x, [&](int row) {
    const int64_t r = blk.row_begin + row;
    return r < blk.row_end ? q_row(r) : nullptr; });
  cp_async_commit();

  const KvSource<Elem> kv{p, seq.k_offset, int(g)};
  const int key_end = int(blk.max_limit);  // keys at or past it are zero-filled, never read
  const KeyTiles keys{int(blk.min_first / Tr::kBlockN * Tr::kBlockN), key_end};  // from the first key's tile
  Accumulators<Ml> acc;
  mainloop<Ml, kSoftcap>(sQ, warp * 16 * kMT, ring, kv, keys, first, limit, int(blk.min_limit),
                         int(blk.max_first), ScoreScale(p.scale, p.softcap), acc);

  // Epilogue: o / l rounded once to Elem (core/sinks.h: with the sink in the denominator); rows
  // with nothing allowed give 0 and lse = -inf (the sink's logit).
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float sum = acc.l[mt][rr];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      const int64_t r = blk.row_begin + warp * 16 * kMT + mt * 16 + lane / 4 + 8 * rr;
      if (r >= blk.row_end) continue;
      // "No allowed key" is decided by the row's key range, never by its sum, so NaN/Inf in real
      // data propagates (SPEC: non-finite real data).
      const bool any = limit[mt][rr] > first[mt][rr];
      RowFinish fin{0.0f, -INFINITY};
      if (p.sinks == nullptr) {
        if (any) fin = finish_row</*kBase2=*/true>(acc.m[mt][rr], sum, nullptr);
      } else {
        const int64_t h = g * group + r % group;
        fin = any ? finish_row</*kBase2=*/true>(acc.m[mt][rr], sum, p.sinks + h) : RowFinish{0.0f, p.sinks[h]};
      }
      const float inv = fin.inv;
      Elem* row = out_row(r);
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        const int col = dt * 8 + 2 * (lane & 3);
        if (col < p.head_dim_v)
          *reinterpret_cast<uint32_t*>(row + col) = pack2<Elem>(acc.o[mt][dt][2 * rr] * inv, acc.o[mt][dt][2 * rr + 1] * inv);
      }
      if ((lane & 3) == 0) lse_at(r) = fin.lse;
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

}  // namespace jax_varlen::cuda::sm80
