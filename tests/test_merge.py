"""merge_attention: partial results over disjoint key slices merge into attention over all keys.

Single device: the slices are cut on the host and each one is run through the op with its
local lengths, exactly as a sequence-parallel device would; those tests take the ``backend``
fixture. The merge's own worked examples and shape errors need no op and run once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_varlen
from conftest import DTYPES, assert_lse_close, assert_out_close, bits, make_inputs, oracle_hi

B, SQ, H, D, DV = 5, 3, 4, 16, 8
LENGTHS = [0, 1, 17, 24, 40]  # empty, one key, mid-slice, on a slice boundary, full


def _partials(q, k, v, n, bounds, **kw):
    """The op on key slices [bounds[p], bounds[p+1]); returns outs [P, ...], lses [P, ...]."""
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        n_local = jnp.clip(n - lo, 0, hi - lo)
        out, lse = jax_varlen.attention(q, k[:, lo:hi], v[:, lo:hi], n_local, return_lse=True, **kw)
        outs.append(out), lses.append(lse)
    return jnp.stack(outs), jnp.stack(lses)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("bounds", [(0, 40), (0, 8, 16, 24, 32, 40), (0, 3, 24, 25, 40)],
                         ids=["P1", "P5-even", "P4-uneven"])
def test_merge_equals_whole(backend, dtype, heads, bounds):
    h, hkv = heads
    q, k, v, n = make_inputs(B, SQ, 40, h, hkv, D, DV, DTYPES[dtype], LENGTHS, seed=1)
    out, lse = jax_varlen.merge_attention(*_partials(q, k, v, n, bounds))
    assert out.dtype == q.dtype and out.shape == (B, SQ, h, DV)
    assert lse.dtype == jnp.float32 and lse.shape == (B, h, SQ)
    hi_out, hi_lse = oracle_hi(q, k, v, n, return_lse=True)
    # The partial outputs are rounded to the input dtype before the merge: one extra rounding,
    # so no same-precision baseline bound here, only the per-dtype one.
    assert_out_close(out, hi_out, None, q.dtype)
    assert_lse_close(lse, hi_lse)


def test_merge_causal_decode(backend):
    """Sq = 1: tail-aligned causal equals non-causal, slice by slice too."""
    q, k, v, n = make_inputs(B, 1, 40, H, 2, D, DV, jnp.float32, LENGTHS, seed=2)
    partials = _partials(q, k, v, n, (0, 10, 20, 30, 40), is_causal=True)
    out, lse = jax_varlen.merge_attention(*partials)
    hi_out, hi_lse = oracle_hi(q, k, v, n, return_lse=True, is_causal=True)
    assert_out_close(out, hi_out, None, q.dtype)
    assert_lse_close(lse, hi_lse)


def test_merge_f32_matches_single_call(backend):
    """f32: the merge agrees with one call over all keys to fp32 rounding."""
    q, k, v, n = make_inputs(B, SQ, 40, H, 2, D, DV, jnp.float32, LENGTHS, seed=3)
    out, lse = jax_varlen.merge_attention(*_partials(q, k, v, n, (0, 16, 32, 40)))
    ref_out, ref_lse = jax_varlen.attention(q, k, v, n, return_lse=True)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], rtol=2e-6)


def test_all_empty_gives_zero_and_minus_inf():
    outs = jnp.full((3, 2, 1, 2, 4), jnp.nan, jnp.float32)  # garbage rows must be ignored
    lses = jnp.full((3, 2, 2, 1), -jnp.inf, jnp.float32)
    out, lse = jax_varlen.merge_attention(outs, lses)
    np.testing.assert_array_equal(out, np.zeros((2, 1, 2, 4), np.float32))
    assert (np.asarray(lse) == -np.inf).all()


def test_empty_partial_with_garbage_is_ignored():
    """A partial whose lse is -inf contributes nothing, even if its row holds NaN/Inf."""
    rng = np.random.default_rng(0)
    good = rng.standard_normal((1, 2, 1, 3, 4)).astype(np.float32)
    outs = np.concatenate([good, np.full_like(good, np.nan), np.full_like(good, np.inf)])
    lses = np.stack([np.full((2, 3, 1), 0.5, np.float32), np.full((2, 3, 1), -np.inf, np.float32),
                     np.full((2, 3, 1), -np.inf, np.float32)])
    out, lse = jax_varlen.merge_attention(outs, lses)
    np.testing.assert_array_equal(out, good[0])
    np.testing.assert_array_equal(lse, lses[0])


def test_two_equal_partials():
    """Worked example: two partials with equal lse -> the mean, and lse + log 2."""
    outs = jnp.asarray([[[[[1.0, 2.0]]]], [[[[3.0, 6.0]]]]])  # [2, 1, 1, 1, 2]
    lses = jnp.asarray([[[[0.25]]], [[[0.25]]]])  # [2, 1, 1, 1]
    out, lse = jax_varlen.merge_attention(outs, lses)
    np.testing.assert_allclose(out, [[[[2.0, 4.0]]]], rtol=1e-7)
    np.testing.assert_allclose(lse, [[[0.25 + np.log(2.0)]]], rtol=1e-7)


def test_rank3_outs(backend):
    q, k, v, n = make_inputs(B, SQ, 40, H, H, D, DV, jnp.float32, LENGTHS, seed=4, rank=3)
    outs, lses = _partials(q, k, v, n, (0, 20, 40), num_heads=H)
    assert outs.ndim == 4
    out, lse = jax_varlen.merge_attention(outs, lses)
    ref = jax_varlen.attention(q, k, v, n, num_heads=H)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)


def test_deterministic_and_jittable(backend):
    q, k, v, n = make_inputs(B, SQ, 40, H, 2, D, DV, jnp.bfloat16, LENGTHS, seed=5)
    outs, lses = _partials(q, k, v, n, (0, 8, 16, 24, 32, 40))
    first = jax_varlen.merge_attention(outs, lses)
    again = jax_varlen.merge_attention(outs, lses)
    jitted = jax.jit(jax_varlen.merge_attention)(outs, lses)
    for a, b in ((first, again), (first, jitted)):
        assert bits(a[0]) == bits(b[0]) and bits(a[1]) == bits(b[1])


@pytest.mark.parametrize(
    "outs_shape, lses_shape, match",
    [
        ((2, 1, 3, 4, 8), (2, 1, 3, 4), r"lses must be \[P, B, H, Sq\]"),  # H, Sq swapped
        ((2, 1, 3, 4, 8), (3, 1, 4, 3), r"lses must be \[P, B, H, Sq\]"),  # P differs
        ((2, 1, 3), (2, 1, 4, 3), r"expects outs \[P, B, Sq, H, Dv\]"),
        ((0, 1, 3, 4, 8), (0, 1, 4, 3), r"at least one partial"),
        ((2, 1, 3, 10), (2, 1, 4, 3), r"multiple of the head count"),
    ],
)
def test_shape_errors(outs_shape, lses_shape, match):
    with pytest.raises(ValueError, match=match):
        jax_varlen.merge_attention(jnp.zeros(outs_shape), jnp.zeros(lses_shape))
