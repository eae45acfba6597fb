"""Tile primitives: the few low-level operations the kernels need that plain Numba does not spell.

Each primitive exists twice:

* on a GPU, a Numba ``@intrinsic`` whose code generation emits the LLVM IR or inline PTX directly;
* under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), a plain-Python emulation with the same
  contract, so the production kernels run unchanged on the CPU (slowly, at small sizes).

The choice is made once, at import time, from ``numba.config.ENABLE_CUDASIM``. Kernels import the
names from here and never ask which version they got. ``tests/test_primitives.py`` checks the GPU
versions against the emulations.
"""

import struct

import numpy as np
from numba import config

SIMULATOR = bool(config.ENABLE_CUDASIM)


# ---------------------------------------------------------------------------------------------------
# Bit casts and bfloat16 conversion
#
# bfloat16 tensors reach the kernels as uint16 arrays holding the raw bits (NumPy has no bfloat16 of
# its own and Numba has no bfloat16 array type). A bfloat16 is the top half of a float32, so widening
# is a shift, and narrowing is round-to-nearest-even on the dropped 16 bits.
# ---------------------------------------------------------------------------------------------------

if SIMULATOR:

    def f32_as_u32(x):
        """The bits of a float32, as a uint32."""
        return np.uint32(struct.unpack("<I", struct.pack("<f", np.float32(x)))[0])

    def u32_as_f32(bits):
        """The float32 whose bits are ``bits``."""
        return np.float32(struct.unpack("<f", struct.pack("<I", int(bits) & 0xFFFFFFFF))[0])

else:
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def f32_as_u32(typingctx, x):
        sig = types.uint32(types.float32)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(types.uint32))

        return sig, codegen

    @intrinsic
    def u32_as_f32(typingctx, bits):
        sig = types.float32(types.uint32)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(types.float32))

        return sig, codegen


from numba import cuda, float32, int32, uint16, uint32  # noqa: E402

if SIMULATOR:
    from numba.core import types as _types

    def _numpy_scalar(numba_type):
        """Numba's scalar type as the simulator uses it, less the overhead. Called on a value, a
        Numba type casts it in the simulator by ``getattr(np, type.name)(value)`` (Type.__call__'s
        cast_python_value), the value NumPy's type gives, but after an import and an isinstance
        test: 2.3 us a call against 0.5 here, some 6% of a simulated Hopper kernel's time. As the
        dtype of a local or shared array it is NumPy's dtype (``.dtype``, ``.itemsize``: what
        np.empty and the simulator's dynamic shared memory read)."""
        scalar = getattr(np, numba_type.name)
        dtype = np.dtype(scalar)
        cls = type(f"numpy_{numba_type.name}", (), {"__slots__": (), "__call__": scalar, "dtype": dtype,
                                                     "itemsize": dtype.itemsize, "name": numba_type.name,
                                                     "__repr__": lambda self: f"numpy_{self.name}"})
        return cls()

    _NUMPY_SCALARS = {}

    def _numpy_scalar_casts(namespace):
        """Put _numpy_scalar's stand-ins in ``namespace`` (a module's globals, an unrolled
        function's namespace) for the Numba scalar types it holds."""
        for name, value in list(namespace.items()):
            if type(value) in (_types.Integer, _types.Float):
                if value not in _NUMPY_SCALARS:
                    _NUMPY_SCALARS[value] = _numpy_scalar(value)
                namespace[name] = _NUMPY_SCALARS[value]

    _numpy_scalar_casts(globals())


@cuda.jit(device=True, inline=True)
def bf16_bits_to_f32(bits):
    """Widen a bfloat16 (given as its uint16 bits) to float32: the bits become the top half."""
    return u32_as_f32(uint32(bits) << uint32(16))


