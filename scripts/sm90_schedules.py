"""Time schedules of the Hopper forward (nbflash/kernels/forward_sm90.py) side by side, fp16; with
--backward, those of the Hopper backward (nbflash/kernels/backward_sm90.py).

    python scripts/sm90_schedules.py
    python scripts/sm90_schedules.py --backward [--headdims D ...] [--only NAME ...] [--anchors] [--isolate S]
                                     [--dropout P] [--rounds R]
    python scripts/sm90_schedules.py --parts [--headdims D ...] [--rowwise-scalar]
                                     [--deterministic [--deterministic-keys128]]

Backward, each column a schedule:
- "base": 2 stages, dQ split by keys (each consumer adds dS K_c for its own 64 keys), the grid's
  plain order;
- "serial": no overlap of P^T with dP^T; "3stages": a 3-stage Q/dO ring; "regs240": setmaxnreg
  24 / 240 instead of 40 / 232;
- "columns" / "3st-columns": dQ split by columns between the consumers (half the atomics, a barrier
  across both per step; halves of 64 columns at headdim 128, of 32 at 64), 2 and 3 stages;
- "steps" / "3st-steps": the consumers take turns by step for dQ (half the atomics, any headdim);
- "heavy-groups4", "heavy-groups8": the planner's choice, longest-first within groups of 4 or 8
  (batch, KV head) pairs (heavy_groups; the planner's is 4);
- (dQ by TMA reduce-adds, dQ_i's atomics deferred to the next step and 128 query rows per step were
  timed here until commit 354c94b, and left the kernel: docs/perf-notes.md steps 6, 9 and 11)
- "rows" / "rows-3st" (headdim 64): the query rows split between
  the consumers (nbflash/kernels/backward_sm90_rows.py, 128 x 128 tiles), 2 and 3 stages, the
  planner's launch order; "rows-stmatrix": P and dS stored by stmatrix (the pipelined loop timed
  on 2026-12-04 as "rows-pipe" is in git history, commit 1aba50e; docs/perf-notes.md step 15);
  "rows-dq" / "rows-dq-dv": dQ_c's product (and dV_c's) issued under dS's stores (step 42);
  "rows-dq-rotate": "rows-dq" with step 43's rotated query tiles;
  "keys128" (headdims up to 64): backward_sm90.py's keys split with 128 query rows a step, dQ split
  by query rows, first and tile-major (step 40; planned from 33 on), and "rows-planned" the rows
  split as the planner makes it (planned up to 32);
  "rows-persistent": a persistent grid of one block per multiprocessor over the planned launch
  order (step 18);
- with --dropout P, every schedule with dropout of probability P (the rows split, which does not serve
  dropout, left out), "dropout-producer": the planned kernel with dropout's keep bits made by the
  producer warpgroup's warps 2 and 3 ahead of each step (dropout_bits="producer", step 26; planned
  at headdims past 64), and "dropout-consumers": the same with each consumer lane's own calls;
- "planned": the planner's choice (configs.sm90_backward_config: step 40's 128-query kernel at
  headdims 33-64, the rows split up to 32, configs.SM90_BACKWARD's row of backward_sm90.py
  otherwise). (dQ by 16-byte reductions, timed as
  "planned-dq4" until commit 8ebb6f1, was 2-20% slower: docs/perf-notes.md step 24.)
  "planned-dqlast" (where the planned kernel splits dQ by columns: headdim 128): the same with dQ_i's
  product issued after dV's and dK's and its reductions made once all three have landed (the order
  before dq_first, step 28); "columns-dqfirst" (headdim 64): backward_sm90.py's kernel from the
  table (its "steps" the default there for dropout and score_mod) with dQ split by 32-column halves
  and each consumer's half issued first (an option, step 29). The planned kernel at headdim 128
  stores dQ_i into a shared tile in wgmma's fragment order and its producer's stats warp adds it to
  a tile-major dq_accum, one bulk reduce-add a step (dq_reduce="tiles", steps 32-33, planned in
  step 35); "planned-rotate": the planned kernel with each block's walk over the query tiles starting
  at its key tile's index (step 43); "planned-3st" (headdim 128): the planned kernel with a third
  stage in its Q/dO ring, which fits beside the staged dQ tile (step 52; planned for plain
  attention, where "planned-2st" is the kernel with two); "planned-quads"
  (backward_sm90.py's kernels): dK and dV by 16-byte stores after the quads' transposes (step 55),
  "planned-pairs" where the plan has them (headdims 72-128, dense: configs.SM90_BACKWARD_STORE_QUADS),
  and in the planned rows split (headdim 64) "rows-pairs" where it is planned with them (without a
  window), "rows-quads" where not; "planned-tma" (backward_sm90.py's kernels): dK and dV written
  into K's and V's tiles, then stored by TMA (step 57); "planned-groups1", "planned-groups2",
  "planned-groups8": the planned kernel launched longest-first in groups of 1, 2 or 8 (batch, KV
  head) pairs instead of 4;
  "planned-red" is the same with the consumers' atomics into a row-major dq_accum instead
  (the form before; timed as "planned" against "planned-tiles" until step 35); "planned-dqwarp"
  the planned kernel with its staged dQ_i added by the producer's warp 2 rather than the stats
  warp (``dq_warp``); "planned-ahead" the planned kernel with its stats warp loading step i + 1's lse
  and D before it adds step i - 1's dQ (``stats_ahead``), "planned-dqwarp-ahead" both, "planned-all" both
  with the query tiles rotated (``rotate``) too; "planned-ds1" (step 40's kernel) with one set of dS^T
  tiles (``ds_buffers=1``), "planned-ring3" that and a third ring stage; "planned-statswarp" the
  planned kernel with its stats warp adding the staged dQ_i (no dq_warp, no stats_ahead: the plan
  until the thirty-fourth session), "planned-notahead" with dq_warp but not stats_ahead (where the
  plan has both, "planned-dqwarp", "planned-dqwarp-ahead" and "planned-ahead" are not offered: they
  are the plan); "planned-fold" the planned kernel converting dQ itself (``fold_dq``: the block
  whose reduce-add completes a query tile converts it after its loop; no conversion kernel),
  "planned-nofold" without it where it is planned. (Steps 30 and 31's
  bulk reduce-adds a row, "planned-bulk", "keys-bulk" and "rows-bulk", were 13-47% slower and left
  with commit 5b92983.) "rows-tiles" (headdim 64): the rows split with tiles (step 34, 1-4% slower);
  "columns-tiles" (headdim 64): "columns-dqfirst" with tiles, in 32-column parts (step 36; planned
  for dropout in step 41, where these two become "planned" and "planned-red", and "planned-steps"
  is the "steps" kernel dropout had before).
With --anchors, PyTorch SDPA's flash and cuDNN backwards on the same inputs in the same loop (timed
as scripts/bench.py times them: the backward alone, a fresh forward before each), and each
schedule's ratio to SDPA flash after the table. With --isolate S, each (shape, schedule) runs in a
child process with S seconds (the kernels compiled first into the on-disk cache, as always): a
schedule that hangs the GPU costs its own cells ("hang") instead of the run, as one whose setmaxnreg
caps asked for more registers than the block held once did (now refused by the configs).
With --parts, the planned backward's three launches (preprocess: D and, where dq_accum is
row-major, its zeros; the dK/dV kernel; the dq conversion) and a tile-major dq_accum's zeroing (the
launcher's cupy.zeros) timed one at a time on each shape, and the bytes the two row-wise
kernels move over their time (GB/s), next to a device-to-device copy's; then the whole call three
ways: alone on an idle GPU (its host work before the first launch counted), behind a forward
queued ahead (host work hidden), and ten calls back to back (per call). --rowwise-scalar plans the
two row-wise kernels' scalar forms (configs.ROWWISE_VECTOR off; docs/perf-notes.md step 19) for the
run: one --parts run with it and one without compare them.
Each is timed as a whole flash_attn_backward call (preprocess and dq conversion included, the same
for all), with a forward queued ahead of each timed call as the SDPA anchors have (so the call's
host work overlaps GPU time for both; before 2026-12-04's third session ours was timed on an idle
GPU, its host work counted), FLOPs 2.5x the forward's, its dq, dk, dv compared with the base's.
The schedules are timed interleaved, one call of each in turn (the order rotated each round), each
the median of --rounds calls (default 15): before 2026-12-07's thirtieth session each was timed in a
block of ten calls after the one before it, and the GPU's clock drifted between the blocks (the
schedule timed last read 5-14% slower on an H100 at hd 128, whichever it was). The SDPA anchors
are still timed after them, as scripts/bench.py times them.

Forward, for each shape (flash-attn's grid: hidden 2048, batch 16384 / seqlen): the planned config ("base"),
the overlapped loop ("overlap": S_{j+1} issued with P_j V_j), the two consumers taking turns
("pingpong"), longest-first inside groups of 4 or 8 (batch, head) pairs ("heavy-groups4",
"heavy-groups8"), at headdim 128 key tiles of 176 ("n176", "n176-pp"), and 2 or 4 of each row's
16 key groups with P's exponentials on the FMA pipes instead of MUFU ("fma2", "fma4":
exp2_fma_groups). With --only, those schedules and "base". TFLOP/s from CUDA events
around each launch (after 3 warm-ups, the schedules timed interleaved as the backward's are, each
the median of --rounds launches); each schedule's output is compared with the
base's. The configs are compiled first in worker processes (into nbflash's on-disk cache), each line
saying the seconds, registers and local (spill) bytes. Needs a GPU of compute capability 9.0.
"""

