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
from .kernels.philox import dropout_words_numpy
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
                 user=(None, None, None), dropout=(0.0, 0)):
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
            rows = xp.asarray(rows)[:, None]
            distance = xp.abs(rows + (self.seqlen_k - self.seqlen_q) - xp.arange(self.seqlen_k)[None, :])
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
        """Dropout's factor of each probability of ``rows`` (1 / (1 - p) kept, 0 dropped), from the
        kernels' Philox stream; None without dropout."""
        if not self.dropout_p:
            return None
        threshold = min(round(self.dropout_p * 2.0**32), 2**32 - 1)
        words = dropout_words_numpy(_host(rows), np.arange(self.seqlen_k), b, h, self.seed & 0xFFFFFFFF,
                                    (self.seed >> 32) & 0xFFFFFFFF)
        return self.xp.asarray(np.where(words >= threshold, 1.0 / (1.0 - self.dropout_p), 0.0))


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
           user=(None, None, None), dropout=(0.0, 0)):
    xp = _array_module(q)
    q, k, v = (xp.asarray(x).astype(dtype) for x in (q, k, v))
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)
    scores = _Scores(xp, seqlen_q, seqlen_k, scale, causal, window_size, softcap, alibi_slopes, batch, bias, user,
                     dropout)
    blocks = [xp.arange(start, min(start + QUERY_BLOCK, seqlen_q)) for start in range(0, seqlen_q, QUERY_BLOCK)]
    return xp, q, k, v, nheads // nheads_k, scores, blocks


