"""Every public function's bad inputs, in one table: each row a call that must raise TypeError or
ValueError (NotImplementedError where the message says what to use instead) whose message names
the argument. Nothing runs on a kernel: every error comes before a launch.

The table holds the kinds of mistake: not an array, wrong number of dims, wrong shape, wrong dtype,
a last dim that is not contiguous, a flag that is not a bool (a string such as "no" would count as
True), a scalar of the wrong type or range, arrays from the wrong place (host memory on a GPU, a
device array in the simulator). test_errors.py, test_kvcache.py and test_backward.py hold more
cases of some rows, with the exact messages.
"""

import ml_dtypes
import numpy as np
import pytest

import nbflash

from .conftest import SIMULATOR

TORCH = None
try:
    import torch as TORCH  # noqa: N812 (optional: nbflash.torch's rows are skipped without it)

    import nbflash.torch as nbtorch
except ImportError:
    nbtorch = None


class DeviceArray:
    """Something that says it is a GPU array (refused under the simulator)."""

    __cuda_array_interface__ = {}


def arrays(xp):
    """Well-formed inputs of every function (batch 2, seqlen_q 8, seqlen_k 6, 4 query and 2 key/value
    heads, headdim 16, float16), each call below spoiling one argument."""
    a = dict(
        q=xp.zeros((2, 8, 4, 16), np.float16), k=xp.zeros((2, 6, 2, 16), np.float16),
        lse=xp.zeros((2, 4, 8), np.float32),
        packed_q=xp.zeros((8, 4, 16), np.float16), packed_k=xp.zeros((6, 2, 16), np.float16),
        cu_q=xp.asarray(np.array([0, 3, 8], np.int32)), cu_k=xp.asarray(np.array([0, 2, 6], np.int32)),
        packed_lse=xp.zeros((4, 8), np.float32),
        decode_q=xp.zeros((2, 1, 4, 16), np.float16), cache=xp.zeros((2, 32, 2, 16), np.float16),
        new=xp.zeros((2, 1, 2, 16), np.float16), cos=xp.zeros((32, 4), np.float16),
        merge_out=xp.zeros((1, 2, 2, 8), np.float16), merge_lse=xp.zeros((1, 2, 2), np.float32),
        qkv=xp.zeros((2, 8, 3, 4, 16), np.float16), kv=xp.zeros((2, 6, 2, 2, 16), np.float16),
        packed_qkv=xp.zeros((8, 3, 4, 16), np.float16), packed_kv=xp.zeros((6, 2, 2, 16), np.float16),
    )
    a["strided_q"] = xp.zeros((2, 8, 4, 32), np.float16)[..., ::2]  # last dim not contiguous
    a["host"] = np.zeros((2, 8, 4, 16), np.float16)  # host memory: refused on a GPU
    a["bytes_q"], a["bytes_k"] = xp.zeros((2, 8, 4, 16), np.uint8), xp.zeros((2, 6, 2, 16), np.uint8)  # e4m3 bytes
    return a


def fp8(a, *, q=None, k=None, **kwargs):
    """The fp8 forward's call on uint8 arrays of e4m3 bytes (CuPy has no float8 dtype)."""
    return (a["bytes_q"] if q is None else q, a["bytes_k"] if k is None else k, a["bytes_k"]), kwargs


def dense(a, **kwargs):
    return (a["q"], a["k"], a["k"]), kwargs


def backward(a, **kwargs):
    call = dict(dout=a["q"], q=a["q"], k=a["k"], v=a["k"], out=a["q"], lse=a["lse"])
    call.update(kwargs)
    return (), call


def varlen(a, *, q=None, cu_q=None, max_q=8, **kwargs):
    q = a["packed_q"] if q is None else q
    return (q, a["packed_k"], a["packed_k"], a["cu_q"] if cu_q is None else cu_q, a["cu_k"], max_q, 4), kwargs


def varlen_backward(a, **kwargs):
    call = dict(dout=a["packed_q"], q=a["packed_q"], k=a["packed_k"], v=a["packed_k"], out=a["packed_q"],
                lse=a["packed_lse"], cu_seqlens_q=a["cu_q"], cu_seqlens_k=a["cu_k"], max_seqlen_q=5, max_seqlen_k=4)
    call.update(kwargs)
    return (), call


