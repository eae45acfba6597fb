"""Attention variants as code compiled into every kernel: built once per ``Variant``.

Every kernel (portable and tensor-core, forward and backward) takes its variant's runtime values as
one tuple argument, ``params`` (``nbflash.problem.Problem.params``), and calls the device functions
built here at fixed points of its tile step:

- the **band**: ``key_tiles`` / ``query_tiles`` give the tile segments a block visits, and
  ``row_keys`` the keys a query row sees, from the window in ``params`` (``geometry`` does the
  arithmetic); without a window they reduce to the sequence bounds and ``WINDOW`` is False;
- the **mask** point, before the row max: an element is dropped iff ``hidden(key, lo, hi)`` for
  its row's ``row_keys``; tiles that every row sees whole skip the test;
- the score point (after Q K^T) and the probability point (after exp, before P V) are where the
  score and probability features enter (``nbflash.problem.PARAMS`` lists the features there are).

A feature the variant does not have compiles to nothing: the flags are closure constants of each
kernel's builder.
"""

from functools import lru_cache

from numba import int32
from numba.extending import register_jitable

from . import geometry

# The kernel type of each runtime value (``nbflash.problem.PARAMS`` gives their order).
PARAM_TYPES = {"window_left": int32, "window_right": int32}


def param_types(variant):
    """The Numba types of ``params`` for ``variant``, in order."""
    return tuple(PARAM_TYPES[name] for name in variant.param_names())


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


@lru_cache(maxsize=None)
def hooks(variant):
    """The ``Hooks`` of ``variant`` (built once per variant)."""
    return Hooks(variant)
