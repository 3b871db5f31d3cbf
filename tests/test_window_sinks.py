"""``local_window_size`` and ``sinks`` (issue 34) on every backend.

The window (jax.nn's convention at each query's tail-aligned position ``p = i + n_kv - n_q``:
key ``j`` allowed iff ``p - left <= j <= p + right``, with the causal and length rules) is in the
CPU loops, forward and backward; the CUDA kernels do not take it yet, so its GPU cases are
strict xfails (they fail loudly once the kernels take it). ``sinks`` (one logit per query head
in every real row's softmax denominator) is a composition on the primitive's results, so its
cases run on every backend. Everything is checked against the float64 oracle
(``jax_varlen.reference``, which builds its mask independently), with NaN in the padding.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_varlen
from conftest import (DTYPES, EXPORT_PLATFORM, allowed_keys, assert_lse_close, assert_out_close,
                      backend_cases, bits, make_inputs_q, make_packed, real_rows)

_UNBOUNDED = 10**9  # a window side past every key: that side unbounded


def _sinks(H, seed=0, scale=2.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(H), jnp.float32)


_STATIC = ("is_causal", "softcap", "local_window_size", "return_lse")


@functools.cache
def _jit_reference():
    return jax.jit(jax_varlen.reference, static_argnames=_STATIC)


def _oracle_hi(q, k, v, n, n_q=None, sinks=None, **kw):
    """The oracle in float64 on the CPU (inputs upcast exactly); numpy (out, lse)."""
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        args = [jax.device_put(np.asarray(x, np.float64), cpu) for x in (q, k, v)]
        extra = dict(nonpad_q_seqlen=None if n_q is None else jax.device_put(np.asarray(n_q), cpu),
                     sinks=None if sinks is None else jax.device_put(np.asarray(sinks, np.float64),
                                                                     cpu))
        out, lse = _jit_reference()(*args, jax.device_put(np.asarray(n), cpu), return_lse=True,
                                    **extra, **kw)
        return np.asarray(out, np.float64), np.asarray(lse, np.float64)


def _check(q, k, v, n, n_q=None, sinks=None, **kw):
    """Ours (with lse) against the float64 oracle; padded query rows zero with lse -inf."""
    out, lse = jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=n_q, sinks=sinks,
                                    return_lse=True, **kw)
    hi_out, hi_lse = _oracle_hi(q, k, v, n, n_q, sinks, **kw)
    assert_out_close(out, hi_out, None, q.dtype)
    assert_lse_close(lse, hi_lse)
    pad = ~real_rows(n_q, q.shape[1], q.shape[0])
    assert (np.asarray(out, np.float32)[pad] == 0).all(), "padded query rows must be zero"
    assert (np.asarray(lse).transpose(0, 2, 1)[pad] == -np.inf).all()
    return out, lse


# --------------------------------------------------------------------------------------------
# The window: forward against the oracle.

# id -> (dtype, B, Sq, Skv, H, Hkv, D, Dv, n_kv, n_q, kw). 64-row and 64-key blocks on the CPU:
# windows narrower and wider than a block, rows whose window starts past the block's first key
# and blocks whose keys a window skips entirely.
_WINDOW = {
    "int-noncausal": ("f32", 3, 150, 200, 4, 2, 16, 16, [200, 77, 0], None,
                      dict(local_window_size=5)),
    "int-causal": ("f32", 3, 150, 200, 4, 2, 16, 16, [200, 77, 0], None,
                   dict(local_window_size=40, is_causal=True)),
    "pair-noncausal": ("f32", 2, 130, 260, 4, 4, 16, 8, [260, 131], None,
                       dict(local_window_size=(70, 3))),
    "pair-causal-softcap": ("f32", 2, 130, 260, 4, 1, 16, 16, [260, 131], None,
                            dict(local_window_size=(100, 7), is_causal=True, softcap=3.0)),
    "zero-zero": ("f32", 2, 70, 90, 2, 1, 8, 8, [90, 33], None, dict(local_window_size=(0, 0))),
    "zero-zero-causal": ("f32", 2, 70, 90, 2, 1, 8, 8, [90, 33], None,
                         dict(local_window_size=0, is_causal=True)),
    "left-only": ("f32", 2, 140, 140, 4, 2, 16, 16, [140, 65], None,
                  dict(local_window_size=(17, _UNBOUNDED))),
    "right-only": ("f32", 2, 140, 140, 4, 2, 16, 16, [140, 65], None,
                   dict(local_window_size=(_UNBOUNDED, 9))),
    "prefill-q-counts": ("f32", 3, 150, 150, 4, 2, 16, 16, [150, 90, 3], [150, 90, 3],
                         dict(local_window_size=(64, 0), is_causal=True)),
    "q-counts-noncausal": ("f32", 3, 100, 170, 4, 2, 16, 16, [170, 60, 0], [40, 100, 5],
                           dict(local_window_size=(30, 12))),
    "bf16-causal": ("bf16", 2, 150, 200, 4, 2, 64, 64, [200, 129], None,
                    dict(local_window_size=(50, 0), is_causal=True)),
}
_WINDOW_GPU = {name: _WINDOW[name] for name in ("int-causal", "prefill-q-counts", "bf16-causal")}


@backend_cases("case", {"cpu": _WINDOW, "gpu": _WINDOW_GPU})
def test_window_forward_matches_oracle(backend, case):
    dtype, B, Sq, Skv, H, Hkv, D, Dv, n_kv, n_q, kw = case
    q, k, v, n, nq = make_inputs_q(B, Sq, Skv, H, Hkv, D, Dv, DTYPES[dtype], n_kv, n_q)
    _check(q, k, v, n, nq, **kw)


def test_window_changes_the_result():
    """The cases above can fail: a window that cuts keys gives another result than none."""
    q, k, v, n, _ = make_inputs_q(2, 70, 90, 2, 1, 8, 8, jnp.float32, [90, 33], pad=0.0)
    full = jax_varlen.attention(q, k, v, n, is_causal=True)
    windowed = jax_varlen.attention(q, k, v, n, is_causal=True, local_window_size=(10, 0))
    assert float(jnp.abs(full - windowed).max()) > 1e-2
    for wide in ((90, 0), (2**70, 2**70)):  # past every key (and past int64): no window
        assert bits(jax_varlen.attention(q, k, v, n, is_causal=True,
                                         local_window_size=wide)) == bits(full)


_SIDES = [None, 0, 1, 2, 3]


@functools.partial(jax.jit, static_argnums=0)
def _forward_and_both_passes(attn, q0, k_onehot, v_eye, v_rand, d_out):
    """One program: ``attn``'s output on (q0, one-hot keys, identity values), the jacobian of
    its column 0 in the values ([B, S, B, S, 1, D]: the d_value pass) and the gradient of
    sum(out * d_out) in the query (the d_query pass)."""
    out = attn(q0, k_onehot, v_eye)
    jac = jax.jacrev(lambda v: attn(q0, k_onehot, v)[:, :, 0, 0])(v_eye)
    d_q = jax.grad(lambda q: jnp.sum(attn(q, k_onehot, v_rand) * d_out))(q0)
    return out, jac, d_q


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_mask_bounds_exhaustively(causal):
    """Every window side in {unbounded, 0..3}, every query count m and key count n in 0..8
    (one sequence each, Sq = Skv = 8): the forward's allowed keys (mask.h key_range of each row
    and row block) and the backward's (row_range of each key block for d_value, key_range for
    d_query) are exactly the contract's. With all scores equal and value the identity, out[i]
    is the uniform distribution over row i's allowed keys; the jacobian of out in value is
    P[i, j] (the d_value pass); d_query with one-hot keys shows dS[i, j] (the d_query pass;
    checked on rows with two keys or more: a row with one has dS = 0 up to rounding)."""
    S, D = 8, 8
    counts = list(itertools.product(range(S + 1), range(S + 1)))  # (n, m)
    n_kv = np.array([c[0] for c in counts], np.int32)
    n_q = np.array([c[1] for c in counts], np.int32)
    B = len(counts)
    q0 = jnp.zeros((B, S, 1, D))
    k_onehot = jnp.broadcast_to(jnp.eye(S, D)[None, :, None], (B, S, 1, D))
    v_eye = jnp.broadcast_to(jnp.eye(S, D)[None, :, None], (B, S, 1, D))
    rng = np.random.default_rng(0)
    d_out = jnp.asarray(rng.standard_normal((B, S, 1, D)), jnp.float32)
    v_rand = jnp.asarray(rng.standard_normal((B, S, 1, D)), jnp.float32)
    for left, right in itertools.product(_SIDES, _SIDES):
        window = (_UNBOUNDED if left is None else left, _UNBOUNDED if right is None else right)
        attn = functools.partial(jax_varlen.attention, nonpad_kv_seqlen=n_kv, nonpad_q_seqlen=n_q,
                                 is_causal=causal, local_window_size=window)
        want = allowed_keys(S, S, n_kv, causal, n_q=n_q, window=(left, right))
        what = f"window ({left}, {right})"
        out, jac, d_q = (np.asarray(x) for x in _forward_and_both_passes(attn, q0, k_onehot,
                                                                          v_eye, v_rand, d_out))
        out = out[:, :, 0, :S]
        np.testing.assert_array_equal(out > 0, want, err_msg=f"forward, {what}")
        counts_per_row = want.sum(-1, keepdims=True)
        np.testing.assert_allclose(out, np.where(want, 1 / np.maximum(counts_per_row, 1), 0),
                                   rtol=1e-6, err_msg=f"forward weights, {what}")
        p = jac[np.arange(B), :, np.arange(B), :, 0, 0]  # [B, S, S]
        np.testing.assert_array_equal(p > 0, want, err_msg=f"d_value pass, {what}")
        ds = d_q[:, :, 0, :S]
        assert not (ds != 0)[~want].any(), f"d_query pass, {what}: a disallowed key counted"
        np.testing.assert_array_equal((ds != 0)[counts_per_row[..., 0] >= 2],
                                      want[counts_per_row[..., 0] >= 2],
                                      err_msg=f"d_query pass, {what}")


# --------------------------------------------------------------------------------------------
# The window: gradients, NaN, empty rows, determinism.

_GRAD_RTOL = {jnp.float32: 1e-4, jnp.bfloat16: 4e-2}


def _grads(fn, q, k, v, n, n_q, d_out, sinks=None, d_lse=None, **kw):
    """d/d(q, k, v[, sinks]) of sum(out * d_out) (+ sum(lse * d_lse)), float32, highest."""
    def loss(q, k, v, s):
        out, lse = fn(q, k, v, n, nonpad_q_seqlen=n_q, sinks=s, return_lse=True, **kw)
        total = jnp.sum(out.astype(jnp.float32) * d_out)
        if d_lse is not None:
            total += jnp.sum(jnp.where(jnp.isinf(lse), 0.0, lse) * d_lse)
        return total

    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    with jax.default_matmul_precision("highest"):
        return jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, sinks)


def _check_grads(dtype, B, Sq, Skv, H, Hkv, D, Dv, n_kv, n_q, kw, sinks=False, packed=False):
    """Ours (NaN in padded keys, padded query rows and their d_out) against the oracle's
    (padding zeroed, on the CPU); padding gets exactly zero gradient."""
    q, k, v, n, nq = make_inputs_q(B, Sq, Skv, H, Hkv, D, Dv, dtype, n_kv, n_q, seed=3)
    rng = np.random.default_rng(4)
    real = real_rows(n_q, Sq, B)
    d_out = rng.standard_normal((B, Sq, H, Dv)).astype(np.float32)
    d_lse = rng.standard_normal((B, H, Sq)).astype(np.float32)
    s = _sinks(H) if sinks else None
    ours = _grads(jax_varlen.attention, q, k, v, n, nq,
                  jnp.asarray(np.where(real[:, :, None, None], d_out, np.nan)), s, d_lse, **kw)
    q0, k0, v0, _, _ = make_inputs_q(B, Sq, Skv, H, Hkv, D, Dv, dtype, n_kv, n_q, seed=3, pad=0.0)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        put = lambda x: None if x is None else jax.device_put(np.asarray(x, np.float32), cpu)  # noqa: E731
        ref = _grads(jax_varlen.reference, put(q0), put(k0), put(v0),
                     jax.device_put(np.asarray(n), cpu),
                     None if nq is None else jax.device_put(np.asarray(nq), cpu),
                     jnp.asarray(np.where(real[:, :, None, None], d_out, 0.0)), put(s),
                     jnp.asarray(d_lse), **kw)
    names = ("d_query", "d_key", "d_value", "d_sinks")
    for name, got, want in zip(names, ours, ref):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.isfinite(got).all(), f"{name} has non-finite entries"
        scale = max(float(np.abs(want).max()), 1e-30)
        err = float(np.abs(got - want).max())
        assert err <= _GRAD_RTOL[dtype] * scale, f"{name}: {err:.3g} > {_GRAD_RTOL[dtype]} * {scale:.3g}"
    key_pad = np.arange(Skv)[None, :] >= np.asarray(n_kv)[:, None]
    assert (np.asarray(ours[0], np.float32)[~real] == 0).all(), "padded query rows: d_query != 0"
    for g in ours[1:3]:
        assert (np.asarray(g, np.float32)[key_pad] == 0).all(), "padded keys: gradient != 0"
    return ours


_WINDOW_GRADS = {name: _WINDOW[name] for name in
                 ("int-noncausal", "pair-causal-softcap", "zero-zero", "left-only", "right-only",
                  "prefill-q-counts", "q-counts-noncausal")}


@backend_cases("case", {"cpu": _WINDOW_GRADS,
                        "gpu": {"prefill-q-counts": _WINDOW["prefill-q-counts"]}})
def test_window_gradients_match_oracle(backend, case):
    dtype, B, Sq, Skv, H, Hkv, D, Dv, n_kv, n_q, kw = case
    _check_grads(DTYPES[dtype], B, Sq, Skv, H, Hkv, D, Dv, n_kv, n_q, kw)


@pytest.mark.parametrize("where", ["key", "value"])
def test_nan_in_a_key_outside_the_window_never_reaches_a_row(where):
    """A NaN in a real key (value) row j: the rows whose window leaves out j, on either side,
    are finite and equal to the oracle's (with j finite: they never see it), forward and
    d_query; the rows that allow it are NaN (a key) or NaN in that column (a value)."""
    B, Sq, Skv, H, Hkv, D = 1, 130, 130, 2, 1, 16
    window = (20, 6)
    q, k, v, n, _ = make_inputs_q(B, Sq, Skv, H, Hkv, D, D, jnp.float32, [130], pad=0.0, seed=5)
    j = 70
    bad_k, bad_v = np.array(k), np.array(v)
    (bad_k if where == "key" else bad_v)[0, j, 0, 1] = np.nan
    bad_k, bad_v = jnp.asarray(bad_k), jnp.asarray(bad_v)
    allowed = allowed_keys(Sq, Skv, [130], False, n_q=[Sq], window=window)[0]
    sees = allowed[:, j]
    assert sees.any() and (~sees[:j]).any() and (~sees[j:]).any()  # rows on both sides miss j
    f = functools.partial(jax_varlen.attention, local_window_size=window)
    out = np.asarray(f(q, bad_k, bad_v, n))
    want = np.asarray(f(q, k, v, n))
    np.testing.assert_allclose(out[0, ~sees], want[0, ~sees], atol=1e-6, rtol=0)
    if where == "key":
        assert np.isnan(out[0, sees]).all()
    else:
        assert np.isnan(out[0, sees, :, 1]).all()
    d_out = jnp.ones_like(q)
    d_q = lambda k, v: jax.grad(lambda q: jnp.sum(f(q, k, v, n) * d_out))(q)  # noqa: E731
    got, clean = np.asarray(d_q(bad_k, bad_v)), np.asarray(d_q(k, v))
    np.testing.assert_allclose(got[0, ~sees], clean[0, ~sees], atol=1e-6, rtol=0)


@backend_cases("case", {"cpu": {"f32": jnp.float32}, "gpu": {"bf16": jnp.bfloat16}})
def test_window_that_excludes_every_key_gives_empty_rows(backend, case):
    """Window (0, 0) non-causal with Sq > n: rows with p = i + n - Sq < 0 see no key: zero
    output, lse = -inf, zero gradient (lse = sinks[h] with sinks); the others see key p."""
    q, k, v, n, _ = make_inputs_q(2, 20, 24, 2, 2, 8, 8, case, [5, 0], seed=6)
    out, lse = jax_varlen.attention(q, k, v, n, local_window_size=0, return_lse=True)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert (out[0, :15] == 0).all() and (lse[0, :, :15] == -np.inf).all()
    assert (out[1] == 0).all() and (lse[1] == -np.inf).all()
    np.testing.assert_allclose(out[0, 15:], np.asarray(v, np.float32)[0, :5], atol=1e-6)
    d_q, d_k = jax.grad(lambda q, k: jnp.sum(jax_varlen.attention(
        q, k, v, n, local_window_size=0) ** 2), argnums=(0, 1))(q, k)
    assert (np.asarray(d_q, np.float32)[0, :15] == 0).all()
    assert np.isfinite(np.asarray(d_q, np.float32)).all()
    assert np.isfinite(np.asarray(d_k, np.float32)).all()
    s = _sinks(2)
    _, lse_s = jax_varlen.attention(q, k, v, n, local_window_size=0, sinks=s, return_lse=True)
    np.testing.assert_array_equal(np.asarray(lse_s)[0, :, :15],
                                  np.broadcast_to(np.asarray(s)[:, None], (2, 15)))


@backend_cases("case", {"cpu": {"f32": ("f32", dict(is_causal=True, local_window_size=(40, 0)))},
                        "gpu": {"bf16": ("bf16", dict(is_causal=True, local_window_size=(40, 0)))}})
def test_window_deterministic_and_batch_invariant(backend, case):
    """Two runs, other padding bits (keys and query rows) and another batch give the same
    bits, forward and gradients."""
    dtype, kw = case
    f = jax.jit(functools.partial(jax_varlen.attention, return_lse=True, **kw))
    g = jax.jit(jax.grad(lambda q, k, v, n, nq: jnp.sum(
        jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq, **kw).astype(jnp.float32) ** 2),
        argnums=(0, 1, 2)))
    results = []
    for pad in (np.nan, np.inf, 0.0, np.nan):
        q, k, v, n, nq = make_inputs_q(3, 140, 200, 4, 2, 32, 32, DTYPES[dtype], [200, 97, 3],
                                 [140, 97, 3], seed=7, pad=pad)
        out, lse = f(q, k, v, n, nonpad_q_seqlen=nq)
        grads = g(q, k, v, n, nq)
        results.append((bits(out), bits(lse)) + tuple(bits(x) for x in grads))
    assert all(r == results[0] for r in results)
    q, k, v, n, nq = make_inputs_q(3, 140, 200, 4, 2, 32, 32, DTYPES[dtype], [200, 97, 3],
                             [140, 97, 3], seed=7)
    out, lse = f(q, k, v, n, nonpad_q_seqlen=nq)
    out1, lse1 = f(q[1:2], k[1:2], v[1:2], n[1:2], nonpad_q_seqlen=nq[1:2])
    assert bits(out1) == bits(out[1:2]) and bits(lse1) == bits(lse[1:2])


# --------------------------------------------------------------------------------------------
# The packed layout.


_PACKED = {
    "window-causal": (dict(local_window_size=(30, 0), is_causal=True), False),
    "window-pair": (dict(local_window_size=(9, 70)), False),
    "sinks": (dict(is_causal=True), True),
    "window-sinks": (dict(local_window_size=5, is_causal=True), True),
}


@backend_cases("case", {"cpu": _PACKED, "gpu": _PACKED})
def test_packed_matches_oracle_and_padded_bits(backend, case):
    """packed_attention against packed_reference (float64), and bitwise equal to attention
    on the same sequences padded, forward and gradients; rows past the last offset are zero
    with lse -inf (with sinks too)."""
    kw, with_sinks = case
    lens_q, lens_k = [5, 0, 70, 1, 17], [9, 3, 66, 0, 130]
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, Dv=16, tail_k=3)
    s = _sinks(4) if with_sinks else None
    out, lse = jax_varlen.packed_attention(q, k, v, cu_q, cu_k, sinks=s, return_lse=True, **kw)
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        put = lambda x: jax.device_put(np.asarray(x, np.float64), cpu)  # noqa: E731
        z = lambda x: np.where(np.isnan(np.asarray(x)), 0, np.asarray(x))  # noqa: E731
        hi_out, hi_lse = jax_varlen.packed_reference(
            put(z(q)), put(z(k)), put(z(v)), np.asarray(cu_q), np.asarray(cu_k),
            sinks=None if s is None else put(s), return_lse=True, **kw)
        hi_out, hi_lse = np.asarray(hi_out), np.asarray(hi_lse)
    assert_out_close(out, hi_out, None, jnp.float32)
    assert_lse_close(lse, hi_lse)
    end = int(cu_q[-1])
    assert (np.asarray(out)[end:] == 0).all() and (np.asarray(lse)[:, end:] == -np.inf).all()
    # The same sequences padded: [B, max, ...] with the counts.
    B, Sq, Skv = len(lens_q), max(lens_q), max(lens_k)
    pq = np.zeros((B, Sq) + q.shape[1:], np.float32)
    pk = np.zeros((B, Skv) + k.shape[1:], np.float32)
    pv = np.zeros((B, Skv) + v.shape[1:], np.float32)
    for b in range(B):
        pq[b, :lens_q[b]] = np.asarray(q)[int(cu_q[b]):int(cu_q[b + 1])]
        pk[b, :lens_k[b]] = np.asarray(k)[int(cu_k[b]):int(cu_k[b + 1])]
        pv[b, :lens_k[b]] = np.asarray(v)[int(cu_k[b]):int(cu_k[b + 1])]
    p_out, p_lse = jax_varlen.attention(jnp.asarray(pq), jnp.asarray(pk), jnp.asarray(pv),
                                        lens_k, nonpad_q_seqlen=lens_q, sinks=s,
                                        return_lse=True, **kw)
    for b in range(B):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert bits(out[rows]) == bits(p_out[b, :lens_q[b]])
        assert bits(lse[:, rows]) == bits(p_lse[b, :, :lens_q[b]])
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape), jnp.float32)
    grads = jax.grad(lambda q, k, v: jnp.sum(jax_varlen.packed_attention(
        q, k, v, cu_q, cu_k, sinks=s, **kw) * ct), argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    for g, x in zip(grads[1:], (k, v)):
        assert (np.asarray(g)[int(cu_k[-1]):] == 0).all()


# --------------------------------------------------------------------------------------------
# Sinks: forward, lse and gradients on every backend.

# id -> (dtype, B, Sq, Skv, H, Hkv, D, Dv, n_kv, n_q, kw)
_SINKS = {
    "noncausal": ("f32", 3, 40, 70, 4, 2, 16, 16, [70, 9, 0], None, {}),
    "causal-empty-rows": ("f32", 3, 40, 30, 4, 1, 16, 8, [30, 9, 0], None, dict(is_causal=True)),
    "q-counts": ("f32", 3, 70, 70, 4, 2, 16, 16, [70, 33, 4], [70, 33, 0], dict(is_causal=True)),
    "softcap": ("f32", 2, 30, 50, 2, 2, 8, 8, [50, 20], None, dict(softcap=2.0)),
    "bf16": ("bf16", 2, 140, 150, 4, 2, 64, 64, [150, 61], [140, 61], dict(is_causal=True)),
}
_SINKS_WINDOW = {"window": ("f32", 2, 130, 150, 4, 2, 16, 16, [150, 61], None,
                            dict(local_window_size=(33, 0), is_causal=True))}


@backend_cases("case", {"cpu": _SINKS | _SINKS_WINDOW, "gpu": _SINKS | _SINKS_WINDOW})
def test_sinks_forward_matches_oracle(backend, case):
    """Against the oracle, which takes the sink as one more score: real rows with no allowed
    key get lse = sinks[h] and zero output; padded query rows keep lse = -inf."""
    dtype, B, Sq, Skv, H, Hkv, D, Dv, n_kv, n_q, kw = case
    q, k, v, n, nq = make_inputs_q(B, Sq, Skv, H, Hkv, D, Dv, DTYPES[dtype], n_kv, n_q)
    s = _sinks(H)
    out, lse = _check(q, k, v, n, nq, sinks=s, **kw)
    empty = ~allowed_keys(Sq, Skv, n_kv, kw.get("is_causal", False), n_q=n_q,
                          window=kw.get("local_window_size")).any(-1) & real_rows(n_q, Sq, B)  # [B, Sq]
    lse_rows = np.asarray(lse).transpose(0, 2, 1)  # [B, Sq, H]
    np.testing.assert_array_equal(lse_rows[empty], np.broadcast_to(np.asarray(s), lse_rows[empty].shape))
    # ... and without sinks the same inputs give another result (the check above can fail).
    plain = jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq, **kw)
    assert float(jnp.abs(plain.astype(jnp.float32) - out.astype(jnp.float32)).max()) > 1e-3
    # The sinks reach the kernels (their epilogues, ffi/core/sinks.h): one primitive with sinks.
    jaxpr = str(jax.make_jaxpr(lambda s: jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq,
                                                               sinks=s, **kw))(s))
    name = "jax_varlen_attention_fwd_sinks" if nq is None else "jax_varlen_packed_attention_fwd_sinks"
    assert name in jaxpr


@backend_cases("case", {
    "cpu": {name: _SINKS[name] for name in ("noncausal", "causal-empty-rows", "q-counts")}
    | _SINKS_WINDOW,
    "gpu": {name: _SINKS[name] for name in ("q-counts", "bf16")} | _SINKS_WINDOW})
def test_sinks_gradients_match_oracle(backend, case):
    """d_query, d_key, d_value and d_sinks (through out and lse) against the oracle's, with NaN
    in padded keys, padded query rows and their d_out; all finite."""
    dtype, B, Sq, Skv, H, Hkv, D, Dv, n_kv, n_q, kw = case
    _check_grads(DTYPES[dtype], B, Sq, Skv, H, Hkv, D, Dv, n_kv, n_q, kw, sinks=True)


def test_d_sinks_formula_and_finite_differences():
    """CPU, float32: d_sinks equals -sum over real rows of exp(sinks[h] - lse) * delta
    (delta = rowsum(d_out * out) - d_lse), computed in float64 from our outputs, and 4-point
    central differences of the loss in sinks (error O(h^4) + eps * |loss| / h)."""
    with jax.default_device(jax.devices("cpu")[0]):
        B, Sq, Skv, H, Hkv, D = 3, 12, 20, 4, 2, 8
        q, k, v, n, nq = make_inputs_q(B, Sq, Skv, H, Hkv, D, D, jnp.float32, [20, 5, 0], [12, 3, 7],
                                 seed=8, pad=0.0)
        s = _sinks(H, seed=9, scale=1.0)
        rng = np.random.default_rng(10)
        d_out = jnp.asarray(rng.standard_normal((B, Sq, H, D)), jnp.float32)
        d_lse = jnp.asarray(rng.standard_normal((B, H, Sq)), jnp.float32)

        def loss(s):
            out, lse = jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq, is_causal=True,
                                            sinks=s, return_lse=True)
            return jnp.sum(out * d_out) + jnp.sum(jnp.where(jnp.isinf(lse), 0.0, lse) * d_lse)

        d_s = np.asarray(jax.jit(jax.grad(loss))(s), np.float64)
        out, lse = jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq, is_causal=True, sinks=s,
                                        return_lse=True)
        out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
        real = real_rows(nq, Sq, B)[:, None, :]  # [B, 1, Sq]
        delta = np.einsum("bqhd,bqhd->bhq", np.asarray(d_out, np.float64), out) - np.asarray(d_lse)
        weight = np.where(real, np.exp(np.asarray(s, np.float64)[None, :, None]
                                       - np.where(real, lse, 0.0)), 0.0)
        want = -(weight * delta).sum(axis=(0, 2))
        np.testing.assert_allclose(d_s, want, rtol=1e-5, atol=1e-5)
        f = jax.jit(loss)
        h = 1e-2
        for u in np.eye(H, dtype=np.float32)[:2].tolist() + [rng.standard_normal(H).tolist()]:
            u = jnp.asarray(u, jnp.float32)
            at = lambda t: float(f(s + t * u))  # noqa: E731
            fd = (-at(2 * h) + 8 * at(h) - 8 * at(-h) + at(-2 * h)) / (12 * h)
            exact = float(jnp.vdot(jnp.asarray(d_s, jnp.float32), u))
            assert abs(fd - exact) <= 2e-3 * max(1.0, abs(exact)), (fd, exact)


# --------------------------------------------------------------------------------------------
# Transformations: jit, vmap, grad, export.

_T = dict(B=3, Sq=12, Skv=20, H=4, Hkv=2, D=8)


def _t_inputs(seed, m=2, pad=np.nan):
    rng = np.random.default_rng(seed)
    parts = []
    for e in range(m):
        n_kv = rng.integers(1, _T["Skv"] + 1, _T["B"])
        n_q = rng.integers(0, _T["Sq"] + 1, _T["B"])
        parts.append(make_inputs_q(_T["B"], _T["Sq"], _T["Skv"], _T["H"], _T["Hkv"], _T["D"], _T["D"],
                             jnp.float32, n_kv, n_q, seed=seed + e, pad=pad))
    return [jnp.stack(x) for x in zip(*parts)]


@backend_cases("case", {
    "cpu": {"window": dict(local_window_size=(3, 1), is_causal=True), "sinks": dict(sinks=True),
            "both": dict(local_window_size=4, sinks=True)},
    "gpu": {"window": dict(local_window_size=(3, 1), is_causal=True), "sinks": dict(sinks=True)}})
def test_jit_vmap_grad(backend, case):
    """vmap (sinks batched too) equals the per-element calls; jit with the window static and
    sinks traced; vmap of grad (d_sinks included) equals the oracle's."""
    kw = dict(case)
    with_sinks = kw.pop("sinks", False)
    q, k, v, n, nq = _t_inputs(11)
    s = jnp.stack([_sinks(_T["H"], seed=1), _sinks(_T["H"], seed=2)]) if with_sinks else None

    def f(q, k, v, n, nq, s):
        return jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq, sinks=s, return_lse=True,
                                    **kw)

    out, lse = jax.jit(jax.vmap(f))(q, k, v, n, nq, s)
    for e in range(2):
        one = [x[e] for x in (q, k, v, n, nq)] + [None if s is None else s[e]]
        want_out, want_lse = f(*one)
        np.testing.assert_allclose(out[e], want_out, atol=1e-6, rtol=0)
        np.testing.assert_array_equal(np.isinf(lse[e]), np.isinf(want_lse))
        hi_out, _ = _oracle_hi(*one[:4], one[4], one[5], **kw)
        assert_out_close(out[e], hi_out, None, jnp.float32)
    window = kw.get("local_window_size")
    g = jax.jit(jax_varlen.attention, static_argnames=("local_window_size", "is_causal"))
    assert bits(g(q[0], k[0], v[0], n[0], nonpad_q_seqlen=nq[0], local_window_size=window,
                  is_causal=kw.get("is_causal", False), sinks=None if s is None else s[0])) == \
        bits(f(q[0], k[0], v[0], n[0], nq[0], None if s is None else s[0])[0])

    def loss(fn, q, k, v, n, nq, s):
        out = fn(q, k, v, n, nonpad_q_seqlen=nq, sinks=s, **kw)
        return jnp.sum(out ** 2)

    argnums = (0, 1, 2, 5) if with_sinks else (0, 1, 2)
    ours = jax.jit(jax.vmap(jax.grad(functools.partial(loss, jax_varlen.attention),
                                     argnums=argnums)))(q, k, v, n, nq, s)
    q0, k0, v0 = (jnp.where(jnp.isnan(x), 0, x) for x in (q, k, v))
    with jax.default_matmul_precision("highest"):
        ref = jax.vmap(jax.grad(functools.partial(loss, jax_varlen.reference),
                                argnums=argnums))(q0, k0, v0, n, nq, s)
    for got, want in zip(ours, ref):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(got, want, atol=2e-5 * float(jnp.abs(want).max()), rtol=0)


