"""Join reports for people: the skew table, a text bar chart, SVG and PNG.

A :class:`~joinkit.JoinReport` is what one rank did in one Join. Rendering
works on a list of them, one per rank (``join.gather_report()``, or reports a
training script saved with ``JoinReport.to_dict`` and ``python -m joinkit
report`` reads back). It tells the truth after a failure: the failing rank and
its exception, which ranks the failure stopped early, and the input skew only
over the ranks whose inputs ran out (a stopped rank's count says nothing about
its share of the data).

Standard library only; a PNG needs matplotlib (``pip install 'joinkit[plot]'``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from xml.sax.saxutils import escape

from ._machine import JoinReport

__all__ = ["format_reports", "chart_lines", "svg_chart", "write_chart"]

#: Width of each bar column of the text chart, in characters.
BAR_WIDTH = 30


def format_reports(reports: Iterable[JoinReport], *, chart: bool = False) -> str:
    """Render join reports as a summary and a table (and a bar chart).

    Args:
        reports: one report per rank (from :meth:`Join.gather_report`).
        chart: also draw a per-rank bar chart of inputs and shadowing time.

    Returns:
        A multi-line string.
    """
    rows = sorted(reports, key=lambda r: r.rank)
    lines = _summary(rows)
    lines.append(
        "rank | inputs | joined at | shadow rounds | shadowing s | last joiner | outcome"
    )
    for r in rows:
        joined = "-" if r.joined_at_round is None else str(r.joined_at_round)
        lines.append(
            f"{r.rank:>4} | {r.inputs:>6} | {joined:>9} | {r.shadow_rounds:>13} | "
            f"{r.seconds_shadowing:>11.3f} | {str(r.is_last_joiner):>11} | {_outcome(r)}"
        )
    if chart:
        lines += ["", *chart_lines(rows)]
    return "\n".join(lines)


def _summary(rows: Sequence[JoinReport]) -> list[str]:
    finished = [r for r in rows if r.outcome in ("joined", "stopped")]
    inputs = [r.inputs for r in finished]
    if inputs:
        skew = (
            f"inputs min {min(inputs):,} / max {max(inputs):,} "
            f"(skew {max(inputs) - min(inputs):,})"
        )
        if len(finished) < len(rows):
            skew += f" over the {len(finished)} ranks whose inputs ran out"
    else:
        skew = "no rank ran out of inputs: no skew to show"
    lines = [f"join report: {len(rows)} ranks, {skew}"]
    for r in rows:
        if r.failure is not None:
            lines.append(
                f"rank {r.rank} failed with {r.failure.exc_type}: {r.failure.message}"
            )
    stopped = [r.rank for r in rows if r.stopped_early]
    if stopped:
        lines.append(
            f"stopped early (inputs left): rank(s) {_ranks(stopped)}; their input "
            "counts are not part of the skew"
        )
    return lines


def _outcome(r: JoinReport) -> str:
    if r.failure is not None:
        return f"failed: {r.failure.exc_type}: {r.failure.message}"
    if r.stopped_by:
        how = "stopped early" if r.stopped_early else "stopped"
        return f"{how} by rank {_ranks(r.stopped_by)}'s failure"
    return r.outcome


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def chart_lines(reports: Iterable[JoinReport], width: int = BAR_WIDTH) -> list[str]:
    """A per-rank bar chart of inputs and seconds spent shadowing, in plain text.

    Each bar is scaled to the largest value of its column; ``#`` fills it.

    Args:
        reports: one report per rank.
        width: characters of the longest bar.

    Returns:
        The chart's lines.
    """
    rows = sorted(reports, key=lambda r: r.rank)
    most_inputs = max((r.inputs for r in rows), default=0)
    most_seconds = max((r.seconds_shadowing for r in rows), default=0.0)
    labels = [f"{r.inputs:,}" for r in rows]
    label_width = max((len(label) for label in labels), default=1)
    lines = [
        f"rank | {'inputs':<{width + label_width + 1}} | shadowing",
    ]
    for r, label in zip(rows, labels, strict=True):
        inputs = _bar(r.inputs, most_inputs, width)
        seconds = _bar(r.seconds_shadowing, most_seconds, width)
        mark = {"failed": "  (failed)", "stopped early": "  (stopped early)"}.get(r.outcome, "")
        lines.append(
            f"{r.rank:>4} | {inputs} {label:>{label_width}} | {seconds} "
            f"{_seconds(r.seconds_shadowing)}{mark}"
        )
    return lines


def _bar(value: float, most: float, width: int) -> str:
    filled = 0 if most <= 0 else round(width * value / most)
    return "#" * filled + " " * (width - filled)


def _seconds(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f} s"
    return f"{value:.1f} s" if value >= 1 else f"{value:.3f} s"


def svg_chart(reports: Iterable[JoinReport]) -> str:
    """The bar chart as a standalone SVG document (no plotting library needed)."""
    rows = sorted(reports, key=lambda r: r.rank)
    most_inputs = max((r.inputs for r in rows), default=0) or 1
    most_seconds = max((r.seconds_shadowing for r in rows), default=0.0) or 1.0
    bar, row_height, left, gap = 240, 22, 70, 140
    height = 50 + row_height * len(rows)
    width = left + 2 * bar + gap + 60
    colors = {"failed": "#c0392b", "stopped early": "#7f8c8d"}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        '<text x="10" y="18" font-weight="bold">joinkit join report</text>',
        f'<text x="{left}" y="38">inputs</text>',
        f'<text x="{left + bar + gap}" y="38">seconds shadowing</text>',
    ]
    for i, r in enumerate(rows):
        y = 46 + i * row_height
        color = colors.get(r.outcome, "#2e86c1")
        w_inputs = bar * r.inputs / most_inputs
        w_seconds = bar * r.seconds_shadowing / most_seconds
        parts += [
            f'<text x="10" y="{y + 14}">rank {r.rank}</text>',
            f'<rect x="{left}" y="{y}" width="{w_inputs:.1f}" height="16" fill="{color}">'
            f"<title>{escape(_outcome(r))}</title></rect>",
            f'<text x="{left + w_inputs + 4:.1f}" y="{y + 13}">{r.inputs:,}</text>',
            f'<rect x="{left + bar + gap}" y="{y}" width="{w_seconds:.1f}" height="16" '
            'fill="#e67e22"/>',
            f'<text x="{left + bar + gap + w_seconds + 4:.1f}" y="{y + 13}">'
            f"{_seconds(r.seconds_shadowing)}</text>",
        ]
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_chart(reports: Iterable[JoinReport], path: str | Path) -> Path:
    """Write the bar chart to ``path``: ``.svg`` as is, ``.png`` through matplotlib.

    Raises:
        ValueError: the suffix is neither ``.svg`` nor ``.png``.
        ModuleNotFoundError: a PNG was asked for and matplotlib is not installed
            (``pip install 'joinkit[plot]'``).
    """
    target = Path(path)
    rows = sorted(reports, key=lambda r: r.rank)
    suffix = target.suffix.lower()
    if suffix == ".svg":
        target.write_text(svg_chart(rows))
        return target
    if suffix != ".png":
        raise ValueError(f"write_chart writes .svg or .png files, not {target.name!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "a PNG chart needs matplotlib: pip install 'joinkit[plot]' (or write "
            "an .svg, which needs nothing)",
            name="matplotlib",
        ) from error
    figure, (left, right) = pyplot.subplots(1, 2, figsize=(9, 0.5 + 0.4 * len(rows)))
    ranks = [f"rank {r.rank}" for r in rows]
    colors = [{"failed": "#c0392b", "stopped early": "#7f8c8d"}.get(r.outcome, "#2e86c1")
              for r in rows]
    left.barh(ranks, [r.inputs for r in rows], color=colors)
    left.set_title("inputs")
    left.invert_yaxis()
    right.barh(ranks, [r.seconds_shadowing for r in rows], color="#e67e22")
    right.set_title("seconds shadowing")
    right.invert_yaxis()
    figure.tight_layout()
    figure.savefig(target)
    pyplot.close(figure)
    return target
