#!/usr/bin/env bash
# The checks to run on a GPU machine. Each part fits a 10-minute command:
#
#   scripts/gpu_check.sh tests   the whole test suite on the GPU (pytest-xdist), host overhead, demo
#   scripts/gpu_check.sh bench   forward and backward throughput next to SDPA (and naive CuPy),
#                                and the claims (docs/claims.md and its plots)
#   scripts/gpu_check.sh all     both, shortened, in about six minutes; needs the kernel cache
#                                prebuilt (scripts/prebuild_cache.py, NBFLASH_CACHE_DIR pointing at it)
#   scripts/gpu_check.sh suite [SECONDS]
#                                only the test suite, stopped after SECONDS (default 145; about 120 s
#                                with a prebuilt cache on 16 cores); TESTS (pytest's paths, default
#                                tests/) narrows it to some files or node ids
#   scripts/gpu_check.sh finish [SECONDS]
#                                the GPU tests the suite's saved parts (docs/runs/) do not cover on the
#                                current plan, in one pytest run stopped after SECONDS (default 560):
#                                every test whose id names dropout, packed sequences (varlen, packed) or
#                                fuzzing (the plans and budgets of those changed after the parts ran:
#                                steps 37-41), and the grids of steps 42-43's options (rows_gpu's early
#                                and rotate forms, rotate_gpu). 227 GPU tests at the time of writing;
#                                `NBFLASH_RESUME_LOGS=$(ls docs/runs/gpu-suite-*.txt | paste -sd:)
#                                pytest --collect-only -m gpu tests/` lists what the parts leave
#   scripts/gpu_check.sh prebuild [SECONDS]
#                                the planned kernels into the kernel cache on all 16 cores
#                                (scripts/prebuild_cache.py --jobs 16; 465 configurations in 170 s on a
#                                cold cache), before a `suite` part in the same call: the tests then
#                                compile only what they alone use
#   scripts/gpu_check.sh reliability
#                                issue 14's checks past the test suite, about 2.5 minutes: the tests
#                                past 2^31 elements, one 1M-token sequence
#   scripts/gpu_check.sh sanitize
#                                compute-sanitizer's four tools on every case of scripts/sanitize.py,
#                                about 4 minutes with a warm kernel cache; on a cold one the cases'
#                                unsanitized runs compile first, all at once, within 320 s (one after
#                                another they took the whole 560 s limit on a fresh machine; all at
#                                once, two of them needed more than 200 s)
#   scripts/gpu_check.sh fuzz [EXAMPLES]
#                                the GPU fuzz profile, FUZZ_PROCESSES (default 3) processes of EXAMPLES (default 170) draws
#                                per fuzz test (4 tests: 12 x EXAMPLES calls), after a prebuild of most
#                                of its kernels, up to 9.2 minutes; every passing example is counted as
#                                it passes (without the prebuild, 540 s stopped one process's backward
#                                test and another's statistics: 11 of 12 tests done), and each failing
#                                one's report as it fails (xdist prints them only at the session's end)
#   scripts/gpu_check.sh headdims
#                                issue 13's item 2 past the headdims timed so far: the sm90 backward
#                                (the rows split padded to 64 below 64, the wide kernel past 128)
#                                against the mma one, the default there, at hd 32, 48, 192 and 256,
#                                fp16, 4k and 16k, causal and not, after a prebuild of both on 16
#                                cores; about 8 minutes
#   scripts/gpu_check.sh defaults [SECONDS]
#                                the GPU tests that take a gradient and have not run since the sm90
#                                backward became the default at headdims 16-256 (the pair past 128),
#                                after a prebuild of the planned kernels: the default backward at the
#                                headdims no grid covered (test_backward_default_headdims_gpu), the
#                                files past the backward's own, less what
#                                docs/runs/gpu-suite-2026-12-06-{headdims,defaults,pair}.txt report
#                                (NBFLASH_RESUME_LOGS; TESTS overrides the files), stopped after SECONDS
#                                (default 400)
#   scripts/gpu_check.sh fold-dq the dQ conversion folded into the dK/dV kernel (an option): its GPU
#                                grid, then the plan with and without it against SDPA, twice
#   scripts/gpu_check.sh wraps [SECONDS]
#                                backward_sm90.py's dS^T stores by shared address (perf-notes step 59):
#                                the GPU grids of its planned kernels (202 tests) and the decode
#                                kernel's, after a prebuild,
#                                stopped after SECONDS (default 400)
#   scripts/gpu_check.sh walks [SECONDS]
#                                step 60's GPU grids past those of wraps (178 tests: the rows split's
#                                persistent and rotated forms, the rotated walk, the wide kernel and
#                                its variants), after a prebuild of the wide kernel's headdims,
#                                stopped after SECONDS (default 420)
#   scripts/gpu_check.sh steps [SECONDS]
#                                wraps and walks in one call, fp16 only (318 of their 510 tests),
#                                after an fp16 prebuild, stopped after SECONDS (default 400)
#   scripts/gpu_check.sh verify [SECONDS]
#                                steps' grids less decode's, stopped after SECONDS (default 230), then
#                                the backward at hd 64 and 128 here and in AB_BASE's tree, once each;
#                                about 9.5 minutes (NO_TIME=1: the grids only)
#   scripts/gpu_check.sh fp8     the fp8 forward's tests, then its speed (bench.py --fp8) next to the
#                                16-bit sm90 kernel and SDPA, then its parts and schedules
#                                (scripts/fp8_parts.py); at most 8.5 minutes
#   scripts/gpu_check.sh exp2    P's exponentials partly on the FMA pipes (exp2_fma_groups) and the V^T
#                                kernel's new form: their GPU tests, then fp8_parts.py and
#                                sm90_schedules.py on them; at most 9 minutes
#   scripts/gpu_check.sh keys128-next
#                                the twenty-ninth session's next steps: step 40's grids with the
#                                deterministic pass at 128 query rows, hd 32/48 against the rows split,
#                                the deterministic parts at hd 64 with that option off, then on; about
#                                8 minutes
#   scripts/gpu_check.sh interleaved
#                                the schedules timed interleaved (sm90_schedules.py since the thirtieth
#                                session): hd 128's third stage and TMA stores, step 40 against the
#                                rows split at hd 32, 48, 64, the GPU's clocks sampled; about 6 minutes
#   scripts/gpu_check.sh retime  earlier choices made on small margins, retimed interleaved (hd 128's dQ
#                                forms, stores, rotate, launch groups; hd 64's groups and rows split),
#                                about 7 minutes
#   scripts/gpu_check.sh keys128-variants
#                                step 40 for the masks and ALiBi (an option): its GPU grid, then the
#                                table's kernel against it, interleaved (scripts/keys128_variants.py)
#   scripts/gpu_check.sh new-defaults
#                                the thirty-second session's plan (step 40 for the masks, ALiBi and packed
#                                sequences; the sm90 backward for a bool mask at hd 64): the GPU tests it
#                                moved that have not run on it, then the bool mask's deterministic
#                                backward on both families; about 8 minutes
#   scripts/gpu_check.sh quads-groups
#                                hd 128's 16-byte dK/dV stores on the planned kernels (their grid, then
#                                timed), hd 64's launch groups of 1, 2 and 4 at 4k, 16k, 32k; about 7 minutes
#   scripts/gpu_check.sh dq-warp
#                                the staged dQ_i added by the producer's warp 2 (dq_warp, an option): its
#                                grid, then timed against the plan at hd 64 and 128, twice, then its
#                                stall profile at hd 64 16k; about 9 minutes
#   scripts/gpu_check.sh stats-ahead
#                                the stats warp's lse and D loaded a step ahead (stats_ahead, an option):
#                                its grid, then timed with and without dq_warp against the plan at hd 64
#                                and 128, twice; about 9 minutes
#   scripts/gpu_check.sh keys128-det-variants
#                                deterministic=True's pass at 128 query rows for the masks and ALiBi (an
#                                option): its grid, then timed against 64 rows; about 8 minutes
#   scripts/gpu_check.sh packed128
#                                step 40 on packed sequences (an option): its GPU grid, then the packed
#                                backward at hd 64 with the option off and on, twice; about 6 minutes
#   scripts/gpu_check.sh table-rotated
#                                issue 13's table, bench.py's columns in turns rotated each round (four
#                                rounds), about 8 minutes
#   scripts/gpu_check.sh planned-now
#                                step 40 planned at hd <= 64 and three stages at 128 (plain): the GPU
#                                tests they now run, then issue 13's table (bench.py's two passes, hd 64
#                                and 128, with the anchors; the backward at 32 too); at most 10 minutes
#   scripts/gpu_check.sh keys128 [RUNS]
#                                step 40 (docs/perf-notes.md): backward_sm90.py with 128 query rows a
#                                step and dQ split by query rows, its GPU grid, then timed RUNS times
#                                (default 2) against the planned rows split at hd 64 with SDPA; about
#                                3 minutes a run
#   scripts/gpu_check.sh wraps-time
#                                step 59 timed: the backward at hd 128 (HEADDIMS) in this tree and in
#                                the tree before it (AB_BASE, as for stores), and in AB_MID's where
#                                given (step 60 apart), alternating, twice; about 5 minutes (8 with
#                                AB_MID)
#   scripts/gpu_check.sh options hd 128's planned dK/dV kernel (dQ tile-major) with dK and dV by
#                                TMA stores and with a third ring stage (perf-notes steps 57 and 52),
#                                each timed against the planned kernel three times, about 5 minutes
#   scripts/gpu_check.sh stores  the sm90 backward with dK, dV and dq stored as 32-bit pairs (perf-notes
#                                step 54) against the tree before it: AB_BASE (default .ab/base.tar, a
#                                `git archive` of that commit carried in the working tree), bench.py's
#                                backward at hd 64, 128 and 256 and forward at 64 and 128 in each
#                                tree, about 8 minutes on a fresh machine
#   scripts/gpu_check.sh sm90 [SECONDS]
#                                the GPU tests of the files running sm90 kernels (every one of them
#                                changed with perf-notes step 54's stores), after a prebuild, stopped
#                                after SECONDS (default 400); NBFLASH_RESUME_LOGS (each earlier
#                                part's log, on the same kernels) and TESTS as in defaults
#   scripts/gpu_check.sh levers  issue 13's work not yet timed on a GPU: the persistent grid's two
#                                cases the last run did not reach, the varlen backward on both
#                                families, and the sm90 backward at headdim 256 (not its default)
#                                against the mma one, about 7 minutes
#   scripts/gpu_check.sh deterministic
#                                deterministic=True on both Hopper kernels: its tests (bit-identical
#                                reruns; the dQ kernel's grid past headdim 128 too), then its
#                                backward timed against the
#                                mma family's deterministic one and the atomic ones, after a prebuild
#                                of both families' kernels; HEADDIMS (default "64 128") for others,
#                                about 5 minutes
#   scripts/gpu_check.sh pair    the Hopper pair (dK/dV without dQ, then the dQ kernel), the default past
#                                headdim 128: its two kernels timed apart (scripts/sm90_schedules.py
#                                --parts) at hd 128 (atomic plan), 192 and 256, and deterministic at 64
#                                and 128; hd 128's pair against the atomic kernel again; about 7 minutes
#   scripts/gpu_check.sh dq-keys the pair past 128 with the dQ kernel's larger key tiles (80 at hd 192,
#                                48 at 256) against the planned ones, each kernel timed apart; about
#                                8 minutes
#   scripts/gpu_check.sh pair-variants
#                                the pair with softcap, ALiBi, bias, dropout, mask_mod and score_mod
#                                (causal, 8k, fp16, hd 64/128/256) against the mma family's deterministic
#                                backward and the atomic kernels; about 9 minutes
#   scripts/gpu_check.sh deterministic-variants [SECONDS]
#                                the deterministic Hopper pair (forced) with every variant, on packed
#                                sequences and with block masks (steps 45-47): their GPU grids,
#                                bit-identical reruns, stopped after SECONDS (default 540)
#   scripts/gpu_check.sh dqfirst dQ's product first (dq_first, planned at hd 72-128 since 2026-12-05): the
#                                planned kernel's GPU grids its first run did not cover (non-causal
#                                tails at hd 96 and 128, the variants at 128), the dQ-last grid, and
#                                hd 64 by 32-column halves with dQ first (an option), then hd 64's
#                                timing: plain against the rows split and SDPA, and with dropout
#                                against the "steps" kernel it would replace; then hd 128 dropout,
#                                the producer's keep bits against the consumers' with dQ first,
#                                about 8 minutes
#   scripts/gpu_check.sh tiles   dQ_i by one bulk reduce-add a step into a tile-major dq_accum
#                                (dq_reduce="tiles", FlashAttention-3's form, planned at hd 72-128
#                                since steps 35 and 37): the grids of the forms the planner mostly
#                                does not take (the consumers' atomics, the rows
#                                split's tiles at hd 64, hd 64 by 32-column halves with dQ first by
#                                atomics and tile-major, packed sequences by both), the
#                                conversion's and the primitive's tests, then hd 128 timed against
#                                the atomic form and hd 64's rows split against those three (step
#                                36), with SDPA; about 5-9 minutes
#   scripts/gpu_check.sh tiles2  the rest of those timings: dropout (hd 64's "steps" against the
#                                halves, hd 128's tiles against the atomics), then packed sequences'
#                                backward at hd 128 with the atomics and tile-major (step 37), about
#                                4-9 minutes
#   scripts/gpu_check.sh early   hd 64's rows split with dQ's product (and dV's) issued under dS's stores
#                                (step 42), and the planned kernels with each block's query tiles
#                                rotated (step 43): their GPU grids, then the schedules next to SDPA at
#                                hd 64 and 128 (HEADDIMS=...), plain and causal, 4k and 16k, about 6
#                                minutes
#   scripts/gpu_check.sh packed  packed sequences' backward at mean lengths 41-303 (steps 38-39: where the
#                                tile-major dQ's padding stops paying, and the sm90 backward against
#                                the mma one on short sequences), hd 128 with both dQ forms, then hd 64,
#                                about 1.5 minutes on a warm cache
#   scripts/gpu_check.sh issue13 issue 13's table (its item 3) in one run per pass: the planned sm90
#                                backward, then forward+backward (a training step's attention), hd 64
#                                and 128, 4k and 16k, plain and causal, fp16, next to SDPA flash,
#                                SDPA cuDNN and FlexAttention, about 8 minutes
#   scripts/gpu_check.sh dropout dropout's keep bits made by the producer's idle warps (not yet run on a
#                                GPU): its test grid (bit-identical to the consumer lanes' bits), then
#                                the planned dropout backward against it, headdims 64 and 128, about
#                                5 minutes
#   scripts/gpu_check.sh stalls [HEADDIM [red|tiles|fp8|dqwarp]]
#                                where the planned dK/dV kernel's warps wait at HEADDIM (default 128;
#                                64: step 40's kernel since the twenty-ninth session), instruction by
#                                instruction (ncu's source counters; scripts/stall_report.py) and its
#                                speed-of-light page (SM, L2 and DRAM throughput against peak), plain
#                                and causal at 4k (STALLS_SEQLEN to change it), about 3
#                                minutes; needs ncu with hardware counters. With "red" or "tiles", the
#                                planned kernel with that dq_reduce (tiles is planned at hd 72-128);
#                                with "fp8", the fp8 forward's kernel instead (at 16k, where the V^T
#                                kernel's share is small); with "dqwarp", the planned kernel with its
#                                staged dQ added by the producer's warp 2 (dq_warp, an option)
#   scripts/gpu_check.sh wide    issue 13's kernels not yet run on a GPU, their test grids: packed
#                                sequences on the sm90 dK/dV kernel, and its wide kernel for
#                                headdims 136-256 with every variant, dense and packed, up to 8 minutes
#
# The whole suite takes longer than one 10-minute command. NBFLASH_RESUME_LOGS (earlier parts'
# pytest.log files, separated by ':') leaves out the tests they already report (tests/conftest.py),
# so each part runs only what the earlier ones did not reach.
#
# Logs and tables go to $OUT (or ./gpu_check_out). Every step has its own time limit, and the test
# log names each result as it comes (-v), so a step cut short still says what failed.
# Needs pytest-xdist (and execnet) beside the project's dependencies.
set -u
out=${OUT:-gpu_check_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

grid() {  # $1: the log's name, $2: time limit in seconds, then pytest's paths and -k: one GPU grid
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout "$2" python3 -m pytest -n 15 --dist loadgroup -v \
        -p no:cacheprovider -W ignore "${@:3}" > "$out/$1.log" 2>&1
    echo "tests: exit $?: $(tail -1 "$out/$1.log")"
    grep -aE "\] (FAILED|ERROR)" "$out/$1.log" | sed 's/^\[gw[0-9]*\] //' | head -10
}

run_tests() {  # $1: time limit in seconds
    # One BLAS thread per worker: the float64 references run in every worker at once. Tests that
    # compile the same kernels go to one worker (--dist loadgroup, tests/conftest.py). pytest runs in
    # a process group of its own so that, past the time limit, its xdist workers stop with it
    # instead of loading the host and the GPU under the measurements that follow.
    # Each test phase over half a second is logged as it ends (tests/conftest.py), so a part cut off
    # by its limit still says where the time went; the slowest are printed after the tallies.
    export NBFLASH_DURATIONS_LOG=${NBFLASH_DURATIONS_LOG:-$out/durations.log}
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 setsid timeout "$1" python3 -m pytest -n "${WORKERS:-15}" \
        --dist loadgroup -v -p no:cacheprovider -W ignore --tb=short -rf ${TESTS:-tests/} > "$out/pytest.log" 2>&1 &
    local group=$!
    wait "$group"
    echo "pytest exit $?"
    kill -- -"$group" 2> /dev/null
    grep -aE "^(FAILED|ERROR)|\] (FAILED|ERROR)" "$out/pytest.log" | sed 's/^\[gw[0-9]*\] //' | sort | uniq | head -40
    echo "passed: $(grep -acE '\] PASSED' "$out/pytest.log")  failed: $(grep -acE '\] FAILED' "$out/pytest.log")"
    tail -1 "$out/pytest.log"
    echo "slowest test phases (seconds, phase, outcome, test):"
    sort -rn "$NBFLASH_DURATIONS_LOG" 2> /dev/null | head -15
}

bench_forward() {  # $1: time limit, then bench.py arguments
    local limit=$1
    shift
    timeout "$limit" python3 scripts/bench.py "$@" --markdown "$out/bench_forward.md" 2>> "$out/progress.log" | tail -80
}

packed_off_on() {  # $1: a configs flag, $2: the logs' name, $3: time limit, then bench.py's headdims
    # bench.py's packed backward with the flag off and on, alternating, twice, each in its own process;
    # lengths drawn up to 2048 and 4096, and four of 4096
    local flag=$1 name=$2 limit=$3 run option
    shift 3
    for run in 1 2; do
        for option in off on; do
            timeout "$limit" python3 scripts/with_configs.py "$flag=$option" -- scripts/bench.py --pass varlen \
                --varlen-backward --headdims "$@" --causal both --varlen-lengths uniform:16384:2048 \
                uniform:16384:4096 4096,4096,4096,4096 --no-torch --budget 0.3 > "$out/${name}_${option}_$run.log" 2>&1
            echo "packed backward, $flag $option, run $run (exit $?):"; tail -14 "$out/${name}_${option}_$run.log"
        done
    done
}

# The GPU grids of perf-notes steps 59 and 60: `wraps` runs the first (and the decode kernel's),
# `walks` the second; `steps` and `verify` take their fp16 halves in one call
WRAPS_K="(test_backward_sm90_gpu and not matches) or test_backward_sm90_variants_gpu or staged_dropout_gpu"
WALKS_K="(test_backward_sm90_rows_gpu and (persistent or rotate)) or test_backward_sm90_wide_gpu or \
test_backward_sm90_rotate_gpu or test_backward_sm90_wide_variants_gpu"

case "${1:-tests}" in
tests)
    run_tests 440
    timeout 100 python3 scripts/host_overhead.py 2>&1 | tee "$out/host.log"
    timeout 60 python3 -m nbflash 2>&1 | tee "$out/demo.log" | tail -9
    ;;
