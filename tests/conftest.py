"""Test setup: with no GPU, run everything in Numba's CUDA simulator.

The switch must happen before Numba is first imported, which is why it sits at the top of the
conftest and checks for a GPU through CuPy alone.
"""

import os
import zlib


def _gpu_present():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


if not _gpu_present():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def _one_shared_array_per_line():
    """Make the simulator's ``cuda.shared.array`` safe for a block's threads.

    The simulator gives a block one array per source line: the first thread there makes it
    (``np.empty``) and stores it under (file, line). It does not lock between finding nothing and
    storing, so two threads arriving together (a thread switch in between) both make one, and the
    second store replaces the first: the threads that took the first array work on one nobody else
    writes, reading the rest of the tile as uninitialized memory. A rare wrong answer, only in the
    first block of a launch, never on a GPU. Here the array is made under a lock. Dynamic shared
    memory (shape 0) is left as it is.
    """
    import sys
    import threading

    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    simulated = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return simulated(self, shape, dtype, alignment)
        caller = sys._getframe(1)
        line = (caller.f_code.co_filename, caller.f_lineno)  # the simulator's key
        with lock:
            if line not in self._allocations:
                if isinstance(dtype, types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                self._allocations[line] = np.empty(shape, dtype)
            return self._allocations[line]

    kernelapi.FakeCUDAShared.array = array


if SIMULATOR:
    _one_shared_array_per_line()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped in the simulator)")


def pytest_collection_modifyitems(config, items):
    if SIMULATOR:
        skip = pytest.mark.skip(reason="needs a CUDA GPU; running in Numba's CUDA simulator")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
        return
    # On a GPU, compiling the kernels takes most of a test run's time (a tensor-core configuration
    # takes 10-40 s). With pytest-xdist's `--dist loadgroup`, tests that compile the same kernels
    # (same dtype, head dim and causal flag) go to the same worker, so each compiles once.
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if {"dtype", "headdim", "causal"} <= params.keys():
            group = f"{params['dtype']}-{params['headdim']}-{params['causal']}"
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name so failures reproduce."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def xp():
    """The array module of the backend: CuPy on a GPU, NumPy in the simulator."""
    if SIMULATOR:
        return np
    import cupy

    return cupy
