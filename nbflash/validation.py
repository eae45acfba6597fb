"""Input validation: every argument is checked once, here, and errors name the argument and the fix.

On a GPU, inputs are CuPy arrays or anything CuPy can wrap without a copy: objects exporting DLPack
(PyTorch tensors, JAX arrays) or ``__cuda_array_interface__`` (Numba device arrays). Under Numba's
CUDA simulator, inputs are NumPy arrays. Either way, the result is a ``Problem`` describing the call
and the inputs as arrays of the backend (CuPy on a GPU, NumPy in the simulator).
"""

import math
import numbers
import secrets
import threading

import numpy as np

from . import runtime
from .dtypes import FLOAT8_E4M3, dtype_name
from .block_mask import check_block_mask
from .kernels.variants import user_function
from .problem import UNBOUNDED, Problem, Variant, window_bounds

MAX_HEADDIM = 256
MAX_GRID_YZ = 65535  # a launch grid's y (heads) and z (batch) dimensions


def _device_array(x, name):
    """``x`` as a CuPy array sharing its memory, or a TypeError naming ``name``."""
    cupy = runtime.cupy()
    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.ndarray):
        raise TypeError(
            f"{name} is a NumPy (host) array; nbflash runs on the GPU: pass cupy.asarray({name})"
        )
    if hasattr(x, "__dlpack_device__"):
        device_type = int(x.__dlpack_device__()[0])
        if device_type not in (runtime.DLPACK_CUDA, runtime.DLPACK_CUDA_MANAGED):
            raise TypeError(
                f"{name} lives in host memory (DLPack device type {device_type}); "
                f"move it to the GPU first (for a PyTorch tensor: {name}.cuda())"
            )
        try:
            return cupy.from_dlpack(x)
        except Exception as error:  # CuPy refuses some dtypes; say which argument it was
            raise TypeError(f"{name} could not be wrapped as a CuPy array via DLPack: {error}")
    if hasattr(x, "__cuda_array_interface__"):
        try:
            return cupy.asarray(x)
        except Exception as error:
            raise TypeError(f"{name} could not be wrapped as a CuPy array: {error}")
    raise TypeError(
        f"{name} must be a CuPy array or a GPU array exporting DLPack or "
        f"__cuda_array_interface__, got {type(x).__name__}"
    )


def _host_array(x, name):
    """Under the simulator, ``x`` must be a NumPy array (the simulator runs on the CPU)."""
    if isinstance(x, np.ndarray):
        return x
    raise TypeError(
        f"{name} must be a NumPy array when running in Numba's CUDA simulator, "
        f"got {type(x).__name__}"
    )


def as_backend_array(x, name):
    """The array the kernels can take: CuPy on a GPU, NumPy under the simulator."""
    return _host_array(x, name) if runtime.SIMULATOR else _device_array(x, name)


def _check_layout(x, name, dims):
    """Shape and strides of a 4-dim array with a contiguous last dim, or an error naming ``name``."""
    shape, strides = x.shape, x.strides
    if len(shape) != 4:
        raise ValueError(f"{name} must have 4 dims {dims}, got shape {tuple(shape)}")
    if 0 in shape:
        raise ValueError(f"{name} has a zero-size dimension: shape {tuple(shape)} {dims}")
    if shape[3] > 1 and strides[3] != x.itemsize:
        raise ValueError(
            f"{name}'s last dim (headdim) must be contiguous (stride {x.itemsize} bytes), got "
            f"strides {tuple(strides)}; pass {name} with a contiguous last dim "
            f"(e.g. cupy.ascontiguousarray({name}))"
        )
    return shape, strides


def rows_aligned(x):
    """Every (batch, seqlen, head) row of the 4-dim backend array ``x`` starts on a 16-byte
    boundary: the kernels may copy its rows 16 bytes at a time."""
    pointer = x.ctypes.data if runtime.SIMULATOR else x.data.ptr
    return pointer % 16 == 0 and not any(s % 16 for s in x.strides[:3])


