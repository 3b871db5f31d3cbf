"""One call of each CUDA forward kernel on a benchmark shape, for Nsight Compute.

    ncu --clock-control none --target-processes all -k regex:fwd_ python3 ncu_case.py [names]

Each named shape of shapes.json (default: d128-full, decode-full) is compiled, run once to
warm up, then run once more inside the profiled range (cudaProfilerStart/Stop through
jax.profiler is not needed: filter by kernel name and launch count instead).
"""

import sys

import jax

import bench


def main(names):
    shapes = bench.load_shapes()
    for name in names:
        shape = shapes[name]
        q, k, v, n = bench.make_inputs(shape, jax.numpy.bfloat16, 0, 0)
        f = jax.jit(lambda q, k, v, n: bench.import_jax_varlen()[0].attention(
            q, k, v, n, is_causal=shape["causal"]))
        jax.block_until_ready(f(q, k, v, n))
        jax.block_until_ready(f(q, k, v, n))
        print(f"ran {name}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["d128-full", "decode-full"])
