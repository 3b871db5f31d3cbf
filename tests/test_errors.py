"""Every bad input raises at trace time, naming the argument, the expected and the given value."""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_varlen

B, SQ, SKV, H, HKV, D, DV = 2, 5, 7, 4, 2, 8, 6


def _arr(shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


def _good(rank=4, dtype=jnp.float32):
    if rank == 4:
        shapes = (B, SQ, H, D), (B, SKV, HKV, D), (B, SKV, HKV, DV)
    else:
        shapes = (B, SQ, H * D), (B, SKV, HKV * D), (B, SKV, HKV * DV)
    return [_arr(s, dtype) for s in shapes] + [jnp.asarray([SKV, 3], jnp.int32)]


def _args(q_shape, k_shape, v_shape, dtype=jnp.float32, **kw):
    """Custom query/key/value shapes (and dtype) with valid lengths [1, 2]."""
    arrays = [_arr(q_shape, dtype), _arr(k_shape, dtype), _arr(v_shape, dtype)]
    return arrays + [jnp.asarray([1, 2], jnp.int32)], kw


def _with(index, value, rank=4, **kw):
    args = _good(rank)
    args[index] = value
    return args, kw


# id -> (builder () -> (args, kwargs), exception type, regex that must match the message,
#        whether the error also fires with traced arrays)
CASES = {
    "query-rank2": (lambda: _with(0, _arr((B, SQ))), ValueError,
                    r"query must have rank 3 .* or 4 .*got shape \(2, 5\)", True),
    "query-rank5": (lambda: _with(0, _arr((B, SQ, H, D, 1))), ValueError,
                    r"query must have rank 3 .* or 4 .*got shape \(2, 5, 4, 8, 1\)", True),
    "key-rank-differs": (lambda: _with(1, _arr((B, SKV, HKV * D))), ValueError,
                         r"key must have the rank of query \(4\), got shape \(2, 7, 16\)", True),
    "value-rank-differs": (lambda: _with(2, _arr((B, SKV, HKV, DV, 1))), ValueError,
                           r"value must have the rank of query \(4\), got shape \(2, 7, 2, 6, 1\)",
                           True),
    "rank3-without-num_heads": (lambda: (_good(3), {}), ValueError,
                                r"num_heads is required for rank-3.*got None", True),
    "rank3-num_heads-zero": (lambda: (_good(3), dict(num_heads=0)), ValueError,
                             r"num_heads must be a positive int, got 0", True),
    "rank3-query-not-divisible": (
        lambda: _with(0, _arr((B, SQ, 30)), rank=3, num_heads=4, kv_num_heads=2), ValueError,
        r"query's last dimension \(30\) must be a multiple of num_heads \(4\)", True),
    "rank3-key-not-divisible": (
        lambda: _with(1, _arr((B, SKV, 17)), rank=3, num_heads=4, kv_num_heads=2), ValueError,
        r"key's last dimension \(17\) must be a multiple of kv_num_heads \(2\)", True),
    "rank3-kv_num_heads-not-dividing": (
        lambda: _args((B, SQ, 4 * D), (B, SKV, 3 * D), (B, SKV, 3 * DV), num_heads=4,
                      kv_num_heads=3),
        ValueError, r"kv_num_heads = 3 must divide num_heads = 4", True),
    "rank3-kv_num_heads-defaulted": (  # the user gave no kv_num_heads: the message says so
        lambda: _args((B, SQ, 4 * D), (B, SKV, 3 * D), (B, SKV, 3 * DV), num_heads=4),
        ValueError, r"value's last dimension \(18\) must be a multiple of kv_num_heads, "
                    r"which defaults to num_heads \(4\).*pass kv_num_heads for grouped", True),
    "num_heads-mismatch-rank4": (lambda: (_good(), dict(num_heads=3)), ValueError,
                                 r"num_heads=3 does not match query's head axis.*\(2, 5, 4, 8\)",
                                 True),
    "kv_num_heads-mismatch-rank4": (
        lambda: (_good(), dict(kv_num_heads=4)), ValueError,
        r"kv_num_heads=4 does not match key's head axis.*\(2, 7, 2, 8\)", True),
    "kv_num_heads-not-dividing": (
        lambda: _args((B, SQ, 4, D), (B, SKV, 3, D), (B, SKV, 3, DV)),
        ValueError, r"key has 3 heads and query has 4: query's head count must be a multiple "
                    r"of key's.*\(2, 5, 4, 8\), key \(2, 7, 3, 8\)", True),
    "value-heads-differ": (lambda: _with(2, _arr((B, SKV, 1, DV))), ValueError,
                           r"value's head count must equal key's \(2\).*\(2, 7, 1, 6\)", True),
    "qk-head-size": (lambda: _with(1, _arr((B, SKV, HKV, D + 1))), ValueError,
                     r"key's head size must equal query's \(8\).*\(2, 7, 2, 9\)", True),
    "head-size-zero": (lambda: _args((B, SQ, H, 0), (B, SKV, HKV, 0), (B, SKV, HKV, DV)),
                       ValueError, r"head size must be at least 1.*\(2, 5, 4, 0\)", True),
    "value-head-size-zero": (lambda: _with(2, _arr((B, SKV, HKV, 0))), ValueError,
                             r"value's head size must be at least 1.*\(2, 7, 2, 0\)", True),
    "key-dtype-mix": (lambda: _with(1, _arr((B, SKV, HKV, D), jnp.float16)), TypeError,
                      r"key must have query's dtype \(float32\), got float16", True),
    "value-dtype-mix": (lambda: _with(2, _arr((B, SKV, HKV, DV), jnp.bfloat16)), TypeError,
                        r"value must have query's dtype \(float32\), got bfloat16", True),
    "query-int32": (
        lambda: _args((B, SQ, H, D), (B, SKV, HKV, D), (B, SKV, HKV, DV), jnp.int32),
        TypeError, r"query must be float32, float16 or bfloat16, got int32", True),
    "query-float64": (
        lambda: _args((B, SQ, H, D), (B, SKV, HKV, D), (B, SKV, HKV, DV), jnp.float64),
        TypeError, r"query must be float32, float16 or bfloat16, got float64", True),
    "lengths-float": (lambda: _with(3, jnp.asarray([1.0, 2.0])), TypeError,
                      r"nonpad_kv_seqlen must be int32 or int64, got float32", True),
    "lengths-wrong-shape": (lambda: _with(3, jnp.asarray([1, 2, 3], jnp.int32)), ValueError,
                            r"nonpad_kv_seqlen must have shape \[B\] = \(2,\), got \(3,\)", True),
    "lengths-2d": (lambda: _with(3, jnp.asarray([[1], [2]], jnp.int32)), ValueError,
                   r"nonpad_kv_seqlen must have shape \[B\] = \(2,\), got \(2, 1\)", True),
    "key-batch-mismatch": (lambda: _with(1, _arr((3, SKV, HKV, D))), ValueError,
                           r"key's batch extent must equal query's \(2\).*\(3, 7, 2, 8\)", True),
    "value-batch-mismatch": (lambda: _with(2, _arr((1, SKV, HKV, DV))), ValueError,
                             r"value's batch extent must equal query's \(2\).*\(1, 7, 2, 6\)",
                             True),
    "kv-seqlen-mismatch": (lambda: _with(2, _arr((B, SKV + 1, HKV, DV))), ValueError,
                           r"value's sequence extent must equal key's \(7\).*\(2, 8, 2, 6\)",
                           True),
    "softcap-negative": (lambda: (_good(), dict(softcap=-1.0)), ValueError,
                         r"softcap must be a finite value >= 0.*got -1\.0", True),
    "softcap-nan": (lambda: (_good(), dict(softcap=math.nan)), ValueError,
                    r"softcap must be a finite value >= 0.*got nan", True),
    "softcap-inf": (lambda: (_good(), dict(softcap=math.inf)), ValueError,
                    r"softcap must be a finite value >= 0.*got inf", True),
    "scale-inf": (lambda: (_good(), dict(scale=math.inf)), ValueError,
                  r"scale must be finite, got inf", True),
    "scale-neg-inf": (lambda: (_good(), dict(scale=-math.inf)), ValueError,
                      r"scale must be finite, got -inf", True),
    "scale-nan": (lambda: (_good(), dict(scale=math.nan)), ValueError,
                  r"scale must be finite, got nan", True),
    "lengths-negative": (lambda: _with(3, np.asarray([7, -1], np.int32)), ValueError,
                         r"nonpad_kv_seqlen\[1\] = -1 is out of range.*0 <= n <= Skv = 7", False),
    "lengths-past-skv": (lambda: _with(3, jnp.asarray([8, 2], jnp.int32)), ValueError,
                         r"nonpad_kv_seqlen\[0\] = 8 is out of range.*0 <= n <= Skv = 7", False),
    "lengths-int64-past-int32": (lambda: _with(3, np.asarray([2**32 + 3, 1], np.int64)),
                                 ValueError, r"nonpad_kv_seqlen\[0\] = 4294967299 is out of range",
                                 False),
}

# float64 arrays only exist with x64 on (without it jnp and jit turn them into float32).
_X64 = {"query-float64"}


def _context(name):
    return jax.enable_x64(True) if name in _X64 else contextlib.nullcontext()


@pytest.mark.parametrize("name", list(CASES))
def test_raises_eagerly(name):
    build, exc, match, _ = CASES[name]
    with _context(name):
        args, kw = build()
        with pytest.raises(exc, match=match):
            jax_varlen.attention(*args, **kw)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[3]])
