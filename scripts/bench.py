"""Forward, backward or forward+backward throughput over flash-attn's benchmark grid, next to the anchors, in one run.

Grid (flash-attn's): hidden size 2048, so nheads = 2048 / headdim; batch = 16384 / seqlen; seqlen
512 ... 16k; headdim 64, 128, 256; causal and not; fp16 and bf16 (fp32 too for our portable path).
FLOPs = 4 * batch * nheads * headdim * (the visible scores: seqlen^2, or seqlen (seqlen + 1) / 2 when
causal; nbflash/kernels/geometry.py counts them).

Anchors measured in the same process: PyTorch SDPA's flash and cuDNN backends (when torch is
importable), naive CuPy attention (matmul, float32 softmax, matmul) and each nbflash kernel family.
Times: CUDA events around each call after a warm-up, median of the repeats; the torch anchors'
backward alone: events around ``out.backward`` only, an untimed fresh forward before each (see
``BackwardOnly``). Ratios are printed as columns. Example:

    python scripts/bench.py --headdims 64 128 --seqlens 1024 4096 16384 --dtypes float16 float32
    python scripts/bench.py --pass backward --families portable --headdims 128 --seqlens 4096
    python scripts/bench.py --pass forward+backward --families mma --headdims 128 --dtypes float16
    python scripts/bench.py --headdims 64 128 256 --seqlens 4096 16384 --dtypes float16 --fp8 --no-naive
    python scripts/bench.py --pass decode --decode-shapes 16x16384 64x4096 --page-sizes none 256
    python scripts/bench.py --pass varlen --varlen-lengths uniform:16384:2048 128,4096 --causal yes --jobs 8

``--pass decode`` times ``flash_attn_with_kvcache`` instead (see ``decode_main``): a few new
queries against a long KV cache, contiguous or paged, as memory bandwidth (KV bytes / time) over
the device-to-device copy bandwidth measured in the same run, next to PyTorch SDPA's flash,
efficient and cuDNN backends on the same contiguous K/V. Calls run back to back between two CUDA
events, as a model's decode step launches layer after layer, so a call's host time overlaps the GPU
work queued before it (a column gives each call timed alone too). A cache much smaller than the L2
(50 MB on the H200) stays partly there from call to call: below ~64 MB of KV compare microseconds,
not bandwidth.

``--pass varlen`` times ``flash_attn_varlen_func``'s forward on a batch of mixed lengths packed
without padding (see ``varlen_main``), in TFLOP/s over each sequence's visible scores, next to the
dense kernel on the same tokens at equal lengths and on the padded batch, and SDPA's backends on the
padded batch and on nested (jagged) tensors; with ``--varlen-backward`` also
``flash_attn_varlen_backward`` with the sm90 and the mma dK/dV kernels.
"""

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import cupy
import numpy as np
from tabulate import tabulate

import nbflash
from nbflash import configs, kvcache
from nbflash.demo import naive_attention
from nbflash.dtypes import SUPPORTED
from nbflash import backward
from nbflash.backward import _flash_attn_backward
from nbflash.catalogue import VARIANTS, variant_arguments
from nbflash import launch
from nbflash.interface import _flash_attn_forward, _kernel_for, _launch_forward
from nbflash.kernels.geometry import visible_count
from nbflash.problem import window_bounds
from nbflash.measure import back_to_back_ms, time_ms
from nbflash.validation import check_forward, check_varlen
from nbflash.varlen import _varlen_forward


def checked(q, k, v, causal, variant):
    """check_forward's (problem, q, k, v) for a catalogue variant; a mask_mod comes with its block
    mask (nbflash.create_block_mask), so that empty tiles are skipped, as FlexAttention's block mask
    skips them."""
    if variant.get("mask_mod") is not None and variant.get("block_mask") is None:
        variant = dict(variant, block_mask=nbflash.create_block_mask(variant["mask_mod"], q.shape[0], q.shape[2],
                                                                     q.shape[1], k.shape[1]))
    return check_forward(q, k, v, None, causal, **variant)


def forcing(family):
    """Run on ``family`` (nbflash.kernel_family), or on the planner's choice for "default"."""
    return contextlib.nullcontext() if family == "default" else nbflash.kernel_family(family)


def forced(family):
    """``family`` as _flash_attn_forward takes it: None for "default"."""
    return None if family == "default" else family


def nbflash_runner(family):
    def run(q, k, v, causal, **variant):
        problem, q_, k_, v_ = checked(q, k, v, causal, variant)
        return lambda: _flash_attn_forward(problem, q_, k_, v_, family=forced(family))

    return run


def nbflash_fp8_runner(q, k, v, causal, **variant):
    """The public fp8 call on q, k and v rounded to e4m3 once, untimed (uint8 arrays: CuPy has no float8
    dtype), descales 1."""
    import ml_dtypes

    if variant:
        raise NotImplementedError(f"the fp8 forward has no {sorted(variant)}")

    def e4m3_bytes(x):  # (NumPy arrays under the simulator)
        on_host = isinstance(x, np.ndarray)
        bits = (x if on_host else cupy.asnumpy(x)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        return bits if on_host else cupy.asarray(bits)

    q8, k8, v8 = (e4m3_bytes(x) for x in (q, k, v))
    return lambda: nbflash.flash_attn_func(q8, k8, v8, causal=causal, fp8_dtype="float8_e4m3fn")


def nbflash_replaced_runner(family, **fields):
    """Times the forward of ``family``'s planned kernel with ``fields`` of its config replaced: a
    search column (--heavy-groups G: heavy_groups=G, longest-first within groups of (batch, head)
    pairs, nbflash/kernels/geometry.py ``grouped_block``; --rescale-slack S: rescale_slack=S, lazy
    rescaling; --forward-blocks: the tensor-core
    forward's block_m, block_n and num_warps in place of nbflash/configs.py MMA_FORWARD's)."""

    def run(q, k, v, causal, **variant):
        problem, q_, k_, v_ = checked(q, k, v, causal, variant)
        kernel = launch.compiled(dataclasses.replace(_kernel_for(problem, family).config, **fields))
        return lambda: _launch_forward(kernel, problem, q_, k_, v_)

    return run


# The families whose forward config has rescale_slack (lazy rescaling; --rescale-slack)
RESCALE_SLACK_FAMILIES = ("mma", "sm90")


def nbflash_step_runner(family, deterministic=False):
    """Times one training step's attention: the forward, then the backward from its out and lse."""

    def run(q, k, v, causal, **variant):
        problem, q_, k_, v_ = checked(q, k, v, causal, variant)
        dout = cupy.random.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)

        def call():
            with forcing(family):
                out, lse = _flash_attn_forward(problem, q_, k_, v_, family=forced(family))
                return _flash_attn_backward(problem, dout, q_, k_, v_, out, lse, deterministic)

        return call

    return run


