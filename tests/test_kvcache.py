"""flash_attn_with_kvcache and merge_attention_states against float64.

Each sequence's output is held to flash-attn's rule (at most twice the error of a same-precision
naive implementation, against float64) on the keys the float64 reference says it attends
(nbflash.reference.attention_kvcache_reference, itself tested in test_reference_kvcache.py); the
caches after the in-place append are compared with the reference's, and guard regions around
them prove that nothing is written outside.

In the simulator: a few small cases through the decode kernel (float16/bfloat16: contiguous and
paged, splits, append with rotary, leftpad, cache_batch_idx, window/softcap/ALiBi) and through the
gathered route (float32). On a GPU: the grid.
"""

import numpy as np
import pytest

import nbflash
from nbflash import configs, kvcache
from nbflash.dtypes import SUPPORTED
from nbflash.reference import apply_rotary_reference, attention_kvcache_reference

from .conftest import SIMULATOR
from .helpers import ERROR_FLOOR, poison_allocations, to_numpy

GUARD = 3  # rows of guard region before and after each cache


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    poison_allocations(monkeypatch)


def draw(rng, xp, shape, dtype):
    return xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(SUPPORTED[dtype]))


def guarded(rng, xp, shape, dtype):
    """(whole, view): a random cache ``view`` of ``shape`` inside ``whole``, which has GUARD extra
    rows (of dim 0) before and after it."""
    whole = draw(rng, xp, (shape[0] + 2 * GUARD,) + tuple(shape[1:]), dtype)
    return whole, whole[GUARD:GUARD + shape[0]]


