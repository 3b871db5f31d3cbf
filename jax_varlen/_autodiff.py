"""Gradients of the forward primitive: a ``jax.custom_vjp`` whose backward recomputes the
attention probabilities from the saved ``lse``.

The backward is plain XLA for now (dense over ``[B, H, Sq, Skv]``, fp32), so it runs on every
platform and composes with ``vmap``, ``jit`` and sharding; a fused backward kernel can replace
it behind the same ``custom_vjp`` without changing callers. Padding never leaks: padded keys
and values are zeroed before any product, so their gradients are exactly zero, and rows with
no allowed key (``lse = -inf``) contribute nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_varlen._config import AttentionConfig
from jax_varlen._primitive import attention_fwd

_HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attention_with_grad(query, key, value, nonpad_kv_seqlen, config: AttentionConfig):
    """``(out, lse)`` of the forward primitive, differentiable in query, key and value."""
    return attention_fwd(query, key, value, nonpad_kv_seqlen, config)


def _fwd(query, key, value, nonpad_kv_seqlen, config):
    out, lse = attention_fwd(query, key, value, nonpad_kv_seqlen, config)
    return (out, lse), (query, key, value, nonpad_kv_seqlen, out, lse)


def _bwd(config, residuals, cotangents):
    query, key, value, lengths, out, lse = residuals
    d_out, d_lse = cotangents
    B, Sq, H, D = query.shape
    Skv, Hkv = key.shape[1:3]
    G = H // Hkv  # query heads per kv head: query head h = g * G + r reads kv head g
    f32 = jnp.float32

    lengths = jnp.clip(lengths, 0, Skv)  # as the kernels do with out-of-range values
    valid = jnp.arange(Skv)[None, :] < lengths[:, None]  # [B, Skv]
    k = jnp.where(valid[:, :, None, None], key.astype(f32), 0.0)
    v = jnp.where(valid[:, :, None, None], value.astype(f32), 0.0)
    q = query.astype(f32).reshape(B, Sq, Hkv, G, D)
    do = d_out.astype(f32).reshape(B, Sq, Hkv, G, -1)
    o = out.astype(f32).reshape(B, Sq, Hkv, G, -1)

    # Scores and probabilities: [B, Hkv, G, Sq, Skv].
    s = config.scale * jnp.einsum("bigrd,bjgd->bgrij", q, k, precision=_HIGHEST)
    if config.softcap > 0:
        s = config.softcap * jnp.tanh(s / config.softcap)
    i = jnp.arange(Sq)[:, None]
    j = jnp.arange(Skv)[None, :]
    n = lengths[:, None, None, None, None]
    allowed = j < n
    if config.is_causal:
        allowed = allowed & (j <= i + n - Sq)
    lse_b = lse.reshape(B, Hkv, G, Sq)[..., None]
    p = jnp.where(allowed & jnp.isfinite(lse_b), jnp.exp(s - jnp.where(jnp.isfinite(lse_b), lse_b, 0.0)), 0.0)

    d_v = jnp.einsum("bgrij,bigre->bjge", p, do, precision=_HIGHEST)
    d_p = jnp.einsum("bigre,bjge->bgrij", do, v, precision=_HIGHEST)
    delta = jnp.einsum("bigre,bigre->bgri", do, o, precision=_HIGHEST)[..., None]
    d_s = p * (d_p - delta + d_lse.astype(f32).reshape(B, Hkv, G, Sq)[..., None])
    if config.softcap > 0:
        d_s = d_s * (1.0 - jnp.square(s / config.softcap))  # d/dx of c * tanh(x / c)
    d_q = config.scale * jnp.einsum("bgrij,bjgd->bigrd", d_s, k, precision=_HIGHEST)
    d_k = config.scale * jnp.einsum("bgrij,bigrd->bjgd", d_s, q, precision=_HIGHEST)
    return (
        d_q.reshape(query.shape).astype(query.dtype),
        d_k.astype(key.dtype),
        d_v.astype(value.dtype),
        None,  # integer lengths have no gradient
    )


attention_with_grad.defvjp(_fwd, _bwd)
