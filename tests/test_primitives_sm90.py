"""The sm_90a primitives (nbflash/primitives_sm90.py) against NumPy.

As in test_primitives.py: each check launches a small kernel that builds operands following the
layouts written out in the module, calls the primitives, and compares what comes back with a direct
NumPy statement. Without a GPU this checks the simulator's emulations; the ``gpu``-marked test runs
the very same checks on the inline-PTX intrinsics (compute capability 9.0 only), which is what
makes the emulations trustworthy. ``scripts/check_sm90_ptx.py`` compiles every kernel here for
sm_90a and runs ptxas on it, with no GPU (``offline_kernels()`` lists them with their signatures).
"""

import numpy as np
import pytest
from numba import cuda, float32, uint16, uint32, uint64

from nbflash import primitives as P
from nbflash import primitives_sm90 as H

ml_dtypes = pytest.importorskip("ml_dtypes")


def _is_sm90():
    if P.SIMULATOR or not cuda.is_available():  # the offline compile check imports us with no GPU
        return False
    return cuda.get_current_device().compute_capability == (9, 0)


# sm_90a code runs only on compute capability 9.0: on any other GPU there is nothing to run.
pytestmark = pytest.mark.skipif(not P.SIMULATOR and not _is_sm90(),
                                reason="sm_90a instructions run only on compute capability 9.0")

TID = np.arange(128)
W, G, Q = TID // 32, (TID % 32) >> 2, (TID % 32) & 3


def _np_dtype(dtype):
    return {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "e4m3": ml_dtypes.float8_e4m3fn,
            "e5m2": ml_dtypes.float8_e5m2}[dtype]


def _bits(x, dtype):
    """x rounded to ``dtype``, as raw bits: uint16, or uint8 for the fp8 types."""
    np_dtype = _np_dtype(dtype)
    return np.asarray(x, dtype=np.float32).astype(np_dtype).view(np.uint8 if np_dtype(0).itemsize == 1 else np.uint16)


def _values(bits, dtype):
    return bits.view(_np_dtype(dtype)).astype(np.float64)


# --- elect.sync, setmaxnreg, fences -------------------------------------------------------------------

@H.launch_bounded(128)
def _small_kernel(out):
    # 4 warps: one warpgroup lowers its register cap, then raises it back, as a producer/consumer
    # kernel's roles would; the fences have no visible effect, only their placement is exercised.
    t = cuda.threadIdx.x
    H.setmaxnreg_dec(40)
    H.setmaxnreg_inc(232)
    elected = H.elect_sync()
    H.fence_proxy_async()
    H.wgmma_fence()
    out[t] = elected


def check_small():
    out = np.full(128, 7, dtype=np.uint32)
    _small_kernel[1, 128](out)
    elected = out.reshape(4, 32)
    np.testing.assert_array_equal(elected.sum(axis=1), 1)  # exactly one lane per warp
    if P.SIMULATOR:
        np.testing.assert_array_equal(elected[:, 0], 1)  # the emulation's choice: lane 0


def test_small():
    check_small()


@cuda.jit
def _copy_kernel(x, out, u, out_u):
    # copy_operands: each thread's four float32 and four uint32 values through the copying asm.
    t = cuda.threadIdx.x
    H.registers_to(out[t], H.copy_operands(H.registers_from(x[t], 4)))
    H.registers_to(out_u[t], H.copy_operands(H.registers_from(u[t], 4)))


def check_copy(rng):
    x = rng.standard_normal((32, 4)).astype(np.float32)
    u = rng.integers(0, 1 << 32, size=(32, 4), dtype=np.uint32)
    out, out_u = np.full_like(x, np.nan), np.zeros_like(u)
    _copy_kernel[1, 32](x, out, u, out_u)
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(out_u, u)


def test_copy_operands(rng):
    check_copy(rng)


# --- stmatrix: four 8x8 matrices of 16-bit elements from one warp's registers --------------------------

@cuda.jit
def _stmatrix_kernel(out):
    # Register i of lane (g, t) holds M_i[g, 2t:2t+2] = 1000 i + 8 g + 2 t and + 1; lane 8 i + r gives
    # row r of matrix i the 16-byte slot (8 i + r) ^ 5 of a 32-slot buffer (rows out of order, as a
    # swizzle places them).
    lane = cuda.threadIdx.x
    buf = cuda.shared.array(128, uint32)
    for w in range(4):
        buf[4 * lane + w] = uint32(0xFFFFFFFF)
    cuda.syncthreads()
    g, t = uint32(lane >> 2), uint32(lane & 3)
    low = 8 * g + 2 * t
    H.stmatrix_x4(P.shared_address(buf) + uint32(16 * (lane ^ 5)), low | ((low + 1) << 16),
                  (low + 1000) | ((low + 1001) << 16), (low + 2000) | ((low + 2001) << 16),
                  (low + 3000) | ((low + 3001) << 16))
    cuda.syncthreads()
    for w in range(4):
        out[4 * lane + w] = buf[4 * lane + w]


def check_stmatrix():
    out = np.zeros(128, dtype=np.uint32)
    _stmatrix_kernel[1, 32](out)
    slots = out.view(np.uint16).reshape(32, 8)
    expected = np.empty((32, 8), dtype=np.uint16)
    for i in range(4):
        for r in range(8):
            expected[(8 * i + r) ^ 5] = 1000 * i + 8 * r + np.arange(8)
    np.testing.assert_array_equal(slots, expected)


def test_stmatrix():
    check_stmatrix()


# --- Named barriers: bar.arrive / bar.sync hand-offs between warps ------------------------------------

ROUNDS = 4


@cuda.jit
def _named_barrier_kernel(out):
    # Warp 0 produces, warp 1 consumes, warp 2 is busy elsewhere (it never touches barriers 1 and 2,
    # which count 64 threads). Barrier 1: "slot full" (producer arrives, consumer syncs); barrier 2:
    # "slot empty" (consumer arrives, producer syncs), so the slot is reused ROUNDS times.
    t = cuda.threadIdx.x
    warp, lane = t // 32, t % 32
    slot = cuda.shared.array(32, uint32)
    for r in range(ROUNDS):
        if warp == 0:
            if r > 0:
                H.named_barrier_sync(2, 64)  # wait until the consumer has read the previous round
            slot[lane] = uint32(1000 * (r + 1) + lane)
            H.named_barrier_arrive(1, 64)  # the slot is full; go on without waiting
        elif warp == 1:
            H.named_barrier_sync(1, 64)  # wait for the producer's writes
            out[r, lane] = slot[(lane + 1) % 32]  # another lane's value: crosses threads
            H.named_barrier_arrive(2, 64)
    cuda.syncthreads()  # every round done before warp 2's final write
    if warp == 2:
        out[ROUNDS, lane] = uint32(lane)


def check_named_barriers():
    out = np.zeros((ROUNDS + 1, 32), dtype=np.uint32)
    _named_barrier_kernel[1, 96](out)
    lane = np.arange(32)
    expected = np.stack([1000 * (r + 1) + (lane + 1) % 32 for r in range(ROUNDS)] + [lane])
    np.testing.assert_array_equal(out, expected)


def test_named_barriers():
    check_named_barriers()


# --- mbarrier + 1-D bulk copy ---------------------------------------------------------------------

CHUNK = 128  # float16 elements per bulk copy: 256 bytes
PHASES = 3
BULK_ALIGNMENT = H.BULK_ALIGNMENT  # a global name: Numba needs the alignment as a literal


