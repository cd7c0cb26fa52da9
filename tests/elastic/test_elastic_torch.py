"""The elastic kill matrix on gloo: ``Join(..., on_rank_loss="finish")`` over a TorchGroup.

One launch of ``elastic_torch_runner.py`` runs every cell: the parent imports
torch once, hosts the TCPStore (so it outlives any rank, as a launcher's
would) and forks each cell's ranks; a cell's ranks SIGKILL themselves at one
of the four kill points (in the loop body, between the heartbeat and the
gradient all-reduce, while draining, in the post hook), in worlds of 3 and 4,
two of them at different iterations, and one during the recovery from
another's death. Each cell checks that every survivor left the Join normally,
that the report names the dead ranks with the iterations they completed, and
that the survivors' Counter totals and model parameters equal a
single-process reference over exactly the consumed inputs (``reference``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

import elastic_torch_runner as runner  # noqa: E402

from joinkit.adapters.torch import _compat as torch_compat  # noqa: E402

DEADLINE = 40.0  # per cell, enforced by the runner (it kills what is left)
CELLS = [
    "3:",  # no death: the elastic path changes nothing
    "3:1/body/3", "3:0/beat/2", "3:0/drain/0", "3:2/post/0",
    "4:3/body/2", "4:2/beat/5", "4:1/drain/1", "4:0/post/0",
    "4:1/body/2+2/beat/5",  # two deaths, at different iterations
    "4:3/body/2+1/recovery/0",  # a death during the recovery
    "4:3/body/9+0/recovery/0",  # ... of a rank that had joined (8 inputs, not 9)
    "3:0/body/0",  # before its first input
    "3:2/body/9",  # the last active rank: the survivors, all joined, finish at once
    "3:1/body/2+2/beat/4",  # rank 0 is left alone
    "3:1/body/3@0",  # rank 0 hosts the store (init_process_group's way): others may die
]
#: Rank 0 hosts the store and dies: no recovery, but a prompt, clear error.
STORE_HOST_DIES = "3:0/body/3@0"
#: A hook that raises is an error for every rank, not a death (it stays alive).
HOOK_RAISES = "4:1/hookraise/0"
#: The loop body's own error: the failure exchange names it on every rank.
BODY_RAISES = "3:2/bodyraise/3"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("elastic_torch")
    done = subprocess.run(
        [sys.executable, str(Path(runner.__file__)), "--out", str(out), "--deadline",
         str(DEADLINE), *CELLS, STORE_HOST_DIES, HOOK_RAISES, BODY_RAISES],
        capture_output=True, text=True, timeout=DEADLINE * len(CELLS) + 60,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    by_spec = {}
    for record in records:
        ranks = {}
        for path in out.glob(f"cell{record['cell']}-rank*.json"):
            data = json.loads(path.read_text())
            ranks[int(path.stem.rpartition("rank")[2])] = data
        by_spec[record["spec"]] = (record, ranks, done.stderr)
    return by_spec


def expected_iterations(world: int, kills: list[tuple[int, str, int]]) -> dict[int, int]:
    """Dead rank -> the inputs it consumed (its all-reduces that completed with it)."""
    out = {}
    for rank, point, at in kills:
        if point in ("body", "beat"):
            out[rank] = at
        elif point in ("drain", "post"):
            out[rank] = runner.INPUTS + rank
    for rank, point, _ in kills:
        if point == "recovery":  # it died in the slot of the other death
            at = next(at for _, p, at in kills if p in ("body", "beat"))
            out[rank] = min(at, runner.INPUTS + rank)
    return out


@pytest.mark.launches
@pytest.mark.timeout(600)
@pytest.mark.parametrize("spec", CELLS)
def test_kill_cell(results: dict[str, Any], spec: str) -> None:
    record, ranks, stderr = results[spec]
    world, kills = runner.parse(spec)
    dead = {rank for rank, _, _ in kills}
    assert record["seconds"] < DEADLINE, (record, stderr[-3000:])
    for rank in range(world):  # every survivor left by itself; the dead were killed
        assert record["exit"][str(rank)] == (-9 if rank in dead else 0), (record,
                                                                          stderr[-3000:])
    check_survivors(spec, ranks)
    record_cell(spec, "forked ranks" + (", store in rank 0" if spec.endswith("@0") else ""),
                ranks, record["seconds"])


def recovery_seconds(spec: str, ranks: dict[int, Any]) -> float | None:
    """From the (last) death to the slowest survivor's first all-reduce on the rebuilt
    group; ``None`` where the survivors had no all-reduce left (post hook deaths)."""
    world, kills = runner.parse(spec)
    deaths = [ranks[rank]["time"] for rank, point, _ in kills if point != "post"]
    if not deaths:
        return None
    died = max(deaths)
    alive = [r for r in ranks.values() if "times" in r]
    after = [min([t for t, size in r["times"] if t > died and size < world], default=None)
             for r in alive]
    if not after or None in after:
        return None
    return max(after) - died  # type: ignore[type-var,operator]


def record_cell(spec: str, launcher: str, ranks: dict[int, Any], seconds: float,
                outcome: str | None = None) -> None:
    """Append a passed cell to ``$JOINKIT_ELASTIC_MATRIX`` (JSON lines), if set
    (``programs/elastic_torch_matrix_md.py`` writes them into docs/elastic-torch.md)."""
    path = os.environ.get("JOINKIT_ELASTIC_MATRIX")
    if not path:
        return
    world, kills = runner.parse(spec)
    survivor = next((r for r in ranks.values() if "lost" in r), {"lost": [], "size": 0})
    line = {"spec": spec, "launcher": launcher, "world": world,
            "kills": [list(k) for k in kills],
            "lost": [[e["rank"], e["iterations"]] for e in survivor["lost"]],
            "survivors": survivor["size"], "seconds": seconds,
            "recovery": None if outcome else recovery_seconds(spec, ranks),
            "outcome": outcome}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def check_survivors(spec: str, ranks: dict[int, Any]) -> None:
    """The report, the Counter totals and the parameters of every survivor."""
    world, kills = runner.parse(spec)
    dead = {rank for rank, _, _ in kills}
    survivors = [rank for rank in range(world) if rank not in dead]
    iterations = expected_iterations(world, kills)
    consumed = {rank: iterations.get(rank, runner.INPUTS + rank) for rank in range(world)}
    w, counts = runner.reference(world, consumed)
    deaths = sorted(iterations)
    for rank in survivors:
        result = ranks[rank]
        assert "error" not in result, result
        lost = {entry["rank"]: entry for entry in result["lost"]}
        assert sorted(lost) == deaths, result["lost"]
        assert sorted(result["group_lost"]) == deaths
        for dead_rank, entry in lost.items():
            assert entry["iterations"] == iterations[dead_rank], (dead_rank, result["lost"])
            assert set(entry["survivors"]) >= set(survivors)
            assert entry["detected"]
        assert result["size"] == len(survivors)
        assert result["count"] == counts[rank], (result["count"], counts[rank])
        np.testing.assert_allclose(result["w"], w, rtol=1e-10, atol=1e-12)
        assert result["post_total"] == len(survivors)
        for dead_rank in deaths:
            assert any(f"rank {dead_rank} was lost" in text for text in result["warnings"])


#: Under ``mpirun --with-ft ulfm`` (a launcher that keeps the survivors): gloo
#: ranks that never initialise MPI, over the runner's store.
MPIRUN_CELLS = ["3:1/beat/3", "4:2/drain/0"]
# mpirun starts slower on a loaded machine: 4-rank cells under --with-ft ulfm ran past
# 70 s at load 15 on 2 cores (torch 2.10, 2026-11-29); the deadline only catches a hang.
MPIRUN_DEADLINE = DEADLINE + 110


@pytest.mark.launches
@pytest.mark.timeout(600)
def test_under_mpirun_with_ft_ulfm(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(Path(runner.__file__)), "--mpirun", "--out", str(tmp_path),
         "--deadline", str(MPIRUN_DEADLINE), *MPIRUN_CELLS],
        capture_output=True, text=True, timeout=MPIRUN_DEADLINE * len(MPIRUN_CELLS) + 60,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert [r["spec"] for r in records] == MPIRUN_CELLS
    for record in records:
        assert record["mpirun"] != "killed after deadline", (record, done.stderr[-3000:])
        world, kills = runner.parse(record["spec"])
        ranks = {rank: json.loads((tmp_path / f"cell{record['cell']}-rank{rank}.json")
                                  .read_text()) for rank in range(world)}
        for rank, _, _ in kills:
            assert "killed" in ranks[rank]
        check_survivors(record["spec"], ranks)
        record_cell(record["spec"], "mpirun --with-ft ulfm", ranks, record["seconds"])


@pytest.mark.launches
@pytest.mark.timeout(600)
def test_the_store_hosts_death_is_a_clear_error(results: dict[str, Any]) -> None:
    record, ranks, stderr = results[STORE_HOST_DIES]
    assert record["exit"] == {"0": -9, "1": 0, "2": 0}, (record, stderr[-3000:])
    died = ranks[0]["time"]
    for rank in (1, 2):
        result = ranks[rank]
        assert result["error"] == "PeerFailure", result
        assert "rank 0 hosted it" in result["message"], result
        assert "host the store outside the ranks" in result["message"], result
        assert result["ended"] - died < 15.0, result  # not the gloo timeout (60 s)
    took = max(ranks[rank]["ended"] for rank in (1, 2)) - died
    record_cell(STORE_HOST_DIES, "forked ranks, store in rank 0", ranks, record["seconds"],
                outcome=f"2 left with PeerFailure naming rank 0, the store's host, "
                        f"{took * 1000:.0f} ms after its death")


@pytest.mark.launches
@pytest.mark.timeout(600)
def test_a_hook_that_raises_ends_the_join_on_every_rank(results: dict[str, Any]) -> None:
    record, ranks, stderr = results[HOOK_RAISES]
    assert record["exit"] == {str(r): 0 for r in range(4)}, (record, stderr[-3000:])
    assert ranks[1]["error"] == "RuntimeError"
    for rank in (0, 2, 3):
        result = ranks[rank]
        assert result["error"] == "GroupAborted", result
        assert "rank 1 failed in a join hook (main_hook)" in result["message"], result
        # From the store's abort key, while rank 1 is still alive (it holds
        # HOLD_AFTER_RAISE s, then its sockets close): below that and the gloo
        # timeout, with room for a loaded machine.
        assert result["ended"] - ranks[1]["ended"] < 0.8 * runner.HOLD_AFTER_RAISE, result
    took = max(ranks[rank]["ended"] for rank in (0, 2, 3)) - ranks[1]["ended"]
    record_cell(HOOK_RAISES, "forked ranks", ranks, record["seconds"],
                outcome=f"an error, not a death: 3 left with GroupAborted naming rank 1 "
                        f"{took * 1000:.0f} ms after it left (it stayed alive)")


@pytest.mark.launches
@pytest.mark.timeout(600)
def test_a_loop_body_that_raises_is_named_on_every_rank(results: dict[str, Any]) -> None:
    record, ranks, stderr = results[BODY_RAISES]
    assert record["exit"] == {str(r): 0 for r in range(3)}, (record, stderr[-3000:])
    assert ranks[2]["error"] == "ValueError"
    for rank in (0, 1):  # the failure exchange (units counted), not an abort
        assert ranks[rank]["error"] == "PeerFailure", ranks[rank]
        assert ranks[rank]["message"] == ("rank 2 failed inside the Join context with "
                                          "ValueError: injected loop body fault on rank 2")
    record_cell(BODY_RAISES, "forked ranks", ranks, record["seconds"],
                outcome="an error, not a death: 2 left with PeerFailure naming rank 2 "
                        "and its ValueError")


@pytest.mark.launches
@pytest.mark.timeout(600)
def test_recovery_is_prompt(results: dict[str, Any]) -> None:
    """From the death to the survivors' next completed all-reduce (recorded per cell)."""
    seconds = {}
    for spec in CELLS:
        if spec in (STORE_HOST_DIES, HOOK_RAISES, BODY_RAISES):
            continue
        took = recovery_seconds(spec, results[spec][1])
        if took is not None:
            seconds[spec] = took
    print("death -> next completed iteration:", {k: f"{v:.3f} s" for k, v in seconds.items()})
    assert seconds
    # Bounded, not a timing test (benchmarks/elastic_gloo.py measures): far
    # below the gloo timeout (60 s) that a survivor without the store key
    # would wait out.
    assert max(seconds.values()) < 15.0, seconds


