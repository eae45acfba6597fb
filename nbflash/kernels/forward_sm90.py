"""FlashAttention forward on Hopper (sm_90a): wgmma, TMA and warp specialization, as in FlashAttention-3.

The algorithm is forward_mma.py's (the paper's Algorithm 1, flash-attn 2's split of the work); what
changes is who moves the data and how the products are issued:

    for each block of block_m query rows (one thread block):
        producer warpgroup (one elected thread):
            Q_i -> shared memory (TMA), once, completing on q_full
            for the i-th key tile j the rows see (i = 0, 1, ...: causal and windows skip tiles,
            so j = first_tile + i; a block mask skips its empty tiles too): wait until ring slot
            i % stages is empty, then
                K_j, V_j -> slot (TMA), completing on k_full / v_full of the slot
        each consumer warpgroup (64 query rows of the block):
            m_i = -inf, l_i = 0, acc = 0                                (registers)
            for the i-th key tile j (slot i % stages):
                wait k_full;  S = Q_i K_j^T                            (wgmma, both from shared memory)
                S = mask(S)                   only on tiles that cross the window's edges or the tail
                m_new = max(m_i, rowmax(S));  alpha = exp2((m_i - m_new) * scale_log2)
                P = exp2(S * scale_log2 - m_new * scale_log2);  l_i = alpha * l_i + rowsum(P)
                wait v_full;  acc = alpha * acc + P V_j                (wgmma, P from registers)
                arrive on the slot's empty barrier (the producer may refill it)
            O_i = acc / l_i;   lse_i = (m_i * scale_log2 + log2(l_i)) * ln(2)

Two other schedules of the consumers' loop (``Sm90ForwardConfig.overlap`` and ``pingpong``): S_j
issued together with P_{j-1} V_{j-1}, so that the softmax of S_j runs while P_{j-1} V_{j-1} is in
flight and O is rescaled once it lands (FlashAttention-3's intra-warpgroup pipelining); and with it the two consumers
taking turns to issue their products through named barriers 1 and 2 (ping-pong). Both are correct;
at headdim 128 both measured slower than the plain loop (docs/perf-notes.md, "Hopper forward"), so
the planner does not use them. A third option, ``exp2_fma_groups``, makes part of each row's P by a
polynomial on the FMA pipes (primitives.exp2_fma3, exp2_fma4) instead of MUFU's ex2.approx, which
the exponentials otherwise queue on where the products are short (fp8, headdim 64): FlashAttention-4's
split, not yet timed.

Grid and threads: grid = (ceil(seqlen_q / block_m), nheads, batch), or with ``heavy_groups`` G
(G ceil(seqlen_q / block_m), ceil(batch nheads / G), 1): each row of blocks a group of G (batch,
query head) pairs, query block by query block; block = 128 * (consumers + 1)
threads. Warpgroup 0 is the producer (it lowers its register cap with setmaxnreg, the consumers
raise theirs); warpgroup 1 + c owns query rows [64 c, 64 c + 64) of the block's tile. With a window
(causal is the window (-1, 0)) blockIdx.x is reversed so the query blocks with the most keys start
first.

Registers (the wgmma accumulator layout, nbflash/primitives_sm90.py): thread t of a consumer
warpgroup (w = warp in the group, g = lane // 4, q4 = lane % 4) holds, of each 64-row accumulator,
rows 16 w + g (registers 4 c + e) and 16 w + g + 8 (registers 4 c + 2 + e), columns 8 c + 2 q4 + e.
A row's max and sum are reduced over the 4 lanes of a quad, as with mma.sync, and the k16 slice s of
S (registers 8 s .. 8 s + 7) packs, pair by pair, into the A registers of P V's k-step s: P never
leaves the registers.

Shared memory (dynamic, 16-bit elements, every tile 1024-byte aligned): the Q tile, then the ring of
K tiles, the ring of V tiles, then the mbarriers. A tile is stored as its 64-column chunks (headdim
padded to a multiple of 64 by TMA's zero fill), each chunk rows of 128 bytes in the 128-byte swizzle
that TMA writes and wgmma reads: the K-major operand image for Q and K, and read as keys x headdim
the MN-major image for V. So no thread ever copies or re-lays a tile.

Memory: q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim), any
strides that are multiples of 16 bytes with the last dimension contiguous, headdim a multiple of 8;
float16 arrays, or uint16 arrays holding bfloat16 bits. ``maps`` holds the three 4-D tensor maps of
q, k and v (``tensor_maps``: boxes of 1 x block rows x 1 x 64 columns), built by the launcher; rows
past a sequence's end and columns past headdim arrive as zeros. out like q (C-contiguous), lse
float32 (batch, nheads, seqlen_q), natural log. Query head h reads key/value head
h // (nheads // nheads_k). A row that sees no key gets out = 0 and lse = -inf.

fp8 (``dtype='float8_e4m3fn'``, FlashAttention-3's fp8 forward; its GPU tests pass on the H100,
docs/benchmarks.md has its speed): q, k and v in e4m3, handed over as uint16 arrays of byte pairs
(so TMA and the tile chunks are those of the 16-bit path, a chunk now 128 columns), out bfloat16
bits, lse as above. wgmma reads 8-bit operands K-major only, so V arrives transposed: ``v`` is
V^T, (batch, nheads_k, headdim, seqlen_k rounded up to 16, zeros past the end), and within each
16 keys in ``FP8_KEY_ORDER``. That order lets a thread pack P, rounded to e4m3 in registers, from
its own S accumulators into P V's A registers without a shuffle (the fp8 A fragment holds 4
consecutive k per register, the accumulator pairs 8 columns apart; tests/test_primitives_sm90.py
shows the pairing). The transpose is a kernel of its own (transpose_fp8.py, launched by
nbflash/interface.py before this one): a read and a write of V's bytes, per call. The per-(batch,
kv head) descales (FlashAttention-3's q_descale, k_descale, v_descale) come as the last entry of
``params``, a float32 (3, batch, nheads_k) array: the first two scale the scores (folded into the
exp2 scale), the third O before it is written. The row sums l_i add P before its rounding to
e4m3. block_n is a multiple of 128 (V^T's 128-byte swizzled rows are 128 keys); headdim a multiple
of 16, padded to 128-column chunks (TMA fills them with zeros; the products stop at headdim). The
plain consumer loop is planned; the overlapped loop and ping-pong are options (up to headdim 128:
at 256 S, P and O do not fit beside each other), timed by scripts/fp8_parts.py.

Variants (nbflash/kernels/variants.py): every feature but packed sequences (``served``), with a
positive scale: the window (causal included), softcap, ALiBi, the additive bias tensor, the boolean
mask tensor, score_mod, mask_mod with or without its block mask, and dropout, in any combination.
Without a score feature the scale is folded into exp2. With one, the raw S goes through the variant's
tensor-core score point (``Hooks.tensor_core_score``, as in forward_mma.py) right after it lands,
before the mask: ``score_row`` once per row of the thread (row0 and row0 + 8; ALiBi's distance as a
float), then ``score_at`` per column 8 c + 2 q4 + e (the bias tensor and score_mod read that
element's (row, key)). That leaves S in units whose positive factor to base 2 (units[EXP]:
softcap's cap, the scale for ALiBi alone, log2(e) in the natural units of a bias or score_mod)
takes the scale's place in exp2, plus an offset in base 2 (units[OFFSET], softcap's -1 of its exp2
tanh) that only the lse sees. The mask point is ``hidden`` on the same elements; with an element
mask (the mask tensor, mask_mod) no tile is known to be whole (``key_tiles`` says so), so every
visited tile takes it, except where a block mask's table calls a tile FULL (mask_mod keeps it
whole); the tiles the table calls EMPTY are never loaded nor computed: the producer and the
consumers walk the same visited tiles (``visit_key_tile``), counted by ``visited_key_tiles``.
Dropout is the probability point: each P kept or zeroed as it is packed for P V (``drop_p``), after
l_i has summed the undropped P, the kept scale applied with 1 / l, as forward_mma.py's mma_p_v
does. A feature that is absent compiles to nothing. Packed sequences stay with the sm80 family
(nbflash/kernels/forward_mma.py), as do headdims that are not multiples of 8 and rows off 16 bytes;
the fp8 path serves the plain kernel and the window only (``FP8_VARIANTS``).
"""

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32, uint64

