"""Hopper (sm_90a) primitives: fences, elect, setmaxnreg, named barriers, stmatrix, mbarriers, the
1-D bulk copy, 2-D TMA loads and stores, 4-D TMA loads, and wgmma (f16, bf16, and fp8: e4m3 / e5m2),
each as an inline-PTX intrinsic beside a plain-Python emulation.

As in ``nbflash.primitives`` (whose ``shared_address`` and ``global_address`` these take), the choice
between the two is made once, at import time, from ``numba.config.ENABLE_CUDASIM``; kernels import
the names from here and never ask which version they got. ``tests/test_primitives_sm90.py`` checks
the emulations against NumPy in the simulator and the intrinsics against the same checks on a GPU;
``scripts/check_sm90_ptx.py`` compiles every one of its kernels for sm_90a and runs ptxas on them.

The instructions are arch-specific: they assemble only for ``sm_90a`` (``compile_ptx(...,
cc=(9, 0, "a"))`` offline; Numba's dispatcher picks sm_90a by itself on a device of compute
capability 9.0) and run only on compute capability 9.0.

Addresses: a shared-memory operand is a 32-bit shared-window address (``shared_address(arr)`` plus a
byte offset), a global one an int64 (``global_address``). In the simulator both are host addresses,
and every emulated access is checked to lie inside an array handed to those functions.

Conventions of the simulator's emulation, beyond each docstring:

* The simulator runs each CUDA thread as a Python thread and one block at a time; emulated state
  (mbarriers, named barriers, warpgroup exchanges) is kept per block and dies with it.
* Asynchronous operations (the bulk copy, TMA, wgmma) complete at once; their waits then only
  check. So the emulation cannot catch a read of a wgmma result before its wait_group, or of a
  copied tile before its mbarrier phase; only the GPU can.
"""

import os
import threading

import numpy as np
from numba import cuda, int32, uint32, uint64

from . import primitives as _p
from .primitives import SIMULATOR

if SIMULATOR:
    _p._numpy_scalar_casts(globals())  # the casts below: NumPy's types, as in primitives.py

# Swizzle modes of a shared-memory matrix descriptor (bits 62-63).
SWIZZLE_NONE = 0
SWIZZLE_128B = 1
SWIZZLE_64B = 2
SWIZZLE_32B = 3

# Spins of mbarrier_wait before it traps. 0 waits forever, as production kernels do; a debug build
# sets NBFLASH_DEBUG_WAIT_SPINS so that a wrong byte count or parity traps instead of hanging the
# GPU. The emulated try_wait blocks for up to a millisecond, so the simulator's bound is ~10 s.
WAIT_SPIN_LIMIT = 10_000 if SIMULATOR else int(os.environ.get("NBFLASH_DEBUG_WAIT_SPINS", "0"))

# The alignment to declare on shared arrays that wgmma reads through a swizzled descriptor
# (``cuda.shared.array(n, uint16, alignment=TILE_ALIGNMENT)``): the swizzle pattern repeats every
# 1024 bytes and the descriptor's base offset is 0. The simulator refuses ``alignment`` and needs none
# (see smem_descriptor).
TILE_ALIGNMENT = None if SIMULATOR else 1024

# The alignment to declare on shared arrays that a 1-D bulk copy writes (bulk_copy_g2s): Numba aligns
# a shared array to its element size only, so a uint16 tile declared after an mbarrier word starts 8
# bytes off and the copy faults (misaligned address). TMA boxes need 128 (TILE_ALIGNMENT covers it).
# The emulation cannot see a missing declaration (host arrays are 16-byte aligned anyway);
# scripts/check_sm90_ptx.py checks the declarations in the compiled test kernels.
BULK_ALIGNMENT = None if SIMULATOR else 16

# wgmma's 8-bit float operand types (PTX names): m64nNk32, K-major operands, f32 accumulator.
_FP8 = ("e4m3", "e5m2")


# Operand images in shared memory that the descriptor can describe, as the wgmma emulation decodes
# them (16-bit elements; r is the M or N index, k the K index; byte offsets from the start address;
# a "core matrix" is 8 rows of 16 bytes):
#
#   K-major,  no swizzle:  (r % 8) 16 + (r // 8) SBO + (k // 8) LBO + (k % 8) 2
#   K-major,  128B:        (r % 8) 128 + (r // 8) SBO + 2 k, then the swizzle below (rows of 64 k)
#   MN-major, no swizzle:  (r % 8) 2 + (r // 8) SBO + (k % 8) 16 + (k // 8) LBO
#   MN-major, 128B:        (r % 64) 2 + (r // 64) LBO + (k % 8) 128 + (k // 8) SBO, then the swizzle
#
# The 128B swizzle XORs address bits 4-6 (the 16-byte chunk) with bits 7-9 (the 128-byte row) of the
# shared address itself, so a swizzled tile starts 1024-byte aligned (TILE_ALIGNMENT) and a k16
# step inside a 128-byte row just adds 32 bytes to the start. LBO is unused by K-major 128B (CUTLASS
# sets 16). The 64B and 32B swizzles are encoded but not emulated.
#
# 8-bit elements (fp8: e4m3, e5m2) are K-major only (wgmma cannot transpose them), with the same
# bytes: a core matrix is 8 rows of 16 k, a 128-byte row holds 128 k, so the K-major images above
# hold with (k // 16) LBO + (k % 16) (no swizzle) and k (128B) for the k terms, and a k32 step is the
# f16 k16 step's bytes (32 inside a swizzled row; 2 LBO without swizzle).


@cuda.jit(device=True, inline=True)
def descriptor_bits(window_address, leading_bytes, stride_bytes, swizzle):
    """The 64-bit wgmma shared-memory matrix descriptor: bits 0-13 the start address >> 4, 16-29 the
    leading-dimension byte offset (LBO) >> 4, 32-45 the stride byte offset (SBO) >> 4, 49-51 the
    base offset (0 here), 62-63 the swizzle mode (SWIZZLE_*). The start address is the tile's 32-bit
    shared-window address; adding ``uint64(offset >> 4)`` to a descriptor moves its start."""
    field = uint64(0x3FFF)
    return (((uint64(window_address) >> uint64(4)) & field)
            | (((uint64(leading_bytes) >> uint64(4)) & field) << uint64(16))
            | (((uint64(stride_bytes) >> uint64(4)) & field) << uint64(32))
            | ((uint64(swizzle) & uint64(3)) << uint64(62)))



