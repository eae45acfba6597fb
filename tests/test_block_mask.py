"""Block masks (nbflash.create_block_mask): the classification against brute force, attention through
them against the float64 reference of their mask_mod on both kernel families, proof that empty tiles
are skipped and full ones not tested, and the errors."""

import numpy as np
import pytest
from numba import cuda

import nbflash
from nbflash.backward import flash_attn_backward
from nbflash.block_mask import EMPTY, FULL, PARTIAL

from .conftest import SIMULATOR
from .helpers import assert_attention_close, poison_allocations, random_qkv, to_numpy
from .test_backward import assert_gradients_close, random_like, reference_forward

DOC = np.repeat(np.arange(8), 24).astype(np.int32)  # documents of 24 tokens: a captured constant


def causal_documents(b, h, q_idx, kv_idx):
    return DOC[q_idx] == DOC[kv_idx] and kv_idx <= q_idx


def documents_with_empty_rows(b, h, q_idx, kv_idx):
    """Per head a different document offset; every 11th query row (shifted by b) sees nothing."""
    return DOC[q_idx] == DOC[(kv_idx + 5 * h) % 192] and (q_idx + b) % 11 != 4


def blocks_and_diagonal(b, h, q_idx, kv_idx):
    """16 x 16 blocks kept or dropped by (b, h), plus a diagonal: every class in 16 x 16 tiles."""
    return (q_idx // 16 + kv_idx // 16 + b + h) % 3 == 0 or q_idx == kv_idx + b


def everything(b, h, q_idx, kv_idx):
    return True


def every_third_key_dropped(b, h, q_idx, kv_idx):
    return kv_idx % 3 != 0


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    poison_allocations(monkeypatch)


def brute_force_classes(mask_mod, batch, nheads, seqlen_q, seqlen_k, block_m, block_n):
    b, h, i, j = np.meshgrid(np.arange(batch), np.arange(nheads), np.arange(seqlen_q), np.arange(seqlen_k),
                             indexing="ij")
    keep = np.vectorize(mask_mod, otypes=[bool])(b, h, i, j)
    m_tiles, n_tiles = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    classes = np.empty((batch, nheads, m_tiles, n_tiles), np.int8)
    for m in range(m_tiles):
        for n in range(n_tiles):
            tile = keep[:, :, m * block_m:(m + 1) * block_m, n * block_n:(n + 1) * block_n]
            classes[:, :, m, n] = np.where(tile.all(axis=(2, 3)), FULL, np.where(tile.any(axis=(2, 3)), PARTIAL, EMPTY))
    return classes


@pytest.mark.parametrize("B, H", [(None, None), (2, 2)])
def test_classification_matches_brute_force(B, H):
    seqlen_q, seqlen_k = 37, 41  # tails in both directions
    block_mask = nbflash.create_block_mask(blocks_and_diagonal, B, H, seqlen_q, seqlen_k)
    for block_m, block_n in ((16, 16), (8, 32)):
        classes = to_numpy(block_mask.classes(block_m, block_n))
        expected = brute_force_classes(blocks_and_diagonal, B or 1, H or 1, seqlen_q, seqlen_k, block_m, block_n)
        assert classes.dtype == np.int8 and classes.shape == expected.shape
        np.testing.assert_array_equal(classes, expected)
        assert block_mask.classes(block_m, block_n) is block_mask.classes(block_m, block_n)  # kept
    assert set(np.unique(to_numpy(block_mask.classes(16, 16))).tolist()) == {EMPTY, PARTIAL, FULL}


def attend(rng, xp, family, dtype, shape, block_mask, backward, deterministic=False, causal=False,
           forward_family=None, **variant):
    """Forward (and backward) through ``block_mask`` against the float64 reference of its mask_mod.
    ``forward_family="reference"``: the backward starts from the float64 reference's out and lse (no
    forward kernel runs, nor is one checked)."""
    q, k, v = random_qkv(rng, xp, *shape, dtype)
    if forward_family == "reference":
        out, lse = reference_forward(xp, q, k, v, None, causal, mask_mod=block_mask.mask_mod, **variant)
    else:
        with nbflash.kernel_family(forward_family or family):
            out, lse = nbflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, block_mask=block_mask,
                                               **variant)
        assert_attention_close(out, lse, q, k, v, causal, mask_mod=block_mask.mask_mod, **variant)
    if backward:
        dout = random_like(rng, xp, q)
        with nbflash.kernel_family(family):
            grads = flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                                        block_mask=block_mask, **variant)
        assert_gradients_close(grads, dout, q, k, v, causal, mask_mod=block_mask.mask_mod, **variant)
    return out, lse


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")
def test_causal_documents_portable(rng, xp):
    # 70 x 70 in the portable kernels' 64 x 64 tiles: the (0, 1) pair is empty
    block_mask = nbflash.create_block_mask(causal_documents, None, None, 70, 70)
    attend(rng, xp, "portable", "float32", (1, 70, 70, 1, 1, 16), block_mask, backward=True)
    assert to_numpy(block_mask.classes(64, 64))[0, 0, 0, 1] == EMPTY


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")
def test_empty_rows_with_window_portable(rng, xp):
    """Rows that see no key (output 0, lse -inf, zero gradients), per-head masks, GQA, combined with
    causal=True and a window; the deterministic dQ kernel."""
    block_mask = nbflash.create_block_mask(documents_with_empty_rows, 1, 2, 45, 70)
    out, lse = attend(rng, xp, "portable", "float32", (1, 45, 70, 2, 1, 16), block_mask, backward=True,
                      deterministic=True, causal=True, window_size=(40, -1))
    assert np.isneginf(to_numpy(lse)).any()


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")
def test_causal_documents_mma(rng, xp):
    """The tensor-core dK/dV kernel (64 x 64 tiles): the block of key tile 1 skips its first query
    tile, so its first request goes to the second. (The backward starts from the float64
    reference's out and lse: the portable forward ran here on test_causal_documents_portable's
    problem, and test_empty_tiles_are_skipped runs the tensor-core forward; the GPU grid runs the
    deterministic dQ kernel too.)"""
    block_mask = nbflash.create_block_mask(causal_documents, None, None, 70, 70)
    attend(rng, xp, "mma", "float16", (1, 70, 70, 1, 1, 16), block_mask, backward=True, forward_family="reference")
    assert to_numpy(block_mask.classes(64, 64))[0, 0, 0, 1] == EMPTY


