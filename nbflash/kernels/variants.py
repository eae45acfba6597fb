"""Attention variants as code compiled into every kernel: built once per ``Variant``.

Every kernel (portable and tensor-core, forward and backward) takes its variant's runtime values as
one tuple argument, ``params`` (``nbflash.problem.Problem.params``), and calls the device functions
built here at fixed points of its tile step:

- the **band**: ``key_tiles`` / ``query_tiles`` give the tile segments a block visits, and
  ``row_keys`` the keys a query row sees, from the window in ``params`` (``geometry`` does the
  arithmetic); without a window they reduce to the sequence bounds and ``WINDOW`` is False;
- the **mask** point, before the row max: an element is dropped iff
  ``hidden(key, lo, hi, row, seqlen_q, params, head_ctx)``: outside its row's ``row_keys``, or
  False in the boolean mask tensor; tiles that every row sees whole skip the test (with a mask
  tensor no tile is known to be whole);
- the **score** point, right after Q K^T: with a score feature (``SCORE``) the kernel scales the
  scores to natural units, ``x = q.k * softmax_scale``, and ``score(x, row, key, ...)`` applies
  the features in flash-attn's order: softcap (``c * tanh(x / c)``), then ALiBi
  (``- slope * |row + seqlen_k - seqlen_q - key|``), then the additive bias tensor
  (``+ bias[b, h, row, key]``). What they read per head, ``head_ctx = (b, h, slope)``, comes from
  ``head_context(params, b, h)`` once per head. The backward calls ``score_grad``, which also
  returns d score / d x (the bias gets no gradient). The tensor-core kernels call the same features
  through ``Hooks.tensor_core_score`` instead: on raw q.k, with the scale folded into them, ALiBi's
  distance a float per row and softcap's tanh from MUFU instructions;
- the probability point (after exp, before P V): dropout's factor of each probability
  (``dropout_factor``; ``dropout_words`` / ``keep_or_zero`` / ``byte_factor`` for a tensor-core
  lane's sixteen scores of four 8-key column blocks, ``dropout_bits_t`` / ``dropout_bit`` for the
  eight of the transposed tile, one Philox call each);
- the **layout**: with packed sequences (``VARLEN``), ``sequence(params, b, total_q, total_k)``
  gives sequence b's rows as (q_start, seqlen_q, k_start, seqlen_k) (geometry.packed_sequence);
  each kernel, under ``if VARLEN:``, narrows its arrays to those rows and exits the blocks that lie
  past its sequence's end, so the rest of it sees one dense sequence. Dense: (0, seqlen_q, 0,
  seqlen_k), and the branch is compiled out;
- the **block mask**: ``tile_class(params, b, h, m_tile, n_tile)`` says whether a (query tile, key
  tile) pair is EMPTY (the kernel skips it: no loads, no math), PARTIAL (the masked copy, with the
  mask_mod test) or FULL (the unmasked copy, if the band sees it whole too). Without a block mask it
  is the constant FULL, so the kernels' tests of it fold away.

A feature the variant does not have compiles to nothing: the flags are closure constants of each
kernel's builder.
"""

import hashlib
import math
from functools import lru_cache

import numpy as np
from numba import float32, int32, uint32
from numba.extending import register_jitable

from ..dtypes import KERNEL_DTYPE
from ..primitives import bf16_bits_to_f32, exp2_approx, rcp_approx, shuffle_xor_u32, tanh_approx
from . import geometry
from .philox import byte_of, dropout_block, dropout_byte

LOG2E = math.log2(math.e)

# The kernel type of each runtime value, as a signature spells it (``nbflash.problem.PARAMS``
# gives their order). The ALiBi slopes are (batch, nheads), any strides (stride 0 over batch when
# the caller gave one slope per head).
PARAM_TYPES = {
    "window_left": "int32",
    "window_right": "int32",
    "softcap": "float32",
    "alibi_slopes": "float32[:,:]",
    "mask": "boolean[:,:,:,:]",  # (batch, nheads, seqlen_q, seqlen_k), any strides: True = kept
    "dropout_threshold": "uint32",
    "dropout_scale": "float32",
    "seed_lo": "uint32",
    "seed_hi": "uint32",
    # (batch, nheads, query tiles, key tiles) of the kernel's tile sizes, any strides (stride 0 where
    # the block mask broadcasts): EMPTY, PARTIAL or FULL (nbflash.block_mask)
    "block_mask": "int8[:,:,:,:]",
    # packed sequences: (batch + 1,) row offsets of each sequence in q and in k / v
    "cu_seqlens_q": "int32[:]",
    "cu_seqlens_k": "int32[:]",
}

# A tile pair's class in a block mask's table: no element kept, some kept, all kept.
EMPTY, PARTIAL, FULL = 0, 1, 2


def _class_scans(class_at):
    """(next_visited, visited_count) over positions whose block-mask class ``class_at(params,
    where, position)`` is not EMPTY: next_visited(params, where, position, end) is the first such
    position in [position, end) (end if none), visited_count(params, where, start, end) how many
    there are in [start, end). One class a trip: reading eight at once (independent loads) measured
    slower on the H200, 10-20% for a document mask (docs/perf-notes.md, "Block masks on the Hopper
    family")."""

    @register_jitable
    def next_visited(params, where, position, end):
        while position < end and class_at(params, where, position) == EMPTY:
            position += 1
        return position

    @register_jitable
    def visited_count(params, where, start, end):
        count = 0
        for position in range(start, end):
            if class_at(params, where, position) != EMPTY:
                count += 1
        return count

    return next_visited, visited_count


