"""Concurrency: processes filling one on-disk kernel cache at once, and threads calling the kernels.

Shared host state, as read in the code (what a thread or a process could race on):

- ``launch.CompiledKernel``: one parameter buffer and launch config per kernel, written and
  launched under the kernel's lock (the driver is called holding the GIL, so nothing rewrites the
  buffer while the driver reads it); held to that below with a fake driver, no GPU needed.
- The caches of compiled kernels (``launch.compiled``, ``interface._forward_kernel``,
  ``backward._kernels``: ``functools.lru_cache``) and the remembered validations
  (``validation._REMEMBERED``, ``kvcache._REMEMBERED``: plain dicts of immutable problems / plans,
  each call launching with its own arrays; a plan's one mutable part, its views into each stream's
  workspace, is a dict keyed by stream). Two threads missing at once may both compile and both
  store; each gets a working kernel and the last store wins. A cleared dict is a miss, never a
  wrong hit; ``kvcache._last_plan`` is only used after its key compares equal to the call's.
- Per thread by construction: the forced kernel family (a ContextVar), the last dropout seed
  (threading.local), the KV-cache workspace (one per stream).
- The on-disk cache: each file written under a temporary name and renamed (``cubin_cache.store``),
  checked against its SHA-256 when read; the processes test below holds it to that.
"""

import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import nbflash
from nbflash import cubin_cache

from .conftest import SIMULATOR
from .helpers import random_qkv, to_numpy, small_tiles

# A child process: loads nbflash/cubin_cache.py on its own (no Numba, no nbflash package: it starts
# in milliseconds), then stores and loads the shared key and its own key ROUNDS times each, with
# payloads large enough that a write done in place would be seen half done. Every load must return
# a whole payload some process stored, with no warning (a torn file would be one). Prints a JSON
# report.
CHILD = r"""
import ctypes, importlib.util, json, sys, warnings
path, worker, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
spec = importlib.util.spec_from_file_location("cubin_cache", path)
cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cache)

class Driver:
    def cuModuleLoadData(self, module, image):
        self.image = image.value
        return 0
    def cuModuleGetFunction(self, function, module, name):
        self.entry = name.value
        return 0
    def cuModuleUnload(self, module):
        return 0

def payload(owner, round_):
    return (b"%d-%d:" % (owner, round_)) * 40000  # about 300 KB, no NUL byte

bad = []
warnings.simplefilter("error")
driver = Driver()
for round_ in range(rounds):
    for key in ("shared", f"own{worker}"):
        cache.store(key, f"_Z6kernel{worker}", payload(worker, round_))
        try:
            found = cache.load(driver, key)
        except RuntimeWarning as warning:
            bad.append(f"{key}: {warning}")
            continue
        if found is None:
            bad.append(f"{key}: a miss after a store")
            continue
        owner = int(driver.entry[len(b"_Z6kernel"):])
        mark = driver.image.split(b":", 1)[0]
        whole = mark.count(b"-") == 1 and driver.image == (mark + b":") * 40000
        if not whole or int(mark.split(b"-")[0]) != owner or (key != "shared" and owner != worker):
            bad.append(f"{key}: entry of worker {owner} with a payload starting {driver.image[:20]!r}")
print(json.dumps(bad))
"""


def test_processes_filling_one_cache_at_once_never_corrupt_it(tmp_path):
    """Four processes store and load one shared key and their own keys, over and over: every load
    is a whole entry one of them stored, never a torn one; no temporary file is left behind."""
    workers, rounds = 4, 25
    environment = dict(os.environ, NBFLASH_CACHE_DIR=str(tmp_path))
    children = [subprocess.Popen([sys.executable, "-c", CHILD, cubin_cache.__file__, str(w), str(rounds)],
                                 env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for w in range(workers)]
    for child in children:
        stdout, stderr = child.communicate(timeout=120)
        assert child.returncode == 0, stderr
        assert json.loads(stdout) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["shared.cubin"] + [f"own{w}.cubin" for w in range(workers)])
    for p in tmp_path.iterdir():  # the last store of each key, whole
        entry, digest, cubin = p.read_bytes().split(b"\n", 2)
        assert len(cubin) > 100000 and cubin_cache.hashlib.sha256(cubin).hexdigest().encode() == digest


