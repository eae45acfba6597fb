"""Check and time variants of the tensor-core forward kernel (nbflash/kernels/forward_mma.py).

Two steps, which can run on different machines:

  build  compile each variant to a cubin (Numba -> PTX -> ptxas -arch=sm_90), in parallel, and record
         registers, spills and the HMMA count. Needs no GPU. Run it where compiling is free, carry the
         folder to the GPU machine:
             python scripts/gpu_mma.py build --cubins DIR [--variants NAME ...]
  run    on a GPU: load each variant's cubin (or compile it there, if none was built or it does not
         load), check it against a float32 reference (PyTorch) at awkward shapes, then time it next
         to PyTorch SDPA's flash backend at headdim 64/128, seqlen 1k-16k, fp16, causal and not:
             python scripts/gpu_mma.py run --cubins DIR --out DIR [--variants NAME ...]

With --around (both steps) the variants are, per headdim, the configuration table's entry
(nbflash/configs.py MMA_FORWARD) and its neighbours: block_m, block_n and num_warps halved and
doubled one at a time, and Q's place toggled. The run then ends with what the search found: per
headdim and causal flag, the entry's mean ratio to SDPA flash against the best neighbour's.

Timing: CUDA events around single launches after warm-up, median of repeats, fresh random inputs.
Shapes follow ANCHORS.md: nheads = 2048 / headdim, batch = 2 * max(1, 16384 / seqlen).
FLOPs: 4 * batch * nheads * seqlen^2 * headdim, halved when causal.

The kernels are launched through CuPy's RawModule with Numba's flattened array arguments (meminfo,
parent, nitems, itemsize, data, shape..., strides...), so several cubins can be loaded and timed
without compiling on the GPU machine.
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from prebuild_cache import cuda_tool, pretend_gpu  # noqa: E402  (scripts/, next to this file)

# Variants are named by their configuration: m<block_m>n<block_n>[s<sub_n>]w<num_warps>, then
# -qsmem / -qreg (Q's fragments re-read from shared memory / kept in registers; default: the
# config's own choice) and -skip (skip_rescale).
VARIANT_NAME = re.compile(r"m(\d+)n(\d+)(?:s(\d+))?w(\d+)(-qsmem|-qreg)?(-skip)?")
DEFAULT_VARIANTS = ["m128n64w8", "m128n32w8", "m128n64s32w8", "m128n64s32w4-qsmem", "m128n32w4-qsmem",
                    "m128n64w4-qsmem"]
MAX_SHARED = 227 * 1024  # what one block may use on the H200


def variant_arguments(name):
    """MmaForwardConfig keyword arguments of a variant name (see VARIANT_NAME)."""
    match = VARIANT_NAME.fullmatch(name)
    if not match:
        raise ValueError(f"variant {name!r} does not read as m<M>n<N>[s<S>]w<W>[-qsmem|-qreg][-skip]")
    block_m, block_n, sub_n, warps, q, skip = match.groups()
    arguments = dict(block_m=int(block_m), block_n=int(block_n), num_warps=int(warps))
    if sub_n:
        arguments["sub_n"] = int(sub_n)
    if q:
        arguments["q_in_registers"] = q == "-qreg"
    if skip:
        arguments["skip_rescale"] = True
    return arguments


def variant_name(block_m, block_n, num_warps, q_in_registers=None):
    q = {None: "", True: "-qreg", False: "-qsmem"}[q_in_registers]
    return f"m{block_m}n{block_n}w{num_warps}{q}"


def around_table(headdim, dtype="float16"):
    """The table's entry for headdim (nbflash/configs.py) first, then its neighbours: block_m,
    block_n and num_warps each halved and doubled, one at a time, and Q's place toggled; only
    configurations the kernel accepts and whose shared memory fits."""
    from nbflash import configs
    from nbflash.kernels.forward_mma import MmaForwardConfig
    from nbflash.problem import Variant

    entry = configs.mma_forward_config(dtype, headdim, Variant(), True)
    m, n, w = entry.block_m, entry.block_n, entry.num_warps
    candidates = [(m, n, w, None)]
    for factor in (0.5, 2):
        candidates += [(int(m * factor), n, w, None), (m, int(n * factor), w, None), (m, n, int(w * factor), None)]
    candidates.append((m, n, w, not entry.use_q_registers))
    names = []
    for block_m, block_n, num_warps, q in candidates:
        try:
            config = MmaForwardConfig(dtype, headdim, Variant(), block_m=block_m, block_n=block_n,
                                      num_warps=num_warps, q_in_registers=q)
        except ValueError:
            continue
        name = variant_name(block_m, block_n, num_warps, q)
        if config.shared_bytes <= MAX_SHARED and name not in names:
            names.append(name)
    return names


HEADDIMS = (64, 128)
SEQLENS = (1024, 4096, 16384)


def variant_key(name, dtype, headdim, causal):
    return f"{name}_{dtype}_d{headdim}_{'causal' if causal else 'full'}"


def make_config(name, dtype, headdim, causal):
    """Causal attention is the kernel's window variant, run with the window (-1, 0)."""
    from nbflash.kernels.forward_mma import MmaForwardConfig
    from nbflash.problem import Variant

    return MmaForwardConfig(dtype, headdim, Variant(window=causal), **variant_arguments(name))


