"""Float64 reference attention: the oracle for the tests, the demo and the benchmarks.

Plain array code, written for clarity. It works on NumPy arrays, and on CuPy arrays when given them
(float64 on the GPU is fast enough for test sizes). Like the kernels, it never holds an N x N matrix
for the whole problem: it walks the (batch, head) pairs and blocks of query rows, so its extra memory
is ``query_block * seqlen_k`` numbers.

Shapes follow flash-attn: q is (batch, seqlen_q, nheads, headdim), k and v are
(batch, seqlen_k, nheads_k, headdim) with ``nheads % nheads_k == 0``.
"""

import math

import numpy as np

from .dtypes import as_numpy_dtype
from .kernels.geometry import visible_keys
from .kernels.philox import dropout_bits_numpy, keep_scale, keep_threshold
from .problem import UNBOUNDED, window_bounds

QUERY_BLOCK = 1024


def _array_module(x):
    """NumPy, or CuPy when ``x`` is a CuPy array."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def visible(seqlen_q, seqlen_k, causal=False, window_size=(UNBOUNDED, UNBOUNDED), xp=np, rows=None):
    """Boolean (len(rows), seqlen_k) mask: True where query row i may attend to key j, or None
    when every row sees every key. The kernels' rule (nbflash/kernels/geometry.py, the same code).

    Windows and causal attention are aligned to the bottom-right corner, as in flash-attn >= 2.1:
    causal is the window (-1, 0), query i seeing key j when ``j <= i + seqlen_k - seqlen_q``. For
    seqlen_q = 2, seqlen_k = 5 (1 = visible)::

        1 1 1 1 0
        1 1 1 1 1

    and for seqlen_q = 5, seqlen_k = 2 the first three rows see no key at all::

        0 0
        0 0
        0 0
        1 0
        1 1
    """
    left, right, window = window_bounds(seqlen_q, seqlen_k, causal, window_size)
    if not window:
        return None
    rows = np.arange(seqlen_q) if rows is None else (rows.get() if hasattr(rows, "get") else rows)
    bounds = np.array([visible_keys(int(row), seqlen_q, seqlen_k, left, right) for row in rows])
    keys = np.arange(seqlen_k)[None, :]
    return xp.asarray((bounds[:, :1] <= keys) & (keys < bounds[:, 1:]))


class _Scores:
    """The scores of one call's variant, as the kernels define them: ``x = q.k * softmax_scale``,
    then softcap (``c * tanh(x / c)``), then ALiBi (``- slope[b, h] * |i + seqlen_k - seqlen_q - j|``),
    then an additive bias tensor, then the window's mask and a boolean mask tensor (-inf)."""

    def __init__(self, xp, seqlen_q, seqlen_k, scale, causal, window_size, softcap, alibi_slopes, batch, bias=None,
                 user=(None, None, None), dropout=(0.0, 0), batch_offset=0):
        self.batch_offset = batch_offset  # dropout's batch index of q's first batch row
        self.xp, self.seqlen_q, self.seqlen_k, self.scale = xp, seqlen_q, seqlen_k, scale
        self.causal, self.window_size, self.softcap = causal, window_size, float(softcap)
        self.slopes = None
        if alibi_slopes is not None:
            slopes = np.asarray(alibi_slopes.get() if hasattr(alibi_slopes, "get") else alibi_slopes, np.float64)
            self.slopes = np.broadcast_to(slopes, (batch, slopes.shape[-1]))
        self.score_mod, self.mask_mod, self.score_mod_grad = user
        self.dropout_p, self.seed = dropout
        self.bias = self.keep = None
        if bias is not None:
            bias = xp.asarray(bias)
            bias = bias.reshape((1,) * (4 - bias.ndim) + tuple(bias.shape))
            if bias.dtype == np.bool_:
                self.keep = bias
            else:
                self.bias = bias.astype(xp.float64)

    def masks(self, blocks):
        return [visible(self.seqlen_q, self.seqlen_k, self.causal, self.window_size, self.xp, rows) for rows in blocks]

    def __call__(self, x, b, h, rows, mask, rounded=None):
        """(s, ds/dx) for the unmasked scaled scores ``x`` of query ``rows`` (ds/dx None when 1);
        ``rounded``: round after each step, as a framework computing in the input dtype would."""
        xp = self.xp
        rounded = rounded or (lambda y: y)
        grad = None
        if self.softcap > 0:
            t = xp.tanh(x / self.softcap)
            x, grad = rounded(self.softcap * t), 1 - t * t
        if self.slopes is not None:
            diagonal = xp.asarray(rows)[:, None] + (self.seqlen_k - self.seqlen_q)  # ``rows`` stays 1-dim: used below
            distance = xp.abs(diagonal - xp.arange(self.seqlen_k)[None, :])
            x = rounded(x - self.slopes[b, h] * distance)
        if self.bias is not None:
            bias = self.bias[min(b, self.bias.shape[0] - 1), min(h, self.bias.shape[1] - 1)]
            x = rounded(x + (bias[xp.asarray(rows)] if bias.shape[0] > 1 else bias))
        if self.score_mod is not None:  # the user's scalar function, element by element (small sizes)
            q_idx, kv_idx = np.meshgrid(_host(rows), np.arange(self.seqlen_k), indexing="ij")
            pre = _host(x)
            x = xp.asarray(np.vectorize(self.score_mod, otypes=[np.float64])(pre, b, h, q_idx, kv_idx))
            x = rounded(x.astype(pre.dtype))
            if self.score_mod_grad is not None:
                user_grad = xp.asarray(np.vectorize(self.score_mod_grad, otypes=[np.float64])(pre, b, h, q_idx, kv_idx))
                grad = user_grad if grad is None else grad * user_grad
        if self.keep is not None:
            keep = self.keep[min(b, self.keep.shape[0] - 1), min(h, self.keep.shape[1] - 1)]
            keep = keep[xp.asarray(rows)] if keep.shape[0] > 1 else keep
            mask = keep if mask is None else (mask & keep)
        if self.mask_mod is not None:
            q_idx, kv_idx = np.meshgrid(_host(rows), np.arange(self.seqlen_k), indexing="ij")
            keep = xp.asarray(np.vectorize(self.mask_mod, otypes=[bool])(b, h, q_idx, kv_idx))
            mask = keep if mask is None else (mask & keep)
        if mask is not None:
            x = xp.where(mask, x, -xp.inf)
        return x, grad


    def dropout_factor(self, b, h, rows):
        """Dropout's factor of each probability of ``rows`` (keep_scale(p) kept, 0 dropped), from
        the kernels' Philox stream; None without dropout."""
        if not self.dropout_p:
            return None
        numbers = dropout_bits_numpy(_host(rows), np.arange(self.seqlen_k), b + self.batch_offset, h,
                                     self.seed & 0xFFFFFFFF, (self.seed >> 32) & 0xFFFFFFFF)
        kept = numbers >= keep_threshold(self.dropout_p)
        return self.xp.asarray(np.where(kept, keep_scale(self.dropout_p), 0.0))


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _softmax_rows(s, xp):
    """(p, row_max, row_sum) with p = exp(s - row_max) unnormalized. Rows that see no key get
    p = 0, row_max = 0 and row_sum = 0."""
    row_max = s.max(axis=1, keepdims=True)
    row_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
    p = xp.exp(s - row_max)
    return p, row_max, p.sum(axis=1, keepdims=True)


