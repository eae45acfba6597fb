"""FlashAttention backward on Hopper for headdims above 128 (up to 256): the consumers split headdim.

backward_sm90.py gives each consumer warpgroup 64 keys of dK and dV over the whole headdim: at
headdim 256 that is 2 x 64 x 256 / 128 = 256 float32 registers a thread, more than setmaxnreg
allows. Here a block takes 64 keys and both consumers share them, each owning half of headdim's
columns (docs/perf-notes.md, "Hopper backward", step 21)::

    for each tile of 64 keys K_j, V_j (one thread block; loaded once by TMA):
        producer warpgroup: as backward_sm90.py's (warp 0: K_j, V_j, then Q_i, dO_i through the ring;
            warp 1: each step's lse_i and D_i into the slot's stats)
        consumer c (columns 128 c .. 128 c + 127 of dK, dV and dQ):
            dK_c = dV_c = 0
            for the i-th step (64 queries), once its slot is full:
                consumer 0: S^T = K_j Q_i^T;  consumer 1: dP^T = V_j dO_i^T      (wgmma, K = headdim)
                hand the other consumer its half: consumer 0 S^T's queries 32-63, consumer 1 dP^T's
                    queries 0-31 (float32, through shared memory); wait for both
                consumer c, for its half of the queries (32 c .. 32 c + 31):
                    P^T = exp2(S^T * scale_log2 - lse_log2[query]) (0 where masked),
                    dS^T = P^T (dP^T - D[query]), P^T and dS^T -> shared memory (16 bit)
                both, once P^T and dS^T are stored:
                    dV_c += P^T dO_i[:, c],  dK_c += dS^T Q_i[:, c]   (wgmma, both from shared memory)
                    dQ_i[:, c] = dS K_j[:, c], 64 columns at a time, into dq_accum by red.add
                    arrive on the slot's empty barrier
            dK_c *= scale; write dK_c, dV_c

P^T and dS^T are made in float32 from the exact S^T and dP^T (dS^T from the exact P^T, as the other
kernels); each consumer holds one of them, so each hands the other the half it needs through shared
memory, register r of thread t at word r * 128 + t (a warp's stores fill the 32 banks;
``split_tiles``, docs/perf-notes.md, "Hopper backward", step 50). Two named barriers a step: the
halves handed over, and the tiles stored (both wait at each). The form before
(``split_tiles=False``, kept as an option: ``configs.SM90_WIDE_SPLIT_TILES`` plans either) had
consumer 0 make the whole step from dP^T handed over whole, while consumer 1 waited: 1.12-1.17x
slower on an H100. Each step's products read P^T and dS^T from shared memory (SS), where
backward_sm90.py takes them from registers.

Registers per consumer thread: dK_c, dV_c 64 each, S^T or dP^T 32, the other's half 16, a 64-column
dQ product 32. Shared memory: K_j, V_j 64 KB, a 2-stage ring of Q_i and dO_i 128 KB, P^T and dS^T
16 KB, the hand-over 16 KB, the stats 1 KB: 226 KB.

Variants: every one backward_sm90.py serves, through the same hooks and device functions (its
``make_*``): the window (causal included), the element masks (mask tensor, mask_mod), a block mask's
EMPTY pairs skipped (the producer's warps walk the visited pairs, the stats warp hands each step to
the consumers with its slot), the score features (softcap, ALiBi, bias, score_mod: the tensor-core
score point on the raw S^T, whose derivative multiplies dS^T), dropout (the forward's Philox stream:
the factor multiplies the P^T that dV takes and dP^T), and packed sequences (TMA's rows offset by
the sequence's first, the bounds read again each step). With a score feature or dropout, dS^T is
made with P^T (``make_probabilities_t``), in place of dP^T's half in registers (without
``split_tiles``: in the hand-over's words, from where ``store_tiles_t`` packs it). Headdims a
multiple of 8 in 136..256, padded to 256 by TMA's zero fill. Its GPU tests pass
(tests/test_backward_sm90.py's wide grids, H200 and H100). With dQ's atomics it runs when "sm90" is
forced (1.2-2.5x the mma backward on an H100).

With ``dq_split="none"`` the consumers skip dQ's products and reductions: the kernel writes dK and
dV only, and backward_dq_sm90.py's pass makes dQ after it, each in a fixed order. That pair is the
planner's default at these headdims for plain and causal attention, and at 256 with softcap, ALiBi
or dropout, with deterministic=True or not (configs.SM90_PAIR_DEFAULT_HEADDIMS, SM90_PAIR_FEATURES:
1.1-1.4x this kernel with atomics on an H100); its GPU tests pass, every variant included.

Memory and arguments: backward_sm90.py's (the same signature and tensor maps)."""

