"""``attention(..., nonpad_q_seqlen=...)``: per-sequence query counts on every backend.

Query rows ``i >= n_q[b]`` are padding: zero output, ``lse = -inf``, zero gradient, never read
(they hold NaN here, like the padded keys). Causal is tail-aligned on the real counts: query
``i`` sees key ``j`` iff ``j <= i + n_kv[b] - n_q[b]``. Checked against the float64 oracle
(``reference``, which builds its mask independently), against ``jax.nn.dot_product_attention``
for the right-padded causal prefill (equal counts), and under every transformation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_varlen
from conftest import (
    DTYPES,
    allowed_keys,
    assert_lse_close,
    assert_out_close,
    backend_cases,
    bits,
    make_inputs_q,
    oracle_hi,
    oracle_same_precision,
    real_rows,
)

_STATIC = ("nonpad_q_seqlen",)


def _check(q, k, v, n, n_q, **kw):
    """Ours (with lse) against the float64 oracle; padded rows exactly zero and -inf."""
    out, lse = jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=n_q, return_lse=True, **kw)
    hi_out, hi_lse = oracle_hi(q, k, v, n, nonpad_q_seqlen=np.asarray(n_q), return_lse=True, **kw)
    cpu = jax.devices("cpu")[0]
    base = None
    if q.dtype != jnp.float32 or all(d.platform == "cpu" for d in q.devices()):
        args = [jax.device_put(np.asarray(x), cpu) for x in (q, k, v, n, n_q)]
        base = oracle_same_precision(*args[:4], nonpad_q_seqlen=args[4], return_lse=True, **kw)[0]
    assert out.shape == q.shape[:3] + (v.shape[3],) and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_out_close(out, hi_out, base, q.dtype)
    assert_lse_close(lse, hi_lse)
    pad_rows = ~real_rows(n_q, q.shape[1])
    assert (np.asarray(out, np.float32)[pad_rows] == 0).all(), "padded query rows must be zero"
    assert (np.asarray(lse).transpose(0, 2, 1)[pad_rows] == -np.inf).all()
    return out, lse


# id -> (B, Sq, Skv, H, Hkv, D, Dv, n_kv, n_q, kw). The CPU's blocks are 64 rows and keys; the
# GPU cases also reach the split-KV path (Sq <= 16), the one-pass kernels and, at bf16/f16 and
# D in {64, 128, 256}, the Hopper kernels.
_CPU = {
    "prefill-causal": (3, 16, 16, 4, 2, 8, 8, [16, 9, 3], [16, 9, 3], dict(is_causal=True)),
    "prefill-noncausal": (3, 16, 16, 4, 4, 8, 6, [16, 9, 3], [16, 9, 3], {}),
    "q-shorter-than-kv-causal": (3, 20, 70, 4, 1, 16, 16, [70, 33, 5], [20, 7, 1],
                                 dict(is_causal=True)),
    "q-longer-than-kv-causal": (2, 40, 24, 4, 2, 16, 16, [10, 24], [25, 33],
                                dict(is_causal=True)),
    "zeros": (4, 9, 13, 2, 2, 8, 8, [0, 13, 5, 0], [4, 0, 9, 0], dict(is_causal=True)),
    "softcap-blocks": (2, 130, 150, 2, 1, 32, 16, [150, 77], [129, 65],
                       dict(is_causal=True, softcap=2.0)),
}
_GPU = {
    "decode": ("bf16", 4, 1, 300, 8, 2, 128, 128, [300, 1, 0, 129], [1, 1, 1, 0],
               dict(is_causal=True)),
    "split-kv-f16": ("f16", 3, 12, 700, 4, 1, 64, 64, [700, 40, 3], [12, 5, 0],
                     dict(is_causal=True)),
    "prefill-d128": ("bf16", 4, 300, 300, 4, 2, 128, 128, [300, 129, 1, 64],
                     [300, 129, 1, 64], dict(is_causal=True)),
    "prefill-d64-softcap": ("bf16", 3, 200, 200, 4, 4, 64, 64, [200, 65, 130], [200, 65, 130],
                            dict(is_causal=True, softcap=5.0)),
    "chunks-d256": ("bf16", 3, 150, 400, 2, 1, 256, 256, [400, 180, 0], [150, 17, 0],
                    dict(is_causal=True)),
    "noncausal-f32": ("f32", 3, 70, 90, 4, 2, 64, 32, [90, 7, 50], [3, 70, 41], {}),
    "sm80-d96": ("bf16", 2, 140, 140, 4, 2, 96, 96, [140, 71], [140, 71], dict(is_causal=True)),
}


@backend_cases("case", {
    "cpu": {name: ("f32",) + c for name, c in _CPU.items()}
           | {"prefill-causal-bf16": ("bf16",) + _CPU["prefill-causal"]},
    "gpu": _GPU | {"cpu-" + name: ("bf16",) + c for name, c in _CPU.items()},
})
def test_forward_matches_oracle(backend, case):
    dtype, B, Sq, Skv, H, Hkv, D, Dv, n_kv, n_q, kw = case
    q, k, v, n, nq = make_inputs_q(B, Sq, Skv, H, Hkv, D, Dv, DTYPES[dtype], n_kv, n_q)
    _check(q, k, v, n, nq, **kw)


def _grads(q, k, v, n, n_q, d_out, reference=False, **kw):
    """d(sum(out * d_out))/d(q, k, v), ours or the oracle's (float32, highest precision)."""
    if reference:
        f = functools.partial(jax_varlen.reference, nonpad_q_seqlen=n_q, **kw)
    else:
        f = functools.partial(jax_varlen.attention, nonpad_q_seqlen=n_q, **kw)

    def loss(q, k, v):
        return jnp.sum(f(q, k, v, n).astype(jnp.float32) * d_out)

    with jax.default_matmul_precision("highest"):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


