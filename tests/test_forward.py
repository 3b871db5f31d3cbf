"""The forward op on every backend against the float64 oracle, and its bitwise properties.

Every test takes the ``backend`` fixture (conftest): it runs on the CPU and on the GPU (marked
``gpu``: skipped unless jax sees a GPU and jax_varlen has its CUDA kernels). Where a check
needs shapes that cross one backend's blocking, each backend has its own table
(``backend_cases``): the CPU handler steps over 64 query rows and 64 keys; the CUDA kernels
over 64- and 128-key tiles, with head sizes bucketed to 64/128/256, and for Sq <= 16 in
f16/bf16 a split-KV path with 1024-key splits. The oracle runs on the CPU in float64 on the
inputs upcast exactly; the oracle on the very inputs gives the same-precision baseline
(conftest.check_against_oracle).
"""

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
    allowed_keys,
    assert_padding_never_leaks,
    backend_cases,
    bits,
    check_against_oracle,
    make_inputs,
    pairwise,
    to_heads,
)


def _case(dtype, shape, lengths, seed=0, **kw):
    """One oracle check: dtype name, (B, Sq, Skv, H, Hkv, D, Dv), lengths, the op's keywords."""
    return dict(dtype=dtype, shape=shape, lengths=lengths, seed=seed, kw=kw)


def _check(case, rank=4):
    B, Sq, Skv, H, Hkv, D, Dv = case["shape"]
    q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, Dv, DTYPES[case["dtype"]], case["lengths"],
                             rank=rank, seed=case["seed"])
    return check_against_oracle(q, k, v, n, **case["kw"])


# --------------------------------------------------------------------------------------------
# The oracle matrix: a pairwise product of dtype, rank, heads, head size, value head size,
# causal, softcap and length pattern, per backend. Patterns: name -> (B, Sq, Skv, lengths).

# CPU: Sq and Skv cross the 64-row and 64-key blocks in some patterns; Sq is often not a
# multiple of 4 (the rows of one step). One head size, three value head sizes, rank 3 and 4.
CPU_PATTERNS = {
    "zeros": (2, 8, 16, [0, 0]),
    "ones": (2, 9, 16, [1, 1]),
    "odd": (3, 24, 128, [17, 37, 127]),
    "full": (2, 40, 40, [40, 40]),
    "ragged": (4, 20, 150, [3, 150, 1, 7]),  # one long among short
    "sqltskv": (2, 5, 70, [70, 33]),  # Sq < Skv: a few queries at the tail of long keys
    "sqgtskv": (3, 70, 20, [20, 7, 0]),  # Sq > Skv: n < Sq, leading causal rows are empty
    "square": (3, 33, 33, [33, 20, 5]),  # self-attention shape with n < Sq
}

# GPU: Sq in {1, 7, 128, 333}; Skv up to 1100 so that key tiles of 64 and 128 are crossed,
# with partial last tiles; lengths 0, 1, odd, Skv, one long among short. Short queries
# (Sq <= 16, f16/bf16) take the split-KV path: n = 1100 crosses a 1024-key split.
GPU_PATTERNS = {
    "zeros": (2, 7, 128, [0, 0]),
    "ones": (3, 128, 64, [1, 1, 1]),
    "odd": (4, 128, 577, [17, 37, 127, 577]),
    "full": (2, 333, 333, [333, 333]),
    "ragged": (4, 128, 1100, [3, 1100, 1, 40]),  # one long among short
    "decode": (4, 1, 1100, [1100, 577, 1, 0]),  # Sq = 1
    "sq7": (3, 7, 1100, [1100, 577, 17]),
    "sqgtskv": (3, 333, 200, [200, 37, 0]),  # n < Sq: leading causal rows are empty
}

# The GPU's value head size in "dv!=d" cases, by head size (here and in the head-size table).
OTHER_DV = {32: 64, 64: 128, 80: 64, 96: 128, 128: 64, 192: 128, 256: 128}

