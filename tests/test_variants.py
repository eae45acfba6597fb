"""The variant hooks the kernels call (nbflash/kernels/variants.py) agree with the geometry they
stand for: with a window they read it from params; without one they are the sequence bounds."""

import pytest

from nbflash.kernels import geometry, variants
from nbflash.problem import Variant, window_bounds

from .test_geometry import LENGTHS


@pytest.mark.parametrize("seqlen_q, seqlen_k", LENGTHS + [(64, 64), (100, 37)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (3, 1)])
@pytest.mark.parametrize("block", [1, 4, 16, 128])
def test_hooks_match_the_geometry(seqlen_q, seqlen_k, window, block):
    left, right, masks = window_bounds(seqlen_q, seqlen_k, False, window)
    hooks = variants.hooks(Variant(window=masks))
    params = (left, right) if masks else ()

    def masked_and_visited(segments):
        first, first_full, end_full, end = segments
        return set(range(first, end)), {t for t in range(first, end) if not first_full <= t < end_full}

    for start in range(0, seqlen_q, block):
        end = min(start + block, seqlen_q)
        assert masked_and_visited(hooks.key_tiles(start, end, seqlen_q, seqlen_k, params, block)) == \
            masked_and_visited(geometry.key_tiles(start, end, seqlen_q, seqlen_k, left, right, block))
    for start in range(0, seqlen_k, block):
        end = min(start + block, seqlen_k)
        assert masked_and_visited(hooks.query_tiles(start, end, seqlen_q, seqlen_k, params, block)) == \
            masked_and_visited(geometry.query_tiles(start, end, seqlen_q, seqlen_k, left, right, block))
    for row in range(seqlen_q):
        lo, hi = hooks.row_keys(row, seqlen_q, seqlen_k, params)
        expected = geometry.visible_keys(row, seqlen_q, seqlen_k, left, right)
        kept = [k for k in range(seqlen_k) if not hooks.hidden(k, lo, hi, row, seqlen_q, params, (0, 0, 0.0))]
        assert kept == list(range(*expected))


def test_params_follow_the_variant():
    assert variants.param_types(Variant()) == ()
    assert variants.param_types(Variant(window=True)) == ("int32", "int32")
    assert variants.param_types(Variant(window=True, softcap=True, alibi=True))[2:] == ("float32", "float32[:,:]")
