"""Packed variable-length sequences: flash_attn_varlen_func and its backward, on both kernel families.

Each packed sequence is checked as its own dense problem against float64 (tests/helpers.py's
twice-the-naive-error rule), so causal, windows and ALiBi are checked bottom-right aligned per
sequence and dropout keyed by the sequence's index. Outputs are poisoned (NaN) before each call:
every row of every sequence must be written.
"""

import dataclasses

import numpy as np
import pytest

import nbflash

from . import helpers
from .conftest import SIMULATOR
from .helpers import assert_attention_close, poison_allocations, to_numpy
from .test_backward import assert_gradients_close


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    poison_allocations(monkeypatch)


@pytest.fixture
def small_tiles():
    """Tiles of 8 (portable) and 16 (tensor-core) rows, so that tiny sequences span several tiles."""
    with helpers.small_tiles():
        yield


def offsets(lengths, xp):
    return xp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def packed(rng, xp, lengths, heads, headdim, dtype):
    x = rng.standard_normal((sum(lengths), heads, headdim), dtype=np.float32)
    return xp.asarray(x.astype(nbflash.dtypes.SUPPORTED[dtype]))


def sequences(cu_q, cu_k):
    cu_q, cu_k = to_numpy(cu_q), to_numpy(cu_k)
    for b in range(len(cu_q) - 1):
        yield b, slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])


def per_sequence(variant, b):
    """The dense variant arguments of sequence b (its ALiBi slopes, dropout's batch index)."""
    variant = dict(variant)
    slopes = variant.get("alibi_slopes")
    if slopes is not None:
        variant["alibi_slopes"] = slopes if slopes.ndim == 1 else slopes[b]
    if variant.get("dropout_p"):
        variant["batch_offset"] = b
    return variant


def assert_varlen_forward(out, lse, q, k, v, cu_q, cu_k, causal, **variant):
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == np.float32  # flash-attn's (nheads, total_q)
    out, lse = to_numpy(out), to_numpy(lse)
    for b, rows_q, rows_k in sequences(cu_q, cu_k):
        if rows_q.start == rows_q.stop:
            continue
        if rows_k.start == rows_k.stop:  # no key at all: out 0, lse -inf
            assert (out[rows_q] == 0).all() and np.isneginf(lse[:, rows_q]).all(), f"sequence {b}"
            continue
        assert_attention_close(out[None, rows_q], lse[None, :, rows_q], q[None, rows_q], k[None, rows_k],
                               v[None, rows_k], causal, **per_sequence(variant, b))


