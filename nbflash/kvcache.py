"""Attention against a KV cache: ``flash_attn_with_kvcache`` (flash-attn 2.8's), and
``merge_attention_states``.

One call appends the new tokens' keys and values to the cache in place (rotating the keys first
when rotary embedding is on) and attends the queries to everything cached. On float16/bfloat16
caches on GPUs of compute capability 8.0 or newer this runs the decode kernel
(nbflash/kernels/decode_mma.py): the query heads that share a key/value head and the query tokens
are packed into the rows of one tile, so the cache is read once per key/value head, and the keys
are split across thread blocks when batch x heads alone would not fill the GPU (Flash-Decoding),
the partial results merged through their log-sum-exps. Other calls (float32 caches, head dims not
a multiple of 8, rows not 16-byte aligned, older GPUs) gather each sequence's keys and run
``flash_attn_func`` with the sequence masks as a bias: correct, but not the fast path.

No host synchronization: lengths given as device arrays stay on the device. With ``out=`` the call
allocates nothing on the GPU after its first call with the same shapes on the same stream (the
split-KV workspace is kept per stream and device), so a decode step can be captured in a CUDA graph
and replayed.
"""

import math
import numbers
from functools import lru_cache

import numpy as np

from . import configs, launch, runtime, validation
from .dtypes import FLOAT32, KERNEL_DTYPE, dtype_name
from .kernels import decode_mma
from .kernels.kvcache import AppendConfig, CombineConfig
from .problem import UNBOUNDED, Variant, window_bounds

LOG2_E = math.log2(math.e)
MAX_SPLITS = decode_mma.MAX_SPLITS  # the decode kernel's merge holds a weight per (row, split)
# Append the new tokens inside the decode launch where it can (_Plan.fused_append), instead of a
# launch of the append kernel before it: one launch a decode step (on the H200: the GPU tests of
# tests/test_kvcache.py pass with it, and a decode call with an append took the host time of one
# without, 1.48x a trivial kernel's instead of 2.69x; docs/benchmarks.md).
FUSED_APPEND = True
# Paged caches whose pages hold whole warp shares of a tile (MmaDecodeConfig.page_aligned: page
# size a multiple of 16 keys, no cache_leftpad): one block-table lookup a lane and tile, not one a
# row it copies. Measured on the H200 (GQA 32/8, hd 128, fp16, pages of 16 and 256; docs/perf-notes.md,
# decode round 5): paged decode at one query token 0.70-0.75 -> 0.83-0.92 of the copy bandwidth,
# 0.93-1.00x the contiguous cache's speed (0.80-0.83x with a lookup a row).
PAGE_ALIGNED_COPIES = True
MIN_TILES_PER_SPLIT = 2  # a split smaller than this spends more on its prologue than on keys
MAX_GRID_X = 2**31 - 1


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------


def _int32_vector(x, name, batch, device):
    """An int32 (batch,) array on q's device."""
    x = validation.as_backend_array(x, name)
    if x.dtype != np.int32:
        raise TypeError(f"{name}.dtype={x.dtype} must be int32 (as in flash-attn): pass {name}.astype('int32')")
    if tuple(x.shape) != (batch,):
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(x.shape)}")
    if not runtime.SIMULATOR and x.data.device_id != device:
        raise ValueError(f"{name} is on GPU {x.data.device_id} but q is on GPU {device}")
    return x


def _same_array_kind(x, name, like, like_name, shape=None):
    x = validation.as_backend_array(x, name)
    if x.dtype != like.dtype:
        raise TypeError(f"{name}.dtype={x.dtype} differs from {like_name}.dtype={like.dtype}; they must match")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if not runtime.SIMULATOR and x.data.device_id != like.data.device_id:
        raise ValueError(f"{name} is on GPU {x.data.device_id} but {like_name} is on GPU {like.data.device_id}")
    return x


class _Call:
    """A validated flash_attn_with_kvcache call: arrays on the backend and the static facts."""


