"""The script that writes observed fault-matrix cells into docs/reliability.md."""

from __future__ import annotations

from pathlib import Path

from fault_matrix_md import render

PAGE = """intro
| case | W | failing | threads | MPI (mpirun) | gloo |
|---|---|---|---|---|---|
| (a) raise before heartbeat | 2 | 0 | old t | old m | old g |
| (c) raise in main hook | 4 | 3 | old t | old m | old g |
after"""


def test_recorded_cells_replace_their_column_and_nothing_else() -> None:
    cells = [
        {"backend": "mpi", "case": "before_heartbeat", "world_size": 2, "failing": 0,
         "outcome": "rank 0: own exc.; 1x PeerFailure(rank 0); ≤ 0.01 s"},
        {"backend": "gloo", "case": "main_hook", "world_size": 4, "failing": 3,
         "outcome": "a | b"},
        {"backend": "threads", "case": "kill", "world_size": 2, "failing": 0, "outcome": "x"},
    ]
    text, replaced, missing = render(cells, PAGE)
    assert replaced == 2
    assert missing == ["threads ('(e) SIGKILL', '2', '0')"]
    lines = text.split("\n")
    assert lines[3] == ("| (a) raise before heartbeat | 2 | 0 | old t | "
                        "rank 0: own exc.; 1x PeerFailure(rank 0); ≤ 0.01 s | old g |")
    assert lines[4] == "| (c) raise in main hook | 4 | 3 | old t | old m | a / b |"
    assert lines[:3] == PAGE.split("\n")[:3] and lines[5] == "after"


def test_the_page_has_a_row_for_every_case_world_and_failing_rank() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    cells = [{"backend": backend, "case": case, "world_size": w, "failing": f, "outcome": "x"}
             for backend in ("threads", "mpi", "gloo")
             for case in ("before_heartbeat", "after_heartbeat", "main_hook", "post_hook",
                          "stall", "kill", "raw_before_heartbeat", "raw_after_heartbeat")
             for w, f in ((2, 0), (2, 1), (4, 0), (4, 3))]
    _, replaced, missing = render(cells, page)
    assert not missing and replaced == len(cells)