FP8_DTYPE = "float8_e4m3fn"  # the one fp8 format the fp8 forward reads (FlashAttention-3's forward format)
FP8_BYTES_HINT = f"pass fp8_dtype={FP8_DTYPE!r} if these are e4m3 bytes (uint8 arrays: CuPy has no float8 dtype)"


def check_fp8_inputs(q, k, v, fp8_dtype):
    """The fp8 forward's q, k, v as uint8 backend arrays of e4m3 bytes: float8_e4m3fn arrays (NumPy,
    under the simulator), or uint8 arrays with ``fp8_dtype='float8_e4m3fn'`` saying what their bytes
    are (CuPy, which cannot hold float8). The kernel reads byte pairs, so both are the same bytes."""
    if fp8_dtype is not None:
        name = fp8_dtype if isinstance(fp8_dtype, str) else _dtype_name_or_str(fp8_dtype)
        if "e5m2" in name:
            raise ValueError(f"fp8_dtype={fp8_dtype!r}: the fp8 forward reads e4m3 only, e5m2 is not supported; "
                             f"quantize q, k and v to e4m3 and pass fp8_dtype={FP8_DTYPE!r}")
        if name != FP8_DTYPE:
            raise ValueError(f"fp8_dtype must be {FP8_DTYPE!r} (the bytes of q, k and v are e4m3) or None, "
                             f"got {fp8_dtype!r}")
    q, k, v = (as_backend_array(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have one dtype, got q.dtype={q.dtype}, k.dtype={k.dtype}, "
                        f"v.dtype={v.dtype}")
    if q.dtype == np.uint8 and fp8_dtype is None:
        raise TypeError(f"q, k and v are uint8 and fp8_dtype is None; {FP8_BYTES_HINT}")
    if fp8_dtype is not None and q.dtype not in (np.uint8, FLOAT8_E4M3):
        raise TypeError(f"fp8_dtype={fp8_dtype!r} takes q, k and v as uint8 arrays of e4m3 bytes, got {q.dtype} "
                        f"(pass x.view(uint8) of e4m3 data, or leave fp8_dtype None for float16/bfloat16/float32)")
    if q.dtype not in (np.uint8, FLOAT8_E4M3):
        raise TypeError(f"q_descale / k_descale / v_descale take float8_e4m3fn q, k and v (or uint8 arrays of e4m3 "
                        f"bytes with fp8_dtype={FP8_DTYPE!r}); q, k and v are {q.dtype}")
    return tuple(x.view(np.uint8) for x in (q, k, v))


def _dtype_name_or_str(dtype):
    """A dtype's name (ml_dtypes' float8 types included); else its str without a "torch." prefix."""
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype).removeprefix("torch.")


def check_softmax_scale(softmax_scale, headdim):
    """The softmax scale to use: 1 / sqrt(headdim) by default, else a finite real number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if type(softmax_scale) is float and math.isfinite(softmax_scale):
        return softmax_scale
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {softmax_scale!r}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
    return float(softmax_scale)


def check_window_size(window_size):
    """flash-attn's window_size: a pair of ints (left, right), each -1 (unbounded) or more."""
    if isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
        isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)) for x in window_size
    ):
        left, right = (int(x) for x in window_size)
        if left < -1 or right < -1:
            raise ValueError(f"window_size={tuple(window_size)}: each side must be -1 (unbounded) or >= 0")
        return left, right
    raise TypeError(f"window_size must be a pair of ints (left, right), -1 for unbounded, got {window_size!r}")


def check_softcap(softcap):
    """softcap: a finite real number >= 0 (0 turns it off)."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (0.0 for none), got {softcap!r}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0.0 for none), got {softcap!r}")
    return float(softcap)


def check_dropout_p(dropout_p):
    """dropout_p: a real number in [0, 1)."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {dropout_p!r}")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r} (if you meant a softmax scale, "
                         f"pass softmax_scale=..., the fifth argument, as in flash-attn)")
    return float(dropout_p)


_last = threading.local()


