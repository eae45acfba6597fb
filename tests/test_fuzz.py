"""Property-based fuzzing of the public functions against the float64 reference (hypothesis).

Each test draws a whole call: shapes (batch, lengths including 1 and the tile sizes +-1, GQA
ratios, head dims), layouts (transposed views, slices of larger arrays with spare heads and padded
rows, rows off the 16-byte grid), dtypes, kernel families, scales (0 and negative included) and
every variant (causal, windows, softcap, ALiBi, bias and mask tensors, score_mod / mask_mod,
block masks, dropout), and holds the result to the same checks as the hand-written tests, through their helpers
(tests/helpers.py, test_backward.py, test_varlen.py, test_kvcache.py): flash-attn's rule of at most
twice the error of a same-precision naive implementation against float64 (forward outputs also
allowed the half-ulp of storing the exact answer in their dtype, ``output_rounding``: a draw of a
dozen outputs can leave the naive path's largest one rounded almost exactly, as a longer run here
found: bf16, 16 outputs, the kernel within 1.2 ulp everywhere and failing the bare rule).

Poisoning: every buffer the library allocates starts as NaN (and ``out=`` of the KV-cache call is
a NaN-filled view into a larger NaN array), so an element left unwritten shows; the spare elements
around a sliced input are NaN too, so a kernel reading outside its view shows.

Two hypothesis profiles, chosen by ``NBFLASH_FUZZ_PROFILE``:

- ``ci`` (the default): a few examples per test, derandomized (the same examples every run, so CI
  is reproducible), no deadline, no example database. In the simulator the shapes are tiny and the
  tiles small (tests/helpers.py's ``small_tiles``), so lengths of 7-17 already cross tiles.
- ``gpu``: ``NBFLASH_FUZZ_EXAMPLES`` examples per test (default 2000), random, with the GPU's shapes
  (lengths across the production tiles) and every kernel family the GPU has; its static choices
  come from a few classes (``GPU_DENSE`` below), as each is a kernel to compile. Compile most of
  them ahead on all cores, then fuzz::

      python -m nbflash prebuild --headdims 40 64 128 --unaligned --variants plain causal softcap \
          causal-softcap alibi causal-alibi bias causal-bias document-mask
      NBFLASH_FUZZ_PROFILE=gpu pytest -m gpu tests/test_fuzz.py

  A failure prints the smallest failing call hypothesis found and a ``@reproduce_failure`` blob.
"""

import contextlib
import os
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption

import nbflash
from nbflash import configs, validation
from nbflash.dtypes import SUPPORTED

from .conftest import SIMULATOR
from .helpers import assert_attention_close, poison_allocations, small_tiles, to_numpy
from .test_backward import assert_gradients_close
from .test_kvcache import check_call
from .test_varlen import assert_varlen_backward, assert_varlen_forward, offsets

PROFILE = os.environ.get("NBFLASH_FUZZ_PROFILE", "ci")
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=4, deadline=None, derandomize=True, database=None,
                          suppress_health_check=_QUIET, print_blob=True)
settings.register_profile("gpu", max_examples=int(os.environ.get("NBFLASH_FUZZ_EXAMPLES", "2000")), deadline=None,
                          suppress_health_check=_QUIET, print_blob=True)
settings.load_profile(PROFILE)


def examples(ci):
    """``ci`` examples under the ci profile (what the simulator can afford per test); the loaded
    profile's count otherwise."""
    return settings(max_examples=ci) if PROFILE == "ci" else settings()


def _append(variable, text):
    path = os.environ.get(variable)
    if path:
        with open(path, "a") as log:
            log.write(text)


@contextlib.contextmanager
def logged(name, call):
    """One GPU example, logged as it ends. With ``NBFLASH_FUZZ_LOG``, a line ``name`` for each example
    that passed: hypothesis prints its statistics only when its test ends, so a process stopped by a
    time limit would leave its count unknown (scripts/gpu_check.sh fuzz counts these). With
    ``NBFLASH_FAILURES_LOG``, each failing call and its error, before hypothesis has shrunk it (each
    shrinking step that still fails adds one more): a limit that stops the shrinking, or the process,
    leaves the failing draw behind."""
    try:
        yield
    except UnsatisfiedAssumption:
        raise
    except Exception as error:
        _append("NBFLASH_FAILURES_LOG", f"---- {name} example failed: {call!r}\n{type(error).__name__}: {error}\n")
        raise
    _append("NBFLASH_FUZZ_LOG", name + "\n")


@pytest.fixture(scope="module", autouse=True)
def poisoned_small_tiles():
    """NaN-poisoned allocations for the whole module, and in the simulator small tiles."""
    with pytest.MonkeyPatch.context() as patch:
        poison_allocations(patch)
        if SIMULATOR:
            with small_tiles():
                yield
        else:
            yield


