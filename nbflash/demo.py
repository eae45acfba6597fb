"""The demo behind ``python -m nbflash``: nbflash's forward next to naive attention.

Naive attention is what a CuPy user writes today: S = Q K^T, softmax, P V, with S and P as full
N x N matrices. nbflash computes the same thing exactly without ever storing them. For each length the
table gives time, peak extra device memory, the max error of each against float64, and the N x N
memory the naive path needs, up to a length where naive attention runs out of memory.

With no GPU the same demo runs in Numba's CUDA simulator at a small size (times are then CPU times
of the simulator, and only the N x N bytes are given, computed rather than measured).
"""

import argparse
import math

import numpy as np
from tabulate import tabulate

from . import runtime
from .dtypes import SUPPORTED
from .interface import flash_attn_func
from .measure import measure_peak, time_ms
from .reference import attention_reference


def naive_attention(q, k, v, causal=False):
    """softmax(q k^T / sqrt(d)) v with the N x N matrices materialized (float32 softmax)."""
    xp = runtime.xp()
    scale = 1.0 / math.sqrt(q.shape[-1])
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # (batch, heads, seqlen, headdim)
    s = (qh @ kh.transpose(0, 1, 3, 2)).astype(xp.float32) * scale
    if causal:
        n_q, n_k = s.shape[-2:]
        s = xp.where(xp.arange(n_k)[None, :] <= xp.arange(n_q)[:, None] + n_k - n_q, s, -xp.inf)
    s -= s.max(axis=-1, keepdims=True)
    p = xp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return (p.astype(q.dtype) @ vh).transpose(0, 2, 1, 3)


def _max_error(out, q, k, v, causal):
    """Max |out - float64 reference| over the first (batch, head) pair (enough to show exactness)."""
    sl = (slice(0, 1), slice(None), slice(0, 1), slice(None))
    ref = attention_reference(q[sl], k[sl], v[sl], causal=causal)
    err = abs(out[sl].astype(ref.dtype) - ref).max()
    return float(err)


def _fmt_bytes(n):
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def run_demo(seqlens, batch, nheads, headdim, dtype, causal):
    on_gpu = not runtime.SIMULATOR
    xp = runtime.cupy() if on_gpu else np
    rows = []
    for n in seqlens:
        rng = np.random.default_rng(n)
        q, k, v = (
            xp.asarray(rng.standard_normal((batch, n, nheads, headdim), dtype=np.float32).astype(dtype))
            for _ in range(3)
        )
        nxn_bytes = batch * nheads * n * n * (2 * np.dtype(dtype).itemsize + 4)  # S, P in dtype; fp32 softmax
        row = {"seqlen": n, "naive N x N needs": _fmt_bytes(nxn_bytes)}
        for name, fn in (
            ("nbflash", lambda: flash_attn_func(q, k, v, causal=causal)),
            ("naive", lambda: naive_attention(q, k, v, causal)),
        ):
            try:
                peak = measure_peak(fn)  # exact: CuPy allocations during one call, inputs excluded
                ms = time_ms(fn, warmup=1, repeats=3)
                row[f"{name} ms"] = f"{ms:.3f}"
                row[f"{name} peak mem"] = _fmt_bytes(peak)
                row[f"{name} max err"] = f"{_max_error(fn(), q, k, v, causal):.2e}"
            except Exception as error:  # naive attention running out of memory is the point
                if "OutOfMemory" not in type(error).__name__ and "out of memory" not in str(error):
                    raise
                row[f"{name} ms"] = "out of memory"
                row[f"{name} peak mem"] = row[f"{name} max err"] = "-"
                if on_gpu:
                    runtime.cupy().get_default_memory_pool().free_all_blocks()
        rows.append(row)
        print(f"  seqlen {n} done", flush=True)
    return rows


DESCRIPTION = (
    "nbflash's demo: its forward pass next to naive attention (S = Q K^T, softmax, P V with the N x N "
    "matrices in memory), per sequence length: time, peak extra memory and max error against float64."
)


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _versions():
    import numba

    try:
        from importlib.metadata import version

        numba_cuda = version("numba-cuda")
    except Exception:
        numba_cuda = "?"
    from . import __version__

    return f"nbflash {__version__} (numba {numba.__version__}, numba-cuda {numba_cuda}, numpy {np.__version__})"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m nbflash", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=_versions())
    parser.add_argument("--seqlens", type=_positive, nargs="+", metavar="N",
                        help="sequence lengths to run (default: 1024 ... 65536 on a GPU, 32 96 in the simulator)")
    parser.add_argument("--batch", type=_positive, default=1, help="batch size (default 1)")
    parser.add_argument("--nheads", type=_positive, help="heads (default 16 on a GPU, 2 in the simulator)")
    parser.add_argument("--headdim", type=_positive,
                        help="head dimension, 1 to 256 (default 64 on a GPU, 32 in the simulator)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                        help="element type (default float16)")
    parser.add_argument("--causal", action="store_true", help="causal attention (bottom-right aligned)")
    args = parser.parse_args(argv)
    if args.headdim is not None and args.headdim > 256:
        parser.error(f"argument --headdim: {args.headdim} exceeds 256")

    if runtime.SIMULATOR:
        print("No CUDA GPU found: running the demo in Numba's CUDA simulator (on the CPU, small size).\n"
              "Its times are the simulator's (Python threads on the CPU), not GPU times, and peak memory\n"
              "is measured only on a GPU ('-'); the N x N column is computed, not measured.")
        defaults = dict(seqlens=[32, 96], nheads=2, headdim=32)
    else:
        device = runtime.cupy().cuda.runtime.getDeviceProperties(0)["name"].decode()
        print(f"GPU: {device}")
        defaults = dict(seqlens=[1024, 4096, 16384, 32768, 65536], nheads=16, headdim=64)
    seqlens = args.seqlens or defaults["seqlens"]
    nheads = args.nheads or defaults["nheads"]
    headdim = args.headdim or defaults["headdim"]
    print(
        f"batch {args.batch}, {nheads} heads, headdim {headdim}, {args.dtype}, "
        f"causal={args.causal}; error is max |out - float64| over one head"
    )
    rows = run_demo(seqlens, args.batch, nheads, headdim, SUPPORTED[args.dtype], args.causal)
    print(tabulate(rows, headers="keys"))