bench)
    bench_forward 330 --families mma portable --headdims 64 128 256 --seqlens 512 1024 2048 4096 8192 16384 \
        --budget 0.3
    timeout 150 python3 scripts/bench.py --pass backward --families mma portable --headdims 64 128 \
        --seqlens 1024 4096 --dtypes float16 --budget 0.3 --markdown "$out/bench_backward.md" \
        2>> "$out/progress.log" | tail -12
    timeout 100 python3 scripts/claims.py --write-docs --docs-dir "$out" --mem-max 65536 \
        --seqlens 1024 4096 16384 --budget 0.3 2>> "$out/progress.log" | tail -30
    ;;
all)
    run_tests 145
    bench_forward 85 --families mma --no-naive --headdims 64 128 256 --seqlens 512 1024 2048 4096 8192 16384 \
        --budget 0.15
    timeout 35 python3 scripts/host_overhead.py 2>&1 | tee "$out/host.log"
    timeout 30 python3 scripts/bench.py --pass backward --families mma portable --headdims 64 128 \
        --seqlens 1024 4096 --dtypes float16 --budget 0.15 --markdown "$out/bench_backward.md" \
        2>> "$out/progress.log" | tail -12
    timeout 35 python3 scripts/claims.py --write-docs --docs-dir "$out" --mem-max 65536 \
        --seqlens 1024 4096 16384 --budget 0.3 --repeats 3 2>> "$out/progress.log" | tail -3
    ;;
