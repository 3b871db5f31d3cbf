"""The split-KV decode path (Sq <= 16, f16/bf16 on CUDA): right, deterministic and
batch-invariant on the GPU, with caches of several splits up to over a hundred.

tests/test_forward.py's ``gpu`` cases reach this path too (its short-query patterns); these
tests add decode-sized heads and caches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_varlen
from conftest import (
    assert_lse_close,
    assert_out_close,
    bits,
    check_against_oracle,
    make_inputs,
    oracle_hi,
)


# Cache lengths 0, 1, odd, full, and one very long among short; Skv crosses several splits.
LENGTHS = {
    "mixed": [0, 1, 1023, 1025, 3000, 17],
    "skewed": [3000, 2, 5, 1, 9, 2049],
}


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", list(LENGTHS))
@pytest.mark.parametrize("Sq", [1, 2, 4, 16])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_decode_matches_oracle(pattern, Sq, causal):
    lengths = LENGTHS[pattern]
    q, k, v, n = make_inputs(len(lengths), Sq, 3000, 32, 8, 128, 128, jnp.bfloat16, lengths,
                             seed=Sq * 7 + causal)
    check_against_oracle(q, k, v, n, is_causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("D,Dv,H,Hkv", [(64, 64, 8, 1), (256, 256, 4, 2), (128, 64, 16, 16)])
def test_decode_head_sizes_and_softcap(D, Dv, H, Hkv):
    q, k, v, n = make_inputs(3, 3, 2100, H, Hkv, D, Dv, jnp.float16, [2100, 1, 1500], seed=D)
    check_against_oracle(q, k, v, n, is_causal=True, softcap=5.0)


@pytest.mark.gpu
def test_decode_deterministic_and_batch_invariant():
    lengths = LENGTHS["mixed"]
    q, k, v, n = make_inputs(len(lengths), 4, 3000, 32, 8, 128, 128, jnp.bfloat16, lengths, seed=1)
    f = jax.jit(lambda q, k, v, n: jax_varlen.attention(q, k, v, n, is_causal=True))
    out = f(q, k, v, n)
    assert bits(out) == bits(f(q, k, v, n))
    # Sequence 4 (n = 3000) alone, and inside a batch padded to a longer cache.
    alone = f(q[4:5], k[4:5], v[4:5], n[4:5])
    assert bits(alone[0]) == bits(out[4])
    pad = lambda x: jnp.concatenate([x, jnp.full((x.shape[0], 900) + x.shape[2:], jnp.nan, x.dtype)], 1)
    wider = f(q[3:5], pad(k[3:5]), pad(v[3:5]), n[3:5])
    assert bits(wider[1]) == bits(out[4])


@pytest.mark.gpu
@pytest.mark.parametrize("Sq", [1, 3])
def test_decode_long_cache(Sq):
    """Over a hundred splits per row (the combine spreads them over its threads and warps)."""
    lengths = [140_000, 70_001, 5]
    q, k, v, n = make_inputs(len(lengths), Sq, 140_000, 4, 1, 64, 64, jnp.bfloat16, lengths,
                             seed=40 + Sq)
    check_against_oracle(q, k, v, n, is_causal=True)
    f = jax.jit(lambda q, k, v, n: jax_varlen.attention(q, k, v, n, is_causal=True,
                                                        return_lse=True))
    both = f(q, k, v, n)
    alone = f(q[1:2], k[1:2], v[1:2], n[1:2])
    assert bits(alone[0][0]) == bits(both[0][1]) and bits(alone[1][0]) == bits(both[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("Sq,window,paged", [(1, None, False), (5, None, False), (3, (700, 0), False),
                                             (1, None, True)],
                         ids=["decode", "spec5", "window", "paged"])
def test_persistent_grid_moves_no_bit(monkeypatch, Sq, window, paged):
    """JAX_VARLEN_SPLIT_PERSISTENT=1 (plan.h; sm80/fwd_split.cuh) walks the split kernel's
    blocks with a persistent grid: bitwise the output and lse of the one-block-per-split grid,
    and the oracle's; last_launch() says which grid ran. 130 sequences of 0, 1, whole chunks, a
    chunk and one, and random key counts: more blocks than the persistent grid has CTAs."""
    rng = np.random.default_rng(Sq)
    lengths = [0, 1, 1024, 1025, 2048, 3072] + [int(x) for x in rng.integers(0, 3073, 124)]
    B, Skv = len(lengths), 3072
    q, k, v, n = make_inputs(B, Sq, Skv, 8, 2, 128, 128, jnp.bfloat16, lengths, seed=Sq)
    kw = dict(is_causal=True, local_window_size=window)
    if paged:  # pages of 64 rows; sequence b's pages stored in reverse order
        pages = Skv // 64
        cache = lambda x: x.reshape(B, pages, 64, *x.shape[2:])[:, ::-1].reshape(B * pages, 64, *x.shape[2:])
        table = (jnp.arange(B)[:, None] * pages + (pages - 1 - jnp.arange(pages))[None]).astype(jnp.int32)
        f = jax.jit(lambda q, n: jax_varlen.paged_attention(q, cache(k), cache(v), table, n,
                                                            return_lse=True, **kw))
    else:
        f = jax.jit(lambda q, n: jax_varlen.attention(q, k, v, n, return_lse=True, **kw))
    results = {}
    for value in "01":  # the handler plans each call: run each to completion
        monkeypatch.setenv("JAX_VARLEN_SPLIT_PERSISTENT", value)
        results[value] = jax.block_until_ready(f(q, n))
        launch = jax_varlen._ffi.extension().last_launch()
        assert launch["split_keys"] > 0 and launch["split_persistent"] == (value == "1")
    assert bits(results["1"][0]) == bits(results["0"][0])
    assert bits(results["1"][1]) == bits(results["0"][1])
    # The float64 oracle on the edge lengths and every 12th other sequence (sequences are
    # independent): all 130 upcast on the CPU is 1.6 GB of keys and values, ~20 s a case.
    sel = np.r_[0:6, 6:B:12]
    hi_out, hi_lse = oracle_hi(q[sel], k[sel], v[sel], n[sel], return_lse=True, **kw)
    assert_out_close(results["1"][0][sel], hi_out, None, jnp.bfloat16)
    assert_lse_close(results["1"][1][sel], hi_lse)
