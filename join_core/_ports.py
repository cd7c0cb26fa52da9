"""The ports the core owns: the join backend protocol and the two registries.

Theory of operation
-------------------
The shell (``Join``) needs two things from outside the core, and the core
defines both as ports that plug-ins fill, so that every import arrow points
into the core and none out of it:

- a *join backend* for the joinables' process group (:class:`JoinBackend`),
  found by :func:`resolve` in the *backend registry*;
- a *framework adapter* for objects that are not joinkit ``Joinable`` but stand
  for one (torch's DDP and ZeroRedundancyOptimizer), found by :func:`adapt` in
  the *adapter registry*; an adapter may also check the whole joinable list of
  a Join (``Join([zero, ddp])`` is refused that way).

Both registries are filled two ways. In code: :func:`register` and
:func:`register_adapter`, later registrations first. And through entry points,
read once, after every in-code registration: the group ``joinkit.backends``
names resolvers ``resolver(process_group, device) -> JoinBackend | None``, and
the group ``joinkit.adapters`` names :class:`Adapter` values. joinkit's own
backends and adapters come in through those same groups (declared in its
``pyproject.toml``); each entry loads only a small module that imports the
heavy one (torch, mpi4py) once that library is already in use, so resolving
never imports a framework by itself.

*Rank loss.* With ``Join(..., on_rank_loss="finish")`` the shell calls the
backend's optional ``start_rank_loss_recovery(config)`` once on entry, before
any collective, with a :class:`RankLossConfig`; a backend without it (or one
that raises from it: MPI without ULFM, nccl, threads) cannot rebuild its group
after a death, and the Join refuses to start. A backend that can then repairs
its own collectives when a rank dies (sequence them, rebuild the group over
the survivors, agree on the last completed one, hand its result to those that
lack it) and keeps ``lost_ranks()``, every :class:`~joinkit.LostRank` so far,
which the shell polls after each heartbeat and at the end
(:func:`lost_ranks`).

Standard library and attrs only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    from ._joinable import Joinable

__all__ = [
    "Handle",
    "JoinBackend",
    "BackendCapabilities",
    "capabilities",
    "SupportsHeartbeatTotal",
    "SupportsCollectiveCount",
    "SupportsAbort",
    "SupportsWait",
    "SupportsStatusBoard",
    "SupportsLivenessBeat",
    "SupportsGonePeers",
    "SupportsObjectCollectives",
    "SupportsRankLossRecovery",
    "Adapter",
    "BACKEND_ENTRY_POINTS",
    "ADAPTER_ENTRY_POINTS",
    "register",
    "resolve",
    "find_registered",
    "register_adapter",
    "adapt",
    "check_joinables",
    "all_agree",
    "gather_object",
    "all_gather_sparse",
    "RankLossConfig",
    "start_rank_loss_recovery",
    "lost_ranks",
]

BACKEND_ENTRY_POINTS = "joinkit.backends"
ADAPTER_ENTRY_POINTS = "joinkit.adapters"


@runtime_checkable
class Handle(Protocol):
    """An in-flight collective."""

    def wait(self) -> Any: ...


@runtime_checkable
class JoinBackend(Protocol):
    """What the Join shell needs from a collective library.

    The required members are below; the optional ones are the ``Supports...``
    protocols (heartbeat sums, a collective counter, abort, wait, the status
    board, gone peers, O(1) object collectives, rank-loss recovery), looked up
    once per Join into a :class:`BackendCapabilities`; docs/guide/writing-a-backend.md
    describes each.
    """

    rank: int
    world_size: int

    def heartbeat(self, value: float) -> Handle:
        """Start a 1-element SUM all-reduce contributing ``value``."""
        ...

    def count(self, value: float) -> float:
        """1-element SUM all-reduce contributing ``value``; return the sum."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (blocking)."""
        ...


# -- the optional members, as types ----------------------------------------------
#
# A backend offers any subset of these beside the required JoinBackend members;
# each makes the Join better where it can (docs/guide/writing-a-backend.md says
# how). They are looked up once, when a Join is built (:func:`capabilities`):
# the shell reads a BackendCapabilities value, never the backend's attributes.