def assert_varlen_backward(grads, dout, q, k, v, cu_q, cu_k, causal, **variant):
    dq, dk, dv = (to_numpy(g) for g in grads)
    for g, x in zip((dq, dk, dv), (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    for b, rows_q, rows_k in sequences(cu_q, cu_k):
        if rows_q.start == rows_q.stop or rows_k.start == rows_k.stop:  # nothing seen: gradients 0
            assert (dq[rows_q] == 0).all() and (dk[rows_k] == 0).all() and (dv[rows_k] == 0).all(), f"sequence {b}"
            continue
        assert_gradients_close((dq[None, rows_q], dk[None, rows_k], dv[None, rows_k]), dout[None, rows_q],
                               q[None, rows_q], k[None, rows_k], v[None, rows_k], causal, **per_sequence(variant, b))


# Sequence lengths: an empty query sequence (1), an empty key sequence (3), a query sequence longer
# than a tile and than its keys (2: causal leaves its first rows without a key), GQA 2:1.
LENGTHS_Q = [9, 0, 20, 3]
LENGTHS_K = [12, 5, 7, 0]


def recorded_builds(monkeypatch):
    """The list every config compiled from now on (launch.compiled) is appended to: what a test
    asserts the plan took."""
    from nbflash import launch

    built, compiled = [], launch.compiled
    monkeypatch.setattr(launch, "compiled", lambda config, *args: built.append(config) or compiled(config, *args))
    return built


def reference_forward(xp, q, k, v, cu_q, cu_k, causal, **variant):
    """out (in q's dtype) and lse of packed sequences from the float64 reference, in the varlen
    layouts: what a backward test starts from where the forward kernel is not under test."""
    q, k, v = to_numpy(q), to_numpy(k), to_numpy(v)
    out = np.zeros(q.shape, q.dtype)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf, np.float32)
    for b, rows_q, rows_k in sequences(cu_q, cu_k):
        if rows_q.start == rows_q.stop or rows_k.start == rows_k.stop:
            continue
        ref, ref_lse = nbflash.attention_reference(q[None, rows_q], k[None, rows_k], v[None, rows_k], None, causal,
                                                   return_lse=True, **per_sequence(variant, b))
        out[rows_q], lse[:, rows_q] = to_numpy(ref)[0], to_numpy(ref_lse)[0]
    return xp.asarray(out), xp.asarray(lse)


def run(rng, xp, family, dtype, causal, deterministic, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K, headdim=16,
        forward="kernel", heads=(2, 1), **variant):
    """The forward and backward on ``family`` (the backward only with "sm90": its forward serves
    no packed sequences, the mma family's runs). ``forward="reference"``: the backward starts from
    the float64 reference's out and lse, and no forward kernel runs (in the simulator the mma
    forward at headdim 128 costs minutes). ``heads``: query heads, KV heads (GQA 2:1 by default)."""
    q = packed(rng, xp, lengths_q, heads[0], headdim, dtype)
    k, v = (packed(rng, xp, lengths_k, heads[1], headdim, dtype) for _ in range(2))
    cu_q, cu_k = offsets(lengths_q, xp), offsets(lengths_k, xp)
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    if forward == "reference":
        out, lse = reference_forward(xp, q, k, v, cu_q, cu_k, causal, **variant)
    else:
        with nbflash.kernel_family("mma" if family == "sm90" else family):
            out, lse = nbflash.flash_attn_varlen_func(q, k, v, *args, causal=causal, return_lse=True, **variant)
        assert_varlen_forward(out, lse, q, k, v, cu_q, cu_k, causal, **variant)
    dout = packed(rng, xp, lengths_q, heads[0], headdim, dtype)
    with nbflash.kernel_family(family):
        grads = nbflash.flash_attn_varlen_backward(dout, q, k, v, out, lse, *args, causal=causal,
                                                   deterministic=deterministic, **variant)
    assert_varlen_backward(grads, dout, q, k, v, cu_q, cu_k, causal, **variant)


def combined(xp, batch, dropout=True):
    """A window, softcap, ALiBi per (sequence, head) and dropout, all at once."""
    slopes = xp.asarray(np.linspace(0.1, 0.6, batch * 2, dtype=np.float32).reshape(batch, 2))
    variant = dict(window_size=(4, 2), softcap=3.0, alibi_slopes=slopes)
    return dict(variant, dropout_p=0.2, seed=1234) if dropout else variant


# ---- Simulator: tiny shapes, small tiles ---------------------------------------------------------


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
def test_varlen_portable_causal(rng, xp, small_tiles):
    run(rng, xp, "portable", "float32", True, False)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
def test_varlen_portable_variants_deterministic(rng, xp, small_tiles):
    run(rng, xp, "portable", "float32", False, True, [0, 10, 3], [2, 4, 9], **combined(xp, 3))


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
def test_varlen_follows_a_plan_without_atomics(rng, xp, separate_dq_plan, small_tiles):
    """deterministic=False where the plan holds no dQ atomics (tests/conftest.py's fixture):
    flash_attn_varlen_backward runs the dQ pass the plan holds (on small tiles: the launcher's
    choice, not the tiles, is checked here)."""
    run(rng, xp, "portable", "float32", True, False)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
def test_varlen_mma_causal(rng, xp, small_tiles):
    run(rng, xp, "mma", "float16", True, False)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
def test_varlen_mma_variants_deterministic(rng, xp, small_tiles):
    # (dropout on the tensor-core kernels: the GPU grid below; in the simulator it costs too much)
    run(rng, xp, "mma", "bfloat16", True, True, [0, 19, 5], [3, 6, 18], **combined(xp, 3, dropout=False))


def test_varlen_equals_dense_on_equal_lengths(rng, xp, small_tiles):
    """Equal lengths: the packed call is the dense call on the same data, bit for bit."""
    q = packed(rng, xp, [11, 11], 2, 16, "float32")
    k, v = (packed(rng, xp, [7, 7], 2, 16, "float32") for _ in range(2))
    cu_q, cu_k = offsets([11, 11], xp), offsets([7, 7], xp)
    with nbflash.kernel_family("portable"):
        out, lse, probs = nbflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 11, 7, causal=True,
                                                         return_attn_probs=True)
        dense, dense_lse = nbflash.flash_attn_func(q.reshape(2, 11, 2, 16), k.reshape(2, 7, 2, 16),
                                                   v.reshape(2, 7, 2, 16), causal=True, return_lse=True)
    assert np.array_equal(to_numpy(out), to_numpy(dense).reshape(out.shape))
    assert np.array_equal(to_numpy(lse), to_numpy(dense_lse).transpose(1, 0, 2).reshape(2, 22))
    dense_probs = nbflash.attention_probabilities(q.reshape(2, 11, 2, 16), k.reshape(2, 7, 2, 16),
                                                  v.reshape(2, 7, 2, 16), causal=True)
    assert probs.shape == (2, 2, 11, 7) and np.array_equal(to_numpy(probs), to_numpy(dense_probs))


