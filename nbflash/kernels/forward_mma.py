"""FlashAttention-2 forward on tensor cores (fp16 / bf16 inputs, float32 accumulation).

The algorithm is the paper's Algorithm 1 (Dao, 2023), with the work split as in flash-attn 2:

    for each block of block_m query rows (one thread block):
        m_i = -inf, l_i = 0, acc = 0                                  (registers)
        for each block of block_n keys K_j, V_j (double-buffered in shared memory, cp.async):
            S    = Q_i K_j^T                                          (mma.sync, registers)
            S    = mask(S)                    only on tiles that cross the window's edges or the tail
            m_new = max(m_i, rowmax(S));  alpha = exp2((m_i - m_new) * scale_log2)
            P    = exp2(S * scale_log2 - m_new * scale_log2)          (registers, then packed to 16 bit)
            l_i  = alpha * l_i + rowsum(P);   acc = alpha * acc + P V_j   (mma.sync)
            m_i  = m_new
        O_i = acc / l_i;   lse_i = (m_i * scale_log2 + log2(l_i)) * ln(2)

Pipeline: one barrier per K/V tile. Tile j + 1 is fetched with cp.async right after the barrier that
makes tile j visible (that barrier also proves every warp has left tile j - 1, whose buffer the
fetch overwrites). A tile is consumed sub_n keys at a time (the S register tile). Tiles that every
row of the block sees whole run a copy of the tile step with no masking code; the others (causal
diagonal, sequence tail) run the masked copy, where each warp also skips the keys its own rows cannot
see. A block mask's empty tile pairs are never fetched nor computed (the prefetch skips to the next
tile it does not call empty), its partial ones run the masked copy. With a window (causal is the
window (-1, 0)), blockIdx.x is reversed so that the query blocks
with the most keys start first; with ``heavy_groups`` G the grid walks groups of G (batch, head)
pairs, query block by query block (nbflash/kernels/geometry.py, ``grouped_block``).

Variants (nbflash/kernels/variants.py): the window's sizes arrive in ``params`` and the visible key
ranges and tile segments come from nbflash/kernels/geometry.py, as in every kernel. Without a score
feature the softmax scale is folded into the exponent (one FFMA per score, on the unscaled max) when
it is positive; otherwise (``fold_scale=False``) the scores are scaled first, since the max of
s * scale is then not the scaled max. With a score feature (softcap, ALiBi) the raw scores go through
the variant's tensor-core score (``Hooks.tensor_core_score``), which leaves them in units whose
positive factor to base 2 is folded into exp2 the same way: softcap's tanh(s * scale / cap) in units
of the cap (less 1 with the exp2 tanh: an offset only the lse sees), ALiBi's s - slope / scale *
|distance| in units of the scale.

Grid and threads: grid = (ceil(seqlen_q / block_m), nheads, batch); block = 32 * num_warps threads.
Warp w owns query rows [w * rows_per_warp, (w + 1) * rows_per_warp) of the block's tile, in m_tiles
slices of 16 rows (one mma.sync row tile each). Within a warp, lane = 4 * g + t holds, for each
16-row slice, rows g and g + 8, and in each 8-column tile of S or O the columns 2t and 2t + 1 (the
mma.sync C-fragment layout; nbflash/primitives.py draws it). So a row's max and sum are reduced over
the 4 lanes of a quad, and the S accumulator turns into the A operand of P V without leaving registers.

Memory: q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim), any
strides with the last dimension contiguous; float16 arrays, or uint16 arrays holding bfloat16 bits.
out like q; lse float32 (batch, nheads, seqlen_q), natural log. Query head h reads key/value head
h // (nheads // nheads_k). Windows (and causal) are bottom-right aligned (geometry.py draws them); a
row that sees no key gets out = 0 and lse = -inf.

Packed sequences (``variant.varlen``): q, out, k, v and lse are stride-0 views over batch of the
packed arrays (total rows in dim 1), and grid.x covers the longest sequence. A block narrows every
array to its sequence's rows (``sequence``, from cu_seqlens in ``params``; the narrowed views keep
the rows' 16-byte alignment) and exits at once if its tile lies past that sequence's end; the rest
is the dense kernel on a batch of one sequence (with a window, the reversed m_block too).

Shared memory (dynamic, 16-bit elements): the Q tile (block_m rows), then two K tiles and two V tiles
(block_n rows each). A row holds headdim zero-padded to a multiple of 16 (the mma k-step), plus 8
elements of padding so that the 8 rows one ldmatrix reads fall in different banks.

Two load paths, chosen by ``MmaForwardConfig.aligned``:
  aligned=True  16-byte cp.async copies, asynchronous and double-buffered. Requires headdim % 8 == 0
                and every row start (q, k, v) 16-byte aligned: data pointers and the strides of
                dimensions 0-2 multiples of 8 elements. The caller checks this.
  aligned=False element-by-element loads into shared memory (synchronous), for any headdim 1..256
                and any strides. Same kernel otherwise.
"""

