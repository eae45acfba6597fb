"""The backward pass: gradients of flash_attn_func, for training.

``flash_attn_backward`` follows flash-attn's ``_flash_attn_backward``: it takes the forward's output
and log-sum-exp (``flash_attn_func(..., return_lse=True)``) and recomputes the attention probabilities
tile by tile from them, so its extra memory is O(batch * nheads * seqlen_q), never N x N.
"""

import math
from functools import lru_cache

import numpy as np

from . import configs, launch, runtime, validation
from .block_mask import kernel_params
from .configs import forced_family, plan_backward
from .dtypes import FLOAT32
from .interface import user_functions_compile
from .kernels.backward_sm90 import FOLD_STEPS, dq_accum_shape

LOG2_E = math.log2(math.e)

# ---------------------------------------------------------------------------------------------------
# Validation of the backward-only arguments
# ---------------------------------------------------------------------------------------------------


def _check_backward(problem, q, dout, out, lse, deterministic):
    """Validate dout, out and lse against the (already checked) q. Returns them as backend arrays."""
    dims = "(batch, seqlen_q, nheads, headdim)"
    checked = []
    for name, x in (("dout", dout), ("out", out)):
        x = validation.as_backend_array(x, name)
        validation._check_layout(x, name, dims)
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)} {dims}, got {tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name}.dtype={x.dtype} differs from q.dtype={q.dtype}; they must match")
        checked.append(x)

    lse = validation.as_backend_array(lse, "lse")
    expected = (problem.batch, problem.nheads, problem.seqlen_q)
    if lse.dtype != FLOAT32:
        raise TypeError(f"lse.dtype={lse.dtype} must be float32 (as flash_attn_func returns it)")
    if tuple(lse.shape) != expected:
        raise ValueError(
            f"lse must have shape (batch, nheads, seqlen_q) = {expected}, got {tuple(lse.shape)}"
        )
    checked.append(lse)

    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    if not runtime.SIMULATOR:
        for name, x in zip(("dout", "out", "lse"), checked):
            if x.data.device_id != problem.device:
                raise ValueError(f"{name} is on GPU {x.data.device_id} but q is on GPU {problem.device}")
    return checked


# ---------------------------------------------------------------------------------------------------
# Compiling: each config for its signature (kernels/registry.py), launched like the forward
# ---------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _kernels(static, deterministic, family, aligned, out_aligned=False, dq_tiles=True):
    """The three compiled kernels of a call (preprocess, dkdv, dq or convert_dq); one cache lookup
    per call. The tensor-core kernels take the portable ones' arguments."""
    with user_functions_compile(static.variant):
        return tuple(launch.compiled(config, static.device)
                     for config in plan_backward(static, deterministic, family, aligned, out_aligned, dq_tiles))


def _dq_accumulator(dkdv_config, batch, nheads, rows, row_major_shape):
    """(dq_accum, tile_major) for a call with atomics: held tile-major where the dK/dV kernel stages
    dQ (the sm90 kernel's dq_reduce="tiles": ``dq_accum_shape``, ``rows`` the query rows: seqlen_q,
    or total_q for packed sequences; with ``fold_dq`` its tiles' arrival counters after them), zeroed
    here, the preprocess (planned without atomic_dq) leaving it alone and the planned conversion
    reading that order; else row-major (``row_major_shape``), zeroed by the preprocess."""
    if getattr(dkdv_config, "dq_tile_major", False):
        return launch.zeros(dq_accum_shape(dkdv_config, batch, nheads, rows), FLOAT32), True
    return launch.empty(row_major_shape, FLOAT32), False


def _fold_or_not(dkdv, problem):
    """(dkdv, folded): the planned dK/dV kernel and whether it converts dQ itself (the sm90 kernel's
    ``fold_dq``), which it can with at most FOLD_STEPS steps a block (GQA group x query tiles) and a
    key tile at least (no block otherwise); past that, the same kernel without it (compiled on first
    use) and the conversion kernel after it."""
    config, p = dkdv.config, problem
    if not getattr(config, "fold_dq", False):
        return dkdv, False
    if p.nheads // p.nheads_k * -(-p.seqlen_q // config.block_m) <= FOLD_STEPS and p.seqlen_k > 0:
        return dkdv, True
    return launch.compiled(config.replaced(fold_dq=False), p.static.device), False


def _dq_out(dkdv, dq):
    """dq as the dK/dV kernel's argument after dq_accum, for the kernels that take it (``takes_dq``)."""
    return (dq,) if getattr(dkdv.config, "takes_dq", False) else ()


# ---------------------------------------------------------------------------------------------------
# The backward pass
# ---------------------------------------------------------------------------------------------------