def use_dkdv_blocks(blocks):
    """Plan the tensor-core dK/dV kernel with (block_m, block_n, num_warps) for every headdim, or
    with the table's own rows (None). Takes effect for the calls that follow (the planned kernels
    are forgotten, so the next call plans and loads them again)."""
    configs.MMA_BACKWARD_DKDV[:] = DEFAULT_DKDV if blocks is None else [(256, *blocks)]
    backward._kernels.cache_clear()


DEFAULT_DKDV = list(configs.MMA_BACKWARD_DKDV)


def nbflash_backward_runner(family, dkdv_blocks=None, deterministic=False):
    """Times flash_attn_backward alone, from the default forward's out and lse, with a forward
    queued before each timed call (``call.before``: nbflash.measure.time_ms), as BackwardOnly times
    torch's backward: the backward's host work then overlaps that forward's GPU time for both."""

    def run(q, k, v, causal, **variant):
        use_dkdv_blocks(dkdv_blocks)
        problem, q_, k_, v_ = checked(q, k, v, causal, variant)
        out, lse = _flash_attn_forward(problem, q_, k_, v_)
        dout = cupy.random.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)

        def call():
            with forcing(family):
                return _flash_attn_backward(problem, dout, q_, k_, v_, out, lse, deterministic)

        call.before = lambda: _flash_attn_forward(problem, q_, k_, v_)
        return call

    return run


def sdpa_runner(backend_name):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal, **variant):
        dropout_p = no_variant(variant)
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))

        def call():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, dropout_p=dropout_p,
                                                                        is_causal=causal)

        return call

    return run


class BackwardOnly:
    """A torch backward timed alone: ``time_ms`` runs ``forward()`` untimed before every
    ``out.backward(dout)`` and puts CUDA events around the backward only.

    Each backward gets a graph of its own, so none needs ``retain_graph=True``: a compiled backward
    (FlexAttention's) refuses it when Inductor reuses the memory of the tensors it saved for the
    backward ("donated buffers"). ``torch._functorch.config.donated_buffer = False`` would allow
    it, but would time a backward planned differently from a training step's; and a retained graph
    accumulates into the gradients, an extra kernel per tensor. Here the gradients start at None
    every time, as a step's (and nbflash's backward) do. Calling the object runs one forward and
    backward, for warm-ups. Without CUDA (tests), the CPU time of the backward."""

    def __init__(self, forward, dout, inputs):
        self.forward, self.dout, self.inputs = forward, dout, inputs

    def prepare(self):
        for tensor in self.inputs:
            tensor.grad = None
        return self.forward()

    def __call__(self):
        self.prepare().backward(self.dout)

    def time_ms(self, warmup=1, repeats=5, budget_s=1.0):
        """Median milliseconds of the backward, at least 3 repeats, more up to ``repeats`` while
        within ``budget_s`` (as nbflash.measure.time_ms)."""
        import torch

        cuda = torch.cuda.is_available() and self.dout.is_cuda
        for _ in range(warmup):
            self()
        if cuda:
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        deadline = time.perf_counter() + budget_s
        while len(times) < max(1, repeats) and (len(times) < 3 or time.perf_counter() < deadline):
            out = self.prepare()  # queued before the start event, so not in the time
            if cuda:
                start.record()
                out.backward(self.dout)
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop))
            else:
                began = time.perf_counter()
                out.backward(self.dout)
                times.append((time.perf_counter() - began) * 1e3)
        return float(np.median(times))


def sdpa_backward_runner(backend_name):
    """Times SDPA's backward alone, a fresh forward before each (see BackwardOnly)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal, **variant):
        dropout_p = no_variant(variant)
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2).detach().requires_grad_() for x in (q, k, v))

        def forward():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, dropout_p=dropout_p,
                                                                        is_causal=causal)

        return BackwardOnly(forward, torch.randn_like(forward()), (tq, tk, tv))  # dout laid out as out

    return run


def sdpa_step_runner(backend_name):
    """Times SDPA's forward and backward together."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal, **variant):
        dropout_p = no_variant(variant)
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        dout = torch.randn_like(tq)

        def call():
            tq.grad = tk.grad = tv.grad = None  # as nbflash, fresh gradients every step
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, dropout_p=dropout_p,
                                                                        is_causal=causal)
            out.backward(dout)

        return call

    return run


def no_variant(variant):
    """SDPA's dropout probability for the catalogue's variant ``variant`` (SDPA draws its own mask:
    the seed is nbflash's only); NotImplementedError for anything else SDPA cannot express."""
    rest = {key: value for key, value in variant.items() if key not in ("dropout_p", "seed")}
    if rest:
        raise NotImplementedError(f"SDPA has no {sorted(rest)}")
    return variant.get("dropout_p", 0.0)


