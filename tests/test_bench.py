"""scripts/bench.py without a GPU: which flags each pass takes, its defaults, the varlen pass's
sequence lengths and FLOP count, and how the torch anchors' backward is timed alone (on a tiny CPU
graph, where torch is importable). One test runs a kernel: the --heavy-groups runner, in the
simulator."""

import importlib.util
import os
import sys
import types

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench.py")


@pytest.fixture(scope="module")
def bench():
    """The script as a module. Where CuPy is missing (the simulator's CI), a stand-in module is
    importable while the script loads, and only then: nothing here calls CuPy."""
    with pytest.MonkeyPatch.context() as patch:
        if importlib.util.find_spec("cupy") is None:
            patch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
        spec = importlib.util.spec_from_file_location("bench_script", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def arguments(bench, *argv):
    parser = bench.build_parser()
    return bench.resolve_arguments(parser, parser.parse_args(list(argv)))


def refused(bench, capsys, *argv):
    """The one-line parser error for ``argv`` (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        arguments(bench, *argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_each_pass_refuses_the_flags_of_the_others(bench, capsys):
    assert "--seqlens does not apply to --pass varlen" in refused(bench, capsys, "--pass", "varlen", "--seqlens", "512")
    assert "--no-naive does not apply to --pass varlen" in refused(bench, capsys, "--pass", "varlen", "--no-naive")
    assert "--page-sizes does not apply to --pass varlen" in refused(bench, capsys, "--pass", "varlen", "--page-sizes",
                                                                     "16")
    for flag, *value in (("--varlen-lengths", "128,256"), ("--varlen-heads", "16x4"), ("--jobs", "4"),
                         ("--varlen-backward",)):
        for which in ("forward", "decode"):
            error = refused(bench, capsys, "--pass", which, flag, *value)
            assert f"{flag} does not apply to --pass {which} (it goes with --pass varlen)" in error
    # --causal goes with the training passes and the varlen pass, not with decode.
    assert "(it goes with --pass forward, backward, forward+backward or varlen)" in refused(
        bench, capsys, "--pass", "decode", "--causal", "yes")
    assert arguments(bench, "--pass", "varlen", "--causal", "yes").causal == "yes"
    assert arguments(bench, "--pass", "decode", "--page-aligned").page_aligned is True
    assert arguments(bench, "--pass", "decode").page_aligned is False
    assert "--page-aligned does not apply to --pass forward" in refused(bench, capsys, "--page-aligned")


def test_forward_blocks_go_with_the_forward(bench, capsys):
    assert arguments(bench, "--forward-blocks", "64x32x2", "128x32x4").forward_blocks == ["64x32x2", "128x32x4"]
    assert arguments(bench).forward_blocks == []
    assert "--forward-blocks goes with --pass forward" in refused(bench, capsys, "--pass", "backward",
                                                                  "--forward-blocks", "64x32x2")
    assert "expected three positive integers as MxNxW" in refused(bench, capsys, "--forward-blocks", "64x32")
    assert "expected three positive integers as MxNxW" in refused(bench, capsys, "--forward-blocks", "64x0x2")


def test_rounds_go_with_the_training_passes(bench, capsys):
    assert arguments(bench).rounds == 1
    assert arguments(bench, "--pass", "backward", "--rounds", "5").rounds == 5
    assert "--rounds must be >= 1" in refused(bench, capsys, "--rounds", "0")
    assert "--rounds does not apply to --pass decode" in refused(bench, capsys, "--pass", "decode", "--rounds", "3")


def test_deterministic_goes_with_the_backward(bench, capsys):
    assert arguments(bench).deterministic is False
    assert arguments(bench, "--pass", "backward", "--deterministic").deterministic is True
    assert arguments(bench, "--pass", "forward+backward", "--deterministic").deterministic is True
    assert "--deterministic goes with --pass backward or forward+backward" in refused(bench, capsys, "--deterministic")
    assert "--deterministic does not apply to --pass varlen" in refused(bench, capsys, "--pass", "varlen",
                                                                        "--deterministic")


def test_heavy_groups_goes_with_the_forward(bench, capsys):
    assert arguments(bench, "--heavy-groups", "4", "8").heavy_groups == [4, 8]
    assert arguments(bench).heavy_groups == []
    assert "--heavy-groups goes with --pass forward" in refused(bench, capsys, "--pass", "backward", "--heavy-groups",
                                                                "8")
    assert "positive group sizes" in refused(bench, capsys, "--heavy-groups", "0")
    assert "--heavy-groups does not apply to --pass decode" in refused(bench, capsys, "--pass", "decode",
                                                                       "--heavy-groups", "8")


def test_fp8_goes_with_the_forward(bench, capsys):
    assert arguments(bench, "--fp8").fp8 is True
    assert arguments(bench).fp8 is False
    assert "--fp8 goes with --pass forward" in refused(bench, capsys, "--pass", "backward", "--fp8")
    assert "--fp8 does not apply to --pass decode" in refused(bench, capsys, "--pass", "decode", "--fp8")
    assert arguments(bench, "--fp8", "--variants", "plain", "causal").variants == ["plain", "causal"]
    assert "plain and causal rows only" in refused(bench, capsys, "--fp8", "--variants", "causal", "softcap")


def test_rescale_slack_goes_with_the_forward(bench, capsys):
    assert arguments(bench, "--rescale-slack", "8", "4").rescale_slack == [8.0, 4.0]
    assert arguments(bench).rescale_slack == []
    assert arguments(bench, "--rescale-slack", "0").rescale_slack == [0.0]  # eager, where lazy is planned
    for bad in (["--rescale-slack", "-1"], ["--rescale-slack", "9"], ["--pass", "backward", "--rescale-slack", "8"]):
        with pytest.raises(SystemExit):
            arguments(bench, *bad)


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="the simulator's arrays")
def test_rescale_slack_runner_is_within_rounding_of_the_planned_kernel(bench):
    """The --rescale-slack column's call: the same attention, P taken against older maxima."""
    import numpy as np

    import nbflash

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 40, 2, 16)).astype(np.float16) for _ in range(3))
    out, lse = bench.nbflash_replaced_runner("mma", rescale_slack=8.0)(q, k, v, True)()
    want, want_lse = nbflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert np.abs(out.astype(np.float32) - want.astype(np.float32)).max() < 2e-3
    assert np.abs(lse - want_lse).max() < 1e-4


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="the simulator's arrays")
def test_heavy_groups_runner_matches_the_planned_kernel(bench):
    """The --heavy-groups column's call: the planned kernel in the grouped order gives the planned
    kernel's bits (each block's work is the same; only the order differs)."""
    import numpy as np

    import nbflash

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 20, 3, 16)).astype(np.float16) for _ in range(3))
    out, lse = bench.nbflash_replaced_runner("mma", heavy_groups=4)(q, k, v, True)()
    want, want_lse = nbflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert np.array_equal(out, want) and np.array_equal(lse, want_lse)


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="the simulator's arrays")
def test_fp8_runner_is_the_fp8_forward_on_rounded_inputs(bench):
    """The --fp8 column's call: the public fp8 forward on the row's inputs rounded to e4m3 (as uint8
    bytes), the same bits as the call on float8_e4m3fn arrays; other variants are refused."""
    import ml_dtypes
    import numpy as np

    import nbflash

    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 40, 2, 64)).astype(np.float16) for _ in range(3))
    out = bench.nbflash_fp8_runner(q, k, v, True)()
    want = nbflash.flash_attn_func(*(x.astype(ml_dtypes.float8_e4m3fn) for x in (q, k, v)), causal=True)
    assert out.dtype == want.dtype and np.array_equal(out.view(np.uint16), want.view(np.uint16))
    with pytest.raises(NotImplementedError, match="softcap"):
        bench.nbflash_fp8_runner(q, k, v, False, softcap=30.0)


