"""Effective work of one attention call, a cheap fp32 check of an output and of gradients,
and the per-shape floors of NOTES.md.

Definitions follow shapes.json's `_doc`:
    effective TFLOP/s = 2 * pairs * H * (D + Dv) / time   (= 4 * pairs * H * D when D == Dv),
        pairs = allowed (query, key) pairs under the implementation's *own* mask, over the
        real query rows only (i < lengths_q[b] where a shape gives lengths_q);
        a training step ("train": forward + backward) counts 3.5x that, the backward alone
        ("bwd") 2.5x;
    effective TB/s = (valid K and V + real Q and O rows, each read or written once) / time.

A shape of layout "packed" (lengths_q and lengths only) is seen through the padded rectangle
it would fill (padded_extent): B = the number of sequences, Sq = the longest lengths_q,
Skv = the longest lengths.

    python3 benchmarks/bench_metrics.py floors     # the floors table of NOTES.md, as markdown
"""

import functools
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

# Mask alignments, for sequence b with n_q real query rows (lengths_q; Sq without it) and n_b
# real keys; rows i >= n_q see no key. "tail" is jax_varlen's causal mask (bottom-right, also
# FA3's): query i sees key j iff j < n_b and j <= i + n_b - n_q. "top_left" is
# jax.nn.dot_product_attention's is_causal with query_seq_lengths / key_value_seq_lengths:
# j < n_b and j <= i. They agree when n_b == n_q.
TAIL = "tail"
TOP_LEFT = "top_left"

# bf16 inputs and output against an fp32 reference: outputs are convex combinations of
# N(0, 1) values, so |out| <~ 3 and one bf16 rounding of the output alone is up to ~8e-3.
MAX_ERR_TOL = 3e-2
# Gradients: max |g - g_ref| over the checked rows / max |g_ref| there, worst of dq, dk, dv.
# bf16 gradients carry one rounding (4e-3 relative) plus bf16 products inside the kernels; a
# wrong mask or a missed term is O(1) on this scale.
GRAD_REL_TOL = 5e-2
HIGHEST = jax.lax.Precision.HIGHEST  # the reference's f32 dots: no TF32 on the GPU

# FLOPs of a pass relative to the forward's (shapes.json `result_record.pass`).
PASS_FLOPS = {"fwd": 1.0, "bwd": 2.5, "train": 3.5}

# Ceilings measured on the lent H200 (brief, 2026-12-02): dense bf16 matrix product and device
# copy (read + write).
MATRIX_TFLOPS = 794.0
COPY_TBPS = 4.30


def padded_extent(shape):
    """The shape with B, Sq and Skv filled in: a packed-layout shape (no rectangle of its own)
    gets B = len(lengths), Sq = max(lengths_q), Skv = max(lengths). Others are returned as
    they are."""
    if all(k in shape for k in ("B", "Sq", "Skv")):
        return shape
    lengths_q = shape.get("lengths_q", shape["lengths"])
    return {**shape, "B": len(shape["lengths"]), "Sq": max(max(lengths_q), 1),
            "Skv": max(max(shape["lengths"]), 1)}


def q_lengths(shape):
    """Real query rows per sequence: lengths_q, or Sq for every sequence without it."""
    return list(shape.get("lengths_q", [shape["Sq"]] * shape["B"]))


def has_q_padding(shape):
    """True when some sequence has padded query rows (lengths_q[b] < Sq)."""
    return any(n < shape["Sq"] for n in q_lengths(shape))


def allowed_pairs(seqlen_q, lengths, is_causal, align, lengths_q=None, window=None):
    """Allowed (query, key) pairs summed over the batch, real query rows only.

    lengths: keys per sequence (n_b); lengths_q: real query rows per sequence (default Sq);
    window: None or jax.nn's local_window_size, an int w (= (w, w)) or (left, right), around
    the query's position p among the keys (tail: p = i + n_b - n_q; top_left: p = i).

    Worked example, Sq = 4, n_b = 2, causal:
        tail:     keys per query row = max(0, min(2, i - 1)) = 0, 0, 1, 2  -> 3 pairs
        top_left: keys per query row = min(2, i + 1)         = 1, 2, 2, 2  -> 7 pairs
    Non-causal: Sq * n_b = 8 pairs either way. With lengths_q = [2] (rows 2 and 3 padding)
    and n_b = 2, causal: tail and top_left both give 1, 2 for rows 0, 1 -> 3 pairs.
    """
    n = np.asarray(lengths, np.int64)[:, None]  # [B, 1]
    n_q = np.asarray(seqlen_q if lengths_q is None else lengths_q, np.int64)
    n_q = np.broadcast_to(n_q, n[:, 0].shape)[:, None]  # [B, 1]
    i = np.arange(seqlen_q, dtype=np.int64)[None, :]  # [1, Sq]
    if align == TAIL:
        pos = i + n - n_q  # [B, Sq]: query row i's position among the keys
    elif align == TOP_LEFT:
        pos = i + 0 * n
    else:
        raise ValueError(f"unknown mask alignment {align!r}")
    lo = np.zeros_like(pos)  # first and last allowed key, inclusive
    hi = np.broadcast_to(n - 1, pos.shape)
    if is_causal:
        hi = np.minimum(hi, pos)
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        lo, hi = np.maximum(lo, pos - left), np.minimum(hi, pos + right)
    per_row = np.clip(hi - lo + 1, 0, None) * (i < n_q)  # [B, Sq]
    return int(per_row.sum())


