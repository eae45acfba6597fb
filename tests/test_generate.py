"""scripts/generate.py: the CuPy model's logits, prefill and decode through flash_attn_with_kvcache
with a paged cache, against the same model in float64 NumPy."""

import os
import sys

import numpy as np
import pytest

from .conftest import SIMULATOR

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def load():
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    import generate

    return generate


def test_logits_match_float64_model(xp):
    generate = load()
    if SIMULATOR:
        config = generate.Config(vocab=48, dim=16, layers=1, heads=1, kv_heads=1, hidden=32, max_len=16, page_size=4)
        prompts, new_tokens = [[3, 1, 4, 1, 5, 9], [2, 7]], 3
    else:
        config = generate.Config(vocab=256, dim=128, layers=2, heads=4, kv_heads=2, hidden=256, max_len=160,
                                 page_size=16)
        prompts, new_tokens = [list(range(5, 105)), [1, 2, 3], list(range(40))], 8
    weights = generate.random_weights(config, seed=3)
    model = generate.Model(config, weights, xp)
    tokens, _, _, chosen_from = model.generate(prompts, new_tokens)
    for prompt, sequence, logits in zip(prompts, tokens, chosen_from):
        assert len(sequence) == len(prompt) + new_tokens and sequence[:len(prompt)] == prompt
        reference = generate.reference_logits(config, weights, sequence[:-1])
        for step, row in enumerate(logits):  # the logits at the position each new token was chosen
            expected = reference[len(prompt) - 1 + step]
            error = np.abs(row.astype(np.float64) - expected).max()
            assert error <= 2e-2 * max(1.0, np.abs(expected).max()), f"step {step}: logits off by {error:.3g}"
            top2 = np.sort(expected)[-2:]
            if top2[1] - top2[0] > 0.1:  # a clear winner: greedy picks the float64 model's token
                assert sequence[len(prompt) + step] == int(np.argmax(expected))


@pytest.mark.skipif(not SIMULATOR, reason="the simulator-size command line; on a GPU the test above runs a larger model")
def test_main_runs_tiny(capsys):
    load().main(["--tiny", "--batch", "1", "--new-tokens", "2"])
    printed = capsys.readouterr().out
    assert "not GPU times" in printed and "tokens/s" in printed
