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
    block = BLOCK_M * THREADS_PER_ROW threads

Thread ``t`` owns query row ``row = t // THREADS_PER_ROW`` of the tile and is lane
``lane = t % THREADS_PER_ROW`` among the threads of that row. It computes the scores of the tile's
key columns ``lane, lane + THREADS_PER_ROW, ...`` and the output features
``lane, lane + THREADS_PER_ROW, ...`` of its row (so a row's threads read neighbouring shared-memory
words). The softmax statistics m_i and l_i are kept, identically, by every thread of a row.

Shared memory (float32; each row padded by one word so that threads reading down a column hit
different banks)::

    Q_s  (BLOCK_M, HEADDIM + 1)    the query tile, loaded once
    K_s  (BLOCK_N, HEADDIM + 1)    the current key tile
    V_s  (BLOCK_N, HEADDIM + 1)    the current value tile
    S_s  (BLOCK_M, BLOCK_N + 1)    the current score tile, shared by a row's threads

Causal attention is aligned to the bottom-right corner: query i sees key j iff
``j <= i + seqlen_k - seqlen_q``. Tiles entirely above the diagonal are never visited, and tiles
entirely below it skip the mask test. A row that sees no key writes out = 0 and lse = -inf.

Arguments: ``q`` (batch, seqlen_q, nheads, headdim), ``k``, ``v`` (batch, seqlen_k, nheads_k,
headdim), any strides; ``out`` like q; ``lse`` float32 (batch, nheads, seqlen_q); ``scale_log2`` the
softmax scale times log2(e). bfloat16 tensors arrive as uint16 arrays of raw bits.
"""

import math
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda, float32

from ..primitives import bf16_bits_to_f32, f32_to_bf16_bits, to_f32

LN2 = math.log(2.0)
NEG_INF = float32(-math.inf)


@dataclass(frozen=True)
class PortableForwardConfig:
    """One compiled variant of the portable forward kernel."""

    dtype: str  # 'float16', 'bfloat16' or 'float32'
    headdim: int
    causal: bool
    block_m: int  # query rows per block
    block_n: int  # key/value rows per tile
    threads_per_row: int

    @property
    def threads(self):
        return self.block_m * self.threads_per_row

    @property
    def static_shared_bytes(self):
        return shared_bytes(self.headdim, self.block_m, self.block_n)

    dynamic_shared_bytes = 0  # all tiles are static shared arrays, within the 48 KB every GPU has

    def grid(self, batch, nheads, seqlen_q):
        return ((seqlen_q + self.block_m - 1) // self.block_m, nheads, batch)


def shared_bytes(headdim, block_m, block_n):
    """Bytes of the four float32 tiles (see the module docstring for the padding)."""
    return 4 * (block_m * (headdim + 1) + 2 * block_n * (headdim + 1) + block_m * (block_n + 1))


@lru_cache(maxsize=None)
def build_forward_portable(config):
    """Compile-time specialization: returns the ``@cuda.jit`` kernel for ``config``."""
    HEADDIM = config.headdim
    CAUSAL = config.causal
    BLOCK_M = config.block_m
    BLOCK_N = config.block_n
    THREADS_PER_ROW = config.threads_per_row
    NUM_THREADS = config.threads
    FEATURES_PER_THREAD = (HEADDIM + THREADS_PER_ROW - 1) // THREADS_PER_ROW
    COLUMNS_PER_THREAD = BLOCK_N // THREADS_PER_ROW
    HEADDIM_PAD = HEADDIM + 1
    BLOCK_N_PAD = BLOCK_N + 1
    if config.dtype == "bfloat16":
        load, store = bf16_bits_to_f32, f32_to_bf16_bits
    else:
        load, store = to_f32, to_f32  # float16 outputs are narrowed by the array store itself

    # ------------------------------------------------------------------------------------------
    # Helpers: tile operations, each done by the whole block or by the threads of one row
    # ------------------------------------------------------------------------------------------

    @cuda.jit(device=True, inline=True)
    def load_tile(src, batch, start, head, rows, tile, scale):
        """tile[r, d] = src[batch, start + r, head, d] * scale, zero beyond the ``rows`` valid rows.

        Consecutive threads read consecutive features of a row: coalesced global reads.
        """
        for i in range(cuda.threadIdx.x, tile.shape[0] * HEADDIM, NUM_THREADS):
            r = i // HEADDIM
            d = i - r * HEADDIM
            if r < rows:
                tile[r, d] = load(src[batch, start + r, head, d]) * scale
            else:
                tile[r, d] = float32(0.0)

    @cuda.jit(device=True, inline=True)
    def score_row(Q_s, K_s, S_s, row, lane, k_start, seqlen_k, diagonal, masked):
        """S_s[row, c] = Q_s[row] . K_s[c] for this thread's columns c; -inf where masked.

        Q_s is pre-scaled by scale * log2(e). ``diagonal`` is the last key index this row may see
        under causal attention; ``masked`` is False for tiles known to need no mask.
        """
        for i in range(COLUMNS_PER_THREAD):
            c = lane + i * THREADS_PER_ROW
            s = float32(0.0)
            for d in range(HEADDIM):
                s += Q_s[row, d] * K_s[c, d]
            if masked:
                k_idx = k_start + c
                if k_idx >= seqlen_k or (CAUSAL and k_idx > diagonal):
                    s = NEG_INF
            S_s[row, c] = s

    @cuda.jit(device=True, inline=True)
    def tile_row_max(S_s, row):
        """The largest score in one row of the tile."""
        m = NEG_INF
        for c in range(BLOCK_N):
            m = max(m, S_s[row, c])
        return m

    @cuda.jit(device=True, inline=True)
    def accumulate_row(S_s, V_s, row, lane, m_new, acc):
        """acc += exp2(S - m_new) @ V_s for this thread's features; returns rowsum(exp2(S - m_new))."""
        l_tile = float32(0.0)
        for c in range(BLOCK_N):
            p = math.exp2(S_s[row, c] - m_new)  # exp2(-inf) = 0 for masked scores
            l_tile += p
            for f in range(FEATURES_PER_THREAD):
                d = lane + f * THREADS_PER_ROW
                if d < HEADDIM:
                    acc[f] += p * V_s[c, d]
        return l_tile

    # ------------------------------------------------------------------------------------------
    # The kernel
    # ------------------------------------------------------------------------------------------

    @cuda.jit(cache=True)  # compiled code is kept on disk (per config) across processes
    def forward_portable(q, k, v, out, lse, scale_log2):
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        tile_m = cuda.blockIdx.x
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        head_k = head // (q.shape[2] // k.shape[2])  # GQA: query heads share a key/value head
        row = cuda.threadIdx.x // THREADS_PER_ROW
        lane = cuda.threadIdx.x % THREADS_PER_ROW

        q_start = tile_m * BLOCK_M
        q_idx = q_start + row
        q_rows = min(BLOCK_M, seqlen_q - q_start)
        diagonal = q_idx + seqlen_k - seqlen_q  # last key this row sees under causal attention

        Q_s = cuda.shared.array((BLOCK_M, HEADDIM_PAD), float32)
        K_s = cuda.shared.array((BLOCK_N, HEADDIM_PAD), float32)
        V_s = cuda.shared.array((BLOCK_N, HEADDIM_PAD), float32)
        S_s = cuda.shared.array((BLOCK_M, BLOCK_N_PAD), float32)
        acc = cuda.local.array(FEATURES_PER_THREAD, float32)
        for f in range(FEATURES_PER_THREAD):
            acc[f] = float32(0.0)
        m_i = NEG_INF
        l_i = float32(0.0)

        # ---- Which key tiles this query tile visits --------------------------------------------
        # Non-causal: all of them. Causal: none past the last row's diagonal; and tiles wholly
        # left of the first row's diagonal (and inside seqlen_k) need no mask at all.
        k_end = seqlen_k
        k_unmasked_end = seqlen_k
        if CAUSAL:
            k_end = max(0, min(seqlen_k, q_start + q_rows + seqlen_k - seqlen_q))
            k_unmasked_end = max(0, min(seqlen_k, q_start + 1 + seqlen_k - seqlen_q))
        num_tiles = (k_end + BLOCK_N - 1) // BLOCK_N
        num_unmasked_tiles = k_unmasked_end // BLOCK_N

        # ---- Load Q_i once, pre-scaled so that scores come out in base 2 -----------------------
        load_tile(q, batch, q_start, head, q_rows, Q_s, scale_log2)

        # ---- Loop over K_j, V_j ----------------------------------------------------------------
        for j in range(num_tiles):
            k_start = j * BLOCK_N
            k_rows = min(BLOCK_N, seqlen_k - k_start)
            load_tile(k, batch, k_start, head_k, k_rows, K_s, float32(1.0))
            load_tile(v, batch, k_start, head_k, k_rows, V_s, float32(1.0))
            cuda.syncthreads()  # K_j, V_j (and Q_i on the first pass) are in shared memory

            masked = j >= num_unmasked_tiles
            score_row(Q_s, K_s, S_s, row, lane, k_start, seqlen_k, diagonal, masked)
            cuda.syncthreads()  # the row's scores, written by all its threads, are complete

            m_new = max(m_i, tile_row_max(S_s, row))
            # A row with nothing visible yet keeps m = -inf; subtract 0 instead so that
            # exp2(-inf - (-inf)) never makes a NaN: every p and alpha is then exp2(-inf) = 0.
            m_safe = m_new if m_new != NEG_INF else float32(0.0)
            alpha = math.exp2(m_i - m_safe)
            for f in range(FEATURES_PER_THREAD):
                acc[f] *= alpha
            l_i = l_i * alpha + accumulate_row(S_s, V_s, row, lane, m_safe, acc)
            m_i = m_new
            cuda.syncthreads()  # everyone is done with K_s, V_s, S_s before the next tile lands

        # ---- Normalize and write O_i and lse ---------------------------------------------------
        if q_idx < seqlen_q:
            inv_l = float32(1.0) / l_i if l_i > float32(0.0) else float32(0.0)
            for f in range(FEATURES_PER_THREAD):
                d = lane + f * THREADS_PER_ROW
                if d < HEADDIM:
                    out[batch, q_idx, head, d] = store(acc[f] * inv_l)
            if lane == 0:
                if l_i > float32(0.0):
                    lse[batch, head, q_idx] = (m_i + math.log2(l_i)) * float32(LN2)
                else:
                    lse[batch, head, q_idx] = NEG_INF

    return forward_portable

