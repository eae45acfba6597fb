"""Compile every kernel of tests/test_primitives_sm90.py for sm_90a and assemble it with ptxas, with no GPU.

    python scripts/check_sm90_ptx.py [--out DIR] [--only NAME ...] [--ptxas PATH] [--fp8-forward] [--backward]

For each kernel: Numba -> PTX (``compile_ptx(..., cc=(9, 0, "a"))``) -> ``ptxas -arch=sm_90a``. Prints
one line per kernel (registers, spills, ptxas warnings) and exits 1 if any kernel fails to compile or
assemble, or if ptxas warns: any C75xx message fails, e.g. a wgmma serialized (C7510, C7511), a wait
(C7517) or a warpgroup.arrive (C7519) injected because registers wgmma uses were written between
wgmma.fence and the wgmma. ptxas versions differ in what they report (13.0 printed C7519 where 13.5
said nothing), so ``--ptxas`` takes the one to check with.

A kernel that issues bulk copies or TMA also fails if one of its shared arrays is declared with an
alignment below 16 (other than 8-byte-aligned mbarrier words): Numba aligns a shared array to its
element size only, so a uint16 tile after an mbarrier word sits 8 bytes off and the copy faults on the
GPU (misaligned address), which the simulator cannot see.

With ``--out`` the PTX, cubin and ptxas log of each kernel are kept there. ``--fp8-forward`` adds the
fp8 forward's planned configs (nbflash.configs.SM90_FP8_FORWARD's headdims, and 64 and 96; plain
and causal), each with 3 key groups' exponentials on the FMA pipes (``exp2_fma_groups``), up to
headdim 128 also with the overlapped loop and with ping-pong (spills are
reported, not failed); ``--backward`` the sm90 dK/dV kernels' planned configs and the schedules
and variants listed in ``backward_kernels``.

Needs ptxas (the CUDA toolkit, or the nvidia-cuda-nvcc wheel) and Numba's NVVM; no GPU.
"""

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)  # before Numba is imported: compile for real

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prebuild_cache import cuda_tool, pretend_gpu  # noqa: E402

