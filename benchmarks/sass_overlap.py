"""How much of the Hopper forward's softmax runs under its own warpgroup's P V, read from SASS.

The consumer mainloop (ffi/cuda/sm90/fwd_mma.h) issues S = Q K^T and O += P V back to back,
waits for S (``wgmma.wait_group 1`` -> ``WARPGROUP.DEPBAR.LE gsb0, 0x1``), runs the softmax and
only then waits for P V (``0x0``). ptxas decides where the second wait lands; every softmax
instruction it leaves between the two runs under this warpgroup's P V. For each forward kernel
in an object this prints, per pair of waits, the instructions between them and how many of
them are the softmax's (FMNMX: row max, SHFL: its reduction, FFMA and MUFU.EX2: the exponent).
FlashAttention-3's d128 kernel keeps the row max and about 20 of 88 exponents there.

    python3 benchmarks/sass_overlap.py OBJECT [--kernel SUBSTRING] [--cuobjdump PATH]

OBJECT: a .o or .cubin with sm_90a code (an instantiation of run_fwd_sm90 compiled with
nvcc -c; or a peer's shared library). cuobjdump comes with the CUDA toolkit (or pip's
nvidia-cuda-cuobjdump).
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess

SOFTMAX_OPS = ("FMNMX", "SHFL", "FFMA", "MUFU.EX2")


def kernels(sass: str) -> dict[str, list[str]]:
    """Function name -> its instructions (opcode and operands), in order."""
    out: dict[str, list[str]] = {}
    name = None
    for line in sass.splitlines():
        if "Function :" in line:
            name = line.split("Function :")[1].strip()
            out[name] = []
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(\S.*?);", line)
        if m and name:
            out[name].append(m.group(1))
    return out


def windows(ins: list[str]) -> list[tuple[int, collections.Counter]]:
    """(length, softmax opcode counts) of each stretch from a `gsb0, 0x1` wait to the next `0x0`."""
    res = []
    i = 0
    while i < len(ins):
        if re.search(r"DEPBAR\.LE gsb0, ?0x1\b", ins[i]):
            j = i + 1
            while j < len(ins) and not re.search(r"DEPBAR\.LE gsb0, ?0x0\b", ins[j]):
                j += 1
            count = collections.Counter()
            for x in ins[i:j]:
                op = x.split()[1] if x.startswith("@") else x.split()[0]
                for k in SOFTMAX_OPS:
                    if op.startswith(k):
                        count[k] += 1
            res.append((j - i, count))
            i = j
        i += 1
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("object")
    ap.add_argument("--kernel", default="fwd_sm90_kernel", help="substring of the kernels' names")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    args = ap.parse_args()
    sass = subprocess.run([args.cuobjdump, "-sass", args.object], capture_output=True, text=True, check=True).stdout
    for name, ins in kernels(sass).items():
        if args.kernel not in name:
            continue
        ws = windows(ins)
        if not ws:
            continue
        cells = [f"{n} instr: " + " ".join(f"{k} {c[k]}" for k in SOFTMAX_OPS if c[k]) for n, c in ws]
        print(name[-90:])
        print("   " + " | ".join(cells))


if __name__ == "__main__":
    main()
