"""Shared helpers for the jax_varlen tests: inputs, the oracle baseline, tolerances, GPU skip.

x64 stays off globally; helpers that need float64 turn it on locally with ``jax.enable_x64``.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

DTYPES = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}

# Error bound relative to max|oracle|, by input dtype (the output is rounded once to it).
RTOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.float16): 2e-3, jnp.dtype(jnp.bfloat16): 2e-2}

# lse is float32 for every input dtype and the inputs reach the oracle exactly (upcast), so
# only fp32 arithmetic separates the two: |lse - oracle| <= LSE_ATOL + LSE_RTOL * |oracle|.
LSE_ATOL = 2e-5
LSE_RTOL = 2e-6

HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


# --------------------------------------------------------------------------------------------
# GPU marker: skip unless a GPU is visible and the extension carries its CUDA kernels.


def _gpu_available() -> tuple[bool, str]:
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        return False, "no GPU visible to jax"
    from jax_varlen import _ffi  # imported lazily: only when a GPU is there at all

    try:
        if not _ffi.has_cuda():
            return False, "jax_varlen was built without its CUDA kernels"
    except ImportError as e:
        return False, f"jax_varlen's extension is not importable: {e}"
    return True, ""


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    ok, reason = _gpu_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU and the CUDA build: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


# --------------------------------------------------------------------------------------------
# Inputs.


def make_inputs(B, Sq, Skv, H, Hkv, D, Dv, dtype, lengths, rank=4, seed=0, pad_value=np.nan,
                lengths_dtype=np.int32):
    """Random normal query/key/value in ``dtype`` with key/value padding (j >= n_b) = pad_value.

    Returns ``(query, key, value, nonpad_kv_seqlen)`` as jax arrays on the default device;
    rank 3 merges the head axis into the last one (``[B, S, H*D]``).
    """
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Sq, H, D), dtype=np.float32)
    k = rng.standard_normal((B, Skv, Hkv, D), dtype=np.float32)
    v = rng.standard_normal((B, Skv, Hkv, Dv), dtype=np.float32)
    n = np.asarray(lengths, dtype=np.int64).reshape(B)
    for b in range(B):
        k[b, max(int(n[b]), 0):] = pad_value
        v[b, max(int(n[b]), 0):] = pad_value
    if rank == 3:
        q, k, v = (x.reshape(x.shape[:2] + (-1,)) for x in (q, k, v))
    elif rank != 4:
        raise ValueError(f"rank must be 3 or 4, got {rank}")
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    return q, k, v, jnp.asarray(n.astype(lengths_dtype))


def to_heads(x, heads):
    """Rank-3 ``[B, S, H*D]`` -> rank-4 ``[B, S, H, D]`` (rank 4 passes through)."""
    x = np.asarray(x)
    return x if x.ndim == 4 else x.reshape(x.shape[:2] + (heads, -1))


def bits(x) -> bytes:
    """The bytes of an array, for bitwise comparisons."""
    x = np.asarray(x)
    return x.dtype.str.encode() + str(x.shape).encode() + x.tobytes()


def assert_padding_never_leaks(B, Sq, Skv, H, Hkv, D, Dv, dtype, lengths, **kw):
    """Padding bits (NaN, +-inf, the dtype's max, zero) never change a single output bit:
    the op on the same inputs with each padding value gives identical, finite results."""
    import jax_varlen

    results = []
    for pad in (np.nan, np.inf, -np.inf, float(jnp.finfo(dtype).max), 0.0):
        q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, Dv, dtype, lengths, seed=7,
                                 pad_value=pad)
        out, lse = jax_varlen.attention(q, k, v, n, return_lse=True, **kw)
        assert np.isfinite(np.asarray(out, np.float32)).all()
        results.append((bits(out), bits(lse)))
    assert all(r == results[0] for r in results)


# --------------------------------------------------------------------------------------------
# Oracle and tolerances.


_STATIC = ("num_heads", "kv_num_heads", "scale", "is_causal", "softcap", "return_lse")


@functools.cache
def jit_reference():
    """The oracle under jit: one compilation per shape instead of one per eager op."""
    from jax_varlen import reference

    return jax.jit(reference, static_argnames=_STATIC)


def _as_numpy(res, dtype=None):
    if isinstance(res, tuple):
        return tuple(np.asarray(r, dtype) for r in res)
    return np.asarray(res, dtype)


def oracle_hi(query, key, value, lengths, **kw):
    """The oracle on the inputs upcast (exactly) to float64, on the CPU; numpy results."""
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        args = [jax.device_put(np.asarray(x, np.float64), cpu) for x in (query, key, value)]
        n = jax.device_put(np.asarray(lengths), cpu)
        return _as_numpy(jit_reference()(*args, n, **kw), np.float64)


def oracle_same_precision(query, key, value, lengths, **kw):
    """The oracle on the very inputs (same dtype, same device); numpy results."""
    return _as_numpy(jit_reference()(query, key, value, lengths, **kw))


def assert_out_close(out, hi, base, dtype, what="out"):
    """``out`` (our op) against ``hi`` (the float64 oracle).

    Two bounds must both hold: the per-dtype error relative to max|hi| (RTOL), and a bound
    relative to ``base``, the oracle's own error on the same low-precision inputs: our error
    may be at most twice the oracle's plus a small floor (an eighth of RTOL).
    """
    out = np.asarray(out, np.float64)
    hi = np.asarray(hi, np.float64)
    assert out.shape == hi.shape, (out.shape, hi.shape)
    bad = np.argwhere(~np.isfinite(out))
    assert bad.size == 0, f"{what}: non-finite values at {bad[:5].tolist()}"
    if out.size == 0:
        return
    scale = max(float(np.max(np.abs(hi))), 1e-30)
    err = float(np.max(np.abs(out - hi)))
    rtol = RTOL[jnp.dtype(dtype)]
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol} * max|ref| {scale:.3g}"
    if base is not None:
        base_err = float(np.max(np.abs(np.asarray(base, np.float64) - hi)))
        bound = 2 * base_err + rtol / 8 * scale
        assert err <= bound, (
            f"{what}: max error {err:.3g} > 2 x oracle's same-precision error {base_err:.3g} "
            f"+ {rtol / 8:.3g} * max|ref| {scale:.3g}"
        )


def assert_lse_close(lse, hi):
    lse = np.asarray(lse, np.float64)
    hi = np.asarray(hi, np.float64)
    assert lse.shape == hi.shape, (lse.shape, hi.shape)
    assert not np.isnan(lse).any(), "lse has NaN"
    assert not (lse == np.inf).any(), "lse has +inf"
    empty = hi == -np.inf
    np.testing.assert_array_equal(lse == -np.inf, empty,
                                  err_msg="lse must be -inf exactly where no key is allowed")
    if (~empty).any():
        err = np.abs(lse[~empty] - hi[~empty])
        bound = LSE_ATOL + LSE_RTOL * np.abs(hi[~empty])
        worst = int(np.argmax(err - bound))
        assert (err <= bound).all(), (
            f"lse: error {err[worst]:.3g} > {LSE_ATOL} + {LSE_RTOL} * |ref| "
            f"({hi[~empty][worst]:.6g})"
        )


def check_against_oracle(query, key, value, lengths, *, baseline=True, **kw):
    """Runs the op (with lse) on the inputs' device and checks out and lse against the float64
    oracle. The same-precision baseline runs on the CPU too: an XLA:CPU compile per shape costs
    a fraction of an XLA:GPU one, and the result is the same."""
    import jax_varlen

    out, lse = jax_varlen.attention(query, key, value, lengths, return_lse=True, **kw)
    assert out.dtype == query.dtype and out.ndim == query.ndim
    assert lse.dtype == jnp.float32
    hi_out, hi_lse = oracle_hi(query, key, value, lengths, return_lse=True, **kw)
    base = None
    if baseline:
        cpu = jax.devices("cpu")[0]
        args = [jax.device_put(np.asarray(x), cpu) for x in (query, key, value, lengths)]
        base = oracle_same_precision(*args, **kw)
    assert_out_close(out, hi_out, base, query.dtype)
    assert_lse_close(lse, hi_lse)
    return out, lse


def assert_cases_cover_causal(axes: dict[str, list], cases: list[dict]) -> None:
    """Every value of every axis appears in some case with causal on and in one with it off."""
    for axis, values in axes.items():
        if axis == "causal":
            continue
        for value in values:
            for causal in (False, True):
                assert any(c[axis] == value and c["causal"] == causal for c in cases), (axis, value)


# --------------------------------------------------------------------------------------------
# A reduced parameter product: every pair of values of any two axes appears in some case
# (greedy pairwise covering, deterministic), plus every value of ``must`` axes together.


def pairwise(axes: dict[str, list], must: tuple[str, ...] = ()) -> list[dict]:
    names = list(axes)
    full = [dict(zip(names, combo)) for combo in itertools.product(*(axes[n] for n in names))]

    def key(v):
        return repr(v)

    def pairs_of(case):
        out = set()
        for a, b in itertools.combinations(names, 2):
            out.add((a, key(case[a]), b, key(case[b])))
        return out

    pairs = [pairs_of(c) for c in full]
    uncovered = set().union(*pairs)
    chosen = []

    def take(candidates):
        i = max(candidates, key=lambda i: len(pairs[i] & uncovered))  # first best: deterministic
        chosen.append(full[i])
        uncovered.difference_update(pairs[i])

    if must:  # seed with the full product of the ``must`` axes
        groups: dict[tuple, list[int]] = {}
        for i, c in enumerate(full):
            groups.setdefault(tuple(key(c[n]) for n in must), []).append(i)
        for idx in groups.values():
            take(idx)
    while uncovered:
        take(range(len(full)))
    return chosen
