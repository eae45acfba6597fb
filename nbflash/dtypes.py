"""The element types nbflash accepts, and how each one reaches a kernel.

NumPy has no bfloat16; ml_dtypes supplies one, and CuPy uses the same type for its bfloat16 arrays.
Kernels see bfloat16 tensors as uint16 arrays holding the raw bits (see ``primitives``).
"""

import ml_dtypes
import numpy as np

FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT32 = np.dtype(np.float32)
# fp8 (e4m3) reaches only the sm90 fp8 forward (nbflash.interface), not SUPPORTED's paths.
FLOAT8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)

SUPPORTED = {"float16": FLOAT16, "bfloat16": BFLOAT16, "float32": FLOAT32}

# The dtype each kind of tensor is handed to the kernels as.
KERNEL_DTYPE = {"float16": FLOAT16, "bfloat16": np.dtype(np.uint16), "float32": FLOAT32,
                "float8_e4m3fn": np.dtype(np.uint16)}  # fp8: byte pairs (the sm90 fp8 forward)


_NAMES = {dtype: name for name, dtype in SUPPORTED.items()}


def dtype_name(dtype):
    """'float16', 'bfloat16' or 'float32' for a supported dtype, else None."""
    name = _NAMES.get(dtype)  # the fast path: a NumPy dtype object
    if name is None:
        try:
            name = _NAMES.get(np.dtype(dtype))
        except TypeError:
            return None
    return name


def as_numpy_dtype(dtype):
    """The NumPy dtype for ``dtype`` (a NumPy dtype, a name, or a dtype of a supported array)."""
    name = dtype_name(dtype)
    if name is None:
        raise TypeError(f"unsupported dtype {dtype!r}; expected float16, bfloat16 or float32")
    return SUPPORTED[name]