import argparse
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ONLY = None  # --only: the schedules to time (None: all)
ANCHORS = False  # --anchors: SDPA's backward next to the schedules
ISOLATE = None  # --isolate: seconds for each (shape, schedule) in a child process (None: one process)
DROPOUT = 0.0  # --dropout: the backward's schedules with this dropout probability (0: none)
ROUNDS = 15  # --rounds: the timed calls of each schedule, interleaved (interleaved_ms)
SHAPES = [(128, 4096, False), (128, 16384, False), (128, 4096, True), (128, 16384, True), (64, 4096, False),
          (64, 16384, False), (64, 4096, True), (64, 16384, True)]  # (headdim, seqlen, causal)


def chosen(found, headdim, causal):
    """The schedules of ``found`` that --only names (all without it); the names it gives that no
    schedule of this shape has are said on stderr (a name the plan has made "planned" or another
    name, say), so that a run does not silently time fewer columns than asked for."""
    if ONLY is None:
        return found
    missing = sorted(ONLY - set(found))
    if missing:
        print(f"--only: no schedule {', '.join(missing)} at hd {headdim}, {'causal' if causal else 'plain'}",
              file=sys.stderr)
    return {name: config for name, config in found.items() if name in ONLY}


def schedules(headdim, causal):
    from nbflash import configs
    from nbflash.problem import Variant

    base = configs.sm90_forward_config("float16", headdim, Variant(window=causal))
    found = {"base": base, "overlap": base.__class__(**{**base.__dict__, "overlap": True}),
             "pingpong": base.__class__(**{**base.__dict__, "overlap": True, "pingpong": True})}
    for groups in (4, 8):  # longest-first within groups of (batch, head) pairs
        found[f"heavy-groups{groups}"] = base.__class__(**{**base.__dict__, "heavy_groups": groups})
    if headdim == 128:
        found["n176"] = base.__class__(**{**base.__dict__, "block_n": 176, "stages": 2})
        found["n176-pp"] = base.__class__(**{**base.__dict__, "block_n": 176, "stages": 2, "overlap": True,
                                             "pingpong": True})
    for groups in (2, 4):  # of each row's 16 key groups, this many with P's exponentials on the FMA pipes
        found[f"fma{groups}"] = base.__class__(**{**base.__dict__, "exp2_fma_groups": groups})
    return chosen(found, headdim, causal)


