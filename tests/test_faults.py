"""Faults in the inputs and in the machine: NaN and Inf in q, k, v (README, "NaN and Inf"), and
running out of GPU memory.

What the kernels do with non-finite inputs, and what these tests hold them to:

- a NaN (or Inf) anywhere in q's row i of head h: out[b, i, h] is NaN, every other row is exactly
  what it is without it (bit for bit), as in the float64 reference;
- an Inf in k's row j: the rows whose score with key j is +inf get NaN (inf / inf, as in the
  reference), the rows whose score is -inf attend as if key j were masked, and rows that do not
  see key j (causal, windows) are untouched;
- a NaN in v's row j: NaN in every row that sees key j (rows masked from it may be NaN too: a
  masked key inside a visited tile still meets a 0 probability, and 0 * NaN is NaN);
- the lse of a poisoned row is NaN, as the reference's for a NaN in q (for a +inf score the
  reference gives +inf and the kernels NaN: either way not the -inf of a row without keys, so
  ``merge_attention_states`` does not drop the row's NaN).
"""

import gc
import numpy as np
import pytest

import nbflash
from nbflash.dtypes import BFLOAT16

from .conftest import SIMULATOR
from .helpers import ERROR_FLOOR, assert_attention_close, random_qkv, small_tiles, to_numpy

# NumPy's (and the simulator's) "invalid value" warnings are what a NaN input is expected to cause.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# (family, dtype): both families in the simulator; on a GPU also the default choice (sm90 or mma).
FAMILIES = [("portable", "float32"), ("mma", "float16")] + ([] if SIMULATOR else [(None, "bfloat16")])
SHAPE = (1, 9, 11, 2, 1, 8)  # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim: two query tiles (small tiles)


@pytest.fixture(autouse=True)
def tiles():
    if SIMULATOR:
        with small_tiles():
            yield
    else:
        yield


def run(family, q, k, v, causal=False):
    if family is None:
        out, lse = nbflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    else:
        with nbflash.kernel_family(family):
            out, lse = nbflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    return to_numpy(out).astype(np.float64), to_numpy(lse)


def nan_rows(x):
    """(batch, seqlen, heads) rows of ``x`` that are NaN, checking that a row is all NaN or none."""
    rows = np.isnan(x).any(axis=-1)
    assert (np.isnan(x).all(axis=-1) == rows).all(), "a row partly NaN"
    return rows


def assert_finite_rows_close(out, q, k, v, causal):
    """The rows the reference keeps finite: within flash-attn's budget of it; the others NaN in both."""
    ref = to_numpy(nbflash.attention_reference(q, k, v, causal=causal))
    naive = to_numpy(nbflash.attention_naive(q, k, v, causal=causal)).astype(np.float64)
    poisoned = nan_rows(ref)
    assert np.array_equal(nan_rows(out), poisoned), "out is NaN in other rows than the reference"
    keep = ~poisoned
    naive_error = np.abs(naive[keep] - ref[keep]).max(initial=0.0)
    error = np.abs(out[keep] - ref[keep]).max(initial=0.0)
    assert error <= 2 * naive_error + ERROR_FLOOR[nbflash.dtypes.dtype_name(q.dtype)]
    return poisoned


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("family, dtype", FAMILIES)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nan_or_inf_in_one_row_of_q_poisons_that_row_only(rng, xp, family, dtype, causal, value):
    q, k, v = random_qkv(rng, xp, *SHAPE, dtype)
    clean_out, clean_lse = run(family, q, k, v, causal)
    assert_attention_close(clean_out.astype(q.dtype), clean_lse, q, k, v, causal)
    poisoned = to_numpy(q).copy()
    poisoned[0, 7, 1, 3] = value  # one element of row 7 (second query tile), head 1
    q = xp.asarray(poisoned)
    out, lse = run(family, q, k, v, causal)
    row = np.zeros(out.shape[:3], bool)
    row[0, 7, 1] = True
    assert np.array_equal(nan_rows(out), row), "exactly the poisoned row is NaN"
    assert np.array_equal(out[~row].view(np.uint64), clean_out[~row].view(np.uint64)), "other rows changed"
    assert np.array_equal(lse[0, 0], clean_lse[0, 0]) and np.array_equal(np.delete(lse[0, 1], 7),
                                                                          np.delete(clean_lse[0, 1], 7))
    ref = to_numpy(nbflash.attention_reference(q, k, v, causal=causal))
    assert np.array_equal(nan_rows(ref), row), "the reference agrees"


