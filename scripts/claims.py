"""The seed's claims about FlashAttention, measured: memory, memory traffic, speed, exactness.

The seed makes four claims. This script measures each on the GPU it runs on and says where the claim
holds, where it does not, and by how much:

(a) memory: naive attention stores the N x N score matrix S ("256 MB at seqlen 8192 in fp16, about
    16 GB at 64k"), FlashAttention stores nothing N x N. Measured: the peak device memory of one call
    of each, as seqlen doubles, for one (batch, head) pair and for a realistic batch x heads, up to a
    length where naive attention cannot run at all. The peak is read exactly by a CuPy allocator
    hook: every allocation made during the call is counted (requested bytes), live bytes are
    followed through frees, and the high-water mark is kept. Inputs exist before the call and are
    not counted; the output is (it is allocated by the call), and shown separately.
(b) memory traffic: bytes moved, O(N^2) for naive attention against O(N) for FlashAttention,
    computed from the algorithms (the model is below, in ``naive_passes`` and ``flash_bytes``), set
    against the measured times: achieved GB/s against the H200's measured copy bandwidth.
(c) speed: nbflash against naive attention across lengths ("2-4x faster"). CUDA events around each
    call after a warm-up, median of the repeats.
(d) exactness: max |out - float64 reference| of both: the same order, no approximation.

"Naive attention" is ``nbflash.demo.naive_attention``, what a CuPy user writes today: S = Q K^T in
the input dtype, softmax in float32, P cast back to the input dtype, O = P V.

Usage (the default arguments take about 2-3 minutes on an H200)::

    python scripts/claims.py                # print the tables and conclusions
    python scripts/claims.py --plots        # also docs/claims_memory.png and docs/claims_time.png
    python scripts/claims.py --write-docs   # also docs/claims.md (tables, conclusions, plots)

With no GPU it runs in Numba's CUDA simulator at a tiny size: errors and computed bytes are real,
measured memory is n/a and times are CPU times of the simulator (not comparable).
Plots need matplotlib: pip install ".[plot]".
"""

import argparse
import datetime
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _gpu_present():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# Numba reads NUMBA_ENABLE_CUDASIM when it is first imported: decide before importing nbflash (when
# something already imported Numba, e.g. the tests' conftest, its choice stands).
if "numba" not in sys.modules and not _gpu_present():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
if importlib.util.find_spec("nbflash") is None:  # run from a checkout without installing
    sys.path.append(str(ROOT))

import numpy as np  # noqa: E402
from tabulate import tabulate  # noqa: E402

import nbflash  # noqa: E402
from nbflash import runtime  # noqa: E402
from nbflash.demo import naive_attention  # noqa: E402
from nbflash.dtypes import SUPPORTED  # noqa: E402
from nbflash.measure import PeakMemory, measure_peak, time_ms  # noqa: E402

SIMULATOR = runtime.SIMULATOR

# A copy kernel on the H200 moved ~4.3 TB/s (shared/ANCHORS.md); the datasheet says 4.8.
COPY_BANDWIDTH = 4.3e12

# The seed's figures for naive attention's S at one head, fp16, read as binary units (they are exactly
# 4 bytes per score element: 8192^2 * 4 B = 256 MiB, 65536^2 * 4 B = 16 GiB).
SEED_MEMORY = {8192: ("256 MB", 256 * 2**20), 65536: ("about 16 GB", 16 * 2**30)}
SEED_SPEEDUP = (2.0, 4.0)

# flash-attn's exactness rule: error at most twice a same-precision naive implementation's, both
# against float64, plus a small absolute floor (the same floors as the test suite).
ERROR_FLOOR = {"float32": 1e-5, "float16": 1e-4, "bfloat16": 1e-3}

FLOAT32_BYTES = 4
LSE_BYTES = 4  # float32 log-sum-exp per query row


# ---- Formatting ------------------------------------------------------------------------------


def fmt_bytes(n):
    """1536 -> '1.5 KiB'; None -> 'n/a'; strings pass through."""
    if n is None:
        return "n/a"
    if isinstance(n, str):
        return n
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def fmt(x, spec=".3g"):
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x
    return format(x, spec)


def is_out_of_memory(error):
    text = f"{type(error).__name__} {error}".lower()
    return "outofmemory" in text or "out of memory" in text or "memoryallocation" in text


# ---- (b) The byte model ----------------------------------------------------------------------


def naive_passes(batch, nheads, seqlen_q, seqlen_k, headdim, itemsize, causal):
    """Bytes each pass of ``naive_attention`` reads and writes: a list of (name, read, written).

    Model: every elementwise pass and reduction streams its operands from device memory and its
    result back (each N x N array is far larger than the 50 MB L2, so nothing survives between
    passes); a matmul reads its operands once and writes its product once (cuBLAS's tile re-reads
    hit L2). Float32 is 4 bytes, the input dtype ``itemsize``. The causal mask is one (N, N) boolean
    array broadcast over (batch, head), read by every head.
    """
    bh, e, f = batch * nheads, itemsize, FLOAT32_BYTES
    nn = bh * seqlen_q * seqlen_k  # score elements of the whole call
    rows = bh * seqlen_q
    passes = [
        ("S = Q K^T (matmul)", bh * (seqlen_q + seqlen_k) * headdim * e, nn * e),
        ("S to float32", nn * e, nn * f),
        ("S * scale", nn * f, nn * f),
    ]
    if causal:
        passes += [
            ("mask j <= i + Nk - Nq", 0, seqlen_q * seqlen_k),
            ("S = where(mask, S, -inf)", nn * (1 + f), nn * f),
        ]
    passes += [
        ("row max", nn * f, rows * f),
        ("S -= max", nn * f + rows * f, nn * f),
        ("P = exp(S)", nn * f, nn * f),
        ("row sum", nn * f, rows * f),
        ("P /= sum", nn * f + rows * f, nn * f),
        ("P to input dtype", nn * f, nn * e),
        ("O = P V (matmul)", nn * e + bh * seqlen_k * headdim * e, rows * headdim * e),
    ]
    return passes


