"""Loads the compiled extension and registers its FFI targets with JAX, once."""

from __future__ import annotations

import functools

import jax

# The forward (_primitive.py) and the backward (_backward.py), per platform, padded and packed.
CPU_TARGET = "jax_varlen_attention_fwd_cpu"
CUDA_TARGET = "jax_varlen_attention_fwd_cuda"
BWD_CPU_TARGET = "jax_varlen_attention_bwd_cpu"
BWD_CUDA_TARGET = "jax_varlen_attention_bwd_cuda"
PACKED_CPU_TARGET = "jax_varlen_packed_attention_fwd_cpu"
PACKED_CUDA_TARGET = "jax_varlen_packed_attention_fwd_cuda"
PACKED_BWD_CPU_TARGET = "jax_varlen_packed_attention_bwd_cpu"
PACKED_BWD_CUDA_TARGET = "jax_varlen_packed_attention_bwd_cuda"
# The forward with attention sinks (_primitive.py, sinks [H] after the lengths).
SINKS_CPU_TARGET = "jax_varlen_attention_fwd_sinks_cpu"
SINKS_CUDA_TARGET = "jax_varlen_attention_fwd_sinks_cuda"
PACKED_SINKS_CPU_TARGET = "jax_varlen_packed_attention_fwd_sinks_cpu"
PACKED_SINKS_CUDA_TARGET = "jax_varlen_packed_attention_fwd_sinks_cuda"
# The paged forward (_paged_primitive.py), CUDA only: the CPU gathers pages, then CPU_TARGET.
PAGED_CUDA_TARGET = "jax_varlen_paged_attention_fwd_cuda"
_XLA_PLATFORM = {"cpu": "cpu", "cuda": "CUDA"}  # the names XLA's registry expects


@functools.cache
def extension():
    """The compiled module ``jax_varlen._jax_varlen``, with every target registered."""
    _use_installed_extension()
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


def _use_installed_extension():
    """Lets a source checkout that shadows the installed package find its compiled extension.

    `python -m jax_varlen` (or `python -m pytest`) run from the repository root imports the
    source folder, not the installed package: Python puts the current directory first on
    sys.path, and the source folder has no `_jax_varlen*.so`. pip's record of the installed
    distribution says where that file is; its folder joins the package's search path.
    """
    import importlib.metadata
    import importlib.util
    import pathlib

    import jax_varlen

    if importlib.util.find_spec("jax_varlen._jax_varlen") is not None:
        return
    try:
        files = importlib.metadata.distribution("jax_varlen").files or ()
    except importlib.metadata.PackageNotFoundError:
        return
    for f in files:
        if f.name.startswith("_jax_varlen") and f.suffix in (".so", ".pyd"):
            folder = str(pathlib.Path(f.locate()).resolve().parent)
            if folder not in jax_varlen.__path__:
                jax_varlen.__path__.append(folder)
            return


def has_cuda() -> bool:
    """True when the extension was built with its CUDA kernels."""
    return bool(extension().with_cuda)
