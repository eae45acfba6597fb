"""The public attention functions. Names and arguments follow flash-attn's Python interface."""

import contextlib
import dataclasses
import math
import numbers
from functools import lru_cache

import numpy as np

from . import configs, launch, runtime, validation
from .block_mask import kernel_params
from .dtypes import BFLOAT16, FLOAT8_E4M3, FLOAT32
from .kernels.transpose_fp8 import Fp8TransposeConfig
from .problem import Variant, window_bounds
from .reference import attention_probabilities

LOG2_E = math.log2(math.e)


@lru_cache(maxsize=None)
def _forward_kernel(static, family):
    """The compiled kernel for a problem's static part; one cache lookup per call."""
    config = configs.plan_forward(static, family)  # a family that cannot serve the call says so itself
    with user_functions_compile(static.variant):
        return launch.compiled(config, static.device)


@contextlib.contextmanager
def user_functions_compile(variant):
    """Compiling kernels with the caller's score_mod / mask_mod: a failure is the function's, so
    the error says so, with Numba's message."""
    try:
        yield
    except Exception as error:
        if not (variant.score_mod or variant.mask_mod):
            raise
        raise TypeError(f"score_mod / mask_mod could not be compiled into the kernel (they take and return "
                        f"scalars: score_mod(score, b, h, q_idx, kv_idx) -> float, mask_mod(b, h, q_idx, "
                        f"kv_idx) -> bool); Numba said:\n{error}") from error


def _kernel_for(problem, family=None):
    return _forward_kernel(problem.static, family or configs.forced_family())


def _flash_attn_forward(problem, q, k, v, family=None):
    """Run the forward pass on validated inputs; returns (out, lse) as backend arrays."""
    return _launch_forward(_kernel_for(problem, family), problem, q, k, v)


