"""Which keys each query sees, and which tiles a block visits.

Plain integer code with no GPU in it. ``register_jitable`` lets the kernels call these functions as
device functions (Numba compiles and inlines them), while the planner, the float64 reference and the
benchmarks' FLOP counts call them as the Python functions they are: every one of them agrees on
what is visible.

The rule is flash-attn's (bottom-right aligned, >= 2.1). Query ``i`` sees key ``j`` iff::

    0 <= j < seqlen_k   and   d - left <= j <= d + right,   where d = i + seqlen_k - seqlen_q

``d`` is the key on query i's diagonal. ``left`` and ``right`` are the window sizes; unbounded sides
arrive as ``seqlen_k`` (left) and ``seqlen_q`` (right), which mask nothing (``nbflash.problem``
turns flash-attn's -1 into those). Causal attention is ``right = 0`` with ``left`` unbounded. For
seqlen_q = 3, seqlen_k = 6, left = 1, right = 0 (1 = visible)::

    0 0 1 1 0 0
    0 0 0 1 1 0
    0 0 0 0 1 1

Tile ranges come as four numbers ``(first, first_full, end_full, end)``: the block visits tiles
``first .. end - 1``; the tiles ``first_full .. end_full - 1`` are seen whole by every row (or column)
of the block, so they need no mask; the others (the window's edges, the diagonal, the sequence
tail) are masked element by element. A block that sees nothing gets ``(0, 0, 0, 0)``.

Sequence bounds: in the dense layout sequence b is rows 0 .. seqlen - 1 of batch row b; in the
packed (varlen) layout ``packed_sequence`` finds its rows, and everything above then applies to
that sequence alone (its own seqlen_q and seqlen_k: causal is bottom-right aligned per sequence).
"""

from numba import int32, uint32
from numba.extending import register_jitable


@register_jitable
def packed_sequence(cu_seqlens_q, cu_seqlens_k, b, total_q, total_k):
    """Packed (varlen) layout: sequence ``b`` holds the query rows q_start .. q_start + seqlen_q - 1
    and the key rows k_start .. k_start + seqlen_k - 1 of the packed arrays, read from the
    cumulative lengths ``cu_seqlens_q`` / ``cu_seqlens_k`` (batch + 1 offsets). Returns
    (q_start, seqlen_q, k_start, seqlen_k).

    The offsets live on the GPU and are not checked there, so they are clamped to the arrays:
    whatever they hold, a sequence is a (possibly empty) run of rows of ``total_q`` / ``total_k``
    and no kernel reads or writes outside them.
    """
    q_start = min(max(cu_seqlens_q[b], 0), total_q)
    q_end = min(max(cu_seqlens_q[b + 1], q_start), total_q)
    k_start = min(max(cu_seqlens_k[b], 0), total_k)
    k_end = min(max(cu_seqlens_k[b + 1], k_start), total_k)
    return q_start, q_end - q_start, k_start, k_end - k_start


