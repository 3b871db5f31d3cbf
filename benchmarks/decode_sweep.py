"""Decode sweep: jax_varlen.attention against cuDNN, FA3 (when importable; its KV-cache kernel
with bench.fa3_default_splits) and XLA where it fits, over batch size and KV-cache length. Every sequence is full (n_b = Skv); Sq = 1, H = 32, Hkv = 8, D = Dv = 128.

On a GPU machine:  python3 benchmarks/decode_sweep.py [--out DIR]     (< 4 minutes on an H200)
CPU smoke test:    JAX_PLATFORMS=cpu python benchmarks/decode_sweep.py --cpu-smoke --impls xla

Grid: B in {1, 8, 64, 256} x Skv in {1k, 4k, 16k, 64k, 128k}. A point whose K + V exceed
24 GiB is recorded as skipped (B=256 with 64k or 128k, B=64 with 128k); xla runs only where
B * Skv <= 64 * 8192. Timing, inputs and records are bench.py's; records add B, Skv and
kv_bytes, and `skipped` (a reason) for a point or impl not run. The files
<out>/<YYYY-MM-DD>-<device>-decode-sweep.json and .md are rewritten after every point, so a
run cut short by a timeout keeps what finished. Plot: python benchmarks/plot.py <the .json>.
"""

import argparse
import datetime
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import bench
import bench_metrics as metrics
import bench_report as report

GIB, MIB = 1 << 30, 1 << 20
HEADS = {"Sq": 1, "H": 32, "Hkv": 8, "D": 128, "Dv": 128, "causal": False}

