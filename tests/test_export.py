"""jax.export of code that uses the op: disabled checks, serialize -> deserialize -> call.

Single device here; sharded export runs in multi_device_cases.py.
"""

from __future__ import annotations

import importlib.util
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
from conftest import bits, make_inputs

# Exported.serialize() needs the flatbuffers package, which jax does not depend on.
needs_flatbuffers = pytest.mark.skipif(
    importlib.util.find_spec("flatbuffers") is None,
    reason="Exported.serialize() needs the flatbuffers package (pip install flatbuffers)",
)

LENGTHS = [0, 5, 33, 40]


def _inputs(dtype=jnp.float32):
    return make_inputs(4, 3, 40, 4, 2, 16, 8, dtype, LENGTHS, seed=7)


def _fn(q, k, v, n):
    return jax_varlen.attention(q, k, v, n, is_causal=True, softcap=5.0, return_lse=True)


def test_disabled_checks_cover_every_target():
    from jax_varlen import _ffi

    checks = jax_varlen.export_disabled_checks()
    for target in (_ffi.CPU_TARGET, _ffi.CUDA_TARGET):
        assert jax.export.DisabledSafetyCheck.custom_call(target) in checks
    for name in _ffi.extension().registrations().get("cpu", {}):
        assert jax.export.DisabledSafetyCheck.custom_call(name) in checks


def test_export_without_disabled_checks_names_the_target():
    """Why the helper exists: our targets are not on jax.export's stable list."""
    with pytest.raises(ValueError, match=r"jax_varlen_attention_fwd_(cpu|cuda)"):
        jax.export.export(jax.jit(_fn))(*_inputs())


@needs_flatbuffers
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_round_trip(dtype):
    args = _inputs(dtype)
    fn = jax.jit(_fn)
    exp = jax.export.export(fn, disabled_checks=jax_varlen.export_disabled_checks())(*args)
    blob = exp.serialize()
    out, lse = jax.export.deserialize(blob).call(*args)
    ref_out, ref_lse = _fn(*args)
    assert bits(out) == bits(ref_out) and bits(lse) == bits(ref_lse)


@needs_flatbuffers
def test_round_trip_rank3_gqa():
    q, k, v, n = make_inputs(2, 1, 24, 8, 2, 32, 32, jnp.float32, [24, 7], seed=8, rank=3)

    def decode(q, k, v, n):
        return jax_varlen.attention(q, k, v, n, num_heads=8, kv_num_heads=2)

    fn = jax.jit(decode)
    exp = jax.export.export(fn, disabled_checks=jax_varlen.export_disabled_checks())(q, k, v, n)
    out = jax.export.deserialize(exp.serialize()).call(q, k, v, n)
    assert bits(out) == bits(decode(q, k, v, n))


@needs_flatbuffers
@pytest.mark.parametrize("register", [False, True], ids=["import-only", "register_ffi_targets"])
def test_deserialize_in_a_fresh_process(tmp_path, register):
    """A process that only deserializes finds the targets: `import jax_varlen` registers them
    (it used to fail with "NOT_FOUND: No FFI handler registered" without the explicit call)."""
    args = _inputs()
    fn = jax.jit(_fn)
    exp = jax.export.export(fn, disabled_checks=jax_varlen.export_disabled_checks())(*args)
    (tmp_path / "fn.bin").write_bytes(exp.serialize())
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
    # Same platform as this process (the blob was exported for it); the same jax_varlen as
    # this process (the source tree finds its compiled extension in the installed copy).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(pathlib.Path(jax_varlen.__file__).resolve().parents[1])]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = np.load(tmp_path / "out.npz")
    ref_out, ref_lse = _fn(*args)
    assert bits(got["out"]) == bits(ref_out) and bits(got["lse"]) == bits(ref_lse)


@needs_flatbuffers
def test_round_trip_with_symbolic_batch():
    """A symbolic batch (shape polymorphism): one export serves every batch size."""
    (b,) = jax.export.symbolic_shape("b")
    q, k, v, n = _inputs()
    specs = [jax.ShapeDtypeStruct((b,) + x.shape[1:], x.dtype) for x in (q, k, v, n)]
    fn = jax.jit(_fn)
    exp = jax.export.export(fn, disabled_checks=jax_varlen.export_disabled_checks())(*specs)
    restored = jax.export.deserialize(exp.serialize())
    for batch in (1, 3, 4):
        args = [x[:batch] for x in (q, k, v, n)]
        assert jax.tree.map(bits, restored.call(*args)) == jax.tree.map(bits, fn(*args))
