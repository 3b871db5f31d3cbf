"""A model of one packed serving step on the Hopper forward's persistent grid: which unit order
finishes first (tile_scheduler.h: the list ranked by keys, or the mixed order of
JAX_VARLEN_FWD_MIXED_ORDER=1).

Usage: python3 benchmarks/serve_order_sim.py [--shape mixed-serve] [--sms 132]

The step's units as the kernel lists them (pack-GQA units of one kv head for sequences whose
group's rows fill fewer tiles, 128-row units per query head otherwise; causal, tail-aligned,
128-key tiles: the lean kernel's), taken in list order by whichever SM is free (the unit
counter). A unit of many rows costs TILE_US per key tile (the tensor cores); a unit of at most 64
tile rows (decode rows) costs DECODE_TILE_US per tile alone, but its tiles' bytes (K and V) come
from HBM, whose BW_TBPS all such units running at once share: when many run together they slow
down, while the many-row units (their K and V shared in L2 by a group's heads and row blocks)
do not. Orders:
- keys: sequences by keys, descending (today's default), each sequence's units together;
- mixed: the two classes each in that order, their units interleaved in proportion to their
  counts (mixed_position);
- sequence-merge: the classes merged by sequence on the fraction of their class's work before
  each (a first version of the mixed order, predicted worse: a long chunk's units stay
  together and leave the decode rows a wave of their own after them).
The model leaves out the per-unit overhead (~3.8 us on an H100, benchmarks/NOTES.md), the same in
every order.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

TILE_US = 1.85  # a 128 x 128 tile of a many-row unit (d128, both products), H100
DECODE_TILE_US = 1.1  # a decode unit's tile when bandwidth is no limit (one warpgroup's products)
BW_TBPS = 3.0  # HBM bandwidth the decode units share
BLOCK_M = BLOCK_N = 128
FEW_ROWS = 64


def units_of(shape: dict) -> list[dict]:
    """Per sequence: its keys, class (1: at most FEW_ROWS tile rows) and units (tiles each)."""
    H, Hkv, D = shape["H"], shape["Hkv"], shape["D"]
    group = H // Hkv
    seqs = []
    for b, (q, k) in enumerate(zip(shape["lengths_q"], shape["lengths"])):
        heads = group if q < BLOCK_M and math.ceil(q * group / BLOCK_M) < group else 1
        rows = q * heads
        units = []
        for m_block in range(math.ceil(rows / BLOCK_M) - 1, -1, -1):
            last_row = (min(rows, (m_block + 1) * BLOCK_M) - 1) // heads
            tiles = math.ceil((last_row + k - q + 1) / BLOCK_N)  # causal, tail-aligned
            units += [tiles] * (H // heads)
        seqs.append(dict(b=b, keys=k, cls=int(rows <= FEW_ROWS), units=units, bytes_per_tile=2 * BLOCK_N * D * 2))
    return seqs


def by_keys(seqs):
    return sorted(seqs, key=lambda s: (-s["keys"], s["b"]))


def order_keys(seqs):
    return [(t, s["cls"], s["bytes_per_tile"]) for s in by_keys(seqs) for t in s["units"]]


def order_mixed(seqs):
    cls = [[(t, c, s["bytes_per_tile"]) for s in by_keys(seqs) if s["cls"] == c for t in s["units"]] for c in (0, 1)]
    longs, total = len(cls[0]), len(cls[0]) + len(cls[1])
    out = []
    for u in range(total):  # tile_scheduler.h, mixed_position
        before, through = u * longs // total, (u + 1) * longs // total
        out.append(cls[0][before] if through > before else cls[1][u - before])
    return out


def order_sequence_merge(seqs):
    keyed = []
    for c in (0, 1):
        ranked = [s for s in by_keys(seqs) if s["cls"] == c]
        total, acc = sum(len(s["units"]) * s["keys"] for s in ranked), 0
        for r, s in enumerate(ranked):
            keyed.append((acc / total if total else 0.0, c, r, s))
            acc += len(s["units"]) * s["keys"]
    return [(t, s["cls"], s["bytes_per_tile"]) for *_, s in sorted(keyed, key=lambda x: x[:3]) for t in s["units"]]


def simulate(units, sms: int, dt_us: float = 0.05) -> float:
    """Microseconds until the last unit ends: each free SM takes the next unit of the list."""
    sm = [None] * sms
    nxt, t = 0, 0.0
    while True:
        for i in range(sms):
            if sm[i] is None and nxt < len(units):
                tiles, cls, tile_bytes = units[nxt]
                sm[i] = [float(tiles), cls, tile_bytes]
                nxt += 1
        active = [x for x in sm if x is not None]
        if not active:
            return t
        decoding = [x for x in active if x[1]]
        if decoding:  # tiles per us for each decode unit: its own pace or its share of HBM
            share = BW_TBPS * 1e6 / decoding[0][2] / len(decoding)
            decode_rate = min(1.0 / DECODE_TILE_US, share)
        for i, x in enumerate(sm):
            if x is None:
                continue
            x[0] -= (decode_rate if x[1] else 1.0 / TILE_US) * dt_us
            if x[0] <= 0:
                sm[i] = None
        t += dt_us


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="mixed-serve")
    ap.add_argument("--sms", type=int, default=132)
    args = ap.parse_args()
    shapes = json.loads((pathlib.Path(__file__).resolve().parents[2] / "shared" / "bench_shapes.json").read_text())
    seqs = units_of(shapes["shapes"][args.shape])
    for c, name in ((0, "many-row"), (1, "few-row")):
        tiles = sum(t for s in seqs if s["cls"] == c for t in s["units"])
        print(f"{name} units: {sum(len(s['units']) for s in seqs if s['cls'] == c)}, tiles {tiles}")
    base = simulate(order_keys(seqs), args.sms)
    print(f"keys (today): {base:.0f} us")
    for name, order in (("mixed", order_mixed), ("sequence-merge", order_sequence_merge)):
        t = simulate(order(seqs), args.sms)
        print(f"{name}: {t:.0f} us ({t / base:.3f} of keys)")


if __name__ == "__main__":
    main()
