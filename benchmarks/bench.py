"""Times jax_varlen.attention against jax.nn.dot_product_attention (cudnn, xla) and, when it is
importable, FlashAttention-3's JAX binding (flash-attn3-jax, impl "fa3") on named shapes.

On a GPU machine:   python3 benchmarks/bench.py [--shapes d128-full,...] [--decode] [--quick]
CPU smoke test:     JAX_PLATFORMS=cpu python benchmarks/bench.py --cpu-smoke --impls xla

Every impl sees the same inputs (finite, N(0, 1), padding included). Results go to
<out>/<YYYY-MM-DD>-<device>-<tag>.json (records in shapes.json's `result_record` format) and .md.
"""

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import bench_metrics as metrics
import bench_report as report

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PEERS = ("cudnn", "xla")
FA3 = "fa3"  # flash-attn3-jax: flash_mha_varlen with seqused_k = our lengths (bottom-right causal)
SMOKE_DIV = 32  # --cpu-smoke divides Sq, Skv and lengths by this and keeps B <= 2
L2_BYTES = 50 << 20  # H200 L2; inputs below 4x this are rotated among 3 sets
CHECK_SEQS = 2  # sequences compared against the fp32 reference


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", help="comma-separated names from shapes.json "
                   "(default: all non-decode shapes; --decode adds decode shapes)")
    p.add_argument("--decode", action="store_true", help="include decode shapes (Sq == 1)")
    p.add_argument("--impls", default="jax_varlen,cudnn,fa3,xla")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--tag", default="fwd", help="file-name suffix")
    p.add_argument("--quick", action="store_true", help="fewer repeats, shorter timing loops")
    p.add_argument("--cpu-smoke", action="store_true",
                   help=f"shrink shapes (/{SMOKE_DIV}, B <= 2) and skip cudnn, to test on CPU")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Shapes and inputs

def load_shapes():
    with open(os.path.join(HERE, "shapes.json")) as f:
        return json.load(f)["shapes"]


def select_shapes(all_shapes, names, decode):
    if names:
        unknown = [n for n in names.split(",") if n not in all_shapes]
        if unknown:
            sys.exit(f"unknown shapes {unknown}; known: {list(all_shapes)}")
        return {n: all_shapes[n] for n in names.split(",")}
    return {n: s for n, s in all_shapes.items() if decode or s["Sq"] != 1}


