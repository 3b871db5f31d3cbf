"""How well the Hopper forward's persistent schedule fills the GPU on a named shape, by list
scheduling over a unit-cost model (no GPU): the units the kernel enumerates (tile_scheduler.h:
sequences heaviest first by keys, row blocks from the last, pack-GQA for short sequences), each
costing its key tiles plus one (its prologue and epilogue), spread over the SMs by

  snake    the kernel's static order (CTA c takes units c, 2G - 1 - c, 2G + c, ...);
  sorted   the same snake over the units sorted by cost;
  dynamic  each unit to the first CTA that is free (a work counter; greedy in list order).

Prints the efficiency (ideal makespan / makespan) of each. A model, not a measurement: it
ignores that decode units are memory-bound and chunk units compute-bound. --memory models that
instead, for the dynamic list (a fluid simulation, microseconds): each SM walks one unit at a
time; a compute tile (a unit of many query rows) takes --tile-us, a pack-GQA decode tile
max(--decode-us, 64 KB / its bandwidth share), the share being min(--sm-gbps, --hbm-tbps /
the SMs streaming), plus --unit-us per unit; printed for the kernel's order, the sequences in
index order (FA3's) and compute units first / decode units first.

  python benchmarks/schedule_sim.py [--sms 132] [shape ...]
  python benchmarks/schedule_sim.py --memory [--sm-gbps 30,45,60] mixed-serve
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def unit_costs(shape, block_m=128, pack_gqa=True, detail=False, order="keys"):
    """The forward's units of a shape with per-sequence query counts, in the kernel's order
    (order="index": the sequences in batch order instead); with detail, (tiles, is_decode)
    pairs: is_decode for a pack-GQA unit, tiles without the +1 of its prologue."""
    lens_k = shape["lengths"]
    lens_q = shape.get("lengths_q", [shape.get("Sq", n) for n in lens_k])
    pack_gqa = pack_gqa and "lengths_q" in shape  # only the packed list packs (tile_scheduler.h)
    H, Hkv, D = shape["H"], shape["Hkv"], max(shape["D"], shape["Dv"])
    banded = shape.get("causal") or shape.get("local_window_size") is not None
    block_n = 128 if D <= 64 or (D <= 128 and banded) else (176 if D <= 128 else 80)  # limits.h, fwd_sm90_block_n
    group = H // Hkv
    costs = []
    seqs = range(len(lens_k)) if order == "index" else sorted(range(len(lens_k)), key=lambda b: (-lens_k[b], b))
    for b in seqs:
        q, k = lens_q[b], lens_k[b]
        heads = group if (pack_gqa and group > 1 and q < block_m
                          and math.ceil(q * group / block_m) < group) else 1
        rows = q * heads
        for m in reversed(range(math.ceil(rows / block_m))):
            last_row = (min(rows, (m + 1) * block_m) - 1) // heads
            key_end = min(max(last_row + k - q + 1, 0), k) if shape.get("causal") else k
            tiles = math.ceil(key_end / block_n)
            costs.extend([(tiles, heads > 1) if detail else tiles + 1] * (H // heads))
    return costs


def fluid_makespan(units, sms, sm_gbps, hbm_tbps, tile_us, decode_us, unit_us, tile_kb, dt_us=0.25):
    """Microseconds for the dynamic list `units` ((tiles, is_decode) pairs) under the memory
    model of --memory (module docstring)."""
    nxt, t = 0, 0.0
    running = [None] * sms  # [tiles left, is_decode, overhead left]

    def take():
        nonlocal nxt
        if nxt == len(units):
            return None
        tiles, dec = units[nxt]
        nxt += 1
        return [float(tiles), dec, unit_us]
    running = [take() for _ in range(sms)]
    while any(r is not None for r in running):
        streaming = sum(1 for r in running if r is not None and r[1] and r[2] <= 0)
        share = min(sm_gbps * 1e3, hbm_tbps * 1e6 / max(streaming, 1))  # bytes per us
        decode_tile = max(decode_us, tile_kb * 1024 / share)
        for i, r in enumerate(running):
            if r is None:
                continue
            if r[2] > 0:
                r[2] -= dt_us
                continue
            r[0] -= dt_us / (decode_tile if r[1] else tile_us)
            if r[0] <= 0:
                running[i] = take()
        t += dt_us
    return t


def makespans(costs, sms):
    def snake(order):
        load = [0] * sms
        for i, c in enumerate(order):
            r, j = divmod(i, sms)
            load[j if r % 2 == 0 else sms - 1 - j] += c
        return max(load)

    free = [0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return {"snake": snake(costs), "sorted": snake(sorted(costs, reverse=True)), "dynamic": max(free)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shapes", nargs="*", default=["mixed-serve", "docs-causal", "docs-causal-d64",
                                                  "prefill-right-padded", "d128-causal-skewed"])
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--memory", action="store_true", help="the memory model (module docstring)")
    p.add_argument("--sm-gbps", default="30,45,60", help="--memory: one SM's stream rates, GB/s")
    p.add_argument("--hbm-tbps", type=float, default=4.3, help="--memory: HBM, TB/s (H200 copy)")
    p.add_argument("--tile-us", type=float, default=1.8, help="--memory: a 128 x 128 compute tile")
    p.add_argument("--decode-us", type=float, default=1.0, help="--memory: a decode tile's compute")
    p.add_argument("--unit-us", type=float, default=2.0, help="--memory: per unit")
    a = p.parse_args()
    with open(os.path.join(HERE, "shapes.json")) as f:
        shapes = json.load(f)["shapes"]
    if a.memory:
        print(f"| shape | SM GB/s | kernel order | index order | compute first | decode first |  (us, {a.sms} SMs)")
        print("|---|---:|---:|---:|---:|---:|")
        for name in a.shapes:
            units = unit_costs(shapes[name], detail=True)
            orders = [units, unit_costs(shapes[name], detail=True, order="index"),
                      [u for u in units if not u[1]] + [u for u in units if u[1]],
                      [u for u in units if u[1]] + [u for u in units if not u[1]]]
            d = shapes[name]["D"]
            for gbps in (float(x) for x in a.sm_gbps.split(",")):
                cells = [fluid_makespan(o, a.sms, gbps, a.hbm_tbps, a.tile_us, a.decode_us, a.unit_us,
                                        tile_kb=2 * 128 * d * 2 / 1024) for o in orders]
                print(f"| {name} | {gbps:.0f} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
        return
    print(f"| shape | units | snake | sorted snake | dynamic |  ({a.sms} SMs, efficiency)")
    print("|---|---:|---:|---:|---:|")
    for name in a.shapes:
        costs = unit_costs(shapes[name])
        ideal = sum(costs) / a.sms
        eff = {k: ideal / v for k, v in makespans(costs, a.sms).items()}
        print(f"| {name} | {len(costs)} | {eff['snake']:.3f} | {eff['sorted']:.3f} | {eff['dynamic']:.3f} |")


if __name__ == "__main__":
    main()
