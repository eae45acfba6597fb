"""Host time of a decode call (``flash_attn_with_kvcache``) on the CPU, with no GPU: a fake CuPy and a
fake driver whose launch does nothing.

Everything nbflash does on the host runs as on a GPU (validation, planning, the remembered-call
fast path, the split workspace, parameter packing, the launch call); only CuPy's arrays, streams and
allocations and the driver's ``cuLaunchKernelEx`` are stand-ins. So the figures are for comparing
versions of nbflash's host path on one machine, not the time of a call on a GPU's host: a real CuPy
array's attributes, a real stream lookup and the ctypes call into libcuda cost more (the last one
about a microsecond). ``scripts/host_overhead.py --decode`` times the real thing on a GPU.

    python scripts/host_profile_fake.py                 # us per call for each case, then cProfile
    python scripts/host_profile_fake.py --calls 20000 --cases append --top 25

Kernels are never compiled: the fake backend builds each CompiledKernel with a null function.
"""

import argparse
import contextlib
import cProfile
import ctypes
import io
import math
import os
import pstats
import sys
import time
from types import SimpleNamespace

if __name__ == "__main__":
    # Numba must not look for a GPU; nbflash is told it has one. Only when run as a script: imported
    # (tests/test_kvcache_host.py) the process has chosen already, and setting it then would turn
    # Numba's later compiles on a GPU machine into the simulator's (every later test in that process
    # then fails with "'FakeCUDAKernel' object has no attribute ...").
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402

import nbflash  # noqa: E402
from nbflash import kvcache, launch, runtime, validation  # noqa: E402

MULTIPROCESSORS = 132  # the H200's


# ---------------------------------------------------------------------------------------------------
# A fake CuPy: arrays with what nbflash reads (shape, strides, dtype, data.ptr, ...), streams, memory
# ---------------------------------------------------------------------------------------------------


class FakeMemory:
    """CuPy's MemoryPointer: ``ptr``, ``device_id``, ``mem.size``, ``+ offset``."""

    def __init__(self, ptr, size, device_id=0):
        self.ptr, self.device_id, self.mem = ptr, device_id, SimpleNamespace(size=size)

    def __add__(self, offset):
        return FakeMemory(self.ptr + offset, self.mem.size - offset, self.device_id)


class FakeAllocator:
    def __init__(self):
        self.next = 0x7F0000000000

    def __call__(self, nbytes):
        ptr = self.next
        self.next += -(-max(nbytes, 1) // 512) * 512
        return FakeMemory(ptr, nbytes)


class FakeArray:
    """A C-contiguous (or given-strides) device array. ``shape`` and ``strides`` are properties that
    build their tuples on each read, as CuPy's do."""

    def __init__(self, shape, dtype, memptr=None, strides=None):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.ndim = len(shape)
        self.size = math.prod(shape)
        if strides is None:
            strides, step = [], self.itemsize
            for n in reversed(shape):
                strides.insert(0, step)
                step *= n
        self._shape, self._strides = list(shape), list(strides)
        self.data = memptr if memptr is not None else _fake.cuda.alloc(self.size * self.itemsize)

    @property
    def shape(self):
        return tuple(self._shape)

    @property
    def strides(self):
        return tuple(self._strides)

    def view_at(self, offset):
        """The same layout at another address (a new array object)."""
        return FakeArray(self.shape, self.dtype, self.data + offset, self.strides)


class FakeStream:
    def __init__(self, ptr):
        self.ptr = ptr


class FakeCuda:
    def __init__(self):
        self.alloc = FakeAllocator()
        self.stream = FakeStream(0)
        self.runtime = SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1,
                                       getDeviceProperties=self._properties)

    @staticmethod
    def _properties(device):
        return {"major": 9, "minor": 0, "multiProcessorCount": MULTIPROCESSORS}

    def get_current_stream(self):
        return self.stream


class FakeCupy:
    ndarray = FakeArray

    def __init__(self):
        self.cuda = FakeCuda()

    def empty(self, shape, dtype):
        return FakeArray(shape, dtype)

    def zeros(self, shape, dtype):
        return FakeArray(shape, dtype)

    def broadcast_to(self, x, shape):
        return FakeArray(shape, x.dtype, x.data, (0,) * (len(shape) - x.ndim) + x.strides)


_fake = FakeCupy()


class FakeDriver:
    """libcuda's few functions a CompiledKernel calls: a launch counts and returns success. With
    ``record``, each launch also keeps what the driver would read: (grid, stream, the 8-byte word of
    every kernel parameter)."""

    def __init__(self, record=False):
        self.launches, self.record, self.seen = 0, record, []

    def cuLaunchKernelEx(self, config, function, parameters, extra):
        self.launches += 1
        if self.record:
            c = launch.LaunchConfig.from_address(config.value)
            words = [ctypes.c_int64.from_address(p).value for p in parameters]
            self.seen.append(((c.grid_x, c.grid_y, c.grid_z), c.stream or 0, words))
        return 0

    def cuFuncSetAttribute(self, *args):
        return 0


