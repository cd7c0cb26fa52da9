"""Exact shards: every sample read once per epoch, nothing padded, nothing dropped.

Theory of operation
-------------------
``torch.utils.data.DistributedSampler`` makes every rank's shard the same
length by repeating samples (13 samples on 2 ranks are read as 7 + 7, one of
them twice), or with ``drop_last=True`` by leaving samples out: evaluation is
then off, and a training epoch weighs some samples twice. It does so because a
loop of collectives hangs when one rank has fewer batches. Under
``joinkit.Join`` uneven shards are fine, so the exact split is the easy one:

- :class:`ShardSampler` (map-style datasets) takes DistributedSampler's order,
  the same ``torch.randperm`` of ``seed + epoch`` (or ``range`` without
  shuffling), and gives rank ``r`` the positions ``r, r + W, r + 2W, ...`` of
  it that exist, without the padding. So rank ``r``'s indices are a prefix of
  DistributedSampler's, every index is on exactly one rank, and the shard
  lengths differ by at most one (ranks below ``len % W`` hold one more).
- :class:`ShardedIterable` (iterable datasets, shard lists) splits a stream
  over *readers*: each DataLoader worker of each rank is one reader, and reader
  ``worker * W + rank`` of ``W * num_workers`` keeps the elements at positions
  congruent to its index. Element ``i`` is therefore read by rank ``i % W``
  whatever ``num_workers`` is (the same ranks as ``ShardSampler(...,
  shuffle=False)``), and by exactly one worker there. With ``expand=`` the
  stream is a list of shards (tar files, say) and each shard is opened by
  exactly one reader, which yields its samples.

*Checkpoints.* With ``batch_size=`` a ShardSampler also knows what every rank
has consumed (``_progress``'s theory of operation): the loop's completed
iterations, counted by the Join the sampler is iterated in
(``Join.current()``, whose report gives this rank's iterations, its shadow
rounds and the lost ranks' iterations), times the batch size, capped by each
rank's share. ``state_dict`` turns that into the positions of the epoch's order
not yet consumed, the same on every rank; ``load_state_dict`` makes them the
next pass, divided over the new world. An iteration of the sampler is a
*pass*; a new pass in the same epoch starts the epoch over (as
DistributedSampler does), except after a resume and, with ``take_over=True``,
after a pass in which ranks died: then it divides what is left over the
survivors (``passes()`` loops over them).

Rank and world size come from the arguments, or from a joinkit group, torch
``ProcessGroup`` or mpi4py communicator passed as ``group=`` (read through
:func:`joinkit.backends.resolve`, so this works under ``mpirun`` without
torch.distributed), or else from the initialised default ``torch.distributed``
group, as DistributedSampler does. They are fixed when the object is built, in
the main process, never inside a DataLoader worker.

This module imports torch (``pip install 'joinkit[torch]'``); joinkit itself
does not import it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import Any

import attrs
import numpy as np

try:
    import torch
    from torch.utils.data import IterableDataset, Sampler, get_worker_info
except ModuleNotFoundError as exc:  # pragma: no cover - the no-torch environment
    raise ModuleNotFoundError(
        "joinkit.adapters.torch.data needs torch, which could not be imported "
        f"({exc}). Please run: pip install 'joinkit[torch]'"
    ) from exc

from . import _progress

__all__ = ["ShardSampler", "ShardedIterable", "TakeOver", "shard_size"]


def shard_size(length: int, num_replicas: int, rank: int) -> int:
    """How many of ``length`` samples rank ``rank`` of ``num_replicas`` holds.

    Args:
        length: the number of samples (indices, elements or shards).
        num_replicas: the number of ranks.
        rank: the rank, ``0 <= rank < num_replicas``.

    Returns:
        ``ceil((length - rank) / num_replicas)``, at least 0: the ranks below
        ``length % num_replicas`` hold one sample more than the others.

    Raises:
        ValueError: a negative length, or a rank or world size out of range.
    """
    _check_rank(num_replicas, rank)
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    return max(0, -(-(length - rank) // num_replicas))


def _check_rank(num_replicas: int, rank: int) -> None:
    # DistributedSampler's wording, plus what to pass instead.
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(
            f"Invalid num_replicas {num_replicas!r}, num_replicas should be a positive int "
            "(the number of ranks the data is split over)"
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or rank >= num_replicas or rank < 0:
        raise ValueError(
            f"Invalid rank {rank!r}, rank should be in the interval [0, {num_replicas - 1}] "
            f"(num_replicas={num_replicas}): pass this process's rank in a world of "
            "num_replicas ranks, or group= to read both from a process group"
        )


def _rank_and_world(
    num_replicas: int | None, rank: int | None, group: Any, who: str
) -> tuple[int, int]:
    """``(num_replicas, rank)`` from the arguments, a group, or torch.distributed."""
    if group is not None:
        if num_replicas is not None or rank is not None:
            raise ValueError(
                f"{who}: pass either group= or num_replicas=/rank=, not both (the group "
                "already says this process's rank and the world size)"
            )
        from joinkit.backends import resolve

        backend = resolve(group)
        num_replicas, rank = int(backend.world_size), int(backend.rank)
    if num_replicas is None or rank is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            missing = " and ".join(
                name for name, value in (("num_replicas", num_replicas), ("rank", rank))
                if value is None
            )
            raise RuntimeError(
                f"{who} was given no {missing} and torch.distributed is not initialised: "
                "call torch.distributed.init_process_group (or joinkit.backends.init_torch()) "
                "first, or pass num_replicas= and rank=, or group= (a joinkit group, a torch "
                "ProcessGroup or an mpi4py communicator)"
            )
        if num_replicas is None:
            num_replicas = dist.get_world_size()
        if rank is None:
            rank = dist.get_rank()
    _check_rank(num_replicas, rank)
    return num_replicas, rank


#: What ``take_over=True`` adds to a loss warning (``Join.note_rank_loss``) when the
#: sampler is iterated in a loop of its own, not over :meth:`ShardSampler.passes`:
#: the lost rank's remaining samples would be left untrained.
TAKE_OVER_PLAIN_LOOP = (
    "ShardSampler(take_over=True) gives a lost rank's remaining samples to the survivors "
    "only in the epoch's next pass, which a loop that iterates the sampler once never "
    "starts, so they are not trained this epoch: loop over sampler.passes() around the "
    "Join:\n"
    "    for _ in sampler.passes():\n"
    "        with Join([model], on_rank_loss=\"finish\"):\n"
    "            for batch in loader:\n"
    "                ...")
#: The same, for a sampler iterated inside :meth:`ShardSampler.passes`.
TAKE_OVER_NEXT_PASS = (
    "ShardSampler(take_over=True) gives them to the survivors in the next pass of "
    "sampler.passes().")


@attrs.frozen(kw_only=True)
class TakeOver:
    """A rank lost in a pass whose unconsumed inputs the survivors took over.

    Attributes:
        rank: the lost rank (original numbering, as ``LostRank.rank``).
        consumed: the dataset indices it consumed in that pass (those of its
            completed iterations), in order.
        moved: survivor (original rank) -> the dataset indices of the lost
            rank's that it reads in the next pass of the epoch, in order.
    """

    rank: int
    consumed: tuple[int, ...]
    moved: Mapping[int, tuple[int, ...]]


@attrs.define
class _Tracker:
    """How the current pass's consumption is counted: the Join it runs in."""

    join: Any = None  # the joinkit Join the pass runs in, once known
    mark: int = 0  # the Join's count of this rank's inputs when the pass began
    losses_before: int = 0  # the Join's lost ranks before the pass began
    # The Join's group numbers its lost ranks as it was built (LostRank.rank); the
    # pass's members are the sampler's numbers: the group's live ranks at the
    # pass's start, in order, are the members in order.
    numbering: dict[int, int] | None = None
    yielded: int = 0  # positions the iterator handed out (a DataLoader reads ahead)
    # Whether anything asked the iterator for an index: a loader may make one and
    # drop it unasked (torchdata's StatefulDataLoader makes two per epoch).
    started: bool = False

    def follow(self, join: Any, members: tuple[int, ...], report: Any = None) -> None:
        """Count this pass with ``join`` (its counts so far are not the pass's when
        ``report`` is given: the pass began now)."""
        self.join = join
        if report is not None:
            self.mark, self.losses_before = report.inputs, len(report.lost_ranks)
        backend = join.backend
        earlier = getattr(backend, "lost_ranks", None)
        lost = tuple(earlier()) if callable(earlier) else ()
        live = sorted(lost[-1].survivors) if lost else list(range(int(backend.world_size)))
        self.numbering = dict(zip(live, members, strict=True)) if len(live) == len(
            members) else None

    def lost(self, report: Any) -> dict[int, int]:
        """The pass's lost members (the sampler's numbers) -> the iterations each completed.

        Raises:
            ValueError: the Join's group is not the sampler's world (another size).
        """
        found = report.lost_ranks[self.losses_before:]
        if found and self.numbering is None:
            raise ValueError(
                "ShardSampler: a rank was lost in a Join whose group is not the sampler's "
                "world (its live ranks differ in number from the sampler's); build the "
                "sampler over the Join's group (group=...) or the same world")
        numbering = self.numbering or {}
        return {numbering[x.rank]: max(0, x.iterations - self.mark) for x in found
                if x.rank in numbering}


