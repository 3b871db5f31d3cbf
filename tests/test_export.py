"""jax.export of code that uses the op, on every backend: disabled checks, serialize ->
deserialize -> call, in this process and in a fresh one, with a symbolic batch; the one-step
``jax_varlen.export``.

Each test exports for its backend's platform (conftest.EXPORT_PLATFORM). Single device here;
sharded export runs in multi_device_cases.py.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_varlen
from jax_varlen import _ffi
from conftest import DTYPES, EXPORT_PLATFORM, backend_cases, bits, make_inputs, needs_flatbuffers

LENGTHS = [0, 5, 33, 40]


def _inputs(dtype=jnp.float32):
    return make_inputs(4, 3, 40, 4, 2, 16, 8, dtype, LENGTHS, seed=7)


def _fn(q, k, v, n):
    return jax_varlen.attention(q, k, v, n, is_causal=True, softcap=5.0, return_lse=True)


def _export(fn, backend, *args):
    return jax.export.export(fn, platforms=(EXPORT_PLATFORM[backend],),
                             disabled_checks=jax_varlen.export_disabled_checks())(*args)


def test_export_without_disabled_checks_names_the_target(backend):
    """Why jax_varlen.export exists: our targets are not on jax.export's stable list."""
    target = {"cpu": _ffi.CPU_TARGET, "gpu": _ffi.CUDA_TARGET}[backend]
    with pytest.raises(ValueError, match=target):
        jax.export.export(jax.jit(_fn), platforms=(EXPORT_PLATFORM[backend],))(*_inputs())


@needs_flatbuffers
@pytest.mark.parametrize("jitted", [False, True], ids=["plain-fn", "jitted-fn"])
def test_one_step_export_round_trip(backend, jitted):
    """jax_varlen.export takes a plain or a jitted function and no disabled_checks."""
    args = _inputs()
    fn = jax.jit(_fn) if jitted else _fn
    exported = jax_varlen.export(fn, platforms=(EXPORT_PLATFORM[backend],))(*args)
    out, lse = jax.export.deserialize(exported.serialize()).call(*args)
    ref_out, ref_lse = jax.jit(_fn)(*args)
    assert bits(out) == bits(ref_out) and bits(lse) == bits(ref_lse)


@needs_flatbuffers
def test_one_step_export_merges_user_checks(backend):
    """The caller's disabled checks join ours (once each, ours first), and the export with the
    merged list round-trips; static arguments go through the caller's own jax.jit."""
    args = _inputs()
    fn = jax.jit(jax_varlen.attention, static_argnames=("is_causal",))
    ours = jax_varlen.export_disabled_checks()
    other = jax.export.DisabledSafetyCheck.custom_call("some_other_library_target")
    exported = jax_varlen.export(
        fn, platforms=(EXPORT_PLATFORM[backend],),
        disabled_checks=[other, ours[0], jax.export.DisabledSafetyCheck.platform()],
    )(*args, is_causal=True)
    assert list(exported.disabled_safety_checks) == [
        *ours, other, jax.export.DisabledSafetyCheck.platform()]
    out = jax.export.deserialize(exported.serialize()).call(*args)
    assert bits(out) == bits(fn(*args, is_causal=True))


def test_one_step_export_symbolic_batch(backend):
    """Specs with a symbolic batch go through unchanged (one export for every batch size)."""
    q, k, v, n = _inputs()
    (b,) = jax.export.symbolic_shape("b")
    specs = [jax.ShapeDtypeStruct((b,) + x.shape[1:], x.dtype) for x in (q, k, v, n)]
    exported = jax_varlen.export(_fn, platforms=(EXPORT_PLATFORM[backend],))(*specs)
    out, lse = exported.call(q[:2], k[:2], v[:2], n[:2])
    ref_out, ref_lse = jax.jit(_fn)(q[:2], k[:2], v[:2], n[:2])
    assert bits(out) == bits(ref_out) and bits(lse) == bits(ref_lse)


@needs_flatbuffers
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_round_trip(backend, dtype):
    args = _inputs(dtype)
    fn = jax.jit(_fn)
    blob = _export(fn, backend, *args).serialize()
    out, lse = jax.export.deserialize(blob).call(*args)
    ref_out, ref_lse = _fn(*args)
    assert bits(out) == bits(ref_out) and bits(lse) == bits(ref_lse)