def grouped_grid(tiles, pairs, groups):
    """The grid of the ``heavy_groups`` launch order: (groups * tiles, ceil(pairs / groups), 1),
    for ``tiles`` tiles (blocks) in each of ``pairs`` (batch, head) pairs; see ``grouped_block``."""
    return (groups * tiles, -(-pairs // groups), 1)


@register_jitable
def grouped_block(x, y, groups):
    """(tile, pair) of block (x, y) of ``grouped_grid``: tile x // groups of pair
    y * groups + x % groups, so each row of blocks walks a group of ``groups`` pairs tile by tile
    (the heaviest tile first: the kernel numbers its tiles so). A pair at or past the last
    (batch * heads) is a block of a partial last group, with nothing to do. The GPU starts blocks
    in this order, so the last wave is every group's lightest tiles, while the blocks running
    together read a few heads' tensors (scripts/dispatch_model.py)."""
    return x // groups, y * groups + x % groups


@register_jitable
def grouped_query_block(x, y, grid_x, groups, nheads):
    """The forward's (query block, head, batch, query blocks per pair) of block (x, y) of
    ``grouped_grid``, grid_x blocks wide: a batch index at or past the batch's end marks a block of
    a partial last group, with nothing to do."""
    m_block, pair = grouped_block(x, y, groups)
    return m_block, pair % nheads, pair // nheads, grid_x // groups


@register_jitable
def visible_keys(row, seqlen_q, seqlen_k, left, right):
    """Query ``row`` sees the keys ``lo <= j < hi``: returns (lo, hi); empty when hi <= lo."""
    diagonal = row + seqlen_k - seqlen_q
    return max(0, diagonal - left), min(seqlen_k, diagonal + right + 1)


@register_jitable
def visible_queries(key, seqlen_q, seqlen_k, left, right):
    """Key ``key`` is seen by the queries ``lo <= i < hi``: returns (lo, hi); empty when hi <= lo."""
    diagonal = key + seqlen_q - seqlen_k  # the query whose diagonal is this key
    return max(0, diagonal - right), min(seqlen_q, diagonal + left + 1)


@register_jitable
def tile_segments(first_lo, first_hi, last_lo, last_hi, block):
    """(first, first_full, end_full, end) in tiles of ``block``, from the visible ranges of a
    block's first row [first_lo, first_hi) and last row [last_lo, last_hi). Both ends of the
    ranges grow with the row, so the block sees [first_lo, last_hi) and every row of it sees
    [last_lo, first_hi)."""
    if first_lo >= last_hi:
        return 0, 0, 0, 0
    first = first_lo // block
    end = (last_hi + block - 1) // block
    first_full = max(first, (last_lo + block - 1) // block)
    end_full = min(end, first_hi // block)
    if first_full >= end_full:  # no tile is seen whole: all are masked
        first_full = end
        end_full = end
    return first, first_full, end_full, end


@register_jitable
def key_tiles(row_start, row_end, seqlen_q, seqlen_k, left, right, block_n):
    """The key tiles (of ``block_n`` keys) that query rows [row_start, row_end) visit, as
    (first, first_full, end_full, end). ``row_end`` may run past seqlen_q (a tile's padding rows);
    that only widens the range."""
    first_lo, first_hi = visible_keys(row_start, seqlen_q, seqlen_k, left, right)
    last_lo, last_hi = visible_keys(row_end - 1, seqlen_q, seqlen_k, left, right)
    return tile_segments(first_lo, first_hi, last_lo, last_hi, block_n)


@register_jitable
def query_tiles(key_start, key_end, seqlen_q, seqlen_k, left, right, block_m):
    """The query tiles (of ``block_m`` rows) that see any of keys [key_start, key_end), as
    (first, first_full, end_full, end): the backward's dK/dV loop."""
    first_lo, first_hi = visible_queries(key_start, seqlen_q, seqlen_k, left, right)
    last_lo, last_hi = visible_queries(key_end - 1, seqlen_q, seqlen_k, left, right)
    return tile_segments(first_lo, first_hi, last_lo, last_hi, block_m)


@register_jitable
def query_step(step, hk, group, first_tile, tiles_per_head):
    """The (query head, query tile) of a dK/dV block's step ``step`` over the (query head of KV head
    hk's group, visited query tile) pairs, heads in order, each over its tiles in order: query head
    hk group + step // tiles_per_head, tile first_tile + step % tiles_per_head. One division, in
    unsigned 32 bits (``step`` is never negative): Python's signed 64-bit ``//`` and ``%`` are a few
    dozen instructions each on a GPU (the mma backward's loop, which asks for two steps' pairs:
    2022 -> 1868 instructions at hd 64 on sm_80). backward_sm90.py's kernels have their own form
    (``make_step_pair``, with the walk's rotation), whose registers ptxas allocated better with
    the ``%`` than with this one quotient."""
    n = uint32(tiles_per_head)
    head = uint32(step) // n
    return hk * group + int32(head), first_tile + int32(uint32(step) - head * n)


def visible_count(seqlen_q, seqlen_k, left, right):
    """How many (query, key) pairs are visible: the scores a kernel must compute (FLOP counts)."""
    total = 0
    for row in range(seqlen_q):
        lo, hi = visible_keys(row, seqlen_q, seqlen_k, left, right)
        total += max(0, hi - lo)
    return total
