"""A first run that explains itself: the message when a kernel compiles, and ``python -m nbflash
prebuild``. Nothing compiles here: the build steps are stubbed (CI has no NVVM or ptxas)."""

import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from numba import cuda

from nbflash import configs, cubin_cache, launch, prebuild, runtime
from nbflash.kernels import registry
from nbflash.kernels.backward_portable import PortableBackwardConfig
from nbflash.kernels.kvcache import AppendConfig
from nbflash.problem import Variant


@pytest.fixture
def fresh_log(monkeypatch):
    """The "nbflash" logger and the announcements as in a new process. Call it in the test body
    to have logging unconfigured as well (pytest gives the root logger its handlers after setup)."""
    monkeypatch.setattr(launch.LOG, "handlers", [])
    monkeypatch.setattr(launch.LOG, "level", logging.NOTSET)
    monkeypatch.setattr(launch.LOG, "propagate", True)
    monkeypatch.setattr(launch, "_log_ready", False)
    monkeypatch.setattr(launch, "_announced", set())
    monkeypatch.delenv("NBFLASH_QUIET", raising=False)
    launch.LOG.manager._clear_cache()
    yield lambda: monkeypatch.setattr(logging.getLogger(), "handlers", [])
    launch.LOG.manager._clear_cache()


@pytest.fixture
def stub_compile(monkeypatch, tmp_path):
    """_load_or_compile with a GPU of cc 9.0, a cache that never hits, and a compiler that only
    counts its calls (and returns a cubin, which the real cache stores in tmp_path)."""
    monkeypatch.setenv("NBFLASH_CACHE_DIR", str(tmp_path))
    device = type("Device", (), {"compute_capability": (9, 0)})
    monkeypatch.setattr(cuda, "current_context", lambda: type("Context", (), {"device": device}), raising=False)
    monkeypatch.setattr(launch, "_driver", lambda: None)
    monkeypatch.setattr(cubin_cache, "load", lambda driver, key: None)
    monkeypatch.setattr(launch, "_function_handle", lambda overload: "function")
    built = []

    class Library:
        _setup_functions = []
        _entry_name = "_Z6kernel"

        def get_cubin(self):
            return b"\x7fELF cubin"

    class Overload:
        _codelibrary = Library()

        def bind(self):
            pass

    class Kernel:
        def compile(self, signature):
            return Overload()

    def build(config):
        built.append(config)
        return Kernel()

    monkeypatch.setattr(registry, "build", build)
    return built


def compile_kernel(config):
    return launch._load_or_compile(config, registry.signature(config))


CAUSAL = configs.mma_forward_config("float16", 128, Variant(window=True), True)
PLAIN = configs.mma_forward_config("bfloat16", 64, Variant(), True)


def test_one_message_per_configuration_on_stderr(fresh_log, stub_compile, tmp_path, capsys):
    fresh_log()
    compile_kernel(CAUSAL)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("nbflash: compiling tensor-core forward (float16, headdim 128, causal/window) for "
                               "sm_90, typically 10-40 s: ")
    assert f"the on-disk cache at {tmp_path} is empty" in lines[0]
    assert "python -m nbflash prebuild" in lines[0]  # the first message of a process says how to skip this
    assert lines[1].startswith("nbflash: compiled tensor-core forward (float16, headdim 128, causal/window) in ")
    assert lines[1].endswith(f" s; cached in {tmp_path}")

    compile_kernel(PLAIN)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("nbflash: compiling tensor-core forward (bfloat16, headdim 64) for sm_90")
    assert f"not in the on-disk cache at {tmp_path} (its first use" in lines[0]
    assert "prebuild" not in lines[0]

    compile_kernel(CAUSAL)  # compiled again (another device, say): announced once is enough
    assert capsys.readouterr().err == ""
    assert stub_compile == [CAUSAL, PLAIN, CAUSAL]


def test_an_unwritable_cache_is_said(fresh_log, stub_compile, monkeypatch, capsys):
    fresh_log()
    monkeypatch.setattr(cubin_cache, "store", lambda key, entry, cubin: None)
    compile_kernel(PLAIN)
    assert capsys.readouterr().err.splitlines()[1].endswith("cannot be written)")