def test_varlen_defaults_and_parsed_values(bench):
    args = arguments(bench, "--pass", "varlen")
    assert (args.headdims, args.dtypes, args.causal, args.jobs) == ([128], ["float16"], "both", 0)
    assert args.varlen_heads == [(16, 16)] and args.varlen_backward is False
    assert arguments(bench, "--pass", "varlen", "--varlen-backward").varlen_backward is True
    labels = [label for label, _ in args.varlen_lengths]
    assert labels == ["uniform:16384:2048", "uniform:32768:8192", "128,512,1024,2048,4096,8192"]
    assert args.varlen_lengths[2][1] == [128, 512, 1024, 2048, 4096, 8192]
    args = arguments(bench, "--pass", "varlen", "--varlen-lengths", "uniform:100:40", "7,3", "--varlen-heads", "16x4",
                     "--jobs", "8")
    assert [label for label, _ in args.varlen_lengths] == ["uniform:100:40", "7,3"]
    assert sum(args.varlen_lengths[0][1]) == 100 and args.varlen_lengths[1][1] == [7, 3]
    assert (args.varlen_heads, args.jobs) == ([(16, 4)], 8)
    # The other passes' defaults are untouched by the varlen ones.
    assert arguments(bench).headdims == [64, 128, 256]
    assert arguments(bench, "--pass", "decode").decode_heads == [(32, 8), (32, 32)]