def flex_runner(which):
    """FlexAttention (torch.compile'd, its Triton kernels) with the catalogue variant as a score_mod
    and a block mask: forward, backward alone, or both, as the SDPA runners."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)

    def run(q, k, v, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, bias=None, score_mod=None,
            score_mod_grad=None, dropout_p=0.0, seed=None, mask_mod=None):
        if dropout_p:
            raise NotImplementedError("FlexAttention has no dropout")
        # The catalogue's score_mod is plain Python: it runs on torch tensors too (Flex differentiates it
        # itself, so score_mod_grad is not needed here).
        user_score = score_mod
        # Every case compiles as in a fresh process. Otherwise each new score_mod / mask_mod is one
        # more recompile of flex_attention: past Dynamo's recompile limit (8) it falls back to a
        # path on which the ALiBi score_mod failed to trace, and values that changed between the
        # cases (window bounds, softcap) are compiled as dynamic.
        torch._dynamo.reset()
        batch, seqlen_q, nheads, _ = q.shape
        seqlen_k = k.shape[1]
        left, right, window = window_bounds(seqlen_q, seqlen_k, causal, window_size)
        offset = seqlen_k - seqlen_q
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2).detach().requires_grad_(which != "forward")
                      for x in (q, k, v))
        # The slopes as the score_mod's captured buffer: a dense float32 tensor of torch's own on the
        # inputs' device, not requiring grad, indexed by head (by batch and head when 2-D), rather
        # than a stride-0 broadcast view of CuPy's memory.
        slopes = None
        if alibi_slopes is not None:
            slopes = torch.from_dlpack(alibi_slopes).to(device=tq.device, dtype=torch.float32).detach().clone()
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
                slope = slopes[h] if slopes.dim() == 1 else slopes[b, h]
                score = score - slope * (q_idx + offset - kv_idx).abs()
            if extra is not None:
                score = score + extra[b, h, q_idx, kv_idx]
            if user_score is not None:
                score = user_score(score, b, h, q_idx, kv_idx)
            return score

        user_mask = mask_mod  # the catalogue's mask_mod: integer arithmetic, runs on torch's index tensors

        def flex_mask(b, h, q_idx, kv_idx):
            diagonal = q_idx + offset
            inside = (kv_idx >= diagonal - left) & (kv_idx <= diagonal + right)
            if user_mask is not None:
                inside = inside & user_mask(b, h, q_idx, kv_idx)
            return inside & keep[b, h, q_idx, kv_idx] if keep is not None else inside

        masked = window or keep is not None or user_mask is not None
        block_mask = create_block_mask(flex_mask, batch if keep is not None else None,
                                       nheads if keep is not None else None, seqlen_q, seqlen_k,
                                       device=tq.device) if masked else None
        modded = softcap > 0 or slopes is not None or extra is not None or user_score is not None

        def forward():
            return compiled(tq, tk, tv, score_mod=score_mod if modded else None, block_mask=block_mask)

        if which == "forward":
            return forward
        dout = torch.randn_like(tq)
        if which == "backward":
            return BackwardOnly(forward, dout, (tq, tk, tv))

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
    if variant:
        raise NotImplementedError(f"the naive attention has no {sorted(variant)}")
    return lambda: naive_attention(q, k, v, causal)


# The defaults of the flags whose default depends on the pass (None in the parser), by kind of pass.
DEFAULTS = {
    "training": dict(headdims=[64, 128, 256], dtypes=["float16", "bfloat16"],
                     seqlens=[512, 1024, 2048, 4096, 8192, 16384], causal="both", families=list(configs.FAMILIES)),
    "decode": dict(headdims=[128], dtypes=["float16"],
                   decode_shapes=["1x131072", "16x16384", "64x4096", "8x8192", "256x1024"],
                   decode_heads=["32x8", "32x32"], page_sizes=["none", "16", "256"], seqlen_q=[1], num_splits=0,
                   page_aligned=False),
    "varlen": dict(headdims=[128], dtypes=["float16"], causal="both",
                   varlen_lengths=["uniform:16384:2048", "uniform:32768:8192", "128,512,1024,2048,4096,8192"],
                   varlen_heads=["16x16"], varlen_backward=False, jobs=0),
}
TRAINING = ("forward", "backward", "forward+backward")
# The passes each pass-specific flag goes with; the other passes refuse it.
FLAG_PASSES = {
    **dict.fromkeys(("seqlens", "variants", "families", "dkdv_blocks", "heavy_groups", "forward_blocks", "no_naive",
                     "rounds", "rescale_slack", "deterministic", "fp8"), TRAINING),
    "causal": (*TRAINING, "varlen"),
    **dict.fromkeys(("decode_shapes", "decode_heads", "page_sizes", "seqlen_q", "num_splits", "page_aligned"),
                    ("decode",)),
    **dict.fromkeys(("varlen_lengths", "varlen_heads", "varlen_backward", "jobs"), ("varlen",)),
}


def pass_kind(which):
    return which if which in ("decode", "varlen") else "training"


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headdims", type=int, nargs="+", default=None,
                        help="default 64 128 256 (decode, varlen: 128)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=None, help="default 512 ... 16384")
    parser.add_argument("--dtypes", nargs="+", default=None,
                        help="default float16 bfloat16 (decode, varlen: float16)")
    parser.add_argument("--causal", choices=["no", "yes", "both"], default=None, help="default both")
    parser.add_argument(
        "--variants", nargs="+", default=None, metavar="NAME",
        help=f"attention variants from nbflash.catalogue ({', '.join(VARIANTS)}), each a row, instead of "
        "--causal; adds FlexAttention (torch.compile) as an anchor; FLOPs count the visible scores only",
    )
    parser.add_argument("--families", nargs="+", default=None, help=f"default {' '.join(configs.FAMILIES)}; "
                        "'default' times the planner's choice (no family forced)")
    parser.add_argument("--no-naive", action="store_true", default=None)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-flex", action="store_true",
                        help="with --variants: leave FlexAttention out (its torch.compile takes minutes)")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per entry")
    parser.add_argument("--markdown", help="also write the table, with GPU, date and command, to this file")
    parser.add_argument(
        "--pass", dest="which", choices=[*PASSES, "decode", "varlen"], default="forward",
        help="time the forward, the backward alone (FLOPs counted as 2.5x the forward's), or both "
        "(3.5x); or decode: flash_attn_with_kvcache against a KV cache, as bandwidth; or varlen: "
        "flash_attn_varlen_func's forward on a batch of mixed lengths",
    )
    parser.add_argument(
        "--heavy-groups", type=int, nargs="+", default=None, metavar="G",
        help="--pass forward: also time each family's planned kernel with heavy_groups=G (longest-first "
        "within groups of G (batch, head) pairs), one column each",
    )
    parser.add_argument(
        "--forward-blocks", nargs="+", default=None, metavar="MxNxW",
        help="--pass forward: also time the tensor-core forward with these (block_m, block_n, num_warps) in "
        "place of the table's, one column each, e.g. 64x32x2",
    )
    parser.add_argument(
        "--rescale-slack", type=float, nargs="+", default=None, metavar="S",
        help="--pass forward: also time the families' planned forward with rescale_slack=S (lazy rescaling: "
        "powers of 2 that P may reach before the maxima move; 0: eager, to time against the configs that plan "
        f"it, the mma forward at headdims 65-128; families {', '.join(RESCALE_SLACK_FAMILIES)}), one column each",
    )
    parser.add_argument(
        "--fp8", action="store_true", default=None,
        help="--pass forward: also time the fp8 forward (compute capability 9.0: e4m3 q, k and v, bfloat16 "
        "out), column 'nbflash fp8', on each row's inputs rounded to e4m3 (descales 1; FLOPs as the row's); "
        "plain and causal rows only",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, metavar="R",
        help="time every column R times, taking turns (each column once a round, after all are built; the "
        "order rotated each round, so give R at least the number of columns), and "
        "report each column's median round; the spread (lowest, highest) goes to stderr. Default 1",
    )
    parser.add_argument(
        "--deterministic", action="store_true", default=None,
        help="--pass backward or forward+backward: also time each family's backward with deterministic=True "
        "(no atomics: a fixed order), one column each",
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
    decode.add_argument("--page-aligned", action="store_true", default=None,
                        help="paged rows also time the other paged copy than the default's (kvcache.PAGE_ALIGNED_COPIES: "
                        "one block-table lookup a warp share where pages allow, or one a row), columns 'per-row us' / "
                        "'per-row BW' (or 'aligned ...' when the default is per row)")
    varlen = parser.add_argument_group("--pass varlen")
    varlen.add_argument(
        "--varlen-lengths", nargs="+", default=None, metavar="SET",
        help="the batches of sequence lengths, one row each: uniform:TOTAL:MAX, lengths drawn uniformly "
        "from [MAX / 4, MAX] (seed 0) until they add up to TOTAL tokens (the last one cut to fit), or a "
        "comma-separated list such as 128,512,4096; default " + " ".join(DEFAULTS["varlen"]["varlen_lengths"]))
    varlen.add_argument("--varlen-backward", action="store_true", default=None,
                        help="also flash_attn_varlen_backward with the sm90 and the mma dK/dV kernels, columns "
                        "'bwd sm90' and 'bwd mma' (TFLOP/s, FLOPs 2.5x the forward's)")
    varlen.add_argument("--varlen-heads", nargs="+", default=None, metavar="HxHK",
                        help="query heads x KV heads; default 16x16 (16x4: GQA)")
    varlen.add_argument("--jobs", type=int, default=None,
                        help="first compile the forward kernels the run needs in this many processes at once "
                        "(into the on-disk kernel cache, as scripts/prebuild_cache.py does; needs ptxas); "
                        "0, the default: each compiles on first use")
    return parser


def resolve_arguments(parser, args):
    """Fill in the pass's defaults; reject the flags that belong to another kind of pass."""
    kind = pass_kind(args.which)
    for name, passes in FLAG_PASSES.items():
        if args.which not in passes and getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            home = ", ".join(passes[:-1]) + " or " + passes[-1] if len(passes) > 1 else passes[0]
            parser.error(f"{flag} does not apply to --pass {args.which} (it goes with --pass {home})")
    for name, value in DEFAULTS[kind].items():
        if getattr(args, name) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)
    if kind == "decode":
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
    elif kind == "varlen":
        args.varlen_lengths = [parse_lengths(parser, text) for text in args.varlen_lengths]
        args.varlen_heads = [parse_pair(parser, "--varlen-heads", text) for text in args.varlen_heads]
        for nheads, nheads_k in args.varlen_heads:
            if nheads % nheads_k:
                parser.error(f"--varlen-heads {nheads}x{nheads_k}: query heads must be a multiple of KV heads")
        if args.jobs < 0:
            parser.error("--jobs must be >= 0 (0: compile each kernel on first use)")
    else:
        args.dkdv_blocks = args.dkdv_blocks or []
        args.heavy_groups = args.heavy_groups or []
        args.forward_blocks = args.forward_blocks or []
        if args.forward_blocks and args.which != "forward":
            parser.error("--forward-blocks goes with --pass forward")
        for blocks in args.forward_blocks:
            parts = blocks.lower().split("x")
            if len(parts) != 3 or not all(part.isdigit() and int(part) > 0 for part in parts):
                parser.error(f"--forward-blocks {blocks!r}: expected three positive integers as MxNxW, e.g. 64x32x2")
        args.fp8 = bool(args.fp8)
        if args.fp8 and args.which != "forward":
            parser.error("--fp8 goes with --pass forward (the fp8 path has no backward)")
        if args.fp8 and args.variants and set(args.variants) - {"plain", "causal"}:
            parser.error("--fp8 times plain and causal rows only (the fp8 forward takes softmax_scale, causal "
                         "and window_size)")
        if args.heavy_groups and args.which != "forward":
            parser.error("--heavy-groups goes with --pass forward")
        if any(g <= 0 for g in args.heavy_groups):
            parser.error("--heavy-groups takes positive group sizes")
        args.rescale_slack = args.rescale_slack or []
        if args.rescale_slack and args.which != "forward":
            parser.error("--rescale-slack goes with --pass forward")
        if any(not 0 <= slack <= 8 for slack in args.rescale_slack):
            parser.error("--rescale-slack takes values in [0, 8] (0: eager, the rescale at every tile)")
        args.no_naive = bool(args.no_naive)
        args.deterministic = bool(args.deterministic)
        if args.deterministic and args.which == "forward":
            parser.error("--deterministic goes with --pass backward or forward+backward")
        args.rounds = 1 if args.rounds is None else args.rounds
        if args.rounds < 1:
            parser.error("--rounds must be >= 1")
    return args


