"""PyTorch autograd over nbflash's kernels: ``loss.backward()`` through FlashAttention.

    from nbflash.torch import flash_attn_func, flash_attn_varlen_func
    out = flash_attn_func(q, k, v, causal=True)   # q, k, v: CUDA tensors with requires_grad
    out.float().pow(2).mean().backward()

torch stays optional: only this module imports it, and nothing in nbflash imports this module.
Tensors cross to CuPy and back through DLPack without a copy, and every kernel is queued on torch's
current stream (wrapped as a CuPy stream: ``Stream.from_external`` on CuPy 14 and newer, the
``ExternalStream`` it deprecates on older CuPy), so the calls order with the surrounding torch work
exactly like a torch op's.
"""

import contextlib

import torch

from . import backward, interface, packed, reference, runtime, validation, varlen


@contextlib.contextmanager
def _on_torch_stream(tensor):
    """Make ``tensor``'s GPU CuPy's current device, and torch's current stream there CuPy's current
    stream, for the ``with`` block."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"q must be a torch tensor on the GPU, got {type(tensor).__name__} (nbflash.torch takes torch "
                        f"tensors; nbflash.flash_attn_func takes CuPy arrays)")
    if tensor.device.type != "cuda":
        raise TypeError(f"q is a {tensor.device.type} tensor; nbflash runs on the GPU: pass q.cuda()")
    cupy = runtime.cupy()
    device = tensor.device.index
    with cupy.cuda.Device(device), _cupy_stream(cupy, torch.cuda.current_stream(tensor.device), device):
        yield


class _StreamPointer:
    """A raw CUDA stream pointer with the CUDA stream protocol, for torch versions whose streams
    lack ``__cuda_stream__``."""

    def __init__(self, pointer):
        self.pointer = pointer

    def __cuda_stream__(self):
        return (0, self.pointer)


_CUPY_STREAMS = {}  # (device, stream pointer) -> the CuPy stream wrapping it
_CUPY_STREAMS_AT_MOST = 64


def _cupy_stream(cupy, stream, device):
    """The CuPy stream for torch's ``stream`` on ``device``: ``cupy.cuda.Stream.from_external``
    where CuPy has it (14 and newer, where ``ExternalStream`` is deprecated and warns on each
    construction), else ``cupy.cuda.ExternalStream``. Neither owns the stream (torch does). Kept
    per (device, pointer), so that a call makes no new one: the wrapper holds nothing but the
    pointer (and, from_external, a reference to torch's stream object)."""
    key = (device, stream.cuda_stream)
    wrapped = _CUPY_STREAMS.get(key)
    if wrapped is None:
        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        if from_external is not None:
            wrapped = from_external(stream if hasattr(stream, "__cuda_stream__") else _StreamPointer(key[1]))
        else:
            wrapped = cupy.cuda.ExternalStream(key[1], device)
        if len(_CUPY_STREAMS) >= _CUPY_STREAMS_AT_MOST:
            _CUPY_STREAMS.clear()
        _CUPY_STREAMS[key] = wrapped
    return wrapped


def _last_dim_contiguous(x):
    """``x`` itself when its last dim is contiguous, else a contiguous copy. Autograd hands over
    broadcast gradients (stride 0 everywhere, from ``out.sum()``), which the kernels cannot read."""
    return x if x.shape[-1] == 1 or x.stride(-1) == 1 else x.contiguous()


class FlashAttnFunction(torch.autograd.Function):
    """out = flash_attn_func(q, k, v); the backward recomputes attention from (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, bias, user,
                dropout, block_mask):
        with _on_torch_stream(q):
            # torch refuses to export tensors that require gradients; the detached views share memory.
            slopes = alibi_slopes.detach() if alibi_slopes is not None else None
            problem, q_, k_, v_ = validation.check_forward(_detached(q), _detached(k), _detached(v), softmax_scale,
                                                           causal, window_size, softcap, slopes, _detached(bias),
                                                           *user, *dropout, block_mask)
            out, lse = interface._flash_attn_forward(problem, q_, k_, v_)
            out, lse = torch.from_dlpack(out), torch.from_dlpack(lse)
        _keep_for_backward(ctx, problem, deterministic, q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if ctx.problem.variant.score_mod and not ctx.problem.variant.score_mod_grad:
            raise ValueError("score_mod's backward needs its derivative: pass score_mod_grad=... to "
                             "nbflash.torch.flash_attn_func")
        return _gradients(ctx, dout, backward._flash_attn_backward) + (None,) * 10


def _keep_for_backward(ctx, problem, deterministic, q, k, v, out, lse):
    """What an autograd Function's backward recomputes attention from."""
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.problem = problem  # the variant, and its tensors (bias, slopes, offsets) kept alive with it
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def _gradients(ctx, dout, run_backward):
    """(dq, dk, dv) as torch tensors: ``run_backward(problem, dout, q, k, v, out, lse, deterministic)``
    on the tensors ``_keep_for_backward`` saved, queued on torch's stream."""
    q, k, v, out, lse = ctx.saved_tensors
    dout = _last_dim_contiguous(dout.to(q.dtype))
    with _on_torch_stream(q):
        arrays = [validation.as_backend_array(x.detach(), name) for x, name in
                  ((dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"))]
        grads = run_backward(ctx.problem, *arrays, ctx.deterministic)
        return tuple(torch.from_dlpack(g) for g in grads)


def _check_flags(deterministic, return_attn_probs, return_lse):
    """The flags must be bools (a string such as "no" would otherwise count as True)."""
    for value, name in ((deterministic, "deterministic"), (return_attn_probs, "return_attn_probs"),
                        (return_lse, "return_lse")):
        interface._check_flag(value, name)


_FLOAT8 = {getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
           if hasattr(torch, name)}


def _fp8_bytes(q, k, v, fp8_dtype):
    """(q, k, v, fp8_dtype) for the core's fp8 forward: torch.float8_e4m3fn tensors as their bytes
    (torch.uint8 views, which CuPy can hold, as it cannot hold float8) with fp8_dtype saying what
    they are; other tensors detached as they are, for the core to check."""
    tensors = (q, k, v)
    for x, name in zip(tensors, "qkv"):
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"the fp8 forward has no backward and {name} requires grad; call it under "
                             f"torch.no_grad() or pass {name}.detach()")
    dtypes = [getattr(x, "dtype", None) for x in tensors]
    if not any(d in _FLOAT8 for d in dtypes):
        return (*(_detached(x) for x in tensors), fp8_dtype)
    if len(set(dtypes)) > 1:
        raise TypeError(f"q, k and v must have one dtype, got q.dtype={dtypes[0]}, k.dtype={dtypes[1]}, "
                        f"v.dtype={dtypes[2]}")
    if dtypes[0] != torch.float8_e4m3fn:
        raise ValueError(f"q, k and v are {dtypes[0]}: the fp8 forward reads float8_e4m3fn only (e5m2 is not "
                         f"supported, nor are the fnuz formats); pass torch.float8_e4m3fn tensors")
    return (*(x.detach().view(torch.uint8) for x in tensors), "float8_e4m3fn" if fp8_dtype is None else fp8_dtype)


def _detached(x):
    """A tensor without its autograd history (torch refuses to export one that requires gradients);
    anything else as it is, for validation to refuse by name."""
    return x.detach() if isinstance(x, torch.Tensor) else x


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, return_lse=False, bias=None,
                    score_mod=None, mask_mod=None, score_mod_grad=None, block_mask=None, q_descale=None,
                    k_descale=None, v_descale=None, fp8_dtype=None):
    """``nbflash.flash_attn_func`` on torch tensors, differentiable with respect to q, k and v:
    flash-attn 2.8's ``flash_attn_func``, argument for argument, so that
    ``from nbflash.torch import flash_attn_func`` replaces ``from flash_attn import flash_attn_func``.

    Arguments and shapes as ``nbflash.flash_attn_func``: q (batch, seqlen_q, nheads, headdim), k and v
    (batch, seqlen_k, nheads_k, headdim), CUDA tensors of dtype float16, bfloat16 or float32;
    ``alibi_slopes`` a float32 CUDA tensor and ``bias`` a float or bool CUDA tensor (no gradients);
    ``score_mod``, ``mask_mod``, ``block_mask`` as in nbflash.flash_attn_func, and ``score_mod_grad`` (the
    derivative of score_mod, which the backward needs). ``deterministic`` makes the backward
    bit-identical run to run (see ``nbflash.backward.flash_attn_backward``). Returns ``out``; with
    ``return_lse=True`` (out, lse), with ``return_attn_probs=True`` (out, lse, S_dmask), as torch
    tensors on q's device (lse and S_dmask not differentiable).

    Dropout's seed comes from torch's default generator, so ``torch.manual_seed`` reproduces a run;
    the backward regenerates the forward's mask from it.

    The fp8 forward (FlashAttention-3's, as in nbflash.flash_attn_func; compute capability 9.0):
    q, k, v ``torch.float8_e4m3fn`` tensors (or torch.uint8 tensors of e4m3 bytes with
    ``fp8_dtype="float8_e4m3fn"``), ``q_descale``, ``k_descale``, ``v_descale`` float32 CUDA
    tensors of shape (batch, nheads_k), scalars or None; out is bfloat16. Inference only (no
    backward): q, k and v must not require gradients where autograd is on::

        out = flash_attn_func(q.to(torch.float8_e4m3fn), k8, v8, causal=True, q_descale=qd, k_descale=kd,
                              v_descale=vd)
    """
    _check_flags(deterministic, return_attn_probs, return_lse)
    if (q_descale is not None or k_descale is not None or v_descale is not None or fp8_dtype is not None
            or getattr(q, "dtype", None) in _FLOAT8):
        if score_mod_grad is not None:
            raise ValueError("the fp8 forward takes softmax_scale, causal and window_size only, not score_mod_grad "
                             "(it has no backward)")
        q, k, v, fp8_dtype = _fp8_bytes(q, k, v, fp8_dtype)
        with _on_torch_stream(q), torch.no_grad():
            result = interface.flash_attn_func(
                q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, _detached(alibi_slopes),
                deterministic, return_attn_probs, return_lse=return_lse, bias=_detached(bias), score_mod=score_mod,
                mask_mod=mask_mod, block_mask=block_mask, q_descale=_detached(q_descale),
                k_descale=_detached(k_descale), v_descale=_detached(v_descale), fp8_dtype=fp8_dtype)
            if not isinstance(result, tuple):
                return torch.from_dlpack(result)
            return tuple(None if x is None else torch.from_dlpack(x) for x in result)
    seed = None
    if validation.check_dropout_p(dropout_p) > 0:
        seed = int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item())
    out, lse = FlashAttnFunction.apply(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                       deterministic, bias, (score_mod, mask_mod, score_mod_grad), (dropout_p, seed),
                                       block_mask)
    if return_attn_probs:
        with _on_torch_stream(q), torch.no_grad():
            problem, *arrays = validation.check_forward(_detached(q), _detached(k), _detached(v), softmax_scale,
                                                        causal, window_size, softcap, _detached(alibi_slopes),
                                                        _detached(bias), score_mod, mask_mod, None, dropout_p, seed,
                                                        block_mask)
            probs = reference.attention_probabilities(*arrays, problem.softmax_scale, False, problem.window(),
                                                      problem.softcap, problem.alibi_slopes,
                                                      bias=problem.bias if problem.mask is None else problem.mask,
                                                      score_mod=score_mod,
                                                      mask_mod=block_mask.mask_mod if block_mask is not None else mask_mod,
                                                      dropout_p=problem.dropout_p, seed=problem.seed)
            return out, lse, torch.from_dlpack(probs)
    return (out, lse) if return_lse else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, out=None):
    """``nbflash.flash_attn_with_kvcache`` on torch tensors (inference: no autograd), flash-attn 2.8's
    signature. The caches are updated in place (the kernels write into the tensors' own memory);
    the work is queued on torch's current stream. Returns out (or ``out`` itself when given), and
    with ``return_softmax_lse`` (out, softmax_lse), as torch tensors on q's device."""
    from . import kvcache

    def plain(x):
        return x.detach() if isinstance(x, torch.Tensor) else x

    with _on_torch_stream(q), torch.no_grad():
        result = kvcache.flash_attn_with_kvcache(
            plain(q), plain(k_cache), plain(v_cache), plain(k), plain(v), plain(rotary_cos), plain(rotary_sin),
            plain(cache_seqlens), plain(cache_batch_idx), plain(cache_leftpad), plain(block_table), softmax_scale,
            causal, window_size, softcap, rotary_interleaved, plain(alibi_slopes), num_splits, return_softmax_lse,
            out=plain(out))
    attention, lse = result if return_softmax_lse else (result, None)
    attention = out if out is not None else torch.from_dlpack(attention)
    return (attention, torch.from_dlpack(lse)) if return_softmax_lse else attention