@pytest.mark.launches
@pytest.mark.timeout(600)
def test_refusals_and_warnings(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(Path(runner.__file__)), "--out", str(tmp_path), "--deadline",
         str(DEADLINE), "2:refusals"],
        capture_output=True, text=True, timeout=DEADLINE + 60,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    record = json.loads((tmp_path / "cells.jsonl").read_text())
    assert record["exit"] == {"0": 0, "1": 0}, done.stderr[-4000:]
    for rank in (0, 1):
        found = json.loads((tmp_path / f"cell0-rank{rank}.json").read_text())
        # DDP's raw ProcessGroup: refused on entry, on every rank, before any
        # collective (the next Join's collectives still match).
        assert "raw ProcessGroup" in found["ddp"] and "FSDP2" in found["ddp"]
        assert "ZeroRedundancyOptimizer" in found["ddp"]
        # Beside a Counter on a TorchGroup of the same group: the ZeRO adapter refuses.
        assert found["mixed"].startswith(
            "Join(on_rank_loss='finish') cannot hold ZeroRedundancyOptimizer: "), found
        assert "not in this version" in found["mixed"]
        assert "only alone" in found["ddp_mixed"], found
        assert found["after"] == 2.0
        # FSDP2 works in finish mode only as Join([model, optimizer]) (test_elastic_fsdp.py);
        # on a torch whose FSDP2 cannot run on the CPU (2.6) FSDP2 itself is refused.
        if torch_compat.fsdp_runs_on_cpu():
            assert found["fsdp"].startswith(
                "Join(on_rank_loss='finish') with an FSDP2 model: "), found
            assert "exactly [model] or [model, optimizer]" in found["fsdp"]
        else:
            assert found["fsdp"].startswith("joinkit refuses FSDP2 on the CPU on torch "), found
        assert found["zero"].startswith(
            "Join(on_rank_loss='finish') cannot hold ZeroRedundancyOptimizer: "), found
        # A stateful ZeRO is held only beside its DDP model (test_elastic_zero.py).
        assert "right after the DistributedDataParallel model" in found["zero"], found
        assert found["count"] == 2.0 and found["lost"] == []
        assert found["initial_rank"] == rank
        if rank == 0:
            texts = "\n".join(found["warnings"])
            assert "the store seems to live in rank 0" in texts
            assert "torchrun's agent kills every worker" in texts
            assert "--with-ft ulfm" in texts
        else:
            assert found["warnings"] == []


