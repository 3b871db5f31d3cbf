"""jax_varlen: variable-length attention for JAX that spends no compute on padding.

Public API: :func:`attention` (padded batch + ``nonpad_kv_seqlen``), :func:`packed_attention`
(sequences packed back to back + ``cu_seqlens``, the same math on the same kernels),
:func:`reference` (the pure-JAX oracle of the contract) and :func:`packed_reference` (the
oracle of the packed layout); :func:`paged_attention` (forward only: a paged KV cache, vLLM's
layout, docs/paged.md) and its oracle :func:`paged_reference`.

Multiple devices (docs/multi_device.md): :func:`merge_attention` and
:func:`sequence_parallel_attention` (KV cache split along its sequence axis);
:func:`export` (``jax.export.export`` with our FFI targets' checks disabled),
:func:`export_disabled_checks` and :func:`register_ffi_targets` for ``jax.export``.
"""

from jax_varlen import _ffi
from jax_varlen._api import attention
from jax_varlen._export import export, export_disabled_checks, register_ffi_targets
from jax_varlen._merge import merge_attention
from jax_varlen._packed_api import packed_attention
from jax_varlen._paged_api import paged_attention
from jax_varlen._seqpar import sequence_parallel_attention
from jax_varlen.reference import packed_reference, paged_reference, reference

__version__ = "0.1.0"

# Importing the package registers its FFI targets, so that a process that only deserializes
# exported code (jax.export.deserialize(...).call(...)) finds them. A source tree that was
# never built imports anyway; the op then says how to build on first use.
try:
    _ffi.extension()
except ImportError:
    pass

__all__ = [
    "attention",
    "packed_attention",
    "reference",
    "packed_reference",
    "paged_attention",
    "paged_reference",
    "merge_attention",
    "sequence_parallel_attention",
    "export",
    "export_disabled_checks",
    "register_ffi_targets",
    "__version__",
]
