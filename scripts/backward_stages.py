"""Where the tensor-core backward's time goes: its dK/dV kernel timed with one stage removed at a time.

Each variant is the production dK/dV kernel (nbflash/kernels/backward_mma.py) compiled with one of
its primitives replaced before compilation, so everything else stays exactly as shipped:

  full         the kernel as shipped
  no-dq-red    the dQ reductions skipped (each guarded by a test that never holds, so the dS K
               products that feed them are still computed)
  no-dq        the whole dQ step gone (its reductions replaced by nothing, so the compiler drops the
               products too; the dS^T stores and barriers stay)
  no-copies    the Q, dO, K, V tile copies skipped (the kernel computes on whatever shared memory
               holds: the results are garbage, the work is the same)

Only the timing is meaningful for the variants other than full. Two steps:

  build  (no GPU) copy the prebuilt kernel cache BASE into OUT/<variant>/ and replace, in each copy,
         the cubin of the headdim-128 fp16 atomic dK/dV kernel (non-causal) with the variant's:
             python scripts/backward_stages.py build --cache-dir BASE --out OUT
  run    (GPU) time each variant with scripts/bench.py --pass backward in its own process (its
         NBFLASH_CACHE_DIR pointing at the variant's copy), next to SDPA flash's backward:
             python scripts/backward_stages.py run --out OUT [--seqlens 4096 16384]
"""

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

VARIANTS = ("full", "no-dq-red", "no-dq", "no-copies")
CC = (9, 0)


def patch(variant):
    """Replace one primitive the dK/dV kernel calls (module globals are read at compile time)."""
    from numba import cuda, float32

    from nbflash.kernels import backward_mma

    if variant == "no-dq-red":
        reduce = backward_mma.red_add_f32x2

        @cuda.jit(device=True, inline=True)
        def rare_reduction(address, a, b):
            if a == float32(1.5e-45) and b == float32(1.5e-45):  # the smallest subnormal: never here
                reduce(address, a, b)

        backward_mma.red_add_f32x2 = rare_reduction
    elif variant == "no-dq":

        @cuda.jit(device=True, inline=True)
        def no_reduction(address, a, b):
            pass

        backward_mma.red_add_f32x2 = no_reduction
    elif variant == "no-copies":

        @cuda.jit(device=True, inline=True)
        def no_copy(dst, src_address, src_bytes):
            pass

        backward_mma.cp_async_16_from = no_copy


def build_variant(variant, base, out):
    """In a fresh process: patch, then compile the dK/dV configs into OUT/<variant>/."""
    import prebuild_cache

    prebuild_cache.pretend_gpu(CC)
    from nbflash import configs

    configs._compute_capability = lambda device=0: CC
    from nbflash import cubin_cache
    from nbflash.kernels import registry
    from nbflash.problem import Static, Variant

    patch(variant)
    folder = os.path.join(out, variant)
    os.makedirs(folder, exist_ok=True)
    built = []
    for causal in (False,):  # run times non-causal rows
        # What one bench row runs: the forward (for out and lse), then the backward's three kernels.
        static = Static("float16", 128, True, 0, Variant(window=causal))
        kernels = [configs.plan_forward(static)] + list(configs.plan_backward(static, False, "mma"))
        for config in kernels:
            signature = registry.signature(config)
            name = cubin_cache.cache_key(config, signature, CC) + ".cubin"
            if config.__class__.__name__ == "MmaBackwardConfig":  # the dK/dV kernel: this variant's
                if os.path.exists(os.path.join(folder, name)):
                    os.remove(os.path.join(folder, name))
                _, status, seconds = prebuild_cache.build_one(config, CC, folder)
                built.append(f"{variant} causal={causal}: dK/dV {status} in {seconds:.0f} s")
            else:
                shutil.copy(os.path.join(base, name), folder)  # the shipped kernel, prebuilt
    return built


def build(args):
    for variant in VARIANTS:
        run = subprocess.run([sys.executable, __file__, "build-one", variant, "--cache-dir", args.cache_dir,
                              "--out", args.out], capture_output=True, text=True)
        print(run.stdout.strip() or run.stderr.strip()[-2000:], flush=True)


def run(args):
    rows = []
    for variant in VARIANTS:
        env = dict(os.environ, NBFLASH_CACHE_DIR=os.path.abspath(os.path.join(args.out, variant)))
        table = os.path.join(args.out, f"{variant}.md")
        command = [sys.executable, os.path.join(HERE, "bench.py"), "--pass", "backward", "--families", "mma",
                   "--headdims", "128", "--seqlens", *map(str, args.seqlens), "--dtypes", "float16",
                   "--causal", args.causal, "--budget", str(args.budget), "--markdown", table]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        for line in done.stderr.splitlines():
            match = re.match(r"\[\d+/\d+\] (\{.*\})$", line)
            if match:
                row = ast.literal_eval(match.group(1))  # bench.py prints each row as a dict literal
                rows.append(dict(variant=variant, **row))
        if done.returncode:
            print(f"{variant}: bench.py failed: {done.stderr.strip()[-1500:]}", flush=True)
    from tabulate import tabulate

    full = {(r["seqlen"], r["causal"]): r["nbflash mma"] for r in rows if r["variant"] == "full"}
    for r in rows:
        base = full.get((r["seqlen"], r["causal"]))
        if isinstance(base, float) and isinstance(r["nbflash mma"], float):
            # Share of the full kernel's time this stage costs: 1 - t_without / t_full.
            r["stage share of time"] = round(1 - base / r["nbflash mma"], 2)
    print("backward TFLOP/s at headdim 128, fp16, each variant timed in its own process with SDPA flash")
    print(tabulate(rows, headers="keys"))
    with open(os.path.join(args.out, "stages.json"), "w") as f:
        json.dump(rows, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["build", "run", "build-one"])
    parser.add_argument("variant", nargs="?", choices=VARIANTS)
    parser.add_argument("--cache-dir", help="build: the prebuilt kernel cache to start from")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--causal", choices=["no", "yes", "both"], default="no")
    parser.add_argument("--budget", type=float, default=0.2)
    args = parser.parse_args()
    if args.step == "build-one":
        print("\n".join(build_variant(args.variant, args.cache_dir, args.out)))
    elif args.step == "build":
        build(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
