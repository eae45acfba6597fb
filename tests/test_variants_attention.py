"""The built-in variants (sliding windows, softcap, ALiBi, and them combined) forward and backward, on
both kernel families, against float64 under the twice-the-naive-error rule; the variants come from
nbflash.catalogue, which the benchmarks time too.

In the simulator (kept short for CI): the combinations on the portable kernels (each feature
appears in one), a bias and a mask on the tensor-core ones (slow to emulate). On a GPU: every
variant, the full grid.
"""

import numpy as np
import pytest

import nbflash
from nbflash.backward import flash_attn_backward
from nbflash.catalogue import VARIANTS, forward_arguments, variant_arguments

from .conftest import SIMULATOR
from .helpers import (assert_attention_close, poison_allocations, random_qkv, simulator_small_tiles, small_tiles,
                      to_numpy)
from .test_backward import assert_gradients_close, random_like, reference_forward

NAMES = [name for name in VARIANTS if name != "plain"]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    poison_allocations(monkeypatch)


def split(arguments):
    """(causal, the other variant arguments) of a catalogue entry."""
    arguments = dict(arguments)
    return arguments.pop("causal", False), arguments


def run_forward(rng, xp, name, family, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim):
    q, k, v = random_qkv(rng, xp, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype)
    causal, variant = split(variant_arguments(name, batch, nheads, seqlen_k, xp, seqlen_q))
    with nbflash.kernel_family(family):
        out, lse = nbflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, **forward_arguments(variant))
    assert_attention_close(out, lse, q, k, v, causal, **variant)
    return q, k, v, out, lse, causal, variant


def run_backward(rng, xp, name, family, dtype, *shape, deterministic=False, forward="kernel"):
    """The forward (``run_forward``), then the backward; ``forward="reference"``: from the float64
    reference's out and lse instead, no forward kernel run."""
    if forward == "reference":
        q, k, v = random_qkv(rng, xp, *shape, dtype)
        causal, variant = split(variant_arguments(name, shape[0], shape[3], shape[2], xp, shape[1]))
        out, lse = reference_forward(xp, q, k, v, None, causal, **variant)
    else:
        q, k, v, out, lse, causal, variant = run_forward(rng, xp, name, family, dtype, *shape)
    dout = random_like(rng, xp, q)
    with nbflash.kernel_family(family):
        grads = flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic, **variant)
    assert_gradients_close(grads, dout, q, k, v, causal, **variant)


SMALL = (1, 13, 21, 2, 1, 16)  # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim: GQA, tails
SIMULATED = ["window-both", "causal-bias", "document-mask", "combined"]  # combined: window, softcap, ALiBi


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
@pytest.mark.parametrize("name", SIMULATED)
def test_variant_portable_small(rng, xp, name):
    """On small tiles (helpers.small_tiles: 13 queries span two 8-row tiles of the forward and the
    dQ kernel, 21 keys three 8-key tiles of the dK/dV kernel, each tile's rows and keys at their
    own offsets; default tiles, one of each, emulated three times as long)."""
    with small_tiles():
        run_backward(rng, xp, name, "portable", "float32", *SMALL)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
@pytest.mark.parametrize("name", ["causal-bias", "document-mask", "document-mask-mod"])
def test_variant_mma_forward_small(rng, xp, name):
    run_forward(rng, xp, name, "mma", "float16", *SMALL)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
def test_variant_mma_backward_small(rng, xp):
    """The tensor-core backward through a mask tensor, from the float64 reference's out and lse (the
    tensor-core forward through it: test_variant_mma_forward_small[document-mask], same shape)."""
    run_backward(rng, xp, "document-mask", "mma", "bfloat16", 1, 13, 21, 2, 1, 16, forward="reference")


def test_bias_broadcasts_without_a_copy(rng, xp):
    """A (seqlen_k,) key bias and a (batch, 1, seqlen_q, seqlen_k) mask broadcast to the full
    shape: the kernel reads them with stride 0, and the answer is the reference's (in the simulator
    on small tiles: the strides, not the tiles, are checked)."""
    q, k, v = random_qkv(rng, xp, 2, 9, 12, 2, 1, 8, "float32")
    key_bias = xp.asarray(rng.standard_normal(12).astype(np.float32))
    keep = xp.asarray(rng.random((2, 1, 9, 12)) > 0.3)
    with simulator_small_tiles(), nbflash.kernel_family("portable"):
        for bias in (key_bias, keep):
            out, lse = nbflash.flash_attn_func(q, k, v, return_lse=True, bias=bias)
            assert_attention_close(out, lse, q, k, v, False, bias=bias)