@pytest.mark.parametrize("family, dtype", FAMILIES)
@pytest.mark.parametrize("causal", [False, True])
def test_inf_in_k(rng, xp, family, dtype, causal):
    """One element of k's row 5 set to +inf: each query row's score with key 5 is +inf or -inf (the
    sign of its q element times the scale); +inf rows are NaN, -inf rows attend without key 5, and
    under causal the rows before key 5's diagonal never see it. Matches the reference."""
    q, k, v = random_qkv(rng, xp, *SHAPE, dtype)
    poisoned = to_numpy(k).copy()
    poisoned[0, 5, 0, 2] = np.inf
    k = xp.asarray(poisoned)
    out, _ = run(family, q, k, v, causal)
    rows = assert_finite_rows_close(out, q, k, v, causal)
    plus = to_numpy(q)[0, :, :, 2].astype(np.float32) > 0  # (seqlen_q, heads): score +inf with key 5
    if causal:  # bottom-right: query i sees key 5 iff 5 <= i + seqlen_k - seqlen_q
        plus &= (np.arange(SHAPE[1]) + SHAPE[2] - SHAPE[1] >= 5)[:, None]
    assert np.array_equal(rows[0], plus)
    assert plus.any() and (~plus).any(), "the draw covers both signs"


@pytest.mark.parametrize("family, dtype", FAMILIES)
def test_nan_in_v_reaches_the_rows_that_see_it(rng, xp, family, dtype):
    q, k, v = random_qkv(rng, xp, *SHAPE, dtype)
    poisoned = to_numpy(v).copy()
    poisoned[0, 10, 0, :] = np.nan  # the last key: under causal, only the last query row sees it
    v = xp.asarray(poisoned)
    out, _ = run(family, q, k, v, causal=True)
    assert nan_rows(out)[0, -1].all(), "the row that sees key 10 is NaN"
    out, _ = run(family, q, k, v, causal=False)
    assert nan_rows(out).all(), "every row sees key 10"


@pytest.mark.parametrize("family, dtype", FAMILIES)
def test_lse_of_a_poisoned_row_matches_the_reference(rng, xp, family, dtype):
    q, k, v = random_qkv(rng, xp, *SHAPE, dtype)
    poisoned = to_numpy(q).copy()
    poisoned[0, 2, 0, 0] = np.nan
    q = xp.asarray(poisoned)
    out, lse = run(family, q, k, v)
    _, ref_lse = nbflash.attention_reference(q, k, v, return_lse=True)
    assert np.isnan(to_numpy(ref_lse)[0, 0, 2])
    assert np.isnan(lse[0, 0, 2]) and np.isnan(out[0, 2, 0]).all()
    clean = np.delete(lse[0, 0], 2)
    assert np.isfinite(clean).all(), "only the poisoned row's lse is NaN"
    # Merged with a clean state, the row stays NaN (an lse of -inf would have weighed it 0).
    clean_out, clean_lse = run(family, random_qkv(rng, xp, *SHAPE, dtype)[0], k, v)
    element = {"float32": np.float32, "float16": np.float16, "bfloat16": BFLOAT16}[dtype]
    merged, merged_lse = nbflash.merge_attention_states(xp.asarray(out.astype(element)), xp.asarray(lse),
                                                        xp.asarray(clean_out.astype(element)), xp.asarray(clean_lse))
    assert np.isnan(to_numpy(merged).astype(np.float64)[0, 2, 0]).all()
    assert np.isnan(to_numpy(merged_lse)[0, 0, 2])


# ---- Out of memory ---------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_out_of_memory_is_a_clear_error_and_leaks_nothing():
    """A call whose outputs cannot fit (q a stride-0 view claiming more than the GPU holds, so the
    inputs cost nothing): CuPy's OutOfMemoryError (a MemoryError saying how many bytes), raised
    before any launch, and the memory pool's used bytes are what they were. The backward case
    gets dq, then fails on its float32 accumulator: dq must be given back too."""
    import cupy

    pool = cupy.get_default_memory_pool()
    _, total = cupy.cuda.runtime.memGetInfo()
    nheads, headdim = 64, 128
    small = cupy.ones((1, 1, nheads, headdim), cupy.float16)
    k = cupy.ones((1, 64, nheads, headdim), cupy.float16)

    def claiming(fraction):
        rows = int(fraction * total) // (nheads * headdim * 2)
        return cupy.broadcast_to(small, (1, rows, nheads, headdim)), rows

    def memory_error(call):
        """The MemoryError's message; the exception and its frames are gone when this returns, so
        whatever the call had allocated is back in the pool unless something still holds it."""
        try:
            call()
        except MemoryError as error:
            return str(error)
        raise AssertionError("no MemoryError")

    cupy.cuda.Device().synchronize()
    gc.collect()  # an earlier test's garbage freed during the call would look like a negative leak
    before = pool.used_bytes()
    q, _ = claiming(1.5)  # out alone: 1.5x the GPU
    assert "out of memory" in memory_error(lambda: nbflash.flash_attn_func(q, k, k, causal=True)).lower()
    assert pool.used_bytes() == before

    q, rows = claiming(0.45)  # dq fits; the float32 dq accumulator (0.9x) does not
    lse = cupy.zeros((1, nheads, rows), cupy.float32)
    before = pool.used_bytes()
    message = memory_error(lambda: nbflash.flash_attn_backward(q, q, k, k, q, lse, causal=True))
    assert "out of memory" in message.lower()
    assert pool.used_bytes() == before
    lse = None  # give the memory back to the GPU for the tests after this one
    pool.free_all_blocks()
