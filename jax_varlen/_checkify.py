"""``jax.experimental.checkify`` support: invalid lengths and offsets become a check error.

The rules live on the primitives, so the checks exist only when a caller functionalizes with
``checkify.checkify``; plain ``jit`` programs carry no check effect (and ``jax.export`` can
serialize them). Outside checkify, the kernels clamp what is out of range (ffi/core/seqlen.h).
checkify has no public hook for primitives, so this uses ``jax._src.checkify`` (the rule adapts
to both of its calling conventions in jax 0.10 to 0.12); should it move, the op still clamps,
and only the report is lost.
"""

from __future__ import annotations

import inspect

import jax.numpy as jnp

try:
    from jax._src import checkify as _checkify
except ImportError:  # pragma: no cover - a future jax without the private module
    _checkify = None


def _register(primitive, checks) -> None:
    """Reports each failing check of ``checks(*operands, **params)``, a list of ``(bad, message,
    *format arguments)`` with ``bad`` a traced bool and the arguments traced scalars that fill
    the message's ``{}`` fields, for ``primitive`` under checkify."""
    if _checkify is None or not hasattr(_checkify, "error_checks"):
        return

    # assert_func is (error, pred, new_error) in jax 0.10-0.11.1; from 0.11.2 the rule's
    # leading context comes first, as it does for the rule itself.
    assert_takes_context = len(inspect.signature(_checkify.assert_func).parameters) > 3

    def rule(*args, **params):
        # The rule's leading arguments are (error, enabled_errors) in jax 0.10-0.11.1 and
        # (context, error, enabled_errors) from 0.11.2: find the error by type, update it, and
        # let checkify's default rule bind the primitive and return in that version's format.
        at = next(i for i, a in enumerate(args) if isinstance(a, _checkify.Error))
        context, error, enabled_errors, operands = args[:at], args[at], args[at + 1], args[at + 2:]
        if _checkify.FailedCheckError in enabled_errors:
            for bad, message, *fmt_args in checks(*operands, **params):
                error = _checkify.assert_func(
                    *(context if assert_takes_context else ()), error, bad,
                    _checkify.FailedCheckError(_checkify.get_traceback(), message, *fmt_args))
        return _checkify.default_checkify_rule(
            primitive, *context, error, enabled_errors, *operands, **params)

    _checkify.error_checks[primitive] = rule


def lengths_check(name: str, lengths, extent: int, extent_name: str):
    """The check of ``[B]`` counts (``nonpad_kv_seqlen``, ``nonpad_q_seqlen``) that must lie in
    ``[0, extent]``."""
    return (jnp.any((lengths < 0) | (lengths > extent)),
            f"{name} must lie in [0, {extent_name}={extent}]; out-of-range values are clamped")


def register_lengths_check(primitive, lengths_index: int, seqlen_k_of) -> None:
    """Reports ``nonpad_kv_seqlen`` outside ``[0, Skv]`` for ``primitive`` under checkify.

    Args:
      primitive: a primitive whose operand ``lengths_index`` holds ``[B]`` lengths.
      seqlen_k_of: ``(*operands) -> Skv`` from the operands' static shapes.
    """

    def checks(*operands, **params):
        return [lengths_check("nonpad_kv_seqlen", operands[lengths_index],
                              seqlen_k_of(*operands), "Skv")]

    _register(primitive, checks)


