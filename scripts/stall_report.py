"""Where a kernel's warps wait, instruction by instruction: a backward call for Nsight Compute to
profile, and a summary of its per-instruction stall samples.

    ncu --clock-control none --kernel-name regex:backward_dkdv --launch-skip 1 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -f -o stalls \\
        python3 scripts/stall_report.py run [--headdim 128] [--seqlen 4096] [--causal] [--dq-reduce red] \\
        [--option dq_warp]
    ncu ... --kernel-name regex:forward_sm90 ... python3 scripts/stall_report.py run --fp8 [--headdim 128] ...
    ncu --import stalls.ncu-rep --page source --csv --print-source sass > stalls.csv
    python3 scripts/stall_report.py summary stalls.csv [--top 40]

``run`` makes the planned backward's calls (the first one compiles and is skipped by
--launch-skip; the second is profiled): batch 4, 16 heads, float16, flash-attn's grid at hidden
2048, on the library's default family (the Hopper kernels on compute capability 9.0), whose dK/dV
kernel at hd 72-128 adds dQ tile-major (``dq_reduce="tiles"``: by the producer's stats warp from a
staged tile, docs/perf-notes.md, "Hopper backward", step 32); with ``--dq-reduce red`` it takes the
consumers' atomics instead (the form before, which short packed sequences keep); each ``--option
NAME`` turns on one of the planned dK/dV kernel's options: ``dq_warp`` (its staged dQ_i added by the
producer's warp 2), ``stats_ahead`` (the stats warp's lse and D loaded a step ahead), ``rotate``
(each block's query tiles rotated).
``summary`` reads ncu's source page (one row per SASS instruction) and prints the instructions
with the most stall samples, each with its share of the kernel's samples and the stall reasons
ncu attributes to it, then the samples grouped by instruction kind (HGMMA, BAR, SYNCS, LDS, REDG,
MUFU, ...): which wait the consumers spend their time in. docs/perf-notes.md, "Hopper backward",
says what the step's phases are.
"""

import argparse
import collections
import csv
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


OPTIONS = ("dq_warp", "stats_ahead", "rotate")  # boolean fields of backward_sm90.py's config, off as planned


def run(headdim, seqlen, causal, dq_reduce=None, fp8=False, options=()):
    import dataclasses

    import cupy
    import numpy as np

    import nbflash
    from nbflash import configs

    if dq_reduce:  # backward_sm90.py's config (hd 72-128), with dq_first
        planned = configs.sm90_backward_config
        configs.sm90_backward_config = lambda *args: dataclasses.replace(planned(*args), dq_reduce=dq_reduce)
    if options:  # the planned kernel (step 40's, hd 72-128's) with these options on
        planned_config = configs.sm90_backward_config
        configs.sm90_backward_config = lambda *args: dataclasses.replace(planned_config(*args),
                                                                         **dict.fromkeys(options, True))

    rng = np.random.default_rng(0)
    shape = (4, seqlen, 16, headdim)
    if fp8:
        import ml_dtypes

        q, k, v = (cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
                                .view(np.uint8)) for _ in range(3))
        for _ in range(2):  # the first compiles (ncu skips it), the second is profiled
            nbflash.flash_attn_func(q, k, v, causal=causal, fp8_dtype="float8_e4m3fn")
        cupy.cuda.runtime.deviceSynchronize()
        print(f"ran the fp8 forward twice: {shape}, causal={causal}")
        return
    q, k, v, dout = (cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(np.float16)) for _ in range(4))
    out, lse = nbflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    for _ in range(2):  # the first compiles (ncu skips it), the second is profiled
        nbflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)
    cupy.cuda.runtime.deviceSynchronize()
    print(f"ran the backward twice: {shape}, causal={causal}, {nbflash.explain(q, k, v, causal=causal)['family']}")


