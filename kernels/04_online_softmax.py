"""Lesson 04: the online softmax. One kernel, no N x N matrix.

Lessons 01-03 needed the whole row of S before the softmax could start (its max and its sum run
over all keys), so S went to global memory. The online softmax gets the same answer one K/V tile
at a time. For one query row i it keeps three running quantities over the keys seen so far:

    m_i   the largest score,
    l_i   the sum of exp(score - m_i),
    acc   the sum of exp(score - m_i) * V[key]            (headdim numbers)

and folds in the next tile, with scores s_1 .. s_Bc and rows V_1 .. V_Bc of V_j, as

    m_new = max(m_i, s_1, ..., s_Bc)
    alpha = exp(m_i - m_new)                  rescales what was summed against the old max
    l_i   = alpha * l_i + sum_c exp(s_c - m_new)
    acc   = alpha * acc + sum_c exp(s_c - m_new) * V_c
    m_i   = m_new

After the last tile, O[i] = acc / l_i: exactly softmax(S[i]) V, never holding more than one tile of S.
(FlashAttention-1 divides by l_i at every step; dividing once at the end is FlashAttention-2's.)

This lesson keeps FlashAttention-1's loop order (the paper's Algorithm 1): the OUTER loop runs over
K/V tiles, the INNER loop over Q tiles. So each row's state (m_i, l_i, acc) must wait in global memory
between K/V tiles, and Q_i, acc, m_i, l_i are read and written again for every K/V tile; and the
whole head is one block: here, one block on the whole GPU. Lesson 05 fixes both.

Threads: one per query row of the current Q tile (block_m threads). Thread t keeps its row of Q_i in
registers; the block shares K_j and V_j in shared memory (lesson 03's ``load_tile``).

Run: python kernels/04_online_softmax.py [--seqlen N] [--seqlen-k M] [--headdim D] [--causal]
"""

import functools
import math

import _common
from numba import cuda, float32

tiles = _common.lesson("03")

# block_m query rows (= threads per block) by block_n keys per tile.
BLOCK_M, BLOCK_N = (8, 8) if _common.SIMULATOR else (64, 16)


@functools.lru_cache(maxsize=None)
def build_online_step(block_n, headdim):
    @cuda.jit(device=True)
    def online_softmax_step(q_row, K_j, V_j, col0, last_key, scale, m_i, l_i, acc):
        """Fold the K/V tile that starts at key ``col0`` into one query row's (m_i, l_i, acc).

        ``q_row``: the row of Q; ``K_j``, ``V_j``: the tiles (block_n x headdim); keys after
        ``last_key`` are masked (past the end, or causal). ``acc`` is updated in place; returns the
        new (m_i, l_i).
        """
        # S_ij for this row: block_n scores, and their max with the old one.
        s_row = cuda.local.array(block_n, float32)
        m_new = m_i
        for c in range(block_n):
            s = float32(-math.inf)
            if col0 + c <= last_key:
                s = float32(0.0)
                for d in range(headdim):
                    s += q_row[d] * K_j[c, d]
                s *= scale
            s_row[c] = s
            m_new = max(m_new, s)
        if m_new == -math.inf:
            return m_i, l_i  # every key so far is masked: nothing to add (and -inf - -inf is NaN)

        # Rescale the old state to the new max (alpha = 0 on the first tile: m_i = -inf).
        alpha = math.exp(m_i - m_new)
        l_new = l_i * alpha
        for d in range(headdim):
            acc[d] *= alpha
        # Add this tile: P_ij = exp(S_ij - m_new); l_i += row sum of P_ij; acc += P_ij V_j.
        for c in range(block_n):
            p = math.exp(s_row[c] - m_new)  # 0 for a masked key
            l_new += p
            for d in range(headdim):
                acc[d] += p * V_j[c, d]
        return m_new, l_new

    return online_softmax_step


@cuda.jit(device=True)
def last_visible_key(i, seqlen_q, seqlen_k, causal):
    """The last key query row i may see: the end of K, or the causal (bottom-right) diagonal."""
    if causal:
        return min(seqlen_k - 1, i + seqlen_k - seqlen_q)
    return seqlen_k - 1


@functools.lru_cache(maxsize=None)
def build_flash1_kernel(block_m, block_n, headdim):
    step = build_online_step(block_n, headdim)

    @cuda.jit
    def flash1_kernel(q, k, v, out, m, l, scale, causal):
        """Grid: one block per head (one head here); block_m threads.

        On entry out = 0, m = -inf, l = 0 (the host fills them): every row's acc, m_i, l_i,
        in global memory.
        """
        t = cuda.threadIdx.x
        seqlen_q, seqlen_k = q.shape[0], k.shape[0]
        K_j = cuda.shared.array((block_n, headdim), float32)
        V_j = cuda.shared.array((block_n, headdim), float32)
        q_row = cuda.local.array(headdim, float32)

        for col0 in range(0, seqlen_k, block_n):  # outer loop: K/V tiles
            tiles.load_tile(K_j, k, col0, 0)
            tiles.load_tile(V_j, v, col0, 0)
            cuda.syncthreads()  # K_j and V_j are complete before anyone reads them
            for row0 in range(0, seqlen_q, block_m):  # inner loop: Q tiles
                i = row0 + t
                if i < seqlen_q:
                    for d in range(headdim):  # Q_i: read again for every K/V tile
                        q_row[d] = q[i, d]
                    last_key = last_visible_key(i, seqlen_q, seqlen_k, causal)
                    # m_i, l_i and acc (= out[i]) come from global memory and go back there.
                    m_i, l_i = step(q_row, K_j, V_j, col0, last_key, scale, m[i], l[i], out[i])
                    m[i] = m_i
                    l[i] = l_i
            cuda.syncthreads()  # everyone is done with K_j, V_j before the next tile overwrites them

        # O = acc / l_i. Each thread finishes the rows it updated itself: no barrier needed.
        for row0 in range(0, seqlen_q, block_m):
            i = row0 + t
            if i < seqlen_q:
                inv_l = float32(1.0) / l[i] if l[i] > 0 else float32(0.0)  # a row that saw no key: 0
                for d in range(headdim):
                    out[i, d] *= inv_l

    return flash1_kernel


def attention(problem, out, m, l):
    p = problem
    out[:] = 0.0  # the running state starts empty: acc = 0, m_i = -inf, l_i = 0
    m[:] = -math.inf
    l[:] = 0.0
    kernel = build_flash1_kernel(BLOCK_M, BLOCK_N, p.headdim)
    kernel[1, BLOCK_M](p.q_dev, p.k_dev, p.v_dev, out, m, l, p.scale, p.causal)


def main(seqlen_q=None, seqlen_k=None, headdim=None, causal=False):
    """Run the lesson and print its report; returns the max error against float64."""
    problem = _common.Problem(seqlen_q, seqlen_k, headdim, causal)
    out = problem.new_output()
    m, l = (_common.device_full((problem.seqlen_q,), 0.0) for _ in range(2))
    seconds = _common.measure(lambda: attention(problem, out, m, l))
    return _common.report(
        f"lesson 04: online softmax, FlashAttention-1 loop order, block_m={BLOCK_M} block_n={BLOCK_N}",
        problem,
        out,
        seconds,
        scratch_bytes=m.nbytes + l.nbytes,
        next_lesson="05 swaps the loops as FlashAttention-2 does: a block owns a Q tile and keeps "
        "m_i, l_i, acc in registers; many blocks; causal tiles above the diagonal skipped.",
    )


if __name__ == "__main__":
    main(**_common.cli(__doc__))
