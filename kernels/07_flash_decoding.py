"""Lesson 07: flash-decoding. Split the keys across blocks, then merge the partial results.

Decoding generates one token at a time: each step has ONE query token per head (seqlen_q = 1)
against the whole key/value cache of the sequence so far, often tens of thousands of keys. Lesson
05's grid is one block per (head, query tile), so at batch 1 a decode step runs `nheads` blocks:
16 blocks on a GPU with 132 multiprocessors, each of which could hold several. Most of the GPU has
nothing to do, and the few busy blocks each walk every key of the cache, one tile after another.

Flash-decoding adds a grid dimension over the keys. Split them into `num_splits` chunks; one block
per (query tile, head, split) runs lesson 05's loop over its chunk only:

    step 1  num_splits = 1: lesson 05's kernel with heads on grid y (the baseline)
    step 2  block (tile, h, s): the online softmax over the keys of split s, giving (m_i, l_i, acc);
            write its partial output o_s = acc / l_i and log-sum-exp lse_s = m_i + log(l_i)
    step 3  merge, per (head, query row):
                lse = log(sum_s exp(lse_s))
                out = sum_s exp(lse_s - lse) o_s

The merge is exact, not an approximation. Write L_s = sum over the keys j of split s of exp(S_j) =
exp(lse_s) and A_s = sum over the same keys of exp(S_j) V_j = L_s o_s. Softmax(S) V is a ratio of
sums over all keys, and sums regroup: out = (sum_s A_s) / (sum_s L_s) = sum_s (L_s / L) o_s with
L = sum_s L_s = exp(lse). Only float32 rounding differs from one block walking every key. The log
form keeps the numbers in range: exp(lse_s - lse) <= 1. A split that sees no key (more splits than
key tiles, or a causal row before its first key) has L_s = 0, lse_s = -inf and weight 0; a row
whose every split is empty gets 0, as in lesson 05.

The price is the scratch: o_s and lse_s in global memory, num_splits x (headdim + 1) float32 per
row, and a second, tiny kernel. Next to reading the whole K/V cache that is small.

Memory layout: q (nheads, seqlen_q, headdim), k and v (nheads, seqlen_k, headdim), float32, batch 1;
heads first, so that k[h] is lesson 05's 2-D array for one head. Scratch: o_part (num_splits,
nheads, seqlen_q, headdim), lse_part (num_splits, nheads, seqlen_q). Splits are whole K/V tiles:
split s gets tiles [s * tiles_per_split, (s + 1) * tiles_per_split), tiles_per_split =
ceil(key tiles / num_splits); so no key is in two splits, and the last splits may get fewer tiles,
or none.

This is the teaching version: lesson 05's one thread per query row and scalar float32 FMAs, so at
seqlen_q = 1 one thread of each block computes while the others only help load K_j and V_j. nbflash's
production decode kernel, nbflash/kernels/decode_mma.py, runs the same split on tensor cores with
cp.async copies, packs the query heads that share a K/V head into one tile (GQA), and lets every
warp take a share of each key tile; its merge is ``combine`` in nbflash/kernels/kvcache.py, and
nbflash/kvcache.py's ``choose_splits`` picks num_splits from the GPU's multiprocessor count.

Run: python kernels/07_flash_decoding.py [--seqlen-k M] [--nheads H] [--headdim D] [--splits S]
                                          [--seqlen N] [--causal]
"""

import functools
import math

import _common
import numpy as np
from numba import cuda, float32

tiles = _common.lesson("03")
online = _common.lesson("04")
flash2 = _common.lesson("05")

BLOCK_M, BLOCK_N = flash2.BLOCK_M, flash2.BLOCK_N

# One decode step: a single query token per head against a long cache (a toy one in the simulator).
if _common.SIMULATOR:
    DEFAULTS = dict(seqlen_q=1, seqlen_k=45, headdim=8, nheads=2, num_splits=3)
else:
    DEFAULTS = dict(seqlen_q=1, seqlen_k=32768, headdim=128, nheads=16, num_splits=64)


