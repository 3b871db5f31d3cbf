"""One call of each CUDA kernel on a benchmark shape, for Nsight Compute:

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --target-processes all \
        -k "regex:fwd_(tc|split)_kernel" --launch-count 4 python3 ncu_case.py [--grad] [names]

Each named shape of shapes.json (default: d128-full, decode-full) runs twice (the first call
compiles), so `--launch-count 2` per shape profiles a warm launch too. With --grad each call
is the gradient of sum(out * dO) (forward and backward kernels, e.g. -k "regex:bwd_"). Without
XLA_PYTHON_CLIENT_PREALLOCATE=false, ncu saves and restores JAX's whole memory pool around
every replay pass.
"""

import sys

import jax

import bench


def main(names, grad):
    jax_varlen, error = bench.import_jax_varlen()
    if jax_varlen is None:
        sys.exit(error)
    shapes = bench.load_shapes()
    for name in names:
        shape = shapes[name]
        q, k, v, n = bench.make_inputs(shape, jax.numpy.bfloat16, 0, 0)
        f = jax.jit(lambda q, k, v, n: jax_varlen.attention(q, k, v, n, is_causal=shape["causal"]))
        if grad:
            attn = f
            f = jax.jit(jax.grad(lambda q, k, v, n: attn(q, k, v, n).astype(jax.numpy.float32).sum(),
                                 argnums=(0, 1, 2)))
        for _ in range(2):
            jax.block_until_ready(f(q, k, v, n))
        print(f"ran {name}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    grad = "--grad" in args
    main([a for a in args if a != "--grad"] or ["d128-full", "decode-full"], grad)
