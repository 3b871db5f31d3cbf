"""The op on 8 CPU devices: sharded jit, shard_map, sequence-parallel decode, sharded export.

Not collected by a plain ``pytest tests`` run (the name does not match ``test_*.py``):
``test_sharding.py::test_multi_device_cases`` runs this file in a subprocess whose XLA_FLAGS
give the CPU 8 devices, so the device count of every other test file is left alone. To run it
by hand (from a folder other than the repository root, whose ``jax_varlen/`` lacks the built
extension):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        pytest /path/to/tests/multi_device_cases.py
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_varlen
from conftest import (assert_lse_close, assert_out_close, bits, collectives_in, full_spec, make_inputs,
                      make_mesh, needs_flatbuffers, oracle_hi)

if jax.device_count() < 8:
    raise RuntimeError(
        f"multi_device_cases.py needs 8 devices, jax sees {jax.device_count()}: run it with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 (test_sharding.py does)"
    )

B, SQ, SKV, D, DV = 8, 5, 48, 16, 8
LENGTHS = [0, 1, 17, 48, 5, 33, 48, 2]


def _put(mesh, arrays, specs):
    return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs)]


def _fn(**kw):
    def f(q, k, v, n):
        return jax_varlen.attention(q, k, v, n, return_lse=True, **kw)

    return f


# --------------------------------------------------------------------------------------------
# Sharded jit: batch and whole kv-head groups split with no communication.

LAYOUTS = {  # name -> (batch axes, head axes)
    "batch": ("x", None),
    "heads": (None, "y"),
    "both": ("x", "y"),
    "batch-2axes": (("x", "y"), None),
    "both-swapped": ("y", "x"),
}


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "dtype, heads, kw",
    [
        (jnp.float32, (8, 4), dict(is_causal=True)),
        (jnp.bfloat16, (4, 4), dict(softcap=3.0)),
    ],
    ids=["f32-gqa-causal", "bf16-mha-softcap"],
)
def test_sharded_jit_no_collectives(explicit, layout, dtype, heads, kw):
    H, HKV = heads
    args = make_inputs(B, SQ, SKV, H, HKV, D, DV, dtype, LENGTHS, seed=11)
    ref_out, ref_lse = _fn(**kw)(*args)  # one device
    mesh = make_mesh(explicit=explicit)
    b, h = LAYOUTS[layout]
    qkv = P(b, None, h, None)
    sharded = _put(mesh, args, (qkv, qkv, qkv, P(b)))
    f = jax.jit(_fn(**kw))
    assert collectives_in(f.lower(*sharded).compile().as_text()) == []
    out, lse = f(*sharded)
    assert full_spec(out) == (b, None, h, None) and full_spec(lse) == (b, h, None)
    # Batch invariance: a device's block gives the bits the whole batch gives.
    assert bits(out) == bits(ref_out) and bits(lse) == bits(ref_lse)


def _sharded_like_one_device(f, args, specs, b, h):
    """f(*args) -> (out [B, S, H, Dv], lse [B, H, S]) under jit with args placed by specs on
    the (2, 4) mesh: no collective in the compiled program, out and lse sharded over batch b
    and heads h, and the bits of the one-device call."""
    ref_out, ref_lse = jax.jit(f)(*args)  # one device
    sharded = _put(make_mesh(), args, specs)
    g = jax.jit(f)
    assert collectives_in(g.lower(*sharded).compile().as_text()) == []
    out, lse = g(*sharded)
    assert full_spec(out) == (b, None, h, None) and full_spec(lse) == (b, h, None)
    assert bits(out) == bits(ref_out) and bits(lse) == bits(ref_lse)


@pytest.mark.parametrize("layout", ["batch", "heads", "both"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed-q-counts"])
def test_sinks_sharded_no_collectives(layout, packed):
    """Sinks in the kernels' denominators: the sinks [H] split with the heads, the batch and
    whole kv-head groups with no communication; the bits of the one-device call."""
    H, HKV = 8, 4
    q, k, v, n = make_inputs(B, SQ, SKV, H, HKV, D, DV, jnp.float32, LENGTHS, seed=3)
    sinks = jnp.asarray(np.linspace(-1.0, 2.0, H), jnp.float32)
    n_q = jnp.asarray([5, 1, 0, 3, 5, 2, 4, 5], jnp.int32)

    def f(q, k, v, n, n_q, s):
        return jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=n_q if packed else None,
                                    sinks=s, is_causal=True, return_lse=True)

    b, h = LAYOUTS[layout]
    qkv = P(b, None, h, None)
    _sharded_like_one_device(f, (q, k, v, n, n_q, sinks), (qkv, qkv, qkv, P(b), P(b), P(h)), b, h)


@pytest.mark.parametrize("layout", ["batch", "heads", "both"])
def test_paged_sharded_no_collectives(layout):
    """paged_attention read in place (the paged primitive): the batch (queries, lengths, block
    table) and whole kv-head groups (the caches' head axis) split with no communication, the
    pages whole on every device; the bits of the one-device call."""
    H, HKV, PAGE, MAX_PAGES = 8, 4, 16, 4
    num_pages = B * MAX_PAGES
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((B, 1, H, D)), jnp.bfloat16)
    kc = jnp.asarray(rng.standard_normal((num_pages, PAGE, HKV, D)), jnp.bfloat16)
    vc = jnp.asarray(rng.standard_normal((num_pages, PAGE, HKV, DV)), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(num_pages).reshape(B, MAX_PAGES), jnp.int32)
    n = jnp.asarray([0, 1, 17, 64, 5, 33, 48, 2], jnp.int32)

    def f(q, kc, vc, table, n):
        return jax_varlen.paged_attention(q, kc, vc, table, n, is_causal=True, return_lse=True)

    assert "jax_varlen_paged_attention_fwd" in str(jax.make_jaxpr(f)(q, kc, vc, table, n))
    b, h = LAYOUTS[layout]
    cache = P(None, None, h, None)
    _sharded_like_one_device(f, (q, kc, vc, table, n),
                             (P(b, None, h, None), cache, cache, P(b), P(b)), b, h)


@pytest.mark.parametrize("layout", ["batch", "heads", "both"])
def test_query_counts_sharded_no_collectives(layout):
    """attention(..., nonpad_q_seqlen=...) splits over batch and heads with no communication,
    forward and gradients, and gives the single-device bits."""
    n_q = [5, 0, 3, 5, 1, 4, 2, 5]
    q, k, v, n = make_inputs(B, SQ, SKV, 8, 4, D, DV, jnp.float32, LENGTHS, seed=13, pad_value=0.0)
    nq = jnp.asarray(n_q, jnp.int32)

    def f(q, k, v, n, nq):
        return jax_varlen.attention(q, k, v, n, nonpad_q_seqlen=nq, is_causal=True,
                                    return_lse=True)

    def loss(q, k, v, n, nq):
        return jnp.sum(f(q, k, v, n, nq)[0] ** 2)

    fwd, grad = jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    args = (q, k, v, n, nq)
    ref_fwd, ref_grad = fwd(*args), grad(*args)
    b, h = LAYOUTS[layout]
    qkv = P(b, None, h, None)
    sharded = _put(make_mesh(), args, (qkv, qkv, qkv, P(b), P(b)))
    for fn, ref in ((fwd, ref_fwd), (grad, ref_grad)):
        assert collectives_in(fn.lower(*sharded).compile().as_text()) == []
        for got, want in zip(fn(*sharded), ref):
            assert bits(got) == bits(want)


def test_sharded_jit_rank3_gqa():
    q, k, v, n = make_inputs(B, SQ, SKV, 8, 4, D, DV, jnp.float32, LENGTHS, seed=12, rank=3)
    f = jax.jit(functools.partial(jax_varlen.attention, num_heads=8, kv_num_heads=4))
    ref = f(q, k, v, n)
    mesh = make_mesh()
    # [B, S, H*D] split over 'y' (4) on its last axis is whole heads: (8 * 16) / 4 = 2 heads.
    qkv = P("x", None, "y")
    sharded = _put(mesh, (q, k, v, n), (qkv, qkv, qkv, P("x")))
    assert collectives_in(f.lower(*sharded).compile().as_text()) == []
    assert bits(f(*sharded)) == bits(ref)


def test_sharded_grad_no_collectives():
    """jax.grad through the op splits over batch and heads with no communication either."""
    args = make_inputs(B, SQ, SKV, 8, 4, D, DV, jnp.float32, LENGTHS, seed=24, pad_value=0.0)

    def loss(q, k, v, n):
        return jnp.sum(jax_varlen.attention(q, k, v, n, is_causal=True) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    ref = grad(*args)
    mesh = make_mesh()
    qkv = P("x", None, "y")
    sharded = _put(mesh, args, (qkv, qkv, qkv, P("x")))
    assert collectives_in(grad.lower(*sharded).compile().as_text()) == []
    for got, want in zip(grad(*sharded), ref):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_packed_sharded_over_heads_no_collectives(explicit):
    """packed_attention [T, H, D] split over whole kv-head groups: no communication, forward
    and gradients, and the single-device bits."""
    rng = np.random.default_rng(31)
    cu_q = jnp.asarray([0, 5, 5, 22, 40], jnp.int32)
    cu_k = jnp.asarray([0, 9, 12, 12, 47], jnp.int32)
    q = jnp.asarray(rng.standard_normal((43, 8, D), dtype=np.float32))
    k = jnp.asarray(rng.standard_normal((48, 4, D), dtype=np.float32))
    v = jnp.asarray(rng.standard_normal((48, 4, DV), dtype=np.float32))

    def f(q, k, v, cu_q, cu_k):
        return jax_varlen.packed_attention(q, k, v, cu_q, cu_k, is_causal=True, return_lse=True)

    def loss(q, k, v, cu_q, cu_k):
        out, _ = f(q, k, v, cu_q, cu_k)
        return jnp.sum(out * out)

    fwd, grad = jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    ref_out, ref_lse = fwd(q, k, v, cu_q, cu_k)
    ref_grads = grad(q, k, v, cu_q, cu_k)
    mesh = make_mesh(explicit=explicit)
    heads = P(None, "y", None)
    sharded = _put(mesh, (q, k, v, cu_q, cu_k), (heads, heads, heads, P(), P()))
    assert collectives_in(fwd.lower(*sharded).compile().as_text()) == []
    assert collectives_in(grad.lower(*sharded).compile().as_text()) == []
    out, lse = fwd(*sharded)
    assert full_spec(out) == (None, "y", None) and full_spec(lse) == ("y", None)
    assert bits(out) == bits(ref_out) and bits(lse) == bits(ref_lse)
    for got, want in zip(grad(*sharded), ref_grads):
        assert bits(got) == bits(want)


def test_sharded_jit_gspmd():
    """The GSPMD callbacks (jax_use_shardy_partitioner=False) split the same way."""
    args = make_inputs(B, SQ, SKV, 8, 4, D, DV, jnp.float32, LENGTHS, seed=13)
    ref = _fn()(*args)
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        mesh = make_mesh()
        qkv = P("x", None, "y")
        sharded = _put(mesh, args, (qkv, qkv, qkv, P("x")))
        f = jax.jit(_fn())
        assert collectives_in(f.lower(*sharded).compile().as_text()) == []
        out = f(*sharded)
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)
    assert bits(out[0]) == bits(ref[0]) and bits(out[1]) == bits(ref[1])


@pytest.mark.parametrize(
    "heads, head_axes, kv_split",
    [
        ((8, 1), "y", False),  # MQA: one kv head cannot be split
        ((8, 2), "y", False),  # 4 devices for 2 kv heads
        ((8, 2), ("x", "y"), False),  # 8 devices for 2 kv heads: 'x' (2) is kept, 'y' gathered
    ],
    ids=["mqa", "gqa-2kv-over-4", "gqa-2kv-over-8"],
)
def test_heads_not_divisible_fall_back_correctly(heads, head_axes, kv_split):
    """Documented fallback: the heads are gathered before the call; the result is exact."""
    H, HKV = heads
    args = make_inputs(B, SQ, SKV, H, HKV, D, DV, jnp.float32, LENGTHS, seed=14)
    ref_out, ref_lse = _fn(is_causal=True)(*args)
    mesh = make_mesh()
    q_spec = P(None, None, head_axes, None)
    sharded = _put(mesh, args, (q_spec, P(), P(), P()))
    f = jax.jit(_fn(is_causal=True))
    assert "all-gather" in collectives_in(f.lower(*sharded).compile().as_text())
    out, lse = f(*sharded)
    assert bits(out) == bits(ref_out) and bits(lse) == bits(ref_lse)


def test_explicit_conflicting_batch_axes_is_an_error():
    args = make_inputs(B, SQ, SKV, 4, 4, D, DV, jnp.float32, LENGTHS, seed=15)
    mesh = make_mesh(explicit=True)
    sharded = _put(mesh, args, (P("x"), P("y"), P("y"), P("x")))
    with pytest.raises(ValueError, match=r"split factor 'b' over different mesh axes.*reshard"):
        jax.jit(_fn())(*sharded)


# --------------------------------------------------------------------------------------------
# shard_map: the op on each device's block.


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map(check_vma):
    args = make_inputs(B, SQ, SKV, 8, 4, D, DV, jnp.bfloat16, LENGTHS, seed=16)
    ref_out, ref_lse = _fn(is_causal=True)(*args)
    mesh = make_mesh()
    qkv = P("x", None, "y")
    f = jax.jit(jax.shard_map(_fn(is_causal=True), mesh=mesh, in_specs=(qkv, qkv, qkv, P("x")),
                              out_specs=(qkv, P("x", "y")), check_vma=check_vma))
    sharded = _put(mesh, args, (qkv, qkv, qkv, P("x")))
    assert collectives_in(f.lower(*sharded).compile().as_text()) == []
    out, lse = f(*sharded)
    assert bits(out) == bits(ref_out) and bits(lse) == bits(ref_lse)


def test_shard_map_with_grad_inside():
    """Each device differentiates its own block's loss: the blocks of the global gradient
    (the loss is a sum over blocks), against the reference's. check_vma=True is the strict
    case: the backward's scan carries must keep their varying types."""
    q, k, v, n = make_inputs(B, SQ, SKV, 8, 4, D, DV, jnp.float32, LENGTHS, seed=25)
    w = jnp.cos(jnp.arange(B * SQ * 8 * DV, dtype=jnp.float32)).reshape(B, SQ, 8, DV)

    def loss(attn):
        return lambda q, k, v, n, w: jnp.sum(attn(q, k, v, n, is_causal=True, softcap=3.0) * w)

    mesh = make_mesh()
    qkv = P("x", None, "y")
    local_grad = jax.grad(loss(jax_varlen.attention), argnums=(0, 1, 2))
    f = jax.jit(jax.shard_map(local_grad, mesh=mesh, in_specs=(qkv, qkv, qkv, P("x"), qkv),
                              out_specs=(qkv, qkv, qkv), check_vma=True))
    args = _put(mesh, (q, k, v, n, w), (qkv, qkv, qkv, P("x"), qkv))
    assert collectives_in(f.lower(*args).compile().as_text()) == []
    got = f(*args)
    ref = jax.jit(jax.grad(loss(jax_varlen.reference), argnums=(0, 1, 2)))(q, k, v, n, w)
    for name, a, b in zip("qkv", got, ref):
        assert full_spec(a)[:3] == ("x", None, "y")
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(a).all(), f"d{name} has non-finite entries"
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * max(1.0, np.abs(b).max()),
                                   err_msg=f"d{name}")


