"""Shared helpers for the jax_varlen tests: the backend fixture and per-backend case tables,
inputs, the oracle baseline, tolerances, the GPU skip, the masking and non-finite data rules,
the transformation tests' small problem and the multi-device cases' meshes.

x64 stays off globally; helpers that need float64 turn it on locally with ``jax.enable_x64``.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os

# Whether this machine has an NVIDIA driver (a GPU machine), decided before jax starts.
NVIDIA_MACHINE = os.path.exists("/dev/nvidiactl")

# Without a GPU most of the suite's time is XLA compiling small CPU programs (the op's glue, the
# oracles): compile them at LLVM optimization level 0 (2026-12-06, test_forward + test_packed:
# 195 -> 142 s of CPU, the same results; our kernels are compiled C++ either way). Set before
# jax starts its backends; a GPU machine keeps XLA's defaults.
if not NVIDIA_MACHINE:
    os.environ["XLA_FLAGS"] = " ".join(
        filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

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


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without xdist, never called
def pytest_xdist_auto_num_workers(config):
    """``pytest -n auto`` (the Quick start): a worker per core, but one where an NVIDIA GPU
    exists, since each worker's jax would claim most of its memory and the next workers would
    find no GPU to run on."""
    return 1 if NVIDIA_MACHINE else None  # None: xdist's own core count


def pytest_collection_modifyitems(config, items):
    # The multi-device cases (a subprocess of their own, 15-40 s each on the 2-core machine)
    # first, so that under `pytest -n auto` they overlap the many short tests instead of being
    # the last worker's tail; the rest keep their order.
    items.sort(key=lambda item: not item.name.startswith("test_multi_device"))
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
# One suite for every backend: a test that takes the ``backend`` fixture runs once on the CPU
# and once on the GPU (marked ``gpu``, so skipped above when there is none), with that
# backend's first device as jax's default device for the whole test: inputs made inside the
# test live there and the op runs there.

BACKENDS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]

# The platform name jax.export uses for a backend. jax.export.export lowers for the default
# backend (the GPU on a GPU machine, whatever the default device), so export tests name it.
EXPORT_PLATFORM = {"cpu": "cpu", "gpu": "cuda"}

# Exported.serialize() needs the flatbuffers package, which jax does not depend on.
needs_flatbuffers = pytest.mark.skipif(
    importlib.util.find_spec("flatbuffers") is None,
    reason="Exported.serialize() needs the flatbuffers package (pip install flatbuffers)",
)


@pytest.fixture(params=BACKENDS)
def backend(request):
    with jax.default_device(jax.devices(request.param)[0]):
        yield request.param


def backend_cases(argname: str, tables: dict[str, dict]):
    """Parametrizes a test over ``backend`` and ``argname`` with each backend's own cases.

    ``tables`` maps "cpu" and "gpu" to ``{case id: value}``; the test runs once per entry,
    with that backend (through the fixture, so its device is the default one; "gpu" entries
    are marked gpu) and the value as ``argname``. For checks whose shapes are chosen per
    backend: the CPU's 64-row and 64-key blocks, the GPU's 64/128-key tiles and split-KV path.
    """
    params = [
        pytest.param(backend, value, id=f"{backend}-{name}",
                     marks=[pytest.mark.gpu] if backend == "gpu" else [])
        for backend, table in tables.items() for name, value in table.items()
    ]
    return pytest.mark.parametrize(("backend", argname), params, indirect=["backend"])


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


def make_inputs_q(B, Sq, Skv, H, Hkv, D, Dv, dtype, n_kv, n_q=None, seed=0, pad=np.nan):
    """``make_inputs`` (the same random values) with query rows ``i >= n_q[b]`` set to ``pad``
    too: ``(query [B, Sq, H, D], key [B, Skv, Hkv, D], value [B, Skv, Hkv, Dv], n_kv [B],
    n_q [B])``, counts int32 jax arrays (``n_q`` None when not given)."""
    q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, Dv, dtype, n_kv, seed=seed, pad_value=pad)
    if n_q is None:
        return q, k, v, n, None
    q = np.array(q, np.float32)  # exact: every dtype here is a subset of float32
    for b, m in enumerate(n_q):
        q[b, m:] = pad
    return jnp.asarray(q, dtype), k, v, n, jnp.asarray(np.asarray(n_q, np.int32))


def real_rows(n_q, Sq, B=None):
    """[B, Sq] bool: the real query rows (``i < n_q[b]``); every row when ``n_q`` is None
    (then ``B`` gives the batch)."""
    if n_q is None:
        return np.ones((B, Sq), bool)
    return np.arange(Sq)[None, :] < np.asarray(n_q)[:, None]


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


_STATIC = ("num_heads", "kv_num_heads", "scale", "is_causal", "softcap", "local_window_size", "return_lse")


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


def check_against_oracle(query, key, value, lengths, **kw):
    """Runs the op (with lse) on the inputs' device and checks out and lse against the float64
    oracle. The same-precision baseline runs on the CPU too: an XLA:CPU compile per shape costs
    a fraction of an XLA:GPU one, and the result is the same.

    The baseline bound applies to f16/bf16 everywhere and to float32 on the CPU; float32 on a
    GPU is held to the per-dtype bound only (as the GPU tests always have been).
    """
    import jax_varlen

    out, lse = jax_varlen.attention(query, key, value, lengths, return_lse=True, **kw)
    assert out.dtype == query.dtype and out.ndim == query.ndim
    assert lse.dtype == jnp.float32
    hi_out, hi_lse = oracle_hi(query, key, value, lengths, return_lse=True, **kw)
    base = None
    if query.dtype != jnp.float32 or all(d.platform == "cpu" for d in query.devices()):
        cpu = jax.devices("cpu")[0]
        args = [jax.device_put(np.asarray(x), cpu) for x in (query, key, value, lengths)]
        base = oracle_same_precision(*args, **kw)
    assert_out_close(out, hi_out, base, query.dtype)
    assert_lse_close(lse, hi_lse)
    return out, lse


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


# --------------------------------------------------------------------------------------------
# Non-finite real data: the rule (docs/semantics.md) and a check of it against the oracle.
#
# A row with no allowed key gives zeros and lse = -inf, decided by the count of allowed keys;
# a row that allows a non-finite element gives what the math gives; every other row is
# unaffected. Padding (NaN in make_inputs) is never read.

# kind -> (array, value): one non-finite element written into real data.
NONFINITE_KINDS = {
    "query-nan": ("query", np.nan),
    "query-inf": ("query", np.inf),
    "key-nan": ("key", np.nan),
    "key-inf": ("key", np.inf),
    "value-nan": ("value", np.nan),
    "value-inf": ("value", np.inf),
}


def nonfinite_positions(Sq, lengths):
    """Where the element goes: sequence 0, query row Sq // 2, key/value row n_0 - 2 (under
    causal only the last two query rows allow it, so the rows below must be unaffected),
    head 1, query/key component 1, value component 2."""
    n0 = int(lengths[0])
    assert n0 >= 2, "sequence 0 needs two real keys"
    return dict(b=0, i=Sq // 2, j=n0 - 2, h=1, d=1, e=2)


def allowed_keys(Sq, Skv, lengths, causal=False, *, n_q=None, window=None):
    """allowed[b, i, j] ([B, Sq, Skv] bool), straight from the contract: query row i of
    sequence b is real iff ``i < n_q[b]`` (default: every row); at its tail-aligned position
    ``p = i + n - m`` (``n = lengths[b]`` keys, ``m = n_q[b]``) it sees key j iff ``j < n``,
    ``j <= p`` when ``causal``, and ``p - left <= j <= p + right`` in a ``window`` (left, right)
    (an int: both sides; a side None: unbounded)."""
    n = np.asarray(lengths)[:, None, None]
    m = np.full_like(n, Sq) if n_q is None else np.asarray(n_q)[:, None, None]
    i = np.arange(Sq)[None, :, None]
    j = np.arange(Skv)[None, None, :]
    p = i + n - m
    ok = (j < n) & (i < m)
    if causal:
        ok &= j <= p
    left, right = (window, window) if isinstance(window, int) else (window or (None, None))
    if left is not None:
        ok &= j >= p - left
    if right is not None:
        ok &= j <= p + right
    return ok


def nonfinite_inputs(kind, B, Sq, Skv, H, Hkv, D, Dv, dtype, lengths, seed=0, at=None):
    """make_inputs with one non-finite element in real data (``NONFINITE_KINDS``), at
    ``nonfinite_positions`` unless ``at`` (same keys) says otherwise.

    For Inf, the factor it meets is made positive (key 0's component for a query Inf, every
    query's component for a key Inf), so that the scores it touches are +inf and the rows
    that allow it are NaN (+inf - max), whatever the random draw.
    """
    q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, Dv, dtype, lengths, seed=seed)
    q, k, v = (np.array(x, np.float32) for x in (q, k, v))  # exact for f16/bf16; writable
    array, value = NONFINITE_KINDS[kind]
    p = at or nonfinite_positions(Sq, lengths)
    b, i, j, h, d, e = (p[x] for x in "bijhde")
    g = h // (H // Hkv)
    if array == "query":
        q[b, i, h, d] = value
        k[b, 0, g, d] = np.abs(k[b, 0, g, d]) + 0.5
    elif array == "key":
        k[b, j, g, d] = value
        heads = slice(g * (H // Hkv), (g + 1) * (H // Hkv))
        q[b, :, heads, d] = np.abs(q[b, :, heads, d]) + 0.5
    else:
        v[b, j, g, e] = value
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    return q, k, v, n, p


def expected_nonfinite(kind, p, Sq, Skv, H, Hkv, Dv, lengths, causal):
    """Masks the rule implies: (out non-finite, out not asserted, lse non-finite).

    Query element: its row (all of Dv), if the row allows any key. Key element: the rows of
    its kv head's query heads that allow it. Value element: those rows, in its column only;
    the rows that do not allow it are not asserted in that column (a kernel may multiply a
    zero probability by it inside a tile).
    """
    B = len(lengths)
    allowed = allowed_keys(Sq, Skv, lengths, causal)
    out_bad = np.zeros((B, Sq, H, Dv), bool)
    out_free = np.zeros_like(out_bad)
    lse_bad = np.zeros((B, H, Sq), bool)
    b, i, j, h = p["b"], p["i"], p["j"], p["h"]
    G = H // Hkv
    heads = np.arange((h // G) * G, (h // G + 1) * G)
    array = NONFINITE_KINDS[kind][0]
    if array == "query":
        out_bad[b, i, h, :] = lse_bad[b, h, i] = allowed[b, i].any()
    elif array == "key":
        rows = np.flatnonzero(allowed[b, :, j])
        out_bad[b, rows[:, None], heads[None, :], :] = True
        lse_bad[b, heads[:, None], rows[None, :]] = True
    else:
        rows = allowed[b, :, j]
        out_bad[b, np.flatnonzero(rows)[:, None], heads[None, :], p["e"]] = True
        out_free[b, np.flatnonzero(~rows)[:, None], heads[None, :], p["e"]] = True
    return out_bad, out_free, lse_bad


def check_nonfinite_rule(kind, B, Sq, Skv, H, Hkv, D, Dv, dtype, lengths, *, seed=0,
                         at=None, reaches=True, **kw):
    """Runs the op (on the default device) on inputs with one non-finite element in real data
    and checks the rule: non-finite exactly where it says (NaN for query/key elements, in out
    and lse), the rest equal to the float64 oracle, which must follow the same rule.
    ``reaches``: whether the element lies where some row allows it (else it is never read)."""
    import jax_varlen

    if NONFINITE_KINDS[kind][1] == np.inf:
        assert not kw.get("softcap"), "softcap maps an infinite score to a finite one"
    causal = kw.get("is_causal", False)
    q, k, v, n, p = nonfinite_inputs(kind, B, Sq, Skv, H, Hkv, D, Dv, dtype, lengths,
                                     seed=seed, at=at)
    out, lse = jax_varlen.attention(q, k, v, n, return_lse=True, **kw)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    hi_out, hi_lse = oracle_hi(q, k, v, n, return_lse=True, **kw)
    cpu = jax.devices("cpu")[0]
    base = None
    if jnp.dtype(dtype) != jnp.float32:
        args = [jax.device_put(np.asarray(x), cpu) for x in (q, k, v, n)]
        base = oracle_same_precision(*args, **kw)
    out_bad, out_free, lse_bad = expected_nonfinite(kind, p, Sq, Skv, H, Hkv, Dv, lengths,
                                                    causal)
    assert out_bad.any() == reaches, "the case does not test what it means to"
    # Where the rule says non-finite: ours and the oracle's (NaN for query and key elements:
    # the score is NaN or +inf, and exp(+inf - +inf) is NaN).
    nan_kind = NONFINITE_KINDS[kind][0] != "value"
    for name, got in (("ours", out), ("oracle", hi_out)):
        bad = got[out_bad]
        assert (np.isnan(bad) if nan_kind else ~np.isfinite(bad)).all(), (
            f"{name}: {int(np.isfinite(bad).sum())} of {bad.size} outputs the non-finite "
            f"element reaches are finite (a row that allows it was masked)")
    for name, got in (("ours", lse), ("oracle", hi_lse)):
        assert np.isnan(got[lse_bad]).all(), f"{name}: lse must be NaN in the rows it reaches"
    # Everywhere else (less the unasserted entries): the oracle's finite result.
    keep = ~(out_bad | out_free)
    masked = lambda x: np.where(keep, x, 0.0)  # noqa: E731
    assert_out_close(masked(out), masked(hi_out), None if base is None else masked(base),
                     dtype, what="out (entries the element does not reach)")
    assert_lse_close(np.where(lse_bad, 0.0, lse), np.where(lse_bad, 0.0, hi_lse))
    return out, lse

# --------------------------------------------------------------------------------------------
# The packed layout's helpers (test_packed.py, test_gpu_sm90.py).


def make_packed(lens_q, lens_k, H=4, Hkv=2, D=16, Dv=8, dtype=jnp.float32, tail_q=3, tail_k=5,
                seed=0, tail_value=np.nan):
    """Random packed query/key/value with ``tail_q``/``tail_k`` unused rows past the last
    offset (filled with ``tail_value``), and int32 offsets."""
    rng = np.random.default_rng(seed)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    Tq, Tk = int(cu_q[-1]) + tail_q, int(cu_k[-1]) + tail_k
    q = rng.standard_normal((Tq, H, D), dtype=np.float32)
    k = rng.standard_normal((Tk, Hkv, D), dtype=np.float32)
    v = rng.standard_normal((Tk, Hkv, Dv), dtype=np.float32)
    q[cu_q[-1]:] = tail_value
    k[cu_k[-1]:] = tail_value
    v[cu_k[-1]:] = tail_value
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    return q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k)


def packed_cotangents(q, v, seed=1):
    rng = np.random.default_rng(seed)
    ct_out = jnp.asarray(rng.standard_normal(q.shape[:2] + v.shape[-1:], dtype=np.float32), q.dtype)
    ct_lse = jnp.asarray(0.5 * rng.standard_normal((q.shape[1], q.shape[0]), dtype=np.float32))
    return ct_out, ct_lse


@functools.cache
def _packed_vjp(kw_key):
    kw = dict(kw_key)

    import jax_varlen

    def pullback(q, k, v, cu_q, cu_k, ct_out, ct_lse):
        def f(q, k, v):
            return jax_varlen.packed_attention(q, k, v, cu_q, cu_k, return_lse=True, **kw)

        return jax.vjp(f, q, k, v)[1]((ct_out, ct_lse))

    return jax.jit(pullback)


def packed_grads(q, k, v, cu_q, cu_k, ct_out, ct_lse, **kw):
    return _packed_vjp(tuple(sorted(kw.items())))(q, k, v, cu_q, cu_k, ct_out, ct_lse)


def cuda_plan(q, k, v, *, pack_seqs, rows, seqlen, dims=None, **plan_kw):
    """The CUDA plan (ffi/plan/plan.h) of a call with the dtype and heads of q [Tq, H, D],
    k [Tk, Hkv, D], v [Tk, Hkv, Dv] and head sizes ``dims`` (default (D, Dv)): ``pack_seqs``
    sequences over ``rows`` (query, key) rows per pack, grids of ``seqlen`` (query, key) rows;
    ``plan_kw`` gives the plan's other inputs (is_causal, window_left/right, compute_major)."""
    from jax_varlen import _ffi

    head_dim, head_dim_v = dims or (q.shape[2], v.shape[2])
    return _ffi.extension().plan(
        dtype=q.dtype.name, pack_seqs=pack_seqs, pack_rows_q=int(rows[0]), pack_rows_k=int(rows[1]),
        seqlen_q=int(seqlen[0]), seqlen_k=int(seqlen[1]), num_heads=q.shape[1],
        kv_num_heads=k.shape[1], head_dim=head_dim, head_dim_v=head_dim_v, **plan_kw)


def padded_alone(q, k, v, cu_q, cu_k, ct_out, ct_lse, b, grid_q, **kw):
    """Sequence b of a packed call alone through ``attention`` (B = 1, Skv = len_k): its out,
    lse and gradients (the packed cotangents' rows of b), on the kernel path that the packed
    call takes. Where the plan gives the packed call (query extent ``grid_q``: max_seqlen_q,
    else Tq) the one-pass kernels but a padded call of Sq = len_q rows split-KV, the short
    sequence gets leading query rows of zeros with zero cotangents, as many as the largest row
    block of any backward. They change no bit of the real rows: rows are
    independent in the forward, tail alignment counts from the last row, the backward groups
    rows in blocks that divide the lead, and a block of zero cotangents adds exact zeros to dK
    and dV."""
    import jax_varlen

    cq, ck = np.asarray(cu_q), np.asarray(cu_k)
    rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
    len_q, len_k = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
    Tq, Tk = q.shape[0], k.shape[0]
    packed = cuda_plan(q, k, v, pack_seqs=len(cq) - 1, rows=(Tq, Tk), seqlen=(grid_q, Tk))
    alone = lambda rows_q: cuda_plan(  # noqa: E731
        q, k, v, pack_seqs=1, rows=(rows_q, len_k), seqlen=(rows_q, len_k))
    lead = 0
    if not packed["split_keys"] and alone(len_q)["split_keys"]:
        # The Hopper backward's largest row block (at the smallest head-dim bucket), which every
        # backward's row block divides (its own at larger buckets, sm80's and the CPU's 64).
        lead = cuda_plan(q, k, v, pack_seqs=1, rows=(Tq, Tk), seqlen=(Tq, Tk),
                         dims=(8, 8))["bwd_block_m"]
        assert not alone(len_q + lead)["split_keys"], "the lead must move the call off split-KV"
    pad = lambda x, axis=0: jnp.concatenate(  # noqa: E731
        [jnp.zeros(x.shape[:axis] + (lead,) + x.shape[axis + 1:], x.dtype), x], axis)
    n = jnp.asarray([ck[b + 1] - ck[b]], jnp.int32)
    f = lambda q, k, v: jax_varlen.attention(q, k, v, n, return_lse=True, **kw)  # noqa: E731
    (out, lse), pullback = jax.vjp(f, pad(q[rq])[None], k[rk][None], v[rk][None])
    d_q, d_k, d_v = pullback((pad(ct_out[rq])[None], pad(ct_lse[:, rq], 1)[None]))
    return out[0, lead:], lse[0, :, lead:], d_q[0, lead:], d_k[0], d_v[0]


# --------------------------------------------------------------------------------------------
# The transformation tests' small problem (test_compose.py, test_backward.py's
# transformations): GQA, causal with a sequence shorter than Sq (empty rows), softcap, NaN
# padding, Dv = D (so that a layer's output can be added to its input).

SMALL_SHAPE = (2, 5, 7, 4, 2, 8)  # B, Sq, Skv, H, Hkv, D
SMALL_LENGTHS = [7, 3]
SMALL_KW = dict(is_causal=True, softcap=2.0)


def small_inputs(seed=0, dtype=jnp.float32, batch=SMALL_SHAPE[0], lengths=SMALL_LENGTHS):
    """``make_inputs`` of the small problem: q [batch, 5, 4, 8], k and v [batch, 7, 2, 8],
    lengths ``lengths[:batch]`` [batch]."""
    _, Sq, Skv, H, Hkv, D = SMALL_SHAPE
    return make_inputs(batch, Sq, Skv, H, Hkv, D, D, dtype, lengths[:batch], seed=seed)


def cos_weights(shape, phase=0.0):
    """float32 ``cos(0 + phase, 1 + phase, ...)`` of ``shape`` (any): non-uniform, deterministic
    weights for a scalar loss or a cotangent."""
    return jnp.cos(jnp.arange(np.prod(shape), dtype=jnp.float32) + phase).reshape(shape)


def assert_trees_close(got, want, atol, what=""):
    """Leaf by leaf (the same number of leaves, each of the same shape, any): ``got`` finite and
    within ``atol * max(1, max|want leaf|)`` of ``want``."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want), (what, len(got), len(want))
    for i, (a, w) in enumerate(zip(got, want)):
        a, w = np.asarray(a), np.asarray(w)
        assert a.shape == w.shape, (what, i, a.shape, w.shape)
        assert np.isfinite(a).all(), f"{what}[{i}] has non-finite entries"
        np.testing.assert_allclose(a, w, rtol=0, atol=atol * max(1.0, np.abs(w).max()),
                                   err_msg=f"{what}[{i}]")


# --------------------------------------------------------------------------------------------
# The multi-device cases (multi_device_cases.py, multi_device_backward_cases.py: 8 CPU devices).

COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")


def make_mesh(shape=(2, 4), names=("x", "y"), *, explicit=False):
    """A mesh of ``shape`` over jax's devices, every axis Explicit or else Auto."""
    from jax.sharding import AxisType

    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def full_spec(x) -> tuple:
    """x's PartitionSpec entries, padded with None to x's rank."""
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def collectives_in(compiled_text: str) -> list[str]:
    """The kinds of collective (``COLLECTIVES``) named in a compiled program's text."""
    return [c for c in COLLECTIVES if c in compiled_text]
