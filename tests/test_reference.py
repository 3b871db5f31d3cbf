"""Tests the oracle (`jax_varlen.reference`) against a per-sequence NumPy loop in float64.

The loop below is a second, independent reading of SPEC.md: for every (b, h, i) it slices
the allowed keys `k[b, :limit]` explicitly instead of masking, so the two share no code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jax_varlen.reference import reference

B, SQ, SKV, H, D, DV = 4, 6, 11, 4, 8, 6

# Lengths for SKV = 11, SQ = 6: every pattern has B = 4 entries.
LENGTHS = {
    "ragged": [0, 1, 7, 11],  # empty, single key, odd, full
    "full": [11, 11, 11, 11],
    "short": [1, 3, 5, 2],  # n < Sq: causal leaves leading query rows empty
    "odd": [3, 5, 9, 7],
}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
TOLS = {  # (atol, rtol) for the output, after one rounding to the dtype
    jnp.float32: (2e-5, 2e-5),
    jnp.float16: (2e-3, 2e-3),
    jnp.bfloat16: (1.6e-2, 1.6e-2),
}


def loop_attention(q, k, v, lengths, *, scale=None, is_causal=False, softcap=0.0):
    """float64 per-(b, h, i) loop over rank-4 NumPy inputs; returns (out, lse)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b_, sq, h_, d = q.shape
    skv, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((b_, sq, h_, dv))
    lse = np.full((b_, h_, sq), -np.inf)
    for b in range(b_):
        n = int(min(max(int(lengths[b]), 0), skv))
        for h in range(h_):
            g = h // (h_ // hkv)
            for i in range(sq):
                limit = min(n, i + (n - sq) + 1) if is_causal else n
                if limit <= 0:
                    continue
                s = scale * (k[b, :limit, g] @ q[b, i, h])
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                m = s.max()
                p = np.exp(s - m)
                out[b, i, h] = p @ v[b, :limit, g] / p.sum()
                lse[b, h, i] = m + np.log(p.sum())
    return out, lse


def make_inputs(lengths, *, heads=(H, H), d=D, dv=DV, sq=SQ, skv=SKV, dtype=jnp.float32,
                pad=np.nan, seed=0):
    """Random rank-4 q, k, v in `dtype` (as NumPy float32 copies too), padding set to `pad`."""
    h, hkv = heads
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((len(lengths), sq, h, d)).astype(np.float32)
    k = rng.standard_normal((len(lengths), skv, hkv, d)).astype(np.float32)
    v = rng.standard_normal((len(lengths), skv, hkv, dv)).astype(np.float32)
    for b, n in enumerate(lengths):
        n = min(max(n, 0), skv)
        k[b, n:] = pad
        v[b, n:] = pad
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    return q, k, v, np.asarray(lengths, np.int32)


def check(q, k, v, lengths, *, atol=2e-5, rtol=2e-5, **kw):
    """Runs the oracle (rank 4, with lse) and compares with the loop on the same inputs."""
    out, lse = reference(q, k, v, jnp.asarray(lengths), return_lse=True, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape[:3] + (v.shape[3],)
    assert lse.dtype == jnp.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    want_out, want_lse = loop_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                        v.astype(jnp.float32), lengths, **kw)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=atol, rtol=rtol)
    np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, atol=2e-5, rtol=2e-5)
    return out, lse


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_matches_loop(heads, is_causal, lengths):
    q, k, v, n = make_inputs(lengths, heads=heads)
    check(q, k, v, n, is_causal=is_causal)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_rank3(heads, is_causal):
    h, hkv = heads
    q, k, v, n = make_inputs(LENGTHS["ragged"], heads=heads)
    out3 = reference(q.reshape(B, SQ, h * D), k.reshape(B, SKV, hkv * D),
                     v.reshape(B, SKV, hkv * DV), n, num_heads=h, kv_num_heads=hkv,
                     is_causal=is_causal)
    assert out3.shape == (B, SQ, h * DV)
    want, _ = loop_attention(q, k, v, n, is_causal=is_causal)
    np.testing.assert_allclose(out3.reshape(B, SQ, h, DV), want, atol=2e-5, rtol=2e-5)


def test_rank3_kv_num_heads_defaults_to_num_heads():
    q, k, v, n = make_inputs(LENGTHS["odd"])
    out3 = reference(q.reshape(B, SQ, -1), k.reshape(B, SKV, -1), v.reshape(B, SKV, -1), n,
                     num_heads=H)
    np.testing.assert_array_equal(out3.reshape(B, SQ, H, DV), reference(q, k, v, n))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16],
                         ids=["f32", "f16", "bf16"])
def test_dtypes(dtype, is_causal):
    q, k, v, n = make_inputs(LENGTHS["ragged"], heads=HEADS["gqa"], dtype=dtype)
    atol, rtol = TOLS[dtype]
    check(q, k, v, n, is_causal=is_causal, atol=atol, rtol=rtol)


@pytest.mark.parametrize("d,dv", [(8, 8), (8, 6), (4, 16), (16, 3)],
                         ids=["d8-dv8", "d8-dv6", "d4-dv16", "d16-dv3"])
def test_head_dims(d, dv):
    q, k, v, n = make_inputs(LENGTHS["ragged"], heads=HEADS["gqa"], d=d, dv=dv)
    check(q, k, v, n, is_causal=True)


@pytest.mark.parametrize("softcap", [0.0, 1.0, 30.0], ids=["nocap", "cap1", "cap30"])
@pytest.mark.parametrize("scale", [None, 0.3, 2.0], ids=["scale-default", "scale0.3", "scale2"])
def test_scale_and_softcap(scale, softcap):
    q, k, v, n = make_inputs(LENGTHS["ragged"], heads=HEADS["gqa"])
    check(q, k, v, n, scale=scale, softcap=softcap, is_causal=True)


