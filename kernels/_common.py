"""Plumbing shared by the lessons: GPU or simulator, inputs, the float64 check, timing, the report.

Every lesson imports this module first (``import _common`` works because Python puts the folder of
the script it runs, kernels/, on ``sys.path``). It has to run before Numba is imported: Numba reads
``NUMBA_ENABLE_CUDASIM`` once, at import time. With no GPU we switch Numba to its simulator, which
runs each CUDA thread as a Python thread on the CPU: slow, so the lessons then pick small sizes.

Nothing here is part of a lesson; read the lessons, not this file.
"""

import ctypes
import importlib.util
import math
import os
import sys
import time


def _gpu_present():
    """True when the CUDA driver loads and reports at least one device (asked through ctypes, so
    that neither Numba nor CuPy is imported before the simulator switch below)."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        return (
            driver.cuInit(0) == 0
            and driver.cuDeviceGetCount(ctypes.byref(count)) == 0
            and count.value > 0
        )
    return False


# An explicit NUMBA_ENABLE_CUDASIM (0 or 1) wins; so does a Numba that is already imported.
if "numba" not in sys.modules and "NUMBA_ENABLE_CUDASIM" not in os.environ and not _gpu_present():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
from numba import config, cuda  # noqa: E402

SIMULATOR = bool(config.ENABLE_CUDASIM)
if SIMULATOR:
    # The simulator's scheduler busy-waits for a block's threads to reach each barrier, holding the
    # GIL for Python's whole switch interval (5 ms) at a time; a short interval makes every
    # cuda.syncthreads() several times cheaper.
    sys.setswitchinterval(2e-4)
KERNELS_DIR = os.path.dirname(os.path.abspath(__file__))

# The lessons check against nbflash's float64 reference, and lesson 06 reads nbflash's kernels: this
# checkout's nbflash, even where another copy is installed, so that an edit to nbflash/ shows in the
# lessons as it does in the tests; an installed nbflash only when the lessons were copied elsewhere.
_CHECKOUT = os.path.dirname(KERNELS_DIR)
if os.path.isdir(os.path.join(_CHECKOUT, "nbflash")):
    sys.path.insert(0, _CHECKOUT)
elif importlib.util.find_spec("nbflash") is None:
    sys.exit("the lessons need nbflash: run them from a checkout of nbflash, or pip install it")

from nbflash.reference import attention_naive, attention_reference  # noqa: E402

try:
    import cupy
except ImportError:  # Numba's own device arrays serve as well
    cupy = None
USE_CUPY = cupy is not None and not SIMULATOR

# Sizes when the command line gives none: a real problem on a GPU, a toy one in the simulator.
DEFAULT_SEQLEN = 64 if SIMULATOR else 2048
DEFAULT_HEADDIM = 16 if SIMULATOR else 64


# ---------------------------------------------------------------------------------------------------
# Device arrays: CuPy on a GPU when it is installed, else Numba's (the simulator's are NumPy inside).
# ---------------------------------------------------------------------------------------------------


def to_device(x):
    return cupy.asarray(x) if USE_CUPY else cuda.to_device(x)


def to_host(x):
    return cupy.asnumpy(x) if USE_CUPY else x.copy_to_host()


def device_full(shape, value):
    """A float32 device array filled with ``value`` (NaN for outputs, so unwritten elements show)."""
    if USE_CUPY:
        return cupy.full(shape, value, dtype=np.float32)
    return cuda.to_device(np.full(shape, value, dtype=np.float32))


def lesson(name):
    """Load an earlier lesson as a module, by the start of its file name ("01" -> 01_naive.py).

    Lessons build on each other by importing the pieces they keep unchanged. (A file name that starts
    with a digit cannot be imported with ``import``.)
    """
    (filename,) = [f for f in os.listdir(KERNELS_DIR) if f.startswith(name) and f.endswith(".py")]
    spec = importlib.util.spec_from_file_location(filename[:-3], os.path.join(KERNELS_DIR, filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------
# A problem, its check and its report.
# ---------------------------------------------------------------------------------------------------


class Problem:
    """One attention problem: single head, q (seqlen_q, headdim), k and v (seqlen_k, headdim), fp32.

    Holds the inputs on the host (for the reference) and on the device (for the kernels), and the
    softmax scale 1/sqrt(headdim) as a float32, so that kernels compute in float32 throughout.
    """

    def __init__(self, seqlen_q=None, seqlen_k=None, headdim=None, causal=False, seed=0):
        self.seqlen_q = seqlen_q or DEFAULT_SEQLEN
        self.seqlen_k = seqlen_k or self.seqlen_q
        self.headdim = headdim or DEFAULT_HEADDIM
        self.causal = bool(causal)
        rng = np.random.default_rng(seed)
        self.q, self.k, self.v = (
            rng.standard_normal((n, self.headdim), dtype=np.float32)
            for n in (self.seqlen_q, self.seqlen_k, self.seqlen_k)
        )
        self.q_dev, self.k_dev, self.v_dev = (to_device(x) for x in (self.q, self.k, self.v))
        self.scale = np.float32(1.0 / math.sqrt(self.headdim))

    def new_output(self):
        """The output array, poisoned with NaN."""
        return device_full((self.seqlen_q, self.headdim), np.nan)

    def errors(self, out):
        """(max error of ``out``, max error of a naive fp32 computation), both against float64."""
        as_4d = [x[None, :, None, :] for x in (self.q, self.k, self.v)]
        exact = attention_reference(*as_4d, causal=self.causal)[0, :, 0, :]
        naive = attention_naive(*as_4d, causal=self.causal)[0, :, 0, :]
        out = to_host(out)
        return float(np.max(np.abs(out - exact))), float(np.max(np.abs(naive - exact)))


def measure(run, repeats=10):
    """Run ``run()`` once (this compiles the kernels), then time it: seconds per call.

    On a GPU: the median of ``repeats`` timed calls, each ended by a device synchronize. In the
    simulator the first call's wall time is all we take; it measures Python threads, not a GPU.
    """
    start = time.perf_counter()
    run()
    cuda.synchronize()
    if SIMULATOR:
        return time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        cuda.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def report(title, problem, out, seconds, scratch_bytes, next_lesson, notes=()):
    """Print what a lesson demonstrates; return the output's max error against float64."""
    p = problem
    error, naive_error = p.errors(out)
    n_by_n = p.seqlen_q * p.seqlen_k * 4
    where = "simulator (Python threads, time not a GPU's)" if SIMULATOR else "GPU"
    print(f"{title}")
    print(f"  seqlen_q={p.seqlen_q} seqlen_k={p.seqlen_k} headdim={p.headdim} causal={p.causal}, {where}")
    print(f"  max |out - float64|        {error:.2e}   (naive fp32 in NumPy: {naive_error:.2e})")
    print(
        f"  scratch in global memory   {_size(scratch_bytes)}"
        f" = {scratch_bytes / n_by_n:.3g} x the N x N float32 matrix ({_size(n_by_n)})"
    )
    print(f"  time per call              {seconds * 1e3:.3f} ms")
    for note in notes:
        print(f"  {note}")
    print(f"  next: {next_lesson}")
    return error


def _size(nbytes):
    for unit in ("bytes", "KiB", "MiB"):
        if nbytes < 1024 or unit == "MiB":
            return f"{nbytes:.4g} {unit}"
        nbytes /= 1024


def cli(description):
    """Parse the command line every lesson shares; returns keyword arguments for ``main``."""
    import argparse

    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=None, help=f"query length (default {DEFAULT_SEQLEN})")
    parser.add_argument("--seqlen-k", type=int, default=None, help="key length (default: --seqlen)")
    parser.add_argument("--headdim", type=int, default=None, help=f"head dim (default {DEFAULT_HEADDIM})")
    parser.add_argument("--causal", action="store_true", help="bottom-right aligned causal mask")
    args = parser.parse_args()
    return dict(seqlen_q=args.seqlen, seqlen_k=args.seqlen_k, headdim=args.headdim, causal=args.causal)
