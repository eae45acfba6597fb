"""The tile primitives against NumPy.

Each check launches a one-warp kernel that builds the operands lane by lane, following the PTX ISA's
fragment layouts as written out in nbflash/primitives.py, calls the primitive, and scatters the
result back the same way. Without a GPU (Numba's simulator) this checks the plain-Python emulations;
on a GPU the same checks run against the inline-PTX intrinsics, which is what makes the emulations
trustworthy: both must agree with the one NumPy statement of the layout. The ``gpu``-marked test
repeats every check over many random draws on the hardware.
"""

import numpy as np
import pytest
from numba import cuda, uint16, uint32

from nbflash import primitives as P
from nbflash.primitives_sm90 import warpgroup_index

ml_dtypes = pytest.importorskip("ml_dtypes")

LANE = np.arange(32)
G, T = LANE >> 2, LANE & 3


def _bits(x, dtype):
    """uint16 bits of float values rounded to ``dtype`` ('float16' or 'bfloat16')."""
    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    return np.asarray(x, dtype=np.float32).astype(np_dtype).view(np.uint16)


def _values(bits, dtype):
    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    return bits.view(np_dtype).astype(np.float64)


def _pairs(lo, hi):
    return lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)


# --- mma.sync m16n8k16 -------------------------------------------------------------------------------

