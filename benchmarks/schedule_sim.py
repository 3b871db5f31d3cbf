"""How well the Hopper forward's persistent schedule fills the GPU on a named shape, by list
scheduling over a unit-cost model (no GPU): the units the kernel enumerates (tile_scheduler.h:
sequences heaviest first by keys, row blocks from the last, pack-GQA for short sequences), each
costing its key tiles plus one (its prologue and epilogue), spread over the SMs by

  snake    the kernel's static order (CTA c takes units c, 2G - 1 - c, 2G + c, ...);
  sorted   the same snake over the units sorted by cost;
  dynamic  each unit to the first CTA that is free (a work counter; greedy in list order).

Prints the efficiency (ideal makespan / makespan) of each. A model, not a measurement: it
ignores that decode units are memory-bound and chunk units compute-bound.

  python benchmarks/schedule_sim.py [--sms 132] [shape ...]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def unit_costs(shape, block_m=128, pack_gqa=True):
    """The forward's units of a shape with per-sequence query counts, in the kernel's order."""
    lens_k = shape["lengths"]
    lens_q = shape.get("lengths_q", [shape.get("Sq", n) for n in lens_k])
    pack_gqa = pack_gqa and "lengths_q" in shape  # only the packed list packs (tile_scheduler.h)
    H, Hkv, D = shape["H"], shape["Hkv"], max(shape["D"], shape["Dv"])
    block_n = 128 if D <= 64 else (176 if D <= 128 else 80)  # fwd_sm90.cuh, default_block_n
    group = H // Hkv
    costs = []
    for b in sorted(range(len(lens_k)), key=lambda b: (-lens_k[b], b)):
        q, k = lens_q[b], lens_k[b]
        heads = group if (pack_gqa and group > 1 and q < block_m
                          and math.ceil(q * group / block_m) < group) else 1
        rows = q * heads
        for m in reversed(range(math.ceil(rows / block_m))):
            last_row = (min(rows, (m + 1) * block_m) - 1) // heads
            key_end = min(max(last_row + k - q + 1, 0), k) if shape.get("causal") else k
            costs.extend([math.ceil(key_end / block_n) + 1] * (H // heads))
    return costs


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
    a = p.parse_args()
    with open(os.path.join(HERE, "shapes.json")) as f:
        shapes = json.load(f)["shapes"]
    print(f"| shape | units | snake | sorted snake | dynamic |  ({a.sms} SMs, efficiency)")
    print("|---|---:|---:|---:|---:|")
    for name in a.shapes:
        costs = unit_costs(shapes[name])
        ideal = sum(costs) / a.sms
        eff = {k: ideal / v for k, v in makespans(costs, a.sms).items()}
        print(f"| {name} | {len(costs)} | {eff['snake']:.3f} | {eff['sorted']:.3f} | {eff['dynamic']:.3f} |")


if __name__ == "__main__":
    main()
