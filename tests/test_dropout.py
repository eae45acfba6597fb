"""Attention dropout: the kernels' Philox stream against the reference's (the same mask, so the
forward and backward compare exactly), statistics of the mask, reproducibility, and the seed."""

import numpy as np
import pytest

import nbflash
from nbflash.backward import flash_attn_backward
from nbflash.kernels.philox import (KEEP_RANGE, dropout_bits_numpy, keep_scale, keep_threshold, philox,
                                    philox_numpy)

from .conftest import SIMULATOR
from .helpers import assert_attention_close, poison_allocations, random_qkv, simulator_small_tiles, to_numpy
from .test_backward import assert_gradients_close, random_like, reference_forward


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    poison_allocations(monkeypatch)


def test_philox_known_answers():
    """Random123's published Philox4x32-10 vectors, through the kernels' code and the NumPy one."""
    ones = 0xFFFFFFFF
    for counter_and_key, expected in (((0,) * 6, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
                                      ((ones,) * 6, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD))):
        assert tuple(int(w) for w in philox(*(np.uint32(x) for x in counter_and_key))) == expected
        assert tuple(int(w) for w in philox_numpy(*counter_and_key)) == expected


def test_dropout_mask_statistics():
    """The kept fraction is 1 - p, with no structure along rows, keys or heads (chi-square-free
    checks: the fraction per row and per key column stays within 5 standard deviations)."""
    rows, keys = 256, 256
    threshold = keep_threshold(0.3)
    p = threshold / KEEP_RANGE  # the dropped fraction asked for: 0.3 rounded to 1/256
    kept = dropout_bits_numpy(np.arange(rows), np.arange(keys), 1, 3, 12345, 678) >= threshold
    sigma = np.sqrt(p * (1 - p) / kept.size)
    assert abs(kept.mean() - (1 - p)) < 5 * sigma
    for axis in (0, 1):
        spread = np.sqrt(p * (1 - p) / kept.shape[axis])
        assert np.abs(kept.mean(axis=axis) - (1 - p)).max() < 5.5 * spread
    other_head = dropout_bits_numpy(np.arange(rows), np.arange(keys), 1, 4, 12345, 678) >= threshold
    assert 0.4 < (kept == other_head).mean() < 0.65  # independent heads agree ~ p^2 + (1 - p)^2 = 0.58


def run(rng, xp, family, dtype, backward, shape=(1, 9, 13, 2, 1, 8), deterministic=False, forward="kernel"):
    """The forward with dropout, then (``backward``) its backward; ``forward="reference"``: the
    backward from the float64 reference's out and lse, no forward kernel run."""
    q, k, v = random_qkv(rng, xp, *shape, dtype)
    if forward == "reference":
        out, lse = reference_forward(xp, q, k, v, None, True, dropout_p=0.2, seed=2024)
    else:
        with nbflash.kernel_family(family):
            out, lse = nbflash.flash_attn_func(q, k, v, 0.2, causal=True, return_lse=True, seed=2024)
        assert_attention_close(out, lse, q, k, v, True, dropout_p=0.2, seed=2024)
    if backward:
        dout = random_like(rng, xp, q)
        with nbflash.kernel_family(family):
            grads = flash_attn_backward(dout, q, k, v, out, lse, 0.2, causal=True, seed=2024,
                                        deterministic=deterministic)
        assert_gradients_close(grads, dout, q, k, v, True, dropout_p=0.2, seed=2024)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")
def test_dropout_portable(rng, xp):
    """The portable forward and backward with dropout, on small tiles (helpers.small_tiles: 9 query
    rows span two 8-row tiles of the forward and the dQ kernel, 13 keys two 8-key tiles of the dK/dV
    kernel, so each tile's scores take their Philox bytes at their own rows and keys; default
    tiles, one of each, emulated six times as long, 19 s against 3: the forward at those runs in
    test_attn_probs_mark_dropped_entries_negative)."""
    with simulator_small_tiles():
        run(rng, xp, "portable", "float32", backward=True)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")
