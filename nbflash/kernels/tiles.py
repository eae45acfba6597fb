"""Pieces the kernels share: element conversion and cooperative tile loads (the portable kernels'
float32 tiles; the tensor-core kernels' 16-bit tiles with padded rows).

Device code only. Each helper is built for one kernel configuration (its head dimension, its thread
count, its element type), so its loops have constant trip counts.
"""

from numba import cuda, float32, uint32

from ..primitives import bf16_bits_to_f32, cp_async_16_from, f32_to_bf16_bits, inline_device, to_f32


def element_io(dtype):
    """(load, store) for elements of ``dtype``: widen one to float32, narrow a float32 back.

    bfloat16 elements are uint16 bits; float16 outputs are narrowed by the array store itself.
    """
    if dtype == "bfloat16":
        return bf16_bits_to_f32, f32_to_bf16_bits
    return to_f32, to_f32


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


def padded_tile_copies(num_threads, headdim, headdim_padded, row_elems, elem):
    """``(copy_async, copy_elementwise)`` for the tensor-core kernels' shared tiles: rows of
    ``row_elems`` 16-bit elements, zero past the valid rows and past ``headdim`` up to
    ``headdim_padded`` (the mma steps read the padding). Both take ``rounds``, the constant number of
    rounds the block needs to cover a tile.

    ``copy_async(tile, x_row0, row_bytes, row0, valid_rows, rounds, tile_rows)``: 16-byte cp.async
    copies (rows on 16-byte boundaries, headdim % 8 == 0); thread ``tid`` copies chunks tid,
    tid + num_threads, ... ``tile`` is the tile's shared address, ``x_row0`` the global address of the
    head's row 0 (``global_address``), so a copy costs one multiply-add. The caller commits and waits.

    ``copy_elementwise(smem, tile_elem0, x, b, row0, h, valid_rows, rounds, tile_rows)``: plain loads
    and stores, one element each: any strides, any headdim.
    """
    chunks = headdim_padded // 8  # 16-byte chunks per row
    row_bytes_shared = row_elems * 2

    @inline_device
    def copy_async(tile, x_row0, row_bytes, row0, valid_rows, rounds, tile_rows):
        tid = cuda.threadIdx.x
        for i in range(rounds):
            chunk = i * num_threads + tid
            if chunk < tile_rows * chunks:
                r = chunk // chunks
                col = (chunk % chunks) * 8
                inside = r < valid_rows and col < headdim
                src = x_row0 + (row0 + r) * row_bytes + col * 2 if inside else x_row0
                cp_async_16_from(tile + uint32(r * row_bytes_shared + col * 2), src, uint32(16 if inside else 0))

    @inline_device
    def copy_elementwise(smem, tile_elem0, x, b, row0, h, valid_rows, rounds, tile_rows):
        tid = cuda.threadIdx.x
        for i in range(rounds):
            e = i * num_threads + tid
            if e < tile_rows * headdim_padded:
                r = e // headdim_padded
                col = e % headdim_padded
                value = elem(0)
                if r < valid_rows and col < headdim:
                    value = x[b, row0 + r, h, col]
                smem[tile_elem0 + r * row_elems + col] = value

    return copy_async, copy_elementwise
