"""The backward pass (the ``jax_varlen_attention_bwd`` primitive and its FFI handlers), on every
backend: gradients against ``jax.vjp`` of ``jax_varlen.reference`` in float64, padding,
non-finite data, determinism, batch invariance and the transformations around it.

Each test that takes the ``backend`` fixture runs on the CPU and, when one is there, on the
GPU (conftest.py). The oracle always runs on the CPU in float64 on the inputs upcast (exactly)
and the very same cotangents, so tolerances only cover our arithmetic: float32 accumulation,
16-bit inputs' rounded ``out`` in ``delta``, and the gradients' own rounding to their dtype.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_varlen
from conftest import (DTYPES, HEADS, SMALL_KW, SMALL_LENGTHS, SMALL_SHAPE, allowed_keys, assert_trees_close,
                      bits, cos_weights, make_inputs, pairwise, small_inputs)
from jax_varlen import _backward
from jax_varlen._autodiff import FORWARD_MODE_MESSAGE, SECOND_ORDER_MESSAGE
from jax_varlen._config import AttentionConfig

# max|ours - oracle| <= GRAD_RTOL * max|oracle|, per gradient. float32: accumulation error;
# 16-bit: the gradient's rounding (2^-9 bf16, 2^-12 f16 relative) plus delta's rounded out,
# with room for kernels that round P and dS to the input dtype before their products.
GRAD_RTOL = {jnp.dtype(jnp.float32): 5e-5, jnp.dtype(jnp.float16): 4e-3,
             jnp.dtype(jnp.bfloat16): 3e-2}

NAMES = ("d_query", "d_key", "d_value")


# --------------------------------------------------------------------------------------------
# Our vjp and the oracle's.


def _kw_key(kw):
    return tuple(sorted(kw.items()))


@functools.cache
def _our_vjp(kw_key):
    kw = dict(kw_key)

    def pullback(q, k, v, n, ct_out, ct_lse):
        attn = lambda q, k, v: jax_varlen.attention(q, k, v, n, return_lse=True, **kw)  # noqa: E731
        return jax.vjp(attn, q, k, v)[1]((ct_out, ct_lse))

    return jax.jit(pullback)


def our_grads(q, k, v, n, ct_out, ct_lse, **kw):
    """(d_query, d_key, d_value) of our op for the cotangents of (out, lse), jitted once per
    attribute set (and per shape, by jit)."""
    return _our_vjp(_kw_key(kw))(q, k, v, n, ct_out, ct_lse)


@functools.cache
def _oracle_vjp(kw_key):
    kw = dict(kw_key)

    def pullback(q, k, v, n, ct_out, ct_lse):
        ref = lambda q, k, v: jax_varlen.reference(q, k, v, n, return_lse=True, **kw)  # noqa: E731
        return jax.vjp(ref, q, k, v)[1]((ct_out, ct_lse))

    return jax.jit(pullback)


def oracle_grads(q, k, v, n, ct_out, ct_lse, **kw):
    """jax.vjp of the reference in float64 on the CPU, on the inputs and the out cotangent
    upcast exactly (the reference's lse is float32, so is its cotangent); numpy results."""
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        args = [jax.device_put(np.asarray(x, np.float64), cpu) for x in (q, k, v, ct_out)]
        n = jax.device_put(np.asarray(n), cpu)
        ct_lse = jax.device_put(np.asarray(ct_lse, np.float32), cpu)
        grads = _oracle_vjp(_kw_key(kw))(*args[:3], n, args[3], ct_lse)
        return [np.asarray(g, np.float64) for g in grads]


def cotangents(B, Sq, H, Dv, dtype, seed=1, lse_scale=0.5):
    rng = np.random.default_rng(seed)
    ct_out = jnp.asarray(rng.standard_normal((B, Sq, H, Dv), dtype=np.float32), dtype)
    ct_lse = jnp.asarray(lse_scale * rng.standard_normal((B, H, Sq), dtype=np.float32))
    return ct_out, ct_lse


def structural_zeros(Sq, Skv, H, Hkv, lengths, causal):
    """Where the math puts exact zeros: (empty query rows [B, Sq, H], padded keys [B, Skv])."""
    lengths = np.clip(np.asarray(lengths), 0, Skv)
    allowed = allowed_keys(Sq, Skv, lengths, causal)  # [B, Sq, Skv]
    empty_rows = np.broadcast_to(~allowed.any(-1)[:, :, None], (len(lengths), Sq, H))
    padded = np.arange(Skv)[None, :] >= lengths[:, None]
    return empty_rows, padded


def assert_grads_close(got, want, dtype, what=""):
    for name, g, w in zip(NAMES, got, want):
        g = np.asarray(g, np.float64)
        assert g.shape == w.shape, (what, name, g.shape, w.shape)
        bad = np.argwhere(~np.isfinite(g))
        assert bad.size == 0, f"{what}{name}: non-finite at {bad[:5].tolist()}"
        if g.size == 0:
            continue
        scale = float(np.max(np.abs(w)))
        err = float(np.max(np.abs(g - w)))
        rtol = GRAD_RTOL[jnp.dtype(dtype)]
        assert err <= rtol * scale, (
            f"{what}{name}: max error {err:.3g} > {rtol} * max|oracle| {scale:.3g}")


def check_grads(B, Sq, Skv, H, Hkv, D, Dv, dtype, lengths, seed=0, **kw):
    """Our gradients against the oracle's, and exact zeros where the math has them."""
    q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, Dv, dtype, lengths, seed=seed)
    ct_out, ct_lse = cotangents(B, Sq, H, Dv, dtype, seed=seed + 1)
    got = our_grads(q, k, v, n, ct_out, ct_lse, **kw)
    for g, x in zip(got, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    want = oracle_grads(q, k, v, n, ct_out, ct_lse, **kw)
    assert_grads_close(got, want, dtype)
    empty_rows, padded = structural_zeros(Sq, Skv, H, Hkv, lengths, kw.get("is_causal", False))
    d_q, d_k, d_v = (np.asarray(g, np.float32) for g in got)
    assert (d_q[empty_rows] == 0).all(), "rows with no allowed key must get zero d_query"
    assert (d_k[padded] == 0).all() and (d_v[padded] == 0).all(), "padding must get zero"
    return got


# --------------------------------------------------------------------------------------------
# Against the oracle: every dtype x feature x length pattern, pairwise.

# (Sq, Skv): Sq < Skv, Sq > Skv, and both past one 64-row / 64-key block of the CPU handler.
SEQS = {"sq<skv": (7, 37), "sq>skv": (37, 13), "blocks": (70, 130), "long-q": (150, 66)}
DIMS = {"d64": (64, 64), "d128": (128, 128), "d256": (256, 256), "d80": (80, 80),
        "d40-dv24": (40, 24), "d5-dv3": (5, 3)}


def length_pattern(name, Skv):
    """Three sequences' lengths, by pattern: 0, 1, odd, Skv, ragged (all of them)."""
    odd = Skv // 2 | 1
    return {
        "zero": [0, 0, 0],
        "one": [1, 1, 1],
        "odd": [odd, odd - 2 if odd > 2 else 1, 3],
        "full": [Skv, Skv, Skv],
        "ragged": [Skv, 0, odd],
    }[name]


AXES = {
    "dtype": list(DTYPES),
    "causal": [False, True],
    "softcap": [0.0, 2.5],
    "heads": list(HEADS),
    "dims": list(DIMS),
    "lengths": ["zero", "one", "odd", "full", "ragged"],
    "seqs": list(SEQS),
}
CASES = pairwise(AXES, must=("dtype", "causal"))


def _case_id(c):
    return "-".join([c["dtype"], "causal" if c["causal"] else "full",
                     f"cap{c['softcap']:g}", c["heads"], c["dims"], c["lengths"], c["seqs"]])


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_grads_match_oracle(backend, case):
    Sq, Skv = SEQS[case["seqs"]]
    H, Hkv = HEADS[case["heads"]]
    D, Dv = DIMS[case["dims"]]
    lengths = length_pattern(case["lengths"], Skv)
    check_grads(len(lengths), Sq, Skv, H, Hkv, D, Dv, DTYPES[case["dtype"]], lengths,
                is_causal=case["causal"], softcap=case["softcap"])


# delta = <d_out, out> per row (the first backward kernel on the GPU, portable/bwd_preprocess.cuh)
# reads a row in the widest vector that head_dim_v, the strides and the alignment allow, over
# a power-of-two group of lanes: value head sizes that give each width (bf16 16-byte vectors of
# 8, then 4, 2, 1 elements; float32 4, then 2, 1), a group of 4 lanes for 3 vectors, and more
# vectors than a warp has lanes (float32 at 200: 50 vectors, two per lane). Sq * H = 600 rows
# per sequence span several blocks and end inside one.
PREPROCESS_DV = {"dv128": 128, "dv24": 24, "dv12": 12, "dv6": 6, "dv3": 3, "dv200": 200}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("dv", list(PREPROCESS_DV))
def test_delta_at_every_vector_width(backend, dtype, dv):
    check_grads(3, 150, 90, 4, 2, 16, PREPROCESS_DV[dv], DTYPES[dtype], [90, 0, 41], seed=11,
                is_causal=True)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_lse_cotangent_alone(backend, dtype):
    """A cotangent on lse only (out's is zero) still reaches query and key (d_value is 0)."""
    B, Sq, Skv, H, Hkv, D, lengths = 3, 9, 20, 4, 2, 16, [20, 5, 0]
    q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, D, DTYPES[dtype], lengths, seed=3)
    _, ct_lse = cotangents(B, Sq, H, D, DTYPES[dtype], seed=4, lse_scale=1.0)
    ct_out = jnp.zeros((B, Sq, H, D), DTYPES[dtype])
    kw = dict(is_causal=True, softcap=1.5)
    got = our_grads(q, k, v, n, ct_out, ct_lse, **kw)
    assert_grads_close(got, oracle_grads(q, k, v, n, ct_out, ct_lse, **kw), DTYPES[dtype])
    assert np.abs(np.asarray(got[0], np.float32)).max() > 0
    assert (np.asarray(got[2], np.float32) == 0).all()


