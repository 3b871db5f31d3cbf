"""The forward attention primitive: abstract evaluation, batching and per-platform lowering.

Operands (already normalized to rank 4 by ``_api``):
  query [B, Sq, H, D], key [B, Skv, Hkv, D], value [B, Skv, Hkv, Dv], nonpad_kv_seqlen int32 [B]
Results:
  out [B, Sq, H, Dv] (dtype of query), lse float32 [B, H, Sq]
Static parameter: ``config``, one frozen :class:`AttentionConfig`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching

from jax_varlen import _checkify, _ffi, _sharding
from jax_varlen._config import AttentionConfig

# The CUDA path's limits, read from the C++ headers that define them (ffi/cuda/limits.h) through
# the extension, which exports them in a CPU-only build too. The CUDA kernels take head sizes up
# to CUDA_MAX_HEAD_DIM (smaller ones round up to a bucket). Split-KV (decode) path: used for up
# to SPLIT_MAX_SEQLEN_Q queries per sequence, cutting each sequence's keys into chunks of
# SPLIT_KEYS. The chunk is a constant (never derived from the batch), so a sequence's result does
# not depend on its batch-mates. In a source tree that was never built they are None: every
# lowering loads the extension first and raises there.
try:
    _CONSTANTS = _ffi.extension().constants()
except ImportError:
    _CONSTANTS = {}
CUDA_MAX_HEAD_DIM = _CONSTANTS.get("cuda_max_head_dim")
SPLIT_MAX_SEQLEN_Q = _CONSTANTS.get("split_max_seqlen_q")
SPLIT_KEYS = _CONSTANTS.get("split_keys")
# Head-dim buckets of the tensor-core kernels, and the Hopper backward's dQ blocks and largest
# bucket (its dQ workspace, _backward.py).
HEAD_DIM_BUCKETS = _CONSTANTS.get("head_dim_buckets")
BWD_BLOCK_M = _CONSTANTS.get("bwd_block_m")
BWD_SM90_MAX_HEAD_DIM = _CONSTANTS.get("bwd_sm90_max_head_dim")

attention_fwd_p = Primitive("jax_varlen_attention_fwd")
attention_fwd_p.multiple_results = True


def attention_fwd(query, key, value, nonpad_kv_seqlen, config: AttentionConfig):
    """Binds the primitive; returns ``(out, lse)``."""
    return attention_fwd_p.bind(query, key, value, nonpad_kv_seqlen, config=config)


attention_fwd_p.def_impl(lambda *args, config: jax.jit(attention_fwd, static_argnums=4)(*args, config))


@attention_fwd_p.def_abstract_eval
def _abstract_eval(query, key, value, nonpad_kv_seqlen, *, config):
    B, Sq, H, _ = query.shape
    Dv = value.shape[-1]
    return (
        jax.core.ShapedArray((B, Sq, H, Dv), query.dtype),
        jax.core.ShapedArray((B, H, Sq), jnp.float32),
    )


def fold_vmapped_axis(args, dims):
    """``(size, operands)``: each operand's vmapped axis folded into its leading batch axis,
    ``[N, B, ...] -> [N * B, ...]``, for primitives whose operands all lead with the batch.

    Unbatched operands are broadcast along the vmapped axis (lengths cost nothing; an
    unbatched query/key/value is materialized once per vmapped element, like any batched call).
    """
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    folded = []
    for a, d in zip(args, dims):
        if d is None:  # unbatched operand
            a = jnp.broadcast_to(a, (size,) + a.shape)
        else:
            a = jnp.moveaxis(a, d, 0)
        folded.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
    return size, folded


def unfold_vmapped_axis(results, size):
    """The inverse for results that lead with the batch: ``[N * B, ...] -> [N, B, ...]``."""
    return [r.reshape((size, -1) + r.shape[1:]) for r in results]


def _batch(args, dims, *, config):
    """A vmapped axis folds into the batch axis: [N, B, ...] -> [N * B, ...], one launch."""
    size, folded = fold_vmapped_axis(args, dims)
    results = unfold_vmapped_axis(attention_fwd(*folded, config), size)
    return results, [0] * len(results)


batching.primitive_batchers[attention_fwd_p] = _batch


def ffi_attrs(config: AttentionConfig):
    """The FFI attributes of a call (the forward's and the backward's): scale, is_causal,
    softcap."""
    return dict(
        scale=np.float32(config.scale),
        is_causal=bool(config.is_causal),
        softcap=np.float32(config.softcap),
    )


def _lower_cpu(ctx, *args, config):
    _ffi.extension()
    return jax.ffi.ffi_lowering(_ffi.CPU_TARGET)(ctx, *args, **ffi_attrs(config))


def split_keys_for(query_aval) -> int:
    """Keys per split-KV chunk for this call on CUDA, or 0 for the one-pass kernel."""
    short = query_aval.shape[1] <= SPLIT_MAX_SEQLEN_Q
    return SPLIT_KEYS if short and query_aval.dtype in (jnp.float16, jnp.bfloat16) else 0


def split_workspace_shape(query_aval, key_aval, value_aval, split_keys: int):
    """Float32 workspace of the split-KV path (layout: ffi/params.h), empty when unused."""
    if not split_keys:
        return (0,)
    B, Sq, H, _ = query_aval.shape
    Skv, Hkv = key_aval.shape[1:3]
    rows_pad = -(-Sq * (H // Hkv) // 16) * 16
    max_splits = -(-Skv // split_keys)
    return (B * Hkv * max_splits * rows_pad * (value_aval.shape[3] + 1),)


def require_cuda_kernels(head_dim: int, head_dim_v: int) -> None:
    """Raises unless the extension carries its CUDA kernels and they take these head sizes
    (the forward's and the backward's CUDA lowerings both check this)."""
    if not _ffi.has_cuda():
        raise RuntimeError(
            "jax_varlen was built without its CUDA kernels, so it cannot run on a GPU. "
            "Reinstall on a machine with the CUDA toolkit (nvcc) on PATH, or force the build "
            "with JAX_VARLEN_CUDA=ON; to run on the CPU, place the inputs there "
            "(jax.device_put(x, jax.devices('cpu')[0]))."
        )
    if max(head_dim, head_dim_v) > CUDA_MAX_HEAD_DIM:
        raise ValueError(
            f"jax_varlen on CUDA supports head sizes up to {CUDA_MAX_HEAD_DIM}; got query/key "
            f"head size {head_dim} and value head size {head_dim_v}"
        )


def _lower_cuda(ctx, query, *args, config):
    require_cuda_kernels(ctx.avals_in[0].shape[-1], ctx.avals_in[2].shape[-1])
    # The split-KV workspace is a third result that only the CUDA call has: XLA allocates it
    # (the handler never does), and nothing reads it after the call.
    q_aval, k_aval, v_aval, _ = ctx.avals_in
    split_keys = split_keys_for(q_aval)
    workspace = jax.core.ShapedArray(
        split_workspace_shape(q_aval, k_aval, v_aval, split_keys), jnp.float32
    )
    ctx = ctx.replace(avals_out=[*ctx.avals_out, workspace])
    out, lse, _ = jax.ffi.ffi_lowering(_ffi.CUDA_TARGET)(
        ctx, query, *args, **ffi_attrs(config), split_keys=np.int64(split_keys)
    )
    return [out, lse]


# Sharded jit splits batch and whole kv-head groups with no communication; the sequence and
# head-size axes stay whole (see _sharding.py for the mechanism and its limits).
_sharding.register(
    attention_fwd_p,
    _sharding.ShardingRule(
        operands=("b q (k g) d", "b s k d", "b s k e", "b"),  # query, key, value, lengths
        results=("b q (k g) e", "b (k g) q"),  # out, lse; query head h = k * (H // Hkv) + g
        parallel=("b", "k"),
    ),
    abstract_eval=_abstract_eval,
    lowerings={"cpu": _lower_cpu, "cuda": _lower_cuda},
    targets=(_ffi.CPU_TARGET, _ffi.CUDA_TARGET),
)

# Under checkify, lengths outside [0, Skv] are reported (elsewhere the kernels clamp them).
_checkify.register_lengths_check(attention_fwd_p, 3, lambda q, k, v, n: k.shape[1])
