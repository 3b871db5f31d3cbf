"""Chunked prefill over a paged KV cache, one process: ``paged_attention`` with the pages read in
place by the Hopper forward (JAX_VARLEN_PAGED_SM90=1, the plan asked at each jit) against the
gathered path (the pages copied into a padded key first) and ``attention`` on the dense keys
(no pages: the floor). bf16, causal, shuffled pages; prints one markdown table.

  python benchmarks/paged_chunks.py [--batch 8 --chunk 512 --keys 8192 --page-size 64]
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_varlen
from jax_varlen.__main__ import median_ms  # the demo's timer: median of runs after warm-up


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--chunk", type=int, default=512, help="queries per sequence (the chunk)")
    p.add_argument("--keys", type=int, default=8192, help="keys per sequence (history + chunk)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--heads", default="32,8", help="H,Hkv")
    p.add_argument("--dim", type=int, default=128)
    a = p.parse_args()
    H, Hkv = (int(x) for x in a.heads.split(","))
    B, Sq, n, ps, D = a.batch, a.chunk, a.keys, a.page_size, a.dim
    rng = np.random.default_rng(0)
    pages_per_seq = -(-n // ps)
    num_pages = B * pages_per_seq
    table = rng.permutation(num_pages).astype(np.int32).reshape(B, pages_per_seq)
    kc = jnp.asarray(rng.standard_normal((num_pages, ps, Hkv, D)), jnp.bfloat16)
    vc = jnp.asarray(rng.standard_normal((num_pages, ps, Hkv, D)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((B, Sq, H, D)), jnp.bfloat16)
    seqlens = jnp.full((B,), n, jnp.int32)
    rows = jnp.asarray(table)[:, :, None] * ps + jnp.arange(ps)[None, None, :]
    dense_k = kc.reshape(-1, Hkv, D)[rows.reshape(B, -1)][:, :n]
    dense_v = vc.reshape(-1, Hkv, D)[rows.reshape(B, -1)][:, :n]
    flops = 4 * B * H * D * (Sq * (n - Sq) + Sq * (Sq + 1) / 2)

    def use_switch(value):
        """The plan reads JAX_VARLEN_PAGED_SM90 when a call is traced and again when it runs, so
        each path is compiled and timed with its own setting."""
        if value is None:
            os.environ.pop("JAX_VARLEN_PAGED_SM90", None)
        else:
            os.environ["JAX_VARLEN_PAGED_SM90"] = value

    def paged():  # a new function per path: jit caches traces by function
        return lambda *x: jax_varlen.paged_attention(*x, is_causal=True)

    dense = lambda q, k, v, n: jax_varlen.attention(q, k, v, n, is_causal=True)  # noqa: E731
    paged_args = (q, kc, vc, jnp.asarray(table), seqlens)
    results, ref = [], None
    for name, switch, f, args in (("paged, gathered", None, paged(), paged_args),
                                  ("paged, in place (JAX_VARLEN_PAGED_SM90=1)", "1", paged(), paged_args),
                                  ("dense keys (attention)", None, dense, (q, dense_k, dense_v, seqlens))):
        use_switch(switch)
        f = jax.jit(f)
        out = np.asarray(f(*args), np.float32)
        err = 0.0 if ref is None else float(np.max(np.abs(out - ref)))
        ref = out if ref is None else ref
        ms = median_ms(f, *args, iters=20)
        ran = jax_varlen._ffi.extension().last_launch() or {}  # None without CUDA
        kernel = f"{ran.get('fwd_path')}{', paged' if ran.get('paged') else ''}" if ran else "cpu"
        results.append((name, ms, flops / ms / 1e9, err, kernel))
    print(f"{jax.devices()[0].device_kind}: B={B}, chunk {Sq}, keys {n}, page_size {ps}, H={H}, "
          f"Hkv={Hkv}, D={D}, causal, bf16")
    print("| path | kernel that ran | ms | TFLOP/s | max diff to gathered |\n|---|---|---:|---:|---:|")
    for name, ms, tf, err, kernel in results:
        print(f"| {name} | {kernel} | {ms:.3f} | {tf:.0f} | {err:.2e} |")


if __name__ == "__main__":
    main()
