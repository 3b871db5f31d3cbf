"""Plots one bench.py results file: python benchmarks/plot.py benchmarks/results/X.json

Writes X.png next to it: grouped bars of effective TFLOP/s per shape and impl, and a second
panel of effective TB/s for decode shapes (Sq == 1) when the file has any. Failed runs are
left as gaps, marked "x" on the axis.
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

IMPL_ORDER = ("jax_varlen", "cudnn", "xla")


def load(path):
    """Returns (records, meta); accepts {"records": [...], "meta": {...}} or a bare list."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):
        return data, {}
    return data["records"], data.get("meta", {})


def is_decode(name, meta):
    shape = meta.get("shapes", {}).get(name)
    return shape["Sq"] == 1 if shape else name.startswith("decode")


def bar_panel(ax, records, key, ylabel):
    """Grouped bars: one group per shape (run order), one bar per impl; value = record[key]."""
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    impls = sorted({r["impl"] for r in records},
                   key=lambda i: (IMPL_ORDER.index(i) if i in IMPL_ORDER else len(IMPL_ORDER), i))
    value = {(r["shape"], r["impl"]): r.get(key) for r in records}
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        xs = [s + (k - (len(impls) - 1) / 2) * width for s in range(len(shapes))]
        ys = [value.get((name, impl)) or 0.0 for name in shapes]
        bars = ax.bar(xs, ys, width, label=impl)
        ax.bar_label(bars, labels=[f"{y:.3g}" if y else "x" for y in ys], fontsize=7, padding=1)
    ax.set_xticks(range(len(shapes)), shapes, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def plot(path):
    records, meta = load(path)
    prefill = [r for r in records if not is_decode(r["shape"], meta)]
    decode = [r for r in records if is_decode(r["shape"], meta)]
    panels = [(rs, key, label) for rs, key, label in (
        (prefill, "eff_tflops", "effective TFLOP/s"),
        (decode, "eff_tbps", "effective TB/s (decode)")) if rs]
    widths = [max(4.0, 1.2 * len({r["shape"] for r in rs})) for rs, _, _ in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(widths) + 1, 4.5), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    for ax, (rs, key, label) in zip(axes[0], panels):
        bar_panel(ax, rs, key, label)
    first = records[0] if records else {}
    fig.suptitle(f"{os.path.basename(path)}: {meta.get('device', first.get('device', ''))}, "
                 f"{first.get('dtype', '')} {first.get('pass', '')}, jax {first.get('jax', '')}",
                 fontsize=10)
    fig.tight_layout()
    png = os.path.splitext(path)[0] + ".png"
    fig.savefig(png, dpi=120)
    return png


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print("wrote " + plot(sys.argv[1]))