suite)
    run_tests "${2:-145}"
    ;;
finish)
    PYTEST_ADDOPTS="-k 'dropout or varlen or packed or fuzz or (rows_gpu and (early or rotate)) or rotate_gpu'" \
        run_tests "${2:-560}"
    ;;
prebuild)
    timeout "${2:-240}" python3 scripts/prebuild_cache.py --jobs 16 > "$out/prebuild.log" 2>&1
    echo "prebuild (exit $?): $(tail -1 "$out/prebuild.log")"
    ;;
reliability)
    # Each step under its own limit, its log under $out; the tallies at the end.
    NBFLASH_SCALE_TESTS=1 timeout 190 python3 -m pytest -m gpu -n 0 -v -p no:cacheprovider tests/test_scale.py \
        > "$out/scale.log" 2>&1
    echo "scale tests: exit $?; $(tail -1 "$out/scale.log")"
    timeout 100 python3 scripts/long_sequence.py > "$out/long_sequence.log" 2>&1
    echo "long sequence: exit $?"
    tail -8 "$out/long_sequence.log"
    ;;
sanitize)
    timeout 560 python3 scripts/sanitize.py --timeout 150 --warm-timeout 320 > "$out/sanitize.log" 2>&1
    echo "sanitizer: exit $?"
    tail -32 "$out/sanitize.log"
    ;;
fuzz)
    # Most of the fuzz's kernels compiled first on all cores (tests/test_fuzz.py's docstring; a
    # prebuild cut by its limit only leaves the rest to compile on first use), then three processes
    # of fresh random draws (hypothesis draws anew in each), four workers each. Each example that
    # passes is logged as it passes (NBFLASH_FUZZ_LOG): hypothesis prints its statistics only at a
    # test's end, and a process stopped by its limit once left its count unknown.
    # PREBUILD_LIMIT=0 leaves the prebuild out; FUZZ_PROCESSES sets the number of processes.
    if [ "${PREBUILD_LIMIT:-170}" != 0 ]; then
        timeout "${PREBUILD_LIMIT:-170}" python3 -m nbflash prebuild --jobs 16 --headdims 40 64 128 --unaligned \
            --variants plain causal softcap causal-softcap alibi causal-alibi bias causal-bias document-mask \
            > "$out/prebuild.log" 2>&1
        echo "prebuild: exit $?: $(tail -1 "$out/prebuild.log")"
    fi
    rm -f "$out/fuzz_passed.log" "$out/fuzz_failures.log"
    runs=$(seq "${FUZZ_PROCESSES:-3}")
    for run in $runs; do
        NBFLASH_FUZZ_LOG="$out/fuzz_passed.log" NBFLASH_FAILURES_LOG="$out/fuzz_failures.log" NBFLASH_FUZZ_PROFILE=gpu NBFLASH_FUZZ_EXAMPLES="${2:-170}" \
            timeout "${FUZZ_LIMIT:-380}" python3 -m pytest -m gpu -n 4 -v -p no:cacheprovider \
            --hypothesis-show-statistics tests/test_fuzz.py > "$out/fuzz$run.log" 2>&1 &
    done
    wait
    for run in $runs; do
        echo "fuzz run $run: $(tail -1 "$out/fuzz$run.log")"
        grep -aE "\] (PASSED|FAILED|ERROR)" "$out/fuzz$run.log" | sed 's/^\[gw[0-9]*\] //' | sort
        grep -aE "passing|failing" "$out/fuzz$run.log" | sort | uniq -c | head -8
    done
    echo "examples passed, by test, all processes (NBFLASH_FUZZ_LOG):"
    sort "$out/fuzz_passed.log" 2> /dev/null | uniq -c
    echo "failing examples (NBFLASH_FAILURES_LOG, written as they fail): $(grep -c '^====' "$out/fuzz_failures.log" 2> /dev/null || echo 0)"
    grep -aE "^====|Falsifying|Error|assert" "$out/fuzz_failures.log" 2> /dev/null | head -20
    ;;
levers)
    # Issue 13's work not yet timed on a GPU (docs/perf-notes.md, "Hopper backward", steps 18, 20
    # and 21): the persistent grid's two cases the last run did not reach, then the varlen backward
    # on both families and the sm90 backward at headdims it does not take by default.
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 100 python3 -m pytest -n 15 --dist loadgroup -v -p no:cacheprovider \
        -W ignore tests/test_backward_sm90.py -k "rows_gpu and persistent" > "$out/levers_tests.log" 2>&1
    echo "tests: exit $?: $(tail -1 "$out/levers_tests.log")"
    grep -aE "\] (FAILED|ERROR)" "$out/levers_tests.log" | sed 's/^\[gw[0-9]*\] //' | head -20
    timeout 150 python3 scripts/bench.py --pass varlen --varlen-backward --headdims 64 128 --causal both \
        --varlen-lengths uniform:16384:2048 --no-torch --budget 0.3 --markdown "$out/varlen_backward.md" \
        > "$out/varlen_backward.log" 2>&1
    echo "varlen backward (exit $?):"; tail -8 "$out/varlen_backward.log"
    # headdims past 128 take the wide kernel when "sm90" is forced
    timeout 190 python3 scripts/bench.py --pass backward --families sm90 mma --headdims 256 \
        --seqlens 4096 16384 --causal both --dtypes float16 --no-naive --budget 0.25 \
        --markdown "$out/headdim256.md" > "$out/headdim256.log" 2>&1
    echo "sm90 backward at headdim 256 (exit $?):"; tail -10 "$out/headdim256.log"
    ;;
deterministic)
    # docs/perf-notes.md, "Hopper backward", step 23: the sm90 dK/dV kernel without dQ, then the sm90
    # dQ kernel. Both families' kernels (atomic and deterministic) compiled first on all cores: on a
    # cold cache the bench alone compiled past its 200 s (2026-12-06).
    timeout 120 python3 scripts/prebuild_cache.py --jobs 16 --headdims ${HEADDIMS:-64 128} --dtypes float16 \
        --families sm90 mma --variants plain causal > "$out/deterministic_prebuild.log" 2>&1
    echo "prebuild (exit $?): $(tail -1 "$out/deterministic_prebuild.log")"
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 250 python3 -m pytest -n 15 --dist loadgroup -v -p no:cacheprovider \
        -W ignore tests/test_backward_sm90.py tests/test_backward_dq_sm90.py \
        -k "(deterministic and not variants) or dq_sm90_gpu" \
        > "$out/deterministic_tests.log" 2>&1
    echo "tests: exit $?: $(tail -1 "$out/deterministic_tests.log")"
    grep -aE "\] (FAILED|ERROR)" "$out/deterministic_tests.log" | sed 's/^\[gw[0-9]*\] //' | head -20
    timeout 200 python3 scripts/bench.py --pass backward --families sm90 mma --deterministic --headdims ${HEADDIMS:-64 128} \
        --seqlens 4096 16384 --causal both --dtypes float16 --no-naive --budget 0.25 \
        --markdown "$out/deterministic.md" > "$out/deterministic.log" 2>&1
    echo "deterministic backward (exit $?):"; tail -12 "$out/deterministic.log"
    ;;
pair)
    # docs/perf-notes.md, "Where issue 13 stands (2026-12-06, nineteenth session)", next 2: where the
    # pair's time goes (the dK/dV kernel without dQ against the dQ kernel; hd 128's atomic plan
    # beside it), at hd 128, 192 and 256, then deterministic at 64 and 128; then hd 128 again, the
    # pair against the atomic kernel (0.89-1.09x in its one run), to place SM90_PAIR_DEFAULT_HEADDIMS
    timeout 150 python3 scripts/prebuild_cache.py --jobs 16 --headdims 64 128 192 256 --dtypes float16 \
        --families sm90 --variants plain causal > "$out/pair_prebuild.log" 2>&1
    echo "prebuild (exit $?): $(tail -1 "$out/pair_prebuild.log")"
    timeout 150 python3 scripts/sm90_schedules.py --parts --headdims 128 192 256 > "$out/pair_parts.log" 2>&1
    echo "parts (exit $?):"; tail -13 "$out/pair_parts.log"
    timeout 100 python3 scripts/sm90_schedules.py --parts --deterministic --headdims 64 128 \
        > "$out/pair_parts_deterministic.log" 2>&1
    echo "parts, deterministic (exit $?):"; tail -9 "$out/pair_parts_deterministic.log"
    timeout 150 python3 scripts/bench.py --pass backward --families sm90 --deterministic --headdims 128 \
        --seqlens 4096 8192 16384 --causal both --dtypes float16 --no-naive --budget 0.3 \
        --markdown "$out/pair_128.md" > "$out/pair_128.log" 2>&1
    echo "hd 128, the pair (det) against the atomic kernel (exit $?):"; tail -8 "$out/pair_128.log"
    ;;
