"""nbflash._compile_speed's stand-ins give numba-cuda's own results.

The checks run in a child process without Numba's simulator (the simulator has no compiler), one
process for all (importing Numba's compiler takes seconds), and need no GPU:

- the singly-assigned-variable scan: numba-cuda's ``Lower._find_singly_assigned_variable`` and
  ``find_singly_assigned_variables`` run on the same IR must set the same attributes. The IR is
  that of nbflash's own unrolled tensor-core forward and its device functions as Numba's front end
  makes it and after SSA reconstruction, plus small functions with the cases the scan tells apart (a name assigned twice in a block, in two blocks,
  used in another block, a generator);
- the element lowerings: for random C-contiguous arrays (dtypes, 1-4 dims, shapes) and constant
  indices (negative ones too), numba-cuda's generic ``getitem`` / ``setitem`` lowering and nbflash's
  are compiled side by side into one LLVM module, run on the CPU by llvmlite's JIT on the same
  arrays, and must read the same element and leave the same array;
- the config hash and equality: for compile flags with options unset, set to other values and set
  explicitly to their defaults, and configs of another class with the same options, the stand-ins
  give numba-cuda's hash and equality for every pair;
- where NVVM is installed: a small unrolled tensor-core kernel compiled with the stand-ins (the
  scan checked against numba-cuda's inside it, on every function lowered) and without them must
  give the same PTX;
- the guard: installed over the checked numba-cuda only, and NBFLASH_COMPILE_PATCH=0 keeps
  numba-cuda's own code.
"""

import os
import re
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


def test_variable_scan_matches_numba_cuda_on_kernel_ir(child):
    assert "front end: checked" in child


def test_element_access_matches_numba_cuda_on_the_cpu(child):
    assert "element access: checked" in child


def test_config_identity_matches_numba_cuda(child):
    assert "config identity: checked" in child


def test_compile_gives_the_same_ptx(child):
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
    _compile_speed.original("singly assigned variables")(theirs)
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

    # the causal forward at head dim 32 (the backward's IR is larger: numba-cuda's scan alone takes
    # seconds on it, more than this test may)
    configs = configurations(["float16"], [32], ["mma"], (9, 0), variants=(Variant(window=True),))
    kernel = registry.build(next(c for c in configs if type(c).__name__ == "MmaForwardConfig")).py_func
    functions = list(_cases()) + [kernel] + [value.py_func for value in kernel.__globals__.values()
                                             if type(value).__name__ == "CUDADispatcher"]
    checked = found = 0
    for fn in functions:
        func_ir = run_frontend(fn, emit_dels=True)
        found += _compare(func_ir, f"{fn.__qualname__} (front end)")
        if not func_ir.func_id.is_generator:
            found += _compare(reconstruct_ssa(run_frontend(fn, emit_dels=False)), f"{fn.__qualname__} (SSA)")
        checked += 1
    assert checked > 8 and found > 1000, (checked, found)
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
    from numba import cuda, float32, uint32
    from numba.cuda import lowering

    from nbflash.prebuild import pretend_gpu
    from nbflash.primitives import inline_device, mma_f16, static_range, unroll

    pretend_gpu((9, 0))
    lowered = []
    scan = _compile_speed.original("singly assigned variables")

    def both(lower):  # numba-cuda's scan, then ours on the same lowerer: the same sets
        scan(lower)
        theirs = lower._singly_assigned_vars
        _compile_speed.find_singly_assigned_variables(lower)
        assert lower._singly_assigned_vars == theirs, lower.fndesc.qualname
        lowered.append(len(theirs))

    def build():
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
                    a[-1] += uint32(1)
            total = float32(0)
            for nt in static_range(2):
                for i in static_range(4):
                    total += acc[nt, i]
            out[cuda.threadIdx.x] = total + acc[1, -2]

        ptx, _ = cuda.compile_ptx(kernel.py_func, "void(int32[::1], float32[::1], int32)", cc=(9, 0))
        ptx = "".join(line for line in ptx.splitlines(True) if "NumbaEnv" not in line)
        return re.sub(r"B\d+v\d+B", "BvB", ptx)  # the tag in the mangled name numbers each definition

    installed = lowering.Lower._find_singly_assigned_variable, lowering.Lower.lower_expr, lowering.Lower.lower_inst
    try:
        lowering.Lower._find_singly_assigned_variable = both
        with_ours = build()
        lowering.Lower.lower_expr, lowering.Lower.lower_inst = _compile_speed.original("constant-index element access")
        lowering.Lower._find_singly_assigned_variable = scan
        without = build()
    finally:
        lowering.Lower._find_singly_assigned_variable, lowering.Lower.lower_expr, lowering.Lower.lower_inst = installed
    assert len(lowered) >= 2 and sum(lowered) > 20, lowered
    assert with_ours == without
    print(f"compile: checked {len(lowered)} functions lowered, the same PTX")


