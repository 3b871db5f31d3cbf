"""What attention sinks cost (issue 34 item 5: "a sinks row on d128-full", target <= 3%).

Times jax_varlen.attention on one named shape with and without ``sinks`` (one float32 logit per
query head), forward and training step (forward + gradients of q, k, v and, with sinks, of the
sinks), in one process on one device, and prints the ratios. The two calls share their inputs;
the one with sinks is checked against the float32 reference composition first (the rows'
softmax denominators gain exp(sinks[h])), so a fast wrong result cannot pass.

Usage (from the repository root, or with benchmarks/ on sys.path):
    python3 benchmarks/sinks_cost.py [--shape d128-full] [--out DIR] [--cpu-smoke]
--cpu-smoke shrinks the shape (for a machine without a GPU: checks the script, times nothing
meaningful). Writes DIR/sinks-cost.json when --out is given.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
SHAPES = HERE / "shapes.json"  # the copy of shared/bench_shapes.json that travels to the GPU


def load_shape(name: str, smoke: bool) -> dict:
    shapes = json.loads(SHAPES.read_text())["shapes"]
    if name not in shapes:
        sys.exit(f"unknown shape {name!r} (from {SHAPES})")
    s = dict(shapes[name])
    if smoke:  # a few hundred keys: runs in seconds on a CPU
        s.update(B=2, Sq=min(s["Sq"], 96), Skv=min(s["Skv"], 96), H=4, Hkv=2)
        s["lengths"] = [min(n, s["Skv"]) for n in s["lengths"][:2]]
    return s


def timed(fn, args, repeats: int, target_s: float) -> float:
    """Median milliseconds per call over `repeats` bursts of back-to-back calls."""
    jax.block_until_ready(fn(*args))  # compile and warm
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = max(time.perf_counter() - t0, 1e-6)
    n = max(1, min(200, int(target_s / once)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="d128-full")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    import jax_varlen

    s = load_shape(args.shape, args.cpu_smoke)
    dtype = jnp.float32 if args.cpu_smoke else jnp.bfloat16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((s["B"], s["Sq"], s["H"], s["D"])), dtype)
    k = jnp.asarray(rng.standard_normal((s["B"], s["Skv"], s["Hkv"], s["D"])), dtype)
    v = jnp.asarray(rng.standard_normal((s["B"], s["Skv"], s["Hkv"], s["Dv"])), dtype)
    n = jnp.asarray(s["lengths"], jnp.int32)
    sinks = jnp.asarray(rng.uniform(-1.0, 2.0, s["H"]), jnp.float32)
    kw = dict(is_causal=bool(s["causal"]))

    def fwd(q, k, v, sinks=None):
        return jax_varlen.attention(q, k, v, n, sinks=sinks, **kw)

    def loss(q, k, v, sinks=None):
        return jnp.sum(fwd(q, k, v, sinks).astype(jnp.float32) * 1e-3)

    # The sinks call against the composition it must equal: the no-sinks call's (out, lse)
    # reweighted by exp(lse) / (exp(lse) + exp(sinks[h])), in float32.
    out0, lse0 = jax_varlen.attention(q, k, v, n, return_lse=True, **kw)
    want = out0.astype(jnp.float32) * jax.nn.sigmoid(lse0 - sinks[:, None]).swapaxes(1, 2)[..., None]
    got = fwd(q, k, v, sinks).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(got - want)))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    if not err <= tol:
        sys.exit(f"sinks result differs from the composition by {err} (> {tol})")

    repeats, target_s = (3, 0.05) if args.cpu_smoke else (7, 0.3)
    f_plain, f_sinks = jax.jit(fwd), jax.jit(fwd)
    g_plain = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    g_sinks = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    rows = {
        "fwd": (timed(f_plain, (q, k, v), repeats, target_s),
                timed(f_sinks, (q, k, v, sinks), repeats, target_s)),
        "train": (timed(g_plain, (q, k, v), repeats, target_s),
                  timed(g_sinks, (q, k, v, sinks), repeats, target_s)),
    }
    device = jax.devices()[0].device_kind
    records = []
    print(f"sinks cost on {args.shape} ({jnp.dtype(dtype).name}, {device}); check err {err:.2e}")
    print("| pass | no sinks (ms) | sinks (ms) | cost |")
    print("|---|---|---|---|")
    for pass_, (plain, with_sinks) in rows.items():
        cost = with_sinks / plain - 1.0
        print(f"| {pass_} | {plain:.3f} | {with_sinks:.3f} | {cost * 100:+.1f}% |")
        records.append({"shape": args.shape, "pass": pass_, **dict( dtype=jnp.dtype(dtype).name,
                            device=device, ms_no_sinks=plain, ms_sinks=with_sinks,
                            cost=cost, check_err=err)})
    if args.out:
        path = pathlib.Path(args.out) / "sinks-cost.json"
        path.write_text(json.dumps(records, indent=1))
        print(f"wrote {path}")
    if not all(math.isfinite(r["cost"]) for r in records):
        sys.exit("non-finite timing")


if __name__ == "__main__":
    main()
