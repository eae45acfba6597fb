"""The launch path's host-side pieces that need no GPU: the parameter buffer and its layout."""

import ctypes
import struct
from types import SimpleNamespace

import numpy as np

from nbflash import launch

SIGNATURE = "void(float16[:,:,:,:], float16[:,:,:,::1], float32[:,:,::1], float32, float32)"


def fake_array(shape, itemsize, pointer):
    """What the launch reads from a CuPy array, and nothing more."""
    strides = tuple(int(s) * itemsize for s in np.cumprod((1,) + tuple(shape[:0:-1]))[::-1])
    return SimpleNamespace(
        shape=tuple(shape), strides=strides, size=int(np.prod(shape)), itemsize=itemsize,
        data=SimpleNamespace(ptr=pointer),
    )


def unpacked(parameters):
    return struct.unpack(launch._parameter_layout(SIGNATURE)[0], bytes(parameters.buffer))


def test_layout_matches_numba_flattening():
    fields, offsets = launch._parameter_layout(SIGNATURE)
    # Two 4-dim arrays (5 + 8 words each), one 3-dim array (5 + 6), two float32 scalars.
    assert len(offsets) == 13 + 13 + 11 + 2 and struct.calcsize(fields) == 8 * len(offsets)
    assert launch._pointer_words(SIGNATURE) == [4, 17, 30]


def test_repeat_call_rewrites_pointers_and_scalars_only():
    a = [fake_array((2, 5, 3, 8), 2, 0x1000), fake_array((2, 5, 3, 8), 2, 0x2000), fake_array((2, 3, 5), 4, 0x3000)]
    b = [fake_array((2, 5, 3, 8), 2, 0x5000), fake_array((2, 5, 3, 8), 2, 0x6000), fake_array((2, 3, 5), 4, 0x7000)]
    fresh, reused = launch.ParameterBuffer(SIGNATURE), launch.ParameterBuffer(SIGNATURE)
    reused.write(a, (1.0, 2.0))
    reused.write(b, (0.5, 0.25))  # same shapes and strides: the fast path
    fresh.write(b, (0.5, 0.25))  # a first call: every field packed
    assert bytes(reused.buffer) == bytes(fresh.buffer)
    values = unpacked(reused)
    assert [values[i] for i in launch._pointer_words(SIGNATURE)] == [0x5000, 0x6000, 0x7000]
    assert values[-2:] == (0.5, 0.25)


def test_new_shape_repacks_everything():
    parameters = launch.ParameterBuffer(SIGNATURE)
    parameters.write([fake_array((2, 5, 3, 8), 2, 16)] * 2 + [fake_array((2, 3, 5), 4, 32)], (1.0, 1.0))
    parameters.write([fake_array((1, 7, 3, 8), 2, 48)] * 2 + [fake_array((1, 3, 7), 4, 64)], (1.0, 1.0))
    values = unpacked(parameters)
    assert values[2:9] == (168, 2, 48, 1, 7, 3, 8)  # nitems, itemsize, data, shape
    assert values[9:13] == (336, 48, 16, 2)  # strides in bytes


def test_layout_key_skips_reading_shapes_and_strides():
    """The same layout_key as the previous write: only pointers and scalars are read; a new key (or
    None) falls back to comparing shapes and strides, and a new layout repacks everything."""
    key = object()
    a = [fake_array((2, 5, 3, 8), 2, 0x1000)] * 2 + [fake_array((2, 3, 5), 4, 0x3000)]
    parameters = launch.ParameterBuffer(SIGNATURE)
    parameters.write(a, (1.0, 2.0), key)
    pointers_only = [SimpleNamespace(data=SimpleNamespace(ptr=p)) for p in (0x5000, 0x6000, 0x7000)]
    parameters.write(pointers_only, (0.5, 0.25), key)  # would fail if shape or strides were read
    fresh = launch.ParameterBuffer(SIGNATURE)
    fresh.write([fake_array((2, 5, 3, 8), 2, 0x5000), fake_array((2, 5, 3, 8), 2, 0x6000),
                 fake_array((2, 3, 5), 4, 0x7000)], (0.5, 0.25))
    assert bytes(parameters.buffer) == bytes(fresh.buffer)
    moved = [fake_array((1, 7, 3, 8), 2, 48)] * 2 + [fake_array((1, 3, 7), 4, 64)]
    parameters.write(moved, (1.0, 1.0), object())  # another key: layouts compared, then repacked
    assert unpacked(parameters)[2:9] == (168, 2, 48, 1, 7, 3, 8)


def test_launch_config_matches_cuda_h():
    """CUlaunchConfig: seven unsigned ints, then the stream pointer on an 8-byte boundary, the
    attribute pointer and their count (cuda.h, CUDA 12)."""
    config = launch.LaunchConfig
    offsets = [getattr(config, name).offset for name, _ in config._fields_]
    assert offsets == [0, 4, 8, 12, 16, 20, 24, 32, 40, 48]
    assert ctypes.sizeof(config) == 56


def test_params_tuple_flattens_into_int32_scalars():
    """A variant's params tuple (int32 window sizes) follows the float32 scale, each scalar in an
    8-byte slot, as Numba flattens tuple arguments."""
    signature = "void(float16[:,:,:,:], float32[:,:,::1], float32, Tuple((int32, int32)))"
    fields, offsets = launch._parameter_layout(signature)
    assert fields.endswith("f4xi4xi4x") and len(offsets) == 13 + 11 + 3
    parameters = launch.ParameterBuffer(signature)
    arrays = [fake_array((2, 5, 3, 8), 2, 0x1000), fake_array((2, 3, 5), 4, 0x3000)]
    parameters.write(arrays, (0.5, 7, -3))
    assert struct.unpack(fields, bytes(parameters.buffer))[-3:] == (0.5, 7, -3)
    parameters.write(arrays, (0.25, 100, 0))  # same layout: only pointers and scalars rewritten
    assert struct.unpack(fields, bytes(parameters.buffer))[-3:] == (0.25, 100, 0)
    assert launch._flat_arguments("void(float32[::1], float32, Tuple(()))") == [1, "float32"]
