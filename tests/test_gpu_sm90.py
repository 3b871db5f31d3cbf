"""The Hopper (sm_90a) paths: that they are the kernels that run on a 9.x GPU, for the padded
and the packed front door, forward and backward; the cases only a persistent, heaviest-first
kernel has -- more work units than SMs, so each CTA walks several units of different
sequences, and batches past the sorted limit; and the packed layout on shapes large enough for
several row and key blocks per sequence, sequences that start mid-block, and the dQ workspace's
per-sequence slots.

The oracle matrices of test_forward.py, test_backward.py and test_packed.py (their gpu cases)
run on these paths too (they are the default kernels on Hopper); these tests add what those
matrices cannot reach with their small shapes.
"""

from __future__ import annotations

import gzip
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_varlen
from conftest import (bits, check_against_oracle, cuda_plan, make_inputs, make_packed, packed_cotangents,
                      packed_grads, padded_alone)

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


def _packed_causal_step(lens_q, seed, max_history):
    """A packed causal call (d128, 8 query heads over 2 kv heads, bf16) on sequences of lens_q
    query rows, each with up to max_history cached keys before them: (make, args), where make()
    is a fresh jit of packed_attention with lse (a fresh trace: a switch set since is planned)."""
    rng = np.random.default_rng(seed)
    lens_k = [n + int(rng.integers(0, max_history)) for n in lens_q]
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, H=8, Hkv=2, D=128, Dv=128, dtype=jnp.bfloat16)
    kw = dict(is_causal=True, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    return (lambda: jax.jit(lambda *a: jax_varlen.packed_attention(*a, return_lse=True, **kw))), (q, k, v, cu_q, cu_k)


@pytest.mark.parametrize("mask", ["none", "causal", "window", "causal-window", "softcap-causal",
                                  "causal-query-lengths", "none-query-lengths"])
def test_key_tile_of_the_band(mask):
    """At head dim 128 the plan (ffi/plan/plan.h, fwd_block_n) gives a banded call (causal or
    a local window) a narrower key tile than an unmasked one: each runs the plan's tile (the
    launch says which), against the oracle, on ragged lengths whose diagonals and window edges
    fall mid-tile in either width, over several units per CTA; with query lengths, last row
    blocks of 60 and 5 rows."""
    _hopper()
    kw = {"none": {}, "causal": dict(is_causal=True), "window": dict(local_window_size=(300, 77)),
          "causal-window": dict(is_causal=True, local_window_size=(413, 0)),
          "softcap-causal": dict(is_causal=True, softcap=20.0),
          "causal-query-lengths": dict(is_causal=True, nonpad_q_seqlen=jnp.array([1100, 572, 133], jnp.int32)),
          "none-query-lengths": dict(nonpad_q_seqlen=jnp.array([1100, 572, 133], jnp.int32))}[mask]
    q, k, v, n = make_inputs(3, 1100, 1500, 16, 4, 128, 128, jnp.bfloat16, [1500, 701, 133], seed=5)
    check_against_oracle(q, k, v, n, **kw)
    major = int(str(jax.devices()[0].compute_capability).split(".")[0])
    window_left, window_right = kw.get("local_window_size", (-1, -1))
    band = dict(is_causal=kw.get("is_causal", False), window_left=window_left, window_right=window_right)
    plan = lambda **mask_inputs: cuda_plan(  # noqa: E731  (the padded call: a pack per sequence)
        q[0], k[0], v[0], pack_seqs=1, rows=(1100, 1500), seqlen=(1100, 1500), compute_major=major,
        **mask_inputs)
    tile = plan(**band)["fwd_block_n"]
    assert jax_varlen._ffi.extension().last_launch()["fwd_block_n"] == tile
    # The cases reach both widths: the banded ones a narrower tile than the unmasked call's.
    banded = band["is_causal"] or "local_window_size" in kw
    assert (tile < plan()["fwd_block_n"]) == banded, "the case does not reach the tile it means to"


@pytest.mark.parametrize("layout", ["packed-serving-step-d128", "padded-query-lengths-d64"])
def test_lean_units(layout):
    """Lean units (fwd_sm90.cuh: the unpaged kernels at d64 and d128/128): the producer hands
    each decoded unit to the consumers, and a warpgroup past a unit's rows (pack-GQA decode
    units of 1-3 rows; last row blocks of 60 and 5 rows) only follows the barriers. The launch
    says they ran; out and lse are bitwise the same run after run; the padded call against the
    oracle. (Their first GPU run compared them bitwise with the kernels without them, which
    have since been dropped: benchmarks/NOTES.md, session 2026-12-06 d.)"""
    _hopper()
    if layout.startswith("packed"):
        make, args = _packed_causal_step([1, 700, 3, 1, 60, 2, 129, 1] * 3, seed=29, max_history=3000)
    else:
        q, k, v, n = make_inputs(3, 700, 900, 8, 2, 64, 64, jnp.bfloat16, [900, 400, 133], seed=31)
        n_q = jnp.array([700, 316, 5], jnp.int32)  # last row blocks of 60 (700 - 640), 60, 5 rows
        make = lambda: jax.jit(lambda *a: jax_varlen.attention(  # noqa: E731
            *a, nonpad_q_seqlen=n_q, return_lse=True, is_causal=True))
        args = (q, k, v, n)
    f = make()
    base = f(*args)
    for _ in range(2):
        out, lse = f(*args)
        launch = jax_varlen._ffi.extension().last_launch()
        assert launch["lean_units"] and launch["dynamic_units"]
        assert bits(out) == bits(base[0]) and bits(lse) == bits(base[1])
    if not layout.startswith("packed"):
        check_against_oracle(q, k, v, n, nonpad_q_seqlen=n_q, is_causal=True)


def _switch_case(layout, seed):
    """(make, args, oracle) of one layout of test_plain_tiles_change_no_bit: make() builds the
    jitted call returning (out, lse); oracle() checks a padded layout against the reference.
    Layouts: packed-serving-step-d128 (a packed causal serving step), padded-causal-d64
    (diagonal tiles masked, those below plain), padded-full-d128 (no mask:
    176-key tiles, a partial last tile), packed-window-d128 (documents under a local window:
    masked tiles on both sides of the plain run)."""
    oracle = lambda: None  # noqa: E731
    if layout == "packed-serving-step-d128":
        make, args = _packed_causal_step([1, 700, 3, 1, 60, 2, 129, 1] * 3, seed=seed, max_history=3000)
    elif layout.startswith("padded"):
        causal, D = layout != "padded-full-d128", int(layout.rsplit("-d", 1)[1])
        q, k, v, n = make_inputs(3, 700, 1900, 8, 2, D, D, jnp.bfloat16, [1900, 400, 133], seed=seed)
        make = lambda: jax.jit(lambda *a: jax_varlen.attention(*a, return_lse=True, is_causal=causal))  # noqa: E731
        args = (q, k, v, n)
        oracle = lambda: check_against_oracle(q, k, v, n, is_causal=causal)  # noqa: E731
    else:
        q, k, v, cu_q, cu_k = make_packed([1500, 77, 900], [1500, 77, 900], H=4, Hkv=2, D=128, Dv=128,
                                          dtype=jnp.bfloat16)
        make = lambda: jax.jit(lambda *a: jax_varlen.packed_attention(  # noqa: E731
            *a, max_seqlen_q=1500, max_seqlen_k=1500, is_causal=True, local_window_size=(600, 0),
            return_lse=True))
        args = (q, k, v, cu_q, cu_k)
    return make, args, oracle


@pytest.mark.parametrize("layout", ["packed-serving-step-d128", "padded-causal-d64", "packed-window-d128",
                                    "padded-full-d128"])
def test_plain_tiles_change_no_bit(monkeypatch, layout):
    """The Hopper forward's loop of plain tiles (JAX_VARLEN_FWD_PLAIN, plan.h; fwd_mma.h): the
    launch says it ran; out and lse bitwise those of the single loop (the same arithmetic without
    its branches), on the layouts of _switch_case (the 176-key kernel on padded-full-d128, the
    lean ones on the others); the padded batches against the oracle too."""
    _hopper()
    make, args, oracle = _switch_case(layout, seed=47)
    monkeypatch.setenv("JAX_VARLEN_FWD_PLAIN", "0")
    base = make()(*args)
    launch = jax_varlen._ffi.extension().last_launch()
    assert launch["dynamic_units"] and not launch["fwd_plain_tiles"]
    assert launch["fwd_block_n"] == (176 if layout == "padded-full-d128" else 128)
    monkeypatch.setenv("JAX_VARLEN_FWD_PLAIN", "1")
    out, lse = make()(*args)
    assert jax_varlen._ffi.extension().last_launch()["fwd_plain_tiles"]
    assert bits(out) == bits(base[0]) and bits(lse) == bits(base[1])
    oracle()
    if layout == "padded-full-d128":  # the softcap kernels have no plain loop: the launch says so
        q, k, v, n = args
        jax.block_until_ready(jax_varlen.attention(q, k, v, n, softcap=20.0))
        assert not jax_varlen._ffi.extension().last_launch()["fwd_plain_tiles"]


@pytest.mark.parametrize("case", ["causal-step-d128", "full-step-d128", "softcap-step-d128"])
def test_mixed_order_moves_no_bit(monkeypatch, case):
    """The packed list's mixed order (JAX_VARLEN_FWD_MIXED_ORDER, plan.h; tile_scheduler.h,
    sort_sequences): a serving step of chunks and decode rows (pack-GQA units beside whole
    tiles; 3 x 8 sequences, so the two classes interleave) ranked in either order gives out and
    lse bitwise the same (the default order's are checked against the oracle by
    test_serving_step_walks_only_real_units and test_pack_gqa_serving_step), the launch saying
    which ran: the lean kernel (causal), the 176-key one (no mask) and the softcap one."""
    _hopper()
    lens_q = [1, 700, 3, 1, 60, 2, 129, 1] * 3
    rng = np.random.default_rng(53)
    lens_k = [n + int(rng.integers(0, 3000)) for n in lens_q]
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, H=8, Hkv=2, D=128, Dv=128, dtype=jnp.bfloat16)
    kw = dict(is_causal=case.startswith("causal"), softcap=20.0 if case.startswith("softcap") else 0.0,
              max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    make = lambda: jax.jit(lambda *a: jax_varlen.packed_attention(*a, return_lse=True, **kw))  # noqa: E731
    monkeypatch.delenv("JAX_VARLEN_FWD_MIXED_ORDER", raising=False)
    base = make()(q, k, v, cu_q, cu_k)
    launch = jax_varlen._ffi.extension().last_launch()
    assert launch["pack_gqa"] and not launch["fwd_mixed_order"]
    assert launch["fwd_block_n"] == (128 if kw["is_causal"] else 176)
    monkeypatch.setenv("JAX_VARLEN_FWD_MIXED_ORDER", "1")
    for _ in range(2):  # and the same again: deterministic
        out, lse = make()(q, k, v, cu_q, cu_k)
        assert jax_varlen._ffi.extension().last_launch()["fwd_mixed_order"]
        assert bits(out) == bits(base[0]) and bits(lse) == bits(base[1])


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


def test_packed_runs_the_hopper_kernels(tmp_path):
    """A packed bf16 training step runs fwd_sm90_kernel and bwd_sm90_kernel, not the sm80 ones."""
    _hopper()
    q, k, v, cu_q, cu_k = make_packed([200, 77, 0, 129], [300, 77, 5, 64], H=4, Hkv=2, D=128,
                                      Dv=128, dtype=jnp.bfloat16)
    ct_out, ct_lse = packed_cotangents(q, v)
    fn = lambda: jax.block_until_ready(  # noqa: E731
        packed_grads(q, k, v, cu_q, cu_k, ct_out, ct_lse, is_causal=True))
    trace = _profiled_kernel_names(fn, tmp_path)
    assert b"fwd_sm90_kernel" in trace and b"bwd_sm90_kernel" in trace
    assert b"fwd_tc_kernel" not in trace and b"bwd_dkdv_kernel" not in trace


# Lengths (len_q, len_k) with several 64/128-row blocks, sequences starting mid-block, empty
# ones, len_q != len_k both ways (tail-aligned causal), single rows and keys.
PACKED_LARGE = ([300, 0, 129, 1, 64, 517, 250], [300, 7, 200, 130, 0, 517, 96])


@pytest.mark.parametrize("hints", [False, True], ids=["bounds", "hints"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_packed_equals_padded_bitwise_large(head_dim, causal, hints):
    """Packed (NaN in the unused tail) against each sequence alone through ``attention``: the
    same bits in out, lse and every gradient; zero gradients for rows no query sees (empty
    query runs) and for the tail."""
    _hopper()
    lens_q, lens_k = PACKED_LARGE
    kw = dict(is_causal=causal, softcap=0.0 if causal else 5.0)
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, H=4, Hkv=2, D=head_dim, Dv=head_dim,
                                      dtype=jnp.bfloat16, seed=head_dim + causal)
    ct_out, ct_lse = packed_cotangents(q, v)
    pkw = dict(kw, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k)) if hints else kw
    out, lse = jax.jit(lambda *a: jax_varlen.packed_attention(*a, return_lse=True, **pkw))(
        q, k, v, cu_q, cu_k)
    d_q, d_k, d_v = packed_grads(q, k, v, cu_q, cu_k, ct_out, ct_lse, **pkw)
    assert np.isfinite(np.asarray(d_q, np.float32)).all()
    assert np.isfinite(np.asarray(d_k, np.float32)).all()
    cq, ck = np.asarray(cu_q), np.asarray(cu_k)
    for b in range(len(lens_q)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if lens_q[b] == 0:
            assert not np.asarray(d_k[rk], np.float32).any() and not np.asarray(d_v[rk], np.float32).any()
            continue
        p_out, p_lse, p_dq, p_dk, p_dv = padded_alone(q, k, v, cu_q, cu_k, ct_out, ct_lse, b,
                                                      max(lens_q) if hints else q.shape[0], **kw)
        assert bits(out[rq]) == bits(p_out), f"out of sequence {b}"
        assert bits(lse[:, rq]) == bits(p_lse), f"lse of sequence {b}"
        assert bits(d_q[rq]) == bits(p_dq), f"d_query of sequence {b}"
        assert bits(d_k[rk]) == bits(p_dk), f"d_key of sequence {b}"
        assert bits(d_v[rk]) == bits(p_dv), f"d_value of sequence {b}"
    for g in (d_q[cq[-1]:], d_k[ck[-1]:], d_v[ck[-1]:], out[cq[-1]:]):
        assert not np.asarray(g, np.float32).any()


def test_packed_many_sequences_deterministic_and_batch_invariant():
    """More sequences than the forward sorts in shared memory (400, lengths 0-100): gradients
    bitwise equal across runs, and a sequence's bits do not depend on its pack-mates."""
    _hopper()
    rng = np.random.default_rng(5)
    lens = [int(x) for x in rng.integers(0, 101, size=400)]
    q, k, v, cu_q, cu_k = make_packed(lens, lens, H=2, Hkv=1, D=64, Dv=64, dtype=jnp.bfloat16)
    ct_out, ct_lse = packed_cotangents(q, v)
    kw = dict(is_causal=True, max_seqlen_q=100, max_seqlen_k=100)
    grads = packed_grads(q, k, v, cu_q, cu_k, ct_out, ct_lse, **kw)
    assert [bits(g) for g in grads] == [bits(g) for g in packed_grads(q, k, v, cu_q, cu_k, ct_out, ct_lse, **kw)]
    # Sequences 3 and 4 alone in a pack of two.
    cq, ck = np.asarray(cu_q), np.asarray(cu_k)
    rq, rk = slice(cq[3], cq[5]), slice(ck[3], ck[5])
    sub_cu_q, sub_cu_k = cu_q[3:6] - cu_q[3], cu_k[3:6] - cu_k[3]
    alone = packed_grads(q[rq], k[rk], v[rk], sub_cu_q, sub_cu_k, ct_out[rq], ct_lse[:, rq], **kw)
    assert bits(alone[0]) == bits(grads[0][rq])
    assert bits(alone[1]) == bits(grads[1][rk]) and bits(alone[2]) == bits(grads[2][rk])


def test_serving_step_walks_only_real_units():
    """A continuous-batching step, packed (the forward's work-proportional list, tile_scheduler.h:
    units only for the row blocks a sequence has): a few long chunks, many decode rows, sequences
    with no new token between them, under causal and long key runs. Out and lse against the
    oracle per sequence, and each sequence's bits equal to it alone (batch invariance: the list
    changes with the batch, a sequence's units do not)."""
    _hopper()
    rng = np.random.default_rng(11)
    lens_q = [700, 0, 1, 1, 300, 0, 1, 129, 1, 1] * 4
    lens_k = [int(n) + int(rng.integers(0, 900)) for n in lens_q]
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, H=8, Hkv=2, D=128, Dv=128, dtype=jnp.bfloat16,
                                      seed=3)
    kw = dict(is_causal=True, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    f = jax.jit(lambda *a: jax_varlen.packed_attention(*a, return_lse=True, **kw))
    out, lse = f(q, k, v, cu_q, cu_k)
    assert bits(out) == bits(f(q, k, v, cu_q, cu_k)[0])  # deterministic
    cq, ck = np.asarray(cu_q), np.asarray(cu_k)
    ct_out, ct_lse = packed_cotangents(q, v)
    for b in (0, 2, 4, 7, 36, 37):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        # Against the oracle, through attention on the sequence's own rows ...
        check_against_oracle(q[None, rq], k[None, rk], v[None, rk],
                             jnp.asarray([lens_k[b]], jnp.int32), is_causal=True)
        # ... and alone, on the kernel path the packed call takes: the same bits.
        p_out, p_lse, *_ = padded_alone(q, k, v, cu_q, cu_k, ct_out, ct_lse, b, max(lens_q),
                                        is_causal=True)
        assert bits(out[rq]) == bits(p_out) and bits(lse[:, rq]) == bits(p_lse), f"sequence {b}"


PACK_GQA_CASES = {
    # H, Hkv, D, keywords: a group of 4, a group of 3 (a tile's 128 rows split a query row's
    # heads between two units), a group of 8, MQA; causal or not, sinks, softcap, a window.
    "g4-d128-causal": (8, 2, 128, dict(is_causal=True)),
    "g3-d64-causal-sinks": (6, 2, 64, dict(is_causal=True, sinks=True)),
    "g8-d128-softcap": (16, 2, 128, dict(softcap=20.0)),
    "g4-d64-window": (4, 1, 64, dict(is_causal=True, local_window_size=(40, 0))),
}


@pytest.mark.parametrize("case", PACK_GQA_CASES)
def test_pack_gqa_serving_step(monkeypatch, case):
    """Pack-GQA (plan.h, on unless JAX_VARLEN_PACK_GQA=0; tile_scheduler.h, heads_of): in a
    serving step the sequences shorter than a tile whose group's rows fill fewer tiles packed (decode rows,
    short chunks) take units of a kv head's whole group; the rest keep a unit per query head.
    The launch says it could pack; out and lse of every real row against the float64 oracle,
    within twice the unpacked kernel's error (plus a floor); deterministic; each sequence's bits
    the same alone in a packed call (its packing depends on its own query rows only)."""
    _hopper()
    from conftest import assert_lse_close, assert_out_close

    H, Hkv, D, kw = PACK_GQA_CASES[case]
    kw = dict(kw)
    rng = np.random.default_rng(17)
    lens_q = [700, 1, 0, 3, 31, 1, 96, 97, 1, 17, 1, 128] * 3
    lens_k = [n + int(rng.integers(0, 900)) for n in lens_q]
    q, k, v, cu_q, cu_k = make_packed(lens_q, lens_k, H=H, Hkv=Hkv, D=D, Dv=D, dtype=jnp.bfloat16, seed=5)
    if kw.pop("sinks", False):
        kw["sinks"] = jnp.asarray(rng.uniform(-1.0, 3.0, H), jnp.float32)
    hints = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))

    def run(q, k, v, cu_q, cu_k):
        return jax.jit(lambda *a: jax_varlen.packed_attention(*a, return_lse=True, **hints, **kw))(
            q, k, v, cu_q, cu_k)

    monkeypatch.setenv("JAX_VARLEN_PACK_GQA", "0")
    base_out, _ = run(q, k, v, cu_q, cu_k)
    assert not jax_varlen._ffi.extension().last_launch()["pack_gqa"]
    monkeypatch.delenv("JAX_VARLEN_PACK_GQA")
    out, lse = run(q, k, v, cu_q, cu_k)
    ran = jax_varlen._ffi.extension().last_launch()
    assert ran["fwd_path"] == "sm90_one_pass" and ran["pack_gqa"], ran
    assert bits(out) == bits(run(q, k, v, cu_q, cu_k)[0])  # deterministic

    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True):
        args = [jax.device_put(np.asarray(x, np.float64), cpu) for x in (q, k, v)]
        cus = [jax.device_put(np.asarray(c), cpu) for c in (cu_q, cu_k)]
        ref_kw = {**kw, "sinks": jax.device_put(np.asarray(kw["sinks"]), cpu)} if "sinks" in kw else kw
        hi_out, hi_lse = jax_varlen.packed_reference(*args, *cus, return_lse=True, **ref_kw)
    end = int(np.asarray(cu_q)[-1])
    assert_out_close(out[:end], np.asarray(hi_out)[:end], base_out[:end], jnp.bfloat16)
    assert_lse_close(lse[:, :end], np.asarray(hi_lse)[:, :end])
    assert not np.asarray(out[end:], np.float32).any()

    # Alone: a pack of one sequence, NaN rows after it up to the hints (the same plan).
    cq, ck = np.asarray(cu_q), np.asarray(cu_k)
    nan_rows = lambda x, rows: jnp.concatenate(  # noqa: E731
        [x, jnp.full((rows - x.shape[0],) + x.shape[1:], jnp.nan, x.dtype)])
    for b in (1, 4, 6, 7, 11):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        sub = [jnp.asarray([0, lens_q[b]], jnp.int32), jnp.asarray([0, lens_k[b]], jnp.int32)]
        a_out, a_lse = run(nan_rows(q[rq], max(lens_q)), nan_rows(k[rk], max(lens_k)),
                           nan_rows(v[rk], max(lens_k)), *sub)
        n = lens_q[b]
        assert bits(a_out[:n]) == bits(out[rq]) and bits(a_lse[:, :n]) == bits(lse[:, rq]), f"sequence {b}"