def decode(a, *, q=None, k_cache=None, **kwargs):
    return (a["decode_q"] if q is None else q, a["cache"] if k_cache is None else k_cache, a["cache"]), kwargs


def merge(a, *, out_a=None, lse_b=None):
    out = a["merge_out"]
    return (out if out_a is None else out_a, a["merge_lse"], out, a["merge_lse"] if lse_b is None else lse_b), {}


F = nbflash
# (function name, call: a -> (args, kwargs), error, what the message must contain, where it applies)
CASES = [
    # flash_attn_func (explain takes the same checks: a few rows)
    ("flash_attn_func", lambda a: dense(a, return_lse="no"), TypeError, "return_lse must be a bool", None),
    ("flash_attn_func", lambda a: dense(a, return_attn_probs=1), TypeError, "return_attn_probs must be a bool", None),
    ("flash_attn_func", lambda a: dense(a, deterministic="yes"), TypeError, "deterministic must be a bool", None),
    ("flash_attn_func", lambda a: dense(a, causal="yes"), TypeError, "causal must be a bool", None),
    ("flash_attn_func", lambda a: ((a["q"][0], a["k"], a["k"]), {}), ValueError, "q must have 4 dims", None),
    ("flash_attn_func", lambda a: ((a["q"], [[1.0]], a["k"]), {}), TypeError, "k must be", None),
    ("flash_attn_func", lambda a: ((a["q"], a["k"], a["k"].astype(np.float32)), {}), TypeError, "v.dtype=float32", None),
    ("flash_attn_func", lambda a: ((a["q"].astype(np.int8),) * 3, {}), TypeError, "q.dtype=int8 is not supported", None),
    ("flash_attn_func", lambda a: ((a["q"], a["k"][:1], a["k"][:1]), {}), ValueError, "batch differs", None),
    ("flash_attn_func", lambda a: ((a["strided_q"], a["k"], a["k"]), {}), ValueError, "q's last dim", None),
    ("flash_attn_func", lambda a: ((a["q"][:, :, :3], a["k"], a["k"]), {}), ValueError, "nheads=3", None),
    ("flash_attn_func", lambda a: dense(a, softmax_scale="0.1"), TypeError, "softmax_scale must be a real", None),
    ("flash_attn_func", lambda a: dense(a, softmax_scale=float("inf")), ValueError, "softmax_scale must be finite",
     None),
    ("flash_attn_func", lambda a: dense(a, window_size=4), TypeError, "window_size must be a pair", None),
    ("flash_attn_func", lambda a: dense(a, softcap=-1.0), ValueError, "softcap must be finite and >= 0", None),
    ("flash_attn_func", lambda a: dense(a, dropout_p=1.0), ValueError, "dropout_p must be in", None),
    ("flash_attn_func", lambda a: dense(a, dropout_p=0.1, seed=-1), TypeError, "seed must be an int", None),
    ("flash_attn_func", lambda a: dense(a, alibi_slopes=a["lse"][0, 0, :3]), ValueError, "alibi_slopes must have shape",
     None),
    ("flash_attn_func", lambda a: dense(a, alibi_slopes=a["lse"][0, 0, :4].astype(np.float64)), TypeError,
     "alibi_slopes.dtype=float64", None),
    ("flash_attn_func", lambda a: dense(a, bias=a["lse"][:, :3]), ValueError, "bias of shape", None),
    ("flash_attn_func", lambda a: dense(a, bias=a["lse"].astype(np.int32)), TypeError, "bias.dtype=int32", None),
    ("flash_attn_func", lambda a: dense(a, score_mod=5), TypeError, "score_mod must be a Python function", None),
    ("flash_attn_func", lambda a: dense(a, mask_mod="x"), TypeError, "mask_mod must be a Python function", None),
    ("flash_attn_func", lambda a: dense(a, block_mask=5), TypeError, "block_mask must be a BlockMask", None),
    ("flash_attn_func", lambda a: ((a["host"], a["k"], a["k"]), {}), TypeError, r"q is a NumPy \(host\) array", "gpu"),
    ("flash_attn_func", lambda a: ((a["q"], DeviceArray(), a["k"]), {}), TypeError,
     "k must be a NumPy array when running in Numba's CUDA simulator", "simulator"),
    # flash_attn_func's fp8 forward: uint8 arrays of e4m3 bytes need fp8_dtype, which names e4m3 and uint8 arrays
    ("flash_attn_func", lambda a: fp8(a), TypeError, "pass fp8_dtype='float8_e4m3fn' if these are e4m3 bytes", None),
    ("flash_attn_func", lambda a: fp8(a, q_descale=2.0), TypeError,
     "pass fp8_dtype='float8_e4m3fn' if these are e4m3 bytes", None),
    ("flash_attn_func", lambda a: dense(a, fp8_dtype="float8_e4m3fn"), TypeError,
     "fp8_dtype='float8_e4m3fn' takes q, k and v as uint8 arrays", None),
    ("flash_attn_func", lambda a: fp8(a, fp8_dtype="float8_e5m2"), ValueError, "e5m2 is not supported", None),
    ("flash_attn_func", lambda a: fp8(a, fp8_dtype=np.float16), ValueError, "fp8_dtype must be 'float8_e4m3fn'",
     None),
    ("flash_attn_func", lambda a: fp8(a, k=a["k"], fp8_dtype="float8_e4m3fn"), TypeError,
     "q, k and v must have one dtype", None),
    ("flash_attn_func", lambda a: fp8(a, q=a["bytes_q"].view(ml_dtypes.float8_e4m3fn)), TypeError,
     "q, k and v must have one dtype", "simulator"),  # float8 arrays exist only in NumPy
    ("flash_attn_func", lambda a: fp8(a, fp8_dtype="float8_e4m3fn", softcap=5.0), ValueError,
     "the fp8 forward takes softmax_scale, causal and window_size only", None),
    ("explain", lambda a: dense(a, causal=1), TypeError, "causal must be a bool", None),
    ("explain", lambda a: ((a["q"], a["k"], a["k"][..., :8]), {}), ValueError, "k and v must have the same shape",
     None),
    # flash_attn_backward
    ("flash_attn_backward", lambda a: backward(a, dout=a["q"][:, :4]), ValueError, "dout must have q's shape", None),
    ("flash_attn_backward", lambda a: backward(a, out=a["q"].astype(np.float32)), TypeError, "out.dtype=float32",
     None),
    ("flash_attn_backward", lambda a: backward(a, lse=a["lse"].astype(np.float16)), TypeError, "lse.dtype=float16",
     None),
    ("flash_attn_backward", lambda a: backward(a, lse=a["lse"][:, :2]), ValueError, "lse must have shape", None),
    ("flash_attn_backward", lambda a: backward(a, lse=[0.0]), TypeError, "lse must be", None),
    ("flash_attn_backward", lambda a: backward(a, dout=a["strided_q"]), ValueError, "dout's last dim", None),
    ("flash_attn_backward", lambda a: backward(a, deterministic="yes"), TypeError, "deterministic must be a bool",
     None),
    ("flash_attn_backward", lambda a: backward(a, dropout_p=0.1), ValueError, "pass the forward's seed", None),
    ("flash_attn_backward", lambda a: backward(a, score_mod=lambda s, b, h, i, j: s), ValueError,
     "score_mod's backward needs its derivative", None),
    ("flash_attn_backward", lambda a: backward(a, v=a["k"][:, :3]), ValueError, "k and v must have the same shape",
     None),
    # flash_attn_varlen_func
    ("flash_attn_varlen_func", lambda a: varlen(a, return_lse="no"), TypeError, "return_lse must be a bool", None),
    ("flash_attn_varlen_func", lambda a: varlen(a, deterministic="no"), TypeError, "deterministic must be a bool",
     None),
    ("flash_attn_varlen_func", lambda a: varlen(a, check_seqlens="yes"), TypeError, "check_seqlens must be a bool",
     None),
    ("flash_attn_varlen_func", lambda a: varlen(a, q=a["q"]), ValueError, "q must have 3 dims", None),
    ("flash_attn_varlen_func", lambda a: varlen(a, cu_q=a["cu_q"].astype(np.int64)), TypeError,
     "cu_seqlens_q.dtype=int64 must be int32", None),
    ("flash_attn_varlen_func", lambda a: varlen(a, cu_q=a["cu_q"][None]), ValueError,
     r"cu_seqlens_q must have shape \(batch \+ 1,\)", None),
    ("flash_attn_varlen_func", lambda a: varlen(a, max_q=8.0), TypeError, "max_seqlen_q must be an int", None),
    ("flash_attn_varlen_func", lambda a: varlen(a, max_q=2), ValueError, "pass max_seqlen_q >= the longest", "simulator"),
    ("flash_attn_varlen_func", lambda a: varlen(a, causal="yes"), TypeError, "causal must be a bool", None),
    ("flash_attn_varlen_func", lambda a: varlen(a, block_table=a["cu_q"]), NotImplementedError, "block_table", None),
    # flash_attn_varlen_backward
    ("flash_attn_varlen_backward", lambda a: varlen_backward(a, lse=a["packed_lse"][:2]), ValueError,
     r"lse must have shape \(nheads, total_q\)", None),
    ("flash_attn_varlen_backward", lambda a: varlen_backward(a, dout=a["packed_q"][None]), ValueError,
     "dout must have q's shape", None),
    ("flash_attn_varlen_backward", lambda a: varlen_backward(a, deterministic="yes"), TypeError,
     "deterministic must be a bool", None),
    # flash_attn_with_kvcache (test_kvcache.py's table has the lengths, pages and rotary rows)
    ("flash_attn_with_kvcache", lambda a: decode(a, return_softmax_lse="no"), TypeError,
     "return_softmax_lse must be a bool", None),
    ("flash_attn_with_kvcache", lambda a: decode(a, causal="yes"), TypeError, "causal must be a bool", None),
    ("flash_attn_with_kvcache", lambda a: decode(a, k=a["new"], v=a["new"], cache_seqlens=3, rotary_cos=a["cos"],
                                                 rotary_sin=a["cos"], rotary_interleaved="yes"), TypeError,
     "rotary_interleaved must be a bool", None),
    ("flash_attn_with_kvcache", lambda a: decode(a, num_splits=1.5), TypeError, "num_splits must be an int", None),
    ("flash_attn_with_kvcache", lambda a: decode(a, num_splits=True), TypeError, "num_splits must be an int", None),
    ("flash_attn_with_kvcache", lambda a: decode(a, num_splits=-2), ValueError, "num_splits must be an int", None),
    ("flash_attn_with_kvcache", lambda a: decode(a, q=a["decode_q"][0]), ValueError, "q must have 4 dims", None),
    ("flash_attn_with_kvcache", lambda a: decode(a, k_cache=[1.0]), TypeError, "k_cache must be", None),
    ("flash_attn_with_kvcache", lambda a: decode(a, out=a["decode_q"].astype(np.float32)), TypeError,
     "out.dtype=float32", None),
    ("flash_attn_with_kvcache", lambda a: decode(a, cache_seqlens=a["cu_q"][:2].astype(np.int64)), TypeError,
     "cache_seqlens.dtype=int64", None),
    ("flash_attn_with_kvcache", lambda a: decode(a, softmax_scale="x"), TypeError, "softmax_scale must be a real",
     None),
    # merge_attention_states
    ("merge_attention_states", lambda a: merge(a, out_a=a["merge_out"][0]), ValueError, "out_a must have 4 dims",
     None),
    ("merge_attention_states", lambda a: merge(a, out_a=a["merge_out"].astype(np.int16)), TypeError,
     "out_a.dtype=int16 is not supported", None),
    ("merge_attention_states", lambda a: merge(a, lse_b=a["merge_lse"].astype(np.float16)), TypeError,
     "lse_b.dtype=float16", None),
    ("merge_attention_states", lambda a: merge(a, lse_b=a["merge_lse"][:, :1]), ValueError, "lse_b must have shape",
     None),
    # the packed functions: the packing, then a check of the function they call
    ("flash_attn_qkvpacked_func", lambda a: ((a["kv"],), {}), ValueError, "qkv must have shape", None),
    ("flash_attn_qkvpacked_func", lambda a: ((a["qkv"],), dict(causal="yes")), TypeError, "causal must be a bool",
     None),
    ("flash_attn_kvpacked_func", lambda a: ((a["q"], a["k"]), {}), ValueError, "kv must have shape", None),
    ("flash_attn_kvpacked_func", lambda a: ((a["q"][:, :, :3], a["kv"]), {}), ValueError, "nheads=3", None),
    ("flash_attn_varlen_qkvpacked_func", lambda a: ((a["qkv"], a["cu_q"], 5), {}), ValueError, "qkv must have shape",
     None),
    ("flash_attn_varlen_qkvpacked_func", lambda a: ((a["packed_qkv"], a["cu_q"].astype(np.int64), 5), {}), TypeError,
     "cu_seqlens_q", None),
    ("flash_attn_varlen_kvpacked_func", lambda a: ((a["packed_q"], [1.0], a["cu_q"], a["cu_k"], 5, 4), {}),
     TypeError, "kv must be an array", None),
    ("flash_attn_qkvpacked_backward", lambda a: ((a["q"], a["kv"], a["q"], a["lse"]), {}), ValueError,
     "qkv must have shape", None),
    ("flash_attn_kvpacked_backward", lambda a: ((a["q"], a["q"], a["kv"], a["q"], a["lse"].astype(np.float16)), {}),
     TypeError, "lse", None),
    ("flash_attn_varlen_qkvpacked_backward", lambda a: ((a["packed_q"], a["packed_kv"], a["packed_q"],
                                                         a["packed_lse"], a["cu_q"], 5), {}), ValueError,
     "qkv must have shape", None),
    ("flash_attn_varlen_kvpacked_backward", lambda a: ((a["packed_q"], a["packed_q"], a["qkv"], a["packed_q"],
                                                        a["packed_lse"], a["cu_q"], a["cu_k"], 5, 4), {}), ValueError,
     "kv must have shape", None),
    # create_block_mask and kernel_family
    ("create_block_mask", lambda a: ((5, 1, 1, 8, 8), {}), TypeError, "mask_mod must be a Python function", None),
    ("create_block_mask", lambda a: ((lambda b, h, i, j: i >= j, 1, 1, "8", 8), {}), TypeError,
     "seqlen_q must be a positive int", None),
    ("kernel_family", lambda a: (("cuda",), {}), ValueError, "family='cuda' is not a kernel family", None),
]

