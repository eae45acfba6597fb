"""Forward pass against float64: dtypes, causal, GQA/MQA, head dims, awkward lengths, layouts.

In the simulator the cases are few and small; with a GPU (`pytest -m gpu`) the full grid runs.
"""


import numpy as np
import pytest

import nbflash

from .conftest import SIMULATOR
from .helpers import assert_attention_close, is_sm90, poison_allocations, random_qkv

DTYPES = ["float32", "float16", "bfloat16"]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every buffer the library allocates starts as NaN, so an unwritten (or unzeroed) element shows."""
    poison_allocations(monkeypatch)


def run_case(rng, xp, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, causal, heads_first=False, family=None):
    q, k, v = random_qkv(rng, xp, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, heads_first)
    if family is None:
        out, lse = nbflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    else:
        with nbflash.kernel_family(family):
            assert nbflash.explain(q, k, v, causal=causal)["family"] == nbflash.configs.canonical_family(family)
            out, lse = nbflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert lse.shape == (batch, nheads, seqlen_q)
    assert_attention_close(out, lse, q, k, v, causal)


# ---- Simulator: small shapes, every feature touched once -------------------------------------

SMALL_CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim
    (1, 13, 29, 2, 1, 16),  # MQA, seqlen_q < seqlen_k
    (2, 29, 13, 2, 2, 8),  # seqlen_q > seqlen_k: under causal the first rows see no key
    (1, 1, 1, 1, 1, 5),
    (1, 40, 40, 3, 1, 40),
]


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SMALL_CASES, ids=lambda s: "x".join(map(str, s)))
def test_forward_small_portable(rng, xp, shape, causal, dtype):
    run_case(rng, xp, *shape, dtype, causal, family="portable")


# The tensor-core kernel is slow to emulate (every warp-level primitive is a 32-thread rendezvous):
# fewer cases, chosen to touch MQA, tails, rows without keys and an unaligned headdim.
@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [SMALL_CASES[0], SMALL_CASES[1]], ids=lambda s: "x".join(map(str, s)))
def test_forward_small_mma(rng, xp, shape, causal, dtype):
    run_case(rng, xp, *shape, dtype, causal, family="mma")


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the full grid below")
@pytest.mark.parametrize("family", ["portable", "mma"])
@pytest.mark.parametrize("headdim", [59, 96, 256])
def test_forward_small_headdims(rng, xp, headdim, family):
    run_case(rng, xp, 1, 9, 17, 1, 1, headdim, "float16", True, family=family)


def test_families_are_named_by_architecture_and_mma_is_an_alias(rng, xp):
    """'sm80' names the mma.sync family; 'mma', its first name, forces the same kernels everywhere
    a family is named (the forward, the backward, the prebuild list); explain() says 'sm80'."""
    from nbflash import configs, prebuild
    from nbflash.problem import Static

    assert configs.FAMILIES == ("sm90", "sm80", "portable") and configs.canonical_family("mma") == "sm80"
    static = Static("float16", 64, True, 0)
    assert configs.plan_forward(static, "mma") == configs.plan_forward(static, "sm80")
    assert configs.plan_backward(static, True, "mma") == configs.plan_backward(static, True, "sm80")
    assert (prebuild.configurations(["float16"], [64], ["mma"], (8, 0))
            == prebuild.configurations(["float16"], [64], ["sm80"], (8, 0)))
    q, k, v = random_qkv(rng, xp, 1, 4, 4, 1, 1, 8, "float16")
    for name in ("mma", "sm80"):
        with nbflash.kernel_family(name):
            assert configs.forced_family() == "sm80" and nbflash.explain(q, k, v)["family"] == "sm80"
    with pytest.raises(ValueError, match="not a kernel family.*'sm80'.*alias 'mma'"):
        nbflash.kernel_family("sm70")


def test_default_family_is_mma_for_16_bit(rng, xp):
    q, k, v = random_qkv(rng, xp, 1, 4, 4, 1, 1, 8, "bfloat16")
    assert nbflash.explain(q, k, v)["family"] == "sm80"
    q, k, v = random_qkv(rng, xp, 1, 4, 4, 1, 1, 8, "float32")
    assert nbflash.explain(q, k, v)["family"] == "portable"


def test_forward_transposed_view(rng, xp):
    """A (batch, nheads, seqlen, headdim) tensor passed as a transposed view, without a copy."""
    run_case(rng, xp, 1, 17, 11, 2, 1, 8, "float32", True, heads_first=True)


def test_forward_softmax_scale(rng, xp):
    q, k, v = random_qkv(rng, xp, 1, 7, 9, 1, 1, 8, "float32")
    out = nbflash.flash_attn_func(q, k, v, softmax_scale=0.37)
    assert_attention_close(out, None, q, k, v, False, softmax_scale=0.37)


@pytest.mark.parametrize("family, dtype", [("portable", "float32"), ("mma", "float16")])
@pytest.mark.parametrize("softmax_scale", [0.0, -0.5])
def test_forward_scale_zero_or_negative(rng, xp, softmax_scale, family, dtype):
    """A scale of 0 (uniform weights over the visible keys) or below 0 (the least similar key
    weighs most), with the causal mask and a sequence tail: the tensor-core kernel once folded the
    scale into exp2 after the max and returned NaN (scale 0) or garbage (scale < 0)."""
    q, k, v = random_qkv(rng, xp, 1, 13, 21, 1, 1, 16, dtype)
    with nbflash.kernel_family(family):
        out, lse = nbflash.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=True, return_lse=True)
    assert_attention_close(out, lse, q, k, v, True, softmax_scale=softmax_scale)


def test_forward_causal_rows_without_keys_are_zero(rng, xp):
    """seqlen_q > seqlen_k, causal: the first seqlen_q - seqlen_k rows see nothing: 0, lse -inf."""
    q, k, v = random_qkv(rng, xp, 1, 12, 4, 1, 1, 8, "float16")
    out, lse = nbflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    out, lse = (x.get() if hasattr(x, "get") else x for x in (out, lse))
    assert (out[:, :8] == 0).all() and np.isneginf(lse[:, :, :8]).all()
    assert np.isfinite(lse[:, :, 8:]).all()


# ---- GPU: the full grid ---------------------------------------------------------------------

SEQLENS = [(1, 1), (113, 203), (203, 113), (1023, 1024), (1024, 1023), (128, 2048), (2048, 2048)]
HEADDIMS = [40, 59, 64, 96, 128, 256]
HEADS = [(4, 4), (6, 2), (4, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "family, dtype", [("mma", "float16"), ("mma", "bfloat16")] + [("portable", d) for d in DTYPES]
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", HEADDIMS)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_forward_gpu(rng, xp, seqlens, headdim, causal, family, dtype):
    # Cycle the head layouts through the grid instead of multiplying it by three.
    nheads, nheads_k = HEADS[(SEQLENS.index(seqlens) + HEADDIMS.index(headdim)) % len(HEADS)]
    heads_first = headdim in (59, 128)
    run_case(rng, xp, 2, *seqlens, nheads, nheads_k, headdim, dtype, causal, heads_first, family)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", [16, 64, 128])
def test_forward_gpu_unaligned_rows_mma(rng, xp, headdim):
    """Rows that do not start on 16-byte boundaries take the tensor-core kernel's element-wise path."""
    q, k, v = random_qkv(rng, xp, 1, 300, 300, 2, 2, headdim + 1, "float16")
    q, k, v = (x[..., 1:] for x in (q, k, v))
    with nbflash.kernel_family("mma"):
        assert not nbflash.explain(q, k, v)["config"]["aligned"]
        out = nbflash.flash_attn_func(q, k, v, causal=True)
    assert_attention_close(out, None, q, k, v, True)


