"""``attention``: normalize rank 3/4, check every argument, bind the primitive."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_varlen._autodiff import (
    attention_with_grad,
    attention_with_sinks_grad,
    packed_attention_with_grad,
    packed_attention_with_sinks_grad,
)
from jax_varlen._config import AttentionConfig

_FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
_LENGTH_DTYPES = (jnp.int32, jnp.int64)


def dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def check_array(name: str, x) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def canonical(x):
    """NumPy inputs get JAX's dtype canonicalization, as ``jnp.asarray`` (and ``jax.nn``) give
    them: float64 becomes float32 unless x64 is enabled. JAX arrays and tracers pass as they
    are (their dtype is already canonical)."""
    return jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x


_AXIS_NAMES = {
    ("query", 4): ("B", "Sq", "H", "D"), ("query", 3): ("B", "Sq", "H*D"),
    ("key", 4): ("B", "Skv", "Hkv", "D"), ("key", 3): ("B", "Skv", "Hkv*D"),
    ("value", 4): ("B", "Skv", "Hkv", "Dv"), ("value", 3): ("B", "Skv", "Hkv*Dv"),
}


def check_static_dims(name: str, x, axis_names, first: int = 1,
                      allowed: str = "the batch dimension B") -> None:
    """Only the leading dimensions (before ``first``) may be symbolic (``jax.export`` with
    ``jax.export.symbolic_shape``): the kernels' tiling, the CUDA path choice and the
    backward's blocks need the other extents."""
    for axis, (dim, axis_name) in enumerate(zip(x.shape, axis_names)):
        if axis >= first and jax.export.is_symbolic_dim(dim):
            raise ValueError(
                f"{name}'s dimension {axis} ({axis_name}) is symbolic ({dim}) in shape "
                f"{tuple(x.shape)}: jax_varlen supports a symbolic (shape-polymorphic) "
                f"{allowed} only; export with a concrete {axis_name} (one export per size)"
            )


def check_flag(name: str, value) -> bool:
    """A static boolean attribute (is_causal, return_lse)."""
    check_static(name, value)
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def check_static(name: str, value) -> None:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a static Python value, got a traced one ({value!r}): it selects "
            f"the compiled computation, so it cannot depend on traced data. Pass it through "
            f"static_argnames (jax.jit(f, static_argnames=\"{name}\")) or bind it with "
            f"functools.partial"
        )


