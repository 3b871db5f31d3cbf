"""Gradients of the forward primitives: first-order reverse mode, through the backward
primitives (``_backward.py``), which recompute the attention probabilities from the saved
``lse``.

Mechanism (the one ``jax.custom_vjp`` uses inside JAX, spelled out so that the errors are
ours), the same for the padded and the packed primitives (``_define_gradients``): the forward
primitive's JVP rule runs the forward and emits a tangent primitive (``attention_tangent_p``,
``packed_attention_tangent_p``) linear in the tangents of query, key and value. Reverse mode
(``grad``, ``vjp``, ``jacrev``) never evaluates it: it transposes it, and the transpose binds
the backward primitive on the residuals (query, key, value, the lengths or offsets, out, lse)
and the cotangents of out and lse. Evaluating the tangent primitive means forward mode
(``jvp``, ``jacfwd``, calling ``linearize``'s function), which raises
:data:`FORWARD_MODE_MESSAGE` (:data:`PACKED_FORWARD_MODE_MESSAGE`), eagerly or under ``jit``.
Differentiating a backward primitive (grad of grad, through its residuals or its cotangents)
raises :data:`SECOND_ORDER_MESSAGE`.

Both primitives have batching rules (a vmapped axis folds into the batch), and the backward
has the forward's sharding rule, lowerings and checkify rule, so gradients compose with
``vmap``, ``jit``, ``scan``, ``cond``, ``checkpoint``, sharding and ``jax.export`` as the
forward does. The backward kernels read only the valid keys: padded keys and values get
exactly zero gradient, rows with no allowed key contribute nothing, and a non-finite value in
real data propagates to the gradients it reaches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_varlen._backward import attention_bwd_p, packed_attention_bwd_p
from jax_varlen._config import AttentionConfig
from jax_varlen._primitive import (
    attention_fwd,
    attention_fwd_p,
    attention_fwd_sinks_p,
    batch_rule,
    packed_attention_fwd,
    packed_attention_fwd_p,
    packed_attention_fwd_sinks_p,
)


def _forward_mode_message(name: str) -> str:
    return (
        f"jax_varlen.{name} does not support forward-mode differentiation (jax.jvp, "
        "jax.jacfwd, jax.hessian, or calling the function jax.linearize returns): its derivative "
        "is defined in reverse mode only. Use jax.grad, jax.vjp or jax.jacrev instead, or "
        "jax_varlen.reference (dense, differentiable in both modes) where forward mode is needed."
    )


FORWARD_MODE_MESSAGE = _forward_mode_message("attention")
PACKED_FORWARD_MODE_MESSAGE = _forward_mode_message("packed_attention")
SECOND_ORDER_MESSAGE = (
    "jax_varlen: second-order gradients (grad of grad) are not supported: the backward pass "
    "of jax_varlen.attention is not differentiable. Use first-order jax.grad / jax.vjp, or "
    "jax_varlen.reference (dense, differentiable to any order) where higher derivatives are "
    "needed."
)


def attention_with_grad(query, key, value, nonpad_kv_seqlen, config: AttentionConfig):
    """``(out, lse)`` of the padded forward primitive, differentiable in query, key and value
    (reverse mode, first order; none for the integer lengths)."""
    return tuple(attention_fwd(query, key, value, nonpad_kv_seqlen, config))


def packed_attention_with_grad(query, key, value, cu_seqlens_q, cu_seqlens_k,
                               config: AttentionConfig):
    """``(out, lse)`` of the packed forward primitive, differentiable in query, key and value
    (reverse mode, first order; none for the integer offsets)."""
    return tuple(packed_attention_fwd(query, key, value, cu_seqlens_q, cu_seqlens_k, config))


def attention_with_sinks_grad(query, key, value, nonpad_kv_seqlen, sinks, config: AttentionConfig):
    """``(out, lse)`` of the padded forward primitive with sinks (float32 ``[H]``, in the
    kernels' softmax denominators), differentiable in query, key, value and sinks."""
    return _with_sinks_grad(attention_fwd_sinks_p, attention_bwd_p, config)(
        query, key, value, nonpad_kv_seqlen, sinks)


def packed_attention_with_sinks_grad(query, key, value, cu_seqlens_q, cu_seqlens_k, sinks,
                                     config: AttentionConfig):
    """``(out, lse)`` of the packed forward primitive with sinks, differentiable in query, key,
    value and sinks."""
    return _with_sinks_grad(packed_attention_fwd_sinks_p, packed_attention_bwd_p, config)(
        query, key, value, cu_seqlens_q, cu_seqlens_k, sinks)


@functools.cache
def _with_sinks_grad(fwd_p, bwd_p, config: AttentionConfig):
    """A ``custom_vjp`` over the forward primitive with sinks, ``f(query, key, value, *lengths,
    sinks) -> (out, lse)``. Its out and lse include the sinks, so the backward primitive gives
    d_query, d_key, d_value from them unchanged (the sink is one more softmax term whose value
    is zero); and since d lse / d sinks[h] = exp(sinks[h] - lse) per row and d out / d sinks[h]
    = -exp(sinks[h] - lse) out:
      d_sinks[h] = -sum over real rows of exp(sinks[h] - lse) * delta,
      delta = rowsum(d_out * out) - d_lse   (float32; rows of no sequence, lse = -inf, add 0).
    Forward mode raises JAX's custom_vjp error; second order raises SECOND_ORDER_MESSAGE (the
    backward primitive's JVP)."""

    @jax.custom_vjp
    def f(query, key, value, *lengths_and_sinks):
        return tuple(fwd_p.bind(query, key, value, *lengths_and_sinks, config=config))

    def fwd(query, key, value, *lengths_and_sinks):
        out, lse = fwd_p.bind(query, key, value, *lengths_and_sinks, config=config)
        return (out, lse), (query, key, value, *lengths_and_sinks, out, lse)

    def bwd(residuals, cotangents):
        query, key, value, *lengths, sinks, out, lse = residuals
        d_out, d_lse = cotangents
        d_out, d_lse = d_out.astype(out.dtype), d_lse.astype(jnp.float32)
        d_query, d_key, d_value = bwd_p.bind(query, key, value, *lengths, out, lse, d_out, d_lse,
                                             config=config)
        # An elementwise product and a sum (never a dot, which the GPU would run in TF32).
        rowsum = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)
        delta = jnp.swapaxes(rowsum, 1, 2) - d_lse  # [N, H, Sq]
        # Rows of no sequence (lse = -inf) are selected away, never multiplied: their d_out
        # may hold anything (NaN included).
        real = lse > -jnp.inf
        terms = jnp.where(real, jnp.exp(jnp.where(real, sinks[:, None] - lse, 0.0)) * delta, 0.0)
        d_sinks = -jnp.sum(terms, axis=(0, 2))
        return (d_query, d_key, d_value, *[None] * len(lengths), d_sinks)

    f.defvjp(fwd, bwd)
    return f


