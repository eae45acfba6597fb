"""``python -m nbflash prebuild``: compile kernels ahead of their first use, into the on-disk cache.

The first call of each configuration compiles its kernel (10-40 s for a tensor-core one). This builds
the forward and backward configurations of the given dtypes, head dimensions and variants on all CPU
cores, without a GPU: Numba -> PTX -> ptxas -> cubin per configuration, written where
``nbflash.cubin_cache`` looks. The cubins are what nbflash would compile on a GPU of that compute
capability with the same numba, numba-cuda and llvmlite. The cache key includes their versions, so
a folder built for another machine (``--cc``, then copy it there and point NBFLASH_CACHE_DIR at it)
must be built with exactly that machine's versions; otherwise its files are simply not used.

Needs ptxas (the CUDA toolkit, or the nvidia-cuda-nvcc wheel) and Numba's NVVM (numba-cuda's CUDA
extra, ``nbflash[cuda12]`` or ``nbflash[cuda13]``).
"""

import argparse
import itertools
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager

from . import cubin_cache, launch, runtime
from .configs import FAMILY_ALIASES
from .kernels import registry

DTYPES = ("float16", "bfloat16", "float32")
HEADDIMS = (32, 64, 96, 128, 256)
FAMILIES = ("portable", "sm80", "sm90")
FAMILY_NAMES = FAMILIES + tuple(FAMILY_ALIASES)  # with the earlier names ("mma")


class MissingTool(RuntimeError):
    """A CUDA command-line tool the build needs is not installed."""


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
        raise MissingTool(f"{name} not found: install the CUDA toolkit or the nvidia-cuda-nvcc wheel")
    return found


def pretend_gpu(cc):
    """Numba asks the current device for its compute capability while compiling device functions;
    with no GPU, answer for the target."""
    import numba.cuda.dispatcher as dispatcher

    class Target:
        compute_capability = cc

    dispatcher.get_current_device = lambda: Target()


@contextmanager
def _planning_for(cc):
    """``nbflash.configs`` plans for the target GPU, not this machine's, until the block ends."""
    from . import configs

    own = configs._compute_capability
    configs._compute_capability = lambda device=0: cc
    try:
        yield configs
    finally:
        configs._compute_capability = own


def configurations(dtypes, headdims, families, cc, unaligned=False, variants=None):
    """Every config a forward or backward call with these parameters compiles (the tensor-core
    forward's variant for rows off 16-byte boundaries only with ``unaligned``). ``variants``: the
    ``nbflash.problem.Variant`` values to build; by default the plain one and the window (which
    causal attention runs)."""
    from .problem import Static, Variant

    alignments = (True, False) if unaligned else (True,)
    variants = variants or (Variant(), Variant(window=True))
    jobs = {}
    with _planning_for(cc) as configs:
        families = [configs.canonical_family(f) for f in families]
        for dtype, headdim, variant, aligned in itertools.product(dtypes, headdims, variants, alignments):
            static = Static(dtype, headdim, aligned, 0, variant)
            mma = "sm80" in families and dtype != "float32" and cc >= (8, 0)
            # The sm90 family is the loop below: it serves aligned rows only, so it has no place here.
            for family in [f for f in families if f == "portable" or (f == "sm80" and mma)]:
                jobs[configs.plan_forward(static, family)] = None
                if family == "sm80" and configs._sm90_default(static):  # what the forward runs by default
                    jobs[configs.plan_forward(static)] = None
                for deterministic in (False, True):
                    # out's rows aligned too where the rest are (the row-wise kernels' 16-byte forms,
                    # when configs.ROWWISE_VECTOR plans them)
                    for out_aligned in (False, True) if aligned else (False,):
                        for config in configs.plan_backward(static, deterministic, family, None, out_aligned):
                            jobs[config] = None
                        if family == "sm80":  # what the backward runs by default (sm90's dK/dV on Hopper)
                            for config in configs.plan_backward(static, deterministic, None, None, out_aligned):
                                jobs[config] = None
        if "sm90" in families and cc == configs.SM90_COMPUTE_CAPABILITY:  # the Hopper kernels, forced or not
            for dtype, headdim, variant in itertools.product(dtypes, headdims, variants):
                static = Static(dtype, headdim, True, 0, variant)
                if not configs.sm90_unsupported_reason(static):
                    jobs[configs.plan_forward(static, "sm90")] = None
                if not configs.mma_unsupported_reason(dtype):
                    for deterministic in (False, True):
                        for out_aligned in (False, True):
                            for config in configs.plan_backward(static, deterministic, "sm90", None, out_aligned):
                                jobs[config] = None
    return list(jobs)


