"""Portable FlashAttention backward: plain float32 arithmetic, runs on any CUDA GPU Numba supports.

The companion of ``forward_portable`` (read that first; this file keeps its layout and names). It is
FlashAttention-2's backward (Algorithm 2): no N x N matrix is stored; the probabilities are recomputed
tile by tile from the forward's log-sum-exp, ``P = exp(S * scale - lse)``.

With ``dO`` the gradient of the output, per (batch, head)::

    D   = rowsum(dO * O)                            (preprocess: one number per query row)
    P   = exp2(Q K^T * scale * log2(e) - lse * log2(e))
    dV  = P^T dO                dP = dO V^T
    dS  = P * (dP - D)
    dQ  = dS K * scale          dK = dS^T Q * scale

Four kernels, picked by ``PortableBackwardConfig.kernel``:

``preprocess``  grid (cdiv(seqlen_q, BLOCK_M), nheads, batch). D for BLOCK_M query rows; with
                ``atomic_dq`` it also zeroes those rows of the float32 dQ accumulator.
``dkdv``        grid (cdiv(seqlen_k, BLOCK_N), nheads_k, batch). One block per key/value tile K_j, V_j
                of one key/value head. It loops over the query heads that share that key/value head
                (grouped-query attention) and, for each, over the query tiles Q_i that see the tile;
                dK_j and dV_j stay in registers for the whole loop, so their sum over the group is
                formed in a fixed order, without atomics. With ``atomic_dq``, each tile's
                contribution dS K_j to dQ_i is added into the float32 accumulator with atomics.
``dq``          grid (cdiv(seqlen_q, BLOCK_M), nheads, batch). The deterministic dQ: one block per query
                tile Q_i loops over the key tiles (the forward's loop order) with dQ_i in registers.
                Used instead of the atomics when bit-identical results are asked for.
``convert_dq``  grid (cdiv(seqlen_q, BLOCK_M), nheads, batch). dq = dq_accum * scale, in the input dtype.

Threads: the block is ROWS * THREADS_PER_ROW threads, ROWS = BLOCK_N for ``dkdv`` (thread ``t`` owns key
row ``t // THREADS_PER_ROW`` of K_j), else BLOCK_M (it owns a query row). Lane
``lane = t % THREADS_PER_ROW`` computes the tile columns ``lane, lane + THREADS_PER_ROW, ...`` and the
features ``lane, lane + THREADS_PER_ROW, ...`` of its row, as in the forward.

Shared memory of ``dkdv`` (float32, rows padded by one word against bank conflicts)::

    Q_s, dO_s    (BLOCK_M, HEADDIM + 1)   the current query tile and its output gradient
    K_s, V_s     (BLOCK_N, HEADDIM + 1)   this block's key/value tile, loaded once
    P_s, dS_s    (BLOCK_N, BLOCK_M + 1)   P^T and dS^T of the current tile pair
    lse_s, D_s   (BLOCK_M,)               lse * log2(e) and D of the current query rows

and of ``dq``: Q_s, dO_s, K_s, V_s as above and dS_s (BLOCK_M, BLOCK_N + 1).

Which keys a query sees is the variant's window (causal is the window (-1, 0)), and
nbflash/kernels/geometry.py says which tile pairs that leaves: pairs with nothing visible are never
visited, and pairs seen whole skip the mask test; a block mask (``tile_class``) removes the pairs it
calls empty and masks those it calls partial. A query row that sees no key has ``lse = -inf`` from the forward; it is
loaded as ``+inf`` so that its P row is exp2(-inf) = 0 and its gradients are exactly 0 (never NaN).
Query rows past seqlen_q are loaded the same way (Q, dO and D as 0), so they need no mask either.

Arguments: ``q``, ``dout`` (batch, seqlen_q, nheads, headdim), ``k``, ``v`` (batch, seqlen_k, nheads_k,
headdim), any strides; ``lse``, ``delta`` float32 (batch, nheads, seqlen_q); ``dq``, ``dk``, ``dv`` like
q, k, v; ``dq_accum`` float32 like q; ``scale_log2`` the softmax scale times log2(e), ``scale`` the
softmax scale; ``params`` the variant's runtime values (nbflash/kernels/variants.py). bfloat16 tensors arrive as uint16 arrays of raw bits.

Packed sequences (``variant.varlen``): ``dkdv`` and ``dq`` take stride-0 views over batch of the
packed arrays (total rows in dim 1; lse and delta (batch, nheads, total_q)), grid.x covering the
longest sequence; a block narrows every array to its sequence's rows (``sequence``, from cu_seqlens
in ``params``), exits at once if its tile lies past that sequence's end, and is otherwise the dense
kernel on one sequence. ``preprocess`` and ``convert_dq`` work row by row, so they run unchanged
on the packed arrays as a batch of one (every row of every sequence).
"""