def test_shard_map_check_vma_rejects_replicated_out_specs():
    """The result varies over the axes its operands vary over, so out_specs=P() is caught."""
    args = make_inputs(B, SQ, SKV, 4, 4, D, DV, jnp.float32, LENGTHS, seed=17)
    mesh = make_mesh()
    f = jax.shard_map(lambda *a: jax_varlen.attention(*a), mesh=mesh,
                      in_specs=(P("x"), P("x"), P("x"), P("x")), out_specs=P(), check_vma=True)
    with pytest.raises(Exception, match=r"(?i)vary|replicat"):
        jax.jit(f)(*args)


# --------------------------------------------------------------------------------------------
# Sequence-parallel decode: the KV cache split along its sequence axis.

SP_SKV = 64
SP_LENGTHS = [0, 1, 16, 17, 64, 31, 48, 5]  # slice 16 on 4 devices: boundaries, empty tails


def _sp_mesh(explicit=False):
    return make_mesh((2, 4), ("b", "s"), explicit=explicit)


@pytest.mark.parametrize(
    "dtype, sq, heads, causal, batch_axis, explicit",
    [
        (jnp.float32, 1, (8, 2), True, None, False),
        (jnp.float32, 1, (8, 2), False, "b", False),
        (jnp.float32, 4, (4, 4), False, None, True),
        (jnp.bfloat16, 1, (8, 1), True, "b", False),
        (jnp.float16, 3, (8, 4), False, "b", True),
    ],
    ids=["f32-decode-causal", "f32-decode-batchsplit", "f32-sq4-explicit",
         "bf16-mqa-decode-causal", "f16-sq3-batchsplit-explicit"],
)
def test_sequence_parallel_matches_single_device(dtype, sq, heads, causal, batch_axis, explicit):
    H, HKV = heads
    q, k, v, n = make_inputs(B, sq, SP_SKV, H, HKV, D, DV, dtype, SP_LENGTHS, seed=18)
    mesh = _sp_mesh(explicit)
    out, lse = jax_varlen.sequence_parallel_attention(
        q, k, v, n, mesh=mesh, axis_name="s", batch_axis=batch_axis, is_causal=causal,
        return_lse=True)
    assert out.shape == (B, sq, H, DV) and out.dtype == dtype and lse.shape == (B, H, sq)
    hi_out, hi_lse = oracle_hi(q, k, v, n, is_causal=causal, return_lse=True)
    assert_out_close(out, hi_out, None, dtype)
    assert_lse_close(lse, hi_lse)
    if dtype == jnp.float32:  # and against the op on one device, to fp32 rounding
        ref_out, ref_lse = _fn(is_causal=causal)(q, k, v, n)
        np.testing.assert_allclose(out, ref_out, rtol=0, atol=2e-6)
        np.testing.assert_allclose(lse, ref_lse, rtol=2e-6)


