"""Loads the compiled extension and registers its FFI targets with JAX, once."""

from __future__ import annotations

import functools

import jax

CPU_TARGET = "jax_varlen_attention_fwd_cpu"
CUDA_TARGET = "jax_varlen_attention_fwd_cuda"
_XLA_PLATFORM = {"cpu": "cpu", "cuda": "CUDA"}  # the names XLA's registry expects


@functools.cache
def extension():
    """The compiled module ``jax_varlen._jax_varlen``, with every target registered."""
    try:
        from jax_varlen import _jax_varlen
    except ImportError as e:  # a source checkout that was never built
        raise ImportError(
            "jax_varlen's compiled extension is missing: install the package "
            "(`pip install .`) rather than importing it from a source tree"
        ) from e
    for platform, targets in _jax_varlen.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=_XLA_PLATFORM[platform])
    return _jax_varlen


def has_cuda() -> bool:
    """True when the extension was built with its CUDA kernels."""
    return bool(extension().with_cuda)
