"""Static parameters of the attention primitives, as one frozen hashable value."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Everything about a call that is not an array.

    Attributes:
      scale: multiplies ``<q, k>`` (already resolved from ``1/sqrt(D)`` when not given).
      is_causal: tail-aligned (bottom-right) causal mask.
      softcap: ``0`` is off; otherwise scores become ``softcap * tanh(s / softcap)``.
      max_seqlen_q, max_seqlen_k: the packed layout only (``None`` for the padded batch): the
        longest sequence's query and key rows, already resolved (``Tq``/``Tk`` when not given);
        they size the kernels' grids and longer sequences are clamped to them.
      padded_lengths: the packed primitive serves :func:`jax_varlen.attention` with
        ``nonpad_q_seqlen``: every pack is one padded sequence, its offsets ``[0, n_q]`` and
        ``[0, n_kv]``; checks then name those arguments (``_checkify.py``).
      window_left, window_right: the local window (``local_window_size``) around each query's
        tail-aligned position ``p``: keys ``p - window_left .. p + window_right``; ``-1`` leaves
        that side unbounded (both ``-1``: no window). ffi/core/mask.h, ``MaskSpec``.
    """

    scale: float
    is_causal: bool = False
    softcap: float = 0.0
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    padded_lengths: bool = False
    window_left: int = -1
    window_right: int = -1