# ---------------------------------------------------------------------------------------------------
# Sizes: the simulator's (small tiles: 8 query rows portable, 16 x 16 tensor-core) and the GPU's
# ---------------------------------------------------------------------------------------------------

SIM = SimpleNamespace(
    batch=2, kv_heads=[1, 2], groups=[1, 2, 3], headdims=[1, 4, 5, 8, 16],
    boundaries=[1, 2, 7, 8, 9, 15, 16, 17], longest=20,
    decode_headdims=[8, 16, 5], decode_capacity=40, decode_queries=3,
    # The simulator's time grows with batch x heads x seqlen_q x seqlen_k: a draw above this is cut
    # down (batch, then heads, then lengths) before it runs. Keeps a whole test under ~10 s.
    work=300,
)
GPU = SimpleNamespace(
    batch=3, kv_heads=[1, 2], groups=[1, 2, 3, 4, 8],
    boundaries=[1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 113, 203, 1023, 1024], longest=1100,
    decode_capacity=4096, decode_queries=6,
    work=1 << 23,  # keeps the float64 reference (and so one example) well under a second
)
# On the GPU every static choice (dtype, head dim, variant features, aligned rows, the scale's sign,
# family) is a kernel to compile, 10-40 s for a tensor-core one: the GPU draws them from these
# classes and fuzzes everything else. (dtype, headdim, features, free): ``free`` classes also draw
# rows off the 16-byte grid, zero and negative scales, and every family. The dense and varlen
# classes reached about 30 forward and 80 backward kernels when the dense ones were the first seven
# (counted by planning them: 26 and 48 of them tensor-core), most of which the prebuild in the module
# docstring compiles ahead on all cores; the last four (dropout, a score_mod, block masks with their
# mask_mod) compile on first use.
GPU_DENSE = [
    ("float16", 64, "", True), ("bfloat16", 128, "", False), ("float32", 64, "", True),
    ("float16", 40, "softcap", False), ("bfloat16", 64, "alibi", False), ("float16", 128, "bias", False),
    ("bfloat16", 64, "mask", False), ("float16", 128, "dropout", False), ("bfloat16", 128, "score_mod", False),
    ("float16", 128, "block_mask", False), ("bfloat16", 64, "block_mask", False),
]
GPU_VARLEN = [("float16", 64, "", True), ("bfloat16", 128, "softcap", False), ("float32", 40, "", True)]
# (dtype, headdim, paged, rotary, features) of the KV-cache call; float32 takes the gathered route.
GPU_KVCACHE = [
    ("float16", 128, False, False, ""), ("bfloat16", 64, True, True, "softcap alibi"), ("float16", 64, True, False, ""),
    ("bfloat16", 128, False, True, ""), ("float32", 64, False, False, "softcap"),
]
DTYPES = ["float32", "float16", "bfloat16"]


def lengths(sizes, low=1):
    """A sequence length: a tile boundary +-1 most of the time, else anything up to ``longest``."""
    return st.one_of(st.sampled_from([n for n in sizes.boundaries if n >= low]), st.integers(low, sizes.longest))


SCALES = st.one_of(st.none(), st.sampled_from([0.0, -0.35, 1.0]), st.floats(-1.5, 1.5, allow_nan=False, width=32))
POSITIVE_SCALES = st.one_of(st.none(), st.floats(0.0625, 1.5, width=32))


def windows(longest):
    side = st.one_of(st.just(-1), st.integers(0, 3), st.integers(0, longest))
    return st.one_of(st.just((-1, -1)), st.tuples(side, side))


# Layouts of an input: how its (batch, seqlen, heads, headdim) values are handed over. The first
# three keep every row on the 16-byte grid (the tensor-core kernels then copy with cp.async).
ALIGNED_LAYOUTS = ["contiguous", "heads_first", "sliced"]
LAYOUTS = ALIGNED_LAYOUTS + ["sliced_odd", "unaligned"]