from dataclasses import dataclass
from functools import lru_cache

from numba import cuda, float32, int32, uint32, uint64

from nbflash.primitives import (
    f32_as_u32,
    inline_device,
    pack_bf16x2,
    pack_f16x2,
    shared_address,
    static_range,
    u32_as_f32,
    unroll,
)
from nbflash.primitives_sm90 import (
    SWIZZLE_128B,
    fence_operands,
    fence_proxy_async,
    launch_bounded,
    make_wgmma_ss,
    mbarrier_arrive,
    mbarrier_wait,
    named_barrier_arrive,
    named_barrier_sync,
    registers_from,
    registers_to,
    setmaxnreg_dec,
    setmaxnreg_inc,
    smem_descriptor,
    tile_base,
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
    make_block_rows,
    make_consumer_step,
    make_init_ring,
    make_issue_keys_by_queries,
    make_probabilities_t,
    make_produce_tiles,
    make_stage_stats,
    make_step_pair,
    make_store_rows,
)
from .forward_sm90 import CHUNK, GROUP, ROW_BYTES
from .geometry import grouped_block, grouped_grid

BLOCK_M = 64  # queries per step: the N of S^T and dP^T, the M of dQ
BLOCK_N = 64  # keys per block: the M of S^T, dP^T, dK and dV
MIN_HEADDIM, MAX_HEADDIM = 136, 256
HEADDIM_PADDED = 256  # four 64-column chunks
HALF = HEADDIM_PADDED // 2  # a consumer's columns


