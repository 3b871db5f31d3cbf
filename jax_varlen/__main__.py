"""``python -m jax_varlen``: check and time ``jax_varlen.attention`` on a skewed padded batch.

Builds one batch whose lengths are drawn (fixed seed) so that about a quarter of the keys are
valid, runs ``attention`` under ``jax.jit`` and under ``jax.vmap`` (two stacked batches) on the
default device, compares both with ``jax_varlen.reference``, and times it against padded
``jax.nn.dot_product_attention(..., key_value_seq_lengths=lens)`` (``implementation="xla"``, and
``"cudnn"`` on a GPU).

Then a training step: ``jax.jit(jax.grad(...))`` of ``sum(out * d_out)`` (a fixed random
``d_out`` in the dtype of ``out``) with respect to query, key and value, compared with the same
gradients of ``jax_varlen.reference`` in float32 at ``"highest"`` matmul precision (max error
relative to the oracle's max magnitude, per gradient), with exactly zero gradient required on
the padded keys and values; it is timed against the gradients of the same padded
``jax.nn.dot_product_attention`` calls.

``--causal`` runs a right-padded causal prefill, so that every implementation computes the
same thing: Sq == Skv (give one of ``--seqlen-q``/``--seqlen-k``, or both equal), sequence b
has ``lens[b]`` real queries and keys at the start of its rows, and query i sees key j iff
``j <= i``. Ours gets ``nonpad_q_seqlen=lens`` (its causal mask is tail-aligned on the real
counts, which is this one when they are equal), jax.nn gets ``query_seq_lengths=lens`` and
``key_value_seq_lengths=lens``. Only the real query rows are compared (padded rows are
zero for ours and arbitrary for jax.nn), and ``d_out`` is zero on the padded rows, so the
gradients compare too.

Exit status: 0 when all three checks (jit, vmap, grad) pass, 1 when one fails, 2 when the
package cannot run here (the compiled extension is missing, or it was built without CUDA and
the device is a GPU).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np

_DTYPES = ("float32", "bfloat16", "float16")
# Elementwise check: |ours - reference| <= atol + rtol * |reference|. Outputs are O(1) (softmax
# averages of N(0, 1) values), so the half-precision bounds are a few units in the last place.
_TOLERANCE = {"float32": (1e-4, 1e-4), "float16": (2e-3, 4e-3), "bfloat16": (1.6e-2, 3.2e-2)}
# Gradient check: max |ours - oracle| <= rtol * max |oracle|, per gradient. An elementwise bound
# does not fit gradients: d_key and d_value sum over all Sq queries, so entries near zero carry
# the rounding of much larger terms. float32 covers accumulation order; 16-bit covers the
# gradient's own rounding (2^-12 float16, 2^-9 bfloat16 relative), the rounded ``out`` inside
# the backward's row sums, and kernels that round P and dS to the input dtype.
_GRAD_RTOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}
_GRAD_NAMES = ("dq", "dk", "dv")
_SEED = 0
_VMAP_SIZE = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m jax_varlen",
        description="Check jax_varlen.attention against jax_varlen.reference (under jit and "
        "vmap) and its jax.grad (under jit) against the reference's, and time both against "
        "padded jax.nn.dot_product_attention.",
    )
    p.add_argument("--batch", type=int, default=8, help="B (default 8)")
    p.add_argument("--seqlen-q", type=int, default=None,
                   help="Sq (default 512; with --causal, Skv's)")
    p.add_argument("--seqlen-k", type=int, default=None,
                   help="Skv, padded (default 512; with --causal, Sq's)")
    p.add_argument("--heads", type=int, default=8, help="H, query heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="Hkv, must divide H (default: H, i.e. MHA)")
    p.add_argument("--head-dim", type=int, default=64, help="D (default 64)")
    p.add_argument("--dtype", choices=_DTYPES, default=None,
                   help="default: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--causal", action="store_true",
                   help="a right-padded causal prefill: Sq == Skv, each sequence's real "
                   "queries and keys both number lens[b]; ours gets nonpad_q_seqlen=lens, "
                   "jax.nn query_seq_lengths=key_value_seq_lengths=lens (the same mask), and "
                   "real query rows are compared")
    p.add_argument("--valid-fraction", type=float, default=0.25,
                   help="share of the B * Skv keys that are real, and with --causal of the "
                   "queries too (default 0.25)")
    p.add_argument("--iters", type=int, default=10,
                   help="timed runs per implementation, after 2 warm-up runs (default 10)")
    args = p.parse_args(argv)
    if args.causal:
        if None not in (args.seqlen_q, args.seqlen_k) and args.seqlen_q != args.seqlen_k:
            p.error(f"--causal runs a right-padded causal prefill, which needs --seqlen-q equal "
                    f"to --seqlen-k; got {args.seqlen_q} and {args.seqlen_k} (give one of them)")
        args.seqlen_q = args.seqlen_k = args.seqlen_q or args.seqlen_k or 512
    else:
        args.seqlen_q = 512 if args.seqlen_q is None else args.seqlen_q
        args.seqlen_k = 512 if args.seqlen_k is None else args.seqlen_k
    if args.kv_heads is None:
        args.kv_heads = args.heads
    for name in ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "head_dim", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads ({args.kv_heads}) must divide --heads ({args.heads})")
    if not 0.0 < args.valid_fraction <= 1.0:
        p.error(f"--valid-fraction must lie in (0, 1], got {args.valid_fraction}")
    return args


# ---------------------------------------------------------------------------------------------
# Can the package run here?

def _installed_extension_dir():
    """The folder of an installed ``_jax_varlen`` extension, from pip's record, or None."""
    try:
        dist = importlib.metadata.distribution("jax_varlen")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name.startswith("_jax_varlen") and f.suffix in (".so", ".pyd"):
            path = pathlib.Path(dist.locate_file(f)).resolve()
            if path.exists():
                return path.parent
    return None


