"""Where the fp8 forward's time goes: V^T, the kernel, the whole call, and the kernel's schedules.

    python scripts/fp8_parts.py [--headdims D ...] [--seqlens N ...] [--schedules S ...] [--vt-threads T ...]

For each shape (flash-attn's grid: hidden 2048, batch 16384 / seqlen; e4m3 inputs from a normal
distribution, descales 1):
- "V^T us": the V^T kernel alone (nbflash/kernels/transpose_fp8.py), microseconds, and its GB/s
  (V read once, V^T written once); with --vt-threads, at each block size given (the first in the
  main columns, the others as "V^T us T");
- the fp8 kernel alone on a V^T made once, TFLOP/s, for each schedule: "plain" (the planned loop),
  "stages3" (its ring a stage deeper: 32 KB more shared memory up to headdim 128, 64 KB at 256,
  230,480 bytes in all, which fits), and up to headdim 128 "overlap" (S_j issued with P_{j-1}
  V_{j-1}) and "pingpong" (the two consumers taking turns), and with --schedules "fma3", "fma5" (3
  or 5 of each row's 16 key groups with P's exponentials on the FMA pipes: exp2_fma_groups), options of
  Sm90ForwardConfig; each output's largest difference from the plain loop's (not 0 for fma: the
  polynomial's P differs in its last bits, and e4m3 rounds some of them apart);
- "call": flash_attn_func on the uint8 arrays (fp8_dtype), V^T and descales included, as a user
  calls it.
Median of 15 timed calls between CUDA events after 3 warm-ups. Needs a GPU of compute capability 9.0
(docs/perf-notes.md, "The fp8 forward's V^T").
"""

import argparse
import dataclasses
import math
import os
import sys

import numpy as np
from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


SCHEDULES = ("plain", "stages3", "overlap", "pingpong", "fma3", "fma5")  # Sm90ForwardConfig's options
DEFAULT_SCHEDULES = SCHEDULES[:4]  # the fma forms on request (--schedules): gpu_check.sh fp8's time limit


def schedules(headdim, causal):
    from nbflash import configs
    from nbflash.problem import Variant

    plain = configs.sm90_fp8_forward_config(headdim, Variant(window=causal))
    found = {"plain": plain, "stages3": dataclasses.replace(plain, stages=3)}
    if headdim <= 128:  # at 256, S, P and O do not fit beside each other (check_sm90_ptx.py --fp8-forward)
        found["overlap"] = dataclasses.replace(plain, overlap=True)
        found["pingpong"] = dataclasses.replace(plain, overlap=True, pingpong=True)
    for groups in (3, 5):  # of each row's 16 key groups, this many with P's exponentials on the FMA pipes
        found[f"fma{groups}"] = dataclasses.replace(plain, exp2_fma_groups=groups)
    return found


def main(headdims, seqlens, names=SCHEDULES, vt_threads=(256,)):
    import cupy
    import ml_dtypes

    import nbflash
    from nbflash import interface, launch
    from nbflash.dtypes import BFLOAT16
    from nbflash.kernels.geometry import visible_count
    from nbflash.kernels.transpose_fp8 import Fp8TransposeConfig
    from nbflash.measure import time_ms
    from nbflash.problem import window_bounds

    def median_ms(call):
        return time_ms(call, warmup=3, repeats=15, budget_s=math.inf)

    rows = []
    for headdim in headdims:
        for causal in (False, True):
            for seqlen in seqlens:
                nheads, batch = 2048 // headdim, max(1, 16384 // seqlen)
                rng = np.random.default_rng(seqlen + headdim)
                q, k, v = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, headdim), np.float32)
                                        .astype(ml_dtypes.float8_e4m3fn).view(np.uint8)) for _ in range(3))
                left, right, _ = window_bounds(seqlen, seqlen, causal, (-1, -1))
                flops = 4 * batch * nheads * visible_count(seqlen, seqlen, left, right) * headdim
                descales = cupy.ones((3, batch, nheads), np.float32)
                params = ((np.int32(left), np.int32(right)) if causal else ()) + (descales,)
                scale_log2 = np.float32(math.log2(math.e) / math.sqrt(headdim))

                vt = interface.fp8_transposed_v(v)
                row = {"shape": (headdim, seqlen, causal)}
                for threads in vt_threads:  # the V^T kernel alone, at each block size
                    vt_config = Fp8TransposeConfig(threads=threads)
                    vt_kernel, vt_grid = launch.compiled(vt_config), vt_config.grid(batch, nheads, headdim, seqlen)
                    vt_ms = median_ms(lambda: vt_kernel.launch(vt_grid, (v.view(np.uint32), vt.view(np.uint32)), ()))
                    suffix = "" if threads == vt_threads[0] else f" {threads}"
                    row["V^T us" + suffix] = round(vt_ms * 1e3, 1)
                    row["V^T GB/s" + suffix] = round(2 * v.nbytes / vt_ms / 1e6)
                vt = interface.fp8_transposed_v(v)  # the planned kernel's, for the schedules below
                reference = None
                for name, config in schedules(headdim, causal).items():
                    if name not in names:
                        continue
                    kernel = launch.compiled(config)
                    out, lse = launch.empty_pair(q.shape, BFLOAT16, (batch, nheads, seqlen), np.dtype(np.float32))
                    grid = config.grid(batch, nheads, seqlen)

                    def call():
                        kernel.launch(grid, (q.view(np.uint16), k.view(np.uint16), vt, out, lse), (scale_log2,),
                                      params)

                    call()
                    got = out.astype(np.float32)
                    reference = got if reference is None else reference
                    row[name] = (round(flops / median_ms(call) / 1e9, 1), float(cupy.abs(got - reference).max()))
                row["call"] = round(flops / median_ms(lambda: nbflash.flash_attn_func(
                    q, k, v, causal=causal, fp8_dtype="float8_e4m3fn")) / 1e9, 1)
                rows.append(row)
                print(row, flush=True)

    table = []
    for row in rows:
        headdim, seqlen, causal = row["shape"]
        timed = [name for name in SCHEDULES if name in row]
        table.append({"hd": headdim, "seqlen": seqlen, "causal": causal,
                      **{name: row[name][0] if name in row else "-" for name in names},
                      "call": row["call"], **{key: value for key, value in row.items() if key.startswith("V^T")},
                      "max difference": f"{max(row[name][1] for name in timed):.2g}"})
    print("fp8 forward, TFLOP/s (the kernel alone on a ready V^T, then the whole call); V^T alone")
    print(tabulate(table, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Time the fp8 forward's parts and schedules.")
    parser.add_argument("--headdims", type=int, nargs="+", default=[64, 128, 256], metavar="D")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384], metavar="N")
    parser.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES), choices=SCHEDULES, metavar="S",
                        help=f"the kernel's schedules to time (of {', '.join(SCHEDULES)}; default "
                             f"{' '.join(DEFAULT_SCHEDULES)}; plain is always timed)")
    parser.add_argument("--vt-threads", type=int, nargs="+", default=[256], metavar="T",
                        help="the V^T kernel's block sizes to time (the first is the one the columns without a "
                             "size give)")
    args = parser.parse_args()
    main(args.headdims, args.seqlens, tuple(dict.fromkeys(["plain"] + args.schedules)), tuple(args.vt_threads))
