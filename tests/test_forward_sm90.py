"""The Hopper forward kernel (nbflash/kernels/forward_sm90.py) against a float64 NumPy reference.

Without a GPU these run in Numba's simulator, where wgmma, TMA and the mbarriers are emulated
(nbflash/primitives_sm90.py): tiny shapes, one or two consumer warpgroups, a K/V ring that wraps.
On a GPU of compute capability 9.0 the same checks run on the hardware, plus a larger grid (awkward
lengths, GQA, causal with seqlen_q != seqlen_k, headdims 64, 96, 128) and the public API on the
"sm90" family. Outputs are poisoned with NaN before each launch, so an unwritten element fails; the
tolerance is flash-attn's rule, twice the error of a naive same-precision implementation.

The fp8 (e4m3) forward with descales (flash_attn_func's q_descale, k_descale, v_descale) is checked
the same way against the float64 attention of the dequantized inputs, in the simulator (two tiny
cases, on float8_e4m3fn NumPy arrays, and the uint8 + fp8_dtype route against them bit for bit)
and, marked gpu, on a grid that has not passed yet; there lse has a per-row allowance for the fp8
wgmma's reduced-precision accumulation (FP8_ACCUMULATION_ERROR). On a GPU every fp8 test uploads the
e4m3 bytes as uint8 CuPy arrays with fp8_dtype="float8_e4m3fn" (fp8_inputs): CuPy has no float8 dtype.
"""

import math

import numpy as np
import pytest
from numba import cuda, uint16, uint64

from nbflash import primitives as P
from nbflash import primitives_sm90 as H
from nbflash import launch
from nbflash.kernels.forward_sm90 import Sm90ForwardConfig
from nbflash.problem import Variant, window_bounds
from nbflash.reference import visible

from .helpers import is_sm90, kernel_reference as reference

ml_dtypes = pytest.importorskip("ml_dtypes")

NP_DTYPE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
PLAIN, WINDOW = Variant(), Variant(window=True)
CAUSAL = (-1, 0)



pytestmark = pytest.mark.skipif(not P.SIMULATOR and not is_sm90(),
                                reason="sm_90a instructions run only on compute capability 9.0")


def run_kernel(config, q, k, v, scale, window, xp, softcap=0.0, alibi_slopes=None):
    """Launch the kernel through nbflash's launcher (which makes the tensor maps and raises the
    shared-memory limit) on (batch, seqlen, heads, headdim) host arrays; returns out and lse (host).
    ``alibi_slopes``: float32 (nheads,) (handed over as a stride-0 view over batch, as validation
    does) or (batch, nheads)."""
    bits = config.dtype == "bfloat16"
    dev = [xp.asarray(x.view(np.uint16) if bits else x) for x in (q, k, v)]
    batch, seqlen_q, nheads, _ = q.shape
    out = xp.asarray(np.full(q.shape, 0x7FC0 if bits else 0x7E00, dtype=np.uint16))  # NaN
    if not bits:
        out = out.view(np.float16)
    lse = xp.full((batch, nheads, seqlen_q), np.nan, dtype=np.float32)
    values = {"softcap": np.float32(softcap)}
    if alibi_slopes is not None:
        values["alibi_slopes"] = xp.broadcast_to(xp.asarray(alibi_slopes, dtype=np.float32), (batch, nheads))
    if config.variant.window:
        bounds = window_bounds(seqlen_q, k.shape[1], False, window)[:2]
        values["window_left"], values["window_right"] = (np.int32(x) for x in bounds)
    params = tuple(values[name] for name in config.variant.param_names())
    launch.compiled(config).launch(config.grid(batch, nheads, seqlen_q), (*dev, out, lse),
                                   (np.float32(scale * math.log2(math.e)),), params)
    get = (lambda x: x.get()) if hasattr(out, "get") else (lambda x: x)
    out, lse = get(out), get(lse)
    return (out.view(ml_dtypes.bfloat16) if bits else out), lse


def check(config, xp, batch=1, seqlen_q=20, seqlen_k=33, nheads=2, nheads_k=1, seed=0, window=CAUSAL,
          heads_first=False, scale=None):
    window = window if config.variant.window else None
    rng = np.random.default_rng(seed)
    D, dt = config.headdim, NP_DTYPE[config.dtype]

    def draw(seqlen, heads):
        if heads_first:  # stored (batch, heads, seqlen, headdim), handed over as a transposed view
            x = rng.standard_normal((batch, heads, seqlen, D)).astype(dt)
            return np.ascontiguousarray(x).transpose(0, 2, 1, 3)
        return rng.standard_normal((batch, seqlen, heads, D)).astype(dt)

    q, k, v = draw(seqlen_q, nheads), draw(seqlen_k, nheads_k), draw(seqlen_k, nheads_k)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out, lse = run_kernel(config, q, k, v, scale, window, xp)
    ref, ref_lse = reference(q, k, v, scale, window)
    naive, _ = reference(q, k, v, scale, window, p_dtype=dt)
    out64 = out.astype(np.float64)
    assert not np.isnan(out64).any(), "out has NaN (an element left unwritten, or a 0/0)"
    err = np.abs(out64 - ref).max()
    naive_err = np.abs(naive.astype(dt).astype(np.float64) - ref).max()
    assert err <= 2 * naive_err + 1e-3, f"max error {err:.3g}, naive {naive_err:.3g}"
    assert not np.isnan(lse).any()
    no_key = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), no_key), "lse = -inf exactly where a row sees no key"
    assert (out64.transpose(0, 2, 1, 3)[no_key] == 0).all(), "rows that see no key must be 0"
    finite = ~no_key
    assert np.allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


# --- The simulator: tiny shapes (each launch of 256 or 384 Python threads takes seconds) -----------

SMALL = dict(block_n=64, consumers=1)


@pytest.mark.parametrize("dtype", ["float16"])  # bfloat16: test_two_consumers_padded_headdim
def test_ring_wraps(dtype, xp):
    # 3 key tiles through a 2-stage ring: the producer waits on an empty barrier; the tail is masked.
    check(Sm90ForwardConfig(dtype, 64, PLAIN, **SMALL), xp, seqlen_q=9, seqlen_k=150, nheads=1)


def test_causal_gqa_two_blocks(xp):
    # seqlen_q > seqlen_k: the first rows see no key (out 0, lse -inf); 2 query blocks, GQA 2:1.
    check(Sm90ForwardConfig("float16", 64, WINDOW, **SMALL), xp, seqlen_q=72, seqlen_k=40, nheads=2, nheads_k=1)


@pytest.mark.parametrize("window", [False, True])
def test_overlapped(window, xp):
    # The overlapped consumer loop (S_{j+1} issued with P_j V_j): 3 key tiles through 2 stages; with
    # the window, 2 query blocks of which the first has rows without keys.
    config = Sm90ForwardConfig("float16", 64, WINDOW if window else PLAIN, overlap=True, **SMALL)
    check(config, xp, seqlen_q=70 if window else 9, seqlen_k=150, nheads=1 if window else 2, nheads_k=1)


@pytest.mark.parametrize("overlap, slack, scale", [(False, 1.0, 1.0), (True, 8.0, 0.125)])
def test_lazy_rescale(overlap, slack, scale, xp):
    """rescale_slack, in the plain and the overlapped consumer loops: at scale 1 the scores spread
    over about +-35 powers of 2, so the maxima must move (a kernel that never moved them overflows
    P), at scale 1/8 they mostly stay; causal, two query blocks, 3 key tiles, rows without keys."""
    config = Sm90ForwardConfig("float16", 64, WINDOW, overlap=overlap, rescale_slack=slack, **SMALL)
    check(config, xp, seqlen_q=70, seqlen_k=150, nheads=1, nheads_k=1, scale=scale)


@pytest.mark.parametrize("groups", [3, 8])
def test_exp2_on_fma_pipes(groups, xp):
    # exp2_fma_groups: 3 of the 8 key groups of a row (spread out), then all 8, take P from the
    # polynomial exp2 instead of MUFU; causal, two query blocks, rows that see no key (their P must be
    # exactly 0 from exp2(-inf), or l > 0 and out becomes V's mean), 3 key tiles.
    config = Sm90ForwardConfig("float16", 64, WINDOW, exp2_fma_groups=groups, **SMALL)
    check(config, xp, seqlen_q=72, seqlen_k=150 if groups == 3 else 40, nheads=1, nheads_k=1)


