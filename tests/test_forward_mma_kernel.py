"""The tensor-core forward kernel, launched directly, against a float64 NumPy reference.

Without a GPU these run in Numba's simulator (tiny shapes; the primitives are emulated); on a GPU the
same tests run on the hardware. Outputs are poisoned with NaN before each launch, so an unwritten
element fails. Tolerance follows flash-attn's rule: at most twice the error of a naive implementation
in the same precision (16-bit inputs and P, float32 accumulation), both measured against float64.
"""

import math

import numpy as np
import pytest
from numba import cuda

from nbflash.kernels.forward_mma import MmaForwardConfig, build_forward_mma
from nbflash.problem import Variant, window_bounds

from .helpers import kernel_reference as reference

ml_dtypes = pytest.importorskip("ml_dtypes")

NP_DTYPE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


PLAIN, WINDOW = Variant(), Variant(window=True)
CAUSAL = (-1, 0)  # the window causal attention is


def run_kernel(config, q, k, v, scale, window, kernel_args=None):
    """Launch on host arrays (the simulator, or Numba's automatic transfers on a GPU); kernel_args,
    when given, replaces (q, k, v) as the kernel's inputs (device views with other strides)."""
    bits = config.dtype == "bfloat16"
    as_kernel = (lambda x: x.view(np.uint16)) if bits else (lambda x: x)
    if kernel_args is None:
        kernel_args = tuple(as_kernel(x) for x in (q, k, v))
    batch, seqlen_q, nheads, _ = q.shape
    out = np.empty(q.shape, dtype=q.dtype)
    out.view(np.uint16)[...] = 0x7FC0 if bits else 0x7E00  # NaN
    lse = np.full((batch, nheads, seqlen_q), np.nan, dtype=np.float32)
    params = ()
    if config.variant.window:  # the window's (left, right), as validation hands them over
        params = tuple(np.int32(x) for x in window_bounds(seqlen_q, k.shape[1], False, window)[:2])
    kernel = build_forward_mma(config)
    kernel[config.grid(batch, nheads, seqlen_q), config.threads, 0, config.shared_bytes](
        *kernel_args, as_kernel(out), lse, np.float32(scale * math.log2(math.e)), params)
    return out, lse


def check(config, batch=1, seqlen_q=20, seqlen_k=33, nheads=2, nheads_k=1, seed=0, row_pad=0, window=CAUSAL,
          scale=None):
    """``window``: the window_size a window config runs with (causal by default)."""
    window = window if config.variant.window else None
    rng = np.random.default_rng(seed)
    D, dt = config.headdim, NP_DTYPE[config.dtype]
    q = rng.standard_normal((batch, seqlen_q, nheads, D)).astype(dt)
    k = rng.standard_normal((batch, seqlen_k, nheads_k, D)).astype(dt)
    v = rng.standard_normal((batch, seqlen_k, nheads_k, D)).astype(dt)
    kernel_args = None
    if row_pad:
        # Each row stored in a longer one: strides of dims 0-2 are not the packed ones.
        stores = [np.zeros(x.shape[:3] + (D + row_pad,), dtype=dt) for x in (q, k, v)]
        for store, x in zip(stores, (q, k, v)):
            store[..., :D] = x
        kernel_args = tuple(cuda.to_device(store)[:, :, :, :D] for store in stores)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out, lse = run_kernel(config, q, k, v, scale, window, kernel_args)
    out_ref, lse_ref = reference(q, k, v, scale, window)
    out_naive, _ = reference(q, k, v, scale, window, p_dtype=dt)
    naive_err = np.abs(out_naive.astype(dt).astype(np.float64) - out_ref).max()
    err = np.abs(out.astype(np.float64) - out_ref)
    assert not np.isnan(out.astype(np.float32)).any(), "unwritten or NaN output"
    assert err.max() <= 2 * naive_err + 1e-3, (err.max(), naive_err)
    assert not np.isnan(lse).any(), "unwritten or NaN lse"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[finite], lse_ref[finite], rtol=1e-4, atol=1e-4)
    return out, lse, lse_ref


SMALL = dict(block_m=32, block_n=16, num_warps=2)  # two warps, one 16-row slice each


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", [PLAIN, WINDOW], ids=["plain", "causal"])
def test_basic(dtype, variant):
    check(MmaForwardConfig(dtype, 16, variant, **SMALL), seqlen_q=20, seqlen_k=33)


@pytest.mark.parametrize("window", [(5, 3), (12, -1)])
def test_sliding_window(window):
    # Bands on both sides of the diagonal: tiles left of the band are skipped, its edges masked.
    check(MmaForwardConfig("float16", 16, WINDOW, **SMALL), seqlen_q=45, seqlen_k=52, window=window)