@pytest.mark.parametrize("layout", ["packed-serving-step", "padded-causal"])
def test_dynamic_units_are_deterministic(layout):
    """Dynamic units (fwd_sm90.cuh UnitSource: CTAs take units from a counter in the forward's
    workspace, zeroed before every launch) move units between CTAs by timing, never what a unit
    computes: out and lse bitwise the same run after run, and the launch says they ran. (Their
    first GPU run compared them bitwise with the static snake, since dropped but for paged
    calls: benchmarks/NOTES.md.)"""
    _hopper()
    if layout == "packed-serving-step":
        make, args = _packed_causal_step([700, 1, 0, 3, 31, 1, 96, 129, 1, 17] * 4, seed=23, max_history=2000)
    else:
        q, k, v, n = make_inputs(4, 1000, 1000, 8, 2, 64, 64, jnp.bfloat16, [1000, 3, 517, 0])
        make = lambda: jax.jit(lambda *a: jax_varlen.attention(*a, return_lse=True, is_causal=True))  # noqa: E731
        args = (q, k, v, n)
    f = make()
    base = f(*args)
    for _ in range(3):
        out, lse = f(*args)
        assert jax_varlen._ffi.extension().last_launch()["dynamic_units"]
        assert bits(out) == bits(base[0]) and bits(lse) == bits(base[1])
    if layout == "padded-causal":
        check_against_oracle(q, k, v, n, is_causal=True)
