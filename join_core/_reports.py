"""What a Join reports, as data and for people.

Rules of this room: frozen values and pure functions; the standard library and
attrs only (a PNG imports matplotlib when asked for one). The machine builds
these values; nothing here decides anything about the protocol.

The values: :class:`Failure` (a rank's exception as data that crosses the
wire), :class:`LostRank` (a rank that died in a finish-mode Join) and
:class:`JoinReport` (what one rank did in one Join), with its JSON form
(``to_dict`` / ``from_dict``, format ``REPORT_FORMAT``).

For people: the skew table, a text bar chart, SVG and PNG.
A :class:`~joinkit.JoinReport` is what one rank did in one Join. Rendering
works on a list of them, one per rank (``join.gather_report()``, or reports a
training script saved with ``JoinReport.to_dict`` and ``python -m joinkit
report`` reads back). It tells the truth after a failure: the failing rank and
its exception, which ranks the failure stopped early, and the input skew only
over the ranks whose inputs ran out (a stopped rank's count says nothing about
its share of the data). A PNG needs matplotlib (``pip install 'joinkit[plot]'``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import attrs

__all__ = [
    "Failure",
    "LostRank",
    "JoinReport",
    "REPORT_FORMAT",
    "format_reports",
    "chart_lines",
    "svg_chart",
    "write_chart",
]


@attrs.frozen(kw_only=True)
class Failure:
    """A rank's exception, as data that can cross the wire."""

    rank: int
    exc_type: str
    message: str


@attrs.frozen(kw_only=True)
class LostRank:
    """A rank that died inside a Join with ``on_rank_loss="finish"``.

    Attributes:
        rank: its rank in the group as it was when the Join was built (the
            *original* rank: reports and messages never use the rebuilt
            group's numbering).
        iterations: how many of its iterations completed with it, as the
            survivors agree: the inputs it had processed whose collectives
            include its contribution.
        survivors: the original ranks still alive after the loss.
        detected: how the loss was seen, e.g. ``"ERR_PROC_FAILED in
            Iallreduce"``.
    """

    rank: int
    iterations: int
    survivors: tuple[int, ...]
    detected: str


@attrs.frozen(kw_only=True)
class JoinReport:
    """What one rank did in one Join (``join.report``).

    Attributes:
        rank: this rank.
        inputs: inputs processed (heartbeats sent) before leaving the loop.
        joined_at_round: the round at which it joined because its inputs ran
            out (``None`` if it failed, was stopped early or never left its loop).
        shadow_rounds: main-hook rounds run after leaving the loop.
        seconds_shadowing: from leaving the loop until every rank had joined.
        is_last_joiner: whether it was among the last to join (never after a
            failure: no post hooks ran).
        phase: the machine's final phase name.
        failure: this rank's own failure, if any.
        stopped_early: whether it left its loop before its inputs ran out:
            a peer failed (``PeerAborted``) or, in throw mode, a peer ran out
            (its ``inputs`` are then not its share of the data).
        stopped_by: the ranks whose failure ended this Join for this rank, as
            the failure exchange reported them (empty without a failure).
        lost_ranks: with ``on_rank_loss="finish"``, the ranks that died inside
            the Join and were treated as joined, in order of loss (original
            ranks, with the iterations each completed).
        heartbeat: how the heartbeat travelled (``Join.heartbeat``):
            ``"classic"`` (its own all-reduce per input, torch's wire format),
            ``"fused"`` (one more element in the first joinable's first
            collective of each input) or ``"round"`` (one more element in each
            collective of the first joinable's rounds, e.g. DDP's gradient
            all-reduce; nothing sent per input). With ``"round"`` a shadow
            round is one *round* of the active ranks (DDP: one gradient
            all-reduce, however many inputs ``no_sync()`` accumulated in it,
            and none for a forward without a backward), so ``shadow_rounds``
            counts those, and ``is_last_joiner`` is true for every rank that
            left after the last round.
    """

    rank: int
    inputs: int
    joined_at_round: int | None
    shadow_rounds: int
    seconds_shadowing: float
    is_last_joiner: bool
    phase: str
    failure: Failure | None = None
    stopped_early: bool = False
    stopped_by: tuple[int, ...] = ()
    lost_ranks: tuple[LostRank, ...] = ()
    heartbeat: str = "classic"

    @property
    def outcome(self) -> str:
        """``"failed"``, ``"stopped early"``, ``"stopped"`` (it had joined when a
        peer failed), ``"joined"``, or ``"unfinished"`` (it never left its loop:
        interrupted, or the Join is still running)."""
        if self.failure is not None:
            return "failed"
        if self.stopped_early:
            return "stopped early"
        if self.stopped_by:
            return "stopped"
        return "joined" if self.joined_at_round is not None else "unfinished"

    def to_dict(self) -> dict[str, Any]:
        """This report as plain JSON-able data (``JoinReport.from_dict`` reads it back)."""
        data = attrs.asdict(self, recurse=True)
        data["stopped_by"] = list(self.stopped_by)
        data["lost_ranks"] = [
            {**attrs.asdict(lost), "survivors": list(lost.survivors)}
            for lost in self.lost_ranks
        ]
        return {"joinkit_report": REPORT_FORMAT, **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JoinReport:
        """Read back what :meth:`to_dict` wrote.

        Raises:
            ValueError: ``data`` is not a joinkit report (the message says what
                is missing or wrong).
        """
        if not isinstance(data, dict) or data.get("joinkit_report") != REPORT_FORMAT:
            raise ValueError(
                "not a joinkit join report: expected a JSON object with "
                f'"joinkit_report": {REPORT_FORMAT} (from JoinReport.to_dict()), got '
                f"{_preview(data)}"
            )
        fields = {f.name for f in attrs.fields(cls)}
        optional = {"failure", "stopped_early", "stopped_by", "lost_ranks", "heartbeat"}
        missing = fields - optional - set(data)
        if missing:
            raise ValueError(f"join report is missing {sorted(missing)}: {_preview(data)}")
        values = {name: data[name] for name in fields if name in data}
        failure = values.get("failure")
        if failure is not None:
            values["failure"] = Failure(**failure)
        values["stopped_by"] = tuple(values.get("stopped_by", ()))
        values["lost_ranks"] = tuple(
            LostRank(**{**lost, "survivors": tuple(lost["survivors"])})
            for lost in values.get("lost_ranks", ())
        )
        return cls(**values)


#: The version of :meth:`JoinReport.to_dict`'s format.
REPORT_FORMAT = 1


def _preview(data: Any) -> str:
    text = repr(data)
    return text if len(text) <= 200 else text[:197] + "..."

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
