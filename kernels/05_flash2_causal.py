"""Lesson 05: FlashAttention-2's loop order, and skipping causal tiles.

Lesson 04 ran the K/V tiles in the outer loop, so every row's state (m_i, l_i, acc) went back to
global memory after each tile, and one block did all the work. FlashAttention-2 swaps the loops:

    grid: one block per Q tile Q_i (block_m query rows); thread t owns row t of it
    for each K/V tile j:                   (the only loop)
        load K_j, V_j into shared memory
        fold S_ij = Q_i K_j^T into (m_i, l_i, acc)        lesson 04's online_softmax_step
    O_i = acc / l_i, written once

Now m_i, l_i and acc live in registers for the whole kernel and O_i is written once; there are
seqlen_q / block_m blocks instead of one; and no global scratch at all. (Still one thread per query
row: with one head at seqlen 2048 that is 2048 threads on a GPU that holds over 200,000, so this
lesson moves far less memory than lesson 03 but is not faster there. nbflash's kernels give each row
several threads or a share of a warp's tensor cores, and run batch x heads times as many blocks.)

Causal (bottom-right aligned: query i sees key j when j <= i + seqlen_k - seqlen_q): the last row of
the block, row0 + block_m - 1, sees keys up to row0 + block_m - 1 + seqlen_k - seqlen_q. Every K/V
tile after that one is masked for every row of the block, so the loop stops there: about half the
work of a square causal problem is never done. Only the tiles that cross the diagonal need the mask.

Run: python kernels/05_flash2_causal.py [--seqlen N] [--seqlen-k M] [--headdim D] [--causal]
"""

import functools
import math

import _common
from numba import cuda, float32

tiles = _common.lesson("03")
online = _common.lesson("04")

BLOCK_M, BLOCK_N = (8, 8) if _common.SIMULATOR else (64, 16)


def key_end(row0, block_m, seqlen_q, seqlen_k, causal):
    """One past the last key that any row of the Q tile starting at ``row0`` may see."""
    if not causal:
        return seqlen_k
    last_row = min(row0 + block_m, seqlen_q) - 1
    return max(0, min(seqlen_k, last_row + 1 + seqlen_k - seqlen_q))


key_end_device = cuda.jit(device=True)(key_end)  # the same rule, compiled for the kernel


@functools.lru_cache(maxsize=None)
def build_flash2_kernel(block_m, block_n, headdim):
    step = online.build_online_step(block_n, headdim)

    @cuda.jit
    def flash2_kernel(q, k, v, out, scale, causal):
        """Grid: one block per Q tile; block_m threads, thread t owns query row row0 + t."""
        t = cuda.threadIdx.x
        row0 = cuda.blockIdx.x * block_m
        i = row0 + t
        seqlen_q, seqlen_k = q.shape[0], k.shape[0]
        K_j = cuda.shared.array((block_n, headdim), float32)
        V_j = cuda.shared.array((block_n, headdim), float32)

        # This row's state, in registers for the whole kernel; its row of Q_i, read once.
        q_row = cuda.local.array(headdim, float32)
        acc = cuda.local.array(headdim, float32)
        for d in range(headdim):
            q_row[d] = q[i, d] if i < seqlen_q else float32(0.0)
            acc[d] = 0.0
        m_i = float32(-math.inf)
        l_i = float32(0.0)
        last_key = online.last_visible_key(i, seqlen_q, seqlen_k, causal)

        # K/V tiles to visit: all of them, or (causal) up to the one holding the last key that the
        # block's last row sees. Later tiles are masked for every row in the block: skip them.
        for col0 in range(0, key_end_device(row0, block_m, seqlen_q, seqlen_k, causal), block_n):
            tiles.load_tile(K_j, k, col0, 0)
            tiles.load_tile(V_j, v, col0, 0)
            cuda.syncthreads()  # K_j and V_j are complete before anyone reads them
            if i < seqlen_q:
                m_i, l_i = step(q_row, K_j, V_j, col0, last_key, scale, m_i, l_i, acc)
            cuda.syncthreads()  # everyone is done with K_j, V_j before the next tile overwrites them

        # O_i = acc / l_i, written once. A row that saw no key (l_i = 0) gets 0.
        if i < seqlen_q:
            inv_l = float32(1.0) / l_i if l_i > 0 else float32(0.0)
            for d in range(headdim):
                out[i, d] = acc[d] * inv_l

    return flash2_kernel


def visited_tiles(seqlen_q, seqlen_k, causal):
    """(K/V tiles the kernel visits, summed over blocks; tiles there are), from the same rule."""
    q_blocks = (seqlen_q + BLOCK_M - 1) // BLOCK_M
    k_tiles = (seqlen_k + BLOCK_N - 1) // BLOCK_N
    visited = sum(
        (key_end(row0, BLOCK_M, seqlen_q, seqlen_k, causal) + BLOCK_N - 1) // BLOCK_N
        for row0 in range(0, seqlen_q, BLOCK_M)
    )
    return visited, q_blocks * k_tiles


def attention(problem, out):
    p = problem
    kernel = build_flash2_kernel(BLOCK_M, BLOCK_N, p.headdim)
    kernel[(p.seqlen_q + BLOCK_M - 1) // BLOCK_M, BLOCK_M](p.q_dev, p.k_dev, p.v_dev, out, p.scale, p.causal)


def main(seqlen_q=None, seqlen_k=None, headdim=None, causal=False):
    """Run the lesson and print its report; returns the max error against float64."""
    problem = _common.Problem(seqlen_q, seqlen_k, headdim, causal)
    out = problem.new_output()
    seconds = _common.measure(lambda: attention(problem, out))
    visited, total = visited_tiles(problem.seqlen_q, problem.seqlen_k, problem.causal)
    return _common.report(
        f"lesson 05: FlashAttention-2 loop order, block_m={BLOCK_M} block_n={BLOCK_N}",
        problem,
        out,
        seconds,
        scratch_bytes=0,
        notes=[f"K/V tiles visited          {visited} of {total} (block, tile) pairs"],
        next_lesson="06 reads nbflash's own forward kernel: the same algorithm on tensor cores "
        "(mma.sync), with its tile primitives.",
    )


if __name__ == "__main__":
    main(**_common.cli(__doc__))
