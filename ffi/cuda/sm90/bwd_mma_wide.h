// Consumer mainloop of the Hopper backward at head-dim bucket 256 (bwd_sm90.cuh, Tr::kWide).
// d256-skewed's training step, H100: 323 TFLOP/s, 1.00x cuDNN with the dQ added from registers
// (299 with it staged for the writer; the mma.sync kernels it replaces: 64; benchmarks/NOTES.md,
// sessions 2026-12-07 k and l).
//
// At 256 the d128 split (each warpgroup 64 keys x the whole head dim) would keep dK and dV of 64
// x 256 in each warpgroup's registers: 256 per thread. Here a CTA owns kBlockN = 64 keys and the
// two warpgroups divide the step's work by product instead, as FlashAttention-3 does at this
// size (64 x 64 tiles, one stage: benchmarks/NOTES.md):
//   warpgroup 0: S^T = K Q^T [64 keys, 64 rows] (SS), P^T = exp(S^T - lse), masked; P^T to
//     shared memory (d_s buffer 0, the A operand of dV) and P -- times 1 - tanh^2 with softcap --
//     in fp32 to p_mul for warpgroup 1; arrives at kPReady;
//   warpgroup 1: dP^T = V dO^T (SS), waits on kPReady, dS^T = P (dP^T - delta) into d_s buffer
//     1; arrives at kDsReady;
//   both, each on its half of the head dim (TiledMmadKV and TiledMmadQ split N):
//     dV += P^T dO (issued as soon as P^T is there), then after kDsReady dK += dS^T Q (the
//     stage's Q and dO are then released) and dQ_part = dS K, all SS; each thread then stores
//     or adds its dQ values into the workspace itself, when the writer warp says it is the
//     block's turn (bwd_dq.h; no staging in shared memory, so Q and dO have two stages).
// The step ends on a sync of both warpgroups (kConsumers): P^T, dS^T and p_mul are then free.
// Per step each warpgroup issues 2 x 64 x 64 x 256 x 2 + ... = half the step's 10.5 MFLOP.
// Registers: dK and dV halves 2 x 64, the dQ half 64 (after S^T or dP^T is dead), S^T or dP^T 32.
//
// Padding and masks as in bwd_mma.h: K rows past n_b zeroed, Q and dO rows past a packed
// sequence zeroed, P and dS 0 at masked pairs (selected: dP^T may be NaN there).
#pragma once

#include "cuda/sm90/bwd_mma.h"  // BwdConsumerSteps

namespace jax_varlen::cuda::sm90 {

template <typename Tr, bool kSoftcap>
struct BwdMmaWide : BwdConsumerSteps<Tr> {
  using Steps = BwdConsumerSteps<Tr>;
  using Steps::Steps, Steps::p, Steps::ss, Steps::ct, Steps::lane, Steps::wg, Steps::release;
  using Element = typename Tr::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim, kStages = Tr::kStages;
  static_assert(Tr::kWide && !Tr::kDqStaged && kBlockM == 64 && kBlockN == 64);

