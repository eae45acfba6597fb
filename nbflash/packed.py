"""flash-attn's packed entry points: q, k and v stacked in one array (qkv), or k and v (kv).

    out = nbflash.flash_attn_qkvpacked_func(qkv, causal=True)        # qkv (batch, seqlen, 3, nheads, headdim)
    out = nbflash.flash_attn_kvpacked_func(q, kv, causal=True)       # kv (batch, seqlen_k, 2, nheads_k, headdim)
    out = nbflash.flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen)  # qkv (total, 3, nheads, headdim)
    out = nbflash.flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

Each takes flash-attn 2.8's arguments in flash-attn's order and calls ``flash_attn_func`` or
``flash_attn_varlen_func`` on views of the packed array: no copy (the kernels take any strides with
the last dimension contiguous), the same kernels, the same results. nbflash's keyword-only extras
(``return_lse``, ``bias``, ``seed``, ...) pass through.

The ``*_backward`` functions are nbflash's (flash-attn differentiates its packed functions through
autograd): the gradients of the packed forward, packed the same way (dqkv, or dq and dkv), with
``flash_attn_backward``'s or ``flash_attn_varlen_backward``'s arguments after the arrays.
"""

from . import runtime
from .backward import flash_attn_backward
from .interface import flash_attn_func
from .varlen import flash_attn_varlen_backward, flash_attn_varlen_func

# The packed layouts: (what the error message shows, the packed axis, its size)
QKV = ("(batch, seqlen, 3, nheads, headdim)", 2, 3)
KV = ("(batch, seqlen_k, 2, nheads_k, headdim)", 2, 2)
VARLEN_QKV = ("(total, 3, nheads, headdim)", 1, 3)
VARLEN_KV = ("(total_k, 2, nheads_k, headdim)", 1, 2)


def unpack(x, name, packing):
    """The views x[..., i, ...] along the packed axis (no copy), once x's rank and that axis's
    size are checked."""
    layout, axis, count = packing
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{name} must be an array of shape {layout}, not {type(x).__name__}")
    if len(shape) != layout.count(",") + 1 or shape[axis] != count:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(shape)}")
    return tuple(x[(slice(None),) * axis + (i,)] for i in range(count))


def pack(arrays, packing):
    """The gradients stacked along the packed axis (a copy into one array)."""
    xp = runtime.xp()
    return xp.stack(arrays, axis=packing[1])


def packed_functions(attention, varlen_attention):
    """flash-attn's four packed functions over ``attention`` (a ``flash_attn_func``) and
    ``varlen_attention`` (a ``flash_attn_varlen_func``): this module's, and nbflash.torch's, whose
    autograd then carries the gradients of the views back into the packed tensor."""

    def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                  **extras):
        """flash_attn_func of q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]; qkv (batch, seqlen,
        3, nheads, headdim). Arguments, nbflash's keyword-only extras and returns as flash_attn_func's."""
        q, k, v = unpack(qkv, "qkv", QKV)
        return attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                         deterministic, return_attn_probs, **extras)

    def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                 softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                 **extras):
        """flash_attn_func of q and k, v = kv[:, :, 0], kv[:, :, 1]; kv (batch, seqlen_k, 2,
        nheads_k, headdim), nheads a multiple of nheads_k (GQA). Otherwise as flash_attn_func."""
        k, v = unpack(kv, "kv", KV)
        return attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                         deterministic, return_attn_probs, **extras)

    def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                         deterministic=False, return_attn_probs=False, **extras):
        """flash_attn_varlen_func of q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2], one set of offsets
        and one length for both; qkv (total, 3, nheads, headdim). Otherwise as flash_attn_varlen_func."""
        q, k, v = unpack(qkv, "qkv", VARLEN_QKV)
        return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                **extras)

    def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                        alibi_slopes=None, deterministic=False, return_attn_probs=False, **extras):
        """flash_attn_varlen_func of q and k, v = kv[:, 0], kv[:, 1]; kv (total_k, 2, nheads_k,
        headdim). Otherwise as flash_attn_varlen_func."""
        k, v = unpack(kv, "kv", VARLEN_KV)
        return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                return_attn_probs, **extras)

    return (flash_attn_qkvpacked_func, flash_attn_kvpacked_func, flash_attn_varlen_qkvpacked_func,
            flash_attn_varlen_kvpacked_func)


(flash_attn_qkvpacked_func, flash_attn_kvpacked_func, flash_attn_varlen_qkvpacked_func,
 flash_attn_varlen_kvpacked_func) = packed_functions(flash_attn_func, flash_attn_varlen_func)


def flash_attn_qkvpacked_backward(dout, qkv, out, lse, *args, **kwargs):
    """(nbflash) dqkv, the gradient of ``flash_attn_qkvpacked_func`` packed as qkv: ``dout``,
    ``out`` and ``lse`` as for ``flash_attn_backward``, then its arguments after lse."""
    q, k, v = unpack(qkv, "qkv", QKV)
    return pack(flash_attn_backward(dout, q, k, v, out, lse, *args, **kwargs), QKV)


def flash_attn_kvpacked_backward(dout, q, kv, out, lse, *args, **kwargs):
    """(nbflash) (dq, dkv), the gradients of ``flash_attn_kvpacked_func``, dkv packed as kv."""
    k, v = unpack(kv, "kv", KV)
    dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, *args, **kwargs)
    return dq, pack((dk, dv), KV)


def flash_attn_varlen_qkvpacked_backward(dout, qkv, out, lse, cu_seqlens, max_seqlen, *args, **kwargs):
    """(nbflash) dqkv, the gradient of ``flash_attn_varlen_qkvpacked_func`` packed as qkv; lse
    (nheads, total) as that function returns it, then ``flash_attn_varlen_backward``'s arguments
    after the offsets and lengths."""
    q, k, v = unpack(qkv, "qkv", VARLEN_QKV)
    return pack(flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                           *args, **kwargs), VARLEN_QKV)


def flash_attn_varlen_kvpacked_backward(dout, q, kv, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, *args, **kwargs):
    """(nbflash) (dq, dkv), the gradients of ``flash_attn_varlen_kvpacked_func``, dkv packed as kv."""
    k, v = unpack(kv, "kv", VARLEN_KV)
    dq, dk, dv = flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, *args, **kwargs)
    return dq, pack((dk, dv), VARLEN_KV)
