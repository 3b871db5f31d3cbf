"""What only the CUDA build has: the planned path is the one that ran (last_launch()), its
head-size limit, CUDA-graph capture of the custom call, and a compute-sanitizer memcheck of
every kernel.

Skips unless jax sees a GPU and jax_varlen was built with its CUDA kernels (see conftest). The
forward's oracle checks and bitwise properties on the GPU are tests/test_forward.py's ``gpu``
cases (the ``backend`` fixture), the decode path's tests/test_gpu_decode.py, the Hopper
path's tests/test_gpu_sm90.py.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_varlen
from conftest import make_inputs
from jax_varlen import _ffi

pytestmark = pytest.mark.gpu


# --------------------------------------------------------------------------------------------
# The plan's path is the one that ran: after each call, the extension's last_launch() (what
# dispatch.cu launched, cuda/launch_record.h) against plan() for the same shapes on this device.


def _compute_major():
    return int(str(getattr(jax.devices()[0], "compute_capability", "0")).split(".")[0])


# (Sq, Skv, D, dtype): a prefill on the one-pass path (sm90 on Hopper), a decode row on
# split-KV, float32 and an odd head size on the portable kernels, d256 (the wide Hopper backward).
PATH_CASES = {
    "prefill-d128-bf16": (200, 300, 128, jnp.bfloat16),
    "decode-d128-bf16": (1, 2500, 128, jnp.bfloat16),
    "prefill-d64-f32": (64, 96, 64, jnp.float32),
    "prefill-d36-f16": (64, 96, 36, jnp.float16),
    "prefill-d256-bf16": (80, 130, 256, jnp.bfloat16),
}


@pytest.mark.parametrize("case", list(PATH_CASES), ids=list(PATH_CASES))
def test_the_planned_path_is_the_one_that_ran(case):
    Sq, Skv, D, dtype = PATH_CASES[case]
    B, H, Hkv = 2, 4, 2
    q, k, v, n = make_inputs(B, Sq, Skv, H, Hkv, D, D, dtype, [Skv, Skv // 3])
    ext = _ffi.extension()
    want = ext.plan(dtype=jnp.dtype(dtype).name, pack_seqs=1, pack_rows_q=Sq, pack_rows_k=Skv,
                    seqlen_q=Sq, seqlen_k=Skv, num_heads=H, kv_num_heads=Hkv, head_dim=D,
                    head_dim_v=D, num_packs=B, compute_major=_compute_major())
    assert want["unsupported"] == ""
    fwd = jax.jit(lambda q, k, v, n: jax_varlen.attention(q, k, v, n, is_causal=True))
    jax.block_until_ready(fwd(q, k, v, n))
    ran = ext.last_launch()
    assert ran["fwd_path"] == want["fwd_path"]
    assert ran["split_keys"] == want["split_keys"]
    loss = lambda q, k, v: jnp.sum(fwd(q, k, v, n).astype(jnp.float32))  # noqa: E731
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
    assert ext.last_launch()["bwd_path"] == want["bwd_path"]
    if _compute_major() == 9 and case == "prefill-d128-bf16":  # the Hopper kernels, both ways
        assert (want["fwd_path"], want["bwd_path"]) == ("sm90_one_pass", "sm90")
    if case == "decode-d128-bf16":
        assert want["fwd_path"] == "sm80_split" and want["split_keys"] > 0


# --------------------------------------------------------------------------------------------
# Each workspace is checked against the handler's own plan (ffi/xla/cuda.cu).


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_a_workspace_of_another_size_is_an_error(which):
    """The handler plans the call again and checks each workspace against that plan: one of
    another size (an exported call from another build, a direct caller of the target) fails
    with both sizes and never runs another kernel. bf16 at D = 128: Sq = 2 takes the split-KV
    forward (its partials), Sq = 64 the backward with its dQ workspace."""
    _ffi.extension()
    Sq = 2 if which == "forward" else 64
    q, k, v, n = make_inputs(2, Sq, 1500, 4, 2, 128, 128, jnp.bfloat16, [1500, 7], seed=5)
    attrs = dict(scale=np.float32(0.1), is_causal=False, softcap=np.float32(0.0),
                 window_left=np.int64(-1), window_right=np.int64(-1))
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    lse = jax.ShapeDtypeStruct((2, 4, Sq), jnp.float32)
    wrong = jax.ShapeDtypeStruct((3,), jnp.float32)
    if which == "forward":
        call = jax.ffi.ffi_call(_ffi.CUDA_TARGET, (out, lse, wrong))
        args = (q, k, v, n)
        match = r"the forward's workspace has 3 float32 elements, the plan expects 2 x \d+"
    else:
        call = jax.ffi.ffi_call(_ffi.BWD_CUDA_TARGET, (out, jax.ShapeDtypeStruct(k.shape, k.dtype),
                                                       jax.ShapeDtypeStruct(v.shape, v.dtype), lse,
                                                       wrong))
        o, l = jax_varlen.attention(q, k, v, n, return_lse=True)
        args = (q, k, v, n, o, l, o, jnp.zeros_like(l))
        match = r"the dQ workspace has 3 float32 elements, the plan expects 2 x \d+"
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(call(*args, **attrs))


# --------------------------------------------------------------------------------------------
# The CUDA kernels take head sizes up to 256 (the CPU handler has no limit): larger ones raise
# at trace time, naming both sizes.


@pytest.mark.parametrize("D,Dv", [(257, 64), (300, 300), (64, 320)])
def test_head_size_over_256_raises(D, Dv):
    q, k, v, n = make_inputs(2, 8, 16, 2, 2, D, Dv, jnp.bfloat16, [16, 3])
    match = rf"head sizes up to 256.*query/key head size {D} and value head size {Dv}"
    with pytest.raises(ValueError, match=match):
        jax.jit(jax_varlen.attention)(q, k, v, n)
    with pytest.raises(ValueError, match=match):
        jax_varlen.attention(q, k, v, n)


# --------------------------------------------------------------------------------------------
# CUDA graphs: XLA may capture the custom call into a command buffer; the bits must not change.

_PROBE = textwrap.dedent("""
    import sys
    import numpy as np
    import jax
    import jax.numpy as jnp
    import jax_varlen

    d = sys.argv[1]
    dtype = jnp.dtype(sys.argv[2])
    q, k, v = (jax.device_put(np.load(f"{d}/{x}.npy").astype(dtype)) for x in "qkv")
    n = jax.device_put(np.load(f"{d}/n.npy"))

    def varlen_cmdbuf_probe(q, k, v, n):
        f = lambda q: jax_varlen.attention(q, k, v, n, is_causal=True, softcap=5.0,
                                           return_lse=True)
        return f(q) + f(q[:, :4])  # one-pass (Sq = 128) and split-KV (Sq = 4) calls

    res = jax.jit(varlen_cmdbuf_probe)(q, k, v, n)
    np.savez(sys.argv[3], *[np.asarray(r).view(np.uint8) for r in res])