  // Step (h, m)'s dQ partial, this warpgroup's half, into its dq_accum tile in register order
  // (value v of thread wt at (v / 4) * 512 + 4 wt + v % 4, as bwd_sm90_dq_kernel reads it):
  // stored by the first key block in the order, added by the others, each once the writer
  // warp says the block ahead has added (kDqTurn); then counted by the writer (kDqDone).
  template <typename TdQ>
  __device__ __forceinline__ void add_dq(const BwdBlock<kBlockM, kBlockN>& blk, int h, int m, const TdQ& tdQrdQ) const {
    constexpr int kQ = decltype(size(tdQrdQ))::value;  // kDqHalf / 128
    const bool first = blk.key_blocks(p, m).y - 1 == blk.n_block;
    float* half = this->kp.bp.dq_accum + blk.dq_unit(p, this->kp.num_slots, h, m) * (kBlockM * kHeadDim) +
                  wg * Tr::kDqHalf + 4 * (ct % kWarpgroupThreads);
    named_sync(int(BwdBarrier::kDqTurn), kDqThreads<Tr>);
#pragma unroll
    for (int i = 0; i < kQ; i += 4) {
      float* dst = half + i * kWarpgroupThreads;
      if (first)
        asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(tdQrdQ(i)), "f"(tdQrdQ(i + 1)),
                     "f"(tdQrdQ(i + 2)), "f"(tdQrdQ(i + 3)) : "memory");
      else
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(tdQrdQ(i)), "f"(tdQrdQ(i + 1)),
                     "f"(tdQrdQ(i + 2)), "f"(tdQrdQ(i + 3)) : "memory");
    }
    named_arrive(int(BwdBarrier::kDqDone), kDqThreads<Tr>);
  }

  // The block's walk: dK and dV (this warpgroup's half of the head dim, cleared by the caller)
  // summed over every step, the ring's stages from pipe on.
  template <typename TdK, typename TdV>
  __device__ __forceinline__ void mma(const BwdBlock<kBlockM, kBlockN>& blk, PipelineState<kStages>& pipe,
                                      TdK& tdKrdK, TdV& tdVrdV) const {
    const int key0 = blk.key0(), len_q = blk.len_q, n = blk.n;
    const int wt = ct % kWarpgroupThreads;  // thread of its warpgroup
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(ss.d_out.data()), typename Tr::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutK{});
    Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(ss.d_out.data()), typename Tr::SmemLayoutQt{});
    Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutKt{});
    Tensor sPdSt = make_tensor(make_smem_ptr(ss.d_s.data()), typename Tr::SmemLayoutdSt{});  // [keys, rows, P^T | dS^T]
    Tensor sdS = make_tensor(make_smem_ptr(ss.d_s.data()), typename Tr::SmemLayoutdS{});     // [rows, keys, 2]
    typename Tr::TiledMmaSdP mma_sdp;  // one warpgroup's [kBlockN, kBlockM] tile
    typename Tr::TiledMmadKV mma_dkv;
    typename Tr::TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(wt);
    auto thr_dkv = mma_dkv.get_thread_slice(ct);
    auto thr_dq = mma_dq.get_thread_slice(ct);
    Tensor tSrK = thr_sdp.partition_fragment_A(sK(_, _, 0));  // warpgroup 0: S^T = K Q^T
    Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);           // (MMA, N, K, stages)
    Tensor tdPrV = thr_sdp.partition_fragment_A(sV(_, _, 0));  // warpgroup 1: dP^T = V dO^T
    Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);
    Tensor tdKVrA = thr_dkv.partition_fragment_A(sPdSt);     // (MMA, M, K, 2): P^T for dV, dS^T for dK
    Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);     // (MMA, N, K, stages)
    Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);        // (MMA, M, K, 2): dS is buffer 1
    Tensor tdQrKt = thr_dq.partition_fragment_B(sKt(_, _, 0));
    // P^T and dS^T to shared memory by stmatrix, from either warpgroup's accumulator.
    auto copy_t = make_tiled_copy_C(typename Tr::CopyAtomdS{}, mma_sdp);
    auto thr_copy_t = copy_t.get_thread_slice(wt);
    Tensor tTsT = thr_copy_t.partition_D(sPdSt);  // (copy, keys, rows, 2)
    // (key, row) of this thread's S^T or dP^T elements: the same in both warpgroups.
    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
    constexpr int kS = decltype(size(cS))::value;  // 32 elements per thread
    static_assert(kS % 4 == 0);
    float* p_mul = ss.p_mul + 4 * wt;  // value v at p_mul[(v / 4) * 512 + v % 4]
    const float2 z_scales = Steps::template exponent_scales<kSoftcap>();
    const float z_scale = z_scales.x, z_cap = z_scales.y;

    Barrier::wait(&ss.full_kv, 0);
    this->zero_k_tail(sK, key0, n);
    const bool packed = p.cu_seqlens_q != nullptr;
    auto to_smem = [&](auto& acc, int buffer) {  // acc (fp32) as Element into d_s buffer `buffer`
      Tensor r = make_tensor_like<Element>(acc);
      cutlass::NumericArrayConverter<Element, float, kS> convert;
      *reinterpret_cast<cutlass::Array<Element, kS>*>(r.data()) =
          convert(*reinterpret_cast<const cutlass::Array<float, kS>*>(acc.data()));
      copy(copy_t, thr_copy_t.retile_S(r), tTsT(_, _, _, buffer));
      cutlass::arch::fence_view_async_shared();
    };

    const MaskSpec mask = p.mask();
    const DiagonalBand band = diagonal_band(mask, n, len_q);
    for (int h = blk.h0; h < blk.h0 + blk.group; ++h) {
      for (int m = blk.m_lo; m < blk.m_hi; ++m) {
        const int row0 = m * kBlockM;
        const int stage = pipe.stage;
        Tensor tAcc = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});  // S^T or dP^T
        Barrier::wait(&ss.full[stage], pipe.phase);
        if (packed && row0 + kBlockM > len_q) this->zero_q_tail(sQ, sdO, stage, len_q - row0);
        if (wg == 0) wgmma_issue<true>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tAcc);
        else wgmma_issue<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), tAcc);
        const bool masked = tile_needs_mask(mask, row0, row0 + kBlockM, key0, key0 + kBlockN, n, len_q);
        // lse (warpgroup 0) or delta (1) of the thread's rows while the product runs: element
        // c + 2 h + 4 j sits at row get<1>(cS(4 j)) + c (common.h).
        const float* stats = wg == 0 ? ss.lse2[stage] : ss.delta[stage];
        float2 st[kS / 4];