def test_pingpong(xp):
    # Two consumers taking turns (named barriers) in the overlapped loop, causal: 3 key tiles, the
    # last a diagonal one.
    config = Sm90ForwardConfig("float16", 64, WINDOW, block_n=64, overlap=True, pingpong=True)
    check(config, xp, seqlen_q=70, seqlen_k=150, nheads=1, nheads_k=1)


def test_heavy_groups(xp):
    # Longest-first within groups of 2 (batch, head) pairs, causal: three pairs (batch 1, 3 query
    # heads over one KV head), so the second group's second block of each query block exits; two
    # query blocks, the first with rows that see no key.
    config = Sm90ForwardConfig("float16", 64, WINDOW, heavy_groups=2, **SMALL)
    assert config.grid(1, 3, 72) == (4, 2, 1)
    check(config, xp, seqlen_q=72, seqlen_k=40, nheads=3, nheads_k=1)


@pytest.mark.gpu
@pytest.mark.skipif(P.SIMULATOR, reason="sizes the simulator cannot afford; needs a GPU")
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_heavy_groups_gpu(window, batch, xp):
    # Groups of 8 over 12 and 36 (batch, head) pairs (partial last groups), GQA 3:1, hd 128.
    config = Sm90ForwardConfig("float16", 128, WINDOW if window else PLAIN, heavy_groups=8)
    check(config, xp, batch=batch, seqlen_q=1000, seqlen_k=1100, nheads=12, nheads_k=4)


def test_two_consumers_padded_headdim(xp):
    # Two consumer warpgroups (block_m 128), headdim 40 padded to 64 by TMA's zero fill, causal
    # with a diagonal tile and a tile skipped for the first rows.
    check(Sm90ForwardConfig("bfloat16", 40, WINDOW, block_n=64, consumers=2), xp, seqlen_q=70, seqlen_k=130,
          nheads=1)


# --- Score features (softcap, ALiBi) through the tensor-core score point: against the float64
# reference with the same features (nbflash.attention_reference), under the same rule ---------------

def check_scores(config, xp, batch=1, seqlen_q=20, seqlen_k=33, nheads=2, nheads_k=1, seed=0, softcap=0.0,
                 alibi="", window=CAUSAL):
    """``alibi``: "" (none), "head" (one slope per head) or "batch" (one per (batch, head))."""
    from tests.helpers import assert_attention_close

    rng = np.random.default_rng(seed)
    D, dt = config.headdim, NP_DTYPE[config.dtype]
    q, k, v = (rng.standard_normal((batch, n, h, D)).astype(dt)
               for n, h in ((seqlen_q, nheads), (seqlen_k, nheads_k), (seqlen_k, nheads_k)))
    slopes = None
    if alibi:
        slopes = rng.uniform(0.05, 1.0, (batch, nheads) if alibi == "batch" else (nheads,)).astype(np.float32)
    window = window if config.variant.window else None
    scale = 1.0 / math.sqrt(D)
    out, lse = run_kernel(config, q, k, v, scale, window, xp, softcap, slopes)
    variant = dict(softcap=softcap, alibi_slopes=slopes)
    if window is not None and window != CAUSAL:
        variant["window_size"] = window
    assert_attention_close(out, lse, q, k, v, window == CAUSAL, softmax_scale=scale, **variant)


SOFTCAP, ALIBI = Variant(softcap=True), Variant(alibi=True)
BOTH_CAUSAL = Variant(window=True, softcap=True, alibi=True)


def test_softcap_ring_wraps(xp):
    # softcap alone, a small cap (most scores in tanh's bend): 3 key tiles through the 2-stage ring,
    # the tail tile masked, GQA 2:1.
    check_scores(Sm90ForwardConfig("float16", 64, SOFTCAP, **SMALL), xp, seqlen_q=9, seqlen_k=150, softcap=2.5)


def test_alibi_per_head(xp):
    # ALiBi alone, one slope per head (a stride-0 view over batch), seqlen_q != seqlen_k: the
    # distance is bottom-right aligned; a tail tile.
    check_scores(Sm90ForwardConfig("float16", 64, ALIBI, **SMALL), xp, batch=2, seqlen_q=21, seqlen_k=75,
                 nheads=2, nheads_k=2, alibi="head")


def test_alibi_per_batch_head_causal_no_key(xp):
    # ALiBi with one slope per (batch, head), causal, seqlen_q > seqlen_k: 2 query blocks, the
    # first rows see no key (out 0, lse -inf).
    check_scores(Sm90ForwardConfig("bfloat16", 64, Variant(window=True, alibi=True), **SMALL), xp, batch=2,
                 seqlen_q=72, seqlen_k=40, nheads=2, nheads_k=1, alibi="batch")


def test_softcap_alibi_causal_two_consumers(xp):
    # Both features and causal, two consumer warpgroups, headdim 40 padded to 64, bfloat16: a
    # diagonal tile, a tile skipped for the first rows; the lse carries softcap's offset.
    check_scores(Sm90ForwardConfig("bfloat16", 40, BOTH_CAUSAL, block_n=64, consumers=2), xp, seqlen_q=70,
                 seqlen_k=130, nheads=1, softcap=4.0, alibi="head")


def test_softcap_alibi_window_overlapped(xp):
    # Both features in the overlapped consumer loop (the score point on its first tile and in its
    # steady state), a window (5, 3) that leaves no row without keys here: 3 key tiles.
    check_scores(Sm90ForwardConfig("float16", 64, BOTH_CAUSAL, overlap=True, **SMALL), xp, seqlen_q=9,
                 seqlen_k=150, nheads=2, nheads_k=1, softcap=6.0, alibi="batch", window=(5, 3))


def test_public_api_sm90_softcap_alibi(monkeypatch, xp):
    # flash_attn_func with softcap and per-head ALiBi slopes, causal, under kernel_family("sm90"):
    # the planned config (two consumers), explain names the family, GQA 2:1.
    import nbflash
    from tests.helpers import assert_attention_close, poison_allocations, random_qkv

    poison_allocations(monkeypatch)
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, xp, 1, 20, 33, 2, 1, 64, "float16")
    slopes = xp.asarray(rng.uniform(0.1, 1.0, 2).astype(np.float32))
    features = dict(softcap=5.0, alibi_slopes=slopes)
    with nbflash.kernel_family("sm90"):
        assert nbflash.explain(q, k, v, causal=True, **features)["family"] == "sm90"
        out, lse, _ = nbflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, **features)
    assert_attention_close(out, lse, q, k, v, True, **features)


# --- The bias and mask tensors, score_mod / mask_mod and dropout (served under kernel_family("sm90"),
# not yet the default): a config of the test's choosing, its params from flash_attn_func's own
# validation, against the float64 reference with the same arguments ----------------------------------

def check_variant(xp, monkeypatch, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal=False,
                  seed=0, name=None, **config):
    """Draw q, k, v; the variant is catalogue entry ``name`` (nbflash.catalogue) and/or the keyword
    arguments of flash_attn_func in ``config`` (window_size, softcap, alibi_slopes, bias, score_mod,
    mask_mod, dropout_p, seed=dropout_seed); the rest of ``config`` goes to Sm90ForwardConfig."""
    from nbflash import configs, validation
    from nbflash.catalogue import variant_arguments
    from tests.helpers import assert_attention_close, poison_allocations, random_qkv

    poison_allocations(monkeypatch)
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, xp, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype)
    names = ("window_size", "softcap", "alibi_slopes", "bias", "score_mod", "mask_mod", "dropout_p")
    variant = {n: config.pop(n) for n in names if n in config}
    if "dropout_seed" in config:
        variant["seed"] = config.pop("dropout_seed")
    if name:
        arguments = variant_arguments(name, batch, nheads, seqlen_k, xp, seqlen_q)
        causal = arguments.pop("causal", causal)
        variant.update(arguments)
    problem, qb, kb, vb = validation.check_forward(q, k, v, None, causal, **variant)
    assert configs.sm90_unsupported_reason(problem.static) is None  # the planner serves what is tested here
    kernel_config = Sm90ForwardConfig(dtype, headdim, problem.static.variant._replace(score_mod_grad=""), **config)
    out, lse = launch.empty_pair(q.shape, qb.dtype, (batch, nheads, seqlen_q), np.dtype(np.float32))
    launch.compiled(kernel_config).launch(kernel_config.grid(batch, nheads, seqlen_q), (qb, kb, vb, out, lse),
                                          (np.float32(problem.softmax_scale * math.log2(math.e)),), problem.params)
    assert_attention_close(out, lse, q, k, v, causal, **variant)


