"""Where kernels run: a CUDA GPU through CuPy and Numba, or Numba's CUDA simulator on the CPU.

The simulator is chosen by the environment variable NUMBA_ENABLE_CUDASIM=1, which Numba reads when it
is first imported; nbflash never switches it behind the caller's back (``python -m nbflash`` and the
tests do, before importing Numba, when no GPU is present).
"""

from numba import config

SIMULATOR = bool(config.ENABLE_CUDASIM)


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

    import numpy as np
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


def _let_woken_threads_run():
    """Keep the simulator's block manager from holding the GIL while a block's threads wait for it.

    The simulator runs a block's CUDA threads as Python threads under a manager thread that polls
    every one of them (``is_alive()``, which never blocks) in a loop that never waits, so it keeps
    the GIL until the interpreter's switch interval (5 ms) takes it away. A thread woken at a
    barrier (each warp collective, named barrier and mbarrier wait of nbflash's emulations, each
    ``syncthreads``) then waits up to that long for the GIL, at every hand-off. Here each poll
    yields the GIL first, so a woken thread runs at once. The poll's answers are unchanged: the
    kernels see nothing different. Measured on 2 cores: the test suite in the simulator 854 s ->
    551 s, the sm90 rows split's hd 64 test 56 s -> 19 s.
    """
    import threading
    import time

    from numba.cuda.simulator import kernel

    block_thread = getattr(kernel, "BlockThread", None)
    if block_thread is None:  # another simulator than the one measured: leave it as it is
        return

    def is_alive(thread):
        time.sleep(0)  # releases the GIL: a simulated thread that can run takes it now
        return threading.Thread.is_alive(thread)

    block_thread.is_alive = is_alive


if SIMULATOR:  # for every kernel run in the simulator: nbflash's, the lessons', the tests'
    _one_shared_array_per_line()
    _let_woken_threads_run()


# DLPack device types (dlpack.h): where an exported tensor's memory lives.
DLPACK_CUDA = 2
DLPACK_CUDA_MANAGED = 13


def gpu_present():
    """True when CuPy can see a CUDA GPU. Imports neither Numba's CUDA driver nor anything heavy."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


_cupy = None


def xp():
    """The array module the library's arrays live in: NumPy in the simulator, CuPy on a GPU."""
    if SIMULATOR:
        import numpy

        return numpy
    return cupy()


def cupy():
    """The CuPy module (imported on first use), or a clear error when it cannot be used."""
    global _cupy
    if _cupy is None:
        try:
            import cupy as module
        except ImportError as error:
            raise RuntimeError(
                "nbflash needs CuPy on a GPU: pip install 'nbflash[cuda12]' or 'nbflash[cuda13]' "
                f"({error}); without a GPU, set NUMBA_ENABLE_CUDASIM=1 before Numba is imported to run the "
                "kernels on the CPU in Numba's CUDA simulator, on NumPy arrays"
            ) from None
        if not gpu_present():
            raise RuntimeError(
                "no CUDA GPU is visible; to run on the CPU in Numba's CUDA simulator, set "
                "NUMBA_ENABLE_CUDASIM=1 before Numba is imported and pass NumPy arrays"
            )
        _cupy = module
    return _cupy
