"""FlashAttention backward on Hopper (sm_90a), the dK/dV pass with the query rows split between the
consumers, the planned dK/dV kernel at headdims up to 32 for plain and windowed attention
(configs.sm90_backward_config; 1.11-1.17x backward_sm90.py's block_m 64 kernel at hd 64 on the
H200). From 33 to 64 backward_sm90.py's 128-query form, FlashAttention-3's hd 64 shape, replaced
it: 1.03-1.10x this kernel at hd 64 on an H100 (docs/perf-notes.md, "Hopper backward", step 40).

Read backward_sm90.py first: the producer, the ring and the tiles are its. There each consumer
warpgroup owns 64 of the tile's keys and works on the transposed scores; here each owns 64 of the
step's 128 query rows and works on the scores as the forward does. Per (batch, KV head), with
D = rowsum(dO * O) from the preprocess::

    for each tile of 128 keys K_j, V_j (one thread block; loaded once by TMA):
        producer warpgroup (as in backward_sm90.py): Q_i, dO_i (128 rows) by TMA, lse_i (base 2)
            and D_i of the tile's rows by the stats warp, into ring slot i % stages
        each consumer warpgroup c (query rows 64 c .. 64 c + 63 of every step; keys 64 c .. 64 c + 63
        of dK and dV):
            dK_c = dV_c = 0                                                         (registers)
            for the i-th step, once the slot is full:
                S  = Q_c K_j^T,  dP = dO_c V_j^T             (wgmma, m64n128, both from shared memory)
                P  = exp2(S * scale_log2 - lse_log2[row])  (0 where masked; while dP is in flight)
                dS = P * (dP - D[row])
                P, dS -> shared memory (16 bit, all 128 rows x 128 keys between the two consumers)
                dQ_c  = dS K_j          (wgmma, dS from registers; into dq_accum by red.add, or
                                          with dq_reduce="tiles" staged in fragment order for the
                                          stats warp's one bulk reduce-add a step)
                dV_c += P^T dO_i,  dK_c += dS^T Q_i   (wgmma, P^T and dS^T: key chunk c of the tiles)
                arrive on the slot's empty barrier
            dK *= scale; write dK_c, dV_c

Why this split: the statistics are per row, so a thread reads its two rows' lse and D once a step
(the keys split reads one per query column), and the window's bounds are made once per row; dQ_c's
A operand is dS_c as it sits in the accumulator's registers, so no consumer waits on another for
dQ, and both do the same work every step. The price: dV and dK need every query's P and dS for a
key, so both go through shared memory, and the two consumers meet at two barriers a step (before
the stores, every product of the last step has read the single P and dS tiles; after them, every
store is in).

Grid and threads: as backward_sm90.py with block_n = 128 (``heavy_groups`` included); block =
384 threads; block_m = 128.

Shared memory (dynamic, every tile 1024-byte aligned): K_j, V_j (128 rows), the ring of Q_i and of
dO_i tiles (128 rows), the P and dS tiles (two 64-key chunks each of 128 query rows of 128 bytes,
the 128-byte swizzle: read with keys contiguous they are P^T's and dS^T's MN-major image), the
ring's stats (lse_log2 and D, 128 floats each per slot), then the mbarriers.

P and dS go to their tiles by 32-bit stores, or with ``stmatrix=True`` by stmatrix (16 instructions
a step instead of 64; measured within -6% to +2% of the stores on the H200, so not planned:
docs/perf-notes.md, "Hopper backward", step 16).

``issue_early`` (an option, not planned; docs/perf-notes.md, "Hopper backward", step 42): "dq" issues
dQ_c's product once the consumer's P is stored, so that it runs under dS's stores and the second
barrier; "dq-dv" also fences P's stores behind a third barrier and issues dV_c with it. The commit
groups keep the order dQ, dV, dK either way.

``rotate`` (an option, not planned; step 43): block n walks its query tiles from the n-th on (mod
their number), so that the blocks of a head running together add into different rows of dq_accum.

``persistent=n`` (an option, not planned; docs/perf-notes.md, "Hopper backward", step 18): a grid
of at most n blocks, each taking work items t, t + n, ... of the plain grid's blocks in their launch
order (``heavy_groups`` included), so that the blocks running together read the same few heads'
Q, dO and dq_accum, as the plain grid's do (taken key tile by key tile across all heads, the first
form measured 14-27% slower: L2 no longer held what they shared). Each role runs the
per-tile code above once per item, with the ring's slots and phases counted on across items, and K
and V in two buffers with a full and an empty barrier each: the producer loads the next item's K
and V while the consumers still work on the current one, instead of a new block starting cold.

Memory and arguments: backward_sm90.py's (the same signature and tensor maps). Variants: plain
attention and the window (causal included); headdims a multiple of 8 up to 64 (padded to 64 by
TMA's zero fill); the other features raise in the config (backward_sm90.py serves them).
"""

from dataclasses import dataclass
from functools import lru_cache

from numba import cuda, float32, int32, int64, uint32, uint64

from nbflash.primitives import (
    exp2_approx,
    inline_device,
    shared_address,
    static_range,
    u32_as_f32,
    unroll,
)
from nbflash.primitives_sm90 import (
    SWIZZLE_128B,
    array_address,
    elect_sync,
    fence_mbarrier_init,
    fence_operands,
    fence_proxy_async,
    fence_proxy_tensormap_acquire,
    k_step,
    launch_bounded,
    make_wgmma_rs,
    make_wgmma_ss,
    mbarrier_arrive,
    mbarrier_arrive_expect_tx,
    mbarrier_init,
    mbarrier_wait,
    named_barrier_sync,
    registers_from,
    registers_to,
    setmaxnreg_dec,
    setmaxnreg_inc,
    smem_descriptor,
    stmatrix_x4,
    tile_base,
    tma_load_4d,
    warpgroup_index,
    wgmma_commit,
    wgmma_fence,
    wgmma_wait,
)
from nbflash.problem import Variant

