"""Join reports people can read and keep: truthful after a failure, JSON, charts, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from joinkit import Join, JoinReport, PeerFailure, format_reports, write_chart
from joinkit._machine import Failure
from joinkit._reports import chart_lines
from joinkit.backends.threads import ThreadGroup, spawn

TIMEOUT = 60.0



def _counter(group: ThreadGroup) -> Any:
    from joinkit import Joinable, JoinHook

    class Hook(JoinHook):
        def main_hook(self) -> None:
            group.all_reduce(np.zeros(1, np.float32))

    class Count(Joinable):
        def __init__(self) -> None:
            super().__init__()

        def __call__(self) -> None:
            Join.notify_join_context(self)
            group.all_reduce(np.ones(1, np.float32))

        def join_hook(self, **kwargs: Any) -> JoinHook:
            return Hook()

        @property
        def join_device(self) -> Any:
            return group.device

        @property
        def join_process_group(self) -> Any:
            return group

    return Count()


def _failing_world(group: ThreadGroup) -> list[JoinReport] | None:
    """Rank 1 raises at its third input; rank 0 has 2 inputs, ranks 2, 3 have 50."""
    counter = _counter(group)
    inputs = {0: 2, 1: 50, 2: 50, 3: 50}[group.rank]
    join = Join([counter], timeout=TIMEOUT)
    try:
        with join:
            for i in range(inputs):
                if group.rank == 1 and i == 2:
                    raise ValueError("bad batch")
                counter()
    except (ValueError, PeerFailure):
        pass
    return join.gather_report()


REPORTS = [
    JoinReport(rank=0, inputs=5, joined_at_round=5, shadow_rounds=2, seconds_shadowing=1.5,
               is_last_joiner=False, phase="DONE"),
    JoinReport(rank=1, inputs=7, joined_at_round=7, shadow_rounds=0, seconds_shadowing=0.0,
               is_last_joiner=True, phase="DONE"),
    JoinReport(rank=2, inputs=6, joined_at_round=6, shadow_rounds=1, seconds_shadowing=0.75,
               is_last_joiner=False, phase="DONE"),
]


def test_after_a_failure_reports_say_who_failed_and_who_was_stopped() -> None:
    reports = spawn(_failing_world, 4, timeout=TIMEOUT)[0]
    assert reports is not None
    by_rank = {r.rank: r for r in reports}
    assert by_rank[1].outcome == "failed"
    assert by_rank[1].failure == Failure(rank=1, exc_type="ValueError", message="bad batch")
    # Rank 0 had run out of inputs (2) before the failure: stopped, not early.
    assert by_rank[0].outcome == "stopped" and by_rank[0].stopped_by == (1,)
    assert by_rank[0].joined_at_round == 2
    # Ranks 2 and 3 still had inputs: the failure stopped them early.
    for rank in (2, 3):
        assert by_rank[rank].outcome == "stopped early"
        assert by_rank[rank].stopped_by == (1,) and by_rank[rank].joined_at_round is None
    assert not any(r.is_last_joiner for r in reports)
    table = format_reports(reports)
    lines = table.splitlines()
    # The skew counts only the rank whose inputs ran out (rank 0).
    assert lines[0] == (
        "join report: 4 ranks, inputs min 2 / max 2 (skew 0) over the 1 ranks whose "
        "inputs ran out"
    )
    assert lines[1] == "rank 1 failed with ValueError: bad batch"
    assert lines[2].startswith("stopped early (inputs left): rank(s) 2, 3;")
    assert lines[4].endswith("| stopped by rank 1's failure")
    assert lines[5].endswith("| failed: ValueError: bad batch")
    assert lines[6].endswith("| stopped early by rank 1's failure")


def test_a_clean_join_reports_joined_ranks_and_their_skew() -> None:
    table = format_reports(REPORTS).splitlines()
    assert table[0] == "join report: 3 ranks, inputs min 5 / max 7 (skew 2)"
    assert table[2] == (
        "   0 |      5 |         5 |             2 |       1.500 |       False | joined"
    )


def test_report_round_trips_through_json() -> None:
    failed = JoinReport(rank=3, inputs=2, joined_at_round=None, shadow_rounds=1,
                        seconds_shadowing=0.25, is_last_joiner=False, phase="DONE",
                        failure=Failure(rank=3, exc_type="ValueError", message="bad"))
    stopped = JoinReport(rank=4, inputs=9, joined_at_round=None, shadow_rounds=0,
                         seconds_shadowing=0.0, is_last_joiner=False, phase="DONE",
                         stopped_early=True, stopped_by=(3,))
    for report in (*REPORTS, failed, stopped):
        data = json.loads(json.dumps(report.to_dict()))
        assert data["joinkit_report"] == 1
        assert JoinReport.from_dict(data) == report


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"rank": 0}, '"joinkit_report": 1'),
        ([1, 2], "expected a JSON object"),
        ({"joinkit_report": 1, "rank": 0}, "missing ["),
    ],
)
def test_from_dict_says_what_is_wrong(data: Any, needle: str) -> None:
    with pytest.raises(ValueError, match="not a joinkit join report|missing") as caught:
        JoinReport.from_dict(data)
    assert needle in str(caught.value)


@pytest.mark.parametrize("dst", [5, -1, "0", True, 1.0])
def test_gather_report_refuses_a_dst_that_is_not_a_rank(dst: Any) -> None:
    def rank_fn(group: ThreadGroup) -> str:
        counter = _counter(group)
        with Join([counter], timeout=TIMEOUT) as join:
            counter()
        with pytest.raises(ValueError, match=r"dst must be a rank of the Join's group, an "
                           r"int from 0 to 1") as caught:
            join.gather_report(dst=dst)
        return str(caught.value)

    messages = spawn(rank_fn, 2, timeout=TIMEOUT)
    assert all(f"gather_report(dst={dst!r})" in m for m in messages)


def test_text_chart_scales_bars_to_the_largest_value() -> None:
    assert chart_lines(REPORTS, width=10) == [
        "rank | inputs       | shadowing",
        "   0 | #######    5 | ########## 1.5 s",
        "   1 | ########## 7 |            0.000 s",
        "   2 | #########  6 | #####      0.750 s",
    ]
    assert format_reports(REPORTS, chart=True).endswith(
        "\n".join(chart_lines(REPORTS))
    )


def test_svg_and_png_charts(tmp_path: Path) -> None:
    svg = write_chart(REPORTS, tmp_path / "skew.svg")
    root = ElementTree.parse(svg).getroot()
    rects = root.findall("{http://www.w3.org/2000/svg}rect")
    assert len(rects) == 2 * len(REPORTS)
    widths = [float(r.get("width", "nan")) for r in rects[::2]]
    assert widths[1] == max(widths) and widths[0] < widths[2] < widths[1]
    png = write_chart(REPORTS, tmp_path / "skew.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"\.svg or \.png"):
        write_chart(REPORTS, tmp_path / "skew.pdf")


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "joinkit", *args], cwd=cwd, capture_output=True,
        text=True, timeout=120,
    )


@pytest.mark.launches
def test_cli_report_reads_saved_reports(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps([r.to_dict() for r in REPORTS[:2]]))
    (tmp_path / "b.jsonl").write_text(json.dumps(REPORTS[2].to_dict()) + "\n")
    done = _cli("report", "a.json", "b.jsonl", "--chart", "--svg", "skew.svg", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    expected = format_reports(REPORTS, chart=True)
    assert done.stdout == f"{expected}\nwrote skew.svg\n"
    assert (tmp_path / "skew.svg").read_text().startswith("<svg")


@pytest.mark.launches
def test_cli_report_errors_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello\n")
    done = _cli("report", "notes.txt", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("python -m joinkit report: notes.txt: not JSON")
    (tmp_path / "twice.json").write_text(json.dumps([REPORTS[0].to_dict()] * 2))
    done = _cli("report", "twice.json", cwd=tmp_path)
    assert done.returncode == 2 and "rank(s) [0] appear more than once" in done.stderr
    done = _cli("report", "missing.json", cwd=tmp_path)
    assert done.returncode == 2 and "missing.json" in done.stderr
