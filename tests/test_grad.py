"""Gradients (custom_vjp) against jax.vjp of the oracle; padding gets exactly zero gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_varlen
from conftest import make_inputs

CASES = [  # (Sq, Skv, H, Hkv, D, Dv, lengths, causal, softcap)
    (9, 13, 4, 2, 8, 5, [13, 0, 5], False, 0.0),
    (9, 13, 4, 2, 8, 5, [13, 0, 5], True, 0.0),
    (7, 7, 2, 1, 16, 16, [7, 3, 1], True, 3.0),
    (12, 20, 3, 3, 6, 10, [20, 19, 11], False, 2.0),
]


def _loss(fn, lengths, causal, softcap):
    def loss(q, k, v):
        out, lse = fn(q, k, v, lengths, is_causal=causal, softcap=softcap, return_lse=True)
        # A non-uniform weighting of out and of the finite lse entries (lse = -inf rows carry
        # no gradient by definition).
        w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return jnp.sum(out.astype(jnp.float32) * w) + 0.3 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return loss


def _grad(attn, lengths, causal, softcap):
    """Jitted (an eager backward runs op by op: seconds per call); test_eager_grad covers
    the eager path."""
    return jax.jit(jax.grad(_loss(attn, lengths, causal, softcap), argnums=(0, 1, 2)))


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_grad_matches_reference(case):
    Sq, Skv, H, Hkv, D, Dv, lengths, causal, softcap = case
    q, k, v, n = make_inputs(len(lengths), Sq, Skv, H, Hkv, D, Dv, jnp.float32, lengths, seed=5)
    ours = _grad(jax_varlen.attention, n, causal, softcap)(q, k, v)
    ref = _grad(jax_varlen.reference, n, causal, softcap)(q, k, v)
    for name, a, b in zip("qkv", ours, ref):
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(a).all(), f"d{name} has non-finite entries"
        np.testing.assert_allclose(a, b, atol=2e-5 * max(1.0, np.abs(b).max()), err_msg=f"d{name}")
    # Padded keys and values (j >= n_b) get exactly zero gradient, even though they hold NaN.
    for b, nb in enumerate(lengths):
        assert (np.asarray(ours[1])[b, nb:] == 0).all() and (np.asarray(ours[2])[b, nb:] == 0).all()


def test_grad_bf16_is_finite_and_close():
    q, k, v, n = make_inputs(2, 16, 24, 4, 2, 32, 32, jnp.bfloat16, [24, 9], seed=6)
    ours = _grad(jax_varlen.attention, n, True, 0.0)(q, k, v)
    ref = _grad(jax_varlen.reference, n, True, 0.0)(q, k, v)
    for a, b in zip(ours, ref):
        assert a.dtype == jnp.bfloat16
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all()
        assert np.abs(a - b).max() <= 3e-2 * max(1.0, np.abs(b).max())


def test_eager_grad():
    """Outside jit: the JVP rule, the transposition and the backward run op by op."""
    q, k, v, n = make_inputs(2, 3, 5, 2, 1, 4, 4, jnp.float32, [5, 2], seed=12)
    ours = jax.grad(_loss(jax_varlen.attention, n, True, 1.5), argnums=(0, 1, 2))(q, k, v)
    ref = _grad(jax_varlen.reference, n, True, 1.5)(q, k, v)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_vmap_of_grad_and_jit():
    q, k, v, n = make_inputs(2, 5, 8, 2, 2, 4, 4, jnp.float32, [8, 3], seed=7)
    stack = lambda x: jnp.stack([x, x[::-1]])
    grad = jax.grad(lambda q, k, v, n: jnp.sum(jax_varlen.attention(q, k, v, n) ** 2))
    batched = jax.jit(jax.vmap(grad))(stack(q), stack(k), stack(v), stack(n))
    for i in range(2):
        one = jax.jit(grad)(stack(q)[i], stack(k)[i], stack(v)[i], stack(n)[i])
        np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(one), rtol=1e-6, atol=1e-6)


def test_grad_is_deterministic():
    q, k, v, n = make_inputs(2, 6, 9, 2, 1, 8, 8, jnp.float32, [9, 4], seed=8)
    f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax_varlen.attention(q, k, v, n, is_causal=True) ** 2),
                         argnums=(0, 1, 2)))
    a, b = f(q, k, v), f(q, k, v)
    for x, y in zip(a, b):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.mark.parametrize("elements", [64, 400], ids=["rows1", "rows2-padded"])
def test_grad_in_several_row_blocks(monkeypatch, elements):
    """The backward scans query rows in blocks; small blocks (and a padded last one) agree."""
    from jax_varlen import _autodiff

    Sq, Skv, H, Hkv, D, Dv, lengths, causal, softcap = CASES[1]
    q, k, v, n = make_inputs(len(lengths), Sq, Skv, H, Hkv, D, Dv, jnp.float32, lengths, seed=9)
    B = len(lengths)
    monkeypatch.setattr(_autodiff, "_BWD_BLOCK_ELEMENTS", elements)
    rows = _autodiff._bwd_block_rows(B, H, Sq, Skv)
    assert rows < Sq and (elements == 64 or Sq % rows)  # several blocks; the padded case pads
    ours = _grad(jax_varlen.attention, n, causal, softcap)(q, k, v)
    ref = _grad(jax_varlen.reference, n, causal, softcap)(q, k, v)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * max(1.0, np.abs(b).max()))


@pytest.mark.parametrize(
    "B,Sq,Skv,lengths",
    [(2, 0, 16, [16, 3]), (2, 5, 0, [0, 0]), (0, 5, 16, []), (0, 0, 0, []), (2, 0, 0, [0, 0])],
    ids=["sq0", "skv0", "b0", "all0", "sq0-skv0"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_grad_of_empty_extents(B, Sq, Skv, lengths, causal):
    """Sq = 0 used to divide by zero in the backward's block count. Empty extents give
    gradients of the right shapes, all zero, as the reference's."""
    q, k, v, n = make_inputs(B, Sq, Skv, 4, 2, 8, 6, jnp.float32, lengths, seed=10)
    f = lambda attn: jax.jit(jax.grad(_loss(attn, n, causal, 0.0), argnums=(0, 1, 2)))  # noqa: E731
    ours, ref = f(jax_varlen.attention)(q, k, v), f(jax_varlen.reference)(q, k, v)
    for x, a, b in zip((q, k, v), ours, ref):
        assert a.shape == x.shape and a.dtype == x.dtype
        assert (np.asarray(a) == 0).all() and (np.asarray(b) == 0).all()