#pragma unroll
        for (int j = 0; j < kS / 4; ++j) st[j] = *reinterpret_cast<const float2*>(&stats[get<1>(cS(4 * j))]);
        auto stat = [&](int i) { return i % 2 == 0 ? st[i / 4].x : st[i / 4].y; };
        warpgroup_wait<0>();

        if (wg == 0) {
          float pm[kS];  // P, times 1 - t^2 with softcap: dS = pm (dP - delta)
#pragma unroll
          for (int i = 0; i < kS; ++i) {
            const int row = row0 + int(get<1>(cS(i)));
            float z = tAcc(i) * z_scale;
            float t = 0.0f;
            if constexpr (kSoftcap) {
              t = tanhf(z);
              z = z_cap * t;
            }
            float prob = ex2_approx(z - stat(i));
            if (masked) {
              const int key = key0 + int(get<0>(cS(i)));
              if (row >= len_q || key >= n || key - row > band.hi || key - row < band.lo) prob = 0.0f;
            }
            tAcc(i) = prob;
            pm[i] = kSoftcap ? prob * (1.0f - t * t) : prob;
          }
#pragma unroll
          for (int i = 0; i < kS; i += 4)
            *reinterpret_cast<float4*>(p_mul + (i / 4) * 512) = make_float4(pm[i], pm[i + 1], pm[i + 2], pm[i + 3]);
          to_smem(tAcc, 0);  // P^T
          named_arrive(int(BwdBarrier::kPReady), Tr::kConsumerThreads);
          wgmma_issue<false>(mma_dkv, tdKVrA(_, _, _, 0), tdVrdOt(_, _, _, stage), tdVrdV);  // dV += P^T dO
          named_sync(int(BwdBarrier::kDsReady), Tr::kConsumerThreads);
        } else {
          named_sync(int(BwdBarrier::kPReady), Tr::kConsumerThreads);
          wgmma_issue<false>(mma_dkv, tdKVrA(_, _, _, 0), tdVrdOt(_, _, _, stage), tdVrdV);  // dV += P^T dO
          // dS^T in place of dP^T; exactly 0 where P is at a masked step (dP^T may be NaN
          // there), as bwd_mma.h decides.
#pragma unroll
          for (int i = 0; i < kS; i += 4) {
            const float4 v = *reinterpret_cast<const float4*>(p_mul + (i / 4) * 512);
            const float pmv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              const float ds = pmv[c] * (tAcc(i + c) - stat(i + c));
              tAcc(i + c) = (kSoftcap || masked) && pmv[c] == 0.0f ? 0.0f : ds;
            }
          }
          to_smem(tAcc, 1);  // dS^T
          named_arrive(int(BwdBarrier::kDsReady), Tr::kConsumerThreads);
        }

        // Both warpgroups, their half of the head dim: dK += dS^T Q first, the last read of the
        // stage's Q and dO, so the stage is released while dQ_part = dS K runs; then dQ_part
        // into the workspace.
        Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
        wgmma_issue<false>(mma_dkv, tdKVrA(_, _, _, 1), tdKrQt(_, _, _, stage), tdKrdK);
        wgmma_issue<true>(mma_dq, tdQrdS(_, _, _, 1), tdQrKt, tdQrdQ);
        warpgroup_wait<1>();  // dV and dK (dQ in flight)
        warpgroup_fence_operand(tdKrdK);
        release(&ss.empty[stage]);
        warpgroup_wait<0>();  // dQ
        warpgroup_fence_operand(tdQrdQ);
        add_dq(blk, h, m, tdQrdQ);
        // Every product of the step has read P^T, dS^T and p_mul: the next step may write them.
        named_sync(int(BwdBarrier::kConsumers), Tr::kConsumerThreads);
        pipe.advance();
      }
    }
  }
};

}  // namespace jax_varlen::cuda::sm90
