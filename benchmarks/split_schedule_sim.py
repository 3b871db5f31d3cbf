"""How the split-KV decode kernel's blocks fill an H100, by a fluid list-scheduling model (no
GPU): the grid's blocks (fwd_split.cuh: split fastest, then kv head, then sequence; a split
past a sequence's keys exits at once) go to `--slots` block slots (3 per SM x 132) in blockIdx
order; a real block spends --pro us (length, Q tile, table entries), streams its keys' K and V
(512 B per key per kv head at d128) at min(--block-gbps, --hbm-tbps / streaming blocks), then
--epi us (the warps' merge, the partial or the row's output); an empty block holds its slot
--empty us. Prints the makespan (us) of each block order and, for comparison, the bytes over
--hbm-tbps. A model, not a measurement (decode-paged measures 225 us of kernel on an H100, the
model 217-221): use it to compare orders and overheads, not for absolute times.

  python benchmarks/split_schedule_sim.py [shape] [--pro 4 --epi 4]
"""

from __future__ import annotations

import argparse
import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def blocks(shape, order, chunk):
    """Keys per block in launch order (0: an empty block). rect: the kernel's grid; splits_asc /
    splits_desc: the split slowest; compact: only real blocks, batch order; heaviest: only real
    blocks, the longest sequences first."""
    lens, heads = shape["lengths"], shape["Hkv"]
    splits = math.ceil(shape["Skv"] / chunk)
    seqs = range(len(lens))
    if order == "rect":
        idx = [(s, b) for b in seqs for _ in range(heads) for s in range(splits)]
    elif order in ("splits_asc", "splits_desc"):
        ss = range(splits) if order == "splits_asc" else reversed(range(splits))
        idx = [(s, b) for s in ss for b in seqs for _ in range(heads)]
    else:
        bs = sorted(seqs, key=lambda b: -lens[b]) if order == "heaviest" else seqs
        idx = [(s, b) for b in bs for _ in range(heads) for s in range(math.ceil(lens[b] / chunk))]
    return [max(0, min(lens[b], (s + 1) * chunk) - s * chunk) for s, b in idx]


def makespan(keys, slots, hbm_tbps, block_gbps, pro, epi, empty, bytes_per_key, dt=0.1):
    hbm, cap = hbm_tbps * 1e6, block_gbps * 1e3  # bytes per us
    queue, active, t = list(reversed(keys)), [], 0.0
    while queue or active:
        while len(active) < slots and queue:
            k = queue.pop()
            active.append(["empty", empty, 0.0] if k == 0 else ["pro", pro, k * bytes_per_key])
        streaming = sum(1 for a in active if a[0] == "stream")
        share = min(cap, hbm / streaming) if streaming else 0.0
        for a in active:
            if a[0] == "stream":
                a[2] -= share * dt
                if a[2] <= 0:
                    a[0], a[1] = "epi", epi
            else:
                a[1] -= dt
                if a[1] <= 0:
                    a[0] = "stream" if a[0] == "pro" else "done"
        active = [a for a in active if a[0] != "done"]
        t += dt
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", nargs="?", default="decode-paged")
    ap.add_argument("--chunk", type=int, default=1024, help="keys per split (plan.h's split_keys)")
    ap.add_argument("--slots", type=int, default=3 * 132)
    ap.add_argument("--hbm-tbps", type=float, default=3.0)
    ap.add_argument("--block-gbps", type=float, default=43.0, help="one block's most (its loads in flight)")
    ap.add_argument("--pro", type=float, default=2.0)
    ap.add_argument("--epi", type=float, default=2.0)
    ap.add_argument("--empty", type=float, default=1.0)
    args = ap.parse_args()
    with open(os.path.join(HERE, "shapes.json")) as f:
        shape = json.load(f)["shapes"][args.shape]
    bpk = 2 * 2 * max(shape["D"], shape["Dv"])
    print(f"{args.shape}: bytes / HBM = {sum(shape['lengths']) * shape['Hkv'] * bpk / (args.hbm_tbps * 1e6):.1f} us")
    for order in ("rect", "splits_asc", "splits_desc", "compact", "heaviest"):
        t = makespan(blocks(shape, order, args.chunk), args.slots, args.hbm_tbps, args.block_gbps,
                     args.pro, args.epi, 0.0 if order in ("compact", "heaviest") else args.empty, bpk)
        print(f"  {order:12s} {t:7.1f} us")


if __name__ == "__main__":
    main()
