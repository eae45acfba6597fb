"""Launching: kernels compiled once per configuration, launched on CuPy's current stream.

Nothing here synchronizes with the host: outputs come from CuPy's memory pool and the kernel is
queued on the caller's current CuPy stream, so a call slots into a CuPy pipeline like any CuPy op.

On a GPU the launch bypasses Numba's dispatcher, which re-types every argument on every call (tens
of microseconds with CuPy arrays). Each configuration is compiled once for one fixed signature;
per call we write the arguments into a preallocated parameter buffer in the layout Numba's kernels
expect, and hand it to the driver's ``cuLaunchKernel``. A Numba array argument is flattened into
``meminfo, parent, nitems, itemsize, data, shape[ndim], strides[ndim]`` (8 bytes each; strides in
bytes), a float32 scalar into 4 bytes. Under the simulator, kernels launch through Numba as usual.
"""

import ctypes
import struct
from functools import lru_cache

import numpy as np
from . import runtime
from .dtypes import BFLOAT16, KERNEL_DTYPE
from .kernels.forward_mma import MmaForwardConfig, build_forward_mma
from .kernels.forward_portable import PortableForwardConfig, build_forward_portable

BUILDERS = {PortableForwardConfig: build_forward_portable, MmaForwardConfig: build_forward_mma}

# Shared memory a block may use without opting in to more.
DEFAULT_SHARED_LIMIT = 48 * 1024

# Driver API constants (cuda.h).
CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def empty(shape, dtype):
    """An uninitialized output array on the backend."""
    if runtime.SIMULATOR:
        return np.empty(shape, dtype)
    return runtime.cupy().empty(shape, dtype)


# ---------------------------------------------------------------------------------------------------
# The driver, through ctypes
# ---------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _driver():
    """libcuda, loaded so that calls keep the GIL: a launch reads its parameter buffer while no other
    Python thread can rewrite it."""
    lib = ctypes.PyDLL("libcuda.so.1")
    lib.cuLaunchKernel.restype = ctypes.c_int
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [
        ctypes.c_uint,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    return lib


def _check(status, what):
    if status != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else status}")


def _function_handle(kernel):
    """The CUfunction of a bound Numba kernel (Numba holds a CUkernel, from the library loader)."""
    handle = int(kernel._codelibrary.get_cufunc().handle)
    function = ctypes.c_void_p()
    if _driver().cuKernelGetFunction(ctypes.byref(function), ctypes.c_void_p(handle)) != 0:
        function = ctypes.c_void_p(handle)  # already a CUfunction
    return function


def _function_attribute(function, attribute):
    value = ctypes.c_int()
    _check(_driver().cuFuncGetAttribute(ctypes.byref(value), attribute, function), "cuFuncGetAttribute")
    return value.value


# ---------------------------------------------------------------------------------------------------
# Compiled kernels
# ---------------------------------------------------------------------------------------------------

# The one signature each forward kernel is compiled for: q, k, v with any strides, fresh contiguous
# out and lse, and the float32 scale.
FORWARD_SIGNATURE = "void({t}[:,:,:,:], {t}[:,:,:,:], {t}[:,:,:,:], {t}[:,:,:,::1], float32[:,:,::1], float32)"


def _array_fields(ndim):
    return 5 + 2 * ndim


class CompiledKernel:
    """One configuration's kernel, compiled and loaded, with its launch parameter buffer."""

    def __init__(self, config, array_ndims):
        self.config = config
        self.kernel = BUILDERS[type(config)](config)
        # The portable kernel's tiles are static; the tensor-core kernel's are all dynamic.
        self.dynamic_shared = getattr(config, "dynamic_shared_bytes", None)
        if self.dynamic_shared is None:
            self.dynamic_shared = config.shared_bytes
        self.registers = self.static_shared = self.local_bytes = None  # known once compiled
        if runtime.SIMULATOR:
            return
        signature = FORWARD_SIGNATURE.format(t=KERNEL_DTYPE[config.dtype].name)
        overload = self.kernel.compile(signature)
        overload.bind()
        self.function = _function_handle(overload)
        if self.dynamic_shared > DEFAULT_SHARED_LIMIT:
            _check(
                _driver().cuFuncSetAttribute(
                    self.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.dynamic_shared
                ),
                "raising the kernel's dynamic shared-memory limit",
            )
        self.registers = _function_attribute(self.function, CU_FUNC_ATTRIBUTE_NUM_REGS)
        self.static_shared = _function_attribute(self.function, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
        self.local_bytes = _function_attribute(self.function, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)

        # Parameter buffer: every array field is 8 bytes; the trailing float32 scalar takes 4.
        n_words = sum(_array_fields(n) for n in array_ndims)
        packer = struct.Struct(f"<{n_words}qf")
        self._pack = packer.pack_into
        self._buffer = ctypes.create_string_buffer(packer.size)
        self._launch = _driver().cuLaunchKernel
        self._current_stream = runtime.cupy().cuda.get_current_stream
        base = ctypes.addressof(self._buffer)
        self._params = (ctypes.c_void_p * (n_words + 1))(*(base + 8 * i for i in range(n_words + 1)))

    def launch(self, grid, arrays, scale):
        """Queue the kernel on CuPy's current stream. ``arrays`` are backend arrays."""
        if runtime.SIMULATOR:
            launch_config = self.kernel[grid, self.config.threads, 0, self.dynamic_shared]
            launch_config(*(_simulator_array(a) for a in arrays), scale)
            return
        fields = []
        for a in arrays:
            fields += (0, 0, a.size, a.itemsize, a.data.ptr, *a.shape, *a.strides)
        self._pack(self._buffer, 0, *fields, scale)
        status = self._launch(
            self.function,
            *grid,
            self.config.threads,
            1,
            1,
            self.dynamic_shared,
            self._current_stream().ptr,
            self._params,
            None,
        )
        if status:
            _check(status, "cuLaunchKernel")


def _simulator_array(x):
    """A NumPy array as the simulator's device array, without a copy (bfloat16 as its uint16 bits).
    The simulator would copy, and refuse, a strided view; wrapped, the kernel works in place."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(x.view(np.uint16) if x.dtype == BFLOAT16 else x)


@lru_cache(maxsize=None)
def compiled(config, device=0):
    """The compiled kernel for ``config`` on ``device`` (compiled on first use, then cached)."""
    return CompiledKernel(config, array_ndims=(4, 4, 4, 4, 3))

