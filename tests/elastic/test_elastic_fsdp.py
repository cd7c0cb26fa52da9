"""FSDP2 in ``Join([model, optimizer], on_rank_loss="finish")`` on gloo: the kill matrix.

One launch of ``elastic_fsdp_runner.py`` runs every forked cell: the parent
imports torch once, hosts the TCPStore (it outlives any rank, as a launcher's
would) and forks each cell's ranks, which train a 2-layer MLP with
``fully_shard`` on each layer and the root (a 1-D CPU mesh) with
``SGD(momentum=0, weight_decay=0.01)`` on uneven inputs (rank ``r`` has
``INPUTS + r``); one rank SIGKILLs itself in its loop body, between its
forward's heartbeat and its backward's gradient unit, while draining
(joined), or in the post hook, in worlds of 3 and 4. Each cell checks that
every survivor left the Join normally, that the report names the dead rank
with the inputs it consumed, that every survivor's full parameters equal a
single-process float64 reference over exactly the consumed inputs (within
1e-6), and that two plain FSDP steps after the Join (FSDP's own all-gathers
and reduce-scatters, re-sharded over the survivors), a later default-mode
Join and a later finish-mode Join over the survivors still equal it. Also: no
death in finish mode equals the reference and the default mode (joinkit's
FSDP replay); the divisor ``divide_by_initial_world_size=False``; the
refusals, after which the group still matches; one cell under ``mpirun
--with-ft ulfm``. With a stateful optimizer (``Adam``; ``SGD(momentum=0.9)``),
after one step before the Join: no death (finish = reference = default mode)
and kills in the body, after the heartbeat, after the unit, while draining and
in the post hook, where every survivor's optimizer state (gathered full) also
equals the reference's (torch's optimizer over the float64 model) at the exit
and after the plain steps; and a death in the entry's state unit (a
``LocalProtocolError`` on every survivor).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

import elastic_fsdp_runner as runner  # noqa: E402
from support import selected_scenarios  # noqa: E402
from support.fork import (  # noqa: E402
    cell_results,
    consumed_inputs,
    rank_results,
    run_runner,
    survivors,
)
from support.refusals import fsdp_refusal, or_refused  # noqa: E402

pytestmark = pytest.mark.launches

DEADLINE = 40.0  # per cell, enforced by the runner (it kills what is left)
# mpirun starts slower on a loaded machine: 4-rank cells under --with-ft ulfm ran past
# 70 s at load 15 on 2 cores (torch 2.10, 2026-11-29); the deadline only catches a hang.
MPIRUN_DEADLINE = DEADLINE + 110
KILL_CELLS = [
    "3:1/body/3", "3:0/beat/2", "3:0/drain/1", "3:0/post/0",
    "4:3/body/2", "4:2/beat/4", "4:1/drain/1", "4:0/step/3",
    "3:1/beat/3~count",  # the divisor: the ranks that contributed
    "4:1/body/2+2/beat/4",  # two deaths, at different iterations
]
#: The last joiner dies in the post hook: the survivors, all joined earlier, take
#: the model of rank 0 of the rebuilt group, as of its join (a documented limit).
POST_CELL = "3:2/post/0"
#: A stateful optimizer (Adam; SGD with momentum=0.9): parameters AND state checked.
STATE_CELLS = [
    "3:1/body/3~adam", "4:2/beat/4~adam", "4:0/step/3~adam", "4:1/drain/1~adam",
    "3:0/post/0~adam", "4:1/body/2~momentum",
]
#: A rank dies in the entry's optimizer-state unit: a clear error on every survivor.
ENTRY_CELL = "3:1/entry/0~adam"
CELLS = ["3:", "3:~raise", "3:~count", "3:~accum", "3:~adam", "3:~adam.raise", "3:~momentum",
         *KILL_CELLS, *STATE_CELLS, ENTRY_CELL, POST_CELL, "4:refusals"]
MPIRUN_CELL = "3:1/beat/3"
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # The cells the selected tests read (support.selected_scenarios): all, for the module.
    return cell_results(runner.__file__, tmp_path_factory.mktemp("elastic_fsdp"),
                        selected_scenarios(request, CELLS), DEADLINE)


def consumed(world: int, kills: list[tuple[int, str, int]]) -> dict[int, int]:
    return consumed_inputs(world, kills, runner.INPUTS)


def check_refused(spec: str, record: dict[str, Any], ranks: dict[int, Any], words: str,
                  ) -> None:
    """Where this torch refuses FSDP2 over gloo (``support.refusals``): every rank of
    ``spec`` was refused by name at its first Join (before any kill point) and exited 0."""
    world = runner.parse(spec)[0]
    assert record.get("mpirun", 0) == 0, record
    assert all(code == 0 for code in record.get("exit", {}).values()), record
    assert set(ranks) == set(range(world)), (spec, record)
    for rank, data in ranks.items():
        assert data["refused"].startswith(words), (spec, rank, data)


def fsdp2_cells(*specs: str) -> Any:
    """A test of the cells ``specs`` (or its ``spec`` parameter): on a torch that
    refuses FSDP2 over gloo it asserts :func:`check_refused` of each instead."""
    def check(words: str, arguments: dict[str, Any]) -> None:
        for spec in specs or (arguments["spec"],):
            record, ranks, _ = arguments["results"][spec]
            check_refused(spec, record, ranks, words)

    def wrap(test: Any) -> Any:
        # The cells it reads, for a run of chosen tests (support.selected_scenarios).
        return pytest.mark.scenarios(*specs)(or_refused(fsdp_refusal, check)(test))

    return wrap


def _flat(values: list[list[float]]) -> np.ndarray:
    return np.concatenate([np.asarray(v, dtype=np.float64) for v in values])


def check_cell(spec: str, ranks: dict[int, Any]) -> None:
    """Every survivor: the report, the parameters at exit and after, the new mesh."""
    world, kills, option = runner.parse(spec)
    options = set(option.split("."))
    optim = "adam" if "adam" in options else "momentum" if "momentum" in options else "sgd"
    used = consumed(world, kills)
    dead = {r for r, _, _ in kills}
    alive = sorted(ranks)
    init = ranks[alive[0]]["init"]
    states: list[Any] = []
    want, want_after, want_later, want_again = runner.reference(
        init, world, used, alive, divide_by_initial_world_size="count" not in options,
        repeat=2 if "accum" in options else 1, optim=optim, states=states)
    want_state, want_state_after = (_flat(s) for s in states)
    if optim == "sgd":
        assert want_state.size == 0, spec
    else:
        assert want_state.size > 0, spec
    for rank, data in ranks.items():
        assert {x["rank"]: x["iterations"] for x in data["lost"]} == {
            r: used[r] for r in dead}, (spec, rank, data["lost"])
        if dead:
            assert data["lost"][-1]["survivors"] == alive, (spec, rank, data["lost"])
            assert any("was lost after" in w for w in data["warnings"]), data["warnings"]
        np.testing.assert_allclose(_flat(data["final"]), want, rtol=0, atol=TOLERANCE,
                                   err_msg=f"{spec} rank {rank} at the Join's exit")
        # The optimizer's state, gathered full (Adam's second moments are small: also
        # a nearly relative check).
        for got, expected, when in ((data["state_final"], want_state, "at the exit"),
                                    (data["state_after"], want_state_after, "after")):
            np.testing.assert_allclose(_flat(got), expected, rtol=0, atol=TOLERANCE,
                                       err_msg=f"{spec} rank {rank} state {when}")
            np.testing.assert_allclose(_flat(got), expected, rtol=1e-3, atol=5e-8,
                                       err_msg=f"{spec} rank {rank} state {when}")
        # FSDP again after the Join, sharded over the survivors.
        assert data["size_after"] == world - len(dead), (spec, data["size_after"])
        assert data["same_objects"], spec  # the optimizer still holds the model's parameters
        np.testing.assert_allclose(_flat(data["after"]), want_after, rtol=0, atol=TOLERANCE,
                                   err_msg=f"{spec} rank {rank} after the Join")
        # And a later default-mode Join over the survivors (uneven).
        np.testing.assert_allclose(_flat(data["later"]), want_later, rtol=0, atol=TOLERANCE,
                                   err_msg=f"{spec} rank {rank} in a later Join")
        # And a later finish-mode Join over them.
        np.testing.assert_allclose(_flat(data["again"]), want_again, rtol=0,
                                   atol=TOLERANCE, err_msg=f"{spec} rank {rank} finish again")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("spec", KILL_CELLS)
@fsdp2_cells()
def test_kill(results: dict[str, Any], spec: str) -> None:
    check_cell(spec, survivors(results, spec, runner.parse))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("spec", STATE_CELLS)
@fsdp2_cells()
def test_kill_with_a_stateful_optimizer(results: dict[str, Any], spec: str) -> None:
    check_cell(spec, survivors(results, spec, runner.parse))


@pytest.mark.timeout(900)
@fsdp2_cells(ENTRY_CELL)
def test_death_while_the_state_is_gathered_at_entry(results: dict[str, Any]) -> None:
    """The state unit at entry lost a rank's shards: every survivor raises, none loops."""
    ranks = survivors(results, ENTRY_CELL, runner.parse)
    for rank, data in ranks.items():
        error = data["entry_error"]
        assert error.startswith("LocalProtocolError: "), (rank, error)
        assert "rank(s) [1] died while the optimizer state's shards were gathered" in error
        assert data["looped"] == []