def parse_lengths(parser, text):
    """One --varlen-lengths set -> (its text, the list of lengths), or a parser error naming the flag."""
    parts = text.lower().split(":")
    if parts[0] == "uniform":
        if len(parts) != 3 or not all(part.isdigit() and int(part) > 0 for part in parts[1:]):
            parser.error(f"--varlen-lengths {text!r}: expected uniform:TOTAL:MAX with two positive integers, "
                         "e.g. uniform:16384:2048")
        return text, uniform_lengths(int(parts[1]), int(parts[2]))
    items = text.split(",")
    if not all(item.strip().isdigit() and int(item) > 0 for item in items):
        parser.error(f"--varlen-lengths {text!r}: expected uniform:TOTAL:MAX or positive lengths separated by "
                     "commas, e.g. 128,512,4096")
    return text, [int(item) for item in items]


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
    if args.which == "varlen":
        return varlen_main(args, argv)

    flop_factor, nbflash_pass, sdpa = PASSES[args.which]
    runners = {f"nbflash {f}": nbflash_pass(f) for f in args.families}
    for groups in args.heavy_groups:
        for family in args.families:
            runners[f"nbflash {family} g{groups}"] = nbflash_replaced_runner(family, heavy_groups=groups)
    for slack in args.rescale_slack:
        for family in args.families:
            if family in RESCALE_SLACK_FAMILIES:
                name = f"lazy{slack:g}" if slack else "eager"
                runners[f"nbflash {family} {name}"] = nbflash_replaced_runner(family, rescale_slack=slack)
    for blocks in args.forward_blocks:
        block_m, block_n, num_warps = map(int, blocks.split("x"))
        runners[f"nbflash mma {blocks}"] = nbflash_replaced_runner("mma", block_m=block_m, block_n=block_n,
                                                                   num_warps=num_warps)
    if args.fp8:
        runners["nbflash fp8"] = nbflash_fp8_runner
    if args.deterministic:
        for family in args.families:
            runners[f"nbflash {family} det"] = nbflash_pass(family, deterministic=True)
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
    if args.variants and not args.no_torch and not args.no_flex and importlib.util.find_spec("torch"):
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
        flops = 4 * visible_pairs(batch, nheads, seqlen, causal, variant) * headdim * flop_factor
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
        timers = {}
        for name, make in runners.items():
            if name.startswith("SDPA") and dtype == "float32":
                row[name] = "-"
                continue
            try:
                call = make(q, k, v, causal, **variant)
                timers[name] = (call.time_ms if isinstance(call, BackwardOnly)
                                else functools.partial(time_ms, call, before=getattr(call, "before", None)))
            except Exception as error:  # unsupported by a backend, ...
                row[name] = failure(name, error)
        rates = {name: [] for name in timers}
        for round_ in range(args.rounds):  # the columns take turns, so that a drift of the clocks hits each
            # alike, their order rotated each round: the column timed last in a row of blocks can read
            # 5-14% slow on an H100 held at its power cap (docs/perf-notes.md, "Timing order")
            order = list(timers.items())
            shift = round_ % len(order) if order else 0
            for name, timer in order[shift:] + order[:shift]:
                if name in row:  # failed in an earlier round
                    continue
                try:
                    rates[name].append(flops / timer(warmup=2, repeats=10, budget_s=args.budget) / 1e9)
                except Exception as error:  # out of memory, ...
                    row[name] = failure(name, error)
                cupy.get_default_memory_pool().free_all_blocks()
        for name, measured in rates.items():
            if name not in row:
                row[name] = round(float(np.median(measured)), 1)
                if args.rounds > 1:
                    print(f"  {name}: {len(measured)} rounds, {min(measured):.1f} .. {max(measured):.1f}",
                          file=sys.stderr)
        # The columns in the runners' order, whichever round filled them.
        row = {**{key: value for key, value in row.items() if key not in runners},
               **{name: row[name] for name in runners if name in row}}
        ours = [row[n] for n in runners
                if n.startswith("nbflash") and n != "nbflash fp8" and isinstance(row[n], float)]
        for anchor in ("SDPA flash", "naive CuPy", "Flex"):
            if ours and isinstance(row.get(anchor), float):
                row[f"best/{anchor}"] = round(max(ours) / row[anchor], 2)
        if isinstance(row.get("nbflash fp8"), float):  # fp8 against the row's 16-bit kernels and cuDNN
            for name, other in (("fp8/best", max(ours, default=None)), ("fp8/cuDNN", row.get("SDPA cuDNN"))):
                if isinstance(other, float):
                    row[name] = round(row["nbflash fp8"] / other, 2)
        rows.append(row)
        print(f"[{index + 1}/{len(cases)}] {row}", file=sys.stderr, flush=True)
        if args.markdown:  # after every row, so that a run cut short still leaves its table
            write_markdown(args, argv, rows, len(cases))
    print(f"GPU: {gpu_name()}, nbflash {nbflash.__version__}")
    print(title(args.which))
    print(tabulate(rows, headers="keys"))


