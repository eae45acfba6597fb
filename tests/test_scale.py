"""Tensors of more than 2^31 elements: every index and offset that can pass 2^31 is 64-bit.

GPU only, and opt-in (``NBFLASH_SCALE_TESTS=1``): each case allocates 20-45 GB of device memory.
The attention is kept cheap by a short causal window, so a case costs its memory traffic, not
FLOPs; the results are checked against float64 on slices of the problem that the window makes
independent of the rest: with a window of ``W`` keys to the left, rows ``a .. a + L - 1`` see only
keys ``a - W .. a + L - 1``, so their outputs (and dq) are those of that local problem, and the
gradients of keys ``a .. a + L - W - 1`` come only from those rows. The slices sit at the start,
across the 2^31-element boundary and at the end of the arrays.

    NBFLASH_SCALE_TESTS=1 pytest -m gpu tests/test_scale.py -n 0
"""

import os
import sys

import numpy as np
import pytest

import nbflash
from tests.conftest import SIMULATOR

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from long_sequence import random_half  # noqa: E402  (scripts/ is not a package)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(SIMULATOR or os.environ.get("NBFLASH_SCALE_TESTS") != "1",
                       reason="needs a GPU with ~45 GB free and NBFLASH_SCALE_TESTS=1"),
]

WINDOW = 96  # keys to the left of each row (and the row itself): causal, window (WINDOW, 0)
SLICE = 256  # rows per checked slice


def _slices(seqlen, nheads, headdim):
    """Row starts: the first slice, the one holding the 2^31st element of q, and the last."""
    boundary_row = (1 << 31) // (nheads * headdim)
    return [WINDOW, max(WINDOW, boundary_row - SLICE // 2), seqlen - SLICE]


def _local(x, start, stop):
    return x[:, start:stop].get().astype(np.float64)


def test_forward_and_backward_past_2_31_elements():
    import cupy

    batch, seqlen, nheads, headdim = 1, (1 << 20) + 4096, 16, 128  # q, k, v: 2^31 + 2^23 elements each
    assert batch * seqlen * nheads * headdim > 1 << 31
    q, k, v = (random_half(cupy, (batch, seqlen, nheads, headdim), seed) for seed in (1, 2, 3))
    window = (WINDOW, 0)
    out, lse = nbflash.flash_attn_func(q, k, v, causal=True, window_size=window, return_lse=True)
    dout = random_half(cupy, out.shape, 4)
    dq, dk, dv = nbflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, window_size=window)
    for a in _slices(seqlen, nheads, headdim):
        rows, keys = (a, a + SLICE), (a - WINDOW, a + SLICE)
        q_l, k_l, v_l, do_l = _local(q, *rows), _local(k, *keys), _local(v, *keys), _local(dout, *rows)
        ref_out, ref_lse = nbflash.attention_reference(q_l, k_l, v_l, window_size=window, return_lse=True)
        ref_dq, ref_dk, ref_dv = nbflash.attention_reference_backward(do_l, q_l, k_l, v_l, window_size=window)
        np.testing.assert_allclose(_local(out, *rows), ref_out, atol=2e-2, err_msg=f"out at row {a}")
        np.testing.assert_allclose(lse[:, :, a:a + SLICE].get(), ref_lse, atol=1e-3, err_msg=f"lse at row {a}")
        np.testing.assert_allclose(_local(dq, *rows), ref_dq, atol=5e-2, err_msg=f"dq at row {a}")
        complete = slice(WINDOW, SLICE)  # keys a .. a + SLICE - WINDOW - 1: every row that sees them is in the slice
        np.testing.assert_allclose(_local(dk, a, a + SLICE - WINDOW), ref_dk[:, complete], atol=5e-2,
                                   err_msg=f"dk at key {a}")
        np.testing.assert_allclose(_local(dv, a, a + SLICE - WINDOW), ref_dv[:, complete], atol=5e-2,
                                   err_msg=f"dv at key {a}")


def test_batch_past_2_31_elements():
    """The batch dimension carries the large offsets: many short sequences."""
    import cupy

    batch, seqlen, nheads, headdim = 4100, 512, 8, 128  # 2^31 + 2^22 elements each
    assert batch * seqlen * nheads * headdim > 1 << 31
    q, k, v = (random_half(cupy, (batch, seqlen, nheads, headdim), seed) for seed in (5, 6, 7))
    out = nbflash.flash_attn_func(q, k, v, causal=True)
    for b in (0, (1 << 31) // (seqlen * nheads * headdim), batch - 1):
        want = nbflash.attention_reference(q[b:b + 1].get(), k[b:b + 1].get(), v[b:b + 1].get(), causal=True)
        np.testing.assert_allclose(out[b:b + 1].get().astype(np.float64), want, atol=2e-2, err_msg=f"batch {b}")


@pytest.mark.parametrize("page_size", [None, 16])
def test_decode_cache_past_2_31_elements(page_size):
    """One query token against a KV cache of more than 2^31 elements, contiguous and paged."""
    import cupy

    batch, capacity, nheads, nheads_k, headdim = 2, (1 << 20) + 256, 32, 8, 128  # cache: 2^31 + 2^20 elements
    rng = np.random.default_rng(8)
    if page_size is None:
        shape, table = (batch, capacity, nheads_k, headdim), None
    else:
        per_seq = capacity // page_size
        shape = (batch * per_seq, page_size, nheads_k, headdim)
        table = cupy.asarray(rng.permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int32))
    assert int(np.prod(shape)) > 1 << 31
    k_cache, v_cache = random_half(cupy, shape, 9), random_half(cupy, shape, 10)
    q = random_half(cupy, (batch, 1, nheads, headdim), 11)
    lengths = np.array([capacity, capacity - 1000], np.int32)
    out = nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cupy.asarray(lengths),
                                          block_table=table)
    for b in range(batch):
        if table is None:
            keys, values = k_cache[b, :lengths[b]], v_cache[b, :lengths[b]]
        else:
            pages = table[b].get()
            keys = k_cache[pages].reshape(-1, nheads_k, headdim)[:lengths[b]]
            values = v_cache[pages].reshape(-1, nheads_k, headdim)[:lengths[b]]
        want = nbflash.attention_reference(q[b:b + 1].get(), keys[None].get(), values[None].get())
        np.testing.assert_allclose(out[b:b + 1].get().astype(np.float64), want, atol=2e-2,
                                   err_msg=f"sequence {b}, page_size={page_size}")