def rotary_tables(rng, xp, positions, rotary_dim, dtype):
    angles = rng.uniform(0, 2 * np.pi, (positions, rotary_dim // 2))
    return (xp.asarray(np.cos(angles).astype(SUPPORTED[dtype])), xp.asarray(np.sin(angles).astype(SUPPORTED[dtype])))


def make_case(rng, xp, dtype, batch, seqlen_q, nheads, nheads_k, headdim, lengths, capacity, seqlen_new=0,
              page_size=None, rotary_dim=0, leftpad=None, batch_idx=False):
    """Arguments of a flash_attn_with_kvcache call, and the guarded caches behind them."""
    args = {}
    q = draw(rng, xp, (batch, seqlen_q, nheads, headdim), dtype)
    if page_size is None:
        rows = batch + 2 if batch_idx else batch
        shape = (rows, capacity, nheads_k, headdim)
        if batch_idx:
            args["cache_batch_idx"] = xp.asarray(rng.permutation(rows)[:batch].astype(np.int32))
    else:
        per_seq = -(-capacity // page_size)
        blocks = batch * per_seq + 1
        shape = (blocks, page_size, nheads_k, headdim)
        args["block_table"] = xp.asarray(rng.permutation(blocks)[:batch * per_seq].reshape(batch, per_seq)
                                         .astype(np.int32))
    k_whole, k_cache = guarded(rng, xp, shape, dtype)
    v_whole, v_cache = guarded(rng, xp, shape, dtype)
    args["cache_seqlens"] = xp.asarray(np.asarray(lengths, np.int32))
    if seqlen_new:
        args["k"] = draw(rng, xp, (batch, seqlen_new, nheads_k, headdim), dtype)
        args["v"] = draw(rng, xp, (batch, seqlen_new, nheads_k, headdim), dtype)
    if rotary_dim:
        full = shape[1] if page_size is None else args["block_table"].shape[1] * page_size
        args["rotary_cos"], args["rotary_sin"] = rotary_tables(rng, xp, full, rotary_dim, dtype)
    if leftpad is not None:
        args["cache_leftpad"] = xp.asarray(np.asarray(leftpad, np.int32))
    return q, k_whole, k_cache, v_whole, v_cache, args


def effective(q, k_after, v_after, b, args, causal, window_size, seqlen_new):
    """Sequence b's rotated q and its keys and values, as flash_attn_func would take them."""
    seqlens = to_numpy(args["cache_seqlens"]).astype(np.int64)
    start = 0 if "cache_leftpad" not in args else int(to_numpy(args["cache_leftpad"])[b])
    positions = np.arange(start, seqlens[b] + seqlen_new)
    if "block_table" in args:
        table = to_numpy(args["block_table"])
        page = k_after.shape[1]
        where = (table[b, positions // page], positions % page)
    else:
        row = b if "cache_batch_idx" not in args else int(to_numpy(args["cache_batch_idx"])[b])
        where = (row, positions)
    k_b, v_b = to_numpy(k_after)[where][None], to_numpy(v_after)[where][None]
    q_b = to_numpy(q)[b:b + 1]
    if "rotary_cos" in args:
        per_token = causal or tuple(window_size) != (-1, -1)
        pos = seqlens[b] + (np.arange(q.shape[1]) if per_token else np.zeros(q.shape[1], np.int64))
        q_b = apply_rotary_reference(q_b, to_numpy(args["rotary_cos"]), to_numpy(args["rotary_sin"]), pos[None],
                                     args.get("rotary_interleaved", True)).astype(q_b.dtype)
    return q_b, k_b, v_b


def check_call(rng, xp, dtype, batch, seqlen_q, nheads, nheads_k, headdim, lengths, capacity, causal=False,
               window_size=(-1, -1), softcap=0.0, alibi=False, num_splits=0, rotary_interleaved=True, **layout):
    q, k_whole, k_cache, v_whole, v_cache, args = make_case(rng, xp, dtype, batch, seqlen_q, nheads, nheads_k,
                                                            headdim, lengths, capacity, **layout)
    if "rotary_cos" in args:
        args["rotary_interleaved"] = rotary_interleaved
    if alibi:
        args["alibi_slopes"] = xp.asarray(rng.uniform(0.1, 1.0, (batch, nheads)).astype(np.float32))
    k_before, v_before = to_numpy(k_whole).copy(), to_numpy(v_whole).copy()
    ref_out, ref_lse, k_after, v_after = attention_kvcache_reference(
        to_numpy(q), to_numpy(k_cache), to_numpy(v_cache),
        **{name: (to_numpy(x) if hasattr(x, "shape") else x) for name, x in args.items()},
        causal=causal, window_size=window_size, softcap=softcap)

    out, lse = nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, causal=causal, window_size=window_size,
                                               softcap=softcap, num_splits=num_splits, return_softmax_lse=True,
                                               **args)
    out, lse = to_numpy(out), to_numpy(lse)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (batch, nheads, seqlen_q)

    # The caches: the appended rows as the reference's (rotated keys within one rounding step), and
    # everything else, guard regions included, untouched.
    k_now, v_now = to_numpy(k_whole), to_numpy(v_whole)
    inside = slice(GUARD, GUARD + k_cache.shape[0])
    np.testing.assert_array_equal(v_now[inside], v_after)
    k_diff = np.abs(k_now[inside].astype(np.float64) - k_after.astype(np.float64))
    assert k_diff.max() <= 1e-2 * np.abs(k_after.astype(np.float64)).max(), "the appended keys differ"
    for guard in (slice(0, GUARD), slice(GUARD + k_cache.shape[0], None)):
        np.testing.assert_array_equal(k_now[guard], k_before[guard])
        np.testing.assert_array_equal(v_now[guard], v_before[guard])

    # The output, sequence by sequence, under the twice-the-naive-error rule.
    assert not np.isnan(out.astype(np.float32)).any() and not np.isnan(lse).any()
    slopes = to_numpy(args["alibi_slopes"]) if alibi else None
    for b in range(batch):
        q_b, k_b, v_b = effective(q, k_now[inside], v_now[inside], b, args, causal, window_size,
                                  layout.get("seqlen_new", 0))
        if k_b.shape[1] == 0:
            assert (out[b] == 0).all() and np.isneginf(lse[b]).all(), "no key: out 0, lse -inf"
            continue
        variant = dict(window_size=window_size, softcap=softcap, alibi_slopes=None if slopes is None else slopes[b])
        ref, rl = nbflash.attention_reference(q_b, k_b, v_b, None, causal, return_lse=True, **variant)
        naive = nbflash.attention_naive(q_b, k_b, v_b, None, causal, **variant)
        error = np.abs(out[b:b + 1].astype(np.float64) - ref).max()
        budget = 2 * np.abs(naive.astype(np.float64) - ref).max() + ERROR_FLOOR[dtype]
        assert error <= budget, f"sequence {b}: error {error:.3g} > budget {budget:.3g}"
        seen = np.isfinite(rl[0])
        assert np.array_equal(np.isneginf(lse[b]), ~seen)
        assert np.abs(lse[b][seen] - rl[0][seen]).max(initial=0) <= 1e-4 * max(1.0, np.abs(rl).max())
        # ... and the kv-cache reference agrees on what the sequence is.
        assert np.abs(ref[0] - ref_out[b]).max() <= 2e-2 * max(1.0, np.abs(ref_out[b]).max())
    return out, lse


# ---------------------------------------------------------------------------------------------------
# In the simulator: small
# ---------------------------------------------------------------------------------------------------

SIM = pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")


@SIM
@pytest.mark.parametrize("num_splits", [3])
def test_decode_contiguous_splits(rng, xp, num_splits):
    # GQA 4/2, one query token, lengths with a tail tile, one crossing tiles and an empty cache.
    check_call(rng, xp, "float16", 3, 1, 4, 2, 16, [130, 37, 0], 150, causal=True, num_splits=num_splits)


@pytest.fixture
def fresh_plans():
    """No decode configuration or plan kept from before the test, nor after it: a test may change
    the decode tables or kvcache's flags (with monkeypatch) and see its calls planned under them."""
    configs.decode_config.cache_clear()
    kvcache.forget_plans()
    yield
    configs.decode_config.cache_clear()
    kvcache.forget_plans()


@pytest.fixture
def narrow_decode(monkeypatch, fresh_plans):
    """Only the 4-warp decode blocks (configs.MMA_DECODE): the 8-warp ones of a call with fewer
    units of work than SMs (MMA_DECODE_WIDE) would change a test's tiles."""
    monkeypatch.setattr(configs, "MMA_DECODE_WIDE", [])


@SIM
def test_decode_ring_refills(rng, xp, narrow_decode):
    # One split over 6 key tiles: every warp refills its share of the ring's 4 slots.
    check_call(rng, xp, "float16", 1, 1, 2, 1, 16, [330], 340, causal=True, num_splits=1)
    assert kvcache._last_plan.config.num_warps == 4


@SIM
def test_decode_wide_blocks(rng, xp, fresh_plans):
    # One sequence and one KV head, fewer units than the simulator's 4 SMs: 8-warp blocks of 128
    # keys (configs.MMA_DECODE_WIDE). Pages of 5 (a warp's 16 keys span four pages), two splits of
    # five key tiles each against a 3-slot ring (every warp refills), an append with rotary.
    check_call(rng, xp, "float16", 1, 1, 4, 1, 16, [1180], 1290, causal=True, num_splits=2, seqlen_new=3,
               page_size=5, rotary_dim=8)
    config = kvcache._last_plan.config
    assert (config.num_warps, config.block_n, config.paged) == (8, 128, True)


@SIM
@pytest.mark.parametrize("page_size, nheads_k, leftpad", [(16, 1, None), (32, 4, None), (16, 1, [3])])
def test_decode_page_aligned_copies(rng, xp, monkeypatch, fresh_plans, page_size, nheads_k, leftpad):
    # Pages holding whole warp shares (16 keys): one lookup a lane and tile (kvcache.PAGE_ALIGNED_COPIES,
    # MmaDecodeConfig.page_aligned); with one KV head the 8-warp blocks, with four the 4-warp ones
    # (4 units, the simulator's 4 SMs); lengths ending inside a share, a new token appended with
    # rotary, two splits. With a leftpad a share may straddle pages: the copies look up every row.
    monkeypatch.setattr(kvcache, "PAGE_ALIGNED_COPIES", True)
    check_call(rng, xp, "float16", 1, 1, 4 * nheads_k, nheads_k, 16, [277], 320, causal=True, num_splits=2,
               seqlen_new=1, page_size=page_size, rotary_dim=8, **({"leftpad": leftpad} if leftpad else {}))
    config = kvcache._last_plan.config
    assert config.paged and config.page_aligned == (leftpad is None)
    assert config.num_warps == (8 if nheads_k == 1 else 4)


@SIM
def test_decode_six_warps(rng, xp, monkeypatch, fresh_plans):
    # Headdim 256's wide row has 6 warps (96 keys a stage): a warp count that is not a power of
    # two, here at headdim 16 (the row stands in for every headdim), two splits of 3 key tiles.
    monkeypatch.setattr(configs, "MMA_DECODE_WIDE", [(256, 96, 6, 2)])
    check_call(rng, xp, "bfloat16", 1, 1, 4, 1, 16, [500], 520, causal=True, num_splits=2)
    config = kvcache._last_plan.config
    assert (config.num_warps, config.block_n) == (6, 96)


@SIM
def test_decode_paged_append_rotary(rng, xp):
    # Pages of 3, two new tokens appended with NeoX rotary, leftpad, two query tokens, causal;
    # headdim 32: a lane copies rows 8 apart, so its next row carries over two pages at a time.
    check_call(rng, xp, "bfloat16", 2, 2, 2, 1, 32, [40, 5], 70, causal=True, seqlen_new=2, page_size=3,
               rotary_dim=8, rotary_interleaved=False, leftpad=[3, 0], num_splits=2)


@SIM
def test_decode_variants_batch_idx(rng, xp):
    # A window, softcap and per-sequence ALiBi, three query tokens of MHA, through cache_batch_idx;
    # headdim 40: rows of 6 chunks of 16 bytes (the copies use 8 threads per row).
    check_call(rng, xp, "float16", 2, 3, 2, 2, 40, [50, 20], 64, causal=True, window_size=(17, 0), softcap=5.0,
               alibi=True, batch_idx=True, seqlen_new=1, rotary_dim=16)


@pytest.fixture
def fused_append(request, monkeypatch):
    """The append inside the decode launch (kvcache.FUSED_APPEND; a test's indirect parameter may
    say False), with no plan kept from before."""
    fused = getattr(request, "param", True)
    monkeypatch.setattr(kvcache, "FUSED_APPEND", fused)
    monkeypatch.setattr(kvcache, "_last_plan", None)
    kvcache._REMEMBERED.clear()
    yield fused
    kvcache._REMEMBERED.clear()


def fused_plans():
    return [plan.fused_append for plan in kvcache._REMEMBERED.values()]


@SIM
def test_decode_fused_append_contiguous(rng, xp, fused_append):
    # Two new tokens appended inside the decode launch, GQA 4/2 through cache_batch_idx with
    # interleaved rotary, causal, three splits: sequence 0's new keys 63 and 64 lie in two key
    # tiles, so two splits' blocks each write one; an empty cache.
    check_call(rng, xp, "float16", 3, 2, 4, 2, 16, [63, 130, 0], 150, causal=True, seqlen_new=2, rotary_dim=8,
               batch_idx=True, num_splits=3)
    assert fused_plans() == [True]


@SIM
def test_decode_fused_append_paged(rng, xp, fused_append):
    # Pages of 3, three new tokens across pages with NeoX rotary, three query tokens, not causal;
    # a left window is not fused (a new key may be no query row's): the append kernel runs first.
    check_call(rng, xp, "bfloat16", 2, 3, 2, 1, 32, [40, 5], 70, seqlen_new=3, page_size=3, rotary_dim=8,
               rotary_interleaved=False, num_splits=2)
    assert fused_plans() == [True]
    check_call(rng, xp, "bfloat16", 2, 3, 2, 1, 32, [40, 5], 70, causal=True, window_size=(2, 0), seqlen_new=3,
               page_size=3, num_splits=2)
    assert sorted(fused_plans()) == [False, True]


@SIM
def test_gathered_float32(rng, xp):
    # float32 goes the gathered route: pages of 1, append, interleaved rotary, not causal.
    check_call(rng, xp, "float32", 2, 2, 2, 1, 8, [6, 0], 12, seqlen_new=3, page_size=1, rotary_dim=4)


@pytest.mark.parametrize("fused_append", [False, True], ids=["append-kernel", "fused"], indirect=True)
@pytest.mark.parametrize("page_size", [None, 4])
def test_device_lengths_overflow_write_nothing_outside(rng, xp, page_size, fused_append):
    """Lengths on the device are not read back: an append past the capacity (or a page index outside
    the cache) is dropped by the kernels, and the guard regions stay as they were; so with the append
    inside the decode launch."""
    q, k_whole, k_cache, v_whole, v_cache, args = make_case(rng, xp, "float16", 2, 1, 2, 1, 16, [15, 3], 16,
                                                            seqlen_new=3, page_size=page_size)
    if page_size is not None:
        args["block_table"][1, 0] = k_cache.shape[0] + 1  # a page past the cache (into the guard rows)
    k_before, v_before = to_numpy(k_whole).copy(), to_numpy(v_whole).copy()
    out = nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=1, **args)
    assert fused_plans() == [fused_append]
    assert not np.isnan(to_numpy(out).astype(np.float32)).any()
    k_now = to_numpy(k_whole)
    for guard in (slice(0, GUARD), slice(GUARD + k_cache.shape[0], None)):
        np.testing.assert_array_equal(k_now[guard], k_before[guard])
        np.testing.assert_array_equal(to_numpy(v_whole)[guard], v_before[guard])
    # Exactly these cache positions changed: 15 of sequence 0 (16 and 17 are past the capacity) and
    # 3, 4, 5 of sequence 1 (paged: 3 sits in the page outside the cache, so only 4 and 5).
    expected = {(0, 15): (0, 0)} | {(1, p): (1, p - 3) for p in (3, 4, 5) if page_size is None or p >= 4}
    inside = k_now[GUARD:GUARD + k_cache.shape[0]].copy()
    before = k_before[GUARD:GUARD + k_cache.shape[0]]
    table = None if page_size is None else to_numpy(args["block_table"])
    for (b, p), (bb, t) in expected.items():
        where = (b, p) if table is None else (table[b, p // page_size], p % page_size)
        np.testing.assert_array_equal(inside[where], to_numpy(args["k"])[bb, t])
        inside[where] = before[where]
    np.testing.assert_array_equal(inside, before)


def test_merge_attention_states(rng, xp):
    """Two disjoint key sets' (out, lse), from the float64 reference rounded as a kernel's would be,
    merge into the whole set's."""
    q = draw(rng, xp, (1, 3, 2, 16), "float16")
    k = draw(rng, xp, (1, 20, 2, 16), "float16")
    v = draw(rng, xp, (1, 20, 2, 16), "float16")

    def state(keys):
        out, lse = nbflash.attention_reference(q, k[:, keys], v[:, keys], return_lse=True)
        return xp.asarray(to_numpy(out).astype(np.float16)), xp.asarray(to_numpy(lse).astype(np.float32))

    (out_a, lse_a), (out_b, lse_b) = state(slice(0, 12)), state(slice(12, 20))
    lse_b[0, 1, 2] = -np.inf  # a row that saw nothing in b: weight 0
    out_b[0, 2, 1] = 0
    out, lse = nbflash.merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref, ref_lse = nbflash.attention_reference(q, k, v, return_lse=True)
    ref, ref_lse = to_numpy(ref), to_numpy(ref_lse)
    ref[0, 2, 1], ref_lse[0, 1, 2] = to_numpy(out_a)[0, 2, 1], to_numpy(lse_a)[0, 1, 2]
    assert np.abs(to_numpy(out).astype(np.float64) - ref).max() < 2e-3
    assert np.abs(to_numpy(lse) - ref_lse).max() < 1e-5
    both_empty = nbflash.merge_attention_states(out_a, xp.full_like(lse_a, -np.inf), out_b,
                                                xp.full_like(lse_b, -np.inf))
    assert (to_numpy(both_empty[0]) == 0).all() and np.isneginf(to_numpy(both_empty[1])).all()


# ---------------------------------------------------------------------------------------------------
# Bad input: each a TypeError/ValueError naming the argument (no kernel runs)
# ---------------------------------------------------------------------------------------------------


def bad_input_cases(xp):
    q = xp.zeros((2, 1, 4, 16), np.float16)
    cache = xp.zeros((2, 32, 2, 16), np.float16)
    pages = xp.zeros((8, 8, 2, 16), np.float16)
    table = xp.zeros((2, 4), np.int32)
    new = xp.zeros((2, 1, 2, 16), np.float16)
    cos = xp.zeros((32, 4), np.float16)
    lens = xp.zeros(2, np.int32)
    return [
        ((q, cache, cache), dict(cache_seqlens=xp.zeros(2, np.int64)), TypeError, "cache_seqlens.dtype"),
        ((q, cache, cache), dict(cache_seqlens=xp.zeros(3, np.int32)), ValueError, "cache_seqlens must have shape"),
        ((q, cache, cache), dict(cache_seqlens=33), ValueError, "cache_seqlens=33"),
        ((q, cache, cache), dict(k=new, v=new, cache_seqlens=32), ValueError, "overflows"),
        ((q, cache, cache), dict(k=new, v=new), ValueError, "pass cache_seqlens"),
        ((q, cache, cache), dict(k=new, cache_seqlens=lens), ValueError, "k and v"),
        ((q, cache, cache.astype(np.float32)), {}, TypeError, "v_cache.dtype"),
        ((q, cache, cache[:, :16]), {}, ValueError, "same shape"),
        ((q, cache[:, :, :, :8], cache[:, :, :, :8]), {}, ValueError, "headdim"),
        ((q[:, :, :3], cache, cache), {}, ValueError, "multiple of nheads_k"),
        ((q, pages, pages), dict(block_table=table.astype(np.int64)), TypeError, "block_table.dtype"),
        ((q, pages, pages), dict(block_table=table[:1]), ValueError, "block_table must have shape"),
        ((q, pages, pages), dict(block_table=table, cache_batch_idx=lens), ValueError, "cache_batch_idx"),
        ((q, cache[:1], cache[:1]), {}, ValueError, "cache_batch_idx"),
        ((q, cache, cache), dict(cache_leftpad=lens[:1]), ValueError, "cache_leftpad must have shape"),
        ((q, cache, cache), dict(k=new, v=new, cache_seqlens=lens, rotary_cos=cos), ValueError, "rotary_sin"),
        ((q, cache, cache), dict(rotary_cos=cos, rotary_sin=cos), ValueError, "pass k and v"),
        ((q, cache, cache), dict(k=new, v=new, cache_seqlens=lens, rotary_cos=cos[:16], rotary_sin=cos[:16]),
         ValueError, "rotary_cos has 16 positions"),
        ((q, cache, cache), dict(k=new, v=new, cache_seqlens=lens, rotary_cos=xp.zeros((32, 9), np.float16),
                                 rotary_sin=xp.zeros((32, 9), np.float16)), ValueError, "rotary_dim"),
        ((q, cache, cache), dict(num_splits=-1), ValueError, "num_splits"),
        # Three query tokens, causal, at cache_seqlens 31: token 2 is rotated at position 33 of 32.
        ((xp.zeros((2, 3, 4, 16), np.float16), cache, cache),
         dict(k=new, v=new, cache_seqlens=31, rotary_cos=cos, rotary_sin=cos, causal=True), ValueError,
         "position 33, past rotary_cos's 32 rows"),
        ((q, cache, cache), dict(return_softmax_lse="yes"), TypeError, "return_softmax_lse"),
        ((q, cache, cache), dict(window_size=(-2, 0)), ValueError, "window_size"),
        ((q, cache, cache), dict(softcap=-1.0), ValueError, "softcap"),
        ((q, cache, cache), dict(alibi_slopes=xp.zeros(3, np.float32)), ValueError, "alibi_slopes"),
        ((q, cache, cache), dict(out=xp.zeros((2, 1, 4, 8), np.float16)), ValueError, "out must have shape"),
    ]


@pytest.mark.parametrize("case", range(26))
def test_bad_input(xp, case):
    args, kwargs, error, message = bad_input_cases(xp)[case]
    with pytest.raises(error, match=message):
        nbflash.flash_attn_with_kvcache(*args, **kwargs)


def test_bad_input_cases_counted(xp):
    assert len(bad_input_cases(xp)) == 26


def test_merge_bad_input(xp):
    out = xp.zeros((1, 2, 2, 8), np.float16)
    lse = xp.zeros((1, 2, 2), np.float32)
    with pytest.raises(TypeError, match="lse_b.dtype"):
        nbflash.merge_attention_states(out, lse, out, lse.astype(np.float16))
    with pytest.raises(ValueError, match="lse_a must have shape"):
        nbflash.merge_attention_states(out, lse[:, :1], out, lse)
    with pytest.raises(TypeError, match="out_b.dtype"):
        nbflash.merge_attention_states(out, lse, out.astype(np.float32), lse)


# ---------------------------------------------------------------------------------------------------
# On a GPU: the grid
# ---------------------------------------------------------------------------------------------------

GPU = pytest.mark.gpu


@GPU
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("headdim", [64, 128, 256, 40, 59])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8), (16, 2)])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_gpu_decode_contiguous(rng, xp, dtype, headdim, heads, seqlen_q):
    lengths = [1000, 1, 0, 4093, 257]
    check_call(rng, xp, dtype, 5, seqlen_q, *heads, headdim, lengths, 4096, causal=True)


@GPU
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("rotary", ["interleaved", "neox", None])
@pytest.mark.parametrize("num_splits", [0, 1, 7])
def test_gpu_decode_paged_append(rng, xp, page_size, rotary, num_splits):
    check_call(rng, xp, "float16", 3, 2, 16, 4, 128, [900, 0, 2000], 2048, causal=True, seqlen_new=3,
               page_size=page_size, rotary_dim=0 if rotary is None else 64, rotary_interleaved=rotary != "neox",
               num_splits=num_splits, leftpad=[7, 0, 0])


@GPU
@pytest.mark.parametrize("page_size", [None, 1, 16, 256])
@pytest.mark.parametrize("rotary", ["interleaved", "neox", None])
@pytest.mark.parametrize("num_splits", [0, 7])
def test_gpu_decode_fused_append(rng, xp, page_size, rotary, num_splits, fused_append):
    check_call(rng, xp, "float16", 3, 2, 16, 4, 128, [900, 0, 2000], 2048, causal=True, seqlen_new=3,
               page_size=page_size, rotary_dim=0 if rotary is None else 64, rotary_interleaved=rotary != "neox",
               num_splits=num_splits)
    assert fused_plans() == [True]


@GPU
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", ["window", "softcap", "alibi", "all", "not-causal"])
def test_gpu_decode_variants(rng, xp, dtype, variant):
    options = {"window": dict(causal=True, window_size=(300, 0)), "softcap": dict(causal=True, softcap=30.0),
               "alibi": dict(causal=True, alibi=True),
               "all": dict(causal=True, window_size=(511, 0), softcap=20.0, alibi=True),
               "not-causal": dict(window_size=(100, 3))}[variant]
    check_call(rng, xp, dtype, 4, 3, 32, 8, 128, [3000, 17, 1, 1200], 3072, seqlen_new=1, batch_idx=True,
               rotary_dim=128, **options)


@GPU
def test_gpu_long_context_splits_agree(rng, xp):
    """Batch 1 at 128k: the split heuristic's answer and no split agree within the contract."""
    out_auto, _ = check_call(rng, xp, "float16", 1, 1, 32, 8, 128, [131072 - 5], 131072, causal=True)
    q, _, k_cache, _, v_cache, args = make_case(np.random.default_rng(1), xp, "float16", 1, 1, 32, 8, 128,
                                                [131000], 131072)
    one = to_numpy(nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=1, **args)).astype(np.float32)
    many = to_numpy(nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=0, **args)).astype(np.float32)
    assert np.abs(one - many).max() <= 2e-3
    # The splits are merged by whichever block finishes last, always in split order: bit-identical.
    for _ in range(3):
        again = to_numpy(nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=0, **args))
        assert np.array_equal(again.astype(np.float32), many)


