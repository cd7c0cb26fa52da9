"""``python -m joinkit run``: torchrun's launcher, with an agent that keeps the survivors.

Theory of operation
-------------------
torchrun is ``torch.distributed.run``: its arguments become a ``LaunchConfig``
and ``launch_agent`` runs one ``LocalElasticAgent`` per node, which starts the
workers, hosts (on the first node) the TCPStore that the rendezvous and the
workers' default group share, and *monitors*: every ``--monitor-interval``
seconds it polls the workers, and as soon as ONE has failed it stops all of
them (SIGTERM) and restarts the group or, with no restarts left, fails.

:class:`JoinkitAgent` is that agent with one change in its monitoring. A
worker that entered ``Join(..., on_rank_loss="finish")`` says so by creating
``finish-<RANK>`` in the folder named by ``JOINKIT_RUN_DIR`` (the agent's,
given to its workers with ``JOINKIT_RUN=1``; ``torch_dist._elastic`` writes
it when a group turns elastic). When such a worker dies by a signal (SIGKILL,
the out-of-memory killer; an exit status is an error, which the Join tells
every rank), the agent records it as *lost* (``lost-<RANK>`` in the same
folder) and leaves the other workers
running: they rebuild their gloo group over the agent's store, which stays
up because the agent does. When no worker is left running the agent succeeds
if every survivor exited 0 (printing the lost ranks on standard error) and
fails otherwise. A worker that dies without having said so is handled as
torchrun would (stop everything, restart or fail): without
``on_rank_loss="finish"`` this is torchrun.

Across nodes every agent posts a beat and, at the end, its outcome in the
rendezvous store; the exit barrier waits for the agents that still beat
(torchrun's waits for all of them, so a lost node kept the others there for
its 300 s timeout). An agent whose workers were all lost reports the job's
outcome: it succeeds when the other agents' survivors did.

The room's rules: torch's own agent is subclassed, not copied; what of
torch's internals it touches (``LocalElasticAgent._monitor_workers``,
``_exit_barrier``, ``_pcontext``, ``SubprocessContext.subprocess_handlers``,
``launcher.api.LocalElasticAgent``) is checked by :func:`check_torch` before
anything runs, so a torch that moved them fails with a message, not silently.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

# Set in every worker's environment (JOINKIT_RUN=1 and the folder where a
# worker announces finish mode, finish-<RANK>): _elastic reads them.
from ._elastic import RUN_DIR_ENV, RUN_ENV

__all__ = ["JoinkitAgent", "main", "check_torch", "RUN_ENV", "RUN_DIR_ENV"]

#: The keys the agents share in the rendezvous store.
_PREFIX = "joinkit/run/"
#: Seconds between an agent's beats, and how long a silent agent counts as alive
#: at the exit barrier (``JOINKIT_RUN_SILENT`` overrides it).
_BEAT = 0.5
_SILENT = float(os.environ.get("JOINKIT_RUN_SILENT", "15"))
#: Seconds the agent waits at shutdown for its beat thread's store call to end.
_BEAT_JOIN = 5.0
#: torch's internals this module relies on: (object, attribute).
_GUARDED = (
    (LocalElasticAgent, "_monitor_workers"),
    (LocalElasticAgent, "_exit_barrier"),
    (LocalElasticAgent, "_start_workers"),
    (LocalElasticAgent, "_invoke_run"),
    (SubprocessContext, "_poll"),
)


def check_torch() -> None:
    """Refuse a torch whose elastic agent lacks what :class:`JoinkitAgent` overrides.

    Raises:
        RuntimeError: the torch version or an internal it checks is not there
            (the message names it and the torch version).
    """
    import torch.distributed.launcher.api as launcher

    missing = [f"{owner.__name__}.{name}" for owner, name in _GUARDED
               if not callable(getattr(owner, name, None))]
    if getattr(launcher, "LocalElasticAgent", None) is not LocalElasticAgent:
        missing.append("torch.distributed.launcher.api.LocalElasticAgent")
    if missing:
        raise RuntimeError(
            f"joinkit run: torch {torch.__version__}'s elastic agent lacks "
            f"{', '.join(missing)}, which joinkit run's agent overrides: joinkit run is "
            f"refused on torch {torch.__version__}; launch with torchrun")


class JoinkitAgent(LocalElasticAgent):
    """torch's ``LocalElasticAgent``, keeping the survivors of a finish-mode worker's death.

    Everything is torch's but the monitoring (module doc): a worker that had
    entered ``Join(..., on_rank_loss="finish")`` and dies is *lost*, and the
    others run on; the group succeeds when the survivors all exit 0.

    Attributes:
        lost: global rank -> the lost worker's exit code (``-9``: SIGKILL), this node's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._folder = Path(tempfile.mkdtemp(prefix="joinkit-run-"))
        self.lost: dict[int, int] = {}
        self._lost_local: set[int] = set()
        self._beating = threading.Event()
        self._beat_thread: threading.Thread | None = None
        self._survivors: list[int] = []
        self._others_ok = False

    # -- the workers -----------------------------------------------------------------------

    def _start_workers(self, worker_group: Any) -> dict[int, Any]:
        attempt = self._folder / f"attempt{len(list(self._folder.iterdir()))}"
        attempt.mkdir()
        self._attempt = attempt
        self.lost, self._lost_local, self._survivors = {}, set(), []
        # The workers inherit the agent's environment (SubprocessHandler).
        os.environ[RUN_ENV] = "1"
        os.environ[RUN_DIR_ENV] = str(attempt)
        started: dict[int, Any] = super()._start_workers(worker_group)
        self._start_beating(worker_group)
        return started

    def _announced(self, global_rank: int) -> bool:
        return (self._attempt / f"finish-{global_rank}").exists()

    def _monitor_workers(self, worker_group: Any) -> RunResult:
        context = self._pcontext
        if not isinstance(context, SubprocessContext):
            result: RunResult = super()._monitor_workers(worker_group)  # a function: torch's
            return result
        codes: dict[int, int | None] = {
            local: handler.proc.poll() for local, handler in context.subprocess_handlers.items()}
        workers = worker_group.workers
        for local, code in sorted(codes.items()):
            if code is None or code == 0 or local in self._lost_local:
                continue
            rank = workers[local].global_rank
            if code > 0 or not self._announced(rank):
                # An error (an exit status, not a signal: the Join tells the others,
                # who fail too), or a worker outside finish mode: torchrun's way
                # (stop all; restart or fail).
                verdict: RunResult = super()._monitor_workers(worker_group)
                return verdict
            self._lost_local.add(local)
            self.lost[rank] = int(code)
            _say(f"rank {rank} (pid {context.subprocess_handlers[local].proc.pid}) was lost "
                 f"({_exit_text(int(code))}); it had entered Join(on_rank_loss='finish'): "
                 "the other workers go on")
            # What the agent decided, for its workers to read (``lost-<RANK>``).
            (self._attempt / f"lost-{rank}").write_text(str(code))
        if any(code is None for code in codes.values()):
            return RunResult(state=WorkerState.HEALTHY)
        if not self._lost_local:
            done: RunResult = super()._monitor_workers(worker_group)  # torch's verdict
            return done
        failures = {
            workers[local].global_rank: ProcessFailure(
                local_rank=local, pid=context.subprocess_handlers[local].proc.pid,
                exitcode=int(code or 0), error_file=context.error_files[local])
            for local, code in codes.items()
            if local not in self._lost_local and code != 0}
        survivors = [workers[local].global_rank for local in codes
                     if local not in self._lost_local]
        if failures:
            return RunResult(state=WorkerState.FAILED, failures=failures)
        self._survivors = survivors
        # torch records every worker's event: the lost ones as failures of a group
        # that succeeded.
        lost = {
            workers[local].global_rank: ProcessFailure(
                local_rank=local, pid=context.subprocess_handlers[local].proc.pid,
                exitcode=int(codes[local] or 0), error_file=context.error_files[local])
            for local in sorted(self._lost_local)}
        return RunResult(state=WorkerState.SUCCEEDED, failures=lost,
                         return_values=dict.fromkeys(survivors))

    def _invoke_run(self, role: str = "default") -> RunResult:
        result: RunResult = super()._invoke_run(role)
        if (result.state == WorkerState.SUCCEEDED and self._lost_local and not self._survivors
                and not self._others_ok):
            # Every worker here was lost and no other agent's survived: the job failed.
            _say("no worker of the job survived")
            context = self._pcontext
            assert isinstance(context, SubprocessContext)
            workers = self._worker_group.workers
            return RunResult(state=WorkerState.FAILED, failures={
                workers[local].global_rank: ProcessFailure(
                    local_rank=local, pid=context.subprocess_handlers[local].proc.pid,
                    exitcode=self.lost[workers[local].global_rank],
                    error_file=context.error_files[local])
                for local in sorted(self._lost_local)})
        return result

    # -- across agents ---------------------------------------------------------------------

    def _start_beating(self, worker_group: Any) -> None:
        store = self._store
        if store is None or self._beat_thread is not None:
            return
        me = worker_group.group_rank
        ranks = [worker.global_rank for worker in worker_group.workers]
        try:
            store.set(f"{_PREFIX}ranks/{me}", json.dumps(ranks))
            beats = store.clone() if hasattr(store, "clone") else store
        except Exception:  # noqa: BLE001 - no shared store: a single node's verdict only
            return

        def beat() -> None:
            count = 0
            while not self._beating.wait(_BEAT):
                count += 1
                try:
                    beats.set(f"{_PREFIX}beat/{me}", str(count))
                except Exception:  # noqa: BLE001 - the store's host is gone
                    return

        self._beat_thread = threading.Thread(target=beat, name="joinkit-run-beat", daemon=True)
        self._beat_thread.start()

    def _exit_barrier(self) -> None:
        """Wait for the other agents that are still alive; print the job's losses."""
        group = self._worker_group
        store, size, me = self._store, group.group_world_size, group.group_rank
        outcome = {"ok": True, "lost": self.lost, "survivors": self._survivors}
        if size is None or size <= 1 or store is None:
            self._report(self.lost, [])
            return
        try:
            store.set(f"{_PREFIX}done/{me}", json.dumps(outcome))
        except Exception as exc:  # noqa: BLE001
            _say(f"the rendezvous store did not answer at exit ({exc}); not waiting for "
                 "the other agents")
            return
        deadline = time.monotonic() + self._exit_barrier_timeout
        seen: dict[int, tuple[str | None, float]] = {}
        done: dict[int, Any] = {}
        gone: list[int] = []
        while time.monotonic() < deadline:
            gone = []
            for agent in range(size):
                if agent in done:
                    continue
                try:
                    if store.check([f"{_PREFIX}done/{agent}"]):
                        done[agent] = json.loads(store.get(f"{_PREFIX}done/{agent}"))
                        continue
                    value = (store.get(f"{_PREFIX}beat/{agent}").decode()
                             if store.check([f"{_PREFIX}beat/{agent}"]) else None)
                except Exception:  # noqa: BLE001 - the store's host is gone
                    _say("the rendezvous store's host is gone: not waiting for the other agents")
                    return
                last = seen.get(agent)
                if last is None or last[0] != value:
                    seen[agent] = (value, time.monotonic())
                elif time.monotonic() - last[1] > _SILENT:
                    gone.append(agent)
            if len(done) + len(gone) >= size:
                break
            time.sleep(0.1)
        self._others_ok = any(o["survivors"] or not o["lost"] for a, o in done.items()
                              if a != me)
        lost = {int(r): c for outcome in done.values() for r, c in outcome["lost"].items()}
        lost_agents = [a for a in range(size) if a not in done]
        lost_ranks: list[int] = []
        for agent in lost_agents:
            with contextlib.suppress(Exception):
                lost_ranks += json.loads(store.get(f"{_PREFIX}ranks/{agent}"))
        self._report(lost, lost_ranks)

    def _report(self, lost: dict[int, int], node_ranks: Sequence[int]) -> None:
        if not lost and not node_ranks:
            return
        parts = [f"{rank} ({_exit_text(code)})" for rank, code in sorted(lost.items())]
        parts += [f"{rank} (its node's agent is gone)" for rank in sorted(node_ranks)]
        _say(f"lost rank(s) {', '.join(parts)}; the survivors finished")

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM,
                  *args: Any, **kwargs: Any) -> None:
        # torch passes (death_sig, is_restart) in 2.6-2.7, (death_sig) in 2.8-2.11,
        # (death_sig, timeout) from 2.12: whatever it passes goes on.
        self._beating.set()
        if self._beat_thread is not None:
            # Not still in a store call once Python finalizes (a thread that comes
            # back from one then aborts the process: torch_dist._board's doc).
            self._beat_thread.join(_BEAT_JOIN)
        super()._shutdown(death_sig, *args, **kwargs)
        shutil.rmtree(self._folder, ignore_errors=True)


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"{signal.Signals(-code).name}, exit code {code}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _say(text: str) -> None:
    print(f"joinkit run: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _our_agent() -> Iterator[None]:
    """torch's launcher builds its agent from this module's class, for one launch."""
    import torch.distributed.launcher.api as launcher

    setattr(launcher, "LocalElasticAgent", JoinkitAgent)  # noqa: B010 - launch_agent's name
    try:
        yield
    finally:
        setattr(launcher, "LocalElasticAgent", LocalElasticAgent)  # noqa: B010


def main(argv: Sequence[str], prog: str = "python -m joinkit run") -> int:
    """Run torchrun's launcher with :class:`JoinkitAgent`; return the exit status.

    Args:
        argv: torchrun's arguments, then the training script and its arguments.
        prog: the program name for the help and errors.

    Returns:
        0 when every worker (or, after losses, every survivor) exited 0, else 1.
    """
    import torch.distributed.run as torchrun

    check_torch()
    parser = torchrun.get_args_parser()
    parser.prog = prog
    args = parser.parse_args(list(argv))
    with _our_agent():
        try:
            torchrun.run(args)  # type: ignore[no-untyped-call]
        except ChildFailedError as failed:
            print(failed.format_msg(), file=sys.stderr, flush=True)  # type: ignore[no-untyped-call]
            return 1
    return 0
