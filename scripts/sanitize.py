"""compute-sanitizer over every kernel family, on awkward shapes.

    python scripts/sanitize.py                         # every tool on every case; a table last
    python scripts/sanitize.py --tools memcheck racecheck --cases forward decode
    python scripts/sanitize.py --case decode           # one case, without a sanitizer (a check)

Each case is a few nbflash calls on shapes that end in partial tiles: lengths one past and one
short of a tile, GQA, rows that see no key, zero-length sequences, pages that split a tile, the
split-KV combine; the variants that read more than q, k and v (dropout's generator, bias and mask
tensors through their strides, a user's score_mod); the Hopper forward and backward. For each tool and case this script starts itself again under
``compute-sanitizer --tool TOOL`` and reads the sanitizer's error summary. Every case first runs
once without a sanitizer, which checks its results against the float64 reference and fills the
on-disk kernel cache, so the sanitized runs load their kernels the way a user's second process
does (from cubins, through the driver), not through Numba. Those unsanitized runs go first, several
at once (``--warm-jobs``): on a cold cache they are mostly compiling, and one after another they
once took the whole of a 560-second limit before any sanitizer ran. Each row of the table is printed
as it comes, so a run stopped by a limit still says what it found.

The ``planted`` case launches a kernel that writes one element past its array, loaded and
launched through nbflash's own path (``nbflash.launch.compiled``): memcheck must report it, which
shows the sanitizer sees kernels loaded that way; the table says whether it did.

``--report-api-errors no``: Numba's driver start-up probes optional entry points, and the sanitizer
would report each missing one as an API error. Needs a GPU and compute-sanitizer on the PATH (or
``--sanitizer PATH``); the simulator can run ``--case`` alone.
"""

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
ERROR_EXIT = 17  # --error-exitcode: tells "the sanitizer found errors" from a failed case


def _backend():
    import nbflash.runtime as runtime

    return np if runtime.SIMULATOR else runtime.cupy()


def _draw(rng, shape, dtype):
    from nbflash.dtypes import BFLOAT16

    xp = _backend()
    x = rng.standard_normal(shape).astype(np.float32)
    return xp.asarray(x.astype(BFLOAT16 if dtype == "bfloat16" else dtype))


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _close(got, want, what, atol):
    got = _host(got).astype(np.float64)
    if not np.isfinite(got).all():
        raise AssertionError(f"{what}: non-finite values")
    error = float(np.abs(got - want).max()) if got.size else 0.0
    if error > atol:
        raise AssertionError(f"{what}: max error {error:.3g} > {atol}")


TOLERANCE = {"float16": 2e-2, "bfloat16": 8e-2, "float32": 1e-4}


def _dense(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, family, backward, **variant):
    """One forward (and backward) against the float64 reference, on kernel family ``family`` (None:
    the library's own choice). A ``block_mask`` goes to the kernels only (the reference takes its
    mask_mod), a ``score_mod_grad`` to the backward and the references only."""
    import nbflash

    q = _draw(rng, (batch, seqlen_q, nheads, headdim), dtype)
    k = _draw(rng, (batch, seqlen_k, nheads_k, headdim), dtype)
    v = _draw(rng, (batch, seqlen_k, nheads_k, headdim), dtype)
    # The reference runs on the host: a bias or mask tensor (or slopes) goes to it as a NumPy copy.
    reference = {name: _host(value) if hasattr(value, "get") else value
                 for name, value in variant.items() if name != "block_mask"}
    forward = {name: value for name, value in variant.items() if name != "score_mod_grad"}
    with nbflash.kernel_family(family) if family else contextlib.nullcontext():
        out, lse = nbflash.flash_attn_func(q, k, v, return_lse=True, **forward)
        ref_out, _ = nbflash.attention_reference(_host(q), _host(k), _host(v), return_lse=True, **reference)
        _close(out, ref_out, f"{family} forward {dtype}", TOLERANCE[dtype])
        if backward:
            dout = _draw(rng, out.shape, dtype)
            for deterministic in (False, True):
                grads = nbflash.flash_attn_backward(dout, q, k, v, out, lse, deterministic=deterministic, **variant)
                want = nbflash.attention_reference_backward(_host(dout), _host(q), _host(k), _host(v), **reference)
                for name, got, ref in zip("qkv", grads, want):
                    scale = max(1.0, float(np.abs(ref).max()))
                    _close(got, ref, f"{family} d{name} {dtype} deterministic={deterministic}",
                           4 * TOLERANCE[dtype] * scale)