def median_ms(call, repeats):
    """Median milliseconds of ``call`` between CUDA events over ``repeats`` calls, after 3 warm-ups."""
    from nbflash.measure import time_ms

    return time_ms(call, warmup=3, repeats=repeats, budget_s=math.inf)


def interleaved_ms(calls, rounds, before=None, switch=None):
    """Median milliseconds of each of ``calls`` (name: callable), timed interleaved: each round times
    one call of every entry in turn (the order rotated round to round), between CUDA events, after
    ``before()`` where given (queued ahead, so host work overlaps the GPU's), ``switch(name)`` called
    first. Timed in blocks one after another instead, the last block starts on a hotter clock (an
    H100 at its power cap: docs/perf-notes.md, "Timing order")."""
    import cupy

    names, times = list(calls), {name: [] for name in calls}
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            if switch is not None:
                switch(name)
            if before is not None:
                before()
            start.record()
            calls[name]()
            stop.record()
            stop.synchronize()
            times[name].append(cupy.cuda.get_elapsed_time(start, stop))
    return {name: float(np.median(found)) for name, found in times.items()}


def build(named):
    from nbflash import launch

    name, config = named
    start = time.time()
    kernel = launch.compiled(config)
    return name, time.time() - start, kernel.registers, kernel.local_bytes


def main():
    import cupy

    from nbflash import launch
    from nbflash.kernels.geometry import visible_count
    from nbflash.problem import window_bounds

    jobs = {}
    for headdim, _, causal in SHAPES:
        for name, config in schedules(headdim, causal).items():
            jobs[config] = f"hd {headdim} {'causal' if causal else 'plain'} {name}"
    # spawned, not forked: the persistent grid's size asked the device, so CUDA is initialized here
    with ProcessPoolExecutor(min(12, os.cpu_count()), mp_context=multiprocessing.get_context("spawn")) as pool:
        for name, seconds, registers, local in pool.map(build, [(n, c) for c, n in jobs.items()]):
            print(f"built {name}: {seconds:.1f} s, {registers} registers, {local} local bytes", flush=True)
    rows = []
    for headdim, seqlen, causal in SHAPES:
        nheads, batch = 2048 // headdim, max(1, 16384 // seqlen)
        rng = np.random.default_rng(seqlen + headdim)
        q, k, v = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, headdim), np.float32)).astype(np.float16)
                   for _ in range(3))
        left, right, _ = window_bounds(seqlen, seqlen, causal, (-1, -1))
        params = (np.int32(left), np.int32(right)) if causal else ()
        flops = 4 * batch * nheads * visible_count(seqlen, seqlen, left, right) * headdim
        row, base, calls = {"shape": (headdim, seqlen, causal)}, None, {}
        for name, config in schedules(headdim, causal).items():
            kernel = launch.compiled(config)
            out = cupy.full(q.shape, np.nan, np.float16)
            lse = cupy.empty((batch, nheads, seqlen), np.float32)
            grid = config.grid(batch, nheads, seqlen)
            scale_log2 = np.float32(math.log2(math.e) / math.sqrt(headdim))

            def call(kernel=kernel, grid=grid, out=out, lse=lse, scale_log2=scale_log2):
                kernel.launch(grid, (q, k, v, out, lse), (scale_log2,), params)

            call()
            got = out.astype(np.float32)
            base = got if base is None else base
            row[name] = (None, float(cupy.abs(got - base).max()))
            for _ in range(3):  # warm-up
                call()
            calls[name] = call
        for name, ms in interleaved_ms(calls, ROUNDS).items():
            row[name] = (round(flops / ms / 1e9, 1), row[name][1])
        rows.append(row)
        print(row, flush=True)
    names = list(schedules(128, False))
    print("| hd | seqlen | causal | " + " | ".join(names) + " | max difference from base |")
    print("|---|---|---|" + "---|" * (len(names) + 1))
    for row in rows:
        headdim, seqlen, causal = row["shape"]
        cells = [str(row[n][0]) if n in row else "-" for n in names]
        difference = max(row[n][1] for n in names if n in row)
        print(f"| {headdim} | {seqlen} | {causal} | " + " | ".join(cells) + f" | {difference:.2g} |")