def naive_bytes(batch, nheads, seqlen_q, seqlen_k, headdim, itemsize, causal):
    """Total bytes ``naive_attention`` moves, pass by pass (see ``naive_passes``)."""
    return sum(
        r + w for _, r, w in naive_passes(batch, nheads, seqlen_q, seqlen_k, headdim, itemsize, causal)
    )


def textbook_naive_bytes(batch, nheads, seqlen_q, seqlen_k, headdim, itemsize):
    """The least any three-kernel attention moves: S written and read, P written and read (input
    dtype, softmax fused into one pass), Q, K, V read once and O written once."""
    bh, e = batch * nheads, itemsize
    return bh * (4 * seqlen_q * seqlen_k * e + (2 * seqlen_q + 2 * seqlen_k) * headdim * e)


def _keys_visited(tile, block_m, block_n, seqlen_q, seqlen_k, causal):
    """Key rows a query tile loads: all of them, or (causal, bottom-right) up to the tile's last
    visible key, rounded up to whole key tiles."""
    if not causal:
        return seqlen_k
    last_row = min((tile + 1) * block_m, seqlen_q) - 1
    visible = last_row + (seqlen_k - seqlen_q) + 1
    if visible <= 0:
        return 0
    return min(seqlen_k, math.ceil(visible / block_n) * block_n)


def flash_bytes(batch, nheads, seqlen_q, seqlen_k, headdim, itemsize, causal, block_m=64, block_n=64):
    """Bytes a FlashAttention forward moves: (with tile re-reads, O(N) floor).

    Model: each block of ``block_m`` query rows reads its Q tile once, then every K and V tile it
    needs, once, and writes its O tile and its lse once. Nothing N x N is ever stored.

    - "with tile re-reads": K and V are read once per query tile, (N / block_m) times in all. This
      is O(N^2 d / block_m): quadratic like naive, but with a constant ``2 d e / block_m`` (4 bytes
      per score element at d = 64, block_m = 64, fp16) against naive's ~56. When the K and V of the
      heads in flight fit in L2 (50 MB on the H200; 4 MiB for one head at 16k, d = 64, fp16), the
      re-reads are served by L2, not device memory.
    - "O(N) floor": Q, K and V read once, O and lse written once: what reaches device memory when
      every re-read hits L2. This is the "O(N)" of the claim.
    """
    e = itemsize
    tiles = math.ceil(seqlen_q / block_m)
    once = (2 * seqlen_q + 2 * seqlen_k) * headdim * e + LSE_BYTES * seqlen_q
    kv = sum(_keys_visited(t, block_m, block_n, seqlen_q, seqlen_k, causal) for t in range(tiles))
    with_rereads = 2 * seqlen_q * headdim * e + LSE_BYTES * seqlen_q + 2 * kv * headdim * e
    bh = batch * nheads
    return bh * with_rereads, bh * once


def attention_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal):
    """4 B H Nq Nk d, halved when causal (flash-attn's count)."""
    return 4 * batch * nheads * seqlen_q * seqlen_k * headdim * (0.5 if causal else 1.0)


# ---- Measuring -------------------------------------------------------------------------------


def _free_cached():
    """Hand cached blocks back to the device (a failed call's arrays come back to a pool late)."""
    if not SIMULATOR:
        runtime.cupy().get_default_memory_pool().free_all_blocks()
        if PeakMemory._gpu_pool is not None:
            PeakMemory._gpu_pool.free_all_blocks()


def random_qkv(batch, seqlen, nheads, headdim, dtype, seed=0):
    """Standard-normal q, k, v of shape (batch, seqlen, nheads, headdim) on the backend (drawn on the
    GPU when there is one: drawing 10^8 numbers on the host takes seconds)."""
    shape = (batch, seqlen, nheads, headdim)
    if SIMULATOR or dtype == "bfloat16":  # bfloat16 conversion done by NumPy (ml_dtypes), as the tests do
        rng = np.random.default_rng(seed)
        xp = np if SIMULATOR else runtime.cupy()
        return tuple(
            xp.asarray(rng.standard_normal(shape, np.float32).astype(SUPPORTED[dtype])) for _ in range(3)
        )
    rng = runtime.cupy().random.default_rng(seed)
    return tuple(rng.standard_normal(shape, dtype=np.float32).astype(SUPPORTED[dtype]) for _ in range(3))


def _run_flash(q, k, v, causal):
    return lambda: nbflash.flash_attn_func(q, k, v, causal=causal)


def _run_naive(q, k, v, causal):
    return lambda: naive_attention(q, k, v, causal)


def kernel_plan(q, k, v, causal):
    """(family, block_m, block_n) of the kernel nbflash dispatches to, as far as nbflash tells.

    The family comes from ``nbflash.explain`` or ``nbflash.plan`` when the library has one, else
    from its planner; tile sizes from the planner's config (64 x 64 assumed when unknown).
    """
    family, block_m, block_n = None, None, None
    for name in ("explain", "plan"):
        fn = getattr(nbflash, name, None)
        if not callable(fn):
            continue
        for call in (lambda: fn(q, k, v, causal=causal), lambda: fn(q, k, v)):
            try:
                result = call()
            except Exception:
                continue
            if isinstance(result, dict):  # nbflash.explain: {'family': ..., 'config': {...}, ...}
                config = result.get("config") or {}
                family = result.get("family")
                block_m, block_n = config.get("block_m"), config.get("block_n")
            else:
                family = getattr(result, "family", None) or str(result).strip().splitlines()[0][:60]
                block_m = getattr(result, "block_m", None)
                block_n = getattr(result, "block_n", None)
            break
        if family:
            break
    try:  # the planner behind flash_attn_func (internal API; optional)
        from nbflash import configs, validation

        problem = validation.check_forward(q, k, v, None, causal)[0]
        config = configs.plan_forward(problem.static)
        family = family or getattr(config, "family", None) or type(config).__name__
        block_m = block_m or getattr(config, "block_m", None)
        block_n = block_n or getattr(config, "block_n", None)
    except Exception:
        pass
    return family or "unknown", block_m or 64, block_n or 64