# ---- Threads ---------------------------------------------------------------------------------


def _problems(rng, xp, shapes, dtype):
    problems = []
    for batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal in shapes:
        q, k, v = random_qkv(rng, xp, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype)
        dout = xp.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(q.dtype))
        problems.append((q, k, v, dout, causal))
    return problems


def _in_threads(work, count):
    """``work(i)`` in ``count`` threads started together; their results in order (or the first
    exception, raised here)."""
    results, errors = [None] * count, []
    barrier = threading.Barrier(count)

    def run(i):
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as error:  # noqa: B036 (re-raised in the caller)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _bitwise_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _fake_array(pointer, shape):
    """What a launch reads from an array: shape, strides, size, itemsize and the data pointer."""
    strides = tuple(int(np.prod(shape[i + 1:])) * 2 for i in range(len(shape)))
    return SimpleNamespace(shape=shape, strides=strides, size=int(np.prod(shape)), itemsize=2,
                           data=SimpleNamespace(ptr=pointer))


def test_launches_from_eight_threads_never_mix_their_parameters(monkeypatch):
    """``CompiledKernel.launch``'s GPU path with a fake driver: eight threads, each with its own
    arrays, scalar, grid and stream, launch one kernel 100 times each. What the "driver" reads at
    each launch (the data pointers and the scalar in the shared parameter buffer, the grid and the
    stream in the shared launch config) is always one thread's call, never a mix: the kernel's lock
    covers writing them and launching. (Checked to fail with the lock replaced by a no-op.)"""
    import ctypes
    import struct

    from nbflash import launch, runtime

    signature = "void(float16[:,:,:,:], float16[:,:,:,::1], float32)"
    fields, _ = launch._parameter_layout(signature)
    pointers = launch._pointer_words(signature)
    kernel = object.__new__(launch.CompiledKernel)  # the state __init__ leaves, without a GPU
    kernel.config, kernel._host_arguments, kernel.function = SimpleNamespace(threads=128), None, None
    kernel._parameters = launch.ParameterBuffer(signature)
    kernel._lock = threading.Lock()
    kernel._launch_config = launch.LaunchConfig(block_x=128, block_y=1, block_z=1)
    kernel._launch_config_pointer = ctypes.c_void_p(ctypes.addressof(kernel._launch_config))
    kernel._grid = kernel._stream = None
    streams = {}

    def current_stream():  # each thread's own stream; a thread switch here is the dangerous one
        time.sleep(0)  # gives up the GIL: another thread runs now if it can
        return SimpleNamespace(ptr=streams[threading.get_ident()])

    seen = []

    def launch_ex(config, function, parameters, extra):  # what the driver would read
        time.sleep(0)
        words = struct.unpack(fields, bytes(kernel._parameters.buffer))
        c = kernel._launch_config
        seen.append((words[pointers[0]], words[pointers[1]], words[-1], (c.grid_x, c.grid_y, c.grid_z), c.stream))
        return 0

    kernel._current_stream, kernel._launch_ex = current_stream, launch_ex
    monkeypatch.setattr(runtime, "SIMULATOR", False)

    def work(i):
        streams[threading.get_ident()] = 1000 + i
        shape = (1, 8 + i, 2, 16)  # a layout of its own: every write repacks the whole buffer
        arrays = (_fake_array(0x10000 * (i + 1), shape), _fake_array(0x10000 * (i + 1) + 0x100, shape))
        for _ in range(100):
            kernel.launch((i + 1, 2, 1), arrays, (float(i),))

    _in_threads(work, 8)
    assert len(seen) == 800
    for a, b, scalar, grid, stream in seen:
        i = a // 0x10000 - 1
        assert (b, scalar, grid, stream) == (a + 0x100, float(i), (i + 1, 2, 1), 1000 + i)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU test below runs the kernels themselves in 8 threads")
