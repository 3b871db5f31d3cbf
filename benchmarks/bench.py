"""Times jax_varlen.attention against jax.nn.dot_product_attention (cudnn, xla) and, when they
are importable, FlashAttention-3's JAX binding (flash-attn3-jax, impl "fa3") and a current
FlashAttention-3 build for JAX (dew-flash-attn-cu13's dew_flash_attn.flash_mha, impl "dew3":
fixed-length, so full shapes only) on named shapes: the forward ("fwd"), and a training step
("train": forward + backward of sum(out * dO) through jax.vjp) with the backward alone ("bwd").
The packed layout: jax_varlen.packed_attention ("jax_varlen_packed"), FA3's flash_mha_varlen
("fa3_packed") and dew_flash_attn.flash_mha_varlen with the keys by their own offsets
("dew3_packed") on the same valid tokens with the padding dropped (class Packed). A shape with
`lengths_q` (padded query rows, e.g. prefill-right-padded) passes them as nonpad_q_seqlen /
query_seq_lengths / seqused_q. The paged layout (decode-paged): jax_varlen.paged_attention
("jax_varlen_paged") and FA3's flash_mha_with_kvcache with page_table ("fa3_paged", best
num_splits) on the same shuffled pages (class Paged); pass them with --impls. A shape an impl
cannot run (a paged shape for a non-paged impl and the reverse, a windowed shape for an impl
without a window, a packed-layout shape for a padded impl, padded query rows for an impl
without a query-length argument, ragged lengths for dew3) gets a record with the reason in
`skipped` (skip_reason). dew3 and dew3_packed are reported beside FA3 but are not the peers
of the issues' targets (bench_report.BEST_OF, PACKED_TARGETS).

On a GPU machine:   python3 benchmarks/bench.py [--shapes d128-full,...] [--decode] [--quick]
                    python3 benchmarks/bench.py --passes train      # train + bwd records
CPU smoke test:     JAX_PLATFORMS=cpu python benchmarks/bench.py --cpu-smoke --passes both

Every impl sees the same inputs (finite, N(0, 1), padding included). Results go to
<out>/<YYYY-MM-DD>-<device>-<tag>.json (records in shapes.json's `result_record` format), .md
(a summary against the issues' targets, then every record) and .png (when matplotlib is
there); all three are rewritten after every shape, so a run cut short keeps what finished.
"""

import argparse
import datetime
import functools
import importlib.metadata
import inspect
import json
import math
import os
import statistics
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

import bench_metrics as metrics
import bench_report as report

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PEERS = ("cudnn", "xla")
FA3 = "fa3"  # flash-attn3-jax: flash_mha_varlen with seqused_k = our lengths (bottom-right causal)
OURS_PACKED = "jax_varlen_packed"  # jax_varlen.packed_attention on the packed tokens
FA3_PACKED = "fa3_packed"  # flash_mha_varlen on the packed tokens (no seqused_k)
# dew-flash-attn-cu13 (dew_flash_attn), a current FlashAttention-3 build for JAX with its own
# backward: flash_mha on full shapes only (it takes no lengths), and flash_mha_varlen on the
# packed tokens with the keys by their own offsets. Not a target peer (bench_report's BEST_OF).
DEW3 = "dew3"
DEW3_PACKED = "dew3_packed"
PACKED_IMPLS = (OURS_PACKED, FA3_PACKED, DEW3_PACKED)
OURS_PAGED = "jax_varlen_paged"  # jax_varlen.paged_attention on the paged cache
FA3_PAGED = "fa3_paged"  # flash_mha_with_kvcache with page_table on the same cache
PAGED_IMPLS = (OURS_PAGED, FA3_PAGED)
SMOKE_DIV = 32  # --cpu-smoke divides Sq, Skv and lengths by this and keeps B <= 2
L2_BYTES = 50 << 20  # H200 L2; inputs below 4x this are rotated among 3 sets
CHECK_SEQS = 2  # sequences compared against the fp32 reference
# Forward records by default (issue 11's shapes and issue 31's prefill-right-padded); the other
# shapes of shapes.json run when named (--shapes, or --shapes all).
FWD_SHAPES = ("d128-full", "d128-skewed", "d128-causal-full", "d128-causal-skewed", "d64-full",
              "d64-skewed", "d128-long-causal", "d128-long-causal-skewed", "prefill-right-padded")
# Training records (issues 12, 31): these shapes, these impls (XLA's padded backward is not a
# peer). dew3 and dew3_packed come last here and in --impls: under --budget-s a shape's
# target peers are measured first.
TRAIN_SHAPES = ("d128-full", "d128-skewed", "d128-causal-full", "d128-causal-skewed",
                "d64-full", "d64-skewed", "prefill-right-padded")
TRAIN_IMPLS = "jax_varlen,cudnn,fa3,jax_varlen_packed,fa3_packed,dew3,dew3_packed"
EXTRA_DTYPES = "float16:d128-full,d128-skewed"  # forward only (issue 11)
# (repeats, seconds per repeat): forward, forward --quick, train/bwd, train/bwd --quick
TIMING = {"fwd": (7, 0.3), "fwd-quick": (3, 0.05), "train": (3, 0.2), "train-quick": (2, 0.05)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", help="comma-separated names from shapes.json, or 'all' (every "
                   "non-decode shape; --decode adds the decode shapes); default: --fwd-shapes "
                   "(plus the decode shapes with --decode) and --train-shapes")
    p.add_argument("--decode", action="store_true", help="include decode shapes (Sq == 1)")
    p.add_argument("--list-layout", choices=("padded", "packed", "paged"),
                   help="print the --shapes of this layout (comma-separated) and exit: h200.sh's "
                   "ab stage times each shape by the impl of its layout")
    p.add_argument("--fwd-shapes", default=",".join(FWD_SHAPES),
                   help="forward shapes when --shapes is not given")
    p.add_argument("--passes", choices=("fwd", "train", "both"), default="fwd",
                   help="fwd: forward records; train: train + bwd records; both (default fwd)")
    p.add_argument("--no-bwd", action="store_true",
                   help="train pass: the training step only, no record of the backward alone "
                        "(h200.sh's ab stage: half the compiles and timing loops)")
    p.add_argument("--impls",
                   default="jax_varlen,cudnn,fa3,xla,jax_varlen_packed,fa3_packed,dew3,dew3_packed",
                   help="forward impls")
    p.add_argument("--train-impls", default=TRAIN_IMPLS, help="train/bwd impls")
    p.add_argument("--train-shapes", default=",".join(TRAIN_SHAPES),
                   help="train/bwd shapes when --shapes is not given")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--extra-dtype", action="append", metavar="DTYPE:SHAPES",
                   help="forward records in another dtype for those of the selected shapes, "
                   f"repeatable (default {EXTRA_DTYPES}; 'none' for none)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--tag", help="file-name suffix (default: fwd, train or fwd-train)")
    p.add_argument("--quick", action="store_true", help="fewer repeats, shorter timing loops")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="stop starting new measurements after this many seconds and record "
                   "the rest as skipped (0: no limit); results are written after every shape")
    p.add_argument("--step-budget-s", type=float, default=20.0,
                   help="bound on the timing loop of one train/bwd measurement (seconds): "
                   "fewer repeats and iterations for a slow step")
    p.add_argument("--fa3-splits", default="1,2,4,8,16",
                   help="decode shapes: FA3's num_splits values tried; the fastest is recorded")
    p.add_argument("--no-plot", action="store_true", help="do not write the .png")
    p.add_argument("--cpu-smoke", action="store_true",
                   help=f"shrink shapes (/{SMOKE_DIV}, B <= 2) and skip cudnn, to test on CPU")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Shapes and inputs