# The H200 sweep. Timing per point: (repeats, target seconds per repeat); points with K + V of
# `big` bytes or more take few iterations anyway (a 16 GiB call is ~5 ms), so fewer repeats.
GRID = {
    "batches": (1, 8, 64, 256),
    "cache": (1024, 4096, 16384, 65536, 131072),
    "kv_limit": 24 * GIB,  # skip points whose K + V bytes exceed this
    "xla_max_tokens": 64 * 8192,  # run xla only where B * Skv <= this
    "rotate_below": 64 * MIB,  # rotate 2 input sets when K + V < this (L2 effects), else 1
    "big": 1 * GIB,
    "timing": (5, 0.1),
    "timing_big": (3, 0.03),
}
# --cpu-smoke: the same logic on tiny sizes, with limits chosen so every skip path is taken:
# (2, 4096) and (4, 4096) exceed kv_limit; xla is skipped at (4, 1024) and (1, 4096).
SMOKE_GRID = {
    "batches": (1, 2, 4),
    "cache": (64, 256, 1024, 4096),
    "kv_limit": 24 * MIB,
    "xla_max_tokens": 2048,
    "rotate_below": 1 * MIB,
    "big": 8 * MIB,
    "timing": (2, 0.01),
    "timing_big": (2, 0.005),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impls", default="jax_varlen,cudnn,fa3,xla")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=os.path.join(bench.HERE, "results"))
    p.add_argument("--tag", default="decode-sweep", help="file-name suffix")
    p.add_argument("--batches", help="comma-separated B values (default: 1,8,64,256)")
    p.add_argument("--cache", help="comma-separated Skv values (default: 1024,...,131072)")
    p.add_argument("--budget-s", type=float, default=220.0,
                   help="points not started within this many seconds are recorded as skipped")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny grid and short timing loops, cudnn skipped, to test on CPU")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def sweep_shape(batch, skv):
    """A shapes.json-style shape: all B sequences full."""
    return {"B": batch, "Skv": skv, **HEADS, "lengths": [skv] * batch}


def kv_bytes(shape, itemsize):
    """K [B, Skv, Hkv, D] + V [B, Skv, Hkv, Dv]: B * Skv * Hkv * (D + Dv) * itemsize."""
    return shape["B"] * shape["Skv"] * shape["Hkv"] * (shape["D"] + shape["Dv"]) * itemsize


def fmt_bytes(n):
    return f"{n / GIB:.3g} GiB" if n >= GIB else f"{n / MIB:.3g} MiB"


def reference_ends(inputs):
    """fp32 reference on the first and the last sequence (the last one has the largest
    offsets into K and V: a 32-bit overflow in a kernel shows there). Returns
    (batch indices, (ref out [n, 1, H, Dv], has_key [n, 1]))."""
    q, k, v, lengths = inputs
    idx = np.array(sorted({0, q.shape[0] - 1}))
    q, k, v, lengths = (x[idx] for x in (q, k, v, lengths))
    return idx, metrics.reference(q, k, v, lengths, scale=1.0 / math.sqrt(q.shape[-1]),
                                  is_causal=False)


def run_point(name, shape, cfg, impls, import_errors, args, base, deadline):
    """Records for one (B, Skv) point: skipped, or checked and timed per impl."""
    dtype = jnp.dtype(args.dtype)
    kv = kv_bytes(shape, dtype.itemsize)
    extra = {"B": shape["B"], "Skv": shape["Skv"], "kv_bytes": kv}
    order = list(import_errors) + list(impls)  # every impl gets a record, in this order
    skip = None
    if kv > cfg["kv_limit"]:
        skip = f"K+V {fmt_bytes(kv)} > {fmt_bytes(cfg['kv_limit'])}"
    elif time.monotonic() > deadline:
        skip = f"time budget ({args.budget_s:.0f} s) spent"
    if skip:
        return [bench.new_record(base, name, impl, skipped=skip, **extra) for impl in order]

    records = [bench.new_record(base, name, impl, error=err, **extra)
               for impl, err in import_errors.items()]
    to_run = {}
    for impl, fn_align in impls.items():
        if impl == "xla" and shape["B"] * shape["Skv"] > cfg["xla_max_tokens"]:
            records.append(bench.new_record(
                base, name, impl, skipped=f"B*Skv > {cfg['xla_max_tokens']}", **extra))
        else:
            to_run[impl] = fn_align
    if not to_run:
        return sorted(records, key=lambda r: order.index(r["impl"]))
    n_sets = 2 if kv < cfg["rotate_below"] else 1
    try:
        sets = [bench.make_inputs(shape, dtype, args.seed, i) for i in range(n_sets)]
        idx, ref = reference_ends(sets[0])
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: record it, go on to the next
        err = "inputs or reference: " + bench.error_string(e)
        records += [bench.new_record(base, name, impl, error=err, **extra) for impl in to_run]
        return sorted(records, key=lambda r: order.index(r["impl"]))
    lengths = shape["lengths"]
    repeats, target_s = cfg["timing_big"] if kv >= cfg["big"] else cfg["timing"]
    nbytes = metrics.bytes_moved(shape, dtype.itemsize)  # valid K/V + Q + O
    scale = 1.0 / math.sqrt(shape["D"])
    for impl, (fn, align) in to_run.items():
        rec = bench.new_record(base, name, impl, **extra)
        jitted = jax.jit(lambda q, k, v, n, fn=fn: fn(q, k, v, n, scale=scale, is_causal=False))
        try:
            out = jax.block_until_ready(jitted(*sets[0]))
            rec.update(bench.check(out[idx], *ref, [lengths[i] for i in idx], 1, align, False))
            del out
            ms = bench.time_ms(jitted, sets, repeats, target_s)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory; keep going
            rec["error"] = bench.error_string(e)
        else:
            rec.update(ms=ms, eff_tflops=metrics.flops(shape, align) / (ms * 1e-3) / 1e12,
                       eff_tbps=nbytes / (ms * 1e-3) / 1e12)
        records.append(rec)
    return sorted(records, key=lambda r: order.index(r["impl"]))


def int_list(text, default):
    return tuple(int(x) for x in text.split(",")) if text else default


def main(argv=None):
    t_start = time.monotonic()
    args = parse_args(argv)
    cfg = dict(SMOKE_GRID if args.cpu_smoke else GRID)
    cfg["batches"] = int_list(args.batches, cfg["batches"])
    cfg["cache"] = int_list(args.cache, cfg["cache"])
    deadline = t_start + args.budget_s
    names = [n for n in args.impls.split(",") if not (args.cpu_smoke and n == "cudnn")]

    jax_varlen, import_error = (bench.import_jax_varlen() if report.OURS in names
                                else (None, None))
    import_errors = {report.OURS: import_error} if import_error else {}
    impls = bench.build_impls(names, jax_varlen, import_errors)

    device = jax.devices()[0].device_kind
    date = datetime.date.today().isoformat()
    versions = bench.package_versions()
    if jax_varlen is not None:
        versions.setdefault("jax_varlen", getattr(jax_varlen, "__version__", None))
    base = {"dtype": args.dtype, "device": device, "jax": jax.__version__,
            "date": date, "cudnn_version": bench.cudnn_version()}
    tag = args.tag + ("-cpu-smoke" if args.cpu_smoke else "")
    stem = f"{date}-{bench.device_slug(device)}-{tag}"
    meta = {"device": device, "device_count": jax.device_count(), "date": date,
            "versions": dict(versions, cudnn=base["cudnn_version"]),
            "command": " ".join(["python3", "benchmarks/decode_sweep.py", *sys.argv[1:]]),
            "cpu_smoke": args.cpu_smoke, "seed": args.seed,
            "jax_varlen_path": jax_varlen and os.path.dirname(jax_varlen.__file__),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "sweep": dict(cfg), "shapes": {}}

    points = [(b, s) for b in cfg["batches"] for s in cfg["cache"]]
    print(f"{device}, jax {jax.__version__}, cudnn {base['cudnn_version']}; impls {names}; "
          f"{len(points)} points", flush=True)
    records = []
    for batch, skv in points:
        name = f"decode-sweep-B{batch}-S{skv}"
        shape = sweep_shape(batch, skv)
        t0 = time.monotonic()
        point = run_point(name, shape, cfg, impls, import_errors, args, base, deadline)
        for rec in point:
            print(bench.progress_line(rec), flush=True)
        print(f"  ({time.monotonic() - t0:.1f} s; {time.monotonic() - t_start:.0f} s so far)",
              flush=True)
        records += point
        meta["shapes"][name] = shape
        meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
        table = (report.sweep_table(records) + "\n\n## All records\n\n"
                 + report.markdown_table(records, meta["shapes"]))
        paths = report.write_results(args.out, stem, records, meta, table)

    print("\nwrote " + ", ".join(paths) + "\n")
    print(report.sweep_table(records))


if __name__ == "__main__":
    main()
