"""Prints the forward targets of the Hopper issue against a bench.py result file.

    python3 benchmarks/targets.py benchmarks/results/<date>-h200-fwd.json

Per shape: effective TFLOP/s of ours, cuDNN, FA3 and XLA from that one run, ours over the best
of cuDNN and FA3, the target ratio and whether it is met (and the absolute 640 TFLOP/s floor on
d128-full).
"""

import json
import sys

# ours / max(cudnn, fa3), forward, bf16 (issue: "Hopper forward ... beat cuDNN and FA3").
RATIO_TARGETS = {
    "d128-full": 1.05, "d128-causal-full": 1.05, "d128-long-causal": 1.05,
    "d128-skewed": 1.4, "d128-causal-skewed": 1.4, "d128-long-causal-skewed": 1.4,
    "d64-full": 1.05, "d64-skewed": 1.3,
}
ABSOLUTE_TARGETS = {"d128-full": 640.0}  # TFLOP/s


def summarize(records):
    """Rows of (shape, {impl: TFLOP/s}, ratio, target, met) in run order."""
    rows = []
    for shape in dict.fromkeys(r["shape"] for r in records):
        eff = {r["impl"]: r["eff_tflops"] for r in records
               if r["shape"] == shape and r.get("eff_tflops")}
        ours = eff.get("jax_varlen")
        peers = [eff[p] for p in ("cudnn", "fa3") if p in eff]
        ratio = ours / max(peers) if ours and peers else None
        target = RATIO_TARGETS.get(shape)
        met = None
        if target is not None and ratio is not None:
            met = ratio >= target and ours >= ABSOLUTE_TARGETS.get(shape, 0.0)
        rows.append((shape, eff, ratio, target, met))
    return rows


def main(path):
    with open(path) as f:
        data = json.load(f)
    records = data["records"] if isinstance(data, dict) else data
    print(f"{'shape':26s} {'ours':>6s} {'cudnn':>6s} {'fa3':>6s} {'xla':>6s} {'ours/best':>9s} "
          f"{'target':>6s} met")
    for shape, eff, ratio, target, met in summarize(records):
        cells = [f"{eff[i]:6.0f}" if i in eff else f"{'-':>6s}"
                 for i in ("jax_varlen", "cudnn", "fa3", "xla")]
        print(f"{shape:26s} {' '.join(cells)} {ratio if ratio else 0:9.2f} "
              f"{target if target else '':>6} {'' if met is None else ('yes' if met else 'no')}")


if __name__ == "__main__":
    main(sys.argv[1])
