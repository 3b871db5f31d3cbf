// Consumer mainloop of the Hopper backward (bwd_sm90.cuh): warpgroups 1 and 2, 64 keys each of
// the CTA's kBlockN = 128 key block. Per step (query head h of the group, row block m that sees
// the block; Q, dO, lse and delta from the producer's ring, bwd_load.h), with S^T = K Q^T
// [keys, rows] so that the keys run along the accumulators' rows:
//   S^T = K Q^T and dP^T = V dO^T            (SS wgmma, K-major operands)
//   P^T = exp(S^T - lse), masked; dS^T = P^T (dP^T - delta) (times 1 - t^2 with softcap)
//   dV += P^T dO and dK += dS^T Q            (RS wgmma: P^T, dS^T from registers; Q, dO
//                                             read MN-major through transposed views)
//   dS^T -> shared memory (stmatrix; as dS, transposed, at 128 rows); dQ_part = dS K (SS; the
//   warpgroups split D at 64 rows, the rows at 128), issued before dK so that each warpgroup's
//   half of dQ_part goes to shared memory, for the dQ writer (bwd_dq.h), while dK runs.
// dK and dV stay in registers for the whole walk and sum over the group's query heads; the
// epilogue (bwd_epilogue.h) stores them.
//
// Padding: keys at or past n_b are never used -- their P and dS are selected to 0, and their K
// rows are zeroed in shared memory before dS K (0 * NaN would poison dQ). Query rows past the
// sequence land as zeros (TMA) or, packed, as the next sequence's rows (or the unowned tail,
// which may hold NaN): those are zeroed in shared memory before the step's products (0 * NaN
// would poison dK and dV), and masked out.
#pragma once

#include "cuda/sm90/bwd_traits.h"

namespace jax_varlen::cuda::sm90 {

// What both consumer mainloops (BwdMma below, BwdMmaWide in bwd_mma_wide.h) share: consumer
// thread ct (0..255; lane, warpgroup wg) and its view of the shared storage, and the steps
// they take alike.
template <typename Tr>
struct BwdConsumerSteps {
  using Barrier = cutlass::arch::ClusterBarrier;
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kChunks = Tr::kHeadDim / 8;

  const BwdKernelParams<Tr>& kp;
  const AttentionParams& p;
  BwdSharedStorage<Tr>& ss;
  int ct, lane, wg;

  __device__ __forceinline__ BwdConsumerSteps(const BwdKernelParams<Tr>& kp, BwdSharedStorage<Tr>& ss)
      : kp(kp), p(kp.bp.fwd), ss(ss), ct(threadIdx.x - kWarpgroupThreads), lane(threadIdx.x % 32),
        wg((threadIdx.x - kWarpgroupThreads) / kWarpgroupThreads) {}

  // This warp's arrival on bar, once all its lanes are there.
  __device__ __forceinline__ void release(uint64_t* bar) const {
    __syncwarp();
    if (lane == 0) Barrier::arrive(bar);
  }
  // The base-2 exponent of score s: z = s * scale * log2 e, or with softcap
  // softcap * log2 e * tanh(s * scale / softcap): (the factor of s, the cap).
  template <bool kSoftcap>
  __device__ __forceinline__ float2 exponent_scales() const {
    const float kLog2e = 1.4426950408889634f;
    return make_float2(kSoftcap ? p.scale / p.softcap : p.scale * kLog2e, p.softcap * kLog2e);
  }

  // After K landed: zeros in K rows past n_b (dS K must not meet padding), by every consumer
  // thread, then a sync of both warpgroups.
  template <typename TK>
  __device__ __forceinline__ void zero_k_tail(TK& sK, int key0, int n) const {
    if (key0 + kBlockN <= n) return;
    const int rows = n - key0;
    for (int idx = ct; idx < (kBlockN - rows) * kChunks; idx += Tr::kConsumerThreads)
      *reinterpret_cast<uint4*>(&sK(rows + idx / kChunks, (idx % kChunks) * 8, 0)) = make_uint4(0, 0, 0, 0);
    cutlass::arch::fence_view_async_shared();
    named_sync(int(BwdBarrier::kConsumers), Tr::kConsumerThreads);
  }
  // Packed: Q and dO rows [rows, kBlockM) of stage s hold another sequence's rows (or NaN of
  // the unowned tail): zeros before the products. Both warpgroups write the same zeros (so
  // neither waits for the other), then each fences its writes for wgmma and syncs its own 128
  // threads.
  template <typename TQ>
  __device__ __forceinline__ void zero_q_tail(TQ& sQ, TQ& sdO, int s, int rows) const {
    for (int idx = ct % kWarpgroupThreads; idx < (kBlockM - rows) * kChunks; idx += kWarpgroupThreads) {
      const int r = rows + idx / kChunks, c = (idx % kChunks) * 8;
      *reinterpret_cast<uint4*>(&sQ(r, c, s)) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(&sdO(r, c, s)) = make_uint4(0, 0, 0, 0);
    }
    cutlass::arch::fence_view_async_shared();
    named_sync(int(BwdBarrier::kOwnWg0) + wg, kWarpgroupThreads);
  }
};

// One consumer thread (ct = 0..255 over both warpgroups: warpgroup ct / 128 owns keys
// [64 * (ct / 128), +64) of the block and dQ columns [D / 2 * (ct / 128), +D / 2)).
template <typename Tr, bool kSoftcap>
struct BwdMma : BwdConsumerSteps<Tr> {
  using Steps = BwdConsumerSteps<Tr>;
  using Steps::Steps, Steps::p, Steps::ss, Steps::ct, Steps::lane, Steps::wg, Steps::release;
  using Element = typename Tr::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim, kStages = Tr::kStages;
  static_assert(!Tr::kWide && Tr::kDqStaged && Tr::kDqBuffers == 2, "head dim 256 has its own mainloop (bwd_mma_wide.h)");

