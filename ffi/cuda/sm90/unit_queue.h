// The counter placement of TileScheduler's list (tile_scheduler.h): a persistent CTA takes its
// next unit from an atomic counter, so a CTA that finishes early takes more and no SM idles
// while others walk long units. The Hopper forward's unpaged kernels use it (fwd_sm90.cuh,
// UnitSource / UnitHandover).
#pragma once

#include "cuda/sm90/common.h"

namespace jax_varlen::cuda::sm90 {

// The producer warp's lane 0 takes the next unit of the list from an atomic counter (an int32
// of the workspace, zeroed before the launch) and hands it to the CTA's other roles through a
// two-slot ring in shared memory (next, on the full / empty mbarriers; `readers` warps arrive
// on empty). A CTA's units come in increasing order. Either way a unit is computed whole by one
// CTA in the same way, so results stay bitwise deterministic and batch invariant; only the
// placement changes.
struct UnitQueue {
  using Barrier = cutlass::arch::ClusterBarrier;
  uint64_t full[2], empty[2];
  int32_t next[2];

  // Thread 0, before the CTA's first sync.
  __device__ void init(int readers) {
    for (int s = 0; s < 2; ++s) {
      Barrier::init(&full[s], 1);
      Barrier::init(&empty[s], readers);
    }
  }
  // The producer warp's r-th unit, or -1 past the end (every lane), once round r - 2's slot is
  // free; publish(r, u) then hands it over (after anything else stored beside it in the slot).
  __device__ __forceinline__ int claim(int* counter, int num_units, int r) {
    const int slot = r & 1;
    Barrier::wait(&empty[slot], ((r >> 1) & 1) ^ 1);
    int taken = 0;
    if (threadIdx.x % 32 == 0) taken = atomicAdd(counter, 1);
    taken = __shfl_sync(0xffffffff, taken, 0);
    return taken < num_units ? taken : -1;
  }
  __device__ __forceinline__ void publish(int r, int u) {
    if (threadIdx.x % 32 != 0) return;
    next[r & 1] = u;
    Barrier::arrive(&full[r & 1]);  // release: the slot is visible to the readers
  }
  // A reader thread's r-th unit, or -1 past the end; `read(slot, u)` reads more beside the index
  // before its warp releases the slot.
  template <typename Read>
  __device__ __forceinline__ int read(int r, Read read_more) {
    const int slot = r & 1;
    Barrier::wait(&full[slot], (r >> 1) & 1);
    const int u = next[slot];
    read_more(slot, u);
    __syncwarp();
    arrive_if(&empty[slot], threadIdx.x % 32 == 0);
    return u;
  }
  __device__ __forceinline__ int read(int r) {
    return read(r, [](int, int) {});
  }
};

}  // namespace jax_varlen::cuda::sm90