def _number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def summary(path, top, context=0):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    # ncu's CSV may start with lines of its own before the header: the header names the source
    header_at = next((i for i, row in enumerate(rows) if "Source" in row), None)
    if header_at is None:
        sys.exit(f"{path}: no header row with a 'Source' column; the first rows are {rows[:3]}")
    header, body = rows[header_at], [row for row in rows[header_at + 1:] if len(row) == len(rows[header_at])]
    samples_at = next((i for i, name in enumerate(header) if name.startswith("Warp Stall Sampling (All")), None)
    if samples_at is None:
        sys.exit(f"{path}: no 'Warp Stall Sampling (All Samples)' column; the columns are {header}")
    source_at = header.index("Source")
    # per-reason columns, where ncu gives them (names with 'stall' that hold numbers)
    reasons = [i for i, name in enumerate(header) if "stall" in name.lower() and i != samples_at
               and not name.startswith("Warp Stall Sampling")]
    executed_at = header.index("Instructions Executed") if "Instructions Executed" in header else None
    total = sum(_number(row[samples_at]) for row in body) or 1.0
    print(f"{len(body)} instructions, {total:.0f} stall samples")

    def ran(row):  # how many times the instruction ran, over all warps ("" without the column)
        return f"{_number(row[executed_at]):>10.0f}" if executed_at is not None else ""

    order = sorted(range(len(body)), key=lambda j: -_number(body[j][samples_at]))
    print(f"\nthe {top} instructions with the most samples (share of all, times run, then the largest reasons):")
    for rank, j in enumerate(order[:top]):
        row = body[j]
        share = _number(row[samples_at]) / total
        named = sorted(((_number(row[i]), header[i]) for i in reasons), reverse=True)[:3]
        why = ", ".join(f"{name} {value:.0f}" for value, name in named if value)
        print(f"  {share:6.1%} {ran(row)}  {row[source_at].strip()[:70]:70s}  {why}")
        if rank < 8:  # what comes before the hottest: a wait lands on the instruction after its cause
            for before in body[max(0, j - context):j]:
                print(f"  {'':6s} {ran(before)}    | {before[source_at].strip()[:70]}")
    if executed_at is not None:
        # Warps of one role run the same instructions the same number of times: the consumers' loop
        # once per consumer warp and step, the producer's warps' loops fewer times, the prologue once
        # per warp. So the samples grouped by that count say which role's instructions wait.
        groups = collections.Counter()
        for row in body:
            groups[_number(row[executed_at])] += _number(row[samples_at])
        print("\nsamples by how many times their instruction ran (one group per warp role and place):")
        for count, value in groups.most_common(8):
            print(f"  {value / total:6.1%}  {count:>10.0f}")
    kinds = collections.Counter()
    for row in body:
        opcode = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", row[source_at])
        kinds[opcode.group(1) if opcode else "?"] += _number(row[samples_at])
    print("\nsamples by instruction kind:")
    for kind, value in kinds.most_common(15):
        print(f"  {value / total:6.1%}  {kind}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("run", help="the backward calls to profile")
    one.add_argument("--headdim", type=int, default=128)
    one.add_argument("--seqlen", type=int, default=4096)
    one.add_argument("--causal", action="store_true")
    one.add_argument("--dq-reduce", choices=["red", "tiles"], default=None,
                     help="how the planned dK/dV kernel adds dQ (its dq_reduce; default: the planner's)")
    one.add_argument("--option", action="append", choices=OPTIONS, default=[],
                     help="turn on this option of the planned dK/dV kernel (repeat for several)")
    one.add_argument("--fp8", action="store_true", help="the fp8 forward's calls instead of the backward's")
    two = sub.add_parser("summary", help="summarize ncu's source page (CSV)")
    two.add_argument("csv")
    two.add_argument("--top", type=int, default=40)
    two.add_argument("--context", type=int, default=0,
                     help="also print this many instructions before each of the 8 hottest")
    args = parser.parse_args()
    if args.what == "run":
        run(args.headdim, args.seqlen, args.causal, args.dq_reduce, args.fp8, tuple(args.option))
    else:
        summary(args.csv, args.top, args.context)


if __name__ == "__main__":
    main()