def laid_out(values, layout, xp):
    """``values`` (NumPy, 3 or 4 dims, heads and headdim last) as a view of ``layout`` on the
    backend; the elements around a sliced view are NaN. ``sliced``: every other row of the leading
    dim, a spare head, rows padded by 16 elements; ``sliced_odd``: padded by 3 (row strides off the
    16-byte grid); ``unaligned``: rows start one element past it."""
    if layout == "heads_first" and values.ndim == 4:  # stored (batch, heads, seqlen, headdim)
        return xp.asarray(np.ascontiguousarray(values.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    if layout in ("sliced", "sliced_odd"):
        pad = 16 if layout == "sliced" else 3
        shape = (2 * values.shape[0],) + values.shape[1:-2] + (values.shape[-2] + 1, values.shape[-1] + pad)
        whole = xp.asarray(np.full(shape, np.nan, values.dtype))
        view = whole[::2, ..., 1:, : values.shape[-1]]
    elif layout == "unaligned":
        whole = xp.asarray(np.full(values.shape[:-1] + (values.shape[-1] + 1,), np.nan, values.dtype))
        view = whole[..., 1:]
    else:
        return xp.asarray(values)
    view[...] = xp.asarray(values)
    return view


def draw_values(rng, shape, dtype):
    return rng.standard_normal(shape, dtype=np.float32).astype(SUPPORTED[dtype])


@st.composite
def statics(draw, sizes, gpu_classes, families=True):
    """(dtype, headdim, features, layouts, scales, families) of a call: free in the simulator (no
    compiling), from ``gpu_classes`` on the GPU. ``features`` None: draw them freely."""
    if sizes is SIM:
        dtype = draw(st.sampled_from(DTYPES))
        family = ["portable"] + (["mma"] if dtype != "float32" else [])
        return dtype, draw(st.sampled_from(sizes.headdims)), None, LAYOUTS, SCALES, family
    dtype, headdim, features, free = draw(st.sampled_from(gpu_classes))
    family = [None] + (["portable", "mma", "sm90"] if free and dtype != "float32" and families else [])
    return (dtype, headdim, features, LAYOUTS if free else ALIGNED_LAYOUTS, SCALES if free else POSITIVE_SCALES,
            family)


# User functions the fuzz may compile into the kernels (module level: one fingerprint, one compile).
def score_shift(score, b, h, q_idx, kv_idx):
    return score + 0.25 * (h - 1) - 0.05 * (q_idx - kv_idx)


def score_shift_grad(score, b, h, q_idx, kv_idx):
    return 1.0


def mask_stripes(b, h, q_idx, kv_idx):
    return (q_idx + 2 * kv_idx + h) % 3 != 0


def mask_documents(b, h, q_idx, kv_idx):
    """Runs of 13 positions (a document each; one more per head) over a causal band: given with its
    block mask, whole tile pairs are empty (skipped) or full (no test), rows past the last shared
    document see no key."""
    return (q_idx // (13 + h) == kv_idx // (13 + h)) & (kv_idx <= q_idx + 2)


# ---------------------------------------------------------------------------------------------------
# flash_attn_func and flash_attn_backward
# ---------------------------------------------------------------------------------------------------


@st.composite
def dense_calls(draw, sizes, classes=None):
    """A flash_attn_func call: its shapes, layouts, family and variant arguments, and a seed for
    the values (on the GPU, of one of ``classes``, by default GPU_DENSE)."""
    dtype, headdim, features, layouts, scales, families = draw(statics(sizes, classes or GPU_DENSE))
    nheads_k = draw(st.sampled_from(sizes.kv_heads))
    call = dict(
        dtype=dtype, family=draw(st.sampled_from(families)), batch=draw(st.integers(1, sizes.batch)),
        seqlen_q=draw(lengths(sizes)), seqlen_k=draw(lengths(sizes)),
        nheads=nheads_k * draw(st.sampled_from(sizes.groups)), nheads_k=nheads_k, headdim=headdim,
        layouts=draw(st.lists(st.sampled_from(layouts), min_size=4, max_size=4)),  # q, k, v, dout
        softmax_scale=draw(scales), causal=draw(st.booleans()), window_size=draw(windows(sizes.longest)),
        values=draw(st.integers(0, 2**32 - 1)),
    )
    if features is None:
        call.update(softcap=draw(st.sampled_from([0.0, 0.0, 0.8, 6.0])),
                    alibi=draw(st.sampled_from([None, None, "heads", "batch"])),
                    bias=draw(st.sampled_from([None, None, None, "float32", "dtype", "mask"])),
                    user=draw(st.sampled_from([None, None, None, "score_mod", "mask_mod", "block_mask"])),
                    dropout_p=draw(st.sampled_from([0.0, 0.0, 0.0, 0.3])))
    else:
        call.update(softcap=draw(st.floats(0.5, 30.0)) if "softcap" in features else 0.0,
                    alibi=draw(st.sampled_from(["heads", "batch"])) if "alibi" in features else None,
                    bias="float32" if features == "bias" else "mask" if features == "mask" else None,
                    user=features if features in ("score_mod", "block_mask") else None,
                    dropout_p=0.3 if features == "dropout" else 0.0)
    return within_budget(call, sizes)


def within_budget(call, sizes, lengths=("seqlen_q", "seqlen_k")):
    """``call`` cut down to ``sizes.work`` query-key pairs (times batch and heads): batch 1 first,
    then one key/value head (the group ratio kept), then halved lengths (each at least 1; a packed
    batch's lengths all halved)."""
    def rows(name):
        value = call[name]
        return value if isinstance(value, int) else max(sum(value), 1)

    def work():
        return call.get("batch", 1) * call["nheads"] * rows(lengths[0]) * rows(lengths[1])

    while sizes.work is not None and work() > sizes.work:
        if call.get("batch", 1) > 1:
            call["batch"] = 1
        elif call["nheads_k"] > 1:
            call["nheads"], call["nheads_k"] = call["nheads"] // call["nheads_k"], 1
        else:
            for n in lengths:
                value = call[n]
                call[n] = max(1, value // 2) if isinstance(value, int) else [x // 2 for x in value]
    return call


def dense_arguments(call, xp):
    """(q, k, v, dout, keyword arguments of flash_attn_func) for a drawn call."""
    rng = np.random.default_rng(call["values"])
    b, sq, sk, h, hk, d = (call[n] for n in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "headdim"))
    shapes = [(b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d)]
    q, k, v, dout = (laid_out(draw_values(rng, shape, call["dtype"]), layout, xp)
                     for shape, layout in zip(shapes, call["layouts"]))
    kwargs = dict(softmax_scale=call["softmax_scale"], causal=call["causal"], window_size=call["window_size"],
                  softcap=call["softcap"])
    if call["alibi"]:
        shape = (h,) if call["alibi"] == "heads" else (b, h)
        kwargs["alibi_slopes"] = xp.asarray(rng.uniform(0.0, 1.0, shape).astype(np.float32))
    if call["bias"] == "mask":  # True = kept; some rows then see no key
        shape = [(sq, sk), (b, 1, sq, sk), (b, h, sq, sk)][rng.integers(3)]
        kwargs["bias"] = xp.asarray(rng.random(shape) < 0.7)
    elif call["bias"]:
        shape = [(sk,), (sq, sk), (b, 1, sq, sk), (1, h, 1, sk)][rng.integers(4)]
        kind = "float32" if call["bias"] == "float32" else call["dtype"]
        kwargs["bias"] = xp.asarray(rng.standard_normal(shape).astype(SUPPORTED[kind]))
    if call["user"] == "score_mod":
        kwargs["score_mod"] = score_shift
    elif call["user"] == "mask_mod":
        kwargs["mask_mod"] = mask_stripes
    elif call["user"] == "block_mask":  # per head, or shared by every batch row and head
        shared = bool(rng.integers(2))
        kwargs["mask_mod"] = mask_documents
        kwargs["block_mask"] = nbflash.create_block_mask(mask_documents, None if shared else b, None if shared else h,
                                                         sq, sk)
    if call["dropout_p"]:
        kwargs.update(dropout_p=call["dropout_p"], seed=int(rng.integers(2**63)))
    return q, k, v, dout, kwargs


def _assume_family_serves(call, q, k, v, kwargs):
    """Reject (not fail) a draw whose forced family cannot serve it: sm90's narrower scope, or a GPU
    without it."""
    if call["family"] != "sm90":
        return
    problem = validation.check_forward(q, k, v, kwargs["softmax_scale"], kwargs["causal"], kwargs["window_size"],
                                       kwargs["softcap"], kwargs.get("alibi_slopes"), kwargs.get("bias"),
                                       kwargs.get("score_mod"), kwargs.get("mask_mod"), None,
                                       kwargs.get("dropout_p", 0.0), kwargs.get("seed"),
                                       block_mask=kwargs.get("block_mask"))[0]
    assume(configs.sm90_unsupported_reason(problem.static) is None)


def family(name):
    """The forced family's block, or none: None is the library's own choice."""
    return nbflash.kernel_family(name) if name else contextlib.nullcontext()


def _reference_variant(kwargs):
    """The keyword arguments of the float64 reference for a call's (a block mask's mask_mod is
    given beside it)."""
    return {name: value for name, value in kwargs.items() if name not in ("softmax_scale", "causal", "block_mask")}


def run_dense_forward(call, xp):
    q, k, v, _, kwargs = dense_arguments(call, xp)
    _assume_family_serves(call, q, k, v, kwargs)
    with family(call["family"]):
        out, lse = nbflash.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    assert_attention_close(out, lse, q, k, v, kwargs["causal"], kwargs["softmax_scale"], output_rounding=True,
                           **_reference_variant(kwargs))
    return q, k, v, out, lse, kwargs


@pytest.mark.skipif(not SIMULATOR, reason="the GPU half is test_gpu_fuzz_forward")
@examples(ci=8)
@given(call=dense_calls(SIM))
def test_fuzz_forward(xp, call):
    run_dense_forward(call, xp)


@pytest.mark.gpu
@given(call=dense_calls(GPU))
def test_gpu_fuzz_forward(xp, call):
    with logged("forward", call):
        run_dense_forward(call, xp)


def run_dense_backward(call, xp, deterministic):
    q, k, v, dout, kwargs = dense_arguments(call, xp)
    if call["user"] == "score_mod":
        kwargs["score_mod_grad"] = score_shift_grad
    forward = {n: x for n, x in kwargs.items() if n != "score_mod_grad"}
    _assume_family_serves(call, q, k, v, forward)
    with family(call["family"]):
        out, lse = nbflash.flash_attn_func(q, k, v, return_lse=True, **forward)
        grads = nbflash.flash_attn_backward(dout, q, k, v, out, lse, deterministic=deterministic, **kwargs)
    assert_gradients_close(grads, dout, q, k, v, kwargs["causal"], kwargs["softmax_scale"],
                           **_reference_variant(kwargs))


@pytest.mark.skipif(not SIMULATOR, reason="the GPU half is test_gpu_fuzz_backward")
@examples(ci=4)
@given(call=dense_calls(SIM), deterministic=st.booleans())
def test_fuzz_backward(xp, call, deterministic):
    run_dense_backward(call, xp, deterministic)


@pytest.mark.gpu
@given(call=dense_calls(GPU), deterministic=st.booleans())
def test_gpu_fuzz_backward(xp, call, deterministic):
    with logged("backward", dict(call, deterministic=deterministic)):
        run_dense_backward(call, xp, deterministic)


# ---------------------------------------------------------------------------------------------------
# flash_attn_varlen_func and its backward
# ---------------------------------------------------------------------------------------------------


@st.composite
def varlen_calls(draw, sizes):
    dtype, headdim, features, layouts, scales, families = draw(statics(sizes, GPU_VARLEN, families=False))
    batch = draw(st.integers(1, sizes.batch + 1))
    lengths_q = draw(st.lists(lengths(sizes, low=0), min_size=batch, max_size=batch).filter(lambda x: sum(x) > 0))
    lengths_k = draw(st.lists(lengths(sizes, low=0), min_size=batch, max_size=batch).filter(lambda x: sum(x) > 0))
    nheads_k = draw(st.sampled_from(sizes.kv_heads))
    call = dict(
        dtype=dtype, family=draw(st.sampled_from(families)), lengths_q=lengths_q, lengths_k=lengths_k,
        spare=draw(st.sampled_from([(0, 0), (0, 0), (3, 1)])),  # max_seqlen beyond the longest
        nheads=nheads_k * draw(st.sampled_from(sizes.groups)), nheads_k=nheads_k, headdim=headdim,
        layouts=draw(st.lists(st.sampled_from([x for x in layouts if x != "heads_first"]), min_size=4, max_size=4)),
        softmax_scale=draw(scales), causal=draw(st.booleans()), window_size=draw(windows(sizes.longest)),
        backward=draw(st.booleans()), deterministic=draw(st.booleans()), values=draw(st.integers(0, 2**32 - 1)),
    )
    if features is None:
        call.update(softcap=draw(st.sampled_from([0.0, 0.0, 2.0])),
                    alibi=draw(st.sampled_from([None, None, "heads", "batch"])),
                    dropout_p=draw(st.sampled_from([0.0, 0.0, 0.0, 0.25])))
    else:
        call.update(softcap=draw(st.floats(0.5, 30.0)) if "softcap" in features else 0.0,
                    alibi=draw(st.sampled_from(["heads", "batch"])) if "alibi" in features else None, dropout_p=0.0)
    call = within_budget(call, sizes, ("lengths_q", "lengths_k"))
    if sum(call["lengths_q"]) == 0 or sum(call["lengths_k"]) == 0:  # halving emptied one: keep a row
        call["lengths_q"][0], call["lengths_k"][0] = max(call["lengths_q"][0], 1), max(call["lengths_k"][0], 1)
    return call


def run_varlen(call, xp):
    rng = np.random.default_rng(call["values"])
    lq, lk, h, hk, d = (call[n] for n in ("lengths_q", "lengths_k", "nheads", "nheads_k", "headdim"))
    shapes = [(sum(lq), h, d), (sum(lk), hk, d), (sum(lk), hk, d), (sum(lq), h, d)]
    q, k, v, dout = (laid_out(draw_values(rng, shape, call["dtype"]), layout, xp)
                     for shape, layout in zip(shapes, call["layouts"]))
    cu_q, cu_k = offsets(lq, xp), offsets(lk, xp)
    args = (cu_q, cu_k, max(lq) + call["spare"][0], max(lk) + call["spare"][1])  # max_seqlen: at least the longest
    variant = dict(softmax_scale=call["softmax_scale"], window_size=call["window_size"], softcap=call["softcap"])
    if call["alibi"]:
        shape = (h,) if call["alibi"] == "heads" else (len(lq), h)
        variant["alibi_slopes"] = xp.asarray(rng.uniform(0.0, 1.0, shape).astype(np.float32))
    if call["dropout_p"]:
        variant.update(dropout_p=call["dropout_p"], seed=int(rng.integers(2**63)))
    with family(call["family"]):
        out, lse = nbflash.flash_attn_varlen_func(q, k, v, *args, causal=call["causal"], return_lse=True, **variant)
    assert_varlen_forward(out, lse, q, k, v, cu_q, cu_k, call["causal"], output_rounding=True, **variant)
    if call["backward"]:
        with family(call["family"]):
            grads = nbflash.flash_attn_varlen_backward(dout, q, k, v, out, lse, *args, causal=call["causal"],
                                                       deterministic=call["deterministic"], **variant)
        assert_varlen_backward(grads, to_numpy(dout), q, k, v, cu_q, cu_k, call["causal"], **variant)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU half is test_gpu_fuzz_varlen")
@examples(ci=3)
@given(call=varlen_calls(SIM))
def test_fuzz_varlen(xp, call):
    run_varlen(call, xp)


@pytest.mark.gpu
@given(call=varlen_calls(GPU))
def test_gpu_fuzz_varlen(xp, call):
    with logged("varlen", call):
        run_varlen(call, xp)


# ---------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache (through test_kvcache.check_call: caches, guards and outputs checked)
# ---------------------------------------------------------------------------------------------------


@st.composite
def kvcache_calls(draw, sizes):
    if sizes is SIM:
        dtype = draw(st.sampled_from(["float16", "bfloat16", "float32"]))
        headdim = draw(st.sampled_from(sizes.decode_headdims))
        paged, rotary, features = draw(st.booleans()), draw(st.booleans()), None
    else:
        dtype, headdim, paged, rotary, features = draw(st.sampled_from(GPU_KVCACHE))
    batch = draw(st.integers(1, sizes.batch))
    capacity = draw(st.integers(1, sizes.decode_capacity))
    seqlen_new = draw(st.sampled_from([0, 0, 1, 2]).filter(lambda n: n <= capacity))
    if rotary:
        seqlen_new = max(seqlen_new, 1) if capacity > 1 else 0  # rotary rotates new keys
    lengths = draw(st.lists(st.integers(0, capacity - seqlen_new), min_size=batch, max_size=batch))
    nheads_k = draw(st.sampled_from(sizes.kv_heads))
    layout = dict(seqlen_new=seqlen_new)
    if paged:
        layout["page_size"] = draw(st.sampled_from([1, 3, 4, 16, capacity]))
    elif draw(st.booleans()):
        layout["batch_idx"] = True
    seqlen_q = draw(st.integers(1, sizes.decode_queries))
    if rotary and seqlen_new:
        layout["rotary_dim"] = 2 * draw(st.integers(1, max(1, headdim // 2)))
        # At most as many queries as new tokens (flash-attn's use): a query past the last key would
        # be rotated at a position past the table, which the library clamps to the table's last row
        # and the reference refuses.
        seqlen_q = min(seqlen_q, seqlen_new)
    if draw(st.booleans()):
        layout["leftpad"] = [draw(st.integers(0, n)) for n in lengths]
    softcap = draw(st.sampled_from([0.0, 0.0, 3.0])) if features is None else 3.0 if "softcap" in features else 0.0
    return dict(
        dtype=dtype, batch=batch, seqlen_q=seqlen_q,
        nheads=nheads_k * draw(st.sampled_from([1, 2, 4])), nheads_k=nheads_k, headdim=headdim,
        lengths=lengths, capacity=capacity, causal=draw(st.booleans()), window_size=draw(windows(capacity)),
        softcap=softcap, alibi=draw(st.booleans()) if features is None else "alibi" in features,
        num_splits=draw(st.sampled_from([0, 1, 2, 3])), rotary_interleaved=draw(st.booleans()), layout=layout,
        values=draw(st.integers(0, 2**32 - 1)),
    )


def _into_poisoned_out(real, xp):
    """flash_attn_with_kvcache with ``out=`` a NaN-filled view (a spare column) of a larger NaN
    array: every element of out must be written, nothing around it, and out itself returned."""

    def call(q, *args, **kwargs):
        whole = xp.full(tuple(q.shape[:3]) + (q.shape[3] + 1,), np.nan, q.dtype)
        out = whole[..., : q.shape[3]]
        result = real(q, *args, out=out, **kwargs)
        assert (result[0] if isinstance(result, tuple) else result) is out
        assert np.isnan(to_numpy(whole[..., -1]).astype(np.float32)).all(), "written outside out"
        return result

    return call


def run_kvcache(call, xp):
    rng = np.random.default_rng(call["values"])
    args = [call[n] for n in ("dtype", "batch", "seqlen_q", "nheads", "nheads_k", "headdim", "lengths", "capacity")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nbflash, "flash_attn_with_kvcache", _into_poisoned_out(nbflash.flash_attn_with_kvcache, xp))
        check_call(rng, xp, *args, causal=call["causal"], window_size=call["window_size"], softcap=call["softcap"],
                   alibi=call["alibi"], num_splits=call["num_splits"], rotary_interleaved=call["rotary_interleaved"],
                   **call["layout"])


@pytest.mark.skipif(not SIMULATOR, reason="the GPU half is test_gpu_fuzz_kvcache")
@examples(ci=3)
@given(call=kvcache_calls(SIM))
def test_fuzz_kvcache(xp, call):
    run_kvcache(call, xp)


@pytest.mark.gpu
@given(call=kvcache_calls(GPU))
def test_gpu_fuzz_kvcache(xp, call):
    with logged("kvcache", call):
        run_kvcache(call, xp)


# ---------------------------------------------------------------------------------------------------
# The fuzz itself: its draws reach what they claim, and its checks can fail
# ---------------------------------------------------------------------------------------------------


def test_layouts_hold_the_values_and_poison_around_them(xp):
    values = draw_values(np.random.default_rng(0), (2, 3, 2, 5), "float16")
    for layout in LAYOUTS:
        view = laid_out(values, layout, xp)
        assert view.shape == values.shape and np.array_equal(to_numpy(view), values), layout
        assert view.strides[-1] == view.itemsize, layout
    assert not validation.rows_aligned(laid_out(values, "unaligned", xp))
    assert laid_out(values, "heads_first", xp).strides[1] < laid_out(values, "heads_first", xp).strides[2]
    sliced = laid_out(values, "sliced", xp)
    base = sliced.base if sliced.base is not None else sliced
    assert np.isnan(to_numpy(base).astype(np.float32)).sum() == to_numpy(base).size - values.size


def test_a_wrong_kernel_fails_the_fuzz(xp, monkeypatch):
    """The fuzz's checks catch a kernel whose softmax scale is off by 1%: the same draw that
    passes fails once the forward launches with a scale of 1.01x."""
    from nbflash import interface

    call = dict(dtype="float32", family="portable", batch=1, seqlen_q=3, seqlen_k=5, nheads=1, nheads_k=1,
                headdim=4, layouts=["contiguous"] * 4, softmax_scale=1.0, causal=False, window_size=(-1, -1),
                softcap=0.0, alibi=None, bias=None, user=None, dropout_p=0.0, values=7)
    run_dense_forward(call, xp)
    real = interface._flash_attn_forward

    def off_scale(problem, *arrays, **kwargs):
        return real(problem._replace(softmax_scale=problem.softmax_scale * 1.01), *arrays, **kwargs)

    monkeypatch.setattr(interface, "_flash_attn_forward", off_scale)
    with pytest.raises(AssertionError, match="max error"):
        run_dense_forward(call, xp)


def assert_valid_dense(dense):
    """A drawn dense call passes validation (score_mod, mask_mod and a block mask included)."""
    q, k, v, dout, kwargs = dense_arguments(dense, np)
    kwargs = {n: x for n, x in kwargs.items() if n not in ("causal", "softmax_scale")}
    validation.check_forward(q, k, v, dense["softmax_scale"], dense["causal"], kwargs.get("window_size"),
                             kwargs.get("softcap"), kwargs.get("alibi_slopes"), kwargs.get("bias"),
                             score_mod=kwargs.get("score_mod"), mask_mod=kwargs.get("mask_mod"),
                             dropout_p=kwargs.get("dropout_p", 0.0), seed=kwargs.get("seed"),
                             block_mask=kwargs.get("block_mask"))
    return kwargs


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs these draws")
@pytest.mark.parametrize("index", range(len(GPU_DENSE)))
@examples(ci=2)
@given(data=st.data())
def test_every_gpu_dense_class_draws_valid_calls(index, data):
    """Each of the GPU's dense classes (a derandomized draw over all of them reaches only the first
    few) gives calls validation accepts, with the feature the class names."""
    dtype, headdim, features, _ = GPU_DENSE[index]
    dense = data.draw(dense_calls(GPU, [GPU_DENSE[index]]))
    kwargs = assert_valid_dense(dense)
    assert (dense["dtype"], dense["headdim"]) == (dtype, headdim)
    named = {"softcap": "softcap", "alibi": "alibi_slopes", "bias": "bias", "mask": "bias", "dropout": "dropout_p",
             "score_mod": "score_mod", "block_mask": "block_mask"}
    for feature in features.split():
        assert kwargs.get(named[feature]) is not None, feature


@pytest.mark.skipif(not SIMULATOR, reason="the GPU runs these draws")
@examples(ci=15)
@given(dense=dense_calls(GPU), packed=varlen_calls(GPU), decode=kvcache_calls(GPU))
def test_gpu_draws_are_valid_calls(dense, packed, decode):
    """The GPU's draws, checked here without running a kernel: validation accepts each (a draw the
    library refuses would fail the GPU fuzz for the wrong reason)."""
    from nbflash import kvcache
    from .test_kvcache import make_case

    assert_valid_dense(dense)
    lq, lk = packed["lengths_q"], packed["lengths_k"]
    q = np.zeros((sum(lq), packed["nheads"], packed["headdim"]), SUPPORTED[packed["dtype"]])
    k = np.zeros((sum(lk), packed["nheads_k"], packed["headdim"]), q.dtype)
    validation.check_varlen(q, k, k, offsets(lq, np), offsets(lk, np), max(lq) + packed["spare"][0],
                            max(lk) + packed["spare"][1], packed["softmax_scale"], packed["causal"],
                            packed["window_size"], packed["softcap"], None, 0.0, None, check_seqlens=True)
    rng = np.random.default_rng(0)
    args = [decode[n] for n in ("dtype", "batch", "seqlen_q", "nheads", "nheads_k", "headdim", "lengths", "capacity")]
    q, _, k_cache, _, v_cache, extra = make_case(rng, np, *args, **decode["layout"])
    kvcache._check(q, k_cache, v_cache, extra.get("k"), extra.get("v"), extra.get("rotary_cos"),
                   extra.get("rotary_sin"), extra["cache_seqlens"], extra.get("cache_batch_idx"),
                   extra.get("cache_leftpad"), extra.get("block_table"), None, decode["causal"],
                   decode["window_size"], decode["softcap"], decode["rotary_interleaved"], None,
                   decode["num_splits"], True, None)


def test_profiles():
    ci = settings.get_profile("ci")
    assert ci.derandomize and ci.deadline is None and ci.database is None
    assert settings.get_profile("gpu").max_examples >= 2000 or "NBFLASH_FUZZ_EXAMPLES" in os.environ


def test_examples_are_logged_as_they_end(tmp_path, monkeypatch):
    """The GPU fuzz's count survives a time limit: each passing example is a line of NBFLASH_FUZZ_LOG,
    each failing one its call and error in NBFLASH_FAILURES_LOG, written as they end (the failure
    raised on; a rejected draw, hypothesis's assume, neither); without the variables nothing is
    written."""
    passes, failures = tmp_path / "passed.log", tmp_path / "failures.log"
    monkeypatch.setenv("NBFLASH_FUZZ_LOG", str(passes))
    monkeypatch.setenv("NBFLASH_FAILURES_LOG", str(failures))
    for name in ("forward", "forward", "varlen"):
        with logged(name, {"seqlen_q": 1}):
            pass
    with pytest.raises(AssertionError), logged("varlen", {"lengths_q": [0, 65]}):
        raise AssertionError("out: max error 0.5")
    with pytest.raises(UnsatisfiedAssumption), logged("forward", {}):
        raise UnsatisfiedAssumption()
    assert passes.read_text().splitlines() == ["forward", "forward", "varlen"]
    assert failures.read_text() == "---- varlen example failed: {'lengths_q': [0, 65]}\nAssertionError: out: max error 0.5\n"
    monkeypatch.delenv("NBFLASH_FUZZ_LOG")
    monkeypatch.delenv("NBFLASH_FAILURES_LOG")
    with logged("forward", {}):
        pass
    assert passes.read_text().splitlines() == ["forward", "forward", "varlen"]


def test_failures_are_logged_as_they_fail(tmp_path, monkeypatch):
    """A failing example survives a time limit too: with NBFLASH_FAILURES_LOG each failed report
    (hypothesis's falsifying example inside) is appended as it fails, once (not by xdist's workers,
    whose reports the controller writes), and passing reports are not."""
    from .conftest import pytest_runtest_logreport

    def report(outcome, text, when="call"):
        return SimpleNamespace(failed=outcome == "failed", outcome=outcome, when=when, duration=0.0,
                               nodeid="tests/test_fuzz.py::test_gpu_fuzz_varlen", longreprtext=text)

    log = tmp_path / "failures.log"
    monkeypatch.setenv("NBFLASH_FAILURES_LOG", str(log))
    monkeypatch.delenv("NBFLASH_DURATIONS_LOG", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytest_runtest_logreport(report("passed", ""))
    pytest_runtest_logreport(report("failed", "Falsifying example: run_varlen(call={'lengths_q': [0, 65]})"))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    pytest_runtest_logreport(report("failed", "the same report, from a worker"))
    text = log.read_text()
    assert text.count("====") == 1 and "call tests/test_fuzz.py::test_gpu_fuzz_varlen" in text
    assert "Falsifying example: run_varlen" in text and "worker" not in text