def load_shapes():
    """shapes.json's shapes (a copy of the project's shared list), each with its padded
    rectangle (B, Sq, Skv; bench_metrics.padded_extent fills them in for a packed shape)."""
    with open(os.path.join(HERE, "shapes.json")) as f:
        return {n: metrics.padded_extent(s) for n, s in json.load(f)["shapes"].items()}


def select_shapes(all_shapes, names, decode):
    """names: comma-separated shape names or 'all' (every non-decode shape, decode ones too
    with `decode`)."""
    if names == "all":
        return {n: s for n, s in all_shapes.items() if decode or s["Sq"] != 1}
    unknown = [n for n in names.split(",") if n not in all_shapes]
    if unknown:
        sys.exit(f"unknown shapes {unknown}; known: {list(all_shapes)}")
    return {n: all_shapes[n] for n in names.split(",")}


def parse_extra_dtypes(values, selected):
    """['float16:d128-full,d128-skewed'] -> [('float16', ['d128-full', 'd128-skewed'])], keeping
    only selected shapes; None -> the default; 'none' -> []."""
    out = []
    for value in values if values is not None else [EXTRA_DTYPES]:
        if value.lower() in ("", "none"):
            continue
        dtype, _, names = value.partition(":")
        jnp.dtype(dtype)  # fails early on a typo
        out.append((dtype, [n for n in names.split(",") if n in selected]))
    return out