# nbflash.torch: the flags are checked before anything touches the GPU, so these rows run under the
# simulator too (on CPU tensors, which the GPU check then refuses by name).
TORCH_CASES = [
    ("flash_attn_func", lambda t: ((t["q"], t["k"], t["k"]), dict(return_lse="no")), TypeError,
     "return_lse must be a bool"),
    ("flash_attn_func", lambda t: ((t["q"], t["k"], t["k"]), dict(deterministic="no")), TypeError,
     "deterministic must be a bool"),
    ("flash_attn_func", lambda t: ((t["q"], t["k"], t["k"]), dict(return_attn_probs="no")), TypeError,
     "return_attn_probs must be a bool"),
    ("flash_attn_func", lambda t: ((t["q"].numpy(), t["k"], t["k"]), {}), TypeError, "q must be a torch tensor"),
    ("flash_attn_func", lambda t: ((t["q"], t["k"], t["k"]), {}), TypeError, "q is a cpu tensor"),
    ("flash_attn_func", lambda t: ((t["q"], t["k"], t["k"]), dict(dropout_p=2.0)), ValueError, "dropout_p must be in"),
    # the fp8 forward: torch.float8_e4m3fn tensors take it (as uint8 bytes to CuPy); on CPU tensors the
    # argument checks run, then the GPU check refuses them by name
    ("flash_attn_func", lambda t: ((t["fp8_q"], t["fp8_k"], t["fp8_k"]), dict(q_descale=2.0)), TypeError,
     "q is a cpu tensor"),
    ("flash_attn_func", lambda t: ((t["fp8_q"], t["k"], t["k"]), {}), TypeError, "q, k and v must have one dtype"),
    ("flash_attn_func", lambda t: ((t["fp8_q"].to(TORCH.float8_e5m2),) * 3, {}), ValueError,
     "e5m2 is not supported"),
    ("flash_attn_func", lambda t: ((t["fp8_q"].requires_grad_(), t["fp8_k"], t["fp8_k"]), {}), ValueError,
     "the fp8 forward has no backward and q requires grad"),
    ("flash_attn_func", lambda t: ((t["fp8_q"], t["fp8_k"], t["fp8_k"]), dict(score_mod_grad=lambda *a: 1.0)),
     ValueError, "not score_mod_grad"),
    ("flash_attn_varlen_func", lambda t: ((t["q"][0], t["k"][0], t["k"][0], t["cu"], t["cu"], 6, 6),
                                          dict(return_lse="no")), TypeError, "return_lse must be a bool"),
    ("flash_attn_varlen_func", lambda t: ((t["q"][0], t["k"][0], t["k"][0], t["cu"], t["cu"], 6, 6), {}), TypeError,
     "q is a cpu tensor"),
    ("flash_attn_with_kvcache", lambda t: ((t["q"][:, :1], t["k"], t["k"]), {}), TypeError, "q is a cpu tensor"),
    ("flash_attn_qkvpacked_func", lambda t: ((t["q"],), {}), ValueError, "qkv must have shape"),
    ("flash_attn_qkvpacked_func", lambda t: ((TORCH.stack([t["q"]] * 3, 2),), dict(return_lse="no")), TypeError,
     "return_lse must be a bool"),
    ("flash_attn_kvpacked_func", lambda t: ((t["q"], t["k"]), {}), ValueError, "kv must have shape"),
    ("flash_attn_varlen_qkvpacked_func", lambda t: ((TORCH.stack([t["q"][0]] * 3, 1), t["cu"], 6), {}), TypeError,
     "q is a cpu tensor"),
    ("flash_attn_varlen_kvpacked_func", lambda t: ((t["q"][0], t["k"][0], t["cu"], t["cu"], 6, 6), {}), ValueError,
     "kv must have shape"),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"{CASES[i][0]}-{i}")