_GRAD_RTOL = {jnp.float32: 1e-4, jnp.float16: 5e-3, jnp.bfloat16: 4e-2}


@backend_cases("case", {
    "cpu": {name: ("f32",) + _CPU[name] for name in
            ("prefill-causal", "q-shorter-than-kv-causal", "q-longer-than-kv-causal", "zeros",
             "softcap-blocks")},
    "gpu": {name: _GPU[name] for name in
            ("prefill-d128", "prefill-d64-softcap", "chunks-d256", "noncausal-f32", "sm80-d96")}
           | {"f32-zeros": ("f32",) + _CPU["zeros"]},
})
def test_gradients_match_oracle(backend, case):
    """Gradients against the oracle's; padded query rows (NaN in query and d_out) and padded
    keys get exactly zero gradient and never reach the real ones."""
    dtype, B, Sq, Skv, H, Hkv, D, Dv, n_kv, n_q, kw = case
    dtype = DTYPES[dtype]
    q, k, v, n, nq = make_inputs_q(B, Sq, Skv, H, Hkv, D, Dv, dtype, n_kv, n_q, seed=3)
    rng = np.random.default_rng(4)
    d_out = rng.standard_normal((B, Sq, H, Dv)).astype(np.float32)
    real = real_rows(n_q, Sq)
    d_out_nan = jnp.asarray(np.where(real[:, :, None, None], d_out, np.nan))
    ours = _grads(q, k, v, n, nq, d_out_nan, **kw)
    # The oracle: padding zeroed (its where() would pass NaN cotangents through otherwise).
    q0, k0, v0, _, _ = make_inputs_q(B, Sq, Skv, H, Hkv, D, Dv, dtype, n_kv, n_q, seed=3, pad=0.0)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        ref = _grads(*(jax.device_put(np.asarray(x, np.float32), cpu) for x in (q0, k0, v0)),
                     jax.device_put(np.asarray(n), cpu), jax.device_put(np.asarray(nq), cpu),
                     jnp.asarray(np.where(real[:, :, None, None], d_out, 0.0)), reference=True,
                     **kw)
    key_pad = np.arange(Skv)[None, :] >= np.asarray(n_kv)[:, None]
    for name, got, want in zip(("d_query", "d_key", "d_value"), ours, ref):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.isfinite(got).all(), f"{name} has non-finite entries"
        scale = max(float(np.abs(want).max()), 1e-30)
        err = float(np.abs(got - want).max())
        assert err <= _GRAD_RTOL[dtype] * scale, f"{name}: {err:.3g} > {_GRAD_RTOL[dtype]} * {scale:.3g}"
    assert (np.asarray(ours[0], np.float32)[~real] == 0).all(), "padded query rows: d_query != 0"
    for g in ours[1:]:
        assert (np.asarray(g, np.float32)[key_pad] == 0).all(), "padded keys: gradient != 0"