import math
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda, float32, uint16, uint32
from numba.types import float16

from nbflash.primitives import (
    global_address,
    inline_device,
    load_u32x4_nc,
    pack_bf16x2,
    pack_f16x2,
    static_range,
    store_u32x4,
    u32_as_f32,
    unpack_bf16x2,
    unpack_f16x2,
    unroll,
)
from nbflash.problem import Variant

from . import variants
from .tiles import element_io, tile_loader

LOG2E = math.log2(math.e)
NEG_INF = float32(-math.inf)
POS_INF = float32(math.inf)

KERNELS = ("preprocess", "dkdv", "dq", "convert_dq")


@dataclass(frozen=True)
class PortableBackwardConfig:
    """One compiled variant of one of the portable backward kernels."""

    kernel: str  # one of KERNELS
    dtype: str  # 'float16', 'bfloat16' or 'float32'
    headdim: int
    variant: Variant
    block_m: int  # query rows per tile
    block_n: int  # key/value rows per tile
    threads_per_row: int
    atomic_dq: bool  # dQ through float32 atomics (else by the deterministic ``dq`` kernel)
    # preprocess and convert_dq only: each lane's 8 features of its row by 16-byte loads and stores
    # (16-bit dtypes, headdim a multiple of 8, threads_per_row = headdim / 8, rows 16-byte aligned)
    vector: bool = False

    def __post_init__(self):
        if self.vector and (self.kernel not in ("preprocess", "convert_dq") or self.dtype == "float32"
                            or self.headdim % 8 or self.threads_per_row != self.headdim // 8):
            raise ValueError(f"vector rows: preprocess or convert_dq, 16-bit elements, headdim a multiple of 8 and "
                             f"headdim / 8 lanes per row, not {self}")

    @property
    def rows(self):
        """The tile rows the block's threads are spread over: key rows for dkdv, else query rows."""
        return self.block_n if self.kernel == "dkdv" else self.block_m

    @property
    def threads(self):
        return self.rows * self.threads_per_row

    @property
    def static_shared_bytes(self):
        return shared_bytes(self.kernel, self.headdim, self.block_m, self.block_n, self.threads_per_row)

    dynamic_shared_bytes = 0  # all tiles are static shared arrays, within the 48 KB every GPU has

    def grid(self, batch, nheads, nheads_k, seqlen_q, seqlen_k):
        if self.kernel == "dkdv":
            return ((seqlen_k + self.block_n - 1) // self.block_n, nheads_k, batch)
        return ((seqlen_q + self.block_m - 1) // self.block_m, nheads, batch)


def shared_bytes(kernel, headdim, block_m, block_n, threads_per_row):
    """Bytes of a kernel's float32 shared arrays (see the module docstring for the padding)."""
    tiles = 2 * (block_m + block_n) * (headdim + 1)  # Q_s, dO_s, K_s, V_s
    if kernel == "dkdv":
        return 4 * (tiles + 2 * block_n * (block_m + 1) + 2 * block_m)
    if kernel == "dq":
        return 4 * (tiles + block_m * (block_n + 1))
    if kernel == "preprocess":
        return 4 * block_m * (threads_per_row + 1)
    return 0


@lru_cache(maxsize=None)
def build_backward_portable(config):
    """Compile-time specialization: returns the ``@cuda.jit`` kernel for ``config``."""
    if config.kernel not in KERNELS:
        raise ValueError(f"config.kernel={config.kernel!r} is not one of {KERNELS}")
    HEADDIM = config.headdim
    hooks = variants.hooks(config.variant)
    key_tiles, query_tiles, row_keys, hidden = hooks.key_tiles, hooks.query_tiles, hooks.row_keys, hooks.hidden
    SCORE, score_grad, head_context = hooks.SCORE, hooks.score_grad, hooks.head_context
    DROPOUT, dropout_factor = hooks.DROPOUT, hooks.dropout_factor
    tile_class = hooks.tile_class  # the block mask's class of a tile pair (FULL without one)
    VARLEN, sequence = hooks.VARLEN, hooks.sequence  # packed sequences: where this block's rows are
    BLOCK_M = config.block_m
    BLOCK_N = config.block_n
    THREADS_PER_ROW = config.threads_per_row
    NUM_THREADS = config.threads
    ATOMIC_DQ = config.atomic_dq
    FEATURES_PER_THREAD = (HEADDIM + THREADS_PER_ROW - 1) // THREADS_PER_ROW
    HEADDIM_PAD = HEADDIM + 1
    BLOCK_M_PAD = BLOCK_M + 1
    BLOCK_N_PAD = BLOCK_N + 1
    THREADS_PER_ROW_PAD = THREADS_PER_ROW + 1
    WHOLE_ROWS = HEADDIM % THREADS_PER_ROW == 0  # every lane's features lie inside the row
    RAW = {"float16": float16, "bfloat16": uint16, "float32": float32}[config.dtype]  # an element as stored
    load, store = element_io(config.dtype)

    # ------------------------------------------------------------------------------------------
    # Helpers: tile operations, each done by the whole block or by the threads of one row
    # ------------------------------------------------------------------------------------------

    load_tile = tile_loader(HEADDIM, NUM_THREADS, load)

    @cuda.jit(device=True, inline=True)
    def lse_log2(lse, batch, head, q_idx, seqlen_q):
        """lse of a query row in base 2, as P's subtrahend; +inf (so P = 0) for a row that sees no
        key (lse = -inf) and for rows past seqlen_q."""
        if q_idx >= seqlen_q:
            return POS_INF
        x = lse[batch, head, q_idx]
        return x * float32(LOG2E) if x != NEG_INF else POS_INF

    @cuda.jit(device=True, inline=True)
    def dot_pair(A_s, a, B_s, b, C_s, c, D_s, d_row):
        """(A_s[a] . B_s[b], C_s[c] . D_s[d_row]) over the head dim: a score and its dP together."""
        s = float32(0.0)
        dp = float32(0.0)
        for d in range(HEADDIM):
            s += A_s[a, d] * B_s[b, d]
            dp += C_s[c, d] * D_s[d_row, d]
        return s, dp

    @cuda.jit(device=True, inline=True)
    def zero(acc):
        for f in range(FEATURES_PER_THREAD):
            acc[f] = float32(0.0)

    @cuda.jit(device=True, inline=True)
    def store_row(dst, batch, idx, head, lane, acc, scale):
        """dst[batch, idx, head, d] = acc * scale for this thread's features d."""
        for f in range(FEATURES_PER_THREAD):
            d = lane + f * THREADS_PER_ROW
            if d < HEADDIM:
                dst[batch, idx, head, d] = store(acc[f] * scale)

    # ------------------------------------------------------------------------------------------
    # Preprocess: D = rowsum(dO * O)
    # ------------------------------------------------------------------------------------------

    @inline_device
    @unroll
    def load_row_pairs(out, dout, batch, q_idx, head, lane, o_raw, do_raw):
        """This thread's features (lane + f THREADS_PER_ROW) of a row of O and of dO, as stored:
        every load goes out before any is used (an in-order warp waits at the first use of a
        load; one or two in flight per thread is far from the bandwidth)."""
        for f in static_range(FEATURES_PER_THREAD):
            d = lane + uint32(f * THREADS_PER_ROW)
            if WHOLE_ROWS or d < uint32(HEADDIM):
                o_raw[f] = out[batch, q_idx, head, d]
                do_raw[f] = dout[batch, q_idx, head, d]

    @cuda.jit(device=True, inline=True)
    def store_delta(partial_s, partial, row, lane, delta, batch, head, q_idx, seqlen_q):
        """D of the block's rows: each lane's partial sum of its row into shared memory, then lane 0
        of each row adds them up."""
        partial_s[row, lane] = partial
        cuda.syncthreads()  # every lane's partial sum of the row is in shared memory
        if lane == 0 and q_idx < seqlen_q:
            total = float32(0.0)
            for i in range(THREADS_PER_ROW):  # a fixed order: D is the same bits on every run
                total += partial_s[row, i]
            delta[batch, head, q_idx] = total

    @cuda.jit(cache=True)  # compiled code is kept on disk (per config) across processes
    def backward_preprocess(out, dout, delta, dq_accum):
        seqlen_q = out.shape[1]
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        row = cuda.threadIdx.x // THREADS_PER_ROW
        lane = uint32(cuda.threadIdx.x % THREADS_PER_ROW)  # unsigned: no negative-index wraparound
        q_idx = cuda.blockIdx.x * BLOCK_M + row
        partial_s = cuda.shared.array((BLOCK_M, THREADS_PER_ROW_PAD), float32)
        o_raw = cuda.local.array(FEATURES_PER_THREAD, RAW)
        do_raw = cuda.local.array(FEATURES_PER_THREAD, RAW)

        partial = float32(0.0)
        if q_idx < seqlen_q:
            load_row_pairs(out, dout, batch, q_idx, head, lane, o_raw, do_raw)
            if ATOMIC_DQ:
                for f in range(FEATURES_PER_THREAD):
                    d = lane + uint32(f * THREADS_PER_ROW)
                    if WHOLE_ROWS or d < uint32(HEADDIM):
                        dq_accum[batch, q_idx, head, d] = float32(0.0)
            for f in range(FEATURES_PER_THREAD):  # a fixed order: D is the same bits on every run
                if WHOLE_ROWS or lane + uint32(f * THREADS_PER_ROW) < uint32(HEADDIM):
                    partial += load(o_raw[f]) * load(do_raw[f])
        store_delta(partial_s, partial, row, lane, delta, batch, head, q_idx, seqlen_q)

    # ------------------------------------------------------------------------------------------
    # dK, dV (and, with atomics, dQ): one block per key/value tile
    # ------------------------------------------------------------------------------------------

    @cuda.jit(device=True, inline=True)
    def probabilities_column(Q_s, dO_s, K_s, V_s, P_s, dS_s, lse_s, D_s, row, lane, k_idx, q_start,
                             seqlen_q, seqlen_k, params, head_ctx, scale_log2, scale, masked):
        """P_s[row, c] = P[c, row] and dS_s[row, c] = dS[c, row] for this thread's query columns c.

        ``row`` is a key row of the tile (key ``k_idx``). Masked entries (keys past seqlen_k, keys
        outside the query's window) get P = dS = 0. With a score feature, dS carries its derivative.
        """
        for i in range(BLOCK_M // THREADS_PER_ROW):
            c = lane + i * THREADS_PER_ROW
            s, dp = dot_pair(Q_s, c, K_s, row, dO_s, c, V_s, row)
            grad = float32(1.0)
            if SCORE:
                x, grad = score_grad(s * scale, q_start + c, k_idx, seqlen_q, seqlen_k, params, head_ctx)
                p = math.exp2(x * float32(LOG2E) - lse_s[c])
            else:
                p = math.exp2(s * scale_log2 - lse_s[c])
            if masked:
                lo, hi = row_keys(q_start + c, seqlen_q, seqlen_k, params)
                if hidden(k_idx, lo, hi, q_start + c, seqlen_q, params, head_ctx):
                    p = float32(0.0)
            if DROPOUT:  # dV takes the dropped P; dP reaches P through the same factor
                factor = dropout_factor(q_start + c, k_idx, params, head_ctx)
                P_s[row, c] = p * factor
                dS_s[row, c] = p * (dp * factor - D_s[c]) * grad
            else:
                P_s[row, c] = p
                dS_s[row, c] = p * (dp - D_s[c]) * grad

    @cuda.jit(device=True, inline=True)
    def accumulate_dkdv(P_s, dS_s, Q_s, dO_s, row, lane, dk_acc, dv_acc):
        """dv_acc += P^T dO and dk_acc += dS^T Q, for this thread's key row and features."""
        for c in range(BLOCK_M):
            p = P_s[row, c]
            ds = dS_s[row, c]
            for f in range(FEATURES_PER_THREAD):
                d = lane + f * THREADS_PER_ROW
                if d < HEADDIM:
                    dv_acc[f] += p * dO_s[c, d]
                    dk_acc[f] += ds * Q_s[c, d]

    @cuda.jit(device=True, inline=True)
    def add_dq_tile(dS_s, K_s, dq_accum, batch, q_start, head, q_rows):
        """dq_accum[Q_i rows] += dS K_j (unscaled), one float32 atomic per element of the tile.

        Consecutive threads take consecutive features of one query row: coalesced atomics.
        """
        for i in range(cuda.threadIdx.x, BLOCK_M * HEADDIM, NUM_THREADS):
            c = i // HEADDIM
            d = i - c * HEADDIM
            if c < q_rows:
                acc = float32(0.0)
                for r in range(BLOCK_N):
                    acc += dS_s[r, c] * K_s[r, d]
                cuda.atomic.add(dq_accum, (batch, q_start + c, head, d), acc)

    @cuda.jit(cache=True)  # compiled code is kept on disk (per config) across processes
    def backward_dkdv(q, k, v, dout, lse, delta, dk, dv, dq_accum, scale_log2, scale, params):
        # dq_accum is only touched with ATOMIC_DQ; otherwise the caller passes any array.
        if VARLEN:  # packed sequences: every array narrowed to this block's sequence (module docstring)
            q_off, seqlen_q, k_off, seqlen_k = sequence(params, cuda.blockIdx.z, q.shape[1], k.shape[1])
            if cuda.blockIdx.x * BLOCK_N >= seqlen_k:
                return  # the whole block: its key tile lies past the sequence's end
            q_end, k_end = q_off + seqlen_q, k_off + seqlen_k
            q, dout, lse, delta = (q[:, q_off:q_end], dout[:, q_off:q_end], lse[:, :, q_off:q_end],
                                   delta[:, :, q_off:q_end])
            k, v, dk, dv = k[:, k_off:k_end], v[:, k_off:k_end], dk[:, k_off:k_end], dv[:, k_off:k_end]
            if ATOMIC_DQ:
                dq_accum = dq_accum[:, q_off:q_end]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        head_k = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        group = q.shape[2] // k.shape[2]  # GQA: the query heads head_k * group ... share this tile
        row = cuda.threadIdx.x // THREADS_PER_ROW
        lane = cuda.threadIdx.x % THREADS_PER_ROW

        k_start = cuda.blockIdx.x * BLOCK_N
        k_rows = min(BLOCK_N, seqlen_k - k_start)
        k_idx = k_start + row

        Q_s = cuda.shared.array((BLOCK_M, HEADDIM_PAD), float32)
        dO_s = cuda.shared.array((BLOCK_M, HEADDIM_PAD), float32)
        K_s = cuda.shared.array((BLOCK_N, HEADDIM_PAD), float32)
        V_s = cuda.shared.array((BLOCK_N, HEADDIM_PAD), float32)
        P_s = cuda.shared.array((BLOCK_N, BLOCK_M_PAD), float32)
        dS_s = cuda.shared.array((BLOCK_N, BLOCK_M_PAD), float32)
        lse_s = cuda.shared.array(BLOCK_M, float32)
        D_s = cuda.shared.array(BLOCK_M, float32)
        dk_acc = cuda.local.array(FEATURES_PER_THREAD, float32)
        dv_acc = cuda.local.array(FEATURES_PER_THREAD, float32)
        zero(dk_acc)
        zero(dv_acc)

        # ---- Which query tiles see this key tile (geometry.py) ----------------------------------
        # Tiles [first_tile, end_tile) hold a query that sees one of its keys; [first_full,
        # end_full) see all of them. The last key tile always masks its rows past seqlen_k.
        first_tile, first_full, end_full, end_tile = query_tiles(
            k_start, k_start + k_rows, seqlen_q, seqlen_k, params, BLOCK_M)
        tail = k_rows < BLOCK_N

        # ---- Load K_j, V_j once -------------------------------------------------------------------
        load_tile(k, batch, k_start, head_k, k_rows, K_s, float32(1.0))
        load_tile(v, batch, k_start, head_k, k_rows, V_s, float32(1.0))

        # ---- Loop over the query heads of the group, and over their Q_i, dO_i -------------------
        for head in range(head_k * group, head_k * group + group):
            head_ctx = head_context(params, batch, head)  # (b, h, ALiBi slope): what the variant reads per head
            for i in range(first_tile, end_tile):
                tile = tile_class(params, batch, head, i, cuda.blockIdx.x)
                if tile == variants.EMPTY:  # the block mask keeps nothing here (the same for the whole block)
                    continue
                q_start = i * BLOCK_M
                q_rows = min(BLOCK_M, seqlen_q - q_start)
                load_tile(q, batch, q_start, head, q_rows, Q_s, float32(1.0))
                load_tile(dout, batch, q_start, head, q_rows, dO_s, float32(1.0))
                for c in range(cuda.threadIdx.x, BLOCK_M, NUM_THREADS):
                    lse_s[c] = lse_log2(lse, batch, head, q_start + c, seqlen_q)
                    D_s[c] = delta[batch, head, q_start + c] if c < q_rows else float32(0.0)
                cuda.syncthreads()  # Q_i, dO_i, lse, D (and K_j, V_j on the first pass) have landed

                masked = tail or i < first_full or i >= end_full
                if tile == variants.PARTIAL:
                    masked = True
                probabilities_column(Q_s, dO_s, K_s, V_s, P_s, dS_s, lse_s, D_s, row, lane, k_idx,
                                     q_start, seqlen_q, seqlen_k, params, head_ctx, scale_log2, scale, masked)
                cuda.syncthreads()  # P^T and dS^T rows, written by all their threads, are complete

                accumulate_dkdv(P_s, dS_s, Q_s, dO_s, row, lane, dk_acc, dv_acc)
                if ATOMIC_DQ:
                    add_dq_tile(dS_s, K_s, dq_accum, batch, q_start, head, q_rows)
                cuda.syncthreads()  # everyone is done with Q_s, dO_s, P_s, dS_s before the next tile

        # ---- Write dK_j, dV_j (keys no query sees get 0) -----------------------------------------
        if k_idx < seqlen_k:
            store_row(dk, batch, k_idx, head_k, lane, dk_acc, scale)
            store_row(dv, batch, k_idx, head_k, lane, dv_acc, float32(1.0))

    # ------------------------------------------------------------------------------------------
    # Deterministic dQ: one block per query tile, looping over the key tiles
    # ------------------------------------------------------------------------------------------

    @cuda.jit(device=True, inline=True)
    def ds_row(Q_s, dO_s, K_s, V_s, dS_s, row, lane, q_idx, k_start, key_lo, key_hi, lse_row, delta_row,
               seqlen_q, seqlen_k, params, head_ctx, scale_log2, scale, masked):
        """dS_s[row, c] = P * (dP - D) for this thread's key columns c (times the score features'
        derivative); 0 where masked (query q_idx sees the keys key_lo <= key < key_hi)."""
        for i in range(BLOCK_N // THREADS_PER_ROW):
            c = lane + i * THREADS_PER_ROW
            s, dp = dot_pair(Q_s, row, K_s, c, dO_s, row, V_s, c)
            grad = float32(1.0)
            if SCORE:
                x, grad = score_grad(s * scale, q_idx, k_start + c, seqlen_q, seqlen_k, params, head_ctx)
                p = math.exp2(x * float32(LOG2E) - lse_row)
            else:
                p = math.exp2(s * scale_log2 - lse_row)
            if masked:
                if hidden(k_start + c, key_lo, key_hi, q_idx, seqlen_q, params, head_ctx):
                    p = float32(0.0)
            if DROPOUT:
                dp *= dropout_factor(q_idx, k_start + c, params, head_ctx)
            dS_s[row, c] = p * (dp - delta_row) * grad

    @cuda.jit(device=True, inline=True)
    def accumulate_dq(dS_s, K_s, row, lane, dq_acc):
        """dq_acc += dS K_j for this thread's query row and features."""
        for c in range(BLOCK_N):
            ds = dS_s[row, c]
            for f in range(FEATURES_PER_THREAD):
                d = lane + f * THREADS_PER_ROW
                if d < HEADDIM:
                    dq_acc[f] += ds * K_s[c, d]

    @cuda.jit(cache=True)  # compiled code is kept on disk (per config) across processes
    def backward_dq(q, k, v, dout, lse, delta, dq, scale_log2, scale, params):
        if VARLEN:  # packed sequences: every array narrowed to this block's sequence (module docstring)
            q_off, seqlen_q, k_off, seqlen_k = sequence(params, cuda.blockIdx.z, q.shape[1], k.shape[1])
            if cuda.blockIdx.x * BLOCK_M >= seqlen_q:
                return  # the whole block: its query tile lies past the sequence's end
            q_end, k_end = q_off + seqlen_q, k_off + seqlen_k
            q, dout, lse, delta, dq = (q[:, q_off:q_end], dout[:, q_off:q_end], lse[:, :, q_off:q_end],
                                       delta[:, :, q_off:q_end], dq[:, q_off:q_end])
            k, v = k[:, k_off:k_end], v[:, k_off:k_end]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        head_k = head // (q.shape[2] // k.shape[2])
        row = cuda.threadIdx.x // THREADS_PER_ROW
        lane = cuda.threadIdx.x % THREADS_PER_ROW

        q_start = cuda.blockIdx.x * BLOCK_M
        q_idx = q_start + row
        q_rows = min(BLOCK_M, seqlen_q - q_start)
        key_lo, key_hi = row_keys(q_idx, seqlen_q, seqlen_k, params)  # the keys this row sees
        head_ctx = head_context(params, batch, head)  # (b, h, ALiBi slope): what the variant reads per head
        lse_row = lse_log2(lse, batch, head, q_idx, seqlen_q)
        delta_row = delta[batch, head, q_idx] if q_idx < seqlen_q else float32(0.0)

        Q_s = cuda.shared.array((BLOCK_M, HEADDIM_PAD), float32)
        dO_s = cuda.shared.array((BLOCK_M, HEADDIM_PAD), float32)
        K_s = cuda.shared.array((BLOCK_N, HEADDIM_PAD), float32)
        V_s = cuda.shared.array((BLOCK_N, HEADDIM_PAD), float32)
        dS_s = cuda.shared.array((BLOCK_M, BLOCK_N_PAD), float32)
        dq_acc = cuda.local.array(FEATURES_PER_THREAD, float32)
        zero(dq_acc)

        # ---- Which key tiles this query tile visits (geometry.py, as in the forward) ------------
        first_tile, first_full, end_full, end_tile = key_tiles(
            q_start, q_start + q_rows, seqlen_q, seqlen_k, params, BLOCK_N)

        # ---- Load Q_i, dO_i once -----------------------------------------------------------------
        load_tile(q, batch, q_start, head, q_rows, Q_s, float32(1.0))
        load_tile(dout, batch, q_start, head, q_rows, dO_s, float32(1.0))

        # ---- Loop over K_j, V_j ------------------------------------------------------------------
        for j in range(first_tile, end_tile):
            tile = tile_class(params, batch, head, cuda.blockIdx.x, j)
            if tile == variants.EMPTY:  # the block mask keeps nothing here (the same for the whole block)
                continue
            k_start = j * BLOCK_N
            k_rows = min(BLOCK_N, seqlen_k - k_start)
            load_tile(k, batch, k_start, head_k, k_rows, K_s, float32(1.0))
            load_tile(v, batch, k_start, head_k, k_rows, V_s, float32(1.0))
            cuda.syncthreads()  # K_j, V_j (and Q_i, dO_i on the first pass) are in shared memory

            masked = j < first_full or j >= end_full or tile == variants.PARTIAL
            ds_row(Q_s, dO_s, K_s, V_s, dS_s, row, lane, q_idx, k_start, key_lo, key_hi, lse_row,
                   delta_row, seqlen_q, seqlen_k, params, head_ctx, scale_log2, scale, masked)
            cuda.syncthreads()  # the row's dS, written by all its threads, is complete

            accumulate_dq(dS_s, K_s, row, lane, dq_acc)
            cuda.syncthreads()  # everyone is done with K_s, V_s, dS_s before the next tile lands

        # ---- Write dQ_i (rows that see no key get 0) ---------------------------------------------
        if q_idx < seqlen_q:
            store_row(dq, batch, q_idx, head, lane, dq_acc, scale)

    # ------------------------------------------------------------------------------------------
    # dq = dq_accum * scale, in the input dtype
    # ------------------------------------------------------------------------------------------

    @inline_device
    @unroll
    def convert_row(dq_accum, dq, batch, q_idx, head, lane, values, scale):
        """dq = dq_accum * scale on this thread's features (lane + f THREADS_PER_ROW) of a row,
        in the input dtype; every load goes out before the first store (with one load in flight
        per thread, the conversion ran at 0.37x of the copy bandwidth on the H200)."""
        for f in static_range(FEATURES_PER_THREAD):
            d = lane + uint32(f * THREADS_PER_ROW)
            if WHOLE_ROWS or d < uint32(HEADDIM):
                values[f] = dq_accum[batch, q_idx, head, d]
        for f in static_range(FEATURES_PER_THREAD):
            d = lane + uint32(f * THREADS_PER_ROW)
            if WHOLE_ROWS or d < uint32(HEADDIM):
                dq[batch, q_idx, head, d] = store(values[f] * scale)

    @cuda.jit(cache=True)  # compiled code is kept on disk (per config) across processes
    def backward_convert_dq(dq_accum, dq, scale):
        # the preprocess's threads: THREADS_PER_ROW lanes per query row
        seqlen_q = dq.shape[1]
        row = cuda.threadIdx.x // THREADS_PER_ROW
        lane = uint32(cuda.threadIdx.x % THREADS_PER_ROW)  # unsigned: no negative-index wraparound
        q_idx = cuda.blockIdx.x * BLOCK_M + row
        values = cuda.local.array(FEATURES_PER_THREAD, float32)
        if q_idx < seqlen_q:
            convert_row(dq_accum, dq, cuda.blockIdx.z, q_idx, cuda.blockIdx.y, lane, values, scale)

    # ------------------------------------------------------------------------------------------
    # The two row-wise kernels by 16-byte accesses (``vector``): lane l owns features 8 l .. 8 l + 7
    # of its row, one 16-byte load of O and one of dO (four packed pairs each), two 16-byte stores
    # of dq_accum's zeros; the conversion reads 32 bytes of dq_accum and stores 16 of dq. The
    # scalar forms above issue 2- and 4-byte accesses, 8 lanes a row (0.6-0.75x of the copy
    # bandwidth on the H200: docs/perf-notes.md, "Hopper backward", step 12).
    # ------------------------------------------------------------------------------------------

    unpack = unpack_f16x2 if config.dtype == "float16" else unpack_bf16x2
    pack = pack_f16x2 if config.dtype == "float16" else pack_bf16x2

    @inline_device
    @unroll
    def dot_packed(o, do):
        """o . do over a lane's eight features, each four uint32 of packed 16-bit pairs; a fixed
        order, so D is the same bits on every run."""
        partial = float32(0.0)
        for w in static_range(4):
            o_lo, o_hi = unpack(o[w])
            do_lo, do_hi = unpack(do[w])
            partial += o_lo * do_lo
            partial += o_hi * do_hi
        return partial

    @cuda.jit(cache=True)  # compiled code is kept on disk (per config) across processes
    def backward_preprocess_vector(out, dout, delta, dq_accum):
        seqlen_q = out.shape[1]
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        row = cuda.threadIdx.x // THREADS_PER_ROW
        lane = cuda.threadIdx.x % THREADS_PER_ROW
        q_idx = cuda.blockIdx.x * BLOCK_M + row
        partial_s = cuda.shared.array((BLOCK_M, THREADS_PER_ROW_PAD), float32)

        partial = float32(0.0)
        if q_idx < seqlen_q:
            o = load_u32x4_nc(global_address(out, batch, q_idx, head, 8 * lane))
            do = load_u32x4_nc(global_address(dout, batch, q_idx, head, 8 * lane))
            if ATOMIC_DQ:
                zeros = global_address(dq_accum, batch, q_idx, head, 8 * lane)
                store_u32x4(zeros, uint32(0), uint32(0), uint32(0), uint32(0))
                store_u32x4(zeros + 16, uint32(0), uint32(0), uint32(0), uint32(0))
            partial = dot_packed(o, do)
        store_delta(partial_s, partial, row, lane, delta, batch, head, q_idx, seqlen_q)

    @cuda.jit(cache=True)  # compiled code is kept on disk (per config) across processes
    def backward_convert_dq_vector(dq_accum, dq, scale):
        seqlen_q = dq.shape[1]
        row = cuda.threadIdx.x // THREADS_PER_ROW
        lane = cuda.threadIdx.x % THREADS_PER_ROW
        q_idx = cuda.blockIdx.x * BLOCK_M + row
        if q_idx < seqlen_q:
            batch, head = cuda.blockIdx.z, cuda.blockIdx.y
            accumulated = global_address(dq_accum, batch, q_idx, head, 8 * lane)
            a = load_u32x4_nc(accumulated)  # features 8 lane .. + 3
            b = load_u32x4_nc(accumulated + 16)  # ... + 4 .. + 7
            store_u32x4(global_address(dq, batch, q_idx, head, 8 * lane),
                        pack(u32_as_f32(a[0]) * scale, u32_as_f32(a[1]) * scale),
                        pack(u32_as_f32(a[2]) * scale, u32_as_f32(a[3]) * scale),
                        pack(u32_as_f32(b[0]) * scale, u32_as_f32(b[1]) * scale),
                        pack(u32_as_f32(b[2]) * scale, u32_as_f32(b[3]) * scale))

    if config.vector:
        return {"preprocess": backward_preprocess_vector, "convert_dq": backward_convert_dq_vector}[config.kernel]
    return {
        "preprocess": backward_preprocess,
        "dkdv": backward_dkdv,
        "dq": backward_dq,
        "convert_dq": backward_convert_dq,
    }[config.kernel]
