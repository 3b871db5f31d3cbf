"""The packed front door, ``jax_varlen.packed_attention``, on every backend: bitwise equal to
``attention`` on the same data padded (forward and gradients), against the float64
``packed_reference``, empty sequences, rows past the last offset, ``len_q != len_k`` under
causal, NaN in the unused tail, determinism, batch invariance, the transformations (jit, grad,
vmap, export), validation errors and checkify.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_varlen
from jax_varlen import _export
from conftest import (DTYPES, EXPORT_PLATFORM, assert_lse_close, assert_out_close, bits, make_packed,
                      needs_flatbuffers, packed_cotangents, packed_grads, padded_alone)
from jax_varlen._autodiff import PACKED_FORWARD_MODE_MESSAGE, SECOND_ORDER_MESSAGE

GRAD_RTOL = {jnp.dtype(jnp.float32): 5e-5, jnp.dtype(jnp.float16): 4e-3,
             jnp.dtype(jnp.bfloat16): 3e-2}

# Length patterns (len_q, len_k per sequence): empty sequences, len_q != len_k both ways, one
# past a 64-row block, odd lengths.
PATTERNS = {
    "ragged": ([5, 0, 17, 1, 70], [9, 3, 17, 0, 66]),
    "q>k": ([12, 33], [4, 20]),
    "decode": ([1, 1, 1], [37, 0, 130]),
    "single": ([40], [40]),
}


# --------------------------------------------------------------------------------------------
# Bitwise against the padded front door: one math path.


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_equals_padded_per_sequence_bitwise(backend, pattern, causal, dtype):
    """Each sequence, called alone through ``attention`` (B = 1, Sq = len_q, Skv = len_k), gives
    the very bits of its rows in the packed call: out, lse and the gradients (the cotangents'
    rows of that sequence)."""
    dtype = DTYPES[dtype]
    lens_q, lens_k = PATTERNS[pattern]
    kw = dict(is_causal=causal, softcap=0.0 if causal else 3.0)
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, dtype=dtype)
    ct_out, ct_lse = packed_cotangents(q, v)
    out, lse = jax_varlen.packed_attention(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    d_q, d_k, d_v = packed_grads(q, k, v, cu_q, cu_k, ct_out, ct_lse, **kw)
    cq, ck = np.asarray(cu_q), np.asarray(cu_k)
    for b in range(len(lens_q)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if lens_q[b] == 0:
            continue
        p_out, p_lse, p_dq, p_dk, p_dv = padded_alone(q, k, v, cu_q, cu_k, ct_out, ct_lse, b,
                                                      q.shape[0], **kw)
        assert bits(out[rq]) == bits(p_out), f"out of sequence {b}"
        assert bits(lse[:, rq]) == bits(p_lse), f"lse of sequence {b}"
        assert bits(d_q[rq]) == bits(p_dq), f"d_query of sequence {b}"
        assert bits(d_k[rk]) == bits(p_dk), f"d_key of sequence {b}"
        assert bits(d_v[rk]) == bits(p_dv), f"d_value of sequence {b}"


def test_equals_padded_batch_bitwise(backend):
    """Non-causal, the whole ragged batch padded at once (queries to the longest, keys to the
    longest with nonpad_kv_seqlen = len_k): the same bits in every real row."""
    lens_q, lens_k = PATTERNS["ragged"]
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, dtype=jnp.float16)
    out, lse = jax_varlen.packed_attention(q, k, v, cu_q, cu_k, return_lse=True)
    B, Sq, Skv = len(lens_q), max(lens_q), max(lens_k)
    qp = np.zeros((B, Sq) + q.shape[1:], np.float32)
    kp = np.full((B, Skv) + k.shape[1:], np.nan, np.float32)
    vp = np.full((B, Skv) + v.shape[1:], np.nan, np.float32)
    cq, ck = np.asarray(cu_q), np.asarray(cu_k)
    for b in range(B):
        qp[b, :lens_q[b]] = np.asarray(q[cq[b]:cq[b + 1]], np.float32)
        kp[b, :lens_k[b]] = np.asarray(k[ck[b]:ck[b + 1]], np.float32)
        vp[b, :lens_k[b]] = np.asarray(v[ck[b]:ck[b + 1]], np.float32)
    p_out, p_lse = jax_varlen.attention(*(jnp.asarray(x, jnp.float16) for x in (qp, kp, vp)),
                                        jnp.asarray(lens_k, jnp.int32), return_lse=True)
    for b in range(B):
        assert bits(out[cq[b]:cq[b + 1]]) == bits(p_out[b, :lens_q[b]])
        assert bits(lse[:, cq[b]:cq[b + 1]]) == bits(p_lse[b, :, :lens_q[b]])


# --------------------------------------------------------------------------------------------
# Against the independent oracle.


@functools.cache
def _jit_oracle(kw_key):
    """packed_reference (out, lse) under jit, and its pullback: one compilation per shape
    rather than one per eager op (eager float64 ops cost seconds per new shape)."""
    kw = dict(kw_key)

    def forward(q, k, v, cu_q, cu_k):
        return jax_varlen.packed_reference(q, k, v, cu_q, cu_k, return_lse=True, **kw)

    def pullback(q, k, v, cu_q, cu_k, ct_out, ct_lse):
        return jax.vjp(lambda q, k, v: forward(q, k, v, cu_q, cu_k), q, k, v)[1]((ct_out, ct_lse))

    return jax.jit(forward), jax.jit(pullback)


def _oracle(q, k, v, cu_q, cu_k, **kw):
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        args = [jax.device_put(np.asarray(x, np.float64), cpu) for x in (q, k, v)]
        cus = [jax.device_put(np.asarray(c), cpu) for c in (cu_q, cu_k)]
        out, lse = _jit_oracle(tuple(sorted(kw.items())))[0](*args, *cus)
        return np.asarray(out, np.float64), np.asarray(lse, np.float64)


def _oracle_grads(q, k, v, cu_q, cu_k, ct_out, ct_lse, **kw):
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        args = [jax.device_put(np.asarray(x, np.float64), cpu) for x in (q, k, v, ct_out)]
        cus = [jax.device_put(np.asarray(c), cpu) for c in (cu_q, cu_k)]
        ct_lse = jax.device_put(np.asarray(ct_lse), cpu)
        grads = _jit_oracle(tuple(sorted(kw.items())))[1](*args[:3], *cus, args[3], ct_lse)
        return [np.asarray(g, np.float64) for g in grads]


CASES = {
    "f32-gqa-causal": dict(dtype="f32", H=4, Hkv=2, kw=dict(is_causal=True)),
    "f32-mha-softcap": dict(dtype="f32", H=2, Hkv=2, kw=dict(softcap=2.0, scale=0.3)),
    "bf16-mqa-causal": dict(dtype="bf16", H=4, Hkv=1, kw=dict(is_causal=True)),
    "f16-gqa-hints": dict(dtype="f16", H=4, Hkv=2, kw=dict(max_seqlen_q=70, max_seqlen_k=66)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pattern", ["ragged", "q>k", "decode"])
def test_against_reference(backend, case, pattern):
    c = CASES[case]
    dtype = DTYPES[c["dtype"]]
    lens_q, lens_k = PATTERNS[pattern]
    kw = dict(c["kw"])
    if pattern != "ragged":
        kw.pop("max_seqlen_q", None), kw.pop("max_seqlen_k", None)
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, H=c["H"], Hkv=c["Hkv"], dtype=dtype, seed=3)
    out, lse = jax_varlen.packed_attention(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    assert out.shape == q.shape[:2] + v.shape[-1:] and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == jnp.float32
    hi_out, hi_lse = _oracle(q, k, v, cu_q, cu_k, **kw)
    assert_out_close(out, hi_out, None, dtype)
    assert_lse_close(lse, hi_lse)
    ct_out, ct_lse = packed_cotangents(q, v, seed=4)
    got = packed_grads(q, k, v, cu_q, cu_k, ct_out, ct_lse, **kw)
    want = _oracle_grads(q, k, v, cu_q, cu_k, ct_out, ct_lse, **kw)
    for name, g, w in zip(("d_query", "d_key", "d_value"), got, want):
        g = np.asarray(g, np.float64)
        assert np.isfinite(g).all(), f"{name}: non-finite"
        err, scale = float(np.max(np.abs(g - w))), float(np.max(np.abs(w)))
        assert err <= GRAD_RTOL[jnp.dtype(dtype)] * scale, f"{name}: {err:.3g} vs {scale:.3g}"


def test_rank2_heads_merged(backend):
    q, k, v, cu_q, cu_k = make_packed([3, 8], [8, 2], H=4, Hkv=2, D=8, Dv=8)
    merged = [x.reshape(x.shape[0], -1) for x in (q, k, v)]
    out = jax_varlen.packed_attention(*merged, cu_q, cu_k, num_heads=4, kv_num_heads=2)
    assert out.shape == (q.shape[0], 4 * 8)
    ref = jax_varlen.packed_attention(q, k, v, cu_q, cu_k)
    assert bits(out.reshape(ref.shape)) == bits(ref)
    oracle = jax_varlen.packed_reference(*merged, cu_q, cu_k, num_heads=4, kv_num_heads=2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(oracle), atol=1e-5)


def test_offsets_as_lists_and_numpy_arrays(backend):
    q, k, v, cu_q, cu_k = make_packed([3, 8], [8, 2])
    want = jax_varlen.packed_attention(q, k, v, cu_q, cu_k, is_causal=True)
    lists = [int(x) for x in cu_q], [int(x) for x in cu_k]
    for a, b in (lists, map(tuple, lists), map(np.asarray, lists)):
        assert bits(jax_varlen.packed_attention(q, k, v, a, b, is_causal=True)) == bits(want)


# --------------------------------------------------------------------------------------------
# Rows no sequence owns, empty sequences, non-finite tails.


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tail_rows_and_empty_sequences(backend, causal):
    """Rows past cu_seqlens_q[-1] are zero with lse -inf; the tail of query, key and value gets
    zero gradient; empty sequences and (causal) rows before the key frontier are empty rows."""
    lens_q, lens_k = [0, 4, 6, 0, 2], [3, 0, 2, 0, 9]
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, tail_q=70, tail_k=9)
    ct_out, ct_lse = packed_cotangents(q, v)
    out, lse = jax_varlen.packed_attention(q, k, v, cu_q, cu_k, return_lse=True, is_causal=causal)
    d_q, d_k, d_v = (np.asarray(g) for g in
                     packed_grads(q, k, v, cu_q, cu_k, ct_out, ct_lse, is_causal=causal))
    out, lse = np.asarray(out), np.asarray(lse)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    assert (out[tq:] == 0).all() and (lse[:, tq:] == -np.inf).all()
    assert (d_q[tq:] == 0).all() and (d_k[tk:] == 0).all() and (d_v[tk:] == 0).all()
    for x in (out, d_q, d_k, d_v):
        assert np.isfinite(x).all(), "the NaN tail leaked"
    hi_out, hi_lse = _oracle(q, k, v, cu_q, cu_k, is_causal=causal)
    assert_out_close(out, hi_out, None, jnp.float32)
    assert_lse_close(lse, hi_lse)
    # Sequence 1 (4 queries, no key) is all empty; under causal sequence 2 (6 queries, 2 keys)
    # has 4 empty leading rows.
    assert (lse[:, 0:4] == -np.inf).all() and (out[0:4] == 0).all()
    if causal:
        assert (lse[:, 4:8] == -np.inf).all() and np.isfinite(lse[:, 8:10]).all()


def test_nan_tail_never_reaches_a_bit(backend):
    """Any bits in the unused tail (NaN, +-inf, the dtype's max, zero) change no bit of the
    owned rows, forward or backward."""
    results = []
    for tail in (np.nan, np.inf, -np.inf, float(jnp.finfo(jnp.bfloat16).max), 0.0):
        q, k, v, cu_q, cu_k = make_packed([5, 9], [7, 3], dtype=jnp.bfloat16, tail_value=tail)
        ct_out, ct_lse = packed_cotangents(q, v)
        out, lse = jax_varlen.packed_attention(q, k, v, cu_q, cu_k, return_lse=True, is_causal=True)
        grads = packed_grads(q, k, v, cu_q, cu_k, ct_out, ct_lse, is_causal=True)
        results.append([bits(x) for x in (out, lse, *grads)])
    assert all(r == results[0] for r in results)


def test_no_query_rows_or_no_sequences(backend):
    q, k, v, cu_q, cu_k = make_packed([0, 0], [3, 4], tail_q=0, tail_k=2)
    out, lse = jax_varlen.packed_attention(q, k, v, cu_q, cu_k, return_lse=True)
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0)
    # B = 0: every row is the tail.
    q, k, v, _, _ = make_packed([], [], tail_q=6, tail_k=4)
    cu = jnp.zeros((1,), jnp.int32)
    out, lse = jax_varlen.packed_attention(q, k, v, cu, cu, return_lse=True)
    assert (np.asarray(out) == 0).all() and (np.asarray(lse) == -np.inf).all()
    d_q, d_k, d_v = jax.grad(lambda q, k, v: jnp.sum(jax_varlen.packed_attention(q, k, v, cu, cu)),
                             argnums=(0, 1, 2))(q, k, v)
    assert all((np.asarray(g) == 0).all() for g in (d_q, d_k, d_v))


# --------------------------------------------------------------------------------------------
# Determinism and batch invariance.


def test_deterministic(backend):
    q, k, v, cu_q, cu_k = make_packed(*PATTERNS["ragged"], dtype=jnp.bfloat16)
    ct_out, ct_lse = packed_cotangents(q, v)
    runs = []
    for _ in range(2):
        out, lse = jax_varlen.packed_attention(q, k, v, cu_q, cu_k, return_lse=True, is_causal=True)
        grads = packed_grads(q, k, v, cu_q, cu_k, ct_out, ct_lse, is_causal=True)
        runs.append([bits(x) for x in (out, lse, *grads)])
    assert runs[0] == runs[1]


def test_batch_invariant(backend):
    """A sequence gives the same bits whatever its neighbours: alone, or packed after others of
    other lengths, with another token count and another hint."""
    lq, lk = 37, 70
    q1, k1, v1, cq1, ck1 = make_packed([lq], [lk], tail_q=0, tail_k=0, seed=5)
    alone = jax_varlen.packed_attention(q1, k1, v1, cq1, ck1, return_lse=True, is_causal=True)
    qo, ko, vo, _, _ = make_packed([9, 130], [2, 64], tail_q=0, tail_k=0, seed=6)
    q = jnp.concatenate([qo, q1, qo[:4]])
    k = jnp.concatenate([ko, k1, ko[:1]])
    v = jnp.concatenate([vo, v1, vo[:1]])
    cu_q = jnp.asarray([0, 9, 139, 139 + lq], jnp.int32)
    cu_k = jnp.asarray([0, 2, 66, 66 + lk], jnp.int32)
    out, lse = jax_varlen.packed_attention(q, k, v, cu_q, cu_k, return_lse=True, is_causal=True,
                                           max_seqlen_q=130, max_seqlen_k=70)
    assert bits(out[139:139 + lq]) == bits(alone[0])
    assert bits(lse[:, 139:139 + lq]) == bits(alone[1])


# --------------------------------------------------------------------------------------------
# Transformations.


def test_jit_traced_offsets_and_hints(backend):
    q, k, v, cu_q, cu_k = make_packed(*PATTERNS["ragged"])
    eager = jax_varlen.packed_attention(q, k, v, cu_q, cu_k, return_lse=True, is_causal=True)
    f = jax.jit(functools.partial(jax_varlen.packed_attention, return_lse=True, is_causal=True),
                static_argnames=("max_seqlen_q", "max_seqlen_k"))
    for hints in ({}, dict(max_seqlen_q=70, max_seqlen_k=66)):
        got = f(q, k, v, cu_q, cu_k, **hints)
        assert all(bits(a) == bits(b) for a, b in zip(got, eager))
    # int64 offsets give the same result.
    with jax.enable_x64(True):
        got = f(q, k, v, cu_q.astype(jnp.int64), cu_k.astype(jnp.int64))
    assert all(bits(a) == bits(b) for a, b in zip(got, eager))


def _loop(fn, *args):
    outs = [fn(*(a[i] for a in args)) for i in range(args[0].shape[0])]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def test_vmap_is_more_sequences(backend):
    """vmap over packs with their own offsets (and over packs sharing one set of offsets)
    equals a loop of calls, bitwise; the jaxpr still has one call."""
    packs = [make_packed(lq, lk, tail_q=tq, tail_k=0, seed=s) for lq, lk, tq, s in
             (([5, 0, 17], [9, 3, 12], 4, 0), ([1, 20, 5], [24, 0, 0], 0, 1),
              ([10, 10, 6], [4, 4, 16], 0, 2))]
    q, k, v, cu_q, cu_k = (jnp.stack(xs) for xs in zip(*packs))
    fn = functools.partial(jax_varlen.packed_attention, return_lse=True, is_causal=True)
    got = jax.vmap(fn)(q, k, v, cu_q, cu_k)
    want = _loop(fn, q, k, v, cu_q, cu_k)
    assert all(bits(a) == bits(b) for a, b in zip(got, want))
    jaxpr = str(jax.make_jaxpr(jax.vmap(fn))(q, k, v, cu_q, cu_k))
    assert jaxpr.count("jax_varlen_packed_attention_fwd[") == 1
    # Unbatched offsets; queries batched along axis 1.
    got = jax.vmap(fn, in_axes=(1, 0, 0, None, None))(jnp.moveaxis(q, 0, 1), k, v, cu_q[0], cu_k[0])
    want = _loop(lambda q, k, v: fn(q, k, v, cu_q[0], cu_k[0]), q, k, v)
    assert all(bits(a) == bits(b) for a, b in zip(got, want))


def test_vmap_of_grad(backend):
    packs = [make_packed([3, 9], [7, 5], tail_q=t, tail_k=0, seed=s) for t, s in ((2, 0), (2, 1))]
    q, k, v, cu_q, cu_k = (jnp.stack(xs) for xs in zip(*packs))

    def loss(q, k, v, cu_q, cu_k):
        out, lse = jax_varlen.packed_attention(q, k, v, cu_q, cu_k, return_lse=True, is_causal=True)
        return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    got = jax.vmap(grad)(q, k, v, cu_q, cu_k)
    want = _loop(grad, q, k, v, cu_q, cu_k)
    assert all(bits(a) == bits(b) for a, b in zip(got, want))


def test_forward_mode_and_second_order_raise(backend):
    q, k, v, cu_q, cu_k = make_packed([3], [4])
    f = lambda q: jax_varlen.packed_attention(q, k, v, cu_q, cu_k)  # noqa: E731
    with pytest.raises(TypeError, match=re.escape(PACKED_FORWARD_MODE_MESSAGE)):
        jax.jvp(f, (q,), (q,))
    with pytest.raises(NotImplementedError, match=re.escape(SECOND_ORDER_MESSAGE)):
        jax.grad(lambda q: jnp.sum(jax.grad(lambda q: jnp.sum(f(q)))(q)))(q)


@needs_flatbuffers
def test_export_round_trip(backend):
    q, k, v, cu_q, cu_k = make_packed(*PATTERNS["ragged"], dtype=jnp.bfloat16)
    ct_out, _ = packed_cotangents(q, v)

    def fn(q, k, v, cu_q, cu_k):
        f = lambda q, k, v: jax_varlen.packed_attention(  # noqa: E731
            q, k, v, cu_q, cu_k, is_causal=True, return_lse=True, max_seqlen_q=70)
        (out, lse), pullback = jax.vjp(f, q, k, v)
        return out, lse, pullback((ct_out, jnp.zeros_like(lse)))

    exported = jax.export.export(jax.jit(fn), platforms=(EXPORT_PLATFORM[backend],),
                                 disabled_checks=jax_varlen.export_disabled_checks())
    blob = exported(q, k, v, cu_q, cu_k).serialize()
    got = jax.export.deserialize(blob).call(q, k, v, cu_q, cu_k)
    want = jax.jit(fn)(q, k, v, cu_q, cu_k)
    assert all(bits(a) == bits(b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def test_export_with_a_symbolic_number_of_sequences(backend):
    """The offsets' length may be symbolic: one export serves every number of sequences."""
    q, k, v, cu_q, cu_k = make_packed([3, 0, 9], [4, 2, 5])
    b, = jax.export.symbolic_shape("b")
    offsets = jax.ShapeDtypeStruct((b,), jnp.int32)
    fn = jax.jit(functools.partial(jax_varlen.packed_attention, is_causal=True))
    exported = jax.export.export(fn, platforms=(EXPORT_PLATFORM[backend],),
                                 disabled_checks=jax_varlen.export_disabled_checks())(
        q, k, v, offsets, offsets)
    for cq, ck in ((cu_q, cu_k), (cu_q[::3], cu_k[::3])):
        assert bits(exported.call(q, k, v, cq, ck)) == bits(fn(q, k, v, cq, ck))


def test_export_knows_the_packed_targets():
    names = _export.ffi_target_names()
    for target in ("jax_varlen_packed_attention_fwd_cpu", "jax_varlen_packed_attention_bwd_cpu",
                   "jax_varlen_packed_attention_fwd_cuda", "jax_varlen_packed_attention_bwd_cuda"):
        assert target in names


# --------------------------------------------------------------------------------------------
# Validation.


def _call(**overrides):
    q, k, v, cu_q, cu_k = make_packed([3, 4], [2, 6], tail_q=1, tail_k=1)
    args = dict(query=q, key=k, value=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    kwargs = {name: overrides.pop(name) for name in list(overrides) if name not in args}
    args.update(overrides)
    return jax_varlen.packed_attention(*args.values(), **kwargs)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(cu_seqlens_q=np.array([1, 3, 7], np.int32)), ValueError,
     r"cu_seqlens_q\[0\] = 1: expected 0"),
    (dict(cu_seqlens_k=np.array([0, 5, 2], np.int32)), ValueError,
     r"cu_seqlens_k\[2\] = 2 is below cu_seqlens_k\[1\] = 5"),
    (dict(cu_seqlens_q=np.array([0, 3, 9], np.int64)), ValueError,
     r"cu_seqlens_q\[2\] = 9 is past the token count Tq = 8"),
    (dict(cu_seqlens_k=np.array([0, 3, 10], np.int32)), ValueError,
     r"cu_seqlens_k\[2\] = 10 is past the token count Tk = 9"),
    (dict(cu_seqlens_q=np.array([0.0, 3.0, 7.0], np.float32)), TypeError,
     "cu_seqlens_q must be int32 or int64, got float32"),
    (dict(cu_seqlens_q=np.zeros((1, 3), np.int32)), ValueError,
     r"cu_seqlens_q must have shape \[B \+ 1\]"),
    (dict(cu_seqlens_k=np.zeros((0,), np.int32)), ValueError,
     r"cu_seqlens_k must have shape \[B \+ 1\]"),
    (dict(cu_seqlens_k=np.array([0, 8], np.int32)), ValueError,
     "cu_seqlens_k must have the shape of cu_seqlens_q"),
    (dict(max_seqlen_q=3), ValueError,
     r"max_seqlen_q = 3 is smaller than sequence 1's length cu_seqlens_q\[2\] - "
     r"cu_seqlens_q\[1\] = 4"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be None or an int >= 0, got -1"),
    (dict(max_seqlen_k=2.5), ValueError, "max_seqlen_k must be None or an int >= 0, got 2.5"),
    (dict(query=np.zeros((8, 4, 16, 1), np.float32)), ValueError,
     r"query must have rank 2 \[Tq, H\*D\] or 3 \[Tq, H, D\]"),
    (dict(value=np.zeros((8, 2, 8), np.float32)), ValueError,
     r"value's token count must equal key's \(9\)"),
    (dict(key=np.zeros((9, 2, 16), np.float16)), TypeError,
     "key must have query's dtype"),
    (dict(num_heads=3), ValueError, "num_heads=3 does not match query's head axis"),
])
def test_validation_errors(overrides, error, match):
    with pytest.raises(error, match=match):
        _call(**overrides)


