"""``python -m joinkit``: a small command line (argparse, no extra dependency).

Subcommands:

``report FILE...``
    Render saved join reports (``JoinReport.to_dict()`` as JSON: one object, a
    list of them, or one object per line) as the skew summary; ``--chart``
    adds the text bar chart, ``--svg``/``--png`` write it to a file.

Other subcommands plug in through the entry-point group ``joinkit.commands``
(the core imports nothing outside itself): each entry point names a function
``add(subparsers)`` that adds its parser and sets ``run=function(args) -> int``
as a default. joinkit's backends add ``doctor`` that way.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from ._reports import JoinReport, format_reports, write_chart

__all__ = ["main", "COMMAND_ENTRY_POINTS", "read_reports"]

COMMAND_ENTRY_POINTS = "joinkit.commands"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m joinkit",
        description="joinkit: a Join for data-parallel training with uneven inputs.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_report(commands)
    for entry_point in sorted(entry_points(group=COMMAND_ENTRY_POINTS), key=lambda e: e.name):
        entry_point.load()(commands)
    args = parser.parse_args(argv)
    status: int = args.run(args)
    return status


def _add_report(commands: Any) -> None:
    report = commands.add_parser(
        "report",
        help="render saved join reports as the skew summary",
        description="Render join reports saved with JoinReport.to_dict() (JSON: an "
        "object, a list of objects, or one object per line) as the skew summary.",
    )
    report.add_argument("files", nargs="+", type=Path, metavar="FILE")
    report.add_argument("--chart", action="store_true", help="add a text bar chart")
    report.add_argument("--svg", type=Path, help="also write the chart as SVG")
    report.add_argument("--png", type=Path, help="also write the chart as PNG (matplotlib)")
    report.set_defaults(run=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    try:
        reports = [r for path in args.files for r in read_reports(path)]
    except (OSError, ValueError) as error:
        print(f"python -m joinkit report: {error}", file=sys.stderr)
        return 2
    ranks = [r.rank for r in reports]
    if len(set(ranks)) != len(ranks):
        duplicates = sorted({rank for rank in ranks if ranks.count(rank) > 1})
        print(
            f"python -m joinkit report: rank(s) {duplicates} appear more than once; "
            "give the reports of one Join (one per rank)",
            file=sys.stderr,
        )
        return 2
    print(format_reports(reports, chart=args.chart))
    for path in (args.svg, args.png):
        if path is not None:
            try:
                print(f"wrote {write_chart(reports, path)}")
            except (ModuleNotFoundError, OSError) as error:
                print(f"python -m joinkit report: {error}", file=sys.stderr)
                return 1
    return 0


def read_reports(path: Path) -> list[JoinReport]:
    """The join reports saved in ``path``.

    Raises:
        OSError: the file cannot be read.
        ValueError: it holds no joinkit report (the message names the file).
    """
    text = path.read_text()
    try:
        data: Any = json.loads(text)
        items = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        try:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON or JSON lines ({error})") from None
    if not items:
        raise ValueError(f"{path}: holds no join report")
    try:
        return [JoinReport.from_dict(item) for item in items]
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None