def test_bias_tensor_ring_wraps(monkeypatch, xp):
    # The catalogue's position bias (float32, one per head, stride 0 over batch): 3 key tiles
    # through the 2-stage ring, the tail tile masked, GQA 2:1.
    check_variant(xp, monkeypatch, "float16", 1, 9, 150, 2, 1, 64, name="bias", **SMALL)


def test_causal_bias_no_key(monkeypatch, xp):
    # causal + bias, seqlen_q > seqlen_k: 2 query blocks, the first rows see no key (out 0, lse -inf).
    check_variant(xp, monkeypatch, "bfloat16", 1, 72, 40, 1, 1, 64, name="causal-bias", **SMALL)


def test_mask_tensor_without_window(monkeypatch, xp):
    # The catalogue's document mask (bool, broadcast over batch and heads), no window: the band sees
    # the first 64-key tile whole, and the mask must still be tested there (no tile is full).
    check_variant(xp, monkeypatch, "float16", 1, 21, 75, 1, 1, 64, name="document-mask", **SMALL)


def test_mask_tensor_causal_no_key(monkeypatch, xp):
    # The document mask with causal, seqlen_q > seqlen_k: 2 query blocks, rows that see no key, the
    # mask read at clamped (row, key) past both ends (the band and the row test decide there).
    check_variant(xp, monkeypatch, "bfloat16", 1, 72, 40, 1, 1, 64, causal=True, name="document-mask", **SMALL)


def test_bias_softcap_alibi_window_overlapped(monkeypatch, xp):
    # A float16 bias (batch, heads, seqlen_q, seqlen_k) after softcap and ALiBi, in natural units,
    # a window, in the overlapped consumer loop: 3 key tiles.
    bias = xp.asarray(np.random.default_rng(5).standard_normal((1, 2, 9, 150)).astype(np.float16))
    slopes = xp.asarray(np.array([0.3, 0.7], np.float32))
    check_variant(xp, monkeypatch, "float16", 1, 9, 150, 2, 1, 64, window_size=(40, 20), softcap=6.0,
                  alibi_slopes=slopes, bias=bias, overlap=True, **SMALL)


def test_score_mod_mask_mod_causal(monkeypatch, xp):
    # The user functions of tests/test_user_functions.py (a captured table, a striped mask), causal,
    # 2 key tiles, GQA 2:1 (score_mod's h is the query head: (h + 1) scales its table). The sm90
    # forward's only simulator run of them (test_user_functions_sm90_backward starts from the
    # reference's out and lse).
    from tests.test_user_functions import relative_bias, striped

    check_variant(xp, monkeypatch, "float16", 1, 20, 70, 2, 1, 64, causal=True, score_mod=relative_bias,
                  mask_mod=striped, **SMALL)


def tiles_0_and_2_of_4(b, h, q_idx, kv_idx):
    """Keys of 64-key tile 0 all kept, tile 1 none, tiles 2 and 3 all but every third."""
    return kv_idx < 64 or (kv_idx >= 128 and kv_idx % 3 != 0)


@pytest.mark.skipif(not P.SIMULATOR, reason="writes the class table in place (NumPy under the simulator)")
@pytest.mark.parametrize("overlap", [False, True])
def test_block_mask_table_is_obeyed(monkeypatch, xp, overlap):
    # A block mask's table (64 x 64 tiles) says FULL, EMPTY, PARTIAL, PARTIAL for the four key tiles;
    # rewritten to say EMPTY for tile 0 and FULL for tile 2, the kernel must drop tile 0 (which
    # mask_mod keeps) and keep all of tile 2 (which mask_mod thins): it skips what the table calls
    # empty, in the producer's loads and the consumers' walk alike (two tiles visited, keys 128..255,
    # through the 2-stage ring), and asks mask_mod where the table says partial (tile 3, which the
    # band alone would call whole).
    import nbflash
    from nbflash import validation
    from nbflash.block_mask import EMPTY, FULL, PARTIAL, kernel_params
    from tests.helpers import assert_attention_close, poison_allocations, random_qkv

    poison_allocations(monkeypatch)
    q, k, v = random_qkv(np.random.default_rng(11), xp, 1, 9, 256, 2, 1, 64, "float16")
    block_mask = nbflash.create_block_mask(tiles_0_and_2_of_4, None, None, 9, 256)
    problem, qb, kb, vb = validation.check_forward(q, k, v, None, False, block_mask=block_mask)
    config = Sm90ForwardConfig("float16", 64, problem.static.variant, overlap=overlap, **SMALL)
    table = block_mask.classes(config.block_m, config.block_n)
    assert table[0, 0, 0].tolist() == [FULL, EMPTY, PARTIAL, PARTIAL]
    table[0, 0, 0, :3] = [EMPTY, EMPTY, FULL]
    out, lse = launch.empty_pair(q.shape, qb.dtype, (1, 2, 9), np.dtype(np.float32))
    launch.compiled(config).launch(config.grid(1, 2, 9), (qb, kb, vb, out, lse),
                                   (np.float32(problem.softmax_scale * math.log2(math.e)),),
                                   kernel_params(problem, config))

    def as_the_table_says(b, h, q_idx, kv_idx):
        return 128 <= kv_idx < 192 or (kv_idx >= 192 and kv_idx % 3 != 0)

    assert_attention_close(out, lse, q, k, v, False, mask_mod=as_the_table_says)


@pytest.mark.parametrize("overlap", [False, True])
def test_dropout_causal(monkeypatch, overlap, xp):
    # Dropout at the probability point (P times its factor as it is packed for P V), causal, 2 key
    # tiles, in both consumer loops: the reference regenerates the same Philox bits.
    check_variant(xp, monkeypatch, "float16", 1, 20, 70, 1, 1, 64, causal=True, dropout_p=0.2, dropout_seed=2024,
                  overlap=overlap, **SMALL)


def test_public_api_sm90_bias(monkeypatch, xp):
    # flash_attn_func with the catalogue's causal bias under kernel_family("sm90"): the planned config
    # (two consumers), explain names the family.
    import nbflash
    from nbflash.catalogue import variant_arguments
    from tests.helpers import assert_attention_close, poison_allocations, random_qkv

    poison_allocations(monkeypatch)
    rng = np.random.default_rng(10)
    q, k, v = random_qkv(rng, xp, 1, 20, 33, 2, 1, 64, "float16")
    features = variant_arguments("bias", 1, 2, 33, xp, 20)
    with nbflash.kernel_family("sm90"):
        assert nbflash.explain(q, k, v, causal=True, **features)["family"] == "sm90"
        out, lse = nbflash.flash_attn_func(q, k, v, causal=True, return_lse=True, **features)
    assert_attention_close(out, lse, q, k, v, True, **features)


