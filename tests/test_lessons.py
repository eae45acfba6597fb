"""The workshop lessons in kernels/ run and compute attention to float32 accuracy.

Each lesson is loaded by path (kernels/ is not a package) and its ``main`` called at a small size:
in the simulator with no GPU (tests/conftest.py switches), on the GPU when there is one. ``main``
returns the max error against the float64 reference, which must stay within the float32 error of a
naive implementation (about 1e-7 here) with room to spare.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
TOLERANCE = 2e-6  # float32 attention at these sizes is off by ~3e-7

# (seqlen_q, seqlen_k, headdim, causal): a square problem, then awkward lengths with causal masks
# in both directions (for 29 queries over 13 keys the first 16 rows see no key and must give 0).
SHAPES = [(24, 24, 16, False), (21, 35, 12, True), (29, 13, 8, True)]
LESSONS = ["01", "02", "03", "04", "05"]


def load(prefix):
    """A lesson module by the start of its file name; kernels/ goes on sys.path for ``_common``."""
    if KERNELS not in sys.path:
        sys.path.insert(0, KERNELS)
    (filename,) = [f for f in os.listdir(KERNELS) if f.startswith(prefix) and f.endswith(".py")]
    spec = importlib.util.spec_from_file_location(f"lesson_{prefix}", os.path.join(KERNELS, filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernels_is_not_a_package():
    # A top-level importable `kernels` would shadow the PyPI package of that name.
    assert not os.path.exists(os.path.join(KERNELS, "__init__.py"))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "q{}-k{}-d{}{}".format(*s[:3], "-causal" * s[3]))
@pytest.mark.parametrize("prefix", LESSONS)
def test_lesson_matches_float64(prefix, shape):
    seqlen_q, seqlen_k, headdim, causal = shape
    error = load(prefix).main(seqlen_q, seqlen_k, headdim, causal)
    assert error < TOLERANCE


def test_lesson_runs_as_a_script():
    # As the workshop runs it: `python kernels/05_flash2_causal.py ...` from the repository root.
    args = [sys.executable, os.path.join(KERNELS, "05_flash2_causal.py")]
    args += ["--seqlen", "20", "--seqlen-k", "30", "--headdim", "8", "--causal"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "max |out - float64|" in result.stdout
    assert "K/V tiles visited" in result.stdout


def test_reading_lesson():
    result = load("06").main(32, 32, 16, True)
    if result is None:
        pytest.skip("nbflash's tensor-core kernel is not available to read or run yet")
    error, allowed = result
    assert error <= allowed


def test_lesson_08_reading_sm90():
    # Lesson 08 reads the Hopper kernel: every file:line it points at is still found, its layout
    # claims hold for every thread of a warpgroup, and where the sm90 kernel runs (the simulator, or
    # compute capability 9.0) its probe kernel confirms them and the library's kernel matches float64
    # (causal, seqlen_q != seqlen_k).
    result = load("08").main(24, 40, 16, True)
    assert result["missing"] == []
    assert result["layout"]
    if result["error"] is None:
        pytest.skip("the sm90 kernel runs only on compute capability 9.0")
    assert result["probe"] and all(result["probe"].values()), result["probe"]
    assert result["error"] <= result["allowed"]



def test_lesson_09_reading_sm90_backward():
    # Lesson 09 reads the Hopper backward: every file:line it points at is still found, the dS^T
    # store and the transposed read meet, and where the sm90 kernels run the library's backward
    # matches float64 (causal, seqlen_q != seqlen_k).
    result = load("09").main(40, 50, 64, True)
    assert result["missing"] == []
    assert result["layout"]
    if result["error"] is None:
        pytest.skip("the sm90 kernel runs only on compute capability 9.0")
    assert result["error"] <= result["allowed"]


# Lesson 07, flash-decoding: lengths in tiles of n = BLOCK_N keys (8 in the simulator, 16 on a GPU),
# so that every case splits the keys the same way on both; each case lists the key tiles each split
# gets (split s: tiles [s * t, (s + 1) * t), t = ceil(key tiles / num_splits)), and the test checks it.
# (name, seqlen_q(n), seqlen_k(n), headdim, nheads, num_splits, causal, key tiles per split)
DECODE_CASES = [
    # 5 key tiles, the last one partial, over 3 splits that do not divide them.
    ("uneven-splits", lambda n: 1, lambda n: 5 * n - 3, 16, 2, 3, False, [2, 2, 1]),
    # 5 tiles over 4 splits: the last split is empty, though there are more tiles than splits.
    ("empty-split", lambda n: 1, lambda n: 5 * n - 1, 12, 3, 4, False, [2, 2, 1, 0]),
    # More splits than key tiles.
    ("more-splits-than-tiles", lambda n: 1, lambda n: 2 * n + 1, 8, 1, 5, False, [1, 1, 1, 0, 0]),
    # Many query tokens, causal, 5 more queries than keys: the first 5 rows see no key in any split
    # (out must be 0 and lse -inf).
    ("queries-before-keys", lambda n: n + 4, lambda n: n - 1, 8, 2, 2, True, [1, 0]),
    # Causal with more keys than queries: the diagonal ends the first Q tile's keys inside a split.
    ("causal-cut", lambda n: 2 * n + 3, lambda n: 3 * n + 5, 12, 1, 3, True, [2, 2, 0]),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda case: case[0])
def test_flash_decoding_matches_float64(case):
    lesson = load("07")
    _, seqlen_q, seqlen_k, headdim, nheads, num_splits, causal, tiles_per_split = case
    seqlen_q, seqlen_k = seqlen_q(lesson.BLOCK_N), seqlen_k(lesson.BLOCK_N)
    key_tiles = -(-seqlen_k // lesson.BLOCK_N)
    t = -(-key_tiles // num_splits)
    assert [max(0, min(key_tiles, (s + 1) * t) - s * t) for s in range(num_splits)] == tiles_per_split
    error = lesson.main(seqlen_q, seqlen_k, headdim, causal, nheads=nheads, num_splits=num_splits)
    assert error < TOLERANCE


def test_flash_decoding_runs_as_a_script():
    # The default decode step (one query token); on a GPU the script also times it and prints the
    # speedup, in the simulator it says why it does not.
    args = [sys.executable, os.path.join(KERNELS, "07_flash_decoding.py")]
    args += ["--seqlen-k", "30", "--headdim", "8", "--nheads", "2", "--splits", "3"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "max |out - float64|" in result.stdout
    assert "2 heads, 3 splits" in result.stdout
    simulator = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    assert ("speedup: not measured" in result.stdout) == simulator
    assert ("speedup over one split" in result.stdout) == (not simulator)
