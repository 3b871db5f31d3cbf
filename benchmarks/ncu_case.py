"""One call of each CUDA kernel on a benchmark shape, for Nsight Compute:

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --target-processes all \
        -k "regex:fwd_(tc|split)_kernel" --launch-count 4 python3 ncu_case.py [--grad] [--packed] [names]

Each named shape of shapes.json (default: d128-full, decode-full) runs twice (the first call
compiles), so `--launch-count 2` per shape profiles a warm launch too. A shape's padded query
rows (lengths_q) go in as nonpad_q_seqlen; --packed calls packed_attention on the shape's valid
tokens instead (bench.Packed, as the benchmark's jax_varlen_packed); --fa3 with --packed runs
FA3's flash_mha_varlen on the same tokens instead (the peer's kernel, side by side with ours in
another ncu run; its kernels match -k "regex:flash|Flash|device_kernel"), and without --packed
FA3 on the padded shape as bench.py times it (flash_mha_varlen with seqused_k); --dew3 runs the
current FA3 build (dew_flash_attn) instead: flash_mha on a padded shape (its lengths ignored:
full shapes only), flash_mha_varlen by the queries' and keys' offsets with --packed. A paged shape
(decode-paged) runs paged_attention on bench.Paged's shuffled cache, or with --fa3
flash_mha_with_kvcache with page_table (bench's fa3_paged, its default num_splits). --runs N: N calls instead
of 2 (kernel_times.py finds one call's kernels as the launches that repeat at the end). With --grad each call
is the gradient of sum(out * dO) (forward and backward kernels, e.g. -k "regex:bwd_"). Without
XLA_PYTHON_CLIENT_PREALLOCATE=false, ncu saves and restores JAX's whole memory pool around
every replay pass.
"""

import functools
import sys

import jax

import bench


def call(jax_varlen, shape, packed, fa3=False, dew3=False):
    """(fn, args): the shape's padded call (lengths_q, where the shape has them, as
    nonpad_q_seqlen), or with `packed` the packed call on its valid tokens (bench.Packed): ours,
    or FA3's with `fa3`."""
    inputs = bench.make_set(shape, jax.numpy.bfloat16, 0, 0)
    causal = shape["causal"]
    scale = shape["D"] ** -0.5
    if shape.get("layout") == "paged":
        paged_args = bench.Paged(shape).pack(*inputs)
        if fa3:
            fns, error = bench.fa3_fn()
            if fns is None:
                sys.exit(error)
            return functools.partial(fns[2], scale=scale, is_causal=causal), paged_args
        return functools.partial(bench.jax_varlen_paged_fn(jax_varlen), scale=scale,
                                 is_causal=causal), paged_args
    if dew3:  # the current FA3 build (dew_flash_attn): fixed-length, or packed by offsets
        import dew_flash_attn
        if packed:
            pk = bench.Packed(shape)
            return (lambda q, k, v, cq, ck: dew_flash_attn.flash_mha_varlen(
                q, k, v, cq, pk.hints["max_seqlen_q"], softmax_scale=scale, is_causal=causal,
                key_cu_seqlens=ck, key_max_seqlen=pk.hints["max_seqlen_k"])), pk.pack(*inputs)
        return (lambda q, k, v, *lengths: dew_flash_attn.flash_mha(
            q, k, v, softmax_scale=scale, is_causal=causal)), inputs
    if packed:
        pk = bench.Packed(shape)
        if fa3:
            fns, error = bench.fa3_fn()
            if fns is None:
                sys.exit(error)
            return (lambda q, k, v, cq, ck: fns[1](q, k, v, cq, ck, scale=scale, is_causal=causal,
                                                    **pk.hints)), pk.pack(*inputs)
        return (lambda q, k, v, cq, ck: jax_varlen.packed_attention(
            q, k, v, cq, ck, is_causal=causal, **pk.hints)), pk.pack(*inputs)
    if fa3:  # the padded call as bench.py times FA3 (flash_mha_varlen with seqused_k)
        fns, error = bench.fa3_fn()
        if fns is None:
            sys.exit(error)
        return functools.partial(fns[0], scale=scale, is_causal=causal), inputs
    return (lambda q, k, v, n, n_q=None: jax_varlen.attention(
        q, k, v, n, nonpad_q_seqlen=n_q, is_causal=causal)), inputs


def main(names, grad, packed, runs, fa3=False, dew3=False):
    jax_varlen, error = bench.import_jax_varlen()
    if jax_varlen is None:
        sys.exit(error)
    shapes = bench.load_shapes()
    for name in names:
        attn, inputs = call(jax_varlen, shapes[name], packed, fa3, dew3)
        f = jax.jit(attn)
        if grad:
            f = jax.jit(jax.grad(lambda *a: attn(*a).astype(jax.numpy.float32).sum(), argnums=(0, 1, 2)))
        for _ in range(runs):
            jax.block_until_ready(f(*inputs))
        print(f"ran {name}{' packed' if packed else ''}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    runs = int(args[args.index("--runs") + 1]) if "--runs" in args else 2
    if "--runs" in args:
        del args[args.index("--runs"):args.index("--runs") + 2]
    flags = {"--grad", "--packed", "--fa3", "--dew3"}
    main([a for a in args if a not in flags] or ["d128-full", "decode-full"], "--grad" in args,
         "--packed" in args, runs, "--fa3" in args, "--dew3" in args)
