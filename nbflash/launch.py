"""Launching: kernels compiled once per configuration, launched on CuPy's current stream.

Nothing here synchronizes with the host: outputs come from CuPy's memory pool and the kernel is
queued on the caller's current CuPy stream, so a call slots into a CuPy pipeline like any CuPy op.

On a GPU the launch bypasses Numba's dispatcher, which re-types every argument on every call (tens
of microseconds with CuPy arrays). Each configuration is compiled once for one fixed signature;
per call we write the arguments into a preallocated parameter buffer in the layout Numba's kernels
expect, and hand it to the driver's ``cuLaunchKernelEx``. A Numba array argument is flattened into
``meminfo, parent, nitems, itemsize, data, shape[ndim], strides[ndim]`` (8 bytes each; strides in
bytes), a float32 or int32 scalar into 4 bytes, a tuple into its elements. Under the simulator,
kernels launch through Numba as usual. Which kernels there are, and their signatures, is
``nbflash.kernels.registry``'s business.
"""

import ctypes
import logging
import math
import os
import struct
import threading
import time
from functools import lru_cache

import numpy as np

from . import cubin_cache, runtime
from .dtypes import BFLOAT16
from .kernels import registry

# Shared memory a block may use without opting in to more.
DEFAULT_SHARED_LIMIT = 48 * 1024

# Driver API constants (cuda.h).
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def empty(shape, dtype):
    """An uninitialized output array on the backend."""
    if runtime.SIMULATOR:
        return np.empty(shape, dtype)
    return runtime.cupy().empty(shape, dtype)


def zeros(shape, dtype):
    """A zeroed output array on the backend."""
    if runtime.SIMULATOR:
        return np.zeros(shape, dtype)
    return runtime.cupy().zeros(shape, dtype)


def empty_pair(shape_a, dtype_a, shape_b, dtype_b):
    """Two uninitialized C-contiguous arrays of NumPy dtypes ``dtype_a``, ``dtype_b``. On a GPU they
    are carved from one allocation: one call into CuPy's memory pool instead of two (two allocations
    took 4.4 of a small call's 20.5 us, docs/benchmarks.md)."""
    if runtime.SIMULATOR:
        return empty(shape_a, dtype_a), empty(shape_b, dtype_b)
    cupy = runtime.cupy()
    bytes_a = math.prod(shape_a) * dtype_a.itemsize
    offset_b = -(-bytes_a // 256) * 256  # the second array starts on a 256-byte boundary
    memory = cupy.cuda.alloc(offset_b + math.prod(shape_b) * dtype_b.itemsize)
    return cupy.ndarray(shape_a, dtype_a, memory), cupy.ndarray(shape_b, dtype_b, memory + offset_b)


# ---------------------------------------------------------------------------------------------------
# The driver, through ctypes
# ---------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _driver():
    """libcuda, loaded so that calls keep the GIL: a launch reads its parameter buffer while no other
    Python thread can rewrite it."""
    lib = ctypes.PyDLL("libcuda.so.1")
    # cuLaunchKernelEx: CUDA 12.0 and newer, which every supported CuPy (cuda12x, cuda13x) requires.
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p] * 4
    return lib


class LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig: what ``cuLaunchKernelEx`` takes in one struct. A kernel keeps one
    and rewrites only what changed since its last launch, so a launch passes four pointers to the
    driver instead of converting eleven arguments."""

    _fields_ = [
        ("grid_x", ctypes.c_uint),
        ("grid_y", ctypes.c_uint),
        ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint),
        ("block_y", ctypes.c_uint),
        ("block_z", ctypes.c_uint),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attributes", ctypes.c_void_p),
        ("attribute_count", ctypes.c_uint),
    ]


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


def _load_or_compile(config, signature):
    """The kernel's CUfunction: from the on-disk cubin cache, else built and compiled by Numba (and
    then cached), saying so on the "nbflash" logger: a first call that compiles for half a minute
    should not look like a hang."""
    from numba import cuda

    context = cuda.current_context()  # makes the device's primary context current for the driver
    capability = tuple(context.device.compute_capability)
    key = cubin_cache.cache_key(config, signature, capability)
    function = cubin_cache.load(_driver(), key)
    if function is not None:
        return function
    first = config not in _announced
    if first:
        _announced.add(config)
        _compile_log().info(_compiling_message(config, capability))
    start = time.perf_counter()
    overload = registry.build(config).compile(signature)
    overload.bind()
    library = overload._codelibrary
    if not library._setup_functions:  # nothing to run at module load: the cubin alone is the kernel
        try:
            cubin_cache.store(key, library._entry_name, library.get_cubin())
        except Exception:  # a Numba whose internals differ: run without the cache, never fail
            pass
    if first:
        folder = cubin_cache.cache_dir()
        if (folder / f"{key}.cubin").exists():
            where = f"cached in {folder}"
        elif library._setup_functions:
            where = "not cached (a kernel with module setup code: it compiles in every process)"
        else:
            where = f"not cached ({folder} cannot be written)"
        seconds = time.perf_counter() - start
        _compile_log().info(f"compiled {describe(config)} in {seconds:.1f} s; {where}")
    return _function_handle(overload)


# ---------------------------------------------------------------------------------------------------
# Saying what compiles
# ---------------------------------------------------------------------------------------------------

LOG = logging.getLogger("nbflash")
_announced = set()  # configs whose compiling was announced in this process
_log_ready = False  # _compile_log has decided whether to give LOG a handler

# What each config type compiles to, and how many seconds that typically takes (Numba 0.68 on the
# H200 machine's host: 16.6-22.7 s for a float16 forward, 2.1-2.2 s for a float32 one; the decode and
# KV-cache kernels are not measured, taken as their families').
KINDS = {
    "MmaForwardConfig": ("tensor-core forward", 10, 40),
    "Sm90ForwardConfig": ("Hopper forward", 5, 20),  # 6-7 s measured on the H200's host
    "MmaBackwardConfig": ("tensor-core backward", 10, 40),
    "Sm90BackwardConfig": ("Hopper backward", 5, 20),  # 6.6-11.2 s on the H200's host, under load
    "Sm90RowsBackwardConfig": ("Hopper rows-split backward", 5, 20),  # 13.4-17.4 s on the H200's host, 4 at once
    "Sm90DqConfig": ("Hopper backward", 5, 20),  # as the dK/dV kernel (not yet timed)
    "Sm90ConvertDqConfig": ("Hopper backward", 1, 5),  # a row-wise kernel's size (not yet timed)
    "Sm90WideBackwardConfig": ("Hopper wide backward", 5, 30),  # not yet timed
    "MmaDecodeConfig": ("tensor-core decode", 10, 40),
    "PortableForwardConfig": ("portable forward", 1, 5),
    "PortableBackwardConfig": ("portable backward", 1, 5),
    "AppendConfig": ("KV-cache append", 1, 5),
    "CombineConfig": ("split-KV", 1, 5),
    "Fp8TransposeConfig": ("fp8 forward's V^T", 1, 5),
}
BACKWARD_PARTS = {"preprocess": "preprocess", "dkdv": "dK/dV", "dq": "dQ", "convert_dq": "dQ conversion"}
FEATURES = (("window", "causal/window"), ("softcap", "softcap"), ("alibi", "ALiBi"), ("mask", "bool mask"),
            ("score_mod", "score_mod"), ("score_mod_grad", "score_mod_grad"), ("mask_mod", "mask_mod"),
            ("dropout", "dropout"), ("block_mask", "block mask"), ("varlen", "varlen"))


def describe(config):
    """A kernel config in a few words: "tensor-core forward (float16, headdim 128, causal/window)"."""
    kind = KINDS.get(type(config).__name__, (type(config).__name__,))[0]
    part = getattr(config, "kernel", None)
    if part in BACKWARD_PARTS:
        kind += " " + BACKWARD_PARTS[part]
    elif part:  # the split-KV combine, or the two-state merge
        kind += " " + part
    details = [config.dtype]
    if hasattr(config, "headdim"):
        details.append(f"headdim {config.headdim}")
    variant = getattr(config, "variant", None)
    if variant is not None:
        details += [name for feature, name in FEATURES if getattr(variant, feature)]
        if variant.bias:
            details.append(f"{variant.bias} bias")
    if part in BACKWARD_PARTS and not getattr(config, "atomic_dq", True):
        details.append("deterministic")
    details += getattr(config, "form_details", ())  # a config's own words for a form of its kernel
    if getattr(config, "aligned", True) is False and kind.startswith("tensor-core forward"):
        details.append("unaligned rows")
    details += [name for name in ("paged", "rotary") if getattr(config, name, False)]
    return f"{kind} ({', '.join(details)})"


def compile_seconds(config):
    """(low, high): the seconds compiling ``config`` typically takes."""
    return KINDS.get(type(config).__name__, ("", 1, 40))[1:]


def _compiling_message(config, capability):
    """What compiles, why, about how long, and where it goes; the first message of a process also
    says how to compile everything ahead of time."""
    from importlib.metadata import version

    folder = cubin_cache.cache_dir()
    try:
        numba_cuda = f"numba-cuda {version('numba-cuda')}"
    except Exception:
        numba_cuda = "this Numba"
    try:
        empty = not any(folder.glob("*.cubin"))
    except OSError:
        empty = True
    if empty:
        why = f"the on-disk cache at {folder} is empty (a first run, or a new NBFLASH_CACHE_DIR)"
    else:
        why = f"not in the on-disk cache at {folder} (its first use with this nbflash, {numba_cuda} and GPU)"
    low, high = compile_seconds(config)
    message = (f"compiling {describe(config)} for sm_{capability[0]}{capability[1]}, typically {low}-{high} s: "
               f"{why}; the kernel will be kept there for later processes")
    if len(_announced) == 1:
        message += ". To compile all configurations ahead: python -m nbflash prebuild"
    return message


def _compile_log():
    """The "nbflash" logger. When logging is not configured (no handler on it or on the root logger)
    it gets, on first use, a handler printing to stderr, and level INFO unless one was set on it;
    NBFLASH_QUIET (set to anything but 0), or ``logging.getLogger("nbflash").setLevel(logging.WARNING)``,
    silences it."""
    global _log_ready
    if not _log_ready:
        _log_ready = True
        quiet = os.environ.get("NBFLASH_QUIET", "0") not in ("", "0")
        if quiet and not LOG.level:
            LOG.setLevel(logging.WARNING)
        elif not (LOG.handlers or logging.getLogger().handlers):
            handler = logging.StreamHandler()  # sys.stderr
            handler.setFormatter(logging.Formatter("nbflash: %(message)s"))
            LOG.addHandler(handler)
            LOG.propagate = False  # root logging configured later would print it twice
            if not LOG.level:
                LOG.setLevel(logging.INFO)
    return LOG


def _function_attribute(function, attribute):
    value = ctypes.c_int()
    _check(_driver().cuFuncGetAttribute(ctypes.byref(value), attribute, function), "cuFuncGetAttribute")
    return value.value


# ---------------------------------------------------------------------------------------------------
# Compiled kernels
# ---------------------------------------------------------------------------------------------------


# struct codes of the scalar kernel parameters, each kept in an 8-byte slot.
SCALAR_FIELDS = {"float32": "f4x", "int32": "i4x", "uint32": "I4x"}


def _flat_arguments(signature):
    """A signature's kernel parameters as Numba flattens them: an array as its dimension count,
    a scalar as its type name; a tuple gives its elements in order."""

    def flat(args):
        for arg in args:
            if arg.startswith("Tuple(("):
                yield from flat(name for name in _split_arguments(arg[len("Tuple((") : -2]) if name)
            elif "[" in arg:
                yield arg.count(",") + 1
            else:
                yield arg

    return list(flat(_split_arguments(signature[signature.index("(") + 1 : -1])))


def _parameter_layout(signature):
    """struct format of the kernel parameters for a signature like "void(float16[:,:,::1], float32)".

    Numba flattens an n-dim array into 5 + 2n parameters of 8 bytes; a float32 or int32 scalar
    takes 4 bytes (padded to 8 when more parameters follow). Returns (format, offsets of each
    parameter).
    """
    fields, offsets, offset = "<", [], 0
    for arg in _flat_arguments(signature):
        if isinstance(arg, int):
            for _ in range(5 + 2 * arg):
                fields += "q"
                offsets.append(offset)
                offset += 8
        else:
            fields += SCALAR_FIELDS[arg]
            offsets.append(offset)
            offset += 8
    return fields, offsets


def _pointer_words(signature):
    """Index (in 8-byte words) of each array's data pointer in the parameter buffer."""
    words, word = [], 0
    for arg in _flat_arguments(signature):
        if isinstance(arg, int):
            words.append(word + 4)  # after meminfo, parent, nitems, itemsize
            word += 5 + 2 * arg
        else:
            word += 1
    return words