def test_new_variants_not_the_default_on_sm90(monkeypatch):
    # On compute capability 9.0 (outside the simulator, which keeps mma), the bias and mask tensors
    # and mask_mod (without a block mask) are served by the sm90 forward but not yet its default (not
    # measured): mma unless kernel_family("sm90"); the measured variants (dropout and score_mod at
    # headdims 64 and 128 among them) keep sm90 as the default, forward and backward.
    from nbflash import configs
    from nbflash.kernels.backward_mma import MmaBackwardConfig
    from nbflash.kernels.backward_sm90 import Sm90BackwardConfig
    from nbflash.kernels.forward_mma import MmaForwardConfig
    from nbflash.problem import Static

    monkeypatch.setattr(configs.runtime, "SIMULATOR", False)
    monkeypatch.setattr(configs, "_compute_capability", lambda device=0: (9, 0))
    served = [Variant(bias="float16"), Variant(window=True, bias="float32"), Variant(mask=True),
              Variant(window=True, softcap=True, alibi=True, bias="bfloat16"), Variant(window=True, mask_mod="g:0"),
              Variant(softcap=True, dropout=True), Variant(window=True, dropout=True, score_mod="f:0")]
    for variant in served:
        static = Static("bfloat16", 128, True, 0, variant)
        assert isinstance(configs.plan_forward(static), MmaForwardConfig), variant
        assert isinstance(configs.plan_forward(static, "sm90"), Sm90ForwardConfig), variant
    measured = [Variant(dropout=True), Variant(window=True, dropout=True), Variant(score_mod="f:0"),
                Variant(window=True, score_mod="f:0", score_mod_grad="h:0")]
    for variant in measured:
        for headdim in (64, 128):
            static = Static("float16", headdim, True, 0, variant)
            assert isinstance(configs.plan_forward(static), Sm90ForwardConfig), variant
            assert isinstance(configs.plan_backward(static, False)[1], Sm90BackwardConfig), variant
        static = Static("float16", 256, True, 0, variant)  # not measured at headdim 256
        assert isinstance(configs.plan_forward(static), MmaForwardConfig), variant
    for variant in configs.SM90_DEFAULT_VARIANTS:
        assert isinstance(configs.plan_forward(Static("float16", 128, True, 0, variant)), Sm90ForwardConfig), variant
    # mask_mod with a block mask: the default where measured (headdim 128, forward and backward; the
    # backward at 64 too), served when forced elsewhere (mma by default); with another feature not
    # measured: mma.
    block_mask = Variant(mask_mod="g:0", block_mask=True)
    static = Static("float16", 128, True, 0, block_mask)
    assert isinstance(configs.plan_forward(static), Sm90ForwardConfig)
    assert isinstance(configs.plan_backward(static, False)[1], Sm90BackwardConfig)
    static = Static("float16", 64, True, 0, block_mask)
    assert isinstance(configs.plan_forward(static), MmaForwardConfig)
    assert isinstance(configs.plan_backward(static, False)[1], Sm90BackwardConfig)
    for static in (Static("float16", 256, True, 0, block_mask),
                   Static("float16", 128, True, 0, block_mask._replace(window=True))):
        assert isinstance(configs.plan_forward(static), MmaForwardConfig)
        assert isinstance(configs.plan_backward(static, False)[1], MmaBackwardConfig)
        assert isinstance(configs.plan_forward(static, "sm90"), Sm90ForwardConfig)
    static = Static("float16", 128, True, 0, Variant(varlen=True))
    assert isinstance(configs.plan_forward(static), MmaForwardConfig)
    with pytest.raises(ValueError, match="serves every variant but varlen"):
        configs.plan_forward(static, "sm90")


def test_sm90_backward_default_for_features(monkeypatch):
    # On compute capability 9.0 the sm90 backward is the default with one of softcap, ALiBi, a bias
    # tensor, dropout or a score_mod, alone or with the window, at the headdims where each was
    # measured (configs.SM90_BACKWARD_FEATURE_HEADDIMS; a score_mod not at 256), and with
    # deterministic=True there too (the pair); past 128 the pair without deterministic=True with
    # softcap, ALiBi and dropout (configs.SM90_PAIR_FEATURES), not with a bias tensor. A bool mask
    # tensor at hd 64 only (step 40's kernel), without deterministic=True, alone or with ALiBi
    # (configs.SM90_BACKWARD_FEATURE_PAIRS). The mma family with other features together, a mask
    # tensor at other headdims, or at headdims not measured.
    from nbflash import configs
    from nbflash.kernels.backward_dq_sm90 import Sm90DqConfig
    from nbflash.kernels.backward_mma import MmaBackwardConfig
    from nbflash.kernels.backward_sm90 import Sm90BackwardConfig
    from nbflash.kernels.backward_sm90_wide import Sm90WideBackwardConfig
    from nbflash.problem import Static

    monkeypatch.setattr(configs.runtime, "SIMULATOR", False)
    monkeypatch.setattr(configs, "_compute_capability", lambda device=0: (9, 0))

    def plan(headdim, variant, deterministic=False):
        return configs.plan_backward(Static("float16", headdim, True, 0, variant), deterministic)

    features = dict(softcap=True, alibi=True, bias="float16", dropout=True, score_mod="f")
    for name, value in features.items():
        for window in (False, True):
            variant = Variant(window=window, **{name: value})
            for headdim in (64, 128, 256):
                if name == "score_mod" and headdim == 256:
                    assert isinstance(plan(headdim, variant)[1], MmaBackwardConfig), variant
                    continue
                dkdv = plan(headdim, variant)[1]
                pair = plan(headdim, variant, True)
                assert isinstance(pair[1], (Sm90BackwardConfig, Sm90WideBackwardConfig)), (headdim, variant)
                assert not pair[1].atomic_dq and isinstance(pair[2], Sm90DqConfig), (headdim, variant)
                if headdim == 256 and name != "bias":  # the pair either way
                    assert plan(headdim, variant) == pair, variant
                else:
                    assert isinstance(dkdv, (Sm90BackwardConfig, Sm90WideBackwardConfig)) and dkdv.atomic_dq, \
                        (headdim, variant)
            for headdim in (32, 96, 192):  # not measured
                assert isinstance(plan(headdim, variant)[1], MmaBackwardConfig), (headdim, variant)
                assert isinstance(plan(headdim, variant, True)[1], MmaBackwardConfig), (headdim, variant)
    for variant in (Variant(window=True, softcap=True, alibi=True), Variant(mask=True), Variant(window=True, mask=True)):
        for deterministic in (False, True):
            assert isinstance(plan(128, variant, deterministic)[1], MmaBackwardConfig), variant
    for variant in (Variant(mask=True), Variant(window=True, mask=True)):
        dkdv = plan(64, variant)[1]
        assert isinstance(dkdv, Sm90BackwardConfig) and (dkdv.block_m, dkdv.atomic_dq) == (128, True), variant
        assert isinstance(plan(64, variant, True)[1], MmaBackwardConfig), variant  # timed with atomics only
        for headdim in (32, 96):
            assert isinstance(plan(headdim, variant)[1], MmaBackwardConfig), (headdim, variant)
    for variant in (Variant(alibi=True, mask=True), Variant(window=True, alibi=True, mask=True)):  # the pair measured
        dkdv = plan(64, variant)[1]
        assert isinstance(dkdv, Sm90BackwardConfig) and (dkdv.block_m, dkdv.atomic_dq) == (128, True), variant
        assert isinstance(plan(64, variant, True)[1], MmaBackwardConfig), variant
        assert isinstance(plan(128, variant)[1], MmaBackwardConfig), variant
    for variant in (Variant(window=True, softcap=True, mask=True), Variant(alibi=True, mask=True, softcap=True),
                    Variant(alibi=True, mask=True, dropout=True)):  # not measured
        assert isinstance(plan(64, variant)[1], MmaBackwardConfig), variant
    block_mask = Variant(mask_mod="m", block_mask=True)
    for headdim, kind in ((64, Sm90BackwardConfig), (128, Sm90BackwardConfig), (256, MmaBackwardConfig)):
        assert isinstance(plan(headdim, block_mask)[1], kind), headdim
        assert isinstance(plan(headdim, block_mask, True)[1], kind), headdim


VARIANT_GPU_CASES = [
    # (name or features, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim)
    ("bias", "float16", 2, 113, 203, 4, 2, 64),
    ("causal-bias", "bfloat16", 2, 203, 113, 4, 1, 128),
    ("causal-bias", "float16", 1, 1023, 1024, 2, 1, 128),
    ("document-mask", "float16", 1, 1024, 1000, 4, 4, 128),
    ("document-mask", "bfloat16", 1, 300, 1000, 3, 1, 96),
    ("user", "float16", 2, 113, 203, 4, 2, 128),
    ("user", "bfloat16", 1, 1023, 1024, 2, 1, 256),
    ("dropout", "float16", 2, 113, 203, 4, 2, 128),
    ("dropout", "bfloat16", 1, 1023, 1024, 2, 1, 64),
    ("bias-softcap-alibi", "float16", 1, 1023, 1024, 2, 1, 128),
]


def gpu_variant_features(name, xp, batch, seqlen_q, seqlen_k, nheads):
    from tests.test_user_functions import relative_bias, striped

    if name == "user":
        return dict(causal=True, score_mod=relative_bias, mask_mod=striped)
    if name == "dropout":
        return dict(causal=True, dropout_p=0.2, dropout_seed=2024)
    if name == "bias-softcap-alibi":
        bias = np.random.default_rng(1).standard_normal((batch, nheads, seqlen_q, seqlen_k)).astype(np.float16)
        slopes = np.random.default_rng(2).uniform(0.01, 0.5, nheads).astype(np.float32)
        return dict(window_size=(256, 64), softcap=30.0, alibi_slopes=xp.asarray(slopes), bias=xp.asarray(bias))
    return dict(name=name)


