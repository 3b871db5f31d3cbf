"""``jax.export`` support: a one-step export, the safety checks our FFI targets need disabled,
and registration.

``jax.export`` refuses custom calls whose targets are not on its list of targets with a
stability guarantee; ours are not (they are this package's ABI, stable only within a version
of jax_varlen). So plain ``jax.export.export(jax.jit(f))(*args)`` of a function that uses the
op fails with JAX's generic "Cannot serialize code with custom calls whose targets have no
compatibility guarantees" error, naming one of our targets. Two ways through:

- ``jax_varlen.export(f)(*args)``: one step, the same arguments and result as
  ``jax.export.export`` (``f`` need not be jitted; extra ``disabled_checks`` are merged in);
- ``jax.export.export(jax.jit(f), disabled_checks=jax_varlen.export_disabled_checks())(*args)``.

JAX offers no public hook to make the plain call work or to reword its error (its list of
stable targets is private, and adding ours there would claim a stability they do not have).
The process that deserializes and runs the export needs the same (or a compatible) jax_varlen
installed and imported: ``import jax_varlen`` registers the targets.

Shape polymorphism: the batch dimension may be symbolic (``jax.export.symbolic_shape("b")``);
every other dimension must be concrete (``_api`` says which one is not). With a symbolic batch
the bare FFI call carries no Shardy rule (its factor sizes must be numbers), so a sharded call
of such an export gathers instead of splitting the batch.

How the op partitions once exported (see ``_sharding.py``): split over the batch with no
communication, by XLA's batch partitioner; split over heads only after gathering the heads.
Code exported from a ``shard_map`` (fully manual) runs on its local blocks as written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
    list if ``fun_jit`` has other custom calls. :func:`export` does both in one step.
    """
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in ffi_target_names()]


def export(
    fun: Callable,
    *,
    platforms: Sequence[str] | None = None,
    disabled_checks: Sequence[jax.export.DisabledSafetyCheck] = (),
    **export_kwargs,
) -> Callable[..., jax.export.Exported]:
    """``jax.export.export`` for code that uses jax_varlen: our FFI targets' checks disabled.

    Same arguments and result as ``jax.export.export``: it returns a function that takes the
    arguments (arrays, or ``jax.ShapeDtypeStruct`` specs, whose batch dimension may be
    symbolic) and returns a ``jax.export.Exported``. Differences:

    - ``fun`` may be a plain function; it is wrapped in ``jax.jit`` unless it is jitted already
      (pass a ``jax.jit(fun, static_argnames=...)`` of your own for static arguments);
    - ``disabled_checks`` (your own, e.g. ``DisabledSafetyCheck.custom_call("other_target")``
      for another library's custom call) are merged with :func:`export_disabled_checks`.

    ``platforms`` and any other keyword go to ``jax.export.export`` unchanged. Example::

        exported = jax_varlen.export(lambda q, k, v, n: jax_varlen.attention(q, k, v, n))(
            q, k, v, lens)
        blob = exported.serialize()  # needs the flatbuffers package
        # later, in any process that ran `import jax_varlen`:
        out = jax.export.deserialize(blob).call(q, k, v, lens)
    """
    fun_jit = fun if isinstance(fun, jax.stages.Wrapped) else jax.jit(fun)
    # Ours first, then the caller's not already there, in their order.
    checks = list(dict.fromkeys([*export_disabled_checks(), *disabled_checks]))
    return jax.export.export(fun_jit, platforms=platforms, disabled_checks=checks,
                             **export_kwargs)