def _check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
           block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
           return_softmax_lse, out):
    c = _Call()
    q = validation.as_backend_array(q, "q")
    (batch, seqlen_q, nheads, headdim), _ = validation._check_layout(q, "q", "(batch, seqlen_q, nheads, headdim)")
    dtype = dtype_name(q.dtype)
    if dtype is None:
        raise TypeError(f"q.dtype={q.dtype} is not supported; expected float16, bfloat16 or float32")
    if headdim > validation.MAX_HEADDIM:
        raise ValueError(f"{headdim=} exceeds {validation.MAX_HEADDIM}")
    device = 0 if runtime.SIMULATOR else q.data.device_id
    if not runtime.SIMULATOR and device != runtime.cupy().cuda.runtime.getDevice():
        raise ValueError(f"q is on GPU {device} but the current CuPy device is "
                         f"{runtime.cupy().cuda.runtime.getDevice()}; call inside `with cupy.cuda.Device({device}):`")

    paged = block_table is not None
    dims = "(num_blocks, page_block_size, nheads_k, headdim)" if paged else "(batch_cache, seqlen_cache, nheads_k, headdim)"
    k_cache = _same_array_kind(k_cache, "k_cache", q, "q")
    v_cache = _same_array_kind(v_cache, "v_cache", q, "q")
    cache_shape, _ = validation._check_layout(k_cache, "k_cache", dims)
    validation._check_layout(v_cache, "v_cache", dims)
    if tuple(v_cache.shape) != tuple(cache_shape):
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(cache_shape)} and "
                         f"{tuple(v_cache.shape)}")
    rows, page_size, nheads_k, headdim_k = cache_shape
    if headdim_k != headdim:
        raise ValueError(f"headdim differs: q has {headdim} (q.shape[3]), k_cache has {headdim_k}")
    if nheads % nheads_k:
        raise ValueError(f"nheads={nheads} (q.shape[2]) must be a multiple of nheads_k={nheads_k} "
                         f"(k_cache.shape[2]) for grouped-query attention")

    if paged:
        block_table = validation.as_backend_array(block_table, "block_table")
        if block_table.dtype != np.int32:
            raise TypeError(f"block_table.dtype={block_table.dtype} must be int32")
        if block_table.ndim != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
            raise ValueError(f"block_table must have shape (batch, max_num_blocks_per_seq) with batch={batch}, "
                             f"got {tuple(block_table.shape)}")
        if not runtime.SIMULATOR and block_table.data.device_id != device:
            raise ValueError(f"block_table is on GPU {block_table.data.device_id} but q is on GPU {device}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be used with block_table: the block table already maps "
                             "each sequence to its pages")
        capacity = block_table.shape[1] * page_size
    else:
        capacity = page_size
        if cache_batch_idx is None and rows < batch:
            raise ValueError(f"k_cache holds {rows} sequences (k_cache.shape[0]) but q has batch={batch}; "
                             f"pass cache_batch_idx to map sequences to cache rows")

    seqlen_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens) go together: pass both or neither")
    if k is not None:
        k = _same_array_kind(k, "k", q, "q")
        v = _same_array_kind(v, "v", q, "q")
        validation._check_layout(k, "k", "(batch, seqlen_new, nheads_k, headdim)")
        validation._check_layout(v, "v", "(batch, seqlen_new, nheads_k, headdim)")
        seqlen_new = k.shape[1]
        expected = (batch, seqlen_new, nheads_k, headdim)
        for name, x in (("k", k), ("v", v)):
            if tuple(x.shape) != expected:
                raise ValueError(f"{name} must have shape (batch, seqlen_new, nheads_k, headdim) = {expected}, "
                                 f"got {tuple(x.shape)}")

    fixed_len = -1  # the one length of every sequence, or -1: cache_seqlens is an array
    lengths_given = cache_seqlens is not None
    if cache_seqlens is None:
        fixed_len = capacity
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, (bool, np.bool_)):
        fixed_len = int(cache_seqlens)
        if not 0 <= fixed_len <= capacity:
            raise ValueError(f"cache_seqlens={fixed_len} must be in [0, {capacity}] (the cache's capacity)")
        cache_seqlens = None  # the kernels take the int as fixed_len
    else:
        cache_seqlens = _int32_vector(cache_seqlens, "cache_seqlens", batch, device)
    if fixed_len >= 0 and fixed_len + seqlen_new > capacity:
        raise ValueError(f"the cache overflows: cache_seqlens={fixed_len} + {seqlen_new} new tokens > capacity "
                         f"{capacity}" + ("" if lengths_given else
                                          " (cache_seqlens=None means every cache is full: pass cache_seqlens)"))
    if cache_batch_idx is not None:
        cache_batch_idx = _int32_vector(cache_batch_idx, "cache_batch_idx", batch, device)
    if cache_leftpad is not None:
        cache_leftpad = _int32_vector(cache_leftpad, "cache_leftpad", batch, device)

    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin go together: pass both or neither")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin rotate the new k (and q): pass k and v too")
        rotary_cos = _same_array_kind(rotary_cos, "rotary_cos", q, "q")
        rotary_sin = _same_array_kind(rotary_sin, "rotary_sin", q, "q", rotary_cos.shape)
        if rotary_cos.ndim != 2 or not 1 <= 2 * rotary_cos.shape[1] <= headdim:
            raise ValueError(f"rotary_cos must have shape (seqlen_ro, rotary_dim / 2) with rotary_dim <= "
                             f"headdim={headdim}, got {tuple(rotary_cos.shape)}")
        if rotary_cos.shape[0] < capacity:
            raise ValueError(f"rotary_cos has {rotary_cos.shape[0]} positions (rotary_cos.shape[0]) but the cache "
                             f"holds {capacity}: give one row per cache position")
        if rotary_interleaved is not True and rotary_interleaved is not False:
            raise TypeError(f"rotary_interleaved must be a bool, got {rotary_interleaved!r}")
    if causal is not True and causal is not False and not isinstance(causal, np.bool_):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    window_size = validation.check_window_size(window_size)
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int >= 0 (0 picks the split count), got {num_splits!r}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 picks the split count), got {num_splits!r}")
    if return_softmax_lse is not True and return_softmax_lse is not False:
        raise TypeError(f"return_softmax_lse must be a bool, got {return_softmax_lse!r}")
    if out is not None:
        out = _same_array_kind(out, "out", q, "q", q.shape)
        if out.shape[3] > 1 and out.strides[3] != out.itemsize:
            raise ValueError("out's last dim must be contiguous")

    c.q, c.k_cache, c.v_cache, c.k, c.v, c.out = q, k_cache, v_cache, k, v, out
    c.rotary_cos, c.rotary_sin, c.interleaved = rotary_cos, rotary_sin, bool(rotary_interleaved)
    c.cache_seqlens, c.cache_batch_idx, c.cache_leftpad, c.block_table = (cache_seqlens, cache_batch_idx,
                                                                          cache_leftpad, block_table)
    c.batch, c.seqlen_q, c.nheads, c.nheads_k, c.headdim = batch, seqlen_q, nheads, nheads_k, headdim
    c.dtype, c.device, c.paged, c.capacity, c.seqlen_new, c.fixed_len = dtype, device, paged, capacity, seqlen_new, fixed_len
    c.causal, c.window_size = bool(causal), window_size
    c.softmax_scale = validation.check_softmax_scale(softmax_scale, headdim)
    c.softcap = validation.check_softcap(softcap)
    c.alibi_slopes = None if alibi_slopes is None else validation.check_alibi_slopes(alibi_slopes, batch, nheads,
                                                                                       device)
    c.num_splits = int(num_splits)
    # The kernels' window: sides that mask nothing for any length the cache can hold are unbounded.
    c.left, c.right, window = window_bounds(seqlen_q, capacity + 1, c.causal, window_size)
    c.variant = Variant(window=window, softcap=c.softcap > 0, alibi=c.alibi_slopes is not None)
    # flash-attn rotates query token i at cache_len + i for causal or local attention, else at cache_len.
    c.rotary_per_token = c.causal or window_size != (UNBOUNDED, UNBOUNDED)
    if not _rotary_positions_fit(c, fixed_len):
        raise ValueError(f"with causal or a window, query token i is rotated at position cache_seqlens + i: "
                         f"cache_seqlens={fixed_len} and seqlen_q={seqlen_q} reach position "
                         f"{fixed_len + seqlen_q - 1}, past rotary_cos's {rotary_cos.shape[0]} rows "
                         f"(rotary_cos.shape[0]): give a row for every position a query reaches")
    return c


