"""How much the launch order of the backward's dK/dV blocks costs at the end of the grid, by a model.

Causal attention gives the key tiles unequal work: key tile n of a (batch, KV head) sees the query
tiles from its diagonal on, (seqlen - block_n n) / block_m steps. The GPU starts blocks in grid
order on whichever multiprocessor frees up; one block per SM fits (shared memory). The model: a
block takes time proportional to its steps, SMs take the next block greedily, and the makespan is
compared with the ideal (all steps spread evenly). Orders:

- default: a pair's key tiles side by side (tile 0, the heaviest, first), pair after pair;
- heavy-first: key tile 0 of every pair, then tile 1, ... (the kernel's former ``heavy_first``);
- groups of G: heavy-first inside each group of G pairs, group after group (``heavy_groups``).

    python scripts/dispatch_model.py [--sms 132] [--block-m 64] [--block-n 128]

(The forward's causal query blocks have the same shape of work: --block-n is then its block_m and
--block-m its block_n, and --sms the block slots, e.g. 264 for the mma forward's 2 blocks per SM.)

It models the order only: no memory system (heavy-first measured slower than the model says at
headdim 64 because the blocks running together then read many heads' Q and dO; groups keep that
to a few heads, as the default does).
"""

import argparse
import heapq
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nbflash.kernels.geometry import grouped_block, grouped_grid  # noqa: E402

SHAPES = [(2048, 16, 8), (4096, 16, 4), (8192, 16, 2), (16384, 16, 1), (4096, 32, 4), (16384, 32, 1)]  # seqlen, KV heads, batch
GROUPS = (2, 4, 8, 16)


def makespan(durations, sms):
    """Greedy list scheduling in order: each block starts on the SM that frees first."""
    free = [0.0] * sms
    for duration in durations:
        heapq.heappush(free, heapq.heappop(free) + duration)
    return max(free)


def orders(seqlen, heads, batch, block_m, block_n, groups):
    """Block durations (steps) in each launch order."""
    tiles = -(-seqlen // block_n)
    steps = [max(1, -(-(seqlen - block_n * n) // block_m)) for n in range(tiles)]
    pairs = batch * heads
    found = {"default": [steps[n] for _ in range(pairs) for n in range(tiles)],
             "heavy-first": [steps[n] for n in range(tiles) for _ in range(pairs)]}
    for g in groups:  # the kernels' own mapping of a block to its (tile, pair)
        x_blocks, y_blocks, _ = grouped_grid(tiles, pairs, g)
        found[f"groups of {g}"] = [steps[tile] for y in range(y_blocks) for x in range(x_blocks)
                                   for tile, pair in [grouped_block(x, y, g)] if pair < pairs]
    return found, sum(steps) * pairs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--block-m", type=int, default=64)
    parser.add_argument("--block-n", type=int, default=128)
    args = parser.parse_args()
    names = ["default", "heavy-first"] + [f"groups of {g}" for g in GROUPS]
    print("makespan over the ideal, causal:")
    print("| seqlen | KV heads | batch | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for seqlen, heads, batch in SHAPES:
        found, total = orders(seqlen, heads, batch, args.block_m, args.block_n, GROUPS)
        ideal = total / args.sms
        cells = [f"{makespan(found[name], args.sms) / ideal:.3f}" for name in names]
        print(f"| {seqlen} | {heads} | {batch} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