def backward_schedules(headdim, causal):
    import dataclasses

    from nbflash import configs
    from nbflash.kernels.backward_sm90 import Sm90BackwardConfig
    from nbflash.kernels.backward_sm90_rows import Sm90RowsBackwardConfig
    from nbflash.problem import Variant

    variant = Variant(window=causal, dropout=DROPOUT > 0)
    planned = configs.sm90_backward_config("float16", headdim, variant)  # step 40 / rows split at hd <= 64
    table = configs.sm90_backward_table_config("float16", headdim, variant)  # backward_sm90.py
    base = table.__class__(**{**table.__dict__, "stages": 2, "dq_split": "keys", "heavy_groups": 0,
                              "dropout_bits": "consumers", "dq_first": False})
    found = {"base": base, "serial": base.__class__(**{**base.__dict__, "overlap": False}),
             "3stages": base.__class__(**{**base.__dict__, "stages": 3}),
             "regs240": base.__class__(**{**base.__dict__, "producer_registers": 24, "consumer_registers": 240})}
    found["columns"] = base.__class__(**{**base.__dict__, "dq_split": "columns"})  # halves of 32 columns at hd 64
    found["3st-columns"] = base.__class__(**{**base.__dict__, "stages": 3, "dq_split": "columns"})
    found["steps"] = base.__class__(**{**base.__dict__, "dq_split": "steps"})
    found["3st-steps"] = base.__class__(**{**base.__dict__, "stages": 3, "dq_split": "steps"})
    if getattr(planned, "dq_split", "") == "columns":  # dQ_i's product after dV's and dK's (before dq_first)
        found["planned-dqlast"] = planned.replaced(dq_first=False, dq_reduce="red")
    if table.dq_split == "steps":  # hd 64: backward_sm90.py by 32-column halves, dQ_i's product first
        found["columns-dqfirst"] = table.__class__(**{**table.__dict__, "dq_split": "columns", "dq_first": True})
        # ... and dQ_i tile-major, 32-column parts (step 36)
        found["columns-tiles"] = table.__class__(**{**found["columns-dqfirst"].__dict__, "dq_reduce": "tiles"})
    if getattr(planned, "dq_reduce", "") == "tiles" and planned.dq_split != "rows":  # dQ_i by the consumers'
        # atomics (before step 35; step 40's dQ split by rows is tile-major only)
        found["planned-red"] = planned.replaced(dq_reduce="red")
    if DROPOUT and table.headdim_padded == 64 and table.dq_split == "columns":  # hd 64 dropout's plan before step 41
        found["planned-steps"] = table.__class__(**{**table.__dict__, "dq_split": "steps", "dq_first": False, "dq_reduce": "red"})
    for groups in (4, 8):  # longest-first within groups of (batch, KV head) pairs
        found[f"heavy-groups{groups}"] = table.__class__(**{**table.__dict__, "heavy_groups": groups})
    if DROPOUT:  # dropout's keep bits made by the producer's warps 2 and 3 instead of the consumer lanes
        found["dropout-producer"] = planned.replaced(dropout_bits="producer")  # (warps 2 and 3 make the bits)
        found["dropout-consumers"] = planned.__class__(**{**planned.__dict__, "dropout_bits": "consumers"})
    if base.headdim_padded == 64 and not DROPOUT:
        # the query rows split between the consumers (a kernel of its own), the planner's launch order
        found["rows"] = Sm90RowsBackwardConfig("float16", headdim, table.variant, heavy_groups=table.heavy_groups)
        found["rows-3st"] = Sm90RowsBackwardConfig("float16", headdim, table.variant, stages=3,
                                                   heavy_groups=table.heavy_groups)
        # dQ staged in fragment order, one bulk reduce-add a step by the stats warp (dq_reduce="tiles")
        found["rows-tiles"] = Sm90RowsBackwardConfig("float16", headdim, table.variant, dq_reduce="tiles",
                                                     heavy_groups=table.heavy_groups)
        # P and dS stored by stmatrix (16 instructions a step instead of 64)
        found["rows-stmatrix"] = Sm90RowsBackwardConfig("float16", headdim, table.variant, stmatrix=True,
                                                        heavy_groups=table.heavy_groups)
        # dQ's product issued once P is stored, under dS's stores ("dq"), and dV's too, behind a third
        # barrier ("dq-dv"; step 42)
        for early in ("dq", "dq-dv"):
            found[f"rows-{early}"] = Sm90RowsBackwardConfig("float16", headdim, table.variant, issue_early=early,
                                                              heavy_groups=table.heavy_groups)
        # backward_sm90.py with 128 query rows a step and dQ split by query rows (step 40: FlashAttention-3's
        # hd 64 shape, the keys split with block_m 128), dQ first and tile-major
        found["keys128"] = configs.keys128_backward_config("float16", headdim, table.variant)
        # the rows split as configs.sm90_backward_config makes it where step 40 is not planned (up to 32)
        # or switched off (configs.SM90_BACKWARD_KEYS128)
        found["rows-planned"] = configs.sm90_rows_backward_config("float16", headdim, table.variant)
        found["rows-dq-rotate"] = Sm90RowsBackwardConfig("float16", headdim, table.variant, issue_early="dq",
                                                         rotate=True, heavy_groups=table.heavy_groups)
        # a persistent grid, one block per multiprocessor, K and V double-buffered
        from numba import cuda

        found["rows-persistent"] = Sm90RowsBackwardConfig(
            "float16", headdim, table.variant, heavy_groups=table.heavy_groups,
            persistent=cuda.get_current_device().MULTIPROCESSOR_COUNT)
    if isinstance(planned, Sm90BackwardConfig) and planned.dq_tile_major and planned.stages == 2:
        # a third ring stage beside the staged dQ (hd 128: 232,008 of 232,448 bytes; step 52)
        try:  # (step 40's 128-query kernel has no room for it: the config refuses)
            found["planned-3st"] = dataclasses.replace(planned, stages=3)
        except ValueError:
            pass
    if isinstance(planned, Sm90BackwardConfig) and planned.dq_split == "rows":
        # step 40 with one set of dS^T tiles (a barrier a step between the consumers, ds_buffers=1), and
        # with the 32 KB that frees spent on a third ring stage ("A third ring stage for step 40 at hd 64")
        found["planned-ds1"] = dataclasses.replace(planned, ds_buffers=1)
        found["planned-ring3"] = dataclasses.replace(planned, ds_buffers=1, stages=3)
    if isinstance(planned, Sm90BackwardConfig) and planned.dq_warp:  # the stats warp adding the staged dQ_i too,
        # as planned until the thirty-fourth session (without dq_warp and stats_ahead), and dq_warp alone
        # ("planned-rotate" is then what "planned-all" was)
        found["planned-statswarp"] = dataclasses.replace(planned, dq_warp=False, stats_ahead=False)
        found["planned-notahead"] = dataclasses.replace(planned, stats_ahead=False)
    elif isinstance(planned, Sm90BackwardConfig) and planned.dq_tile_major and not planned.staged_dropout:
        # the staged dQ_i added by the producer's warp 2, apart from the stats warp's lse and D (dq_warp)
        found["planned-dqwarp"] = dataclasses.replace(planned, dq_warp=True)
        # ... and the stats warp's lse and D loaded a step ahead as well (stats_ahead)
        found["planned-dqwarp-ahead"] = dataclasses.replace(planned, dq_warp=True, stats_ahead=True)
        if not planned.variant.block_mask:  # ... and each block's query tiles rotated too (all three options)
            found["planned-all"] = dataclasses.replace(planned, dq_warp=True, stats_ahead=True, rotate=True)
    if (isinstance(planned, Sm90BackwardConfig) and planned.dq_warp and not planned.variant.varlen
            and not planned.variant.block_mask):  # the dQ conversion folded into the dK/dV kernel (fold_dq) or not
        found["planned-nofold" if planned.fold_dq else "planned-fold"] = dataclasses.replace(
            planned, fold_dq=not planned.fold_dq)
    if isinstance(planned, Sm90BackwardConfig) and not planned.stats_ahead:  # the stats warp's lse and D loaded a
        # step ahead (stats_ahead)
        found["planned-ahead"] = dataclasses.replace(planned, stats_ahead=True)
    if isinstance(planned, Sm90BackwardConfig) and planned.stages == 3:  # plain at hd 128 since step 52 was planned
        found["planned-2st"] = dataclasses.replace(planned, stages=2)
    if isinstance(planned, Sm90RowsBackwardConfig):  # the planned rows split, the other dK/dV stores (step 55)
        found["rows-pairs" if planned.store_quads else "rows-quads"] = dataclasses.replace(
            planned, store_quads=not planned.store_quads)
    if isinstance(planned, Sm90BackwardConfig) and planned.block_m == 64:  # 16-byte dK/dV stores (step 55)
        found["planned-pairs" if planned.store_quads else "planned-quads"] = dataclasses.replace(
            planned, store_quads=not planned.store_quads)
        if not planned.variant.varlen:  # dK and dV through K's and V's tiles and TMA stores (step 57)
            found["planned-tma"] = planned.replaced(store_tma=True)
    if not planned.variant.block_mask:  # each block's walk over the query tiles rotated by its key tile (step 43;
        # on step 40's 128-query kernel too: "The blocks of a head adding into one dQ tile")
        found["planned-rotate"] = planned.__class__(**{**planned.__dict__, "rotate": True})
    if getattr(planned, "heavy_groups", 0):  # the planned kernel's launch order in groups of 1, 2 and 8 (batch,
        # KV head) pairs instead of configs.SM90_BACKWARD_HEAVY_GROUPS' 4 (step 13, before step 40 and the tiles)
        for groups in (1, 2, 8):
            found[f"planned-groups{groups}"] = dataclasses.replace(planned, heavy_groups=groups)
    found["planned"] = planned
    return chosen(found, headdim, causal)


