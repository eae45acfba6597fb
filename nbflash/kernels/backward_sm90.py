"""FlashAttention backward on Hopper (sm_90a): the dK/dV pass on wgmma and TMA, warp-specialized.

The algorithm is backward_mma.py's (the paper's Algorithm 2, read that file first), with the
Hopper forward's machinery (forward_sm90.py: the producer warpgroup, the mbarrier ring, TMA's
swizzled tiles, wgmma's accumulator layout). Per (batch, head), with D = rowsum(dO * O) from the
preprocess::

    for each tile of block_n keys K_j, V_j (one thread block; loaded once by TMA):
        producer warpgroup:
            warp 0, one elected thread: K_j, V_j -> shared memory (completing on kv_full); then for
                the i-th step (a query head of the GQA group and a query tile Q_i that sees K_j):
                wait until ring slot i % stages is empty, then Q_i, dO_i -> the slot (TMA)
            warp 1: the same steps; lse_i (in base 2) and D_i of the tile's rows -> the slot's
                stats (plain loads and stores), arriving on the slot's full barrier with the TMA;
                with dq_reduce="tiles", then, once both consumers have staged dQ_{i-1}, the tile ->
                dq_accum (one bulk reduce-add), and the staged tile is free again
        each consumer warpgroup c (64 keys of the tile, rows 64 c .. 64 c + 63):
            dK = dV = 0                                                    (registers)
            for the i-th step (slot i % stages), once the slot is full:
                S^T  = K_c Q_i^T,  dP^T = V_c dO_i^T         (wgmma, both operands in shared memory)
                P^T  = exp2(S^T * scale_log2 - lse_log2[query])   (0 where masked: only on tiles
                                        crossing the window's edges or a tail; while dP^T is in flight)
                dS^T = P^T * (dP^T - D[query])
                dV  += P^T dO_i,  dK += dS^T Q_i          (wgmma, P^T and dS^T from registers)
                dS^T -> shared memory (16 bit, the 128-byte swizzle)
                dQ_i += dS K_c                       (wgmma from shared memory, A transposed: dS^T
                                                            read as dS; into dq_accum by red.add,
                                                            or staged for warp 1)
                arrive on the slot's empty barrier (the producer may refill it)
            dK *= scale; write dK, dV

Working on the transposed scores keeps a consumer's accumulator rows on its own keys (as in the
mma backward): P^T and dS^T are in the accumulator layout of a 64-row wgmma, which is the register
A operand of dV += P^T dO and dK += dS^T Q, so neither leaves the registers for those products;
dK and dV stay in registers for the whole loop, summed over the GQA group's query heads in a fixed
order. Q_i and dO_i are read through two descriptors each: K-major (queries by headdim, the B of
S^T and dP^T) and MN-major (the same bytes as queries by headdim with headdim contiguous, the B of
dV and dK). dQ needs dS with queries as its rows: the stored dS^T (rows of 64 queries, 128 bytes)
is exactly the MN-major image of dS, which wgmma reads with its A-transpose flag. Each consumer
adds its own 64 keys' share of dQ_i (K = its 64 keys), so the two consumers never wait for each
other; the float32 atomics land in ``dq_accum``, which the portable convert_dq kernel scales and
narrows, as for the mma family. With ``dq_split="columns"`` each consumer instead adds half of
headdim's columns over all block_n keys, reading both consumers' dS^T tiles (laid side by side),
after a barrier across both: half the atomics. With ``dq_split="steps"`` (any headdim) the
consumers take turns by step parity, the one whose turn it is adding the whole dQ_i over all block_n
keys: half the atomics too. The plan uses "columns" at headdim 128 and "steps" at 64
(configs.SM90_BACKWARD: 21-32% and 6-11% faster than "keys" on the H200). With "columns" the plan
also issues dQ_i's product first (``dq_first``): the consumer adds it to dq_accum while dV's and
dK's products run, instead of after all three (10-16% faster at headdim 128). With it
the plan then takes ``dq_reduce="tiles"`` (FlashAttention-3's form; configs.SM90_BACKWARD_DQ_TILES,
6-10% faster again at headdim 128): the consumers store dQ_i into a shared tile in wgmma's fragment
order instead, and the producer's stats warp adds it into a tile-major dq_accum by one bulk
reduce-add a step (``make_stage_dq``, ``make_add_staged_dq``), which the conversion reads in that
order (``Sm90ConvertDqConfig``). Packed sequences take it too (configs.
SM90_BACKWARD_VARLEN_DQ_TILES: each sequence's tiles start on a whole tile of dq_accum,
``padded_first_row``), unless they are too short for that padding (configs.packed_dq_tiles_fit).

With ``block_m=128`` and ``dq_split="rows"`` (headdims up to 64; for plain and windowed attention
planned from 33 on, configs.SM90_BACKWARD_KEYS128: 1.03-1.10x the rows split at hd 64 on an H100;
FlashAttention-3's hd 64 shape, docs/perf-notes.md "Hopper backward" step 40) a step
takes 128 query rows: each consumer's S^T and dP^T are its 64 keys by all 128 queries (m64n128), P^T
and dS^T are 8 k16 steps of dV's and dK's register A operands, each dS^T tile is two 64-query chunks
(the first chunk of both consumers' tiles side by side, then the second), and consumer c adds the
whole dQ of query rows 64 c .. 64 c + 63 over all block_n keys (dS from chunk c), first and
tile-major: one 64-row unit of the staged tile, as backward_sm90_rows.py's "tiles" form stages it.
The masks and ALiBi build in this form too (``keys128_serves``; planned with
configs.SM90_BACKWARD_KEYS128_VARIANTS), softcap, a float bias, score_mod and dropout
not (their loops spill at 128 query rows). Packed sequences take this form where
configs.SM90_BACKWARD_VARLEN_KEYS128 and the padding of 128-row tiles fits: each
sequence's tiles then start on a whole 128-row tile of dq_accum, and the conversion pads to the
same (``Sm90ConvertDqConfig.tile_rows``).

Grid and threads: grid = (ceil(seqlen_k / block_n), nheads_k, batch), or with ``heavy_groups`` G
(G ceil(seqlen_k / block_n), ceil(batch nheads_k / G), 1): each row of blocks a group of G (batch,
KV head) pairs, key tile by key tile; block = 128 * (consumers + 1) threads; block_n = 64 *
consumers, block_m = 64 (or 128, above).

Shared memory (dynamic, every tile 1024-byte aligned): K_j, V_j (block_n rows), the ring of Q_i and
of dO_i tiles (block_m rows each), the consumers' dS^T tiles (two each, for even and odd steps: 64
keys x block_m queries), the ring's stats (lse_log2 and D, block_m floats each per slot), then the
mbarriers. A tile is stored as its 64-column chunks (headdim padded to a multiple of 64 by TMA's
zero fill), rows of 128 bytes in the 128-byte swizzle, as in forward_sm90.py.

Memory: q, dout (batch, seqlen_q, nheads, headdim), k, v (batch, seqlen_k, nheads_k, headdim), any
strides that are multiples of 16 bytes with the last dimension contiguous, headdim a multiple of 8
up to 128; float16 arrays, or uint16 arrays holding bfloat16 bits. lse, delta float32 (batch,
nheads, seqlen_q); dk, dv like k, v (C-contiguous); dq_accum float32 like q, zeroed by the
preprocess (tile-major with dq_reduce="tiles": ``dq_accum_shape``, zeroed by the launcher); dq like q
(C-contiguous), written only where the kernel converts dQ itself (``fold_dq``). ``maps`` holds the
four 4-D tensor maps of q, k, v and dout (``tensor_maps``), built by the launcher. A row with lse
= -inf (it sees no key) and rows past seqlen_q get lse_log2 = +inf, so their P is exactly 0; keys
past seqlen_k are masked, and their dK, dV rows are not written.

Variants: the window (causal included); the element masks (the mask tensor, mask_mod), tested at
the mask point of every visited tile (none is known to be whole with them, except the pairs a
block mask's table calls FULL; the pairs it calls EMPTY are never visited: the producer's two warps
walk the visited (query head, query tile) pairs, 32 classes a read, ``warp_visit_query_step``,
every warp counts them the same way, ``warp_visited_query_steps``, and the stats warp hands each
step to the consumers with its slot); the score features
(softcap, ALiBi, the bias tensor, score_mod), whose scores come from the tensor-core score point of
the raw S^T (``Hooks.tensor_core_score``, as in the mma backward) and whose derivative multiplies
dS^T; and dropout, whose factors (the forward's Philox stream, ``Hooks.dropout_bits_t``: made by
each consumer lane, or with ``dropout_bits="producer"`` by the producer's idle warps 2 and 3 into the
ring slot, ``make_stage_dropout``) multiply the P^T that dV takes and dP^T. With a score feature or
dropout, dS^T is made with P^T once dP^T has landed. Headdims above 128 (dK and dV of 64 keys at
headdim 256 would need all of a consumer's registers) go to backward_sm90_wide.py (every variant,
through this file's ``make_*`` device functions). The deterministic mode (a fixed order instead
of atomics) runs this kernel with ``dq_split="none"`` (dK and dV only) and then
backward_dq_sm90.py's dQ kernel.

Schedules measured on the H200 and taken out again for being slower (docs/perf-notes.md, "Hopper
backward", steps 6, 7, 9 and 11; the code is in commit 354c94b): dQ_i staged in shared memory and
added by TMA reduce-adds (``dq_reduce="tma"``: within noise), the key tiles as the grid's slowest
index (``heavy_first``: -8% to +3%), dQ_i's atomics deferred under the next step's products
(``defer_dq``: 3-9% slower) and 128 query rows per step with dQ by columns and atomics
(``block_m=128`` then: 12-13% slower; step 40's form above is another). Steps 30 and 31 (the code
is in commit 5b92983): dQ_i staged as rows and added by one bulk reduce-add a row
(``dq_reduce="bulk"``, by columns and by keys, and on backward_sm90_rows.py: 13-47% slower).

Packed sequences (``variant.varlen``): q, k, v, dout are stride-0 views over batch of the packed
arrays (as in backward_mma.py), lse, delta, dk, dv and dq_accum the packed arrays as a batch of one
(nbflash/varlen.py; narrowed views, as the mma family takes them, would keep their strides in
registers: 468 bytes spilled at hd 128). grid.x covers the longest key sequence; a block reads its
sequence's first rows and lengths (``sequence``, from cu_seqlens in ``params``), exits at once if
its key tile lies past the sequence's end, and otherwise offsets every row it reads or writes by
the sequence's first. TMA reads the packed arrays (the maps are those of a batch of one:
``tensor_maps``) at the sequence's first row plus the tile's. A tile crossing the
sequence's end so reads the next sequence's rows (or zeros past the last one), which the dense
layout's tails already make harmless: rows past seqlen_q get lse = +inf (P = 0, dS = 0, no dq
added), keys past seqlen_k are masked (P = 0) and their dK, dV rows not written. What such rows
hold only meets a zero, so finite values there change nothing; a NaN or an infinity in another
sequence's rows would (0 x NaN), where the mma family never reads them.
"""

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, uint32, uint64
from numba.extending import register_jitable

from nbflash.primitives import (
    exp2_approx,
    f32_as_u32,
    global_address,
    inline_device,
    load_u32x4_cg,
    load_u32x4_nc,
    pack_bf16x2,
    pack_f16x2,
    red_add_f32x2,
    shared_address,
    shuffle_xor_u32,
    static_range,
    store_u32,
    store_u32x4,
    u32_as_f32,
    unroll,
)
from nbflash.primitives_sm90 import (
    SWIZZLE_128B,
    array_address,
    bulk_reduce_add_f32,
    bulk_wait,
    cached_tensor_maps,
    check_register_split,
    elect_sync,
    fence_mbarrier_init,
    fence_operands,
    fence_proxy_async,
    fence_proxy_async_global,
    fence_proxy_tensormap_acquire,
    k_step,
    launch_bounded,
    make_wgmma_rs,
    make_wgmma_ss,
    mbarrier_arrive,
    mbarrier_arrive_expect_tx,
    mbarrier_init,
    mbarrier_wait,
    named_barrier_arrive,
    named_barrier_sync,
    registers_from,
    registers_to,
    setmaxnreg_dec,
    setmaxnreg_inc,
    smem_descriptor,
    store_shared_f32x4,
    store_shared_u32,
    tensor_map_4d_words,
    tile_base,
    tma_load_4d,
    tma_store_4d,
    tma_store_commit,
    tma_store_wait,
    warpgroup_index,
    wgmma_commit,
    wgmma_fence,
    wgmma_wait,
)
from nbflash.problem import Variant

from . import variants
from .geometry import grouped_block, grouped_grid, packed_sequence
from .forward_sm90 import CHUNK, GROUP, ROW_BYTES

LOG2E = math.log2(math.e)
KEYS = 64  # keys per consumer warpgroup: the M of its wgmmas
MAX_SHARED_BYTES = 232448  # dynamic shared memory a block may have on compute capability 9.0
MAX_HEADDIM = 128
# With fold_dq, the steps a block may have (a bit each in shared memory: 1 KB): a GQA group of 8 query
# heads up to 64k query rows in tiles of 64. Past it the launcher takes the conversion kernel.
FOLD_STEPS = 8192
# The sm90 backward serves every variant. Each feature enters through the hooks: the window, the
# element masks (mask tensor, mask_mod: then no tile is whole, Hooks.query_tiles, except the pairs a
# block mask calls FULL), a block mask's EMPTY pairs skipped (the steps walk the pairs visited), the
# score features (softcap, ALiBi, bias, score_mod: the tensor-core score point, as in the mma
# backward), dropout, and packed sequences (the layout: ``Hooks.sequence``, TMA's rows offset).


class Sm90BackwardBlock:
    """What the Hopper backward's configs share (this file's dK/dV kernel, the rows split's, the wide
    kernel's and the dQ kernel's): a producer warpgroup and ``consumers`` consumer warpgroups of
    sm_90a code, and the checks of the fields they all have."""

    arch_suffix = "a"  # wgmma, TMA and setmaxnreg assemble for sm_90a only
    rotate = False  # query tiles in order (``make_step_pair``); a field where a kernel offers rotating them

    @property
    def threads(self):
        return GROUP * (self.consumers + 1)

    @property
    def launch_bounds(self):
        return (self.threads, 1)

    @property
    def headdim_padded(self):
        """headdim rounded up to whole 64-column chunks (TMA fills the rest with zeros)."""
        return -(-self.headdim // CHUNK) * CHUNK

    @property
    def q_bytes(self):
        """Bytes of one Q (or dO) tile: block_m rows of headdim_padded 16-bit elements."""
        return self.block_m * self.headdim_padded * 2

    @property
    def kv_bytes(self):
        """Bytes of one K (or V) tile: block_n rows."""
        return self.block_n * self.headdim_padded * 2

    @property
    def dq_tile_major(self):
        """``dq_reduce="tiles"`` (in the configs that have the field): dq_accum held tile by tile in
        wgmma's fragment order (``dq_accum_shape``, ``Sm90ConvertDqConfig``), dQ_i staged in shared memory in the
        same order by the consumers and added by the producer's stats warp, one bulk reduce-add a step."""
        return getattr(self, "dq_reduce", "red") == "tiles"

    @property
    def dq_stage_bytes(self):
        """Bytes of the staged dQ tile (``dq_tile_major``; none otherwise): block_m x headdim_padded
        float32, unpadded (16-byte stores of consecutive threads: no bank conflicts)."""
        return self.block_m * self.headdim_padded * 4 if self.dq_tile_major else 0

    def replaced(self, **changes):
        """``dataclasses.replace(self, **changes)``, less what the changes leave no room for, unless
        they set it themselves: ``dq_warp`` where they take away what warp 2 needs (the staged dQ:
        atomics, dQ last; or warps 2 and 3: the producer's keep bits), and ``fold_dq`` with it,
        ``store_quads`` where they
        set ``store_tma`` (dK's and dV's other stores). The one place that switches a planned option
        off for a plan changed by hand (configs.plan_backward's fallback, the schedules, the tests'
        fixtures). Configs without those fields (the other sm90 kernels) get the plain replace."""
        if changes.get("store_tma") and getattr(self, "store_quads", False) and "store_quads" not in changes:
            changes = {**changes, "store_quads": False}
        fold = getattr(self, "fold_dq", False)  # (warp 2's too: dropped with it)
        if fold and changes.get("dq_warp", True) is False and "fold_dq" not in changes:
            changes = {**changes, "fold_dq": False}
        if not getattr(self, "dq_warp", False) or "dq_warp" in changes:
            return replace(self, **changes)
        config = replace(self, **{**changes, "dq_warp": False, **({"fold_dq": False} if fold else {})})
        if not config.dq_tile_major or config.staged_dropout:
            return config
        return replace(config, dq_warp=True, **({"fold_dq": changes.get("fold_dq", True)} if fold else {}))

    def check_dq_reduce(self):
        if self.dq_reduce not in ("red", "tiles"):
            raise ValueError(f"{self.dq_reduce=} must be 'red' or 'tiles'")

    def check_dtype_headdim(self, low, high):
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"{self.dtype=} must be 'float16' or 'bfloat16'")
        if self.headdim % 8 or not low <= self.headdim <= high:
            raise ValueError(f"{self.headdim=} must be a multiple of 8 in {low}..{high}")

    def check_block(self):
        """The ring, the launch order, the register split and shared memory (once the fields the
        sizes depend on are checked)."""
        if self.stages < 2:
            raise ValueError(f"{self.stages=}: the ring needs at least 2 stages")
        if getattr(self, "heavy_groups", 0) < 0:
            raise ValueError(f"heavy_groups={self.heavy_groups} must be 0 (off) or a group size")
        if self.consumers == 2:  # setmaxnreg splits the registers (one consumer keeps the entry cap)
            check_register_split(self.threads, self.producer_registers, self.consumer_registers, self.consumers)
        if self.dynamic_shared_bytes > MAX_SHARED_BYTES:
            raise ValueError(f"{self.dynamic_shared_bytes} bytes of shared memory exceed a block's "
                             f"{MAX_SHARED_BYTES}: fewer stages")


