"""nbflash: FlashAttention as Numba CUDA kernels in Python syntax, over CuPy arrays.

    out = nbflash.flash_attn_func(q, k, v, causal=True)

See ``flash_attn_func`` for shapes, dtypes and the causal convention.
"""

from .configs import kernel_family
from .interface import explain, flash_attn_func
from .reference import attention_naive, attention_reference

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "explain",
    "kernel_family",
    "attention_reference",
    "attention_naive",
    "__version__",
]