@pytest.mark.parametrize("deterministic", [False, True])
def test_dropout_mma(rng, xp, deterministic):
    # 40 query rows: both 16-row slices' row pairs (r, r + 8) of the forward's and the dQ kernel's
    # Philox blocks, and both query halves of the dK/dV kernel's shared calls (dropout_bits_t). The
    # forward kernel runs once, before the atomic backward; the deterministic one starts from the
    # reference's out and lse (the same forward on the same shape again cost two fifths of its time)
    run(rng, xp, "mma", "float16", backward=True, shape=(1, 40, 37, 1, 1, 16), deterministic=deterministic,
        forward="reference" if deterministic else "kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("family, dtype", [("mma", "float16"), ("mma", "bfloat16"), ("portable", "float32")])
@pytest.mark.parametrize("shape", [(2, 113, 203, 4, 2, 64), (1, 300, 300, 2, 1, 128)], ids=lambda s: "x".join(map(str, s)))
def test_dropout_gpu(rng, xp, family, dtype, shape):
    run(rng, xp, family, dtype, backward=True, shape=shape, deterministic=shape[0] == 1)


def test_same_seed_same_bits_and_fresh_seeds(rng, xp):
    """The seed's bookkeeping, not the kernel's dropout (the tests above check that against the
    reference): in the simulator on small tiles, which the seeds do not depend on and which emulate
    many times faster (default tiles: four forwards took 50 s of CI)."""
    q, k, v = random_qkv(rng, xp, 1, 5, 8, 1, 1, 4, "float32")
    with simulator_small_tiles(), nbflash.kernel_family("portable"):
        first = to_numpy(nbflash.flash_attn_func(q, k, v, 0.5, seed=7))
        other = to_numpy(nbflash.flash_attn_func(q, k, v, 0.5, seed=8))
        fresh = to_numpy(nbflash.flash_attn_func(q, k, v, 0.5))
        drawn = nbflash.last_dropout_seed()
        replay = to_numpy(nbflash.flash_attn_func(q, k, v, 0.5, seed=drawn))
    assert not np.array_equal(first, other) and not np.array_equal(first, fresh)
    assert isinstance(drawn, int) and np.array_equal(fresh, replay)  # the same seed: the same bits


def test_attn_probs_mark_dropped_entries_negative(rng, xp):
    q, k, v = random_qkv(rng, xp, 1, 5, 8, 1, 1, 4, "float32")
    with nbflash.kernel_family("portable"):
        out, _, probs = nbflash.flash_attn_func(q, k, v, 0.4, return_attn_probs=True, seed=3)
    probs = to_numpy(probs)
    assert (probs < 0).any() and np.allclose(np.abs(probs).sum(-1), 1, atol=1e-5)
    expected = np.einsum("bhij,bjhd->bihd", np.maximum(probs, 0) * keep_scale(0.4), to_numpy(v).astype(np.float32))
    assert np.abs(to_numpy(out) - expected).max() < 1e-4


def test_backward_needs_the_seed(rng, xp):
    q, k, v = random_qkv(rng, xp, 1, 4, 4, 1, 1, 8, "float32")
    # out and lse from the float64 reference: the error comes before any launch, so no forward
    # kernel need run (emulated, the dropout forward took 11 s of CI)
    out, lse = reference_forward(xp, q, k, v)
    with pytest.raises(ValueError, match="pass the forward's seed"):
        flash_attn_backward(q, q, k, v, out, lse, 0.1)
    with pytest.raises(TypeError, match="seed must be an int"):
        nbflash.flash_attn_func(q, k, v, 0.1, seed=-1)


def test_one_philox_call_decides_sixteen_scores():
    # One call's four words hold rows r, r + 8 (r % 16 < 8) by keys k + 8 j + e (k % 32 < 8 even),
    # word j, byte 2 i + e for row r + 8 i: a tensor-core lane's scores of four 8-key column blocks,
    # each word in the accumulator's order. The one-score path and the reference agree.
    from nbflash.kernels.philox import dropout_block, dropout_byte

    for row, key, b, h in ((0, 0, 0, 0), (5, 2, 1, 3), (71, 134, 2, 15), (1015, 4070, 0, 7)):
        words = [int(w) for w in dropout_block(row, key, b, h, 12345, 678)]
        numbers = {(row + 8 * i, key + 8 * j + e): (words[j] >> (8 * (2 * i + e))) & 0xFF
                   for i in range(2) for j in range(4) for e in range(2)}
        for (r, k), number in numbers.items():
            assert int(dropout_byte(r, k, b, h, 12345, 678)) == number
            # every score of the block names the same call
            assert [int(w) for w in dropout_block(r, k, b, h, 12345, 678)] == words
        rows, keys = np.array([row, row + 8]), key + np.array([0, 1, 8, 9, 16, 17, 24, 25])
        block = dropout_bits_numpy(rows, keys, b, h, 12345, 678)
        assert all(int(block[a, c]) == numbers[(rows[a], keys[c])] for a in range(2) for c in range(8))
    # distinct blocks of a head take distinct counters: their words (4 bytes of one 8-key column
    # block's rows r, r + 8 by keys k, k + 1) differ
    every = dropout_bits_numpy(np.arange(48), np.arange(64), 0, 0, 1, 2).astype(np.uint64)
    r, k = np.array([i for i in range(48) if i % 16 < 8]), np.arange(0, 64, 2)
    words = (every[r][:, k] | (every[r][:, k + 1] << np.uint64(8)) | (every[r + 8][:, k] << np.uint64(16))
             | (every[r + 8][:, k + 1] << np.uint64(24)))
    assert len(np.unique(words)) == words.size
    assert every.max() < KEEP_RANGE


def test_keep_threshold_and_scale():
    # p rounds to a multiple of 1/256; the scale is the exact inverse of the kept fraction
    for p in (0.0, 0.1, 0.25, 0.5, 0.9, 0.99):
        threshold = keep_threshold(p)
        assert abs(threshold / KEEP_RANGE - p) <= 1 / 512 and threshold < KEEP_RANGE
        assert keep_scale(p) * (KEEP_RANGE - threshold) == KEEP_RANGE
    assert keep_threshold(0.1) == 26 and keep_scale(0.5) == 2.0 and keep_threshold(0.999) == 255  # at most 255/256