@backend_cases("case", {
    "cpu": {"prefill": (3, 16, 4, 2, 8, [16, 9, 3])},
    "gpu": {"prefill-d128": (4, 512, 8, 2, 128, [512, 300, 17, 129]),
            "prefill-d64": (3, 256, 4, 4, 64, [1, 256, 100])},
})
def test_right_padded_causal_prefill_equals_jax_nn(backend, case):
    """The new user's case: equal counts, causal, the real rows equal to jax.nn with
    query_seq_lengths = key_value_seq_lengths (float32 at highest precision: an independent
    implementation of the same mask)."""
    B, S, H, Hkv, D, lens = case
    q, k, v, n, nq = make_inputs_q(B, S, S, H, Hkv, D, D, jnp.float32, lens, lens, pad=0.0)
    with jax.default_matmul_precision("highest"):
        ours = jax_varlen.attention(q, k, v, lens, nonpad_q_seqlen=lens, is_causal=True)
        theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=nq,
                                              key_value_seq_lengths=n)
    real = real_rows(lens, S)
    err = np.abs(np.asarray(ours) - np.asarray(theirs))[real].max()
    assert err <= 2e-5, err
    # Without the query counts the short sequences' rows are shifted (tail alignment): the
    # keyword is what makes this case right, so the check above can fail.
    shifted = jax_varlen.attention(q, k, v, lens, is_causal=True)
    assert np.abs(np.asarray(shifted) - np.asarray(theirs))[real].max() > 1e-2


@backend_cases("case", {
    "cpu": {"f32": ("f32", 3, 70, 90, 4, 2, 32, [90, 7, 50], [3, 70, 41])},
    "gpu": {"bf16-d128": ("bf16", 3, 300, 300, 4, 2, 128, [300, 129, 7], [300, 129, 7]),
            "bf16-decode": ("bf16", 3, 4, 600, 4, 1, 64, [600, 129, 7], [4, 1, 0])},
})
def test_deterministic_and_padding_bits_never_matter(backend, case):
    """Two runs give the same bits, and so do other padding values (query rows and keys) and
    another sequence's lengths in the batch (batch invariance of each sequence's result)."""
    dtype, B, Sq, Skv, H, Hkv, D, n_kv, n_q = case
    dtype = DTYPES[dtype]
    f = jax.jit(functools.partial(jax_varlen.attention, is_causal=True, return_lse=True))
    results = []
    for pad in (np.nan, np.inf, 0.0, np.nan):
        q, k, v, n, nq = make_inputs_q(B, Sq, Skv, H, Hkv, D, D, dtype, n_kv, n_q, seed=5, pad=pad)
        out, lse = f(q, k, v, n, nonpad_q_seqlen=nq)
        results.append((bits(out), bits(lse)))
    assert all(r == results[0] for r in results)
    # Sequence 0 alone (B = 1) gives the bits it gives inside the batch.
    q, k, v, n, nq = make_inputs_q(B, Sq, Skv, H, Hkv, D, D, dtype, n_kv, n_q, seed=5)
    out, lse = f(q, k, v, n, nonpad_q_seqlen=nq)
    out1, lse1 = f(q[:1], k[:1], v[:1], n[:1], nonpad_q_seqlen=nq[:1])
    assert bits(out1) == bits(out[:1]) and bits(lse1) == bits(lse[:1])


@backend_cases("case", {"cpu": {"f32": jnp.float32}, "gpu": {"bf16": jnp.bfloat16}})
def test_full_counts_equal_no_counts(backend, case):
    """nonpad_q_seqlen = Sq everywhere is today's behaviour (the same oracle result)."""
    q, k, v, n, nq = make_inputs_q(3, 130, 140, 4, 2, 64, 64, case, [140, 65, 0], [130] * 3, pad=0.0)
    with_counts = jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq, is_causal=True)
    without = jax_varlen.attention(q, k, v, n, is_causal=True)
    tol = 1e-5 if case == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(with_counts, np.float32), np.asarray(without, np.float32),
                               atol=tol, rtol=0)


# --------------------------------------------------------------------------------------------
# Transformations.

_B, _SQ, _SKV, _H, _HKV, _D = 3, 12, 20, 4, 2, 8