def flops(shape, align, pass_="fwd"):
    """Effective FLOPs: two matmuls (QK^T over D, PV over Dv) per allowed pair and head, times
    PASS_FLOPS[pass_] (3.5 for a training step, 2.5 for the backward alone)."""
    shape = padded_extent(shape)
    pairs = allowed_pairs(shape["Sq"], shape["lengths"], shape["causal"], align,
                          lengths_q=shape.get("lengths_q"),
                          window=shape.get("local_window_size"))
    return PASS_FLOPS[pass_] * 2 * pairs * shape["H"] * (shape["D"] + shape["Dv"])


def bytes_moved(shape, itemsize):
    """Valid K and V rows, plus the real rows of Q and O, each touched once."""
    shape = padded_extent(shape)
    kv = sum(shape["lengths"]) * shape["Hkv"] * (shape["D"] + shape["Dv"])
    rows_q = sum(q_lengths(shape))
    q = rows_q * shape["H"] * shape["D"]
    o = rows_q * shape["H"] * shape["Dv"]
    return (kv + q + o) * itemsize


@functools.partial(jax.jit, static_argnames=("is_causal", "window"))
def _reference_rows(q, k, v, lengths, lengths_q, q_start, *, scale, is_causal, window=None):
    """fp32 masked softmax attention, tail-aligned causal, for a chunk of query rows.

    q: [B, C, H, D] (rows q_start .. q_start + C - 1 of Sq); k: [B, Skv, Hkv, D];
    v: [B, Skv, Hkv, Dv]; lengths: [B] int32 keys; lengths_q: [B] int32 real query rows (rows
    i >= lengths_q[b] are padding and see no key); window: None or (left, right), keys
    p - left .. p + right of the row's tail-aligned position p = i + n - n_q.
    Returns out [B, C, H, Dv] fp32 and has_key [B, C] (False where a row sees no key; out is 0).
    """
    b, c, h, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    group = h // hkv  # query heads per KV head (GQA)
    q = q.astype(jnp.float32).reshape(b, c, hkv, group, d)
    s = jnp.einsum("bckgd,bskd->bkgcs", q, k.astype(jnp.float32),
                   precision=HIGHEST) * scale  # [B, Hkv, G, C, Skv]
    i = q_start + jnp.arange(c)[None, :, None]  # [1, C, 1]
    j = jnp.arange(skv)[None, None, :]  # [1, 1, Skv]
    n = lengths[:, None, None]  # [B, 1, 1]
    n_q = lengths_q[:, None, None]  # [B, 1, 1]
    allowed = (j < n) & (i < n_q)  # [B, C, Skv]
    if is_causal:
        allowed = allowed & (j <= i + n - n_q)
    if window is not None:
        left, right = window
        allowed = allowed & (j >= i + n - n_q - left) & (j <= i + n - n_q + right)
    allowed = jnp.broadcast_to(allowed, (b, c, skv))
    s = jnp.where(allowed[:, None, None], s, -jnp.inf)
    has_key = allowed.any(-1)  # [B, C]
    m = jnp.where(has_key[:, None, None, :, None], s.max(-1, keepdims=True), 0.0)
    p = jnp.exp(s - m)  # masked entries -> exp(-inf) = 0
    p = p / jnp.maximum(p.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    out = jnp.einsum("bkgcs,bskd->bckgd", p, v.astype(jnp.float32),
                     precision=HIGHEST)  # [B, C, Hkv, G, Dv]
    return out.reshape(b, c, h, v.shape[-1]), has_key


def _q_lengths_array(q, lengths_q):
    """lengths_q as int32 [B], Sq for every sequence when None."""
    if lengths_q is None:
        return jnp.full((q.shape[0],), q.shape[1], jnp.int32)
    return jnp.asarray(lengths_q, jnp.int32)


def window_pair(window):
    """jax.nn's local_window_size (None, an int w or a pair) as None or a (left, right) tuple."""
    if window is None:
        return None
    return (int(window), int(window)) if isinstance(window, int) else tuple(int(w) for w in window)


def reference(q, k, v, lengths, *, scale, is_causal, lengths_q=None, window=None, chunk=512):
    """Reference for whole sequences, computed in query chunks to bound the [.., C, Skv] logits.

    q: [B, Sq, H, D] ... as in _reference_rows; lengths_q: None (every row real) or [B] real
    query rows; window: jax.nn's local_window_size or None. Returns out [B, Sq, H, Dv] fp32,
    has_key [B, Sq] (False on padded rows and rows whose window holds no key).
    """
    window = window_pair(window)
    seqlen_q = q.shape[1]
    lengths_q = _q_lengths_array(q, lengths_q)
    outs, keys = [], []
    for start in range(0, seqlen_q, chunk):
        o, hk = _reference_rows(q[:, start:start + chunk], k, v, lengths, lengths_q, start,
                                scale=scale, is_causal=is_causal, window=window)
        outs.append(o)
        keys.append(hk)
    return jnp.concatenate(outs, 1), jnp.concatenate(keys, 1)


def max_abs_err(out, ref, has_key, seqs):
    """Max |out - ref| over rows that see at least one key, in sequences `seqs` (indices into
    ref's batch). Rows with no allowed key are skipped: their value is a convention (0 here).
    Returns a float (nan when out has a non-finite value there) or None when `seqs` is empty."""
    if not seqs:
        return None
    idx = np.asarray(seqs)
    diff = jnp.abs(out[idx].astype(jnp.float32) - ref[idx])  # [len(seqs), Sq, H, Dv]
    diff = jnp.where(has_key[idx][:, :, None, None], diff, 0.0)
    err = jnp.where(jnp.isfinite(diff).all(), diff.max(), jnp.nan)
    return float(err)


@functools.partial(jax.jit, static_argnames=("is_causal", "window"))
def _reference_chunk_grads(q, k, v, lengths, lengths_q, q_start, dout, *, scale, is_causal,
                           window=None):
    """Gradients of sum(out * dout) over one chunk of query rows (all f32): (dq, dk, dv)."""
    def f(q, k, v):
        return _reference_rows(q, k, v, lengths, lengths_q, q_start, scale=scale,
                               is_causal=is_causal, window=window)[0]
    _, vjp = jax.vjp(f, q, k, v)
    return vjp(dout)


def reference_grads(q, k, v, lengths, dout, *, scale, is_causal, lengths_q=None, window=None,
                    chunk=512):
    """fp32 gradients of sum(reference(q, k, v) * dout) with respect to q, k and v.

    q: [B, Sq, H, D], k: [B, Skv, Hkv, D], v: [B, Skv, Hkv, Dv], dout: [B, Sq, H, Dv] (any float
    dtype; computed in f32); lengths_q as in reference(). The loss is a sum over query rows, so
    each chunk of rows is differentiated on its own (memory bounded by one chunk's logits) and
    dk, dv are summed over chunks. Returns ((dq, dk, dv), has_key [B, Sq]).
    """
    window = window_pair(window)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    q, k, v, dout = f32(q), f32(k), f32(v), f32(dout)
    seqlen_q = q.shape[1]
    lengths_q = _q_lengths_array(q, lengths_q)
    dqs, dk, dv, keys = [], jnp.zeros_like(k), jnp.zeros_like(v), []
    for start in range(0, seqlen_q, chunk):
        sl = slice(start, start + chunk)
        dq_c, dk_c, dv_c = _reference_chunk_grads(q[:, sl], k, v, lengths, lengths_q, start,
                                                  dout[:, sl], scale=scale, is_causal=is_causal,
                                                  window=window)
        _, hk = _reference_rows(q[:, sl], k, v, lengths, lengths_q, start, scale=scale,
                                is_causal=is_causal, window=window)
        dqs.append(dq_c)
        keys.append(hk)
        dk, dv = dk + dk_c, dv + dv_c
    return (jnp.concatenate(dqs, 1), dk, dv), jnp.concatenate(keys, 1)


def max_rel_grad_err(grads, ref_grads, has_key, lengths, seqs):
    """Worst over (dq, dk, dv) of max |g - g_ref| / max |g_ref| on sequences `seqs`: dq on rows
    that see a key, dk and dv on the valid key rows (j < n_b). grads in any dtype, full batch;
    ref_grads f32 over the first sequences. Returns a float (nan when a checked value is not
    finite) or None when `seqs` is empty."""
    if not seqs:
        return None
    idx = np.asarray(seqs)
    skv = ref_grads[1].shape[1]
    valid_k = jnp.arange(skv)[None, :] < jnp.asarray(lengths)[idx][:, None]  # [S, Skv]
    masks = (has_key[idx], valid_k, valid_k)
    worst = 0.0
    for g, r, m in zip(grads, ref_grads, masks):
        g, r = g[idx].astype(jnp.float32), r[idx]
        m = m[:, :, None, None]
        diff = jnp.where(m, jnp.abs(g - r), 0.0)
        if not bool(jnp.isfinite(jnp.where(m, g, 0.0)).all()):
            return math.nan
        scale = float(jnp.where(m, jnp.abs(r), 0.0).max())
        worst = max(worst, float(diff.max()) / max(scale, 1e-30))
    return worst


# ---------------------------------------------------------------------------------------------
# Floors (NOTES.md): python3 benchmarks/bench_metrics.py floors

def floors(shape, itemsize=2):
    """Lower bounds on one forward call of jax_varlen (tail-aligned mask): effective FLOPs over
    MATRIX_TFLOPS and the fewest bytes (Q, the valid K/V rows, O, each once) over COPY_TBPS."""
    f = flops(shape, TAIL)
    nbytes = bytes_moved(shape, itemsize)
    t_flop = f / (MATRIX_TFLOPS * 1e12)
    t_byte = nbytes / (COPY_TBPS * 1e12)
    t = max(t_flop, t_byte)
    return {"gflop": f / 1e9, "mb": nbytes / 1e6, "flop_us": t_flop * 1e6,
            "byte_us": t_byte * 1e6, "bound": "compute" if t_flop >= t_byte else "memory",
            "max_tflops": f / t / 1e12, "max_tbps": nbytes / t / 1e12,
            "train_flop_us": PASS_FLOPS["train"] * t_flop * 1e6}


def floors_table(shapes, targets):
    """Markdown: the floors of every named shape, then the issue targets in absolute terms from
    the peers' numbers in shapes.json ("measured", "measured_train", "measured_TBps").
    targets(shape_name, pass_) -> (ratio or None, absolute TFLOP/s floor or None)."""
    lines = [
        "| shape | GFLOP | MB | FLOP floor (us) | byte floor (us) | bound | max TFLOP/s | "
        "train FLOP floor (us) |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for name, s in shapes.items():
        fl = floors(s)
        lines.append(f"| {name} | {fl['gflop']:.4g} | {fl['mb']:.0f} | {fl['flop_us']:.1f} | "
                     f"{fl['byte_us']:.1f} | {fl['bound']} | {fl['max_tflops']:.4g} | "
                     f"{fl['train_flop_us']:.0f} |")
    lines += ["", "| shape | pass | best peer (brief) | target | target TFLOP/s | "
              "target time (us) | target / max TFLOP/s |", "|---|---|---|---:|---:|---:|---:|"]
    for name, s in shapes.items():
        fl = floors(s)
        for pass_, key in (("fwd", "measured"), ("train", "measured_train")):
            ratio, absolute = targets(name, pass_)
            peers = s.get(key, {})
            if ratio is None or not peers:
                continue
            best = max(peers, key=peers.get)
            goal = max(ratio * peers[best], absolute or 0.0)
            work = fl["gflop"] * 1e9 * PASS_FLOPS[pass_]
            lines.append(f"| {name} | {pass_} | {best} {peers[best]:.1f} | {ratio:.2f}x"
                         f"{f' and {absolute:.0f}' if absolute else ''} | {goal:.0f} | "
                         f"{work / (goal * 1e12) * 1e6:.0f} | {goal / fl['max_tflops']:.2f} |")
    return "\n".join(lines)


def main(argv):
    if argv[:1] != ["floors"]:
        sys.exit(__doc__)
    import bench_report  # targets live with the report
    path = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "shapes.json")
    with open(path) as f:
        shapes = json.load(f)["shapes"]
    print(f"bf16; {MATRIX_TFLOPS:.0f} TFLOP/s matrix rate, {COPY_TBPS:.2f} TB/s copy; "
          f"shapes from {os.path.basename(path)}\n")
    print(floors_table(shapes, bench_report.target))


if __name__ == "__main__":
    main(sys.argv[1:])