def catalogue_variants(names):
    """The static variants (nbflash.problem.Variant) the named catalogue entries compile. Entries
    with a user function (score-mod) are left out: the worker processes cannot compile the caller's
    function, whose kernels are built at their first call instead."""
    import numpy as np

    from .catalogue import variant_arguments
    from .problem import Variant, window_bounds

    found = []
    for name in names:
        arguments = variant_arguments(name, 2, 4, 1024, np)
        if "score_mod" in arguments:
            continue
        window = window_bounds(1024, 1024, arguments.get("causal", False), arguments.get("window_size", (-1, -1)))[2]
        bias = arguments.get("bias")
        variant = Variant(window=window, softcap=arguments.get("softcap", 0) > 0,
                          alibi=arguments.get("alibi_slopes") is not None,
                          bias="float32" if bias is not None and bias.dtype != np.bool_ else "",
                          mask=bias is not None and bias.dtype == np.bool_,
                          dropout=arguments.get("dropout_p", 0) > 0)
        if variant not in found:
            found.append(variant)
    return found


def cached_file(config, cc, cache_dir):
    """The path ``config``'s cubin for compute capability ``cc`` has in ``cache_dir``."""
    key = cubin_cache.cache_key(config, registry.signature(config), cc)
    return os.path.join(cache_dir, key + ".cubin")


def build_one(config, cc, cache_dir):
    """Compile ``config`` for ``cc`` into ``cache_dir`` (unless it is there): (config, "built" or
    "cached", seconds)."""
    os.environ["NBFLASH_CACHE_DIR"] = cache_dir
    pretend_gpu(cc)
    from numba import cuda

    signature = registry.signature(config)
    key = cubin_cache.cache_key(config, signature, cc)
    if os.path.exists(os.path.join(cache_dir, key + ".cubin")):
        return config, "cached", 0.0
    start = time.time()
    # An arch-specific kernel (sm_90a's wgmma) compiles for its suffixed target, with its launch bounds.
    suffix = getattr(config, "arch_suffix", "")
    options = {"launch_bounds": config.launch_bounds} if hasattr(config, "launch_bounds") else {}
    ptx, _ = cuda.compile_ptx(registry.build(config).py_func, signature, cc=(*cc, suffix) if suffix else cc,
                              **options)
    entry = re.search(r"\.entry\s+(\S+)\s*\(", ptx).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin_path = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        arch = f"-arch=sm_{cc[0]}{cc[1]}{suffix}"
        done = subprocess.run([cuda_tool("ptxas"), arch, ptx_path, "-o", cubin_path], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"ptxas {arch} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        with open(cubin_path, "rb") as f:
            cubin_cache.store(key, entry, f.read())
    return config, "built", time.time() - start


# ---------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------


def _compute_capability(text):
    match = re.fullmatch(r"(\d+)\.(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not MAJOR.MINOR, such as 9.0")
    return int(match[1]), int(match[2])


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _headdim(text):
    value = int(text)
    if not 1 <= value <= 256:
        raise argparse.ArgumentTypeError(f"{value} is not in 1..256")
    return value


def parser(prog="python -m nbflash prebuild"):
    from .catalogue import VARIANTS

    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Compile nbflash's forward and backward kernels ahead of their first use, on all CPU cores, "
            "into the on-disk kernel cache that later calls load them from (a tensor-core kernel takes "
            "10-40 s to compile on first use). Needs ptxas and Numba's NVVM, no GPU: with --cc it builds "
            "for another machine (copy the folder there and point NBFLASH_CACHE_DIR at it; that machine "
            "must have the same numba, numba-cuda and llvmlite versions, or the files are not used)."
        ),
    )
    p.add_argument("--cc", type=_compute_capability, metavar="MAJOR.MINOR",
                   help="compute capability to build for, e.g. 9.0 (H100, H200) or 8.0 (A100) "
                   "(default: the local GPU's)")
    p.add_argument("--jobs", type=_positive, default=os.cpu_count(), metavar="N",
                   help=f"processes compiling at once (default: {os.cpu_count()}, the CPU count)")
    p.add_argument("--headdims", type=_headdim, nargs="+", default=list(HEADDIMS), metavar="D",
                   help=f"head dimensions (default: {' '.join(map(str, HEADDIMS))})")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES, metavar="DTYPE",
                   help=f"element types (default: {' '.join(DTYPES)})")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILY_NAMES, metavar="FAMILY",
                   help="kernel families: portable, sm80 (alias mma: tensor cores by mma.sync; fp16 and bf16 on "
                   "cc >= 8.0), sm90 (the Hopper kernels; cc 9.0) (default: all)")
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), metavar="NAME",
                   help="nbflash.catalogue variants to build, of: " + ", ".join(sorted(VARIANTS))
                   + " (default: plain and causal)")
    p.add_argument("--unaligned", action="store_true",
                   help="also the tensor-core forward for rows off 16-byte boundaries")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="where the cubins go (default: $NBFLASH_CACHE_DIR, else $XDG_CACHE_HOME/nbflash, else "
                   "~/.cache/nbflash)")
    return p


