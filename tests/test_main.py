"""The demo, ``python -m jax_varlen``: its argument rules and its checks, on tiny shapes, in this
process (on the default device; the shapes keep it to a few seconds on a CPU)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import jax_varlen
from jax_varlen import __main__ as demo

TINY = ["--batch", "3", "--heads", "2", "--head-dim", "16", "--iters", "1"]


def test_causal_is_a_prefill_with_equal_lengths():
    """--causal makes Sq == Skv: one given length sets both; two different ones are refused."""
    assert (demo.parse_args([]).seqlen_q, demo.parse_args([]).seqlen_k) == (512, 512)
    assert vars(demo.parse_args(["--seqlen-q", "64"]))["seqlen_k"] == 512
    for given in (["--seqlen-q", "96"], ["--seqlen-k", "96"],
                  ["--seqlen-q", "96", "--seqlen-k", "96"]):
        args = demo.parse_args(["--causal", *given])
        assert (args.seqlen_q, args.seqlen_k) == (96, 96)
    assert demo.parse_args(["--causal"]).seqlen_q == 512


def test_causal_refuses_different_lengths(capsys):
    with pytest.raises(SystemExit) as e:
        demo.parse_args(["--causal", "--seqlen-q", "64", "--seqlen-k", "128"])
    assert e.value.code == 2
    assert "--seqlen-q equal to --seqlen-k" in capsys.readouterr().err


def test_real_rows_and_masked_error():
    rows = demo.real_rows(np.array([2, 0, 3]), 3)
    assert rows.tolist() == [[True, True, False], [False, False, False], [True, True, True]]
    out = np.zeros((3, 3, 1, 1), np.float32)
    ref = np.where(rows, 0.0, np.nan)[:, :, None, None]  # garbage only on padded rows
    assert demo.max_error(out, ref, "float32", rows) == (0.0, True)
    assert demo.max_error(out, ref, "float32")[1] is False


@pytest.mark.parametrize("extra", [["--seqlen-q", "64", "--seqlen-k", "64"],
                                   ["--seqlen-q", "40", "--seqlen-k", "72"]],
                         ids=["sq64-skv64", "sq40-skv72"])
def test_demo_passes(extra, capsys):
    assert demo.main([*TINY, *extra]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.skipif(
    "nonpad_q_seqlen" not in inspect.signature(jax_varlen.attention).parameters,
    reason="--causal needs jax_varlen.attention(..., nonpad_q_seqlen=)",
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_demo_causal_prefill_passes(dtype, capsys):
    """Ours, the reference and jax.nn compute the same causal prefill: the checks pass, and
    jax.nn's error on the real rows is rounding (a different mask would be off by O(0.1-1))."""
    assert demo.main([*TINY, "--causal", "--seqlen-k", "70", "--dtype", dtype]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "causal prefill" in out and "n/a" not in out
    xla = next(line for line in out.splitlines() if line.startswith("jax.nn xla (padded)"))
    assert float(xla.split()[-2]) < 0.05