# ---------------------------------------------------------------------------------------------------
# Steps 1 and 2: lesson 05's loop over one split of the keys; partial output and log-sum-exp.
# ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def build_split_kernel(block_m, block_n, headdim):
    step = online.build_online_step(block_n, headdim)

    @cuda.jit
    def split_kernel(q, k, v, o_part, lse_part, scale, causal, tiles_per_split):
        """Grid: (query tiles, heads, splits); block_m threads, thread t owns query row row0 + t.

        Block (x, h, s) folds the keys of split s into the rows of head h's Q tile x and writes
        o_part[s, h, i] = acc / l_i and lse_part[s, h, i] = m_i + log(l_i) for each of its rows.
        """
        t = cuda.threadIdx.x
        row0 = cuda.blockIdx.x * block_m
        h = cuda.blockIdx.y
        s = cuda.blockIdx.z
        i = row0 + t
        q_h, k_h, v_h = q[h], k[h], v[h]  # this head's (seqlen, headdim) arrays, as in lesson 05
        seqlen_q, seqlen_k = q_h.shape[0], k_h.shape[0]
        K_j = cuda.shared.array((block_n, headdim), float32)
        V_j = cuda.shared.array((block_n, headdim), float32)

        # This row's state in registers, exactly as in lesson 05.
        q_row = cuda.local.array(headdim, float32)
        acc = cuda.local.array(headdim, float32)
        for d in range(headdim):
            q_row[d] = q_h[i, d] if i < seqlen_q else float32(0.0)
            acc[d] = 0.0
        m_i = float32(-math.inf)
        l_i = float32(0.0)
        last_key = online.last_visible_key(i, seqlen_q, seqlen_k, causal)

        # The only change to lesson 05's loop: it starts at this split's first tile and stops at its
        # last (or earlier, at the last key the block's rows may see). An empty split runs no tile.
        split_begin = s * tiles_per_split * block_n
        split_end = min(
            split_begin + tiles_per_split * block_n,
            flash2.key_end_device(row0, block_m, seqlen_q, seqlen_k, causal),
        )
        for col0 in range(split_begin, split_end, block_n):
            tiles.load_tile(K_j, k_h, col0, 0)
            tiles.load_tile(V_j, v_h, col0, 0)
            cuda.syncthreads()  # K_j and V_j are complete before anyone reads them
            if i < seqlen_q:
                m_i, l_i = step(q_row, K_j, V_j, col0, last_key, scale, m_i, l_i, acc)
            cuda.syncthreads()  # everyone is done with K_j, V_j before the next tile overwrites them

        # This split's normalized partial output and its log-sum-exp (natural log). A row that saw
        # no key in this split (l_i = 0) writes o_s = 0, as lesson 05 does, and lse_s = -inf: its
        # weight in the merge is exp(-inf) = 0, and 0 * o_s is 0 (o_s = acc / l_i would be 0 / 0).
        if i < seqlen_q:
            if l_i > 0:
                inv_l = float32(1.0) / l_i
                lse_part[s, h, i] = m_i + math.log(l_i)
            else:
                inv_l = float32(0.0)
                lse_part[s, h, i] = -math.inf
            for d in range(headdim):
                o_part[s, h, i, d] = acc[d] * inv_l

    return split_kernel


# ---------------------------------------------------------------------------------------------------
# Step 3: merge the splits, out = sum_s exp(lse_s - lse) o_s.
# ---------------------------------------------------------------------------------------------------


@cuda.jit
def merge_kernel(o_part, lse_part, out, lse):
    """Grid: (query rows, heads); headdim threads, thread d owns column d of out[h, i].

    Each thread reads the row's num_splits log-sum-exps itself (a few numbers, the same for every
    thread, so they come from cache): no shared memory and no barrier.
    """
    i = cuda.blockIdx.x
    h = cuda.blockIdx.y
    d = cuda.threadIdx.x
    num_splits = lse_part.shape[0]

    # The largest lse_s: subtracting it keeps every exp(lse_s - lse_max) <= 1 (lesson 02's row max).
    lse_max = float32(-math.inf)
    for s in range(num_splits):
        lse_max = max(lse_max, lse_part[s, h, i])
    if lse_max == -math.inf:  # no split saw a key: out = 0, lse = -inf (and -inf - -inf is NaN)
        out[h, i, d] = 0.0
        if d == 0:
            lse[h, i] = -math.inf
        return

    # total = sum_s exp(lse_s - lse_max) = exp(lse - lse_max); o = sum_s exp(lse_s - lse_max) o_s.
    total = float32(0.0)
    o = float32(0.0)
    # An empty split has lse_s = -inf: weight exp(-inf) = 0 against a finite lse_max, times its o_s = 0.
    for s in range(num_splits):
        w = math.exp(lse_part[s, h, i] - lse_max)
        total += w
        o += w * o_part[s, h, i, d]
    out[h, i, d] = o / total  # = sum_s exp(lse_s - lse) o_s
    if d == 0:
        lse[h, i] = lse_max + math.log(total)