def _stacked(seed, m=2, shared_kv=False, shared_q=False, pad=np.nan):
    """m stacked batches; n_kv and n_q differ per element unless ``shared_*`` (an unbatched
    count must fit every element's padding)."""
    rng = np.random.default_rng(seed)
    n_kv = rng.integers(0, _SKV + 1, (m, _B))
    n_q = rng.integers(0, _SQ + 1, (m, _B))
    n_kv[0, 0], n_q[0, 0] = _SKV, _SQ
    if shared_kv:
        n_kv[:] = n_kv[0]
    if shared_q:
        n_q[:] = n_q[0]
    parts = [make_inputs_q(_B, _SQ, _SKV, _H, _HKV, _D, _D, jnp.float32, n_kv[e], n_q[e],
                     seed=seed + e, pad=pad) for e in range(m)]
    return [jnp.stack(x) for x in zip(*parts)]


@pytest.mark.parametrize("batched", ["both", "q-only", "kv-only", "lengths-only"])
def test_vmap(backend, batched):
    # Unbatched counts are shared by both elements; unbatched arrays hold finite padding (the
    # other element's counts may reach past this element's real rows).
    q, k, v, n, nq = _stacked(11, shared_kv=batched == "q-only", shared_q=batched == "kv-only",
                              pad=0.0 if batched == "lengths-only" else np.nan)
    axes = {"both": (0, 0, 0, 0, 0), "q-only": (0, 0, 0, None, 0),
            "kv-only": (0, 0, 0, 0, None), "lengths-only": (None, None, None, 0, 0)}[batched]
    args = [x if a is not None else x[0] for x, a in zip((q, k, v, n, nq), axes)]

    def f(q, k, v, n, nq):
        return jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq, is_causal=True,
                                    return_lse=True)

    out, lse = jax.jit(jax.vmap(f, in_axes=axes))(*args)
    for e in range(2):
        one = [x[e] if a is not None else x for x, a in zip(args, axes)]
        want_out, want_lse = f(*one)
        np.testing.assert_allclose(out[e], want_out, atol=1e-6, rtol=0)
        np.testing.assert_array_equal(np.isinf(lse[e]), np.isinf(want_lse))
        np.testing.assert_allclose(np.where(np.isinf(want_lse), 0, lse[e]),
                                   np.where(np.isinf(want_lse), 0, want_lse), atol=1e-5, rtol=0)
        hi = oracle_hi(*one[:4], nonpad_q_seqlen=np.asarray(one[4]), is_causal=True)
        assert_out_close(out[e], hi, None, jnp.float32)


def test_grad_under_vmap_and_jit_with_traced_counts(backend):
    q, k, v, n, nq = _stacked(12)

    def loss(q, k, v, n, nq):
        return jnp.sum(jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq, is_causal=True) ** 2)

    def ref_loss(q, k, v, n, nq):
        return jnp.sum(jax_varlen.reference(q, k, v, n, nonpad_q_seqlen=nq, is_causal=True) ** 2)

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, n, nq)
    q0, k0, v0 = (jnp.where(jnp.isnan(x), 0, x) for x in (q, k, v))
    with jax.default_matmul_precision("highest"):
        ref = jax.vmap(jax.grad(ref_loss, argnums=(0, 1, 2)))(q0, k0, v0, n, nq)
    for got, want in zip(grads, ref):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(got, want, atol=2e-5 * float(jnp.abs(want).max()), rtol=0)


def test_lengths_as_lists_and_numpy_arrays(backend):
    q, k, v, n, nq = make_inputs_q(_B, _SQ, _SKV, _H, _HKV, _D, _D, jnp.float32, [20, 5, 0], [12, 3, 7])
    want = jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq, is_causal=True)
    for lists in (([20, 5, 0], [12, 3, 7]), (np.array([20, 5, 0]), np.array([12, 3, 7], np.int64)),
                  ((20, 5, 0), (12, 3, 7))):
        got = jax_varlen.attention(q, k, v, lists[0], nonpad_q_seqlen=lists[1], is_causal=True)
        assert bits(got) == bits(want)


@pytest.mark.parametrize("bad, what", [([13, 3, 7], r"nonpad_q_seqlen\[0\] = 13 is out of range: "
                                                    r"expected 0 <= n <= Sq = 12"),
                                       ([12, -1, 7], r"nonpad_q_seqlen\[1\] = -1 is out of range")])
def test_concrete_out_of_range_counts_raise(bad, what):
    q, k, v, n, _ = make_inputs_q(_B, _SQ, _SKV, _H, _HKV, _D, _D, jnp.float32, [20, 5, 0], [1, 1, 1])
    with pytest.raises(ValueError, match=what):
        jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=bad)
    with pytest.raises(ValueError, match=what):  # closed over under jit: still concrete
        jax.jit(lambda q: jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=np.asarray(bad)))(q)


