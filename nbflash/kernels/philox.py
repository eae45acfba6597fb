"""Philox4x32-10 (Salmon et al., 2011), the counter-based generator flash-attn and cuRAND use for
dropout: four 32-bit words of output from a 128-bit counter and a 64-bit key, with no state. The
backward regenerates the forward's dropout mask from (seed, counter) instead of storing it.

``philox(c0, c1, c2, c3, k0, k1)`` is plain integer code on uint32 values: the kernels compile it
as a device function (``register_jitable``); ``philox_numpy`` is the same rounds on NumPy arrays for
the reference. The key is the 64-bit seed. Each score takes one byte of a word, so one call decides
sixteen scores (flash-attn 2 also compares bytes); a score is kept iff its byte is at least
``keep_threshold(p)`` = round(p * 256), and a kept probability is scaled by ``keep_scale(p)``, the
exact inverse of the kept fraction, so dropout leaves every expectation unchanged.

Which byte belongs to a score (row = query, key): one call covers rows ``r``, ``r + 8`` (``r % 16 <
8``) by keys ``k + 8 j + e`` (``k % 32 < 8`` even, j < 4, e < 2), because that is what one thread of
a tensor-core tile holds of a 16 x 32 block: the accumulator of an m16n8 mma.sync (and of a 64-row
wgmma) gives each lane rows g and g + 8 of a 16-row slice and keys 2 t and 2 t + 1 of each 8-key
column block, so four column blocks give the sixteen. The forwards and the dQ kernel make one call
per sixteen scores and use all of it (``Hooks.dropout_words``). The counter of score (row, key) is

    ((key // 32) * 4 + key % 8 // 2, (row // 16) * 8 + row % 8, (batch << 16) | head, 0),

its word (key // 8) % 4 and in it byte 2 * (row // 8 % 2) + key % 2: a word holds one 8-key column
block's four scores in the accumulator's order. The backwards' dK/dV tile holds the transposed
block (keys g, g + 8 by queries 2 t, 2 t + 1, 2 t + 8, 2 t + 9): there lanes ``L`` and ``L ^ 4``
(keys of both parities) make one call each, for the queries 2 t, 2 t + 8 and 2 t + 1, 2 t + 9, and
trade the four keep bits the other needs with a shuffle (``Hooks.dropout_bits_t``); the portable
kernels ask for one score at a time (``dropout_byte``).
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
        c0, c1, c2, c3 = uint32(hi1 ^ c1 ^ k0), lo1, uint32(hi0 ^ c3 ^ k1), lo0
        k0 = uint32((uint64(k0) + uint64(W0)) & uint64(0xFFFFFFFF))
        k1 = uint32((uint64(k1) + uint64(W1)) & uint64(0xFFFFFFFF))
    return c0, c1, c2, c3


KEEP_BITS = 8  # each score's random number: one byte of a Philox word
KEEP_RANGE = 1 << KEEP_BITS


def keep_threshold(dropout_p):
    """A score is kept iff its random byte is at least this (dropout_p in [0, 1)): the dropped
    fraction is threshold / 256, dropout_p rounded to a multiple of 1/256."""
    return min(round(dropout_p * KEEP_RANGE), KEEP_RANGE - 1)


def keep_scale(dropout_p):
    """The factor of a kept probability: the exact inverse of the kept fraction (so dropout leaves
    every expectation unchanged)."""
    return KEEP_RANGE / (KEEP_RANGE - keep_threshold(dropout_p))


@register_jitable
def dropout_block(row, key, b, h, seed_lo, seed_hi):
    """The four words of the block that holds score (row, key) of batch b, query head h (both <
    2^16): rows r, r + 8 (r % 16 < 8) by keys k + 8 j + e (k % 32 < 8 even, j < 4, e < 2). Word j
    holds keys k + 8 j, k + 8 j + 1 of rows r, r + 8, in bytes 2 i + e (row r + 8 i)."""
    return philox(uint32((key // 32) * 4 + (key % 8) // 2), uint32((row // 16) * 8 + row % 8),
                  uint32((b << 16) | h), uint32(0), uint32(seed_lo), uint32(seed_hi))


@register_jitable
def byte_of(word, n):
    """Byte ``n`` (0 the lowest) of ``word``: one score's random number."""
    return (word >> uint32(8 * n)) & uint32(0xFF)


@register_jitable
def dropout_byte(row, key, b, h, seed_lo, seed_hi):
    """The random byte of score (row, key): one score at a time (the portable kernels)."""
    words = dropout_block(row, key, b, h, seed_lo, seed_hi)
    n = 2 * ((row // 8) % 2) + key % 2
    j = (key // 8) % 4
    if j == 0:
        return byte_of(words[0], n)
    if j == 1:
        return byte_of(words[1], n)
    if j == 2:
        return byte_of(words[2], n)
    return byte_of(words[3], n)


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
    """``dropout_byte`` for every (rows[:, None], keys[None, :]) pair: a uint32 array of bytes."""
    rows, keys = np.asarray(rows)[:, None], np.asarray(keys)[None, :]
    words = philox_numpy((keys // 32) * 4 + (keys % 8) // 2, (rows // 16) * 8 + rows % 8, (b << 16) | h, 0,
                         seed_lo, seed_hi)
    word = np.broadcast_to((keys // 8) % 4, np.broadcast(rows, keys).shape)
    shift = (8 * (2 * ((rows // 8) % 2) + keys % 2)).astype(np.uint32)
    return (np.choose(word, words) >> shift) & np.uint32(0xFF)