@GPU
def test_gpu_out_and_graph_capture(rng, xp):
    """With out=, a decode step captured in a CUDA graph and replayed gives the call's result, and
    the replay appends in place like the call."""
    import cupy

    q, _, k_cache, _, v_cache, args = make_case(rng, xp, "float16", 2, 1, 32, 8, 128, [500, 3000], 4096,
                                                seqlen_new=1, page_size=16)
    lens = args["cache_seqlens"]
    out = cupy.empty_like(q)
    k0, v0 = k_cache.copy(), v_cache.copy()
    expected = nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, out=out, num_splits=4, **args).copy()
    k_expected = k_cache.copy()
    k_cache[...], v_cache[...] = k0, v0
    out[...] = np.nan
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, out=out, num_splits=4, **args)  # warm up
        k_cache[...], v_cache[...] = k0, v0
        stream.begin_capture()
        nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, out=out, num_splits=4, **args)
        graph = stream.end_capture()
        out[...] = np.nan
        k_cache[...], v_cache[...] = k0, v0
        graph.launch(stream)
    stream.synchronize()
    assert cupy.array_equal(out, expected)
    assert cupy.array_equal(k_cache, k_expected)
    assert lens.dtype == np.int32


def test_choose_splits_fills_whole_waves():
    # 8 blocks (batch 1, 8 KV heads) on 132 multiprocessors: 16 splits give 128 of them a block,
    # the first count within 95% of a full wave.
    assert kvcache.choose_splits(8, 2048, 132) == 16
    assert kvcache.choose_splits(512, 64, 132) == 1  # batch 64 x 8 heads: already four waves
    assert kvcache.choose_splits(128, 256, 132) == 1  # batch 16 x 8 heads: 128 of 132
    assert kvcache.choose_splits(8, 6, 132) == 3  # at most one split per MIN_TILES_PER_SPLIT tiles
    assert kvcache.choose_splits(40, 2048, 132) == 13  # 520 blocks in 4 waves of 132 (3 splits: 0.91)
    # One block: the most splits (128) fill 128 of 132; 122 is the first within 95% of that.
    assert kvcache.MAX_SPLITS == 128 and kvcache.choose_splits(1, 10**6, 132) == 122


