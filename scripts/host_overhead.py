"""Host time of one nbflash call on a tiny problem, next to a trivial CuPy ElementwiseKernel launch
(and, on compute capability 9.0, of the fp8 forward's call, with and without descale arrays).

Both are timed in the same run on the same arrays (the host is noisy: compare within a run): the
median over rounds of back-to-back calls, host clock, without synchronizing inside a round. A round
is kept well below the depth of the launch queue (about a thousand launches): past it the host waits
for the GPU and the time measured would include the kernels' run time.
Then the first call's time in fresh processes: cold (empty on-disk kernel cache) and warm (the cache
filled by the cold run).

    python scripts/host_overhead.py
    python scripts/host_overhead.py --decode    # flash_attn_with_kvcache instead, with a cProfile
    python scripts/host_overhead.py --decode --append-launch  # the append as a launch of its own
"""

import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
import time

import cupy
import numpy as np

import nbflash

FIRST_CALL = """
import time
t0 = time.perf_counter()
import cupy, nbflash
q = cupy.random.standard_normal((1, 16, 1, 64), dtype=cupy.float32).astype(cupy.{dtype})
t1 = time.perf_counter()
nbflash.flash_attn_func(q, q, q, causal=True)
cupy.cuda.Device().synchronize()
t2 = time.perf_counter()
print(f"{{t1 - t0:.2f}} {{t2 - t1:.2f}}")
"""


def host_us(fn, calls=200, rounds=31):
    fn()
    cupy.cuda.get_current_stream().synchronize()
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_round.append((time.perf_counter() - t0) / calls * 1e6)
        cupy.cuda.get_current_stream().synchronize()
    return float(np.median(per_round))


def first_call_seconds(dtype):
    """(import seconds, first-call seconds) for a cold and then a warm on-disk cache."""
    results = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, NBFLASH_CACHE_DIR=cache)
        for _ in ("cold", "warm"):
            run = subprocess.run(
                [sys.executable, "-c", FIRST_CALL.format(dtype=dtype)], env=env, capture_output=True, text=True
            )
            if run.returncode:
                results.append(("failed", run.stderr.strip().splitlines()[-1]))
            else:
                results.append(tuple(run.stdout.split()))
    return results


def main():
    q, k, v = (cupy.random.standard_normal((1, 16, 1, 64), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    trivial = cupy.ElementwiseKernel("T q, T k", "T out", "out = q + k", "nbflash_trivial")
    out = cupy.empty_like(q)
    rows = [
        ("cupy ElementwiseKernel (q + k)", host_us(lambda: trivial(q, k, out))),
        ("nbflash.flash_attn_func", host_us(lambda: nbflash.flash_attn_func(q, k, v))),
        ("nbflash.flash_attn_func causal", host_us(lambda: nbflash.flash_attn_func(q, k, v, causal=True))),
        ("cupy ElementwiseKernel (q + k), again", host_us(lambda: trivial(q, k, out))),
    ]
    if cupy.cuda.Device().compute_capability == "90":  # the fp8 forward: V^T and descales made each call
        q8 = cupy.zeros(q.shape, cupy.uint8)  # e4m3 bytes
        descales = cupy.ones((1, 1), cupy.float32)
        rows[-1:-1] = [
            ("nbflash.flash_attn_func fp8", host_us(lambda: nbflash.flash_attn_func(q8, q8, q8,
                                                                                    fp8_dtype="float8_e4m3fn"))),
            ("nbflash.flash_attn_func fp8, descales", host_us(lambda: nbflash.flash_attn_func(
                q8, q8, q8, fp8_dtype="float8_e4m3fn", q_descale=descales, k_descale=descales, v_descale=descales))),
        ]
    # Where the time goes: each stage of a call on its own.
    from nbflash import interface, launch, validation

    problem, *_ = validation.check_forward(q, k, v, None, False)
    kernel = interface._kernel_for(problem)
    lse = launch.empty((1, 1, 16), np.float32)
    grid = kernel.config.grid(1, 1, 16)
    stages = [
        ("  stage: validation.check_forward", lambda: validation.check_forward(q, k, v, None, False)),
        ("  stage: kernel lookup", lambda: interface._kernel_for(problem)),
        ("  stage: out and lse (one allocation)", lambda: launch.empty_pair(q.shape, q.dtype, (1, 1, 16), np.dtype(np.float32))),
        ("  stage: kernel.launch", lambda: kernel.launch(grid, (q, k, v, out, lse), (0.1,), problem.params, problem)),
    ]
    rows += [(name, host_us(fn)) for name, fn in stages]
    base = rows[0][1]
    print("host time per call, tiny problem (1, 16, 1, 64) float16:")
    for name, us in rows:
        print(f"  {name:40s} {us:8.1f} us  {us / base:5.2f}x")
    for dtype in ("float16", "float32"):
        (cold, warm) = first_call_seconds(dtype)
        print(f"first call {dtype}: cold cache import {cold[0]} s, call {cold[1]} s; warm cache import {warm[0]} s, call {warm[1]} s")


def decode_main():
    """A decode step's host time (batch 1, 32/8 heads, headdim 128, fp16, a 1024-token cache, lengths
    on the GPU, ``out=``): attention alone and with a one-token append, each next to the trivial
    kernel, then a cProfile of 2000 calls of each by own time."""
    batch, nheads, nheads_k, headdim, capacity = 1, 32, 8, 128, 1024
    q = cupy.zeros((batch, 1, nheads, headdim), cupy.float16)
    k_cache = cupy.zeros((batch, capacity, nheads_k, headdim), cupy.float16)
    v_cache = cupy.zeros_like(k_cache)
    k_new = cupy.zeros((batch, 1, nheads_k, headdim), cupy.float16)
    v_new = cupy.zeros_like(k_new)
    lengths = cupy.full((batch,), 100, cupy.int32)  # the append rewrites token 100 each call
    out = cupy.empty_like(q)
    trivial = cupy.ElementwiseKernel("T q, T k", "T out", "out = q + k", "nbflash_trivial")
    calls = {
        "flash_attn_with_kvcache": lambda: nbflash.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                                           cache_seqlens=lengths, out=out),
        "flash_attn_with_kvcache + append": lambda: nbflash.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, out=out),
    }
    rows = [("cupy ElementwiseKernel (q + q)", host_us(lambda: trivial(q, q, out)))]
    rows += [(name, host_us(fn)) for name, fn in calls.items()]
    rows.append(("cupy ElementwiseKernel (q + q), again", host_us(lambda: trivial(q, q, out))))
    base = rows[0][1]
    from nbflash import kvcache

    append = "" if kvcache.FUSED_APPEND else " (the append a launch of its own)"
    print(f"host time per decode call (1 x 1024 cache, 32/8 heads, headdim 128, float16, out=){append}:")
    for name, us in rows:
        print(f"  {name:40s} {us:8.1f} us  {us / base:5.2f}x")
    for name, fn in calls.items():
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(4):  # rounds of 500: the launch queue never fills
            for _ in range(500):
                fn()
            cupy.cuda.get_current_stream().synchronize()
        profiler.disable()
        print(f"\ncProfile of 2000 calls, {name}, by own time:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    if "--append-launch" in sys.argv[1:]:
        from nbflash import kvcache

        kvcache.FUSED_APPEND = False
    decode_main() if "--decode" in sys.argv[1:] else main()