def _warp_class_scans(class_at):
    """The scans of ``_class_scans`` done by a whole warp, ``lane`` its lane (0..31; all 32 lanes
    call with the same arguments): each lane reads one class of 32 consecutive positions, so one
    memory latency covers 32 of them, and the lanes agree by butterfly shuffles (the lowest lane
    that found one; the sum of the counts). Same results as ``_class_scans``."""

    @register_jitable
    def warp_next_visited(params, where, position, end, lane):
        while position < end:
            found = uint32(32)  # the lowest lane whose position is visited, 32 if none
            if position + lane < end and class_at(params, where, position + lane) != EMPTY:
                found = uint32(lane)
            mask = uint32(16)
            while mask != uint32(0):
                found = min(found, shuffle_xor_u32(found, mask))
                mask >>= uint32(1)
            if found < uint32(32):
                return position + int32(found)
            position += 32
        return end

    @register_jitable
    def warp_visited_count(params, where, start, end, lane):
        count = uint32(0)
        for position in range(start + lane, end, 32):
            if class_at(params, where, position) != EMPTY:
                count += uint32(1)
        mask = uint32(16)
        while mask != uint32(0):
            count += shuffle_xor_u32(count, mask)
            mask >>= uint32(1)
        return int32(count)

    return warp_next_visited, warp_visited_count


def param_types(variant):
    """The signature types of ``params`` for ``variant``, in order (the bias tensor's element type
    is the variant's; bfloat16 arrives as its uint16 bits)."""
    types = dict(PARAM_TYPES, bias=f"{KERNEL_DTYPE.get(variant.bias, 'float32')}[:,:,:,:]")
    return tuple(types[name] for name in variant.param_names())


def _score_steps(variant, names):
    """(feature, score, score_grad) of each score feature, in the order they apply: the device
    functions take ``(x, row, key, seqlen_q, seqlen_k, params, head_ctx)``; score_grad returns
    (y, dy/dx)."""
    steps = []
    if variant.softcap:
        SOFTCAP = names.index("softcap")

        @register_jitable
        def softcap(x, row, key, seqlen_q, seqlen_k, params, head_ctx):
            cap = params[SOFTCAP]
            return cap * math.tanh(x / cap)

        @register_jitable
        def softcap_grad(x, row, key, seqlen_q, seqlen_k, params, head_ctx):
            cap = params[SOFTCAP]
            t = math.tanh(x / cap)
            return cap * t, float32(1) - t * t

        steps.append(("softcap", softcap, softcap_grad))
    if variant.alibi:

        @register_jitable
        def alibi(x, row, key, seqlen_q, seqlen_k, params, head_ctx):
            return x - head_ctx[2] * float32(abs(row + seqlen_k - seqlen_q - key))

        @register_jitable
        def alibi_grad(x, row, key, seqlen_q, seqlen_k, params, head_ctx):
            return alibi(x, row, key, seqlen_q, seqlen_k, params, head_ctx), float32(1)

        steps.append(("alibi", alibi, alibi_grad))
    if variant.bias:
        BIAS = names.index("bias")
        to_float = bf16_bits_to_f32 if variant.bias == "bfloat16" else float32

        @register_jitable
        def bias(x, row, key, seqlen_q, seqlen_k, params, head_ctx):
            if row < seqlen_q and key < seqlen_k:  # the tiles' padding reads nothing
                x += to_float(params[BIAS][head_ctx[0], head_ctx[1], row, key])
            return x

        @register_jitable
        def bias_grad(x, row, key, seqlen_q, seqlen_k, params, head_ctx):
            return bias(x, row, key, seqlen_q, seqlen_k, params, head_ctx), float32(1)

        steps.append(("bias", bias, bias_grad))
    if variant.score_mod:
        user = _device(variant.score_mod)
        user_grad = _device(variant.score_mod_grad) if variant.score_mod_grad else None

        @register_jitable
        def score_mod(x, row, key, seqlen_q, seqlen_k, params, head_ctx):
            return float32(user(x, head_ctx[0], head_ctx[1], row, key))

        if user_grad is None:

            @register_jitable
            def score_mod_grad(x, row, key, seqlen_q, seqlen_k, params, head_ctx):
                return score_mod(x, row, key, seqlen_q, seqlen_k, params, head_ctx), float32(1)  # never used

        else:

            @register_jitable
            def score_mod_grad(x, row, key, seqlen_q, seqlen_k, params, head_ctx):
                grad = float32(user_grad(x, head_ctx[0], head_ctx[1], row, key))
                return score_mod(x, row, key, seqlen_q, seqlen_k, params, head_ctx), grad

        steps.append(("score_mod", score_mod, score_mod_grad))
    return steps