# The instruction each kernel must contain once compiled: proof the intrinsic reached the PTX.
EXPECTED = {
    "small": ["setmaxnreg.dec.sync.aligned.u32 40", "setmaxnreg.inc.sync.aligned.u32 232", "elect.sync",
              "fence.proxy.async.shared::cta", "wgmma.fence.sync.aligned"],
    "named_barriers": ["bar.sync", "bar.arrive"],
    "stmatrix": ["stmatrix.sync.aligned.m8n8.x4.shared.b16"],
    "descriptor_bits": [],
    "mbarrier_bulk_copy": ["mbarrier.init.shared::cta.b64", "mbarrier.arrive.expect_tx",
                           "mbarrier.try_wait.parity", "cp.async.bulk.shared::cluster.global"],
    "bounded_wait": ["mbarrier.try_wait.parity", "trap;"],
    "tma_store_2d": ["cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group", "cp.async.bulk.commit_group",
                     "cp.async.bulk.wait_group.read 0"],
    "tma_store_corner": ["cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group"],
    "store_shared_u32": ["st.shared.u32"],
    "tma_store_4d": ["cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group", "cp.async.bulk.commit_group",
                     "cp.async.bulk.wait_group.read 0"],
    "tma_reduce_add_4d": ["cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group",
                          "cp.async.bulk.commit_group", "cp.async.bulk.wait_group.read 0"],
    "bulk_reduce_add_f32": ["cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32", "st.shared.v4.f32",
                            "cp.async.bulk.commit_group", "cp.async.bulk.wait_group.read 0"],
    "tma_load_2d": ["cp.async.bulk.tensor.2d.shared::cluster.global.tile", "fence.proxy.tensormap::generic.acquire"],
    "wgmma": ["wgmma.mma_async.sync.aligned.m64n64k16.f32", "wgmma.commit_group.sync.aligned",
              "wgmma.wait_group.sync.aligned 0"],
    "wgmma_e4m3": ["wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3", "wgmma.wait_group.sync.aligned 0"],
    "wgmma_e5m2": ["wgmma.mma_async.sync.aligned.m64n64k32.f32.e5m2.e5m2", "wgmma.wait_group.sync.aligned 0"],
    "wgmma_fp8_two_gemm": ["wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3", "cvt.rn.satfinite.e4m3x2.f32"],
    "pack_e4m3": ["cvt.rn.satfinite.e4m3x2.f32"],
    "forward_fp8": ["k32.f32.e4m3.e4m3", "cvt.rn.satfinite.e4m3x2.f32", "cp.async.bulk.tensor.4d"],
    "copy_operands": ["mov.b32"],
    "backward_sm90": ["wgmma.mma_async.sync.aligned.m64n64k16.f32", "red.global.add.v2.f32", "cp.async.bulk.tensor.4d"],
    # dQ_i staged in shared memory in fragment order (16-byte stores), added by the producer's stats
    # warp by one bulk reduce-add a step (dq_reduce="tiles"): no red.add
    "backward_sm90_dq_tiles": ["wgmma.mma_async.sync.aligned.m64n64k16.f32", "st.shared.v4.f32",
                               "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32", "cp.async.bulk.tensor.4d"],
    "backward_sm90_rows_dq_tiles": ["wgmma.mma_async.sync.aligned.m64n64k16.f32", "st.shared.v4.f32",
                                    "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"],
    # the dq conversion from a tile-major dq_accum: 16-byte loads of consecutive threads
    "backward_sm90_convert_dq_tiles": ["ld.global.nc.v4.u32"],
    # fold_dq: warp 2 waits for its reduce-adds' completion, publishes them and counts; the consumers
    # read the completed tiles past L1
    "backward_sm90_fold_dq": ["cp.reduce.async.bulk", "cp.async.bulk.wait_group 0", "fence.proxy.async.global",
                              "atom.global.add.f32", "ld.global.cg.v4.u32", "bar.arrive"],
    "backward_sm90_keys128_fold_dq": ["wgmma.mma_async.sync.aligned.m64n128k16.f32", "cp.async.bulk.wait_group 0",
                                      "fence.proxy.async.global", "atom.global.add.f32", "ld.global.cg.v4.u32"],
    # block_m 128, dQ by query rows (step 40): S^T and dP^T 64 x 128, dQ by one bulk reduce-add a step
    "backward_sm90_keys128": ["wgmma.mma_async.sync.aligned.m64n128k16.f32", "cp.reduce.async.bulk"],
    # ... without dQ (the deterministic backward's dK/dV pass at block_m 128)
    "backward_sm90_keys128_deterministic": ["wgmma.mma_async.sync.aligned.m64n128k16.f32", "cp.async.bulk.tensor.4d"],
    # the deterministic backward's dK/dV pass (dq_split="none"): no dQ, so no reductions
    "backward_sm90_deterministic": ["wgmma.mma_async.sync.aligned.m64n64k16.f32", "cp.async.bulk.tensor.4d"],
    "backward_sm90_wide_deterministic": ["wgmma.mma_async.sync.aligned.m64n64k16.f32", "cp.async.bulk.tensor.4d"],
    # the dQ kernel past headdim 128: dQ (64 x headdim padded) += dS (registers) K_j
    "backward_dq_sm90": ["wgmma.mma_async.sync.aligned.m64n", "cp.async.bulk.tensor.4d"],
    "backward_dq_sm90_plain_hd192": ["wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16", "cp.async.bulk.tensor.4d"],
    "backward_dq_sm90_causal_hd192": ["wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16", "cp.async.bulk.tensor.4d"],
    "backward_dq_sm90_plain_hd256": ["wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16", "cp.async.bulk.tensor.4d"],
    "backward_dq_sm90_causal_hd256": ["wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16", "cp.async.bulk.tensor.4d"],
}


def fp8_forward_kernels():
    """(name, Python function, signature, compile options) of the fp8 forward's planned configs."""
    from nbflash import configs
    from nbflash.kernels import registry
    from nbflash.problem import Variant

    kernels = []
    # the table's headdims, and two whose products stop short of their 128-column chunks
    for headdim in sorted({64, 96, *(row[0] for row in configs.SM90_FP8_FORWARD)}):
        for variant in (Variant(), Variant(window=True)):
            config = configs.sm90_fp8_forward_config(headdim, variant)
            name = f"forward_fp8_hd{headdim}_{'causal' if variant.window else 'plain'}"
            # the plain loop, and up to headdim 128 the overlapped one alone and with the consumers'
            # turns (options; at 256, S, P and O do not fit beside each other: 48 and 168 bytes spilled
            # and the wgmmas serialized, ptxas 13.5)
            schedules = (("", {}), ("_overlap", {"overlap": True}), ("_pingpong", {"overlap": True, "pingpong": True}))
            # and with 3 of each row's 16 key groups' exponentials on the FMA pipes (an option)
            fma = (("_fma3", {"exp2_fma_groups": 3}),)
            for schedule, options in (schedules if headdim <= 128 else schedules[:1]) + fma:
                scheduled = dataclasses.replace(config, **options)
                kernels.append((name + schedule, registry.build(scheduled).py_func, registry.signature(scheduled),
                                {"launch_bounds": scheduled.launch_bounds}))
    return kernels