def test_grad_with_nan_in_a_real_query_row():
    """Non-finite real data propagates into the gradient too (a zeroed row would hide a
    blow-up): the NaN row's d_query is NaN, as the reference's, and the other rows of d_query
    and the other sequence are unaffected; padded keys and values still get exactly zero."""
    Sq, Skv, H, Hkv, D, Dv, lengths = 6, 11, 4, 2, 8, 8, [9, 4]
    q, k, v, n = make_inputs(2, Sq, Skv, H, Hkv, D, Dv, jnp.float32, lengths, seed=11)
    b, i, h = 0, 3, 1
    q = q.at[b, i, h, 2].set(jnp.nan)
    grad = lambda attn: jax.jit(jax.grad(_loss(attn, n, True, 0.0), argnums=(0, 1, 2)))  # noqa: E731
    ours = [np.asarray(g) for g in grad(jax_varlen.attention)(q, k, v)]
    ref = [np.asarray(g) for g in grad(jax_varlen.reference)(q, k, v)]
    nan_row = np.zeros(q.shape, bool)
    nan_row[b, i, h] = True
    assert np.isnan(ours[0][nan_row]).all() and np.isnan(ref[0][nan_row]).all()
    np.testing.assert_allclose(ours[0][~nan_row], ref[0][~nan_row], atol=2e-5)
    for name, a, r in zip("qkv", ours, ref):  # sequence 1 does not see sequence 0's NaN
        np.testing.assert_allclose(a[1], r[1], atol=2e-5, err_msg=f"d{name}[1]")
    # The real keys and values of sequence 0: what the reference gives, NaN for NaN (row i
    # reaches the keys it attends to, and every key through 0 * NaN in d_k's product).
    nb = lengths[b]
    assert np.isnan(ours[1][b, :nb]).any() and np.isnan(ours[2][b, :nb]).any()
    for name, a, r in zip("kv", ours[1:], ref[1:]):
        np.testing.assert_allclose(a[b, :nb], r[b, :nb], atol=2e-5, err_msg=f"d{name}[0]")
    for nb, d_k, d_v in zip(lengths, ours[1], ours[2]):
        assert (d_k[nb:] == 0).all() and (d_v[nb:] == 0).all()
