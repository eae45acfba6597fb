"""Lesson 01: naive attention in three kernels, the N x N matrix in global memory.

    O = softmax(scale * Q K^T) V        Q: (seqlen_q, d), K and V: (seqlen_k, d), scale = 1/sqrt(d)

computed the way the formula reads, one kernel per step:

    1. scores_kernel   S = scale * Q K^T           one thread per element of S
    2. softmax_kernel  P = softmax(S), row by row   one thread per row
    3. pv_kernel       O = P V                      one thread per element of O

S and P are seqlen_q x seqlen_k float32 matrices in global memory: at seqlen 8192 that is 256 MiB each,
per head. Every later lesson removes some of that traffic; lesson 04 removes the matrices.

Causal masking is bottom-right aligned, as in flash-attn: query i sees key j when
j <= i + seqlen_k - seqlen_q. A query row that sees no key at all gets output 0.

Run: python kernels/01_naive.py [--seqlen N] [--seqlen-k M] [--headdim D] [--causal]
"""

import math

import _common
from numba import cuda, float32

THREADS_2D = (16, 16)  # threads per block for the two kernels that map a 2-D grid over a matrix
THREADS_1D = 128  # threads per block for the row softmax


@cuda.jit
def scores_kernel(q, k, s, scale, causal):
    # x runs along a row of S, so neighbouring threads write neighbouring addresses.
    j, i = cuda.grid(2)  # i: query row, j: key column
    seqlen_q, seqlen_k = s.shape
    if i >= seqlen_q or j >= seqlen_k:
        return  # the grid is rounded up to whole blocks; these threads have no element
    if causal and j > i + seqlen_k - seqlen_q:
        s[i, j] = -math.inf  # masked: exp(-inf) = 0 in the softmax
        return
    dot = float32(0.0)
    for d in range(q.shape[1]):
        dot += q[i, d] * k[j, d]
    s[i, j] = dot * scale


@cuda.jit
def softmax_kernel(s, p):
    i = cuda.grid(1)  # this thread's row
    if i >= s.shape[0]:
        return
    seqlen_k = s.shape[1]
    # Pass 1: the row max. Subtracting it keeps every exp() <= 1 (no overflow); the result is the same.
    row_max = float32(-math.inf)
    for j in range(seqlen_k):
        row_max = max(row_max, s[i, j])
    if row_max == -math.inf:
        row_max = float32(0.0)  # a causal row that sees no key: all its exp() are 0, no NaN from inf-inf
    # Pass 2: exponentials and their sum.
    row_sum = float32(0.0)
    for j in range(seqlen_k):
        e = math.exp(s[i, j] - row_max)
        p[i, j] = e
        row_sum += e
    # Pass 3: normalise. (A row that sees no key has row_sum 0; its P row, and so its output, stays 0.)
    inv_sum = float32(1.0) / row_sum if row_sum > 0 else float32(0.0)
    for j in range(seqlen_k):
        p[i, j] *= inv_sum


@cuda.jit
def pv_kernel(p, v, out):
    d, i = cuda.grid(2)  # i: query row, d: feature; x runs along a row of O
    if i >= out.shape[0] or d >= out.shape[1]:
        return
    acc = float32(0.0)
    for j in range(v.shape[0]):
        acc += p[i, j] * v[j, d]
    out[i, d] = acc


def blocks_for(shape, threads):
    """Enough blocks of ``threads`` to cover ``shape`` (x first, as cuda.grid returns it)."""
    return tuple((n + t - 1) // t for n, t in zip(shape, threads))


def attention(problem, out, s_mat, p_mat):
    """Launch the three kernels: S into ``s_mat``, P into ``p_mat``, O into ``out``."""
    p = problem
    scores_kernel[blocks_for((p.seqlen_k, p.seqlen_q), THREADS_2D), THREADS_2D](
        p.q_dev, p.k_dev, s_mat, p.scale, p.causal
    )
    softmax_kernel[blocks_for((p.seqlen_q,), (THREADS_1D,)), THREADS_1D](s_mat, p_mat)
    pv_kernel[blocks_for((p.headdim, p.seqlen_q), THREADS_2D), THREADS_2D](p_mat, p.v_dev, out)


def main(seqlen_q=None, seqlen_k=None, headdim=None, causal=False):
    """Run the lesson and print its report; returns the max error against float64."""
    problem = _common.Problem(seqlen_q, seqlen_k, headdim, causal)
    out = problem.new_output()
    n_by_n = (problem.seqlen_q, problem.seqlen_k)
    s_mat, p_mat = _common.device_full(n_by_n, 0.0), _common.device_full(n_by_n, 0.0)
    seconds = _common.measure(lambda: attention(problem, out, s_mat, p_mat))
    return _common.report(
        "lesson 01: naive attention, three kernels, S and P in global memory",
        problem,
        out,
        seconds,
        scratch_bytes=s_mat.nbytes + p_mat.nbytes,
        next_lesson="02 makes the softmax one block per row with shared-memory reductions, "
        "writing P over S (one N x N matrix instead of two).",
    )


if __name__ == "__main__":
    main(**_common.cli(__doc__))