def _element_masks(variant, names):
    """``keep(row, key, params, head_ctx)``: the boolean mask tensor and the user's mask_mod
    combined, or None when the variant has neither (asked only inside the sequence)."""
    tests = []
    if variant.mask:
        KEEP = names.index("mask")

        @register_jitable
        def tensor(row, key, params, head_ctx):
            return params[KEEP][head_ctx[0], head_ctx[1], row, key]

        tests.append(tensor)
    if variant.mask_mod:
        user = _device(variant.mask_mod)

        @register_jitable
        def mask_mod(row, key, params, head_ctx):
            return bool(user(head_ctx[0], head_ctx[1], row, key))

        tests.append(mask_mod)
    if not tests:
        return None
    keep = tests[0]
    for test in tests[1:]:
        keep = _both(keep, test)
    return keep


def _both(first, second):
    @register_jitable
    def both(row, key, params, head_ctx):
        return first(row, key, params, head_ctx) and second(row, key, params, head_ctx)

    return both


# ---------------------------------------------------------------------------------------------------
# User functions (score_mod, mask_mod): fingerprinted into the variant, compiled as device functions
# ---------------------------------------------------------------------------------------------------

_USER_FUNCTIONS = {}  # fingerprint -> the Python function


def user_function(fn, name):
    """The fingerprint under which ``fn`` enters a variant (and so every kernel cache key): a hash
    of its code, its constants and the values it captures (closure cells and the globals it reads).
    A function that captures a GPU array is refused: the kernel could not read it."""
    if not callable(fn) or not hasattr(fn, "__code__"):
        raise TypeError(f"{name} must be a Python function, got {type(fn).__name__}")
    digest = hashlib.sha256()
    _fingerprint(fn, name, digest, set())
    key = f"{fn.__qualname__}:{digest.hexdigest()[:20]}"
    _USER_FUNCTIONS.setdefault(key, fn)
    return key


def _fingerprint(fn, name, digest, seen):
    code = fn.__code__
    for part in (code.co_code, code.co_consts, code.co_names, code.co_varnames, code.co_argcount):
        digest.update(repr(part).encode())
    captured = [cell.cell_contents for cell in fn.__closure__ or ()]
    captured += [fn.__globals__[g] for g in code.co_names if g in fn.__globals__]
    for value in captured:
        if isinstance(value, (bool, int, float, complex, str, bytes, type(None))):
            digest.update(repr(value).encode())
        elif isinstance(value, np.ndarray):  # Numba copies it into the kernel as a constant
            digest.update(f"{value.dtype}{value.shape}".encode() + value.tobytes())
        elif hasattr(value, "__cuda_array_interface__") or hasattr(value, "__dlpack__"):
            raise TypeError(
                f"{name} captures a GPU array ({type(value).__name__}); a kernel cannot read it from "
                f"there. Pass a NumPy array (copied into the kernel as a constant), or the tensor as bias="
            )
        elif hasattr(value, "__code__") and id(value) not in seen:  # a helper it calls
            seen.add(id(value))
            _fingerprint(value, name, digest, seen)
        else:  # modules (math), Numba types and functions
            digest.update(repr(getattr(value, "__name__", type(value).__name__)).encode())


def _device(key):
    """The device function compiled from the user function behind ``key``."""
    from numba import cuda

    return cuda.jit(device=True)(_USER_FUNCTIONS[key])


def _chain(steps):
    """One (score, score_grad) pair applying ``steps`` in order (the identity for none)."""

    @register_jitable
    def score(x, row, key, seqlen_q, seqlen_k, params, head_ctx):
        return x

    @register_jitable
    def score_grad(x, row, key, seqlen_q, seqlen_k, params, head_ctx):
        return x, float32(1)

    for _, step, step_grad in steps:
        score, score_grad = _then(score, score_grad, step, step_grad)
    return score, score_grad


def _then(first, first_grad, step, step_grad):
    @register_jitable
    def score(x, row, key, seqlen_q, seqlen_k, params, head_ctx):
        y = first(x, row, key, seqlen_q, seqlen_k, params, head_ctx)
        return step(y, row, key, seqlen_q, seqlen_k, params, head_ctx)

    @register_jitable
    def score_grad(x, row, key, seqlen_q, seqlen_k, params, head_ctx):
        y, dy = first_grad(x, row, key, seqlen_q, seqlen_k, params, head_ctx)
        z, dz = step_grad(y, row, key, seqlen_q, seqlen_k, params, head_ctx)
        return z, dz * dy

    return score, score_grad


# ---------------------------------------------------------------------------------------------------
# The tensor-core kernels' score point: raw Q K^T in, a score in units that the softmax's exp2 folds
# ---------------------------------------------------------------------------------------------------

# softcap's tanh in the tensor-core kernels. "exp2": tanh(u) - 1 = -2 / (1 + e^(2u)) from ex2.approx and
# rcp.approx (an FFMA, an FADD and two MUFU instructions per score; within ~2e-7 of tanh, absolute).
# "mufu": tanh.approx (an FMUL and one MUFU instruction), which the PTX ISA bounds only to a relative
# 2^-10.987: a score off by up to softcap * 2^-11 (0.015 at softcap 30), more than the tests' 1e-5 on
# the lse allows (MUFU.TANH has been measured at ~1.1e-5 on sm_75, which would pass: to be checked
# on the GPUs we support before it becomes the default). The portable kernels and decode keep
# libdevice's tanhf (``_score_steps``). Change it here, not at run time: the cubin cache keys on this
# file's source.
SOFTCAP_TANH = "exp2"

