"""python -m nbflash: a clean --help, --version, and bad arguments as one line of error (no traceback)."""

import os
import subprocess
import sys

import nbflash


def run(*args):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM=os.environ.get("NUMBA_ENABLE_CUDASIM", "0"))
    return subprocess.run([sys.executable, "-m", "nbflash", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_help_is_plain_text_and_every_option_explained():
    result = run("--help")
    assert result.returncode == 0
    assert "``" not in result.stdout, "raw RST markup in --help"
    for option in ("--seqlens", "--batch", "--nheads", "--headdim", "--dtype", "--causal", "--version"):
        assert option in result.stdout
    for explained in ("sequence lengths to run", "batch size", "heads (default", "head dimension",
                      "element type", "causal attention", "show program's version"):
        assert explained in result.stdout, f"--help does not explain: {explained}"


def test_version():
    result = run("--version")
    assert result.returncode == 0 and result.stdout.startswith(f"nbflash {nbflash.__version__}")


def test_bad_arguments_are_one_line():
    for args in (["--seqlens", "0"], ["--batch", "-2"], ["--headdim", "300"], ["--dtype", "int8"]):
        result = run(*args)
        assert result.returncode == 2, args
        assert "Traceback" not in result.stderr, args
        errors = [line for line in result.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1, (args, result.stderr)


def test_no_cupy_error_points_at_the_simulator(monkeypatch):
    """Without CuPy the error says how to install it and how to run in the simulator instead."""
    import builtins

    from nbflash import runtime

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy":
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(runtime, "_cupy", None)
    monkeypatch.setattr(builtins, "__import__", no_cupy)
    try:
        runtime.cupy()
    except RuntimeError as error:
        assert "nbflash[cuda12]" in str(error) and "NUMBA_ENABLE_CUDASIM=1" in str(error)
    else:
        raise AssertionError("runtime.cupy() did not raise without CuPy")
