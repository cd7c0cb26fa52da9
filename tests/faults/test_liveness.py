"""The default watchdog spares a healthy slow rank and finds a silent one (issue 12).

The default timeout is scaled down with the private knob
``JOINKIT_DEFAULT_TIMEOUT`` (docs/reliability.md); its policy is the
default's. A full-length run (330 s, the real default of 300 s) is recorded
in docs/reliability.md. In processes (``programs/liveness_runner.py``): a slow
rank on gloo, with the default and with an explicit timeout; a rank frozen
with SIGSTOP while the others are in their loop bodies, on gloo and under
``mpirun``; a rank holding the GIL (a C call that keeps it) for several
timeouts, on gloo and under ``mpirun``; a rank killed with SIGKILL under ``torchrun`` and
``mpirun``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

import fault_scenarios as fs
import pytest
from support.faults import Launch, python, record_cell, run_all
from support.mpi import child_env, is_open_mpi, mpirun

from joinkit import Join, Joinable, JoinHook, RankTimeout, backends
from joinkit.backends.threads import spawn

RUNNER = Path(__file__).parent / "programs" / "liveness_runner.py"
HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_MPI = importlib.util.find_spec("mpi4py") is not None
#: The scaled default timeout of the slow-rank cells; the slow rank works
#: three times as long. In processes the watchdog also judges silence (at half
#: the timeout, with the torch status thread publishing twice a second), which
#: on a loaded machine needs a few seconds of slack.
SLOW_TIMEOUT = 2.0
GLOO_SLOW_TIMEOUT = 5.0
#: The scaled default timeout of the frozen and killed cells.
SILENCE_TIMEOUT = 10.0
#: How long the GIL cells' rank 1 holds the GIL: several timeouts. Under mpirun
#: the launch (its start-up included) must end before rank 1 lets go, which
#: needs slack on a loaded machine, and costs nothing: the abort ends the job.
#: On gloo rank 1 wakes and fails before the launch ends, so its hold is the
#: launch's length: 3 timeouts (rank 0 reports it within one, about 7 s here).
GIL_HOLD = 6 * SILENCE_TIMEOUT
GLOO_GIL_HOLD = 3 * SILENCE_TIMEOUT
LAUNCH_TIMEOUT = 240.0  # hard limit per launch
_TORCHRUN = Path(sys.executable).with_name("torchrun")
TORCHRUN = [str(_TORCHRUN)] if _TORCHRUN.exists() else [python(), "-m", "torch.distributed.run"]
WAITING = re.compile(r"rank 0 has waited \d+ s, since \d{4}-\d\d-\d\d [\d:]+ UTC, in counting "
                     r"non-joined ranks \(shadow round 0\), for ranks 1 \(active: in its loop "
                     r"body, posted \d+ s ago\)")


# -- threads: in one process ------------------------------------------------------------


def _slow_rank(group: Any, timeout: float | None) -> tuple[str | None, float]:
    """Rank 1 works 3 timeouts in one iteration; rank 0 has joined and counts."""
    counter = fs.Counter(group)
    kwargs = {} if timeout is None else {"timeout": timeout}
    try:
        with Join([counter], **kwargs):
            for i in range(4 if group.rank == 1 else 2):
                if group.rank == 1 and i == 2:
                    time.sleep(3 * SLOW_TIMEOUT)
                counter.step()
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return type(exc).__name__, counter.count
    return None, counter.count


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_threads_default_waits_for_a_slow_healthy_rank(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("JOINKIT_DEFAULT_TIMEOUT", str(SLOW_TIMEOUT))
    with caplog.at_level(logging.INFO, logger="joinkit"):
        results = spawn(_slow_rank, 2, args=(None,), timeout=60.0)
    assert results == [(None, 4.0), (None, 6.0)], results
    assert any(WAITING.search(record.getMessage()) for record in caplog.records), caplog.text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_threads_explicit_timeout_is_a_hard_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOINKIT_DEFAULT_TIMEOUT", "1000")  # not used: the timeout is explicit
    results = spawn(_slow_rank, 2, args=(SLOW_TIMEOUT,), timeout=60.0)
    assert results[0][0] == RankTimeout.__name__, results
    assert results[1][0] is not None, results  # the abort reached it


def test_the_knob_must_be_a_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOINKIT_DEFAULT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="JOINKIT_DEFAULT_TIMEOUT='soon'"):
        spawn(lambda group: Join([fs.Counter(group)]), 1, timeout=30.0)


class _Done:
    def __init__(self, value: float) -> None:
        self.value = value

    def wait(self) -> float:
        return self.value


class _Boardless:
    """A join backend of one rank with no status board (no ``peer_board``)."""

    rank, world_size = 0, 1

    def heartbeat(self, value: float) -> _Done:
        return _Done(value)

    def count(self, value: float) -> float:
        return value

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


class _OnBoardless(Joinable):
    def __init__(self) -> None:
        super().__init__()
        self.group = _Boardless()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return JoinHook()

    @property
    def join_device(self) -> Any:
        return "cpu"

    @property
    def join_process_group(self) -> Any:
        return self.group


backends.register(_Boardless, lambda group, device: group)


def test_without_a_board_the_default_is_a_hard_limit_of_six_timeouts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOINKIT_DEFAULT_TIMEOUT", "2")
    join = Join([_OnBoardless()])
    assert join._drive.watch.hard and join._drive.watch.timeout == 12.0  # 30 min unscaled
    explicit = Join([_OnBoardless()], timeout=5.0)
    assert explicit._drive.watch.hard and explicit._drive.watch.timeout == 5.0
    with join:
        pass

    def on_threads(group: Any) -> tuple[bool, float]:
        join = Join([fs.Counter(group)])
        return join._drive.watch.hard, join._drive.watch.timeout

    assert spawn(on_threads, 2, timeout=30.0) == [(False, 2.0)] * 2  # the board decides


class _Bereaved(_Boardless):
    """A one-rank join backend that says its peer 1 is gone (or fails to tell)."""

    def __init__(self, gone: dict[int, str] | None) -> None:
        self.gone = gone
        self.asked = 0

    def gone_peers(self) -> dict[int, str]:
        self.asked += 1
        if self.gone is None:
            raise OSError("cannot tell")
        return self.gone


class _OnBereaved(_OnBoardless):
    def __init__(self, gone: dict[int, str] | None) -> None:
        Joinable.__init__(self)
        self.group = _Bereaved(gone)


backends.register(_Bereaved, lambda group, device: group)


def test_an_error_leaving_the_join_names_the_peers_whose_process_is_gone() -> None:
    joinable = _OnBereaved({1: "pid 4242 on node0"})
    with pytest.raises(RuntimeError, match="Connection closed by peer") as caught:
        with Join([joinable]):
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500")
    assert caught.value.__notes__[0] == (  # first: before anything else is tried
        "joinkit: rank 1 (pid 4242 on node0) is no longer running (killed? out of "
        "memory?): it is the likely cause of this error")
    assert joinable.group.asked == 1


class _BereavedInCount(_Bereaved):
    def count(self, value: float) -> float:
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500")


class _OnBereavedInCount(_OnBoardless):
    def __init__(self) -> None:
        Joinable.__init__(self)
        self.group = _BereavedInCount({1: "pid 4242 on node0"})


backends.register(_BereavedInCount, lambda group, device: group)


def test_a_failed_join_collective_names_the_peers_whose_process_is_gone() -> None:
    joinable = _OnBereavedInCount()
    with pytest.raises(RuntimeError, match="Connection closed by peer") as caught:
        with Join([joinable]):
            pass  # the loop ends; the Join's count fails
    assert caught.value.__notes__ == [
        "joinkit: rank 1 (pid 4242 on node0) is no longer running (killed? out of "
        "memory?): it is the likely cause of this error"]
    assert joinable.group.asked == 1


def test_no_note_when_every_peer_runs_or_the_backend_cannot_tell() -> None:
    for gone in ({}, None):
        joinable = _OnBereaved(gone)
        with pytest.raises(ValueError, match="bad input") as caught:
            with Join([joinable]):
                raise ValueError("bad input")
        assert not any("no longer running" in note
                       for note in getattr(caught.value, "__notes__", [])), caught.value
        assert joinable.group.asked == 1
    joinable = _OnBereaved({1: "pid 4242 on node0"})
    with Join([joinable]):
        pass
    assert joinable.group.asked == 0  # asked only on a failure


# -- processes ----------------------------------------------------------------------------


def _spawned(root: Path, name: str, ranks: int, scenario: str, knob: float,
             *extra: str) -> Launch:
    out = root / name
    command = [python(), str(RUNNER), "--spawn", str(ranks), "--out", str(out),
               "--deadline", str(LAUNCH_TIMEOUT - 30), scenario, *extra]
    env = child_env({"OMP_NUM_THREADS": "1", "JOINKIT_DEFAULT_TIMEOUT": str(knob)})
    return Launch(name, command, out, LAUNCH_TIMEOUT, env=env)


def _launched(root: Path, name: str, launcher: list[str], scenario: str,
              *extra: str) -> Launch:
    out = root / name
    command = [*launcher, python(), str(RUNNER), "--out", str(out), scenario, *extra]
    if launcher[0].endswith("torchrun") or "torch.distributed.run" in launcher:
        command = [*launcher, str(RUNNER), "--out", str(out), scenario, *extra]
    env = child_env({"OMP_NUM_THREADS": "1",
                     "JOINKIT_DEFAULT_TIMEOUT": str(SILENCE_TIMEOUT)})
    return Launch(name, command, out, LAUNCH_TIMEOUT, env=env)


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Launch]:
    root = tmp_path_factory.mktemp("liveness")
    todo = []
    if HAVE_TORCH:
        todo += [
            _spawned(root, "slow-default", 2, "slow", GLOO_SLOW_TIMEOUT,
                     "--sleep", str(3 * GLOO_SLOW_TIMEOUT)),
            _spawned(root, "slow-explicit", 2, "slow", 1000.0, "--sleep",
                     str(3 * GLOO_SLOW_TIMEOUT), "--timeout", str(GLOO_SLOW_TIMEOUT)),
            _spawned(root, "freeze-gloo", 3, "freeze", SILENCE_TIMEOUT),
            _spawned(root, "gil-gloo", 3, "gil", SILENCE_TIMEOUT, "--sleep",
                     str(GLOO_GIL_HOLD)),
            _launched(root, "kill-torchrun",
                      [*TORCHRUN, "--standalone", "--nproc-per-node", "3"], "kill"),
        ]
    if HAVE_MPI:
        mpi = [mpirun(), "-n", "3", *(["--oversubscribe"] if is_open_mpi() else [])]
        if is_open_mpi():
            mpi += ["-x", "JOINKIT_DEFAULT_TIMEOUT"]
        todo += [_launched(root, "freeze-mpi", mpi, "freeze"),
                 _launched(root, "gil-mpi", mpi, "gil", "--sleep", str(GIL_HOLD)),
                 _launched(root, "kill-mpirun", mpi, "kill")]
    # Three at a time, the gloo GIL cell (the longest: rank 1 holds the GIL
    # GLOO_GIL_HOLD s) first: every launch mostly waits (a sleep, a frozen or
    # GIL-bound rank, a watchdog's timeout), so two at a time left the cores
    # half idle.
    todo.sort(key=lambda launch: launch.name != "gil-gloo")
    return run_all(todo, parallel=3)


def _ranks(launch: Launch) -> dict[int, dict[str, Any]]:
    return {int(path.stem[4:]): json.loads(path.read_text())
            for path in launch.out.glob("rank*.json")}


def _ended(launch: Launch) -> dict[int, Any]:
    path = launch.out / "launch.json"
    assert path.exists(), launch.explain()
    return {int(rank): ended for rank, ended in json.loads(path.read_text()).items()}


def _silence_named(text: str, rank: int = 1) -> bool:
    return re.search(rf"has seen no sign of life from rank {rank} on the status board within "
                     rf"the timeout \({SILENCE_TIMEOUT:g} s\): rank {rank}: silent for "
                     r"[\d.]+ s", text) is not None


needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="needs torch")
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs mpi4py")


@pytest.mark.launches
@needs_torch
@pytest.mark.timeout(LAUNCH_TIMEOUT * 4)
def test_gloo_default_waits_for_a_slow_healthy_rank(launches: dict[str, Launch]) -> None:
    launch = launches["slow-default"]
    ended, ranks = _ended(launch), _ranks(launch)
    assert [ended[r]["exit"] for r in (0, 1)] == [0, 0], launch.explain()
    assert ranks[0]["error"] is None and ranks[1]["error"] is None, ranks
    assert ranks[0]["count"] == 4.0 and ranks[1]["count"] == 8.0, ranks
    assert any(WAITING.search(line) for line in ranks[0]["log"]), ranks[0]["log"]
    record_cell("gloo", "slow rank, default timeout", 2, 1,
                f"both exit 0; rank 0 waited {ranks[0]['seconds']:.1f} s (timeout "
                f"{GLOO_SLOW_TIMEOUT:g} s, knob) and logged whom it waited for")


@pytest.mark.launches
@needs_torch
@pytest.mark.timeout(LAUNCH_TIMEOUT * 4)
def test_gloo_explicit_timeout_stays_a_hard_limit(launches: dict[str, Launch]) -> None:
    launch = launches["slow-explicit"]
    ended, ranks = _ended(launch), _ranks(launch)
    assert ranks[0]["error"]["type"] == "RankTimeout", ranks
    assert "made no progress" in ranks[0]["error"]["message"], ranks
    # Rank 1 learns of rank 0's abort from the board (or at its next
    # collective); if rank 0's process (the store's host) is gone first,
    # rank 1's watchdog finds rank 0 silent. Either way rank 0 is named.
    error = ranks[1]["error"]
    assert (error["type"] == "GroupAborted" and error["peer"]["rank"] == 0) or (
        error["type"] == "RankTimeout" and "no sign of life from rank 0" in error["message"]
    ), error
    assert [ended[r]["exit"] for r in (0, 1)] == [1, 1], launch.explain()
    record_cell("gloo", "slow rank, explicit timeout", 2, 1,
                f"rank 0: RankTimeout after {ranks[0]['seconds']:.1f} s (timeout "
                f"{GLOO_SLOW_TIMEOUT:g} s); rank 1: {error['type']} naming rank 0")


@pytest.mark.launches
@needs_torch
@pytest.mark.timeout(LAUNCH_TIMEOUT * 4)
def test_gloo_sigstop_of_a_rank_in_its_loop_body_is_reported(
        launches: dict[str, Launch]) -> None:
    launch = launches["freeze-gloo"]
    ended, ranks = _ended(launch), _ranks(launch)
    assert ended[1]["exit"] == "frozen, killed", launch.explain()
    assert set(ranks) == {0, 2}, launch.explain()
    for rank in (0, 2):
        assert ended[rank]["exit"] == 1, launch.explain()
        error = ranks[rank]["error"]
        # Rank 0 (rank 1's ring neighbour) reports it; rank 2 gets the abort.
        assert _silence_named(error["message"]), error
        assert error["type"] == ("RankTimeout" if rank == 0 else "GroupAborted"), error
    # Reported within the timeout of the freeze (a loaded machine may add to it).
    assert ranks[0]["seconds"] < 3 * SILENCE_TIMEOUT, ranks
    record_cell("gloo", "SIGSTOP in the loop body", 3, 1,
                f"rank 0: RankTimeout naming rank 1 silent after {ranks[0]['seconds']:.1f} s "
                f"in the Join (timeout {SILENCE_TIMEOUT:g} s, knob); rank 2: GroupAborted "
                f"(rank 0) after {ranks[2]['seconds']:.1f} s")


@pytest.mark.launches
@needs_mpi
@pytest.mark.timeout(LAUNCH_TIMEOUT * 4)
def test_mpi_sigstop_of_a_rank_in_its_loop_body_ends_the_job(
        launches: dict[str, Launch]) -> None:
    launch = launches["freeze-mpi"]
    assert not launch.timed_out and launch.returncode != 0, launch.explain()
    assert _silence_named(launch.output), launch.explain()
    assert re.search(r"joinkit: rank [02] aborts the MPI job: rank [02] has seen no sign of "
                     r"life from rank 1", launch.output), launch.explain()
    record_cell("mpi", "SIGSTOP in the loop body", 3, 1,
                f"job ends: exit {launch.returncode} after {launch.seconds:.1f} s (start-up "
                f"included; timeout {SILENCE_TIMEOUT:g} s, knob); a peer's watchdog: "
                "RankTimeout naming rank 1 silent, then MPI_Abort")


@pytest.mark.launches
@needs_torch
@pytest.mark.timeout(LAUNCH_TIMEOUT * 4)
def test_gloo_rank_holding_the_gil_in_its_loop_body_is_reported(
        launches: dict[str, Launch]) -> None:
    launch = launches["gil-gloo"]
    ended, ranks = _ended(launch), _ranks(launch)
    for rank in (0, 2):
        assert ended[rank]["exit"] == 1, launch.explain()
        error = ranks[rank]["error"]
        # Rank 1's watchdog thread cannot beat: rank 0, its ring neighbour,
        # reports it silent; rank 2 gets the abort.
        assert _silence_named(error["message"]), error
        assert error["type"] == ("RankTimeout" if rank == 0 else "GroupAborted"), error
    # Reported within the timeout, long before rank 1 lets go of the GIL.
    assert ranks[0]["seconds"] < GLOO_GIL_HOLD, ranks
    # Rank 1 wakes to a group its peers have left, and fails too.
    assert ended[1]["exit"] == 1 and ranks[1]["error"] is not None, launch.explain()
    record_cell("gloo", "GIL held in the loop body", 3, 1,
                f"rank 0: RankTimeout naming rank 1 silent after {ranks[0]['seconds']:.1f} s "
                f"in the Join (timeout {SILENCE_TIMEOUT:g} s, knob; GIL held "
                f"{GLOO_GIL_HOLD:g} s); rank 2: GroupAborted (rank 0) after "
                f"{ranks[2]['seconds']:.1f} s; rank 1, once awake: "
                f"{ranks[1]['error']['type']} after {ranks[1]['seconds']:.1f} s")


@pytest.mark.launches
@needs_mpi
@pytest.mark.timeout(LAUNCH_TIMEOUT * 4)
def test_mpi_rank_holding_the_gil_in_its_loop_body_ends_the_job(
        launches: dict[str, Launch]) -> None:
    launch = launches["gil-mpi"]
    assert not launch.timed_out and launch.returncode != 0, launch.explain()
    assert _silence_named(launch.output), launch.explain()
    assert re.search(r"joinkit: rank [02] aborts the MPI job: rank [02] has seen no sign of "
                     r"life from rank 1", launch.output), launch.explain()
    # The job ended before rank 1 let go of the GIL (start-up included):
    # rank 1 never got back to Python to leave the Join.
    assert launch.seconds < GIL_HOLD, launch.explain()
    assert not (launch.out / "rank1.json").exists(), launch.explain()
    record_cell("mpi", "GIL held in the loop body", 3, 1,
                f"job ends: exit {launch.returncode} after {launch.seconds:.1f} s (start-up "
                f"included; timeout {SILENCE_TIMEOUT:g} s, knob; GIL held {GIL_HOLD:g} s); a "
                "peer's watchdog: RankTimeout naming rank 1 silent, then MPI_Abort")


@pytest.mark.launches
@needs_torch
@pytest.mark.timeout(LAUNCH_TIMEOUT * 4)
def test_torchrun_sigkill_ends_every_survivor(launches: dict[str, Launch]) -> None:
    launch = launches["kill-torchrun"]
    assert not launch.timed_out and launch.returncode != 0, launch.explain()
    root_cause = launch.output.rpartition("Root Cause")[2]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: -9", root_cause), (
        launch.explain())
    ranks = _ranks(launch)
    assert 1 not in ranks and all(r["error"] is not None for r in ranks.values()), ranks
    # gloo's error names an address; the note names the dead rank (gone_peers).
    gone = re.compile(r"joinkit: rank 1 \(pid \d+ on \S+\) is no longer running")
    assert all(any(gone.match(note) for note in r["error"]["notes"])
               for r in ranks.values()), ranks
    record_cell("gloo", "SIGKILL, default timeout", 3, 1,
                f"torchrun exit {launch.returncode} after {launch.seconds:.1f} s (start-up "
                f"included), root cause rank 1 SIGKILL; {len(ranks)} survivor(s) left the "
                "Join with an error first (gloo's, with a note: rank 1 is no longer "
                "running), the rest got SIGTERM")


@pytest.mark.launches
@needs_mpi
@pytest.mark.timeout(LAUNCH_TIMEOUT * 4)
def test_mpirun_sigkill_ends_every_survivor(launches: dict[str, Launch]) -> None:
    launch = launches["kill-mpirun"]
    assert not launch.timed_out and launch.returncode != 0, launch.explain()
    if is_open_mpi():
        assert re.search(r"process rank 1 with PID \d+ on node \S+ exited on\s+signal 9",
                         launch.output), launch.explain()
    else:
        assert re.search(r"KILLED BY SIGNAL: 9|Killed \(signal 9\)", launch.output), (
            launch.explain())
    record_cell("mpi", "SIGKILL, default timeout", 3, 1,
                f"job ends: exit {launch.returncode} after {launch.seconds:.1f} s (start-up "
                "included); mpirun names rank 1")
