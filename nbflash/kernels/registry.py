"""Every kernel nbflash compiles: config type -> (builder, signature).

The launcher, the backward, the prebuild script and the tuning scripts read this table; nothing
else lists kernels. A config (a frozen dataclass from the kernel's module) says everything the
machine code depends on; ``build(config)`` returns its ``@cuda.jit`` kernel and ``signature(config)``
the one Numba signature it is compiled for:

- inputs (q, k, v, dout) take any strides with the last dim contiguous; the buffers the library
  allocates (out, lse, gradients, accumulators) are C-contiguous;
- scalars (float32 such as the softmax scale, int32 lengths and flags) follow the arrays;
- with packed sequences (``Variant.varlen``) the outputs too take any strides: each is a stride-0
  view over batch of one packed array (``nbflash.varlen``);
- the last argument of every attention kernel is ``params``, the variant's runtime values as one
  tuple (``nbflash.problem.Problem.params``, types from ``variants.param_types``).
"""

from ..dtypes import KERNEL_DTYPE
from . import variants
from .backward_mma import MmaBackwardConfig, build_backward_mma
from .backward_portable import PortableBackwardConfig, build_backward_portable
from .backward_dq_sm90 import Sm90DqConfig, build_backward_dq_sm90
from .backward_sm90 import Sm90BackwardConfig, Sm90ConvertDqConfig, build_backward_sm90, build_convert_dq_tiles
from .backward_sm90_rows import Sm90RowsBackwardConfig, build_backward_sm90_rows
from .backward_sm90_wide import Sm90WideBackwardConfig, build_backward_sm90_wide
from .backward_sm90 import tensor_maps as backward_tensor_maps
from .decode_mma import MmaDecodeConfig, build_decode_mma
from .forward_mma import MmaForwardConfig, build_forward_mma
from .forward_portable import PortableForwardConfig, build_forward_portable
from .forward_sm90 import FP8, Sm90ForwardConfig, build_forward_sm90, tensor_maps
from .kvcache import AppendConfig, CombineConfig, build_append, build_combine
from .transpose_fp8 import Fp8TransposeConfig, build_transpose_fp8


def _params(config, extra=()):
    names = ", ".join((*variants.param_types(config.variant), *extra))
    return f"Tuple(({names}{',' if names else ''}))"


def _written(config, ndim):
    """The type code of an output array's dims: C-contiguous, or, with packed sequences, any
    strides (the kernel gets a stride-0 view over batch of the packed output)."""
    return ":," * (ndim - 1) + (":" if config.variant.varlen else "::1")


def _forward(config):
    t = KERNEL_DTYPE[config.dtype].name
    return (f"void({t}[:,:,:,:], {t}[:,:,:,:], {t}[:,:,:,:], {t}[{_written(config, 4)}], "
            f"float32[{_written(config, 3)}], float32, {_params(config)})")


def _forward_sm90(config):
    """The forward's arguments, then the tensor maps of q, k, v (``HOST_ARGUMENTS``). fp8: every
    array uint16 (byte pairs in, bfloat16 bits out), and the descales after the variant's params."""
    t = KERNEL_DTYPE[config.dtype].name
    params = _params(config, ("float32[:,:,::1]",) if config.dtype == FP8 else ())
    return (f"void({t}[:,:,:,:], {t}[:,:,:,:], {t}[:,:,:,:], {t}[:,:,:,::1], float32[:,:,::1], uint64[:,::1], "
            f"float32, {params})")


def _backward(config):
    t = KERNEL_DTYPE[config.dtype].name
    inputs = ", ".join([f"{t}[:,:,:,:]"] * 4)  # q, k, v, dout (or out, dout)
    # dq_accum, or a stand-in for it
    accum = f"float32[{_written(config, 4)}]" if config.atomic_dq else f"float32[{_written(config, 3)}]"
    grad = f"{t}[{_written(config, 4)}]"
    stats = f"float32[{_written(config, 3)}]"  # delta (and lse, any strides anyway)
    if config.kernel == "preprocess":
        return f"void({t}[:,:,:,:], {t}[:,:,:,:], float32[:,:,::1], {accum})"
    if config.kernel == "convert_dq":
        return f"void(float32[:,:,:,::1], {grad}, float32)"
    if config.kernel == "dkdv":
        arrays = f"{inputs}, float32[:,:,:], {stats}, {grad}, {grad}, {accum}"
    else:  # dq
        arrays = f"{inputs}, float32[:,:,:], {stats}, {grad}"
    return f"void({arrays}, float32, float32, {_params(config)})"


def _backward_sm90(config, dq=False):
    """The dK/dV kernel's arguments (as the mma family's, with dq_accum; with ``dq``, dq after it),
    then the tensor maps of q, k, v, dout (``HOST_ARGUMENTS``)."""
    t = KERNEL_DTYPE[config.dtype].name
    inputs = ", ".join([f"{t}[:,:,:,:]"] * 4)  # q, k, v, dout
    # dq_accum, or without atomics (dq_split="none") a stand-in: delta, as for the other families
    accum = "float32[:,:,:,::1]" if config.atomic_dq else "float32[:,:,::1]"
    if dq:
        accum += f", {t}[:,:,:,::1]"
    return (f"void({inputs}, float32[:,:,:], float32[:,:,::1], {t}[:,:,:,::1], {t}[:,:,:,::1], "
            f"{accum}, uint64[:,::1], float32, float32, {_params(config)})")