def test_softcap_changes_result():
    q, k, v, n = make_inputs(LENGTHS["full"])
    plain = reference(q, k, v, n, scale=2.0)
    capped = reference(q, k, v, n, scale=2.0, softcap=1.0)
    assert np.abs(np.asarray(plain - capped)).max() > 1e-2


def test_negative_softcap_raises():
    q, k, v, n = make_inputs(LENGTHS["full"])
    with pytest.raises(ValueError, match="softcap"):
        reference(q, k, v, n, softcap=-1.0)


@pytest.mark.parametrize("sq,skv,lengths", [(13, 5, [0, 1, 5]), (6, 11, [0, 2, 11])],
                         ids=["sq13-skv5", "sq6-skv11"])
def test_empty_rows_are_zero_with_lse_neg_inf(sq, skv, lengths):
    """n = 0 empties every row; causal with n < Sq empties the leading Sq - n rows."""
    q, k, v, n = make_inputs(lengths, sq=sq, skv=skv)
    out, lse = check(q, k, v, n, is_causal=True)
    out, lse = np.asarray(out), np.asarray(lse)
    for b, nb in enumerate(lengths):
        empty = max(sq - nb, 0) if nb else sq
        assert (out[b, :empty] == 0).all() and np.isneginf(lse[b, :, :empty]).all()
        assert np.isfinite(lse[b, :, empty:]).all()


@pytest.mark.parametrize("pad", [np.nan, np.inf, -np.inf, 1e30], ids=["nan", "inf", "-inf", "huge"])
def test_padding_never_leaks(pad):
    q, k, v, n = make_inputs(LENGTHS["ragged"], heads=HEADS["gqa"], pad=pad)
    q0, k0, v0, _ = make_inputs(LENGTHS["ragged"], heads=HEADS["gqa"], pad=0.0)
    for causal in (False, True):
        got = reference(q, k, v, n, is_causal=causal, return_lse=True)
        want = reference(q0, k0, v0, n, is_causal=causal, return_lse=True)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("dtype", [np.int32, np.int64], ids=["int32", "int64"])
def test_length_dtypes(dtype):
    q, k, v, n = make_inputs(LENGTHS["ragged"])
    want = reference(q, k, v, n)
    np.testing.assert_array_equal(reference(q, k, v, np.asarray(n, dtype)), want)
    with jax.enable_x64(True):
        got = reference(q, k, v, jnp.asarray(n, dtype))
    np.testing.assert_array_equal(got, want)


def test_out_of_range_lengths_are_clamped():
    q, k, v, _ = make_inputs([11, 11, 11, 11], pad=0.0)
    got = reference(q, k, v, jnp.asarray([-3, 0, 40, 11]), is_causal=True, return_lse=True)
    want = reference(q, k, v, jnp.asarray([0, 0, 11, 11]), is_causal=True, return_lse=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_float64_inputs_compute_in_float64():
    with jax.enable_x64(True):
        q, k, v, n = make_inputs(LENGTHS["ragged"], heads=HEADS["gqa"], dtype=jnp.float64)
        out, lse = reference(q, k, v, n, is_causal=True, softcap=2.0, return_lse=True)
        assert out.dtype == jnp.float64 and lse.dtype == jnp.float32
        want, _ = loop_attention(q, k, v, n, is_causal=True, softcap=2.0)
        np.testing.assert_allclose(out, want, atol=1e-12, rtol=1e-12)


def test_jit_and_vmap():
    q, k, v, n = make_inputs(LENGTHS["ragged"], heads=HEADS["gqa"])
    fn = lambda q, k, v, n: reference(q, k, v, n, is_causal=True, return_lse=True)  # noqa: E731
    eager = fn(q, k, v, n)
    for g, w in zip(jax.jit(fn)(q, k, v, n), eager):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-6)
    # vmap over the batch axis, each call seeing one sequence as a batch of one.
    one = lambda q, k, v, n: fn(q[None], k[None], v[None], n[None])  # noqa: E731
    out, lse = jax.vmap(one)(q, k, v, n)
    np.testing.assert_allclose(out[:, 0], eager[0], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(lse[:, 0], eager[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_grad_finite_and_zero_on_padding(heads):
    lengths = [0, 1, 3, 11]  # empty sequence, empty causal rows, NaN padding
    q, k, v, n = make_inputs(lengths, heads=heads)

    def loss(q, k, v):
        out, lse = reference(q, k, v, n, is_causal=True, softcap=5.0, return_lse=True)
        return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g in (dq, dk, dv):
        assert np.isfinite(np.asarray(g)).all()
    for b, nb in enumerate(lengths):
        assert (np.asarray(dk[b, nb:]) == 0).all() and (np.asarray(dv[b, nb:]) == 0).all()
        empty = max(SQ - nb, 0) if nb else SQ  # rows with no allowed key: no gradient
        assert (np.asarray(dq[b, :empty]) == 0).all()
    assert np.abs(np.asarray(dk[3])).max() > 0 and np.abs(np.asarray(dv[3])).max() > 0


def test_grad_matches_finite_differences():
    with jax.enable_x64(True):
        q, k, v, n = make_inputs([0, 2, 5, 11], heads=HEADS["gqa"], d=4, dv=3, pad=0.0,
                                 dtype=jnp.float64)
        fn = jax.jit(lambda q, k, v: reference(q, k, v, n, is_causal=True, softcap=3.0))
        check_grads(fn, (q, k, v), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