# Where the tensor-core score leaves S (``Hooks.tensor_core_score``): in units of the softcap (tanh,
# less 1 with "exp2"), of the softmax scale (q.k itself), or natural units.
CAP_UNITS, SCALE_UNITS, NATURAL_UNITS = "cap", "scale", "natural"

# The constants ``score_units`` gives per head: the base-2 score is S * units[EXP] + units[OFFSET];
# PRE multiplies q.k first (tanh's argument with a softcap, else the scale), POST turns tanh into
# natural units, SLOPE is ALiBi's slope per unit.
EXP, OFFSET, PRE, POST, SLOPE = range(5)


def _softcap_tanh(kind):
    """(tanh_less, SHIFT, ARG): tanh_less(s, units) = tanh(u) - SHIFT for u = s * scale / cap, with
    units[PRE] = ARG * scale / cap."""
    if kind == "mufu":

        @register_jitable
        def tanh_less(s, units):
            return tanh_approx(s * units[PRE])

        return tanh_less, 0, 1.0

    if kind != "exp2":
        raise ValueError(f"SOFTCAP_TANH must be 'exp2' or 'mufu', got {kind!r}")

    @register_jitable
    def tanh_less(s, units):
        """tanh(u) - 1 = -2 / (1 + e^(2u)) = 1 / (-1/2 - 2^(a - 1)) for a = 2u log2(e); 2^(a - 1) = inf
        and 0 give 0 and -2."""
        return rcp_approx(float32(-0.5) - exp2_approx(s * units[PRE] - float32(1)))

    return tanh_less, 1, 2 * LOG2E


def tensor_core_units(variant, positive_scale):
    """The units the tensor-core score leaves S in: softcap's (cap) when the features after it are
    ALiBi's at most, the scale's when ALiBi is the only feature and the scale is positive (the
    forward's max then commutes with the scale), else natural units (a bias tensor, a score_mod)."""
    natural = bool(variant.bias or variant.score_mod)
    if variant.softcap and not natural:
        return CAP_UNITS
    if variant.alibi and not variant.softcap and not natural and positive_scale:
        return SCALE_UNITS
    return NATURAL_UNITS


def _tensor_core_score(variant, names, steps, positive_scale):
    """(score_units, score_row, score_at, score_at_grad) for ``Hooks.tensor_core_score``."""
    UNITS = tensor_core_units(variant, positive_scale)
    tanh_less, SHIFT, TANH_ARG = _softcap_tanh(SOFTCAP_TANH)
    SOFTCAP = names.index("softcap") if variant.softcap else -1

    if UNITS == CAP_UNITS:

        @register_jitable
        def score_units(params, scale, head_ctx):
            cap = params[SOFTCAP]
            return (cap * float32(LOG2E), cap * float32(SHIFT * LOG2E), scale * float32(TANH_ARG) / cap, float32(1),
                    head_ctx[2] / cap)

    elif UNITS == SCALE_UNITS:

        @register_jitable
        def score_units(params, scale, head_ctx):
            return scale * float32(LOG2E), float32(0), float32(1), float32(1), head_ctx[2] / scale

    elif variant.softcap:

        @register_jitable
        def score_units(params, scale, head_ctx):
            cap = params[SOFTCAP]
            return float32(LOG2E), float32(0), scale * float32(TANH_ARG) / cap, cap, head_ctx[2]

    else:

        @register_jitable
        def score_units(params, scale, head_ctx):
            return float32(LOG2E), float32(0), scale, float32(1), head_ctx[2]

    @register_jitable
    def score_row(row, key, seqlen_q, seqlen_k, params, head_ctx, units):
        """What the features read of a (row, key) base once: the two, and ALiBi's distance as a
        float (the elements' distances differ from it by constants)."""
        return row, key, float32(int32(row + seqlen_k - seqlen_q - key))

    # Each step: (y, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units) -> y at row
    # ctx[0] + row_off and key ctx[1] + key_off (the offsets are the kernels' unrolled constants);
    # the first step takes q.k itself.
    if variant.softcap:
        score, score_grad = _tensor_core_softcap(tanh_less, SHIFT, UNITS == NATURAL_UNITS)
    else:
        score, score_grad = _tensor_core_scale(UNITS == SCALE_UNITS)
    for feature, step, step_grad in steps:
        if feature == "alibi":
            step, step_grad = _tensor_core_alibi()
        elif feature != "softcap":
            step, step_grad = _at_row_and_key(step, step_grad)
        else:
            continue
        score, score_grad = _then_at(score, score_grad, step, step_grad)
    return score_units, score_row, score, score_grad


def _tensor_core_scale(scale_units):
    """q.k in the scale's units (itself) or scaled to natural units."""
    if scale_units:

        @register_jitable
        def scale(s, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units):
            return s

    else:

        @register_jitable
        def scale(s, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units):
            return s * units[PRE]

    @register_jitable
    def scale_grad(s, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units):
        return scale(s, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units), float32(1)

    return scale, scale_grad


