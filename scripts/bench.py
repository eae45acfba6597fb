"""Forward, backward or forward+backward throughput over flash-attn's benchmark grid, next to the anchors, in one run.

Grid (flash-attn's): hidden size 2048, so nheads = 2048 / headdim; batch = 16384 / seqlen; seqlen
512 ... 16k; headdim 64, 128, 256; causal and not; fp16 and bf16 (fp32 too for our portable path).
FLOPs = 4 * batch * nheads * headdim * (the visible scores: seqlen^2, or seqlen (seqlen + 1) / 2 when
causal; nbflash/kernels/geometry.py counts them).

Anchors measured in the same process: PyTorch SDPA's flash and cuDNN backends (when torch is
importable), naive CuPy attention (matmul, float32 softmax, matmul) and each nbflash kernel family.
Times: CUDA events around each call after a warm-up, median of the repeats. Ratios are printed as
columns. Example:

    python scripts/bench.py --headdims 64 128 --seqlens 1024 4096 16384 --dtypes float16 float32
    python scripts/bench.py --pass backward --families portable --headdims 128 --seqlens 4096
    python scripts/bench.py --pass forward+backward --families mma --headdims 128 --dtypes float16
"""

import argparse
import importlib.util
import sys
import time

import cupy
import numpy as np
from tabulate import tabulate

import nbflash
from nbflash import configs
from nbflash.demo import naive_attention
from nbflash.dtypes import SUPPORTED
from nbflash import backward
from nbflash.backward import _flash_attn_backward
from nbflash.catalogue import VARIANTS, variant_arguments
from nbflash.interface import _flash_attn_forward
from nbflash.kernels.geometry import visible_count
from nbflash.problem import window_bounds
from nbflash.measure import time_ms
from nbflash.validation import check_forward


def nbflash_runner(family):
    def run(q, k, v, causal, **variant):
        problem, q_, k_, v_ = check_forward(q, k, v, None, causal, **variant)
        return lambda: _flash_attn_forward(problem, q_, k_, v_, family=family)

    return run


def nbflash_step_runner(family):
    """Times one training step's attention: the forward, then the backward from its out and lse."""

    def run(q, k, v, causal, **variant):
        problem, q_, k_, v_ = check_forward(q, k, v, None, causal, **variant)
        dout = cupy.random.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)

        def call():
            with nbflash.kernel_family(family):
                out, lse = _flash_attn_forward(problem, q_, k_, v_, family=family)
                return _flash_attn_backward(problem, dout, q_, k_, v_, out, lse)

        return call

    return run


def use_dkdv_blocks(blocks):
    """Plan the tensor-core dK/dV kernel with (block_m, block_n, num_warps) for every headdim, or
    with the table's own rows (None). Takes effect for the calls that follow (the planned kernels
    are forgotten, so the next call plans and loads them again)."""
    configs.MMA_BACKWARD_DKDV[:] = DEFAULT_DKDV if blocks is None else [(256, *blocks)]
    backward._kernels.cache_clear()


DEFAULT_DKDV = list(configs.MMA_BACKWARD_DKDV)


def nbflash_backward_runner(family, dkdv_blocks=None):
    """Times flash_attn_backward alone, from the default forward's out and lse."""

    def run(q, k, v, causal, **variant):
        use_dkdv_blocks(dkdv_blocks)
        problem, q_, k_, v_ = check_forward(q, k, v, None, causal, **variant)
        out, lse = _flash_attn_forward(problem, q_, k_, v_)
        dout = cupy.random.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)

        def call():
            with nbflash.kernel_family(family):
                return _flash_attn_backward(problem, dout, q_, k_, v_, out, lse)

        return call

    return run


def sdpa_runner(backend_name):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal, **variant):
        no_variant(variant)
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))

        def call():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

        return call

    return run


def sdpa_backward_runner(backend_name):
    """Times SDPA's backward alone (out.backward on a retained graph)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal, **variant):
        no_variant(variant)
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        dout = torch.randn_like(out)
        return lambda: out.backward(dout, retain_graph=True)

    return run


def sdpa_step_runner(backend_name):
    """Times SDPA's forward and backward together."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal, **variant):
        no_variant(variant)
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        dout = torch.randn_like(tq)

        def call():
            tq.grad = tk.grad = tv.grad = None  # as nbflash, fresh gradients every step
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
            out.backward(dout)

        return call

    return run