@pytest.mark.parametrize("bad, match", [
    (jnp.zeros((3,), jnp.float32), TypeError),
    (jnp.zeros((2,), jnp.int32), ValueError),
    (jnp.zeros((3, 1), jnp.int32), ValueError),
])
def test_bad_count_arrays_raise_at_trace_time(bad, match):
    q, k, v, n, _ = make_inputs_q(_B, _SQ, _SKV, _H, _HKV, _D, _D, jnp.float32, [20, 5, 0], [1, 1, 1])
    with pytest.raises(match, match="nonpad_q_seqlen"):
        jax.jit(lambda nq: jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq)).trace(bad)


def test_checkify_reports_traced_out_of_range_counts(backend):
    q, k, v, n, _ = make_inputs_q(_B, _SQ, _SKV, _H, _HKV, _D, _D, jnp.float32, [20, 5, 0], [1, 1, 1])

    def f(nq):
        return jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq, is_causal=True)

    checked = jax.jit(checkify.checkify(f))
    err, _ = checked(jnp.asarray([12, 3, 7], jnp.int32))
    assert err.get() is None
    err, out = checked(jnp.asarray([12, 99, 7], jnp.int32))
    assert "nonpad_q_seqlen must lie in [0, Sq=12]" in err.get()
    # Outside checkify the count is clamped: 99 acts as Sq.
    clamped = f(jnp.asarray([12, 12, 7], jnp.int32))
    np.testing.assert_allclose(out, clamped, atol=1e-6, rtol=0)
    err, _ = jax.jit(checkify.checkify(lambda n: jax_varlen.attention(
        q, k, v, n, nonpad_q_seqlen=jnp.asarray([1, 1, 1]))))(jnp.asarray([21, 0, 0]))
    assert "nonpad_kv_seqlen must lie in [0, Skv=20]" in err.get()


def test_export_round_trip(backend):
    pytest.importorskip("flatbuffers")
    from conftest import EXPORT_PLATFORM

    q, k, v, n, nq = make_inputs_q(_B, _SQ, _SKV, _H, _HKV, _D, _D, jnp.float32, [20, 5, 0], [12, 3, 7])

    def f(q, k, v, n, nq):
        return jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq, is_causal=True)

    exp = jax.export.export(jax.jit(f), platforms=[EXPORT_PLATFORM[backend]],
                            disabled_checks=jax_varlen.export_disabled_checks())(q, k, v, n, nq)
    again = jax.export.deserialize(exp.serialize())
    assert bits(again.call(q, k, v, n, nq)) == bits(jax.jit(f)(q, k, v, n, nq))


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_reference_matches_a_loop_from_the_contract(causal):
    """The oracle itself, against a plain loop over rows on the contract's mask (conftest's
    allowed_keys): row i of sequence b is real iff i < n_q[b], and sees key j iff j < n_kv[b]
    (and, causal, j <= i + n_kv[b] - n_q[b])."""
    B, Sq, Skv, H, Hkv, D = 4, 6, 9, 2, 1, 4
    n_kv, n_q = [9, 4, 0, 2], [6, 2, 3, 5]
    q, k, v, n, nq = make_inputs_q(B, Sq, Skv, H, Hkv, D, D, jnp.float32, n_kv, n_q, seed=9)
    out, lse = jax_varlen.reference(q, k, v, n, nonpad_q_seqlen=nq, is_causal=causal,
                                    return_lse=True)
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    allowed = allowed_keys(Sq, Skv, n_kv, causal, n_q=n_q)
    for b in range(B):
        for h in range(H):
            for i in range(Sq):
                keys = np.flatnonzero(allowed[b, i])
                if keys.size == 0:
                    assert (np.asarray(out[b, i, h]) == 0).all() and lse[b, h, i] == -np.inf
                    continue
                s = np.array([q[b, i, h] @ k[b, j, h // (H // Hkv)] for j in keys]) / np.sqrt(D)
                p = np.exp(s - s.max())
                want = (p[:, None] * v[b, keys, h // (H // Hkv)]).sum(0) / p.sum()
                np.testing.assert_allclose(out[b, i, h], want, atol=1e-5, rtol=0)
                np.testing.assert_allclose(lse[b, h, i], s.max() + np.log(p.sum()), atol=1e-5)
