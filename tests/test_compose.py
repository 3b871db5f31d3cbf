"""Gradients compose with JAX's transformations in every order users write them, on every
backend (the ``backend`` fixture).

Each program is written once over an attention function and run twice: with
``jax_varlen.attention`` and with ``jax_varlen.reference`` (the dense oracle, differentiated
by JAX itself, its dots at the highest precision on any device); values and gradients must
agree. The unsupported transformations (forward mode, grad of grad, symbolic non-batch
dimensions) must fail with our messages; those fail while tracing, whatever the device, so
they run once. shard_map with grad inside runs on 8 devices in multi_device_cases.py.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_varlen
from conftest import (EXPORT_PLATFORM, SMALL_KW, SMALL_LENGTHS, SMALL_SHAPE, assert_trees_close, bits,
                      cos_weights, needs_flatbuffers, small_inputs)

# conftest's small problem: GQA, causal with a sequence shorter than Sq (empty rows), softcap,
# NaN padding, Dv = D (so that a layer's output can be added to its input).
B, SQ, SKV, H, HKV, D = SMALL_SHAPE
LENGTHS = SMALL_LENGTHS
KW = SMALL_KW
# Ours against the reference: within GRAD_ATOL * max(1, max|reference|), leaf by leaf.
GRAD_ATOL = 2e-5
ARGNUMS = (0, 1, 2)

OURS = jax_varlen.attention
REF = jax_varlen.reference
IMPLS = {"ours": OURS, "reference": REF}


def _loss(attn):
    """A scalar of out and of the finite lse entries, non-uniformly weighted."""

    def loss(q, k, v, n):
        out, lse = attn(q, k, v, n, return_lse=True, **KW)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out * cos_weights(out.shape)) + 0.3 * jnp.sum(finite_lse * cos_weights(lse.shape))

    return loss


@functools.cache
def _reference_grads(seed=0):
    """The oracle's value and gradients for small_inputs(seed), on the CPU (computed once)."""
    with jax.default_device(jax.devices("cpu")[0]):
        q, k, v, n = small_inputs(seed)
        return jax.jit(jax.value_and_grad(_loss(REF), argnums=ARGNUMS))(q, k, v, n)


def assert_padding_grads_zero(d_k, d_v, lengths=LENGTHS):
    for b, nb in enumerate(lengths):
        assert (np.asarray(d_k)[..., b, nb:, :, :] == 0).all()
        assert (np.asarray(d_v)[..., b, nb:, :, :] == 0).all()


# --------------------------------------------------------------------------------------------
# grad and jit, in every order.


def test_grad_of_jit(backend):
    """The issue's reproducer: the primal used to return a list where the fwd rule gave a tuple."""
    q, k, v, n = small_inputs()
    grads = jax.grad(jax.jit(_loss(OURS)), argnums=ARGNUMS)(q, k, v, n)
    assert_trees_close(grads, _reference_grads()[1], GRAD_ATOL)
    assert_padding_grads_zero(grads[1], grads[2])


def test_jit_of_grad(backend):
    q, k, v, n = small_inputs()
    grads = jax.jit(jax.grad(_loss(OURS), argnums=ARGNUMS))(q, k, v, n)
    assert_trees_close(grads, _reference_grads()[1], GRAD_ATOL)


def test_grad_of_a_loss_calling_jitted_attention(backend):
    attn = jax.jit(OURS, static_argnames=("is_causal", "softcap", "return_lse"))
    q, k, v, n = small_inputs()
    grads = jax.grad(_loss(attn), argnums=ARGNUMS)(q, k, v, n)
    assert_trees_close(grads, _reference_grads()[1], GRAD_ATOL)


def test_value_and_grad(backend):
    q, k, v, n = small_inputs()
    value, grads = jax.jit(jax.value_and_grad(_loss(OURS), argnums=ARGNUMS))(q, k, v, n)
    ref_value, ref_grads = _reference_grads()
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    assert_trees_close(grads, ref_grads, GRAD_ATOL)


