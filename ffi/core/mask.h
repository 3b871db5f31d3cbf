// The one mask predicate of the op, shared by the CPU loops and every CUDA kernel (host and
// device): which keys a query row may attend to, and the clamp that keeps lengths inside the
// buffers.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JV_HOST_DEVICE inline
#endif

namespace jax_varlen {

// Clamp a (possibly invalid, traced) length into [0, extent]: memory past the buffers is never
// read, whatever the caller passed.
JV_HOST_DEVICE int64_t clamp_seqlen(int64_t n, int64_t extent) {
  return n < 0 ? 0 : (n > extent ? extent : n);
}

// The mask of a call: the tail-aligned causal rule and a local window around each query's
// position p = i + n - seqlen_q (row i of seqlen_q, n valid keys): key j is allowed iff
//   j < n,  p - left <= j (left >= 0),  j <= p + right (right >= 0),  j <= p (causal).
// -1 leaves a side of the window unbounded; a window of (-1, -1) is no window. jax.nn's
// local_window_size convention: an int w is (w, w).
struct MaskSpec {
  bool causal = false;
  int64_t left = -1, right = -1;
};

// A half-open interval [begin, end) of keys or rows; empty when end <= begin.
struct Range {
  int64_t begin, end;
  JV_HOST_DEVICE bool empty() const { return end <= begin; }
};

// Keys [begin, end) that query row i may attend to (both bounds grow with i, by at most one
// per row). Worked examples: seqlen_q = n = 6, causal, left = 2: row 4 (p = 4) sees keys 2..4;
// causal without a window, seqlen_q = 4, n = 2: rows 0..3 see [0, 0), [0, 0), [0, 1), [0, 2)
// (the leading two rows are empty: zeros, lse = -inf).
JV_HOST_DEVICE Range key_range(const MaskSpec& m, int64_t i, int64_t n, int64_t seqlen_q) {
  const int64_t p = i + n - seqlen_q;
  int64_t end = n;
  if (m.causal && p + 1 < end) end = p + 1;
  if (m.right >= 0 && p + m.right + 1 < end) end = p + m.right + 1;
  int64_t begin = m.left >= 0 && p - m.left > 0 ? p - m.left : 0;
  if (end < begin) end = begin;
  return {begin, end};
}

// Whether query row i may attend to key j: the predicate key_range's bounds describe, for
// kernels that test one (row, key) pair at a time (a masked tile's elements).
JV_HOST_DEVICE bool key_allowed(const MaskSpec& m, int64_t i, int64_t j, int64_t n, int64_t seqlen_q) {
  const int64_t p = i + n - seqlen_q;
  return j >= 0 && j < n && (!m.causal || j <= p) && (m.right < 0 || j <= p + m.right) && (m.left < 0 || j >= p - m.left);
}

// The allowed pairs of real rows and keys (i < seqlen_q, j < n) as a band of diagonals:
// lo <= j - i <= hi, in 32 bits (INT32_MIN / INT32_MAX where a side is unbounded), for kernels
// that test every (row, key) pair of a tile: at position p = i + n - seqlen_q, j <= p (causal),
// j <= p + right and j >= p - left (a window).
struct DiagonalBand {
  int32_t lo, hi;
};
JV_HOST_DEVICE DiagonalBand diagonal_band(const MaskSpec& m, int64_t n, int64_t seqlen_q) {
  const int64_t shift = n - seqlen_q;
  int64_t hi = INT32_MAX, lo = INT32_MIN;
  if (m.causal) hi = shift;
  if (m.right >= 0 && shift + m.right < hi) hi = shift + m.right;
  if (m.left >= 0) lo = shift - m.left;
  return {int32_t(lo < INT32_MIN ? INT32_MIN : (lo > INT32_MAX ? INT32_MAX : lo)),
          int32_t(hi < INT32_MIN ? INT32_MIN : hi)};
}

// Keys that some row of [i0, i1) may attend to: [begin of row i0, end of row i1 - 1), since
// both bounds grow with the row (a superset when the rows' ranges do not overlap).
JV_HOST_DEVICE Range key_range(const MaskSpec& m, int64_t i0, int64_t i1, int64_t n, int64_t seqlen_q) {
  if (i1 <= i0) return {0, 0};
  const Range first = key_range(m, i0, n, seqlen_q), last = key_range(m, i1 - 1, n, seqlen_q);
  return {first.begin, last.end > first.begin ? last.end : first.begin};
}

// Query rows [begin, end), within [0, seqlen_q), that may attend to some key of [j0, j1): the
// inverse of key_range, for a backward that walks key blocks. Row i sees key j iff its position
// p = i + n - seqlen_q lies in [j (causal) or j - right (right >= 0), j + left (left >= 0)].
JV_HOST_DEVICE Range row_range(const MaskSpec& m, int64_t j0, int64_t j1, int64_t n, int64_t seqlen_q) {
  if (j1 > n) j1 = n;
  if (j0 < 0) j0 = 0;
  if (j1 <= j0 || seqlen_q <= 0) return {0, 0};
  const int64_t shift = n - seqlen_q;  // p = i + shift
  int64_t begin = 0, end = seqlen_q;
  // The lowest position that sees a key of the block, when causal or a right bound sets one.
  // (No INT64_MIN sentinel here: `INT64_MIN - shift` overflows, which is undefined; with one,
  // the GPU backward got an empty range for every non-causal key block, dK = dV = 0, on an
  // H100 on 2026-12-06, while the host build was right.)
  if (m.causal || m.right >= 0) {
    int64_t p_lo = m.right >= 0 ? j0 - m.right : j0;
    if (m.causal && j0 > p_lo) p_lo = j0;
    if (p_lo - shift > begin) begin = p_lo - shift;
  }
  if (m.left >= 0 && j1 - 1 + m.left - shift + 1 < end) end = j1 - 1 + m.left - shift + 1;
  if (end < begin) end = begin;
  return {begin, end};
}

// Tiles of kBlock rows (or keys) that hold some element of r: [r.begin / kBlock, ceil(r.end /
// kBlock)), or [0, 0) for an empty r.
template <int kBlock>
JV_HOST_DEVICE Range tiles_of(const Range& r) {
  return r.empty() ? Range{0, 0} : Range{r.begin / kBlock, (r.end + kBlock - 1) / kBlock};
}
// The key tiles of kBlockN keys that query rows [i0, i1) may see (key_range's, in tiles).
template <int kBlockN>
JV_HOST_DEVICE Range key_tiles(const MaskSpec& m, int64_t i0, int64_t i1, int64_t n, int64_t seqlen_q) {
  return tiles_of<kBlockN>(key_range(m, i0, i1, n, seqlen_q));
}
// The row tiles of kBlockM query rows that see some key of [j0, j1) (row_range's, in tiles).
template <int kBlockM>
JV_HOST_DEVICE Range row_tiles(const MaskSpec& m, int64_t j0, int64_t j1, int64_t n, int64_t seqlen_q) {
  return tiles_of<kBlockM>(row_range(m, j0, j1, n, seqlen_q));
}
// Whether the tile of query rows [i0, i1) and keys [j0, j1) holds a pair the mask removes or a
// row past the real ones: unless every row is real and sees every key of the tile. Both bounds
// of a row's keys grow with the row, so the first row's end and the last row's begin decide.
// In the callers' integer type (the kernels' int: in 64 bits the loop around it compiled
// differently).
template <typename Int>
JV_HOST_DEVICE bool tile_needs_mask(const MaskSpec& m, Int i0, Int i1, Int j0, Int j1, Int n, Int seqlen_q) {
  return i1 > seqlen_q || key_range(m, i0, n, seqlen_q).end < j1 || key_range(m, i1 - 1, n, seqlen_q).begin > j0;
}

// The first query row that sees some key; seqlen_q when none does. The rows before it see none
// and every row from it on sees one: a row's key range only grows with the row, and it is empty
// only while it ends at or before key 0 (its start stays below n: p - left <= n - 1).
JV_HOST_DEVICE int64_t first_row_with_keys(const MaskSpec& m, int64_t n, int64_t seqlen_q) {
  const Range rows = row_range(m, 0, n, n, seqlen_q);
  return rows.empty() ? seqlen_q : rows.begin;
}

}  // namespace jax_varlen