stores)
    # docs/perf-notes.md, step 54: the kernels' dK/dV (and dq, and the forward's O) stores, one 32-bit
    # pair instead of two 16-bit elements, against the tree before (each tree its own kernel cache: this
    # tree's is NBFLASH_CACHE_DIR, prebuilt by an earlier `sm90` or `prebuild` call on the same machine)
    base=${AB_BASE:-.ab/base.tar}
    [ -f "$base" ] || { echo "no $base: git archive -o $base <the commit before step 54>, in the working tree"; exit 2; }
    rm -rf /tmp/ab_base && mkdir -p /tmp/ab_base && tar -xf "$base" -C /tmp/ab_base
    for run in backward:base backward:new forward:base forward:new; do
        pass=${run%:*} tree=$PWD; [ "${run#*:}" = new ] || tree=/tmp/ab_base
        path=${PYTHONPATH/$PWD/$tree}  # this tree's nbflash first
        headdims="64 128 256"; [ "$pass" = backward ] || headdims="64 128"
        cache=/tmp/ab_cache_base; [ "${run#*:}" = base ] || cache=${NBFLASH_CACHE_DIR:-/tmp/ab_cache_new}
        (cd "$tree" && PYTHONPATH=$path NBFLASH_CACHE_DIR=$cache timeout 160 \
            python3 scripts/bench.py --pass "$pass" --families default --headdims $headdims --seqlens 4096 16384 \
            --dtypes float16 --variants plain causal --no-naive --no-torch --budget 0.3) > "$out/stores_${run/:/_}.log" 2>&1
        echo "$run (exit $?):"; tail -13 "$out/stores_${run/:/_}.log"
    done
    ;;
wraps)
    # docs/perf-notes.md, step 59: backward_sm90.py's dS^T stored by shared address (no signed-index
    # wraps), in every kernel of that file: their GPU grids (the planned kernels at headdims 64-128,
    # every score variant, the producer's dropout bits), and the decode kernel's (its paged loop's
    # batch index made unsigned the same session), after a prebuild of the sm90 family
    timeout 100 python3 scripts/prebuild_cache.py --jobs 16 --dtypes float16 bfloat16 --families sm90 \
        > "$out/prebuild.log" 2>&1
    echo "prebuild (exit $?): $(tail -1 "$out/prebuild.log")"
    grid wraps_tests "${2:-400}" tests/test_backward_sm90.py tests/test_kvcache.py -k "$WRAPS_K or test_gpu_decode"
    ;;
walks)
    # docs/perf-notes.md, step 60: each dK/dV step's query head and tile by an unsigned 32-bit
    # division, in all three sm90 dK/dV kernels; the grids `wraps` leaves: the rows split's
    # persistent and rotated forms, the rotated walk, the wide kernel (hd 136-256) and its variants
    timeout 150 python3 scripts/prebuild_cache.py --jobs 16 --dtypes float16 bfloat16 --families sm90 \
        --headdims 136 192 256 > "$out/prebuild_wide.log" 2>&1
    echo "prebuild (exit $?): $(tail -1 "$out/prebuild_wide.log")"
    grid walks_tests "${2:-420}" tests/test_backward_sm90.py -k "$WALKS_K"
    ;;
steps)
    # steps 59 and 60 in one call where device time is short: `wraps` and `walks` grids in fp16 only
    # (318 of their 510 tests; the bf16 half is the same index arithmetic), after an fp16 prebuild
    timeout 150 python3 scripts/prebuild_cache.py --jobs 16 --dtypes float16 --families sm90 \
        --headdims 32 64 96 128 136 192 256 > "$out/prebuild_steps.log" 2>&1
    echo "prebuild (exit $?): $(tail -1 "$out/prebuild_steps.log")"
    grid steps_tests "${2:-400}" tests/test_backward_sm90.py tests/test_kvcache.py \
        -k "($WRAPS_K or test_gpu_decode or $WALKS_K) and not bfloat16"
    ;;
verify)
    # steps 59-61 checked and timed in one call, where device time is short: the fp16 grids of
    # `steps` less the decode kernel's, stopped after SECONDS (default 230), then the backward at
    # hd 64 and 128 in this tree and in AB_BASE's (the tree before step 59), once each
    timeout 100 python3 scripts/prebuild_cache.py --jobs 16 --dtypes float16 --families sm90 \
        --headdims 64 96 128 136 192 256 > "$out/prebuild_verify.log" 2>&1
    echo "prebuild (exit $?): $(tail -1 "$out/prebuild_verify.log")"
    grid verify_tests "${2:-230}" tests/test_backward_sm90.py -k "($WRAPS_K or $WALKS_K) and not bfloat16"
    [ -z "${NO_TIME:-}" ] || exit 0  # NO_TIME=1: the grids only
    base=${AB_BASE:-.ab/base.tar}
    [ -f "$base" ] || { echo "no $base"; exit 2; }
    rm -rf /tmp/ab_base && mkdir -p /tmp/ab_base && tar -xf "$base" -C /tmp/ab_base
    (cd /tmp/ab_base && PYTHONPATH=${PYTHONPATH/$PWD//tmp/ab_base} NBFLASH_CACHE_DIR=/tmp/ab_cache_base timeout 60 \
        python3 scripts/prebuild_cache.py --jobs 16 --dtypes float16 --families sm90 --headdims 64 128 \
        --variants plain causal) > "$out/prebuild_base.log" 2>&1
    echo "base prebuild (exit $?): $(tail -1 "$out/prebuild_base.log")"
    for run in base new; do
        tree=$PWD cache=${NBFLASH_CACHE_DIR:-/tmp/ab_cache_new}
        [ "$run" = new ] || { tree=/tmp/ab_base cache=/tmp/ab_cache_base; }
        (cd "$tree" && PYTHONPATH=${PYTHONPATH/$PWD/$tree} NBFLASH_CACHE_DIR=$cache timeout 95 \
            python3 scripts/bench.py --pass backward --families default --headdims 64 128 --seqlens 4096 16384 \
            --dtypes float16 --variants plain causal --no-naive --no-torch --budget 0.25) > "$out/verify_$run.log" 2>&1
        echo "$run (exit $?):"; tail -10 "$out/verify_$run.log"
    done
    ;;
wraps-time)
    # step 59 timed: the backward at hd 128 (and the forward as a control) in this tree and in the tree
    # before it (AB_BASE, default .ab/base.tar: `git archive -o .ab/base.tar <the commit before step
    # 59>` in the working tree), and in a third tree between them where AB_MID names one (step 60
    # apart from step 59: .ab/mid.tar, the commit before step 60), alternating, twice; each tree its
    # own kernel cache
    base=${AB_BASE:-.ab/base.tar} mid=${AB_MID:-}
    [ -f "$base" ] || { echo "no $base: git archive -o $base <the commit before step 59>, in the working tree"; exit 2; }
    [ -z "$mid" ] || [ -f "$mid" ] || { echo "no $mid"; exit 2; }
    rm -rf /tmp/ab_base /tmp/ab_mid && mkdir -p /tmp/ab_base && tar -xf "$base" -C /tmp/ab_base
    runs="base:1 new:1 base:2 new:2"
    if [ -n "$mid" ]; then
        mkdir -p /tmp/ab_mid && tar -xf "$mid" -C /tmp/ab_mid
        runs="base:1 mid:1 new:1 base:2 mid:2 new:2"
    fi
    for run in $runs; do
        tree=$PWD cache=${NBFLASH_CACHE_DIR:-/tmp/ab_cache_new}
        case ${run%:*} in
            base) tree=/tmp/ab_base cache=/tmp/ab_cache_base ;;
            mid) tree=/tmp/ab_mid cache=/tmp/ab_cache_mid ;;
        esac
        path=${PYTHONPATH/$PWD/$tree}  # this tree's nbflash first
        (cd "$tree" && PYTHONPATH=$path NBFLASH_CACHE_DIR=$cache timeout 130 \
            python3 scripts/bench.py --pass backward --families default --headdims ${HEADDIMS:-128} \
            --seqlens 4096 16384 --dtypes float16 --variants plain causal --no-naive --no-torch --budget 0.3) \
            > "$out/wraps_${run/:/_}.log" 2>&1
        echo "$run (exit $?):"; tail -${TAIL:-6} "$out/wraps_${run/:/_}.log"
    done
    ;;
options)
    # docs/perf-notes.md, steps 57 and 52: hd 128's planned kernel with dK and dV through K's and V's
    # tiles and TMA stores, and with a third ring stage, both mixed so far on the H100 (step 57 in
    # the twenty-third session: +3% at 4k, -2% and -3% at 16k, two runs; its grids passed there),
    # timed against the planned kernel, three runs; since the third stage is planned for plain
    # attention (twenty-ninth session), there "planned-tma" is both together and "planned-2st" the old plan
    for run in 1 2 3; do
        timeout 150 python3 scripts/sm90_schedules.py --backward --headdims 128 --only planned-tma planned-3st planned-2st \
            > "$out/options_$run.log" 2>&1
        echo "planned, TMA stores, 3 stages (exit $?):"; tail -6 "$out/options_$run.log"
    done
    ;;
dq-keys)
    # docs/perf-notes.md, step 48: the sm90 dQ kernel's key tiles past headdim 128, planned (64 keys at
    # hd 192, 32 at 256) against the largest two stages of which fit shared memory (80, 48), the pair's
    # kernels timed apart (the dK/dV kernel unchanged: a check of the timing's noise)
    timeout 150 python3 scripts/prebuild_cache.py --jobs 16 --headdims 192 256 --dtypes float16 \
        --families sm90 --variants plain causal > "$out/dq_keys_prebuild.log" 2>&1
    echo "prebuild (exit $?): $(tail -1 "$out/dq_keys_prebuild.log")"
    grid dq_keys_tests 150 tests/test_backward_dq_sm90.py -k key_tile_options_gpu
    timeout 120 python3 scripts/sm90_schedules.py --parts --headdims 192 256 > "$out/dq_keys_planned.log" 2>&1
    echo "planned (exit $?):"; tail -9 "$out/dq_keys_planned.log"
    timeout 300 python3 scripts/sm90_schedules.py --parts --headdims 192 256 --dq-keys 192:80 256:48 \
        > "$out/dq_keys_option.log" 2>&1
    echo "80 and 48 keys (exit $?):"; tail -9 "$out/dq_keys_option.log"
    ;;
pair-variants)
    # ... next 1: the pair with the features against the mma family's deterministic backward and the
    # atomic kernels (sm90: the wide one at 256), to plan them by default; causal, 8k, fp16
    timeout 170 python3 scripts/prebuild_cache.py --jobs 16 --headdims 64 128 256 --dtypes float16 \
        --families sm90 mma --variants causal-softcap causal-alibi causal-bias causal-dropout document-mask-mod \
        > "$out/pair_variants_prebuild.log" 2>&1
    echo "prebuild (exit $?): $(tail -1 "$out/pair_variants_prebuild.log")"
    timeout 380 python3 scripts/bench.py --pass backward --families sm90 mma --deterministic --headdims 64 128 256 \
        --seqlens 8192 --variants causal-softcap causal-alibi causal-bias causal-dropout document-mask-mod \
        causal-score-mod --dtypes float16 --no-naive --no-flex --budget 0.2 \
        --markdown "$out/pair_variants.md" > "$out/pair_variants.log" 2>&1
    echo "the pair with features (exit $?):"; tail -20 "$out/pair_variants.log"
    ;;