def case_forward(rng, small):
    n = (13, 29) if small else (77, 130)
    _dense(rng, "float16", 2, n[0], n[1], 4, 2, 64, "mma", False)
    _dense(rng, "bfloat16", 1, n[1], n[1], 2, 1, 40, "mma", False, causal=True)
    _dense(rng, "float32", 2, n[0], n[1], 2, 2, 24, "portable", False, causal=True)


def case_backward(rng, small):
    n = (13, 29) if small else (65, 127)
    _dense(rng, "float16", 2, n[0], n[1], 4, 2, 64, "mma", True, causal=True)
    _dense(rng, "float32", 1, n[1], n[0], 2, 1, 40, "portable", True)


def case_rows_without_keys(rng, small):
    # seqlen_q > seqlen_k, causal: the first rows see no key (output 0, lse -inf); and a window.
    n = (21, 9) if small else (150, 61)
    for family in ("mma", "portable"):
        _dense(rng, "float16", 1, n[0], n[1], 2, 1, 32, family, True, causal=True)
        _dense(rng, "float16", 1, n[0], n[1], 2, 2, 32, family, False, window_size=(3, 0))


def case_varlen(rng, small):
    import nbflash

    xp = _backend()
    lengths = [5, 0, 17] if small else [65, 0, 1, 200, 127]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, nheads, headdim = int(cu[-1]), 2, 64
    q, k, v = (_draw(rng, (total, nheads, headdim), "float16") for _ in range(3))
    cu_d = xp.asarray(cu)
    out, lse = nbflash.flash_attn_varlen_func(q, k, v, cu_d, cu_d, max(lengths), max(lengths), causal=True,
                                              return_lse=True)
    ref = nbflash.attention_varlen_reference(_host(q), _host(k), _host(v), cu, cu, causal=True)
    _close(out, ref[0] if isinstance(ref, tuple) else ref, "varlen forward", TOLERANCE["float16"])
    dout = _draw(rng, out.shape, "float16")
    # the library's choice, then the Hopper dK/dV kernel where this nbflash and the GPU have it (its
    # TMA tiles cross the sequences' ends)
    import nbflash.configs as configs

    for family in (None, "sm90") if "sm90" in configs.FAMILIES else (None,):
        with nbflash.kernel_family(family) if family else contextlib.nullcontext():
            grads = nbflash.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_d, cu_d, max(lengths),
                                                       max(lengths), causal=True)
        for g in grads:
            if not np.isfinite(_host(g).astype(np.float32)).all():
                raise AssertionError(f"varlen backward ({family or 'default'}): non-finite gradient")