def main_backward():
    # Every shape's schedules from the planner, before the loop below stands in for it.
    table = {(headdim, causal): backward_schedules(headdim, causal) for headdim, _, causal in SHAPES}
    jobs = {}
    for (headdim, causal), found in table.items():
        for name, config in found.items():
            jobs[config] = f"hd {headdim} {'causal' if causal else 'plain'} {name}"
    # spawned, not forked: the persistent grid's size asked the device, so CUDA is initialized here
    with ProcessPoolExecutor(min(12, os.cpu_count()), mp_context=multiprocessing.get_context("spawn")) as pool:
        for name, seconds, registers, local in pool.map(build, [(n, c) for c, n in jobs.items()]):
            print(f"built {name}: {seconds:.1f} s, {registers} registers, {local} local bytes", flush=True)
    rows, began = [], time.time()
    for headdim, seqlen, causal in SHAPES:
        names = list(table[headdim, causal]) + (["SDPA"] if ANCHORS else [])
        if ISOLATE:
            row = {"shape": (headdim, seqlen, causal)}
            for name in names:
                row.update(isolated_entry(name, headdim, seqlen, causal))
        else:
            row = backward_row(table, headdim, seqlen, causal, names)
        rows.append(row)
        print(f"{time.time() - began:.0f} s", row, flush=True)
    names = list(dict.fromkeys(name for found in table.values() for name in found))
    names += ["SDPA flash", "SDPA cuDNN"] if ANCHORS else []
    print("| hd | seqlen | causal | " + " | ".join(names) + " | max difference from base |")
    print("|---|---|---|" + "---|" * (len(names) + 1))
    for row in rows:
        headdim, seqlen, causal = row["shape"]
        cells = [str(row[n][0]) if n in row else "-" for n in names]
        difference = max(row[n][1] for n in names if n in row)
        print(f"| {headdim} | {seqlen} | {causal} | " + " | ".join(cells) + f" | {difference:.2g} |")
    if ANCHORS:

        def ratio(row, name):
            value, anchor = row.get(name, ("-",))[0], row["SDPA flash"][0]
            numbers = isinstance(value, float) and isinstance(anchor, float)
            return f"{value / anchor:.2f}" if numbers else "-"

        ours = [n for n in names if not n.startswith("SDPA")]
        print("\nRatio to SDPA flash's backward:")
        print("| hd | seqlen | causal | " + " | ".join(ours) + " |")
        print("|---|---|---|" + "---|" * len(ours))
        for row in rows:
            headdim, seqlen, causal = row["shape"]
            cells = [ratio(row, n) for n in ours]
            print(f"| {headdim} | {seqlen} | {causal} | " + " | ".join(cells) + " |")