# -- the pieces, in this process (no process group) -------------------------------------


@pytest.mark.launches
def test_a_killed_process_is_gone_even_as_a_zombie() -> None:
    import os
    import signal
    import time

    from joinkit.backends import _status
    from joinkit.backends.torch_dist import _elastic as _torch_elastic

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid = child.pid
        deadline = time.monotonic() + 30
        process = _status.this_process()
        process["pid"], process["started"] = pid, None
        assert not _torch_elastic._process_gone(process)
        os.kill(pid, signal.SIGKILL)
        while not _torch_elastic._process_gone(process):  # a zombie until reaped
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()
    assert _torch_elastic._process_gone(process)  # reaped: no /proc entry at all
    elsewhere = dict(process, host="another-host")
    assert not _torch_elastic._process_gone(elsewhere)  # cannot tell: not gone


def test_where_the_store_lives_is_guessed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime

    import torch.distributed as dist

    from joinkit.backends.torch_dist import _elastic as _torch_elastic

    guess = _torch_elastic.store_outlives_ranks_guess
    assert guess(dist.FileStore(str(tmp_path / "store"), 1))
    assert guess(dist.HashStore())
    tcp = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=5),
                        wait_for_workers=False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert not guess(tcp)  # init_process_group's: in rank 0
    assert not guess(dist.PrefixStore("a/", dist.PrefixStore("b/", tcp)))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's agent hosts it
    assert guess(dist.PrefixStore("a/", tcp))


