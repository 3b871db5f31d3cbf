"""The CUDA call's plan (ffi/plan/plan.h) through the extension's ``plan()``, on any machine (the
CPU-only build exports it too): the path a call takes, its head-dim bucket and the size of every
workspace; and that lowering for CUDA from this machine gives the FFI calls exactly the plan's
workspaces (the CUDA handler rejects any other size).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import jax_varlen
from jax_varlen import _ffi

SPLIT_DTYPES = ["float16", "bfloat16"]


def plan(dtype="bfloat16", Sq=4, Skv=2100, H=8, Hkv=2, D=128, Dv=None, **kw):
    """The plan of a padded call [B, Sq, H, D] x [B, Skv, Hkv, D] (a pack per sequence); ``kw``
    overrides any input (packed: pack_seqs, pack_rows_q/k; num_packs, compute_major)."""
    inputs = dict(dtype=dtype, pack_seqs=1, pack_rows_q=Sq, pack_rows_k=Skv, seqlen_q=Sq,
                  seqlen_k=Skv, num_heads=H, kv_num_heads=Hkv, head_dim=D,
                  head_dim_v=D if Dv is None else Dv)
    result = _ffi.extension().plan(**{**inputs, **kw})
    assert result["unsupported"] == "", result["unsupported"]
    return result


def workspaces(p):
    return p["fwd_workspace_per_pack"], p["dq_workspace_per_pack"]


def split_limit(dtype):
    """The longest query extent that takes split-KV, found by asking (up to 256 rows)."""
    split = [Sq for Sq in range(1, 257) if plan(dtype, Sq=Sq)["split_keys"] > 0]
    assert split, f"no query extent takes split-KV in {dtype}"
    return max(split)


# --------------------------------------------------------------------------------------------
# The forward's path and its split-KV workspace.


@pytest.mark.parametrize("dtype", SPLIT_DTYPES)
def test_split_kv_for_short_queries_in_16_bit(dtype):
    """Every query extent up to one limit (the same in f16 and bf16) takes split-KV with one
    chunk size whatever the keys and the batch; every longer one the one-pass kernels."""
    limit = split_limit(dtype)
    assert limit == split_limit("float16")
    chunks = {plan(dtype, Sq=Sq, Skv=Skv, num_packs=packs)["split_keys"]
              for Sq in range(1, limit + 1) for Skv in (0, 1, 5000) for packs in (1, 777)}
    assert len(chunks) == 1 and chunks.pop() > 0
    for major in (0, 8, 9):
        assert plan(dtype, Sq=limit, compute_major=major)["fwd_path"] == "sm80_split"
        long = plan(dtype, Sq=limit + 1, compute_major=major)
        assert long["split_keys"] == 0 and long["fwd_workspace_per_pack"] == 1  # the unit counter
        assert long["fwd_path"] in ("sm80_one_pass", "sm90_one_pass")
    for Sq in range(limit + 1, 4 * limit):
        assert plan(dtype, Sq=Sq)["split_keys"] == 0


def test_split_chunk_knob(monkeypatch):
    """JAX_VARLEN_SPLIT_KEYS (a benchmark knob) sets the chunk to a multiple of 128 keys in
    [128, 8192], and the workspace follows it; any other value keeps the default."""
    default = plan(Skv=4100)
    for value, want in (("2048", 2048), ("128", 128), ("8192", 8192), ("100", None),
                        ("1000", None), ("16384", None), ("2048x", None), ("", None)):
        monkeypatch.setenv("JAX_VARLEN_SPLIT_KEYS", value)
        got = plan(Skv=4100)
        assert got["split_keys"] == (want or default["split_keys"]), value
        chunks = -(-4100 // got["split_keys"])  # partials: [Hkv, chunks, 16 rows] of Dv + 1,
        # then a counter per (kv head, row block)
        assert got["fwd_workspace_per_pack"] == 2 * chunks * 16 * (128 + 1) + 2, value


def test_split_persistent_knob(monkeypatch):
    """JAX_VARLEN_SPLIT_PERSISTENT=1 (an experiment) puts a split-KV call's kernel on a
    persistent grid; anything else keeps the one-block-per-split grid; it sizes no workspace and
    leaves a call that is not split-KV alone."""
    default = plan(Sq=1)
    assert default["split_keys"] > 0 and not default["split_persistent"]
    for value, want in (("1", True), ("0", False), ("", False), ("yes", False)):
        monkeypatch.setenv("JAX_VARLEN_SPLIT_PERSISTENT", value)
        got = plan(Sq=1)
        assert got["split_persistent"] == want, value
        assert workspaces(got) == workspaces(default), value
    monkeypatch.setenv("JAX_VARLEN_SPLIT_PERSISTENT", "1")
    assert not plan(Sq=300)["split_persistent"]  # one pass: nothing to put on the grid


def test_forward_plain_tiles_knob(monkeypatch):
    """JAX_VARLEN_FWD_PLAIN (a benchmark knob) turns the Hopper forward's loop of plain tiles on (1)
    or off (0); any other value keeps the default; it sizes no workspace. Only unpaged one-pass
    calls at head dim 64 and 128 get it (every key tile width there)."""
    lean = dict(Sq=300, compute_major=9, is_causal=True)
    if not _ffi.extension().with_sm90:
        monkeypatch.setenv("JAX_VARLEN_FWD_PLAIN", "1")
        assert not plan(**lean)["fwd_plain_tiles"]
        return
    default = plan(**lean)
    assert default["lean_units"]
    for value, want in (("1", True), ("0", False), ("2", None), ("", None), ("on", None)):
        monkeypatch.setenv("JAX_VARLEN_FWD_PLAIN", value)
        got = plan(**lean)
        assert got["fwd_plain_tiles"] == (default["fwd_plain_tiles"] if want is None else want), value
        assert workspaces(got) == workspaces(default), value
    monkeypatch.setenv("JAX_VARLEN_FWD_PLAIN", "1")
    assert plan(Sq=300, D=64, compute_major=9)["fwd_plain_tiles"]  # d64: lean at any band
    unmasked = plan(Sq=300, compute_major=9)  # d128 unmasked: 176-key tiles, not lean
    assert unmasked["fwd_plain_tiles"] and unmasked["fwd_block_n"] == 176 and not unmasked["lean_units"]
    monkeypatch.setenv("JAX_VARLEN_PAGED_SM90", "1")
    paged = plan(Sq=300, compute_major=9, page_size=64)  # gathered tiles, the single loop
    assert paged["fwd_path"] == "sm90_one_pass" and not paged["fwd_plain_tiles"]
    assert not plan(Sq=300, D=256, compute_major=9, is_causal=True)["fwd_plain_tiles"]
    assert not plan(Sq=300, compute_major=8, is_causal=True)["fwd_plain_tiles"]  # the sm80 kernels
    assert not plan(Sq=4, compute_major=9, is_causal=True)["fwd_plain_tiles"]  # split-KV


def test_forward_mixed_order_knob(monkeypatch):
    """JAX_VARLEN_FWD_MIXED_ORDER=1 (an experiment, off by default) gives the Hopper forward's
    calls the mixed order of the packed list (a padded call's list ignores it); any other value,
    or another path (the sm80 kernels, split-KV), keeps the ranking by keys; it sizes no
    workspace."""
    gqa = dict(Sq=300, compute_major=9, is_causal=True)
    monkeypatch.delenv("JAX_VARLEN_FWD_MIXED_ORDER", raising=False)
    default = plan(**gqa)
    assert not default["fwd_mixed_order"]
    monkeypatch.setenv("JAX_VARLEN_FWD_MIXED_ORDER", "1")
    got = plan(**gqa)
    assert got["fwd_mixed_order"] == (got["fwd_path"] == "sm90_one_pass") == _ffi.extension().with_sm90
    assert workspaces(got) == workspaces(default)
    if _ffi.extension().with_sm90:  # every bucket, any mask, with or without a group
        assert plan(Sq=300, D=256, H=8, Hkv=8, compute_major=9)["fwd_mixed_order"]
    assert not plan(Sq=300, compute_major=8)["fwd_mixed_order"]  # the sm80 kernels
    assert not plan(Sq=4, compute_major=9)["fwd_mixed_order"]  # split-KV
    for value in ("0", "2", "", "on"):
        monkeypatch.setenv("JAX_VARLEN_FWD_MIXED_ORDER", value)
        assert not plan(**gqa)["fwd_mixed_order"], value


@pytest.mark.parametrize("case", ["float32", "odd-head-dim", "odd-value-head-dim"])
def test_portable_calls_take_no_workspace(case):
    """Float32 and head sizes off the multiples of 8 run the portable kernels at any query
    extent and on any device: no split-KV, no workspace."""
    kw = {"float32": dict(dtype="float32"), "odd-head-dim": dict(D=60, Dv=64),
          "odd-value-head-dim": dict(D=64, Dv=36)}[case]
    for Sq in (1, 4, 300):
        for major in (0, 8, 9):
            p = plan(Sq=Sq, compute_major=major, **kw)
            assert (p["fwd_path"], p["bwd_path"], p["split_keys"]) == ("portable", "portable", 0)
            assert workspaces(p) == (0, 0) and p["bwd_block_m"] == 0


def test_one_pass_workspace_is_the_unit_counter():
    """Calls the Hopper forward could take get one word per pack for its unit counter (dynamic
    units), whatever the device and the build; portable calls none. Dynamic units are every
    unpaged Hopper call's, never another path's nor a paged call's."""
    for major in (0, 8, 9):
        p = plan(Sq=300, compute_major=major)
        assert p["fwd_workspace_per_pack"] == 1
        # compute_major 0 (the lowering's: the device is unknown) plans the best path built
        assert p["dynamic_units"] == (major in (0, 9) and _ffi.extension().with_sm90)
    assert plan(Sq=300, dtype="float32")["fwd_workspace_per_pack"] == 0
    assert plan(Sq=300, Skv=0)["fwd_workspace_per_pack"] == 0  # no key row: never the Hopper path
    assert not plan(Sq=4, compute_major=9)["dynamic_units"]  # split-KV


def test_hopper_key_tile_follows_the_band(monkeypatch):
    """The Hopper forward's keys per tile (fwd_block_n): the bucket's widest (128, 176, 80 at
    64, 128, 256) for an unmasked call; at bucket 128 a banded one -- causal, or any side of a
    local window -- takes 128, which lines up with the 128-row query tile. No workspace changes
    with it; other paths say 0; a paged call keeps the widest."""
    if not _ffi.extension().with_sm90:
        assert plan(Sq=300, compute_major=9, is_causal=True)["fwd_block_n"] == 0
        return
    widest = {64: 128, 128: 176, 256: 80}
    for D, w in widest.items():
        assert plan(Sq=300, D=D, compute_major=9)["fwd_block_n"] == w
        for band in (dict(is_causal=True), dict(window_left=100), dict(window_right=0),
                     dict(is_causal=True, window_left=4096, window_right=0)):
            p = plan(Sq=300, D=D, compute_major=9, **band)
            assert p["fwd_block_n"] == (128 if D == 128 else w), (D, band)
            assert workspaces(p) == workspaces(plan(Sq=300, D=D, compute_major=9))
    assert plan(Sq=300, D=120, Dv=72, compute_major=9, is_causal=True)["fwd_block_n"] == 128  # bucket 128
    assert plan(Sq=300, compute_major=8, is_causal=True)["fwd_block_n"] == 0
    assert plan(Sq=4, compute_major=9, is_causal=True)["fwd_block_n"] == 0  # split-KV
    assert plan(Sq=300, dtype="float32", compute_major=9, is_causal=True)["fwd_block_n"] == 0
    monkeypatch.setenv("JAX_VARLEN_PAGED_SM90", "1")
    assert plan(Sq=300, Skv=2048, page_size=64, compute_major=9, is_causal=True)["fwd_block_n"] == 176


def test_lean_units_where_the_kernels_have_them(monkeypatch):
    """Lean units: every dynamic-units call on a kernel that carries them -- d64, and d128 with
    the banded calls' 128-key tile, never d128's 176-key tile or d256 -- and no other. They
    change no workspace."""
    sm90 = _ffi.extension().with_sm90
    for D, causal, lean in ((64, False, True), (128, True, True), (128, False, False), (256, True, False)):
        p = plan(Sq=300, D=D, compute_major=9, is_causal=causal)
        assert p["lean_units"] == (sm90 and lean), (D, causal)
        assert workspaces(p) == workspaces(plan(Sq=300, D=D, compute_major=9))
    assert not plan(Sq=300, compute_major=8, is_causal=True)["lean_units"]
    assert not plan(Sq=4, compute_major=9, is_causal=True)["lean_units"]  # split-KV
    if sm90:  # a paged call on the Hopper forward (a build without it cannot plan one): static units
        monkeypatch.setenv("JAX_VARLEN_PAGED_SM90", "1")
        p = plan(Sq=300, Skv=2048, page_size=64, compute_major=9, is_causal=True)
        assert not p["lean_units"] and not p["dynamic_units"]


@pytest.mark.parametrize("Sq,Skv,D", [(4, 2100, 128), (300, 700, 64), (1, 9000, 256), (40, 40, 128)])
def test_workspaces_grow_by_their_per_seq_with_each_sequence(Sq, Skv, D):
    """The plan's per_seq is each workspace's growth per sequence of a pack, exactly (the
    lowering of a symbolic number of sequences sizes the workspaces with it, _primitive.py):
    packs of 1 to 6 sequences of the same extents."""
    base = plan(Sq=Sq, Skv=Skv, D=D, pack_rows_q=6 * Sq, pack_rows_k=6 * Skv)
    assert base["fwd_workspace_per_seq"] >= 0 and base["dq_workspace_per_seq"] > 0
    for seqs in range(1, 7):
        got = plan(Sq=Sq, Skv=Skv, D=D, pack_seqs=seqs, pack_rows_q=6 * Sq, pack_rows_k=6 * Skv)
        for name in ("fwd", "dq"):
            want = base[f"{name}_workspace_per_pack"] + (seqs - 1) * base[f"{name}_workspace_per_seq"]
            assert got[f"{name}_workspace_per_pack"] == want, (name, seqs)


def test_split_workspace_size():
    """Per sequence, one float32 partial per (kv head, chunk of keys, padded query row), each
    head_dim_v + 1 floats (output and lse), then one int32 arrival counter per (kv head, 16-row
    block of packed rows): a second chunk doubles the partials but not the counters, a
    sequence more in the pack adds as much again, and with no query or key row it is empty."""
    chunk = plan(Sq=4)["split_keys"]
    # H = 8, Hkv = 2: 4 query rows x 4 heads = 16 packed rows, one row block per kv head.
    rows, counters = 2 * 16, 2
    one = plan(Sq=4, Skv=chunk, Dv=64)["fwd_workspace_per_pack"]
    assert one == rows * 65 + counters
    assert plan(Sq=4, Skv=chunk + 1, Dv=64)["fwd_workspace_per_pack"] == 2 * rows * 65 + counters
    assert plan(Sq=4, Skv=chunk, Dv=128)["fwd_workspace_per_pack"] == rows * 129 + counters
    packed = plan(Sq=4, Skv=chunk, Dv=64, pack_seqs=3, pack_rows_q=40, pack_rows_k=3 * chunk)
    assert packed["fwd_workspace_per_pack"] == 3 * one
    assert plan(Sq=0)["fwd_workspace_per_pack"] == 0
    assert plan(Skv=0)["fwd_workspace_per_pack"] == 0
    # Rows are padded: one query row and a whole padded block take the same room.
    assert plan(Sq=1, Hkv=8)["fwd_workspace_per_pack"] == plan(Sq=2, Hkv=8)[
        "fwd_workspace_per_pack"]


# --------------------------------------------------------------------------------------------
# The backward's path and its dQ workspace.


@pytest.mark.parametrize("dtype", SPLIT_DTYPES)
def test_dq_workspace_by_bucket(dtype):
    """The Hopper backward's dQ workspace is sized at every bucket (64, 128, 256), not without a
    query or a key row; its per-pack size is num_heads x slots x (a tile of bwd_block_m x bucket
    floats + a counter), and a sequence-order entry per sequence."""
    taken = ((64, 64, 64), (48, 64, 64), (128, 72, 128), (96, 128, 128), (256, 256, 256), (64, 136, 256))
    for D, Dv, bucket in taken:
        p = plan(dtype, Sq=300, D=D, Dv=Dv)
        assert p["head_dim_bucket"] == bucket and p["bwd_block_m"] == (128 if bucket == 64 else 64)
        unit = p["bwd_block_m"] * bucket + 1
        assert p["dq_workspace_per_pack"] > 1 and (p["dq_workspace_per_pack"] - 1) % (8 * unit) == 0
    for kw in (dict(Sq=0), dict(Skv=0)):
        p = plan(dtype, **{"Sq": 300, **kw})
        assert p["dq_workspace_per_pack"] == 0 and p["bwd_block_m"] == 0
        assert p["bwd_path"] == "sm80"


def test_dq_workspace_packed():
    """A pack of B sequences keeps each sequence's row blocks in slots of their own: B - 1 slots
    more per head than one sequence over the same rows, and 3 more sequence-order entries."""
    one = plan(Sq=300, pack_rows_q=300, pack_seqs=1)
    four = plan(Sq=100, pack_rows_q=300, pack_seqs=4, seqlen_q=100)
    unit = one["bwd_block_m"] * one["head_dim_bucket"] + 1
    assert four["dq_workspace_per_pack"] - one["dq_workspace_per_pack"] == 3 * 8 * unit + 3


# --------------------------------------------------------------------------------------------
# The device: paths change with the compute capability, workspaces never do.


@pytest.mark.parametrize("Sq", [4, 300])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_paths_by_compute_capability(Sq, D):
    by_major = {major: plan(Sq=Sq, D=D, compute_major=major) for major in (0, 7, 8, 9, 10)}
    assert len({workspaces(p) for p in by_major.values()}) == 1
    assert (by_major[7]["fwd_path"], by_major[7]["bwd_path"]) == ("portable", "portable")
    for major in (8, 10):
        assert by_major[major]["fwd_path"] == ("sm80_split" if Sq == 4 else "sm80_one_pass")
        assert by_major[major]["bwd_path"] == "sm80"
    hopper = by_major[9]
    if _ffi.extension().with_sm90:
        assert hopper["fwd_path"] == ("sm80_split" if Sq == 4 else "sm90_one_pass")
        assert hopper["bwd_path"] == "sm90"
    else:
        assert (hopper["fwd_path"], hopper["bwd_path"]) == (by_major[8]["fwd_path"], "sm80")
    best = 9 if _ffi.extension().with_sm90 else 8
    assert by_major[0] == by_major[best]


def test_pack_gqa_by_default_on_hopper(monkeypatch):
    """Pack-GQA (Plan::pack_gqa) for the Hopper forward of a call with a group, unless
    JAX_VARLEN_PACK_GQA=0; it sizes no workspace and changes no path."""
    monkeypatch.delenv("JAX_VARLEN_PACK_GQA", raising=False)
    on = plan(Sq=300, compute_major=9)
    assert on["pack_gqa"] == _ffi.extension().with_sm90
    assert not plan(Sq=300, H=8, Hkv=8, compute_major=9)["pack_gqa"]  # no group to pack
    assert not plan(Sq=4, compute_major=9)["pack_gqa"]  # split-KV (its own kernel packs)
    assert not plan(Sq=300, compute_major=8)["pack_gqa"]
    monkeypatch.setenv("JAX_VARLEN_PACK_GQA", "0")
    off = plan(Sq=300, compute_major=9)
    assert not off["pack_gqa"] and {**on, "pack_gqa": False} == off


def test_hopper_needs_a_key_row():
    p = plan(Sq=300, Skv=0, compute_major=9)
    assert (p["fwd_path"], p["bwd_path"]) == ("sm80_one_pass", "sm80")


def test_packed_is_padded_with_packs():
    """A pack of one sequence over all its rows is the padded call; the packed layout's
    max_seqlen_q hint (not its rows) decides split-KV."""
    assert plan(Sq=300, pack_seqs=1, seqlen_q=300) == plan(Sq=300)
    limit = split_limit("bfloat16")
    hinted = plan(Sq=300, pack_seqs=5, seqlen_q=limit)
    assert hinted["split_keys"] > 0 and hinted["fwd_workspace_per_pack"] > 0
    assert plan(Sq=300, pack_seqs=5, seqlen_q=limit + 1)["split_keys"] == 0


@pytest.mark.parametrize(
    "kw, match",
    [(dict(head_dim=257), r"head sizes up to 256; got query/key head size 257 and value head "
                          r"size 128"),
     (dict(head_dim_v=320), r"head sizes up to 256; got query/key head size 128 and value head "
                            r"size 320"),
     (dict(kv_num_heads=70000, num_heads=70000), r"up to 65535 sequences and kv heads; got 1 "
                                                  r"sequences and 70000 kv heads"),
     (dict(pack_seqs=70000, pack_rows_q=70000), r"got 70000 sequences"),
     (dict(kv_num_heads=3), r"kv_num_heads must divide num_heads"),
     (dict(seqlen_q=5, pack_rows_q=4), r"seqlen_q/k <= pack_rows_q/k")],
)
def test_unsupported_calls(kw, match):
    inputs = dict(dtype="bfloat16", pack_seqs=1, pack_rows_q=4, pack_rows_k=16, seqlen_q=4,
                  seqlen_k=16, num_heads=8, kv_num_heads=2, head_dim=128, head_dim_v=128)
    p = _ffi.extension().plan(**{**inputs, **kw})
    assert re.search(match, p["unsupported"]), p["unsupported"]
    assert set(p) == {"unsupported"}


def test_unknown_dtype():
    with pytest.raises(ValueError, match="float64"):
        plan("float64")


# --------------------------------------------------------------------------------------------
# Lowering for CUDA on this machine: the FFI calls carry the plan's workspaces.


@pytest.fixture
def cuda_lowering(monkeypatch):
    """Lowering for CUDA as a CUDA build would (the lowering only asks the plan; a CPU-only
    build refuses it otherwise)."""
    monkeypatch.setattr(_ffi, "has_cuda", lambda: True)


def _custom_call_results(text: str, target: str) -> list[str]:
    """The result types of the one custom call to ``target`` in a StableHLO module's text."""
    calls = [line for line in text.splitlines() if f"custom_call @{target}(" in line]
    assert len(calls) == 1, f"{len(calls)} calls to {target}"
    results = calls[0].rsplit("->", 1)[1]
    return re.findall(r"tensor<[^>]*>", results)


def _export_for_cuda(fn, *specs):
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=jax_varlen.export_disabled_checks())(*specs)
    return exported.mlir_module()