  // The dQ partial (this warpgroup's half) to `half`, a buffer of d_q, in register order (value
  // v of thread wt at (v / 4) * 512 + 4 wt + v % 4), then handed to the writer on `full`.
  template <typename TdQ>
  __device__ __forceinline__ void hand_dq(float* half, uint64_t* full, const TdQ& tdQrdQ) const {
    const int wt = ct % kWarpgroupThreads;
    constexpr int kQ = decltype(size(tdQrdQ))::value;  // kDqHalf / 128
#pragma unroll
    for (int i = 0; i < kQ; i += 4)
      *reinterpret_cast<float4*>(half + 4 * wt + i * kWarpgroupThreads) =
          make_float4(tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2), tdQrdQ(i + 3));
    cutlass::arch::fence_view_async_shared();
    release(full);
  }

  // The block's walk: dK and dV (cleared by the caller) summed over every step, the ring's
  // stages from pipe on.
  template <typename TdK, typename TdV>
  __device__ __forceinline__ void mma(const BwdBlock<kBlockM, kBlockN>& blk, PipelineState<kStages>& pipe, TdK& tdKrdK,
                                      TdV& tdVrdV) const {
    // The sequence's query rows and keys, in registers: read through blk in the masked loop,
    // they turned its branch-free predicate into branches (64 more at d64, and twice the spills).
    const int key0 = blk.key0(), len_q = blk.len_q, n = blk.n;
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(ss.d_out.data()), typename Tr::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Tr::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Tr::SmemLayoutK{});
    Tensor sdSt = make_tensor(make_smem_ptr(ss.d_s.data()), typename Tr::SmemLayoutdSt{});
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
    // (key, row) of this thread's S^T elements.
    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
    constexpr int kS = decltype(size(cS))::value;  // 32 elements of S^T per thread
    const float2 z_scales = Steps::template exponent_scales<kSoftcap>();
    const float z_scale = z_scales.x, z_cap = z_scales.y;

    Barrier::wait(&ss.full_kv, 0);
    this->zero_k_tail(sK, key0, n);
    const bool packed = p.cu_seqlens_q != nullptr;

    // An allowed pair of a real row i and a real key j: lo <= j - i <= hi (mask.h).
    const MaskSpec mask = p.mask();
    const DiagonalBand band = diagonal_band(mask, n, len_q);
    int step = 0;
    for (int h = blk.h0; h < blk.h0 + blk.group; ++h) {
      for (int m = blk.m_lo; m < blk.m_hi; ++m, ++step) {
        const int row0 = m * kBlockM;
        const int buf = step & 1;  // of dS^T and of the dQ partial
        const int stage = pipe.stage;
        Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        Barrier::wait(&ss.full[stage], pipe.phase);
        if (packed && row0 + kBlockM > len_q) this->zero_q_tail(sQ, sdO, stage, len_q - row0);
        wgmma_issue<true>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
        wgmma_issue<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), tdPrdP);
        // Masking: needed unless every row of the block is real and sees every key of this block
        // (mask.h; len_q and n are locals: read through BwdBlock inside the masked loop, they
        // turned its selects into branches).
        const bool masked = tile_needs_mask(mask, row0, row0 + kBlockM, key0, key0 + kBlockN, n, len_q);
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
          if (masked) {  // key_allowed() in 32 bits: real row, real key, inside the band
            const int key = key0 + int(get<0>(cS(i)));
            if (row >= len_q || key >= n || key - row > band.hi || key - row < band.lo) prob = 0.0f;
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
        named_sync(int(BwdBarrier::kConsumers), Tr::kConsumerThreads);
        Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
        wgmma_issue<true>(mma_dq, tdQrdS(_, _, _, buf), tdQrKt, tdQrdQ);
        wgmma_issue<false>(mma_dkv, tdKrdS, tdKrQt(_, _, _, stage), tdKrdK);
        warpgroup_wait<1>();  // dQ (dK in flight)
        warpgroup_fence_operand(tdQrdQ);
        // The dQ partial to this warpgroup's half of buffer `buf`, once the writer has read what
        // it held two steps ago.
        Barrier::wait(&ss.empty_dq[buf][wg], ((step >> 1) & 1) ^ 1);
        hand_dq(ss.d_q[buf][wg], &ss.full_dq[buf][wg], tdQrdQ);
        warpgroup_wait<0>();  // dK
        warpgroup_fence_operand(tdKrdK);
        warpgroup_fence_operand(tdKrdS);  // its registers stay live until dK has read them
        release(&ss.empty[stage]);
        pipe.advance();
      }
    }
  }
};

}  // namespace jax_varlen::cuda::sm90
