"""Kernel configurations: the one table of block sizes, and the choice of kernel family.

Every heuristic lives here. ``plan_forward`` turns a validated problem into a frozen config that the
launcher compiles (once per config) and launches.
"""

from .kernels.forward_portable import PortableForwardConfig, shared_bytes

# Shared memory a block may use without opting in: every CUDA GPU offers it, so the portable path
# stays within it.
PORTABLE_SHARED_LIMIT = 48 * 1024

# Portable forward: (largest headdim, threads per query row, query rows per block). The key tile
# height is the largest power of two from 64 down that keeps the four float32 tiles within
# PORTABLE_SHARED_LIMIT. More threads per row keep each thread's slice of the output row (held in
# registers) at 16 to 32 floats.
PORTABLE_FORWARD = [
    (32, 4, 64),
    (64, 4, 64),
    (128, 8, 32),
    (256, 8, 16),
]

FAMILIES = ("portable",)


def portable_forward_config(dtype, headdim, causal):
    for max_headdim, threads_per_row, block_m in PORTABLE_FORWARD:
        if headdim <= max_headdim:
            break
    block_n = 64
    while block_n > threads_per_row and shared_bytes(headdim, block_m, block_n) > PORTABLE_SHARED_LIMIT:
        block_n //= 2
    return PortableForwardConfig(dtype, headdim, causal, block_m, block_n, threads_per_row)


def plan_forward(problem, family=None):
    """The config to run ``problem`` (a validation.Problem) with; ``family`` forces a kernel family."""
    if family not in (None, "portable"):
        raise ValueError(f"{family=} is not a kernel family; expected one of {FAMILIES} or None")
    return portable_forward_config(problem.dtype, problem.headdim, problem.causal)