@pytest.mark.parametrize("fold_scale, scale", [(False, 0.0), (False, -0.3)])
def test_scale_not_positive(fold_scale, scale):
    # A zero or negative scale is applied to the scores before the max (the planner's choice).
    check(MmaForwardConfig("float16", 16, WINDOW, fold_scale=fold_scale, **SMALL), seqlen_q=20, seqlen_k=33,
          scale=scale)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (37, 21), (33, 40), (16, 16)])
def test_lengths_causal(seqlen_q, seqlen_k):
    # seqlen_q > seqlen_k: the first rows see no key (out 0, lse -inf); tails on both sides.
    _, lse, lse_ref = check(MmaForwardConfig("float16", 16, WINDOW, **SMALL), seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                            nheads=1, nheads_k=1, seed=seqlen_q)
    if seqlen_q > seqlen_k:
        assert np.isneginf(lse_ref).any() and np.isneginf(lse).any()


def test_headdim_40_gqa_batch():
    check(MmaForwardConfig("bfloat16", 40, PLAIN, **SMALL), batch=2, seqlen_q=17, seqlen_k=9, nheads=4, nheads_k=2)


def test_heavy_groups():
    # Longest-first within groups of 4 (batch, head) pairs, causal: 2 x 3 pairs, so the second
    # group's last two blocks of each query block exit; two query blocks, rows without keys.
    config = MmaForwardConfig("float16", 16, WINDOW, heavy_groups=4, **SMALL)
    assert config.grid(2, 3, 40) == (4 * 2, 2, 1)
    check(config, batch=2, seqlen_q=40, seqlen_k=30, nheads=3, nheads_k=1)


@pytest.mark.parametrize("skip_rescale, q_in_registers", [(False, None), (True, True)])
def test_two_slices_per_warp(skip_rescale, q_in_registers):
    # block_m = 64 with 2 warps: each warp owns two 16-row slices (m_tiles = 2); block_n = 32.
    config = MmaForwardConfig("float16", 16, WINDOW, block_m=64, block_n=32, num_warps=2, skip_rescale=skip_rescale,
                              q_in_registers=q_in_registers)
    check(config, seqlen_q=40, seqlen_k=40)


@pytest.mark.parametrize("slack, scale", [(1.0, 2.0), (8.0, 0.25)])
def test_lazy_rescale(slack, scale):
    """rescale_slack: P taken against maxima up to 2**slack behind. With scale 2 the scores spread
    over about +-35 powers of 2, so a kernel that never moved its maxima would overflow P's float16
    (and one that rescaled l or acc alone would be off); slack 8 at a small scale mostly stays.
    Causal with tails, GQA, two 16-row slices a warp as well as one."""
    check(MmaForwardConfig("float16", 16, WINDOW, rescale_slack=slack, **SMALL), seqlen_q=37, seqlen_k=52,
          nheads=2, nheads_k=1, scale=scale)
    check(MmaForwardConfig("bfloat16", 16, PLAIN, block_m=64, block_n=32, num_warps=2, rescale_slack=slack),
          seqlen_q=40, seqlen_k=70, scale=scale)


def test_lazy_rescale_bounds():
    with pytest.raises(ValueError, match="rescale_slack"):
        MmaForwardConfig("float16", 16, PLAIN, rescale_slack=9.0)
    with pytest.raises(ValueError, match="take one"):
        MmaForwardConfig("float16", 16, PLAIN, rescale_slack=4.0, skip_rescale=True)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(40, 37), (25, 40)])
def test_sub_tiles(seqlen_q, seqlen_k):
    # K/V tiles of 32 keys consumed 16 at a time; 4 warps, so warps skip sub-tiles past their diagonal.
    config = MmaForwardConfig("float16", 16, WINDOW, block_m=64, block_n=32, num_warps=4, sub_n=16)
    check(config, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=1, nheads_k=1)


@pytest.mark.parametrize("headdim", [59, 8])
def test_unaligned_path(headdim):
    # Element-wise loads: headdim not a multiple of 8, rows not 16-byte aligned.
    check(MmaForwardConfig("float16", headdim, WINDOW, aligned=False, **SMALL), seqlen_q=21, seqlen_k=26)


@pytest.mark.parametrize("aligned, row_pad", [(True, 8), (False, 3)])
def test_strided_inputs(aligned, row_pad):
    # Padded rows: strides of dims 0-2 not the packed ones (still 16-byte multiples when aligned).
    check(MmaForwardConfig("float16", 16, PLAIN, aligned=aligned, **SMALL), seqlen_q=19, seqlen_k=23,
          row_pad=row_pad)
