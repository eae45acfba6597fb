"""Kernel configurations: the one table of block sizes, and the choice of kernel family.

Every heuristic lives here. ``plan_forward`` turns the static part of a validated problem
(``nbflash.problem.Static``) into a frozen config that the launcher compiles (once per config) and
launches; ``plan_backward`` does the same for the backward's kernels. Three kernel families, named by the
architecture they need (``"mma"``, the sm80 family's first name, stays an alias of ``"sm80"``):

- ``"sm90"``: Hopper's wgmma, TMA and warp specialization (nbflash/kernels/forward_sm90.py): the
  float16 / bfloat16 forward on compute capability 9.0, every variant but packed sequences (the
  window, softcap, ALiBi, bias and mask tensors, score_mod, mask_mod and its block mask, dropout), a
  positive scale, headdim a multiple of 8 up to 256, rows on 16-byte boundaries
  (``sm90_unsupported_reason``); chosen by default at the headdims where it was measured faster
  (``SM90_DEFAULT_HEADDIMS``; with softcap and ALiBi measured at headdim 128), for the variants
  measured (``SM90_DEFAULT_VARIANTS``: the others run on it only when "sm90" is forced). Its backward
  (nbflash/kernels/backward_sm90.py: the dK/dV kernel with atomic dq; every variant, packed
  sequences included, headdim up to 128, ``sm90_backward_unsupported_reason``; at headdims up to
  64, for plain and windowed attention, its sibling nbflash/kernels/backward_sm90_rows.py, which
  splits the query rows between the consumers; at headdims 136-256, every variant, its sibling
  nbflash/kernels/backward_sm90_wide.py, which splits headdim: ``sm90_backward_config``) is the
  default at ``SM90_BACKWARD_DEFAULT_HEADDIMS`` for plain and causal attention, with one of softcap,
  ALiBi, a bias tensor, dropout or a score_mod at the headdims where each was measured
  (``SM90_BACKWARD_FEATURE_HEADDIMS``), with a block mask (``SM90_BACKWARD_BLOCK_MASK_HEADDIMS``),
  and for packed sequences at headdims 64 and 128 (``SM90_BACKWARD_VARLEN_HEADDIMS``); with
  deterministic=True (its dK/dV kernel without dQ, then nbflash/kernels/backward_dq_sm90.py) at
  ``SM90_DETERMINISTIC_DEFAULT_HEADDIMS`` for the same variants but packed sequences, and that
  pair without deterministic=True too at ``SM90_PAIR_DEFAULT_HEADDIMS`` (past headdim 128, where it
  beats the wide kernel's dQ atomics; with a feature, those of ``SM90_PAIR_FEATURES``); the sm80
  family's backward elsewhere. Its fp8 (e4m3)
  forward is reached only through flash_attn_func's fp8 inputs (``SM90_FP8_FORWARD``).
- ``"sm80"`` (alias ``"mma"``): tensor cores through ``mma.sync`` (nbflash/kernels/forward_mma.py);
  float16 and bfloat16 on GPUs of compute capability 8.0 and newer (Ampere, Ada, and Hopper where
  sm90 does not serve a call). Chosen wherever it applies and sm90 is not.
- ``"portable"``: scalar float32 arithmetic (nbflash/kernels/forward_portable.py); any dtype, any
  GPU. Serves float32 and older GPUs.

``kernel_family(name)`` forces a family inside a ``with`` block (as PyTorch's ``sdpa_kernel`` does).
"""

import contextlib
import contextvars
import dataclasses
import math
from functools import lru_cache

from . import runtime
from .problem import Variant
from .kernels.backward_mma import MmaBackwardConfig
from .kernels.backward_sm90 import MAX_HEADDIM as SM90_BACKWARD_MAX_HEADDIM
from .kernels.backward_sm90 import Sm90BackwardConfig, Sm90ConvertDqConfig, keys128_serves
from .kernels.backward_sm90_rows import Sm90RowsBackwardConfig
from .kernels.backward_sm90_wide import MAX_HEADDIM as SM90_WIDE_BACKWARD_MAX_HEADDIM
from .kernels.backward_sm90_wide import Sm90WideBackwardConfig
from .kernels.backward_sm90_rows import served as sm90_rows_serves
from .kernels.backward_dq_sm90 import Sm90DqConfig
from .kernels.forward_mma import MmaForwardConfig
from .kernels.forward_sm90 import UNSERVED_FEATURES as SM90_UNSERVED_FEATURES
from .kernels.forward_sm90 import FP8, Sm90ForwardConfig, served as sm90_serves
from .kernels.backward_portable import PortableBackwardConfig
from .kernels.decode_mma import MmaDecodeConfig
from .kernels.backward_portable import shared_bytes as backward_shared_bytes
from .kernels.forward_portable import PortableForwardConfig, shared_bytes

FAMILIES = ("sm90", "sm80", "portable")
FAMILY_ALIASES = {"mma": "sm80"}  # earlier names, still accepted everywhere a family is named


def canonical_family(family):
    """A family's name as FAMILIES spells it (``"mma"`` -> ``"sm80"``); None stays None."""
    return FAMILY_ALIASES.get(family, family)


MMA_DTYPES = ("float16", "bfloat16")
MMA_MIN_COMPUTE_CAPABILITY = (8, 0)

# Shared memory a block may use without opting in: every CUDA GPU offers it, so the portable path
# stays within it.
PORTABLE_SHARED_LIMIT = 48 * 1024

# Portable forward: (largest headdim, threads_x, threads_y, rows_per_thread). The key tile height is
# the largest of 64, 32, 16, 8 that keeps the shared tiles within PORTABLE_SHARED_LIMIT. Each thread
# holds rows_per_thread x (headdim / threads_x) output values in registers: 16 to 64 floats.
PORTABLE_FORWARD = [
    (32, 16, 16, 4),
    (64, 16, 16, 4),
    (128, 16, 8, 4),
    (256, 8, 8, 2),
]

# Tensor-core forward: (largest headdim, block_m, block_n, num_warps), for both float16 and bfloat16,
# causal or not. With 4 warps each warp owns two 16-row slices of a 128-row query tile, which halves
# the K/V shared-memory reads per FLOP; block_n 32 keeps that within the registers (0 spills).
# Measured (docs/perf-notes.md, round 3): 0.82-0.91x SDPA flash at headdim 128, seqlen 4k-16k, fp16,
# against 0.75-0.86x for (128, 64, 8 warps). Up to headdim 64 the registers leave room for 64-key
# tiles: the search around this table (scripts/gpu_mma.py --around, docs/perf-notes.md) measured
# (128, 64, 4) at 0.97x SDPA flash non-causal and 0.93x causal at headdim 64 (mean of 4k and 16k),
# against 0.91x and 0.76x for (128, 32, 4); at headdims 128 and 256 the table's rows were best.
MMA_FORWARD = [
    (64, 128, 64, 4),
    (128, 128, 32, 4),
    (256, 64, 32, 4),
]

# The tensor-core forward's launch order with a window (causal): longest-first within groups of 8
# (batch, head) pairs (``heavy_groups``). Measured on the H200 (scripts/bench.py --heavy-groups 8,
# docs/perf-notes.md step 13): causal hd 128 8k fp16 +11.6%, causal + ALiBi +10.5%. Without a window
# every query block has the same work and the order is left as it was.
MMA_FORWARD_HEAVY_GROUPS = 8

# The tensor-core forward's lazy rescaling (MmaForwardConfig.rescale_slack: P may reach 2**8 before
# a warp moves its maxima and rescales O), by largest headdim. Measured on the H200 at headdim 128,
# 8k, fp16 (scripts/bench.py --rescale-slack 8 --rounds 5, docs/benchmarks.md "GPU runs of
# 2026-12-04, second session"): the window +9.7% (0.95x FlexAttention), causal +8.9%. Not measured
# at headdims 64 and 256: off there.
MMA_FORWARD_RESCALE_SLACK = [
    (64, 0.0),
    (128, 8.0),
    (256, 0.0),
]

_forced_family = contextvars.ContextVar("nbflash_kernel_family", default=None)


def kernel_family(family):
    """Run the calls inside the ``with`` block on one kernel family: ``"sm90"``, ``"sm80"`` (or
    its alias ``"mma"``) or ``"portable"``.

    A name that is not a family raises ValueError here, at the call (not only on entering the
    block). A call the forced family cannot serve (float32 on ``"sm80"``, say) raises ValueError.
    A backward under ``"sm90"`` runs the Hopper dK/dV kernel where it serves the call (every
    variant, headdim a multiple of 8 up to 256: ``sm90_backward_unsupported_reason``; with
    deterministic=True, its form without dQ and the Hopper dQ kernel) and the sm80 family's kernels
    otherwise.
    """
    _check_family(family)
    return _forcing(canonical_family(family))


@contextlib.contextmanager
def _forcing(family):
    token = _forced_family.set(family)
    try:
        yield
    finally:
        _forced_family.reset(token)


def _check_family(family):
    if canonical_family(family) not in FAMILIES:
        raise ValueError(f"{family=} is not a kernel family; expected one of {FAMILIES} (or the alias 'mma')")


@lru_cache(maxsize=None)
def _compute_capability(device):
    if runtime.SIMULATOR:
        return (9, 0)  # the simulator runs every kernel; emulate a current GPU
    props = runtime.cupy().cuda.runtime.getDeviceProperties(device)
    return (props["major"], props["minor"])


def mma_unsupported_reason(dtype, device=0):
    """Why the tensor-core family cannot run this call, or None when it can."""
    if dtype not in MMA_DTYPES:
        return f"the tensor-core kernel takes float16 or bfloat16, not {dtype}"
    cc = _compute_capability(device)
    if cc < MMA_MIN_COMPUTE_CAPABILITY:
        return f"the tensor-core kernel needs compute capability >= 8.0, this GPU has {cc[0]}.{cc[1]}"
    return None