def check_seed(seed, dropout_p):
    """Dropout's 64-bit seed: the caller's, or, for None, a fresh one (``last_dropout_seed`` reads
    it back, for the backward)."""
    if seed is None:
        seed = secrets.randbits(64) if dropout_p > 0 else 0
    elif isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**64:
        raise TypeError(f"seed must be an int in [0, 2**64) or None (a fresh one), got {seed!r}")
    if dropout_p > 0:
        _last.seed = int(seed)
    return int(seed)


def last_dropout_seed():
    """The seed of this thread's last call with dropout (the one ``seed=None`` drew): pass it to
    ``flash_attn_backward(..., seed=...)`` to regenerate the same dropout mask. None before any."""
    return getattr(_last, "seed", None)


def check_alibi_slopes(alibi_slopes, batch, nheads, device):
    """float32 ALiBi slopes of shape (nheads,) or (batch, nheads) on the arrays' device, as a
    (batch, nheads) view (stride 0 over batch for one slope per head; no copy)."""
    slopes = as_backend_array(alibi_slopes, "alibi_slopes")
    if slopes.dtype != np.float32:
        raise TypeError(f"alibi_slopes.dtype={slopes.dtype} must be float32 (as in flash-attn)")
    if tuple(slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads}), "
            f"got {tuple(slopes.shape)}"
        )
    if not runtime.SIMULATOR and slopes.data.device_id != device:
        raise ValueError(f"alibi_slopes is on GPU {slopes.data.device_id} but q is on GPU {device}")
    xp = runtime.xp()
    return xp.broadcast_to(slopes, (batch, nheads)) if slopes.ndim == 1 else slopes


def check_bias(bias, batch, nheads, seqlen_q, seqlen_k, dtype, device):
    """An additive float bias or a boolean mask (True = kept), broadcastable to (batch, nheads,
    seqlen_q, seqlen_k), as a 4-dim view of that shape (stride 0 on the broadcast dims; no copy).
    Returns (view, kind): kind 'mask' for a boolean tensor, else the bias's element type (float32,
    or q's 16-bit type)."""
    x = as_backend_array(bias, "bias")
    target = (batch, nheads, seqlen_q, seqlen_k)
    if x.dtype == np.bool_:
        kind = "mask"
    else:
        kind = dtype_name(x.dtype)
        if kind not in ("float32", dtype):
            raise TypeError(f"bias.dtype={x.dtype}: an additive bias is float32 or q's dtype ({dtype}); "
                            f"a mask is bool (True = kept)")
    shape = (1,) * (4 - x.ndim) + tuple(x.shape)
    if x.ndim > 4 or any(n not in (1, m) for n, m in zip(shape, target)):
        raise ValueError(f"bias of shape {tuple(x.shape)} does not broadcast to (batch, nheads, seqlen_q, "
                         f"seqlen_k) = {target}; size-1 dims broadcast")
    if not runtime.SIMULATOR and x.data.device_id != device:
        raise ValueError(f"bias is on GPU {x.data.device_id} but q is on GPU {device}")
    xp = runtime.xp()
    return xp.broadcast_to(x.reshape(shape), target), kind


# A model calls attention with the same shapes call after call. A call that repeats an earlier,
# valid call in everything validation looks at (array types, shapes, strides, dtypes, devices, the
# 16-byte alignment of the data, softmax_scale and causal) takes the earlier call's Problem: the
# checks below would reach the same verdict. Only plain backend arrays, a float or None scale and a
# bool causal qualify; anything else is checked in full.
_REMEMBERED = {}
_REMEMBER_AT_MOST = 256


