"""Time step 40's kernel (backward_sm90.py at 128 query rows a step) against the table's kernel on the
masks and ALiBi at headdim 64: configs.SM90_BACKWARD_KEYS128_VARIANTS off and on, interleaved.

    python scripts/keys128_variants.py [--variants NAME ...] [--seqlens N ...] [--headdim D] [--rounds R]
                                       [--deterministic]

Each shape is fp16, batch x seqlen = 16k tokens, 2048 / headdim query heads (as sm90_schedules.py's),
the catalogue's arguments for the variant (nbflash.catalogue; "causal-alibi-mask": causal ALiBi with
the document mask as a bool tensor; a mask_mod with its block mask, as bench.py gives it), under the
sm90 family. Both plans are timed as whole flash_attn_backward calls, a forward queued ahead of
each, call by call with the order rotated each round (sm90_schedules.py's ``interleaved_ms``: timed
in blocks, the GPU's clock drifts between them); their gradients are compared with each other
first. For the variants whose backward defaulted to the mma family (``MMA_DEFAULT``), that family's
backward is timed in the same rounds too. FLOPs are counted as 2.5x the forward's over the window's
visible pairs (the masks' skipped pairs counted too: the ratio between the plans is the figure).
With --deterministic: deterministic=True's plans, the dK/dV pass without dQ at 64 query rows against
128 (configs.SM90_DETERMINISTIC_KEYS128_VARIANTS), each followed by the sm90 dQ kernel; "mma" the
mma family's deterministic backward.
Needs a GPU of compute capability 9.0.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sm90_schedules import interleaved_ms  # noqa: E402

VARIANTS = ["causal-alibi", "alibi", "document-mask", "document-mask-mod", "causal-alibi-mask"]
# the variants whose backward defaulted to the mma family at headdim 64 (a bool mask tensor, before the
# thirty-second session's run moved it to sm90 there): timed on it too
MMA_DEFAULT = ["document-mask", "causal-alibi-mask"]


def arguments_of(name, batch, nheads, seqlen, xp):
    """(causal, the other arguments) of the catalogue's ``name``, or of causal ALiBi with its document
    mask."""
    from nbflash.catalogue import alibi_slopes, document_mask, variant_arguments

    if name == "causal-alibi-mask":
        return True, {"alibi_slopes": alibi_slopes(nheads, xp), "bias": document_mask(seqlen, seqlen, xp)}
    import nbflash

    arguments = dict(variant_arguments(name, batch, nheads, seqlen, xp, seqlen))
    if arguments.get("mask_mod") is not None:  # with its block mask, as bench.py gives it (empty tiles skipped)
        arguments["block_mask"] = nbflash.create_block_mask(arguments["mask_mod"], batch, nheads, seqlen, seqlen)
    return arguments.pop("causal", False), arguments


def time_shape(name, headdim, seqlen, rounds, tokens=16384, nheads=None, deterministic=False):
    import cupy

    import nbflash
    from nbflash import backward, configs
    from nbflash.catalogue import forward_arguments
    from nbflash.kernels.geometry import visible_count
    from nbflash.problem import window_bounds

    nheads, batch = nheads or 2048 // headdim, max(1, tokens // seqlen)
    rng = np.random.default_rng(seqlen + headdim)
    q, k, v, dout = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, headdim), np.float32))
                     .astype(np.float16) for _ in range(4))
    causal, arguments = arguments_of(name, batch, nheads, seqlen, cupy)
    forward_only = forward_arguments(arguments)
    out, lse = nbflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, **forward_only)
    left, right, _ = window_bounds(seqlen, seqlen, causal, tuple(arguments.get("window_size", (-1, -1))))
    flops = 2.5 * 4 * batch * nheads * visible_count(seqlen, seqlen, left, right) * headdim
    kernels, compiled, plan = backward._kernels, {}, ["table"]
    options = configs.SM90_BACKWARD_KEYS128_VARIANTS, configs.SM90_DETERMINISTIC_KEYS128_VARIANTS

    def kernels_of(*args, **kwargs):  # each plan's kernels kept apart: switching is a lookup
        configs.SM90_BACKWARD_KEYS128_VARIANTS = plan[0] == "step40"
        configs.SM90_DETERMINISTIC_KEYS128_VARIANTS = plan[0] == "step40"
        key = (plan[0], args, tuple(sorted(kwargs.items())))
        if key not in compiled:
            compiled[key] = kernels.__wrapped__(*args, **kwargs)
        return compiled[key]

    def call():  # the plans "table" and "step40" are the sm90 family's, "mma" the sm80 family's
        with nbflash.kernel_family("mma" if plan[0] == "mma" else "sm90"):
            return nbflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                                               **arguments)

    plans = ("table", "step40", "mma") if name in MMA_DEFAULT else ("table", "step40")

    backward._kernels = kernels_of
    try:
        got = {}
        for name_ in plans:
            plan[0] = name_
            got[name_] = [g.astype(np.float32) for g in call()]
            dkdv = [found[1].config for key, found in compiled.items() if key[0] == name_]
            print(f"  {name_}: {[type(c).__name__ + ' block_m ' + str(c.block_m) for c in dkdv]}", flush=True)
            for _ in range(2):
                call()
        difference = max(float(cupy.abs(a - b).max()) for other in plans[1:]
                         for a, b in zip(got["table"], got[other]))
        medians = interleaved_ms({n: call for n in plans}, rounds,
                                 before=lambda: nbflash.flash_attn_func(q, k, v, causal=causal, **forward_only),
                                 switch=lambda n: plan.__setitem__(0, n))
    finally:
        backward._kernels = kernels
        configs.SM90_BACKWARD_KEYS128_VARIANTS, configs.SM90_DETERMINISTIC_KEYS128_VARIANTS = options
        backward._kernels.cache_clear()
    tflops = {n: flops / ms / 1e9 for n, ms in medians.items()}
    return tflops["table"], tflops["step40"], tflops.get("mma"), difference


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=VARIANTS, metavar="NAME")
    parser.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384], metavar="N")
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic=True: the dK/dV pass without dQ at 64 against 128 query rows")
    args = parser.parse_args()
    rows = []
    for name in args.variants:
        for seqlen in args.seqlens:
            print(f"{name} hd {args.headdim} {seqlen}:", flush=True)
            table, step40, mma, difference = time_shape(name, args.headdim, seqlen, args.rounds,
                                                        deterministic=args.deterministic)
            rows.append((name, seqlen, table, step40, mma, difference))
            print(f"  table {table:.1f}, step 40 {step40:.1f} TFLOP/s, {step40 / table:.3f}x"
                  + (f", mma {mma:.1f}" if mma else "") + f", largest difference {difference:.3g}", flush=True)
    print("\n| variant | seqlen | table's kernel | step 40 | step 40 / table | mma family | max difference |")
    print("|---|---|---|---|---|---|---|")
    for name, seqlen, table, step40, mma, difference in rows:
        print(f"| {name} | {seqlen} | {table:.1f} | {step40:.1f} | {step40 / table:.3f} | "
              f"{f'{mma:.1f}' if mma else '-'} | {difference:.3g} |")


if __name__ == "__main__":
    main()