def keys128_serves(variant):
    """``block_m=128`` (step 40's form) builds ``variant``: anything but softcap, a float bias,
    score_mod and dropout, whose loops spill at 128 query rows a step (ptxas 13.5 at hd 64, causal:
    88, 147 and 327 local accesses a step for softcap, the bias and dropout; the window, ALiBi, the
    element and block masks 0-4; docs/perf-notes.md "Step 40 for the masks and ALiBi")."""
    return not (variant.softcap or variant.bias or variant.score_mod or variant.dropout)


@dataclass(frozen=True)
class Sm90BackwardConfig(Sm90BackwardBlock):
    """One compiled variant of the Hopper dK/dV kernel (the backward's preprocess and dq conversion
    are the portable family's; with ``dq_reduce="tiles"`` the conversion is ``Sm90ConvertDqConfig``)."""

    dtype: str  # 'float16' or 'bfloat16'
    headdim: int  # a multiple of 8, at most 128
    variant: Variant = Variant()
    consumers: int = 2  # consumer warpgroups of 64 keys: block_n = 64 * consumers
    stages: int = 2  # query tiles in flight (the ring)
    producer_registers: int = 40  # setmaxnreg caps with two consumers (the register file: 64K)
    consumer_registers: int = 232
    overlap: bool = True  # P^T's exponentials run while dP^T's product is in flight
    # query rows per step: the N of S^T = K Q^T; 128 takes dq_split="rows" (dS^T's rows are then two
    # 64-query chunks of 128 bytes) or "none" (the deterministic backward's dK/dV pass), headdims up to
    # 64, plain or windowed attention
    block_m: int = 64
    # dQ_i's split between the consumers: "keys", each adds dS K_c for its own 64 keys and all of
    # headdim; "columns", each adds half of headdim's columns over all block_n keys (half the atomics,
    # a barrier across both consumers per step; two consumers, headdim padded to 64 or 128: halves of
    # 32 or 64 columns, the N of its wgmma); "steps", the
    # consumers take turns by step parity, each adding the whole dQ_i over all block_n keys on its
    # steps (half the atomics as well, for any headdim; two consumers); "none", no dQ at all: the
    # deterministic backward's dK/dV pass (backward_dq_sm90.py makes dQ in a fixed order), without
    # dS^T's stores, their barrier, the dQ products and the atomics; "rows" (block_m 128, headdim up to
    # 64, dQ first and tile-major: FlashAttention-3's hd 64 shape, step 40), each consumer adds the
    # whole dQ of its 64 of the step's 128 query rows, over all block_n keys
    dq_split: str = "keys"
    # Longest-first within groups of this many (batch, KV head) pairs (0: off, a head's key tiles
    # side by side): the grid walks the groups one after another and, inside a group, key tile 0 of
    # every pair, then tile 1, ...; so the blocks running together read a few heads' Q and dO
    # (locality), and the last wave holds the shortest blocks, where the default order leaves the
    # last head's heaviest tile to start near the end. A dispatch model (greedy, 132 SMs, block
    # time = its steps) put the default's tail at +7% over the ideal at causal hd 128 4k and this
    # order's at +0.0% with groups of 4-8. (All pairs in one group, key tiles slowest, was measured
    # too, as ``heavy_first``: -8% to +3%, its blocks reading many heads at once; docs/perf-notes.md
    # step 7, the code in commit 354c94b.)
    heavy_groups: int = 0
    # Dropout's keep bits: "consumers", each consumer lane makes its Philox calls as it makes P^T
    # (one call per eight scores, four bits traded with lane ^ 4); "producer", the producer
    # warpgroup's idle warps 2 and 3 make the same calls for every lane ahead of the step, into the
    # ring slot beside lse and D, and a consumer lane reads one word a step (no Philox rounds, and
    # none of their registers, in the consumers' loop). Planned past headdim 64 (docs/perf-notes.md,
    # "Hopper backward", step 26: +6% causal at hd 128; at hd 64, 20-25% slower)
    dropout_bits: str = "consumers"
    # dQ_i's product issued before dV's and dK's ("columns" only, one dQ product a step): the
    # consumer waits for it alone and adds it to dq_accum while the tensor cores run dV's and dK's
    # products, where the reductions otherwise start after all three have landed (the stall counters
    # of docs/perf-notes.md step 28: the reductions' queue held the consumer for about a fifth of
    # its step). Planned with "columns" (step 28: +10-16% at hd 128). ("steps" would issue it on a
    # consumer's turn only, a branch around the wgmmas that ptxas serializes: not offered.)
    dq_first: bool = False
    # How dQ_i reaches dq_accum: "red", each consumer thread's red.add.v2 of its registers; "tiles"
    # (with dq_first; FlashAttention-3's form), each consumer stores its half in
    # wgmma's fragment order into a shared tile (16-byte stores of consecutive threads) and arrives
    # on dq_full, and the producer's stats warp adds the whole tile by one bulk reduce-add (the copy
    # engine's: no consumer issues or waits for a reduction), then frees it (dq_empty). dq_accum
    # holds each query tile in that order (``dq_accum_shape``), which the conversion reads
    # (``Sm90ConvertDqConfig``). Step 28's stall counters put about a fifth of the consumers'
    # samples on the reductions; docs/perf-notes.md steps 32 and 33. (Steps 30 and 31 staged rows,
    # one bulk reduce-add a row: 13-47% slower, taken out; step 6, TMA tensor reduce-adds issued
    # and waited for by a consumer thread: within noise, taken out; their code is in history,
    # perf-notes says where.) Planned: "tiles" at headdims 72-128 (configs.planned_backward_sm90_config;
    # step 35, +6-10% at 128), for packed sequences too (step 37, +6-12%: each sequence's tiles from
    # its ``padded_first_row`` of dq_accum) unless they are too short for that padding (step 38,
    # configs.packed_dq_tiles_fit: "red" then).
    dq_reduce: str = "red"
    # With dq_reduce="tiles": the producer's warp 2 adds the staged dQ_i into dq_accum (waits for
    # dq_full, the bulk reduce-add, waits for its read, frees the tile), so the stats warp only
    # stages lse and D, never behind the dQ reductions' waits (``make_reduce_staged_dq``). In step
    # 40's profile at hd 64 16k the consumers waited at the ring's full barrier for a quarter of
    # their samples while the stats warp never waited for a free slot (docs/perf-notes.md, "The
    # stats warp's two duties apart"). Not with the producer's keep bits (warps 2 and 3 busy).
    # Planned with stats_ahead wherever dQ_i is staged (configs.SM90_BACKWARD_DQ_WARP: +17% to +45% at
    # hd 64, +7% to +25% at hd 128 on an H100), for packed sequences an option (built since, not timed:
    # configs.SM90_BACKWARD_VARLEN_DQ_WARP)
    dq_warp: bool = False
    # The stats warp loads step i + 1's lse and D (and walks to its pair) right after arriving on
    # step i's full barrier, holding them in registers until step i + 1's stores, so that the loads'
    # latency passes under step i - 1's dQ add (with dq_reduce="tiles" and without dq_warp) and the
    # wait for step i + 1's slot, instead of adding to the warp's chain each step (``make_stage_stats``).
    # In step 40's profile at hd 64 16k the stats warp waited on its own lse loads and on the staged
    # dQ's reduce-add, never for a free slot, while the consumers waited at the ring's full barrier for
    # a quarter of their samples (docs/perf-notes.md, "The stats warp's two duties apart" and "The
    # stats warp's loads a step ahead"). With or without dq_warp; planned with it (configs.SM90_BACKWARD_DQ_WARP)
    stats_ahead: bool = False
    # Block n's walk over its query tiles starts n tiles on (mod the tiles it visits), so that the
    # blocks of a head running together add into different rows of dq_accum (``make_step_pair``;
    # docs/perf-notes.md step 43). Not with a block mask, whose visited pairs are walked in order.
    # Measured on the 64-row kernels (not planned); on step 40's an option until timed (perf-notes,
    # "The blocks of a head adding into one dQ tile")
    rotate: bool = False
    # dK and dV stored 16 bytes a lane after a transpose across each quad (``make_store_rows``'s
    # quads; docs/perf-notes.md step 55), instead of a 32-bit pair a store. Planned in the rows split
    # (configs.SM90_BACKWARD_ROWS_STORE_QUADS), an option here: at hd 128 it measured -8.6% to +5%
    # (H100, twenty-second session). The simulator tests the shared store code through it
    store_quads: bool = False
    # dK and dV written into K_j's and V_j's tiles once the loop is done with them (the tiles'
    # layout), then stored by TMA from the producer's warp 0, one 64 x 64 box a chunk and consumer
    # (``make_store_tma``; docs/perf-notes.md step 57). Not for packed sequences (a box would write
    # the next sequence's rows). An option until timed
    store_tma: bool = False
    # dS^T's tiles: two sets, by step parity (a consumer writes step i + 1's while the other's dQ_i
    # product may still read step i's), or one set (1; dq_split="rows" only), where the consumers
    # meet at a named barrier before each step's dS^T stores (both past their wait for the last
    # step's dQ product). One set frees 32 KB at hd 64, room for a third ring stage (stages=3) that
    # two sets leave 1,096 bytes short of (docs/perf-notes.md, "A third ring stage for step 40 at hd
    # 64"). An option until timed
    ds_buffers: int = 2
    # The dQ conversion folded into this kernel, with dq_warp (docs/perf-notes.md "The dQ conversion
    # folded into the dK/dV kernel"): warp 2 counts each step's arrival on its query tile once the
    # step's bulk reduce-add is complete, a step late (``make_count_arrival``: a float32 counter per
    # (batch, query head, query tile) past the tiles in dq_accum, zeroed with it); the arrival that
    # completes the tile's count of visiting key tiles marks the step in shared memory, and once the
    # loop is done the consumers' eight warps convert the marked tiles from L2 (``make_convert_marked``:
    # dq = dq_accum * scale in the input dtype, as ``Sm90ConvertDqConfig``), so no conversion kernel
    # reads dq_accum back from memory afterwards. The kernel writes dq (its argument after dq_accum,
    # ``takes_dq``). Dense sequences without a block mask (whose counts the table would give); at most
    # ``FOLD_STEPS`` steps a block (the launcher takes the conversion kernel past that). An option
    # until timed (configs.SM90_BACKWARD_FOLD_DQ)
    fold_dq: bool = False
    kernel = "dkdv"  # the backward's plan reads it (one kernel of the three)
    takes_dq = True  # the kernel takes dq after dq_accum (and writes it with fold_dq)
    # packed sequences: lse, delta, dk, dv and dq_accum come as the packed arrays (a batch of one),
    # whose rows the kernel offsets itself (nbflash/varlen.py; the module docstring)
    varlen_batch_of_one = True

    def __post_init__(self):
        self.check_dtype_headdim(8, MAX_HEADDIM)
        if self.consumers not in (1, 2):
            raise ValueError(f"{self.consumers=} must be 1 or 2")
        if self.dq_split not in ("keys", "columns", "steps", "none", "rows"):
            raise ValueError(f"{self.dq_split=} must be 'keys', 'columns', 'steps', 'none' or 'rows'")
        if self.dq_split in ("columns", "steps", "rows") and self.consumers != 2:
            raise ValueError(f"dq_split={self.dq_split!r} takes two consumers, not {self.consumers=}")
        if self.dropout_bits not in ("consumers", "producer"):
            raise ValueError(f"{self.dropout_bits=} must be 'consumers' or 'producer'")
        if self.dq_first and self.dq_split not in ("columns", "rows"):
            raise ValueError(f"dq_first=True takes dq_split='columns' or 'rows' (one dQ product a step), not "
                             f"{self.dq_split!r}")
        if self.block_m not in (64, 128):
            raise ValueError(f"{self.block_m=} must be 64 or 128")
        if self.dq_split not in ("rows", "none") if self.block_m == 128 else self.dq_split == "rows":
            raise ValueError(f"block_m=128 goes with dq_split='rows' (or 'none': no dQ), and 'rows' only with it, got "
                             f"{self.block_m=} and {self.dq_split=}")
        if self.block_m == 128 and (self.headdim_padded != 64 or not keys128_serves(self.variant)):
            raise ValueError(f"block_m=128 takes headdim <= 64 and neither softcap, a float bias, score_mod nor "
                             f"dropout, got {self.headdim=}, {self.variant}")
        if self.dq_split == "rows" and (not self.dq_first or self.dq_reduce != "tiles"):
            raise ValueError(f"dq_split='rows' takes dq_first=True and dq_reduce='tiles', got {self.dq_first=}, "
                             f"{self.dq_reduce=}")
        if self.block_m == 128 and (self.store_quads or self.store_tma):
            raise ValueError("block_m=128 is built without store_quads and store_tma (neither tested there), got "
                             f"{self.store_quads=}, {self.store_tma=}")
        self.check_dq_reduce()
        if self.dq_reduce == "tiles" and not self.dq_first:
            raise ValueError("dq_reduce='tiles' takes dq_first=True (dQ split by columns, its product first), "
                             f"not dq_split={self.dq_split!r} with dq_first={self.dq_first}")
        if self.store_tma and (self.variant.varlen or self.store_quads):
            raise ValueError("store_tma=True takes neither packed sequences (a box would write the next "
                             "sequence's rows) nor store_quads=True (another store of the same rows)")
        if self.dq_warp and (not self.dq_tile_major or self.staged_dropout):
            raise ValueError("dq_warp=True takes dq_reduce='tiles' (a staged dQ to add) and not the producer's keep "
                             f"bits (warps 2 and 3), got {self.dq_reduce=}, {self.dropout_bits=}")
        if self.fold_dq and (not self.dq_warp or self.variant.varlen or self.variant.block_mask):
            raise ValueError("fold_dq=True takes dq_warp=True (warp 2 counts the arrivals), dense sequences and no "
                             f"block mask, got {self.dq_warp=}, {self.variant}")
        if self.ds_buffers not in (1, 2) or (self.ds_buffers == 1 and self.dq_split != "rows"):
            raise ValueError(f"{self.ds_buffers=} must be 2, or 1 with dq_split='rows' (got {self.dq_split!r})")
        if self.rotate and self.variant.block_mask:
            raise ValueError("rotate=True walks every query tile of a key tile; a block mask's visited pairs are "
                             "walked in order")
        self.check_block()

    @property
    def staged_dropout(self):
        """Dropout's keep bits come from the producer's warps 2 and 3 (``dropout_bits="producer"``)."""
        return self.variant.dropout and self.dropout_bits == "producer"

    @property
    def form_details(self):
        """What launch.describe adds for this form: step 40's 128 query rows a step, dQ added by warp 2,
        the stats warp's loads a step ahead."""
        return ((("128 queries a step",) if self.block_m == 128 else ()) + (("dQ by warp 2",) if self.dq_warp else ())
                + (("stats ahead",) if self.stats_ahead else ()) + (("one dS^T set",) if self.ds_buffers == 1 else ())
                + (("dQ converted in the kernel",) if self.fold_dq else ()))

    @property
    def dq_part_columns(self):
        """With ``dq_tile_major``: the columns of one consumer's dQ product, a part of each 64-row unit
        of dq_accum (``dq_accum_shape``): half of headdim_padded (dQ split by columns), or all of it
        (by rows: a consumer's product is a whole 64-row unit)."""
        return self.headdim_padded if self.dq_split == "rows" else self.headdim_padded // 2

    @property
    def atomic_dq(self):
        """dQ goes to dq_accum by atomics; with dq_split="none" there is no dQ here (the
        deterministic backward: dq_accum is then a stand-in the kernel never reads)."""
        return self.dq_split != "none"

    @property
    def block_n(self):
        return KEYS * self.consumers

    @property
    def ds_bytes(self):
        """Bytes of one consumer's dS^T tile (64 keys x 64 queries, 16 bit: 64 rows of 128 bytes);
        none without dQ."""
        return KEYS * self.block_m * 2 if self.atomic_dq else 0

    @property
    def stats_bytes(self):
        """Bytes of one slot's lse_log2 and D; with a block mask, then 16 bytes of the step the stats
        warp walked to: its query head, query tile and whether it is masked (a word unused); with
        ``staged_dropout``, then a word of keep bits per consumer thread."""
        return (2 * self.block_m * 4 + (16 if self.variant.block_mask else 0)
                + (4 * GROUP * self.consumers if self.staged_dropout else 0))

    @property
    def dynamic_shared_bytes(self):
        """The tiles (and the staged dQ_i), the stats, 1 + 2 stages mbarriers (and dq_full, dq_empty),
        with ``fold_dq`` a bit a step (the tiles to convert), and 1024 bytes of slack to align the
        tiles."""
        return (1024 + 2 * self.kv_bytes + 2 * self.stages * self.q_bytes
                + self.ds_buffers * self.consumers * self.ds_bytes + self.dq_stage_bytes
                + self.stages * self.stats_bytes + 8 * (1 + 2 * self.stages) + (16 if self.dq_tile_major else 0)
                + (FOLD_STEPS // 8 if self.fold_dq else 0))

    def grid(self, batch, nheads, nheads_k, seqlen_q, seqlen_k):
        tiles = -(-seqlen_k // self.block_n)
        if self.heavy_groups:
            return grouped_grid(tiles, batch * nheads_k, self.heavy_groups)
        return (tiles, nheads_k, batch)


def _words(config, q, k, v, dout, *outputs):
    rows = [(q, config.block_m), (k, config.block_n), (v, config.block_n), (dout, config.block_m)]
    rows += [(x, KEYS) for x in outputs]  # dk and dv, a consumer's 64 keys a box (``store_tma``)
    return np.stack([tensor_map_4d_words(x, (1, n, 1, CHUNK), SWIZZLE_128B) for x, n in rows])


def tensor_maps(config, q, k, v, dout, dk=None, dv=None):
    """The kernel's ``maps``: the tensor maps of q, k, v, dout as a (4, 16) uint64 array on the
    backend, with the boxes the kernel loads (block_m rows of q and dout, block_n of k and v, 64
    columns, swizzled as wgmma reads them), kept for the last few calls as the forward's. Any
    backward config with block_m and block_n: the Hopper dK/dV kernels' and the dQ kernel's. With
    ``store_tma`` (backward_sm90.py's option) two more rows: dk's and dv's, 64 x 64 boxes."""
    if config.variant.varlen:  # stride-0 views over batch: the maps are the packed arrays' (a batch of one)
        q, k, v, dout = (x[:1] for x in (q, k, v, dout))
    arrays = (q, k, v, dout) + ((dk, dv) if getattr(config, "store_tma", False) else ())
    key = (type(config).__name__, config.block_m, config.block_n, len(arrays))
    return cached_tensor_maps(key, arrays, lambda *xs: _words(config, *xs))


def dq_accum_shape(config, batch, nheads, seqlen_q):
    """With ``dq_tile_major``: dq_accum's shape, (batch, nheads, query tiles x block_m, headdim_padded)
    float32, zeroed by the caller. Each query tile's block_m x headdim_padded floats are contiguous,
    in the order the consumers stage them (make_stage_dq), so the stats warp adds a step's
    dQ_i by one bulk reduce-add; rows past seqlen_q and columns past headdim are in it too (their
    dQ is 0). Inside, every 64 rows are a unit of 64 x headdim_padded floats, in parts of
    ``config.dq_part_columns`` columns (a consumer's product), each in fragment order: this file's
    kernel stages a unit a step (the consumers' column halves), backward_sm90_rows.py two (each
    consumer's 64 rows, all 64 columns).

    Packed sequences (``variant.varlen``; ``seqlen_q``: the packed rows, total_q): one batch row,
    sequence b's tiles from row ``padded_first_row(q_first, b, block_m)`` on, so that each starts
    on a whole tile: (1, nheads, ceil((total_q + batch block_m) / block_m) block_m, headdim_padded).

    With ``fold_dq``, past the tiles, each query tile's arrival counter (``fold_counter``): a
    float32 a tile, headdim_padded a row, zeroed with the rest."""
    rows = seqlen_q + (batch * config.block_m if config.variant.varlen else 0)
    tiles = -(-rows // config.block_m)
    counter_rows = -(-tiles // config.headdim_padded) if getattr(config, "fold_dq", False) else 0
    return (1 if config.variant.varlen else batch, nheads, tiles * config.block_m + counter_rows,
            config.headdim_padded)


@register_jitable
def padded_first_row(q_first, b, block_m):
    """Packed sequences with a tile-major dq_accum (``dq_accum_shape``): the row of dq_accum where
    sequence b's query tiles start, its first packed row q_first moved up to a multiple of block_m
    past b tiles of slack. Sequence b + 1's start is then at least ceil(seqlen_b / block_m) tiles
    later, and every tile ends inside dq_accum: with the clamped offsets of
    ``geometry.packed_sequence``, (q_first + b block_m) + seqlen_b + block_m - 1 < total_q + batch
    block_m, whatever cu_seqlens_q holds."""
    return (q_first + b * block_m) // block_m * block_m


# -------------------------------------------------------------------------------------------------
# Device functions the Hopper backward kernels share (this file's, backward_sm90_rows.py's,
# backward_sm90_wide.py's and backward_dq_sm90.py's), each made from a config's constants (or a
# variant's hooks: the producer's copies, a consumer's step, its S^T and dP^T, the probabilities
# with every variant's features, which this file's kernel and the wide one both run). A 64-row
# accumulator is in wgmma's layout: thread (warp w of the warpgroup, g = lane // 4, q4 = lane % 4)
# holds rows 16 w + g (registers 4 c + e) and 16 w + g + 8 (registers 4 c + 2 + e) of columns
# 8 c + 2 q4 + e.
# -------------------------------------------------------------------------------------------------


def make_pack_a(dtype, regs):
    """``pack_a(x, packed)``: an accumulator's registers packed pair by pair into ``regs`` 16-bit
    ``dtype`` pairs, the A registers of a wgmma (k16 slice ks: packed registers 4 ks .. 4 ks + 3)."""
    pack = pack_f16x2 if dtype == "float16" else pack_bf16x2

    @inline_device
    @unroll
    def pack_a(x, packed):
        """A registers of a k16 slice ks: the accumulator's registers 8 ks .. 8 ks + 7, in pairs."""
        for i in static_range(regs):
            packed[i] = pack(x[2 * i], x[2 * i + 1])

    return pack_a


def make_add_dq(headdim, columns):
    """``add_dq(dq_accum, acc, b, row0, h, col0, seqlen_q, q4)``: a 64-row product of ``columns``
    dQ columns into dq_accum by red.add.v2, the thread's two rows and column pairs inside the arrays.
    Both rows' addresses come first, each in registers of its own, so that the second row's
    address does not overwrite the one the first row's reductions still wait in the queue to read
    (docs/perf-notes.md step 61). (16-byte reductions, lane pairs trading a column pair first, were
    2-5% slower at hd 64 and 20% at hd 128: step 24, the code in commit 8ebb6f1.)"""
    HD = headdim

    @inline_device
    @unroll
    def add_dq(dq_accum, acc, b, row0, h, col0, seqlen_q, q4):
        """dq_accum[b, row0 + (0, 8), h, col0 + 8 c + 2 q4 (+1)] += acc (unscaled), inside the arrays."""
        first = global_address(dq_accum, b, row0, h, col0 + 2 * q4)  # both rows' addresses first
        second = global_address(dq_accum, b, row0 + 8, h, col0 + 2 * q4)
        if row0 < seqlen_q:
            for c in static_range(columns // 8):
                if col0 + 8 * c < HD:  # HD is a multiple of 8: both columns of the pair are inside
                    red_add_f32x2(first + 32 * c, acc[4 * c], acc[4 * c + 1])
        if row0 + 8 < seqlen_q:
            for c in static_range(columns // 8):
                if col0 + 8 * c < HD:
                    red_add_f32x2(second + 32 * c, acc[4 * c + 2], acc[4 * c + 3])

    return add_dq


def make_store_rows(dtype, headdim, headdim_padded, quads=False):
    """``store_rows(dst, acc, b, row0, h, seqlen, scale, q4)``: a 64-row accumulator of
    ``headdim_padded`` columns times ``scale``, narrowed to ``dtype``, into dst's rows (dK, dV, dq).
    A thread's two columns of a row are neighbours (wgmma's layout), so each pair goes out as one
    32-bit store: half as many stores as one a column, and no byte shuffling (``stalls 128`` put
    6-8% of the samples on the 16-bit stores and their permutes). ``dst`` is one of the backward's
    fresh contiguous outputs, whose headdim is a multiple of 8: every pair is whole and 4-byte
    aligned.

    With ``quads`` (an option, docs/perf-notes.md step 55) the four lanes of a quad, which hold the
    four pairs of each 8-column group of their row, trade pairs (two butterfly exchanges of two
    words, by lane ^ 1 then lane ^ 2) so that each lane holds one whole group of four groups: 16
    contiguous bytes, one 16-byte store. A quarter of the stores, each a row's 64 contiguous bytes
    across the quad, for 4 shuffles a store. Every lane shuffles (the rows' test comes after)."""
    HD, DT = headdim, headdim_padded // 8  # DT: 8-column groups of the accumulator
    pack = pack_f16x2 if dtype == "float16" else pack_bf16x2  # (rounding as a single element's: to nearest even)
    if quads and DT % 4:
        raise ValueError(f"quad stores take whole sets of four 8-column groups, not {DT}")

    @inline_device
    def trade(a0, a1, a2, a3, q4, mask):
        """One butterfly stage of the quad's 4 x 4 transpose: the two words whose slot k has
        (k ^ q4) & mask set go to lane q4 ^ mask, which sends its slots k ^ mask back."""
        if mask == 1:
            odd = (q4 & 1) != 0
            x0 = a0 if odd else a1  # slot (q4 & 1) ^ 1, then that + 2
            x1 = a2 if odd else a3
            y0, y1 = shuffle_xor_u32(x0, uint32(1)), shuffle_xor_u32(x1, uint32(1))
            return (y0 if odd else a0), (a1 if odd else y0), (y1 if odd else a2), (a3 if odd else y1)
        high = (q4 & 2) != 0
        x0 = a0 if high else a2  # slot (q4 & 2) ^ 2, then that + 1
        x1 = a1 if high else a3
        y0, y1 = shuffle_xor_u32(x0, uint32(2)), shuffle_xor_u32(x1, uint32(2))
        return (y0 if high else a0), (y1 if high else a1), (a2 if high else y0), (a3 if high else y1)

    @inline_device
    @unroll
    def store_quads(dst, acc, b, row0, h, seqlen, scale, q4):
        """store_rows with ``quads``: lane q4 stores group 4 m + q4 of each set m of four."""
        for rh in static_range(2):
            row = row0 + 8 * rh
            for m in static_range(DT // 4):
                r = 16 * m + 2 * rh  # group 4 m + k's pair: registers r + 4 k, r + 4 k + 1
                a0 = pack(acc[r] * scale, acc[r + 1] * scale)
                a1 = pack(acc[r + 4] * scale, acc[r + 5] * scale)
                a2 = pack(acc[r + 8] * scale, acc[r + 9] * scale)
                a3 = pack(acc[r + 12] * scale, acc[r + 13] * scale)
                a0, a1, a2, a3 = trade(a0, a1, a2, a3, q4, 1)
                a0, a1, a2, a3 = trade(a0, a1, a2, a3, q4, 2)  # now group 4 m + q4, lanes 0..3's pairs
                col = 8 * (4 * m + q4)
                if row < seqlen and col < HD:
                    store_u32x4(global_address(dst, b, row, h, col), a0, a1, a2, a3)

    if quads:
        return store_quads

    @inline_device
    @unroll
    def store_rows(dst, acc, b, row0, h, seqlen, scale, q4):
        """dst[b, row0 + (0, 8), h, :] = acc * scale, for rows inside the sequence."""
        for rh in static_range(2):
            row = row0 + 8 * rh
            if row < seqlen:
                for c in static_range(DT):
                    col = 8 * c + 2 * q4
                    if col < HD:
                        r = 4 * c + 2 * rh
                        store_u32(global_address(dst, b, row, h, col), pack(acc[r] * scale, acc[r + 1] * scale))

    return store_rows


def make_store_tma(config):
    """``(write_tiles, store_tiles)`` of ``store_tma`` (an option, docs/perf-notes.md step 57): dK and
    dV through K_j's and V_j's tiles and TMA, once neither consumer's products read those tiles.
    ``write_tiles(smem_tiles, acc_dk, acc_dv, scale, consumer, warp, lane)``, a consumer
    warpgroup's: its 64 key rows of dK (times ``scale``) and dV, narrowed, into its rows of
    the tiles (``smem_tiles``: K's first byte; V's KV bytes on) in the layout the loads left
    (64-column chunks of block_n rows of 128 bytes, the 128-byte swizzle), a thread's pair of
    columns a 32-bit store (stmatrix, four groups an instruction, made ptxas spill in the loop:
    docs/perf-notes.md step 57); then it arrives on barrier STORE_BARRIER.
    ``store_tiles(smem_tiles, maps_address, mem_b, n_start, hk, seqlen_k)``, the producer's warp 0
    (done with its copies; so the consumers hold nothing across their loop for the stores): once
    both consumers have arrived, one lane stores each consumer's 64 x 64 box of each chunk by TMA
    (maps rows 4 and 5: dk's and dv's), and waits until the copies have read the tiles. TMA writes
    only the rows and columns inside the arrays: key tails and the columns past headdim need no
    test."""
    HDP, BN, CONSUMERS = config.headdim_padded, config.block_n, config.consumers
    DT, CHUNKS = HDP // 8, HDP // CHUNK
    KV_BYTES, KV_CHUNK_BYTES = config.kv_bytes, BN * ROW_BYTES
    pack = pack_f16x2 if config.dtype == "float16" else pack_bf16x2
    DK_MAP, DV_MAP = 4 * 128, 5 * 128  # bytes into the maps
    ARRIVALS = CONSUMERS * GROUP + 32  # the consumers' threads, then warp 0's

    @inline_device
    @unroll
    def write_rows(rows, acc, scale, warp, lane):
        """The warp's 16 rows of a 64-row accumulator into the tile rows at shared address ``rows``
        (the consumer's first row of chunk 0): the thread's pair of columns 8 c + 2 q4 of rows g
        and g + 8 in 8-column group c's 16-byte unit, swizzled by the row (c % 8 ^ g, as TMA's
        loads leave a row), by address (through the ``smem`` array's 64-bit element index, ptxas
        made the plain loop 15 instructions longer: docs/perf-notes.md step 57)."""
        g, q4 = lane >> 2, lane & 3
        for rh in static_range(2):
            row = uint32(16 * warp + 8 * rh) + uint32(g)
            for c in static_range(DT):
                address = (rows + uint32((c // 8) * KV_CHUNK_BYTES) + row * uint32(ROW_BYTES)
                           + ((uint32(c % 8) ^ uint32(g)) * uint32(16)) + uint32(4) * uint32(q4))
                r = 4 * c + 2 * rh
                store_shared_u32(address, pack(acc[r] * scale, acc[r + 1] * scale))

    @inline_device
    def write_tiles(smem_tiles, acc_dk, acc_dv, scale, consumer, warp, lane):
        rows = smem_tiles + uint32(consumer * KEYS * ROW_BYTES)
        write_rows(rows, acc_dk, scale, warp, lane)
        write_rows(rows + uint32(KV_BYTES), acc_dv, float32(1), warp, lane)
        fence_proxy_async()  # the shared stores before the copies' reads
        named_barrier_arrive(STORE_BARRIER, ARRIVALS)

    @inline_device
    @unroll
    def store_tiles(smem_tiles, maps_address, mem_b, n_start, hk, seqlen_k):
        named_barrier_sync(STORE_BARRIER, ARRIVALS)  # every consumer's rows are in
        if elect_sync() == uint32(1):
            dk_map, dv_map = maps_address + DK_MAP, maps_address + DV_MAP
            fence_proxy_tensormap_acquire(dk_map)  # the maps were copied from the host
            fence_proxy_tensormap_acquire(dv_map)
            for consumer in static_range(CONSUMERS):
                key_base = n_start + KEYS * consumer
                if key_base < seqlen_k:  # (a box wholly past the keys would write nothing)
                    for chunk in static_range(CHUNKS):
                        tile = smem_tiles + uint32(consumer * KEYS * ROW_BYTES + chunk * KV_CHUNK_BYTES)
                        tma_store_4d(dk_map, chunk * CHUNK, hk, key_base, mem_b, tile)
                        tma_store_4d(dv_map, chunk * CHUNK, hk, key_base, mem_b, tile + uint32(KV_BYTES))
            tma_store_commit()
            tma_store_wait(0)  # the copies have read the tiles (the block's shared memory outlives this)

    return write_tiles, store_tiles


STORE_BARRIER = 5  # the named barrier of store_tma's hand-off (1-3: the consumers' dS^T, 4: K and V free)
FOLD_BARRIER = 6  # fold_dq's: warp 2 has marked every tile to convert


def make_init_ring(stages, full_arrivals, empty_arrivals):
    """``init_ring(kv_full, qd_full, qd_empty)``, thread 0's before the block's first barrier: the
    K/V tile's barrier (one arrival: the TMA thread's expect_tx) and each ring slot's full and empty
    barriers (8 bytes apart), fenced so that the copy engine sees them."""

    @inline_device
    def init_ring(kv_full, qd_full, qd_empty):
        mbarrier_init(kv_full, 1)
        for slot in range(stages):
            mbarrier_init(qd_full + uint32(8 * slot), full_arrivals)
            mbarrier_init(qd_empty + uint32(8 * slot), empty_arrivals)
        fence_mbarrier_init()

    return init_ring


def make_step_pair(config):
    """``step_pair(position, hk, group, first_tile, tiles_per_head, n_block) -> (h, tile)``: the query
    head and tile of a dK/dV block's step at ``position`` of its walk: query head hk group +
    position // tiles_per_head, and of its visited tiles the position mod tiles_per_head-th in order
    from ``first_tile``, or with ``config.rotate`` (an option of this kernel and of
    backward_sm90_rows.py) from tile n_block mod tiles_per_head of them on, so that the blocks of one
    head that run together add into different rows of dq_accum rather than all into the same. The
    producer's copies, the stats warp, its keep-bits warps (``dropout_bits="producer"``) and the
    consumers all take their step's pair from here. The division is unsigned and 32-bit: Python's
    signed 64-bit one is a few dozen instructions, at each consumer step's head on the way to its
    wait for the ring."""
    ROTATE = config.rotate

    @inline_device
    def step_pair(position, hk, group, first_tile, tiles_per_head, n_block):
        n = uint32(tiles_per_head)
        t = uint32(position) % n
        if ROTATE:
            t = uint32(t + uint32(n_block)) % n  # (the sum cast back: a 32-bit division, not a 64-bit call)
        return hk * group + int32(uint32(position) // n), first_tile + int32(t)

    return step_pair


def make_stage_stats(config, hooks):
    """``stage_stats``, the producer's warp 1 in a dK/dV block (one key tile; backward_sm90_rows.py's
    and backward_sm90_wide.py's as well): walking the block's steps (the visited (query head, query
    tile) pairs) through the ring with warp 0's copies, each step's lse in base 2 and D (with a block
    mask, the step itself for the consumers) into the slot's stats; with ``dq_tile_major``, after
    staging step i's stats, step i - 1's dQ from the staged tile into dq_accum (``make_add_staged_dq``),
    unless warp 2 adds it (``dq_warp``: ``make_reduce_staged_dq``). With ``stats_ahead`` (an option
    of this kernel's config) step i + 1's lse and D are loaded once step i's are staged, before step
    i - 1's dQ is added."""
    BM, STAGES, STATS_BYTES = config.block_m, config.stages, config.stats_bytes
    ROWS_PER_LANE = BM // 32  # the stats rows of each lane
    BLOCK_MASK, STEP_WORD, SCORE = hooks.BLOCK_MASK, 2 * BM, hooks.SCORE
    warp_visit_query_step, tile_class, head_context = hooks.warp_visit_query_step, hooks.tile_class, hooks.head_context
    score_units = hooks.tensor_core_score(False)[0]
    VARLEN, sequence = hooks.VARLEN, hooks.sequence
    NEG_INF, POS_INF = float32(-math.inf), float32(math.inf)
    STAGED_DQ = config.dq_tile_major and not getattr(config, "dq_warp", False)  # (else warp 2's)
    STATS_AHEAD = getattr(config, "stats_ahead", False)  # (backward_sm90_rows.py's and _wide.py's: never)
    add_staged_dq = make_add_staged_dq(config)
    step_pair = make_step_pair(config)

    @inline_device
    @unroll
    def load_step(lse_ahead, d_ahead, lse, delta, mem_b, row0, b, hk, group, n_block, first_tile, tiles_per_head,
                  i, position, seqlen_q, params, scale, lane):
        """With STATS_AHEAD: ``(position, h, tile, offset)`` of step i (``warp_visit_query_step``, given
        step i - 1's position), its head's lse offset (SCORE), and the lane's lse and D of the step's
        rows as loaded, into ``lse_ahead`` and ``d_ahead`` (rows past seqlen_q: -inf and 0). Nothing
        reads them until the step's stores: the loads' latency passes under what the warp does
        meanwhile."""
        position = warp_visit_query_step(params, b, hk, group, n_block, first_tile, tiles_per_head, i, position, lane)
        h, tile = step_pair(position, hk, group, first_tile, tiles_per_head, n_block)
        offset = float32(0)
        if SCORE:
            offset = score_units(params, scale, head_context(params, b, h))[variants.OFFSET]
        for r in static_range(ROWS_PER_LANE):
            row = tile * BM + 32 * r + lane
            lse_ahead[r], d_ahead[r] = NEG_INF, float32(0)
            if row < seqlen_q:
                lse_ahead[r] = lse[mem_b, h, row0 + row]
                d_ahead[r] = delta[mem_b, h, row0 + row]
        return position, h, tile, offset

    @inline_device
    @unroll
    def stage_stats(smem, stats_word0, qd_full, qd_empty, lse, delta, b, hk, group, n_block, first_tile,
                    tiles_per_head, steps, seqlen_q, params, scale, lane, tail, first_full, end_full, step0,
                    dq_accum, dq_stage, dq_full, dq_empty):
        """Warp 1's: step i's lse_log2 and D of its BM query rows into ring slot (step0 + i) % STAGES's
        stats (at smem index stats_word0 on; step0: the block's steps before this key tile's, in a
        persistent block), once the consumers have released the slot; the arrival on its full
        barrier releases the stores. With a block mask, lane 0 adds the step (query head, query
        tile, masked) at word STEP_WORD. Packed sequences: lse and delta hold the packed rows
        (a batch of one), the sequence's from its first. With STAGED_DQ (one key tile a block),
        step i - 1's dQ goes out once step i's stats are in: step i's slot is free once the
        consumers are past step i - 2, which is before step i - 1's dQ is staged, so neither waits
        on the other (dq_accum, dq_stage and its barriers are unused otherwise). With STATS_AHEAD,
        step i's pair and rows were loaded before: step 0's ahead of the loop, step i + 1's right
        after the arrival on step i's full barrier, so that their loads are in flight while the warp
        adds step i - 1's dQ and waits for step i + 1's slot; lse_log2 is made from them at the
        stores (the first instruction to read a load waits for it)."""
        mem_b, row0, dq_row0 = b, 0, 0
        if VARLEN:
            row0 = sequence(params, b, lse.shape[2], lse.shape[2])[0]  # the query rows' first
            mem_b = 0
            if STAGED_DQ:  # the sequence's first whole tile of dq_accum (dq_accum_shape)
                dq_row0 = padded_first_row(row0, b, BM)
        position = -1
        last_h, last_q_start = 0, 0  # with STAGED_DQ: step i - 1's query head and tile
        if STATS_AHEAD:  # step 0's pair and rows (then step i + 1's in step i)
            lse_ahead = cuda.local.array(ROWS_PER_LANE, float32)  # (registers: constant indices)
            d_ahead = cuda.local.array(ROWS_PER_LANE, float32)
            next_h, next_tile, next_offset = 0, 0, float32(0)
            if steps > 0:
                position, next_h, next_tile, next_offset = load_step(
                    lse_ahead, d_ahead, lse, delta, mem_b, row0, b, hk, group, n_block, first_tile, tiles_per_head,
                    0, position, seqlen_q, params, scale, lane)
        for i in range(steps):
            if not STATS_AHEAD:  # (else step i's position came with its rows)
                position = warp_visit_query_step(params, b, hk, group, n_block, first_tile, tiles_per_head, i,
                                                 position, lane)
            slot, use = (step0 + i) % STAGES, (step0 + i) // STAGES
            if use > 0:
                mbarrier_wait(qd_empty + uint32(8 * slot), (use - 1) & 1)
            if STATS_AHEAD:
                h, tile = next_h, next_tile  # (loaded a step ahead)
            else:
                h, tile = step_pair(position, hk, group, first_tile, tiles_per_head, n_block)
            q_start = tile * BM
            stats = stats_word0 + uint32(slot * (STATS_BYTES // 4))
            lse_rows = cuda.local.array(ROWS_PER_LANE, float32)  # (registers: constant indices)
            d_rows = cuda.local.array(ROWS_PER_LANE, float32)
            if STATS_AHEAD:  # the rows loaded a step ahead; -inf (no key seen, or past seqlen_q): P = 0
                for r in static_range(ROWS_PER_LANE):
                    x = lse_ahead[r]
                    lse_rows[r] = POS_INF if x == NEG_INF else x * float32(LOG2E) - next_offset
                    d_rows[r] = d_ahead[r]
            else:
                # the score features' offset (variants.OFFSET) out of lse, as out of their scores
                offset = float32(0)
                if SCORE:
                    offset = score_units(params, scale, head_context(params, b, h))[variants.OFFSET]
                for r in static_range(ROWS_PER_LANE):
                    row = q_start + 32 * r + lane
                    lse_rows[r], d_rows[r] = POS_INF, float32(0)  # rows past seqlen_q: P = 0
                    if row < seqlen_q:
                        x = lse[mem_b, h, row0 + row]
                        if x != NEG_INF:  # a row that sees no key keeps +inf: P = 0
                            lse_rows[r] = x * float32(LOG2E) - offset
                        d_rows[r] = delta[mem_b, h, row0 + row]
            for r in static_range(ROWS_PER_LANE):
                smem[stats + 32 * r + lane] = f32_as_u32(lse_rows[r])
                smem[stats + BM + 32 * r + lane] = f32_as_u32(d_rows[r])
            if BLOCK_MASK and lane == 0:  # the step for the consumers: head, tile, masked
                smem[stats + STEP_WORD] = uint32(h)
                smem[stats + STEP_WORD + 1] = uint32(tile)
                smem[stats + STEP_WORD + 2] = uint32(
                    tail or tile < first_full or tile >= end_full
                    or tile_class(params, b, h, tile, n_block) != variants.FULL)
            mbarrier_arrive(qd_full + uint32(8 * slot))  # releases the stores with the arrival
            if STATS_AHEAD and i + 1 < steps:  # step i + 1's, in flight under the dQ add and the next wait
                position, next_h, next_tile, next_offset = load_step(
                    lse_ahead, d_ahead, lse, delta, mem_b, row0, b, hk, group, n_block, first_tile, tiles_per_head,
                    i + 1, position, seqlen_q, params, scale, lane)
            if STAGED_DQ:
                if i > 0:
                    add_staged_dq(dq_accum, dq_stage, dq_full, dq_empty, i - 1, last_h, dq_row0 + last_q_start, mem_b,
                                  lane)
                last_h, last_q_start = h, q_start
        if STAGED_DQ and steps > 0:
            add_staged_dq(dq_accum, dq_stage, dq_full, dq_empty, steps - 1, last_h, dq_row0 + last_q_start, mem_b,
                          lane)

    return stage_stats


def make_stage_dropout(config, hooks):
    """``stage_dropout(smem, stats_word0, qd_full, qd_empty, params, b, hk, group, n_block, first_tile,
    tiles_per_head, steps, n_start, t)``: the producer's warps 2 and 3 (thread t of their 64) with
    ``staged_dropout``: for each step, once the consumers have released its slot, every consumer
    lane's keep bits (``Hooks.dropout_bits_t``'s, byte p for the queries 16 p + 2 q4 on) into the
    slot's words from DROP_WORD on, a word per consumer thread. The lanes of key rows k, k + 1 and of
    k + 16, k + 17 (lane ^ 4, and the same two of the next warp) make the same two Philox calls a
    query pair; thread t makes them once for those four lanes (``Hooks.dropout_bits_t_lanes``): half
    the calls the consumer lanes make themselves. The arrival on the slot's full barrier releases
    the stores."""
    BM, STAGES, STATS_BYTES, CONSUMERS = config.block_m, config.stages, config.stats_bytes, config.consumers
    DROP_WORD = 2 * BM + (4 if hooks.BLOCK_MASK else 0)  # after lse_log2, D and a block mask's step
    QUADS = CONSUMERS * 32  # lane quads: (consumer, even warp, g // 2, q4)
    warp_visit_query_step, head_context = hooks.warp_visit_query_step, hooks.head_context
    dropout_bits_t_lanes = hooks.dropout_bits_t_lanes
    step_pair = make_step_pair(config)

    @inline_device
    @unroll
    def stage_dropout(smem, stats_word0, qd_full, qd_empty, params, b, hk, group, n_block, first_tile,
                      tiles_per_head, steps, n_start, t):
        """Warps 2 and 3's: step i's keep bits of every consumer lane into ring slot i % STAGES."""
        position = -1
        for i in range(steps):
            position = warp_visit_query_step(params, b, hk, group, n_block, first_tile, tiles_per_head, i, position,
                                             t % 32)
            slot, use = i % STAGES, i // STAGES
            if use > 0:
                mbarrier_wait(qd_empty + uint32(8 * slot), (use - 1) & 1)
            h, tile = step_pair(position, hk, group, first_tile, tiles_per_head, n_block)
            q_start = tile * BM
            head_ctx = head_context(params, b, h)
            words = stats_word0 + uint32(slot * (STATS_BYTES // 4) + DROP_WORD)
            for quad in range(t, QUADS, 64):  # loops, not unrolled: two calls at a time in 40 registers
                # consumer c, warps 2 w2 and 2 w2 + 1, key rows 16 (2 w2) + 2 gh and + 1, the lanes' q4
                c, w2, gh, q4 = quad // 32, (quad // 16) % 2, (quad // 4) % 4, quad % 4
                key = n_start + 64 * c + 32 * w2 + 2 * gh
                # the four lanes' words: keys key, key + 1, key + 16, key + 17, a byte per query pair p
                word0, word1, word16, word17 = uint32(0), uint32(0), uint32(0), uint32(0)
                for p in range(BM // 16):
                    bits0, bits1, bits16, bits17 = dropout_bits_t_lanes(q_start + 16 * p + 2 * q4, key, params,
                                                                        head_ctx)
                    at = uint32(8 * p)
                    word0, word1 = word0 | (bits0 << at), word1 | (bits1 << at)
                    word16, word17 = word16 | (bits16 << at), word17 | (bits17 << at)
                thread = uint32(128 * c + 64 * w2 + 8 * gh + q4)  # the consumer thread of key row key
                smem[words + thread] = word0
                smem[words + thread + uint32(4)] = word1  # lane ^ 4: key + 1
                smem[words + thread + uint32(32)] = word16  # the next warp: key + 16
                smem[words + thread + uint32(36)] = word17
            mbarrier_arrive(qd_full + uint32(8 * slot))  # releases the stores with the arrival

    return stage_dropout


def make_add_staged_dq(config):
    """``add_staged_dq(dq_accum, dq_stage, dq_full, dq_empty, i, h, row, mem_b, lane)``, the stats
    warp's with ``dq_tile_major`` (make_stage_stats): once the consumers have stored their parts of
    step i's dQ in the staged tile (dq_full), lane 0 adds the whole tile into the block_m rows of
    dq_accum[mem_b, h] from ``row`` on (``dq_accum_shape``: the same fragment order; the query
    tile's start, for a packed sequence past its ``padded_first_row``) by one bulk reduce-add, and
    once the copy engine has read it the tile is free again (dq_empty, one arrival a lane). Rows
    past seqlen_q go in too: their dQ is 0, and dq_accum holds whole tiles."""
    TILE_BYTES = config.dq_stage_bytes

    @inline_device
    def add_staged_dq(dq_accum, dq_stage, dq_full, dq_empty, i, h, row, mem_b, lane):
        mbarrier_wait(dq_full, i & 1)  # the consumers' parts are stored (and fenced)
        if lane == 0:
            bulk_reduce_add_f32(global_address(dq_accum, mem_b, h, row, 0), dq_stage, uint32(TILE_BYTES))
            tma_store_commit()
            tma_store_wait(0)  # the copy engine has read the tile
        mbarrier_arrive(dq_empty)  # the phase completes with lane 0's arrival, after the read

    return add_staged_dq


def make_reduce_staged_dq(config, hooks):
    """``reduce_staged_dq(dq_accum, dq_stage, dq_full, dq_empty, params, b, hk, group, n_block,
    first_tile, tiles_per_head, steps, packed_rows, fold_marks, seqlen_q, seqlen_k, lane)``, the
    producer's warp 2 with ``dq_warp``: walking the block's steps as the stats warp does, each step's
    dQ from the staged tile into dq_accum (``make_add_staged_dq``: wait for the consumers' parts, one
    bulk reduce-add, wait for its read, free the tile), so that the stats warp's staging of lse and D
    never waits behind it. Packed sequences: dq_accum a batch of one, sequence b's tiles from its
    ``padded_first_row`` (``packed_rows``: the packed query rows).

    With ``fold_dq``, lane 0 then counts each step's arrival on its query tile (``count_arrival``) a
    step late, once that step's reduce-add is complete (``bulk_wait``(1), not 0: the step's own add
    need not have landed, so warp 2 issues the next one no later than without the fold), and the
    last step's after the loop."""
    BM = config.block_m
    warp_visit_query_step = hooks.warp_visit_query_step
    VARLEN, sequence = hooks.VARLEN, hooks.sequence
    add_staged_dq = make_add_staged_dq(config)
    step_pair = make_step_pair(config)
    FOLD = getattr(config, "fold_dq", False)
    count_arrival = make_count_arrival(config)
    visiting_run = make_visiting_key_tiles(hooks, BM, config.block_n)

    @inline_device
    def reduce_staged_dq(dq_accum, dq_stage, dq_full, dq_empty, params, b, hk, group, n_block, first_tile,
                         tiles_per_head, steps, packed_rows, fold_marks, seqlen_q, seqlen_k, lane):
        mem_b, dq_row0 = b, 0
        if VARLEN:  # the sequence's first whole tile of dq_accum (dq_accum_shape)
            mem_b = 0
            dq_row0 = padded_first_row(sequence(params, b, packed_rows, packed_rows)[0], b, BM)
        position = -1
        marks = uint32(0)  # (FOLD) lane 0's marks of the current 32 steps
        last_h, last_tile = hk * group, first_tile  # (FOLD) the step before's pair: counted a step late
        start, stop, counted = 0, 0, -1  # (FOLD) the run of key tiles visiting query tile `counted`
        for i in range(steps):
            position = warp_visit_query_step(params, b, hk, group, n_block, first_tile, tiles_per_head, i, position,
                                             lane)
            h, tile = step_pair(position, hk, group, first_tile, tiles_per_head, n_block)
            add_staged_dq(dq_accum, dq_stage, dq_full, dq_empty, i, h, dq_row0 + tile * BM, mem_b, lane)
            if FOLD and lane == 0:
                if i > 0:  # step i - 1's additions have had a step to complete (step i's may not yet)
                    start, stop = visiting_run(last_tile, start, stop, counted, seqlen_q, seqlen_k, params)
                    counted = last_tile
                    bulk_wait(1)
                    marks = count_arrival(dq_accum, fold_marks, marks, b, last_h, last_tile, i - 1, steps, seqlen_q,
                                          stop - start)
                last_h, last_tile = h, tile
        if FOLD and lane == 0 and steps > 0:  # the last step's
            start, stop = visiting_run(last_tile, start, stop, counted, seqlen_q, seqlen_k, params)
            bulk_wait(0)
            count_arrival(dq_accum, fold_marks, marks, b, last_h, last_tile, steps - 1, steps, seqlen_q, stop - start)

    return reduce_staged_dq


def make_visiting_key_tiles(hooks, block_m, block_n):
    """``visiting_run(tile, start, stop, tile_before, seqlen_q, seqlen_k, params) -> (start, stop)``:
    the key tiles whose blocks add into query tile ``tile``'s dQ, those whose visited query tiles
    [first, end) (the ``hooks.query_tiles`` each dK/dV block walks) hold it. Without a window, every
    key tile. With one, both ends of a key tile's range grow with the key (a key tile no query sees
    has (0, 0)), so the visiting key tiles are one run [start, stop): from the first whose range ends
    past the tile to the first that starts past it, found over the ranges themselves (the very ranges
    the blocks walk, so the count cannot disagree with them). It is found from [start, stop), the run
    of ``tile_before``: both ends only move up as the tile does, so a walk over increasing tiles
    advances them by a key tile or so a step, with two binary searches only where the tile goes back
    (a new query head, a rotated walk's wrap) or at the first (tile_before < 0)."""
    WINDOW, query_tiles = hooks.WINDOW, hooks.query_tiles

    @inline_device
    def starts_past(j, tile, end, seqlen_q, seqlen_k, params):
        """Key tile j's visited query tiles [first, end) (as its block's walk has them) start past
        ``tile`` (or with ``end``, end past it)."""
        first, _, _, last = query_tiles(j * block_n, min(j * block_n + block_n, seqlen_k), seqlen_q, seqlen_k, params,
                                        block_m)
        return (last if end else first) > tile

    @inline_device
    def first_past(tile, end, lo, hi, seqlen_q, seqlen_k, params):
        """The first key tile in [lo, hi) past ``tile`` (``starts_past``); hi if none."""
        while lo < hi:
            mid = (lo + hi) // 2
            if starts_past(mid, tile, end, seqlen_q, seqlen_k, params):
                hi = mid
            else:
                lo = mid + 1
        return lo

    @inline_device
    def visiting_run(tile, start, stop, tile_before, seqlen_q, seqlen_k, params):
        key_tiles = (seqlen_k + block_n - 1) // block_n
        if not WINDOW:
            return 0, key_tiles
        if tile < tile_before or tile_before < 0:
            start = first_past(tile, True, 0, key_tiles, seqlen_q, seqlen_k, params)
            return start, first_past(tile, False, start, key_tiles, seqlen_q, seqlen_k, params)
        while start < key_tiles and not starts_past(start, tile, True, seqlen_q, seqlen_k, params):
            start += 1
        stop = max(stop, start)
        while stop < key_tiles and not starts_past(stop, tile, False, seqlen_q, seqlen_k, params):
            stop += 1
        return start, stop

    return visiting_run


def make_count_arrival(config):
    """``count_arrival(dq_accum, fold_marks, marks, b, h, tile, step, steps, seqlen_q, visits) ->
    marks``, warp 2's lane 0 with ``fold_dq``, once its bulk reduce-add of step ``step`` into query
    tile ``tile`` of head h is complete (the caller's ``bulk_wait``): publish the additions to every
    block (a proxy fence, then a release), count this block's arrival on the tile (``fold_counter``),
    and if it is the last of the tile's ``visits`` (its visiting key tiles, ``make_visiting_key_tiles``),
    acquire the other blocks' additions and mark the step. The marks are a bit a step: word w (at shared address ``fold_marks`` + 4 w) holds steps 32 w .. 32 w + 31,
    stored once its last step is counted (every word up to the last step's is written, so none needs
    zeroing first); ``marks`` carries the current word. The same pattern as a split decode's merge
    ticket (decode_mma.py)."""
    BM, HDP = config.block_m, config.headdim_padded

    @inline_device
    def count_arrival(dq_accum, fold_marks, marks, b, h, tile, step, steps, seqlen_q, visits):
        fence_proxy_async_global()  # the completed additions ordered with this thread's generic accesses
        cuda.threadfence()  # ... and visible to every block before the count says so
        arrived = cuda.atomic.add(dq_accum, fold_counter(b, h, tile, seqlen_q, BM, HDP), float32(1))
        if arrived == float32(visits - 1):
            cuda.threadfence()  # the other blocks' additions are read after their arrivals
            marks |= uint32(1) << uint32(step % 32)
        if step % 32 == 31 or step == steps - 1:
            store_shared_u32(fold_marks + uint32(4 * (step // 32)), marks)
            marks = uint32(0)
        return marks

    return count_arrival


@register_jitable
def fold_counter(b, h, tile, seqlen_q, block_m, headdim_padded):
    """With ``fold_dq``: the index in dq_accum of query tile ``tile``'s arrival counter (batch b,
    head h), a float32 past the tiles (``dq_accum_shape``): exact up to 2^24 arrivals."""
    tile_rows = (seqlen_q + block_m - 1) // block_m * block_m
    return b, h, tile_rows + tile // headdim_padded, tile % headdim_padded


def make_convert_unit(headdim_padded, part_columns, load, store_rows):
    """``convert_unit(dq_accum, dq, mem_b, h, unit_row, dq_row, rows_end, scale, t)``: thread t's
    share (t in 0..127) of the 64-row unit at row unit_row of a tile-major dq_accum[mem_b, h]
    (``dq_accum_shape``) -> dq[mem_b, dq_row + ..., h] (rows before rows_end), times scale in dq's
    dtype: the registers that staging thread t kept in each part (``make_stage_dq``: 16-byte loads,
    consecutive t consecutive), written by ``store_rows`` (``make_store_rows``'s, as the dK/dV kernel
    writes dK). ``load``: ``load_u32x4_nc`` for a kernel of its own, ``load_u32x4_cg`` inside the
    kernel whose blocks wrote dq_accum (``fold_dq``)."""
    HDP, COLUMNS = headdim_padded, part_columns
    PARTS = HDP // COLUMNS  # the staged products of a unit
    VECTORS = COLUMNS // 8  # a staging thread's 16-byte stores a part
    PART = 4 * 64 * COLUMNS  # bytes of a part
    ACC_REGS = HDP // 2  # a thread's registers over all HDP columns

    @inline_device
    @unroll
    def convert_unit(dq_accum, dq, mem_b, h, unit_row, dq_row, rows_end, scale, t):
        tile = global_address(dq_accum, mem_b, h, unit_row, 0)
        # acc in the accumulator's layout over all HDP columns: part p's register r is acc[p COLUMNS / 2 + r]
        acc = cuda.local.array(ACC_REGS, float32)
        for p in static_range(PARTS):
            for v in static_range(VECTORS):
                words = load(tile + p * PART + 16 * (GROUP * v + t))
                for e in static_range(4):
                    acc[p * (COLUMNS // 2) + 4 * v + e] = u32_as_f32(words[e])
        store_rows(dq, acc, mem_b, dq_row + 16 * (t // 32) + (t % 32) // 4, h, rows_end, scale, t % 4)

    return convert_unit


def make_convert_marked(config, hooks):
    """``convert_marked(smem, marks_word0, dq_accum, dq, params, b, hk, group, n_block, first_tile,
    tiles_per_head, steps, seqlen_q, seqlen_k, scale, warp, lane)``, the consumers' eight warps
    (``warp`` 0..7) with ``fold_dq``, once the loop is done and warp 2 has counted every arrival:
    each query tile whose last arrival this block made (warp 2's marks, from smem word
    ``marks_word0`` on) -> dq, its 64-row units dealt round the warps, a warp taking a unit's 128
    staging threads in four passes (``make_convert_unit``, reading past L1: other blocks added into
    those tiles during this launch). With a window some query tiles may see no key at all, so no
    block converts them: block 0 of each KV head writes their dq rows as zeros (the conversion
    kernel would have, from dq_accum's zeros)."""
    BM, HD, HDP, WARPS = config.block_m, config.headdim, config.headdim_padded, 4 * config.consumers
    UNITS = BM // 64
    store_rows = make_store_rows(config.dtype, HD, HDP, quads=config.store_quads)
    convert_unit = make_convert_unit(HDP, config.dq_part_columns, load_u32x4_cg, store_rows)
    step_pair = make_step_pair(config)
    WINDOW = hooks.WINDOW
    visiting_run = make_visiting_key_tiles(hooks, BM, config.block_n)

    @inline_device
    def zero_rows(dq, b, h, row0, rows_end, lane):
        """dq's rows [row0, rows_end) of head h -> 0, a row a lane, 16 bytes a store."""
        for row in range(row0 + lane, rows_end, 32):
            for c in range(HD // 8):
                store_u32x4(global_address(dq, b, row, h, 8 * c), uint32(0), uint32(0), uint32(0), uint32(0))

    @inline_device
    def convert_marked(smem, marks_word0, dq_accum, dq, params, b, hk, group, n_block, first_tile, tiles_per_head,
                       steps, seqlen_q, seqlen_k, scale, warp, lane):
        marked = 0  # the marked steps so far: unit u of the k-th goes to warp (k UNITS + u) % WARPS
        for w in range((steps + 31) // 32):
            marks = smem[marks_word0 + w]
            for e in range(32 if marks != 0 else 0):
                if marks & (uint32(1) << uint32(e)):
                    h, tile = step_pair(32 * w + e, hk, group, first_tile, tiles_per_head, n_block)
                    for u in range(UNITS):
                        if (marked * UNITS + u) % WARPS == warp:
                            row = tile * BM + 64 * u
                            for unit_warp in range(4):
                                convert_unit(dq_accum, dq, b, h, row, row, seqlen_q, scale, 32 * unit_warp + lane)
                    marked += 1
        if WINDOW and n_block == 0:  # the query tiles no key tile visits (each warp's in increasing order)
            start, stop, counted = 0, 0, -1
            for tile in range(warp, (seqlen_q + BM - 1) // BM, WARPS):
                start, stop = visiting_run(tile, start, stop, counted, seqlen_q, seqlen_k, params)
                counted = tile
                if stop == start:
                    for h in range(hk * group, hk * group + group):
                        zero_rows(dq, b, h, tile * BM, min(tile * BM + BM, seqlen_q), lane)

    return convert_marked


def make_stage_dq(block_m, columns):
    """``stage_dq(dq_stage, acc, dq_full, dq_empty, use, row, col0, q4)``, a consumer thread's with
    ``dq_tile_major``: its part of a 64-row dQ product of ``columns`` columns (wgmma's layout: its
    rows ``row`` and ``row`` + 8, columns col0 + 8 c + 2 q4 + e) into the staged tile in fragment
    order, once the stats warp has had the tile's last use read (dq_empty; ``use``: the block's step,
    counted from 0); then fenced for the copy engine, and the thread's arrival on dq_full. The
    product of columns col0 .. col0 + columns - 1 is block_m x columns floats from byte 4 block_m col0
    on, in which thread t (32 w + lane of its warpgroup) keeps its registers 4 v .. 4 v + 3 at bytes
    16 t + 2048 v, one 16-byte store each (a warp's 512 contiguous bytes: the minimum four passes).
    ``Sm90ConvertDqConfig`` reads the same order back."""

    @inline_device
    @unroll
    def stage_dq(dq_stage, acc, dq_full, dq_empty, use, row, col0, q4):
        if use > 0:
            mbarrier_wait(dq_empty, (use - 1) & 1)
        thread = 32 * (row // 16) + 4 * (row % 16) + q4  # row = 16 w + lane // 4
        base = dq_stage + uint32(4 * block_m * col0 + 16 * thread)
        for v in static_range(columns // 8):
            store_shared_f32x4(base + uint32(16 * GROUP * v), acc[4 * v], acc[4 * v + 1], acc[4 * v + 2],
                               acc[4 * v + 3])
        fence_proxy_async()  # the stores are ordered before the bulk reduce-add reads them
        mbarrier_arrive(dq_full)

    return stage_dq


def make_block_rows(hooks, block_n):
    """``block_rows(params, b, n_block, seqlen_q, seqlen_k) -> (mem_b, q_row0, seqlen_q, k_row0,
    seqlen_k, inside)``: where a dK/dV block's rows are. Dense: batch b's, from row 0. Packed
    sequences: sequence b's first rows and lengths (``Hooks.sequence``; 32-bit, as few registers as
    can be) in the packed arrays, a batch of one (mem_b 0); ``inside`` is False when key tile
    n_block lies past the sequence's end (the block then exits before any barrier)."""
    VARLEN, sequence = hooks.VARLEN, hooks.sequence

    @inline_device
    def block_rows(params, b, n_block, seqlen_q, seqlen_k):
        mem_b, q_row0, k_row0, inside = b, 0, 0, True
        if VARLEN:
            q_first, q_rows, k_first, k_rows = sequence(params, b, seqlen_q, seqlen_k)
            q_row0, seqlen_q, k_row0, seqlen_k = int32(q_first), int32(q_rows), int32(k_first), int32(k_rows)
            inside = n_block * block_n < seqlen_k
            mem_b = 0
        return mem_b, q_row0, seqlen_q, k_row0, seqlen_k, inside

    return block_rows


def make_issue_keys_by_queries(wgmma, headdim_padded, kv_chunk_bytes, q_chunk_bytes):
    """``issue_keys_by_queries(acc, desc_a, desc_b) -> acc``: acc = A B^T over headdim, A a K-major
    tile of keys (K or V: 64-column chunks of ``kv_chunk_bytes``), B one of queries (Q_i or dO_i:
    chunks of ``q_chunk_bytes``), by ``wgmma`` (an SS product with B K-major): S^T = K Q_i^T or dP^T
    = V dO_i^T, one commit group."""
    HD_STEPS = headdim_padded // 16

    @inline_device
    @unroll
    def issue_keys_by_queries(acc, desc_a, desc_b):
        """acc = A B^T over headdim (S^T = K Q_i^T or dP^T = V dO_i^T), one commit group."""
        for kk in static_range(HD_STEPS):
            acc = wgmma(acc, desc_a + k_step(kv_chunk_bytes, kk), desc_b + k_step(q_chunk_bytes, kk),
                        uint32(0 if kk == 0 else 1))
        wgmma_commit()
        return acc

    return issue_keys_by_queries


def make_consumer_step(hooks, block_m, stages, stats_bytes, step_pair):
    """``consumer_step(smem, qd_full, stats_word0, params, b, hk, group, n_block, first_tile,
    tiles_per_head, i) -> (h, tile, masked)``: a consumer's i-th step (i unsigned), the
    (query head, query tile) pair it works on. Without a block mask step i is pair i (masked is
    then decided by the caller); with one, the stats warp walked to the pair and left it in the
    slot's stats (word 2 block_m on: query head, query tile, masked), which the consumer reads
    once the slot is full (waiting for it: the stats warp arrives after its stores)."""
    BLOCK_MASK, STEP_WORD, STATS_WORDS = hooks.BLOCK_MASK, 2 * block_m, stats_bytes // 4

    if BLOCK_MASK:

        @inline_device
        def consumer_step(smem, qd_full, stats_word0, params, b, hk, group, n_block, first_tile, tiles_per_head, i):
            """Step i's (query head, query tile, masked) as the stats warp left them with the slot
            (waiting for it: the stats warp arrives after its stores)."""
            step = stats_word0 + uint32((i % stages) * STATS_WORDS) + uint32(STEP_WORD)
            mbarrier_wait(qd_full + uint32(8 * (i % stages)), (i // stages) & 1)
            return int32(smem[step]), int32(smem[step + 1]), smem[step + 2] != uint32(0)

    else:

        @inline_device
        def consumer_step(smem, qd_full, stats_word0, params, b, hk, group, n_block, first_tile, tiles_per_head, i):
            """Step i's (query head, query tile, -): pair i."""
            h, tile = step_pair(i, hk, group, first_tile, tiles_per_head, n_block)
            return h, tile, False

    return consumer_step


def make_produce_tiles(config, hooks):
    """``produce_tiles(maps, k_tile, v_tile, q_ring, do_ring, kv_full, qd_full, qd_empty, params, b,
    hk, group, n_block, first_tile, tiles_per_head, steps, q_row0, k_row0, mem_b, lane)``: the
    producer's warp 0 in a dK/dV block of ``config`` (block_m, block_n, stages, headdim_padded,
    q_bytes, kv_bytes): K_j and V_j by TMA (completing on kv_full), then for each step the visited
    (query head, query tile) pair's Q_i and dO_i into ring slot i % stages once the consumers have
    released it. One elected lane issues the copies; with a block mask the whole warp walks the
    pairs with it (32 classes a read: a later document's key tile passes tens of empty pairs), else
    the elected lane alone (step i is pair i). TMA's rows: k_row0 + the tile's keys, q_row0 + the
    tile's queries, of batch mem_b (packed sequences: the sequence's first rows of a batch of one)."""
    BM, BN, STAGES = config.block_m, config.block_n, config.stages
    CHUNKS = config.headdim_padded // CHUNK
    Q_BYTES, KV_BYTES = config.q_bytes, config.kv_bytes
    Q_CHUNK_BYTES, KV_CHUNK_BYTES = BM * ROW_BYTES, BN * ROW_BYTES
    BLOCK_MASK, warp_visit_query_step = hooks.BLOCK_MASK, hooks.warp_visit_query_step
    step_pair = make_step_pair(config)

    @inline_device
    @unroll
    def produce_tiles(maps, k_tile, v_tile, q_ring, do_ring, kv_full, qd_full, qd_empty, params, b, hk, group,
                      n_block, first_tile, tiles_per_head, steps, q_row0, k_row0, mem_b, lane):
        leader = elect_sync() == uint32(1)
        if leader or BLOCK_MASK:
            maps_address = array_address(maps)
            q_map, k_map, v_map, do_map = (maps_address, maps_address + 128, maps_address + 256, maps_address + 384)
            if leader:
                fence_proxy_tensormap_acquire(q_map)  # the maps were copied from the host
                fence_proxy_tensormap_acquire(k_map)
                fence_proxy_tensormap_acquire(v_map)
                fence_proxy_tensormap_acquire(do_map)
                mbarrier_arrive_expect_tx(kv_full, 2 * KV_BYTES)
                for chunk in static_range(CHUNKS):
                    tma_load_4d(k_tile + uint32(chunk * KV_CHUNK_BYTES), k_map, chunk * CHUNK, hk,
                                k_row0 + n_block * BN, mem_b, kv_full)
                    tma_load_4d(v_tile + uint32(chunk * KV_CHUNK_BYTES), v_map, chunk * CHUNK, hk,
                                k_row0 + n_block * BN, mem_b, kv_full)
            position = -1
            for i in range(steps):
                position = warp_visit_query_step(params, b, hk, group, n_block, first_tile, tiles_per_head, i,
                                                 position, lane)
                slot, use = i % STAGES, i // STAGES
                if use > 0:  # the consumers have released the slot's previous tiles
                    mbarrier_wait(qd_empty + uint32(8 * slot), (use - 1) & 1)
                if leader:
                    h, tile = step_pair(position, hk, group, first_tile, tiles_per_head, n_block)
                    q_start = tile * BM
                    full = qd_full + uint32(8 * slot)
                    q_slot = q_ring + uint32(slot * Q_BYTES)
                    do_slot = do_ring + uint32(slot * Q_BYTES)
                    mbarrier_arrive_expect_tx(full, 2 * Q_BYTES)
                    for chunk in static_range(CHUNKS):
                        tma_load_4d(q_slot + uint32(chunk * Q_CHUNK_BYTES), q_map, chunk * CHUNK, h,
                                    q_row0 + q_start, mem_b, full)
                        tma_load_4d(do_slot + uint32(chunk * Q_CHUNK_BYTES), do_map, chunk * CHUNK, h,
                                    q_row0 + q_start, mem_b, full)

    return produce_tiles


def make_probabilities_t(hooks, block_m, handover=False, staged_dropout=False, columns=None):
    """``probabilities_t(s, dp, smem, stats, key_row0, q_start, seqlen_q, seqlen_k, params, head_ctx,
    scale_log2, units, q4, masked)``: a consumer's S^T (keys by block_m queries, wgmma's layout) ->
    P^T in place, and with a score feature or dropout dS^T from the landed dP^T at once. ``dp`` is
    dP^T's registers, or with ``handover`` the shared-memory word of this thread's register 0 of a
    float32 copy (register r at word dp + 128 r: backward_sm90_wide.py's hand-over), where dS^T
    replaces dP^T. With ``staged_dropout`` the keep bits come in ``drop_word`` (byte p for queries
    16 p + 2 q4 on, make_stage_dropout's) instead of the lane's own Philox calls. ``columns``
    (first, end): only the 8-query column groups first..end-1 (even bounds; registers 4 first ..
    4 end - 1), default all."""
    BM, NT = block_m, block_m // 8
    FIRST_PAIR, END_PAIR = (0, NT // 2) if columns is None else (columns[0] // 2, columns[1] // 2)
    row_keys, hidden = hooks.row_keys, hooks.hidden
    SCORE, DROPOUT, dropout_bits_t, dropout_bit = hooks.SCORE, hooks.DROPOUT, hooks.dropout_bits_t, hooks.dropout_bit
    FUSED = SCORE or DROPOUT  # dS^T made with P^T, from the landed dP^T (its factors used as they are made)
    _, score_row, _, score_at_grad = hooks.tensor_core_score(False)

    @inline_device
    @unroll
    def probabilities_t(s, dp, smem, stats, key_row0, q_start, seqlen_q, seqlen_k, params, head_ctx, scale_log2,
                        units, q4, masked, drop_word):
        """S^T -> P^T = exp2(S^T * scale_log2 - lse_log2[query]) in place, for the thread's two key
        rows (key_row0, key_row0 + 8) and its query columns 8 c + 2 q4 + e; masked entries (keys
        past seqlen_k, or outside a query's window) get P = 0. With a score feature P comes from the
        variant's score of the raw S^T (in units[EXP] to base 2), and dP^T (landed) becomes dS^T at
        once, times the score's derivative (score_gradients_t's work, fused: the derivatives never
        all live at once).
        ``masked`` is a constant at each call site; ``stats`` indexes smem at the slot's lse_log2
        (less the score features' offset; then D, BM words on)."""
        # The score features' (row, key) bases: queries q_start + 2 q4 + column offset, the two key rows
        ctx = (score_row(q_start + 2 * q4, key_row0, seqlen_q, seqlen_k, params, head_ctx, units),
               score_row(q_start + 2 * q4, key_row0 + 8, seqlen_q, seqlen_k, params, head_ctx, units))
        for pair in static_range(FIRST_PAIR, END_PAIR):
            # Dropout's factors of queries 16 pair + 2 q4 (+1, +8, +9), the two key rows: one Philox call
            # per eight scores, shared with lane ^ 4 (Hooks.dropout_bits_t); a constant without dropout
            if staged_dropout:
                drop = (drop_word >> uint32(8 * pair)) & uint32(255)
            else:
                drop = dropout_bits_t(q_start + 16 * pair + 2 * q4, key_row0, params, head_ctx)
            for half in static_range(2):
                c = 2 * pair + half
                for e in static_range(2):
                    col = 8 * c + 2 * q4 + e
                    lse_c = u32_as_f32(smem[stats + col])
                    d_c = u32_as_f32(smem[stats + BM + col])  # used with a score feature or dropout
                    lo, hi = row_keys(q_start + col, seqlen_q, seqlen_k, params)  # used by the masked copy
                    for rh in static_range(2):
                        r = 4 * c + 2 * rh + e
                        dy = float32(1)
                        if SCORE:
                            y, dy = score_at_grad(s[r], ctx[rh], 8 * c + e, 0, seqlen_q, seqlen_k, params, head_ctx,
                                                  units)
                            p = exp2_approx(y * units[variants.EXP] - lse_c)
                        else:
                            p = exp2_approx(s[r] * scale_log2 - lse_c)
                        if masked:
                            if hidden(key_row0 + 8 * rh, lo, hi, q_start + col, seqlen_q, params, head_ctx):
                                p = float32(0)
                        factor = float32(1)
                        if DROPOUT:  # dV takes the dropped P; dP reaches P through the same factor
                            factor = dropout_bit(drop, 4 * rh + 2 * half + e, params)
                        s[r] = p * factor
                        if FUSED:
                            if handover:
                                word = dp + uint32(r * GROUP)
                                smem[word] = f32_as_u32(p * (u32_as_f32(smem[word]) * factor - d_c) * dy)
                            else:
                                dp[r] = p * (dp[r] * factor - d_c) * dy

    return probabilities_t


@lru_cache(maxsize=None)
def build_backward_sm90(config: Sm90BackwardConfig):
    """Compile-time constants of ``config`` captured in a fresh ``@cuda.jit`` kernel."""
    BM, BN, HD, HDP = config.block_m, config.block_n, config.headdim, config.headdim_padded
    CONSUMERS, STAGES, THREADS = config.consumers, config.stages, config.threads
    CHUNKS = HDP // CHUNK
    Q_BYTES, KV_BYTES, DS_BYTES, STATS_BYTES = config.q_bytes, config.kv_bytes, config.ds_bytes, config.stats_bytes
    Q_CHUNK_BYTES, KV_CHUNK_BYTES = BM * ROW_BYTES, BN * ROW_BYTES
    Q_STEPS = BM // 16  # k16 steps over a query tile (dV, dK)
    DQ_BY_COLUMNS = config.dq_split == "columns"
    DQ_BY_STEPS = config.dq_split == "steps"
    DQ_BY_ROWS = config.dq_split == "rows"  # block_m 128: consumer c adds dQ of query rows 64 c .. 64 c + 63
    DQ_ALL_KEYS = DQ_BY_COLUMNS or DQ_BY_STEPS or DQ_BY_ROWS  # dQ reads both consumers' dS^T (a barrier across both)
    NO_DQ = config.dq_split == "none"  # dK and dV only (the deterministic backward)
    KEY_STEPS = (BN if DQ_ALL_KEYS else KEYS) // 16  # k16 steps of dQ: all keys, or the consumer's
    DQ_CHUNKS = 1 if DQ_BY_COLUMNS or DQ_BY_ROWS else CHUNKS  # 64-column chunks of dQ a consumer adds
    DQ_FIRST = config.dq_first  # dQ_i's product ahead of dV's and dK's, its reductions under them
    # dQ columns per product: a consumer's half of headdim with "columns" (32 at headdim 64, 64 at
    # 128), else a 64-column chunk; the half's first byte in a row of K's tile: 64 bytes into the one
    # chunk at headdim 64 (the 128B swizzle is of the address, so a descriptor may start mid-row),
    # the second chunk at 128
    DQ_COLS = HDP // 2 if DQ_BY_COLUMNS else CHUNK
    HALF_OFFSET = (DQ_COLS // CHUNK) * KV_CHUNK_BYTES + (DQ_COLS % CHUNK) * 2
    HEAVY_GROUPS = config.heavy_groups
    DS_BUFFERS = config.ds_buffers  # dS^T's sets of tiles: by step parity, or one (a barrier before the stores)
    # A parity's dS^T tiles (64 keys x 64 queries each): the consumers' side by side, so that with a
    # split over all keys dQ_i's k16 steps walk all block_n keys of one tile pair in order. With
    # block_m 128 each tile is two such 64-query chunks, QCHUNK apart: chunk j of every consumer's tile
    # together (dQ over all keys for queries 64 j ..), or the consumer's own tile's two halves
    DS_TILE = KEYS * ROW_BYTES
    QCHUNK = (CONSUMERS if DQ_ALL_KEYS else 1) * DS_TILE
    S_REGS, ACC_REGS, P_REGS = BM // 2, HDP // 2, BM // 4  # per thread: S^T, dK (dV), packed P^T
    DQ_REGS = DQ_COLS // 2  # a product's dQ columns
    NT = BM // 8  # 8-column groups of S^T (queries)
    STAGED_DROPOUT = config.staged_dropout  # dropout's keep bits from the producer's warps 2 and 3
    DROP_WORD = 2 * BM + (4 if config.variant.block_mask else 0)  # ... at this word of a slot's stats
    # dQ_i staged in shared memory by the consumers, added by the producer's stats warp (dq_reduce="tiles")
    STAGED_DQ, DQ_STAGE_BYTES = config.dq_tile_major, config.dq_stage_bytes
    # the TMA thread's expect_tx and the stats warp's 32 lanes (and the dropout warps' 64)
    FULL_ARRIVALS = 1 + 32 + (64 if STAGED_DROPOUT else 0)
    EMPTY_ARRIVALS = CONSUMERS * GROUP
    SPLIT_REGISTERS = CONSUMERS == 2
    PRODUCER_REGS, CONSUMER_REGS = config.producer_registers, config.consumer_registers
    hooks = variants.hooks(config.variant)
    query_tiles, head_context = hooks.query_tiles, hooks.head_context
    # A block mask's classes: EMPTY (query tile, key tile) pairs are never loaded nor computed, FULL
    # ones skip the mask test (make_stage_stats); the steps walk the pairs visited (the i-th step is
    # pair i without one), walked and counted by whole warps where every lane is there (the
    # producer's and the prologue's): 32 classes a read. With one, the stats warp hands each step to
    # the consumers with its slot (make_consumer_step): a walk of their own kept the table and the
    # band's 64-bit bounds live across their loop, where they spilled (ptxas: 124 bytes, 12 now;
    # ncu: 6.6x the causal kernel's local loads; the document mask's backward ran 11% slower)
    BLOCK_MASK, warp_visited_query_steps = hooks.BLOCK_MASK, hooks.warp_visited_query_steps
    # softcap, ALiBi, bias, score_mod: P from the raw S^T through the score point, dS^T carries its
    # derivative; dropout: dV takes the dropped P^T, dS^T the factor too
    FUSED = hooks.SCORE or hooks.DROPOUT  # dS^T made with P^T, from the landed dP^T (make_probabilities_t)
    VARLEN, sequence = hooks.VARLEN, hooks.sequence  # packed sequences: where this block's rows are
    # No max here: any scale works, but ALiBi's slope per unit of a zero scale would not.
    score_units = hooks.tensor_core_score(False)[0]
    # commit groups left in flight while P^T is computed (with a score feature dS^T is made with P^T)
    PENDING = 1 if config.overlap and not FUSED else 0
    IS_F16 = config.dtype == "float16"
    AB = "f16" if IS_F16 else "bf16"
    # S^T (64 x BM) = K_c (K-major) Q_i^T (K-major), and dP^T = V_c dO_i^T
    issue_keys_by_queries = make_issue_keys_by_queries(make_wgmma_ss(BM, AB, 0), HDP, KV_CHUNK_BYTES, Q_CHUNK_BYTES)
    wgmma_keys_acc = make_wgmma_rs(HDP, AB, 1)  # dV (64 x HDP) += P^T (registers) dO (queries x HDP, MN-major)
    wgmma_dq = make_wgmma_ss(DQ_COLS, AB, 1, 1)  # dQ (64 x DQ_COLS) = dS (MN-major) K's columns (MN-major)
    K_MAJOR = (16, 1024)  # descriptor strides (bytes): 8-row groups 1024 apart, LBO unused
    STEP16 = 16 * ROW_BYTES >> 4  # descriptor increment of a k16 step of an MN-major tile: 16 rows
    init_ring = make_init_ring(STAGES, FULL_ARRIVALS, EMPTY_ARRIVALS)
    pack_a = make_pack_a(config.dtype, P_REGS)  # P^T's and dS^T's A registers
    add_dq = make_add_dq(HD, DQ_COLS)  # a product's dQ columns into dq_accum

    @inline_device
    def add_dq_columns(dq_accum, dq_acc, b, row0, h, seqlen_q, q4, consumer):
        """add_dq of the consumer's half of headdim ("columns"): the first column a constant in each
        copy (a run-time one spilled 208 bytes)."""
        if consumer == 0:
            add_dq(dq_accum, dq_acc, b, row0, h, 0, seqlen_q, q4)
        else:
            add_dq(dq_accum, dq_acc, b, row0, h, DQ_COLS, seqlen_q, q4)

    @inline_device
    def ds_set(i):
        """The set of dS^T tiles step i writes and reads: its parity's, or the one set."""
        return i % 2 if DS_BUFFERS == 2 else 0

    @inline_device
    def all_keys_ds(ds_tiles, i):
        """dS over all block_n keys (a split over all keys): from step i's set's first dS^T tile."""
        return smem_descriptor(ds_tiles + uint32(ds_set(i) * CONSUMERS * DS_BYTES), DS_BYTES, 1024, SWIZZLE_128B)

    @inline_device
    def rows_ds(ds_tiles, i, consumer):
        """dS of the consumer's 64 query rows over all block_n keys ("rows"): query chunk ``consumer``
        of step i's set's tiles."""
        return smem_descriptor(ds_tiles + uint32(ds_set(i) * CONSUMERS * DS_BYTES + consumer * QCHUNK), DS_BYTES, 1024,
                               SWIZZLE_128B)

    @inline_device
    def half_k(k_tile, consumer):
        """K's columns of the consumer's half of headdim ("columns"), every key of the tile."""
        return smem_descriptor(k_tile + uint32(consumer * HALF_OFFSET), KV_CHUNK_BYTES, 1024, SWIZZLE_128B)
    store_rows = make_store_rows(config.dtype, HD, HDP, quads=config.store_quads)  # dK, dV
    STORE_TMA = config.store_tma  # ... or through K's and V's tiles and TMA
    write_tiles, store_tiles = make_store_tma(config)
    block_rows = make_block_rows(hooks, BN)  # where the block's rows are (packed sequences: its sequence's)
    produce_tiles = make_produce_tiles(config, hooks)  # the producer's warp 0
    stage_stats = make_stage_stats(config, hooks)  # the producer's warp 1
    DQ_WARP = config.dq_warp
    reduce_staged_dq = make_reduce_staged_dq(config, hooks)  # the producer's warp 2, with DQ_WARP
    FOLD = config.fold_dq  # ... which then marks the query tiles this block converts, after its loop
    convert_marked = make_convert_marked(config, hooks)
    probabilities_t = make_probabilities_t(hooks, BM, staged_dropout=STAGED_DROPOUT)
    stage_dropout = make_stage_dropout(config, hooks)  # the producer's warps 2 and 3, with STAGED_DROPOUT
    # with STAGED_DQ, the consumer's part of dQ_i for the stats warp: half the columns, or its 64 rows
    stage_dq = make_stage_dq(64, DQ_COLS) if DQ_BY_ROWS else make_stage_dq(BM, DQ_COLS)
    DQ_UNIT_BYTES = 64 * HDP * 4  # ("rows") a consumer's 64 rows of the staged tile
    consumer_step = make_consumer_step(hooks, BM, STAGES, STATS_BYTES, make_step_pair(config))

    @inline_device
    def issue_scores(s, dp, desc_k, desc_v, qd_full, q_ring, do_ring, slot, use):
        """S^T = K_c Q_i^T and dP^T = V_c dO_i^T of the step whose tiles are in ring ``slot`` (its
        ``use``-th fill), once they have landed: two commit groups; returns their accumulators (the
        first k16 step ignores what s and dp hold)."""
        acc_s = fence_operands(registers_from(s, S_REGS))
        acc_dp = fence_operands(registers_from(dp, S_REGS))
        mbarrier_wait(qd_full + uint32(8 * slot), use & 1)
        wgmma_fence()  # the accumulators' registers are ordered before wgmma uses them
        acc_s = issue_keys_by_queries(acc_s, desc_k, smem_descriptor(q_ring + uint32(slot * Q_BYTES), K_MAJOR[0],
                                                                     K_MAJOR[1], SWIZZLE_128B))
        acc_dp = issue_keys_by_queries(acc_dp, desc_v, smem_descriptor(do_ring + uint32(slot * Q_BYTES), K_MAJOR[0],
                                                                       K_MAJOR[1], SWIZZLE_128B))
        return acc_s, acc_dp

    @inline_device
    @unroll
    def issue_keys_acc(acc, a_regs, desc_b):
        """acc += A B over the query tile (dV += P^T dO_i or dK += dS^T Q_i), A from registers (k16
        step ks: registers 4 ks .. 4 ks + 3), one commit group."""
        for ks in static_range(Q_STEPS):
            acc = wgmma_keys_acc(acc, a_regs[4 * ks], a_regs[4 * ks + 1], a_regs[4 * ks + 2], a_regs[4 * ks + 3],
                                 desc_b + uint64(ks * STEP16), uint32(1))
        wgmma_commit()
        return acc

    @inline_device
    @unroll
    def issue_dq(acc, desc_ds, desc_k):
        """acc = dS K for DQ_COLS columns of headdim, over the consumer's 64 keys or all block_n."""
        for ks in static_range(KEY_STEPS):
            acc = wgmma_dq(acc, desc_ds + uint64(ks * STEP16), desc_k + uint64(ks * STEP16),
                           uint32(0 if ks == 0 else 1))
        wgmma_commit()
        return acc

    @inline_device
    @unroll
    def score_gradients_t(p, dp, smem, stats, q4):
        """dP^T -> dS^T = P^T (dP^T - D[query]) in place (P^T = 0 where masked gives dS^T = 0)."""
        for c in static_range(NT):
            for e in static_range(2):
                d_c = u32_as_f32(smem[stats + BM + 8 * c + 2 * q4 + e])
                for rh in static_range(2):
                    r = 4 * c + 2 * rh + e
                    dp[r] = p[r] * (dp[r] - d_c)

    @inline_device
    @unroll
    def store_ds_t(ds_tile, packed, warp, g, q4):
        """The thread's packed dS^T (rows 16 warp + g and + 8, query columns 8 c + 2 q4, + 1) into the
        consumer's dS^T tile at shared address ``ds_tile``: rows of 128 bytes, 16-byte unit c stored
        at c ^ (row % 8) (the swizzle TMA writes and wgmma reads; row % 8 = g). A row starts on 128
        bytes of the tile, so the unit is bits 4-6 of the offset in it: the thread's first word is
        unit g of its row (c = 0), unit c ^ g is that offset with bits 4-6 XORed by c, and the row 8
        on is 1024 bytes further. So one XOR a unit and the stores' own offsets (through an index
        into the smem array, each word's signed 64-bit index took five more instructions). With
        block_m 128, query groups 8 on are the second chunk's, QCHUNK further."""
        first = uint32((16 * warp + g) * ROW_BYTES + 16 * g + 4 * q4)
        for i in static_range(P_REGS):
            c = i // 2  # the 8-query group: unit c % 8 of chunk c // 8
            if BM == 64:  # (the general form below, as it was written before block_m 128: the same SASS)
                store_shared_u32(ds_tile + ((first ^ uint32(16 * c)) + uint32(8 * ROW_BYTES * (i % 2))), packed[i])
            else:
                store_shared_u32(ds_tile + uint32((c // 8) * QCHUNK) + ((first ^ uint32(16 * (c % 8)))
                                                                        + uint32(8 * ROW_BYTES * (i % 2))), packed[i])

    # -----------------------------------------------------------------------------------------------
    # The kernel
    # -----------------------------------------------------------------------------------------------

    @launch_bounded(THREADS, 1)
    @unroll
    def backward_dkdv_sm90(q, k, v, dout, lse, delta, dk, dv, dq_accum, dq, maps, scale_log2, scale, params):
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
        ds_tiles = do_ring + uint32(STAGES * Q_BYTES)
        dq_stage = ds_tiles + uint32(DS_BUFFERS * CONSUMERS * DS_BYTES)  # with STAGED_DQ: BM x HDP float32
        stats_ring = dq_stage + uint32(DQ_STAGE_BYTES)
        kv_full = stats_ring + uint32(STAGES * STATS_BYTES)
        qd_full = kv_full + uint32(8)  # + 8 * slot
        qd_empty = qd_full + uint32(8 * STAGES)
        dq_full = qd_empty + uint32(8 * STAGES)  # with STAGED_DQ: the staged tile is stored
        dq_empty = dq_full + uint32(8)  # ... and the stats warp has had it read
        fold_marks = dq_empty + uint32(8)  # with FOLD: a bit a step, the query tiles this block converts
        stats_word0 = (stats_ring - smem_start) // uint32(4)  # smem's index of the first slot's stats

        # ---- Which query tiles see this key tile (geometry.py): [first_tile, end_tile), of which
        # [first_full, end_full) see all of its keys; the key tail always masks. One step per
        # (query head of the group, query tile).
        first_tile, first_full, end_full, end_tile = query_tiles(
            n_start, min(n_start + BN, seqlen_k), seqlen_q, seqlen_k, params, BM)
        tail = n_start + BN > seqlen_k
        tiles_per_head = end_tile - first_tile
        steps = warp_visited_query_steps(params, b, hk, group, n_block, first_tile, tiles_per_head, tid % 32)

        if tid == 0:
            if STAGED_DQ:
                mbarrier_init(dq_full, CONSUMERS * GROUP)
                mbarrier_init(dq_empty, 32)
            init_ring(kv_full, qd_full, qd_empty)  # (its fence covers the ones above)
        cuda.syncthreads()  # the barriers are initialised before anyone arrives on or waits for them

        if group_id == 0:
            # ---- Producer: warp 0 issues the copies, warp 1 stages lse and D (warp 2 adds dQ with DQ_WARP) ----
            if SPLIT_REGISTERS:
                setmaxnreg_dec(PRODUCER_REGS)
            warp = tid // 32
            lane = tid % 32
            if warp == 0 and steps > 0:
                produce_tiles(maps, k_tile, v_tile, q_ring, do_ring, kv_full, qd_full, qd_empty, params, b, hk, group,
                              n_block, first_tile, tiles_per_head, steps, q_row0, k_row0, mem_b, lane)
            elif warp == 1:  # (with STAGED_DQ, dQ from the staged tile into dq_accum too)
                stage_stats(smem, stats_word0, qd_full, qd_empty, lse, delta, b, hk, group, n_block, first_tile,
                            tiles_per_head, steps, seqlen_q, params, scale, lane, tail, first_full, end_full, 0,
                            dq_accum, dq_stage, dq_full, dq_empty)
            elif STAGED_DROPOUT and warp >= 2:  # warps 2 and 3
                stage_dropout(smem, stats_word0, qd_full, qd_empty, params, b, hk, group, n_block, first_tile,
                              tiles_per_head, steps, n_start, tid - 64)
            elif DQ_WARP and warp == 2:  # the staged dQ_i into dq_accum, apart from the stats
                reduce_staged_dq(dq_accum, dq_stage, dq_full, dq_empty, params, b, hk, group, n_block, first_tile,
                                 tiles_per_head, steps, lse.shape[2], fold_marks, seqlen_q, seqlen_k, lane)
                if FOLD:  # every step is counted and marked (bar.arrive orders the marks' stores before)
                    named_barrier_arrive(FOLD_BARRIER, CONSUMERS * GROUP + 32)
            if STORE_TMA and warp == 0:  # dK and dV out of K_j's and V_j's tiles, once the consumers wrote them
                store_tiles(k_tile, array_address(maps), mem_b, n_start, hk, seqlen_k)
        else:
            # ---- Consumers: 64 keys each ----
            if SPLIT_REGISTERS:
                setmaxnreg_inc(CONSUMER_REGS)
            consumer = group_id - 1
            lane = tid % 32
            warp = (tid % GROUP) // 32
            g, q4 = lane >> 2, lane & 3
            key_base = n_start + KEYS * consumer  # the consumer's first key
            key_row0 = key_base + 16 * warp + g  # the thread's first key row (+8: the second)
            rows_off = uint32(KEYS * consumer * ROW_BYTES)  # the consumer's rows in a K or V chunk
            desc_k = smem_descriptor(k_tile + rows_off, K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)
            desc_v = smem_descriptor(v_tile + rows_off, K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)
            ds_pair = ds_tiles + uint32(2 * consumer * DS_BYTES)  # the consumer's two dS^T tiles

            s = cuda.local.array(S_REGS, float32)
            dp = cuda.local.array(S_REGS, float32)
            dk_acc = cuda.local.array(ACC_REGS, float32)
            dv_acc = cuda.local.array(ACC_REGS, float32)
            dq_acc = cuda.local.array(DQ_REGS, float32)
            p = cuda.local.array(P_REGS, uint32)
            ds = cuda.local.array(P_REGS, uint32)
            for r in static_range(S_REGS):
                s[r] = float32(0)
                dp[r] = float32(0)
            for r in static_range(ACC_REGS):
                dk_acc[r] = float32(0)
                dv_acc[r] = float32(0)
            for r in static_range(DQ_REGS):
                dq_acc[r] = float32(0)

            if steps > 0:
                mbarrier_wait(kv_full, 0)
            for step in range(steps):
                i = uint32(step)  # unsigned: i % STAGES and i % 2 are ANDs, not Python's signed modulo
                if VARLEN:  # the sequence's first query row and lengths, read again each step (L1 hits):
                    # held across the loop, they and what the masks make of them spilled
                    q_first, q_rows, _, k_rows = sequence(params, b, q.shape[1], k.shape[1])
                    q_row0, seqlen_q, seqlen_k = int32(q_first), int32(q_rows), int32(k_rows)
                h, tile, step_masked = consumer_step(smem, qd_full, stats_word0, params, b, hk, group, n_block,
                                                     first_tile, tiles_per_head, i)
                slot, use = i % STAGES, i // STAGES
                head_ctx = head_context(params, b, h)  # (b, h, ALiBi slope): what the variant reads per head
                units = score_units(params, scale, head_ctx)  # the score features' constants for this head
                q_start = tile * BM
                q_slot = q_ring + uint32(slot * Q_BYTES)
                do_slot = do_ring + uint32(slot * Q_BYTES)

                # S^T = K_c Q_i^T and dP^T = V_c dO_i^T, two commit groups
                acc_s, acc_dp = issue_scores(s, dp, desc_k, desc_v, qd_full, q_ring, do_ring, slot, use)
                stats = stats_word0 + uint32(slot * (STATS_BYTES // 4))
                wgmma_wait(PENDING)  # S^T has landed (with overlap, dP^T may still run)
                registers_to(s, fence_operands(acc_s))
                if FUSED:  # dP^T too: its derivative (and dropout's factors) used as it is made
                    registers_to(dp, fence_operands(acc_dp))

                # P^T, the mask only on tiles crossing the window's edges or a tail (with a block mask,
                # the stats warp's word says it: those or not FULL); then dS^T
                drop_word = uint32(0)  # with STAGED_DROPOUT, the thread's keep bits (the producer's)
                if STAGED_DROPOUT:
                    drop_word = smem[stats + uint32(DROP_WORD) + uint32(tid - GROUP)]
                if step_masked if BLOCK_MASK else tail or tile < first_full or tile >= end_full:
                    probabilities_t(s, dp, smem, stats, key_row0, q_start, seqlen_q, seqlen_k, params, head_ctx,
                                    scale_log2, units, q4, True, drop_word)
                else:
                    probabilities_t(s, dp, smem, stats, key_row0, q_start, seqlen_q, seqlen_k, params, head_ctx,
                                    scale_log2, units, q4, False, drop_word)
                if not FUSED:
                    wgmma_wait(0)  # dP^T has landed
                    registers_to(dp, fence_operands(acc_dp))
                    score_gradients_t(s, dp, smem, stats, q4)
                pack_a(s, p)
                pack_a(dp, ds)
                # dS^T into the tile of this step's parity: the other may still be read by the last
                # step's dQ in another warp; every warp is past that once the barrier below is passed
                # (with one set, the barrier before the stores waits for the last step's dQ instead)
                ds_tile = ds_pair + uint32((i % 2) * DS_BYTES)
                if DQ_BY_ROWS:  # ... in two 64-query chunks (the block_m 64 form below keeps its SASS)
                    ds_tile = ds_tiles + uint32(ds_set(i) * CONSUMERS * DS_BYTES + consumer * DS_TILE)
                elif DQ_ALL_KEYS:  # a parity's tiles hold dS^T of all block_n keys, rows in order
                    ds_tile = ds_tiles + uint32(((i % 2) * CONSUMERS + consumer) * DS_TILE)
                if DS_BUFFERS == 1:  # one set: both consumers' dQ products of the last step have read it
                    named_barrier_sync(3, CONSUMERS * GROUP)
                if not NO_DQ:
                    store_ds_t(ds_tile, ds, warp, g, q4)
                    fence_proxy_async()  # the dS^T stores are ordered before wgmma reads them

                # dV += P^T dO_i and dK += dS^T Q_i
                p_regs = fence_operands(registers_from(p, P_REGS))
                ds_regs = fence_operands(registers_from(ds, P_REGS))
                acc_dv = fence_operands(registers_from(dv_acc, ACC_REGS))
                acc_dk = fence_operands(registers_from(dk_acc, ACC_REGS))
                if DQ_ALL_KEYS:
                    named_barrier_sync(1, CONSUMERS * GROUP)  # both consumers' dS^T is stored
                elif not NO_DQ:
                    named_barrier_sync(1 + consumer, GROUP)  # the warpgroup's dS^T is stored
                if DQ_FIRST:
                    acc_q = fence_operands(registers_from(dq_acc, DQ_REGS))
                wgmma_fence()  # P^T's, dS^T's and the accumulators' registers are ordered before wgmma
                if DQ_BY_ROWS:  # dQ_i = dS K over all block_n keys, the consumer's 64 rows, first
                    acc_q = issue_dq(acc_q, rows_ds(ds_tiles, i, consumer),
                                     smem_descriptor(k_tile, KV_CHUNK_BYTES, 1024, SWIZZLE_128B))
                elif DQ_FIRST:  # dQ_i = dS K over all block_n keys, the consumer's half of headdim, first
                    acc_q = issue_dq(acc_q, all_keys_ds(ds_tiles, i), half_k(k_tile, consumer))
                acc_dv = issue_keys_acc(acc_dv, p_regs, smem_descriptor(do_slot, Q_CHUNK_BYTES, 1024, SWIZZLE_128B))
                acc_dk = issue_keys_acc(acc_dk, ds_regs, smem_descriptor(q_slot, Q_CHUNK_BYTES, 1024, SWIZZLE_128B))
                if DQ_FIRST:  # dQ_i's reductions while the tensor cores run dV's and dK's products
                    wgmma_wait(2)  # dQ_i has landed (commit groups complete in order)
                    registers_to(dq_acc, fence_operands(acc_q))
                    if DQ_BY_ROWS:  # the consumer's 64-row unit of the staged tile
                        stage_dq(dq_stage + uint32(consumer * DQ_UNIT_BYTES), dq_acc, dq_full, dq_empty, i,
                                 16 * warp + g, 0, q4)
                    elif STAGED_DQ:  # into shared memory, for the producer's stats warp
                        stage_dq(dq_stage, dq_acc, dq_full, dq_empty, i, 16 * warp + g, DQ_COLS * consumer, q4)
                    else:
                        add_dq_columns(dq_accum, dq_acc, mem_b, q_row0 + q_start + 16 * warp + g, h,
                                       q_row0 + seqlen_q, q4, consumer)
                    wgmma_wait(0)  # dV's and dK's products are done with Q_i and dO_i
                    registers_to(dv_acc, fence_operands(acc_dv))
                    registers_to(dk_acc, fence_operands(acc_dk))
                    mbarrier_arrive(qd_empty + uint32(8 * slot))  # this thread is done with the slot
                    continue

                # dQ_i += dS K_c, a 64-column chunk at a time
                desc_ds = smem_descriptor(ds_tile, DS_BYTES, 1024, SWIZZLE_128B)  # dS: queries contiguous
                if DQ_ALL_KEYS:
                    desc_ds = all_keys_ds(ds_tiles, i)
                if NO_DQ or (DQ_BY_STEPS and i % 2 != consumer):  # no dQ_i here, or the other consumer's
                    wgmma_wait(0)  # dV's and dK's products are done with Q_i and dO_i
                    registers_to(dv_acc, fence_operands(acc_dv))
                    registers_to(dk_acc, fence_operands(acc_dk))
                    mbarrier_arrive(qd_empty + uint32(8 * slot))  # this thread is done with the slot
                    continue
                for chunk in static_range(DQ_CHUNKS):
                    desc_kc = smem_descriptor(k_tile + uint32(chunk * KV_CHUNK_BYTES) + (uint32(0) if DQ_BY_STEPS
                                              else rows_off), KV_CHUNK_BYTES, 1024, SWIZZLE_128B)
                    if DQ_BY_COLUMNS:
                        desc_kc = half_k(k_tile, consumer)
                    acc_q = fence_operands(registers_from(dq_acc, DQ_REGS))
                    acc_q = issue_dq(acc_q, desc_ds, desc_kc)
                    wgmma_wait(0)
                    registers_to(dq_acc, fence_operands(acc_q))
                    if chunk == 0:  # dV's and dK's products are done with Q_i and dO_i as well
                        registers_to(dv_acc, fence_operands(acc_dv))
                        registers_to(dk_acc, fence_operands(acc_dk))
                        mbarrier_arrive(qd_empty + uint32(8 * slot))  # this thread is done with the slot
                    if DQ_BY_COLUMNS:
                        add_dq_columns(dq_accum, dq_acc, mem_b, q_row0 + q_start + 16 * warp + g, h,
                                       q_row0 + seqlen_q, q4, consumer)
                    else:
                        add_dq(dq_accum, dq_acc, mem_b, q_row0 + q_start + 16 * warp + g, h, chunk * CHUNK,
                               q_row0 + seqlen_q, q4)

            # ---- Write dK = dS^T Q * scale and dV (keys no query sees get 0) ----
            if VARLEN:  # the key rows again: not held across the loop
                _, _, k_first, k_rows = sequence(params, b, q.shape[1], k.shape[1])
                k_row0, seqlen_k = int32(k_first), int32(k_rows)
            if STORE_TMA:  # once neither consumer's products read K_j or V_j any more
                named_barrier_sync(4, CONSUMERS * GROUP)
                write_tiles(k_tile, dk_acc, dv_acc, scale, consumer, warp, lane)
            else:
                store_rows(dk, dk_acc, mem_b, k_row0 + key_row0, hk, k_row0 + seqlen_k, scale, q4)
                store_rows(dv, dv_acc, mem_b, k_row0 + key_row0, hk, k_row0 + seqlen_k, float32(1), q4)
            if FOLD:  # dq of the query tiles whose last arrival was this block's
                named_barrier_sync(FOLD_BARRIER, CONSUMERS * GROUP + 32)
                convert_marked(smem, (fold_marks - smem_start) // uint32(4), dq_accum, dq, params, b, hk, group,
                               n_block, first_tile, tiles_per_head, steps, seqlen_q, seqlen_k, scale,
                               4 * consumer + warp, lane)

    return backward_dkdv_sm90


# -------------------------------------------------------------------------------------------------
# The dq conversion from a tile-major dq_accum (dq_reduce="tiles")
# -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sm90ConvertDqConfig:
    """dq = dq_accum * scale, in the input dtype, from dq_accum held tile-major (``dq_accum_shape``,
    the dK/dV kernel's ``dq_reduce="tiles"``): one block of 128 threads a 64-row unit, thread t
    reading the registers that thread t of a consumer staged in each part (16-byte loads of
    consecutive threads), then writing them as the dK/dV kernel writes dK (``make_store_rows``). One
    pass over dq_accum, as the row-major conversion's."""

    dtype: str  # 'float16' or 'bfloat16'
    headdim: int
    part_columns: int  # the dK/dV config's dq_part_columns: a staged product's columns
    # packed sequences: dq_accum as dq_accum_shape lays them out (a batch row, each sequence from its
    # padded_first_row), dq the packed rows (a batch of one); the kernel takes cu_seqlens_q after dq
    # and its grid a block row per sequence (batch: the sequences, seqlen_q: the longest)
    varlen: bool = False
    # packed sequences: the dK/dV kernel's query tile (its block_m), to which each sequence's first
    # row of dq_accum is padded (padded_first_row); its 128-row tiles are two of this kernel's units
    tile_rows: int = 64
    # dq stored 16 bytes a lane after a transpose across each quad (``make_store_rows``'s quads, as
    # the dK/dV kernel's ``store_quads``), instead of a 32-bit pair a store. The kernel ran at 0.47-0.57x
    # the device-to-device copy's bandwidth on an H100 (thirty-fifth session, sm90_schedules.py
    # --parts: 127-154 us at 4k, 4-5% of the call). An option until timed (configs.SM90_CONVERT_DQ_QUADS)
    store_quads: bool = False
    kernel = "convert_dq"  # the backward's plan reads it (one kernel of the three)
    block_m = 64  # rows of a unit (dq_accum_shape)
    threads = GROUP
    atomic_dq = True
    dynamic_shared_bytes = 0
    launch_bounds = (GROUP, 1)

    def __post_init__(self):
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"{self.dtype=} must be 'float16' or 'bfloat16'")
        if self.headdim % 8 or not 8 <= self.headdim <= MAX_HEADDIM:
            raise ValueError(f"{self.headdim=} must be a multiple of 8 in 8..{MAX_HEADDIM}")
        if self.part_columns % 8 or self.headdim_padded % self.part_columns:
            raise ValueError(f"{self.part_columns=} must be a multiple of 8 dividing {self.headdim_padded}")
        if self.tile_rows not in (64, 128) or (self.tile_rows != 64 and not self.varlen):
            raise ValueError(f"{self.tile_rows=} must be 64, or 128 with packed sequences (varlen=True)")
        if self.store_quads and self.headdim_padded % 32:
            raise ValueError(f"store_quads=True takes whole sets of four 8-column groups, not {self.headdim_padded=}")

    headdim_padded = Sm90BackwardConfig.headdim_padded

    def grid(self, batch, nheads, nheads_k, seqlen_q, seqlen_k):
        return (-(-seqlen_q // self.block_m), nheads, batch)


@lru_cache(maxsize=None)
def build_convert_dq_tiles(config: Sm90ConvertDqConfig):
    BM = config.block_m
    TILE_ROWS = config.tile_rows  # packed sequences: the dK/dV kernel's tiles, whose padding dq_accum has
    store_rows = make_store_rows(config.dtype, config.headdim, config.headdim_padded, quads=config.store_quads)
    convert_unit = make_convert_unit(config.headdim_padded, config.part_columns, load_u32x4_nc, store_rows)

    if config.varlen:

        @launch_bounded(GROUP, 1)
        def backward_convert_dq_tiles_varlen(dq_accum, dq, cu_seqlens_q, scale):
            q_start = cuda.blockIdx.x * BM
            h, b = cuda.blockIdx.y, cuda.blockIdx.z
            q_first, q_rows, _, _ = packed_sequence(cu_seqlens_q, cu_seqlens_q, b, dq.shape[1], dq.shape[1])
            if q_start < q_rows:  # the sequence's tile q_start / BM, from its first whole tile of dq_accum
                first = padded_first_row(q_first, b, TILE_ROWS) + q_start
                convert_unit(dq_accum, dq, 0, h, first, q_first + q_start, q_first + q_rows, scale, cuda.threadIdx.x)

        return backward_convert_dq_tiles_varlen

    @launch_bounded(GROUP, 1)
    def backward_convert_dq_tiles(dq_accum, dq, scale):
        q_start = cuda.blockIdx.x * BM
        convert_unit(dq_accum, dq, cuda.blockIdx.z, cuda.blockIdx.y, q_start, q_start, dq.shape[1], scale,
                     cuda.threadIdx.x)

    return backward_convert_dq_tiles