# ---- (a) Memory ------------------------------------------------------------------------------


def default_mem_seqlens(start, stop):
    seqlens, n = [], start
    while n <= stop:
        seqlens.append(n)
        n *= 2
    return seqlens


def memory_sweep(batch, nheads, headdim, dtype, seqlens, stop_at_naive_oom=True, log=print):
    """Peak device memory of one call of naive attention and of nbflash at each length.

    Stops after the first length where naive attention runs out of memory (nbflash is measured
    there too). In the simulator nothing is run: the computed columns only.
    """
    itemsize = np.dtype(SUPPORTED[dtype]).itemsize
    rows = []
    warmed = False
    for n in seqlens:
        bh = batch * nheads
        row = {
            "batch": batch,
            "nheads": nheads,
            "seqlen": n,
            "scores": bh * n * n,  # score elements
            "S_bytes": bh * n * n * itemsize,  # S alone in the input dtype
            "flash_output_bytes": bh * n * (headdim * itemsize + LSE_BYTES),  # out + lse
            "naive_peak": None,
            "flash_peak": None,
        }
        if not SIMULATOR:
            q, k, v = random_qkv(batch, n, nheads, headdim, dtype, seed=n)
            if not warmed:  # compile outside the measurement
                small = random_qkv(1, 64, 1, headdim, dtype)
                nbflash.flash_attn_func(*small)
                naive_attention(*small)
                warmed = True
            for key, make in (("naive_peak", _run_naive), ("flash_peak", _run_flash)):
                try:
                    row[key] = measure_peak(make(q, k, v, False))
                except Exception as error:
                    if not is_out_of_memory(error):
                        raise
                    row[key] = "out of memory"
                _free_cached()
            del q, k, v
            _free_cached()
            log(
                f"  memory {batch}x{nheads} seqlen {n}: naive {fmt_bytes(row['naive_peak'])}, "
                f"nbflash {fmt_bytes(row['flash_peak'])}"
            )
        rows.append(row)
        if stop_at_naive_oom and row["naive_peak"] == "out of memory":
            break
    return rows


def memory_table(rows):
    out = []
    for r in rows:
        naive, flash = r["naive_peak"], r["flash_peak"]
        seed = SEED_MEMORY.get(r["seqlen"]) if r["batch"] * r["nheads"] == 1 else None
        out.append(
            {
                "B x H": f"{r['batch']}x{r['nheads']}",
                "seqlen": r["seqlen"],
                "seed says": seed[0] if seed else "",
                "S alone": fmt_bytes(r["S_bytes"]),
                "naive peak": fmt_bytes(naive),
                "naive B/score": fmt(naive / r["scores"], ".2f") if isinstance(naive, int) else "n/a",
                "nbflash peak": fmt_bytes(flash),
                "nbflash out+lse": fmt_bytes(r["flash_output_bytes"]),
                "naive/nbflash": fmt(naive / flash, ".0f") if isinstance(naive, int) and flash else "n/a",
            }
        )
    return out


def _slope(rows, key):
    """Growth exponent of ``key`` over the last two lengths where it was measured."""
    pts = [(r["seqlen"], r[key]) for r in rows if isinstance(r[key], int) and r[key] > 0]
    if len(pts) < 2:
        return None
    (n0, y0), (n1, y1) = pts[-2], pts[-1]
    return math.log(y1 / y0) / math.log(n1 / n0)


def memory_conclusions(sweeps, device_bytes=None):
    lines = []
    one = next((rows for rows in sweeps if rows and rows[0]["batch"] * rows[0]["nheads"] == 1), None)
    lines.append(
        "The seed's figures (256 MB at 8192, about 16 GB at 64k) are 4 bytes per score element: "
        "S alone in fp16 is 2 bytes per element, 128 MiB at 8192 and 8 GiB at 65536 per head; "
        "the seed's numbers are S plus P in fp16 (or S in fp32)."
    )
    if one:
        measured = {r["seqlen"]: r["naive_peak"] for r in one if isinstance(r["naive_peak"], int)}
        for n, (said, claim) in SEED_MEMORY.items():
            if n in measured:
                peak = measured[n]
                verdict = (
                    "understates" if peak > 1.1 * claim else "matches" if peak > 0.9 * claim else "overstates"
                )
                lines.append(
                    f"At seqlen {n}, one head: naive attention measured {fmt_bytes(peak)} at its peak "
                    f"({peak / n**2:.2f} bytes per score element), {peak / claim:.2f}x the seed's "
                    f"{said}: the claim {verdict} what this naive implementation needs (it keeps float32 "
                    "copies for the softmax)."
                )
    for rows in sweeps:
        if not rows:
            continue
        shape = f"{rows[0]['batch']}x{rows[0]['nheads']} (batch x heads)"
        s_naive, s_flash = _slope(rows, "naive_peak"), _slope(rows, "flash_peak")
        if s_naive is not None and s_flash is not None:
            lines.append(
                f"{shape}: naive peak memory grows as N^{s_naive:.2f}, nbflash's as N^{s_flash:.2f} "
                "over the last doubling measured (quadratic against linear: the claim holds)."
            )
        exact = [r for r in rows if isinstance(r["flash_peak"], int)]
        if exact:
            extra = max(r["flash_peak"] - r["flash_output_bytes"] for r in exact)
            lines.append(
                f"{shape}: nbflash's peak is its output plus lse "
                + (
                    "exactly, at every length: no workspace at all."
                    if extra == 0
                    else f"plus at most {fmt_bytes(extra)}."
                )
            )
        oom = [r for r in rows if r["naive_peak"] == "out of memory"]
        if oom:
            r = oom[0]
            cap = f" of the GPU's {fmt_bytes(device_bytes)}" if device_bytes else ""
            lines.append(
                f"{shape}: naive attention cannot run at seqlen {r['seqlen']} (out of memory{cap}); "
                f"nbflash runs there with a peak of {fmt_bytes(r['flash_peak'])}."
            )
        elif not SIMULATOR and rows:
            lines.append(
                f"{shape}: naive attention still ran at seqlen {rows[-1]['seqlen']}, the longest tried."
            )
    if SIMULATOR:
        lines.append("Simulator run: memory is not measured (n/a); the computed columns stand.")
    return lines


