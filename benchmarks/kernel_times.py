"""Per-kernel GPU times of the last call in an Nsight Compute CSV, e.g. of ncu_case.py:

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --metrics gpu__time_duration.sum --csv \\
        --target-processes all python3 ncu_case.py --runs 3 --grad prefill-right-padded > t.csv
    python3 kernel_times.py t.csv [--last N]

With `ncu_case.py --runs 3`, the last call's kernels are the CSV's longest tail that the
launches before it repeat (or the last N with --last). Prints each kernel's name (shortened) and microseconds, then
the total: where a call's time goes, kernel by kernel (ncu serializes launches, so gaps
between kernels are not counted).
"""

import csv
import sys


def rows(path):
    """[(id, kernel name, microseconds)] of gpu__time_duration.sum rows, in launch order."""
    out = []
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(r["Metric Value"].replace(",", ""))
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
                 "second": 1e6, "s": 1e6}[r["Metric Unit"]]  # ncu writes either spelling
        out.append((int(r["ID"]), r["Kernel Name"], value * scale))
    return out


def last_run(launches, last=None):
    """One call's launches: the last `last`, or the longest tail (at most half) that the
    launches before it repeat (ncu_case.py --runs 3: the second and third calls launch the same
    kernels; the longest, since a call may itself launch one kernel twice in a row)."""
    if last:
        return launches[-last:]
    names = [name for _, name, _ in launches]
    for period in range(len(names) // 2, 0, -1):
        if names[-period:] == names[-2 * period:-period]:
            return launches[-period:]
    return launches


def main(argv):
    last = int(argv[argv.index("--last") + 1]) if "--last" in argv else None
    for path in [a for a in argv if a.endswith(".csv")]:
        launches = last_run(rows(path), last)
        print(f"{path}: {len(launches)} kernels")
        for _, name, us in launches:
            print(f"  {us:9.1f} us  {name[:100]}")
        print(f"  {sum(us for _, _, us in launches):9.1f} us  total")


if __name__ == "__main__":
    main(sys.argv[1:])