def _train_step(attn):
    """Out and the gradients of sum(out) with respect to q, k, v: both FFI calls."""
    def step(q, k, v, *lengths):
        f = lambda q, k, v: attn(q, k, v, *lengths)  # noqa: E731
        out, pullback = jax.vjp(f, q, k, v)
        return out, pullback(jnp.ones_like(out))

    return step


LOWERING_CASES = {  # dtype, Sq, Skv, H, Hkv, D, Dv
    "bf16-split": ("bfloat16", 4, 2100, 8, 2, 128, 128),
    "f16-one-pass-d64": ("float16", 300, 700, 4, 4, 64, 64),
    "bf16-d256": ("bfloat16", 37, 100, 4, 1, 256, 128),
    "f32": ("float32", 4, 100, 2, 1, 64, 64),
}


@pytest.mark.parametrize("case", list(LOWERING_CASES))
@pytest.mark.parametrize("batch", ["static", "symbolic"])
def test_padded_lowering_carries_the_plans_workspaces(cuda_lowering, case, batch):
    dtype, Sq, Skv, H, Hkv, D, Dv = LOWERING_CASES[case]
    B = 3 if batch == "static" else jax.export.symbolic_shape("b")[0]
    shapes = ((B, Sq, H, D), (B, Skv, Hkv, D), (B, Skv, Hkv, Dv))
    specs = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    specs.append(jax.ShapeDtypeStruct((B,), jnp.int32))
    text = _export_for_cuda(_train_step(jax_varlen.attention), *specs)
    p = plan(dtype, Sq=Sq, Skv=Skv, H=H, Hkv=Hkv, D=D, Dv=Dv)
    lead = "3" if batch == "static" else "?"
    fwd = _custom_call_results(text, _ffi.CUDA_TARGET)
    bwd = _custom_call_results(text, _ffi.BWD_CUDA_TARGET)
    assert len(fwd) == 3 and len(bwd) == 5  # out, lse, workspace; grads, delta, workspace
    assert fwd[-1] == f"tensor<{lead}x{p['fwd_workspace_per_pack']}xf32>"
    assert bwd[-1] == f"tensor<{lead}x{p['dq_workspace_per_pack']}xf32>"
    assert "split_keys" not in text  # the handler takes it from its own plan


