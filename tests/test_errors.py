"""Bad input raises TypeError or ValueError naming the argument; never a crash or a wrong answer."""

import numpy as np
import pytest

import nbflash

from .conftest import SIMULATOR
from .helpers import random_qkv, simulator_small_tiles, to_numpy


@pytest.fixture
def qkv(rng, xp):
    return random_qkv(rng, xp, 2, 8, 6, 4, 2, 16, "float16")


def call(q, k, v, **kwargs):
    return nbflash.flash_attn_func(q, k, v, **kwargs)


def test_wrong_number_of_dims(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"q must have 4 dims \(batch, seqlen_q, nheads, headdim\)"):
        call(q[0], k, v)
    with pytest.raises(ValueError, match="k must have 4 dims"):
        call(q, k[None], v)


def test_batch_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="batch differs"):
        call(q, k[:1], v[:1])


def test_headdim_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="headdim differs"):
        call(q, k[..., :8], v[..., :8])


def test_dtype_mismatch(qkv, xp):
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"k.dtype=float32 differs from q.dtype=float16"):
        call(q, k.astype(xp.float32), v)
    with pytest.raises(TypeError, match=r"v.dtype=float32 differs"):
        call(q, k, v.astype(xp.float32))


def test_k_v_shapes_differ(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        call(q, k, v[:, :5])


def test_heads_not_divisible(rng, xp):
    q, k, v = random_qkv(rng, xp, 1, 8, 8, 5, 2, 16, "float16")
    with pytest.raises(ValueError, match=r"nheads=5 \(q.shape\[2\]\) must be a multiple of nheads_k=2"):
        call(q, k, v)


def test_headdim_too_large(rng, xp):
    q, k, v = random_qkv(rng, xp, 1, 2, 2, 1, 1, 257, "float16")
    with pytest.raises(ValueError, match="headdim=257 exceeds 256"):
        call(q, k, v)


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_zero_size_dims(qkv, dim):
    q, k, v = qkv
    index = [slice(None)] * 4
    index[dim] = slice(0, 0)
    with pytest.raises(ValueError, match="q has a zero-size dimension"):
        call(q[tuple(index)], k, v)


@pytest.mark.parametrize("dtype", ["int32", "float64", "int8", "complex64", "bool"])
def test_unsupported_dtypes(xp, dtype):
    q = xp.ones((1, 4, 1, 8), dtype=dtype)
    with pytest.raises(TypeError, match=f"q.dtype={dtype} is not supported"):
        call(q, q, q)


def test_last_dim_not_contiguous(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="q's last dim \\(headdim\\) must be contiguous"):
        call(q[..., ::2], k[..., :8], v[..., :8])


def test_not_an_array(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="k must be"):
        call(q, [[1.0]], v)


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_softmax_scale_not_finite(qkv, scale):
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        call(*qkv, softmax_scale=scale)


@pytest.mark.parametrize("scale", ["0.1", True, [0.1]])
def test_softmax_scale_wrong_type(qkv, scale):
    with pytest.raises(TypeError, match="softmax_scale must be a real number"):
        call(*qkv, softmax_scale=scale)


def test_causal_not_bool(qkv):
    with pytest.raises(TypeError, match="causal must be a bool"):
        call(*qkv, causal="yes")


@pytest.mark.skipif(not SIMULATOR, reason="simulator only")
def test_device_array_in_simulator_is_refused(qkv):
    class FakeGpuArray:
        __cuda_array_interface__ = {}

    q, k, v = qkv
    with pytest.raises(TypeError, match="v must be a NumPy array when running in Numba's CUDA simulator"):
        call(q, k, FakeGpuArray())


@pytest.mark.gpu
def test_host_array_on_gpu_is_refused(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"q is a NumPy \(host\) array.*cupy.asarray\(q\)"):
        call(q.get(), k, v)


@pytest.mark.gpu
def test_host_torch_tensor_on_gpu_is_refused(qkv):
    torch = pytest.importorskip("torch")
    q, k, v = qkv
    with pytest.raises(TypeError, match="k lives in host memory"):
        call(q, torch.zeros(tuple(k.shape), dtype=torch.float16), v)


@pytest.mark.gpu
def test_arrays_on_different_devices(qkv):
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    q, k, v = qkv
    with cupy.cuda.Device(1):
        k1 = cupy.asarray(k)
    with pytest.raises(ValueError, match="must be on one GPU"):
        call(q, k1, v)




def test_too_many_heads_for_one_launch(xp):
    q = xp.ones((1, 1, 65536, 1), dtype=xp.float32)
    with pytest.raises(ValueError, match="nheads=65536 must each be at most 65535"):
        call(q, q, q)


# ---- Repeated calls skip the checks only when the verdict would be the same ------------------


def test_repeated_call_reuses_the_checked_problem(xp):
    from nbflash import validation

    q = xp.zeros((1, 8, 2, 16), np.float32)
    first, *_ = validation.check_forward(q, q, q, None, True)
    again, *_ = validation.check_forward(xp.zeros((1, 8, 2, 16), np.float32), q, q, None, True)
    assert again is first
    other_scale, *_ = validation.check_forward(q, q, q, 0.5, True)
    not_causal, *_ = validation.check_forward(q, q, q, None, False)
    assert other_scale.softmax_scale == 0.5 and not not_causal.causal
    # A view whose rows start off a 16-byte boundary: same shape, so only the alignment tells.
    wide = xp.zeros((1, 8, 2, 17), np.float32)[..., 1:]
    assert wide.shape == q.shape and not validation.check_forward(wide, wide, wide, None, True)[0].aligned


def test_repeated_bad_call_still_raises(xp):
    q = xp.zeros((1, 8, 2, 16), np.float32)
    for _ in range(2):
        with pytest.raises(ValueError, match="softmax_scale must be finite"):
            nbflash.flash_attn_func(q, q, q, softmax_scale=float("nan"))
        with pytest.raises(TypeError, match="causal must be a bool"):
            nbflash.flash_attn_func(q, q, q, causal=1)


# ---- The variant arguments (flash-attn 2.8's signature) --------------------------------------


@pytest.mark.parametrize("window", [5, (1, 2, 3), (1.0, 2), ("a", 1), (True, 0), None])
def test_window_size_not_a_pair_of_ints(qkv, window):
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        call(*qkv, window_size=window)


def test_window_size_below_minus_one(qkv):
    with pytest.raises(ValueError, match=r"window_size=\(-2, 0\): each side must be -1"):
        call(*qkv, window_size=(-2, 0))


@pytest.mark.parametrize("softcap, error", [(-1.0, ValueError), (float("inf"), ValueError), ("30", TypeError),
                                            (True, TypeError)])
def test_softcap_out_of_range(qkv, softcap, error):
    with pytest.raises(error, match="softcap must be"):
        call(*qkv, softcap=softcap)


def test_alibi_slopes_wrong_shape_dtype_or_host(qkv, xp):
    q, k, v = qkv  # batch 2, nheads 4
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(nheads,\) = \(4,\)"):
        call(q, k, v, alibi_slopes=xp.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"or \(batch, nheads\) = \(2, 4\)"):
        call(q, k, v, alibi_slopes=xp.ones((4, 2), np.float32))
    with pytest.raises(TypeError, match="alibi_slopes.dtype=float64 must be float32"):
        call(q, k, v, alibi_slopes=xp.ones(4, np.float64))
    if not SIMULATOR:
        with pytest.raises(TypeError, match="alibi_slopes is a NumPy"):
            call(q, k, v, alibi_slopes=np.ones(4, np.float32))


@pytest.mark.parametrize("dropout_p, error", [(1.0, ValueError), (-0.1, ValueError), ("0", TypeError)])
def test_dropout_p_out_of_range(qkv, dropout_p, error):
    with pytest.raises(error, match="dropout_p must be"):
        call(*qkv, dropout_p=dropout_p)


def test_flash_attn_positional_order(rng, xp):
    """flash-attn users pass dropout_p fourth: nbflash once took it for the softmax scale. (The
    argument order, not the kernels: in the simulator on small tiles, many times faster to emulate;
    on default tiles the dropout forward made this 28 s of CI.)"""
    q, k, v = random_qkv(rng, xp, 1, 4, 6, 1, 1, 4, "float32")
    with simulator_small_tiles():
        out = nbflash.flash_attn_func(q, k, v, 0.0, 0.5, True)
        assert np.array_equal(to_numpy(out),
                              to_numpy(nbflash.flash_attn_func(q, k, v, softmax_scale=0.5, causal=True)))
        dropped = nbflash.flash_attn_func(q, k, v, 0.1, None, True, seed=5)
        assert not np.array_equal(to_numpy(dropped), to_numpy(nbflash.flash_attn_func(q, k, v, causal=True)))


@pytest.mark.parametrize("name", ["deterministic", "return_attn_probs", "return_lse"])
def test_flags_must_be_bool(qkv, name):
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        call(*qkv, **{name: "yes"})


def test_bias_wrong_dtype_or_shape(qkv, xp):
    q, k, v = qkv  # batch 2, seqlen_q 8, seqlen_k 6, nheads 4, float16
    with pytest.raises(TypeError, match="an additive bias is float32 or q's dtype"):
        call(q, k, v, bias=xp.zeros((8, 6), np.float64))
    with pytest.raises(ValueError, match=r"does not broadcast to \(batch, nheads, seqlen_q, seqlen_k\) = \(2, 4, 8, 6\)"):
        call(q, k, v, bias=xp.zeros((3, 8, 6), np.float32))
    with pytest.raises(ValueError, match="does not broadcast"):
        call(q, k, v, bias=xp.zeros((1, 1, 1, 8, 6), np.float32))