def _fail_missing_extension():
    import jax_varlen

    package_dir = pathlib.Path(jax_varlen.__file__).resolve().parent
    installed = _installed_extension_dir()
    if installed is not None and installed != package_dir:
        msg = (
            f"python imported jax_varlen from {package_dir}, a source folder without the "
            f"compiled extension: the current directory comes first on sys.path and shadows "
            f"the installed package in {installed}.\n"
            f"fix: run `python -m jax_varlen` from another directory (for example `cd /tmp`)."
        )
    else:
        msg = (
            "jax_varlen's compiled extension (jax_varlen._jax_varlen) is not installed.\n"
            "fix: install the package from the repository root with `pip install .` "
            "(needs a C++17 compiler; CMake and the rest come from PyPI), then run "
            "`python -m jax_varlen` again."
        )
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def check_runnable(device):
    from jax_varlen import _ffi

    try:
        _ffi.extension()
    except ImportError:
        _fail_missing_extension()
    if device.platform == "gpu" and not _ffi.has_cuda():
        print(
            f"error: the default device is a GPU ({device.device_kind}) but jax_varlen was built "
            "without its CUDA kernels.\nfix: reinstall with nvcc on PATH (`pip install .`; force "
            "it with JAX_VARLEN_CUDA=ON), or run on the CPU with JAX_PLATFORMS=cpu.",
            file=sys.stderr,
        )
        sys.exit(2)


# ---------------------------------------------------------------------------------------------
# Inputs

def skewed_lengths(rng, batch: int, seqlen_k: int, fraction: float) -> np.ndarray:
    """``batch`` lengths in ``[1, seqlen_k]`` summing to ``round(fraction * batch * seqlen_k)``.

    One sequence, at a random index, is as long as the total allows (the full ``seqlen_k`` by
    default); the others share the rest by uniform Dirichlet weights, so most are short. E.g.
    B=8, Skv=512, fraction 0.25: a total of 1024 keys, one sequence of 512 and seven sharing 512.
    """
    total = min(max(int(round(fraction * batch * seqlen_k)), batch), batch * seqlen_k)
    lengths = np.ones(batch, np.int64)
    longest = int(rng.integers(batch))
    lengths[longest] = min(seqlen_k, total - (batch - 1))
    weights = rng.dirichlet(np.ones(batch))
    remaining = total - int(lengths.sum())
    while remaining > 0:
        room = seqlen_k - lengths
        w = np.where(room > 0, weights, 0.0)
        share = np.minimum(np.floor(w / w.sum() * remaining).astype(np.int64), room)
        if share.sum() == 0:  # fewer keys left than sequences: one each to the heaviest
            heaviest = np.argsort(-w)[:remaining]
            share[heaviest[room[heaviest] > 0]] = 1
        lengths += share
        remaining -= int(share.sum())
    return lengths


