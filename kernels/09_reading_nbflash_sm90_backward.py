"""Lesson 09: a guided reading of nbflash's Hopper backward (the dK/dV kernel and the dQ paths).

Read lesson 08 first: this kernel, ``nbflash/kernels/backward_sm90.py``, is built from the same
parts (a producer warpgroup issuing TMA copies into an mbarrier ring, two consumer warpgroups
multiplying with wgmma, setmaxnreg moving registers between them). What is new is the algorithm
it feeds: FlashAttention's backward (the paper's Algorithm 2), which recomputes P from the forward's
log-sum-exp and makes five products per pair of tiles instead of the forward's two:

    S = Q K^T,  P = exp(S * scale - lse),  dP = dO V^T,  dS = P * (dP - D)     (D = rowsum(dO * O))
    dV += P^T dO,   dK += dS^T Q * scale,   dQ += dS K * scale

The lesson is about where each operand lives. Three ideas carry the kernel: the scores are computed
transposed (keys as rows), so P^T and dS^T land in the register layout wgmma takes as its A
operand; one shared-memory tile is read through two descriptors (K-major and MN-major); and dS,
which dQ needs with queries as rows, is stored once as dS^T and read back transposed by wgmma's
A-transpose flag. dQ itself is the one gradient a key-tile block cannot own: it is added with
float32 atomics, or, with ``deterministic=True``, made by a separate query-tile kernel
(``nbflash/kernels/backward_dq_sm90.py``, the forward's shape).

Like lessons 06 and 08 it copies no kernel code: it prints each topic, the numbers it takes for
this problem, and where it is in the library (file:line, found by searching the files). It checks
one layout claim in Python (the dS^T store and the transposed read meet on every element), and runs
the library's backward through ``nbflash.kernel_family("sm90")`` against float64; on a GPU of
compute capability 9.0 at flash-attn's benchmark size, timed next to the mma family's backward.

Run: python kernels/09_reading_nbflash_sm90_backward.py [--seqlen N] [--seqlen-k M] [--headdim D] [--causal]
"""

import importlib.util
import os
import sys
import time

import _common
import numpy as np

_spec = importlib.util.spec_from_file_location(
    "lesson_08", os.path.join(_common.KERNELS_DIR, "08_reading_nbflash_sm90.py"))
lesson_08 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lesson_08)  # its reading helpers: anchors, paragraphs, the problem
say, print_anchors, Sm90Problem, sm90_runs_here = (lesson_08.say, lesson_08.print_anchors, lesson_08.Sm90Problem,
                                                   lesson_08.sm90_runs_here)

KERNEL = "nbflash/kernels/backward_sm90.py"
DQ_KERNEL = "nbflash/kernels/backward_dq_sm90.py"
PRIMS = "nbflash/primitives_sm90.py"
CONFIGS = "nbflash/configs.py"
BODY = "backward_dkdv_sm90"  # the kernel's function