@pytest.mark.parametrize("sq", [1, 4])
def test_sequence_parallel_with_sinks(sq):
    """Sinks join the merged row once: the one-device attention(..., sinks=...) result (to
    fp32 rounding), and d_sinks and d_query through the shards, the gather and the merge."""
    q, k, v, n = make_inputs(B, sq, SP_SKV, 8, 4, D, DV, jnp.float32, SP_LENGTHS, seed=23)
    sinks = jnp.asarray(np.linspace(-1.0, 1.5, 8), jnp.float32)
    mesh = _sp_mesh(False)
    sp = functools.partial(jax_varlen.sequence_parallel_attention, mesh=mesh, axis_name="s",
                           batch_axis="b", return_lse=True)
    out, lse = jax.jit(lambda q, s: sp(q, k, v, n, sinks=s))(q, sinks)
    ref_out, ref_lse = jax.jit(lambda q, s: jax_varlen.attention(
        q, k, v, n, sinks=s, return_lse=True))(q, sinks)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-6)
    assert (np.asarray(lse)[np.asarray(n) == 0] == np.asarray(sinks)[:, None]).all()

    def loss(fn, q, s):
        return jnp.sum(fn(q, s)[0] ** 2)

    got = jax.jit(jax.grad(functools.partial(loss, lambda q, s: sp(q, k, v, n, sinks=s)),
                           argnums=(0, 1)))(q, sinks)
    want = jax.jit(jax.grad(functools.partial(loss, lambda q, s: jax_varlen.attention(
        q, k, v, n, sinks=s, return_lse=True)), argnums=(0, 1)))(q, sinks)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.abs(w).max()))