def make_batch(key, args, dtype):
    """query [B, Sq, H, D], key [B, Skv, Hkv, D], value [B, Skv, Hkv, D]; padding is finite."""
    import jax

    kq, kk, kv = jax.random.split(key, 3)
    B, Sq, Skv, D = args.batch, args.seqlen_q, args.seqlen_k, args.head_dim
    q = jax.random.normal(kq, (B, Sq, args.heads, D), dtype)
    k = jax.random.normal(kk, (B, Skv, args.kv_heads, D), dtype)
    v = jax.random.normal(kv, (B, Skv, args.kv_heads, D), dtype)
    return q, k, v


# ---------------------------------------------------------------------------------------------
# Checks and timing

def real_rows(lengths, seqlen_q):
    """[..., B, Sq] bool: query row i of sequence b is real (i < lengths[..., b])."""
    return np.arange(seqlen_q) < np.asarray(lengths)[..., None]


def max_error(out, ref, dtype_name, rows=None):
    """Max |out - ref| in float32 and whether every element is within tolerance; over the
    query rows where ``rows`` ([..., B, Sq] bool, out's leading axes) is True, if given."""
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    if rows is not None:
        out, ref = out[rows], ref[rows]
    err = np.abs(out - ref)
    atol, rtol = _TOLERANCE[dtype_name]
    ok = bool(np.all(err <= atol + rtol * np.abs(ref)))  # NaN compares False: fails
    return float(np.max(err, initial=0.0)), ok  # NaN anywhere shows as nan


def grad_errors(grads, oracle, lengths, dtype_name):
    """Per gradient, max |ours - oracle| / max |oracle|; and whether all are within tolerance
    and the padded keys' gradients are exactly zero.

    grads, oracle: (d_query [B, Sq, H, D], d_key [B, Skv, Hkv, D], d_value [B, Skv, Hkv, Dv]);
    lengths: [B] valid keys per sequence.
    """
    errs = []
    for g, o in zip(grads, oracle):
        g = np.asarray(g, np.float32)
        o = np.asarray(o, np.float32)
        # tiny, not 0: an all-zero oracle then reads as exact (0) or far off (huge), never nan
        scale = max(float(np.max(np.abs(o))), float(np.finfo(np.float32).tiny))
        errs.append(float(np.max(np.abs(g - o))) / scale)  # NaN anywhere shows as nan
    ok = all(e <= _GRAD_RTOL[dtype_name] for e in errs)  # NaN compares False: fails
    skv = np.asarray(grads[1]).shape[1]
    padded = np.arange(skv)[None, :] >= np.asarray(lengths)[:, None]  # [B, Skv]
    zero_padding = all(bool(np.all(np.asarray(g)[padded] == 0)) for g in grads[1:])
    return errs, ok, zero_padding


def median_ms(fn, *args, iters: int, warmup: int = 2) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    line = f"{type(e).__name__}: {line}"
    return line if len(line) <= 100 else line[:97] + "..."


# ---------------------------------------------------------------------------------------------

