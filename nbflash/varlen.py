"""Packed variable-length sequences: flash-attn 2.8's ``flash_attn_varlen_func`` and its backward.

A batch of sequences of different lengths is packed row after row into q (total_q, nheads, headdim)
and k, v (total_k, nheads_k, headdim), with no padding; ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32,
batch + 1 offsets, on the GPU) say where each sequence's rows start. This is a layout of the same
kernels as ``flash_attn_func`` (``Variant.varlen``), not other kernels: each kernel gets the packed
arrays as views of shape (batch, total, ...) with stride 0 over batch, reads its sequence's bounds
from the offsets (``nbflash.kernels.geometry.packed_sequence``) and narrows its views to those rows;
from there on it is the dense kernel on one sequence. (The Hopper dK/dV kernel takes lse, delta
and the arrays it writes as the packed arrays themselves, a batch of one, and offsets its rows: its
narrowed views would hold their strides in registers it has not got.) The offsets are runtime
values: new lengths never recompile anything.

Checking the offsets: they live on the GPU, and reading them back is a host synchronization, which
the call otherwise never makes. So by default they are checked only where that costs nothing
(under Numba's simulator, where they are host memory); ``check_seqlens=True`` checks them on a GPU
too. Unchecked, the kernels still never read or write outside the arrays: every offset is clamped
to the arrays' rows on the device. Bad offsets then give wrong results for the sequences they
describe, and rows outside every sequence are not written.
"""

import math

import numpy as np

from . import backward, interface, launch, runtime, validation
from .configs import forced_family, packed_dq_tile_rows
from .dtypes import FLOAT32
from .reference import attention_probabilities

LOG2_E = math.log2(math.e)


def _batch_view(x, batch):
    """``x`` as (batch, *x.shape) with stride 0 over batch: every sequence's blocks index the one
    packed array (and narrow it to their rows). Writable: outputs are written through it."""
    xp = runtime.xp()
    return xp.lib.stride_tricks.as_strided(x, (batch, *x.shape), (0, *x.strides))


def _varlen_forward(problem, q, k, v, family=None):
    """The forward on validated packed inputs: (out (total_q, nheads, headdim), lse (nheads, total_q))."""
    kernel = interface._kernel_for(problem, family)
    out, lse = launch.empty_pair(q.shape, q.dtype, (problem.nheads, q.shape[0]), FLOAT32)
    grid = kernel.config.grid(problem.batch, problem.nheads, problem.seqlen_q)  # seqlen_q: max_seqlen_q
    arrays = tuple(_batch_view(x, problem.batch) for x in (q, k, v, out, lse))
    kernel.launch(grid, arrays, (problem.softmax_scale * LOG2_E,), problem.params)
    return out, lse


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, return_lse=False,
                           seed=None, check_seqlens=None):
    """Exact attention over a batch of packed sequences of different lengths (flash-attn 2.8's
    ``flash_attn_varlen_func``: the same arguments in the same order).

    Arguments:
        q: (total_q, nheads, headdim), the batch's query sequences one after another.
        k, v: (total_k, nheads_k, headdim), likewise. dtypes, headdim, GQA, strides and devices as
            in ``flash_attn_func``.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device: sequence b is the rows
            cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1
            of k and v. They start at 0, never decrease and end at total_q / total_k; a sequence
            may be empty (a query row with no key gets out 0, lse -inf).
        max_seqlen_q, max_seqlen_k: ints (host values), at least every sequence's length: they
            size the grid. Rows past max_seqlen_q of a longer sequence would not be computed.
        dropout_p, softmax_scale, softcap, deterministic, seed: as in ``flash_attn_func``. Dropout's
            random stream is keyed by (b, h, row within sequence b, key within it), so the backward
            regenerates it from the same seed.
        causal, window_size: as in ``flash_attn_func``, bottom-right aligned per sequence, to that
            sequence's own (seqlen_q_b, seqlen_k_b).
        alibi_slopes: float32 (nheads,) or (batch, nheads); the bias -slope * |i + seqlen_k_b -
            seqlen_q_b - j| per sequence.
        return_attn_probs: also return lse and S_dmask, float32 (batch, nheads, max_seqlen_q,
            max_seqlen_k), each sequence's probabilities in its top-left corner (zeros elsewhere),
            negated where dropout dropped them. A debugging aid computed apart from the kernel: it
            reads the offsets back to the host and takes N x N memory.
        block_table: paged K/V for packed sequences is not supported (NotImplementedError).
        return_lse: (nbflash) also return lse.
        check_seqlens: (nbflash) check the offsets' values on the host: True always (a GPU
            synchronization), False never, None (default) only where it is free (the simulator).
            Unchecked offsets never make a kernel read or write outside the arrays (module
            docstring).

    Returns:
        out: (total_q, nheads, headdim), q's dtype. With return_lse=True, (out, lse); with
        return_attn_probs=True, (out, lse, S_dmask); lse float32 (nheads, total_q), natural log
        (flash-attn's varlen layout).
    """
    if block_table is not None:
        raise NotImplementedError("block_table (paged K/V) is not supported with packed sequences; pass the keys "
                                  "and values packed as k, v (total_k, nheads_k, headdim), or use "
                                  "nbflash.flash_attn_with_kvcache for paged caches")
    interface._check_flag(deterministic, "deterministic")
    interface._check_flag(return_attn_probs, "return_attn_probs")
    interface._check_flag(return_lse, "return_lse")
    problem, q, k, v = validation.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                                               seed, check_seqlens)
    out, lse = _varlen_forward(problem, q, k, v)
    if return_attn_probs:
        return out, lse, _varlen_probabilities(problem, q, k, v)
    return (out, lse) if return_lse else out


