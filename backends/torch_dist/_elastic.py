"""A gloo TorchGroup that outlives its dead ranks (``Join(..., on_rank_loss="finish")``).

Theory of operation
-------------------
torch 2.13 cannot shrink a gloo group (``shrink_group`` is nccl-only) and
``ProcessGroup.abort()`` does not wake a gloo collective in flight. What works
is to leave the broken group behind and build a new, smaller gloo group of the
survivors over the store, which outlives the dead rank when it lives outside
the ranks (torchrun's agent store, a ``FileStore``, a ``TCPStore`` hosted by a
launcher). This module does that for one :class:`TorchGroup`, so the object
the user holds keeps working: same Python object, new ``process_group``, new
``rank`` and ``world_size``.

*Units.* In elastic mode every collective method of the group is one *unit*:
it runs to completion before it returns (an ``async_op`` or a heartbeat gives
back a handle that is already complete), numbered by ``seq``. Sequential units
mean a rank that completed unit k+1 knows every rank completed k's collectives
(it could not have got k+1's data otherwise), so survivors are at most one
unit apart. Each rank keeps the result of its last completed unit and a copy
of the input of the unit in flight (what an in-place all-reduce overwrites).

*Detection.* A unit's waits go in slices of ``_SLICE`` s. Between slices they
look at a flag that the group's *watcher* thread sets when the store key
``failed`` of the current generation appears. The watcher checks for it on a
clone of the store (no lock shared with the main thread) every
``_WATCH_INTERVAL`` s, less often in a big world: the watchers of a world make
at most ``_WATCH_POLLS_PER_SECOND`` reads per second together. It does not
block in a ``store.wait``, which nothing can wake: a watcher whose wait
returned while Python finalized (the key posted, the store's host gone)
killed its process, since a thread that takes the GIL back then is ended by
``pthread_exit``, whose unwinding through pybind11's GIL release calls
``std::terminate`` ("terminate called without an active exception"). The exit
guard (``_exit``) stops and joins the watchers before Python finalizes. The
first rank that sees the failure posts that key: its own collective failed
(gloo's "Connection closed by peer": the dead rank's neighbours), or, after
``_PATIENCE`` s of waiting, a peer's process is gone (same host, ``/proc``;
the liveness check for a rank that no collective is reading from). So a rank
that is not the dead rank's neighbour wakes within milliseconds, not after
the group's timeout.

*Membership.* On the failure key each survivor's watcher registers it as
alive (``alive/R``, original ranks). The first rank to claim ``decider``
waits until every expected member registered or is known gone (its process
no longer runs), at most ``_GRACE`` s for a peer it cannot see (on another
host), and at most ``_ALIVE_GRACE`` s for one whose process runs on this host
(alive, only slow to register on a loaded machine), and posts ``members``.
The others wait for it; if the decider dies first, a ``compare_set`` of
``"abandoned"`` settles the race and everyone moves to the next generation
with the same expected members.

*Rebuild.* Generation g+1 is a fresh ``ProcessGroupGloo`` over
``PrefixStore("joinkit/elastic/<group>/<g+1>/pg/", store)``, built in a helper
thread while the main thread watches for a new failure (a member that dies
during the recovery: the next generation starts over, see
``tests/elastic/test_elastic_torch.py``). The old group is never destroyed (a gloo
worker may stay blocked in it; destroying it would join that thread): it is
kept through exit.

*Agreement and hand-over.* On the new group: an all-gather of every
survivor's last completed ``seq`` (M: the highest); if some lack M, the lowest
new rank that has it broadcasts its cached result (a pickle), which they
apply as their unit's result. Then a SUM of every survivor's count of
heartbeats it sent as active (``ACTIVE``) gives, with the heartbeat totals,
the dead rank's own count: its ``iterations`` (minus one when its last
completed unit was an active heartbeat: that iteration's collective never
completed with it, so its input counts as not seen). A *transparent* unit
(``settles=False``: DDP's buffer broadcast before its forward, between an
iteration's heartbeat and its gradient unit) does not count as that
collective: the heartbeat before it stays the last unit for this rule, so a
rank that died after it and before the gradient unit did not consume that
input either. A unit that nobody completed is re-run on the new group from
its saved input.

Standard library, torch and the group's own modules; ``torch_dist`` imports it.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import socket
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from joinkit import LostRank, PeerFailure
from joinkit.lowlevel import ACTIVE

from .. import _status
from . import _board


class ElasticGroup(_board.BoardGroup, Protocol):
    """What the recovery reads and calls of a ``TorchGroup`` (this module sits
    below ``_group``, which imports it)."""

    process_group: Any

    def _aborted_error(self) -> Exception: ...
    def _posted_abort(self) -> tuple[int, str] | None: ...
    def _adopt(self, process_group: Any, rank: int, world_size: int) -> None: ...

#: Seconds a wait of a unit waits before it looks at the failure flag.
_SLICE = 0.01
#: Seconds a unit waits before it also looks for peers whose process is gone.
_PATIENCE = 1.0
#: Seconds the decider waits for expected members that neither registered
#: nor are known gone (another host) before it decides without them.
_GRACE = 2.0
#: Seconds the decider waits, at most, for an expected member on this host whose
#: process still runs (alive, but slow to register on a loaded machine).
_ALIVE_GRACE = 30.0
#: How long a non-decider waits for the decision beyond ``_GRACE``.
_DECISION_SLACK = 3.0
#: Seconds between two looks of the watcher at the failure key, at least; and
#: the store reads per second that the watchers of a whole world make together.
_WATCH_INTERVAL = 0.05
_WATCH_POLLS_PER_SECOND = 200.0
#: Launchers that keep the survivors of a dead worker.
KEEPING_LAUNCHERS = "`mpirun --with-ft ulfm` (Open MPI 5), `srun --no-kill` (Slurm)"


class GenerationFailed(Exception):
    """A unit's collective failed, or a peer posted a failure: recover. Internal."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class ElasticUnavailable(ValueError):
    """``on_rank_loss="finish"`` cannot work for this group (raised on Join entry)."""


