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
