"""Turns benchmark records into markdown tables and writes the JSON + markdown result files.

    python3 benchmarks/bench_report.py RESULTS.json [MORE.json ...]

prints the summary of one or more result files (e.g. the forward call's and the training
call's): per shape and pass, ours / cuDNN / FA3 / dew3 / XLA effective TFLOP/s, ours over the
best of cuDNN and FA3 (or the peers TARGET_PEERS names for the shape), and the issue's target
for it; then the packed layout's table (issue 13), which also holds the packed-layout shapes.
dew3 (dew-flash-attn-cu13, a current FlashAttention-3 build) is shown where it ran, not
counted in the targets' ratios: the issues name cuDNN and flash-attn3-jax.
"""

import json
import os
import sys

OURS = "jax_varlen"
OURS_PACKED, FA3_PACKED = "jax_varlen_packed", "fa3_packed"  # the packed layout (issue 13)
DEW3, DEW3_PACKED = "dew3", "dew3_packed"  # shown beside FA3; no target names them
OURS_PAGED = "jax_varlen_paged"  # the paged layout (issue 34): paged_attention
BEST_OF = ("cudnn", "fa3")  # the peers a target ratio is measured against
SUMMARY_IMPLS = (OURS, "cudnn", "fa3", DEW3, "xla")

# Targets, bf16, ratio ours / max(cuDNN, FA3) in the same run (max over TARGET_PEERS[shape]
# where it names the peers). Forward: issue 11 (Hopper forward), with 640 TFLOP/s absolute on
# d128-full; train: issue 12 (fused backward); prefill-right-padded, forward and train: issue 31
# (padded query rows), against cuDNN (FA3's flash_mha_varlen takes no seqused_q).
RATIO_TARGETS = {
    "fwd": {"d128-full": 1.05, "d128-causal-full": 1.05, "d128-long-causal": 1.05,
            "d128-skewed": 1.4, "d128-causal-skewed": 1.4, "d128-long-causal-skewed": 1.4,
            "d64-full": 1.05, "d64-skewed": 1.3, "prefill-right-padded": 1.2},
    "train": {"d128-full": 1.0, "d128-causal-full": 1.0, "d64-full": 1.0,
              "d128-skewed": 1.5, "d128-causal-skewed": 1.5, "d64-skewed": 1.5,
              "prefill-right-padded": 1.2},
}
TARGET_PEERS = {"prefill-right-padded": ("cudnn",)}  # else BEST_OF
ABSOLUTE_TARGETS = {"fwd": {"d128-full": 640.0}}  # TFLOP/s
# Issue 13, every shape, forward and train: packed within 3% of padded, >= 1.05x FA3's packed.
PACKED_TARGETS = {"padded": 0.97, "fa3_packed": 1.05}
TARGET_DTYPE = "bfloat16"


def target(shape, pass_):
    """(ratio or None, absolute TFLOP/s or None) of the issues for a bf16 (shape, pass)."""
    return RATIO_TARGETS.get(pass_, {}).get(shape), ABSOLUTE_TARGETS.get(pass_, {}).get(shape)


def _is_packed(shape):
    """A packed-layout shape: only the packed impls run it (packed_table)."""
    return shape.get("layout") == "packed"


def _is_decode(shape):
    return shape["Sq"] == 1


def _eff(record, decode):
    """The headline number of a record: TB/s for decode shapes, TFLOP/s otherwise."""
    return record.get("eff_tbps" if decode else "eff_tflops")


def _fmt(x, spec):
    return "" if x is None else format(x, spec)


def _fmt_bytes(n):
    """1.5 GiB, 64 MiB, 256 KiB; '' for None."""
    if n is None:
        return ""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def _note(record):
    """Skip reason, error (shortened) or correctness-check result, whichever applies."""
    if record.get("skipped"):
        return "skipped: " + record["skipped"]
    if record.get("error"):
        return "error: " + record["error"].splitlines()[0][:80]
    if "max_err" in record:
        err = record["max_err"]
        return f"max_err {err:.2e} ({record['check']})" if err is not None else record["check"]
    return ""