def _repeat_key(q, k, v, softmax_scale, causal, window_size=(UNBOUNDED, UNBOUNDED), softcap=0.0,
                alibi_slopes=None, bias=None, user=(), dropout_p=0.0):
    """What check_forward's verdict depends on, as a dict key; None if the call does not qualify."""
    if runtime.SIMULATOR:
        if not (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray):
            return None
        pointers = q.ctypes.data | k.ctypes.data | v.ctypes.data
        devices = None
    else:
        cupy = runtime.cupy()
        array = cupy.ndarray
        if not (type(q) is array and type(k) is array and type(v) is array):
            return None
        qd, kd, vd = q.data, k.data, v.data
        pointers = qd.ptr | kd.ptr | vd.ptr
        devices = (qd.device_id, kd.device_id, vd.device_id, cupy.cuda.runtime.getDevice())
    if not (softmax_scale is None or type(softmax_scale) is float) or not (causal is True or causal is False):
        return None
    if alibi_slopes is not None or bias is not None or type(softcap) is not float or type(window_size) is not tuple:
        return None  # slopes and biases are arrays a problem would hold on to; odd types: check in full
    if any(fn is not None for fn in user) or dropout_p:
        return None  # user functions: fingerprinted on every call; dropout: a seed per call
    return (
        q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape, v.strides, v.dtype,
        softmax_scale, causal, window_size, softcap, pointers % 16 == 0, devices,
    )


def check_forward(q, k, v, softmax_scale, causal, window_size=(UNBOUNDED, UNBOUNDED), softcap=0.0,
                  alibi_slopes=None, bias=None, score_mod=None, mask_mod=None, score_mod_grad=None, dropout_p=0.0,
                  seed=None, block_mask=None):
    """Validate a forward call. Returns (problem, q, k, v) with the arrays on the backend."""
    user = (score_mod, mask_mod, score_mod_grad)
    key = _repeat_key(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, bias, user + (block_mask,),
                      dropout_p)
    problem = _REMEMBERED.get(key) if key is not None else None
    if problem is not None:
        return problem, q, k, v
    problem, q, k, v = _check_forward(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, bias,
                                      user, dropout_p, seed, block_mask)
    if key is not None:
        if len(_REMEMBERED) >= _REMEMBER_AT_MOST:
            _REMEMBERED.clear()
        _REMEMBERED[key] = problem
    return problem, q, k, v