# Per backend: the axes, the axes whose every combination is taken (pairwise's ``must``), the
# axes' fixed values, the softcap value of "softcap" cases. The GPU matrix has the buckets
# (64, 128, 256) and a size that rounds up (80); rank 3 is test_rank3_and_explicit_scale's.
MATRIX = {
    "cpu": dict(
        patterns=CPU_PATTERNS,
        axes={"dtype": list(DTYPES), "rank": [3, 4], "heads": list(HEADS),
              "dv": ["dv=d", 16, 48], "causal": [False, True], "softcap": [False, True],
              "pattern": list(CPU_PATTERNS)},
        must=("dtype", "causal", "pattern"), fixed=dict(head_dim=32), softcap=2.0),
    "gpu": dict(
        patterns=GPU_PATTERNS,
        axes={"dtype": list(DTYPES), "head_dim": [64, 80, 128, 256], "causal": [False, True],
              "softcap": [False, True], "heads": list(HEADS), "dv": ["dv=d", "dv!=d"],
              "pattern": list(GPU_PATTERNS)},
        must=("dtype", "head_dim", "causal"), fixed=dict(rank=4), softcap=5.0),
}


def _matrix_cases(backend):
    """{case id: case} for one backend: every (must) combination, every pair of values."""
    m = MATRIX[backend]
    cases = {}
    for c in pairwise(m["axes"], must=m["must"]):
        c = dict(c, **m["fixed"])
        D = c["head_dim"]
        if c["dv"] == "dv=d":
            c["dv"] = D
        elif c["dv"] == "dv!=d":
            c["dv"] = OTHER_DV[D]
        name = "-".join([
            c["dtype"], f"rank{c['rank']}", c["heads"], f"d{D}", f"dv{c['dv']}",
            "causal" if c["causal"] else "noncausal",
            "softcap" if c["softcap"] else "nosoftcap",
            c["pattern"],
        ])
        cases[name] = dict(c, seed=zlib.crc32(name.encode()))
    return cases


