"""nbflash._compile_speed's replacement pass gives numba-cuda's own result, on real IR.

The comparison runs in a child process without Numba's simulator (the simulator has no compiler):
numba-cuda's ``Lower._find_singly_assigned_variable`` and ``find_singly_assigned_variables`` are
run on the same IR and must set the same attributes. The IR is that of nbflash's own unrolled
tensor-core kernels and their device functions (the forward and the dK/dV backward), as Numba's
front end makes it and after its SSA reconstruction, plus small functions with the cases the pass
tells apart (a name assigned twice in a block, in two blocks, used in another block, a generator). Where NVVM is installed, also inside a real compile: every function lowered for a
small tensor-core kernel checks the two against each other. No GPU needed.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _child():
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def child():
    """The child's report: one process runs every check (a Numba import costs seconds)."""
    return _child()


def test_replacement_matches_numba_cuda_on_kernel_ir(child):
    assert "front end: checked" in child


def test_replacement_matches_numba_cuda_inside_a_compile(child):
    if "NVVM is not installed" in child:
        pytest.skip("NVVM is not installed (numba-cuda without its CUDA extra)")
    assert "compile: checked" in child


def test_patch_is_guarded(child):
    """Installed only over the exact original; NBFLASH_COMPILE_PATCH=0 keeps numba-cuda's pass."""
    assert "guard: guarded" in child


# ---------------------------------------------------------------------------------------------------
# The child process
# ---------------------------------------------------------------------------------------------------


class _Lowerer:
    """What the pass reads of a numba-cuda ``Lower`` (``BaseLower.__init__`` sets these two)."""

    def __init__(self, func_ir):
        self.func_ir = func_ir
        self.blocks = dict(sorted(func_ir.blocks.items()))


def _compare(func_ir, what):
    from nbflash import _compile_speed

    theirs, ours = _Lowerer(func_ir), _Lowerer(func_ir)
    _compile_speed.original()(theirs)
    _compile_speed.find_singly_assigned_variables(ours)
    assert ours._singly_assigned_vars == theirs._singly_assigned_vars, what
    assert ours._blk_local_varmap == theirs._blk_local_varmap == {}, what
    return len(theirs._singly_assigned_vars)


def _cases():
    """Small functions with each case the pass distinguishes."""

    def twice_in_block(a):
        x = a + 1
        x = x * 2  # x assigned twice in one block: not singly assigned
        y = a - 1
        return x + y

    def two_blocks(a):
        if a > 0:
            x = 1
        else:
            x = 2  # x defined in two blocks
        z = a * 3  # used only in its own block
        return x + z

    def used_elsewhere(a):
        w = a + 1
        for i in range(3):  # w used in the loop's blocks
            a += w * i
        return a

    def generator(a):
        v = a + 1
        yield v

    return twice_in_block, two_blocks, used_elsewhere, generator


def _frontend():
    from numba.cuda.compiler import run_frontend
    from numba.cuda.core.ssa import reconstruct_ssa

    from nbflash.kernels import registry
    from nbflash.prebuild import configurations
    from nbflash.problem import Variant

    configs = configurations(["float16"], [32], ["mma"], (9, 0), variants=(Variant(window=True),))
    wanted = [c for c in configs if type(c).__name__ == "MmaForwardConfig"]
    wanted += [c for c in configs if getattr(c, "kernel", "") == "dkdv"][:1]
    functions = [(fn, True) for fn in _cases()]
    for config in wanted:
        kernel = registry.build(config).py_func
        # the forward's IR also after SSA reconstruction; the backward's (larger: numba-cuda's pass takes
        # seconds on it) only as the front end makes it
        ssa = type(config).__name__ == "MmaForwardConfig"
        functions += [(fn, ssa) for fn in [kernel] + [value.py_func for value in kernel.__globals__.values()
                                                      if type(value).__name__ == "CUDADispatcher"]]
    checked = found = 0
    for fn, ssa in functions:
        func_ir = run_frontend(fn, emit_dels=True)
        found += _compare(func_ir, f"{fn.__qualname__} (front end)")
        if ssa and not func_ir.func_id.is_generator:
            found += _compare(reconstruct_ssa(run_frontend(fn, emit_dels=False)), f"{fn.__qualname__} (SSA)")
        checked += 1
    assert checked > 10 and found > 100, (checked, found)
    print(f"front end: checked {checked} functions, {found} singly assigned variables")