def test_sinks_under_remat_scan_and_forward_mode(backend):
    """Sinks compose as the rest of the op: a scan over layers under jax.checkpoint gives the
    gradients (d_sinks included) of the plain loop; forward mode raises (reverse mode only)."""
    q, k, v, n, nq = (x[0] for x in _t_inputs(5, m=1))
    sinks = jnp.stack([_sinks(_T["H"], seed=3), _sinks(_T["H"], seed=4)])  # [layers = 2, H]

    def layer(x, s):
        return jax_varlen.attention(x, k, v, n, nonpad_q_seqlen=nq, sinks=s, is_causal=True)

    def looped(x, sinks):
        for s in sinks:
            x = layer(x, s)
        return jnp.sum(x ** 2)

    def scanned(x, sinks):
        body = jax.checkpoint(lambda x, s: (layer(x, s), None))
        return jnp.sum(jax.lax.scan(body, x, sinks)[0] ** 2)

    x0 = jnp.where(jnp.isnan(q), 0.0, q)
    want = jax.jit(jax.grad(looped, argnums=(0, 1)))(x0, sinks)
    got = jax.jit(jax.grad(scanned, argnums=(0, 1)))(x0, sinks)
    for g, w in zip(got, want):
        assert np.isfinite(np.asarray(w)).all()
        np.testing.assert_allclose(g, w, atol=1e-5 * float(jnp.abs(w).max()), rtol=1e-5)
    with pytest.raises(TypeError, match="forward-mode|jvp"):
        jax.jvp(lambda s: layer(x0, s), (sinks[0],), (sinks[0],))


