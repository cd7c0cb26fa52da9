"""Write the fault matrix's observed cells into docs/reliability.md.

    JOINKIT_FAULT_MATRIX=cells.jsonl pytest tests/test_faults_*.py -k test_fault_matrix
    python fault_matrix_md.py cells.jsonl docs/reliability.md

Each passed cell of the matrix tests appends one JSON line (``record_cell`` in
``fault_support.py``: backend, case, world size, failing rank, outcome). This
script replaces, in the table under "## The matrix", the cell of each recorded
(case, W, failing rank, backend) with its outcome; cells no run recorded keep
their text. It prints how many cells it replaced and which rows it could not
find.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: The matrix's case names (fault_scenarios.CASES) -> the table's row labels.
LABELS = {
    "before_heartbeat": "(a) raise before heartbeat",
    "after_heartbeat": "(b) raise after heartbeat",
    "main_hook": "(c) raise in main hook",
    "post_hook": "(d) raise in post hook",
    "stall": "stall (sleep 3x timeout)",
    "kill": "(e) SIGKILL",
    "raw_before_heartbeat": "(f) raw comm., raise before heartbeat",
    "raw_after_heartbeat": "(f) raw comm., raise after heartbeat",
}
#: The table's columns after ``case | W | failing``.
COLUMNS = {"threads": 3, "mpi": 4, "gloo": 5}


def render(cells: list[dict[str, object]], page: str) -> tuple[str, int, list[str]]:
    """``page`` with the recorded cells written in; the count, and what was not found."""
    lines = page.split("\n")
    rows: dict[tuple[str, str, str], int] = {}
    for index, line in enumerate(lines):
        parts = [part.strip() for part in line.strip().strip("|").split("|")]
        if len(parts) == 6 and parts[0] in LABELS.values():
            rows[(parts[0], parts[1], parts[2])] = index
    replaced, missing = 0, []
    for cell in cells:
        key = (LABELS.get(str(cell["case"]), str(cell["case"])), str(cell["world_size"]),
               str(cell["failing"]))
        column = COLUMNS.get(str(cell["backend"]))
        index = rows.get(key)
        if index is None or column is None:
            missing.append(f"{cell['backend']} {key}")
            continue
        parts = [part.strip() for part in lines[index].strip().strip("|").split("|")]
        parts[column] = str(cell["outcome"]).replace("|", "/")
        lines[index] = "| " + " | ".join(parts) + " |"
        replaced += 1
    return "\n".join(lines), replaced, missing


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    cells = [json.loads(line) for line in Path(argv[0]).read_text().splitlines() if line]
    page = Path(argv[1])
    text, replaced, missing = render(cells, page.read_text())
    page.write_text(text)
    print(f"{replaced} cells written into {page}")
    for row in missing:
        print(f"no row for {row}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