@pytest.mark.timeout(900)
@fsdp2_cells(POST_CELL)
def test_last_joiner_dies_in_post_hook(results: dict[str, Any]) -> None:
    ranks = survivors(results, POST_CELL, runner.parse)
    world = 3
    # Its later iterations are counted, but the survivors (joined at INPUTS and
    # INPUTS + 1) hold rank 0's model as of its join: every rank's first INPUTS inputs.
    alive = sorted(ranks)
    as_of_join = {r: runner.INPUTS for r in range(world)}
    want = runner.reference(ranks[0]["init"], world, as_of_join, alive)[0]
    for rank, data in ranks.items():
        assert [(x["rank"], x["iterations"]) for x in data["lost"]] == [
            (2, runner.INPUTS + 2)], (rank, data["lost"])
        np.testing.assert_allclose(_flat(data["final"]), want, rtol=0, atol=TOLERANCE,
                                   err_msg=f"rank {rank}")
        assert data["size_after"] == 2 and data["same_objects"]


@pytest.mark.timeout(900)
@fsdp2_cells("3:", "3:~raise", "3:~count", "3:~accum", "3:~adam", "3:~adam.raise", "3:~momentum")
def test_no_death_equals_reference_and_default_mode(results: dict[str, Any]) -> None:
    finish = survivors(results, "3:", runner.parse)
    default = survivors(results, "3:~raise", runner.parse)
    check_cell("3:", finish)
    check_cell("3:~raise", default)  # joinkit's FSDP replay: the same numbers
    check_cell("3:~count", survivors(results, "3:~count", runner.parse))
    check_cell("3:~accum", survivors(results, "3:~accum", runner.parse))  # two backwards per step
    # A stateful optimizer: finish mode, joinkit's FSDP replay (default mode), the reference.
    adam = survivors(results, "3:~adam", runner.parse)
    adam_default = survivors(results, "3:~adam.raise", runner.parse)
    check_cell("3:~adam", adam)
    check_cell("3:~adam.raise", adam_default)
    check_cell("3:~momentum", survivors(results, "3:~momentum", runner.parse))
    for rank in range(3):
        for key in ("final", "state_final"):
            np.testing.assert_allclose(_flat(adam[rank][key]), _flat(adam_default[rank][key]),
                                       rtol=0, atol=TOLERANCE)
        # Every rank holds the same bits (every rank stepped every full parameter).
        assert adam[rank]["final"] == adam[0]["final"]
    init = finish[0]["init"]
    used = consumed(3, [])
    want = runner.reference(init, 3, used, [0, 1, 2])[0]
    want_count = runner.reference(init, 3, used, [0, 1, 2],
                                  divide_by_initial_world_size=False)[0]
    assert not np.allclose(want, want_count)  # the two divisors differ here
    for rank in range(3):
        np.testing.assert_allclose(_flat(finish[rank]["final"]),
                                   _flat(default[rank]["final"]), rtol=0, atol=TOLERANCE)


