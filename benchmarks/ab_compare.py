"""Compare two bench.py runs of jax_varlen, one per build (issue 32 item 6: "in one GPU run with
both builds, every named shape's forward and training step within 2%").

Usage: python3 benchmarks/ab_compare.py BASE NEW [--tolerance 0.02] [--out FILE.md]

BASE and NEW are bench.py's record files (a list, or {"records": [...]}), or folders of them
(every *.json inside), of the same shapes and passes, from the base build and the new one
(h200.sh's ``ab`` stage runs both in one call). A record timed in several files of one side
(h200.sh's AB_ROUNDS: base, new, base, new, ... interleaved, so that a drift of the machine
between processes falls on both sides) counts with its fastest time.
For each (shape, impl, dtype, pass) timed in both, prints the base and new times and new / base;
rows slower than 1 + tolerance are marked SLOWER. Exit status 0 either way (the table is the
verdict); 2 when the files share no timed record.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys


def records(path: str) -> dict:
    """{(shape, impl, dtype, pass): ms} of the timed records of a file, or of a folder's files
    (the fastest where a record was timed more than once)."""
    paths = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
    rows = []
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        rows += data["records"] if isinstance(data, dict) else data
    out = {}
    for r in rows:
        if r.get("ms") is None or r.get("error") or r.get("skipped"):
            continue
        key = (r["shape"], r["impl"], r.get("dtype", ""), r["pass"])
        out[key] = min(float(r["ms"]), out.get(key, float("inf")))
    return out


def table(base: dict, new: dict, tolerance: float) -> tuple[list[str], int]:
    lines = ["| shape | impl | dtype | pass | base ms | new ms | new / base | |",
             "|---|---|---|---|---|---|---|---|"]
    slower = 0
    for key in sorted(base.keys() & new.keys()):
        ratio = new[key] / base[key]
        flag = "SLOWER" if ratio > 1.0 + tolerance else ""
        slower += bool(flag)
        lines.append(f"| {' | '.join(key)} | {base[key]:.3f} | {new[key]:.3f} | {ratio:.3f} | {flag} |")
    return lines, slower


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--out")
    args = ap.parse_args()
    base, new = records(args.base), records(args.new)
    if not base.keys() & new.keys():
        print(f"no timed record in both {args.base} and {args.new}")
        sys.exit(2)
    lines, slower = table(base, new, args.tolerance)
    lines.append("")
    lines.append(f"{len(base.keys() & new.keys())} records compared; {slower} slower than "
                 f"{1 + args.tolerance:.2f}x the base; only in base: "
                 f"{len(base.keys() - new.keys())}, only in new: {len(new.keys() - base.keys())}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