SM90_COMPUTE_CAPABILITY = (9, 0)
SM90_MAX_HEADDIM = 256

# Hopper forward: (largest headdim, block_n, stages); block_m is 128 (two consumer warpgroups of 64
# rows). Start points (FlashAttention-3's tile shapes), not tuned; at headdim 256, 80-key tiles in 2
# stages fill the 227 KB of shared memory.
SM90_FORWARD = [
    (64, 128, 3),
    (128, 128, 2),
    (256, 80, 2),
]

# The headdims at which the sm90 family is the default on compute capability 9.0: where it was
# measured faster than the mma family, causal and not (docs/perf-notes.md, "Hopper forward": fp16 at
# headdims 64 and 128, seqlen 1k-16k, 1.17-2.01x the mma family, except headdim 64 causal at 1k: 176
# against 178 TFLOP/s; at headdim 256, seqlen 4k and 16k, 2.4-3.1x). Other headdims it serves
# (multiples of 8 up to 256) are not measured yet: mma by default. With softcap or ALiBi it is the
# default at these headdims too: measured at headdim 128, seqlen 8k, fp16 (docs/perf-notes.md,
# "Hopper forward"), softcap 320-360 and ALiBi 411-476 TFLOP/s against the mma family's ~236 and ~259
# (causal); headdims 64 and 256 with them are not measured.
SM90_DEFAULT_HEADDIMS = (64, 128, 256)
# ... for the variants measured there: plain and windowed (causal) attention, each with or without
# softcap and ALiBi. The bias and mask tensors and mask_mod run on the sm90 forward only when "sm90"
# is forced (not measured); mma by default.
SM90_DEFAULT_VARIANTS = tuple(Variant(window=window, softcap=softcap, alibi=alibi)
                              for softcap in (False, True) for alibi in (False, True) for window in (False, True))
# Dropout and score_mod, each alone or with the window, were measured at headdims 64 and 128 (fp16,
# seqlen 8k, causal; docs/benchmarks.md, 2026-12-03): the sm90 forward 1.08x / 1.45x the mma
# forward with dropout (hd 64 / 128), 1.22x / 1.53x with a score_mod; the sm90 backward 1.48x /
# 1.54x and 1.77x / 1.96x the mma backward. There they take the sm90 family by default.
SM90_MEASURED_EXTRAS = ("dropout", "score_mod")
SM90_EXTRAS_HEADDIMS = (64, 128)
# mask_mod with its block mask (and no other feature) was measured at headdim 128 (fp16, seqlen 8k,
# three documents; docs/benchmarks.md, "GPU runs of 2026-12-03, third session"): the sm90 forward
# 263.8 TFLOP/s against the mma forward's 156.9, the sm90 backward 182.0 against 125.7. There it
# takes the sm90 family by default, forward and backward.
SM90_BLOCK_MASK_HEADDIMS = (128,)


def _measured_on_sm90(variant, headdim, measured):
    """``variant`` at ``headdim`` was measured faster on the sm90 family: it is one of ``measured``,
    or the plain kernel or the window with one of ``SM90_MEASURED_EXTRAS`` at
    ``SM90_EXTRAS_HEADDIMS``, or mask_mod with its block mask at ``SM90_BLOCK_MASK_HEADDIMS``."""
    variant = variant._replace(score_mod_grad="")
    if variant in measured:
        return True
    if variant.block_mask and variant._replace(mask_mod="", block_mask=False) == Variant():
        return headdim in SM90_BLOCK_MASK_HEADDIMS
    extras = [feature for feature in SM90_MEASURED_EXTRAS if getattr(variant, feature)]
    return (headdim in SM90_EXTRAS_HEADDIMS and len(extras) == 1
            and variant._replace(dropout=False, score_mod="") in (Variant(), Variant(window=True)))


def _backward_features(variant):
    """The features of ``SM90_BACKWARD_FEATURE_HEADDIMS`` that ``variant`` adds to plain or windowed
    attention, sorted by name; () for any other variant."""
    features = tuple(sorted(name for name in SM90_BACKWARD_FEATURE_HEADDIMS if getattr(variant, name)))
    plain = variant._replace(score_mod_grad="", **{name: Variant._field_defaults[name] for name in features})
    return features if plain in (Variant(), Variant(window=True)) else ()


def _backward_feature(variant):
    """The one feature of ``SM90_BACKWARD_FEATURE_HEADDIMS`` that ``variant`` adds to plain or windowed
    attention; None for any other variant."""
    features = _backward_features(variant)
    return features[0] if len(features) == 1 else None


def _backward_measured_on_sm90(variant, headdim, deterministic=False):
    """``variant`` at ``headdim`` (one of ``SM90_BACKWARD_DEFAULT_HEADDIMS``) was measured faster on the
    sm90 backward: plain or windowed attention, one feature of ``SM90_BACKWARD_FEATURE_HEADDIMS`` at
    its headdims (with ``deterministic``, not those of ``SM90_BACKWARD_ATOMIC_ONLY_FEATURES``), or
    mask_mod with its block mask at ``SM90_BACKWARD_BLOCK_MASK_HEADDIMS``, or two features of
    ``SM90_BACKWARD_FEATURE_PAIRS`` together at theirs (without deterministic: measured so)."""
    variant = variant._replace(score_mod_grad="")
    if variant in SM90_BACKWARD_DEFAULT_VARIANTS:
        return True
    if variant.block_mask and variant._replace(mask_mod="", block_mask=False) == Variant():
        return headdim in SM90_BACKWARD_BLOCK_MASK_HEADDIMS
    features = _backward_features(variant)
    if len(features) != 1:
        return not deterministic and headdim in SM90_BACKWARD_FEATURE_PAIRS.get(features, ())
    feature = features[0]
    if deterministic and feature in SM90_BACKWARD_ATOMIC_ONLY_FEATURES:
        return False
    return headdim in SM90_BACKWARD_FEATURE_HEADDIMS[feature]


def sm90_unsupported_reason(static):
    """Why the sm90 forward cannot run this call (a problem's static part), or None when it can."""
    reason = mma_unsupported_reason(static.dtype, static.device)
    if reason:
        return reason
    cc = _compute_capability(static.device)
    if cc != SM90_COMPUTE_CAPABILITY:
        return f"the sm90 kernel runs on compute capability 9.0 only, this GPU has {cc[0]}.{cc[1]}"
    if not sm90_serves(static.variant):
        return f"the sm90 kernel serves every variant but {' and '.join(SM90_UNSERVED_FEATURES)}"
    if static.headdim % 8 or static.headdim > SM90_MAX_HEADDIM:
        return f"the sm90 kernel takes headdim a multiple of 8 up to {SM90_MAX_HEADDIM}, not {static.headdim}"
    if not static.aligned:
        return "the sm90 kernel's TMA needs every row of q, k, v on a 16-byte boundary"
    if not static.positive_scale:
        return "the sm90 kernel folds a positive softmax scale into exp2"
    return None


# The fp8 (e4m3) Hopper forward (FlashAttention-3's fp8 path, nbflash.interface's fp8 entry): (largest
# headdim, block_n, stages); block_m 128. block_n is a multiple of 128 (V^T's swizzled rows). Start
# points, compiled and assembled (no spills at headdim 128) but NOT yet run on a GPU; only this
# entry reaches them, never a default.
SM90_FP8_FORWARD = [
    (128, 128, 2),
    (256, 128, 2),
]


def sm90_fp8_unsupported_reason(headdim, device=0):
    """Why the fp8 forward cannot run (it exists for compute capability 9.0 only), or None."""
    cc = _compute_capability(device)
    if cc != SM90_COMPUTE_CAPABILITY:
        return (f"the fp8 (float8_e4m3fn) forward runs on compute capability 9.0 only (wgmma), this GPU "
                f"has {cc[0]}.{cc[1]}; pass float16 or bfloat16 inputs")
    if headdim % 16 or headdim > SM90_MAX_HEADDIM:
        return f"the fp8 forward takes headdim a multiple of 16 up to {SM90_MAX_HEADDIM}, not {headdim}"
    return None


@lru_cache(maxsize=None)
def sm90_fp8_forward_config(headdim, variant):
    _, block_n, stages = _row(SM90_FP8_FORWARD, headdim)
    return Sm90ForwardConfig(dtype=FP8, headdim=headdim, variant=variant, block_n=block_n, stages=stages)


@lru_cache(maxsize=None)
def sm90_forward_config(dtype, headdim, variant):
    _, block_n, stages = _row(SM90_FORWARD, headdim)
    if variant.dropout:  # one Philox call covers 32 keys: headdim 256's 80-key tiles become 64
        block_n -= block_n % 32
    return Sm90ForwardConfig(dtype=dtype, headdim=headdim, variant=variant, block_n=block_n, stages=stages)


def _sm90_default(static):
    """The sm90 family is the default for this call: it serves it and was measured faster there."""
    if runtime.SIMULATOR or static.headdim not in SM90_DEFAULT_HEADDIMS:
        return False  # the simulator keeps the default of the suite's cases: mma
    if not _measured_on_sm90(static.variant, static.headdim, SM90_DEFAULT_VARIANTS):
        return False  # served, not yet measured: mma
    return sm90_unsupported_reason(static) is None


