"""Gradients of the forward primitive: a ``jax.custom_vjp`` whose backward recomputes the
attention probabilities from the saved ``lse``.

The backward is plain XLA for now (fp32, a scan over blocks of query rows, so memory grows
with ``rows * Skv`` rather than ``Sq * Skv``), so it runs on every platform and composes with
``vmap``, ``jit`` and sharding; a fused backward kernel can replace
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


# Query rows per step of the backward's scan: the [B, H, rows, Skv] fp32 intermediates stay
# under about this many elements (256 MiB each), whatever Sq is.
_BWD_BLOCK_ELEMENTS = 1 << 26


def _bwd_block_rows(B, H, Sq, Skv) -> int:
    rows = max(1, _BWD_BLOCK_ELEMENTS // max(1, B * H * Skv))
    return min(Sq, 1 << (rows.bit_length() - 1))  # a power of two, at most Sq


def _bwd(config, residuals, cotangents):
    query, key, value, lengths, out, lse = residuals
    d_out, d_lse = cotangents
    B, Sq, H, D = query.shape
    Skv, Hkv = key.shape[1:3]
    Dv = value.shape[3]
    G = H // Hkv  # query heads per kv head: query head h = g * G + r reads kv head g
    f32 = jnp.float32

    lengths = jnp.clip(lengths, 0, Skv)  # as the kernels do with out-of-range values
    valid = jnp.arange(Skv)[None, :] < lengths[:, None]  # [B, Skv]
    k = jnp.where(valid[:, :, None, None], key.astype(f32), 0.0)  # [B, Skv, Hkv, D]
    v = jnp.where(valid[:, :, None, None], value.astype(f32), 0.0)  # [B, Skv, Hkv, Dv]

    # The query rows go through a scan in blocks of `rows`, so memory grows with rows * Skv,
    # not Sq * Skv. Sq is padded to whole blocks with rows whose lse is -inf (p = 0 there).
    rows = _bwd_block_rows(B, H, Sq, Skv)
    blocks = -(-Sq // rows)
    pad = blocks * rows - Sq

    def blocked(x, axis, fill=0.0):  # [..., Sq, ...] -> [blocks, ..., rows, ...] along `axis`
        x = jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)],
                    constant_values=fill)
        x = x.reshape(x.shape[:axis] + (blocks, rows) + x.shape[axis + 1:])
        return jnp.moveaxis(x, axis, 0)

    q = blocked(query.astype(f32).reshape(B, Sq, Hkv, G, D), 1)  # [blocks, B, rows, Hkv, G, D]
    do = blocked(d_out.astype(f32).reshape(B, Sq, Hkv, G, Dv), 1)
    o = blocked(out.astype(f32).reshape(B, Sq, Hkv, G, Dv), 1)
    lse_r = blocked(lse.reshape(B, Hkv, G, Sq), 3, -jnp.inf)  # [blocks, B, Hkv, G, rows]
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
        allowed = j[None, :] < n
        if config.is_causal:
            allowed = allowed & (j[None, :] <= i + n - Sq)
        finite = jnp.isfinite(lse_t)[..., None]
        p = jnp.where(allowed & finite, jnp.exp(s - jnp.where(finite, lse_t[..., None], 0.0)), 0.0)
        d_v = d_v + jnp.einsum("bgrij,bigre->bjge", p, do_t, precision=_HIGHEST)
        d_p = jnp.einsum("bigre,bjge->bgrij", do_t, v, precision=_HIGHEST)
        delta = jnp.einsum("bigre,bigre->bgri", do_t, o_t, precision=_HIGHEST)[..., None]
        d_s = p * (d_p - delta + dlse_t[..., None])
        if config.softcap > 0:
            d_s = d_s * (1.0 - jnp.square(s / config.softcap))  # d/dx of c * tanh(x / c)
        d_q = config.scale * jnp.einsum("bgrij,bjgd->bigrd", d_s, k, precision=_HIGHEST)
        d_k = d_k + config.scale * jnp.einsum("bgrij,bigrd->bjgd", d_s, q_t, precision=_HIGHEST)
        return (d_k, d_v), d_q

    init = (jnp.zeros((B, Skv, Hkv, D), f32), jnp.zeros((B, Skv, Hkv, Dv), f32))
    xs = (jnp.arange(blocks), q, do, o, lse_r, dlse_r)
    (d_k, d_v), d_q = jax.lax.scan(step, init, xs)  # d_q: [blocks, B, rows, Hkv, G, D]
    d_q = jnp.moveaxis(d_q, 0, 1).reshape(B, blocks * rows, H, D)[:, :Sq]
    return (
        d_q.astype(query.dtype),
        d_k.astype(key.dtype),
        d_v.astype(value.dtype),
        None,  # integer lengths have no gradient
    )


attention_with_grad.defvjp(_fwd, _bwd)
