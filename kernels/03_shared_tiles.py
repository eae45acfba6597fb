"""Lesson 03: Q, K, V (and P) tiles in shared memory.

In lessons 01-02 every thread read its own operands from global memory: the thread computing
S[i, j] read all of row i of Q and row j of K, so each row of Q was read seqlen_k times and each
row of K seqlen_q times. Here a block computes a whole tile and first copies the tile's operands
into shared memory (on-chip, about 100x the bandwidth of global memory), once:

    scores:  block (x, y) computes the block_m x block_n tile S_ij of S, from the tiles
             Q_i = Q[i*block_m : (i+1)*block_m] and K_j = K[j*block_n : (j+1)*block_n];
    P V:     block i computes the block_m rows O_i of O, looping over j: P_ij and V_j in shared
             memory, O_i += P_ij V_j.

Each element of Q and K is now read from global memory seqlen_k / block_n (resp. seqlen_q / block_m)
times instead of seqlen_k (resp. seqlen_q) times. The softmax between the two is lesson 02's; S and P
still live in global memory. The tile sizes are compile-time constants, captured by a factory
(``build_*``), because a shared array's shape must be known when the kernel compiles.

Run: python kernels/03_shared_tiles.py [--seqlen N] [--seqlen-k M] [--headdim D] [--causal]
"""

import functools
import math

import _common
from numba import cuda, float32

fused = _common.lesson("02")

# Tile sizes: block_m query rows by block_n keys; a block has block_n x block_m threads, one per
# element of an S tile. Smaller in the simulator, which runs each CUDA thread as a Python thread.
BLOCK_M = BLOCK_N = 8 if _common.SIMULATOR else 16


@cuda.jit(device=True)
def load_tile(tile, src, row0, col0):
    """Copy ``src[row0 : row0 + rows, col0 : col0 + cols]`` into the shared ``tile`` (rows x cols),
    with zeros where the window runs past the end of ``src``.

    Every thread of the block takes part: the tile is split into elements in row-major order and
    thread t copies elements t, t + nthreads, ... so neighbouring threads read neighbouring
    addresses (coalesced). The caller must cuda.syncthreads() before reading the tile.
    """
    rows, cols = tile.shape
    nthreads = cuda.blockDim.x * cuda.blockDim.y
    for e in range(cuda.threadIdx.y * cuda.blockDim.x + cuda.threadIdx.x, rows * cols, nthreads):
        r = row0 + e // cols
        c = col0 + e % cols
        tile[e // cols, e % cols] = src[r, c] if r < src.shape[0] and c < src.shape[1] else float32(0.0)


@functools.lru_cache(maxsize=None)
def build_scores_kernel(block_m, block_n, headdim):
    @cuda.jit
    def scores_tiled_kernel(q, k, s, scale, causal):
        """S_ij = scale * Q_i K_j^T. Grid: (key tiles, query tiles); threads (block_n, block_m)."""
        c, r = cuda.threadIdx.x, cuda.threadIdx.y  # this thread's element of the tile
        i = cuda.blockIdx.y * block_m + r  # query row
        j = cuda.blockIdx.x * block_n + c  # key column
        seqlen_q, seqlen_k = s.shape

        Q_i = cuda.shared.array((block_m, headdim), float32)
        K_j = cuda.shared.array((block_n, headdim), float32)
        load_tile(Q_i, q, cuda.blockIdx.y * block_m, 0)
        load_tile(K_j, k, cuda.blockIdx.x * block_n, 0)
        cuda.syncthreads()  # the tiles are complete: each thread reads rows that others copied

        if i >= seqlen_q or j >= seqlen_k:
            return
        if causal and j > i + seqlen_k - seqlen_q:
            s[i, j] = -math.inf
            return
        dot = float32(0.0)
        for d in range(headdim):
            dot += Q_i[r, d] * K_j[c, d]  # both from shared memory
        s[i, j] = dot * scale

    return scores_tiled_kernel


@functools.lru_cache(maxsize=None)
def build_pv_kernel(block_m, block_n, headdim):
    cols_per_thread = (headdim + block_n - 1) // block_n  # thread (c, r) owns O_i[r, c::block_n]

    @cuda.jit
    def pv_tiled_kernel(p, v, out):
        """O_i = sum over j of P_ij V_j. Grid: one block per query tile; threads (block_n, block_m)."""
        c, r = cuda.threadIdx.x, cuda.threadIdx.y
        row0 = cuda.blockIdx.x * block_m
        seqlen_k = p.shape[1]

        P_ij = cuda.shared.array((block_m, block_n), float32)
        V_j = cuda.shared.array((block_n, headdim), float32)
        acc = cuda.local.array(cols_per_thread, float32)  # this thread's part of O_i, in registers
        for t in range(cols_per_thread):
            acc[t] = 0.0

        for col0 in range(0, seqlen_k, block_n):
            load_tile(P_ij, p, row0, col0)
            load_tile(V_j, v, col0, 0)
            cuda.syncthreads()  # the tiles are complete before anyone reads them
            for t in range(cols_per_thread):
                d = c + t * block_n
                if d < headdim:
                    for cc in range(block_n):
                        acc[t] += P_ij[r, cc] * V_j[cc, d]
            cuda.syncthreads()  # everyone is done with these tiles before the next loads overwrite them

        if row0 + r < out.shape[0]:
            for t in range(cols_per_thread):
                d = c + t * block_n
                if d < headdim:
                    out[row0 + r, d] = acc[t]

    return pv_tiled_kernel


def attention(problem, out, s_mat):
    """Tiled scores, lesson 02's softmax (in place), tiled P V."""
    p = problem
    scores_kernel = build_scores_kernel(BLOCK_M, BLOCK_N, p.headdim)
    pv_kernel = build_pv_kernel(BLOCK_M, BLOCK_N, p.headdim)
    q_tiles = (p.seqlen_q + BLOCK_M - 1) // BLOCK_M
    k_tiles = (p.seqlen_k + BLOCK_N - 1) // BLOCK_N
    scores_kernel[(k_tiles, q_tiles), (BLOCK_N, BLOCK_M)](p.q_dev, p.k_dev, s_mat, p.scale, p.causal)
    fused.softmax_rows_kernel[p.seqlen_q, fused.THREADS](s_mat)
    pv_kernel[q_tiles, (BLOCK_N, BLOCK_M)](s_mat, p.v_dev, out)


def main(seqlen_q=None, seqlen_k=None, headdim=None, causal=False):
    """Run the lesson and print its report; returns the max error against float64."""
    problem = _common.Problem(seqlen_q, seqlen_k, headdim, causal)
    out = problem.new_output()
    s_mat = _common.device_full((problem.seqlen_q, problem.seqlen_k), 0.0)
    seconds = _common.measure(lambda: attention(problem, out, s_mat))
    return _common.report(
        f"lesson 03: shared-memory tiles, block_m={BLOCK_M} block_n={BLOCK_N}",
        problem,
        out,
        seconds,
        scratch_bytes=s_mat.nbytes,
        next_lesson="04 fuses all three steps into one kernel with the online softmax "
        "(running max m_i, running sum l_i, rescaled acc): no N x N matrix at all.",
    )


if __name__ == "__main__":
    main(**_common.cli(__doc__))