def _setup(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dtype, bias=None,
           user=(None, None, None), dropout=(0.0, 0), batch_offset=0):
    xp = _array_module(q)
    q, k, v = (xp.asarray(x).astype(dtype) for x in (q, k, v))
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)
    scores = _Scores(xp, seqlen_q, seqlen_k, scale, causal, window_size, softcap, alibi_slopes, batch, bias, user,
                     dropout, batch_offset)
    blocks = [xp.arange(start, min(start + QUERY_BLOCK, seqlen_q)) for start in range(0, seqlen_q, QUERY_BLOCK)]
    return xp, q, k, v, nheads // nheads_k, scores, blocks


def attention_reference(q, k, v, softmax_scale=None, causal=False, return_lse=False,
                        window_size=(UNBOUNDED, UNBOUNDED), softcap=0.0, alibi_slopes=None, bias=None, score_mod=None, mask_mod=None, score_mod_grad=None, dropout_p=0.0, seed=0,
                        batch_offset=0):
    """Exact attention in float64.

    Returns ``out`` (float64, q's shape) and, with ``return_lse``, ``lse`` (float64,
    (batch, nheads, seqlen_q), natural log). Rows that see no key give out = 0 and lse = -inf.
    Non-finite inputs propagate as IEEE arithmetic says, never to a silent 0: a NaN in q's row i
    makes row i of out and lse NaN; a score of +inf (an Inf in k) makes its row of out NaN (inf /
    inf) and its lse +inf; a score of -inf masks that key.
    ``causal``, ``window_size``, ``softcap`` and ``alibi_slopes`` as in ``nbflash.flash_attn_func``.
    ``batch_offset``: the batch index dropout's stream gives q's first batch row (a packed
    sequence's index, ``attention_varlen_reference``).
    """
    xp, q, k, v, group, scores, blocks = _setup(q, k, v, softmax_scale, causal, window_size, softcap,
                                                alibi_slopes, np.float64, bias, (score_mod, mask_mod, score_mod_grad), (dropout_p, seed),
                                                batch_offset)
    out = xp.zeros(q.shape, xp.float64)
    lse = xp.full(q.shape[:1] + (q.shape[2], q.shape[1]), -xp.inf, xp.float64)
    masks = scores.masks(blocks)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            k_h, v_h = k[b, :, h // group], v[b, :, h // group]
            for rows, mask in zip(blocks, masks):
                s, _ = scores((q[b, rows, h] @ k_h.T) * scores.scale, b, h, rows, mask)
                p, row_max, row_sum = _softmax_rows(s, xp)
                # Rows that see no key have sum 0; a NaN (from a NaN or Inf input) is kept, so it shows.
                seen = row_sum[:, 0] != 0
                safe_sum = xp.where(row_sum == 0, 1.0, row_sum)
                factor = scores.dropout_factor(b, h, rows)  # dropout drops from P V, not from the sum
                kept = p if factor is None else p * factor
                out[b, rows, h] = xp.where(seen[:, None], (kept @ v_h) / safe_sum, 0.0)
                lse[b, h, rows] = xp.where(seen, row_max[:, 0] + xp.log(safe_sum[:, 0]), -xp.inf)
    return (out, lse) if return_lse else out


def attention_probabilities(q, k, v, softmax_scale=None, causal=False, window_size=(UNBOUNDED, UNBOUNDED),
                            softcap=0.0, alibi_slopes=None, bias=None, score_mod=None, mask_mod=None, score_mod_grad=None, dropout_p=0.0, seed=0,
                            batch_offset=0):
    """The attention probabilities P, float32 (batch, nheads, seqlen_q, seqlen_k): what
    ``flash_attn_func(..., return_attn_probs=True)`` hands back as S_dmask. N x N memory: for
    debugging small problems only. ``batch_offset`` as in ``attention_reference``."""
    xp, q, k, v, group, scores, blocks = _setup(q, k, v, softmax_scale, causal, window_size, softcap,
                                                alibi_slopes, np.float32, bias, (score_mod, mask_mod, score_mod_grad), (dropout_p, seed),
                                                batch_offset)
    probs = xp.zeros((q.shape[0], q.shape[2], q.shape[1], k.shape[1]), xp.float32)
    masks = scores.masks(blocks)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            for rows, mask in zip(blocks, masks):
                s, _ = scores((q[b, rows, h] @ k[b, :, h // group].T) * xp.float32(scores.scale), b, h, rows, mask)
                p, _, row_sum = _softmax_rows(s, xp)
                p = p / xp.where(row_sum > 0, row_sum, 1.0)
                factor = scores.dropout_factor(b, h, rows)
                probs[b, h, rows] = p if factor is None else xp.where(factor > 0, p, -p)  # dropped: negative
    return probs


def attention_naive(q, k, v, softmax_scale=None, causal=False, window_size=(UNBOUNDED, UNBOUNDED), softcap=0.0,
                    alibi_slopes=None, bias=None, score_mod=None, mask_mod=None, score_mod_grad=None, dropout_p=0.0, seed=0,
                    batch_offset=0):
    """Attention as a same-precision naive implementation computes it, for error budgets.

    Matmuls accumulate in float32 and round their result to the input dtype, the softmax runs in
    float32 and its result is rounded to the input dtype, as a framework's fp16/bf16 attention
    does (and so is each score feature's result). flash-attn's test rule: a kernel may be off from
    float64 by at most twice this.
    """
    dtype = as_numpy_dtype(q.dtype)
    xp, q, k, v, group, scores, _ = _setup(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                           np.float32, bias, (score_mod, mask_mod, score_mod_grad), (dropout_p, seed),
                                           batch_offset)

    def rounded(x):
        return x.astype(dtype).astype(xp.float32)

    q, k, v = rounded(q), rounded(k), rounded(v)
    mask = scores.masks([xp.arange(q.shape[1])])[0]
    rows = xp.arange(q.shape[1])
    out = xp.zeros(q.shape, xp.float32)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            s = rounded((q[b, :, h] @ k[b, :, h // group].T) * xp.float32(scores.scale))
            s, _ = scores(s, b, h, rows, mask, rounded)
            p, _, row_sum = _softmax_rows(s.astype(xp.float32), xp)
            p = rounded(p / xp.where(row_sum > 0, row_sum, 1.0))
            factor = scores.dropout_factor(b, h, rows)
            if factor is not None:
                p = rounded(p * factor.astype(xp.float32))
            out[b, :, h] = rounded(p @ v[b, :, h // group])
    return out


def attention_reference_backward(dout, q, k, v, softmax_scale=None, causal=False,
                                 window_size=(UNBOUNDED, UNBOUNDED), softcap=0.0, alibi_slopes=None, bias=None, score_mod=None, mask_mod=None, score_mod_grad=None, dropout_p=0.0, seed=0,
                                 batch_offset=0):
    """Gradients of exact attention in float64: returns ``(dq, dk, dv)``, float64, shaped like q, k, v.

    ``dout`` is the gradient of the loss with respect to ``out`` (q's shape). With
    ``x = q k^T * scale``, ``s = score(x)`` (the variant's features, see ``attention_reference``),
    ``P = softmax(s)`` per (batch, head) and ``out = P v``::

        dv = P^T dout                dp = dout v^T
        ds = P * (dp - rowsum(dout * out)) * ds/dx
        dq = ds k * scale            dk = ds^T q * scale

    Under grouped-query attention, dk and dv of a key/value head are summed over the query heads that
    share it. Rows that see no key contribute nothing (their P row is 0). Chunked like the forward:
    extra memory is ``query_block * seqlen_k`` numbers. ``batch_offset`` as in ``attention_reference``.
    """
    xp, q, k, v, group, scores, blocks = _setup(q, k, v, softmax_scale, causal, window_size, softcap,
                                                alibi_slopes, np.float64, bias, (score_mod, mask_mod, score_mod_grad), (dropout_p, seed),
                                                batch_offset)
    dout = xp.asarray(dout).astype(xp.float64)
    dq = xp.zeros(q.shape, xp.float64)
    dk = xp.zeros(k.shape, xp.float64)
    dv = xp.zeros(v.shape, xp.float64)
    masks = scores.masks(blocks)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            k_h, v_h = k[b, :, h // group], v[b, :, h // group]
            for rows, mask in zip(blocks, masks):
                s, grad = scores((q[b, rows, h] @ k_h.T) * scores.scale, b, h, rows, mask)
                p, _, row_sum = _softmax_rows(s, xp)
                p = p / xp.where(row_sum > 0, row_sum, 1.0)
                do = dout[b, rows, h]
                dp = do @ v_h.T
                factor = scores.dropout_factor(b, h, rows)  # dropout: out = (P * factor) v
                kept, dp = (p, dp) if factor is None else (p * factor, dp * factor)
                delta = (p * dp).sum(axis=1, keepdims=True)  # = rowsum(dout * out)
                ds = p * (dp - delta) * (1.0 if grad is None else grad)
                dq[b, rows, h] = (ds @ k_h) * scores.scale
                dk[b, :, h // group] += (ds.T @ q[b, rows, h]) * scores.scale
                dv[b, :, h // group] += kept.T @ do
    return dq, dk, dv


def attention_naive_backward(dout, q, k, v, softmax_scale=None, causal=False,
                             window_size=(UNBOUNDED, UNBOUNDED), softcap=0.0, alibi_slopes=None, bias=None, score_mod=None, mask_mod=None, score_mod_grad=None, dropout_p=0.0, seed=0,
                             batch_offset=0, numerics="framework"):
    """Gradients as a same-precision naive implementation computes them, for error budgets.

    The forward of ``attention_naive``, then each backward matmul accumulating in float32 and rounding
    its result to the input dtype, as a framework's fp16/bf16 autograd does. Returns float32
    ``(dq, dk, dv)`` holding input-dtype values. Not chunked: for test sizes only.

    ``numerics="flash"``: FlashAttention's own rounding instead. Scores stay float32; its forward rounds the unnormalized
    exponentials for the product with v (dropout zeroes the dropped ones) and divides by their float32
    sum at the end, then multiplies by dropout's keep scale; its backward
    recomputes P and dP in float32 registers: dS = P * (dP - rowsum(dout * out)) from the float32 P
    and dP (only dS, and P for dV, rounded to the input dtype), against ``out`` as that forward stored
    it (one key tile's worth: a kernel's rescaling between tiles is not modelled). Its P then differs
    from the rounded one that made ``out``, so the rows of dS no longer sum to zero, an error a
    framework's autograd (whose P is the same rounded P throughout) does not make. With a couple of
    keys that error can be twice or more the framework's own (one query against two keys, fp16: dq off
    by 1.1e-3 against the framework's 4.5e-4, the kernels equal to this implementation to the bit).
    """
    if numerics not in ("framework", "flash"):
        raise ValueError(f"numerics must be 'framework' or 'flash', not {numerics!r}")
    flash = numerics == "flash"
    dtype = as_numpy_dtype(q.dtype)
    xp, q, k, v, group, scores, _ = _setup(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                           np.float32, bias, (score_mod, mask_mod, score_mod_grad), (dropout_p, seed),
                                           batch_offset)

    def rounded(x):
        return x.astype(dtype).astype(xp.float32)

    dout, q, k, v = (rounded(xp.asarray(x).astype(xp.float32)) for x in (dout, q, k, v))
    scale = xp.float32(scores.scale)
    dq = xp.zeros(q.shape, xp.float32)
    dk = xp.zeros(k.shape, xp.float32)
    dv = xp.zeros(v.shape, xp.float32)
    rows = xp.arange(q.shape[1])
    mask = scores.masks([rows])[0]
    # What stays in float32 registers under FlashAttention's numerics (scores, dP) and is rounded to
    # the dtype by a framework's
    registers = (lambda x: x) if flash else rounded
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            k_h, v_h, do = k[b, :, h // group], v[b, :, h // group], dout[b, :, h]
            s, grad = scores(registers((q[b, :, h] @ k_h.T) * scale), b, h, rows, mask, registers)
            exps, _, row_sum = _softmax_rows(s.astype(xp.float32), xp)
            row_sum = xp.where(row_sum > 0, row_sum, 1.0)
            p_exact = exps / row_sum
            p = rounded(p_exact)
            factor = scores.dropout_factor(b, h, rows)
            kept = p if factor is None else rounded(p * factor.astype(xp.float32))
            if flash:  # its forward: the unnormalized exponentials rounded, the dropped ones zeroed, and
                # the sum divided out at the end with dropout's scale (the kernels' inv_l *= scale)
                if factor is None:
                    out = rounded((rounded(exps) @ v_h) / row_sum)
                else:
                    kept_exps = rounded(exps) * (factor != 0)
                    out = rounded((kept_exps @ v_h) / row_sum * xp.float32(keep_scale(dropout_p)))
            else:
                out = rounded(kept @ v_h)
            dv[b, :, h // group] += rounded(kept.T @ do)
            dp = registers(do @ v_h.T)
            if factor is not None:
                dp = registers(dp * factor.astype(xp.float32))
            delta = (do * out).sum(axis=1, keepdims=True)
            ds = rounded((p_exact if flash else p) * (dp - delta))
            if grad is not None:
                ds = rounded(ds * grad)
            dq[b, :, h] = rounded((ds @ k_h) * scale)
            dk[b, :, h // group] += rounded((ds.T @ q[b, :, h]) * scale)
    # Under GQA/MQA the per-head dk and dv are summed over the group (as the backward of a framework's
    # head-repeat does) and the sum, like every gradient, is handed back in the input dtype.
    return dq, rounded(dk), rounded(dv)


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """(b, q rows, k rows) of each packed sequence, as slices."""
    cu_q, cu_k = (np.asarray(_host(c), np.int64) for c in (cu_seqlens_q, cu_seqlens_k))
    for b in range(len(cu_q) - 1):
        yield b, slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])


def _sequence_slopes(alibi_slopes, b):
    """Sequence b's ALiBi slopes (nheads,), from (nheads,) or (batch, nheads); None for none."""
    if alibi_slopes is None:
        return None
    slopes = np.asarray(_host(alibi_slopes), np.float64)
    return slopes if slopes.ndim == 1 else slopes[b]


def attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                               window_size=(UNBOUNDED, UNBOUNDED), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                               seed=0):
    """Exact attention over packed sequences in float64, sequence by sequence through
    ``attention_reference``: returns (out, lse), out float64 (total_q, nheads, headdim), lse float64
    (nheads, total_q). q is (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim);
    sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q (and likewise of k, v).
    Each sequence is its own problem (causal and ALiBi bottom-right aligned to its own lengths,
    dropout keyed by its index b). Rows outside every sequence stay 0 (lse -inf)."""
    xp = _array_module(q)
    out = xp.zeros(q.shape, xp.float64)
    lse = xp.full((q.shape[1], q.shape[0]), -xp.inf, xp.float64)
    for b, rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        if rows_q.stop == rows_q.start or rows_k.stop == rows_k.start:
            continue  # no query, or no key: out 0, lse -inf
        slopes = _sequence_slopes(alibi_slopes, b)
        o, l = attention_reference(q[None, rows_q], k[None, rows_k], v[None, rows_k], softmax_scale, causal, True,
                                   window_size, softcap, slopes, dropout_p=dropout_p, seed=seed, batch_offset=b)
        out[rows_q], lse[:, rows_q] = o[0], l[0]
    return out, lse


def attention_varlen_reference_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                                        window_size=(UNBOUNDED, UNBOUNDED), softcap=0.0, alibi_slopes=None,
                                        dropout_p=0.0, seed=0):
    """Gradients of ``attention_varlen_reference``: (dq, dk, dv), float64, shaped like q, k, v
    (packed), sequence by sequence through ``attention_reference_backward``."""
    xp = _array_module(q)
    dq, dk, dv = (xp.zeros(x.shape, xp.float64) for x in (q, k, v))
    for b, rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        if rows_q.stop == rows_q.start or rows_k.stop == rows_k.start:
            continue  # nothing is seen: every gradient 0
        slopes = _sequence_slopes(alibi_slopes, b)
        grads = attention_reference_backward(dout[None, rows_q], q[None, rows_q], k[None, rows_k], v[None, rows_k],
                                             softmax_scale, causal, window_size, softcap, slopes, dropout_p=dropout_p,
                                             seed=seed, batch_offset=b)
        dq[rows_q], dk[rows_k], dv[rows_k] = (g[0] for g in grads)
    return dq, dk, dv


def apply_rotary_reference(x, cos, sin, positions, interleaved=True):
    """Rotary position embedding of ``x`` in float64 (not rounded): what ``flash_attn_with_kvcache``
    applies to q and to the new keys.

    ``x`` is (batch, seqlen, heads, headdim), any float dtype; ``cos`` and ``sin`` are
    (seqlen_ro, rotary_dim / 2); ``positions`` is an integer (batch, seqlen) array of rows of cos
    and sin. Only the first ``rotary_dim`` dims rotate, the rest pass through. Dim pairs are
    (2d, 2d + 1) when ``interleaved`` (GPT-J), (d, d + rotary_dim / 2) otherwise (GPT-NeoX), for
    d = 0 .. rotary_dim / 2 - 1; each pair (x1, x2) becomes (x1 cos - x2 sin, x1 sin + x2 cos),
    with cos and sin at [position, d].
    """
    xp = _array_module(x)
    x = xp.asarray(x).astype(xp.float64)
    cos, sin = (xp.asarray(c).astype(xp.float64) for c in (cos, sin))
    positions = xp.asarray(positions)
    half = cos.shape[1]
    assert x.ndim == 4, f"x must be (batch, seqlen, heads, headdim), got shape {x.shape}"
    assert cos.shape == sin.shape and cos.ndim == 2, (
        f"cos {cos.shape} and sin {sin.shape} must both be (seqlen_ro, rotary_dim / 2)")
    assert 2 * half <= x.shape[3], f"rotary_dim {2 * half} exceeds headdim {x.shape[3]}"
    assert positions.shape == x.shape[:2], f"positions {positions.shape} must be (batch, seqlen) = {x.shape[:2]}"
    if positions.size:
        assert 0 <= int(positions.min()) and int(positions.max()) < cos.shape[0], (
            f"positions {int(positions.min())} .. {int(positions.max())} outside cos/sin's {cos.shape[0]} rows")
    c, s = cos[positions][:, :, None, :], sin[positions][:, :, None, :]  # (batch, seqlen, 1, half)
    first, second = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else (slice(0, half),
                                                                                        slice(half, 2 * half))
    x1, x2 = x[..., first], x[..., second]
    out = x.copy()
    out[..., first] = x1 * c - x2 * s
    out[..., second] = x1 * s + x2 * c
    return out


def attention_kvcache_reference(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(UNBOUNDED, UNBOUNDED), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None):
    """``flash_attn_with_kvcache`` in float64: returns ``(out, lse, k_cache_after, v_cache_after)``.

    ``out`` is float64 (q's shape), ``lse`` float64 (batch, nheads, seqlen_q), natural log; the caches
    after this call's append are new arrays in the caches' dtype (the inputs are left as they were),
    so that a test can compare them with what the kernels wrote in place.

    The steps, one sequence ``b`` at a time:

    1. Append. The new keys (rotated first, when ``rotary_cos`` is given, at positions
       ``cache_seqlens[b] + t``, and rounded to q's dtype) and values go to cache positions
       ``cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1`` of cache row ``cache_batch_idx[b]``,
       or, paged, position ``p`` to row ``p % page_block_size`` of block ``block_table[b, p // page_block_size]``.
    2. Gather. The keys are the cache positions ``cache_leftpad[b] <= p < cache_seqlens[b] + seqlen_new``,
       re-indexed from 0: ``seqlen_k_b = cache_seqlens[b] + seqlen_new - cache_leftpad[b]``.
    3. Attend, as ``attention_reference`` (so ``flash_attn_func``) on (q_b, K_b, V_b), with q rotated
       at ``cache_seqlens[b] + i`` (causal or windowed) or ``cache_seqlens[b]`` (otherwise) and rounded
       to its dtype, and ALiBi slopes row b. A sequence with no key gives out 0 and lse -inf.

    ``cache_seqlens`` None means every cache is full (its capacity: seqlen_cache, or
    max_blocks_per_seq * page_block_size when paged); an int applies to every sequence.
    """
    xp = _array_module(q)
    q = xp.asarray(q)
    batch, seqlen_q, nheads, headdim = q.shape
    paged = block_table is not None
    if paged:
        table = _host(block_table).astype(np.int64)
        assert table.ndim == 2 and table.shape[0] == batch, (
            f"block_table {table.shape} must be (batch={batch}, max_blocks_per_seq)")
        assert cache_batch_idx is None, "cache_batch_idx goes with contiguous caches only"
        page = k_cache.shape[1]
        capacity = table.shape[1] * page
    else:
        capacity = k_cache.shape[1]
    nheads_k = k_cache.shape[2]
    assert k_cache.shape == v_cache.shape, f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ"
    assert k_cache.shape[3] == headdim, f"the caches' headdim {k_cache.shape[3]} is not q's {headdim}"
    assert nheads % nheads_k == 0, f"{nheads=} is not a multiple of {nheads_k=}"
    assert (k is None) == (v is None), "k and v are appended together"
    seqlen_new = 0 if k is None else k.shape[1]
    if k is not None:
        assert k.shape == v.shape == (batch, seqlen_new, nheads_k, headdim), (
            f"k {k.shape} and v {v.shape} must be (batch, seqlen_new, nheads_k, headdim)")

    def per_sequence(values, default):
        if values is None:
            return np.full(batch, default, np.int64)
        return np.broadcast_to(np.asarray(_host(values), np.int64), (batch,)).copy()

    seqlens = per_sequence(cache_seqlens, capacity)
    leftpad = per_sequence(cache_leftpad, 0)
    rows = np.arange(batch) if cache_batch_idx is None else per_sequence(cache_batch_idx, 0)
    for b in range(batch):
        assert 0 <= leftpad[b] <= seqlens[b], (
            f"sequence {b}: cache_leftpad {leftpad[b]} outside 0 .. cache_seqlens {seqlens[b]}")
        assert seqlens[b] + seqlen_new <= capacity, (
            f"sequence {b}: {seqlens[b]} cached + {seqlen_new} new tokens exceed the cache's {capacity} positions")

    def locate(b, positions):
        """Cache indices (a tuple for fancy indexing) of sequence b's cache positions."""
        if paged:
            return xp.asarray(table[b, positions // page]), xp.asarray(positions % page)
        return int(rows[b]), xp.asarray(positions)

    dtype = q.dtype
    rotary = rotary_cos is not None
    if rotary:
        windowed = causal or tuple(window_size) != (UNBOUNDED, UNBOUNDED)
        offsets = np.arange(seqlen_q)[None, :] if windowed else np.zeros((1, seqlen_q), np.int64)
        q = apply_rotary_reference(q, rotary_cos, rotary_sin, xp.asarray(seqlens[:, None] + offsets),
                                   rotary_interleaved).astype(dtype)

    # 1. Append into copies of the caches.
    k_after, v_after = k_cache.copy(), v_cache.copy()
    if k is not None:
        new_positions = seqlens[:, None] + np.arange(seqlen_new)[None, :]
        k_new = xp.asarray(k)
        if rotary:
            k_new = apply_rotary_reference(k_new, rotary_cos, rotary_sin, xp.asarray(new_positions),
                                           rotary_interleaved).astype(dtype)
        for b in range(batch):
            where = locate(b, new_positions[b])
            k_after[where] = k_new[b].astype(k_after.dtype)
            v_after[where] = xp.asarray(v[b]).astype(v_after.dtype)

    # 2. and 3. Gather each sequence's keys and attend.
    slopes = None
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(_host(alibi_slopes), np.float64), (batch, nheads))
    out = xp.zeros(q.shape, xp.float64)
    lse = xp.full((batch, nheads, seqlen_q), -xp.inf, xp.float64)
    for b in range(batch):
        keys = np.arange(leftpad[b], seqlens[b] + seqlen_new)
        if keys.size == 0:  # nothing to attend: out 0, lse -inf as initialized
            continue
        where = locate(b, keys)
        k_b, v_b = k_after[where][None], v_after[where][None]  # (1, seqlen_k_b, nheads_k, headdim)
        out_b, lse_b = attention_reference(q[b:b + 1], k_b, v_b, softmax_scale, causal, return_lse=True,
                                           window_size=window_size, softcap=softcap,
                                           alibi_slopes=None if slopes is None else slopes[b])
        out[b], lse[b] = out_b[0], lse_b[0]
    return out, lse, k_after, v_after