def _flash_attn_backward(problem, dout, q, k, v, out, lse, deterministic=False):
    """Run the backward pass on validated inputs; returns (dq, dk, dv) as backend arrays."""
    p = problem
    # The tensor-core kernels where they apply, unless a family is forced (configs.plan_backward).
    family = forced_family()
    aligned = p.aligned and validation.rows_aligned(dout)  # q, k, v (checked) and dout: cp.async
    # out's rows too, where the row-wise kernels' 16-byte forms are planned (they read them)
    out_aligned = configs.ROWWISE_VECTOR and validation.rows_aligned(out)
    preprocess, dkdv, dq_kernel = _kernels(p.static, deterministic, family, aligned, out_aligned)
    dkdv, folded = _fold_or_not(dkdv, p)
    # dQ by a pass of its own (deterministic=True, or where the plan prefers it: configs.py) or atomics
    separate_dq = not dkdv.config.atomic_dq
    dq = launch.empty(q.shape, q.dtype)
    dk = launch.empty(k.shape, k.dtype)
    dv = launch.empty(v.shape, v.dtype)
    delta = launch.empty((problem.batch, problem.nheads, problem.seqlen_q), FLOAT32)
    # dq_accum is only used with atomics; delta stands in for it otherwise (one signature per config).
    dq_accum, tiles = (delta, False) if separate_dq else _dq_accumulator(dkdv.config, p.batch, p.nheads,
                                                                           p.seqlen_q, q.shape)

    scale = np.float32(problem.softmax_scale)
    scale_log2 = np.float32(problem.softmax_scale * LOG2_E)
    shape = (problem.batch, problem.nheads, problem.nheads_k, problem.seqlen_q, problem.seqlen_k)

    # D = rowsum(dO * O); with atomics, dq_accum zeroed too.
    preprocess.launch(preprocess.config.grid(*shape), (out, dout, delta, delta if tiles else dq_accum), ())
    dkdv.launch(dkdv.config.grid(*shape), (q, k, v, dout, lse, delta, dk, dv, dq_accum, *_dq_out(dkdv, dq)),
                (scale_log2, scale), kernel_params(p, dkdv.config))
    if separate_dq:
        dq_kernel.launch(dq_kernel.config.grid(*shape), (q, k, v, dout, lse, delta, dq), (scale_log2, scale),
                         kernel_params(p, dq_kernel.config))
    elif not folded:  # (folded: the dK/dV kernel converted dQ itself)
        dq_kernel.launch(dq_kernel.config.grid(*shape), (dq_accum, dq), (scale,))
    return dq, dk, dv


def flash_attn_backward(dout, q, k, v, out, lse, dropout_p=0.0, softmax_scale=None, causal=False,
                        window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, *, bias=None,
                        score_mod=None, mask_mod=None, score_mod_grad=None, block_mask=None, seed=None):
    """Gradients of ``flash_attn_func`` with respect to q, k and v.

    Arguments:
        dout: (batch, seqlen_q, nheads, headdim), the gradient of the loss with respect to ``out``.
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes: exactly as
            given to ``flash_attn_func``, in its order (same shapes, dtypes, strides rules,
            grouped-query attention and bottom-right alignment). Every variant has its gradient:
            through the softcap's tanh; ALiBi slopes get none (they are not trained).
        bias, score_mod, mask_mod, block_mask: (nbflash) as given to ``flash_attn_func``; bias gets no
            gradient. A block mask's tables are per tile size, so the backward's kernels classify
            their own tiles on first use (kept in the BlockMask for the next calls).
        seed: (nbflash) with dropout_p > 0, the forward's seed (``nbflash.last_dropout_seed()`` after a
            forward with seed=None): the dropout mask is regenerated from it.
        score_mod_grad: (nbflash) with a score_mod, its derivative with respect to the score:
            ``score_mod_grad(score, b, h, q_idx, kv_idx) -> d score_mod / d score`` (compiled the
            same way); the backward of a score_mod cannot run without it.
        out: (batch, seqlen_q, nheads, headdim), q's dtype: the forward's output.
        lse: (batch, nheads, seqlen_q), float32: the forward's log-sum-exp
            (``flash_attn_func(..., return_lse=True)``).
        deterministic: bool. By default dq is accumulated with float32 atomics, whose order varies
            from run to run (so do the last bits of dq). With True, dq comes from a separate pass
            in a fixed order and every gradient is bit-identical run to run, at some extra cost.
            (On Hopper GPUs, at headdims past 128, the default already takes that separate pass:
            it is faster there than the atomics.)

    Returns:
        dq, dk, dv: shaped and typed like q, k, v (fresh contiguous arrays). Under grouped-query
        attention, dk and dv of a key/value head are summed over the query heads that share it.
        Query rows that see no key (causal, seqlen_q > seqlen_k) get dq = 0 and contribute nothing.

    Kernels: the tensor-core family for float16/bfloat16 on compute capability >= 8.0, the portable
    one otherwise (float32, older GPUs); ``nbflash.kernel_family`` forces either.

    Extra memory: float32 (batch, nheads, seqlen_q) for rowsum(dout * out), plus a float32 copy of
    dq's shape for the atomics (not in deterministic mode, nor where the plan takes the separate dQ
    pass anyway: on Hopper GPUs past headdim 128). The work is queued on CuPy's current
    stream; the call does not wait for it.
    """
    if validation.check_dropout_p(dropout_p) > 0 and seed is None:
        raise ValueError("dropout_p > 0: pass the forward's seed=... so the backward regenerates its dropout mask "
                         "(nbflash.last_dropout_seed() reads back one the forward drew)")
    if score_mod is not None and score_mod_grad is None:
        raise ValueError("score_mod's backward needs its derivative: pass score_mod_grad(score, b, h, q_idx, "
                         "kv_idx) -> d score_mod / d score (e.g. lambda s, b, h, i, j: 1.0 for a shift)")
    problem, q, k, v = validation.check_forward(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                                bias, score_mod, mask_mod, score_mod_grad, dropout_p, seed,
                                                block_mask)
    dout, out, lse = _check_backward(problem, q, dout, out, lse, deterministic)
    return _flash_attn_backward(problem, dout, q, k, v, out, lse, bool(deterministic))
