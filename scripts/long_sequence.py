"""One very long sequence, forward and backward: time and device memory, to show O(N) memory.

    python scripts/long_sequence.py                       # 1M tokens, 8 heads, headdim 128, fp16, causal
    python scripts/long_sequence.py --seqlen 262144 --no-backward

For each run it prints the time of the forward and of the backward (CUDA events, one warm-up call
first, which also compiles), the TFLOP/s over the causal half, and the memory the call added on
top of its inputs (how far CuPy's pool grew during the call): attention that stored the N x N scores
would need seqlen^2 * nheads * 2 bytes (16 TiB at 1M tokens and 8 heads). A correctness check on
the last rows (a slice of queries against every key, in float64) runs unless --no-check.
Needs a GPU.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def random_half(cupy, shape, seed):
    """A large float16 array of N(0, 1) values, drawn a chunk at a time (no float32 copy of it all)."""
    x = cupy.empty(shape, np.float16)
    flat = x.reshape(-1)
    rng = cupy.random.default_rng(seed)
    step = 1 << 28
    for start in range(0, flat.size, step):
        stop = min(flat.size, start + step)
        flat[start:stop] = rng.standard_normal(stop - start, dtype=np.float32).astype(np.float16)
    return x


def _timed(cupy, fn):
    """(result, milliseconds, bytes the memory pool grew by during the call): the pool's cached
    blocks are released first, so the growth is what the call held at its peak (temporaries freed
    and reused within it count once)."""
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    result = fn()
    stop.record()
    stop.synchronize()
    return result, cupy.cuda.get_elapsed_time(start, stop), pool.total_bytes() - before


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=1 << 20)
    parser.add_argument("--nheads", type=int, default=8)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args(argv)

    import cupy

    import nbflash

    n, h, d = args.seqlen, args.nheads, args.headdim
    q, k, v = (random_half(cupy, (1, n, h, d), seed) for seed in (1, 2, 3))
    inputs = 3 * q.nbytes
    forward = lambda: nbflash.flash_attn_func(q, k, v, causal=True, return_lse=True)  # noqa: E731
    (out, lse) = forward()  # warm-up (compiles on a cold cache)
    del out, lse
    (out, lse), fwd_ms, fwd_extra = _timed(cupy, forward)
    flops = 4 * n * n * d * h / 2  # causal: half the scores
    print(f"seqlen {n}, {h} heads, headdim {d}, fp16, causal; inputs {inputs / 2**30:.1f} GiB")
    print(f"forward : {fwd_ms:9.1f} ms  {flops / fwd_ms / 1e9:6.1f} TFLOP/s  "
          f"+{fwd_extra / 2**30:.2f} GiB (out and lse)")
    if not args.no_backward:
        dout = random_half(cupy, out.shape, 4)
        backward = lambda: nbflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True)  # noqa: E731
        grads = backward()
        del grads
        grads, bwd_ms, bwd_extra = _timed(cupy, backward)
        print(f"backward: {bwd_ms:9.1f} ms  {2.5 * flops / bwd_ms / 1e9:6.1f} TFLOP/s  "
              f"+{bwd_extra / 2**30:.2f} GiB (dq, dk, dv and the float32 dq accumulator)")
    naive = n * n * h * 2
    print(f"an N x N score matrix would be {naive / 2**40:.1f} TiB")
    if not args.no_check:
        rows = 64
        qs = q[:, n - rows:].get().astype(np.float64)
        ks, vs = k.get().astype(np.float64), v.get().astype(np.float64)
        # The last `rows` queries see every key but the last few (causal, bottom-right aligned).
        want = nbflash.attention_reference(qs, ks, vs, causal=True)
        error = float(np.abs(out[:, n - rows:].get().astype(np.float64) - want).max())
        print(f"max error of the last {rows} rows against float64: {error:.2e}")
        return 0 if error < 2e-2 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