def _launch_forward(kernel, problem, q, k, v):
    """``kernel`` (a compiled forward) on validated inputs; returns (out, lse)."""
    config = kernel.config
    out, lse = launch.empty_pair(q.shape, q.dtype, (problem.batch, problem.nheads, problem.seqlen_q), FLOAT32)
    grid = config.grid(problem.batch, problem.nheads, problem.seqlen_q)
    # The problem stands for the five arrays' shapes and strides (validation remembers it per layout).
    kernel.launch(grid, (q, k, v, out, lse), (problem.softmax_scale * LOG2_E,), kernel_params(problem, config),
                  problem)
    return out, lse


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, return_lse=False, bias=None,
                    score_mod=None, mask_mod=None, block_mask=None, seed=None, q_descale=None, k_descale=None,
                    v_descale=None, fp8_dtype=None):
    """Exact scaled dot-product attention, softmax(q k^T * softmax_scale) v, in O(seqlen) memory.

    flash-attn 2.8's ``flash_attn_func``: the same arguments in the same order, so that a call
    written for flash-attn runs unchanged (``return_lse`` is nbflash's, keyword-only).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim)
        k: (batch, seqlen_k, nheads_k, headdim)
        v: (batch, seqlen_k, nheads_k, headdim)
            float16, bfloat16 or float32, all the same; headdim 1 to 256. nheads must be a multiple
            of nheads_k (grouped-query / multi-query attention): query head h uses key/value head
            h // (nheads // nheads_k). Any strides, but the last dim contiguous. On a GPU: CuPy
            arrays, or any GPU array exporting DLPack or __cuda_array_interface__ (a PyTorch
            tensor is used without a copy). Under Numba's CUDA simulator: NumPy arrays.
        dropout_p: float in [0, 1). Attention dropout: each probability is dropped with chance
            dropout_p (kept ones scaled by 1 / (1 - dropout_p)), by a Philox counter-based
            generator keyed by ``seed``, so the backward regenerates the same mask. Each score
            draws a random byte (as flash-attn 2's kernels do), so dropout_p is rounded to a
            multiple of 1/256 (0.1 drops 26/256 = 0.1016 of the scores) and the kept scale is the
            exact inverse of the kept fraction, so the expectation is unchanged.
        softmax_scale: float. Default 1 / sqrt(headdim). Any finite value, 0 and negative included.
        causal: bool. Causal mask aligned to the bottom-right corner of the score matrix, as in
            flash-attn >= 2.1: the window (-1, 0). For seqlen_q = 2, seqlen_k = 5 (1 = kept,
            0 = masked)::

                1 1 1 1 0
                1 1 1 1 1

            and for seqlen_q = 5, seqlen_k = 2::

                0 0
                0 0
                0 0
                1 0
                1 1

        window_size: (left, right), -1 for unbounded. Sliding-window (local) attention: query i sees
            key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right. With
            causal=True, right is 0. Key tiles outside the band are never visited.
        softcap: float >= 0. When > 0, each scaled score x becomes softcap * tanh(x / softcap)
            (Gemma 2, Grok), before ALiBi and the mask.
        alibi_slopes: float32 array of shape (nheads,) or (batch, nheads), on q's device: a bias
            of -slope * |i + seqlen_k - seqlen_q - j| is added to the score of query i and key j.
        deterministic: bool. flash-attn's flag for the backward; the forward is deterministic
            whatever it says (nbflash.torch passes it on to the backward).
        return_attn_probs: bool. Also return the log-sum-exp and S_dmask, the attention
            probabilities P as float32 (batch, nheads, seqlen_q, seqlen_k), negated where dropout
            dropped them (flash-attn's encoding). A debugging aid: S_dmask
            is computed apart from the kernel (N x N memory; flash-attn pads its last two dims to
            multiples of 128, nbflash does not).
        return_lse: bool (nbflash). Also return the log-sum-exp of each score row.
        bias: (nbflash) a tensor broadcastable to (batch, nheads, seqlen_q, seqlen_k) (missing leading
            dims and size-1 dims broadcast, read with stride 0; no copy). Float (float32 or q's
            dtype): added to the scores after softcap and ALiBi (T5-style position biases). Bool:
            a mask, True = kept (document masks for packed sequences). Every tile then tests it;
            neither gets a gradient.
        score_mod: (nbflash) a Python function ``score_mod(score, b, h, q_idx, kv_idx) -> score``,
            FlexAttention's convention: applied to each scaled score after the built-in features,
            compiled into the kernel (Numba device code: scalars in, a float out; it may read
            constants and NumPy arrays it captures, which become kernel constants). The backward
            needs its derivative (``flash_attn_backward(..., score_mod_grad=...)``).
        mask_mod: (nbflash) ``mask_mod(b, h, q_idx, kv_idx) -> bool``, True = kept; every tile then
            tests it.
        block_mask: (nbflash) ``nbflash.create_block_mask(mask_mod, B, H, seqlen_q, seqlen_k)``
            (FlexAttention's convention; B, H None to broadcast): mask_mod with each (query tile, key
            tile) pair classified on the GPU as empty (skipped: no loads, no math), full (no mask
            test) or partial (mask_mod asked per element). Implies its mask_mod (passing another
            one too is an error); its B, H and lengths must be the call's. The same values as
            ``mask_mod=`` alone, with less work where the mask is sparse (document masks, blocks).
        seed: (nbflash) dropout's 64-bit seed: the same seed gives bit-identical results. None
            draws a fresh one; ``nbflash.last_dropout_seed()`` reads it back (the backward needs
            it: ``flash_attn_backward(..., dropout_p, ..., seed=...)``).
        q_descale, k_descale, v_descale: FlashAttention-3's fp8 forward. With q, k, v of dtype
            float8_e4m3fn (ml_dtypes' e4m3), or uint8 arrays of e4m3 bytes with
            ``fp8_dtype="float8_e4m3fn"`` (on compute capability 9.0 only, an error elsewhere),
            attention of the dequantized inputs q * q_descale, k * k_descale, v * v_descale: each a
            float32 of shape (batch, nheads_k) (query head h takes row h // (nheads // nheads_k)),
            a scalar, or None (1). Then headdim is a multiple of 16 up to 256, the rows 16-byte
            aligned, out is bfloat16, and softmax_scale, causal, window_size and return_lse /
            return_attn_probs (lse only: S_dmask is None) are the only other arguments taken; no
            backward. P is rounded to e4m3 for P V, as in FlashAttention-3. V is transposed into
            a new array on each call (wgmma reads 8-bit operands K-major only): one read and one
            write of V's bytes. Its GPU tests have not passed yet: on an H200 they stopped at
            uploading float8 to CuPy; the same path run on uint8 CuPy storage outside the tests met
            the out bound in 6 of 6 cases, lse's 1e-4 in 3 (docs/benchmarks.md).
        fp8_dtype: (nbflash) None, or "float8_e4m3fn": q, k and v are uint8 arrays holding e4m3
            bytes, which then take the fp8 forward exactly as float8_e4m3fn arrays do (the kernel
            reads the same bytes). CuPy has no float8 dtype, so this is the route on a GPU::

                q8 = cupy.asarray(q.astype(ml_dtypes.float8_e4m3fn).view(numpy.uint8))  # e4m3 bytes
                out = nbflash.flash_attn_func(q8, k8, v8, causal=True, fp8_dtype="float8_e4m3fn",
                                              q_descale=qd, k_descale=kd, v_descale=vd)  # bfloat16

            uint8 arrays without it are an error, as is fp8_dtype with float16/bfloat16/float32
            arrays; e5m2 is not supported (the fp8 forward reads e4m3 only).

    A query row that sees no key gets output 0 (and lse -inf), whatever the variant.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype; a CuPy array (NumPy under the simulator).
        With return_lse=True, (out, lse); with return_attn_probs=True, (out, lse, S_dmask), as
        flash-attn; lse is (batch, nheads, seqlen_q), float32, natural log.

    The work is queued on CuPy's current stream; the call does not wait for it.
    """
    _check_flag(deterministic, "deterministic")
    _check_flag(return_attn_probs, "return_attn_probs")
    _check_flag(return_lse, "return_lse")
    if (q_descale is not None or k_descale is not None or v_descale is not None or fp8_dtype is not None
            or getattr(q, "dtype", None) == FLOAT8_E4M3):  # FlashAttention-3's fp8 forward
        q, k, v = validation.check_fp8_inputs(q, k, v, fp8_dtype)
        others = dict(dropout_p=dropout_p != 0.0, softcap=softcap != 0.0, alibi_slopes=alibi_slopes is not None,
                      bias=bias is not None, score_mod=score_mod is not None, mask_mod=mask_mod is not None,
                      block_mask=block_mask is not None, seed=seed is not None)
        taken = [name for name, given in others.items() if given]
        if taken:
            raise ValueError(f"the fp8 forward takes softmax_scale, causal and window_size only, not {taken}")
        out, lse = _flash_attn_fp8(q, k, v, softmax_scale, causal, window_size, q_descale, k_descale, v_descale)
        if return_attn_probs:
            return out, lse, None
        return (out, lse) if return_lse else out
    problem, q, k, v = validation.check_forward(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                                bias, score_mod, mask_mod, None, dropout_p, seed, block_mask)
    out, lse = _flash_attn_forward(problem, q, k, v)
    if return_attn_probs:
        mask_mod = block_mask.mask_mod if block_mask is not None else mask_mod
        probs = attention_probabilities(q, k, v, problem.softmax_scale, False, problem.window(), problem.softcap,
                                        problem.alibi_slopes, bias=problem.bias if problem.mask is None else problem.mask,
                                        score_mod=score_mod, mask_mod=mask_mod, dropout_p=problem.dropout_p,
                                        seed=problem.seed)
        return out, lse, probs
    return (out, lse) if return_lse else out


