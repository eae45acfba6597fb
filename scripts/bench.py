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
    python scripts/bench.py --pass decode --decode-shapes 16x16384 64x4096 --page-sizes none 256

``--pass decode`` times ``flash_attn_with_kvcache`` instead (see ``decode_main``): a few new
queries against a long KV cache, contiguous or paged, as memory bandwidth (KV bytes / time) over
the device-to-device copy bandwidth measured in the same run, next to PyTorch SDPA's flash,
efficient and cuDNN backends on the same contiguous K/V.
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


# The defaults of the flags whose default depends on the pass (None in the parser).
DEFAULTS = {
    "training": dict(headdims=[64, 128, 256], dtypes=["float16", "bfloat16"],
                     seqlens=[512, 1024, 2048, 4096, 8192, 16384], causal="both", families=list(configs.FAMILIES)),
    "decode": dict(headdims=[128], dtypes=["float16"],
                   decode_shapes=["1x131072", "16x16384", "64x4096", "8x8192", "256x1024"],
                   decode_heads=["32x8", "32x32"], page_sizes=["none", "16", "256"], seqlen_q=[1], num_splits=0),
}
# Flags of the training passes that mean nothing to the decode pass, and the reverse.
TRAINING_ONLY = ("seqlens", "causal", "variants", "families", "dkdv_blocks", "no_naive")
DECODE_ONLY = ("decode_shapes", "decode_heads", "page_sizes", "seqlen_q", "num_splits")


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headdims", type=int, nargs="+", default=None,
                        help="default 64 128 256 (decode: 128)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=None, help="default 512 ... 16384")
    parser.add_argument("--dtypes", nargs="+", default=None, help="default float16 bfloat16 (decode: float16)")
    parser.add_argument("--causal", choices=["no", "yes", "both"], default=None, help="default both")
    parser.add_argument(
        "--variants", nargs="+", default=None, metavar="NAME",
        help=f"attention variants from nbflash.catalogue ({', '.join(VARIANTS)}), each a row, instead of "
        "--causal; adds FlexAttention (torch.compile) as an anchor; FLOPs count the visible scores only",
    )
    parser.add_argument("--families", nargs="+", default=None, help=f"default {' '.join(configs.FAMILIES)}")
    parser.add_argument("--no-naive", action="store_true", default=None)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per entry")
    parser.add_argument("--markdown", help="also write the table, with GPU, date and command, to this file")
    parser.add_argument(
        "--pass", dest="which", choices=[*PASSES, "decode"], default="forward",
        help="time the forward, the backward alone (FLOPs counted as 2.5x the forward's), or both "
        "(3.5x); or decode: flash_attn_with_kvcache against a KV cache, as bandwidth",
    )
    parser.add_argument(
        "--dkdv-blocks", nargs="+", default=None, metavar="MxNxW",
        help="--pass backward: also time the tensor-core dK/dV kernel with these (block_m, block_n, "
        "num_warps), one column each, e.g. 64x128x8",
    )
    decode = parser.add_argument_group("--pass decode")
    decode.add_argument("--decode-shapes", nargs="+", default=None, metavar="BxN",
                        help="(batch, cache length) pairs; default " + " ".join(DEFAULTS["decode"]["decode_shapes"]))
    decode.add_argument("--decode-heads", nargs="+", default=None, metavar="HxHK",
                        help="query heads x KV heads; default 32x8 (GQA) 32x32 (MHA)")
    decode.add_argument("--page-sizes", nargs="+", default=None, metavar="SIZE",
                        help="paged caches with these page_block_size, 'none' for a contiguous cache; "
                        "default none 16 256")
    decode.add_argument("--seqlen-q", type=int, nargs="+", default=None, metavar="N",
                        help="new queries per sequence (causal, bottom-right aligned); default 1")
    decode.add_argument("--num-splits", type=int, default=None,
                        help="num_splits for flash_attn_with_kvcache (0, the default: its heuristic)")
    return parser