# ---------------------------------------------------------------------------------------------------
# Host side: the problem (several heads), the launches, the check.
# ---------------------------------------------------------------------------------------------------


class DecodeProblem:
    """Lesson 05's problem with heads: q (nheads, seqlen_q, headdim), k and v (nheads, seqlen_k,
    headdim), float32; ``errors`` as in the other lessons, over all heads."""

    def __init__(self, seqlen_q, seqlen_k, headdim, nheads, causal=False, seed=0):
        self.seqlen_q, self.seqlen_k, self.headdim = seqlen_q, seqlen_k, headdim
        self.nheads = nheads
        self.causal = bool(causal)
        rng = np.random.default_rng(seed)
        self.q, self.k, self.v = (
            rng.standard_normal((nheads, n, headdim), dtype=np.float32)
            for n in (seqlen_q, seqlen_k, seqlen_k)
        )
        self.q_dev, self.k_dev, self.v_dev = (_common.to_device(x) for x in (self.q, self.k, self.v))
        self.scale = np.float32(1.0 / math.sqrt(headdim))

    @property
    def key_tiles(self):
        return (self.seqlen_k + BLOCK_N - 1) // BLOCK_N

    def new_output(self, num_splits=None):
        """The output (nheads, seqlen_q, headdim), or with ``num_splits`` the partial outputs
        (num_splits, nheads, seqlen_q, headdim); poisoned with NaN."""
        shape = (self.nheads, self.seqlen_q, self.headdim)
        return _common.device_full(shape if num_splits is None else (num_splits,) + shape, np.nan)

    def new_lse(self, num_splits=None):
        shape = (self.nheads, self.seqlen_q)
        return _common.device_full(shape if num_splits is None else (num_splits,) + shape, np.nan)

    def exact(self):
        """(out, lse) in float64: out (nheads, seqlen_q, headdim), lse (nheads, seqlen_q)."""
        as_4d = [x.transpose(1, 0, 2)[None] for x in (self.q, self.k, self.v)]  # (1, seqlen, nheads, d)
        out, lse = _common.attention_reference(*as_4d, causal=self.causal, return_lse=True)
        return out[0].transpose(1, 0, 2), lse[0]

    def errors(self, out):
        """(max error of ``out``, max error of a naive fp32 computation), both against float64.
        ``out`` may carry a leading axis of one split (the baseline's)."""
        as_4d = [x.transpose(1, 0, 2)[None] for x in (self.q, self.k, self.v)]
        exact = self.exact()[0]
        naive = _common.attention_naive(*as_4d, causal=self.causal)[0].transpose(1, 0, 2)
        out = np.asarray(_common.to_host(out)).reshape(exact.shape)
        return float(np.max(np.abs(out - exact))), float(np.max(np.abs(naive - exact)))

    def lse_error(self, lse):
        """Max error of ``lse`` against float64 (rows that see no key must be -inf in both); ``lse``
        may carry a leading axis of one split."""
        exact = self.exact()[1]
        lse = np.asarray(_common.to_host(lse), dtype=np.float64).reshape(exact.shape)
        empty = np.isneginf(exact)
        if not np.array_equal(np.isneginf(lse), empty):
            return math.inf
        return float(np.max(np.abs(lse[~empty] - exact[~empty]), initial=0.0))


