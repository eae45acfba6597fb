"""Backward pass against float64: dtypes, causal, GQA/MQA, head dims, awkward lengths, layouts,
determinism, and errors for bad backward-only arguments.

In the simulator the cases are few and small; with a GPU (`pytest -m gpu`) the full grid runs.
"""

import numpy as np
import pytest

import nbflash
from nbflash.backward import flash_attn_backward
from nbflash.dtypes import SUPPORTED, dtype_name
from nbflash.reference import attention_naive_backward, attention_reference, attention_reference_backward

from .conftest import SIMULATOR
from .helpers import ERROR_FLOOR, poison_allocations, random_qkv, simulator_small_tiles, to_numpy

DTYPES = ["float32", "float16", "bfloat16"]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every buffer the library allocates starts as NaN, so an unwritten (or unzeroed) element shows."""
    poison_allocations(monkeypatch)


def random_like(rng, xp, x, heads_first=False):
    """A fresh standard-normal array shaped and typed like ``x`` (optionally a transposed view)."""
    batch, seqlen, nheads, headdim = x.shape
    shape = (batch, nheads, seqlen, headdim) if heads_first else tuple(x.shape)
    y = xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(SUPPORTED[dtype_name(x.dtype)]))
    return y.transpose(0, 2, 1, 3) if heads_first else y


def assert_gradients_close(grads, dout, q, k, v, causal, softmax_scale=None, **variant):
    """dq, dk, dv against float64, under flash-attn's twice-the-naive-error rule.

    "Naive": the larger error of two same-precision implementations, a framework's autograd and
    FlashAttention's own rounding (``attention_naive_backward``'s ``numerics``). The second makes an
    error of its own (P in float32 against an output made from the rounded P), which with a couple of
    keys can pass twice the first's: the GPU fuzz drew one query against two keys, fp16, where the
    kernels' dq, bit for bit that implementation's, was 2.5 times the framework's error.
    The floor is relative to the largest reference gradient: gradients are not O(1) like outputs.
    """
    dtype = dtype_name(q.dtype)
    refs = attention_reference_backward(dout, q, k, v, softmax_scale, causal, **variant)
    naives = [attention_naive_backward(dout, q, k, v, softmax_scale, causal, numerics=numerics, **variant)
              for numerics in ("framework", "flash")]
    for name, grad, x, ref, *naive in zip(("dq", "dk", "dv"), grads, (q, k, v), refs, *naives):
        assert grad.shape == x.shape and grad.dtype == x.dtype, name
        grad64, ref = to_numpy(grad).astype(np.float64), to_numpy(ref)
        assert not np.isnan(grad64).any(), f"{name} has NaN (an element left unwritten, or a 0/0)"
        error = np.abs(grad64 - ref).max()
        naive_error = max(np.abs(to_numpy(n).astype(np.float64) - ref).max() for n in naive)
        budget = 2 * naive_error + ERROR_FLOOR[dtype] * max(1.0, np.abs(ref).max())
        assert error <= budget, f"{name}: max error {error:.3g} > budget {budget:.3g} (naive {naive_error:.3g})"


def forward(q, k, v, softmax_scale=None, causal=False):
    """(out, lse) from the forward. On a GPU, the default kernel family (what a user's backward
    follows); in the simulator the portable one, which it emulates far faster than tensor cores."""
    if not SIMULATOR:
        return nbflash.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True)
    with nbflash.kernel_family("portable"):
        return nbflash.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True)


def reference_forward(xp, q, k, v, softmax_scale=None, causal=False, **variant):
    """(out, lse) as a forward kernel leaves them, from the float64 reference: out rounded to q's
    dtype, lse to float32 (rows that see no key: out 0, lse -inf). For the simulator's backward
    tests whose forward kernel is not under test: emulated, the forward of a case cost about as
    long as the backward kernel under test (the forward kernels' own tests check them)."""
    out, lse = attention_reference(q, k, v, softmax_scale, causal, return_lse=True, **variant)
    return xp.asarray(to_numpy(out).astype(q.dtype)), xp.asarray(to_numpy(lse).astype(np.float32))


def portable_backward(*args, family="portable", **kwargs):
    """This file tests the portable backward kernels (tests/test_backward_mma.py the tensor-core
    ones, through ``family``), whatever the default family is."""
    with nbflash.kernel_family(family):
        return flash_attn_backward(*args, **kwargs)


def run_case(rng, xp, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, causal,
             deterministic=False, heads_first=False, softmax_scale=None, family="portable",
             simulator_reference_forward=False):
    """One backward call of kernel ``family`` against float64 (the forward's family is the
    default's on a GPU, the portable one in the simulator; there with
    ``simulator_reference_forward`` no forward kernel runs: ``reference_forward``)."""
    q, k, v = random_qkv(rng, xp, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, heads_first)
    dout = random_like(rng, xp, q, heads_first)
    if SIMULATOR and simulator_reference_forward:
        out, lse = reference_forward(xp, q, k, v, softmax_scale, causal)
    else:
        out, lse = forward(q, k, v, softmax_scale, causal)
    grads = portable_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                              deterministic=deterministic, family=family)
    assert_gradients_close(grads, dout, q, k, v, causal, softmax_scale)
    return grads


