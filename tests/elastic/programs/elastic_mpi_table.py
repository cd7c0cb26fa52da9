"""Write the elastic MPI kill matrix's recorded cells into docs/elastic.md.

    ELASTIC_MPI_RECORD=cells.jsonl pytest test_elastic_mpi.py
    python elastic_mpi_table.py cells.jsonl docs/elastic.md

Each passed cell of ``test_survivors_finish_with_the_reference_numbers`` appends
one JSON line (its world, who died where, the lost ranks' iterations, the
survivors, and the time from each death to the survivors' next completed
iteration). This script replaces the table between the page's
``<!-- elastic-matrix: start -->`` and ``<!-- elastic-matrix: end -->`` markers
with one row per cell, in the order recorded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

START, END = "<!-- elastic-matrix: start -->", "<!-- elastic-matrix: end -->"


def table(cells: list[dict[str, object]]) -> str:
    """The Markdown table of the recorded cells."""
    lines = ["| cell | world | killed (where) | lost: iterations | survivors | "
             "finished, numbers = reference | death to next iteration |",
             "|---|---:|---|---|---|---|---:|"]
    for cell in cells:
        deaths = cell["deaths"]
        assert isinstance(deaths, list)
        lost = cell["lost"]
        assert isinstance(lost, dict)
        killed = ", ".join(f"{rank} ({where})" for rank, where, _ in deaths)
        iterations = ", ".join(f"{rank}: {n}" for rank, n in sorted(lost.items()))
        survivors = ", ".join(str(r) for r in cell["survivors"])  # type: ignore[attr-defined]
        ms = ", ".join(f"{t:.0f} ms" for _, _, t in deaths)
        lines.append(f"| {cell['cell']} | {cell['world']} | {killed} | {iterations} | "
                     f"{survivors} | yes | {ms} |")
    return "\n".join(lines)


def render(cells: list[dict[str, object]], page: str) -> str:
    """``page`` with the table between the markers replaced."""
    head, start, rest = page.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"the page has no {START} ... {END} markers")
    return f"{head}{START}\n{table(cells)}\n{END}{tail}"


def main() -> None:
    record, page = Path(sys.argv[1]), Path(sys.argv[2])
    cells = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    page.write_text(render(cells, page.read_text()))
    print(f"wrote {len(cells)} cells into {page}")


if __name__ == "__main__":
    main()