@pytest.mark.parametrize(
    "B,Sq,Skv,lengths",
    [(2, 0, 16, [16, 3]), (2, 5, 0, [0, 0]), (0, 5, 16, []), (0, 0, 0, []), (2, 0, 0, [0, 0])],
    ids=["sq0", "skv0", "b0", "all0", "sq0-skv0"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_empty_extents(backend, B, Sq, Skv, lengths, causal):
    """Empty extents give gradients of the right shapes and dtypes, all zero."""
    q, k, v, n = make_inputs(B, Sq, Skv, 4, 2, 8, 6, jnp.float32, lengths, seed=10)
    ct_out, ct_lse = cotangents(B, Sq, 4, 6, jnp.float32)
    got = our_grads(q, k, v, n, ct_out, ct_lse, is_causal=causal)
    for x, g in zip((q, k, v), got):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert (np.asarray(g) == 0).all()


def test_out_of_range_traced_lengths_are_clamped(backend):
    """Traced lengths outside [0, Skv] give the gradients of the clamped lengths."""
    q, k, v, _ = make_inputs(3, 6, 10, 2, 1, 8, 8, jnp.float32, [10, 0, 10], seed=11,
                             pad_value=0.0)
    ct_out, ct_lse = cotangents(3, 6, 2, 8, jnp.float32)
    bad = our_grads(q, k, v, jnp.array([12, -3, 10], jnp.int32), ct_out, ct_lse)
    good = our_grads(q, k, v, jnp.array([10, 0, 10], jnp.int32), ct_out, ct_lse)
    assert [bits(g) for g in bad] == [bits(g) for g in good]


def test_checkify_reports_lengths_in_the_backward_too(backend):
    """The backward primitive carries the lengths check: a pullback checkified apart from its
    forward reports out-of-range lengths."""
    q, k, v, n = make_inputs(2, 4, 8, 2, 2, 8, 8, jnp.float32, [8, 3], seed=12)
    config = AttentionConfig(scale=8 ** -0.5)
    out, lse = jax_varlen.attention(q, k, v, n, return_lse=True)
    d_lse = jnp.zeros_like(lse)
    bwd = lambda n: _backward.attention_bwd(q, k, v, n, out, lse, out, d_lse, config)  # noqa: E731
    err, _ = jax.jit(checkify.checkify(bwd))(jnp.array([9, 3], jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match=r"nonpad_kv_seqlen must lie in \[0, Skv=8\]"):
        err.throw()
    err, _ = jax.jit(checkify.checkify(bwd))(n)
    err.throw()  # in range: no error


# --------------------------------------------------------------------------------------------
# Padding and non-finite data.


@pytest.mark.parametrize(
    "dtype, heads, kw",
    [("f32", "gqa", dict(is_causal=True)), ("bf16", "mqa", dict(softcap=2.0)),
     ("f16", "mha", dict(is_causal=True, softcap=3.0))],
    ids=["f32-gqa-causal", "bf16-mqa-softcap", "f16-mha-causal-softcap"],
)
def test_padding_bits_never_change_a_gradient_bit(backend, dtype, heads, kw):
    """Padded keys and values may hold anything: NaN, +-inf, the dtype's max and zero padding
    give bitwise-identical gradients, finite, with exactly zero gradient on the padding."""
    H, Hkv = HEADS[heads]
    B, Sq, Skv, D, lengths = 4, 11, 70, 16, [70, 0, 1, 33]
    dt = DTYPES[dtype]
    results = []
    for pad in (np.nan, np.inf, -np.inf, float(jnp.finfo(dt).max), 0.0):
        q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, D, dt, lengths, seed=7, pad_value=pad)
        ct_out, ct_lse = cotangents(B, Sq, H, D, dt, seed=8)
        got = our_grads(q, k, v, n, ct_out, ct_lse, **kw)
        for name, g in zip(NAMES, got):
            assert np.isfinite(np.asarray(g, np.float32)).all(), (pad, name)
        for b, nb in enumerate(lengths):
            assert (np.asarray(got[1], np.float32)[b, nb:] == 0).all()
            assert (np.asarray(got[2], np.float32)[b, nb:] == 0).all()
        results.append([bits(g) for g in got])
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("kind", ["query", "key"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_in_real_data_propagates(backend, kind, causal):
    """A NaN in a real query row (or key) gives NaN where the math puts it: that row's
    d_query and the d_key/d_value of the keys it attends to (the d_query of the rows that
    attend to the key, and that key's d_key/d_value); other sequences and other kv heads'
    gradients are unaffected and equal the oracle's; padding still gets exactly zero."""
    B, Sq, Skv, H, Hkv, D, lengths = 2, 6, 11, 4, 2, 8, [9, 4]
    q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, D, jnp.float32, lengths, seed=11)
    ct_out, ct_lse = cotangents(B, Sq, H, D, jnp.float32, seed=12)
    b, i, h, j = 0, 3, 1, 5  # row 3 allows keys 0..6 under causal (n = 9, Sq = 6)
    G = H // Hkv
    g = h // G
    if kind == "query":
        q = q.at[b, i, h, 2].set(jnp.nan)
    else:
        k = k.at[b, j, g, 2].set(jnp.nan)
    got = [np.asarray(x) for x in our_grads(q, k, v, n, ct_out, ct_lse, is_causal=causal)]
    want = oracle_grads(q, k, v, n, ct_out, ct_lse, is_causal=causal)
    allowed = allowed_keys(Sq, Skv, lengths, causal)
    heads = np.arange(g * G, (g + 1) * G)
    nan_q = np.zeros(q.shape, bool)
    nan_kv = np.zeros((B, Skv, Hkv), bool)  # keys of kv head g only
    if kind == "query":
        nan_q[b, i, h] = True
        nan_kv[b, allowed[b, i], g] = True  # the keys row i attends to
    else:
        rows = allowed[b, :, j]  # the rows that attend to key j: their d_query, and (their
        for hh in heads:          # lse is NaN) every key they attend to
            nan_q[b, rows, hh] = True
        nan_kv[b, allowed[b, rows].any(0), g] = True
    # NaN where the math puts it, in ours and in the oracle.
    for name, x in (("ours", got), ("oracle", want)):
        assert np.isnan(x[0][nan_q]).all(), f"{name}: d_query must be NaN in the rows it reaches"
        assert np.isnan(x[1][nan_kv]).all() and np.isnan(x[2][nan_kv]).all(), name
    # Unaffected: other sequences and other kv heads' rows and keys, equal to the oracle.
    other_heads = np.setdiff1d(np.arange(H), heads)
    for name, a, w in zip(NAMES, got, want):
        np.testing.assert_allclose(a[1], w[1], rtol=0, atol=5e-5 * np.abs(w[1]).max(),
                                   err_msg=f"{name}[1]")
    np.testing.assert_allclose(got[0][b][:, other_heads], want[0][b][:, other_heads], rtol=0,
                               atol=5e-5 * np.abs(want[0][b][:, other_heads]).max())
    other_g = [x for x in range(Hkv) if x != g]
    for a, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(a[b][:, other_g], w[b][:, other_g], rtol=0,
                                   atol=5e-5 * np.abs(w[b][:, other_g]).max())
    # Rows and keys of the group that the element does not reach through an allowed pair:
    # finite where the oracle is (no 0 * NaN reaches them in the math), not asserted where
    # the oracle's dense products made them NaN.
    for name, a, w in zip(NAMES, got, want):
        both = np.isfinite(a) & np.isfinite(w)
        np.testing.assert_allclose(a[both], w[both], rtol=0, atol=5e-5 * np.abs(w[both]).max(),
                                   err_msg=name)
    # Padding: exactly zero.
    for nb, d_k, d_v in zip(lengths, got[1], got[2]):
        assert (d_k[nb:] == 0).all() and (d_v[nb:] == 0).all()


# --------------------------------------------------------------------------------------------
# Determinism and batch invariance.


# d256: on the Hopper path 64-key blocks, whose dQ partials are summed in the writer's fixed
# order (bwd_dq.h): 11 blocks of the longest sequence add into each row block, so a race in
# that order would change d_q's bits.
DETERMINISM = {"d32": (3, 70, 130, 32, [130, 77, 3]), "d256": (3, 200, 700, 256, [700, 377, 3])}


@pytest.mark.parametrize("case", list(DETERMINISM))
def test_gradients_are_deterministic(backend, case):
    B, Sq, Skv, D, lengths = DETERMINISM[case]
    H, Hkv = 4, 2
    q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, D, jnp.bfloat16, lengths, seed=13)
    ct_out, ct_lse = cotangents(B, Sq, H, D, jnp.bfloat16, seed=14)
    first = our_grads(q, k, v, n, ct_out, ct_lse, is_causal=True)
    for _ in range(2):
        again = our_grads(q, k, v, n, ct_out, ct_lse, is_causal=True)
        assert [bits(g) for g in again] == [bits(g) for g in first]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_batch_invariance(backend, dtype):
    """A sequence's gradients do not depend on its batch-mates (their lengths, their data, the
    batch size): bitwise the same alone, in one batch and in another."""
    Sq, Skv, H, Hkv, D = 40, 100, 4, 1, 24
    dt = DTYPES[dtype]
    q, k, v, n = make_inputs(4, Sq, Skv, H, Hkv, D, D, dt, [100, 61, 0, 7], seed=15)
    ct_out, ct_lse = cotangents(4, Sq, H, D, dt, seed=16)
    kw = dict(is_causal=True)
    full = our_grads(q, k, v, n, ct_out, ct_lse, **kw)
    for b in range(4):
        alone = our_grads(q[b:b + 1], k[b:b + 1], v[b:b + 1], n[b:b + 1], ct_out[b:b + 1],
                          ct_lse[b:b + 1], **kw)
        assert [bits(g[b]) for g in full] == [bits(g[0]) for g in alone], b
    # Other batch-mates: sequence 1 next to different sequences, in a batch of 2.
    q2, k2, v2, _ = make_inputs(2, Sq, Skv, H, Hkv, D, D, dt, [3, 100], seed=17)
    mix = lambda a, b_: jnp.concatenate([a[1:2], b_[:1]])  # noqa: E731
    other = our_grads(mix(q, q2), mix(k, k2), mix(v, v2), jnp.array([61, 3], jnp.int32),
                      mix(ct_out, ct_out[::-1]), mix(ct_lse, ct_lse[::-1]), **kw)
    assert [bits(g[1]) for g in full] == [bits(g[0]) for g in other]


# --------------------------------------------------------------------------------------------
# Transformations around the op.

# conftest's small problem: GQA, causal with a sequence shorter than Sq, softcap, NaN padding.
B, SQ, SKV, H, HKV, D = SMALL_SHAPE
LENGTHS = SMALL_LENGTHS
KW = SMALL_KW


def _loss(attn, **kw):
    """A scalar of out and of the finite lse entries, non-uniformly weighted."""
    kw = {**KW, **kw}

    def loss(q, k, v, n):
        out, lse = attn(q, k, v, n, return_lse=True, **kw)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return (jnp.sum(out.astype(jnp.float32) * cos_weights(out.shape))
                + 0.3 * jnp.sum(finite_lse * cos_weights(lse.shape, 1.0)))

    return loss


def test_eager_grad_equals_jit_grad(backend):
    """Outside jit (the primitives' impls) and under jit: the same bits."""
    q, k, v, n = small_inputs(seed=20)
    grad = jax.grad(_loss(jax_varlen.attention), argnums=(0, 1, 2))
    eager, jitted = grad(q, k, v, n), jax.jit(grad)(q, k, v, n)
    assert [bits(g) for g in eager] == [bits(g) for g in jitted]
    assert_trees_close(jitted, jax.jit(jax.grad(_loss(jax_varlen.reference),
                                                argnums=(0, 1, 2)))(q, k, v, n), 5e-5)


def test_vmap_of_grad(backend):
    """vmap(grad) folds the vmapped axis into the batch: bitwise the per-element gradients
    (batch invariance), with the lengths both batched and unbatched."""
    qs, ks, vs = (jnp.stack(xs)
                  for xs in zip(small_inputs(seed=21)[:3], small_inputs(seed=22)[:3]))
    grad = jax.grad(_loss(jax_varlen.attention), argnums=(0, 1, 2))
    ns = jnp.array([LENGTHS, [2, 7]], jnp.int32)
    for in_axes, lengths in (((0, 0, 0, 0), ns), ((0, 0, 0, None), ns[0])):
        batched = jax.jit(jax.vmap(grad, in_axes=in_axes))(qs, ks, vs, lengths)
        for i in range(2):
            n = lengths[i] if in_axes[3] == 0 else lengths
            one = jax.jit(grad)(qs[i], ks[i], vs[i], n)
            assert [bits(g[i]) for g in batched] == [bits(g) for g in one], (in_axes, i)


def test_checkpoint_and_scan(backend):
    """jax.checkpoint around the op, and lax.scan over layers of it: the reference's
    gradients."""
    q, k, v, n = small_inputs(seed=23)

    def run(attn):
        ckpt = jax.checkpoint(_loss(attn))
        d_ckpt = jax.jit(jax.grad(ckpt, argnums=(0, 1, 2)))(q, k, v, n)

        def layers(q, ks, vs):
            def layer(x, kv):
                out = attn(x, kv[0], kv[1], n, **KW)
                return x + out, jnp.sum(out * out)
            x, sums = jax.lax.scan(layer, q, (ks, vs))
            return jnp.sum(x * cos_weights(x.shape)) + jnp.sum(sums)

        ks = jnp.stack([k, 0.5 * k, -k])  # three layers' keys and values (NaN padding)
        vs = jnp.stack([v, -v, 2.0 * v])
        d_scan = jax.jit(jax.grad(layers, argnums=(0, 1, 2)))(q, ks, vs)
        return d_ckpt, d_scan

    (ours_ckpt, ours_scan), (ref_ckpt, ref_scan) = run(jax_varlen.attention), run(
        jax_varlen.reference)
    assert_trees_close(ours_ckpt, ref_ckpt, 5e-5, "checkpoint ")
    assert_trees_close(ours_scan, ref_scan, 5e-5, "scan ")
    for b, nb in enumerate(LENGTHS):  # every layer's padding: exactly zero
        assert (np.asarray(ours_scan[1])[:, b, nb:] == 0).all()
        assert (np.asarray(ours_scan[2])[:, b, nb:] == 0).all()


def test_jacrev_tiny(backend):
    """jax.jacrev (reverse mode, one pullback per output element under vmap) of out in key,
    against the oracle's jacobian in float64."""
    q, k, v, n = make_inputs(2, 3, 5, 2, 1, 4, 3, jnp.float32, [5, 2], seed=24)
    f = lambda attn: lambda k: attn(q, k, v, n, is_causal=True, softcap=1.5)  # noqa: E731
    ours = np.asarray(jax.jit(jax.jacrev(f(jax_varlen.attention)))(k))
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        q, k, v = (jax.device_put(np.asarray(x, np.float64), cpu) for x in (q, k, v))
        n = jax.device_put(np.asarray(n), cpu)
        want = np.asarray(jax.jacrev(f(jax_varlen.reference))(k))
    assert ours.shape == want.shape == (2, 3, 2, 3, 2, 5, 1, 4)
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, want, rtol=0, atol=5e-5 * np.abs(want).max())


def test_second_order_raises(backend):
    q, k, v, n = small_inputs(seed=25)
    inner = lambda q: jnp.sum(jax.grad(_loss(jax_varlen.attention))(q, k, v, n))  # noqa: E731
    with pytest.raises(NotImplementedError, match=re.escape(SECOND_ORDER_MESSAGE)):
        jax.grad(inner)(q)
    # Through the cotangent only: the backward is not differentiable in it either.
    w = jnp.ones((B, SQ, H, D))
    through_ct = lambda w: jnp.sum(jax.grad(  # noqa: E731
        lambda q: jnp.sum(jax_varlen.attention(q, k, v, n) * w))(q))
    with pytest.raises(NotImplementedError, match=re.escape(SECOND_ORDER_MESSAGE)):
        jax.jit(jax.grad(through_ct))(w)


def test_forward_mode_raises(backend):
    q, k, v, n = small_inputs(seed=26)
    with pytest.raises(TypeError, match=re.escape(FORWARD_MODE_MESSAGE)):
        jax.jvp(lambda q: jax_varlen.attention(q, k, v, n), (q,), (q,))
    with pytest.raises(TypeError, match=re.escape(FORWARD_MODE_MESSAGE)):
        jax.jit(jax.jacfwd(lambda k: jnp.sum(jax_varlen.attention(q, k, v, n))))(k)


def test_finite_differences():
    """CPU, float32: directional derivatives of a smooth loss against 4-point central
    differences (error O(h^4) + eps * |loss| / h), on a small case with GQA, causal, softcap,
    an empty row and lse in the loss."""
    with jax.default_device(jax.devices("cpu")[0]):
        q, k, v, n = make_inputs(2, 4, 6, 2, 1, 4, 3, jnp.float32, [6, 3], seed=27,
                                 pad_value=0.0)
        loss = jax.jit(_loss(jax_varlen.attention, softcap=1.5))
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, n)
        rng = np.random.default_rng(28)
        h = 1e-2
        for _ in range(3):
            u = [jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v)]
            u[1] = u[1].at[1, 3:].set(0.0)  # padded keys and values of sequence 1 stay put
            u[2] = u[2].at[1, 3:].set(0.0)
            at = lambda t: float(loss(*(x + t * d for x, d in zip((q, k, v), u)), n))  # noqa: E731
            fd = (-at(2 * h) + 8 * at(h) - 8 * at(-h) + at(-2 * h)) / (12 * h)
            exact = sum(float(jnp.vdot(g, d)) for g, d in zip(grads, u))
            assert abs(fd - exact) <= 2e-3 * max(1.0, abs(exact)), (fd, exact)


