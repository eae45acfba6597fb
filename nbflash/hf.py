"""nbflash as an attention implementation of HuggingFace transformers (5.x): ``attn_implementation="nbattn"``.

    import nbflash.hf, transformers
    nbflash.hf.register()                     # once, before building or loading the model
    model = transformers.AutoModelForCausalLM.from_pretrained(name, attn_implementation="nbattn",
                                                              dtype=torch.bfloat16, device_map="cuda")

The name is "nbattn", not "nbflash": transformers 5 reads any implementation name containing "flash"
as a FlashAttention kernel to download from the Hub (``is_flash_attention_requested``) and fails.

``register`` adds two functions under one name: the attention function, which runs
``nbflash.torch.flash_attn_func`` (prefill, training, and each ``generate()`` step on the cache's full
keys and values), and the mask function, which gives the model SDPA's mask (``sdpa_mask``): None
when the mask is plain causal, else a boolean (batch, 1, seqlen_q, seqlen_k) tensor, True = kept
(padding, sliding windows, packed sequences, image-token overlays). nbflash takes that tensor as
its ``bias=`` mask, and the narrowest window holding it, measured once per forward when the mask is
made, as its ``window_size``, so the kernels skip the key tiles a causal or sliding mask leaves out.
GQA runs natively (no repeated keys and values).

What nbflash cannot run falls back to transformers' SDPA function with a warning (once per reason),
or raises ValueError with ``strict=True``: tensors off the GPU or of other dtypes, head dims above 256
or differing between keys and values, masks that are neither bool nor float tensors of the right
shape (a FlexAttention BlockMask), position biases. Attention sinks (``s_aux``), which neither runs,
raise. Attention weights are never returned (None, as with SDPA).

Importing nbflash.hf does not import transformers (``register`` does).
"""

import warnings

import torch

NAME = "nbattn"

# The narrowest window (left, right) holding a mask, in nbflash's bottom-right convention,
# as the mask function measured it: an attribute of the mask tensor it returns.
_WINDOW = "_nbflash_window"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DEVICES = ("cuda",)  # where the kernels run (the tests add "cpu", with the reference standing in)
_WARNED = set()


def register(name=NAME, strict=False):
    """Register nbflash with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``
    under ``name``; returns it, for ``attn_implementation=name``.

    ``strict=True``: raise ValueError where nbflash cannot run a call, instead of falling back to
    SDPA with a warning. Registering a name again replaces its functions (``register("nbattn_strict",
    strict=True)`` next to the default gives both).
    """
    try:
        import transformers
    except ImportError as error:
        raise ImportError("nbflash.hf needs HuggingFace transformers >= 5: pip install 'transformers>=5'") from error
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise ImportError(f"nbflash.hf needs transformers >= 5 (its AttentionMaskInterface), found "
                          f"{transformers.__version__}: pip install -U 'transformers>=5'")
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if "flash" in name.lower():
        raise ValueError(f"name={name!r} contains 'flash': transformers would take it for a FlashAttention "
                         f"kernel on the Hub and try to download it; choose another (the default is {NAME!r})")
    if "/" in name or ":" in name or name in ("eager", "sdpa", "flex_attention") or name.startswith("paged|"):
        raise ValueError(f"name={name!r} is a name transformers gives another meaning (a Hub kernel, or one of "
                         f"its own implementations); choose another (the default is {NAME!r})")
    if strict is not True and strict is not False:
        raise TypeError(f"strict must be a bool, got {strict!r}")
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, _attention_function(name, strict))
    AttentionMaskInterface.register(name, mask_function)
    return name


