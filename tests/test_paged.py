"""``paged_attention``: attention over a paged KV cache, on every backend.

Key ``j`` of sequence ``b`` is row ``j % page_size`` of page ``block_table[b, j // page_size]``.
Every case builds the same keys twice: as a paged cache (pages in a shuffled order, NaN in
every unused page, in the tail of each sequence's last page and in the padded query rows,
garbage in the table entries past a sequence's pages) and as the unpaged equivalent (a padded
``[B, max_pages * page_size, Hkv, D]``). The op is checked against the float64 oracle
(``paged_reference``, which reads each key on its own through the table) and against
``attention`` on the unpaged equivalent; the oracle is checked against a loop from the layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_varlen
from jax_varlen import _ffi
from conftest import DTYPES, RTOL, allowed_keys, assert_lse_close, assert_out_close, backend_cases, bits

_STATIC = ("max_seqlen_q", "num_heads", "kv_num_heads", "scale", "is_causal", "softcap",
           "local_window_size", "return_lse")
_SINKS4 = np.array([0.5, -1.0, 2.0, 0.0], np.float32)  # [H = 4]: one logit per query head


def _paged(seqlens, page_size, max_pages, Hkv, D, Dv, dtype, *, seed=0, pad=np.nan,
           spare_pages=3, order_seed=None):
    """A paged cache holding random keys/values for sequences of ``seqlens`` keys.

    Returns ``(key_cache, value_cache, block_table, seqlens_k, key, value)``: the caches
    ``[num_pages, page_size, Hkv, D/Dv]`` (pages assigned in a shuffled order, ``spare_pages``
    never used; every row no sequence uses is ``pad``), the int32 table ``[B, max_pages]``
    (entries past a sequence's pages: -1, past the last page, INT32_MAX, or an unused page), and
    the unpaged equivalent ``key``/``value`` ``[B, max_pages * page_size, ...]`` (``pad`` past
    each length). ``order_seed`` shuffles the pages differently, same keys."""
    rng = np.random.default_rng(seed)
    B, S = len(seqlens), max_pages * page_size
    key = rng.standard_normal((B, S, Hkv, D), dtype=np.float32)
    value = rng.standard_normal((B, S, Hkv, Dv), dtype=np.float32)
    used = [-(-n // page_size) for n in seqlens]
    assert max(used, default=0) <= max_pages
    num_pages = sum(used) + spare_pages
    order = np.random.default_rng(seed + 1 if order_seed is None else order_seed).permutation(
        num_pages)
    key_cache = np.full((num_pages, page_size, Hkv, D), pad, np.float32)
    value_cache = np.full((num_pages, page_size, Hkv, Dv), pad, np.float32)
    garbage = [-1, num_pages, np.iinfo(np.int32).max]
    garbage += [int(p) for p in order[sum(used):]]  # the unused (pad-filled) pages
    table = np.zeros((B, max_pages), np.int32)
    nxt = 0
    for b, n in enumerate(seqlens):
        key[b, n:] = pad
        value[b, n:] = pad
        for p in range(max_pages):
            if p < used[b]:
                page = int(order[nxt])
                nxt += 1
                table[b, p] = page
                key_cache[page] = key[b, p * page_size:(p + 1) * page_size]
                value_cache[page] = value[b, p * page_size:(p + 1) * page_size]
            else:
                table[b, p] = garbage[(b + p) % len(garbage)]
    cast = functools.partial(jnp.asarray, dtype=dtype)
    return (cast(key_cache), cast(value_cache), jnp.asarray(table),
            jnp.asarray(np.asarray(seqlens, np.int32)), cast(key), cast(value))


def _queries(shape, dtype, seed=7):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32),
                       dtype)


def _packed_queries(q_lens, extra_rows, H, D, dtype, seed=7):
    """Packed queries ``[sum(q_lens) + extra_rows, H, D]`` (the extra rows NaN) and
    ``cu_seqlens_q``."""
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = np.random.default_rng(seed).standard_normal((cu[-1] + extra_rows, H, D)).astype(
        np.float32)
    q[cu[-1]:] = np.nan
    return jnp.asarray(q, dtype), jnp.asarray(cu)


def _oracle(*args, **kw):
    """paged_reference on the inputs upcast (exactly) to float64, on the CPU."""
    cpu = jax.devices("cpu")[0]
    upcast = lambda x: np.asarray(  # noqa: E731
        x, np.float64 if jnp.issubdtype(x.dtype, jnp.floating) else None)
    with jax.enable_x64(True):
        args = [jax.device_put(upcast(x), cpu) for x in args]
        kw = {k: (jax.device_put(np.asarray(v), cpu) if hasattr(v, "shape") else v)
              for k, v in kw.items()}
        return tuple(np.asarray(r) for r in jax.jit(
            jax_varlen.paged_reference, static_argnames=_STATIC)(*args, return_lse=True, **kw))


def _same_precision(*args, **kw):
    """paged_reference on the very inputs, on the CPU (the baseline of assert_out_close)."""
    cpu = jax.devices("cpu")[0]
    args = [jax.device_put(np.asarray(x), cpu) for x in args]
    kw = {k: (jax.device_put(np.asarray(v), cpu) if hasattr(v, "shape") else v)
          for k, v in kw.items()}
    return np.asarray(jax.jit(jax_varlen.paged_reference, static_argnames=_STATIC)(*args, **kw))


def _unpaged_packed(q, cu, key, value, seqlens, max_q, **kw):
    """``attention`` on the unpaged keys for packed queries: the rows scattered into a padded
    ``[B, max_q, H, D]`` in NumPy, ``nonpad_q_seqlen`` the counts, gathered back in NumPy."""
    cu = np.asarray(cu)
    B, Tq = len(cu) - 1, q.shape[0]
    q_np = np.asarray(q, np.float32)
    q_pad = np.full((B, max_q) + q_np.shape[1:], np.nan, np.float32)
    for b in range(B):
        q_pad[b, :cu[b + 1] - cu[b]] = q_np[cu[b]:cu[b + 1]]
    out, lse = jax_varlen.attention(jnp.asarray(q_pad, q.dtype), key, value, seqlens,
                                    nonpad_q_seqlen=jnp.asarray(np.diff(cu).astype(np.int32)),
                                    return_lse=True, **kw)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    packed_out = np.zeros((Tq,) + out.shape[2:], np.float32)
    packed_lse = np.full((lse.shape[1], Tq), -np.inf, np.float32)
    for b in range(B):
        packed_out[cu[b]:cu[b + 1]] = out[b, :cu[b + 1] - cu[b]]
        packed_lse[:, cu[b]:cu[b + 1]] = lse[b, :, :cu[b + 1] - cu[b]]
    return packed_out, packed_lse


def _close_to_unpaged(out, lse, want_out, want_lse, dtype):
    """The same op on the same keys, unpaged: equal up to the dtype's rounding."""
    out, want_out = np.asarray(out, np.float32), np.asarray(want_out, np.float32)
    scale = max(float(np.abs(want_out).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(out, want_out, atol=RTOL[jnp.dtype(dtype)] * scale, rtol=0)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse),
                               np.where(np.isinf(want_lse), 0, want_lse), atol=1e-4, rtol=0)


# id -> (form, dtype, page_size, max_pages, H, Hkv, D, Dv, seqlens_k, queries, kw). ``queries``
# is Sq (padded) or the per-sequence query counts (packed: cu_seqlens_q, plus 3 NaN rows).
_CPU = {
    "decode-p16-gqa": ("padded", "f32", 16, 4, 4, 2, 16, 16, [37, 1, 0, 64], 1, {}),
    "decode-p1-mqa-causal": ("padded", "f32", 1, 40, 4, 1, 8, 8, [40, 7, 0], 1,
                             dict(is_causal=True)),
    "speculative-p16-causal": ("padded", "f32", 16, 5, 4, 2, 16, 16, [70, 4, 2, 33], 4,
                               dict(is_causal=True)),
    "chunks-p5-softcap": ("padded", "f32", 5, 7, 4, 2, 16, 8, [35, 8, 19], 8,
                          dict(is_causal=True, softcap=3.0)),
    "chunks-p5-noncausal-mha": ("padded", "f32", 5, 6, 2, 2, 8, 8, [30, 11, 6], 6, {}),
    "mixed-p16-causal": ("packed", "f32", 16, 3, 4, 2, 16, 16, [40, 17, 1, 25, 12, 0, 0, 2],
                         [7, 1, 1, 0, 12, 1, 0, 3], dict(is_causal=True)),
    "mixed-p5-softcap": ("packed", "f32", 5, 8, 4, 1, 8, 12, [33, 5, 0, 21], [9, 1, 0, 1],
                         dict(is_causal=True, softcap=2.0, scale=0.3)),
    "mixed-p1-noncausal": ("packed", "f32", 1, 20, 2, 2, 8, 8, [20, 3, 9], [4, 1, 9], {}),
    "decode-p16-bf16": ("padded", "bf16", 16, 4, 8, 2, 32, 32, [64, 17, 0, 5], 1,
                        dict(is_causal=True)),
    "mixed-p16-f16": ("packed", "f16", 16, 4, 4, 2, 32, 32, [50, 16, 3], [5, 1, 3],
                      dict(is_causal=True)),
    # A sliding window and sinks (issue 34), passed through to attention.
    "speculative-p5-window-sinks": ("padded", "f32", 5, 9, 4, 2, 16, 16, [41, 9, 0, 3], 4,
                                    dict(is_causal=True, local_window_size=(6, 0),
                                         sinks=_SINKS4)),
    "mixed-p16-window-pair": ("packed", "f32", 16, 4, 4, 2, 16, 16, [50, 17, 1, 0], [9, 1, 1, 0],
                              dict(local_window_size=(12, 2))),
    "mixed-p16-sinks": ("packed", "bf16", 16, 4, 4, 2, 32, 32, [60, 5, 0], [6, 1, 0],
                        dict(is_causal=True, sinks=_SINKS4)),
    # Read in place (the plan takes them: 16-bit, Sq <= 16 or packed decode rows only, pages of
    # a multiple of 16 rows); the CPU's primitive gathers, the GPU's kernel reads the pages.
    "decode-only-p16-bf16-sinks": ("packed", "bf16", 16, 4, 4, 2, 32, 32, [60, 5, 0, 17],
                                   [1, 1, 0, 1], dict(is_causal=True, sinks=_SINKS4)),
    "speculative-p32-f16-window": ("padded", "f16", 32, 3, 4, 1, 16, 24, [70, 3, 0, 33], 3,
                                   dict(is_causal=True, local_window_size=(9, 0))),
}
_GPU = {
    "decode-p16-bf16-d128": ("padded", "bf16", 16, 40, 8, 2, 128, 128, [640, 129, 0, 1], 1,
                             dict(is_causal=True)),
    "speculative-p16-bf16-d64": ("padded", "bf16", 16, 20, 8, 1, 64, 64, [300, 17, 4], 4,
                                 dict(is_causal=True)),
    "chunks-p5-f16-softcap": ("padded", "f16", 5, 30, 4, 2, 64, 64, [150, 40, 9], 16,
                              dict(is_causal=True, softcap=5.0)),
    "mixed-p16-bf16-d128": ("packed", "bf16", 16, 24, 8, 2, 128, 128, [380, 200, 33, 0, 1],
                            [130, 1, 1, 0, 1], dict(is_causal=True)),
    "decode-p1-f32": ("padded", "f32", 1, 300, 4, 2, 64, 64, [300, 1, 0], 1, {}),
    "mixed-p16-bf16-sinks": ("packed", "bf16", 16, 24, 4, 2, 128, 128, [380, 33, 0, 1],
                             [130, 1, 0, 1], dict(is_causal=True, sinks=_SINKS4)),
    # Read in place by the split-KV kernel: pages of 16 (two per 32-key tile at d <= 128, one
    # per 16-key tile at d256), 64 (decode-paged's), several splits of 1024 keys.
    "decode-p64-bf16-d128-gqa4": ("padded", "bf16", 64, 40, 16, 4, 128, 128,
                                  [2500, 65, 0, 1, 640, 1024, 1025], 1, {}),
    "decode-p16-f16-d256": ("padded", "f16", 16, 80, 4, 2, 256, 256, [1200, 17, 0, 1], 1,
                            dict(is_causal=True)),
    "speculative-p16-bf16-d64-softcap": ("padded", "bf16", 16, 70, 8, 2, 64, 64,
                                         [1100, 16, 3, 0], 5,
                                         dict(is_causal=True, softcap=4.0)),
    "decode-only-p32-bf16-sinks": ("packed", "bf16", 32, 40, 4, 2, 128, 96,
                                   [1200, 33, 0, 1, 31], [1, 1, 0, 1, 1],
                                   dict(is_causal=True, sinks=_SINKS4)),
}

# Which cases the plan reads in place (the rest gather the pages first).
_IN_PLACE = {"decode-p16-bf16", "decode-only-p16-bf16-sinks", "speculative-p32-f16-window",
             "decode-p16-bf16-d128", "speculative-p16-bf16-d64", "decode-p64-bf16-d128-gqa4",
             "decode-p16-f16-d256", "speculative-p16-bf16-d64-softcap",
             "decode-only-p32-bf16-sinks"}


def _case_inputs(case, hint=True):
    """A case's paged cache and queries: ``(query, key_cache, value_cache, block_table,
    seqlens_k, extra)``, extra = the packed form's ``cu_seqlens_q`` (and ``max_seqlen_q`` with
    ``hint``)."""
    form, dtype, ps, max_pages, H, Hkv, D, Dv, seqlens, queries, kw = case
    dtype = DTYPES[dtype]
    kc, vc, table, n, _, _ = _paged(seqlens, ps, max_pages, Hkv, D, Dv, dtype)
    if form == "padded":
        return _queries((len(seqlens), queries, H, D), dtype), kc, vc, table, n, {}
    q, cu = _packed_queries(queries, 3, H, D, dtype)
    extra = dict(cu_seqlens_q=cu, max_seqlen_q=max(queries)) if hint else dict(cu_seqlens_q=cu)
    return q, kc, vc, table, n, extra


def _run_case(case):
    form, dtype, ps, max_pages, H, Hkv, D, Dv, seqlens, queries, kw = case
    dtype = DTYPES[dtype]
    kc, vc, table, n, key, value = _paged(seqlens, ps, max_pages, Hkv, D, Dv, dtype)
    if form == "padded":
        q = _queries((len(seqlens), queries, H, D), dtype)
        args, extra = (q, kc, vc, table, n), {}
        want = jax_varlen.attention(q, key, value, n, return_lse=True, **kw)
    else:
        q, cu = _packed_queries(queries, 3, H, D, dtype)
        args, extra = (q, kc, vc, table, n), dict(cu_seqlens_q=cu, max_seqlen_q=max(queries))
        want = _unpaged_packed(q, cu, key, value, n, max(queries), **kw)
    out, lse = jax_varlen.paged_attention(*args, return_lse=True, **extra, **kw)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    hi_out, hi_lse = _oracle(*args, **extra, **kw)
    base = None
    if dtype != jnp.float32 or all(d.platform == "cpu" for d in q.devices()):
        base = _same_precision(*args, **extra, **kw)
    assert_out_close(out, hi_out, base, dtype)
    assert_lse_close(lse, hi_lse)
    _close_to_unpaged(out, lse, *want, dtype)
    return out, lse, args, extra


@backend_cases("case", {"cpu": _CPU, "gpu": _GPU})
def test_forward_matches_oracle_and_unpaged_attention(backend, case):
    out, lse, (q, *_), extra = _run_case(case)
    if "cu_seqlens_q" in extra:  # rows of no sequence: zero, lse -inf
        end = int(extra["cu_seqlens_q"][-1])
        assert out.shape[0] == q.shape[0] and lse.shape == (q.shape[1], q.shape[0])
        assert not np.asarray(out[end:], np.float32).any()
        assert (np.asarray(lse[:, end:]) == -np.inf).all()
    else:
        assert out.shape == q.shape[:3] + (case[7],) and lse.shape == (q.shape[0], q.shape[2],
                                                                       q.shape[1])


@backend_cases("name", {"cpu": {n: n for n in _CPU}, "gpu": {n: n for n in _GPU}})
def test_pages_are_read_in_place_when_the_plan_takes_the_call(backend, name):
    """The plan's decision is the path the call takes: in-place calls bind the paged primitive
    (on the GPU its kernel reads the pages: the split-KV path ran with paged keys), the others
    gather the pages and bind no paged primitive."""
    case = {**_CPU, **_GPU}[name]
    q, kc, vc, table, n, extra = _case_inputs(case)
    f = functools.partial(jax_varlen.paged_attention, **extra, **case[-1])
    jaxpr = str(jax.make_jaxpr(f)(q, kc, vc, table, n))
    assert ("jax_varlen_paged_attention_fwd" in jaxpr) == (name in _IN_PLACE)
    if backend == "gpu" and name in _IN_PLACE:
        jax.block_until_ready(jax.jit(f)(q, kc, vc, table, n))
        ran = _ffi.extension().last_launch()
        assert ran["paged"] and ran["fwd_path"] == "sm80_split" and ran["split_keys"] > 0


@backend_cases("case", {"cpu": {"decode": _CPU["decode-p16-gqa"],
                                "mixed": _CPU["mixed-p5-softcap"]},
                        "gpu": {"mixed": _GPU["mixed-p16-bf16-d128"]}})
def test_merged_heads(backend, case):
    """Rank-3 caches [num_pages, page_size, Hkv*D] with num_heads/kv_num_heads: the rank-4
    result, merged."""
    form, dtype, ps, max_pages, H, Hkv, D, Dv, seqlens, queries, kw = case
    dtype = DTYPES[dtype]
    q, kc, vc, table, n, extra = _case_inputs(case, hint=False)
    split = jax_varlen.paged_attention(q, kc, vc, table, n, **extra, **kw)
    merge = lambda x: x.reshape(x.shape[:-2] + (-1,))  # noqa: E731
    merged = jax_varlen.paged_attention(merge(q), merge(kc), merge(vc), table, n, num_heads=H,
                                        kv_num_heads=Hkv, **extra, **kw)
    assert bits(merged) == bits(merge(split))
    ref = jax_varlen.paged_reference(merge(q), merge(kc), merge(vc), table, n, num_heads=H,
                                     kv_num_heads=Hkv, **extra, **kw)
    np.testing.assert_allclose(np.asarray(merged, np.float32), np.asarray(ref, np.float32),
                               atol=RTOL[jnp.dtype(dtype)] * 10, rtol=0)


# Chunks (more than 16 queries) read in place by the Hopper forward (its producer warps gather
# the pages, sm90/fwd_load.h) under JAX_VARLEN_PAGED_SM90=1; without it they gather first.
_HOPPER_CHUNKS = {
    "chunks-p16-bf16-d128": ("padded", "bf16", 16, 40, 8, 2, 128, 128, [640, 129, 0, 1, 300], 64,
                             dict(is_causal=True)),
    "chunks-p64-f16-d64-softcap": ("padded", "f16", 64, 12, 4, 1, 64, 64, [700, 65, 3], 40,
                                   dict(is_causal=True, softcap=5.0)),
    "chunks-p32-bf16-d256-window-sinks": ("padded", "bf16", 32, 10, 4, 2, 256, 256, [300, 31, 0], 33,
                                          dict(is_causal=True, local_window_size=(50, 0),
                                               sinks=_SINKS4)),
    "chunks-p48-bf16-d128-noncausal": ("padded", "bf16", 48, 20, 4, 4, 128, 128, [900, 47, 49], 17,
                                       {}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", _HOPPER_CHUNKS)
def test_hopper_reads_the_pages_of_chunks(monkeypatch, name):
    """With JAX_VARLEN_PAGED_SM90=1 a chunked-prefill call binds the paged primitive and the
    Hopper forward reads the pages in place (the launch says so): against the oracle and the
    unpaged call, NaN in every unused page and row (_paged)."""
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    if jax.default_backend() != "gpu" or not cc.startswith("9"):
        pytest.skip(f"needs a compute capability 9.x GPU, got {cc!r}")
    monkeypatch.setenv("JAX_VARLEN_PAGED_SM90", "1")
    case = _HOPPER_CHUNKS[name]
    q, kc, vc, table, n, extra = _case_inputs(case)
    f = functools.partial(jax_varlen.paged_attention, **case[-1])
    assert "jax_varlen_paged_attention_fwd" in str(jax.make_jaxpr(f)(q, kc, vc, table, n))
    _run_case(case)
    ran = _ffi.extension().last_launch()
    assert ran["paged"] and ran["fwd_path"] == "sm90_one_pass", ran


@backend_cases("case", {"cpu": {"speculative": _CPU["speculative-p16-causal"],
                                "mixed": _CPU["mixed-p16-causal"]},
                        "gpu": {"mixed": _GPU["mixed-p16-bf16-d128"]}})
def test_unused_rows_and_page_order_never_matter(backend, case):
    """Other bits in the unused pages, the tails of last pages and the padded query rows (NaN,
    Inf, 0), and another physical order of the pages: the same result, bit for bit."""
    form, dtype, ps, max_pages, H, Hkv, D, Dv, seqlens, queries, kw = case
    dtype = DTYPES[dtype]
    f = jax.jit(functools.partial(jax_varlen.paged_attention, return_lse=True, **kw))
    results = []
    for pad, order in ((np.nan, 0), (np.inf, 0), (0.0, 0), (np.nan, 5), (-np.inf, 9)):
        kc, vc, table, n, _, _ = _paged(seqlens, ps, max_pages, Hkv, D, Dv, dtype, pad=pad,
                                        order_seed=order)
        if form == "padded":
            q, extra = _queries((len(seqlens), queries, H, D), dtype), {}
        else:
            q, cu = _packed_queries(queries, 3, H, D, dtype)
            q = q.at[int(cu[-1]):].set(pad)
            extra = dict(cu_seqlens_q=cu)
        out, lse = f(q, kc, vc, table, n, **extra)
        assert np.isfinite(np.asarray(out, np.float32)).all()
        results.append((bits(out), bits(lse)))
    assert all(r == results[0] for r in results)


def test_jit_with_traced_indices(backend):
    """Table, lengths and offsets traced under jit (the attributes static): the eager result."""
    form, dtype, ps, max_pages, H, Hkv, D, Dv, seqlens, queries, kw = _CPU["mixed-p16-causal"]
    kc, vc, table, n, _, _ = _paged(seqlens, ps, max_pages, Hkv, D, Dv, jnp.float32)
    q, cu = _packed_queries(queries, 3, H, D, jnp.float32)
    f = jax.jit(jax_varlen.paged_attention, static_argnames=_STATIC)
    eager = jax_varlen.paged_attention(q, kc, vc, table, n, cu_seqlens_q=cu, max_seqlen_q=12,
                                       return_lse=True, **kw)
    traced = f(q, kc, vc, table, n, cu_seqlens_q=cu, max_seqlen_q=12, return_lse=True, **kw)
    assert bits(traced[0]) == bits(eager[0]) and bits(traced[1]) == bits(eager[1])
    qd = _queries((len(seqlens), 1, H, D), jnp.float32)
    assert bits(f(qd, kc, vc, table, n)) == bits(jax_varlen.paged_attention(qd, kc, vc, table, n))


@pytest.mark.parametrize("shared_cache", [False, True], ids=["own-caches", "shared-cache"])
def test_vmap_over_calls(backend, shared_cache):
    """vmap: each element an independent call (not batched beyond B inside the op)."""
    H, Hkv, D, ps, max_pages = 4, 2, 8, 5, 6
    calls = [_paged([30, 7, 0], ps, max_pages, Hkv, D, D, jnp.float32, seed=s) for s in (1, 2)]
    if shared_cache:  # one cache, two tables into it (the sequences in another order)
        roll = np.asarray([1, 2, 0])
        calls[1] = calls[0][:2] + (calls[0][2][roll], calls[0][3][roll])
    kc, vc, table, n = (jnp.stack([c[i] for c in calls]) for i in range(4))
    q = _queries((2, 3, 4, H, D), jnp.float32)
    axes = (0, None, None, 0, 0) if shared_cache else (0, 0, 0, 0, 0)
    args = (q, kc[0] if shared_cache else kc, vc[0] if shared_cache else vc, table, n)

    def f(q, kc, vc, table, n):
        return jax_varlen.paged_attention(q, kc, vc, table, n, is_causal=True, return_lse=True)

    out, lse = jax.jit(jax.vmap(f, in_axes=axes))(*args)
    for e in range(2):
        one = [x[e] if a is not None else x for x, a in zip(args, axes)]
        want_out, want_lse = f(*one)
        np.testing.assert_allclose(out[e], want_out, atol=1e-6, rtol=0)
        np.testing.assert_array_equal(np.isinf(lse[e]), np.isinf(want_lse))

    # Packed queries, vmapped offsets too.
    qp, cu = _packed_queries([2, 1, 0], 2, H, D, jnp.float32)
    cu2 = jnp.stack([cu, jnp.asarray([0, 1, 1, 4], jnp.int32)])
    g = functools.partial(jax_varlen.paged_attention, is_causal=True, max_seqlen_q=3)
    out = jax.vmap(lambda q, t, n, cu: g(q, kc[0], vc[0], t, n, cu_seqlens_q=cu))(
        jnp.stack([qp, qp]), table, n, cu2)
    for e in range(2):
        want = g(qp, kc[0], vc[0], table[e], n[e], cu_seqlens_q=cu2[e])
        np.testing.assert_allclose(out[e], want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("axes", [(0, 0, 0, 0, 0), (0, None, None, 0, 0), (None, 1, 1, 0, None)],
                         ids=["own-caches", "shared-cache", "caches-on-axis-1"])
def test_in_place_vmap_and_export(backend, axes):
    """The paged primitive under vmap (a vmapped cache folds into the pages, the block table
    offset with it; an unbatched one is shared) and through jax.export: each element is the
    call on its own, bit for bit."""
    H, Hkv, D, ps, max_pages = 4, 2, 32, 16, 5
    calls = [_paged([70, 17, 0, 1], ps, max_pages, Hkv, D, D, jnp.bfloat16, seed=s)
             for s in (1, 2)]
    calls[1] = calls[1][:2] + (calls[0][2], calls[0][3])  # one table shape (same page count)
    stacked = [jnp.stack([c[i] for c in calls]) for i in range(4)]
    q = _queries((2, 4, 1, H, D), jnp.bfloat16)
    args = [q, *stacked]
    args = [x if a is not None else x[0] for x, a in zip(args, axes)]
    args = [jnp.moveaxis(x, 0, a) if a not in (None, 0) else x for x, a in zip(args, axes)]

    def f(q, kc, vc, table, n):
        return jax_varlen.paged_attention(q, kc, vc, table, n, is_causal=True, return_lse=True)

    assert "jax_varlen_paged_attention_fwd" in str(jax.make_jaxpr(f)(
        *[x if a is None else jnp.take(x, 0, axis=a) for x, a in zip(args, axes)]))
    out, lse = jax.jit(jax.vmap(f, in_axes=axes))(*args)
    for e in range(2):
        one = [x if a is None else jnp.take(x, e, axis=a) for x, a in zip(args, axes)]
        want_out, want_lse = jax.jit(f)(*one)
        assert bits(out[e]) == bits(want_out) and bits(lse[e]) == bits(want_lse)
    if axes[1] is None:  # export the unbatched call
        pytest.importorskip("flatbuffers")
        from conftest import EXPORT_PLATFORM

        one = [x if a is None else jnp.take(x, 0, axis=a) for x, a in zip(args, axes)]
        exp = jax_varlen.export(f, platforms=[EXPORT_PLATFORM[backend]])(*one)
        got = jax.export.deserialize(exp.serialize()).call(*one)
        want = jax.jit(f)(*one)
        assert bits(got[0]) == bits(want[0]) and bits(got[1]) == bits(want[1])


@pytest.mark.parametrize("vmapped", [False, True], ids=["call", "vmap"])
def test_in_place_clamps_bad_indices(backend, vmapped):
    """On the in-place path nothing clamps in XLA: the kernel clamps each page index and length
    where it reads them (seqlen.h). A used table entry outside [0, num_pages) reads the page
    the clamped entry names -- under vmap, a page of its own element's cache, never a
    neighbour's -- and a length past the extent reads the extent, bit for bit as the clamped
    inputs do. (checkify reports both: test_checkify_reports_bad_table_entries; the gather
    path clamps the same way: gather_pages.)"""
    H, Hkv, D, ps, max_pages = 4, 2, 32, 16, 5
    calls = [_paged([70, 17, 0, 1], ps, max_pages, Hkv, D, D, jnp.bfloat16, seed=s, pad=0.5)
             for s in (1, 2)]
    num_pages = calls[0][0].shape[0]
    assert calls[1][0].shape[0] == num_pages
    q = _queries((2, 4, 1, H, D), jnp.bfloat16)

    def f(q, kc, vc, table, n):
        return jax_varlen.paged_attention(q, kc, vc, table, n, return_lse=True)

    assert "jax_varlen_paged_attention_fwd" in str(jax.make_jaxpr(f)(q[0], *calls[0][:4]))
    bad = [(c[2].at[0, 1].set(num_pages + 3).at[1, 0].set(-5), c[3].at[3].set(10**6))
           for c in calls]
    clamped = [(c[2].at[0, 1].set(num_pages - 1).at[1, 0].set(0), c[3].at[3].set(max_pages * ps))
               for c in calls]
    if vmapped:  # each element its own caches, table and lengths
        kc, vc = (jnp.stack([c[i] for c in calls]) for i in (0, 1))
        table, n = (jnp.stack([x[i] for x in bad]) for i in (0, 1))
        out, lse = jax.jit(jax.vmap(f))(q, kc, vc, table, n)
        got = [(out[e], lse[e]) for e in range(2)]
    else:
        got = [jax.jit(f)(q[e], *calls[e][:2], *bad[e]) for e in range(2)]
    for e in range(2):
        want = jax.jit(f)(q[e], *calls[e][:2], *clamped[e])
        assert bits(got[e][0]) == bits(want[0]) and bits(got[e][1]) == bits(want[1])


def test_checkify_reports_bad_table_entries(backend):
    """A used table entry outside [0, num_pages) is clamped (no out-of-bounds read) and
    reported under checkify; garbage past a sequence's pages is neither read nor reported."""
    kc, vc, table, n, _, _ = _paged([30, 7, 0], 5, 6, 2, 8, 8, jnp.float32)
    num_pages = kc.shape[0]
    q = _queries((3, 2, 4, 8), jnp.float32)

    def f(table, n):
        return jax_varlen.paged_attention(q, kc, vc, table, n, is_causal=True)

    checked = jax.jit(checkify.checkify(f))
    err, good = checked(table, n)
    assert err.get() is None  # the table holds garbage past each sequence's pages
    bad = table.at[1, 1].set(num_pages + 3)
    err, out = checked(bad, n)
    assert f"block_table[1, 1] = {num_pages + 3} is out of range" in err.get()
    assert f"[0, num_pages={num_pages})" in err.get()
    np.testing.assert_array_equal(out, f(table.at[1, 1].set(num_pages - 1), n))  # clamped
    err, _ = checked(table.at[0, 0].set(-2), n)
    assert "block_table[0, 0] = -2" in err.get()
    err, _ = checked(table, n.at[0].set(31))
    assert "seqlens_k must lie in [0, max_pages * page_size=30]" in err.get()
    # Packed: malformed traced offsets are reported under their name.
    qp, cu = _packed_queries([2, 1, 0], 2, 4, 8, jnp.float32)
    err, _ = jax.jit(checkify.checkify(lambda cu: jax_varlen.paged_attention(
        qp, kc, vc, table, n, cu_seqlens_q=cu)))(cu.at[2].set(1))
    assert "cu_seqlens_q[2] = 1 is below the entry before it" in err.get()


def test_export_round_trip(backend):
    pytest.importorskip("flatbuffers")
    from conftest import EXPORT_PLATFORM

    kc, vc, table, n, _, _ = _paged([30, 7, 0], 5, 6, 2, 8, 8, jnp.float32)
    qp, cu = _packed_queries([4, 1, 0], 2, 4, 8, jnp.float32)
    qd = _queries((3, 1, 4, 8), jnp.float32)
    for q, extra in ((qd, {}), (qp, dict(cu_seqlens_q=cu))):
        def f(q, kc, vc, table, n, *cu):
            kw = dict(cu_seqlens_q=cu[0], max_seqlen_q=4) if cu else {}
            return jax_varlen.paged_attention(q, kc, vc, table, n, is_causal=True,
                                              return_lse=True, **kw)

        args = (q, kc, vc, table, n) + tuple(extra.values())
        exp = jax_varlen.export(f, platforms=[EXPORT_PLATFORM[backend]])(*args)
        again = jax.export.deserialize(exp.serialize())
        got, want = again.call(*args), jax.jit(f)(*args)
        assert bits(got[0]) == bits(want[0]) and bits(got[1]) == bits(want[1])


def test_gradients_raise(backend):
    kc, vc, table, n, _, _ = _paged([30, 7, 0], 5, 6, 2, 8, 8, jnp.float32, pad=0.0)
    q = _queries((3, 2, 4, 8), jnp.float32)

    def loss(q, kc):
        return jnp.sum(jax_varlen.paged_attention(q, kc, vc, table, n, is_causal=True))

    for fn in (jax.grad(loss), jax.grad(loss, argnums=1), jax.jit(jax.grad(loss))):
        with pytest.raises(NotImplementedError, match="paged_attention is forward-only"):
            fn(q, kc)
    with pytest.raises(NotImplementedError, match="forward-only"):
        jax.jvp(lambda q: loss(q, kc), (q,), (q,))
    # With its inputs' gradients stopped it is a constant of the loss, as any array.
    stopped = jax.grad(lambda q: loss(jax.lax.stop_gradient(q), kc) + jnp.sum(q))(q)
    np.testing.assert_array_equal(stopped, np.ones_like(q))


def test_lengths_and_tables_as_lists_and_int64(backend):
    kc, vc, table, n, _, _ = _paged([30, 7, 0], 5, 6, 2, 8, 8, jnp.float32)
    q = _queries((3, 1, 4, 8), jnp.float32)
    want = jax_varlen.paged_attention(q, kc, vc, table, n)
    for t, lens in ((np.asarray(table).tolist(), [30, 7, 0]),
                    (np.asarray(table, np.int64), np.asarray([30, 7, 0], np.int64))):
        assert bits(jax_varlen.paged_attention(q, kc, vc, t, lens)) == bits(want)


def test_empty_packed_steps(backend):
    """No query rows, or only sequences without a new token: zeros and lse -inf."""
    kc, vc, table, n, _, _ = _paged([30, 7, 0], 5, 6, 2, 8, 8, jnp.float32)
    for rows, cu in ((4, [0, 0, 0, 0]), (0, [0, 0, 0, 0])):
        q = jnp.full((rows, 4, 8), jnp.nan)
        out, lse = jax_varlen.paged_attention(q, kc, vc, table, n, return_lse=True,
                                              cu_seqlens_q=jnp.asarray(cu, jnp.int32))
        assert out.shape == (rows, 4, 8) and not np.asarray(out).any()
        assert lse.shape == (4, rows) and (np.asarray(lse) == -np.inf).all()


# --------------------------------------------------------------------------------------------
# Argument checks: each names the argument, the expected and the given.


_NP = 11  # _args' num_pages: 6 + 2 + 0 used pages, 3 spare


def _args():
    kc, vc, table, n, _, _ = _paged([30, 7, 0], 5, 6, 2, 8, 8, jnp.float32)
    return dict(query=_queries((3, 1, 4, 8), jnp.float32), key_cache=kc, value_cache=vc,
                block_table=table, seqlens_k=n)


_BAD = {
    "query-rank": (dict(query=jnp.zeros((3, 4, 8))), ValueError,
                   r"query must have rank 4 \[B, Sq, H, D\] without cu_seqlens_q"),
    "packed-query-rank": (dict(query=jnp.zeros((3, 1, 4, 8)),
                               cu_seqlens_q=jnp.asarray([0, 1, 2, 3])), ValueError,
                          r"query must have rank 3 \[Tq, H, D\] with cu_seqlens_q"),
    "cache-rank": (dict(key_cache=jnp.zeros((5, 8))), ValueError, r"key_cache must have rank 4"),
    "page-size-mismatch": (dict(value_cache=jnp.zeros((_NP, 4, 2, 8))), ValueError,
                           r"value_cache's page_size \(dimension 1\) must equal key_cache's \(5\)"),
    "num-pages-mismatch": (dict(value_cache=jnp.zeros((12, 5, 2, 8))), ValueError,
                           r"value_cache's page count num_pages \(dimension 0\) must equal"),
    "hkv-divides-h": (dict(key_cache=jnp.zeros((_NP, 5, 3, 8)),
                           value_cache=jnp.zeros((_NP, 5, 3, 8))), ValueError,
                      r"key_cache's head count Hkv = 3 must divide query's H = 4"),
    "head-dim": (dict(key_cache=jnp.zeros((_NP, 5, 2, 16))), ValueError,
                 r"key_cache's head size must equal query's \(8\)"),
    "cache-dtype": (dict(value_cache=jnp.zeros((_NP, 5, 2, 8), jnp.bfloat16)), TypeError,
                    r"value_cache must have query's dtype \(float32\), got bfloat16"),
    "table-dtype": (dict(block_table=jnp.zeros((3, 6), jnp.float32)), TypeError,
                    r"block_table must be int32 or int64, got float32"),
    "table-batch": (dict(block_table=jnp.zeros((2, 6), jnp.int32)), ValueError,
                    r"block_table must have shape \[B, max_pages\] with B = 3 \(query's batch\)"),
    "table-packed-batch": (dict(query=jnp.zeros((5, 4, 8)), cu_seqlens_q=jnp.asarray([0, 5])),
                           ValueError, r"with B = 1 \(len\(cu_seqlens_q\) - 1\)"),
    "seqlens-shape": (dict(seqlens_k=jnp.zeros((2,), jnp.int32)), ValueError,
                      r"seqlens_k must have shape \[B\] = \(3,\)"),
    "seqlens-too-long": (dict(seqlens_k=[30, 31, 0]), ValueError,
                         r"seqlens_k\[1\] = 31 is out of range: expected 0 <= n <= "
                         r"max_pages \* page_size = 30"),
    "seqlens-negative": (dict(seqlens_k=[30, 7, -1]), ValueError, r"seqlens_k\[2\] = -1"),
    "used-entry-out-of-range": (dict(seqlens_k=[30, 7, 1]), ValueError,
                                r"block_table\[2, 0\] = .* is out of range: the pages of "
                                r"sequence 2's 1 keys \(seqlens_k\[2\]\) must lie in "
                                rf"\[0, num_pages = {_NP}\)"),
    "num-heads": (dict(num_heads=3), ValueError, r"num_heads=3 does not match query's head axis"),
    "max-seqlen-q": (dict(query=jnp.zeros((5, 4, 8)), cu_seqlens_q=jnp.asarray([0, 4, 5, 5]),
                          max_seqlen_q=2), ValueError,
                     r"max_seqlen_q = 2 is smaller than sequence 0's length"),
    "max-seqlen-q-padded": (dict(max_seqlen_q=1), ValueError,
                            r"max_seqlen_q bounds packed query counts: pass it with "
                            r"cu_seqlens_q"),
    "flag-not-bool": (dict(return_lse=1), TypeError, r"return_lse must be a bool"),
}


@pytest.mark.parametrize("change, error, match", list(_BAD.values()), ids=list(_BAD))
def test_bad_arguments_raise(change, error, match):
    args = _args() | change
    with pytest.raises(error, match=match):
        jax_varlen.paged_attention(**args)


# --------------------------------------------------------------------------------------------
# The oracle.


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("form", ["padded", "packed"])
def test_paged_reference_matches_a_loop_from_the_layout(form, causal):
    """The oracle, against a loop that reads key j of sequence b at row j % page_size of page
    block_table[b, j // page_size] and applies the tail-aligned rule (conftest's allowed_keys;
    m queries, the last m of the n keys: query i sees key j iff j < n and, causal,
    j <= i + n - m)."""
    H, Hkv, D, ps = 2, 1, 4, 3
    seqlens = [8, 2, 0, 5]
    kc, vc, table, n, _, _ = _paged(seqlens, ps, 3, Hkv, D, D, jnp.float32, seed=4)
    if form == "padded":
        q = _queries((4, 2, H, D), jnp.float32)
        extra, q_rows = {}, [(b, i, b * 2 + i, 2) for b in range(4) for i in range(2)]
    else:
        q, cu = _packed_queries([3, 1, 1, 2], 1, H, D, jnp.float32)
        extra = dict(cu_seqlens_q=cu)
        cu = np.asarray(cu)
        q_rows = [(b, r - cu[b], r, cu[b + 1] - cu[b]) for b in range(4)
                  for r in range(cu[b], cu[b + 1])]
    out, lse = jax_varlen.paged_reference(q, kc, vc, table, n, is_causal=causal,
                                          return_lse=True, **extra)
    q_np, kc_np, vc_np, table_np = (np.asarray(x, np.float64) for x in (q, kc, vc, table))
    out, lse = np.asarray(out), np.asarray(lse)
    if form == "padded":  # to packed rows: out [B*Sq, H, D], lse [H, B*Sq]
        q_np = q_np.reshape(-1, H, D)
        out, lse = out.reshape(-1, H, D), lse.transpose(1, 0, 2).reshape(H, -1)
    counts_q = {b: m for b, _, _, m in q_rows}  # each sequence's m
    allowed = allowed_keys(max(counts_q.values()), max(seqlens), seqlens, causal,
                           n_q=[counts_q[b] for b in range(len(seqlens))])
    for b, i, r, m in q_rows:
        for h in range(H):
            g = h // (H // Hkv)
            keys = np.flatnonzero(allowed[b, i])
            if keys.size == 0:
                assert (out[r, h] == 0).all() and lse[h, r] == -np.inf
                continue
            k = np.stack([kc_np[int(table_np[b, j // ps]), j % ps, g] for j in keys])
            v = np.stack([vc_np[int(table_np[b, j // ps]), j % ps, g] for j in keys])
            s = k @ q_np[r, h] / np.sqrt(D)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[r, h], p @ v / p.sum(), atol=1e-5, rtol=0)
            np.testing.assert_allclose(lse[h, r], s.max() + np.log(p.sum()), atol=1e-5)
    if form == "packed":
        assert (out[cu[-1]:] == 0).all() and (lse[:, cu[-1]:] == -np.inf).all()


def test_documented_signature_is_the_real_one():
    """docs/paged.md's signature block lists every argument of paged_attention with its
    default, and paged_reference takes the same arguments with the same defaults."""
    import inspect
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "paged.md").read_text()
    sig = next(b for b in re.findall(r"^```text\n(.*?)^```", text, flags=re.DOTALL | re.M)
               if "jax_varlen.paged_attention(" in b)
    op = inspect.signature(jax_varlen.paged_attention).parameters
    assert list(op) == list(inspect.signature(jax_varlen.paged_reference).parameters)
    for name, p in op.items():
        expected = name if p.default is inspect.Parameter.empty else f"{name}={p.default!r}"
        assert expected in sig, f"docs/paged.md: {expected} missing from the signature"
        assert inspect.signature(jax_varlen.paged_reference).parameters[name].default == p.default