@runtime_checkable
class SupportsHeartbeatTotal(Protocol):
    """Read a heartbeat's sum: an active rank learns of a failed peer at its next notify."""

    def heartbeat_total(self, handle: Handle) -> float: ...


@runtime_checkable
class SupportsCollectiveCount(Protocol):
    """Count the group's own collectives (not heartbeats or counts), so that a
    failure right after a heartbeat is told from one later in the iteration."""

    collectives_issued: int


@runtime_checkable
class SupportsAbort(Protocol):
    """Make the peers' pending and future collectives fail; ``aborted`` is
    ``(rank, reason)`` of an abort this rank knows of (no I/O), or ``None``."""

    def abort(self, message: str) -> None: ...


@runtime_checkable
class SupportsWait(Protocol):
    """Wait for a handle the backend's own way (e.g. in slices, giving up on an abort)."""

    def wait(self, handle: Handle) -> Any: ...


@runtime_checkable
class SupportsStatusBoard(Protocol):
    """The status board: what each rank's Join is doing, read by the peers.

    ``post_status`` is called on entry, per join collective and on exit (keep
    it cheap); ``peer_status`` and ``peer_board`` (rank -> (status, its age,
    latest beat)) are read out of band by the watchdog thread: without
    ``peer_board`` the default timeout is a hard limit.
    """

    def post_status(self, what: str) -> None: ...

    def peer_status(self) -> dict[int, str]: ...

    def peer_board(
        self, ranks: Sequence[int]
    ) -> dict[int, tuple[str, float, int | None]]: ...


@runtime_checkable
class SupportsLivenessBeat(Protocol):
    """Show the peers this rank is alive: the watchdog thread calls ``post_beat``
    every tenth of the timeout (no I/O on the caller's thread; a background
    one publishes), and the peers read the beat in ``peer_board``."""

    def post_beat(self) -> None: ...


@runtime_checkable
class SupportsGonePeers(Protocol):
    """rank -> e.g. ``"pid 4242 on node0"`` for the peers whose process no longer
    runs; asked once when an error leaves the Join (about a second; never raises)."""

    def gone_peers(self) -> dict[int, str]: ...


@runtime_checkable
class SupportsObjectCollectives(Protocol):
    """Object collectives that cost a rank O(1) instead of ``all_gather_object``'s
    O(world size): the entry check, reports and the failure exchange."""

    def all_agree(self, value: int) -> bool: ...

    def gather_object(self, obj: Any, dst: int) -> list[Any] | None: ...

    def broadcast_object(self, obj: Any, src: int) -> Any: ...


@runtime_checkable
class SupportsRankLossRecovery(Protocol):
    """Rebuild the group after a rank dies (``Join(on_rank_loss="finish")``)."""

    def start_rank_loss_recovery(self, config: RankLossConfig) -> None: ...

    def lost_ranks(self) -> tuple[Any, ...]: ...


@runtime_checkable
class SupportsSideWire(Protocol):
    """A second communicator over the same ranks, for a ``joinkit.SideChannel``.

    ``side_wire()`` is called on every rank at once (on Join entry, so it may be
    collective) and returns the same wire on later calls; the wire follows
    ``joinkit.lowlevel.SideWire`` (``backends._side_wire.ArrayWire`` is one over
    any group with array collectives).
    """

    def side_wire(self) -> Any: ...