def mask_function(*args, **kwargs):
    """The mask transformers builds for ``name`` (its mask interface's arguments): SDPA's, None or a
    boolean (batch, 1, seqlen_q, seqlen_k) tensor. A tensor carries the narrowest window holding it,
    so that the kernels skip the key tiles outside; measuring it reads three numbers back from the
    GPU, once per mask and forward (making SDPA's mask already reads its padding back)."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.ndim == 4 and not _compiling():
        setattr(mask, _WINDOW, narrowest_window(mask))
    return mask


def narrowest_window(mask):
    """The narrowest ``window_size`` (left, right) holding every kept entry of a boolean ``mask``
    (..., seqlen_q, seqlen_k), aligned to the bottom-right corner as nbflash's windows are: query i
    sees key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, -1 for a side
    with no bound. A causal mask with padding gives (-1, 0); a sliding window of w keys, (w - 1, 0)."""
    seqlen_q, seqlen_k = mask.shape[-2:]
    kept = mask.reshape(-1, seqlen_q, seqlen_k).any(0)  # the union over batch rows and heads
    rows = kept.any(1)
    first = kept.to(torch.uint8).argmax(1)  # argmax gives the first of equal maxima
    last = seqlen_k - 1 - kept.flip(1).to(torch.uint8).argmax(1)
    diagonal = torch.arange(seqlen_q, device=mask.device) + seqlen_k - seqlen_q  # each row's bottom-right key
    none = torch.tensor(-1, device=mask.device)
    left, right, any_kept = torch.stack([torch.where(rows, diagonal - first, none).max(),
                                         torch.where(rows, last - diagonal, none).max(), rows.any()]).tolist()
    if not any_kept:
        return -1, -1
    # A side reaching past every row's last key (or first) bounds nothing.
    left = -1 if left >= seqlen_k - 1 else max(left, 0)
    right = -1 if right >= seqlen_q - 1 else max(right, 0)
    return left, right


def _compiling():
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and compiler.is_compiling()


def _attention_function(name, strict):
    def nbflash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                  sliding_window=None, softcap=None, is_causal=None, **kwargs):
        """transformers' attention function: query (batch, nheads, seqlen_q, headdim), key and value
        (batch, nheads_k, seqlen_k, headdim); returns (out (batch, seqlen_q, nheads, headdim), None)."""
        if kwargs.get("s_aux") is not None:
            raise ValueError(f"attn_implementation={name!r}: attention sinks (s_aux) are supported by neither "
                             f"nbflash nor SDPA; use attn_implementation='eager'")
        is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        q, k, v = _autocast(query, key, value)
        reason = _unsupported(q, k, v, attention_mask, is_causal, kwargs)
        if reason is not None:
            if strict:
                raise ValueError(f"attn_implementation={name!r} (strict): nbflash cannot run this call: {reason}")
            if reason not in _WARNED:
                _WARNED.add(reason)
                warnings.warn(f"attn_implementation={name!r}: nbflash cannot run {reason}; those calls run "
                              f"transformers' SDPA attention instead", stacklevel=2)
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          sliding_window=sliding_window, softcap=softcap, is_causal=is_causal,
                                          **kwargs)
        return _nbflash_attention(q, k, v, attention_mask, dropout, scaling, sliding_window, softcap, is_causal), None

    nbflash_attention_forward.__qualname__ = nbflash_attention_forward.__name__
    return nbflash_attention_forward


def _autocast(query, key, value):
    """Under autocast, the three in autocast's dtype, as SDPA (an autocast op) gets them; rotary
    embeddings in float32 make query and key float32 while value is already half."""
    device = query.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return tuple(x.to(dtype) for x in (query, key, value))
    return query, key, value


def _unsupported(q, k, v, mask, is_causal, kwargs):
    """Why nbflash cannot run this call (a phrase for the warning), or None when it can."""
    if q.device.type not in _DEVICES:
        return f"tensors on the {q.device.type} (nbflash runs on CUDA GPUs)"
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"query, key, value of dtypes {q.dtype}, {k.dtype}, {v.dtype} (float16, bfloat16 or float32, all one)"
    batch, nheads, seqlen_q, headdim = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    if headdim > 256 or k.shape[-1] != headdim or v.shape[-1] != headdim:
        return f"head dims {headdim}, {k.shape[-1]}, {v.shape[-1]} (one head dim, at most 256)"
    if nheads % nheads_k:
        return f"{nheads} query heads over {nheads_k} key/value heads (a multiple)"
    if kwargs.get("position_bias") is not None:
        return "a position bias (T5-style)"
    if mask is None:
        if is_causal and 1 < seqlen_q and seqlen_k < seqlen_q:
            return "a causal mask with fewer keys than queries and no mask tensor (SDPA aligns it top-left)"
        return None
    if not isinstance(mask, torch.Tensor):
        return f"an attention_mask of type {type(mask).__name__} (a bool or float tensor)"
    if mask.dtype != torch.bool and mask.dtype not in (q.dtype, torch.float32):
        return f"an attention_mask of dtype {mask.dtype} (bool, float32 or the query's dtype)"
    if mask.device != q.device:
        return "an attention_mask on another device than the query"
    target = (batch, nheads, seqlen_q, seqlen_k)
    if mask.ndim != 4 or any(n not in (1, m) for n, m in zip(mask.shape, target)):
        return f"an attention_mask of shape {tuple(mask.shape)} (one broadcasting to {target})"
    return None


def _nbflash_attention(q, k, v, mask, dropout, scaling, sliding_window, softcap, is_causal):
    """SDPA's semantics on nbflash's kernels, (batch, seqlen, heads, headdim) views of transformers'
    (batch, heads, seqlen, headdim) tensors (no copies)."""
    from .torch import flash_attn_func

    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if mask is None:
        # SDPA's causal mask is aligned top-left, and one query token sees every key. With more keys
        # than queries, the extra ones are a static cache's empty slots: dropped, the two alignments agree.
        causal = is_causal and seqlen_q > 1
        if causal and seqlen_k > seqlen_q:
            k, v = k[:, :seqlen_q], v[:, :seqlen_q]
        window = (-1, -1)
        if sliding_window:  # transformers' windows: causal, w keys up to the query's; else |i - j| <= w
            window = (sliding_window - 1, 0) if is_causal else (sliding_window, sliding_window)
    else:
        causal = False  # the mask holds everything, causality included
        window = getattr(mask, _WINDOW, (-1, -1)) if mask.shape[-2] == seqlen_q else (-1, -1)
    return flash_attn_func(q, k, v, dropout_p=dropout, softmax_scale=scaling, causal=causal, window_size=window,
                           softcap=softcap or 0.0, bias=mask)