def test_host_side_from_eight_threads_matches_serial(rng, xp):
    """The host side of a call (validation and its remembered problems, planning, the compiled-kernel
    caches of the forward and the backward) from eight threads at once, each shape in two of them:
    the same problems and kernel configurations as serial calls.

    Only the host side: the simulator swaps a kernel module's ``cuda`` global for its fake one while
    a kernel runs, so two threads cannot run kernels at once there (the GPU test below does)."""
    from nbflash import backward, configs, interface, validation

    shapes = [(1, 5, 7, 2, 1, 8, True), (1, 9, 4, 1, 1, 4, False), (2, 3, 9, 2, 2, 8, False), (1, 8, 8, 3, 1, 4, True)]
    problems = _problems(rng, xp, shapes * 2, "float32")

    def host_side(i):
        q, k, v, _, causal = problems[i]
        problem = validation.check_forward(q, k, v, None, causal)[0]
        with nbflash.kernel_family("portable"):  # a ContextVar: each thread forces its own
            forward = interface._kernel_for(problem)
            kernels = backward._kernels(problem.static, i % 2 == 0, configs.forced_family(), problem.aligned)
        return problem, forward, kernels

    with small_tiles():
        validation._REMEMBERED.clear()
        concurrent = _in_threads(host_side, len(problems))
        serial = [host_side(i) for i in range(len(problems))]
    for (problem, forward, kernels), (again, forward_again, kernels_again) in zip(concurrent, serial):
        # Equal, not identical: two threads missing a cache at once each build one (the last stored
        # wins), which is harmless; what must not happen is a wrong problem or kernel.
        assert problem == again
        assert forward.config == forward_again.config and forward.config.threads == 16  # small tiles, every thread
        assert [x.config for x in kernels] == [x.config for x in kernels_again]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, deterministic", [("float16", True), ("float32", True), ("float16", False)])
def test_gpu_threads_on_their_own_streams_match_serial_calls(rng, xp, dtype, deterministic):
    """Eight threads, each on its own CuPy stream, run forward and backward on problems of their
    own, three times over the same kernels: the results are bit-identical to serial calls on the
    default stream. With the default backward (``deterministic=False``: on compute capability 9.0
    the Hopper one), dQ adds float32 atomics in whatever order the blocks run, so it is held to
    the serial dQ within rounding instead; out, lse, dK and dV stay bit-identical."""
    import cupy

    shapes = [(2, 257, 203, 4, 2, 64, True), (1, 113, 300, 4, 4, 64, False), (3, 64, 64, 2, 1, 64, True),
              (1, 1, 513, 8, 8, 64, False)] * 2
    problems = _problems(rng, xp, shapes, dtype)

    def call(problem):
        q, k, v, dout, causal = problem
        out, lse = nbflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
        grads = nbflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
        return out, lse, *grads

    serial = [[to_numpy(x) for x in call(p)] for p in problems]
    cupy.cuda.Device().synchronize()

    def threaded(i):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            results = [call(problems[i]) for _ in range(3)]  # queued back to back, then read
            stream.synchronize()
            return [[to_numpy(x) for x in r] for r in results]

    for got, expected in zip(_in_threads(threaded, len(problems)), serial):
        for repeat in got:
            out, lse, dq, dk, dv = repeat
            assert all(_bitwise_equal(a, b) for a, b in zip((out, lse, dk, dv), expected[:2] + expected[3:]))
            if deterministic:
                assert _bitwise_equal(dq, expected[2])
            else:
                want = expected[2].astype(np.float32)
                assert np.allclose(dq.astype(np.float32), want, rtol=2e-3, atol=2e-3 * float(np.abs(want).max()))