def test_the_torchrun_warning_names_launchers_that_keep_survivors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from joinkit.backends.torch_dist import _elastic as _torch_elastic

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert _torch_elastic.torchrun_warning() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    text = _torch_elastic.torchrun_warning()
    assert text is not None
    assert "kills every worker" in text and "--with-ft ulfm" in text and "--no-kill" in text


def test_gloo_errors_get_short_names() -> None:
    from joinkit.backends.torch_dist import _elastic as _torch_elastic

    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234. This is")
    assert _torch_elastic._gloo_error(closed) == "gloo error (connection closed by peer)"
    reset = RuntimeError("Connection reset by peer")
    assert _torch_elastic._gloo_error(reset) == "gloo error (connection reset by peer)"
    assert _torch_elastic._gloo_error(RuntimeError("x" * 500)) == f"gloo error ({'x' * 120})"


_NCCL_REFUSAL = """
import datetime, torch, torch.distributed as dist
from joinkit import Join
from joinkit.backends.torch_dist import TorchGroup
from tests.support import Counter
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
group = TorchGroup()
try:
    with Join([Counter(group)], on_rank_loss="finish"):
        pass
except ValueError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.launches
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA (nccl)")
def test_nccl_is_refused_on_entry() -> None:
    done = subprocess.run([sys.executable, "-c", _NCCL_REFUSAL], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert "REFUSED" in done.stdout, done.stdout + done.stderr
    assert "not available on nccl in this version" in done.stdout