from . import variants
from .backward_sm90 import (
    Sm90BackwardBlock,
    make_add_dq,
    make_init_ring,
    make_pack_a,
    make_stage_dq,
    make_stage_stats,
    make_step_pair,
    make_store_rows,
)
from .forward_sm90 import CHUNK, GROUP, ROW_BYTES
from .geometry import grouped_block, grouped_grid

ROWS = 64  # query rows per consumer warpgroup: the M of S, dP and dQ
BLOCK_M = 128  # query rows per step: two consumers' rows
BLOCK_N = 128  # keys per block: the N of S and dP; 64 per consumer in dK and dV
MAX_HEADDIM = 64  # one 64-column chunk: dK, dV and dQ of 32 registers each


def served(variant):
    """This kernel serves ``variant``: nothing but the window (causal included) is on. The other
    features (score features, dropout, element and block masks, packed sequences) stay with
    backward_sm90.py."""
    return variant._replace(window=False) == Variant()


@dataclass(frozen=True)
class Sm90RowsBackwardConfig(Sm90BackwardBlock):
    """One compiled variant of the Hopper dK/dV kernel with the query rows split between the two
    consumers (the backward's preprocess and dq conversion are the portable family's; with
    ``dq_reduce="tiles"`` the conversion is backward_sm90.py's ``Sm90ConvertDqConfig``)."""

    dtype: str  # 'float16' or 'bfloat16'
    headdim: int  # a multiple of 8, at most 64
    variant: Variant = Variant()
    stages: int = 2  # query tiles in flight (the ring)
    producer_registers: int = 40  # setmaxnreg caps (the block holds 384 x 168 registers at entry)
    consumer_registers: int = 232
    heavy_groups: int = 0  # longest-first within groups of (batch, KV head) pairs, as backward_sm90.py's
    stmatrix: bool = False  # P and dS into their tiles by stmatrix (16 a step) instead of 64 32-bit stores
    # A persistent grid: at most this many blocks (0: one block per key tile), each taking the plain
    # grid's blocks t, t + blocks, ... in launch order, with K and V double-buffered so that the next
    # tile's load runs under the current tile's steps.
    persistent: int = 0
    # How dQ_c reaches dq_accum: "red", each consumer thread's red.add.v2 of its registers; "tiles",
    # each consumer stores its 64 rows in wgmma's fragment order into a shared tile of the step's
    # 128 rows, which the producer's stats warp adds into a tile-major dq_accum by one bulk
    # reduce-add a step (backward_sm90.py's ``dq_reduce``; docs/perf-notes.md, "Hopper backward",
    # step 34: an option, 1-4% slower than "red" on an H100). Not with a persistent grid, whose
    # second K and V leave no room for the tile.
    dq_reduce: str = "red"
    # Which products run under the step's stores (docs/perf-notes.md, "Hopper backward", step 42):
    # "none", dQ_c, dV_c and dK_c issued together once both consumers' P and dS are stored; "dq",
    # dQ_c (its A is dS_c's registers) issued once the consumer's P is stored (issued before, P's
    # registers outlived it and ptxas spilled), so it runs under dS's stores and the second barrier;
    # "dq-dv", that, with P's stores fenced behind a barrier of their own first, so that dV_c is
    # issued with it and runs under dS's stores too (three barriers a step instead of two).
    issue_early: str = "none"
    # Block n's walk over its query tiles starts n tiles on (mod the tiles it visits), so that the
    # blocks of a head running together add into different rows of dq_accum (backward_sm90.py's
    # ``make_step_pair``; step 43)
    rotate: bool = False
    # dK and dV stored 16 bytes a lane after a transpose across each quad (backward_sm90.py's
    # ``make_store_rows`` quads; docs/perf-notes.md step 55): planned without a window
    # (configs.SM90_BACKWARD_ROWS_STORE_QUADS)
    store_quads: bool = False
    kernel = "dkdv"  # the backward's plan reads it (one kernel of the three)
    atomic_dq = True  # dQ goes to dq_accum by atomics (no deterministic form)
    consumers = 2
    block_m = BLOCK_M
    block_n = BLOCK_N

    def __post_init__(self):
        self.check_dtype_headdim(8, MAX_HEADDIM)
        if not served(self.variant):
            raise ValueError(f"{self.variant=}: the rows-split sm90 backward serves plain attention and the window "
                             "(causal) only; backward_sm90.py serves the other features")
        if self.persistent < 0:
            raise ValueError(f"persistent={self.persistent} must be 0 (off) or a block count")
        self.check_dq_reduce()
        if self.issue_early not in ("none", "dq", "dq-dv"):
            raise ValueError(f"issue_early={self.issue_early!r} must be 'none', 'dq' or 'dq-dv'")
        if self.dq_reduce == "tiles" and self.persistent:
            raise ValueError(f"dq_reduce='tiles' takes one key tile a block, not persistent={self.persistent}")
        self.check_block()

    @property
    def dq_part_columns(self):
        """With ``dq_tile_major``: a consumer's dQ product covers all 64 columns of its 64 rows."""
        return CHUNK

    @property
    def p_bytes(self):
        """Bytes of the P (or dS) tile: 128 query rows x 128 keys, 16 bit."""
        return BLOCK_M * BLOCK_N * 2

    @property
    def stats_bytes(self):
        """Bytes of one slot's lse_log2 and D."""
        return 2 * BLOCK_M * 4

    @property
    def dynamic_shared_bytes(self):
        """The tiles (and the staged dQ), the stats, 1 + 2 stages mbarriers, and 1024 bytes of slack
        to align the tiles; persistent: a second K and V and three more mbarriers (the second K/V's
        full, both empties); ``dq_tile_major``: two more (dq_full, dq_empty)."""
        kv_buffers = 2 if self.persistent else 1
        return (1024 + 2 * kv_buffers * self.kv_bytes + 2 * self.stages * self.q_bytes + 2 * self.p_bytes
                + self.dq_stage_bytes + self.stages * self.stats_bytes + 8 * (1 + 2 * self.stages)
                + (24 if self.persistent else 0) + (16 if self.dq_tile_major else 0))

    def grid(self, batch, nheads, nheads_k, seqlen_q, seqlen_k):
        tiles = -(-seqlen_k // BLOCK_N)
        if self.heavy_groups:
            grid = grouped_grid(tiles, batch * nheads_k, self.heavy_groups)
        else:
            grid = (tiles, nheads_k, batch)
        if self.persistent:  # the blocks above are its work items
            return (min(self.persistent, grid[0] * grid[1] * grid[2]), 1, 1)
        return grid


@lru_cache(maxsize=None)
def build_backward_sm90_rows(config: Sm90RowsBackwardConfig):
    """Compile-time constants of ``config`` captured in a fresh ``@cuda.jit`` kernel."""
    BM, BN, HD, STAGES, THREADS = BLOCK_M, BLOCK_N, config.headdim, config.stages, config.threads
    CONSUMERS = config.consumers
    Q_BYTES, KV_BYTES, P_BYTES, STATS_BYTES = config.q_bytes, config.kv_bytes, config.p_bytes, config.stats_bytes
    P_CHUNK_BYTES = BM * ROW_BYTES  # a 64-key chunk of the P (dS) tile: 128 query rows of 128 bytes
    HD_STEPS = CHUNK // 16  # k16 steps over headdim (S, dP)
    Q_STEPS = BM // 16  # k16 steps over the step's queries (dV, dK)
    KEY_STEPS = BN // 16  # k16 steps over the tile's keys (dQ)
    S_REGS, ACC_REGS, P_REGS = BN // 2, CHUNK // 2, BN // 4  # per thread: S (dP), dK (dV, dQ), packed P (dS)
    NT = BN // 8  # 8-key column groups of S
    FULL_ARRIVALS = 1 + 32  # the TMA thread's expect_tx and the stats warp's 32 lanes
    # dQ_c staged in shared memory by the consumers, added by the producer's stats warp (dq_reduce="tiles")
    STAGED_DQ, DQ_STAGE_BYTES = config.dq_tile_major, config.dq_stage_bytes
    DQ_PART_BYTES = DQ_STAGE_BYTES // CONSUMERS  # a consumer's 64 rows
    EMPTY_ARRIVALS = CONSUMERS * GROUP
    BOTH = CONSUMERS * GROUP  # threads of the named barriers across the consumers
    PRODUCER_REGS, CONSUMER_REGS = config.producer_registers, config.consumer_registers
    HEAVY_GROUPS, STMATRIX, PERSISTENT = config.heavy_groups, config.stmatrix, config.persistent > 0
    DQ_EARLY, DV_EARLY = config.issue_early != "none", config.issue_early == "dq-dv"
    KV_BUFFERS = 2 if PERSISTENT else 1  # K/V tiles in flight
    KV_PAIR = 2 * KV_BYTES  # a buffer's K and V
    KV_FULL_STEP = 8 * (1 + 2 * STAGES)  # the second buffer's full barrier: after the ring's barriers
    hooks = variants.hooks(config.variant)
    query_tiles, row_keys, hidden, head_context = hooks.query_tiles, hooks.row_keys, hooks.hidden, hooks.head_context
    IS_F16 = config.dtype == "float16"
    AB = "f16" if IS_F16 else "bf16"
    wgmma_rows_by_keys = make_wgmma_ss(BN, AB, 0)  # S (64 x BN) = Q_c (K-major) K_j^T (keys K-major)
    wgmma_dq = make_wgmma_rs(CHUNK, AB, 1)  # dQ_c (64 x 64) = dS_c (registers) K_j (keys x headdim, MN-major)
    # dV_c (64 keys x 64) += P^T (key chunk c of the P tile, keys contiguous: MN-major) dO_i (MN-major)
    wgmma_keys_acc = make_wgmma_ss(CHUNK, AB, 1, 1)
    K_MAJOR = (16, 1024)  # descriptor strides (bytes): 8-row groups 1024 apart, LBO unused
    STEP16 = 16 * ROW_BYTES >> 4  # descriptor increment of a k16 step of an MN-major tile: 16 rows
    init_ring = make_init_ring(STAGES, FULL_ARRIVALS, EMPTY_ARRIVALS)
    pack_a = make_pack_a(config.dtype, P_REGS)  # P's and dS's A registers
    add_dq = make_add_dq(HD, CHUNK)  # dQ_c into dq_accum
    store_rows = make_store_rows(config.dtype, HD, CHUNK, quads=config.store_quads)  # dK, dV
    stage_stats = make_stage_stats(config, hooks)  # the producer's warp 1
    stage_dq = make_stage_dq(64, CHUNK)  # with STAGED_DQ, a consumer's 64 rows of dQ for the stats warp
    step_pair = make_step_pair(config)  # step i's query head and tile (``rotate``)

    @inline_device
    @unroll
    def issue_rows_by_keys(acc, desc_a, desc_b):
        """acc = A B^T over headdim (S = Q_c K_j^T or dP = dO_c V_j^T) from the first k16 step's
        zero (scale-d 0), one commit group."""
        for kk in static_range(HD_STEPS):
            acc = wgmma_rows_by_keys(acc, desc_a + k_step(Q_BYTES, kk), desc_b + k_step(KV_BYTES, kk),
                                     uint32(0 if kk == 0 else 1))
        wgmma_commit()
        return acc

    @inline_device
    @unroll
    def issue_dq(acc, ds_regs, desc_k):
        """acc = dS_c K_j over the tile's keys, dS_c's packed registers as A (k16 step ks: registers
        4 ks .. 4 ks + 3), from the first step's zero; one commit group."""
        for ks in static_range(KEY_STEPS):
            acc = wgmma_dq(acc, ds_regs[4 * ks], ds_regs[4 * ks + 1], ds_regs[4 * ks + 2], ds_regs[4 * ks + 3],
                           desc_k + uint64(ks * STEP16), uint32(0 if ks == 0 else 1))
        wgmma_commit()
        return acc

    @inline_device
    @unroll
    def issue_keys_acc(acc, desc_a, desc_b):
        """acc += A B over the step's 128 queries (dV_c += P^T dO_i or dK_c += dS^T Q_i), both from
        shared memory, MN-major; one commit group."""
        for ks in static_range(Q_STEPS):
            acc = wgmma_keys_acc(acc, desc_a + uint64(ks * STEP16), desc_b + uint64(ks * STEP16), uint32(1))
        wgmma_commit()
        return acc

    @inline_device
    @unroll
    def probabilities(s, row0, lse_log2, n_start, seqlen_q, seqlen_k, params, head_ctx, scale_log2, q4, masked):
        """S -> P = exp2(S * scale_log2 - lse_log2[row]) in place, for the thread's two query rows
        (row0, row0 + 8; lse_log2 theirs) and its key columns n_start + 8 c + 2 q4 + e; masked
        entries (keys past seqlen_k, or outside the row's window) get P = 0. ``masked`` is a
        constant at each call site. Rows past seqlen_q have lse_log2 = +inf, so P = 0.
        The mask tests the column's offset 8 c + e from the thread's first key against the row's
        bounds less that key (the band's test is the same shifted, and this kernel serves no
        element mask): 32 keys made once before the loop were spilled, and compared in 64 bits."""
        key0 = n_start + 2 * q4
        if masked:  # the first key made opaque each step, so nothing of it is kept across the loop
            key0 = int64(fence_operands((uint32(key0), uint32(0)))[0])  # (one register is no tuple to the asm)
        for rh in static_range(2):
            row = row0 + 8 * rh
            lo, hi = row_keys(row, seqlen_q, seqlen_k, params)  # used by the masked copy
            lo_rel, hi_rel = int32(max(lo - key0, -1)), int32(hi - key0)
            for c in static_range(NT):
                for e in static_range(2):
                    r = 4 * c + 2 * rh + e
                    p = exp2_approx(s[r] * scale_log2 - lse_log2[rh])
                    if masked:
                        if hidden(int32(8 * c + e), lo_rel, hi_rel, row, seqlen_q, params, head_ctx):
                            p = float32(0)
                    s[r] = p

    @inline_device
    @unroll
    def score_gradients(p, dp, d):
        """dP -> dS = P (dP - D[row]) in place (P = 0 where masked gives dS = 0)."""
        for c in static_range(NT):
            for rh in static_range(2):
                for e in static_range(2):
                    r = 4 * c + 2 * rh + e
                    dp[r] = p[r] * (dp[r] - d[rh])

    @inline_device
    @unroll
    def store_rows_tile(smem, row_word, swizzle, packed):
        """The thread's packed P (or dS) of its rows r0 and r0 + 8 of the step (r0 % 8 = g) and keys
        8 c + 2 q4, + 1 into a tile: key chunk c // 8 (P_CHUNK_BYTES apart), rows of 128 bytes,
        16-byte unit c % 8 stored at (c % 8) ^ g (the swizzle wgmma reads). ``row_word`` is the smem
        index of the tile's row r0 plus q4, ``swizzle`` is 4 g (a unit in words). Packed register i
        holds key group c = i // 2 of row r0 + 8 (i % 2)."""
        for i in static_range(P_REGS):
            chunk, unit = (i // 2) // 8, (i // 2) % 8
            offset = chunk * (P_CHUNK_BYTES // 4) + 8 * (i % 2) * (ROW_BYTES // 4)
            smem[row_word + uint32(offset) + (uint32(4 * unit) ^ swizzle)] = packed[i]

    @inline_device
    @unroll
    def store_tile_stmatrix(lane_row, lane_j, lane_r, packed):
        """The warp's packed P (or dS) of its 16 rows r0 .. r0 + 15 of the step into a tile, by
        stmatrix: call k stores key groups 2k and 2k + 1 (packed registers 4k .. 4k + 3: group 2k rows
        r0 + g and r0 + 8 + g, then group 2k + 1's), matrix i being rows r0 + 8 (i % 2) .. + 7 of group
        2k + i // 2. Lane 8 i + r gives that matrix's row r: key chunk 2k // 8 (P_CHUNK_BYTES apart),
        16-byte unit (2k % 8 + i // 2) ^ r (the 128-byte swizzle; the row's index mod 8 is r).
        ``lane_row`` is the tile's address of the lane's row r0 + 8 (i % 2) + r, ``lane_j`` = i // 2,
        ``lane_r`` = r."""
        for k in static_range(P_REGS // 4):
            unit = (uint32((2 * k) % 8) + lane_j) ^ lane_r
            stmatrix_x4(lane_row + uint32((2 * k // 8) * P_CHUNK_BYTES) + unit * uint32(16),
                        packed[4 * k], packed[4 * k + 1], packed[4 * k + 2], packed[4 * k + 3])

    @inline_device
    def store_tile(smem, p_tile, p_row_word, lane_row, g, lane, packed, which):
        """P (``which`` 0) or dS (1) of the thread's two rows into its tile, P_BYTES apart
        (``stmatrix``: lane_row is the P tile's offset of the lane's stmatrix row; else p_row_word, the
        word of its first row). The row and lane words are made opaque each step: else LLVM makes
        every store address once before the loop, and ptxas spills them (the 32-bit stores' 64: 320
        bytes, 74 local accesses in the loop)."""
        if STMATRIX:
            row, lane_j, lane_r = fence_operands((lane_row, uint32(lane >> 4), uint32(lane & 7)))
            store_tile_stmatrix(p_tile + row + uint32(which * P_BYTES), lane_j, lane_r, packed)
        else:
            row_word, swizzle = fence_operands((p_row_word, uint32(4 * g)))
            store_rows_tile(smem, row_word + uint32(which * (P_BYTES // 4)), swizzle, packed)

    @inline_device
    @unroll
    def read_stats(smem, stats_word0, slot, row0, lse_log2, d):
        """The thread's two rows' lse_log2 and D in a slot (the stats warp's stores arrived with it)."""
        stats = stats_word0 + uint32(slot * (STATS_BYTES // 4))
        for rh in static_range(2):
            lse_log2[rh] = u32_as_f32(smem[stats + row0 + 8 * rh])
            d[rh] = u32_as_f32(smem[stats + BM + row0 + 8 * rh])

    @inline_device
    def step_probabilities(s, tile, row0, lse_log2, n_start, seqlen_q, seqlen_k, params, head_ctx, scale_log2, q4,
                           tail, first_full, end_full):
        """S -> P for a step's query tile: the masked copy only on tiles crossing the window's edges or
        the key tail."""
        if tail or tile < first_full or tile >= end_full:
            probabilities(s, tile * BM + row0, lse_log2, n_start, seqlen_q, seqlen_k, params, head_ctx,
                          scale_log2, q4, True)
        else:
            probabilities(s, tile * BM + row0, lse_log2, n_start, seqlen_q, seqlen_k, params, head_ctx,
                          scale_log2, q4, False)

    @inline_device
    def rows_descriptor(tile, rows_off):
        """A consumer's 64 rows of a Q (dO) tile as S's (dP's) A: K-major."""
        return smem_descriptor(tile + rows_off, K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)

    @inline_device
    def mn_descriptor(tile, chunk_bytes):
        """A tile read MN-major (dV's and dK's A and B): 64-column chunks chunk_bytes apart."""
        return smem_descriptor(tile, chunk_bytes, 1024, SWIZZLE_128B)

    # -----------------------------------------------------------------------------------------------
    # The kernel
    # -----------------------------------------------------------------------------------------------

    @inline_device
    def key_tile(work, grid_x, pairs, nheads_k):
        """A persistent block's work item -> (key tile, KV head, batch, whether the pair exists): the
        plain grid's block `work` in launch order, grid_x blocks a row (a partial last group of heavy
        pairs has items with nothing to do)."""
        x, y = work % grid_x, work // grid_x
        n_block, pair = x, y
        if HEAVY_GROUPS:
            n_block, pair = grouped_block(x, y, HEAVY_GROUPS)
        return n_block, pair % nheads_k, pair // nheads_k, pair < pairs

    @inline_device
    def visits(n_block, seqlen_q, seqlen_k, params, group):
        """Which query tiles see key tile n_block (geometry.py): [first_tile, end_tile), of which
        [first_full, end_full) see all of its keys; the key tail always masks. One step per (query
        head of the group, query tile)."""
        n_start = n_block * BN
        first_tile, first_full, end_full, end_tile = query_tiles(
            n_start, min(n_start + BN, seqlen_k), seqlen_q, seqlen_k, params, BM)
        tiles_per_head = end_tile - first_tile
        return n_start, first_tile, first_full, end_full, n_start + BN > seqlen_k, tiles_per_head, group * tiles_per_head

    @launch_bounded(THREADS, 1)
    @unroll
    def backward_dkdv_sm90_rows(q, k, v, dout, lse, delta, dk, dv, dq_accum, maps, scale_log2, scale, params):
        # The block's key tiles, as work items [work0, work_end) in strides of work_stride: one (its
        # own) unless persistent.
        nheads_k = k.shape[2]
        pairs = q.shape[0] * nheads_k
        work0, work_end, work_stride, grid_x = 0, 1, 1, 1
        if PERSISTENT:  # the plain grid's blocks, grid_x a row (config.grid)
            grid_x = (k.shape[1] + BN - 1) // BN
            grid_y = pairs
            if HEAVY_GROUPS:
                grid_x, grid_y = grid_x * HEAVY_GROUPS, (pairs + HEAVY_GROUPS - 1) // HEAVY_GROUPS
            work0, work_end, work_stride = cuda.blockIdx.x, grid_x * grid_y, cuda.gridDim.x
        if HEAVY_GROUPS and not PERSISTENT:  # (batch, KV head) pairs in groups, key tile by key tile (geometry.py)
            n_block, pair = grouped_block(cuda.blockIdx.x, cuda.blockIdx.y, HEAVY_GROUPS)
            if pair >= pairs:
                return  # the last group's missing pairs: the whole block, before any barrier
            b, hk = pair // nheads_k, pair % nheads_k
        else:
            n_block, hk, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        group_id = warpgroup_index(tid)  # 0: the producer; 1 + c: consumer c
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        group = q.shape[2] // nheads_k  # GQA: query heads hk * group ... share this K/V tile
        visited = visits(n_block, seqlen_q, seqlen_k, params, group)  # persistent: again per key tile

        # Shared memory: tiles from the first 1024-byte boundary, then the stats and the barriers.
        # Persistent: K/V buffer j at k_tile + j KV_PAIR (its V KV_BYTES on), its full and empty
        # barriers at kv_full + j KV_FULL_STEP and kv_empty + 8 j.
        smem = cuda.shared.array(0, uint32)
        smem_start = shared_address(smem)
        k_tile = tile_base(smem_start)
        v_tile = k_tile + uint32(KV_BYTES)
        q_ring = k_tile + uint32(KV_BUFFERS * KV_PAIR)
        do_ring = q_ring + uint32(STAGES * Q_BYTES)
        p_tile = do_ring + uint32(STAGES * Q_BYTES)
        ds_tile = p_tile + uint32(P_BYTES)
        dq_stage = ds_tile + uint32(P_BYTES)  # with STAGED_DQ: the step's 128 rows of dQ, float32
        stats_ring = dq_stage + uint32(DQ_STAGE_BYTES)
        kv_full = stats_ring + uint32(STAGES * STATS_BYTES)
        qd_full = kv_full + uint32(8)  # + 8 * slot
        qd_empty = qd_full + uint32(8 * STAGES)
        kv_empty = qd_empty + uint32(8 * STAGES + 8)  # persistent only: after the second K/V's full barrier
        dq_full = qd_empty + uint32(8 * STAGES)  # with STAGED_DQ (never persistent): the rows are staged
        dq_empty = dq_full + uint32(8)  # ... and the stats warp has had them read
        stats_word0 = (stats_ring - smem_start) // uint32(4)  # smem's index of the first slot's stats

        if tid == 0:
            if STAGED_DQ:
                mbarrier_init(dq_full, CONSUMERS * GROUP)
                mbarrier_init(dq_empty, 32)
            init_ring(kv_full, qd_full, qd_empty)  # (its fence covers the two above)
            if PERSISTENT:
                mbarrier_init(kv_full + uint32(KV_FULL_STEP), 1)
                mbarrier_init(kv_empty, EMPTY_ARRIVALS)
                mbarrier_init(kv_empty + uint32(8), EMPTY_ARRIVALS)
                fence_mbarrier_init()
        cuda.syncthreads()  # the barriers are initialised before anyone arrives on or waits for them

        if group_id == 0:
            # ---- Producer: warp 0 issues the copies, warp 1 stages lse and D ----
            setmaxnreg_dec(PRODUCER_REGS)
            warp = tid // 32
            lane = tid % 32
            step0, kv_use = 0, 0  # the block's steps and loaded K/V tiles before this work item's
            if warp == 0:
                if elect_sync() == uint32(1):  # one lane issues the copies
                    maps_address = array_address(maps)
                    q_map, k_map, v_map, do_map = (maps_address, maps_address + 128, maps_address + 256,
                                                   maps_address + 384)
                    fence_proxy_tensormap_acquire(q_map)  # the maps were copied from the host
                    fence_proxy_tensormap_acquire(k_map)
                    fence_proxy_tensormap_acquire(v_map)
                    fence_proxy_tensormap_acquire(do_map)
                    for work in range(work0, work_end, work_stride):
                        if PERSISTENT:
                            n_block, hk, b, exists = key_tile(work, grid_x, pairs, nheads_k)
                            if not exists:
                                continue
                            visited = visits(n_block, seqlen_q, seqlen_k, params, group)
                        n_start, first_tile, _, _, _, tiles_per_head, steps = visited
                        if steps > 0:
                            buffer = kv_use % KV_BUFFERS
                            if kv_use >= KV_BUFFERS:  # the consumers are done with the buffer's last tile
                                mbarrier_wait(kv_empty + uint32(8 * buffer), (kv_use // KV_BUFFERS - 1) & 1)
                            kv_ready = kv_full + uint32(buffer * KV_FULL_STEP)
                            mbarrier_arrive_expect_tx(kv_ready, 2 * KV_BYTES)
                            tma_load_4d(k_tile + uint32(buffer * KV_PAIR), k_map, 0, hk, n_start, b, kv_ready)
                            tma_load_4d(v_tile + uint32(buffer * KV_PAIR), v_map, 0, hk, n_start, b, kv_ready)
                            kv_use += 1
                        for i in range(steps):
                            slot, use = (step0 + i) % STAGES, (step0 + i) // STAGES
                            if use > 0:  # the consumers have released the slot's previous tiles
                                mbarrier_wait(qd_empty + uint32(8 * slot), (use - 1) & 1)
                            h, tile = step_pair(i, hk, group, first_tile, tiles_per_head, n_block)
                            q_start = tile * BM
                            full = qd_full + uint32(8 * slot)
                            mbarrier_arrive_expect_tx(full, 2 * Q_BYTES)
                            tma_load_4d(q_ring + uint32(slot * Q_BYTES), q_map, 0, h, q_start, b, full)
                            tma_load_4d(do_ring + uint32(slot * Q_BYTES), do_map, 0, h, q_start, b, full)
                        step0 += steps
            elif warp == 1:  # backward_sm90.py's stats warp
                for work in range(work0, work_end, work_stride):
                    if PERSISTENT:
                        n_block, hk, b, exists = key_tile(work, grid_x, pairs, nheads_k)
                        if not exists:
                            continue
                        visited = visits(n_block, seqlen_q, seqlen_k, params, group)
                    n_start, first_tile, first_full, end_full, tail, tiles_per_head, steps = visited
                    stage_stats(smem, stats_word0, qd_full, qd_empty, lse, delta, b, hk, group, n_block, first_tile,
                                tiles_per_head, steps, seqlen_q, params, scale, lane, tail, first_full, end_full,
                                step0, dq_accum, dq_stage, dq_full, dq_empty)
                    step0 += steps
        else:
            # ---- Consumers: 64 query rows of each step, 64 keys of dK and dV each ----
            setmaxnreg_inc(CONSUMER_REGS)
            consumer = group_id - 1
            lane = tid % 32
            warp = (tid % GROUP) // 32
            g, q4 = lane >> 2, lane & 3
            row0 = ROWS * consumer + 16 * warp + g  # the thread's first row in the step (+8: the second)
            key_row = ROWS * consumer + 16 * warp + g  # ... and its first key row in the tile (dK, dV)
            rows_off = uint32(ROWS * consumer * ROW_BYTES)  # the consumer's rows in a Q or dO tile
            chunk_off = uint32(consumer * P_CHUNK_BYTES)  # the consumer's keys in the P and dS tiles
            # smem index of the thread's first row (and lane pair) in the P tile; dS's is P_BYTES on
            p_row_word = uint32((p_tile - smem_start) // uint32(4) + uint32(row0 * (ROW_BYTES // 4) + q4))
            # ... and with stmatrix the P tile's offset of the row the lane gives (lane 8 i + r: row r of
            # the warp's eight rows 8 (i % 2) on)
            lane_row = uint32((ROWS * consumer + 16 * warp + 8 * ((lane >> 3) & 1) + (lane & 7)) * ROW_BYTES)

            s = cuda.local.array(S_REGS, float32)
            dp = cuda.local.array(S_REGS, float32)
            zeros = cuda.local.array(S_REGS, float32)  # what every product but dK and dV starts from
            dk_acc = cuda.local.array(ACC_REGS, float32)
            dv_acc = cuda.local.array(ACC_REGS, float32)
            dq_acc = cuda.local.array(ACC_REGS, float32)
            p = cuda.local.array(P_REGS, uint32)
            ds = cuda.local.array(P_REGS, uint32)
            lse_log2 = cuda.local.array(2, float32)
            d = cuda.local.array(2, float32)
            for r in static_range(S_REGS):
                zeros[r] = float32(0)

            desc_k_rows = smem_descriptor(k_tile, K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)  # K_j^T's B: K-major
            desc_v_rows = smem_descriptor(v_tile, K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)
            desc_k_cols = smem_descriptor(k_tile, KV_BYTES, 1024, SWIZZLE_128B)  # dQ's B: keys x headdim

            step0, kv_use = uint32(0), 0  # the block's steps and K/V tiles before this work item's
            for work in range(work0, work_end, work_stride):
                if PERSISTENT:
                    n_block, hk, b, exists = key_tile(work, grid_x, pairs, nheads_k)
                    if not exists:
                        continue
                    visited = visits(n_block, seqlen_q, seqlen_k, params, group)
                n_start, first_tile, first_full, end_full, tail, tiles_per_head, steps = visited
                buffer = kv_use % KV_BUFFERS
                if PERSISTENT:  # the buffer this key tile's K and V come to
                    k_now = k_tile + uint32(buffer * KV_PAIR)
                    desc_k_rows = smem_descriptor(k_now, K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)
                    desc_v_rows = smem_descriptor(k_now + uint32(KV_BYTES), K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)
                    desc_k_cols = smem_descriptor(k_now, KV_BYTES, 1024, SWIZZLE_128B)
                for r in static_range(ACC_REGS):
                    dk_acc[r] = float32(0)
                    dv_acc[r] = float32(0)

                if steps > 0:
                    mbarrier_wait(kv_full + uint32(buffer * KV_FULL_STEP), (kv_use // KV_BUFFERS) & 1)
                for step in range(steps):
                    i = uint32(step)  # unsigned: i % STAGES is an AND, not Python's signed modulo
                    slot, use = (step0 + i) % STAGES, (step0 + i) // STAGES
                    h, tile = step_pair(i, hk, group, first_tile, tiles_per_head, n_block)
                    head_ctx = head_context(params, b, h)
                    q_start = tile * BM
                    q_slot = q_ring + uint32(slot * Q_BYTES)
                    do_slot = do_ring + uint32(slot * Q_BYTES)

                    # S = Q_c K_j^T and dP = dO_c V_j^T, two commit groups, from fresh zeros (nothing
                    # but dK and dV lives across steps)
                    acc_s = fence_operands(registers_from(zeros, S_REGS))
                    acc_dp = fence_operands(registers_from(zeros, S_REGS))
                    mbarrier_wait(qd_full + uint32(8 * slot), use & 1)
                    wgmma_fence()  # the accumulators' registers are ordered before wgmma uses them
                    acc_s = issue_rows_by_keys(acc_s, rows_descriptor(q_slot, rows_off), desc_k_rows)
                    acc_dp = issue_rows_by_keys(acc_dp, rows_descriptor(do_slot, rows_off), desc_v_rows)
                    read_stats(smem, stats_word0, slot, row0, lse_log2, d)
                    wgmma_wait(1)  # S has landed (dP may still run)
                    registers_to(s, fence_operands(acc_s))

                    # P, the mask only on tiles crossing the window's edges or a tail; then dS
                    step_probabilities(s, tile, row0, lse_log2, n_start, seqlen_q, seqlen_k, params, head_ctx,
                                       scale_log2, q4, tail, first_full, end_full)
                    wgmma_wait(0)  # dP has landed
                    registers_to(dp, fence_operands(acc_dp))
                    score_gradients(s, dp, d)
                    pack_a(s, p)
                    pack_a(dp, ds)

                    # P and dS of all 128 rows into shared memory, once the last step's dV and dK
                    # products (both consumers', each waited for before its next step) have read the
                    # tiles; with DV_EARLY dV_c is issued once both consumers' P is in, under dS's stores
                    named_barrier_sync(1, BOTH)
                    store_tile(smem, p_tile, p_row_word, lane_row, g, lane, p, 0)
                    if DV_EARLY:
                        fence_proxy_async()  # the stores are ordered before wgmma reads them
                        acc_dv = fence_operands(registers_from(dv_acc, ACC_REGS))
                        named_barrier_sync(3, BOTH)  # both consumers' P is stored
                    if DQ_EARLY:  # dQ_c = dS_c K_j (A from registers) under dS's stores (P's registers are free)
                        ds_regs = fence_operands(registers_from(ds, P_REGS))
                        acc_q = fence_operands(registers_from(zeros, ACC_REGS))
                        wgmma_fence()
                        acc_q = issue_dq(acc_q, ds_regs, desc_k_cols)
                    if DV_EARLY:
                        acc_dv = issue_keys_acc(acc_dv, mn_descriptor(p_tile + chunk_off, P_CHUNK_BYTES),
                                                mn_descriptor(do_slot, Q_BYTES))
                    store_tile(smem, p_tile, p_row_word, lane_row, g, lane, ds, 1)
                    fence_proxy_async()  # the stores are ordered before wgmma reads them
                    if not DQ_EARLY:
                        ds_regs = fence_operands(registers_from(ds, P_REGS))
                        acc_q = fence_operands(registers_from(zeros, ACC_REGS))
                    if not DV_EARLY:
                        acc_dv = fence_operands(registers_from(dv_acc, ACC_REGS))
                    acc_dk = fence_operands(registers_from(dk_acc, ACC_REGS))
                    named_barrier_sync(2, BOTH)  # both consumers' rows are stored

                    # dQ_c = dS_c K_j (A from registers), then dV_c += P^T dO_i and dK_c += dS^T Q_i
                    # (key chunk c of the tiles): three commit groups, dQ's first so it lands first
                    # (with DQ_EARLY and DV_EARLY issued above, in the same order)
                    wgmma_fence()  # dS's, dQ's and the accumulators' registers are ordered before wgmma
                    if not DQ_EARLY:
                        acc_q = issue_dq(acc_q, ds_regs, desc_k_cols)
                    if not DV_EARLY:
                        acc_dv = issue_keys_acc(acc_dv, mn_descriptor(p_tile + chunk_off, P_CHUNK_BYTES),
                                                mn_descriptor(do_slot, Q_BYTES))
                    acc_dk = issue_keys_acc(acc_dk, mn_descriptor(ds_tile + chunk_off, P_CHUNK_BYTES),
                                            mn_descriptor(q_slot, Q_BYTES))
                    wgmma_wait(2)  # dQ_c has landed: added while dV and dK run
                    registers_to(dq_acc, fence_operands(acc_q))
                    if STAGED_DQ:  # into shared memory, for the producer's stats warp
                        stage_dq(dq_stage + uint32(consumer * DQ_PART_BYTES), dq_acc, dq_full, dq_empty, i,
                                 16 * warp + g, 0, q4)
                    else:
                        add_dq(dq_accum, dq_acc, b, q_start + row0, h, 0, seqlen_q, q4)
                    wgmma_wait(0)  # dV's and dK's products are done with the slot and the P and dS tiles
                    registers_to(dv_acc, fence_operands(acc_dv))
                    registers_to(dk_acc, fence_operands(acc_dk))
                    mbarrier_arrive(qd_empty + uint32(8 * slot))  # this thread is done with the slot
                if steps > 0:
                    if PERSISTENT:  # every product that reads K_j and V_j has landed: the producer may
                        mbarrier_arrive(kv_empty + uint32(8 * buffer))  # load a later tile into them
                    kv_use += 1
                    step0 = uint32(step0 + steps)

                # ---- Write dK = dS^T Q * scale and dV (keys no query sees get 0) ----
                store_rows(dk, dk_acc, b, n_start + key_row, hk, seqlen_k, scale, q4)
                store_rows(dv, dv_acc, b, n_start + key_row, hk, seqlen_k, float32(1), q4)

    return backward_dkdv_sm90_rows