def attention_reference(q, k, v, softmax_scale=None, causal=False, return_lse=False,
                        window_size=(UNBOUNDED, UNBOUNDED), softcap=0.0, alibi_slopes=None, bias=None, score_mod=None, mask_mod=None, score_mod_grad=None, dropout_p=0.0, seed=0):
    """Exact attention in float64.

    Returns ``out`` (float64, q's shape) and, with ``return_lse``, ``lse`` (float64,
    (batch, nheads, seqlen_q), natural log). Rows that see no key give out = 0 and lse = -inf.
    ``causal``, ``window_size``, ``softcap`` and ``alibi_slopes`` as in ``nbflash.flash_attn_func``.
    """
    xp, q, k, v, group, scores, blocks = _setup(q, k, v, softmax_scale, causal, window_size, softcap,
                                                alibi_slopes, np.float64, bias, (score_mod, mask_mod, score_mod_grad), (dropout_p, seed))
    out = xp.zeros(q.shape, xp.float64)
    lse = xp.full(q.shape[:1] + (q.shape[2], q.shape[1]), -xp.inf, xp.float64)
    masks = scores.masks(blocks)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            k_h, v_h = k[b, :, h // group], v[b, :, h // group]
            for rows, mask in zip(blocks, masks):
                s, _ = scores((q[b, rows, h] @ k_h.T) * scores.scale, b, h, rows, mask)
                p, row_max, row_sum = _softmax_rows(s, xp)
                seen = row_sum[:, 0] > 0  # rows that see at least one key
                safe_sum = xp.where(row_sum > 0, row_sum, 1.0)
                factor = scores.dropout_factor(b, h, rows)  # dropout drops from P V, not from the sum
                kept = p if factor is None else p * factor
                out[b, rows, h] = xp.where(seen[:, None], (kept @ v_h) / safe_sum, 0.0)
                lse[b, h, rows] = xp.where(seen, row_max[:, 0] + xp.log(safe_sum[:, 0]), -xp.inf)
    return (out, lse) if return_lse else out


def attention_probabilities(q, k, v, softmax_scale=None, causal=False, window_size=(UNBOUNDED, UNBOUNDED),
                            softcap=0.0, alibi_slopes=None, bias=None, score_mod=None, mask_mod=None, score_mod_grad=None, dropout_p=0.0, seed=0):
    """The attention probabilities P, float32 (batch, nheads, seqlen_q, seqlen_k): what
    ``flash_attn_func(..., return_attn_probs=True)`` hands back as S_dmask. N x N memory: for
    debugging small problems only."""
    xp, q, k, v, group, scores, blocks = _setup(q, k, v, softmax_scale, causal, window_size, softcap,
                                                alibi_slopes, np.float32, bias, (score_mod, mask_mod, score_mod_grad), (dropout_p, seed))
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
                    alibi_slopes=None, bias=None, score_mod=None, mask_mod=None, score_mod_grad=None, dropout_p=0.0, seed=0):
    """Attention as a same-precision naive implementation computes it, for error budgets.

    Matmuls accumulate in float32 and round their result to the input dtype, the softmax runs in
    float32 and its result is rounded to the input dtype, as a framework's fp16/bf16 attention
    does (and so is each score feature's result). flash-attn's test rule: a kernel may be off from
    float64 by at most twice this.
    """
    dtype = as_numpy_dtype(q.dtype)
    xp, q, k, v, group, scores, _ = _setup(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                           np.float32, bias, (score_mod, mask_mod, score_mod_grad), (dropout_p, seed))

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
                                 window_size=(UNBOUNDED, UNBOUNDED), softcap=0.0, alibi_slopes=None, bias=None, score_mod=None, mask_mod=None, score_mod_grad=None, dropout_p=0.0, seed=0):
    """Gradients of exact attention in float64: returns ``(dq, dk, dv)``, float64, shaped like q, k, v.

    ``dout`` is the gradient of the loss with respect to ``out`` (q's shape). With
    ``x = q k^T * scale``, ``s = score(x)`` (the variant's features, see ``attention_reference``),
    ``P = softmax(s)`` per (batch, head) and ``out = P v``::

        dv = P^T dout                dp = dout v^T
        ds = P * (dp - rowsum(dout * out)) * ds/dx
        dq = ds k * scale            dk = ds^T q * scale

    Under grouped-query attention, dk and dv of a key/value head are summed over the query heads that
    share it. Rows that see no key contribute nothing (their P row is 0). Chunked like the forward:
    extra memory is ``query_block * seqlen_k`` numbers.
    """
    xp, q, k, v, group, scores, blocks = _setup(q, k, v, softmax_scale, causal, window_size, softcap,
                                                alibi_slopes, np.float64, bias, (score_mod, mask_mod, score_mod_grad), (dropout_p, seed))
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
                             window_size=(UNBOUNDED, UNBOUNDED), softcap=0.0, alibi_slopes=None, bias=None, score_mod=None, mask_mod=None, score_mod_grad=None, dropout_p=0.0, seed=0):
    """Gradients as a same-precision naive implementation computes them, for error budgets.

    The forward of ``attention_naive``, then each backward matmul accumulating in float32 and rounding
    its result to the input dtype, as a framework's fp16/bf16 autograd does. Returns float32
    ``(dq, dk, dv)`` holding input-dtype values. Not chunked: for test sizes only.
    """
    dtype = as_numpy_dtype(q.dtype)
    xp, q, k, v, group, scores, _ = _setup(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                           np.float32, bias, (score_mod, mask_mod, score_mod_grad), (dropout_p, seed))

    def rounded(x):
        return x.astype(dtype).astype(xp.float32)

    dout, q, k, v = (rounded(xp.asarray(x).astype(xp.float32)) for x in (dout, q, k, v))
    scale = xp.float32(scores.scale)
    dq = xp.zeros(q.shape, xp.float32)
    dk = xp.zeros(k.shape, xp.float32)
    dv = xp.zeros(v.shape, xp.float32)
    rows = xp.arange(q.shape[1])
    mask = scores.masks([rows])[0]
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            k_h, v_h, do = k[b, :, h // group], v[b, :, h // group], dout[b, :, h]
            s, grad = scores(rounded((q[b, :, h] @ k_h.T) * scale), b, h, rows, mask, rounded)
            p, _, row_sum = _softmax_rows(s.astype(xp.float32), xp)
            p = rounded(p / xp.where(row_sum > 0, row_sum, 1.0))
            factor = scores.dropout_factor(b, h, rows)
            kept = p if factor is None else rounded(p * factor.astype(xp.float32))
            out = rounded(kept @ v_h)
            dv[b, :, h // group] += rounded(kept.T @ do)
            dp = rounded(do @ v_h.T)
            if factor is not None:
                dp = rounded(dp * factor.astype(xp.float32))
            delta = (do * out).sum(axis=1, keepdims=True)
            ds = rounded(p * (dp - delta))
            if grad is not None:
                ds = rounded(ds * grad)
            dq[b, :, h] = rounded((ds @ k_h) * scale)
            dk[b, :, h // group] += rounded((ds.T @ q[b, :, h]) * scale)
    # Under GQA/MQA the per-head dk and dv are summed over the group (as the backward of a framework's
    # head-repeat does) and the sum, like every gradient, is handed back in the input dtype.
    return dq, rounded(dk), rounded(dv)
