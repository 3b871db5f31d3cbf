"""Sharding: the rule algebra here, in this process; everything on 8 devices in a subprocess.

The multi-device cases (sharded jit with no collectives, shard_map, sequence-parallel decode,
sharded export) live in multi_device_cases.py. They need
``--xla_force_host_platform_device_count=8``, which only takes effect before jax creates its
CPU client, so ``test_multi_device_cases`` runs them in a fresh interpreter; every other test
file keeps the process's single CPU device.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import jax_varlen
from jax_varlen._primitive import attention_fwd_p
from jax_varlen._sharding import rule_of
from jax_varlen._sharding_rule import ShardingRule

# The forward primitive's own rule (what sharded calls use), not a copy of it.
ATTENTION = rule_of(attention_fwd_p)
# query [B=8, Sq=5, H=8, D=16], key [8, 48, Hkv=4, 16], value [8, 48, 4, 8], lengths [8]
SHAPES = [(8, 5, 8, 16), (8, 48, 4, 16), (8, 48, 4, 8), (8,)]
AXES = {"x": 2, "y": 4, "z": 2}


def test_multi_device_cases():
    here = pathlib.Path(__file__).resolve().parent
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env["XLA_FLAGS"] = flags.strip()
    env["JAX_PLATFORMS"] = "cpu"
    # The subprocess imports the jax_varlen this process imported (a source tree finds its
    # compiled extension in the installed copy), so both test the same code.
    package_root = str(pathlib.Path(jax_varlen.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "pytest", str(here / "multi_device_cases.py"), "-q",
           "-p", "no:cacheprovider", "-o", "addopts="]
    proc = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True, timeout=1200)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"multi-device cases failed (rc={proc.returncode}):\n{tail}"
    assert " passed" in proc.stdout, tail


def test_factor_sizes():
    sizes = ATTENTION.factor_sizes(SHAPES)
    assert sizes == {"b": 8, "q": 5, "k": 4, "g": 2, "d": 16, "s": 48, "e": 8}
    assert ATTENTION.factors == ("b", "q", "k", "g", "d", "s", "e")
    assert ATTENTION.whole == ("q", "g", "d", "s", "e")
    assert ATTENTION.batch_factor == "b"


def test_assign_and_specs():
    specs = [("x", None, "y", None), ("x", None, "y"), (), ("x",)]
    assignment = ATTENTION.assign(specs, SHAPES, AXES)
    assert assignment == {"b": ("x",), "k": ("y",)}
    ins, outs = ATTENTION.specs(assignment)
    assert ins == (("x", None, "y", None), ("x", None, "y", None), ("x", None, "y", None), ("x",))
    assert outs == (("x", None, "y", None), ("x", "y", None))


def test_assign_keeps_the_longest_dividing_prefix():
    """Worked example of the docstring: k (4 kv heads) over ('z', 'y') of sizes 2, 4 keeps 'z'."""
    specs = [(None, None, ("z", "y"), None), (), (), ()]
    assert ATTENTION.assign(specs, SHAPES, AXES) == {"k": ("z",)}


def test_assign_drops_what_does_not_divide():
    mqa = [(8, 5, 8, 16), (8, 48, 1, 16), (8, 48, 1, 8), (8,)]
    assert ATTENTION.assign([(None, None, "x"), (), (), ()], mqa, AXES) == {}
    odd_batch = [(3, 5, 8, 16), (3, 48, 4, 16), (3, 48, 4, 8), (3,)]
    assert ATTENTION.assign([("x",), (), (), ()], odd_batch, AXES) == {}


def test_assign_one_axis_serves_one_factor():
    specs = [("x", None, "x", None), (), (), ()]
    assert ATTENTION.assign(specs, SHAPES, AXES) == {"b": ("x",)}


def test_assign_strict_conflict():
    specs = [("x",), ("y",), (), ()]
    assert ATTENTION.assign(specs, SHAPES, AXES) == {"b": ("x",)}  # first operand wins
    with pytest.raises(ValueError, match=r"operands 0 and 1 split factor 'b' over different"):
        ATTENTION.assign(specs, SHAPES, AXES, strict=True)


def test_shardy_rule():
    text, kwargs = ATTENTION.shardy(SHAPES)
    assert text == "b q (k g) d, b s k d, b s k e, b -> b q (k g) e, b (k g) q"
    assert kwargs == {"g": 2, "need_replication_factors": ("q", "g", "d", "s", "e")}


@pytest.mark.parametrize(
    "kv_heads, text",
    [(8, "b q k d, b s k d, b s k e, b -> b q k e, b k q"),  # MHA: g = 1
     (1, "b q g d, b s k d, b s k e, b -> b q g e, b g q")],  # MQA: k = 1
    ids=["mha", "mqa"],
)
def test_shardy_rule_drops_size_one_factors(kv_heads, text):
    shapes = [(8, 5, 8, 16), (8, 48, kv_heads, 16), (8, 48, kv_heads, 8), (8,)]
    assert ATTENTION.shardy(shapes)[0] == text


def test_shardy_attr_text():
    batch_only = ATTENTION.with_parallel(["b"])
    assert batch_only.shardy_attr(SHAPES) == (
        "#sdy.op_sharding_rule<([i, j, kl, m], [i, n, k, m], [i, n, k, o], [i])"
        "->([i, j, kl, o], [i, kl, j]) {i=8, j=5, k=4, l=2, m=16, n=48, o=8} "
        "need_replication={j, k, l, m, n, o}, custom>"
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(operands=("b (g k)",), results=("b",), parallel=("k",)), "major"),
        (dict(operands=("b b",), results=("b",), parallel=("b",)), "occurs twice"),
        (dict(operands=("b",), results=("b",), parallel=("z",)), "does not occur"),
        (dict(operands=("b ?",), results=("b",), parallel=()), "unexpected character"),
    ],
)
def test_rule_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardingRule(**kwargs)
