"""``jax.export`` support: the safety checks our FFI targets need disabled, and registration.

``jax.export`` refuses custom calls whose targets are not on its list of targets with a
stability guarantee; ours are not (they are this package's ABI, stable only within a version
of jax_varlen). Exporting a function that uses the op therefore needs
``disabled_checks=jax_varlen.export_disabled_checks()``, and the process that deserializes and
runs it needs the same (or a compatible) jax_varlen installed and imported: ``import
jax_varlen`` registers the targets.

Shape polymorphism: the batch dimension may be symbolic (``jax.export.symbolic_shape("b")``);
every other dimension must be concrete (``_api`` says which one is not). With a symbolic batch
the bare FFI call carries no Shardy rule (its factor sizes must be numbers), so a sharded call
of such an export gathers instead of splitting the batch.

How the op partitions once exported (see ``_sharding.py``): split over the batch with no
communication, by XLA's batch partitioner; split over heads only after gathering the heads.
Code exported from a ``shard_map`` (fully manual) runs on its local blocks as written.
"""

from __future__ import annotations

import jax

from jax_varlen import _ffi


def register_ffi_targets() -> None:
    """Loads the compiled extension and registers all its FFI targets with XLA (idempotent).

    ``import jax_varlen`` already does this (and registers the targets' batch partitioners),
    so a process that only deserializes exported code needs nothing more than the import.
    Calling it explicitly raises ``ImportError`` when the compiled extension is missing.
    """
    _ffi.extension()


def ffi_target_names() -> tuple[str, ...]:
    """Every FFI target name this package can emit, on every platform, sorted.

    The union of ``_ffi``'s ``*_TARGET`` constants (known even where the extension was built
    without CUDA, e.g. exporting for CUDA from a CPU machine) and the targets the installed
    extension registers.
    """
    names = {v for k, v in vars(_ffi).items() if k.endswith("_TARGET") and isinstance(v, str)}
    try:
        for targets in _ffi.extension().registrations().values():
            names.update(targets)
    except ImportError:  # a source tree without the extension: the constants still hold
        pass
    return tuple(sorted(names))


def export_disabled_checks() -> list:
    """``[jax.export.DisabledSafetyCheck.custom_call(name) for each of our FFI targets]``.

    Pass it to ``jax.export.export(fun_jit, disabled_checks=...)``; add your own checks to the
    list if ``fun_jit`` has other custom calls.
    """
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in ffi_target_names()]