def test_raises_at_trace_time(name):
    """Shape/dtype/attribute errors fire while tracing (abstract arrays, nothing runs)."""
    build, exc, match, _ = CASES[name]
    with _context(name):
        args, kw = build()
        specs = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in args]
        with pytest.raises(exc, match=match):
            jax.eval_shape(lambda *a: jax_varlen.attention(*a, **kw), *specs)
        with pytest.raises(exc, match=match):
            jax.jit(lambda *a: jax_varlen.attention(*a, **kw)).trace(*args)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c[3]])
def test_concrete_lengths_raise_inside_jit(name):
    """Lengths that are concrete while tracing (closed over) are checked like eager ones."""
    build, exc, match, _ = CASES[name]
    args, kw = build()
    lengths = np.asarray(args[3])
    with pytest.raises(exc, match=match):
        jax.jit(lambda q, k, v: jax_varlen.attention(q, k, v, lengths, **kw))(*args[:3])


def test_valid_inputs_do_not_raise():
    """The base of every case above is valid, so each error comes from the one change."""
    for rank, kw in ((4, {}), (3, dict(num_heads=H, kv_num_heads=HKV))):
        out = jax_varlen.attention(*_good(rank), **kw)
        assert out.shape == ((B, SQ, H, DV) if rank == 4 else (B, SQ, H * DV))


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(is_causal="yes"), TypeError, r"is_causal must be a bool, got 'yes'"),
        (dict(scale="0.5"), TypeError, r"scale must be a Python float or None, got str"),
        (dict(softcap=None), TypeError, r"softcap must be a Python float, got NoneType"),
        (dict(num_heads=2.0), ValueError, r"num_heads must be a positive int, got 2\.0"),
    ],
    ids=["is_causal-str", "scale-str", "softcap-none", "num_heads-float"],
)
def test_bad_attribute_types(kw, exc, match):
    args = _good(3 if "num_heads" in kw else 4)
    with pytest.raises(exc, match=match):
        jax_varlen.attention(*args, **kw)