@cuda.jit
def _mbarrier_kernel(src, out, early):
    # One barrier, reused for PHASES phases. It expects 3 arrivals per phase: thread 0's
    # arrive.expect_tx (which also announces the copy's bytes) and plain arrivals from threads 32 and
    # 33. Thread 0 copies chunk p of src into shared memory; everyone waits for phase p (parity
    # p % 2), then reads the whole chunk.
    t = cuda.threadIdx.x
    bar_word = cuda.shared.array(1, uint64)
    tile = cuda.shared.array(CHUNK, uint16, alignment=BULK_ALIGNMENT)  # undeclared: 8 bytes after bar_word
    bar = P.shared_address(bar_word)
    if t == 0:
        H.mbarrier_init(bar, 3)
        H.fence_mbarrier_init()
    cuda.syncthreads()  # the barrier is initialised before anyone arrives or waits
    if t == 0:
        early[0] = H.mbarrier_try_wait_parity(bar, 0)  # nobody has arrived: 0
    cuda.syncthreads()  # that probe ran before the first arrivals
    for p in range(PHASES):
        if t == 0:
            H.mbarrier_arrive_expect_tx(bar, CHUNK * 2)
            H.bulk_copy_g2s(P.shared_address(tile), P.global_address(src, 0, 0, p, 0), CHUNK * 2, bar)
        if t == 32 or t == 33:
            H.mbarrier_arrive(bar)
        H.mbarrier_wait(bar, p % 2)
        if t == 0:
            early[p + 1] = H.mbarrier_try_wait_parity(bar, (p + 1) % 2)  # the next phase is open: 0
        for e in range(t, CHUNK, 64):
            out[p, e] = tile[e]
        cuda.syncthreads()  # the chunk is read by all before the next copy overwrites it


def check_mbarrier(rng):
    src = rng.standard_normal((1, 1, PHASES, CHUNK)).astype(np.float16)
    out = np.zeros((PHASES, CHUNK), dtype=np.uint16)
    early = np.full(PHASES + 1, 7, dtype=np.uint32)
    _mbarrier_kernel[1, 64](src, out, early)
    np.testing.assert_array_equal(out, src[0, 0].view(np.uint16))
    np.testing.assert_array_equal(early, 0)


def test_mbarrier_bulk_copy(rng):
    check_mbarrier(rng)


_wait_briefly = H.make_mbarrier_wait(3)


@cuda.jit
def _stuck_kernel(src):
    # The barrier expects 16 bytes more than the copy brings: its phase never completes.
    tile = cuda.shared.array(16, uint16, alignment=BULK_ALIGNMENT)
    bar_word = cuda.shared.array(1, uint64)
    bar = P.shared_address(bar_word)
    H.mbarrier_init(bar, 1)
    H.mbarrier_arrive_expect_tx(bar, 48)
    H.bulk_copy_g2s(P.shared_address(tile), P.global_address(src, 0, 0, 0, 0), 32, bar)
    _wait_briefly(bar, 0)


@pytest.mark.skipif(not P.SIMULATOR, reason="a trap on the GPU would end the test process's context")
def test_bounded_wait_traps():
    with pytest.raises(RuntimeError, match="trap"):
        _stuck_kernel[1, 1](np.zeros((1, 1, 1, 16), np.float16))


# --- Shared-memory matrix descriptors ---------------------------------------------------------------

@cuda.jit
def _descriptor_kernel(fields, out):
    for i in range(fields.shape[0]):
        out[i] = H.descriptor_bits(uint32(fields[i, 0]), uint32(fields[i, 1]), uint32(fields[i, 2]),
                                   uint32(fields[i, 3]))


def check_descriptor_bits():
    # (address, LBO, SBO, swizzle) and the descriptor written out by hand.
    fields = np.array([[0x1230, 128, 1024, H.SWIZZLE_128B], [0x3FFF0, 0, 0, H.SWIZZLE_NONE],
                       [0x40010, 0x3FFF0, 16, H.SWIZZLE_32B]], dtype=np.int64)
    expected = np.array([0x123 | (8 << 16) | (64 << 32) | (1 << 62), 0x3FFF,
                         0x001 | (0x3FFF << 16) | (1 << 32) | (3 << 62)], dtype=np.uint64)
    out = np.zeros(3, dtype=np.uint64)
    _descriptor_kernel[1, 1](fields, out)
    np.testing.assert_array_equal(out, expected)


def test_descriptor_bits():
    check_descriptor_bits()


# --- wgmma m64nNk16 ---------------------------------------------------------------------------------
#
# Shared-memory images of the operands (r: the M or N index, k: the K index, 16-bit elements, byte
# offsets), for K = 64 (a 128B-swizzle row) and the k16 step that moves the descriptor's start:
#   K-major, no swizzle:  (r % 8) 16 + (r // 8) SBO + (k // 8) LBO + (k % 8) 2   LBO 128, SBO 1024; step 2 LBO
#   K-major, 128B:        (r // 8) 1024 + (r % 8) 128 + ((k // 8) ^ (r % 8)) 16 + (k % 8) 2   SBO 1024; step 32
#   MN-major, 128B (B):   (k // 8) 1024 + (k % 8) 128 + (((n % 64) // 8) ^ (k % 8)) 16 + (n % 8) 2,
#                         N = 64 (one 64-wide group): SBO 1024; step 2048

N = 64
K = 64
REGS = N // 2
A_ELEMS = 64 * K  # shared-array sizes must be names of constants, not expressions
B_ELEMS = N * K
TILE_ALIGNMENT = H.TILE_ALIGNMENT  # a global name: Numba needs the alignment as a literal


