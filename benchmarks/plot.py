"""Plots one bench.py results file: python benchmarks/plot.py benchmarks/results/X.json

Writes X.png next to it: grouped bars of effective TFLOP/s per shape and impl, one panel per
pass (forward, training step, backward alone), and a panel of effective TB/s for decode shapes
(Sq == 1) when the file has any. Shapes in a dtype other than bfloat16 are labelled with it
(e.g. "d128-full f16"). Failed runs are left as gaps, marked "x" on the axis.

A decode_sweep.py file (records with B and Skv) is drawn as lines instead: effective TB/s
against cache length (log x), one line per (impl, B), with the H200's measured copy bandwidth
as a horizontal line on H200 files; and, when the file has jax_varlen and cuDNN, a second
panel of jax_varlen's TB/s over cuDNN's. Skipped or failed points are gaps in the lines.
"""

import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

IMPL_ORDER = ("jax_varlen", "cudnn", "fa3", "xla")
COPY_TBPS = 4.30  # device-to-device copy (read + write) measured on the lent H200; NOTES.md
LINE_STYLE = {"jax_varlen": ("-", "o"), "cudnn": ("--", "s"), "fa3": ("-.", "v"),
              "xla": (":", "^")}


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


SHORT_DTYPE = {"bfloat16": "", "float16": " f16", "float32": " f32"}
PASS_LABEL = {"fwd": "forward", "train": "training step (fwd + bwd, 3.5x fwd FLOPs)",
              "bwd": "backward alone (2.5x fwd FLOPs)"}


def group_label(record):
    """'d128-full' for bfloat16, 'd128-full f16' for float16."""
    dtype = record.get("dtype", "bfloat16")
    return record["shape"] + SHORT_DTYPE.get(dtype, f" {dtype}")


def bar_panel(ax, records, key, ylabel):
    """Grouped bars: one group per shape (and dtype; run order), one bar per impl; value =
    record[key]."""
    shapes = list(dict.fromkeys(group_label(r) for r in records))
    impls = sorted({r["impl"] for r in records}, key=impl_key)
    value = {(group_label(r), r["impl"]): r.get(key) for r in records}
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


def impl_key(impl):
    return (IMPL_ORDER.index(impl) if impl in IMPL_ORDER else len(IMPL_ORDER), impl)


def is_sweep(records, meta):
    return "sweep" in meta or bool(records) and all("Skv" in r and "B" in r for r in records)


def cache_label(skv):
    """1024 -> '1k', 131072 -> '128k', 64 -> '64'."""
    return f"{skv // 1024}k" if skv >= 1024 and skv % 1024 == 0 else str(skv)


def sweep_plot(path, records, meta):
    """TB/s against Skv per (impl, B); NaN (skipped, failed) breaks a line."""
    impls = sorted({r["impl"] for r in records}, key=impl_key)
    batches = sorted({r["B"] for r in records})
    caches = sorted({r["Skv"] for r in records})
    tbps = {(r["impl"], r["B"], r["Skv"]): r.get("eff_tbps") for r in records}
    value = lambda impl, b, s: tbps.get((impl, b, s)) or math.nan  # noqa: E731
    colors = {b: plt.get_cmap("tab10")(k % 10) for k, b in enumerate(batches)}
    ratio = "jax_varlen" in impls and "cudnn" in impls
    fig, axes = plt.subplots(1, 2 if ratio else 1, figsize=(13 if ratio else 7.5, 5),
                             squeeze=False, gridspec_kw={"width_ratios": [3, 2] if ratio else [1]})
    ax = axes[0][0]
    for impl in impls:
        style, marker = LINE_STYLE.get(impl, ("-.", "d"))
        for b in batches:
            ys = [value(impl, b, s) for s in caches]
            if all(math.isnan(y) for y in ys):
                continue  # nothing ran for this (impl, B), e.g. xla at B = 256
            ax.plot(caches, ys, linestyle=style, marker=marker, color=colors[b],
                    label=f"{impl} B={b}")
    device = meta.get("device", records[0].get("device", "") if records else "")
    if "H200" in device:
        ax.axhline(COPY_TBPS, color="gray", linestyle="-.", linewidth=1)
        ax.annotate(f"device copy {COPY_TBPS:.2f} TB/s", (caches[0], COPY_TBPS),
                    xytext=(2, 3), textcoords="offset points", fontsize=8, color="gray")
    ax.set_ylabel("effective TB/s (valid K/V + Q + O bytes / time)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, ncol=len(impls), loc="upper left", bbox_to_anchor=(0, -0.12))

    if ratio:
        rax = axes[0][1]
        for b in batches:
            ys = [value("jax_varlen", b, s) / value("cudnn", b, s) for s in caches]
            if not all(math.isnan(y) for y in ys):
                rax.plot(caches, ys, marker="o", color=colors[b], label=f"B={b}")
        rax.axhline(1.0, color="gray", linewidth=1)
        rax.set_ylabel("jax_varlen TB/s / cuDNN TB/s")
        rax.legend(fontsize=7)
    for a in axes[0]:
        a.set_xscale("log", base=2)
        a.set_xticks(caches, [cache_label(s) for s in caches])
        a.minorticks_off()
        a.set_xlabel("KV cache length Skv (every sequence full; Sq = 1, H 32/8, D 128)")
        a.grid(alpha=0.3)
    first = records[0] if records else {}
    smoke = "\nCPU smoke test: checks the script, not performance" if meta.get("cpu_smoke") else ""
    fig.suptitle(f"{os.path.basename(path)}: {device}, {first.get('dtype', '')} decode, "
                 f"jax {first.get('jax', '')}{smoke}", fontsize=10)
    fig.tight_layout()
    png = os.path.splitext(path)[0] + ".png"
    fig.savefig(png, dpi=120)
    return png


def plot(path):
    records, meta = load(path)
    if is_sweep(records, meta):
        return sweep_plot(path, records, meta)
    prefill = [r for r in records if not is_decode(r["shape"], meta)]
    decode = [r for r in records if is_decode(r["shape"], meta)]
    passes = list(dict.fromkeys(r.get("pass", "fwd") for r in prefill))
    panels = [([r for r in prefill if r.get("pass", "fwd") == p], "eff_tflops",
               PASS_LABEL.get(p, p)) for p in passes]
    if decode:
        panels.append((decode, "eff_tbps", "decode"))
    widths = [max(4.0, 1.2 * len({group_label(r) for r in rs})) for rs, _, _ in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(widths) + 1, 4.5), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    for ax, (rs, key, title) in zip(axes[0], panels):
        bar_panel(ax, rs, key, "effective TB/s" if key == "eff_tbps" else "effective TFLOP/s")
        ax.set_title(title, fontsize=9)
    first = records[0] if records else {}
    versions = meta.get("versions", {})
    peers = ", ".join(f"{k} {versions[k]}" for k in ("cudnn", "flash-attn3-jax") if versions.get(k))
    smoke = "; CPU smoke test: checks the script, not performance" if meta.get("cpu_smoke") else ""
    fig.suptitle(f"{os.path.basename(path)}: {meta.get('device', first.get('device', ''))}, "
                 f"{meta.get('date', first.get('date', ''))}, jax {first.get('jax', '')}"
                 f"{', ' + peers if peers else ''}{smoke}", fontsize=10)
    fig.tight_layout()
    png = os.path.splitext(path)[0] + ".png"
    fig.savefig(png, dpi=120)
    return png


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print("wrote " + plot(sys.argv[1]))
