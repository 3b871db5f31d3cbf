"""``packed_attention``: normalize rank 2/3, check every argument (the offsets and the hints
included), bind the packed primitive on one pack."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_varlen._api import (
    as_lengths,
    canonical,
    check_array,
    check_flag,
    check_shapes,
    check_sinks,
    check_static,
    check_static_dims,
    dtype_name,
    make_config,
    split_or_check_heads,
)
from jax_varlen._autodiff import packed_attention_with_grad, packed_attention_with_sinks_grad

_OFFSET_DTYPES = (jnp.int32, jnp.int64)
_AXIS_NAMES = {
    ("query", 3): ("Tq", "H", "D"), ("query", 2): ("Tq", "H*D"),
    ("key", 3): ("Tk", "Hkv", "D"), ("key", 2): ("Tk", "Hkv*D"),
    ("value", 3): ("Tk", "Hkv", "Dv"), ("value", 2): ("Tk", "Hkv*Dv"),
}


def _normalize_heads(query, key, value, num_heads, kv_num_heads):
    """Checks ranks and head counts; returns rank-3 query, key, value."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_array(name, x)
    query, key, value = map(canonical, (query, key, value))
    if query.ndim not in (2, 3):
        raise ValueError(
            f"query must have rank 2 [Tq, H*D] or 3 [Tq, H, D], got shape {tuple(query.shape)}"
        )
    for name, x in (("key", key), ("value", value)):
        if x.ndim != query.ndim:
            raise ValueError(
                f"{name} must have the rank of query ({query.ndim}), got shape {tuple(x.shape)}"
            )
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_static_dims(name, x, _AXIS_NAMES[name, x.ndim], first=0,
                          allowed="number of sequences (cu_seqlens' length)")
    return split_or_check_heads(query, key, value, num_heads, kv_num_heads, query.ndim == 2,
                                "rank-2 inputs [T, H*D]")


def _check_offsets(name: str, cu_seqlens, rows: int, rows_name: str):
    """Checks ``[B + 1]`` int32/int64 offsets into ``rows`` token rows; returns them as int32.

    Concrete offsets must start at 0, never decrease and end at most at ``rows``; traced ones
    reach the primitive as they are (the kernels clamp them; checkify reports them). Python
    lists and tuples are taken as ``jnp.asarray`` would take them."""
    cu_seqlens = as_lengths(name, cu_seqlens)
    check_array(name, cu_seqlens)
    if cu_seqlens.dtype not in _OFFSET_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {dtype_name(cu_seqlens.dtype)}")
    if cu_seqlens.ndim != 1 or (
        not jax.export.is_symbolic_dim(cu_seqlens.shape[0]) and cu_seqlens.shape[0] < 1
    ):
        raise ValueError(
            f"{name} must have shape [B + 1] (one offset per sequence boundary, starting at 0), "
            f"got {tuple(cu_seqlens.shape)}"
        )
    if not isinstance(cu_seqlens, jax.core.Tracer):
        cu = np.asarray(cu_seqlens).astype(np.int64)
        if cu[0] != 0:
            raise ValueError(f"{name}[0] = {int(cu[0])}: expected 0 ({name} must start at 0)")
        down = np.flatnonzero(np.diff(cu) < 0)
        if down.size:
            i = int(down[0]) + 1
            raise ValueError(
                f"{name}[{i}] = {int(cu[i])} is below {name}[{i - 1}] = {int(cu[i - 1])}: "
                f"expected non-decreasing offsets"
            )
        if cu[-1] > rows:
            i = cu.size - 1
            raise ValueError(
                f"{name}[{i}] = {int(cu[-1])} is past the token count {rows_name} = {rows}: "
                f"expected {name}[-1] <= {rows_name}"
            )
        return jnp.asarray(cu.astype(np.int32))
    if cu_seqlens.dtype == jnp.int32:
        return cu_seqlens
    # int64 is narrowed after a clip to [-1, rows + 1], which keeps an out-of-range value out
    # of range instead of letting it wrap.
    return jnp.clip(cu_seqlens, -1, rows + 1).astype(jnp.int32)


def _resolve_hint(name: str, hint, rows: int, rows_name: str, offsets_name: str, cu_seqlens):
    """``max_seqlen_q/k``: a static int >= 0, ``rows`` when not given (a larger one is the same
    bound: no sequence has more than ``rows`` rows). Concrete offsets must respect it."""
    if hint is None:
        return rows
    check_static(name, hint)
    if isinstance(hint, bool) or not isinstance(hint, (int, np.integer)) or hint < 0:
        raise ValueError(f"{name} must be None or an int >= 0, got {hint!r}")
    if not isinstance(cu_seqlens, jax.core.Tracer):
        lengths = np.diff(np.asarray(cu_seqlens))
        long = np.flatnonzero(lengths > hint)
        if long.size:
            b = int(long[0])
            raise ValueError(
                f"{name} = {hint} is smaller than sequence {b}'s length {offsets_name}[{b + 1}] - "
                f"{offsets_name}[{b}] = {int(lengths[b])}: {name} must bound every length"
            )
    return min(int(hint), rows)


