// What the last CUDA forward and backward of this process launched (dispatch.cu records it
// when XLA runs a handler; a captured CUDA graph replays kernels without it): the path's row
// after the alignment check (FwdPath / BwdPath, plan/plan.h), the keys per split-KV chunk (0:
// one pass), whether the forward read a paged cache in place and whether it
// could pack query heads (pack-GQA); -1 before any call. Tests read it through the extension's last_launch() to prove
// which kernel served a call. Plain C++ (no CUDA headers): bindings.cc includes it.
#pragma once

#include <cstdint>

namespace jax_varlen::cuda {

struct LaunchRecord {
  int fwd_path = -1, bwd_path = -1;
  int64_t split_keys = 0;
  bool split_persistent = false;  // the split-KV forward ran on a persistent grid (Plan::split_persistent)
  bool paged = false;
  bool pack_gqa = false;  // the Hopper forward could pack query heads (Plan::pack_gqa)
  bool dynamic_units = false;  // the Hopper forward took its units from a counter
  int fwd_block_n = 0;  // the Hopper forward's keys per tile (0: another path)
  bool lean_units = false;  // the Hopper forward ran its lean kernel (Plan::lean_units)
  bool fwd_plain_tiles = false;  // the Hopper forward ran its plain-tile loop (Plan::fwd_plain_tiles, no softcap)
  bool fwd_mixed_order = false;  // the Hopper forward ranked a packed list in the mixed order (Plan::fwd_mixed_order)
};
LaunchRecord last_launch();

}  // namespace jax_varlen::cuda