defaults)
    # The GPU tests not yet run since the sm90 backward became the default at headdims 16-256, with
    # deterministic=True too (the pair past 128 either way; 2026-12-06): the files whose tests take a
    # gradient, less those the resume logs (docs/runs/gpu-suite-2026-12-06-*.txt) report passed on
    # that plan. After a prebuild of the planned kernels on all cores.
    timeout 170 python3 scripts/prebuild_cache.py --jobs 16 --dtypes float16 bfloat16 > "$out/prebuild.log" 2>&1
    echo "prebuild (exit $?): $(tail -1 "$out/prebuild.log")"
    NBFLASH_RESUME_LOGS=${NBFLASH_RESUME_LOGS:-docs/runs/gpu-suite-2026-12-06-headdims.txt:docs/runs/gpu-suite-2026-12-06-defaults.txt:docs/runs/gpu-suite-2026-12-06-pair.txt} \
    TESTS=${TESTS:-"tests/test_backward_sm90.py::test_backward_default_headdims_gpu tests/test_fuzz.py \
        tests/test_variants_attention.py tests/test_backward_mma.py tests/test_hf.py \
        tests/test_dropout.py tests/test_block_mask.py tests/test_user_functions.py tests/test_concurrency.py \
        tests/test_lessons.py tests/test_first_run.py tests/test_faults.py tests/test_bad_inputs.py \
        tests/test_sanitize.py tests/test_bench.py tests/test_claims.py tests/test_compile_speed.py"} \
        run_tests "${2:-400}"
    ;;
sm90)
    # The GPU tests running sm90 kernels: since step 54 (2026-12-06, twenty-first session) stored dK, dV,
    # dq and the forward's O as 32-bit pairs, none has run on the current kernels (the uniform
    # descriptors' parts, docs/runs/gpu-suite-2026-12-06-uniform*.txt, ran the kernels before). Resume a
    # cut-off run with NBFLASH_RESUME_LOGS=<its log>. After a prebuild on all cores.
    # (the sm90 family's 128 planned kernels: all three families' 304 took more than 170 s on a fresh
    # machine, twenty-second session)
    timeout 170 python3 scripts/prebuild_cache.py --jobs 16 --dtypes float16 bfloat16 --families sm90 \
        > "$out/prebuild.log" 2>&1
    echo "prebuild (exit $?): $(tail -1 "$out/prebuild.log")"
    TESTS=${TESTS:-"tests/test_primitives.py tests/test_backward_sm90.py tests/test_backward_dq_sm90.py \
        tests/test_forward_sm90.py tests/test_varlen.py tests/test_block_mask.py tests/test_torch_bridge.py \
        tests/test_dropout.py tests/test_user_functions.py tests/test_variants_attention.py tests/test_fuzz.py"} \
        run_tests "${2:-400}"
    ;;
deterministic-variants)
    # docs/perf-notes.md, "Hopper backward", steps 45-47: the deterministic Hopper pair (forced) with
    # every variant, on packed sequences and with block masks, bit-identical reruns
    TESTS=${TESTS:-"tests/test_backward_sm90.py::test_backward_sm90_deterministic_variants_gpu \
        tests/test_varlen.py::test_varlen_sm90_backward_gpu tests/test_block_mask.py::test_block_mask_gpu"} \
        run_tests "${2:-540}"
    ;;
dqfirst)
    # docs/perf-notes.md, "Hopper backward", steps 28 and 29
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 240 python3 -m pytest -n 15 --dist loadgroup -v -p no:cacheprovider \
        -W ignore tests/test_backward_sm90.py -k "dq_last_gpu or dq_first_gpu or (test_backward_sm90_gpu and (-128- \
        or -96-)) or (variants_gpu and x128-)" > "$out/dqfirst_tests.log" 2>&1
    echo "tests: exit $?: $(tail -1 "$out/dqfirst_tests.log")"
    grep -aE "\] (FAILED|ERROR)" "$out/dqfirst_tests.log" | sed 's/^\[gw[0-9]*\] //' | head -20
    timeout 200 python3 scripts/sm90_schedules.py --backward --headdims 64 --only columns-dqfirst --anchors \
        > "$out/dqfirst_hd64.log" 2>&1
    echo "hd 64, 32-column halves with dQ first, against the rows split (exit $?):"; tail -12 "$out/dqfirst_hd64.log"
    timeout 120 python3 scripts/sm90_schedules.py --backward --headdims 64 --dropout 0.1 --only columns-dqfirst \
        > "$out/dqfirst_dropout.log" 2>&1
    echo "hd 64 dropout, the same against \"steps\" (exit $?):"; tail -8 "$out/dqfirst_dropout.log"
    # hd 128 dropout: the producer's keep bits were measured faster with dQ last; with dQ first the
    # consumers' step is shorter, and the producer's Philox calls may become its critical path
    timeout 120 python3 scripts/sm90_schedules.py --backward --headdims 128 --dropout 0.1 --only dropout-consumers \
        > "$out/dqfirst_dropout128.log" 2>&1
    echo "hd 128 dropout, the producer's bits (planned) against the consumers' (exit $?):"
    tail -6 "$out/dqfirst_dropout128.log"
    ;;
tiles)
    # docs/perf-notes.md, "Hopper backward", steps 32-37
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 220 python3 -m pytest -n 15 --dist loadgroup -v -p no:cacheprovider \
        -W ignore tests/test_primitives_sm90.py tests/test_backward_sm90.py tests/test_varlen.py \
        -k "dq_red or bulk_reduce or convert_dq_tiles or (rows_gpu and tiles) or columns_dq_first_gpu or dq_tiles_gpu or dq_reduce_gpu" \
        > "$out/tiles_tests.log" 2>&1
    echo "tests: exit $?: $(tail -1 "$out/tiles_tests.log")"
    grep -aE "\] (FAILED|ERROR)" "$out/tiles_tests.log" | sed 's/^\[gw[0-9]*\] //' | head -20
    timeout 330 python3 scripts/sm90_schedules.py --backward --headdims 64 128 \
        --only planned-red rows-tiles columns-dqfirst columns-tiles --anchors > "$out/tiles.log" 2>&1
    rc=$?
    echo "the planned kernels against dQ by atomics (hd 128), the rows split's tiles and backward_sm90.py by"
    echo "32-column halves, dQ first, by atomics and tile-major (hd 64) (exit $rc):"
    tail -22 "$out/tiles.log"
    ;;
early)
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 170 python3 -m pytest -n 15 --dist loadgroup -v -p no:cacheprovider \
        -W ignore tests/test_backward_sm90.py -k "(rows_gpu and (early or rotate)) or rotate_gpu" \
        > "$out/early_tests.log" 2>&1
    echo "tests: exit $?: $(tail -1 "$out/early_tests.log")"
    grep -aE "\] (FAILED|ERROR)" "$out/early_tests.log" | sed 's/^\[gw[0-9]*\] //' | head -20
    timeout "${2:-300}" python3 scripts/sm90_schedules.py --backward --headdims ${HEADDIMS:-64 128} --anchors \
        --only rows-dq rows-dq-dv planned-rotate rows-dq-rotate > "$out/early.log" 2>&1
    echo "schedules (exit $?):"
    tail -22 "$out/early.log"
    ;;
tiles2)
    # dropout: hd 64 (planned since step 41: by halves, dQ first, tile-major) against "planned-steps" (dQ last,
    # its plan before) and the halves by atomics ("planned-red"); hd 128 (planned: tiles, with the
    # producer's keep bits) against the atomics
    timeout 260 python3 scripts/sm90_schedules.py --backward --headdims 64 128 --dropout 0.1 \
        --only planned-steps planned-red > "$out/tiles_dropout.log" 2>&1
    echo "dropout 0.1 (exit $?):"
    tail -12 "$out/tiles_dropout.log"
    # packed sequences at hd 128 (step 37): the atomics (an option), then the planned tile-major dQ
    for form in red tiles; do
        timeout 140 python3 scripts/with_configs.py SM90_BACKWARD_VARLEN_DQ_TILES=$([ "$form" = tiles ] && echo on || echo off) \
            -- scripts/bench.py --pass varlen --varlen-backward --headdims 128 \
            --causal both --varlen-lengths uniform:16384:2048 --no-torch --budget 0.3 > "$out/varlen_$form.log" 2>&1
        echo "varlen backward, dq_reduce=$form (exit $?):"; tail -6 "$out/varlen_$form.log"
    done
    ;;
packed)
    # packed sequences of mean length 41-303 (perf-notes steps 38-39): hd 128 with the atomics and
    # with the tile-major dQ (the padding's limit lifted), each beside the mma backward; then hd 64
    # as planned (backward_sm90.py's "steps") beside the mma one
    for form in red tiles; do
        timeout 200 python3 scripts/with_configs.py SM90_BACKWARD_VARLEN_DQ_TILES=$([ "$form" = tiles ] && echo on || echo off) SM90_VARLEN_DQ_TILES_MAX_PADDING=1e9 \
            -- scripts/bench.py --pass varlen --varlen-backward --headdims 128 \
            --causal both --varlen-lengths uniform:16384:64 uniform:16384:128 uniform:16384:256 uniform:16384:512 \
            --no-torch --budget 0.2 > "$out/packed_$form.log" 2>&1
        echo "packed backward, hd 128, dq_reduce=$form (exit $?):"; tail -10 "$out/packed_$form.log"
    done
    timeout 150 python3 scripts/bench.py --pass varlen --varlen-backward --headdims 64 --causal both \
        --varlen-lengths uniform:16384:256 uniform:16384:2048 --no-torch --budget 0.2 > "$out/packed_64.log" 2>&1
    echo "packed backward, hd 64 (exit $?):"; tail -6 "$out/packed_64.log"
    ;;