def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def loss_grad(attn):
    """``jax.jit(jax.grad)`` of ``sum(attn(q, k, v, lens) * d_out)`` with respect to q, k, v.

    attn: ``(q [B, Sq, H, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv], lens [B]) -> out
    [B, Sq, H, Dv]``. The returned function takes ``(q, k, v, lens, d_out)``, d_out shaped and
    typed like out, and returns ``(d_q, d_k, d_v)`` shaped and typed like q, k, v. The loss sums
    in float32 so that 16-bit inputs do not round it; out's cotangent is then d_out exactly.
    """
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, lens, d_out):
        out = attn(q, k, v, lens)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def print_header(device, args, dtype_name, lengths):
    import jax

    import jax_varlen

    print(
        f"jax_varlen {jax_varlen.__version__} | jax {jax.__version__} | jaxlib "
        f"{_version('jaxlib')} | numpy {np.__version__} | Python {platform.python_version()}"
    )
    if device.platform == "cpu":
        print(f"device: {device} ({os.cpu_count()} CPU cores)")
    else:
        print(f"device: {device} ({device.device_kind})")
    print(
        f"shape: B={args.batch} Sq={args.seqlen_q} Skv={args.seqlen_k} H={args.heads} "
        f"Hkv={args.kv_heads} D={args.head_dim} {dtype_name} "
        f"{'causal prefill (right-padded)' if args.causal else 'non-causal'}"
    )
    valid = lengths.sum() / (args.batch * args.seqlen_k)
    name = "nonpad_q_seqlen = nonpad_kv_seqlen" if args.causal else "nonpad_kv_seqlen"
    what = "queries and keys" if args.causal else "keys"
    print(f"{name}: {lengths.tolist()} ({100 * valid:.1f}% of {what} valid, seed {_SEED})")


def print_table(rows):
    """rows: (name, ms or None, speedup text, error text)."""
    head = ("implementation", "time (ms)", "jax_varlen speedup", "max |err| vs reference")
    cells = [head] + [
        (name, "-" if ms is None else f"{ms:.2f}", speedup, err) for name, ms, speedup, err in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(4)]
    for n, r in enumerate(cells):
        print(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}")
        if n == 0:
            print("  ".join("-" * w for w in widths))