def test_rank2_needs_num_heads():
    q, k, v, cu_q, cu_k = make_packed([3], [2])
    with pytest.raises(ValueError, match=r"num_heads is required for rank-2 inputs \[T, H\*D\]"):
        jax_varlen.packed_attention(q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1),
                                    v.reshape(v.shape[0], -1), cu_q, cu_k)


def test_traced_hint_is_an_error():
    q, k, v, cu_q, cu_k = make_packed([3], [2])
    f = jax.jit(lambda m: jax_varlen.packed_attention(q, k, v, cu_q, cu_k, max_seqlen_q=m))
    with pytest.raises(TypeError, match="max_seqlen_q must be a static Python value"):
        f(3)


# --------------------------------------------------------------------------------------------
# checkify: traced bad offsets and too-small hints are reported; elsewhere clamped.


def _checked(cu_q, cu_k, grad=False, **kw):
    # Finite tails: a clamped sequence may reach into them (they are inside the buffers).
    q, k, v, _, _ = make_packed([3, 4], [2, 6], tail_q=1, tail_k=1, tail_value=0.0)

    def f(cu_q, cu_k):
        g = lambda q: jax_varlen.packed_attention(q, k, v, cu_q, cu_k, **kw)  # noqa: E731
        return jax.grad(lambda q: jnp.sum(g(q)))(q) if grad else g(q)

    err, out = checkify.checkify(jax.jit(f), errors=checkify.user_checks)(
        jnp.asarray(cu_q, jnp.int32), jnp.asarray(cu_k, jnp.int32))
    return err.get(), out


