"""The Hopper deterministic dQ kernel (nbflash/kernels/backward_dq_sm90.py) against float64, launched
directly (it is not in the kernel registry yet, so no plan reaches it).

Each case draws q, k, v and dout, takes out and lse from the float64 reference (out rounded to the
inputs' dtype, as a forward returns it), D = rowsum(dout * out) as the preprocess computes it, runs
the kernel twice on NaN-poisoned dq buffers and checks that the two runs agree bit for bit (no
atomics: a fixed order) and that dq meets tests/test_backward.py's rule: twice the error of a
same-precision naive backward, plus a floor relative to the largest reference gradient.

Without a GPU these run in Numba's simulator, where wgmma, TMA and the mbarriers are emulated (384
Python threads a block: three tiny cases). On a GPU of compute capability 9.0 (not yet run there) a
larger grid runs, through the launcher with the kernel put into the registry for the test.
"""

import math

import numpy as np
import pytest

from nbflash import configs, launch
from nbflash.dtypes import KERNEL_DTYPE
from nbflash.kernels import registry, variants
from nbflash.kernels.backward_dq_sm90 import Sm90DqConfig, build_backward_dq_sm90
from nbflash.kernels.backward_sm90 import tensor_maps
from nbflash.problem import Variant, window_bounds
from nbflash.reference import attention_naive_backward, attention_reference, attention_reference_backward

from .conftest import SIMULATOR
from .helpers import ERROR_FLOOR, is_sm90, random_qkv, to_numpy



pytestmark = pytest.mark.skipif(not SIMULATOR and not is_sm90(),
                                reason="sm_90a instructions run only on compute capability 9.0")

NAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0}


def signature(config):
    """The kernel's Numba signature: the mma dq kernel's arguments (registry._backward, kernel
    "dq"), with the tensor maps of q, k, v, dout after dq."""
    t = KERNEL_DTYPE[config.dtype].name
    inputs = ", ".join([f"{t}[:,:,:,:]"] * 4)  # q, k, v, dout
    params = ", ".join(variants.param_types(config.variant))
    return (f"void({inputs}, float32[:,:,:], float32[:,:,::1], {t}[:,:,:,::1], uint64[:,::1], float32, float32, "
            f"Tuple(({params}{',' if params else ''})))")


def run_dq(config, q, k, v, dout, lse, delta, scale, params, xp, monkeypatch):
    """dq (bits of the kernel's dtype: float16, or uint16 bfloat16 bits) from one launch, on a
    fresh NaN-filled buffer."""
    batch, seqlen_q, nheads, _ = q.shape
    dq = xp.full(q.shape, NAN_BITS[config.dtype], dtype=np.uint16)
    if config.dtype == "float16":
        dq = dq.view(np.float16)
    grid = config.grid(batch, nheads, k.shape[2], seqlen_q, k.shape[1])
    scalars = (np.float32(scale * math.log2(math.e)), np.float32(scale))
    if SIMULATOR:  # the kernel itself, its arrays wrapped as the launcher does
        maps = tensor_maps(config, q, k, v, dout)
        arrays = [launch._simulator_array(x) for x in (q, k, v, dout, lse, delta, dq, maps)]
        kernel = build_backward_dq_sm90(config)
        kernel[grid, config.threads, 0, config.dynamic_shared_bytes](*arrays, *scalars, params)
    else:  # through the launcher (sm_90a, the shared-memory limit raised), the kernel registered for the test
        monkeypatch.setitem(registry.KERNELS, Sm90DqConfig, (build_backward_dq_sm90, signature))
        monkeypatch.setitem(registry.HOST_ARGUMENTS, Sm90DqConfig,
                            lambda config, arrays: (*arrays, tensor_maps(config, *arrays[:4])))
        launch.compiled(config).launch(grid, (q, k, v, dout, lse, delta, dq), scalars, params)
    return to_numpy(dq).view(np.uint16)


def check(rng, xp, monkeypatch, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, causal, **config):
    """One problem through the kernel twice: bit-identical runs, and dq within the rule."""
    variant = Variant(window=True) if causal else Variant()
    cfg = Sm90DqConfig(dtype, headdim, variant, **config)
    q, k, v = random_qkv(rng, np, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype)
    dout = rng.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)
    scale = 1.0 / math.sqrt(headdim)
    # The forward's outputs: out in the inputs' dtype, lse float32 (natural log, -inf for rows
    # without keys), and the preprocess's D = rowsum(dout * out) in float32
    out, lse = attention_reference(q, k, v, scale, causal, return_lse=True)
    out = np.asarray(out).astype(q.dtype).astype(np.float32)
    lse = np.ascontiguousarray(np.asarray(lse, dtype=np.float32))
    delta = np.ascontiguousarray((dout.astype(np.float32) * out).sum(-1).transpose(0, 2, 1))
    params = ()
    if causal:
        left, right, _ = window_bounds(seqlen_q, seqlen_k, True, (-1, -1))
        params = (np.int32(left), np.int32(right))

    def device(x):
        return xp.asarray(x.view(np.uint16) if dtype == "bfloat16" else x)

    inputs = [device(x) for x in (q, k, v, dout)] + [xp.asarray(lse), xp.asarray(delta)]
    first = run_dq(cfg, *inputs, scale, params, xp, monkeypatch)
    again = run_dq(cfg, *inputs, scale, params, xp, monkeypatch)
    assert np.array_equal(first, again), "two runs differ: dq must be bit-identical run to run"

    dq = first.view(np.float16 if dtype == "float16" else q.dtype).astype(np.float64)
    assert not np.isnan(dq).any(), "dq has NaN (an element left unwritten, or a 0/0)"
    ref = to_numpy(attention_reference_backward(dout, q, k, v, scale, causal)[0])
    naive = to_numpy(attention_naive_backward(dout, q, k, v, scale, causal)[0]).astype(np.float64)
    error = np.abs(dq - ref).max()
    naive_error = np.abs(naive - ref).max()
    budget = 2 * naive_error + ERROR_FLOOR[dtype] * max(1.0, np.abs(ref).max())
    assert error <= budget, f"dq: max error {error:.3g} > budget {budget:.3g} (naive {naive_error:.3g})"
    no_key = np.isneginf(lse).transpose(0, 2, 1)  # (batch, seqlen_q, nheads): rows that see no key
    assert (dq[no_key] == 0).all(), "rows that see no key must get dq = 0"
    return dq, no_key


