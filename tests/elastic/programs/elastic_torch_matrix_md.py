"""Write the gloo elastic kill matrix's recorded cells into docs/elastic-torch.md.

    JOINKIT_ELASTIC_MATRIX=cells.jsonl pytest test_elastic_torch.py
    python elastic_torch_matrix_md.py cells.jsonl docs/elastic-torch.md

Each passed cell of ``test_elastic_torch.py`` appends one JSON line
(``record_cell``: the cell, its launcher, the deaths, the lost ranks the
survivors reported, the time from the death to their next all-reduce). This
script replaces the table between ``<!-- elastic-torch-matrix -->`` and
``<!-- /elastic-torch-matrix -->`` with one row per recorded cell.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

START, END = "<!-- elastic-torch-matrix -->", "<!-- /elastic-torch-matrix -->"
POINTS = {"body": "loop body", "beat": "after heartbeat", "drain": "draining",
          "post": "post hook", "recovery": "during recovery",
          "hookraise": "RAISES in its main hook", "bodyraise": "RAISES in its loop body"}


def table(cells: list[dict[str, object]]) -> str:
    rows = ["| W | killed (rank: where, at input) | launcher | survivors | report: lost "
            "rank (iterations) | numbers = reference | death -> next iteration |",
            "|---|---|---|---|---|---|---|"]
    for cell in cells:
        kills = "; ".join(f"{rank}: {POINTS[point]}" + (f" @ {at}" if point in
                                                         ("body", "beat", "bodyraise")
                                             else "")
                          for rank, point, at in cell["kills"]) or "none"  # type: ignore[attr-defined]
        lost = ", ".join(f"{rank} ({its})" for rank, its in cell["lost"]) or "-"  # type: ignore[attr-defined]
        recovery = cell["recovery"]
        took = "-" if recovery is None else f"{float(recovery) * 1000:.0f} ms"  # type: ignore[arg-type]
        if cell.get("outcome"):  # no recovery possible: how the survivors left
            rows.append(f"| {cell['world']} | {kills} | {cell['launcher']} | "
                        f"{cell['outcome']} | - | - | - |")
            continue
        rows.append(f"| {cell['world']} | {kills} | {cell['launcher']} | "
                    f"{cell['survivors']} left normally | {lost} | yes | {took} |")
    return "\n".join(rows)


def main() -> None:
    cells = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line]
    page = Path(sys.argv[2])
    text = page.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    page.write_text(f"{head}{START}\n{table(cells)}\n{END}{tail}")
    print(f"wrote {len(cells)} cells into {page}")


if __name__ == "__main__":
    main()
