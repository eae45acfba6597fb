"""The GPU suite in parts (tests/conftest.py): which tests a part's ``pytest -v`` log reports, so
that ``NBFLASH_RESUME_LOGS`` leaves them out of the next part."""

from .conftest import reported_node_ids


def test_reported_node_ids_read_both_log_forms(tmp_path):
    """xdist's lines (outcome first) and a single process's (outcome after the id), and parameters
    with spaces: "[old layout]" was cut at its space, so the 2026-12-04 suite's resume log never
    matched that test and every part ran it again."""
    log = tmp_path / "part1.log"
    log.write_text(
        "[gw3] [ 12%] PASSED tests/test_a.py::test_x[1x1-64-False] \n"
        "[gw0] [ 13%] FAILED tests/test_a.py::test_y[old layout] \n"
        "tests/test_b.py::test_z[flipped] SKIPPED (needs a GPU)            [ 50%]\n"
        "tests/test_b.py::test_w PASSED                                     [100%]\n"
        "PASSED tests/test_c.py::test_v[a b-c]\n"  # docs/runs' form
        "FAILED tests/test_d.py::test_u - AssertionError: boom\n"  # pytest -rf's summary
        "collected 12 items; tests/test_e.py is not a result\n"
    )
    assert reported_node_ids([str(log)]) == {
        "tests/test_a.py::test_x[1x1-64-False]", "tests/test_a.py::test_y[old layout]",
        "tests/test_b.py::test_z[flipped]", "tests/test_b.py::test_w", "tests/test_c.py::test_v[a b-c]",
        "tests/test_d.py::test_u"}