def _reset_caches():
    launch.compiled.cache_clear()
    kvcache._stand_ins.cache_clear()
    kvcache._multiprocessors.cache_clear()
    kvcache._REMEMBERED.clear()
    kvcache._last_plan = None  # else the next call with an equal key takes the last fake GPU's plan
    kvcache._workspaces.clear()
    kvcache._merge_counters.clear()
    validation._REMEMBERED.clear()


@contextlib.contextmanager
def fake_gpu(record=False):
    """nbflash believes it runs on a GPU (compute capability 9.0, 132 multiprocessors) through the
    fake CuPy and driver; yields (fake cupy, fake driver). Restores everything on exit."""
    driver = FakeDriver(record)
    _fake.cuda.stream = FakeStream(0)
    saved = (runtime.SIMULATOR, runtime._cupy, launch._driver, launch._load_or_compile, launch._function_attribute)
    _reset_caches()
    runtime.SIMULATOR, runtime._cupy = False, _fake
    launch._driver = lambda: driver
    launch._load_or_compile = lambda config, signature: None
    launch._function_attribute = lambda function, attribute: 0
    try:
        yield _fake, driver
    finally:
        (runtime.SIMULATOR, runtime._cupy, launch._driver, launch._load_or_compile,
         launch._function_attribute) = saved
        _reset_caches()


# ---------------------------------------------------------------------------------------------------
# The calls
# ---------------------------------------------------------------------------------------------------


def decode_case(name, batch=1, nheads=32, nheads_k=8, headdim=128, capacity=1024, page=None):
    """Arguments of one decode step (seqlen_q 1, float16, lengths on the GPU, ``out=``) as a serving
    loop passes them: ``plain`` attends, ``append`` also writes the new token's k and v,
    ``paged_rotary`` appends through a block table with rotary embedding, causal."""
    dtype = np.float16
    q = FakeArray((batch, 1, nheads, headdim), dtype)
    if page is None:
        cache_shape = (batch, capacity, nheads_k, headdim)
    else:
        cache_shape = (batch * capacity // page, page, nheads_k, headdim)
    kwargs = dict(cache_seqlens=FakeArray((batch,), np.int32), out=FakeArray(q.shape, dtype))
    if name in ("append", "paged_rotary"):
        new = (batch, 1, nheads_k, headdim)
        kwargs.update(k=FakeArray(new, dtype), v=FakeArray(new, dtype))
    if name == "paged_rotary":
        kwargs.update(rotary_cos=FakeArray((capacity, headdim // 2), dtype),
                      rotary_sin=FakeArray((capacity, headdim // 2), dtype), causal=True)
    if page is not None:
        kwargs["block_table"] = FakeArray((batch, capacity // page), np.int32)
    return (q, FakeArray(cache_shape, dtype), FakeArray(cache_shape, dtype)), kwargs


CASES = {
    "plain": dict(),
    "append": dict(),
    "paged_rotary": dict(page=16),
}


def per_call_us(fn, calls, rounds):
    """The least, over rounds, of the mean time of ``calls`` back-to-back calls, in microseconds
    (on a shared machine the other processes only ever add time)."""
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return min(times)


def trivial_us(calls, rounds):
    """A floor to compare against on this machine: a Python function call that reads two arrays'
    shapes and a stream and calls the fake driver (about what any launch wrapper must do)."""
    a, b = FakeArray((4,), np.float16), FakeArray((4,), np.float16)
    driver = FakeDriver()

    def call():
        a.shape, b.shape, _fake.cuda.get_current_stream().ptr
        return driver.cuLaunchKernelEx(None, None, None, None)

    return per_call_us(call, calls, rounds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="calls per round (default 1000)")
    parser.add_argument("--rounds", type=int, default=30, help="rounds; the fastest is printed (default 30)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--top", type=int, default=15, help="cProfile rows per case (0: none)")
    parser.add_argument("--append-launch", action="store_true",
                        help="the append as a launch of its own (kvcache.FUSED_APPEND off)")
    args = parser.parse_args(argv)
    kvcache.FUSED_APPEND = not args.append_launch

    print("flash_attn_with_kvcache host time, fake CuPy and driver (a CPU measurement, not a GPU's host):")
    print(f"  {'floor: 2 shapes, a stream, a no-op driver call':48s} {trivial_us(args.calls, args.rounds):7.2f} us")
    profiles = []
    with fake_gpu() as (_, driver):
        for name in args.cases:
            (q, k_cache, v_cache), kwargs = decode_case(name, **CASES[name])

            def call():
                return nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)

            before = driver.launches
            us = per_call_us(call, args.calls, args.rounds)
            launches = (driver.launches - before) / (args.calls * args.rounds + 1)
            plan = next(iter(kvcache._REMEMBERED.values())) if len(kvcache._REMEMBERED) == 1 else None
            splits = getattr(plan, "splits", "?")
            print(f"  {name:48s} {us:7.2f} us  ({launches:.0f} launches a call, {splits} splits)")
            if args.top:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.calls):
                    call()
                profiler.disable()
                profiles.append((name, profiler))
            kvcache._REMEMBERED.clear()
            kvcache._last_plan = None
    for name, profiler in profiles:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(args.top)
        print(f"\n---- cProfile, {name}, {args.calls} calls, by own time ----")
        print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()))


if __name__ == "__main__":
    sys.exit(main())