def test_vjp_with_lse_cotangent_only(backend):
    """A cotangent on lse alone (d_out symbolically zero) still reaches query and key."""
    q, k, v, n = small_inputs()

    def pullback(attn):
        def f(q, k, ct):
            lse, vjp = jax.vjp(lambda q, k: attn(q, k, v, n, return_lse=True, **KW)[1], q, k)
            return vjp(jnp.where(jnp.isfinite(lse), ct, 0.0))

        return jax.jit(f)

    ct = cos_weights((B, H, SQ))
    assert_trees_close(pullback(OURS)(q, k, ct), pullback(REF)(q, k, ct), GRAD_ATOL)


def test_jacrev(backend):
    """jax.jacrev is vmap of the pullback: the backward pass under vmap."""
    q, k, v, n = small_inputs()

    def make(attn):
        return jax.jit(jax.jacrev(lambda k: jnp.sum(attn(q, k, v, n, **KW), axis=(2, 3))))

    assert_trees_close(make(OURS)(k), make(REF)(k), GRAD_ATOL, "jacobian")


# --------------------------------------------------------------------------------------------
# Rematerialization.

POLICIES = {
    "default": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_checkpoint(backend, policy):
    q, k, v, n = small_inputs()
    loss = jax.checkpoint(_loss(OURS), policy=POLICIES[policy])
    grad = jax.grad(loss, argnums=ARGNUMS)
    assert_trees_close(jax.jit(grad)(q, k, v, n), _reference_grads()[1], GRAD_ATOL)
    # The policy took effect: the op is not a dot, so only everything_saveable keeps its
    # results; every other policy runs it again in the backward pass.
    calls = str(jax.make_jaxpr(grad)(q, k, v, n)).count("jax_varlen_attention_fwd[")
    assert calls == (1 if policy == "everything_saveable" else 2)


# --------------------------------------------------------------------------------------------
# Control flow: scan over layers, cond, switch, fori_loop.

LAYERS = 3


def _layer_params(seed=1):
    """Per-layer query scales [L, H, D] and keys/values [L, B, Skv, Hkv, D] (NaN padding)."""
    ks, vs = [], []
    for layer in range(LAYERS):
        _, k, v, _ = small_inputs(seed + layer)
        ks.append(k), vs.append(v)
    ws = 1.0 + 0.1 * cos_weights((LAYERS, H, D))
    return ws, jnp.stack(ks), jnp.stack(vs)


def _stack(attn):
    """A scan over layers: x <- x + attention(x * w_l, k_l, v_l); also each layer's sum."""

    def forward(x, ws, ks, vs, n):
        def layer(x, params):
            w, k, v = params
            out = attn(x * w, k, v, n, **KW)
            return x + out, jnp.sum(out)

        return jax.lax.scan(layer, x, (ws, ks, vs))

    def loss(x, ws, ks, vs, n):
        x, sums = forward(x, ws, ks, vs, n)
        return jnp.sum(x * cos_weights(x.shape)) + jnp.sum(sums * jnp.arange(1.0, LAYERS + 1))

    return forward, loss


def test_scan_over_layers_forward(backend):
    x, _, _, n = small_inputs()
    ws, ks, vs = _layer_params()
    ours = jax.jit(_stack(OURS)[0])(x, ws, ks, vs, n)
    ref = jax.jit(_stack(REF)[0])(x, ws, ks, vs, n)
    assert_trees_close(ours, ref, GRAD_ATOL, "scan outputs")


def test_scan_over_layers_grad(backend):
    x, _, _, n = small_inputs()
    ws, ks, vs = _layer_params()
    argnums = (0, 1, 2, 3)
    ours = jax.jit(jax.grad(_stack(OURS)[1], argnums=argnums))(x, ws, ks, vs, n)
    ref = jax.jit(jax.grad(_stack(REF)[1], argnums=argnums))(x, ws, ks, vs, n)
    assert_trees_close(ours, ref, GRAD_ATOL)
    assert_padding_grads_zero(ours[2], ours[3])


def _branches(attn):
    """Three branches with one output type: causal+softcap attention, plain attention of a
    scaled query, and no attention at all."""
    return [
        lambda q, k, v, n: attn(q, k, v, n, **KW),
        lambda q, k, v, n: attn(2.0 * q, k, v, n),
        lambda q, k, v, n: jnp.tanh(q),
    ]


def _cond_loss(attn):
    def loss(q, k, v, n, pred):
        first, second, _ = _branches(attn)
        out = jax.lax.cond(pred, first, second, q, k, v, n)
        return jnp.sum(out * cos_weights(out.shape))

    return loss


def _switch_loss(attn):
    def loss(q, k, v, n, index):
        out = jax.lax.switch(index, _branches(attn), q, k, v, n)
        return jnp.sum(out * cos_weights(out.shape))

    return loss


@pytest.mark.parametrize("control", ["cond", "switch"])
def test_cond_and_switch(backend, control):
    q, k, v, n = small_inputs()
    make, selectors = {
        "cond": (_cond_loss, [jnp.bool_(True), jnp.bool_(False)]),
        "switch": (_switch_loss, [jnp.int32(0), jnp.int32(1), jnp.int32(2)]),
    }[control]
    ours = jax.jit(jax.value_and_grad(make(OURS), argnums=ARGNUMS))
    ref = jax.jit(jax.value_and_grad(make(REF), argnums=ARGNUMS))
    results = []
    for s in selectors:  # one compilation each: the selector is traced
        got, want = ours(q, k, v, n, s), ref(q, k, v, n, s)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        assert_trees_close(got[1], want[1], GRAD_ATOL)
        results.append(bits(got[1][0]))
    assert len(set(results)) == len(selectors)  # each branch really ran


def test_fori_loop(backend):
    """fori_loop with static bounds (a scan underneath): differentiable in reverse mode."""
    q, k, v, n = small_inputs()

    def make(attn):
        def loss(x, k, v, n):
            body = lambda i, x: x + attn(x, k, v, n, **KW) / (i + 1.0)  # noqa: E731
            x = jax.lax.fori_loop(0, 3, body, x)
            return jnp.sum(x * cos_weights(x.shape))

        return loss

    ours = jax.jit(jax.grad(make(OURS), argnums=ARGNUMS))(q, k, v, n)
    ref = jax.jit(jax.grad(make(REF), argnums=ARGNUMS))(q, k, v, n)
    assert_trees_close(ours, ref, GRAD_ATOL)


# --------------------------------------------------------------------------------------------
# vmap of grad of jit; export of a jitted gradient.


def test_vmap_of_grad_of_jit(backend):
    problems = [small_inputs(3), small_inputs(4, lengths=[2, 7])]  # lengths differ per problem
    q, k, v, n = (jnp.stack([p[i] for p in problems]) for i in range(4))
    grads = jax.vmap(jax.grad(jax.jit(_loss(OURS)), argnums=ARGNUMS))(q, k, v, n)
    ref_grad = jax.jit(jax.grad(_loss(REF), argnums=ARGNUMS))
    for i in range(2):
        ref = ref_grad(q[i], k[i], v[i], n[i])
        assert_trees_close([g[i] for g in grads], ref, GRAD_ATOL, f"problem {i}")


@needs_flatbuffers
def test_export_of_jitted_grad(backend):
    q, k, v, n = small_inputs()
    grad = jax.jit(jax.grad(_loss(OURS), argnums=ARGNUMS))
    exported = jax.export.export(grad, platforms=(EXPORT_PLATFORM[backend],),
                                 disabled_checks=jax_varlen.export_disabled_checks())
    blob = exported(q, k, v, n).serialize()
    got = jax.export.deserialize(blob).call(q, k, v, n)
    assert jax.tree.map(bits, got) == jax.tree.map(bits, grad(q, k, v, n))
    assert_trees_close(got, _reference_grads()[1], GRAD_ATOL)


@needs_flatbuffers
def test_export_of_jitted_grad_with_symbolic_batch(backend):
    """One export, any batch size: the batch dimension may be symbolic."""
    grad = jax.jit(jax.grad(_loss(OURS), argnums=ARGNUMS))
    (b,) = jax.export.symbolic_shape("b")
    specs = [jax.ShapeDtypeStruct((b,) + s, dt) for s, dt in (
        ((SQ, H, D), jnp.float32), ((SKV, HKV, D), jnp.float32), ((SKV, HKV, D), jnp.float32),
        ((), jnp.int32))]
    exported = jax.export.export(grad, platforms=(EXPORT_PLATFORM[backend],),
                                 disabled_checks=jax_varlen.export_disabled_checks())
    restored = jax.export.deserialize(exported(*specs).serialize())
    assert str(restored.in_avals[0].shape[0]) == "b"
    for batch in (1, 2):
        args = small_inputs(batch=batch)
        assert jax.tree.map(bits, restored.call(*args)) == jax.tree.map(bits, grad(*args))


def test_checkify_of_grad_reports_bad_lengths(backend):
    from jax.experimental import checkify

    q, k, v, _ = small_inputs()
    f = jax.jit(checkify.checkify(jax.grad(_loss(OURS), argnums=ARGNUMS)))
    err, grads = f(q, k, v, jnp.asarray(LENGTHS, jnp.int32))
    assert err.get() is None
    assert_trees_close(grads, _reference_grads()[1], GRAD_ATOL)
    err, _ = f(q, k, v, jnp.asarray([SKV + 1, 3], jnp.int32))
    assert "nonpad_kv_seqlen must lie in [0, Skv=7]" in err.get()


# --------------------------------------------------------------------------------------------
# Unsupported: forward mode and second order fail with our messages.

FORWARD_MODE = r"does not support forward-mode differentiation.*Use jax\.grad, jax\.vjp or jax\.jacrev"
SECOND_ORDER = r"jax_varlen: second-order gradients \(grad of grad\) are not supported"


def _out(q, k, v, n):
    return OURS(q, k, v, n, **KW)


def _scalar(q, k, v, n):
    return jnp.sum(_out(q, k, v, n) * cos_weights((B, SQ, H, D)))


FORWARD_CASES = {
    "jvp": lambda q, k, v, n: jax.jvp(lambda q: _out(q, k, v, n), (q,), (q,)),
    "jvp-of-jit": lambda q, k, v, n: jax.jvp(jax.jit(lambda q: _out(q, k, v, n)), (q,), (q,)),
    "jit-of-jvp": lambda q, k, v, n: jax.jit(
        lambda q: jax.jvp(lambda q: _out(q, k, v, n), (q,), (q,)))(q),
    "jacfwd": lambda q, k, v, n: jax.jacfwd(lambda k: _scalar(q, k, v, n))(k),
    "linearize-then-call": lambda q, k, v, n: jax.linearize(lambda q: _out(q, k, v, n), q)[1](q),
    "hessian": lambda q, k, v, n: jax.hessian(lambda q: _scalar(q, k, v, n))(q),
    "jvp-of-grad": lambda q, k, v, n: jax.jvp(
        jax.grad(lambda q: _scalar(q, k, v, n)), (q,), (q,)),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_mode_raises_our_message(case):
    with pytest.raises(TypeError, match=FORWARD_MODE):
        FORWARD_CASES[case](*small_inputs())


def test_linearize_alone_and_its_transpose_work(backend):
    """jax.linearize itself succeeds, and transposing its linear map is reverse mode."""
    q, k, v, n = small_inputs()

    @jax.jit
    def transposed(q, ct):
        _, f_jvp = jax.linearize(lambda q: _out(q, k, v, n), q)
        return jax.linear_transpose(f_jvp, q)(ct)

    ct = cos_weights((B, SQ, H, D))
    ref = jax.jit(lambda q, ct: jax.vjp(lambda q: REF(q, k, v, n, **KW), q)[1](ct))
    assert_trees_close(transposed(q, ct), ref(q, ct), GRAD_ATOL)


def test_vmap_of_linearized_map_transposes(backend):
    """vmap of linearize's linear map, transposed: reverse mode through the tangent
    primitive's batching rule (evaluating it would be forward mode)."""
    q, k, v, n = small_inputs()
    cts = jnp.stack([cos_weights((B, SQ, H, D)), cos_weights((B, SQ, H, D), phase=1.0)])

    @jax.jit
    def transposed(q, cts):
        _, f_jvp = jax.linearize(lambda q: _out(q, k, v, n), q)
        return jax.linear_transpose(jax.vmap(f_jvp), jnp.stack([q, q]))(cts)[0]

    ref = jax.jit(jax.vmap(lambda ct: jax.vjp(lambda q: REF(q, k, v, n, **KW), q)[1](ct)[0]))
    assert_trees_close(transposed(q, cts), ref(cts), GRAD_ATOL)


def test_grad_with_jvp_then_partial_eval_linearization(backend):
    """The older linearization path (jax_use_direct_linearize=False: JVP, then partial
    evaluation) gives the same gradients."""
    q, k, v, n = small_inputs()
    previous = jax.config.jax_use_direct_linearize
    jax.config.update("jax_use_direct_linearize", False)
    try:
        grads = jax.jit(jax.grad(_loss(OURS), argnums=ARGNUMS))(q, k, v, n)
    finally:
        jax.config.update("jax_use_direct_linearize", previous)
    assert_trees_close(grads, _reference_grads()[1], GRAD_ATOL)


SECOND_ORDER_CASES = {
    "grad-of-grad": lambda q, k, v, n: jax.grad(
        lambda q: jnp.sum(jax.grad(lambda q: _scalar(q, k, v, n))(q)))(q),
    "grad-of-jit-grad": lambda q, k, v, n: jax.grad(
        lambda k: jnp.sum(jax.jit(jax.grad(lambda k: _scalar(q, k, v, n)))(k)))(k),
    # Through the cotangent only (the forward is not differentiated): still refused, since
    # the backward pass is not differentiable.
    "grad-through-cotangent": lambda q, k, v, n: jax.grad(
        lambda w: jnp.sum(jax.grad(lambda q: jnp.sum(_out(q, k, v, n) * w))(q)))(
        jnp.ones((B, SQ, H, D))),
}


@pytest.mark.parametrize("case", list(SECOND_ORDER_CASES))
def test_second_order_raises_our_message(case):
    with pytest.raises(NotImplementedError, match=SECOND_ORDER):
        SECOND_ORDER_CASES[case](*small_inputs())


@pytest.mark.parametrize(
    "rank, axis, name",
    [(4, 1, "Sq"), (4, 2, "H"), (4, 3, "D"), (3, 2, "H*D")],
    ids=["sq", "heads", "head_dim", "rank3-last"],
)
def test_export_with_symbolic_non_batch_dimension_names_it(rank, axis, name):
    (s,) = jax.export.symbolic_shape("s")
    q_shape = [B, SQ, H, D] if rank == 4 else [B, SQ, H * D]
    q_shape[axis] = s
    kv = (B, SKV, HKV, D) if rank == 4 else (B, SKV, HKV * D)
    specs = [jax.ShapeDtypeStruct(tuple(q_shape), jnp.float32),
             jax.ShapeDtypeStruct(kv, jnp.float32), jax.ShapeDtypeStruct(kv, jnp.float32),
             jax.ShapeDtypeStruct((B,), jnp.int32)]
    f = functools.partial(OURS, num_heads=H if rank == 3 else None)
    match = rf"query's dimension {axis} \({re.escape(name)}\) is symbolic \(s\).*batch dimension B only"
    with pytest.raises(ValueError, match=match):
        jax.export.export(jax.jit(f), disabled_checks=jax_varlen.export_disabled_checks())(*specs)


def test_export_with_symbolic_kv_length_names_it():
    (s,) = jax.export.symbolic_shape("s")
    specs = [jax.ShapeDtypeStruct((B, SQ, H, D), jnp.float32),
             jax.ShapeDtypeStruct((B, s, HKV, D), jnp.float32),
             jax.ShapeDtypeStruct((B, s, HKV, D), jnp.float32),
             jax.ShapeDtypeStruct((B,), jnp.int32)]
    with pytest.raises(ValueError, match=r"key's dimension 1 \(Skv\) is symbolic \(s\)"):
        jax.export.export(jax.jit(OURS), disabled_checks=jax_varlen.export_disabled_checks())(
            *specs)

