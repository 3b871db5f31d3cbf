"""The backward attention primitives, padded and packed: abstract evaluation, batching and
per-platform lowering, with the forward's shared rules (``_primitive.py``).

Operands (rank 4, as the forward's; ``_autodiff`` binds them as the transpose of the forward's
tangent map):
  query [N, Sq, H, D], key [N, Skv, Hkv, D], value [N, Skv, Hkv, Dv] (one dtype), the lengths
  (``attention_bwd_p``: nonpad_kv_seqlen int32 [B], N = B; ``packed_attention_bwd_p``:
  cu_seqlens_q and cu_seqlens_k int32 [N, B + 1], Sq = Tq, Skv = Tk), out [N, Sq, H, Dv]
  (query's dtype), lse float32 [N, H, Sq] (the forward's results), d_out (out's shape and
  dtype), d_lse float32 [N, H, Sq] (their cotangents)
Results:
  d_query, d_key, d_value (the shapes and dtype of query, key, value)
Static parameter: ``config``, the forward's :class:`AttentionConfig`.

The FFI call is the same on every platform (targets ``_ffi.BWD_CPU_TARGET`` and
``_ffi.BWD_CUDA_TARGET``, packed: ``_ffi.PACKED_BWD_*``): the operands in this order; results
d_query, d_key, d_value and ``delta`` (float32, lse's shape, a workspace that the lowering adds
and drops), and on CUDA the Hopper kernel's dQ workspace (float32 ``[N, per pack]``, the size
the plan gives, ``_primitive.cuda_plan``; empty where that kernel never runs); attributes, read
by the handlers as one dictionary (ffi/xla/handler_common.h, ``CallAttrs``): ``scale``
(f32), ``is_causal`` (bool), ``softcap`` (f32), ``window_left`` and ``window_right`` (i64, -1:
that side unbounded; optional), packed: ``max_seqlen_q``, ``max_seqlen_k`` (i64). The math is in ffi/core/params.h (``BackwardParams``): keys at or past ``n_b`` get exactly
zero gradient and are never read, rows with no allowed key contribute nothing, lengths are
clamped into ``[0, Skv]``; packed rows that no sequence owns get zero gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching

from jax_varlen import _checkify, _ffi, _sharding
from jax_varlen._config import AttentionConfig
from jax_varlen._primitive import (
    batch_rule,
    cuda_plan,
    ffi_attrs,
    jit_impl,
    lower_cpu,
    workspace_aval,
)

attention_bwd_p = Primitive("jax_varlen_attention_bwd")
attention_bwd_p.multiple_results = True
packed_attention_bwd_p = Primitive("jax_varlen_packed_attention_bwd")
packed_attention_bwd_p.multiple_results = True


def attention_bwd(query, key, value, nonpad_kv_seqlen, out, lse, d_out, d_lse,
                  config: AttentionConfig):
    """Binds the padded primitive; returns ``(d_query, d_key, d_value)``."""
    return attention_bwd_p.bind(query, key, value, nonpad_kv_seqlen, out, lse, d_out, d_lse,
                                config=config)


def _abstract_eval(query, key, value, *lengths_and_residuals, config):
    out, lse, d_out, d_lse = lengths_and_residuals[-4:]
    N, Sq, H, _ = query.shape
    expected = {
        "out": (out, (N, Sq, H, value.shape[3]), query.dtype),
        "lse": (lse, (N, H, Sq), jnp.float32),
        "d_out": (d_out, (N, Sq, H, value.shape[3]), query.dtype),
        "d_lse": (d_lse, (N, H, Sq), jnp.float32),
    }
    for name, (aval, shape, dtype) in expected.items():
        if tuple(aval.shape) != shape or aval.dtype != dtype:
            raise TypeError(
                f"jax_varlen backward: {name} must be {jnp.dtype(dtype).name}{list(shape)}, "
                f"got {aval.dtype.name}{list(aval.shape)}"
            )
    return [jax.core.ShapedArray(x.shape, x.dtype) for x in (query, key, value)]


# As the forward's: a vmapped axis folds into the batch (packs) axis, which leads every operand
# and result ([M, N, ...] -> [M * N, ...]), so it is still one call.
for _p in (attention_bwd_p, packed_attention_bwd_p):
    _p.def_impl(jit_impl(_p))
    batching.primitive_batchers[_p] = batch_rule(_p)


def _with_workspaces(lower, workspaces_of=lambda ctx, config: ()):
    """``lower`` (a forward-style lowering of the call's operands and results) given the extra
    results the handlers write: delta first (lse's shape), then the platform's own
    (``workspaces_of(ctx, config)``: avals). XLA allocates them (the handlers never do), and
    nothing reads them after the call."""

    def lowering(ctx, *args, config):
        delta = jax.core.ShapedArray(ctx.avals_in[-3].shape, jnp.float32)  # lse's
        extra = [delta, *workspaces_of(ctx, config)]
        results = lower(ctx.replace(avals_out=[*ctx.avals_out, *extra]), *args, config=config)
        return list(results[:3])  # d_query, d_key, d_value

    return lowering


def _dq_workspace(ctx, config):
    """The CUDA call's one workspace: the Hopper backward's dQ (float32, the plan's size)."""
    plan = cuda_plan(ctx.avals_in, config)
    return [workspace_aval(ctx.avals_in, plan["dq_workspace_per_pack"])]


def _lower_cuda(target):
    """The CUDA lowering of a backward primitive (with its workspaces)."""

    def lower(ctx, *args, config):
        return jax.ffi.ffi_lowering(target)(ctx, *args, **ffi_attrs(config))

    return _with_workspaces(lower, _dq_workspace)


# Like the forward: batch (packs) and whole kv-head groups split with no communication; the
# sequence and head-size axes stay whole (_sharding.py).
_RESIDUALS = ("b q (k g) e", "b (k g) q", "b q (k g) e", "b (k g) q")  # out, lse, d_out, d_lse
_GRADS = ("b q (k g) d", "b s k d", "b s k e")  # d_query, d_key, d_value
_sharding.register(
    attention_bwd_p,
    _sharding.ShardingRule(
        # query, key, value, lengths
        operands=("b q (k g) d", "b s k d", "b s k e", "b", *_RESIDUALS),
        results=_GRADS,
        parallel=("b", "k"),
    ),
    abstract_eval=_abstract_eval,
    lowerings={
        "cpu": _with_workspaces(lower_cpu(_ffi.BWD_CPU_TARGET)),
        "cuda": _lower_cuda(_ffi.BWD_CUDA_TARGET),
    },
    targets=(_ffi.BWD_CPU_TARGET, _ffi.BWD_CUDA_TARGET),
)
_sharding.register(
    packed_attention_bwd_p,
    _sharding.ShardingRule(
        # query, key, value, cu_seqlens_q, cu_seqlens_k
        operands=("b q (k g) d", "b s k d", "b s k e", "b c", "b c", *_RESIDUALS),
        results=_GRADS,
        parallel=("b", "k"),
    ),
    abstract_eval=_abstract_eval,
    lowerings={
        "cpu": _with_workspaces(lower_cpu(_ffi.PACKED_BWD_CPU_TARGET)),
        "cuda": _lower_cuda(_ffi.PACKED_BWD_CUDA_TARGET),
    },
    targets=(_ffi.PACKED_BWD_CPU_TARGET, _ffi.PACKED_BWD_CUDA_TARGET),
)

# Under checkify, lengths outside [0, Skv] (and malformed offsets) are reported here too: a
# pullback can be checkified apart from its forward (elsewhere the kernels clamp them).
_checkify.register_lengths_check(attention_bwd_p, 3, lambda q, k, *rest: k.shape[1])
_checkify.register_cu_seqlens_check(packed_attention_bwd_p)
