"""Portable FlashAttention forward: plain float32 arithmetic, runs on any CUDA GPU Numba supports.

This is the kernel for float32 inputs and for GPUs without the tensor-core path, and the one to read
first: it is FlashAttention-2's algorithm with nothing but shared memory and scalar arithmetic.

Algorithm (FlashAttention-2, Algorithm 1, in base 2): for the query tile Q_i, walk the key/value
tiles K_j, V_j and keep, per query row, the running maximum m_i, the running sum l_i of exp2(s - m_i)
and an un-normalized output acc. For each tile::

    S      = Q_i K_j^T * scale * log2(e)          (masked entries are -inf)
    m_new  = max(m_i, rowmax(S))
    alpha  = exp2(m_i - m_new)                    (rescales what was accumulated so far)
    P      = exp2(S - m_new)
    l_i    = alpha * l_i + rowsum(P)
    acc    = alpha * acc + P V_j
    m_i    = m_new

and at the end ``out = acc / l_i`` and ``lse = (m_i + log2(l_i)) * ln(2)``. O, m and l never leave
the block inside the loop (flash-attn 2's loop order); no N x N matrix is ever stored.

Grid and block::

    grid  = (cdiv(seqlen_q, BLOCK_M), nheads, batch)   one block per query tile of one head
    block = THREADS_Y * THREADS_X threads, thread (ty, tx) = divmod(threadIdx.x, THREADS_X)

Register tiling: thread (ty, tx) owns the ROWS_PER_THREAD query rows ``ty * ROWS_PER_THREAD + r``.
For S it computes the key columns ``tx + THREADS_X * c`` of those rows; for the output, the features
``tx + THREADS_X * f``. Each value it reads from shared memory then feeds several multiply-adds (a
Q value serves all its key columns, a V value all its rows), which is what makes the kernel run at a
useful fraction of the float32 rate instead of at the speed of shared memory. Every thread of a row
group keeps the same m_i; each keeps its own share of l_i, summed once at the end.

Shared memory (float32; each row padded by one word so that threads reading down a column hit
different banks)::

    Q_s    (BLOCK_M, HEADDIM + 1)     the query tile, loaded once, pre-scaled by scale * log2(e)
    K_s    (BLOCK_N, HEADDIM + 1)     the current key tile
    V_s    (BLOCK_N, HEADDIM + 1)     the current value tile
    P_s    (BLOCK_M, BLOCK_N + 1)     the current probabilities, shared by a row's threads
    part_s (BLOCK_M, THREADS_X)       per-thread partial row maxima (then row sums)

Which keys a query sees is the variant's window (causal is the window (-1, 0): every key up to the
query's diagonal, bottom-right aligned), and nbflash/kernels/geometry.py says which key tiles that
leaves: tiles no row of the block sees are never visited, and tiles every row sees whole skip the
mask test. A block mask (``tile_class``) removes the tiles it calls empty and masks those it calls
partial. A row that sees no key writes out = 0 and lse = -inf.

Arguments: ``q`` (batch, seqlen_q, nheads, headdim), ``k``, ``v`` (batch, seqlen_k, nheads_k,
headdim), any strides; ``out`` like q; ``lse`` float32 (batch, nheads, seqlen_q); ``scale_log2`` the
softmax scale times log2(e); ``params`` the variant's runtime values (nbflash/kernels/variants.py).
bfloat16 tensors arrive as uint16 arrays of raw bits.

Packed sequences (``variant.varlen``): q, out are (batch, total_q, nheads, headdim), k, v (batch,
total_k, nheads_k, headdim) and lse (batch, nheads, total_q), each a view with stride 0 over batch
of the one packed array; grid.x covers the longest sequence. A block first narrows every array to
its sequence's rows (``sequence``, from cu_seqlens in ``params``) and, if its tile lies past that
sequence's end, exits at once; the rest of the kernel is the dense one on a batch of one sequence.
"""

import math
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda, float32

from nbflash.problem import Variant

from . import variants
from .tiles import element_io, tile_loader

LN2 = math.log(2.0)
LOG2E = math.log2(math.e)
NEG_INF = float32(-math.inf)