# ---------------------------------------------------------------- the decode pass

SDPA_BACKENDS = {"SDPA flash": "FLASH_ATTENTION", "SDPA efficient": "EFFICIENT_ATTENTION",
                 "SDPA cuDNN": "CUDNN_ATTENTION"}
COPY_BYTES = 2**30  # the copy-bandwidth buffer: 1 GiB, far beyond any L2


def copy_bandwidth(budget_s):
    """Device-to-device copy bandwidth in bytes/s: (bytes read + bytes written) / time of a copy of a
    1 GiB buffer (copies back to back, as the decode calls are timed), the ceiling a kernel that
    streams its inputs once can approach."""
    source = cupy.ones(COPY_BYTES // 2, np.float16)
    target = cupy.empty_like(source)
    ms = back_to_back_ms(functools.partial(cupy.copyto, target, source), DECODE_BACK_TO_BACK, repeats=20,
                         budget_s=budget_s)
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
    tk, tv, extra = sdpa_gqa(tq, tk, tv)
    if seqlen_q > 1:
        from torch.nn.attention.bias import causal_lower_right

        extra["attn_mask"] = causal_lower_right(seqlen_q, seqlen_k)
    return tq, tk, tv, extra


def sdpa_gqa(tq, tk, tv):
    """(tk, tv, keyword arguments) for SDPA on (batch, heads, seqlen, d) tensors, with fewer KV heads
    than query heads too: enable_gqa, or on a torch before 2.5 (no enable_gqa) the KV heads repeated."""
    import torch

    extra = {}
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5):
        extra["enable_gqa"] = tq.shape[1] != tk.shape[1]
    elif tq.shape[1] != tk.shape[1]:
        group = tq.shape[1] // tk.shape[1]
        tk, tv = (x.repeat_interleave(group, dim=1) for x in (tk, tv))
    return tk, tv, extra


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


