"""``python -m joinkit run`` across two nodes: one worker lost, then a whole node.

Two network namespaces (``tests/support/two_nodes.py``, as
``tests/backends/launch/test_two_nodes.py`` makes them), two workers per node,
torchrun's static rendezvous on node1
(``--master-addr 10.77.0.1``, ``GLOO_SOCKET_IFNAME=jk0``), the program of
``programs/elastic_run_program.py`` with two cells over one elastic group:

1. rank 3 (on node2) is SIGKILLed in its loop body: node2's agent keeps rank
   2 running (it had entered ``Join(on_rank_loss="finish")``), every
   survivor finishes the cell over ranks 0, 1, 2;
2. rank 2 kills its whole node (node2's agent, every worker it started,
   itself) in its loop body: ranks 0 and 1 finish over the two of them, and
   node1's agent, after waiting for node2's agent only while it still beats,
   exits 0 naming ranks 2 and 3 as lost.

The survivors' numbers must equal the single-process reference, as in the
one-node matrix. Skipped only where network namespaces cannot be made.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from run_checks import check_cells, death_to_next_iteration
from support.mpi import ROOT, child_env
from support.two_nodes import ADDRESSES, IFNAME, NODES, Task, TwoNodes, unavailable

pytestmark = [pytest.mark.needs_torch, pytest.mark.launches]

PROGRAM = Path(__file__).parent / "programs" / "elastic_run_program.py"
CELLS = ["3/body/2", "2/node/3"]
TIMEOUT = 300.0


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Any:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"two nodes (network namespaces) cannot be made here: {reason}")
    out = tmp_path_factory.mktemp("joinkit_run_nodes")
    env = child_env(drop=("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "LOCAL_WORLD_SIZE"))
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", JOINKIT_RUN_SILENT="5")
    tasks = [Task(node, [sys.executable, "-m", "joinkit", "run", "--nnodes", "2",
                         "--node-rank", str(rank), "--nproc-per-node", "2",
                         "--master-addr", ADDRESSES["node1"], "--master-port", "29541",
                         "--monitor-interval", "0.1", str(PROGRAM), str(out), *CELLS],
                  env={"GLOO_SOCKET_IFNAME": IFNAME})
             for rank, node in enumerate(NODES)]
    with TwoNodes(suffix="r") as nodes:
        # Node2's launcher is killed with its node: the other must not be cut short.
        done = nodes.run_all({"run": tasks}, env, ROOT, TIMEOUT, grace=TIMEOUT)
    return out, done["run"]


@pytest.mark.timeout(int(TIMEOUT) + 120)
def test_one_worker_then_a_whole_node_lost(ran: Any) -> None:
    out, run = ran
    # node1's launcher exits 0; node2's was killed with its node.
    assert sorted(run.returncodes, key=str) == [-9, 0], run.explain()
    ranks: dict[int, Any] = {}
    for path in Path(out).glob("rank*.json"):
        data = json.loads(path.read_text())
        ranks[data["rank"]] = data
    assert sorted(ranks) == [0, 1], run.explain()
    check_cells("two nodes", 4, CELLS, ranks)
    assert re.search(r"joinkit run: rank 3 \(pid \d+\) was lost \(SIGKILL", run.stderr), \
        run.explain()
    lost = re.findall(r"joinkit run: lost rank\(s\) (.*); the survivors finished", run.stderr)
    assert lost == ["2 (its node's agent is gone), 3 (its node's agent is gone)"], \
        run.explain()
    recovery = death_to_next_iteration(Path(out), ranks)
    print("two nodes: death -> survivors' next completed iteration: "
          + ", ".join(f"{1000 * s:.0f} ms" for s in recovery))
    assert len(recovery) == 2 and max(recovery) < 15.0  # rank 3's death, then the node's
