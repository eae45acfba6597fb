"""Time the decode kernel's block configurations (configs.MMA_DECODE rows) on a few decode shapes.

Builds every candidate's kernels in parallel processes first (into the on-disk cubin cache, as
prebuild_cache.py does), then times ``flash_attn_with_kvcache`` with each candidate in turn and
prints microseconds and KV bytes / time as a fraction of the copy bandwidth measured in the run.

    python scripts/decode_tune.py --candidates 64x4x3 64x4x4 128x4x2 --shapes 1x131072 64x4096 \
        --heads 32x8 --headdim 128 --page-sizes none 16 --jobs 16

A candidate is BLOCKNxWARPSxSTAGES: keys per pipeline stage, warps, stages in flight. With
``--num-splits`` each candidate runs with each split count (0: the library's heuristic), a column
group each. "us" is a call's time with 20 calls back to back between two CUDA events (its host time
hidden, as in a decode loop); "host us" and "gpu us" are cupyx's benchmark of one call at a time.
"""

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cupy  # noqa: E402
import numpy as np  # noqa: E402
from cupyx.profiler import benchmark  # noqa: E402
from tabulate import tabulate  # noqa: E402

import nbflash  # noqa: E402
from nbflash import configs, kvcache  # noqa: E402
from nbflash.dtypes import SUPPORTED  # noqa: E402
from nbflash.measure import back_to_back_ms  # noqa: E402
from nbflash.problem import Variant  # noqa: E402


def pair(text):
    a, b = text.lower().split("x")
    return int(a), int(b)


def candidate_config(candidate, dtype, headdim, paged, rows):
    block_n, warps, stages = candidate
    # The candidate for every call, whatever its count of units (the plan takes MMA_DECODE_WIDE's
    # row when they are fewer than the SMs).
    configs.MMA_DECODE[:] = [(256, block_n, warps, stages)]
    configs.MMA_DECODE_WIDE[:] = [(256, block_n, warps, stages)]
    configs.decode_config.cache_clear()
    kvcache.forget_plans()  # a remembered call would keep the previous candidate's plan and kernel
    return configs.decode_config(dtype, headdim, Variant(), paged, False, True, rows)


def caches(batch, context, nheads_k, headdim, dtype, page, rng):
    if page is None:
        shape = (batch, context, nheads_k, headdim)
        table = None
    else:
        per_seq = -(-context // page)
        shape = (batch * per_seq, page, nheads_k, headdim)
        table = cupy.asarray(rng.permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int32))
    k = cupy.random.standard_normal(shape, dtype=np.float32).astype(dtype)
    v = cupy.random.standard_normal(shape, dtype=np.float32).astype(dtype)
    return k, v, table


def copy_bandwidth():
    a = cupy.empty(1 << 30, np.uint8)
    b = cupy.empty_like(a)
    ms = back_to_back_ms(lambda: cupy.copyto(b, a), 20, repeats=20, budget_s=1.0)
    return 2 * a.nbytes / (ms * 1e-3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", nargs="+", default=["64x4x3", "64x4x4", "128x4x2", "32x2x4"])
    parser.add_argument("--shapes", nargs="+", default=["1x131072", "16x16384", "64x4096"])
    parser.add_argument("--heads", nargs="+", default=["32x8"])
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--page-sizes", nargs="+", default=["none"])
    parser.add_argument("--num-splits", type=int, nargs="+", default=[0],
                        help="split counts to time each candidate with (0: the library's heuristic)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    args = parser.parse_args()
    candidates = [tuple(int(x) for x in c.split("x")) for c in args.candidates]
    pages = [None if p == "none" else int(p) for p in args.page_sizes]
    heads = [pair(h) for h in args.heads]
    shapes = [pair(s) for s in args.shapes]

    import prebuild_cache

    cc = cupy.cuda.Device().compute_capability
    cc = (int(cc[:-1]), int(cc[-1]))
    cache_dir = os.environ.get("NBFLASH_CACHE_DIR") or os.path.expanduser("~/.cache/nbflash")
    jobs = {candidate_config(c, args.dtype, args.headdim, p is not None, h // hk): None
            for c in candidates for p in pages for h, hk in heads}
    with ProcessPoolExecutor(args.jobs) as pool:
        for config, status, seconds in pool.map(prebuild_cache.build_one, jobs, [cc] * len(jobs),
                                                [cache_dir] * len(jobs)):
            print(f"{status} {seconds:5.1f} s  {config}", file=sys.stderr, flush=True)

    bandwidth = copy_bandwidth()
    # The host-time yardstick (issue 11: a decode call within 1.5x of it): one trivial elementwise
    # kernel, launched the same way.
    trivial = cupy.ElementwiseKernel("float32 x", "float32 y", "y = x", "nbflash_trivial")
    x = cupy.zeros(1, np.float32)
    y = cupy.empty_like(x)
    timing = benchmark(lambda: trivial(x, y), n_repeat=200, n_warmup=10)
    trivial_us = 1e6 * float(np.median(timing.cpu_times))
    rows = []
    dtype = SUPPORTED[args.dtype]
    for nheads, nheads_k in heads:
        for batch, context in shapes:
            rng = np.random.default_rng(0)
            q = cupy.random.standard_normal((batch, 1, nheads, args.headdim), dtype=np.float32).astype(dtype)
            kv_bytes = 2 * batch * context * nheads_k * args.headdim * dtype.itemsize
            for page in pages:
                k, v, table = caches(batch, context, nheads_k, args.headdim, dtype, page, rng)
                lens = cupy.full(batch, context, np.int32)
                row = {"heads": f"{nheads}/{nheads_k}", "shape": f"{batch}x{context}",
                       "layout": "contiguous" if page is None else f"paged {page}"}
                reference = None
                for c in candidates:
                    candidate_config(c, args.dtype, args.headdim, page is not None, nheads // nheads_k)
                    for num_splits in args.num_splits:

                        def call():
                            return nbflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table,
                                                                   num_splits=num_splits)

                        out = call()
                        reference = out if reference is None else reference
                        agree = float(cupy.abs(out.astype(np.float32) - reference.astype(np.float32)).max())
                        us = 1e3 * back_to_back_ms(call, 20, repeats=30, budget_s=1.0)
                        # Host and device time of one call apart (cupyx's benchmark: CPU time of the call,
                        # GPU time between events around it).
                        timing = benchmark(call, n_repeat=30, n_warmup=3)
                        name = "x".join(map(str, c)) + (f"/{num_splits}" if num_splits else "")
                        row[f"{name} host us"] = round(1e6 * float(np.median(timing.cpu_times)), 1)
                        row[f"{name} gpu us"] = round(1e6 * float(np.median(timing.gpu_times[0])), 1)
                        splits = kvcache._last_plan.splits  # the plan's count (its heuristic's, or num_splits)
                        row[f"{name} us"] = round(us, 1)
                        row[f"{name} BW"] = round(kv_bytes / (us * 1e-6) / bandwidth, 3)
                        row[f"{name} splits"] = splits
                        assert agree < 2e-2, f"candidate {name} disagrees with the first by {agree}"
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
                k = v = table = None
                cupy.get_default_memory_pool().free_all_blocks()
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s; {args.dtype}, headdim {args.headdim}, seqlen_q 1; "
          f"host time of a trivial CuPy ElementwiseKernel call {trivial_us:.1f} us")
    print(tabulate(rows, headers="keys"))


if __name__ == "__main__":
    main()