@lru_cache(maxsize=None)
def portable_forward_config(dtype, headdim, variant):
    for max_headdim, threads_x, threads_y, rows_per_thread in PORTABLE_FORWARD:
        if headdim <= max_headdim:
            break
    block_m = threads_y * rows_per_thread
    block_n = 64
    while block_n > threads_x and shared_bytes(headdim, block_m, block_n, threads_x) > PORTABLE_SHARED_LIMIT:
        block_n //= 2
    return PortableForwardConfig(dtype, headdim, variant, threads_x, threads_y, rows_per_thread, block_n)


@lru_cache(maxsize=None)
def mma_forward_config(dtype, headdim, variant, aligned, positive_scale=True):
    for max_headdim, block_m, block_n, num_warps in MMA_FORWARD:
        if headdim <= max_headdim:
            break
    return MmaForwardConfig(
        dtype=dtype,
        headdim=headdim,
        variant=variant,
        block_m=block_m,
        block_n=dropout_keys(block_n, variant),
        num_warps=num_warps,
        aligned=aligned and headdim % 8 == 0,
        fold_scale=positive_scale,
        heavy_groups=MMA_FORWARD_HEAVY_GROUPS if variant.window else 0,
        rescale_slack=_row(MMA_FORWARD_RESCALE_SLACK, headdim)[1],
    )