def _varlen_probabilities(problem, q, k, v):
    """S_dmask of packed sequences (flash_attn_varlen_func's return_attn_probs), sequence by sequence."""
    xp = runtime.xp()
    probs = xp.zeros((problem.batch, problem.nheads, problem.seqlen_q, problem.seqlen_k), xp.float32)
    cu_q, cu_k = (np.asarray(c.get() if hasattr(c, "get") else c) for c in (problem.cu_seqlens_q, problem.cu_seqlens_k))
    for b in range(problem.batch):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows_q.stop == rows_q.start or rows_k.stop == rows_k.start:
            continue
        # The window, as flash-attn spells it, for this sequence (problem.window() is the longest's).
        left = -1 if problem.window_left >= problem.seqlen_k else problem.window_left
        right = -1 if problem.window_right >= problem.seqlen_q else problem.window_right
        slopes = None if problem.alibi_slopes is None else problem.alibi_slopes[b]
        p = attention_probabilities(q[None, rows_q], k[None, rows_k], v[None, rows_k], problem.softmax_scale, False,
                                    (left, right), problem.softcap, slopes, dropout_p=problem.dropout_p,
                                    seed=problem.seed, batch_offset=b)
        probs[b, :, : p.shape[2], : p.shape[3]] = p[0]
    return probs


# ---------------------------------------------------------------------------------------------------
# The backward pass
# ---------------------------------------------------------------------------------------------------


def _check_varlen_backward(problem, q, dout, out, lse, deterministic):
    """dout and out like q (total_q, nheads, headdim), lse float32 (nheads, total_q)."""
    checked = []
    for name, x in (("dout", dout), ("out", out)):
        x = validation.as_backend_array(x, name)
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)} (total_q, nheads, headdim), got "
                             f"{tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name}.dtype={x.dtype} differs from q.dtype={q.dtype}; they must match")
        validation._check_layout(x[None], name, "(total_q, nheads, headdim)")
        checked.append(x)
    lse = validation.as_backend_array(lse, "lse")
    if lse.dtype != FLOAT32:
        raise TypeError(f"lse.dtype={lse.dtype} must be float32 (as flash_attn_varlen_func returns it)")
    if tuple(lse.shape) != (problem.nheads, q.shape[0]):
        raise ValueError(f"lse must have shape (nheads, total_q) = {(problem.nheads, q.shape[0])}, got "
                         f"{tuple(lse.shape)}")
    checked.append(lse)
    interface._check_flag(deterministic, "deterministic")
    if not runtime.SIMULATOR:
        for name, x in zip(("dout", "out", "lse"), checked):
            if x.data.device_id != problem.device:
                raise ValueError(f"{name} is on GPU {x.data.device_id} but q is on GPU {problem.device}")
    return checked