@cuda.jit(device=True, inline=True)
def f32_to_bf16_bits(x):
    """Narrow a float32 to bfloat16 bits, rounding to nearest even; NaN stays NaN."""
    bits = f32_as_u32(x)
    if (bits & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
        return uint16(0x7FC0)
    round_up = uint32(0x7FFF) + ((bits >> uint32(16)) & uint32(1))
    return uint16((bits + round_up) >> uint32(16))


@cuda.jit(device=True, inline=True)
def unpack_bf16x2(word):
    """The two bfloat16 of a packed uint32 (the low 16 bits the first), widened to float32."""
    return u32_as_f32(word << uint32(16)), u32_as_f32(word & uint32(0xFFFF0000))


@cuda.jit(device=True, inline=True)
def to_f32(x):
    """Widen a float16 or float32 element to float32."""
    return float32(x)


# ---------------------------------------------------------------------------------------------------
# exp2 on the FMA pipes
#
# The softmax's exponentials go to the SM's MUFU unit (ex2.approx: 16 a clock an SM on Hopper), which
# at fp8 is as busy as the tensor cores (docs/perf-notes.md, "The fp8 forward measured"). The same
# 2**x can be made from plain arithmetic, FlashAttention-4's way: x = j + f with j the integer
# nearest x and f in [-1/2, 1/2]; 2**f from a short polynomial; 2**j added into the exponent field.
# Adding 1.5 * 2**23 rounds x to j in float32's low mantissa bits (round to nearest even), from
# which j shifted left by 23 is the exponent's increment. p(0) is exactly 1, so x <= -127
# (masked scores: -inf, clamped) gives the bits 0: exactly +0.0, as ex2.approx.ftz gives. Between
# -127 and -126 the result is some number below 2**-126 instead of the true one (float32's
# subnormals, which the ftz exponential flushes to 0 anyway). On the GPU a NaN x gives 0 (FMNMX
# drops it), not NaN; the simulator's max keeps the NaN.
# Coefficients: relative minimax on [-1/2, 1/2] with the constant term 1.
# ---------------------------------------------------------------------------------------------------

ROUND_TO_INTEGER = 12582912.0  # 1.5 * 2**23: x + this has x rounded to an integer in its low bits


@cuda.jit(device=True, inline=True)
def _exp2_split(x):
    """(t, f): t = 1.5 * 2**23 + j with j the integer nearest max(x, -127), f = x - j in [-1/2, 1/2]."""
    x = max(x, float32(-127.0))
    t = x + float32(ROUND_TO_INTEGER)
    return t, x - (t - float32(ROUND_TO_INTEGER))


@cuda.jit(device=True, inline=True)
def _exp2_join(p, t):
    """p * 2**j: j (t's bits less 1.5 * 2**23's) added into p's exponent field. In signed words
    nothing wraps: p's field is 126 or 127 and j >= -127, so the sum is >= 0."""
    j = int32(f32_as_u32(t)) - int32(0x4B400000)
    return u32_as_f32(uint32(int32(f32_as_u32(p)) + (j << int32(23))))


@cuda.jit(device=True, inline=True)
def exp2_fma3(x):
    """2**x for x <= 127 without MUFU (P: x <= 0, or <= rescale_slack), within 1.1e-4 relative (degree 3)."""
    t, f = _exp2_split(x)
    p = ((float32(0.05500858277082443) * f + float32(0.24221037328243256)) * f
         + float32(0.6932829022407532)) * f + float32(1.0)
    return _exp2_join(p, t)


@cuda.jit(device=True, inline=True)
def exp2_fma4(x):
    """2**x for x <= 127 without MUFU (P: x <= 0, or <= rescale_slack), within 3e-6 relative (degree 4)."""
    t, f = _exp2_split(x)
    p = (((float32(0.009582818485796452) * f + float32(0.05590637028217316)) * f + float32(0.24024099111557007)) * f
         + float32(0.6931241750717163)) * f + float32(1.0)
    return _exp2_join(p, t)


# ---------------------------------------------------------------------------------------------------
# Tensor-core tile primitives
#
# The fast forward kernel (kernels/forward_mma.py) is written against these few warp-level operations.
# Fragment layouts follow the PTX ISA ("Matrix fragments for mma.m16n8k16 with floating point type" and
# "Warp-level matrix load instruction: ldmatrix"). With ``g = lane >> 2`` (the lane's quad, 0..7) and
# ``t = lane & 3`` (its place in the quad, 0..3), and "2 halves" meaning a uint32 whose low 16 bits hold
# the lower-index element:
#
#   A (16x16, row-major)   a0 = A[g, 2t:2t+2]  a1 = A[g+8, 2t:2t+2]  a2 = A[g, 2t+8:2t+10]  a3 = A[g+8, 2t+8:2t+10]
#   B (16x8, "col")        b0 = B[2t:2t+2, g]  b1 = B[2t+8:2t+10, g]
#   C, D (16x8, float32)   c0, c1 = C[g, 2t], C[g, 2t+1]      c2, c3 = C[g+8, 2t], C[g+8, 2t+1]
#
#   ldmatrix .x4: lanes 8i..8i+7 give the shared addresses of the 8 rows (16 bytes each) of matrix i;
#   register i of every lane receives M_i[g, 2t:2t+2], or M_i[2t:2t+2, g] with .trans.
#
# Shared memory is addressed by 32-bit shared-window addresses (``shared_address(arr)`` plus a byte
# offset), which is what ldmatrix and cp.async take.
# ---------------------------------------------------------------------------------------------------

if SIMULATOR:
    import ctypes
    import threading

    # --- Warp collectives in the simulator -------------------------------------------------------
    # The simulator runs each CUDA thread as a Python thread and one block at a time. A collective
    # (mma, ldmatrix, shuffle) needs the values of all lanes of the warp, so the lanes meet at a
    # per-warp barrier: each posts its operands, the barrier's action (run once, by one thread, when
    # all lanes have arrived) computes every lane's result, and a second barrier keeps the next
    # collective from overwriting the results before every lane has read its own. The kernels call
    # collectives in warp-uniform control flow, as the hardware's .sync.aligned forms require.

    class _WarpExchange:
        def __init__(self, lanes):
            self.lanes = lanes
            self.posted = [None] * lanes
            self.results = None
            self.arrived = threading.Barrier(lanes, action=self._combine, timeout=600)
            self.read = threading.Barrier(lanes, timeout=600)

        def _combine(self):
            combine = self.posted[0][0]
            self.results = combine([value for _, value in self.posted])

    _exchange_lock = threading.Lock()

    def _warp_collective(combine, value):
        """Post ``value``; return this lane's entry of ``combine(values of lanes 0..31)``."""
        thread = threading.current_thread()
        manager = thread._manager  # one BlockManager per block: the exchanges die with the block
        warp, lane = divmod(thread.thread_id, 32)
        with _exchange_lock:
            exchanges = manager.__dict__.setdefault("_nbflash_warps", {})
            exchange = exchanges.get(warp)
            if exchange is None:
                block_threads = int(np.prod(manager._block_dim))
                exchange = exchanges[warp] = _WarpExchange(min(32, block_threads - 32 * warp))
        exchange.posted[lane] = (combine, value)
        exchange.arrived.wait()
        result = exchange.results[lane]
        exchange.read.wait()
        return result

    _LANE = np.arange(32)
    _G = _LANE >> 2
    _T = _LANE & 3

    # --- Shared-memory addresses -----------------------------------------------------------------
    # A shared-window address is emulated by the host address of the simulator's shared buffer, so
    # ldmatrix and cp.async read and write exactly the bytes the kernel's other views of that buffer
    # see. Every access is checked to lie inside an array handed to shared_address, and aligned.

    class _Ranges:
        """The address ranges of the arrays a kernel handed to shared_address or global_address,
        to check every emulated access against. The simulator's threads (one per CUDA thread)
        register and look up at once, so a lock guards the table; only the most recently
        registered ranges are kept (every call registers its array again), so that lookups stay
        fast over a whole test session instead of scanning every array ever simulated."""

        KEPT = 64

        def __init__(self):
            self._ranges = {}
            self._lock = threading.Lock()

        def register(self, low, high):
            with self._lock:
                self._ranges.pop(low, None)  # re-inserted last: the most recent
                self._ranges[low] = high
                while len(self._ranges) > self.KEPT:
                    del self._ranges[next(iter(self._ranges))]

        def contains(self, addr, nbytes):
            with self._lock:
                return any(low <= addr and addr + nbytes <= high for low, high in self._ranges.items())

    _shared_ranges = _Ranges()

    def shared_address(arr):
        """The shared-window address of ``arr[0]`` (a host address in the simulator)."""
        start = arr.ctypes.data
        _shared_ranges.register(start, start + arr.nbytes)
        return np.uint64(start)

    def _shared_bytes(addr, nbytes):
        addr = int(addr)
        if addr % 16:
            raise ValueError(f"shared address {addr:#x} is not 16-byte aligned")
        if not _shared_ranges.contains(addr, nbytes):
            raise IndexError(f"shared address {addr:#x} (+{nbytes}) is outside every shared array")
        return (ctypes.c_uint8 * nbytes).from_address(addr)

    # --- cp.async: emulated as an immediate copy ---------------------------------------------------

    def cp_async_16(dst, src, i0, i1, i2, i3, src_bytes):
        """Copy the 16 bytes ``src[i0, i1, i2, i3:i3+8]`` to shared address ``dst``; zero-fill
        instead when ``src_bytes`` is 0 (then ``src`` is not read)."""
        out = np.frombuffer(_shared_bytes(dst, 16), dtype=np.uint8)
        if int(src_bytes) == 0:
            out[:] = 0
            return
        assert int(src_bytes) == 16, "cp_async_16 copies 16 bytes or zero-fills"
        row = np.asarray([src[i0, i1, i2, i3 + e] for e in range(8)])
        assert row.dtype.itemsize == 2
        out[:] = row.view(np.uint8)

    _global_ranges = _Ranges()

    def global_address(x, i0, i1, i2, i3):
        """The address of ``x[i0, i1, i2, i3]`` as an int64 (a host address in the simulator); the
        indices may lie outside the array as long as nothing is read there."""
        nd = x._item._ary if hasattr(x, "_item") else x
        low, high = np.lib.array_utils.byte_bounds(nd)
        _global_ranges.register(low, high)
        s0, s1, s2, s3 = nd.strides
        return np.int64(nd.ctypes.data + int(i0) * s0 + int(i1) * s1 + int(i2) * s2 + int(i3) * s3)

    def cp_async_16_from(dst, src_address, src_bytes):
        """cp_async_16 from a global address (see global_address); zero-fill when src_bytes is 0."""
        out = np.frombuffer(_shared_bytes(dst, 16), dtype=np.uint8)
        if int(src_bytes) == 0:
            out[:] = 0
            return
        assert int(src_bytes) == 16, "cp_async_16_from copies 16 bytes or zero-fills"
        addr = int(src_address)
        if addr % 16:
            raise ValueError(f"global address {addr:#x} is not 16-byte aligned")
        if not _global_ranges.contains(addr, 16):
            raise IndexError(f"global address {addr:#x} (+16) is outside every array")
        out[:] = np.frombuffer((ctypes.c_uint8 * 16).from_address(addr), dtype=np.uint8)

    def load_f32_cg(address):
        """The float32 at a global address (see global_address), read at the L2 cache, past this
        multiprocessor's L1 (ld.global.cg): for data other blocks of the running kernel wrote."""
        addr = int(address)
        if addr % 4:
            raise ValueError(f"global address {addr:#x} is not 4-byte aligned")
        if not _global_ranges.contains(addr, 4):
            raise IndexError(f"global address {addr:#x} (+4) is outside every array")
        return np.float32(ctypes.c_float.from_address(addr).value)

    _reduction_lock = threading.Lock()

    def _red_add_f32(address, values):
        """Add ``values`` to as many float32 at a global address, atomically (one vector reduction:
        the address aligned to the vector's bytes)."""
        words = _global_bytes(address, 4 * len(values))  # alignment and bounds checked
        floats = (ctypes.c_float * len(values)).from_address(ctypes.addressof(words))
        with _reduction_lock:
            for i, x in enumerate(values):
                floats[i] = np.float32(floats[i]) + np.float32(x)

    def red_add_f32(address, a):
        """Add ``a`` to the float32 at a global address (see global_address), atomically."""
        _red_add_f32(address, (a,))

    def red_add_f32x2(address, a, b):
        """Add ``a`` and ``b`` to the two float32 at a global address (see global_address),
        atomically; the address must be 8-byte aligned."""
        _red_add_f32(address, (a, b))

    def red_add_f32x4(address, a, b, c, d):
        """Add ``a``, ``b``, ``c``, ``d`` to the four float32 at a global address (see
        global_address), atomically; the address must be 16-byte aligned."""
        _red_add_f32(address, (a, b, c, d))

    def _global_bytes(address, nbytes):
        addr = int(address)
        if addr % nbytes:
            raise ValueError(f"global address {addr:#x} is not {nbytes}-byte aligned")
        if not _global_ranges.contains(addr, nbytes):
            raise IndexError(f"global address {addr:#x} (+{nbytes}) is outside every array")
        return (ctypes.c_uint32 * (nbytes // 4)).from_address(addr)

    def load_u32x4_nc(address):
        """The 16 bytes at a global address (see global_address; 16-byte aligned) as four uint32,
        by the read-only path (ld.global.nc.v4: for data no thread of the running kernel writes)."""
        return tuple(np.uint32(word) for word in _global_bytes(address, 16))

    def load_u32x4_cg(address):
        """The 16 bytes at a global address (16-byte aligned) as four uint32, read at the L2 cache,
        past this multiprocessor's L1 (ld.global.cg.v4: for data other blocks of the running kernel
        wrote)."""
        return tuple(np.uint32(word) for word in _global_bytes(address, 16))

    def store_u32x4(address, a, b, c, d):
        """Four uint32 to the 16 bytes at a global address (16-byte aligned), one vector store."""
        words = _global_bytes(address, 16)
        for i, word in enumerate((a, b, c, d)):
            words[i] = int(word) & 0xFFFFFFFF

    def store_u32(address, word):
        """A uint32 to the 4 bytes at a global address (4-byte aligned): e.g. two 16-bit elements
        packed by pack_f16x2, the first in the low half."""
        _global_bytes(address, 4)[0] = int(word) & 0xFFFFFFFF

    def unpack_f16x2(word):
        """The two float16 of a packed uint32 (the low 16 bits the first), widened to float32."""
        halves = np.array([int(word) & 0xFFFF, (int(word) >> 16) & 0xFFFF], dtype=np.uint16).view(np.float16)
        return np.float32(halves[0]), np.float32(halves[1])

    def cp_async_commit():
        """Close the group of cp.async copies issued so far (nothing to do: copies were immediate)."""

    def cp_async_wait(n):
        """Wait until at most ``n`` committed groups are pending (immediate copies: nothing to do)."""

    # --- ldmatrix ---------------------------------------------------------------------------------

    def _ldmatrix_combine(transpose, addresses):
        regs = np.empty((32, 4), dtype=np.uint32)
        for i in range(4):
            m = np.stack([np.frombuffer(_shared_bytes(a, 16), dtype=np.uint16).copy()
                          for a in addresses[8 * i:8 * i + 8]]).astype(np.uint32)
            if transpose:
                m = m.T
            regs[:, i] = m[_G, 2 * _T] | (m[_G, 2 * _T + 1] << np.uint32(16))
        return [tuple(np.uint32(r) for r in regs[lane]) for lane in range(32)]

    def ldmatrix_x4(addr):
        """Four 8x8 16-bit matrices from shared memory; lane 8i+r gives the address of row r of
        matrix i. Returns this lane's four registers (see the layout table above)."""
        return _warp_collective(lambda posted: _ldmatrix_combine(False, posted), int(addr))

    def ldmatrix_x4_trans(addr):
        """As ldmatrix_x4, each matrix transposed."""
        return _warp_collective(lambda posted: _ldmatrix_combine(True, posted), int(addr))

    # --- mma.sync m16n8k16 ------------------------------------------------------------------------

    def _halves(words):
        words = np.asarray(words, dtype=np.uint32)
        return (words & np.uint32(0xFFFF)).astype(np.uint16), (words >> np.uint32(16)).astype(np.uint16)

    def _decode_f16(bits):
        return bits.view(np.float16).astype(np.float64)

    def _decode_bf16(bits):
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)

    def _mma_combine(decode, posted):
        r = np.asarray([[int(x) for x in p[:6]] for p in posted], dtype=np.uint32)
        c = np.asarray([[float(x) for x in p[6:]] for p in posted], dtype=np.float32)
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        C = np.zeros((16, 8))
        for reg, (row, col) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
            lo, hi = _halves(r[:, reg])
            A[_G + row, 2 * _T + col] = decode(lo)
            A[_G + row, 2 * _T + col + 1] = decode(hi)
        for reg, k in [(4, 0), (5, 8)]:
            lo, hi = _halves(r[:, reg])
            B[2 * _T + k, _G] = decode(lo)
            B[2 * _T + k + 1, _G] = decode(hi)
        C[_G, 2 * _T], C[_G, 2 * _T + 1] = c[:, 0], c[:, 1]
        C[_G + 8, 2 * _T], C[_G + 8, 2 * _T + 1] = c[:, 2], c[:, 3]
        D = (A @ B + C).astype(np.float32)
        return [(D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1])
                for g, t in zip(_G, _T)]

    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A @ B + C for one warp: A 16x16 and B 16x8 float16 fragments, C and D 16x8 float32."""
        return _warp_collective(lambda posted: _mma_combine(_decode_f16, posted),
                                (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """As mma_f16, with bfloat16 fragments."""
        return _warp_collective(lambda posted: _mma_combine(_decode_bf16, posted),
                                (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))

    # --- Packing, exp2, quad reductions -----------------------------------------------------------

    def pack_f16x2(lo, hi):
        """Two float32 rounded to float16 (nearest even), packed: ``lo`` in the low 16 bits."""
        bits = np.array([lo, hi], dtype=np.float32).astype(np.float16).view(np.uint16)
        return np.uint32(int(bits[0]) | (int(bits[1]) << 16))

    def pack_bf16x2(lo, hi):
        """Two float32 rounded to bfloat16 (nearest even), packed: ``lo`` in the low 16 bits."""
        return np.uint32(int(f32_to_bf16_bits(np.float32(lo))) | (int(f32_to_bf16_bits(np.float32(hi))) << 16))

    def exp2_approx(x):
        """2**x in float32 (ex2.approx.ftz on the GPU: about 2 ulp, subnormals flushed)."""
        with np.errstate(over="ignore"):
            return np.exp2(np.float32(x))

    def _quad_combine(op, posted):
        x = np.asarray(posted, dtype=np.float32)
        x = op(x, x[_LANE ^ 1])  # the butterfly's two steps, in the hardware's order
        x = op(x, x[_LANE ^ 2])
        return list(x)

    def quad_max(x):
        """Maximum of ``x`` over the 4 lanes of this lane's quad (lanes 4g..4g+3)."""
        return _warp_collective(lambda posted: _quad_combine(np.maximum, posted), np.float32(x))

    def quad_sum(x):
        """Sum of ``x`` over the 4 lanes of this lane's quad, in butterfly order."""
        return _warp_collective(lambda posted: _quad_combine(np.add, posted), np.float32(x))

    def shuffle_xor_u32(x, lane_mask):
        """The ``x`` of lane ``lane ^ lane_mask`` (shfl.sync.bfly.b32 over the whole warp)."""
        mask = int(lane_mask)
        return _warp_collective(lambda posted: [posted[lane ^ mask] for lane in range(len(posted))], np.uint32(x))

    def warp_broadcast_u32(x):
        """Lane 0's ``x`` in every lane (shfl.sync.idx.b32 from lane 0 over the whole warp)."""
        return _warp_collective(lambda posted: [posted[0]] * len(posted), np.uint32(x))

    def warp_sync():
        """Wait until every lane of the warp has arrived (bar.warp.sync): shared-memory writes and
        landed cp.async copies of each lane are then visible to the others."""
        _warp_collective(lambda posted: posted, 0)

    def warp_all(x):
        """1 in every lane when ``x`` is nonzero in every lane of the warp, else 0 (vote.sync.all)."""
        return _warp_collective(lambda posted: [np.uint32(all(int(v) != 0 for v in posted))] * len(posted),
                                np.uint32(x))

else:
    from llvmlite import ir
    from numba.cuda import cgutils

    _i32 = ir.IntType(32)
    _i64 = ir.IntType(64)
    _f32 = ir.FloatType()

    def _asm(builder, ret, args, text, constraints, side_effect=False):
        ftype = ir.FunctionType(ret, [a.type for a in args])
        return builder.asm(ftype, text, constraints, list(args), side_effect)

    def _tuple(context, builder, tuple_type, struct, n):
        values = [builder.extract_value(struct, i) for i in range(n)]
        return context.make_tuple(builder, tuple_type, values)

    @intrinsic
    def shared_address(typingctx, arr):
        """The 32-bit shared-window address of ``arr[0]``, for a shared-memory array ``arr``."""
        sig = types.uint32(arr)

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            generic = builder.ptrtoint(data, _i64)
            window = _asm(builder, _i64, [generic], "cvta.to.shared.u64 $0, $1;", "=l,l")
            return builder.trunc(window, _i32)

        return sig, codegen

    @intrinsic
    def cp_async_16(typingctx, dst, src, i0, i1, i2, i3, src_bytes):
        """Copy the 16 bytes ``src[i0, i1, i2, i3:i3+8]`` to shared address ``dst`` asynchronously
        (cp.async.cg, bypassing L1); zero-fill instead when ``src_bytes`` is 0."""
        sig = types.void(types.uint32, src, types.intp, types.intp, types.intp, types.intp, types.uint32)

        def codegen(context, builder, signature, args):
            aryty = signature.args[1]
            ary = context.make_array(aryty)(context, builder, args[1])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, args[2:6])
            _asm(builder, ir.VoidType(), [args[0], builder.ptrtoint(ptr, _i64), args[6]],
                 "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def global_address(typingctx, x, i0, i1, i2, i3):
        """The address of ``x[i0, i1, i2, i3]`` as an int64 (int64, not uint64: Numba would turn
        uint64-int64 arithmetic into float64); the indices may lie outside the array."""
        sig = types.int64(x, types.intp, types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, args[1:5])
            return builder.ptrtoint(ptr, _i64)

        return sig, codegen

    @intrinsic
    def cp_async_16_from(typingctx, dst, src_address, src_bytes):
        """cp_async_16 from a global address (see global_address); zero-fill when src_bytes is 0."""
        sig = types.void(types.uint32, types.int64, types.uint32)

        def codegen(context, builder, signature, args):
            _asm(builder, ir.VoidType(), list(args), "cp.async.cg.shared.global [$0], [$1], 16, $2;",
                 "r,l,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def load_f32_cg(typingctx, address):
        """The float32 at a global address (see global_address), read at the L2 cache, past this
        multiprocessor's L1 (ld.global.cg): for data other blocks of the running kernel wrote."""
        sig = types.float32(types.int64)

        def codegen(context, builder, signature, args):
            return _asm(builder, _f32, list(args), "ld.global.cg.f32 $0, [$1];", "=f,l,~{memory}", side_effect=True)

        return sig, codegen

    @intrinsic
    def red_add_f32(typingctx, address, a):
        """Add ``a`` to the float32 at a global address (see global_address), atomically, the result
        unread (red.global.add.f32). By address: ``cuda.atomic.add(x, (i0, i1, i2, i3), a)`` wraps
        each signed index as Python does (a sign shift, an AND and an add apiece)."""
        sig = types.void(types.int64, types.float32)

        def codegen(context, builder, signature, args):
            _asm(builder, ir.VoidType(), list(args), "red.global.add.f32 [$0], $1;", "l,f,~{memory}",
                 side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def red_add_f32x2(typingctx, address, a, b):
        """Add ``a`` and ``b`` to the two float32 at a global address (see global_address), as one
        vector reduction (red.global.add.v2.f32, sm_90 and newer); 8-byte aligned address."""
        sig = types.void(types.int64, types.float32, types.float32)

        def codegen(context, builder, signature, args):
            _asm(builder, ir.VoidType(), list(args), "red.global.add.v2.f32 [$0], {$1, $2};",
                 "l,f,f,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def red_add_f32x4(typingctx, address, a, b, c, d):
        """Add ``a``, ``b``, ``c``, ``d`` to the four float32 at a global address (see
        global_address), as one vector reduction (red.global.add.v4.f32, sm_90 and newer); 16-byte
        aligned address."""
        sig = types.void(types.int64, types.float32, types.float32, types.float32, types.float32)

        def codegen(context, builder, signature, args):
            _asm(builder, ir.VoidType(), list(args), "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};",
                 "l,f,f,f,f,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def load_u32x4_nc(typingctx, address):
        """The 16 bytes at a global address (see global_address; 16-byte aligned) as four uint32,
        by the read-only path (ld.global.nc.v4.u32: for data no thread of the running kernel writes)."""
        ret = types.UniTuple(types.uint32, 4)
        sig = ret(types.int64)

        def codegen(context, builder, signature, args):
            struct = _asm(builder, ir.LiteralStructType([_i32] * 4), list(args),
                          "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
            return _tuple(context, builder, ret, struct, 4)

        return sig, codegen

    @intrinsic
    def load_u32x4_cg(typingctx, address):
        """The 16 bytes at a global address (16-byte aligned) as four uint32, read at the L2 cache,
        past this multiprocessor's L1 (ld.global.cg.v4.u32: for data other blocks of the running
        kernel wrote). Ordered as a memory access (not moved above a barrier or a fence)."""
        ret = types.UniTuple(types.uint32, 4)
        sig = ret(types.int64)

        def codegen(context, builder, signature, args):
            struct = _asm(builder, ir.LiteralStructType([_i32] * 4), list(args),
                          "ld.global.cg.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l,~{memory}", side_effect=True)
            return _tuple(context, builder, ret, struct, 4)

        return sig, codegen

    @intrinsic
    def store_u32(typingctx, address, word):
        """A uint32 to the 4 bytes at a global address (4-byte aligned): st.global.u32."""
        sig = types.void(types.int64, types.uint32)

        def codegen(context, builder, signature, args):
            _asm(builder, ir.VoidType(), list(args), "st.global.u32 [$0], $1;", "l,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def store_u32x4(typingctx, address, a, b, c, d):
        """Four uint32 to the 16 bytes at a global address (16-byte aligned): st.global.v4.u32."""
        sig = types.void(types.int64, types.uint32, types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, signature, args):
            _asm(builder, ir.VoidType(), list(args), "st.global.v4.u32 [$0], {$1, $2, $3, $4};",
                 "l,r,r,r,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def unpack_f16x2(typingctx, word):
        """The two float16 of a packed uint32 (the low 16 bits the first), widened to float32."""
        ret = types.UniTuple(types.float32, 2)
        sig = ret(types.uint32)

        def codegen(context, builder, signature, args):
            struct = _asm(builder, ir.LiteralStructType([_f32] * 2), list(args),
                          "{ .reg .f16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
                          "=f,=f,r")
            return _tuple(context, builder, ret, struct, 2)

        return sig, codegen

    @intrinsic
    def cp_async_commit(typingctx):
        """Close the group of cp.async copies this thread issued since the last commit."""
        sig = types.void()

        def codegen(context, builder, signature, args):
            _asm(builder, ir.VoidType(), [], "cp.async.commit_group;", "~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async_wait(typingctx, n):
        """Wait until at most ``n`` (a compile-time integer) of this thread's committed groups are
        still in flight. Other threads' copies become visible only after a barrier."""
        if not isinstance(n, types.IntegerLiteral):
            return None
        sig = types.void(n)
        pending = int(n.literal_value)

        def codegen(context, builder, signature, args):
            _asm(builder, ir.VoidType(), [], f"cp.async.wait_group {pending};", "~{memory}",
                 side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    def _ldmatrix(transpose):
        suffix = ".trans" if transpose else ""
        text = f"ldmatrix.sync.aligned.m8n8.x4{suffix}.shared.b16 {{$0, $1, $2, $3}}, [$4];"

        def typer(typingctx, addr):
            ret = types.UniTuple(types.uint32, 4)
            sig = ret(types.uint32)

            def codegen(context, builder, signature, args):
                struct = _asm(builder, ir.LiteralStructType([_i32] * 4), [args[0]], text,
                              "=r,=r,=r,=r,r", side_effect=True)  # volatile: ordered after waits/barriers
                return _tuple(context, builder, ret, struct, 4)

            return sig, codegen

        return typer

    ldmatrix_x4 = intrinsic(_ldmatrix(False))
    ldmatrix_x4_trans = intrinsic(_ldmatrix(True))

    def _mma(kind):
        text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

        def typer(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            ret = types.UniTuple(types.float32, 4)
            sig = ret(*([types.uint32] * 6 + [types.float32] * 4))

            def codegen(context, builder, signature, args):
                struct = _asm(builder, ir.LiteralStructType([_f32] * 4), args, text,
                              "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                return _tuple(context, builder, ret, struct, 4)

            return sig, codegen

        return typer

    mma_f16 = intrinsic(_mma("f16"))
    mma_bf16 = intrinsic(_mma("bf16"))

    def _pack(kind):
        # cvt.rn.{f16x2,bf16x2}.f32 d, a, b puts a in the upper half and b in the lower.
        text = f"cvt.rn.{kind}.f32 $0, $2, $1;"

        def typer(typingctx, lo, hi):
            sig = types.uint32(types.float32, types.float32)

            def codegen(context, builder, signature, args):
                return _asm(builder, _i32, args, text, "=r,f,f")

            return sig, codegen

        return typer

    pack_f16x2 = intrinsic(_pack("f16x2"))
    pack_bf16x2 = intrinsic(_pack("bf16x2"))

    def _unary_f32(text):
        """The typer of a float32 -> float32 intrinsic that is one PTX instruction ($0 <- f($1))."""

        def typer(typingctx, x):
            sig = types.float32(types.float32)

            def codegen(context, builder, signature, args):
                return _asm(builder, _f32, args, text, "=f,f")

            return sig, codegen

        return typer

    exp2_approx = intrinsic(_unary_f32("ex2.approx.ftz.f32 $0, $1;"))

    def _quad(op):
        text = ("{ .reg .f32 t; "
                f"shfl.sync.bfly.b32 t, $1, 1, 0x1f, 0xffffffff; {op}.f32 $0, $1, t; "
                f"shfl.sync.bfly.b32 t, $0, 2, 0x1f, 0xffffffff; {op}.f32 $0, $0, t; }}")

        def typer(typingctx, x):
            sig = types.float32(types.float32)

            def codegen(context, builder, signature, args):
                return _asm(builder, _f32, args, text, "=f,f", side_effect=True)

            return sig, codegen

        return typer

    quad_max = intrinsic(_quad("max"))
    quad_sum = intrinsic(_quad("add"))

    @intrinsic
    def shuffle_xor_u32(typingctx, x, lane_mask):
        """The ``x`` of lane ``lane ^ lane_mask`` (shfl.sync.bfly.b32 over the whole warp: every lane
        calls it, in warp-uniform control flow)."""
        sig = types.uint32(types.uint32, types.uint32)

        def codegen(context, builder, signature, args):
            return _asm(builder, _i32, args, "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r",
                        side_effect=True)

        return sig, codegen

    @intrinsic
    def warp_broadcast_u32(typingctx, x):
        """Lane 0's ``x`` in every lane (shfl.sync.idx.b32 over the whole warp: every lane calls it,
        in warp-uniform control flow). ptxas takes the result for warp-uniform, so what is made
        from it (a warpgroup's index, its wgmma descriptors) can live in uniform registers, where
        wgmma reads its descriptors; made from threadIdx it is moved there (R2UR) at every wgmma."""
        sig = types.uint32(types.uint32)

        def codegen(context, builder, signature, args):
            return _asm(builder, _i32, args, "shfl.sync.idx.b32 $0, $1, 0, 0x1f, 0xffffffff;", "=r,r",
                        side_effect=True)

        return sig, codegen

    @intrinsic
    def warp_all(typingctx, x):
        """1 in every lane when ``x`` is nonzero in every lane of the warp, else 0 (vote.sync.all
        with a full mask: every lane calls it, in warp-uniform control flow)."""
        sig = types.uint32(types.uint32)

        def codegen(context, builder, signature, args):
            text = ("{ .reg .pred p, q; setp.ne.u32 p, $1, 0; vote.sync.all.pred q, p, 0xffffffff; "
                    "selp.u32 $0, 1, 0, q; }")
            return _asm(builder, _i32, args, text, "=r,r", side_effect=True)

        return sig, codegen

    @intrinsic
    def warp_sync(typingctx):
        """Wait until every lane of the warp has arrived (bar.warp.sync with a full mask): each
        lane's shared-memory writes and landed cp.async copies are then visible to the others."""
        sig = types.void()

        def codegen(context, builder, signature, args):
            _asm(builder, ir.VoidType(), [], "bar.warp.sync 0xffffffff;", "~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen


# ---------------------------------------------------------------------------------------------------
# Special functions in one MUFU instruction each
#
# What the tensor-core kernels' score features (softcap's tanh) are built from, instead of libdevice's
# correctly rounded versions (a dozen instructions and, for a division, a branch to a slow path).
# ---------------------------------------------------------------------------------------------------

if SIMULATOR:

    def rcp_approx(x):
        """1 / x in float32 (rcp.approx.ftz on the GPU: within 1 ulp; subnormal inputs and results
        flushed to zero, so 1 / subnormal is an infinity)."""
        x = np.float32(x)
        if 0 < abs(x) < np.finfo(np.float32).tiny:
            x = np.float32(np.copysign(0.0, x))
        with np.errstate(divide="ignore"):
            y = np.float32(1) / x
        return y if abs(y) >= np.finfo(np.float32).tiny or y == 0 else np.float32(np.copysign(0.0, y))

    def tanh_approx(x):
        """tanh(x) in float32 to 11 significant bits (tanh.approx.f32 on the GPU, one MUFU.TANH: within a
        relative 2^-10.987 by the PTX ISA). Emulated at that precision, so that the simulator's results
        carry an error of the hardware's size."""
        mantissa, exponent = np.frexp(np.tanh(np.float32(x)))
        return np.float32(np.ldexp(np.round(mantissa * 2048.0) / 2048.0, exponent))

else:
    rcp_approx = intrinsic(_unary_f32("rcp.approx.ftz.f32 $0, $1;"))
    tanh_approx = intrinsic(_unary_f32("tanh.approx.f32 $0, $1;"))


# ---------------------------------------------------------------------------------------------------
# Compile-time loop unrolling
#
# A warp's tiles live in `cuda.local.array`s that must be indexed with constants to stay in registers.
# LLVM fully unrolls only small loop nests, and the tensor-core kernel's nests hold 64 mma.sync each,
# so loops over tiles are written `for i in static_range(N)` (N a constant: a literal or a closure /
# global name) and the function is decorated with `@unroll` under its `@cuda.jit`: the decorator
# rewrites such loops into N copies of their body with `i` replaced by 0 .. N-1, like Triton's
# `tl.static_range`.
# ---------------------------------------------------------------------------------------------------

import ast  # noqa: E402
import inspect  # noqa: E402
import textwrap  # noqa: E402


def static_range(*args):
    """``range`` whose loop `@unroll` expands at compile time. Never called in a function `@unroll`
    expanded, so a call means the decorator is missing: Numba would refuse the kernel ("Untyped
    global name 'static_range'"), and the simulator says so too instead of running the loop."""
    raise TypeError(f"static_range{args} outside an @unroll function: decorate the function that holds the "
                    "loop with @unroll (under @cuda.jit or @inline_device)")


def _substituted(node, name, value):
    """A copy of the AST ``node`` with every ``name`` replaced by the constant ``value``: what
    copy.deepcopy and then a NodeTransformer give, in one pass several times faster (the unrolled
    kernels copy their loop bodies tens of thousands of nodes a build). Leaves (strings, numbers,
    the shared Load/Store contexts) are immutable and stay shared."""
    if isinstance(node, ast.Name) and node.id == name:
        if not isinstance(node.ctx, ast.Load):
            raise SyntaxError(f"static_range loop variable {name!r} is assigned in its body")
        return ast.copy_location(ast.Constant(value), node)
    copied = node.__class__.__new__(node.__class__)
    for field, item in node.__dict__.items():
        if isinstance(item, ast.AST) and not isinstance(item, ast.expr_context):
            item = _substituted(item, name, value)
        elif isinstance(item, list):
            item = [_substituted(x, name, value) if isinstance(x, ast.AST) else x for x in item]
        setattr(copied, field, item)
    return copied


def _is_static_range(node):
    it = node.iter
    return isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "static_range"


class _UnrollStaticRanges(ast.NodeTransformer):
    def __init__(self, namespace):
        self.namespace = namespace

    def visit_For(self, node):
        it = node.iter
        if not _is_static_range(node):
            self.generic_visit(node)
            return node
        if node.orelse or not isinstance(node.target, ast.Name):
            raise SyntaxError("static_range loops take one plain variable and no else branch")
        for inner in ast.walk(node):
            if isinstance(inner, (ast.Break, ast.Continue)):
                raise SyntaxError("static_range loops cannot break or continue")
        bounds = [eval(compile(ast.Expression(a), "<static_range>", "eval"), self.namespace) for a in it.args]
        unrolled = []
        for value in range(*bounds):
            for stmt in node.body:
                stmt = _substituted(stmt, node.target.id, value)
                result = self.visit(stmt)  # inner static_range loops, now with constant bounds
                unrolled.extend(result if isinstance(result, list) else [result])
        return unrolled or [ast.Pass()]


# The unrolled code of a function, by its code object and the values its static_range bounds read
# (a kernel is built once per configuration, and many configurations share their bounds): the
# unrolled tree is a function of the source and those values alone, so a repeat build execs the code
# compiled the first time in its own namespace instead of unrolling and compiling again.
_UNROLLED = {}
_BOUND_NAMES = {}  # code object -> (source, the names static_range arguments read)
_MISSING = object()


def _unrolled_key(fn, namespace):
    """The cache key of ``fn`` unrolled in ``namespace``, or None where a bound reads a value that
    is not a plain int (no key then: unrolled afresh each time)."""
    code = fn.__code__
    if code not in _BOUND_NAMES:
        source = textwrap.dedent(inspect.getsource(fn))
        names = sorted({n.id for loop in ast.walk(ast.parse(source)) if isinstance(loop, ast.For)
                        and _is_static_range(loop) for a in loop.iter.args for n in ast.walk(a)
                        if isinstance(n, ast.Name)})
        _BOUND_NAMES[code] = source, tuple(names)
    source, names = _BOUND_NAMES[code]
    values = []
    for name in names:  # not in the namespace: a loop variable (set by outer bounds) or a builtin
        value = namespace.get(name, _MISSING)
        if value is not _MISSING and type(value) not in (int, bool):
            return source, None
        values.append(None if value is _MISSING else value)
    return source, (code.co_filename, code, tuple(values))


def unroll(fn):
    """Expand the ``static_range`` loops of ``fn`` (see above); returns a new function. Also under
    the simulator, so that CI runs the very code the GPU compiles."""
    namespace = dict(fn.__globals__)
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        namespace[name] = cell.cell_contents
    source, key = _unrolled_key(fn, namespace)
    code = _UNROLLED.get(key)
    if code is None:
        tree = ast.parse(source)
        tree.body[0].decorator_list = []
        tree = ast.fix_missing_locations(_UnrollStaticRanges(namespace).visit(tree))
        code = compile(tree, f"<unrolled {fn.__qualname__}>", "exec")
        if key is not None:
            _UNROLLED[key] = code
    if SIMULATOR:
        _numpy_scalar_casts(namespace)
    exec(code, namespace)
    return namespace[fn.__name__]


def inline_device(fn):
    """``@cuda.jit(device=True)`` whose calls are always inlined by NVVM (``forceinline``), so the
    caller's register arrays passed in stay registers; Numba's own IR-level inlining would do the
    same but compiles the unrolled tile loops several times slower. The simulator's jit takes no
    ``forceinline``."""
    from numba import cuda as _cuda

    if SIMULATOR:
        return _cuda.jit(device=True)(fn)
    return _cuda.jit(device=True, forceinline=True)(fn)