@pytest.mark.gpu
@pytest.mark.skipif(P.SIMULATOR, reason="sizes the simulator cannot afford; needs a GPU")
@pytest.mark.parametrize("case", VARIANT_GPU_CASES, ids=["-".join(map(str, c)) for c in VARIANT_GPU_CASES])
@pytest.mark.parametrize("schedule", ["stages2", "overlap"])
def test_forward_sm90_variants_gpu(case, schedule, monkeypatch, xp):
    # The bias and mask tensors, score_mod + mask_mod, dropout, and a bias after softcap and ALiBi
    # in a window, on the hardware: the planned tile shapes through two consumer loops.
    name, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = case
    features = gpu_variant_features(name, xp, batch, seqlen_q, seqlen_k, nheads)
    check_variant(xp, monkeypatch, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, seed=seqlen_q,
                  block_n=128 if headdim <= 128 else 80, overlap=schedule == "overlap", **features)


@pytest.mark.gpu
@pytest.mark.skipif(P.SIMULATOR, reason="the simulator keeps the mma family as the default")
def test_new_variants_default_mma_forced_sm90_gpu(monkeypatch, xp):
    # On compute capability 9.0 the library's own choice for a bias, a mask and a score_mod with a
    # mask_mod is still the mma forward (sm90 not yet measured with them; dropout, checked by the call
    # alone, is sm90's by default since it was measured); under kernel_family("sm90") explain and the
    # call take the sm90 forward, within the budget.
    import nbflash
    from tests.helpers import assert_attention_close, poison_allocations, random_qkv

    poison_allocations(monkeypatch)
    rng = np.random.default_rng(14)
    q, k, v = random_qkv(rng, xp, 2, 517, 1000, 8, 2, 128, "bfloat16")
    for name in ("causal-bias", "document-mask", "user", "dropout"):
        features = gpu_variant_features(name, xp, 2, 517, 1000, 8)
        if "name" in features:
            from nbflash.catalogue import variant_arguments
            features = variant_arguments(features.pop("name"), 2, 8, 1000, xp, 517)
        if "dropout_seed" in features:
            features["seed"] = features.pop("dropout_seed")
        causal = features.pop("causal", False)
        if name != "dropout":  # explain takes no dropout_p
            assert nbflash.explain(q, k, v, causal=causal, **features)["family"] == "sm80", name
        with nbflash.kernel_family("sm90"):
            if name != "dropout":
                assert nbflash.explain(q, k, v, causal=causal, **features)["family"] == "sm90", name
            out, lse = nbflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, **features)
        assert_attention_close(out, lse, q, k, v, causal, **features)


SCORE_GPU_CASES = [
    # (dtype, headdim, window, batch, seqlen_q, seqlen_k, nheads, nheads_k, softcap, alibi)
    ("float16", 128, False, 2, 113, 203, 4, 2, 30.0, ""),
    ("bfloat16", 128, True, 2, 203, 113, 4, 1, 0.0, "head"),
    ("float16", 128, True, 1, 1023, 1024, 2, 1, 30.0, "batch"),
    ("float16", 64, True, 2, 1024, 1000, 4, 4, 2.5, "head"),
    ("bfloat16", 64, False, 1, 1, 1, 1, 1, 10.0, "batch"),
    ("float16", 96, True, 1, 300, 1000, 3, 1, 0.0, "batch"),
    ("bfloat16", 256, True, 1, 1023, 1024, 2, 1, 50.0, "head"),
    ("float16", 256, False, 2, 113, 203, 4, 2, 0.0, "head"),
    ("float16", 128, True, 1, 4096, 4000, 2, 2, 30.0, "head"),
]


@pytest.mark.gpu
@pytest.mark.skipif(P.SIMULATOR, reason="sizes the simulator cannot afford; needs a GPU")
@pytest.mark.parametrize("case", SCORE_GPU_CASES, ids=["-".join(map(str, c[:2] + ("w" if c[2] else "p",) + c[3:8]))
                                                        + f"-cap{c[8]:g}-alibi{c[9] or 'none'}"
                                                        for c in SCORE_GPU_CASES])
@pytest.mark.parametrize("schedule", ["stages2", "overlap", "pingpong"])
def test_forward_sm90_scores_gpu(case, schedule, xp):
    # softcap, ALiBi (one slope per head or per (batch, head)) or both, causal or not, on the
    # hardware: the planned tile shapes through the three consumer loops.
    dtype, headdim, window, batch, seqlen_q, seqlen_k, nheads, nheads_k, softcap, alibi = case
    variant = Variant(window=window, softcap=softcap > 0, alibi=bool(alibi))
    config = Sm90ForwardConfig(dtype, headdim, variant, block_n=128 if headdim <= 128 else 80,
                               overlap=schedule != "stages2", pingpong=schedule == "pingpong")
    check_scores(config, xp, batch, seqlen_q, seqlen_k, nheads, nheads_k, seed=seqlen_q, softcap=softcap,
                 alibi=alibi)


@pytest.mark.gpu
@pytest.mark.skipif(P.SIMULATOR, reason="the simulator keeps the mma family as the default")
def test_sm90_is_the_default_for_softcap_alibi(monkeypatch, xp):
    # On compute capability 9.0 the library's own choice for softcap and ALiBi at headdim 128 is the
    # sm90 forward, and its answer is within the budget.
    import nbflash
    from tests.helpers import assert_attention_close, poison_allocations, random_qkv

    poison_allocations(monkeypatch)
    rng = np.random.default_rng(13)
    q, k, v = random_qkv(rng, xp, 2, 517, 1000, 8, 2, 128, "bfloat16")
    slopes = xp.asarray(rng.uniform(0.01, 0.5, (2, 8)).astype(np.float32))
    for features in (dict(softcap=30.0), dict(alibi_slopes=slopes), dict(softcap=30.0, alibi_slopes=slopes)):
        assert nbflash.explain(q, k, v, causal=True, **features)["family"] == "sm90", features
        out, lse, _ = nbflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, **features)
        assert_attention_close(out, lse, q, k, v, True, **features)


# --- fp8 (e4m3) q, k, v with per-(batch, kv head) descales: the error against the float64 attention
# of the dequantized inputs, next to a naive implementation's that rounds P to e4m3 as the kernel
# does (P = exp(S - m) before the division by the row sum), with a bfloat16 output ---------------------

def fp8_case(rng, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, scalar_descales=False):
    e4m3 = ml_dtypes.float8_e4m3fn
    q, k, v = (rng.standard_normal((batch, n, h, headdim)).astype(np.float32).astype(e4m3)
               for n, h in ((seqlen_q, nheads), (seqlen_k, nheads_k), (seqlen_k, nheads_k)))
    if scalar_descales:
        descales = tuple(np.float32(x) for x in rng.uniform(0.25, 2.0, 3))
    else:
        descales = tuple(rng.uniform(0.25, 2.0, (batch, nheads_k)).astype(np.float32) for _ in range(3))
    return q, k, v, descales