# Decode calls timed together between two CUDA events, back to back (a call's host time then
# overlaps the calls queued before it, as in a model's decode step, layer after layer).
DECODE_BACK_TO_BACK = 20


def decode_title(copy_bytes_per_s):
    return (
        f"decode: microseconds per call ({DECODE_BACK_TO_BACK} calls back to back between two CUDA events, "
        "median) and KV bytes / time as a fraction of the copy bandwidth "
        f"({copy_bytes_per_s / 1e12:.2f} TB/s, read + written, measured in this run the same way); KV bytes = "
        "2 * batch * context * nheads_k * headdim * itemsize; speedup vs X = X's time / nbflash's time "
        "(> 1: nbflash faster); SDPA runs on contiguous K/V; 'nbflash us 1 call': each call alone between "
        "its events, its host time and launch latency included"
    )


def decode_main(args, argv):
    """The decode benchmark: for every dtype, headdim, heads, seqlen_q and (batch, context), the
    SDPA anchors once on contiguous K/V, then nbflash once per layout (contiguous, each page size)."""
    anchors = {}
    if not args.no_torch:
        if importlib.util.find_spec("torch"):
            anchors = SDPA_BACKENDS
        else:
            print("torch not importable: no SDPA anchors", file=sys.stderr)
    bandwidth = copy_bandwidth(args.budget)
    heading = decode_title(bandwidth)
    print(f"copy bandwidth: {bandwidth / 1e12:.3f} TB/s", file=sys.stderr)
    cases = [(dtype, headdim, heads, seqlen_q, shape) for dtype in args.dtypes for headdim in args.headdims
             for heads in args.decode_heads for seqlen_q in args.seqlen_q for shape in args.decode_shapes]
    total = len(cases) * len(args.page_sizes)
    rows = []
    # --page-aligned: paged rows also run the other kind of paged copy than the default's
    default_aligned = kvcache.PAGE_ALIGNED_COPIES
    other_copies = "per-row" if default_aligned else "aligned"

    def timed_us(name, make, one_call=False):
        """Median microseconds per call of the call ``make()`` builds, calls back to back (with
        ``one_call``: each call alone between its events, so its host time and launch latency count),
        or '-' when it fails (and why, on stderr)."""
        try:
            call = make()
            if one_call:
                return round(1e3 * time_ms(call, warmup=3, repeats=100, budget_s=args.budget), 1)
            return round(1e3 * back_to_back_ms(call, DECODE_BACK_TO_BACK, repeats=30, budget_s=args.budget), 1)
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
            def ours_runner():
                return nbflash_decode_runner(q, k_cache, v_cache, context, table, args.num_splits)

            ours = timed_us("nbflash", ours_runner)
            row = {"dtype": dtype, "hdim": headdim, "heads": f"{nheads}/{nheads_k}", "seqlen_q": seqlen_q,
                   "shape": f"{batch}x{context}", "layout": "contiguous" if page is None else f"paged {page}",
                   "nbflash us": ours, "nbflash BW": fraction(ours),
                   "nbflash us 1 call": timed_us("nbflash", ours_runner, one_call=True)}
            if args.page_aligned:
                aligned = "-"
                if page is not None:
                    kvcache.PAGE_ALIGNED_COPIES = not default_aligned
                    kvcache.forget_plans()  # a remembered call would keep its plan (and kernel)
                    try:
                        aligned = timed_us(f"nbflash {other_copies}", ours_runner)
                    finally:
                        kvcache.PAGE_ALIGNED_COPIES = default_aligned
                        kvcache.forget_plans()
                row[f"{other_copies} us"], row[f"{other_copies} BW"] = aligned, fraction(aligned)
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


# ---------------------------------------------------------------- the varlen pass

# Calls timed together between two CUDA events, back to back: a call's host time (tens of
# microseconds) then overlaps the kernels queued before it instead of adding to kernels of 0.1-2 ms.
BACK_TO_BACK = 10


def uniform_lengths(total, longest, seed=0):
    """Sequence lengths drawn uniformly from [longest / 4, longest] until they add up to ``total``
    tokens, the last one cut to fit: a prefill batch of mixed lengths, the same in every run."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < total:
        drawn = int(rng.integers(max(1, longest // 4), longest, endpoint=True))
        lengths.append(min(drawn, total - sum(lengths)))
    return lengths


def visible_pairs(batch, nheads, seqlen, causal, variant):
    """The (query, key) pairs a variant's forward computes over the whole batch: the window's (causal
    included), and where the variant has a boolean mask tensor or a mask_mod, only the pairs it keeps
    inside the window (a document mask of three equal runs keeps a third)."""
    window_size = variant.get("window_size", (-1, -1))
    left, right, window = window_bounds(seqlen, seqlen, causal, window_size)
    mask = variant.get("bias")
    if variant.get("mask_mod") is not None:  # asked at b = h = 0 (the catalogue's ignore b and h)
        rows, keys = np.arange(seqlen)[:, None], np.arange(seqlen)[None, :]
        mask = np.broadcast_to(variant["mask_mod"](0, 0, rows, keys), (seqlen, seqlen))
    if mask is None or mask.dtype != np.bool_:
        return batch * nheads * visible_count(seqlen, seqlen, left, right)
    if window:
        from nbflash.reference import visible

        mask = mask & visible(seqlen, seqlen, causal, window_size, xp=np if isinstance(mask, np.ndarray) else cupy)
    # A mask broadcast over batch or heads (size-1 or missing leading dimensions) counts once per
    # (batch, head) it stands for.
    leading = int(np.prod(mask.shape[:-2], dtype=np.int64)) if mask.ndim > 2 else 1
    return int(mask.sum()) * batch * nheads // leading


@functools.lru_cache(maxsize=None)
def visible_scores(seqlen, causal):
    """The (query, key) pairs one sequence computes: seqlen^2, or seqlen (seqlen + 1) / 2 causal."""
    left, right, _ = window_bounds(seqlen, seqlen, causal, (-1, -1))
    return visible_count(seqlen, seqlen, left, right)


def varlen_flops(lengths, nheads, headdim, causal):
    """The forward's FLOPs over a batch of these lengths: 4 H D x each sequence's visible scores, summed."""
    return 4 * nheads * headdim * sum(visible_scores(n, causal) for n in lengths)


def packed_batch(lengths, nheads, nheads_k, headdim, dtype):
    """Random q (total, nheads, headdim), k and v (total, nheads_k, headdim), and the int32 offsets."""
    total = sum(lengths)
    q = random_device((total, nheads, headdim), dtype)
    k, v = (random_device((total, nheads_k, headdim), dtype) for _ in range(2))
    cu_seqlens = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return q, k, v, cu_seqlens


def padded(x, lengths):
    """The packed ``x`` as a (batch, longest, ...) batch, each sequence right-padded with zeros."""
    out = cupy.zeros((len(lengths), max(lengths), *x.shape[1:]), x.dtype)
    start = 0
    for b, n in enumerate(lengths):
        out[b, :n] = x[start:start + n]
        start += n
    return out


def nbflash_varlen_runner(q, k, v, cu_seqlens, longest, causal):
    """flash_attn_varlen_func's forward, validated once outside the timed call (as the dense runners)."""
    problem, q_, k_, v_ = check_varlen(q, k, v, cu_seqlens, cu_seqlens, longest, longest, None, causal, (-1, -1),
                                       0.0, None, 0.0, None, False)
    return lambda: _varlen_forward(problem, q_, k_, v_)


