"""nbflash: FlashAttention as Numba CUDA kernels in Python syntax, over CuPy arrays.

    out = nbflash.flash_attn_func(q, k, v, causal=True)
    out, lse = nbflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = nbflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    out = nbflash.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = nbflash.flash_attn_qkvpacked_func(qkv, causal=True)   # and kvpacked, varlen_*packed (nbflash/packed.py)

See ``flash_attn_func`` for shapes, dtypes and the causal convention; ``nbflash.torch`` for a
PyTorch autograd function over the same kernels (torch stays optional: only that module imports it).
"""

from . import _compile_speed
from .backward import flash_attn_backward
from .block_mask import BlockMask, create_block_mask
from .configs import kernel_family
from .interface import explain, flash_attn_func
from .kvcache import flash_attn_with_kvcache, merge_attention_states
from .packed import (flash_attn_kvpacked_backward, flash_attn_kvpacked_func, flash_attn_qkvpacked_backward,
                     flash_attn_qkvpacked_func, flash_attn_varlen_kvpacked_backward, flash_attn_varlen_kvpacked_func,
                     flash_attn_varlen_qkvpacked_backward, flash_attn_varlen_qkvpacked_func)
from .varlen import flash_attn_varlen_backward, flash_attn_varlen_func
from .validation import last_dropout_seed
from .reference import (attention_naive, attention_probabilities, attention_reference, attention_reference_backward,
                        attention_varlen_reference, attention_varlen_reference_backward)

__version__ = "0.1.0"

_compile_speed.apply()  # before any kernel compiles: a faster, equivalent numba-cuda lowering pass

__all__ = [
    "flash_attn_func",
    "flash_attn_backward",
    "flash_attn_varlen_func",
    "flash_attn_varlen_backward",
    "flash_attn_with_kvcache",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_qkvpacked_backward",
    "flash_attn_kvpacked_backward",
    "flash_attn_varlen_qkvpacked_backward",
    "flash_attn_varlen_kvpacked_backward",
    "merge_attention_states",
    "explain",
    "create_block_mask",
    "BlockMask",
    "last_dropout_seed",
    "kernel_family",
    "attention_reference",
    "attention_reference_backward",
    "attention_varlen_reference",
    "attention_varlen_reference_backward",
    "attention_naive",
    "attention_probabilities",
    "__version__",
]
