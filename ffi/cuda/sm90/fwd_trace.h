// The Hopper forward's unit trace: a profiling build's record of when each step of each unit
// happened on its SM, to see where a unit's time beside its tiles goes (the Q wait, the last
// P V, the epilogue, the hand-over) -- what Nsight Compute's aggregate stall counts cannot
// show. Built only with -DJAX_VARLEN_FWD_TRACE=ON (CMake), read by benchmarks/unit_trace.py
// through the extension's fwd_trace(); in every other build the marks below compile to nothing
// and the kernels are the same.
//
// Layout: kTraceCtas CTAs x (1 + kTraceRounds) rows x kTraceFields int64. A CTA's row 0 is its
// header: globaltimer ns and clock64 at its start, its SM, the grid, the list's units, then
// globaltimer ns and clock64 at its first consumer thread's end. Row 1 + r is its r-th unit: the
// unit's sequence, tiles and rows, then the SM clock at each FwdMark (clock64 counts one SM's
// cycles: compare marks within a CTA only). -1 where nothing was written: a round past the CTA's
// last unit, a mark its path does not reach (an idle warpgroup of a lean unit marks only
// kTraceGot and kTraceStored).
#pragma once

#include <cstdint>

namespace jax_varlen::cuda::sm90 {

inline constexpr int kTraceCtas = 256, kTraceRounds = 255, kTraceFields = 16;
inline constexpr int64_t kTraceValues = int64_t(kTraceCtas) * (1 + kTraceRounds) * kTraceFields;

// The fields of a unit's row. The consumer marks are per warpgroup: field kTraceGot + k of
// warpgroup 0 is field kTraceGot + kTraceWarpgroupStride + k of warpgroup 1.
enum FwdMark : int {
  kTraceSeq = 0,      // the unit's sequence (Unit::b)
  kTraceTiles = 1,    // its key tiles (n_tiles - t_begin; 0: no row sees a key)
  kTraceRows = 2,     // its query rows (Unit::rows)
  kTraceClaim = 3,    // producer: the unit claimed and decoded
  kTraceQIssued = 4,  // producer: the previous Q released and this one's copy issued
  kTraceLoaded = 5,   // producer: the unit's last copy issued
  kTraceGot = 6,      // consumer warpgroup: the unit in hand
  kTraceQ = 7,        //   its Q tile landed (full_q)
  kTraceLoop = 8,     //   the last Q K^T done (empty_q released)
  kTraceMma = 9,      //   the last P V done
  kTraceStored = 10,  //   the epilogue's stores issued
};
inline constexpr int kTraceWarpgroupStride = 5;

#ifdef JAX_VARLEN_FWD_TRACE
#define JV_FWD_TRACE(...) __VA_ARGS__
// The device buffer (nullptr until the first fwd_trace_read; dispatch.cu) and its copy into
// host (kTraceValues values; allocates the buffer on the first call, then refills it with -1).
// Host code, one device; fwd_trace_read returns false when a CUDA call failed.
int64_t* fwd_trace_device_buffer();
bool fwd_trace_read(int64_t* host);
#else
#define JV_FWD_TRACE(...)
#endif

#ifdef __CUDACC__
// Row 1 + r of this CTA, or nullptr past the buffer (or without one).
__device__ __forceinline__ int64_t* trace_row(int64_t* buffer, int r) {
  if (buffer == nullptr || blockIdx.x >= kTraceCtas || r >= kTraceRounds) return nullptr;
  return buffer + (int64_t(blockIdx.x) * (1 + kTraceRounds) + 1 + r) * kTraceFields;
}
__device__ __forceinline__ void trace_set(int64_t* row, int field, int64_t value) {
  if (row != nullptr) *reinterpret_cast<volatile int64_t*>(row + field) = value;
}
__device__ __forceinline__ void trace_mark(int64_t* row, int field) { trace_set(row, field, clock64()); }
// This CTA's header row (row 0), or nullptr.
__device__ __forceinline__ int64_t* trace_header_row(int64_t* buffer) {
  if (buffer == nullptr || blockIdx.x >= kTraceCtas) return nullptr;
  return buffer + int64_t(blockIdx.x) * (1 + kTraceRounds) * kTraceFields;
}
__device__ __forceinline__ int64_t globaltimer_ns() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return int64_t(ns);
}
// Its start (thread 0, before the roles part): fields 0-4.
__device__ __forceinline__ void trace_header(int64_t* buffer, int num_units) {
  int64_t* row = trace_header_row(buffer);
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  trace_set(row, 0, globaltimer_ns());
  trace_mark(row, 1);
  trace_set(row, 2, sm);
  trace_set(row, 3, gridDim.x);
  trace_set(row, 4, num_units);
}
// Its end (the first consumer thread, after its last unit): fields 5 and 6 (their ratio to the
// start's gives the SM clock).
__device__ __forceinline__ void trace_footer(int64_t* buffer) {
  int64_t* row = trace_header_row(buffer);
  trace_set(row, 5, globaltimer_ns());
  trace_mark(row, 6);
}
#endif

}  // namespace jax_varlen::cuda::sm90