def nbflash_varlen_backward_runner(q, k, v, cu_seqlens, longest, causal, family):
    """flash_attn_varlen_backward on ``family``'s dK/dV kernel (sm90 where it serves the call, else
    the mma family's), from the forward's out and lse made once, untimed."""
    out, lse = nbflash.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal=causal,
                                              return_lse=True)
    dout = random_device(q.shape, q.dtype)

    def call():
        with forcing(family):
            return nbflash.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens, cu_seqlens, longest, longest,
                                                      causal=causal)

    return call


def sdpa_padded_runner(backend_name, q, k, v, lengths, causal):
    """SDPA restricted to one backend on the right-padded (batch, longest, heads, d) batch: causal
    with is_causal (every real row then sees only real keys), otherwise with a boolean key padding
    mask (batch, 1, 1, longest)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
    tk, tv, extra = sdpa_gqa(tq, tk, tv)
    if causal:
        extra["is_causal"] = True
    else:
        keys = torch.arange(tk.shape[2], device=tq.device)
        extra["attn_mask"] = (keys[None, :] < torch.tensor(lengths, device=tq.device)[:, None])[:, None, None, :]

    def call():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **extra)

    return call


def sdpa_jagged_runner(q, k, v, cu_seqlens, lengths, causal):
    """SDPA's flash backend on nested (jagged) tensors over the packed arrays: PyTorch's own path
    for packed sequences, no padding."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    offsets = torch.from_dlpack(cu_seqlens).long()

    def nested(x):
        values = torch.from_dlpack(x)
        try:  # the bounds given, so that SDPA need not read them back from the offsets
            tensor = torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=min(lengths),
                                                            max_seqlen=max(lengths))
        except TypeError:  # a torch before 2.5
            tensor = torch.nested.nested_tensor_from_jagged(values, offsets)
        return tensor.transpose(1, 2)

    tq, tk, tv = (nested(x) for x in (q, k, v))
    extra = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}

    def call():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, **extra)

    return call


def kernel_statics(dtype, headdim, nheads, nheads_k, causal):
    """The static parts (Problem.static, what the kernels compile for) of a case's dense and packed
    problems, from tiny inputs of the same kind."""
    q, k, v, cu_seqlens = packed_batch([64], nheads, nheads_k, headdim, SUPPORTED[dtype])
    dense = check_forward(q[None], k[None], v[None], None, causal)[0]
    packed = check_varlen(q, k, v, cu_seqlens, cu_seqlens, 64, 64, None, causal, (-1, -1), 0.0, None, 0.0, None,
                          False)[0]
    return dense.static, packed.static