def tampered(block_mask, n_tile, tile_class):
    """Every table the block mask holds, with key tile ``n_tile`` (64 keys in every table these tests
    make) set to ``tile_class`` for every query tile: what the kernels then compute shows whether
    they obey the table."""
    for (_, block_n), table in block_mask._classes.items():
        assert block_n == 64
        table[:, :, :, n_tile] = tile_class


@pytest.mark.skipif(not SIMULATOR, reason="writes the tables in place (NumPy under the simulator)")
@pytest.mark.parametrize("family, dtype, seqlen_q", [("portable", "float32", 9), ("mma", "float16", 9)])
def test_empty_tiles_are_skipped(rng, xp, family, dtype, seqlen_q):
    """A mask_mod that keeps everything, with a table that calls key tile 1 (keys 64..127, in both
    families' forward tiles: 64 keys) empty: the kernels must leave those keys out, which asking
    mask_mod would not. Key tile 2 follows it, so the tensor-core forward prefetches past it."""
    shape = (1, seqlen_q, 130, 1, 1, 16)
    q, k, v = random_qkv(rng, xp, *shape, dtype)
    block_mask = nbflash.create_block_mask(everything, None, None, seqlen_q, 130)
    with nbflash.kernel_family(family):
        config = nbflash.explain(q, k, v, block_mask=block_mask)["config"]  # the forward's tiles
        block_mask.classes(config["block_m"], config["block_n"])
        tampered(block_mask, 1, EMPTY)
        out, lse = nbflash.flash_attn_func(q, k, v, block_mask=block_mask, return_lse=True)

    def without_tile_1(b, h, q_idx, kv_idx):
        return not 64 <= kv_idx < 128

    assert_attention_close(out, lse, q, k, v, False, mask_mod=without_tile_1)