def test_bad_input(xp, case):
    name, make, error, message, where = CASES[case]
    if where == "gpu" and SIMULATOR or where == "simulator" and not SIMULATOR:
        pytest.skip(f"a {where}-only row")
    args, kwargs = make(arrays(xp))
    function = getattr(nbflash, name)
    with pytest.raises(error, match=message):  # kernel_family too: it checks at the call, before any `with`
        function(*args, **kwargs)


@pytest.mark.skipif(nbtorch is None, reason="torch is not installed")
@pytest.mark.parametrize("case", range(len(TORCH_CASES)), ids=lambda i: f"torch-{TORCH_CASES[i][0]}-{i}")
def test_bad_input_torch(case):
    name, make, error, message = TORCH_CASES[case]
    tensors = dict(q=TORCH.zeros(2, 6, 4, 16, dtype=TORCH.float16), k=TORCH.zeros(2, 6, 2, 16, dtype=TORCH.float16),
                   cu=TORCH.tensor([0, 6], dtype=TORCH.int32))
    tensors.update(fp8_q=tensors["q"].to(TORCH.float8_e4m3fn), fp8_k=tensors["k"].to(TORCH.float8_e4m3fn))
    args, kwargs = make(tensors)
    with pytest.raises(error, match=message):
        getattr(nbtorch, name)(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(nbtorch is None, reason="torch is not installed")
def test_gpu_bad_input_torch_other_arguments():
    """On the GPU, past the device check: a k that is no tensor, a host k, a flag."""
    q = TORCH.zeros(2, 6, 4, 16, dtype=TORCH.float16, device="cuda")
    k = TORCH.zeros(2, 6, 2, 16, dtype=TORCH.float16, device="cuda")
    with pytest.raises(TypeError, match="k is a NumPy"):
        nbtorch.flash_attn_func(q, k.cpu().numpy(), k)
    with pytest.raises(TypeError, match="v lives in host memory"):
        nbtorch.flash_attn_func(q, k, k.cpu())
    with pytest.raises(TypeError, match="return_softmax_lse must be a bool"):
        nbtorch.flash_attn_with_kvcache(q[:, :1], k, k, return_softmax_lse="no")


def test_every_public_function_has_a_row():
    """A new public function gets its rows here (reference functions are the oracle, not checked
    inputs; last_dropout_seed takes none; BlockMask is built by create_block_mask)."""
    exempt = {"attention_reference", "attention_reference_backward", "attention_varlen_reference",
              "attention_varlen_reference_backward", "attention_naive", "attention_probabilities",
              "last_dropout_seed", "BlockMask", "__version__"}
    assert set(nbflash.__all__) - exempt == {name for name, *_ in CASES}
    if nbtorch is not None:
        public = {n for n in dir(nbtorch) if n.startswith("flash_attn") and callable(getattr(nbtorch, n))}
        assert public == {name for name, *_ in TORCH_CASES}