# ---- GPU: every variant x family x pass, awkward lengths and head dims -----------------------

GPU_SHAPES = [(2, 113, 203, 4, 2, 40), (1, 203, 113, 6, 2, 59), (2, 1023, 1024, 4, 1, 64),
              (1, 512, 2048, 2, 2, 128), (1, 300, 300, 2, 1, 256)]


def gpu_grid():
    """(shape, name, family, dtype) of the GPU grid: every variant at every shape on both families.
    The tensor-core family takes float16 and bfloat16 in turn, by shape and variant, so that each
    variant meets both types and each shape both: the types differ in loads and conversions only,
    which the plain grids of test_forward.py and test_backward*.py cover at every headdim, and each
    tensor-core case compiles its own kernels (10-40 s each), most of this file's GPU time."""
    for i, shape in enumerate(GPU_SHAPES):
        for j, name in enumerate(NAMES):
            yield shape, name, "mma", ("float16", "bfloat16")[(i + j) % 2]
            yield shape, name, "portable", "float32"


@pytest.mark.gpu
@pytest.mark.parametrize("shape, name, family, dtype",
                         [pytest.param(*case, id="-".join(["x".join(map(str, case[0])), *case[1:]]))
                          for case in gpu_grid()])
def test_variant_gpu(rng, xp, shape, name, family, dtype):
    run_backward(rng, xp, name, family, dtype, *shape, deterministic=shape[1] == 113)


def test_window_skips_tiles_and_matches_an_explicit_mask(rng, xp):
    """A sliding window is exactly attention with the band as a mask (the reference builds it from
    the geometry; here it is written out), and causal=True is window_size=(-1, 0)."""
    q, k, v = random_qkv(rng, xp, 1, 30, 30, 1, 1, 8, "float32")
    with nbflash.kernel_family("portable"):
        windowed = to_numpy(nbflash.flash_attn_func(q, k, v, window_size=(4, 2)))
        causal = to_numpy(nbflash.flash_attn_func(q, k, v, causal=True))
        as_window = to_numpy(nbflash.flash_attn_func(q, k, v, window_size=(-1, 0)))
    assert np.array_equal(causal, as_window)
    qn, kn, vn = (to_numpy(x).astype(np.float64)[0, :, 0] for x in (q, k, v))
    i, j = np.arange(30)[:, None], np.arange(30)[None, :]
    s = np.where((j >= i - 4) & (j <= i + 2), qn @ kn.T / np.sqrt(8), -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    expected = (p / p.sum(axis=1, keepdims=True)) @ vn
    assert np.abs(windowed[0, :, 0] - expected).max() < 1e-5


def test_return_attn_probs(rng, xp):
    """(out, lse, S_dmask) as flash-attn returns them; S_dmask rows are the probabilities."""
    q, k, v = random_qkv(rng, xp, 1, 9, 12, 2, 1, 8, "float32")
    out, lse, probs = nbflash.flash_attn_func(q, k, v, causal=True, softcap=5.0, return_attn_probs=True)
    probs = to_numpy(probs)
    assert probs.shape == (1, 2, 9, 12) and probs.dtype == np.float32
    assert np.allclose(probs.sum(-1), 1, atol=1e-5) and (probs[..., 0, 4:] == 0).all()
    expected = np.einsum("bhij,bjhd->bihd", probs, to_numpy(v).astype(np.float32).repeat(2, axis=2))
    assert np.abs(to_numpy(out) - expected).max() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_padding_mask_with_a_window_gpu(rng, xp, deterministic):
    """What nbflash.hf passes for a padded batch: a bool (batch, 1, seqlen, seqlen) mask, left
    padding under a causal band, with the narrowest window holding it, (-1, 0); GQA, head dim 64."""
    batch, seqlen, nheads, nheads_k, headdim = 3, 77, 4, 2, 64
    q, k, v = random_qkv(rng, xp, batch, seqlen, seqlen, nheads, nheads_k, headdim, "float16")
    pads = [0, 5, 30]
    mask = np.tril(np.ones((seqlen, seqlen), bool))[None, None].repeat(batch, 0)
    for b, pad in enumerate(pads):
        mask[b, :, :, :pad] = False
    variant = {"bias": xp.asarray(mask), "window_size": (-1, 0)}
    out, lse = nbflash.flash_attn_func(q, k, v, return_lse=True, **variant)
    assert_attention_close(out, lse, q, k, v, False, **variant)
    dout = random_like(rng, xp, q)
    grads = flash_attn_backward(dout, q, k, v, out, lse, deterministic=deterministic, **variant)
    assert_gradients_close(grads, dout, q, k, v, False, **variant)
