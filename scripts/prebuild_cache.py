"""Fill nbflash's on-disk kernel cache without a GPU: Numba -> PTX -> ptxas -> cubin, per configuration.

For images and CI runners that should start with every kernel already compiled (a tensor-core
configuration takes 10-40 s to compile), and for a GPU machine whose time is scarce: build here,
copy the folder there, point NBFLASH_CACHE_DIR at it. The cubins are what nbflash would compile on
a GPU of that compute capability with the same numba, numba-cuda and llvmlite. The cache key includes
their versions, so build with exactly the target's versions: on a machine with any other version
(numba 0.68.0 against 0.68.1 is enough) the files are simply not used, and kernels compile there.

    python scripts/prebuild_cache.py --cc 9.0 --cache-dir DIR [--headdims 64 128] [--dtypes float16] [--jobs 2]

Needs ptxas (the CUDA toolkit, or the nvidia-cuda-nvcc wheel) and Numba's NVVM; no GPU.
"""

import argparse
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def cuda_tool(name):
    """A CUDA tool (ptxas, cuobjdump, nvdisasm) from the nvidia-cuda-nvcc wheel, else from PATH."""
    try:
        import nvidia

        for root in nvidia.__path__:
            for sub in ("cu13/bin", "cuda_nvcc/bin", "cu12/bin"):
                path = os.path.join(root, sub, name)
                if os.path.exists(path):
                    return path
    except ImportError:
        pass
    found = shutil.which(name)
    if not found:
        sys.exit(f"{name} not found: install the CUDA toolkit or the nvidia-cuda-nvcc wheel")
    return found


def pretend_gpu(cc):
    """Numba asks the current device for its compute capability while compiling device functions;
    with no GPU, answer for the target."""
    import numba.cuda.dispatcher as dispatcher

    class Target:
        compute_capability = cc

    dispatcher.get_current_device = lambda: Target()


def configurations(dtypes, headdims, families, cc, unaligned=False, variants=None):
    """Every config a forward or backward call with these parameters compiles (the tensor-core
    forward's variant for rows off 16-byte boundaries only with ``unaligned``). ``variants``: the
    ``nbflash.problem.Variant`` values to build; by default the plain one and the window (which
    causal attention runs)."""
    from nbflash import configs
    from nbflash.problem import Static, Variant

    configs._compute_capability = lambda device=0: cc  # plan for the target GPU, not this machine
    alignments = (True, False) if unaligned else (True,)
    variants = variants or (Variant(), Variant(window=True))
    jobs = {}
    for dtype, headdim, variant, aligned in itertools.product(dtypes, headdims, variants, alignments):
        static = Static(dtype, headdim, aligned, 0, variant)
        mma = "mma" in families and dtype != "float32" and cc >= (8, 0)
        for family in [f for f in families if f == "portable" or mma]:
            jobs[configs.plan_forward(static, family)] = None
            for deterministic in (False, True):
                for config in configs.plan_backward(static, deterministic, family):
                    jobs[config] = None
    return list(jobs)


def catalogue_variants(names):
    """The static variants (nbflash.problem.Variant) the named catalogue entries compile."""
    import numpy as np

    from nbflash.catalogue import variant_arguments
    from nbflash.problem import Variant, window_bounds

    found = []
    for name in names:
        arguments = variant_arguments(name, 2, 4, 1024, np)
        window = window_bounds(1024, 1024, arguments.get("causal", False), arguments.get("window_size", (-1, -1)))[2]
        bias = arguments.get("bias")
        variant = Variant(window=window, softcap=arguments.get("softcap", 0) > 0,
                          alibi=arguments.get("alibi_slopes") is not None,
                          bias="float32" if bias is not None and bias.dtype != np.bool_ else "",
                          mask=bias is not None and bias.dtype == np.bool_)
        if variant not in found:
            found.append(variant)
    return found


def build_one(config, cc, cache_dir):
    os.environ["NBFLASH_CACHE_DIR"] = cache_dir
    pretend_gpu(cc)
    from numba import cuda

    from nbflash import cubin_cache
    from nbflash.kernels import registry

    signature = registry.signature(config)
    key = cubin_cache.cache_key(config, signature, cc)
    if os.path.exists(os.path.join(cache_dir, key + ".cubin")):
        return config, "cached", 0.0
    start = time.time()
    ptx, _ = cuda.compile_ptx(registry.build(config).py_func, signature, cc=cc)
    entry = re.search(r"\.entry\s+(\S+)\s*\(", ptx).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin_path = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        arch = f"-arch=sm_{cc[0]}{cc[1]}"
        subprocess.run([cuda_tool("ptxas"), arch, ptx_path, "-o", cubin_path], check=True, capture_output=True)
        with open(cubin_path, "rb") as f:
            cubin_cache.store(key, entry, f.read())
    return config, "built", time.time() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", default="9.0", help="compute capability, e.g. 9.0 (H100/H200) or 8.0 (A100)")
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16", "float32"])
    parser.add_argument("--headdims", type=int, nargs="+", default=[32, 64, 96, 128, 256])
    parser.add_argument("--families", nargs="+", default=["portable", "mma"], choices=["portable", "mma"])
    parser.add_argument("--unaligned", action="store_true", help="also the forward for unaligned rows")
    parser.add_argument(
        "--variants", nargs="+", default=None, metavar="NAME",
        help="the nbflash.catalogue variants to build (default: plain and causal, i.e. no feature and "
        "the window)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    args = parser.parse_args()
    cc = tuple(int(x) for x in args.cc.split("."))
    os.makedirs(args.cache_dir, exist_ok=True)
    jobs = configurations(args.dtypes, args.headdims, args.families, cc, args.unaligned,
                          catalogue_variants(args.variants) if args.variants else None)
    # Slowest first (tensor-core kernels, large head dims), so the pool ends evenly.
    jobs.sort(key=lambda config: ("Mma" in type(config).__name__, config.headdim), reverse=True)
    print(f"{len(jobs)} kernels for cc {args.cc} into {args.cache_dir}", flush=True)
    start = time.time()
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(build_one, config, cc, os.path.abspath(args.cache_dir)) for config in jobs]
        for done, future in enumerate(as_completed(futures), 1):
            config, status, seconds = future.result()
            print(f"[{done}/{len(jobs)}] {status} {seconds:5.1f} s  {config}", flush=True)
    print(f"done in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
