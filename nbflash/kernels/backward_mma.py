"""FlashAttention-2 backward on tensor cores (fp16 / bf16 inputs, float32 accumulation).

The companion of ``forward_mma`` (read that first: this file keeps its fragment layouts, names and
unrolling) and of ``backward_portable`` (whose preprocess and dq-conversion kernels it reuses). The
algorithm is the paper's Algorithm 2 (Dao, 2023): P is recomputed from the forward's log-sum-exp, so
no N x N matrix is ever stored. Per (batch, head), with D = rowsum(dO * O) from the preprocess::

    P   = exp2(Q K^T * scale_log2 - lse * log2(e))
    dV  = P^T dO                dP = dO V^T
    dS  = P * (dP - D)
    dQ  = dS K * scale          dK = dS^T Q * scale

Two kernels, picked by ``MmaBackwardConfig.kernel``:

``dkdv``  grid (cdiv(seqlen_k, block_n), nheads_k, batch); block = 32 * num_warps threads, and
          block_n = 16 * num_warps: warp w owns keys [16 w, 16 w + 16) of the block's tile K_j, V_j.
          The block loops over the query heads of its GQA group and, for each, over the query tiles
          Q_i (block_m rows) that see K_j (geometry.py: tiles that see none of its keys are skipped,
          and only tiles crossing the window's edges, or the key tail, run the masked copy; a block
          mask's empty pairs are skipped, its partial ones masked)::

              S^T  = K_j Q_i^T,  dP^T = V_j dO_i^T             (mma.sync; C fragments, keys x queries)
              P^T  = exp2(S^T * scale_log2 - lse_log2[query]) (0 where masked or the row sees no key)
              dS^T = P^T * (dP^T - D[query])
              dV_j += P^T dO_i,  dK_j += dS^T Q_i             (C fragments packed into A fragments)

          Working on the transposed scores keeps a warp's rows on its own keys, so P^T and dS^T are
          A operands straight from registers, and dK_j, dV_j stay in registers for the whole loop:
          their sum over the query heads of the group has a fixed order (no atomics). With
          ``atomic_dq``, dS^T also goes to shared memory and the block adds dQ_i += dS K_j into the
          float32 dq accumulator with atomics (each warp a quarter of the columns for all the
          tile's rows, or, where headdim does not split so, 16 rows for all columns; ldmatrix.trans
          turns the stored dS^T back into A fragments of dS).

``dq``    grid (cdiv(seqlen_q, block_m), nheads, batch), blockIdx.x reversed with a window (the
          query blocks with the most keys first, as in the forward); block_m = 16 * num_warps:
          warp w owns query rows [16 w, 16 w + 16) of Q_i. The deterministic dQ: the forward's loop order, over the key
          tiles K_j, V_j that Q_i sees, with dQ_i in registers::

              S = Q_i K_j^T,  dP = dO_i V_j^T,  dS = P * (dP - D),  dQ_i += dS K_j

Fragments (nbflash/primitives.py draws them). A lane = 4 g + t holds, of each 16 x 8 C tile, rows g
and g + 8 and columns 2t, 2t + 1. A tile ``c[nt, i]`` of a 16 x (8 * NT) product is NT such C
tiles; its columns 16 p .. 16 p + 15, packed to 16 bit, are the A fragment of k-step p of the next
product (as P is in the forward's P V). B operands come from shared tiles by ldmatrix: without
transpose from a tile stored [n][k] (K_j for S = Q K^T), with ``.trans`` from a tile stored [k][n]
(dO_i for dV = P^T dO).

Memory: q, dout (batch, seqlen_q, nheads, headdim), k, v (batch, seqlen_k, nheads_k, headdim), any
strides with the last dimension contiguous; float16 arrays, or uint16 arrays holding bfloat16 bits.
lse, delta float32 (batch, nheads, seqlen_q); dq, dk, dv like q, k, v; dq_accum float32 like q. Query
head h reads key/value head h // (nheads // nheads_k). Windows (causal is the window (-1, 0)) are
bottom-right aligned, and the variant's runtime values arrive in ``params``
(nbflash/kernels/variants.py). A row with lse = -inf (it sees no key) is given lse = +inf,
so its P row is exp2(-inf) = 0 and its gradients are exactly 0, never NaN; rows past seqlen_q too.
With a score feature (softcap, ALiBi), P comes from the variant's tensor-core score of the raw S
(``Hooks.tensor_core_score``, as in the forward), and dS carries its derivative.

Packed sequences (``variant.varlen``): the arrays are stride-0 views over batch of the packed ones
(total rows in dim 1; lse and delta (batch, nheads, total_q)), grid.x covering the longest
sequence; a block narrows every array to its sequence's rows (``sequence``, from cu_seqlens in
``params``), exits at once if its tile lies past that sequence's end, and is otherwise the dense
kernel on one sequence.

Shared memory (dynamic, 16-bit elements; rows of headdim zero-padded to a multiple of 16, plus 8
elements so that the 8 rows one ldmatrix reads fall in different banks)::

    dkdv   K_j, V_j (block_n rows), Q_i, dO_i (block_m rows), and with atomic_dq dS^T
           (block_n rows of block_m + 8); static float32 lse_log2 and D of the block_m query rows
    dq     Q_i, dO_i (block_m rows), K_j, V_j (block_n rows)

Tiles whose rows start on 16-byte boundaries (headdim % 8 == 0, the usual layouts) are copied with
16-byte cp.async, every copy of a tile pair issued before the first wait; other layouts load element
by element (plain loads, any headdim 1..256, any strides). The dK/dV kernel requests the next query
tile as soon as the current one's dK/dV products are done, so the copy overlaps the dQ step.
"""

import math
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda, float32, int32, uint16, uint32
from numba.types import float16

from nbflash.problem import Variant
from nbflash.primitives import (
    cp_async_16_from,
    cp_async_commit,
    cp_async_wait,
    exp2_approx,
    f32_to_bf16_bits,
    global_address,
    inline_device,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_bf16,
    mma_f16,
    pack_bf16x2,
    pack_f16x2,
    red_add_f32,
    red_add_f32x2,
    shared_address,
    static_range,
    unroll,
)