@attrs.frozen(kw_only=True)
class BackendCapabilities:
    """What a join backend offers beyond the required members, looked up once.

    Built by :func:`capabilities` when a Join is built; every optional member
    the shell uses is a field here (the bound method, or ``None`` where the
    backend lacks it), so the shell never probes a backend. The protocols
    ``Supports...`` above say what each member must do.

    Attributes:
        heartbeat_total: the bound method (:class:`SupportsHeartbeatTotal`) or ``None``.
        abort: the bound method (:class:`SupportsAbort`) or ``None``.
        wait: the bound method (:class:`SupportsWait`) or ``None``.
        post_status: the bound method (:class:`SupportsStatusBoard`) or ``None``.
        peer_status: the bound method (:class:`SupportsStatusBoard`) or ``None``.
        post_beat: the bound method (:class:`SupportsLivenessBeat`) or ``None``.
        peer_board: the bound method (:class:`SupportsStatusBoard`) or ``None``.
        gone_peers: the bound method (:class:`SupportsGonePeers`) or ``None``.
        all_agree: the bound method (:class:`SupportsObjectCollectives`) or ``None``.
        gather_object: the bound method (:class:`SupportsObjectCollectives`) or ``None``.
        broadcast_object: the bound method (:class:`SupportsObjectCollectives`) or ``None``.
        start_rank_loss_recovery: the bound method (:class:`SupportsRankLossRecovery`) or ``None``.
        lost_ranks: the bound method (:class:`SupportsRankLossRecovery`) or ``None``.
        side_wire: the bound method (:class:`SupportsSideWire`) or ``None``.
        counts_collectives: it has ``collectives_issued``.
        knows_aborts: it has ``aborted`` (read by the watchdog thread).
    """

    heartbeat_total: Callable[[Any], float] | None = None
    counts_collectives: bool = False
    abort: Callable[[str], None] | None = None
    knows_aborts: bool = False
    wait: Callable[[Any], Any] | None = None
    post_status: Callable[[str], None] | None = None
    peer_status: Callable[[], dict[int, str]] | None = None
    post_beat: Callable[[], None] | None = None
    peer_board: Callable[..., Any] | None = None
    gone_peers: Callable[[], dict[int, str]] | None = None
    all_agree: Callable[[int], bool] | None = None
    gather_object: Callable[[Any, int], Any] | None = None
    broadcast_object: Callable[[Any, int], Any] | None = None
    start_rank_loss_recovery: Callable[[Any], None] | None = None
    lost_ranks: Callable[[], tuple[Any, ...]] | None = None
    side_wire: Callable[[], Any] | None = None


_METHODS = tuple(
    field.name for field in attrs.fields(BackendCapabilities)
    if field.name not in ("counts_collectives", "knows_aborts")
)


def capabilities(backend: JoinBackend) -> BackendCapabilities:
    """Look up the optional members ``backend`` offers (once per Join).

    Args:
        backend: a join backend.

    Returns:
        Its :class:`BackendCapabilities`.
    """
    found = {name: getattr(backend, name, None) for name in _METHODS}
    return BackendCapabilities(
        counts_collectives=hasattr(backend, "collectives_issued"),
        knows_aborts=hasattr(backend, "aborted"),
        **found,
    )


@attrs.frozen(kw_only=True)
class RankLossConfig:
    """What a Join gives its backend's ``start_rank_loss_recovery``.

    Attributes:
        progress: call it (from the thread running the recovery) at every step
            of a recovery: the Join's watchdog then sees progress and does not
            take a recovery that repeats for a stall. Cheap (an increment).
        world_size: the group's size when the Join was built.
        rank: this rank in that group (its original rank).
    """

    progress: Callable[[], None]
    world_size: int
    rank: int


def start_rank_loss_recovery(backend: JoinBackend, caps: BackendCapabilities,
                             config: RankLossConfig) -> None:
    """Turn on the backend's recovery from a dead rank, or say why it cannot.

    Called on entering a Join with ``on_rank_loss="finish"``, before any
    collective, on every rank.

    Args:
        backend: the Join's backend.
        caps: its capabilities.
        config: what the backend needs (:class:`RankLossConfig`).

    Raises:
        ValueError: the backend has no ``start_rank_loss_recovery``: it cannot
            rebuild its group after a rank dies. A backend's own refusal (MPI
            without ULFM, say) propagates as it raised it.
    """
    start = caps.start_rank_loss_recovery
    if start is None:
        kind = type(backend)
        raise ValueError(
            f"Join(on_rank_loss='finish') needs a backend that can rebuild its group "
            f"after a rank dies, and {kind.__module__}.{kind.__qualname__} cannot (it "
            "has no start_rank_loss_recovery). What works: an MPIGroup under "
            "`mpirun --with-ft ulfm` (Open MPI 5 with ULFM), or a gloo TorchGroup "
            "under a launcher that keeps the survivors (docs/elastic.md); otherwise "
            "use on_rank_loss='raise' (the default), which ends the Join promptly "
            "naming the dead rank"
        )
    start(config)


