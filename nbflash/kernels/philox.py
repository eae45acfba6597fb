"""Philox4x32-10 (Salmon et al., 2011), the counter-based generator flash-attn and cuRAND use for
dropout: four 32-bit words of output from a 128-bit counter and a 64-bit key, with no state. The
backward regenerates the forward's dropout mask from (seed, counter) instead of storing it.

``philox(c0, c1, c2, c3, k0, k1)`` is plain integer code on uint32 values: the kernels compile it
as a device function (``register_jitable``); ``philox_numpy`` is the same rounds on NumPy arrays for
the reference. An element is kept iff its word >= the threshold round(p * 2^32); the key is the
64-bit seed.

Which word belongs to a score (row = query, key): one call's four words cover a 2 x 2 block of
scores, the rows ``r`` and ``r + 8`` (``r % 16 < 8``) by the keys ``k`` and ``k + 1`` (``k``
even), because that is what one thread of a tensor-core tile holds: the accumulator of an
m16n8 mma.sync (and of a 64-row wgmma) gives each lane rows g and g + 8 of a 16-row slice and
keys 2 t and 2 t + 1 of each 8-key column block. So the forwards make one call per four scores and
use all of its words (``dropout_quad``). The counter of score (row, key) is

    (key // 2, (row // 16) * 8 + row % 8, (batch << 16) | head, 0), its word 2 * (row // 8 % 2) + key % 2.

The backwards' dK/dV tile holds the transposed block (keys g, g + 8 by queries 2 t, 2 t + 1):
there two lanes (keys k and k + 1) each make one of two calls and trade the keep bits of the
words the other needs with a shuffle (``Hooks.dropout_bits_t``); the portable kernels ask for one
score at a time (``dropout_word``).
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
def _row_group(row):
    """The counter's row word: rows r and r + 8 of each 16-row slice share one."""
    return uint32((row // 16) * 8 + row % 8)


@register_jitable
def dropout_quad(row, key, b, h, seed_lo, seed_hi):
    """The four words of the 2 x 2 block that holds score (row, key): those of rows r, r + 8 (r % 16
    < 8) by keys k, k + 1 (k even), in the order (r, k), (r, k + 1), (r + 8, k), (r + 8, k + 1)."""
    return philox(uint32(key // 2), _row_group(row), uint32((b << 16) | h), uint32(0), uint32(seed_lo),
                  uint32(seed_hi))


@register_jitable
def dropout_word(row, key, b, h, seed_lo, seed_hi):
    """The 32-bit random word of score (row, key) of batch b, query head h (both < 2^16)."""
    words = dropout_quad(row, key, b, h, seed_lo, seed_hi)
    lane = 2 * ((row // 8) % 2) + key % 2
    if lane == 0:
        return words[0]
    if lane == 1:
        return words[1]
    if lane == 2:
        return words[2]
    return words[3]


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
    words = philox_numpy(keys // 2, (rows // 16) * 8 + rows % 8, (b << 16) | h, 0, seed_lo, seed_hi)
    lane = np.broadcast_to(2 * ((rows // 8) % 2) + keys % 2, np.broadcast(rows, keys).shape)
    return np.choose(lane, words)
