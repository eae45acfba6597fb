"""Host time of one nbflash call on a tiny problem, next to a trivial CuPy ElementwiseKernel launch.

Both are timed in the same run on the same arrays (the host is noisy: compare within a run): the
median of many back-to-back calls, host clock, without synchronizing inside the loop. Also reports
the first call's time (compilation) for one fresh configuration.

    python scripts/host_overhead.py
"""

import time

import cupy
import numpy as np

import nbflash


def host_us(fn, calls=2000, rounds=7):
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


def main():
    q, k, v = (cupy.random.standard_normal((1, 16, 1, 16), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    t0 = time.perf_counter()
    nbflash.flash_attn_func(q, k, v, causal=True)
    cupy.cuda.get_current_stream().synchronize()
    first = time.perf_counter() - t0
    trivial = cupy.ElementwiseKernel("T q, T k", "T out", "out = q + k", "nbflash_trivial")
    out = cupy.empty_like(q)
    rows = [
        ("cupy ElementwiseKernel (q + k)", host_us(lambda: trivial(q, k, out))),
        ("nbflash.flash_attn_func", host_us(lambda: nbflash.flash_attn_func(q, k, v))),
        ("nbflash.flash_attn_func causal", host_us(lambda: nbflash.flash_attn_func(q, k, v, causal=True))),
    ]
    base = rows[0][1]
    print(f"first call (compile + launch): {first:.2f} s")
    for name, us in rows:
        print(f"{name:40s} {us:8.1f} us/call  {us / base:5.2f}x")


if __name__ == "__main__":
    main()
