"""Gradients of the forward primitive: first-order reverse mode, with a backward pass that
recomputes the attention probabilities from the saved ``lse``.

Mechanism (the one ``jax.custom_vjp`` uses inside JAX, spelled out so that the errors are
ours): the forward primitive's JVP rule runs the forward and emits ``attention_tangent_p``, a
primitive linear in the tangents of query, key and value. Reverse mode (``grad``, ``vjp``,
``jacrev``) never evaluates it: it transposes it, and the transpose is the backward pass.
Evaluating it means forward mode (``jvp``, ``jacfwd``, calling ``linearize``'s function), which
raises :data:`FORWARD_MODE_MESSAGE`, eagerly or under ``jit``. Differentiating the backward
pass (grad of grad) raises :data:`SECOND_ORDER_MESSAGE`: the fused backward kernel that will
replace it will not be differentiable either.

The backward is plain XLA for now (fp32, a scan over blocks of query rows, so memory grows
with ``rows * Skv`` rather than ``Sq * Skv``), so it runs on every platform and composes with
``vmap``, ``jit``, ``scan``, ``cond``, ``checkpoint``, sharding and ``jax.export``; a fused
backward kernel can replace it behind the same transpose rule without changing callers.
Padding never leaks: padded keys and values are zeroed before any product and every
probability and score gradient outside the allowed keys is exactly zero, so padded keys and
values get exactly zero gradient, and rows with no allowed key contribute nothing. A
non-finite value in real data propagates to the gradients it touches, as in the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_varlen._config import AttentionConfig
from jax_varlen._primitive import attention_fwd, attention_fwd_p

_HIGHEST = jax.lax.Precision.HIGHEST

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
    grads = _backward(config, query, key, value, lengths, out, lse, d_out, d_lse)
    return [None] * 6 + [g if ad.is_undefined_primal(t) else None for g, t in zip(grads, d_in)]


ad.primitive_transposes[attention_tangent_p] = _tangent_transpose


def _tangent_batch(args, dims, *, config):
    """Like the forward's rule: a vmapped axis folds into the batch axis, which leads every
    operand and result ([N, B, ...] -> [N * B, ...]); unbatched operands are broadcast."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    folded = []
    for a, d in zip(args, dims):
        a = jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
        folded.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
    results = attention_tangent_p.bind(*folded, config=config)
    return [r.reshape((size, -1) + r.shape[1:]) for r in results], [0, 0]


batching.primitive_batchers[attention_tangent_p] = _tangent_batch


def _forward_mode(*args, **kwargs):
    raise TypeError(FORWARD_MODE_MESSAGE)


# Evaluating or compiling the tangent map itself is forward mode.
attention_tangent_p.def_impl(_forward_mode)
mlir.register_lowering(attention_tangent_p, _forward_mode)


# Query rows per step of the backward's scan: the [B, H, rows, Skv] fp32 intermediates stay
# under about this many elements (256 MiB each), whatever Sq is.
_BWD_BLOCK_ELEMENTS = 1 << 26


