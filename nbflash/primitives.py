"""Tile primitives: the few low-level operations the kernels need that plain Numba does not spell.

Each primitive exists twice:

* on a GPU, a Numba ``@intrinsic`` whose code generation emits the LLVM IR or inline PTX directly;
* under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), a plain-Python emulation with the same
  contract, so the production kernels run unchanged on the CPU (slowly, at small sizes).

The choice is made once, at import time, from ``numba.config.ENABLE_CUDASIM``. Kernels import the
names from here and never ask which version they got. ``tests/test_primitives.py`` checks the GPU
versions against the emulations.
"""

import struct

import numpy as np
from numba import config

SIMULATOR = bool(config.ENABLE_CUDASIM)


# ---------------------------------------------------------------------------------------------------
# Bit casts and bfloat16 conversion
#
# bfloat16 tensors reach the kernels as uint16 arrays holding the raw bits (NumPy has no bfloat16 of
# its own and Numba has no bfloat16 array type). A bfloat16 is the top half of a float32, so widening
# is a shift, and narrowing is round-to-nearest-even on the dropped 16 bits.
# ---------------------------------------------------------------------------------------------------

if SIMULATOR:

    def f32_as_u32(x):
        """The bits of a float32, as a uint32."""
        return np.uint32(struct.unpack("<I", struct.pack("<f", np.float32(x)))[0])

    def u32_as_f32(bits):
        """The float32 whose bits are ``bits``."""
        return np.float32(struct.unpack("<f", struct.pack("<I", int(bits) & 0xFFFFFFFF))[0])

else:
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def f32_as_u32(typingctx, x):
        sig = types.uint32(types.float32)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(types.uint32))

        return sig, codegen

    @intrinsic
    def u32_as_f32(typingctx, bits):
        sig = types.float32(types.uint32)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(types.float32))

        return sig, codegen


from numba import cuda, float32, uint16, uint32  # noqa: E402


@cuda.jit(device=True, inline=True)
def bf16_bits_to_f32(bits):
    """Widen a bfloat16 (given as its uint16 bits) to float32: the bits become the top half."""
    return u32_as_f32(uint32(bits) << uint32(16))


@cuda.jit(device=True, inline=True)
def f32_to_bf16_bits(x):
    """Narrow a float32 to bfloat16 bits, rounding to nearest even; NaN stays NaN."""
    bits = f32_as_u32(x)
    if (bits & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
        return uint16(0x7FC0)
    round_up = uint32(0x7FFF) + ((bits >> uint32(16)) & uint32(1))
    return uint16((bits + round_up) >> uint32(16))


@cuda.jit(device=True, inline=True)
def to_f32(x):
    """Widen a float16 or float32 element to float32."""
    return float32(x)