def _backward_sm90_dq(config):
    """backward_sm90.py's dK/dV kernel: ``_backward_sm90``'s arguments with dq after dq_accum (written
    where the kernel converts dQ itself, ``fold_dq``; left alone otherwise)."""
    return _backward_sm90(config, dq=True)


def _convert_dq_sm90(config):
    """The tile-major dq conversion's arguments: dq_accum (``dq_accum_shape``), dq, (packed sequences:
    cu_seqlens_q,) the softmax scale."""
    sequences = "int32[:], " if config.varlen else ""
    return f"void(float32[:,:,:,::1], {KERNEL_DTYPE[config.dtype].name}[:,:,:,::1], {sequences}float32)"


def _backward_dq_sm90(config):
    """The deterministic dQ kernel's arguments (as the mma family's), then the tensor maps of q, k,
    v, dout (``HOST_ARGUMENTS``)."""
    t = KERNEL_DTYPE[config.dtype].name
    inputs = ", ".join([f"{t}[:,:,:,:]"] * 4)  # q, k, v, dout
    return (f"void({inputs}, float32[:,:,:], float32[:,:,::1], {t}[:,:,:,::1], uint64[:,::1], "
            f"float32, float32, {_params(config)})")


def _decode(config):
    t = KERNEL_DTYPE[config.dtype].name
    cache = f"{t}[:,:,:,:]"  # k_cache, v_cache: any strides, the last dim contiguous
    # q, the caches, out, lse, the splits' partial outputs and lse, their merge's counters, then
    # cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_cos, rotary_sin, and the new
    # tokens' k and v (read only where the append is fused: MmaDecodeConfig.append)
    arrays = (f"{t}[:,:,:,:], {cache}, {cache}, {t}[:,:,:,:], float32[:,:,::1], float32[:,:,:,:,::1], "
              f"float32[:,:,:,::1], int32[::1], int32[:], int32[:], int32[:], int32[:,:], {t}[:,:], {t}[:,:], "
              f"{t}[:,:,:,:], {t}[:,:,:,:]")
    return f"void({arrays}, float32, int32, int32, int32, {_params(config)})"


def _append(config):
    t = KERNEL_DTYPE[config.dtype].name
    return (f"void({t}[:,:,:,:], {t}[:,:,:,:], {t}[:,:,:,:], {t}[:,:,:,:], int32[:], int32[:], int32[:,:], "
            f"{t}[:,:], {t}[:,:], int32, int32)")


def _combine(config):
    t = KERNEL_DTYPE[config.dtype].name
    return f"void({t}[:,:,:,:], float32[:,:,:], {t}[:,:,:,:], float32[:,:,:], {t}[:,:,:,:], float32[:,:,:])"


def _transpose_fp8(config):
    return "void(uint32[:,:,:,:], uint32[:,:,:,::1])"  # V as words of 4 columns, V^T of 4 positions


KERNELS = {
    PortableForwardConfig: (build_forward_portable, _forward),
    MmaForwardConfig: (build_forward_mma, _forward),
    Sm90ForwardConfig: (build_forward_sm90, _forward_sm90),
    PortableBackwardConfig: (build_backward_portable, _backward),
    MmaBackwardConfig: (build_backward_mma, _backward),
    Sm90BackwardConfig: (build_backward_sm90, _backward_sm90_dq),
    Sm90RowsBackwardConfig: (build_backward_sm90_rows, _backward_sm90),  # the same arguments
    Sm90WideBackwardConfig: (build_backward_sm90_wide, _backward_sm90),  # the same arguments
    Sm90DqConfig: (build_backward_dq_sm90, _backward_dq_sm90),
    Sm90ConvertDqConfig: (build_convert_dq_tiles, _convert_dq_sm90),
    MmaDecodeConfig: (build_decode_mma, _decode),
    AppendConfig: (build_append, _append),
    CombineConfig: (build_combine, _combine),
    Fp8TransposeConfig: (build_transpose_fp8, _transpose_fp8),
}


# Arrays a kernel takes beyond those its callers pass, made on the host from them at each launch:
# ``make(config, arrays) -> arrays``. The sm90 kernels' TMA reads q, k, v (and the backward's dout)
# through tensor maps.
HOST_ARGUMENTS = {
    Sm90ForwardConfig: lambda config, arrays: (*arrays, tensor_maps(config, *arrays[:3])),
    Sm90BackwardConfig: lambda config, arrays: (*arrays, backward_tensor_maps(config, *arrays[:4], *arrays[6:8])),
    Sm90RowsBackwardConfig: lambda config, arrays: (*arrays, backward_tensor_maps(config, *arrays[:4])),
    Sm90WideBackwardConfig: lambda config, arrays: (*arrays, backward_tensor_maps(config, *arrays[:4])),
    Sm90DqConfig: lambda config, arrays: (*arrays, backward_tensor_maps(config, *arrays[:4])),
}


def build(config):
    """The ``@cuda.jit`` kernel of ``config`` (built once per config)."""
    return KERNELS[type(config)][0](config)


def signature(config):
    """The one Numba signature ``config``'s kernel is compiled for."""
    return KERNELS[type(config)][1](config)
