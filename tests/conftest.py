"""Test setup: with no GPU, run everything in Numba's CUDA simulator.

The switch must happen before Numba is first imported, which is why it sits at the top of the
conftest and checks for a GPU through CuPy alone.
"""

import os
import re
import zlib


def _gpu_present():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


if not _gpu_present():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped in the simulator)")


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (setup.cfg's default): in the simulator a worker per core and one more, at most 4
    (each loads Numba and runs the kernels in its own threads, which hand the GIL to each other
    through the kernel's futexes: a core idles in those hand-overs, which the extra worker fills;
    tests/test_backward_sm90.py on 2 cores: 404 s with 2 workers, 351 s with 3); on a GPU a worker
    per core, at most 8 (the workers share the device; more compile kernels at once than the cache
    can reuse)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores + 1, 4) if SIMULATOR else min(cores, 8))


# A node id: the file and test, then its parameters in brackets, which may hold spaces ("[old layout]").
# xdist's -v lines put the outcome first, a single process's -v lines after the id.
_NODE_ID = r"tests/[^\s\[]+(?:\[[^\]\n]*\])?"
_OUTCOME = r"(?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
RESULT_LINE = re.compile(rf"\b{_OUTCOME} ({_NODE_ID})|^({_NODE_ID}) {_OUTCOME}\b")


def reported_node_ids(paths):
    """The node ids that ``pytest -v`` logs at `paths` report a result for (xdist's lines too)."""
    done = set()
    for path in paths:
        with open(path, errors="replace") as log:
            for line in log:
                done.update(first or second for first, second in RESULT_LINE.findall(line))
    return done


def _resume(config, items):
    """With ``NBFLASH_RESUME_LOGS`` (``pytest -v`` logs, separated by os.pathsep), leave out the
    tests those logs already report: a suite longer than one sitting runs in parts, each part
    taking what the earlier ones did not reach."""
    logs = [p for p in os.environ.get("NBFLASH_RESUME_LOGS", "").split(os.pathsep) if p]
    if not logs:
        return
    done = reported_node_ids(logs)
    kept = [item for item in items if item.nodeid not in done]
    dropped = [item for item in items if item.nodeid in done]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_runtest_logreport(report):
    """With ``NBFLASH_DURATIONS_LOG``, each test phase that took more than half a second appends a
    line (seconds, phase, outcome, node id) to that file as it ends: a run cut off by a time limit
    still says where its time went (pytest's --durations prints only at the end). Short lines
    appended by several xdist workers stay whole."""
    path = os.environ.get("NBFLASH_DURATIONS_LOG")
    replayed = getattr(report, "node", None) is not None  # xdist's controller, repeating a worker's report
    if path and report.duration > 0.5 and not replayed:
        with open(path, "a") as log:
            log.write(f"{report.duration:.1f} {report.when} {report.outcome} {report.nodeid}\n")
    _log_failure(report)


def _log_failure(report):
    """With ``NBFLASH_FAILURES_LOG``, each failed test phase appends its whole report (traceback,
    and for a fuzz test hypothesis's falsifying example) to that file as it fails. pytest-xdist
    prints failures only when the session ends, so a run stopped by a time limit once lost the one
    failing fuzz example it had found. Written by the process that prints the results (xdist's
    controller, or pytest itself without workers), so reports never interleave."""
    path = os.environ.get("NBFLASH_FAILURES_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as log:
            log.write(f"==== {report.when} {report.nodeid}\n{report.longreprtext}\n")


def pytest_collection_modifyitems(config, items):
    _resume(config, items)
    if SIMULATOR:
        skip = pytest.mark.skip(reason="needs a CUDA GPU; running in Numba's CUDA simulator")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
        return
    # On a GPU, compiling the kernels takes most of a test run's time (a tensor-core configuration
    # takes 10-40 s). With pytest-xdist's `--dist loadgroup`, tests that compile the same kernels
    # (same dtype, head dim and causal flag) go to the same worker, so each compiles once.
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if {"dtype", "headdim", "causal"} <= params.keys():
            group = f"{params['dtype']}-{params['headdim']}-{params['causal']}"
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name so failures reproduce."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def xp():
    """The array module of the backend: CuPy on a GPU, NumPy in the simulator."""
    if SIMULATOR:
        return np
    import cupy

    return cupy


@pytest.fixture
def separate_dq_plan(monkeypatch):
    """Every backward plans the separate dQ pass, with deterministic=False too, as the Hopper planner
    does past headdim 128 (configs.SM90_PAIR_DEFAULT_HEADDIMS, a GPU-only plan): the launchers must
    follow the plan (its dK/dV config's ``atomic_dq``), not the flag."""
    from nbflash import backward as module

    planned = module.plan_backward
    monkeypatch.setattr(module, "plan_backward", lambda static, deterministic, *rest: planned(static, True, *rest))
    module._kernels.cache_clear()
    yield
    module._kernels.cache_clear()