# --------------------------------------------------------------------------------------------
# The FFI target called directly: bad shapes are InvalidArgument naming the argument.


@pytest.mark.parametrize(
    "wrong, match",
    [("d_out", r"d_out has shape \[2, 3, 2, 5\]"), ("d_lse", r"d_lse has shape \[2, 3, 2\]"),
     ("lse", r"lse has shape \[2, 3, 2\]"), ("d_query", r"d_query has shape \[2, 3, 2, 3\]")],
)
def test_ffi_target_rejects_bad_shapes(backend, wrong, match):
    from jax_varlen import _ffi

    _ffi.extension()
    target = {"cpu": _ffi.BWD_CPU_TARGET, "gpu": _ffi.BWD_CUDA_TARGET}[backend]
    q, k, v, n = make_inputs(2, 3, 5, 2, 1, 4, 4, jnp.float32, [5, 2], seed=29)
    out = jnp.zeros((2, 3, 2, 4), jnp.float32)
    lse = jnp.zeros((2, 2, 3), jnp.float32)
    args = dict(out=out, lse=lse, d_out=out, d_lse=lse)
    results = dict(d_query=q, d_key=k, d_value=v)
    if wrong == "d_out":
        args["d_out"] = jnp.zeros((2, 3, 2, 5), jnp.float32)
    elif wrong in ("d_lse", "lse"):
        args[wrong] = jnp.zeros((2, 3, 2), jnp.float32)
    else:
        results["d_query"] = jnp.zeros((2, 3, 2, 3), jnp.float32)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in results.values()]
    shapes.append(jax.ShapeDtypeStruct((2, 2, 3), jnp.float32))  # delta
    if backend == "gpu":  # the Hopper kernel's dQ workspace (empty: not taken)
        shapes.append(jax.ShapeDtypeStruct((0,), jnp.float32))
    call = jax.ffi.ffi_call(target, shapes)
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(call(q, k, v, n, args["out"], args["lse"], args["d_out"],
                                   args["d_lse"], scale=np.float32(0.5), is_causal=False,
                                   softcap=np.float32(0.0)))


# --------------------------------------------------------------------------------------------
# Several devices: sharded jit of gradients splits with no collectives (8 CPU devices, in a
# subprocess: the device count is fixed when jax starts).


def test_multi_device_backward_cases():
    here = pathlib.Path(__file__).resolve().parent
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    package_root = str(pathlib.Path(jax_varlen.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "pytest", str(here / "multi_device_backward_cases.py"), "-q",
           "-p", "no:cacheprovider", "-o", "addopts="]
    proc = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"multi-device backward cases failed (rc={proc.returncode}):\n{tail}"
    assert " passed" in proc.stdout, tail