import math
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda, float32, uint16, uint32
from numba.types import float16

from nbflash.problem import Variant
from nbflash.primitives import (
    cp_async_16_from,
    cp_async_commit,
    cp_async_wait,
    exp2_approx,
    global_address,
    inline_device,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_bf16,
    mma_f16,
    pack_bf16x2,
    pack_f16x2,
    quad_max,
    quad_sum,
    shared_address,
    static_range,
    unroll,
    warp_all,
)

from . import variants
from .geometry import grouped_grid, grouped_query_block
from .tiles import output_store

LN2 = math.log(2.0)


@dataclass(frozen=True)
class MmaForwardConfig:
    """One compiled variant of the tensor-core forward kernel."""

    dtype: str  # 'float16' or 'bfloat16'
    headdim: int  # 1 .. 256
    variant: Variant = Variant()
    block_m: int = 128  # query rows per thread block
    block_n: int = 64  # keys per K/V tile
    num_warps: int = 8  # block_m must be a multiple of 16 * num_warps
    aligned: bool = True  # cp.async path (see the module docstring for its requirements)
    # Q_i's fragments loaded into registers once, or re-read from shared memory for every K tile;
    # None: in registers when a warp owns one 16-row slice and headdim <= 128 (measured best; with
    # two slices per warp the registers are needed for the O accumulator).
    q_in_registers: bool | None = None
    sub_n: int = 0  # keys per S register tile (a divisor of block_n, multiple of 16); 0: block_n
    skip_rescale: bool = False  # branch around acc *= alpha when a row's max did not change
    # Lazy rescaling: a warp keeps the row maxima its P is taken against (m_i) until some row's
    # running max passes its m_i by more than this many powers of 2, so P <= 2**rescale_slack; only
    # then are m_i, l_i and acc rescaled, all rows of the warp at once (one vote a tile, a
    # warp-uniform branch). O = acc / l and lse = m_i + log2(l) are the same in exact arithmetic.
    # 0: rescale at every tile (alpha = 1 when the max held). At most 8: P stays far inside
    # float16's range (65504) when it is packed for P V.
    rescale_slack: float = 0.0
    fold_scale: bool = True  # the scale is positive: fold it into exp2 (a score feature folds its units)
    # Longest-first within groups of this many (batch, head) pairs (0: off; geometry.grouped_block):
    # the grid's last wave holds short blocks (with a window) while the blocks running together
    # read a few heads' K and V
    heavy_groups: int = 0

    def __post_init__(self):
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"{self.dtype=} must be 'float16' or 'bfloat16'")
        if not 1 <= self.headdim <= 256:
            raise ValueError(f"{self.headdim=} must be in 1..256")
        if self.block_m % (16 * self.num_warps):
            raise ValueError(f"{self.block_m=} must be a multiple of 16 * {self.num_warps=}")
        if self.block_n % 16 or self.block_n <= 0:
            raise ValueError(f"{self.block_n=} must be a positive multiple of 16")
        if self.sub_n and (self.block_n % self.sub_n or self.sub_n % 16):
            raise ValueError(f"{self.sub_n=} must be a multiple of 16 dividing {self.block_n=}")
        if self.aligned and self.headdim % 8:
            raise ValueError(f"aligned=True needs headdim % 8 == 0, got {self.headdim=}")
        if self.variant.dropout and (self.sub_n or self.block_n) % 32:
            raise ValueError(f"dropout needs key sub-tiles of a multiple of 32 (one Philox call per 32 keys), got "
                             f"{self.block_n=}, {self.sub_n=}")
        if self.heavy_groups < 0:
            raise ValueError(f"heavy_groups={self.heavy_groups} must be 0 (off) or a group size")
        if not 0 <= self.rescale_slack <= 8:
            raise ValueError(f"rescale_slack={self.rescale_slack} must be in [0, 8] (powers of 2 that P may reach)")
        if self.rescale_slack and self.skip_rescale:
            raise ValueError("rescale_slack and skip_rescale are two ways of skipping the rescale: take one")

    @property
    def headdim_padded(self):
        """headdim rounded up to the mma k-step (16)."""
        return -(-self.headdim // 16) * 16

    @property
    def row_elems(self):
        """Elements per shared-memory row: padded headdim plus 16 bytes against bank conflicts."""
        return self.headdim_padded + 8

    @property
    def m_tiles(self):
        """16-row slices per warp."""
        return self.block_m // (16 * self.num_warps)

    @property
    def use_q_registers(self):
        if self.q_in_registers is not None:
            return self.q_in_registers
        return self.m_tiles == 1 and self.headdim_padded <= 128

    @property
    def threads(self):
        return 32 * self.num_warps

    @property
    def shared_bytes(self):
        """Dynamic shared memory per block: the Q tile and two K and two V tiles, 2 bytes each."""
        return (self.block_m + 4 * self.block_n) * self.row_elems * 2

    @property
    def dynamic_shared_bytes(self):
        """What a launch asks for: all of the kernel's shared memory is dynamic."""
        return self.shared_bytes

    def grid(self, batch, nheads, seqlen_q):
        tiles = -(-seqlen_q // self.block_m)
        if self.heavy_groups:
            return grouped_grid(tiles, batch * nheads, self.heavy_groups)
        return (tiles, nheads, batch)


@lru_cache(maxsize=None)
def build_forward_mma(config: MmaForwardConfig):
    """Compile-time constants of ``config`` captured in a fresh ``@cuda.jit`` kernel."""
    BM, BN, HD = config.block_m, config.block_n, config.headdim
    HDP, ROW = config.headdim_padded, config.row_elems
    WARPS, THREADS = config.num_warps, config.threads
    ROWS_PER_WARP = BM // WARPS
    MT = ROWS_PER_WARP // 16  # 16-row slices per warp
    KT = HDP // 16  # k-steps of S = Q K^T (over headdim)
    SUB_N = config.sub_n or BN  # keys per S register tile
    NT = SUB_N // 8  # 8-key column tiles of S
    PT = SUB_N // 16  # k-steps of O += P V (over keys)
    DT = HDP // 8  # 8-column tiles of O (over headdim)
    ALIGNED, Q_IN_REGISTERS = config.aligned, config.use_q_registers
    hooks = variants.hooks(config.variant)
    WINDOW, key_tiles, row_keys, hidden = hooks.WINDOW, hooks.key_tiles, hooks.row_keys, hooks.hidden
    HEAVY_GROUPS = config.heavy_groups
    ELEMENT_MASK = hooks.ELEMENT_MASK
    SCORE, head_context = hooks.SCORE, hooks.head_context
    score_units, score_row, score_at, _ = hooks.tensor_core_score(config.fold_scale)
    DROPOUT, dropout_words = hooks.DROPOUT, hooks.dropout_words
    keep_or_zero, dropout_scale = hooks.keep_or_zero, hooks.dropout_scale
    BLOCK_MASK, tile_class, next_key_tile = hooks.BLOCK_MASK, hooks.tile_class, hooks.next_key_tile
    VARLEN, sequence = hooks.VARLEN, hooks.sequence  # packed sequences: where this block's rows are
    SKIP_RESCALE, FOLD_SCALE = config.skip_rescale, config.fold_scale and not SCORE
    SLACK = float32(config.rescale_slack)
    ROW_BYTES = ROW * 2
    Q_BYTES, KV_BYTES = BM * ROW_BYTES, BN * ROW_BYTES
    CHUNKS = HDP // 8  # 16-byte chunks per row
    Q_COPIES = -(-BM * CHUNKS // THREADS)  # cp.async rounds to fill a tile
    KV_COPIES = -(-BN * CHUNKS // THREADS)
    Q_ELEMS = -(-BM * HDP // THREADS)  # element rounds (unaligned path)
    KV_ELEMS = -(-BN * HDP // THREADS)
    Q_FRAG = (MT, KT, 4)
    S_ACC = (MT, NT, 4)
    O_ACC = (MT, DT, 4)
    ROW_STAT = (MT, 2)
    P_FRAG = (MT, 4)
    NEG_INF = float32(-math.inf)

    if config.dtype == "float16":
        ELEM, mma, pack = float16, mma_f16, pack_f16x2
    else:
        ELEM, mma, pack = uint16, mma_bf16, pack_bf16x2

    # -----------------------------------------------------------------------------------------------
    # Tile loads: global rows [row0, row0 + rows) of one head into a shared tile, zero-padded
    # (rows past the sequence end, columns past headdim).
    # -----------------------------------------------------------------------------------------------

    @inline_device
    def copy_tile_async(tile, x_row0, row_bytes, row0, valid_rows, rounds, tile_rows):
        """cp.async, 16 bytes per copy; thread `tid` copies chunks tid, tid + THREADS, ... x_row0 is
        the address of the head's row 0 (global_address), so a copy costs one multiply-add."""
        tid = cuda.threadIdx.x
        for i in range(rounds):
            chunk = i * THREADS + tid
            if chunk < tile_rows * CHUNKS:
                r = chunk // CHUNKS
                col = (chunk % CHUNKS) * 8
                inside = r < valid_rows and col < HD
                src = x_row0 + (row0 + r) * row_bytes + col * 2 if inside else x_row0
                cp_async_16_from(tile + uint32(r * ROW_BYTES + col * 2), src, uint32(16 if inside else 0))

    @inline_device
    def copy_tile_elementwise(smem, tile_elem0, x, b, row0, h, valid_rows, rounds, tile_rows):
        """Plain loads and stores, one element each: any strides, any headdim."""
        tid = cuda.threadIdx.x
        for i in range(rounds):
            e = i * THREADS + tid
            if e < tile_rows * HDP:
                r = e // HDP
                col = e % HDP
                value = ELEM(0)
                if r < valid_rows and col < HD:
                    value = x[b, row0 + r, h, col]
                smem[tile_elem0 + r * ROW + col] = value

    @inline_device
    def load_q_tile(smem, base, q, b, m_start, h, seqlen_q):
        if ALIGNED:
            copy_tile_async(base, global_address(q, b, 0, h, 0), q.strides[1], m_start, seqlen_q - m_start,
                            Q_COPIES, BM)
        else:
            copy_tile_elementwise(smem, 0, q, b, m_start, h, seqlen_q - m_start, Q_ELEMS, BM)

    @inline_device
    def load_kv_tiles(smem, base, k, v, b, n_start, hk, seqlen_k, buf):
        k_off = Q_BYTES + buf * KV_BYTES
        v_off = Q_BYTES + (2 + buf) * KV_BYTES
        if ALIGNED:
            copy_tile_async(base + uint32(k_off), global_address(k, b, 0, hk, 0), k.strides[1], n_start,
                            seqlen_k - n_start, KV_COPIES, BN)
            copy_tile_async(base + uint32(v_off), global_address(v, b, 0, hk, 0), v.strides[1], n_start,
                            seqlen_k - n_start, KV_COPIES, BN)
        else:
            copy_tile_elementwise(smem, k_off // 2, k, b, n_start, hk, seqlen_k - n_start, KV_ELEMS, BN)
            copy_tile_elementwise(smem, v_off // 2, v, b, n_start, hk, seqlen_k - n_start, KV_ELEMS, BN)

    # -----------------------------------------------------------------------------------------------
    # Warp tile operations. Shared tiles are addressed by shared-window byte addresses; q_warp is the
    # warp's first row of the Q tile, and *_lane the byte offset of the row this lane hands ldmatrix.
    # -----------------------------------------------------------------------------------------------

    @inline_device
    @unroll
    def load_q_fragments(q_frag, q_warp, q_lane):
        """Q_i's A-operand fragments from the warp's rows of the shared Q tile: ldmatrix matrices
        0-3 are rows 0-7 / 8-15 by columns 0-7 / 8-15 of each 16x16 block."""
        for mt in static_range(MT):
            for kt in static_range(KT):
                a = ldmatrix_x4(q_warp + q_lane + uint32(mt * 16 * ROW_BYTES + kt * 32))
                for i in static_range(4):
                    q_frag[mt, kt, i] = a[i]

    @inline_device
    @unroll
    def mma_q_kt(s, q_frag, q_warp, q_lane, k_tile, k_lane):
        """S = Q_i K_j^T. K's rows (keys) are the B operand's columns, so ldmatrix without transpose
        gives B fragments: matrices 0-3 are keys 0-7 / 8-15 (of a 16-key pair of tiles) by headdim
        columns 0-7 / 8-15 (of the k-step)."""
        for mt in static_range(MT):
            for nt in static_range(NT):
                for i in static_range(4):
                    s[mt, nt, i] = float32(0)
        for kt in static_range(KT):
            if not Q_IN_REGISTERS:  # this k-step's Q_i fragments, re-read for every K tile
                for mt in static_range(MT):
                    a = ldmatrix_x4(q_warp + q_lane + uint32(mt * 16 * ROW_BYTES + kt * 32))
                    for i in static_range(4):
                        q_frag[mt, kt, i] = a[i]
            for np2 in static_range(NT // 2):
                kf = ldmatrix_x4(k_tile + k_lane + uint32(np2 * 16 * ROW_BYTES + kt * 32))
                for half in static_range(2):
                    nt = np2 * 2 + half
                    for mt in static_range(MT):
                        d = mma(q_frag[mt, kt, 0], q_frag[mt, kt, 1], q_frag[mt, kt, 2], q_frag[mt, kt, 3],
                                kf[2 * half], kf[2 * half + 1],
                                s[mt, nt, 0], s[mt, nt, 1], s[mt, nt, 2], s[mt, nt, 3])
                        for i in static_range(4):
                            s[mt, nt, i] = d[i]

    @inline_device
    @unroll
    def scale_scores(s, scale_log2):
        """S *= scale * log2(e): scores in the exponent's units before the max (fold_scale=False)."""
        for mt in static_range(MT):
            for nt in static_range(NT):
                for i in static_range(4):
                    s[mt, nt, i] *= scale_log2

    @inline_device
    @unroll
    def score_scores(s, first_row, n_start, seqlen_q, seqlen_k, params, head_ctx, units, g, t):
        """S = the variant's score features on raw Q K^T, in the units that units[EXP] turns to base 2
        (variants.Hooks.tensor_core_score): what they read of a row is computed once per row."""
        for mt in static_range(MT):
            for r in static_range(2):
                ctx = score_row(first_row + mt * 16 + g + 8 * r, n_start + 2 * t, seqlen_q, seqlen_k, params, head_ctx,
                                units)
                for nt in static_range(NT):
                    for e in static_range(2):
                        s[mt, nt, 2 * r + e] = score_at(s[mt, nt, 2 * r + e], ctx, 0, nt * 8 + e, seqlen_q, seqlen_k,
                                                        params, head_ctx, units)

    @inline_device
    @unroll
    def mask_scores(s, first_row, n_start, seqlen_q, seqlen_k, params, head_ctx, g, t):
        """-inf where the row does not see the key: past the end, outside its window, or masked."""
        for mt in static_range(MT):
            for r in static_range(2):
                row = first_row + mt * 16 + g + 8 * r
                lo, hi = row_keys(row, seqlen_q, seqlen_k, params)
                for nt in static_range(NT):
                    for e in static_range(2):
                        if hidden(n_start + nt * 8 + 2 * t + e, lo, hi, row, seqlen_q, params, head_ctx):
                            s[mt, nt, 2 * r + e] = NEG_INF

    @inline_device
    @unroll
    def row_max(s, m, mt, r):
        """The larger of ``m`` and the largest score of row (mt, r) of the tile, over the quad."""
        for nt in static_range(NT):
            m = max(m, max(s[mt, nt, 2 * r], s[mt, nt, 2 * r + 1]))
        return quad_max(m)

    @inline_device
    @unroll
    def exponentiate_row(s, mt, r, m_scaled, scale_log2):
        """Row (mt, r) of S -> P = exp2(S * scale_log2 - m_scaled) in place; returns the lane's sum of P."""
        row_sum = float32(0)
        for nt in static_range(NT):
            for e in static_range(2):
                p = exp2_approx(s[mt, nt, 2 * r + e] * scale_log2 - m_scaled)
                s[mt, nt, 2 * r + e] = p
                row_sum += p
        return row_sum

    @inline_device
    @unroll
    def online_softmax(s, m_i, l_i, acc, scale_log2, first_row, n_start, params, head_ctx, g, t):
        """S -> P = exp2(S * scale_log2 - m_new * scale_log2) in place; rescale l_i and acc by
        alpha = exp2((m_i - m_new) * scale_log2). l_i stays a per-lane partial sum until the end.
        (Dropout applies in mma_p_v, after l_i has summed the undropped P.)"""
        for mt in static_range(MT):
            for r in static_range(2):
                m_prev = m_i[mt, r]
                m_new = row_max(s, m_prev, mt, r)
                # A row that has seen only masked keys keeps m = -inf; subtract 0 then, not -inf.
                m_scaled = m_new * scale_log2 if m_new != NEG_INF else float32(0)
                alpha = exp2_approx(m_prev * scale_log2 - m_scaled)
                row_sum = exponentiate_row(s, mt, r, m_scaled, scale_log2)
                l_i[mt, r] = l_i[mt, r] * alpha + row_sum
                m_i[mt, r] = m_new
                if not SKIP_RESCALE or m_new != m_prev:  # alpha is exactly 1 when the max held
                    for dt in static_range(DT):
                        acc[mt, dt, 2 * r] *= alpha
                        acc[mt, dt, 2 * r + 1] *= alpha

    @inline_device
    @unroll
    def lazy_online_softmax(s, m_i, l_i, acc, scale_log2, first_row, n_start, params, head_ctx, g, t):
        """online_softmax with lazy rescaling (``rescale_slack``): S -> P = exp2(S * scale_log2 -
        m_i * scale_log2) against the m_i the warp holds, as long as no row's max passes it by more
        than the slack; otherwise m_i moves to the new maxima and l_i and acc are rescaled, for all
        of the warp's rows (the vote keeps the branch warp-uniform)."""
        tile_max = cuda.local.array(ROW_STAT, float32)
        stay = uint32(1)
        for mt in static_range(MT):
            for r in static_range(2):
                m_new = row_max(s, m_i[mt, r], mt, r)
                tile_max[mt, r] = m_new
                # False for a row with no key yet and none here (-inf and -inf), and for NaN
                if m_new * scale_log2 > m_i[mt, r] * scale_log2 + SLACK:
                    stay = uint32(0)
        stay = warp_all(stay)
        if not stay:  # the rare tile: every row of the warp moves to its new max
            for mt in static_range(MT):
                for r in static_range(2):
                    m_new = tile_max[mt, r]
                    # A row that has seen only masked keys keeps m = -inf; alpha is then 0 or 1
                    m_scaled = m_new * scale_log2 if m_new != NEG_INF else float32(0)
                    alpha = exp2_approx(m_i[mt, r] * scale_log2 - m_scaled)
                    l_i[mt, r] *= alpha
                    m_i[mt, r] = m_new
                    for dt in static_range(DT):
                        acc[mt, dt, 2 * r] *= alpha
                        acc[mt, dt, 2 * r + 1] *= alpha
        for mt in static_range(MT):
            for r in static_range(2):
                # A row that has seen only masked keys keeps m = -inf; subtract 0 then, not -inf.
                m_scaled = m_i[mt, r] * scale_log2 if m_i[mt, r] != NEG_INF else float32(0)
                l_i[mt, r] += exponentiate_row(s, mt, r, m_scaled, scale_log2)

    if SLACK > 0:
        online_softmax = lazy_online_softmax  # noqa: F811 (the step below calls whichever is chosen)

    @inline_device
    @unroll
    def mma_p_v(acc, s, v_tile, v_lane, first_row, n_start, params, head_ctx, g, t):
        """acc += P V_j. P's A fragments are S's C fragments packed to 16 bit, two 8-key tiles per
        k-step; V's B fragments come from ldmatrix.trans: matrices 0-3 are keys 0-7 / 8-15 by headdim
        columns 0-7 / 8-15 (of a 16-column pair of tiles). The probability point: with dropout, each
        P is kept or zeroed by its dropout bit as it is packed (each S value's last use, which keeps
        the generator's registers from adding to the whole tile's); the kept scale waits for
        write_output."""
        later = cuda.local.array((MT, 2), uint32)  # the next k-step's dropout words
        for pt in static_range(PT):
            p_frag = cuda.local.array(P_FRAG, uint32)
            if DROPOUT:
                for mt in static_range(MT):
                    if pt % 2 == 0:  # rows g, g + 8 by keys 2 t, 2 t + 1 of this k-step's two 8-key tiles
                        # and the next one's: one call (the kept scale is applied in write_output)
                        w = dropout_words(first_row + mt * 16 + g, n_start + pt * 16 + 2 * t, params, head_ctx)
                        now = (w[0], w[1])
                        later[mt, 0], later[mt, 1] = w[2], w[3]
                    else:
                        now = (later[mt, 0], later[mt, 1])
                    for j in static_range(2):
                        for i in static_range(4):
                            s[mt, 2 * pt + j, i] = keep_or_zero(s[mt, 2 * pt + j, i], now[j], i, params)
            for mt in static_range(MT):
                p_frag[mt, 0] = pack(s[mt, 2 * pt, 0], s[mt, 2 * pt, 1])
                p_frag[mt, 1] = pack(s[mt, 2 * pt, 2], s[mt, 2 * pt, 3])
                p_frag[mt, 2] = pack(s[mt, 2 * pt + 1, 0], s[mt, 2 * pt + 1, 1])
                p_frag[mt, 3] = pack(s[mt, 2 * pt + 1, 2], s[mt, 2 * pt + 1, 3])
            for dp2 in static_range(DT // 2):
                vf = ldmatrix_x4_trans(v_tile + v_lane + uint32(pt * 16 * ROW_BYTES + dp2 * 32))
                for half in static_range(2):
                    dt = dp2 * 2 + half
                    for mt in static_range(MT):
                        d = mma(p_frag[mt, 0], p_frag[mt, 1], p_frag[mt, 2], p_frag[mt, 3],
                                vf[2 * half], vf[2 * half + 1],
                                acc[mt, dt, 0], acc[mt, dt, 1], acc[mt, dt, 2], acc[mt, dt, 3])
                        for i in static_range(4):
                            acc[mt, dt, i] = d[i]

    store_element = output_store(config.dtype)  # out[b, row, h, col] = value, narrowed

    @inline_device
    @unroll
    def write_output(out, lse, acc, m_i, l_i, b, h, first_row, seqlen_q, scale_log2, lse_offset, params, g, t):
        """O_i = acc / l_i and lse_i, for rows inside the sequence; 0 and -inf for rows with no key.
        ``lse_offset``: what a score feature's units leave out of the base-2 scores."""
        for mt in static_range(MT):
            for r in static_range(2):
                l_row = quad_sum(l_i[mt, r])  # every lane of the warp takes part in the shuffle
                row = first_row + mt * 16 + g + 8 * r
                # l = 0: a row without keys (out 0, lse -inf); a NaN l (a NaN in q) stays NaN in both
                inv_l = float32(1) / l_row if l_row != float32(0) else float32(0)
                if DROPOUT:  # the kept probabilities' scale, left out of P V (mma_p_v)
                    inv_l *= dropout_scale(params)
                if row < seqlen_q:
                    for dt in static_range(DT):
                        for e in static_range(2):
                            col = dt * 8 + 2 * t + e
                            if col < HD:
                                store_element(out, b, row, h, col, acc[mt, dt, 2 * r + e] * inv_l)
                    if t == 0:
                        if l_row != float32(0):
                            lse_log2 = m_i[mt, r] * scale_log2 + math.log2(l_row)
                            if SCORE:
                                lse_log2 += lse_offset
                            lse[b, h, row] = lse_log2 * float32(LN2)
                        else:
                            lse[b, h, row] = NEG_INF

    @inline_device
    @unroll
    def attend_tile(s, acc, m_i, l_i, q_frag, q_warp, q_lane, k_tile, k_lane, v_tile, v_lane,
                    scale_log2, softmax_log2, n_start, first_row, seqlen_q, seqlen_k, params, head_ctx, units,
                    g, t, masked):
        """One K/V tile into the warp's running (m_i, l_i, acc), SUB_N keys at a time (S lives in
        registers, SUB_N columns wide). `masked` is a constant at each call site: the unmasked copy
        has no masking code for the compiler to predicate into every tile."""
        # The keys some row of this warp sees [warp_lo, warp_hi), and those all its rows see
        # [full_lo, full_hi) (without a window: 0 and seqlen_k).
        warp_lo, full_hi = row_keys(first_row, seqlen_q, seqlen_k, params)
        full_lo, warp_hi = row_keys(first_row + ROWS_PER_WARP - 1, seqlen_q, seqlen_k, params)
        for sub in static_range(BN // SUB_N):
            sub_start = n_start + sub * SUB_N
            sub_end = sub_start + SUB_N
            # Skip keys none of this warp's rows sees. Warp-uniform, so the warp's collectives
            # stay together.
            visible = True
            if masked:
                visible = sub_start < warp_hi and sub_end > warp_lo
            if visible:
                k_sub = k_tile + uint32(sub * SUB_N * ROW_BYTES)
                v_sub = v_tile + uint32(sub * SUB_N * ROW_BYTES)

                # S = Q_i K_j^T (in the exponent's units, if the scale is not folded into exp2)
                mma_q_kt(s, q_frag, q_warp, q_lane, k_sub, k_lane)
                if SCORE:
                    score_scores(s, first_row, sub_start, seqlen_q, seqlen_k, params, head_ctx, units, g, t)
                elif not FOLD_SCALE:
                    scale_scores(s, scale_log2)

                # Mask where some row of the warp does not see every key of the sub-tile, or
                # always with an element mask (the band cannot vouch for it).
                if masked:
                    if ELEMENT_MASK or sub_end > full_hi or sub_start < full_lo:
                        mask_scores(s, first_row, sub_start, seqlen_q, seqlen_k, params, head_ctx, g, t)

                # m_i, l_i, acc rescaled; S becomes P
                online_softmax(s, m_i, l_i, acc, softmax_log2, first_row, sub_start, params, head_ctx, g, t)

                # acc += P V_j
                mma_p_v(acc, s, v_sub, v_lane, first_row, sub_start, params, head_ctx, g, t)

    # -----------------------------------------------------------------------------------------------
    # The kernel
    # -----------------------------------------------------------------------------------------------

    @cuda.jit
    @unroll
    def forward_mma(q, k, v, out, lse, scale_log2, params):
        m_block, h, b, m_blocks = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z, cuda.gridDim.x
        if HEAVY_GROUPS:  # (batch, head) pairs in groups, query block by query block (geometry.py)
            m_block, h, b, m_blocks = grouped_query_block(cuda.blockIdx.x, cuda.blockIdx.y, cuda.gridDim.x,
                                                          HEAVY_GROUPS, q.shape[2])
            if b >= q.shape[0]:
                return  # a partial last group's missing pairs: the whole block, before any barrier
        if WINDOW:  # the last query blocks see the most keys (causal): start them first
            m_block = m_blocks - 1 - m_block
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane >> 2, lane & 3
        if VARLEN:  # packed sequences: every array narrowed to this block's sequence (module docstring)
            q_off, seqlen_q, k_off, seqlen_k = sequence(params, b, q.shape[1], k.shape[1])
            if m_block * BM >= seqlen_q:
                return  # the whole block: its tile lies past the sequence's end (no barrier is left waiting)
            q_end, k_end = q_off + seqlen_q, k_off + seqlen_k
            q, out, lse = q[:, q_off:q_end], out[:, q_off:q_end], lse[:, :, q_off:q_end]
            k, v = k[:, k_off:k_end], v[:, k_off:k_end]
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        hk = h // (q.shape[2] // k.shape[2])  # GQA: the key/value head this query head reads
        m_start = m_block * BM
        warp_row0 = warp * ROWS_PER_WARP  # the warp's first row within the Q tile
        first_row = m_start + warp_row0  # ... and within the sequence

        smem = cuda.shared.array(0, ELEM)
        base = shared_address(smem)

        # ---- Which key tiles this block visits (geometry.py): tiles [first_tile, end_tile), of
        # which [first_full, end_full) every row sees whole and the others are masked ----
        first_tile, first_full, end_full, end_tile = key_tiles(
            m_start, min(m_start + BM, seqlen_q), seqlen_q, seqlen_k, params, BN)
        scale = scale_log2 * float32(LN2)  # the softmax scale itself, for the score features
        head_ctx = head_context(params, b, h)  # (b, h, ALiBi slope): what the variant reads per head
        units = score_units(params, scale, head_ctx)  # the score features' constants for this head
        # What multiplies S in exp2: a score feature leaves S in units of units[EXP] > 0, folded like a
        # positive scale (and an offset in base 2 that only the lse sees)
        softmax_log2 = units[variants.EXP] if SCORE else (scale_log2 if FOLD_SCALE else float32(1))

        # ---- Prologue: Q_i and the first K/V tile in flight; Q_i into registers ----
        load_q_tile(smem, base, q, b, m_start, h, seqlen_q)
        cp_async_commit()
        first_visited = next_key_tile(params, b, h, m_block, first_tile, end_tile)  # first_tile without a block mask
        if end_tile > first_visited:
            load_kv_tiles(smem, base, k, v, b, first_visited * BN, hk, seqlen_k, 0)
        cp_async_commit()
        cp_async_wait(1)  # this thread's Q copies have landed (the K/V group may be in flight)
        cuda.syncthreads()  # ... and every other thread's, before ldmatrix reads the Q tile

        # Per-lane byte offsets of the rows each lane addresses in ldmatrix (see the helpers).
        q_lane = uint32(((lane & 7) + ((lane >> 3) & 1) * 8) * ROW_BYTES + (lane >> 4) * 16)
        k_lane = uint32(((lane & 7) + (lane >> 4) * 8) * ROW_BYTES + ((lane >> 3) & 1) * 16)
        v_lane = q_lane
        q_warp = base + uint32(warp_row0 * ROW_BYTES)

        q_frag = cuda.local.array(Q_FRAG, uint32)
        if Q_IN_REGISTERS:
            load_q_fragments(q_frag, q_warp, q_lane)

        s = cuda.local.array(S_ACC, float32)
        acc = cuda.local.array(O_ACC, float32)
        m_i = cuda.local.array(ROW_STAT, float32)
        l_i = cuda.local.array(ROW_STAT, float32)
        for mt in static_range(MT):
            for r in static_range(2):
                m_i[mt, r] = NEG_INF
                l_i[mt, r] = float32(0)
            for dt in static_range(DT):
                for i in static_range(4):
                    acc[mt, dt, i] = float32(0)

        # ---- Main loop over key tiles K_j, V_j ----
        # With a block mask, the tiles it calls empty are passed over (block-uniform, so the barriers
        # stay uniform): nothing was fetched for them, and the buffers alternate over the tiles
        # visited, counted by `visited`.
        visited = 0
        for j in range(first_tile, end_tile):
            tile = tile_class(params, b, h, m_block, j)  # FULL without a block mask
            if tile == variants.EMPTY:
                continue
            buf = (visited if BLOCK_MASK else j - first_tile) & 1
            visited += 1
            n_start = j * BN
            cp_async_wait(0)  # this thread's copies of tile j (the only group in flight) have landed
            cuda.syncthreads()  # every thread's have: tile j is complete in shared memory; and every
            #                     warp is done with iteration j - 1, so the other buffer is free
            j_next = next_key_tile(params, b, h, m_block, j + 1, end_tile)  # the next tile visited: j + 1 without
            if j_next < end_tile:  # prefetch it while this one is computed on
                load_kv_tiles(smem, base, k, v, b, n_start + (j_next - j) * BN, hk, seqlen_k, 1 - buf)
            cp_async_commit()

            k_tile = base + uint32(Q_BYTES + buf * KV_BYTES)
            v_tile = base + uint32(Q_BYTES + (2 + buf) * KV_BYTES)
            # Tiles every row of the block sees whole cost no masking code at all; the others
            # (the window's edges, the sequence tail) go through the masked copy of the same step.
            if first_full <= j and j < end_full and tile == variants.FULL:
                attend_tile(s, acc, m_i, l_i, q_frag, q_warp, q_lane, k_tile, k_lane, v_tile, v_lane,
                            scale_log2, softmax_log2, n_start, first_row, seqlen_q, seqlen_k, params, head_ctx,
                            units, g, t, False)
            else:
                attend_tile(s, acc, m_i, l_i, q_frag, q_warp, q_lane, k_tile, k_lane, v_tile, v_lane,
                            scale_log2, softmax_log2, n_start, first_row, seqlen_q, seqlen_k, params, head_ctx,
                            units, g, t, True)

        # ---- Epilogue: normalise and write O_i and lse_i ----
        write_output(out, lse, acc, m_i, l_i, b, h, first_row, seqlen_q, softmax_log2, units[variants.OFFSET], params,
                     g, t)

    return forward_mma
