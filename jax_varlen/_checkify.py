"""``jax.experimental.checkify`` support: out-of-range lengths become a check error.

The rule lives on the primitive, so the check exists only when a caller functionalizes with
``checkify.checkify``; plain ``jit`` programs carry no check effect (and ``jax.export`` can
serialize them). Outside checkify, out-of-range lengths are clamped into ``[0, Skv]`` by the
kernels. checkify has no public hook for primitives, so this uses ``jax._src.checkify`` (its
layout is the same in jax 0.10 to 0.12); should it move, the op still clamps, and only the
report is lost.
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

    def rule(error, enabled_errors, *operands, **params):
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
        return error, primitive.bind(*operands, **params)

    _checkify.error_checks[primitive] = rule
