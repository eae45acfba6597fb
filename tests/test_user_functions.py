"""User score_mod / mask_mod functions (FlexAttention's conventions) compiled into every kernel,
against the float64 reference that applies the same functions element by element."""

import numpy as np
import pytest

import nbflash
from nbflash import configs, validation
from nbflash.backward import flash_attn_backward
from nbflash.kernels.backward_sm90 import Sm90BackwardConfig
from nbflash.kernels.variants import user_function

from .conftest import SIMULATOR
from .helpers import assert_attention_close, is_sm90, poison_allocations, random_qkv, small_tiles
from .test_backward import assert_gradients_close, random_like, reference_forward

TABLE = np.linspace(-1.0, 1.0, 32).astype(np.float32)  # captured: a kernel constant


def relative_bias(score, b, h, q_idx, kv_idx):
    return score * 0.5 + TABLE[(q_idx - kv_idx) % 32] * (h + 1)


def relative_bias_grad(score, b, h, q_idx, kv_idx):
    return 0.5


def striped(b, h, q_idx, kv_idx):
    return (q_idx + kv_idx + b) % 5 != 0


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    poison_allocations(monkeypatch)


def check(rng, xp, family, dtype, backward, shape=(1, 9, 12, 2, 1, 8)):
    q, k, v = random_qkv(rng, xp, *shape, dtype)
    user = dict(score_mod=relative_bias, mask_mod=striped)
    with nbflash.kernel_family(family):
        out, lse = nbflash.flash_attn_func(q, k, v, causal=True, return_lse=True, **user)
    assert_attention_close(out, lse, q, k, v, True, **user)
    if backward:
        dout = random_like(rng, xp, q)
        with nbflash.kernel_family(family):
            grads = flash_attn_backward(dout, q, k, v, out, lse, causal=True, score_mod_grad=relative_bias_grad, **user)
        assert_gradients_close(grads, dout, q, k, v, True, score_mod_grad=relative_bias_grad, **user)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")
def test_user_functions_portable(rng, xp):
    """On small tiles (helpers.small_tiles: 9 queries span two 8-row tiles of the forward and the dQ
    kernel, 12 keys two 8-key tiles of the dK/dV kernel, so the functions see each tile's own rows
    and keys; default tiles, one of each, emulated several times as long)."""
    with small_tiles():
        check(rng, xp, "portable", "float32", backward=True)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")
def test_user_functions_mma_forward(rng, xp):
    check(rng, xp, "mma", "float16", backward=False, shape=(1, 9, 17, 1, 1, 16))


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")
def test_user_functions_sm90_backward(rng, xp):
    """The sm90 backward: score_mod and its derivative at the score point of S^T, mask_mod at the
    mask point of every visited tile (none is whole with an element mask); GQA 2:1. From the float64
    reference's out and lse: the sm90 forward through these functions runs in
    tests/test_forward_sm90.py's test_score_mod_mask_mod_causal (GQA 2:1 too)."""
    q, k, v = random_qkv(rng, xp, 1, 40, 60, 2, 1, 64, "float16")
    user = dict(score_mod=relative_bias, mask_mod=striped)
    problem = validation.check_forward(q, k, v, None, True, score_mod_grad=relative_bias_grad, **user)[0]
    assert isinstance(configs.plan_backward(problem.static, False, "sm90")[1], Sm90BackwardConfig)
    out, lse = reference_forward(xp, q, k, v, None, True, **user)
    dout = random_like(rng, xp, q)
    with nbflash.kernel_family("sm90"):
        grads = flash_attn_backward(dout, q, k, v, out, lse, causal=True, score_mod_grad=relative_bias_grad, **user)
    assert_gradients_close(grads, dout, q, k, v, True, score_mod_grad=relative_bias_grad, **user)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs the grid below")
def test_mask_mod_without_window_mma(rng, xp):
    """Without a window, every row sees a whole 64-key tile by the band alone: the tensor-core
    forward must still test the mask there (it once skipped it, trusting the band)."""
    q, k, v = random_qkv(rng, xp, 1, 9, 70, 1, 1, 16, "float16")
    with nbflash.kernel_family("mma"):
        out, lse = nbflash.flash_attn_func(q, k, v, mask_mod=striped, return_lse=True)
    assert_attention_close(out, lse, q, k, v, False, mask_mod=striped)


@pytest.mark.gpu
@pytest.mark.parametrize("family, dtype", [("mma", "float16"), ("mma", "bfloat16"), ("portable", "float32"),
                                           ("sm90", "float16"), ("sm90", "bfloat16")])
@pytest.mark.parametrize("shape", [(2, 113, 203, 4, 2, 64), (1, 300, 300, 2, 1, 128)], ids=lambda s: "x".join(map(str, s)))
def test_user_functions_gpu(rng, xp, family, dtype, shape):
    if family == "sm90" and not is_sm90():
        pytest.skip("the sm90 family needs compute capability 9.0")
    check(rng, xp, family, dtype, backward=True, shape=shape)


def test_backward_needs_the_derivative(rng, xp):
    q, k, v = random_qkv(rng, xp, 1, 4, 4, 1, 1, 8, "float32")
    with nbflash.kernel_family("portable"):
        out, lse = nbflash.flash_attn_func(q, k, v, score_mod=relative_bias, return_lse=True)
    with pytest.raises(ValueError, match="score_mod's backward needs its derivative"):
        flash_attn_backward(q, q, k, v, out, lse, score_mod=relative_bias)


def test_fingerprint_follows_code_and_captured_values():
    def shifted(offset):
        return lambda score, b, h, i, j: score + offset

    one, also_one, two = shifted(1.0), shifted(1.0), shifted(2.0)
    assert user_function(one, "score_mod") == user_function(also_one, "score_mod")
    assert user_function(one, "score_mod") != user_function(two, "score_mod")
    assert user_function(relative_bias, "score_mod") != user_function(relative_bias_grad, "score_mod")


def test_captured_gpu_array_is_refused(rng, xp):
    class DeviceArray:  # what a CuPy array or torch CUDA tensor looks like to the fingerprint
        __cuda_array_interface__ = {}

    table = DeviceArray()

    def reads_gpu(score, b, h, i, j):
        return score + table[i]

    q, k, v = random_qkv(rng, xp, 1, 4, 4, 1, 1, 8, "float32")
    with pytest.raises(TypeError, match="score_mod captures a GPU array"):
        nbflash.flash_attn_func(q, k, v, score_mod=reads_gpu)
    with pytest.raises(TypeError, match="mask_mod must be a Python function"):
        nbflash.flash_attn_func(q, k, v, mask_mod="causal")


@pytest.mark.gpu
def test_score_mod_that_does_not_compile(rng, xp):
    def uses_a_dict(score, b, h, i, j):
        return {"a": score}["a"] + 1j

    q, k, v = random_qkv(rng, xp, 1, 64, 64, 1, 1, 64, "float16")
    with pytest.raises(TypeError, match="could not be compiled into the kernel"):
        nbflash.flash_attn_func(q, k, v, score_mod=uses_a_dict)
