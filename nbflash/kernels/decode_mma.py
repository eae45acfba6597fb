"""Decoding on tensor cores: a few query tokens against a long KV cache (Flash-Decoding).

A decode step reads every cached key and value once and does little arithmetic with them: the
kernel is bound by memory bandwidth, so its whole design is about keeping many bytes in flight and
reading each K/V row exactly once:

    for each (sequence b, key/value head hk, block of packed query rows, split s):   (one thread block)
        rows = the (query token, query head) pairs that read head hk, packed 16 to an mma row tile
        keys = the split's share of the key tiles that these rows see
        every warp: m_w = -inf, l_w = 0, acc_w = 0
        for each tile of block_n keys (cp.async ring of `stages` tiles in shared memory):
            warp w takes keys [w * block_n / num_warps, (w + 1) * block_n / num_warps) of the tile,
            which it copied itself `stages` tiles earlier:
            S = Q K^T, mask, online softmax into (m_w, l_w, acc_w), acc_w += P V    (mma.sync)
            and refills its share of the slot with the tile `stages` ahead
        merge the warps' (m_w, l_w, acc_w) through shared memory
        one split:  out = acc / l and lse
        several:    the split's normalized partial output and lse; the block that finishes its
                    rows' last split merges them all by their log-sum-exps (no second launch)

Packing the query heads of a group (GQA) and the query tokens into the rows of one tile means each
K/V tile is read once per key/value head, not once per query head. Splitting the keys (``splits``,
grid z) fills the GPU when batch x heads alone would not (batch 1, a 128k context); the warps of a
block split each tile among themselves, so every warp has keys to work on even when the rows fill
a single 16-row tile. A warp copies and reads only its own share, so the warps need no block
barrier in the loop, and a slot is refilled the moment its warp is done with it: all `stages`
tiles are in flight while a warp waits, which is what bounds a memory-bound kernel (bytes in
flight over the memory latency).

Cache layouts (``MmaDecodeConfig.paged``):
  contiguous  k_cache[cache_row, position, hk, :], cache_row = cache_batch_idx[b] (or b)
  paged       k_cache[block_table[b, position // page_size], position % page_size, hk, :]
Sequence b's keys are the cache positions [leftpad_b, cache_len_b + seqlen_new); key j of the
attention is position leftpad_b + j, and the variant's window, causal mask and ALiBi see seqlen_k =
cache_len_b + seqlen_new - leftpad_b (flash-attn's convention). A position past the cache's capacity,
or a page index outside the cache, is never read (zero-filled and masked): a wrong length or block
table cannot make the kernel read outside the cache.

Rotary embedding (``rotary``): the Q tile is rotated in shared memory after it lands, at position
cache_len_b + token (``options & ROTARY_PER_TOKEN``, causal or local attention) or cache_len_b;
the new keys were rotated by the append kernel (nbflash/kernels/kvcache.py) before they were stored,
or, with ``append``, by this kernel: each block first writes the new tokens whose keys are in its
split (rotated, with kvcache.py's append_rows), then copies its tiles as always.

The fragment layout and the online softmax are the tensor-core forward's (forward_mma.py); what
differs is who owns what: there a warp owns rows and walks every key, here every warp holds all the
rows and a quarter of each key tile.
"""

import math
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda, float32, int32, int64, uint16, uint32
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
    load_f32_cg,
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
    warp_sync,
)

from . import variants
from .kvcache import make_append_rows
from .tiles import element_io

LN2 = math.log(2.0)
LOG2E = math.log2(math.e)

# Bits of the kernel's ``options`` argument.
HAS_BATCH_IDX = 1  # cache_batch_idx maps sequence b to its cache row (contiguous caches)
HAS_LEFTPAD = 2  # cache_leftpad gives each sequence's first cached position
ROTARY_PER_TOKEN = 4  # query token i sits at position cache_len + i (causal or local attention)

MAX_SPLITS = 128  # the most splits of the keys: the merge holds a weight per (row, split) in shared memory
MERGE_LOADS = 16  # the split merge's loads in flight per thread (the splits of batch 1 / 128k, hd 128)


