#!/usr/bin/env bash
# The checks to run on a GPU machine, in two parts that each fit a 10-minute command:
#
#   scripts/gpu_check.sh tests   the GPU tests (pytest -m gpu; kernels compiled in parallel by
#                                pytest-xdist), the host-overhead measurement and the demo
#   scripts/gpu_check.sh bench   forward and backward throughput next to SDPA (and naive CuPy),
#                                and the claims
#
# Logs and tables go to $OUT (or ./gpu_check_out). Every step has its own time limit, and the test
# log names each result as it comes (-v), so a step cut short still says what failed.
# Needs pytest-xdist (and execnet) beside the project's dependencies.
set -u
out=${OUT:-gpu_check_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

case "${1:-tests}" in
tests)
    timeout 440 python3 -m pytest -m gpu -n "${WORKERS:-14}" --dist loadgroup -v -p no:cacheprovider -W ignore \
        --tb=short -rf tests/ > "$out/pytest_gpu.log" 2>&1
    echo "pytest exit $?"
    grep -E "^(FAILED|ERROR)|\] (FAILED|ERROR)" "$out/pytest_gpu.log" | sed 's/^\[gw[0-9]*\] //' | sort | uniq | head -60
    grep -cE "PASSED" "$out/pytest_gpu.log" | sed 's/^/passed: /'
    tail -2 "$out/pytest_gpu.log"
    timeout 100 python3 scripts/host_overhead.py 2>&1 | tee "$out/host.log"
    timeout 120 python3 -m nbflash 2>&1 | tee "$out/demo.log" | tail -9
    ;;
bench)
    timeout 330 python3 scripts/bench.py --families mma portable --headdims 64 128 \
        --seqlens 1024 4096 16384 --dtypes float16 --budget 0.5 \
        --markdown "$out/bench_forward.md" 2> "$out/bench.err" | tail -16
    timeout 150 python3 scripts/bench.py --pass backward --families portable --headdims 64 128 \
        --seqlens 1024 4096 --dtypes float16 --budget 0.5 \
        --markdown "$out/bench_backward.md" 2> "$out/bench_backward.err" | tail -10
    timeout 200 python3 scripts/claims.py --write-docs --docs-dir "$out" 2> "$out/claims.err" | tail -30
    ;;
*)
    echo "usage: $0 tests|bench" >&2
    exit 2
    ;;
esac