def prebuild(statics, jobs):
    """Compile the forward kernels of these static parts in ``jobs`` processes at once into the on-disk
    kernel cache, which the run then loads them from (scripts/prebuild_cache.py's build step). On any
    failure (no ptxas, ...) the kernels compile on first use instead."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import prebuild_cache
    from nbflash import cubin_cache

    capability = cupy.cuda.Device().compute_capability  # e.g. "90"
    cc = (int(capability[:-1]), int(capability[-1]))
    wanted = list(dict.fromkeys(configs.plan_forward(static) for static in statics))
    start = time.time()
    # The workers touch no GPU; spawned, they start clear of this process's CUDA state.
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for config, status, seconds in pool.map(prebuild_cache.build_one, wanted, [cc] * len(wanted),
                                                    [str(cubin_cache.cache_dir())] * len(wanted)):
                print(f"  {status} {seconds:5.1f} s  {config}", file=sys.stderr, flush=True)
    except (Exception, SystemExit) as error:
        print(f"prebuild failed ({type(error).__name__}: {str(error)[:160]}): kernels compile on first use",
              file=sys.stderr)
    print(f"prebuild: {len(wanted)} kernels, {time.time() - start:.0f} s", file=sys.stderr, flush=True)


def varlen_title():
    return (
        "varlen: forward TFLOP/s on a batch of mixed lengths, FLOPs = 4 H D x the visible scores summed over "
        f"the sequences (L^2 each, L (L + 1) / 2 causal); time: median of CUDA events around {BACK_TO_BACK} "
        "back-to-back calls, over the calls, for every column. nbflash varlen: flash_attn_varlen_func on the packed "
        "batch. nbflash dense eq: the dense kernel on the same tokens as equal lengths (batch = seqs, seqlen = "
        "tokens / seqs rounded), over its own FLOPs. nbflash dense pad: the dense kernel on the batch "
        "right-padded to the longest sequence (pad % of it padding), over the real FLOPs: what padding costs "
        "(it masks nothing, so without causal the real rows also see the padding). SDPA flash, efficient, "
        "cuDNN: one backend each on the padded batch, over the real FLOPs; causal with is_causal (right "
        "padding: real rows see only real keys), non-causal with a boolean key padding attn_mask, which the "
        "flash backend does not take ('-'). SDPA jagged: SDPA's flash backend on nested jagged tensors (no "
        "padding). varlen/X: nbflash varlen's TFLOP/s over X's (> 1: varlen faster); varlen/SDPA pad: over "
        "the fastest SDPA backend on the padded batch."
    )


def varlen_main(args, argv):
    """The varlen benchmark: for every dtype, headdim, heads, causal and set of lengths, nbflash's
    packed forward, the dense kernel on equal lengths and on the padded batch, and the SDPA anchors."""
    anchors, jagged = {}, False
    if not args.no_torch:
        if importlib.util.find_spec("torch"):
            anchors, jagged = SDPA_BACKENDS, True
        else:
            print("torch not importable: no SDPA anchors", file=sys.stderr)
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    kinds = [(dtype, headdim, heads, causal) for dtype in args.dtypes for headdim in args.headdims
             for heads in args.varlen_heads for causal in causals]
    cases = [(*kind, lengths) for kind in kinds for lengths in args.varlen_lengths]
    if args.jobs:
        prebuild([static for (dtype, headdim, (nheads, nheads_k), causal) in kinds
                  for static in kernel_statics(dtype, headdim, nheads, nheads_k, causal)], args.jobs)
    heading = varlen_title()
    rows = []
    for index, (dtype, headdim, (nheads, nheads_k), causal, (label, lengths)) in enumerate(cases):
        element = SUPPORTED[dtype]
        count, total, longest = len(lengths), sum(lengths), max(lengths)
        flops = varlen_flops(lengths, nheads, headdim, causal)

        def tflops(name, make, flops=flops):
            """TFLOP/s of the call ``make()`` builds, or why not ('oom', 'n/a'; the error on stderr)."""
            try:
                call = make()

                def calls():
                    for _ in range(BACK_TO_BACK):
                        call()

                ms = time_ms(calls, warmup=2, repeats=10, budget_s=args.budget) / BACK_TO_BACK
                return round(flops / ms / 1e9, 1)
            except Exception as error:  # out of memory, a backend refusing the shape, ...
                return failure(name, error)

        row = {"dtype": dtype, "hdim": headdim, "heads": f"{nheads}/{nheads_k}", "causal": causal, "lengths": label,
               "seqs": count, "tokens": total, "max": longest, "pad %": round(100 * (1 - total / (count * longest)), 1)}
        q, k, v, cu_seqlens = packed_batch(lengths, nheads, nheads_k, headdim, element)
        row["nbflash varlen"] = tflops("nbflash varlen",
                                       lambda: nbflash_varlen_runner(q, k, v, cu_seqlens, longest, causal))
        mean = max(1, round(total / count))
        equal = [random_device((count, mean, heads, headdim), element) for heads in (nheads, nheads_k, nheads_k)]
        row["nbflash dense eq"] = tflops("nbflash dense eq", lambda: nbflash_runner(None)(*equal, causal),
                                         count * varlen_flops([mean], nheads, headdim, causal))
        equal = None
        release_memory()
        batch = [padded(x, lengths) for x in (q, k, v)]
        row["nbflash dense pad"] = tflops("nbflash dense pad", lambda: nbflash_runner(None)(*batch, causal))
        for name, backend in anchors.items():
            if dtype == "float32" or (backend == "FLASH_ATTENTION" and not causal):
                row[name] = "-"  # SDPA's fused kernels take no float32; its flash backend no attn_mask
            else:
                row[name] = tflops(name, lambda: sdpa_padded_runner(backend, *batch, lengths, causal))
        if jagged:
            row["SDPA jagged"] = "-" if dtype == "float32" else tflops(
                "SDPA jagged", lambda: sdpa_jagged_runner(q, k, v, cu_seqlens, lengths, causal))
        if args.varlen_backward:  # the backward's dK/dV kernel of each family, FLOPs 2.5x the forward's
            for family in ("sm90", "mma"):
                row[f"bwd {family}"] = "-" if dtype == "float32" else tflops(
                    f"bwd {family}", lambda family=family: nbflash_varlen_backward_runner(
                        q, k, v, cu_seqlens, longest, causal, family), 2.5 * flops)

        def over(other):
            ours = row["nbflash varlen"]
            return round(ours / other, 2) if isinstance(ours, float) and isinstance(other, float) and other else "-"

        row["varlen/dense eq"] = over(row["nbflash dense eq"])
        row["varlen/dense pad"] = over(row["nbflash dense pad"])
        if anchors:
            measured = [row[name] for name in anchors if isinstance(row[name], float)]
            row["varlen/SDPA pad"] = over(max(measured)) if measured else "-"
        if jagged:
            row["varlen/SDPA jagged"] = over(row["SDPA jagged"])
        rows.append(row)
        print(f"[{index + 1}/{len(cases)}] {row}", file=sys.stderr, flush=True)
        if args.markdown:  # after every row, so that a run cut short still leaves its table
            write_markdown(args, argv, rows, len(cases), heading)
        q = k = v = cu_seqlens = batch = None
        release_memory()
    print(f"GPU: {gpu_name()}, nbflash {nbflash.__version__}")
    print(heading)
    print(tabulate(rows, headers="keys"))


def failure(name, error):
    """A column's entry for a runner that raised: 'oom' or 'n/a', the error on stderr."""
    print(f"  {name}: {type(error).__name__}: {str(error)[:120]}", file=sys.stderr)
    return "oom" if "memory" in str(error).lower() else "n/a"


def release_memory():
    """Hand cached device memory back between cases (multi-GiB caches come and go), CuPy's and torch's."""
    cupy.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        sys.modules["torch"].cuda.empty_cache()


def gpu_name():
    return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()


def title(which):
    factor = {"forward": "", "backward": ", x2.5 backward; torch's: a fresh forward before each, untimed",
              "forward+backward": ", x3.5 forward+backward"}
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

