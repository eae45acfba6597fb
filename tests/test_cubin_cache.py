"""The on-disk cubin cache: keys, files, faults (damaged files, read-only folders), and (on a GPU)
that a hit skips Numba's compiler and that a damaged file is recompiled and replaced. Processes
filling one cache at once: tests/test_concurrency.py."""

import hashlib
import warnings
from dataclasses import dataclass

import numpy as np
import pytest

import nbflash
from nbflash import configs, cubin_cache, launch
from nbflash.kernels import registry
from nbflash.problem import Static, Variant

from .helpers import assert_attention_close, random_qkv


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NBFLASH_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NBFLASH_CACHE_DIR", str(tmp_path / "a"))
    assert cubin_cache.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("NBFLASH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cubin_cache.cache_dir() == tmp_path / "xdg" / "nbflash"


def test_key_tells_configurations_signatures_and_gpus_apart():
    a = configs.mma_forward_config("float16", 128, Variant(window=True), True)
    b = configs.mma_forward_config("float16", 128, Variant(), True)
    c = configs.mma_forward_config("bfloat16", 128, Variant(window=True), True)
    sig = registry.signature(a)
    keys = {
        cubin_cache.cache_key(a, sig, (9, 0)),
        cubin_cache.cache_key(b, sig, (9, 0)),
        cubin_cache.cache_key(c, sig, (9, 0)),
        cubin_cache.cache_key(a, sig + " ", (9, 0)),
        cubin_cache.cache_key(a, sig, (8, 0)),
    }
    assert len(keys) == 5
    assert cubin_cache.cache_key(a, sig, (9, 0)) == cubin_cache.cache_key(a, sig, [9, 0])


class FakeDriver:
    """Records what load() asks of the driver; loads succeed unless told otherwise."""

    def __init__(self, module_status=0):
        self.module_status, self.loaded = module_status, []

    def cuModuleLoadData(self, module, image):
        self.loaded.append(image.value)
        return self.module_status

    def cuModuleGetFunction(self, function, module, name):
        self.entry = name.value
        return 0

    def cuModuleUnload(self, module):
        return 0


def test_store_then_load_round_trip(cache):
    cubin_cache.store("k1", "_Z6kernel", b"\x7fELF\x00binary\nwith newlines")
    assert [p.name for p in cache.iterdir()] == ["k1.cubin"]  # no temporary file left behind
    driver = FakeDriver()
    assert cubin_cache.load(driver, "k1") is not None
    assert driver.loaded == [b"\x7fELF"]  # the image (ctypes shows it up to its first NUL byte)
    assert driver.entry == b"_Z6kernel"


def test_store_takes_numba_linker_output_and_skips_what_it_cannot_write(cache):
    class ObjectCode:  # the shape of what numba-cuda's linker returns (cuda.core)
        code = b"\x7fELF cubin"

    cubin_cache.store("linked", "_Z6kernel", ObjectCode())
    digest = hashlib.sha256(b"\x7fELF cubin").hexdigest().encode()
    assert (cache / "linked.cubin").read_bytes() == b"_Z6kernel\n" + digest + b"\n\x7fELF cubin"

    class OnDisk:
        code = "/some/path.cubin"  # an ObjectCode backed by a file: not cached

    cubin_cache.store("path", "_Z6kernel", OnDisk())
    assert not (cache / "path.cubin").exists()


def test_missing_corrupt_or_unloadable_files_are_misses(cache):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an absent file is a plain miss: no warning
        assert cubin_cache.load(FakeDriver(), "absent") is None
    (cache / "empty.cubin").write_bytes(b"")
    with pytest.warns(RuntimeWarning, match="empty.cubin is truncated or corrupt"):
        assert cubin_cache.load(FakeDriver(), "empty") is None
    (cache / "noname.cubin").write_bytes(b"\n" + hashlib.sha256(b"cubin").hexdigest().encode() + b"\ncubin")
    with pytest.warns(RuntimeWarning, match="noname.cubin is truncated or corrupt"):
        assert cubin_cache.load(FakeDriver(), "noname") is None
    cubin_cache.store("bad", "_Z6kernel", b"not a cubin")
    with pytest.warns(RuntimeWarning, match="bad.cubin was refused by the CUDA driver"):
        assert cubin_cache.load(FakeDriver(module_status=200), "bad") is None


@pytest.mark.parametrize("damage", ["truncated", "flipped", "old layout"])
def test_damaged_file_is_a_miss_with_a_warning_then_replaced(cache, damage):
    """A cubin cut short (a full disk, a copy interrupted), with a changed byte, or of the layout
    before checksums: detected without the driver (which may load a damaged image), a warning,
    and the next store replaces it."""
    cubin = bytes(range(1, 200)) * 50
    cubin_cache.store("k", "_Z6kernel", cubin)
    path = cache / "k.cubin"
    data = path.read_bytes()
    damaged = {"truncated": data[: len(data) // 2], "flipped": data[:-7] + b"X" + data[-6:],
               "old layout": b"_Z6kernel\n" + cubin}[damage]
    path.write_bytes(damaged)
    driver = FakeDriver()
    with pytest.warns(RuntimeWarning, match=r"k.cubin is truncated or corrupt.*compiling it again"):
        assert cubin_cache.load(driver, "k") is None
    assert driver.loaded == []  # the damaged image never reached the driver
    cubin_cache.store("k", "_Z6kernel", cubin)  # what a recompile does
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cubin_cache.load(driver, "k") is not None
    assert path.read_bytes() == data


def test_format_is_part_of_the_key(monkeypatch):
    """Files of another layout are never even read: the key changes with FORMAT."""
    config = configs.mma_forward_config("float16", 64, Variant(), True)
    before = cubin_cache.cache_key(config, "sig", (9, 0))
    monkeypatch.setattr(cubin_cache, "FORMAT", cubin_cache.FORMAT + "x")
    assert cubin_cache.cache_key(config, "sig", (9, 0)) != before


def test_unreadable_file_is_a_miss_with_a_warning(cache):
    (cache / "dir.cubin").mkdir()  # a path that exists but cannot be read as a file
    with pytest.warns(RuntimeWarning, match="dir.cubin cannot be read"):
        assert cubin_cache.load(FakeDriver(), "dir") is None


def test_read_only_cache_loads_and_stores_nothing(cache, monkeypatch):
    """A cache directory nobody may write to (a shared, prebuilt cache): what is there loads, and a
    new kernel is simply not cached, with no error and no file left behind. (Tests run as root,
    whom permissions do not stop, so the refusal is the one the OS gives a non-root user.)"""
    cubin_cache.store("there", "_Z6kernel", b"cubin")

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cubin_cache.tempfile, "NamedTemporaryFile", refused)
    cubin_cache.store("new", "_Z6kernel", b"cubin")  # must not raise
    assert cubin_cache.load(FakeDriver(), "there") is not None
    assert cubin_cache.load(FakeDriver(), "new") is None
    assert sorted(p.name for p in cache.iterdir()) == ["there.cubin"]


def test_failed_rename_leaves_no_temporary_file(cache, monkeypatch):
    def refused(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cubin_cache.os, "replace", refused)
    cubin_cache.store("k", "_Z6kernel", b"cubin")
    assert list(cache.iterdir()) == []


def test_unwritable_cache_dir_means_no_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("NBFLASH_CACHE_DIR", str(blocker / "sub"))
    cubin_cache.store("k", "_Z6kernel", b"cubin")  # must not raise
    assert cubin_cache.load(FakeDriver(), "k") is None


@pytest.mark.gpu
def test_gpu_second_load_comes_from_disk_without_numba(cache, rng, xp, monkeypatch):
    """The first CompiledKernel compiles and writes a cubin; the second loads it and never calls the
    builder; both give the same exact attention."""
    config = configs.mma_forward_config("float16", 64, Variant(window=True), True)
    first = launch.CompiledKernel(config)
    assert len(list(cache.glob("*.cubin"))) == 1

    def no_compiling(config):
        raise AssertionError("the cached cubin should have been loaded")

    monkeypatch.setattr(registry, "build", no_compiling)
    second = launch.CompiledKernel(config)
    assert second.registers == first.registers and second.local_bytes == first.local_bytes

    q, k, v = random_qkv(rng, xp, 2, 300, 300, 4, 4, 64, "float16")
    outs = []
    for kernel in (first, second):
        out, lse = launch.empty(q.shape, q.dtype), launch.empty((2, 4, 300), np.float32)
        kernel.launch(config.grid(2, 4, 300), (q, k, v, out, lse), (0.125 * 1.4426950408889634,), (300, 0))
        assert_attention_close(out, None, q, k, v, True)
        outs.append(xp.asnumpy(out))
    assert np.array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))
    with nbflash.kernel_family("mma"):
        assert nbflash.explain(q, k, v, causal=True)["config"]["headdim"] == 64


