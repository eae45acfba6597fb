"""Attention variants as code compiled into every kernel: built once per ``Variant``.

Every kernel (portable and tensor-core, forward and backward) takes its variant's runtime values as
one tuple argument, ``params`` (``nbflash.problem.Problem.params``), and calls the device functions
built here at fixed points of its tile step:

- the **band**: ``key_tiles`` / ``query_tiles`` give the tile segments a block visits, and
  ``row_keys`` the keys a query row sees, from the window in ``params`` (``geometry`` does the
  arithmetic); without a window they reduce to the sequence bounds and ``WINDOW`` is False;
- the **mask** point, before the row max: an element is dropped iff ``hidden(key, lo, hi)`` for
  its row's ``row_keys``; tiles that every row sees whole skip the test;
- the **score** point, right after Q K^T: with a score feature (``SCORE``) the kernel scales the
  scores to natural units, ``x = q.k * softmax_scale``, and ``score(x, row, key, ...)`` applies
  the features in flash-attn's order: softcap (``c * tanh(x / c)``), then ALiBi
  (``- slope * |row + seqlen_k - seqlen_q - key|``, the slope from ``score_slope(params, b, h)``
  once per head). The backward calls ``score_grad``, which also returns d score / d x;
- the probability point (after exp, before P V) is where dropout will enter.

A feature the variant does not have compiles to nothing: the flags are closure constants of each
kernel's builder.
"""

import math
from functools import lru_cache

from numba import float32
from numba.extending import register_jitable

from . import geometry

# The kernel type of each runtime value, as a signature spells it (``nbflash.problem.PARAMS``
# gives their order). The ALiBi slopes are (batch, nheads), any strides (stride 0 over batch when
# the caller gave one slope per head).
PARAM_TYPES = {
    "window_left": "int32",
    "window_right": "int32",
    "softcap": "float32",
    "alibi_slopes": "float32[:,:]",
}


def param_types(variant):
    """The signature types of ``params`` for ``variant``, in order."""
    return tuple(PARAM_TYPES[name] for name in variant.param_names())


def _score_steps(variant, names):
    """(score, score_grad) device functions of each score feature, in the order they apply: each
    takes ``(x, row, key, seqlen_q, seqlen_k, params, slope)``; score_grad returns (y, dy/dx)."""
    steps = []
    if variant.softcap:
        SOFTCAP = names.index("softcap")

        @register_jitable
        def softcap(x, row, key, seqlen_q, seqlen_k, params, slope):
            cap = params[SOFTCAP]
            return cap * math.tanh(x / cap)

        @register_jitable
        def softcap_grad(x, row, key, seqlen_q, seqlen_k, params, slope):
            cap = params[SOFTCAP]
            t = math.tanh(x / cap)
            return cap * t, float32(1) - t * t

        steps.append((softcap, softcap_grad))
    if variant.alibi:

        @register_jitable
        def alibi(x, row, key, seqlen_q, seqlen_k, params, slope):
            return x - slope * float32(abs(row + seqlen_k - seqlen_q - key))

        @register_jitable
        def alibi_grad(x, row, key, seqlen_q, seqlen_k, params, slope):
            return alibi(x, row, key, seqlen_q, seqlen_k, params, slope), float32(1)

        steps.append((alibi, alibi_grad))
    return steps


def _chain(steps):
    """One (score, score_grad) pair applying ``steps`` in order (the identity for none)."""

    @register_jitable
    def score(x, row, key, seqlen_q, seqlen_k, params, slope):
        return x

    @register_jitable
    def score_grad(x, row, key, seqlen_q, seqlen_k, params, slope):
        return x, float32(1)

    for step, step_grad in steps:
        score, score_grad = _then(score, score_grad, step, step_grad)
    return score, score_grad


def _then(first, first_grad, step, step_grad):
    @register_jitable
    def score(x, row, key, seqlen_q, seqlen_k, params, slope):
        return step(first(x, row, key, seqlen_q, seqlen_k, params, slope), row, key, seqlen_q, seqlen_k, params,
                    slope)

    @register_jitable
    def score_grad(x, row, key, seqlen_q, seqlen_k, params, slope):
        y, dy = first_grad(x, row, key, seqlen_q, seqlen_k, params, slope)
        z, dz = step_grad(y, row, key, seqlen_q, seqlen_k, params, slope)
        return z, dz * dy

    return score, score_grad


class Hooks:
    """The device functions and flags a kernel builder reads for one variant.

    Visibility, in the geometry's terms (nbflash/kernels/geometry.py) but with the window read from
    ``params``: ``key_tiles`` and ``query_tiles`` give a block's tile segments, ``row_keys`` the
    keys [lo, hi) a query row sees, and ``hidden(key, lo, hi)`` is the mask test. Without a window
    they are written for what they then are (every key up to seqlen_k, no lower bound), so that
    the plain kernels hold no window state at all; ``tests/test_variants.py`` checks both against
    the geometry.
    """

    def __init__(self, variant):
        names = variant.param_names()
        self.WINDOW = WINDOW = variant.window
        if WINDOW:
            LEFT, RIGHT = names.index("window_left"), names.index("window_right")

            @register_jitable
            def key_tiles(row_start, row_end, seqlen_q, seqlen_k, params, block):
                return geometry.key_tiles(row_start, row_end, seqlen_q, seqlen_k, params[LEFT], params[RIGHT],
                                          block)

            @register_jitable
            def query_tiles(key_start, key_end, seqlen_q, seqlen_k, params, block):
                return geometry.query_tiles(key_start, key_end, seqlen_q, seqlen_k, params[LEFT], params[RIGHT],
                                            block)

            @register_jitable
            def row_keys(row, seqlen_q, seqlen_k, params):
                return geometry.visible_keys(row, seqlen_q, seqlen_k, params[LEFT], params[RIGHT])

        else:

            @register_jitable
            def key_tiles(row_start, row_end, seqlen_q, seqlen_k, params, block):
                end = (seqlen_k + block - 1) // block
                return (0, 0, seqlen_k // block, end) if seqlen_k >= block else (0, end, end, end)

            @register_jitable
            def query_tiles(key_start, key_end, seqlen_q, seqlen_k, params, block):
                end = (seqlen_q + block - 1) // block
                return (0, 0, seqlen_q // block, end) if seqlen_q >= block else (0, end, end, end)

            @register_jitable
            def row_keys(row, seqlen_q, seqlen_k, params):
                return 0, seqlen_k

        @register_jitable
        def hidden(key, lo, hi):
            """The mask test: key outside [lo, hi) (no lower bound to test without a window)."""
            return key >= hi or (WINDOW and key < lo)

        self.key_tiles, self.query_tiles, self.row_keys, self.hidden = key_tiles, query_tiles, row_keys, hidden

        self.SCORE = variant.score
        self.score, self.score_grad = _chain(_score_steps(variant, names))
        if variant.alibi:
            ALIBI = names.index("alibi_slopes")

            @register_jitable
            def score_slope(params, b, h):
                return params[ALIBI][b, h]

        else:

            @register_jitable
            def score_slope(params, b, h):
                return float32(0)

        self.score_slope = score_slope


@lru_cache(maxsize=None)
def hooks(variant):
    """The ``Hooks`` of ``variant`` (built once per variant)."""
    return Hooks(variant)