def test_bad_varlen_values_name_their_flag(bench, capsys):
    for argv, flag in ((["--varlen-lengths", "uniform:100"], "--varlen-lengths"),
                       (["--varlen-lengths", "uniform:0:8"], "--varlen-lengths"),
                       (["--varlen-lengths", "128,x"], "--varlen-lengths"),
                       (["--varlen-lengths", "128,0"], "--varlen-lengths"),
                       (["--varlen-heads", "16x3"], "--varlen-heads"),
                       (["--jobs", "-1"], "--jobs")):
        assert flag in refused(bench, capsys, "--pass", "varlen", *argv), argv


def test_uniform_lengths_fill_the_total_from_a_quarter_of_the_longest(bench):
    lengths = bench.uniform_lengths(16384, 2048)
    assert sum(lengths) == 16384
    assert all(512 <= n <= 2048 for n in lengths[:-1]) and 1 <= lengths[-1] <= 2048
    assert lengths == bench.uniform_lengths(16384, 2048)  # seed 0: the same batch every run
    assert lengths != bench.uniform_lengths(16384, 2048, seed=1)
    assert len(set(lengths)) > 1
    assert bench.uniform_lengths(10, 100) == [10]  # one draw already past the total: cut to fit
    assert bench.uniform_lengths(9, 1) == [1] * 9


def test_varlen_flops_sum_each_sequences_visible_scores(bench):
    nheads, headdim = 16, 128
    assert bench.varlen_flops([1000], nheads, headdim, False) == 4 * nheads * headdim * 1000 ** 2
    assert bench.varlen_flops([1000], nheads, headdim, True) == 4 * nheads * headdim * 1000 * 1001 // 2
    for causal in (False, True):
        lengths = [7, 300, 64, 1]
        total = sum(bench.varlen_flops([n], nheads, headdim, causal) for n in lengths)
        assert bench.varlen_flops(lengths, nheads, headdim, causal) == total
        # Mixed lengths compute more scores than equal ones with the same tokens.
        assert total > bench.varlen_flops([93] * 4, nheads, headdim, causal)


def test_backward_only_gives_each_backward_a_fresh_forward(bench):
    """The torch anchors' backward alone: an untimed forward before every timed backward, so no graph
    is retained (a compiled backward with donated buffers refuses that) and the gradients are one
    backward's, not a sum over the repeats."""
    torch = pytest.importorskip("torch")
    x = torch.arange(1.0, 5.0, requires_grad=True)
    forwards = []

    def forward():
        forwards.append(1)
        return x * x  # its graph can be walked once: a second backward through it would raise

    dout = torch.full((4,), 0.5)
    call = bench.BackwardOnly(forward, dout, (x,))
    assert call.time_ms(warmup=2, repeats=3, budget_s=0.0) >= 0.0
    assert len(forwards) == 2 + 3
    assert torch.equal(x.grad, 2 * x.detach() * dout)


def test_runners_take_the_catalogues_dropout_and_user_function(bench):
    """SDPA's runners take the dropout variants' probability (SDPA draws its own mask) and refuse
    what SDPA cannot express; the naive attention refuses every variant rather than time another."""
    import numpy as np

    from nbflash.catalogue import forward_arguments, variant_arguments
    from nbflash.prebuild import catalogue_variants
    from nbflash.problem import Variant

    dropout = variant_arguments("causal-dropout", 1, 2, 64, np)
    assert dropout.pop("causal") is True and bench.no_variant(dropout) == 0.2
    assert bench.no_variant({}) == 0.0
    score = variant_arguments("score-mod", 1, 2, 64, np)
    assert callable(score["score_mod"]) and score["score_mod"](3.5, 0, 1, 2, 3) == 3.5
    assert "score_mod_grad" not in forward_arguments(score)
    with pytest.raises(NotImplementedError, match="score_mod"):
        bench.no_variant(score)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        bench.naive_runner(None, None, None, False, **dropout)
    # prebuild compiles the dropout variants; a user function's kernels are built at its first call
    assert catalogue_variants(["causal-dropout", "score-mod"]) == [Variant(window=True, dropout=True)]