@pytest.mark.gpu
def test_gpu_damaged_cubin_is_recompiled_and_replaced(cache, rng, xp):
    """A cached cubin cut in half: the next process (a fresh CompiledKernel) warns, compiles, and
    leaves a good file that a third one loads without a warning; both compute exact attention."""
    config = configs.portable_forward_config("float32", 16, Variant())
    launch.CompiledKernel(config)
    (path,) = cache.glob("*.cubin")
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with pytest.warns(RuntimeWarning, match="truncated or corrupt"):
        second = launch.CompiledKernel(config)
    _, digest, cubin = path.read_bytes().split(b"\n", 2)
    assert hashlib.sha256(cubin).hexdigest().encode() == digest, "the damaged file was not replaced"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        third = launch.CompiledKernel(config)
    q, k, v = random_qkv(rng, xp, 1, 40, 40, 2, 2, 16, "float32")
    for kernel in (second, third):
        out, lse = launch.empty(q.shape, q.dtype), launch.empty((1, 2, 40), np.float32)
        kernel.launch(config.grid(1, 2, 40), (q, k, v, out, lse), (0.25 * 1.4426950408889634,), ())
        assert_attention_close(out, None, q, k, v, False)


def test_key_follows_the_kernels_own_module(monkeypatch):
    """Editing one kernel module changes its kernels' keys and no other module's."""
    from nbflash.kernels import backward_mma, forward_mma

    forward = configs.mma_forward_config("float16", 64, Variant(), True)
    backward_cfg = configs.plan_backward(Static("float16", 64, True, 0), False, "mma")[1]
    assert type(backward_cfg).__module__ == backward_mma.__name__
    before = (cubin_cache.cache_key(forward, "sig", (9, 0)), cubin_cache.cache_key(backward_cfg, "sig", (9, 0)))
    real = cubin_cache._source_hash.__wrapped__

    def edited(module_name):
        digest = real(module_name)
        return digest + "edited" if module_name == backward_mma.__name__ else digest

    monkeypatch.setattr(cubin_cache, "_source_hash", edited)
    after = (cubin_cache.cache_key(forward, "sig", (9, 0)), cubin_cache.cache_key(backward_cfg, "sig", (9, 0)))
    assert after[0] == before[0] and after[1] != before[1]
    assert forward_mma.__name__ != backward_mma.__name__