def resolve_arguments(parser, args):
    """Fill in the pass's defaults; reject the flags that belong to the other kind of pass."""
    decode = args.which == "decode"
    for name in DECODE_ONLY if not decode else TRAINING_ONLY:
        if getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} does not apply to --pass {args.which}" + (
                "" if decode else " (it goes with --pass decode)"))
    for name, value in DEFAULTS["decode" if decode else "training"].items():
        if getattr(args, name) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)
    if decode:
        args.decode_shapes = [parse_pair(parser, "--decode-shapes", text) for text in args.decode_shapes]
        args.decode_heads = [parse_pair(parser, "--decode-heads", text) for text in args.decode_heads]
        for nheads, nheads_k in args.decode_heads:
            if nheads % nheads_k:
                parser.error(f"--decode-heads {nheads}x{nheads_k}: query heads must be a multiple of KV heads")
        pages = []
        for text in args.page_sizes:
            if text.lower() == "none":
                pages.append(None)
            elif text.isdigit() and int(text) >= 1:
                pages.append(int(text))
            else:
                parser.error(f"--page-sizes {text!r}: a page size >= 1, or 'none' for a contiguous cache")
        args.page_sizes = pages
        if min(args.seqlen_q) < 1:
            parser.error("--seqlen-q must be >= 1")
        if args.num_splits < 0:
            parser.error("--num-splits must be >= 0 (0: the library's heuristic)")
    else:
        args.dkdv_blocks = args.dkdv_blocks or []
        args.no_naive = bool(args.no_naive)
    return args


