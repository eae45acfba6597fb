"""The tensor-core backward (nbflash/kernels/backward_mma.py) against float64, through the public
``flash_attn_backward`` inside ``nbflash.kernel_family("mma")``.

Same rule as tests/test_backward.py (its helpers and its NaN-poisoned outputs are reused). In the
simulator the shapes are tiny: with the default block sizes each call is a single tile, so a second
set of cases runs with small blocks (several query and key tiles, idle warps, two dQ slices per
warp). With a GPU (`pytest -m gpu`) the full grid runs.
"""

import numpy as np
import pytest

import nbflash
from nbflash import backward, configs
from nbflash.backward import flash_attn_backward
from nbflash.kernels.backward_mma import MmaBackwardConfig
from nbflash.kernels.backward_portable import PortableBackwardConfig
from nbflash.problem import Static, Variant

from .conftest import SIMULATOR
from .helpers import random_qkv, to_numpy
from .test_backward import poisoned_outputs  # noqa: F401  (autouse: every library buffer starts as NaN)
from .test_backward import (
    HEADDIMS,
    SEQLENS,
    assert_gradients_close,
    forward,
    gpu_grid_case,
    random_like,
    reference_forward,
    run_case,
)


def run_mma(*args, **kwargs):
    """run_case through the tensor-core kernels. In the simulator out and lse come from the float64
    reference (reference_forward), not the portable forward kernel, whose emulation cost about as
    long as the backward's (tests/test_forward.py checks it on the same shapes), except where a test
    asks for the kernel's (the rows without keys: the forward's lse of -inf into the backward)."""
    kwargs.setdefault("simulator_reference_forward", True)
    return run_case(*args, family="mma", **kwargs)


def test_run_mma_runs_the_tensor_core_backward(monkeypatch, rng, xp):
    """run_mma must reach the tensor-core kernels (it once ran the portable ones: a family forced
    inside run_case overrode the one forced around it)."""
    planned = []
    plan = backward.plan_backward

    def recording_plan(*args):
        configs_ = plan(*args)
        planned.extend(type(c).__name__ for c in configs_)
        return configs_

    monkeypatch.setattr(backward, "plan_backward", recording_plan)
    backward._kernels.cache_clear()
    run_mma(rng, xp, 1, 5, 7, 1, 1, 8, "float16", False)
    backward._kernels.cache_clear()
    assert "MmaBackwardConfig" in planned


@pytest.fixture
def small_blocks(request, monkeypatch):
    """Plan the tensor-core kernels with the block sizes given as the test's parameter."""
    dkdv, dq = request.param
    monkeypatch.setattr(configs, "MMA_BACKWARD_DKDV", [(256, *dkdv)])
    monkeypatch.setattr(configs, "MMA_BACKWARD_DQ", [(256, *dq)])
    backward._kernels.cache_clear()
    yield
    backward._kernels.cache_clear()


# ---- Simulator: tiny shapes ------------------------------------------------------------------

SMALL_CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, causal, deterministic
    (1, 13, 29, 2, 1, 16, "float16", False, False),  # MQA, seqlen_q < seqlen_k
    (1, 13, 29, 2, 1, 16, "bfloat16", True, True),
    (2, 29, 13, 2, 2, 8, "bfloat16", True, False),  # seqlen_q > seqlen_k: first rows see no key
    (1, 29, 13, 2, 2, 8, "float16", False, True),
    (1, 40, 37, 1, 1, 40, "float16", True, False),  # headdim not a multiple of 16
    (1, 37, 40, 1, 1, 40, "bfloat16", False, True),
]


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[6]}-"
                         + ("causal" if c[7] else "full") + ("-deterministic" if c[8] else "-atomic"))
def test_backward_mma_small(rng, xp, case):
    run_mma(rng, xp, *case)


# (block_m, block_n, num_warps) of the dK/dV kernel, then of the dQ kernel.
SMALL_BLOCKS = {
    "m16n32": ((16, 32, 2), (32, 16, 2)),  # many tiles; in the atomic dQ step one warp of two idles
    "m64n32": ((64, 32, 2), (32, 32, 2)),  # four dQ slices over two warps
}


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
@pytest.mark.parametrize(
    "small_blocks, shape, dtype, causal, deterministic",
    [
        (SMALL_BLOCKS["m16n32"], (1, 20, 33, 3, 1, 20), "float16", False, True),  # GQA group of 3
        (SMALL_BLOCKS["m16n32"], (1, 33, 20, 1, 1, 20), "bfloat16", True, False),  # seqlen_q > seqlen_k
        (SMALL_BLOCKS["m64n32"], (1, 20, 37, 2, 1, 16), "bfloat16", True, True),  # seqlen_q < seqlen_k
        (SMALL_BLOCKS["m64n32"], (1, 33, 33, 1, 1, 24), "float16", True, False),  # diagonal, tails
        # headdim 64 over two warps: the atomic dQ step split by columns, two column pairs a warp
        (SMALL_BLOCKS["m16n32"], (1, 20, 33, 2, 1, 64), "float16", False, False),
    ],
    indirect=["small_blocks"],
    ids=["m16n32-gqa", "m16n32-causal-q>k", "m64n32-causal-q<k", "m64n32-causal-square",
         "m16n32-hd64-dq-by-columns"],
)
def test_backward_mma_several_tiles(rng, xp, small_blocks, shape, dtype, causal, deterministic):
    run_mma(rng, xp, *shape, dtype, causal, deterministic)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