TOPICS = [
    ("1. The loops swapped: one block per key tile", """
        The forward gives a block a query tile and loops over keys. The backward's dK_j and dV_j are
        sums over queries, so a block takes a key tile K_j, V_j (loaded once by TMA) and loops over
        the query tiles that see it, and over the query heads that share its key/value head (GQA):
        dK_j and dV_j stay in registers for the whole loop, summed in a fixed order, and are written
        once. The geometry module says which query tiles see the key tile, and which of them see all
        of it (no mask), as it says the forward's key tiles.""",
     [(KERNEL, BODY, "query_tiles(", 0, "the query tiles that see this key tile (geometry.py)"),
      (KERNEL, BODY, "steps = warp_visited_query_steps(", 0,
       "one step per (query head of the group, query tile) it visits, counted by the whole warp"),
      (KERNEL, BODY, "store_rows(dk, dk_acc", 0, "dK written once, times the scale, after the loop")]),
    ("2. The scores transposed: keys as rows", """
        Each consumer owns 64 keys of the tile and computes S^T = K_c Q_i^T (64 keys by 64 queries)
        and dP^T = V_c dO_i^T, with both operands in shared memory. In the accumulator layout a
        thread holds two key rows and 16 query columns; a 16-column slice of that accumulator,
        packed pair by pair to 16 bit, is exactly the register A operand of a 64-row wgmma. So
        dV += P^T dO and dK += dS^T Q take P^T and dS^T straight from registers (the RS form), as
        the forward's O += P V takes P. Computing S = Q K^T instead would leave P with queries as
        rows, and P^T would have to go through shared memory.""",
     [(KERNEL, "build_backward_sm90", "issue_keys_by_queries = make_issue_keys_by_queries(make_wgmma_ss", 0,
       "S^T and dP^T: SS, N = 64 queries"),
      (KERNEL, "build_backward_sm90", "wgmma_keys_acc = make_wgmma_rs", 0, "dV and dK: RS, A from registers"),
      (KERNEL, "pack_a", "packed[i] = pack(", 0, "the accumulator packed into A registers")]),
    ("3. One tile, two descriptors", """
        Q_i and dO_i arrive once per step (TMA, 128-byte swizzle, rows of queries). S^T = K Q^T reads
        Q_i as B stored K-major (n = queries, k = headdim contiguous); dK += dS^T Q reads the same
        bytes as B stored MN-major (k = queries, n = headdim contiguous). The swizzled image is the
        same; only the descriptor's strides and the transpose bit differ, so no thread re-lays a
        tile.""",
     [(KERNEL, "issue_scores", "smem_descriptor(q_ring + uint32(slot * Q_BYTES), K_MAJOR[0]", 0,
       "Q_i as S^T's B, K-major"),
      (KERNEL, BODY, "smem_descriptor(q_slot, Q_CHUNK_BYTES", 0, "the same Q_i as dK's B, MN-major")]),
    ("4. dS^T stored, read back as dS", """
        dQ_i += dS K needs dS with queries as rows (wgmma's M), but the registers hold dS^T. Each
        thread stores its packed dS^T pairs into a 64 x 64 tile of 128-byte rows, one row per key,
        with the 128-byte swizzle (16-byte chunk c of row r goes to chunk c ^ (r % 8), which also
        spreads a warp's 32 stores over the 32 banks). A row starts on 128 bytes, so the chunk is
        bits 4-6 of the byte offset: the kernel makes the thread's chunk-0 offset once (chunk r % 8)
        and XORs 16 c into it for chunk c, by shared address. Read with an MN-major descriptor that image
        IS dS (M = queries contiguous, K = keys), and wgmma's A-transpose flag takes it: the
        primitive's trans_a. The stores are generic-proxy writes and wgmma reads through the async
        proxy: fence.proxy.async, then a named barrier over the warpgroup, then the wgmma. Two such
        tiles alternate by step parity, so a warp's next stores never land under another warp's
        still-running read: every warp is past the last step's dQ once it passes this step's
        barrier.""",
     [(KERNEL, "store_ds_t", "first ^ uint32(16 * c)", 0, "the swizzled store of packed dS^T pairs"),
      (KERNEL, BODY, "fence_proxy_async()", 0, "generic stores ordered before the async proxy's reads"),
      (KERNEL, BODY, "named_barrier_sync(1 + consumer, GROUP)", 0, "the warpgroup's dS^T is stored"),
      (KERNEL, "build_backward_sm90", "wgmma_dq = make_wgmma_ss(DQ_COLS, AB, 1, 1)", 0, "dQ: A transposed, B MN-major"),
      (PRIMS, "make_wgmma_ss", "trans_a", 0, "the A-transpose flag of the primitive")]),
    ("5. The producer's two warps and one full barrier", """
        The forward's producer has one busy thread. Here warp 0's elected thread issues the TMA
        copies of Q_i and dO_i, and warp 1 stages the step's statistics (lse in base 2, with +inf
        for rows past the sequence or without keys, so their P is exactly 0; and D) into the slot
        with plain loads and stores. Both arrive on the slot's full barrier, which expects 1 + 32
        arrivals and the TMA's bytes: a consumer that sees the phase complete sees the tiles and
        the statistics. Every consumer thread arrives on the slot's empty barrier once its dV, dK
        products (the last readers of Q_i, dO_i) are done.""",
     [(KERNEL, "build_backward_sm90", "FULL_ARRIVALS = 1 + 32", 0, "the TMA thread and the stats warp"),
      (KERNEL, "stage_stats", "mbarrier_arrive(qd_full", 0, "the stats warp's arrival releases its stores"),
      (KERNEL, BODY, "mbarrier_arrive(qd_empty", 0, "a consumer thread releases the slot")]),
    ("6. dQ: atomics, or a second kernel", """
        A key-tile block sees only part of each query's keys, so its dS K is a partial sum of dQ_i.
        It goes to a float32 dq_accum by vector reductions (red.global.add.v2.f32), and the
        portable convert kernel scales and narrows it; the order of the additions, and so the last
        bits of dq, vary run to run. Those reductions were the step's bottleneck: with each
        consumer adding dS K_c for its own 64 keys ("keys"), every step sends 64 x headdim floats
        per consumer. The plan halves that: at headdim 128 each consumer adds one 64-column half
        of dQ_i over all 128 keys ("columns"); at 64 the consumers take turns by step ("steps"),
        each adding the whole dQ_i over all keys on its steps. Both read the two consumers' dS^T
        side by side, so a step's barrier now spans both warpgroups: 21-32% faster at headdim 128
        on the H200 all the same. With "columns" a consumer also issues dQ_i's product before dV's
        and dK's (dq_first) and makes its reductions while those run: 10-16% more. For dense
        batches the plan then drops the consumers' reductions altogether (dq_reduce="tiles",
        FlashAttention-3's form): each consumer stores its half of dQ_i into shared memory, in the
        order the accumulator's registers are in, and the producer's stats warp adds the whole tile
        by one bulk reduce-add into a dq_accum kept in that same order, which the tile-major
        conversion reads: 6-10% more on an H100. (The same with one reduce-add a row measured 13-22%
        slower, the copy engine taking the tile's 64 row operations one after another; packed
        sequences keep the atomics.) (At
        headdims 33-64, for plain and windowed attention, the plan takes this kernel with 128
        query rows a step, each consumer's 64 keys against all of them, and dQ split by query
        rows (block_m=128, dq_split="rows"); up to 32 a sibling kernel, backward_sm90_rows.py,
        that splits a step's query rows between the consumers instead of its keys.) With deterministic=True the
        plan swaps in the forward's shape for dQ: one block per query tile loops over the key
        tiles, dQ_i stays in registers, dS goes from the accumulator into dQ's A registers as the
        forward's P does, and dq is written once (backward_dq_sm90.py); dK and dV then come from the
        mma family's kernel without atomics.""",
     [(KERNEL, "add_dq", "red_add_f32x2(", 0, "two columns of dq_accum per reduction"),
      (KERNEL, BODY, "wgmma_wait(2)  # dQ_i has landed", 0, "dq_first: dQ_i's reductions under dV, dK"),
      (KERNEL, "add_staged_dq", "bulk_reduce_add_f32(", 0, "dq_reduce='tiles': the stats warp's reduce-add"),
      (CONFIGS, "planned_backward_sm90_config", 'dq_reduce="tiles"', 0, "planned where dQ's product comes first"),
      (KERNEL, BODY, "(DQ_BY_STEPS and i % 2 != consumer)", 0, "'steps': the other consumer's turn"),
      (CONFIGS, "plan_backward", "sm90_dq = (", 0, "deterministic=True under 'sm90': the dQ kernel"),
      (DQ_KERNEL, None, "def backward_dq_sm90(", 0, "the deterministic dQ kernel")]),
]


