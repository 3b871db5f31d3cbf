"""The op under jit, vmap and checkify, on every backend (the ``backend`` fixture).

vmap must equal the op on each element, bitwise, and the float64 oracle under the same vmap;
jit must equal eager, bitwise; traced out-of-range lengths are clamped and reported under
checkify.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_varlen
from conftest import (
    DTYPES,
    assert_lse_close,
    assert_out_close,
    backend_cases,
    bits,
    make_inputs,
    oracle_hi,
)

# Problem geometries: (B, Sq, Skv, H, Hkv, D, Dv) and the lengths [N][B] of N = 3 problems
# stacked for vmap. "small" runs on every backend (on the GPU, f16/bf16 at Sq = 9 take the
# split-KV path, f32 the SIMT kernel); "key-tiles" (GPU) crosses the 64/128-key tiles of the
# one-pass tensor-core path at head size 64.
GEOMETRY = {
    "small": ((2, 9, 40, 4, 2, 16, 8), [[40, 0], [17, 40], [1, 23]]),
    "key-tiles": ((2, 64, 300, 4, 2, 64, 64), [[300, 0], [17, 300], [1, 129]]),
}
(B, SQ, SKV, H, HKV, D, DV), LENGTHS = GEOMETRY["small"]
N = 3


def _stack(n, dtype, lengths, seed, unbatched_kv=False, rank=4, geometry="small"):
    """n independent problems stacked on a new leading axis: [n, B, ...] each.

    ``lengths``: [n][B]. With ``unbatched_kv`` key/value are one [B, ...] problem whose
    padding starts after the largest length of each sequence over the n problems.
    """
    b, sq, skv, h, hkv, d, dv = GEOMETRY[geometry][0]
    qs, ks, vs = [], [], []
    for i in range(n):
        q, k, v, _ = make_inputs(b, sq, skv, h, hkv, d, dv, dtype, lengths[i], rank=rank,
                                 seed=seed + i)
        qs.append(q), ks.append(k), vs.append(v)
    lens = jnp.asarray(np.asarray(lengths, np.int32))
    if unbatched_kv:
        _, k, v, _ = make_inputs(b, sq, skv, h, hkv, d, dv, dtype,
                                 np.max(np.asarray(lengths), axis=0), rank=rank, seed=seed + n)
        return jnp.stack(qs), k, v, lens
    return jnp.stack(qs), jnp.stack(ks), jnp.stack(vs), lens


def _oracle_hi(f_kw, in_axes, args, vmaps=1):
    """vmap(reference) in float64 on the CPU, with the same in_axes."""
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        a = [jax.device_put(np.asarray(x, np.float64 if i < 3 else np.asarray(x).dtype), cpu)
             for i, x in enumerate(args)]
        f = lambda q, k, v, n: jax_varlen.reference(q, k, v, n, **f_kw)  # noqa: E731
        for _ in range(vmaps):
            f = jax.vmap(f, in_axes=in_axes)
        res = f(*a)
        return jax.tree.map(lambda r: np.asarray(r, np.float64), res)


def _loop(f_kw, in_axes, args):
    """The op applied to each vmapped element separately, stacked: what vmap must equal bitwise."""
    size = next(np.shape(a)[ax] for a, ax in zip(args, in_axes) if ax is not None)
    outs = []
    for i in range(size):
        el = [a if ax is None else jnp.take(a, i, axis=ax) for a, ax in zip(args, in_axes)]
        outs.append(jax_varlen.attention(*el, **f_kw))
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


IN_AXES = {
    "all0": (0, 0, 0, 0),
    "lengths-unbatched": (0, 0, 0, None),
    "kv-unbatched": (0, None, None, 0),
    "only-lengths-batched": (None, None, None, 0),
    "query-axis1": (1, 0, 0, 0),
    "query-axis1-kv-unbatched": (1, None, None, 0),
}


def _vmap_args(name, dtype, rank=4, geometry="small"):
    in_axes = IN_AXES[name]
    lengths = GEOMETRY[geometry][1]
    q, k, v, n = _stack(N, dtype, lengths, seed=100, unbatched_kv=in_axes[1] is None, rank=rank,
                        geometry=geometry)
    if in_axes[0] is None:
        q = q[0]
    if in_axes[0] == 1:
        q = jnp.moveaxis(q, 0, 1)
    if in_axes[3] is None:
        # One length per sequence for every vmapped element: padding must start after it.
        n = jnp.asarray(np.min(np.asarray(lengths), axis=0).astype(np.int32))
    return in_axes, (q, k, v, n)


# (geometry, dtype, in_axes name). GPU: also bf16 on the one-pass tensor-core path across key
# tiles.
_SMALL_VMAPS = {name: ("small", "f32", name) for name in IN_AXES}
VMAP_CASES = {
    "cpu": _SMALL_VMAPS,
    "gpu": {**_SMALL_VMAPS,
            **{f"key-tiles-bf16-{name}": ("key-tiles", "bf16", name)
               for name in ("all0", "lengths-unbatched", "query-axis1-kv-unbatched")}},
}


@backend_cases("case", VMAP_CASES)
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_vmap(backend, case, causal, return_lse):
    geometry, dtype, name = case
    b, sq, _, h, _, _, dv = GEOMETRY[geometry][0]
    dtype = DTYPES[dtype]
    in_axes, args = _vmap_args(name, dtype, geometry=geometry)
    kw = dict(is_causal=causal, softcap=1.5, return_lse=return_lse)
    f = lambda q, k, v, n: jax_varlen.attention(q, k, v, n, **kw)  # noqa: E731
    got = jax.vmap(f, in_axes=in_axes)(*args)
    hi = _oracle_hi(kw, in_axes, args)
    if return_lse:
        assert got[0].shape == (N, b, sq, h, dv) and got[1].shape == (N, b, h, sq)
        assert_out_close(got[0], hi[0], None, dtype)
        assert_lse_close(got[1], hi[1])
    else:
        assert got.shape == (N, b, sq, h, dv)
        assert_out_close(got, hi, None, dtype)
    loop = _loop(kw, in_axes, args)
    assert jax.tree.map(bits, got) == jax.tree.map(bits, loop)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_vmap_low_precision_rank3(backend, dtype):
    in_axes, args = _vmap_args("all0", DTYPES[dtype], rank=3)
    kw = dict(num_heads=H, kv_num_heads=HKV, is_causal=True)
    got = jax.vmap(lambda *a: jax_varlen.attention(*a, **kw), in_axes=in_axes)(*args)
    assert got.shape == (N, B, SQ, H * DV) and got.dtype == DTYPES[dtype]
    assert_out_close(got, _oracle_hi(kw, in_axes, args), None, DTYPES[dtype])
    assert bits(got) == bits(_loop(kw, in_axes, args))


def test_nested_vmap(backend):
    M = 2
    lengths = [[[40, 3], [0, 40]], [[11, 29], [40, 40]]]  # [M][N=2][B]
    qs, ks, vs = [], [], []
    for m in range(M):
        q, k, v, _ = _stack(2, jnp.float32, lengths[m], seed=200 + 10 * m)
        qs.append(q), ks.append(k), vs.append(v)
    q, k, v = jnp.stack(qs), jnp.stack(ks), jnp.stack(vs)  # [M, 2, B, ...]
    n = jnp.asarray(np.asarray(lengths, np.int32))
    q = jnp.moveaxis(q, 1, 0)  # inner vmapped axis of q first: [2, M, B, ...]
    kw = dict(is_causal=True, return_lse=True)
    f = lambda q, k, v, n: jax_varlen.attention(q, k, v, n, **kw)  # noqa: E731
    inner = jax.vmap(f, in_axes=(0, 0, 0, 0))
    outer = jax.vmap(inner, in_axes=(1, 0, 0, 0))
    out, lse = outer(q, k, v, n)
    assert out.shape == (M, 2, B, SQ, H, DV) and lse.shape == (M, 2, B, H, SQ)
    for m in range(M):
        for i in range(2):
            o, l = jax_varlen.attention(q[i, m], k[m, i], v[m, i], n[m, i], **kw)
            assert bits(out[m, i]) == bits(o) and bits(lse[m, i]) == bits(l)
    with jax.enable_x64(True):
        cpu = jax.devices("cpu")[0]
        a = [jax.device_put(np.asarray(x, np.float64), cpu) for x in (q, k, v)]
        r = lambda q, k, v, n: jax_varlen.reference(q, k, v, n, **kw)  # noqa: E731
        hi = jax.vmap(jax.vmap(r, in_axes=(0, 0, 0, 0)), in_axes=(1, 0, 0, 0))(*a, np.asarray(n))
        hi = jax.tree.map(lambda x: np.asarray(x, np.float64), hi)
    assert_out_close(out, hi[0], None, jnp.float32)
    assert_lse_close(lse, hi[1])


def test_vmap_under_jit_and_jit_under_vmap(backend):
    in_axes, args = _vmap_args("lengths-unbatched", jnp.bfloat16)
    f = lambda q, k, v, n: jax_varlen.attention(q, k, v, n, is_causal=True)  # noqa: E731
    a = jax.jit(jax.vmap(f, in_axes=in_axes))(*args)
    b = jax.vmap(jax.jit(f), in_axes=in_axes)(*args)
    c = jax.vmap(f, in_axes=in_axes)(*args)
    assert bits(a) == bits(b) == bits(c)


# (dtype, (B, Sq, Skv, H, Hkv, D, Dv), lengths). GPU: also bf16 across key tiles at head size
# 128 with MQA and Dv < D.
_SMALL_JITS = {dt: (dt, (3, 13, 70, 4, 1, 16, 24), [70, 0, 33]) for dt in DTYPES}
JIT_CASES = {
    "cpu": _SMALL_JITS,
    "gpu": {**_SMALL_JITS, "bf16-key-tiles": ("bf16", (3, 128, 577, 4, 1, 128, 64),
                                              [577, 0, 300])},
}


@backend_cases("case", JIT_CASES)
def test_jit_with_traced_lengths_matches_eager(backend, case):
    dtype, shape, lengths = case
    q, k, v, n = make_inputs(*shape, DTYPES[dtype], lengths, seed=41)
    for kw in (dict(), dict(is_causal=True, softcap=2.0, scale=0.3)):
        eager = jax_varlen.attention(q, k, v, n, return_lse=True, **kw)
        jitted = jax.jit(lambda q, k, v, n: jax_varlen.attention(q, k, v, n, return_lse=True,
                                                                 **kw))(q, k, v, n)
        assert jax.tree.map(bits, eager) == jax.tree.map(bits, jitted)
        # static keyword arguments through jit's static_argnames
        f = jax.jit(jax_varlen.attention, static_argnames=("is_causal", "softcap", "scale",
                                                           "return_lse"))
        assert jax.tree.map(bits, f(q, k, v, n, return_lse=True, **kw)) == jax.tree.map(bits, eager)


def _bad_lengths_setup():
    # Valid lengths [0, Skv, 7, Skv] are what the traced bad lengths below clamp to.
    q, k, v, n = make_inputs(4, 6, 20, 4, 2, 8, 8, jnp.float32, [0, 20, 7, 20], seed=43)
    bad = jnp.asarray([-3, 25, 7, 2**31 - 1], jnp.int32)
    return q, k, v, n, bad


def test_checkify_reports_out_of_range_traced_lengths(backend):
    q, k, v, n, bad = _bad_lengths_setup()
    f = lambda q, k, v, n: jax_varlen.attention(q, k, v, n, is_causal=True)  # noqa: E731
    # (checkify(f) without jit runs f eagerly in this jax: the lengths arrive concrete and
    # raise ValueError, the concrete-lengths rule.)
    for checked in (checkify.checkify(jax.jit(f)), jax.jit(checkify.checkify(f))):
        err, out = checked(q, k, v, bad)
        assert err.get() is not None
        assert "nonpad_kv_seqlen" in err.get()
        assert bits(out) == bits(jax_varlen.attention(q, k, v, n, is_causal=True))
        err, out = checked(q, k, v, n)
        assert err.get() is None
        assert bits(out) == bits(jax_varlen.attention(q, k, v, n, is_causal=True))
    for one_bad in ([-1, 20, 7, 20], [0, 21, 7, 20]):
        err, _ = checkify.checkify(jax.jit(f))(q, k, v, jnp.asarray(one_bad, jnp.int32))
        assert err.get() is not None, one_bad


def test_traced_out_of_range_lengths_are_clamped(backend):
    q, k, v, n, bad = _bad_lengths_setup()
    f = jax.jit(lambda q, k, v, n: jax_varlen.attention(q, k, v, n, is_causal=True,
                                                        return_lse=True))
    out, lse = f(q, k, v, bad)
    ref = jax_varlen.attention(q, k, v, n, is_causal=True, return_lse=True)
    assert bits(out) == bits(ref[0]) and bits(lse) == bits(ref[1])
    hi_out, hi_lse = oracle_hi(q, k, v, n, is_causal=True, return_lse=True)
    assert_out_close(out, hi_out, None, jnp.float32)
    assert_lse_close(lse, hi_lse)
    # The most negative int32 too, and under vmap.
    out2 = f(q, k, v, jnp.asarray([-2**31, 2**31 - 1, 7, 20], jnp.int32))
    assert bits(out2[0]) == bits(ref[0])
    vm = jax.vmap(lambda n: f(q, k, v, n)[0])(jnp.stack([bad, n]))
    assert bits(vm[0]) == bits(ref[0]) and bits(vm[1]) == bits(ref[0])


def test_traced_int64_lengths_clamp_before_narrowing(backend):
    """An int64 length past int32 range clamps to Skv, never wraps into range."""
    q, k, v, n = make_inputs(2, 6, 20, 4, 2, 8, 8, jnp.float32, [20, 20], seed=47)
    ref = jax_varlen.attention(q, k, v, n)
    with jax.enable_x64(True):
        big = jnp.asarray([2**32 + 3, 2**40], jnp.int64)  # would wrap to 3 and 0 as int32
        out = jax.jit(lambda n: jax_varlen.attention(q, k, v, n))(big)
        err, out2 = checkify.checkify(jax.jit(lambda n: jax_varlen.attention(q, k, v, n)))(big)
        assert err.get() is not None
    assert bits(out) == bits(ref) and bits(out2) == bits(ref)
