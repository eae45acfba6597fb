"""Named attention variants: the flash_attn_func arguments of each, shared by the tests and the
benchmarks (``scripts/bench.py --variant NAME``), so that what is measured is what is tested.

``variant_arguments(name, batch, nheads, seqlen_k, xp, seqlen_q)`` gives the keyword arguments for a
problem of that size (ALiBi slopes are an array of the problem's head count, windows scale with
seqlen_k, bias and mask tensors have the problem's lengths).
"""

import numpy as np


def noop_score(score, b, h, q_idx, kv_idx):
    """The identity: a user score_mod that changes nothing (FlexAttention's benchmarks call it
    "noop"), so that timing it measures what the score_mod hook itself costs."""
    return score


def noop_score_grad(score, b, h, q_idx, kv_idx):
    """noop_score's derivative with respect to the score."""
    return 1.0


# The score-mod variants' arguments: the identity and its derivative
NOOP_SCORE = {"score_mod": lambda b, h, m, n, xp: noop_score,
              "score_mod_grad": lambda b, h, m, n, xp: noop_score_grad}

DROPOUT_P = 0.2  # the dropout variants' probability, with a fixed seed (the same mask each call)

# name -> keyword arguments; a callable value is given (batch, nheads, seqlen_q, seqlen_k, xp) and
# returns the argument (so the user functions are wrapped in one).
# ``score_mod_grad`` is flash_attn_backward's (and the reference's) argument, not flash_attn_func's:
# ``forward_arguments`` leaves it out.
VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": lambda b, h, m, n, xp: (max(1, n // 4), 0)},  # a quarter of the keys, causal side
    "window-both": {"window_size": lambda b, h, m, n, xp: (max(1, n // 8), max(1, n // 16))},
    "softcap": {"softcap": 30.0},
    "causal-softcap": {"causal": True, "softcap": 30.0},
    "alibi": {"alibi_slopes": lambda b, h, m, n, xp: alibi_slopes(h, xp)},
    "causal-alibi": {"causal": True, "alibi_slopes": lambda b, h, m, n, xp: alibi_slopes(h, xp)},
    "bias": {"bias": lambda b, h, m, n, xp: position_bias(h, m, n, xp)},
    "causal-bias": {"causal": True, "bias": lambda b, h, m, n, xp: position_bias(h, m, n, xp)},
    "document-mask": {"bias": lambda b, h, m, n, xp: document_mask(m, n, xp)},
    # The same documents as a mask_mod (the benchmarks add its block mask, as FlexAttention's)
    "document-mask-mod": {"mask_mod": lambda b, h, m, n, xp: document_mask_mod(m, n)},
    "combined": {  # window + softcap + per-batch ALiBi
        "causal": True,
        "window_size": lambda b, h, m, n, xp: (max(1, n // 3), 0),
        "softcap": 20.0,
        "alibi_slopes": lambda b, h, m, n, xp: xp.asarray(
            (np.tile(alibi_slopes(h, np), (b, 1)) * (1 + np.arange(b))[:, None]).astype(np.float32)),
    },
    "dropout": {"dropout_p": DROPOUT_P, "seed": 2024},
    "causal-dropout": {"causal": True, "dropout_p": DROPOUT_P, "seed": 2024},
    "score-mod": NOOP_SCORE,
    "causal-score-mod": {"causal": True, **NOOP_SCORE},
}


def alibi_slopes(nheads, xp=np):
    """The ALiBi paper's slopes, 2^(-8 h / nheads) for h = 1 .. nheads, float32."""
    return xp.asarray(2.0 ** (-8.0 * np.arange(1, nheads + 1) / nheads), dtype=np.float32)


def position_bias(nheads, seqlen_q, seqlen_k, xp=np):
    """A T5-like relative-position bias, float32 (nheads, seqlen_q, seqlen_k): broadcast over batch."""
    distance = np.abs(np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q - np.arange(seqlen_k)[None, :])
    scale = np.linspace(0.5, 2.0, nheads)[:, None, None]
    return xp.asarray((-scale * np.log1p(distance)[None]).astype(np.float32))


def document_mask(seqlen_q, seqlen_k, xp=np, documents=3):
    """Packed sequences: a bool (seqlen_q, seqlen_k) mask, True where query and key belong to the
    same of ``documents`` equal runs (bottom-right aligned, as the kernels' windows)."""
    doc_q = (np.arange(seqlen_q) + seqlen_k - seqlen_q) * documents // seqlen_k
    doc_k = np.arange(seqlen_k) * documents // seqlen_k
    return xp.asarray(doc_q[:, None] == doc_k[None, :])


def document_mask_mod(seqlen_q, seqlen_k, documents=3):
    """``document_mask`` as a mask_mod: query and key in the same of ``documents`` equal runs. Plain
    integer arithmetic, so the one function compiles into nbflash's kernels and runs on
    FlexAttention's index tensors."""
    offset = seqlen_k - seqlen_q

    def same_document(b, h, q_idx, kv_idx):
        return (q_idx + offset) * documents // seqlen_k == kv_idx * documents // seqlen_k

    return same_document


def variant_arguments(name, batch, nheads, seqlen_k, xp=np, seqlen_q=None):
    """flash_attn_func keyword arguments of the named variant for a problem of this size."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; expected one of {sorted(VARIANTS)}")
    seqlen_q = seqlen_k if seqlen_q is None else seqlen_q
    return {key: value(batch, nheads, seqlen_q, seqlen_k, xp) if callable(value) else value
            for key, value in VARIANTS[name].items()}


def forward_arguments(arguments):
    """``variant_arguments``' result without what only the backward takes (``score_mod_grad``)."""
    return {key: value for key, value in arguments.items() if key != "score_mod_grad"}