def signature(config):
    from nbflash.kernels import registry

    return registry.signature(config)


# ---------------------------------------------------------------------------------------------------
# build: Numba -> PTX -> cubin, no GPU needed
# ---------------------------------------------------------------------------------------------------

def _build_one(job):
    name, dtype, headdim, causal, folder = job
    from numba import cuda

    try:
        cuda.get_current_device()
    except Exception:
        pretend_gpu((9, 0))  # no GPU here: compile for the H200
    from nbflash.kernels.forward_mma import build_forward_mma

    config = make_config(name, dtype, headdim, causal)
    key = variant_key(name, dtype, headdim, causal)
    meta = os.path.join(folder, key + ".json")
    if os.path.exists(meta) and os.path.exists(os.path.join(folder, key + ".cubin")):
        with open(meta) as f:
            return json.load(f)  # built before (delete the folder after changing the kernel)
    start = time.time()
    ptx, _ = cuda.compile_ptx(build_forward_mma(config).py_func, signature(config), cc=(9, 0))
    numba_s = time.time() - start
    entry = re.search(r"\.entry\s+(\S+)\(", ptx).group(1)
    ptx_path, cubin_path = os.path.join(folder, key + ".ptx"), os.path.join(folder, key + ".cubin")
    with open(ptx_path, "w") as f:
        f.write(ptx)
    ptxas = subprocess.run([cuda_tool("ptxas"), "-arch=sm_90", "-v", ptx_path, "-o", cubin_path],
                           capture_output=True, text=True, check=True).stderr
    sass = subprocess.run([cuda_tool("cuobjdump"), "-sass", cubin_path], capture_output=True, text=True,
                          env=dict(os.environ, PATH=os.path.dirname(cuda_tool("nvdisasm")) + ":" + os.environ["PATH"])).stdout
    os.remove(ptx_path)
    info = dict(
        key=key, entry=entry, numba_compile_s=round(numba_s, 1),
        registers=int(re.search(r"Used (\d+) registers", ptxas).group(1)),
        spill_bytes=sum(int(x) for x in re.findall(r"(\d+) bytes spill", ptxas)),
        stack_bytes=int(re.search(r"(\d+) bytes stack frame", ptxas).group(1)),
        hmma=sass.count("HMMA"), ldsm=sass.count("LDSM"), ldl=sass.count("LDL"),
        shared_bytes=config.shared_bytes, threads=config.threads,
    )
    with open(os.path.join(folder, key + ".json"), "w") as f:
        json.dump(info, f)
    return info


def build(args):
    os.makedirs(args.cubins, exist_ok=True)
    jobs = [(name, "float16", d, c, args.cubins) for d in args.headdims for name in variants_for(args, d)
            for c in (False, True)]
    with ProcessPoolExecutor(args.jobs) as pool:
        for info in pool.map(_build_one, jobs):
            print(f"{info['key']:40s} regs {info['registers']:3d} spill {info['spill_bytes']:3d} "
                  f"stack {info['stack_bytes']:3d} HMMA {info['hmma']:3d} LDSM {info['ldsm']:3d} "
                  f"smem {info['shared_bytes']:6d} numba {info['numba_compile_s']}s", flush=True)


# ---------------------------------------------------------------------------------------------------
# run: load, check, time (GPU)
# ---------------------------------------------------------------------------------------------------

