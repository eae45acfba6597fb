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


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped in the simulator)")


def pytest_collection_modifyitems(config, items):
    if SIMULATOR:
        skip = pytest.mark.skip(reason="needs a CUDA GPU; running in Numba's CUDA simulator")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


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
