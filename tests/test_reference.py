"""The float64 reference itself: its gradients against finite differences of its forward, for every
built-in variant (the kernels are judged against it, so it must be right)."""

import numpy as np
import pytest

from nbflash.catalogue import VARIANTS, variant_arguments
from nbflash.reference import attention_reference, attention_reference_backward


@pytest.mark.parametrize("name", list(VARIANTS))
def test_reference_gradients_match_finite_differences(name):
    rng = np.random.default_rng(len(name))
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = 2, 7, 9, 2, 1, 4
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim))
    k = rng.standard_normal((batch, seqlen_k, nheads_k, headdim))
    v = rng.standard_normal((batch, seqlen_k, nheads_k, headdim))
    dout = rng.standard_normal(q.shape)
    arguments = variant_arguments(name, batch, nheads, seqlen_k, np, seqlen_q)
    if "softcap" in arguments:
        arguments["softcap"] = 1.5  # small enough that tanh bends the scores
        q = q * 3

    def loss(q, k, v):
        return float((attention_reference(q, k, v, 0.7, **arguments) * dout).sum())

    grads = attention_reference_backward(dout, q, k, v, 0.7, **arguments)
    for x, grad, which in zip((q, k, v), grads, "qkv"):
        direction = rng.standard_normal(x.shape)
        h = 1e-5
        plus = [y + h * direction if w == which else y for y, w in zip((q, k, v), "qkv")]
        minus = [y - h * direction if w == which else y for y, w in zip((q, k, v), "qkv")]
        numeric = (loss(*plus) - loss(*minus)) / (2 * h)
        analytic = float((grad * direction).sum())
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (which, numeric, analytic)