def _compile():
    from nbflash import _compile_speed

    try:
        from numba.cuda.cudadrv import nvvm

        nvvm.NVVM()
        from numba.cuda.cudadrv import nvrtc

        nvrtc.get_supported_ccs()  # compile_ptx asks NVRTC which architectures it may target
    except Exception as error:  # no NVVM or NVRTC (numba-cuda without its CUDA extra, as in CI)
        print(f"compile: NVVM is not installed ({type(error).__name__}: NVVM or NVRTC missing)")
        return
    from numba import cuda
    from numba.cuda import lowering

    from numba import float32, uint32

    from nbflash.prebuild import pretend_gpu
    from nbflash.primitives import inline_device, mma_f16, static_range, unroll

    pretend_gpu((9, 0))
    lowered = []

    def both(lower):  # numba-cuda's pass, then ours on the same lowerer: the same sets
        _compile_speed.original()(lower)
        theirs = lower._singly_assigned_vars
        _compile_speed.find_singly_assigned_variables(lower)
        assert lower._singly_assigned_vars == theirs, lower.fndesc.qualname
        lowered.append(len(theirs))

    lowering.Lower._find_singly_assigned_variable = both

    @inline_device
    @unroll
    def accumulate(acc, a, b):  # unrolled register tiles, as in the tensor-core kernels
        for nt in static_range(2):
            d = mma_f16(a[0], a[1], a[2], a[3], b[nt], b[nt], acc[nt, 0], acc[nt, 1], acc[nt, 2], acc[nt, 3])
            for i in static_range(4):
                acc[nt, i] = d[i]

    @cuda.jit
    @unroll
    def kernel(x, out, n):
        a = cuda.local.array(4, uint32)
        b = cuda.local.array(2, uint32)
        acc = cuda.local.array((2, 4), float32)
        for i in static_range(4):
            a[i] = uint32(x[i])
        for nt in static_range(2):
            b[nt] = uint32(x[4 + nt])
            for i in static_range(4):
                acc[nt, i] = float32(0)
        for j in range(n):  # a loop, branches, a name assigned in several blocks
            accumulate(acc, a, b)
            if j % 2:
                a[0] += uint32(1)
        total = float32(0)
        for nt in static_range(2):
            for i in static_range(4):
                total += acc[nt, i]
        out[cuda.threadIdx.x] = total

    cuda.compile_ptx(kernel.py_func, "void(int32[::1], float32[::1], int32)", cc=(9, 0))
    assert len(lowered) >= 2 and sum(lowered) > 20, lowered
    print(f"compile: checked {len(lowered)} functions lowered")


def _guard():
    from numba.cuda import lowering

    from nbflash import _compile_speed

    assert _compile_speed.applied(), _compile_speed._state["reason"]
    assert lowering.Lower._find_singly_assigned_variable is _compile_speed.find_singly_assigned_variables
    original = _compile_speed.original()
    assert _compile_speed.original_source_sha256(lowering) == _compile_speed.ORIGINAL_SOURCE_SHA256
    off = subprocess.run([sys.executable, "-c", "import nbflash, numba.cuda.lowering as l; from nbflash import "
                          "_compile_speed as c; print(c.applied(), l.Lower._find_singly_assigned_variable.__module__)"],
                         capture_output=True, text=True, env=dict(os.environ, NBFLASH_COMPILE_PATCH="0"))
    assert off.stdout.split() == ["False", "numba.cuda.lowering"], off.stdout + off.stderr
    assert original.__module__ == "numba.cuda.lowering"
    print("guard: guarded")


if __name__ == "__main__":
    _guard()  # first: the others replace numba-cuda's method with their own checks
    _frontend()
    _compile()
