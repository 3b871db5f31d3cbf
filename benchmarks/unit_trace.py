"""Where a Hopper forward unit's time goes, from the kernel's own unit trace.

Needs a profiling build (`-DJAX_VARLEN_FWD_TRACE=ON`; `CMAKE_DEFINES=-DJAX_VARLEN_FWD_TRACE=ON
bash benchmarks/prebuild.sh . SITE`): the forward then records, per CTA of its persistent grid
and per unit it took, the SM clock at each step of the unit (ffi/cuda/sm90/fwd_trace.h). Usage:

    python3 unit_trace.py [--packed] [--out FILE.json] [--raw DIR] [shape names]   (default: d128-skewed)

For each named shape of shapes.json: one traced call of our forward (ncu_case.call: the padded
call, or the packed one on the valid tokens with --packed) after two warm ones, then per unit and
consumer warpgroup (clock64 deltas within a CTA, in us at the SM clock the trace measures):

    q_wait  unit in hand -> its Q tile landed     (the producer's Q copy behind the last unit's)
    loop    Q landed -> last Q K^T done           (every tile's S; all P V but the first tile's)
    tail    -> the first tile's P V done          (the last product)
    epi     -> the epilogue's stores issued
    gap     -> the next unit in hand              (the hand-over)

and a least-squares fit of a unit's whole time (in hand to next in hand) to a + b * tiles: b is
the time of a key tile, a what a unit costs beside its tiles. Also the producer's wait for the
previous Q's release, the CTAs' finish spread (the tail of the persistent grid) and the kernel's
time (globaltimer, first start to last end). XLA's command buffers are switched off (a captured
graph would keep the first launch's trace pointer).
"""

import argparse
import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench  # noqa: E402
import ncu_case  # noqa: E402

# ffi/cuda/sm90/fwd_trace.h's fields.
SEQ, TILES, ROWS, CLAIM, Q_ISSUED, LOADED, GOT = range(7)
WG_STRIDE = 5  # GOT, Q, LOOP, MMA, STORED per consumer warpgroup


def traced(ext, fn, args):
    """The trace of one call of fn(*args): [CTAs, 1 + rounds, fields] int64, -1 where unset."""
    jf = jax.jit(fn)
    for _ in range(2):
        jax.block_until_ready(jf(*args))
    ext.fwd_trace()  # clear
    jax.block_until_ready(jf(*args))
    return np.frombuffer(ext.fwd_trace(), np.int64).reshape(ext.fwd_trace_shape)


def analyse(trace):
    """Statistics of one call's trace (see the module's docstring)."""
    head = trace[:, 0, :]
    ctas = np.nonzero(head[:, 0] >= 0)[0]
    if len(ctas) == 0:
        return {"error": "nothing traced: not the Hopper forward's path, or not a trace build"}
    start_ns, start_clk, end_ns, end_clk = (head[ctas, i].astype(np.float64) for i in (0, 1, 5, 6))
    ghz = float(np.median((end_clk - start_clk) / np.maximum(end_ns - start_ns, 1)))
    us = lambda cycles: cycles / ghz / 1e3  # noqa: E731
    units, fit_x, fit_y = [], [], []
    phases = {k: [] for k in ("q_wait", "loop", "tail", "epi", "gap")}
    producer_q_wait = []
    for c in ctas:
        rows = trace[c, 1:, :]
        taken = np.nonzero(rows[:, GOT] >= 0)[0]
        for i, r in enumerate(taken):
            row = rows[r]
            units.append(int(row[TILES]))
            nxt = rows[taken[i + 1]] if i + 1 < len(taken) else None
            for wg in (0, 1):
                got, q, loop, mma, stored = (row[GOT + WG_STRIDE * wg + k] for k in range(5))
                if q >= 0 and loop >= 0 and mma >= 0 and stored >= 0:
                    phases["q_wait"].append(us(q - got))
                    phases["loop"].append(us(loop - q))
                    phases["tail"].append(us(mma - loop))
                    phases["epi"].append(us(stored - mma))
                    if nxt is not None and nxt[GOT + WG_STRIDE * wg] >= 0:
                        phases["gap"].append(us(nxt[GOT + WG_STRIDE * wg] - stored))
            if nxt is not None:  # the unit's whole time on warpgroup 0: in hand to next in hand
                fit_x.append(row[TILES])
                fit_y.append(us(nxt[GOT] - row[GOT]))
            if i > 0 and row[Q_ISSUED] >= 0 and row[CLAIM] >= 0:
                producer_q_wait.append(us(row[Q_ISSUED] - row[CLAIM]))
    x, y = np.asarray(fit_x, np.float64), np.asarray(fit_y, np.float64)
    per_unit, per_tile = (np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)[0]
                          if len(x) > 2 else (float("nan"), float("nan")))
    mean = lambda v: float(np.mean(v)) if len(v) else float("nan")  # noqa: E731
    return {
        "sm_clock_ghz": ghz,
        "ctas": int(len(ctas)),
        "units": len(units),
        "tiles_per_unit": mean(units),
        "fit_us_per_unit": float(per_unit),
        "fit_us_per_tile": float(per_tile),
        **{f"{k}_us": mean(v) for k, v in phases.items()},
        **{f"{k}_us_p90": float(np.percentile(v, 90)) if len(v) else float("nan") for k, v in phases.items()},
        "producer_q_wait_us": mean(producer_q_wait),
        "finish_spread_us": float((end_ns.max() - end_ns.min()) / 1e3),
        "kernel_us": float((end_ns.max() - start_ns.min()) / 1e3),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=["d128-skewed"])
    ap.add_argument("--packed", action="store_true", help="the packed call on the shape's valid tokens")
    ap.add_argument("--out", help="write the statistics here (JSON)")
    ap.add_argument("--raw", help="and each call's whole trace here (DIR/SHAPE[-packed].npz: trace [CTAs, 1 + rounds,"
                    " fields] int64), for a look at single units after the call")
    a = ap.parse_args()
    jax_varlen, error = bench.import_jax_varlen()
    if jax_varlen is None:
        sys.exit(error)
    ext = jax_varlen._ffi.extension()
    if not hasattr(ext, "fwd_trace"):
        sys.exit("unit_trace.py: this build has no unit trace (configure with -DJAX_VARLEN_FWD_TRACE=ON)")
    ext.fwd_trace()  # allocates the buffer before any traced call
    shapes = bench.load_shapes()
    results = {}
    for name in a.names:
        fn, args = ncu_case.call(jax_varlen, shapes[name], a.packed)
        trace = traced(ext, fn, args)
        results[name] = analyse(trace)
        if a.raw:
            os.makedirs(a.raw, exist_ok=True)
            np.savez_compressed(os.path.join(a.raw, name + ("-packed" if a.packed else "") + ".npz"), trace=trace)
    cols = ("units", "tiles_per_unit", "fit_us_per_tile", "fit_us_per_unit", "q_wait_us", "loop_us", "tail_us",
            "epi_us", "gap_us", "producer_q_wait_us", "finish_spread_us", "kernel_us")
    print("| shape | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, r in results.items():
        cells = (f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols)
        print(f"| {name}{' packed' if a.packed else ''} | " + " | ".join(cells) + " |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