def test_quiet_by_environment_or_level(fresh_log, stub_compile, monkeypatch, capsys):
    fresh_log()
    monkeypatch.setenv("NBFLASH_QUIET", "1")
    compile_kernel(CAUSAL)
    assert capsys.readouterr().err == ""

    monkeypatch.setattr(launch, "_log_ready", False)
    monkeypatch.setattr(launch, "_announced", set())
    monkeypatch.delenv("NBFLASH_QUIET")
    logging.getLogger("nbflash").setLevel(logging.WARNING)
    compile_kernel(CAUSAL)
    assert capsys.readouterr().err == ""
    assert len(stub_compile) == 2


def test_configured_logging_gets_the_records_instead(fresh_log, stub_compile, caplog, capsys):
    caplog.set_level(logging.INFO, logger="nbflash")
    compile_kernel(PLAIN)
    assert [r.name for r in caplog.records] == ["nbflash", "nbflash"]
    assert caplog.records[0].getMessage().startswith("compiling tensor-core forward (bfloat16, headdim 64)")
    assert launch.LOG.handlers == [] and "nbflash:" not in capsys.readouterr().err


def test_describe_names_kernel_kind_and_features():
    variant = Variant(softcap=True, bias="float16")
    backward = PortableBackwardConfig("dq", "float32", 40, variant, 64, 64, 1, False)
    described = "portable backward dQ (float32, headdim 40, softcap, float16 bias, deterministic)"
    assert launch.describe(backward) == described
    assert launch.describe(AppendConfig("float16", paged=True)) == "KV-cache append (float16, paged)"
    assert launch.compile_seconds(backward) == (1, 5) and launch.compile_seconds(CAUSAL) == (10, 40)


# --- python -m nbflash prebuild ----------------------------------------------------------------------


def test_prebuild_help(capsys):
    with pytest.raises(SystemExit) as exit:
        prebuild.main(["--help"])
    out = capsys.readouterr().out
    assert exit.value.code == 0 and out.startswith("usage: python -m nbflash prebuild")
    for option in ("--cc", "--jobs", "--headdims", "--dtypes", "--cache-dir", "NBFLASH_CACHE_DIR"):
        assert option in out


def test_python_m_nbflash_prebuild_reaches_its_parser():
    """Its arguments go to prebuild's parser before the demo's (or the simulator's restart)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM=os.environ.get("NUMBA_ENABLE_CUDASIM", "0"))
    result = subprocess.run([sys.executable, "-m", "nbflash", "prebuild", "--cc", "9.0", "--jobs", "0"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == "python -m nbflash prebuild: error: argument --jobs: 0 is not >= 1"


@pytest.mark.parametrize("args", [["--cc", "9"], ["--cc", "sm90"], ["--cc", "9.0", "--jobs", "0"],
                                  ["--cc", "9.0", "--headdims", "300"], ["--cc", "9.0", "--dtypes", "int8"],
                                  ["--cc", "9.0", "--families", "fast"], ["--cc", "9.0", "--variants", "nope"],
                                  []])
def test_prebuild_bad_arguments_are_one_line(args, monkeypatch, capsys):
    monkeypatch.setattr(runtime, "gpu_present", lambda: False)
    with pytest.raises(SystemExit) as exit:
        prebuild.main(args)
    assert exit.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors


def test_prebuild_unaligned_with_every_family_on_hopper():
    """``--unaligned`` on compute capability 9.0 with the sm90 family in the list (the default) once
    stopped the whole command: the sm90 forward, which needs rows on 16-byte boundaries, was planned
    for the unaligned variant too. The unaligned configurations are the sm80 family's; sm90's are the
    aligned ones, and the GPU fuzz's variants plan without an error."""
    names = "plain causal softcap alibi bias causal-bias document-mask".split()
    variants = prebuild.catalogue_variants(names)
    wanted = prebuild.configurations(["float16"], [40, 64, 128], list(prebuild.FAMILIES), (9, 0), True, variants)
    aligned = prebuild.configurations(["float16"], [40, 64, 128], list(prebuild.FAMILIES), (9, 0), False, variants)
    assert set(aligned) < set(wanted)
    unaligned = [c for c in wanted if getattr(c, "aligned", True) is False]
    assert unaligned and all(type(c).__name__.startswith("Mma") for c in unaligned)
    assert any(type(c).__name__.startswith("Sm90") for c in aligned)


