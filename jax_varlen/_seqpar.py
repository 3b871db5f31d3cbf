"""``sequence_parallel_attention``: attention over a KV cache split along its sequence axis.

Recipe (``shard_map`` over the mesh, keys and values split along ``axis_name``):

1. device ``p`` holds keys ``[p * L, (p + 1) * L)`` with ``L = Skv / P``; its local lengths are
   ``n_local = clip(n - p * L, 0, L)`` (worked example, ``L = 4``, ``n = 6``: device 0 sees 4
   keys, device 1 sees 2, devices 2 and 3 see none);
2. each device runs the op on its slice and returns ``(out, lse)``: an empty slice gives zeros
   and ``lse = -inf``;
3. ``lax.all_gather`` stacks the ``P`` partials in device order on every device, and
   :func:`merge_attention` combines them in that fixed order (bitwise reproducible, identical
   on every device, so the result is replicated along ``axis_name``).

The all-gather moves ``P`` partial outputs ``[B, Sq, H, Dv]`` (and ``lse``) per device: small
for decode (``Sq = 1``), which is what this recipe is for. A psum-based merge would move less
but give no guarantee on the order of the floating-point sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_varlen._api import (
    check_flag,
    check_lengths,
    check_shapes,
    check_sinks,
    make_config,
    normalize_heads,
    with_sinks,
)
from jax_varlen._merge import merge_attention
from jax_varlen._primitive import attention_fwd


def _axes(name, mesh, value, taken):
    """Normalizes a mesh-axis argument (None, a name or a tuple of names) to a tuple."""
    axes = () if value is None else (value,) if isinstance(value, str) else tuple(value)
    for a in axes:
        if a not in mesh.axis_names:
            raise ValueError(
                f"{name}={value!r} is not an axis of the mesh {tuple(mesh.axis_names)}"
            )
        if a in taken:
            raise ValueError(f"mesh axis {a!r} is used twice (in {name} and another argument)")
    return axes


def _size(mesh, axes) -> int:
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size


def _entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def sequence_parallel_attention(
    query,
    key,
    value,
    nonpad_kv_seqlen,
    *,
    mesh,
    axis_name,
    batch_axis=None,
    head_axis=None,
    num_heads=None,
    kv_num_heads=None,
    scale=None,
    is_causal=False,
    softcap=0.0,
    sinks=None,
    return_lse=False,
):
    """:func:`jax_varlen.attention` with the keys and values split along their sequence axis.

    Gives the result of ``attention(query, key, value, nonpad_kv_seqlen, ...)`` on one device
    (up to one extra rounding of f16/bf16 partial outputs before the float32 merge), with each
    device of ``axis_name`` holding and reading only its slice of the KV cache. Gradients
    (first-order reverse mode) flow through each slice's call, the all-gather and the merge.

    Args:
      query: ``[B, Sq, H, D]`` or ``[B, Sq, H*D]``; replicated along ``axis_name``.
      key: ``[B, Skv, Hkv, D]`` (or rank 3); split along ``Skv`` over ``axis_name``.
      value: ``[B, Skv, Hkv, Dv]`` (or rank 3); split like ``key``.
      nonpad_kv_seqlen: int32/int64 ``[B]``, global lengths (``0 <= n_b <= Skv``).
      mesh: a ``jax.sharding.Mesh``.
      axis_name: the mesh axis (a name) that splits the sequence; its size must divide ``Skv``.
      batch_axis: optional mesh axis (or axes) that also splits the batch (must divide ``B``).
      head_axis: optional mesh axis (or axes) that also splits the heads, in whole kv-head
        groups (must divide ``Hkv``).
      num_heads, kv_num_heads, scale, softcap, return_lse: as in :func:`jax_varlen.attention`.
      sinks: optional float ``[H]`` (as in :func:`jax_varlen.attention`): joins the softmax
        once, after the slices' partial results are merged (``lse = logaddexp(lse, sinks[h])``,
        ``out`` rescaled to match); differentiable.
      is_causal: supported for decode (``Sq == 1``, where it equals non-causal). With
        ``Sq > 1`` a causal mask needs each query's global position relative to each slice,
        which the op does not take, so it raises ``ValueError``.

    Returns:
      ``out`` ``[B, Sq, H, Dv]`` (rank and dtype of ``query``), replicated along
      ``axis_name``; with ``return_lse`` also float32 ``lse`` ``[B, H, Sq]``.
    """
    rank = getattr(query, "ndim", None)
    query, key, value = normalize_heads(query, key, value, num_heads, kv_num_heads)
    check_shapes(query, key, value)
    B, Sq, H, D = query.shape
    Skv, Hkv = key.shape[1], key.shape[2]
    lengths = check_lengths("nonpad_kv_seqlen", nonpad_kv_seqlen, B, Skv, "Skv")
    config = make_config(D, scale, is_causal, softcap)
    return_lse = check_flag("return_lse", return_lse)
    sinks = check_sinks(sinks, H)

    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be one mesh axis name (a str), got {axis_name!r}")
    seq = _axes("axis_name", mesh, axis_name, ())
    batch = _axes("batch_axis", mesh, batch_axis, seq)
    heads = _axes("head_axis", mesh, head_axis, seq + batch)
    if config.is_causal and Sq > 1:
        raise ValueError(
            f"sequence_parallel_attention supports is_causal=True only for decode (Sq == 1), "
            f"got Sq = {Sq}: a causal mask over a slice of the keys needs each query's global "
            f"position, which the op does not take. Keep the keys whole for causal prefill "
            f"(attention() under jit, split over batch or heads instead)."
        )
    for what, extent, axes in (("Skv", Skv, seq), ("B", B, batch), ("Hkv", Hkv, heads)):
        if extent % _size(mesh, axes):
            raise ValueError(
                f"{what} = {extent} must be a multiple of the size of mesh axes {axes} "
                f"({_size(mesh, axes)})"
            )

    b, h = _entry(batch), _entry(heads)
    out, lse = _sharded_call(mesh, axis_name, b, h, config)(query, key, value, lengths)
    if sinks is not None:  # once, on the merged row (every query row is real here)
        out, lse = with_sinks(out, lse, sinks)
    if rank == 3:
        out = out.reshape(out.shape[:2] + (-1,))
    return (out, lse) if return_lse else out


@functools.lru_cache(maxsize=64)
def _sharded_call(mesh, axis_name, b, h, config):
    """The jitted ``shard_map`` of one configuration (mesh, axes, config), built once: an eager
    call would otherwise trace and compile a new closure every time (about 6 s on 8 CPU
    devices). ``(query, key, value, lengths) -> (out, lse)``."""
    q_spec, kv_spec, n_spec = P(b, None, h, None), P(b, axis_name, h, None), P(b)
    in_specs = (q_spec, kv_spec, kv_spec, n_spec)
    out_specs = (P(b, None, h, None), P(b, h, None))
    explicit = jax.sharding.AxisType.Explicit in tuple(getattr(mesh, "axis_types", ()))

    def local(q, k, v, n):
        # k, v: [B_l, L, Hkv_l, *] keys [p * L, (p + 1) * L) of each sequence.
        slice_len = k.shape[1]
        offset = jax.lax.axis_index(axis_name) * slice_len
        n_local = jnp.clip(n - offset, 0, slice_len).astype(jnp.int32)
        out, lse = attention_fwd(q, k, v, n_local, config)
        # [P, ...] in device order along axis_name, identical on every device.
        outs = jax.lax.all_gather(out, axis_name)
        lses = jax.lax.all_gather(lse, axis_name)
        return merge_attention(outs, lses)

    # check_vma=False: the merged result is replicated along axis_name by construction (same
    # gathered partials, same fixed-order merge on every device), which the type system
    # cannot see through all_gather.
    sharded = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    @jax.jit
    def call(*args):
        if explicit:  # shard_map on an Explicit mesh takes arguments already laid out as in_specs
            args = tuple(jax.sharding.reshard(x, NamedSharding(mesh, s)) for x, s in zip(args, in_specs))
        return sharded(*args)

    return call