def dropout_keys(block_n, variant):
    """A key tile of ``block_n`` keys, widened with dropout to whole 32-key blocks: the tensor-core
    kernels make one Philox call per 32 keys of a lane's rows (nbflash/kernels/philox.py)."""
    return -(-block_n // 32) * 32 if variant.dropout else block_n


def forced_family():
    """The family forced by an enclosing ``kernel_family`` block, or None."""
    return _forced_family.get()


def _resolve_family(dtype, device, family):
    """The family a call runs on: ``family`` if given (an error if it cannot serve the call), else
    the tensor-core family wherever it applies and the portable one otherwise."""
    if family is None:
        return "portable" if mma_unsupported_reason(dtype, device) else "sm80"
    _check_family(family)
    family = canonical_family(family)
    if family == "sm80":
        reason = mma_unsupported_reason(dtype, device)
        if reason:
            raise ValueError(f"kernel family 'sm80' (mma.sync) cannot run this call: {reason}")
    return family


def plan_forward(static, family=None):
    """The config to run a forward call with, for a problem's static part (``Problem.static``).

    ``family`` forces a kernel family; by default the tensor-core family runs whenever it applies,
    the portable one otherwise.
    """
    family = canonical_family(family)
    if family == "sm90" or (family is None and _sm90_default(static)):
        reason = sm90_unsupported_reason(static)
        if reason:
            raise ValueError(f"kernel family 'sm90' cannot run this call: {reason}")
        return sm90_forward_config(static.dtype, static.headdim, static.variant._replace(score_mod_grad=""))
    family = _resolve_family(static.dtype, static.device, family)
    variant = static.variant._replace(score_mod_grad="")  # only the backward differentiates
    if family == "sm80":
        return mma_forward_config(static.dtype, static.headdim, variant, static.aligned, static.positive_scale)
    return portable_forward_config(static.dtype, static.headdim, variant)


# ---------------------------------------------------------------------------------------------------
# Backward (nbflash/kernels/backward_portable.py, nbflash/kernels/backward_mma.py)
# ---------------------------------------------------------------------------------------------------

# Portable dK/dV kernel: (largest headdim, threads per key row, key rows per block). The query tile
# height is then the largest power of two from 64 down that fits the shared-memory limit. Each
# thread holds two slices (dK and dV) of its key row, of headdim / threads_per_row floats each.
PORTABLE_BACKWARD_DKDV = [
    (32, 4, 64),
    (64, 4, 64),
    (128, 8, 32),
    (256, 8, 8),
]

# Portable dQ kernel (deterministic mode): (largest headdim, threads per query row, query rows per
# block); the key tile height is fitted the same way.
PORTABLE_BACKWARD_DQ = [
    (32, 4, 64),
    (64, 4, 32),
    (128, 8, 16),
    (256, 8, 8),
]

# Preprocess and dq conversion: query rows per block and threads per row (memory-bound, tiny).
PORTABLE_BACKWARD_ROWS = (32, 8)
# ... and their 16-byte forms (backward_portable.py's ``vector``: headdim / 8 lanes a row, 256
# threads a block), for 16-bit rows on 16-byte boundaries. Measured on the H200 (docs/perf-notes.md,
# "Hopper backward", step 19): the preprocess 90-108 -> 80-88 us and the conversion 70-86 -> 58-65
# us at hd 64 and 128, 4k and 16k, 34-52 us a call saved.
ROWWISE_VECTOR = True
ROWWISE_VECTOR_THREADS = 256


def _fit(kernel, headdim, threads_per_row, fixed, fixed_is_m):
    """The largest power-of-two tile height from 64 down (at least threads_per_row) that keeps the
    kernel within PORTABLE_SHARED_LIMIT, the other tile height being ``fixed``."""
    size = 64
    while size > threads_per_row:
        block_m, block_n = (fixed, size) if fixed_is_m else (size, fixed)
        if backward_shared_bytes(kernel, headdim, block_m, block_n, threads_per_row) <= PORTABLE_SHARED_LIMIT:
            break
        size //= 2
    return size


def _row(table, headdim):
    for entry in table:
        if headdim <= entry[0]:
            return entry
    raise ValueError(f"{headdim=} exceeds {table[-1][0]}")


# Tensor-core backward (nbflash/kernels/backward_mma.py): (largest headdim, block_m, block_n,
# num_warps) of the dK/dV kernel (block_n = 16 * num_warps: a warp owns 16 keys), and of the
# deterministic dQ kernel (block_m = 16 * num_warps: a warp owns 16 query rows). Their GPU test grid
# passed on the H200 (168 cases, docs/benchmarks.md). At headdim 128, 64 x 128 with 8 warps measured
# within 1-3% of 64 x 64 (bench.py --dkdv-blocks); no wider search yet.
MMA_BACKWARD_DKDV = [
    (128, 64, 64, 4),
    (256, 32, 64, 4),
]
MMA_BACKWARD_DQ = [
    (128, 64, 64, 4),
    (256, 64, 32, 4),
]


# Hopper backward (nbflash/kernels/backward_sm90.py): (largest headdim, stages of the Q/dO ring, dQ's
# split between the consumers); block_m 64, block_n 128 (two consumer warpgroups of 64 keys).
# Measured on the H200 (scripts/sm90_schedules.py --backward, docs/perf-notes.md "Hopper backward"):
# halving dQ's atomics is the large step: "columns" 1.23-1.32x "keys" at headdim 128, "steps"
# 1.06-1.11x at headdim 64 (where "columns" cannot split one 64-column chunk); a third stage is
# within noise with either.
SM90_BACKWARD = [
    (64, 2, "steps"),
    (128, 2, "columns"),
]
# The headdims at which the sm90 backward is the default on compute capability 9.0: where it was
# measured faster than the mma family (docs/perf-notes.md, "Hopper backward": fp16 at headdims 64
# and 128, seqlen 4k and 16k, causal and not, 1.4-1.8x the mma family; with dQ's atomics halved,
# 0.98-1.20x SDPA flash).
# Between them, padded to 128 columns: measured at headdims 80, 96 and 112 (scripts/bench.py --pass
# backward --families sm90 mma, fp16, 4k and 16k, causal and not; docs/benchmarks.md "GPU runs of
# 2026-12-04, fifth session"): 1.42-1.97x the mma backward, 1.02-1.34x SDPA flash's. 72, 88, 104
# and 120 take the same padded kernel, whose time hardly depends on the true headdim (hd 80 ran at
# 259-274 TFLOP/s, hd 112 at 323-337): not timed, expected between their neighbours.
# Below 64 and past 128 (2026-12-06, eighteenth session, an H100: scripts/gpu_check.sh headdims and
# the same bench.py --pass backward --families sm90 mma at hd 16, 24, 136 and 160; fp16, 4k and 16k,
# causal and not, one run each), the sm90 backward against the mma one: hd 16 1.30-1.48x (1.07-1.18x
# SDPA flash's), hd 24 1.51-1.69x (1.06-1.17x), hd 32 1.52-1.70x (0.94-1.02x), hd 48 1.67-1.97x
# (1.36-1.47x); hd 136 1.20-1.28x (1.04-1.09x), hd 160 1.39-1.49x (0.97-1.00x), hd 192 1.52-1.61x
# (0.82-0.88x), hd 256 2.07-2.47x (0.97-1.00x). Below 64 the rows split runs padded to 64 columns,
# past 128 the wide kernel padded to 256, so the headdims between those timed run the same kernels
# (expected between their neighbours'). Headdim 8 (eight times padded) is not timed: mma.
SM90_BACKWARD_DEFAULT_HEADDIMS = tuple(range(16, 264, 8))
# deterministic=True takes the sm90 dK/dV kernel without dQ and the sm90 dQ kernel by default at these
# headdims (plain attention and the window: SM90_BACKWARD_DEFAULT_VARIANTS; the others it serves
# when "sm90" is forced): measured on an H100 (2026-12-06, bench.py --pass backward
# --families sm90 mma --deterministic, fp16, hd 64 and 128, 4k and 16k, causal and not, one run),
# 1.91-2.47x the mma family's deterministic backward (hd 64 278.9-330.4 TFLOP/s against 130.5-165.5;
# hd 128 389.8-442.6 against 166.0-184.2), and 0.89-1.09x the atomic sm90 backward. 72-120 run the
# kernels padded to 128 columns, as the atomic backward does. Below 64 and past 128 (2026-12-06,
# nineteenth session, an H100: scripts/gpu_check.sh deterministic at hd 16, 24, 32, 48, 136, 160,
# 192 and 256, the same shapes, one run each), against the mma family's deterministic backward:
# hd 16 0.99-1.01x non-causal and 1.22-1.28x causal, hd 24 1.43-1.54x, hd 32 1.26-1.61x, hd 48
# 1.67-1.80x, hd 136 1.43-1.60x, hd 160 1.69-1.86x, hd 192 2.00-2.24x, hd 256 2.47-2.79x. Both
# kernels pad headdim to a multiple of 64 (the wide one past 128 to 256), so the headdims between
# those timed run kernels of the same shape as their neighbours'. Headdim 8: mma.
SM90_DETERMINISTIC_DEFAULT_HEADDIMS = tuple(range(16, 264, 8))
# ... and past headdim 128 the same pair is the default without deterministic=True too, for the same
# variants: in the runs above it beat the wide kernel with dQ's atomics at every shape, hd 136
# 1.10-1.23x, hd 160 1.22-1.34x, hd 192 1.26-1.39x, hd 256 1.22-1.39x (the wide kernel's dQ atomics
# cost more than a second pass over K and V). Its results are then bit-identical run to run as well.
SM90_PAIR_DEFAULT_HEADDIMS = tuple(range(136, 264, 8))
# ... for these variants, and with the features below; the others it serves run on it when "sm90" is
# forced
SM90_BACKWARD_DEFAULT_VARIANTS = (Variant(), Variant(window=True))
# ... and with one of these features, alone or with the window, at the headdims listed, where the
# sm90 backward was measured faster than the mma one: dropout and a score_mod at 64 and 128 (the
# forward's ``SM90_MEASURED_EXTRAS`` runs, 2026-12-03: 1.48x / 1.54x and 1.77x / 1.96x), causal
# softcap and ALiBi at 128 (2026-12-03, second session: 306 / 311 TFLOP/s against 167 / 170); then
# every one of them on an H100 (2026-12-06, twentieth session: scripts/gpu_check.sh pair-variants,
# bench.py --pass backward --families sm90 mma --deterministic, fp16, causal, seqlen 8k, one run;
# docs/benchmarks.md, "The backward's features on the Hopper kernels"), the sm90 backward against
# the mma one, with dQ's atomics / with deterministic=True (the pair against the mma family's
# deterministic backward): softcap hd 64 1.70x / 1.82x, 128 2.30x / 2.09x, 256 2.29x / 2.52x; ALiBi
# 1.50x / 2.09x, 2.43x / 2.49x, 2.30x / 2.45x; a bias tensor 1.08x / 1.10x, 1.19x / 1.16x, 1.25x /
# 1.09x; dropout 1.55x / 1.72x, 1.91x / 1.81x, 1.98x / 2.34x; a score_mod (64 and 128) 1.82x /
# 2.15x, 2.42x / 2.43x. A bool mask tensor at hd 64 (2026-12-07, thirty-second session, an H100:
# scripts/keys128_variants.py, a document mask, fp16, 4k / 16k, interleaved) on the sm90 backward
# as planned (step 40) against the mma one: 66.2 / 66.7 TFLOP/s against 58.5 / 52.9 (1.13x /
# 1.26x; the table's sm90 kernel 62.5 / 62.6); causal ALiBi with it 70.6 / 64.0 against 66.4 / 52.2
# (two features: ``SM90_BACKWARD_FEATURE_PAIRS``). Not measured: other headdims, the features
# together, the mask tensor elsewhere, a score_mod at 256; non-causal forms run the same kernels
# with fewer masked tiles.
SM90_BACKWARD_FEATURE_HEADDIMS = {"softcap": (64, 128, 256), "alibi": (64, 128, 256), "bias": (64, 128, 256),
                                  "dropout": (64, 128, 256), "score_mod": (64, 128), "mask": (64,)}
# ... of which these were measured with dQ's atomics only: with deterministic=True the mma family
# stays their default (the bool mask's deterministic backward was cut off by its run's time limit
# before it was timed, thirty-second session)
SM90_BACKWARD_ATOMIC_ONLY_FEATURES = ("mask",)
# ... and two of them together, alone or with the window, at these headdims (without
# deterministic=True only): causal ALiBi with a bool mask tensor at hd 64 (the run above: step 40
# 70.6 / 64.0 TFLOP/s against the mma backward's 66.4 / 52.2 at 4k / 16k, 1.06x / 1.23x)
SM90_BACKWARD_FEATURE_PAIRS = {("alibi", "mask"): (64,)}
# ... and mask_mod with its block mask (no other feature) at these: 128 measured on 2026-12-03 (see
# ``SM90_BLOCK_MASK_HEADDIMS``), 64 and 128 in the run above (three documents, causal-free): 1.90x /
# 1.63x and 2.13x / 1.99x
SM90_BACKWARD_BLOCK_MASK_HEADDIMS = (64, 128)
# ... and past headdim 128, with these features the pair is the default without deterministic=True
# too (as for plain and windowed attention): at hd 256 in the run above softcap 1.24x, ALiBi 1.26x,
# dropout 1.39x the wide kernel with dQ's atomics; with a bias tensor 0.90x, which keeps the atomics
SM90_PAIR_FEATURES = ("softcap", "alibi", "dropout")
# ... and packed sequences (flash_attn_varlen_backward) at these headdims, plain and causal. Headdim
# 128 measured on an H100 (scripts/gpu_check.sh tiles2: scripts/bench.py --pass varlen
# --varlen-backward --headdims 128, 14 sequences of up to 2048 tokens, 16384 in all, fp16, two runs),
# the sm90 backward at 270 / 301 TFLOP/s non-causal (atomics / tile-major) and 201 / 213 causal
# against the mma backward's 139 and 113: 1.9-2.2x tile-major, 1.8-1.9x with the atomics (which
# shorter packed sequences keep, ``packed_dq_tiles_fit``); on the H200 (gpu_check.sh packed) 1.1-1.6x
# at mean lengths 83-303, but 0.93x / 0.92x (non-causal / causal) at mean length 41, batches of
# sequences a tile or less long, left on it. Headdim 64 (backward_sm90.py's "steps" kernel; the rows
# split takes no packed sequences) on the H200, one run: 1.26x / 1.21x the mma backward at mean
# length 160, 1.65x / 1.54x at 1170. Not measured: other headdims, the window or other variants on
# packed sequences.
SM90_BACKWARD_VARLEN_HEADDIMS = (64, 128)


# The sm90 dQ kernel (deterministic=True): (largest headdim, keys per K/V tile), two consumers of 64
# query rows. Past headdim 128 its tiles shrink so that S, dP, dS and dQ keep fitting a consumer's
# registers (backward_dq_sm90.MAX_ACCUMULATOR_WORDS) and its tiles shared memory: ptxas 13.5 (sm_90a)
# assembles both without spills. Only when "sm90" is forced there (not yet timed; the mma family's
# deterministic backward by default).
SM90_DQ = [
    (128, 128),
    (192, 64),
    (256, 32),
]
# ... at most this many keys a tile with dropout or an element mask: at hd 128 with 128-key tiles
# ptxas (13.5) spilled 280 bytes (dropout, 133 local accesses in the loop) and 112 (mask tensor); with
# 64-key tiles none (softcap and ALiBi do not spill at 128)
SM90_DQ_MASKED_KEYS = 64


# The wide kernel's P^T and dS^T made by both consumers, each for half the step's queries
# (``Sm90WideBackwardConfig.split_tiles``), instead of consumer 0 alone while consumer 1 waits:
# measured on an H100 (2026-12-06, twentieth session: scripts/sm90_schedules.py --parts --headdims
# 256 with and without --split-tiles, fp16, 4k and 16k, causal and not, one run; docs/perf-notes.md,
# "Hopper backward", step 50), the wide dK/dV kernel without dQ 1.12-1.17x faster, the default
# backward at hd 256 (the pair) 1.06-1.10x. Bit-identical gradients either way.
SM90_WIDE_SPLIT_TILES = True


# The deterministic backward's dK/dV pass at 128 query rows a step (step 40's kernel without dQ:
# ``block_m=128, dq_split="none"``) where step 40 is planned (headdims 33-64, plain and windowed
# attention). ptxas 13.5, fp16, hd 64, plain: 748 instructions a step, no local access in the loop.
# Measured on an H100 (thirtieth session: scripts/gpu_check.sh keys128-next, sm90_schedules.py
# --parts --deterministic --headdims 64 without and with --deterministic-keys128, one run each;
# docs/perf-notes.md, "Hopper backward", step 40), fp16, hd 64, 4k and 16k, time saved: the dK/dV
# pass 4.4-5.2% plain and 5.0-8.2% causal; the whole deterministic call alone 1.5-3.9% plain and
# 6.0-8.8% causal, behind a forward 2.8-4.3% plain, -2.3% (4k, slower) and 4.8% (16k) causal (its GPU
# grid, bit-identical reruns included, passed there). Two processes one after the other, not
# interleaved.
SM90_DETERMINISTIC_KEYS128 = True
# ... and for the masks and ALiBi as step 40 takes them (``keys128_serves``: ALiBi, the bool mask,
# mask_mod, a block mask, with or without a window; not on packed sequences), where the table's
# kernel without dQ (block_m 64) runs them otherwise. ptxas 13.5, fp16, hd 64 (check_sm90_ptx.py
# --backward --loop-spills): causal ALiBi 2336 instructions a step, 4 local accesses; a block mask
# 839, 0; a causal bool mask 3804, 0 (the plain causal pass planned: 1737, 3). An option, off until
# timed (scripts/keys128_variants.py --deterministic; tests/test_backward_sm90.py's
# keys128_deterministic_variants cases).
SM90_DETERMINISTIC_KEYS128_VARIANTS = False


def sm90_deterministic_configs(dtype, headdim, variant):
    """The deterministic sm90 backward's kernels (dK/dV, dQ): the dK/dV kernel without dQ
    (backward_sm90.py's from the table, at 128 query rows a step with ``SM90_DETERMINISTIC_KEYS128``,
    for the masks and ALiBi too with ``SM90_DETERMINISTIC_KEYS128_VARIANTS``, the wide one past
    headdim 128), then the dQ kernel with ``SM90_DQ``'s key tiles."""
    if headdim > SM90_BACKWARD_MAX_HEADDIM:
        dkdv = Sm90WideBackwardConfig(dtype, headdim, variant, heavy_groups=SM90_BACKWARD_HEAVY_GROUPS, dq_split="none",
                                      split_tiles=SM90_WIDE_SPLIT_TILES)
    else:
        dkdv = dataclasses.replace(sm90_backward_table_config(dtype, headdim, variant), dq_split="none",
                                   dq_first=False)
        variants = SM90_DETERMINISTIC_KEYS128_VARIANTS and not variant.varlen and keys128_serves(variant)
        if SM90_DETERMINISTIC_KEYS128 and keys128_planned(headdim) and (sm90_rows_serves(variant) or variants):
            dkdv = dataclasses.replace(dkdv, block_m=128)
    _, block_n = _row(SM90_DQ, headdim)
    if variant.dropout or variant.mask or variant.mask_mod:
        block_n = min(block_n, SM90_DQ_MASKED_KEYS)
    return dkdv, Sm90DqConfig(dtype, headdim, variant, block_n=block_n)  # score_mod_grad too


def sm90_backward_unsupported_reason(static, deterministic, aligned):
    """Why the sm90 backward (its dK/dV kernel) cannot run this call, or None when it can."""
    reason = mma_unsupported_reason(static.dtype, static.device)
    if reason:
        return reason
    cc = _compute_capability(static.device)
    if cc != SM90_COMPUTE_CAPABILITY:
        return f"the sm90 backward runs on compute capability 9.0 only, this GPU has {cc[0]}.{cc[1]}"
    if deterministic:
        return "the sm90 backward adds dq with atomics; deterministic=True runs the sm80 family's fixed order"
    if static.headdim % 8 or static.headdim > SM90_WIDE_BACKWARD_MAX_HEADDIM:
        return (f"the sm90 backward takes headdim a multiple of 8 up to {SM90_WIDE_BACKWARD_MAX_HEADDIM}, "
                f"not {static.headdim}")
    if not aligned:
        return "the sm90 backward's TMA needs every row of q, k, v and dout on a 16-byte boundary"
    return None


# The sm90 backward's launch order: longest-first within groups of 4 (batch, KV head) pairs
# (``heavy_groups``). Measured on the H200 against the order before (scripts/sm90_schedules.py
# --backward --anchors, docs/perf-notes.md step 13): fp16, hd 64 and 128, 4k and 16k, causal and not,
# +1.9% to +7.2% at every shape but hd 128 16k non-causal (-1.4%, within noise); groups of 8 were no
# better.
SM90_BACKWARD_HEAVY_GROUPS = 4


# The query rows split between the consumers (nbflash/kernels/backward_sm90_rows.py) at headdims up
# to this, for the variants it serves (plain attention and the window): measured on the H200
# (scripts/sm90_schedules.py --backward --headdims 64 --anchors, docs/benchmarks.md "GPU runs of
# 2026-12-04, second session"), fp16, headdim 64, 4k and 16k, causal and not: 1.11-1.17x
# backward_sm90.py's planned "steps" kernel, 1.15-1.24x SDPA flash's backward. Two stages (a third
# was 0.92-1.01x). The simulator keeps backward_sm90.py (the rows kernel's emulation takes about
# 50 s a case: tests/test_backward_sm90.py runs it through a fixture).
SM90_BACKWARD_ROWS_MAX_HEADDIM = 64


# There (headdims up to 64, plain and windowed attention), backward_sm90.py with 128 query rows a
# step, each consumer's S^T and dP^T its 64 keys by all 128 queries, and dQ split by query rows,
# first and tile-major (``block_m=128, dq_split="rows"``, FlashAttention-3's hd 64 shape) instead of
# the rows split: measured on an H100 (scripts/gpu_check.sh keys128 2: sm90_schedules.py --backward
# --headdims 64 --only planned keys128 rows-tiles --anchors, docs/perf-notes.md "Hopper backward"
# step 40), fp16, hd 64, 4k and 16k, twice: +9.6% / +2.5-3.0% non-causal, +5.0-5.5% / +8.0-9.2%
# causal over the rows split as planned before; 1.22-1.44x SDPA flash's backward, 0.78-0.93x
# cuDNN's. Not timed with a sliding window (causal is one). The simulator keeps the table's kernel,
# as above.
SM90_BACKWARD_KEYS128 = True
# ... from this headdim on: at hd 32 (bench.py --pass backward, one run on an H100, against the rows
# split's of 2026-12-06 on an H100, SDPA flash within 1% of its figures then, docs/benchmarks.md)
# it ran +1.4% / -10.2% plain (4k / 16k), -1.0% / 0.0% causal: the rows split keeps headdims up to
# 32. Timed interleaved with the rows split in one process (thirtieth session, H100, gpu_check.sh
# interleaved, docs/perf-notes.md "Timing order"): hd 32 -7% to -14% (the rows split keeps it), hd 48
# -4% to +2% (even: step 40 keeps it), hd 64 +4% to +10%. Headdims 40 and 56 are not timed.
SM90_BACKWARD_KEYS128_MIN_HEADDIM = 33

# Step 40 (above) for packed sequences too (plain and windowed, headdims 33-64), where the tile-major
# dQ's padding of 128 rows a sequence fits (``packed_dq_tiles_fit`` with 128-row tiles); else the
# table's kernel as before. An option, off until timed: its simulator and GPU tests are
# tests/test_varlen.py's keys128 cases; ptxas and the prediction in docs/perf-notes.md ("Step 40
# for packed sequences"). Measured on an H100 (2026-12-07, thirty-second session, gpu_check.sh
# packed128: bench.py --pass varlen --varlen-backward --headdims 64, fp16, 16k tokens, off and on
# alternating, two runs each), the sm90 backward's TFLOP/s off -> on: lengths drawn up to 2048
# 246-253 -> 273 plain, 178-184 -> 182 causal (even); up to 4096 283-285 -> 328-329 plain, 230-234 ->
# 245 causal; four of 4096 301-302 -> 363-370 plain, 275-281 -> 323-324 causal. Its GPU grid passed
# (16 tests). Planned.
SM90_BACKWARD_VARLEN_KEYS128 = True

# Step 40 (above) for the masks and ALiBi too, at the same headdims (not on packed sequences): the
# element mask (a bool tensor or mask_mod), a block mask, ALiBi, each with or without a window,
# which run the table's "steps" kernel (block_m 64) otherwise. Softcap, a float bias, score_mod and
# dropout stay there (``keys128_serves``: their loops spill at 128 query rows). Its tests are
# tests/test_backward_sm90.py's keys128_variants cases (the GPU grid: 31 passed); ptxas and the
# prediction in docs/perf-notes.md ("Step 40 for the masks and ALiBi"). Measured on an H100
# (2026-12-07, thirty-second session, scripts/keys128_variants.py: hd 64, fp16, 16k tokens, both
# plans under the sm90 family, interleaved, 15 rounds), step 40 against the table's kernel, 4k / 16k:
# causal ALiBi 1.102x / 1.129x, ALiBi 1.238x / 1.090x, a bool document mask 1.060x / 1.066x, a
# mask_mod with its block mask 1.016x / 1.098x, causal ALiBi with the bool mask 1.057x / 1.068x.
# Planned.
SM90_BACKWARD_KEYS128_VARIANTS = True

# Whether the rows split without a window issues dQ_c's product under dS's stores
# (``issue_early="dq"``, docs/perf-notes.md "Hopper backward" step 42). Measured on an H100
# (2026-12-06, scripts/sm90_schedules.py --backward --headdims 64 --anchors, each form alone in its
# process, two runs each, fp16) against the planned kernel, which issues all three products after the
# second barrier: 4k +0.2%, 16k +2.4-3.0% (354.0-355.9 TFLOP/s against 345.6-345.7; 359.4 in a third
# run). Causal 0.1-1.1% slower at 4k (three runs) and +0.5% at 16k, inside the runs' spread, so the
# window would keep "none". Its GPU grid passes (tests/test_backward_sm90.py rows_gpu, "early-dq"),
# and so do the GPU suite's backward tests on the plan with it (H200, 2026-12-06: test_backward.py,
# test_backward_sm90.py, the torch bridge's and the fuzzer's gradients, docs/runs/). On the H200,
# issue 13's table with it: hd 64 16k 1.21x SDPA flash's backward, where it read 1.19x without it.
SM90_BACKWARD_ROWS_DQ_EARLY = True
# Whether the rows split without a window stores dK and dV 16 bytes a lane after a transpose across
# each quad (``store_quads``, docs/perf-notes.md "Hopper backward" step 55), instead of a 32-bit pair
# a store. Measured on an H100 (2026-12-06, twenty-second session: scripts/gpu_check.sh options, then
# scripts/sm90_schedules.py --backward --headdims 64 128 three times more, fp16, hd 64), the planned
# kernel with it against without, means of four runs: 4k +3.5% (351.9 TFLOP/s against 340.1), 16k
# +6.6% (368.2 against 345.4, leaving out one slow run of the kernel without, 320.2); causal 4k
# +0.1%, 16k -0.6%, inside the runs' spread, so the window keeps the pairs. Its GPU grid passes
# (tests/test_backward_sm90.py rows_gpu, "quads", without dQ's product early), and the timed runs'
# results with dQ's product early agree with the reference as closely as the pairs' (6.1e-05);
# the grid of that combination ("early-dq-quads") has not run on a GPU yet.
SM90_BACKWARD_ROWS_STORE_QUADS = True


# dQ_i staged in shared memory and added by the producer's stats warp, one bulk reduce-add a step
# into a tile-major dq_accum (``dq_reduce="tiles"``, FlashAttention-3's form), where the kernel issues
# dQ_i's product first (dq_first: headdims 72-128): measured on an H100
# (scripts/sm90_schedules.py --backward --headdims 64 128 --only planned-tiles rows-tiles --anchors,
# docs/perf-notes.md "Hopper backward" steps 32-34), fp16, hd 128, 4k and 16k, two runs: +9-10% /
# +7-8% non-causal, +6% / +10% causal over the atomic reductions ("red"); a third run +5% to +13%.
# At hd 64 plain and causal attention keep the rows split's atomics: its tiles (step 34) measured
# -4% to +5%, then 2-7% slower, and backward_sm90.py by 32-column halves with it (step 36) 0.79-0.89x
# the rows split; dropout at hd 64 takes it by halves (``SM90_BACKWARD_DROPOUT_COLUMNS``).
# The other variants at hd 72-128 (dropout, softcap, ALiBi, masks, score_mod) take it too: their
# GPU grids pass with it; dropout 0.1 timed (gpu_check.sh tiles2), H100: +10% / +0% non-causal,
# +4% / +10% causal (4k / 16k); H200: +9.6% / +12.4%, +7.2% / +11.5%.
SM90_BACKWARD_DQ_TILES = True
# The same for packed sequences (each sequence's tiles from a whole tile of dq_accum: dq_accum_shape,
# step 37): measured on an H100 (scripts/gpu_check.sh tiles2: scripts/bench.py --varlen, 14
# sequences of up to 2048 tokens, 16384 in all, fp16, hd 128), the sm90 backward +11.5% non-causal
# and +5.8% causal over the atomics.
SM90_BACKWARD_VARLEN_DQ_TILES = True
# ... where the padding (up to a tile of block_m rows a sequence, dq_accum_shape) adds at most this
# share to the packed query rows, i.e. mean length >= 512 (a 64-row tile a sequence at most). Measured
# on the H200 (scripts/gpu_check.sh packed and tiles2: bench.py --varlen-backward, hd 128, fp16, 16384
# tokens of uniformly drawn lengths, one run), tile-major over atomics, non-causal / causal: mean
# length 41 -14% / -14%, 83 -10% / -11%, 160 -5% / -8%, 303 +0.4% / -3.6%, 1170 +13.5% / +7.0%. Short
# sequences' kernels run a step or two, and the tile-major dq_accum (several times the row-major one
# below mean 64) is zeroed every call. Between 303 and 1170 nothing is timed: the line is drawn halfway.
SM90_VARLEN_DQ_TILES_MAX_PADDING = 0.125


def packed_dq_tiles_fit(batch, total_q, tile_rows=Sm90BackwardConfig.block_m):
    """Whether ``batch`` packed sequences of ``total_q`` query rows in all take the tile-major dQ in
    tiles of ``tile_rows`` (``SM90_VARLEN_DQ_TILES_MAX_PADDING``); else their backward keeps the atomics."""
    return batch * tile_rows <= SM90_VARLEN_DQ_TILES_MAX_PADDING * total_q


def packed_dq_tile_rows(batch, total_q):
    """The largest query tile (128 or 64 rows) whose tile-major dQ padding ``batch`` packed sequences
    of ``total_q`` rows take (``packed_dq_tiles_fit``), or 0 for none: ``plan_backward``'s ``dq_tiles``."""
    return next((rows for rows in (128, 64) if packed_dq_tiles_fit(batch, total_q, rows)), 0)


def sm90_backward_config(dtype, headdim, variant):
    """The sm90 backward's dK/dV kernel: at headdims up to ``SM90_BACKWARD_ROWS_MAX_HEADDIM``, for
    plain and windowed attention, backward_sm90.py with 128 query rows a step and dQ split by query
    rows (``SM90_BACKWARD_KEYS128``, from ``SM90_BACKWARD_KEYS128_MIN_HEADDIM`` on; packed sequences
    too with ``SM90_BACKWARD_VARLEN_KEYS128``, the masks and ALiBi with ``SM90_BACKWARD_KEYS128_VARIANTS``),
    or else the rows split (``sm90_rows_backward_config``);
    the wide one past headdim 128; backward_sm90.py's from
    the table otherwise, its dQ tile-major where it issues dQ_i's product first
    (``SM90_BACKWARD_DQ_TILES``)."""
    if headdim > SM90_BACKWARD_MAX_HEADDIM:
        return Sm90WideBackwardConfig(dtype, headdim, variant, heavy_groups=SM90_BACKWARD_HEAVY_GROUPS,
                                      split_tiles=SM90_WIDE_SPLIT_TILES)
    if runtime.SIMULATOR:  # the simulator keeps the table's kernel (SM90_BACKWARD_ROWS_MAX_HEADDIM)
        return planned_backward_sm90_config(dtype, headdim, variant)
    packed = SM90_BACKWARD_VARLEN_KEYS128 and variant.varlen and sm90_rows_serves(variant._replace(varlen=False))
    masks = SM90_BACKWARD_KEYS128_VARIANTS and not variant.varlen and keys128_serves(variant)
    if keys128_planned(headdim) and (sm90_rows_serves(variant) or packed or masks):
        return keys128_backward_config(dtype, headdim, variant)
    if headdim <= SM90_BACKWARD_ROWS_MAX_HEADDIM and sm90_rows_serves(variant):
        return sm90_rows_backward_config(dtype, headdim, variant)
    return planned_backward_sm90_config(dtype, headdim, variant)


def keys128_planned(headdim):
    """Step 40's kernel is planned at this headdim (for the variants the rows split serves)."""
    return SM90_BACKWARD_KEYS128 and SM90_BACKWARD_KEYS128_MIN_HEADDIM <= headdim <= SM90_BACKWARD_ROWS_MAX_HEADDIM


def keys128_backward_config(dtype, headdim, variant):
    """Step 40's kernel: backward_sm90.py with 128 query rows a step, dQ split by query rows, first
    and tile-major (its staged dQ_i added by warp 2: ``staged_dq_by_warp_2``)."""
    return staged_dq_by_warp_2(dataclasses.replace(sm90_backward_table_config(dtype, headdim, variant), block_m=128,
                                                   dq_split="rows", dq_first=True, dq_reduce="tiles"))


# The staged dQ_i added into dq_accum by the producer's warp 2 (``dq_warp``), the stats warp staging
# lse and D only, and those loaded a step ahead (``stats_ahead``), wherever dQ_i is staged tile-major,
# except with the producer's keep bits (warps 2 and 3 busy), for packed sequences only with
# ``SM90_BACKWARD_VARLEN_DQ_WARP``. Measured on an H100 (thirty-fourth session, scripts/sm90_schedules.py
# --backward, fp16, plain and causal, 4k and 16k, two interleaved runs, one with SDPA's backwards;
# docs/perf-notes.md "dq_warp, stats_ahead, rotate and the third ring stage measured"): at hd 64 (step
# 40) +17% to +45% over the stats warp adding it, at hd 128 +7% to +25%; stats_ahead's part -1% to +2%
# plain, 0 to +4% causal.
SM90_BACKWARD_DQ_WARP = True
# ... for packed sequences too: built and through its GPU grid (test_varlen_sm90_dq_warp_gpu, 12 of 12
# on an H100), not timed; an option until it is (gpu_check.sh packed-dq-warp)
SM90_BACKWARD_VARLEN_DQ_WARP = False


# The dQ conversion folded into the dK/dV kernel (``fold_dq``: the block whose bulk reduce-add completes a
# query tile's dQ converts it from L2 after its loop, instead of a conversion kernel reading dq_accum
# back; docs/perf-notes.md "The dQ conversion folded into the dK/dV kernel"), with dq_warp, dense
# sequences without a block mask. Simulator cases (test_backward_sm90_fold_dq_small,
# test_backward_sm90_keys128_fold_dq_small); an option, off, until
# its GPU grid has run and it is timed (scripts/gpu_check.sh fold-dq)
SM90_BACKWARD_FOLD_DQ = False


def staged_dq_by_warp_2(config):
    """``config`` with ``dq_warp`` and ``stats_ahead`` where ``SM90_BACKWARD_DQ_WARP`` plans them (for
    packed sequences where ``SM90_BACKWARD_VARLEN_DQ_WARP`` does), and the conversion folded in where
    ``SM90_BACKWARD_FOLD_DQ`` is on (dense sequences, no block mask)."""
    packed_ok = SM90_BACKWARD_VARLEN_DQ_WARP or not config.variant.varlen
    if SM90_BACKWARD_DQ_WARP and config.dq_tile_major and not config.staged_dropout and packed_ok:
        fold = SM90_BACKWARD_FOLD_DQ and not (config.variant.varlen or config.variant.block_mask)
        return dataclasses.replace(config, dq_warp=True, stats_ahead=True, fold_dq=fold)
    return config


def sm90_rows_backward_config(dtype, headdim, variant):
    """The rows split as planned (``SM90_BACKWARD_ROWS_DQ_EARLY``: dQ's product issued early without a
    window; ``SM90_BACKWARD_ROWS_STORE_QUADS``: dK and dV by 16-byte stores without a window)."""
    early = "dq" if SM90_BACKWARD_ROWS_DQ_EARLY and not variant.window else "none"
    quads = SM90_BACKWARD_ROWS_STORE_QUADS and not variant.window
    return Sm90RowsBackwardConfig(dtype, headdim, variant, heavy_groups=SM90_BACKWARD_HEAVY_GROUPS,
                                  issue_early=early, store_quads=quads)


def planned_backward_sm90_config(dtype, headdim, variant):
    """backward_sm90.py's dK/dV kernel as planned: ``SM90_BACKWARD``'s row for ``headdim``
    (``sm90_backward_table_config``), its dQ tile-major where it issues dQ_i's product first
    (``SM90_BACKWARD_DQ_TILES``; for packed sequences ``SM90_BACKWARD_VARLEN_DQ_TILES``) and then added
    by warp 2 (``staged_dq_by_warp_2``), with three ring stages for plain attention padded to 128
    columns where ``SM90_BACKWARD_PLAIN_THREE_STAGES`` (an option, off), and dK and dV by 16-byte
    stores where ``SM90_BACKWARD_STORE_QUADS`` (``store_quads_planned``)."""
    table = sm90_backward_table_config(dtype, headdim, variant)
    if SM90_BACKWARD_DQ_TILES and table.dq_first and (SM90_BACKWARD_VARLEN_DQ_TILES or not variant.varlen):
        stages = 3 if SM90_BACKWARD_PLAIN_THREE_STAGES and table.headdim_padded == 128 and variant == Variant() else \
            table.stages
        return staged_dq_by_warp_2(dataclasses.replace(table, dq_reduce="tiles", stages=stages,
                                                       store_quads=store_quads_planned(table)))
    return table


# dK and dV stored 16 bytes a lane after a transpose across each quad (``store_quads``, step 55) by
# the planned kernel padded to 128 columns (headdims 72-128) with dQ tile-major, dense sequences.
# Measured on an H100 (thirty-fifth session: scripts/gpu_check.sh dq-warp-anchors, i.e.
# sm90_schedules.py --backward --headdims 64 128 --anchors, two runs, fp16, hd 128, on the plan with
# dq_warp; docs/perf-notes.md "The plan against the anchors again; the 16-byte dK/dV stores planned;
# the kernels apart"): +0.5% to +3.3% in all eight cells (4k and 16k, plain and causal, two runs), as the thirty-second
# session's +0.9% to +3.5% before dq_warp. Its GPU grid on that plan (test_backward_sm90_store_quads_gpu:
# hd 72, 104 and 128; plain, causal, softcap and dropout's producer bits) 12 of 12. Packed sequences
# keep the pairs (neither timed nor in that grid) unless ``SM90_BACKWARD_VARLEN_STORE_QUADS``.
SM90_BACKWARD_STORE_QUADS = True
# ... for packed sequences too (each sequence's key rows bounded as the pairs' are): an option, off,
# until timed (scripts/gpu_check.sh packed-quads; simulator case in test_varlen_sm90_dq_tiles, GPU grid
# test_varlen_sm90_store_quads_gpu)
SM90_BACKWARD_VARLEN_STORE_QUADS = False


# The tile-major dQ conversion (Sm90ConvertDqConfig) storing dq 16 bytes a lane after the quads'
# transposes (``store_quads``): an option, off, until timed (scripts/gpu_check.sh convert-quads). The
# conversion measured 127-154 us at 4k on an H100 (thirty-fifth session, sm90_schedules.py --parts),
# 0.47-0.57x the device-to-device copy's bandwidth: 4-5% of the call at 4k, about 1.4% at 16k.
SM90_CONVERT_DQ_QUADS = False


def store_quads_planned(table):
    """Whether the planned kernel from ``table`` (``sm90_backward_table_config``) stores dK and dV 16
    bytes a lane (``SM90_BACKWARD_STORE_QUADS``; for packed sequences ``SM90_BACKWARD_VARLEN_STORE_QUADS``)."""
    packed_ok = SM90_BACKWARD_VARLEN_STORE_QUADS or not table.variant.varlen
    return SM90_BACKWARD_STORE_QUADS and table.headdim_padded == 128 and packed_ok


# Plain attention (no window, no other feature) on the planned kernel padded to 128 columns (dQ
# tile-major) with a third ring stage beside the staged dQ tile (232,008 of the 232,448 bytes): an
# option, off. Planned in the twenty-ninth session on schedules timed one block of calls after
# another (+2.3% to +8.1% over two stages, the three-stage kernel timed before the two-stage one),
# then timed interleaved call by call on an H100 (thirtieth session: scripts/gpu_check.sh
# interleaved, sm90_schedules.py --backward --headdims 128, two runs of 15 rounds, docs/perf-notes.md
# "Timing order"), fp16, hd 128: -1.5% to -1.6% at 4k and -2.4% to -3.3% at 16k against two stages,
# causal -3.0% to -4.3%. The earlier gain was the order: the schedule timed last read 5-14% slower.
SM90_BACKWARD_PLAIN_THREE_STAGES = False


# Dropout's keep bits made by the producer's idle warps 2 and 3 (``dropout_bits="producer"``) past
# this headdim, the kernel padded to 128 columns: measured on the H200 (scripts/sm90_schedules.py
# --backward --dropout 0.1, docs/perf-notes.md "Hopper backward" step 26), fp16, hd 128, 4k and 16k:
# +6% causal, +0-1% non-causal against the consumer lanes' own calls; at hd 64, whose step has half
# the products to hide the producer's Philox calls under, 20-25% slower. Headdims 72-120 run the same
# padded kernel (when "sm90" is forced): not timed.
SM90_BACKWARD_PRODUCER_DROPOUT_MIN_HEADDIM = 72


# With dQ split by columns, dQ_i's product issued before dV's and dK's and its reductions made while
# they run (``dq_first``): measured on the H200 (scripts/sm90_schedules.py --backward --headdims 128
# --anchors, docs/perf-notes.md "Hopper backward" step 28), fp16, hd 128, 4k and 16k: +16% / +10%
# non-causal, +13% / +10% causal over the products' old order; 1.25-1.31x SDPA flash's backward.
SM90_BACKWARD_DQ_FIRST = True


# Dropout where the table's row is "steps" (headdims up to 64) by 32-column halves instead, dQ's
# product first (so tile-major: ``SM90_BACKWARD_DQ_TILES``), the form step 36 built: measured at hd 64
# (scripts/gpu_check.sh tiles2: sm90_schedules.py --backward --headdims 64 --dropout 0.1, fp16, 4k
# and 16k; docs/perf-notes.md "Hopper backward", steps 36-39), against "steps": +1.1% / +1.6%
# non-causal, +5.8% / +8.7% causal on the H200; +0.0% / +2.3%, +4.8% / +8.3% on an H100. Its GPU grid:
# test_backward_sm90_columns_dq_first_gpu. Below 64 (only when "sm90" is forced) not timed.
SM90_BACKWARD_DROPOUT_COLUMNS = True


@lru_cache(maxsize=None)
def sm90_backward_table_config(dtype, headdim, variant):
    """backward_sm90.py's dK/dV kernel with ``SM90_BACKWARD``'s row for ``headdim`` (dQ's product
    first with "columns": ``SM90_BACKWARD_DQ_FIRST``; dropout's keep bits by the producer's warps
    past ``SM90_BACKWARD_PRODUCER_DROPOUT_MIN_HEADDIM``; dropout by columns where the row says
    "steps": ``SM90_BACKWARD_DROPOUT_COLUMNS``)."""
    _, stages, dq_split = _row(SM90_BACKWARD, headdim)
    if variant.dropout and dq_split == "steps" and SM90_BACKWARD_DROPOUT_COLUMNS:
        dq_split = "columns"
    bits = "producer" if variant.dropout and headdim >= SM90_BACKWARD_PRODUCER_DROPOUT_MIN_HEADDIM else "consumers"
    return Sm90BackwardConfig(dtype=dtype, headdim=headdim, variant=variant, stages=stages, dq_split=dq_split,
                              heavy_groups=SM90_BACKWARD_HEAVY_GROUPS, dropout_bits=bits,
                              dq_first=SM90_BACKWARD_DQ_FIRST and dq_split == "columns")


def plan_backward(static, deterministic, family=None, aligned=None, out_aligned=False, dq_tiles=True):
    """The kernel configs of a backward call: (preprocess, dkdv, dq or convert_dq), for a problem's
    static part (``Problem.static``). ``aligned``: every row of q, k, v and dout starts on a 16-byte
    boundary (the tensor-core kernels then copy tiles with cp.async); default ``static.aligned``.
    ``out_aligned``: so do out's rows (with ``aligned`` and ``ROWWISE_VECTOR``, the row-wise kernels
    take their 16-byte forms where the dtype and headdim allow). ``dq_tiles``: the largest query
    tile whose tile-major dQ padding packed sequences take (``packed_dq_tile_rows``: 128, 64, or 0
    or False for none; True, the default, any): a dK/dV kernel with dQ tile-major in larger tiles
    gives way, step 40's to the table's kernel, the others to dQ's atomics.

    ``family`` "sm90" (the Hopper dK/dV kernel with atomic dq, where it serves the call:
    ``sm90_backward_unsupported_reason``; with deterministic=True the Hopper dK/dV kernel without
    dQ and the Hopper dQ kernel (``sm90_deterministic_configs``, every variant); the sm80 family's
    kernels otherwise; the default at ``SM90_BACKWARD_DEFAULT_HEADDIMS``, with
    deterministic=True at ``SM90_DETERMINISTIC_DEFAULT_HEADDIMS``, and the deterministic plan
    without it too at ``SM90_PAIR_DEFAULT_HEADDIMS``), "sm80" (alias
    "mma": tensor-core dK/dV and dQ kernels, float16/bfloat16 on compute capability >= 8.0; the
    default wherever it applies) or "portable" (any dtype and GPU; the default elsewhere). All use the
    portable preprocess and dq-conversion kernels.
    """
    family = canonical_family(family)
    dtype, headdim, device = static.dtype, static.headdim, static.device
    aligned = static.aligned if aligned is None else aligned
    variant = static.variant._replace(score_mod_grad="")
    measured = _backward_measured_on_sm90(variant, headdim, deterministic)
    default = (family is None and not runtime.SIMULATOR and headdim in SM90_BACKWARD_DEFAULT_HEADDIMS
               and (measured or (headdim in SM90_BACKWARD_VARLEN_HEADDIMS and variant == Variant(varlen=True))))
    sm90 = family == "sm90" or default
    # deterministic=True under "sm90": the sm90 dK/dV kernel without dQ (dq_split="none"; the wide one
    # past headdim 128) and the sm90 dQ kernel, every variant;
    # by default at SM90_DETERMINISTIC_DEFAULT_HEADDIMS for the variants measured (plain and windowed
    # attention, the features at their headdims), and at SM90_PAIR_DEFAULT_HEADDIMS without
    # deterministic=True too (faster than dQ's atomics there) for plain and windowed attention and
    # SM90_PAIR_FEATURES
    pair_default = default and measured and (
        headdim in SM90_DETERMINISTIC_DEFAULT_HEADDIMS if deterministic
        else headdim in SM90_PAIR_DEFAULT_HEADDIMS
        and (variant in SM90_BACKWARD_DEFAULT_VARIANTS or _backward_feature(variant) in SM90_PAIR_FEATURES))
    sm90_dq = (sm90_backward_unsupported_reason(static, False, aligned) is None
               and ((deterministic and family == "sm90") or pair_default))
    sm90 = sm90 and not sm90_dq and sm90_backward_unsupported_reason(static, deterministic, aligned) is None
    family = _resolve_family(dtype, device, "sm80" if family == "sm90" else family)
    atomic = not (deterministic or sm90_dq)
    common = dict(dtype=dtype, headdim=headdim, variant=static.variant, atomic_dq=atomic)
    rows, rows_threads = PORTABLE_BACKWARD_ROWS
    vector = ROWWISE_VECTOR and aligned and out_aligned and dtype != "float32" and headdim % 8 == 0
    if vector:  # 16-byte accesses: eight features a lane
        rows_threads = headdim // 8
        rows = ROWWISE_VECTOR_THREADS // rows_threads
    # The row-wise kernels do not depend on the variant: one compiled kernel serves them all.
    rowwise = dict(common, variant=Variant(), vector=vector)
    preprocess = PortableBackwardConfig("preprocess", block_m=rows, block_n=rows,
                                        threads_per_row=rows_threads, **rowwise)
    convert = PortableBackwardConfig("convert_dq", block_m=rows, block_n=rows,
                                     threads_per_row=rows_threads, **rowwise)

    if sm90:
        dkdv = sm90_backward_config(dtype, headdim, static.variant)  # score_mod_grad too
        tile_limit = math.inf if dq_tiles is True else int(dq_tiles)  # packed sequences' padding
        if getattr(dkdv, "dq_split", "") == "rows" and dkdv.block_m > tile_limit:  # step 40's tiles need it
            dkdv = planned_backward_sm90_config(dtype, headdim, static.variant)
        if getattr(dkdv, "dq_tile_major", False) and dkdv.block_m > tile_limit:  # (no staged dQ for warp 2)
            dkdv = dkdv.replaced(dq_reduce="red")
        if getattr(dkdv, "dq_tile_major", False):  # dq_accum tile-major: the caller zeroes it
            preprocess = dataclasses.replace(preprocess, atomic_dq=False)
            varlen = static.variant.varlen  # each sequence's tiles from a whole tile of the dK/dV kernel's
            convert = Sm90ConvertDqConfig(dtype, headdim, dkdv.dq_part_columns, varlen,
                                          tile_rows=dkdv.block_m if varlen else 64, store_quads=SM90_CONVERT_DQ_QUADS)
        return preprocess, dkdv, convert
    if sm90_dq:  # both Hopper kernels, neither with atomics: dK, dV, then dQ, each in a fixed order
        return (preprocess, *sm90_deterministic_configs(dtype, headdim, static.variant))
    if family == "sm80":
        _, block_m, block_n, num_warps = _row(MMA_BACKWARD_DKDV, headdim)
        vector = dict(common, aligned=aligned and headdim % 8 == 0)
        # sm_90 adds two float32 columns to dq_accum per vector reduction, half the atomics.
        vector_dq = atomic and headdim % 8 == 0 and _compute_capability(device) >= (9, 0)
        dkdv = MmaBackwardConfig("dkdv", block_m=block_m, block_n=block_n, num_warps=num_warps,
                                 vector_dq=vector_dq, **vector)
        if atomic:
            return preprocess, dkdv, convert
        _, block_m, block_n, num_warps = _row(MMA_BACKWARD_DQ, headdim)
        dq = MmaBackwardConfig("dq", block_m=block_m, block_n=dropout_keys(block_n, static.variant),
                               num_warps=num_warps, **vector)
        return preprocess, dkdv, dq

    _, threads, block_n = _row(PORTABLE_BACKWARD_DKDV, headdim)
    block_m = _fit("dkdv", headdim, threads, block_n, fixed_is_m=False)
    dkdv = PortableBackwardConfig("dkdv", block_m=block_m, block_n=block_n, threads_per_row=threads,
                                  **common)
    if atomic:
        return preprocess, dkdv, convert
    _, threads, block_m = _row(PORTABLE_BACKWARD_DQ, headdim)
    block_n = _fit("dq", headdim, threads, block_m, fixed_is_m=True)
    dq = PortableBackwardConfig("dq", block_m=block_m, block_n=block_n, threads_per_row=threads, **common)
    return preprocess, dkdv, dq


# ---------------------------------------------------------------------------------------------------
# Decode (nbflash/kernels/decode_mma.py, through nbflash.flash_attn_with_kvcache)
# ---------------------------------------------------------------------------------------------------

# (largest headdim, block_n, num_warps, stages): keys per pipeline stage (each warp takes an equal
# share of 16 keys or more), and how many stages are in flight. MMA_DECODE sizes the blocks so that
# two fit an SM's shared memory up to headdim 128 (a stage of 64 keys at headdim 128 is 34 KB of K
# and V): 8 warps an SM where a call has units of work (sequence, KV head, block of rows) for two
# blocks on every SM. A call with fewer units than SMs gets one block an SM from the split count
# (kvcache.choose_splits); there MMA_DECODE_WIDE gives that one block 8 warps. Measured on the H200
# (2026-12-03, scripts/decode_tune.py, calls back to back, GQA 32/8, hd 128, fp16; docs/perf-notes.md):
# 128x8x2 against 64x4x3, as fractions of the copy bandwidth: batch 1 / 128k 0.878 vs 0.862, paged
# (pages of 16) 0.714 vs 0.421; batch 16 / 16k 0.971 vs 0.955, paged 0.786 vs 0.44; but batch 64 /
# 4k (512 units) 0.895 vs 0.939, paged 0.726 vs 0.756, hence the narrow blocks there. Headdim 64,
# 128x8x3 against 64x4x4: 0.782 vs 0.733 (paged 0.583 vs 0.333) at batch 1 / 128k, 0.890 vs 0.845
# (0.652 vs 0.356) at 16 / 16k. Headdim 256 has room for 6 warps (two stages of 8 warps x 16 keys
# would take 270 KB; 96 keys take 211 KB): 96x6x2 against 64x4x2, paged 0.586 vs 0.454 at batch 1 /
# 128k, 0.649 vs 0.495 at 16 / 16k, contiguous 0.837 vs 0.832 and 0.916 vs 0.940 (the one loss).
MMA_DECODE = [
    (64, 64, 4, 4),
    (128, 64, 4, 3),
    (256, 64, 4, 2),
]
MMA_DECODE_WIDE = [
    (64, 128, 8, 3),
    (128, 128, 8, 2),
    (256, 96, 6, 2),
]


@lru_cache(maxsize=None)
def decode_config(dtype, headdim, variant, paged, rotary, rotary_interleaved, rows, positive_scale=True,
                  append=False, wide=False, aligned_pages=None):
    """The decode kernel's configuration: ``rows`` = packed (query token, query head) rows per
    key/value head (seqlen_q * nheads / nheads_k); two 16-row tiles per block when they are more
    than 16 and the accumulators fit (headdim <= 64); ``append``: the new tokens appended inside it;
    ``wide``: 8-warp blocks (6 at headdim 256; MMA_DECODE_WIDE), for calls whose blocks come one
    per SM; ``aligned_pages``: the page size of a paged call without leftpad whose copies may take
    a warp's share of a tile from one page (``page_aligned``, when the size is a multiple of it)."""
    table = MMA_DECODE_WIDE if wide and has_wide_decode(headdim) else MMA_DECODE
    _, block_n, num_warps, stages = _row(table, headdim)
    m_tiles = 2 if rows > 16 and headdim <= 64 else 1
    page_aligned = bool(paged and aligned_pages and aligned_pages % (block_n // num_warps) == 0)
    return MmaDecodeConfig(dtype=dtype, headdim=headdim, variant=variant, paged=paged, rotary=rotary,
                           rotary_interleaved=rotary_interleaved if rotary else True, m_tiles=m_tiles,
                           block_n=block_n, num_warps=num_warps, stages=stages, fold_scale=positive_scale,
                           append=append, page_aligned=page_aligned)


def has_wide_decode(headdim):
    """Whether MMA_DECODE_WIDE has a row for ``headdim``."""
    return any(headdim <= row[0] for row in MMA_DECODE_WIDE)
