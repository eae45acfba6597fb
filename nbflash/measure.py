"""Measuring: device time with CUDA events and exact peak device memory, for the demo and scripts.

Under Numba's CUDA simulator there is no device: ``time_ms`` gives the CPU time of one call and
``measure_peak`` gives None.
"""

import time

import numpy as np

from . import runtime

SIMULATOR = runtime.SIMULATOR


class PeakMemory:
    """Counts CuPy device allocations while active: live bytes and their high-water mark.

    Installed as CuPy's allocator (``cupy.cuda.PythonFunctionAllocator``) over a private memory
    pool. ``malloc`` and ``free`` do the bookkeeping with the bytes asked for, so the peak is exact
    (not rounded to the pool's blocks). Allocations made before entering (the inputs) are not
    counted. On leaving, the previous allocator is restored and the private pool emptied. Memory that
    libraries allocate outside CuPy (cuBLAS's workspace, Numba's own) is not seen.

    ``pool`` is anything with ``malloc(size)`` returning an object with ``.ptr``, and
    ``free_all_blocks()``; tests pass a fake one.
    """

    _gpu_pool = None

    def __init__(self, pool=None):
        self.pool = pool
        self.blocks = {}  # ptr -> (the pool's memory object, requested bytes)
        self.live = 0
        self.peak = 0
        self.allocations = 0
        self._previous = None

    def malloc(self, size, device_id=None):
        if size == 0:
            return 0
        memory = self.pool.malloc(size)
        self.blocks[int(memory.ptr)] = (memory, size)
        self.live += size
        self.allocations += 1
        self.peak = max(self.peak, self.live)
        return int(memory.ptr)

    def free(self, ptr, device_id=None):
        entry = self.blocks.pop(int(ptr), None)
        if entry is not None:  # dropping entry[0] hands the block back to the private pool
            self.live -= entry[1]

    def __enter__(self):
        cp = runtime.cupy()
        if self.pool is None:
            # One private pool for the whole run, kept alive so late frees always find it.
            if PeakMemory._gpu_pool is None:
                PeakMemory._gpu_pool = cp.cuda.MemoryPool()
            self.pool = PeakMemory._gpu_pool
        cp.cuda.Device().synchronize()
        cp.get_default_memory_pool().free_all_blocks()  # cached blocks would crowd the measurement
        self.pool.free_all_blocks()
        self._previous = cp.cuda.get_allocator()
        allocator = cp.cuda.memory.PythonFunctionAllocator(self.malloc, self.free)
        cp.cuda.set_allocator(allocator.malloc)
        return self

    def __exit__(self, *exc):
        cp = runtime.cupy()
        cp.cuda.set_allocator(self._previous)
        cp.cuda.Device().synchronize()
        self.pool.free_all_blocks()
        return False


def measure_peak(fn):
    """Peak extra device bytes of one call of ``fn`` (its output included), or None in the
    simulator. Raises the call's error (out of memory, say)."""
    if SIMULATOR:
        return None
    with PeakMemory() as meter:
        out = fn()
        runtime.cupy().cuda.get_current_stream().synchronize()
        del out
    return meter.peak


def time_ms(fn, warmup=1, repeats=5, budget_s=1.0, before=None):
    """Median milliseconds of ``fn``: CUDA events after ``warmup`` calls; at least 3 repeats, more
    up to ``repeats`` while within ``budget_s``. In the simulator: one call, CPU time.

    Each call runs between its two events on an idle GPU, so its host work before the first launch
    (argument checks, allocations) counts. With ``before``, ``before()`` is queued ahead of every
    timed call, before its start event: the GPU is still working on it while ``fn``'s host work
    runs, so only ``fn``'s GPU time counts, as in a training step whose host runs ahead of its
    kernels. scripts/bench.py times torch's backward so (a fresh forward queued before each), and
    nbflash's backward the same way beside it. ``before`` must keep the GPU busy longer than
    ``fn``'s host work takes (a forward pass at benchmark sizes does)."""
    if SIMULATOR:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    cp = runtime.cupy()
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    cp.cuda.get_current_stream().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    deadline = time.perf_counter() + budget_s
    while len(times) < max(1, repeats) and (len(times) < 3 or time.perf_counter() < deadline):
        if before is not None:
            before()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def back_to_back_ms(fn, calls, warmup=3, repeats=50, budget_s=1.0):
    """Milliseconds per call of ``fn`` run ``calls`` times back to back between two CUDA events
    (``time_ms``'s median over repeats, divided by ``calls``). The GPU works through the queued
    calls while the host prepares the next, so a call's host time and launch latency stay out of
    its figure unless they exceed its GPU time: a model's decode step launching layer after layer,
    or a replayed CUDA graph. ``time_ms`` (each call alone between its events) counts them."""
    def in_a_row():
        for _ in range(calls):
            fn()

    return time_ms(in_a_row, warmup=max(1, -(-warmup // calls)), repeats=repeats, budget_s=budget_s) / calls