def _split_arguments(arguments):
    """"float16[:,:], Tuple((int32, int32))" -> ["float16[:,:]", "Tuple((int32, int32))"]: commas
    outside brackets and parentheses split."""
    parts, depth, current = [], 0, ""
    for ch in arguments:
        depth += ch in "[("
        depth -= ch in "])"
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return parts + [current.strip()]


class ParameterBuffer:
    """A kernel's parameters, packed in the layout Numba's kernels expect, and the array of pointers
    to each parameter that ``cuLaunchKernelEx`` takes.

    ``write(arrays, scalars)`` packs a call's arguments: the arrays in signature order, and the
    scalars in signature order (a tuple's arrays and scalars, such as a variant's ``params``, go
    into these two lists where they fall). When the arrays have the shapes and strides of the
    previous call (the common case: a model calls attention with the same shapes again and again),
    only the data pointers and the scalars are rewritten.
    """

    def __init__(self, signature):
        fields, offsets = _parameter_layout(signature)
        packer = struct.Struct(fields)
        self._pack = packer.pack_into
        self.buffer = ctypes.create_string_buffer(packer.size)
        base = ctypes.addressof(self.buffer)
        self.pointers = (ctypes.c_void_p * len(offsets))(*(base + o for o in offsets))
        self._words = (ctypes.c_int64 * (packer.size // 8)).from_buffer(self.buffer)
        self._pointer_words = _pointer_words(signature)
        self._kinds = _flat_arguments(signature)  # per parameter: an array's ndim or a scalar type
        self._scalar_packers, word = [], 0  # (byte offset, pack_into) of each scalar, in order
        for kind in self._kinds:
            if isinstance(kind, int):
                word += 5 + 2 * kind
            else:
                self._scalar_packers.append((8 * word, struct.Struct("<" + SCALAR_FIELDS[kind]).pack_into))
                word += 1
        self._layout = self._layout_key = None

    def write(self, arrays, scalars, layout_key=None, varying=None):
        """``layout_key``: optional; an object that stands for the arrays' shapes and strides (the
        same object only ever for the same layouts, as the forward's checked Problem does). When it
        is the previous call's, the shapes and strides are not even read. ``varying``: optional,
        with a ``layout_key``; the indices of the arrays that may differ from those of the last
        call with that key: the caller passes the very same objects at every other index with it
        (a decode plan's stand-ins and workspace views), whose pointers are then not rewritten."""
        if varying is not None and layout_key is not None and layout_key is self._layout_key:
            words, pointer_words = self._words, self._pointer_words
            for i in varying:
                words[pointer_words[i]] = arrays[i].data.ptr
            buffer = self.buffer
            for (offset, pack), value in zip(self._scalar_packers, scalars):
                pack(buffer, offset, value)
            return
        if layout_key is None or layout_key is not self._layout_key:
            layout = [(a.shape, a.strides) for a in arrays]
            self._layout_key = layout_key  # held, so that its identity is never reused
            if layout != self._layout:
                fields, next_array, next_scalar = [], iter(arrays), iter(scalars)
                for kind in self._kinds:
                    if isinstance(kind, int):
                        a = next(next_array)
                        fields += (0, 0, a.size, a.itemsize, a.data.ptr, *a.shape, *a.strides)
                    else:
                        fields.append(next(next_scalar))
                self._pack(self.buffer, 0, *fields)
                self._layout = layout
                return
        words = self._words
        for word, a in zip(self._pointer_words, arrays):
            words[word] = a.data.ptr
        buffer = self.buffer
        for (offset, pack), value in zip(self._scalar_packers, scalars):
            pack(buffer, offset, value)


class CompiledKernel:
    """One configuration's kernel, compiled for its signature (``registry.signature``) and loaded,
    with its launch parameter buffer. ``launch(grid, arrays, scalars)`` queues it on CuPy's current
    stream."""

    def __init__(self, config):
        self.config = config
        signature = registry.signature(config)
        self.dynamic_shared = config.dynamic_shared_bytes  # 0 for the portable kernels
        self.registers = self.static_shared = self.local_bytes = None  # known once compiled
        self._takes_params = "Tuple((" in signature  # the variant's runtime values, last
        self._host_arguments = registry.HOST_ARGUMENTS.get(type(config))  # tensor maps, for the sm90 forward
        if runtime.SIMULATOR:
            self.kernel = registry.build(config)
            return
        self.function = _load_or_compile(config, signature)
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

        self._parameters = ParameterBuffer(signature)
        self._lock = threading.Lock()  # one launch at a time writes the shared parameter buffer
        self._current_stream = runtime.cupy().cuda.get_current_stream
        self._launch_config = LaunchConfig(block_x=config.threads, block_y=1, block_z=1,
                                           shared_bytes=self.dynamic_shared)
        self._launch_config_pointer = ctypes.c_void_p(ctypes.addressof(self._launch_config))
        self._grid = self._stream = None  # what the launch config holds now
        self._launch_ex = _driver().cuLaunchKernelEx

    def launch(self, grid, arrays, scalars, params=(), layout_key=None, stream=None, varying=None):
        """Queue the kernel on CuPy's current stream. ``arrays`` are backend arrays, in the order
        of the signature, followed by the float32 ``scalars`` and, for a kernel that takes them,
        the variant's ``params`` (``Problem.params``); ``layout_key`` as in
        ``ParameterBuffer.write`` (``varying`` too: indices into ``arrays`` followed by the
        params' arrays); ``stream``: the current stream's pointer, where the caller has asked CuPy
        for it already (a call of several launches asks once)."""
        if self._host_arguments is not None:
            arrays = self._host_arguments(self.config, arrays)
        if runtime.SIMULATOR:
            launch_config = self.kernel[grid, self.config.threads, 0, self.dynamic_shared]
            arrays = [_simulator_array(a) for a in arrays]
            params = tuple(_simulator_array(p) if getattr(p, "ndim", 0) else p for p in params)
            launch_config(*arrays, *scalars, *((params,) if self._takes_params else ()))
            return
        if params:  # a variant's arrays (ALiBi slopes, ...) and scalars, where the signature has them
            arrays = (*arrays, *(p for p in params if getattr(p, "ndim", 0)))
            scalars = (*scalars, *(p for p in params if not getattr(p, "ndim", 0)))
        with self._lock:
            self._parameters.write(arrays, scalars, layout_key, varying)
            if stream is None:
                stream = self._current_stream().ptr
            if grid != self._grid or stream != self._stream:
                c = self._launch_config
                c.grid_x, c.grid_y, c.grid_z = grid
                c.stream = stream
                self._grid, self._stream = grid, stream
            status = self._launch_ex(self._launch_config_pointer, self.function, self._parameters.pointers,
                                     None)
        if status:
            _check(status, "cuLaunchKernelEx")


def _simulator_array(x):
    """A NumPy array as the simulator's device array, without a copy (bfloat16 as its uint16 bits).
    The simulator would copy, and refuse, a strided view; wrapped, the kernel works in place."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(x.view(np.uint16) if x.dtype == BFLOAT16 else x)


@lru_cache(maxsize=None)
def compiled(config, device=0):
    """The compiled kernel for ``config`` on ``device`` (compiled on first use, then cached)."""
    return CompiledKernel(config)