# ---- (b, c) Speed and traffic ----------------------------------------------------------------


def speed_sweep(batch, nheads, headdim, dtype, seqlens, causals, repeats=5, budget_s=1.0, log=print):
    """Median time of naive attention and of nbflash at each (seqlen, causal), plus what the byte
    model says each moves."""
    itemsize = np.dtype(SUPPORTED[dtype]).itemsize
    rows = []
    for causal in causals:
        for n in seqlens:
            q, k, v = random_qkv(batch, n, nheads, headdim, dtype, seed=n)
            family, block_m, block_n = kernel_plan(q, k, v, causal)
            flash_tiles, flash_floor = flash_bytes(
                batch, nheads, n, n, headdim, itemsize, causal, block_m, block_n
            )
            row = {
                "batch": batch,
                "nheads": nheads,
                "headdim": headdim,
                "dtype": dtype,
                "seqlen": n,
                "causal": causal,
                "family": family,
                "block_m": block_m,
                "block_n": block_n,
                "flops": attention_flops(batch, nheads, n, n, headdim, causal),
                "naive_bytes": naive_bytes(batch, nheads, n, n, headdim, itemsize, causal),
                "textbook_bytes": textbook_naive_bytes(batch, nheads, n, n, headdim, itemsize),
                "flash_bytes": flash_tiles,
                "flash_floor_bytes": flash_floor,
            }
            for key, make in (("naive_ms", _run_naive), ("flash_ms", _run_flash)):
                try:
                    row[key] = time_ms(make(q, k, v, causal), repeats=repeats, budget_s=budget_s)
                except Exception as error:
                    if not is_out_of_memory(error):
                        raise
                    row[key] = "out of memory"
                _free_cached()
            del q, k, v
            _free_cached()
            log(
                f"  speed seqlen {n} causal={causal}: naive {fmt(row['naive_ms'])} ms, "
                f"nbflash {fmt(row['flash_ms'])} ms ({family})"
            )
            rows.append(row)
    return rows


def _num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def speed_table(rows):
    out = []
    for r in rows:
        naive, flash = r["naive_ms"], r["flash_ms"]
        speedup = naive / flash if _num(naive) and _num(flash) and not SIMULATOR else None
        out.append(
            {
                "seqlen": r["seqlen"],
                "causal": r["causal"],
                "naive ms": fmt(naive, ".3f"),
                "nbflash ms": fmt(flash, ".3f"),
                "speedup": fmt(speedup, ".2f"),
                "seed's 2-4x": "n/a (simulator)" if SIMULATOR else _speed_verdict(speedup, naive),
                "naive TFLOP/s": (
                    fmt(r["flops"] / naive / 1e9, ".1f") if _num(naive) and not SIMULATOR else "n/a"
                ),
                "nbflash TFLOP/s": (
                    fmt(r["flops"] / flash / 1e9, ".1f") if _num(flash) and not SIMULATOR else "n/a"
                ),
                "nbflash kernel": r["family"],
            }
        )
    return out


def _speed_verdict(speedup, naive):
    low, high = SEED_SPEEDUP
    if speedup is None:
        return "naive cannot run" if naive == "out of memory" else "n/a"
    if speedup < low:
        return f"fails: {low / speedup:.1f}x short"
    if speedup > high:
        return f"exceeds: {speedup / high:.1f}x above"
    return "holds"


def traffic_table(rows, bandwidth=COPY_BANDWIDTH):
    out = []
    for r in rows:
        naive, flash = r["naive_ms"], r["flash_ms"]
        scores = r["batch"] * r["nheads"] * r["seqlen"] ** 2
        naive_gbs = r["naive_bytes"] / naive / 1e6 if _num(naive) and not SIMULATOR else None
        out.append(
            {
                "seqlen": r["seqlen"],
                "causal": r["causal"],
                "naive bytes": fmt_bytes(r["naive_bytes"]),
                "naive B/score": fmt(r["naive_bytes"] / scores, ".1f"),
                "textbook naive": fmt_bytes(r["textbook_bytes"]),
                "nbflash w/ re-reads": fmt_bytes(r["flash_bytes"]),
                "nbflash O(N) floor": fmt_bytes(r["flash_floor_bytes"]),
                "naive/floor": fmt(r["naive_bytes"] / r["flash_floor_bytes"], ".0f"),
                "naive GB/s": fmt(naive_gbs, ".0f"),
                "% of copy BW": fmt(100 * naive_gbs * 1e9 / bandwidth, ".0f") if naive_gbs else "n/a",
                "naive byte-bound ms": fmt(r["naive_bytes"] / bandwidth * 1e3, ".3f"),
                "nbflash GB/s w/ re-reads": (
                    fmt(r["flash_bytes"] / flash / 1e6, ".0f") if _num(flash) and not SIMULATOR else "n/a"
                ),
                "nbflash floor ms": fmt(r["flash_floor_bytes"] / bandwidth * 1e3, ".4f"),
            }
        )
    return out


