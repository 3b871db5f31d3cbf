"""``jax.experimental.checkify`` support: out-of-range lengths become a check error.

The rule lives on the primitive, so the check exists only when a caller functionalizes with
``checkify.checkify``; plain ``jit`` programs carry no check effect (and ``jax.export`` can
serialize them). Outside checkify, out-of-range lengths are clamped into ``[0, Skv]`` by the
kernels. checkify has no public hook for primitives, so this uses ``jax._src.checkify`` (the
rule adapts to both of its calling conventions in jax 0.10 to 0.12); should it move, the op
still clamps, and only the report is lost.
"""

from __future__ import annotations

import jax.numpy as jnp

try:
    from jax._src import checkify as _checkify
except ImportError:  # pragma: no cover - a future jax without the private module
    _checkify = None


def register_lengths_check(primitive, lengths_index: int, seqlen_k_of) -> None:
    """Reports ``nonpad_kv_seqlen`` outside ``[0, Skv]`` for ``primitive`` under checkify.

    Args:
      primitive: a primitive whose operand ``lengths_index`` holds ``[B]`` lengths.
      seqlen_k_of: ``(*operands) -> Skv`` from the operands' static shapes.
    """
    if _checkify is None or not hasattr(_checkify, "error_checks"):
        return

    def rule(*args, **params):
        # The rule's leading arguments are (error, enabled_errors) in jax 0.10-0.11.1 and
        # (context, error, enabled_errors) from 0.11.2: find the error by type, update it, and
        # let checkify's default rule bind the primitive and return in that version's format.
        at = next(i for i, a in enumerate(args) if isinstance(a, _checkify.Error))
        error, enabled_errors, operands = args[at], args[at + 1], args[at + 2:]
        if _checkify.FailedCheckError in enabled_errors:
            seqlen_k = seqlen_k_of(*operands)
            lengths = operands[lengths_index]
            bad = jnp.any((lengths < 0) | (lengths > seqlen_k))
            error = _checkify.assert_func(
                error,
                bad,
                _checkify.FailedCheckError(
                    _checkify.get_traceback(),
                    f"nonpad_kv_seqlen must lie in [0, Skv={seqlen_k}]; out-of-range values "
                    "are clamped",
                ),
            )
        return _checkify.default_checkify_rule(
            primitive, *args[:at], error, enabled_errors, *operands, **params)

    _checkify.error_checks[primitive] = rule
