"""The forward op on the CPU against the float64 oracle, and its bitwise properties."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_varlen
from conftest import (
    DTYPES,
    HEADS,
    assert_cases_cover_causal,
    assert_padding_never_leaks,
    bits,
    check_against_oracle,
    make_inputs,
    pairwise,
    to_heads,
)

# Length patterns: name -> (B, Sq, Skv, lengths). Sq and Skv cross the CPU's 64-row and
# 64-key blocks in some patterns; Sq is often not a multiple of 4 (the rows of one step).
PATTERNS = {
    "zeros": (2, 8, 16, [0, 0]),
    "ones": (2, 9, 16, [1, 1]),
    "odd": (3, 24, 128, [17, 37, 127]),
    "full": (2, 40, 40, [40, 40]),
    "ragged": (4, 20, 150, [3, 150, 1, 7]),  # one long among short
    "sqltskv": (2, 5, 70, [70, 33]),  # Sq < Skv: a few queries at the tail of long keys
    "sqgtskv": (3, 70, 20, [20, 7, 0]),  # Sq > Skv: n < Sq, leading causal rows are empty
    "square": (3, 33, 33, [33, 20, 5]),  # self-attention shape with n < Sq
}

HEAD_DIM = 32
DV = {"dv=d": HEAD_DIM, "dv16": 16, "dv48": 48}
SOFTCAP = 2.0

_AXES = {
    "dtype": list(DTYPES),
    "rank": [3, 4],
    "heads": list(HEADS),
    "dv": list(DV),
    "causal": [False, True],
    "softcap": [False, True],
    "pattern": list(PATTERNS),
}
# Every (dtype, causal, pattern) combination, and every pair of values of any two axes.
CASES = pairwise(_AXES, must=("dtype", "causal", "pattern"))


def _case_id(c):
    return "-".join([
        c["dtype"],
        f"rank{c['rank']}",
        c["heads"],
        f"d{HEAD_DIM}",
        c["dv"],
        "causal" if c["causal"] else "noncausal",
        "softcap" if c["softcap"] else "nosoftcap",
        c["pattern"],
    ])


def _kwargs(rank, H, Hkv, causal, softcap):
    kw = dict(is_causal=causal, softcap=SOFTCAP if softcap else 0.0)
    if rank == 3:
        kw.update(num_heads=H, kv_num_heads=Hkv)
    return kw


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_oracle(case):
    B, Sq, Skv, lengths = PATTERNS[case["pattern"]]
    H, Hkv = HEADS[case["heads"]]
    dtype = DTYPES[case["dtype"]]
    q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, HEAD_DIM, DV[case["dv"]], dtype, lengths,
                             rank=case["rank"], seed=zlib.crc32(_case_id(case).encode()))
    kw = _kwargs(case["rank"], H, Hkv, case["causal"], case["softcap"])
    out, lse = check_against_oracle(q, k, v, n, **kw)
    assert out.shape == q.shape[:-1] + (q.shape[-1] // HEAD_DIM * DV[case["dv"]],)
    assert lse.shape == (B, H, Sq)


def test_cases_cover_every_value_with_causal_on_and_off():
    assert_cases_cover_causal(_AXES, CASES)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [1, 3, 64, 80, 96, 128, 256, 300])
def test_head_sizes(head_dim, dtype):
    causal = head_dim % 2 == 0
    for dv in sorted({head_dim, max(1, head_dim // 2 + 1)}):
        q, k, v, n = make_inputs(2, 9, 70, 4, 2, head_dim, dv, DTYPES[dtype], [70, 23],
                                 seed=head_dim)
        check_against_oracle(q, k, v, n, is_causal=causal)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rows_without_keys_are_zero_with_lse_minus_inf(dtype):
    B, Sq, Skv, H = 3, 12, 16, 4
    lengths = [0, 5, 16]
    q, k, v, n = make_inputs(B, Sq, Skv, H, 2, 8, 8, DTYPES[dtype], lengths, seed=1)
    for causal in (False, True):
        out, lse = jax_varlen.attention(q, k, v, n, is_causal=causal, return_lse=True)
        out, lse = np.asarray(out, np.float32), np.asarray(lse)
        empty = np.zeros((B, Sq), bool)
        empty[0] = True  # n = 0
        if causal:
            for b, nb in enumerate(lengths):
                empty[b, : max(Sq - nb, 0)] = True  # row i sees keys j <= i + n - Sq
        assert (out[empty] == 0).all()
        assert (lse.transpose(0, 2, 1)[empty] == -np.inf).all()
        assert np.isfinite(lse.transpose(0, 2, 1)[~empty]).all()
        assert np.isfinite(out).all()
        assert (np.abs(out[~empty]).sum(-1) > 0).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_padding_never_leaks(dtype, causal):
    assert_padding_never_leaks(3, 21, 90, 4, 1, 16, 24, DTYPES[dtype], [90, 0, 41],
                               is_causal=causal, softcap=1.5)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_outputs_finite_for_extreme_scores(dtype):
    """Large logits (scale 50) stay finite and still match the oracle."""
    q, k, v, n = make_inputs(2, 17, 80, 4, 2, 16, 16, DTYPES[dtype], [80, 37], seed=3)
    for causal in (False, True):
        out, lse = check_against_oracle(q, k, v, n, scale=50.0, is_causal=causal)
        assert np.isfinite(np.asarray(out, np.float32)).all()
        assert not np.isnan(np.asarray(lse)).any()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bitwise_deterministic(dtype):
    q, k, v, n = make_inputs(3, 130, 200, 4, 2, 32, 32, DTYPES[dtype], [200, 77, 131], seed=5)
    f = jax.jit(lambda *a: jax_varlen.attention(*a, is_causal=True, return_lse=True))
    runs = [f(q, k, v, n) for _ in range(3)]
    runs.append(jax_varlen.attention(q, k, v, n, is_causal=True, return_lse=True))
    first = tuple(bits(x) for x in runs[0])
    for r in runs[1:]:
        assert tuple(bits(x) for x in r) == first


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_batch_invariance(dtype, causal):
    """A sequence alone gives the same bits as inside a bigger batch with other lengths."""
    Sq, Skv, H, Hkv, D, Dv, n0 = 37, 100, 4, 2, 32, 16, 61
    dt = DTYPES[dtype]
    q1, k1, v1, n1 = make_inputs(1, Sq, Skv, H, Hkv, D, Dv, dt, [n0], seed=11)
    alone = jax_varlen.attention(q1, k1, v1, n1, is_causal=causal, return_lse=True)
    qb, kb, vb, nb = make_inputs(5, Sq, Skv, H, Hkv, D, Dv, dt, [100, 0, 3, n0, 99], seed=12)
    at = 3
    qb, kb, vb = qb.at[at].set(q1[0]), kb.at[at].set(k1[0]), vb.at[at].set(v1[0])
    batched = jax_varlen.attention(qb, kb, vb, nb, is_causal=causal, return_lse=True)
    assert bits(batched[0][at]) == bits(alone[0][0])
    assert bits(batched[1][at]) == bits(alone[1][0])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_padding_extent_invariance(dtype):
    """More padding (a larger Skv) around the same valid keys changes no bit."""
    Sq, n0 = 19, 45
    q, k, v, n = make_inputs(2, Sq, 50, 4, 4, 16, 16, DTYPES[dtype], [n0, 50], seed=13)
    ref = jax_varlen.attention(q, k, v, n, is_causal=True, return_lse=True)
    pad = jnp.full((2, 150, 4, 16), jnp.nan, q.dtype)
    k2 = jnp.concatenate([k, pad], axis=1)
    v2 = jnp.concatenate([v, pad], axis=1)
    out = jax_varlen.attention(q, k2, v2, n, is_causal=True, return_lse=True)
    assert bits(out[0]) == bits(ref[0]) and bits(out[1]) == bits(ref[1])


def test_int64_lengths():
    q, k, v, n = make_inputs(3, 10, 40, 4, 2, 16, 16, jnp.float32, [40, 0, 13], seed=17)
    ref = jax_varlen.attention(q, k, v, n, is_causal=True, return_lse=True)
    # A numpy int64 array (x64 off) ...
    out = jax_varlen.attention(q, k, v, np.asarray(n, np.int64), is_causal=True, return_lse=True)
    assert bits(out[0]) == bits(ref[0]) and bits(out[1]) == bits(ref[1])
    # ... and a jax int64 array, eager and traced, with x64 on.
    with jax.enable_x64(True):
        n64 = jnp.asarray(np.asarray(n), jnp.int64)
        assert n64.dtype == jnp.int64
        out = jax_varlen.attention(q, k, v, n64, is_causal=True, return_lse=True)
        assert bits(out[0]) == bits(ref[0]) and bits(out[1]) == bits(ref[1])
        f = jax.jit(lambda n: jax_varlen.attention(q, k, v, n, is_causal=True, return_lse=True))
        out = f(n64)
        assert bits(out[0]) == bits(ref[0]) and bits(out[1]) == bits(ref[1])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scale", [0.0, 0.05, 1.0, 3.7])
def test_explicit_scale(scale, dtype):
    q, k, v, n = make_inputs(2, 11, 66, 4, 2, 24, 24, DTYPES[dtype], [66, 29], seed=19)
    check_against_oracle(q, k, v, n, scale=scale, is_causal=True)
    check_against_oracle(q, k, v, n, scale=scale, softcap=SOFTCAP)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v, n = make_inputs(2, 11, 30, 2, 2, 25, 8, jnp.float32, [30, 12], seed=23)
    a = jax_varlen.attention(q, k, v, n)
    b = jax_varlen.attention(q, k, v, n, scale=1 / np.sqrt(25))
    assert bits(a) == bits(b)


def test_return_lse_shapes_and_rank3():
    B, Sq, Skv, H, Hkv, D, Dv = 2, 7, 20, 6, 3, 8, 5
    q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, Dv, jnp.float32, [20, 9], rank=3, seed=29)
    out, lse = jax_varlen.attention(q, k, v, n, num_heads=H, kv_num_heads=Hkv, return_lse=True)
    assert out.shape == (B, Sq, H * Dv) and lse.shape == (B, H, Sq)
    plain = jax_varlen.attention(q, k, v, n, num_heads=H, kv_num_heads=Hkv)
    assert bits(plain) == bits(out)
    # rank 3 gives the same bits as rank 4 on the same data
    q4, k4, v4 = to_heads(q, H), to_heads(k, Hkv), to_heads(v, Hkv)
    out4, lse4 = jax_varlen.attention(jnp.asarray(q4), jnp.asarray(k4), jnp.asarray(v4), n,
                                      return_lse=True)
    assert bits(np.asarray(out4).reshape(out.shape)) == bits(out)
    assert bits(lse4) == bits(lse)


EMPTY = pytest.mark.parametrize(
    "B,Sq,Skv,lengths",
    [(2, 0, 16, [16, 3]), (2, 5, 0, [0, 0]), (0, 5, 16, []), (0, 0, 0, []), (2, 0, 0, [0, 0])],
    ids=["sq0", "skv0", "b0", "all0", "sq0-skv0"],
)


@EMPTY
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_empty_extents(B, Sq, Skv, lengths, causal):
    H, Hkv, D, Dv = 4, 2, 8, 6
    q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, Dv, jnp.float32, lengths, seed=31)
    for f in (jax_varlen.attention,
              jax.jit(jax_varlen.attention, static_argnames=("is_causal", "return_lse"))):
        out, lse = f(q, k, v, n, is_causal=causal, return_lse=True)
        assert out.shape == (B, Sq, H, Dv) and out.dtype == q.dtype
        assert lse.shape == (B, H, Sq) and lse.dtype == jnp.float32
        assert (np.asarray(out) == 0).all()
        assert (np.asarray(lse) == -np.inf).all()


@EMPTY
def test_empty_extents_match_oracle(B, Sq, Skv, lengths):
    q, k, v, n = make_inputs(B, Sq, Skv, 4, 2, 8, 6, jnp.float32, lengths, seed=31)
    check_against_oracle(q, k, v, n, is_causal=True)
