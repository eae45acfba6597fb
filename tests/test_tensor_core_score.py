"""The tensor-core kernels' score point (variants.Hooks.tensor_core_score) and the special functions
it is built from.

The score point takes raw q.k and leaves a score in units the softmax folds (softcap's, the scale's
or natural ones): turned back to natural units it must be the variant's ``score``, and its gradient
``score_grad``'s. The special functions: the simulator's emulations, and on a GPU the MUFU
instructions themselves, within the bounds the PTX ISA gives them.
"""

import math

import numpy as np
import pytest
from numba import cuda, float32

from nbflash import primitives as P
from nbflash.kernels import variants
from nbflash.problem import Variant

from .conftest import SIMULATOR

TANH_APPROX_BOUND = 2.0**-10.987  # relative (PTX ISA, tanh.approx.f32)
EXP2_TANH_BOUND = 5e-7  # absolute: ex2.approx and rcp.approx, ~2^-22 each, and the final rounding


_EXP2_TANH_LESS = variants._softcap_tanh("exp2")[0]  # tanh(u) - 1, for units[PRE] * s = 2 u log2(e)


@cuda.jit
def _special_kernel(x, rcp, tanh_mufu, tanh_exp2):
    tanh_less = _EXP2_TANH_LESS
    i = cuda.threadIdx.x
    while i < x.size:
        rcp[i] = P.rcp_approx(x[i])
        tanh_mufu[i] = P.tanh_approx(x[i])
        # the exp2 tanh on u = x: its argument is 2 u log2(e), with units[PRE] = 2 log2(e)
        units = (float32(0), float32(0), float32(2 * variants.LOG2E), float32(1), float32(0))
        tanh_exp2[i] = tanh_less(x[i], units) + float32(1)
        i += cuda.blockDim.x


def check_special_functions(x):
    outs = [np.full(x.size, np.nan, np.float32) for _ in range(3)]
    _special_kernel[1, 64](x, *outs)
    rcp, tanh_mufu, tanh_exp2 = (o.astype(np.float64) for o in outs)
    x64 = x.astype(np.float64)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(rcp, 1 / x64, rtol=2.0**-22)
    exact = np.tanh(x64)
    assert (np.abs(tanh_mufu - exact) <= TANH_APPROX_BOUND * np.abs(exact)).all()
    assert np.abs(tanh_exp2 - exact).max() <= EXP2_TANH_BOUND
    nonzero = exact != 0
    return (np.abs(tanh_mufu - exact)[nonzero] / np.abs(exact[nonzero])).max(), np.abs(tanh_exp2 - exact).max()


def _arguments(rng, n):
    x = np.concatenate([rng.standard_normal(n // 2) * 3, rng.uniform(-12, 12, n // 2), [0, 1e-3, -1e-3, 40, -40]])
    return np.concatenate([x, [np.inf, -np.inf]]).astype(np.float32)


def test_special_functions(rng):
    check_special_functions(_arguments(rng, 256))


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="checks the MUFU instructions; needs a GPU")
def test_special_functions_on_gpu(rng):
    x = np.concatenate([_arguments(rng, 1 << 16), np.linspace(-10, 10, 1 << 16, dtype=np.float32)])
    check_special_functions(x)


# ---- the score point against the variant's natural-unit score (Python calls: the simulator) --------

SEQLEN_Q, SEQLEN_K, BATCH, NHEADS = 7, 11, 2, 3
CASES = {  # the units each leaves S in: cap, scale, natural
    "softcap": (Variant(softcap=True), 0.125), "alibi": (Variant(alibi=True), 0.125),
    "alibi-negative-scale": (Variant(alibi=True), -0.5),
    "window-softcap-alibi": (Variant(softcap=True, alibi=True, window=True), 0.3),
    "softcap-bias": (Variant(softcap=True, bias="float32"), 0.25),
    "alibi-bias": (Variant(alibi=True, bias="float32"), 0.25), "plain": (Variant(), 0.25),
}


def _params(rng, variant, cap):
    values = {
        "window_left": 3, "window_right": 1, "softcap": np.float32(cap),
        "alibi_slopes": rng.uniform(0.01, 0.5, (BATCH, NHEADS)).astype(np.float32),
        "bias": rng.standard_normal((BATCH, NHEADS, SEQLEN_Q, SEQLEN_K)).astype(np.float32),
    }
    return tuple(values[name] for name in variant.param_names())


@pytest.mark.skipif(not SIMULATOR, reason="calls the device functions from Python")
@pytest.mark.parametrize("kind, bound", [("exp2", EXP2_TANH_BOUND), ("mufu", TANH_APPROX_BOUND)], ids=["exp2", "mufu"])
@pytest.mark.parametrize("variant, scale", CASES.values(), ids=CASES.keys())
def test_tensor_core_score_is_the_score(rng, monkeypatch, kind, bound, variant, scale):
    monkeypatch.setattr(variants, "SOFTCAP_TANH", kind)
    cap = 7.5
    hooks = variants.Hooks(variant)  # not the cached hooks: built with this tanh
    params = _params(rng, variant, cap)
    score_units, score_row, score_at, score_at_grad = hooks.tensor_core_score(scale > 0)
    for b, h in [(0, 0), (1, 2)]:
        head_ctx = hooks.head_context(params, b, h)
        units = score_units(params, np.float32(scale), head_ctx)
        assert units[variants.EXP] > 0
        for row0, key0 in [(0, 0), (2, 5), (6, 1)]:
            ctx = score_row(row0, key0, SEQLEN_Q, SEQLEN_K, params, head_ctx, units)
            for row_off, key_off in [(0, 0), (0, 3), (1, 0), (0, 5)]:
                row, key = row0 + row_off, key0 + key_off
                for s in np.float32([-60.0, -3.0, -0.2, 0.0, 0.7, 4.0, 45.0]):
                    expected, expected_grad = hooks.score_grad(np.float32(s * np.float32(scale)), row, key, SEQLEN_Q,
                                                               SEQLEN_K, params, head_ctx)
                    assert hooks.score(np.float32(s * np.float32(scale)), row, key, SEQLEN_Q, SEQLEN_K, params,
                                       head_ctx) == expected
                    y = score_at(s, ctx, row_off, key_off, SEQLEN_Q, SEQLEN_K, params, head_ctx, units)
                    y_grad, grad = score_at_grad(s, ctx, row_off, key_off, SEQLEN_Q, SEQLEN_K, params, head_ctx, units)
                    assert y_grad == y
                    natural = (float(y) * float(units[variants.EXP]) + float(units[variants.OFFSET])) * math.log(2)
                    # tanh's error, times the cap (relative for tanh.approx), and float32 rounding
                    tanh_error = cap * (bound * abs(math.tanh(s * scale / cap)) if kind == "mufu" else bound)
                    tolerance = (tanh_error if variant.softcap else 0) + 4e-6 * (1 + abs(float(expected)))
                    assert abs(natural - float(expected)) <= tolerance, (s, row, key)
                    assert abs(float(grad) - float(expected_grad)) <= 4 * tanh_error / cap + 1e-6
