"""The forward attention primitives, padded and packed: abstract evaluation, batching and
per-platform lowering, one set of rules for both.

``attention_fwd_p``, operands (already normalized to rank 4 by ``_api``):
  query [B, Sq, H, D], key [B, Skv, Hkv, D], value [B, Skv, Hkv, Dv], nonpad_kv_seqlen int32 [B]
``packed_attention_fwd_p``, operands (``_packed_api`` adds the leading axis):
  query [N, Tq, H, D], key [N, Tk, Hkv, D], value [N, Tk, Hkv, Dv], cu_seqlens_q and
  cu_seqlens_k int32 [N, B + 1]: N packs (1 from the public API, more under vmap) of B
  sequences each (ffi/core/params.h)
Results of both:
  out [N, Sq, H, Dv] (dtype of query), lse float32 [N, H, Sq] (packed: Sq = Tq)
Static parameter: ``config``, one frozen :class:`AttentionConfig` (packed: with the
``max_seqlen_q/k`` hints).

``attention_fwd_sinks_p`` and ``packed_attention_fwd_sinks_p``: the same with one more operand,
sinks float32 [H] (one logit per query head, gpt-oss), which the kernels add to every real
row's softmax denominator (ffi/core/sinks.h): out and lse include it, so the backward
primitives serve them unchanged (``_autodiff._with_sinks_grad`` adds ``d_sinks``).

Both primitives lead every operand and result with the same axis (the batch, or the packs), so
they share their abstract evaluation, their batching rule (a vmapped axis folds into that axis:
for the packed layout, a vmapped axis becomes more packs, i.e. more sequences, in one launch)
and their lowerings; only the FFI targets, the sharding rules' length operands and the
checkify checks differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching

from jax_varlen import _checkify, _ffi, _sharding
from jax_varlen._config import AttentionConfig

attention_fwd_p = Primitive("jax_varlen_attention_fwd")
attention_fwd_p.multiple_results = True
packed_attention_fwd_p = Primitive("jax_varlen_packed_attention_fwd")
packed_attention_fwd_p.multiple_results = True


def attention_fwd(query, key, value, nonpad_kv_seqlen, config: AttentionConfig):
    """Binds the padded primitive; returns ``(out, lse)``."""
    return attention_fwd_p.bind(query, key, value, nonpad_kv_seqlen, config=config)


def packed_attention_fwd(query, key, value, cu_seqlens_q, cu_seqlens_k, config: AttentionConfig):
    """Binds the packed primitive; returns ``(out, lse)``."""
    return packed_attention_fwd_p.bind(query, key, value, cu_seqlens_q, cu_seqlens_k,
                                       config=config)


attention_fwd_sinks_p = Primitive("jax_varlen_attention_fwd_sinks")
attention_fwd_sinks_p.multiple_results = True
packed_attention_fwd_sinks_p = Primitive("jax_varlen_packed_attention_fwd_sinks")
packed_attention_fwd_sinks_p.multiple_results = True


def attention_fwd_sinks(query, key, value, nonpad_kv_seqlen, sinks, config: AttentionConfig):
    """Binds the padded primitive with sinks (float32 [H]); returns ``(out, lse)``."""
    return attention_fwd_sinks_p.bind(query, key, value, nonpad_kv_seqlen, sinks, config=config)


def packed_attention_fwd_sinks(query, key, value, cu_seqlens_q, cu_seqlens_k, sinks,
                               config: AttentionConfig):
    """Binds the packed primitive with sinks (float32 [H]); returns ``(out, lse)``."""
    return packed_attention_fwd_sinks_p.bind(query, key, value, cu_seqlens_q, cu_seqlens_k, sinks,
                                             config=config)


def jit_impl(primitive):
    """Eager evaluation of ``primitive``: its binding, compiled once per shape and config."""

    def impl(*args, config):
        return primitive.bind(*args, config=config)

    return jax.jit(impl, static_argnames="config")


def _abstract_eval(query, key, value, *lengths, config):
    N, Sq, H, _ = query.shape
    Dv = value.shape[-1]
    return (
        jax.core.ShapedArray((N, Sq, H, Dv), query.dtype),
        jax.core.ShapedArray((N, H, Sq), jnp.float32),
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


def batch_rule_of(bind):
    """The batching rule of a binding ``bind(*operands, config) -> results`` whose operands and
    results all lead with its batch (or packs) axis: a vmapped axis folds into it,
    [M, N, ...] -> [M * N, ...], one launch."""

    def rule(args, dims, *, config):
        size, folded = fold_vmapped_axis(args, dims)
        results = unfold_vmapped_axis(bind(*folded, config=config), size)
        return results, [0] * len(results)

    return rule


def batch_rule(primitive):
    """``batch_rule_of`` for a primitive whose operands and results all lead with its batch."""
    return batch_rule_of(lambda *operands, config: primitive.bind(*operands, config=config))


def sinks_batch_rule(primitive):
    """The batching rule of a forward primitive with sinks (its last operand, [H], which does
    not lead with the batch): with the sinks unbatched, the others fold into the batch (one
    launch); with batched sinks (each vmapped element its own), one call per element, in a
    loop (``lax.map``)."""

    def rule(args, dims, *, config):
        if dims[-1] is None:
            sinks = args[-1]
            return batch_rule_of(lambda *folded, config: primitive.bind(*folded, sinks, config=config))(
                args[:-1], dims[:-1], config=config)
        batched = [None if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]

        def one(elements):
            it = iter(elements)
            return primitive.bind(*[a if b is None else next(it) for a, b in zip(args, batched)],
                                  config=config)

        results = jax.lax.map(one, [b for b in batched if b is not None])
        return list(results), [0] * len(results)

    return rule


for _p in (attention_fwd_p, packed_attention_fwd_p):
    _p.def_impl(jit_impl(_p))
    batching.primitive_batchers[_p] = batch_rule(_p)
for _p in (attention_fwd_sinks_p, packed_attention_fwd_sinks_p):
    _p.def_impl(jit_impl(_p))
    batching.primitive_batchers[_p] = sinks_batch_rule(_p)


def ffi_attrs(config: AttentionConfig):
    """The FFI attributes of a call (the forward's and the backward's): scale, is_causal,
    softcap, for the packed layout max_seqlen_q and max_seqlen_k, then window_left and
    window_right (-1: that side of the local window unbounded)."""
    attrs = dict(
        scale=np.float32(config.scale),
        is_causal=bool(config.is_causal),
        softcap=np.float32(config.softcap),
    )
    if config.max_seqlen_q is not None:
        attrs.update(max_seqlen_q=np.int64(config.max_seqlen_q),
                     max_seqlen_k=np.int64(config.max_seqlen_k))
    attrs.update(window_left=np.int64(config.window_left),
                 window_right=np.int64(config.window_right))
    return attrs


def lower_cpu(target: str):
    """The CPU lowering of a primitive: its operands and results, as they are, to ``target``."""

    def lower(ctx, *args, config):
        _ffi.extension()
        return jax.ffi.ffi_lowering(target)(ctx, *args, **ffi_attrs(config))

    return lower


def cuda_plan(avals_in, config: AttentionConfig) -> dict:
    """The CUDA call's plan (ffi/plan/plan.h, the extension's ``plan()``) for a primitive's
    operands: paths, head-dim bucket and every workspace's float32 elements per pack. The CUDA
    handler makes the same plan from the same shapes and rejects workspaces of other sizes.

    Its inputs are named as in ffi/core/params.h: the padded batch is a pack per sequence; the packed
    layout's ``cu_seqlens_q`` [N, B + 1] gives B sequences per pack and the ``max_seqlen_q/k``
    hints the grids' extents. No workspace depends on the number of packs (which may be
    symbolic here), so the plan is asked for one.

    Raises ``RuntimeError`` if the extension has no CUDA kernels and ``ValueError`` if they
    cannot take the call (head sizes past the largest bucket, more kv heads or sequences than
    the grids hold), with the plan's message.
    """
    if not _ffi.has_cuda():
        raise RuntimeError(
            "jax_varlen was built without its CUDA kernels, so it cannot run on a GPU. "
            "Reinstall on a machine with the CUDA toolkit (nvcc) on PATH, or force the build "
            "with JAX_VARLEN_CUDA=ON; to run on the CPU, place the inputs there "
            "(jax.device_put(x, jax.devices('cpu')[0]))."
        )
    query, key, value = avals_in[:3]
    _, pack_rows_q, num_heads, head_dim = query.shape
    _, pack_rows_k, kv_num_heads, _ = key.shape
    head_dim_v = value.shape[3]
    if config.max_seqlen_q is None:
        pack_seqs, seqlen_q, seqlen_k = 1, pack_rows_q, pack_rows_k
    else:
        pack_seqs, seqlen_q, seqlen_k = (avals_in[3].shape[1] - 1, config.max_seqlen_q,
                                         config.max_seqlen_k)

    def ask(seqs):
        plan = _ffi.extension().plan(
            dtype=jnp.dtype(query.dtype).name, pack_seqs=seqs, pack_rows_q=pack_rows_q,
            pack_rows_k=pack_rows_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=num_heads,
            kv_num_heads=kv_num_heads, head_dim=head_dim, head_dim_v=head_dim_v,
            is_causal=config.is_causal, window_left=config.window_left,
            window_right=config.window_right)
        if plan["unsupported"]:
            raise ValueError(plan["unsupported"])
        return plan

    if not jax.export.is_symbolic_dim(pack_seqs):
        return ask(pack_seqs)
    # A symbolic number of sequences per pack (jax.export): the plan at one sequence and each
    # workspace's growth per sequence (plan.h) give its size as an expression; the handler plans
    # the concrete count.
    plan = ask(1)
    for name in ("fwd", "dq"):
        plan[f"{name}_workspace_per_pack"] += (pack_seqs - 1) * plan[f"{name}_workspace_per_seq"]
    return plan


def workspace_aval(avals_in, per_pack: int) -> jax.core.ShapedArray:
    """A float32 workspace of the CUDA call, ``[N, per_pack]``: like every operand it leads with
    the packs (the batch), so XLA's batch partitioner splits it with them; the layout inside is
    the kernels' (ffi/core/params.h, ffi/plan/limits.h)."""
    return jax.core.ShapedArray((avals_in[0].shape[0], per_pack), jnp.float32)