def _range(values, spec=".2f"):
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    return (
        format(lo, spec) if format(lo, spec) == format(hi, spec) else f"{format(lo, spec)}-{format(hi, spec)}"
    )


def speed_conclusions(rows):
    lines = []
    if not rows:
        return lines
    families = sorted({r["family"] for r in rows})
    if SIMULATOR:
        return [
            "Simulator run: times are CPU times of Numba's simulator, not comparable; "
            f"nbflash kernel: {', '.join(families)}."
        ]
    low, high = SEED_SPEEDUP
    for causal in sorted({r["causal"] for r in rows}):
        sub = [r for r in rows if r["causal"] == causal]
        both = [r for r in sub if _num(r["naive_ms"]) and _num(r["flash_ms"])]
        speedups = [r["naive_ms"] / r["flash_ms"] for r in both]
        label = "causal" if causal else "non-causal"
        if speedups:
            holds = [r["seqlen"] for r, s in zip(both, speedups) if low <= s <= high]
            above = [r["seqlen"] for r, s in zip(both, speedups) if s > high]
            below = [(r["seqlen"], s) for r, s in zip(both, speedups) if s < low]
            text = f"{label}: nbflash is {_range(speedups)}x naive attention's speed (seed: 2-4x)"
            parts = []
            if holds:
                parts.append(f"the claim holds at seqlen {', '.join(map(str, holds))}")
            if above:
                parts.append(f"nbflash does better than claimed at {', '.join(map(str, above))}")
            if below:
                worst = min(s for _, s in below)
                parts.append(
                    f"it fails at {', '.join(str(n) for n, _ in below)} "
                    f"(worst: {worst:.2f}x, {low / worst:.1f}x short of the claim's low end)"
                )
            lines.append(text + ("; " + "; ".join(parts) if parts else "") + ".")
        oom = [r["seqlen"] for r in sub if r["naive_ms"] == "out of memory"]
        if oom:
            r = next(r for r in sub if r["seqlen"] == oom[0])
            lines.append(
                f"{label}: at seqlen {', '.join(map(str, oom))} naive attention runs out of memory; "
                f"nbflash takes {fmt(r['flash_ms'], '.1f')} ms there."
            )
    flash_tf = [r["flops"] / r["flash_ms"] / 1e9 for r in rows if _num(r["flash_ms"])]
    naive_tf = [r["flops"] / r["naive_ms"] / 1e9 for r in rows if _num(r["naive_ms"])]
    lines.append(
        f"Throughput: nbflash ({', '.join(families)}) {_range(flash_tf, '.1f')} TFLOP/s, naive "
        f"{_range(naive_tf, '.1f')} TFLOP/s (FLOPs = 4 B H N^2 d, halved when causal)."
    )
    return lines


def traffic_conclusions(rows, bandwidth=COPY_BANDWIDTH):
    if not rows:
        return []
    r0 = rows[0]
    scores = lambda r: r["batch"] * r["nheads"] * r["seqlen"] ** 2  # noqa: E731
    longest = max(r["seqlen"] for r in rows)
    per_score = ", ".join(
        f"{r['naive_bytes'] / scores(r):.1f} {'causal' if r['causal'] else 'non-causal'}"
        for r in rows
        if r["seqlen"] == longest
    )
    rereads = _range([r["flash_bytes"] / scores(r) for r in rows if r["seqlen"] == longest], ".2f")
    lines = [
        f"Byte model: at seqlen {longest} naive attention moves {per_score} bytes per score element, "
        f"pass by pass (a fused three-kernel naive would move "
        f"{4 * np.dtype(SUPPORTED[r0['dtype']]).itemsize}); nbflash's floor is Q, K, V read and O, lse "
        "written once: O(N), no score element ever reaches device memory. Its K/V re-reads, once per "
        f"{r0['block_m']}-row query tile, add up to "
        f"{rereads} bytes per score element there, which L2 (50 MB on the H200) can serve."
    ]
    last = max(rows, key=lambda r: (r["seqlen"], -r["causal"]))
    ratio = last["naive_bytes"] / last["flash_floor_bytes"]
    lines.append(
        f"At seqlen {last['seqlen']} naive attention moves {ratio:.0f}x nbflash's floor "
        f"({fmt_bytes(last['naive_bytes'])} against {fmt_bytes(last['flash_floor_bytes'])}); "
        "the ratio doubles with every doubling of seqlen (O(N^2) against O(N))."
    )
    if SIMULATOR:
        return lines
    timed = [r for r in rows if _num(r["naive_ms"])]
    if timed:
        gbs = [r["naive_bytes"] / r["naive_ms"] / 1e6 for r in timed]
        percent = _range([100 * g * 1e9 / bandwidth for g in gbs], ".0f")
        lines.append(
            f"Naive attention achieves {_range(gbs, '.0f')} GB/s on the model's bytes "
            f"({percent}% of the {bandwidth / 1e12:.1f} TB/s copy bandwidth): "
            + (
                "it is bound by memory traffic, which grows as N^2."
                if min(gbs) * 1e9 >= 0.5 * bandwidth
                else "its passes run below copy bandwidth, and its time grows with the N^2 bytes they move."
            )
        )
    flash = [r for r in rows if _num(r["flash_ms"])]
    if flash:
        ratio = [r["flash_ms"] / (r["flash_floor_bytes"] / bandwidth * 1e3) for r in flash]
        lines.append(
            f"nbflash takes {_range(ratio, '.0f')}x the time its O(N) floor of bytes needs at copy "
            "bandwidth: "
            + (
                "memory traffic does not limit it; its speed is its kernel's arithmetic (TFLOP/s, table (c))."
                if min(ratio) >= 5
                else "at some lengths it is close to its byte floor."
            )
        )
    return lines