# ---- Simulator: small shapes, every feature touched once -------------------------------------

SMALL_CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim
    (1, 13, 29, 2, 1, 16),  # MQA, seqlen_q < seqlen_k
    (2, 29, 13, 2, 2, 8),  # seqlen_q > seqlen_k: under causal the first rows see no key
    (1, 1, 1, 1, 1, 5),
    (1, 40, 37, 2, 1, 40),  # several query and key tiles, tails on both
]


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SMALL_CASES, ids=lambda s: "x".join(map(str, s)))
def test_backward_small(rng, xp, shape, causal, dtype, deterministic):
    if dtype != "float16" and shape[1] == 40 and not causal:
        pytest.skip("the largest shape runs in float16 and causal only, to keep the simulator quick")
    if deterministic and dtype != "float16":
        pytest.skip("the deterministic dQ kernel runs in float16 here (its loads are the atomic path's, "
                    "which every dtype runs); the GPU grid runs it in every dtype")
    if deterministic and not causal and shape[1] > 1:
        pytest.skip("the deterministic dQ kernel runs causal here (rows without keys, masked tiles), plus the "
                    "1 x 1 case; the GPU grid runs it both ways")
    # out and lse from the float64 reference: the portable forward's emulation cost about as long as
    # the backward's, and tests/test_forward.py runs it on these shapes (the tests below keep it
    # before the backward where a call's whole path is checked: transposed views, the plans, on small
    # tiles in the simulator)
    run_case(rng, xp, *shape, dtype, causal, deterministic, simulator_reference_forward=True)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
@pytest.mark.parametrize(
    "headdim, seqlen_q, seqlen_k, causal, deterministic",
    [
        (59, 9, 17, True, False),
        (96, 9, 17, True, True),
        (256, 9, 17, True, False),
        # Full key tiles (32 rows at headdim 128), so the unmasked paths run too: all tiles when not
        # causal; under causal, the query tiles wholly below the diagonal.
        (128, 48, 40, True, False),
        (128, 48, 40, False, True),
    ],
)
def test_backward_small_headdims(rng, xp, headdim, seqlen_q, seqlen_k, causal, deterministic):
    # At 9 x 17 (causal, float16) the portable forward is checked on these very shapes by
    # tests/test_forward.py::test_forward_small_headdims: here out and lse come from the float64
    # reference. The headdim-128 shapes keep the forward kernel (no forward test runs them).
    run_case(rng, xp, 1, seqlen_q, seqlen_k, 1, 1, headdim, "float16", causal, deterministic,
             simulator_reference_forward=(seqlen_q, seqlen_k, causal) == (9, 17, True))


@pytest.mark.parametrize("family", ["portable", "mma"])
@pytest.mark.parametrize("softmax_scale", [0.0, -0.5])
def test_backward_scale_zero_or_negative(rng, xp, softmax_scale, family):
    if SIMULATOR and family == "mma":
        pytest.skip("the simulator runs the tensor-core backward in tests/test_backward_mma.py")
    # (in the simulator from the reference's out and lse: test_forward_scale_zero_or_negative runs the
    # forward kernels at these scales on this shape)
    run_case(rng, xp, 1, 13, 21, 1, 1, 16, "float16", True, softmax_scale=softmax_scale, family=family,
             simulator_reference_forward=True)


def test_backward_transposed_views(rng, xp):
    """q, k, v and dout as (batch, nheads, seqlen, headdim) tensors passed as transposed views (in the
    simulator on small tiles, helpers.simulator_small_tiles: the strides, not the tiles, are checked)."""
    with simulator_small_tiles():
        run_case(rng, xp, 1, 17, 11, 2, 1, 8, "float32", True, heads_first=True)
        run_case(rng, xp, 1, 17, 11, 2, 1, 8, "bfloat16", False, deterministic=True, heads_first=True)


def test_backward_softmax_scale(rng, xp):
    # (in the simulator from the reference's out and lse: test_forward_softmax_scale runs this forward)
    run_case(rng, xp, 1, 7, 9, 1, 1, 8, "float32", False, softmax_scale=0.37, simulator_reference_forward=True)


