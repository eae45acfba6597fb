"""Where the cold compile of a kernel configuration spends its time, stage by stage.

    python scripts/compile_time.py [--cc 9.0] [--kernels forward dkdv dq] [--repeat 3] [--ptx-dir DIR]

Each kernel is built and compiled in a fresh process with an empty kernel cache (a cold compile:
nothing of Numba's in-memory state carried over), for the float16 causal configuration of
``--headdim`` (default 128) that ``nbflash.prebuild`` would build. With ``--cc`` the compile is
offline, no GPU needed: Numba -> PTX -> ``ptxas`` (the path ``python -m nbflash prebuild`` takes);
without it, on a GPU, the path a first call takes (Numba's compile, then its linker for the cubin).
On a GPU, ``call-forward`` and ``call-backward`` time a process's first ``flash_attn_func`` or
``flash_attn_backward`` call itself (float16 causal, (1, 1024, 4, headdim)): every kernel it
compiles, loads and runs.

Stages (each time exclusive of the stages nested inside it: the device functions a kernel calls are
compiled from inside its type inference, and their own passes count in their own stages):

- build:       ``registry.build(config)``: the @unroll AST expansion, the dispatchers;
- front end:   Numba's passes before typing (bytecode to IR, untyped rewrites, SSA, ...);
- typing:      type inference (``*TypeInference`` passes);
- lowering:    Numba IR to LLVM IR (``*NativeLowering``), of which ``sav scan`` is the singly
               assigned variable scan nbflash._compile_speed replaces;
- passes:      the other typed passes (rewrites, backend, library creation);
- IR text:     LLVM IR modules to text and numba-cuda's textual fix-ups of it, before NVVM;
- NVVM:        NVVM's compile of the LLVM IR to PTX;
- ptxas:       PTX to cubin (``ptxas`` offline, Numba's linker on a GPU);
- rest:        whatever else the compile call spent (Numba's dispatch, caching of typed results).

Wall seconds per stage and in all, the range over ``--repeat`` runs, and the CPU seconds of the
process and its ptxas (steadier than wall time on a machine other work shares).

NBFLASH_COMPILE_PATCH=0 in the environment turns nbflash's compile-speed patches off
(nbflash/_compile_speed.py), for a before/after. ``--ptx-dir`` writes each kernel's PTX there
(``<kernel>.ptx``, with the NumbaEnv lines, whose names are not deterministic, removed) and
ptxas's register and spill report (``<kernel>.ptxas``) when compiling offline.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
KERNELS = ("forward", "forward_sm90", "dkdv", "dkdv_det", "dq")
CALLS = ("call-forward", "call-backward")  # on a GPU: a public call's first run, every kernel it compiles
STAGES = ("build", "front end", "typing", "lowering", "sav scan", "passes", "IR text", "NVVM", "ptxas", "rest")


def _config(kernel, headdim, cc):
    """The float16 causal config of ``kernel`` that prebuild builds for ``cc``."""
    from nbflash.prebuild import configurations
    from nbflash.problem import Variant

    configs = configurations(["float16"], [headdim], ["mma"], cc, variants=(Variant(window=True),))
    for config in configs:
        name = type(config).__name__
        if (kernel, name) in (("forward", "MmaForwardConfig"), ("forward_sm90", "Sm90ForwardConfig")):
            return config
        if name == "MmaBackwardConfig" and kernel.startswith(config.kernel):
            if config.kernel == "dq" or config.atomic_dq == (kernel == "dkdv"):
                return config
    raise SystemExit(f"no {kernel} config among {configs}")


class StageClock:
    """Exclusive wall time per stage: entering a nested stage pauses the enclosing one."""

    def __init__(self):
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.detail = {}  # the same, per compiler pass (and per wrapped function): "stage: name"
        self.stack = [("rest", "rest")]
        self.mark = time.perf_counter()

    def _switch(self):
        now = time.perf_counter()
        stage, detail = self.stack[-1]
        self.seconds[stage] += now - self.mark
        self.detail[detail] = self.detail.get(detail, 0.0) + now - self.mark
        self.mark = now

    def timed(self, stage, fn, stage_of=None):
        """``fn`` wrapped so that its time counts in ``stage`` (or in ``stage_of(*args)``, and then
        in the detail of the pass ``args[2]``)."""

        def wrapper(*args, **kwargs):
            self._switch()
            where = stage_of(*args) if stage_of else stage
            name = type(args[2]).__name__ if stage_of else fn.__qualname__
            self.stack.append((where, f"{where}: {name}"))
            try:
                return fn(*args, **kwargs)
            finally:
                self._switch()
                self.stack.pop()

        wrapper.__wrapped__ = fn
        return wrapper


def _instrument(clock):
    """Wrap Numba's compiler so that ``clock`` sees its stages."""
    from numba.cuda import codegen, lowering
    from numba.cuda.core import compiler_machinery
    from numba.cuda.cudadrv import nvvm

    manager = compiler_machinery.PassManager
    typed = {}  # the compiler states (one per function compiled) whose type inference has begun, by id

    def stage_of(manager, index, pss, state):
        name = type(pss).__name__
        if "TypeInference" in name:
            typed[id(state)] = state  # held, so that its id is not reused
            return "typing"
        if "NativeLowering" in name:
            return "lowering"
        return "passes" if id(state) in typed else "front end"

    manager._runPass = clock.timed(None, manager._runPass, stage_of)
    lowering.Lower._find_singly_assigned_variable = clock.timed("sav scan",
                                                               lowering.Lower._find_singly_assigned_variable)
    library = codegen.CUDACodeLibrary
    library.llvm_strs = property(clock.timed("IR text", library.llvm_strs.fget))
    nvvm.llvm_replace = clock.timed("IR text", nvvm.llvm_replace)
    nvvm.CompilationUnit.compile = clock.timed("NVVM", nvvm.CompilationUnit.compile)
    nvvm.CompilationUnit.verify = clock.timed("NVVM", nvvm.CompilationUnit.verify)
    nvvm.CompilationUnit.add_module = clock.timed("NVVM", nvvm.CompilationUnit.add_module)
    library.get_cubin = clock.timed("ptxas", library.get_cubin)