def main(argv=None) -> int:
    args = parse_args(argv)

    import jax
    import jax.numpy as jnp

    import jax_varlen

    device = jax.devices()[0]
    check_runnable(device)
    dtype_name = args.dtype or ("bfloat16" if device.platform == "gpu" else "float32")
    dtype = jnp.dtype(dtype_name)

    rng = np.random.default_rng(_SEED)
    lengths = skewed_lengths(rng, args.batch, args.seqlen_k, args.valid_fraction)
    # The vmapped call sees two stacked batches: this one and a reshuffled second one.
    stacked_lengths = np.stack([lengths, rng.permutation(lengths)])
    keys = jax.random.split(jax.random.key(_SEED), _VMAP_SIZE)
    q, k, v = make_batch(keys[0], args, dtype)
    q2, k2, v2 = make_batch(keys[1], args, dtype)
    lens = jnp.asarray(lengths, jnp.int32)
    stacked = (
        jnp.stack([q, q2]), jnp.stack([k, k2]), jnp.stack([v, v2]),
        jnp.asarray(stacked_lengths, jnp.int32),
    )
    print_header(device, args, dtype_name, lengths)

    # (q, k, v, lens) -> out. --causal: a right-padded causal prefill, lens real queries and
    # keys per sequence; otherwise every query row is real.
    def varlen(fn):
        def attn(q, k, v, lens):
            return fn(q, k, v, lens, is_causal=args.causal,
                      nonpad_q_seqlen=lens if args.causal else None)
        return attn

    ours = jax.jit(varlen(jax_varlen.attention))
    ours_vmap = jax.jit(jax.vmap(varlen(jax_varlen.attention)))
    reference = varlen(jax_varlen.reference)
    # The query rows compared: [B, Sq], and [_VMAP_SIZE, B, Sq] for the stacked batches.
    rows = real_rows(lengths, args.seqlen_q) if args.causal else None
    stacked_rows = real_rows(stacked_lengths, args.seqlen_q) if args.causal else None

    ref = reference(q, k, v, lens)
    err_jit, ok_jit = max_error(ours(q, k, v, lens), ref, dtype_name, rows)
    ref_stacked = [reference(*(x[i] for x in stacked)) for i in range(_VMAP_SIZE)]
    err_vmap, ok_vmap = max_error(ours_vmap(*stacked), jnp.stack(ref_stacked), dtype_name,
                                  stacked_rows)

    def padded_attn(implementation):
        """(q, k, v, lens) -> out: jax.nn's padded attention, the same mask as ours."""
        def attn(q, k, v, lens):
            return jax.nn.dot_product_attention(
                q, k, v, key_value_seq_lengths=lens, is_causal=args.causal,
                query_seq_lengths=lens if args.causal else None, implementation=implementation)
        return attn

    def verdict(err, ok):
        return f"{err:.2e} {'ok' if ok else 'FAIL'}"

    t_ours = median_ms(ours, q, k, v, lens, iters=args.iters)
    t_vmap = median_ms(ours_vmap, *stacked, iters=args.iters)
    table = [
        ("jax_varlen (jit)", t_ours, "1.00x", verdict(err_jit, ok_jit)),
        (f"jax_varlen (vmap over {_VMAP_SIZE} batches)", t_vmap, "-", verdict(err_vmap, ok_vmap)),
    ]
    peers = ["xla"] + (["cudnn"] if device.platform == "gpu" else [])
    for impl in peers:
        name = f"jax.nn {impl} (padded)"
        fn = jax.jit(padded_attn(impl))
        try:
            out = fn(q, k, v, lens)
            t = median_ms(fn, q, k, v, lens, iters=args.iters)
        except Exception as e:  # cuDNN refuses some dtypes, shapes and devices
            table.append((name, None, "-", f"failed: {_first_line(e)}"))
            continue
        err = f"{max_error(out, ref, dtype_name, rows)[0]:.2e} (info)"
        table.append((name, t, f"{t / t_ours:.2f}x", err))

    # Training step. The oracle differentiates the reference on the inputs upcast (exactly) to
    # float32, at "highest" precision so that a GPU's TF32 matmuls do not blur it. With
    # --causal, d_out is zero on the padded query rows, whose outputs differ between
    # implementations (jax.nn's are not zero) and are not part of the loss.
    d_out = jax.random.normal(jax.random.fold_in(keys[0], 1), ref.shape, ref.dtype)
    if args.causal:
        d_out = jnp.where(rows[:, :, None, None], d_out, jnp.zeros((), d_out.dtype))
    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    with jax.default_matmul_precision("highest"):
        oracle = loss_grad(reference)(*f32[:3], lens, f32[3])
    ours_grad = loss_grad(varlen(jax_varlen.attention))
    grad_errs, ok_grad_err, zero_padding = grad_errors(
        ours_grad(q, k, v, lens, d_out), oracle, lengths, dtype_name)
    ok_grad = ok_grad_err and zero_padding

    def grad_text(errs):
        return " ".join(f"{n} {e:.2e}" for n, e in zip(_GRAD_NAMES, errs))

    t_grad = median_ms(ours_grad, q, k, v, lens, d_out, iters=args.iters)
    grad_verdict = f"{grad_text(grad_errs)} (rel) {'ok' if ok_grad else 'FAIL'}"
    if not zero_padding:
        grad_verdict += " (padded keys' dk/dv not zero)"
    table.append(("jax_varlen grad (jit)", t_grad, "1.00x", grad_verdict))
    for impl in peers:
        name = f"jax.nn {impl} grad (padded)"
        fn = loss_grad(padded_attn(impl))
        try:
            grads = fn(q, k, v, lens, d_out)
            t = median_ms(fn, q, k, v, lens, d_out, iters=args.iters)
        except Exception as e:  # cuDNN's backward refuses more than its forward
            table.append((name, None, "-", f"failed: {_first_line(e)}"))
            continue
        err = f"{grad_text(grad_errors(grads, oracle, lengths, dtype_name)[0])} (rel, info)"
        table.append((name, t, f"{t / t_grad:.2f}x", err))
    print()
    print_table(table)

    atol, rtol = _TOLERANCE[dtype_name]
    passed = ok_jit and ok_vmap and ok_grad
    print(
        f"\n{'PASS' if passed else 'FAIL'}: jit and vmap against jax_varlen.reference "
        f"(|err| <= {atol:g} + {rtol:g} * |ref|{' on real query rows' if args.causal else ''}); "
        f"grad of sum(out * d_out) w.r.t. q, k, v\n"
        f"against the reference's in float32 (max |err| <= {_GRAD_RTOL[dtype_name]:g} * "
        f"max |oracle| each, exactly 0 on padded keys); times are medians of {args.iters} runs"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
