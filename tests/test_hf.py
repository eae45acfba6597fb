"""nbflash.hf: nbflash as transformers' attention implementation "nbattn", against "sdpa" on small
random Llama- and Mistral-style models (GQA: 4 query heads over 2 key/value heads, head dim 64).

The GPU tests run the kernels (float16: one dtype and one head dim, so few kernels compile). The
others need torch and transformers but no GPU: the registration, the mask function, the fallback
to SDPA off the GPU, and the mapping of transformers' calls to ``flash_attn_func``, with nbflash's
float64 reference standing in for the kernels on the CPU.
"""

import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("nbflash.hf needs transformers >= 5", allow_module_level=True)

from nbflash import hf  # noqa: E402

NAME = hf.register()
STRICT = hf.register("nbattn_strict", strict=True)  # the GPU tests: a fallback would raise

CONFIG = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=256, pad_token_id=0, bos_token_id=None,
              eos_token_id=None, initializer_range=0.1)  # 0.1: logits spread enough for greedy decoding to mean something
SLIDING_WINDOW = 16  # Mistral's window, shorter than the sequences below so that it masks


def models(*names, kind="llama"):
    """One randomly initialised float32 CPU model per attention implementation, all with the same weights."""
    if kind == "llama":
        config_class, model_class, extra = transformers.LlamaConfig, transformers.LlamaForCausalLM, {}
    else:
        config_class, model_class = transformers.MistralConfig, transformers.MistralForCausalLM
        extra = {"sliding_window": SLIDING_WINDOW}
    torch.manual_seed(0)
    built = []
    for name in names:
        model = model_class(config_class(**CONFIG, **extra, attn_implementation=name))
        if built:
            model.load_state_dict(built[0].state_dict())
        built.append(model.eval())
    return built


