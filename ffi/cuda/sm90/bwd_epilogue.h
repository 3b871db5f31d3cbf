// Epilogue of the Hopper backward (bwd_sm90.cuh): a key block's dK (scaled) and dV, straight from
// the consumers' registers (bwd_mma.h), zeros for its keys past n_b; and the whole CTA's zeros
// for a block that no query row sees (wholly past n_b, or masked out). Rows past the keys the
// sequence owns (k_rows) are never written.
#pragma once

#include "cuda/sm90/bwd_traits.h"

namespace jax_varlen::cuda::sm90 {

template <typename Tr>
struct BwdEpilogue {
  using Element = typename Tr::Element;
  static constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kHeadDim = Tr::kHeadDim;

  // dK and dV rows [key0, key0 + kBlockN) of sequence b, kv head g: row 0 of each.
  struct Dst {
    Element* d_k;
    Element* d_v;
  };
  static __device__ __forceinline__ Dst dst(const AttentionParams& p, const BackwardParams& bp,
                                            const BwdBlock<kBlockM, kBlockN>& blk) {
    const int64_t key0 = blk.key0();
    return {static_cast<Element*>(bp.d_k) + int64_t(blk.pack) * p.k_batch_stride +
                (blk.k_start + key0) * p.k_row_stride + blk.g * p.k_head_stride,
            static_cast<Element*>(bp.d_v) + int64_t(blk.pack) * p.v_batch_stride +
                (blk.k_start + key0) * p.v_row_stride + blk.g * p.v_head_stride};
  }

  // Every thread of the CTA: zeros in the block's rows, 16 bytes per store.
  static __device__ __forceinline__ void store_zeros(const AttentionParams& p, const BwdBlock<kBlockM, kBlockN>& blk,
                                                     const Dst& d) {
    const int key0 = blk.key0();
    const int rows = blk.k_rows - key0 < kBlockN ? blk.k_rows - key0 : kBlockN;
    const int ck = int(p.head_dim / 8), cv = int(p.head_dim_v / 8);
    for (int idx = threadIdx.x; idx < rows * (ck + cv); idx += Tr::kThreads) {
      const int r = idx / (ck + cv), c = idx % (ck + cv);
      Element* out = c < ck ? d.d_k + r * p.k_row_stride + c * 8 : d.d_v + r * p.v_row_stride + (c - ck) * 8;
      *reinterpret_cast<uint4*>(out) = make_uint4(0, 0, 0, 0);
    }
  }

  // One consumer thread (ct = 0..255): its dK and dV elements, in pairs of adjacent columns.
  template <typename TdK, typename TdV>
  static __device__ __forceinline__ void store(const AttentionParams& p, const BwdBlock<kBlockM, kBlockN>& blk, const Dst& d,
                                               int ct, const TdK& tdKrdK, const TdV& tdVrdV) {
    // (key, column) of this thread's dK/dV elements.
    Tensor cKV = typename Tr::TiledMmadKV{}.get_thread_slice(ct).partition_C(
        make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    const int key0 = blk.key0();
    constexpr int kKV = decltype(size(cKV))::value;
#pragma unroll
    for (int i = 0; i < kKV; i += 2) {
      const int r = int(get<0>(cKV(i))), c = int(get<1>(cKV(i)));
      const int key = key0 + r;
      if (key >= blk.k_rows) continue;
      const bool real = key < blk.n;
      if (c < p.head_dim) {
        cutlass::Array<Element, 2> pair;
        pair[0] = Element(real ? tdKrdK(i) * p.scale : 0.0f);
        pair[1] = Element(real ? tdKrdK(i + 1) * p.scale : 0.0f);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(d.d_k + r * p.k_row_stride + c) = pair;
      }
      if (c < p.head_dim_v) {
        cutlass::Array<Element, 2> pair;
        pair[0] = Element(real ? tdVrdV(i) : 0.0f);
        pair[1] = Element(real ? tdVrdV(i + 1) : 0.0f);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(d.d_v + r * p.v_row_stride + c) = pair;
      }
    }
  }
};

}  // namespace jax_varlen::cuda::sm90