def test_a_kernel_key_covers_the_modules_it_imports():
    """The files hashed into a kernel module's key follow its imports: the Hopper kernels are
    built from primitives_sm90.py (its intrinsics' asm) and the sm90 backward from forward_sm90.py's
    tile constants, the decode kernel from kernels/kvcache.py's append rows; a kernel module
    another does not import stays out (an edit there is no miss)."""
    import pathlib

    from nbflash.kernels import backward_sm90, decode_mma, forward_mma

    package = pathlib.Path(cubin_cache.__file__).parent

    def sources(module):
        return {str(path.relative_to(package)) for path in cubin_cache.kernel_sources(module.__file__)}

    shared = set(cubin_cache.SHARED_KERNEL_SOURCES)
    assert {"primitives_sm90.py", "kernels/forward_sm90.py", "kernels/backward_sm90.py"} | shared <= sources(
        backward_sm90)
    assert {"kernels/kvcache.py", "kernels/decode_mma.py"} | shared <= sources(decode_mma)
    assert sources(forward_mma) == shared | {"kernels/forward_mma.py"}


@dataclass(frozen=True)
class OutsideConfig:
    """A configuration whose module is not in the package (this test file), as a script's own
    kernel is (scripts/sanitize.py's planted one)."""

    dtype: str = "float32"


def test_a_kernel_defined_outside_the_package_has_a_key():
    """Its module's file is hashed under its name; the first GPU run of the sanitizer's planted case
    stopped on ``relative_to`` (the script is not under nbflash/)."""
    key = cubin_cache.cache_key(OutsideConfig(), "void(float32[::1])", (9, 0))
    assert key == cubin_cache.cache_key(OutsideConfig(), "void(float32[::1])", (9, 0))
    assert key != cubin_cache.cache_key(OutsideConfig("float16"), "void(float32[::1])", (9, 0))