@pytest.mark.gpu
def test_forward_gpu_torch_tensor_without_copy():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(2, 100, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = nbflash.flash_attn_func(q, k, v, causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2).float() for x in (q, k, v)), is_causal=True
    ).transpose(1, 2)
    got = torch.from_dlpack(out).float()
    assert (got - expected).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_forward_gpu_on_current_stream(rng, xp):
    """The kernel is queued on CuPy's current stream: results are ready after that stream syncs."""
    import cupy

    q, k, v = random_qkv(rng, xp, 2, 512, 512, 4, 4, 64, "float16")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = nbflash.flash_attn_func(q, k, v)
    stream.synchronize()
    assert_attention_close(out, None, q, k, v, False)




def test_explain_reports_the_backward(rng, xp):
    """explain() says which kernels the backward would run, by default and deterministic, and
    follows a forced family (planned, not compiled)."""
    q, k, v = random_qkv(rng, xp, 1, 8, 8, 2, 1, 64, "float16")
    with nbflash.kernel_family("mma"):  # the default on a GPU of compute capability 8.x, and in the simulator
        backward = nbflash.explain(q, k, v, causal=True)["backward"]
    assert backward["default"] == ["portable backward preprocess (float16, headdim 64)",
                                   "tensor-core backward dK/dV (float16, headdim 64, causal/window)",
                                   "portable backward dQ conversion (float16, headdim 64)"]
    assert backward["deterministic"][1:] == ["tensor-core backward dK/dV (float16, headdim 64, causal/window, "
                                             "deterministic)",
                                             "tensor-core backward dQ (float16, headdim 64, causal/window, "
                                             "deterministic)"]
    if SIMULATOR or is_sm90():  # the sm90 family exists there only
        with nbflash.kernel_family("sm90"):
            backward = nbflash.explain(q, k, v, causal=True)["backward"]
        # on a GPU 128 queries a step at headdim 64 (configs.SM90_BACKWARD_KEYS128; the simulator keeps
        # block_m 64), the staged dQ added by warp 2 (configs.SM90_BACKWARD_DQ_WARP)
        steps = "" if SIMULATOR else ", 128 queries a step, dQ by warp 2, stats ahead"
        assert backward["default"][1] == f"Hopper backward dK/dV (float16, headdim 64, causal/window{steps})"
        assert backward["deterministic"][2] == "Hopper backward dQ (float16, headdim 64, causal/window, deterministic)"
