"""Block masks: which (query tile, key tile) pairs of a mask_mod are empty, partial or full.

FlexAttention's ``create_block_mask`` in nbflash's terms::

    doc = np.repeat(np.arange(4), 256)            # document ids of a packed sequence, a constant
    def same_document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx] and kv_idx <= q_idx
    block_mask = nbflash.create_block_mask(same_document, None, None, 1024, 1024)
    out = nbflash.flash_attn_func(q, k, v, block_mask=block_mask)

Each kernel walks its own tiles (the tensor-core forward 128 queries by 32 or 64 keys, the backward
64 by 64, the portable kernels smaller: nbflash/configs.py), so a ``BlockMask`` holds the mask_mod
and the shape, and classifies for a kernel's (block_m, block_n) the first time a kernel with those
tile sizes runs, on the GPU (``classes``), keeping the table for the next calls. A tile pair is
EMPTY when mask_mod keeps none of its elements inside the sequences (the kernels skip it: no loads,
no math), FULL when it keeps all of them (no mask test), PARTIAL otherwise (mask_mod is asked
element by element, as without a block mask). The table changes which work is done, never a value.
"""

import numbers

import numpy as np
from numba import cuda, int8, int32

from . import runtime
from .kernels.variants import EMPTY, FULL, PARTIAL, _device, user_function

__all__ = ["BlockMask", "create_block_mask", "EMPTY", "PARTIAL", "FULL"]


class BlockMask:
    """A mask_mod and the shape it is classified for (``create_block_mask`` makes one).

    ``batch`` and ``nheads`` are None where the mask broadcasts (mask_mod is then asked with
    b = 0 or h = 0, and its answer serves every batch row or head: FlexAttention's B=None, H=None).
    """

    def __init__(self, mask_mod, batch, nheads, seqlen_q, seqlen_k):
        self.fingerprint = user_function(mask_mod, "mask_mod")
        self.mask_mod = mask_mod
        self.batch, self.nheads = batch, nheads
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self._classes = {}  # (block_m, block_n) -> int8 (batch or 1, nheads or 1, m tiles, n tiles)

    @property
    def shape(self):
        """(B, H, seqlen_q, seqlen_k) as given, None for a broadcast dimension."""
        return self.batch, self.nheads, self.seqlen_q, self.seqlen_k

    def __repr__(self):
        return f"BlockMask({self.mask_mod.__qualname__}, shape={self.shape}, classified for {sorted(self._classes)})"

    def classes(self, block_m, block_n):
        """The class of every tile pair for tiles of ``block_m`` queries by ``block_n`` keys: an
        int8 array (B or 1, H or 1, cdiv(seqlen_q, block_m), cdiv(seqlen_k, block_n)) of EMPTY,
        PARTIAL, FULL, on the GPU (NumPy under the simulator). Classified on the first call for
        these tile sizes (the work is queued on CuPy's current stream), then kept."""
        key = (int(block_m), int(block_n))
        table = self._classes.get(key)
        if table is None:
            table = _classify(self, *key)
            self._classes[key] = table
        return table


