"""The float64 reference of flash_attn_with_kvcache, checked against independent computations.

Pure NumPy and tiny shapes: no kernel runs here. The oracles are written out from the definitions
(rotary as a complex multiplication, attention as a loop over every (query, key) pair with the mask
spelled out), and the layouts are checked against each other: paged against contiguous, a permuted
cache_batch_idx against a gathered cache, a left-padded cache against the unpadded one.
"""

import math

import numpy as np
import pytest

from nbflash.reference import apply_rotary_reference, attention_kvcache_reference

DTYPE = np.float16


def normal(rng, *shape, dtype=DTYPE):
    return rng.standard_normal(shape).astype(dtype)


def rotary_tables(rng, seqlen_ro, rotary_dim, dtype=DTYPE):
    """Random angles (not a frequency ladder), so that a wrong row or column of cos/sin shows."""
    angles = rng.uniform(0.0, 2.0 * np.pi, (seqlen_ro, rotary_dim // 2))
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def rotary_complex(x, cos, sin, positions, interleaved):
    """Rotary as complex multiplication: pair d is x1 + i x2, times e^(i theta[position, d])."""
    x = x.astype(np.float64)
    half = cos.shape[1]
    if interleaved:
        first, second = np.arange(0, 2 * half, 2), np.arange(1, 2 * half, 2)
    else:
        first, second = np.arange(half), np.arange(half, 2 * half)
    phase = cos.astype(np.float64)[positions] + 1j * sin.astype(np.float64)[positions]  # (batch, seqlen, half)
    z = (x[..., first] + 1j * x[..., second]) * phase[:, :, None, :]
    out = x.copy()
    out[..., first], out[..., second] = z.real, z.imag
    return out


def direct_attention(q, keys, values, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """One sequence by brute force: q (seqlen_q, nheads, d), keys and values (seqlen_k, nheads_k, d).
    Every (i, j) pair is visited and the bottom-right aligned mask is written out from its definition.
    Returns out (seqlen_q, nheads, d) and lse (nheads, seqlen_q), float64."""
    q, keys, values = (x.astype(np.float64) for x in (q, keys, values))
    seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = keys.shape[:2]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    left, right = window
    if causal:
        right = 0
    out = np.zeros(q.shape)
    lse = np.full((nheads, seqlen_q), -np.inf)
    for h in range(nheads):
        kv = h // (nheads // nheads_k)
        for i in range(seqlen_q):
            diagonal = i + seqlen_k - seqlen_q
            seen, scores = [], []
            for j in range(seqlen_k):
                if (left >= 0 and j < diagonal - left) or (right >= 0 and j > diagonal + right):
                    continue
                score = scale * float(q[i, h] @ keys[j, kv])
                if softcap > 0:
                    score = softcap * math.tanh(score / softcap)
                if slopes is not None:
                    score -= float(slopes[h]) * abs(diagonal - j)
                seen.append(j)
                scores.append(score)
            if seen:
                scores = np.array(scores)
                weights = np.exp(scores - scores.max())
                out[i, h] = weights @ values[seen, kv] / weights.sum()
                lse[h, i] = scores.max() + math.log(weights.sum())
    return out, lse


def poisoned_cache(rng, batch, capacity, nheads_k, headdim, seqlens):
    """A cache holding random tokens in positions [0, seqlens[b]) and NaN after them, so that a
    reference reading past a sequence's end returns NaN."""
    cache = normal(rng, batch, capacity, nheads_k, headdim)
    for b, n in enumerate(seqlens):
        cache[b, n:] = np.nan
    return cache


def to_paged(cache, page, rng, spare_blocks=2):
    """The same logical contents as a paged cache: (blocks, block_table), each sequence's blocks at
    random places among ``batch * max_blocks + spare_blocks`` blocks (the spare ones NaN)."""
    batch, capacity = cache.shape[:2]
    assert capacity % page == 0
    max_blocks = capacity // page
    num_blocks = batch * max_blocks + spare_blocks
    table = rng.permutation(num_blocks)[: batch * max_blocks].reshape(batch, max_blocks).astype(np.int32)
    blocks = np.full((num_blocks, page) + cache.shape[2:], np.nan, cache.dtype)
    for b in range(batch):
        for i in range(max_blocks):
            blocks[table[b, i]] = cache[b, i * page:(i + 1) * page]
    return blocks, table


def from_paged(blocks, table):
    """The contiguous (batch, capacity, ...) view of a paged cache's logical contents."""
    return np.stack([np.concatenate([blocks[i] for i in row]) for row in table])


def assert_equal(a, b, what):
    assert a.shape == b.shape, f"{what}: shapes {a.shape} and {b.shape}"
    assert np.array_equal(a, b, equal_nan=True), f"{what} differ (max |diff| {np.nanmax(np.abs(a - b)):.3g})"


# ---------------------------------------------------------------- rotary


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_is_a_complex_multiplication(rng, interleaved):
    x = normal(rng, 2, 3, 2, 10)  # headdim 10, rotary_dim 6: four dims pass through
    cos, sin = rotary_tables(rng, 7, 6, np.float64)
    positions = rng.integers(0, 7, (2, 3))
    rotated = apply_rotary_reference(x, cos, sin, positions, interleaved)
    assert rotated.dtype == np.float64 and rotated.shape == x.shape
    np.testing.assert_allclose(rotated, rotary_complex(x, cos, sin, positions, interleaved), rtol=0, atol=1e-12)
    assert np.array_equal(rotated[..., 6:], x[..., 6:].astype(np.float64)), "dims past rotary_dim pass through"


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_pairs(interleaved):
    """Which dims form a pair, by hand: a 90-degree turn maps (x1, x2) to (-x2, x1)."""
    x = np.arange(1.0, 9.0).reshape(1, 1, 1, 8)  # headdim 8, rotary_dim 4
    cos, sin = np.zeros((1, 2)), np.ones((1, 2))
    rotated = apply_rotary_reference(x, cos, sin, np.zeros((1, 1), int), interleaved)[0, 0, 0]
    expected = [-2, 1, -4, 3, 5, 6, 7, 8] if interleaved else [-3, -4, 1, 2, 5, 6, 7, 8]
    assert rotated.tolist() == expected


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_scores_depend_on_relative_position(rng, interleaved):
    """With RoPE's tables (angle = position * frequency), <R_m q, R_n k> depends on m - n only."""
    frequencies = 10000.0 ** (-np.arange(4) / 4)
    angles = np.arange(32)[:, None] * frequencies[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    q, k = normal(rng, 1, 1, 1, 8), normal(rng, 1, 1, 1, 8)

    def score(m, n):
        rq = apply_rotary_reference(q, cos, sin, np.array([[m]]), interleaved)
        rk = apply_rotary_reference(k, cos, sin, np.array([[n]]), interleaved)
        return float(rq.ravel() @ rk.ravel())

    assert score(9, 4) == pytest.approx(score(25, 20), abs=1e-12)
    assert score(9, 4) != pytest.approx(score(9, 5), abs=1e-6)


# ---------------------------------------------------------------- attention by hand


def test_hand_checkable_case():
    """One sequence, one head, three keys, scale 1: scores 1, 0, -1 against q = (1, 0)."""
    q = np.array([1.0, 0.0], np.float32).reshape(1, 1, 1, 2)
    cache_k = np.full((1, 5, 1, 2), np.nan, np.float32)  # positions 3 and 4 must not be read
    cache_v = np.full((1, 5, 1, 2), np.nan, np.float32)
    cache_k[0, :3, 0] = [[1, 0], [0, 1], [-1, 0]]
    cache_v[0, :3, 0] = [[1, 2], [3, 4], [5, 6]]
    weights = np.exp([1.0, 0.0, -1.0]) / np.exp([1.0, 0.0, -1.0]).sum()
    expected = weights @ np.array([[1, 2], [3, 4], [5, 6]])
    out, lse, _, _ = attention_kvcache_reference(q, cache_k, cache_v, cache_seqlens=3, softmax_scale=1.0)
    np.testing.assert_allclose(out[0, 0, 0], expected, rtol=1e-14)
    assert lse[0, 0, 0] == pytest.approx(math.log(math.e + 1 + 1 / math.e), rel=1e-14)
    # The third key appended in the call instead of cached: the same answer.
    k_new, v_new = cache_k[:, 2:3].copy(), cache_v[:, 2:3].copy()
    cache_k[0, 2:] = cache_v[0, 2:] = np.nan
    out2, lse2, k_after, _ = attention_kvcache_reference(q, cache_k, cache_v, k_new, v_new, cache_seqlens=2,
                                                         softmax_scale=1.0)
    np.testing.assert_allclose(out2, out, rtol=1e-14)
    np.testing.assert_allclose(lse2, lse, rtol=1e-14)
    assert k_after[0, 2, 0].tolist() == [-1, 0]


# ---------------------------------------------------------------- against direct attention

VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (3, 1)},
    "causal-window": {"causal": True, "window_size": (2, 0)},
    "softcap": {"softcap": 0.7},
    "alibi-per-sequence": {"causal": True, "alibi_slopes": np.array([[0.5, 0.25, 0.125, 0.0625],
                                                                     [1.0, 0.3, 0.2, 0.1],
                                                                     [0.05, 0.6, 0.7, 0.8]], np.float32)},
    "alibi-shared": {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625], np.float32)},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_against_direct_attention(rng, name):
    """GQA (4 query heads on 2 kv heads), seqlen_q 4, three sequences of different lengths with two
    new tokens each: 0 + 2 keys (under causal, the first two queries see none), 6 + 2 and 9 + 2;
    windows, softcap and ALiBi aligned on each sequence's own length."""
    variant = VARIANTS[name]
    seqlens, seqlen_new, seqlen_q = np.array([0, 6, 9], np.int32), 2, 4
    q = normal(rng, 3, seqlen_q, 4, 8)
    k_cache, v_cache = (poisoned_cache(rng, 3, 12, 2, 8, seqlens) for _ in range(2))
    k, v = normal(rng, 3, seqlen_new, 2, 8), normal(rng, 3, seqlen_new, 2, 8)
    out, lse, _, _ = attention_kvcache_reference(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, **variant)
    slopes = variant.get("alibi_slopes")
    for b, n in enumerate(seqlens):
        keys = np.concatenate([k_cache[b, :n], k[b]])
        values = np.concatenate([v_cache[b, :n], v[b]])
        row = None if slopes is None else (slopes[b] if slopes.ndim == 2 else slopes)
        ref_out, ref_lse = direct_attention(q[b], keys, values, None, variant.get("causal", False),
                                            variant.get("window_size", (-1, -1)), variant.get("softcap", 0.0), row)
        np.testing.assert_allclose(out[b], ref_out, rtol=1e-12, atol=1e-12, err_msg=f"sequence {b}")
        assert np.array_equal(np.isneginf(lse[b]), np.isneginf(ref_lse))
        np.testing.assert_allclose(lse[b], ref_lse, rtol=1e-12, err_msg=f"sequence {b}")
    if variant.get("causal"):
        assert np.isneginf(lse[0, :, :2]).all() and (out[0, :2] == 0).all(), "queries before the keys see none"


def test_gqa_equals_repeated_heads(rng):
    q = normal(rng, 2, 3, 6, 8)
    k_cache, v_cache = normal(rng, 2, 7, 2, 8), normal(rng, 2, 7, 2, 8)
    seqlens = np.array([4, 7], np.int32)
    grouped = attention_kvcache_reference(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    repeated = attention_kvcache_reference(q, np.repeat(k_cache, 3, axis=2), np.repeat(v_cache, 3, axis=2),
                                           cache_seqlens=seqlens, causal=True)
    assert_equal(grouped[0], repeated[0], "out")
    assert_equal(grouped[1], repeated[1], "lse")


def test_empty_sequence(rng):
    """cache_seqlens 0 and no new keys (or a leftpad that covers the whole cache): out 0, lse -inf;
    the other sequences are unaffected."""
    q = normal(rng, 3, 2, 2, 8)
    k_cache, v_cache = (poisoned_cache(rng, 3, 6, 2, 8, [0, 4, 3]) for _ in range(2))
    out, lse, k_after, _ = attention_kvcache_reference(q, k_cache, v_cache, cache_seqlens=np.array([0, 4, 3], np.int32),
                                                       cache_leftpad=np.array([0, 0, 3], np.int32))
    assert (out[[0, 2]] == 0).all() and np.isneginf(lse[[0, 2]]).all()
    ref_out, ref_lse = direct_attention(q[1], k_cache[1, :4], v_cache[1, :4])
    np.testing.assert_allclose(out[1], ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse[1], ref_lse, rtol=1e-12)
    assert_equal(k_after, k_cache, "the cache (nothing appended)")


def test_cache_seqlens_none_int_and_array(rng):
    """None: every cache full; an int: the same length for every sequence."""
    q = normal(rng, 2, 1, 2, 8)
    k_cache, v_cache = normal(rng, 2, 5, 2, 8), normal(rng, 2, 5, 2, 8)
    full = attention_kvcache_reference(q, k_cache, v_cache)
    as_array = attention_kvcache_reference(q, k_cache, v_cache, cache_seqlens=np.array([5, 5], np.int32))
    assert_equal(full[0], as_array[0], "out")
    three = attention_kvcache_reference(q, k_cache, v_cache, cache_seqlens=3)
    ref_out, _ = direct_attention(q[1], k_cache[1, :3], v_cache[1, :3])
    np.testing.assert_allclose(three[0][1], ref_out, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- rotary inside the call


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary_positions(rng, causal, interleaved):
    """New key t of sequence b rotates at cache_seqlens[b] + t; query i at cache_seqlens[b] + i when
    causal, else every query at cache_seqlens[b]. Both rounded to q's dtype; old keys untouched."""
    seqlens, seqlen_new, seqlen_q = np.array([3, 0], np.int32), 3, 2
    q = normal(rng, 2, seqlen_q, 2, 8)
    k_cache, v_cache = (poisoned_cache(rng, 2, 8, 1, 8, seqlens) for _ in range(2))
    k, v = normal(rng, 2, seqlen_new, 1, 8), normal(rng, 2, seqlen_new, 1, 8)
    cos, sin = rotary_tables(rng, 8, 4)  # rotary_dim 4 of headdim 8
    out, lse, k_after, v_after = attention_kvcache_reference(
        q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=seqlens, causal=causal, rotary_interleaved=interleaved)
    key_positions = seqlens[:, None] + np.arange(seqlen_new)
    query_positions = seqlens[:, None] + (np.arange(seqlen_q) if causal else np.zeros(seqlen_q, int))
    k_rotated = rotary_complex(k, cos, sin, key_positions, interleaved).astype(DTYPE)
    q_rotated = rotary_complex(q, cos, sin, query_positions, interleaved).astype(DTYPE)
    for b, n in enumerate(seqlens):
        assert_equal(k_after[b, n:n + seqlen_new], k_rotated[b], f"sequence {b}'s appended keys")
        assert_equal(v_after[b, n:n + seqlen_new], v[b], f"sequence {b}'s appended values (not rotated)")
        keys = np.concatenate([k_cache[b, :n], k_rotated[b]])
        values = np.concatenate([v_cache[b, :n], v[b]])
        ref_out, ref_lse = direct_attention(q_rotated[b], keys, values, causal=causal)
        np.testing.assert_allclose(out[b], ref_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[b], ref_lse, rtol=1e-12)


# ---------------------------------------------------------------- layouts against each other


def kvcache_case(rng, batch=3, capacity=48, seqlens=(5, 0, 30), seqlen_new=2, seqlen_q=2):
    """q, the caches (NaN past each sequence's tokens), new k and v, rotary tables and lengths."""
    seqlens = np.array(seqlens, np.int32)
    return dict(
        q=normal(rng, batch, seqlen_q, 4, 8),
        k_cache=poisoned_cache(rng, batch, capacity, 2, 8, seqlens),
        v_cache=poisoned_cache(rng, batch, capacity, 2, 8, seqlens),
        k=normal(rng, batch, seqlen_new, 2, 8),
        v=normal(rng, batch, seqlen_new, 2, 8),
        rotary=rotary_tables(rng, capacity, 6),
        seqlens=seqlens,
    )


@pytest.mark.parametrize("page", [1, 3, 16])
def test_paged_equals_contiguous(rng, page):
    case = kvcache_case(rng)
    cos, sin = case["rotary"]
    common = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=case["seqlens"], causal=True,
                  alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32))
    out, lse, k_after, v_after = attention_kvcache_reference(case["q"], case["k_cache"], case["v_cache"], case["k"],
                                                             case["v"], **common)
    k_blocks, table = to_paged(case["k_cache"], page, rng)
    v_blocks = np.full_like(k_blocks, np.nan)
    for b in range(table.shape[0]):
        for i, block in enumerate(table[b]):
            v_blocks[block] = case["v_cache"][b, i * page:(i + 1) * page]
    paged = attention_kvcache_reference(case["q"], k_blocks, v_blocks, case["k"], case["v"], block_table=table,
                                        **common)
    assert_equal(paged[0], out, "out")
    assert_equal(paged[1], lse, "lse")
    assert_equal(from_paged(paged[2], table), k_after, "k_cache after the append")
    assert_equal(from_paged(paged[3], table), v_after, "v_cache after the append")
    spare = np.setdiff1d(np.arange(k_blocks.shape[0]), table)
    assert np.isnan(paged[2][spare]).all() and np.isnan(paged[3][spare]).all(), "blocks outside the table untouched"


def test_cache_batch_idx_gathers_rows(rng):
    """Sequence b on cache row cache_batch_idx[b] of a larger cache equals a cache holding those rows in order;
    the append lands in those rows and the unused rows stay as they were."""
    case = kvcache_case(rng, batch=5, capacity=12, seqlens=(1, 4, 0, 7, 2))
    index = np.array([3, 0, 4], np.int32)  # three sequences over five cache rows
    cos, sin = case["rotary"]
    q, k, v = case["q"][:3], case["k"][:3], case["v"][:3]
    common = dict(rotary_cos=cos, rotary_sin=sin, causal=True)
    gathered = attention_kvcache_reference(q, case["k_cache"][index], case["v_cache"][index], k, v,
                                           cache_seqlens=case["seqlens"][index], **common)
    indexed = attention_kvcache_reference(q, case["k_cache"], case["v_cache"], k, v, cache_batch_idx=index,
                                          cache_seqlens=case["seqlens"][index], **common)
    assert_equal(indexed[0], gathered[0], "out")
    assert_equal(indexed[1], gathered[1], "lse")
    assert_equal(indexed[2][index], gathered[2], "k_cache rows after the append")
    assert_equal(indexed[3][index], gathered[3], "v_cache rows after the append")
    unused = [1, 2]
    assert_equal(indexed[2][unused], case["k_cache"][unused], "unused k_cache rows")
    assert_equal(indexed[3][unused], case["v_cache"][unused], "unused v_cache rows")


def left_padded(cache, pads):
    """The cache with sequence b's tokens moved right by pads[b], NaN in front of them."""
    out = np.full_like(cache, np.nan)
    for b, pad in enumerate(pads):
        out[b, pad:] = cache[b, :cache.shape[1] - pad]
    return out


def test_leftpad_equals_unpadded(rng):
    """A cache left-padded by cache_leftpad[b] (cache_seqlens counting the padding) attends exactly as the
    unpadded cache: masks and ALiBi distances are on the keys after the padding."""
    case = kvcache_case(rng, capacity=16, seqlens=(3, 0, 6))
    pads = np.array([2, 5, 0], np.int32)
    common = dict(causal=True, window_size=(4, 0), alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32))
    plain = attention_kvcache_reference(case["q"], case["k_cache"], case["v_cache"], case["k"], case["v"],
                                        cache_seqlens=case["seqlens"], **common)
    padded = attention_kvcache_reference(case["q"], left_padded(case["k_cache"], pads),
                                         left_padded(case["v_cache"], pads), case["k"], case["v"],
                                         cache_seqlens=case["seqlens"] + pads, cache_leftpad=pads, **common)
    assert_equal(padded[0], plain[0], "out")
    assert_equal(padded[1], plain[1], "lse")
    assert_equal(padded[2], left_padded(plain[2], pads), "k_cache after the append")