@SIM
def test_remembered_calls(rng, xp):
    """A call that looks like an earlier one to validation skips it (the serving loop's case), and
    still sees this call's arrays and lengths: a decode loop with an int cache_seqlens, then an
    overflowing length, which must still raise."""
    from nbflash import kvcache

    q = draw(rng, xp, (1, 1, 2, 16), "float16")
    k_cache, v_cache = draw(rng, xp, (1, 40, 1, 16), "float16"), draw(rng, xp, (1, 40, 1, 16), "float16")
    kvcache._REMEMBERED.clear()
    for length in (20, 21):
        k_new, v_new = draw(rng, xp, (1, 1, 1, 16), "float16"), draw(rng, xp, (1, 1, 1, 16), "float16")
        q = draw(rng, xp, (1, 1, 2, 16), "float16")
        out = nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=length, causal=True,
                                              num_splits=1)
        assert len(kvcache._REMEMBERED) == 1
        np.testing.assert_array_equal(to_numpy(k_cache)[0, length], to_numpy(k_new)[0, 0])
        ref = nbflash.attention_reference(q, k_cache[:, :length + 1], v_cache[:, :length + 1], causal=True)
        assert np.abs(to_numpy(out).astype(np.float64) - to_numpy(ref)).max() < 2e-3
    with pytest.raises(ValueError, match="overflows"):
        nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=40, causal=True, num_splits=1)
