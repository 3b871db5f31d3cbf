"""Gradients on 8 CPU devices: sharded jit of the backward splits batch and whole kv-head
groups with no collective, in the bits of one device; GSPMD; sharded export of a gradient.

Not collected by a plain ``pytest tests`` run (the name does not match ``test_*.py``):
``test_backward.py::test_multi_device_backward_cases`` runs it in a subprocess whose
XLA_FLAGS give the CPU 8 devices. By hand (from a folder other than the repository root):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        pytest /path/to/tests/multi_device_backward_cases.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_varlen
from conftest import bits, collectives_in, full_spec, make_inputs, make_mesh, needs_flatbuffers

if jax.device_count() < 8:
    raise RuntimeError(
        f"multi_device_backward_cases.py needs 8 devices, jax sees {jax.device_count()}: run it "
        "with XLA_FLAGS=--xla_force_host_platform_device_count=8 (test_backward.py does)"
    )

B, SQ, SKV, D, DV = 8, 5, 48, 16, 8
LENGTHS = [0, 1, 17, 48, 5, 33, 48, 2]


def _pullback(**kw):
    """(q, k, v, n, ct_out, ct_lse) -> (d_q, d_k, d_v): no reduction, so no collective
    besides what the op itself would need."""

    def f(q, k, v, n, ct_out, ct_lse):
        attn = lambda q, k, v: jax_varlen.attention(q, k, v, n, return_lse=True, **kw)  # noqa: E731
        return jax.vjp(attn, q, k, v)[1]((ct_out, ct_lse))

    return f


def _args(dtype, heads, seed):
    H, HKV = heads
    q, k, v, n = make_inputs(B, SQ, SKV, H, HKV, D, DV, dtype, LENGTHS, seed=seed)
    rng = np.random.default_rng(seed + 1)
    ct_out = jnp.asarray(rng.standard_normal((B, SQ, H, DV), dtype=np.float32), dtype)
    ct_lse = jnp.asarray(rng.standard_normal((B, H, SQ), dtype=np.float32))
    return q, k, v, n, ct_out, ct_lse


def _specs(b, h):
    qkv = P(b, None, h, None)
    return (qkv, qkv, qkv, P(b), qkv, P(b, h, None))


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
    [(jnp.float32, (8, 4), dict(is_causal=True)), (jnp.bfloat16, (4, 4), dict(softcap=3.0))],
    ids=["f32-gqa-causal", "bf16-mha-softcap"],
)
def test_sharded_grad_no_collectives(explicit, layout, dtype, heads, kw):
    args = _args(dtype, heads, seed=31)
    f = jax.jit(_pullback(**kw))
    ref = f(*args)  # one device
    mesh = make_mesh(explicit=explicit)
    b, h = LAYOUTS[layout]
    sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, _specs(b, h))]
    assert collectives_in(f.lower(*sharded).compile().as_text()) == []
    got = f(*sharded)
    for g in got:
        assert full_spec(g) == (b, None, h, None)
    # Every device computes its block as one device would: the same bits.
    assert [bits(g) for g in got] == [bits(g) for g in ref]


def test_sharded_grad_gspmd():
    """The GSPMD callbacks (jax_use_shardy_partitioner=False) split the backward the same way."""
    args = _args(jnp.float32, (8, 4), seed=32)
    f = jax.jit(_pullback(is_causal=True))
    ref = f(*args)
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        mesh = make_mesh()
        sharded = [jax.device_put(a, NamedSharding(mesh, s))
                   for a, s in zip(args, _specs("x", "y"))]
        g = jax.jit(_pullback(is_causal=True))
        assert collectives_in(g.lower(*sharded).compile().as_text()) == []
        got = g(*sharded)
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)
    assert [bits(x) for x in got] == [bits(x) for x in ref]


def test_heads_not_divisible_fall_back_correctly():
    """MQA: one kv head cannot be split over 'y'; the heads are gathered, the result exact."""
    args = _args(jnp.float32, (8, 1), seed=33)
    f = jax.jit(_pullback(is_causal=True))
    ref = f(*args)
    mesh = make_mesh()
    specs = (P(None, None, "y"), P(), P(), P(), P(), P())
    sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    got = f(*sharded)
    assert [bits(x) for x in got] == [bits(x) for x in ref]


@needs_flatbuffers
def test_sharded_export_of_grad():
    """An exported gradient (the bare FFI call with its delta workspace, batch partitionable)
    runs split over the batch with no collective, in the bits of one device."""
    args = _args(jnp.float32, (8, 4), seed=34)
    mesh = make_mesh()
    shardings = [NamedSharding(mesh, s) for s in _specs("x", None)]
    f = jax.jit(_pullback(is_causal=True), in_shardings=shardings)
    exp = jax.export.export(f, disabled_checks=jax_varlen.export_disabled_checks())(*args)
    call = jax.jit(jax.export.deserialize(exp.serialize()).call)
    sharded = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    assert collectives_in(call.lower(*sharded).compile().as_text()) == []
    got = call(*sharded)
    ref = jax.jit(_pullback(is_causal=True))(*args)
    assert [bits(x) for x in got] == [bits(x) for x in ref]


def test_shard_map_with_grad_inside_check_vma():
    """grad inside shard_map (check_vma=True): the backward's results vary over the manual
    axes its operands vary over; each block's gradients are the single-device ones."""
    args = _args(jnp.float32, (8, 4), seed=35)
    mesh = make_mesh()
    specs = _specs("x", "y")
    f = jax.jit(jax.shard_map(_pullback(is_causal=True, softcap=2.0), mesh=mesh,
                              in_specs=specs, out_specs=specs[:3], check_vma=True))
    sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    assert collectives_in(f.lower(*sharded).compile().as_text()) == []
    got = f(*sharded)
    ref = jax.jit(_pullback(is_causal=True, softcap=2.0))(*args)
    assert [bits(x) for x in got] == [bits(x) for x in ref]