# ---- (d) Exactness ---------------------------------------------------------------------------


def _to_numpy(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def max_error(out, ref):
    return float(np.abs(_to_numpy(out).astype(np.float64) - _to_numpy(ref)).max())


def error_sweep(batch, nheads, headdim, dtypes, seqlens, causals, log=print):
    """Max |out - float64| of nbflash and of naive attention, with flash-attn's budget."""
    rows = []
    for dtype in dtypes:
        for causal in causals:
            for n in seqlens:
                q, k, v = random_qkv(batch, n, nheads, headdim, dtype, seed=n + 1)
                ref = nbflash.attention_reference(q, k, v, causal=causal)
                same_precision = max_error(nbflash.attention_naive(q, k, v, causal=causal), ref)
                row = {"dtype": dtype, "seqlen": n, "causal": causal, "same_precision": same_precision}
                row["budget"] = 2 * same_precision + ERROR_FLOOR[dtype]
                for key, make in (("flash_error", _run_flash), ("naive_error", _run_naive)):
                    try:
                        row[key] = max_error(make(q, k, v, causal)(), ref)
                    except Exception as error:  # e.g. a matmul the backend lacks for this dtype
                        row[key] = f"n/a ({type(error).__name__})"
                rows.append(row)
                del q, k, v, ref
                _free_cached()
                log(
                    f"  error {dtype} seqlen {n} causal={causal}: nbflash {fmt(row['flash_error'])}, "
                    f"naive {fmt(row['naive_error'])}"
                )
    return rows


def error_table(rows):
    out = []
    for r in rows:
        f, n = r["flash_error"], r["naive_error"]
        ok = _num(f) and f <= r["budget"]
        out.append(
            {
                "dtype": r["dtype"],
                "seqlen": r["seqlen"],
                "causal": r["causal"],
                "nbflash max err": fmt(f, ".2e"),
                "naive max err": fmt(n, ".2e"),
                "nbflash/naive": fmt(f / n, ".2f") if _num(f) and _num(n) and n > 0 else "n/a",
                "same-precision model": fmt(r["same_precision"], ".2e"),
                "budget (2x + floor)": fmt(r["budget"], ".2e"),
                "within": "yes" if ok else "NO",
            }
        )
    return out


def error_conclusions(rows):
    if not rows:
        return []
    lines = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        sub = [r for r in rows if r["dtype"] == dtype]
        ratios = [
            r["flash_error"] / r["naive_error"]
            for r in sub
            if _num(r["flash_error"]) and _num(r["naive_error"]) and r["naive_error"] > 0
        ]
        within = all(_num(r["flash_error"]) and r["flash_error"] <= r["budget"] for r in sub)
        compared = (
            f"nbflash's max error is {_range(ratios)}x naive attention's (both against float64); "
            if ratios
            else "no error ratio (a call failed); "
        )
        lines.append(
            f"{dtype}: {compared}{'every' if within else 'NOT every'} case is within flash-attn's budget "
            "(twice a same-precision naive implementation, plus a floor): "
            + ("exact, no approximation." if within else "see the table.")
        )
    return lines


# ---- Report, plots, docs ---------------------------------------------------------------------


def device_info():
    if SIMULATOR:
        return {"name": "Numba CUDA simulator (CPU)", "memory": None}
    cp = runtime.cupy()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    return {"name": props["name"].decode(), "memory": int(props["totalGlobalMem"])}


def sections(results):
    """[(title, table rows, conclusions)] for the parts that ran."""
    out = []
    if results.get("memory") is not None:
        rows = [r for sweep in results["memory"] for r in sweep]
        out.append(
            (
                "(a) Memory: peak device memory of one call, inputs excluded",
                memory_table(rows),
                memory_conclusions(results["memory"], results["device"]["memory"]),
            )
        )
    if results.get("speed") is not None:
        out.append(
            (
                "(b) Memory traffic: bytes moved (model) against measured time",
                traffic_table(results["speed"], results["bandwidth"]),
                traffic_conclusions(results["speed"], results["bandwidth"]),
            )
        )
        out.append(
            (
                "(c) Speed: median time per call",
                speed_table(results["speed"]),
                speed_conclusions(results["speed"]),
            )
        )
    if results.get("errors") is not None:
        out.append(
            (
                "(d) Exactness: max |out - float64 reference|",
                error_table(results["errors"]),
                error_conclusions(results["errors"]),
            )
        )
    return out


def print_report(results):
    for title, table, lines in sections(results):
        print(f"\n{title}")
        print(tabulate(table, headers="keys", disable_numparse=True))
        for line in lines:
            print(f"- {line}")


def plot(results, docs_dir):
    """docs/claims_memory.png and docs/claims_time.png; returns the paths written ([] without data).
    Raises ImportError when matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs_dir = Path(docs_dir)
    docs_dir.mkdir(parents=True, exist_ok=True)
    written = []
    gib = 2**30

    c = results["config"]
    if results.get("memory"):
        fig, ax = plt.subplots(figsize=(9.5, 4.8))
        for i, rows in enumerate(results["memory"]):
            if not rows:
                continue
            shape = f"{rows[0]['batch']}x{rows[0]['nheads']}"
            color = f"C{2 * i}"
            ns = [r["seqlen"] for r in rows]
            naive = [(r["seqlen"], r["naive_peak"] / gib) for r in rows if isinstance(r["naive_peak"], int)]
            flash = [(r["seqlen"], r["flash_peak"] / gib) for r in rows if isinstance(r["flash_peak"], int)]
            if naive:
                ax.plot(*zip(*naive), "o-", color=color, label=f"naive, B x H = {shape} (measured)")
            if flash:
                ax.plot(
                    *zip(*flash), "s-", color=f"C{2 * i + 1}", label=f"nbflash, B x H = {shape} (measured)"
                )
            ax.plot(
                ns,
                [r["S_bytes"] / gib for r in rows],
                ":",
                color=color,
                alpha=0.6,
                label=f"S alone, {shape} (computed)",
            )
            oom = [r["seqlen"] for r in rows if r["naive_peak"] == "out of memory"]
            if oom and results["device"]["memory"]:
                ax.plot(
                    oom,
                    [results["device"]["memory"] / gib] * len(oom),
                    "x",
                    color=color,
                    ms=12,
                    mew=3,
                    label=f"naive out of memory, {shape}",
                )
        seeds = sorted(SEED_MEMORY.items())
        ax.plot(
            [n for n, _ in seeds],
            [b / gib for _, (_, b) in seeds],
            "*",
            color="k",
            ms=12,
            label="seed's figures (1 head)",
        )
        if results["device"]["memory"]:
            ax.axhline(results["device"]["memory"] / gib, color="gray", lw=1, ls="--", label="device memory")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="seqlen",
            ylabel="peak extra device memory (GiB)",
            title=f"Peak memory of one attention call ({c['dtype']}, d={c['headdim']})",
        )
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = docs_dir / "claims_memory.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    if results.get("speed"):
        fig, ax = plt.subplots(figsize=(9.5, 4.8))
        rows = results["speed"]
        for j, causal in enumerate(sorted({r["causal"] for r in rows})):
            sub = [r for r in rows if r["causal"] == causal]
            tag = "causal" if causal else "non-causal"
            style = "--" if causal else "-"
            naive = [(r["seqlen"], r["naive_ms"]) for r in sub if _num(r["naive_ms"])]
            flash = [(r["seqlen"], r["flash_ms"]) for r in sub if _num(r["flash_ms"])]
            if naive:
                ax.plot(*zip(*naive), "o" + style, color="C0", label=f"naive, {tag}")
            if flash:
                ax.plot(*zip(*flash), "s" + style, color="C1", label=f"nbflash ({sub[0]['family']}), {tag}")
            if not causal:
                bound = [(r["seqlen"], r["naive_bytes"] / results["bandwidth"] * 1e3) for r in sub]
                ax.plot(*zip(*bound), ":", color="C0", alpha=0.7, label="naive: its bytes at copy bandwidth")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="seqlen",
            ylabel="ms per call (median)",
            title=f"Forward time, B x H = {c['batch']}x{c['nheads']}, d={c['headdim']}, {c['dtype']}"
            + (" (simulator: CPU time)" if SIMULATOR else ""),
        )
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = docs_dir / "claims_time.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def write_docs(results, docs_dir, plots=True):
    """docs/claims.md from this run (and the plots, when matplotlib is there). Returns the paths."""
    docs_dir = Path(docs_dir)
    docs_dir.mkdir(parents=True, exist_ok=True)
    images, note = [], ""
    if plots:
        try:
            images = plot(results, docs_dir)
        except ImportError:
            note = '(Plots not drawn: matplotlib is not installed; `pip install ".[plot]"` and run again.)'
    c, d = results["config"], results["device"]
    lines = [
        "# The seed's claims, measured",
        "",
        f"Generated by `{results['command']}` on {d['name']}, {results['date']}, nbflash "
        f"{nbflash.__version__}. Do not edit by hand: run it again.",
        "",
        "Naive attention is `nbflash.demo.naive_attention` (S = Q K^T in the input dtype, softmax in "
        "float32, P cast back, O = P V), what a CuPy user writes today. Shapes: (batch, seqlen, heads, "
        f"headdim) with headdim {c['headdim']}, {c['dtype']}; memory for one (batch, head) pair and for "
        f"B x H = {c['batch']}x{c['nheads']}; speed at B x H = {c['batch']}x{c['nheads']}.",
        "",
        "How each figure is obtained:",
        "",
        "- Peak memory: CuPy's allocator is replaced during one call by a hook that counts every "
        "allocation (bytes requested) and every free, and keeps the high-water mark of live bytes. "
        "Inputs exist before the call and are not counted; the output is. Workspace that libraries "
        "allocate outside CuPy (cuBLAS's) is not seen.",
        "- Bytes moved: computed from the algorithm (`naive_passes`, `flash_bytes` in "
        "scripts/claims.py): every naive pass streams its N x N operands from device memory and back; "
        "nbflash reads Q once, K and V once per query tile (L2 can serve these re-reads), writes O "
        "and lse once; its O(N) floor counts Q, K, V read once. Set against the measured times and the "
        f"{results['bandwidth'] / 1e12:.1f} TB/s copy bandwidth measured on the H200.",
        "- Times: CUDA events around each call after a warm-up, median of the repeats.",
        "- Errors: max |out - float64 reference| (`nbflash.attention_reference`) over the whole output; "
        "budget: flash-attn's rule, twice the error of a same-precision naive implementation "
        "(`nbflash.attention_naive`) plus a small floor.",
        "",
    ]
    if SIMULATOR:
        lines += [
            "**This run is from Numba's CUDA simulator (no GPU): memory is not measured and times are "
            "CPU times.**",
            "",
        ]
    for title, table, conclusions in sections(results):
        lines += [
            f"## {title}",
            "",
            tabulate(table, headers="keys", tablefmt="github", disable_numparse=True),
            "",
        ]
        lines += [f"- {line}" for line in conclusions] + [""]
    if images or note:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in images]
        if note:
            lines.append(note)
        lines.append("")
    path = docs_dir / "claims.md"
    path.write_text("\n".join(lines))
    return [path, *images]


def measuring_arguments(argv):
    """The command line less the options that only say where files go (--docs-dir, --json)."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--docs-dir", "--json"):
            skip = True
        elif not arg.startswith(("--docs-dir=", "--json=")):
            shown.append(arg)
    return shown


