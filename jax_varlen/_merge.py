"""``merge_attention``: combine attention over disjoint key sets into attention over their union.

If partial ``p`` attended to key set ``K_p`` and returned ``out_p`` (softmax-weighted values)
and ``lse_p = log sum_{j in K_p} exp(s_j)``, then attention over ``K = union K_p`` is

    lse = log sum_p exp(lse_p)
    out = sum_p exp(lse_p - lse) * out_p

which is exact (the same math, regrouped), not an approximation. This is what a
sequence-parallel decode needs: each device attends to its slice of the KV cache, then the
slices are merged.
"""

from __future__ import annotations

import jax.numpy as jnp


def merge_attention(outs, lses):
    """Merges partial attention results over disjoint key sets, exactly and deterministically.

    Args:
      outs: ``[P, B, Sq, H, Dv]`` partial outputs (any float dtype), stacked along a leading
        axis, one per key set; rank-3 partials ``[P, B, Sq, H*Dv]`` work too.
      lses: float32 ``[P, B, H, Sq]``, the partials' log-sum-exp (natural log), ``-inf`` where
        a partial had no allowed key (its ``outs`` row is then ignored, whatever it holds).

    Returns:
      ``(out, lse)``: ``out`` ``[B, Sq, H, Dv]`` in the dtype of ``outs``, ``lse`` float32
      ``[B, H, Sq]``. A row with no allowed key in any partial gives zeros and ``lse = -inf``,
      never NaN.

    The weights ``exp(lse_p - lse)`` and the sum are computed in float32, one partial after the
    other in index order ``p = 0, 1, ...`` (not a tree reduction), so the result is bitwise
    reproducible and does not depend on the backend's reduction order.
    """
    outs = jnp.asarray(outs)
    lses = jnp.asarray(lses)
    if outs.ndim not in (4, 5) or lses.ndim != 4:
        raise ValueError(
            "merge_attention expects outs [P, B, Sq, H, Dv] (or [P, B, Sq, H*Dv]) and lses "
            f"[P, B, H, Sq]; got outs {tuple(outs.shape)} and lses {tuple(lses.shape)}"
        )
    P, B, Sq = outs.shape[:3]
    H = lses.shape[2]
    if lses.shape != (P, B, H, Sq) or (outs.ndim == 5 and outs.shape[3] != H):
        raise ValueError(
            f"merge_attention: lses must be [P, B, H, Sq] matching outs; got outs "
            f"{tuple(outs.shape)} and lses {tuple(lses.shape)}"
        )
    if P == 0:
        raise ValueError("merge_attention needs at least one partial result (P >= 1)")
    rank3 = outs.ndim == 4
    if rank3:
        if outs.shape[3] % H:
            raise ValueError(
                f"merge_attention: outs' last dimension ({outs.shape[3]}) must be a multiple "
                f"of the head count in lses ({H})"
            )
        outs = outs.reshape(outs.shape[:3] + (H, -1))
    out_dtype = outs.dtype
    lses = lses.astype(jnp.float32)

    # m: [B, H, Sq], the largest partial lse; 0 where every partial is empty, so that
    # lse_p - m stays -inf (weight 0) there instead of -inf - -inf = NaN.
    m = jnp.max(lses, axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    # w: [P, B, H, Sq], each partial's share up to the common factor exp(-m); exp(-inf) = 0.
    w = jnp.exp(lses - m)

    total = w[0]
    acc = _weighted(w[0], outs[0])
    for p in range(1, P):  # fixed order: bitwise reproducible
        total = total + w[p]
        acc = acc + _weighted(w[p], outs[p])

    nonempty = total > 0  # [B, H, Sq]
    lse = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, total, 1.0)), -jnp.inf)
    scale = jnp.where(nonempty, 1.0 / jnp.where(nonempty, total, 1.0), 0.0)
    out = (acc * _to_bqh1(scale)).astype(out_dtype)
    if rank3:
        out = out.reshape(out.shape[:2] + (-1,))
    return out, lse


def _to_bqh1(x):
    """``[B, H, Sq]`` -> ``[B, Sq, H, 1]``, to scale ``[B, Sq, H, Dv]`` rows."""
    return jnp.swapaxes(x, 1, 2)[..., None]


def _weighted(w, out):
    """``w`` ``[B, H, Sq]`` times ``out`` ``[B, Sq, H, Dv]`` in float32; a zero weight gives
    exact zeros even where ``out`` holds NaN or Inf (an empty partial's row is not trusted)."""
    w = _to_bqh1(w)
    return jnp.where(w > 0, w * out.astype(jnp.float32), 0.0)