def case_decode(rng, small):
    """Decode against contiguous and paged caches, with an append, rotary and several splits (so
    the combine runs), and merge_attention_states."""
    import nbflash
    from nbflash.reference import attention_kvcache_reference

    xp = _backend()
    batch, nheads, nheads_k, headdim = 2, 8, 2, 64
    capacity = 40 if small else 300
    lengths = [capacity - 3, 7]
    for page_size in (None, 16, 3):
        q = _draw(rng, (batch, 1, nheads, headdim), "float16")
        k_new = _draw(rng, (batch, 1, nheads_k, headdim), "float16")
        v_new = _draw(rng, (batch, 1, nheads_k, headdim), "float16")
        per_seq = -(-capacity // (page_size or capacity))
        positions = per_seq * (page_size or capacity)  # the cache's capacity: one rotary row each
        cos = xp.asarray(np.cos(rng.uniform(0, 6, (positions, 16))).astype(np.float16))
        sin = xp.asarray(np.sin(rng.uniform(0, 6, (positions, 16))).astype(np.float16))
        args = {}
        if page_size is None:
            k_cache = _draw(rng, (batch, capacity, nheads_k, headdim), "float16")
            v_cache = _draw(rng, (batch, capacity, nheads_k, headdim), "float16")
        else:
            k_cache = _draw(rng, (batch * per_seq, page_size, nheads_k, headdim), "float16")
            v_cache = _draw(rng, (batch * per_seq, page_size, nheads_k, headdim), "float16")
            table = rng.permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int32)
            args["block_table"] = xp.asarray(table)
        seqlens = xp.asarray(np.array(lengths, np.int32))
        host_args = {name: _host(x) for name, x in args.items()}
        ref_out, _, _, _ = attention_kvcache_reference(
            _host(q), _host(k_cache).copy(), _host(v_cache).copy(), k=_host(k_new), v=_host(v_new),
            rotary_cos=_host(cos), rotary_sin=_host(sin), cache_seqlens=np.array(lengths, np.int32), causal=True,
            **host_args)
        out = nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens, causal=True,
                                              num_splits=3, **args)
        _close(out, ref_out, f"decode page_size={page_size}", TOLERANCE["float16"])
    out_a, out_b = (_draw(rng, (batch, 3, nheads, headdim), "float16") for _ in range(2))
    lse_a = xp.asarray(rng.standard_normal((batch, nheads, 3)).astype(np.float32))
    lse_b = xp.asarray(rng.standard_normal((batch, nheads, 3)).astype(np.float32))
    nbflash.merge_attention_states(out_a, lse_a, out_b, lse_b)


def _sm90_calls(rng, small, backward):
    """The Hopper family's plain and causal calls (GQA, tails), forward and with ``backward`` the
    backward too; False where this nbflash has no sm90 family."""
    import nbflash.configs as configs

    if "sm90" not in configs.FAMILIES:
        print("no sm90 family in this nbflash: skipped")
        return False
    n = (13, 29) if small else (77, 200)
    _dense(rng, "float16", 2, n[0], n[1], 4, 2, 64, "sm90", backward)
    _dense(rng, "bfloat16", 1, n[1], n[1], 2, 1, 128, "sm90", backward, causal=True)
    return True


def case_sm90(rng, small):
    """The Hopper family's forward, where this nbflash has it and the GPU runs it."""
    _sm90_calls(rng, small, False)


