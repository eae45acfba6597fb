"""Pieces the portable kernels share: element conversion and the cooperative tile load.

Device code only. Each helper is built for one kernel configuration (its head dimension, its thread
count, its element type), so its loops have constant trip counts.
"""

from numba import cuda, float32
from numba.types import float16

from ..primitives import bf16_bits_to_f32, f32_to_bf16_bits, inline_device, to_f32


def element_io(dtype):
    """(load, store) for elements of ``dtype``: widen one to float32, narrow a float32 back.

    bfloat16 elements are uint16 bits; float16 outputs are narrowed by the array store itself.
    """
    if dtype == "bfloat16":
        return bf16_bits_to_f32, f32_to_bf16_bits
    return to_f32, to_f32


def output_store(dtype):
    """A device function ``store_element(out, b, row, h, col, value)``: out[b, row, h, col] =
    value (float32) narrowed to ``dtype`` (float16, or bfloat16 as its uint16 bits), the tensor-core
    kernels' output write."""
    if dtype == "float16":

        @inline_device
        def store_element(out, b, row, h, col, value):
            out[b, row, h, col] = float16(value)

    else:

        @inline_device
        def store_element(out, b, row, h, col, value):
            out[b, row, h, col] = f32_to_bf16_bits(value)

    return store_element


def tile_loader(headdim, num_threads, load):
    """A device function ``load_tile(src, batch, start, head, rows, tile, scale)``:
    tile[r, d] = src[batch, start + r, head, d] * scale, zero beyond the ``rows`` valid rows.

    The whole block takes part; consecutive threads read consecutive features of a row, so global
    reads are coalesced. ``tile`` is a float32 shared array of at least ``headdim`` columns.
    """

    @cuda.jit(device=True, inline=True)
    def load_tile(src, batch, start, head, rows, tile, scale):
        for i in range(cuda.threadIdx.x, tile.shape[0] * headdim, num_threads):
            r = i // headdim
            d = i - r * headdim
            if r < rows:
                tile[r, d] = load(src[batch, start + r, head, d]) * scale
            else:
                tile[r, d] = float32(0.0)

    return load_tile
