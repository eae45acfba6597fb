"""Philox4x32-10 (Salmon et al., 2011), the counter-based generator flash-attn and cuRAND use for
dropout: four 32-bit words of output from a 128-bit counter and a 64-bit key, with no state. The
backward regenerates the forward's dropout mask from (seed, counter) instead of storing it.

``philox(c0, c1, c2, c3, k0, k1)`` is plain integer code on uint32 values: the kernels compile it
as a device function (``register_jitable``); ``philox_numpy`` is the same rounds on NumPy arrays for
the reference. The key is the 64-bit seed. Each score takes a 16-bit half of a word, so one call
decides eight scores; a score is kept iff its number is at least ``keep_threshold(p)`` = round(p *
2^16), and a kept probability is scaled by ``keep_scale(p)``, the exact inverse of the kept fraction.

Which half-word belongs to a score (row = query, key): one call covers the 16 x 16 block's rows
``r``, ``r + 8`` (``r % 16 < 8``) by keys ``k``, ``k + 1``, ``k + 8``, ``k + 9`` (``k % 16 < 8``,
even), because that is what one thread of a tensor-core tile holds of it: the accumulator of an
m16n8 mma.sync (and of a 64-row wgmma) gives each lane rows g and g + 8 of a 16-row slice and keys
2 t and 2 t + 1 of each 8-key column block, so two column blocks give the eight. The forwards and
the dQ kernel make one call per eight scores and use all of it (``Hooks.dropout_factors8``). The
counter of score (row, key) is

    ((key // 16) * 4 + key % 8 // 2, (row // 16) * 8 + row % 8, (batch << 16) | head, 0),

its word 2 * (row // 8 % 2) + key // 8 % 2, and in it the low half for an even key, the high half
for an odd one. The backwards' dK/dV tile holds the transposed block (keys g, g + 8 by queries
2 t, 2 t + 1, 2 t + 8, 2 t + 9): there lanes ``L`` and ``L ^ 4`` (keys of both parities) make one
call each, for the queries 2 t, 2 t + 8 and 2 t + 1, 2 t + 9, and trade the four keep bits the
other needs with a shuffle (``Hooks.dropout_bits_t``); the portable kernels ask for one score at a
time (``dropout_bits16``).
"""

import numpy as np
from numba import uint32, uint64
from numba.extending import register_jitable

M0, M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # key increments (the golden ratio and sqrt(3) - 1)
ROUNDS = 10


@register_jitable
def _mulhilo(a, b):
    product = uint64(a) * uint64(b)
    return uint32(product >> uint64(32)), uint32(product & uint64(0xFFFFFFFF))


@register_jitable
def philox(c0, c1, c2, c3, k0, k1):
    """The four output words for counter (c0, c1, c2, c3) and key (k0, k1); all uint32."""
    for _ in range(ROUNDS):
        hi0, lo0 = _mulhilo(uint32(M0), c0)
        hi1, lo1 = _mulhilo(uint32(M1), c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = uint32((uint64(k0) + uint64(W0)) & uint64(0xFFFFFFFF))
        k1 = uint32((uint64(k1) + uint64(W1)) & uint64(0xFFFFFFFF))
    return c0, c1, c2, c3


KEEP_BITS = 16  # each score's random number: one 16-bit half of a Philox word
KEEP_RANGE = 1 << KEEP_BITS


def keep_threshold(dropout_p):
    """A score is kept iff its 16-bit random number is at least this (dropout_p in [0, 1)): the
    kept fraction is (2^16 - threshold) / 2^16, within 2^-17 of 1 - dropout_p."""
    return min(round(dropout_p * KEEP_RANGE), KEEP_RANGE - 1)


def keep_scale(dropout_p):
    """The factor of a kept probability: the exact inverse of the kept fraction (so dropout leaves
    every expectation unchanged), 1 / (1 - dropout_p) to within 2^-16 relative."""
    return KEEP_RANGE / (KEEP_RANGE - keep_threshold(dropout_p))


@register_jitable
def dropout_block(row, key, b, h, seed_lo, seed_hi):
    """The four words of the block that holds score (row, key) of batch b, query head h (both <
    2^16): rows r, r + 8 (r % 16 < 8) by keys k, k + 1, k + 8, k + 9 (k % 16 < 8, k even). Word 2 i
    + j holds rows r + 8 i by keys k + 8 j, k + 1 + 8 j, in its low and high 16 bits."""
    return philox(uint32((key // 16) * 4 + (key % 8) // 2), uint32((row // 16) * 8 + row % 8),
                  uint32((b << 16) | h), uint32(0), uint32(seed_lo), uint32(seed_hi))


@register_jitable
def half_of(word, odd):
    """The 16-bit random number in ``word``'s low (odd = 0) or high (odd = 1) half."""
    return (word >> uint32(16)) if odd else (word & uint32(0xFFFF))


@register_jitable
def dropout_bits16(row, key, b, h, seed_lo, seed_hi):
    """The 16-bit random number of score (row, key): one score at a time (the portable kernels)."""
    words = dropout_block(row, key, b, h, seed_lo, seed_hi)
    word = 2 * ((row // 8) % 2) + (key // 8) % 2
    if word == 0:
        return half_of(words[0], key % 2)
    if word == 1:
        return half_of(words[1], key % 2)
    if word == 2:
        return half_of(words[2], key % 2)
    return half_of(words[3], key % 2)


def philox_numpy(c0, c1, c2, c3, k0, k1):
    """``philox`` on NumPy uint32 arrays (broadcast together): the reference's generator."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) for c in np.broadcast_arrays(c0, c1, c2, c3))
    k0, k1 = np.uint64(k0), np.uint64(k1)
    mask = np.uint64(0xFFFFFFFF)
    for _ in range(ROUNDS):
        p0, p1 = np.uint64(M0) * c0, np.uint64(M1) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask)
        k0, k1 = (k0 + np.uint64(W0)) & mask, (k1 + np.uint64(W1)) & mask
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def dropout_bits_numpy(rows, keys, b, h, seed_lo, seed_hi):
    """``dropout_bits16`` for every (rows[:, None], keys[None, :]) pair: a uint32 array of 16-bit
    numbers."""
    rows, keys = np.asarray(rows)[:, None], np.asarray(keys)[None, :]
    words = philox_numpy((keys // 16) * 4 + (keys % 8) // 2, (rows // 16) * 8 + rows % 8, (b << 16) | h, 0,
                         seed_lo, seed_hi)
    word = np.broadcast_to(2 * ((rows // 8) % 2) + (keys // 8) % 2, np.broadcast(rows, keys).shape)
    return (np.choose(word, words) >> np.uint32(16) * (keys % 2).astype(np.uint32)) & np.uint32(0xFFFF)
