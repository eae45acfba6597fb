"""flash-attn's packed entry points (nbflash/packed.py): the same results as the unpacked calls on
views of the packed array, against float64, with flash-attn's positional order; the packed
gradients; bad packings named; nbflash.torch's versions (their signatures anywhere, their
gradients on the GPU)."""

import inspect

import numpy as np
import pytest

import nbflash
from nbflash import packed

from .conftest import SIMULATOR
from .helpers import assert_attention_close, small_tiles, to_numpy
from .test_backward import assert_gradients_close
from .test_varlen import LENGTHS_Q, assert_varlen_backward, assert_varlen_forward, offsets

# flash-attn 2.8's signatures, argument for argument
FLASH_ATTN_SIGNATURES = {
    "flash_attn_qkvpacked_func": ["qkv", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                                  "alibi_slopes", "deterministic", "return_attn_probs"],
    "flash_attn_kvpacked_func": ["q", "kv", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                                 "alibi_slopes", "deterministic", "return_attn_probs"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen", "dropout_p", "softmax_scale", "causal",
                                         "window_size", "softcap", "alibi_slopes", "deterministic",
                                         "return_attn_probs"],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                        "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                                        "alibi_slopes", "deterministic", "return_attn_probs"],
}


def random(rng, xp, shape, dtype):
    return xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(nbflash.dtypes.SUPPORTED[dtype]))


@pytest.fixture(autouse=True)
def simulator_tiles():
    """In the simulator, tiles of 8-16 rows (helpers.small_tiles): these tests check that the packed
    API gives the views' bits, which tile sizes do not change, and the emulation of small blocks is
    several times faster."""
    if SIMULATOR:
        with small_tiles():
            yield
    else:
        yield


@pytest.mark.parametrize("module", ["nbflash", "nbflash.torch"])
def test_signatures_are_flash_attns(module):
    if module == "nbflash.torch":
        pytest.importorskip("torch")
    functions = __import__(module, fromlist=["_"])
    for name, expected in FLASH_ATTN_SIGNATURES.items():
        parameters = inspect.signature(getattr(functions, name)).parameters
        positional = [p for p, v in parameters.items() if v.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert positional == expected, name
        assert parameters["window_size"].default == (-1, -1) and parameters["dropout_p"].default == 0.0


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_qkvpacked_matches_the_views(rng, xp, dtype):
    """qkv (batch, seqlen, 3, nheads, headdim), flash-attn's positional order: the same bits as
    flash_attn_func on the views, and float64's answer; the packed gradient is the three
    gradients stacked."""
    qkv = random(rng, xp, (2, 21, 3, 2, 16), dtype)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out, lse = nbflash.flash_attn_qkvpacked_func(qkv, 0.0, 0.3, True, (-1, -1), 0.0, None, True, return_lse=True)
    ref_out, ref_lse = nbflash.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, return_lse=True)
    assert np.array_equal(to_numpy(out), to_numpy(ref_out)) and np.array_equal(to_numpy(lse), to_numpy(ref_lse))
    assert_attention_close(out, lse, q, k, v, True, softmax_scale=0.3)

    dout = random(rng, xp, out.shape, dtype)
    dqkv = nbflash.flash_attn_qkvpacked_backward(dout, qkv, out, lse, 0.0, 0.3, True, deterministic=True)
    assert dqkv.shape == qkv.shape and dqkv.dtype == qkv.dtype
    grads = nbflash.flash_attn_backward(dout, q, k, v, out, lse, 0.0, 0.3, True, deterministic=True)
    for i, g in enumerate(grads):
        assert np.array_equal(to_numpy(dqkv)[:, :, i], to_numpy(g))
    assert_gradients_close(grads, dout, q, k, v, True, softmax_scale=0.3)


def test_kvpacked_matches_the_views(rng, xp):
    """kv (batch, seqlen_k, 2, nheads_k, headdim) under GQA 2:1, a window given positionally."""
    q = random(rng, xp, (1, 29, 4, 32), "float16")
    kv = random(rng, xp, (1, 41, 2, 2, 32), "float16")
    k, v = kv[:, :, 0], kv[:, :, 1]
    # one packed call (positional) serves both checks: a second, by keyword, ran the same kernel on
    # the same inputs (return_lse only picks what is returned)
    out, lse = nbflash.flash_attn_kvpacked_func(q, kv, 0.0, None, False, (8, 3), return_lse=True)
    assert np.array_equal(to_numpy(out), to_numpy(nbflash.flash_attn_func(q, k, v, window_size=(8, 3))))
    assert_attention_close(out, lse, q, k, v, False, window_size=(8, 3))
    dout = random(rng, xp, out.shape, "float16")
    dq, dkv = nbflash.flash_attn_kvpacked_backward(dout, q, kv, out, lse, window_size=(8, 3), deterministic=True)
    assert dkv.shape == kv.shape
    assert_gradients_close((dq, dkv[:, :, 0], dkv[:, :, 1]), dout, q, k, v, False, window_size=(8, 3))


