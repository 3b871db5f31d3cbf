// The lean units' part of the Hopper forward's consumer mainloop (fwd_mma.h, FwdMma): in the lean
// kernels (fwd_sm90.cuh, kLean) a consumer warpgroup whose rows all lie past a unit's only
// follows the unit's barriers, and the other warpgroup has the tensor cores to itself.
// Included at the end of fwd_mma.h.
#pragma once

#include "cuda/sm90/fwd_mma.h"

namespace jax_varlen::cuda::sm90 {

// Whether this warpgroup's 64 rows all lie past unit w's rows (the last row block of a sequence
// with at most 64 rows left, every pack-GQA decode unit). In the lean kernels (fwd_sm90.cuh,
// kLean) it then runs follow() instead of mma() and stores nothing (its rows are past the
// sequence), and the other warpgroup has the tensor cores to itself. Uniform over the
// warpgroup, as wgmma needs.
template <typename Tr, bool kSoftcap>
__device__ __forceinline__ bool FwdMma<Tr, kSoftcap>::idle(const Unit& w) const {
  return cwg * (kBlockM / Tr::kConsumerWarpgroups) >= w.rows;
}

// mma()'s part in the barriers for unit w, and nothing else: the same waits on the K, V and Q
// rings (so this warpgroup's releases count toward the phases they belong to), the same
// releases, the same turns (so the other warpgroup's turns stay paired). No product, no
// softmax, no accumulator touched: a function of its own, since branches around the products
// inside mma() make ptxas serialize its wgmma pipeline (benchmarks/NOTES.md).
template <typename Tr, bool kSoftcap>
inline __device__ void FwdMma<Tr, kSoftcap>::follow(const Unit& w, PipelineState<kStages>& pipe, int& q_iter) const {
  const bool edge_turns = w.n_tiles - w.t_begin <= kShortUnitTiles;
  auto edge_wait = [&] { if (edge_turns) sched_wait(); };
  auto edge_pass = [&] { if (edge_turns) sched_pass(); };
  Barrier::wait(&ss.full_q, q_iter & 1);
  ++q_iter;
  int t = w.n_tiles - 1;
  const int last_rows = w.key_end - t * kBlockN;
  const bool half = last_rows <= Tr::kHalfN;
  if (half) {  // S and P V of the half tile
    Barrier::wait(&ss.full_k[pipe.stage], pipe.phase);
    edge_wait();
    edge_pass();
    release(&ss.empty_k[pipe.stage]);
    Barrier::wait(&ss.full_v[pipe.stage], pipe.phase);
    edge_wait();
    edge_pass();
    release(&ss.empty_v[pipe.stage]);
    pipe.advance();
    --t;
  }
  if (t >= w.t_begin) {  // S of tile t
    Barrier::wait(&ss.full_k[pipe.stage], pipe.phase);
    edge_wait();
    edge_pass();
    release(&ss.empty_k[pipe.stage]);
  }
  for (; t > w.t_begin; --t) {  // S of tile t - 1 and P V of tile t
    const int stage_v = pipe.stage, phase_v = pipe.phase;
    pipe.advance();
    Barrier::wait(&ss.full_k[pipe.stage], pipe.phase);
    sched_wait();
    Barrier::wait(&ss.full_v[stage_v], phase_v);
    sched_pass();
    release(&ss.empty_k[pipe.stage]);
    release(&ss.empty_v[stage_v]);
  }
  release(&ss.empty_q);
  if (t == w.t_begin) {  // P V of the first tile
    Barrier::wait(&ss.full_v[pipe.stage], pipe.phase);
    edge_wait();
    edge_pass();
    release(&ss.empty_v[pipe.stage]);
    pipe.advance();
  }
}

}  // namespace jax_varlen::cuda::sm90