from nbflash.primitives import (
    exp2_approx,
    exp2_fma3,
    exp2_fma4,
    global_address,
    inline_device,
    pack_bf16x2,
    pack_f16x2,
    quad_max,
    quad_sum,
    shared_address,
    static_range,
    store_u32,
    unroll,
    warp_all,
)
from nbflash.primitives_sm90 import (
    SWIZZLE_128B,
    array_address,
    cached_tensor_maps,
    check_register_split,
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
    named_barrier_arrive,
    named_barrier_sync,
    pack_e4m3x4,
    registers_from,
    registers_to,
    setmaxnreg_dec,
    setmaxnreg_inc,
    smem_descriptor,
    tensor_map_4d_words,
    tile_base,
    tma_load_4d,
    warpgroup_index,
    wgmma_commit,
    wgmma_fence,
    wgmma_wait,
)
from nbflash.problem import Variant

from . import variants
from .geometry import grouped_grid, grouped_query_block

LN2 = math.log(2.0)
CHUNK = 64  # columns of a tile chunk: one 128-byte swizzled row of 16-bit elements
ROW_BYTES = 128  # bytes of a chunk row
GROUP = 128  # threads of a warpgroup
# The plain kernel and the window (causal included): what the fp8 path serves.
FP8_VARIANTS = (Variant(), Variant(window=True))
# What the 16-bit forward does not serve (nbflash/kernels/forward_mma.py does): packed sequences.
UNSERVED_FEATURES = ("varlen",)


def served(variant):
    """The 16-bit forward serves ``variant``: any combination of the window, softcap, ALiBi, the bias
    and mask tensors, score_mod, mask_mod (with or without a block mask) and dropout (none of
    ``UNSERVED_FEATURES``)."""
    return not any(getattr(variant, feature) for feature in UNSERVED_FEATURES)


