"""The public attention functions. Names and arguments follow flash-attn's Python interface."""

import dataclasses
import math
from functools import lru_cache

from . import configs, launch, validation
from .dtypes import FLOAT32

LOG2_E = math.log2(math.e)


@lru_cache(maxsize=None)
def _forward_kernel(static, family):
    """The compiled kernel for a problem's static part; one cache lookup per call."""
    return launch.compiled(configs.plan_forward(static, family), static.device)


def _kernel_for(problem, family=None):
    return _forward_kernel(problem.static, family or configs.forced_family())


def _flash_attn_forward(problem, q, k, v, family=None):
    """Run the forward pass on validated inputs; returns (out, lse) as backend arrays."""
    kernel = _kernel_for(problem, family)
    config = kernel.config
    out, lse = launch.empty_pair(q.shape, q.dtype, (problem.batch, problem.nheads, problem.seqlen_q), FLOAT32)
    grid = config.grid(problem.batch, problem.nheads, problem.seqlen_q)
    # The problem stands for the five arrays' shapes and strides (validation remembers it per layout).
    kernel.launch(grid, (q, k, v, out, lse), (problem.softmax_scale * LOG2_E,), problem.params, problem)
    return out, lse


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False):
    """Exact scaled dot-product attention, softmax(q k^T * softmax_scale) v, in O(seqlen) memory.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim)
        k: (batch, seqlen_k, nheads_k, headdim)
        v: (batch, seqlen_k, nheads_k, headdim)
            float16, bfloat16 or float32, all the same; headdim 1 to 256. nheads must be a multiple
            of nheads_k (grouped-query / multi-query attention): query head h uses key/value head
            h // (nheads // nheads_k). Any strides, but the last dim contiguous. On a GPU: CuPy
            arrays, or any GPU array exporting DLPack or __cuda_array_interface__ (a PyTorch
            tensor is used without a copy). Under Numba's CUDA simulator: NumPy arrays.
        softmax_scale: float. Default 1 / sqrt(headdim).
        causal: bool. Causal mask aligned to the bottom-right corner of the score matrix, as in
            flash-attn >= 2.1. For seqlen_q = 2, seqlen_k = 5 (1 = kept, 0 = masked)::

                1 1 1 1 0
                1 1 1 1 1

            and for seqlen_q = 5, seqlen_k = 2::

                0 0
                0 0
                0 0
                1 0
                1 1

            A query row that sees no key gets output 0 (and lse -inf).
        return_lse: bool. Also return the log-sum-exp of each score row.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype; a CuPy array (NumPy under the simulator).
        lse: (batch, nheads, seqlen_q), float32, natural log; only with return_lse=True.

    The work is queued on CuPy's current stream; the call does not wait for it.
    """
    problem, q, k, v = validation.check_forward(q, k, v, softmax_scale, causal)
    out, lse = _flash_attn_forward(problem, q, k, v)
    return (out, lse) if return_lse else out


def explain(q, k, v, softmax_scale=None, causal=False):
    """Which kernel and configuration ``flash_attn_func(q, k, v, ...)`` runs, without running it.

    Returns a dict: ``family`` ('mma' or 'portable'), ``config`` (the block configuration), ``grid``,
    ``block``, ``dynamic_shared_bytes``, and, on a GPU, the compiled kernel's ``registers`` per
    thread, ``static_shared_bytes`` and ``local_bytes`` per thread (spills). Compiles the kernel if it
    is not compiled yet. Honors an enclosing ``nbflash.kernel_family`` block.
    """
    problem, q, k, v = validation.check_forward(q, k, v, softmax_scale, causal)
    kernel = _kernel_for(problem)
    config = kernel.config
    return {
        "family": "mma" if isinstance(config, configs.MmaForwardConfig) else "portable",
        "config": {**dataclasses.asdict(config), "block_m": config.block_m, "block_n": config.block_n},
        "grid": config.grid(problem.batch, problem.nheads, problem.seqlen_q),
        "block": (config.threads, 1, 1),
        "dynamic_shared_bytes": kernel.dynamic_shared,
        "static_shared_bytes": kernel.static_shared,
        "registers": kernel.registers,
        "local_bytes": kernel.local_bytes,
    }