@pytest.mark.parametrize("shape", [(1, 13, 29, 2, 1, 16), (1, 29, 37, 1, 1, 40)], ids=["hd16", "hd40"])
def test_backward_mma_sm80_reductions(rng, xp, monkeypatch, shape):
    """Compute capability 8.x (the simulator plans as 9.0): dQ's reductions one float32 at a time,
    by address (red_add_f32), in the dQ step split by rows (headdims 16 and 40: 8-column tiles that
    do not pair up across four warps; 40 padded to 48, its last tile's columns past 40 not added),
    causal, atomic."""
    monkeypatch.setattr(configs, "_compute_capability", lambda device: (8, 0))
    backward._kernels.cache_clear()
    try:
        run_mma(rng, xp, *shape, "float16", True, False)
    finally:
        backward._kernels.cache_clear()


def test_backward_mma_rows_without_keys(rng, xp):
    """seqlen_q > seqlen_k, causal: the first rows see nothing: dq = 0 there, and no NaN anywhere."""
    dq, dk, dv = run_mma(rng, xp, 1, 12, 4, 2, 1, 8, "float16", True, simulator_reference_forward=False)
    dq, dk, dv = (to_numpy(x).astype(np.float32) for x in (dq, dk, dv))
    assert (dq[:, :8] == 0).all()
    assert np.isfinite(dk).all() and np.isfinite(dv).all()


def test_backward_mma_transposed_views(rng, xp):
    """q, k, v and dout as transposed (batch, nheads, seqlen, headdim) views: any strides."""
    run_mma(rng, xp, 1, 17, 11, 2, 1, 8, "bfloat16", True, deterministic=True, heads_first=True)


def test_backward_mma_deterministic_is_bitwise_reproducible(rng, xp):
    q, k, v = random_qkv(rng, xp, 1, 17, 13, 1, 1, 12, "float16")
    dout = random_like(rng, xp, q)
    # (in the simulator out and lse from the float64 reference: the backward's bits are under test)
    out, lse = reference_forward(xp, q, k, v, None, True) if SIMULATOR else forward(q, k, v, causal=True)
    with nbflash.kernel_family("mma"):
        first = flash_attn_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        second = flash_attn_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for a, b in zip(first, second):
        assert np.array_equal(to_numpy(a).view(np.uint16), to_numpy(b).view(np.uint16))


def test_backward_mma_planning():
    """Tensor-core by default for float16/bfloat16 (as the forward), portable for float32; 'mma'
    plans the tensor-core dK/dV and dQ kernels around the portable preprocess and conversion."""
    causal = Variant(window=True)
    for deterministic in (False, True):
        default = configs.plan_backward(Static("float16", 64, False, 0, causal), deterministic)
        assert [type(c) for c in default[:2]] == [PortableBackwardConfig, MmaBackwardConfig]
        assert all(isinstance(c, PortableBackwardConfig)
                   for c in configs.plan_backward(Static("float32", 64, False, 0, causal), deterministic))
    preprocess, dkdv, convert = configs.plan_backward(Static("float16", 64, False, 0, causal), False, "mma")
    assert (preprocess.kernel, convert.kernel) == ("preprocess", "convert_dq")
    assert isinstance(dkdv, MmaBackwardConfig) and dkdv.kernel == "dkdv" and dkdv.atomic_dq
    _, dkdv, dq = configs.plan_backward(Static("bfloat16", 256, False, 0), True, "mma")
    assert (dkdv.kernel, dq.kernel) == ("dkdv", "dq") and not dkdv.atomic_dq
    assert isinstance(dq, MmaBackwardConfig)


def test_backward_mma_rejects_float32(rng, xp):
    q, k, v = random_qkv(rng, xp, 1, 4, 4, 1, 1, 8, "float32")
    lse = xp.zeros((1, 1, 4), np.float32)
    with nbflash.kernel_family("mma"), pytest.raises(ValueError, match=r"kernel family 'sm80' \(mma.sync\) cannot run"):
        flash_attn_backward(q, q, k, v, q, lse)


# ---- GPU: the full grid, the one tests/test_backward.py runs on the portable kernels ------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", HEADDIMS)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_backward_mma_gpu(rng, xp, seqlens, headdim, causal, dtype):
    gpu_grid_case(run_mma, rng, xp, seqlens, headdim, causal, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_backward_mma_gpu_deterministic_bitwise(rng, xp, dtype):
    """Many blocks racing for the same rows: deterministic mode must still give equal bits, and the
    atomic path must agree with it to rounding."""
    q, k, v = random_qkv(rng, xp, 2, 1023, 1024, 8, 2, 64, dtype)
    dout = random_like(rng, xp, q)
    out, lse = nbflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    with nbflash.kernel_family("mma"):
        runs = [flash_attn_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
                for _ in range(3)]
        fast = flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert np.array_equal(to_numpy(a).view(np.uint16), to_numpy(b).view(np.uint16))
    for a, b in zip(runs[0], fast):
        a, b = to_numpy(a).astype(np.float32), to_numpy(b).astype(np.float32)
        assert np.abs(a - b).max() <= 1e-2 * max(1.0, np.abs(a).max())


@pytest.mark.gpu
def test_backward_mma_gpu_matches_portable(rng, xp):
    """The two families agree on a mid-size problem (a check independent of the reference)."""
    q, k, v = random_qkv(rng, xp, 2, 384, 512, 4, 2, 128, "float16")
    dout = random_like(rng, xp, q)
    out, lse = nbflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    with nbflash.kernel_family("portable"):
        portable = flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    with nbflash.kernel_family("mma"):
        mma = flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    assert_gradients_close(mma, dout, q, k, v, True)
    for a, b in zip(portable, mma):
        a, b = to_numpy(a).astype(np.float32), to_numpy(b).astype(np.float32)
        assert np.abs(a - b).max() <= 2e-2 * max(1.0, np.abs(a).max())