@pytest.mark.skipif(not SIMULATOR, reason="writes the tables in place (NumPy under the simulator)")
def test_full_tiles_are_not_tested(rng, xp):
    """A table that calls key tile 0 full although mask_mod drops every third key there: the
    kernels (forward and backward) must keep all of it, i.e. not ask mask_mod."""
    # 64 query rows: a whole query tile, which the backward's dK/dV loop would otherwise mask
    q, k, v = random_qkv(rng, xp, 1, 64, 70, 1, 1, 16, "float32")
    block_mask = nbflash.create_block_mask(every_third_key_dropped, None, None, 64, 70)
    dout = random_like(rng, xp, q)
    problem = nbflash.validation.check_forward(q, k, v, None, False, block_mask=block_mask)[0]
    with nbflash.kernel_family("portable"):
        config = nbflash.explain(q, k, v, block_mask=block_mask)["config"]  # the forward's tiles
        block_mask.classes(config["block_m"], config["block_n"])
        _, dkdv, _ = nbflash.configs.plan_backward(problem.static, False, "portable")  # the backward's
        block_mask.classes(dkdv.block_m, dkdv.block_n)
        tampered(block_mask, 0, FULL)
        out, lse = nbflash.flash_attn_func(q, k, v, block_mask=block_mask, return_lse=True)
        grads = flash_attn_backward(dout, q, k, v, out, lse, block_mask=block_mask)

    def tile_0_whole(b, h, q_idx, kv_idx):
        return kv_idx < 64 or kv_idx % 3 != 0

    assert_attention_close(out, lse, q, k, v, False, mask_mod=tile_0_whole)
    assert_gradients_close(grads, dout, q, k, v, False, mask_mod=tile_0_whole)


def test_walks_over_the_table():
    """The forwards' walks over a block mask's table (nbflash.kernels.variants.Hooks) against a list
    comprehension: random tables with long runs of empty tiles, bands [first, end) ending inside
    one, rows with nothing to visit (the dK/dV kernel's walk over (query head, query tile) pairs:
    test_warp_walks_over_the_table)."""
    from nbflash.kernels import variants
    from nbflash.problem import Variant

    hooks = variants.hooks(Variant(block_mask=True))
    rng = np.random.default_rng(3)
    for _ in range(30):
        m_tiles, n_tiles = int(rng.integers(1, 4)), int(rng.integers(1, 40))
        table = np.where(rng.random((1, 4, m_tiles, n_tiles)) < 0.25, FULL, EMPTY).astype(np.int8)
        table[0, 0, 0, :] = EMPTY  # a row with nothing to visit
        params = (table,)
        for h in range(4):
            for m in range(m_tiles):
                first, end = sorted(int(x) for x in rng.integers(0, n_tiles + 1, 2))
                expected = [j for j in range(first, end) if table[0, h, m, j] != EMPTY]
                assert hooks.visited_key_tiles(params, 0, h, m, first, end) == len(expected)
                walk, j = [], first - 1
                for i in range(len(expected)):
                    j = hooks.visit_key_tile(params, 0, h, m, first, i, j, end)
                    walk.append(j)
                assert walk == expected
                assert hooks.next_key_tile(params, 0, h, m, walk[-1] + 1 if walk else first, end) == end


