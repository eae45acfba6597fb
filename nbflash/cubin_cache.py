"""An on-disk cache of compiled kernels, so that a new process skips Numba's compiler.

Numba's own disk cache (``cache=True``) does not fit the tensor-core kernels: their tile loops are
unrolled by rewriting the function's source (``primitives.unroll``), and Numba keys its cache on the
function's bytecode and closure, which no longer tell one configuration from another. Since nbflash
launches its kernels through the driver anyway (``launch.CompiledKernel``), it can cache what the
driver loads: the cubin Numba linked, and the name of the kernel in it.

One file per kernel: the entry name, a newline, the SHA-256 of the cubin in hex, a newline, then
the cubin. The file name is a hash of everything the machine code depends on: the file layout
(``FORMAT``), the kernel's module, the files all kernels share and the nbflash modules it imports,
the compiler's versions (numba, numba-cuda, llvmlite), the configuration, the signature and the
GPU's compute capability.

Faults: a file is written to a temporary name in the same folder and renamed over the old one, so
processes filling one cache at once never see half a file. A file that is there but cannot be read,
is truncated or corrupt (its checksum does not match) or that the driver refuses is a miss with a
RuntimeWarning saying so; the kernel is compiled again and the file replaced. A cache directory that
cannot be written (read-only, full, not a folder) just means no caching: files already there are
still loaded.

The directory is ``$NBFLASH_CACHE_DIR``, else ``$XDG_CACHE_HOME/nbflash``, else ``~/.cache/nbflash``.
"""

import ast
import ctypes
import hashlib
import os
import pathlib
import sys
import tempfile
import warnings
from functools import lru_cache

FORMAT = "2"  # the file layout above: part of every key, so a file of an older layout is never read


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


def kernel_sources(module_file):
    """The files a kernel module's compiled code can come from: the module, SHARED_KERNEL_SOURCES,
    and every nbflash module it imports, directly or through those (read from the ``import``
    statements): the Hopper primitives for the sm90 kernels, forward_sm90.py's tile constants for
    the sm90 backward, kernels/kvcache.py's append rows for the decode kernel."""
    package = pathlib.Path(__file__).parent
    found, todo = set(), [pathlib.Path(module_file)] + [package / name for name in SHARED_KERNEL_SOURCES]
    while todo:
        path = todo.pop()
        if path in found or not path.is_file():
            continue
        found.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:  # relative: from the importing file's folder, one up per extra dot
                base, parts = path.parents[node.level - 1], node.module.split(".") if node.module else []
            elif node.module == "nbflash" or (node.module or "").startswith("nbflash."):
                base, parts = package.parent, node.module.split(".")
            else:
                continue
            target = base.joinpath(*parts)  # a module (target.py), or a package whose modules are named
            candidates = [target.with_suffix(".py")] + [target / f"{alias.name}.py" for alias in node.names]
            todo.extend(c for c in candidates if c.is_file() and package in c.parents)
    return sorted(found)


@lru_cache(maxsize=None)
def _source_hash(module_name):
    """A hash of the source the kernels of ``module_name`` are built from (``kernel_sources``): an
    edit to any of those files is a miss; an edit to a kernel module it does not import is not."""
    digest = hashlib.sha256()
    package = pathlib.Path(__file__).parent
    for path in kernel_sources(sys.modules[module_name].__file__):
        # A kernel defined outside the package (a script's own, as scripts/sanitize.py's planted
        # one) is named by its file name: its content is hashed all the same.
        digest.update(str(path.relative_to(package) if package in path.parents else path.name).encode())
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
    parts = (FORMAT, source, _compiler_versions(), repr(config), signature, repr(tuple(compute_capability)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _corrupt(path, why):
    warnings.warn(f"nbflash: the cached kernel {path} {why}; compiling it again (and replacing the file, where the "
                  f"cache can be written)", RuntimeWarning, stacklevel=3)


def load(driver, key):
    """The CUfunction cached under ``key``, loaded into the current context, or None: a miss when
    there is no file, a miss with a RuntimeWarning when the file is unreadable, corrupt or refused."""
    path = cache_dir() / f"{key}.cubin"
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # never stored (or no cache folder): a plain miss
        return None
    except OSError as error:
        _corrupt(path, f"cannot be read ({error})")
        return None
    entry, _, rest = data.partition(b"\n")
    digest, _, cubin = rest.partition(b"\n")
    if not entry or not cubin or hashlib.sha256(cubin).hexdigest().encode() != digest:
        _corrupt(path, "is truncated or corrupt (its checksum does not match)")
        return None
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    status = driver.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(cubin))
    if status != 0:
        _corrupt(path, f"was refused by the CUDA driver (cuModuleLoadData error {status})")
        return None
    status = driver.cuModuleGetFunction(ctypes.byref(function), module, ctypes.c_char_p(entry))
    if status != 0:
        driver.cuModuleUnload(module)
        _corrupt(path, f"has no kernel {entry.decode(errors='replace')!r} (cuModuleGetFunction error {status})")
        return None
    return function


def store(key, entry_name, cubin):
    """Write the cubin under ``key``: to a temporary file in the cache folder first, then renamed
    over ``key``'s file (atomic on one file system), so readers never see half a file.

    ``cubin`` is bytes, or what Numba's linker returns (a cuda.core ``ObjectCode``, whose ``code`` is
    the bytes). Anything else is not cached: caching must never make a call fail. Nothing is left
    behind when the write fails (a read-only or full disk).
    """
    cubin = getattr(cubin, "code", cubin)
    if not isinstance(cubin, (bytes, bytearray, memoryview)):
        return
    cubin = bytes(cubin)
    data = entry_name.encode() + b"\n" + hashlib.sha256(cubin).hexdigest().encode() + b"\n" + cubin
    folder = cache_dir()
    temporary = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{key}.", suffix=".tmp", delete=False) as f:
            temporary = f.name
            f.write(data)
        os.replace(temporary, folder / f"{key}.cubin")
        temporary = None
    except OSError:
        pass  # a read-only or full disk: run without the cache
    finally:
        if temporary is not None:
            try:
                os.unlink(temporary)
            except OSError:
                pass