def lost_ranks(caps: BackendCapabilities) -> Callable[[], tuple[Any, ...]]:
    """The backend's ``lost_ranks`` method (after a successful
    :func:`start_rank_loss_recovery`).

    Returns:
        A callable giving every ``LostRank`` so far, in order of loss; one that
        gives ``()`` where the backend keeps none.
    """
    return tuple if caps.lost_ranks is None else caps.lost_ranks


Factory = Callable[[Any, Any], JoinBackend]
Resolver = Callable[[Any, Any], "JoinBackend | None"]
Kind = type | Callable[[Any], bool]


@attrs.frozen(kw_only=True)
class Adapter:
    """A bridge from one framework's objects to joinkit Joinables.

    Attributes:
        name: what the adapter bridges (for messages), e.g. ``"torch"``.
        matches: ``matches(obj) -> bool``: whether ``obj`` is one of the
            framework's joinables. It must not import the framework: an object
            of a framework that is not imported cannot exist.
        adapt: ``adapt(obj) -> Joinable``: the joinkit Joinable standing for it.
        check: ``check(joinables)``, optional: inspects a Join's whole list of
            joinables (adapted ones included) and raises ``ValueError`` for a
            combination the framework cannot shadow correctly.
    """

    name: str
    matches: Callable[[Any], bool]
    adapt: Callable[[Any], Joinable]
    check: Callable[[Sequence[Joinable]], None] | None = None


# (matcher, factory), newest first: matcher is a type (isinstance) or a predicate.
_registered: list[tuple[Kind, Factory]] = []
_adapters: list[Adapter] = []
_entry_point_resolvers: list[Resolver] | None = None
_entry_point_adapters: list[Adapter] | None = None


def register(kind: Kind, factory: Factory) -> None:
    """Teach the backend registry a new kind of process group.

    Args:
        kind: a type (groups that are instances of it match) or a predicate
            ``kind(process_group) -> bool``.
        factory: ``factory(process_group, device) -> JoinBackend``.

    Later registrations win over earlier ones, so a third party can override a
    built-in backend for its own subclass.
    """
    _registered.insert(0, (kind, factory))


def find_registered(process_group: Any, device: Any = None) -> JoinBackend | None:
    """The backend from in-code registrations only, or ``None``.

    For entry-point resolvers that import a module which registers itself.
    """
    for kind, factory in _registered:
        if isinstance(kind, type):
            if isinstance(process_group, kind):
                return factory(process_group, device)
        elif kind(process_group):
            return factory(process_group, device)
    return None


def resolve(process_group: Any, device: Any = None) -> JoinBackend:
    """Return the join backend for a joinable's process group and device.

    In-code registrations first (newest first), then the entry points of the
    ``joinkit.backends`` group in their installed order.

    Args:
        process_group: the joinable's ``join_process_group``.
        device: the joinable's ``join_device``.

    Returns:
        A :class:`JoinBackend`.

    Raises:
        TypeError: no registered backend handles this kind of process group.
    """
    backend = find_registered(process_group, device)
    if backend is not None:
        return backend
    for resolver in _backend_entry_points():
        backend = resolver(process_group, device)
        if backend is not None:
            return backend
    kind = type(process_group)
    raise TypeError(
        f"joinkit has no backend for a join_process_group of type "
        f"{kind.__module__}.{kind.__qualname__}. Use a torch.distributed "
        "ProcessGroup, an mpi4py communicator or a joinkit.backends.threads group, "
        "or register a backend for this type with "
        "joinkit.backends.register(kind, factory) or the 'joinkit.backends' entry "
        "point group."
    )