FP8 = "float8_e4m3fn"  # the fp8 forward's input dtype (e4m3, as ml_dtypes and PyTorch name it)
# fp8: the key at k position p of each 16 in P's A registers and in V^T's rows (see the docstring):
# position 4 q + 2 c + e holds key 8 c + 2 q + e, the accumulator column thread q holds as value e
# of 8-column group c.
FP8_KEY_ORDER = tuple(8 * ((p % 4) // 2) + 2 * (p // 4) + p % 2 for p in range(16))


@dataclass(frozen=True)
class Sm90ForwardConfig:
    """One compiled variant of the Hopper forward kernel."""

    dtype: str  # 'float16', 'bfloat16' or FP8 ('float8_e4m3fn': run on an H200 through uint8 storage)
    headdim: int  # a multiple of 8, at most 256
    variant: Variant = Variant()
    block_n: int = 128  # keys per K/V tile
    consumers: int = 2  # consumer warpgroups of 64 query rows: block_m = 64 * consumers
    stages: int = 2  # K/V tiles in flight (the ring)
    producer_registers: int = 40  # setmaxnreg caps with two consumers (the register file: 64K)
    consumer_registers: int = 232
    overlap: bool = False  # issue S_j with P_{j-1} V_{j-1}, the softmax under the latter (FlashAttention-3)
    pingpong: bool = False  # the two consumers take turns issuing their products (needs overlap)
    # Longest-first within groups of this many (batch, query head) pairs (0: off): the grid walks
    # the groups one after another and, inside a group, each pair's heaviest query block, then the
    # next; so the last wave holds short blocks (with a window) while the blocks running together
    # still read a few heads' K and V (scripts/dispatch_model.py models the backward's case)
    heavy_groups: int = 0
    # Lazy rescaling (as MmaForwardConfig.rescale_slack): each warp keeps the maxima its P is taken
    # against until some row passes them by more than this many powers of 2 (a vote a tile), so
    # P <= 2**rescale_slack and O is rescaled only then; 0: at every tile. At most 8.
    rescale_slack: float = 0.0
    # Of each row's block_n / 8 groups of 8 keys, this many (spread evenly) take P's exponentials
    # from the FMA pipes (primitives.exp2_fma3 at fp8, exp2_fma4 at 16 bits: 8 instructions a score)
    # instead of MUFU (16 a clock an SM), FlashAttention-4's split; 0: all on MUFU
    exp2_fma_groups: int = 0

    def __post_init__(self):
        if self.dtype not in ("float16", "bfloat16", FP8):
            raise ValueError(f"{self.dtype=} must be 'float16', 'bfloat16' or {FP8!r}")
        if self.dtype == FP8:
            if self.headdim % 16 or self.block_n % 128:
                raise ValueError(f"fp8: {self.headdim=} must be a multiple of 16 and {self.block_n=} of 128 "
                                 "(V^T's swizzled rows)")
        if self.headdim % 8 or not 8 <= self.headdim <= 256:
            raise ValueError(f"{self.headdim=} must be a multiple of 8 in 8..256")
        if not served(self.variant):
            raise ValueError(f"{self.variant=}: the sm90 forward serves no {' and no '.join(UNSERVED_FEATURES)}")
        if self.dtype == FP8 and self.variant not in FP8_VARIANTS:
            raise ValueError(f"{self.variant=}: the fp8 forward serves the plain kernel and the window only")
        if self.block_n % 16 or not 16 <= self.block_n <= 256:
            raise ValueError(f"{self.block_n=} must be a multiple of 16 in 16..256 (a TMA box and a wgmma n)")
        if self.variant.dropout and self.block_n % 32:
            raise ValueError(f"dropout needs {self.block_n=} a multiple of 32 (one Philox call per 32 keys)")
        if self.consumers not in (1, 2):
            raise ValueError(f"{self.consumers=} must be 1 or 2")
        if self.pingpong and not (self.overlap and self.consumers == 2):
            raise ValueError("pingpong=True takes two consumers and overlap=True")
        if self.stages < 2:
            raise ValueError(f"{self.stages=}: the ring needs at least 2 stages")
        if self.heavy_groups < 0:
            raise ValueError(f"heavy_groups={self.heavy_groups} must be 0 (off) or a group size")
        if not 0 <= self.exp2_fma_groups <= self.block_n // 8:
            raise ValueError(f"exp2_fma_groups={self.exp2_fma_groups} must be in 0..{self.block_n // 8} "
                             "(groups of 8 keys of a row)")
        if not 0 <= self.rescale_slack <= 8:
            raise ValueError(f"rescale_slack={self.rescale_slack} must be in [0, 8] (powers of 2 that P may reach)")
        if self.consumers == 2:  # setmaxnreg splits the registers (one consumer keeps the entry cap)
            check_register_split(self.threads, self.producer_registers, self.consumer_registers, self.consumers)

    @property
    def block_m(self):
        return 64 * self.consumers

    @property
    def element_bytes(self):
        return 1 if self.dtype == FP8 else 2

    @property
    def headdim_padded(self):
        """headdim rounded up to whole 128-byte chunks (TMA fills the rest with zeros): 64 columns,
        or 128 of fp8."""
        columns = ROW_BYTES // self.element_bytes
        return -(-self.headdim // columns) * columns

    @property
    def threads(self):
        return GROUP * (self.consumers + 1)

    @property
    def q_bytes(self):
        return self.block_m * self.headdim_padded * self.element_bytes

    @property
    def kv_bytes(self):
        """Bytes of one K (or V, or fp8 V^T) tile."""
        return self.block_n * self.headdim_padded * self.element_bytes

    @property
    def shared_bytes(self):
        """The tiles, the 1 + 3 stages mbarriers, and 1024 bytes of slack to align the tiles."""
        return 1024 + self.q_bytes + 2 * self.stages * self.kv_bytes + 8 * (1 + 3 * self.stages)

    @property
    def dynamic_shared_bytes(self):
        return self.shared_bytes

    @property
    def launch_bounds(self):
        """(threads, blocks per SM): the register cap at entry that setmaxnreg needs."""
        return (self.threads, 1)

    arch_suffix = "a"  # wgmma, TMA and setmaxnreg assemble for sm_90a only

    def grid(self, batch, nheads, seqlen_q):
        tiles = -(-seqlen_q // self.block_m)
        if self.heavy_groups:
            return grouped_grid(tiles, batch * nheads, self.heavy_groups)
        return (tiles, nheads, batch)


def _words(config, q, k, v):
    if config.dtype == FP8:  # v is V^T (batch, nheads_k, headdim, keys / 2 as uint16): headdim rows of 128 keys
        return np.stack([tensor_map_4d_words(q, (1, config.block_m, 1, CHUNK), SWIZZLE_128B),
                         tensor_map_4d_words(k, (1, config.block_n, 1, CHUNK), SWIZZLE_128B),
                         tensor_map_4d_words(v, (1, 1, config.headdim_padded, CHUNK), SWIZZLE_128B)])
    return np.stack([tensor_map_4d_words(x, (1, rows, 1, CHUNK), SWIZZLE_128B)
                     for x, rows in ((q, config.block_m), (k, config.block_n), (v, config.block_n))])


def tensor_maps(config, q, k, v):
    """The kernel's ``maps``: the tensor maps of q, k, v (rows of 16-bit values) as a (3, 16) uint64
    array on the backend, with the boxes the kernel loads (block_m or block_n rows of 64 columns,
    swizzled as wgmma reads them); kept for the last few calls, a broadcast input copied first
    (primitives_sm90.cached_tensor_maps)."""
    key = (config.block_m, config.block_n, config.headdim_padded if config.dtype == FP8 else 0)
    return cached_tensor_maps(key, (q, k, v), lambda *xs: _words(config, *xs))


@lru_cache(maxsize=None)
def build_forward_sm90(config: Sm90ForwardConfig):
    """Compile-time constants of ``config`` captured in a fresh ``@cuda.jit`` kernel."""
    BM, BN, HD, HDP = config.block_m, config.block_n, config.headdim, config.headdim_padded
    CONSUMERS, STAGES, THREADS = config.consumers, config.stages, config.threads
    IS_FP8 = config.dtype == FP8
    ELEMENT_BYTES = config.element_bytes
    CHUNKS = HDP * ELEMENT_BYTES // ROW_BYTES  # 128-byte chunks of a tile's rows
    Q_BYTES, KV_BYTES = config.q_bytes, config.kv_bytes
    Q_CHUNK_BYTES, KV_CHUNK_BYTES = BM * ROW_BYTES, BN * ROW_BYTES
    VT_CHUNKS, VT_CHUNK_BYTES = BN // ROW_BYTES, HDP * ROW_BYTES  # fp8's V^T tile: chunks of 128 keys
    # k steps (k16 of 16-bit operands, k32 of fp8: 32 bytes of a row either way) of S = Q K^T and of O += P V.
    # fp8 stops both products at headdim: S's k steps at the last one holding a column (the zeros TMA
    # fills past headdim add nothing) and O at headdim columns (n a multiple of 16, V^T's first rows).
    # Its chunks are 128 columns, so at headdim 64 this halves the tensor cores' work.
    QK_STEPS = -(-HD // 32) if IS_FP8 else HDP * ELEMENT_BYTES // 32
    PV_STEPS = BN * ELEMENT_BYTES // 32
    HDO = HD if IS_FP8 else HDP  # O's columns
    S_REGS, O_REGS, P_REGS = BN // 2, HDO // 2, 4 * PV_STEPS  # per thread: S and O accumulators, packed P
    NT = BN // 8  # 8-column groups of S
    DT = HDO // 8  # 8-column groups of O
    EMPTY_ARRIVALS = CONSUMERS * GROUP  # every consumer thread releases a slot
    SPLIT_REGISTERS = CONSUMERS == 2  # with one consumer the entry cap already suffices
    PRODUCER_REGS, CONSUMER_REGS = config.producer_registers, config.consumer_registers
    OVERLAP, PINGPONG = config.overlap, config.pingpong
    SLACK = float32(config.rescale_slack)
    FMA_GROUPS = config.exp2_fma_groups
    exp2_fma = exp2_fma3 if IS_FP8 else exp2_fma4  # P rounded to e4m3 or to 16 bits
    TURN_THREADS = 2 * GROUP  # a turn barrier: the waiting consumer and the one handing over
    hooks = variants.hooks(config.variant)
    WINDOW, key_tiles, row_keys, hidden = hooks.WINDOW, hooks.key_tiles, hooks.row_keys, hooks.hidden
    # A block mask's classes: EMPTY tiles are never loaded nor computed, FULL ones skip the mask test
    # (FULL everywhere without one, and then the walk below is j = first_tile + i)
    tile_class, visit_key_tile, visited_key_tiles = hooks.tile_class, hooks.visit_key_tile, hooks.visited_key_tiles
    HEAVY_GROUPS = config.heavy_groups
    head_context = hooks.head_context
    # A score feature (softcap, ALiBi, bias, score_mod): raw S through the tensor-core score point, into
    # units whose positive factor to base 2 replaces the scale in exp2 (the scale is positive here:
    # configs.py).
    SCORE = hooks.SCORE
    DROPOUT, dropout_words = hooks.DROPOUT, hooks.dropout_words
    keep_or_zero, dropout_scale = hooks.keep_or_zero, hooks.dropout_scale
    score_units, score_row, score_at, _ = hooks.tensor_core_score(True)
    NEG_INF = float32(-math.inf)
    IS_F16 = config.dtype == "float16"  # else bfloat16 out (and in, except fp8's e4m3)
    AB = "e4m3" if IS_FP8 else "f16" if IS_F16 else "bf16"
    pack = pack_f16x2 if IS_F16 else pack_bf16x2
    DESCALES = len(variants.param_types(config.variant))  # fp8: params' entry of the descales
    wgmma_qk = make_wgmma_ss(BN, AB, 0)  # S (64 x BN) = Q (64 x HDP, K-major) K^T (K: BN rows, K-major)
    if IS_FP8:  # O (64 x HD) += P (registers) V, from V^T's first HD rows (keys, K-major)
        wgmma_pv = make_wgmma_rs(HDO, AB, 0)
    else:
        wgmma_pv = make_wgmma_rs(HDP, AB, 1)  # O (64 x HDP) += P (registers) V (keys x HDP, MN-major)
    # Descriptor strides (bytes): K-major 128B swizzle, 8-row groups 1024 apart (LBO unused: 16);
    # V MN-major, 8-key groups 1024 apart, 64-column chunks a tile chunk apart.
    K_MAJOR = (16, 1024)
    V_MN_MAJOR = (KV_CHUNK_BYTES, 1024)

    # -----------------------------------------------------------------------------------------------
    # Tile addresses: a k16 step of a K-major tile is 32 bytes inside a 128-byte row, and the next
    # chunk after 4 steps; a k16 step of V (16 keys) is 16 rows of 128 bytes.
    # -----------------------------------------------------------------------------------------------

    @inline_device
    def k_descriptor(k_ring, slot):
        return smem_descriptor(k_ring + uint32(slot * KV_BYTES), K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)

    if IS_FP8:  # V^T is K-major, as K is: a k32 step (32 keys) is 32 bytes of its rows
        @inline_device
        def v_descriptor(v_ring, slot):
            return smem_descriptor(v_ring + uint32(slot * KV_BYTES), K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)
    else:
        @inline_device
        def v_descriptor(v_ring, slot):
            return smem_descriptor(v_ring + uint32(slot * KV_BYTES), V_MN_MAJOR[0], V_MN_MAJOR[1], SWIZZLE_128B)

    # -----------------------------------------------------------------------------------------------
    # Consumer tile operations, on the thread's registers (local arrays indexed by constants)
    # -----------------------------------------------------------------------------------------------

    @inline_device
    @unroll
    def score_scores(s, row0, n_start, seqlen_q, seqlen_k, params, head_ctx, units, q4):
        """S = the variant's score features on raw Q K^T, in the units that units[EXP] turns to base 2
        (variants.Hooks.tensor_core_score): what they read of a row is computed once per row."""
        for rh in static_range(2):
            ctx = score_row(row0 + 8 * rh, n_start + 2 * q4, seqlen_q, seqlen_k, params, head_ctx, units)
            for c in static_range(NT):
                for e in static_range(2):
                    s[4 * c + 2 * rh + e] = score_at(s[4 * c + 2 * rh + e], ctx, 0, 8 * c + e, seqlen_q, seqlen_k,
                                                     params, head_ctx, units)

    # The mask tensor alone: its test without a branch per element (hidden_clamped; with a branch per
    # element, 116 bytes of spills at hd 128, none without). A mask_mod keeps the guarded test: the
    # user's code run on every element unconditionally spilled 604 bytes (with the tests' score_mod).
    if config.variant.mask and not config.variant.mask_mod:
        hidden_clamped = hooks.hidden_clamped

        @inline_device
        @unroll
        def mask_scores(s, row0, n_start, seqlen_q, seqlen_k, params, head_ctx, q4):
            """-inf where the row does not see the key: past the end, outside its window, or masked."""
            for rh in static_range(2):
                row = row0 + 8 * rh
                lo, hi = row_keys(row, seqlen_q, seqlen_k, params)
                for c in static_range(NT):
                    for e in static_range(2):
                        x = s[4 * c + 2 * rh + e]
                        dropped = hidden_clamped(n_start + 8 * c + 2 * q4 + e, lo, hi, row, seqlen_q, seqlen_k, params,
                                                 head_ctx)
                        s[4 * c + 2 * rh + e] = NEG_INF if dropped else x
    else:
        @inline_device
        @unroll
        def mask_scores(s, row0, n_start, seqlen_q, seqlen_k, params, head_ctx, q4):
            """-inf where the row does not see the key: past the end, outside its window, or masked."""
            for rh in static_range(2):
                row = row0 + 8 * rh
                lo, hi = row_keys(row, seqlen_q, seqlen_k, params)
                for c in static_range(NT):
                    for e in static_range(2):
                        if hidden(n_start + 8 * c + 2 * q4 + e, lo, hi, row, seqlen_q, params, head_ctx):
                            s[4 * c + 2 * rh + e] = NEG_INF

    @inline_device
    @unroll
    def row_max(s, m, rh):
        """The larger of ``m`` and the largest score of the thread's row rh of the tile, over the quad."""
        for c in static_range(NT):
            m = max(m, max(s[4 * c + 2 * rh], s[4 * c + 2 * rh + 1]))
        return quad_max(m)

    @inline_device
    @unroll
    def exponentiate_row(s, rh, m_scaled, scale_log2):
        """Row rh of S -> P = exp2(S * scale_log2 - m_scaled) in place; returns the lane's sum of P."""
        row_sum = float32(0)
        for c in static_range(NT):
            for e in static_range(2):
                x = s[4 * c + 2 * rh + e] * scale_log2 - m_scaled
                # exp2_fma_groups of the NT groups, evenly spaced, on the FMA pipes (c is a constant)
                p = exp2_fma(x) if (c * FMA_GROUPS) % NT < FMA_GROUPS else exp2_approx(x)
                s[4 * c + 2 * rh + e] = p
                row_sum += p
        return row_sum

    @inline_device
    @unroll
    def online_softmax(s, m_i, l_i, alpha, scale_log2):
        """S -> P = exp2(S * scale_log2 - m_new * scale_log2) in place; l_i rescaled by, and ``alpha``
        set to, exp2((m_i - m_new) * scale_log2), for the O accumulator (rescale_o). l_i stays a
        per-lane partial sum."""
        for rh in static_range(2):
            m_prev = m_i[rh]
            m_new = row_max(s, m_prev, rh)
            # A row that has seen only masked keys keeps m = -inf; subtract 0 then, not -inf.
            m_scaled = m_new * scale_log2 if m_new != NEG_INF else float32(0)
            alpha[rh] = exp2_approx(m_prev * scale_log2 - m_scaled)
            row_sum = exponentiate_row(s, rh, m_scaled, scale_log2)
            l_i[rh] = l_i[rh] * alpha[rh] + row_sum
            m_i[rh] = m_new

    @inline_device
    @unroll
    def lazy_online_softmax(s, m_i, l_i, alpha, scale_log2):
        """online_softmax with lazy rescaling (``rescale_slack``): the warp's maxima stay where they
        are, and alpha is exactly 1, unless some row of the warp passes its m_i by more than the
        slack (one vote); then every row moves to its new max."""
        tile_max = cuda.local.array(2, float32)
        stay = uint32(1)
        for rh in static_range(2):
            m_new = row_max(s, m_i[rh], rh)
            tile_max[rh] = m_new
            # False for a row with no key yet and none here (-inf and -inf), and for NaN
            if m_new * scale_log2 > m_i[rh] * scale_log2 + SLACK:
                stay = uint32(0)
        stay = warp_all(stay)
        for rh in static_range(2):
            alpha[rh] = float32(1)
            if not stay:  # warp-uniform
                m_new = tile_max[rh]
                # A row that has seen only masked keys keeps m = -inf; alpha is then 0 or 1
                m_scaled = m_new * scale_log2 if m_new != NEG_INF else float32(0)
                alpha[rh] = exp2_approx(m_i[rh] * scale_log2 - m_scaled)
                l_i[rh] *= alpha[rh]
                m_i[rh] = m_new
            m_scaled = m_i[rh] * scale_log2 if m_i[rh] != NEG_INF else float32(0)
            l_i[rh] += exponentiate_row(s, rh, m_scaled, scale_log2)

    @inline_device
    @unroll
    def drop_p(s, row0, n_start, params, head_ctx, q4):
        """The probability point: P or 0 by its dropout bit, element by element, after online_softmax
        has summed the undropped P into l_i and before pack_p (each P's last use); the kept scale
        waits for write_output."""
        for c4 in static_range(NT // 4):  # rows row0, row0 + 8 by keys 2 q4, 2 q4 + 1 of four 8-key groups
            w = dropout_words(row0, n_start + 32 * c4 + 2 * q4, params, head_ctx)  # one call
            for j in static_range(4):
                for i in static_range(4):
                    s[16 * c4 + 4 * j + i] = keep_or_zero(s[16 * c4 + 4 * j + i], w[j], i, params)

    @inline_device
    @unroll
    def rescale_o(o, alpha):
        for rh in static_range(2):
            for c in static_range(DT):
                o[4 * c + 2 * rh] *= alpha[rh]
                o[4 * c + 2 * rh + 1] *= alpha[rh]

    rescale_every_row = rescale_o

    @inline_device
    @unroll
    def lazy_rescale_o(o, alpha):
        """rescale_o where the warp's maxima moved: lazy_online_softmax leaves alpha exactly 1 in every
        row of a warp that stayed, and below 1 in some row of one that moved (past the slack), so
        this vote gives its answer again, warp-uniform."""
        if not warp_all(uint32(alpha[0] == float32(1) and alpha[1] == float32(1))):
            rescale_every_row(o, alpha)

    if SLACK > 0:  # the consumer loops call whichever pair is chosen
        online_softmax, rescale_o = lazy_online_softmax, lazy_rescale_o  # noqa: F811

    @inline_device
    @unroll
    def issue_qk(acc_s, desc_q, desc_k):
        """S = Q_i K_j^T, issued as one commit group (asynchronous: valid after its wgmma_wait)."""
        for kk in static_range(QK_STEPS):
            acc_s = wgmma_qk(acc_s, desc_q + k_step(Q_CHUNK_BYTES, kk), desc_k + k_step(KV_CHUNK_BYTES, kk),
                             uint32(0 if kk == 0 else 1))
        wgmma_commit()
        return acc_s

    if IS_FP8:
        @inline_device
        @unroll
        def issue_pv(acc_o, p_regs, desc_v):
            """O += P V_j from V^T (K-major: k32 steps as K's), one commit group."""
            for ks in static_range(PV_STEPS):
                acc_o = wgmma_pv(acc_o, p_regs[4 * ks], p_regs[4 * ks + 1], p_regs[4 * ks + 2], p_regs[4 * ks + 3],
                                 desc_v + k_step(VT_CHUNK_BYTES, ks), uint32(1))
            wgmma_commit()
            return acc_o

        @inline_device
        @unroll
        def pack_p(s, p):
            """P's e4m3 A registers: k32 slice ks is S's registers 16 ks .. 16 ks + 15; register j of it
            packs the row's (j % 2) pair of 8-column groups 2 (j // 2) and 2 (j // 2) + 1, which puts
            the keys in FP8_KEY_ORDER, as V^T has them."""
            for ks in static_range(PV_STEPS):
                for j in static_range(4):
                    r0 = 16 * ks + 8 * (j // 2) + 2 * (j % 2)
                    p[4 * ks + j] = pack_e4m3x4(s[r0], s[r0 + 1], s[r0 + 4], s[r0 + 5])

        @inline_device
        def fp8_scales(params, b, hk, scale_log2):
            """The exp2 scale with q's and k's descales folded in, and v's descale (for O)."""
            descale = params[DESCALES]
            return scale_log2 * descale[0, b, hk] * descale[1, b, hk], descale[2, b, hk]

        @inline_device
        @unroll
        def scale_o(o, factor):
            for r in static_range(O_REGS):
                o[r] *= factor
    else:
        @inline_device
        @unroll
        def issue_pv(acc_o, p_regs, desc_v):
            """O += P V_j, P from registers (k16 step ks: P's registers 4 ks .. 4 ks + 3), one commit group."""
            for ks in static_range(PV_STEPS):
                acc_o = wgmma_pv(acc_o, p_regs[4 * ks], p_regs[4 * ks + 1], p_regs[4 * ks + 2], p_regs[4 * ks + 3],
                                 desc_v + uint64(ks * 16 * ROW_BYTES >> 4), uint32(1))
            wgmma_commit()
            return acc_o

        @inline_device
        @unroll
        def pack_p(s, p):
            """P's A registers: k16 slice ks is S's registers 8 ks .. 8 ks + 7, packed in pairs."""
            for i in static_range(P_REGS):
                p[i] = pack(s[2 * i], s[2 * i + 1])

        fp8_scales = scale_o = None  # the kernel's fp8 branches are compiled out

    @inline_device
    @unroll
    def write_output(out, lse, o, m_i, l_i, b, h, row0, seqlen_q, scale_log2, lse_offset, params, q4):
        """O_i = acc / l_i and lse_i, for rows inside the sequence; 0 and -inf for rows with no key.
        ``lse_offset``: what a score feature's units leave out of the base-2 scores."""
        for rh in static_range(2):
            l_row = quad_sum(l_i[rh])  # every lane of the warp takes part in the shuffle
            row = row0 + 8 * rh
            # l = 0: a row without keys (out 0, lse -inf); a NaN l (a NaN in q) stays NaN in both
            inv_l = float32(1) / l_row if l_row != float32(0) else float32(0)
            if DROPOUT:  # the kept probabilities' scale, left out of P V (drop_p)
                inv_l *= dropout_scale(params)
            if row < seqlen_q:
                for c in static_range(DT):
                    # the thread's two neighbouring columns: one 32-bit store (out is a fresh contiguous
                    # array, headdim a multiple of 8), packed as P is (to nearest even, the first low)
                    col = 8 * c + 2 * q4
                    if col < HD:
                        r = 4 * c + 2 * rh
                        store_u32(global_address(out, b, row, h, col), pack(o[r] * inv_l, o[r + 1] * inv_l))
                if q4 == 0:
                    if l_row != float32(0):
                        lse_log2 = m_i[rh] * scale_log2 + math.log2(l_row)
                        if SCORE:
                            lse_log2 += lse_offset
                        lse[b, h, row] = lse_log2 * float32(LN2)
                    else:
                        lse[b, h, row] = NEG_INF

    # -----------------------------------------------------------------------------------------------
    # The kernel
    # -----------------------------------------------------------------------------------------------

    @launch_bounded(THREADS, 1)
    @unroll
    def forward_sm90(q, k, v, out, lse, maps, scale_log2, params):
        m_block, h, b, m_blocks = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z, cuda.gridDim.x
        if HEAVY_GROUPS:  # (batch, head) pairs in groups, query block by query block (geometry.py)
            m_block, h, b, m_blocks = grouped_query_block(cuda.blockIdx.x, cuda.blockIdx.y, cuda.gridDim.x,
                                                          HEAVY_GROUPS, q.shape[2])
            if b >= q.shape[0]:
                return  # a partial last group's missing pairs: the whole block, before any barrier
        if WINDOW:  # the last query blocks see the most keys (causal): start them first
            m_block = m_blocks - 1 - m_block
        tid = cuda.threadIdx.x
        group = warpgroup_index(tid)  # 0: the producer; 1 + c: consumer c
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        hk = h // (q.shape[2] // k.shape[2])  # GQA: the key/value head this query head reads
        m_start = m_block * BM

        # Shared memory: tiles from the first 1024-byte boundary (tile_base), then the barriers.
        smem = cuda.shared.array(0, uint32)
        base = tile_base(shared_address(smem))
        q_tile = base
        k_ring = base + uint32(Q_BYTES)
        v_ring = k_ring + uint32(STAGES * KV_BYTES)
        q_full = v_ring + uint32(STAGES * KV_BYTES)
        k_full = q_full + uint32(8)  # + 8 * slot
        v_full = k_full + uint32(8 * STAGES)
        kv_empty = v_full + uint32(8 * STAGES)

        # ---- Which key tiles this block visits (geometry.py): tiles [first_tile, end_tile), of
        # which [first_full, end_full) every row sees whole and the others are masked ----
        first_tile, first_full, end_full, end_tile = key_tiles(
            m_start, min(m_start + BM, seqlen_q), seqlen_q, seqlen_k, params, BN)
        # ... of which a block mask's EMPTY ones are passed over: the i-th tile visited is j, which
        # the producer and the consumers walk alike (visit_key_tile)
        n_tiles = visited_key_tiles(params, b, h, m_block, first_tile, end_tile)

        if tid == 0:
            mbarrier_init(q_full, 1)
            for slot in range(STAGES):
                mbarrier_init(k_full + uint32(8 * slot), 1)
                mbarrier_init(v_full + uint32(8 * slot), 1)
                mbarrier_init(kv_empty + uint32(8 * slot), EMPTY_ARRIVALS)
            fence_mbarrier_init()
        cuda.syncthreads()  # the barriers are initialised before anyone arrives on or waits for them

        if group == 0:
            # ---- Producer: one thread issues every copy; the ring's empty barriers pace it ----
            if SPLIT_REGISTERS:
                setmaxnreg_dec(PRODUCER_REGS)
            if tid < 32:
                if elect_sync() == uint32(1):
                    maps_address = array_address(maps)
                    q_map, k_map, v_map = maps_address, maps_address + 128, maps_address + 256
                    fence_proxy_tensormap_acquire(q_map)  # the maps were copied from the host
                    fence_proxy_tensormap_acquire(k_map)
                    fence_proxy_tensormap_acquire(v_map)
                    mbarrier_arrive_expect_tx(q_full, Q_BYTES)
                    for chunk in static_range(CHUNKS):
                        tma_load_4d(q_tile + uint32(chunk * Q_CHUNK_BYTES), q_map, chunk * CHUNK, h, m_start, b,
                                    q_full)
                    j = first_tile - 1
                    for i in range(n_tiles):
                        j = visit_key_tile(params, b, h, m_block, first_tile, i, j, end_tile)
                        slot, use = i % STAGES, i // STAGES
                        if use > 0:  # the consumers have released the slot's previous tile
                            mbarrier_wait(kv_empty + uint32(8 * slot), (use - 1) & 1)
                        n_start = j * BN
                        k_tile = k_ring + uint32(slot * KV_BYTES)
                        v_tile = v_ring + uint32(slot * KV_BYTES)
                        mbarrier_arrive_expect_tx(k_full + uint32(8 * slot), KV_BYTES)
                        for chunk in static_range(CHUNKS):
                            tma_load_4d(k_tile + uint32(chunk * KV_CHUNK_BYTES), k_map, chunk * CHUNK, hk, n_start,
                                        b, k_full + uint32(8 * slot))
                        mbarrier_arrive_expect_tx(v_full + uint32(8 * slot), KV_BYTES)
                        if IS_FP8:  # V^T: headdim rows of 128 keys a chunk (keys / 2 in uint16 columns)
                            for chunk in static_range(VT_CHUNKS):
                                tma_load_4d(v_tile + uint32(chunk * VT_CHUNK_BYTES), v_map,
                                            n_start // 2 + chunk * CHUNK, 0, hk, b, v_full + uint32(8 * slot))
                        else:
                            for chunk in static_range(CHUNKS):
                                tma_load_4d(v_tile + uint32(chunk * KV_CHUNK_BYTES), v_map, chunk * CHUNK, hk,
                                            n_start, b, v_full + uint32(8 * slot))
        else:
            # ---- Consumers: 64 query rows each ----
            if SPLIT_REGISTERS:
                setmaxnreg_inc(CONSUMER_REGS)
            consumer = group - 1
            lane = tid % 32
            q4 = lane & 3
            row0 = m_start + 64 * consumer + 16 * ((tid % GROUP) // 32) + (lane >> 2)  # +8: the second row
            head_ctx = head_context(params, b, h)
            if IS_FP8:  # S and O in the inputs' true units
                scale_log2, v_scale = fp8_scales(params, b, hk, scale_log2)
            lse_offset = float32(0)
            if SCORE:  # the features' constants for this head; exp2's factor becomes that of their units
                units = score_units(params, scale_log2 * float32(LN2), head_ctx)
                scale_log2, lse_offset = units[variants.EXP], units[variants.OFFSET]
            desc_q = smem_descriptor(q_tile + uint32(64 * consumer * ROW_BYTES), K_MAJOR[0], K_MAJOR[1], SWIZZLE_128B)

            s = cuda.local.array(S_REGS, float32)
            o = cuda.local.array(O_REGS, float32)
            p = cuda.local.array(P_REGS, uint32)
            m_i = cuda.local.array(2, float32)
            l_i = cuda.local.array(2, float32)
            alpha = cuda.local.array(2, float32)
            for r in static_range(S_REGS):
                s[r] = float32(0)
            for r in static_range(O_REGS):
                o[r] = float32(0)
            for rh in static_range(2):
                m_i[rh] = NEG_INF
                l_i[rh] = float32(0)

            mbarrier_wait(q_full, 0)
            j = first_tile - 1  # the key tile visited before the first
            if not OVERLAP:
                for i in range(n_tiles):
                    j = visit_key_tile(params, b, h, m_block, first_tile, i, j, end_tile)
                    slot, use = i % STAGES, i // STAGES

                    # S = Q_i K_j^T
                    acc_s = fence_operands(registers_from(s, S_REGS))
                    mbarrier_wait(k_full + uint32(8 * slot), use & 1)
                    wgmma_fence()  # the accumulator's registers are ordered before wgmma uses them
                    acc_s = issue_qk(acc_s, desc_q, k_descriptor(k_ring, slot))
                    wgmma_wait(0)
                    registers_to(s, fence_operands(acc_s))
                    if SCORE:
                        score_scores(s, row0, j * BN, seqlen_q, seqlen_k, params, head_ctx, units, q4)

                    # Mask the tiles that some row of the block does not see whole
                    if j < first_full or j >= end_full or tile_class(params, b, h, m_block, j) != variants.FULL:
                        mask_scores(s, row0, j * BN, seqlen_q, seqlen_k, params, head_ctx, q4)

                    # m_i, l_i, O rescaled; S becomes P, packed to 16 bits
                    online_softmax(s, m_i, l_i, alpha, scale_log2)
                    rescale_o(o, alpha)
                    if DROPOUT:
                        drop_p(s, row0, j * BN, params, head_ctx, q4)
                    pack_p(s, p)

                    # O += P V_j
                    p_regs = fence_operands(registers_from(p, P_REGS))
                    acc_o = fence_operands(registers_from(o, O_REGS))
                    mbarrier_wait(v_full + uint32(8 * slot), use & 1)
                    wgmma_fence()  # P's and the rescaled accumulator's registers are ordered before wgmma
                    acc_o = issue_pv(acc_o, p_regs, v_descriptor(v_ring, slot))
                    wgmma_wait(0)
                    registers_to(o, fence_operands(acc_o))
                    mbarrier_arrive(kv_empty + uint32(8 * slot))  # this thread is done with the slot's K and V
            elif n_tiles > 0:
                if PINGPONG and consumer == 1:
                    named_barrier_arrive(1, TURN_THREADS)  # consumer 0 takes the first turn
                # Overlapped (FlashAttention-3's intra-warpgroup pipelining): S_j = Q K_j^T is issued
                # together with O += P_{j-1} V_{j-1}; the softmax of S_j runs while the P V product is
                # still in flight, and O is rescaled by alpha_j once it has landed.
                j = visit_key_tile(params, b, h, m_block, first_tile, 0, j, end_tile)
                acc_s = fence_operands(registers_from(s, S_REGS))
                mbarrier_wait(k_full, 0)
                wgmma_fence()  # the accumulator's registers are ordered before wgmma uses them
                acc_s = issue_qk(acc_s, desc_q, k_descriptor(k_ring, 0))
                wgmma_wait(0)
                registers_to(s, fence_operands(acc_s))
                if SCORE:
                    score_scores(s, row0, j * BN, seqlen_q, seqlen_k, params, head_ctx, units, q4)
                if j < first_full or j >= end_full or tile_class(params, b, h, m_block, j) != variants.FULL:
                    mask_scores(s, row0, j * BN, seqlen_q, seqlen_k, params, head_ctx, q4)
                online_softmax(s, m_i, l_i, alpha, scale_log2)  # O is still 0: nothing to rescale
                if DROPOUT:
                    drop_p(s, row0, j * BN, params, head_ctx, q4)
                pack_p(s, p)
                for i in range(1, n_tiles):
                    j = visit_key_tile(params, b, h, m_block, first_tile, i, j, end_tile)
                    slot, use = i % STAGES, i // STAGES
                    prev_slot, prev_use = (i - 1) % STAGES, (i - 1) // STAGES
                    acc_s = fence_operands(registers_from(s, S_REGS))
                    p_regs = fence_operands(registers_from(p, P_REGS))
                    acc_o = fence_operands(registers_from(o, O_REGS))
                    mbarrier_wait(k_full + uint32(8 * slot), use & 1)
                    mbarrier_wait(v_full + uint32(8 * prev_slot), prev_use & 1)
                    if PINGPONG:  # wait for this consumer's turn at the tensor cores
                        named_barrier_sync(1 + consumer, TURN_THREADS)
                    wgmma_fence()  # both accumulators' and P's registers are ordered before wgmma
                    acc_s = issue_qk(acc_s, desc_q, k_descriptor(k_ring, slot))
                    acc_o = issue_pv(acc_o, p_regs, v_descriptor(v_ring, prev_slot))
                    if PINGPONG:  # the other consumer's turn: its products run under this one's softmax
                        named_barrier_arrive(2 - consumer, TURN_THREADS)
                    wgmma_wait(1)  # S_j has landed; P_{j-1} V_{j-1} may still run
                    registers_to(s, fence_operands(acc_s))
                    if SCORE:
                        score_scores(s, row0, j * BN, seqlen_q, seqlen_k, params, head_ctx, units, q4)
                    if j < first_full or j >= end_full or tile_class(params, b, h, m_block, j) != variants.FULL:
                        mask_scores(s, row0, j * BN, seqlen_q, seqlen_k, params, head_ctx, q4)
                    online_softmax(s, m_i, l_i, alpha, scale_log2)
                    registers_to(s, fence_operands(registers_from(s, S_REGS)))  # P done before the wait
                    wgmma_wait(0)
                    registers_to(o, fence_operands(acc_o))
                    mbarrier_arrive(kv_empty + uint32(8 * prev_slot))  # done with tile j - 1's K and V
                    rescale_o(o, alpha)
                    if DROPOUT:
                        drop_p(s, row0, j * BN, params, head_ctx, q4)
                    pack_p(s, p)
                last = (n_tiles - 1) % STAGES
                p_regs = fence_operands(registers_from(p, P_REGS))
                acc_o = fence_operands(registers_from(o, O_REGS))
                mbarrier_wait(v_full + uint32(8 * last), ((n_tiles - 1) // STAGES) & 1)
                wgmma_fence()  # P's and the accumulator's registers are ordered before wgmma
                acc_o = issue_pv(acc_o, p_regs, v_descriptor(v_ring, last))
                wgmma_wait(0)
                registers_to(o, fence_operands(acc_o))
                mbarrier_arrive(kv_empty + uint32(8 * last))
                if PINGPONG and consumer == 0:
                    named_barrier_sync(1, TURN_THREADS)  # consumer 1's last hand-over, so none is left over

            # ---- Epilogue: normalise and write O_i and lse_i ----
            if IS_FP8:
                scale_o(o, v_scale)
            write_output(out, lse, o, m_i, l_i, b, h, row0, seqlen_q, scale_log2, lse_offset, params, q4)

    return forward_sm90