def backward_row(table, headdim, seqlen, causal, names):
    """One shape's entries: each schedule of ``names`` (and "SDPA": both anchors) as (TFLOP/s, its
    largest difference from "base", which is timed first whether named or not).

    The schedules are timed interleaved, call by call: each round queues a forward, then times one
    call of every schedule in turn (the order rotated round to round), and each schedule's figure is
    the median of its ROUNDS calls. Timing them one after another instead (ten calls of one, then
    ten of the next) let the GPU's clock drift between them: on an H100 at hd 128 the schedule timed
    last read 5-14% slower whichever it was (docs/perf-notes.md, "Timing order")."""
    import cupy

    import nbflash
    from nbflash import backward, configs
    from nbflash.kernels.geometry import visible_count
    from nbflash.problem import window_bounds

    nheads, batch = 2048 // headdim, max(1, 16384 // seqlen)
    rng = np.random.default_rng(seqlen + headdim)
    q, k, v, dout = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, headdim), np.float32))
                     .astype(np.float16) for _ in range(4))
    drop = dict(dropout_p=DROPOUT, seed=1) if DROPOUT else {}
    out, lse = nbflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, **drop)
    left, right, _ = window_bounds(seqlen, seqlen, causal, (-1, -1))
    flops = 2.5 * 4 * batch * nheads * visible_count(seqlen, seqlen, left, right) * headdim
    row, base = {"shape": (headdim, seqlen, causal)}, None
    planned, kernels = configs.sm90_backward_config, backward._kernels
    current, compiled = [None], {}

    def kernels_of(*args, **kwargs):  # each schedule's kernels kept apart, so that switching is a lookup
        key = (current[0], args, tuple(sorted(kwargs.items())))
        if key not in compiled:
            compiled[key] = kernels.__wrapped__(*args, **kwargs)
        return compiled[key]

    def call():
        with nbflash.kernel_family("sm90"):
            return nbflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, **drop)

    ours = ["base"] + [n for n in names if n not in ("base", "SDPA")]
    configs.sm90_backward_config = lambda *args: table[headdim, causal][current[0]]
    backward._kernels = kernels_of
    try:
        for name in ours:  # each one's gradients against the base's, and its warm-up
            current[0] = name
            got = [g.astype(np.float32) for g in call()]
            base = got if base is None else base
            difference = max(float(cupy.abs(a - b).max()) for a, b in zip(got, base))
            row[name] = (None, difference)
            for _ in range(2):
                call()
        # a forward queued before each timed call, as the SDPA anchors' (bench.BackwardOnly): the
        # call's host work runs while the GPU is still busy with it
        medians = interleaved_ms({name: call for name in ours}, ROUNDS,
                                 before=lambda: nbflash.flash_attn_func(q, k, v, causal=causal, **drop),
                                 switch=lambda name: current.__setitem__(0, name))
        for name, ms in medians.items():
            row[name] = (round(flops / ms / 1e9, 1), row[name][1])
    finally:
        configs.sm90_backward_config = planned
        backward._kernels = kernels
        backward._kernels.cache_clear()
    if "SDPA" in names:
        for name, ms in sdpa_backward_ms(q, k, v, causal).items():
            row[name] = (round(flops / ms / 1e9, 1), 0.0)
    return row


def isolated_entry(name, headdim, seqlen, causal):
    """``backward_row`` of one schedule (or "SDPA") in a child process with ISOLATE seconds: a
    schedule that hangs the GPU costs its own entries, shown as "hang"."""
    import json
    import subprocess

    command = [sys.executable, os.path.abspath(__file__), "--backward", "--child", name, str(headdim), str(seqlen),
               str(causal), "--dropout", str(DROPOUT)]
    labels = ["SDPA flash", "SDPA cuDNN"] if name == "SDPA" else [name]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=ISOLATE)
    except subprocess.TimeoutExpired:
        return {label: ("hang", 0.0) for label in labels}
    found = [line for line in run.stdout.splitlines() if line.startswith("ENTRY ")]
    if not found:
        print(f"{name} at {(headdim, seqlen, causal)} failed:", run.stderr[-2000:], flush=True)
        return {label: ("fail", 0.0) for label in labels}
    entries = json.loads(found[-1][len("ENTRY "):])
    return {label: tuple(entries[label]) for label in labels}


def child_entry(name, headdim, seqlen, causal):
    import json

    table = {(headdim, causal): backward_schedules(headdim, causal)}
    row = backward_row(table, headdim, seqlen, causal, [name])
    del row["shape"]
    print("ENTRY " + json.dumps(row), flush=True)