@pytest.mark.timeout(900)
@fsdp2_cells("4:refusals")
def test_refusals(results: dict[str, Any]) -> None:
    record, ranks, stderr = results["4:refusals"]
    assert record["exit"] == {str(r): 0 for r in range(4)}, (record, stderr[-3000:])
    expected = {
        "hsdp": "HSDP and 2-D meshes",
        "odd_state": "entry 'odd' of parameter first.weight (a plain tensor (3,))",
        "uneven_state": "hold state for different parameters or of different shapes",
        "scheduler": "exactly [model] or [model, optimizer]",
        "gradients": "1 rank(s) hold gradients at the Join's entry",
        "no_sync": "set_requires_gradient_sync(True) before the Join",
    }
    for rank in range(4):
        found = ranks[rank]["refusals"]
        for name, words in expected.items():
            assert words in found[name], (rank, name, found[name])
            assert name in ("gradients", "uneven_state") or "What works" in found[name], (
                found[name])
        assert ranks[rank]["after"] == "ok"
        # After the refused entry, FSDP reduced a plain step's gradients again.
        assert found["after_uneven_state"] == ranks[0]["refusals"]["after_uneven_state"]
        assert found["after_uneven_state"] != found["before_uneven_state"]  # it stepped
        # A forward with gradients and no backward: an error on every rank, no hang.
        error = found["no_backward"]
        assert error.startswith(("LocalProtocolError: ", "PeerFailure: ")), error
        assert "ran a forward with gradients enabled and no backward" in error, error
        # An error is not a death: the raising rank gets its own, the others a
        # PeerFailure naming it (the failure protocol), promptly.
        raised = found["raised"]
        if rank == 1:
            assert raised.startswith("KeyError: "), raised
        else:
            assert raised.startswith("PeerFailure: rank 1 failed") and "KeyError" in raised, \
                raised
        # After the refusals the group still matched, and every rank holds the same model.
        np.testing.assert_array_equal(ranks[rank]["params"], ranks[0]["params"])