def _heads(name: str, value, given) -> int:
    if value is None:
        return given
    check_static(name, value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def split_heads(name: str, x, heads: int, heads_name: str, hint: str = ""):
    """[..., heads * d] -> [..., heads, d] (padded [B, S, ...], packed [T, ...])."""
    if x.shape[-1] % heads:
        raise ValueError(
            f"{name}'s last dimension ({x.shape[-1]}) must be a multiple of {heads_name} "
            f"({heads}); {name} has shape {tuple(x.shape)}{hint}"
        )
    return x.reshape(x.shape[:-1] + (heads, x.shape[-1] // heads))


def normalize_heads(query, key, value, num_heads, kv_num_heads):
    """Checks ranks and head counts; returns rank-4 query, key, value (NumPy inputs
    canonicalized like JAX's)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_array(name, x)
    query, key, value = map(canonical, (query, key, value))
    if query.ndim not in (3, 4):
        raise ValueError(
            f"query must have rank 3 [B, Sq, H*D] or 4 [B, Sq, H, D], got shape {tuple(query.shape)}"
        )
    for name, x in (("key", key), ("value", value)):
        if x.ndim != query.ndim:
            raise ValueError(
                f"{name} must have the rank of query ({query.ndim}), got shape {tuple(x.shape)}"
            )
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_static_dims(name, x, _AXIS_NAMES[name, x.ndim])
    return split_or_check_heads(query, key, value, num_heads, kv_num_heads, query.ndim == 3,
                                "rank-3 inputs [B, S, H*D]")


def split_or_check_heads(query, key, value, num_heads, kv_num_heads, merged: bool, merged_name):
    """Merged heads (``[..., H*D]``): split with ``num_heads`` (required) and ``kv_num_heads``;
    split heads (``[..., H, D]``): the counts, when given, must match."""
    if merged:
        if num_heads is None:
            raise ValueError(f"num_heads is required for {merged_name}; got None")
        kv_given = kv_num_heads is not None
        num_heads = _heads("num_heads", num_heads, None)
        kv_num_heads = _heads("kv_num_heads", kv_num_heads, num_heads)
        # Without kv_num_heads the key heads are num_heads: say so, not "kv_num_heads (4)".
        kv_name = "kv_num_heads" if kv_given else "kv_num_heads, which defaults to num_heads"
        kv_hint = "" if kv_given else "; pass kv_num_heads for grouped-query attention"
        query = split_heads("query", query, num_heads, "num_heads")
        key = split_heads("key", key, kv_num_heads, kv_name, kv_hint)
        value = split_heads("value", value, kv_num_heads, kv_name, kv_hint)
        if kv_num_heads and num_heads % kv_num_heads:
            raise ValueError(
                f"kv_num_heads = {kv_num_heads} must divide num_heads = {num_heads} (each kv "
                f"head serves num_heads / kv_num_heads query heads)")
    else:
        for name, given, x, axis_name in (
            ("num_heads", num_heads, query, "query"),
            ("kv_num_heads", kv_num_heads, key, "key"),
        ):
            if given is not None and _heads(name, given, None) != x.shape[-2]:
                raise ValueError(
                    f"{name}={given} does not match {axis_name}'s head axis: "
                    f"{axis_name} has shape {tuple(x.shape)}"
                )
        H, Hkv = query.shape[-2], key.shape[-2]
        if Hkv and H % Hkv:
            raise ValueError(
                f"key has {Hkv} heads and query has {H}: query's head count must be a "
                f"multiple of key's (each kv head serves H / Hkv query heads); query has shape "
                f"{tuple(query.shape)}, key {tuple(key.shape)}")
    return query, key, value


def check_shapes(query, key, value) -> None:
    """query [B, Sq, H, D], key [B, Skv, Hkv, D], value [B, Skv, Hkv, Dv]; or packed (rank 3)
    query [Tq, H, D], key [Tk, Hkv, D], value [Tk, Hkv, Dv]."""
    H, D = query.shape[-2:]
    if query.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"query must be float32, float16 or bfloat16, got {dtype_name(query.dtype)}"
        )
    for name, x in (("key", key), ("value", value)):
        if x.dtype != query.dtype:
            raise TypeError(
                f"{name} must have query's dtype ({dtype_name(query.dtype)}), "
                f"got {dtype_name(x.dtype)}"
            )
        if query.ndim == 4 and x.shape[0] != query.shape[0]:
            raise ValueError(
                f"{name}'s batch extent must equal query's ({query.shape[0]}), got shape "
                f"{tuple(x.shape)}"
            )
    Hkv = key.shape[-2]
    if value.shape[-3] != key.shape[-3]:
        extent = "sequence extent" if query.ndim == 4 else "token count"
        raise ValueError(
            f"value's {extent} must equal key's ({key.shape[-3]}), got value shape "
            f"{tuple(value.shape)}"
        )
    if value.shape[-2] != Hkv:
        raise ValueError(
            f"value's head count must equal key's ({Hkv}), got value shape {tuple(value.shape)}"
        )
    if Hkv == 0:
        raise ValueError(f"key must have at least one head, got key shape {tuple(key.shape)}")
    if key.shape[-1] != D:
        raise ValueError(
            f"key's head size must equal query's ({D}), got key shape {tuple(key.shape)}"
        )
    if D == 0:
        raise ValueError(f"head size must be at least 1, got query shape {tuple(query.shape)}")
    if value.shape[-1] == 0:
        raise ValueError(
            f"value's head size must be at least 1, got value shape {tuple(value.shape)}"
        )


def as_lengths(name: str, lengths):
    """Python lists and tuples of ints become NumPy arrays (as ``jnp.asarray`` would take
    them), checked and narrowed to int32 like NumPy lengths; arrays and tracers pass as they
    are."""
    if isinstance(lengths, (list, tuple)):
        try:
            return np.asarray(lengths)
        except ValueError as e:  # ragged nesting
            raise ValueError(f"{name} must be a [B] sequence of ints, got {lengths!r}") from e
    return lengths


def check_lengths(name: str, lengths, batch: int, extent: int, extent_name: str):
    """Checks ``[B]`` int32/int64 per-sequence counts in ``[0, extent]`` (``nonpad_kv_seqlen``
    against ``Skv``, ``nonpad_q_seqlen`` against ``Sq``); returns them as int32."""
    lengths = as_lengths(name, lengths)
    check_array(name, lengths)
    if lengths.dtype not in _LENGTH_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {dtype_name(lengths.dtype)}")
    if lengths.shape != (batch,):
        raise ValueError(f"{name} must have shape [B] = ({batch},), got {tuple(lengths.shape)}")
    if not isinstance(lengths, jax.core.Tracer):
        values = np.asarray(lengths)
        bad = np.flatnonzero((values < 0) | (values > extent))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{name}[{i}] = {int(values[i])} is out of range: expected "
                f"0 <= n <= {extent_name} = {extent}"
            )
    # Traced lengths reach the primitive as they are (kernels clamp them; checkify reports
    # them, _checkify.py): int32 untouched -- a clip would be one more XLA kernel per call,
    # 2.7 us of a 232 us decode step (H100, benchmarks/NOTES.md, session 2026-12-07 m) --, and
    # int64 narrowed after a clip to [-1, extent + 1], which keeps an out-of-range value out of
    # range instead of letting it wrap.
    if lengths.dtype == jnp.int32:
        return lengths
    return jnp.clip(lengths, -1, extent + 1).astype(jnp.int32)


# A window side at least this large is unbounded for any buffer (and stays far from int64
# overflow in the kernels' index math): larger ones are taken as this one, the same mask.
_MAX_WINDOW = 2**62


def _window_side(value, given) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"local_window_size must be None, an int >= 0 or a pair (left, right) of ints >= 0, "
            f"got {given!r}")
    if value < 0:
        raise ValueError(
            f"local_window_size must be >= 0 (jax.nn's convention: an int w or a pair "
            f"(left, right)), got {given!r}")
    return min(int(value), _MAX_WINDOW)


def check_window(local_window_size) -> tuple[int, int]:
    """``local_window_size`` (``None``, an int ``w`` meaning ``(w, w)``, or a pair ``(left,
    right)`` of ints >= 0, as in ``jax.nn.dot_product_attention``) -> ``(window_left,
    window_right)`` of :class:`AttentionConfig`, ``(-1, -1)`` for no window."""
    if local_window_size is None:
        return -1, -1
    check_static("local_window_size", local_window_size)
    if isinstance(local_window_size, (tuple, list)):
        if len(local_window_size) != 2:
            raise ValueError(
                f"local_window_size must be an int or a pair (left, right), got "
                f"{local_window_size!r} (length {len(local_window_size)})")
        for side in local_window_size:
            check_static("local_window_size", side)
        return tuple(_window_side(side, local_window_size) for side in local_window_size)
    side = _window_side(local_window_size, local_window_size)
    return side, side


def check_sinks(sinks, num_heads: int):
    """``sinks``: ``None`` or a float array ``[H]`` (one logit per query head; lists and NumPy
    arrays too), returned as float32."""
    if sinks is None:
        return None
    if isinstance(sinks, (list, tuple)):
        sinks = np.asarray(sinks)
    check_array("sinks", sinks)
    sinks = canonical(sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks must be a float array [H], got {dtype_name(sinks.dtype)}")
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(
            f"sinks must have shape [H] = ({num_heads},) (one logit per query head), got "
            f"{tuple(sinks.shape)}")
    return sinks.astype(jnp.float32)


def with_sinks(out, lse, sinks, real_rows=None):
    """The op's ``(out, lse)`` with one more logit per query head in every real row's softmax
    denominator (attention sinks, gpt-oss), from the primitive's results without it:

      lse = log(exp(lse0) + exp(sinks[h])),   out = out0 * exp(lse0 - lse)

    A real row with no allowed key (``lse0 = -inf``, ``out0 = 0``) gets ``lse = sinks[h]`` and
    stays zero; rows that are no rows (``real_rows`` False: padded query rows, packed rows no
    sequence owns) keep ``lse = -inf``. Every ``exp`` and ``log`` sees finite arguments on the
    branch a row takes (the ``where``s select, never multiply), so the forward and the
    gradients (through the primitive's backward, which takes the ``lse`` cotangent, and to
    ``sinks``: ``d_sinks[h] = -sum_rows exp(sinks[h] - lse) * delta``) are NaN-free wherever
    the data is finite.

    out: ``[N, Sq, H, Dv]``; lse: float32 ``[N, H, Sq]``; sinks: float32 ``[H]``; real_rows:
    ``None`` (every row) or bool broadcastable to lse's shape.

    Used where a kernel has no sinks of its own: ``paged_attention``'s in-place decode path and
    ``sequence_parallel_attention``'s merged result (``attention`` and ``packed_attention`` add
    the sinks inside the kernels, ffi/core/sinks.h).
    """
    sink = sinks[:, None]  # [H, 1]: broadcasts over lse's [N, H, Sq]
    empty = lse == -jnp.inf
    lse0 = jnp.where(empty, sink, lse)  # finite on the branch empty rows do not take
    top = jax.lax.stop_gradient(jnp.maximum(lse0, sink))
    mixed = top + jnp.log(jnp.exp(lse0 - top) + jnp.exp(sink - top))
    lse_real = jnp.where(empty, sink, mixed)
    factor = jnp.where(empty, 0.0, jnp.exp(lse0 - lse_real))  # [N, H, Sq], in [0, 1]
    out = (out.astype(jnp.float32) * jnp.swapaxes(factor, 1, 2)[..., None]).astype(out.dtype)
    if real_rows is not None:
        lse_real = jnp.where(real_rows, lse_real, -jnp.inf)
    return out, lse_real


def make_config(head_dim: int, scale, is_causal, softcap,
                local_window_size=None) -> AttentionConfig:
    for name, value in (("scale", scale), ("softcap", softcap)):
        check_static(name, value)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    is_causal = check_flag("is_causal", is_causal)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)):
        raise TypeError(f"softcap must be a Python float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite value >= 0 (0 = off), got {softcap}")
    window_left, window_right = check_window(local_window_size)
    return AttentionConfig(scale=float(scale), is_causal=bool(is_causal), softcap=float(softcap),
                           window_left=window_left, window_right=window_right)


def attention(
    query,
    key,
    value,
    nonpad_kv_seqlen,
    *,
    nonpad_q_seqlen=None,
    num_heads=None,
    kv_num_heads=None,
    scale=None,
    is_causal=False,
    softcap=0.0,
    local_window_size=None,
    sinks=None,
    return_lse=False,
):
    """Attention over a padded ragged batch that spends no compute on padding.

    Args:
      query: ``[B, Sq, H, D]`` or ``[B, Sq, H*D]``; float32, float16 or bfloat16 (NumPy
        inputs are canonicalized as JAX does: float64 becomes float32 unless x64 is on).
      key: ``[B, Skv, Hkv, D]`` or ``[B, Skv, Hkv*D]``; the dtype of ``query``.
      value: ``[B, Skv, Hkv, Dv]`` or ``[B, Skv, Hkv*Dv]``; ``Dv`` may differ from ``D``.
      nonpad_kv_seqlen: int32 or int64 ``[B]`` (or a list of ints): keys ``j < n_b`` of
        sequence ``b`` are real; the rest is padding that is never read (it may hold NaN) and
        never costs compute.
      nonpad_q_seqlen: optional int32 or int64 ``[B]`` (or a list of ints); default ``None``:
        every one of the ``Sq`` query rows is real. Query rows ``i >= n_q[b]`` are padding:
        never read (they may hold NaN), no compute spent on them, zero output, ``lse = -inf``
        and zero gradient. A right-padded causal prefill passes the same counts for both.
      num_heads: ``H``; required for rank-3 inputs, checked against rank-4 ones.
      kv_num_heads: ``Hkv`` (defaults to ``num_heads``); must divide ``H`` (MHA, GQA, MQA).
        Query head ``h`` reads kv head ``h // (H // Hkv)``.
      scale: multiplies ``<q, k>``; defaults to ``1/sqrt(D)``.
      is_causal: tail-aligned (bottom-right) causal mask: query ``i`` sees key ``j`` iff
        ``j <= i + n_b - n_q[b]`` (``n_q[b] = Sq`` without ``nonpad_q_seqlen``): the real
        queries are the last ``n_q[b]`` positions of the ``n_b`` keys. Decode and chunked
        prefill (new queries after a cache) need nothing more; a right-padded prefill
        (queries and keys the same tokens, padded at the end) must pass
        ``nonpad_q_seqlen=nonpad_kv_seqlen``, or its short sequences' rows are shifted.
      softcap: ``0`` is off; otherwise scores become ``softcap * tanh(s / softcap)`` before
        masking (Gemma 2 style).
      local_window_size: ``None`` (default: no window), an int ``w`` meaning ``(w, w)``, or a
        pair ``(left, right)`` of ints >= 0 (``jax.nn``'s convention), around each query's
        tail-aligned position ``p = i + n_b - n_q[b]``: key ``j`` is allowed iff
        ``p - left <= j <= p + right`` (and ``j <= p`` when causal, ``j < n_b`` always). Key
        blocks outside the window cost no compute, on every backend.
      sinks: optional float ``[H]``, one logit per query head (gpt-oss attention sinks): every
        real row's softmax denominator gains ``exp(sinks[h])``, so ``lse = log(exp(sinks[h]) +
        sum_j exp(s_j))`` over the allowed keys and ``out = sum_j exp(s_j - lse) v_j``; a real
        row with no allowed key gives zeros and ``lse = sinks[h]``. Differentiable (an
        ordinary, possibly traced, array); every backend.
      return_lse: also return the float32 log-sum-exp ``[B, H, Sq]`` (natural log).

    ``num_heads``, ``kv_num_heads``, ``scale``, ``is_causal``, ``softcap``,
    ``local_window_size`` and ``return_lse`` are static: under ``jax.jit`` pass them through
    ``static_argnames`` or ``functools.partial``.

    Returns:
      ``out`` ``[B, Sq, H, Dv]`` with the rank and dtype of ``query`` (``[B, Sq, H*Dv]`` for
      rank 3); with ``return_lse`` the pair ``(out, lse)``. Padded query rows and rows with
      no allowed key (``n_b = 0``, the leading ``n_q[b] - n_b`` rows under causal, rows whose
      window holds no key) are zero, with lse ``-inf`` (``sinks[h]`` for a real row with
      sinks): decided by the count of allowed keys, never by the values. A row that allows a
      NaN or Inf (in its query or an allowed key or value) gives what the math gives (NaN).

    Raises:
      TypeError, ValueError: at trace time, naming the argument, the expected and the given
        value. Concrete out-of-range lengths raise ``ValueError``; traced ones are clamped into
        ``[0, Skv]`` (``[0, Sq]`` for ``nonpad_q_seqlen``) and reported under
        ``jax.experimental.checkify``. Forward-mode
        differentiation raises ``TypeError`` and second-order gradients
        ``NotImplementedError`` (reverse mode, first order, is supported).
    """
    rank = getattr(query, "ndim", None)
    query, key, value = normalize_heads(query, key, value, num_heads, kv_num_heads)
    check_shapes(query, key, value)
    B, Sq, Skv = query.shape[0], query.shape[1], key.shape[1]
    lengths = check_lengths("nonpad_kv_seqlen", nonpad_kv_seqlen, B, Skv, "Skv")
    config = make_config(query.shape[3], scale, is_causal, softcap, local_window_size)
    return_lse = check_flag("return_lse", return_lse)
    sinks = check_sinks(sinks, query.shape[2])
    if nonpad_q_seqlen is None:
        if sinks is None:
            out, lse = attention_with_grad(query, key, value, lengths, config)
        else:
            out, lse = attention_with_sinks_grad(query, key, value, lengths, sinks, config)
    else:
        # Per-sequence query counts: every sequence is a pack of its own with offsets [0, n_q]
        # and [0, n_kv] (ffi/core/params.h), so the packed primitive's kernels, which skip rows past
        # a sequence's length, serve the call unchanged: [B, Sq, H, D] is [N = B packs, Tq =
        # Sq rows, H, D] and lse [B, H, Sq] is [N, H, Tq].
        q_lengths = check_lengths("nonpad_q_seqlen", nonpad_q_seqlen, B, Sq, "Sq")
        config = dataclasses.replace(config, max_seqlen_q=Sq, max_seqlen_k=Skv,
                                     padded_lengths=True)
        zero = jnp.zeros_like(lengths)
        offsets = (jnp.stack([zero, q_lengths], axis=1), jnp.stack([zero, lengths], axis=1))
        if sinks is None:
            out, lse = packed_attention_with_grad(query, key, value, *offsets, config)
        else:
            out, lse = packed_attention_with_sinks_grad(query, key, value, *offsets, sinks,
                                                        config)
    if rank == 3:
        out = out.reshape(out.shape[:2] + (-1,))
    return (out, lse) if return_lse else out