def fp8_dequantized(x, descale, nheads_k):
    """x in float64 times its descale: a scalar, or (batch, nheads_k) as FlashAttention-3's
    descales are for q, k and v alike (q's head h takes its key/value head h // (nheads / nheads_k)'s)."""
    d = np.broadcast_to(np.asarray(descale, dtype=np.float64), (x.shape[0], nheads_k))
    return x.astype(np.float64) * np.repeat(d, x.shape[2] // nheads_k, axis=1)[:, None, :, None]


# Hopper's fp8 wgmma does not add its products into a full float32 accumulator: each addition step
# keeps only about 13-14 mantissa bits (DeepSeek-V3's technical report, on increasing accumulation
# precision: about 14 bits retained in FP8 GEMMs on H800; others describe an e8m13 accumulator on H100).
# So a score s_ij = scale * sum_d q_id k_jd off the hardware is off by up to about 2^-13 of its partial
# sums' magnitude, which sum_d |q_id k_jd| bounds; the allowance is twice that per-step error, and lse
# (1-Lipschitz in the max norm of its row's scores) inherits at most its row's largest score error.
# The simulator's emulation accumulates in float32 and gets no such allowance.
FP8_ACCUMULATION_ERROR = 2.0**-12


def fp8_lse_bound(q64, k64, scale, window, ref_lse):
    """Per-row bound (batch, nheads, seqlen_q) on |lse - ref_lse| for the fp8 forward, on the
    dequantized float64 q and k: float32's 1e-4 (absolute and relative, as np.allclose), plus on the
    hardware scale * max_j sum_d |q_id| |k_jd| * FP8_ACCUMULATION_ERROR over the keys j row i sees."""
    bound = 1e-4 + 1e-4 * np.abs(np.where(np.isfinite(ref_lse), ref_lse, 0.0))
    if P.SIMULATOR:
        return bound
    group = q64.shape[2] // k64.shape[2]
    magnitude = np.einsum("bihd,bjhd->bhij", np.abs(q64), np.repeat(np.abs(k64), group, axis=2))
    mask = visible(q64.shape[1], k64.shape[1], window_size=window) if window else None
    if mask is not None:
        magnitude = np.where(mask, magnitude, 0.0)
    return bound + scale * magnitude.max(axis=-1, initial=0.0) * FP8_ACCUMULATION_ERROR


def check_fp8_error(out, lse, q, k, v, descales, scale, window):
    nheads = q.shape[2]
    q64, k64, v64 = (fp8_dequantized(x, d, k.shape[2]) for x, d in zip((q, k, v), descales))
    ref, ref_lse = reference(q64, k64, v64, scale, window)
    # the naive fp8 attention: S in float32, P = exp(S - m) rounded to e4m3, P V / l, out in bfloat16
    group = nheads // k.shape[2]
    kk, vv = (np.repeat(x, group, axis=2).astype(np.float32) for x in (k64, v64))
    s = np.einsum("bihd,bjhd->bhij", q64.astype(np.float32), kk) * np.float32(scale)
    if window:
        s = np.where(visible(q.shape[1], k.shape[1], window_size=window), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    p8 = p.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    naive = np.einsum("bhij,bjhd->bihd", p8 / np.where(l > 0, l, 1), vv)
    naive = naive.astype(ml_dtypes.bfloat16).astype(np.float64)
    out64 = np.asarray(out).astype(np.float64)
    assert not np.isnan(out64).any(), "out has NaN (an element left unwritten, or a 0/0)"
    err, naive_err = np.abs(out64 - ref).max(), np.abs(naive - ref).max()
    print(f"fp8 forward: max error {err:.3g} against float64 of the dequantized inputs (naive e4m3-P: {naive_err:.3g})")
    assert err <= 2 * naive_err + 1e-3, f"max error {err:.3g}, naive {naive_err:.3g}"
    lse = np.asarray(lse)
    no_key = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), no_key), "lse = -inf exactly where a row sees no key"
    assert (out64.transpose(0, 2, 1, 3)[no_key] == 0).all(), "rows that see no key must be 0"
    lse_err = np.abs(lse[~no_key] - ref_lse[~no_key])
    bound = fp8_lse_bound(q64, k64, scale, window, ref_lse)[~no_key]
    if lse_err.size:
        largest, worst = np.argmax(lse_err), np.argmax(lse_err / bound)
        message = (f"lse max error {lse_err[largest]:.3g} against its row's bound {bound[largest]:.3g} "
                   f"({lse_err[largest] / bound[largest]:.3g}x); "
                   f"largest error/bound {lse_err[worst] / bound[worst]:.3g}x "
                   f"(error {lse_err[worst]:.3g}, bound {bound[worst]:.3g})")
        print(f"fp8 forward: {message}")
        assert (lse_err <= bound).all(), message
    return err, naive_err


def test_fp8_dequantized_per_head_descales_with_gqa():
    # q's descale is (batch, nheads_k) like k's and v's: q's heads 0, 1 take kv head 0's, 2, 3 kv head 1's
    # (the helper first broadcast it to q's own heads and failed the first GPU run's GQA case).
    x = np.ones((2, 1, 4, 1), np.float32)
    d = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    assert fp8_dequantized(x, d, 2)[:, 0, :, 0].tolist() == [[1, 1, 2, 2], [3, 3, 4, 4]]
    assert fp8_dequantized(x[:, :, :2], d, 2)[:, 0, :, 0].tolist() == [[1, 2], [3, 4]]
    assert fp8_dequantized(x, np.float32(0.5), 2).max() == 0.5


def _host(x):
    return x.get() if hasattr(x, "get") else x


def fp8_inputs(xp, *arrays):
    """e4m3 host arrays as the backend takes them, and the keywords that say what they are: the
    float8_e4m3fn NumPy arrays themselves under the simulator; on a GPU, uint8 CuPy arrays of the
    same bytes with fp8_dtype (CuPy has no float8 dtype)."""
    if xp is np:
        return list(arrays), {}
    return [xp.asarray(x.view(np.uint8)) for x in arrays], dict(fp8_dtype="float8_e4m3fn")


@pytest.mark.parametrize("headdim, overlap, fma_groups", [(64, False, 0), (80, False, 0), (64, True, 0), (64, False, 5)])
def test_fp8_kernel_ring_wraps(xp, headdim, overlap, fma_groups):
    # A small config straight through the launcher: one consumer, headdim 64 or 80 padded to a
    # 128-byte chunk (S's k steps stop at 64 or 96 columns, O's at 64 or 80), 3 key tiles of 128
    # through a 2-stage ring, seqlen_k 300 (V^T padded to 304, the tail masked), per-head descales;
    # the plain loop and the overlapped one (S_j issued with P_{j-1} V_{j-1}); 5 of each row's 16
    # key groups with P from the polynomial exp2 (exp2_fma_groups).
    from nbflash import interface

    rng = np.random.default_rng(80)
    config = Sm90ForwardConfig("float8_e4m3fn", headdim, PLAIN, block_n=128, consumers=1, overlap=overlap,
                               exp2_fma_groups=fma_groups)
    q, k, v, descales = fp8_case(rng, 1, 9, 300, 2, 2, headdim)
    out = xp.asarray(np.full(q.shape, np.nan, dtype=ml_dtypes.bfloat16))
    lse = xp.full((1, 2, 9), np.nan, dtype=np.float32)
    scale = 1.0 / math.sqrt(64)
    (q_dev, k_dev, v_dev), _ = fp8_inputs(xp, q, k, v)
    launch.compiled(config).launch(
        config.grid(1, 2, 9), (q_dev.view(np.uint16), k_dev.view(np.uint16), interface.fp8_transposed_v(v_dev), out,
                               lse),
        (np.float32(scale * math.log2(math.e)),),
        (interface._fp8_descales([xp.asarray(d) for d in descales], 1, 2, xp),))
    check_fp8_error(_host(out), _host(lse), q, k, v, descales, scale, None)