def _check_forward(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, bias, user, dropout_p,
                   seed, block_mask=None):
    q = as_backend_array(q, "q")
    k = as_backend_array(k, "k")
    v = as_backend_array(v, "v")
    (batch, seqlen_q, nheads, headdim), _ = _check_layout(q, "q", "(batch, seqlen_q, nheads, headdim)")
    k_shape, _ = _check_layout(k, "k", "(batch, seqlen_k, nheads_k, headdim)")
    v_shape, _ = _check_layout(v, "v", "(batch, seqlen_k, nheads_k, headdim)")

    dtype = dtype_name(q.dtype)
    if dtype is None:
        raise TypeError(f"q.dtype={q.dtype} is not supported; expected float16, bfloat16 or float32"
                        + (f"; {FP8_BYTES_HINT}" if q.dtype == np.uint8 else ""))
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}.dtype={x.dtype} differs from q.dtype={q.dtype}; they must match")

    if k_shape != v_shape:
        raise ValueError(f"k and v must have the same shape, got k {k_shape} and v {v_shape}")
    _, seqlen_k, nheads_k, headdim_k = k_shape
    if k_shape[0] != batch:
        raise ValueError(f"batch differs: q has {batch} (q.shape[0]), k and v have {k_shape[0]}")
    if headdim_k != headdim:
        raise ValueError(f"headdim differs: q has {headdim} (q.shape[3]), k and v have {headdim_k}")
    if headdim > MAX_HEADDIM:
        raise ValueError(f"{headdim=} exceeds {MAX_HEADDIM}")
    if batch > MAX_GRID_YZ or nheads > MAX_GRID_YZ:
        raise ValueError(
            f"batch={batch} and nheads={nheads} must each be at most {MAX_GRID_YZ} "
            f"(one launch covers them); split the call along that dimension"
        )
    if nheads % nheads_k:
        raise ValueError(
            f"nheads={nheads} (q.shape[2]) must be a multiple of nheads_k={nheads_k} (k.shape[2]) "
            f"for grouped-query attention"
        )
    if causal is not True and causal is not False and not isinstance(causal, np.bool_):
        raise TypeError(f"causal must be a bool, got {causal!r}")

    if runtime.SIMULATOR:
        device = 0
    else:
        device = q.data.device_id
        if k.data.device_id != device or v.data.device_id != device:
            devices = {"q": device, "k": k.data.device_id, "v": v.data.device_id}
            raise ValueError(f"q, k and v must be on one GPU, got devices {devices}")
        current = runtime.cupy().cuda.runtime.getDevice()
        if device != current:
            raise ValueError(
                f"q is on GPU {device} but the current CuPy device is {current}; "
                f"call inside `with cupy.cuda.Device({device}):`"
            )
    aligned = rows_aligned(q) and rows_aligned(k) and rows_aligned(v)

    left, right, window = window_bounds(seqlen_q, seqlen_k, bool(causal), check_window_size(window_size))
    softcap = check_softcap(softcap)
    if alibi_slopes is not None:
        alibi_slopes = check_alibi_slopes(alibi_slopes, batch, nheads, device)
    additive = keep = None
    if bias is not None:
        bias, kind = check_bias(bias, batch, nheads, seqlen_q, seqlen_k, dtype, device)
        additive, keep = (None, bias) if kind == "mask" else (bias, None)
    if block_mask is not None:  # it carries its mask_mod (the element test of its partial tiles)
        check_block_mask(block_mask, user[1], batch, nheads, seqlen_q, seqlen_k)
        user = (user[0], block_mask.mask_mod, user[2])
    score_mod, mask_mod, score_mod_grad = (
        "" if fn is None else user_function(fn, name) for fn, name in zip(user, ("score_mod", "mask_mod", "score_mod_grad"))
    )
    if score_mod_grad and not score_mod:
        raise ValueError("score_mod_grad was given without a score_mod")
    dropout_p = check_dropout_p(dropout_p)
    seed = check_seed(seed, dropout_p)
    problem = Problem(
        batch,
        seqlen_q,
        seqlen_k,
        nheads,
        nheads_k,
        headdim,
        dtype,
        check_softmax_scale(softmax_scale, headdim),
        aligned,
        device,
        Variant(window=window, softcap=softcap > 0, alibi=alibi_slopes is not None,
                bias=dtype_name(additive.dtype) if additive is not None else "", mask=keep is not None,
                score_mod=score_mod, score_mod_grad=score_mod_grad, mask_mod=mask_mod, dropout=dropout_p > 0,
                block_mask=block_mask is not None),
        left,
        right,
        softcap,
        alibi_slopes,
        additive,
        keep,
        dropout_p,
        seed,
        block_mask,
    )
    return problem, q, k, v


# ---------------------------------------------------------------------------------------------------
# Packed variable-length sequences (nbflash.varlen)
# ---------------------------------------------------------------------------------------------------