def test_prebuild_plans_the_wide_hopper_backward():
    """At headdims past 128 on compute capability 9.0 the prebuild has the wide sm90 dK/dV kernel
    (the default there, and what "sm90" forced takes), and for deterministic=True under "sm90" its
    form without dQ and the sm90 dQ kernel with 32-key tiles (configs.SM90_DQ)."""
    from nbflash.kernels.backward_dq_sm90 import Sm90DqConfig
    from nbflash.kernels.backward_sm90_wide import Sm90WideBackwardConfig

    wanted = prebuild.configurations(["bfloat16"], [256], list(prebuild.FAMILIES), (9, 0))
    assert any(isinstance(c, Sm90WideBackwardConfig) and c.atomic_dq for c in wanted)
    assert any(isinstance(c, Sm90WideBackwardConfig) and not c.atomic_dq for c in wanted)
    assert any(isinstance(c, Sm90DqConfig) and c.block_n == 32 for c in wanted)


def test_prebuild_has_the_rowwise_vector_forms_when_planned(monkeypatch):
    """With configs.ROWWISE_VECTOR on (planned), the prebuild compiles the row-wise kernels' 16-byte
    forms too (the preprocess, atomic and not, and the conversion, per 16-bit headdim), beside the
    scalar ones that unaligned outputs still take; with it off, none is planned."""
    monkeypatch.setattr(configs, "ROWWISE_VECTOR", False)
    wanted = prebuild.configurations(["float16"], [64, 128], ["portable", "sm80"], (9, 0))
    assert not any(getattr(c, "vector", False) for c in wanted)
    monkeypatch.setattr(configs, "ROWWISE_VECTOR", True)
    configured = prebuild.configurations(["float16"], [64, 128], ["portable", "sm80"], (9, 0))
    assert set(wanted) < set(configured)  # the scalar forms stay
    vector = [c for c in configured if getattr(c, "vector", False)]
    assert sorted((c.headdim, c.kernel, c.atomic_dq) for c in vector) == [
        (hd, kernel, atomic) for hd in (64, 128) for kernel, atomic in
        (("convert_dq", True), ("preprocess", False), ("preprocess", True))]


def test_prebuild_counts_built_cached_and_failed(monkeypatch, tmp_path, capsys):
    """The whole command with threads for processes and a build that compiles nothing: one tick per
    kernel, the counts at the end, and each distinct error once."""
    wanted = prebuild.configurations(["float32"], [32], ["portable"], (9, 0))
    done_before = wanted[0]
    open(prebuild.cached_file(done_before, (9, 0), str(tmp_path)), "wb").close()

    def build_one(config, cc, cache_dir):
        assert config != done_before and cc == (9, 0) and cache_dir == str(tmp_path)
        if getattr(config, "kernel", "") == "dkdv":
            raise RuntimeError("ptxas -arch=sm_90 failed: out of registers\nmore detail")
        return config, "built", 0.0

    monkeypatch.setattr(prebuild, "cuda_tool", lambda name: "/usr/bin/true")
    monkeypatch.setattr(prebuild, "build_one", build_one)
    monkeypatch.setattr(prebuild, "ProcessPoolExecutor", lambda jobs, mp_context=None: ThreadPoolExecutor(jobs))
    status = prebuild.main(["--cc", "9.0", "--dtypes", "float32", "--headdims", "32", "--families", "portable",
                            "--jobs", "2", "--cache-dir", str(tmp_path)])
    failed = sum(getattr(config, "kernel", "") == "dkdv" for config in wanted)
    out = capsys.readouterr().out
    assert status == 1 and failed >= 2
    assert out.count("failed: portable backward dK/dV") == 1 and "more detail" not in out
    assert out.splitlines()[-1].startswith(f"{len(wanted) - 1 - failed} built, 1 already cached, {failed} failed in ")