def config_facts(config, problem):
    """What the config holds per thread and per block for this problem."""
    hdp = config.headdim_padded
    per_thread = {"S^T": config.block_m // 2, "dP^T": config.block_m // 2, "dK": hdp // 2, "dV": hdp // 2,
                  "dQ chunk": 32}
    print(f"  per consumer thread: {', '.join(f'{k} {v}' for k, v in per_thread.items())} float32 accumulators"
          f" ({sum(per_thread.values())} of the {config.consumer_registers} registers setmaxnreg gives it)")
    print(f"  shared memory: K, V {2 * config.kv_bytes} B, Q/dO ring {2 * config.stages * config.q_bytes} B"
          f" ({config.stages} stages), dS^T tiles {2 * config.consumers * config.ds_bytes} B, stats"
          f" {config.stages * config.stats_bytes} B"
          + (f", staged dQ {config.dq_stage_bytes} B" if config.dq_tile_major else "")
          + f": {config.dynamic_shared_bytes} B with the alignment slack")
    tiles = -(-problem.seqlen_q // config.block_m)
    dq_bytes = config.block_m * hdp * 4 * {"keys": config.consumers, "none": 0}.get(config.dq_split, 1)
    how = ("one bulk reduce-add of the staged tile" if config.dq_tile_major
           else f"atomics ({config.dq_split!r})")
    print(f"  this problem: {-(-problem.seqlen_k // config.block_n)} key-tile blocks per head, each up to"
          f" {tiles} steps; dq_accum takes {dq_bytes} B per step by {how}")


def store_and_read_meet():
    """Every element (key, query) of a 64 x 64 dS^T tile: the byte the store writes (row key,
    16-byte chunk (query // 8) ^ (key % 8), 4 bytes per packed pair; store_ds_t makes it as the
    chunk-0 offset, chunk key % 8, XORed by 16 (query // 8)) equals the byte an MN-major,
    128-byte-swizzled A operand reads for dS[query, key] (M = query contiguous in 128-byte rows,
    one row per k = key: the layout primitives_sm90's emulation decodes)."""
    key, query = np.meshgrid(np.arange(64), np.arange(64), indexing="ij")
    stored = key * 128 + ((query // 8) ^ (key % 8)) * 16 + (query % 8) * 2
    first = key * 128 + 16 * (key % 8) + (query % 8) * 2  # store_ds_t's chunk-0 offset (and the byte in it)
    unswizzled = (key // 8) * 1024 + (key % 8) * 128 + query * 2  # SBO 1024: 8 key rows per 1024 bytes
    read = unswizzled ^ (((unswizzled >> 7) & 7) << 4)
    return bool(np.array_equal(stored, read) and np.array_equal(first ^ (16 * (query // 8)), stored))


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


class BackwardProblem(Sm90Problem):
    """Lesson 08's problem with dout, and the backward run by a family and checked against float64."""

    def gradients(self, family):
        import nbflash

        if not hasattr(self, "_forward"):
            q = self.arrays[0]
            rng = np.random.default_rng(1)
            dout = rng.standard_normal(q.shape, np.float32).astype(np.float16)
            self._dout = dout if _common.SIMULATOR else _common.cupy.asarray(dout)
            with nbflash.kernel_family("portable" if _common.SIMULATOR else "sm90"):
                self._forward = nbflash.flash_attn_func(*self.arrays, causal=self.causal, return_lse=True)
        with nbflash.kernel_family(family):
            return nbflash.flash_attn_backward(self._dout, *self.arrays, *self._forward, causal=self.causal)

    def check(self, grads):
        """max |grad - float64| over dq, dk, dv, and flash-attn's allowance (twice the naive fp16
        error plus a floor of 1e-3 times the largest gradient): on a GPU batch 0 and head 0 only."""
        from nbflash.reference import attention_naive_backward, attention_reference_backward

        pick = (lambda x: x[:1, :, :1]) if not _common.SIMULATOR else (lambda x: x)
        host = [pick(_host(x)) for x in (self._dout, *self.arrays)]
        exact = attention_reference_backward(*host, causal=self.causal)
        naive = attention_naive_backward(*host, causal=self.causal)
        error = allowed = 0.0
        for got, ref, low in zip(grads, exact, naive):
            ref = np.asarray(ref, np.float64)
            error = max(error, float(np.abs(pick(_host(got)).astype(np.float64) - ref).max()))
            allowed = max(allowed, 2 * float(np.abs(np.asarray(low, np.float64) - ref).max())
                          + 1e-3 * float(np.abs(ref).max()))
        return error, allowed


def main(seqlen_q=None, seqlen_k=None, headdim=None, causal=False):
    """Print the reading guide, check the dS^T claim and run the library's backward. Returns a dict:
    ``missing`` (anchors not found), ``layout`` (the claim of topic 4) and ``error`` / ``allowed``
    (the backward against float64; None where no sm90 kernel runs)."""
    from nbflash import configs
    from nbflash.problem import Variant

    seqlen_q = seqlen_q or (40 if _common.SIMULATOR else _common.DEFAULT_SEQLEN)
    seqlen_k = seqlen_k or seqlen_q
    headdim = headdim or (64 if _common.SIMULATOR else 128)
    if headdim % 8 or not 8 <= headdim <= 128:
        raise ValueError(f"{headdim=}: the sm90 backward serves multiples of 8 up to 128 (nbflash runs other "
                         "headdims on the mma family)")
    result = dict(missing=[], layout=None, error=None, allowed=None)
    why_not = sm90_runs_here()
    problem = BackwardProblem(seqlen_q, seqlen_k, headdim, causal)
    config = configs.planned_backward_sm90_config("float16", headdim, Variant(window=causal))

    print("lesson 09: reading nbflash's Hopper backward (nbflash/kernels/backward_sm90.py)")
    print("  Open the kernel file beside this printout; its docstring has the loop, the grid and the layouts.")
    print(f"\nThe problem: q {problem.shapes[0]}, k and v {problem.shapes[1]}, float16, causal={causal}")
    print(f"  its dK/dV config (configs.SM90_BACKWARD's row): block_n {config.block_n} keys ({config.consumers} consumers of 64),"
          f" block_m {config.block_m} queries a step, stages {config.stages}, dq_split {config.dq_split!r},"
          f" dq_reduce {config.dq_reduce!r}")
    config_facts(config, problem)
    for title, text, anchors in TOPICS:
        print(f"\n{title}")
        say(text)
        if title.startswith("4."):
            result["layout"] = store_and_read_meet()
            print(f"  checked: the store and the transposed read meet on all 64 x 64 elements:"
                  f" {'yes' if result['layout'] else 'NO'}")
        result["missing"] += print_anchors(anchors)

    print("\nThe library's backward, through nbflash.kernel_family('sm90'):")
    if why_not:
        print(f"  not run: {why_not}")
    else:
        start = time.perf_counter()
        grads = problem.gradients("sm90")  # the first call compiles the kernels
        seconds = (time.perf_counter() - start if _common.SIMULATOR
                   else _common.measure(lambda: problem.gradients("sm90")))
        result["error"], result["allowed"] = problem.check(grads)
        print(f"  max |grad - float64| (dq, dk, dv)  {result['error']:.2e}   (allowed {result['allowed']:.2e})")
        if _common.SIMULATOR:
            print(f"  time per call                     {seconds * 1e3:.1f} ms (simulator: Python threads, not a GPU)")
        else:
            mma = _common.measure(lambda: problem.gradients("mma"))
            flops = 2.5 * problem.flops()
            print(f"  time per call                     sm90 {seconds * 1e3:.3f} ms ({flops / seconds / 1e12:.0f}"
                  f" TFLOP/s), mma {mma * 1e3:.3f} ms ({flops / mma / 1e12:.0f} TFLOP/s): sm90 {mma / seconds:.2f}x")
    print("\nnext: tests/test_backward_sm90.py and tests/test_backward_dq_sm90.py, which check the same kernels;"
          " docs/perf-notes.md, 'Hopper backward', for what was measured and what is next.")
    return result


if __name__ == "__main__":
    try:
        main(**_common.cli(__doc__))
    except ValueError as error:  # a headdim the sm90 backward does not serve: say so, no traceback
        sys.exit(f"lesson 09: {error}")
