"""FlashAttention backward on Hopper (sm_90a): the deterministic dQ pass, on wgmma and TMA, warp-specialized.

The deterministic backward (``deterministic=True``) runs dK/dV without atomics and this kernel for
dQ: each query tile's dQ_i is summed in registers over the key tiles in a fixed order and written
once, so a run is bit-identical to the last. The algorithm is backward_mma.py's ``dq`` kernel (the
paper's Algorithm 2 with the loops swapped for dQ: read that file first), with the Hopper
forward's machinery (forward_sm90.py: the producer warpgroup, the K/V mbarrier ring, TMA's
swizzled tiles, wgmma's accumulator layout). Per (batch, head), with D = rowsum(dO * O) from the
preprocess::

    for each block of block_m query rows (one thread block):
        producer warpgroup (one elected thread):
            Q_i, dO_i -> shared memory (TMA), once, completing on q_full
            for the i-th key tile j the rows see (j = first_tile + i): wait until ring slot
                i % stages is empty, then K_j, V_j -> the slot (TMA), completing on k_full / v_full
        each consumer warpgroup (64 query rows of the block):
            lse_log2, D of the thread's two rows (registers, read once); dQ = 0 (registers)
            for the i-th key tile j (slot i % stages), once K_j and V_j have landed:
                S = Q_i K_j^T,  dP = dO_i V_j^T            (wgmma, both operands in shared memory)
                P = exp2(S * scale_log2 - lse_log2[row])      (0 where masked: only on tiles that
                                       cross the window's edges or the tail; while dP is in flight)
                dS = P * (dP - D[row])
                dQ += dS K_j                            (wgmma, dS packed to 16 bit in registers)
                arrive on the slot's empty barrier (the producer may refill it)
            dq = dQ * scale

This is the forward's loop with dP in place of the online softmax and dS K_j in place of P V_j:
the row statistics are final (the forward's lse), so nothing is rescaled. S and dP are
64 x block_n accumulators of the same wgmma (K_j and V_j both read K-major, keys by headdim); dS,
in the accumulator layout, packs pair by pair into the A registers of dQ's k16 steps, exactly as
the forward packs P; K_j is then read MN-major (keys by headdim, headdim contiguous), as the
forward reads V_j. So dS never leaves the registers and no thread copies or re-lays a tile.

Grid and threads: grid = (ceil(seqlen_q / block_m), nheads, batch); block = 128 * (consumers + 1)
threads; block_m = 64 * consumers. Warpgroup 0 is the producer (it lowers its register cap with
setmaxnreg, the consumers raise theirs); warpgroup 1 + c owns query rows [64 c, 64 c + 64) of the
block's tile. With a window (causal is the window (-1, 0)) blockIdx.x is reversed so the query
blocks with the most keys start first.

Registers (the wgmma accumulator layout, nbflash/primitives_sm90.py): thread t of a consumer
warpgroup (w = warp in the group, g = lane // 4, q4 = lane % 4) holds, of each 64-row accumulator,
rows 16 w + g (registers 4 c + e) and 16 w + g + 8 (registers 4 c + 2 + e), columns 8 c + 2 q4 + e.
Per thread: S and dP (block_n / 2 each), dQ (headdim padded / 2), the packed dS (block_n / 4).

Shared memory (dynamic, 16-bit elements, every tile 1024-byte aligned): the Q and dO tiles, the
ring of K tiles, the ring of V tiles, then the mbarriers. A tile is stored as its 64-column chunks
(headdim padded to a multiple of 64 by TMA's zero fill), rows of 128 bytes in the 128-byte swizzle,
as in forward_sm90.py.

Memory: q, dout (batch, seqlen_q, nheads, headdim), k, v (batch, seqlen_k, nheads_k, headdim), any
strides that are multiples of 16 bytes with the last dimension contiguous, headdim a multiple of 8
up to 256 (past 128 with key tiles small enough that S, dP, dS and dQ keep fitting the registers:
``MAX_ACCUMULATOR_WORDS``, configs.SM90_DQ); float16 arrays, or uint16 arrays holding bfloat16 bits.
lse (natural log), delta float32 (batch, nheads, seqlen_q); dq like q (C-contiguous), written in q's
dtype. ``maps`` holds the four 4-D tensor maps of q, k, v and dout (backward_sm90.tensor_maps),
built by the launcher; rows past a sequence's end and columns past headdim arrive as zeros. Query
head h reads key/value head h // (nheads // nheads_k). A row with lse = -inf (it sees no key) and
rows past seqlen_q get lse_log2 = +inf, so their P is exactly 0 and a row that sees no key gets
dq = 0.

Variants: the window (causal included) through the hooks' tile ranges and mask test, as the
forward's. The score features (softcap, ALiBi, bias), the element masks (mask tensor, mask_mod: no
tile is then seen whole, so every tile is masked), a score_mod (with its score_mod_grad, as the
score point's derivative) and dropout (the forward's Philox words, as backward_mma.py's dq kernel
reads them: the same elements a lane in both layouts) make P and dS in one pass once dP has landed
(``feature_gradients``: P from the score point of the raw S, dS times the score's derivative and dP
times dropout's factor, lse less the features' offset). Packed sequences: the packed q, k, v, dout
(and lse, delta, dq) come as a batch of one, and each block row b finds sequence b's first rows and
lengths (``Hooks.sequence``): TMA reads from those rows (a tile past the sequence's end reads the
next sequence's rows, or zeros past the arrays' end, which the row and key masks keep out of dq),
lse, delta and dq are narrowed to the sequence, and a block whose query tile lies past the
sequence's end exits at once. A block mask: the producer and the consumers walk the key tiles the
query tile visits (``Hooks.visit_key_tile``, as the forwards do), EMPTY ones skipped, and FULL ones
not masked; its table is classified for this kernel's tiles (block_mask.kernel_params).

Its GPU tests pass at headdims up to 256 with every variant, on packed sequences and with block
masks (bit-identical reruns included). It is planned by default for plain and windowed attention
with deterministic=True at headdims 16-256 (configs.SM90_DETERMINISTIC_DEFAULT_HEADDIMS) and
without it past 128 (configs.SM90_PAIR_DEFAULT_HEADDIMS, where this second pass beats the wide
kernel's dQ atomics); with the other variants only when "sm90" is forced (not yet timed with them).
"""