def shrink(shape):
    """--cpu-smoke: e.g. d128-skewed B=8, Sq=Skv=4096, lengths [4096, 685, ...]
    -> B=2, Sq=Skv=128, lengths [128, 21] (lengths_q alike). Decode keeps Sq = 1; lengths stay
    >= 1."""
    s = {k: v for k, v in shape.items() if not k.startswith("measured")}  # H200 numbers
    s["Sq"] = max(1, shape["Sq"] // SMOKE_DIV)
    s["Skv"] = max(1, shape["Skv"] // SMOKE_DIV)
    s["lengths"] = [min(s["Skv"], max(1, n // SMOKE_DIV)) for n in shape["lengths"][:2]]
    if "lengths_q" in shape:
        s["lengths_q"] = [min(s["Sq"], max(1, n // SMOKE_DIV)) for n in shape["lengths_q"][:2]]
    if shape.get("local_window_size") is not None:  # the window shrinks with the keys
        s["local_window_size"] = [w // SMOKE_DIV for w in metrics.window_pair(shape["local_window_size"])]
    s["B"] = len(s["lengths"])
    return s


def input_bytes(shape, itemsize):
    """q [B, Sq, H, D] + k [B, Skv, Hkv, D] + v [B, Skv, Hkv, Dv] + out [B, Sq, H, Dv]."""
    b, sq, skv = shape["B"], shape["Sq"], shape["Skv"]
    return itemsize * b * (sq * shape["H"] * (shape["D"] + shape["Dv"])
                           + skv * shape["Hkv"] * (shape["D"] + shape["Dv"]))


def make_inputs(shape, dtype, seed, index):
    """One input set (q, k, v, lengths); set `index` uses its own random stream. Padded query
    rows (lengths_q) are random too: the impls must not read them."""
    b, sq, skv, h, hkv = shape["B"], shape["Sq"], shape["Skv"], shape["H"], shape["Hkv"]
    kq, kk, kv = jax.random.split(jax.random.fold_in(jax.random.key(seed), index), 3)
    q = jax.random.normal(kq, (b, sq, h, shape["D"]), dtype)  # [B, Sq, H, D]
    k = jax.random.normal(kk, (b, skv, hkv, shape["D"]), dtype)  # [B, Skv, Hkv, D]
    v = jax.random.normal(kv, (b, skv, hkv, shape["Dv"]), dtype)  # [B, Skv, Hkv, Dv]
    lengths = jnp.asarray(shape["lengths"], jnp.int32)  # [B]
    return jax.block_until_ready((q, k, v, lengths))


def make_set(shape, dtype, seed, index):
    """make_inputs(), plus lengths_q [B] int32 when some query rows are padding:
    (q, k, v, lengths[, lengths_q]). The padded impls take lengths_q as an optional fifth
    argument."""
    inputs = make_inputs(shape, dtype, seed, index)
    if not metrics.has_q_padding(shape):
        return inputs
    return (*inputs, jnp.asarray(metrics.q_lengths(shape), jnp.int32))


def make_dout(shape, dtype, seed, index):
    """The output cotangent dO [B, Sq, H, Dv] of input set `index` (its own random stream),
    zero on padded query rows (i >= lengths_q[b]), as a loss over the real tokens gives."""
    key = jax.random.fold_in(jax.random.key(seed), 1000 + index)
    dout = jax.random.normal(key, (shape["B"], shape["Sq"], shape["H"], shape["Dv"]), dtype)
    if metrics.has_q_padding(shape):
        real = jnp.arange(shape["Sq"])[None, :] < jnp.asarray(metrics.q_lengths(shape))[:, None]
        dout = jnp.where(real[:, :, None, None], dout, 0).astype(dtype)
    return dout


class Paged:
    """A paged-layout shape's KV cache (shapes.json layout "paged"), for the paged impls: the
    padded keys and values [B, Skv, Hkv, D] cut into pages of `page_size` rows, B * Skv /
    page_size pages in a random order (seed 0): block_table [B, Skv / page_size] int32, page
    block_table[b, p] = rows p * page_size .. of sequence b. pack() runs before the timing; the
    output is padded [B, Sq, H, Dv] as the padded impls give it."""

    def __init__(self, shape):
        self.page_size = int(shape["page_size"])
        b, skv = shape["B"], shape["Skv"]
        assert skv % self.page_size == 0, "a paged shape's Skv is whole pages"
        self.pages = skv // self.page_size  # per sequence
        perm = np.random.default_rng(0).permutation(b * self.pages)
        self.table = jnp.asarray(perm.reshape(b, self.pages).astype(np.int32))
        self.order = jnp.asarray(np.argsort(perm))  # cache page -> its (b, p) in order

    def pack(self, q, k, v, lengths, *rest):
        """make_set()'s (q, k, v, lengths) -> (q, key_cache, value_cache, block_table,
        lengths)."""
        def cache(x):  # [B, Skv, Hkv, d] -> [B * pages, page_size, Hkv, d], shuffled
            pages = x.reshape(x.shape[0] * self.pages, self.page_size, *x.shape[2:])
            return pages[self.order]
        return jax.block_until_ready((q, cache(k), cache(v), self.table, lengths, *rest))


class Packed:
    """A named shape's valid tokens without the padding, for the packed impls: q [sum(lengths_q),
    H, D] (the real query rows of each sequence, one after another; every row when the shape
    has no lengths_q), k and v [sum(lengths), Hkv, D or Dv] (the valid keys), cu_seqlens_q and
    cu_seqlens_k their cumulative sums, and the static hints max_seqlen_q / max_seqlen_k (the
    longest of each). pack() runs before the timing; the unpack_* are for the checks only (zeros
    on the padded rows)."""

    def __init__(self, shape):
        self.b, self.sq, self.skv = shape["B"], shape["Sq"], shape["Skv"]
        self.with_lengths_q = metrics.has_q_padding(shape)  # make_set's fifth element
        lens_q = [min(max(int(n), 0), self.sq) for n in metrics.q_lengths(shape)]
        lens = [min(max(int(n), 0), self.skv) for n in shape["lengths"]]
        self.queries = self._rows(lens_q, self.sq)  # rows of the flattened [B * Sq] query axis
        self.keys = self._rows(lens, self.skv)  # rows of the flattened [B * Skv] key axis
        self.cu_q = jnp.asarray(np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32))
        self.cu_k = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        self.hints = {"max_seqlen_q": max(max(lens_q), 1), "max_seqlen_k": max(max(lens), 1)}

    @staticmethod
    def _rows(lens, extent):
        """[0, 1, 2, 4096, 4097] for lens [3, 2], extent 4096."""
        return jnp.asarray(np.concatenate(
            [b * extent + np.arange(n) for b, n in enumerate(lens)]).astype(np.int32))

    def pack(self, q, k, v, lengths, *rest):
        """make_set()'s (q, k, v, lengths[, lengths_q])[, dO] padded -> (q, k, v, cu_seqlens_q,
        cu_seqlens_k[, dO]) packed."""
        del lengths  # in cu_seqlens_k
        douts = rest[1:] if self.with_lengths_q else rest  # lengths_q is in cu_seqlens_q
        flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
        return jax.block_until_ready((flat(q)[self.queries], flat(k)[self.keys],
                                      flat(v)[self.keys], self.cu_q, self.cu_k,
                                      *(flat(d)[self.queries] for d in douts)))

    @staticmethod
    def _scatter(x, rows, batch, extent):
        full = jnp.zeros((batch * extent, *x.shape[1:]), x.dtype).at[rows].set(x)
        return full.reshape(batch, extent, *x.shape[1:])

    def unpack_out(self, out):
        """out [sum(lengths_q), H, Dv] -> [B, Sq, H, Dv], zeros on the padded query rows."""
        return self._scatter(out, self.queries, self.b, self.sq)

    def unpack_grads(self, grads):
        """(dq, dk, dv) packed -> padded, zeros for the padded queries and keys."""
        d_q, d_k, d_v = grads
        return (self.unpack_out(d_q), self._scatter(d_k, self.keys, self.b, self.skv),
                self._scatter(d_v, self.keys, self.b, self.skv))


# ---------------------------------------------------------------------------------------------
# Implementations: name -> (fn(q, k, v, lengths, lengths_q=None, *, scale, is_causal), causal
# mask alignment); the packed ones take Packed.pack()'s (q, k, v, cu_seqlens_q, cu_seqlens_k)
# and its hints.

# impl -> why it cannot run a shape with padded query rows (lengths_q), set by build_impls.
NO_Q_LENGTHS = {}

def import_jax_varlen():
    """Returns (module, None) or (None, error string); a source tree is tried as a fallback."""
    try:
        import jax_varlen
        return jax_varlen, None
    except ImportError:
        sys.path.insert(0, REPO)
    try:
        import jax_varlen
        return jax_varlen, None
    except Exception as e:  # noqa: BLE001 - any failure is recorded, not fatal
        return None, f"import jax_varlen: {type(e).__name__}: {e}"


FA3_EINOPS_STUB = False  # set when flash_attn3_jax was imported over a stand-in einops


def import_fa3():
    """flash_attn3_jax. Its package __init__ imports einops (used only by flash_mha's
    sequence-sharded path, never by flash_mha_varlen or flash_mha_with_kvcache); the device
    image installs the wheel with --no-deps, so without einops a stand-in that raises on use
    is put in its place."""
    global FA3_EINOPS_STUB
    try:
        import flash_attn3_jax
    except ModuleNotFoundError as e:
        if e.name != "einops":
            raise
        stub = types.ModuleType("einops")

        def rearrange(*args, **kwargs):
            raise ImportError("einops is not installed (bench.py's stand-in)")
        stub.rearrange = rearrange
        sys.modules["einops"] = stub
        FA3_EINOPS_STUB = True
        import flash_attn3_jax
    return flash_attn3_jax


def fa3_default_splits(batch, heads, skv, sms=132):
    """num_splits for FA3's KV-cache kernel when none is given (decode_sweep.py): one split
    when B x H blocks fill the SMs, else enough splits for about two waves, each split at
    least 256 keys."""
    blocks = batch * heads
    if blocks >= 0.8 * sms:
        return 1
    return max(1, min(128, skv // 256, -(-2 * sms // blocks)))


def fa3_fn():
    """FlashAttention-3 on our padded layout and on the packed one ((padded, packed) fns), or
    (None, error) without it. Padded, Sq > 1: the varlen forward, the rectangle flattened to
    [B*S, heads, dim] with cu_seqlens = b * S and seqused_k = lengths, which is the same
    computation (its causal mask is bottom-right, like ours) and has a backward (a custom_vjp);
    padded query rows (lengths_q) go in as seqused_q where flash_mha_varlen takes it (0.2.3 does
    not: then NO_Q_LENGTHS says so). Sq == 1: the KV-cache kernel with cache_seqlens = lengths
    and `num_splits` (forward only)."""
    try:
        fa3 = import_fa3()
        flash_mha_varlen = fa3.flash_mha_varlen
        flash_mha_with_kvcache = fa3.flash_mha_with_kvcache
    except Exception as e:  # noqa: BLE001 - optional peer
        return None, f"import flash_attn3_jax: {type(e).__name__}: {e}"
    if "seqused_q" not in inspect.signature(flash_mha_varlen).parameters:
        NO_Q_LENGTHS[FA3] = (
            f"not comparable: flash_attn3_jax {getattr(fa3, '__version__', '')}'s "
            "flash_mha_varlen takes no seqused_q: padded query rows (lengths_q) would be "
            "computed as real ones (causal: with the diagonal shifted)")

    def fn(q, k, v, n, n_q=None, *, scale, is_causal, num_splits=None, window=None):
        b, sq, h, d = q.shape
        skv, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
        n = n.astype(jnp.int32)
        if window is not None:  # full lengths only (skip_reason): the fixed-length kernel
            return fa3.flash_mha(q, k, v, softmax_scale=float(scale), is_causal=is_causal,
                                 window_size=tuple(window))
        if sq == 1 and d == dv:
            splits = num_splits or fa3_default_splits(b, h, skv)
            return flash_mha_with_kvcache(q, k, v, cache_seqlens=n, softmax_scale=float(scale),
                                          is_causal=is_causal, num_splits=splits)
        cu_q = jnp.arange(b + 1, dtype=jnp.int32) * sq
        cu_k = jnp.arange(b + 1, dtype=jnp.int32) * skv
        used_q = {} if n_q is None else {"seqused_q": n_q.astype(jnp.int32)}
        out = flash_mha_varlen(q.reshape(b * sq, h, d), k.reshape(b * skv, hkv, d),
                               v.reshape(b * skv, hkv, dv), cu_q, cu_k, seqused_k=n,
                               max_seqlen_q=sq, max_seqlen_k=skv, softmax_scale=scale,
                               is_causal=is_causal, **used_q)
        return out.reshape(b, sq, h, dv)

    def packed(q, k, v, cu_q, cu_k, *, scale, is_causal, max_seqlen_q, max_seqlen_k):
        return flash_mha_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max_seqlen_q,
                                max_seqlen_k=max_seqlen_k, softmax_scale=scale,
                                is_causal=is_causal)

    def paged(q, key_cache, value_cache, table, n, *, scale, is_causal, num_splits=None):
        splits = num_splits or fa3_default_splits(q.shape[0], q.shape[2], table.shape[1] * key_cache.shape[1])
        return flash_mha_with_kvcache(q, key_cache, value_cache, cache_seqlens=n.astype(jnp.int32),
                                      page_table=table, softmax_scale=float(scale),
                                      is_causal=is_causal, num_splits=splits)
    return (fn, packed, paged), None


def dew3_fn():
    """dew_flash_attn (the dew-flash-attn-cu13 wheel: FlashAttention-3's Hopper kernels as XLA
    FFI targets, differentiated through the kernel's own backward) on our padded layout and on
    the packed one ((padded, packed) fns), or (None, error) without it. Without a CUDA jax it
    imports but its first call raises (no gpu backend), which the record keeps as its error.
    Its window_size (left, right) counts keys before and after the query's bottom-right-aligned
    position, as our local window does: the window pair goes in as it is."""
    try:
        import dew_flash_attn
    except Exception as e:  # noqa: BLE001 - optional peer
        return None, f"import dew_flash_attn: {type(e).__name__}: {e}"

    def fn(q, k, v, n, n_q=None, *, scale, is_causal, window=None):
        # flash_mha takes no lengths: full shapes only (skip_reason), where every n == Skv and
        # no query row is padding (n_q is never given), so q [B, Sq, H, D] over the whole of
        # k, v [B, Skv, Hkv, D] is our computation (its causal mask aligned to the last key).
        del n, n_q
        return dew_flash_attn.flash_mha(q, k, v, softmax_scale=float(scale), is_causal=is_causal,
                                        window_size=(-1, -1) if window is None else tuple(window))

    def packed(q, k, v, cu_q, cu_k, *, scale, is_causal, max_seqlen_q, max_seqlen_k, window=None):
        # The keys always go by their own offsets (cu_k): without key_cu_seqlens flash_mha_varlen
        # hands the kernel the queries' offsets twice, so giving both costs nothing and covers
        # lengths_q != lengths. Causal with n_q != n_k (mixed-serve) is allowed, not skipped:
        # dew_flash_attn documents its causal mask and window as each sequence's own, aligned to
        # the last key as flash_mha's (FA3's varlen kernel offsets the diagonal by
        # seqlen_k - seqlen_q per sequence), i.e. bottom-right like ours; the check against the
        # fp32 reference on the first sequences (mixed-serve's first has n_q < n_k) would show
        # MISMATCH otherwise.
        return dew_flash_attn.flash_mha_varlen(
            q, k, v, cu_q, max_seqlen_q, softmax_scale=float(scale), is_causal=is_causal,
            window_size=(-1, -1) if window is None else tuple(window), key_cu_seqlens=cu_k,
            key_max_seqlen=max_seqlen_k)
    return (fn, packed), None


def jax_varlen_fn(jax_varlen):
    """jax_varlen.attention as a padded impl; lengths_q goes in as nonpad_q_seqlen (where this
    build's attention takes it: otherwise NO_Q_LENGTHS says so)."""
    if "nonpad_q_seqlen" not in inspect.signature(jax_varlen.attention).parameters:
        NO_Q_LENGTHS[report.OURS] = ("this build's jax_varlen.attention takes no "
                                     "nonpad_q_seqlen (padded query rows)")

    def fn(q, k, v, n, n_q=None, *, scale, is_causal, window=None):
        used = {} if n_q is None else {"nonpad_q_seqlen": n_q}
        if window is not None:  # only then: an older build (the ab stage's base) has no window
            used["local_window_size"] = window
        return jax_varlen.attention(q, k, v, n, scale=scale, is_causal=is_causal, **used)
    return fn


def jax_varlen_packed_fn(jax_varlen):
    """jax_varlen.packed_attention as a packed impl (the window as local_window_size)."""
    def fn(q, k, v, cu_q, cu_k, *, scale, is_causal, max_seqlen_q, max_seqlen_k, window=None):
        used = {} if window is None else {"local_window_size": window}  # as jax_varlen_fn
        return jax_varlen.packed_attention(q, k, v, cu_q, cu_k, scale=scale, is_causal=is_causal,
                                           max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                           **used)
    return fn


def jax_varlen_paged_fn(jax_varlen):
    """jax_varlen.paged_attention as a paged impl (Paged.pack()'s arguments)."""
    def fn(q, key_cache, value_cache, table, n, *, scale, is_causal):
        return jax_varlen.paged_attention(q, key_cache, value_cache, table, n, scale=scale,
                                          is_causal=is_causal)
    return fn


def jax_nn_fn(implementation):
    """jax.nn.dot_product_attention (top-left causal) as a padded impl: key_value_seq_lengths
    = lengths and, on shapes with padded query rows, query_seq_lengths = lengths_q."""
    def fn(q, k, v, n, n_q=None, *, scale, is_causal, window=None):
        # With a window, no lengths: jax.nn's cuDNN path rejects a window with them (jax-ml/jax
        # #39576); skip_reason keeps windowed peers to full lengths, where they change nothing.
        return jax.nn.dot_product_attention(q, k, v, query_seq_lengths=n_q,
                                            key_value_seq_lengths=None if window else n,
                                            scale=scale, is_causal=is_causal,
                                            implementation=implementation,
                                            local_window_size=window)
    return fn


def build_impls(names, jax_varlen, import_errors):
    """{name: (fn, mask alignment)} for the importable ones; import failures go to
    import_errors[name] (recorded as errors, the run goes on)."""
    impls = {}
    for name in names:
        if name == report.OURS:
            if jax_varlen is not None:
                impls[name] = (jax_varlen_fn(jax_varlen), metrics.TAIL)
        elif name == OURS_PACKED:
            if jax_varlen is not None:
                impls[name] = (jax_varlen_packed_fn(jax_varlen), metrics.TAIL)
            else:
                import_errors[name] = import_errors.get(report.OURS, "jax_varlen not imported")
        elif name == OURS_PAGED:
            if jax_varlen is not None:
                impls[name] = (jax_varlen_paged_fn(jax_varlen), metrics.TAIL)
            else:
                import_errors[name] = import_errors.get(report.OURS, "jax_varlen not imported")
        elif name in (FA3, FA3_PACKED, FA3_PAGED):
            fns, err = fa3_fn()
            if fns is None:
                import_errors[name] = err
            else:
                impls[name] = (fns[(FA3, FA3_PACKED, FA3_PAGED).index(name)], metrics.TAIL)
        elif name in (DEW3, DEW3_PACKED):
            fns, err = dew3_fn()
            if fns is None:
                import_errors[name] = err
            else:
                impls[name] = (fns[(DEW3, DEW3_PACKED).index(name)], metrics.TAIL)
        elif name in PEERS:
            impls[name] = (jax_nn_fn(name), metrics.TOP_LEFT)
        else:
            sys.exit(f"unknown impl {name!r}; known: {report.OURS}, {FA3}, {DEW3}, "
                     f"{', '.join(PEERS)}, {', '.join(PACKED_IMPLS)}, {', '.join(PAGED_IMPLS)}")
    return impls


# ---------------------------------------------------------------------------------------------
# Timing and checking

def time_ms(fn, input_sets, repeats, target_s, budget_s=None):
    """Median over `repeats` of (elapsed / n_iter) for n_iter calls issued back to back and
    synchronized once at the end, cycling through input_sets. fn is compiled and warm.
    budget_s bounds the timing loop (repeats and n_iter shrink for a slow fn, to 1 and 1)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*input_sets[0]))
    one = time.perf_counter() - t0
    if budget_s is None or 4 * one <= budget_s:
        jax.block_until_ready(fn(*input_sets[0]))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*input_sets[1 % len(input_sets)]))
        one = time.perf_counter() - t0
    n_iter = max(3, min(1000, math.ceil(target_s / max(one, 1e-6))))
    if budget_s is not None:
        repeats = max(1, min(repeats, int(budget_s // (3 * max(one, 1e-6)))))
        n_iter = max(1, min(n_iter, int(budget_s // (repeats * max(one, 1e-6)))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(n_iter):
            out = fn(*input_sets[i % len(input_sets)])
        jax.block_until_ready(out)  # one stream: the last call finishing means all have
        times.append((time.perf_counter() - t0) / n_iter)
    return 1e3 * statistics.median(times)


def checked_seqs(lengths, seqlen_q, align, is_causal, lengths_q=None):
    """The first CHECK_SEQS sequences where the impl's mask equals ours (a top-left causal mask
    equals the tail-aligned one only when n_b == n_q, the real query rows: Sq without
    lengths_q)."""
    n_q = lengths_q if lengths_q is not None else [seqlen_q] * len(lengths)
    return [b for b, (n, m) in enumerate(zip(lengths[:CHECK_SEQS], n_q))
            if align == metrics.TAIL or not is_causal or n == m]


def _verdict(err, tol):
    if err is None:
        return {"max_err": None, "check": "skipped (masks differ)"}
    if math.isnan(err):
        return {"max_err": None, "check": "non-finite output"}
    return {"max_err": err, "check": "ok" if err <= tol else "MISMATCH"}


def check(out, ref, has_key, lengths, seqlen_q, align, is_causal, lengths_q=None):
    """Max abs error of `out` against the fp32 reference on the checked sequences, over the
    rows that see a key (has_key is False on padded query rows)."""
    seqs = checked_seqs(lengths, seqlen_q, align, is_causal, lengths_q)
    return _verdict(metrics.max_abs_err(out, ref, has_key, seqs), metrics.MAX_ERR_TOL)


def check_grads(grads, ref_grads, has_key, lengths, seqlen_q, align, is_causal,
                lengths_q=None):
    """Worst relative error of (dq, dk, dv) against the fp32 reference's gradients (dq on the
    rows that see a key, dk and dv on the valid keys)."""
    seqs = checked_seqs(lengths, seqlen_q, align, is_causal, lengths_q)
    err = metrics.max_rel_grad_err(grads, ref_grads, has_key, lengths, seqs)
    return _verdict(err, metrics.GRAD_REL_TOL)


def error_string(e):
    return f"{type(e).__name__}: {e}"[:1000]


def new_record(base, shape_name, impl, **extra):
    """A `result_record` of shapes.json, keys in its order; ms/eff_* are filled after timing.
    extra may override "pass" and "dtype"."""
    return {"shape": shape_name, "impl": impl, "pass": "fwd", "dtype": base["dtype"], "ms": None,
            "eff_tflops": None, "eff_tbps": None, **base, **extra}


class Clock:
    """The run's time budget (--budget-s; 0 is none)."""

    def __init__(self, budget_s):
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s if budget_s > 0 else math.inf

    def spent(self):
        return time.monotonic() > self.deadline

    def skip_reason(self):
        return f"time budget ({self.budget_s:.0f} s) spent"


def skip_reason(impl, shape, pass_):
    """Why `impl` does not run `shape` in pass `pass_` ("fwd", "train" or "bwd"), or None.
    Layouts and attributes bench.py does not run yet are skipped for every impl; a
    packed-layout shape (no padded rectangle of its own) runs on the packed impls only."""
    layout = shape.get("layout", "padded")
    if (layout == "paged") != (impl in PAGED_IMPLS):
        return (f"paged layout: run by the paged impls only ({', '.join(PAGED_IMPLS)})"
                if layout == "paged" else "a paged impl: paged-layout shapes only")
    if layout == "paged" and pass_ != "fwd":
        return "paged_attention is forward only"
    if layout not in ("padded", "packed", "paged"):
        return f"layout {layout!r}: not run by bench.py"
    ragged = metrics.has_q_padding(shape) or any(n != shape["Skv"] for n in shape["lengths"])
    if shape.get("local_window_size") is not None:
        if impl == FA3_PACKED:
            return "flash_attn3_jax's flash_mha_varlen takes no window_size"
        if impl == FA3 and ragged:
            return ("flash_attn3_jax's windowed kernel (flash_mha) is fixed-length: "
                    "ragged lengths are not comparable")
        if impl in PEERS and ragged:
            return "jax.nn's cuDNN path takes no sequence lengths with a local window"
    if pass_ != "fwd" and shape.get("train") is False:
        return "forward only (train: false in shapes.json)"
    if layout == "packed" and impl not in PACKED_IMPLS:
        return f"packed layout: run by the packed impls only ({', '.join(PACKED_IMPLS)})"
    # dew3_packed runs every shape (window and causal with lengths_q != lengths included: see
    # dew3_fn); dew3 takes no lengths at all.
    if impl == DEW3 and ragged:
        return ("dew_flash_attn's flash_mha is fixed-length (no sequence lengths): ragged "
                "lengths are not comparable")
    if metrics.has_q_padding(shape) and impl in NO_Q_LENGTHS:
        return NO_Q_LENGTHS[impl]
    return None


def unrun_records(name, shape, impls, import_errors, base_record, clock, passes, **tags):
    """The records of impls that will not run on this shape (import error, skip_reason, or the
    run's time budget spent), printed; and {impl: (fn, align)} of those that will."""
    records, to_run = [], {}
    for impl in [*import_errors, *impls]:
        for p in passes:
            rec = new_record(base_record, name, impl, **tags, **{"pass": p})
            if impl in import_errors:
                rec["error"] = import_errors[impl]
            elif reason := skip_reason(impl, shape, p):
                rec["skipped"] = reason
            elif clock.spent():
                rec["skipped"] = clock.skip_reason()
            else:
                to_run[impl] = impls[impl]
                continue
            records.append(rec)
            print(progress_line(rec), flush=True)
    return records, to_run


def run_fwd(name, shape, dtype, impls, import_errors, args, base_record, clock):
    """Checks and times every impl's forward on one shape in one dtype; returns its records
    (in impl order)."""
    dtype = jnp.dtype(dtype)
    tags = {"dtype": dtype.name}
    order = [*import_errors, *impls]
    records, impls = unrun_records(name, shape, impls, import_errors, base_record, clock,
                                   ("fwd",), **tags)
    tags["pass"] = "fwd"
    if not impls:
        return records
    decode = shape["Sq"] == 1
    n_sets = 3 if input_bytes(shape, dtype.itemsize) < 4 * L2_BYTES else 1
    sets = [make_set(shape, dtype, args.seed, i) for i in range(n_sets)]
    scale = 1.0 / math.sqrt(shape["D"])
    lengths_q = shape.get("lengths_q")
    window = metrics.window_pair(shape.get("local_window_size"))
    win = {} if window is None else {"window": window}  # the impls' local window
    ref = None
    if not decode:  # fp32 reference on the first sequences (real query rows), tail-aligned
        q, k, v, lengths = (x[:CHECK_SEQS] for x in sets[0][:4])
        ref = metrics.reference(q, k, v, lengths, scale=scale, is_causal=shape["causal"],
                                lengths_q=None if lengths_q is None else lengths_q[:CHECK_SEQS],
                                window=window)
    repeats, target_s = TIMING["fwd-quick" if args.quick else "fwd"]
    nbytes = metrics.bytes_moved(shape, dtype.itemsize)

    for impl, (fn, align) in impls.items():
        rec = new_record(base_record, name, impl, **tags)
        if clock.spent():
            rec["skipped"] = clock.skip_reason()
            records.append(rec)
            print(progress_line(rec), flush=True)
            continue
        packing = Packed(shape) if impl in PACKED_IMPLS else Paged(shape) if impl in PAGED_IMPLS else None
        impl_sets = [packing.pack(*s) for s in sets] if packing else sets
        hints = packing.hints if isinstance(packing, Packed) else {}
        unpack = packing.unpack_out if isinstance(packing, Packed) else (lambda out: out)
        variants = {None: fn}
        if impl in (FA3, FA3_PAGED) and decode:  # the brief's FA3 decode numbers: best num_splits
            variants = {int(s): functools.partial(fn, num_splits=int(s))
                        for s in args.fa3_splits.split(",")}
        timed = {}
        for key, vfn in variants.items():
            jitted = jax.jit(lambda *args, fn=vfn: fn(*args, scale=scale,
                                                      is_causal=shape["causal"], **hints, **win))
            try:
                out = unpack(jax.block_until_ready(jitted(*impl_sets[0])))
                if ref is not None:
                    rec.update(check(out, *ref, shape["lengths"], shape["Sq"], align,
                                     shape["causal"], lengths_q))
                del out
                timed[key] = time_ms(jitted, impl_sets, repeats, target_s)
            except Exception as e:  # noqa: BLE001 - e.g. cudnn rejecting a shape; keep going
                timed[key] = None
                rec["error"] = error_string(e)
        ok = {key: ms for key, ms in timed.items() if ms is not None}
        if len(variants) > 1:
            rec["variants_ms"] = {str(key): ms for key, ms in timed.items()}
        if ok:
            best = min(ok, key=ok.get)
            ms = ok[best]
            rec.pop("error", None)
            if best is not None:
                rec["fa3_num_splits"] = best
            rec.update(ms=ms, eff_tflops=metrics.flops(shape, align) / (ms * 1e-3) / 1e12,
                       eff_tbps=nbytes / (ms * 1e-3) / 1e12)
        records.append(rec)
        print(progress_line(rec), flush=True)
        del impl_sets
    return sorted(records, key=lambda r: order.index(r["impl"]))


def backward_alone(vjp_fns, douts):
    """The backward alone: (jitted fn, input sets) with fn(residuals, dO) = vjp_fn(dO), one set
    per (jax.vjp function, dO). The vjp functions are pytrees of their residuals; they are
    flattened once here, so a call hashes only the residual arrays (their structure, which
    holds the backward's jaxpr, is a constant of the jitted function)."""
    flat = [jax.tree_util.tree_flatten(f) for f in vjp_fns]
    treedef = flat[0][1]
    flat = [f for f in flat if f[1] == treedef]  # the same structure, or the first set only
    fn = jax.jit(lambda leaves, dout: jax.tree_util.tree_unflatten(treedef, leaves)(dout))
    return fn, [(leaves, do) for (leaves, _), do in zip(flat, douts)]


def run_train(name, shape, dtype, impls, import_errors, args, base_record, clock):
    """Per impl, a training step ("train": forward + backward of sum(out * dO) through jax.vjp,
    3.5x the forward's FLOPs) and, unless --no-bwd, the backward alone ("bwd": the vjp function
    applied to dO, 2.5x), each checked against the fp32 reference's gradients on the first sequences and
    timed within --step-budget-s. Returns the records (in impl order)."""
    dtype = jnp.dtype(dtype)
    passes = ("train",) if args.no_bwd else ("train", "bwd")
    order = [*import_errors, *impls]
    records, impls = unrun_records(name, shape, impls, import_errors, base_record, clock,
                                   passes, dtype=dtype.name)
    if not impls:
        return records
    n_sets = 3 if input_bytes(shape, dtype.itemsize) < 4 * L2_BYTES else 1
    sets = [(*make_set(shape, dtype, args.seed, i), make_dout(shape, dtype, args.seed, i))
            for i in range(n_sets)]
    scale = 1.0 / math.sqrt(shape["D"])
    causal = shape["causal"]
    lengths_q = shape.get("lengths_q")
    window = metrics.window_pair(shape.get("local_window_size"))
    win = {} if window is None else {"window": window}  # the impls' local window
    q, k, v, lengths = (x[:CHECK_SEQS] for x in sets[0][:4])
    ref_grads, has_key = metrics.reference_grads(
        q, k, v, lengths, sets[0][-1][:CHECK_SEQS], scale=scale, is_causal=causal,
        lengths_q=None if lengths_q is None else lengths_q[:CHECK_SEQS], window=window)
    repeats, target_s = TIMING["train-quick" if args.quick else "train"]
    budget = args.step_budget_s

    for impl, (fn, align) in impls.items():
        # An input set is (q, k, v, *aux, dO): aux = (lengths[, lengths_q]), or packed
        # (cu_seqlens_q, cu_seqlens_k) with the gradients unpacked for the check.
        packing = Packed(shape) if impl in PACKED_IMPLS else None
        impl_sets = [packing.pack(*s) for s in sets] if packing else sets
        hints = packing.hints if packing else {}
        unpack = packing.unpack_grads if packing else (lambda grads: grads)
        fwd = jax.jit(lambda *args, fn=fn: fn(*args, scale=scale, is_causal=causal, **hints,
                                              **win))

        def step(q, k, v, *rest, fwd=fwd):
            *aux, dout = rest
            _, vjp_fn = jax.vjp(lambda q, k, v: fwd(q, k, v, *aux), q, k, v)
            return vjp_fn(dout)
        train = jax.jit(step)

        # One compiled forward returning the vjp function (a pytree: residual arrays plus a
        # structure holding the backward), so every input set's has the same structure.
        make_vjp = jax.jit(lambda q, k, v, *aux, fwd=fwd:
                           jax.vjp(lambda q, k, v: fwd(q, k, v, *aux), q, k, v)[1])

        def bwd_inputs(make_vjp=make_vjp, impl_sets=impl_sets):
            """backward_alone() of every input set: the forward runs here, outside the
            timing."""
            vjp_fns = [make_vjp(*s[:-1]) for s in impl_sets]
            return backward_alone(vjp_fns, [s[-1] for s in impl_sets])

        for p in passes:
            rec = new_record(base_record, name, impl, dtype=dtype.name, **{"pass": p})
            if clock.spent():
                rec["skipped"] = clock.skip_reason()
            else:
                try:
                    fn_p, sets_p = (train, impl_sets) if p == "train" else bwd_inputs()
                    grads = unpack(jax.block_until_ready(fn_p(*sets_p[0])))
                    rec.update(check_grads(grads, ref_grads, has_key, shape["lengths"],
                                           shape["Sq"], align, causal, lengths_q))
                    del grads
                    ms = time_ms(fn_p, sets_p, repeats, target_s, budget_s=budget)
                except Exception as e:  # noqa: BLE001 - e.g. no backward for a peer
                    rec["error"] = error_string(e)
                else:
                    work = metrics.flops(shape, align, p)
                    rec.update(ms=ms, eff_tflops=work / (ms * 1e-3) / 1e12,
                               input_sets=len(sets_p))
            records.append(rec)
            print(progress_line(rec), flush=True)
    return sorted(records, key=lambda r: order.index(r["impl"]))


def progress_line(rec):
    """'  d128-full  bf16 fwd    cudnn   12.345 ms  max_err 3.91e-03 ok' (or the error)."""
    dtype = report._short_dtype(rec.get("dtype", ""))
    parts = [f"  {rec['shape']:26s} {dtype:4s} {rec.get('pass', 'fwd'):5s} {rec['impl']:11s}",
             f"{rec['ms']:9.3f} ms" if rec["ms"] is not None
             else "  skipped" if rec.get("skipped") else "   failed"]
    if rec.get("eff_tflops") is not None:
        parts.append(f"{rec['eff_tflops']:7.1f} TFLOP/s")
    if rec.get("skipped"):
        parts.append(rec["skipped"])
    if rec.get("max_err") is not None:
        parts.append(f"max_err {rec['max_err']:.2e} {rec['check']}")
    elif "check" in rec:
        parts.append(rec["check"])
    if rec.get("error"):
        parts.append(rec["error"].splitlines()[0][:120])
    return "  ".join(parts)


# ---------------------------------------------------------------------------------------------
# Environment

def device_slug(kind):
    """'NVIDIA H200' -> 'h200'; 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'; 'cpu' -> 'cpu'."""
    kind = kind.lower().removeprefix("nvidia").strip()
    return "-".join(kind.split())


def cudnn_version():
    """'9.19.0' from the CUDA plugin's version module, or None without one."""
    try:
        from jax._src.lib import cuda_versions
        v = cuda_versions.cudnn_get_version()  # e.g. 91900
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    except Exception:  # noqa: BLE001 - CPU-only jaxlib, or an internal module that moved
        return None


def package_versions():
    names = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
             "jax-cuda12-pjrt", "jax_varlen", "flash-attn3-jax", "dew-flash-attn-cu13",
             "nvidia-cutlass")
    versions = {}
    for n in names:
        try:
            versions[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def write_all(args, stem, records, meta, shapes):
    """JSON + markdown (summary first) and, unless --no-plot, the PNG."""
    meta["summary"] = report.summary_table(records, shapes)
    packed = report.packed_table(records, shapes)
    if packed:
        meta["summary"] += "\n\nPacked layout (issue 13):\n\n" + packed
    table = report.markdown_table(records, shapes)
    paths = list(report.write_results(args.out, stem, records, meta, table))
    if not args.no_plot:
        try:
            import plot
            paths.append(plot.plot(paths[0]))
        except ImportError as e:  # matplotlib is optional: plot.py can run elsewhere later
            meta["plot"] = f"not drawn: {e}"
        except Exception as e:  # noqa: BLE001 - a plotting bug must not lose the results
            meta["plot"] = f"failed: {error_string(e)}"
            print(f"plot: {meta['plot']}", flush=True)
    return paths, table


def main(argv=None):
    t_start = time.monotonic()
    args = parse_args(argv)
    all_shapes = load_shapes()
    if args.list_layout:
        names = select_shapes(all_shapes, args.shapes or "all", True)
        print(",".join(n for n, s in names.items() if s.get("layout", "padded") == args.list_layout))
        return
    run_fwd_pass = args.passes in ("fwd", "both")
    run_train_pass = args.passes in ("train", "both")
    fwd_shapes, train_shapes = {}, {}
    if run_fwd_pass:
        fwd_shapes = select_shapes(all_shapes, args.shapes or args.fwd_shapes, args.decode)
        if args.decode and not args.shapes:
            fwd_shapes.update({n: s for n, s in all_shapes.items() if s["Sq"] == 1})
    if run_train_pass:
        train_shapes = {n: s for n, s in select_shapes(
            all_shapes, args.shapes or args.train_shapes, False).items() if s["Sq"] != 1}
    extras = parse_extra_dtypes(args.extra_dtype, fwd_shapes)
    shapes = {**fwd_shapes, **train_shapes}
    if args.cpu_smoke:
        shapes = {n: shrink(s) for n, s in shapes.items()}
        args.quick = True  # a logic test: short timing loops
    skip = ("cudnn",) if args.cpu_smoke else ()
    fwd_names = [n for n in args.impls.split(",") if n not in skip] if run_fwd_pass else []
    train_impl_names = ([n for n in args.train_impls.split(",") if n not in skip]
                        if run_train_pass else [])
    names = list(dict.fromkeys(fwd_names + train_impl_names))

    ours = (report.OURS, OURS_PACKED, OURS_PAGED)
    ours_wanted = any(n in names for n in ours)
    jax_varlen, import_error = import_jax_varlen() if ours_wanted else (None, None)
    import_errors = ({n: import_error for n in ours if n in names} if import_error else {})
    impls = build_impls(names, jax_varlen, import_errors)

    def subset(wanted):
        return ({n: impls[n] for n in wanted if n in impls},
                {n: import_errors[n] for n in wanted if n in import_errors})

    device = jax.devices()[0].device_kind
    date = datetime.date.today().isoformat()
    versions = package_versions()
    if jax_varlen is not None:
        versions.setdefault("jax_varlen", getattr(jax_varlen, "__version__", None))
    if FA3 in impls:
        versions.setdefault("flash-attn3-jax", getattr(sys.modules.get("flash_attn3_jax"),
                                                       "__version__", None))
    base = {"dtype": args.dtype, "device": device, "jax": jax.__version__,
            "date": date, "cudnn_version": cudnn_version()}

    jobs = [(n, args.dtype, "fwd") for n in fwd_shapes]
    jobs += [(n, dtype, "fwd") for dtype, ns in extras for n in ns]
    jobs += [(n, args.dtype, "train") for n in train_shapes]
    print(f"{device}, jax {jax.__version__}, cudnn {base['cudnn_version']}, flash-attn3-jax "
          f"{versions.get('flash-attn3-jax')}, dew-flash-attn-cu13 "
          f"{versions.get('dew-flash-attn-cu13')}; forward impls {fwd_names}, train impls "
          f"{train_impl_names}; {len(jobs)} (shape, dtype, pass) jobs", flush=True)

    tag = args.tag or {"fwd": "fwd", "train": "train", "both": "fwd-train"}[args.passes]
    tag += "-cpu-smoke" if args.cpu_smoke else ""
    stem = f"{date}-{device_slug(device)}-{tag}"
    meta = {"device": device, "device_count": jax.device_count(), "date": date,
            "versions": dict(versions, cudnn=base["cudnn_version"]),
            "command": " ".join(["python3", "benchmarks/bench.py", *sys.argv[1:]]),
            "cpu_smoke": args.cpu_smoke, "quick": args.quick, "seed": args.seed,
            "passes": args.passes, "timing": TIMING, "step_budget_s": args.step_budget_s,
            "jax_varlen_path": jax_varlen and os.path.dirname(jax_varlen.__file__),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "shapes": {}}
    if FA3 in impls:
        meta["fa3_einops_stub"] = FA3_EINOPS_STUB
    clock = Clock(args.budget_s)
    records, paths, table = [], [], ""
    for name, dtype, pass_ in jobs:
        t0 = time.monotonic()
        run = run_fwd if pass_ == "fwd" else run_train
        wanted = fwd_names if pass_ == "fwd" else train_impl_names
        try:
            records += run(name, shapes[name], dtype, *subset(wanted), args, base, clock)
        except Exception as e:  # noqa: BLE001 - e.g. inputs or reference out of memory
            print(f"  {name} {dtype} {pass_}: {error_string(e)}", flush=True)
            records += [new_record(base, name, impl, dtype=jnp.dtype(dtype).name,
                                   error="inputs or reference: " + error_string(e),
                                   **{"pass": p})
                        for impl in wanted for p in (("fwd",) if pass_ == "fwd"
                                                     else ("train", "bwd"))]
        meta["shapes"][name] = shapes[name]
        meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
        print(f"  ({time.monotonic() - t0:.1f} s; {meta['elapsed_s']:.0f} s so far)",
              flush=True)
        paths, table = write_all(args, stem, records, meta, shapes)

    print("\nwrote " + ", ".join(paths) + "\n")
    print(table)
    print("\nSummary (ours / best of cuDNN and FA3, or cuDNN alone where the target says so; "
          "targets: issue 11 forward, issue 12 train, issue 31 prefill-right-padded)\n")
    print(report.summary_table(records, shapes))
    packed = report.packed_table(records, shapes)
    if packed:
        print("\nPacked layout (issue 13: packed / padded >= 0.97, packed / FA3 packed >= 1.05)\n")
        print(packed)


if __name__ == "__main__":
    main()
