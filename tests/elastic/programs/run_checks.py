"""What the ``joinkit run`` tests check of ``elastic_run_program.py``'s records.

Shared by ``tests/elastic/test_joinkit_run.py`` (one node) and
``test_joinkit_run_two_nodes.py`` (two): each cell's survivors against the
float64 reference of ``elastic_torch_runner.py``, and the time from a death to
the survivors' next completed iteration.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import elastic_torch_runner as trainer_runner
import numpy as np


def parse_cell(cell: str) -> list[tuple[int, str, int]]:
    return [(int(r), p, int(a)) for r, p, a in
            (item.split("/") for item in cell.split("+") if item != "-")]


def _consumed(members: list[int], kills: list[tuple[int, str, int]]) -> tuple[dict[int, int],
                                                                             dict[int, int]]:
    """(rank -> inputs consumed, dead rank -> its iterations) of one cell."""
    inputs = {r: trainer_runner.INPUTS + r for r in members}
    dead: dict[int, int] = {}
    for rank, point, at in kills:
        if point in ("body", "beat", "node"):
            dead[rank] = at
        elif point in ("drain", "post"):
            dead[rank] = inputs[rank]
    for rank, point, _ in kills:
        if point == "recovery":  # it died in the recovery from the other death
            other = next(at for r, p, at in kills if p in ("body", "beat"))
            dead[rank] = min(other, inputs[rank])
    return {**inputs, **dead}, dead


def check_cells(name: str, world: int, cells: list[str], ranks: dict[int, Any]) -> None:
    """Each cell's survivors: left normally, the report, the reference's numbers."""
    members = list(range(world))
    for index, cell in enumerate(cells):
        kills = parse_cell(cell)
        consumed, dead = _consumed(members, kills)
        survivors = [r for r in members if r not in dead]
        w, counts = trainer_runner.reference(len(members), consumed)
        for rank in survivors:
            if rank not in ranks:
                continue  # it died in a later cell
            result = ranks[rank]["cells"][index]
            assert result["world"] == len(members), (name, index, rank)
            lost = {r: c for r, c, _ in result["lost"]}
            assert lost == dead, (name, cell, rank, result["lost"])
            assert result["count"] == counts[rank], (name, cell, rank)
            np.testing.assert_allclose(result["w"], w, rtol=1e-10, atol=1e-12,
                                       err_msg=f"{name} {cell} rank {rank}")
            assert result["size"] == len(survivors)
            assert result["post_total"] == len(survivors)
        members = survivors


def death_to_next_iteration(out: Path, ranks: dict[int, Any]) -> list[float]:
    """For each death in the loop (not drain/post/recovery): the time from it to the
    slowest survivor's first all-reduce completed without the dead rank."""
    seconds = []
    for path in out.glob("died-*.json"):
        death = json.loads(path.read_text())
        if death["point"] not in ("body", "beat", "node"):
            continue
        cell = death["cell"]
        after = []
        for data in ranks.values():
            times = data["cells"][cell]["times"]
            later = [t for t, size in times if t > death["time"]
                     and size < data["cells"][cell]["world"]]
            if later:
                after.append(min(later))
        if after and len(after) == len(ranks):
            seconds.append(max(after) - death["time"])
    return seconds