def cu_seqlens_checks(name: str, cu_seqlens, rows: int, hint: int, hint_name: str):
    """The checks of one ``[N, B + 1]`` offsets operand of a pack of ``rows`` rows (Tq or Tk):
    ``(bad, message, index, value)`` for the first offending entry of each rule (for ``N > 1``,
    under vmap, the index counts along the last axis of the first offending pack)."""
    n = cu_seqlens.shape[-1]
    flat = cu_seqlens.reshape(-1)
    lengths = jnp.diff(cu_seqlens, axis=-1)  # [N, B]

    def first(bad, values, width):  # (any, index along the last axis, value) of the first bad
        if bad.size == 0:  # no sequences (B = 0): no lengths to check
            return jnp.bool_(False), jnp.int32(0), jnp.int32(0)
        bad_flat = bad.reshape(-1)
        at = jnp.argmax(bad_flat)
        return jnp.any(bad_flat), at % width, values.reshape(-1)[at]

    start = jnp.zeros_like(cu_seqlens, dtype=bool).at[..., 0].set(cu_seqlens[..., 0] != 0)
    decreasing = jnp.zeros_like(cu_seqlens, dtype=bool).at[..., 1:].set(lengths < 0)
    checks = [
        (*first(start, flat, n), f"{name}[{{}}] = {{}}: {name} must start at 0"),
        (*first(decreasing, flat, n), f"{name}[{{}}] = {{}} is below the entry before it: {name} "
                                      "must be non-decreasing"),
        (*first(cu_seqlens > rows, flat, n), f"{name}[{{}}] = {{}} is past the token count "
                                             f"({rows}): {name} must end at most there"),
        (*first(lengths > hint, lengths, n - 1),
         f"sequence {{}} has {{}} rows, more than {hint_name}={hint}: a hint must bound every "
         "length (longer sequences are clamped)"),
    ]
    return [(bad, message, at, value) for bad, at, value, message in checks]


def register_cu_seqlens_check(primitive) -> None:
    """Reports malformed ``cu_seqlens_q``/``cu_seqlens_k`` (operands 3 and 4 of the packed
    primitives: not starting at 0, decreasing, past the token count, or with a sequence longer
    than its ``max_seqlen`` hint) under checkify; the kernels clamp them otherwise. When the
    primitive serves ``attention(..., nonpad_q_seqlen=...)`` (``config.padded_lengths``), the
    counts are reported under their own names."""

    def checks(query, key, value, cu_seqlens_q, cu_seqlens_k, *rest, config):
        if config.padded_lengths:  # attention() with nonpad_q_seqlen: offsets [[0, n]] per pack
            return [lengths_check("nonpad_q_seqlen", cu_seqlens_q[:, 1], query.shape[1], "Sq"),
                    lengths_check("nonpad_kv_seqlen", cu_seqlens_k[:, 1], key.shape[1], "Skv")]
        return (cu_seqlens_checks("cu_seqlens_q", cu_seqlens_q, query.shape[1],
                                  config.max_seqlen_q, "max_seqlen_q")
                + cu_seqlens_checks("cu_seqlens_k", cu_seqlens_k, key.shape[1],
                                    config.max_seqlen_k, "max_seqlen_k"))

    _register(primitive, checks)


def block_table_check(block_table, seqlens_k, num_pages: int, page_size: int):
    """The check of a paged cache's ``[..., B, max_pages]`` block table: every page a sequence's
    keys use (entry ``p < ceil(seqlens_k[b] / page_size)``) must lie in ``[0, num_pages)``; the
    entries past a sequence's pages are never read and not checked. ``(bad, message, b, p,
    value)`` for the first offending entry (under vmap, ``b`` counts along the batch axis of
    the first offending call)."""
    batch, pages = block_table.shape[-2:]
    if block_table.size == 0:
        return jnp.bool_(False), "", jnp.int32(0), jnp.int32(0), jnp.int32(0)
    n = jnp.clip(seqlens_k, 0, pages * page_size)[..., None]  # [..., B, 1]
    used = jnp.arange(pages) < (n + page_size - 1) // page_size
    bad = (used & ((block_table < 0) | (block_table >= num_pages))).reshape(-1)
    at = jnp.argmax(bad)
    return (jnp.any(bad),
            f"block_table[{{}}, {{}}] = {{}} is out of range: the pages of a sequence's keys "
            f"must lie in [0, num_pages={num_pages}); out-of-range entries are clamped",
            at // pages % batch, at % pages, block_table.reshape(-1)[at])