def measure(kernel, headdim, cc, ptx_dir):
    """One cold compile in this process: {stage: seconds, "total": seconds, ...}."""
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    sys.path.insert(0, ROOT)
    from nbflash import _compile_speed, configs
    from nbflash.kernels import registry

    if cc:
        from nbflash.prebuild import pretend_gpu

        pretend_gpu(cc)
        configs._compute_capability = lambda device=0: cc
    else:
        from numba import cuda

        cc = tuple(cuda.get_current_device().compute_capability)
    clock = StageClock()
    _instrument(clock)
    if kernel in CALLS:
        return _first_call(kernel, headdim, clock)
    config = _config(kernel, headdim, cc)
    signature = registry.signature(config)
    from numba import cuda

    cpu_start = _cpu_seconds()
    start = clock.mark = time.perf_counter()
    kernel_fn = clock.timed("build", registry.build)(config)
    report = ""
    if os.environ.get("NBFLASH_COMPILE_TIME_GPU") == "1":  # the first call's path, on a GPU
        overload = kernel_fn.compile(signature)
        overload._codelibrary.get_cubin()
        ptx = overload._codelibrary.get_asm_str() if ptx_dir else ""
    else:  # as nbflash.prebuild compiles it: an arch-specific kernel for its suffixed target
        suffix = getattr(config, "arch_suffix", "")
        options = {"launch_bounds": config.launch_bounds} if hasattr(config, "launch_bounds") else {}
        ptx, _ = cuda.compile_ptx(kernel_fn.py_func, signature, cc=(*cc, suffix) if suffix else cc, **options)
        report = clock.timed("ptxas", _ptxas)(ptx)
    clock._switch()
    total = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu_start
    if ptx_dir:
        os.makedirs(ptx_dir, exist_ok=True)
        with open(os.path.join(ptx_dir, f"{kernel}.ptx"), "w") as f:
            f.write(strip_env(ptx))
        if report:
            with open(os.path.join(ptx_dir, f"{kernel}.ptxas"), "w") as f:  # less its own compile time
                f.write("".join(line for line in report.splitlines(True) if "Compile time" not in line))
    result = dict(clock.seconds, total=total, cpu=cpu, patched=_compile_speed.applied(), detail=clock.detail)
    result["registers"] = _registers(report)
    return result