def _local_capability():
    """The compute capability of the GPU CuPy sees, or None."""
    if not runtime.gpu_present():
        return None
    import cupy

    capability = cupy.cuda.Device(0).compute_capability  # e.g. "90"
    return int(capability[:-1]), int(capability[-1])


@contextmanager
def _without_simulator():
    """Worker processes compile for real: they start without NUMBA_ENABLE_CUDASIM."""
    saved = os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["NUMBA_ENABLE_CUDASIM"] = saved


def _estimate(kernels, jobs):
    """'about 3-12 min': the typical compile time of these configs spread over ``jobs`` processes."""
    low, high = (sum(launch.compile_seconds(config)[i] for config in kernels) / jobs for i in (0, 1))
    if high < 120:
        return f"about {low:.0f}-{high:.0f} s"
    return f"about {low / 60:.0f}-{high / 60:.0f} min"


def main(argv=None, prog="python -m nbflash prebuild"):
    """Run the command line; returns the exit status (0, or 1 when a kernel failed to build)."""
    from tqdm import tqdm

    p = parser(prog)
    args = p.parse_args(argv)
    cc = args.cc or _local_capability()
    if cc is None:
        p.error("no CUDA GPU is visible (through CuPy): pass --cc, the compute capability to build for, "
                "e.g. --cc 9.0 for H100/H200 or --cc 8.0 for A100")
    try:
        cuda_tool("ptxas")
    except MissingTool as error:
        p.error(str(error))
    cache_dir = os.path.abspath(args.cache_dir or cubin_cache.cache_dir())
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as error:
        p.error(f"cannot create the cache folder: {error}")
    variants = catalogue_variants(args.variants) if args.variants else None
    wanted = configurations(args.dtypes, args.headdims, args.families, cc, args.unaligned, variants)
    todo = [config for config in wanted if not os.path.exists(cached_file(config, cc, cache_dir))]
    # Slowest first (tensor-core kernels, large head dims), so the pool ends evenly.
    todo.sort(key=lambda config: (launch.compile_seconds(config)[1], config.headdim), reverse=True)
    jobs = max(1, min(args.jobs, len(todo)))
    counts = {"built": 0, "cached": len(wanted) - len(todo), "failed": 0}
    target = f"{len(wanted)} kernels for sm_{cc[0]}{cc[1]} in {cache_dir}"
    if not todo:
        print(f"{target}: all compiled already", flush=True)
        return 0
    print(f"{target}: {counts['cached']} there already, {len(todo)} to compile in {jobs} processes "
          f"({_estimate(todo, jobs)})", flush=True)
    start, errors = time.time(), set()
    bar = tqdm(total=len(wanted), initial=counts["cached"], unit="kernel", dynamic_ncols=True)
    bar.set_postfix(counts)
    pool = None
    try:
        with _without_simulator():
            # Spawned, the workers start clear of this process's CUDA state and of the simulator.
            pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
            futures = {pool.submit(build_one, config, cc, cache_dir): config for config in todo}
            for future in as_completed(futures):
                try:
                    status = future.result()[1]
                except Exception as error:
                    status = "failed"
                    message = (str(error).strip().splitlines() or [type(error).__name__])[0]
                    if message not in errors:  # each distinct error once, not once per kernel
                        errors.add(message)
                        bar.write(f"failed: {launch.describe(futures[future])}: {message}")
                counts[status] += 1
                bar.set_postfix(counts, refresh=False)
                bar.update()
        pool.shutdown()
    except KeyboardInterrupt:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
        print(f"interrupted: {counts['built']} kernels built so far (kept in {cache_dir})", file=sys.stderr)
        return 130
    bar.close()
    print(f"{counts['built']} built, {counts['cached']} already cached, {counts['failed']} failed "
          f"in {time.time() - start:.0f} s", flush=True)
    return 1 if counts["failed"] else 0