def _tensor_core_softcap(tanh_less, SHIFT, natural):
    """softcap on q.k: tanh - SHIFT in cap units, or cap * tanh; d/dx = 1 - tanh^2."""
    if natural and SHIFT:

        @register_jitable
        def from_tanh_less(y, units):
            return y * units[POST] + units[POST] * float32(SHIFT)

    elif natural:

        @register_jitable
        def from_tanh_less(y, units):
            return y * units[POST]

    else:

        @register_jitable
        def from_tanh_less(y, units):
            return y

    if SHIFT:

        @register_jitable
        def tanh_of(y):
            return y + float32(SHIFT)

    else:

        @register_jitable
        def tanh_of(y):
            return y

    @register_jitable
    def softcap(s, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units):
        return from_tanh_less(tanh_less(s, units), units)

    @register_jitable
    def softcap_grad(s, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units):
        y = tanh_less(s, units)
        t = tanh_of(y)
        return from_tanh_less(y, units), float32(1) - t * t

    return softcap, softcap_grad


def _tensor_core_alibi():
    """- slope * |distance|: an FADD of a constant to the row's distance, and an FFMA that takes its
    absolute value as an operand modifier (no integer conversion per score)."""

    @register_jitable
    def alibi(y, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units):
        return y - units[SLOPE] * abs(ctx[2] + float32(row_off - key_off))

    @register_jitable
    def alibi_grad(y, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units):
        return alibi(y, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units), float32(1)

    return alibi, alibi_grad


def _at_row_and_key(step, step_grad):
    """A natural-unit step of ``_score_steps`` (bias, score_mod) at the element's row and key."""

    @register_jitable
    def at(y, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units):
        return step(y, ctx[0] + row_off, ctx[1] + key_off, seqlen_q, seqlen_k, params, head_ctx)

    @register_jitable
    def at_grad(y, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units):
        return step_grad(y, ctx[0] + row_off, ctx[1] + key_off, seqlen_q, seqlen_k, params, head_ctx)

    return at, at_grad


def _then_at(first, first_grad, step, step_grad):
    @register_jitable
    def score(s, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units):
        y = first(s, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units)
        return step(y, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units)

    @register_jitable
    def score_grad(s, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units):
        y, dy = first_grad(s, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units)
        z, dz = step_grad(y, ctx, row_off, key_off, seqlen_q, seqlen_k, params, head_ctx, units)
        return z, dz * dy

    return score, score_grad


