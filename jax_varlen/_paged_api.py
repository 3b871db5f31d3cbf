"""``paged_attention``: attention over a paged KV cache (vLLM's layout), forward only.

Key ``j`` of sequence ``b`` is row ``j % page_size`` of page ``block_table[b, j // page_size]``
of ``key_cache`` ``[num_pages, page_size, Hkv, D]`` (and of ``value_cache``). The queries are the
newest tokens of each sequence: padded ``[B, Sq, H, D]`` (the last ``Sq`` of its
``seqlens_k[b]`` keys) or packed ``[Tq, H, D]`` with ``cu_seqlens_q`` (a continuous-batching
step: prefill chunks and decodes in one call).

Two ways to compute, chosen per call by the CUDA plan (ffi/plan/plan.h; ``_paged_primitive``):
- **in place**: decode-like calls (float16/bfloat16, head sizes multiples of 8, at most 16
  queries per sequence -- padded ``Sq``, or packed with ``max_seqlen_q = 1`` -- and a
  ``page_size`` multiple of 16) bind ``paged_attention_fwd_p``: on the GPU the split-KV kernel
  loads each key tile through the block table, so no page is copied and unused pages are never
  read; on the CPU the primitive gathers the pages and runs the padded CPU kernel. With
  ``JAX_VARLEN_PAGED_SM90=1`` (opt-in) padded chunks of more than 16 queries bind it too, and
  the Hopper forward's producer warps gather each key tile from the pages (cp.async; GPU tests
  pass on an H100, but it measured 2.6x slower than gathering first, benchmarks/NOTES.md);
- **gathered**: every other call copies the pages each sequence needs through the (clamped)
  block table into a padded ``[B, max_pages * page_size, Hkv, D]`` key and value and calls
  :func:`attention` with ``nonpad_kv_seqlen = seqlens_k``; packed queries are scattered into
  ``[B, max_seqlen_q, H, D]`` with ``nonpad_q_seqlen`` and gathered back.
Both give the same results; the semantics do not depend on the way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_varlen import _checkify
from jax_varlen._api import (
    _heads,
    as_lengths,
    attention,
    canonical,
    check_array,
    check_flag,
    check_lengths,
    check_sinks,
    check_static,
    dtype_name,
    make_config,
    split_heads,
    with_sinks,
)
from jax_varlen._packed_api import _check_offsets, _resolve_hint
from jax_varlen._paged_primitive import gather_pages, paged_attention_fwd, takes

_FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
_INDEX_DTYPES = (jnp.int32, jnp.int64)
_EXTENT_NAME = "max_pages * page_size"

# (packed, cache rank) -> query's expected rank and layout.
_QUERY_LAYOUT = {
    (False, 4): (4, "[B, Sq, H, D]"), (False, 3): (3, "[B, Sq, H*D]"),
    (True, 4): (3, "[Tq, H, D]"), (True, 3): (2, "[Tq, H*D]"),
}


# --------------------------------------------------------------------------------------------
# The indices' checkify report; clamping cu_seqlens_q.
#
# ``paged_inputs_p`` carries the indices' checkify report (_checkify.py: the rules live on
# primitives, so plain jit programs carry no check effect and jax.export serializes them). It
# clamps only cu_seqlens_q (packed) into [0, Tq], non-decreasing (_pad_queries indexes with
# it); the block table and seqlens_k pass through: every reader clamps them where it reads
# them -- the paged kernel (seqlen.h, paged_key_row and SeqlenInfo), gather_pages and the
# attention kernels --, and the two XLA fusions that clamped them here cost 5.4 us of a 232 us
# decode step (H100, benchmarks/NOTES.md, session 2026-12-07 m). Operands lead with any number
# of vmapped axes: block_table [..., B, max_pages], seqlens_k [..., B], cu_seqlens_q [..., B + 1].

paged_inputs_p = Primitive("jax_varlen_paged_inputs")
paged_inputs_p.multiple_results = True


def _clamp(block_table, seqlens_k, *cu_seqlens_q, num_pages, extent, rows, max_seqlen_q):
    del num_pages, extent, max_seqlen_q  # checked, not clamped here (see above)
    clamped = [block_table, seqlens_k]
    if cu_seqlens_q:
        clamped.append(jax.lax.cummax(jnp.clip(cu_seqlens_q[0], 0, rows),
                                      axis=cu_seqlens_q[0].ndim - 1))
    return clamped


paged_inputs_p.def_impl(_clamp)
paged_inputs_p.def_abstract_eval(lambda *operands, **params: list(operands))
mlir.register_lowering(paged_inputs_p, mlir.lower_fun(_clamp, multiple_results=True))


def _batch_rule(operands, dims, **params):
    """A vmapped axis becomes one more leading axis of every operand."""
    size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
    operands = [batching.bdim_at_front(x, d, size) for x, d in zip(operands, dims)]
    return paged_inputs_p.bind(*operands, **params), [0] * len(operands)


batching.primitive_batchers[paged_inputs_p] = _batch_rule


def _checks(block_table, seqlens_k, *cu_seqlens_q, num_pages, extent, rows, max_seqlen_q):
    page_size = extent // block_table.shape[-1]
    checks = [_checkify.block_table_check(block_table, seqlens_k, num_pages, page_size),
              _checkify.lengths_check("seqlens_k", seqlens_k, extent, _EXTENT_NAME)]
    if cu_seqlens_q:
        cu = cu_seqlens_q[0]
        checks += _checkify.cu_seqlens_checks("cu_seqlens_q", cu.reshape(-1, cu.shape[-1]),
                                              rows, max_seqlen_q, "max_seqlen_q")
    return checks


_checkify._register(paged_inputs_p, _checks)


# --------------------------------------------------------------------------------------------
# Argument checks.


def _normalize(query, key_cache, value_cache, packed, num_heads, kv_num_heads):
    """Checks ranks and head counts; returns query ``[B, Sq, H, D]`` (``[Tq, H, D]`` packed)
    and caches ``[num_pages, page_size, Hkv, D]`` / ``[..., Dv]``."""
    for name, x in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_array(name, x)
    query, key_cache, value_cache = map(canonical, (query, key_cache, value_cache))
    if key_cache.ndim not in (3, 4):
        raise ValueError(
            f"key_cache must have rank 4 [num_pages, page_size, Hkv, D] or 3 [num_pages, "
            f"page_size, Hkv*D], got shape {tuple(key_cache.shape)}")
    if value_cache.ndim != key_cache.ndim:
        raise ValueError(
            f"value_cache must have the rank of key_cache ({key_cache.ndim}), got shape "
            f"{tuple(value_cache.shape)}")
    rank, layout = _QUERY_LAYOUT[packed, key_cache.ndim]
    if query.ndim != rank:
        form = "with cu_seqlens_q (packed)" if packed else "without cu_seqlens_q (padded)"
        raise ValueError(
            f"query must have rank {rank} {layout} {form} and rank-{key_cache.ndim} caches, "
            f"got shape {tuple(query.shape)}")
    if key_cache.ndim == 3:  # merged heads: [..., H*D]
        if num_heads is None:
            raise ValueError("num_heads is required for merged-head inputs (rank-3 caches "
                             "[num_pages, page_size, Hkv*D]); got None")
        num_heads = _heads("num_heads", num_heads, None)
        kv_num_heads = _heads("kv_num_heads", kv_num_heads, num_heads)
        query = split_heads("query", query, num_heads, "num_heads")
        key_cache = split_heads("key_cache", key_cache, kv_num_heads, "kv_num_heads")
        value_cache = split_heads("value_cache", value_cache, kv_num_heads, "kv_num_heads")
    else:
        for name, given, x, x_name in (("num_heads", num_heads, query, "query"),
                                       ("kv_num_heads", kv_num_heads, key_cache, "key_cache")):
            if given is not None and _heads(name, given, None) != x.shape[-2]:
                raise ValueError(f"{name}={given} does not match {x_name}'s head axis: "
                                 f"{x_name} has shape {tuple(x.shape)}")
    return query, key_cache, value_cache


def _check_caches(query, key_cache, value_cache) -> None:
    H, D = query.shape[-2:]
    num_pages, page_size, Hkv, _ = key_cache.shape
    if query.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"query must be float32, float16 or bfloat16, got {dtype_name(query.dtype)}")
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache)):
        if x.dtype != query.dtype:
            raise TypeError(f"{name} must have query's dtype ({dtype_name(query.dtype)}), got "
                            f"{dtype_name(x.dtype)}")
    if num_pages < 1 or page_size < 1:
        raise ValueError(
            f"key_cache must hold at least one page of at least one row ([num_pages, "
            f"page_size, ...] with both >= 1), got shape {tuple(key_cache.shape)}")
    for axis, what in ((0, "page count num_pages"), (1, "page_size"), (2, "head count Hkv")):
        if value_cache.shape[axis] != key_cache.shape[axis]:
            raise ValueError(
                f"value_cache's {what} (dimension {axis}) must equal key_cache's "
                f"({key_cache.shape[axis]}), got value_cache shape {tuple(value_cache.shape)} "
                f"and key_cache shape {tuple(key_cache.shape)}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(
            f"key_cache's head count Hkv = {Hkv} must divide query's H = {H} (each kv head "
            f"serves H / Hkv query heads); query has shape {tuple(query.shape)}, key_cache "
            f"{tuple(key_cache.shape)}")
    if key_cache.shape[3] != D:
        raise ValueError(f"key_cache's head size must equal query's ({D}), got key_cache "
                         f"shape {tuple(key_cache.shape)}")
    if D == 0 or value_cache.shape[3] == 0:
        raise ValueError(f"head sizes must be at least 1, got query shape {tuple(query.shape)} "
                         f"and value_cache shape {tuple(value_cache.shape)}")


def _check_block_table(block_table, batch: int, batch_name: str):
    """``[B, max_pages]`` int32/int64 page indices; returns them as int32 (int64 after a clip
    that keeps an out-of-range entry out of range)."""
    if isinstance(block_table, (list, tuple)):
        block_table = np.asarray(block_table)
    check_array("block_table", block_table)
    if block_table.dtype not in _INDEX_DTYPES:
        raise TypeError(f"block_table must be int32 or int64, got "
                        f"{dtype_name(block_table.dtype)}")
    if block_table.ndim != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(
            f"block_table must have shape [B, max_pages] with B = {batch} ({batch_name}) and "
            f"max_pages >= 1, got {tuple(block_table.shape)}")
    return block_table


def _check_used_pages(block_table, seqlens_k, num_pages: int, page_size: int) -> None:
    """Concrete tables: every page a sequence's keys use must exist (entries past a sequence's
    pages are never read, any value)."""
    if isinstance(block_table, jax.core.Tracer) or isinstance(seqlens_k, jax.core.Tracer):
        return
    table, n = np.asarray(block_table), np.asarray(seqlens_k)
    used = np.arange(table.shape[1])[None, :] < -(-n[:, None] // page_size)
    bad = np.argwhere(used & ((table < 0) | (table >= num_pages)))
    if bad.size:
        b, p = (int(i) for i in bad[0])
        raise ValueError(
            f"block_table[{b}, {p}] = {int(table[b, p])} is out of range: the pages of "
            f"sequence {b}'s {int(n[b])} keys (seqlens_k[{b}]) must lie in [0, num_pages = "
            f"{num_pages})")


# --------------------------------------------------------------------------------------------
# The computation (forward only).


def _forward_only(fn, *args):
    """``fn(*args)`` under a ``custom_jvp`` whose rule raises: jax.grad, jax.jvp and
    jax.linearize through paged_attention fail at trace time instead of giving zeros."""

    @jax.custom_jvp
    def forward(*args):
        return fn(*args)

    @forward.defjvp
    def _no_derivative(primals, tangents):
        raise NotImplementedError(
            "paged_attention is forward-only (inference): it has no gradient. Train with "
            "jax_varlen.attention or jax_varlen.packed_attention on contiguous keys, or "
            "stop the gradient of paged_attention's inputs (jax.lax.stop_gradient)")

    return forward(*args)


def _pad_queries(query, cu, max_seqlen_q: int):
    """Packed query [Tq, H, D] -> padded [B, max_seqlen_q, H, D] and the counts [B]: row i of
    sequence b (packed row cu[b] + i) goes to [b, i]; rows past a sequence's count are zero.
    Worked example, cu = [0, 3, 3, 4], max_seqlen_q = 3: rows 0-2 -> [0, 0:3], no row for
    sequence 1, row 3 -> [2, 0]."""
    Tq = query.shape[0]
    counts = jnp.minimum(cu[1:] - cu[:-1], max_seqlen_q)  # [B]; clamped cu: in [0, Tq]
    i = jnp.arange(max_seqlen_q)
    rows = jnp.minimum(cu[:-1, None] + i[None, :], Tq - 1)  # [B, max_seqlen_q]
    real = (i[None, :] < counts[:, None])[..., None, None]
    return jnp.where(real, query[rows], 0), counts


def _compute(query, key_cache, value_cache, block_table, seqlens_k, *rest, packed,
             max_seqlen_q, has_sinks, attention_kw, config):
    """``(out, lse)`` of a paged call. ``config``: the paged primitive's static parameters when
    its kernel takes the call (``paged_attention`` asks the plan: ``_paged_primitive.takes``),
    which then reads the pages in place on the GPU; ``None``: the pages each sequence needs are
    gathered into dense keys and :func:`attention` runs on them. ``rest``: ``cu_seqlens_q``
    (packed, clamped), then ``sinks`` (float32 ``[H]``, if any); the table and lengths as
    given, clamped where they are read (gather_pages, the kernels)."""
    rest = list(rest)
    sinks = rest.pop() if has_sinks else None
    Tq, B = query.shape[0], seqlens_k.shape[0]  # Tq: packed rows (packed form)
    if packed:
        (cu,) = rest
        query, counts = _pad_queries(query, cu, max_seqlen_q)  # [B, max_seqlen_q, H, D]
    if config is not None:  # the paged kernel: padded queries, every one real (max_seqlen_q 1)
        out, lse = paged_attention_fwd(query, key_cache, value_cache, seqlens_k, block_table,
                                       config)
        if sinks is not None:  # a sequence without a new token (packed) has no real row
            real_rows = (counts > 0)[:, None, None] if packed else None
            out, lse = with_sinks(out, lse, sinks, real_rows)
    else:
        key = gather_pages(key_cache, block_table)      # [B, max_pages * page_size, Hkv, D]
        value = gather_pages(value_cache, block_table)  # [B, max_pages * page_size, Hkv, Dv]
        kw = dict(attention_kw, sinks=sinks) if has_sinks else dict(attention_kw)
        if packed:
            kw["nonpad_q_seqlen"] = counts
        out, lse = attention(query, key, value, seqlens_k, return_lse=True, **kw)
    if not packed:
        return out, lse
    # Back to packed rows: row r of sequence b (cu[b] <= r < cu[b + 1]) is padded row
    # [b, r - cu[b]]; rows of no sequence, and those past max_seqlen_q, are zero (lse -inf).
    # Worked example, cu = [0, 3, 3, 4], Tq = 6: rows 0-2 are [0, 0:3], row 3 is [2, 0], rows
    # 4-5 no sequence's.
    r = jnp.arange(Tq)
    b = jnp.minimum(jnp.searchsorted(cu[1:], r, side="right"), B - 1)
    i = r - cu[b]
    owned = (r < cu[-1]) & (i >= 0) & (i < max_seqlen_q)
    i = jnp.clip(i, 0, max_seqlen_q - 1)
    out = jnp.where(owned[:, None, None], out[b, i], 0)        # [Tq, H, Dv]
    lse = jnp.where(owned[None, :], lse[b, :, i].T, -jnp.inf)  # [H, Tq]
    return out, lse


def paged_attention(
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
    """Attention over a paged KV cache, forward only (inference: decode, speculative tokens,
    chunked prefill, and mixed continuous-batching steps).

    Layout (vLLM's): key ``j`` of sequence ``b`` is row ``j % page_size`` of page
    ``block_table[b, j // page_size]`` of ``key_cache`` (the same for ``value_cache``); sequence
    ``b`` has ``seqlens_k[b]`` keys. The queries are the newest tokens of each sequence: its
    ``m_b`` queries are the last ``m_b`` of its keys (``attention``'s tail-aligned rule with
    ``nonpad_kv_seqlen = seqlens_k``).

    Decode-like calls read the pages in place on the GPU (float16/bfloat16, head sizes
    multiples of 8, at most 16 queries per sequence -- padded ``Sq <= 16``, or packed with
    ``max_seqlen_q = 1`` -- and ``page_size`` a multiple of 16): the split-KV kernel loads each
    key tile through the block table. With ``JAX_VARLEN_PAGED_SM90=1`` padded chunks of more
    than 16 queries (chunked prefill) read them in place too, on the Hopper forward (its
    producer warps gather each key tile's pages; GPU tests pass on an H100, but it measured
    2.6x slower than gathering first, hence opt-in: benchmarks/NOTES.md). Other calls
    (longer query runs, other page sizes, float32) copy the pages each sequence needs into a
    padded
    ``[B, max_pages * page_size, Hkv, D]`` key and value and call :func:`attention`: their
    cost and memory follow ``B * max_pages * page_size``.

    Args:
      query: padded ``[B, Sq, H, D]`` (every sequence has ``m_b = Sq`` queries: decode with
        ``Sq = 1``, speculative tokens, equal chunks) or, with ``cu_seqlens_q``, packed
        ``[Tq, H, D]``; merged heads ``[B, Sq, H*D]`` / ``[Tq, H*D]`` go with rank-3 caches and
        ``num_heads``. float32, float16 or bfloat16.
      key_cache: ``[num_pages, page_size, Hkv, D]`` (or ``[num_pages, page_size, Hkv*D]``),
        query's dtype. Any ``page_size >= 1`` works; a multiple of 16 is read in place on the
        GPU (see above). Rows no sequence uses (other pages, the tail of a
        sequence's last page) may hold any bits, NaN included: they never change the result.
      value_cache: ``[num_pages, page_size, Hkv, Dv]`` (or merged), the same ``num_pages``,
        ``page_size`` and ``Hkv``.
      block_table: int32 or int64 ``[B, max_pages]``: the pages of each sequence, in order.
        Only the first ``ceil(seqlens_k[b] / page_size)`` entries of row ``b`` are read; the
        rest may hold anything (e.g. -1). A used entry outside ``[0, num_pages)`` is invalid:
        ``ValueError`` when the table and ``seqlens_k`` are concrete; traced, it is clamped
        (never an out-of-bounds read) and reported under ``jax.experimental.checkify``.
      seqlens_k: int32 or int64 ``[B]`` (or a list): keys per sequence, the new tokens'
        included, in ``[0, max_pages * page_size]`` (concrete values outside raise
        ``ValueError``; traced ones are clamped and reported under checkify).
      cu_seqlens_q: optional int32/int64 ``[B + 1]`` offsets for packed queries (as in
        :func:`packed_attention`): sequence ``b``'s queries are rows
        ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (none for a sequence with no new token); rows
        past ``cu_seqlens_q[-1]`` are no sequence's (never read; zero output).
      max_seqlen_q: static bound of the per-sequence query counts (packed form only; default
        ``Tq``). It sizes the padded copy ``[B, max_seqlen_q, H, D]``: pass the longest
        chunk. A longer sequence raises ``ValueError`` (concrete offsets) or is clamped to it
        (rows past it zero) and reported under checkify.
      num_heads, kv_num_heads, scale, is_causal, softcap, return_lse: as for
        :func:`attention` (static). ``is_causal`` is tail-aligned: query ``i`` of a sequence
        with ``m`` queries and ``n`` keys sees key ``j`` iff ``j <= i + n - m``.
      local_window_size, sinks: passed to :func:`attention` when not ``None``.

    Returns:
      ``out`` ``[B, Sq, H, Dv]`` (packed: ``[Tq, H, Dv]``) with query's rank and dtype; with
      ``return_lse`` also the float32 lse ``[B, H, Sq]`` (packed: ``[H, Tq]``). Rows with no
      allowed key (``seqlens_k[b] = 0``; the leading ``m - n`` rows under causal) and packed
      rows of no sequence are zero with lse ``-inf``.

    Not batched beyond ``B``: ``jax.vmap`` works (each element an independent call, with its
    own caches or shared ones). Forward only: differentiating through it (``jax.grad``,
    ``jax.jvp``) raises ``NotImplementedError``.

    Raises:
      TypeError, ValueError: at trace time, naming the argument, the expected and the given
        value.
    """
    packed = cu_seqlens_q is not None
    rank = getattr(query, "ndim", None)
    query, key_cache, value_cache = _normalize(query, key_cache, value_cache, packed,
                                               num_heads, kv_num_heads)
    _check_caches(query, key_cache, value_cache)
    num_pages, page_size = key_cache.shape[:2]
    check_static("local_window_size", local_window_size)
    config = make_config(query.shape[-1], scale, is_causal, softcap, local_window_size)
    return_lse = check_flag("return_lse", return_lse)
    sinks = check_sinks(sinks, query.shape[-2])

    if packed:
        cu = _check_offsets("cu_seqlens_q", cu_seqlens_q, query.shape[0], "Tq")
        batch, batch_name = cu.shape[0] - 1, "len(cu_seqlens_q) - 1"
    else:
        if max_seqlen_q is not None:
            raise ValueError(f"max_seqlen_q bounds packed query counts: pass it with "
                             f"cu_seqlens_q, or not at all; got max_seqlen_q={max_seqlen_q!r} "
                             f"and cu_seqlens_q=None")
        batch, batch_name = query.shape[0], "query's batch"
    block_table = _check_block_table(block_table, batch, batch_name)
    extent = block_table.shape[1] * page_size
    seqlens_k = as_lengths("seqlens_k", seqlens_k)
    lengths = check_lengths("seqlens_k", seqlens_k, batch, extent, _EXTENT_NAME)
    _check_used_pages(block_table, seqlens_k, num_pages, page_size)
    table = jnp.asarray(block_table)
    if table.dtype != jnp.int32:  # int64: clipped first, so that out of range stays out
        table = jnp.clip(table, -1, num_pages).astype(jnp.int32)

    operands, max_q = [table, lengths], 0
    if packed:
        max_q = _resolve_hint("max_seqlen_q", max_seqlen_q, query.shape[0], "Tq",
                              "cu_seqlens_q", cu)
        operands.append(cu)
    operands = paged_inputs_p.bind(*operands, num_pages=num_pages, extent=extent,
                                   rows=query.shape[0], max_seqlen_q=max_q)

    # local_window_size and sinks reach attention only when given.
    attention_kw = dict(scale=scale, is_causal=is_causal, softcap=softcap)
    if local_window_size is not None:
        attention_kw["local_window_size"] = local_window_size
    if sinks is not None:
        operands.append(sinks)
    H, Dv = query.shape[-2], value_cache.shape[-1]
    if packed and (query.shape[0] == 0 or max_q == 0 or batch == 0):
        # No query row belongs to a sequence: nothing to compute.
        out = jnp.zeros((query.shape[0], H, Dv), query.dtype)
        lse = jnp.full((H, query.shape[0]), -jnp.inf, jnp.float32)
    else:
        # The paged kernel reads the pages in place when the plan takes the call (decode-like
        # calls: padded queries, or packed ones with max_seqlen_q = 1: the plan's packed_queries);
        # the rest gathers the pages each sequence needs.
        padded_shape = (batch, max_q) + query.shape[1:] if packed else query.shape
        in_place = takes(padded_shape, query.dtype, key_cache, value_cache, block_table.shape[1],
                         packed_queries=packed)
        fn = functools.partial(_compute, packed=packed, max_seqlen_q=max_q,
                               has_sinks=sinks is not None, attention_kw=attention_kw,
                               config=config if in_place else None)
        out, lse = _forward_only(fn, query, key_cache, value_cache, *operands)
    if out.ndim > rank:  # merged heads in, merged heads out
        out = out.reshape(out.shape[:-2] + (-1,))
    return (out, lse) if return_lse else out