def parse_pair(parser, flag, text):
    """'16x4096' -> (16, 4096), or a parser error naming the flag."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        parser.error(f"{flag} {text!r}: expected two positive integers as AxB, e.g. 16x4096")
    return int(parts[0]), int(parts[1])


def main(argv=None):
    parser = build_parser()
    args = resolve_arguments(parser, parser.parse_args(argv))
    argv = list(sys.argv[1:] if argv is None else argv)
    if args.which == "decode":
        return decode_main(args, argv)

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


# ---------------------------------------------------------------- the decode pass

SDPA_DECODE_BACKENDS = {"SDPA flash": "FLASH_ATTENTION", "SDPA efficient": "EFFICIENT_ATTENTION",
                        "SDPA cuDNN": "CUDNN_ATTENTION"}
COPY_BYTES = 2**30  # the copy-bandwidth buffer: 1 GiB, far beyond any L2


def copy_bandwidth(budget_s):
    """Device-to-device copy bandwidth in bytes/s: (bytes read + bytes written) / time of one copy of a
    1 GiB buffer, the ceiling a kernel that streams its inputs once can approach."""
    source = cupy.ones(COPY_BYTES // 2, np.float16)
    target = cupy.empty_like(source)
    ms = time_ms(lambda: cupy.copyto(target, source), warmup=3, repeats=50, budget_s=budget_s)
    del source, target
    cupy.get_default_memory_pool().free_all_blocks()
    return 2 * COPY_BYTES / (ms * 1e-3)


def random_device(shape, dtype):
    """Standard-normal values drawn on the GPU (a host draw of a multi-GiB cache takes seconds)."""
    return cupy.random.standard_normal(shape, dtype=np.float32).astype(dtype)


def decode_caches(batch, context, nheads_k, headdim, dtype, page, rng):
    """(k_cache, v_cache, block_table): contiguous (batch, context, nheads_k, headdim) when ``page`` is
    None; else ceil(context / page) pages a sequence, every sequence's pages at random places among all
    of them (the int32 block_table is a random permutation)."""
    if page is None:
        shape, table = (batch, context, nheads_k, headdim), None
    else:
        max_blocks = -(-context // page)
        shape = (batch * max_blocks, page, nheads_k, headdim)
        table = cupy.asarray(rng.permutation(batch * max_blocks).reshape(batch, max_blocks).astype(np.int32))
    return random_device(shape, dtype), random_device(shape, dtype), table


def nbflash_decode_runner(q, k_cache, v_cache, context, block_table, num_splits):
    """flash_attn_with_kvcache on full caches of ``context`` tokens each, causal (bottom-right)."""
    cache_seqlens = cupy.full(q.shape[0], context, np.int32)
    kvcache = getattr(nbflash, "flash_attn_with_kvcache", None)
    if kvcache is None:
        raise NotImplementedError("this nbflash has no flash_attn_with_kvcache")
    return lambda: kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                           causal=True, num_splits=num_splits)


def sdpa_decode_inputs(q, k_cache, v_cache):
    """(q, k, v, keyword arguments) for SDPA: (batch, nheads, seqlen_q, d) q and contiguous
    (batch, nheads_k, N, d) K and V copies, with enable_gqa (KV heads repeated on a torch before 2.5,
    which has no enable_gqa). One query is trivially causal (it sees every key); more queries get the
    bottom-right causal mask (torch's causal_lower_right), as nbflash's causal."""
    import torch

    tq = torch.from_dlpack(q).transpose(1, 2).contiguous()
    tk, tv = (torch.from_dlpack(x).transpose(1, 2).contiguous() for x in (k_cache, v_cache))
    seqlen_q, seqlen_k = tq.shape[2], tk.shape[2]
    extra = {}
    if seqlen_q > 1:
        from torch.nn.attention.bias import causal_lower_right

        extra["attn_mask"] = causal_lower_right(seqlen_q, seqlen_k)
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5):
        extra["enable_gqa"] = tq.shape[1] != tk.shape[1]
    elif tq.shape[1] != tk.shape[1]:
        group = tq.shape[1] // tk.shape[1]
        tk, tv = (x.repeat_interleave(group, dim=1) for x in (tk, tv))
    return tq, tk, tv, extra


def sdpa_decode_runner(backend_name, inputs):
    """SDPA restricted to one backend (SDPBackend's name) on ``sdpa_decode_inputs``."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    tq, tk, tv, extra = inputs

    def call():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **extra)

    return call


def decode_title(copy_bytes_per_s):
    return (
        "decode: microseconds per call and KV bytes / time as a fraction of the copy bandwidth "
        f"({copy_bytes_per_s / 1e12:.2f} TB/s, read + written, measured in this run); KV bytes = "
        "2 * batch * context * nheads_k * headdim * itemsize; speedup vs X = X's time / nbflash's time "
        "(> 1: nbflash faster); SDPA runs on contiguous K/V"
    )


def decode_main(args, argv):
    """The decode benchmark: for every dtype, headdim, heads, seqlen_q and (batch, context), the
    SDPA anchors once on contiguous K/V, then nbflash once per layout (contiguous, each page size)."""
    anchors = {}
    if not args.no_torch:
        if importlib.util.find_spec("torch"):
            anchors = SDPA_DECODE_BACKENDS
        else:
            print("torch not importable: no SDPA anchors", file=sys.stderr)
    bandwidth = copy_bandwidth(args.budget)
    heading = decode_title(bandwidth)
    print(f"copy bandwidth: {bandwidth / 1e12:.3f} TB/s", file=sys.stderr)
    cases = [(dtype, headdim, heads, seqlen_q, shape) for dtype in args.dtypes for headdim in args.headdims
             for heads in args.decode_heads for seqlen_q in args.seqlen_q for shape in args.decode_shapes]
    total = len(cases) * len(args.page_sizes)
    rows = []

    def timed_us(name, make):
        """Median microseconds of the call ``make()`` builds, or '-' when it fails (and why, on stderr)."""
        try:
            return round(1e3 * time_ms(make(), warmup=3, repeats=100, budget_s=args.budget), 1)
        except Exception as error:  # a backend refusing the shape, out of memory, ...
            print(f"  {name}: {type(error).__name__}: {str(error)[:160]}", file=sys.stderr)
            return "-"

    for index, (dtype, headdim, (nheads, nheads_k), seqlen_q, (batch, context)) in enumerate(cases):
        rng = np.random.default_rng(index)
        itemsize = SUPPORTED[dtype].itemsize
        kv_bytes = 2 * batch * context * nheads_k * headdim * itemsize

        def fraction(us):
            return round(kv_bytes / (us * 1e-6) / bandwidth, 3) if isinstance(us, float) else "-"

        q = random_device((batch, seqlen_q, nheads, headdim), SUPPORTED[dtype])
        k_cache, v_cache, _ = decode_caches(batch, context, nheads_k, headdim, SUPPORTED[dtype], None, rng)
        sdpa_us = {}
        if anchors:
            try:
                inputs = sdpa_decode_inputs(q, k_cache, v_cache)
            except Exception as error:  # out of memory for the contiguous copies, an old torch, ...
                print(f"  SDPA inputs: {type(error).__name__}: {str(error)[:160]}", file=sys.stderr)
                inputs = None
            for name, backend in anchors.items():
                sdpa_us[name] = "-" if inputs is None else timed_us(name, lambda: sdpa_decode_runner(backend, inputs))
            inputs = None
            release_memory()
        for page in args.page_sizes:
            if page is not None:  # the contiguous caches give way to paged ones of the same size
                k_cache = v_cache = None
                release_memory()
                k_cache, v_cache, table = decode_caches(batch, context, nheads_k, headdim, SUPPORTED[dtype],
                                                        page, rng)
            else:
                table = None
            ours = timed_us("nbflash", lambda: nbflash_decode_runner(q, k_cache, v_cache, context, table,
                                                                     args.num_splits))
            row = {"dtype": dtype, "hdim": headdim, "heads": f"{nheads}/{nheads_k}", "seqlen_q": seqlen_q,
                   "shape": f"{batch}x{context}", "layout": "contiguous" if page is None else f"paged {page}",
                   "nbflash us": ours, "nbflash BW": fraction(ours)}
            for name, us in sdpa_us.items():
                row[f"{name} us"], row[f"{name} BW"] = us, fraction(us)
            for name in ("SDPA flash", "SDPA cuDNN"):
                if name in sdpa_us:
                    row[f"speedup vs {name}"] = (round(sdpa_us[name] / ours, 2)
                                                 if isinstance(ours, float) and isinstance(sdpa_us[name], float)
                                                 else "-")
            rows.append(row)
            print(f"[{len(rows)}/{total}] {row}", file=sys.stderr, flush=True)
            if args.markdown:  # after every row, so that a run cut short still leaves its table
                write_markdown(args, argv, rows, total, heading)
        q = k_cache = v_cache = table = None
        release_memory()
    print(f"GPU: {gpu_name()}, nbflash {nbflash.__version__}")
    print(heading)
    print(tabulate(rows, headers="keys"))


def release_memory():
    """Hand cached device memory back between cases (multi-GiB caches come and go), CuPy's and torch's."""
    cupy.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        sys.modules["torch"].cuda.empty_cache()


def gpu_name():
    return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()


def title(which):
    factor = {"forward": "", "backward": ", x2.5 backward", "forward+backward": ", x3.5 forward+backward"}
    return (
        f"{which} TFLOP/s (FLOPs = 4 B H D x visible scores: N^2, N (N + 1) / 2 causal{factor[which]}); "
        "ratios are nbflash's best family over the anchor"
    )


def write_markdown(args, argv, rows, total, heading=None):
    """The table so far, with GPU, date and the command (less the output file's own path), under
    ``heading`` (the pass's title by default)."""
    shown = [a for i, a in enumerate(argv) if a != "--markdown" and (i == 0 or argv[i - 1] != "--markdown")]
    shown = [a for a in shown if not a.startswith("--markdown=")]
    command = "python scripts/bench.py " + " ".join(shown)
    done = "" if len(rows) == total else f" Cut short: {len(rows)} of {total} rows."
    with open(args.markdown, "w") as f:
        f.write(f"GPU: {gpu_name()}. Date: {time.strftime('%Y-%m-%d')}. Command: `{command}`.{done}\n\n")
        f.write(f"{heading or title(args.which)}\n\n{tabulate(rows, headers='keys', tablefmt='github')}\n")


if __name__ == "__main__":
    main()