class Hooks:
    """The device functions and flags a kernel builder reads for one variant.

    Visibility, in the geometry's terms (nbflash/kernels/geometry.py) but with the window read from
    ``params``: ``key_tiles`` and ``query_tiles`` give a block's tile segments, ``row_keys`` the
    keys [lo, hi) a query row sees, and ``hidden(key, lo, hi, ...)`` is the mask test. Without a window
    they are written for what they then are (every key up to seqlen_k, no lower bound), so that
    the plain kernels hold no window state at all; ``tests/test_variants.py`` checks both against
    the geometry.
    """

    def __init__(self, variant):
        names = variant.param_names()
        self.WINDOW = WINDOW = variant.window
        if WINDOW:
            LEFT, RIGHT = names.index("window_left"), names.index("window_right")

            @register_jitable
            def key_tiles(row_start, row_end, seqlen_q, seqlen_k, params, block):
                return geometry.key_tiles(row_start, row_end, seqlen_q, seqlen_k, params[LEFT], params[RIGHT],
                                          block)

            @register_jitable
            def query_tiles(key_start, key_end, seqlen_q, seqlen_k, params, block):
                return geometry.query_tiles(key_start, key_end, seqlen_q, seqlen_k, params[LEFT], params[RIGHT],
                                            block)

            @register_jitable
            def row_keys(row, seqlen_q, seqlen_k, params):
                return geometry.visible_keys(row, seqlen_q, seqlen_k, params[LEFT], params[RIGHT])

        else:

            @register_jitable
            def key_tiles(row_start, row_end, seqlen_q, seqlen_k, params, block):
                end = (seqlen_k + block - 1) // block
                return (0, 0, seqlen_k // block, end) if seqlen_k >= block else (0, end, end, end)

            @register_jitable
            def query_tiles(key_start, key_end, seqlen_q, seqlen_k, params, block):
                end = (seqlen_q + block - 1) // block
                return (0, 0, seqlen_q // block, end) if seqlen_q >= block else (0, end, end, end)

            @register_jitable
            def row_keys(row, seqlen_q, seqlen_k, params):
                return 0, seqlen_k

        @register_jitable
        def outside(key, lo, hi):
            """Outside the row's visible keys [lo, hi) (no lower bound to test without a window)."""
            return key >= hi or (WINDOW and key < lo)

        keep = _element_masks(variant, names)
        self.ELEMENT_MASK = keep is not None  # a mask tensor or mask_mod: the band alone never says "whole"
        if keep is not None:
            # An element mask: no tile is known to be seen whole. Except with a block mask, whose
            # table says which tiles mask_mod keeps whole (a mask tensor is still tested everywhere).
            if variant.mask or not variant.block_mask:
                band_key_tiles, band_query_tiles = key_tiles, query_tiles

                @register_jitable
                def key_tiles(row_start, row_end, seqlen_q, seqlen_k, params, block):
                    first, _, _, end = band_key_tiles(row_start, row_end, seqlen_q, seqlen_k, params, block)
                    return first, end, end, end

                @register_jitable
                def query_tiles(key_start, key_end, seqlen_q, seqlen_k, params, block):
                    first, _, _, end = band_query_tiles(key_start, key_end, seqlen_q, seqlen_k, params, block)
                    return first, end, end, end

            @register_jitable
            def hidden(key, lo, hi, row, seqlen_q, params, head_ctx):
                """The mask test: outside the band, or dropped by the element masks (asked only
                inside the sequence)."""
                if outside(key, lo, hi):
                    return True
                return row < seqlen_q and not keep(row, key, params, head_ctx)

        else:

            @register_jitable
            def hidden(key, lo, hi, row, seqlen_q, params, head_ctx):
                """The mask test: outside the band."""
                return outside(key, lo, hi)

        self.key_tiles, self.query_tiles, self.row_keys, self.hidden = key_tiles, query_tiles, row_keys, hidden

        if keep is not None:

            @register_jitable
            def hidden_clamped(key, lo, hi, row, seqlen_q, seqlen_k, params, head_ctx):
                """``hidden`` without a branch per element (the sm90 forward's, for the mask tensor):
                the element masks read at (row, key) clamped into the sequence (always in bounds, so
                the read needs no guard; where the clamp moves it, the band or the row test decides),
                the tests combined bitwise."""
                kept = keep(min(row, seqlen_q - 1), min(key, seqlen_k - 1), params, head_ctx)
                return outside(key, lo, hi) | ((row < seqlen_q) & (not kept))

        else:

            @register_jitable
            def hidden_clamped(key, lo, hi, row, seqlen_q, seqlen_k, params, head_ctx):
                return outside(key, lo, hi)

        self.hidden_clamped = hidden_clamped

        self.BLOCK_MASK = variant.block_mask
        if variant.block_mask:
            CLASSES = names.index("block_mask")

            @register_jitable
            def tile_class(params, b, h, m_tile, n_tile):
                return int32(params[CLASSES][b, h, m_tile, n_tile])

        else:

            @register_jitable
            def tile_class(params, b, h, m_tile, n_tile):
                return int32(FULL)

        # The walks over the tiles a block visits: key tiles of a query tile (the forwards), scans
        # of positions by _class_scans, and (query head, query tile) pairs over a key tile (the sm90
        # dK/dV kernel), by _warp_class_scans.

        @register_jitable
        def key_tile_class(params, where, n_tile):
            b, h, m_tile = where
            return tile_class(params, b, h, m_tile, n_tile)

        @register_jitable
        def pair_class(params, where, position):
            b, hk, group, n_tile, first, per_head = where
            return tile_class(params, b, hk * group + position // per_head, first + position % per_head, n_tile)

        next_key, key_count = _class_scans(key_tile_class)
        warp_next_pair, warp_pair_count = _warp_class_scans(pair_class)

        @register_jitable
        def next_key_tile(params, b, h, m_tile, n_tile, end):
            """The first key tile from ``n_tile`` on that query tile ``m_tile`` visits (not EMPTY),
            or ``end``: a pipelined kernel prefetches that one (``n_tile`` itself without a block
            mask)."""
            if not variant.block_mask:
                return n_tile
            return next_key(params, (b, h, m_tile), n_tile, end)

        @register_jitable
        def visit_key_tile(params, b, h, m_tile, first, i, previous, end):
            """The i-th key tile (from 0) that query tile ``m_tile`` visits from ``first`` on, given
            the one before it, ``previous`` (first - 1 for i = 0): first + i without a block mask
            (a kernel's loop then compiles as it did before block masks), else the next tile after
            ``previous`` not EMPTY."""
            if not variant.block_mask:
                return first + i
            return next_key(params, (b, h, m_tile), previous + 1, end)

        @register_jitable
        def visited_key_tiles(params, b, h, m_tile, first, end):
            """How many key tiles of [first, end) query tile ``m_tile`` visits (not EMPTY): end -
            first without a block mask."""
            if not variant.block_mask:
                return end - first
            return key_count(params, (b, h, m_tile), first, end)

        @register_jitable
        def warp_visit_query_step(params, b, hk, group, n_tile, first, per_head, i, previous, lane):
            """The i-th step (from 0) of a dK/dV block over key tile ``n_tile``, as its position
            among the (query head of KV head hk's group, query tile) pairs in order, g * per_head +
            tile - first, given the step before it at ``previous`` (-1 for i = 0): i without a block
            mask (the loop then compiles as before), else the next pair after ``previous`` that is
            not EMPTY. Walked by a whole warp (all 32 lanes, ``lane`` each one's): 32 pairs a read
            past empty ones."""
            if not variant.block_mask:
                return i
            return warp_next_pair(params, (b, hk, group, n_tile, first, per_head), previous + 1, group * per_head,
                                  lane)

        @register_jitable
        def warp_visited_query_steps(params, b, hk, group, n_tile, first, per_head, lane):
            """How many of the group * per_head (query head, query tile) pairs over key tile
            ``n_tile`` a dK/dV block visits (not EMPTY), counted by a whole warp (all 32 lanes)."""
            if not variant.block_mask:
                return group * per_head
            return warp_pair_count(params, (b, hk, group, n_tile, first, per_head), 0, group * per_head, lane)

        self.warp_visit_query_step, self.warp_visited_query_steps = warp_visit_query_step, warp_visited_query_steps
        self.tile_class, self.next_key_tile = tile_class, next_key_tile
        self.visit_key_tile, self.visited_key_tiles = visit_key_tile, visited_key_tiles

        # The layout: where sequence b's rows are. The kernels call this only under `if VARLEN:`
        # (the dense layout compiles nothing of it).
        self.VARLEN = variant.varlen
        if variant.varlen:
            CU_Q, CU_K = names.index("cu_seqlens_q"), names.index("cu_seqlens_k")

            @register_jitable
            def sequence(params, b, total_q, total_k):
                return geometry.packed_sequence(params[CU_Q], params[CU_K], b, total_q, total_k)

        else:

            @register_jitable
            def sequence(params, b, seqlen_q, seqlen_k):
                return 0, seqlen_q, 0, seqlen_k

        self.sequence = sequence

        self.SCORE = variant.score
        self._variant, self._names, self._steps = variant, names, _score_steps(variant, names)
        self.score, self.score_grad = _chain(self._steps)
        self._tensor_core = {}
        if variant.alibi:
            ALIBI = names.index("alibi_slopes")

            @register_jitable
            def head_context(params, b, h):
                return b, h, params[ALIBI][b, h]

        else:

            @register_jitable
            def head_context(params, b, h):
                return b, h, float32(0)

        self.head_context = head_context

        # The probability point: dropout's factor of each probability, keep_scale(p) or 0; the
        # portable forward feeds P * factor to P V, the tensor-core forwards P or 0 (keep_or_zero)
        # and the scale once at the end (dropout_scale), the backward uses the factor for dV and dP.
        self.DROPOUT = variant.dropout
        if variant.dropout:
            THRESHOLD, SCALE = names.index("dropout_threshold"), names.index("dropout_scale")
            SEED_LO, SEED_HI = names.index("seed_lo"), names.index("seed_hi")

            @register_jitable
            def factor_of(number, params):
                """The dropout factor of a score whose random byte is ``number``: the kept scale or 0."""
                return params[SCALE] if number >= params[THRESHOLD] else float32(0)

            @register_jitable
            def dropout_factor(row, key, params, head_ctx):
                return factor_of(dropout_byte(row, key, head_ctx[0], head_ctx[1], params[SEED_LO], params[SEED_HI]),
                                 params)

            @register_jitable
            def kept(number, threshold):
                return uint32(1) if number >= threshold else uint32(0)

            @register_jitable
            def dropout_words(row, key, params, head_ctx):
                """The four words of rows row, row + 8 by keys key + 8 j + e, word j byte 2 i + e for
                row + 8 i (``row % 16 < 8``, ``key % 32 < 8`` even): a tensor-core lane's sixteen
                scores of four 8-key column blocks, each word one block's four in its accumulator's
                order; one Philox call (philox.dropout_block)."""
                return dropout_block(row, key, head_ctx[0], head_ctx[1], params[SEED_LO], params[SEED_HI])

            @register_jitable
            def keep_or_zero(x, word, n, params):
                """``x`` if byte ``n`` of ``word`` (of ``dropout_words``) keeps its score, else 0."""
                return x if byte_of(word, n) >= params[THRESHOLD] else float32(0)

            @register_jitable
            def byte_factor(word, n, params):
                """The dropout factor of byte ``n`` of ``word``."""
                return factor_of(byte_of(word, n), params)

            @register_jitable
            def dropout_scale(params):
                return params[SCALE]

            @register_jitable
            def column_bits(word, odd, threshold):
                """Bit i: whether byte 2 i + odd of ``word`` (row + 8 i, key parity ``odd``) is kept."""
                return kept(byte_of(word, odd), threshold) | (kept(byte_of(word, 2 + odd), threshold) << uint32(1))

            @register_jitable
            def call_bits(lo, hi, parity, threshold):
                """Bit 2 j + i: whether a call's score of row + 8 i by key + 8 j is kept, for keys of
                ``parity``, from its words of keys key (lo) and key + 8 (hi)."""
                return column_bits(lo, parity, threshold) | (column_bits(hi, parity, threshold) << uint32(2))

            @register_jitable
            def interleave_bits(even_q, odd_q):
                """dropout_bits_t's bits from bit 2 j + i of the even and the odd query's."""
                bits = uint32(0)
                for n in range(4):  # n = 2 j + i -> bit 4 j + 2 i (+1 for the odd query)
                    at = uint32(4 * (n // 2) + 2 * (n % 2))
                    bits |= (((even_q >> uint32(n)) & uint32(1)) << at) | (((odd_q >> uint32(n)) & uint32(1))
                                                                         << (at + uint32(1)))
                return bits

            @register_jitable
            def dropout_bits_t(query, key, params, head_ctx):
                """Which of the scores (query + 8 i + e, key + 8 j) are kept, as bit 4 j + 2 i + e
                (``dropout_bit``), for ``query % 16 < 8`` even and ``key % 16 < 8``: a lane's eight
                scores of the transposed tile (keys as rows), where lane ^ 4 holds the same queries
                for keys of the other parity. Called by every lane of the warp. The two lanes make
                one Philox call each, the even key's lane for queries query, query + 8, the odd
                one's for query + 1, query + 9; of its sixteen bytes they need the eight of keys
                key, key + 8 (words key // 8 % 4 and the next), and each trades the four bits the
                other needs (one shuffle): one call per eight scores and one register for the eight
                factors."""
                odd = key % 2
                w = dropout_block(query + odd, key - odd, head_ctx[0], head_ctx[1], params[SEED_LO],
                                  params[SEED_HI])
                threshold = params[THRESHOLD]
                # keys key, key + 8 are words 0, 1 or 2, 3 of the call (key % 32 < 16 or not)
                lo, hi = (w[0], w[1]) if (key // 16) % 2 == 0 else (w[2], w[3])
                # bit 2 j + i: query + odd' + 8 i by key + 8 j, for key parity odd' = odd (mine) and 1 - odd
                mine, theirs = call_bits(lo, hi, odd, threshold), call_bits(lo, hi, 1 - odd, threshold)
                got = shuffle_xor_u32(theirs, uint32(4))  # query + 1 - odd (+8) for my keys
                even_q, odd_q = (got, mine) if odd else (mine, got)
                return interleave_bits(even_q, odd_q)

            @register_jitable
            def dropout_bits_t_lanes(query, key, params, head_ctx):
                """dropout_bits_t of the four lanes that share two Philox calls, by one thread, for
                ``key % 32 < 8`` even: keys key and key + 1 (a lane and lane ^ 4) and key + 16 and
                key + 17 (the same lanes of the next warp, 16 key rows on, whose calls are the same:
                their words 2 and 3), as (key, key + 1, key + 16, key + 17). The calls are the lanes'
                (queries query, query + 8 and query + 1, query + 9), each read whole: two calls per
                sixteen scores, no shuffle; for a warp that stages the bits for the lanes."""
                w_e = dropout_block(query, key, head_ctx[0], head_ctx[1], params[SEED_LO], params[SEED_HI])
                w_o = dropout_block(query + 1, key, head_ctx[0], head_ctx[1], params[SEED_LO], params[SEED_HI])
                t = params[THRESHOLD]
                # a lane's bits: the even query's call's, the odd one's, for its key parity and words
                return (interleave_bits(call_bits(w_e[0], w_e[1], 0, t), call_bits(w_o[0], w_o[1], 0, t)),
                        interleave_bits(call_bits(w_e[0], w_e[1], 1, t), call_bits(w_o[0], w_o[1], 1, t)),
                        interleave_bits(call_bits(w_e[2], w_e[3], 0, t), call_bits(w_o[2], w_o[3], 0, t)),
                        interleave_bits(call_bits(w_e[2], w_e[3], 1, t), call_bits(w_o[2], w_o[3], 1, t)))

            @register_jitable
            def dropout_bit(bits, i, params):
                """The factor of bit ``i`` of ``dropout_bits_t``: the kept scale or 0 dropped."""
                return params[SCALE] if (bits >> uint32(i)) & uint32(1) else float32(0)

        else:

            @register_jitable
            def dropout_factor(row, key, params, head_ctx):
                return float32(1)

            @register_jitable
            def dropout_words(row, key, params, head_ctx):
                return uint32(0), uint32(0), uint32(0), uint32(0)

            @register_jitable
            def keep_or_zero(x, word, n, params):
                return x

            @register_jitable
            def byte_factor(word, n, params):
                return float32(1)

            @register_jitable
            def dropout_scale(params):
                return float32(1)

            @register_jitable
            def dropout_bits_t(query, key, params, head_ctx):
                return uint32(255)

            @register_jitable
            def dropout_bits_t_lanes(query, key, params, head_ctx):
                return uint32(255), uint32(255), uint32(255), uint32(255)

            @register_jitable
            def dropout_bit(bits, i, params):
                return float32(1)

        self.dropout_factor, self.dropout_words, self.byte_factor = dropout_factor, dropout_words, byte_factor
        self.keep_or_zero, self.dropout_scale = keep_or_zero, dropout_scale
        self.dropout_bits_t, self.dropout_bit = dropout_bits_t, dropout_bit
        self.dropout_bits_t_lanes = dropout_bits_t_lanes

    def tensor_core_score(self, positive_scale):
        """The tensor-core kernels' score point, on raw q.k (no scale applied):

        - ``units = score_units(params, scale, head_ctx)`` once per head; the score in base 2 is
          ``S * units[EXP] + units[OFFSET]`` (a positive factor, which the forward folds into its
          exp2 after the max; the offset, which the softmax does not see, goes into the lse), the
          rest are the features' constants in those units;
        - ``ctx = score_row(row, key, seqlen_q, seqlen_k, params, head_ctx, units)`` once per base
          (row, key) of a run of elements, and ``score_at(s, ctx, row_off, key_off, seqlen_q,
          seqlen_k, params, head_ctx, units)`` per element at (row + row_off, key + key_off), the
          offsets compile-time constants; ``score_at_grad`` returns (y, d score / d x) as
          ``score_grad`` does.

        The same scores as ``score`` (up to softcap's tanh, ``SOFTCAP_TANH``), with the scale folded
        into softcap's argument and ALiBi's slope, and ALiBi's distance a float per base. With
        ``positive_scale`` False, ALiBi alone stays in natural units (the scale's sign would
        flip the max).
        """
        if positive_scale not in self._tensor_core:
            self._tensor_core[positive_scale] = _tensor_core_score(self._variant, self._names, self._steps,
                                                                   positive_scale)
        return self._tensor_core[positive_scale]


@lru_cache(maxsize=None)
def hooks(variant):
    """The ``Hooks`` of ``variant`` (built once per variant)."""
    return Hooks(variant)