def test_backward_causal_rows_without_keys(rng, xp):
    """seqlen_q > seqlen_k, causal: the first rows see nothing: dq = 0 there, and no NaN anywhere. In
    the simulator from the reference's out and lse (those rows: out 0, lse -inf, as the forward
    kernels leave them; tests/test_forward.py's causal cases with seqlen_q > seqlen_k check that)."""
    for deterministic in (False, True):
        dq, dk, dv = run_case(rng, xp, 1, 12, 4, 2, 1, 8, "float16", True, deterministic,
                              simulator_reference_forward=True)
        dq, dk, dv = (to_numpy(x).astype(np.float32) for x in (dq, dk, dv))
        assert (dq[:, :8] == 0).all()
        assert np.isfinite(dk).all() and np.isfinite(dv).all()


@pytest.fixture
def rowwise_vector(monkeypatch):
    """The row-wise kernels' 16-byte forms planned (configs.ROWWISE_VECTOR, the default: set here so
    that the test keeps them if the default changes)."""
    from nbflash import backward, configs

    monkeypatch.setattr(configs, "ROWWISE_VECTOR", True)
    backward._kernels.cache_clear()
    yield configs
    backward._kernels.cache_clear()


@pytest.mark.parametrize("dtype, headdim", [("float16", 16), ("bfloat16", 40)])
def test_backward_rowwise_vector(rng, xp, rowwise_vector, dtype, headdim):
    """The preprocess and the dq conversion by 16-byte accesses: D, dq_accum's zeros and dq's
    conversion against float64, atomic and deterministic, with rows past the last block's end (37
    rows, 128 or 51 a block: headdim / 8 lanes a row). An out whose rows are off the 16-byte grid,
    and float32, take the scalar forms."""
    from nbflash.problem import Static, Variant

    static = Static(dtype, headdim, True, 0, Variant())
    planned = rowwise_vector.plan_backward(static, False, "portable", True, True)
    assert planned[0].vector and planned[2].vector and planned[0].threads_per_row == headdim // 8
    assert not rowwise_vector.plan_backward(static, False, "portable", True, False)[0].vector
    assert not rowwise_vector.plan_backward(Static("float32", 16, True, 0, Variant()), False, "portable", True,
                                            True)[0].vector
    # (in the simulator out and lse from the float64 reference: the forward kernel is not under test)
    run_case(rng, xp, 1, 37, 20, 2, 1, headdim, dtype, False, simulator_reference_forward=True)
    run_case(rng, xp, 1, 37, 20, 2, 1, headdim, dtype, True, deterministic=True, simulator_reference_forward=True)
    # out off the 16-byte grid: a view one element into a wider array
    q, k, v = random_qkv(rng, xp, 1, 9, 11, 1, 1, headdim, dtype)
    dout = random_like(rng, xp, q)
    out, lse = reference_forward(xp, q, k, v) if SIMULATOR else forward(q, k, v)
    wide = xp.zeros((1, 9, 1, headdim + 1), out.dtype)
    wide[..., 1:] = out
    grads = portable_backward(dout, q, k, v, wide[..., 1:], lse)
    assert_gradients_close(grads, dout, q, k, v, False)


def test_backward_deterministic_is_bitwise_reproducible(rng, xp):
    """Two deterministic backward calls agree to the bit (in the simulator, which runs blocks one at a
    time, on small tiles: helpers.simulator_small_tiles)."""
    q, k, v = random_qkv(rng, xp, 1, 21, 18, 2, 1, 12, "float16")
    dout = random_like(rng, xp, q)
    with simulator_small_tiles():
        out, lse = forward(q, k, v, causal=True)
        first = portable_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        second = portable_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for a, b in zip(first, second):
        assert np.array_equal(to_numpy(a).view(np.uint16), to_numpy(b).view(np.uint16))


def test_backward_follows_a_plan_without_atomics(rng, xp, separate_dq_plan):
    """deterministic=False on a plan without dQ's atomics: the dQ pass runs (not the conversion of an
    unused accumulator), and the result is the deterministic one, bit for bit. In the simulator on
    small tiles (helpers.simulator_small_tiles: the launcher's choice, not the tiles, is checked)."""
    q, k, v = random_qkv(rng, xp, 2, 21, 30, 2, 1, 16, "float16")
    dout = random_like(rng, xp, q)
    with simulator_small_tiles():
        out, lse = forward(q, k, v, causal=True)
        grads = portable_backward(dout, q, k, v, out, lse, causal=True)
        assert_gradients_close(grads, dout, q, k, v, True)
        again = portable_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for a, b in zip(grads, again):
        assert np.array_equal(to_numpy(a).view(np.uint16), to_numpy(b).view(np.uint16))


# ---- Errors on the backward-only arguments ---------------------------------------------------