def backward_kernels():
    """(name, Python function, signature, compile options) of the sm90 dK/dV kernel's planned
    configs (fp16, plain), and at headdim 64 the 32-column "columns" split, the query rows split
    between the consumers (backward_sm90_rows.py: fp16 and bf16, plain and causal; and its
    persistent grid, fp16), causal dropout at each planned headdim (its keep bits made by the
    consumer lanes, and by the producer's warps 2 and 3), the causal kernel at each, dense and on
    packed sequences, dQ by 16-byte reductions, the deterministic pass, and the kernel for headdims
    past 128 (backward_sm90_wide.py) at 256: plain and causal, fp16 and bf16, and causal with
    softcap, with dropout and on packed sequences (fp16)."""
    import dataclasses

    from nbflash import configs
    from nbflash.kernels import registry
    from nbflash.problem import Variant

    found = [(f"backward_sm90_hd{headdim}", configs.sm90_backward_table_config("float16", headdim, Variant()))
             for headdim, *_ in configs.SM90_BACKWARD]
    # the other variants planned at hd 128: a block mask (document masks), causal softcap and ALiBi
    for name, variant in (("block_mask", Variant(block_mask=True)), ("causal_softcap", Variant(window=True, softcap=True)),
                          ("causal_alibi", Variant(window=True, alibi=True))):
        found.append((f"backward_sm90_{name}_hd128", configs.sm90_backward_table_config("float16", 128, variant)))
    hd64 = configs.sm90_backward_table_config("float16", 64, Variant())
    # dQ by 32-column halves (wgmma N = 32)
    found.append(("backward_sm90_columns_hd64", dataclasses.replace(hd64, dq_split="columns")))
    # the query rows split between the consumers (backward_sm90_rows.py), fp16 and bf16, plain and causal
    from nbflash.kernels.backward_sm90_rows import Sm90RowsBackwardConfig

    for dtype in ("float16", "bfloat16"):  # as planned (configs.SM90_BACKWARD_ROWS_DQ_EARLY included)
        for variant in (Variant(), Variant(window=True)):
            found.append((f"backward_sm90_rows_{'causal' if variant.window else 'plain'}_{dtype}_hd64",
                          configs.sm90_rows_backward_config(dtype, 64, variant)))
    for dtype in ("float16", "bfloat16"):  # P and dS stored by stmatrix
        for variant in (Variant(), Variant(window=True)):
            found.append((f"backward_sm90_rows_stmatrix_{'causal' if variant.window else 'plain'}_{dtype}_hd64",
                          Sm90RowsBackwardConfig(dtype, 64, variant, stmatrix=True)))
    for variant in (Variant(), Variant(window=True)):  # dQ staged, one bulk reduce-add a step (an option)
        found.append((f"backward_sm90_rows_dq_tiles_{'causal' if variant.window else 'plain'}_float16_hd64",
                      Sm90RowsBackwardConfig("float16", 64, variant, dq_reduce="tiles")))
    for early in ("none", "dq", "dq-dv"):  # all three products after dS's stores, or dQ's (and dV's) under them
        for variant in (Variant(), Variant(window=True)):
            found.append((f"backward_sm90_rows_early_{early.replace('-', '_')}_"
                          f"{'causal' if variant.window else 'plain'}_float16_hd64",
                          Sm90RowsBackwardConfig("float16", 64, variant, issue_early=early)))
    for variant in (Variant(), Variant(window=True)):  # each block's walk over the query tiles rotated
        found.append((f"backward_sm90_rotate_{'causal' if variant.window else 'plain'}_hd128", dataclasses.replace(
            configs.sm90_backward_table_config("float16", 128, variant), rotate=True)))
        found.append((f"backward_sm90_rows_rotate_{'causal' if variant.window else 'plain'}_float16_hd64",
                      Sm90RowsBackwardConfig("float16", 64, variant, rotate=True)))
    for variant in (Variant(), Variant(window=True)):  # a persistent grid, K and V double-buffered
        found.append((f"backward_sm90_rows_persistent_{'causal' if variant.window else 'plain'}_float16_hd64",
                      Sm90RowsBackwardConfig("float16", 64, variant, persistent=132)))
    # causal dropout (served when "sm90" is forced): P^T from the landed dP^T, shuffled Philox words
    for headdim, *_ in configs.SM90_BACKWARD:
        found.append((f"backward_sm90_causal_dropout_hd{headdim}", dataclasses.replace(
            configs.sm90_backward_table_config("float16", headdim, Variant(window=True, dropout=True)),
            dropout_bits="consumers")))
    # ... and with its keep bits made by the producer's warps 2 and 3 (dropout_bits="producer")
    for headdim, *_ in configs.SM90_BACKWARD:
        found.append((f"backward_sm90_staged_dropout_hd{headdim}", dataclasses.replace(
            configs.sm90_backward_table_config("float16", headdim, Variant(window=True, dropout=True)),
            dropout_bits="producer")))
    # packed sequences (served when "sm90" is forced): every array narrowed to the block's sequence,
    # TMA's rows offset by its first; beside the causal kernel of the same headdim
    for headdim, *_ in configs.SM90_BACKWARD:
        for varlen in (False, True):
            found.append((f"backward_sm90_{'varlen_' if varlen else ''}causal_hd{headdim}",
                          configs.sm90_backward_table_config("float16", headdim, Variant(window=True, varlen=varlen))))
    # dQ_i's product after dV's and dK's, its reductions once all three have landed (the planned
    # "columns" kernel before dq_first; hd 128)
    for variant in (Variant(), Variant(window=True)):
        found.append((f"backward_sm90_dq_last_{'causal' if variant.window else 'plain'}_hd128", dataclasses.replace(
            configs.sm90_backward_table_config("float16", 128, variant), dq_first=False)))
    # hd 64 by 32-column halves with dQ_i's product first (dq_first; "steps", the default there, would
    # issue it on alternate steps only, a branch around the wgmmas, which ptxas serializes: C7519),
    # plain, causal and with dropout (whose hd 64 default is backward_sm90.py's "steps" kernel)
    for name, variant in (("plain", Variant()), ("causal", Variant(window=True)),
                          ("causal_dropout", Variant(window=True, dropout=True))):
        found.append((f"backward_sm90_columns_dq_first_{name}_hd64", dataclasses.replace(
            configs.sm90_backward_table_config("float16", 64, variant), dq_split="columns", dq_first=True)))
    # dQ_i staged in shared memory and added by the producer's stats warp, one bulk reduce-add a step
    # into a tile-major dq_accum (dq_reduce="tiles", an option): hd 128 plain, causal, causal dropout,
    # a block mask
    for name, variant in (("plain", Variant()), ("causal", Variant(window=True)),
                          ("causal_dropout", Variant(window=True, dropout=True)), ("block_mask", Variant(block_mask=True))):
        found.append((f"backward_sm90_dq_tiles_{name}_hd128", dataclasses.replace(
            configs.sm90_backward_table_config("float16", 128, variant), dq_reduce="tiles")))
    # ... planned, with a third ring stage (an option, step 52: 232,008 of 232,448 bytes)
    for name, variant in (("plain", Variant()), ("causal", Variant(window=True))):
        found.append((f"backward_sm90_dq_tiles_3st_{name}_hd128", dataclasses.replace(
            configs.planned_backward_sm90_config("float16", 128, variant), stages=3)))
    # ... planned, dK and dV by 16-byte stores after the quads' transposes (step 55; planned since the
    # thirty-fifth session: configs.SM90_BACKWARD_STORE_QUADS)
    for name, variant in (("plain", Variant()), ("causal", Variant(window=True))):
        found.append((f"backward_sm90_dq_tiles_store_quads_{name}_hd128", dataclasses.replace(
            configs.planned_backward_sm90_config("float16", 128, variant), store_quads=True)))
    # ... planned, dK and dV through K's and V's tiles and TMA stores (an option, step 57)
    for name, variant in (("plain", Variant()), ("causal", Variant(window=True))):
        found.append((f"backward_sm90_dq_tiles_store_tma_{name}_hd128",
                      configs.planned_backward_sm90_config("float16", 128, variant).replaced(store_tma=True)))
    # ... planned, the staged dQ_i added by the producer's warp 2, the stats warp only staging lse and D
    # (``dq_warp``, an option), at hd 128 and in step 40's kernel at hd 64
    for name, variant in (("plain", Variant()), ("causal", Variant(window=True))):
        found.append((f"backward_sm90_dq_tiles_dq_warp_{name}_hd128", dataclasses.replace(
            configs.planned_backward_sm90_config("float16", 128, variant), dq_warp=True)))
        found.append((f"backward_sm90_keys128_dq_warp_{name}_hd64", dataclasses.replace(
            configs.keys128_backward_config("float16", 64, variant), dq_warp=True)))
    # ... planned, the stats warp's lse and D loaded a step ahead (``stats_ahead``, an option), with the
    # staged dQ_i added by the stats warp or by warp 2 (dq_warp), plain, at hd 128 and in step 40's kernel
    for dq_warp in (False, True):
        warp2 = "_dq_warp" if dq_warp else ""
        found.append((f"backward_sm90_dq_tiles{warp2}_stats_ahead_plain_hd128", dataclasses.replace(
            configs.planned_backward_sm90_config("float16", 128, Variant()), dq_warp=dq_warp, stats_ahead=True)))
        found.append((f"backward_sm90_keys128{warp2}_stats_ahead_plain_hd64", dataclasses.replace(
            configs.keys128_backward_config("float16", 64, Variant()), dq_warp=dq_warp, stats_ahead=True)))
    # ... planned, the dQ conversion folded in (``fold_dq``, an option), at hd 128 and in step 40's kernel
    for name, variant in (("plain", Variant()), ("causal", Variant(window=True))):
        found.append((f"backward_sm90_fold_dq_{name}_hd128", dataclasses.replace(
            configs.planned_backward_sm90_config("float16", 128, variant), dq_warp=True, fold_dq=True)))
        found.append((f"backward_sm90_keys128_fold_dq_{name}_hd64", dataclasses.replace(
            configs.keys128_backward_config("float16", 64, variant), dq_warp=True, fold_dq=True)))
    # ... step 40's kernel with each block's query tiles rotated (``rotate``, an option there)
    for name, variant in (("plain", Variant()), ("alibi", Variant(window=True, alibi=True))):
        found.append((f"backward_sm90_keys128_rotate_{name}_hd64", dataclasses.replace(
            configs.keys128_backward_config("float16", 64, variant), rotate=True)))
    # ... and all three options of the late ring together (dq_warp, stats_ahead, rotate), plain
    found.append(("backward_sm90_keys128_all_plain_hd64", dataclasses.replace(
        configs.keys128_backward_config("float16", 64, Variant()), dq_warp=True, stats_ahead=True, rotate=True)))
    found.append(("backward_sm90_rows_store_quads_causal_hd64", dataclasses.replace(
        configs.sm90_rows_backward_config("float16", 64, Variant(window=True)), store_quads=True)))
    # ... on packed sequences (planned since step 37), causal at hd 128
    found.append(("backward_sm90_dq_tiles_varlen_causal_hd128", dataclasses.replace(
        configs.sm90_backward_table_config("float16", 128, Variant(window=True, varlen=True)), dq_reduce="tiles")))
    # the same at hd 64 by 32-column halves with dQ_i's product first (an option, step 36)
    for name, variant in (("plain", Variant()), ("causal", Variant(window=True)),
                          ("causal_dropout", Variant(window=True, dropout=True))):
        found.append((f"backward_sm90_dq_tiles_columns_{name}_hd64", dataclasses.replace(
            configs.sm90_backward_table_config("float16", 64, variant), dq_split="columns", dq_first=True,
            dq_reduce="tiles")))
    # block_m 128 with dQ split by query rows (step 40: FlashAttention-3's hd 64 shape), plain and causal
    for variant in (Variant(), Variant(window=True)):
        found.append((f"backward_sm90_keys128_{'causal' if variant.window else 'plain'}_hd64",
                      configs.keys128_backward_config("float16", 64, variant)))
        found.append((f"backward_sm90_keys128_deterministic_{'causal' if variant.window else 'plain'}_hd64",
                      dataclasses.replace(configs.sm90_backward_table_config("float16", 64, variant), block_m=128,
                                          dq_split="none")))
    # ... with the masks and ALiBi (configs.SM90_BACKWARD_KEYS128_VARIANTS, planned), beside the table's
    # kernel they run otherwise (softcap, a float bias and dropout spill 88-327 local accesses a step at
    # block_m 128: refused, backward_sm90.keys128_serves)
    for name, variant in (("alibi", Variant(window=True, alibi=True)), ("block_mask", Variant(block_mask=True)),
                          ("mask", Variant(window=True, mask=True))):
        found.append((f"backward_sm90_keys128_{name}_hd64", configs.keys128_backward_config("float16", 64, variant)))
        found.append((f"backward_sm90_table_{name}_hd64", configs.sm90_backward_table_config("float16", 64, variant)))
        # ... and without dQ (the deterministic backward's dK/dV pass at 128 query rows)
        found.append((f"backward_sm90_keys128_deterministic_{name}_hd64", dataclasses.replace(
            configs.sm90_backward_table_config("float16", 64, variant), block_m=128, dq_split="none")))
    # ... on packed sequences (configs.SM90_BACKWARD_VARLEN_KEYS128, planned), plain and causal
    for variant in (Variant(varlen=True), Variant(window=True, varlen=True)):
        found.append((f"backward_sm90_keys128_varlen_{'causal' if variant.window else 'plain'}_hd64",
                      configs.keys128_backward_config("float16", 64, variant)))
    from nbflash.kernels.backward_sm90 import Sm90ConvertDqConfig

    for dtype, headdim, columns in (("float16", 128, 64), ("bfloat16", 96, 64), ("float16", 64, 64),
                                    ("float16", 64, 32)):  # ... its dq conversion (hd 64: the rows split's
        found.append((f"backward_sm90_convert_dq_tiles_{dtype}_hd{headdim}_part{columns}",  # and the halves')
                      Sm90ConvertDqConfig(dtype, headdim, columns)))
    for headdim in (128, 64):  # ... dq stored 16 bytes a lane (store_quads, an option: SM90_CONVERT_DQ_QUADS)
        found.append((f"backward_sm90_convert_dq_tiles_quads_float16_hd{headdim}",
                      Sm90ConvertDqConfig("float16", headdim, 64, store_quads=True)))
    found.append(("backward_sm90_convert_dq_tiles_varlen_float16_hd128",  # packed sequences' (step 37)
                  Sm90ConvertDqConfig("float16", 128, 64, varlen=True)))
    found.append(("backward_sm90_convert_dq_tiles_varlen_float16_hd64_rows128",  # ... after step 40's tiles
                  Sm90ConvertDqConfig("float16", 64, 64, varlen=True, tile_rows=128)))
    found.append(("backward_sm90_keys_plain_hd128", dataclasses.replace(  # by keys with red.add (step 1's)
        configs.sm90_backward_table_config("float16", 128, Variant()), dq_split="keys", dq_first=False)))
    # the deterministic backward's dK/dV pass (no dQ: dq_split="none"), plain at each planned headdim
    for headdim, *_ in configs.SM90_BACKWARD:
        found.append((f"backward_sm90_deterministic_hd{headdim}", dataclasses.replace(
            configs.sm90_backward_table_config("float16", headdim, Variant()), dq_split="none", dq_first=False)))
    # ... past headdim 128: the wide dK/dV kernel without dQ, then the dQ kernel with smaller key
    # tiles (configs.SM90_DQ), plain and causal, at each row's largest headdim, as planned
    for headdim in (192, 256):
        for variant in (Variant(), Variant(window=True)):
            name = "causal" if variant.window else "plain"
            dkdv, dq = configs.sm90_deterministic_configs("float16", headdim, variant)
            found.append((f"backward_sm90_wide_deterministic_{name}_hd{headdim}", dkdv))
            found.append((f"backward_dq_sm90_{name}_hd{headdim}_keys{dq.block_n}", dq))
            # ... and the largest key tiles two stages of which fit shared memory (options, not planned)
            keys = {192: 80, 256: 48}[headdim]
            found.append((f"backward_dq_sm90_{name}_hd{headdim}_keys{keys}",
                          dataclasses.replace(dq, block_n=keys)))
    # ... and the dQ kernel's variants at hd 128 (causal): softcap, dropout (the dK/dV kernel without dQ
    # is backward_sm90.py's, whose variants are listed above)
    for feature in ("softcap", "dropout"):
        dkdv, dq = configs.sm90_deterministic_configs("float16", 128, Variant(window=True, **{feature: True}))
        found.append((f"backward_sm90_deterministic_causal_{feature}_hd128", dkdv))
        found.append((f"backward_dq_sm90_causal_{feature}_hd128_keys{dq.block_n}", dq))
    # headdims past 128: the consumers split headdim (backward_sm90_wide.py), fp16 and bf16, plain and causal
    from nbflash.kernels.backward_sm90_wide import Sm90WideBackwardConfig

    for dtype in ("float16", "bfloat16"):
        for variant in (Variant(), Variant(window=True)):
            found.append((f"backward_sm90_wide_{'causal' if variant.window else 'plain'}_{dtype}_hd256",
                          Sm90WideBackwardConfig(dtype, 256, variant)))
    # ... and its variants (fp16, causal): a score feature and dropout (dS^T made in the hand-over),
    # packed sequences (the bounds read again each step)
    for feature in ("softcap", "dropout", "varlen"):
        found.append((f"backward_sm90_wide_{feature}_causal_float16_hd256",
                      Sm90WideBackwardConfig("float16", 256, Variant(window=True, **{feature: True}))))
    return [(name, registry.build(config).py_func, registry.signature(config), {"launch_bounds": config.launch_bounds})
            for name, config in found]