# --------------------------------------------------------------------------------------------
# The JVP rule and the linear tangent primitive, per forward primitive.
#
# tangent_p(query, key, value, *lengths, out, lse, d_query, d_key, d_value) -> (d_out, d_lse):
# linear in the last three operands; the others are residuals (lengths: nonpad_kv_seqlen, or
# cu_seqlens_q and cu_seqlens_k).


def _forward_mode(message):
    def raise_(*args, **kwargs):
        raise TypeError(message)

    return raise_


def _define_gradients(fwd_p, bwd_p, name: str, forward_mode_message: str) -> Primitive:
    """The tangent primitive of ``fwd_p`` with its rules; its transpose binds ``bwd_p``."""
    tangent_p = Primitive(name)
    tangent_p.multiple_results = True

    def fwd_jvp(primals, tangents, *, config):
        out, lse = fwd_p.bind(*primals, config=config)
        d_in = [ad.instantiate_zeros(t) for t in tangents[:3]]  # zeros stay known: not transposed
        d_out, d_lse = tangent_p.bind(*primals, out, lse, *d_in, config=config)
        return (out, lse), (d_out, d_lse)

    def abstract_eval(*args, config):
        out, lse = args[-5:-3]
        # The tangent types of the primal results (shape, dtype, sharding, varying manual axes).
        return out.to_tangent_aval(), lse.to_tangent_aval()

    def transpose(cotangents, *args, config):
        residuals, d_in = args[:-3], args[-3:]
        out = residuals[-2]
        d_out, d_lse = (ad.instantiate_zeros(c) for c in cotangents)
        grads = bwd_p.bind(*residuals, d_out.astype(out.dtype), d_lse.astype(jnp.float32),
                           config=config)
        return [None] * len(residuals) + [
            g if ad.is_undefined_primal(t) else None for g, t in zip(grads, d_in)]

    ad.primitive_jvps[fwd_p] = fwd_jvp
    tangent_p.def_abstract_eval(abstract_eval)
    ad.primitive_transposes[tangent_p] = transpose
    # Like the forward's rule: a vmapped axis folds into the batch (packs) axis, which leads
    # every operand and result ([M, N, ...] -> [M * N, ...]); unbatched operands are broadcast.
    batching.primitive_batchers[tangent_p] = batch_rule(tangent_p)
    # Evaluating or compiling the tangent map itself is forward mode.
    tangent_p.def_impl(_forward_mode(forward_mode_message))
    mlir.register_lowering(tangent_p, _forward_mode(forward_mode_message))
    return tangent_p


attention_tangent_p = _define_gradients(attention_fwd_p, attention_bwd_p,
                                        "jax_varlen_attention_tangent", FORWARD_MODE_MESSAGE)
packed_attention_tangent_p = _define_gradients(
    packed_attention_fwd_p, packed_attention_bwd_p, "jax_varlen_packed_attention_tangent",
    PACKED_FORWARD_MODE_MESSAGE)


# Second order: a gradient's own derivative differentiates the backward primitive (through
# its residuals or its cotangents); that raises. (JAX calls a JVP rule only for a nonzero
# tangent, so first-order gradients never get here.)


def _second_order(primals, tangents, **params):
    raise NotImplementedError(SECOND_ORDER_MESSAGE)


ad.primitive_jvps[attention_bwd_p] = _second_order
ad.primitive_jvps[packed_attention_bwd_p] = _second_order