def _bwd_block_rows(B, H, Sq, Skv) -> int:
    """A power of two in [1, Sq] (Sq >= 1). A symbolic batch (shape-polymorphic jax.export)
    sizes the blocks for B = 1: the intermediates then grow with the batch it is called with."""
    B = B if isinstance(B, int) else 1
    rows = max(1, _BWD_BLOCK_ELEMENTS // max(1, B * H * Skv))
    return min(Sq, 1 << (rows.bit_length() - 1))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _backward(config, query, key, value, lengths, out, lse, d_out, d_lse):
    """Gradients of query, key and value; differentiating this raises (see below)."""
    B, Sq, H, D = query.shape
    Skv, Hkv = key.shape[1:3]
    Dv = value.shape[3]
    if Sq == 0 or Skv == 0 or B == 0:  # nothing to attend: every gradient is zero
        return (jnp.zeros(query.shape, query.dtype), jnp.zeros(key.shape, key.dtype),
                jnp.zeros(value.shape, value.dtype))
    G = H // Hkv  # query heads per kv head: query head h = g * G + r reads kv head g
    f32 = jnp.float32

    lengths = jnp.clip(lengths, 0, Skv)  # as the kernels do with out-of-range values
    valid = jnp.arange(Skv)[None, :] < lengths[:, None]  # [B, Skv]
    k = jnp.where(valid[:, :, None, None], key.astype(f32), 0.0)  # [B, Skv, Hkv, D]
    v = jnp.where(valid[:, :, None, None], value.astype(f32), 0.0)  # [B, Skv, Hkv, Dv]

    # The query rows go through a scan in blocks of `rows`, so memory grows with rows * Skv,
    # not Sq * Skv. Sq is padded to whole blocks; padded rows (i >= Sq) are masked out.
    rows = _bwd_block_rows(B, H, Sq, Skv)
    blocks = -(-Sq // rows)
    pad = blocks * rows - Sq

    def blocked(x, axis):  # [..., Sq, ...] -> [blocks, ..., rows, ...] along `axis`
        x = jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)])
        x = x.reshape(x.shape[:axis] + (blocks, rows) + x.shape[axis + 1:])
        return jnp.moveaxis(x, axis, 0)

    q = blocked(query.astype(f32).reshape(B, Sq, Hkv, G, D), 1)  # [blocks, B, rows, Hkv, G, D]
    do = blocked(d_out.astype(f32).reshape(B, Sq, Hkv, G, Dv), 1)
    o = blocked(out.astype(f32).reshape(B, Sq, Hkv, G, Dv), 1)
    lse_r = blocked(lse.reshape(B, Hkv, G, Sq), 3)  # [blocks, B, Hkv, G, rows]
    dlse_r = blocked(d_lse.astype(f32).reshape(B, Hkv, G, Sq), 3)
    n = lengths[:, None, None, None, None]
    j = jnp.arange(Skv)

    def step(carry, xs):
        d_k, d_v = carry
        t, q_t, do_t, o_t, lse_t, dlse_t = xs
        # Scores and probabilities of this block: [B, Hkv, G, rows, Skv].
        s = config.scale * jnp.einsum("bigrd,bjgd->bgrij", q_t, k, precision=_HIGHEST)
        if config.softcap > 0:
            s = config.softcap * jnp.tanh(s / config.softcap)
        i = (t * rows + jnp.arange(rows))[:, None]
        # Which (row, key) pairs the forward used: real rows (i < Sq), allowed keys. A row
        # with no allowed key (lse = -inf) has none, so it contributes nothing; a row whose
        # lse is NaN (non-finite real data) propagates it, as the reference does.
        used = (j[None, :] < n) & (i < Sq)
        if config.is_causal:
            used = used & (j[None, :] <= i + n - Sq)
        p = jnp.where(used, jnp.exp(s - lse_t[..., None]), 0.0)
        d_v = d_v + jnp.einsum("bgrij,bigre->bjge", p, do_t, precision=_HIGHEST)
        d_p = jnp.einsum("bigre,bjge->bgrij", do_t, v, precision=_HIGHEST)
        delta = jnp.einsum("bigre,bigre->bgri", do_t, o_t, precision=_HIGHEST)[..., None]
        d_s = p * (d_p - delta + dlse_t[..., None])
        if config.softcap > 0:
            d_s = d_s * (1.0 - jnp.square(s / config.softcap))  # d/dx of c * tanh(x / c)
        # Exactly zero outside the used pairs, even where a NaN row makes p * (...) NaN: the
        # gradients of padded keys stay zero.
        d_s = jnp.where(used, d_s, 0.0)
        d_q = config.scale * jnp.einsum("bgrij,bjgd->bigrd", d_s, k, precision=_HIGHEST)
        d_k = d_k + config.scale * jnp.einsum("bgrij,bigrd->bjgd", d_s, q_t, precision=_HIGHEST)
        return (d_k, d_v), d_q

    init = tuple(
        _varying_like(jnp.zeros(shape, f32), query, key, value, lengths, out, lse, d_out, d_lse)
        for shape in ((B, Skv, Hkv, D), (B, Skv, Hkv, Dv))
    )
    xs = (jnp.arange(blocks), q, do, o, lse_r, dlse_r)
    (d_k, d_v), d_q = jax.lax.scan(step, init, xs)  # d_q: [blocks, B, rows, Hkv, G, D]
    d_q = jnp.moveaxis(d_q, 0, 1).reshape(B, blocks * rows, H, D)[:, :Sq]
    # Padded keys and values: exactly zero, also when a NaN query row turns 0 * NaN into NaN
    # in the products above.
    d_k = jnp.where(valid[:, :, None, None], d_k, 0.0)
    d_v = jnp.where(valid[:, :, None, None], d_v, 0.0)
    return d_q.astype(query.dtype), d_k.astype(key.dtype), d_v.astype(value.dtype)


def _varying_like(x, *operands):
    """``x`` typed as varying over every manual axis that some operand varies over. Inside
    ``shard_map`` (with ``check_vma``) a scan's carry must keep its type from step to step, and
    the steps mix in every operand; outside, and on a jax without these types, a no-op."""
    try:
        axes = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in operands))
        missing = tuple(sorted(axes - jax.typeof(x).manual_axis_type.varying))
    except AttributeError:
        return x
    return jax.lax.pcast(x, missing, to="varying") if missing else x


# Second order: a gradient's own derivative differentiates the backward pass (through its
# residuals or its cotangents); that raises.


@_backward.defjvp
def _backward_jvp(config, primals, tangents):
    raise NotImplementedError(SECOND_ORDER_MESSAGE)