@pytest.mark.parametrize("hints", [False, True], ids=["bounds", "hints"])
def test_packed_lowering_carries_the_plans_workspaces(cuda_lowering, hints):
    """packed_attention [T, H, D] with 5 sequences: one pack, the hints' grids."""
    Tq, Tk, H, Hkv, D = 200, 3000, 4, 2, 64
    shapes = ((Tq, H, D), (Tk, Hkv, D), (Tk, Hkv, D))
    specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    specs += [jax.ShapeDtypeStruct((6,), jnp.int32)] * 2
    kw = dict(max_seqlen_q=4, max_seqlen_k=1500) if hints else {}
    text = _export_for_cuda(_train_step(functools.partial(jax_varlen.packed_attention, **kw)),
                            *specs)
    p = plan(Sq=Tq, Skv=Tk, H=H, Hkv=Hkv, D=D, pack_seqs=5,
             seqlen_q=kw.get("max_seqlen_q", Tq), seqlen_k=kw.get("max_seqlen_k", Tk))
    assert (p["split_keys"] > 0) == hints
    fwd = _custom_call_results(text, _ffi.PACKED_CUDA_TARGET)
    bwd = _custom_call_results(text, _ffi.PACKED_BWD_CUDA_TARGET)
    assert fwd[-1] == f"tensor<1x{p['fwd_workspace_per_pack']}xf32>"
    assert bwd[-1] == f"tensor<1x{p['dq_workspace_per_pack']}xf32>"