def _image(x_bits, layout):
    """The uint16 shared image of x (rows r = M or N index, columns k) in ``layout``; x of 16-bit
    elements, or of 8-bit ones (uint8 bits, K-major: 16 k per 16-byte chunk, 128 per 128-byte row)."""
    rows, cols = x_bits.shape
    size = x_bits.dtype.itemsize
    per_chunk = 16 // size
    r, k = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    if layout == "kmajor_none":
        off = (r % 8) * 16 + (r // 8) * (128 * cols // per_chunk) + (k // per_chunk) * 128 + (k % per_chunk) * size
    elif layout == "kmajor_128b":
        off = (r // 8) * 1024 + (r % 8) * 128 + (((k // per_chunk) ^ (r % 8)) * 16) + (k % per_chunk) * size
    elif layout == "mnmajor_128b":  # x given as (n, k); n contiguous
        off = (k // 8) * 1024 + (k % 8) * 128 + ((((r % 64) // 8) ^ (k % 8)) * 16) + (r % 8) * 2
    image = np.zeros(rows * cols, dtype=x_bits.dtype)
    image[off.ravel() // size] = x_bits.ravel()
    return image.view(np.uint16)


# (LBO, SBO, swizzle, k16 step in bytes) per layout, for 64 rows (A) or N rows (B) and K = 64.
_DESCRIPTORS = {
    "kmajor_none": (128, 1024, H.SWIZZLE_NONE, 256),
    "kmajor_128b": (16, 1024, H.SWIZZLE_128B, 32),
    "mnmajor_128b": (K * 128, 1024, H.SWIZZLE_128B, 2048),
}


def _make_wgmma_kernel(ab, a_layout, b_layout, register_a):
    trans_b = 1 if b_layout.startswith("mn") else 0
    wgmma = (H.make_wgmma_rs if register_a else H.make_wgmma_ss)(N, ab, trans_b)
    lbo_a, sbo_a, swz_a, step_a = _DESCRIPTORS[a_layout]
    lbo_b, sbo_b, swz_b, step_b = _DESCRIPTORS[b_layout]

    @cuda.jit
    def kernel(a_image, b_image, a_regs, c, d, scale_first, rescale):
        # One warpgroup, K = 64 in four k16 wgmmas, the accumulator carried in registers from one to
        # the next: D = rescale (A0 B0 + C) + A1 B1, where 0 and 1 are the two halves of K and C is
        # dropped when scale_first is 0. The rescale between the halves is FA3's update of O: the
        # accumulator leaves the asynchronous unit (wait), is scaled in registers, and goes back.
        t = cuda.threadIdx.x
        sa = cuda.shared.array(A_ELEMS, uint16, alignment=TILE_ALIGNMENT)
        sb = cuda.shared.array(B_ELEMS, uint16, alignment=TILE_ALIGNMENT)
        for i in range(t, 64 * K, 128):
            sa[i] = a_image[i]
        for i in range(t, N * K, 128):
            sb[i] = b_image[i]
        H.fence_proxy_async()  # the generic-proxy stores are seen by wgmma (the async proxy)
        cuda.syncthreads()  # every thread's stores are in before any wgmma reads them
        desc_a = H.smem_descriptor(P.shared_address(sa), lbo_a, sbo_a, swz_a)
        desc_b = H.smem_descriptor(P.shared_address(sb), lbo_b, sbo_b, swz_b)
        acc = H.fence_operands(H.registers_from(c[t], REGS))
        o = cuda.local.array(REGS, float32)
        for half in range(2):
            s = 2 * half  # the half's k16 steps are s and s + 1
            scale = scale_first[0] if half == 0 else uint32(1)
            db0, db1 = desc_b + uint64(s * step_b // 16), desc_b + uint64((s + 1) * step_b // 16)
            if register_a:  # the A fragments are in registers before the fence (see make_wgmma_rs)
                a0 = H.fence_operands(H.registers_from(a_regs[s, t], 4))
                a1 = H.fence_operands(H.registers_from(a_regs[s + 1, t], 4))
            H.wgmma_fence()  # the accumulator's (and A's) register writes are ordered before wgmma reads them
            if register_a:
                acc = wgmma(acc, a0[0], a0[1], a0[2], a0[3], db0, scale)
                acc = wgmma(acc, a1[0], a1[1], a1[2], a1[3], db1, uint32(1))
            else:
                acc = wgmma(acc, desc_a + uint64(s * step_a // 16), db0, scale)
                acc = wgmma(acc, desc_a + uint64((s + 1) * step_a // 16), db1, uint32(1))
            H.wgmma_commit()
            H.wgmma_wait(0)  # the group is done: its accumulator may be read
            if half == 0:
                H.registers_to(o, H.fence_operands(acc))
                for r in range(REGS):
                    o[r] *= rescale[0]
                acc = H.fence_operands(H.registers_from(o, REGS))
        H.registers_to(d[t], H.fence_operands(acc))

    return kernel


def _acc_coords(n):
    r = np.arange(n // 2)
    rows = (16 * W + G)[:, None] + 8 * ((r[None, :] // 2) % 2)
    cols = 8 * (r[None, :] // 4) + 2 * Q[:, None] + r[None, :] % 2
    return rows, cols


def _a_registers(a_bits):
    """A (64 x K bits) as the RS form's registers: (K // 16, 128 threads, 4)."""
    rows, cols = _acc_coords(16)  # (128, 8): the 8 halves of a thread's 4 registers
    regs = np.empty((K // 16, 128, 4), dtype=np.uint32)
    for s in range(K // 16):
        halves = a_bits[:, 16 * s:16 * s + 16][rows, cols].astype(np.uint32)  # (128, 8)
        regs[s] = halves[:, 0::2] | (halves[:, 1::2] << 16)
    return regs


def _fp8_fragment_coords():
    """(row, k) of the 16 bytes of a thread's 4 fp8 A registers (register j, byte e): row 16 w + g +
    8 (j % 2), k 16 (j // 2) + 4 q + e. Arrays of shape (128, 16), register-major."""
    j, e = np.arange(16) // 4, np.arange(16) % 4
    rows = (16 * W + G)[:, None] + 8 * (j[None, :] % 2)
    cols = 16 * (j[None, :] // 2) + 4 * Q[:, None] + e[None, :]
    return rows, cols


def _a_registers_fp8(a_bits):
    """A (64 x K8 uint8 bits) as the fp8 RS form's registers: (K8 // 32, 128 threads, 4)."""
    rows, cols = _fp8_fragment_coords()
    steps = a_bits.shape[1] // 32
    regs = np.empty((steps, 128, 4), dtype=np.uint32)
    for s in range(steps):
        b = a_bits[:, 32 * s:32 * s + 32][rows, cols].astype(np.uint32).reshape(128, 4, 4)
        regs[s] = b[:, :, 0] | (b[:, :, 1] << 8) | (b[:, :, 2] << 16) | (b[:, :, 3] << 24)
    return regs


_wgmma_kernels = {}


def check_wgmma(ab, a_layout, b_layout, register_a, scale_first, rescale, rng):
    # fp8 (e4m3, e5m2): the same kernel and images in bytes: K8 = 128 one-byte elements fill the
    # 128-byte rows that K = 64 16-bit ones do, and its four k32 steps move the descriptors as the
    # four k16 steps do.
    fp8 = ab in ("e4m3", "e5m2")
    dtype = ab if fp8 else "float16" if ab == "f16" else "bfloat16"
    depth = 2 * K if fp8 else K
    a_bits = _bits(rng.standard_normal((64, depth)), dtype)
    b_bits = _bits(rng.standard_normal((N, depth)), dtype)  # B as (n, k)
    c = rng.standard_normal((64, N)).astype(np.float32)
    rows, cols = _acc_coords(N)
    key = (ab, a_layout, b_layout, register_a)  # scale_first and rescale are runtime values
    if key not in _wgmma_kernels:
        _wgmma_kernels[key] = _make_wgmma_kernel(*key)
    d = np.full((128, REGS), np.nan, dtype=np.float32)
    _wgmma_kernels[key][1, 128](_image(a_bits, a_layout), _image(b_bits, b_layout),
                                (_a_registers_fp8 if fp8 else _a_registers)(a_bits), c[rows, cols].copy(), d,
                                np.array([scale_first], dtype=np.uint32), np.array([rescale], dtype=np.float32))
    a, b, h = _values(a_bits, dtype), _values(b_bits, dtype), depth // 2
    expected = rescale * (a[:, :h] @ b[:, :h].T + (c if scale_first else 0)) + a[:, h:] @ b[:, h:].T
    if not fp8:
        # K = 64 products of 16-bit values summed in float32: a few float32 ulps of the sum's size.
        np.testing.assert_allclose(d, expected[rows, cols], rtol=1e-5, atol=1e-4)
        return
    # The emulation rounds once to float32. The GPU's fp8 accumulation is said to keep fewer bits in
    # its partial sums (about 14), so there the bound is 2^-10 of the sum of |terms|; a wrong layout
    # or k step is off by the size of the terms themselves.
    magnitude = abs(rescale) * (np.abs(a[:, :h]) @ np.abs(b[:, :h]).T + np.abs(c)) + np.abs(a[:, h:]) @ np.abs(b[:, h:]).T
    bound = (1e-6 if P.SIMULATOR else 2.0 ** -10) * magnitude[rows, cols] + 1e-6
    err = np.abs(d.astype(np.float64) - expected[rows, cols])
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst ratio to the bound {(err / bound).max():.3g}"


# (operands, A layout, B layout, A in registers, scale_d of the first k16 step, rescale halfway)
WGMMA_CASES = [
    ("f16", "kmajor_none", "kmajor_none", False, 1, 1.0),
    ("bf16", "kmajor_128b", "kmajor_128b", False, 0, 1.0),
    ("f16", "kmajor_128b", "mnmajor_128b", False, 1, 0.375),
    ("bf16", "kmajor_none", "mnmajor_128b", True, 1, 1.5),
    # fp8, m64nNk32: both operands K-major (all wgmma can read of 8-bit types)
    ("e4m3", "kmajor_none", "kmajor_none", False, 1, 1.0),
    ("e4m3", "kmajor_128b", "kmajor_128b", False, 0, 0.375),
    ("e4m3", "kmajor_none", "kmajor_128b", True, 1, 1.5),
    ("e5m2", "kmajor_128b", "kmajor_128b", True, 1, 1.0),
]


@pytest.mark.parametrize("case", WGMMA_CASES, ids=["-".join(map(str, c)) for c in WGMMA_CASES])
def test_wgmma(case, rng):
    check_wgmma(*case, rng)


# --- Two GEMMs chained in registers: S = Q K^T (SS), then O = P V (RS) with P = S as f16 ---------------
#
# FA3's pattern: a k16 slice s of the S accumulator is, register for register, the RS A fragment of P
# (registers 8s .. 8s+7 pack into a0..a3), so no data moves between threads.

_s_wgmma = H.make_wgmma_ss(N, "f16", 0)
_o_wgmma = H.make_wgmma_rs(N, "f16", 1)
_q_lbo, _q_sbo, _q_swz, _q_step = _DESCRIPTORS["kmajor_128b"]
_v_lbo, _v_sbo, _v_swz, _v_step = _DESCRIPTORS["mnmajor_128b"]


@cuda.jit
def _two_gemm_kernel(q_image, k_image, v_image, o):
    t = cuda.threadIdx.x
    sq = cuda.shared.array(A_ELEMS, uint16, alignment=TILE_ALIGNMENT)
    sk = cuda.shared.array(B_ELEMS, uint16, alignment=TILE_ALIGNMENT)
    sv = cuda.shared.array(B_ELEMS, uint16, alignment=TILE_ALIGNMENT)
    for i in range(t, A_ELEMS, 128):
        sq[i] = q_image[i]
    for i in range(t, B_ELEMS, 128):
        sk[i] = k_image[i]
        sv[i] = v_image[i]
    H.fence_proxy_async()  # the generic-proxy stores are seen by wgmma (the async proxy)
    cuda.syncthreads()  # every thread's stores are in before any wgmma reads them
    dq = H.smem_descriptor(P.shared_address(sq), _q_lbo, _q_sbo, _q_swz)
    dk = H.smem_descriptor(P.shared_address(sk), _q_lbo, _q_sbo, _q_swz)
    dv = H.smem_descriptor(P.shared_address(sv), _v_lbo, _v_sbo, _v_swz)
    zero = cuda.local.array(REGS, float32)
    for r in range(REGS):
        zero[r] = 0.0
    acc_s = H.fence_operands(H.registers_from(zero, REGS))
    H.wgmma_fence()  # the zeroed accumulator is ordered before wgmma reads it (scale_d 0 ignores it)
    for s in range(K // 16):
        acc_s = _s_wgmma(acc_s, dq + uint64(s * _q_step // 16), dk + uint64(s * _q_step // 16),
                         uint32(0 if s == 0 else 1))
    H.wgmma_commit()
    H.wgmma_wait(0)
    acc_s = H.fence_operands(acc_s)
    # P's A fragments: k16 slice s (S's columns 16 s .. 16 s + 15) is S's registers 8 s .. 8 s + 7,
    # packed in pairs. They go through fence_operands before wgmma_fence, so that the packing is
    # done before the wgmmas are issued (else ptxas serializes them, C7511).
    p = cuda.local.array(16, uint32)
    for j in range(16):
        p[j] = P.pack_f16x2(acc_s[2 * j], acc_s[2 * j + 1])
    p_regs = H.fence_operands(H.registers_from(p, 16))
    acc_o = acc_s  # any values: the first P V step has scale_d 0
    H.wgmma_fence()  # the A fragments are ordered before wgmma reads them
    for s in range(N // 16):
        acc_o = _o_wgmma(acc_o, p_regs[4 * s], p_regs[4 * s + 1], p_regs[4 * s + 2], p_regs[4 * s + 3],
                         dv + uint64(s * _v_step // 16), uint32(0 if s == 0 else 1))
    H.wgmma_commit()
    H.wgmma_wait(0)
    H.registers_to(o[t], H.fence_operands(acc_o))


def check_two_gemm(rng):
    q = _bits(rng.standard_normal((64, K)), "float16")
    k = _bits(rng.standard_normal((N, K)), "float16")
    v = _bits(rng.standard_normal((N, K)), "float16")  # V as (d, key): V^T's rows, for an MN-major image
    o = np.full((128, REGS), np.nan, dtype=np.float32)
    _two_gemm_kernel[1, 128](_image(q, "kmajor_128b"), _image(k, "kmajor_128b"), _image(v, "mnmajor_128b"), o)
    s_f32 = (_values(q, "float16") @ _values(k, "float16").T).astype(np.float32)
    p = s_f32.astype(np.float16).astype(np.float64)  # (64 queries, N keys)
    expected = p @ _values(v, "float16").T  # (64, 64): O[m, d] = sum_key P[m, key] V[key, d]
    rows, cols = _acc_coords(N)
    # S rounded to f16 may differ by one f16 ulp where the float32 sums differ in order.
    np.testing.assert_allclose(o, expected[rows, cols], rtol=2e-3, atol=2e-2)


def test_two_gemm_registers(rng):
    check_two_gemm(rng)


# --- fp8: e4m3 packing, and the two GEMMs with P in e4m3 registers ----------------------------------
#
# The fp8 A fragment is not the accumulator's layout: of the 16 keys of a half k32 slice, thread q of
# a quad holds the accumulator's columns 2q, 2q+1, 8+2q, 9+2q, while register j of A wants k
# positions 4q..4q+3. Packing a thread's own four values into one register needs no shuffle; it puts
# key 8c + 2q + e (c: which 8-column group, e: which of the pair) at k position 4q + 2c + e. The sum
# over keys does not care about their order as long as V's rows follow: V^T's k positions are
# permuted the same way (FP8_KEY_ORDER), wherever V is transposed. That is what an fp8 forward does.

FP8_KEY_ORDER = np.array([8 * ((p % 4) // 2) + 2 * (p // 4) + p % 2 for p in range(16)])  # key at k position p


@cuda.jit
def _pack_e4m3_kernel(x, out):
    t = cuda.threadIdx.x
    out[t] = H.pack_e4m3x4(x[t, 0], x[t, 1], x[t, 2], x[t, 3])


def check_pack_e4m3(rng):
    x = rng.standard_normal((32, 4)).astype(np.float32) * 40
    # saturation (satfinite: +-448, never NaN from a finite value), the largest normal, a tie
    # (2.0625 between 2 and 2.125: to even), the smallest subnormal, signed zero
    x[0] = [1000.0, -1000.0, 448.0, 2.0625]
    x[1] = [2.0 ** -9, -(2.0 ** -9), -0.0, 0.0]
    out = np.zeros(32, dtype=np.uint32)
    _pack_e4m3_kernel[1, 32](x, out)
    expected = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.uint32)
    expected = expected[:, 0] | (expected[:, 1] << 8) | (expected[:, 2] << 16) | (expected[:, 3] << 24)
    np.testing.assert_array_equal(out, expected)


def test_pack_e4m3(rng):
    check_pack_e4m3(rng)


FP8_K = 128  # Q and K: 128 one-byte elements a row (one 128-byte swizzled row)
_s_wgmma_fp8 = H.make_wgmma_ss(N, "e4m3")
_o_wgmma_fp8 = H.make_wgmma_rs(N, "e4m3")
_vt_lbo, _vt_sbo, _vt_step = 128, 512, 256  # V^T: 64 rows of 64 keys, K-major, no swizzle


@cuda.jit
def _two_gemm_fp8_kernel(q_image, k_image, vt_image, s_out, o):
    # S = Q K^T (SS, 4 k32 steps), P = e4m3(S) packed from the thread's own accumulators, then
    # O = P V (RS, 2 k32 steps over the 64 keys) with V^T's keys in FP8_KEY_ORDER.
    t = cuda.threadIdx.x
    sq = cuda.shared.array(A_ELEMS, uint16, alignment=TILE_ALIGNMENT)
    sk = cuda.shared.array(B_ELEMS, uint16, alignment=TILE_ALIGNMENT)
    sv = cuda.shared.array(B_ELEMS, uint16, alignment=TILE_ALIGNMENT)
    for i in range(t, A_ELEMS, 128):
        sq[i] = q_image[i]
    for i in range(t, B_ELEMS, 128):
        sk[i] = k_image[i]
        sv[i] = vt_image[i]
    H.fence_proxy_async()  # the generic-proxy stores are seen by wgmma (the async proxy)
    cuda.syncthreads()  # every thread's stores are in before any wgmma reads them
    dq = H.smem_descriptor(P.shared_address(sq), _q_lbo, _q_sbo, _q_swz)
    dk = H.smem_descriptor(P.shared_address(sk), _q_lbo, _q_sbo, _q_swz)
    dv = H.smem_descriptor(P.shared_address(sv), _vt_lbo, _vt_sbo, H.SWIZZLE_NONE)
    zero = cuda.local.array(REGS, float32)
    for r in range(REGS):
        zero[r] = 0.0
    acc_s = H.fence_operands(H.registers_from(zero, REGS))
    H.wgmma_fence()  # the zeroed accumulator is ordered before wgmma reads it (scale_d 0 ignores it)
    for s in range(FP8_K // 32):  # a k32 step is 32 bytes inside the swizzled row, as f16's k16
        acc_s = _s_wgmma_fp8(acc_s, dq + uint64(s * _q_step // 16), dk + uint64(s * _q_step // 16),
                             uint32(0 if s == 0 else 1))
    H.wgmma_commit()
    H.wgmma_wait(0)
    acc_s = H.fence_operands(acc_s)
    H.registers_to(s_out[t], acc_s)
    # P's A registers: k32 slice s is S's registers 16 s .. 16 s + 15; register j of it packs the
    # row's (j % 2) values of the 8-column groups 2 (j // 2) and 2 (j // 2) + 1.
    p = cuda.local.array(8, uint32)
    for s in range(2):
        for j in range(4):
            r0 = 16 * s + 8 * (j // 2) + 2 * (j % 2)
            p[4 * s + j] = H.pack_e4m3x4(acc_s[r0], acc_s[r0 + 1], acc_s[r0 + 4], acc_s[r0 + 5])
    p_regs = H.fence_operands(H.registers_from(p, 8))
    acc_o = acc_s  # any values: the first P V step has scale_d 0
    H.wgmma_fence()  # the A fragments are ordered before wgmma reads them
    for s in range(2):
        acc_o = _o_wgmma_fp8(acc_o, p_regs[4 * s], p_regs[4 * s + 1], p_regs[4 * s + 2], p_regs[4 * s + 3],
                             dv + uint64(s * _vt_step // 16), uint32(0 if s == 0 else 1))
    H.wgmma_commit()
    H.wgmma_wait(0)
    H.registers_to(o[t], H.fence_operands(acc_o))


def fp8_key_permuted(vt):
    """V^T (rows, keys) with the keys of each 16 in FP8_KEY_ORDER."""
    order = (np.arange(vt.shape[1]) // 16) * 16 + FP8_KEY_ORDER[np.arange(vt.shape[1]) % 16]
    return vt[:, order]


def check_two_gemm_fp8(rng):
    q = _bits(rng.standard_normal((64, FP8_K)) * 0.5, "e4m3")
    k = _bits(rng.standard_normal((N, FP8_K)) * 0.5, "e4m3")
    v = _bits(rng.standard_normal((N, 64)), "e4m3")  # (key, d)
    s_out = np.full((128, REGS), np.nan, dtype=np.float32)
    o = np.full((128, REGS), np.nan, dtype=np.float32)
    vt = fp8_key_permuted(np.ascontiguousarray(v.T))  # (d, key): the B operand, K-major
    vt_image = np.zeros(B_ELEMS, dtype=np.uint16)  # 64 x 64 bytes: half the tile's array
    vt_image[:vt.size // 2] = _image(vt, "kmajor_none")
    _two_gemm_fp8_kernel[1, 128](_image(q, "kmajor_128b"), _image(k, "kmajor_128b"), vt_image, s_out, o)
    rows, cols = _acc_coords(N)
    qv, kv, vv = (_values(x, "e4m3") for x in (q, k, v))
    s_ref = qv @ kv.T
    magnitude = np.abs(qv) @ np.abs(kv).T
    tol = 1e-6 if P.SIMULATOR else 2.0 ** -10  # see check_wgmma: the GPU's fp8 partial sums
    assert (np.abs(s_out - s_ref[rows, cols]) <= tol * magnitude[rows, cols] + 1e-6).all()
    # O against P = e4m3(the kernel's own S), so that a rounding of S that lands on the other side
    # of an e4m3 boundary does not count; the keys in natural order: the permutation must cancel.
    s_kernel = np.zeros((64, N))
    s_kernel[rows, cols] = s_out
    p = np.clip(s_kernel, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    expected = p @ vv
    bound = tol * (np.abs(p) @ np.abs(vv)) + 1e-6
    err = np.abs(o - expected[rows, cols])
    assert (err <= bound[rows, cols]).all(), f"max error {err.max():.3g}"


def test_two_gemm_fp8_registers(rng):
    check_two_gemm_fp8(rng)


# --- Two groups in flight: wait_group(1) frees the older while the newer runs ------------------------

@cuda.jit
def _two_groups_kernel(a_image, b_image, c, d_first, d_second):
    # Group 1: acc1 = C + A0 B0 (K's first half); group 2: acc2 = A1 B1 (the second half), issued
    # before group 1 is waited for. wait_group(1) then lets acc1 be read while group 2 may still run.
    t = cuda.threadIdx.x
    sa = cuda.shared.array(A_ELEMS, uint16, alignment=TILE_ALIGNMENT)
    sb = cuda.shared.array(B_ELEMS, uint16, alignment=TILE_ALIGNMENT)
    for i in range(t, A_ELEMS, 128):
        sa[i] = a_image[i]
    for i in range(t, B_ELEMS, 128):
        sb[i] = b_image[i]
    H.fence_proxy_async()  # the generic-proxy stores are seen by wgmma (the async proxy)
    cuda.syncthreads()  # every thread's stores are in before any wgmma reads them
    da = H.smem_descriptor(P.shared_address(sa), _q_lbo, _q_sbo, _q_swz)
    db = H.smem_descriptor(P.shared_address(sb), _q_lbo, _q_sbo, _q_swz)
    acc1 = H.fence_operands(H.registers_from(c[t], REGS))
    # acc2 needs registers of its own (any values: its first step has scale_d 0). As ``acc2 = acc1``
    # the compiler copied acc1 for the first group, after the fence (ptxas: C7519, see wgmma_fence).
    acc2 = H.fence_operands(acc1)
    H.wgmma_fence()  # both accumulators' register writes are ordered before wgmma reads them
    for s in range(2):
        acc1 = _s_wgmma(acc1, da + uint64(s * _q_step // 16), db + uint64(s * _q_step // 16), uint32(1))
    H.wgmma_commit()
    for s in range(2, 4):
        acc2 = _s_wgmma(acc2, da + uint64(s * _q_step // 16), db + uint64(s * _q_step // 16),
                        uint32(0 if s == 2 else 1))
    H.wgmma_commit()
    H.wgmma_wait(1)  # the first group is done, the second may not be
    H.registers_to(d_first[t], H.fence_operands(acc1))
    H.wgmma_wait(0)
    H.registers_to(d_second[t], H.fence_operands(acc2))


def check_two_groups(rng):
    a = _bits(rng.standard_normal((64, K)), "float16")
    b = _bits(rng.standard_normal((N, K)), "float16")
    c = rng.standard_normal((64, N)).astype(np.float32)
    rows, cols = _acc_coords(N)
    first = np.full((128, REGS), np.nan, dtype=np.float32)
    second = np.full((128, REGS), np.nan, dtype=np.float32)
    _two_groups_kernel[1, 128](_image(a, "kmajor_128b"), _image(b, "kmajor_128b"), c[rows, cols].copy(),
                               first, second)
    a, b, h = _values(a, "float16"), _values(b, "float16"), K // 2
    np.testing.assert_allclose(first, (a[:, :h] @ b[:, :h].T + c)[rows, cols], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(second, (a[:, h:] @ b[:, h:].T)[rows, cols], rtol=1e-5, atol=1e-4)


def test_two_groups_in_flight(rng):
    check_two_groups(rng)


# --- TMA: 2-D tile loads through a tensor map ----------------------------------------------------------

BOX_ROWS, BOX_COLS = 64, 64  # 128-byte box rows: what the 128B swizzle takes
BOX_ELEMS = BOX_ROWS * BOX_COLS
TMA_CORNERS = ((0, 0), (16, 50), (40, 8))  # (c0 = column, c1 = row); the last two leave the tensor


@cuda.jit
def _tma_kernel(tensor_map, corners, out):
    # Thread 0 loads one box per phase of one mbarrier; everyone waits, then copies the shared image
    # out as it lies (swizzled or not).
    t = cuda.threadIdx.x
    bar_word = cuda.shared.array(1, uint64)
    tile = cuda.shared.array(BOX_ELEMS, uint16, alignment=TILE_ALIGNMENT)
    bar = P.shared_address(bar_word)
    tmap = H.array_address(tensor_map)
    if t == 0:
        H.mbarrier_init(bar, 1)
        H.fence_mbarrier_init()
        H.fence_proxy_tensormap_acquire(tmap)  # the map was copied from the host
    cuda.syncthreads()  # the barrier is initialised before anyone waits on it
    for p in range(corners.shape[0]):
        if t == 0:
            H.mbarrier_arrive_expect_tx(bar, BOX_ELEMS * 2)  # the full box, even out of bounds
            H.tma_load_2d(P.shared_address(tile), tmap, corners[p, 0], corners[p, 1], bar)
        H.mbarrier_wait(bar, p % 2)
        for i in range(t, BOX_ELEMS, 64):
            out[p, i] = tile[i]
        cuda.syncthreads()  # the box is read by all before the next load overwrites it


def check_tma(swizzle, xp, rng):
    x = rng.integers(0, 1 << 16, size=(100, 72), dtype=np.uint16)  # 144-byte rows
    corners = np.asarray(TMA_CORNERS, dtype=np.int32)
    x_dev = xp.asarray(x)
    tensor_map = H.make_tensor_map_2d(x_dev, BOX_ROWS, BOX_COLS, swizzle)
    out = xp.zeros((len(TMA_CORNERS), BOX_ELEMS), dtype=np.uint16)
    _tma_kernel[1, 64](tensor_map, xp.asarray(corners), out)
    out = out.get() if hasattr(out, "get") else out
    padded = np.zeros((100 + BOX_ROWS, 72 + BOX_COLS), dtype=np.uint16)
    padded[:100, :72] = x
    for p, (c0, c1) in enumerate(TMA_CORNERS):
        box = padded[c1:c1 + BOX_ROWS, c0:c0 + BOX_COLS]
        expected = _image(box, "kmajor_128b") if swizzle == H.SWIZZLE_128B else box.ravel()
        np.testing.assert_array_equal(out[p], expected)


def _make_box_kernel(issue, elems, dtype):
    """A kernel that, for each corner p, writes one box image of ``elems`` elements of ``dtype``
    (swizzled as a TMA load leaves one) into shared memory with ordinary stores, then has thread 0
    hand it to ``issue(tmap, corners, p, tile)`` (a TMA store or reduce-add at corners[p]) and wait
    until the tile has been read."""

    @cuda.jit
    def box_kernel(tensor_map, corners, boxes):
        t = cuda.threadIdx.x
        tile = cuda.shared.array(elems, dtype, alignment=TILE_ALIGNMENT)
        tmap = H.array_address(tensor_map)
        if t == 0:
            H.fence_proxy_tensormap_acquire(tmap)  # the map was copied from the host
        for p in range(corners.shape[0]):
            for i in range(t, elems, 64):
                tile[i] = boxes[p, i]
            H.fence_proxy_async()  # this thread's stores are seen by the TMA unit (the async proxy)
            cuda.syncthreads()  # every thread's part of the tile is in before the copy reads it
            if t == 0:
                issue(tmap, corners, p, P.shared_address(tile))
                H.tma_store_commit()
                H.tma_store_wait(0)  # the tile has been read: it may be overwritten
            cuda.syncthreads()  # nobody overwrites the tile before thread 0's wait

    return box_kernel


@cuda.jit(device=True)
def _store_2d(tmap, corners, p, tile):  # corner (c0 column, c1 row)
    H.tma_store_2d(tmap, corners[p, 0], corners[p, 1], tile)


@cuda.jit(device=True)
def _store_4d(tmap, corners, p, tile):  # corner (c0 headdim, c1 head, c2 row, c3 batch)
    H.tma_store_4d(tmap, corners[p, 0], corners[p, 1], corners[p, 2], corners[p, 3], tile)


@cuda.jit(device=True)
def _reduce_add_4d(tmap, corners, p, tile):
    H.tma_reduce_add_4d(tmap, corners[p, 0], corners[p, 1], corners[p, 2], corners[p, 3], tile)


_tma_store_kernel = _make_box_kernel(_store_2d, BOX_ELEMS, uint16)


def check_tma_store(swizzle, xp, rng):
    # Boxes at disjoint places (the last two partly outside the tensor) of a poisoned tensor: the
    # order in which two stores reach global memory is not defined. Every c0 is a multiple of 8
    # elements (16 bytes), as TMA requires (c0 = 100 faulted on the H200: illegal instruction).
    corners = ((0, 0), (96, 0), (8, 64))
    x = np.full((100, 136), 0xABCD, dtype=np.uint16)
    boxes = rng.integers(0, 1 << 16, size=(len(corners), BOX_ROWS, BOX_COLS), dtype=np.uint16)
    images = np.stack([_image(b, "kmajor_128b") if swizzle == H.SWIZZLE_128B else b.ravel() for b in boxes])
    x_dev = xp.asarray(x)
    tensor_map = H.make_tensor_map_2d(x_dev, BOX_ROWS, BOX_COLS, swizzle)
    _tma_store_kernel[1, 64](tensor_map, xp.asarray(np.asarray(corners, dtype=np.int32)), xp.asarray(images))
    got = x_dev.get() if hasattr(x_dev, "get") else x_dev
    expected = np.full((100 + BOX_ROWS, 136 + BOX_COLS), 0xABCD, dtype=np.uint16)
    for (c0, c1), box in zip(corners, boxes):
        expected[c1:c1 + BOX_ROWS, c0:c0 + BOX_COLS] = box
    np.testing.assert_array_equal(got, expected[:100, :136])


STORE4_ROWS, STORE4_COLS = 64, 64  # a 16-bit box of 128-byte rows (a backward epilogue's chunk)
STORE4_ELEMS = STORE4_ROWS * STORE4_COLS


_tma_store_4d_kernel = _make_box_kernel(_store_4d, STORE4_ELEMS, uint16)


def test_tma_store_4d(xp, rng):
    """Boxes of 64 rows x 64 16-bit columns stored by TMA into a poisoned (2, 100, 3, 136) tensor
    (batch, rows, heads, headdim), at disjoint places: one inside, one past the rows' end (a tile's
    tail: rows 64-127 of 100), one past the headdim's end (columns 128-191 of 136), each box
    swizzled (128B) as a load leaves it. Only the parts inside the tensor are written; every other
    element keeps its poison."""
    x = np.full((2, 100, 3, 136), 0xABCD, dtype=np.uint16)
    corners = np.asarray([(64, 1, 0, 0), (0, 2, 64, 1), (128, 0, 20, 1)], dtype=np.int32)
    boxes = rng.integers(0, 1 << 16, size=(len(corners), STORE4_ROWS, STORE4_COLS), dtype=np.uint16)
    images = np.stack([_image(b, "kmajor_128b") for b in boxes])
    x_dev = xp.asarray(x.copy())
    tensor_map = H.make_tensor_map_4d(x_dev, (1, STORE4_ROWS, 1, STORE4_COLS), H.SWIZZLE_128B)
    _tma_store_4d_kernel[1, 64](tensor_map, xp.asarray(corners), xp.asarray(images))
    got = x_dev.get() if hasattr(x_dev, "get") else x_dev
    expected = np.full((2, 100 + STORE4_ROWS, 3, 136 + STORE4_COLS), 0xABCD, dtype=np.uint16)
    for (c0, c1, c2, c3), box in zip(corners, boxes):
        expected[c3, c2:c2 + STORE4_ROWS, c1, c0:c0 + STORE4_COLS] = box
    np.testing.assert_array_equal(got, expected[:, :100, :, :136])


RED_ROWS, RED_COLS = 64, 32  # a float32 box of 128-byte rows: what the 128B swizzle takes
RED_ELEMS = RED_ROWS * RED_COLS


_tma_reduce_kernel = _make_box_kernel(_reduce_add_4d, RED_ELEMS, float32)


def _swizzled_f32(box):
    """The 128B-swizzled image of a (rows, 32) float32 box: 16-byte chunk j of row r at j ^ (r % 8)."""
    rows = box.shape[0]
    chunks = np.ascontiguousarray(box, dtype=np.float32).view(np.uint8).reshape(rows, 8, 16)
    image = np.empty_like(chunks)
    for r in range(rows):
        image[r, np.arange(8) ^ (r % 8)] = chunks[r]
    return image.reshape(-1).view(np.float32)


def check_tma_reduce(xp, rng):
    # Boxes added into a (2, 100, 3, 72) float32 tensor (batch, rows, heads, headdim) holding random
    # values: two overlapping ones (their sums add), one partly past the rows and the headdim's
    # end (the outside is dropped), one ending at the last row; c0 multiples of 4 elements (16
    # bytes). No box starts before the tensor: on the H200 a negative coordinate (row -16, or
    # c0 = -32) faulted with an illegal instruction (test_tma_reduce_refuses_negative_coordinates).
    x = rng.standard_normal((2, 100, 3, 72)).astype(np.float32)
    corners = np.asarray([(0, 1, 0, 0), (0, 1, 32, 0), (64, 2, 80, 1), (32, 0, 36, 1)], dtype=np.int32)
    boxes = rng.standard_normal((len(corners), RED_ROWS, RED_COLS)).astype(np.float32)
    images = np.stack([_swizzled_f32(b) for b in boxes])
    x_dev = xp.asarray(x.copy())  # the simulator's array is x itself otherwise
    tensor_map = H.make_tensor_map_4d(x_dev, (1, RED_ROWS, 1, RED_COLS), H.SWIZZLE_128B)
    _tma_reduce_kernel[1, 64](tensor_map, xp.asarray(corners), xp.asarray(images))
    got = x_dev.get() if hasattr(x_dev, "get") else x_dev
    expected = np.zeros((2, 100 + 2 * RED_ROWS, 3, 72 + RED_COLS), np.float64)
    expected[:, RED_ROWS:RED_ROWS + 100, :, :72] = x
    for (c0, c1, c2, c3), box in zip(corners, boxes):
        expected[c3, RED_ROWS + c2:RED_ROWS + c2 + RED_ROWS, c1, c0:c0 + RED_COLS] += box
    np.testing.assert_allclose(got, expected[:, RED_ROWS:RED_ROWS + 100, :, :72], rtol=1e-6, atol=1e-6)


def test_tma_reduce_add_4d(xp, rng):
    check_tma_reduce(xp, rng)


WORDS = 256


@cuda.jit
def _store_shared_u32_kernel(out, places, values):
    # Thread t writes values[t] at word places[t] of a shared tile of WORDS words (set to a poison
    # first) by its shared address, then the block copies the tile out.
    t = cuda.threadIdx.x
    tile = cuda.shared.array(WORDS, uint32)
    for i in range(t, WORDS, 64):
        tile[i] = uint32(0xDEADBEEF)
    cuda.syncthreads()
    H.store_shared_u32(P.shared_address(tile) + uint32(4) * uint32(places[t]), values[t])
    cuda.syncthreads()
    for i in range(t, WORDS, 64):
        out[i] = tile[i]


def test_store_shared_u32(xp, rng):
    """st.shared.u32 by address: 64 threads' words at distinct scattered places of a poisoned tile
    (values with the high bit set among them) land there and nowhere else."""
    places = rng.permutation(WORDS)[:64].astype(np.int32)
    values = rng.integers(0, 1 << 32, size=64, dtype=np.uint64).astype(np.uint32)
    values[0] = 0xFFFFFFFF
    out = xp.zeros(WORDS, dtype=np.uint32)
    _store_shared_u32_kernel[1, 64](out, xp.asarray(places), xp.asarray(values))
    got = out.get() if hasattr(out, "get") else out
    expected = np.full(WORDS, 0xDEADBEEF, dtype=np.uint32)
    expected[places] = values
    np.testing.assert_array_equal(got, expected)


BULK_ROWS, BULK_COLS, BULK_STRIDE = 8, 72, 80  # rows of 288 bytes, 320 apart in shared memory
BULK_TILE = BULK_ROWS * BULK_STRIDE  # a literal for cuda.shared.array


@cuda.jit
def _bulk_reduce_kernel(x, first_rows, values):
    # Block p writes its (BULK_ROWS, BULK_COLS) float32 values into shared memory four by four
    # (16-byte stores), rows BULK_STRIDE floats apart, then thread r < BULK_ROWS adds row r into
    # x[p % 2, first_rows[p] + r, 1, :] by one bulk reduce-add and waits until it has been read.
    # The blocks' rows overlap: their additions meet in global memory.
    t, p = cuda.threadIdx.x, cuda.blockIdx.x
    tile = cuda.shared.array(BULK_TILE, float32, alignment=BULK_ALIGNMENT)
    tile_address = P.shared_address(tile)
    for quad in range(t, BULK_ROWS * BULK_COLS // 4, 64):
        r, c = quad // (BULK_COLS // 4), 4 * (quad % (BULK_COLS // 4))
        H.store_shared_f32x4(tile_address + uint32(4 * (r * BULK_STRIDE + c)), values[p, r, c],
                             values[p, r, c + 1], values[p, r, c + 2], values[p, r, c + 3])
    H.fence_proxy_async()  # the stores are ordered before the bulk copies read them
    cuda.syncthreads()
    if t < BULK_ROWS:
        H.bulk_reduce_add_f32(P.global_address(x, p % 2, first_rows[p] + t, 1, 0),
                              tile_address + uint32(4 * t * BULK_STRIDE), uint32(4 * BULK_COLS))
        H.tma_store_commit()
        H.tma_store_wait(0)


def test_bulk_reduce_add_f32(xp, rng):
    """Rows of float32 staged by 16-byte shared stores and added into a (2, 40, 3, 72) tensor by bulk
    reduce-adds: four blocks, two on each batch, their rows overlapping (3..10 and 6..13: the
    overlap gets both), the tensor's other elements untouched."""
    x = rng.standard_normal((2, 40, 3, BULK_COLS)).astype(np.float32)
    first_rows = np.asarray([3, 20, 6, 32], dtype=np.int32)
    values = rng.standard_normal((4, BULK_ROWS, BULK_COLS)).astype(np.float32)
    x_dev = xp.asarray(x.copy())
    _bulk_reduce_kernel[4, 64](x_dev, xp.asarray(first_rows), xp.asarray(values))
    got = x_dev.get() if hasattr(x_dev, "get") else x_dev
    expected = x.astype(np.float64)
    for p, first in enumerate(first_rows):
        expected[p % 2, first:first + BULK_ROWS, 1] += values[p]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not P.SIMULATOR, reason="the emulation's checks; the GPU faults")
def test_bulk_reduce_add_refuses_misaligned_sizes():
    x = np.zeros((1, 4, 1, 8), np.float32)

    @cuda.jit
    def kernel(x, nbytes):
        tile = cuda.shared.array(16, float32, alignment=BULK_ALIGNMENT)
        H.bulk_reduce_add_f32(P.global_address(x, 0, 0, 0, 0), P.shared_address(tile), nbytes[0])

    with pytest.raises(ValueError, match="multiple of 16"):
        kernel[1, 1](x, np.asarray([24], np.uint32))


@pytest.mark.skipif(not P.SIMULATOR, reason="the GPU faults (illegal instruction), ending the test process's context")
@pytest.mark.parametrize("corner", [(0, 0, -16, 0), (-32, 0, 0, 0)], ids=["row", "innermost"])
def test_tma_reduce_refuses_negative_coordinates(corner):
    x = np.zeros((1, 100, 1, 72), np.float32)  # outlives the map, which names its memory
    tensor_map = H.make_tensor_map_4d(x, (1, RED_ROWS, 1, RED_COLS), H.SWIZZLE_128B)
    images = np.zeros((1, RED_ELEMS), np.float32)
    with pytest.raises(ValueError, match="negative coordinate"):
        _tma_reduce_kernel[1, 64](tensor_map, np.asarray([corner], dtype=np.int32), images)


@pytest.mark.parametrize("swizzle", [H.SWIZZLE_NONE, H.SWIZZLE_128B], ids=["none", "128b"])
def test_tma_2d(swizzle, xp, rng):
    check_tma(swizzle, xp, rng)
    check_tma_store(swizzle, xp, rng)


@cuda.jit
def _tma_corner_kernel(tensor_map, c0):
    tile = cuda.shared.array(BOX_ELEMS, uint16, alignment=TILE_ALIGNMENT)
    H.tma_store_2d(H.array_address(tensor_map), c0, 0, P.shared_address(tile))


@pytest.mark.skipif(not P.SIMULATOR, reason="the GPU faults (illegal instruction), ending the test process's context")
def test_tma_innermost_coordinate_aligned():
    # A box whose rows start off a 16-byte boundary: c0 = 100 16-bit elements is 200 bytes.
    x = np.zeros((100, 136), np.uint16)  # outlives the map, which names its memory
    tensor_map = H.make_tensor_map_2d(x, BOX_ROWS, BOX_COLS)
    _tma_corner_kernel[1, 1](tensor_map, -8)  # a multiple of 8 elements: fine, even outside the tensor
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        _tma_corner_kernel[1, 1](tensor_map, 100)


# --- On the GPU (compute capability 9.0): every check, several draws ----------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(P.SIMULATOR, reason="checks the inline-PTX intrinsics; needs a GPU")
def test_sm90_intrinsics_on_gpu(xp):
    rng = np.random.default_rng(90)
    for _ in range(5):
        check_small()
        check_copy(rng)
        check_descriptor_bits()
        check_named_barriers()
        check_stmatrix()
        check_mbarrier(rng)
        for case in WGMMA_CASES:
            check_wgmma(*case, rng)
        check_two_gemm(rng)
        check_pack_e4m3(rng)
        check_two_gemm_fp8(rng)
        check_two_groups(rng)
        for swizzle in (H.SWIZZLE_NONE, H.SWIZZLE_128B):
            check_tma(swizzle, xp, rng)
            check_tma_store(swizzle, xp, rng)
        check_tma_reduce(xp, rng)


# --- Offline: every kernel above compiles for sm_90a and assembles (scripts/check_sm90_ptx.py) --------

def _offline_toolchain():
    """ptxas (the CUDA toolkit or the nvidia-cuda-nvcc wheel) and a Numba that can compile PTX
    without a GPU (NVVM and NVRTC: numba-cuda's CUDA extra). CI has neither compiler library."""
    import os
    import subprocess
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    from prebuild_cache import cuda_tool

    try:
        cuda_tool("ptxas")
    except SystemExit:  # cuda_tool exits when neither the toolkit nor the nvcc wheel has ptxas
        return False
    probe = ("import os; os.environ.pop('NUMBA_ENABLE_CUDASIM', None)\n"
             "from numba import cuda\n"
             "def k(x):\n    x[0] = 1\n"
             "cuda.compile_ptx(k, 'void(int32[:])', cc=(9, 0))")
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_ENABLE_CUDASIM"}
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, env=env, timeout=300).returncode == 0


@pytest.mark.skipif(not _offline_toolchain(),
                    reason="needs ptxas and Numba's offline compilers (NVVM, NVRTC: numba-cuda[cu12] or [cu13])")
def test_sm90a_kernels_assemble():
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")
    run = subprocess.run([sys.executable, os.path.join(root, "scripts", "check_sm90_ptx.py")],
                         capture_output=True, text=True, cwd=root, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr


def offline_kernels():
    """(name, Python function, signature, compile options) of every kernel above."""
    from numba import types

    u16_1d = types.Array(types.uint16, 1, "C")
    f32_2d = types.Array(types.float32, 2, "C")
    kernels = [
        ("small", _small_kernel, (types.Array(types.uint32, 1, "C"),), {"launch_bounds": (128, 1)}),
        ("copy_operands", _copy_kernel, (f32_2d, f32_2d, types.Array(types.uint32, 2, "C"),
                                         types.Array(types.uint32, 2, "C")), {}),
        ("descriptor_bits", _descriptor_kernel, (types.Array(types.int64, 2, "C"), types.Array(types.uint64, 1, "C")),
         {}),
        ("named_barriers", _named_barrier_kernel, (types.Array(types.uint32, 2, "C"),), {}),
        ("stmatrix", _stmatrix_kernel, (types.Array(types.uint32, 1, "C"),), {}),
        ("mbarrier_bulk_copy", _mbarrier_kernel,
         (types.Array(types.float16, 4, "C"), types.Array(types.uint16, 2, "C"),
          types.Array(types.uint32, 1, "C")), {}),
        ("bounded_wait", _stuck_kernel, (types.Array(types.float16, 4, "C"),), {}),
        ("wgmma_two_gemm", _two_gemm_kernel, (u16_1d, u16_1d, u16_1d, f32_2d), {}),
        ("pack_e4m3", _pack_e4m3_kernel, (f32_2d, types.Array(types.uint32, 1, "C")), {}),
        ("wgmma_fp8_two_gemm", _two_gemm_fp8_kernel, (u16_1d, u16_1d, u16_1d, f32_2d, f32_2d), {}),
        ("wgmma_two_groups", _two_groups_kernel, (u16_1d, u16_1d, f32_2d, f32_2d, f32_2d), {}),
        ("tma_load_2d", _tma_kernel, (types.Array(types.uint64, 1, "C"), types.Array(types.int32, 2, "C"),
                                      types.Array(types.uint16, 2, "C")), {}),
        ("tma_store_2d", _tma_store_kernel, (types.Array(types.uint64, 1, "C"), types.Array(types.int32, 2, "C"),
                                             types.Array(types.uint16, 2, "C")), {}),
        ("tma_store_corner", _tma_corner_kernel, (types.Array(types.uint64, 1, "C"), types.int32), {}),
        ("tma_store_4d", _tma_store_4d_kernel, (types.Array(types.uint64, 1, "C"), types.Array(types.int32, 2, "C"),
                                                 types.Array(types.uint16, 2, "C")), {}),
        ("tma_reduce_add_4d", _tma_reduce_kernel, (types.Array(types.uint64, 1, "C"), types.Array(types.int32, 2, "C"),
                                                   f32_2d), {}),
        ("store_shared_u32", _store_shared_u32_kernel, (types.Array(types.uint32, 1, "C"),
                                                         types.Array(types.int32, 1, "C"),
                                                         types.Array(types.uint32, 1, "C")), {}),
        ("bulk_reduce_add_f32", _bulk_reduce_kernel, (types.Array(types.float32, 4, "C"),
                                                      types.Array(types.int32, 1, "C"),
                                                      types.Array(types.float32, 3, "C")), {}),
    ]
    for case in WGMMA_CASES:
        kernel = _make_wgmma_kernel(*case[:4])
        sig = (u16_1d, u16_1d, types.Array(types.uint32, 3, "C"), f32_2d, f32_2d,
               types.Array(types.uint32, 1, "C"), types.Array(types.float32, 1, "C"))
        kernels.append(("wgmma_" + "_".join(map(str, case)), kernel, sig, {}))
    return [(name, getattr(k, "py_func", k), sig, opts) for name, k, sig, opts in kernels]