@pytest.mark.parametrize("seqlen_k, headdim, threads", [(70, 80, 256), (1, 256, 256), (70, 80, 128)])
def test_fp8_transposed_v(xp, seqlen_k, headdim, threads):
    # V^T for the fp8 kernel (nbflash/kernels/transpose_fp8.py) against NumPy's: every other head of
    # a strided V, a length off 16 and 64 (its padding must come out zero in an array poisoned
    # first), headdim off 64, and one key padded to 16 at headdim 256; with 128 threads a block,
    # each thread moves 8 words instead of 4.
    from nbflash import interface
    from nbflash.kernels.forward_sm90 import FP8_KEY_ORDER
    from nbflash.kernels.transpose_fp8 import Fp8TransposeConfig

    rng = np.random.default_rng(82)
    batch, nheads_k, padded = 2, 2, -(-seqlen_k // 16) * 16
    v_all = rng.integers(0, 256, (batch, seqlen_k, 2 * nheads_k, headdim), dtype=np.uint8)
    position = np.arange(padded)
    key = position // 16 * 16 + np.asarray(FP8_KEY_ORDER)[position % 16]
    expected = np.zeros((batch, nheads_k, headdim, padded), dtype=np.uint8)
    inside = key < seqlen_k
    expected[..., position[inside]] = v_all[:, key[inside], ::2].transpose(0, 2, 3, 1)

    v = xp.asarray(v_all)[:, :, ::2]
    vt = xp.full(expected.shape, 0xAB, dtype=np.uint8)
    config = Fp8TransposeConfig(threads=threads)
    launch.compiled(config).launch(config.grid(batch, nheads_k, headdim, padded),
                                   (v.view(np.uint32), vt.view(np.uint32)), ())
    np.testing.assert_array_equal(_host(vt), expected)
    np.testing.assert_array_equal(_host(interface.fp8_transposed_v(v)).view(np.uint8), expected)


def test_fp8_public_api_causal_gqa(xp):
    # flash_attn_func with e4m3 inputs and FlashAttention-3's descales (scalars here): the planned
    # config (two consumers), causal with seqlen_q > seqlen_k (rows without keys), GQA 2:1.
    import nbflash

    q, k, v, descales = fp8_case(np.random.default_rng(81), 1, 70, 40, 2, 1, 128, scalar_descales=True)
    dev, fp8_dtype = fp8_inputs(xp, q, k, v)
    out, lse = nbflash.flash_attn_func(*dev, causal=True, return_lse=True, q_descale=descales[0],
                                       k_descale=descales[1], v_descale=descales[2], **fp8_dtype)
    assert out.dtype == ml_dtypes.bfloat16 and out.shape == q.shape
    check_fp8_error(_host(out), _host(lse), q, k, v, descales, 1.0 / math.sqrt(128), CAUSAL)


def test_fp8_descales_every_form(xp):
    # The descales' forms as the kernel gets them, one (3, batch, nheads_k) float32 array: None (1),
    # a Python float, a NumPy scalar, and (1,), () and (batch, nheads_k) arrays of other dtypes.
    from nbflash import interface

    per_head = np.arange(6, dtype=np.float64).reshape(2, 3) / 4
    cases = [((None, 2.5, np.float32(0.5)), [1.0, 2.5, 0.5]),
             ((xp.asarray(np.array([3.0])), xp.asarray(np.array(0.25, np.float16)), xp.asarray(per_head)),
              [3.0, 0.25, per_head])]
    for descales, expected in cases:
        got = _host(interface._fp8_descales(descales, 2, 3, xp))
        assert got.dtype == np.float32 and got.shape == (3, 2, 3)
        for row, value in zip(got, expected):
            np.testing.assert_array_equal(row, np.broadcast_to(np.float32(value), (2, 3)))


def test_fp8_refusals(monkeypatch, xp):
    import nbflash
    from nbflash import configs

    e4m3 = ml_dtypes.float8_e4m3fn
    (q,), fp8_dtype = fp8_inputs(xp, np.zeros((1, 8, 1, 64), dtype=e4m3))
    with pytest.raises(ValueError, match="takes softmax_scale, causal and window_size only"):
        nbflash.flash_attn_func(q, q, q, softcap=5.0, **fp8_dtype)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        half = xp.zeros((1, 8, 1, 64), dtype=np.float16)
        nbflash.flash_attn_func(half, half, half, q_descale=np.float32(2))
    with pytest.raises(ValueError, match=r"shape \(batch, nheads_k\)"):
        nbflash.flash_attn_func(q, q, q, k_descale=xp.ones((2, 1), np.float32), **fp8_dtype)
    with pytest.raises(ValueError, match="multiple of 16"):
        (q40,), _ = fp8_inputs(xp, np.zeros((1, 8, 1, 40), dtype=e4m3))
        nbflash.flash_attn_func(q40, q40, q40, **fp8_dtype)
    monkeypatch.setattr(configs, "_compute_capability", lambda device: (8, 9))
    with pytest.raises(ValueError, match="compute capability 9.0 only"):
        nbflash.flash_attn_func(q, q, q, **fp8_dtype)


@pytest.mark.skipif(not P.SIMULATOR, reason="CuPy cannot hold float8_e4m3fn: on a GPU the uint8 route is the only one")
def test_fp8_uint8_bytes_route_is_bit_identical():
    # uint8 arrays of the same bytes with fp8_dtype: the same kernel on the same bytes, so out and lse
    # bit for bit those of the float8_e4m3fn arrays (per-head descales, GQA 2:1, a window).
    import nbflash

    q, k, v, descales = fp8_case(np.random.default_rng(82), 1, 5, 20, 2, 1, 64)
    call = dict(window_size=(7, 2), return_lse=True, q_descale=descales[0], k_descale=descales[1],
                v_descale=descales[2])
    out, lse = nbflash.flash_attn_func(q, k, v, **call)
    out8, lse8 = nbflash.flash_attn_func(*(x.view(np.uint8) for x in (q, k, v)), fp8_dtype="float8_e4m3fn", **call)
    assert out8.dtype == out.dtype == ml_dtypes.bfloat16 and lse8.dtype == lse.dtype == np.float32
    assert np.array_equal(out8.view(np.uint16), out.view(np.uint16)), "out differs between the two routes"
    assert np.array_equal(lse8, lse, equal_nan=True), "lse differs between the two routes"
    check_fp8_error(out, lse, q, k, v, descales, 1.0 / math.sqrt(64), (7, 2))


FP8_GPU_CASES = [
    # (headdim, causal, batch, seqlen_q, seqlen_k, nheads, nheads_k, scalar descales)
    (128, False, 2, 113, 203, 4, 2, False),
    (128, True, 1, 1023, 1024, 2, 1, False),
    (128, True, 1, 1, 1, 1, 1, True),
    (64, True, 2, 203, 113, 4, 1, False),
    (96, False, 1, 300, 1000, 3, 1, True),
    (256, False, 2, 1024, 1024, 2, 2, False),
    (256, True, 1, 4096, 4000, 2, 1, False),
]


@pytest.mark.gpu
@pytest.mark.skipif(P.SIMULATOR, reason="sizes the simulator cannot afford; needs a GPU")
@pytest.mark.parametrize("case", FP8_GPU_CASES, ids=["-".join(map(str, c)) for c in FP8_GPU_CASES])
def test_fp8_forward_gpu(case, xp):
    # The fp8 forward on the hardware (its tests not passed yet): flash_attn_func with the e4m3 bytes
    # in uint8 CuPy arrays (fp8_dtype; CuPy cannot hold float8) and descales on the device, against
    # the float64 attention of the dequantized inputs.
    import nbflash

    headdim, causal, batch, seqlen_q, seqlen_k, nheads, nheads_k, scalar = case
    q, k, v, descales = fp8_case(np.random.default_rng(seqlen_q), batch, seqlen_q, seqlen_k, nheads, nheads_k,
                                 headdim, scalar_descales=scalar)
    dev, fp8_dtype = fp8_inputs(xp, q, k, v)
    dev_descales = [d if scalar else xp.asarray(d) for d in descales]
    out, lse = nbflash.flash_attn_func(*dev, causal=causal, return_lse=True, q_descale=dev_descales[0],
                                       k_descale=dev_descales[1], v_descale=dev_descales[2], **fp8_dtype)
    check_fp8_error(_host(out), _host(lse), q, k, v, descales, 1.0 / math.sqrt(headdim), CAUSAL if causal else None)


@pytest.mark.gpu
@pytest.mark.skipif(P.SIMULATOR, reason="sizes the simulator cannot afford; needs a GPU")
@pytest.mark.parametrize("schedule", ["overlap", "pingpong", "fma3"])
@pytest.mark.parametrize("case", [c for c in FP8_GPU_CASES if c[0] <= 128],
                         ids=["-".join(map(str, c)) for c in FP8_GPU_CASES if c[0] <= 128])
def test_fp8_schedules_gpu(case, schedule, xp, monkeypatch):
    # The fp8 forward's overlapped loop, alone and with the consumers' turns, and the plain loop with
    # 3 of each row's 16 key groups' exponentials on the FMA pipes (options, timed by
    # scripts/fp8_parts.py), planned in place of the plain loop for the public call above.
    import dataclasses

    from nbflash import configs

    planned = configs.sm90_fp8_forward_config
    options = {"fma3": {"exp2_fma_groups": 3}, "overlap": {"overlap": True},
               "pingpong": {"overlap": True, "pingpong": True}}[schedule]
    monkeypatch.setattr(configs, "sm90_fp8_forward_config", lambda headdim, variant: dataclasses.replace(
        planned(headdim, variant), **options))
    test_fp8_forward_gpu(case, xp)


# --- The GPU: the same kernel at sizes the simulator cannot afford -----------------------------------

GPU_CASES = [
    # (dtype, headdim, variant, batch, seqlen_q, seqlen_k, nheads, nheads_k)
    ("float16", 64, PLAIN, 2, 113, 203, 4, 2),
    ("float16", 128, PLAIN, 1, 1023, 1024, 2, 2),
    ("bfloat16", 128, WINDOW, 2, 203, 113, 4, 1),
    ("float16", 128, WINDOW, 1, 1024, 1024, 2, 1),
    ("bfloat16", 64, WINDOW, 1, 1, 1, 1, 1),
    ("float16", 96, WINDOW, 1, 300, 1000, 3, 1),
    ("bfloat16", 128, PLAIN, 2, 2048, 2048, 2, 2),
    ("float16", 64, WINDOW, 1, 4096, 4000, 2, 2),
    ("float16", 256, PLAIN, 2, 113, 203, 4, 2),
    ("bfloat16", 256, WINDOW, 1, 1023, 1024, 2, 1),
    ("float16", 200, WINDOW, 2, 203, 113, 2, 2),
]


@pytest.mark.gpu
@pytest.mark.skipif(P.SIMULATOR, reason="sizes the simulator cannot afford; needs a GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=["-".join(map(str, c[:2] + ("w" if c[2].window else "p",) + c[3:]))
                                                  for c in GPU_CASES])