@cuda.jit(device=True, inline=True)
def k_step(chunk_bytes, kk):
    """Descriptor increment (16-byte units) of k16 step ``kk`` of a K-major tile stored as 64-column
    chunks of ``chunk_bytes`` each (rows of 128 bytes, the 128B swizzle): 32 bytes along the rows
    within a chunk, the next chunk every four steps."""
    return uint64(((kk // 4) * chunk_bytes + (kk % 4) * 32) >> 4)


if SIMULATOR:
    import ctypes

    def _block():
        """The simulator's manager of the current thread's block, and the thread's linear id."""
        thread = threading.current_thread()
        return thread._manager, thread.thread_id

    def _block_state(name, make):
        manager, _ = _block()
        with _p._exchange_lock:
            state = manager.__dict__.get(name)
            if state is None:
                state = manager.__dict__[name] = make()
        return state

    def _group_collective(combine, value, size):
        """As primitives._warp_collective, over the ``size`` consecutive threads (a warpgroup: 128)
        holding this one: each posts ``value``, one runs ``combine`` on all of them in rank order,
        each gets its own entry back."""
        manager, thread_id = _block()
        group, rank = divmod(thread_id, size)
        with _p._exchange_lock:
            exchanges = manager.__dict__.setdefault(f"_nbflash_groups_{size}", {})
            exchange = exchanges.get(group)
            if exchange is None:
                block_threads = int(np.prod(manager._block_dim))
                if block_threads < size * (group + 1):
                    raise ValueError(f"a {size}-thread collective needs whole groups; the block has "
                                     f"{block_threads} threads")
                exchange = exchanges[group] = _p._WarpExchange(size)
        exchange.posted[rank] = (combine, value)
        exchange.arrived.wait()
        result = exchange.results[rank]
        exchange.read.wait()
        return result

    def _check_shared(addr, nbytes, align):
        addr = int(addr)
        if addr % align:
            raise ValueError(f"shared address {addr:#x} is not {align}-byte aligned")
        if not _p._shared_ranges.contains(addr, nbytes):
            raise IndexError(f"shared address {addr:#x} (+{nbytes}) is outside every shared array")
        return addr

    # --- stmatrix --------------------------------------------------------------------------------

    def _stmatrix_combine(posted):
        for i in range(4):
            for r in range(8):
                row = np.frombuffer(_p._shared_bytes(posted[8 * i + r][0], 16), dtype=np.uint32)
                row[:] = [posted[4 * r + t][1 + i] for t in range(4)]
        return [None] * 32

    def stmatrix_x4(addr, r0, r1, r2, r3):
        """stmatrix.x4 (ldmatrix's inverse), by a whole warp: four 8x8 matrices of 16-bit elements to
        shared memory. Lane 8 i + r gives the address (16-byte aligned) of row r of matrix i; register
        i of the lane with g = lane >> 2, t = lane & 3 holds M_i[g, 2t:2t+2] (the lower index in the
        low half): the layout of an mma accumulator's 8-column group packed to 16 bits, so a tile of
        packed scores goes out in one instruction per four such groups instead of one per register."""
        _p._warp_collective(_stmatrix_combine, (int(addr), int(r0), int(r1), int(r2), int(r3)))

    # --- Fences, elect, setmaxnreg ----------------------------------------------------------------

    def fence_proxy_async():
        """fence.proxy.async.shared::cta: order this thread's generic-proxy shared-memory writes
        before later async-proxy accesses (wgmma, bulk copies); goes after ``st.shared`` of
        operands and before the barrier that publishes them. Emulation: nothing (one proxy)."""

    def wgmma_fence():
        """wgmma.fence.sync.aligned: order prior register and shared accesses before the next
        wgmma reads them (before the first wgmma, and after touching its accumulator or A
        registers). Warpgroup-wide. Nothing may write those registers between it and the wgmma:
        not a load of an A fragment, nor a copy the compiler makes (two accumulators started from
        the same values); ptxas then injects a warpgroup.arrive of its own (C7519 in its -v
        output). Emulation: nothing (wgmma completes at once)."""

    def elect_sync():
        """elect.sync with the full mask: 1 in one lane of the warp, 0 in the others. All 32 lanes
        must execute it. The hardware elects one lane, the same one for the same mask (the PTX ISA
        does not say which); the emulation elects lane 0."""
        _, thread_id = _block()
        return np.uint32(1 if thread_id % 32 == 0 else 0)

    def _check_maxnreg(count):
        if not (24 <= count <= 256 and count % 8 == 0):
            raise ValueError(f"setmaxnreg takes a multiple of 8 in [24, 256], not {count}")

    def setmaxnreg_inc(count):
        """setmaxnreg.inc.sync.aligned.u32 count: raise this warpgroup's register cap to ``count``
        (a literal multiple of 8 in [24, 256]); needs a register cap at kernel entry
        (``launch_bounds``). Emulation: checks ``count``, does nothing."""
        _check_maxnreg(count)

    def setmaxnreg_dec(count):
        """setmaxnreg.dec.sync.aligned.u32 count: lower this warpgroup's register cap (see
        setmaxnreg_inc). Emulation: checks ``count``, does nothing."""
        _check_maxnreg(count)

    def trap():
        """trap: abort the kernel (the emulation raises)."""
        raise RuntimeError("trap: the kernel aborted")

    # --- Named barriers -----------------------------------------------------------------------------
    # Ids 1..15 are the kernel's; id 0 is cuda.syncthreads's, which the emulation does not share.

    BARRIER_SECONDS = 600  # the emulated named barriers' bound on a wait (below)

    class _NamedBarriers:
        def __init__(self):
            self.cv = threading.Condition()
            self.count = {}
            self.arrived = {}
            self.generation = {}

        def arrive(self, barrier_id, count, wait):
            barrier_id, count = int(barrier_id), int(count)
            if not 1 <= barrier_id <= 15:
                raise ValueError(f"named barrier id {barrier_id} is not in 1..15 (0 is syncthreads')")
            if count <= 0 or count % 32:
                raise ValueError(f"named barrier thread count {count} is not a positive multiple of 32")
            with self.cv:
                if self.arrived.get(barrier_id, 0) and self.count[barrier_id] != count:
                    raise RuntimeError(f"named barrier {barrier_id}: count {count} while "
                                       f"{self.count[barrier_id]} threads are expected")
                self.count[barrier_id] = count
                generation = self.generation.setdefault(barrier_id, 0)
                self.arrived[barrier_id] = self.arrived.get(barrier_id, 0) + 1
                if self.arrived[barrier_id] == count:
                    self.arrived[barrier_id] = 0
                    self.generation[barrier_id] = generation + 1
                    self.cv.notify_all()
                elif wait:
                    # A bound, so that a deadlock fails rather than hangs; generous, as the emulation is
                    # slow: 256 threads' share of a bfloat16 headdim-128 step took over 60 s between
                    # the first and the last arrival on 2 cores (scripts/sanitize.py --case
                    # sm90_backward --small), as the warp exchange's 600 s allow in primitives.py
                    released = self.cv.wait_for(lambda: self.generation[barrier_id] != generation,
                                                timeout=BARRIER_SECONDS)
                    if not released:
                        raise RuntimeError(f"named barrier {barrier_id}: {self.arrived[barrier_id]} "
                                           f"of {count} threads arrived in {BARRIER_SECONDS} s")

    def named_barrier_sync(barrier_id, count):
        """bar.sync id, count: wait until ``count`` threads (a multiple of 32, whole warps) have
        arrived at barrier ``id`` (1..15; 0 is syncthreads'), counting this one; it also orders
        their shared-memory accesses. The hardware counts whole warps, so every lane of a warp
        should execute it. Emulation: a per-(block, id) counter of threads; a thread arriving
        while the count differs raises; waiting 60 s raises."""
        _block_state("_nbflash_named_barriers", _NamedBarriers).arrive(barrier_id, count, True)

    def named_barrier_arrive(barrier_id, count):
        """bar.arrive id, count: count this thread into barrier ``id`` (as named_barrier_sync) and
        go on without waiting: the producer's half of a producer/consumer hand-off."""
        _block_state("_nbflash_named_barriers", _NamedBarriers).arrive(barrier_id, count, False)

    # --- mbarrier ---------------------------------------------------------------------------------

    class _MBarrier:
        """An mbarrier's phase: arrivals still expected in it and transaction bytes outstanding."""

        def __init__(self, count):
            self.count = count
            self.pending = count
            self.tx = 0
            self.phase = 0

        def complete_if_done(self):
            if self.pending == 0 and self.tx == 0:
                self.phase += 1
                self.pending = self.count

    class _MBarriers:
        def __init__(self):
            self.cv = threading.Condition()
            self.barriers = {}

        def update(self, bar, step):
            addr = _check_shared(bar, 8, 8)
            with self.cv:
                barrier = self.barriers.get(addr)
                if barrier is None:
                    raise RuntimeError(f"mbarrier at {addr:#x} used before mbarrier_init")
                step(barrier)
                if barrier.pending < 0:
                    raise RuntimeError(f"mbarrier at {addr:#x}: more arrivals than its count "
                                       f"{barrier.count} in one phase")
                barrier.complete_if_done()
                self.cv.notify_all()

    def _mbarriers():
        return _block_state("_nbflash_mbarriers", _MBarriers)

    def mbarrier_init(bar, count):
        """mbarrier.init.shared::cta.b64 [bar], count: make the 8-byte-aligned 64-bit shared word at
        ``bar`` a barrier expecting ``count`` arrivals per phase, in phase 0 (an element of a uint64
        shared array is 8-byte aligned wherever it is declared: Numba aligns to the element size).
        One thread inits; a fence_mbarrier_init and a syncthreads publish it. Emulation: the
        barrier's state is a Python object keyed by the address (the word itself is not written)."""
        addr = _check_shared(bar, 8, 8)
        if not 1 <= int(count) < 1 << 20:
            raise ValueError(f"mbarrier arrival count {int(count)} is not in [1, 2**20)")
        state = _mbarriers()
        with state.cv:
            state.barriers[addr] = _MBarrier(int(count))

    def fence_mbarrier_init():
        """fence.mbarrier_init.release.cluster: make prior mbarrier_inits visible to the async
        proxy (bulk copies completing on them). Emulation: nothing."""

    def mbarrier_arrive(bar):
        """mbarrier.arrive.shared::cta.b64: one arrival on the barrier's current phase. The phase
        completes when all its arrivals are in and its transaction count is back to zero."""
        _mbarriers().update(bar, lambda b: setattr(b, "pending", b.pending - 1))

    def mbarrier_arrive_expect_tx(bar, nbytes):
        """mbarrier.arrive.expect_tx.shared::cta.b64: add ``nbytes`` to the current phase's
        expected transaction bytes (which bulk copies complete), then arrive."""

        def step(b):
            b.tx += int(nbytes)
            b.pending -= 1

        _mbarriers().update(bar, step)

    def _complete_tx(bar, nbytes):
        def step(b):
            b.tx -= int(nbytes)

        _mbarriers().update(bar, step)

    def mbarrier_try_wait_parity(bar, parity):
        """mbarrier.try_wait.parity.shared::cta.b64: 1 once the phase of parity ``parity`` (0 or 1)
        has completed (the barrier's current phase has the other parity), else 0 after a
        system-dependent time. Emulation: blocks up to 1 ms for a change before answering 0."""
        addr = _check_shared(bar, 8, 8)
        state = _mbarriers()
        with state.cv:
            barrier = state.barriers.get(addr)
            if barrier is None:
                raise RuntimeError(f"mbarrier at {addr:#x} waited on before mbarrier_init")

            def done():
                return barrier.phase % 2 != int(parity) % 2

            return np.uint32(1 if state.cv.wait_for(done, timeout=1e-3) else 0)

    # --- Bulk copy, global -> shared, completing on an mbarrier ---------------------------------

    def _check_bulk(what, nbytes, global_address):
        """A bulk copy's size (a positive multiple of 16) and global address (16-byte aligned, inside
        an array), as ints."""
        nbytes, address = int(nbytes), int(global_address)
        if nbytes <= 0 or nbytes % 16:
            raise ValueError(f"{what} of {nbytes} bytes: not a positive multiple of 16")
        if address % 16:
            raise ValueError(f"global address {address:#x} is not 16-byte aligned")
        if not _p._global_ranges.contains(address, nbytes):
            raise IndexError(f"global address {address:#x} (+{nbytes}) is outside every array")
        return nbytes, address

    def bulk_copy_g2s(dst, src_address, nbytes, bar):
        """cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], nbytes,
        [bar]: copy ``nbytes`` (a multiple of 16) from global address ``src_address`` (16-byte
        aligned; see primitives.global_address) to shared address ``dst`` (16-byte aligned: declare
        its array with ``alignment=BULK_ALIGNMENT``), asynchronously; the copy completes ``nbytes``
        transaction bytes on the mbarrier ``bar``, which must expect them
        (mbarrier_arrive_expect_tx) in the same phase. Issued by one thread. Emulation: an
        immediate copy, then the complete_tx."""
        nbytes, src = _check_bulk("bulk copy", nbytes, src_address)
        ctypes.memmove(_check_shared(dst, nbytes, 16), src, nbytes)
        _complete_tx(bar, nbytes)

    # --- TMA: 2-D tile loads through a tensor map ----------------------------------------------------
    # The emulated tensor map is nbflash's own: 16 uint64 words (the size of the driver's CUtensorMap)
    # holding a tag, the tensor's address, shape and row stride, the box and the swizzle.

    _TENSOR_MAP_TAG = 0x6E62_666C_746D_6170  # "nbfltmap"

    def _encode_tensor_map(x, box_rows, box_cols, swizzle):
        nd = np.asarray(x)
        words = np.zeros(16, dtype=np.uint64)
        words[:8] = [_TENSOR_MAP_TAG, nd.ctypes.data, nd.shape[0], nd.shape[1], nd.strides[0],
                     box_rows, box_cols, swizzle]
        low, high = np.lib.array_utils.byte_bounds(nd)
        _p._global_ranges.register(low, high)
        return words

    def array_address(arr):
        """The global address of ``arr[0]`` (of any array), as an int64: what tma_load_2d and
        fence_proxy_tensormap_acquire take for a tensor map."""
        nd = arr._item._ary if hasattr(arr, "_item") else arr
        low, high = np.lib.array_utils.byte_bounds(nd)
        _p._global_ranges.register(low, high)
        return np.int64(nd.ctypes.data)

    def fence_proxy_tensormap_acquire(tensor_map):
        """fence.proxy.tensormap::generic.acquire.sys [map], 128: make a tensor map written to
        global memory from the host (cudaMemcpy) visible to the tensor-map proxy before TMA reads
        it; once per thread that issues TMA with that map. Emulation: nothing."""

    def _tensor_map(address):
        """The tensor (a writable NumPy view), box shape and swizzle of the map at ``address``."""
        addr = int(address)
        if not _p._global_ranges.contains(addr, 128):
            raise IndexError(f"tensor map address {addr:#x} is outside every array")
        words = np.frombuffer((ctypes.c_uint8 * 128).from_address(addr), dtype=np.uint64)
        if int(words[0]) != _TENSOR_MAP_TAG:
            raise ValueError("not a tensor map made by make_tensor_map_2d")
        base, rows, cols, row_stride, box_rows, box_cols, swizzle = (int(w) for w in words[1:8])
        if swizzle == SWIZZLE_128B and box_cols * 2 != 128:
            raise NotImplementedError("the 128B swizzle emulation takes boxes of 128-byte rows")
        if swizzle not in (SWIZZLE_NONE, SWIZZLE_128B):
            raise NotImplementedError("TMA emulation: swizzle none or 128B")
        tensor = np.frombuffer((ctypes.c_uint8 * (rows * row_stride)).from_address(base), dtype=np.uint16)
        return tensor.reshape(rows, row_stride // 2)[:, :cols], box_rows, box_cols, swizzle

    def _box_window(tensor, box_rows, box_cols, c0, c1):
        """The part of the box at (row c1, column c0) inside the tensor: (box slice, tensor slice).
        The box's first column must be 16-byte aligned (c0 a multiple of 8 elements, negative
        allowed): the hardware faults otherwise (an illegal instruction), even where the box leaves
        the tensor."""
        c0, c1 = int(np.int32(c0)), int(np.int32(c1))
        if (2 * c0) % 16:
            raise ValueError(f"TMA innermost coordinate c0 = {c0} is not 16-byte aligned (a multiple "
                             "of 8 16-bit elements)")
        rows, cols = tensor.shape
        r_lo, r_hi = max(c1, 0), min(c1 + box_rows, rows)
        k_lo, k_hi = max(c0, 0), min(c0 + box_cols, cols)
        if r_lo >= r_hi or k_lo >= k_hi:
            return None, None
        return ((slice(r_lo - c1, r_hi - c1), slice(k_lo - c0, k_hi - c0)),
                (slice(r_lo, r_hi), slice(k_lo, k_hi)))

    def _chunk_order(box_rows, swizzle):
        """Where each 16-byte chunk of the box's row-major image lies in shared memory (chunk
        indices): the identity, or with the 128B swizzle chunk j of row r at j ^ (r % 8)."""
        r = np.arange(box_rows)[:, None]
        j = np.arange(8)[None, :]
        return (r * 8 + (j ^ (r % 8) if swizzle == SWIZZLE_128B else j)).reshape(-1)

    def tma_load_2d(dst, tensor_map, c0, c1, bar):
        """cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes
        [dst], [map, {c0, c1}], [bar]: copy the box of the tensor map (make_tensor_map_2d) whose
        first element is (row c1, column c0) -- c0 the innermost coordinate, in elements, and a
        multiple of 8 (the box's rows must start 16-byte aligned, else the GPU faults with an illegal
        instruction; c1 is free) -- to shared address ``dst`` (128-byte aligned; 1024 with the 128B
        swizzle), asynchronously, completing the full box's bytes on mbarrier ``bar`` even where the
        box leaves the tensor (those elements are zero). The box lands row after row; with
        SWIZZLE_128B (rows of exactly 128 bytes) the 16-byte chunk j of row r is stored at chunk
        j ^ (r % 8): the K-major 128B image wgmma reads. Issued by one thread. Emulation: an
        immediate copy (swizzled by offset from ``dst``), then the complete_tx; c0 is checked, but
        of ``dst`` only 16-byte alignment (simulator arrays cannot be aligned)."""
        tensor, box_rows, box_cols, swizzle = _tensor_map(tensor_map)
        box = np.zeros((box_rows, box_cols), dtype=np.uint16)
        inside, source = _box_window(tensor, box_rows, box_cols, c0, c1)
        if inside is not None:
            box[inside] = tensor[source]
        out = np.frombuffer(_p._shared_bytes(dst, box.nbytes), dtype=np.uint8)
        chunks = out.reshape(-1, 16)
        if swizzle == SWIZZLE_128B:
            chunks[_chunk_order(box_rows, swizzle)] = box.view(np.uint8).reshape(-1, 16)
        else:
            out[:] = box.view(np.uint8).reshape(-1)
        _complete_tx(bar, box.nbytes)

    # A 4-D map (make_tensor_map_4d) is tagged apart: the tensor's address, shape and byte strides
    # in the array's order, the box in the same order, and the swizzle.
    _TENSOR_MAP_4D_TAG = 0x6E62_666C_746D_3464  # "nbfltm4d"

    def _tensor_map_4d_words(x, box, swizzle):
        nd = np.asarray(x)
        words = np.zeros(16, dtype=np.uint64)
        words[:16] = [_TENSOR_MAP_4D_TAG, nd.ctypes.data, *nd.shape, *nd.strides, *box, swizzle, nd.itemsize]
        low, high = np.lib.array_utils.byte_bounds(nd)
        _p._global_ranges.register(low, high)
        return words

    def _tensor_map_4d(tensor_map):
        """The emulated 4-D map at device address ``tensor_map``: (base, shape, strides, box,
        swizzle, itemsize)."""
        addr = int(tensor_map)
        if not _p._global_ranges.contains(addr, 128):
            raise IndexError(f"tensor map address {addr:#x} is outside every array")
        words = [int(w) for w in np.frombuffer((ctypes.c_uint8 * 128).from_address(addr), dtype=np.uint64)]
        if words[0] != _TENSOR_MAP_4D_TAG:
            raise ValueError("not a tensor map made by make_tensor_map_4d")
        return words[1], words[2:6], words[6:10], words[10:14], words[14], words[15]

    def _mapped_array(tensor_map, dtype, c0, what):
        """(the array, box, swizzle) of the emulated 4-D map, its elements of ``dtype`` (checked),
        after the checks the hardware makes of a box at innermost coordinate c0."""
        base, shape, strides, box, swizzle, itemsize = _tensor_map_4d(tensor_map)
        dtype = np.dtype(dtype)
        if itemsize != dtype.itemsize:
            raise NotImplementedError(f"the TMA {what} emulation takes maps of {dtype} elements")
        if (itemsize * int(np.int32(c0))) % 16:
            raise ValueError(f"TMA innermost coordinate c0 = {int(c0)} is not 16-byte aligned (a multiple "
                             f"of {16 // itemsize} {8 * itemsize}-bit elements)")
        if swizzle == SWIZZLE_128B and box[3] * itemsize != 128:
            raise NotImplementedError("the 128B swizzle emulation takes boxes of 128-byte rows")
        if swizzle not in (SWIZZLE_NONE, SWIZZLE_128B):
            raise NotImplementedError("TMA emulation: swizzle none or 128B")
        span = sum((n - 1) * st for n, st in zip(shape, strides)) + itemsize
        flat = np.frombuffer((ctypes.c_uint8 * span).from_address(base), dtype=dtype)
        return np.lib.stride_tricks.as_strided(flat, shape, strides), box, swizzle

    def _box_slices(start, box, shape):
        """(inside the box, inside the tensor) slices of a box at ``start`` (x's order), clipped."""
        inside, source = [], []
        for lo, n, extent in zip(start, box, shape):
            a, z = max(lo, 0), min(lo + n, extent)
            inside.append(slice(a - lo, max(z, a) - lo))
            source.append(slice(a, max(z, a)))
        return tuple(inside), tuple(source)

    def tma_reduce_add_4d(tensor_map, c0, c1, c2, c3, src):
        """cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [map, {c0, c1, c2,
        c3}], [src]: add the box image at shared address ``src`` (laid out, and swizzled, as
        tma_load_4d leaves a box) element by element into the float32 array of the map
        (make_tensor_map_4d of a float32 array) at x[c3, c2, c1, c0], c0 innermost (a multiple of 4
        elements: 16 bytes); elements past the array's ends are not added. Every coordinate must be
        0 or more: a box starting before the array (a negative coordinate, innermost or not)
        faulted on the H200 (illegal instruction, ending the context), where loads and stores take
        one; the emulation raises. Each element's addition is
        atomic (other blocks may add to the same elements), their order unspecified. Asynchronous,
        in this thread's bulk group, as tma_store_2d: tma_store_commit closes the group,
        tma_store_wait(n) waits for its reads of shared memory. Write the tile with ordinary stores,
        then fence_proxy_async and a barrier, then one thread issues. Emulation: an immediate
        addition."""
        tensor, box, swizzle = _mapped_array(tensor_map, np.float32, c0, "reduce-add")
        corner = [int(np.int32(c)) for c in (c3, c2, c1, c0)]
        if min(corner) < 0:
            raise ValueError(f"tma_reduce_add_4d at (c0, c1, c2, c3) = {tuple(corner[::-1])}: a negative "
                             "coordinate (the GPU faults: illegal instruction)")
        image = np.frombuffer(_p._shared_bytes(src, int(np.prod(box)) * 4), dtype=np.uint8).reshape(-1, 16)
        if swizzle == SWIZZLE_128B:
            image = image[_chunk_order(image.shape[0] // 8, swizzle)]
        values = image.reshape(-1).view(np.float32).reshape(box)
        inside, target = _box_slices(corner, box, tensor.shape)
        tensor[target] += values[inside]

    def tma_load_4d(dst, tensor_map, c0, c1, c2, c3, bar):
        """cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes
        [dst], [map, {c0, c1, c2, c3}], [bar]: as tma_load_2d for a map of a 4-D array x
        (make_tensor_map_4d), the coordinates innermost first: the box whose first element is
        x[c3, c2, c1, c0] (c0 a multiple of 8). The box lands in x's order, its last dimension
        innermost, zero where it leaves the array; with SWIZZLE_128B its innermost extent is 128
        bytes and each 128-byte row of the image is swizzled as in tma_load_2d. Emulation: an
        immediate copy, then the complete_tx."""
        tensor, box, swizzle = _mapped_array(tensor_map, np.uint16, c0, "load")
        shape = tensor.shape
        image = np.zeros(box, dtype=np.uint16)
        inside, source = _box_slices([int(np.int32(c)) for c in (c3, c2, c1, c0)], box, shape)
        image[inside] = tensor[source]
        out = np.frombuffer(_p._shared_bytes(dst, image.nbytes), dtype=np.uint8)
        if swizzle == SWIZZLE_128B:
            rows = image.size // 64
            out.reshape(-1, 16)[_chunk_order(rows, swizzle)] = image.view(np.uint8).reshape(-1, 16)
        else:
            out[:] = image.view(np.uint8).reshape(-1)
        _complete_tx(bar, image.nbytes)

    def tma_store_4d(tensor_map, c0, c1, c2, c3, src):
        """cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [map, {c0, c1, c2, c3}], [src]:
        the inverse of tma_load_4d: write the box image at shared address ``src`` (laid out, and
        swizzled, as tma_load_4d leaves a box) to the 16-bit array of the map (make_tensor_map_4d)
        at x[c3, c2, c1, c0] on, c0 innermost (a multiple of 8 elements: 16 bytes); elements past
        the array's ends are not written, so a box over a tile's tail rows writes only the rows
        inside. Asynchronous, in this thread's bulk group, as tma_store_2d: tma_store_commit closes
        the group, tma_store_wait(0) waits until its reads of shared memory are done. Write the
        tile with ordinary stores, then fence_proxy_async and a barrier, then one thread stores.
        Emulation: an immediate copy."""
        tensor, box, swizzle = _mapped_array(tensor_map, np.uint16, c0, "store")
        image = np.frombuffer(_p._shared_bytes(src, int(np.prod(box)) * 2), dtype=np.uint8).reshape(-1, 16)
        if swizzle == SWIZZLE_128B:
            image = image[_chunk_order(image.shape[0] // 8, swizzle)]
        values = image.reshape(-1).view(np.uint16).reshape(box)
        inside, target = _box_slices([int(np.int32(c)) for c in (c3, c2, c1, c0)], box, tensor.shape)
        tensor[target] = values[inside]

    def tma_store_2d(tensor_map, c0, c1, src):
        """cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [map, {c0, c1}], [src]: the
        inverse of tma_load_2d: write the box image at shared address ``src`` (laid out, and
        swizzled, as tma_load_2d leaves it) to the tensor at (row c1, column c0; c0 a multiple of 8,
        as for the load); elements outside the tensor are not written. Asynchronous, in this
        thread's bulk group: tma_store_commit closes the group, tma_store_wait(0) waits until its
        reads of shared memory are done (before the tile is overwritten) -- and, for other blocks or
        the host to see the writes, the kernel's end. Write the tile with ordinary stores, then
        fence_proxy_async and a barrier, then one thread stores. Emulation: an immediate copy."""
        tensor, box_rows, box_cols, swizzle = _tensor_map(tensor_map)
        nbytes = box_rows * box_cols * 2
        image = np.frombuffer(_p._shared_bytes(src, nbytes), dtype=np.uint8).reshape(-1, 16)
        if swizzle == SWIZZLE_128B:
            image = image[_chunk_order(box_rows, swizzle)]
        box = image.reshape(-1).view(np.uint16).reshape(box_rows, box_cols)
        inside, target = _box_window(tensor, box_rows, box_cols, c0, c1)
        if inside is not None:
            tensor[target] = box[inside]

    def bulk_reduce_add_f32(dst_address, src, nbytes):
        """cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [dst], [src], nbytes: add the
        ``nbytes`` (a positive multiple of 16) of float32 at shared address ``src`` (16-byte aligned)
        element by element into those at global address ``dst_address`` (16-byte aligned; see
        primitives.global_address). A contiguous run, no tensor map: one row of a row-major array.
        Each element's addition is atomic (other blocks may add to the same elements), their order
        unspecified. Asynchronous, in this thread's bulk group, as tma_store_2d: tma_store_commit
        closes the group, tma_store_wait(n) waits for its reads of shared memory. Write the source
        with ordinary stores, then fence_proxy_async, then hand it to the issuing thread (an
        mbarrier or a barrier). Emulation: an immediate addition."""
        nbytes, dst = _check_bulk("bulk reduce-add", nbytes, dst_address)
        values = np.frombuffer(_p._shared_bytes(_check_shared(src, nbytes, 16), nbytes), dtype=np.float32).copy()
        target = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(dst), dtype=np.float32)
        with _p._reduction_lock:
            target += values

    def store_shared_u32(addr, value):
        """st.shared.u32 [addr], value: one 32-bit word to a 4-byte aligned shared address, by the
        address itself (a kernel's tile offsets), not through an array's 64-bit element index."""
        (ctypes.c_uint32).from_address(_check_shared(addr, 4, 4)).value = int(value) & 0xFFFFFFFF

    def store_shared_f32x4(addr, a, b, c, d):
        """st.shared.v4.f32 [addr], {a, b, c, d}: four float32 to a 16-byte aligned shared address,
        one store (a warp's 32 lanes, 512 bytes, in the minimum four passes where they are
        contiguous)."""
        words = (ctypes.c_float * 4).from_address(_check_shared(addr, 16, 16))
        words[0], words[1], words[2], words[3] = np.float32(a), np.float32(b), np.float32(c), np.float32(d)

    def tma_store_commit():
        """cp.async.bulk.commit_group: close this thread's group of TMA stores (emulation: nothing)."""

    def tma_store_wait(pending):
        """cp.async.bulk.wait_group.read N: wait until at most ``pending`` (a literal) of this
        thread's store groups still read shared memory (emulation: nothing; stores were
        immediate)."""

    def bulk_wait(pending):
        """cp.async.bulk.wait_group N (without .read): wait until at most ``pending`` (a literal) of
        this thread's bulk groups are incomplete, their writes to global memory done and visible to
        this thread (a reduce-add's additions made), not only their reads of shared memory
        (emulation: nothing; the operations were immediate)."""

    def fence_proxy_async_global():
        """fence.proxy.async.global: order this thread's async-proxy global accesses (its completed
        bulk reduce-adds) with its later generic-proxy ones, such as the release that publishes
        them to other blocks. Emulation: nothing (one proxy)."""

    # --- Shared-memory matrix descriptors: an emulated shared window --------------------------------
    # The descriptor holds 14 bits of address, which cannot name a host address. So the emulation
    # gives each shared array a descriptor touches a place in an emulated shared window of the block,
    # 1024-byte aligned (what TILE_ALIGNMENT asks of the GPU), and the descriptor carries the window
    # address exactly as the hardware's would; the wgmma emulation maps it back. The swizzle is
    # applied to window addresses, as the hardware applies it to shared addresses. An array's place
    # is fixed by the first descriptor that points into it.

    class _Window:
        def __init__(self):
            self.lock = threading.Lock()
            self.entries = []  # (host_low, host_high, window_low)
            self.end = 1024

        def to_window(self, host):
            with self.lock:
                for low, high, window in self.entries:
                    if low <= host < high:
                        return window + host - low
                with _p._shared_ranges._lock:
                    found = [(low, high) for low, high in _p._shared_ranges._ranges.items()
                             if low <= host < high]
                if not found:
                    raise IndexError(f"shared address {host:#x} is outside every shared array")
                low, high = found[-1]
                window = self.end
                self.end = window + (high - low + 1023) // 1024 * 1024
                if self.end > 1 << 18:
                    raise MemoryError("the emulated shared window exceeds 256 KiB")
                self.entries.append((low, high, window))
                return window + host - low

        def to_host(self, window_addresses, esize=2):
            """Host addresses of an array of window addresses of ``esize``-byte elements, all in one
            array's place."""
            lo, hi = int(window_addresses.min()), int(window_addresses.max()) + esize
            with self.lock:
                for low, high, window in self.entries:
                    if window <= lo and hi <= window + high - low:
                        return window_addresses - window + low
            raise IndexError(f"a descriptor reads window bytes [{lo:#x}, {hi:#x}) outside every "
                             "shared array")

    def _window():
        return _block_state("_nbflash_window", _Window)

    def tile_base(window_address):
        """Where a kernel's swizzled tiles start: the array's own address, which the emulated shared
        window (``_Window``) already places on a 1024-byte boundary."""
        return window_address

    def smem_descriptor(address, leading_bytes, stride_bytes, swizzle):
        """The wgmma descriptor (see descriptor_bits) of the tile at shared address ``address``.
        Emulation: the address is first placed in the block's emulated shared window (see above)."""
        return descriptor_bits(_window().to_window(int(address)), leading_bytes, stride_bytes, swizzle)

    # --- wgmma ------------------------------------------------------------------------------------

    _TID = np.arange(128)
    _ROW_BASE = 16 * (_TID // 32) + ((_TID % 32) >> 2)  # 16 w + g
    _Q = (_TID % 32) & 3

    def _acc_coords(n):
        """(row, col) of accumulator register r for every thread: arrays of shape (128, n // 2)."""
        r = np.arange(n // 2)
        rows = _ROW_BASE[:, None] + 8 * ((r[None, :] // 2) % 2)
        cols = 8 * (r[None, :] // 4) + 2 * _Q[:, None] + r[None, :] % 2
        return rows, cols

    def _operand_offsets(rows, cols_k, desc, mn_major, esize=2):
        """Window byte addresses of the elements (rows[i], cols_k[j]) of an operand described by
        ``desc``: K-major (k contiguous) or MN-major (the row index contiguous; 16-bit only), of
        ``esize``-byte elements."""
        d = int(desc)
        start = (d & 0x3FFF) << 4
        lbo = ((d >> 16) & 0x3FFF) << 4
        sbo = ((d >> 32) & 0x3FFF) << 4
        swizzle = (d >> 62) & 3
        if (d >> 49) & 7:
            raise NotImplementedError("wgmma emulation: descriptor base offset must be 0")
        r = rows[:, None]
        k = cols_k[None, :]
        if swizzle == SWIZZLE_NONE:
            if mn_major:  # 8x8 core matrices of 8 consecutive r (16 bytes) per k
                off = (r // 8) * sbo + (k // 8) * lbo + (k % 8) * 16 + (r % 8) * 2
            else:  # core matrices of 8 r by 16 bytes of consecutive k
                per_chunk = 16 // esize
                off = (r // 8) * sbo + (r % 8) * 16 + (k // per_chunk) * lbo + (k % per_chunk) * esize
        elif swizzle == SWIZZLE_128B:
            if mn_major:  # 128-byte rows of 64 consecutive r, one per k; 8 k rows per 1024 bytes
                off = (r // 64) * lbo + (k // 8) * sbo + (k % 8) * 128 + (r % 64) * 2
            else:  # 128-byte rows of consecutive k, one per r; 8 r rows per 1024 bytes
                off = (r // 8) * sbo + (r % 8) * 128 + k * esize
        else:
            raise NotImplementedError("wgmma emulation: swizzle modes 64B and 32B are not modelled")
        addr = start + off
        if swizzle == SWIZZLE_128B:  # 16-byte chunk index (bits 4-6) ^= 128-byte row (bits 7-9)
            addr = addr ^ (((addr >> 7) & 7) << 4)
        return addr

    def _read_operand(desc, nrows, mn_major, decode, esize=2):
        """The (nrows, k) operand of one wgmma: k = 16 16-bit or 32 8-bit elements."""
        addr = _operand_offsets(np.arange(nrows), np.arange(32 // esize), desc, mn_major, esize)
        if addr.min() % esize:
            raise ValueError("wgmma operand addresses must be 2-byte aligned")
        host = _window().to_host(addr, esize)
        lo = int(host.min())
        span = int(host.max()) + esize - lo
        raw = np.frombuffer((ctypes.c_uint8 * span).from_address(lo), dtype=np.uint8)
        if esize == 1:
            return decode(raw[host - lo])
        bits = raw[host - lo].astype(np.uint16) | (raw[host - lo + 1].astype(np.uint16) << 8)
        return decode(bits)  # (nrows, 16)

    def _uniform(posted, index, what):
        value = posted[0][index]
        if any(p[index] != value for p in posted):
            raise ValueError(f"wgmma: {what} differs between the warpgroup's threads")
        return value

    def _finish(n, posted, a, b, scale_d):
        """D = A B (+ C) with A (64, 16) and B as (n, 16), returned as every thread's fragment."""
        rows, cols = _acc_coords(n)
        c = np.asarray([[float(x) for x in p[-1]] for p in posted], dtype=np.float64)
        d = a @ b.T  # float64: exact for f16/bf16 (16 terms) and fp8 (32 terms) up to the final rounding
        out = d[rows, cols]
        if scale_d:
            out = out + c
        out = out.astype(np.float32)
        return [tuple(out[t]) for t in range(128)]

    def _decode(ab):
        if ab in _FP8:
            import ml_dtypes

            fp8 = ml_dtypes.float8_e4m3fn if ab == "e4m3" else ml_dtypes.float8_e5m2
            return lambda bits: np.asarray(bits, dtype=np.uint8).view(fp8).astype(np.float64)
        return _p._decode_f16 if ab == "f16" else _p._decode_bf16

    def _make_wgmma_ss(n, ab, trans_b, trans_a=0):
        decode, esize = _decode(ab), 1 if ab in _FP8 else 2

        def combine(posted):
            a = _read_operand(_uniform(posted, 0, "desc_a"), 64, bool(trans_a), decode, esize)
            b = _read_operand(_uniform(posted, 1, "desc_b"), n, bool(trans_b), decode, esize)
            return _finish(n, posted, a, b, int(_uniform(posted, 2, "scale_d")))

        def wgmma(acc, desc_a, desc_b, scale_d):
            if len(acc) != n // 2:
                raise ValueError(f"m64n{n} takes {n // 2} accumulator registers, not {len(acc)}")
            return _group_collective(combine, (int(desc_a), int(desc_b), int(scale_d), acc), 128)

        return wgmma

    def _a_fragment_coords(ab):
        """(row, k) of each element of the RS form's A registers for every thread, in register order
        and, within a register, from the low bits up: arrays of shape (128, 8) for 16-bit elements
        (the accumulator's layout at n = 16), (128, 16) for 8-bit ones (register j: row 16 w + g +
        8 (j % 2), k 16 (j // 2) + 4 q + byte)."""
        if ab not in _FP8:
            return _acc_coords(16)
        j, byte = np.arange(16) // 4, np.arange(16) % 4
        rows = _ROW_BASE[:, None] + 8 * (j[None, :] % 2)
        cols = 16 * (j[None, :] // 2) + 4 * _Q[:, None] + byte[None, :]
        return rows, cols

    def _make_wgmma_rs(n, ab, trans_b):
        decode, fp8 = _decode(ab), ab in _FP8
        rows, cols = _a_fragment_coords(ab)

        def combine(posted):
            regs = np.asarray([p[:4] for p in posted], dtype=np.uint32)
            if fp8:  # (128, 4, 4): four bytes a register, the lowest first
                parts = np.stack([(regs >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)], axis=2)
                a = np.zeros((64, 32))
                a[rows, cols] = decode(parts.reshape(128, 16).astype(np.uint8))
            else:  # (128, 4, 2): two halves a register, the low one first
                halves = np.stack([regs & np.uint32(0xFFFF), regs >> np.uint32(16)], axis=2)
                a = np.zeros((64, 16))
                a[rows, cols] = decode(halves.reshape(128, 8).astype(np.uint16))
            b = _read_operand(_uniform(posted, 4, "desc_b"), n, bool(trans_b), decode, 1 if fp8 else 2)
            return _finish(n, posted, a, b, int(_uniform(posted, 5, "scale_d")))

        def wgmma(acc, a0, a1, a2, a3, desc_b, scale_d):
            if len(acc) != n // 2:
                raise ValueError(f"m64n{n} takes {n // 2} accumulator registers, not {len(acc)}")
            return _group_collective(
                combine, (int(a0), int(a1), int(a2), int(a3), int(desc_b), int(scale_d), acc), 128)

        return wgmma

    def pack_e4m3x4(x0, x1, x2, x3):
        """Four float32 rounded to e4m3 (nearest even, saturating to +-448; NaN stays NaN), packed
        in one uint32 with ``x0`` in the low byte: an fp8 A register of the RS wgmma
        (cvt.rn.satfinite.e4m3x2.f32, twice)."""
        import ml_dtypes

        x = np.clip(np.array([x0, x1, x2, x3], dtype=np.float32), -448.0, 448.0)  # NaN passes through
        b = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.uint32)
        return np.uint32(int(b[0]) | (int(b[1]) << 8) | (int(b[2]) << 16) | (int(b[3]) << 24))

    def wgmma_commit():
        """wgmma.commit_group.sync.aligned: close the group of wgmmas issued since the last commit.
        Emulation: nothing (they completed)."""

    def wgmma_wait(pending):
        """wgmma.wait_group.sync.aligned N: wait until at most ``pending`` (a literal) committed
        groups are in flight; only then are their accumulators (and shared operands) free to touch.
        Emulation: nothing."""

    def fence_operands(values):
        """Pass a tuple of registers (float32 or uint32) through an empty volatile asm, so the
        compiler cannot move their producers below it or their users above it (pin an accumulator
        around wgmma_fence / wgmma_wait). Emulation: the identity."""
        return values

    def copy_operands(values):
        """A tuple of registers (float32 or uint32) copied into others by a volatile asm (one mov
        each): values a wgmma wrote, taken out of its accumulator right after the wgmma_wait that
        covers it, to be kept past the next wgmma's issue. Read from the accumulator itself after
        another wgmma is issued (in a later step of a loop), ptxas cannot tell which wait covers
        them and serializes every wgmma of the kernel (C7519 in its -v output). Emulation: the
        identity."""
        return values

    def registers_from(arr, count):
        """A UniTuple of the first ``count`` (a literal) elements of the 1-D array ``arr``: the form
        an accumulator or an A fragment takes (a register tuple), from a local or global array."""
        return tuple(arr[i] for i in range(count))

    def registers_to(arr, values):
        """Store a register tuple into the first elements of the 1-D array ``arr``."""
        for i, value in enumerate(values):
            arr[i] = value

else:
    # The intrinsics. Their contracts are the docstrings of the emulations above (and of the
    # wgmma factories below); each instruction is one _ptx line.
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _CONSTRAINT = {types.uint32: "r", types.int32: "r", types.uint64: "l", types.int64: "l",
                   types.float32: "f"}

    @cuda.jit(device=True, inline=True)
    def tile_base(window_address):
        """The first 1024-byte boundary at or past ``window_address`` (a 32-bit shared-window
        address): where a kernel's swizzled tiles start in its dynamic shared memory, which the
        launch sizes with 1024 bytes of slack for this (TILE_ALIGNMENT's reason)."""
        return window_address + ((uint32(1024) - (window_address & uint32(1023))) & uint32(1023))

    def _with_arity(n, typer):
        """``typer(typingctx, args)`` as a typer of n named arguments: Numba lowers an intrinsic
        with ``*args`` as one tuple argument."""
        params = "".join(f", a{i}" for i in range(n))
        namespace = {"typer": typer}
        exec(f"def fixed(typingctx{params}):\n    return typer(typingctx, ({params[2:]}{',' if n == 1 else ''}))",
             namespace)
        return namespace["fixed"]

    def _ptx(text, operands=(), result=None):
        """An intrinsic that emits the PTX ``text`` (volatile, clobbering memory): ``operands`` the
        Numba types of its inputs, ``result`` that of its one output ($0; inputs follow) or None."""
        outputs = [] if result is None else ["=" + _CONSTRAINT[result]]
        constraints = ",".join(outputs + [_CONSTRAINT[t] for t in operands] + ["~{memory}"])
        ret = types.void if result is None else result

        def typer(typingctx, args):
            sig = ret(*operands)

            def codegen(context, builder, signature, llargs):
                lltype = ir.VoidType() if result is None else context.get_value_type(result)
                ftype = ir.FunctionType(lltype, [a.type for a in llargs])
                value = builder.asm(ftype, text, constraints, list(llargs), True)
                return context.get_dummy_value() if result is None else value

            return sig, codegen

        return intrinsic(_with_arity(len(operands), typer))

    def _ptx_literal(template, check):
        """As _ptx with no operands, for an instruction with one immediate: the intrinsic takes a
        compile-time integer, ``check``s it and formats it into ``template``."""

        def typer(typingctx, n):
            if not isinstance(n, types.IntegerLiteral):
                return None
            value = int(n.literal_value)
            check(value)
            text = template.format(value)

            def codegen(context, builder, signature, llargs):
                ftype = ir.FunctionType(ir.VoidType(), [])
                builder.asm(ftype, text, "~{memory}", [], True)
                return context.get_dummy_value()

            return types.void(n), codegen

        return intrinsic(typer)

    def _check_maxnreg(count):
        if not (24 <= count <= 256 and count % 8 == 0):
            raise ValueError(f"setmaxnreg takes a multiple of 8 in [24, 256], not {count}")

    def _check_pending(count):
        if not 0 <= count <= 7:
            raise ValueError(f"a wait_group takes 0..7 pending groups, not {count}")

    u32, u64, i64 = types.uint32, types.uint64, types.int64

    fence_proxy_async = _ptx("fence.proxy.async.shared::cta;")
    wgmma_fence = _ptx("wgmma.fence.sync.aligned;")
    wgmma_commit = _ptx("wgmma.commit_group.sync.aligned;")
    wgmma_wait = _ptx_literal("wgmma.wait_group.sync.aligned {};", _check_pending)
    elect_sync = _ptx("{ .reg .pred p; elect.sync _|p, 0xffffffff; selp.u32 $0, 1, 0, p; }", result=u32)
    setmaxnreg_inc = _ptx_literal("setmaxnreg.inc.sync.aligned.u32 {};", _check_maxnreg)
    setmaxnreg_dec = _ptx_literal("setmaxnreg.dec.sync.aligned.u32 {};", _check_maxnreg)
    trap = _ptx("trap;")

    named_barrier_sync = _ptx("bar.sync $0, $1;", (u32, u32))
    named_barrier_arrive = _ptx("bar.arrive $0, $1;", (u32, u32))
    stmatrix_x4 = _ptx("stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};", (u32,) * 5)

    mbarrier_init = _ptx("mbarrier.init.shared::cta.b64 [$0], $1;", (u32, u32))
    fence_mbarrier_init = _ptx("fence.mbarrier_init.release.cluster;")
    mbarrier_arrive = _ptx("mbarrier.arrive.shared::cta.b64 _, [$0];", (u32,))
    mbarrier_arrive_expect_tx = _ptx("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", (u32, u32))
    mbarrier_try_wait_parity = _ptx("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; "
                                    "selp.u32 $0, 1, 0, p; }", (u32, u32), result=u32)

    bulk_copy_g2s = _ptx("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                         "[$0], [$1], $2, [$3];", (u32, i64, u32, u32))

    smem_descriptor = descriptor_bits

    fence_proxy_tensormap_acquire = _ptx("fence.proxy.tensormap::generic.acquire.sys [$0], 128;", (i64,))
    tma_load_2d = _ptx("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                       "[$0], [$1, {$2, $3}], [$4];", (u32, i64, types.int32, types.int32, u32))
    tma_load_4d = _ptx("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                       "[$0], [$1, {$2, $3, $4, $5}], [$6];",
                       (u32, i64, types.int32, types.int32, types.int32, types.int32, u32))
    tma_store_2d = _ptx("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [$0, {$1, $2}], [$3];",
                        (i64, types.int32, types.int32, u32))
    tma_store_4d = _ptx("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [$0, {$1, $2, $3, $4}], [$5];",
                        (i64, types.int32, types.int32, types.int32, types.int32, u32))
    tma_reduce_add_4d = _ptx("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group "
                             "[$0, {$1, $2, $3, $4}], [$5];",
                             (i64, types.int32, types.int32, types.int32, types.int32, u32))
    bulk_reduce_add_f32 = _ptx("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
                               (i64, u32, u32))
    store_shared_u32 = _ptx("st.shared.u32 [$0], $1;", (u32, u32))
    store_shared_f32x4 = _ptx("st.shared.v4.f32 [$0], {$1, $2, $3, $4};",
                              (u32, types.float32, types.float32, types.float32, types.float32))
    tma_store_commit = _ptx("cp.async.bulk.commit_group;")
    tma_store_wait = _ptx_literal("cp.async.bulk.wait_group.read {};", _check_pending)
    bulk_wait = _ptx_literal("cp.async.bulk.wait_group {};", _check_pending)
    fence_proxy_async_global = _ptx("fence.proxy.async.global;")

    @intrinsic
    def array_address(typingctx, arr):
        if not isinstance(arr, types.Array):
            return None

        def codegen(context, builder, signature, llargs):
            data = context.make_array(arr)(context, builder, llargs[0]).data
            return builder.ptrtoint(data, ir.IntType(64))

        return types.int64(arr), codegen

    def _encode_tensor_map(x, box_rows, box_cols, swizzle):
        import cupy
        from cuda.bindings import driver

        modes = {SWIZZLE_NONE: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
                 SWIZZLE_128B: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                 SWIZZLE_64B: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
                 SWIZZLE_32B: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B}
        rows, cols = x.shape
        err, tensor_map = driver.cuTensorMapEncodeTiled(
            driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, x.data.ptr,
            [driver.cuuint64_t(cols), driver.cuuint64_t(rows)], [driver.cuuint64_t(x.strides[0])],
            [driver.cuuint32_t(box_cols), driver.cuuint32_t(box_rows)], [driver.cuuint32_t(1)] * 2,
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, modes[swizzle],
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed: {err}")
        return cupy.asarray(np.asarray([int(w) for w in tensor_map.opaque], dtype=np.uint64))

    def _tensor_map_4d_words(x, box, swizzle):
        from cuda.bindings import driver

        modes = {SWIZZLE_NONE: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
                 SWIZZLE_128B: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B}
        # The driver lists dimensions innermost first: the array's order reversed. 16-bit elements
        # as UINT16 (loads copy bits); float32 as FLOAT32 (what a reduce-add needs to add floats).
        data_type = (driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16 if x.dtype.itemsize == 2
                     else driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32)
        # A dimension of one element is never stepped over: its stride (0 in a view over a batch
        # of packed rows) given as the span of the dimensions inside it, as a dense array's.
        strides = list(x.strides[:3])
        for i in (2, 1, 0):
            if x.shape[i] == 1:
                strides[i] = (strides[i + 1] if i < 2 else x.dtype.itemsize) * x.shape[i + 1]
        err, tensor_map = driver.cuTensorMapEncodeTiled(
            data_type, 4, x.data.ptr,
            [driver.cuuint64_t(n) for n in reversed(x.shape)],
            [driver.cuuint64_t(s) for s in reversed(strides)],
            [driver.cuuint32_t(n) for n in reversed(box)], [driver.cuuint32_t(1)] * 4,
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, modes[swizzle],
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed: {err}")
        return np.asarray([int(w) for w in tensor_map.opaque], dtype=np.uint64)

    def _register_tuple_asm(builder, lltype, count, text, constraints, inputs):
        ftype = ir.FunctionType(ir.LiteralStructType([lltype] * count), [a.type for a in inputs])
        return builder.asm(ftype, text, constraints, list(inputs), True)

    def _wgmma_intrinsic(n, ab, trans_b, register_a, trans_a=0):
        regs = n // 2
        d = ", ".join(f"${i}" for i in range(regs))
        if register_a:
            a = "{" + ", ".join(f"${regs + j}" for j in range(4)) + "}"
            desc_b, scale = regs + 4, regs + 5
            layout = f", {trans_b}"  # imm-scale-a, imm-scale-b, imm-trans-b (A in registers: no trans-a)
            input_constraints = ["r"] * 4 + ["l", "r"]
        else:
            a = f"${regs}"
            desc_b, scale = regs + 1, regs + 2
            layout = f", {trans_a}, {trans_b}"  # imm-trans-a, imm-trans-b
            input_constraints = ["l", "l", "r"]
        k = 16
        if ab in _FP8:  # k32, and no transpose operands: fp8 operands are K-major only
            k, layout = 32, ""
        text = (f"{{ .reg .pred p; setp.ne.b32 p, ${scale}, 0; "
                f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ab}.{ab} "
                f"{{{d}}}, {a}, ${desc_b}, p, 1, 1{layout}; }}")
        # The accumulator is read and written: outputs tied to inputs (LLVM's spelling of "+f").
        constraints = ",".join(["=f"] * regs + input_constraints + [str(i) for i in range(regs)]
                               + ["~{memory}"])
        acc_type = types.UniTuple(types.float32, regs)
        scalar_args = [u32] * 4 + [u64, u32] if register_a else [u64, u64, u32]

        def typer(typingctx, args):
            sig = acc_type(acc_type, *scalar_args)

            def codegen(context, builder, signature, llargs):
                acc_values = [builder.extract_value(llargs[0], i) for i in range(regs)]
                out = _register_tuple_asm(builder, ir.FloatType(), regs, text, constraints,
                                          list(llargs[1:]) + acc_values)
                values = [builder.extract_value(out, i) for i in range(regs)]
                return context.make_tuple(builder, acc_type, values)

            return sig, codegen

        return intrinsic(_with_arity(1 + len(scalar_args), typer))

    def _make_wgmma_ss(n, ab, trans_b, trans_a=0):
        return _wgmma_intrinsic(n, ab, trans_b, register_a=False, trans_a=trans_a)

    def _make_wgmma_rs(n, ab, trans_b):
        return _wgmma_intrinsic(n, ab, trans_b, register_a=True)

    def _register_tuple_intrinsic(values, text, constraints):
        """Typing and codegen of an intrinsic that passes a UniTuple of registers through one asm
        (``text`` with ``constraints``), returning the asm's outputs as the tuple."""
        count = values.count

        def codegen(context, builder, signature, llargs):
            lltype = context.get_value_type(values.dtype)
            inputs = [builder.extract_value(llargs[0], i) for i in range(count)]
            out = _register_tuple_asm(builder, lltype, count, text, constraints, inputs)
            return context.make_tuple(builder, values, [builder.extract_value(out, i) for i in range(count)])

        return values(values), codegen

    def _register_code(values):
        """The asm constraint letter of a tuple of float32 or uint32 registers, else None."""
        if not isinstance(values, types.UniTuple) or values.dtype not in (types.float32, types.uint32):
            return None
        return "f" if values.dtype == types.float32 else "r"

    @intrinsic
    def fence_operands(typingctx, values):
        code = _register_code(values)
        if code is None:
            return None
        count = values.count
        constraints = ",".join([f"={code}"] * count + [str(i) for i in range(count)] + ["~{memory}"])
        return _register_tuple_intrinsic(values, "", constraints)

    @intrinsic
    def copy_operands(typingctx, values):
        code = _register_code(values)
        if code is None:
            return None
        count = values.count
        text = " ".join(f"mov.b32 ${i}, ${count + i};" for i in range(count))
        return _register_tuple_intrinsic(values, text, ",".join([f"={code}"] * count + [code] * count))

    @intrinsic
    def pack_e4m3x4(typingctx, x0, x1, x2, x3):
        # cvt.rn.satfinite.e4m3x2.f32 d, a, b puts a in the upper byte and b in the lower.
        text = ("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }")
        sig = types.uint32(types.float32, types.float32, types.float32, types.float32)

        def codegen(context, builder, signature, llargs):
            ftype = ir.FunctionType(ir.IntType(32), [a.type for a in llargs])
            return builder.asm(ftype, text, "=r,f,f,f,f", list(llargs), False)

        return sig, codegen

    @intrinsic
    def registers_from(typingctx, arr, count):
        if not (isinstance(arr, types.Array) and arr.ndim == 1 and isinstance(count, types.IntegerLiteral)):
            return None
        n = int(count.literal_value)
        ret = types.UniTuple(arr.dtype, n)

        def codegen(context, builder, signature, llargs):
            ary = context.make_array(arr)(context, builder, llargs[0])
            values = [builder.load(cgutils.get_item_pointer(context, builder, arr, ary,
                                                            [context.get_constant(types.intp, i)]))
                      for i in range(n)]
            return context.make_tuple(builder, ret, values)

        return ret(arr, count), codegen

    @intrinsic
    def registers_to(typingctx, arr, values):
        if not (isinstance(arr, types.Array) and arr.ndim == 1 and isinstance(values, types.UniTuple)
                and values.dtype == arr.dtype):
            return None

        def codegen(context, builder, signature, llargs):
            ary = context.make_array(arr)(context, builder, llargs[0])
            for i in range(values.count):
                ptr = cgutils.get_item_pointer(context, builder, arr, ary, [context.get_constant(types.intp, i)])
                builder.store(builder.extract_value(llargs[1], i), ptr)
            return context.get_dummy_value()

        return types.void(arr, values), codegen


def _check_wgmma(n, ab, trans_b, trans_a=0):
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma m64n{n}: n must be a multiple of 8 in [8, 256]")
    if ab not in ("f16", "bf16") + _FP8:
        raise ValueError(f"wgmma operands {ab!r}: 'f16', 'bf16', 'e4m3' or 'e5m2'")
    if trans_b not in (0, 1):
        raise ValueError(f"{trans_b=}: 0 (B K-major) or 1 (B MN-major)")
    if trans_a not in (0, 1):
        raise ValueError(f"{trans_a=}: 0 (A K-major) or 1 (A MN-major)")
    if ab in _FP8 and (trans_b or trans_a):
        raise ValueError(f"wgmma {ab}: 8-bit operands are K-major only (trans_a=trans_b=0); transpose V in memory")


def make_wgmma_ss(n, ab="f16", trans_b=0, trans_a=0):
    """``wgmma(acc, desc_a, desc_b, scale_d) -> acc``: wgmma.mma_async.sync.aligned.m64n{n}k16
    .f32.{ab}.{ab}, both operands in shared memory (SS). A is 64x16 through ``desc_a``,
    stored K-major (64 rows of 16 k, ``trans_a=0``) or MN-major (16 rows of 64, ``trans_a=1``:
    a transposed image, such as dS^T stored to give dS, 16-bit only); B is 16 x n, stored
    K-major (n rows of 16 k, ``trans_b=0``) or MN-major (16 rows of n, ``trans_b=1``) through
    ``desc_b``. With ``ab`` 'e4m3' or 'e5m2' (fp8) it is m64n{n}k32:
    A 64x32 and B 32 x n, both K-major (``trans_b`` 0; the PTX has no transpose operands for
    8-bit types), in the K-major images above descriptor_bits with 1-byte elements; the k32 step
    moves the descriptor by the f16 k16 step's bytes (both fp8 forms checked against NumPy on an H200,
    tests/test_primitives_sm90.py). ``acc`` is this thread's n/2 float32 accumulator
    registers (a UniTuple), updated in place: D = A B + D, or D = A B when ``scale_d`` is 0.
    Register r of thread t (w = t // 32, g = lane // 4, q = lane % 4) holds D[16 w + g +
    8 ((r // 2) % 2), 8 (r // 4) + 2 q + r % 2]. Warpgroup-wide (128 threads), asynchronous:
    wgmma_fence before, wgmma_commit after, and the result is valid only after wgmma_wait. Two
    accumulators in flight must not start from the same values (``acc2 = acc1``): wgmma updates
    its registers in place, so the compiler copies them, after wgmma_fence (see there); give the
    second its own registers before the fence (fence_operands of a copy).
    Emulation: a warpgroup collective that decodes both descriptors (the layouts above
    descriptor_bits: no swizzle or 128B, base offset 0), multiplies in float64, rounds once to
    float32 (the hardware accumulates in float32 in its own order; for fp8 products it is said to
    keep fewer bits in its partial sums, so a GPU check allows more) and completes at once."""
    _check_wgmma(n, ab, trans_b, trans_a)
    return _make_wgmma_ss(n, ab, trans_b, trans_a)


def make_wgmma_rs(n, ab="f16", trans_b=0):
    """``wgmma(acc, a0, a1, a2, a3, desc_b, scale_d) -> acc``: as make_wgmma_ss with A from
    registers (RS): a0..a3 are uint32 of two f16/bf16 each (the lower k in the low half); a_j of
    thread t holds A[16 w + g + 8 (j % 2), 8 (j // 2) + 2 q] and the next column, i.e. the
    accumulator's layout at n = 16, so a k16 slice of an accumulator packs into A without
    shuffles. Make (or load) the A registers before wgmma_fence and pass them through
    fence_operands: packed between the wgmmas, they made ptxas serialize them (C7511 in its -v
    output); loaded from memory after the fence, they made it inject a warpgroup.arrive (C7519).
    With ``ab`` 'e4m3' or 'e5m2' (k32, B K-major only): a0..a3 hold four fp8 values each (the
    lowest k in the low byte; pack_e4m3x4 makes them), a_j of thread t holds A[16 w + g + 8 (j % 2),
    16 (j // 2) + 4 q .. + 3] (CUTLASS's ALayout_64x32). That is not the accumulator's layout (a
    thread's accumulator holds columns 2 q, 2 q + 1, 8 + 2 q, 9 + 2 q of each 16): P = S in fp8
    needs its keys permuted, or the values moved between lanes. Not run on a GPU yet."""
    _check_wgmma(n, ab, trans_b)
    return _make_wgmma_rs(n, ab, trans_b)


def make_tensor_map_2d(x, box_rows, box_cols, swizzle=SWIZZLE_NONE):
    """Host side of tma_load_2d: the tensor map of the 2-D array ``x`` of 16-bit elements (rows
    contiguous, the row stride a multiple of 16 bytes) for boxes of ``box_rows`` x ``box_cols``
    elements (at most 256 each; ``box_cols`` x 2 bytes at most 128 with SWIZZLE_128B), as a
    uint64[16] array in device memory (CuPy allocations are aligned enough). Kernels take its
    address (array_address), run fence_proxy_tensormap_acquire once, then tma_load_2d. On a GPU the
    words are the driver's opaque CUtensorMap (cuTensorMapEncodeTiled, through cuda.bindings); the
    map names ``x``'s memory, so ``x`` must outlive its use. The simulator's words are its own."""
    if x.ndim != 2 or x.dtype.itemsize != 2:
        raise ValueError(f"make_tensor_map_2d takes a 2-D array of 16-bit elements, not {x.dtype} {x.shape}")
    if x.strides[1] != 2 or x.strides[0] % 16:
        raise ValueError(f"{x.strides=}: rows must be contiguous and 16-byte aligned")
    if not (1 <= box_rows <= 256 and 1 <= box_cols <= 256 and (box_cols * 2) % 16 == 0):
        raise ValueError(f"box {box_rows} x {box_cols}: at most 256 each, rows a multiple of 16 bytes")
    if swizzle == SWIZZLE_128B and box_cols * 2 > 128:
        raise ValueError(f"{box_cols=}: the 128B swizzle takes box rows of at most 128 bytes")
    return _encode_tensor_map(x, box_rows, box_cols, swizzle)


def tensor_map_4d_words(x, box, swizzle=SWIZZLE_NONE):
    """Host side of tma_load_4d (and of tma_reduce_add_4d): the 16 words (a NumPy uint64[16]) of the
    tensor map of the 4-D array ``x`` of 16-bit elements, or float32 ones for a reduce-add (last
    dimension contiguous, the other strides multiples of 16 bytes, the data 16-byte aligned) for
    boxes of ``box`` elements, given in x's order (each at most 256; the last at most 128 bytes
    with SWIZZLE_128B). The words must reach device memory (a CuPy array, see make_tensor_map_4d)
    before a kernel reads them; the map names ``x``'s memory, so ``x`` must outlive its use. On a
    GPU they are the driver's CUtensorMap; the simulator's are its own."""
    if x.ndim != 4 or not (x.dtype.itemsize == 2 or x.dtype == np.float32):
        raise ValueError(f"tensor_map_4d_words takes a 4-D array of 16-bit elements or float32, not {x.dtype} "
                         f"{x.shape}")
    item = x.dtype.itemsize
    if x.strides[3] != item or any(s % 16 for s in x.strides[:3]):
        raise ValueError(f"{x.strides=}: the last dimension contiguous, the others multiples of 16 bytes")
    if len(box) != 4 or not all(1 <= n <= 256 for n in box) or (box[3] * item) % 16:
        raise ValueError(f"{box=}: four extents of at most 256, the last a multiple of 16 bytes")
    if swizzle == SWIZZLE_128B and box[3] * item > 128:
        raise ValueError(f"{box=}: the 128B swizzle takes innermost extents of at most 128 bytes")
    return _tensor_map_4d_words(x, tuple(int(n) for n in box), swizzle)


def make_tensor_map_4d(x, box, swizzle=SWIZZLE_NONE):
    """tensor_map_4d_words in device memory (a CuPy uint64[16]; the words themselves in the simulator)."""
    words = tensor_map_4d_words(x, box, swizzle)
    if SIMULATOR:
        return words
    import cupy

    return cupy.asarray(words)


_MAPS = {}  # (the caller's key, the arrays' pointers, shapes, strides) -> device maps, most recent last
_MAPS_KEPT = 32
_COPIES = []  # the last broadcast inputs' contiguous copies


def _broadcast(x):
    """x has a stride-0 dimension of more than one element (one tensor seen over several rows)."""
    return any(s == 0 and n > 1 for n, s in zip(x.shape, x.strides))


def cached_tensor_maps(key, arrays, make_words):
    """A kernel's tensor maps of ``arrays`` in device memory: ``make_words(*arrays)`` (a NumPy
    (n, 16) uint64 array, e.g. stacked tensor_map_4d_words) copied to the GPU, and kept for the
    last few calls under ``key`` and the arrays' pointers, shapes and strides: a model calls
    attention on the same buffers again and again, and a map costs a driver call and a copy. A
    broadcast input (a stride 0, which a tensor map cannot hold) is copied for the call, its maps
    not kept, the copy held for the last few calls (CuPy's pool reuses memory in stream order).
    In the simulator the words themselves."""
    if SIMULATOR:
        return make_words(*arrays)
    import cupy

    if any(_broadcast(x) for x in arrays):
        arrays = tuple(cupy.ascontiguousarray(x) if _broadcast(x) else x for x in arrays)
        _COPIES.append(arrays)  # held past the launch (the maps name their memory)
        del _COPIES[:-_MAPS_KEPT]
        return cupy.asarray(make_words(*arrays))
    full_key = (key, *((x.data.ptr, x.shape, x.strides) for x in arrays))
    maps = _MAPS.pop(full_key, None)
    if maps is None:
        maps = cupy.asarray(make_words(*arrays))
        while len(_MAPS) >= _MAPS_KEPT:
            del _MAPS[next(iter(_MAPS))]
    _MAPS[full_key] = maps
    return maps


def make_mbarrier_wait(spin_limit):
    """A device function ``wait(bar, parity)`` that loops on mbarrier_try_wait_parity until the
    phase of parity ``parity`` completes; after ``spin_limit`` failed tries (0: never) it traps, so a
    wrong byte count or parity stops the kernel instead of hanging it."""

    @cuda.jit(device=True, inline=True)
    def wait(bar, parity):
        spins = 0
        while mbarrier_try_wait_parity(bar, parity) == uint32(0):
            if spin_limit:
                spins += 1
                if spins >= spin_limit:
                    trap()

    return wait


mbarrier_wait = make_mbarrier_wait(WAIT_SPIN_LIMIT)


def check_register_split(threads, producer, consumer, consumers):
    """Raise ValueError unless setmaxnreg caps of ``producer`` registers (one warpgroup) and
    ``consumer`` registers (each of ``consumers`` warpgroups) fit in what the block holds at entry:
    ``threads`` times ptxas's cap under the launch bounds (65536 / threads, rounded down to a
    multiple of 8; 168 at 384 threads). A warpgroup's setmaxnreg.inc waits until the others'
    .dec have freed enough registers, so caps that add up to more never return: 32 / 240 with two
    consumers (65,536 registers against 64,512) hung on the H200."""
    entry = min(255, 65536 // threads) // 8 * 8
    wanted = 128 * (producer + consumers * consumer)
    if wanted > entry * threads:
        raise ValueError(f"setmaxnreg caps {producer} / {consumer} ask {wanted} registers for {consumers} consumer "
                         f"warpgroups and a producer, more than the {entry * threads} the block holds at entry "
                         f"({threads} threads x {entry}): a warpgroup would wait forever in setmaxnreg.inc. "
                         f"Lower them, e.g. 40 / 232 or 24 / 240")


def launch_bounded(max_threads, min_blocks=1):
    """``cuda.jit`` with launch bounds (``.maxntid``, ``.minnctapersm``), which give ptxas the
    register cap at entry that setmaxnreg needs; the simulator's jit takes none."""
    if SIMULATOR:
        return cuda.jit
    return lambda fn: cuda.jit(fn, launch_bounds=(max_threads, min_blocks))


# warpgroup_index(tid): the warpgroup of thread ``tid`` (tid // 128), made warp-uniform to ptxas by a
# broadcast from lane 0 (``warp_broadcast_u32``; every lane calls it, in warp-uniform control flow).
# Whatever a warpgroup computes from it (which tiles it reads: its wgmma descriptors) then stays in
# uniform registers, where wgmma takes its descriptors; made from threadIdx alone, ptxas keeps them
# in per-thread registers and moves each to uniform ones (R2UR) before every wgmma: at headdim 256,
# 12 instructions a wgmma instead of 3.
if SIMULATOR:

    def warpgroup_index(tid):
        """tid // 128, through lane 0 (see above); a Python int, as tid // 128 is here."""
        return int(_p.warp_broadcast_u32(uint32(tid // 128)))

else:

    @_p.inline_device
    def warpgroup_index(tid):
        """tid // 128, warp-uniform to ptxas (see above)."""
        return int32(_p.warp_broadcast_u32(uint32(tid // 128)))