def test_sequence_parallel_with_head_axis_rank3_under_jit():
    mesh = jax.make_mesh((2, 2, 2), ("b", "s", "h"), axis_types=(AxisType.Auto,) * 3)
    q, k, v, n = make_inputs(B, 1, SP_SKV, 8, 4, D, DV, jnp.float32, SP_LENGTHS, seed=19, rank=3)
    f = jax.jit(functools.partial(
        jax_varlen.sequence_parallel_attention, mesh=mesh, axis_name="s", batch_axis="b",
        head_axis="h", num_heads=8, kv_num_heads=4, is_causal=True))
    out = f(q, k, v, n)
    ref = jax_varlen.attention(q, k, v, n, num_heads=8, kv_num_heads=4, is_causal=True)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)


def test_sequence_parallel_is_deterministic_and_replicated():
    q, k, v, n = make_inputs(B, 1, SP_SKV, 8, 2, D, DV, jnp.bfloat16, SP_LENGTHS, seed=20)
    f = jax.jit(functools.partial(jax_varlen.sequence_parallel_attention, mesh=_sp_mesh(),
                                  axis_name="s", return_lse=True))
    first, again = f(q, k, v, n), f(q, k, v, n)
    assert bits(first[0]) == bits(again[0]) and bits(first[1]) == bits(again[1])
    # Replicated along 's': every device that holds a block holds the same bits.
    shards = {}
    for s in first[0].addressable_shards:
        shards.setdefault(str(s.index), set()).add(bits(s.data))
    assert all(len(v) == 1 for v in shards.values())