def expected_instructions(name):
    """The EXPECTED entry of a kernel: its own, else that of its longest listed prefix."""
    prefixes = [key for key in EXPECTED if name == key or name.startswith(key + "_")]
    return EXPECTED[max(prefixes, key=len)] if prefixes else EXPECTED[name]


# A module-scope shared array in Numba's PTX: ".visible .shared .align 8 .b8 _cudapy_smem_2[8];".
SHARED_ARRAY = re.compile(r"^\s*(?:\.visible\s+)?\.shared\s+\.align\s+(\d+)\s+\.b8\s+(\w+)\[(\d+)\]", re.M)


def misaligned_shared_arrays(ptx):
    """The shared arrays of a kernel using the bulk-copy engine that may start off a 16-byte boundary:
    declared with .align below 16, except 8-byte words at .align 8 (mbarriers), which are 8-aligned
    anywhere. Where ptxas places the arrays is its choice, so any of them may follow another."""
    if "cp.async.bulk" not in ptx:
        return []
    found = []
    for align, label, size in SHARED_ARRAY.findall(ptx):
        align, size = int(align), int(size)
        if align < 16 and not (align == 8 and size == 8):
            found.append(f"{label}[{size}] .align {align}")
    return found


def check(name, pyfunc, sig, options, out_dir, ptxas):
    from numba import cuda

    ptx, _ = cuda.compile_ptx(pyfunc, sig, cc=(9, 0, "a"), **options)
    if ".target sm_90a" not in ptx:
        return False, "PTX is not .target sm_90a"
    missing = [s for s in expected_instructions(name) if s not in ptx]
    if missing:
        return False, f"PTX lacks {missing}"
    loose = misaligned_shared_arrays(ptx)
    if loose:
        return False, f"shared arrays not 16-byte aligned in a kernel with bulk copies (alignment=...): {loose}"
    ptx_path = os.path.join(out_dir, f"{name}.ptx")
    with open(ptx_path, "w") as f:
        f.write(ptx)
    run = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx_path, "-o", os.path.join(out_dir, f"{name}.cubin")],
                         capture_output=True, text=True)
    log = run.stdout + run.stderr
    with open(os.path.join(out_dir, f"{name}.ptxas.log"), "w") as f:
        f.write(log)
    if run.returncode:
        return False, "ptxas failed:\n" + log
    # C75xx: ptxas serialized wgmma or injected waits of its own (e.g. C7510, C7517).
    warnings = [line for line in log.splitlines() if "warning" in line.lower() or "(C75" in line]
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    summary = f"{regs.group(1) if regs else '?'} registers, {spills.group(1) if spills else '?'} bytes spilled"
    if warnings:
        return False, summary + "; ptxas warnings:\n" + "\n".join(warnings)
    return True, summary


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)\s*$")