headdims)
    # The sm90 backward against the mma one below 64 and past 128, where the mma one was the default
    # until this comparison (2026-12-06; configs.SM90_BACKWARD_DEFAULT_HEADDIMS since).
    timeout 230 python3 scripts/prebuild_cache.py --cc 9.0 --jobs 16 --headdims 32 48 192 256 --dtypes float16 \
        --families sm90 mma --variants plain causal > "$out/headdims_prebuild.log" 2>&1
    echo "prebuild (exit $?): $(tail -1 "$out/headdims_prebuild.log")"
    timeout 300 python3 scripts/bench.py --pass backward --families sm90 mma --headdims 32 48 192 256 \
        --seqlens 4096 16384 --causal both --dtypes float16 --no-naive --budget 0.2 \
        --markdown "$out/headdims_backward.md" > "$out/headdims_backward.log" 2>&1
    echo "backward by headdim (exit $?):"; tail -20 "$out/headdims_backward.log"
    ;;
fp8)
    # the fp8 forward after its V^T kernel (perf-notes "The fp8 forward's V^T"): the fp8 tests (the
    # overlapped and ping-pong options' included), then its speed next to the 16-bit sm90 kernel and
    # SDPA (the first figures, before that kernel, are in benchmarks.md's "Hopper forward"), then its
    # parts and schedules (scripts/fp8_parts.py); at most 8.5 minutes
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 180 python3 -m pytest -n 15 --dist loadgroup -v -p no:cacheprovider \
        -W ignore tests/test_forward_sm90.py tests/test_torch_bridge.py tests/test_bench.py -k fp8 > "$out/fp8_tests.log" 2>&1
    echo "fp8 tests (exit $?): $(tail -1 "$out/fp8_tests.log")"
    timeout 180 python3 scripts/bench.py --families sm90 --headdims 64 128 256 --seqlens 4096 16384 --dtypes float16 \
        --fp8 --no-naive --markdown "$out/fp8.md" > "$out/fp8.log" 2>&1
    echo "bench (exit $?):"; tail -16 "$out/fp8.log"
    timeout 150 python3 scripts/fp8_parts.py > "$out/fp8_parts.log" 2>&1  # V^T, the kernel's schedules, the call
    echo "parts (exit $?):"; tail -16 "$out/fp8_parts.log"
    ;;
exp2)
    # P's exponentials partly on the FMA pipes (exp2_fma_groups) and the V^T kernel's loads in flight
    # together, neither run on a GPU yet (docs/perf-notes.md, "The fp8 softmax's exponentials on the
    # FMA pipes"): their tests, then the fp8 kernel's plain loop against fma3 and fma5 and V^T at 256
    # and 128 threads (fp8_parts.py), then the 16-bit forward's fma2 and fma4 at hd 64 and 128
    # (sm90_schedules.py); at most 9 minutes
    grid exp2_tests 180 tests/test_primitives.py tests/test_forward_sm90.py -k "intrinsics_match or exp2 or fma or transposed_v or fp8_kernel_ring_wraps"
    timeout 190 python3 scripts/fp8_parts.py --headdims 64 128 --schedules plain fma3 fma5 --vt-threads 256 128 \
        > "$out/exp2_fp8.log" 2>&1
    echo "fp8 (exit $?):"; tail -12 "$out/exp2_fp8.log"
    timeout 150 python3 scripts/sm90_schedules.py --headdims 64 128 --only fma2 fma4 > "$out/exp2_16bit.log" 2>&1
    echo "16-bit (exit $?):"; tail -14 "$out/exp2_16bit.log"
    ;;
keys128)
    # docs/perf-notes.md, "Hopper backward", step 40: backward_sm90.py with 128 query rows a step and dQ
    # split by query rows (FlashAttention-3's hd 64 shape), its GPU grid, then timed against the planned
    # rows split at hd 64 with the anchors, twice (the second run a check of the first's noise)
    grid keys128_tests 200 tests/test_backward_sm90.py -k "keys128"
    for run in $(seq "${2:-2}"); do
        timeout 170 python3 scripts/sm90_schedules.py --backward --headdims 64 --only planned keys128 rows-tiles \
            --anchors > "$out/keys128_$run.log" 2>&1
        echo "planned, keys128, rows-tiles (exit $?):"; tail -12 "$out/keys128_$run.log"
    done
    ;;
keys128-next)
    # docs/perf-notes.md, "Where issue 13 stands (2026-12-07, twenty-ninth session)": the deterministic
    # dK/dV pass at 128 query rows a step (configs.SM90_DETERMINISTIC_KEYS128, an option) and the plan's
    # grids it touches; hd 32 and 48 side by side (the rows split against step 40); then the
    # deterministic backward's parts at hd 64 with the option off, then on (about 8 minutes; hd 128's
    # options after it: `options`)
    grid keys128_next_tests 180 tests/test_backward_sm90.py -k "keys128 or three_stages"
    timeout 150 python3 scripts/sm90_schedules.py --backward --headdims 32 48 --only planned keys128 rows-planned \
        --anchors > "$out/keys128_hd32_48.log" 2>&1
    echo "hd 32 and 48: planned, keys128, rows-planned (exit $?):"; tail -6 "$out/keys128_hd32_48.log"
    run=0
    for flag in "" --deterministic-keys128; do
        run=$((run + 1))
        timeout 70 python3 scripts/sm90_schedules.py --parts --deterministic --headdims 64 $flag \
            > "$out/keys128_deterministic_$run.log" 2>&1
        echo "deterministic parts, hd 64 ${flag:-(option off)} (exit $?):"; tail -4 "$out/keys128_deterministic_$run.log"
    done
    ;;
interleaved)
    # sm90_schedules.py --backward now times its schedules interleaved, call by call (the thirtieth
    # session found the schedule timed last 5-14% slower, whichever it was): hd 128's third ring
    # stage and TMA stores again (planned-2st is two stages for plain attention, planned-3st three for
    # causal), step 40 against the rows split at hd 32, 48 and 64, with the GPU's clocks, power and
    # throttle reasons sampled beside them (clocks.csv); about 6 minutes on a fresh machine
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv -lms 250 > "$out/clocks.csv" 2>&1 &
    sampler=$!
    for run in 1 2; do
        timeout 150 python3 scripts/sm90_schedules.py --backward --headdims 128 --only planned-tma planned-3st planned-2st \
            > "$out/interleaved_options_$run.log" 2>&1
        echo "hd 128: planned, TMA stores, 2 and 3 stages, interleaved (exit $?):"; tail -6 "$out/interleaved_options_$run.log"
    done
    timeout 200 python3 scripts/sm90_schedules.py --backward --headdims 32 48 64 --only keys128 rows-planned --anchors \
        > "$out/interleaved_keys128.log" 2>&1
    echo "hd 32, 48, 64: planned, keys128, rows-planned, interleaved (exit $?):"; tail -28 "$out/interleaved_keys128.log"
    kill "$sampler" 2> /dev/null
    echo "SM clock (MHz) and power (W) while timing: min, median, max; throttle reasons seen:"
    python3 - "$out/clocks.csv" <<'PY'
import csv, statistics, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) == 6 and r[1].strip()[:1].isdigit()]
if not rows:
    sys.exit("no samples: " + open(sys.argv[1]).read()[:300])
for name, column in (("clock", 1), ("power", 3)):
    xs = [float(r[column].split()[0]) for r in rows]
    print(name, min(xs), statistics.median(xs), max(xs))
print(sorted({r[5].strip() for r in rows}))
PY
    ;;
retime)
    # the choices made on margins under about 10% with the planned form timed last (docs/perf-notes.md,
    # "Timing order"), retimed interleaved: at hd 128 dQ's atomics and its old order against the
    # tile-major dQ first, the 16-byte stores, TMA stores, rotated walks, launch groups of 2 and 8; at
    # hd 64 the launch groups and the rows split; about 7 minutes on a fresh machine
    timeout 250 python3 scripts/sm90_schedules.py --backward --headdims 128 --only planned-red planned-dqlast \
        planned-quads planned-tma planned-rotate planned-groups2 planned-groups8 > "$out/retime_128.log" 2>&1
    echo "hd 128, interleaved (exit $?):"; tail -6 "$out/retime_128.log"
    timeout 200 python3 scripts/sm90_schedules.py --backward --headdims 64 --only planned-groups2 planned-groups8 \
        rows-planned --anchors > "$out/retime_64.log" 2>&1
    echo "hd 64, interleaved (exit $?):"; tail -13 "$out/retime_64.log"
    ;;
keys128-variants)
    # step 40 for the masks and ALiBi (configs.SM90_BACKWARD_KEYS128_VARIANTS, an option; docs/perf-notes.md
    # "Step 40 for the masks and ALiBi"): its GPU grid, then scripts/keys128_variants.py (the table's
    # kernel and step 40's timed interleaved at hd 64, 4k and 16k); about 8 minutes on a fresh machine
    grid keys128_variants_tests 220 tests/test_backward_sm90.py -k "keys128_variants"
    timeout 300 python3 scripts/keys128_variants.py > "$out/keys128_variants.log" 2>&1
    echo "step 40 with the masks and ALiBi, interleaved (exit $?):"; tail -13 "$out/keys128_variants.log"
    ;;
new-defaults)
    # the thirty-second session's plan (step 40 for the masks, ALiBi and packed sequences; the sm90
    # backward for a bool mask at hd 64): the bool mask's kernels prebuilt (both families, with and
    # without deterministic=True), the GPU tests whose default kernels the plan changed less those
    # docs/runs/gpu-suite-2026-12-07-thirty-second-defaults.txt reports, stopped after 260 s; then the
    # bool mask's deterministic backward on both families; about 8 minutes
    timeout 90 python3 scripts/prebuild_cache.py --jobs 16 --headdims 64 --dtypes float16 --families sm90 mma \
        --variants document-mask > "$out/new_defaults_prebuild.log" 2>&1
    echo "prebuild (exit $?): $(tail -1 "$out/new_defaults_prebuild.log")"
    NBFLASH_RESUME_LOGS=docs/runs/gpu-suite-2026-12-07-thirty-second-defaults.txt grid new_defaults_tests 260 \
        tests/test_varlen.py tests/test_variants_attention.py tests/test_backward_sm90.py tests/test_block_mask.py \
        tests/test_packed.py -k "varlen_sm90_backward_gpu or variant_gpu or varlen_gpu or sm90_variants_gpu \
        or dq_reduce_gpu or block_mask_gpu or padding_mask_with_a_window_gpu or torch_packed"
    timeout 100 python3 scripts/bench.py --pass backward --families sm90 mma --deterministic --headdims 64 \
        --seqlens 4096 16384 --variants document-mask --dtypes float16 --no-naive --no-flex --budget 0.2 \
        > "$out/mask_deterministic.log" 2>&1
    echo "the bool mask, deterministic (exit $?):"; tail -8 "$out/mask_deterministic.log"
    ;;