def test_non_array_argument():
    args = _good()
    args[1] = [[0.0]]
    with pytest.raises(TypeError, match=r"key must be an array, got list"):
        jax_varlen.attention(*args)


@pytest.mark.parametrize("value", [None, 1, "yes", np.array([True])],
                         ids=["none", "int", "str", "array"])
def test_return_lse_must_be_a_bool(value):
    with pytest.raises(TypeError, match=r"return_lse must be a bool, got"):
        jax_varlen.attention(*_good(), return_lse=value)


@pytest.mark.parametrize(
    "name, value",
    [("is_causal", True), ("return_lse", True), ("scale", 0.5), ("softcap", 2.0)],
)
def test_traced_static_attribute_says_static_argnames(name, value):
    """A static attribute passed as a traced jit argument: say what to do instead."""
    args = _good()
    f = jax.jit(lambda x: jax_varlen.attention(*args, **{name: x}))
    match = (rf"{name} must be a static Python value, got a traced one.*"
             rf"static_argnames \(jax\.jit\(f, static_argnames=\"{name}\"\)\).*functools\.partial")
    with pytest.raises(TypeError, match=match):
        f(value)
    # ... and what it suggests works.
    out = jax.jit(lambda *a, **kw: jax_varlen.attention(*a, **kw),
                  static_argnames=name)(*args, **{name: value})
    assert out is not None


def test_numpy_float64_inputs_are_canonicalized_like_jax():
    """With x64 off, NumPy float64 becomes float32 (JAX's dtype canonicalization, which
    jax.nn.dot_product_attention applies too); the result is the float32 call's."""
    assert not jax.config.jax_enable_x64
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, SQ, H, D))
    k = rng.standard_normal((B, SKV, HKV, D))
    v = rng.standard_normal((B, SKV, HKV, D))
    n = np.asarray([SKV, 3])  # int64 NumPy lengths are accepted as they are
    assert q.dtype == np.float64
    ours = jax_varlen.attention(q, k, v, n)
    assert ours.dtype == jnp.float32
    f32 = jax_varlen.attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), n)
    assert np.asarray(ours).tobytes() == np.asarray(f32).tobytes()
    assert jax.nn.dot_product_attention(q, np.repeat(k, 2, 2), np.repeat(v, 2, 2)).dtype == jnp.float32
    # Rank 3 and a mix of NumPy float64 and JAX float32 arrays canonicalize the same way.
    mixed = jax_varlen.attention(q.reshape(B, SQ, -1), jnp.asarray(k.reshape(B, SKV, -1), jnp.float32),
                                 v.reshape(B, SKV, -1), n, num_heads=H, kv_num_heads=HKV)
    assert np.asarray(mixed).tobytes() == np.asarray(f32).reshape(B, SQ, -1).tobytes()