def loop_local_accesses(cubin, cuobjdump):
    """(wgmmas, instructions, local loads and stores, signed-index wraps: ``signed_index_wraps``,
    integer divisions: ``integer_divisions``, calls) of the loop that holds the most HGMMAs: the
    strongly connected component of the SASS control-flow graph whose blocks hold them (None
    without wgmma).
    Spills outside the loop (values kept for the epilogue) cost once per block; these cost every
    step."""
    sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in _SASS_LINE.finditer(sass)]
    at = {address: i for i, (address, _) in enumerate(code)}

    def target(text):
        m = _BRANCH_TARGET.search(text)
        return at.get(int(m.group(1), 16)) if m else None

    starts = {0}  # basic blocks begin at branch targets and after branches and exits
    for i, (_, text) in enumerate(code):
        if target(text) is not None:
            starts.add(target(text))
        if re.search(r"\b(BRA|EXIT)\b", text):
            starts.add(i + 1)
    starts = sorted(i for i in starts if i < len(code))
    ends = starts[1:] + [len(code)]
    block = {i: b for b, (s, e) in enumerate(zip(starts, ends)) for i in range(s, e)}
    successors = []
    for s, e in zip(starts, ends):
        last = code[e - 1][1]
        out = {block[target(last)]} if target(last) is not None else set()
        if not (re.match(r"(BRA|EXIT)\b", last)) and e < len(code):  # unpredicated branches do not fall through
            out.add(block[e])
        successors.append(out)
    # Tarjan's strongly connected components, iteratively
    order, low, component, stack, on_stack = {}, {}, {}, [], set()
    for root in range(len(starts)):
        if root in order:
            continue
        work = [(root, iter(successors[root]))]
        order[root] = low[root] = len(order)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == order[v]:
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        component[x] = v
                        if x == v:
                            break
            elif w not in order:
                order[w] = low[w] = len(order)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(successors[w])))
            elif w in on_stack:
                low[v] = min(low[v], order[w])
    hgmma = [component[block[i]] for i, (_, text) in enumerate(code) if "HGMMA" in text]
    if not hgmma:
        return None
    loop = max(hgmma, key=hgmma.count)  # a pipelined loop's prologue issues some wgmmas outside it
    body = [text for i, (_, text) in enumerate(code) if component[block[i]] == loop]
    return (sum("HGMMA" in t for t in body), len(body),
            sum(bool(re.search(r"\b(LDL|STL)\b", t)) for t in body), signed_index_wraps(body), integer_divisions(body),
            sum(bool(re.search(r"\bCALL\b", t)) for t in body))


