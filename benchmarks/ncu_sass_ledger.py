"""Where a kernel's warps stall, per SASS instruction, from Nsight Compute's source page
(ncu_sites.sh writes it: ``ncu --import X.ncu-rep --page source --csv --print-source sass``).

Usage: python3 benchmarks/ncu_sass_ledger.py LABEL-sass.csv [OTHER-sass.csv] [--top 40]

Prints the kernel's totals (executed warp instructions, stall samples), the instructions that
hold the most samples (with their opcode and the stall reasons' columns where the page has them)
until --cover of all samples, and the samples and executed instructions by opcode. With a second
file, the by-opcode table of both side by side (which instructions one build executes more).
The page's column names differ between Nsight Compute versions: columns are found by substring.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from collections import defaultdict


def _num(x: str) -> float:
    x = (x or "").replace(",", "").strip()
    try:
        return float(x)
    except ValueError:
        return 0.0


def read(path: str) -> tuple[list[dict], dict]:
    """Rows of the source page (one per SASS instruction) and the columns found:
    {"source", "address", "samples", "executed", "reasons": [...]}."""
    text = open(path, errors="replace").read()
    start = text.find('"Address"')
    if start < 0:
        start = text.find('"#"')
    if start < 0:
        sys.exit(f"{path}: no source page table (no \"Address\" column)")
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    names = list(rows[0].keys()) if rows else []

    def find(*subs, avoid=()):
        for n in names:
            if all(s.lower() in n.lower() for s in subs) and not any(a.lower() in n.lower() for a in avoid):
                return n
        return None

    cols = {
        "source": find("source"),
        "address": find("address"),
        "samples": find("warp stall sampling", "all") or find("sampling", avoid=("not",)),
        "executed": find("instructions executed", avoid=("thread", "predicated")),
        "reasons": [n for n in names if n.lower().startswith("stall_") or "stall (" in n.lower()],
    }
    if cols["source"] is None or cols["samples"] is None:
        sys.exit(f"{path}: columns not found in {names}")
    return rows, cols


def opcode(src: str) -> str:
    s = re.sub(r"^@!?U?P\w+\s+", "", src.strip())
    return s.split(" ")[0] if s else "?"


def by_opcode(rows, cols):
    out = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        op = opcode(r[cols["source"]])
        out[op][0] += _num(r[cols["samples"]])
        if cols["executed"]:
            out[op][1] += _num(r[cols["executed"]])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--cover", type=float, default=0.8, help="list instructions until this share of samples")
    args = ap.parse_args()
    tables = []
    for path in args.csv:
        rows, cols = read(path)
        total = sum(_num(r[cols["samples"]]) for r in rows) or 1.0
        executed = sum(_num(r[cols["executed"]]) for r in rows) if cols["executed"] else 0.0
        print(f"== {path}: {len(rows)} instructions, {executed:.4g} warp instructions executed, {total:.0f} stall samples")
        ranked = sorted(range(len(rows)), key=lambda i: -_num(rows[i][cols["samples"]]))
        acc = 0.0
        for n, i in enumerate(ranked[: args.top]):
            r = rows[i]
            s = _num(r[cols["samples"]])
            acc += s
            reasons = sorted(((_num(r[c]), c) for c in cols["reasons"]), reverse=True)[:2]
            why = ", ".join(f"{c.replace('stall_', '')} {v:.0f}" for v, c in reasons if v > 0)
            print(f"{i:6d} {r.get(cols['address'] or '', ''):>8} {100 * s / total:5.1f}%  "
                  f"{r[cols['source']].strip()[:70]:70s} {why}")
            if acc >= args.cover * total:
                break
        tables.append((path, by_opcode(rows, cols), total, executed))
    print("\n== by opcode: stall samples (share), warp instructions executed")
    ops = sorted({op for _, t, _, _ in tables for op in t}, key=lambda op: -max(t[op][0] / tot for _, t, tot, _ in tables))
    for op in ops[: args.top]:
        cells = "  ".join(f"{100 * t[op][0] / tot:5.1f}% {t[op][1]:10.4g}" for _, t, tot, _ in tables)
        print(f"{op:28s} {cells}")


if __name__ == "__main__":
    main()