def test_varlen_unchecked_offsets_stay_inside_the_arrays(rng, xp, small_tiles):
    """With the offsets unchecked (as on a GPU by default), offsets past the arrays are clamped to
    them, and rows outside every sequence are left as they were (NaN-poisoned here): nothing is
    read or written outside the arrays (the simulator raises on any such index)."""
    q = packed(rng, xp, [10], 1, 16, "float32")
    k, v = (packed(rng, xp, [6], 1, 16, "float32") for _ in range(2))
    cu_q = xp.asarray(np.array([0, 4, 99], np.int32))  # sequence 1 runs past q's 10 rows: rows 4..9
    cu_k = xp.asarray(np.array([0, 3, 3], np.int32))  # sequence 1 has no key
    with nbflash.kernel_family("portable"):
        out, lse = nbflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 6, return_lse=True, check_seqlens=False)
    out, lse = to_numpy(out), to_numpy(lse)
    ref, ref_lse = nbflash.attention_reference(q[None, :4], k[None, :3], v[None, :3], return_lse=True)
    assert np.allclose(out[:4], ref[0], atol=1e-5) and np.allclose(lse[:, :4], ref_lse[0], atol=1e-5)
    assert (out[4:] == 0).all() and np.isneginf(lse[:, 4:]).all()  # the clamped sequence: no key

    q2 = packed(rng, xp, [10], 1, 16, "float32")
    cu_q = xp.asarray(np.array([0, 6, 6], np.int32))  # rows 6..9 are in no sequence
    cu_k = xp.asarray(np.array([0, 6, 6], np.int32))
    with nbflash.kernel_family("portable"):
        out = to_numpy(nbflash.flash_attn_varlen_func(q2, k, v, cu_q, cu_k, 6, 6, check_seqlens=False))
    assert not np.isnan(out[:6]).any() and np.isnan(out[6:]).all()