@pytest.fixture
def call_args(rng, xp):
    """Well-formed arguments (nothing runs: every error is raised before a launch)."""
    q, k, v = random_qkv(rng, xp, 2, 8, 6, 4, 2, 16, "float16")
    lse = xp.asarray(rng.standard_normal((2, 4, 8), dtype=np.float32))
    return dict(dout=random_like(rng, xp, q), q=q, k=k, v=v, out=random_like(rng, xp, q), lse=lse)


@pytest.mark.parametrize("name", ["dout", "out"])
def test_backward_errors_dout_out(call_args, xp, name):
    x = call_args[name]
    with pytest.raises(ValueError, match=f"{name} must have q's shape"):
        flash_attn_backward(**{**call_args, name: x[:, :4]})
    with pytest.raises(TypeError, match=f"{name}.dtype=float32 differs from q.dtype"):
        flash_attn_backward(**{**call_args, name: x.astype(xp.float32)})
    with pytest.raises(ValueError, match=f"{name} must have 4 dims"):
        flash_attn_backward(**{**call_args, name: x[0]})
    with pytest.raises(ValueError, match=f"{name}'s last dim"):
        flash_attn_backward(**{**call_args, name: xp.swapaxes(x, 2, 3).copy().swapaxes(2, 3)})


def test_backward_errors_lse(call_args, xp):
    lse = call_args["lse"]
    with pytest.raises(TypeError, match=r"lse.dtype=float64 must be float32"):
        flash_attn_backward(**{**call_args, "lse": lse.astype(xp.float64)})
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, nheads, seqlen_q\) = \(2, 4, 8\)"):
        flash_attn_backward(**{**call_args, "lse": lse[:, :2]})
    with pytest.raises(ValueError, match=r"lse must have shape"):
        flash_attn_backward(**{**call_args, "lse": xp.swapaxes(lse, 1, 2)})


def test_backward_errors_qkv_and_flags(call_args):
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flash_attn_backward(**{**call_args, "v": call_args["v"][:, :3]})
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_attn_backward(**call_args, deterministic="yes")
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attn_backward(**call_args, causal=1)


# ---- GPU: the full grid ---------------------------------------------------------------------

SEQLENS = [(1, 1), (113, 203), (203, 113), (1023, 1024), (1024, 1023), (128, 2048), (2048, 2048)]
HEADDIMS = [40, 59, 64, 96, 128, 256]
HEADS = [(4, 4), (6, 2), (4, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", HEADDIMS)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_backward_gpu(rng, xp, seqlens, headdim, causal, dtype):
    gpu_grid_case(run_case, rng, xp, seqlens, headdim, causal, dtype)


def gpu_grid_case(run, rng, xp, seqlens, headdim, causal, dtype):
    """One point of the GPU grid through ``run`` (run_case, or a family's wrapper of it). The head
    layouts, the memory layouts and the dQ modes cycle through the grid instead of multiplying it."""
    index = SEQLENS.index(seqlens) + HEADDIMS.index(headdim)
    nheads, nheads_k = HEADS[index % len(HEADS)]
    heads_first = headdim in (59, 128)
    deterministic = (index + causal) % 2 == 1
    run(rng, xp, 2, *seqlens, nheads, nheads_k, headdim, dtype, causal, deterministic, heads_first)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_gpu_deterministic_bitwise(rng, xp, dtype):
    """Many blocks racing for the same rows: deterministic mode must still give equal bits."""
    q, k, v = random_qkv(rng, xp, 2, 1023, 1024, 8, 2, 64, dtype)
    dout = random_like(rng, xp, q)
    out, lse = nbflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    runs = [portable_backward(dout, q, k, v, out, lse, causal=True, deterministic=True) for _ in range(3)]
    view = np.uint32 if dtype == "float32" else np.uint16
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert np.array_equal(to_numpy(a).view(view), to_numpy(b).view(view))
    # And the atomic path agrees with it to rounding.
    fast = portable_backward(dout, q, k, v, out, lse, causal=True)
    for a, b in zip(runs[0], fast):
        a, b = to_numpy(a).astype(np.float32), to_numpy(b).astype(np.float32)
        assert np.abs(a - b).max() <= 1e-2 * max(1.0, np.abs(a).max())


@pytest.mark.gpu
def test_backward_gpu_on_current_stream(rng, xp):
    """The kernels are queued on CuPy's current stream: results are ready after that stream syncs."""
    import cupy

    q, k, v = random_qkv(rng, xp, 2, 512, 512, 4, 4, 64, "float16")
    dout = random_like(rng, xp, q)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out, lse = nbflash.flash_attn_func(q, k, v, return_lse=True)
        grads = portable_backward(dout, q, k, v, out, lse)
    stream.synchronize()
    assert_gradients_close(grads, dout, q, k, v, False)
