"""Turns benchmark records into a markdown table and writes the JSON + markdown result files."""

import json
import os

OURS = "jax_varlen"


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


def markdown_table(records, shapes):
    """One row per (shape, impl). `ours/impl` = our effective rate / that impl's (>1: ours is
    faster per unit of useful work); `ref` = the peer's number recorded in shapes.json."""
    lines = [
        "| shape | impl | ms | eff | ours/impl | ref | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for name in dict.fromkeys(r["shape"] for r in records):  # shapes in run order
        decode = _is_decode(shapes[name])
        unit = "TB/s" if decode else "TFLOP/s"
        rows = [r for r in records if r["shape"] == name]
        ours = next((_eff(r, decode) for r in rows if r["impl"] == OURS), None)
        measured = shapes[name].get("measured_TBps" if decode else "measured", {})
        for r in rows:
            eff = _eff(r, decode)
            ratio = ours / eff if ours and eff and r["impl"] != OURS else None
            ref = measured.get(r["impl"])
            lines.append(
                f"| {name} | {r['impl']} | {_fmt(r.get('ms'), '.3f')} "
                f"| {_fmt(eff, '.4g')} {unit if eff is not None else ''} "
                f"| {_fmt(ratio, '.2f')} | {_fmt(ref, '')} | {_note(r)} |"
            )
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
    """Writes <out_dir>/<stem>.json ({"records": [...], "meta": {...}}) and <stem>.md."""
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
                "that impl's. ref = the peer's number in shapes.json.\n\n"
                f"{table}\n")
    return json_path, md_path