def test_varlen_bad_input(xp):
    q = xp.asarray(np.ones((10, 2, 16), np.float16))
    k = v = xp.asarray(np.ones((6, 1, 16), np.float16))
    cu_q, cu_k = offsets([4, 6], xp), offsets([3, 3], xp)
    good = (q, k, v, cu_q, cu_k, 6, 3)
    checked = {"check_seqlens": True}

    def call(*args, **kwargs):
        return nbflash.flash_attn_varlen_func(*args, **kwargs)

    cases = [
        ((q[None], k, v, cu_q, cu_k, 6, 3), {}, ValueError, "q must have 3 dims"),
        ((q, k[None], v[None], cu_q, cu_k, 6, 3), {}, ValueError, "k must have 3 dims"),
        ((q, k, v[:, :, :8], cu_q, cu_k, 6, 3), {}, ValueError, "k and v must have the same shape"),
        ((q[:, :1], xp.asarray(np.ones((6, 2, 16), np.float16)), xp.asarray(np.ones((6, 2, 16), np.float16)),
          cu_q, cu_k, 6, 3), {}, ValueError, "nheads=1"),
        ((q, k, v, cu_q.astype(np.int64), cu_k, 6, 3), {}, TypeError, "cu_seqlens_q.dtype"),
        ((q, k, v, cu_q, cu_k[None], 6, 3), {}, ValueError, "cu_seqlens_k must have shape"),
        ((q, k, v, cu_q, offsets([3, 3, 0], xp), 6, 3), {}, ValueError, "cu_seqlens_q and cu_seqlens_k"),
        ((q, k, v, cu_q, cu_k, 6.0, 3), {}, TypeError, "max_seqlen_q must be an int"),
        ((q, k, v, cu_q, cu_k, 6, True), {}, TypeError, "max_seqlen_k must be an int"),
        # The offsets' values are read back only when asked (by default on a GPU: no host sync).
        ((q, k, v, cu_q, cu_k, 5, 3), checked, ValueError, "max_seqlen_q=5"),
        ((q, k, v, offsets([4, 5], xp), cu_k, 6, 3), checked, ValueError, "cu_seqlens_q[-1]=9"),
        ((q, k, v, xp.asarray(np.array([1, 4, 10], np.int32)), cu_k, 6, 3), checked, ValueError,
         "cu_seqlens_q[0]=1"),
        ((q, k, v, cu_q, xp.asarray(np.array([0, 4, 3], np.int32)), 6, 3), checked, ValueError,
         "cu_seqlens_k must be nondecreasing"),
        (good, {"block_table": xp.asarray(np.zeros((2, 1), np.int32))}, NotImplementedError, "block_table"),
        (good, {"check_seqlens": 1}, TypeError, "check_seqlens"),
        (good, {"alibi_slopes": xp.asarray(np.ones((3, 2), np.float32))}, ValueError, "alibi_slopes"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
            call(*args, **kwargs)
    lse = xp.asarray(np.zeros((2, 10), np.float32))
    with pytest.raises(ValueError, match=r"lse must have shape \(nheads, total_q\)"):
        nbflash.flash_attn_varlen_backward(q, q, k, v, q, lse.T, cu_q, cu_k, 6, 3)
    with pytest.raises(ValueError, match="dout must have q's shape"):
        nbflash.flash_attn_varlen_backward(q[:5], q, k, v, q, lse, cu_q, cu_k, 6, 3)
    with pytest.raises(ValueError, match="seed"):
        nbflash.flash_attn_varlen_backward(q, q, k, v, q, lse, cu_q, cu_k, 6, 3, 0.1)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
def test_varlen_sm90_backward_causal(rng, xp, monkeypatch):
    """The Hopper dK/dV kernel on packed sequences (its real tiles: 128 keys, 64 queries; the
    forward falls back to the mma family): sequence 2 spans two key tiles and two query tiles, so
    its tiles' TMA reads cross into sequence 3's rows and past the packed arrays' end; sequence 1
    has no query (its dK, dV are 0), sequence 3 no key (its dq rows 0), and the blocks of key tiles
    past a sequence's end exit. GQA 2:1 (the other simulator cases below run one head, for CI's time)."""
    from nbflash import backward
    from nbflash.kernels.backward_sm90 import Sm90BackwardConfig

    built = recorded_builds(monkeypatch)
    backward._kernels.cache_clear()
    try:
        run(rng, xp, "sm90", "float16", True, False, [9, 0, 70, 3], [12, 5, 130, 0])
    finally:
        backward._kernels.cache_clear()
    assert any(isinstance(c, Sm90BackwardConfig) and c.variant.varlen for c in built)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
def test_varlen_sm90_backward_deterministic(rng, xp, monkeypatch):
    """deterministic=True on packed sequences under "sm90": the Hopper dK/dV kernel without dQ, then
    the Hopper dQ kernel, each sequence's rows read by TMA from its first (sequence 2's second query
    tile and its key tiles read into sequence 3's rows), sequence 1 with no query (its blocks exit),
    sequence 3 with no key (its dq rows 0)."""
    from nbflash import backward
    from nbflash.kernels.backward_dq_sm90 import Sm90DqConfig

    built = recorded_builds(monkeypatch)
    backward._kernels.cache_clear()
    try:
        run(rng, xp, "sm90", "float16", True, True, [9, 0, 70, 3], [12, 5, 130, 0], forward="reference",
            heads=(1, 1))
    finally:
        backward._kernels.cache_clear()
    assert any(isinstance(c, Sm90DqConfig) and c.variant.varlen for c in built)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
def test_varlen_sm90_backward_columns(rng, xp):
    """The same kernel's headdim-128 form ("columns": each consumer adds half of dQ's columns over
    both consumers' keys, dQ's product first), not causal: sequence 0 spans two query tiles (both
    ring slots) and one key tile with a tail, sequence 1's key tile crosses into the packed arrays'
    end. (Two key tiles of a sequence: the causal case above; with 130 keys here this case took
    4.5 minutes of CI's 2 cores.)"""
    run(rng, xp, "sm90", "bfloat16", False, False, [70, 5], [100, 20], 128, forward="reference", heads=(1, 1))


@pytest.fixture(params=["tiles", "red"])
def varlen_dq_reduce(request, monkeypatch):
    """Packed sequences' dQ by the planned tile-major form (dq_reduce="tiles", configs.
    SM90_BACKWARD_VARLEN_DQ_TILES: each sequence's tiles from a whole tile of dq_accum, converted a
    block row per sequence), or by the consumers' atomics into a row-major dq_accum ("red"). The
    tests' sequences are shorter than the plan takes the tile-major form for (configs.
    packed_dq_tiles_fit), so "tiles" lifts that limit."""
    from nbflash import backward, configs

    monkeypatch.setattr(configs, "SM90_BACKWARD_VARLEN_DQ_TILES", request.param == "tiles")
    monkeypatch.setattr(configs, "SM90_VARLEN_DQ_TILES_MAX_PADDING", 1e9)
    backward._kernels.cache_clear()
    yield request.param
    backward._kernels.cache_clear()


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")
@pytest.mark.parametrize("quads", [False, True], ids=["pairs", "quads"])
def test_varlen_sm90_dq_tiles(rng, xp, monkeypatch, quads):
    """The Hopper dK/dV kernel's tile-major dQ on packed sequences (planned): headdim 40 by 32-column halves
    (the table patched to "columns", so that dQ's product comes first), causal; sequence 0 spans two
    query tiles (dq_accum's rows 0-127), sequence 1 has no query, sequence 2's 9 rows start at packed
    row 70 and at dq_accum's row 192 (70 + 2 x 64, down to a whole tile); its key tile crosses into
    the packed arrays' end. "quads": dK and dV by 16-byte stores (``store_quads``; for packed
    sequences an option, configs.SM90_BACKWARD_VARLEN_STORE_QUADS): each sequence's key rows bounded
    (5 and 20 keys: the rows past them are the next sequence's or past the arrays), the last set of
    four 8-column groups partly past headdim."""
    from nbflash import backward, configs
    from nbflash.kernels.backward_sm90 import Sm90ConvertDqConfig

    if quads:
        planned = configs.sm90_backward_config
        monkeypatch.setattr(configs, "sm90_backward_config",
                            lambda *args: dataclasses.replace(planned(*args), store_quads=True))
    monkeypatch.setattr(configs, "SM90_BACKWARD", [(128, 2, "columns")])
    monkeypatch.setattr(configs, "SM90_VARLEN_DQ_TILES_MAX_PADDING", 3.0)  # 3 x 64 rows of padding for 79
    configs.sm90_backward_table_config.cache_clear()
    backward._kernels.cache_clear()
    built = recorded_builds(monkeypatch)
    try:
        run(rng, xp, "sm90", "float16", True, False, [70, 0, 9], [100, 5, 20], 40, forward="reference",
            heads=(1, 1))
    finally:
        configs.sm90_backward_table_config.cache_clear()
        backward._kernels.cache_clear()
    assert any(getattr(c, "dq_reduce", "") == "tiles" and c.variant.varlen and c.store_quads == quads for c in built)
    assert Sm90ConvertDqConfig("float16", 40, 32, True) in built


def test_packed_dq_tiles_fit():
    """The tile-major dQ's padding (a 64-row tile a sequence at most) against the packed rows: taken
    up to an eighth of them (mean length 512: shorter ones ran faster with the atomics), else the
    atomics; with step 40's 128-row tiles from mean length 1024 (packed_dq_tile_rows: the largest)."""
    from nbflash.configs import packed_dq_tile_rows, packed_dq_tiles_fit

    assert packed_dq_tiles_fit(14, 16384) and packed_dq_tiles_fit(2, 1024) and packed_dq_tiles_fit(1, 512)
    assert not packed_dq_tiles_fit(2, 1023) and not packed_dq_tiles_fit(54, 16384) and not packed_dq_tiles_fit(1, 1)
    assert packed_dq_tiles_fit(16, 16384, 128) and not packed_dq_tiles_fit(17, 16384, 128)
    assert [packed_dq_tile_rows(b, 16384) for b in (1, 16, 17, 32, 33)] == [128, 128, 64, 64, 0]


def test_packed_sequences_plan_step_40(monkeypatch):
    """configs.SM90_BACKWARD_VARLEN_KEYS128 (an option): packed sequences at headdims 33-64, plain or
    windowed, take step 40's kernel (128 query rows a step, dQ tile-major by rows) where the padding
    of 128-row tiles fits; where only 64-row tiles fit, or none, the table's kernel as before; never
    with another feature. Its dQ conversion pads each sequence to the dK/dV kernel's tiles."""
    from nbflash import configs
    from nbflash.kernels.backward_sm90 import Sm90ConvertDqConfig
    from nbflash.problem import Static, Variant

    monkeypatch.setattr(configs, "SM90_BACKWARD_VARLEN_KEYS128", True)
    packed, window = Variant(varlen=True), Variant(varlen=True, window=True)
    planned = {}
    with monkeypatch.context() as gpu:
        gpu.setattr(configs.runtime, "SIMULATOR", False)  # the planner's choice on a GPU (no kernel runs)
        for variant in (packed, window):
            planned[variant] = configs.sm90_backward_config("float16", 64, variant)
            assert (planned[variant].block_m, planned[variant].dq_split) == (128, "rows"), planned[variant]
        assert configs.sm90_backward_config("float16", 32, packed).block_m == 64  # the rows split's headdims
        assert configs.sm90_backward_config("float16", 64, Variant(varlen=True, softcap=True)).block_m == 64
        gpu.setattr(configs, "SM90_BACKWARD_VARLEN_KEYS128", False)
        assert configs.sm90_backward_config("float16", 64, packed).block_m == 64
    # the call's plan, as on a GPU (sm90_backward_config's choice above)
    monkeypatch.setattr(configs, "sm90_backward_config", lambda dtype, headdim, variant: planned[variant])
    for variant in (packed, window):
        _, dkdv, convert = configs.plan_backward(Static("float16", 64, False, 0, variant), False, "sm90", True,
                                                 dq_tiles=128)
        assert dkdv == planned[variant] and convert == Sm90ConvertDqConfig("float16", 64, 64, True, tile_rows=128)
        for rows in (64, 0):  # the padding of 128-row tiles does not fit: the table's kernel
            _, dkdv, _ = configs.plan_backward(Static("float16", 64, False, 0, variant), False, "sm90", True,
                                               dq_tiles=rows)
            assert dkdv.block_m == 64 and dkdv == configs.planned_backward_sm90_config("float16", 64, variant)
    with pytest.raises(ValueError, match="tile_rows"):
        Sm90ConvertDqConfig("float16", 64, 64, False, tile_rows=128)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs test_varlen_sm90_keys128_gpu and _dq_warp_gpu")
@pytest.mark.parametrize("dq_warp", [False, True], ids=["stats-warp", "dq-warp"])
def test_varlen_sm90_keys128(rng, xp, monkeypatch, dq_warp):
    """Step 40's kernel on packed sequences (configs.SM90_BACKWARD_VARLEN_KEYS128), causal, hd 40:
    sequence 0's 130 query rows span two 128-row tiles (dq_accum's rows 0-255), sequence 1 has no
    query, sequence 2's 9 rows start at packed row 130 and at dq_accum's row 384 (130 + 2 x 128, down
    to a whole tile), where a conversion padding to 64-row units reads row 256 (this case fails
    then). Its first key tile crosses into sequence 1's keys. One head with the staged dQ_i added by
    the stats warp; with it added by the producer's warp 2 (configs.SM90_BACKWARD_VARLEN_DQ_WARP:
    ``dq_warp`` with ``stats_ahead``) GQA 2:1, warp 2 walking each key tile's steps over both query
    heads: a warp 2 that added sequence 2's tile at its packed row (130) or the dense one (0) fails."""
    from nbflash import backward, configs

    monkeypatch.setattr(configs, "SM90_BACKWARD_VARLEN_DQ_WARP", dq_warp)
    monkeypatch.setattr(configs, "sm90_backward_config",
                        lambda dtype, headdim, variant: configs.keys128_backward_config(dtype, headdim, variant))
    monkeypatch.setattr(configs, "SM90_VARLEN_DQ_TILES_MAX_PADDING", 1e9)
    backward._kernels.cache_clear()
    built = recorded_builds(monkeypatch)
    try:
        run(rng, xp, "sm90", "float16", True, False, [130, 0, 9], [70, 5, 20], 40, forward="reference",
            heads=(2, 1) if dq_warp else (1, 1))
    finally:
        backward._kernels.cache_clear()
    dkdv = [c for c in built if getattr(c, "block_m", 0) == 128 and c.variant.varlen]
    assert dkdv and all(c.dq_warp == c.stats_ahead == dq_warp for c in dkdv)
    assert any(getattr(c, "tile_rows", 0) == 128 for c in built)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("window", [None, "causal", (40, 8)], ids=["plain", "causal", "window"])
@pytest.mark.parametrize("headdim", [64, 128])
def test_varlen_sm90_dq_warp_gpu(rng, xp, monkeypatch, dtype, window, headdim):
    """The planned sm90 backward on packed sequences with ``dq_warp`` and ``stats_ahead``
    (configs.SM90_BACKWARD_VARLEN_DQ_WARP, an option): step 40's kernel at hd 64, the table's tile-major one at 128 (the padding's
    limit lifted so that the grid's short sequences take the tiles); sequences with no query, no
    key, one row, a tile and one, GQA 2:1; plain, causal and a two-sided window."""
    from nbflash import configs

    monkeypatch.setattr(configs, "SM90_BACKWARD_VARLEN_DQ_WARP", True)
    built = run_packed_grid(rng, xp, monkeypatch, dtype, window, headdim)
    assert any(getattr(c, "dq_warp", False) and c.variant.varlen and c.dq_tile_major for c in built)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, "causal"], ids=["plain", "causal"])