def lower_cuda(target: str):
    """The CUDA lowering of a forward primitive: its operands and results, plus the plan's
    split-KV workspace, a third result that only the CUDA call has: XLA allocates it (the
    handler never does), and nothing reads it after the call."""

    def lower(ctx, *args, config):
        plan = cuda_plan(ctx.avals_in, config)
        workspace = workspace_aval(ctx.avals_in, plan["fwd_workspace_per_pack"])
        ctx = ctx.replace(avals_out=[*ctx.avals_out, workspace])
        out, lse, _ = jax.ffi.ffi_lowering(target)(ctx, *args, **ffi_attrs(config))
        return [out, lse]

    return lower


# Sharded jit splits batch (packs) and whole kv-head groups with no communication; the sequence
# and head-size axes stay whole (see _sharding.py for the mechanism and its limits). The packed
# layout's offsets [N, B + 1] stay whole per pack. With sinks, the sinks [H] split with the
# heads (whole kv-head groups); they do not lead with the batch, so XLA's batch partitioner does
# not apply: an exported call with sinks runs unsplit (see _sharding.py).
_RESULTS = ("b q (k g) e", "b (k g) q")  # out, lse; query head h = k * (H // Hkv) + g
_QKV = ("b q (k g) d", "b s k d", "b s k e")  # query, key, value
for _p, _lengths, _cpu, _cuda in (
        (attention_fwd_p, ("b",), _ffi.CPU_TARGET, _ffi.CUDA_TARGET),
        (packed_attention_fwd_p, ("b c", "b c"), _ffi.PACKED_CPU_TARGET, _ffi.PACKED_CUDA_TARGET),
        (attention_fwd_sinks_p, ("b", "(k g)"), _ffi.SINKS_CPU_TARGET, _ffi.SINKS_CUDA_TARGET),
        (packed_attention_fwd_sinks_p, ("b c", "b c", "(k g)"), _ffi.PACKED_SINKS_CPU_TARGET,
         _ffi.PACKED_SINKS_CUDA_TARGET)):
    _sharding.register(
        _p,
        # then nonpad_kv_seqlen [B], or cu_seqlens_q and cu_seqlens_k [N, B + 1]; then sinks
        _sharding.ShardingRule(operands=_QKV + _lengths, results=_RESULTS, parallel=("b", "k")),
        abstract_eval=_abstract_eval,
        lowerings={"cpu": lower_cpu(_cpu), "cuda": lower_cuda(_cuda)},
        targets=(_cpu, _cuda),
    )

# Under checkify, lengths outside [0, Skv] and malformed offsets (or offsets past the hints) are
# reported (elsewhere the kernels clamp them).
_checkify.register_lengths_check(attention_fwd_p, 3, lambda q, k, v, n: k.shape[1])
_checkify.register_cu_seqlens_check(packed_attention_fwd_p)
_checkify.register_lengths_check(attention_fwd_sinks_p, 3, lambda q, k, v, n, s: k.shape[1])
_checkify.register_cu_seqlens_check(packed_attention_fwd_sinks_p)
