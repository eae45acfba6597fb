"""The launch path's host-side pieces that need no GPU: the parameter buffer and its layout."""

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