def _varlen_backward(problem, dout, q, k, v, out, lse, deterministic=False):
    """The backward on validated packed inputs: (dq, dk, dv) shaped like q, k, v."""
    p = problem
    aligned = p.aligned and validation.rows_aligned(dout[None])
    total_q, total_k = q.shape[0], k.shape[0]
    # dQ tile-major (the sm90 kernel's plan) unless the sequences are too short for it to pay: the
    # largest query tile (128 or 64 rows, or none) whose padding they take (configs.py)
    dq_tiles = packed_dq_tile_rows(p.batch, total_q)
    preprocess, dkdv, dq_kernel = backward._kernels(p.static, deterministic, forced_family(), aligned, False, dq_tiles)
    separate_dq = not dkdv.config.atomic_dq  # dQ by a pass of its own (backward.py)
    dq = launch.empty((1, *q.shape), q.dtype)  # the row-wise convert_dq writes it as a batch of one
    dk = launch.empty(k.shape, k.dtype)
    dv = launch.empty(v.shape, v.dtype)
    delta = launch.empty((1, p.nheads, total_q), FLOAT32)
    # delta stands in for dq_accum without atomics; tile-major, each sequence's tiles start on a whole
    # tile (dq_accum_shape)
    dq_accum, tiles = (delta, False) if separate_dq else backward._dq_accumulator(dkdv.config, p.batch, p.nheads,
                                                                                    total_q, (1, *q.shape))
    scale = np.float32(p.softmax_scale)
    scale_log2 = np.float32(p.softmax_scale * LOG2_E)

    # The row-wise kernels need no sequence bounds: D = rowsum(dO * O) (and dq_accum = 0) for every
    # packed row, as a batch of one.
    rows = (1, p.nheads, p.nheads_k, total_q, total_k)
    preprocess.launch(preprocess.config.grid(*rows), (out[None], dout[None], delta, delta if tiles else dq_accum), ())
    # The tile kernels: one grid row per sequence, on stride-0 views narrowed in the kernel.
    shape = (p.batch, p.nheads, p.nheads_k, p.seqlen_q, p.seqlen_k)  # seqlen_*: the max_seqlen values
    views = [_batch_view(x, p.batch) for x in (q, k, v, dout, lse, delta[0], dk, dv, dq_accum[0], dq[0])]
    if getattr(dkdv.config, "varlen_batch_of_one", False):  # the Hopper kernels offset the packed rows themselves
        dkdv.launch(dkdv.config.grid(*shape), (*views[:4], lse[None], delta, dk[None], dv[None], dq_accum,
                                               *backward._dq_out(dkdv, dq)),
                    (scale_log2, scale), p.params)
    else:
        dkdv.launch(dkdv.config.grid(*shape), views[:9], (scale_log2, scale), p.params)
    if separate_dq and getattr(dq_kernel.config, "varlen_batch_of_one", False):  # the Hopper dQ kernel's rows
        dq_kernel.launch(dq_kernel.config.grid(*shape), (q[None], k[None], v[None], dout[None], lse[None], delta, dq),
                         (scale_log2, scale), p.params)
    elif separate_dq:
        dq_kernel.launch(dq_kernel.config.grid(*shape), views[:6] + views[9:], (scale_log2, scale), p.params)
    elif tiles:  # a block row per sequence, each reading its tiles
        dq_kernel.launch(dq_kernel.config.grid(*shape), (dq_accum, dq, p.cu_seqlens_q), (scale,))
    else:
        dq_kernel.launch(dq_kernel.config.grid(*rows), (dq_accum, dq), (scale,))
    return dq[0], dk, dv


def flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, *, seed=None, check_seqlens=None):
    """Gradients of ``flash_attn_varlen_func`` with respect to q, k and v.

    Arguments: ``dout`` (total_q, nheads, headdim), the gradient of the output; q, k, v, the
    offsets, max_seqlen_q / max_seqlen_k and the variant's arguments exactly as given to
    ``flash_attn_varlen_func``; ``out`` its output and ``lse`` its (nheads, total_q) log-sum-exp
    (``return_lse=True``); ``deterministic`` and ``seed`` (the forward's, with dropout) as in
    ``flash_attn_backward``; ``check_seqlens`` as in ``flash_attn_varlen_func``.

    Returns dq, dk, dv shaped and typed like q, k, v (fresh contiguous arrays); under GQA dk and dv
    are summed over the query heads sharing a key/value head. Extra memory: float32 (nheads,
    total_q) for rowsum(dout * out), and without ``deterministic`` a float32 copy of dq's shape.
    """
    if validation.check_dropout_p(dropout_p) > 0 and seed is None:
        raise ValueError("dropout_p > 0: pass the forward's seed=... so the backward regenerates its dropout mask "
                         "(nbflash.last_dropout_seed() reads back one the forward drew)")
    problem, q, k, v = validation.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                                               seed, check_seqlens)
    dout, out, lse = _check_varlen_backward(problem, q, dout, out, lse, deterministic)
    return _varlen_backward(problem, dout, q, k, v, out, lse, bool(deterministic))
