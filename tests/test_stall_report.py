"""scripts/stall_report.py's summary of ncu's source page, on a made-up CSV (no GPU): the hottest
instructions with what ran before them, and the samples grouped by how often their instruction
ran (which warp role waits)."""

import importlib.util
import os

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "stall_report.py")


def load():
    spec = importlib.util.spec_from_file_location("stall_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_ranks_groups_and_shows_context(tmp_path, capsys):
    rows = [
        '"Kernel Name","backward_dkdv_sm90"',
        '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
        '"Instructions Executed","stall_long_sb","stall_barrier"',
        '"0x10","HGMMA.64x64x16.F32 R152, gdesc[UR20], R152, gsb0","10","5","800","0","2"',
        '"0x20","WARPGROUP.DEPBAR.LE gsb0, 0x0","600","500","800","0","600"',
        '"0x30","REDG.E.ADD.F32x2.FTZ.RN.STRONG.GPU desc[UR10][R4.64], R152","90","80","800","10","0"',
        '"0x40","@P0   BRA 0x7f0","300","290","100","300","0"',
    ]
    path = tmp_path / "stalls.csv"
    path.write_text("\n".join(rows) + "\n")
    load().summary(str(path), top=2, context=1)
    out = capsys.readouterr().out
    assert "4 instructions, 1000 stall samples" in out
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if "WARPGROUP.DEPBAR" in line)
    assert "60.0%" in lines[first] and "800" in lines[first] and "stall_barrier 600" in lines[first]
    assert "| HGMMA.64x64x16" in lines[first + 1]  # the instruction before it
    assert "30.0%" in lines[first + 2] and "BRA" in lines[first + 2]
    assert "| REDG" in lines[first + 3]  # the branch's: a wait lands after its cause
    groups = lines.index("samples by how many times their instruction ran (one group per warp role and place):")
    assert not any("9.0%" in line for line in lines[:groups])  # only the top 2 are ranked
    assert lines[groups + 1].split() == ["70.0%", "800"] and lines[groups + 2].split() == ["30.0%", "100"]