def _fp8_descales(descales, batch, nheads_k, xp):
    """The three descales as one float32 (3, batch, nheads_k) array (the kernel's last param): a
    host scalar (None is 1) fills its row, an array is broadcast and cast into it; no copy from the
    host, one small operation a row."""
    out = xp.empty((3, batch, nheads_k), dtype=np.float32)
    for row, name, d in zip(out, ("q_descale", "k_descale", "v_descale"), descales):
        if d is None:
            d = 1.0
        if isinstance(d, numbers.Real) or getattr(d, "ndim", None) == 0 and isinstance(d, np.generic):
            row.fill(float(d))
            continue
        d = validation.as_backend_array(d, name)
        if d.shape not in ((), (1,), (batch, nheads_k)):
            raise ValueError(f"{name} must be a scalar or of shape (batch, nheads_k) = {(batch, nheads_k)}, "
                             f"got {tuple(d.shape)}")
        row[...] = d.reshape(d.shape if d.ndim == 2 else ())
    return out


FP8_TRANSPOSE = Fp8TransposeConfig()  # the V^T kernel: one config for every shape


def fp8_transposed_v(v):
    """The fp8 kernel's V operand: V^T, (batch, nheads_k, headdim, seqlen_k rounded up to 16) bytes,
    zeros past seqlen_k, the keys of each 16 in FP8_KEY_ORDER, as uint16 byte pairs: one small
    kernel (nbflash/kernels/transpose_fp8.py), one read and one write of V, on the current stream."""
    batch, seqlen_k, nheads_k, headdim = v.shape
    padded = -(-seqlen_k // 16) * 16
    vt = runtime.xp().empty((batch, nheads_k, headdim, padded), dtype=np.uint8)
    launch.compiled(FP8_TRANSPOSE).launch(FP8_TRANSPOSE.grid(batch, nheads_k, headdim, padded),
                                          (v.view(np.uint8).view(np.uint32), vt.view(np.uint32)), ())
    return vt.view(np.uint16)


def _flash_attn_fp8(q, k, v, softmax_scale, causal, window_size, q_descale, k_descale, v_descale):
    """The fp8 forward (see flash_attn_func) on uint8 backend arrays of e4m3 bytes (as
    validation.check_fp8_inputs gives them): checks, V^T, descales, launch. Returns (out, lse)."""
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if x.ndim == 4:
            reason = configs.sm90_fp8_unsupported_reason(x.shape[3], 0 if runtime.SIMULATOR else x.device.id)
            if reason:
                raise ValueError(reason)
        if x.ndim != 4 or 0 in x.shape or x.strides[3] != 1 or not validation.rows_aligned(x):
            raise ValueError(f"{name} must be (batch, seqlen, heads, headdim), none of them 0, with a contiguous "
                             f"last dim and 16-byte aligned rows, got shape {tuple(x.shape)}, strides "
                             f"{tuple(x.strides)}")
    batch, seqlen_q, nheads, headdim = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != headdim or nheads % nheads_k:
        raise ValueError(f"fp8: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v alike, "
                         "batch and headdim as q's, nheads a multiple of nheads_k")
    scale = validation.check_softmax_scale(softmax_scale, headdim)
    if not scale > 0:
        raise ValueError(f"the fp8 forward folds a positive softmax_scale into exp2, got {scale}")
    left, right = validation.check_window_size(window_size)
    left, right, window = window_bounds(seqlen_q, seqlen_k, causal, (left, right))
    config = configs.sm90_fp8_forward_config(headdim, Variant(window=True) if window else Variant())
    xp = runtime.xp()
    params = (np.int32(left), np.int32(right)) if window else ()
    params = (*params, _fp8_descales((q_descale, k_descale, v_descale), batch, nheads_k, xp))
    out, lse = launch.empty_pair(q.shape, BFLOAT16, (batch, nheads, seqlen_q), FLOAT32)
    launch.compiled(config).launch(config.grid(batch, nheads, seqlen_q),
                                   (q.view(np.uint16), k.view(np.uint16), fp8_transposed_v(v), out, lse),
                                   (np.float32(scale * LOG2_E),), params)
    return out, lse


def _check_flag(value, name):
    if value is not True and value is not False and not isinstance(value, np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def explain(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, *,
            bias=None, score_mod=None, mask_mod=None, block_mask=None):
    """Which kernel and configuration ``flash_attn_func(q, k, v, ...)`` runs, without running it.

    Returns a dict: ``family`` ('sm90', 'sm80' or 'portable'), ``config`` (the block configuration and the
    variant), ``grid``, ``block``, ``dynamic_shared_bytes``, and, on a GPU, the compiled kernel's
    ``registers`` per thread, ``static_shared_bytes`` and ``local_bytes`` per thread (spills); and
    ``backward``: what ``flash_attn_backward`` would run for these inputs, as {"default": [...],
    "deterministic": [...]}, each a list of its kernels in a few words (e.g. "Hopper backward dK/dV
    (float16, headdim 128, causal/window)"; planned, not compiled; a dout whose rows are off 16 bytes
    may change it). Compiles the forward kernel if it is not compiled yet. Honors an enclosing
    ``nbflash.kernel_family`` block.
    """
    problem, q, k, v = validation.check_forward(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                                bias, score_mod, mask_mod, block_mask=block_mask)
    kernel = _kernel_for(problem)
    config = kernel.config
    return {
        "family": ("sm90" if isinstance(config, configs.Sm90ForwardConfig)
                   else "sm80" if isinstance(config, configs.MmaForwardConfig) else "portable"),
        "config": {**dataclasses.asdict(config), "block_m": config.block_m, "block_n": config.block_n},
        "grid": config.grid(problem.batch, problem.nheads, problem.seqlen_q),
        "block": (config.threads, 1, 1),
        "dynamic_shared_bytes": kernel.dynamic_shared,
        "static_shared_bytes": kernel.static_shared,
        "registers": kernel.registers,
        "local_bytes": kernel.local_bytes,
        "backward": {
            mode: [launch.describe(c) for c in configs.plan_backward(problem.static, deterministic,
                                                                     configs.forced_family())]
            for mode, deterministic in (("default", False), ("deterministic", True))
        },
    }