def _first_call(kernel, headdim, clock):
    """The first ``flash_attn_func`` (or ``flash_attn_backward``) call of a process, float16 causal,
    (1, 1024, 4, headdim), with an empty kernel cache: every kernel it compiles, loads and runs."""
    import cupy

    import nbflash
    from nbflash import _compile_speed
    from nbflash.kernels import registry

    registry.build = clock.timed("build", registry.build)  # launch.py calls it through the module
    shape = (1, 1024, 4, headdim)
    q, k, v, dout = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    out = cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    lse = cupy.random.standard_normal((1, 4, 1024), dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    cpu_start = _cpu_seconds()
    start = clock.mark = time.perf_counter()
    if kernel == "call-forward":
        nbflash.flash_attn_func(q, k, v, causal=True)
    else:
        nbflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    cupy.cuda.Device().synchronize()
    clock._switch()
    total = time.perf_counter() - start
    return dict(clock.seconds, total=total, cpu=_cpu_seconds() - cpu_start, patched=_compile_speed.applied(),
                detail=clock.detail, registers="")


def _cpu_seconds():
    """CPU time of this process and its finished children (ptxas): on a shared machine, steadier
    than wall time."""
    import resource

    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def strip_env(ptx):
    """The PTX without its ``.common .global`` NumbaEnv lines (names that differ run to run)."""
    return "".join(line for line in ptx.splitlines(True) if not (".common .global" in line and "NumbaEnv" in line))


def canonical_registers(ptx):
    """``ptx`` with its virtual registers renamed in order of first appearance (%rd1942 -> %rd<k>):
    two PTX files that are equal after this differ only in register names."""
    names = {}

    def rename(match):
        kind = match[1]
        return names.setdefault(match[0], f"%{kind}<{sum(name.startswith('%' + kind + '<') for name in names.values())}>")

    return re.sub(r"%(rd|rs|r|fd|f|p|hh|h|b)(\d+)\b", rename, ptx)


def compare(before, after):
    """Each kernel's PTX in folder ``before`` against ``after``: identical, identical up to register
    names, or different (with the first differing line); and their ptxas reports."""
    for name in sorted(f for f in os.listdir(before) if f.endswith(".ptx")):
        old, new = (open(os.path.join(d, name)).read() for d in (before, after))
        if old == new:
            verdict = "identical"
        elif canonical_registers(old) == canonical_registers(new):
            verdict = "identical up to virtual register names"
        else:
            lines = [i for i, (a, b) in enumerate(zip(old.splitlines(), new.splitlines())) if a != b]
            verdict = f"different (first at line {lines[0] + 1 if lines else '?'})"
        report = name[:-4] + ".ptxas"
        if all(os.path.exists(os.path.join(d, report)) for d in (before, after)):
            same = open(os.path.join(before, report)).read() == open(os.path.join(after, report)).read()
            verdict += "; ptxas report " + ("identical" if same else "differs")
        print(f"{name[:-4]}: {verdict}")


def _ptxas(ptx):
    """ptxas -v on ``ptx``, for its ``.target``: its report (registers, spills)."""
    from nbflash.prebuild import cuda_tool

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        arch = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M)[1]
        done = subprocess.run([cuda_tool("ptxas"), f"-arch={arch}", "-v", path, "-o",
                               os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ptxas failed: {done.stderr.strip()}")
    return done.stderr


def _registers(report):
    match = re.search(r"Used (\d+) registers", report or "")
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report or "")
    if not match:
        return ""
    return f"{match[1]} regs" + (f", spills {spills[1]}/{spills[2]} B" if spills else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cc", help="compile offline for this compute capability, e.g. 9.0 (no GPU needed)")
    p.add_argument("--kernels", nargs="+", default=["forward"], choices=KERNELS + CALLS,
                   help="forward (tensor-core, mma.sync); forward_sm90 (wgmma: the default for this "
                   "config on compute capability 9.0); dkdv (the default backward's, atomic dQ); dkdv_det and dq (deterministic); "
                   "on a GPU also call-forward and call-backward: a first public call, all the kernels it compiles")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--repeat", type=int, default=1, help="cold compiles per kernel; the table shows medians")
    p.add_argument("--ptx-dir", help="write each kernel's PTX (and ptxas -v report) here")
    p.add_argument("--json", help="also write every run's figures to this file")
    p.add_argument("--passes", type=int, default=0, metavar="N",
                   help="also print the N compiler passes (and wrapped functions) that took longest")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="compare two --ptx-dir folders (PTX and ptxas reports) instead of compiling")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one kernel in this process
    args = p.parse_args(argv)
    if args.compare:
        compare(*args.compare)
        return 0
    cc = tuple(int(x) for x in args.cc.split(".")) if args.cc else None
    if args.one:
        if not cc:
            os.environ["NBFLASH_COMPILE_TIME_GPU"] = "1"
        print(json.dumps(measure(args.one, args.headdim, cc, args.ptx_dir)))
        return 0
    runs = {}
    for kernel in args.kernels:
        for attempt in range(args.repeat):
            command = [sys.executable, os.path.abspath(__file__), "--one", kernel, "--headdim", str(args.headdim)]
            command += ["--cc", args.cc] if args.cc else []
            command += ["--ptx-dir", args.ptx_dir] if args.ptx_dir and attempt == 0 else []
            with tempfile.TemporaryDirectory() as cache:  # an empty kernel cache: a cold first call
                done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, NBFLASH_CACHE_DIR=cache))
            if done.returncode:
                sys.exit(f"{kernel}: {done.stderr.strip()}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs.setdefault(kernel, []).append(result)
            print(f"{kernel} run {attempt + 1}: {result['total']:.1f} s", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    patched = {r["patched"] for results in runs.values() for r in results}
    where = f"offline for sm_{cc[0]}{cc[1]}" if cc else "on the GPU (first-call path)"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\ncold compile, float16 causal headdim {args.headdim}, {where}; patch "
          f"{'/'.join(sorted(map(str, patched)))}; medians of {args.repeat}; {os.cpu_count()} CPUs, load {load:.1f}")
    shown = [s for s in STAGES if any(r[s] > 0.005 for results in runs.values() for r in results)]
    print(f"{'kernel':14}" + "".join(f"{s:>10}" for s in shown) + f"{'total':>10}  {'min-max':>11}{'cpu':>8}  ptxas")
    for kernel, results in runs.items():
        cells = "".join(f"{statistics.median(r[s] for r in results):10.2f}" for s in shown)
        totals = [r["total"] for r in results]
        cpu = statistics.median(r["cpu"] for r in results)
        print(f"{kernel:14}{cells}{statistics.median(totals):10.2f}  {min(totals):5.1f}-{max(totals):<5.1f}{cpu:8.1f}"
              f"  {results[0]['registers']}")
    for kernel, results in runs.items() if args.passes else ():
        names = {name for r in results for name in r["detail"]}
        medians = {name: statistics.median(r["detail"].get(name, 0.0) for r in results) for name in names}
        top = sorted(medians.items(), key=lambda item: -item[1])[:args.passes]
        print(f"{kernel}: " + ", ".join(f"{name} {seconds:.2f}" for name, seconds in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