@backend_cases("case", {backend: _matrix_cases(backend) for backend in MATRIX})
def test_matches_oracle(backend, case):
    B, Sq, Skv, lengths = MATRIX[backend]["patterns"][case["pattern"]]
    H, Hkv = HEADS[case["heads"]]
    D, Dv, rank = case["head_dim"], case["dv"], case["rank"]
    q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, Dv, DTYPES[case["dtype"]], lengths,
                             rank=rank, seed=case["seed"])
    kw = dict(is_causal=case["causal"], softcap=MATRIX[backend]["softcap"] if case["softcap"]
              else 0.0)
    if rank == 3:
        kw.update(num_heads=H, kv_num_heads=Hkv)
    out, lse = check_against_oracle(q, k, v, n, **kw)
    assert out.shape == q.shape[:-1] + (q.shape[-1] // D * Dv,)
    assert lse.shape == (B, H, Sq)


# --------------------------------------------------------------------------------------------
# Head sizes outside the matrix.
#
# CPU (no size limit): 1 to 300, each with Dv = D and a smaller Dv (odd for even D); causal for
# even D. GPU: the sizes between buckets (32, 96, 192) across key tiles; sizes off the
# multiples of 8 (the portable kernel) and Dv up to 256, short (split-KV) and long queries.
HEAD_SIZE_CASES = {
    "cpu": {
        f"{dt}-d{hd}-dv{dv}": _case(dt, (2, 9, 70, 4, 2, hd, dv), [70, 23], seed=hd,
                                    is_causal=hd % 2 == 0)
        for dt in ("f32", "bf16")
        for hd in (1, 3, 64, 80, 96, 128, 256, 300)
        for dv in sorted({hd, max(1, hd // 2 + 1)})
    },
    "gpu": {
        **{f"bf16-d{hd}-dv{OTHER_DV[hd]}": _case("bf16", (3, 40, 700, 4, 2, hd, OTHER_DV[hd]),
                                                 [700, 65, 0], seed=hd, is_causal=True)
           for hd in (32, 96, 192)},
        **{f"{dt}-d{D}-dv{Dv}-sq{Sq}": _case(dt, (3, Sq, 1100, 4, 2, D, Dv), [1100, 0, 77],
                                             seed=D * 1000 + Dv + Sq, is_causal=True,
                                             softcap=5.0)
           for dt in ("f16", "bf16")
           for D, Dv in ((1, 1), (3, 20), (36, 100), (250, 250), (20, 256))
           for Sq in (5, 70)},
    },
}


@backend_cases("case", HEAD_SIZE_CASES)
def test_head_sizes(backend, case):
    _check(case)


# --------------------------------------------------------------------------------------------
# Empty rows, padding, extreme scores.


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rows_without_keys_are_zero_with_lse_minus_inf(backend, dtype):
    B, Sq, Skv, H = 3, 12, 16, 4
    lengths = [0, 5, 16]
    q, k, v, n = make_inputs(B, Sq, Skv, H, 2, 8, 8, DTYPES[dtype], lengths, seed=1)
    for causal in (False, True):
        out, lse = jax_varlen.attention(q, k, v, n, is_causal=causal, return_lse=True)
        out, lse = np.asarray(out, np.float32), np.asarray(lse)
        # n = 0; under causal also the rows i < Sq - n (row i sees keys j <= i + n - Sq)
        empty = ~allowed_keys(Sq, Skv, lengths, causal).any(-1)  # [B, Sq]
        assert (out[empty] == 0).all()
        assert (lse.transpose(0, 2, 1)[empty] == -np.inf).all()
        assert np.isfinite(lse.transpose(0, 2, 1)[~empty]).all()
        assert np.isfinite(out).all()
        assert (np.abs(out[~empty]).sum(-1) > 0).all()


# GPU: across key tiles and head size 128, with GQA.
PADDING_CASES = {
    "cpu": {f"{dt}-{'causal' if c else 'noncausal'}":
            _case(dt, (3, 21, 90, 4, 1, 16, 24), [90, 0, 41], is_causal=c, softcap=1.5)
            for dt in DTYPES for c in (False, True)},
    "gpu": {f"{dt}-{'causal' if c else 'noncausal'}":
            _case(dt, (3, 65, 577, 4, 2, 128, 128), [577, 0, 130], is_causal=c, softcap=5.0)
            for dt in ("f32", "bf16") for c in (False, True)},
}


@backend_cases("case", PADDING_CASES)
def test_padding_never_leaks(backend, case):
    assert_padding_never_leaks(*case["shape"], DTYPES[case["dtype"]], case["lengths"],
                               **case["kw"])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_outputs_finite_for_extreme_scores(backend, dtype):
    """Large logits (scale 50) stay finite and still match the oracle."""
    q, k, v, n = make_inputs(2, 17, 80, 4, 2, 16, 16, DTYPES[dtype], [80, 37], seed=3)
    for causal in (False, True):
        out, lse = check_against_oracle(q, k, v, n, scale=50.0, is_causal=causal)
        assert np.isfinite(np.asarray(out, np.float32)).all()
        assert not np.isnan(np.asarray(lse)).any()


# --------------------------------------------------------------------------------------------
# Bitwise properties: determinism, batch invariance, padding extent.

# (dtype, B, Sq, Skv, H, Hkv, D, lengths). GPU: Skv = 2100 crosses two 1024-key splits (Sq 1
# and 7 in f16/bf16 take the split-KV path), head sizes of each bucket and one between.
DETERMINISM_CASES = {
    "cpu": {dt: (dt, 3, 130, 200, 4, 2, 32, [200, 77, 131]) for dt in DTYPES},
    "gpu": {f"{dt}-d{hd}-sq{Sq}": (dt, 4, Sq, 2100, 8, 2, hd, [2100, 577, 17, 1])
            for dt, hd, Sq in (("f32", 64, 333), ("f16", 96, 333), ("bf16", 128, 333),
                               ("bf16", 256, 333), ("bf16", 128, 1), ("f16", 64, 7))},
}


@backend_cases("case", DETERMINISM_CASES)
def test_bitwise_deterministic(backend, case):
    dtype, B, Sq, Skv, H, Hkv, D, lengths = case
    q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, D, DTYPES[dtype], lengths, seed=5)
    f = jax.jit(lambda *a: jax_varlen.attention(*a, is_causal=True, return_lse=True))
    first = jax.tree.map(bits, f(q, k, v, n))
    for _ in range(3):
        assert jax.tree.map(bits, f(q, k, v, n)) == first
    assert jax.tree.map(bits, jax_varlen.attention(q, k, v, n, is_causal=True,
                                                   return_lse=True)) == first


# (dtype, Sq, Skv, H, Hkv, D, Dv, lengths of the batch); the sequence under test is index 3.
# GPU: n = 1077 crosses a 1024-key split of the short-query path; its batch-mates are longer
# and shorter, so any batch-driven tiling or split choice would show.
BATCH_INVARIANCE_CASES = {
    "cpu": {dt: (dt, 37, 100, 4, 2, 32, 16, [100, 0, 3, 61, 99]) for dt in DTYPES},
    "gpu": {f"{dt}-d{hd}-sq{Sq}": (dt, Sq, 2100, 8, 2, hd, hd,
                                   [2100, 0, 3, 1077, 1099, 64, 128, 1])
            for dt, hd, Sq in (("f32", 64, 128), ("bf16", 128, 128), ("bf16", 128, 1),
                               ("f16", 64, 7), ("f32", 32, 1))},
}


@backend_cases("case", BATCH_INVARIANCE_CASES)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_batch_invariance(backend, case, causal):
    """A sequence alone gives the same bits as inside a bigger batch with other lengths."""
    dtype, Sq, Skv, H, Hkv, D, Dv, lengths = case
    dt, at = DTYPES[dtype], 3
    q1, k1, v1, n1 = make_inputs(1, Sq, Skv, H, Hkv, D, Dv, dt, [lengths[at]], seed=11)
    alone = jax_varlen.attention(q1, k1, v1, n1, is_causal=causal, return_lse=True)
    qb, kb, vb, nb = make_inputs(len(lengths), Sq, Skv, H, Hkv, D, Dv, dt, lengths, seed=12)
    qb, kb, vb = qb.at[at].set(q1[0]), kb.at[at].set(k1[0]), vb.at[at].set(v1[0])
    batched = jax_varlen.attention(qb, kb, vb, nb, is_causal=causal, return_lse=True)
    assert bits(batched[0][at]) == bits(alone[0][0])
    assert bits(batched[1][at]) == bits(alone[1][0])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_padding_extent_invariance(backend, dtype):
    """More padding (a larger Skv) around the same valid keys changes no bit."""
    Sq, n0 = 19, 45
    q, k, v, n = make_inputs(2, Sq, 50, 4, 4, 16, 16, DTYPES[dtype], [n0, 50], seed=13)
    ref = jax_varlen.attention(q, k, v, n, is_causal=True, return_lse=True)
    pad = jnp.full((2, 150, 4, 16), jnp.nan, q.dtype)
    k2 = jnp.concatenate([k, pad], axis=1)
    v2 = jnp.concatenate([v, pad], axis=1)
    out = jax_varlen.attention(q, k2, v2, n, is_causal=True, return_lse=True)
    assert bits(out[0]) == bits(ref[0]) and bits(out[1]) == bits(ref[1])


def test_int64_lengths(backend):
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


# Traced int32 lengths reach the kernels as they are (jax_varlen._api.check_lengths: no clip in
# XLA); every kernel clamps them into [0, Skv]. GPU: the split-KV path (Sq 4) and the one-pass
# path (Sq 37: the Hopper forward on sm_90), with their backward, across a 1024-key split.
TRACED_LENGTH_CASES = {
    "cpu": {dt: (dt, (4, 9, 70, 4, 2, 16, 16)) for dt in DTYPES},
    "gpu": {f"bf16-{path}": ("bf16", (4, Sq, 1100, 8, 2, 128, 128))
            for path, Sq in (("split", 4), ("one-pass", 37))},
}


@backend_cases("case", TRACED_LENGTH_CASES)
def test_out_of_range_traced_lengths_are_clamped(backend, case):
    """Traced int32 lengths outside [0, Skv] (INT32_MAX, -1, Skv + 1, INT32_MIN) give bit for
    bit the output, lse and gradients of the clamped ones (Skv, 0, Skv, 0)."""
    dtype, (B, Sq, Skv, H, Hkv, D, Dv) = case
    q, k, v, _ = make_inputs(B, Sq, Skv, H, Hkv, D, Dv, DTYPES[dtype], [Skv] * B, seed=23)
    w = jnp.asarray(np.random.default_rng(5).standard_normal((B, Sq, H, Dv)), jnp.float32)

    def loss(q, k, v, n):
        return (jax_varlen.attention(q, k, v, n, is_causal=True).astype(jnp.float32) * w).sum()

    fwd = jax.jit(lambda n: jax_varlen.attention(q, k, v, n, is_causal=True, return_lse=True))
    grads = jax.jit(lambda n: jax.grad(loss, argnums=(0, 1, 2))(q, k, v, n))
    bad = jnp.asarray([2**31 - 1, -1, Skv + 1, -2**31], jnp.int32)
    good = jnp.asarray([Skv, 0, Skv, 0], jnp.int32)
    assert [bits(x) for x in fwd(bad)] == [bits(x) for x in fwd(good)]
    assert [bits(x) for x in grads(bad)] == [bits(x) for x in grads(good)]


# --------------------------------------------------------------------------------------------
# Scale, rank 3, lse.

# Each case is checked causal, then with softcap. GPU: the kernels fold a positive scale into
# the exp; zero and negative scales take the transformed path, split-KV (Sq 4) and one-pass
# (Sq 37), across a 1024-key split.
SCALE_CASES = {
    "cpu": {f"{dt}-scale{s}": _case(dt, (2, 11, 66, 4, 2, 24, 24), [66, 29], seed=19, scale=s)
            for dt in DTYPES for s in (-0.7, 0.0, 0.05, 1.0, 3.7)},
    "gpu": {f"bf16-scale{s}-{path}": _case("bf16", (3, Sq, 1100, 8, 2, 128, 128),
                                           [1100, 0, 77], seed=31, scale=s)
            for s in (-0.7, 0.0) for path, Sq in (("split", 4), ("one-pass", 37))},
}


@backend_cases("case", SCALE_CASES)
def test_explicit_scale(backend, case):
    _check(dict(case, kw=dict(case["kw"], is_causal=True)))
    _check(dict(case, kw=dict(case["kw"], softcap=2.0)))


def test_default_scale_is_inverse_sqrt_head_dim(backend):
    q, k, v, n = make_inputs(2, 11, 30, 2, 2, 25, 8, jnp.float32, [30, 12], seed=23)
    a = jax_varlen.attention(q, k, v, n)
    b = jax_varlen.attention(q, k, v, n, scale=1 / np.sqrt(25))
    assert bits(a) == bits(b)


# Rank 3 with GQA and an explicit scale against the oracle (the CPU matrix has rank 3 too):
# across the CPU's 64-key block; on the GPU across key tiles at head size 64.
RANK3_CASES = {
    "cpu": {dt: _case(dt, (3, 13, 70, 8, 2, 16, 16), [70, 33, 5], seed=3) for dt in DTYPES},
    "gpu": {dt: _case(dt, (3, 37, 300, 8, 2, 64, 64), [300, 129, 5], seed=3) for dt in DTYPES},
}


@backend_cases("case", RANK3_CASES)
def test_rank3_and_explicit_scale(backend, case):
    _check(dict(case, kw=dict(num_heads=8, kv_num_heads=2, scale=0.3, is_causal=True)), rank=3)


def test_return_lse_shapes_and_rank3(backend):
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


# --------------------------------------------------------------------------------------------
# Empty extents: B = 0, Sq = 0, Skv = 0 are valid.

EMPTY = pytest.mark.parametrize(
    "B,Sq,Skv,lengths",
    [(2, 0, 16, [16, 3]), (2, 5, 0, [0, 0]), (0, 5, 16, []), (0, 0, 0, []), (2, 0, 0, [0, 0])],
    ids=["sq0", "skv0", "b0", "all0", "sq0-skv0"],
)


@EMPTY
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_empty_extents(backend, B, Sq, Skv, lengths, causal):
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
def test_empty_extents_match_oracle(backend, B, Sq, Skv, lengths):
    q, k, v, n = make_inputs(B, Sq, Skv, 4, 2, 8, 6, jnp.float32, lengths, seed=31)
    check_against_oracle(q, k, v, n, is_causal=True)