def register_adapter(adapter: Adapter) -> None:
    """Teach the adapter registry a framework's joinables (newest first).

    Args:
        adapter: the :class:`Adapter`.
    """
    _adapters.insert(0, adapter)


def adapt(obj: Any) -> Joinable | None:
    """The Joinable an adapter gives for ``obj``, or ``None`` if none matches."""
    for adapter in _all_adapters():
        if adapter.matches(obj):
            return adapter.adapt(obj)
    return None


def check_joinables(joinables: Sequence[Joinable]) -> None:
    """Run every adapter's check over a Join's joinables.

    Raises:
        ValueError: an adapter refuses the combination (its message says why).
    """
    for adapter in _all_adapters():
        if adapter.check is not None:
            adapter.check(joinables)


def _all_adapters() -> Iterable[Adapter]:
    global _entry_point_adapters
    yield from _adapters
    if _entry_point_adapters is None:
        loaded = [ep.load() for ep in entry_points(group=ADAPTER_ENTRY_POINTS)]
        for value in loaded:
            if not isinstance(value, Adapter):
                raise TypeError(
                    f"the {ADAPTER_ENTRY_POINTS!r} entry point gave {value!r}, not a "
                    "joinkit Adapter"
                )
        _entry_point_adapters = loaded
    yield from _entry_point_adapters


def _backend_entry_points() -> list[Resolver]:
    global _entry_point_resolvers
    if _entry_point_resolvers is None:
        _entry_point_resolvers = [
            ep.load() for ep in entry_points(group=BACKEND_ENTRY_POINTS)
        ]
    return _entry_point_resolvers


# -- the collectives with an optional fast path ---------------------------------------
#
# The Join's object collectives, through the backend's optional member where it
# has one (every rank of a group has the same backend, so all ranks take the
# same path), else through ``all_gather_object``, which every backend has but
# which costs every rank O(world size) bytes and unpickling.


def all_agree(backend: JoinBackend, caps: BackendCapabilities, value: int) -> bool:
    """Whether every rank passed the same ``value`` (a collective).

    Args:
        backend: the join backend.
        caps: its capabilities.
        value: an int in ``[0, 2**63)``.

    Returns:
        The same answer on every rank: the backend's ``all_agree(value)`` (one
        small all-reduce), else a comparison of all-gathered values.
    """
    agree = caps.all_agree
    if agree is not None:
        return bool(agree(value))
    values = backend.all_gather_object(value)
    return all(other == value for other in values)


def gather_object(backend: JoinBackend, caps: BackendCapabilities, obj: Any,
                  dst: int) -> list[Any] | None:
    """Every rank's picklable ``obj`` on rank ``dst`` only (a collective).

    Args:
        backend: the join backend.
        caps: its capabilities.
        obj: this rank's object.
        dst: the rank that receives them.

    Returns:
        The objects in rank order on ``dst``, ``None`` elsewhere: through the
        backend's ``gather_object(obj, dst)``, else its ``all_gather_object``.
    """
    gather = caps.gather_object
    if gather is not None:
        gathered = gather(obj, dst)
        return None if gathered is None else list(gathered)
    objects = backend.all_gather_object(obj)
    return list(objects) if backend.rank == dst else None


def all_gather_sparse(backend: JoinBackend, caps: BackendCapabilities, obj: Any) -> list[Any]:
    """The ranks' objects that are not ``None``, in rank order, on every rank.

    For values that few ranks have (failures): with the backend's
    ``gather_object`` and ``broadcast_object``, a gather to rank 0 and a
    broadcast of what it found, so a rank other than 0 handles O(objects
    found) bytes instead of O(world size); else an all-gather.

    Args:
        backend: the join backend.
        caps: its capabilities.
        obj: this rank's object, or ``None``.

    Returns:
        The objects that are not ``None``, in rank order.
    """
    gather, broadcast = caps.gather_object, caps.broadcast_object
    if gather is None or broadcast is None:
        return [o for o in backend.all_gather_object(obj) if o is not None]
    gathered = gather(obj, 0)
    found = None if gathered is None else [o for o in gathered if o is not None]
    return list(broadcast(found, 0))