def sdpa_backward_ms(q, k, v, causal):
    """SDPA flash's and cuDNN's backward on these inputs, milliseconds, timed as bench.py times them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench", os.path.join(os.path.dirname(__file__), "bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return {f"SDPA {label}": bench.sdpa_backward_runner(backend)(q, k, v, causal).time_ms(warmup=2, repeats=10)
            for label, backend in (("flash", "FLASH_ATTENTION"), ("cuDNN", "CUDNN_ATTENTION"))}


def main_parts(deterministic=False):
    """The planned backward's kernels timed apart: the preprocess, the dK/dV kernel, and dQ's pass:
    the conversion of dq_accum after atomics, or the sm90 dQ kernel where the plan holds the pair
    (deterministic=True, or past headdim 128: configs.SM90_PAIR_DEFAULT_HEADDIMS). Each kernel's
    TFLOP/s counts its own products (2 N^2 d FLOPs each over the visible scores): dK/dV with dQ 5
    (S, dP, dV, dK, dQ), without 4, the dQ kernel 3 (S, dP, dQ)."""
    import cupy

    import nbflash
    from nbflash import backward, validation
    from nbflash.kernels.geometry import visible_count
    from nbflash.measure import back_to_back_ms, time_ms
    from nbflash.problem import window_bounds

    copy_src = cupy.empty(1 << 28, np.uint8)
    copy_dst = cupy.empty_like(copy_src)
    copy_gbs = 2 * copy_src.nbytes / median_ms(lambda: copy_dst.__setitem__(Ellipsis, copy_src), 20) / 1e6
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write); deterministic={deterministic}")
    print("| hd | seqlen | causal | plan | preprocess us | GB/s | dq_accum zeroed us | dK/dV us | TFLOP/s | dQ pass us "
          "| GB/s or TFLOP/s | whole call us | behind a forward us | back to back us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for headdim, seqlen, causal in SHAPES:
        nheads, batch = 2048 // headdim, max(1, 16384 // seqlen)
        rng = np.random.default_rng(seqlen + headdim)
        q, k, v, dout = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, headdim), np.float32))
                         .astype(np.float16) for _ in range(4))
        out, lse = nbflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
        problem, q_, k_, v_ = validation.check_forward(q, k, v, None, causal)
        preprocess, dkdv, last = backward._kernels(problem.static, deterministic, None, problem.aligned,
                                                   validation.rows_aligned(out))
        pair = not dkdv.config.atomic_dq  # dQ by the sm90 dQ kernel (or the mma one), not by atomics
        shape = (batch, nheads, nheads, seqlen, seqlen)
        delta = cupy.empty((batch, nheads, seqlen), np.float32)
        # as the launcher makes it: row-major, or tile-major (dq_reduce="tiles", hd 72-128), whose
        # zeroing is not the preprocess's (delta stands in for it there)
        dq_accum, tiles = (delta, False) if pair else backward._dq_accumulator(dkdv.config, batch, nheads, seqlen,
                                                                                q.shape)
        dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
        scale = np.float32(problem.softmax_scale)
        scale_log2 = np.float32(problem.softmax_scale * math.log2(math.e))
        params = backward.kernel_params(problem, dkdv.config)
        if pair:
            last_args, last_scalars = (q_, k_, v_, dout, lse, delta, dq), (scale_log2, scale)
            last_params = backward.kernel_params(problem, last.config)
        else:
            last_args, last_scalars, last_params = (dq_accum, dq), (scale,), ()

        def call():
            return nbflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)

        # with fold_dq the dK/dV kernel converts dQ itself, and each launch needs its counters (in
        # dq_accum) zeroed: it is timed after a memset of dq_accum, and no conversion kernel runs
        folded = getattr(dkdv.config, "fold_dq", False)

        def dkdv_launch():
            if folded:
                dq_accum.fill(0)
            dkdv.launch(dkdv.config.grid(*shape), (q_, k_, v_, dout, lse, delta, dk, dv, dq_accum,
                                                   *backward._dq_out(dkdv, dq)), (scale_log2, scale), params)

        times = {
            "pre": median_ms(lambda: preprocess.launch(preprocess.config.grid(*shape),
                                                       (out, dout, delta, delta if tiles else dq_accum), ()), 20),
            "dkdv": median_ms(dkdv_launch, 10),
            "last": 0.0 if folded else median_ms(lambda: last.launch(last.config.grid(*shape), last_args,
                                                                     last_scalars, last_params), 10 if pair else 20),
            # tile-major: the launcher's zeroed dq_accum (cupy.zeros: the pool's allocation and a memset)
            "zeros": median_ms(lambda: cupy.zeros(dq_accum.shape, dq_accum.dtype), 20) if tiles else 0.0,
            "call": median_ms(call, 10),
            # the call's host work hidden behind a forward queued ahead (as the SDPA anchors are timed),
            # and ten calls back to back: against "call", what the host and the launch gaps cost
            "behind": time_ms(call, warmup=3, repeats=10, budget_s=math.inf,
                              before=lambda: nbflash.flash_attn_func(q, k, v, causal=causal)),
            "row": back_to_back_ms(call, 10, warmup=3, repeats=5, budget_s=math.inf),
        }
        left, right, _ = window_bounds(seqlen, seqlen, causal, (-1, -1))
        product_flops = 2 * batch * nheads * visible_count(seqlen, seqlen, left, right) * headdim
        # read O, dO; write D (and dq_accum's zeros where row-major: tile-major, the launcher's cupy.zeros)
        pre_bytes = out.nbytes + dout.nbytes + delta.nbytes + (0 if pair or tiles else dq_accum.nbytes)
        if folded:
            last_rate = "folded into dK/dV (its us: after dq_accum's memset)"
        elif pair:
            last_rate = f"{3 * product_flops / times['last'] / 1e9:.1f} TFLOP/s"
        else:
            last_rate = f"{(dq_accum.nbytes + dq.nbytes) / times['last'] / 1e6:.0f} GB/s"
        print(f"| {headdim} | {seqlen} | {causal} | {'pair' if pair else 'atomic'} | {1e3 * times['pre']:.0f} "
              f"| {pre_bytes / times['pre'] / 1e6:.0f} | {1e3 * times['zeros']:.0f} | {1e3 * times['dkdv']:.0f} "
              f"| {(4 if pair else 5) * product_flops / times['dkdv'] / 1e9:.1f} | {1e3 * times['last']:.0f} "
              f"| {last_rate} | {1e3 * times['call']:.0f} | {1e3 * times['behind']:.0f} | {1e3 * times['row']:.0f} |",
              flush=True)


def parse_args():
    parser = argparse.ArgumentParser(description="Time the Hopper kernels' schedules side by side.")
    parser.add_argument("--backward", action="store_true", help="the backward's schedules (default: the forward's)")
    parser.add_argument("--headdims", type=int, nargs="+", metavar="D", help="only the shapes of these headdims")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="only these schedules ('base', the differences' reference, and the backward's "
                             "'planned' are always timed)")
    parser.add_argument("--anchors", action="store_true",
                        help="with --backward: time SDPA's flash and cuDNN backwards in the same loop")
    parser.add_argument("--isolate", type=float, metavar="SECONDS",
                        help="with --backward: time each (shape, schedule) in a child process with this time "
                             "limit, so that a schedule that hangs the GPU costs only its own cells")
    parser.add_argument("--seqlens", type=int, nargs="+", metavar="N",
                        help="these seqlens instead of 4k and 16k (batch x seqlen 16k tokens; a batch of one past)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, metavar="R",
                        help=f"the timed calls of each schedule, interleaved (default {ROUNDS})")
    parser.add_argument("--child", nargs=4, metavar=("NAME", "HD", "SEQLEN", "CAUSAL"), help=argparse.SUPPRESS)
    parser.add_argument("--rowwise-scalar", action="store_true",
                        help="plan the row-wise kernels' scalar forms (configs.ROWWISE_VECTOR off) for this run")
    parser.add_argument("--dropout", type=float, default=0.0, metavar="P",
                        help="with --backward: the schedules with dropout of probability P (the SDPA anchors "
                             "without), and \"dropout-producer\": the planned kernel with the keep bits made by "
                             "the producer's warps 2 and 3")
    parser.add_argument("--parts", action="store_true",
                        help="the planned backward's preprocess, dK/dV kernel and dQ pass (the dq conversion, or "
                             "the dQ kernel where the plan holds the pair) timed apart; --headdims takes any "
                             "headdim here")
    parser.add_argument("--deterministic", action="store_true", help="with --parts: plan deterministic=True")
    parser.add_argument("--dq-keys", nargs="+", default=[], metavar="HD:KEYS",
                        help="with --parts: the sm90 dQ kernel's key tiles for configs.SM90_DQ's row of "
                             "largest headdim HD (an option to time, such as 256:48)")
    parser.add_argument("--deterministic-keys128", action="store_true",
                        help="with --parts --deterministic: the dK/dV pass at 128 query rows a step where step 40 "
                             "is planned (configs.SM90_DETERMINISTIC_KEYS128)")
    parser.add_argument("--no-split-tiles", action="store_true",
                        help="plan the wide kernel's P^T and dS^T made by consumer 0 alone (the form before "
                             "configs.SM90_WIDE_SPLIT_TILES)")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    if args.headdims and args.parts:  # any headdim: 4k and 16k, causal and not
        SHAPES = [(d, n, c) for d in args.headdims for c in (False, True) for n in (4096, 16384)]
    elif args.headdims:  # the table's shapes of these headdims; 4k and 16k, causal and not, for others
        SHAPES = [shape for shape in SHAPES if shape[0] in args.headdims] + [
            (d, n, c) for d in args.headdims if d not in {shape[0] for shape in SHAPES} for c in (False, True)
            for n in (4096, 16384)]
    if args.seqlens:
        SHAPES = [(d, n, c) for d, c in dict.fromkeys((d, c) for d, _, c in SHAPES) for n in args.seqlens]
    if args.only:
        ONLY = {"base", "planned", *args.only}
    ANCHORS = args.anchors
    ISOLATE = args.isolate
    ROUNDS = args.rounds
    DROPOUT = args.dropout
    if args.rowwise_scalar:  # the backward calls plan the row-wise kernels' scalar forms
        from nbflash import configs

        configs.ROWWISE_VECTOR = False
    if args.child:
        name, headdim, seqlen, causal = args.child
        child_entry(name, int(headdim), int(seqlen), causal == "True")
        sys.exit(0)
    if args.dq_keys:
        from nbflash import configs

        rows = dict(configs.SM90_DQ)
        for item in args.dq_keys:
            headdim, keys = map(int, item.split(":"))
            if headdim not in rows:
                raise SystemExit(f"--dq-keys {item}: configs.SM90_DQ has no row of largest headdim {headdim}")
            rows[headdim] = keys
        configs.SM90_DQ[:] = sorted(rows.items())
        print(f"configs.SM90_DQ for this run: {configs.SM90_DQ}")
    if args.no_split_tiles:
        from nbflash import configs

        configs.SM90_WIDE_SPLIT_TILES = False
        print("configs.SM90_WIDE_SPLIT_TILES = False for this run")
    if args.deterministic_keys128:
        from nbflash import configs

        configs.SM90_DETERMINISTIC_KEYS128 = True
        print("configs.SM90_DETERMINISTIC_KEYS128 = True for this run")
    main_parts(args.deterministic) if args.parts else main_backward() if args.backward else main()