def test_sequence_parallel_eager_calls_reuse_one_program():
    """Called eagerly, the op builds its jitted shard_map once per (mesh, axes, config):
    repeated calls -- a decode loop outside jit -- reuse it instead of tracing a new closure
    each time (about 6 s a call on these 8 CPU devices before), with the same bits as the
    op under the user's jit."""
    from jax_varlen import _seqpar

    q, k, v, n = make_inputs(B, 1, SP_SKV, 8, 2, D, DV, jnp.float32, SP_LENGTHS, seed=21)
    kw = dict(mesh=_sp_mesh(), axis_name="s", return_lse=True)
    first = jax_varlen.sequence_parallel_attention(q, k, v, n, **kw)
    hits = _seqpar._sharded_call.cache_info().hits
    again = jax_varlen.sequence_parallel_attention(q, k, v, n, **kw)
    assert _seqpar._sharded_call.cache_info().hits == hits + 1
    jitted = jax.jit(functools.partial(jax_varlen.sequence_parallel_attention, **kw))(q, k, v, n)
    for a, b_ in ((first, again), (first, jitted)):
        assert bits(a[0]) == bits(b_[0]) and bits(a[1]) == bits(b_[1])


@pytest.mark.parametrize(
    "sq, heads, causal, batch_axis, explicit",
    [(1, (8, 2), True, "b", False), (4, (4, 4), False, None, True)],
    ids=["decode-causal-batchsplit", "sq4-explicit"],
)
def test_sequence_parallel_grad_matches_single_device(sq, heads, causal, batch_axis, explicit):
    """Gradients flow through the sliced call, the all-gather and the merge: they equal the
    single-device op's gradient (the padded and out-of-slice keys get exactly zero)."""
    H, HKV = heads
    q, k, v, n = make_inputs(B, sq, SP_SKV, H, HKV, D, DV, jnp.float32, SP_LENGTHS, seed=26)
    w = jnp.cos(jnp.arange(B * sq * H * DV, dtype=jnp.float32)).reshape(B, sq, H, DV)
    mesh = _sp_mesh(explicit)
    sp = functools.partial(jax_varlen.sequence_parallel_attention, mesh=mesh, axis_name="s",
                           batch_axis=batch_axis)

    def loss(attn):
        return lambda q, k, v: jnp.sum(attn(q, k, v, n, is_causal=causal) * w)

    with jax.set_mesh(mesh):
        got = jax.jit(jax.grad(loss(sp), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(jax_varlen.attention), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6,
                                   err_msg=f"d{name}")
    for b, nb in enumerate(SP_LENGTHS):
        assert (np.asarray(got[1])[b, nb:] == 0).all() and (np.asarray(got[2])[b, nb:] == 0).all()


def test_sequence_parallel_errors():
    mesh = _sp_mesh()
    q, k, v, n = make_inputs(B, 3, SP_SKV, 8, 2, D, DV, jnp.float32, SP_LENGTHS, seed=21)
    sp = functools.partial(jax_varlen.sequence_parallel_attention, mesh=mesh)
    with pytest.raises(ValueError, match=r"is_causal=True only for decode \(Sq == 1\), got Sq = 3"):
        sp(q, k, v, n, axis_name="s", is_causal=True)
    with pytest.raises(ValueError, match=r"Skv = 62 must be a multiple of the size of mesh axes"):
        sp(q, k[:, :62], v[:, :62], jnp.minimum(n, 62), axis_name="s")
    with pytest.raises(ValueError, match=r"Hkv = 2 must be a multiple"):
        sp(q, k, v, n, axis_name="b", head_axis="s")
    with pytest.raises(ValueError, match=r"axis_name='t' is not an axis of the mesh"):
        sp(q, k, v, n, axis_name="t")
    with pytest.raises(ValueError, match=r"used twice"):
        sp(q, k, v, n, axis_name="s", batch_axis="s")


@needs_flatbuffers
def test_sequence_parallel_export_round_trip():
    """shard_map is fully manual: the exported module runs its blocks as written."""
    mesh = _sp_mesh()
    q, k, v, n = make_inputs(B, 1, SP_SKV, 8, 2, D, DV, jnp.float32, SP_LENGTHS, seed=22)
    f = jax.jit(functools.partial(
        jax_varlen.sequence_parallel_attention, mesh=mesh, axis_name="s", batch_axis="b"))
    exp = jax.export.export(f, disabled_checks=jax_varlen.export_disabled_checks())(q, k, v, n)
    # The exported module runs on the mesh's 8 devices: give it arguments that live there.
    args = _put(mesh, (q, k, v, n), (P(),) * 4)
    out = jax.export.deserialize(exp.serialize()).call(*args)
    assert bits(out) == bits(f(q, k, v, n))


# --------------------------------------------------------------------------------------------
# Sharded export: the bare FFI call, split over the batch by XLA's batch partitioner.


@needs_flatbuffers
@pytest.mark.parametrize("layout", ["batch", "heads"])
def test_sharded_export_round_trip(layout, tmp_path):
    args = make_inputs(B, SQ, SKV, 8, 4, D, DV, jnp.float32, LENGTHS, seed=23)
    ref_out, ref_lse = _fn(is_causal=True)(*args)
    mesh = make_mesh()
    b, h = LAYOUTS[layout]
    qkv = P(b, None, h, None)
    shardings = [NamedSharding(mesh, s) for s in (qkv, qkv, qkv, P(b))]
    f = jax.jit(_fn(is_causal=True), in_shardings=shardings)
    exp = jax.export.export(f, disabled_checks=jax_varlen.export_disabled_checks())(*args)
    blob = exp.serialize()
    sharded = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    call = jax.jit(jax.export.deserialize(blob).call)
    collectives = collectives_in(call.lower(*sharded).compile().as_text())
    # Documented limit: exported code splits the batch for free, the heads after a gather.
    assert collectives == ([] if layout == "batch" else ["all-gather"])
    out, lse = call(*sharded)
    assert bits(out) == bits(ref_out) and bits(lse) == bits(ref_lse)
    if layout == "batch":
        _check_in_fresh_process(tmp_path, blob, args, ref_out)


@needs_flatbuffers
def test_symbolic_batch_export_called_sharded():
    """Documented limit: a symbolic batch leaves the call without a Shardy rule, so a
    batch-sharded call of the export gathers first; the result is still exact."""
    args = make_inputs(B, SQ, SKV, 8, 4, D, DV, jnp.float32, LENGTHS, seed=27)
    f = jax.jit(_fn(is_causal=True))
    (b,) = jax.export.symbolic_shape("b")
    specs = [jax.ShapeDtypeStruct((b,) + x.shape[1:], x.dtype) for x in args]
    exp = jax.export.export(f, disabled_checks=jax_varlen.export_disabled_checks())(*specs)
    call = jax.jit(jax.export.deserialize(exp.serialize()).call)
    mesh = make_mesh()
    sharded = _put(mesh, args, (P("x"),) * 4)
    assert "all-gather" in collectives_in(call.lower(*sharded).compile().as_text())
    out, lse = call(*sharded)
    ref_out, ref_lse = f(*args)
    assert bits(out) == bits(ref_out) and bits(lse) == bits(ref_lse)


def _check_in_fresh_process(tmp_path, blob, args, ref_out):
    """A process that only imports jax_varlen and registers its targets runs the blob split
    over the batch with no collective (the batch partitioner is registered by name)."""
    (tmp_path / "fn.bin").write_bytes(blob)
    np.savez(tmp_path / "args.npz", *[np.asarray(a) for a in args])
    script = textwrap.dedent(
        """
        import sys
        import jax, numpy as np
        from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        import jax_varlen

        jax_varlen.register_ffi_targets()
        exp = jax.export.deserialize(open(sys.argv[1] + "/fn.bin", "rb").read())
        mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
        data = np.load(sys.argv[1] + "/args.npz")
        args = [jax.device_put(data[f"arr_{i}"], NamedSharding(mesh, P("x"))) for i in range(4)]
        call = jax.jit(exp.call)
        text = call.lower(*args).compile().as_text()
        assert "all-gather" not in text and "all-to-all" not in text, "collective in the HLO"
        out, _ = call(*args)
        np.save(sys.argv[1] + "/out.npy", np.asarray(out))
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert bits(np.load(tmp_path / "out.npy")) == bits(ref_out)