def test_varlen_packed_match_the_views(rng, xp):
    """qkv (total, 3, nheads, headdim) with one set of offsets (an empty sequence among them), and
    q with kv (total_k, 2, nheads_k, headdim) under GQA; gradients packed the same way."""
    cu = offsets(LENGTHS_Q, xp)
    total, longest = sum(LENGTHS_Q), max(LENGTHS_Q)
    qkv = random(rng, xp, (total, 3, 2, 16), "float32")
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    out, lse = nbflash.flash_attn_varlen_qkvpacked_func(qkv, cu, longest, 0.0, None, True, return_lse=True)
    assert_varlen_forward(out, lse, q, k, v, cu, cu, True)
    dout = random(rng, xp, out.shape, "float32")
    dqkv = nbflash.flash_attn_varlen_qkvpacked_backward(dout, qkv, out, lse, cu, longest, causal=True)
    assert dqkv.shape == qkv.shape
    assert_varlen_backward((dqkv[:, 0], dqkv[:, 1], dqkv[:, 2]), dout, q, k, v, cu, cu, True)

    kv = random(rng, xp, (total, 2, 1, 16), "float32")
    out, lse = nbflash.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, longest, longest, return_lse=True)
    ref_out = nbflash.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu, cu, longest, longest)
    assert np.array_equal(to_numpy(out), to_numpy(ref_out))
    dq, dkv = nbflash.flash_attn_varlen_kvpacked_backward(dout, q, kv, out, lse, cu, cu, longest, longest)
    assert dq.shape == q.shape and dkv.shape == kv.shape
    assert_varlen_backward((dq, dkv[:, 0], dkv[:, 1]), dout, q, kv[:, 0], kv[:, 1], cu, cu, False)


def test_bad_packings_are_named(xp):
    qkv = xp.zeros((1, 8, 3, 2, 16), np.float16)
    with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seqlen, 3, nheads, headdim\), got \(1, 8, 2"):
        nbflash.flash_attn_qkvpacked_func(qkv[:, :, :2])
    with pytest.raises(ValueError, match=r"kv must have shape \(batch, seqlen_k, 2, nheads_k, headdim\)"):
        nbflash.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 0])
    with pytest.raises(ValueError, match=r"qkv must have shape \(total, 3, nheads, headdim\)"):
        nbflash.flash_attn_varlen_qkvpacked_func(qkv, xp.zeros(2, np.int32), 8)
    with pytest.raises(TypeError, match="qkv must be an array of shape"):
        nbflash.flash_attn_qkvpacked_func([[1.0]])
    with pytest.raises(TypeError, match="unexpected keyword argument 'causl'"):
        nbflash.flash_attn_qkvpacked_func(qkv, causl=True)


def test_unpack_makes_views_not_copies(xp):
    qkv = xp.zeros((1, 4, 3, 2, 8), np.float32)
    q, k, v = packed.unpack(qkv, "qkv", packed.QKV)
    v[0, 0, 0, 0] = 1
    assert float(qkv[0, 0, 2, 0, 0]) == 1


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="nbflash.torch runs on CUDA tensors")
@pytest.mark.parametrize("causal", [False, True])
def test_torch_packed_gradients_match_the_unpacked(causal):
    """nbflash.torch's qkv-packed and kv-packed functions: autograd's packed gradient equals the
    unpacked call's three gradients stacked."""
    torch = pytest.importorskip("torch")
    import nbflash.torch as nt

    generator = torch.Generator(device="cuda").manual_seed(7)
    qkv = torch.randn(2, 203, 3, 4, 64, device="cuda", dtype=torch.float16, generator=generator, requires_grad=True)
    dout = torch.randn(2, 203, 4, 64, device="cuda", dtype=torch.float16, generator=generator)
    nt.flash_attn_qkvpacked_func(qkv, 0.0, None, causal, deterministic=True).backward(dout)
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    nt.flash_attn_func(q, k, v, causal=causal, deterministic=True).backward(dout)
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=2))

    q = q.detach().requires_grad_()
    kv = qkv.detach()[:, :, 1:].clone().requires_grad_()
    nt.flash_attn_kvpacked_func(q, kv, causal=causal, deterministic=True).backward(dout)
    assert torch.equal(kv.grad, torch.stack([k.grad, v.grad], dim=2)) and torch.equal(q.grad, qkv.grad[:, :, 0])
