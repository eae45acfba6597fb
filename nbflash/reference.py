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


def _row_block_softmax(q_rows, k_h, scale, mask, xp):
    """For a block of query rows of one head: (p, row_max, row_sum), with p = exp(s - row_max)
    unnormalized; ``mask`` (or None) says which keys each row sees. Rows that see no key get p = 0,
    row_max = 0 and row_sum = 0."""
    s = (q_rows @ k_h.T) * scale
    if mask is not None:
        s = xp.where(mask, s, -xp.inf)
    row_max = s.max(axis=1, keepdims=True)
    row_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
    p = xp.exp(s - row_max)
    return p, row_max, p.sum(axis=1, keepdims=True)


def attention_reference(q, k, v, softmax_scale=None, causal=False, return_lse=False,
                        window_size=(UNBOUNDED, UNBOUNDED)):
    """Exact attention in float64.

    Returns ``out`` (float64, q's shape) and, with ``return_lse``, ``lse`` (float64,
    (batch, nheads, seqlen_q), natural log). Rows that see no key give out = 0 and lse = -inf.
    ``causal`` and ``window_size`` as in ``nbflash.flash_attn_func`` (see ``visible``).
    """
    xp = _array_module(q)
    q, k, v = (xp.asarray(x).astype(xp.float64) for x in (q, k, v))
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)

    out = xp.zeros(q.shape, xp.float64)
    lse = xp.full((batch, nheads, seqlen_q), -xp.inf, xp.float64)
    blocks = [xp.arange(start, min(start + QUERY_BLOCK, seqlen_q)) for start in range(0, seqlen_q, QUERY_BLOCK)]
    masks = [visible(seqlen_q, seqlen_k, causal, window_size, xp, rows) for rows in blocks]
    for b in range(batch):
        for h in range(nheads):
            k_h, v_h = k[b, :, h // group], v[b, :, h // group]
            for rows, mask in zip(blocks, masks):
                p, row_max, row_sum = _row_block_softmax(q[b, rows, h], k_h, scale, mask, xp)
                seen = row_sum[:, 0] > 0  # rows that see at least one key
                safe_sum = xp.where(row_sum > 0, row_sum, 1.0)
                out[b, rows, h] = xp.where(seen[:, None], (p @ v_h) / safe_sum, 0.0)
                lse[b, h, rows] = xp.where(seen, row_max[:, 0] + xp.log(safe_sum[:, 0]), -xp.inf)
    return (out, lse) if return_lse else out


def attention_naive(q, k, v, softmax_scale=None, causal=False, window_size=(UNBOUNDED, UNBOUNDED)):
    """Attention as a same-precision naive implementation computes it, for error budgets.

    Matmuls accumulate in float32 and round their result to the input dtype, the softmax runs in
    float32 and its result is rounded to the input dtype, as a framework's fp16/bf16 attention
    does. flash-attn's test rule: a kernel may be off from float64 by at most twice this.
    """
    xp = _array_module(q)
    dtype = as_numpy_dtype(q.dtype)

    def rounded(x):
        return x.astype(dtype).astype(xp.float32)

    q, k, v = (rounded(xp.asarray(x).astype(xp.float32)) for x in (q, k, v))
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)
    mask = visible(seqlen_q, seqlen_k, causal, window_size, xp)
    out = xp.zeros(q.shape, xp.float32)
    for b in range(batch):
        for h in range(nheads):
            s = rounded((q[b, :, h] @ k[b, :, h // group].T) * xp.float32(scale))
            if mask is not None:
                s = xp.where(mask, s, -xp.inf)
            row_max = s.max(axis=1, keepdims=True)
            row_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
            p = xp.exp(s - row_max)
            row_sum = p.sum(axis=1, keepdims=True)
            p = rounded(p / xp.where(row_sum > 0, row_sum, 1.0))
            out[b, :, h] = rounded(p @ v[b, :, h // group])
    return out


def attention_reference_backward(dout, q, k, v, softmax_scale=None, causal=False,
                                 window_size=(UNBOUNDED, UNBOUNDED)):
    """Gradients of exact attention in float64: returns ``(dq, dk, dv)``, float64, shaped like q, k, v.

    ``dout`` is the gradient of the loss with respect to ``out`` (q's shape). With
    ``P = softmax(q k^T * scale)`` per (batch, head) and ``out = P v``::

        dv = P^T dout                dp = dout v^T
        ds = P * (dp - rowsum(dout * out))
        dq = ds k * scale            dk = ds^T q * scale

    Under grouped-query attention, dk and dv of a key/value head are summed over the query heads that
    share it. Rows that see no key contribute nothing (their P row is 0). Chunked like the forward:
    extra memory is ``query_block * seqlen_k`` numbers.
    """
    xp = _array_module(q)
    dout, q, k, v = (xp.asarray(x).astype(xp.float64) for x in (dout, q, k, v))
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)

    dq = xp.zeros(q.shape, xp.float64)
    dk = xp.zeros(k.shape, xp.float64)
    dv = xp.zeros(v.shape, xp.float64)
    blocks = [xp.arange(start, min(start + QUERY_BLOCK, seqlen_q)) for start in range(0, seqlen_q, QUERY_BLOCK)]
    masks = [visible(seqlen_q, seqlen_k, causal, window_size, xp, rows) for rows in blocks]
    for b in range(batch):
        for h in range(nheads):
            k_h, v_h = k[b, :, h // group], v[b, :, h // group]
            for rows, mask in zip(blocks, masks):
                p, _, row_sum = _row_block_softmax(q[b, rows, h], k_h, scale, mask, xp)
                p = p / xp.where(row_sum > 0, row_sum, 1.0)
                do = dout[b, rows, h]
                dp = do @ v_h.T
                delta = (p * dp).sum(axis=1, keepdims=True)  # = rowsum(dout * out)
                ds = p * (dp - delta)
                dq[b, rows, h] = (ds @ k_h) * scale
                dk[b, :, h // group] += (ds.T @ q[b, rows, h]) * scale
                dv[b, :, h // group] += p.T @ do
    return dq, dk, dv


def attention_naive_backward(dout, q, k, v, softmax_scale=None, causal=False,
                             window_size=(UNBOUNDED, UNBOUNDED)):
    """Gradients as a same-precision naive implementation computes them, for error budgets.

    The forward of ``attention_naive``, then each backward matmul accumulating in float32 and rounding
    its result to the input dtype, as a framework's fp16/bf16 autograd does. Returns float32
    ``(dq, dk, dv)`` holding input-dtype values. Not chunked: for test sizes only.
    """
    xp = _array_module(q)
    dtype = as_numpy_dtype(q.dtype)

    def rounded(x):
        return x.astype(dtype).astype(xp.float32)

    dout, q, k, v = (rounded(xp.asarray(x).astype(xp.float32)) for x in (dout, q, k, v))
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    scale = xp.float32(1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale))
    dq = xp.zeros(q.shape, xp.float32)
    dk = xp.zeros(k.shape, xp.float32)
    dv = xp.zeros(v.shape, xp.float32)
    mask = visible(seqlen_q, seqlen_k, causal, window_size, xp)
    for b in range(batch):
        for h in range(nheads):
            k_h, v_h, do = k[b, :, h // group], v[b, :, h // group], dout[b, :, h]
            s = rounded((q[b, :, h] @ k_h.T) * scale)
            if mask is not None:
                s = xp.where(mask, s, -xp.inf)
            row_max = s.max(axis=1, keepdims=True)
            row_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
            p = xp.exp(s - row_max)
            row_sum = p.sum(axis=1, keepdims=True)
            p = rounded(p / xp.where(row_sum > 0, row_sum, 1.0))
            out = rounded(p @ v_h)
            dv[b, :, h // group] += rounded(p.T @ do)
            dp = rounded(do @ v_h.T)
            delta = (do * out).sum(axis=1, keepdims=True)
            ds = rounded(p * (dp - delta))
            dq[b, :, h] = rounded((ds @ k_h) * scale)
            dk[b, :, h // group] += rounded((ds.T @ q[b, :, h]) * scale)
    # Under GQA/MQA the per-head dk and dv are summed over the group (as the backward of a framework's
    # head-repeat does) and the sum, like every gradient, is handed back in the input dtype.
    return dq, rounded(dk), rounded(dv)