def test_config():
    cfg = Sm90DqConfig("float16", 128)
    assert (cfg.kernel, cfg.atomic_dq, cfg.block_m, cfg.block_n, cfg.threads) == ("dq", False, 128, 128, 384)
    assert cfg.grid(2, 8, 2, 1000, 3000) == (8, 8, 2)
    assert cfg.dynamic_shared_bytes <= 227 * 1024
    # the score features, the element masks and dropout (with the window or not)
    for variant in (Variant(softcap=True, alibi=True), Variant(window=True, bias="float16"), Variant(mask=True),
                    Variant(window=True, mask_mod="g:0"), Variant(dropout=True), Variant(score_mod="f:0"),
                    Variant(varlen=True, window=True), Variant(mask_mod="g:0", block_mask=True)):
        assert Sm90DqConfig("bfloat16", 96, variant).variant == variant
    for bad in (dict(headdim=60), dict(headdim=256), dict(dtype="float32"), dict(stages=1),
                dict(stages=3)):  # stages=3: 256 KiB of tiles at headdim 128
        with pytest.raises(ValueError):
            Sm90DqConfig(**{"dtype": "float16", "headdim": 128, **bad})
    # past headdim 128 with smaller key tiles: S, dP, dS and dQ within a consumer's registers
    assert Sm90DqConfig("float16", 256, block_n=32).dynamic_shared_bytes <= 227 * 1024
    assert Sm90DqConfig("float16", 192, block_n=64).dynamic_shared_bytes <= 227 * 1024
    for bad in (dict(headdim=264, block_n=32), dict(headdim=256, block_n=128), dict(headdim=200, block_n=96)):
        with pytest.raises(ValueError):
            Sm90DqConfig(**{"dtype": "float16", **bad})
    with pytest.raises(ValueError, match="shared memory"):  # the registers fit, the tiles do not
        Sm90DqConfig("float16", 256, block_n=64)


# ---- Simulator: tiny shapes ------------------------------------------------------------------


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")
def test_dq_sm90_small(rng, xp, monkeypatch):
    """One query block of two consumers (the second's rows partly past seqlen_q), two key tiles (the
    second a tail), GQA with two query heads on one kv head."""
    check(rng, xp, monkeypatch, 1, 70, 150, 2, 1, 64, "float16", False)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")
def test_dq_sm90_causal_ring_and_rows_without_keys(rng, xp, monkeypatch):
    """Causal with seqlen_q > seqlen_k: the first rows see no key (dq = 0; the first query block sees
    none at all and copies nothing), three key tiles through a ring of two stages (a slot refilled),
    the diagonal's masked tiles and the unmasked ones before it, headdim 72 padded to two chunks,
    bfloat16. One consumer (block_m 64) and 64-key tiles to keep the simulator quick."""
    dq, no_key = check(rng, xp, monkeypatch, 1, 230, 166, 1, 1, 72, "bfloat16", True, consumers=1, block_n=64)
    assert no_key[:, :64].all() and not no_key[:, 64:].any()


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")
def test_dq_sm90_causal_two_consumers(rng, xp, monkeypatch):
    """Causal, two consumers, seqlen_q < seqlen_k (every row sees keys), a ring of small tiles that
    wraps (block_n 64: 4 tiles through 2 stages), float16."""
    check(rng, xp, monkeypatch, 1, 90, 230, 1, 1, 64, "float16", True, block_n=64)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")
def test_dq_sm90_wide_small(rng, xp, monkeypatch):
    """Past headdim 128: headdim 200 padded to 256 (dQ's wgmma N = 256), 32-key tiles (three through
    a ring of two), causal with a tail, two consumers (the second's rows past seqlen_q)."""
    check(rng, xp, monkeypatch, 1, 70, 80, 1, 1, 200, "float16", True, block_n=32)


# ---- GPU -----------------------------------------------------------------------------------

GPU_SHAPES = [(2, 113, 203, 4, 2), (1, 1023, 1024, 4, 1), (2, 300, 257, 2, 2), (1, 2048, 2048, 2, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", [64, 72, 96, 128, 136, 192, 256])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dq_sm90_gpu(rng, xp, monkeypatch, shape, headdim, causal, dtype):
    """Past headdim 128 with the planner's key tiles (configs.SM90_DQ)."""
    check(rng, xp, monkeypatch, *shape, headdim, dtype, causal, block_n=configs._row(configs.SM90_DQ, headdim)[1])


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim, keys", [(160, 80), (192, 80), (200, 48), (256, 48)])
@pytest.mark.parametrize("shape", GPU_SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_dq_sm90_key_tile_options_gpu(rng, xp, monkeypatch, shape, headdim, keys, causal):
    """The largest key tiles two stages of which fit shared memory past headdim 128 (an option that
    scripts/gpu_check.sh dq-keys times against the planned ones; docs/perf-notes.md step 48)."""
    check(rng, xp, monkeypatch, *shape, headdim, "float16", causal, block_n=keys)
