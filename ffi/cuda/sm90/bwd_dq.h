// dQ of the Hopper backward (bwd_sm90.cuh): the dQ writer role (warp 1 of warpgroup 0) and the
// kernel that turns the summed partials into d_q.
//
// Row block m of head h gets one partial per key block that it sees (n < nvis(m)); they are
// summed in a fixed order, key blocks descending, into dq_accum (fp32) with a counter per
// (b, h, m) in dq_semaphore: the writer of block n waits until the counter reaches
// nvis(m) - 1 - n, bulk-copies each consumer warpgroup's half from shared memory (the first
// partial) or bulk-adds it (cp.reduce.async.bulk, the others) -- one 16 KB op per half, in the
// order the registers hold it --, waits for it to land, and counts itself (a release add). The
// consumers never wait on the counter: they hand the halves over through two shared buffers
// (full_dq / empty_dq), so they fill one while the writer drains the other. At head dim 256
// (Tr::kWide, no staging: bwd_traits.h) the writer only keeps the order: it waits for the
// counter as above and arrives at the named barrier kDqTurn; each consumer thread then stores
// (the first partial) or adds (red.global.add.v4.f32) its values in the same register order
// straight from its accumulators and arrives at kDqDone; the writer syncs there and counts the
// block (a release add: the barrier orders the consumers' adds before it, as CUTLASS's
// GenericBarrier does). bwd_sm90_dq_kernel
// then writes d_q = scale * dq_accum in the input dtype (zero rows where no block sees the row
// block). The order depends only on the lengths, so d_q is bitwise deterministic. Every wait is
// on a block of higher n of the same (b, g), which has a lower blockIdx.x (bwd_sm90.cuh: a
// pair's key blocks are side by side, in reverse, whatever the sequences' order) and so was
// dispatched earlier: no deadlock whatever the residency.
#pragma once

#include "cuda/sm90/bwd_traits.h"

namespace jax_varlen::cuda::sm90 {

__device__ __forceinline__ int load_acquire(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// The writer warp: every step of the block, in the consumers' order.
template <typename Tr>
struct BwdDqWriter {
  using Barrier = cutlass::arch::ClusterBarrier;
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;

  __device__ __forceinline__ static void run(const BwdKernelParams<Tr>& kp, BwdSharedStorage<Tr>& ss,
                                             const BwdBlock<kBlockM, kBlockN>& blk) {
    const BackwardParams& bp = kp.bp;
    const AttentionParams& p = bp.fwd;
    const int lane = threadIdx.x % 32;
    int step = 0;
    for (int h = blk.h0; h < blk.h0 + blk.group; ++h)
      for (int m = blk.m_lo; m < blk.m_hi; ++m, ++step) {
        const int rank = blk.key_blocks(p, m).y - 1 - blk.n_block;  // >= 0
        const int64_t unit = blk.dq_unit(p, kp.num_slots, h, m);
        int* sem = bp.dq_semaphore + unit;
        if constexpr (!Tr::kDqStaged) {  // the consumers add; the writer keeps the order
          if (lane == 0 && rank > 0)
            while (load_acquire(sem) < rank) {
            }
          __syncwarp();
          named_arrive(int(BwdBarrier::kDqTurn), kDqThreads<Tr>);
          named_sync(int(BwdBarrier::kDqDone), kDqThreads<Tr>);
          if (lane == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(sem) : "memory");
          __syncwarp();
          continue;
        }
        static_assert(Tr::kDqBuffers == 2);
        const int buf = step & 1;
        const int phase_dq = (step >> 1) & 1;
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
  }
};

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
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;
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
  BwdBlock<kBlockM, kBlockN> blk{};
  blk.locate(p, b);
  if (m >= blk.m_end) return;
  const int2 seen_blocks = blk.key_blocks(p, m);
  const bool seen = seen_blocks.y > seen_blocks.x;
  const float* src = bp.dq_accum + blk.dq_unit(p, num_slots, h, m) * (kBlockM * kHeadDim) +
                     (ct / kWarpgroupThreads) * Tr::kDqHalf + 4 * (ct % kWarpgroupThreads);
#pragma unroll
  for (int i = 0; i < kQ; i += 4) {
    const float4 v = seen ? __ldcs(reinterpret_cast<const float4*>(src + i * kWarpgroupThreads)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
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

}  // namespace jax_varlen::cuda::sm90