@pytest.mark.parametrize("headdim", [64, 128])
def test_varlen_sm90_convert_quads_gpu(rng, xp, monkeypatch, window, headdim):
    """The sm90 backward on packed sequences with the tile-major dQ conversion storing dq 16 bytes a
    lane (configs.SM90_CONVERT_DQ_QUADS, an option): each sequence's rows from its padded first
    row of dq_accum, none past its end (the next sequence's rows), bfloat16, GQA 2:1."""
    from nbflash import configs
    from nbflash.kernels.backward_sm90 import Sm90ConvertDqConfig

    monkeypatch.setattr(configs, "SM90_CONVERT_DQ_QUADS", True)
    built = run_packed_grid(rng, xp, monkeypatch, "bfloat16", window, headdim)
    assert any(isinstance(c, Sm90ConvertDqConfig) and c.store_quads and c.varlen for c in built)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, "causal", (40, 8)], ids=["plain", "causal", "window"])
@pytest.mark.parametrize("headdim", [72, 128])
def test_varlen_sm90_store_quads_gpu(rng, xp, monkeypatch, window, headdim):
    """The planned sm90 backward on packed sequences with dK and dV by 16-byte stores
    (configs.SM90_BACKWARD_VARLEN_STORE_QUADS, an option): each sequence's key rows bounded (no key,
    one, a tile and one), headdim 72's last set of four groups mostly past it, bfloat16, GQA 2:1."""
    from nbflash import configs

    monkeypatch.setattr(configs, "SM90_BACKWARD_VARLEN_STORE_QUADS", True)
    built = run_packed_grid(rng, xp, monkeypatch, "bfloat16", window, headdim)
    assert any(getattr(c, "store_quads", False) and c.variant.varlen for c in built)


