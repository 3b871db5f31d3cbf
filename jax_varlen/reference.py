"""The independent oracle: dense, masked attention in plain JAX, following the contract
(docs/semantics.md).

Every score `[B, H, Sq, Skv]` is computed, then masked; nothing here is fast or shared with
the kernels, so the kernels can be tested against it. It is differentiable (gradients for
query, key and value), and works under `jit` and `vmap`.

Empty rows and non-finite data: a row with no allowed key gives zeros and
lse = -inf, decided by the allowed mask (never by the value of the sum); a row that allows a
NaN or Inf gives what the arithmetic gives (NaN), like `jax.nn.dot_product_attention`.

Choices where the contract (docs/semantics.md) is silent:
- Compute dtype is `promote(float32, query.dtype)`: fp32 for f32/f16/bf16, fp64 for f64
  inputs (x64 enabled), which the spec does not cover but a test baseline may want.
- `lse` is always float32, as the spec's table says, even for f64 inputs.
- `softcap` is a static Python number (it picks a code path); `scale` may be traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def reference(
    query,
    key,
    value,
    nonpad_kv_seqlen,
    *,
    nonpad_q_seqlen=None,
    num_heads=None,
    kv_num_heads=None,
    scale=None,
    is_causal=False,
    softcap=0.0,
    local_window_size=None,
    sinks=None,
    return_lse=False,
):
    """Variable-length attention over a padded batch, computed densely and masked.

    Args:
      query: `[B, Sq, H, D]`, or `[B, Sq, H*D]` with `num_heads`.
      key: `[B, Skv, Hkv, D]`, or `[B, Skv, Hkv*D]` with `kv_num_heads` (default `num_heads`).
      value: `[B, Skv, Hkv, Dv]`, or `[B, Skv, Hkv*Dv]`.
      nonpad_kv_seqlen: `[B]` ints; keys `j >= n_b` are padding (any bits, NaN included).
        Values outside `[0, Skv]` are clamped into it.
      nonpad_q_seqlen: optional `[B]` ints (default `Sq` for every sequence); query rows
        `i >= n_q` are padding (any bits, NaN included): zero output, `lse = -inf`. Values
        outside `[0, Sq]` are clamped into it.
      num_heads, kv_num_heads: head counts, needed only for rank-3 inputs.
      scale: multiplies `<q, k>`; default `1/sqrt(D)`.
      is_causal: tail-aligned (bottom-right) causal mask: key `j` is allowed for query `i`
        iff `j <= i + (n - n_q)` (`n_q = Sq` without `nonpad_q_seqlen`).
      softcap: if `> 0`, scores become `softcap * tanh(s / softcap)` before masking.
      local_window_size: `None` (no window), an int `w` (`(w, w)`) or a pair `(left, right)`
        of ints >= 0 (`jax.nn`'s convention), applied at each query's tail-aligned position
        `p = i + n - n_q`: key `j` is allowed iff `p - left <= j <= p + right` (and the
        causal and length rules).
      sinks: optional `[H]` logits, one per query head (gpt-oss): the softmax denominator
        gains `exp(sinks[h])`, so `lse = log(exp(sinks[h]) + sum_j exp(s_j))` over the
        allowed keys and a row with no allowed key gives zeros and `lse = sinks[h]`.
        Differentiable.
      return_lse: also return the log-sum-exp of the allowed scores (and the sink).

    Returns:
      `out` with the rank and dtype of `query` (`[B, Sq, H, Dv]` or `[B, Sq, H*Dv]`); with
      `return_lse`, `(out, lse)` where `lse` is float32 `[B, H, Sq]`. A real query row with
      no allowed key gives zeros and `lse = -inf` (`sinks[h]` with sinks); padded query rows
      give zeros and `lse = -inf`.
    """
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0, got {softcap}")
    rank3 = query.ndim == 3
    if rank3:
        if num_heads is None:
            raise ValueError("num_heads is required for rank-3 [B, S, H*D] inputs")
        kv_num_heads = num_heads if kv_num_heads is None else kv_num_heads
        query = query.reshape(query.shape[:2] + (num_heads, -1))
        key = key.reshape(key.shape[:2] + (kv_num_heads, -1))
        value = value.reshape(value.shape[:2] + (kv_num_heads, -1))

    batch, seqlen_q, heads, head_dim = query.shape
    seqlen_k = key.shape[1]
    if scale is None:
        scale = 1.0 / head_dim**0.5

    # n: [B], clamped so that it can index [0, Skv].
    n = jnp.clip(jnp.asarray(nonpad_kv_seqlen).astype(jnp.int32), 0, seqlen_k)
    kv_valid = jnp.arange(seqlen_k)[None, :] < n[:, None]  # [B, Skv]

    # n_q: [B] real query rows, clamped into [0, Sq] (every row without nonpad_q_seqlen).
    if nonpad_q_seqlen is None:
        n_q = jnp.full((batch,), seqlen_q, jnp.int32)
    else:
        n_q = jnp.clip(jnp.asarray(nonpad_q_seqlen).astype(jnp.int32), 0, seqlen_q)
    q_valid = jnp.arange(seqlen_q)[None, :] < n_q[:, None]  # [B, Sq]

    # allowed: [B, 1, Sq, Skv]. Worked example, causal, n_q=3, n=5: query 0 sees keys 0..2,
    # query 2 sees keys 0..4. With n=1 < n_q=3, queries 0 and 1 see nothing. With n_q = n
    # (a right-padded prefill) query i sees keys 0..i.
    i = jnp.arange(seqlen_q)[:, None]
    j = jnp.arange(seqlen_k)[None, :]
    nb = n[:, None, None, None]
    allowed = (j < nb) & q_valid[:, None, :, None]
    position = i + (nb - n_q[:, None, None, None])  # the query's tail-aligned key position
    allowed = allowed & _position_mask(j, position, is_causal, local_window_size)
    out, lse = _masked_attention(query, key, value, kv_valid, allowed, scale, softcap,
                                 q_valid=q_valid, sinks=sinks)
    if sinks is not None:  # padded query rows are no rows: lse -inf, as without sinks
        lse = jnp.where(q_valid[:, None, :], lse, -jnp.inf)
    if rank3:
        out = out.reshape(batch, seqlen_q, -1)
    return (out, lse) if return_lse else out


def _window(local_window_size):
    """``None``, an int ``w`` or a pair ``(left, right)`` -> ``(left, right)`` or ``None``."""
    if local_window_size is None:
        return None
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)
    left, right = (int(w) for w in local_window_size)
    if left < 0 or right < 0:
        raise ValueError(f"local_window_size must be >= 0, got {local_window_size}")
    return left, right


def _position_mask(j, position, is_causal, local_window_size):
    """Keys ``j`` a query at tail-aligned key position ``position`` may see (broadcasting):
    ``j <= position`` when causal, ``position - left <= j <= position + right`` in a window."""
    ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(j), jnp.shape(position)), bool)
    if is_causal:
        ok = ok & (j <= position)
    window = _window(local_window_size)
    if window is not None:
        ok = ok & (j >= position - window[0]) & (j <= position + window[1])
    return ok


def _masked_attention(query, key, value, kv_valid, allowed, scale, softcap, q_valid=None,
                      sinks=None):
    """Dense softmax attention under a mask: query [B, Sq, H, D], key [B, Skv, Hkv, D], value
    [B, Skv, Hkv, Dv], kv_valid [B, Skv] (keys that may be read at all), allowed [B, 1, Sq, Skv]
    (a subset of them per query row), q_valid [B, Sq] (query rows that may be read at all;
    default every row), sinks [H] (a logit per head in every row's denominator; default none).
    Returns out [B, Sq, H, Dv] (query's dtype) and float32 lse [B, H, Sq]."""
    heads, kv_heads = query.shape[2], key.shape[2]
    out_dtype = query.dtype
    compute = jnp.promote_types(jnp.float32, query.dtype)

    # Zero keys/values that may not be read before any product: p * NaN would be NaN even
    # where p == 0. The where also makes their gradients exactly zero.
    kv_valid = kv_valid[:, :, None, None]  # [B, Skv, 1, 1]
    q = query.astype(compute)
    if q_valid is not None:
        q = jnp.where(q_valid[:, :, None, None], q, 0)
    k = jnp.where(kv_valid, key.astype(compute), 0)
    v = jnp.where(kv_valid, value.astype(compute), 0)

    # GQA/MQA: query head h reads kv head h // (H // Hkv); repeat maps exactly that way
    # (e.g. H=4, Hkv=2: kv heads [0, 0, 1, 1]).
    group = heads // kv_heads
    k = jnp.repeat(k, group, axis=2)  # [B, Skv, H, D]
    v = jnp.repeat(v, group, axis=2)  # [B, Skv, H, Dv]

    s = scale * jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=_HIGHEST)  # [B, H, Sq, Skv]
    if softcap > 0:
        s = softcap * jnp.tanh(s / softcap)
    any_allowed = jnp.any(allowed, axis=-1, keepdims=True)  # [B, 1, Sq, 1]

    # Double where: masked rows use a safe max (0) and a safe sum (1), so neither the
    # forward nor the backward pass ever sees -inf - -inf or 0 / 0.
    s = jnp.where(allowed, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf))
    if sinks is None:
        m = jnp.where(any_allowed, m, 0.0)
        p = jnp.exp(s - m)  # masked scores are -inf, so p == 0 there
        l = jnp.where(any_allowed, jnp.sum(p, axis=-1, keepdims=True), 1.0)
    else:
        # The sink is one more (value-less) score: the max includes it, so it is finite in
        # every row and an empty row gets l = 1, lse = sink.
        sink = jnp.asarray(sinks).astype(compute)[None, :, None, None]  # [1, H, 1, 1]
        m = jnp.maximum(m, jax.lax.stop_gradient(sink))
        p = jnp.exp(s - m)
        l = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink - m)
        any_allowed = jnp.ones_like(any_allowed)  # lse = m + log(l) in every row

    # Masked weights are exactly 0 even in a row whose max or sum is NaN (non-finite real
    # data): the NaN stays in that row's output and never reaches the gradients of keys and
    # values the row does not allow.
    weights = jnp.where(allowed, p / l, 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision=_HIGHEST)  # [B, Sq, H, Dv]
    lse = jnp.where(any_allowed, m + jnp.log(l), -jnp.inf)[..., 0]  # [B, H, Sq]
    return out.astype(out_dtype), lse.astype(jnp.float32)


