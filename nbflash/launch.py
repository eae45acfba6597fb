"""Launching: compiled kernels cached per configuration, launched on CuPy's current stream.

Nothing here synchronizes with the host: outputs come from CuPy's memory pool and the kernel is
queued on the caller's current CuPy stream, so a call slots into a CuPy pipeline like any CuPy op.
"""

import numpy as np
from numba import cuda

from . import runtime
from .dtypes import KERNEL_DTYPE
from .kernels.forward_portable import PortableForwardConfig, build_forward_portable

BUILDERS = {PortableForwardConfig: build_forward_portable}

_streams = {}


def _numba_stream():
    """Numba's handle on CuPy's current stream (created once per stream)."""
    cupy_stream = runtime.cupy().cuda.get_current_stream()
    stream = _streams.get(cupy_stream.ptr)
    if stream is None:
        stream = _streams[cupy_stream.ptr] = cuda.external_stream(cupy_stream.ptr)
    return stream


def kernel_array(x, dtype_name):
    """``x`` as the array a kernel takes: bfloat16 as raw uint16 bits; on a GPU, a Numba view.

    The view shares ``x``'s memory (no copy, no synchronization).
    """
    dtype = KERNEL_DTYPE[dtype_name]
    if runtime.SIMULATOR:
        # Wrap the NumPy array as the simulator's device array: the kernel then reads and writes it
        # in place, whatever its strides (the simulator would copy, and refuse, a strided view).
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(x.view(dtype) if x.dtype != dtype else x)
    interface = {
        "shape": x.shape,
        "strides": x.strides,
        "typestr": dtype.str,
        "data": (x.data.ptr, False),
        "version": 3,
    }
    return cuda.from_cuda_array_interface(interface, owner=x, sync=False)


def empty(shape, dtype):
    """An uninitialized output array on the backend."""
    if runtime.SIMULATOR:
        return np.empty(shape, dtype)
    return runtime.cupy().empty(shape, dtype)


def launch(config, grid, args):
    """Run the kernel for ``config`` over ``grid`` with ``args`` (already kernel arrays)."""
    kernel = BUILDERS[type(config)](config)
    if runtime.SIMULATOR:
        kernel[grid, config.num_threads](*args)
    else:
        kernel[grid, config.num_threads, _numba_stream(), 0](*args)