def run_packed_grid(rng, xp, monkeypatch, dtype, window, headdim):
    """The sm90 backward on GPU_LENGTHS[0]'s packed sequences, GQA 2:1, with dQ's padding limit lifted
    (so that the short sequences take the tile-major forms too); plain, "causal" or a two-sided
    window (a tuple): the configs compiled."""
    from nbflash import backward, configs

    monkeypatch.setattr(configs, "SM90_VARLEN_DQ_TILES_MAX_PADDING", 1e9)
    backward._kernels.cache_clear()
    built = recorded_builds(monkeypatch)
    lengths_q, lengths_k = GPU_LENGTHS[0]
    variant = {} if window in (None, "causal") else dict(window_size=window)
    try:
        run(rng, xp, "sm90", dtype, window == "causal", False, lengths_q, lengths_k, headdim, **variant)
    finally:
        backward._kernels.cache_clear()
    return built


@pytest.mark.parametrize("lengths,tiles", [([1100, 1000], 128), ([600, 500], 64), ([1, 300, 0, 129, 64, 77], 0)])
def test_varlen_backward_plans_dq_tiles_by_length(xp, monkeypatch, lengths, tiles):
    """flash_attn_varlen_backward asks for the tile-major dQ only where the sequences are long
    enough for its padding, in the largest tiles whose padding fits (configs.packed_dq_tile_rows);
    stopped at the kernels' lookup."""
    from nbflash import backward

    asked = []

    def stop(static, deterministic, family, aligned, out_aligned=False, dq_tiles=True):
        asked.append(dq_tiles)
        raise RuntimeError("stop")

    monkeypatch.setattr(backward, "_kernels", stop)
    rng = np.random.default_rng(0)
    q, k, v, dout, out = (packed(rng, xp, lengths, 2, 64, "float16") for _ in range(5))
    lse = xp.zeros((2, sum(lengths)), np.float32)
    cu = offsets(lengths, xp)
    with pytest.raises(RuntimeError, match="stop"):
        nbflash.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, max(lengths), max(lengths))
    assert asked == [tiles]


