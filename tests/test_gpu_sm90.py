"""The Hopper (sm_90a) forward path: that it is the kernel that runs on a 9.x GPU, and the
cases only a persistent, heaviest-first kernel has -- more work units than SMs, so each CTA
walks several units of different sequences, and batches past the sorted limit.

The oracle matrix of test_forward.py (its gpu cases) runs on this path too (it is the default
one-pass kernel on Hopper); these tests add what that matrix cannot reach with its small
shapes.
"""

from __future__ import annotations

import gzip
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_varlen
from conftest import bits, check_against_oracle, make_inputs

pytestmark = pytest.mark.gpu


def _hopper():
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", "")
    if not str(cc).startswith("9"):
        pytest.skip(f"needs a compute capability 9.x GPU, got {cc!r}")


def _profiled_kernel_names(fn, tmp_path: pathlib.Path) -> bytes:
    """Runs fn under the JAX profiler; returns every byte the trace wrote (gunzipped)."""
    fn()  # compile and load outside the trace
    with jax.profiler.trace(str(tmp_path)):
        fn()
    blobs = []
    for f in tmp_path.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            blobs.append(gzip.decompress(data) if f.suffix == ".gz" else data)
    return b"".join(blobs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_hopper_kernel_is_the_one_that_runs(dtype, tmp_path):
    _hopper()
    q, k, v, n = make_inputs(2, 256, 300, 4, 2, 128, 128, dtype, [300, 77])
    f = jax.jit(lambda q, k, v, n: jax_varlen.attention(q, k, v, n, is_causal=True))
    trace = _profiled_kernel_names(lambda: f(q, k, v, n).block_until_ready(), tmp_path)
    assert b"fwd_sm90_kernel" in trace
    assert b"fwd_tc_kernel" not in trace


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_many_units_per_cta(head_dim, causal):
    """3 * 16 heads * 16 row blocks = 768 units over at most 132 CTAs: each CTA walks several
    units of different sequences, lengths and causal frontiers, with partial and half tiles."""
    _hopper()
    q, k, v, n = make_inputs(3, 2048, 700, 16, 4, head_dim, head_dim, jnp.bfloat16,
                             [700, 1, 321], seed=head_dim + causal)
    check_against_oracle(q, k, v, n, is_causal=causal)


def test_batch_past_the_sorted_limit():
    """More sequences than the kernel sorts in shared memory: they keep their own order."""
    _hopper()
    lengths = np.random.default_rng(0).integers(0, 65, size=400)
    q, k, v, n = make_inputs(400, 64, 64, 2, 1, 64, 64, jnp.bfloat16, list(lengths), seed=7)
    check_against_oracle(q, k, v, n, is_causal=True)


def test_long_units_bitwise_deterministic_and_batch_invariant():
    _hopper()
    q, k, v, n = make_inputs(4, 1024, 2048, 8, 2, 128, 128, jnp.bfloat16, [2048, 5, 1500, 129])
    f = jax.jit(jax_varlen.attention)
    out = f(q, k, v, n)
    assert bits(out) == bits(f(q, k, v, n))
    # Sequence 2 alone, in a batch of one: the same bits.
    alone = f(q[2:3], k[2:3], v[2:3], n[2:3])
    assert bits(alone) == bits(out[2:3])
