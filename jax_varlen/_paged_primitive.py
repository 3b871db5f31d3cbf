"""The paged forward primitive: attention that reads a paged KV cache in place on the GPU.

``paged_attention_fwd_p``, operands (``_paged_api`` checks them first; the table and lengths
come as given, and every reader clamps them where it reads them: the kernels, gather_pages):
  query [B, Sq, H, D], key_cache [num_pages, page_size, Hkv, D], value_cache
  [num_pages, page_size, Hkv, Dv], seqlens_k int32 [B] (clamped into [0, max_pages *
  page_size]),
  block_table int32 [B, max_pages] (each entry clamped into [0, num_pages)): key ``j`` of
  sequence ``b`` is row ``j % page_size`` of page ``block_table[b, j // page_size]``; each
  sequence's ``Sq`` queries are the last ``Sq`` of its ``seqlens_k[b]`` keys.
Results: out [B, Sq, H, Dv] (query's dtype), lse float32 [B, H, Sq].
Static parameter: ``config`` (:class:`AttentionConfig` of the padded batch).

``paged_attention`` binds it only for the calls the plan takes (:func:`takes`: the split-KV
kernel's shapes, or with ``JAX_VARLEN_PAGED_SM90=1`` the Hopper forward's longer query runs,
and pages of a multiple of 16 rows, ffi/plan/plan.h); the others gather the pages into dense
keys and run :func:`jax_varlen.attention`. Lowerings:
  cuda  the FFI target ``jax_varlen_paged_attention_fwd_cuda``: the split-KV kernel loads each
        key tile through the block table (ffi/cuda/sm80/mainloop.h, KvSource), and so does the
        Hopper forward under ``JAX_VARLEN_PAGED_SM90=1`` (its producer warps, by cp.async:
        ffi/cuda/sm90/fwd_load.h, load_tile_paged), so no page is copied and pages no sequence
        uses are never read;
  cpu   gathers the pages into dense keys ``[B, max_pages * page_size, Hkv, D]`` and calls the
        padded CPU target: the same results, and the primitive's rules (abstract evaluation,
        batching, sharding, export) are tested without a GPU.
Batching: a vmapped axis of query, seqlens_k or block_table folds into the batch; a vmapped
cache folds into the pages (``[M, num_pages, ...] -> [M * num_pages, ...]``), element ``m``'s
block table then pointing ``m * num_pages`` pages further. One launch either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_varlen import _ffi, _sharding
from jax_varlen._config import AttentionConfig
from jax_varlen._primitive import (
    _abstract_eval,
    ffi_attrs,
    fold_vmapped_axis,
    jit_impl,
    unfold_vmapped_axis,
    workspace_aval,
)

paged_attention_fwd_p = Primitive("jax_varlen_paged_attention_fwd")
paged_attention_fwd_p.multiple_results = True


def _plan(query_shape, dtype, cache_shape, value_dim: int, max_pages: int,
          packed_queries: bool = False) -> dict:
    """The CUDA plan of a paged call (ffi/plan/plan.h with ``page_size``): the padded batch of
    ``B`` sequences of ``max_pages * page_size`` key rows each; ``packed_queries``: the padded
    queries stand for packed query runs (paged_attention with ``cu_seqlens_q``)."""
    _, Sq, H, D = query_shape
    _, page_size, Hkv, _ = cache_shape
    extent = max_pages * page_size
    return _ffi.extension().plan(
        dtype=jnp.dtype(dtype).name, pack_seqs=1, pack_rows_q=Sq, pack_rows_k=extent,
        seqlen_q=Sq, seqlen_k=extent, num_heads=H, kv_num_heads=Hkv, head_dim=D,
        head_dim_v=value_dim, page_size=page_size, packed_queries=packed_queries)


def takes(query_shape, dtype, key_cache, value_cache, max_pages: int,
          packed_queries: bool = False) -> bool:
    """Whether the paged kernel takes a call with padded queries ``query_shape``
    ``[B, Sq, H, D]`` and these caches (the plan decides): float16 or bfloat16, head sizes
    multiples of 8, ``Sq <= 16`` queries per sequence (the split-KV path; longer chunks on the
    Hopper forward with ``JAX_VARLEN_PAGED_SM90=1``: GPU tests pass on an H100, opt-in as it
    measured 2.6x slower than gathering, benchmarks/NOTES.md) and ``page_size`` a multiple of
    16. ``packed_queries``: the padded rows stand for packed query runs, which the kernels take
    at one query per sequence only (they have no per-sequence query counts)."""
    plan = _plan(query_shape, dtype, key_cache.shape, value_cache.shape[-1], max_pages,
                 packed_queries)
    return not plan["unsupported"]


def paged_attention_fwd(query, key_cache, value_cache, seqlens_k, block_table,
                        config: AttentionConfig):
    """Binds the paged primitive; returns ``(out, lse)``."""
    return paged_attention_fwd_p.bind(query, key_cache, value_cache, seqlens_k, block_table,
                                      config=config)


def _batch_rule(args, dims, *, config):
    query, key_cache, value_cache, seqlens_k, block_table = args
    q_dim, k_dim, v_dim, n_dim, t_dim = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if k_dim is not None or v_dim is not None:
        # Element m's pages are pages m * num_pages on of the folded caches. The kernel clamps
        # a page index into the folded caches only, so an invalid one is clamped into its own
        # element's pages here first.
        num_pages = key_cache.shape[0 if k_dim != 0 else 1]
        _, (key_cache, value_cache) = fold_vmapped_axis([key_cache, value_cache], [k_dim, v_dim])
        table = (block_table[None] if t_dim is None else jnp.moveaxis(block_table, t_dim, 0))
        table = (jnp.clip(table, 0, num_pages - 1) +
                 (jnp.arange(size, dtype=table.dtype) * num_pages)[:, None, None])
        block_table, t_dim = table, 0
    _, (query, seqlens_k, block_table) = fold_vmapped_axis(
        [query, seqlens_k, block_table], [q_dim, n_dim, t_dim])
    results = paged_attention_fwd_p.bind(query, key_cache, value_cache, seqlens_k, block_table,
                                         config=config)
    results = unfold_vmapped_axis(results, size)
    return results, [0] * len(results)


paged_attention_fwd_p.def_impl(jit_impl(paged_attention_fwd_p))
batching.primitive_batchers[paged_attention_fwd_p] = _batch_rule


def gather_pages(cache, block_table):
    """cache [num_pages, page_size, Hkv, D], block_table [B, max_pages] ->
    [B, max_pages * page_size, Hkv, D]: row j of sequence b is row j % page_size of page
    block_table[b, j // page_size], the entry clamped into [0, num_pages) as the paged kernel
    clamps it (seqlen.h, paged_key_row). Worked example, page_size 2, block_table[b] = [5, 1]:
    keys 0, 1 are page 5's rows 0, 1 and keys 2, 3 page 1's."""
    B, max_pages = block_table.shape
    block_table = jnp.clip(block_table, 0, cache.shape[0] - 1)
    pages = jnp.take(cache, block_table, axis=0)  # [B, max_pages, page_size, Hkv, D]
    return pages.reshape((B, max_pages * cache.shape[1]) + cache.shape[2:])


def _lower_cpu(ctx, query, key_cache, value_cache, seqlens_k, block_table, *, config):
    """Gathers the pages, then the padded CPU target."""
    _ffi.extension()
    out_aval, lse_aval = ctx.avals_out

    def compute(query, key_cache, value_cache, seqlens_k, block_table):
        key = gather_pages(key_cache, block_table)
        value = gather_pages(value_cache, block_table)
        call = jax.ffi.ffi_call(_ffi.CPU_TARGET, (out_aval, lse_aval))
        return call(query, key, value, seqlens_k, **ffi_attrs(config))

    return mlir.lower_fun(compute, multiple_results=True)(
        ctx, query, key_cache, value_cache, seqlens_k, block_table)


def _lower_cuda(ctx, *args, config):
    """The paged CUDA target, with the plan's split-KV workspace as a third result (XLA
    allocates it; nothing reads it after the call)."""
    if not _ffi.has_cuda():
        raise RuntimeError(
            "jax_varlen was built without its CUDA kernels, so it cannot run on a GPU; "
            "reinstall on a machine with the CUDA toolkit (nvcc) on PATH")
    query, key_cache, value_cache, _, block_table = ctx.avals_in
    plan = _plan(query.shape, query.dtype, key_cache.shape, value_cache.shape[-1],
                 block_table.shape[1])
    if plan["unsupported"]:  # paged_attention asks first (takes); a direct bind may not
        raise ValueError(plan["unsupported"])
    workspace = workspace_aval(ctx.avals_in, plan["fwd_workspace_per_pack"])
    ctx = ctx.replace(avals_out=[*ctx.avals_out, workspace])
    out, lse, _ = jax.ffi.ffi_lowering(_ffi.PAGED_CUDA_TARGET)(ctx, *args, **ffi_attrs(config))
    return [out, lse]


# Sharded jit splits the batch (query, lengths and block table with it) and whole kv-head
# groups (the caches' head axis with them); the caches' pages stay whole on every device, since
# any sequence may point at any page. The caches do not lead with the batch, so XLA's batch
# partitioner does not apply: an exported call runs unsplit (see _sharding.py).
_sharding.register(
    paged_attention_fwd_p,
    _sharding.ShardingRule(
        # query, key_cache, value_cache, seqlens_k, block_table
        operands=("b q (k g) d", "p s k d", "p s k e", "b", "b m"),
        results=("b q (k g) e", "b (k g) q"),
        parallel=("b", "k"),
    ),
    abstract_eval=_abstract_eval,
    lowerings={"cpu": _lower_cpu, "cuda": _lower_cuda},
    targets=(_ffi.PAGED_CUDA_TARGET,),
)