@pytest.mark.parametrize("cu_q, cu_k, kw, match", [
    ([1, 3, 7], [0, 2, 8], {}, r"cu_seqlens_q\[0\] = 1: cu_seqlens_q must start at 0"),
    ([0, 3, 7], [0, 6, 2], {}, r"cu_seqlens_k\[2\] = 2 is below the entry before it"),
    ([0, 3, 20], [0, 2, 8], {}, r"cu_seqlens_q\[2\] = 20 is past the token count \(8\)"),
    ([0, 3, 7], [0, 2, 8], dict(max_seqlen_k=4),
     r"sequence 1 has 6 rows, more than max_seqlen_k=4"),
])
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "grad"])
def test_checkify_reports(backend, cu_q, cu_k, kw, match, grad):
    msg, out = _checked(cu_q, cu_k, grad=grad, **kw)
    assert msg is not None and re.search(match, msg), msg
    assert np.isfinite(np.asarray(out)).all(), "clamped, never out of bounds"


def test_checkify_clean_and_clamped_without_it(backend):
    msg, out = _checked([0, 3, 7], [0, 2, 8], max_seqlen_q=4, max_seqlen_k=6)
    assert msg is None
    q, k, v, cu_q, cu_k = make_packed([3, 4], [2, 6], tail_q=1, tail_k=1, tail_value=0.0)
    ref = jax_varlen.packed_attention(q, k, v, cu_q, cu_k, max_seqlen_q=4, max_seqlen_k=6)
    assert bits(out) == bits(ref)
    # Outside checkify, a too-small traced hint clamps: sequence 1 keeps its first 2 query rows
    # and 3 keys; its other rows are zero.
    q, k, v, cu_q, cu_k = make_packed([3, 4], [2, 6], tail_q=1, tail_k=1)
    f = jax.jit(lambda cq, ck: jax_varlen.packed_attention(q, k, v, cq, ck, max_seqlen_q=2,
                                                           max_seqlen_k=3, return_lse=True))
    out, lse = (np.asarray(x) for x in f(cu_q, cu_k))
    assert np.isfinite(out).all() and (out[2] == 0).all() and (out[5:] == 0).all()
    assert (lse[:, 5:] == -np.inf).all()
    hi_out, _ = _oracle(q[3:5], k[2:5], v[2:5], np.array([0, 2]), np.array([0, 3]))
    np.testing.assert_allclose(out[3:5], hi_out, atol=1e-5)