def _group(record):
    """Records compare within one (shape, dtype, pass)."""
    return record["shape"], record.get("dtype", TARGET_DTYPE), record.get("pass", "fwd")


def _measured_key(decode, pass_):
    """shapes.json's key for the brief's peer numbers of this kind of record."""
    if decode:
        return "measured_TBps" if pass_ == "fwd" else None
    return {"fwd": "measured", "train": "measured_train"}.get(pass_)


def markdown_table(records, shapes):
    """One row per (shape, dtype, pass, impl). `ours/impl` = our effective rate (jax_varlen's;
    jax_varlen_packed's on a packed-layout shape, jax_varlen_paged's on a paged one) / that impl's (>1: ours is faster per unit of
    useful work); `ref` = the peer's number recorded in shapes.json (bf16 only)."""
    lines = [
        "| shape | dtype | pass | impl | ms | eff | ours/impl | ref | note |",
        "|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for key in dict.fromkeys(_group(r) for r in records):  # groups in run order
        name, dtype, pass_ = key
        decode = _is_decode(shapes[name])
        unit = "TB/s" if decode else "TFLOP/s"
        rows = [r for r in records if _group(r) == key]
        layout = shapes[name].get("layout")
        ours_impl = {"packed": OURS_PACKED, "paged": OURS_PAGED}.get(layout, OURS)
        ours = next((_eff(r, decode) for r in rows if r["impl"] == ours_impl), None)
        mkey = _measured_key(decode, pass_)
        measured = shapes[name].get(mkey, {}) if mkey and dtype == TARGET_DTYPE else {}
        for r in rows:
            eff = _eff(r, decode)
            ratio = ours / eff if ours and eff and r["impl"] != ours_impl else None
            ref = measured.get(r["impl"])
            lines.append(
                f"| {name} | {_short_dtype(dtype)} | {pass_} | {r['impl']} "
                f"| {_fmt(r.get('ms'), '.3f')} "
                f"| {_fmt(eff, '.4g')} {unit if eff is not None else ''} "
                f"| {_fmt(ratio, '.2f')} | {_fmt(ref, '')} | {_note(r)} |"
            )
    return "\n".join(lines)


def _short_dtype(dtype):
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(dtype, dtype)


def summary_rows(records, shapes=None):
    """One row per non-decode (shape, dtype, pass) in run order (later records of the same
    (shape, dtype, pass, impl) replace earlier ones, so several files can be combined):
    {"shape", "dtype", "pass", "eff": {impl: TFLOP/s}, "ratio", "best", "target", "absolute",
    "met"}; ratio = ours / the best of the shape's TARGET_PEERS (default cuDNN and FA3). A
    target applies to bf16 only; met is None without a target or without numbers."""
    latest = {}
    for r in records:
        if shapes is not None and r["shape"] in shapes and _is_decode(shapes[r["shape"]]):
            continue
        if shapes is None and r["shape"].startswith("decode"):
            continue
        latest[(*_group(r), r["impl"])] = r
    rows = []
    for key in dict.fromkeys(k[:3] for k in latest):
        name, dtype, pass_ = key
        eff = {k[3]: r["eff_tflops"] for k, r in latest.items()
               if k[:3] == key and r.get("eff_tflops")}
        ours = eff.get(OURS)
        peers = {p: eff[p] for p in TARGET_PEERS.get(name, BEST_OF) if p in eff}
        best = max(peers, key=peers.get) if peers else None
        ratio = ours / peers[best] if ours and best else None
        ratio_t, absolute = target(name, pass_) if dtype == TARGET_DTYPE else (None, None)
        met = None
        if ratio_t is not None and ratio is not None:
            met = ratio >= ratio_t and (absolute is None or ours >= absolute)
        rows.append({"shape": name, "dtype": dtype, "pass": pass_, "eff": eff, "ratio": ratio,
                     "best": best, "target": ratio_t, "absolute": absolute, "met": met})
    return rows


def summary_table(records, shapes=None):
    """Markdown: per padded shape and pass, the effective TFLOP/s of ours and the peers
    (SUMMARY_IMPLS; '-' where one has no number), ours over the best of cuDNN and FA3
    (TARGET_PEERS; dew3 is shown, not counted), and the target (bf16; forward: issue 11,
    train: issue 12, prefill-right-padded: issue 31). Packed-layout shapes are left to
    packed_table."""
    lines = ["| shape | dtype | pass | ours | cuDNN | FA3 | dew3 | XLA | ours / best | target "
             "| met |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for row in summary_rows(records, shapes):
        if shapes is not None and _is_packed(shapes.get(row["shape"], {})):
            continue
        cells = [_fmt(row["eff"].get(i), ".0f" if row["eff"].get(i, 0) >= 10 else ".3g")
                 or "-" for i in SUMMARY_IMPLS]
        ratio = f"{row['ratio']:.2f} ({row['best']})" if row["ratio"] is not None else "-"
        tgt = ""
        if row["target"] is not None:
            tgt = f">= {row['target']:.2f}x" + (f", >= {row['absolute']:.0f} TFLOP/s"
                                                if row["absolute"] else "")
        met = "" if row["met"] is None else ("yes" if row["met"] else "no")
        lines.append(f"| {row['shape']} | {_short_dtype(row['dtype'])} | {row['pass']} | "
                     + " | ".join(cells) + f" | {ratio} | {tgt} | {met} |")
    return "\n".join(lines)


def packed_table(records, shapes=None):
    """Markdown: per shape and pass with packed records, effective TFLOP/s of jax_varlen padded
    and packed and FA3 padded and packed; packed / padded and packed / FA3 packed against
    PACKED_TARGETS (bf16; a packed-layout shape has no padded records, and only the FA3 packed
    ratio decides); then dew3 packed and packed / dew3 packed, shown, not a target ('-' where
    dew3_packed did not run). '' when no record is packed."""
    rows = [r for r in summary_rows(records, shapes) if OURS_PACKED in r["eff"]]
    if not rows:
        return ""
    lines = ["| shape | dtype | pass | padded | packed | packed / padded | FA3 | FA3 packed "
             "| packed / FA3 packed | dew3 packed | packed / dew3 packed | met |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        eff = row["eff"]
        ours = eff[OURS_PACKED]
        vs_padded = ours / eff[OURS] if eff.get(OURS) else None
        vs_fa3 = ours / eff[FA3_PACKED] if eff.get(FA3_PACKED) else None
        vs_dew3 = ours / eff[DEW3_PACKED] if eff.get(DEW3_PACKED) else None
        met = ""
        packed_only = shapes is not None and _is_packed(shapes.get(row["shape"], {}))
        if row["dtype"] == TARGET_DTYPE and vs_fa3 is not None and (vs_padded is not None
                                                                     or packed_only):
            ok = ((packed_only or vs_padded >= PACKED_TARGETS["padded"])
                  and vs_fa3 >= PACKED_TARGETS["fa3_packed"])
            met = "yes" if ok else "no"
        rate = lambda i: _fmt(eff.get(i), ".0f" if eff.get(i, 0) >= 10 else ".3g") or "-"  # noqa: E731
        cells = [rate(OURS), rate(OURS_PACKED), _fmt(vs_padded, ".3f") or "-",
                 rate("fa3"), rate(FA3_PACKED)]
        cells += [_fmt(vs_fa3, ".2f") or "-", rate(DEW3_PACKED), _fmt(vs_dew3, ".2f") or "-"]
        lines.append(f"| {row['shape']} | {_short_dtype(row['dtype'])} | {row['pass']} | "
                     + " | ".join(cells) + f" | {met} |")
    return "\n".join(lines)


def sweep_table(records):
    """decode_sweep.py's records as one row per (B, Skv): effective TB/s per impl, then
    jax_varlen's rate over each peer's. Notes list skips, errors and failed checks."""
    impls = list(dict.fromkeys(r["impl"] for r in records))
    peers = [i for i in impls if i != OURS] if OURS in impls else []
    columns = ["B", "Skv", "K+V", *(f"{i} TB/s" for i in impls), *(f"ours/{p}" for p in peers)]
    lines = ["| " + " | ".join(columns) + " | note |", "|" + "---:|" * len(columns) + "---|"]
    for name in dict.fromkeys(r["shape"] for r in records):
        rows = {r["impl"]: r for r in records if r["shape"] == name}
        first = next(iter(rows.values()))
        tbps = {i: rows[i].get("eff_tbps") if i in rows else None for i in impls}
        ours = tbps.get(OURS)
        ratios = [ours / tbps[p] if ours and tbps[p] else None for p in peers]
        bad = [(i, r) for i, r in rows.items()  # skipped, failed, or not a clean check
               if r.get("skipped") or r.get("error") or r.get("check", "ok") != "ok"]
        reasons = {_note(r) for _, r in bad}
        if len(bad) == len(rows) and len(reasons) == 1:
            note = reasons.pop()  # e.g. the whole point skipped, for one reason
        else:
            note = "; ".join(f"{i}: {_note(r)}" for i, r in bad)
        cells = [str(first.get("B", "")), str(first.get("Skv", "")),
                 _fmt_bytes(first.get("kv_bytes")), *(_fmt(tbps[i], ".3g") for i in impls),
                 *(_fmt(x, ".2f") for x in ratios), note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(out_dir, stem, records, meta, table):
    """Writes <out_dir>/<stem>.json ({"records": [...], "meta": {...}}) and <stem>.md (the
    summary first where meta["summary"] holds one, then `table`)."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, stem + ".json")
    with open(json_path, "w") as f:
        json.dump({"records": records, "meta": meta}, f, indent=1, allow_nan=False)
        f.write("\n")
    md_path = os.path.join(out_dir, stem + ".md")
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    with open(md_path, "w") as f:
        f.write(f"# {stem}\n\n{meta['device']} ({meta['date']}); {versions}\n\n"
                f"Command: `{meta['command']}`\n\n"
                "eff = effective TFLOP/s (allowed query-key pairs under each impl's own mask) "
                "or TB/s for decode (valid K/V + Q + O bytes). ours/impl = jax_varlen's eff / "
                "that impl's. ref = the peer's number in shapes.json. Passes: fwd; train = "
                "forward + backward of sum(out * dO) through jax.vjp, 3.5x the forward's "
                "FLOPs; bwd = the backward alone, 2.5x.\n\n"
                + (f"## Summary\n\n{meta['summary']}\n\n## All records\n\n"
                   if meta.get("summary") else "")
                + f"{table}\n")
    return json_path, md_path


def load_records(path):
    """(records, meta) of a result file: {"records": [...], "meta": {...}} or a bare list."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):
        return data, {}
    return data["records"], data.get("meta", {})


def main(paths):
    if not paths:
        sys.exit(__doc__)
    records, shapes = [], {}
    for path in paths:
        recs, meta = load_records(path)
        records += recs
        shapes.update(meta.get("shapes", {}))
        versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items() if v)
        print(f"{os.path.basename(path)}: {meta.get('device', '')} {meta.get('date', '')}; "
              f"{versions}")
    print()
    print(summary_table(records, shapes or None))
    packed = packed_table(records, shapes or None)
    if packed:
        print()
        print(packed)


if __name__ == "__main__":
    main(sys.argv[1:])