def test_lowering_refuses_what_the_plan_refuses(cuda_lowering):
    q = jax.ShapeDtypeStruct((2, 8, 2, 300), jnp.bfloat16)
    n = jax.ShapeDtypeStruct((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"head sizes up to 256; got query/key head size 300"):
        _export_for_cuda(jax_varlen.attention, q, q, q, n)


# --------------------------------------------------------------------------------------------
# Paged caches (page_size > 0): the split-KV kernel reads pages in place (and the Hopper forward
# under JAX_VARLEN_PAGED_SM90=1).


@pytest.mark.parametrize("page_size", [16, 32, 64, 256])
def test_paged_plan_is_the_split_plan(page_size):
    """A paged call in place is the padded call over max_pages * page_size keys on the split-KV
    path (the same workspace), with no backward (forward only)."""
    extent = 40 * page_size
    paged = plan(Sq=1, Skv=extent, page_size=page_size)
    assert plan(Sq=1, Skv=extent, page_size=page_size, packed_queries=True) == paged  # one per sequence
    dense = plan(Sq=1, Skv=extent)
    assert paged["fwd_path"] == "sm80_split" and paged["split_keys"] == dense["split_keys"] > 0
    assert paged["fwd_workspace_per_pack"] == dense["fwd_workspace_per_pack"]
    assert paged["dq_workspace_per_pack"] == 0 and paged["bwd_block_m"] == 0


@pytest.mark.parametrize(
    "kw, got",
    [(dict(page_size=8), "got 1 queries per sequence, head sizes 128 and 128, page_size 8"),
     (dict(page_size=24), "page_size 24"),
     (dict(page_size=16, seqlen_q=17, pack_rows_q=17), "got 17 queries per sequence"),
     (dict(page_size=16, dtype="float32"), "page_size 16"),
     (dict(page_size=16, head_dim=36, head_dim_v=36), "head sizes 36 and 36"),
     (dict(page_size=16, seqlen_q=2, pack_rows_q=2, packed_queries=True), "got 2 queries per sequence")])
def test_paged_plan_refuses_what_the_kernel_cannot_read(kw, got):
    """Pages of a size not a multiple of 16, longer query runs, float32, odd head sizes, or
    packed query runs padded to more than one row (the kernel has no per-sequence query
    counts): the plan says why (paged_attention then gathers the pages instead)."""
    inputs = dict(dtype="bfloat16", pack_seqs=1, pack_rows_q=1, pack_rows_k=1600, seqlen_q=1,
                  seqlen_k=1600, num_heads=8, kv_num_heads=2, head_dim=128, head_dim_v=128)
    p = _ffi.extension().plan(**{**inputs, **kw})
    assert "the paged kernel (split-KV) takes" in p["unsupported"], p
    assert got in p["unsupported"]


def test_paged_chunks_on_hopper_are_a_switch(monkeypatch):
    """Paged calls with more than 16 queries per sequence: refused (paged_attention gathers)
    unless JAX_VARLEN_PAGED_SM90=1, which plans them on the Hopper forward, in place, with only
    the unit counter's workspace word and no backward; an sm80 device still refuses them."""
    monkeypatch.delenv("JAX_VARLEN_PAGED_SM90", raising=False)
    assert "the paged kernel" in _ffi.extension().plan(
        dtype="bfloat16", pack_seqs=1, pack_rows_q=64, pack_rows_k=640, seqlen_q=64, seqlen_k=640,
        num_heads=8, kv_num_heads=2, head_dim=128, head_dim_v=128, page_size=16,
        compute_major=9)["unsupported"]
    monkeypatch.setenv("JAX_VARLEN_PAGED_SM90", "1")
    inputs = dict(dtype="bfloat16", pack_seqs=1, pack_rows_q=64, pack_rows_k=640, seqlen_q=64,
                  seqlen_k=640, num_heads=8, kv_num_heads=2, head_dim=128, head_dim_v=128,
                  page_size=16)
    on9 = _ffi.extension().plan(**inputs, compute_major=9)
    if _ffi.extension().with_sm90:
        assert on9["unsupported"] == "" and on9["fwd_path"] == "sm90_one_pass"
        assert (on9["fwd_workspace_per_pack"], on9["dq_workspace_per_pack"]) == (1, 0)  # the unit counter
        assert "page_size 24" in _ffi.extension().plan(**{**inputs, "page_size": 24},
                                                       compute_major=9)["unsupported"]
    else:
        assert "the paged kernel" in on9["unsupported"]
    assert "the paged kernel" in _ffi.extension().plan(**inputs, compute_major=8)["unsupported"]


def test_paged_and_sinks_lowerings_carry_the_plans_workspace(cuda_lowering):
    """paged_attention in place lowers to the paged target with the split plan's workspace;
    attention with sinks to the sinks target, with the workspace of the same call without."""
    B, H, Hkv, D, P, ps, max_pages = 3, 8, 2, 128, 50, 32, 12
    q = jax.ShapeDtypeStruct((B, 1, H, D), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((P, ps, Hkv, D), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((B, max_pages), jnp.int32)
    n = jax.ShapeDtypeStruct((B,), jnp.int32)
    text = _export_for_cuda(jax_varlen.paged_attention, q, cache, cache, table, n)
    p = plan(Sq=1, Skv=max_pages * ps, H=H, Hkv=Hkv, D=D, page_size=ps)
    assert _custom_call_results(text, _ffi.PAGED_CUDA_TARGET)[-1] == \
        f"tensor<{B}x{p['fwd_workspace_per_pack']}xf32>"

    kv = jax.ShapeDtypeStruct((B, 300, Hkv, D), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((H,), jnp.float32)
    text = _export_for_cuda(lambda q, k, v, n, s: jax_varlen.attention(q, k, v, n, sinks=s),
                            q, kv, kv, n, sinks)
    p = plan(Sq=1, Skv=300, H=H, Hkv=Hkv, D=D)
    assert _custom_call_results(text, _ffi.SINKS_CUDA_TARGET)[-1] == \
        f"tensor<{B}x{p['fwd_workspace_per_pack']}xf32>"
    assert f"custom_call @{_ffi.CUDA_TARGET}(" not in text