class Kernel:
    """One variant, loaded from a cubin through CuPy, launched with Numba's flattened arguments."""

    def __init__(self, name, dtype, headdim, causal, folder, compile_fallback=True):
        import cupy

        self.config = make_config(name, dtype, headdim, causal)
        key = variant_key(name, dtype, headdim, causal)
        meta_path = os.path.join(folder, key + ".json") if folder else None
        self.info = {}
        if meta_path and os.path.exists(meta_path):
            with open(meta_path) as f:
                self.info = json.load(f)
            try:
                module = cupy.RawModule(path=os.path.join(folder, key + ".cubin"))
                self.function = module.get_function(self.info["entry"])
                self.function.max_dynamic_shared_size_bytes = self.config.shared_bytes
                self.source = "cubin built offline"
                return
            except Exception as error:  # e.g. a cubin this driver cannot load
                if not compile_fallback:
                    raise
                print(f"  {key}: offline cubin unusable ({error}); compiling here", flush=True)
        self._compile_here(key)

    def _compile_here(self, key):
        import tempfile

        import cupy
        from numba import cuda

        from nbflash.kernels.forward_mma import build_forward_mma

        start = time.time()
        kernel = build_forward_mma(self.config)
        kernel.compile(signature(self.config))
        library = next(iter(kernel.overloads.values()))._codelibrary
        cubin = library.get_cubin(cc=cuda.get_current_device().compute_capability)
        entry = re.search(r"\.entry\s+(\S+)\(", library.get_asm_str()).group(1)
        path = os.path.join(tempfile.mkdtemp(), key + ".cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        module = cupy.RawModule(path=path)
        self.function = module.get_function(entry)
        self.function.max_dynamic_shared_size_bytes = self.config.shared_bytes
        self.info.setdefault("registers", self.function.num_regs)
        self.source = f"compiled here in {time.time() - start:.1f}s"

    @staticmethod
    def _flat(t):
        import numpy as np

        size = t.element_size()
        return ([np.uint64(0), np.uint64(0), np.int64(t.numel()), np.int64(size), np.uint64(t.data_ptr())]
                + [np.int64(n) for n in t.shape] + [np.int64(s * size) for s in t.stride()])

    def __call__(self, q, k, v, out, lse, scale):
        import numpy as np

        from nbflash.problem import window_bounds

        batch, seqlen_q, nheads, _ = q.shape
        args = []
        for t in (q, k, v, out, lse):
            args += self._flat(t)
        args.append(np.float32(scale * math.log2(math.e)))
        if self.config.variant.window:  # the window's (left, right): causal's, as validation gives them
            args += [np.int32(x) for x in window_bounds(seqlen_q, k.shape[1], True, (-1, -1))[:2]]
        self.function(self.config.grid(batch, nheads, seqlen_q), (self.config.threads,), tuple(args),
                      shared_mem=self.config.shared_bytes)


def reference(q, k, v, scale, causal, round_p=False):
    """float32 attention (out, lse) on the GPU, bottom-right causal, GQA by repetition; with
    round_p, the probabilities are rounded to fp16 before P V (the naive fp16 implementation)."""
    import torch

    seqlen_q, nheads, seqlen_k, nheads_k = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    kf = kf.repeat_interleave(nheads // nheads_k, dim=1)
    vf = vf.repeat_interleave(nheads // nheads_k, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        s = s.masked_fill(j > i + seqlen_k - seqlen_q, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    if round_p:
        p = p.half().float()
    return torch.matmul(p, vf).transpose(1, 2), lse


def check(kernel, log):
    """Awkward shapes against the float32 reference; error bound from a naive fp16 implementation."""
    import torch

    d, causal = kernel.config.headdim, kernel.config.variant.window
    ok = True
    for batch, sq, sk, h, hk in [(2, 1027, 1027, 4, 4), (1, 333, 1500, 4, 2), (1, 700, 257, 2, 1), (1, 1, 1, 1, 1)]:
        q = torch.randn(batch, sq, h, d, device="cuda", dtype=torch.float16)
        k = torch.randn(batch, sk, hk, d, device="cuda", dtype=torch.float16)
        v = torch.randn(batch, sk, hk, d, device="cuda", dtype=torch.float16)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((batch, h, sq), float("nan"), device="cuda")
        scale = d ** -0.5
        kernel(q, k, v, out, lse, scale)
        torch.cuda.synchronize()
        ref, ref_lse = reference(q, k, v, scale, causal)
        # naive fp16: probabilities rounded to fp16 before P V, output rounded to fp16
        naive = reference(q, k, v, scale, causal, round_p=True)[0].half().float()
        naive_err = (naive - ref).abs().max().item()
        err = (out.float() - ref).abs().nan_to_num(float("inf")).max().item()
        finite = torch.isfinite(ref_lse)
        lse_err = (lse - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
        lse_inf_ok = bool((torch.isneginf(lse) == torch.isneginf(ref_lse)).all())
        good = err <= 2 * naive_err + 2e-3 and lse_err < 1e-3 and lse_inf_ok and not torch.isnan(lse).any()
        ok &= good
        log(f"    check b{batch} sq{sq} sk{sk} h{h}/{hk}: max err {err:.2e} (naive fp16 {naive_err:.2e}) "
            f"lse err {lse_err:.1e} {'ok' if good else 'FAIL'}")
    return ok


def time_ms(fn, warmup=3, repeats=15):
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def run(args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "gpu_mma.log"), "w")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")

    log(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rows = []
    for d in args.headdims:
        for causal in (False, True):
            kernels = {}
            for name in variants_for(args, d):
                start = time.time()
                try:
                    kern = Kernel(name, "float16", d, causal, args.cubins, not args.no_compile)
                except Exception as error:
                    log(f"{name} d{d} causal={causal}: load failed: {error!r}")
                    continue
                info = kern.info
                log(f"{name} d{d} causal={causal}: {kern.source}, regs {info.get('registers')}, "
                    f"spill {info.get('spill_bytes')}, load {time.time() - start:.1f}s")
                if check(kern, log):
                    kernels[name] = kern
            for seqlen in args.seqlens:
                nheads, batch = 2048 // d, 2 * max(1, 16384 // seqlen)
                flops = 4 * batch * nheads * seqlen * seqlen * d * (0.5 if causal else 1.0)
                q, k, v = (torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=torch.float16) for _ in range(3))
                out = torch.empty_like(q)
                lse = torch.empty(batch, nheads, seqlen, device="cuda")
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                row = dict(headdim=d, causal=causal, seqlen=seqlen, sdpa_tflops=flops / sdpa_ms / 1e9)
                for name, kern in kernels.items():
                    ms = time_ms(lambda: kern(q, k, v, out, lse, d ** -0.5))
                    row[name] = flops / ms / 1e9
                rows.append(row)
                log(f"  d{d} causal={causal} n{seqlen}: SDPA flash {row['sdpa_tflops']:.0f} TFLOP/s; "
                    + ", ".join(f"{n} {row[n]:.0f} ({row[n] / row['sdpa_tflops']:.2f}x)" for n in kernels))
    with open(os.path.join(args.out, "gpu_mma.json"), "w") as f:
        json.dump(rows, f, indent=1)
    names = list(dict.fromkeys(n for d in args.headdims for n in variants_for(args, d)
                               if any(n in r for r in rows)))
    log("\nTFLOP/s (ratio to SDPA flash), fp16 forward")
    log(f"{'hd':>3} {'causal':>6} {'seqlen':>6} {'SDPA':>5} " + " ".join(f"{n:>22}" for n in names))
    for r in rows:
        cells = [f"{r[n]:6.0f} ({r[n] / r['sdpa_tflops']:.2f}x)" if n in r else "-" for n in names]
        log(f"{r['headdim']:>3} {str(r['causal']):>6} {r['seqlen']:>6} {r['sdpa_tflops']:5.0f} "
            + " ".join(f"{c:>22}" for c in cells))
    if args.around:
        search_summary(rows, args, log)


def variants_for(args, headdim):
    return around_table(headdim) if args.around else args.variants


def search_summary(rows, args, log):
    """Per (headdim, causal): the table's entry against the variant with the best mean ratio to
    SDPA flash over the timed lengths."""
    log("\nSearch around the table (mean ratio to SDPA flash over the timed seqlens)")
    for d in args.headdims:
        entry = around_table(d)[0]
        for causal in (False, True):
            mine = [r for r in rows if r["headdim"] == d and r["causal"] == causal]
            means = {}
            for name in around_table(d):
                ratios = [r[name] / r["sdpa_tflops"] for r in mine if name in r]
                if ratios and len(ratios) == len(mine):
                    means[name] = sum(ratios) / len(ratios)
            if not means:
                continue
            best = max(means, key=means.get)
            verdict = "the table's entry is best" if best == entry else f"better: {best}"
            log(f"  hd {d} causal={causal}: table {entry} {means.get(entry, float('nan')):.3f}x, "
                f"best {best} {means[best]:.3f}x ({verdict})")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["build", "run"])
    parser.add_argument("--cubins", default=None, help="folder of offline-built cubins")
    parser.add_argument("--out", default="gpu_mma_out", help="folder for logs (run)")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="names as VARIANT_NAME reads")
    parser.add_argument("--around", action="store_true",
                        help="instead of --variants: the table's entry per headdim and its neighbours")
    parser.add_argument("--headdims", nargs="+", type=int, default=list(HEADDIMS))
    parser.add_argument("--seqlens", nargs="+", type=int, default=list(SEQLENS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--no-compile", action="store_true", help="run: skip variants without a usable cubin")
    args = parser.parse_args()
    if args.step == "build":
        if not args.cubins:
            parser.error("build needs --cubins DIR")
        build(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