def batch(padding, device="cpu", seqlen=40):
    """Two sequences of random tokens and their attention mask: row 0 padded on the left (as for
    generation), row 1 on the right (as for training), when ``padding``."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, CONFIG["vocab_size"], (2, seqlen), generator=generator)
    mask = torch.ones(2, seqlen, dtype=torch.long)
    if padding:
        mask[0, :9] = 0
        mask[1, -6:] = 0
        ids[mask == 0] = CONFIG["pad_token_id"]
    return ids.to(device), mask.to(device)


def left_padded_prompts(device="cpu", seqlen=24):
    ids, mask = batch(False, device, seqlen)
    mask[0, :7] = 0
    ids[mask == 0] = CONFIG["pad_token_id"]
    return ids, mask


def greedy(model, ids, mask, new_tokens=10):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                          do_sample=False, output_scores=True, return_dict_in_generate=True)


def assert_same_greedy_tokens(ours, theirs, prompt, tie):
    """Our greedy tokens are theirs up to the first step where the two runs pick differently, and
    there their scores of the two picks are within ``tie`` times the largest score (a near tie,
    which rounding may break either way); on every step before, the scores agree as closely."""
    tokens, expected = ours.sequences[:, prompt:], theirs.sequences[:, prompt:]
    assert tokens.shape == expected.shape
    scale = max(score.float().abs().max().item() for score in theirs.scores)
    for row in range(tokens.shape[0]):
        differ = (tokens[row] != expected[row]).nonzero()
        steps = int(differ[0]) if len(differ) else tokens.shape[1]
        for step in range(steps):
            gap = (ours.scores[step][row].float() - theirs.scores[step][row].float()).abs().max().item()
            assert gap <= tie * scale, f"row {row}, step {step}: scores differ by {gap:.3g} (largest {scale:.3g})"
        if steps < tokens.shape[1]:
            scores = theirs.scores[steps][row].float()
            margin = (scores[expected[row, steps]] - scores[tokens[row, steps]]).item()
            assert margin <= tie * scale, (f"row {row} diverges at step {steps} where the reference's pick leads by "
                                           f"{margin:.3g}: {tokens[row].tolist()} vs {expected[row].tolist()}")


# ---------------------------------------------------------------------------------------------------
# Without a GPU: registration, the mask function, the fallback, the mapping to flash_attn_func
# ---------------------------------------------------------------------------------------------------


def test_registered_under_a_name_without_flash():
    from transformers import AttentionInterface, AttentionMaskInterface

    assert NAME == "nbattn" and "flash" not in NAME.lower()
    for name in (NAME, STRICT):
        assert name in AttentionInterface() and name in AttentionMaskInterface()
    # transformers would read these as Hub kernels (or its own implementations)
    for bad in ("nbflash", "my_FlashAttention", "org/kernel", "sdpa"):
        with pytest.raises(ValueError, match="name="):
            hf.register(bad)
    with pytest.raises(TypeError, match="strict"):
        hf.register("nbattn_other", strict="yes")


def test_without_transformers_register_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    with pytest.raises(ImportError, match="pip install 'transformers>=5'"):
        hf.register()


def test_mask_function_gives_padded_batches_their_mask():
    """No padding: None (plain causal, nbflash's own causal mask). Padding: SDPA's boolean mask,
    with the narrowest window holding it, causal (-1, 0), or the sliding window's (w - 1, 0)."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    _, padding = batch(True, seqlen=12)
    assert hf.mask_function(batch_size=2, q_length=12, kv_length=12, attention_mask=torch.ones(2, 12).bool()) is None
    mask = hf.mask_function(batch_size=2, q_length=12, kv_length=12, attention_mask=padding.bool())
    assert torch.equal(mask, sdpa_mask(batch_size=2, q_length=12, kv_length=12, attention_mask=padding.bool()))
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 12, 12)
    assert mask._nbflash_window == (-1, 0)
    sliding = hf.mask_function(batch_size=2, q_length=12, kv_length=12, local_size=5, attention_mask=padding.bool(),
                               mask_function=sliding_window_causal_mask_function(5))
    assert sliding._nbflash_window == (4, 0)
    # one decode step with a cache of 12 keys: every key of the unpadded row is seen
    step = hf.mask_function(batch_size=2, q_length=1, kv_length=12, q_offset=11, attention_mask=padding.bool())
    assert step.shape == (2, 1, 1, 12) and step._nbflash_window == (-1, -1)


def test_narrowest_window():
    rows, cols = torch.arange(6)[:, None], torch.arange(9)[None, :]
    offset = 9 - 6  # bottom-right alignment
    band = (cols >= rows + offset - 2) & (cols <= rows + offset + 1)
    assert hf.narrowest_window(band) == (2, 1)
    assert hf.narrowest_window(torch.ones(2, 1, 6, 9, dtype=torch.bool)) == (-1, -1)
    assert hf.narrowest_window((cols <= rows + offset)[None, None]) == (-1, 0)
    assert hf.narrowest_window(torch.zeros(6, 9, dtype=torch.bool)) == (-1, -1)  # nothing kept: nothing to bound
    assert hf.narrowest_window((cols < rows + offset - 1)) == (-1, 0)  # a side inside the diagonal widens to it