def case_sm90_backward(rng, small):
    """The Hopper family's backward (the dK/dV kernels, and with ``deterministic=True`` the dQ kernel),
    and its forward, on tails, GQA, the window's variants and a block mask whose tables skip whole
    (query tile, key tile) pairs (the producer's warp-wide walks). At headdims up to 64, plain and
    causal calls take the rows split (backward_sm90_rows.py): headdim 64 plain in _sm90_calls, and
    causal at headdim 40 (padded to 64) with more queries than keys (rows that see no key)."""
    import nbflash
    from nbflash.catalogue import document_mask_mod

    if not _sm90_calls(rng, small, True):
        return
    n = (13, 29) if small else (77, 200)
    _dense(rng, "bfloat16", 2, n[1], n[0], 4, 2, 40, "sm90", True, causal=True)
    _dense(rng, "float16", 1, n[1], n[0], 2, 2, 64, "sm90", True, window_size=(n[0] // 2, 3), softcap=20.0,
           alibi_slopes=_backend().asarray(np.array([0.5, 0.25], np.float32)))
    seqlen = 70 if small else 333
    mask_mod = document_mask_mod(seqlen, seqlen)
    block_mask = nbflash.create_block_mask(mask_mod, None, None, seqlen, seqlen)
    _dense(rng, "float16", 1, seqlen, seqlen, 4, 2, 128, "sm90", True, mask_mod=mask_mod, block_mask=block_mask)
    # headdims past 128: backward_sm90_wide.py (the consumers split headdim), and with score
    # features (dS^T made in the hand-over's words)
    _dense(rng, "bfloat16", 1, n[1], n[0], 2, 1, 256, "sm90", True, causal=True)
    _dense(rng, "float16", 1, n[1], n[0], 2, 2, 192, "sm90", True, window_size=(n[0] // 2, 3), softcap=20.0,
           alibi_slopes=_backend().asarray(np.array([0.5, 0.25], np.float32)))


def score_tilt(score, b, h, q_idx, kv_idx):
    """A user score_mod for the variants case (module level: one fingerprint, one compile)."""
    return score + 0.01 * (kv_idx - q_idx) - 0.1 * h


def score_tilt_grad(score, b, h, q_idx, kv_idx):
    return 1.0


def case_variants(rng, small):
    """Dropout, a float32 bias and a boolean mask tensor (broadcast over batch or heads) and a user
    score_mod, forward and backward, on the mma family and on the library's own choice (the Hopper
    kernels where compute capability 9.0 has them): the variants' extra reads (the Philox stream,
    the tensors through their strides, the user's code)."""
    xp = _backend()
    n = (13, 29) if small else (77, 200)
    for family in ("mma", None):
        _dense(rng, "float16", 2, n[0], n[1], 4, 2, 64, family, True, causal=True, dropout_p=0.2, seed=7)
        bias = xp.asarray(rng.standard_normal((2, 1, n[0], n[1])).astype(np.float32))
        _dense(rng, "float16", 2, n[0], n[1], 4, 2, 64, family, True, window_size=(n[1] // 2, 2), bias=bias)
        mask = xp.asarray(rng.random((n[1], n[1])) < 0.7)
        _dense(rng, "bfloat16", 1, n[1], n[1], 2, 1, 128, family, True, bias=mask)
        _dense(rng, "bfloat16", 1, n[1], n[0], 2, 2, 128, family, True, causal=True, score_mod=score_tilt,
               score_mod_grad=score_tilt_grad)


@dataclass(frozen=True)
class PlantedConfig:
    """A kernel that writes one element past the end of its array: memcheck must see it."""

    dtype: str = "float32"
    threads: int = 32
    dynamic_shared_bytes: int = 0


def _build_planted(config):
    from numba import cuda

    @cuda.jit
    def planted(x):
        i = cuda.threadIdx.x
        if i == 0:
            x[x.shape[0]] = 1.0  # one past the end (Numba's boundscheck is off in kernels)

    return planted


def case_planted(rng, small):
    import nbflash.launch as launch
    import nbflash.runtime as runtime
    from nbflash.kernels import registry

    if runtime.SIMULATOR:
        print("planted: needs a GPU (the simulator would raise IndexError)")
        return
    registry.KERNELS.setdefault(PlantedConfig, (_build_planted, lambda config: "void(float32[::1])"))
    x = planted_target(runtime.cupy())
    launch.compiled(PlantedConfig()).launch((1, 1, 1), (x,), ())
    runtime.cupy().cuda.Device().synchronize()


def planted_target(xp):
    """The array the planted kernel writes one past: a whole allocation of its own, so that the
    write lands past the allocation's end. (A view one element short of the allocation, as this
    case first had, puts the write on the allocation's last element: in bounds, and memcheck on the
    H200 rightly reported 0 errors.) Its size, 512 bytes short of 4 MiB, is a multiple of CuPy's
    512-byte rounding (the allocation ends where the array does) but not of the driver's 2 MiB
    pages, so no other allocation can start where the write lands."""
    return xp.zeros((1 << 20) - 128, np.float32)


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def run_case(name, small, seed=0):
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    CASES[name](rng, small)
    import nbflash.runtime as runtime

    if not runtime.SIMULATOR:
        runtime.cupy().cuda.Device().synchronize()
    return time.perf_counter() - start


def _errors(text):
    """The error count of a sanitizer's summary: memcheck, synccheck and initcheck end with
    ``ERROR SUMMARY: N errors``, racecheck with ``RACECHECK SUMMARY: H hazards displayed (E errors,
    W warnings)`` (its warnings count here too: a possible hazard is not a clean run). None when
    there is no summary."""
    match = re.search(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    if match:
        return int(match.group(1)) + int(match.group(2))
    match = re.search(r"ERROR SUMMARY: (\d+) error", text)
    return int(match.group(1)) if match else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), help="run one case (no sanitizer) and exit")
    parser.add_argument("--small", action="store_true", help="the cases at simulator sizes")
    parser.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS), help="sanitizer tools to run")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES), help="cases to run")
    parser.add_argument("--sanitizer", default="compute-sanitizer", help="the compute-sanitizer executable")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per sanitized run")
    parser.add_argument("--warm-timeout", type=float, default=900,
                        help="seconds for each case's unsanitized run, which compiles its kernels on a cold cache")
    parser.add_argument("--warm-jobs", type=int, default=None,
                        help="unsanitized runs at once (default: every case, up to half the CPU cores): on a cold "
                             "cache they compile, and in parallel the compiles take a case's time, not the sum")
    parser.add_argument("--log-dir", default=None, help="write each sanitized run's output here")
    args = parser.parse_args(argv)

    if args.case:
        seconds = run_case(args.case, args.small)
        print(f"case {args.case}: ok in {seconds:.1f} s")
        return 0
    sanitizer = shutil.which(args.sanitizer) or args.sanitizer
    me = [sys.executable, os.path.abspath(__file__)] + (["--small"] if args.small else [])
    rows, failed = [], False
    width = max(len(case) for case in args.cases)

    def row(case, tool, verdict, extra):  # printed as it comes too: a run cut off by its limit still tells
        rows.append((case, tool, verdict, extra))
        print(f"{case:<{width}}  {tool:<13}  {verdict}  ({extra})", flush=True)

    def unsanitized(case):  # compiles the case's kernels on a cold cache: its own, longer limit
        start = time.perf_counter()
        try:
            run = subprocess.run(me + ["--case", case], capture_output=True, text=True, timeout=args.warm_timeout)
        except subprocess.TimeoutExpired:
            return None, f"over --warm-timeout {args.warm_timeout:g} s (compiling on a cold kernel cache?)"
        if run.returncode != 0:
            return False, (run.stderr.strip().splitlines() or ["?"])[-1]
        return True, f"{time.perf_counter() - start:.0f} s"

    # Every case's unsanitized run first, several at once (they check the results and fill the
    # kernel cache; the cache's writes are atomic), then the sanitized runs one at a time.
    jobs = args.warm_jobs or max(1, min(len(args.cases), (os.cpu_count() or 2) // 2))
    warmed = {}
    with ThreadPoolExecutor(jobs) as pool:
        for case, (ok, extra) in zip(args.cases, pool.map(unsanitized, args.cases)):
            warmed[case] = ok
            row(case, "(unsanitized)", {True: "ok", False: "case failed", None: "timed out"}[ok], extra)
            failed |= not ok
    for case in args.cases:
        if not warmed[case]:
            continue
        for tool in args.tools:
            command = [sanitizer, "--tool", tool, "--report-api-errors", "no", "--error-exitcode", str(ERROR_EXIT)]
            if tool == "racecheck":
                command += ["--racecheck-report", "all"]
            start = time.perf_counter()
            try:
                run = subprocess.run(command + me + ["--case", case], capture_output=True, text=True,
                                     timeout=args.timeout)
                text, code = run.stdout + run.stderr, run.returncode
            except subprocess.TimeoutExpired as expired:
                text, code = f"{expired.stdout or ''}{expired.stderr or ''}", None
            if args.log_dir:
                os.makedirs(args.log_dir, exist_ok=True)
                with open(os.path.join(args.log_dir, f"{case}-{tool}.log"), "w") as log:
                    log.write(text if isinstance(text, str) else text.decode(errors="replace"))
            errors = _errors(text) if isinstance(text, str) else None
            expect_errors = case == "planted" and tool == "memcheck"
            if code is None:
                verdict = "timed out"
            elif errors is None:
                verdict = f"no summary (exit {code})"
            elif expect_errors:
                verdict = "reported, as it must" if errors > 0 else "NOT REPORTED: the sanitizer misses our kernels"
            else:
                verdict = "clean" if errors == 0 and code == 0 else f"{errors} errors (exit {code})"
            failed |= verdict not in ("clean", "reported, as it must")
            row(case, tool, verdict, f"{time.perf_counter() - start:.0f} s")
    print(f"{'case':<{width}}  {'tool':<13}  result")
    for case, tool, verdict, extra in rows:
        print(f"{case:<{width}}  {tool:<13}  {verdict}  ({extra})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
