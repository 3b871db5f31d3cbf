"""NaN and Inf in real data propagate; padding still never leaks; on every backend.

The rule (docs/semantics.md): a row with no allowed key gives zeros and lse = -inf, decided
by the count of allowed keys, never by the value of a sum; a row that allows a non-finite
element gives what the math gives; rows that do not are unaffected. The checks are
conftest.check_nonfinite_rule, on each backend's own shapes (``PATHS``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_varlen
from conftest import (
    NONFINITE_KINDS,
    DTYPES,
    assert_out_close,
    backend_cases,
    check_nonfinite_rule,
    nonfinite_inputs,
    oracle_hi,
)

# CPU: sequence 0 (n = 70) holds the element: key row 68 lies in the second 64-key step of the
# CPU loops, and under causal only query rows 7 and 8 allow it. Sequence 1 (n = 5 < Sq) has
# empty leading rows under causal. Padding is NaN (make_inputs).
SHAPE = dict(B=2, Sq=9, Skv=80, H=4, Hkv=2, D=16, Dv=8, lengths=[70, 5])

# name -> (dtype, shape) per backend. GPU: one per kernel path. The element sits in sequence 0
# at key row n_0 - 2 (past the first key tile; for split-KV, in the second 1024-key split) and
# query row Sq // 2; sequence 1 has n < Sq, so under causal its leading rows are empty.
PATHS = {
    "cpu": {"f32": ("f32", SHAPE), "bf16": ("bf16", SHAPE)},
    "gpu": {
        "onepass-bf16": ("bf16", dict(B=2, Sq=70, Skv=300, H=4, Hkv=2, D=128, Dv=128,
                                      lengths=[300, 37])),
        "onepass-f16": ("f16", dict(B=2, Sq=70, Skv=300, H=4, Hkv=2, D=64, Dv=64,
                                    lengths=[290, 3])),
        "split-bf16": ("bf16", dict(B=2, Sq=4, Skv=1100, H=8, Hkv=2, D=64, Dv=64,
                                    lengths=[1100, 2])),
        "simt-f32": ("f32", dict(B=2, Sq=9, Skv=200, H=4, Hkv=2, D=32, Dv=32,
                                 lengths=[150, 5])),
        "portable-f16": ("f16", dict(B=2, Sq=9, Skv=200, H=4, Hkv=1, D=36, Dv=20,
                                     lengths=[130, 4])),
    },
}
# The f32 path of each backend, and (GPU) the one-pass and split-KV bf16 ones, for softcap.
SOFTCAP_PATHS = {
    "cpu": {"f32": PATHS["cpu"]["f32"]},
    "gpu": {name: PATHS["gpu"][name] for name in ("onepass-bf16", "split-bf16", "simt-f32")},
}


@backend_cases("path", PATHS)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("kind", list(NONFINITE_KINDS))
def test_nonfinite_real_data_propagates(backend, path, kind, causal):
    dtype, shape = path
    check_nonfinite_rule(kind, dtype=DTYPES[dtype], is_causal=causal, seed=1, **shape)


@backend_cases("path", SOFTCAP_PATHS)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("kind", ["query-nan", "key-nan", "value-nan"])
def test_nan_propagates_through_softcap(backend, path, kind, causal):
    dtype, shape = path
    check_nonfinite_rule(kind, dtype=DTYPES[dtype], is_causal=causal, softcap=2.0, seed=2,
                         **shape)


@backend_cases("path", PATHS)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_nan_query_in_a_row_without_keys(backend, path, causal):
    """Sequence 1 has n < Sq: under causal its row 0 allows no key, so a NaN query there is
    never read (zeros, lse = -inf); without causal the row allows keys and is NaN."""
    dtype, shape = path
    at = dict(b=1, i=0, j=0, h=2, d=0, e=0)
    out, lse = check_nonfinite_rule("query-nan", dtype=DTYPES[dtype], is_causal=causal, at=at,
                                    reaches=not causal, **shape)
    if causal:
        assert (out[1, 0, 2] == 0).all() and lse[1, 2, 0] == -np.inf
    else:
        assert np.isnan(out[1, 0, 2]).all()


def test_minus_inf_score_gets_zero_weight(backend):
    """An Inf key whose scores are -inf (negative query components) gets probability
    exp(-inf) = 0: the math gives finite rows, and so must the op."""
    q, k, v, n, p = nonfinite_inputs("key-inf", dtype=jnp.float32, seed=3, **SHAPE)
    q = np.array(q)
    G = SHAPE["H"] // SHAPE["Hkv"]
    g = p["h"] // G
    q[p["b"], :, g * G:(g + 1) * G, p["d"]] *= -1.0  # nonfinite_inputs made them positive
    q = jnp.asarray(q)
    for causal in (False, True):
        out, lse = jax_varlen.attention(q, k, v, n, is_causal=causal, return_lse=True)
        hi_out, hi_lse = oracle_hi(q, k, v, n, is_causal=causal, return_lse=True)
        assert np.isfinite(hi_out).all() and np.isfinite(np.asarray(out)).all()
        assert_out_close(out, hi_out, None, jnp.float32)
        finite = np.isfinite(hi_lse)
        np.testing.assert_allclose(np.asarray(lse)[finite], hi_lse[finite], rtol=1e-5)


@pytest.mark.parametrize("kind", ["query-nan", "key-nan", "value-nan", "query-inf"])
def test_nan_pattern_matches_jax_nn(backend, kind):
    """With every key real and no mask, jax.nn.dot_product_attention is plain attention:
    its NaN pattern and its finite values are ours."""
    shape = dict(SHAPE, Dv=SHAPE["D"], lengths=[80, 80])  # jax.nn needs Dv = D
    q, k, v, n, _ = nonfinite_inputs(kind, dtype=jnp.float32, seed=4, **shape)
    ours = np.asarray(jax_varlen.attention(q, k, v, n))
    with jax.default_matmul_precision("highest"):  # on a GPU, XLA's f32 dots are TF32 otherwise
        theirs = np.asarray(jax.nn.dot_product_attention(q, k, v, implementation="xla"))
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    assert np.isnan(ours).any()
    finite = np.isfinite(theirs)
    np.testing.assert_allclose(ours[finite], theirs[finite], atol=1e-5)