def run(args, log=print):
    """Every part the arguments ask for; returns the results (plain data, JSON-serializable)."""
    dev = device_info()
    parts = set(args.parts)
    results = {
        "command": " ".join(["python scripts/claims.py"] + measuring_arguments(args.argv)),
        "date": datetime.date.today().isoformat(),
        "device": dev,
        "simulator": SIMULATOR,
        "bandwidth": args.bandwidth,
        "config": {"batch": args.batch, "nheads": args.nheads, "headdim": args.headdim, "dtype": args.dtype},
        "memory": None,
        "speed": None,
        "errors": None,
    }
    seconds = results["seconds"] = {}
    t0 = time.perf_counter()
    if "memory" in parts:
        seqlens = args.mem_seqlens or default_mem_seqlens(args.mem_start, args.mem_max)
        results["memory"] = [
            memory_sweep(1, 1, args.headdim, args.dtype, seqlens, log=log),
            memory_sweep(args.batch, args.nheads, args.headdim, args.dtype, seqlens, log=log),
        ]
        seconds["memory"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
    if "speed" in parts:
        causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
        results["speed"] = speed_sweep(
            args.batch,
            args.nheads,
            args.headdim,
            args.dtype,
            args.seqlens,
            causals,
            args.repeats,
            args.budget,
            log=log,
        )
        seconds["speed"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
    if "errors" in parts:
        results["errors"] = error_sweep(
            1, args.error_heads, args.headdim, args.error_dtypes, args.error_seqlens, [False, True], log=log
        )
        seconds["errors"] = round(time.perf_counter() - t0, 1)
    log(f"  seconds per part (compilation included): {seconds}")
    return results


def parse_args(argv=None):
    sim = SIMULATOR
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1 if sim else 4, help="batch of the realistic shape")
    parser.add_argument("--nheads", type=int, default=2 if sim else 16, help="heads of the realistic shape")
    parser.add_argument("--headdim", type=int, default=16 if sim else 64)
    parser.add_argument("--dtype", default="float16", choices=list(SUPPORTED))
    parser.add_argument(
        "--parts", nargs="+", default=["memory", "speed", "errors"], choices=["memory", "speed", "errors"]
    )
    parser.add_argument(
        "--mem-start", type=int, default=16 if sim else 1024, help="first length of the memory sweep"
    )
    parser.add_argument(
        "--mem-max",
        type=int,
        default=64 if sim else 262144,
        help="the memory sweep doubles the length up to this, stopping once naive runs out of memory",
    )
    parser.add_argument("--mem-seqlens", type=int, nargs="+", help="explicit memory-sweep lengths instead")
    parser.add_argument(
        "--seqlens",
        type=int,
        nargs="+",
        default=[16, 32, 64] if sim else [512, 1024, 2048, 4096, 8192, 16384],
        help="lengths of the speed sweep",
    )
    parser.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--budget", type=float, default=1.0, help="seconds of timing per entry (at least 3 runs)"
    )
    parser.add_argument("--error-seqlens", type=int, nargs="+", default=[24] if sim else [1024, 4096])
    parser.add_argument("--error-heads", type=int, default=2 if sim else 4)
    parser.add_argument("--error-dtypes", nargs="+", default=list(SUPPORTED), choices=list(SUPPORTED))
    parser.add_argument("--bandwidth", type=float, default=COPY_BANDWIDTH, help="copy bandwidth, bytes/s")
    parser.add_argument(
        "--plots", action="store_true", help="write docs/claims_memory.png, docs/claims_time.png"
    )
    parser.add_argument("--write-docs", action="store_true", help="write docs/claims.md (and the plots)")
    parser.add_argument("--docs-dir", default=str(DOCS))
    parser.add_argument("--json", help="also write the raw results to this file")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv=None):
    args = parse_args(argv)
    dev = device_info()
    if SIMULATOR:
        print(
            "No CUDA GPU found: running in Numba's CUDA simulator at a tiny size "
            "(errors and computed bytes are real; memory n/a; times are CPU times)."
        )
    else:
        print(f"GPU: {dev['name']}, {fmt_bytes(dev['memory'])}")
    q, k, v = random_qkv(1, 64, 1, args.headdim, args.dtype)
    print(
        f"nbflash {nbflash.__version__}, kernel: {kernel_plan(q, k, v, False)[0]}; "
        f"headdim {args.headdim}, {args.dtype}; realistic shape B x H = {args.batch}x{args.nheads}"
    )
    start = time.perf_counter()
    results = run(args, log=lambda s: print(s, file=sys.stderr, flush=True))
    print_report(results)
    print(f"\n({time.perf_counter() - start:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write_docs:
        for path in write_docs(results, args.docs_dir, plots=True):
            print(f"wrote {path}")
    elif args.plots:
        try:
            for path in plot(results, args.docs_dir):
                print(f"wrote {path}")
        except ImportError:
            print(
                '--plots needs matplotlib: pip install ".[plot]" (or pip install matplotlib)', file=sys.stderr
            )
    return results


if __name__ == "__main__":
    main()