from . import variants
from .geometry import query_step

LOG2E = math.log2(math.e)
NEG_INF = float32(-math.inf)
POS_INF = float32(math.inf)

KERNELS = ("dkdv", "dq")


@dataclass(frozen=True)
class MmaBackwardConfig:
    """One compiled variant of one of the tensor-core backward kernels."""

    kernel: str  # 'dkdv' or 'dq'
    dtype: str  # 'float16' or 'bfloat16'
    headdim: int  # 1 .. 256
    variant: Variant = Variant()
    block_m: int = 64  # query rows per tile (dq: 16 * num_warps)
    block_n: int = 64  # keys per tile (dkdv: 16 * num_warps)
    num_warps: int = 4
    atomic_dq: bool = True  # dkdv: add dQ into the float32 accumulator with atomics
    aligned: bool = False  # every row of q, k, v, dout starts on a 16-byte boundary: cp.async loads
    vector_dq: bool = False  # dkdv, atomic_dq, headdim % 8 == 0: two columns per reduction (sm_90)

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"{self.kernel=} must be one of {KERNELS}")
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"{self.dtype=} must be 'float16' or 'bfloat16'")
        if not 1 <= self.headdim <= 256:
            raise ValueError(f"{self.headdim=} must be in 1..256")
        if self.block_m % 16 or self.block_n % 16 or self.block_m <= 0 or self.block_n <= 0:
            raise ValueError(f"{self.block_m=} and {self.block_n=} must be positive multiples of 16")
        if self.aligned and self.headdim % 8:
            raise ValueError(f"aligned=True needs headdim % 8 == 0, got {self.headdim=}")
        if self.kernel == "dq" and self.variant.dropout and self.block_n % 32:
            raise ValueError(f"the dq kernel's dropout needs {self.block_n=} a multiple of 32 (one Philox call per "
                             "32 keys)")
        if self.vector_dq and (self.kernel != "dkdv" or not self.atomic_dq or self.headdim % 8):
            raise ValueError("vector_dq=True needs the dkdv kernel with atomic_dq and headdim % 8 == 0")
        if self.kernel == "dkdv" and self.block_m > self.threads:
            raise ValueError(f"the dkdv kernel stages one query row's lse and D per thread: "
                             f"{self.block_m=} must be at most {self.threads=}")
        warp_rows = self.block_n if self.kernel == "dkdv" else self.block_m
        if warp_rows != 16 * self.num_warps:
            raise ValueError(f"the {self.kernel} kernel gives each warp 16 rows: "
                             f"{warp_rows=} must be 16 * {self.num_warps=}")

    @property
    def headdim_padded(self):
        """headdim rounded up to the mma k-step (16)."""
        return -(-self.headdim // 16) * 16

    @property
    def row_elems(self):
        """Elements per shared-memory row of Q, dO, K, V: padded headdim plus 16 bytes."""
        return self.headdim_padded + 8

    @property
    def ds_row_elems(self):
        """Elements per shared-memory row of dS^T (dkdv with atomic_dq): block_m plus 16 bytes."""
        return self.block_m + 8

    @property
    def threads(self):
        return 32 * self.num_warps

    @property
    def dynamic_shared_bytes(self):
        """The Q/dO and K/V tiles (and dS^T), 2 bytes an element; all of it dynamic."""
        tiles = 2 * (self.block_m + self.block_n) * self.row_elems
        if self.kernel == "dkdv" and self.atomic_dq:
            tiles += self.block_n * self.ds_row_elems
        return 2 * tiles

    @property
    def static_shared_bytes(self):
        """dkdv: lse_log2 and D of the query tile, float32."""
        return 8 * self.block_m if self.kernel == "dkdv" else 0

    def grid(self, batch, nheads, nheads_k, seqlen_q, seqlen_k):
        if self.kernel == "dkdv":
            return (-(-seqlen_k // self.block_n), nheads_k, batch)
        return (-(-seqlen_q // self.block_m), nheads, batch)


# ---------------------------------------------------------------------------------------------------
# Warp tile products, built for constant tile counts (``static_range`` bounds come from the factory)
# ---------------------------------------------------------------------------------------------------


def make_mma_abt(N_TILES, K_STEPS, B_ROW_BYTES, mma):
    """``mma_abt(c, a_rows, a_lane, b_rows, b_lane)``: c = A B^T, a 16 x (8 * N_TILES) C tile.

    A is 16 rows of a shared tile stored row-major (the warp's rows: K_j for S^T, Q_i for S), B is
    8 * N_TILES rows of a shared tile stored the same way (Q_i for S^T, K_j for S); the product runs
    over K_STEPS 16-column steps of their rows. ldmatrix without transpose gives both operands:
    matrices 0-3 are rows 0-7 / 8-15 by columns 0-7 / 8-15 for A, and rows (B's columns) 0-7 / 8-15
    of a 16-row pair of n tiles by columns 0-7 / 8-15 for B.
    """

    @inline_device
    @unroll
    def mma_abt(c, a_rows, a_lane, b_rows, b_lane):
        for nt in static_range(N_TILES):
            for i in static_range(4):
                c[nt, i] = float32(0)
        for kt in static_range(K_STEPS):
            a = ldmatrix_x4(a_rows + a_lane + uint32(kt * 32))
            for np2 in static_range(N_TILES // 2):
                bf = ldmatrix_x4(b_rows + b_lane + uint32(np2 * 16 * B_ROW_BYTES + kt * 32))
                for half in static_range(2):
                    nt = np2 * 2 + half
                    d = mma(a[0], a[1], a[2], a[3], bf[2 * half], bf[2 * half + 1],
                            c[nt, 0], c[nt, 1], c[nt, 2], c[nt, 3])
                    for i in static_range(4):
                        c[nt, i] = d[i]

    return mma_abt


def make_mma_ab(N_TILES, K_STEPS, B_ROW_BYTES, mma, pack):
    """``mma_ab(acc, c, b_rows, b_lane)``: acc += C B, acc a 16 x (8 * N_TILES) C tile.

    C (16 x 16 * K_STEPS, float32 C fragments: P^T, dS^T or dS) is packed to 16 bit, two 8-column
    tiles per k-step, into A fragments; B is 16 * K_STEPS rows of a shared tile stored [k][n] (dO_i,
    Q_i or K_j), read with ldmatrix.trans: matrices 0-3 are rows 0-7 / 8-15 by columns 0-7 / 8-15 of
    a 16-column pair of n tiles.
    """

    @inline_device
    @unroll
    def mma_ab(acc, c, b_rows, b_lane):
        for pt in static_range(K_STEPS):
            a0 = pack(c[2 * pt, 0], c[2 * pt, 1])
            a1 = pack(c[2 * pt, 2], c[2 * pt, 3])
            a2 = pack(c[2 * pt + 1, 0], c[2 * pt + 1, 1])
            a3 = pack(c[2 * pt + 1, 2], c[2 * pt + 1, 3])
            for dp2 in static_range(N_TILES // 2):
                bf = ldmatrix_x4_trans(b_rows + b_lane + uint32(pt * 16 * B_ROW_BYTES + dp2 * 32))
                for half in static_range(2):
                    dt = dp2 * 2 + half
                    d = mma(a0, a1, a2, a3, bf[2 * half], bf[2 * half + 1],
                            acc[dt, 0], acc[dt, 1], acc[dt, 2], acc[dt, 3])
                    for i in static_range(4):
                        acc[dt, i] = d[i]

    return mma_ab


def make_score_gradient(hooks):
    """``score_gradient(s, dp, ctx, key_off, lse_log2, d, key, lo, hi, row, seqlen_q, seqlen_k, params,
    head_ctx, scale_log2, units, word, byte, masked) -> dS``: one element of the dq kernels' dS = P (dP
    * factor - D) * d score / d S, with P = exp2(score(S) - lse_log2) from the raw S (the score point
    ``hooks.tensor_core_score(False)``, ``ctx`` its row base and ``key_off`` the element's key offset
    from it; S * scale_log2 without score features), 0 where ``masked`` (a constant at each call site)
    and the key is hidden from the row (which sees keys lo <= key < hi), and factor dropout's (byte
    ``byte`` of ``word``, of ``hooks.dropout_words``). Shared by this file's dq kernel and
    backward_dq_sm90.py's: a lane holds the same elements in mma.sync's and wgmma's layouts."""
    SCORE, DROPOUT, hidden, byte_factor = hooks.SCORE, hooks.DROPOUT, hooks.hidden, hooks.byte_factor
    score_at_grad = hooks.tensor_core_score(False)[3]

    @inline_device
    def score_gradient(s, dp, ctx, key_off, lse_log2, d, key, lo, hi, row, seqlen_q, seqlen_k, params, head_ctx,
                       scale_log2, units, word, byte, masked):
        grad = float32(1)
        if SCORE:
            y, grad = score_at_grad(s, ctx, 0, key_off, seqlen_q, seqlen_k, params, head_ctx, units)
            p = exp2_approx(y * units[variants.EXP] - lse_log2)
        else:
            p = exp2_approx(s * scale_log2 - lse_log2)
        if masked:
            if hidden(key, lo, hi, row, seqlen_q, params, head_ctx):
                p = float32(0)
        factor = float32(1)
        if DROPOUT:
            factor = byte_factor(word, byte, params)
        return p * (dp * factor - d) * grad

    return score_gradient


@lru_cache(maxsize=None)
def build_backward_mma(config: MmaBackwardConfig):
    """Compile-time constants of ``config`` captured in a fresh ``@cuda.jit`` kernel."""
    BM, BN, HD = config.block_m, config.block_n, config.headdim
    HDP, ROW, DS_ROW = config.headdim_padded, config.row_elems, config.ds_row_elems
    WARPS, THREADS = config.num_warps, config.threads
    ATOMIC_DQ, ALIGNED, VECTOR_DQ = config.atomic_dq, config.aligned, config.vector_dq
    hooks = variants.hooks(config.variant)
    BLOCK_MASK = hooks.BLOCK_MASK
    key_tiles, query_tiles, row_keys, hidden = hooks.key_tiles, hooks.query_tiles, hooks.row_keys, hooks.hidden
    SCORE, head_context = hooks.SCORE, hooks.head_context
    # No max here: any scale works, but ALiBi's slope per unit of a zero scale would not.
    score_units, score_row, _, score_at_grad = hooks.tensor_core_score(False)
    DROPOUT, dropout_words = hooks.DROPOUT, hooks.dropout_words
    dropout_bits_t, dropout_bit = hooks.dropout_bits_t, hooks.dropout_bit
    tile_class = hooks.tile_class  # the block mask's class of a tile pair (FULL without one)
    VARLEN, sequence = hooks.VARLEN, hooks.sequence  # packed sequences: where this block's rows are
    WINDOW = hooks.WINDOW
    CHUNKS = HDP // 8  # 16-byte chunks of a padded tile row (the aligned path's cp.async copies)
    ROW_BYTES, DS_ROW_BYTES = ROW * 2, DS_ROW * 2
    KT = HDP // 16  # k-steps over headdim (S, dP)
    DT = HDP // 8  # 8-column tiles over headdim (dK, dV, dQ)
    QNT, KNT = BM // 8, BN // 8  # 8-column tiles over queries (S^T) or keys (S)
    Q_SLICES = BM // 16  # 16-row slices of a query tile (the atomic dQ step)
    Q_SLICE_ROUNDS = -(-Q_SLICES // WARPS)
    Q_ELEMS, KV_ELEMS = BM * ROW, BN * ROW  # tile sizes in elements

    if config.dtype == "float16":
        ELEM, mma, pack = float16, mma_f16, pack_f16x2
    else:
        ELEM, mma, pack = uint16, mma_bf16, pack_bf16x2
    IS_F16 = config.dtype == "float16"

    # -----------------------------------------------------------------------------------------------
    # Tile loads and element stores
    # -----------------------------------------------------------------------------------------------

    @inline_device
    def load_tile(smem, tile_elem0, x, b, row0, h, valid_rows, tile_rows):
        """Start copying global rows [row0, row0 + tile_rows) of head h into a shared tile; zero
        past valid_rows and past headdim (the mma steps read the padding). ``tiles_landed`` waits.

        Aligned rows: 16-byte cp.async copies, all issued before any is waited for. Otherwise one
        element per thread and round, with plain loads (any headdim, any strides).
        """
        if ALIGNED:
            # The forward's copy_tile_async does the same with a constant round count, which
            # unrolls: tried here, it raised this kernel's spill stack from 208 to 472 bytes (ptxas,
            # headdim 128), so the copies stay in a strided loop.
            x_row0 = global_address(x, b, 0, h, 0)
            row_bytes = x.strides[1]
            tile = shared_address(smem) + uint32(tile_elem0 * 2)
            for chunk in range(cuda.threadIdx.x, tile_rows * CHUNKS, THREADS):
                r = chunk // CHUNKS
                col = (chunk % CHUNKS) * 8
                inside = r < valid_rows and col < HD
                src = x_row0 + (row0 + r) * row_bytes + col * 2 if inside else x_row0
                cp_async_16_from(tile + uint32(r * ROW_BYTES + col * 2), src, uint32(16 if inside else 0))
        else:
            for e in range(cuda.threadIdx.x, tile_rows * HDP, THREADS):
                r = e // HDP
                col = e % HDP
                value = ELEM(0)
                if r < valid_rows and col < HD:
                    value = x[b, row0 + r, h, col]
                smem[tile_elem0 + r * ROW + col] = value

    @inline_device
    def tiles_landed():
        """This thread's tile copies have landed (a barrier must follow before others read them)."""
        if ALIGNED:
            cp_async_commit()
            cp_async_wait(0)

    @inline_device
    def to_elem(value):
        """A float32 rounded to the kernel's 16-bit element (nearest even)."""
        if IS_F16:
            return float16(value)
        return f32_to_bf16_bits(value)

    @inline_device
    def lse_log2(lse, b, h, row, seqlen_q):
        """lse of a query row in base 2, P's subtrahend; +inf (P = 0) for a row that sees no key
        (lse = -inf) and for rows past seqlen_q."""
        if row >= seqlen_q:
            return POS_INF
        x = lse[b, h, row]
        return x * float32(LOG2E) if x != NEG_INF else POS_INF

    @inline_device
    @unroll
    def store_rows(dst, acc, b, row0, h, seqlen, scale, g, t):
        """dst[b, row0 + (g, g + 8), h, :] = acc * scale, a 16-row C tile, inside the sequence."""
        for r in static_range(2):
            row = row0 + g + 8 * r
            if row < seqlen:
                for dt in static_range(DT):
                    for e in static_range(2):
                        col = dt * 8 + 2 * t + e
                        if col < HD:
                            dst[b, row, h, col] = to_elem(acc[dt, 2 * r + e] * scale)

    @inline_device
    @unroll
    def zero_tile(acc):
        for dt in static_range(DT):
            for i in static_range(4):
                acc[dt, i] = float32(0)

    # -----------------------------------------------------------------------------------------------
    # The dK/dV kernel: one block per key tile K_j, V_j
    # -----------------------------------------------------------------------------------------------

    K_TILE, V_TILE = 0, KV_ELEMS  # element offsets in dynamic shared memory
    Q_TILE, DO_TILE = 2 * KV_ELEMS, 2 * KV_ELEMS + Q_ELEMS
    DS_TILE = 2 * KV_ELEMS + 2 * Q_ELEMS

    mma_keys_by_queries = make_mma_abt(QNT, KT, ROW_BYTES, mma)  # S^T = K Q^T, dP^T = V dO^T
    mma_keys_acc = make_mma_ab(DT, QNT // 2, ROW_BYTES, mma, pack)  # dV += P^T dO, dK += dS^T Q

    @inline_device
    @unroll
    def softmax_grad_t(s, dp, lse_s, d_s, key0, q_start, seqlen_q, seqlen_k, params, head_ctx, scale_log2, units,
                       g, t, masked):
        """S^T -> P^T and dP^T -> dS^T = P^T * (dP^T - D), in place (times the score features'
        derivative). ``key0`` is the warp's first key; masked entries (keys past seqlen_k, or
        outside a query's window) get P = dS = 0. `masked` is a constant at each call site."""
        # The score features' (row, key) bases: queries q_start + 2t + column offset, keys g and g + 8
        ctx = (score_row(q_start + 2 * t, key0 + g, seqlen_q, seqlen_k, params, head_ctx, units),
               score_row(q_start + 2 * t, key0 + g + 8, seqlen_q, seqlen_k, params, head_ctx, units))
        for pair in static_range(QNT // 2):
            # Dropout's factors of queries 16 pair + 2t (+1, +8, +9), keys g and g + 8: one Philox
            # call per eight scores, shared with lane ^ 4 (Hooks.dropout_bits_t); a constant without dropout
            drop = dropout_bits_t(q_start + 16 * pair + 2 * t, key0 + g, params, head_ctx)
            for half in static_range(2):
                nt = 2 * pair + half
                for e in static_range(2):
                    c = nt * 8 + 2 * t + e  # the query column, within the tile
                    lse_c = lse_s[c]
                    d_c = d_s[c]
                    lo, hi = row_keys(q_start + c, seqlen_q, seqlen_k, params)  # used by the masked copy
                    for r in static_range(2):
                        grad = float32(1)
                        if SCORE:
                            y, grad = score_at_grad(s[nt, 2 * r + e], ctx[r], nt * 8 + e, 0, seqlen_q, seqlen_k,
                                                    params, head_ctx, units)
                            p = exp2_approx(y * units[variants.EXP] - lse_c)
                        else:
                            p = exp2_approx(s[nt, 2 * r + e] * scale_log2 - lse_c)
                        if masked:
                            if hidden(key0 + g + 8 * r, lo, hi, q_start + c, seqlen_q, params, head_ctx):
                                p = float32(0)
                        factor = float32(1)
                        if DROPOUT:  # dV takes the dropped P; dP reaches P through the same factor
                            factor = dropout_bit(drop, 4 * r + 2 * half + e, params)
                        s[nt, 2 * r + e] = p * factor
                        dp[nt, 2 * r + e] = p * (dp[nt, 2 * r + e] * factor - d_c) * grad

    @inline_device
    @unroll
    def store_ds_t(smem, ds, warp, g, t):
        """The warp's 16 rows of dS^T, rounded to 16 bit, into the shared dS^T tile."""
        for nt in static_range(QNT):
            for r in static_range(2):
                row = warp * 16 + g + 8 * r
                for e in static_range(2):
                    smem[DS_TILE + row * DS_ROW + nt * 8 + 2 * t + e] = to_elem(ds[nt, 2 * r + e])

    @inline_device
    @unroll
    def mma_ds_k(acc, ds_t, ds_lane, k_tile, kt_lane, slice_):
        """acc = dS K_j for 16 query rows (slice ``slice_`` of Q_i). dS's A fragments come from the
        stored dS^T by ldmatrix.trans (matrices 0-3: keys 0-7 / 8-15 of a k-step by queries 0-7 /
        8-15 of the slice, each transposed); K_j's B fragments by ldmatrix.trans, as in mma_ab."""
        zero_tile(acc)
        for kt in static_range(BN // 16):
            a = ldmatrix_x4_trans(ds_t + ds_lane + uint32(kt * 16 * DS_ROW_BYTES) + uint32(slice_ * 32))
            for dp2 in static_range(DT // 2):
                bf = ldmatrix_x4_trans(k_tile + kt_lane + uint32(kt * 16 * ROW_BYTES + dp2 * 32))
                for half in static_range(2):
                    dt = dp2 * 2 + half
                    d = mma(a[0], a[1], a[2], a[3], bf[2 * half], bf[2 * half + 1],
                            acc[dt, 0], acc[dt, 1], acc[dt, 2], acc[dt, 3])
                    for i in static_range(4):
                        acc[dt, i] = d[i]

    @inline_device
    @unroll
    def add_dq_atomic(dq_accum, acc, b, row0, h, seqlen_q, g, t):
        """dq_accum[b, row0 + (g, g + 8), h, :] += acc (unscaled): a lane's two adjacent columns in
        one vector reduction (VECTOR_DQ), else one float32 atomic per element."""
        for r in static_range(2):
            row = row0 + g + 8 * r
            if row < seqlen_q:
                row_address = global_address(dq_accum, b, row, h, 0)
                if VECTOR_DQ:
                    for dt in static_range(DT):
                        if dt * 8 < HD:  # headdim % 8 == 0: the whole 8-column tile is inside
                            red_add_f32x2(row_address + (dt * 8 + 2 * t) * 4, acc[dt, 2 * r], acc[dt, 2 * r + 1])
                else:  # by address: atomic.add's signed indices cost a wrap apiece (perf-notes step 59)
                    for dt in static_range(DT):
                        for e in static_range(2):
                            col = dt * 8 + 2 * t + e
                            if col < HD:
                                red_add_f32(row_address + col * 4, acc[dt, 2 * r + e])

    # The dQ step split by columns: warp w adds dQ_i[:, DT_WARP 8-column tiles of its own] for all
    # BM query rows, so each warp reads only its quarter of K_j's fragments (and keeps a k-step's in
    # registers across the row slices) instead of all of K_j for 16 rows: a third fewer ldmatrix
    # (hd 128: 24 instead of 36 a warp a step). Needs each warp's tiles to pair up (DT % (2 WARPS)
    # == 0); other headdims split by rows (mma_ds_k above).
    DQ_BY_COLUMNS = DT % (2 * WARPS) == 0
    DT_WARP = DT // WARPS if DQ_BY_COLUMNS else 2
    K_PAIRS = DT_WARP // 2  # ldmatrix.x4 loads of K_j's fragments a warp needs per k-step

    @inline_device
    @unroll
    def mma_ds_k_columns(acc, bk, ds_t, ds_lane, k_tile, kt_lane, warp):
        """acc[m] = dS K_j[:, the warp's columns] for each 16-row slice m of Q_i: A fragments of dS
        from the stored dS^T (as in mma_ds_k), B fragments of K_j's columns, loaded once a k-step
        into ``bk``."""
        for m in static_range(Q_SLICES):
            for dt in static_range(DT_WARP):
                for i in static_range(4):
                    acc[m, dt, i] = float32(0)
        for kt in static_range(BN // 16):
            for dp2 in static_range(DT_WARP // 2):
                column_pair = warp * (DT_WARP // 2) + dp2
                bf = ldmatrix_x4_trans(k_tile + kt_lane + uint32(kt * 16 * ROW_BYTES) + uint32(column_pair * 32))
                for i in static_range(4):
                    bk[dp2, i] = bf[i]
            for m in static_range(Q_SLICES):
                a = ldmatrix_x4_trans(ds_t + ds_lane + uint32(kt * 16 * DS_ROW_BYTES + m * 32))
                for dp2 in static_range(DT_WARP // 2):
                    for half in static_range(2):
                        dt = dp2 * 2 + half
                        d = mma(a[0], a[1], a[2], a[3], bk[dp2, 2 * half], bk[dp2, 2 * half + 1],
                                acc[m, dt, 0], acc[m, dt, 1], acc[m, dt, 2], acc[m, dt, 3])
                        for i in static_range(4):
                            acc[m, dt, i] = d[i]

    @inline_device
    @unroll
    def add_dq_atomic_columns(dq_accum, acc, b, q_start, h, seqlen_q, g, t, warp):
        """dq_accum[b, q_start + rows, h, the warp's columns] += acc (unscaled), as add_dq_atomic."""
        col0 = warp * DT_WARP * 8
        for m in static_range(Q_SLICES):
            for r in static_range(2):
                row = q_start + m * 16 + g + 8 * r
                if row < seqlen_q:
                    row_address = global_address(dq_accum, b, row, h, 0)
                    if VECTOR_DQ:
                        for dt in static_range(DT_WARP):
                            if col0 + dt * 8 < HD:  # headdim % 8 == 0: the whole tile is inside
                                red_add_f32x2(row_address + (col0 + dt * 8 + 2 * t) * 4, acc[m, dt, 2 * r],
                                              acc[m, dt, 2 * r + 1])
                    else:
                        for dt in static_range(DT_WARP):
                            for e in static_range(2):
                                col = col0 + dt * 8 + 2 * t + e
                                if col < HD:
                                    red_add_f32(row_address + col * 4, acc[m, dt, 2 * r + e])

    @inline_device
    def step_class(params, b, hk, group, first_tile, tiles_per_head, n_block, step):
        """The block mask's class of the dK/dV loop's step (query head, query tile) for this key tile."""
        h, tile = query_step(step, hk, group, first_tile, tiles_per_head)
        return tile_class(params, b, h, tile, n_block)

    @inline_device
    def next_step(params, b, hk, group, first_tile, tiles_per_head, n_block, step, steps):
        """The first step from ``step`` on that the block mask does not call empty, or ``steps``:
        the one whose tiles are requested next (``step`` itself without a block mask)."""
        if BLOCK_MASK:
            while step < steps and step_class(params, b, hk, group, first_tile, tiles_per_head, n_block,
                                              step) == variants.EMPTY:
                step += 1
        return step

    @cuda.jit
    @unroll
    def backward_dkdv_mma(q, k, v, dout, lse, delta, dk, dv, dq_accum, scale_log2, scale, params):
        # dq_accum is only touched with ATOMIC_DQ; otherwise the caller passes any array.
        n_block, hk, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane >> 2, lane & 3
        if VARLEN:  # packed sequences: every array narrowed to this block's sequence (module docstring)
            q_off, seqlen_q, k_off, seqlen_k = sequence(params, b, q.shape[1], k.shape[1])
            if n_block * BN >= seqlen_k:
                return  # the whole block: its key tile lies past the sequence's end
            q_end, k_end = q_off + seqlen_q, k_off + seqlen_k
            q, dout, lse, delta = (q[:, q_off:q_end], dout[:, q_off:q_end], lse[:, :, q_off:q_end],
                                   delta[:, :, q_off:q_end])
            k, v, dk, dv = k[:, k_off:k_end], v[:, k_off:k_end], dk[:, k_off:k_end], dv[:, k_off:k_end]
            if ATOMIC_DQ:
                dq_accum = dq_accum[:, q_off:q_end]
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        group = q.shape[2] // k.shape[2]  # GQA: query heads hk * group ... share this K/V tile
        n_start = n_block * BN
        key0 = n_start + warp * 16  # the warp's first key

        smem = cuda.shared.array(0, ELEM)
        base = shared_address(smem)
        lse_s = cuda.shared.array(BM, float32)  # lse_log2 of the query tile's rows
        d_s = cuda.shared.array(BM, float32)  # D of the query tile's rows

        # Per-lane byte offsets of the row each lane hands ldmatrix: a_lane for A fragments (and B
        # fragments of a [k][n] tile, with .trans), b_lane for B fragments of an [n][k] tile (and A
        # fragments of a [k][m] tile, with .trans). See make_mma_abt and make_mma_ab.
        a_lane = uint32(((lane & 7) + ((lane >> 3) & 1) * 8) * ROW_BYTES + (lane >> 4) * 16)
        b_lane = uint32(((lane & 7) + (lane >> 4) * 8) * ROW_BYTES + ((lane >> 3) & 1) * 16)
        ds_lane = uint32(((lane & 7) + (lane >> 4) * 8) * DS_ROW_BYTES + ((lane >> 3) & 1) * 16)
        k_warp = base + uint32((K_TILE + warp * 16 * ROW) * 2)
        v_warp = base + uint32((V_TILE + warp * 16 * ROW) * 2)
        k_tile = base + uint32(K_TILE * 2)
        q_tile = base + uint32(Q_TILE * 2)
        do_tile = base + uint32(DO_TILE * 2)
        ds_t = base + uint32(DS_TILE * 2)

        # ---- Which query tiles see this key tile (geometry.py): [first_tile, end_tile), of which
        # [first_full, end_full) see all of its keys. The key tail always masks.
        first_tile, first_full, end_full, end_tile = query_tiles(
            n_start, min(n_start + BN, seqlen_k), seqlen_q, seqlen_k, params, BM)
        tail = n_start + BN > seqlen_k

        # ---- K_j, V_j once; dK_j, dV_j accumulators in registers ----
        load_tile(smem, K_TILE, k, b, n_start, hk, seqlen_k - n_start, BN)
        load_tile(smem, V_TILE, v, b, n_start, hk, seqlen_k - n_start, BN)
        dk_acc = cuda.local.array((DT, 4), float32)
        dv_acc = cuda.local.array((DT, 4), float32)
        zero_tile(dk_acc)
        zero_tile(dv_acc)
        s = cuda.local.array((QNT, 4), float32)  # S^T, then P^T
        dp = cuda.local.array((QNT, 4), float32)  # dP^T, then dS^T
        dq_acc = cuda.local.array((DT, 4), float32)  # the dQ step split by rows
        dq_cols = cuda.local.array((Q_SLICES, DT_WARP, 4), float32)  # ... or by columns
        k_frags = cuda.local.array((K_PAIRS, 4), uint32)

        # ---- Loop over the query heads of the group and their query tiles Q_i, dO_i ----
        # One step per (head, query tile). A step's Q_i, dO_i (and its rows' lse and D, staged in
        # registers, a row per thread) are requested during the step before, as soon as that step's
        # dK/dV products are done with the shared Q and dO tiles: the copies land while the block
        # works on the dQ atomics.
        tiles_per_head = end_tile - first_tile
        steps = group * tiles_per_head
        lse_next, d_next = float32(0), float32(0)
        first_step = next_step(params, b, hk, group, first_tile, tiles_per_head, n_block, 0, steps)
        if first_step < steps:
            h = hk * group
            q_start = first_tile * BM
            if BLOCK_MASK:  # the first step the block mask does not call empty
                h, first = query_step(first_step, hk, group, first_tile, tiles_per_head)
                q_start = first * BM
            load_tile(smem, Q_TILE, q, b, q_start, h, seqlen_q - q_start, BM)
            load_tile(smem, DO_TILE, dout, b, q_start, h, seqlen_q - q_start, BM)
            if tid < BM:
                lse_next = lse_log2(lse, b, h, q_start + tid, seqlen_q)
                d_next = delta[b, h, q_start + tid] if q_start + tid < seqlen_q else float32(0)
        tiles_landed()  # also when no query tile follows: no copy outlives the block

        for step in range(steps):
            # A step the block mask calls empty is passed over by the whole block (nothing was
            # requested for it).
            tile = step_class(params, b, hk, group, first_tile, tiles_per_head, n_block, step)
            if tile == variants.EMPTY:
                continue
            h, i = query_step(step, hk, group, first_tile, tiles_per_head)
            head_ctx = head_context(params, b, h)  # (b, h, ALiBi slope): what the variant reads per head
            units = score_units(params, scale, head_ctx)  # the score features' constants for this head
            q_start = i * BM
            if tid < BM:
                # the score features' offset (variants.OFFSET) out of lse, as out of their scores
                lse_s[tid] = lse_next - units[variants.OFFSET] if SCORE else lse_next
                d_s[tid] = d_next
            tiles_landed()
            cuda.syncthreads()  # Q_i, dO_i, lse, D (and K_j, V_j) have landed; the last dQ step is done

            # S^T = K_j Q_i^T and dP^T = V_j dO_i^T, the warp's 16 keys by BM queries
            mma_keys_by_queries(s, k_warp, a_lane, q_tile, b_lane)
            mma_keys_by_queries(dp, v_warp, a_lane, do_tile, b_lane)

            # P^T and dS^T; the mask only on tiles crossing the window's edges or the key tail
            if tail or i < first_full or i >= end_full or tile == variants.PARTIAL:
                softmax_grad_t(s, dp, lse_s, d_s, key0, q_start, seqlen_q, seqlen_k, params, head_ctx, scale_log2,
                               units, g, t, True)
            else:
                softmax_grad_t(s, dp, lse_s, d_s, key0, q_start, seqlen_q, seqlen_k, params, head_ctx, scale_log2,
                               units, g, t, False)

            # dV_j += P^T dO_i and dK_j += dS^T Q_i
            mma_keys_acc(dv_acc, s, do_tile, a_lane)
            mma_keys_acc(dk_acc, dp, q_tile, a_lane)
            if ATOMIC_DQ:
                store_ds_t(smem, dp, warp, g, t)
            cuda.syncthreads()  # every warp is done with Q_i, dO_i, lse, D; dS^T is stored

            # Request the next step's tiles, then dQ_i += dS K_j through shared dS^T and atomics
            step_next = next_step(params, b, hk, group, first_tile, tiles_per_head, n_block, step + 1, steps)
            if step_next < steps:
                h_next, i_next = query_step(step_next, hk, group, first_tile, tiles_per_head)
                q_next = i_next * BM
                load_tile(smem, Q_TILE, q, b, q_next, h_next, seqlen_q - q_next, BM)
                load_tile(smem, DO_TILE, dout, b, q_next, h_next, seqlen_q - q_next, BM)
                if tid < BM:
                    lse_next = lse_log2(lse, b, h_next, q_next + tid, seqlen_q)
                    d_next = delta[b, h_next, q_next + tid] if q_next + tid < seqlen_q else float32(0)
            if ATOMIC_DQ and DQ_BY_COLUMNS:
                mma_ds_k_columns(dq_cols, k_frags, ds_t, ds_lane, k_tile, a_lane, warp)
                add_dq_atomic_columns(dq_accum, dq_cols, b, q_start, h, seqlen_q, g, t, warp)
            elif ATOMIC_DQ:
                for round_ in static_range(Q_SLICE_ROUNDS):
                    slice_ = round_ * WARPS + warp
                    if slice_ < Q_SLICES:  # warp-uniform
                        mma_ds_k(dq_acc, ds_t, ds_lane, k_tile, a_lane, slice_)
                        add_dq_atomic(dq_accum, dq_acc, b, q_start + slice_ * 16, h, seqlen_q, g, t)

        # ---- Write dK_j = dS^T Q * scale and dV_j (keys no query sees get 0) ----
        store_rows(dk, dk_acc, b, key0, hk, seqlen_k, scale, g, t)
        store_rows(dv, dv_acc, b, key0, hk, seqlen_k, float32(1), g, t)

    # -----------------------------------------------------------------------------------------------
    # The deterministic dQ kernel: one block per query tile Q_i
    # -----------------------------------------------------------------------------------------------

    Q_TILE_Q, DO_TILE_Q = 0, Q_ELEMS  # element offsets in dynamic shared memory
    K_TILE_Q, V_TILE_Q = 2 * Q_ELEMS, 2 * Q_ELEMS + KV_ELEMS

    mma_queries_by_keys = make_mma_abt(KNT, KT, ROW_BYTES, mma)  # S = Q K^T, dP = dO V^T
    score_gradient = make_score_gradient(hooks)
    mma_queries_acc = make_mma_ab(DT, KNT // 2, ROW_BYTES, mma, pack)  # dQ += dS K

    @inline_device
    @unroll
    def softmax_grad(s, dp, lse_row, d_row, key_lo, key_hi, first_row, n_start, seqlen_q, seqlen_k, params,
                     head_ctx, scale_log2, units, g, t, masked):
        """dP -> dS = P * (dP - D) in place (times the score features' derivative), P = exp2(S *
        scale_log2 - lse_log2) of the lane's rows g and g + 8 (which see the keys
        key_lo[r] <= key < key_hi[r]); 0 for the other keys."""
        ctx = (score_row(first_row + g, n_start + 2 * t, seqlen_q, seqlen_k, params, head_ctx, units),
               score_row(first_row + g + 8, n_start + 2 * t, seqlen_q, seqlen_k, params, head_ctx, units))
        for nt in static_range(KNT):
            if nt % 4 == 0:  # dropout's words of rows g, g + 8 by keys 2t, 2t + 1 of this tile and the
                # next three: one Philox call (constants without dropout)
                drop = dropout_words(first_row + g, n_start + nt * 8 + 2 * t, params, head_ctx)
            for r in static_range(2):
                for e in static_range(2):
                    dp[nt, 2 * r + e] = score_gradient(
                        s[nt, 2 * r + e], dp[nt, 2 * r + e], ctx[r], nt * 8 + e, lse_row[r], d_row[r],
                        n_start + nt * 8 + 2 * t + e, key_lo[r], key_hi[r], first_row + g + 8 * r, seqlen_q, seqlen_k,
                        params, head_ctx, scale_log2, units, drop[nt % 4], 2 * r + e, masked)

    @cuda.jit
    @unroll
    def backward_dq_mma(q, k, v, dout, lse, delta, dq, scale_log2, scale, params):
        m_block, h, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        if WINDOW:  # the last query blocks see the most keys (causal): start them first
            m_block = cuda.gridDim.x - 1 - m_block
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane >> 2, lane & 3
        if VARLEN:  # packed sequences: every array narrowed to this block's sequence (module docstring)
            q_off, seqlen_q, k_off, seqlen_k = sequence(params, b, q.shape[1], k.shape[1])
            if m_block * BM >= seqlen_q:
                return  # the whole block: its query tile lies past the sequence's end
            q_end, k_end = q_off + seqlen_q, k_off + seqlen_k
            q, dout, lse, delta, dq = (q[:, q_off:q_end], dout[:, q_off:q_end], lse[:, :, q_off:q_end],
                                       delta[:, :, q_off:q_end], dq[:, q_off:q_end])
            k, v = k[:, k_off:k_end], v[:, k_off:k_end]
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        hk = h // (q.shape[2] // k.shape[2])  # GQA: the key/value head this query head reads
        q_start = m_block * BM
        first_row = q_start + warp * 16  # the warp's first query row

        smem = cuda.shared.array(0, ELEM)
        base = shared_address(smem)
        a_lane = uint32(((lane & 7) + ((lane >> 3) & 1) * 8) * ROW_BYTES + (lane >> 4) * 16)
        b_lane = uint32(((lane & 7) + (lane >> 4) * 8) * ROW_BYTES + ((lane >> 3) & 1) * 16)
        q_warp = base + uint32((Q_TILE_Q + warp * 16 * ROW) * 2)
        do_warp = base + uint32((DO_TILE_Q + warp * 16 * ROW) * 2)
        k_tile = base + uint32(K_TILE_Q * 2)
        v_tile = base + uint32(V_TILE_Q * 2)

        head_ctx = head_context(params, b, h)  # (b, h, ALiBi slope): what the variant reads per head
        units = score_units(params, scale, head_ctx)  # the score features' constants for this head
        # lse_log2, D and the visible keys [key_lo, key_hi) of the lane's two rows, g and g + 8
        lse_row = cuda.local.array(2, float32)
        d_row = cuda.local.array(2, float32)
        key_lo = cuda.local.array(2, int32)
        key_hi = cuda.local.array(2, int32)
        for r in static_range(2):
            row = first_row + g + 8 * r
            lse_row[r] = lse_log2(lse, b, h, row, seqlen_q)
            if SCORE:  # the score features' offset (variants.OFFSET) out of lse, as out of their scores
                lse_row[r] -= units[variants.OFFSET]
            d_row[r] = delta[b, h, row] if row < seqlen_q else float32(0)
            lo, hi = row_keys(row, seqlen_q, seqlen_k, params)
            key_lo[r] = lo
            key_hi[r] = hi

        # ---- Which key tiles this query tile visits (geometry.py, as in the forward) ----
        first_tile, first_full, end_full, end_tile = key_tiles(
            q_start, min(q_start + BM, seqlen_q), seqlen_q, seqlen_k, params, BN)

        # ---- Q_i, dO_i once; dQ_i in registers ----
        load_tile(smem, Q_TILE_Q, q, b, q_start, h, seqlen_q - q_start, BM)
        load_tile(smem, DO_TILE_Q, dout, b, q_start, h, seqlen_q - q_start, BM)
        tiles_landed()  # also when no key tile follows: no copy outlives the block
        dq_acc = cuda.local.array((DT, 4), float32)
        zero_tile(dq_acc)
        s = cuda.local.array((KNT, 4), float32)  # S
        dp = cuda.local.array((KNT, 4), float32)  # dP, then dS

        # ---- Loop over K_j, V_j ----
        for j in range(first_tile, end_tile):
            tile = tile_class(params, b, h, m_block, j)
            if tile == variants.EMPTY:  # the block mask keeps nothing here (the same for the whole block)
                continue
            n_start = j * BN
            cuda.syncthreads()  # every warp is done with K_{j-1}, V_{j-1}
            load_tile(smem, K_TILE_Q, k, b, n_start, hk, seqlen_k - n_start, BN)
            load_tile(smem, V_TILE_Q, v, b, n_start, hk, seqlen_k - n_start, BN)
            tiles_landed()
            cuda.syncthreads()  # K_j, V_j (and Q_i, dO_i on the first pass) have landed

            # S = Q_i K_j^T and dP = dO_i V_j^T, the warp's 16 queries by BN keys
            mma_queries_by_keys(s, q_warp, a_lane, k_tile, b_lane)
            mma_queries_by_keys(dp, do_warp, a_lane, v_tile, b_lane)

            # dS = P * (dP - D); the mask only on tiles crossing the window's edges or the key tail
            if first_full <= j and j < end_full and tile == variants.FULL:
                softmax_grad(s, dp, lse_row, d_row, key_lo, key_hi, first_row, n_start, seqlen_q, seqlen_k, params,
                             head_ctx, scale_log2, units, g, t, False)
            else:
                softmax_grad(s, dp, lse_row, d_row, key_lo, key_hi, first_row, n_start, seqlen_q, seqlen_k, params,
                             head_ctx, scale_log2, units, g, t, True)

            # dQ_i += dS K_j
            mma_queries_acc(dq_acc, dp, k_tile, a_lane)

        # ---- Write dQ_i * scale (rows that see no key get 0) ----
        store_rows(dq, dq_acc, b, first_row, h, seqlen_q, scale, g, t)

    return backward_dkdv_mma if config.kernel == "dkdv" else backward_dq_mma