quads-groups)
    # hd 128's 16-byte dK/dV stores (step 55's quads: +0.9-3.5% in two interleaved runs of the
    # thirty-second session) on the planned kernels: their GPU grid, then timed against the plan once
    # more; hd 64's launch groups of 1 and 2 against its 4 at 4k, 16k and 32k, interleaved (groups of 2
    # won hd 64 16k plain by 5.8% and lost the other three cells); about 7 minutes
    grid quads_tests 200 tests/test_backward_sm90.py -k "store_quads_gpu"
    timeout 90 python3 scripts/sm90_schedules.py --backward --headdims 128 --only planned-quads planned-pairs planned \
        > "$out/quads128.log" 2>&1
    echo "hd 128 (exit $?):"; tail -6 "$out/quads128.log"
    timeout 130 python3 scripts/sm90_schedules.py --backward --headdims 64 --seqlens 4096 16384 32768 \
        --only planned-groups1 planned-groups2 planned > "$out/groups64.log" 2>&1
    echo "hd 64 (exit $?):"; tail -8 "$out/groups64.log"
    ;;
dq-warp)
    # the staged dQ_i added by the producer's warp 2, the stats warp only staging lse and D (dq_warp, an
    # option; docs/perf-notes.md "The stats warp's two duties apart"): its GPU grid, then the planned
    # kernels with it against without at hd 64 (step 40) and 128, interleaved, twice, then where the
    # hd 64 kernel with it waits at 16k (stalls 64 dqwarp); about 9 minutes
    grid dq_warp_tests 180 tests/test_backward_sm90.py -k "dq_warp"
    for run in 1 2; do
        timeout 130 python3 scripts/sm90_schedules.py --backward --headdims 64 128 --only planned-dqwarp planned \
            > "$out/dq_warp_$run.log" 2>&1
        echo "run $run (exit $?):"; tail -10 "$out/dq_warp_$run.log"
    done
    STALLS_SEQLEN=16384 bash "$0" stalls 64 dqwarp 2>&1 | grep -aE "^ncu|^ +[0-9.]+%|Throughput" | head -24
    rm -f "$out"/stalls_hd64_dqwarp*.log  # (at most 8 files come back: the summaries and pages stay)
    ;;
stats-ahead)
    # the late ring at hd 64 16k, three candidates (options): the stats warp loading step i + 1's lse and
    # D before it adds step i - 1's dQ (stats_ahead; docs/perf-notes.md "The stats warp's loads a step
    # ahead"), warp 2 adding the staged dQ (dq_warp), step 40's blocks walking their query tiles rotated
    # (rotate; "The blocks of a head adding into one dQ tile"): their GPU grids, then the planned kernels
    # with each against the plan at hd 64 (step 40) and 128, interleaved, twice (AHEAD_RUNS="1" once);
    # about 10 minutes, 6 with one run
    grid stats_ahead_tests 300 tests/test_backward_sm90.py -k "stats_ahead or dq_warp or keys128_rotate"
    for run in ${AHEAD_RUNS:-1 2}; do
        timeout 240 python3 scripts/sm90_schedules.py --backward --headdims 64 128 \
            --only planned-ahead planned-dqwarp-ahead planned-dqwarp planned-rotate planned \
            > "$out/stats_ahead_$run.log" 2>&1
        echo "run $run (exit $?):"; tail -14 "$out/stats_ahead_$run.log"
    done
    ;;
dq-warp-plan)
    # the thirty-fourth session's plan (configs.SM90_BACKWARD_DQ_WARP: warp 2 adds the staged dQ_i, the
    # stats warp loads a step ahead): dq_warp's GPU grid on packed sequences (an option there), then the
    # GPU tests the plan moves: the sm90 backward's grids as planned, its variants, the block masks, the
    # default backward's grid and the torch bridge's gradients (stopped at the limit); about 8 minutes
    grid varlen_dq_warp_tests 150 tests/test_varlen.py -k "dq_warp"
    PYTEST_ADDOPTS="-k 'not test_backward_sm90 or test_backward_sm90_gpu or keys128_gpu or keys128_variants_gpu \
or test_backward_sm90_variants_gpu'" TESTS="tests/test_backward_sm90.py tests/test_torch_bridge.py \
tests/test_block_mask.py tests/test_backward.py" run_tests "${2:-300}"
    grep -aE "\] PASSED" "$out/pytest.log" | sed 's/^\[gw[0-9]*\] //;s/ *PASSED.*//' | sort > "$out/passed.txt"
    sed 's/\[.*//' "$out/passed.txt" | uniq -c
    ;;
plan-suite)
    # The GPU tests that run the planned sm90 backward (dq_warp and stats_ahead since the thirty-fourth
    # session) by default: test_backward.py's grid, the variants with gradients, the default headdims,
    # the sm90 grid and schedules, block masks, dropout, score/mask functions, the fuzz and the torch
    # bridge; less what NBFLASH_RESUME_LOGS reports passed. After a prebuild of the sm90 family.
    timeout "${PREBUILD_LIMIT:-150}" python3 scripts/prebuild_cache.py --jobs 16 --dtypes float16 bfloat16 \
        --families sm90 > "$out/prebuild.log" 2>&1
    echo "prebuild (exit $?): $(tail -1 "$out/prebuild.log")"
    TESTS=${TESTS:-"tests/test_backward_sm90.py::test_backward_sm90_gpu tests/test_backward.py \
        tests/test_variants_attention.py tests/test_backward_sm90.py::test_backward_default_headdims_gpu \
        tests/test_backward_sm90.py::test_backward_sm90_schedules_gpu tests/test_block_mask.py \
        tests/test_dropout.py tests/test_user_functions.py tests/test_torch_bridge.py tests/test_fuzz.py"} \
        run_tests "${2:-400}"
    ;;
convert-quads)
    # the tile-major dQ conversion storing dq 16 bytes a lane (configs.SM90_CONVERT_DQ_QUADS, an option;
    # it ran at 0.47-0.57x a copy's bandwidth, 4-5% of the call at 4k: docs/perf-notes.md, thirty-fifth
    # session): its GPU grid, then the planned backward's kernels timed apart (--parts, which times
    # dq_accum's zeroing too) with the option off and on, alternating, twice; then the plan (16-byte
    # dK/dV stores at hd 128 since the thirty-fifth session) against its pairs and SDPA; about 6 minutes
    grid convert_quads_tests 150 tests/test_backward_sm90.py tests/test_varlen.py -k "convert_quads"
    for run in 1 2; do
        for option in off on; do
            timeout 70 python3 scripts/with_configs.py SM90_CONVERT_DQ_QUADS=$option \
                -- scripts/sm90_schedules.py --parts --headdims 64 128 \
                > "$out/convert_quads_${option}_$run.log" 2>&1
            echo "parts, convert quads $option, run $run (exit $?):"; tail -9 "$out/convert_quads_${option}_$run.log"
        done
    done
    timeout 130 python3 scripts/sm90_schedules.py --backward --headdims 128 64 --anchors --only planned-pairs planned \
        > "$out/plan_anchors.log" 2>&1
    echo "the plan against SDPA (exit $?):"; tail -22 "$out/plan_anchors.log"
    ;;
fold-dq)
    # the dQ conversion folded into the dK/dV kernel (configs.SM90_BACKWARD_FOLD_DQ, an option: the block
    # whose reduce-add completes a query tile converts it after its loop; docs/perf-notes.md, thirty-sixth
    # session): its GPU grid, then the plan with and without it against SDPA, twice (the first
    # run's kernels compiled on first use); about 8 minutes
    grid fold_dq_tests 260 tests/test_backward_sm90.py -k "fold_dq_gpu"
    for run in 1 2; do
        timeout 150 python3 scripts/sm90_schedules.py --backward --headdims 128 64 --anchors \
            --only planned-fold planned > "$out/fold_anchors_$run.log" 2>&1
        echo "the plan with and without the fold, run $run (exit $?):"; tail -22 "$out/fold_anchors_$run.log"
    done
    ;;
packed-quads)
    # dK and dV by 16-byte stores on packed sequences (configs.SM90_BACKWARD_VARLEN_STORE_QUADS, an option;
    # planned for dense sequences at hd 72-128 since the thirty-fifth session): its GPU grid, then
    # bench.py's packed backward at hd 128 with the option off and on, alternating, twice (each in its
    # own process); lengths drawn up to 2048 and 4096, and four of 4096; about 5 minutes
    grid packed_quads_tests 150 tests/test_varlen.py -k "store_quads_gpu"
    packed_off_on SM90_BACKWARD_VARLEN_STORE_QUADS packed_quads 60 128
    ;;
dq-warp-anchors)
    # the plan (dq_warp and stats_ahead) against the plan before (the stats warp adding the staged dQ),
    # dq_warp alone and (hd 128) the plan with 16-byte dK/dV stores (step 55's quads: +0.9-3.5% in eight
    # of eight cells before dq_warp; their grid: quads-groups; planned since the thirty-fifth session,
    # where "planned-pairs" is the plan without them), SDPA flash's and cuDNN's backwards in the
    # same loop, the plan timed last of ours (the order that read slow in the thirtieth session), twice;
    # about 5 minutes
    for run in 1 2; do
        timeout 130 python3 scripts/sm90_schedules.py --backward --headdims 64 128 --anchors \
            --only planned-statswarp planned-notahead planned-quads planned-pairs planned > "$out/dq_warp_anchors_$run.log" 2>&1
        echo "run $run (exit $?):"; tail -22 "$out/dq_warp_anchors_$run.log"
    done
    # the planned backward's three kernels timed apart: how much of 4k's time the preprocess and the dQ
    # conversion (and dq_accum's zeroing) take (about 6% at hd 128 by their bytes, 1.5% at 16k)
    timeout 90 python3 scripts/sm90_schedules.py --parts --headdims 64 128 > "$out/dq_warp_parts.log" 2>&1
    echo "parts (exit $?):"; tail -12 "$out/dq_warp_parts.log"
    ;;
