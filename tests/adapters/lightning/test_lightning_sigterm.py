"""A real SIGTERM to one rank during ``Trainer.fit`` with ``UnevenInputs`` stops every rank.

One torchrun launch of ``programs/lightning_sigterm_worker.py`` (2 CPU ranks, gloo,
DDP; 5 and 8 training batches) runs two fits, each with a real SIGTERM
(``os.kill`` of one rank's own process) in the first epoch: to rank 0 at its
batch 2, while both ranks train; and to rank 1 (the rank with more batches) at
its batch 6, after rank 0 has joined and shadows. Lightning's semantics: every
rank ends ``fit`` with ``SIGTERMException`` at the next batch's check (batch 3,
and batch 7), and ``trainer.received_sigterm`` is true on every rank. Before
joinkit swapped Lightning's handler (whose broadcast met the Join's heartbeat)
both hung. Bounded: the Join's timeout (60 s) and the launch's deadline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from support import launch_ranks
from support.mpi import child_env

pytest.importorskip("torch")
pytest.importorskip("pytorch_lightning")

LAUNCH_TIMEOUT = 240.0
WORKER = Path(__file__).parent / "programs" / "lightning_sigterm_worker.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

pytestmark = [pytest.mark.timeout(LAUNCH_TIMEOUT + 60), pytest.mark.launches]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lightning_sigterm")
    (worker,) = launch_ranks(
        [[TORCHRUN, "--standalone", "--nproc-per-node", "2", str(WORKER), str(out),
          "0@2", "1@6"]], LAUNCH_TIMEOUT, env=child_env({"OMP_NUM_THREADS": "1"}), cwd=out)
    ranks = []
    for rank in range(2):
        path = out / f"rank{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else {})
    return {"worker": worker, "ranks": ranks}


def _results(runs: dict[str, Any], name: str) -> list[dict[str, Any]]:
    found = []
    for rank in runs["ranks"]:
        record = rank.get(name)
        assert record is not None, f"{name} did not run:\n{runs['worker'].stdout[-5000:]}"
        assert record["ok"], record["error"]
        found.append(record["result"])
    return found


@pytest.mark.parametrize(("name", "last"), [("0@2", (2, 2)), ("1@6", (4, 6))])
def test_sigterm_stops_every_rank(runs: dict[str, Any], name: str,
                                  last: tuple[int, int]) -> None:
    for rank, result in enumerate(_results(runs, name)):
        assert result["sigterm_exception"], (rank, result)
        assert result["received_sigterm"], (rank, result)
        # Every rank stops at the same check: the batch after the signalled one;
        # a rank that ran out (rank 0 in "1@6") stops from its shadow round.
        assert result["batches"] == [[0, b] for b in range(last[rank] + 1)], (rank, result)


def test_launch_exits(runs: dict[str, Any]) -> None:
    assert runs["worker"].returncode == 0, runs["worker"].stdout[-5000:]