def create_block_mask(mask_mod, B, H, seqlen_q, seqlen_k):
    """A ``BlockMask`` for ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = kept) over ``B``
    batch rows, ``H`` query heads, ``seqlen_q`` queries and ``seqlen_k`` keys.

    FlexAttention's ``create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN)``: B or H None means the
    mask does not depend on b (or h) and is shared by every batch row (or head). Pass it as
    ``flash_attn_func(q, k, v, block_mask=...)`` (and to the backward): tile pairs it keeps nothing
    of are skipped, tile pairs it keeps whole pay no mask test, and mask_mod is compiled into the
    kernels as with ``mask_mod=``. The classification runs on the GPU, per tile size a kernel
    needs, at the first call that needs it.
    """
    for name, value in (("B", B), ("H", H)):
        if value is not None and (not _is_int(value) or value < 1):
            raise TypeError(f"{name} must be a positive int, or None (the mask does not depend on it), got {value!r}")
    for name, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if not _is_int(value) or value < 1:
            raise TypeError(f"{name} must be a positive int, got {value!r}")
    return BlockMask(mask_mod, None if B is None else int(B), None if H is None else int(H), int(seqlen_q),
                     int(seqlen_k))


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def check_block_mask(block_mask, mask_mod, batch, nheads, seqlen_q, seqlen_k):
    """A call's block_mask against its shapes (and its mask_mod, if it also gave one): returns the
    mask_mod's fingerprint, or raises an error naming the argument and the fix."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask from nbflash.create_block_mask(mask_mod, B, H, seqlen_q, "
                        f"seqlen_k), got {type(block_mask).__name__}")
    if mask_mod is not None and user_function(mask_mod, "mask_mod") != block_mask.fingerprint:
        raise ValueError("mask_mod differs from block_mask's mask_mod; pass block_mask alone (it carries the "
                         "mask_mod it was made from)")
    for name, given, call in (("B", block_mask.batch, batch), ("H", block_mask.nheads, nheads)):
        if given is not None and given != call:
            raise ValueError(f"block_mask was made for {name}={given}, but the call has {call} "
                             f"({'batch' if name == 'B' else 'nheads'}); create it with {name}={call}, or "
                             f"{name}=None if the mask does not depend on {'b' if name == 'B' else 'h'}")
    for name, given, call in (("seqlen_q", block_mask.seqlen_q, seqlen_q), ("seqlen_k", block_mask.seqlen_k, seqlen_k)):
        if given != call:
            raise ValueError(f"block_mask was made for {name}={given}, but the call has {name}={call}; "
                             f"create it with create_block_mask(mask_mod, B, H, {seqlen_q}, {seqlen_k})")
    return block_mask.fingerprint


def kernel_params(problem, config):
    """``problem.params`` for the kernel of ``config``: the block mask (if any) as its class table
    for the config's tile sizes, viewed as (batch, nheads, m tiles, n tiles) (stride 0 where it
    broadcasts)."""
    params = problem.params
    if not problem.variant.block_mask:
        return params
    table = problem.block_mask.classes(config.block_m, config.block_n)
    xp = runtime.xp()
    view = xp.broadcast_to(table, (problem.batch, problem.nheads, *table.shape[2:]))
    index = problem.variant.param_names().index("block_mask")
    return params[:index] + (view,) + params[index + 1:]


# ---------------------------------------------------------------------------------------------------
# The classification kernel: one block per (key tile, query tile, batch row and head), one thread
# per query row of the tile
# ---------------------------------------------------------------------------------------------------

_CLASSIFIERS = {}


def _classifier(fingerprint, block_m, block_n):
    """The kernel classifying tiles of ``block_m`` x ``block_n`` for the mask_mod behind
    ``fingerprint`` (compiled once per mask_mod and tile size)."""
    key = (fingerprint, block_m, block_n)
    if key in _CLASSIFIERS:
        return _CLASSIFIERS[key]
    mask_mod = _device(fingerprint)
    BLOCK_M, BLOCK_N = block_m, block_n

    @cuda.jit
    def classify(classes, seqlen_q, seqlen_k):
        n_tile, m_tile = cuda.blockIdx.x, cuda.blockIdx.y
        b, h = cuda.blockIdx.z // classes.shape[1], cuda.blockIdx.z % classes.shape[1]
        row = m_tile * BLOCK_M + cuda.threadIdx.x
        kept = int32(0)  # ints: the barrier's OR takes an integer predicate
        dropped = int32(0)
        if row < seqlen_q:  # only elements inside the sequences count; the kernels mask the tails
            for key in range(n_tile * BLOCK_N, min(n_tile * BLOCK_N + BLOCK_N, seqlen_k)):
                if mask_mod(b, h, row, key):
                    kept = int32(1)
                else:
                    dropped = int32(1)
        any_kept = cuda.syncthreads_or(kept)  # every row of the tile has answered
        any_dropped = cuda.syncthreads_or(dropped)
        if cuda.threadIdx.x == 0:
            tile = FULL if not any_dropped else (PARTIAL if any_kept else EMPTY)
            classes[b, h, m_tile, n_tile] = int8(tile)

    _CLASSIFIERS[key] = classify
    return classify


def _classify(block_mask, block_m, block_n):
    from .interface import user_functions_compile
    from .problem import Variant

    batch, nheads = block_mask.batch or 1, block_mask.nheads or 1
    m_tiles, n_tiles = -(-block_mask.seqlen_q // block_m), -(-block_mask.seqlen_k // block_n)
    shape = (batch, nheads, m_tiles, n_tiles)
    if m_tiles > 65535 or batch * nheads > 65535:
        raise ValueError(f"block_mask's classification grid ({n_tiles}, {m_tiles}, {batch * nheads}) exceeds "
                         f"65535 in y or z; make the block mask with B=None / H=None where the mask allows")
    grid = (n_tiles, m_tiles, batch * nheads)
    kernel = _classifier(block_mask.fingerprint, block_m, block_n)
    with user_functions_compile(Variant(mask_mod=block_mask.fingerprint)):
        if runtime.SIMULATOR:
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            table = np.empty(shape, np.int8)
            kernel[grid, block_m](FakeCUDAArray(table), block_mask.seqlen_q, block_mask.seqlen_k)
            return table
        cupy = runtime.cupy()
        table = cupy.empty(shape, np.int8)
        stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)
        kernel[grid, block_m, stream](table, np.int32(block_mask.seqlen_q), np.int32(block_mask.seqlen_k))
        return table