def _check_max_seqlen(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int (the longest sequence's length, a host value), got {value!r}")
    if value < 1:
        raise ValueError(f"{name}={value} must be at least 1 (the longest sequence's length)")
    return int(value)


def _check_cu_seqlens(cu, name, device):
    cu = as_backend_array(cu, name)
    if cu.dtype != np.int32:
        raise TypeError(f"{name}.dtype={cu.dtype} must be int32 (as in flash-attn): pass {name}.astype(int32)")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must have shape (batch + 1,), at least 2 offsets, got {tuple(cu.shape)}")
    if not runtime.SIMULATOR and cu.data.device_id != device:
        raise ValueError(f"{name} is on GPU {cu.data.device_id} but q is on GPU {device}")
    return cu


def check_cu_seqlens_values(cu, name, total, max_seqlen, max_name):
    """What the kernels cannot check for themselves: ``cu`` starts at 0, never decreases, ends at
    ``total`` (every row belongs to a sequence), and no sequence is longer than ``max_seqlen``.
    Reads ``cu`` on the host (a synchronization on a GPU)."""
    values = np.asarray(cu.get() if hasattr(cu, "get") else cu, np.int64)
    lengths = np.diff(values)
    if values[0] != 0:
        raise ValueError(f"{name}[0]={values[0]} must be 0 (offsets of the packed sequences' rows)")
    if (lengths < 0).any():
        b = int(np.argmax(lengths < 0))
        raise ValueError(f"{name} must be nondecreasing: {name}[{b + 1}]={values[b + 1]} < {name}[{b}]={values[b]}")
    if values[-1] != total:
        raise ValueError(f"{name}[-1]={values[-1]} must equal the packed rows' count {total}: every row must belong "
                         f"to a sequence")
    if lengths.max() > max_seqlen:
        b = int(np.argmax(lengths))
        raise ValueError(f"sequence {b} has {lengths[b]} rows ({name}[{b + 1}] - {name}[{b}]) but {max_name}="
                         f"{max_seqlen}; pass {max_name} >= the longest sequence")


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                 window_size, softcap, alibi_slopes, dropout_p, seed, check_seqlens=None):
    """Validate a packed (varlen) call. Returns (problem, q, k, v), the arrays 3-dim on the backend.

    The packed arrays are checked as one dense batch row (``_check_forward``); the problem then
    becomes the batch's: batch = len(cu_seqlens_q) - 1, seqlen_q / seqlen_k the max_seqlen values
    (they size the grid, and bound the window), the offsets runtime values of the varlen layout.
    ``check_seqlens``: read the offsets back and check them (``check_cu_seqlens_values``); None
    does so only where that costs no GPU synchronization (under the simulator)."""
    q = as_backend_array(q, "q")
    k = as_backend_array(k, "k")
    v = as_backend_array(v, "v")
    for name, x, dims in (("q", q, "(total_q, nheads, headdim)"), ("k", k, "(total_k, nheads_k, headdim)"),
                          ("v", v, "(total_k, nheads_k, headdim)")):
        if x.ndim != 3:
            raise ValueError(f"{name} must have 3 dims {dims}, the sequences' rows packed one after another "
                             f"(flash_attn_func takes the 4-dim batch), got shape {tuple(x.shape)}")
        if x.shape[0] == 0:
            raise ValueError(f"{name} has no rows: shape {tuple(x.shape)} {dims}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    (total_q, nheads, headdim), (total_k, nheads_k, headdim_k) = q.shape, k.shape
    if headdim_k != headdim:
        raise ValueError(f"headdim differs: q has {headdim} (q.shape[2]), k and v have {headdim_k}")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"nheads={nheads} (q.shape[1]) must be a multiple of nheads_k={nheads_k} (k.shape[1]) "
                         f"for grouped-query attention")
    max_seqlen_q = _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    if check_seqlens is not None and check_seqlens is not True and check_seqlens is not False:
        raise TypeError(f"check_seqlens must be a bool or None, got {check_seqlens!r}")

    problem, q4, k4, v4 = _check_forward(q[None], k[None], v[None], softmax_scale, causal, window_size, softcap, None,
                                         None, (None, None, None), dropout_p, seed)
    device = problem.device
    cu_q = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", device)
    cu_k = _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", device)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both be (batch + 1,), got {tuple(cu_q.shape)} and "
                         f"{tuple(cu_k.shape)}")
    batch = cu_q.shape[0] - 1
    if batch > MAX_GRID_YZ:
        raise ValueError(f"batch={batch} (len(cu_seqlens_q) - 1) must be at most {MAX_GRID_YZ}; split the call")
    if check_seqlens or (check_seqlens is None and runtime.SIMULATOR):
        check_cu_seqlens_values(cu_q, "cu_seqlens_q", total_q, max_seqlen_q, "max_seqlen_q")
        check_cu_seqlens_values(cu_k, "cu_seqlens_k", total_k, max_seqlen_k, "max_seqlen_k")

    # An unbounded side must mask nothing in every sequence: normalized against the longest.
    left, right, window = window_bounds(max_seqlen_q, max_seqlen_k, bool(causal), check_window_size(window_size))
    if alibi_slopes is not None:
        alibi_slopes = check_alibi_slopes(alibi_slopes, batch, nheads, device)
    variant = problem.variant._replace(window=window, alibi=alibi_slopes is not None, varlen=True)
    problem = problem._replace(batch=batch, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k, variant=variant,
                               window_left=left, window_right=right, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_q,
                               cu_seqlens_k=cu_k)
    return problem, q, k, v