class FlashAttnVarlenFunction(torch.autograd.Function):
    """out = flash_attn_varlen_func(q, k, v, ...) on packed sequences; the backward recomputes
    attention from (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_size, softcap, alibi_slopes, deterministic, dropout):
        with _on_torch_stream(q):
            problem, q_, k_, v_ = validation.check_varlen(_detached(q), _detached(k), _detached(v), cu_seqlens_q,
                                                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                                          causal, window_size, softcap, _detached(alibi_slopes),
                                                          *dropout)
            out, lse = varlen._varlen_forward(problem, q_, k_, v_)
            out, lse = torch.from_dlpack(out), torch.from_dlpack(lse)
        _keep_for_backward(ctx, problem, deterministic, q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _gradients(ctx, dout, varlen._varlen_backward) + (None,) * 11


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, return_lse=False):
    """``nbflash.flash_attn_varlen_func`` on torch tensors, differentiable with respect to q, k and
    v: flash-attn 2.8's ``flash_attn_varlen_func``, argument for argument. q (total_q, nheads,
    headdim), k and v (total_k, nheads_k, headdim) CUDA tensors; cu_seqlens_q / cu_seqlens_k int32
    CUDA tensors (batch + 1,); max_seqlen_q / max_seqlen_k Python ints. Returns ``out``; with
    ``return_lse=True`` (out, lse), with ``return_attn_probs=True`` (out, lse, S_dmask); lse
    (nheads, total_q), not differentiable. Dropout's seed comes from torch's default generator.
    """
    if block_table is not None:
        raise NotImplementedError("block_table (paged K/V) is not supported with packed sequences; pass the keys "
                                  "and values packed as k, v (total_k, nheads_k, headdim)")
    _check_flags(deterministic, return_attn_probs, return_lse)
    seed = None
    if validation.check_dropout_p(dropout_p) > 0:
        seed = int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item())
    with _on_torch_stream(q):
        cu_q, cu_k = (validation.as_backend_array(c, name) for c, name in
                      ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")))
    out, lse = FlashAttnVarlenFunction.apply(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                             window_size, softcap, alibi_slopes, deterministic, (dropout_p, seed))
    if return_attn_probs:
        with _on_torch_stream(q), torch.no_grad():
            problem, *arrays = validation.check_varlen(_detached(q), _detached(k), _detached(v), cu_q, cu_k,
                                                       max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
                                                       softcap, _detached(alibi_slopes), dropout_p, seed)
            return out, lse, torch.from_dlpack(varlen._varlen_probabilities(problem, *arrays))
    return (out, lse) if return_lse else out


# flash-attn's packed functions on torch tensors: flash_attn_func and flash_attn_varlen_func above
# on views of qkv or kv (no copy), so autograd's gradient reaches the packed tensor packed the same
# way (nbflash/packed.py).
(flash_attn_qkvpacked_func, flash_attn_kvpacked_func, flash_attn_varlen_qkvpacked_func,
 flash_attn_varlen_kvpacked_func) = packed.packed_functions(flash_attn_func, flash_attn_varlen_func)