def test_visible_pairs_count_what_a_mask_keeps(bench):
    """TFLOP/s over the visible scores: a boolean mask tensor counts the pairs it keeps (a document
    mask of three runs a third of them), inside the window when there is one, once per (batch,
    head) it is broadcast over; a float bias changes nothing."""
    import numpy as np

    from nbflash.catalogue import document_mask

    n, batch, nheads = 96, 2, 3
    mask = document_mask(n, n)
    assert bench.visible_pairs(batch, nheads, n, False, {}) == batch * nheads * n * n
    assert bench.visible_pairs(batch, nheads, n, False, {"bias": mask}) == batch * nheads * 3 * 32 * 32
    assert bench.visible_pairs(batch, nheads, n, True, {"bias": mask}) == batch * nheads * 3 * (32 * 33 // 2)
    per_head = np.stack([mask, mask & np.tri(n, dtype=bool), mask])[None]  # (1, nheads, n, n)
    assert bench.visible_pairs(batch, nheads, n, False, {"bias": per_head}) == batch * int(per_head.sum())
    bias = np.zeros((n, n), np.float32)
    assert bench.visible_pairs(batch, nheads, n, True, {"bias": bias}) == batch * nheads * n * (n + 1) // 2
    # The same documents as the catalogue's mask_mod
    from nbflash.catalogue import variant_arguments

    mask_mod = variant_arguments("document-mask-mod", batch, nheads, n, np)
    assert bench.visible_pairs(batch, nheads, n, False, mask_mod) == batch * nheads * 3 * 32 * 32
    assert bench.visible_pairs(batch, nheads, n, True, mask_mod) == batch * nheads * 3 * (32 * 33 // 2)


def test_a_mask_mod_is_timed_with_its_block_mask(bench, xp):
    """The nbflash runners give a catalogue mask_mod its block mask (empty tiles skipped, as Flex's
    block mask skips them); a variant without one is checked as it is. The arrays are the backend's
    (CuPy on a GPU: nbflash refuses host arrays there)."""
    import numpy as np

    from nbflash.catalogue import variant_arguments

    rng = np.random.default_rng(0)
    q, k, v = (xp.asarray(rng.standard_normal((1, 40, 2, 16)).astype(np.float16)) for _ in range(3))
    problem = bench.checked(q, k, v, False, variant_arguments("document-mask-mod", 1, 2, 40, xp))[0]
    assert problem.static.variant.block_mask and problem.static.variant.mask_mod
    assert not bench.checked(q, k, v, True, {})[0].static.variant.block_mask



def test_time_ms_queues_before_ahead_of_each_start_event(monkeypatch):
    """nbflash.measure.time_ms(before=...): ``before()`` goes into the stream ahead of every timed
    call's start event (warm-ups included), so the call's host work overlaps it, as the torch
    anchors' backward overlaps its fresh forward; without ``before`` the start event comes first."""
    from types import SimpleNamespace

    from nbflash import measure

    log = []

    class Event:
        def __init__(self):
            self.name = "start" if not any(isinstance(x, Event) for x in log) else "stop"
            log.append(self)

        def record(self):
            log.append(f"{self.name}.record")

        def synchronize(self):
            pass

    def fake_cupy():
        return SimpleNamespace(cuda=SimpleNamespace(
            Event=Event, get_elapsed_time=lambda a, b: 2.0,
            get_current_stream=lambda: SimpleNamespace(synchronize=lambda: log.append("sync"))))

    monkeypatch.setattr(measure, "SIMULATOR", False)
    monkeypatch.setattr(measure.runtime, "cupy", fake_cupy)
    assert measure.time_ms(lambda: log.append("fn"), warmup=1, repeats=2, budget_s=0.0,
                           before=lambda: log.append("before")) == 2.0
    steps = [x for x in log if isinstance(x, str)]
    assert steps[:3] == ["before", "fn", "sync"]  # the warm-up
    timed = steps[3:]
    assert timed == ["before", "start.record", "fn", "stop.record"] * 2  # each timed call
    log.clear()
    measure.time_ms(lambda: log.append("fn"), warmup=0, repeats=1, budget_s=0.0)
    assert [x for x in log if isinstance(x, str)][1:4] == ["start.record", "fn", "stop.record"]


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="the simulator's arrays")
def test_default_family_forces_nothing(bench):
    """--families default: the planner's choice, as a user's call gets it (no family forced)."""
    import numpy as np

    import nbflash
    from nbflash import configs

    with bench.forcing("default"):
        assert configs.forced_family() is None
    with bench.forcing("mma"):
        assert configs.forced_family() == "sm80"
    assert bench.forced("default") is None and bench.forced("sm90") == "sm90"
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 24, 2, 16)).astype(np.float16) for _ in range(3))
    out, lse = bench.nbflash_runner("default")(q, k, v, True)()
    want, want_lse = nbflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert np.array_equal(out, want) and np.array_equal(lse, want_lse)