def _segments(cu_seqlens, rows: int):
    """For each of ``rows`` packed rows: (sequence index or -1 past the last offset, position
    in its sequence, its sequence's length). Offsets are clamped into [0, rows] and made
    non-decreasing first (invalid offsets are clamped, as the kernels clamp them)."""
    cu = jax.lax.cummax(jnp.clip(jnp.asarray(cu_seqlens).astype(jnp.int32), 0, rows))
    r = jnp.arange(rows)
    b = jnp.searchsorted(cu[1:], r, side="right")  # sequences that end at or before row r
    owned = r < cu[-1]
    bc = jnp.minimum(b, cu.shape[0] - 2)
    start = cu[bc]
    return jnp.where(owned, b, -1), r - start, cu[bc + 1] - start


def packed_reference(
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
    """The packed layout's attention, computed densely over every (query row, key row) pair
    and masked to the pairs of one sequence.

    Args:
      query: `[Tq, H, D]`, or `[Tq, H*D]` with `num_heads`.
      key, value: `[Tk, Hkv, D]` and `[Tk, Hkv, Dv]` (or merged heads with `kv_num_heads`).
      cu_seqlens_q, cu_seqlens_k: `[B + 1]` ints: sequence `b` owns query rows
        `cu_seqlens_q[b]:cu_seqlens_q[b+1]` and key rows `cu_seqlens_k[b]:cu_seqlens_k[b+1]`.
        Rows past the last offset belong to no sequence (any bits, never read).
      max_seqlen_q, max_seqlen_k: accepted for `packed_attention`'s signature; valid offsets
        never exceed them, and the oracle does not need them.
      Others: as for `reference`; causal and the window are tail-aligned per sequence
        (query `i` at key position `p = i + len_k - len_q`; causal: key `j` allowed iff
        `j <= p`).

    Returns:
      `out` with the rank and dtype of `query`; with `return_lse`, `(out, lse)` where `lse`
      is float32 `[H, Tq]`. Rows with no allowed key, and rows past the last offset, give
      zeros and `lse = -inf` (`sinks[h]` with sinks, for rows a sequence owns).
    """
    del max_seqlen_q, max_seqlen_k
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0, got {softcap}")
    rank2 = query.ndim == 2
    if rank2:
        if num_heads is None:
            raise ValueError("num_heads is required for rank-2 [T, H*D] inputs")
        kv_num_heads = num_heads if kv_num_heads is None else kv_num_heads
        query = query.reshape(query.shape[:1] + (num_heads, -1))
        key = key.reshape(key.shape[:1] + (kv_num_heads, -1))
        value = value.reshape(value.shape[:1] + (kv_num_heads, -1))
    if scale is None:
        scale = 1.0 / query.shape[-1] ** 0.5

    # Worked example, cu_seqlens_q = [0, 2, 5], Tq = 6: rows 0-1 are sequence 0 (positions
    # 0-1 of 2), rows 2-4 sequence 1 (positions 0-2 of 3), row 5 no sequence's.
    seq_q, pos_q, len_q = _segments(cu_seqlens_q, query.shape[0])
    seq_k, pos_k, len_k = _segments(cu_seqlens_k, key.shape[0])
    allowed = (seq_q[:, None] == seq_k[None, :]) & (seq_q[:, None] >= 0)  # [Tq, Tk]
    position = pos_q[:, None] + len_k[None, :] - len_q[:, None]
    allowed = allowed & _position_mask(pos_k[None, :], position, is_causal, local_window_size)
    out, lse = _masked_attention(query[None], key[None], value[None], (seq_k >= 0)[None],
                                 allowed[None, None], scale, softcap, q_valid=(seq_q >= 0)[None],
                                 sinks=sinks)
    out, lse = out[0], lse[0]
    if sinks is not None:  # rows no sequence owns stay -inf, as without sinks
        lse = jnp.where((seq_q >= 0)[None, :], lse, -jnp.inf)
    if rank2:
        out = out.reshape(out.shape[:1] + (-1,))
    return (out, lse) if return_lse else out


def paged_reference(
    query,
    key_cache,
    value_cache,
    block_table,
    seqlens_k,
    *,
    cu_seqlens_q=None,
    max_seqlen_q=None,
    num_heads=None,
    kv_num_heads=None,
    scale=None,
    is_causal=False,
    softcap=0.0,
    local_window_size=None,
    sinks=None,
    return_lse=False,
):
    """The paged layout's attention: each key read on its own through the block table, then
    the dense oracle (`reference` for a padded query, `packed_reference` for a packed one).

    Key `j` of sequence `b` is row `j % page_size` of page `block_table[b, j // page_size]`
    (entries clamped into `[0, num_pages)`); sequence `b` has `seqlens_k[b]` keys (clamped into
    `[0, max_pages * page_size]`) and its queries are the last of them.

    Args:
      query: padded `[B, Sq, H, D]` (or `[B, Sq, H*D]`), or packed `[Tq, H, D]` (`[Tq, H*D]`)
        with `cu_seqlens_q` `[B + 1]`.
      key_cache, value_cache: `[num_pages, page_size, Hkv, D]` and `[..., Dv]` (or merged heads).
      block_table: `[B, max_pages]` ints; seqlens_k: `[B]` ints.
      max_seqlen_q: accepted for `paged_attention`'s signature; valid offsets never exceed it.
      Others: as for `reference`.

    Returns:
      As `reference` (padded) or `packed_reference` (packed: `lse` `[H, Tq]`).
    """
    num_pages, page_size = key_cache.shape[:2]
    max_pages = block_table.shape[1]
    table = jnp.clip(jnp.asarray(block_table).astype(jnp.int32), 0, num_pages - 1)
    extent = max_pages * page_size
    n = jnp.clip(jnp.asarray(seqlens_k).astype(jnp.int32), 0, extent)
    kw = dict(num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, is_causal=is_causal,
              softcap=softcap, local_window_size=local_window_size, sinks=sinks,
              return_lse=return_lse)
    if cu_seqlens_q is None:
        # keys[b, j] = key_cache[table[b, j // page_size], j % page_size]: [B, extent, ...]
        j = jnp.arange(extent)
        pages = table[:, j // page_size]  # [B, extent]
        return reference(query, key_cache[pages, j % page_size],
                         value_cache[pages, j % page_size], n, **kw)
    # Packed keys: sequence b's n[b] keys at rows cu_k[b]:cu_k[b+1] of a [B * extent] buffer,
    # read one by one; the rows past cu_k[-1] are zero (no sequence's).
    cu_k = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(n)])
    rows = jnp.arange(table.shape[0] * extent)
    seq = jnp.minimum(jnp.searchsorted(cu_k[1:], rows, side="right"), table.shape[0] - 1)
    pos = jnp.clip(rows - cu_k[seq], 0, extent - 1)
    real = (rows < cu_k[-1]).reshape((-1,) + (1,) * (key_cache.ndim - 2))
    pages = table[seq, pos // page_size]
    key = jnp.where(real, key_cache[pages, pos % page_size], 0)
    value = jnp.where(real, value_cache[pages, pos % page_size], 0)
    return packed_reference(query, key, value, cu_seqlens_q, cu_k, **kw)