@dataclass(frozen=True)
class PortableForwardConfig:
    """One compiled variant of the portable forward kernel."""

    dtype: str  # 'float16', 'bfloat16' or 'float32'
    headdim: int
    variant: Variant
    threads_x: int  # threads sharing a row group: split the key columns and the features
    threads_y: int  # row groups per block
    rows_per_thread: int  # query rows each thread owns
    block_n: int  # key/value rows per tile; a multiple of threads_x

    @property
    def block_m(self):
        return self.threads_y * self.rows_per_thread

    @property
    def threads(self):
        return self.threads_x * self.threads_y

    @property
    def static_shared_bytes(self):
        return shared_bytes(self.headdim, self.block_m, self.block_n, self.threads_x)

    dynamic_shared_bytes = 0  # all tiles are static shared arrays, within the 48 KB every GPU has

    def grid(self, batch, nheads, seqlen_q):
        return ((seqlen_q + self.block_m - 1) // self.block_m, nheads, batch)


def shared_bytes(headdim, block_m, block_n, threads_x):
    """Bytes of the shared tiles (see the module docstring for the padding)."""
    tiles = block_m * (headdim + 1) + 2 * block_n * (headdim + 1) + block_m * (block_n + 1)
    return 4 * (tiles + block_m * threads_x)


@lru_cache(maxsize=None)
def build_forward_portable(config):
    """Compile-time specialization: returns the ``@cuda.jit`` kernel for ``config``."""
    HEADDIM = config.headdim
    hooks = variants.hooks(config.variant)
    key_tiles, row_keys, hidden = hooks.key_tiles, hooks.row_keys, hooks.hidden
    SCORE, score, head_context = hooks.SCORE, hooks.score, hooks.head_context
    DROPOUT, dropout_factor = hooks.DROPOUT, hooks.dropout_factor
    tile_class = hooks.tile_class  # the block mask's class of a tile pair (FULL without one)
    VARLEN, sequence = hooks.VARLEN, hooks.sequence  # packed sequences: where this block's rows are
    BLOCK_M = config.block_m
    BLOCK_N = config.block_n
    THREADS_X = config.threads_x
    ROWS = config.rows_per_thread
    NUM_THREADS = config.threads
    COLS = BLOCK_N // THREADS_X  # key columns of S per thread
    FEATURES = (HEADDIM + THREADS_X - 1) // THREADS_X  # output features per thread
    S_REGS = ROWS * COLS
    ACC_REGS = ROWS * FEATURES
    HEADDIM_PAD = HEADDIM + 1
    BLOCK_N_PAD = BLOCK_N + 1
    load, store = element_io(config.dtype)

    # ------------------------------------------------------------------------------------------
    # Helpers: tile operations, each done by the whole block or by one thread on its registers
    # ------------------------------------------------------------------------------------------

    load_tile = tile_loader(HEADDIM, NUM_THREADS, load)

    @cuda.jit(device=True, inline=True)
    def scores(Q_s, K_s, row0, tx, s):
        """s[r, c] = Q_s[row0 + r] . K_s[tx + THREADS_X * c]: a ROWS x COLS register tile."""
        for i in range(S_REGS):
            s[i] = float32(0.0)
        for d in range(HEADDIM):
            for c in range(COLS):
                k_val = K_s[tx + THREADS_X * c, d]
                for r in range(ROWS):
                    s[r * COLS + c] += Q_s[row0 + r, d] * k_val

    @cuda.jit(device=True, inline=True)
    def score_scores(s, row0, tx, q_start, k_start, seqlen_q, seqlen_k, params, head_ctx):
        """s = score(s) * log2(e): the variant's score features on natural-unit scores (Q_i was
        scaled by the softmax scale alone), then the exponent's units."""
        for r in range(ROWS):
            for c in range(COLS):
                x = score(s[r * COLS + c], q_start + row0 + r, k_start + tx + THREADS_X * c, seqlen_q, seqlen_k,
                          params, head_ctx)
                s[r * COLS + c] = x * float32(LOG2E)

    @cuda.jit(device=True, inline=True)
    def mask_scores(s, row0, tx, q_start, k_start, seqlen_q, seqlen_k, params, head_ctx):
        """-inf where the row does not see the key: past seqlen_k, outside its window, or masked."""
        for r in range(ROWS):
            row = q_start + row0 + r
            lo, hi = row_keys(row, seqlen_q, seqlen_k, params)
            for c in range(COLS):
                if hidden(k_start + tx + THREADS_X * c, lo, hi, row, seqlen_q, params, head_ctx):
                    s[r * COLS + c] = NEG_INF

    @cuda.jit(device=True, inline=True)
    def row_max_partial(s, r):
        """Largest of this thread's scores in row r."""
        m = NEG_INF
        for c in range(COLS):
            m = max(m, s[r * COLS + c])
        return m

    @cuda.jit(device=True, inline=True)
    def row_reduce(part_s, row, use_max):
        """Max (or sum) over the THREADS_X partial values of one row."""
        acc = part_s[row, 0]
        for x in range(1, THREADS_X):
            acc = max(acc, part_s[row, x]) if use_max else acc + part_s[row, x]
        return acc

    @cuda.jit(device=True, inline=True)
    def accumulate_pv(P_s, V_s, row0, tx, acc):
        """acc[r, f] += sum_c P_s[row0 + r, c] * V_s[c, tx + THREADS_X * f]."""
        for c in range(BLOCK_N):
            for f in range(FEATURES):
                d = tx + THREADS_X * f
                v_val = V_s[c, d] if d < HEADDIM else float32(0.0)
                for r in range(ROWS):
                    acc[r * FEATURES + f] += P_s[row0 + r, c] * v_val

    # ------------------------------------------------------------------------------------------
    # The kernel
    # ------------------------------------------------------------------------------------------

    @cuda.jit(cache=True)  # compiled code is kept on disk (per config) across processes
    def forward_portable(q, k, v, out, lse, scale_log2, params):
        if VARLEN:  # packed sequences: every array narrowed to this block's sequence (module docstring)
            q_off, seqlen_q, k_off, seqlen_k = sequence(params, cuda.blockIdx.z, q.shape[1], k.shape[1])
            if cuda.blockIdx.x * BLOCK_M >= seqlen_q:
                return  # the whole block: its tile lies past the sequence's end (no barrier is left waiting)
            q_end, k_end = q_off + seqlen_q, k_off + seqlen_k
            q, out, lse = q[:, q_off:q_end], out[:, q_off:q_end], lse[:, :, q_off:q_end]
            k, v = k[:, k_off:k_end], v[:, k_off:k_end]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        tile_m = cuda.blockIdx.x
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        head_k = head // (q.shape[2] // k.shape[2])  # GQA: query heads share a key/value head
        ty = cuda.threadIdx.x // THREADS_X
        tx = cuda.threadIdx.x % THREADS_X
        row0 = ty * ROWS  # this thread's first row within the tile

        q_start = tile_m * BLOCK_M
        q_rows = min(BLOCK_M, seqlen_q - q_start)

        Q_s = cuda.shared.array((BLOCK_M, HEADDIM_PAD), float32)
        K_s = cuda.shared.array((BLOCK_N, HEADDIM_PAD), float32)
        V_s = cuda.shared.array((BLOCK_N, HEADDIM_PAD), float32)
        P_s = cuda.shared.array((BLOCK_M, BLOCK_N_PAD), float32)
        part_s = cuda.shared.array((BLOCK_M, THREADS_X), float32)
        s = cuda.local.array(S_REGS, float32)
        acc = cuda.local.array(ACC_REGS, float32)
        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)  # this thread's share of the row sums
        alpha = cuda.local.array(ROWS, float32)
        for i in range(ACC_REGS):
            acc[i] = float32(0.0)
        for r in range(ROWS):
            m_i[r] = NEG_INF
            l_i[r] = float32(0.0)

        # ---- Which key tiles this query tile visits (geometry.py) -------------------------------
        # Tiles [first_tile, end_tile) hold keys some row sees; [first_full, end_full) every row
        # sees whole, so they need no mask at all.
        first_tile, first_full, end_full, end_tile = key_tiles(
            q_start, q_start + q_rows, seqlen_q, seqlen_k, params, BLOCK_N)

        # ---- Load Q_i once, pre-scaled so that scores come out in base 2 -----------------------
        # (natural units instead when a score feature needs them; it returns them in base 2)
        head_ctx = head_context(params, batch, head)  # (b, h, ALiBi slope): what the variant reads per head
        load_tile(q, batch, q_start, head, q_rows, Q_s, scale_log2 * float32(LN2) if SCORE else scale_log2)

        # ---- Loop over K_j, V_j ----------------------------------------------------------------
        for j in range(first_tile, end_tile):
            tile = tile_class(params, batch, head, tile_m, j)
            if tile == variants.EMPTY:  # the block mask keeps nothing here (the same for the whole block)
                continue
            k_start = j * BLOCK_N
            k_rows = min(BLOCK_N, seqlen_k - k_start)
            load_tile(k, batch, k_start, head_k, k_rows, K_s, float32(1.0))
            load_tile(v, batch, k_start, head_k, k_rows, V_s, float32(1.0))
            cuda.syncthreads()  # K_j, V_j (and Q_i on the first pass) are in shared memory

            scores(Q_s, K_s, row0, tx, s)
            if SCORE:
                score_scores(s, row0, tx, q_start, k_start, seqlen_q, seqlen_k, params, head_ctx)
            if j < first_full or j >= end_full or tile == variants.PARTIAL:
                mask_scores(s, row0, tx, q_start, k_start, seqlen_q, seqlen_k, params, head_ctx)
            for r in range(ROWS):
                part_s[row0 + r, tx] = row_max_partial(s, r)
            cuda.syncthreads()  # every thread's partial row maxima are in part_s

            for r in range(ROWS):
                m_new = max(m_i[r], row_reduce(part_s, row0 + r, True))
                # A row with nothing visible yet keeps m = -inf; subtract 0 instead so that
                # exp2(-inf - (-inf)) never makes a NaN: every p and alpha is then exp2(-inf) = 0.
                m_safe = m_new if m_new != NEG_INF else float32(0.0)
                alpha[r] = math.exp2(m_i[r] - m_safe)
                l_tile = float32(0.0)
                for c in range(COLS):
                    p = math.exp2(s[r * COLS + c] - m_safe)
                    l_tile += p
                    if DROPOUT:  # the probability point: P V takes the dropped, rescaled P
                        p *= dropout_factor(q_start + row0 + r, k_start + tx + THREADS_X * c, params, head_ctx)
                    P_s[row0 + r, tx + THREADS_X * c] = p
                l_i[r] = l_i[r] * alpha[r] + l_tile
                m_i[r] = m_new
            for r in range(ROWS):
                for f in range(FEATURES):
                    acc[r * FEATURES + f] *= alpha[r]
            cuda.syncthreads()  # P_j is complete in P_s; part_s has been read

            accumulate_pv(P_s, V_s, row0, tx, acc)
            cuda.syncthreads()  # everyone is done with K_s, V_s, P_s before the next tile lands

        # ---- Normalize and write O_i and lse ---------------------------------------------------
        for r in range(ROWS):
            part_s[row0 + r, tx] = l_i[r]
        cuda.syncthreads()  # every thread's share of the row sums is in part_s
        for r in range(ROWS):
            q_idx = q_start + row0 + r
            if q_idx < seqlen_q:
                l_row = row_reduce(part_s, row0 + r, False)
                # l = 0: a row without keys (out 0, lse -inf); a NaN l (a NaN in q) stays NaN in both
                inv_l = float32(1.0) / l_row if l_row != float32(0.0) else float32(0.0)
                for f in range(FEATURES):
                    d = tx + THREADS_X * f
                    if d < HEADDIM:
                        out[batch, q_idx, head, d] = store(acc[r * FEATURES + f] * inv_l)
                if tx == 0:
                    if l_row != float32(0.0):
                        lse[batch, head, q_idx] = (m_i[r] + math.log2(l_row)) * float32(LN2)
                    else:
                        lse[batch, head, q_idx] = NEG_INF

    return forward_portable