def _element_access():
    import ctypes
    import operator
    import random

    import numpy as np
    from llvmlite import binding as llvm
    from llvmlite import ir as llvm_ir
    from numba.cuda import types
    from numba.cuda.descriptor import cuda_target
    from numba.cuda.np import arrayobj

    from nbflash import _compile_speed

    context = cuda_target.target_context
    context.refresh()
    typing_context = context.typing_context
    dtypes = {types.float32: np.float32, types.float64: np.float64, types.int32: np.int32, types.uint32: np.uint32}

    class Library:  # where the generic lowering would add linking libraries (it adds none)
        def add_linking_library(self, library):
            raise AssertionError(library)

    def generic(builder, op, aryty, ary, index, *value):  # numba-cuda's Lower.lower_getitem / lower_setitem
        idxty = types.UniTuple(types.intp, len(index)) if len(index) > 1 else types.intp
        fnop = typing_context.resolve_value_type(op)
        callsig = fnop.get_call_type(typing_context, (aryty, idxty) + (aryty.dtype,) * len(value), {})
        constant = context.get_constant_generic(builder, idxty, index if len(index) > 1 else index[0])
        result = context.get_function(fnop, callsig)(builder, (ary, constant, *value))
        return context.cast(builder, result, callsig.return_type, aryty.dtype) if not value else None

    rng = random.Random(14)
    module, cases = llvm_ir.Module("element_access"), []
    with context.push_code_library(Library()):
        for n in range(40):
            aryty = types.Array(rng.choice(list(dtypes)), rng.randint(1, 4), "C")
            index = tuple(rng.randint(-3, 3) for _ in range(aryty.ndim))
            array, value = context.get_value_type(aryty).as_pointer(), context.get_value_type(aryty.dtype)
            for kind in ("get generic", "get ours", "set generic", "set ours"):
                args = [array] + ([value] if kind.startswith("set") else [])
                fn = llvm_ir.Function(module, llvm_ir.FunctionType(value if kind.startswith("get") else llvm_ir.VoidType(),
                                                                   args), f"{kind.replace(' ', '_')}_{n}")
                builder = llvm_ir.IRBuilder(fn.append_basic_block())
                ary = builder.load(fn.args[0])
                if kind == "get generic":
                    builder.ret(generic(builder, operator.getitem, aryty, ary, index))
                elif kind == "get ours":
                    pointer = _compile_speed._element_pointer(context, builder, aryty, ary, index)
                    builder.ret(arrayobj.load_item(context, builder, aryty, pointer))
                elif kind == "set generic":
                    generic(builder, operator.setitem, aryty, ary, index, fn.args[1])
                    builder.ret_void()
                else:
                    pointer = _compile_speed._element_pointer(context, builder, aryty, ary, index)
                    arrayobj.store_item(context, builder, aryty, fn.args[1], pointer)
                    builder.ret_void()
            cases.append((aryty, index, n))
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    compiled = llvm.parse_assembly(str(module))
    compiled.verify()
    engine = llvm.create_mcjit_compiler(compiled, llvm.Target.from_default_triple().create_target_machine())
    engine.finalize_object()
    checked = 0
    for aryty, index, n in cases:
        element = np.ctypeslib.as_ctypes_type(np.dtype(dtypes[aryty.dtype]))
        dims = ctypes.c_int64 * aryty.ndim

        class Array(ctypes.Structure):  # Numba's array structure: meminfo, parent, nitems, itemsize, data, shape, strides
            _fields_ = [("meminfo", ctypes.c_void_p), ("parent", ctypes.c_void_p), ("nitems", ctypes.c_int64),
                        ("itemsize", ctypes.c_int64), ("data", ctypes.c_void_p), ("shape", dims), ("strides", dims)]

        get = {kind: ctypes.CFUNCTYPE(element, ctypes.POINTER(Array))(engine.get_function_address(f"get_{kind}_{n}"))
               for kind in ("generic", "ours")}
        put = {kind: ctypes.CFUNCTYPE(None, ctypes.POINTER(Array), element)(engine.get_function_address(f"set_{kind}_{n}"))
               for kind in ("generic", "ours")}
        for trial in range(3):
            shape = tuple(rng.randint(max(i + 1, -i), 6) for i in index)
            x = (np.random.default_rng(trial).random(shape) * 100).astype(dtypes[aryty.dtype])
            view = Array(None, None, x.size, x.itemsize, x.ctypes.data, dims(*shape), dims(*x.strides))
            assert get["generic"](ctypes.byref(view)) == get["ours"](ctypes.byref(view)) == x[index], (aryty, index, shape)
            written = []
            for kind in ("generic", "ours"):
                y = x.copy()
                view.data = y.ctypes.data
                put[kind](ctypes.byref(view), element(7))
                written.append(y)
            expected = x.copy()
            expected[index] = 7
            assert (written[0] == expected).all() and (written[1] == expected).all(), (aryty, index, shape)
            checked += 1
    print(f"element access: checked {checked} arrays")