def packed_attention(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q=None,
    max_seqlen_k=None,
    num_heads=None,
    kv_num_heads=None,
    scale=None,
    is_causal=False,
    softcap=0.0,
    local_window_size=None,
    sinks=None,
    return_lse=False,
):
    """Attention over sequences packed back to back, with no padding at all.

    Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key/value rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; every key of a sequence is real. The math, the
    attributes, the precision and the determinism are those of :func:`attention`, per sequence.

    Args:
      query: ``[Tq, H, D]`` or ``[Tq, H*D]``; float32, float16 or bfloat16.
      key: ``[Tk, Hkv, D]`` or ``[Tk, Hkv*D]``; the dtype of ``query``.
      value: ``[Tk, Hkv, Dv]`` or ``[Tk, Hkv*Dv]``; ``Dv`` may differ from ``D``.
      cu_seqlens_q, cu_seqlens_k: int32 or int64 ``[B + 1]`` cumulative offsets: starting at
        0, non-decreasing, the last at most ``Tq`` (``Tk``). Rows past the last are no
        sequence's (they may hold any bits, NaN included, and are never read).
      max_seqlen_q, max_seqlen_k: optional static upper bounds of the query and key lengths.
        They size the kernels' grids (and the CUDA decode workspace); without them ``Tq`` and
        ``Tk`` are used, which is always safe. A sequence longer than its hint is invalid
        input: a ``ValueError`` for concrete offsets, a check error under
        ``jax.experimental.checkify``, and otherwise the sequence is clamped to the hint (never
        an out-of-bounds read; its rows past the hint are zero).
      num_heads, kv_num_heads, scale, softcap: as for :func:`attention`.
      is_causal: tail-aligned per sequence: query ``i`` of sequence ``b`` sees key ``j`` iff
        ``j <= i + len_k - len_q`` (``len = cu[b+1] - cu[b]``).
      local_window_size: as for :func:`attention`, per sequence: ``None``, an int ``w``
        (``(w, w)``) or a pair ``(left, right)`` of ints >= 0 around query ``i``'s position
        ``p = i + len_k - len_q``: key ``j`` is allowed iff ``p - left <= j <= p + right``.
      sinks: as for :func:`attention`: optional float ``[H]``, one logit per query head in
        the softmax denominator of every row a sequence owns (a row with no allowed key: zeros,
        ``lse = sinks[h]``; rows past ``cu_seqlens_q[-1]`` keep ``lse = -inf``).
      return_lse: also return the float32 log-sum-exp ``[H, Tq]`` (FlashAttention's varlen
        layout; natural log).

    The hints, ``num_heads``, ``kv_num_heads``, ``scale``, ``is_causal``, ``softcap``,
    ``local_window_size`` and ``return_lse`` are static; the offsets and ``sinks`` may be
    traced.

    Returns:
      ``out`` ``[Tq, H, Dv]`` with the rank and dtype of ``query`` (``[Tq, H*Dv]`` for rank 2);
      with ``return_lse`` the pair ``(out, lse)``. Rows with no allowed key (a sequence with no
      keys, the leading ``len_q - len_k`` rows under causal) and rows past
      ``cu_seqlens_q[-1]`` are zero with lse ``-inf``; their gradients, and those of key and
      value rows past ``cu_seqlens_k[-1]``, are zero.

    Raises:
      TypeError, ValueError: at trace time, naming the argument, the expected and the given
        value; concrete malformed offsets name the argument, the index and the value. Traced
        ones are clamped and reported under ``jax.experimental.checkify``.
    """
    rank = getattr(query, "ndim", None)
    query, key, value = _normalize_heads(query, key, value, num_heads, kv_num_heads)
    check_shapes(query, key, value)
    Tq, Tk = query.shape[0], key.shape[0]
    cu_q = _check_offsets("cu_seqlens_q", cu_seqlens_q, Tq, "Tq")
    cu_k = _check_offsets("cu_seqlens_k", cu_seqlens_k, Tk, "Tk")
    if cu_q.shape != cu_k.shape:
        raise ValueError(
            f"cu_seqlens_k must have the shape of cu_seqlens_q ({tuple(cu_q.shape)}: one "
            f"offset per sequence boundary), got {tuple(cu_k.shape)}"
        )
    config = dataclasses.replace(
        make_config(query.shape[2], scale, is_causal, softcap, local_window_size),
        max_seqlen_q=_resolve_hint("max_seqlen_q", max_seqlen_q, Tq, "Tq", "cu_seqlens_q", cu_q),
        max_seqlen_k=_resolve_hint("max_seqlen_k", max_seqlen_k, Tk, "Tk", "cu_seqlens_k", cu_k),
    )
    return_lse = check_flag("return_lse", return_lse)
    sinks = check_sinks(sinks, query.shape[1])
    # One pack (the leading axis of the primitive, ffi/core/params.h): [1, Tq, H, D] and so on.
    operands = (query[None], key[None], value[None], cu_q[None], cu_k[None])
    if sinks is None:
        out, lse = packed_attention_with_grad(*operands, config)
    else:  # in the kernels' softmax denominators; rows of no sequence keep lse = -inf
        out, lse = packed_attention_with_sinks_grad(*operands, sinks, config)
    out, lse = out[0], lse[0]
    if rank == 2:
        out = out.reshape(out.shape[:1] + (-1,))
    return (out, lse) if return_lse else out