def no_variant(variant):
    if variant:
        raise NotImplementedError(f"SDPA has no {sorted(variant)}")


def flex_runner(which):
    """FlexAttention (torch.compile'd, its Triton kernels) with the catalogue variant as a score_mod
    and a block mask: forward, backward alone, or both, as the SDPA runners."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)

    def run(q, k, v, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, bias=None):
        batch, seqlen_q, nheads, _ = q.shape
        seqlen_k = k.shape[1]
        left, right, window = window_bounds(seqlen_q, seqlen_k, causal, window_size)
        offset = seqlen_k - seqlen_q
        slopes = torch.from_dlpack(alibi_slopes) if alibi_slopes is not None else None
        if slopes is not None and slopes.dim() == 1:
            slopes = slopes[None].expand(batch, nheads)
        extra = keep = None
        if bias is not None:
            tensor = torch.from_dlpack(bias)
            tensor = tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))
            tensor = tensor.expand(batch, nheads, seqlen_q, seqlen_k)
            keep, extra = (tensor, None) if tensor.dtype == torch.bool else (None, tensor.float())

        def score_mod(score, b, h, q_idx, kv_idx):
            if softcap > 0:
                score = softcap * torch.tanh(score / softcap)
            if slopes is not None:
                score = score - slopes[b, h] * (q_idx + offset - kv_idx).abs()
            if extra is not None:
                score = score + extra[b, h, q_idx, kv_idx]
            return score

        def mask_mod(b, h, q_idx, kv_idx):
            diagonal = q_idx + offset
            inside = (kv_idx >= diagonal - left) & (kv_idx <= diagonal + right)
            return inside & keep[b, h, q_idx, kv_idx] if keep is not None else inside

        masked = window or keep is not None
        block_mask = create_block_mask(mask_mod, batch if keep is not None else None,
                                       nheads if keep is not None else None, seqlen_q, seqlen_k) if masked else None
        modded = softcap > 0 or slopes is not None or extra is not None
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2).detach().requires_grad_(which != "forward")
                      for x in (q, k, v))

        def forward():
            return compiled(tq, tk, tv, score_mod=score_mod if modded else None, block_mask=block_mask)

        if which == "forward":
            return forward
        dout = torch.randn_like(tq)
        if which == "backward":
            out = forward()
            return lambda: out.backward(dout, retain_graph=True)

        def step():
            tq.grad = tk.grad = tv.grad = None
            forward().backward(dout)

        return step

    return run


# FLOPs of each pass as a multiple of the forward's (flash-attn's count: the backward does 2.5x).
PASSES = {
    "forward": (1.0, nbflash_runner, sdpa_runner),
    "backward": (2.5, nbflash_backward_runner, sdpa_backward_runner),
    "forward+backward": (3.5, nbflash_step_runner, sdpa_step_runner),
}


def naive_runner(q, k, v, causal, **variant):
    no_variant(variant)
    return lambda: naive_attention(q, k, v, causal)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headdims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    parser.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    parser.add_argument(
        "--variants", nargs="+", default=None, metavar="NAME",
        help=f"attention variants from nbflash.catalogue ({', '.join(VARIANTS)}), each a row, instead of "
        "--causal; adds FlexAttention (torch.compile) as an anchor; FLOPs count the visible scores only",
    )
    parser.add_argument("--families", nargs="+", default=list(configs.FAMILIES))
    parser.add_argument("--no-naive", action="store_true")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per entry")
    parser.add_argument("--markdown", help="also write the table, with GPU, date and command, to this file")
    parser.add_argument(
        "--pass", dest="which", choices=list(PASSES), default="forward",
        help="time the forward, the backward alone (FLOPs counted as 2.5x the forward's), or both "
        "(3.5x)",
    )
    parser.add_argument(
        "--dkdv-blocks", nargs="+", default=[], metavar="MxNxW",
        help="--pass backward: also time the tensor-core dK/dV kernel with these (block_m, block_n, "
        "num_warps), one column each, e.g. 64x128x8",
    )
    args = parser.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)

    flop_factor, nbflash_pass, sdpa = PASSES[args.which]
    runners = {f"nbflash {f}": nbflash_pass(f) for f in args.families}
    for blocks in args.dkdv_blocks:
        if args.which != "backward":
            parser.error("--dkdv-blocks goes with --pass backward")
        runners[f"nbflash mma {blocks}"] = nbflash_backward_runner("mma", tuple(map(int, blocks.split("x"))))
    if not args.no_torch:
        if importlib.util.find_spec("torch"):
            runners["SDPA flash"] = sdpa("FLASH_ATTENTION")
            runners["SDPA cuDNN"] = sdpa("CUDNN_ATTENTION")
        else:
            print("torch not importable: no SDPA anchors", file=sys.stderr)
    if args.variants and not args.no_torch and importlib.util.find_spec("torch"):
        runners["Flex"] = flex_runner(args.which)
    if not args.no_naive and args.which == "forward" and not args.variants:
        runners["naive CuPy"] = naive_runner

    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    variants = args.variants or [("causal" if c else "plain") for c in causals]
    cases = [
        (d, n, name, dt) for dt in args.dtypes for d in args.headdims for name in variants for n in args.seqlens
    ]
    rows = []
    for index, (headdim, seqlen, name, dtype) in enumerate(cases):
        nheads, batch = 2048 // headdim, max(1, 16384 // seqlen)
        variant = variant_arguments(name, batch, nheads, seqlen, cupy)
        causal = variant.pop("causal", False)
        left, right, _ = window_bounds(seqlen, seqlen, causal, variant.get("window_size", (-1, -1)))
        flops = 4 * batch * nheads * visible_count(seqlen, seqlen, left, right) * headdim * flop_factor
        rng = np.random.default_rng(index)
        q, k, v = (
            cupy.asarray(rng.standard_normal((batch, seqlen, nheads, headdim), np.float32)).astype(
                SUPPORTED[dtype]
            )
            for _ in range(3)
        )
        row = {"dtype": dtype, "hdim": headdim, "seqlen": seqlen, "causal": causal}
        if args.variants:
            row = {"dtype": dtype, "hdim": headdim, "seqlen": seqlen, "variant": name}
        for name, make in runners.items():
            if name.startswith("SDPA") and dtype == "float32":
                row[name] = "-"
                continue
            try:
                ms = time_ms(make(q, k, v, causal, **variant), warmup=2, repeats=10, budget_s=args.budget)
                row[name] = round(flops / ms / 1e9, 1)
            except Exception as error:  # out of memory, unsupported by a backend, ...
                row[name] = "oom" if "memory" in str(error).lower() else "n/a"
                print(f"  {name}: {type(error).__name__}: {str(error)[:120]}", file=sys.stderr)
            cupy.get_default_memory_pool().free_all_blocks()
        ours = [row[n] for n in runners if n.startswith("nbflash") and isinstance(row[n], float)]
        for anchor in ("SDPA flash", "naive CuPy", "Flex"):
            if ours and isinstance(row.get(anchor), float):
                row[f"best/{anchor}"] = round(max(ours) / row[anchor], 2)
        rows.append(row)
        print(f"[{index + 1}/{len(cases)}] {row}", file=sys.stderr, flush=True)
        if args.markdown:  # after every row, so that a run cut short still leaves its table
            write_markdown(args, argv, rows, len(cases))
    print(f"GPU: {gpu_name()}, nbflash {nbflash.__version__}")
    print(title(args.which))
    print(tabulate(rows, headers="keys"))


def gpu_name():
    return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()


def title(which):
    factor = {"forward": "", "backward": ", x2.5 backward", "forward+backward": ", x3.5 forward+backward"}
    return (
        f"{which} TFLOP/s (FLOPs = 4 B H D x visible scores: N^2, N (N + 1) / 2 causal{factor[which]}); "
        "ratios are nbflash's best family over the anchor"
    )


def write_markdown(args, argv, rows, total):
    """The table so far, with GPU, date and the command (less the output file's own path)."""
    shown = [a for i, a in enumerate(argv) if a != "--markdown" and (i == 0 or argv[i - 1] != "--markdown")]
    shown = [a for a in shown if not a.startswith("--markdown=")]
    command = "python scripts/bench.py " + " ".join(shown)
    done = "" if len(rows) == total else f" Cut short: {len(rows)} of {total} rows."
    with open(args.markdown, "w") as f:
        f.write(f"GPU: {gpu_name()}. Date: {time.strftime('%Y-%m-%d')}. Command: `{command}`.{done}\n\n")
        f.write(f"{title(args.which)}\n\n{tabulate(rows, headers='keys', tablefmt='github')}\n")


if __name__ == "__main__":
    main()