def _config_identity():
    from numba.cuda.core.targetconfig import Option, TargetConfig
    from numba.cuda.flags import Flags

    from nbflash import _compile_speed

    their_hash, their_eq = _compile_speed.original("config hash and equality")
    our_eq = _compile_speed._config_eq(their_eq)

    class Other(TargetConfig):  # another class, the same option names as Flags
        locals().update({name: Option(type=option.type, default=option.default, doc="")
                         for name, option in Flags.options.items()})

    configs = []
    for cls in (Flags, Other):
        configs.append(cls())  # nothing set
        explicit = cls()
        explicit.boundscheck = cls.options["boundscheck"].default  # set, to the default
        configs.append(explicit)
        changed = cls()
        changed.debuginfo, changed.boundscheck = True, True
        configs.append(changed)
        same = cls()
        same.debuginfo, same.boundscheck = True, True  # another object, the same values
        configs.append(same)
        configs.append(changed.copy())
        partial = cls()
        partial.debuginfo = True  # one of changed's two values
        configs.append(partial)
    pairs = 0
    for a in configs:
        assert _compile_speed.config_hash(a) == their_hash(a)
        for b in configs + [None, 3]:
            assert our_eq(a, b) == their_eq(a, b), (a, b)
            pairs += 1
    print(f"config identity: checked {pairs} pairs")


def _guard():
    from numba.cuda import lowering
    from numba.cuda.core.targetconfig import TargetConfig

    from nbflash import _compile_speed

    assert _compile_speed.applied(), _compile_speed._state["reason"]
    assert TargetConfig.__hash__ is _compile_speed.config_hash
    assert lowering.Lower._find_singly_assigned_variable is _compile_speed.find_singly_assigned_variables
    assert lowering.Lower.lower_expr.__wrapped__ is _compile_speed.original("constant-index element access")[0]
    code = ("import nbflash, numba.cuda.lowering as l; from nbflash import _compile_speed as c; "
            "print(c.applied(), l.Lower._find_singly_assigned_variable.__module__, hasattr(l.Lower.lower_expr, '__wrapped__'))")
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, NBFLASH_COMPILE_PATCH="0"))
    assert off.stdout.split() == ["False", "numba.cuda.lowering", "False"], off.stdout + off.stderr
    print("guard: guarded")


if __name__ == "__main__":
    _guard()
    _config_identity()
    _frontend()
    _element_access()
    _compile()