@pytest.mark.parametrize("schedule", ["stages2", "stages3", "overlap", "pingpong", "n176", "fma4"])
def test_forward_sm90_gpu(case, schedule, xp):
    # fma4: 4 of each row's key groups with P's exponentials on the FMA pipes (exp2_fma_groups)
    dtype, headdim, variant, batch, seqlen_q, seqlen_k, nheads, nheads_k = case
    if headdim > 128 and schedule in ("n176", "stages3"):
        pytest.skip("more than 227 KB of shared memory at this headdim")
    block_n = 176 if schedule == "n176" else 128 if headdim <= 128 else 80
    config = Sm90ForwardConfig(dtype, headdim, variant, block_n=block_n,
                               stages=3 if schedule == "stages3" else 2, overlap=schedule in ("overlap", "pingpong"),
                               pingpong=schedule == "pingpong", exp2_fma_groups=4 if schedule == "fma4" else 0)
    check(config, xp, batch, seqlen_q, seqlen_k, nheads, nheads_k, seed=seqlen_q)


BOX = (1, 16, 1, 64)
BOX_ELEMS = 16 * 64
TILE_ALIGNMENT = H.TILE_ALIGNMENT  # a global name: Numba needs the alignment as a literal


@cuda.jit
def _tma_4d_kernel(tensor_map, corners, out):
    # Thread 0 loads one box per phase of one mbarrier; everyone waits, then copies the image out.
    t = cuda.threadIdx.x
    bar_word = cuda.shared.array(1, uint64)
    tile = cuda.shared.array(BOX_ELEMS, uint16, alignment=TILE_ALIGNMENT)
    bar = P.shared_address(bar_word)
    tmap = H.array_address(tensor_map)
    if t == 0:
        H.mbarrier_init(bar, 1)
        H.fence_mbarrier_init()
        H.fence_proxy_tensormap_acquire(tmap)  # the map was copied from the host
    cuda.syncthreads()  # the barrier is initialised before anyone waits on it
    for p in range(corners.shape[0]):
        if t == 0:
            H.mbarrier_arrive_expect_tx(bar, BOX_ELEMS * 2)  # the full box, even out of bounds
            H.tma_load_4d(P.shared_address(tile), tmap, corners[p, 0], corners[p, 1], corners[p, 2],
                          corners[p, 3], bar)
        H.mbarrier_wait(bar, p % 2)
        for i in range(t, BOX_ELEMS, 32):
            out[p, i] = tile[i]
        cuda.syncthreads()  # the box is read by all before the next load overwrites it


def test_tensor_map_4d_box():
    # The 4-D map (the emulation's, or on the GPU the driver's) against NumPy: boxes inside, past the
    # end of dim 1 and of the last dim (zeros), of a strided view (rows of 72 in strides of 80).
    xp = np
    if not P.SIMULATOR:
        import cupy as xp
    x_full = np.random.default_rng(1).integers(0, 1 << 16, size=(2, 40, 3, 80), dtype=np.uint16)
    x = x_full[:, :, :, :72]
    corners = np.array([[0, 1, 0, 0], [8, 2, 30, 1], [64, 0, 32, 1]], dtype=np.int32)  # (c0, c1, c2, c3)
    x_dev = xp.asarray(x_full)[:, :, :, :72]
    tensor_map = H.make_tensor_map_4d(x_dev, BOX, H.SWIZZLE_128B)
    out = xp.zeros((len(corners), BOX_ELEMS), dtype=np.uint16)
    _tma_4d_kernel[1, 32](tensor_map, xp.asarray(corners), out)
    out = out.get() if hasattr(out, "get") else out
    padded = np.zeros((2, 40 + 16, 3, 72 + 64), dtype=np.uint16)
    padded[:, :40, :, :72] = x
    r, kk = np.meshgrid(np.arange(16), np.arange(64), indexing="ij")
    offsets = (r // 8) * 1024 + (r % 8) * 128 + (((kk // 8) ^ (r % 8)) * 16) + (kk % 8) * 2  # K-major 128B
    for p, (c0, c1, c2, c3) in enumerate(corners):
        image = np.zeros(BOX_ELEMS, dtype=np.uint16)
        image[offsets.ravel() // 2] = padded[c3, c2:c2 + 16, c1, c0:c0 + 64].ravel()
        np.testing.assert_array_equal(out[p], image)


# --- The public API on the "sm90" family -----------------------------------------------------------

def test_public_api_sm90(monkeypatch, xp):
    # flash_attn_func under kernel_family("sm90") plans this kernel (explain says so), launches it
    # with the tensor maps the launcher makes, and returns out and lse within the budget.
    import nbflash
    from tests.helpers import assert_attention_close, poison_allocations, random_qkv

    poison_allocations(monkeypatch)
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, xp, 1, 20, 33, 2, 1, 64, "float16")
    with nbflash.kernel_family("sm90"):
        assert nbflash.explain(q, k, v, causal=True)["family"] == "sm90"
        out, lse, _ = nbflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert_attention_close(out, lse, q, k, v, True)


def test_sm90_refuses_what_it_does_not_serve(xp):
    import nbflash

    rng = np.random.default_rng(8)
    q, k, v = (x[0] for x in random_qkv_small(rng, xp))  # one packed sequence of 8: (total, heads, headdim)
    cu_seqlens = xp.asarray(np.array([0, 8], np.int32))
    with nbflash.kernel_family("sm90"), pytest.raises(ValueError, match="kernel family 'sm90' cannot run"):
        nbflash.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, 8, 8)


def random_qkv_small(rng, xp):
    from tests.helpers import random_qkv

    return random_qkv(rng, xp, 1, 8, 8, 1, 1, 64, "float16")


@pytest.mark.gpu
@pytest.mark.skipif(P.SIMULATOR, reason="sizes the simulator cannot afford; needs a GPU")
@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_public_api_sm90_gpu(monkeypatch, xp, heads_first, causal):
    # The planned configs (nbflash.configs.SM90_FORWARD) through flash_attn_func, on both layouts a
    # model hands over (heads-first views make the tensor maps' strides non-monotonic), GQA 4:1.
    import nbflash
    from tests.helpers import assert_attention_close, poison_allocations, random_qkv

    poison_allocations(monkeypatch)
    rng = np.random.default_rng(11)
    for headdim, dtype in ((64, "bfloat16"), (128, "float16")):
        q, k, v = random_qkv(rng, xp, 2, 517, 300, 8, 2, headdim, dtype, heads_first=heads_first)
        with nbflash.kernel_family("sm90"):
            assert nbflash.explain(q, k, v, causal=causal)["family"] == "sm90"
            out, lse, _ = nbflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        assert_attention_close(out, lse, q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.skipif(P.SIMULATOR, reason="the simulator keeps the mma family as the default")
def test_sm90_is_the_default_where_measured_faster(xp):
    import nbflash
    from tests.helpers import random_qkv

    rng = np.random.default_rng(12)
    for headdim, expected in ((64, "sm90"), (128, "sm90"), (256, "sm90"), (96, "sm80"), (40, "sm80")):
        q, k, v = random_qkv(rng, xp, 1, 8, 8, 1, 1, headdim, "bfloat16")
        assert nbflash.explain(q, k, v, causal=True)["family"] == expected, headdim