def _rotary_positions_fit(c, fixed_len):
    """Whether every query token's rotary position is a row of rotary_cos, where the lengths are
    known on the host (fixed_len >= 0); lengths on the GPU are not read back, and the kernel then
    clamps a position past the table to its last row."""
    if c.rotary_cos is None or fixed_len < 0:
        return True
    last = fixed_len + (c.seqlen_q - 1 if c.rotary_per_token else 0)
    return last < c.rotary_cos.shape[0]


# The _Call attribute holding each runtime value a variant passes the kernels (Variant.param_names).
_PARAM_ATTRIBUTES = {"window_left": "left", "window_right": "right", "softcap": "softcap",
                     "alibi_slopes": "alibi_slopes"}


@lru_cache(maxsize=None)
def _param_attributes(variant):
    return tuple(_PARAM_ATTRIBUTES[name] for name in variant.param_names())


def _params(c):
    """The variant's runtime values for the kernels, in their order (``()`` for plain attention)."""
    attributes = _param_attributes(c.variant)
    return tuple([getattr(c, name) for name in attributes]) if attributes else ()


# ---------------------------------------------------------------------------------------------------
# Buffers the launches need: stand-ins for absent arrays, the split-KV workspace
# ---------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _stand_ins(device, dtype):
    """Tiny arrays passed where an optional argument is absent (the kernels never read them)."""
    xp = runtime.xp()
    element = KERNEL_DTYPE[dtype]  # bfloat16 as its uint16 bits, as the kernels see it
    return {
        "int32": xp.zeros(1, np.int32),
        "table": xp.zeros((1, 1), np.int32),
        "rotary": xp.zeros((1, 1), element),
        "o_part": xp.zeros((1, 1, 1, 1, 1), np.float32),
        "lse_part": xp.zeros((1, 1, 1, 1), np.float32),
    }


_workspaces = {}  # (device, stream) -> CuPy memory, kept for the life of the process
_merge_counters = {}  # (device, stream) -> int32 zeros: the decode kernel's split-merge tickets
_retired = []  # outgrown workspaces: a captured CUDA graph may still point into them
_replaced = 0  # how many workspaces and counters were made: a plan's kept views are older than that


def _workspace(nbytes, device, stream):
    """Device memory of at least ``nbytes`` owned by the library for ``stream`` (a pointer): stream
    order keeps two calls on one stream from overlapping, and a graph captured on it keeps
    pointing at memory nobody else reuses."""
    global _replaced
    key = (device, stream)
    memory = _workspaces.get(key)
    if memory is None or memory.mem.size < nbytes:
        if memory is not None:
            _retired.append(memory)
        memory = _workspaces[key] = runtime.cupy().cuda.alloc(max(nbytes, 1 << 20))
        _replaced += 1
    return memory


def _counters(slots, device, stream):
    """int32 zeros, at least ``slots`` of them, for ``stream``: each decode launch with several
    splits counts its blocks' arrivals there and leaves the counts at 0 again (so they never need
    clearing, also under graph replay). Per stream, as the workspace: launches on two streams may
    run at once."""
    global _replaced
    if runtime.SIMULATOR:
        return np.zeros(slots, np.int32)
    key = (device, stream)
    counters = _merge_counters.get(key)
    if counters is None or counters.size < slots:
        if counters is not None:
            _retired.append(counters)  # a captured graph may still count there
        counters = _merge_counters[key] = runtime.cupy().zeros(max(slots, 1024), np.int32)
        _replaced += 1
    return counters