@needs_flatbuffers
def test_round_trip_rank3_gqa(backend):
    q, k, v, n = make_inputs(2, 1, 24, 8, 2, 32, 32, jnp.float32, [24, 7], seed=8, rank=3)

    def decode(q, k, v, n):
        return jax_varlen.attention(q, k, v, n, num_heads=8, kv_num_heads=2)

    fn = jax.jit(decode)
    out = jax.export.deserialize(_export(fn, backend, q, k, v, n).serialize()).call(q, k, v, n)
    assert bits(out) == bits(decode(q, k, v, n))


@needs_flatbuffers
@pytest.mark.parametrize("register", [False, True], ids=["import-only", "register_ffi_targets"])
def test_deserialize_in_a_fresh_process(backend, tmp_path, register):
    """A process that only deserializes finds the targets: `import jax_varlen` registers them
    (it used to fail with "NOT_FOUND: No FFI handler registered" without the explicit call)."""
    args = _inputs()
    fn = jax.jit(_fn)
    (tmp_path / "fn.bin").write_bytes(_export(fn, backend, *args).serialize())
    np.savez(tmp_path / "args.npz", *[np.asarray(a) for a in args])
    script = textwrap.dedent(
        f"""
        import sys
        import jax, numpy as np
        import jax_varlen

        {"jax_varlen.register_ffi_targets()" if register else ""}
        exp = jax.export.deserialize(open(sys.argv[1] + "/fn.bin", "rb").read())
        args = np.load(sys.argv[1] + "/args.npz")
        out, lse = exp.call(*[args[f"arr_{{i}}"] for i in range(4)])
        np.savez(sys.argv[1] + "/out.npz", out=np.asarray(out), lse=np.asarray(lse))
        """
    )
    # The platform the blob was exported for: the CPU alone, or the GPU without preallocating
    # (this process holds GPU memory already). The same jax_varlen as this process (the source
    # tree finds its compiled extension in the installed copy).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(pathlib.Path(jax_varlen.__file__).resolve().parents[1])]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.update({"cpu": {"JAX_PLATFORMS": "cpu"},
                "gpu": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}}[backend])
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = np.load(tmp_path / "out.npz")
    ref_out, ref_lse = _fn(*args)
    assert bits(got["out"]) == bits(ref_out) and bits(got["lse"]) == bits(ref_lse)


# (dtype, B, Sq, Skv, H, Hkv, D, Dv, lengths). GPU: the split-KV path (Sq 4), whose workspace
# size is an expression in the batch, and the one-pass path (Sq 70), across a 1024-key split.
_SMALL = ("f32", 4, 3, 40, 4, 2, 16, 8, LENGTHS)  # _inputs()
SYMBOLIC_BATCH_CASES = {
    "cpu": {"f32-sq3": _SMALL},
    "gpu": {
        "f32-sq3": _SMALL,
        **{f"bf16-sq{Sq}-{path}": ("bf16", 3, Sq, 1100, 8, 2, 64, 64, [1100, 5, 577])
           for path, Sq in (("split", 4), ("one-pass", 70))},
    },
}


@needs_flatbuffers
@backend_cases("case", SYMBOLIC_BATCH_CASES)
def test_round_trip_with_symbolic_batch(backend, case):
    """A symbolic batch (shape polymorphism): one export serves every batch size, with the
    bits of a direct call."""
    dtype, B, Sq, Skv, H, Hkv, D, Dv, lengths = case
    q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, Dv, DTYPES[dtype], lengths, seed=7)
    (b,) = jax.export.symbolic_shape("b")
    specs = [jax.ShapeDtypeStruct((b,) + x.shape[1:], x.dtype) for x in (q, k, v, n)]
    fn = jax.jit(_fn)
    restored = jax.export.deserialize(_export(fn, backend, *specs).serialize())
    for batch in range(1, B + 1):
        args = [x[:batch] for x in (q, k, v, n)]
        assert jax.tree.map(bits, restored.call(*args)) == jax.tree.map(bits, fn(*args))
