"""Named attention variants: the flash_attn_func arguments of each, shared by the tests and the
benchmarks (``scripts/bench.py --variant NAME``), so that what is measured is what is tested.

``variant_arguments(name, batch, nheads, seqlen_k, xp)`` gives the keyword arguments for a problem of
that size (ALiBi slopes are an array of the problem's head count; windows scale with seqlen_k when
given as a fraction).
"""

import numpy as np

# name -> keyword arguments; a callable value is given (batch, nheads, seqlen_k, xp).
VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": lambda b, h, n, xp: (max(1, n // 4), 0)},  # a quarter of the keys, causal side
    "window-both": {"window_size": lambda b, h, n, xp: (max(1, n // 8), max(1, n // 16))},
    "softcap": {"softcap": 30.0},
    "causal-softcap": {"causal": True, "softcap": 30.0},
    "alibi": {"alibi_slopes": lambda b, h, n, xp: alibi_slopes(h, xp)},
    "causal-alibi": {"causal": True, "alibi_slopes": lambda b, h, n, xp: alibi_slopes(h, xp)},
    "combined": {  # window + softcap + per-batch ALiBi
        "causal": True,
        "window_size": lambda b, h, n, xp: (max(1, n // 3), 0),
        "softcap": 20.0,
        "alibi_slopes": lambda b, h, n, xp: xp.asarray(
            (np.tile(alibi_slopes(h, np), (b, 1)) * (1 + np.arange(b))[:, None]).astype(np.float32)),
    },
}


def alibi_slopes(nheads, xp=np):
    """The ALiBi paper's slopes, 2^(-8 h / nheads) for h = 1 .. nheads, float32."""
    return xp.asarray(2.0 ** (-8.0 * np.arange(1, nheads + 1) / nheads), dtype=np.float32)


def variant_arguments(name, batch, nheads, seqlen_k, xp=np):
    """flash_attn_func keyword arguments of the named variant for a problem of this size."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; expected one of {sorted(VARIANTS)}")
    return {key: value(batch, nheads, seqlen_k, xp) if callable(value) else value
            for key, value in VARIANTS[name].items()}
