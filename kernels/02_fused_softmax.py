"""Lesson 02: a fused row softmax, one block per row, reductions in shared memory.

Lesson 01's softmax gave each row to one thread, which walked its row three times on its own; a
row of 8192 scores was 24576 dependent steps for one thread while its neighbours did the same on
other rows, each touching addresses far from the others'. Here a whole block works on one row:

    - each thread walks a strided slice of the row (thread t reads t, t + THREADS, ...), so the
      block's reads are contiguous in memory (coalesced);
    - the block combines its threads' partial max (then partial sum) with a tree reduction in shared
      memory: log2(THREADS) steps, a barrier after each;
    - P is written over S, in place: one N x N matrix instead of two.

The scores and P V kernels are lesson 01's, unchanged.

Run: python kernels/02_fused_softmax.py [--seqlen N] [--seqlen-k M] [--headdim D] [--causal]
"""

import math

import _common
from numba import cuda, float32

naive = _common.lesson("01")

# Threads per block (one block per row); a power of two, for the tree reduction. Fewer in the
# simulator, which runs every CUDA thread as a Python thread.
THREADS = 32 if _common.SIMULATOR else 256


@cuda.jit(device=True)
def block_max(partial):
    """The max of ``partial[0:THREADS]``, returned to every thread of the block."""
    t = cuda.threadIdx.x
    cuda.syncthreads()  # every thread has written its partial value
    stride = THREADS // 2
    while stride > 0:
        if t < stride:
            partial[t] = max(partial[t], partial[t + stride])
        cuda.syncthreads()  # this level is complete before the next level reads it
        stride //= 2
    result = partial[0]
    cuda.syncthreads()  # everyone has read the result before ``partial`` is reused
    return result


@cuda.jit(device=True)
def block_sum(partial):
    """The sum of ``partial[0:THREADS]``, returned to every thread of the block."""
    t = cuda.threadIdx.x
    cuda.syncthreads()  # every thread has written its partial value
    stride = THREADS // 2
    while stride > 0:
        if t < stride:
            partial[t] += partial[t + stride]
        cuda.syncthreads()  # this level is complete before the next level reads it
        stride //= 2
    result = partial[0]
    cuda.syncthreads()  # everyone has read the result before ``partial`` is reused
    return result


@cuda.jit
def softmax_rows_kernel(s):
    """Softmax of each row of ``s``, in place. Grid: one block per row; THREADS threads per block."""
    i = cuda.blockIdx.x  # this block's row
    t = cuda.threadIdx.x
    seqlen_k = s.shape[1]
    partial = cuda.shared.array(THREADS, float32)  # one slot per thread, for the reductions

    # Row max: each thread over its slice, then across the block.
    m = float32(-math.inf)
    for j in range(t, seqlen_k, THREADS):
        m = max(m, s[i, j])
    partial[t] = m
    row_max = block_max(partial)
    if row_max == -math.inf:
        row_max = float32(0.0)  # a causal row that sees no key: all its exp() are 0, no NaN

    # Exponentials, written in place, and their sum.
    total = float32(0.0)
    for j in range(t, seqlen_k, THREADS):
        e = math.exp(s[i, j] - row_max)
        s[i, j] = e
        total += e
    partial[t] = total
    row_sum = block_sum(partial)

    # Normalise. Each thread rescales only the elements it wrote itself, so no barrier is needed.
    inv_sum = float32(1.0) / row_sum if row_sum > 0 else float32(0.0)
    for j in range(t, seqlen_k, THREADS):
        s[i, j] *= inv_sum


def attention(problem, out, s_mat):
    """Scores, softmax in place, P V: S and then P live in ``s_mat``."""
    p = problem
    threads = naive.THREADS_2D
    naive.scores_kernel[naive.blocks_for((p.seqlen_k, p.seqlen_q), threads), threads](
        p.q_dev, p.k_dev, s_mat, p.scale, p.causal
    )
    softmax_rows_kernel[p.seqlen_q, THREADS](s_mat)
    naive.pv_kernel[naive.blocks_for((p.headdim, p.seqlen_q), threads), threads](s_mat, p.v_dev, out)


def main(seqlen_q=None, seqlen_k=None, headdim=None, causal=False):
    """Run the lesson and print its report; returns the max error against float64."""
    problem = _common.Problem(seqlen_q, seqlen_k, headdim, causal)
    out = problem.new_output()
    s_mat = _common.device_full((problem.seqlen_q, problem.seqlen_k), 0.0)
    seconds = _common.measure(lambda: attention(problem, out, s_mat))
    return _common.report(
        "lesson 02: fused row softmax, one block per row, P written over S",
        problem,
        out,
        seconds,
        scratch_bytes=s_mat.nbytes,
        next_lesson="03 stages Q, K, V and P in shared-memory tiles, so a block loads each "
        "element from global memory once instead of once per thread.",
    )


if __name__ == "__main__":
    main(**_common.cli(__doc__))