def test_off_the_gpu_falls_back_to_sdpa_with_one_warning_or_raises_when_strict():
    sdpa, ours, strict = models("sdpa", NAME, STRICT)
    ids, mask = batch(True)
    hf._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        expected = sdpa(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
        again = ours(ids, attention_mask=mask).logits
    ours_warnings = [str(w.message) for w in caught if NAME in str(w.message)]
    assert len(ours_warnings) == 1 and "cpu" in ours_warnings[0] and "SDPA" in ours_warnings[0], ours_warnings
    assert torch.equal(got, expected) and torch.equal(again, expected)
    with pytest.raises(ValueError, match="strict.*cpu"), torch.no_grad():
        strict(ids, attention_mask=mask)


def test_attention_sinks_raise():
    module = torch.nn.Module()
    q = torch.zeros(1, 4, 3, 8)
    attention = transformers.AttentionInterface()[NAME]
    with pytest.raises(ValueError, match="s_aux"):
        attention(module, q, q, q, None, s_aux=torch.zeros(4))


@pytest.fixture
def reference_kernels(monkeypatch):
    """``nbflash.torch.flash_attn_func`` replaced by nbflash's float64 reference on CPU tensors,
    and the CPU let through: what nbflash.hf hands the kernels, checked without a GPU. Returns the
    list of calls made, (causal, window_size, mask kind, q shape, k shape)."""
    import nbflash.torch

    calls = []

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        bias=None):
        assert dropout_p == 0.0 and q.shape[-1] == 64 and k.shape[2] == 2  # GQA natively, no repeated heads
        calls.append((causal, window_size, None if bias is None else bias.dtype, tuple(q.shape), tuple(k.shape)))
        host = [x.detach().double().numpy() for x in (q, k, v)]
        out = nbflash.attention_reference(*host, softmax_scale, causal, window_size=window_size, softcap=softcap,
                                          bias=None if bias is None else bias.numpy())
        return torch.from_numpy(out).to(q.dtype)

    monkeypatch.setattr(nbflash.torch, "flash_attn_func", flash_attn_func)
    monkeypatch.setattr(hf, "_DEVICES", ("cuda", "cpu"))
    return calls


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("padding", [False, True], ids=["unpadded", "padded"])
def test_logits_through_the_reference_match_sdpa(reference_kernels, kind, padding):
    """float32 on the CPU: the calls nbflash.hf makes give SDPA's logits (at the tokens that are not padding)."""
    sdpa, ours = models("sdpa", STRICT, kind=kind)
    ids, mask = batch(padding)
    with torch.no_grad():
        expected, got = (model(ids, attention_mask=mask).logits for model in (sdpa, ours))
    kept = mask.bool()
    assert (got[kept] - expected[kept]).abs().max().item() < 1e-4
    causal, window, mask_kind, _, _ = reference_kernels[0]
    if kind == "llama" and not padding:
        assert (causal, window, mask_kind) == (True, (-1, -1), None)  # no mask tensor at all
    else:  # the mask as a bool tensor, and the band the kernels may skip outside of
        assert (causal, mask_kind) == (False, torch.bool)
        assert window == ((-1, 0) if kind == "llama" else (SLIDING_WINDOW - 1, 0))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_through_the_reference_matches_sdpa(reference_kernels, cache):
    """Left-padded prompts, greedy decoding on a dynamic cache (the keys so far each step) and a
    static one (prefill sees the cache's empty slots too, which nbflash.hf drops): SDPA's tokens."""
    sdpa, ours = models("sdpa", STRICT)
    ids, mask = left_padded_prompts()
    kwargs = {} if cache == "dynamic" else {"cache_implementation": "static"}
    with torch.no_grad():
        expected = sdpa.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **kwargs)
        got = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **kwargs)
    assert torch.equal(got, expected)
    decode = [call for call in reference_kernels if call[3][1] == 1]
    assert decode and all(call[2] == torch.bool for call in decode)  # each step masks the padding


def test_static_cache_prefill_drops_the_empty_slots(reference_kernels):
    """An unpadded prompt into a static cache: no mask tensor, and the keys cut to the prompt's."""
    sdpa, ours = models("sdpa", STRICT)
    ids = batch(False, seqlen=10)[0]
    with torch.no_grad():
        expected = sdpa.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static")
        got = ours.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static")
    assert torch.equal(got, expected)
    causal, window, mask_kind, q_shape, k_shape = reference_kernels[0]
    assert (causal, mask_kind) == (True, None) and k_shape[1] == q_shape[1] == 10