def test_leftpad_keeps_rotary_positions_absolute(rng):
    """Rotary positions are cache positions, padding included: padding every sequence by L equals the
    unpadded cache with the rotary tables shifted by L."""
    case = kvcache_case(rng, capacity=16, seqlens=(3, 0, 6))
    cos, sin = case["rotary"]
    pad = 4
    pads = np.full(3, pad, np.int32)
    plain = attention_kvcache_reference(case["q"], case["k_cache"], case["v_cache"], case["k"], case["v"],
                                        cos[pad:], sin[pad:], cache_seqlens=case["seqlens"], causal=True)
    padded = attention_kvcache_reference(case["q"], left_padded(case["k_cache"], pads),
                                         left_padded(case["v_cache"], pads), case["k"], case["v"], cos, sin,
                                         cache_seqlens=case["seqlens"] + pads, cache_leftpad=pads, causal=True)
    assert_equal(padded[0], plain[0], "out")
    assert_equal(padded[2], left_padded(plain[2], pads), "k_cache after the append")
    unshifted = attention_kvcache_reference(case["q"], case["k_cache"], case["v_cache"], case["k"], case["v"],
                                            cos, sin, cache_seqlens=case["seqlens"], causal=True)
    assert not np.allclose(unshifted[0], padded[0]), "the padding must move the rotary positions"