class ShardSampler(Sampler[int]):
    """DistributedSampler's order, minus the padding: each index exactly once.

    A drop-in for ``torch.utils.data.DistributedSampler``: the same arguments
    and defaults, ``set_epoch``, and for the same ``seed`` and epoch the same
    order, with the repeated samples left out. Rank ``r`` of ``W`` iterates
    ``perm[r::W]`` where ``perm`` is ``torch.randperm(len(dataset))`` drawn
    from a generator seeded with ``seed + epoch`` (``range(len(dataset))``
    without shuffling). Ranks below ``len(dataset) % W`` hold one index more
    than the others; a rank may hold none. Run the loop under ``joinkit.Join``
    so the ranks with fewer batches do not hang the others.

    Checkpoints (``batch_size=`` given): :meth:`state_dict` says what every
    rank has consumed, counted from the Join's iterations (one batch each),
    and :meth:`load_state_dict` on any world size yields exactly the rest.
    With ``take_over=True`` in ``Join(..., on_rank_loss="finish")`` a rank
    that dies leaves its unconsumed inputs to the survivors: the epoch's
    next pass (:meth:`passes`) gives them to them.

    Args:
        dataset: a map-style dataset (anything with ``len``).
        num_replicas: the number of ranks; default: torch.distributed's world
            size (or the group's).
        rank: this process's rank; default: torch.distributed's rank (or the
            group's).
        shuffle: shuffle the indices, DistributedSampler's way.
        seed: the shuffle's seed; must be the same on every rank.
        drop_last: must be ``False`` (refused: this sampler never drops).
        group: instead of ``num_replicas``/``rank``, a joinkit group, a torch
            ``ProcessGroup`` or an mpi4py communicator to read them from
            (its rank in that group), e.g. ``MPI.COMM_WORLD`` under mpirun.
        batch_size: the DataLoader's batch size: one batch per iteration of
            the Join. Needed by :meth:`state_dict` and ``take_over``.
        take_over: after a pass in which ranks died (``on_rank_loss="finish"``),
            the epoch's next pass divides their unconsumed inputs over the
            survivors: loop over :meth:`passes` around the Join. Each loss
            warning says where those inputs go, or, in a loop that iterates
            the sampler once, that they are not trained and the loop to use.

    Raises:
        ValueError: ``drop_last=True``; a rank outside ``[0, num_replicas)``;
            ``num_replicas < 1``; ``group=`` together with ``num_replicas=``
            or ``rank=``; ``batch_size`` not a positive int; ``take_over``
            without ``batch_size``.
        RuntimeError: ``num_replicas`` or ``rank`` missing while
            torch.distributed is not initialised and no group was given.
        TypeError: ``group`` is of a kind no joinkit backend handles.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        group: Any = None,
        batch_size: int | None = None,
        take_over: bool = False,
    ) -> None:
        if drop_last:
            raise ValueError(
                "ShardSampler(drop_last=True): ShardSampler never drops a sample (each index "
                "is read exactly once per epoch, the shards differing by at most one; run the "
                "loop under joinkit.Join for the uneven shards). To drop an incomplete last "
                "batch pass drop_last=True to the DataLoader; to drop samples until every "
                "rank holds the same number use torch.utils.data.DistributedSampler("
                "drop_last=True)"
            )
        if batch_size is not None and (isinstance(batch_size, bool)
                                       or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"ShardSampler(batch_size={batch_size!r}): pass the DataLoader's "
                             "batch size, a positive int")
        if take_over and batch_size is None:
            raise ValueError(
                "ShardSampler(take_over=True) needs batch_size= (the DataLoader's): it counts "
                "a lost rank's consumed inputs as its completed iterations times the batch size")
        self.num_replicas, self.rank = _rank_and_world(
            num_replicas, rank, group, "ShardSampler"
        )
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = False
        self.batch_size = batch_size
        self.take_over = bool(take_over)
        self.epoch = 0
        self._pass = _progress.Pass(pending=_all(len(dataset)),
                                    members=tuple(range(self.num_replicas)))
        self._tracker: _Tracker | None = None  # set while a pass is (or was) iterated
        self._take_overs: list[TakeOver] = []
        # Whether a passes() generator is running: a loss warning says where the
        # lost rank's samples go, or that the loop must use passes().
        self._in_passes = False
        # The loaded state's pass (pending, members, skip): a StatefulDataLoader
        # restores its position in it (_resume_pass).
        self._loaded: tuple[np.ndarray, tuple[int, ...], int] | None = None

    @property
    def total_size(self) -> int:
        """The number of indices over all ranks: ``len(dataset)``, no padding."""
        return len(self.dataset)

    @property
    def num_samples(self) -> int:
        """The number of indices this rank iterates (``len(self)``)."""
        return len(self)

    @property
    def world(self) -> tuple[int, ...]:
        """The ranks the next (or current) pass is divided over, in their original
        numbering: ``range(num_replicas)`` until a rank is lost in a Join with
        ``on_rank_loss="finish"``, the survivors after."""
        return self._upcoming()[0].members

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (call it before each epoch's loop, on every rank).

        Setting the epoch the sampler is already in keeps what it consumed
        (a sampler loaded from a state is in the state's epoch). After a rank
        was lost, the new epoch is divided over the survivors.

        Args:
            epoch: the epoch number; the order is drawn from ``seed + epoch``.
        """
        if epoch == self.epoch:
            return
        members = self._upcoming()[0].members
        self.epoch = epoch
        self._pass = _progress.Pass(pending=_all(len(self.dataset)), members=members)
        self._tracker = None
        self._take_overs = []

    def _order(self, epoch: int | None = None) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        generator = torch.Generator()
        generator.manual_seed(self.seed + (self.epoch if epoch is None else epoch))
        return torch.randperm(n, generator=generator).numpy().astype(np.int64)

    def __iter__(self) -> Iterator[int]:
        join = _current_join()
        if self.take_over and (join is None or join.on_rank_loss != "finish"):
            where = "outside any Join" if join is None else (
                f"inside a Join with on_rank_loss={join.on_rank_loss!r}")
            raise ValueError(
                f"ShardSampler(take_over=True) is iterated {where}: survivors take over a "
                "lost rank's inputs only in Join(..., on_rank_loss='finish') (docs/resume.md); "
                "iterate the DataLoader inside such a Join, or drop take_over=True")
        upcoming, take_overs = self._upcoming()
        self._take_overs += take_overs
        self._pass = upcoming
        tracker = _Tracker()
        if join is not None:
            tracker.follow(join, upcoming.members, report=join.report)
            if self.take_over:
                join.note_rank_loss(TAKE_OVER_NEXT_PASS if self._in_passes
                                    else TAKE_OVER_PLAIN_LOOP)
        self._tracker = tracker
        order = self._order()
        return _PassIterator(self, order[upcoming.share(self.rank)] if self.rank in
                             upcoming.members else order[:0], tracker)

    def __len__(self) -> int:
        upcoming = self._pass if self._tracker is not None else self._upcoming()[0]
        if self.rank not in upcoming.members:
            return 0
        return len(upcoming.share(self.rank))

    # -- progress -------------------------------------------------------------------------

    def _count(self) -> tuple[int, dict[int, int]]:
        """The current pass's completed rounds and its lost members' iterations."""
        tracker = self._tracker
        assert tracker is not None
        join = tracker.join
        if join is None:
            join = _current_join()
            if join is None:
                if tracker.yielded == 0:
                    return 0, {}
                raise ValueError(
                    "ShardSampler.state_dict() counts what the loop consumed from the Join's "
                    "iterations, but this pass was iterated outside any joinkit Join: run the "
                    "loop inside `with Join([...]):` (one batch per iteration) and call "
                    "state_dict() in it, between iterations, or after it")
            tracker.follow(join, self._pass.members)
        report = join.report
        if report is None:
            raise ValueError("ShardSampler.state_dict(): the pass ran in a Join with "
                             "enable=False, which counts nothing; use an enabled Join")
        if join is _current_join() and report.outcome == "unfinished":
            rounds = report.inputs - tracker.mark  # in the loop body: lockstep
        elif report.outcome == "joined":
            rounds = report.inputs + report.shadow_rounds - tracker.mark
        else:
            raise ValueError(
                f"ShardSampler.state_dict(): the Join of this pass ended {report.outcome} "
                f"({report.failure or 'a peer failed'}): what the ranks consumed is not known "
                "alike on every rank; take the state from the last checkpoint before it")
        return max(0, rounds), tracker.lost(report)

    def _consumed(self) -> tuple[dict[int, int], dict[int, int]]:
        """(member -> positions consumed, lost member -> iterations) of the current pass."""
        if self._tracker is None:
            return {m: 0 for m in self._pass.members}, {}
        rounds, lost = self._count()
        lost = {r: n for r, n in lost.items() if r in self._pass.members}
        if lost and self.batch_size is None:
            raise ValueError("ShardSampler(batch_size=None) cannot count a lost rank's inputs: "
                             "pass the DataLoader's batch_size= to the sampler")
        return self._pass.consumed(self.batch_size or 1, rounds, lost), lost

    def _lost(self) -> dict[int, int]:
        """The current pass's members lost so far -> the iterations each completed in it."""
        tracker = self._tracker
        if tracker is None:
            return {}
        if tracker.join is None:
            join = _current_join()
            if join is None:
                return {}
            tracker.follow(join, self._pass.members)
        report = tracker.join.report
        if report is None:
            return {}
        return {r: n for r, n in tracker.lost(report).items() if r in self._pass.members}

    def _upcoming(self) -> tuple[_progress.Pass, list[TakeOver]]:
        """The pass the next ``__iter__`` starts, and the take-overs it carries out."""
        if self._tracker is None or not self._tracker.started:
            return self._pass, []  # never begun: the same pass again
        lost = self._lost()
        members = tuple(m for m in self._pass.members if m not in lost) or self._pass.members
        if not (self.take_over and lost):
            # A new pass of the epoch starts over (as DistributedSampler's would).
            return _progress.Pass(pending=_all(len(self.dataset)), members=members), []
        consumed, lost = self._consumed()
        left = self._pass.left(consumed)
        leftovers = self._pass.leftovers(consumed, sorted(lost))
        if not any(len(v) for v in leftovers.values()):
            return _progress.Pass(pending=_all(len(self.dataset)), members=members), []
        upcoming = _progress.Pass(pending=left, members=members)
        order = self._order()
        moved = _progress.assign(left, members, leftovers)
        take_overs = [
            TakeOver(rank=rank,
                     consumed=tuple(order[self._pass.share(rank)[:consumed[rank]]].tolist()),
                     moved={m: tuple(order[p].tolist()) for m, p in moved[rank].items()})
            for rank in sorted(leftovers) if len(leftovers[rank])]
        return upcoming, take_overs

    @property
    def take_overs(self) -> tuple[TakeOver, ...]:
        """This epoch's take-overs: each lost rank's consumed inputs and which
        survivor reads each of the rest (including those of the pass just run,
        before the next pass starts). The same on every rank."""
        return tuple(self._take_overs) + tuple(self._upcoming()[1])

    def passes(self) -> Iterator[int]:
        """The passes of this epoch: loop over it around the Join (outside it).

        Yields ``0``, then once more (``1``, ``2``, ...) after each pass in
        which ranks died and ``take_over=True`` has inputs of theirs for the
        survivors; the same on every rank::

            for _ in sampler.passes():
                with Join([model], on_rank_loss="finish"):
                    for batch in loader:
                        ...

        Yields:
            The number of the pass.
        """
        number = 0
        self._in_passes = True
        try:
            yield number
            while self._tracker is not None:
                upcoming, take_overs = self._upcoming()
                if not take_overs:
                    return
                number += 1
                yield number
        finally:
            self._in_passes = False

    def remaining(self) -> int:
        """How many samples of this epoch are not consumed yet (all ranks; the same on
        every rank, counted as :meth:`state_dict` counts)."""
        if self._tracker is None:
            return len(self._pass.pending)
        consumed, _ = self._consumed()
        return len(self._pass.left(consumed))

    def skip_rounds(self, count: int = 1) -> None:
        """Count ``count`` rounds of the current pass's Join as taking no batch.

        ``state_dict`` counts one batch per round of the Join. A loop whose model
        makes every forward a round (an FSDP model's joinable: each forward is a
        step check, which a joined rank shadows) and runs forwards without a batch
        of this sampler inside the pass (an evaluation in the middle of an epoch)
        calls it on every rank alike, once per such round, so that ``state_dict``
        counts the training iterations only.

        Args:
            count: the rounds without a batch (0 or more).

        Raises:
            ValueError: ``count`` is negative.
        """
        if count < 0:
            raise ValueError(f"ShardSampler.skip_rounds(count): count must be >= 0, not {count}")
        if self._tracker is not None:
            self._tracker.mark += count

    def state_dict(self) -> dict[str, Any]:
        """What the epoch has consumed, on every rank alike (no collective).

        Call it on every rank at the same point of the loop: between two
        iterations inside the Join (after the optimizer's step, before the
        next batch's forward), or outside it (after the Join, before
        ``set_epoch``). Each iteration consumes one batch of ``batch_size``
        on every rank still in its loop: the count is the Join's (this rank's
        iterations, its shadow rounds after the Join, and the iterations each
        lost rank completed), not what the DataLoader read ahead.

        Returns:
            A dict of plain values (ints, strings, lists): the format, the
            dataset's length, ``shuffle``, ``seed``, ``epoch``, a digest of the
            epoch's order, the unconsumed positions of that order as runs
            (``remaining``), the world and what each of its ranks consumed.

        Raises:
            ValueError: no ``batch_size``; the pass was iterated outside any
                Join; its Join ended with an error (the consumption is not
                known alike on every rank).
        """
        if self.batch_size is None and self._tracker is not None and self._tracker.yielded:
            raise ValueError(
                "ShardSampler.state_dict() needs batch_size= (the DataLoader's): it counts "
                "consumed inputs as the loop's iterations times the batch size; build the "
                "sampler as ShardSampler(dataset, ..., batch_size=b)")
        consumed, lost = self._consumed()
        left = self._pass.left(consumed)
        order = self._order()
        return {
            "format": _progress.STATE_FORMAT,
            "version": _progress.STATE_VERSION,
            "dataset_length": len(self.dataset),
            "shuffle": bool(self.shuffle),
            "seed": int(self.seed),
            "epoch": int(self.epoch),
            "order": _progress.order_digest(order),
            "remaining": _progress.to_runs(left),
            "world": list(self._pass.members),
            "consumed": [[m, int(consumed[m])] for m in self._pass.members],
            "lost": sorted(lost),
            "batch_size": self.batch_size,
            "pass": {"pending": _progress.to_runs(self._pass.pending),
                     "skip": self._pass.skip},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`'s state, on any world size.

        The next pass divides the state's unconsumed samples over this
        sampler's ranks (``num_replicas``), as a fresh epoch would divide all
        of them; the epoch becomes the state's.

        Args:
            state: a state from :meth:`state_dict` (of any rank: they are alike).

        Raises:
            ValueError: the state is not a ShardSampler's, or it is of a dataset
                of another length, of another ``seed`` or ``shuffle``, or its
                epoch's order differs from the one this sampler draws (another
                generator or torch version): the message names the difference.
        """
        pending, loaded = self._check_state(state)
        self.epoch = int(state["epoch"])
        self._pass = _progress.Pass(pending=pending, members=tuple(range(self.num_replicas)))
        self._tracker = None
        self._take_overs = []
        self._loaded = loaded

    def _check_state(self, state: Mapping[str, Any]
                     ) -> tuple[np.ndarray, tuple[np.ndarray, tuple[int, ...], int] | None]:
        if not isinstance(state, Mapping) or state.get("format") != _progress.STATE_FORMAT:
            got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"ShardSampler.load_state_dict: not a ShardSampler state (format "
                             f"{got!r}; expected {_progress.STATE_FORMAT!r})")
        if state.get("version") != _progress.STATE_VERSION:
            raise ValueError(f"ShardSampler.load_state_dict: state version "
                             f"{state.get('version')!r}; this joinkit reads version "
                             f"{_progress.STATE_VERSION}")
        n = len(self.dataset)
        differences = []
        if state.get("dataset_length") != n:
            differences.append(f"the dataset's length: {state.get('dataset_length')} in the "
                               f"state, {n} here (a state of another dataset)")
        if state.get("shuffle") != bool(self.shuffle):
            differences.append(f"shuffle: {state.get('shuffle')} in the state, "
                               f"{bool(self.shuffle)} here")
        if state.get("seed") != self.seed:
            differences.append(f"seed: {state.get('seed')} in the state, {self.seed} here")
        epoch = state.get("epoch")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            differences.append(f"epoch: {epoch!r} is not an epoch number")
        if differences:
            raise ValueError("ShardSampler.load_state_dict: the state does not fit this "
                             "sampler: " + "; ".join(differences) + ". Load it into a "
                             "ShardSampler over the same dataset with the same seed and "
                             "shuffle (any world size)")
        order = self._order(epoch)
        digest = _progress.order_digest(order)
        if state.get("order") != digest:
            raise ValueError(
                f"ShardSampler.load_state_dict: the order of epoch {epoch} differs: the "
                f"state's is {state.get('order')!r}, this sampler draws {digest!r} from seed "
                f"{self.seed} + epoch {epoch} (torch.randperm of another torch version or "
                "generator): resuming would not continue the same order")
        pending = _progress.from_runs(state.get("remaining"), n)
        loaded = None
        current = state.get("pass")
        world = state.get("world")
        if isinstance(current, Mapping) and isinstance(world, list):
            skip = current.get("skip", 0)
            loaded = (_progress.from_runs(current.get("pending"), n),
                      tuple(int(r) for r in world), int(skip))
        return pending, loaded

    def _resume_pass(self, iterator: _PassIterator, state: Mapping[str, Any]) -> None:
        """A StatefulDataLoader restores its sampler iterator: the pass of its checkpoint.

        Raises:
            ValueError: the checkpoint is of another world (a StatefulDataLoader's
                own state is per rank; another world size needs the sampler's
                state_dict, which any world can load).
        """
        loaded = self._loaded
        if loaded is None:
            raise ValueError("ShardSampler: a pass position was restored without the sampler's "
                             "state (StatefulDataLoader loads the sampler's state first)")
        pending, members, skip = loaded
        world = tuple(state.get("world", ()))
        if members != tuple(range(self.num_replicas)) or world != members:
            raise ValueError(
                f"a StatefulDataLoader checkpoint of a ShardSampler resumes only on the world it "
                f"was taken on (ranks {list(members)}); this sampler has num_replicas="
                f"{self.num_replicas}. To resume on another world size, save "
                "sampler.state_dict() (taken in the loop) beside the loader's and load that "
                "into the sampler (docs/resume.md)")
        yielded = int(state.get("yielded", 0))
        batch = self.batch_size or 1
        self._pass = _progress.Pass(pending=pending, members=members,
                                    skip=skip + -(-yielded // batch))
        share = self._pass.share(self.rank)
        start = min(self._pass.skip * batch, len(share))
        iterator._indices = self._order()[share[start:]].tolist()
        iterator._tracker.yielded = 0


class _PassIterator(Iterator[int]):
    """One pass's indices for this rank; counts what it hands out.

    Stateful for torchdata's StatefulDataLoader (``state_dict`` /
    ``load_state_dict``): its own state is the pass's position, valid on the
    world it was taken on only.
    """

    def __init__(self, sampler: ShardSampler, indices: np.ndarray, tracker: _Tracker) -> None:
        self._sampler = sampler
        self._indices = indices.tolist()
        self._tracker = tracker

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        tracker = self._tracker
        tracker.started = True
        if tracker.yielded >= len(self._indices):
            raise StopIteration
        index = self._indices[tracker.yielded]
        tracker.yielded += 1
        return int(index)

    def state_dict(self) -> dict[str, Any]:
        """This rank's position in the pass (StatefulDataLoader's own checkpoints)."""
        return {"yielded": self._tracker.yielded, "world": list(self._sampler._pass.members)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a StatefulDataLoader's checkpoint, on the world it was taken on."""
        self._sampler._resume_pass(self, state)


def _all(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def _current_join() -> Any:
    from joinkit import Join

    return Join.current()


class ShardedIterable(IterableDataset[Any]):
    """A stream split over rank x DataLoader worker: each element read once.

    Every DataLoader worker of every rank is one *reader*; reader ``worker * W
    + rank`` of ``W * num_workers`` keeps the elements whose position in the
    stream is congruent to its index. So rank ``r`` holds elements ``r, r + W,
    ...`` (as ``ShardSampler(shuffle=False)``; counts differ by at most one
    between ranks), whatever ``num_workers``, and within a rank each is read by
    exactly one worker. Every reader iterates the whole ``source`` and skips
    what is not its own, so a costly stream should be a list of *shards*
    given with ``expand=``: then each reader opens only its own shards.

    A map-style ``source`` (``len`` and ``__getitem__``, not a torch
    ``IterableDataset``) is indexed, so a reader loads only its own elements.

    Args:
        source: an iterable that can be iterated again (in each worker and
            epoch): a list, a map-style dataset, a torch or Hugging Face
            iterable dataset; not a one-shot iterator such as a generator.
        num_replicas: the number of ranks; default as :class:`ShardSampler`.
        rank: this process's rank; default as :class:`ShardSampler`.
        group: as :class:`ShardSampler`'s.
        expand: turns one of this reader's items into the elements it holds
            (for a webdataset-style list of shard paths: a path into the
            samples of that tar file); ``None`` yields the items themselves.

    Raises:
        TypeError: ``source`` is a one-shot iterator, or ``group`` is of a
            kind no joinkit backend handles.
        ValueError: a rank outside ``[0, num_replicas)``, ``num_replicas <
            1``, or ``group=`` together with ``num_replicas=``/``rank=``.
        RuntimeError: ``num_replicas`` or ``rank`` missing while
            torch.distributed is not initialised and no group was given.
    """

    def __init__(
        self,
        source: Iterable[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        *,
        group: Any = None,
        expand: Callable[[Any], Iterable[Any]] | None = None,
    ) -> None:
        if isinstance(source, Iterator):
            raise TypeError(
                f"ShardedIterable needs a source it can iterate again, in every DataLoader "
                f"worker and every epoch; a {type(source).__name__} is a one-shot iterator. "
                "Pass a list (e.g. list(...) of it, or of its shard paths with expand=), a "
                "dataset, or an object whose __iter__ starts a new iterator"
            )
        self.num_replicas, self.rank = _rank_and_world(
            num_replicas, rank, group, "ShardedIterable"
        )
        self.source = source
        self.expand = expand

    def reader(self) -> tuple[int, int]:
        """``(index, count)`` of the reader that calls it (this worker of this rank).

        Returns:
            ``worker_id * num_replicas + rank`` and ``num_workers *
            num_replicas``, from ``torch.utils.data.get_worker_info()`` (a
            main-process DataLoader, or a plain loop, is one worker).
        """
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return worker * self.num_replicas + self.rank, workers * self.num_replicas

    def _own_items(self) -> Iterator[Any]:
        index, count = self.reader()
        source: Any = self.source
        if (
            not isinstance(source, IterableDataset)
            and isinstance(source, Sized)
            and hasattr(source, "__getitem__")
        ):
            return (source[i] for i in range(index, len(source), count))
        return itertools.islice(source, index, None, count)

    def __iter__(self) -> Iterator[Any]:
        items = self._own_items()
        if self.expand is None:
            return items
        return itertools.chain.from_iterable(map(self.expand, items))

    def __len__(self) -> int:
        """The number of elements this rank yields (over all its workers).

        Raises:
            TypeError: with ``expand=`` or an unsized source (the number is
                not known before reading).
        """
        if self.expand is not None or not isinstance(self.source, Sized):
            raise TypeError(
                "this ShardedIterable has no len(): its source has none, or expand= makes "
                "the number of elements unknown until the shards are read"
            )
        return shard_size(len(self.source), self.num_replicas, self.rank)
