"""Effective work of one attention call, and a cheap fp32 check of an output.

Definitions follow shapes.json's `_doc`:
    effective TFLOP/s = 2 * pairs * H * (D + Dv) / time   (= 4 * pairs * H * D when D == Dv),
        pairs = allowed (query, key) pairs under the implementation's *own* mask;
    effective TB/s = (valid K and V + Q + O bytes, each read or written once) / time.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

# Mask alignments. "tail" is jax_varlen's causal mask (bottom-right): query i of sequence b
# sees key j iff j < n_b and j <= i + n_b - Sq. "top_left" is jax.nn.dot_product_attention's
# is_causal with key_value_seq_lengths: j < n_b and j <= i. They agree when n_b == Sq.
TAIL = "tail"
TOP_LEFT = "top_left"

# bf16 inputs and output against an fp32 reference: outputs are convex combinations of
# N(0, 1) values, so |out| <~ 3 and one bf16 rounding of the output alone is up to ~8e-3.
MAX_ERR_TOL = 3e-2


def allowed_pairs(seqlen_q, lengths, is_causal, align):
    """Allowed (query, key) pairs summed over the batch.

    Worked example, Sq = 4, n_b = 2, causal:
        tail:     keys per query row = max(0, min(2, i - 1)) = 0, 0, 1, 2  -> 3 pairs
        top_left: keys per query row = min(2, i + 1)         = 1, 2, 2, 2  -> 7 pairs
    Non-causal: Sq * n_b = 8 pairs either way.
    """
    n = np.asarray(lengths, np.int64)[:, None]  # [B, 1]
    i = np.arange(seqlen_q, dtype=np.int64)[None, :]  # [1, Sq]
    if not is_causal:
        return int(seqlen_q * n.sum())
    if align == TAIL:
        per_row = np.clip(i + n - seqlen_q + 1, 0, n)  # [B, Sq]
    elif align == TOP_LEFT:
        per_row = np.minimum(n, i + 1)  # [B, Sq]
    else:
        raise ValueError(f"unknown mask alignment {align!r}")
    return int(per_row.sum())


def flops(shape, align):
    """Effective FLOPs: two matmuls (QK^T over D, PV over Dv) per allowed pair and head."""
    pairs = allowed_pairs(shape["Sq"], shape["lengths"], shape["causal"], align)
    return 2 * pairs * shape["H"] * (shape["D"] + shape["Dv"])


def bytes_moved(shape, itemsize):
    """Valid K and V rows, plus all of Q and O, each touched once."""
    kv = sum(shape["lengths"]) * shape["Hkv"] * (shape["D"] + shape["Dv"])
    q = shape["B"] * shape["Sq"] * shape["H"] * shape["D"]
    o = shape["B"] * shape["Sq"] * shape["H"] * shape["Dv"]
    return (kv + q + o) * itemsize


@functools.partial(jax.jit, static_argnames=("seqlen_q", "is_causal"))
def _reference_rows(q, k, v, lengths, q_start, *, scale, seqlen_q, is_causal):
    """fp32 masked softmax attention, tail-aligned causal, for a chunk of query rows.

    q: [B, C, H, D] (rows q_start .. q_start + C - 1 of Sq); k: [B, Skv, Hkv, D];
    v: [B, Skv, Hkv, Dv]; lengths: [B] int32.
    Returns out [B, C, H, Dv] fp32 and has_key [B, C] (False where a row sees no key; out is 0).
    """
    b, c, h, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    group = h // hkv  # query heads per KV head (GQA)
    q = q.astype(jnp.float32).reshape(b, c, hkv, group, d)
    s = jnp.einsum("bckgd,bskd->bkgcs", q, k.astype(jnp.float32)) * scale  # [B, Hkv, G, C, Skv]
    i = q_start + jnp.arange(c)[:, None]  # [C, 1]
    j = jnp.arange(skv)[None, :]  # [1, Skv]
    n = lengths[:, None, None]  # [B, 1, 1]
    allowed = j[None] < n  # [B, C or 1, Skv]
    if is_causal:
        allowed = allowed & (j[None] <= i[None] + n - seqlen_q)
    allowed = jnp.broadcast_to(allowed, (b, c, skv))
    s = jnp.where(allowed[:, None, None], s, -jnp.inf)
    has_key = allowed.any(-1)  # [B, C]
    m = jnp.where(has_key[:, None, None, :, None], s.max(-1, keepdims=True), 0.0)
    p = jnp.exp(s - m)  # masked entries -> exp(-inf) = 0
    p = p / jnp.maximum(p.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    out = jnp.einsum("bkgcs,bskd->bckgd", p, v.astype(jnp.float32))  # [B, C, Hkv, G, Dv]
    return out.reshape(b, c, h, v.shape[-1]), has_key


def reference(q, k, v, lengths, *, scale, is_causal, chunk=512):
    """Reference for whole sequences, computed in query chunks to bound the [.., C, Skv] logits.

    q: [B, Sq, H, D] ... as in _reference_rows. Returns out [B, Sq, H, Dv] fp32, has_key [B, Sq].
    """
    seqlen_q = q.shape[1]
    outs, keys = [], []
    for start in range(0, seqlen_q, chunk):
        o, hk = _reference_rows(q[:, start:start + chunk], k, v, lengths, start, scale=scale,
                                seqlen_q=seqlen_q, is_causal=is_causal)
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
