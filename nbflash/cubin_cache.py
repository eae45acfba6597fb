"""An on-disk cache of compiled kernels, so that a new process skips Numba's compiler.

Numba's own disk cache (``cache=True``) does not fit the tensor-core kernels: their tile loops are
unrolled by rewriting the function's source (``primitives.unroll``), and Numba keys its cache on the
function's bytecode and closure, which no longer tell one configuration from another. Since nbflash
launches its kernels through the driver anyway (``launch.CompiledKernel``), it can cache what the
driver loads: the cubin Numba linked, and the name of the kernel in it.

One file per kernel: the entry name, a newline, then the cubin. The file name is a hash of
everything the machine code depends on: the kernel's module and the files all kernels share, the
compiler's versions (numba, numba-cuda, llvmlite), the configuration, the signature and the GPU's
compute capability. A file that cannot be read or loaded is treated as a miss, and a cache
directory that cannot be written just means no caching.

The directory is ``$NBFLASH_CACHE_DIR``, else ``$XDG_CACHE_HOME/nbflash``, else ``~/.cache/nbflash``.
"""

import ctypes
import hashlib
import os
import pathlib
import sys
import tempfile
from functools import lru_cache


def cache_dir():
    """Where cubins are kept (read from the environment on every call, so tests can redirect it)."""
    if os.environ.get("NBFLASH_CACHE_DIR"):
        return pathlib.Path(os.environ["NBFLASH_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "nbflash"


# Besides its own module, every kernel is built from these: the tile primitives, the dtypes, the
# order of a variant's runtime values (problem.py), and the device code the kernels share (tiles,
# geometry, variants). The other host-side modules do not reach the compiled code.
SHARED_KERNEL_SOURCES = (
    "primitives.py", "dtypes.py", "problem.py", "kernels/tiles.py", "kernels/geometry.py", "kernels/variants.py",
    "kernels/philox.py",
)


@lru_cache(maxsize=None)
def _source_hash(module_name):
    """A hash of the source the kernels of ``module_name`` are built from: an edit to that module or
    to a shared file is a miss; an edit to another kernel's module is not."""
    digest = hashlib.sha256()
    package = pathlib.Path(__file__).parent
    module_file = pathlib.Path(sys.modules[module_name].__file__)
    for path in [package / name for name in SHARED_KERNEL_SOURCES] + [module_file]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@lru_cache(maxsize=None)
def _compiler_versions():
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("numba", "numba-cuda", "llvmlite"):
        try:
            found.append(f"{name}={version(name)}")
        except PackageNotFoundError:
            found.append(f"{name}=?")
    return " ".join(found)


def cache_key(config, signature, compute_capability):
    source = _source_hash(type(config).__module__)
    parts = (source, _compiler_versions(), repr(config), signature, repr(tuple(compute_capability)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def load(driver, key):
    """The CUfunction cached under ``key``, loaded into the current context, or None."""
    path = cache_dir() / f"{key}.cubin"
    try:
        data = path.read_bytes()
    except OSError:
        return None
    entry, _, cubin = data.partition(b"\n")
    if not entry or not cubin:
        return None
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    if driver.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(cubin)) != 0:
        return None
    if driver.cuModuleGetFunction(ctypes.byref(function), module, ctypes.c_char_p(entry)) != 0:
        driver.cuModuleUnload(module)
        return None
    return function


def store(key, entry_name, cubin):
    """Write the cubin under ``key``: to a temporary file first, so readers never see half a file.

    ``cubin`` is bytes, or what Numba's linker returns (a cuda.core ``ObjectCode``, whose ``code`` is
    the bytes). Anything else is not cached: caching must never make a call fail.
    """
    cubin = getattr(cubin, "code", cubin)
    if not isinstance(cubin, (bytes, bytearray, memoryview)):
        return
    cubin = bytes(cubin)
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as f:
            f.write(entry_name.encode() + b"\n" + cubin)
        os.replace(f.name, folder / f"{key}.cubin")
    except OSError:
        pass  # a read-only or full disk: run without the cache
