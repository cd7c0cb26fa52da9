"""What every benchmark script shares: interleaved timing, medians, JSON out.

A script measures several *variants* of one loop (no Join, torch's Join,
joinkit's Join, ...) and prints them side by side. Variants take turns within
every repeat, in a rotating order, so a noisy moment on a shared machine hits
them alike; a repeat's time is the slowest rank's (as in training); the
reported figure is the median over repeats, after warm-up runs that are not
recorded. A ratio between two variants is the median of their per-repeat
ratios (paired, so slow drift of the machine's load cancels out).

Results go to standard output as a table and, when ``JOINKIT_BENCH_OUT`` names
a file, as JSON lines that ``benchmarks/run.py`` turns into RESULTS.md.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

# (numerator, denominator, target or None): a ratio to report.
Ratio = tuple[str, str, "float | None"]


def timed(
    variants: dict[str, Callable[[int], float | None]],
    iterations: int,
    repeats: int,
    slowest: Callable[[float], float],
    barrier: Callable[[], None],
    warmup: int = 2,
) -> dict[str, list[float]]:
    """Per-iteration microseconds of every variant, one entry per repeat.

    Args:
        variants: name -> ``loop(n)``; the loop runs ``n`` iterations and may
            return the seconds to count (e.g. only the part inside a Join);
            ``None`` counts its whole call.
        iterations: iterations per repeat.
        repeats: recorded repeats.
        slowest: this rank's seconds -> the largest over all ranks.
        barrier: lines the ranks up before each run.
        warmup: unrecorded runs of every variant first.

    Returns:
        name -> per-repeat microseconds per iteration.
    """
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            barrier()
            start = time.perf_counter()
            counted = variants[name](iterations)
            seconds = time.perf_counter() - start if counted is None else counted
            seconds = slowest(seconds)
            if round_ >= warmup:
                times[name].append(seconds / iterations * 1e6)
    return times


def paired_ratios(times: dict[str, list[float]], top: str, bottom: str) -> list[float]:
    """``top / bottom`` of every repeat round."""
    return [a / b for a, b in zip(times[top], times[bottom], strict=True)]


def report(
    bench: str,
    times: dict[str, list[float]],
    ratios: Sequence[Ratio],
    info: dict[str, Any] | None = None,
) -> None:
    """Print the variants and ratios; append them to ``JOINKIT_BENCH_OUT``."""
    lines = [f"== {bench}" + (f"  ({_info(info)})" if info else "")]
    width = max(len(name) for name in times)
    for name, values in times.items():
        q1, median, q3 = _quartiles(values)
        lines.append(f"  {name:{width}}  {median:9.1f} us/iter   (IQR {q1:.1f}-{q3:.1f})")
    records: list[dict[str, Any]] = []
    for top, bottom, target in ratios:
        low, ratio, high = _quartiles(paired_ratios(times, top, bottom))
        verdict = "" if target is None else ("  ok" if ratio <= target else "  MISSED")
        goal = "" if target is None else f"  (target <= {target:g})"
        lines.append(f"  {top} / {bottom}: {ratio:.3f} (IQR {low:.2f}-{high:.2f}){goal}{verdict}")
        records.append({"kind": "ratio", "bench": bench, "top": top, "bottom": bottom,
                        "ratio": ratio, "q1": low, "q3": high, "target": target})
    print("\n".join(lines), flush=True)
    out = os.environ.get("JOINKIT_BENCH_OUT")
    if out:
        with open(out, "a") as f:
            for name, values in times.items():
                q1, median, q3 = _quartiles(values)
                f.write(json.dumps({"kind": "time", "bench": bench, "variant": name,
                                    "us": median, "q1": q1, "q3": q3,
                                    "repeats": len(values), "info": info or {}}) + "\n")
            for record in records:
                f.write(json.dumps(record) + "\n")


def record_value(bench: str, name: str, value: float, unit: str,
                 target: float | None = None, info: dict[str, Any] | None = None,
                 quiet: bool = False) -> None:
    """Print (unless ``quiet``) and record one measured value (not a ratio)."""
    verdict = "" if target is None else ("  ok" if value <= target else "  MISSED")
    goal = "" if target is None else f"  (target <= {target:g} {unit})"
    if not quiet:
        print(f"== {bench}: {name} {value:.3g} {unit}{goal}{verdict}", flush=True)
    out = os.environ.get("JOINKIT_BENCH_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"kind": "value", "bench": bench, "name": name, "value": value,
                                "unit": unit, "target": target, "info": info or {}}) + "\n")


def int_arg(index: int, default: int) -> int:
    """``sys.argv[index]`` as an int, or ``default``."""
    return int(sys.argv[index]) if len(sys.argv) > index else default


def str_arg(index: int, default: str) -> str:
    """``sys.argv[index]``, or ``default``."""
    return sys.argv[index] if len(sys.argv) > index else default


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def _info(info: dict[str, Any]) -> str:
    return ", ".join(f"{key} {value}" for key, value in info.items())