def test_numpy_float64_with_x64_is_rejected():
    """With x64 on, float64 stays float64 (as in JAX), which the op does not take."""
    with jax.enable_x64(True):
        q = np.zeros((B, SQ, H, D))
        k = v = np.zeros((B, SKV, HKV, D))
        with pytest.raises(TypeError, match=r"query must be float32, float16 or bfloat16, got float64"):
            jax_varlen.attention(q, k, v, np.asarray([SKV, 3]))


# --------------------------------------------------------------------------------------------
# local_window_size and sinks (issue 34): each error names the argument and the given value.


@pytest.mark.parametrize(
    "window, exc, match",
    [
        (-1, ValueError, r"local_window_size must be >= 0 .*got -1"),
        ((4, -2), ValueError, r"local_window_size must be >= 0 .*got \(4, -2\)"),
        ((1, 2, 3), ValueError, r"local_window_size must be an int or a pair \(left, right\), "
                                r"got \(1, 2, 3\) \(length 3\)"),
        ([5], ValueError, r"local_window_size must be an int or a pair .*got \[5\] \(length 1\)"),
        (2.5, TypeError, r"local_window_size must be None, an int >= 0 or a pair .*got 2\.5"),
        (True, TypeError, r"local_window_size must be None, an int >= 0 or a pair .*got True"),
        ((1, "2"), TypeError, r"local_window_size must be None, an int >= 0 .*got \(1, '2'\)"),
    ],
    ids=["negative", "pair-negative", "pair-of-three", "list-of-one", "float", "bool",
         "pair-with-str"],
)
def test_bad_local_window_size(window, exc, match):
    with pytest.raises(exc, match=match):
        jax_varlen.attention(*_good(), local_window_size=window)
    q, k, v = (x[0] for x in _good()[:3])
    with pytest.raises(exc, match=match):
        jax_varlen.packed_attention(q, k, v, jnp.asarray([0, 3]), jnp.asarray([0, 4]),
                                    local_window_size=window)


def test_traced_local_window_size_says_static_argnames():
    args = _good()
    with pytest.raises(TypeError, match=r"local_window_size must be a static Python value.*"
                                        r"static_argnames"):
        jax.jit(lambda w: jax_varlen.attention(*args, local_window_size=w))(3)
    with pytest.raises(TypeError, match=r"local_window_size must be a static Python value"):
        jax.jit(lambda w: jax_varlen.attention(*args, local_window_size=(w, 2)))(3)


@pytest.mark.parametrize(
    "sinks, exc, match",
    [
        (jnp.zeros((H + 1,)), ValueError, r"sinks must have shape \[H\] = \(4,\) .*got \(5,\)"),
        (jnp.zeros((1, H)), ValueError, r"sinks must have shape \[H\] = \(4,\) .*got \(1, 4\)"),
        (jnp.zeros((), jnp.float32), ValueError, r"sinks must have shape \[H\] = \(4,\).*got \(\)"),
        (jnp.zeros((H,), jnp.int32), TypeError, r"sinks must be a float array \[H\], got int32"),
        ("no", TypeError, r"sinks must be an array, got str"),
    ],
    ids=["too-long", "2d", "scalar", "int", "str"],
)
def test_bad_sinks(sinks, exc, match):
    with pytest.raises(exc, match=match):
        jax_varlen.attention(*_good(), sinks=sinks)
    q, k, v = (x[0] for x in _good()[:3])
    with pytest.raises(exc, match=match):
        jax_varlen.packed_attention(q, k, v, jnp.asarray([0, 3]), jnp.asarray([0, 4]), sinks=sinks)
    if not isinstance(sinks, str):  # traced: the same check, at trace time
        with pytest.raises(exc, match=match):
            jax.jit(lambda s: jax_varlen.attention(*_good(), sinks=s)).trace(sinks)


def test_sinks_as_a_list_and_float16():
    want = jax_varlen.attention(*_good(), sinks=jnp.asarray([0.5, -1.0, 0.0, 2.0]))
    for s in ([0.5, -1.0, 0.0, 2.0], np.asarray([0.5, -1.0, 0.0, 2.0]),
              jnp.asarray([0.5, -1.0, 0.0, 2.0], jnp.float16)):
        assert np.asarray(jax_varlen.attention(*_good(), sinks=s)).tobytes() == \
            np.asarray(want).tobytes()