def signed_index_wraps(body):
    """How many ANDs in ``body`` (SASS texts) wrap an array index as Python's: Numba indexes an
    array with a signed index as ``i + (len if i < 0 else 0)``, which ptxas assembles as a sign
    shift (SHF.R.S32.HI r, RZ, 0x1f), an AND of it with the length (a uniform register or a
    constant) and an add, for each 32-bit half the index needs (so one AND a wrapped index, or two
    where both halves are kept). An unsigned index, or a shared address (store_shared_u32), has
    none."""
    signs, wraps = set(), 0
    for text in body:
        m = re.search(r"SHF\.R\.S32\.HI (R\d+), RZ, 0x1f", text)
        if m:
            signs.add(m.group(1))
        m = re.search(r"LOP3\.LUT (R\d+), (R\d+), (UR\d+|c\[[^]]+\]\[[^]]+\]), RZ, 0xc0", text)
        if m and m.group(2) in signs:
            wraps += 1
    return wraps


def integer_divisions(body):
    """How many integer divisions (or modulos) by a value known only at run time ``body`` (SASS
    texts) makes: each starts from a float reciprocal of the divisor (I2F.U32.RP, then MUFU.RCP and a
    correction: about 15 instructions for 32 unsigned bits). A 64-bit signed one (Python's ``//``
    and ``%`` on int64) adds a test for 32-bit operands, a call to the 64-bit routine and the sign
    fixes: a few dozen instructions (it shows as a call, counted apart by ``loop_local_accesses``).
    A division by a power of two is a shift and counts none."""
    return sum(bool(re.search(r"\bI2F(\.U32)?\.RP\b", t)) for t in body)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="keep PTX, cubins and ptxas logs in this folder")
    parser.add_argument("--only", nargs="*", help="kernel names (default: all)")
    parser.add_argument("--ptxas", help="the ptxas to assemble with (default: the nvcc wheel's, else PATH's)")
    parser.add_argument("--fp8-forward", action="store_true", help="also the fp8 forward's planned configs")
    parser.add_argument("--backward", action="store_true", help="also the sm90 dK/dV kernel's planned configs")
    parser.add_argument("--loop-spills", action="store_true",
                        help="also count the local loads and stores in the loop holding the wgmmas (needs cuobjdump)")
    args = parser.parse_args()

    pretend_gpu((9, 0))
    ptxas = args.ptxas or cuda_tool("ptxas")
    from tests.test_primitives_sm90 import offline_kernels

    out_dir = args.out or tempfile.mkdtemp(prefix="sm90_ptx_")
    os.makedirs(out_dir, exist_ok=True)
    failed = 0
    kernels = (offline_kernels() + (fp8_forward_kernels() if args.fp8_forward else [])
               + (backward_kernels() if args.backward else []))
    for name, pyfunc, sig, options in kernels:
        if args.only and name not in args.only:
            continue
        try:
            ok, message = check(name, pyfunc, sig, options, out_dir, ptxas)
        except Exception as e:  # a typing or lowering error: report it and go on
            if os.environ.get("TRACEBACK"):
                import traceback
                traceback.print_exc()
            ok, message = False, f"{type(e).__name__}: {e}"
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {message}", flush=True)
        counts = ok and args.loop_spills and loop_local_accesses(os.path.join(out_dir, f"{name}.cubin"),
                                                                 cuda_tool("cuobjdump"))
        if counts:
            print("     its loop: {} HGMMA, {} instructions, {} local loads/stores, {} signed-index wraps, "
                  "{} integer divisions, {} calls".format(*counts), flush=True)
    print(f"{failed} failed" if failed else "all kernels compiled for sm_90a and assembled")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
