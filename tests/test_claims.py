"""scripts/claims.py: its byte model, its memory bookkeeping, and its parts run end to end.

With no GPU everything runs in Numba's CUDA simulator at a tiny size (float32, so the portable
kernel, the quick one to simulate). On a GPU the same calls measure real memory, and nbflash's peak
must then be exactly its output plus lse.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

from .conftest import SIMULATOR

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "claims.py")


@pytest.fixture(scope="module")
def claims():
    spec = importlib.util.spec_from_file_location("claims", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- The byte model --------------------------------------------------------------------------


def test_naive_traffic_is_quadratic_and_flash_floor_linear(claims):
    n, d, e = 4096, 64, 2
    naive = [claims.naive_bytes(1, 1, m, m, d, e, False) for m in (n, 2 * n)]
    assert 3.95 < naive[1] / naive[0] <= 4.0  # N^2, plus O(N d) terms
    floors = [claims.flash_bytes(1, 1, m, m, d, e, False, 128, 64)[1] for m in (n, 2 * n)]
    assert floors[1] == 2 * floors[0]  # exactly linear: Q, K, V read once, O and lse written once
    assert floors[0] == 4 * n * d * e + 4 * n


def test_naive_bytes_per_score_element(claims):
    # fp16 naive attention, pass by pass: 4 passes over fp16 N x N arrays, 12 over float32 ones.
    n = 8192
    per_score = claims.naive_bytes(1, 1, n, n, 64, 2, False) / n**2
    assert abs(per_score - (4 * 2 + 12 * 4)) < 0.1
    textbook = claims.textbook_naive_bytes(1, 1, n, n, 64, 2) / n**2
    assert abs(textbook - 4 * 2) < 0.1  # S written and read, P written and read
    assert claims.naive_bytes(1, 1, n, n, 64, 2, True) > claims.naive_bytes(1, 1, n, n, 64, 2, False)


def test_flash_rereads_and_causal_tiles(claims):
    n, d, e = 8192, 64, 2
    rereads, floor = claims.flash_bytes(2, 3, n, n, d, e, False, 128, 64)
    # K and V once per 128-row query tile: 2 d e / block_m = 2 bytes per score element.
    assert abs(rereads / (6 * n * n) - 2 * d * e / 128) < 0.05  # + Q, O, lse: O(N d)
    assert floor < rereads
    causal, _ = claims.flash_bytes(2, 3, n, n, d, e, True, 128, 64)
    assert 0.45 < causal / rereads < 0.55  # tiles above the diagonal are never loaded
    # Bottom-right causal with more queries than keys: the first rows see no key, load nothing.
    assert claims._keys_visited(0, 16, 16, 64, 16, True) == 0
    assert claims._keys_visited(3, 16, 16, 64, 16, True) == 16
    assert claims._keys_visited(0, 16, 16, 16, 64, False) == 64


# ---- Peak-memory bookkeeping -----------------------------------------------------------------


class FakePool:
    """Hands out increasing addresses; fails past a capacity, like a pool running out of memory."""

    class Block:
        def __init__(self, ptr):
            self.ptr = ptr

    def __init__(self, capacity):
        self.capacity, self.used, self.next = capacity, 0, 4096

    def malloc(self, size):
        if self.used + size > self.capacity:
            raise MemoryError("out of memory")
        self.used += size
        self.next += size + 512
        return self.Block(self.next)

    def free_all_blocks(self):
        pass


def test_peak_memory_counts_live_bytes_and_high_water(claims):
    meter = claims.PeakMemory(FakePool(capacity=10_000))
    a = meter.malloc(1000, 0)
    b = meter.malloc(3000, 0)
    meter.free(a, 0)
    c = meter.malloc(500, 0)
    assert (meter.live, meter.peak) == (3500, 4000)
    meter.free(b, 0)
    meter.free(c, 0)
    meter.free(c, 0)  # a second free of the same pointer changes nothing
    assert (meter.live, meter.peak, meter.allocations) == (0, 4000, 3)
    assert meter.malloc(0, 0) == 0 and meter.live == 0  # zero-byte requests need no memory
    with pytest.raises(MemoryError):
        meter.malloc(20_000, 0)
    assert (meter.live, meter.peak) == (0, 4000)
    assert claims.is_out_of_memory(MemoryError("out of memory"))
    assert not claims.is_out_of_memory(ValueError("headdim=300 exceeds 256"))


# ---- The parts, tiny -------------------------------------------------------------------------


def test_errors_are_the_same_order_as_naive(claims):
    rows = claims.error_sweep(1, 1, 16, ["float32"], [20], [False, True], log=lambda s: None)
    assert len(rows) == 2
    for row in rows:
        assert row["flash_error"] <= row["budget"], row
        assert row["flash_error"] < 1e-5 and row["naive_error"] < 1e-5
    table = claims.error_table(rows)
    assert all(r["within"] == "yes" for r in table)
    assert "exact, no approximation" in claims.error_conclusions(rows)[0]


def test_parts_tables_and_docs(claims, tmp_path):
    log = lambda s: None  # noqa: E731
    memory = [claims.memory_sweep(1, 1, 16, "float32", [16, 32], log=log)]
    speed = claims.speed_sweep(1, 1, 16, "float32", [16, 32], [False], repeats=1, budget_s=0.1, log=log)
    errors = claims.error_sweep(1, 1, 16, ["float32"], [16], [False], log=log)
    for row in memory[0]:
        if SIMULATOR:
            assert row["naive_peak"] is None and row["flash_peak"] is None  # n/a, not measured
        else:  # nbflash allocates its output and lse, nothing N x N
            assert row["flash_peak"] == row["flash_output_bytes"]
            assert row["naive_peak"] > row["S_bytes"]
    assert [r["seqlen"] for r in speed] == [16, 32]
    assert all(isinstance(r["flash_ms"], float) and r["family"] != "unknown" for r in speed)
    results = {
        "command": "python scripts/claims.py (test)",
        "date": "today",
        "device": claims.device_info(),
        "simulator": SIMULATOR,
        "bandwidth": claims.COPY_BANDWIDTH,
        "config": {"batch": 1, "nheads": 1, "headdim": 16, "dtype": "float32"},
        "memory": memory,
        "speed": speed,
        "errors": errors,
    }
    titles = [title for title, _, _ in claims.sections(results)]
    assert [t[:3] for t in titles] == ["(a)", "(b)", "(c)", "(d)"]
    paths = claims.write_docs(results, tmp_path, plots=False)
    text = (tmp_path / "claims.md").read_text()
    assert paths == [tmp_path / "claims.md"]
    assert "| B x H " in text and "256 MB" in text and "(d) Exactness" in text
    assert "None" not in text


def test_recorded_command_leaves_out_where_files_go(claims):
    argv = ["--write-docs", "--docs-dir", "/some/dir", "--budget", "0.3", "--json=r.json", "--seqlens", "64"]
    assert claims.measuring_arguments(argv) == ["--write-docs", "--budget", "0.3", "--seqlens", "64"]


def test_plots(claims, tmp_path):
    pytest.importorskip("matplotlib")
    rows = [claims.memory_sweep(1, 1, 8, "float32", [16, 32], log=lambda s: None)]
    speed = claims.speed_sweep(1, 1, 8, "float32", [16], [False], repeats=1, budget_s=0.1, log=lambda s: None)
    results = {
        "device": claims.device_info(),
        "bandwidth": claims.COPY_BANDWIDTH,
        "config": {"batch": 1, "nheads": 1, "headdim": 8, "dtype": "float32"},
        "memory": rows,
        "speed": speed,
    }
    paths = claims.plot(results, tmp_path)
    assert sorted(p.name for p in paths) == ["claims_memory.png", "claims_time.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_script_runs(tmp_path):
    args = [sys.executable, SCRIPT, "--dtype", "float32", "--headdim", "8", "--batch", "1", "--nheads", "1"]
    args += ["--mem-seqlens", "16", "--seqlens", "16", "--causal", "no", "--repeats", "1"]
    args += ["--error-seqlens", "16", "--error-heads", "1", "--error-dtypes", "float32"]
    args += ["--write-docs", "--docs-dir", str(tmp_path), "--json", str(tmp_path / "raw.json")]
    env = dict(os.environ)
    if SIMULATOR:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    for part in ("(a) Memory", "(b) Memory traffic", "(c) Speed", "(d) Exactness"):
        assert part in result.stdout
    assert (tmp_path / "claims.md").exists() and (tmp_path / "raw.json").exists()