@pytest.mark.skipif(not SIMULATOR, reason="a one-warp kernel on NumPy tables (the GPU runs the kernels' own grid)")
def test_warp_walks_over_the_table():
    """The dK/dV walk and count done by a whole warp (Hooks.warp_visit_query_step and
    warp_visited_query_steps: 32 classes a read, lanes agreeing by shuffles), run by a 32-thread
    kernel, against a list comprehension: runs of empty pairs longer than 32 (several rounds of
    reads), bands ending inside a round, a head's tiles all empty, nothing visited at all."""
    from nbflash.kernels import variants
    from nbflash.problem import Variant

    hooks = variants.hooks(Variant(block_mask=True))
    count_pairs, visit = hooks.warp_visited_query_steps, hooks.warp_visit_query_step

    @cuda.jit
    def walk(table, hk, group, n, first, per_head, out):
        lane = cuda.threadIdx.x
        params = (table,)
        steps = count_pairs(params, 0, hk, group, n, first, per_head, lane)
        if lane == 0:
            out[0] = steps
        position = -1
        for i in range(steps):
            position = visit(params, 0, hk, group, n, first, per_head, i, position, lane)
            if lane == 0:
                out[1 + i] = position

    rng = np.random.default_rng(5)
    for trial, group in enumerate((1, 2, 4, 1)):
        m_tiles = int(rng.integers(36, 50))
        table = np.where(rng.random((1, 8, m_tiles, 2)) < 0.1, FULL, EMPTY).astype(np.int8)
        if trial == 3:
            table[:] = EMPTY  # nothing to visit
        table[0, :, : m_tiles - 2, 1] = EMPTY  # a run of empty pairs longer than a round of reads
        table[0, ::2, :, 0] = EMPTY  # every other head's tiles all empty: walks cross a whole head
        hk = int(rng.integers(0, 8 // group))
        for n in range(2):
            first, end = int(rng.integers(0, 5)), int(rng.integers(m_tiles - 5, m_tiles + 1))
            per_head = end - first
            pairs = [g * per_head + t - first for g in range(group) for t in range(first, end)
                     if table[0, hk * group + g, t, n] != EMPTY]
            out = np.full(1 + group * per_head, -7, np.int64)
            walk[1, 32](table, hk, group, n, first, per_head, out)
            assert out[0] == len(pairs)
            assert list(out[1:1 + len(pairs)]) == pairs


def head_striped(b, h, q_idx, kv_idx):
    return (kv_idx + h) % 5 != 0


@pytest.mark.skipif(not SIMULATOR, reason="writes the tables in place (NumPy under the simulator)")
def test_sm90_backward_obeys_the_table(rng, xp):
    """The Hopper dK/dV kernel's steps walk (query head, query tile) pairs: a mask_mod that thins
    every tile, with tables rewritten to call keys 0..127 empty for the first 64 queries and full
    for the next 64. The kernel must leave the empty pairs out and keep the full ones whole (neither
    follows from asking mask_mod), over GQA 2:1, so that the walk of key tile 0 skips a pair within
    each head and moves across heads. Keys 128..255 stay partial where the band alone would call
    them whole, so mask_mod must be asked there. The forward runs on the portable kernels (faster to
    emulate), from the same rewritten table for its tile sizes (both 64 queries a tile). Tiles are
    rewritten full only where no sequence tail crosses them (a tail's masked step may still ask
    mask_mod)."""
    q, k, v = random_qkv(rng, xp, 1, 128, 256, 2, 1, 32, "float16")
    block_mask = nbflash.create_block_mask(head_striped, None, 2, 128, 256)
    problem = nbflash.validation.check_forward(q, k, v, None, False, block_mask=block_mask)[0]
    with nbflash.kernel_family("portable"):
        config = nbflash.explain(q, k, v, block_mask=block_mask)["config"]
    tiles = [(config["block_m"], config["block_n"])]
    _, dkdv, _ = nbflash.configs.plan_backward(problem.static, False, "sm90")
    assert type(dkdv).__name__ == "Sm90BackwardConfig"
    tiles.append((dkdv.block_m, dkdv.block_n))
    for block_m, block_n in tiles:
        assert block_m == 64 and 128 % block_n == 0
        table = block_mask.classes(block_m, block_n)
        table[:, :, 0, :128 // block_n] = EMPTY
        table[:, :, 1, :128 // block_n] = FULL
    with nbflash.kernel_family("portable"):
        out, lse = nbflash.flash_attn_func(q, k, v, return_lse=True, block_mask=block_mask)
    dout = random_like(rng, xp, q)
    with nbflash.kernel_family("sm90"):
        grads = flash_attn_backward(dout, q, k, v, out, lse, block_mask=block_mask)

    def as_the_tables_say(b, h, q_idx, kv_idx):
        return (kv_idx < 128 and q_idx >= 64) or (kv_idx >= 128 and head_striped(b, h, q_idx, kv_idx))

    assert_attention_close(out, lse, q, k, v, False, mask_mod=as_the_tables_say)
    assert_gradients_close(grads, dout, q, k, v, False, mask_mod=as_the_tables_say)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below (sm90, deterministic)")
def test_sm90_deterministic_dq_walks_the_visited_tiles(rng, xp):
    """deterministic=True under "sm90" with a block mask: the Hopper dQ kernel (128 queries by 64
    keys a tile) walks the key tiles its query tile visits, its producer and consumers alike. Causal
    documents of 24 tokens over 192: query tile 0 skips key tile 2, query tile 1 skips key tile 0,
    its first, and starts at the second. One head (two took the emulation twice as long, most of it
    in the dK/dV pass, whose walk across GQA heads test_sm90_backward_obeys_the_table checks)."""
    from nbflash.kernels.backward_dq_sm90 import Sm90DqConfig

    shape = (1, 192, 192, 1, 1, 16)
    q, k, v = random_qkv(rng, xp, *shape, "float16")
    block_mask = nbflash.create_block_mask(causal_documents, None, None, 192, 192)
    problem = nbflash.validation.check_forward(q, k, v, None, False, block_mask=block_mask)[0]
    _, dkdv, dq = nbflash.configs.plan_backward(problem.static, True, "sm90")
    assert isinstance(dq, Sm90DqConfig) and (dq.block_m, dq.block_n) == (128, 64) and not dkdv.atomic_dq
    classes = to_numpy(block_mask.classes(128, 64))
    assert classes[0, 0, 0, 2] == EMPTY and classes[0, 0, 1, 0] == EMPTY and classes[0, 0, 1, 1] != EMPTY
    attend(rng, xp, "sm90", "float16", shape, block_mask, backward=True, deterministic=True,
           forward_family="reference")  # (the portable forward through a block mask: the tests above)


@pytest.mark.gpu
@pytest.mark.parametrize("family, dtype", [("mma", "float16"), ("mma", "bfloat16"), ("portable", "float32"),
                                           ("sm90", "float16"), ("sm90", "bfloat16")])
@pytest.mark.parametrize("deterministic", [False, True])
def test_block_mask_gpu(rng, xp, family, dtype, deterministic):
    doc = np.repeat(np.arange(8), 50).astype(np.int32)

    def documents(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx] and (q_idx + h) % 37 != 0

    block_mask = nbflash.create_block_mask(documents, None, 4, 333, 333)
    attend(rng, xp, family, dtype, (2, 333, 333, 4, 2, 64), block_mask, backward=True, deterministic=deterministic,
           causal=True)


def test_bad_block_masks(rng, xp):
    q, k, v = random_qkv(rng, xp, 2, 5, 6, 2, 1, 8, "float32")
    with pytest.raises(TypeError, match="block_mask must be a BlockMask from nbflash.create_block_mask"):
        nbflash.flash_attn_func(q, k, v, block_mask=np.ones((2, 2, 5, 6), bool))
    with pytest.raises(ValueError, match=r"block_mask was made for B=3, but the call has 2 \(batch\).*B=None"):
        nbflash.flash_attn_func(q, k, v, block_mask=nbflash.create_block_mask(everything, 3, None, 5, 6))
    with pytest.raises(ValueError, match=r"block_mask was made for H=1, but the call has 2 \(nheads\)"):
        nbflash.flash_attn_func(q, k, v, block_mask=nbflash.create_block_mask(everything, None, 1, 5, 6))
    with pytest.raises(ValueError, match="block_mask was made for seqlen_k=7, but the call has seqlen_k=6"):
        nbflash.flash_attn_func(q, k, v, block_mask=nbflash.create_block_mask(everything, 2, 2, 5, 7))
    block_mask = nbflash.create_block_mask(everything, 2, 2, 5, 6)
    with pytest.raises(ValueError, match="mask_mod differs from block_mask's mask_mod; pass block_mask alone"):
        nbflash.flash_attn_func(q, k, v, block_mask=block_mask, mask_mod=every_third_key_dropped)
    out, lse = nbflash.flash_attn_func(q, k, v, return_lse=True, block_mask=block_mask)
    with pytest.raises(ValueError, match="mask_mod differs from block_mask's mask_mod"):
        flash_attn_backward(q, q, k, v, out, lse, block_mask=block_mask, mask_mod=every_third_key_dropped)
    with pytest.raises(TypeError, match="mask_mod must be a Python function"):
        nbflash.create_block_mask("causal", None, None, 5, 6)
    with pytest.raises(TypeError, match="B must be a positive int, or None"):
        nbflash.create_block_mask(everything, 0, None, 5, 6)
    with pytest.raises(TypeError, match="seqlen_k must be a positive int"):
        nbflash.create_block_mask(everything, None, None, 5, 6.0)


def test_same_mask_mod_with_its_block_mask_is_accepted(rng, xp):
    q, k, v = random_qkv(rng, xp, 1, 5, 6, 1, 1, 8, "float32")
    block_mask = nbflash.create_block_mask(every_third_key_dropped, None, None, 5, 6)
    with nbflash.kernel_family("portable"):
        out = nbflash.flash_attn_func(q, k, v, block_mask=block_mask, mask_mod=every_third_key_dropped)
    assert_attention_close(out, None, q, k, v, False, mask_mod=every_third_key_dropped)