packed-dq-warp)
    # dq_warp and stats_ahead on packed sequences (configs.SM90_BACKWARD_VARLEN_DQ_WARP, an option; the
    # dense plan since the thirty-fourth session): bench.py's packed backward at hd 64 (step 40) and 128
    # (the tiles) with the option off and on, alternating, twice (each in its own process); lengths drawn
    # up to 2048 and 4096 and four of 4096 (shorter ones take the atomics: no staged dQ); about 6 minutes
    packed_off_on SM90_BACKWARD_VARLEN_DQ_WARP packed_dq_warp 80 64 128
    ;;
ring3)
    # step 40 at hd 64 with one set of dS^T tiles (ds_buffers=1, a barrier a step between the consumers) and
    # a third ring stage in the bytes it frees (docs/perf-notes.md "A third ring stage for step 40 at hd 64"):
    # the GPU grid, then both against the plan at hd 64, interleaved (RING3_RUNS="1 2" twice); about 5 minutes
    grid ring3_tests 200 tests/test_backward_sm90.py -k "one_ds_set"
    for run in ${RING3_RUNS:-1}; do
        timeout 200 python3 scripts/sm90_schedules.py --backward --headdims 64 \
            --only planned-ring3 planned-ds1 planned > "$out/ring3_$run.log" 2>&1
        echo "run $run (exit $?):"; tail -8 "$out/ring3_$run.log"
    done
    ;;
keys128-det-variants)
    # deterministic=True's dK/dV pass at 128 query rows for the masks and ALiBi
    # (configs.SM90_DETERMINISTIC_KEYS128_VARIANTS, an option): its GPU grid (bit-identical reruns), then
    # the pass at 64 against 128 query rows, interleaved (keys128_variants.py --deterministic); about 8 minutes
    grid keys128_det_variants_tests 200 tests/test_backward_sm90.py -k "keys128_deterministic_variants"
    timeout 300 python3 scripts/keys128_variants.py --deterministic > "$out/keys128_det_variants.log" 2>&1
    echo "the deterministic pass with the masks and ALiBi, interleaved (exit $?):"; tail -13 "$out/keys128_det_variants.log"
    ;;
packed128)
    # step 40 on packed sequences (configs.SM90_BACKWARD_VARLEN_KEYS128, an option; docs/perf-notes.md
    # "Step 40 for packed sequences"): its GPU grid, then bench.py's packed backward at hd 64 with the
    # option off and on, alternating, twice (each in its own process); lengths drawn up to 2048 and
    # 4096 (the 128-row padding takes mean lengths from 1024 on) and four of 4096; about 6 minutes
    grid packed128_tests 200 tests/test_varlen.py -k "keys128 or plan_step_40 or dq_tiles_by_length"
    packed_off_on SM90_BACKWARD_VARLEN_KEYS128 packed128 90 64
    ;;
table-rotated)
    # issue 13's table on the plan of the thirtieth session (two ring stages at hd 128 again), bench.py's
    # columns timed in turns with their order rotated each round (four rounds, four columns: each
    # column once in each place), so that the one timed last is not always the same (docs/perf-notes.md,
    # "Timing order"); about 8 minutes on a fresh machine
    for pass in backward forward+backward; do
        timeout 280 python3 scripts/bench.py --pass "$pass" --families default --headdims 64 128 --seqlens 4096 16384 \
            --dtypes float16 --variants plain causal --no-naive --budget 0.3 --rounds 4 \
            --markdown "$out/rotated_${pass/+/_}.md" > "$out/rotated_${pass/+/_}.log" 2>&1
        echo "$pass (exit $?):"; tail -14 "$out/rotated_${pass/+/_}.log"
    done
    ;;
planned-now)
    # step 40 planned at headdims up to 64 (configs.SM90_BACKWARD_KEYS128) and a third ring stage at
    # 128 for plain attention (configs.SM90_BACKWARD_PLAIN_THREE_STAGES): the GPU tests whose default
    # or "sm90" backward they now run (plain, causal, the sliding window, the default's small
    # headdims, hd 128's plain grid, the torch bridge's gradients and training steps), then issue
    # 13's table (bench.py's two passes at hd 64 and 128 with the anchors) and the backward at hd 32
    grid planned_now_tests 250 tests/test_backward_sm90.py tests/test_torch_bridge.py tests/test_forward.py -k \
        "explain_reports or keys128 or planned_where_measured or (test_backward_sm90_gpu and (64 or 128)) or gradients_match \
        or training_steps or (test_backward_default_headdims_gpu and not (144 or 160 or 176 or 200 or 248)) \
        or (test_backward_sm90_variants_gpu and 2x113x203x4x2x64 and window) or three_stages"
    for pass in backward forward+backward; do
        timeout 160 python3 scripts/bench.py --pass "$pass" --families default --headdims \
            $([ "$pass" = backward ] && echo 32) 64 128 --seqlens 4096 16384 --dtypes float16 --variants plain \
            causal --no-naive --budget 0.3 --markdown "$out/issue13_${pass/+/_}.md" > "$out/issue13_${pass/+/_}.log" 2>&1
        echo "$pass (exit $?):"; tail -16 "$out/issue13_${pass/+/_}.log"
    done
    ;;
issue13)
    # the issue's item 3: bench.py's two passes side by side with the anchors (Flex through --variants)
    for pass in backward forward+backward; do
        timeout 270 python3 scripts/bench.py --pass "$pass" --families default --headdims 64 128 --seqlens 4096 16384 \
            --dtypes float16 --variants plain causal --no-naive --budget 0.3 --markdown "$out/issue13_${pass/+/_}.md" \
            > "$out/issue13_${pass/+/_}.log" 2>&1  # no "+" in the names: such files may not come back
        echo "$pass (exit $?):"; tail -12 "$out/issue13_${pass/+/_}.log"
    done
    ;;
dropout)
    # docs/perf-notes.md, "Hopper backward", step 26: dropout's keep bits from the producer's warps
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 150 python3 -m pytest -n 15 --dist loadgroup -v -p no:cacheprovider \
        -W ignore tests/test_backward_sm90.py tests/test_varlen.py -k staged_dropout > "$out/dropout_tests.log" 2>&1
    echo "tests: exit $?: $(tail -1 "$out/dropout_tests.log")"
    grep -aE "\] (FAILED|ERROR)" "$out/dropout_tests.log" | sed 's/^\[gw[0-9]*\] //' | head -20
    timeout 300 python3 scripts/sm90_schedules.py --backward --headdims 64 128 --dropout 0.1 \
        --only dropout-producer > "$out/dropout.log" 2>&1
    echo "dropout backward, keep bits by the consumers (planned) and by the producer (exit $?):"
    tail -16 "$out/dropout.log"
    ;;
stalls)
    # docs/perf-notes.md, "Where issue 13 stands": the stall reasons of the planned kernel's step
    headdim=${2:-128}
    for causal in "" "--causal"; do
        name="stalls_hd$headdim${3:+_$3}${causal:+_causal}"
        if [ "${3:-}" = fp8 ]; then kernel=forward_sm90 what="--fp8 --seqlen 16384"
        elif [ "${3:-}" = dqwarp ]; then kernel=backward_dkdv what="--seqlen ${STALLS_SEQLEN:-4096} --option dq_warp"
        elif [ "${3:-}" = ahead ]; then kernel=backward_dkdv what="--seqlen ${STALLS_SEQLEN:-4096} --option stats_ahead"
        elif [ "${3:-}" = rotate ]; then kernel=backward_dkdv what="--seqlen ${STALLS_SEQLEN:-4096} --option rotate"
        else kernel=backward_dkdv what="--seqlen ${STALLS_SEQLEN:-4096} ${3:+--dq-reduce $3}"; fi
        timeout 200 ncu --clock-control none --kernel-name regex:$kernel --launch-skip 1 --launch-count 1 \
            --section SourceCounters --section WarpStateStats --section SpeedOfLight -f -o "$out/$name" \
            python3 scripts/stall_report.py run --headdim "$headdim" $what $causal > "$out/$name.log" 2>&1
        echo "ncu ${causal:-plain} (exit $?): $(tail -1 "$out/$name.log")"
        timeout 120 ncu --import "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/$name.csv" 2>&1
        python3 scripts/stall_report.py summary "$out/$name.csv" --top 30 --context 3 > "$out/$name.txt" 2>&1
        head -40 "$out/$name.txt"  # (not through tee: head's exit would cut the file short)
        # the speed-of-light page: SM, L2 and DRAM throughput against their peaks
        timeout 60 ncu --import "$out/$name.ncu-rep" --page details --section SpeedOfLight > "$out/$name.sol.txt" 2>&1
        grep -aE "Throughput|Duration|Elapsed Cycles" "$out/$name.sol.txt" | head -12
        rm -f "$out/$name.ncu-rep"  # large; the summaries come back (the CSV too with STALLS_KEEP_CSV=1)
        [ -n "${STALLS_KEEP_CSV:-}" ] || rm -f "$out/$name.csv"
    done
    ;;
wide)
    # Issue 13's kernels not yet run on a GPU (docs/perf-notes.md, "Hopper backward", steps 20-22):
    # their GPU grids, each test named as it ends (-v), so a run cut short says what it reached.
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 470 python3 -m pytest -n 15 --dist loadgroup -v -p no:cacheprovider \
        -W ignore tests/test_varlen.py tests/test_backward_sm90.py -k "(varlen and sm90) or wide_gpu or wide_variants" \
        > "$out/wide_tests.log" 2>&1
    echo "tests: exit $?: $(tail -1 "$out/wide_tests.log")"
    grep -aE "\] (FAILED|ERROR)" "$out/wide_tests.log" | sed 's/^\[gw[0-9]*\] //' | head -30
    echo "passed: $(grep -acE '\] PASSED' "$out/wide_tests.log")  failed: $(grep -acE '\] FAILED' "$out/wide_tests.log")"
    ;;
*)
    echo "usage: $0 tests|bench|all|suite [SECONDS]|defaults [SECONDS]|prebuild [SECONDS]|reliability|sanitize|fuzz [EXAMPLES]|levers|deterministic|deterministic-variants [SECONDS]|options|wraps [SECONDS]|walks [SECONDS]|wraps-time|stores|sm90 [SECONDS]|dqfirst|tiles|tiles2|issue13|dropout|stalls [HEADDIM [red|tiles|fp8|dqwarp]]|wide|fp8|exp2|keys128 [RUNS]|planned-now|keys128-next|stats-ahead|plan-suite [SECONDS]|dq-warp-anchors|convert-quads|packed-quads|fold-dq" >&2
    exit 2
    ;;
esac