@dataclass(frozen=True)
class Sm90WideBackwardConfig(Sm90BackwardBlock):
    """One compiled variant of the Hopper dK/dV kernel for headdims 136..256, the consumers splitting
    headdim (the backward's preprocess and dq conversion are the portable family's)."""

    dtype: str  # 'float16' or 'bfloat16'
    headdim: int
    variant: Variant = Variant()
    stages: int = 2  # query tiles in flight (the ring)
    producer_registers: int = 40  # setmaxnreg caps (the block holds 384 x 168 registers at entry)
    consumer_registers: int = 232
    heavy_groups: int = 0  # longest-first within groups of (batch, KV head) pairs, as backward_sm90.py's
    # "columns": each consumer adds its half of dQ_i's columns into dq_accum by atomics; "none": no dQ
    # at all (dK and dV only: the deterministic backward, whose dQ is backward_dq_sm90.py's pass)
    dq_split: str = "columns"
    # P^T and dS^T made by both consumers, each for half the step's queries (consumer 0 queries 0-31,
    # consumer 1 32-63), the halves of S^T and dP^T the other holds exchanged through the hand-over;
    # else by consumer 0 alone from dP^T handed over, while consumer 1 waits (the module docstring)
    split_tiles: bool = False
    kernel = "dkdv"  # the backward's plan reads it (one kernel of the three)
    varlen_batch_of_one = True  # packed sequences: as backward_sm90.py's (nbflash/varlen.py)
    consumers = 2
    block_m = BLOCK_M
    block_n = BLOCK_N

    def __post_init__(self):
        self.check_dtype_headdim(MIN_HEADDIM, MAX_HEADDIM)
        if self.dq_split not in ("columns", "none"):
            raise ValueError(f"{self.dq_split=} must be 'columns' (dQ by atomics) or 'none' (no dQ)")
        self.check_block()

    @property
    def atomic_dq(self):
        """dQ goes to dq_accum by atomics; with dq_split="none" there is no dQ here."""
        return self.dq_split != "none"

    @property
    def headdim_padded(self):
        """Four 64-column chunks whatever the headdim (136-256): the tiles' shapes are fixed."""
        return HEADDIM_PADDED

    @property
    def pt_bytes(self):
        """Bytes of the P^T (or dS^T) tile: 64 keys x 64 queries, 16 bit."""
        return BLOCK_N * ROW_BYTES

    @property
    def handover_bytes(self):
        """Bytes of dP^T's hand-over: 64 x 64 float32."""
        return BLOCK_N * BLOCK_M * 4

    @property
    def stats_bytes(self):
        """Bytes of one slot's lse_log2 and D; with a block mask, then the four words of the step
        (backward_sm90.py's ``make_consumer_step``)."""
        return 2 * BLOCK_M * 4 + (16 if self.variant.block_mask else 0)

    @property
    def dynamic_shared_bytes(self):
        """The tiles, the hand-over, the stats, 1 + 2 stages mbarriers, and 1024 bytes of slack to
        align the tiles."""
        return (1024 + 2 * self.kv_bytes + 2 * self.stages * self.q_bytes + 2 * self.pt_bytes + self.handover_bytes
                + self.stages * self.stats_bytes + 8 * (1 + 2 * self.stages))

    def grid(self, batch, nheads, nheads_k, seqlen_q, seqlen_k):
        tiles = -(-seqlen_k // BLOCK_N)
        if self.heavy_groups:
            return grouped_grid(tiles, batch * nheads_k, self.heavy_groups)
        return (tiles, nheads_k, batch)


@lru_cache(maxsize=None)
def build_backward_sm90_wide(config: Sm90WideBackwardConfig):
    """Compile-time constants of ``config`` captured in a fresh ``@cuda.jit`` kernel."""
    BM, BN, HD, STAGES, THREADS = BLOCK_M, BLOCK_N, config.headdim, config.stages, config.threads
    Q_BYTES, KV_BYTES, PT_BYTES, STATS_BYTES = config.q_bytes, config.kv_bytes, config.pt_bytes, config.stats_bytes
    HANDOVER_BYTES = config.handover_bytes
    Q_CHUNK_BYTES, KV_CHUNK_BYTES = BM * ROW_BYTES, BN * ROW_BYTES
    Q_STEPS = BM // 16  # k16 steps over the step's queries (dV, dK)
    KEY_STEPS = BN // 16  # k16 steps over the tile's keys (dQ)
    S_REGS, ACC_REGS, DQ_REGS = BM // 2, HALF // 2, CHUNK // 2
    NT = BM // 8  # 8-query column groups of S^T
    FULL_ARRIVALS = 1 + 32  # the TMA thread's expect_tx and the stats warp's 32 lanes
    EMPTY_ARRIVALS = BOTH = 2 * GROUP  # both consumers' threads
    PRODUCER_REGS, CONSUMER_REGS = config.producer_registers, config.consumer_registers
    HEAVY_GROUPS = config.heavy_groups
    NO_DQ = config.dq_split == "none"  # dK and dV only (the deterministic backward)
    hooks = variants.hooks(config.variant)
    query_tiles, head_context = hooks.query_tiles, hooks.head_context
    # a block mask: the steps walk the visited pairs (backward_sm90.py's make_consumer_step)
    BLOCK_MASK, warp_visited_query_steps = hooks.BLOCK_MASK, hooks.warp_visited_query_steps
    FUSED = hooks.SCORE or hooks.DROPOUT  # dS^T made with P^T, in the hand-over (module docstring)
    VARLEN, sequence = hooks.VARLEN, hooks.sequence  # packed sequences: where this block's rows are
    score_units = hooks.tensor_core_score(False)[0]
    AB = "f16" if config.dtype == "float16" else "bf16"
    # S^T (64 x 64) = K_j (K-major) Q_i^T (K-major), and dP^T = V_j dO_i^T
    issue_keys_by_queries = make_issue_keys_by_queries(make_wgmma_ss(BM, AB, 0), HEADDIM_PADDED, KV_CHUNK_BYTES,
                                                       Q_CHUNK_BYTES)
    wgmma_keys_acc = make_wgmma_ss(HALF, AB, 1)  # dV_c (64 x 128) += P^T (K-major) dO_i's half (MN-major)
    wgmma_dq = make_wgmma_ss(CHUNK, AB, 1, 1)  # dQ (64 x 64) = dS (dS^T read MN-major) K_j's chunk (MN-major)
    K_MAJOR = (16, 1024)  # descriptor strides (bytes): 8-row groups 1024 apart, LBO unused
    STEP16 = 16 * ROW_BYTES >> 4  # descriptor increment of a k16 step of an MN-major tile: 16 rows
    init_ring = make_init_ring(STAGES, FULL_ARRIVALS, EMPTY_ARRIVALS)
    pack = pack_f16x2 if config.dtype == "float16" else pack_bf16x2  # two values into 16-bit halves
    add_dq = make_add_dq(HD, CHUNK)  # a 64-column dQ product into dq_accum
    store_first = make_store_rows(config.dtype, HALF, HALF)  # consumer 0's columns of dK, dV
    store_second = make_store_rows(config.dtype, HD - HALF, HALF)  # consumer 1's (those below headdim)
    block_rows = make_block_rows(hooks, BN)  # where the block's rows are (packed sequences: its sequence's)
    produce_tiles = make_produce_tiles(config, hooks)  # the producer's warp 0
    stage_stats = make_stage_stats(config, hooks)  # the producer's warp 1
    consumer_step = make_consumer_step(hooks, BM, STAGES, STATS_BYTES, make_step_pair(config))
    probabilities_t = make_probabilities_t(hooks, BM, handover=True)  # consumer 0's P^T (and fused dS^T)
    SPLIT_TILES, HALF_REGS = config.split_tiles, S_REGS // 2

    @inline_device
    @unroll
    def issue_keys_acc(acc, desc_a, desc_b):
        """acc += A B over the step's queries (dV_c += P^T dO_i[:, c] or dK_c += dS^T Q_i[:, c]), A
        K-major (k16 step: 32 bytes along a row), B MN-major; one commit group."""
        for ks in static_range(Q_STEPS):
            acc = wgmma_keys_acc(acc, desc_a + uint64(2 * ks), desc_b + uint64(ks * STEP16), uint32(1))
        wgmma_commit()
        return acc

    @inline_device
    @unroll
    def issue_dq(acc, desc_ds, desc_k):
        """acc = dS K_j over the tile's keys for one 64-column chunk, from zero; one commit group."""
        for ks in static_range(KEY_STEPS):
            acc = wgmma_dq(acc, desc_ds + uint64(ks * STEP16), desc_k + uint64(ks * STEP16),
                           uint32(0 if ks == 0 else 1))
        wgmma_commit()
        return acc

    def make_store_tiles_t(first, end, dp_registers):
        """``store_tiles_t(smem, pt_row_word, p, dp, lane_word, stats, g, q4)``: P^T (in p) and dS^T of
        the thread's key rows 16 warp + g, + 8 and query columns 8 c + 2 q4, + 1 for the column groups
        c = first .. end - 1, packed to 16 bits, into the P^T and dS^T tiles: rows of 128 bytes,
        16-byte unit c stored at c ^ g (the 128-byte swizzle wgmma reads; the row's index mod 8 is g).
        dS^T = P^T (dP^T - D[query]), or with a score feature or dropout dP^T's place as it is
        (probabilities_t made dS^T there). dP^T is in registers ``dp`` (``dp_registers``) or in the
        hand-over, register r at word ``lane_word`` + 128 r. ``pt_row_word``: the P^T tile's word of
        the thread's first row plus q4. Both words are made opaque each step: else LLVM makes every
        address once before the loop, and ptxas spills them."""

        @inline_device
        @unroll
        def store_tiles_t(smem, pt_row_word, p, dp, lane_word, stats, g, q4):
            row_word, swizzle, lane_word = fence_operands((pt_row_word, uint32(4 * g), lane_word))
            for c in static_range(first, end):
                d0 = u32_as_f32(smem[stats + BM + 8 * c + 2 * q4])
                d1 = u32_as_f32(smem[stats + BM + 8 * c + 2 * q4 + 1])
                for rh in static_range(2):
                    r = 4 * c + 2 * rh
                    if dp_registers:
                        dp0, dp1 = dp[r], dp[r + 1]
                    else:
                        dp0 = u32_as_f32(smem[lane_word + uint32(r * GROUP)])
                        dp1 = u32_as_f32(smem[lane_word + uint32((r + 1) * GROUP)])
                    ds0, ds1 = dp0, dp1
                    if not FUSED:
                        ds0, ds1 = p[r] * (dp0 - d0), p[r + 1] * (dp1 - d1)
                    word = row_word + uint32(8 * rh * (ROW_BYTES // 4)) + (uint32(4 * c) ^ swizzle)
                    smem[word] = pack(p[r], p[r + 1])
                    smem[word + uint32(PT_BYTES // 4)] = pack(ds0, ds1)

        return store_tiles_t

    store_tiles_t = make_store_tiles_t(0, NT, False)  # consumer 0, the whole step, dP^T handed over

    def make_half_tiles_t(consumer):
        """``half_tiles_t(s, other, smem, lane_word, stats, pt_row_word, key_row0, q_start, seqlen_q,
        seqlen_k, params, head_ctx, scale_log2, units, g, q4, masked)`` (split_tiles): P^T and dS^T of
        ``consumer``'s half of the step's queries (column groups 4 consumer .. 4 consumer + 3,
        registers 16 consumer .. 16 consumer + 15) into the tiles. Its own product's half is in s
        (S^T for consumer 0, dP^T for 1); the other's, which the other left in the hand-over (register r
        at word lane_word + 128 r), is read into ``other`` first."""
        first = HALF_REGS * consumer
        probabilities = make_probabilities_t(hooks, BM, columns=(NT // 2 * consumer, NT // 2 * (consumer + 1)))
        store = make_store_tiles_t(NT // 2 * consumer, NT // 2 * (consumer + 1), True)

        @inline_device
        @unroll
        def half_tiles_t(s, other, smem, lane_word, stats, pt_row_word, key_row0, q_start, seqlen_q, seqlen_k, params,
                         head_ctx, scale_log2, units, g, q4, masked):
            for r in static_range(first, first + HALF_REGS):
                other[r] = u32_as_f32(smem[lane_word + uint32(r * GROUP)])
            if consumer == 0:  # S^T in s, dP^T in other
                probabilities(s, other, smem, stats, key_row0, q_start, seqlen_q, seqlen_k, params, head_ctx, scale_log2,
                              units, q4, masked, uint32(0))
                store(smem, pt_row_word, s, other, lane_word, stats, g, q4)
            else:  # S^T in other, dP^T in s
                probabilities(other, s, smem, stats, key_row0, q_start, seqlen_q, seqlen_k, params, head_ctx, scale_log2,
                              units, q4, masked, uint32(0))
                store(smem, pt_row_word, other, s, lane_word, stats, g, q4)

        return half_tiles_t

    half_tiles_0, half_tiles_1 = make_half_tiles_t(0), make_half_tiles_t(1)

    # -----------------------------------------------------------------------------------------------
    # The kernel
    # -----------------------------------------------------------------------------------------------

    @launch_bounded(THREADS, 1)
    @unroll
    def backward_dkdv_sm90_wide(q, k, v, dout, lse, delta, dk, dv, dq_accum, maps, scale_log2, scale, params):
        if HEAVY_GROUPS:  # (batch, KV head) pairs in groups, key tile by key tile (geometry.py)
            n_block, pair = grouped_block(cuda.blockIdx.x, cuda.blockIdx.y, HEAVY_GROUPS)
            if pair >= q.shape[0] * k.shape[2]:
                return  # the last group's missing pairs: the whole block, before any barrier
            b, hk = pair // k.shape[2], pair % k.shape[2]
        else:
            n_block, hk, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        # Where the block's rows are: the batch index of the arrays it writes (and of TMA's maps),
        # and TMA's first query and key rows (0, or the sequence's first packed rows)
        mem_b, q_row0, seqlen_q, k_row0, seqlen_k, inside = block_rows(params, b, n_block, q.shape[1], k.shape[1])
        if not inside:
            return  # the whole block, before any barrier: its key tile lies past the sequence's end
        tid = cuda.threadIdx.x
        group_id = warpgroup_index(tid)  # 0: the producer; 1 + c: consumer c
        group = q.shape[2] // k.shape[2]  # GQA: query heads hk * group ... share this K/V tile
        n_start = n_block * BN

        # Shared memory: tiles from the first 1024-byte boundary, then the stats and the barriers.
        smem = cuda.shared.array(0, uint32)
        smem_start = shared_address(smem)
        k_tile = tile_base(smem_start)
        v_tile = k_tile + uint32(KV_BYTES)
        q_ring = v_tile + uint32(KV_BYTES)
        do_ring = q_ring + uint32(STAGES * Q_BYTES)
        pt_tile = do_ring + uint32(STAGES * Q_BYTES)
        ds_tile = pt_tile + uint32(PT_BYTES)
        handover = ds_tile + uint32(PT_BYTES)
        stats_ring = handover + uint32(HANDOVER_BYTES)
        kv_full = stats_ring + uint32(STAGES * STATS_BYTES)
        qd_full = kv_full + uint32(8)  # + 8 * slot
        qd_empty = qd_full + uint32(8 * STAGES)
        stats_word0 = (stats_ring - smem_start) // uint32(4)  # smem's index of the first slot's stats

        # Which query tiles see this key tile (geometry.py): [first_tile, end_tile), of which
        # [first_full, end_full) see all of its keys; the key tail always masks. One step per visited
        # (query head of the group, query tile) pair.
        first_tile, first_full, end_full, end_tile = query_tiles(
            n_start, min(n_start + BN, seqlen_k), seqlen_q, seqlen_k, params, BM)
        tail = n_start + BN > seqlen_k
        tiles_per_head = end_tile - first_tile
        steps = warp_visited_query_steps(params, b, hk, group, n_block, first_tile, tiles_per_head, tid % 32)

        if tid == 0:
            init_ring(kv_full, qd_full, qd_empty)
        cuda.syncthreads()  # the barriers are initialised before anyone arrives on or waits for them

        if group_id == 0:
            # ---- Producer: warp 0 issues the copies, warp 1 stages lse and D ----
            setmaxnreg_dec(PRODUCER_REGS)
            warp = tid // 32
            lane = tid % 32
            if warp == 0 and steps > 0:
                produce_tiles(maps, k_tile, v_tile, q_ring, do_ring, kv_full, qd_full, qd_empty, params, b, hk, group,
                              n_block, first_tile, tiles_per_head, steps, q_row0, k_row0, mem_b, lane)
            elif warp == 1:
                stage_stats(smem, stats_word0, qd_full, qd_empty, lse, delta, b, hk, group, n_block, first_tile,
                            tiles_per_head, steps, seqlen_q, params, scale, lane, tail, first_full, end_full, 0,
                            dq_accum, uint32(0), uint32(0), uint32(0))  # (no staged dQ here)
        else:
            # ---- Consumers: columns HALF c .. HALF c + HALF - 1 of dK, dV and dQ each ----
            setmaxnreg_inc(CONSUMER_REGS)
            consumer = group_id - 1
            t = tid % GROUP
            lane = tid % 32
            warp = t // 32
            g, q4 = lane >> 2, lane & 3
            key_row0 = n_start + 16 * warp + g  # the thread's first key row (+8: the second)
            col_chunk = uint32(2 * consumer)  # the consumer's first 64-column chunk
            # the scores' A: K_j (consumer 0) or V_j (consumer 1), K-major
            desc_kv = smem_descriptor(k_tile + uint32(consumer * KV_BYTES), K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)
            desc_pt = smem_descriptor(pt_tile, K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)  # dV's A: P^T, K-major
            desc_dst = smem_descriptor(ds_tile, K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)  # dK's A: dS^T, K-major
            desc_ds = smem_descriptor(ds_tile, PT_BYTES, 1024, SWIZZLE_128B)  # dQ's A: dS (dS^T read MN-major)
            # smem words: the hand-over's register 0 of this thread, and the P^T tile's first row of
            # the thread plus q4 (dS^T's tile follows it)
            handover_lane = uint32((handover - smem_start) // uint32(4) + uint32(t))
            pt_row_word = uint32((pt_tile - smem_start) // uint32(4) + uint32((16 * warp + g) * (ROW_BYTES // 4) + q4))

            # S^T (P^T) or dP^T, and a dQ product: each made from its own last registers, which the
            # first k16 step ignores (scale-d 0); zeros only so that the first step reads defined values
            s = cuda.local.array(S_REGS, float32)
            other = cuda.local.array(S_REGS, float32)  # split_tiles: the other consumer's half, from the hand-over
            dk_acc = cuda.local.array(ACC_REGS, float32)
            dv_acc = cuda.local.array(ACC_REGS, float32)
            dq_acc = cuda.local.array(DQ_REGS, float32)
            for r in static_range(S_REGS):
                s[r] = float32(0)
                dq_acc[r] = float32(0)
            for r in static_range(ACC_REGS):
                dk_acc[r] = float32(0)
                dv_acc[r] = float32(0)

            # the query tiles that see the key tile whole, in 32 bits (64-bit bounds held across the
            # loop spilled)
            full_start, full_end = int32(first_full), int32(end_full)
            if steps > 0:
                mbarrier_wait(kv_full, 0)
            for step in range(steps):
                i = uint32(step)  # unsigned: i % STAGES is an AND, not Python's signed modulo
                if VARLEN:  # the sequence's first query row and lengths, read again each step (L1 hits):
                    # held across the loop, they and what the masks make of them spill
                    q_first, q_rows, _, k_rows = sequence(params, b, q.shape[1], k.shape[1])
                    q_row0, seqlen_q, seqlen_k = int32(q_first), int32(q_rows), int32(k_rows)
                h, tile, step_masked = consumer_step(smem, qd_full, stats_word0, params, b, hk, group, n_block,
                                                     first_tile, tiles_per_head, i)
                slot, use = i % STAGES, i // STAGES
                q_start = tile * BM
                q_slot = q_ring + uint32(slot * Q_BYTES)
                do_slot = do_ring + uint32(slot * Q_BYTES)

                # S^T = K_j Q_i^T (consumer 0) or dP^T = V_j dO_i^T (consumer 1)
                acc_s = fence_operands(registers_from(s, S_REGS))
                mbarrier_wait(qd_full + uint32(8 * slot), use & 1)
                wgmma_fence()  # the accumulator's registers are ordered before wgmma uses them
                acc_s = issue_keys_by_queries(acc_s, desc_kv, smem_descriptor(
                    q_slot if consumer == 0 else do_slot, K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B))
                wgmma_wait(0)
                registers_to(s, fence_operands(acc_s))

                stats = stats_word0 + uint32(slot * (STATS_BYTES // 4))
                # the mask only on tiles crossing the window's edges or a tail (with a block mask, the
                # stats warp's word says it: those or not FULL)
                masked = step_masked if BLOCK_MASK else tail or int32(tile) < full_start or int32(tile) >= full_end
                if SPLIT_TILES:  # each consumer makes P^T and dS^T for its half of the queries
                    head_ctx = head_context(params, b, h)
                    units = score_units(params, scale, head_ctx)
                    # the other's half of this product to the hand-over: register r at word r * GROUP + t
                    lane_word = fence_operands((handover_lane, uint32(0)))[0]  # opaque: see store_tiles_t
                    if consumer == 0:  # S^T's queries 32-63
                        for r in static_range(HALF_REGS, S_REGS):
                            smem[lane_word + uint32(r * GROUP)] = f32_as_u32(s[r])
                    else:  # dP^T's queries 0-31
                        for r in static_range(HALF_REGS):
                            smem[lane_word + uint32(r * GROUP)] = f32_as_u32(s[r])
                    named_barrier_sync(1, BOTH)  # both halves are handed over
                    if masked:
                        if consumer == 0:
                            half_tiles_0(s, other, smem, lane_word, stats, pt_row_word, key_row0, q_start, seqlen_q,
                                         seqlen_k, params, head_ctx, scale_log2, units, g, q4, True)
                        else:
                            half_tiles_1(s, other, smem, lane_word, stats, pt_row_word, key_row0, q_start, seqlen_q,
                                         seqlen_k, params, head_ctx, scale_log2, units, g, q4, True)
                    elif consumer == 0:
                        half_tiles_0(s, other, smem, lane_word, stats, pt_row_word, key_row0, q_start, seqlen_q, seqlen_k,
                                     params, head_ctx, scale_log2, units, g, q4, False)
                    else:
                        half_tiles_1(s, other, smem, lane_word, stats, pt_row_word, key_row0, q_start, seqlen_q, seqlen_k,
                                     params, head_ctx, scale_log2, units, g, q4, False)
                    fence_proxy_async()  # the tiles' stores are ordered before wgmma reads them
                elif consumer == 1:  # dP^T to consumer 0: register r of thread t at word r * GROUP + t
                    lane_word = fence_operands((handover_lane, uint32(0)))[0]  # opaque: see store_tiles_t
                    for r in static_range(S_REGS):
                        smem[lane_word + uint32(r * GROUP)] = f32_as_u32(s[r])
                    named_barrier_arrive(1, BOTH)
                else:
                    head_ctx = head_context(params, b, h)  # (b, h, ALiBi slope): what the variant reads per head
                    units = score_units(params, scale, head_ctx)  # the score features' constants for this head
                    lane_word = handover_lane  # read by probabilities_t only when FUSED
                    if FUSED:  # dS^T is made with P^T: dP^T first
                        named_barrier_sync(1, BOTH)
                        lane_word = fence_operands((handover_lane, uint32(0)))[0]  # opaque: see store_tiles_t
                    if masked:
                        probabilities_t(s, lane_word, smem, stats, key_row0, q_start, seqlen_q, seqlen_k, params,
                                        head_ctx, scale_log2, units, q4, True, uint32(0))
                    else:
                        probabilities_t(s, lane_word, smem, stats, key_row0, q_start, seqlen_q, seqlen_k, params,
                                        head_ctx, scale_log2, units, q4, False, uint32(0))
                    if not FUSED:
                        named_barrier_sync(1, BOTH)  # dP^T is handed over
                    store_tiles_t(smem, pt_row_word, s, s, handover_lane, stats, g, q4)
                    fence_proxy_async()  # the tiles' stores are ordered before wgmma reads them
                named_barrier_sync(2, BOTH)  # P^T and dS^T are stored

                # dV_c += P^T dO_i[:, c], dK_c += dS^T Q_i[:, c], and dQ_i's first 64 columns of c
                acc_dv = fence_operands(registers_from(dv_acc, ACC_REGS))
                acc_dk = fence_operands(registers_from(dk_acc, ACC_REGS))
                if not NO_DQ:
                    acc_q = fence_operands(registers_from(dq_acc, DQ_REGS))
                wgmma_fence()
                acc_dv = issue_keys_acc(acc_dv, desc_pt, smem_descriptor(
                    do_slot + col_chunk * uint32(Q_CHUNK_BYTES), Q_CHUNK_BYTES, 1024, SWIZZLE_128B))
                acc_dk = issue_keys_acc(acc_dk, desc_dst, smem_descriptor(
                    q_slot + col_chunk * uint32(Q_CHUNK_BYTES), Q_CHUNK_BYTES, 1024, SWIZZLE_128B))
                if not NO_DQ:
                    acc_q = issue_dq(acc_q, desc_ds, smem_descriptor(
                        k_tile + col_chunk * uint32(KV_CHUNK_BYTES), KV_CHUNK_BYTES, 1024, SWIZZLE_128B))
                wgmma_wait(0)
                registers_to(dv_acc, fence_operands(acc_dv))
                registers_to(dk_acc, fence_operands(acc_dk))
                if not NO_DQ:
                    registers_to(dq_acc, fence_operands(acc_q))
                mbarrier_arrive(qd_empty + uint32(8 * slot))  # this thread is done with the slot
                if not NO_DQ:  # (the deterministic backward's dQ is the dQ kernel's, after this one)
                    row = q_row0 + q_start + 16 * warp + g
                    add_dq(dq_accum, dq_acc, mem_b, row, h, HALF * consumer, q_row0 + seqlen_q, q4)
                    # ... and its second 64 columns
                    acc_q = fence_operands(registers_from(dq_acc, DQ_REGS))
                    wgmma_fence()
                    acc_q = issue_dq(acc_q, desc_ds, smem_descriptor(
                        k_tile + (col_chunk + uint32(1)) * uint32(KV_CHUNK_BYTES), KV_CHUNK_BYTES, 1024,
                        SWIZZLE_128B))
                    wgmma_wait(0)
                    registers_to(dq_acc, fence_operands(acc_q))
                    add_dq(dq_accum, dq_acc, mem_b, row, h, HALF * consumer + CHUNK, q_row0 + seqlen_q, q4)

            # ---- Write dK_c = dS^T Q * scale and dV_c (keys no query sees get 0) ----
            if VARLEN:  # the key rows again: not held across the loop
                _, _, k_first, k_rows = sequence(params, b, q.shape[1], k.shape[1])
                k_row0, seqlen_k = int32(k_first), int32(k_rows)
            if consumer == 0:
                store_first(dk, dk_acc, mem_b, k_row0 + key_row0, hk, k_row0 + seqlen_k, scale, q4)
                store_first(dv, dv_acc, mem_b, k_row0 + key_row0, hk, k_row0 + seqlen_k, float32(1), q4)
            else:
                store_second(dk[:, :, :, HALF:], dk_acc, mem_b, k_row0 + key_row0, hk, k_row0 + seqlen_k, scale, q4)
                store_second(dv[:, :, :, HALF:], dv_acc, mem_b, k_row0 + key_row0, hk, k_row0 + seqlen_k, float32(1),
                             q4)

    return backward_dkdv_sm90_wide