def _scratch(c, splits, merge_slots, stream):
    """(lse, o_part, lse_part, counters) for a decode launch of call ``c`` (its shapes) with
    ``splits`` splits: the split merge's partial results and tickets, and an lse the caller does not
    see. On a GPU they live in the stream's workspace and are made once per plan and stream
    (``_Plan.scratch``); under the simulator, every call makes its own."""
    shape = (c.batch, c.nheads, c.seqlen_q)
    stand = _stand_ins(c.device, c.dtype)
    if runtime.SIMULATOR:
        if splits == 1:
            return np.empty(shape, np.float32), stand["o_part"], stand["lse_part"], stand["int32"]
        return (np.empty(shape, np.float32), np.empty((splits, *shape, c.headdim), np.float32),
                np.empty((splits, *shape), np.float32), _counters(merge_slots, c.device, stream))
    cupy = runtime.cupy()
    rows = c.batch * c.nheads * c.seqlen_q
    memory = _workspace(4 * (splits * rows * (c.headdim + 1) + rows) + 512, c.device, stream)
    lse = cupy.ndarray(shape, np.float32, memory)
    if splits == 1:
        return lse, stand["o_part"], stand["lse_part"], stand["int32"]
    offset = -(-4 * rows // 256) * 256
    o_part = cupy.ndarray((splits, *shape, c.headdim), np.float32, memory + offset)
    offset += -(-4 * splits * rows * c.headdim // 256) * 256
    lse_part = cupy.ndarray((splits, *shape), np.float32, memory + offset)
    return lse, o_part, lse_part, _counters(merge_slots, c.device, stream)


# ---------------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _multiprocessors(device):
    if runtime.SIMULATOR:
        return 4
    return runtime.cupy().cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]


@lru_cache(maxsize=1024)
def choose_splits(blocks, tiles, multiprocessors):
    """How many splits of the keys: enough blocks to give every multiprocessor one, in whole waves.
    The smallest count whose wave efficiency (blocks over the multiprocessors of the waves they
    take) is within 95% of the best; at most one split per MIN_TILES_PER_SPLIT key tiles.

    One block per multiprocessor, not one per block slot: on the H200 a lone decode block keeps
    its multiprocessor's share of the bandwidth busy (batch 1 / 128k: 16 splits on 132
    multiprocessors ran as fast as 32 on the 264 slots of two blocks each), and every extra split
    costs partial outputs written and read back by the combine (batch 16 / 16k: one split, 128
    blocks, 0.80 of the copy bandwidth; two, filling the slots, 0.75)."""
    if blocks >= multiprocessors:
        return 1
    most = max(1, min(MAX_SPLITS, tiles // MIN_TILES_PER_SPLIT))

    def efficiency(splits):
        n = blocks * splits
        return n / (-(-n // multiprocessors) * multiprocessors)

    best = max(efficiency(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if efficiency(s) >= 0.95 * best)


def _uses_decode_kernel(c):
    if configs.mma_unsupported_reason(c.dtype, c.device) is not None or c.headdim % 8:
        return False
    arrays = [c.q, c.k_cache, c.v_cache]
    return all(validation.rows_aligned(x) for x in arrays)


# ---------------------------------------------------------------------------------------------------
# The calls
# ---------------------------------------------------------------------------------------------------


def _options(c):
    options = 0
    if c.cache_batch_idx is not None:
        options |= decode_mma.HAS_BATCH_IDX
    if c.cache_leftpad is not None:
        options |= decode_mma.HAS_LEFTPAD
    if c.rotary_per_token:
        options |= decode_mma.ROTARY_PER_TOKEN
    return options


class _Plan:
    """What a call's kernels and launches are, worked out once for every call that looks the same to
    validation (the same shapes, strides, dtypes, alignment, devices and flags: ``_remember_key``).
    ``run`` launches them for a call's arrays; it is the one route of every call, checked in full
    or remembered."""

    def __init__(self, c, key=None):
        self.template = c
        self.key = key
        self.decode = _uses_decode_kernel(c)
        self.stand = _stand_ins(c.device, c.dtype)
        self.options = _options(c)
        self._current_stream = None if runtime.SIMULATOR else runtime.cupy().cuda.get_current_stream
        # The append inside the decode launch (MmaDecodeConfig.append): where every new key is in
        # some block's keys, i.e. every query row's window is unbounded on the left (the last
        # query token then sees them all), and no leftpad (a key below it is no block's)
        self.fused_append = (FUSED_APPEND and c.k is not None and self.decode and c.left > c.capacity
                             and c.cache_leftpad is None and c.seqlen_q > 0)
        if c.k is not None and not self.fused_append:
            self.append_config = AppendConfig(c.dtype, paged=c.paged, rotary=c.rotary_cos is not None,
                                              rotary_interleaved=c.interleaved)
            self.append_kernel = launch.compiled(self.append_config, c.device)
            self.append_grid = self.append_config.grid(c.batch, c.seqlen_new, c.nheads_k)
            self.append_layout = object()  # stands for the append's array layouts (ParameterBuffer.write)
            # The append's arguments that are each call's (the rest are the plan's stand-ins): the
            # caches, k, v, and whichever of lengths, cache_batch_idx, block_table, rotary are given.
            given = (c.cache_seqlens, c.cache_batch_idx, c.block_table, c.rotary_cos, c.rotary_sin)
            self.append_varying = (0, 1, 2, 3, *(4 + i for i, x in enumerate(given) if x is not None))
        if self.decode:
            self._plan_decode(c)

    def _plan_decode(self, c):
        rows_total = c.nheads // c.nheads_k * c.seqlen_q

        # The page size where the copies may take a warp's share from one page (else None)
        aligned_pages = (c.k_cache.shape[1] if PAGE_ALIGNED_COPIES and c.paged and c.cache_leftpad is None
                         else None)

        def config_of(wide):
            return configs.decode_config(c.dtype, c.headdim, c.variant, c.paged, c.rotary_cos is not None,
                                         c.interleaved, rows_total, c.softmax_scale > 0, append=self.fused_append,
                                         wide=wide, aligned_pages=aligned_pages)

        config = config_of(False)
        row_blocks = -(-rows_total // config.q_rows)
        multiprocessors = _multiprocessors(c.device)
        if c.batch * c.nheads_k * row_blocks < multiprocessors:
            # Fewer units of work than SMs: the splits make one block an SM (choose_splits), and
            # that block takes 8 warps (6 at headdim 256; configs.MMA_DECODE_WIDE).
            config = config_of(True)
        if c.batch * c.nheads_k > MAX_GRID_X or row_blocks > validation.MAX_GRID_YZ:
            raise ValueError(f"batch * nheads_k = {c.batch * c.nheads_k} or seqlen_q * (nheads / nheads_k) = "
                             f"{rows_total} is too large for one launch; split the call")
        splits = c.num_splits
        tiles = -(-(c.capacity + 1) // config.block_n)
        if splits == 0:
            splits = choose_splits(c.batch * c.nheads_k * row_blocks, tiles, multiprocessors)
        self.splits = max(1, min(splits, tiles, MAX_SPLITS))
        self.config = config
        self.decode_kernel = launch.compiled(config, c.device)
        self.decode_grid = config.grid(c.batch, c.nheads_k, row_blocks, self.splits)
        # The decode launch's arguments that are each call's: q, the caches, out, lse (fresh when
        # returned), the given optional arrays and ALiBi's slopes; the split scratch and the
        # stand-ins are the same objects on every launch with a stream's layout key (scratch).
        given = (c.cache_seqlens, c.cache_batch_idx, c.cache_leftpad, c.block_table, c.rotary_cos, c.rotary_sin)
        self.decode_varying = (0, 1, 2, 3, 4, *(8 + i for i, x in enumerate(given) if x is not None), 14, 15,
                               *((16,) if c.alibi_slopes is not None else ()))
        self.merge_slots = c.batch * c.nheads_k * row_blocks  # the split merge's counters (one per block of rows)
        self.scale_log2 = c.softmax_scale * LOG2_E
        attributes = _param_attributes(c.variant)
        # The variant's runtime values; ALiBi's slopes are each call's array, at this index.
        self.params = tuple(getattr(c, name) for name in attributes)
        self.slopes_at = attributes.index("alibi_slopes") if c.alibi_slopes is not None else None
        self._scratch = {}  # stream -> (_replaced when made, (lse, o_part, lse_part, counters), layout key)

    def lengths(self, cache_seqlens):
        """(fixed_len, cache_seqlens array or None) of a remembered call, whose cache_seqlens is of
        the template's kind; None when the lengths need the full check (which then raises)."""
        if cache_seqlens is None or type(cache_seqlens) is int:
            c = self.template
            fixed_len = c.capacity if cache_seqlens is None else cache_seqlens
            if not 0 <= fixed_len <= c.capacity - c.seqlen_new or not _rotary_positions_fit(c, fixed_len):
                return None
            return fixed_len, None
        return -1, cache_seqlens

    def scratch(self, stream):
        """The decode launch's (lse, o_part, lse_part, counters) on ``stream`` and the layout key
        that stands for them (and the plan's stand-ins) in the decode kernel's parameter buffer:
        views into the stream's workspace kept from the plan's last call there, unless a workspace
        was made since (making these CuPy arrays was a third of a decode call's host time)."""
        if stream is None:  # the simulator
            return _scratch(self.template, self.splits, self.merge_slots, None), None
        kept = self._scratch.get(stream)
        if kept is None or kept[0] != _replaced:
            views = _scratch(self.template, self.splits, self.merge_slots, stream)
            kept = self._scratch[stream] = (_replaced, views, object())
        return kept[1], kept[2]

    def bind(self, arrays, fixed_len, cache_seqlens):
        """The template call with this call's arrays and lengths (for the gathered route)."""
        c = _Call()
        c.__dict__.update(self.template.__dict__)  # a shallow copy, without copy.copy's protocol
        (c.q, c.k_cache, c.v_cache, c.k, c.v, c.rotary_cos, c.rotary_sin, c.cache_batch_idx, c.cache_leftpad,
         c.block_table, slopes, c.out) = arrays
        if slopes is not None:
            c.alibi_slopes = runtime.xp().broadcast_to(slopes, (c.batch, c.nheads)) if slopes.ndim == 1 else slopes
        c.fixed_len, c.cache_seqlens = fixed_len, cache_seqlens
        return c

    def run(self, arrays, fixed_len, cache_seqlens, want_lse):
        """This call's launches: the append of the new k (rotated) and v into the cache, in place,
        then the decode kernel (or the gathered route). ``arrays`` in ``flash_attn_with_kvcache``'s
        order, of the template's layouts. Returns (out, lse)."""
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, batch_idx, leftpad, table, slopes, out = arrays
        stand = self.stand
        stream = None if self._current_stream is None else self._current_stream().ptr  # asked once a call
        lengths = stand["int32"] if cache_seqlens is None else cache_seqlens
        batch_idx = stand["int32"] if batch_idx is None else batch_idx
        table = stand["table"] if table is None else table
        if rotary_cos is None:
            rotary_cos = rotary_sin = stand["rotary"]
        if k is not None and not self.fused_append:
            self.append_kernel.launch(self.append_grid, (k_cache, v_cache, k, v, lengths, batch_idx, table,
                                                         rotary_cos, rotary_sin),
                                      (fixed_len, self.options), (), self.append_layout, stream,
                                      self.append_varying)
        if not self.decode:
            return _gathered(self.bind(arrays, fixed_len, cache_seqlens))
        c = self.template
        if out is None:
            out = launch.empty(q.shape, q.dtype)
        (lse, o_part, lse_part, counters), layout = self.scratch(stream)
        if want_lse:
            lse = launch.empty((c.batch, c.nheads, c.seqlen_q), FLOAT32)
        params = self.params
        if self.slopes_at is not None:
            if slopes.ndim == 1:
                slopes = runtime.xp().broadcast_to(slopes, (c.batch, c.nheads))
            params = (*params[:self.slopes_at], slopes, *params[self.slopes_at + 1:])
        self.decode_kernel.launch(self.decode_grid, (q, k_cache, v_cache, out, lse, o_part, lse_part, counters,
                                                     lengths, batch_idx, stand["int32"] if leftpad is None else leftpad,
                                                     table, rotary_cos, rotary_sin,
                                                     q if k is None else k, q if v is None else v),
                                  (self.scale_log2, c.seqlen_new, fixed_len, self.options), params,
                                  layout, stream, self.decode_varying)
        return out, lse


# A serving loop calls with the same shapes again and again: such a call skips validation and
# planning. Only plain backend arrays (or None) and plain Python scalars qualify.
_REMEMBERED = {}
_REMEMBER_AT_MOST = 256
_last_plan = None  # the plan of the last remembered call (a serving loop's every layer has one)
# The arrays whose pointers' alignment is part of the verdict, first in the order of
# flash_attn_with_kvcache's arguments: q, k_cache and v_cache, whose rows the decode kernel copies
# 16 bytes at a time when all three are aligned (_uses_decode_kernel); every other array it reads
# or writes element by element.
_ALIGNED_ARRAYS = 3


def forget_plans():
    """Drop the remembered calls' plans, so the next call is checked and planned afresh: for the
    tuning scripts, which change the configuration table (configs.MMA_DECODE) between calls that
    would otherwise reuse the plan, and kernel, made under the old one."""
    global _last_plan
    _REMEMBERED.clear()
    _last_plan = None


def _remember_key(arrays, cache_seqlens, scalars):
    """What validation's and planning's verdict on a call depends on, as a dict key: the current
    device, the flags, per array its shape, strides, dtype and device, and whether q and the caches
    are all 16-byte aligned (never a pointer: a serving loop's layers share one plan); None if the
    call does not qualify (then it is checked in full)."""
    softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits, return_lse = scalars
    if not ((softmax_scale is None or type(softmax_scale) is float) and type(causal) is bool
            and type(window_size) is tuple and type(softcap) is float and type(rotary_interleaved) is bool
            and type(num_splits) is int and type(return_lse) is bool):
        return None
    if len(window_size) != 2 or type(window_size[0]) is not int or type(window_size[1]) is not int:
        return None
    simulator = runtime.SIMULATOR
    if simulator:
        array_type, device = np.ndarray, 0
    else:
        cupy = runtime.cupy()
        array_type, device = cupy.ndarray, cupy.cuda.runtime.getDevice()
    parts = [device, *scalars]
    pointers = 0  # q's and the caches' pointers or-ed: their low 4 bits are 0 when all are aligned
    for i, x in enumerate(arrays):
        if x is None:
            parts.append(None)
        elif type(x) is array_type:
            if simulator:
                parts += (x.shape, x.strides, x.dtype, 0)
                if i < _ALIGNED_ARRAYS:
                    pointers |= x.ctypes.data
            else:
                data = x.data
                parts += (x.shape, x.strides, x.dtype, data.device_id)
                if i < _ALIGNED_ARRAYS:
                    pointers |= data.ptr
        else:
            return None
    parts.append(pointers % 16 == 0)
    if cache_seqlens is None or type(cache_seqlens) is int:
        parts.append(type(cache_seqlens))
    elif type(cache_seqlens) is array_type:
        parts += (cache_seqlens.shape, cache_seqlens.strides, cache_seqlens.dtype,
                  0 if simulator else cache_seqlens.data.device_id)
    else:
        return None
    return tuple(parts)


def _sequence_lengths(c, xp):
    """(start, seqlen_k) per sequence as (batch,) int64 arrays on the backend, no host round trip."""
    cache_len = (xp.full(c.batch, c.fixed_len, np.int64) if c.fixed_len >= 0
                 else c.cache_seqlens.astype(np.int64))
    start = xp.zeros(c.batch, np.int64) if c.cache_leftpad is None else c.cache_leftpad.astype(np.int64)
    end = xp.minimum(cache_len + c.seqlen_new, c.capacity)
    return start, xp.maximum(end - start, 0), cache_len


def _gathered(c):
    """The portable route: each sequence's keys gathered into a dense (batch, capacity) layout, its
    lengths, window and ALiBi as a float bias, then flash_attn_func."""
    from .interface import flash_attn_func

    xp = runtime.xp()
    start, seqlen_k, cache_len = _sequence_lengths(c, xp)
    j = xp.arange(c.capacity)[None, :]
    position = xp.minimum(start[:, None] + j, c.capacity - 1)
    if c.paged:
        page_size = c.k_cache.shape[1]
        table = c.block_table.astype(np.int64)
        pages = xp.take_along_axis(table, position // page_size, axis=1)
        pages = xp.clip(pages, 0, c.k_cache.shape[0] - 1)
        keys, values = c.k_cache[pages, position % page_size], c.v_cache[pages, position % page_size]
    else:
        rows = (xp.arange(c.batch) if c.cache_batch_idx is None else
                xp.clip(c.cache_batch_idx.astype(np.int64), 0, c.k_cache.shape[0] - 1))
        keys, values = c.k_cache[rows[:, None], position], c.v_cache[rows[:, None], position]

    i = xp.arange(c.seqlen_q)[None, :, None]
    diagonal = i + seqlen_k[:, None, None] - c.seqlen_q  # (batch, seqlen_q, 1)
    keep = j[:, None, :] < seqlen_k[:, None, None]  # (batch, 1, capacity), then (batch, seqlen_q, capacity)
    left, right = c.window_size
    if c.causal:
        right = 0
    if left >= 0:
        keep = keep & (j[:, None, :] >= diagonal - left)
    if right >= 0:
        keep = keep & (j[:, None, :] <= diagonal + right)
    bias = xp.where(keep, np.float32(0), np.float32(-np.inf)).astype(np.float32)[:, None]  # (batch, 1, sq, cap)
    if c.alibi_slopes is not None:
        distance = xp.abs(diagonal - j[:, None, :]).astype(np.float32)[:, None]
        bias = bias - c.alibi_slopes[:, :, None, None] * distance

    q = c.q
    if c.rotary_cos is not None:
        positions = cache_len[:, None] + (xp.arange(c.seqlen_q)[None, :] if c.rotary_per_token else 0)
        q = _rotate(q, c.rotary_cos, c.rotary_sin, xp.minimum(positions, c.rotary_cos.shape[0] - 1), c.interleaved,
                    xp)
    out, lse = flash_attn_func(q, keys, values, softmax_scale=c.softmax_scale, softcap=c.softcap, bias=bias,
                               return_lse=True)
    if c.out is not None:
        c.out[...] = out
        out = c.out
    return out, lse


def _rotate(x, cos, sin, positions, interleaved, xp):
    """Rotary embedding of x (batch, seqlen, heads, headdim) at positions (batch, seqlen), in float32,
    rounded back to x's dtype (what the kernels do)."""
    half = cos.shape[1]
    c = cos.astype(np.float32)[positions][:, :, None, :]
    s = sin.astype(np.float32)[positions][:, :, None, :]
    y = x.astype(np.float32)
    if interleaved:
        x1, x2 = y[..., 0:2 * half:2], y[..., 1:2 * half:2]
    else:
        x1, x2 = y[..., :half], y[..., half:2 * half]
    r1, r2 = x1 * c - x2 * s, x1 * s + x2 * c
    if interleaved:
        y[..., 0:2 * half:2], y[..., 1:2 * half:2] = r1, r2
    else:
        y[..., :half], y[..., half:2 * half] = r1, r2
    return y.astype(x.dtype)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, out=None):
    """Attention of q against a KV cache, appending the new keys and values first (in place).

    flash-attn 2.8's ``flash_attn_with_kvcache``: the same arguments in the same order and the same
    semantics, so a call written for flash-attn runs unchanged (``out=`` is nbflash's, keyword-only).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim). Decoding is seqlen_q = 1 (or a few tokens for
            speculative decoding); any seqlen_q works.
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or with ``block_table``
            paged: (num_blocks, page_block_size, nheads_k, headdim), any page size. q's dtype
            (float16, bfloat16 or float32); nheads a multiple of nheads_k (GQA / MQA).
        k, v: None, or the new tokens (batch, seqlen_new, nheads_k, headdim): written into the cache
            at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (after rotary
            embedding, for k), before the attention, which then sees them.
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2) in q's dtype, one row per
            cache position (seqlen_ro >= the cache's capacity; with causal or a window also one
            for each position cache_seqlens + i a query token reaches, checked when cache_seqlens
            is an int: with lengths on the GPU a position past the table takes its last row), with
            k and v: the first
            rotary_dim dims of the new k and of q are rotated. The new token t sits at position
            cache_seqlens[b] + t; query token i at cache_seqlens[b] + i with causal or a window,
            else at cache_seqlens[b] (flash-attn's convention). Computed in float32, stored in
            q's dtype.
        cache_seqlens: None (every cache is full), an int, or int32 (batch,) on the GPU: the tokens
            in each cache before this call.
        cache_batch_idx: None, or int32 (batch,): the cache row (k_cache.shape[0]) of each sequence
            (contiguous caches only).
        cache_leftpad: None, or int32 (batch,): the first cache position of each sequence; the
            keys before it are not attended.
        block_table: None, or int32 (batch, max_num_blocks_per_seq): the pages of each sequence in
            order (page p of sequence b is k_cache[block_table[b, p]]).
        softmax_scale, causal, window_size, softcap, alibi_slopes: as ``flash_attn_func``, with
            sequence b's key count seqlen_k = cache_seqlens[b] + seqlen_new - cache_leftpad[b]
            (the causal mask and windows are aligned to each sequence's last key).
        rotary_interleaved: True: rotate the pairs (x[2d], x[2d + 1]) (GPT-J); False: the pairs
            (x[d], x[d + rotary_dim / 2]) (GPT-NeoX).
        num_splits: 0 picks how many parts the keys are split into (thread blocks working on one
            sequence and head, merged by their log-sum-exps) to fill the GPU; n > 0 forces n (1:
            no split; at most 128). The result is the same up to rounding.
        return_softmax_lse: also return the log-sum-exp, float32 (batch, nheads, seqlen_q), natural log.
        out: (nbflash) an array of q's shape and dtype to write the output into.

    Lengths are checked on the host when they are known there (an int cache_seqlens): an append
    past the capacity is a ValueError. Lengths and block tables held on the GPU are not read back
    (no synchronization); the kernels then skip any write past the capacity or through a page
    index outside the cache, and read nothing there (such keys are not attended).

    Returns out, or (out, softmax_lse) with return_softmax_lse.
    """
    global _last_plan
    arrays = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
              alibi_slopes, out)
    key = _remember_key(arrays, cache_seqlens, (softmax_scale, causal, window_size, softcap, rotary_interleaved,
                                                num_splits, return_softmax_lse))
    plan = lengths = None
    if key is not None:
        plan = _last_plan
        if plan is None or plan.key != key:
            plan = _last_plan = _REMEMBERED.get(key)
        if plan is not None:
            lengths = plan.lengths(cache_seqlens)
    if lengths is None:
        c = _check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                   block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                   num_splits, return_softmax_lse, out)
        plan = _Plan(c, key)
        if key is not None:
            if len(_REMEMBERED) >= _REMEMBER_AT_MOST:
                _REMEMBERED.clear()
            _REMEMBERED[key] = _last_plan = plan
        arrays = (c.q, c.k_cache, c.v_cache, c.k, c.v, c.rotary_cos, c.rotary_sin, c.cache_batch_idx,
                  c.cache_leftpad, c.block_table, c.alibi_slopes, c.out)
        lengths = (c.fixed_len, c.cache_seqlens)
    out, lse = plan.run(arrays, *lengths, return_softmax_lse)
    return (out, lse) if return_softmax_lse else out


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """The attention output over the union of two disjoint key sets, from each set's output and
    log-sum-exp (cascade attention: a shared prefix attended once, each suffix apart).

    out_a, out_b: (batch, seqlen_q, nheads, headdim), one dtype; lse_a, lse_b: float32
    (batch, nheads, seqlen_q), natural log, as ``flash_attn_func(..., return_lse=True)`` and
    ``flash_attn_with_kvcache(..., return_softmax_lse=True)`` return them. A row with lse -inf
    (no key) has weight 0. Returns (out, lse), lse = log(exp(lse_a) + exp(lse_b)).
    """
    out_a = validation.as_backend_array(out_a, "out_a")
    validation._check_layout(out_a, "out_a", "(batch, seqlen_q, nheads, headdim)")
    dtype = dtype_name(out_a.dtype)
    if dtype is None:
        raise TypeError(f"out_a.dtype={out_a.dtype} is not supported; expected float16, bfloat16 or float32")
    batch, seqlen_q, nheads, _ = out_a.shape
    out_b = _same_array_kind(out_b, "out_b", out_a, "out_a", out_a.shape)
    validation._check_layout(out_b, "out_b", "(batch, seqlen_q, nheads, headdim)")
    lse_shape = (batch, nheads, seqlen_q)
    lse_a = validation.as_backend_array(lse_a, "lse_a")
    lse_b = validation.as_backend_array(lse_b, "lse_b")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.dtype != np.float32:
            raise TypeError(f"{name}.dtype={x.dtype} must be float32")
        if tuple(x.shape) != lse_shape:
            raise ValueError(f"{name} must have shape (batch, nheads, seqlen_q) = {lse_shape}, got {tuple(x.shape)}")
    device = 0 if runtime.SIMULATOR else out_a.data.device_id
    out, lse = launch.empty_pair(out_a.shape, out_a.dtype, lse_shape, FLOAT32)
    config = CombineConfig("merge", dtype)
    launch.compiled(config, device).launch(config.grid(batch, nheads, seqlen_q),
                                           (out_a, lse_a, out_b, lse_b, out, lse), ())
    return out, lse