class _Done:
    """A completed unit's handle: ``wait()`` returns at once (async_op, heartbeats)."""

    __slots__ = ("value", "total")

    def __init__(self, value: Any, total: float = 0.0) -> None:
        self.value = value
        self.total = total

    def wait(self, timeout: Any = None) -> Any:
        return self.value

    def is_completed(self) -> bool:
        return True

    def exception(self) -> None:
        return None


def _process_gone(process: dict[str, Any]) -> bool:
    """Whether the posted process no longer runs (one in ``exit()`` or a zombie
    counts as gone: ``_status.gone_text``)."""
    return _status.gone_text(process) is not None


def store_outlives_ranks_guess(store: Any) -> bool:
    """Whether ``store`` (a c10d store) outlives every rank, as far as one can tell.

    A ``FileStore`` or ``HashStore`` does; a ``TCPStore`` does under torchrun
    (its agent hosts it) and otherwise is taken to live in rank 0 (what
    ``init_process_group`` over ``env://`` does).
    """
    while isinstance(store, dist.PrefixStore):  # type: ignore[attr-defined]
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):  # type: ignore[attr-defined]
        return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return True


class Elastic:
    """The recovery state of one TorchGroup in elastic mode (module doc).

    Args:
        group: the group; its ``process_group`` is replaced on each rebuild.
        progress: called at each step of a recovery (the Join's watchdog).
        store: the base c10d store (the default group's).
        store_host: the original rank that hosts the store, or ``None`` when
            it lives outside the ranks.
    """

    def __init__(self, group: ElasticGroup, progress: Callable[[], None], store: Any,
                 store_host: int | None) -> None:
        self.group = group
        self.progress = progress
        self.store = store
        self.store_host = store_host
        self.initial_rank = group.rank
        self.members: list[int] = list(range(group.world_size))  # original ranks
        self.generation = 0
        name = getattr(group.process_group, "group_name", "") or "default"
        self.root = f"joinkit/elastic/{name}/"
        self.seq = 0  # units completed on this rank
        self.issued_other = 0  # units other than heartbeats and counts, issued
        self.inside = False
        self.last: tuple[int, str, Any] | None = None  # (seq, kind, result)
        # Heartbeat bookkeeping for the dead ranks' iterations (module doc).
        self.totals = 0.0  # sum of every completed heartbeat's total
        self.own_active = 0  # heartbeats this rank completed as active
        self.last_beat: float | None = None  # this rank's value, if the last unit was a beat
        self.current_beat: float | None = None  # the same, for the unit in flight
        # The result of the last unit that settles (not transparent), and whether
        # the unit in flight settles (module doc).
        self.last_settled: Any = None
        self.current_settles = True
        self.lost: list[Any] = []
        self.counted = 0  # heartbeats of ranks lost so far (their own_active)
        self.failed_seen = -1  # generation whose failure key the watcher saw
        self.processes: dict[int, dict[str, Any]] = {}
        self.kept: list[Any] = []  # old process groups, never destroyed
        self.timeout = datetime.timedelta(seconds=float(os.environ.get(
            "JOINKIT_ELASTIC_GLOO_TIMEOUT", "60")))
        self._stop = threading.Event()
        self._post_process()
        announce_finish_mode()
        try:  # the watcher's own connection (module doc)
            watched = self.store.clone()
        except Exception:  # noqa: BLE001 - a store without clone(): share it
            watched = self.store
        self._watcher = threading.Thread(target=self._watch, args=(watched,),
                                         name="joinkit-elastic", daemon=True)
        _board.start_stoppable(self._watcher, self._stop)

    def reset_counts(self) -> None:
        """A new Join: iterations count from here (every rank calls it on entry)."""
        self.totals, self.own_active, self.counted = 0.0, 0, 0

    # -- keys ----------------------------------------------------------------------

    def key(self, generation: int, name: str) -> str:
        return f"{self.root}{generation}/{name}"

    def _post_process(self) -> None:
        me = json.dumps(_status.this_process())
        self.store.set(f"{self.root}process/{self.initial_rank}", me)

    def _peer_processes(self) -> dict[int, dict[str, Any]]:
        for rank in self.members:
            if rank in self.processes or rank == self.initial_rank:
                continue
            key = f"{self.root}process/{rank}"
            try:
                if self.store.check([key]):
                    self.processes[rank] = json.loads(self.store.get(key))
            except Exception:  # noqa: BLE001 - the store is gone: nothing known
                continue
        return self.processes

    def running_here(self, rank: int) -> bool:
        """Whether ``rank``'s process runs on this host (so it is alive, if slow)."""
        process = self._peer_processes().get(rank)
        return (process is not None and process.get("host") == socket.gethostname()
                and not _process_gone(process))

    def gone(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` whose process is known to be gone (same host)."""
        processes = self._peer_processes()
        return [r for r in ranks if r in processes and _process_gone(processes[r])]

    # -- the watcher thread ----------------------------------------------------------

    def _watch(self, store: Any) -> None:
        """The watcher thread: sets ``failed_seen`` once the failure key of the
        current generation appears, and registers this rank alive (module doc)."""
        try:
            while not self._stop.is_set():
                generation = self.generation
                try:
                    found = bool(store.check([self.key(generation, "failed")]))
                except Exception:  # noqa: BLE001 - no store: nothing known
                    found = False
                if not found:
                    self._stop.wait(max(_WATCH_INTERVAL,
                                        len(self.members) / _WATCH_POLLS_PER_SECOND))
                    continue
                if generation == self.generation:
                    self.failed_seen = max(self.failed_seen, generation)
                    try:
                        store.set(self.key(generation, f"alive/{self.initial_rank}"), "1")
                    except Exception:  # noqa: BLE001
                        pass
                while self.generation == generation and not self._stop.wait(0.005):
                    pass
        finally:
            _board.forget(threading.current_thread())

    # -- waits ---------------------------------------------------------------------

    def wait(self, work: Any) -> Any:
        """Wait for ``work`` of the current generation.

        Raises:
            GenerationFailed: a rank died (this rank's collective failed, a
                peer posted the failure key, or a peer's process is gone).
            GroupAborted: a rank aborted the group (a join hook raised): that
                is an error for every rank, as with ``on_rank_loss="raise"``,
                not a death to recover from.
        """
        group = self.group
        generation = self.generation
        started = time.monotonic()
        next_look = started + _PATIENCE
        slice_ = datetime.timedelta(seconds=_SLICE)
        watched = False
        try:
            while True:
                if group._abort is not None:
                    raise group._aborted_error()
                if self.failed_seen >= generation:
                    raise GenerationFailed("store key")
                try:
                    return work.wait(slice_)
                except RuntimeError:
                    if work.is_completed():
                        # The slice may have ended as the work completed: only a
                        # second wait tells a failure from a success.
                        try:
                            return work.wait()
                        except RuntimeError as failed:
                            self._raise_if_aborted()  # the aborting rank left
                            raise GenerationFailed(_gloo_error(failed)) from failed
                if not watched:  # a long wait: the abort watcher reads the abort key
                    watched = _board._watch_aborts(group, +1)
                now = time.monotonic()
                if now >= next_look:
                    next_look = now + _PATIENCE / 2
                    gone = self.gone([r for r in self.members if r != self.initial_rank])
                    if gone:
                        self._raise_if_aborted()  # a peer that aborted and left
                        raise GenerationFailed(f"rank {gone[0]}'s process is gone")
        finally:
            if watched:
                _board._watch_aborts(group, -1)

    def _raise_if_aborted(self) -> None:
        """Raise GroupAborted if a rank aborted the group (the store's abort key):
        an abort is an error for every rank, never a death to recover from."""
        group = self.group
        if group._abort is None:
            group._abort = group._posted_abort()
        if group._abort is not None:
            raise group._aborted_error()

    # -- units ---------------------------------------------------------------------

    def unit(self, kind: str, run: Callable[[], Any], buf: Any = None,
             beat: float | None = None, settles: bool = True) -> Any:
        """Run one collective method as a unit (module doc); return its result.

        Args:
            kind: its name, for messages and the hand-over.
            run: the method's plain body on the current process group.
            buf: the caller's buffer it overwrites in place, if any: saved
                before and restored before a re-run; a hand-over lands in it.
            beat: for a heartbeat: this rank's value (its result is the total).
            settles: ``False`` for a transparent unit (module doc).
        """
        saved = _snapshot(buf)
        self.current_beat = beat
        self.current_settles = settles
        if beat is None:  # not a heartbeat or a count: collectives_issued
            self.issued_other += 1
        self.inside = True
        try:
            while True:
                if self.failed_seen >= self.generation:
                    handed = self.recover("store key", kind)
                else:
                    try:
                        result = run()
                    except GenerationFailed as failure:
                        handed = self.recover(failure.detail, kind)
                    else:
                        self._completed(kind, _snapshot(result), beat, settles)
                        return result
                if handed is not None:
                    result = _apply(buf, handed)
                    self._completed(kind, handed, beat, settles)
                    return result
                _restore(buf, saved)
        finally:
            self.inside = False

    def _completed(self, kind: str, result: Any, beat: float | None, settles: bool) -> None:
        self.seq += 1
        self.last = (self.seq, kind, result)
        if settles:
            self.last_beat, self.last_settled = beat, result
        if beat is not None:
            self.totals += _tally(result)
            if beat == ACTIVE:
                self.own_active += 1

    # -- recovery ------------------------------------------------------------------

    def recover(self, detail: str, kind: str) -> Any:
        """Rebuild the group over the survivors; return a handed-over result or None.

        Raises:
            PeerFailure: the store is gone (its host died), or this rank was
                left out of the rebuilt group.
        """
        self._raise_if_aborted()  # the failure may be a peer's abort, seen late
        first_detail = None
        expected = list(self.members)
        first_generation = self.generation
        try:
            # This rank's heartbeats so far, should it die during the recovery
            # (its share is then known, not guessed from the totals).
            self.store.set(self.key(first_generation, f"state/{self.initial_rank}"),
                           json.dumps({"beats": self.own_active,
                                       "last_active": self.last_beat == ACTIVE}))
        except (RuntimeError, OSError, ValueError) as exc:
            raise self._store_gone(exc) from exc
        while True:
            generation = self.generation
            me = self.initial_rank
            try:
                posted = f"rank {me}: {detail} in {kind}"
                first = self.store.compare_set(self.key(generation, "failed"), "", posted)
                first_detail = first_detail or (first.decode() if first else posted)
                self.store.set(self.key(generation, f"alive/{me}"), "1")
                self.progress()
                members = self._decide(generation, self.members)
            except (RuntimeError, OSError, ValueError) as exc:
                raise self._store_gone(exc) from exc
            self.progress()
            if members is None:  # the decider died: once more, one generation on
                self._advance(generation + 1)
                detail = "the decider died"
                continue
            if me not in members:
                raise PeerFailure(
                    me, "RankLost",
                    f"rank {me} was left out of the group rebuilt after a rank died "
                    f"(it did not answer within {_GRACE:g} s)")
            self._advance(generation + 1)
            try:
                pg = self._build(generation + 1, members)
                handed = self._agree(pg, members, expected, first_detail or detail, kind,
                                     first_generation)
            except GenerationFailed as failure:
                # A member died during the recovery: wait for the others only.
                detail = failure.detail
                self._adopt_members(members)
                continue
            return handed

    def _store_gone(self, exc: BaseException) -> PeerFailure:
        host = self.store_host
        where = ("" if host is None else
                 f" rank {host} hosted it (a TCPStore in rank 0: its death cannot be "
                 "recovered; host the store outside the ranks: docs/elastic-torch.md);")
        return PeerFailure(
            -1 if host is None else host, "StoreLost",
            f"the store that the survivors rebuild the group over did not answer:{where} "
            f"{exc}")

    def _advance(self, generation: int) -> None:
        self.generation = generation

    def _adopt_members(self, members: list[int]) -> None:
        self.members = list(members)

    def _decide(self, generation: int, expected: list[int]) -> list[int] | None:
        store, me = self.store, self.initial_rank
        members_key = self.key(generation, "members")
        claim = store.compare_set(self.key(generation, "decider"), "", str(me))
        if claim.decode() == str(me):
            deadline = time.monotonic() + _GRACE
            cap = time.monotonic() + _ALIVE_GRACE
            while True:
                alive = [r for r in expected
                         if store.check([self.key(generation, f"alive/{r}")])]
                missing = [r for r in expected if r not in alive]
                gone = self.gone(missing) if missing else []
                if len(gone) == len(missing):
                    break
                now = time.monotonic()
                # A member on this host whose process still runs is alive, only slow
                # to register (a loaded machine): wait for it, up to the cap.
                if now >= deadline and (now >= cap or not any(
                        self.running_here(r) for r in missing if r not in gone)):
                    break
                time.sleep(0.002)
            decided = store.compare_set(members_key, "", json.dumps(alive))
        else:
            # Wait for the decision; give up early when the decider is gone.
            decider = int(claim.decode())
            deadline = time.monotonic() + _GRACE + _DECISION_SLACK
            cap = time.monotonic() + _ALIVE_GRACE + _DECISION_SLACK
            next_look = time.monotonic() + 0.05
            while not store.check([members_key]) and (
                    time.monotonic() < deadline
                    or (time.monotonic() < cap and self.running_here(decider))):
                time.sleep(0.002)
                if time.monotonic() >= next_look:
                    next_look = time.monotonic() + 0.05
                    if self.gone([decider]):
                        break
            # The decider died (or never posted): settle the race for good.
            decided = store.compare_set(members_key, "", "abandoned")
        text = decided.decode()
        return None if text == "abandoned" else [int(r) for r in json.loads(text)]

    def _build(self, generation: int, members: list[int]) -> Any:
        """A gloo group of ``members`` for ``generation``, or GenerationFailed."""
        rank = members.index(self.initial_rank)
        # The group's rendezvous blocks on the store: a connection of its own,
        # so this thread's store reads (who is gone, a new failure) go on.
        try:
            base = self.store.clone()
        except Exception:  # noqa: BLE001 - a store without clone()
            base = self.store
        store = dist.PrefixStore(self.key(generation, "pg/"), base)  # type: ignore[attr-defined]
        self._peer_processes()
        built: list[Any] = []
        errors: list[BaseException] = []

        def build() -> None:
            try:
                built.append(dist.ProcessGroupGloo(store, rank, len(members), self.timeout))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
            finally:
                _board.forget(threading.current_thread())

        # Joined by the exit guard too (up to its patience), should a failure
        # below leave it connecting.
        helper = threading.Thread(target=build, name="joinkit-elastic-build", daemon=True)
        if not _board.start_stoppable(helper, threading.Event()):
            build()  # the process is leaving: no thread
        next_look = time.monotonic() + 0.05
        while helper.is_alive():
            helper.join(_SLICE)
            if self.failed_seen >= generation:
                raise GenerationFailed("store key")
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + 0.05
                gone = self.gone([r for r in members if r != self.initial_rank])
                if gone:
                    self._post_failed(generation, f"rank {gone[0]}'s process is gone "
                                      "(during the rebuild)")
                    raise GenerationFailed(f"rank {gone[0]}'s process is gone")
        if errors:
            raise GenerationFailed(f"gloo error while rebuilding: {errors[0]}")
        self.progress()
        return built[0]

    def _post_failed(self, generation: int, detail: str) -> None:
        try:
            self.store.compare_set(self.key(generation, "failed"), "", detail)
        except Exception:  # noqa: BLE001
            pass

    def _agree(self, pg: Any, members: list[int], expected: list[int], detail: str,
               kind: str, first_generation: int) -> Any:
        """Agree on the last completed unit over ``pg``; hand it over; record losses."""
        group = self.group
        rank, size = members.index(self.initial_rank), len(members)
        seqs = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        mine = torch.tensor([self.seq], dtype=torch.int64)
        self._raw(pg.allgather([seqs], [mine]), pg)
        completed = [int(s.item()) for s in seqs]
        highest = max(completed)
        donor = completed.index(highest)
        handed = None
        if min(completed) < highest:
            payload = pickle.dumps(self.last) if rank == donor else b""
            length = torch.tensor([len(payload)], dtype=torch.int64)
            opts = dist.BroadcastOptions()
            opts.rootRank = donor
            self._raw(pg.broadcast([length], opts), pg)
            raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if rank == donor \
                else torch.zeros(int(length.item()), dtype=torch.uint8)
            self._raw(pg.broadcast([raw], opts), pg)
            if rank != donor and self.seq < highest:
                last = pickle.loads(raw.numpy().tobytes())
                handed = last[2]
        # The dead ranks' heartbeats: every total minus the survivors' own; and
        # whether the last unit (M, the same on every survivor now) was a
        # heartbeat in which a dead rank was active.
        own, totals = self.own_active, self.totals
        last_result, last_beat = self.last_settled, self.last_beat
        if handed is not None and self.current_settles:
            last_result, last_beat = handed, self.current_beat
            if last_beat is not None:
                totals += _tally(handed)
                own += 1 if last_beat == ACTIVE else 0
        sums = torch.tensor([own, 1 if last_beat == ACTIVE else 0], dtype=torch.int64)
        sum_opts = dist.AllreduceOptions()
        sum_opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        self._raw(pg.allreduce([sums], sum_opts), pg)
        dead = [r for r in expected if r not in members]
        residual = int(round(totals)) - int(sums[0].item()) - self.counted
        # A rank that died during the recovery posted its own count first.
        posted = self._posted_states(first_generation, dead)
        residual -= sum(state["beats"] for state in posted.values())
        silent = [r for r in dead if r not in posted]
        share, extra = divmod(max(residual, 0), max(len(silent), 1))
        dead_active_last = (last_beat is not None and
                            int(round(_tally(last_result))) - int(sums[1].item()) > 0)

        for rank_lost in dead:
            if rank_lost in posted:
                beats = int(posted[rank_lost]["beats"])
                active_last = bool(posted[rank_lost]["last_active"])
                how = f"{detail}; rank {rank_lost} died during the recovery"
            else:
                index = silent.index(rank_lost)
                beats = share + (1 if index < extra else 0)
                active_last = dead_active_last and len(silent) == 1
                how = detail if len(silent) == 1 else (
                    f"{detail}; ranks {', '.join(map(str, silent))} died together: "
                    "their heartbeats are shared out evenly")
            self.counted += beats
            # Its last completed unit an active heartbeat: that iteration's
            # collective never completed with it (module doc).
            iterations = max(beats - 1, 0) if active_last else beats
            self.lost.append(LostRank(rank=rank_lost, iterations=iterations,
                                      survivors=tuple(members), detected=how))
        self.kept.append(group.process_group)
        group._adopt(pg, rank, size)
        self._adopt_members(members)
        self.progress()
        return handed

    def _posted_states(self, first_generation: int, dead: list[int]) -> dict[int, Any]:
        """The counts that ``dead`` ranks posted on entering this recovery."""
        found = {}
        for rank in dead:
            key = self.key(first_generation, f"state/{rank}")
            try:
                if self.store.check([key]):
                    found[rank] = json.loads(self.store.get(key))
            except (RuntimeError, OSError, ValueError):
                continue
        return found

    def _raw(self, work: Any, pg: Any) -> None:
        """Wait for a recovery collective on ``pg`` (the current generation)."""
        self.wait(work)


def _gloo_error(exc: BaseException) -> str:
    """A short name for a failed gloo collective's error."""
    text = str(exc)
    if "Connection closed by peer" in text:
        return "gloo error (connection closed by peer)"
    if "Connection reset by peer" in text:
        return "gloo error (connection reset by peer)"
    return f"gloo error ({text.splitlines()[0][:120] if text else type(exc).__name__})"


def _tally(total: Any) -> float:
    """A heartbeat total's active count (flagged or alarmed sums count 0)."""
    value = float(total)
    return value if value < 2.0**24 else 0.0


def _snapshot(buf: Any) -> Any:
    if isinstance(buf, torch.Tensor):
        return buf.detach().clone()
    if isinstance(buf, np.ndarray):
        return buf.copy()
    if isinstance(buf, list):
        return [_snapshot(b) for b in buf]
    return buf


def _restore(buf: Any, saved: Any) -> None:
    if isinstance(buf, torch.Tensor):
        with torch.no_grad():
            buf.copy_(saved)
    elif isinstance(buf, np.ndarray):
        np.copyto(buf, saved)


def _apply(buf: Any, result: Any) -> Any:
    """A handed-over result as the unit's result (in place into ``buf`` if any)."""
    if buf is None:
        return result
    if isinstance(buf, torch.Tensor):
        with torch.no_grad():
            buf.copy_(result if isinstance(result, torch.Tensor) else torch.as_tensor(result))
    elif isinstance(buf, np.ndarray):
        np.copyto(buf, np.asarray(result))
    return buf


def torchrun_warning() -> str | None:
    """The warning for ``on_rank_loss="finish"`` under torchrun, or ``None`` elsewhere
    (and under ``python -m joinkit run``, whose agent keeps the survivors)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get(RUN_ENV) == "1":
        return None
    return (
        "joinkit: Join(on_rank_loss='finish') under torchrun: torchrun's agent kills "
        "every worker when one dies, so the survivors will not get to finish; launch "
        f"with `python -m joinkit run` (torchrun's arguments; its agent keeps them) or "
        f"another launcher that keeps the survivors ({KEEPING_LAUNCHERS}), or a process "
        "of your own that hosts the store (docs/elastic-torch.md)"
    )


#: Set by ``python -m joinkit run``'s agent in its workers' environment (``_run``),
#: with the folder where a worker says it entered a finish-mode Join.
RUN_ENV = "JOINKIT_RUN"
RUN_DIR_ENV = "JOINKIT_RUN_DIR"


def announce_finish_mode() -> None:
    """Tell ``python -m joinkit run``'s agent that this worker's death is a loss to
    finish without (``finish-<RANK>`` in its folder); nothing elsewhere."""
    folder = os.environ.get(RUN_DIR_ENV)
    if not folder or os.environ.get(RUN_ENV) != "1":
        return
    rank = os.environ.get("RANK")
    if rank is None:
        return
    try:
        with open(os.path.join(folder, f"finish-{int(rank)}"), "a"):
            pass
    except (OSError, ValueError):
        warnings.warn(f"joinkit: could not tell joinkit run's agent (folder {folder}) that "
                      "this worker finishes after a loss: its death would stop the job",
                      RuntimeWarning, stacklevel=2)


def warn_torchrun() -> None:
    message = torchrun_warning()
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=4)