""")


def _probe_here(q, k, v, n):
    f = lambda q: jax_varlen.attention(q, k, v, n, is_causal=True, softcap=5.0,  # noqa: E731
                                       return_lse=True)
    res = jax.jit(lambda q: f(q) + f(q[:, :4]))(q)
    return [np.asarray(r).view(np.uint8) for r in res]


def _run_probe(tmp_path, name, xla_flags, dtype):
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process already holds GPU memory
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    out_path = tmp_path / f"{name}.npz"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), dtype, str(out_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"probe ({name}) failed:\n{proc.stdout}\n{proc.stderr}"
    with np.load(out_path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def _custom_calls_in_command_buffers(text):
    """(inside, outside): kCustomCall thunks nested under a top-level kCommandBuffer or not.

    Each thunk line reads "<indent><index>: <kind> ..."; nested thunks are indented under
    their command buffer (the format XLA's own command-buffer tests parse).
    """
    inside = outside = 0
    in_cmd = False
    for line in text.splitlines():
        thunk = line.lstrip()
        m = re.match(r"(\d+): (\S+)", thunk)
        if not m:
            continue
        if thunk == line:  # top level
            in_cmd = m.group(2).startswith("kCommandBuffer")
        if m.group(2).startswith("kCustomCall"):
            if in_cmd and thunk != line:
                inside += 1
            else:
                outside += 1
    return inside, outside


def test_command_buffer_capture_is_bitwise_identical(tmp_path):
    dtype = "bfloat16"
    q, k, v, n = make_inputs(3, 128, 1100, 4, 2, 128, 128, jnp.bfloat16, [1100, 0, 300],
                             seed=17)
    for name, x in zip("qkv", (q, k, v)):
        np.save(tmp_path / f"{name}.npy", np.asarray(x, np.float32))  # exact upcast
    np.save(tmp_path / "n.npy", np.asarray(n))
    here = _probe_here(q, k, v, n)

    dump = tmp_path / "dump"
    graph = _run_probe(
        tmp_path, "graph",
        f"--xla_gpu_enable_command_buffer=+CUSTOM_CALL --xla_gpu_graph_min_graph_size=1 "
        f"--xla_dump_to={dump}", dtype)
    plain = _run_probe(tmp_path, "plain", "--xla_gpu_enable_command_buffer=", dtype)
    assert len(here) == len(graph) == len(plain) == 4
    for i in range(4):
        assert here[i].tobytes() == graph[i].tobytes(), f"result {i}: graph differs"
        assert here[i].tobytes() == plain[i].tobytes(), f"result {i}: plain differs"

    pattern = "*varlen_cmdbuf_probe*thunk_sequence_after_thunk_passes*.txt"
    files = sorted(glob.glob(str(dump / pattern)))
    listing = sorted(os.listdir(dump)) if dump.exists() else []
    if not files:
        # This jax/XLA names its dumps differently: any thunk-sequence dump of the probe module
        # must still show the custom calls inside a command buffer.
        files = sorted(glob.glob(str(dump / "*varlen_cmdbuf_probe*thunk*.txt")))
    assert files, f"no thunk-sequence dump of the probe module; dump holds: {listing}"
    text = "\n".join(open(f).read() for f in files)
    inside, outside = _custom_calls_in_command_buffers(text)
    assert inside >= 2 and outside == 0, (
        f"expected both custom calls nested under kCommandBuffer; got {inside} inside, "
        f"{outside} outside, in {files}:\n{text[:4000]}")


# --------------------------------------------------------------------------------------------
# compute-sanitizer memcheck: no out-of-bounds or misaligned access in any kernel.

_MEMCHECK_CASE = textwrap.dedent("""
    import numpy as np
    import jax
    import jax.numpy as jnp
    import jax_varlen

    rng = np.random.default_rng(0)
    def run(B, Sq, Skv, H, Hkv, D, Dv, dtype, lengths, **kw):
        q = jnp.asarray(rng.standard_normal((B, Sq, H, D)), dtype)
        k = jnp.asarray(rng.standard_normal((B, Skv, Hkv, D)), dtype)
        v = jnp.asarray(rng.standard_normal((B, Skv, Hkv, Dv)), dtype)
        n = jnp.asarray(lengths, jnp.int32)
        jax.block_until_ready(jax_varlen.attention(q, k, v, n, return_lse=True, **kw))

    # tensor-core one-pass (a partial tile at every edge), split-KV + combine, portable kernel
    run(2, 70, 1100, 4, 2, 128, 64, jnp.bfloat16, [1100, 37], is_causal=True, softcap=5.0)
    run(2, 33, 300, 2, 1, 256, 256, jnp.float16, [300, 0])
    run(3, 2, 1100, 8, 2, 64, 64, jnp.bfloat16, [1100, 1, 0], is_causal=True)
    run(2, 9, 100, 4, 2, 13, 20, jnp.float32, [100, 37])
    print("memcheck case done")
""")


def _compute_sanitizer():
    found = shutil.which("compute-sanitizer")
    for root in filter(None, (os.environ.get("CUDA_HOME"), "/usr/local/cuda")):
        if not found and os.path.exists(f"{root}/bin/compute-sanitizer"):
            found = f"{root}/bin/compute-sanitizer"
    return found


def test_compute_sanitizer_memcheck_is_clean(tmp_path):
    sanitizer = _compute_sanitizer()
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not installed on this machine")
    script = tmp_path / "memcheck_case.py"
    script.write_text(_MEMCHECK_CASE)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run(
        [sanitizer, "--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode", "99",
         sys.executable, str(script)],
        env=env, capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    print(log[-1500:])  # shown with pytest -rP: the sanitizer's own summary
    assert proc.returncode == 0 and "memcheck case done" in log, log[-6000:]
    assert "ERROR SUMMARY: 0 errors" in log, log[-6000:]
