"""Gradients of the forward primitive: first-order reverse mode, through the backward
primitive ``attention_bwd_p`` (``_backward.py``), which recomputes the attention probabilities
from the saved ``lse``.

Mechanism (the one ``jax.custom_vjp`` uses inside JAX, spelled out so that the errors are
ours): the forward primitive's JVP rule runs the forward and emits ``attention_tangent_p``, a
primitive linear in the tangents of query, key and value. Reverse mode (``grad``, ``vjp``,
``jacrev``) never evaluates it: it transposes it, and the transpose binds the backward
primitive on the residuals (query, key, value, lengths, out, lse) and the cotangents of out
and lse. Evaluating the tangent primitive means forward mode (``jvp``, ``jacfwd``, calling
``linearize``'s function), which raises :data:`FORWARD_MODE_MESSAGE`, eagerly or under
``jit``. Differentiating the backward primitive (grad of grad, through its residuals or its
cotangents) raises :data:`SECOND_ORDER_MESSAGE`.

Both primitives have batching rules (a vmapped axis folds into the batch), and the backward
has the forward's sharding rule, lowerings and checkify rule, so gradients compose with
``vmap``, ``jit``, ``scan``, ``cond``, ``checkpoint``, sharding and ``jax.export`` as the
forward does. The backward kernels read only the valid keys: padded keys and values get
exactly zero gradient, rows with no allowed key contribute nothing, and a non-finite value in
real data propagates to the gradients it reaches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_varlen._backward import attention_bwd, attention_bwd_p
from jax_varlen._config import AttentionConfig
from jax_varlen._primitive import (
    attention_fwd,
    attention_fwd_p,
    fold_vmapped_axis,
    unfold_vmapped_axis,
)

FORWARD_MODE_MESSAGE = (
    "jax_varlen.attention does not support forward-mode differentiation (jax.jvp, "
    "jax.jacfwd, jax.hessian, or calling the function jax.linearize returns): its derivative "
    "is defined in reverse mode only. Use jax.grad, jax.vjp or jax.jacrev instead, or "
    "jax_varlen.reference (dense, differentiable in both modes) where forward mode is needed."
)
SECOND_ORDER_MESSAGE = (
    "jax_varlen: second-order gradients (grad of grad) are not supported: the backward pass "
    "of jax_varlen.attention is not differentiable. Use first-order jax.grad / jax.vjp, or "
    "jax_varlen.reference (dense, differentiable to any order) where higher derivatives are "
    "needed."
)


def attention_with_grad(query, key, value, nonpad_kv_seqlen, config: AttentionConfig):
    """``(out, lse)`` of the forward primitive, differentiable in query, key and value
    (reverse mode, first order; none for the integer lengths)."""
    return tuple(attention_fwd(query, key, value, nonpad_kv_seqlen, config))


# --------------------------------------------------------------------------------------------
# The JVP rule and the linear tangent primitive.
#
# attention_tangent_p(query, key, value, lengths, out, lse, d_query, d_key, d_value)
#   -> (d_out, d_lse): linear in the last three operands; the first six are residuals.

attention_tangent_p = Primitive("jax_varlen_attention_tangent")
attention_tangent_p.multiple_results = True


def _fwd_jvp(primals, tangents, *, config):
    query, key, value, lengths = primals
    out, lse = attention_fwd_p.bind(query, key, value, lengths, config=config)
    d_in = [ad.instantiate_zeros(t) for t in tangents[:3]]  # zeros stay known: not transposed
    d_out, d_lse = attention_tangent_p.bind(query, key, value, lengths, out, lse, *d_in,
                                            config=config)
    return (out, lse), (d_out, d_lse)


ad.primitive_jvps[attention_fwd_p] = _fwd_jvp


@attention_tangent_p.def_abstract_eval
def _tangent_abstract_eval(query, key, value, lengths, out, lse, *d_in, config):
    # The tangent types of the primal results (shape, dtype, sharding, varying manual axes).
    return out.to_tangent_aval(), lse.to_tangent_aval()


def _tangent_transpose(cotangents, query, key, value, lengths, out, lse, *d_in, config):
    d_out, d_lse = (ad.instantiate_zeros(c) for c in cotangents)
    grads = attention_bwd(query, key, value, lengths, out, lse, d_out.astype(out.dtype),
                          d_lse.astype(jnp.float32), config)
    return [None] * 6 + [g if ad.is_undefined_primal(t) else None for g, t in zip(grads, d_in)]


ad.primitive_transposes[attention_tangent_p] = _tangent_transpose


def _tangent_batch(args, dims, *, config):
    """Like the forward's rule: a vmapped axis folds into the batch axis, which leads every
    operand and result ([N, B, ...] -> [N * B, ...]); unbatched operands are broadcast."""
    size, folded = fold_vmapped_axis(args, dims)
    results = unfold_vmapped_axis(attention_tangent_p.bind(*folded, config=config), size)
    return results, [0] * len(results)


batching.primitive_batchers[attention_tangent_p] = _tangent_batch


def _forward_mode(*args, **kwargs):
    raise TypeError(FORWARD_MODE_MESSAGE)


# Evaluating or compiling the tangent map itself is forward mode.
attention_tangent_p.def_impl(_forward_mode)
mlir.register_lowering(attention_tangent_p, _forward_mode)


# Second order: a gradient's own derivative differentiates the backward primitive (through
# its residuals or its cotangents); that raises. (JAX calls a JVP rule only for a nonzero
# tangent, so first-order gradients never get here.)


def _second_order(primals, tangents, **params):
    raise NotImplementedError(SECOND_ORDER_MESSAGE)


ad.primitive_jvps[attention_bwd_p] = _second_order