def shrink(shape):
    """--cpu-smoke: e.g. d128-skewed B=8, Sq=Skv=4096, lengths [4096, 685, ...]
    -> B=2, Sq=Skv=128, lengths [128, 21]. Decode keeps Sq = 1; lengths stay >= 1."""
    s = {k: v for k, v in shape.items() if not k.startswith("measured")}  # H200 numbers
    s["Sq"] = max(1, shape["Sq"] // SMOKE_DIV)
    s["Skv"] = max(1, shape["Skv"] // SMOKE_DIV)
    s["lengths"] = [min(s["Skv"], max(1, n // SMOKE_DIV)) for n in shape["lengths"][:2]]
    s["B"] = len(s["lengths"])
    return s


def input_bytes(shape, itemsize):
    """q [B, Sq, H, D] + k [B, Skv, Hkv, D] + v [B, Skv, Hkv, Dv] + out [B, Sq, H, Dv]."""
    b, sq, skv = shape["B"], shape["Sq"], shape["Skv"]
    return itemsize * b * (sq * shape["H"] * (shape["D"] + shape["Dv"])
                           + skv * shape["Hkv"] * (shape["D"] + shape["Dv"]))


def make_inputs(shape, dtype, seed, index):
    """One input set (q, k, v, lengths); set `index` uses its own random stream."""
    b, sq, skv, h, hkv = shape["B"], shape["Sq"], shape["Skv"], shape["H"], shape["Hkv"]
    kq, kk, kv = jax.random.split(jax.random.fold_in(jax.random.key(seed), index), 3)
    q = jax.random.normal(kq, (b, sq, h, shape["D"]), dtype)  # [B, Sq, H, D]
    k = jax.random.normal(kk, (b, skv, hkv, shape["D"]), dtype)  # [B, Skv, Hkv, D]
    v = jax.random.normal(kv, (b, skv, hkv, shape["Dv"]), dtype)  # [B, Skv, Hkv, Dv]
    lengths = jnp.asarray(shape["lengths"], jnp.int32)  # [B]
    return jax.block_until_ready((q, k, v, lengths))


# ---------------------------------------------------------------------------------------------
# Implementations: name -> (fn(q, k, v, lengths, *, scale, is_causal), causal mask alignment)

def import_jax_varlen():
    """Returns (module, None) or (None, error string); a source tree is tried as a fallback."""
    try:
        import jax_varlen
        return jax_varlen, None
    except ImportError:
        sys.path.insert(0, REPO)
    try:
        import jax_varlen
        return jax_varlen, None
    except Exception as e:  # noqa: BLE001 - any failure is recorded, not fatal
        return None, f"import jax_varlen: {type(e).__name__}: {e}"


def fa3_fn():
    """FlashAttention-3's varlen forward on our padded layout, or (None, error) without it: the
    rectangle is flattened to [B*S, heads, dim] with cu_seqlens = b * S and seqused_k = lengths,
    which is the same computation (its causal mask is bottom-right, like ours)."""
    try:
        from flash_attn3_jax import flash_mha_varlen
    except Exception as e:  # noqa: BLE001 - optional peer
        return None, f"import flash_attn3_jax: {type(e).__name__}: {e}"

    def fn(q, k, v, n, *, scale, is_causal):
        b, sq, h, d = q.shape
        skv, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
        cu_q = jnp.arange(b + 1, dtype=jnp.int32) * sq
        cu_k = jnp.arange(b + 1, dtype=jnp.int32) * skv
        out = flash_mha_varlen(q.reshape(b * sq, h, d), k.reshape(b * skv, hkv, d),
                               v.reshape(b * skv, hkv, dv), cu_q, cu_k, seqused_k=n,
                               max_seqlen_q=sq, max_seqlen_k=skv, softmax_scale=scale,
                               is_causal=is_causal)
        return out.reshape(b, sq, h, dv)
    return fn, None


def build_impls(names, jax_varlen, import_errors):
    impls = {}
    for name in names:
        if name == report.OURS:
            if jax_varlen is not None:
                impls[name] = (lambda q, k, v, n, *, scale, is_causal: jax_varlen.attention(
                    q, k, v, n, scale=scale, is_causal=is_causal), metrics.TAIL)
        elif name == FA3:
            fn, err = fa3_fn()
            if fn is None:
                import_errors[name] = err
            else:
                impls[name] = (fn, metrics.TAIL)
        elif name in PEERS:
            impls[name] = (lambda q, k, v, n, *, scale, is_causal, impl=name:
                           jax.nn.dot_product_attention(
                               q, k, v, key_value_seq_lengths=n, scale=scale,
                               is_causal=is_causal, implementation=impl), metrics.TOP_LEFT)
        else:
            sys.exit(f"unknown impl {name!r}; known: {report.OURS}, {FA3}, {', '.join(PEERS)}")
    return impls


# ---------------------------------------------------------------------------------------------
# Timing and checking

def time_ms(fn, input_sets, repeats, target_s):
    """Median over `repeats` of (elapsed / n_iter) for n_iter calls issued back to back and
    synchronized once at the end, cycling through input_sets. fn is compiled and warm."""
    for _ in range(2):
        jax.block_until_ready(fn(*input_sets[0]))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*input_sets[1 % len(input_sets)]))
    one = time.perf_counter() - t0
    n_iter = max(3, min(1000, math.ceil(target_s / max(one, 1e-6))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(n_iter):
            out = fn(*input_sets[i % len(input_sets)])
        out.block_until_ready()  # one stream: the last call finishing means all have
        times.append((time.perf_counter() - t0) / n_iter)
    return 1e3 * statistics.median(times)


def check(out, ref, has_key, lengths, seqlen_q, align, is_causal):
    """Compares `out` on the first CHECK_SEQS sequences where the impl's mask equals ours
    (a top-left causal mask equals the tail-aligned one only when n_b == Sq)."""
    seqs = [b for b, n in enumerate(lengths[:CHECK_SEQS])
            if align == metrics.TAIL or not is_causal or n == seqlen_q]
    err = metrics.max_abs_err(out, ref, has_key, seqs)
    if err is None:
        return {"max_err": None, "check": "skipped (masks differ)"}
    if math.isnan(err):
        return {"max_err": None, "check": "non-finite output"}
    return {"max_err": err, "check": "ok" if err <= metrics.MAX_ERR_TOL else "MISMATCH"}


def error_string(e):
    return f"{type(e).__name__}: {e}"[:1000]


def new_record(base, shape_name, impl, **extra):
    """A `result_record` of shapes.json, keys in its order; ms/eff_* are filled after timing."""
    return {"shape": shape_name, "impl": impl, "pass": "fwd", "dtype": base["dtype"], "ms": None,
            "eff_tflops": None, "eff_tbps": None, **base, **extra}


def run_shape(name, shape, impls, import_errors, args, base_record):
    """Checks and times every impl on one shape; returns its records."""
    dtype = jnp.dtype(args.dtype)
    decode = shape["Sq"] == 1
    n_sets = 3 if input_bytes(shape, dtype.itemsize) < 4 * L2_BYTES else 1
    sets = [make_inputs(shape, dtype, args.seed, i) for i in range(n_sets)]
    scale = 1.0 / math.sqrt(shape["D"])
    ref = None
    if not decode:  # fp32 reference on the first sequences, tail-aligned causal
        q, k, v, lengths = (x[:CHECK_SEQS] for x in sets[0])
        ref = metrics.reference(q, k, v, lengths, scale=scale, is_causal=shape["causal"])
    repeats, target_s = (3, 0.05) if args.quick else (7, 0.3)
    nbytes = metrics.bytes_moved(shape, dtype.itemsize)

    records = [new_record(base_record, name, impl, error=err)
               for impl, err in import_errors.items()]
    for rec in records:
        print(progress_line(rec), flush=True)
    for impl, (fn, align) in impls.items():
        rec = new_record(base_record, name, impl)
        jitted = jax.jit(lambda q, k, v, n, fn=fn: fn(q, k, v, n, scale=scale,
                                                      is_causal=shape["causal"]))
        try:
            out = jax.block_until_ready(jitted(*sets[0]))
            if ref is not None:
                rec.update(check(out, *ref, shape["lengths"], shape["Sq"], align,
                                 shape["causal"]))
            del out
            ms = time_ms(jitted, sets, repeats, target_s)
        except Exception as e:  # noqa: BLE001 - e.g. cudnn rejecting a shape; keep going
            rec["error"] = error_string(e)
        else:
            rec.update(ms=ms, eff_tflops=metrics.flops(shape, align) / (ms * 1e-3) / 1e12,
                       eff_tbps=nbytes / (ms * 1e-3) / 1e12)
        records.append(rec)
        print(progress_line(rec), flush=True)
    return records


def progress_line(rec):
    """'  d128-full   cudnn   12.345 ms  max_err 3.91e-03 ok' (or the error's first line)."""
    parts = [f"  {rec['shape']:26s} {rec['impl']:11s}",
             f"{rec['ms']:9.3f} ms" if rec["ms"] is not None
             else "  skipped" if rec.get("skipped") else "   failed"]
    if rec.get("skipped"):
        parts.append(rec["skipped"])
    if rec.get("max_err") is not None:
        parts.append(f"max_err {rec['max_err']:.2e} {rec['check']}")
    elif "check" in rec:
        parts.append(rec["check"])
    if rec.get("error"):
        parts.append(rec["error"].splitlines()[0][:120])
    return "  ".join(parts)


# ---------------------------------------------------------------------------------------------
# Environment

def device_slug(kind):
    """'NVIDIA H200' -> 'h200'; 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'; 'cpu' -> 'cpu'."""
    kind = kind.lower().removeprefix("nvidia").strip()
    return "-".join(kind.split())


def cudnn_version():
    """'9.19.0' from the CUDA plugin's version module, or None without one."""
    try:
        from jax._src.lib import cuda_versions
        v = cuda_versions.cudnn_get_version()  # e.g. 91900
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    except Exception:  # noqa: BLE001 - CPU-only jaxlib, or an internal module that moved
        return None


def package_versions():
    names = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
             "jax-cuda12-pjrt", "jax_varlen")
    versions = {}
    for n in names + ("flash-attn3-jax",):
        try:
            versions[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def main(argv=None):
    args = parse_args(argv)
    shapes = select_shapes(load_shapes(), args.shapes, args.decode)
    if args.cpu_smoke:
        shapes = {n: shrink(s) for n, s in shapes.items()}
        args.quick = True  # a logic test: short timing loops
    names = [n for n in args.impls.split(",") if not (args.cpu_smoke and n in ("cudnn", FA3))]

    jax_varlen, import_error = (import_jax_varlen() if report.OURS in names else (None, None))
    import_errors = {report.OURS: import_error} if import_error else {}
    impls = build_impls(names, jax_varlen, import_errors)

    device = jax.devices()[0].device_kind
    date = datetime.date.today().isoformat()
    versions = package_versions()
    if jax_varlen is not None:
        versions.setdefault("jax_varlen", getattr(jax_varlen, "__version__", None))
    base = {"dtype": args.dtype, "device": device, "jax": jax.__version__,
            "date": date, "cudnn_version": cudnn_version()}

    print(f"{device}, jax {jax.__version__}, cudnn {base['cudnn_version']}; "
          f"impls {names}; {len(shapes)} shapes", flush=True)
    records = []
    for name, shape in shapes.items():
        records += run_shape(name, shape, impls, import_errors, args, base)

    tag = args.tag + ("-cpu-smoke" if args.cpu_smoke else "")
    stem = f"{date}-{device_slug(device)}-{tag}"
    meta = {"device": device, "device_count": jax.device_count(), "date": date,
            "versions": dict(versions, cudnn=base["cudnn_version"]),
            "command": " ".join(["python3", "benchmarks/bench.py", *sys.argv[1:]]),
            "cpu_smoke": args.cpu_smoke, "quick": args.quick, "seed": args.seed,
            "jax_varlen_path": jax_varlen and os.path.dirname(jax_varlen.__file__),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "shapes": shapes}
    table = report.markdown_table(records, shapes)
    paths = report.write_results(args.out, stem, records, meta, table)
    print("\nwrote " + ", ".join(paths) + "\n")
    print(table)


if __name__ == "__main__":
    main()
