"""The visibility rule and the tile segments every kernel, the planner and the reference share,
against brute force over small shapes."""


import numpy as np
import pytest

from nbflash.kernels import geometry
from nbflash.problem import window_bounds
from nbflash.reference import visible

LENGTHS = [(1, 1), (5, 2), (2, 5), (7, 7), (13, 29), (29, 13)]
WINDOWS = [(-1, -1), (-1, 0), (0, 0), (3, 1), (1, 4), (-1, 2), (6, -1), (40, 40)]


def brute_force(seqlen_q, seqlen_k, window):
    """flash-attn's rule, written out: query i sees key j iff j is inside the sequence and
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (-1: unbounded)."""
    left, right = window
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    d = i + seqlen_k - seqlen_q
    return ((left < 0) | (j >= d - left)) & ((right < 0) | (j <= d + right)) & (j >= 0)


@pytest.mark.parametrize("seqlen_q, seqlen_k", LENGTHS)
@pytest.mark.parametrize("window", WINDOWS)
def test_visible_keys_and_queries(seqlen_q, seqlen_k, window):
    expected = brute_force(seqlen_q, seqlen_k, window)
    left, right, masks = window_bounds(seqlen_q, seqlen_k, False, window)
    assert masks == (not expected.all())
    mask = visible(seqlen_q, seqlen_k, window_size=window)
    assert np.array_equal(expected, np.ones_like(expected) if mask is None else mask)
    for row in range(seqlen_q):
        lo, hi = geometry.visible_keys(row, seqlen_q, seqlen_k, left, right)
        assert set(range(lo, hi)) == set(np.flatnonzero(expected[row]))
    for key in range(seqlen_k):
        lo, hi = geometry.visible_queries(key, seqlen_q, seqlen_k, left, right)
        assert set(range(lo, hi)) == set(np.flatnonzero(expected[:, key]))
    assert geometry.visible_count(seqlen_q, seqlen_k, left, right) == expected.sum()


def test_causal_is_the_window_minus_one_zero():
    for seqlen_q, seqlen_k in LENGTHS:
        assert np.array_equal(brute_force(seqlen_q, seqlen_k, (-1, 0)),
                              np.arange(seqlen_k)[None, :] <= np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q)
        assert window_bounds(seqlen_q, seqlen_k, True, (-1, -1)) == window_bounds(seqlen_q, seqlen_k, False, (-1, 0))


@pytest.mark.parametrize("seqlen_q, seqlen_k", LENGTHS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block", [1, 4, 16])
def test_tile_segments(seqlen_q, seqlen_k, window, block):
    """For every block of rows (and of keys): the tiles visited are exactly those with a visible
    element, and the unmasked ones exactly those every row (column) sees whole."""
    seen = brute_force(seqlen_q, seqlen_k, window)
    left, right, _ = window_bounds(seqlen_q, seqlen_k, False, window)
    for transpose, length, other in ((False, seqlen_q, seqlen_k), (True, seqlen_k, seqlen_q)):
        grid = seen.T if transpose else seen
        segments = geometry.query_tiles if transpose else geometry.key_tiles
        for start in range(0, length, block):
            end = min(start + block, length)
            first, first_full, end_full, last = segments(start, end, seqlen_q, seqlen_k, left, right, block)
            rows = grid[start:end]
            tiles = [rows[:, t * block:(t + 1) * block] for t in range(-(-other // block))]
            any_seen = [t for t, tile in enumerate(tiles) if tile.any()]
            full = [t for t, tile in enumerate(tiles) if tile.shape[1] == block and tile.all()]
            if any_seen:
                assert (first, last) == (any_seen[0], any_seen[-1] + 1)
                assert any_seen == list(range(first, last))  # the visible tiles are contiguous
            else:
                assert first == last
            assert list(range(first_full, end_full)) == full


@pytest.mark.parametrize("tiles, pairs, groups", [(1, 1, 1), (5, 6, 4), (3, 8, 8), (7, 3, 16), (4, 12, 3)])
def test_grouped_order_visits_each_tile_once(tiles, pairs, groups):
    """The heavy_groups order: every (tile, pair) exactly once, the blocks past the last pair
    idle, and inside each group tile 0 of every pair before any pair's tile 1."""
    x_blocks, y_blocks, z_blocks = geometry.grouped_grid(tiles, pairs, groups)
    assert z_blocks == 1 and y_blocks * groups >= pairs > (y_blocks - 1) * groups
    seen = [geometry.grouped_block(x, y, groups) for y in range(y_blocks) for x in range(x_blocks)]
    real = [(tile, pair) for tile, pair in seen if pair < pairs]
    assert sorted(real) == [(t, p) for t in range(tiles) for p in range(pairs)]
    assert len(seen) - len(real) == y_blocks * groups * tiles - pairs * tiles
    for y in range(y_blocks):
        row = [geometry.grouped_block(x, y, groups)[0] for x in range(x_blocks)]
        assert row == sorted(row)  # tile by tile within the group


@pytest.mark.parametrize("hk, group, first_tile, tiles_per_head", [(0, 1, 0, 1), (2, 3, 4, 5), (1, 8, 0, 7), (3, 2, 9, 1)])
def test_query_step_walks_each_pair_once(hk, group, first_tile, tiles_per_head):
    """query_step (the mma backward's dK/dV steps, one unsigned division): step s is query head
    hk group + s // tiles_per_head and tile first_tile + s % tiles_per_head, every pair once."""
    pairs = [geometry.query_step(s, hk, group, first_tile, tiles_per_head) for s in range(group * tiles_per_head)]
    expected = [(hk * group + h, first_tile + t) for h in range(group) for t in range(tiles_per_head)]
    assert [(int(h), int(t)) for h, t in pairs] == expected