@backend_cases("case", {
    "cpu": {"window": dict(local_window_size=(3, 1), is_causal=True),
            "sinks": dict(sinks=True, is_causal=True),
            "packed-window-sinks": dict(local_window_size=2, sinks=True, packed=True)},
    "gpu": {"window": dict(local_window_size=(3, 1), is_causal=True),
            "sinks": dict(sinks=True, is_causal=True)}})
def test_export_round_trip(backend, case):
    """jax.export of forward and gradients (d_sinks included): the deserialized call gives
    the same bits."""
    pytest.importorskip("flatbuffers")
    kw = dict(case)
    with_sinks, packed = kw.pop("sinks", False), kw.pop("packed", False)
    s = _sinks(4, seed=3) if with_sinks else jnp.zeros((4,))
    if packed:
        q, k, v, cu_q, cu_k = make_packed([5, 0, 7], [9, 3, 4], Dv=16, tail_k=3)

        def f(q, k, v, s):
            return jax_varlen.packed_attention(q, k, v, cu_q, cu_k,
                                               sinks=s if with_sinks else None, **kw)
    else:
        q, k, v, n, nq = make_inputs_q(3, 12, 20, 4, 2, 8, 8, jnp.float32, [20, 5, 1], [12, 3, 7])

        def f(q, k, v, s):
            return jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq,
                                        sinks=s if with_sinks else None, **kw)

    def train(q, k, v, s):
        return jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3))(q, k, v, s)

    for fn in (f, train):
        exp = jax.export.export(jax.jit(fn), platforms=[EXPORT_PLATFORM[backend]],
                                disabled_checks=jax_varlen.export_disabled_checks())(q, k, v, s)
        again = jax.export.deserialize(exp.serialize())
        got, want = again.call(q, k, v, s), jax.jit(fn)(q, k, v, s)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert bits(a) == bits(b)


def test_calls_without_window_attributes_still_run():
    """An FFI call lowered before the window existed (a serialized export, a direct caller)
    carries no window_left/window_right: the CPU handler takes it as no window."""
    from jax_varlen import _ffi

    _ffi.extension()
    q, k, v, n, _ = make_inputs_q(2, 5, 7, 2, 1, 4, 4, jnp.float32, [7, 3], pad=0.0)
    call = jax.ffi.ffi_call(_ffi.CPU_TARGET, (jax.ShapeDtypeStruct((2, 5, 2, 4), jnp.float32),
                                              jax.ShapeDtypeStruct((2, 2, 5), jnp.float32)))
    out, lse = call(q, k, v, n, scale=np.float32(0.5), is_causal=True, softcap=np.float32(0.0))
    want_out, want_lse = jax_varlen.attention(q, k, v, n, scale=0.5, is_causal=True,
                                              return_lse=True)
    assert bits(out) == bits(want_out) and bits(lse) == bits(want_lse)
    with pytest.raises(Exception, match="missing attribute is_causal"):
        jax.block_until_ready(call(q, k, v, n, scale=np.float32(0.5), softcap=np.float32(0.0)))