def launch_split(problem, o_part, lse_part):
    """One block per (query tile, head, split) over o_part's num_splits splits of the key tiles."""
    p = problem
    num_splits = o_part.shape[0]
    tiles_per_split = (p.key_tiles + num_splits - 1) // num_splits
    grid = ((p.seqlen_q + BLOCK_M - 1) // BLOCK_M, p.nheads, num_splits)
    kernel = build_split_kernel(BLOCK_M, BLOCK_N, p.headdim)
    kernel[grid, BLOCK_M](p.q_dev, p.k_dev, p.v_dev, o_part, lse_part, p.scale, p.causal, tiles_per_split)


def attention_one_block_per_row(problem, out, lse):
    """Step 1, the baseline: a single split, whose partial output is the output (out and lse with a
    leading axis of 1)."""
    launch_split(problem, out, lse)


def attention_split(problem, o_part, lse_part, out, lse):
    """Steps 2 and 3: the split kernel, then the merge."""
    p = problem
    launch_split(p, o_part, lse_part)
    merge_kernel[(p.seqlen_q, p.nheads), p.headdim](o_part, lse_part, out, lse)


def main(seqlen_q=None, seqlen_k=None, headdim=None, causal=False, nheads=None, num_splits=None):
    """Run both versions, check them against float64 and print the report (on a GPU also the
    speedup of the split version); returns the largest max error against float64, of out and lse,
    of either version."""
    given = dict(seqlen_q=seqlen_q, seqlen_k=seqlen_k, headdim=headdim, nheads=nheads,
                 num_splits=num_splits)
    size = {name: given[name] or DEFAULTS[name] for name in DEFAULTS}  # None: the default size
    num_splits = size.pop("num_splits")
    problem = DecodeProblem(**size, causal=causal)

    one_out, one_lse = problem.new_output(1), problem.new_lse(1)
    o_part, lse_part = problem.new_output(num_splits), problem.new_lse(num_splits)
    out, lse = problem.new_output(), problem.new_lse()
    one_seconds = _common.measure(lambda: attention_one_block_per_row(problem, one_out, one_lse))
    split_seconds = _common.measure(lambda: attention_split(problem, o_part, lse_part, out, lse))

    one_error = problem.errors(one_out)[0]
    lse_error, one_lse_error = problem.lse_error(lse), problem.lse_error(one_lse)
    q_tiles = (problem.seqlen_q + BLOCK_M - 1) // BLOCK_M
    tiles_per_split = (problem.key_tiles + num_splits - 1) // num_splits
    splits_with_keys = -(-problem.key_tiles // tiles_per_split)
    notes = [
        f"blocks                     {q_tiles * problem.nheads} with one split, "
        f"{q_tiles * problem.nheads * num_splits} with {num_splits} "
        f"({tiles_per_split} of the {problem.key_tiles} key tiles each; "
        f"empty splits: {num_splits - splits_with_keys})",
        f"one split: max |out - float64| {one_error:.2e}, time per call {one_seconds * 1e3:.3f} ms",
        f"lse: max |lse - float64| {lse_error:.2e} merged, {one_lse_error:.2e} with one split",
        f"scratch above is per head, as the N x N matrix it is compared with; "
        f"all {problem.nheads} heads: {o_part.nbytes + lse_part.nbytes} bytes",
    ]
    if _common.SIMULATOR:
        notes.append(
            "speedup: not measured; the simulator runs the blocks one after another on the CPU, so "
            "it cannot show blocks filling an idle GPU (run on a GPU to see it)"
        )
    else:
        notes.append(f"speedup over one split      {one_seconds / split_seconds:.1f}x")
    error = _common.report(
        f"lesson 07: flash-decoding, {problem.nheads} heads, {num_splits} splits, "
        f"block_m={BLOCK_M} block_n={BLOCK_N}",
        problem,
        out,
        split_seconds,
        scratch_bytes=(o_part.nbytes + lse_part.nbytes) / problem.nheads,
        notes=notes,
        next_lesson="the exercises in docs/workshop.md; then nbflash's decode kernel, "
        "nbflash/kernels/decode_mma.py, and its combine in nbflash/kernels/kvcache.py.",
    )
    return float(np.max([error, one_error, lse_error, one_lse_error]))  # np.max: a NaN is not lost


def cli(description):
    """The shared options (--seqlen is the query tokens, 1 by default), plus --nheads and --splits;
    returns keyword arguments for ``main``."""
    import argparse

    where = " in the simulator" if _common.SIMULATOR else ""
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--seqlen", type=int, dest="seqlen_q", help="query tokens per head (default 1)")
    for option, name, what in [
        ("--seqlen-k", "seqlen_k", "keys"),
        ("--headdim", "headdim", "head dim"),
        ("--nheads", "nheads", "heads"),
        ("--splits", "num_splits", "splits of the keys"),
    ]:
        parser.add_argument(option, type=int, dest=name, help=f"{what} (default {DEFAULTS[name]}{where})")
    parser.add_argument("--causal", action="store_true", help="bottom-right aligned causal mask")
    return vars(parser.parse_args())


if __name__ == "__main__":
    main(**cli(__doc__))