@pytest.mark.timeout(300)
def test_under_mpirun_with_ft_ulfm(tmp_path: Path) -> None:
    """One cell under ``mpirun --with-ft ulfm`` (gloo ranks that never initialise MPI)."""
    records, stderr = run_runner(runner.__file__, tmp_path, [MPIRUN_CELL], MPIRUN_DEADLINE,
                                 mpirun=True)
    (record,) = records
    assert record["mpirun"] != "killed after deadline", record
    ranks = rank_results(tmp_path, record)
    words = fsdp_refusal()
    if words is not None:  # this torch refuses FSDP2 over gloo
        check_refused(MPIRUN_CELL, record, ranks, words)
        return
    assert set(ranks) == {0, 2}, (record, stderr[-3000:])
    check_cell(MPIRUN_CELL, ranks)


_CUDA_PROGRAM = """
import os, tempfile, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from joinkit import Join
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
model = torch.nn.Linear(4, 2, device="cuda")
fully_shard(model, mesh=init_device_mesh("cuda", (1,)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    with Join([model, optimizer], on_rank_loss="finish"):
        pass
except ValueError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.timeout(120)
def test_a_cuda_model_is_refused() -> None:
    """A CUDA FSDP2 model in a finish-mode Join: refused on entry (gloo on the CPU only)."""
    import subprocess

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("CUDA-only: a CUDA FSDP2 model")
    done = subprocess.run([sys.executable, "-c", _CUDA_PROGRAM], capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED" in done.stdout and "CPU" in done.stdout, done.stdout