# ---------------------------------------------------------------------------------------------------
# On the GPU: the kernels against SDPA, float16
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("padding", [False, True], ids=["unpadded", "padded"])
def test_logits_match_sdpa(kind, padding):
    """float16 logits at the tokens that are not padding: ours within twice SDPA's error against the
    same model in float32 (plus a floor), and finite everywhere (a query that sees no key, a
    left-padded one, gets 0 from nbflash)."""
    reference, sdpa, ours = models("sdpa", "sdpa", STRICT, kind=kind)
    reference.cuda()
    sdpa.cuda().half()
    ours.cuda().half()
    ids, mask = batch(padding, "cuda")
    with torch.no_grad():
        exact, theirs, got = (model(ids, attention_mask=mask).logits.float() for model in (reference, sdpa, ours))
    assert got.isfinite().all()
    kept = mask.bool()
    error = (got[kept] - exact[kept]).abs().max().item()
    sdpa_error = (theirs[kept] - exact[kept]).abs().max().item()
    budget = 2 * sdpa_error + 1e-3 * exact.abs().max().item()
    assert error <= budget, f"error {error:.3g} > budget {budget:.3g} (SDPA's {sdpa_error:.3g})"


@pytest.mark.gpu
def test_training_gradients_match_sdpa():
    """Training on a padded batch under float16 autocast (float32 weights), measured against the
    float32 run (SDPA, no autocast) and held to SDPA's own autocast error: every parameter's gradient
    within twice SDPA's error (plus a floor), then a few SGD steps whose losses stay within twice
    SDPA's drift from the float32 losses (plus a floor) and fall. The steps are large (the loss halves
    in one), so a gradient differing in its last float16 bits moves later losses by percents: only
    a comparison with SDPA's own drift tells rounding from a wrong gradient.
    (AdamW's first steps are not a fair check: they move every weight by about lr times the sign of
    its gradient, so float16 rounding on gradients near zero changes the loss by percents.)
    Rotary embeddings leave query and key float32 and value half under autocast; nbflash.hf casts
    them as autocast casts SDPA's."""
    ids, mask = batch(True, "cuda")
    labels = ids.masked_fill(mask == 0, -100)
    exact_model, sdpa, ours = (model.cuda().train() for model in models("sdpa", "sdpa", STRICT))

    def gradient(model, autocast):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
            model(ids, attention_mask=mask, labels=labels).loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    exact = gradient(exact_model, False)
    theirs, got = gradient(sdpa, True), gradient(ours, True)
    assert got.isfinite().all()
    error = ((got - exact).norm() / exact.norm()).item()
    sdpa_error = ((theirs - exact).norm() / exact.norm()).item()
    assert error <= 2 * sdpa_error + 1e-3, f"gradient error {error:.3g} (SDPA's {sdpa_error:.3g})"

    losses = {}
    for name, model, autocast in (("float32", exact_model, False), ("sdpa", sdpa, True), ("ours", ours, True)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        losses[name] = []
        for _ in range(4):
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
                loss = model(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    for exact_loss, theirs_loss, our_loss in zip(losses["float32"], losses["sdpa"], losses["ours"]):
        drift = abs(theirs_loss - exact_loss)
        assert abs(our_loss - exact_loss) <= 2 * drift + 5e-3 * exact_loss, losses
    assert losses["ours"][-1] < losses["ours"][0], losses


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_greedy_generation_matches_sdpa(kind):
    """float16 greedy decoding of left-padded prompts (the Mistral ones longer than its window):
    SDPA's tokens, up to a near tie that float16 rounding may break either way."""
    sdpa, ours = (model.cuda().half() for model in models("sdpa", STRICT, kind=kind))
    ids, mask = left_padded_prompts("cuda", seqlen=24)
    with torch.no_grad():
        expected, got = greedy(sdpa, ids, mask, 12), greedy(ours, ids, mask, 12)
    assert_same_greedy_tokens(got, expected, ids.shape[1], tie=1e-2)
