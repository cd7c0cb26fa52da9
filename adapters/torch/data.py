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
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

try:
    import torch
    from torch.utils.data import IterableDataset, Sampler, get_worker_info
except ModuleNotFoundError as exc:  # pragma: no cover - the no-torch environment
    raise ModuleNotFoundError(
        "joinkit.adapters.data needs torch, which could not be imported "
        f"({exc}). Please run: pip install 'joinkit[torch]'"
    ) from exc

__all__ = ["ShardSampler", "ShardedIterable", "shard_size"]


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

    Raises:
        ValueError: ``drop_last=True``; a rank outside ``[0, num_replicas)``;
            ``num_replicas < 1``; ``group=`` together with ``num_replicas=``
            or ``rank=``.
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
        self.num_replicas, self.rank = _rank_and_world(
            num_replicas, rank, group, "ShardSampler"
        )
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = False
        self.epoch = 0

    @property
    def total_size(self) -> int:
        """The number of indices over all ranks: ``len(dataset)``, no padding."""
        return len(self.dataset)

    @property
    def num_samples(self) -> int:
        """The number of indices this rank iterates (``len(self)``)."""
        return shard_size(len(self.dataset), self.num_replicas, self.rank)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (call it before each epoch's loop, on every rank).

        Args:
            epoch: the epoch number; the order is drawn from ``seed + epoch``.
        """
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order: list[int] = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        return iter(order[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


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
