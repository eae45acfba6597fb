"""Shared test helpers: random inputs in any layout, poisoned outputs, the flash-attn error rule,
small tiles for the simulator."""

import contextlib

import numpy as np
import pytest

import nbflash
from nbflash.dtypes import SUPPORTED
from nbflash.reference import visible

# Absolute floor added to the error budget (flash-attn's rule is "at most twice the error of a
# same-precision naive implementation"; a float32 naive path can be nearly exact on easy inputs).
ERROR_FLOOR = {"float32": 1e-5, "float16": 1e-4, "bfloat16": 1e-3}


def random_qkv(rng, xp, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, heads_first=False):
    """Fresh standard-normal q, k, v on the backend.

    With ``heads_first`` the arrays are stored as (batch, nheads, seqlen, headdim) and handed over as
    transposed views, the layout many models keep their tensors in.
    """

    def draw(seqlen, heads):
        shape = (batch, heads, seqlen, headdim) if heads_first else (batch, seqlen, heads, headdim)
        x = xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(SUPPORTED[dtype]))
        return x.transpose(0, 2, 1, 3) if heads_first else x

    return draw(seqlen_q, nheads), draw(seqlen_k, nheads_k), draw(seqlen_k, nheads_k)


def to_numpy(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


# The tensor-core kernels' softcap tanh (nbflash/kernels/variants.py, SOFTCAP_TANH "exp2", from
# ex2.approx and rcp.approx): within about 2e-7 of tanh, absolute; the lse check allows this much.
TANH_ERROR = 2.5e-7


def assert_attention_close(out, lse, q, k, v, causal, softmax_scale=None, output_rounding=False, **variant):
    """out (and lse, if given) against float64, under flash-attn's twice-the-naive-error rule;
    ``variant``: window_size, softcap, alibi_slopes, as given to flash_attn_func.

    ``output_rounding``: also allow half a unit in the last place of out's dtype at the largest
    reference value: the error of storing the exact answer, which nothing avoids. The rule assumes
    enough elements that the naive error already includes it; on a draw of a dozen outputs
    (tests/test_fuzz.py) the naive path may round its largest one almost exactly."""
    dtype = nbflash.dtypes.dtype_name(q.dtype)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref, ref_lse = nbflash.attention_reference(q, k, v, softmax_scale, causal, return_lse=True, **variant)
    naive = nbflash.attention_naive(q, k, v, softmax_scale, causal, **variant)
    out64 = to_numpy(out).astype(np.float64)
    ref, ref_lse, naive = to_numpy(ref), to_numpy(ref_lse), to_numpy(naive)
    assert not np.isnan(out64).any(), "out has NaN (an element left unwritten, or a 0/0)"
    error = np.abs(out64 - ref).max()
    naive_error = np.abs(naive.astype(np.float64) - ref).max()
    budget = 2 * naive_error + ERROR_FLOOR[dtype]
    if output_rounding:
        budget += 0.5 * float(np.spacing(np.abs(ref).max(initial=0.0).astype(SUPPORTED[dtype])))
    assert error <= budget, f"max error {error:.3g} > budget {budget:.3g} (naive {naive_error:.3g})"
    if lse is not None:
        lse = to_numpy(lse)
        assert lse.shape == ref_lse.shape and lse.dtype == np.float32
        assert not np.isnan(lse).any()
        no_key = np.isneginf(ref_lse)
        assert np.array_equal(np.isneginf(lse), no_key), "lse = -inf exactly where a row sees no key"
        assert (out64[np.transpose(no_key, (0, 2, 1))] == 0).all(), "rows that see no key must be 0"
        finite = ~no_key
        lse_error = np.abs(lse[finite] - ref_lse[finite]) / np.maximum(1.0, np.abs(ref_lse[finite]))
        # A softcap's tanh in the tensor-core kernels is off by up to TANH_ERROR (absolute), so a score
        # by softcap * TANH_ERROR, and the lse (a smooth max of the scores) by as much.
        lse_budget = 1e-5 + variant.get("softcap", 0.0) * TANH_ERROR
        assert lse_error.max(initial=0.0) <= lse_budget, f"lse relative error {lse_error.max():.3g} > {lse_budget:.3g}"
    return error, naive_error


def poison_allocations(monkeypatch):
    """Make every array nbflash allocates (launch.empty, launch.empty_pair) start as NaN."""
    from nbflash import launch

    real_empty, real_pair = launch.empty, launch.empty_pair

    def poisoned(x):
        x[...] = np.nan
        return x

    monkeypatch.setattr(launch, "empty", lambda shape, dtype: poisoned(real_empty(shape, dtype)))
    monkeypatch.setattr(launch, "empty_pair", lambda *args: tuple(poisoned(x) for x in real_pair(*args)))


@contextlib.contextmanager
def small_tiles():
    """Plan every forward and backward with tiles of 8 rows (portable) and 16 (tensor-core), and
    the backward's row-wise kernels with 8 rows of 4 threads: tiny sequences then span several
    tiles, and the simulator runs blocks of 16-32 threads instead of 256 (several times faster)."""
    from nbflash import backward, configs, interface

    caches = (configs.portable_forward_config, configs.mma_forward_config, interface._forward_kernel,
              backward._kernels)

    def clear():
        for cache in caches:
            cache.cache_clear()

    clear()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(configs, "PORTABLE_FORWARD", [(256, 4, 4, 2)])  # block_m 8
            patch.setattr(configs, "PORTABLE_BACKWARD_DKDV", [(256, 4, 8)])  # block_n 8
            patch.setattr(configs, "PORTABLE_BACKWARD_DQ", [(256, 4, 8)])  # block_m 8
            patch.setattr(configs, "PORTABLE_BACKWARD_ROWS", (8, 4))
            patch.setattr(configs, "MMA_FORWARD", [(256, 16, 16, 1)])
            patch.setattr(configs, "MMA_BACKWARD_DKDV", [(256, 16, 16, 1)])
            patch.setattr(configs, "MMA_BACKWARD_DQ", [(256, 16, 16, 1)])
            yield
    finally:
        clear()  # after the tables are restored: no small-tile config outlives the block


def simulator_small_tiles():
    """``small_tiles()`` in the simulator, nothing on a GPU: for tests of the API around the kernels
    (argument order, seeds), whose answers the tile sizes do not change, and which emulate far
    faster on small blocks."""
    from nbflash import primitives

    return small_tiles() if primitives.SIMULATOR else contextlib.nullcontext()


def kernel_reference(q, k, v, scale, window, p_dtype=None):
    """What a forward kernel's test compares against, on (batch, seqlen, heads, headdim) host
    arrays: attention in float64 (or, with p_dtype, the naive low-precision version), out and lse;
    ``window`` a flash-attn window_size, or None."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    work = np.float64 if p_dtype is None else np.float32
    q, k, v = (x.astype(work) for x in (q, k, v))
    k = np.repeat(k, nheads // nheads_k, axis=2)
    v = np.repeat(v, nheads // nheads_k, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    mask = visible(seqlen_q, seqlen_k, window_size=window) if window else None
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    p = p / np.where(l > 0, l, 1)
    if p_dtype is not None:
        p = p.astype(p_dtype).astype(work)
    out = np.einsum("bhij,bjhd->bihd", p, v)
    with np.errstate(divide="ignore"):
        lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(l[..., 0]), -np.inf)
    return out, lse


def is_sm90():
    """A GPU of compute capability 9.0 is here (sm_90a code runs on nothing else); False in the
    simulator and where no GPU is (the offline compile check imports the sm90 tests with none)."""
    from nbflash import primitives

    if primitives.SIMULATOR:
        return False
    from numba import cuda

    return cuda.is_available() and cuda.get_current_device().compute_capability == (9, 0)


@contextlib.contextmanager
def replanned(monkeypatch, change):
    """Plan the sm90 backward's dK/dV kernel as the planner does, then through ``change`` (a config
    to a config), inside the ``with``; the compiled kernels' cache cleared on entry and on exit."""
    from nbflash import backward, configs

    planned = configs.sm90_backward_config
    monkeypatch.setattr(configs, "sm90_backward_config", lambda *args: change(planned(*args)))
    backward._kernels.cache_clear()
    try:
        yield
    finally:
        backward._kernels.cache_clear()