@pytest.mark.parametrize("paged", [False, True])
def test_append_writes_only_the_new_rows(rng, paged):
    """The new rotated keys and the new values at cache_seqlens[b] ... + seqlen_new - 1, every other
    element of the caches as it was, and the input caches not modified."""
    case = kvcache_case(rng, capacity=12, seqlens=(0, 5, 9), seqlen_new=3)
    cos, sin = case["rotary"]
    k_cache, v_cache, table = case["k_cache"], case["v_cache"], None
    if paged:
        k_cache, table = to_paged(case["k_cache"], 4, rng)
        v_cache = np.full_like(k_cache, np.nan)
        for b in range(3):
            for i, block in enumerate(table[b]):
                v_cache[block] = case["v_cache"][b, i * 4:(i + 1) * 4]
    before = k_cache.copy(), v_cache.copy()
    _, _, k_after, v_after = attention_kvcache_reference(case["q"], k_cache, v_cache, case["k"], case["v"], cos, sin,
                                                         cache_seqlens=case["seqlens"], block_table=table,
                                                         rotary_interleaved=False)
    assert_equal(k_cache, before[0], "the input k_cache")
    assert_equal(v_cache, before[1], "the input v_cache")
    assert k_after.dtype == k_cache.dtype and v_after.dtype == v_cache.dtype
    positions = case["seqlens"][:, None] + np.arange(3)
    expected_k = case["k_cache"].copy()
    expected_v = case["v_cache"].copy()
    rotated = rotary_complex(case["k"], cos, sin, positions, False).astype(DTYPE)
    for b, n in enumerate(case["seqlens"]):
        expected_k[b, n:n + 3], expected_v[b, n:n + 3] = rotated[b], case["v"][b]
    got_k, got_v = (from_paged(x, table) for x in (k_after, v_after)) if paged else (k_after, v_after)
    assert_equal(got_k, expected_k, "k_cache after the append")
    assert_equal(got_v, expected_v, "v_cache after the append")
