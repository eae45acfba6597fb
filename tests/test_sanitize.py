"""scripts/sanitize.py: it reads every tool's summary, and its planted fault is one memcheck can see.

Both were wrong in the first run on the H200: racecheck's summary line is not ``ERROR SUMMARY``
(every racecheck run read as "no summary"), and the planted write landed on the last element of
its allocation, in bounds (memcheck reported 0 errors, the table said the sanitizer missed our
kernels).
"""

import importlib.util
import os

import numpy as np
import pytest
from .conftest import SIMULATOR

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "sanitize.py")


@pytest.fixture(scope="module")
def sanitize():
    spec = importlib.util.spec_from_file_location("sanitize", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The tails of sanitized runs as compute-sanitizer printed them on the H200 (clean), and with findings.
MEMCHECK_CLEAN = "========= COMPUTE-SANITIZER\ncase forward: ok in 1.8 s\n========= ERROR SUMMARY: 0 errors\n"
RACECHECK_CLEAN = ("========= COMPUTE-SANITIZER\ncase forward: ok in 4.0 s\n"
                   "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")


def test_summaries_of_every_tool(sanitize):
    assert sanitize._errors(MEMCHECK_CLEAN) == 0
    assert sanitize._errors("========= ERROR SUMMARY: 1 error\n") == 1
    assert sanitize._errors("========= ERROR SUMMARY: 12 errors\n") == 12
    assert sanitize._errors(RACECHECK_CLEAN) == 0
    assert sanitize._errors("========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n") == 1
    assert sanitize._errors("========= RACECHECK SUMMARY: 3 hazards displayed (0 errors, 3 warnings)\n") == 3
    assert sanitize._errors("========= COMPUTE-SANITIZER\nTraceback (most recent call last):\n") is None


def test_planted_write_lands_past_its_allocation(sanitize):
    """The planted kernel writes element ``x.shape[0]`` of the array it is given; that array must
    be a whole allocation (a view short of one leaves the write inside it, where memcheck is right
    to see nothing)."""
    import nbflash.runtime as runtime

    xp = np if SIMULATOR else runtime.cupy()
    x = sanitize.planted_target(xp)
    assert x.base is None and x.flags.c_contiguous  # owns its memory: a view of a larger array would not
    assert x.nbytes % 512 == 0 and x.nbytes % (2 << 20) != 0  # CuPy's rounding; ends inside a driver page
    if not SIMULATOR:
        assert x.data.mem.size == x.nbytes  # CuPy: the allocation ends where the array does


def test_a_slow_warm_up_is_a_row_not_a_traceback(sanitize, monkeypatch, capsys):
    """Each case first runs unsanitized, compiling its kernels on a cold cache (the sm90_backward
    case took over 100 s on the H200 so); past --warm-timeout that is the table's row for the case,
    the other cases still run, and the exit status says something failed."""
    import subprocess

    calls = []

    def run(command, **kwargs):
        calls.append((command, kwargs["timeout"]))
        if "--tool" not in command and "sm90_backward" in command:
            raise subprocess.TimeoutExpired(command, kwargs["timeout"])
        return subprocess.CompletedProcess(command, 0, MEMCHECK_CLEAN, "")

    monkeypatch.setattr(sanitize.subprocess, "run", run)
    status = sanitize.main(["--cases", "sm90_backward", "forward", "--tools", "memcheck", "--warm-timeout", "7",
                            "--timeout", "3", "--sanitizer", "compute-sanitizer"])
    table = capsys.readouterr().out
    assert status == 1
    assert "sm90_backward  (unsanitized)  timed out  (over --warm-timeout 7 s" in table
    assert "forward        memcheck       clean" in table
    assert [timeout for command, timeout in calls] == [7, 7, 3]  # the warm-ups' limit, then the sanitized run's
