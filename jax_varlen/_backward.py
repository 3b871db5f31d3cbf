"""The backward attention primitive: abstract evaluation, batching and per-platform lowering.

Operands (rank 4, as the forward's; ``_autodiff`` binds it as the transpose of the forward's
tangent map):
  query [B, Sq, H, D], key [B, Skv, Hkv, D], value [B, Skv, Hkv, Dv] (one dtype),
  nonpad_kv_seqlen int32 [B], out [B, Sq, H, Dv] (query's dtype), lse float32 [B, H, Sq]
  (the forward's results), d_out (out's shape and dtype), d_lse float32 [B, H, Sq] (their
  cotangents)
Results:
  d_query, d_key, d_value (the shapes and dtype of query, key, value)
Static parameter: ``config``, the forward's :class:`AttentionConfig`.

The FFI call is the same on every platform (targets ``_ffi.BWD_CPU_TARGET`` and
``_ffi.BWD_CUDA_TARGET``): the eight operands in this order; results d_query, d_key, d_value
and ``delta`` (float32 [B, H, Sq], a workspace that the lowering adds and drops), and on CUDA
the Hopper kernel's dQ workspace (float32, :func:`dq_workspace_shape`); attributes
``scale`` (f32), ``is_causal`` (bool), ``softcap`` (f32). The math is in ffi/params.h
(``BackwardParams``): keys at or past ``n_b`` get exactly zero gradient and are never read,
rows with no allowed key contribute nothing, lengths are clamped into ``[0, Skv]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching

from jax_varlen import _checkify, _ffi, _sharding
from jax_varlen._config import AttentionConfig
from jax_varlen._primitive import (
    BWD_BLOCK_M,
    BWD_SM90_MAX_HEAD_DIM,
    HEAD_DIM_BUCKETS,
    ffi_attrs,
    fold_vmapped_axis,
    require_cuda_kernels,
    unfold_vmapped_axis,
)

attention_bwd_p = Primitive("jax_varlen_attention_bwd")
attention_bwd_p.multiple_results = True


def attention_bwd(query, key, value, nonpad_kv_seqlen, out, lse, d_out, d_lse,
                  config: AttentionConfig):
    """Binds the primitive; returns ``(d_query, d_key, d_value)``."""
    return attention_bwd_p.bind(query, key, value, nonpad_kv_seqlen, out, lse, d_out, d_lse,
                                config=config)


attention_bwd_p.def_impl(
    lambda *args, config: jax.jit(attention_bwd, static_argnums=8)(*args, config))


def _abstract_eval(query, key, value, nonpad_kv_seqlen, out, lse, d_out, d_lse, *, config):
    B, Sq, H, _ = query.shape
    expected = {
        "out": (out, (B, Sq, H, value.shape[3]), query.dtype),
        "lse": (lse, (B, H, Sq), jnp.float32),
        "d_out": (d_out, (B, Sq, H, value.shape[3]), query.dtype),
        "d_lse": (d_lse, (B, H, Sq), jnp.float32),
    }
    for name, (aval, shape, dtype) in expected.items():
        if tuple(aval.shape) != shape or aval.dtype != dtype:
            raise TypeError(
                f"jax_varlen backward: {name} must be {jnp.dtype(dtype).name}{list(shape)}, "
                f"got {aval.dtype.name}{list(aval.shape)}"
            )
    return [jax.core.ShapedArray(x.shape, x.dtype) for x in (query, key, value)]


def _batch(args, dims, *, config):
    """As the forward's: a vmapped axis folds into the batch axis, which leads every operand
    and result ([N, B, ...] -> [N * B, ...]), so it is still one call."""
    size, folded = fold_vmapped_axis(args, dims)
    results = unfold_vmapped_axis(attention_bwd(*folded, config), size)
    return results, [0] * len(results)


batching.primitive_batchers[attention_bwd_p] = _batch


def dq_workspace_shape(query_aval, value_aval):
    """Float32 dQ workspace of the Hopper backward (layout: ffi/cuda/limits.h): per (sequence,
    head, block of BWD_BLOCK_M rows) an fp32 partial sum of the block's dQ and a counter;
    empty when the head sizes' bucket is past the kernel's."""
    B, Sq, H, D = query_aval.shape
    dim = next(b for b in HEAD_DIM_BUCKETS if max(D, value_aval.shape[3]) <= b)
    if dim > BWD_SM90_MAX_HEAD_DIM:
        return (0,)
    return (B * H * -(-Sq // BWD_BLOCK_M) * (BWD_BLOCK_M * dim + 1),)


def _lower(target, ctx, *args, config, workspaces=()):
    # The workspaces: results that XLA allocates (the handlers never do) and nothing reads after
    # the call. delta first (lse's shape), then the platform's own.
    delta = jax.core.ShapedArray(ctx.avals_in[5].shape, jnp.float32)
    extra = [delta, *(jax.core.ShapedArray(s, jnp.float32) for s in workspaces)]
    ctx = ctx.replace(avals_out=[*ctx.avals_out, *extra])
    results = jax.ffi.ffi_lowering(target)(ctx, *args, **ffi_attrs(config))
    return list(results[:3])  # d_query, d_key, d_value


def _lower_cpu(ctx, *args, config):
    _ffi.extension()
    return _lower(_ffi.BWD_CPU_TARGET, ctx, *args, config=config)


def _lower_cuda(ctx, *args, config):
    query, _, value = ctx.avals_in[:3]
    require_cuda_kernels(query.shape[-1], value.shape[-1])
    return _lower(_ffi.BWD_CUDA_TARGET, ctx, *args, config=config,
                  workspaces=[dq_workspace_shape(query, value)])


# Like the forward: batch and whole kv-head groups split with no communication; the sequence
# and head-size axes stay whole (_sharding.py).
_sharding.register(
    attention_bwd_p,
    _sharding.ShardingRule(
        # query, key, value, lengths, out, lse, d_out, d_lse
        operands=("b q (k g) d", "b s k d", "b s k e", "b",
                  "b q (k g) e", "b (k g) q", "b q (k g) e", "b (k g) q"),
        results=("b q (k g) d", "b s k d", "b s k e"),  # d_query, d_key, d_value
        parallel=("b", "k"),
    ),
    abstract_eval=_abstract_eval,
    lowerings={"cpu": _lower_cpu, "cuda": _lower_cuda},
    targets=(_ffi.BWD_CPU_TARGET, _ffi.BWD_CUDA_TARGET),
)

# Under checkify, lengths outside [0, Skv] are reported here too: a pullback can be
# checkified apart from its forward (elsewhere the kernels clamp them).
_checkify.register_lengths_check(attention_bwd_p, 3, lambda q, k, *rest: k.shape[1])