@dataclass(frozen=True)
class MmaDecodeConfig:
    """One compiled variant of the decode kernel."""

    dtype: str  # 'float16' or 'bfloat16'
    headdim: int  # a multiple of 8, up to 256 (rows are copied 16 bytes at a time)
    variant: Variant = Variant()  # window, softcap, ALiBi
    paged: bool = False  # k_cache/v_cache are pages addressed through block_table
    # Paged, with pages a multiple of a warp's share of keys and no leftpad: a warp's share of a
    # tile lies in one page, so a lane looks its page up once per tile and steps its rows by the
    # row stride (as contiguous caches), instead of once per row it copies.
    page_aligned: bool = False
    rotary: bool = False  # rotate the query tile (rotary_cos / rotary_sin)
    rotary_interleaved: bool = True  # pairs (2d, 2d + 1) (GPT-J) or (d, d + rotary_dim / 2) (NeoX)
    m_tiles: int = 1  # 16-row tiles of packed (token, head) rows per block
    block_n: int = 64  # keys per pipeline stage, shared among the warps
    num_warps: int = 4
    stages: int = 3  # K/V tiles in flight in the cp.async ring
    fold_scale: bool = True  # the scale is positive: fold it into exp2 (not with a score feature)
    # The append fused: each block writes the new tokens' k (rotated with rotary) and v that fall in
    # its split's keys into the cache before it copies them (k_new, v_new; kernels/kvcache.py's
    # append_rows), so a decode step with new tokens is one launch. Every new key must be in some
    # block's keys: the planner fuses only where every query row's window is unbounded on the left.
    append: bool = False

    def __post_init__(self):
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"{self.dtype=} must be 'float16' or 'bfloat16'")
        if not 8 <= self.headdim <= 256 or self.headdim % 8:
            raise ValueError(f"{self.headdim=} must be a multiple of 8 in 8..256")
        if self.block_n % (16 * self.num_warps):
            raise ValueError(f"{self.block_n=} must be a multiple of 16 * {self.num_warps=}")
        if self.stages < 2:
            raise ValueError(f"{self.stages=} must be at least 2")
        if self.page_aligned and not self.paged:
            raise ValueError("page_aligned needs paged=True")

    @property
    def headdim_padded(self):
        return -(-self.headdim // 16) * 16

    @property
    def row_elems(self):
        """Elements per shared-memory row: padded headdim plus 16 bytes against bank conflicts."""
        return self.headdim_padded + 8

    @property
    def q_rows(self):
        return 16 * self.m_tiles

    @property
    def threads(self):
        return 32 * self.num_warps

    @property
    def q_in_registers(self):
        return self.m_tiles * self.headdim_padded <= 128

    @property
    def ring_bytes(self):
        return self.stages * 2 * self.block_n * self.row_elems * 2

    @property
    def merge_bytes(self):
        """The warps' accumulators, maxima and sums, float32, where the ring was."""
        rows = self.q_rows
        return 4 * (self.num_warps * rows * self.headdim_padded + 2 * self.num_warps * rows + 2 * rows)

    @property
    def combine_bytes(self):
        """The splits' merge: a weight per (row, split), each row's max and sum, and the ticket."""
        return 4 * (self.q_rows * MAX_SPLITS + 2 * self.q_rows + 1)

    @property
    def dynamic_shared_bytes(self):
        return self.q_rows * self.row_elems * 2 + max(self.ring_bytes, self.merge_bytes, self.combine_bytes)

    def grid(self, batch, nheads_k, row_blocks, splits):
        return (batch * nheads_k, row_blocks, splits)


@lru_cache(maxsize=None)
def build_decode_mma(config: MmaDecodeConfig):
    """Compile-time constants of ``config`` captured in a fresh ``@cuda.jit`` kernel."""
    BN, HD, HDP, ROW = config.block_n, config.headdim, config.headdim_padded, config.row_elems
    WARPS, THREADS, STAGES = config.num_warps, config.threads, config.stages
    MT, Q_ROWS = config.m_tiles, config.q_rows
    KW = BN // WARPS  # keys of a tile each warp takes
    KT = HDP // 16  # k-steps of S = Q K^T
    NT = KW // 8  # 8-key column tiles of S
    PT = KW // 16  # k-steps of O += P V
    DT = HDP // 8  # 8-column tiles of O
    Q_IN_REGISTERS, PAGED, PAGE_ALIGNED = config.q_in_registers, config.paged, config.page_aligned
    ROTARY, INTERLEAVED = config.rotary, config.rotary_interleaved
    hooks = variants.hooks(config.variant)
    key_tiles, row_keys, hidden = hooks.key_tiles, hooks.row_keys, hooks.hidden
    SCORE, score, head_context = hooks.SCORE, hooks.score, hooks.head_context
    FOLD_SCALE = config.fold_scale and not SCORE
    ROW_BYTES = ROW * 2
    Q_BYTES = Q_ROWS * ROW_BYTES
    TILE_BYTES = BN * ROW_BYTES  # one K (or V) tile of the ring
    CHUNKS = HDP // 8  # 16-byte chunks per row
    Q_COPIES = -(-Q_ROWS * CHUNKS // THREADS)
    CHUNK_SLOTS = 1 << (CHUNKS - 1).bit_length()  # lanes per row in the K/V copies: a power of two
    ROWS_PER_ROUND = 32 // CHUNK_SLOTS  # rows of the warp's share one round of its copies covers
    KV_COPIES = -(-KW // ROWS_PER_ROUND)
    # The merge's float32 arrays, in 4-byte words from the start of shared memory (after Q).
    MERGE_ACC = Q_BYTES // 4  # [warp][row][col]
    MERGE_MAX = MERGE_ACC + WARPS * Q_ROWS * HDP  # [warp][row], log2 units
    MERGE_SUM = MERGE_MAX + WARPS * Q_ROWS  # [warp][row]
    BLOCK_MAX = MERGE_SUM + WARPS * Q_ROWS  # [row]: the block's max and sum
    BLOCK_SUM = BLOCK_MAX + Q_ROWS
    # The splits' merge (merge_splits), over the same memory once the rows are written.
    SPLIT_WEIGHT = Q_BYTES // 4  # [row][split]: lse_s, then exp(lse_s - lse_max) / total
    SPLIT_MAX = SPLIT_WEIGHT + Q_ROWS * MAX_SPLITS  # [row]
    SPLIT_SUM = SPLIT_MAX + Q_ROWS  # [row]
    TICKET = SPLIT_SUM + Q_ROWS  # the block's place among its rows' splits, as a float32
    NEG_INF = float32(-math.inf)
    # cp.async.wait_group takes its count as a compile-time constant: groups that may stay in flight
    # (the prologue waits for Q only; the loop for tile j, with the next stages - 1 still coming).
    WAIT_FOR_Q = STAGES
    WAIT_FOR_TILE = STAGES - 1

    if config.dtype == "float16":
        ELEM, mma, pack = float16, mma_f16, pack_f16x2
    else:
        ELEM, mma, pack = uint16, mma_bf16, pack_bf16x2
    IS_F16 = config.dtype == "float16"
    load_elem, store_elem = element_io(config.dtype)
    APPEND = config.append
    append_rows = make_append_rows(config.dtype, PAGED, ROTARY, INTERLEAVED)

    # -----------------------------------------------------------------------------------------------
    # Loads into shared memory
    # -----------------------------------------------------------------------------------------------

    @inline_device
    @unroll
    def load_q_tile(base, q, b, hk, group, row0, rows_total):
        """The block's packed rows of q: row r is query token (row0 + r) // group of query head
        hk * group + (row0 + r) % group; rows past the last are zero."""
        tid = cuda.threadIdx.x
        fallback = global_address(q, 0, 0, 0, 0)
        for i in static_range(Q_COPIES):
            chunk = i * THREADS + tid
            if chunk < Q_ROWS * CHUNKS:
                r = chunk // CHUNKS
                col = (chunk % CHUNKS) * 8
                packed = row0 + r
                inside = packed < rows_total and col < HD
                src = fallback
                if inside:
                    src = global_address(q, b, packed // group, hk * group + packed % group, col)
                cp_async_16_from(base + uint32(r * ROW_BYTES + col * 2), src, uint32(16 if inside else 0))

    @inline_device
    @unroll
    def lookup_pages(pages, offsets, k_cache, block_table, b, start, seqlen_k, n_start):
        """Paged caches: the page and the row in it of each key this lane copies for its warp's
        share of a tile, keys n_start .. n_start + KW - 1 (page -1: past seqlen_k). Called one tile
        ahead of the copies, so the block table's latency hides behind a tile of work instead of
        stalling them. The lane's keys are ROWS_PER_ROUND apart: one division (the page size is a
        runtime value) for the first, then the row steps on and carries into the next page."""
        page_size = uint32(k_cache.shape[1])
        b = uint32(b)  # unsigned: a signed index is wrapped as Python's at every lookup
        r0 = (cuda.threadIdx.x % 32) // CHUNK_SLOTS
        position = uint32(start + n_start + r0)
        index = position // page_size  # the sequence's page holding the lane's first key ...
        row = position - index * page_size  # ... and the key's row in it
        if PAGE_ALIGNED:  # the warp's whole share is in this page (config.page_aligned): one lookup
            page = int32(-1)
            if n_start < seqlen_k:
                page = block_table[b, index]
            pages[0] = page
            offsets[0] = int32(row)
            return
        for i in static_range(KV_COPIES):
            r = r0 + i * ROWS_PER_ROUND
            page = int32(-1)
            if n_start + r < seqlen_k and r < KW:  # not checked against the cache here: that would wait for the load
                page = block_table[b, index]
            pages[i] = page
            offsets[i] = int32(row)
            row += uint32(ROWS_PER_ROUND)
            while row >= page_size:  # pages shorter than a round carry more than once
                row -= page_size
                index += uint32(1)

    @inline_device
    @unroll
    def load_kv_tile(base, k_cache, v_cache, pages, offsets, k_thread, v_thread, seqlen_k, n_start, stage):
        """The warp's share of a tile: keys n_start .. n_start + KW - 1 of the sequence (cache
        positions start + j) into its rows of ring slot ``stage``; keys past seqlen_k and pages
        outside the cache are zero-filled. Lane ``lane`` copies the 16-byte chunk ``lane %
        CHUNK_SLOTS`` of rows lane // CHUNK_SLOTS + i * ROWS_PER_ROUND: consecutive lanes along a
        row (slots past the row's CHUNKS copy nothing). Contiguous caches: k_thread / v_thread are
        the addresses of the lane's chunk in key 0, so a copy costs a multiply-add; paged: in row 0
        of page 0, and a copy adds its row's page and row in it (lookup_pages) times their strides."""
        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        r0, col = lane // CHUNK_SLOTS, (lane % CHUNK_SLOTS) * 8
        k_dst = base + uint32(Q_BYTES + stage * 2 * TILE_BYTES + (warp * KW + r0) * ROW_BYTES + col * 2)
        v_dst = k_dst + uint32(TILE_BYTES)
        k_fallback = global_address(k_cache, 0, 0, 0, 0)
        v_fallback = global_address(v_cache, 0, 0, 0, 0)
        if not PAGED:
            for i in range(KV_COPIES):
                r = r0 + i * ROWS_PER_ROUND
                if r < KW and col < HDP:
                    j = n_start + r
                    inside = j < seqlen_k and col < HD
                    k_from, v_from = k_fallback, v_fallback
                    if inside:
                        k_from = k_thread + j * k_cache.strides[1]
                        v_from = v_thread + j * v_cache.strides[1]
                    size = uint32(16 if inside else 0)
                    cp_async_16_from(k_dst + uint32(i * ROWS_PER_ROUND * ROW_BYTES), k_from, size)
                    cp_async_16_from(v_dst + uint32(i * ROWS_PER_ROUND * ROW_BYTES), v_from, size)
        elif PAGE_ALIGNED:  # one page for the warp's share: its address once, then a row stride a copy
            # (the contiguous loop's shape; folding the two into one base-plus-stride loop changed the
            # contiguous kernel's code, 219 -> 204 registers, the form measured slower before: kept apart)
            page = pages[0]
            page_inside = page >= 0 and page < k_cache.shape[0]
            k_page, v_page = k_fallback, v_fallback
            if page_inside:  # (page and row are >= 0 here: as unsigned, widening them costs nothing)
                page64, row64 = int64(uint32(page)), int64(uint32(offsets[0]))
                k_page = k_thread + page64 * k_cache.strides[0] + row64 * k_cache.strides[1]
                v_page = v_thread + page64 * v_cache.strides[0] + row64 * v_cache.strides[1]
            for i in range(KV_COPIES):
                r = r0 + i * ROWS_PER_ROUND
                if r < KW and col < HDP:
                    inside = page_inside and n_start + r < seqlen_k and col < HD
                    k_from, v_from = k_fallback, v_fallback
                    if inside:
                        k_from = k_page + i * ROWS_PER_ROUND * k_cache.strides[1]
                        v_from = v_page + i * ROWS_PER_ROUND * v_cache.strides[1]
                    size = uint32(16 if inside else 0)
                    cp_async_16_from(k_dst + uint32(i * ROWS_PER_ROUND * ROW_BYTES), k_from, size)
                    cp_async_16_from(v_dst + uint32(i * ROWS_PER_ROUND * ROW_BYTES), v_from, size)
        else:
            for i in static_range(KV_COPIES):  # unrolled: pages[i] and offsets[i] stay in registers
                if r0 + i * ROWS_PER_ROUND < KW and col < HDP:
                    j = n_start + r0 + i * ROWS_PER_ROUND
                    page = pages[i]
                    inside = j < seqlen_k and col < HD and page >= 0 and page < k_cache.shape[0]
                    k_from, v_from = k_fallback, v_fallback
                    if inside:  # k_thread, v_thread: the lane's chunk in page 0, row 0
                        # (page and row are >= 0 here: as unsigned, widening them costs nothing)
                        page64, row64 = int64(uint32(page)), int64(uint32(offsets[i]))
                        k_from = k_thread + page64 * k_cache.strides[0] + row64 * k_cache.strides[1]
                        v_from = v_thread + page64 * v_cache.strides[0] + row64 * v_cache.strides[1]
                    size = uint32(16 if inside else 0)
                    cp_async_16_from(k_dst + uint32(i * ROWS_PER_ROUND * ROW_BYTES), k_from, size)
                    cp_async_16_from(v_dst + uint32(i * ROWS_PER_ROUND * ROW_BYTES), v_from, size)

    @inline_device
    def rotate_q_tile(smem, rotary_cos, rotary_sin, row0, rows_total, group, position0, per_token):
        """Rotary embedding on the landed Q tile, in place: each thread owns whole pairs."""
        half = rotary_cos.shape[1]  # rotary_dim / 2
        last = rotary_cos.shape[0] - 1
        for e in range(cuda.threadIdx.x, Q_ROWS * half, THREADS):
            r = e // half
            d = e % half
            packed = row0 + r
            if packed < rows_total:
                position = position0 + (packed // group if per_token else 0)
                position = min(position, last)  # a position past the table cannot be read
                c = load_elem(rotary_cos[position, d])
                s = load_elem(rotary_sin[position, d])
                i1 = r * ROW + (2 * d if INTERLEAVED else d)
                i2 = i1 + (1 if INTERLEAVED else half)
                x1 = load_elem(smem[i1])
                x2 = load_elem(smem[i2])
                smem[i1] = ELEM(store_elem(x1 * c - x2 * s))
                smem[i2] = ELEM(store_elem(x1 * s + x2 * c))

    # -----------------------------------------------------------------------------------------------
    # Warp tile operations (the C-fragment layout of forward_mma.py: lane = 4 g + t holds rows g
    # and g + 8 of each 16-row tile, columns 2t and 2t + 1 of each 8-column tile)
    # -----------------------------------------------------------------------------------------------

    @inline_device
    @unroll
    def load_q_fragments(q_frag, q_tile, q_lane):
        for mt in static_range(MT):
            for kt in static_range(KT):
                a = ldmatrix_x4(q_tile + q_lane + uint32(mt * 16 * ROW_BYTES + kt * 32))
                for i in static_range(4):
                    q_frag[mt, kt, i] = a[i]

    @inline_device
    @unroll
    def mma_q_kt(s, q_frag, q_tile, q_lane, k_tile, k_lane):
        """S = Q K^T over the warp's KW keys."""
        for mt in static_range(MT):
            for nt in static_range(NT):
                for i in static_range(4):
                    s[mt, nt, i] = float32(0)
        for kt in static_range(KT):
            if not Q_IN_REGISTERS:
                for mt in static_range(MT):
                    a = ldmatrix_x4(q_tile + q_lane + uint32(mt * 16 * ROW_BYTES + kt * 32))
                    for i in static_range(4):
                        q_frag[mt, 0, i] = a[i]
            for np2 in static_range(NT // 2):
                kf = ldmatrix_x4(k_tile + k_lane + uint32(np2 * 16 * ROW_BYTES + kt * 32))
                for half in static_range(2):
                    nt = np2 * 2 + half
                    for mt in static_range(MT):
                        qk = kt if Q_IN_REGISTERS else 0
                        d = mma(q_frag[mt, qk, 0], q_frag[mt, qk, 1], q_frag[mt, qk, 2], q_frag[mt, qk, 3],
                                kf[2 * half], kf[2 * half + 1],
                                s[mt, nt, 0], s[mt, nt, 1], s[mt, nt, 2], s[mt, nt, 3])
                        for i in static_range(4):
                            s[mt, nt, i] = d[i]

    @inline_device
    @unroll
    def score_and_mask(s, token, head, slope, masked, n_start, b, seqlen_q, seqlen_k, params, scale, scale_log2, g,
                       t):
        """The score point (the variant's features on natural-unit scores, then base 2) and, on a
        tile that crosses the window's edges or the end of the keys, the mask point."""
        for mt in static_range(MT):
            for r in static_range(2):
                row = token[mt, r]
                head_ctx = (b, head[mt, r], slope[mt, r])
                lo, hi = row_keys(row, seqlen_q, seqlen_k, params)
                for nt in static_range(NT):
                    for e in static_range(2):
                        key = n_start + nt * 8 + 2 * t + e
                        x = s[mt, nt, 2 * r + e]
                        if SCORE:
                            x = score(x * scale, row, key, seqlen_q, seqlen_k, params, head_ctx) * float32(LOG2E)
                        elif not FOLD_SCALE:
                            x *= scale_log2
                        if masked:
                            if hidden(key, lo, hi, row, seqlen_q, params, head_ctx):
                                x = NEG_INF
                        s[mt, nt, 2 * r + e] = x

    @inline_device
    @unroll
    def online_softmax(s, m_i, l_i, acc, softmax_log2):
        """S -> P = exp2((S - m_new) * softmax_log2); l_i and acc rescaled by exp2((m_i - m_new) *
        softmax_log2). l_i stays a per-lane partial sum until the merge."""
        for mt in static_range(MT):
            for r in static_range(2):
                m_prev = m_i[mt, r]
                m_new = m_prev
                for nt in static_range(NT):
                    m_new = max(m_new, max(s[mt, nt, 2 * r], s[mt, nt, 2 * r + 1]))
                m_new = quad_max(m_new)
                m_scaled = m_new * softmax_log2 if m_new != NEG_INF else float32(0)
                alpha = exp2_approx(m_prev * softmax_log2 - m_scaled)
                row_sum = float32(0)
                for nt in static_range(NT):
                    for e in static_range(2):
                        p = exp2_approx(s[mt, nt, 2 * r + e] * softmax_log2 - m_scaled)
                        s[mt, nt, 2 * r + e] = p
                        row_sum += p
                l_i[mt, r] = l_i[mt, r] * alpha + row_sum
                m_i[mt, r] = m_new
                for dt in static_range(DT):
                    acc[mt, dt, 2 * r] *= alpha
                    acc[mt, dt, 2 * r + 1] *= alpha

    @inline_device
    @unroll
    def mma_p_v(acc, s, v_tile, v_lane):
        """acc += P V over the warp's KW keys (P's A fragments are S's C fragments, packed)."""
        for pt in static_range(PT):
            p0 = cuda.local.array((MT, 4), uint32)
            for mt in static_range(MT):
                p0[mt, 0] = pack(s[mt, 2 * pt, 0], s[mt, 2 * pt, 1])
                p0[mt, 1] = pack(s[mt, 2 * pt, 2], s[mt, 2 * pt, 3])
                p0[mt, 2] = pack(s[mt, 2 * pt + 1, 0], s[mt, 2 * pt + 1, 1])
                p0[mt, 3] = pack(s[mt, 2 * pt + 1, 2], s[mt, 2 * pt + 1, 3])
            for dp2 in static_range(DT // 2):
                vf = ldmatrix_x4_trans(v_tile + v_lane + uint32(pt * 16 * ROW_BYTES + dp2 * 32))
                for half in static_range(2):
                    dt = dp2 * 2 + half
                    for mt in static_range(MT):
                        d = mma(p0[mt, 0], p0[mt, 1], p0[mt, 2], p0[mt, 3], vf[2 * half], vf[2 * half + 1],
                                acc[mt, dt, 0], acc[mt, dt, 1], acc[mt, dt, 2], acc[mt, dt, 3])
                        for i in static_range(4):
                            acc[mt, dt, i] = d[i]

    @inline_device
    @unroll
    def attend(s, acc, m_i, l_i, q_frag, q_tile, q_lane, k_tile, k_lane, v_tile, v_lane, token, head, slope,
               n_start, b, seqlen_q, seqlen_k, params, scale, scale_log2, softmax_log2, g, t, masked):
        """The warp's KW keys of one tile into its (m_i, l_i, acc). ``masked`` is a constant at each
        call site: tiles every row sees whole carry no masking code."""
        mma_q_kt(s, q_frag, q_tile, q_lane, k_tile, k_lane)
        if SCORE or masked or not FOLD_SCALE:
            score_and_mask(s, token, head, slope, masked, n_start, b, seqlen_q, seqlen_k, params, scale, scale_log2,
                           g, t)
        online_softmax(s, m_i, l_i, acc, softmax_log2)
        mma_p_v(acc, s, v_tile, v_lane)

    # -----------------------------------------------------------------------------------------------
    # The end: the warps' states merged, then the output (or the split's partial output) written
    # -----------------------------------------------------------------------------------------------

    @inline_device
    @unroll
    def merge_warps(words, acc, m_i, l_i, softmax_log2, warp, g, t):
        """Each warp's (max, sum) per row, then its acc rescaled to the block's max, into shared
        memory; the block's max and sum per row land in BLOCK_MAX / BLOCK_SUM. Ends before the
        barrier that makes the accumulators visible (the caller's)."""
        for mt in static_range(MT):
            for r in static_range(2):
                row = mt * 16 + g + 8 * r
                l_row = quad_sum(l_i[mt, r])
                if t == 0:
                    m = m_i[mt, r]
                    words[MERGE_MAX + warp * Q_ROWS + row] = m * softmax_log2 if m != NEG_INF else NEG_INF
                    words[MERGE_SUM + warp * Q_ROWS + row] = l_row
        cuda.syncthreads()  # every warp's max and sum are visible
        for mt in static_range(MT):
            for r in static_range(2):
                row = mt * 16 + g + 8 * r
                block_max = NEG_INF
                for w in static_range(WARPS):
                    block_max = max(block_max, words[MERGE_MAX + w * Q_ROWS + row])
                mine = words[MERGE_MAX + warp * Q_ROWS + row]
                factor = exp2_approx(mine - block_max) if mine != NEG_INF else float32(0)
                if warp == 0 and t == 0:
                    total = float32(0)
                    for w in static_range(WARPS):
                        m_w = words[MERGE_MAX + w * Q_ROWS + row]
                        if m_w != NEG_INF:
                            total += words[MERGE_SUM + w * Q_ROWS + row] * exp2_approx(m_w - block_max)
                    words[BLOCK_MAX + row] = block_max
                    words[BLOCK_SUM + row] = total
                for dt in static_range(DT):
                    for e in static_range(2):
                        col = dt * 8 + 2 * t + e
                        words[MERGE_ACC + (warp * Q_ROWS + row) * HDP + col] = acc[mt, dt, 2 * r + e] * factor

    @inline_device
    def write_rows(words, out, lse, o_part, lse_part, b, hk, group, row0, rows_total, split, splits):
        """O = (sum over warps of acc) / l and lse for the block's rows, by the whole block with
        consecutive threads on consecutive columns; with several splits, into the partial arrays."""
        for e in range(cuda.threadIdx.x, Q_ROWS * HD, THREADS):
            r = e // HD
            col = e % HD
            packed = row0 + r
            if packed < rows_total:
                token = packed // group
                h = hk * group + packed % group
                o = float32(0)
                for w in range(WARPS):
                    o += words[MERGE_ACC + (w * Q_ROWS + r) * HDP + col]
                total = words[BLOCK_SUM + r]
                o = o / total if total != float32(0) else float32(0)
                lse_value = NEG_INF
                if total != float32(0):
                    lse_value = (words[BLOCK_MAX + r] + math.log2(total)) * float32(LN2)
                if splits == 1:
                    if IS_F16:
                        out[b, token, h, col] = float16(o)
                    else:
                        out[b, token, h, col] = f32_to_bf16_bits(o)
                    if col == 0:
                        lse[b, h, token] = lse_value
                else:
                    o_part[split, b, h, token, col] = o
                    if col == 0:
                        lse_part[split, b, h, token] = lse_value

    @inline_device
    @unroll
    def merge_splits(words, out, lse, o_part, lse_part, counters, b, hk, group, row0, rows_total, splits):
        """Flash-decoding's combine, in the block that finishes last: each block of a (sequence,
        head, row block) has written its split's partial rows; it makes them visible device-wide
        and takes a ticket; the block with the last ticket merges every split's rows, weighted by
        exp(lse_s - lse) (lse = log sum_s exp(lse_s)), reading them past its L1 (other blocks wrote
        them during this launch), and resets the counter for the next launch (or graph replay).
        The merge reads the splits in order, so the result does not depend on which block is last."""
        tid = cuda.threadIdx.x
        slot = cuda.blockIdx.x * cuda.gridDim.y + cuda.blockIdx.y
        cuda.threadfence()  # this thread's partial rows are visible to every block ...
        cuda.syncthreads()  # ... and every thread's, before the ticket says so
        if tid == 0:
            words[TICKET] = float32(cuda.atomic.add(counters, slot, 1))
        cuda.syncthreads()
        if words[TICKET] != float32(splits - 1):
            return
        cuda.threadfence()  # the other blocks' rows are read after their tickets
        rows = min(Q_ROWS, rows_total - row0)
        for e in range(tid, rows * splits, THREADS):
            r, sp = e // splits, e % splits
            packed = row0 + r
            address = global_address(lse_part, sp, b, hk * group + packed % group, packed // group)
            words[SPLIT_WEIGHT + r * splits + sp] = load_f32_cg(address)
        cuda.syncthreads()  # every split's lse is in shared memory
        for r in range(tid, rows, THREADS):
            lse_max = NEG_INF
            for sp in range(splits):
                lse_max = max(lse_max, words[SPLIT_WEIGHT + r * splits + sp])
            shift = lse_max if lse_max != NEG_INF else float32(0)  # no key in any split: weights 0
            total = float32(0)
            for sp in range(splits):
                total += math.exp(words[SPLIT_WEIGHT + r * splits + sp] - shift)
            words[SPLIT_MAX + r] = shift
            words[SPLIT_SUM + r] = total
        cuda.syncthreads()  # every row's max and sum
        for e in range(tid, rows * splits, THREADS):
            r = e // splits
            total = words[SPLIT_SUM + r]
            weight = math.exp(words[SPLIT_WEIGHT + e] - words[SPLIT_MAX + r])
            words[SPLIT_WEIGHT + e] = weight / total if total != float32(0) else float32(0)
        cuda.syncthreads()  # the weights
        # The splits' partial values of an output element, MERGE_LOADS at a time: all of a batch's
        # loads are in flight before the first is used (one at a time, the merge, which one block
        # does after the others are done, waited an L2 latency per split), and the sum still runs
        # in split order.
        part = cuda.local.array(MERGE_LOADS, float32)
        for e in range(tid, rows * HD, THREADS):
            r, col = e // HD, e % HD
            packed = row0 + r
            token, h = packed // group, hk * group + packed % group
            o = float32(0)
            for sp0 in range(0, splits, MERGE_LOADS):
                for i in static_range(MERGE_LOADS):
                    if sp0 + i < splits:
                        part[i] = load_f32_cg(global_address(o_part[sp0 + i], b, h, token, col))
                for i in static_range(MERGE_LOADS):
                    if sp0 + i < splits:
                        o += words[SPLIT_WEIGHT + r * splits + sp0 + i] * part[i]
            out[b, token, h, col] = store_elem(o)
            if col == 0:
                total = words[SPLIT_SUM + r]
                lse[b, h, token] = words[SPLIT_MAX + r] + math.log(total) if total != float32(0) else NEG_INF
        if tid == 0:
            counters[slot] = 0

    # -----------------------------------------------------------------------------------------------
    # The kernel
    # -----------------------------------------------------------------------------------------------

    @cuda.jit
    @unroll
    def decode_mma(q, k_cache, v_cache, out, lse, o_part, lse_part, counters, cache_seqlens, cache_batch_idx,
                   cache_leftpad, block_table, rotary_cos, rotary_sin, k_new, v_new, scale_log2, seqlen_new, fixed_len,
                   options, params):
        nheads_k = k_cache.shape[2]
        b, hk = cuda.blockIdx.x // nheads_k, cuda.blockIdx.x % nheads_k
        m_block, split, splits = cuda.blockIdx.y, cuda.blockIdx.z, cuda.gridDim.z
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane >> 2, lane & 3
        seqlen_q = q.shape[1]
        group = q.shape[2] // nheads_k
        rows_total = group * seqlen_q
        row0 = m_block * Q_ROWS  # the block's first packed (token, head) row

        # ---- The sequence's keys: cache positions [start, end), as keys 0 .. seqlen_k - 1 ----
        cache_len = fixed_len if fixed_len >= 0 else cache_seqlens[b]
        start = cache_leftpad[b] if options & HAS_LEFTPAD else 0
        capacity = block_table.shape[1] * k_cache.shape[1] if PAGED else k_cache.shape[1]
        seqlen_k = max(0, min(cache_len + seqlen_new, capacity) - start)
        cache_row = cache_batch_idx[b] if options & HAS_BATCH_IDX else b

        # ---- The key tiles these rows see (geometry.py), and this split's share of them ----
        first_token = row0 // group
        last_token = (min(row0 + Q_ROWS, rows_total) - 1) // group
        first_tile, first_full, end_full, end_tile = key_tiles(first_token, last_token + 1, seqlen_q, seqlen_k,
                                                               params, BN)
        per_split = (end_tile - first_tile + splits - 1) // splits
        tile_lo = first_tile + split * per_split
        tile_hi = min(end_tile, tile_lo + per_split)
        keys_lo, _ = row_keys(first_token, seqlen_q, seqlen_k, params)  # some row sees keys from here
        _, keys_hi = row_keys(last_token, seqlen_q, seqlen_k, params)  # ... up to here

        smem = cuda.shared.array(0, ELEM)
        words = cuda.shared.array(0, float32)  # the same memory, as float32 (for the merge)
        base = shared_address(smem)

        if APPEND:
            # ---- The new tokens i whose keys (cache_len + i - start) are this split's: written
            # into the cache by this block before it copies them (the same values by every block of
            # rows that sees them) ----
            i_lo = max(0, tile_lo * BN + start - cache_len)
            i_hi = min(seqlen_new, tile_hi * BN + start - cache_len)
            if i_lo < i_hi:
                append_rows(k_cache, v_cache, k_new, v_new, b, hk, cache_len, i_lo, i_hi, cache_row, block_table,
                            rotary_cos, rotary_sin, tid, THREADS)
                cuda.threadfence_block()
                cuda.syncthreads()  # the rows are in global memory before any warp copies them

        # ---- Prologue: Q and the first `stages` K/V tiles in flight ----
        # Each warp copies its own share of every tile (keys warp * KW .. warp * KW + KW - 1 of it)
        # and is the only one to read it: the warps run their pipelines without a block barrier.
        load_q_tile(base, q, b, hk, group, row0, rows_total)
        cp_async_commit()
        pages = cuda.local.array(KV_COPIES, int32)  # paged: the pages and rows of the next tile's keys
        offsets = cuda.local.array(KV_COPIES, int32)
        # The address of this lane's chunk of key 0 (cache position start) when contiguous; of row
        # 0 of page 0 when paged (a copy then adds its page's and row's strides).
        first_row, first_position = (0, 0) if PAGED else (cache_row, start)
        k_thread = global_address(k_cache, first_row, first_position, hk, (lane % CHUNK_SLOTS) * 8)
        v_thread = global_address(v_cache, first_row, first_position, hk, (lane % CHUNK_SLOTS) * 8)
        share = warp * KW  # the warp's first key in every tile
        for st in static_range(STAGES):
            if tile_lo + st < tile_hi:
                if PAGED:
                    lookup_pages(pages, offsets, k_cache, block_table, b, start, seqlen_k,
                                 (tile_lo + st) * BN + share)
                load_kv_tile(base, k_cache, v_cache, pages, offsets, k_thread, v_thread, seqlen_k,
                             (tile_lo + st) * BN + share, st)
            cp_async_commit()
        if PAGED:
            lookup_pages(pages, offsets, k_cache, block_table, b, start, seqlen_k, (tile_lo + STAGES) * BN + share)
        cp_async_wait(WAIT_FOR_Q)  # this thread's Q copies have landed
        cuda.syncthreads()  # ... and every thread's
        if ROTARY:
            rotate_q_tile(smem, rotary_cos, rotary_sin, row0, rows_total, group, cache_len,
                          options & ROTARY_PER_TOKEN)
            cuda.syncthreads()  # the rotated rows are visible before ldmatrix reads them

        q_lane = uint32(((lane & 7) + ((lane >> 3) & 1) * 8) * ROW_BYTES + (lane >> 4) * 16)
        k_lane = uint32(((lane & 7) + (lane >> 4) * 8) * ROW_BYTES + ((lane >> 3) & 1) * 16)
        v_lane = q_lane
        q_frag = cuda.local.array((MT, KT if Q_IN_REGISTERS else 1, 4), uint32)
        if Q_IN_REGISTERS:
            load_q_fragments(q_frag, base, q_lane)

        # Each lane's rows: their query token, query head and ALiBi slope (the variant's head
        # context is per row here: the rows of a tile belong to different heads).
        token = cuda.local.array((MT, 2), int32)
        head = cuda.local.array((MT, 2), int32)
        slope = cuda.local.array((MT, 2), float32)
        for mt in static_range(MT):
            for r in static_range(2):
                packed = min(row0 + mt * 16 + g + 8 * r, rows_total - 1)  # padding rows copy the last
                token[mt, r] = packed // group
                head[mt, r] = hk * group + packed % group
                slope[mt, r] = head_context(params, b, head[mt, r])[2]

        s = cuda.local.array((MT, NT, 4), float32)
        acc = cuda.local.array((MT, DT, 4), float32)
        m_i = cuda.local.array((MT, 2), float32)
        l_i = cuda.local.array((MT, 2), float32)
        for mt in static_range(MT):
            for r in static_range(2):
                m_i[mt, r] = NEG_INF
                l_i[mt, r] = float32(0)
            for dt in static_range(DT):
                for i in static_range(4):
                    acc[mt, dt, i] = float32(0)
        softmax_log2 = scale_log2 if FOLD_SCALE else float32(1)
        scale = scale_log2 * float32(LN2)

        # ---- Main loop: tile j in ring slot (j - tile_lo) % STAGES; the warp's share of it ----
        for j in range(tile_lo, tile_hi):
            stage = (j - tile_lo) % STAGES
            cp_async_wait(WAIT_FOR_TILE)  # this lane's copies of tile j have landed
            warp_sync()  # ... and every lane's
            n_start = j * BN + share  # this warp's keys of the tile
            if n_start < keys_hi and n_start + KW > keys_lo:  # some row sees one of them
                k_tile = base + uint32(Q_BYTES + stage * 2 * TILE_BYTES + warp * KW * ROW_BYTES)
                v_tile = k_tile + uint32(TILE_BYTES)
                if first_full <= j and j < end_full:
                    attend(s, acc, m_i, l_i, q_frag, base, q_lane, k_tile, k_lane, v_tile, v_lane, token, head, slope,
                           n_start, b, seqlen_q, seqlen_k, params, scale, scale_log2, softmax_log2, g, t, False)
                else:
                    attend(s, acc, m_i, l_i, q_frag, base, q_lane, k_tile, k_lane, v_tile, v_lane, token, head, slope,
                           n_start, b, seqlen_q, seqlen_k, params, scale, scale_log2, softmax_log2, g, t, True)
            # The slot is refilled as soon as the warp is done with it: `stages` tiles stay in
            # flight while the warp waits for the next one.
            if j + STAGES < tile_hi:
                warp_sync()  # every lane's reads of the slot are done
                load_kv_tile(base, k_cache, v_cache, pages, offsets, k_thread, v_thread, seqlen_k,
                             (j + STAGES) * BN + share, stage)
                if PAGED:  # the next copy's pages, while the warp waits for its tiles
                    lookup_pages(pages, offsets, k_cache, block_table, b, start, seqlen_k,
                                 (j + STAGES + 1) * BN + share)
            cp_async_commit()

        # ---- Epilogue: merge the warps, write the rows ----
        cp_async_wait(0)
        cuda.syncthreads()  # every warp is done with the ring, which the merge reuses
        merge_warps(words, acc, m_i, l_i, softmax_log2, warp, g, t)
        cuda.syncthreads()  # every warp's rescaled acc and the block's sums are visible
        write_rows(words, out, lse, o_part, lse_part, b, hk, group, row0, rows_total, split, splits)
        if splits > 1:
            merge_splits(words, out, lse, o_part, lse_part, counters, b, hk, group, row0, rows_total, splits)

    return decode_mma
