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


def loop_attention(q, k, v, lengths, *, scale=None, is_causal=False, softcap=0.0,
                   nonpad_q_seqlen=None, local_window_size=None, sinks=None):
    """float64 per-(b, h, i) loop over rank-4 NumPy inputs; returns (out, lse). Row i of
    sequence b is real iff i < m (m = nonpad_q_seqlen[b], default Sq); its tail-aligned key
    position is p = i + n - m; it sees keys j < n with j <= p when causal and
    p - left <= j <= p + right in a window."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b_, sq, h_, d = q.shape
    skv, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)
    out = np.zeros((b_, sq, h_, dv))
    lse = np.full((b_, h_, sq), -np.inf)
    for b in range(b_):
        n = int(min(max(int(lengths[b]), 0), skv))
        m = sq if nonpad_q_seqlen is None else int(min(max(int(nonpad_q_seqlen[b]), 0), sq))
        for h in range(h_):
            g = h // (h_ // hkv)
            for i in range(m):
                p = i + n - m
                keys = [j for j in range(n) if (not is_causal or j <= p) and (
                    local_window_size is None
                    or p - local_window_size[0] <= j <= p + local_window_size[1])]
                sink = None if sinks is None else float(sinks[h])
                if not keys:
                    if sink is not None:
                        lse[b, h, i] = sink
                    continue
                s = scale * (k[b, keys, g] @ q[b, i, h])
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                mx = s.max() if sink is None else max(s.max(), sink)
                e = np.exp(s - mx)
                total = e.sum() + (0.0 if sink is None else np.exp(sink - mx))
                out[b, i, h] = e @ v[b, keys, g] / total
                lse[b, h, i] = mx + np.log(total)
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


# --------------------------------------------------------------------------------------------
# Query counts, local windows and sinks (issues 31 and 34), against the same loop.

WINDOWS = {"none": None, "w0": 0, "w2": 2, "left3-right0": (3, 0), "left0-right4": (0, 4),
           "left1-right20": (1, 20)}


@pytest.mark.parametrize("window", WINDOWS.values(), ids=WINDOWS.keys())
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("q_counts", [None, [6, 2, 0, 5]], ids=["all-rows", "q-counts"])
def test_window_and_query_counts_match_loop(window, is_causal, q_counts):
    q, k, v, lengths = make_inputs(LENGTHS["ragged"], heads=HEADS["gqa"])
    if q_counts is not None:
        q = q.at[np.arange(SQ)[None, :] >= np.asarray(q_counts)[:, None]].set(np.nan)
    check(q, k, v, lengths, is_causal=is_causal, local_window_size=window,
          nonpad_q_seqlen=None if q_counts is None else jnp.asarray(q_counts))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", [None, (1, 0)], ids=["no-window", "window"])
def test_sinks_match_loop(is_causal, window):
    """Rows with allowed keys gain exp(sink) in the denominator; empty rows (sequence 0 has
    no key; under causal the leading rows of short sequences) give zeros and lse = sink."""
    q, k, v, lengths = make_inputs(LENGTHS["short"] + [0], heads=HEADS["gqa"])
    sinks = jnp.asarray([0.5, -1.0, 2.0, -30.0], jnp.float32)
    out, lse = check(q, k, v, lengths, is_causal=is_causal, local_window_size=window,
                     sinks=sinks)
    assert (np.asarray(lse[-1]) == np.asarray(sinks)[:, None]).all()
    assert (np.asarray(out[-1]) == 0).all()


def test_sinks_lower_the_weights():
    """A sink only adds to the denominator: the output shrinks by sum_j e^s_j / (e^sink +
    sum_j e^s_j) row by row, which the no-sink lse gives exactly."""
    q, k, v, lengths = make_inputs(LENGTHS["full"])
    sinks = jnp.linspace(-1.0, 1.0, H)
    out0, lse0 = reference(q, k, v, jnp.asarray(lengths), return_lse=True)
    out1, lse1 = reference(q, k, v, jnp.asarray(lengths), sinks=sinks, return_lse=True)
    shrink = np.exp(np.asarray(lse0) - np.asarray(lse1))  # [B, H, Sq]
    np.testing.assert_allclose(out1, out0 * shrink.transpose(0, 2, 1)[..., None], atol=1e-6)


def test_sinks_gradient_matches_the_formula_and_finite_differences():
    """d_sinks[h] = -sum over rows of exp(sinks[h] - lse) * rowsum(dO * O) (issue 34)."""
    q, k, v, lengths = make_inputs(LENGTHS["odd"], heads=HEADS["gqa"], pad=0.0)
    n = jnp.asarray(lengths)
    sinks = jnp.asarray([0.3, -0.7, 1.1, 0.0], jnp.float32)
    d_out = jax.random.normal(jax.random.key(3), (B, SQ, H, DV))

    def loss(sinks, q, k, v):
        return jnp.sum(reference(q, k, v, n, is_causal=True, sinks=sinks) * d_out)

    with jax.default_matmul_precision("highest"):
        d_sinks = jax.jit(jax.grad(loss))(sinks, q, k, v)
        out, lse = reference(q, k, v, n, is_causal=True, sinks=sinks, return_lse=True)
    rowsum = jnp.sum(d_out * out, axis=-1).transpose(0, 2, 1)  # [B, H, Sq]
    want = -jnp.sum(jnp.exp(sinks[None, :, None] - lse) * rowsum, axis=(0, 2))
    np.testing.assert_allclose(d_sinks, want, atol=1e-5, rtol=1e-5)
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x), jnp.float64) for x in (sinks, q, k, v)]
        check_grads(jax.jit(lambda s, q, k, v: jnp.sum(
            reference(q, k, v, n, is_causal=True, sinks=s) * np.asarray(d_out))), args, order=1,
                    modes=("rev",), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bad", [-1, (2, -1)])
def test_negative_window_raises(bad):
    q, k, v, lengths = make_inputs(LENGTHS["full"])
    with pytest.raises(ValueError, match="local_window_size must be >= 0"):
        reference(q, k, v, jnp.asarray(lengths), local_window_size=bad)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_packed_reference_window_and_sinks_equal_the_padded_oracle(is_causal):
    """The packed oracle, sequence by sequence, against the padded one with query counts."""
    from jax_varlen.reference import packed_reference

    lens_q, lens_k = [3, 0, 6, 2], [5, 4, 6, 0]
    q, k, v, _ = make_inputs([11] * 4, heads=HEADS["gqa"])
    sinks = jnp.asarray([0.1, -0.4, 0.9, 0.0], jnp.float32)
    kw = dict(is_causal=is_causal, local_window_size=(2, 1), sinks=sinks, return_lse=True)
    cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    pq = jnp.concatenate([q[b, :m] for b, m in enumerate(lens_q)] + [q[0, :2]])  # 2 tail rows
    pk = jnp.concatenate([k[b, :n] for b, n in enumerate(lens_k)])
    pv = jnp.concatenate([v[b, :n] for b, n in enumerate(lens_k)])
    out, lse = packed_reference(pq, pk, pv, cu_q, cu_k, **kw)
    want, want_lse = reference(q, k, v, jnp.asarray(lens_k), nonpad_q_seqlen=jnp.asarray(lens_q),
                               **kw)
    for b, m in enumerate(lens_q):
        np.testing.assert_allclose(out[cu_q[b]:cu_q[b + 1]], want[b, :m], atol=1e-6)
        np.testing.assert_allclose(lse[:, cu_q[b]:cu_q[b + 1]], want_lse[b, :, :m], atol=1e-6)
    assert (np.asarray(out[cu_q[-1]:]) == 0).all() and (np.asarray(lse[:, cu_q[-1]:]) == -np.inf).all()