@cuda.jit
def _mma_f16_kernel(a_regs, b_regs, c, d):
    lane = cuda.threadIdx.x
    r = P.mma_f16(a_regs[lane, 0], a_regs[lane, 1], a_regs[lane, 2], a_regs[lane, 3],
                  b_regs[lane, 0], b_regs[lane, 1], c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    for i in range(4):
        d[lane, i] = r[i]


@cuda.jit
def _mma_bf16_kernel(a_regs, b_regs, c, d):
    lane = cuda.threadIdx.x
    r = P.mma_bf16(a_regs[lane, 0], a_regs[lane, 1], a_regs[lane, 2], a_regs[lane, 3],
                   b_regs[lane, 0], b_regs[lane, 1], c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    for i in range(4):
        d[lane, i] = r[i]


def check_mma(dtype, rng):
    A = _bits(rng.standard_normal((16, 16)), dtype)
    B = _bits(rng.standard_normal((16, 8)), dtype)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    a_regs = np.stack([_pairs(A[G + r, 2 * T + k], A[G + r, 2 * T + k + 1])
                       for r, k in [(0, 0), (8, 0), (0, 8), (8, 8)]], axis=1)
    b_regs = np.stack([_pairs(B[2 * T + k, G], B[2 * T + k + 1, G]) for k in (0, 8)], axis=1)
    c_regs = np.stack([C[G, 2 * T], C[G, 2 * T + 1], C[G + 8, 2 * T], C[G + 8, 2 * T + 1]], axis=1)
    d_regs = np.full((32, 4), np.nan, dtype=np.float32)
    kernel = _mma_f16_kernel if dtype == "float16" else _mma_bf16_kernel
    kernel[1, 32](a_regs, b_regs, c_regs, d_regs)
    D = np.empty((16, 8))
    D[G, 2 * T], D[G, 2 * T + 1] = d_regs[:, 0], d_regs[:, 1]
    D[G + 8, 2 * T], D[G + 8, 2 * T + 1] = d_regs[:, 2], d_regs[:, 3]
    expected = _values(A, dtype) @ _values(B, dtype) + C
    np.testing.assert_allclose(D, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma(dtype):
    check_mma(dtype, np.random.default_rng(0))


# --- ldmatrix x4 (and .trans) ------------------------------------------------------------------------

def _make_ldmatrix_kernel(transpose):
    load = P.ldmatrix_x4_trans if transpose else P.ldmatrix_x4

    @cuda.jit
    def kernel(rows, order, regs):
        # rows: 32 rows of 8 uint16 (4 matrices of 8 rows), stored in shared memory in the permuted
        # row order `order`, so the lanes' addresses are not simply consecutive.
        lane = cuda.threadIdx.x
        smem = cuda.shared.array(0, uint16)
        for e in range(8):
            smem[order[lane] * 8 + e] = rows[lane, e]
        cuda.syncthreads()  # every row stored before any lane's ldmatrix reads it
        r = load(P.shared_address(smem) + uint32(order[lane] * 16))
        for i in range(4):
            regs[lane, i] = r[i]

    return kernel


_ldmatrix_kernels = {False: _make_ldmatrix_kernel(False), True: _make_ldmatrix_kernel(True)}


def check_ldmatrix(transpose, rng):
    rows = rng.integers(0, 1 << 16, size=(32, 8), dtype=np.uint16)
    order = rng.permutation(32).astype(np.int32)
    regs = np.zeros((32, 4), dtype=np.uint32)
    _ldmatrix_kernels[transpose][1, 32, 0, 32 * 16](rows, order, regs)
    for i in range(4):
        m = rows[8 * i:8 * i + 8]
        if transpose:
            m = m.T
        np.testing.assert_array_equal(regs[:, i], _pairs(m[G, 2 * T], m[G, 2 * T + 1]))


@pytest.mark.parametrize("transpose", [False, True])
def test_ldmatrix(transpose):
    check_ldmatrix(transpose, np.random.default_rng(1))


# --- cp.async 16 bytes, zero-fill, commit / wait ------------------------------------------------------

@cuda.jit
def _cp_async_kernel(src, coords, out):
    # Lane i copies src[coords[i]] (8 elements) to 16-byte slot i of shared memory, or zero-fills the
    # slot when coords[i, 4] is 0; then every lane reads back all slots.
    lane = cuda.threadIdx.x
    smem = cuda.shared.array(0, uint16)
    base = P.shared_address(smem)
    P.cp_async_16(base + uint32(lane * 16), src, coords[lane, 0], coords[lane, 1], coords[lane, 2],
                  coords[lane, 3], uint32(coords[lane, 4]))
    P.cp_async_commit()
    P.cp_async_wait(0)
    cuda.syncthreads()  # other lanes' copies are visible only after the barrier
    for e in range(8):
        out[lane, e] = smem[lane * 8 + e]


@cuda.jit
def _cp_async_from_kernel(src, coords, out):
    # As _cp_async_kernel, through a precomputed global address.
    lane = cuda.threadIdx.x
    smem = cuda.shared.array(0, uint16)
    base = P.shared_address(smem)
    row0 = P.global_address(src, coords[lane, 0], 0, coords[lane, 2], 0)
    address = row0 + coords[lane, 1] * src.strides[1] + coords[lane, 3] * 2
    P.cp_async_16_from(base + uint32(lane * 16), address, uint32(coords[lane, 4]))
    P.cp_async_commit()
    P.cp_async_wait(0)
    cuda.syncthreads()  # other lanes' copies are visible only after the barrier
    for e in range(8):
        out[lane, e] = smem[lane * 8 + e]


def check_cp_async(rng):
    src = rng.standard_normal((2, 3, 4, 24)).astype(np.float16)
    coords = np.stack([rng.integers(0, 2, 32), rng.integers(0, 3, 32), rng.integers(0, 4, 32),
                       8 * rng.integers(0, 3, 32), 16 * rng.integers(0, 2, 32)], axis=1).astype(np.int64)
    for kernel in (_cp_async_kernel, _cp_async_from_kernel):
        out = np.full((32, 8), 0xFFFF, dtype=np.uint16)
        kernel[1, 32, 0, 32 * 16](src, coords, out)
        for lane in range(32):
            b, s, h, d, nbytes = coords[lane]
            expected = src[b, s, h, d:d + 8].view(np.uint16) if nbytes else np.zeros(8, np.uint16)
            np.testing.assert_array_equal(out[lane], expected)


def test_cp_async():
    check_cp_async(np.random.default_rng(2))


# --- red.global.add.f32 and its v2, v4 forms ---------------------------------------------------------

@cuda.jit
def _red1_kernel(acc, coords, values):
    # Lane i adds values[i, 0] to acc[coords[i]]; lanes collide.
    lane = cuda.threadIdx.x
    address = P.global_address(acc, coords[lane, 0], coords[lane, 1], coords[lane, 2], coords[lane, 3])
    P.red_add_f32(address, values[lane, 0])


@cuda.jit
def _red_kernel(acc, coords, values):
    # Lane i adds values[i, 0:2] to acc[coords[i], coords[i, 3]:coords[i, 3] + 2]; lanes collide.
    lane = cuda.threadIdx.x
    address = P.global_address(acc, coords[lane, 0], coords[lane, 1], coords[lane, 2], coords[lane, 3])
    P.red_add_f32x2(address, values[lane, 0], values[lane, 1])


@cuda.jit
def _red4_kernel(acc, coords, values):
    # Lane i adds values[i, 0:4] to acc[coords[i], coords[i, 3]:coords[i, 3] + 4]; lanes collide.
    lane = cuda.threadIdx.x
    address = P.global_address(acc, coords[lane, 0], coords[lane, 1], coords[lane, 2], coords[lane, 3])
    P.red_add_f32x4(address, values[lane, 0], values[lane, 1], values[lane, 2], values[lane, 3])


def check_red(rng, width=2):
    """32 lanes' reductions of ``width`` float32 (1: _red1_kernel, 2: _red_kernel, 4: _red4_kernel),
    colliding."""
    acc = rng.integers(-8, 8, (2, 3, 2, 8)).astype(np.float32)
    coords = np.stack([rng.integers(0, 2, 32), rng.integers(0, 3, 32), rng.integers(0, 2, 32),
                       width * rng.integers(0, 8 // width, 32)], axis=1).astype(np.int64)
    values = rng.integers(-64, 64, (32, width)).astype(np.float32)  # integers: any order sums exactly
    expected = acc.copy()
    for (b, s, h, d), vector in zip(coords, values):
        expected[b, s, h, d:d + width] += vector
    {1: _red1_kernel, 2: _red_kernel, 4: _red4_kernel}[width][1, 32](acc, coords, values)
    np.testing.assert_array_equal(acc, expected)


def test_red_add_f32():
    check_red(np.random.default_rng(4), 1)


def test_red_add_f32x2():
    check_red(np.random.default_rng(5))


def test_red_add_f32x4():
    check_red(np.random.default_rng(6), 4)


# --- ld.global.nc.v4, st.global.v4 and the packed-pair unpacks ----------------------------------------

@cuda.jit
def _vector_kernel(x, y, widened, coords):
    # Lane i copies the 16 bytes x[coords[i], c:c + 8] (8 16-bit elements) to y at the same place,
    # and widens them both ways: as float16 pairs and as bfloat16 pairs.
    lane = cuda.threadIdx.x
    b, s, h, c = coords[lane, 0], coords[lane, 1], coords[lane, 2], coords[lane, 3]
    w0, w1, w2, w3 = P.load_u32x4_nc(P.global_address(x, b, s, h, c))
    P.store_u32x4(P.global_address(y, b, s, h, c), w0, w1, w2, w3)
    for i, word in enumerate((w0, w1, w2, w3)):
        lo, hi = P.unpack_f16x2(word)
        widened[lane, 0, 2 * i], widened[lane, 0, 2 * i + 1] = lo, hi
        lo, hi = P.unpack_bf16x2(word)
        widened[lane, 1, 2 * i], widened[lane, 1, 2 * i + 1] = lo, hi


@cuda.jit
def _pair_store_kernel(y, values, coords, bf16):
    # Lane i narrows values[i] (two float32) and stores them as one 32-bit word at y[coords[i]]
    lane = cuda.threadIdx.x
    b, s, h, c = coords[lane, 0], coords[lane, 1], coords[lane, 2], coords[lane, 3]
    if bf16:
        word = P.pack_bf16x2(values[lane, 0], values[lane, 1])
    else:
        word = P.pack_f16x2(values[lane, 0], values[lane, 1])
    P.store_u32(P.global_address(y, b, s, h, c), word)


@pytest.mark.parametrize("bf16", [False, True], ids=["float16", "bfloat16"])
def test_pair_store(bf16):
    """pack_{f16,bf16}x2 then store_u32 (st.global.u32) at 4-byte-aligned places of a 4-D array of
    16-bit elements: the first value lands at the even column, each rounded to nearest even as a
    single element's narrowing (the sm90 backward's dK, dV and dq stores); nothing else changes."""
    rng = np.random.default_rng(11)
    values = rng.standard_normal((32, 2)).astype(np.float32) * 100
    values[0] = [1 + 2.0 ** -11, -(1 + 3 * 2.0 ** -11)]  # ties for float16: to even, both ways
    values[1] = [1 + 2.0 ** -8, -(1 + 3 * 2.0 ** -8)]  # and for bfloat16
    y = np.full((2, 3, 2, 8), 0x7E00, np.uint16)  # a NaN everywhere nothing is stored
    places = [(b, s, h, c) for b in range(2) for s in range(3) for h in range(2) for c in range(0, 8, 2)]
    coords = np.array([places[i] for i in rng.permutation(len(places))[:32]], np.int64)  # 32 of the 48 pairs
    _pair_store_kernel[1, 32](y, values, coords, bf16)
    expected = np.full_like(y, 0x7E00)
    for lane, (b, s, h, c) in enumerate(coords):
        if bf16:
            bits = values[lane].view(np.uint32).astype(np.uint64)  # finite: round to nearest even by hand
            expected[b, s, h, c:c + 2] = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        else:
            expected[b, s, h, c:c + 2] = values[lane].astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(y, expected)


def test_vector_load_store_unpack():
    """16-byte loads and stores at 16-byte-aligned places of a 4-D array (every lane its own eight
    elements; lanes may repeat a place: the same bytes), and each uint32's two halves widened as
    float16 and as bfloat16, the low half first."""
    rng = np.random.default_rng(8)
    values = rng.standard_normal((2, 3, 2, 16)).astype(np.float16)
    values.reshape(-1)[:4] = [np.inf, -0.0, 65504, 6e-8]  # an infinity, a signed zero, the largest, a subnormal
    x = values.view(np.uint16)
    y = np.zeros_like(x)
    coords = np.stack([rng.integers(0, 2, 32), rng.integers(0, 3, 32), rng.integers(0, 2, 32),
                       8 * rng.integers(0, 2, 32)], axis=1).astype(np.int64)
    coords[0] = 0
    widened = np.full((32, 2, 8), np.nan, np.float32)
    _vector_kernel[1, 32](x, y, widened, coords)
    for lane, (b, s, h, c) in enumerate(coords):
        bits = x[b, s, h, c:c + 8]
        np.testing.assert_array_equal(y[b, s, h, c:c + 8], bits)
        np.testing.assert_array_equal(widened[lane, 0], bits.view(np.float16).astype(np.float32))
        np.testing.assert_array_equal(widened[lane, 1], (bits.astype(np.uint32) << 16).view(np.float32))
    touched = np.zeros(x.shape, bool)
    for b, s, h, c in coords:
        touched[b, s, h, c:c + 8] = True
    assert (y[~touched] == 0).all()  # nothing written outside the lanes' places


# --- ld.global.cg ------------------------------------------------------------------------------------

@cuda.jit
def _load_cg_kernel(x, coords, out):
    lane = cuda.threadIdx.x
    address = P.global_address(x, coords[lane, 0], coords[lane, 1], coords[lane, 2], coords[lane, 3])
    out[lane] = P.load_f32_cg(address)


def test_load_f32_cg():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 2, 8)).astype(np.float32)
    coords = np.stack([rng.integers(0, n, 32) for n in x.shape], axis=1).astype(np.int64)
    out = np.full(32, np.nan, np.float32)
    _load_cg_kernel[1, 32](x, coords, out)
    np.testing.assert_array_equal(out, x[tuple(coords.T)])


# --- packing, exp2, quad reductions -------------------------------------------------------------------

@cuda.jit
def _pointwise_kernel(x, y, packed_f16, packed_bf16, exp2, qmax, qsum):
    lane = cuda.threadIdx.x
    packed_f16[lane] = P.pack_f16x2(x[lane], y[lane])
    packed_bf16[lane] = P.pack_bf16x2(x[lane], y[lane])
    exp2[lane] = P.exp2_approx(x[lane])
    qmax[lane] = P.quad_max(y[lane])
    qsum[lane] = P.quad_sum(y[lane])


def check_pointwise(rng):
    x = (rng.standard_normal(32) * 20).astype(np.float32)
    y = (rng.standard_normal(32) * 1e3).astype(np.float32)
    x[0], y[1], y[4:8] = -np.inf, -np.inf, -np.inf  # exp2(-inf) = 0; a quad of -inf stays -inf
    outs = [np.zeros(32, np.uint32), np.zeros(32, np.uint32)] + [np.full(32, np.nan, np.float32) for _ in range(3)]
    _pointwise_kernel[1, 32](x, y, *outs)
    packed_f16, packed_bf16, exp2, qmax, qsum = outs
    np.testing.assert_array_equal(packed_f16, _pairs(_bits(x, "float16"), _bits(y, "float16")))
    np.testing.assert_array_equal(packed_bf16, _pairs(_bits(x, "bfloat16"), _bits(y, "bfloat16")))
    np.testing.assert_allclose(exp2, np.exp2(x.astype(np.float64)), rtol=2e-6)
    quads = y.reshape(8, 4)
    np.testing.assert_array_equal(qmax, np.repeat(quads.max(axis=1), 4))
    expected_sum = np.repeat((quads[:, 0] + quads[:, 1]) + (quads[:, 2] + quads[:, 3]), 4)
    np.testing.assert_allclose(qsum, expected_sum, rtol=1e-6)


def test_pointwise():
    check_pointwise(np.random.default_rng(3))


@cuda.jit
def _exp2_fma_kernel(x, out3, out4):
    for i in range(cuda.threadIdx.x, x.size, cuda.blockDim.x):  # one warp (the simulator's threads are dear)
        out3[i] = P.exp2_fma3(x[i])
        out4[i] = P.exp2_fma4(x[i])


def check_exp2_fma(rng, n=64):
    """exp2 on the FMA pipes: within its degree's bound of 2**x from 0 down to -126 (random draws,
    the integers and the halfway points, where the rounding to j chooses) and up to 8 (lazy
    rescaling's positive exponents), exactly 0 at -127 and below and at -inf (masked scores)."""
    x = np.concatenate([-rng.random(n) * 126, -np.arange(0, 127), -np.arange(0, 126) - 0.5, rng.random(8) * 8,
                        [-127.0, -127.3, -500.0, -np.inf]]).astype(np.float32)
    out3, out4 = np.full(x.size, np.nan, np.float32), np.full(x.size, np.nan, np.float32)
    _exp2_fma_kernel[1, 32](x, out3, out4)
    exact = np.exp2(x.astype(np.float64))
    normal = x >= -126
    np.testing.assert_allclose(out3[normal], exact[normal], rtol=1.1e-4, atol=0)
    np.testing.assert_allclose(out4[normal], exact[normal], rtol=3e-6, atol=0)
    assert (out3[x <= -127] == 0).all() and (out4[x <= -127] == 0).all()


def test_exp2_fma():
    check_exp2_fma(np.random.default_rng(7))


@cuda.jit
def _vote_kernel(flags, out):
    warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
    out[warp, lane] = P.warp_all(flags[warp, lane])


def check_vote(rng):
    """warp_all per warp of a 3-warp block: all set, one lane clear (a random one), all clear."""
    flags = rng.integers(1, 2**32, (3, 32), dtype=np.uint64).astype(np.uint32)
    flags[1, rng.integers(32)] = 0
    flags[2] = 0
    out = np.full((3, 32), 7, np.uint32)
    _vote_kernel[1, 96](flags, out)
    np.testing.assert_array_equal(out, np.array([[1] * 32, [0] * 32, [0] * 32], np.uint32))


def test_vote():
    check_vote(np.random.default_rng(5))


@cuda.jit
def _broadcast_kernel(values, out, groups):
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    out[warp, lane] = P.warp_broadcast_u32(values[warp, lane])
    groups[warp, lane] = warpgroup_index(tid)


def check_broadcast(rng):
    """warp_broadcast_u32 gives every lane its warp's lane 0 value; warpgroup_index (made from it)
    is tid // 128, in a block of 3 warpgroups."""
    values = rng.integers(0, 2**32, (12, 32), dtype=np.uint64).astype(np.uint32)
    out = np.zeros((12, 32), np.uint32)
    groups = np.full((12, 32), -1, np.int32)
    _broadcast_kernel[1, 384](values, out, groups)
    np.testing.assert_array_equal(out, np.repeat(values[:, :1], 32, axis=1))
    np.testing.assert_array_equal(groups, np.repeat(np.arange(12) // 4, 32).reshape(12, 32))


def test_broadcast():
    check_broadcast(np.random.default_rng(6))


def test_static_range_needs_unroll():
    """static_range loops are expanded by @unroll; one left in an undecorated function (which Numba
    would refuse) raises in the simulator as well, naming the fix."""
    from nbflash.primitives import static_range

    def forgot(x):
        for i in static_range(3):
            x += i
        return x

    with pytest.raises(TypeError, match="@unroll"):
        forgot(0)
    assert P.unroll(forgot)(1) == 4


def test_unroll_reuses_code_only_for_the_same_bounds():
    """@unroll keeps a function's unrolled code by the values its static_range bounds read: a build
    with the same bounds but other closure values execs that code with its own values; other bounds
    unroll afresh; a bound that is no plain int (here an object) is never cached. Numba's scalar
    types stay casts (NumPy's in the simulator, the same values)."""
    from nbflash.primitives import static_range

    def build(n, scale, m=None):
        bound = n if m is None else m

        @P.unroll
        def f(x):
            total = uint32(0)
            for i in static_range(bound):
                total += uint32(scale * (i + x))
            return total

        return f

    assert build(3, 1)(1) == 6 and build(3, 2)(1) == 12 and build(4, 1)(1) == 10
    assert type(build(3, 1)(1)) is np.uint32

    class Three(int):
        pass

    assert build(0, 1, Three(3))(1) == 6 and build(0, 1, 4)(1) == 10


# --- On the GPU: every check, many draws ---------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(P.SIMULATOR, reason="checks the inline-PTX intrinsics; needs a GPU")
def test_intrinsics_match_layouts_on_gpu():
    rng = np.random.default_rng(4)
    for _ in range(20):
        for dtype in ("float16", "bfloat16"):
            check_mma(dtype, rng)
        for transpose in (False, True):
            check_ldmatrix(transpose, rng)
        check_cp_async(rng)
        check_red(rng, 1)
        check_red(rng)
        if cuda.get_current_device().compute_capability >= (9, 0):  # red.v4.f32: sm_90
            check_red(rng, 4)
        check_pointwise(rng)
        check_exp2_fma(rng)
        check_vote(rng)
        check_broadcast(rng)


@pytest.mark.skipif(not P.SIMULATOR, reason="the simulator's block manager")
def test_simulator_poll_yields_and_answers_as_before():
    """nbflash.runtime makes the simulator's poll of a block's threads yield the GIL: each answer is
    still threading.Thread's, for a running thread and for one that has ended; and a block whose
    threads meet at many barriers still runs them all to the end."""
    import threading

    from numba.cuda.simulator import kernel as simulated

    assert simulated.BlockThread.is_alive is not threading.Thread.is_alive
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    assert simulated.BlockThread.is_alive(thread) and thread.is_alive()
    release.set()
    thread.join()
    assert not simulated.BlockThread.is_alive(thread) and not thread.is_alive()

    @cuda.jit
    def count_rounds(out):
        for _ in range(20):
            cuda.syncthreads()
            if cuda.threadIdx.x == 0:
                out[cuda.blockIdx.x] += 1

    out = np.zeros(2, np.int32)
    count_rounds[2, 64](out)
    assert out.tolist() == [20, 20]