# ---- GPU: real tile sizes ------------------------------------------------------------------------

GPU_LENGTHS = [([1, 300, 0, 129, 64, 77], [250, 1, 40, 129, 0, 200])]


@pytest.mark.gpu
@pytest.mark.parametrize("family,dtype", [("mma", "float16"), ("mma", "bfloat16"), ("portable", "float32"),
                                          ("sm90", "float16"), ("sm90", "bfloat16")])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_gpu(rng, xp, family, dtype, causal, deterministic):
    for lengths_q, lengths_k in GPU_LENGTHS:
        run(rng, xp, family, dtype, causal, deterministic, lengths_q, lengths_k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", [64, 96, 128, 136, 256])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_varlen_sm90_backward_gpu(rng, xp, deterministic, dtype, causal, headdim):
    """The sm90 dK/dV kernel's planned forms on packed sequences: "steps" at headdim 64, "columns"
    (both consumers' dS^T, half the columns each) at 96 and 128, and past 128 the wide kernel
    (backward_sm90_wide.py); deterministic, each without dQ, then the sm90 dQ kernel."""
    lengths_q, lengths_k = GPU_LENGTHS[0]
    run(rng, xp, "sm90", dtype, causal, deterministic, lengths_q, lengths_k, headdim)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", [96, 128])
def test_varlen_sm90_dq_reduce_gpu(rng, xp, varlen_dq_reduce, dtype, causal, headdim):
    """Both dQ forms on packed sequences (tile-major planned from mean length 512, the atomics below): the
    kernel by columns, dQ first, at 96 and 128; then with the window, softcap, ALiBi and dropout
    at 128."""
    lengths_q, lengths_k = GPU_LENGTHS[0]
    run(rng, xp, "sm90", dtype, causal, False, lengths_q, lengths_k, headdim)
    if headdim == 128 and causal:
        run(rng, xp, "sm90", dtype, True, False, lengths_q, lengths_k, headdim, **combined(xp, len(lengths_q)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("window", [None, "causal", (40, 8)], ids=["plain", "causal", "window"])
@pytest.mark.parametrize("headdim", [40, 64])
def test_varlen_sm90_keys128_gpu(rng, xp, monkeypatch, dtype, window, headdim):
    """Step 40's kernel on packed sequences (configs.SM90_BACKWARD_VARLEN_KEYS128 on, the padding's
    limit lifted so that the grid's short sequences take it too), as planned: sequences with no
    query, no key, one row, a tile and one, GQA 2:1; plain, causal and a two-sided window."""
    from nbflash import configs

    monkeypatch.setattr(configs, "SM90_BACKWARD_VARLEN_KEYS128", True)
    built = run_packed_grid(rng, xp, monkeypatch, dtype, window, headdim)
    assert any(getattr(c, "block_m", 0) == 128 and c.variant.varlen for c in built)


@pytest.mark.gpu
@pytest.mark.parametrize("family,dtype", [("mma", "bfloat16"), ("portable", "float32"), ("sm90", "bfloat16")])
def test_varlen_gpu_variants(rng, xp, family, dtype):
    lengths_q, lengths_k = GPU_LENGTHS[0]
    run(rng, xp, family, dtype, True, True, lengths_q, lengths_k, **combined(xp, len(lengths_q)))
    run(rng, xp, family, dtype, False, False, lengths_q, lengths_k, **combined(xp, len(lengths_q), dropout=False))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("headdim", [64, 128])
def test_varlen_sm90_staged_dropout_gpu(rng, xp, monkeypatch, dtype, headdim):
    """Dropout's keep bits made by the producer's warps 2 and 3 (dropout_bits="producer") on
    packed sequences, with the window, softcap and ALiBi: the bits of each sequence's own rows."""
    import dataclasses

    lengths_q, lengths_k = GPU_LENGTHS[0]
    with helpers.replanned(monkeypatch, lambda config: dataclasses.replace(config, dropout_bits="producer")):
        run(rng, xp, "sm90", dtype, True, False, lengths_q, lengths_k, headdim, **combined(xp, len(lengths_q)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_varlen_sm90_wide_variants_gpu(rng, xp, dtype):
    """The wide kernel (headdim 256) on packed sequences with the window, softcap, ALiBi and dropout."""
    lengths_q, lengths_k = GPU_LENGTHS[0]
    run(rng, xp, "sm90", dtype, True, False, lengths_q, lengths_k, 256, **combined(xp, len(lengths_q)))