import math
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda, float32, int32, uint32, uint64

from nbflash.primitives import (
    exp2_approx,
    inline_device,
    shared_address,
    static_range,
    unroll,
)
from nbflash.primitives_sm90 import (
    SWIZZLE_128B,
    array_address,
    elect_sync,
    fence_mbarrier_init,
    fence_operands,
    fence_proxy_tensormap_acquire,
    k_step,
    launch_bounded,
    make_wgmma_rs,
    make_wgmma_ss,
    mbarrier_arrive,
    mbarrier_arrive_expect_tx,
    mbarrier_init,
    mbarrier_wait,
    registers_from,
    registers_to,
    setmaxnreg_dec,
    setmaxnreg_inc,
    smem_descriptor,
    tile_base,
    tma_load_4d,
    warpgroup_index,
    wgmma_commit,
    wgmma_fence,
    wgmma_wait,
)
from nbflash.problem import Variant

from . import variants
from .backward_mma import make_score_gradient
from .backward_sm90 import Sm90BackwardBlock, make_pack_a, make_store_rows
from .forward_sm90 import CHUNK, GROUP, ROW_BYTES

LOG2E = math.log2(math.e)
MAX_HEADDIM = 256
# S, dP (block_n / 2 registers a thread each), the packed dS (block_n / 4) and dQ (headdim_padded / 2)
# of 64 rows live in a consumer's registers together: at most this many words of them (ptxas 13.5,
# sm_90a, no spills: headdim 128 with 128-key tiles under the 232 cap, 224 words; headdim 256 with
# 32-key tiles and two consumers, 168; with 64-key tiles and one consumer, 208, in 224-242 registers)
MAX_ACCUMULATOR_WORDS = 224
@dataclass(frozen=True)
class Sm90DqConfig(Sm90BackwardBlock):
    """One compiled variant of the Hopper deterministic dQ kernel (the backward's preprocess is the
    portable family's; dK/dV come from a kernel without atomics)."""

    dtype: str  # 'float16' or 'bfloat16'
    headdim: int  # a multiple of 8, at most 256 (past 128 with smaller key tiles: MAX_ACCUMULATOR_WORDS)
    variant: Variant = Variant()
    block_n: int = 128  # keys per K/V tile
    stages: int = 2  # K/V tiles in flight (the ring)
    consumers: int = 2  # consumer warpgroups of 64 query rows: block_m = 64 * consumers
    producer_registers: int = 40  # setmaxnreg caps with two consumers (the register file: 64K)
    consumer_registers: int = 232
    kernel = "dq"  # the backward's plan reads it (one kernel of the three)
    atomic_dq = False  # dQ is written once per query tile: a fixed order, no atomics
    varlen_batch_of_one = True  # packed sequences: the packed arrays as a batch of one (nbflash/varlen.py)

    def __post_init__(self):
        self.check_dtype_headdim(8, MAX_HEADDIM)
        if self.block_n % 16 or not 16 <= self.block_n <= 256:
            raise ValueError(f"{self.block_n=} must be a multiple of 16 in 16..256 (a TMA box and a wgmma n)")
        if self.consumers not in (1, 2):
            raise ValueError(f"{self.consumers=} must be 1 or 2")
        words = self.headdim_padded // 2 + self.block_n + self.block_n // 4
        if words > MAX_ACCUMULATOR_WORDS:
            raise ValueError(f"{self.block_n=} at headdim {self.headdim}: S, dP, dS and dQ would take {words} "
                             f"registers a thread, more than {MAX_ACCUMULATOR_WORDS}: smaller key tiles")
        self.check_block()

    @property
    def block_m(self):
        return 64 * self.consumers

    @property
    def dynamic_shared_bytes(self):
        """The tiles, the 1 + 3 stages mbarriers, and 1024 bytes of slack to align the tiles."""
        return 1024 + 2 * self.q_bytes + 2 * self.stages * self.kv_bytes + 8 * (1 + 3 * self.stages)

    def grid(self, batch, nheads, nheads_k, seqlen_q, seqlen_k):
        return (-(-seqlen_q // self.block_m), nheads, batch)


@lru_cache(maxsize=None)
def build_backward_dq_sm90(config: Sm90DqConfig):
    """Compile-time constants of ``config`` captured in a fresh ``@cuda.jit`` kernel."""
    BM, BN, HD, HDP = config.block_m, config.block_n, config.headdim, config.headdim_padded
    CONSUMERS, STAGES, THREADS = config.consumers, config.stages, config.threads
    CHUNKS = HDP // CHUNK
    Q_BYTES, KV_BYTES = config.q_bytes, config.kv_bytes
    Q_CHUNK_BYTES, KV_CHUNK_BYTES = BM * ROW_BYTES, BN * ROW_BYTES
    HD_STEPS = HDP // 16  # k16 steps over headdim (S, dP)
    KEY_STEPS = BN // 16  # k16 steps over a key tile (dQ)
    S_REGS, DQ_REGS, DS_REGS = BN // 2, HDP // 2, BN // 4  # per thread: S (dP), dQ, packed dS
    NT = BN // 8  # 8-column groups of S
    EMPTY_ARRIVALS = CONSUMERS * GROUP  # every consumer thread releases a slot
    SPLIT_REGISTERS = CONSUMERS == 2  # with one consumer the entry cap already suffices
    PRODUCER_REGS, CONSUMER_REGS = config.producer_registers, config.consumer_registers
    hooks = variants.hooks(config.variant)
    WINDOW, key_tiles, row_keys, hidden = hooks.WINDOW, hooks.key_tiles, hooks.row_keys, hooks.hidden
    head_context = hooks.head_context
    VARLEN, sequence = hooks.VARLEN, hooks.sequence  # packed sequences: where this block's rows are
    # a block mask: the producer and the consumers walk the same visited key tiles (the forwards')
    tile_class, visit_key_tile, visited_key_tiles = hooks.tile_class, hooks.visit_key_tile, hooks.visited_key_tiles
    # the score features (softcap, ALiBi, bias, score_mod) and dropout: P and dS in one pass once dP has
    # landed, as backward_mma.py's dq kernel makes them (``FEATURES``); the others overlap P with dP
    SCORE, DROPOUT = hooks.SCORE, hooks.DROPOUT
    FEATURES = SCORE or DROPOUT
    score_units, score_row = hooks.tensor_core_score(False)[:2]
    dropout_words = hooks.dropout_words
    score_gradient = make_score_gradient(hooks)  # one element of dS, as backward_mma.py's dq kernel
    NEG_INF, POS_INF = float32(-math.inf), float32(math.inf)
    IS_F16 = config.dtype == "float16"
    AB = "f16" if IS_F16 else "bf16"
    wgmma_scores = make_wgmma_ss(BN, AB, 0)  # S (64 x BN) = Q K^T and dP = dO V^T, all K-major
    wgmma_dq = make_wgmma_rs(HDP, AB, 1)  # dQ (64 x HDP) += dS (registers) K (keys x HDP, MN-major)
    # Descriptor strides (bytes): K-major 128B swizzle, 8-row groups 1024 apart (LBO unused: 16);
    # K MN-major, 8-key groups 1024 apart, 64-column chunks a tile chunk apart.
    K_MAJOR = (16, 1024)
    K_MN_MAJOR = (KV_CHUNK_BYTES, 1024)
    STEP16 = 16 * ROW_BYTES >> 4  # descriptor increment of a k16 step of an MN-major tile: 16 rows
    pack_ds = make_pack_a(config.dtype, DS_REGS)  # dS's A registers
    store_rows = make_store_rows(config.dtype, HD, HDP)  # dq

    # -----------------------------------------------------------------------------------------------
    # Tile addresses: a k16 step of a K-major tile is 32 bytes inside a 128-byte row, and the next
    # chunk after 4 steps; a k16 step of MN-major K (16 keys) is 16 rows of 128 bytes.
    # -----------------------------------------------------------------------------------------------

    @inline_device
    def key_major_descriptor(ring, slot):
        """K_j or V_j as the B of S or dP: keys by headdim, K-major."""
        return smem_descriptor(ring + uint32(slot * KV_BYTES), K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)

    @inline_device
    def k_mn_descriptor(k_ring, slot):
        """K_j as the B of dQ: keys (the k of the product) by headdim, MN-major."""
        return smem_descriptor(k_ring + uint32(slot * KV_BYTES), K_MN_MAJOR[0], K_MN_MAJOR[1], SWIZZLE_128B)

    # -----------------------------------------------------------------------------------------------
    # Consumer tile operations, on the thread's registers (local arrays indexed by constants)
    # -----------------------------------------------------------------------------------------------

    @inline_device
    @unroll
    def issue_scores(acc, desc_a, desc_b):
        """acc = A B^T over headdim (S = Q_i K_j^T or dP = dO_i V_j^T), one commit group."""
        for kk in static_range(HD_STEPS):
            acc = wgmma_scores(acc, desc_a + k_step(Q_CHUNK_BYTES, kk), desc_b + k_step(KV_CHUNK_BYTES, kk),
                               uint32(0 if kk == 0 else 1))
        wgmma_commit()
        return acc

    @inline_device
    @unroll
    def issue_dq(acc, ds_regs, desc_k):
        """dQ += dS K_j, dS from registers (k16 step ks: registers 4 ks .. 4 ks + 3), one commit group."""
        for ks in static_range(KEY_STEPS):
            acc = wgmma_dq(acc, ds_regs[4 * ks], ds_regs[4 * ks + 1], ds_regs[4 * ks + 2], ds_regs[4 * ks + 3],
                           desc_k + uint64(ks * STEP16), uint32(1))
        wgmma_commit()
        return acc

    @inline_device
    def row_stats(lse, delta, b, h, row, seqlen_q):
        """(lse_log2, D) of a query row: lse in base 2, P's subtrahend, +inf (P = 0) for a row that
        sees no key (lse = -inf) and for rows past seqlen_q; D = 0 there."""
        if row >= seqlen_q:
            return POS_INF, float32(0)
        x = lse[b, h, row]
        return (x * float32(LOG2E) if x != NEG_INF else POS_INF), delta[b, h, row]

    @inline_device
    @unroll
    def probabilities(s, lse_row, row0, n_start, seqlen_q, seqlen_k, params, head_ctx, scale_log2, q4, masked):
        """S -> P = exp2(S * scale_log2 - lse_log2[row]) in place, for the thread's rows row0 and
        row0 + 8 and its key columns n_start + 8 c + 2 q4 + e; with ``masked`` (a constant at each
        call site) P = 0 where the row does not see the key (past the end, or outside its window)."""
        for rh in static_range(2):
            row = row0 + 8 * rh
            lo, hi = row_keys(row, seqlen_q, seqlen_k, params)  # used by the masked copy
            for c in static_range(NT):
                for e in static_range(2):
                    r = 4 * c + 2 * rh + e
                    p = exp2_approx(s[r] * scale_log2 - lse_row[rh])
                    if masked:
                        if hidden(n_start + 8 * c + 2 * q4 + e, lo, hi, row, seqlen_q, params, head_ctx):
                            p = float32(0)
                    s[r] = p

    @inline_device
    @unroll
    def score_gradients(p, dp, d_row):
        """dP -> dS = P (dP - D[row]) in place (P = 0 where masked gives dS = 0)."""
        for rh in static_range(2):
            for c in static_range(NT):
                for e in static_range(2):
                    r = 4 * c + 2 * rh + e
                    dp[r] = p[r] * (dp[r] - d_row[rh])

    @inline_device
    @unroll
    def feature_gradients(s, dp, lse_row, d_row, row0, n_start, seqlen_q, seqlen_k, params, head_ctx, scale_log2,
                          units, q4, masked):
        """With score features or dropout: dP -> dS = P (dP * factor - D[row]) * d score / d S in place,
        P = exp2(score(S) - lse_log2[row]) (0 where masked, ``masked`` a constant at each call site),
        factor dropout's keep_scale or 0, for the thread's rows row0 and row0 + 8 and key columns
        n_start + 8 c + 2 q4 + e (backward_mma.py's ``softmax_grad`` in wgmma's layout, the same
        elements a lane: rows g and g + 8 of its warp's 16, columns 2 q4 + e of each 8)."""
        ctx = (score_row(row0, n_start + 2 * q4, seqlen_q, seqlen_k, params, head_ctx, units),
               score_row(row0 + 8, n_start + 2 * q4, seqlen_q, seqlen_k, params, head_ctx, units))
        for c in static_range(NT):
            if c % 4 == 0:  # dropout's words of both rows by keys 2 q4, 2 q4 + 1 of this group of 8
                # columns and the next three: one Philox call (constants without dropout)
                drop = dropout_words(row0, n_start + 8 * c + 2 * q4, params, head_ctx)
            for rh in static_range(2):
                row = row0 + 8 * rh
                lo, hi = row_keys(row, seqlen_q, seqlen_k, params)  # used by the masked copy
                for e in static_range(2):
                    r = 4 * c + 2 * rh + e
                    dp[r] = score_gradient(s[r], dp[r], ctx[rh], 8 * c + e, lse_row[rh], d_row[rh],
                                           n_start + 8 * c + 2 * q4 + e, lo, hi, row, seqlen_q, seqlen_k, params,
                                           head_ctx, scale_log2, units, drop[c % 4], 2 * rh + e, masked)

    # -----------------------------------------------------------------------------------------------
    # The kernel
    # -----------------------------------------------------------------------------------------------

    @launch_bounded(THREADS, 1)
    @unroll
    def backward_dq_sm90(q, k, v, dout, lse, delta, dq, maps, scale_log2, scale, params):
        m_block, h, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        if WINDOW:  # the last query blocks see the most keys (causal): start them first
            m_block = cuda.gridDim.x - 1 - m_block
        tid = cuda.threadIdx.x
        group = warpgroup_index(tid)  # 0: the producer; 1 + c: consumer c
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        hk = h // (q.shape[2] // k.shape[2])  # GQA: the key/value head this query head reads
        m_start = m_block * BM
        mem_b, q_row0, k_row0 = b, 0, 0  # where the rows of Q_i, K_j in memory start (TMA's coordinates)
        if VARLEN:  # packed sequences: sequence b's rows of the packed arrays, a batch of one
            q_first, q_rows, k_first, k_rows = sequence(params, b, seqlen_q, seqlen_k)
            q_row0, seqlen_q, k_row0, seqlen_k = int32(q_first), int32(q_rows), int32(k_first), int32(k_rows)
            mem_b = 0
            if m_start >= seqlen_q:
                return  # the whole block (before any barrier): its query tile lies past the sequence's end
            lse = lse[:, :, q_row0:q_row0 + seqlen_q]  # the rows read and written by index: this sequence's
            delta = delta[:, :, q_row0:q_row0 + seqlen_q]
            dq = dq[:, q_row0:q_row0 + seqlen_q]

        # Shared memory: tiles from the first 1024-byte boundary (tile_base), then the barriers.
        smem = cuda.shared.array(0, uint32)
        base = tile_base(shared_address(smem))
        q_tile = base
        do_tile = q_tile + uint32(Q_BYTES)
        k_ring = do_tile + uint32(Q_BYTES)
        v_ring = k_ring + uint32(STAGES * KV_BYTES)
        q_full = v_ring + uint32(STAGES * KV_BYTES)
        k_full = q_full + uint32(8)  # + 8 * slot
        v_full = k_full + uint32(8 * STAGES)
        kv_empty = v_full + uint32(8 * STAGES)

        # ---- Which key tiles this block visits (geometry.py, as in the forward): tiles
        # [first_tile, end_tile), of which [first_full, end_full) every row sees whole ----
        first_tile, first_full, end_full, end_tile = key_tiles(
            m_start, min(m_start + BM, seqlen_q), seqlen_q, seqlen_k, params, BN)
        n_tiles = visited_key_tiles(params, b, h, m_block, first_tile, end_tile)  # end - first without a block mask

        if tid == 0:
            mbarrier_init(q_full, 1)
            for slot in range(STAGES):
                mbarrier_init(k_full + uint32(8 * slot), 1)
                mbarrier_init(v_full + uint32(8 * slot), 1)
                mbarrier_init(kv_empty + uint32(8 * slot), EMPTY_ARRIVALS)
            fence_mbarrier_init()
        cuda.syncthreads()  # the barriers are initialised before anyone arrives on or waits for them

        if group == 0:
            # ---- Producer: one thread issues every copy; the ring's empty barriers pace it. A block
            # whose rows see no key copies nothing (its consumers write dq = 0) ----
            if SPLIT_REGISTERS:
                setmaxnreg_dec(PRODUCER_REGS)
            if tid < 32 and n_tiles > 0:
                if elect_sync() == uint32(1):
                    maps_address = array_address(maps)
                    q_map, k_map, v_map, do_map = (maps_address, maps_address + 128, maps_address + 256,
                                                   maps_address + 384)
                    fence_proxy_tensormap_acquire(q_map)  # the maps were copied from the host
                    fence_proxy_tensormap_acquire(k_map)
                    fence_proxy_tensormap_acquire(v_map)
                    fence_proxy_tensormap_acquire(do_map)
                    mbarrier_arrive_expect_tx(q_full, 2 * Q_BYTES)
                    for chunk in static_range(CHUNKS):
                        tma_load_4d(q_tile + uint32(chunk * Q_CHUNK_BYTES), q_map, chunk * CHUNK, h,
                                    q_row0 + m_start, mem_b, q_full)
                        tma_load_4d(do_tile + uint32(chunk * Q_CHUNK_BYTES), do_map, chunk * CHUNK, h,
                                    q_row0 + m_start, mem_b, q_full)
                    j = first_tile - 1
                    for i in range(n_tiles):
                        slot, use = i % STAGES, i // STAGES
                        if use > 0:  # the consumers have released the slot's previous tiles
                            mbarrier_wait(kv_empty + uint32(8 * slot), (use - 1) & 1)
                        j = visit_key_tile(params, b, h, m_block, first_tile, i, j, end_tile)  # first + i unmasked
                        n_start = j * BN
                        k_tile = k_ring + uint32(slot * KV_BYTES)
                        v_tile = v_ring + uint32(slot * KV_BYTES)
                        mbarrier_arrive_expect_tx(k_full + uint32(8 * slot), KV_BYTES)
                        for chunk in static_range(CHUNKS):
                            tma_load_4d(k_tile + uint32(chunk * KV_CHUNK_BYTES), k_map, chunk * CHUNK, hk,
                                        k_row0 + n_start, mem_b, k_full + uint32(8 * slot))
                        mbarrier_arrive_expect_tx(v_full + uint32(8 * slot), KV_BYTES)
                        for chunk in static_range(CHUNKS):
                            tma_load_4d(v_tile + uint32(chunk * KV_CHUNK_BYTES), v_map, chunk * CHUNK, hk,
                                        k_row0 + n_start, mem_b, v_full + uint32(8 * slot))
        else:
            # ---- Consumers: 64 query rows each ----
            if SPLIT_REGISTERS:
                setmaxnreg_inc(CONSUMER_REGS)
            consumer = group - 1
            lane = tid % 32
            q4 = lane & 3
            row0 = m_start + 64 * consumer + 16 * ((tid % GROUP) // 32) + (lane >> 2)  # +8: the second row
            head_ctx = head_context(params, b, h)
            rows_off = uint32(64 * consumer * ROW_BYTES)  # the consumer's rows in a Q or dO chunk
            desc_q = smem_descriptor(q_tile + rows_off, K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)
            desc_do = smem_descriptor(do_tile + rows_off, K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)

            units = score_units(params, scale, head_ctx)  # the score features' constants for this head

            # lse_log2 and D of the thread's two rows, read once
            lse_row = cuda.local.array(2, float32)
            d_row = cuda.local.array(2, float32)
            for rh in static_range(2):
                lse_log2, d = row_stats(lse, delta, mem_b, h, row0 + 8 * rh, seqlen_q)
                if SCORE:  # the score features' offset (variants.OFFSET) out of lse, as out of their scores
                    lse_log2 -= units[variants.OFFSET]
                lse_row[rh] = lse_log2
                d_row[rh] = d

            s = cuda.local.array(S_REGS, float32)  # S, then P
            dp = cuda.local.array(S_REGS, float32)  # dP, then dS
            dq_acc = cuda.local.array(DQ_REGS, float32)
            ds = cuda.local.array(DS_REGS, uint32)  # dS packed to 16 bit
            for r in static_range(S_REGS):
                s[r] = float32(0)
                dp[r] = float32(0)
            for r in static_range(DQ_REGS):
                dq_acc[r] = float32(0)

            if n_tiles > 0:
                mbarrier_wait(q_full, 0)
            j = first_tile - 1
            for i in range(n_tiles):
                j = visit_key_tile(params, b, h, m_block, first_tile, i, j, end_tile)  # first + i unmasked
                n_start = j * BN
                slot, use = i % STAGES, i // STAGES

                # S = Q_i K_j^T and dP = dO_i V_j^T, two commit groups
                acc_s = fence_operands(registers_from(s, S_REGS))
                acc_dp = fence_operands(registers_from(dp, S_REGS))
                mbarrier_wait(k_full + uint32(8 * slot), use & 1)
                mbarrier_wait(v_full + uint32(8 * slot), use & 1)
                wgmma_fence()  # the accumulators' registers are ordered before wgmma uses them
                acc_s = issue_scores(acc_s, desc_q, key_major_descriptor(k_ring, slot))
                acc_dp = issue_scores(acc_dp, desc_do, key_major_descriptor(v_ring, slot))
                if FEATURES:  # P and dS in one pass, once both have landed (the mask as below)
                    wgmma_wait(0)
                    registers_to(s, fence_operands(acc_s))
                    registers_to(dp, fence_operands(acc_dp))
                    if j < first_full or j >= end_full or tile_class(params, b, h, m_block, j) != variants.FULL:
                        feature_gradients(s, dp, lse_row, d_row, row0, n_start, seqlen_q, seqlen_k, params, head_ctx,
                                          scale_log2, units, q4, True)
                    else:
                        feature_gradients(s, dp, lse_row, d_row, row0, n_start, seqlen_q, seqlen_k, params, head_ctx,
                                          scale_log2, units, q4, False)
                else:
                    wgmma_wait(1)  # S has landed; dP may still run
                    registers_to(s, fence_operands(acc_s))

                    # P, the mask only on tiles that some row of the block does not see whole (and a
                    # block mask's PARTIAL ones)
                    if j < first_full or j >= end_full or tile_class(params, b, h, m_block, j) != variants.FULL:
                        probabilities(s, lse_row, row0, n_start, seqlen_q, seqlen_k, params, head_ctx, scale_log2, q4,
                                      True)
                    else:
                        probabilities(s, lse_row, row0, n_start, seqlen_q, seqlen_k, params, head_ctx, scale_log2, q4,
                                      False)

                    # dS = P (dP - D)
                    wgmma_wait(0)  # dP has landed
                    registers_to(dp, fence_operands(acc_dp))
                    score_gradients(s, dp, d_row)
                pack_ds(dp, ds)  # dS packed to 16 bits

                # dQ_i += dS K_j
                ds_regs = fence_operands(registers_from(ds, DS_REGS))
                acc_q = fence_operands(registers_from(dq_acc, DQ_REGS))
                wgmma_fence()  # dS's and the accumulator's registers are ordered before wgmma
                acc_q = issue_dq(acc_q, ds_regs, k_mn_descriptor(k_ring, slot))
                wgmma_wait(0)
                registers_to(dq_acc, fence_operands(acc_q))
                mbarrier_arrive(kv_empty + uint32(8 * slot))  # this thread is done with the slot's K and V

            # ---- Write dQ_i * scale (rows that see no key get 0) ----
            store_rows(dq, dq_acc, mem_b, row0, h, seqlen_q, scale, q4)

    return backward_dq_sm90
