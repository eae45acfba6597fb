"""Philox4x32-10 (Salmon et al., 2011), the counter-based generator flash-attn and cuRAND use for
dropout: four 32-bit words of output from a 128-bit counter and a 64-bit key, with no state. The
backward regenerates the forward's dropout mask from (seed, counter) instead of storing it.

``philox(c0, c1, c2, c3, k0, k1)`` is plain integer code on uint32 values: the kernels compile it
as a device function (``register_jitable``); ``philox_numpy`` is the same rounds on NumPy arrays for
the reference. Counter of a score (``dropout_word``): (key // 4, query, head,
0) with head = (batch << 16) | head; its word is key % 4. An element is kept iff that word >= the
threshold round(p * 2^32); the key is the 64-bit seed.
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


@register_jitable
def dropout_word(row, key, b, h, seed_lo, seed_hi):
    """The 32-bit random word of score (row, key) of batch b, query head h (both < 2^16)."""
    words = philox(uint32(key // 4), uint32(row), uint32((b << 16) | h), uint32(0), uint32(seed_lo), uint32(seed_hi))
    lane = key % 4
    if lane == 0:
        return words[0]
    if lane == 1:
        return words[1]
    if lane == 2:
        return words[2]
    return words[3]


@register_jitable
def dropout_pair(row, key, b, h, seed_lo, seed_hi):
    """``dropout_word`` of (row, key) and (row, key + 1) for an even key: words key % 4 and the next
    of one call (both keys share the counter key // 4)."""
    words = philox(uint32(key // 4), uint32(row), uint32((b << 16) | h), uint32(0), uint32(seed_lo), uint32(seed_hi))
    if key % 4 == 0:
        return words[0], words[1]
    return words[2], words[3]


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


def dropout_words_numpy(rows, keys, b, h, seed_lo, seed_hi):
    """``dropout_word`` for every (rows[:, None], keys[None, :]) pair: a uint32 array."""
    rows, keys = np.asarray(rows)[:, None], np.asarray(keys)[None, :]
    words = philox_numpy(keys // 4, rows, (b << 16) | h, 0, seed_lo, seed_hi)
    lane = np.broadcast_to(keys % 4, np.broadcast(rows, keys).shape)
    return np.choose(lane, words)
