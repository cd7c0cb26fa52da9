"""The joinable side of the API: ``Joinable``, ``JoinHook`` and ``JoinConfig``.

What an author of a joinable implements and reads, apart from the shell that
drives it (``_join``, the ``Join`` context manager, and its parts: ``_drive``,
the command executor, among them).
A joinable subclasses :class:`Joinable` (its hooks in a :class:`JoinHook`) and
reads its :class:`JoinConfig` (``self._join_config``), which the Join sets on
entry and resets to the disabled one on exit. The names, arguments and
defaults follow ``torch.distributed.algorithms.join``.

This module sits below the shell, which imports it: the Join a config names is
typed as :class:`JoinContext`, the Join as its joinables see it.

Standard library and attrs only.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import attrs

if TYPE_CHECKING:
    from ._machine import JoinState
    from ._reports import JoinReport

__all__ = ["Joinable", "JoinHook", "JoinConfig", "JoinContext"]


class JoinContext(Protocol):
    """The Join a joinable is inside, as the joinable sees it (``JoinConfig.join``).

    The public members of :class:`~joinkit.Join` that a joinable reads; the
    Join itself is what a config names.
    """

    @property
    def backend(self) -> Any: ...
    @property
    def joinables(self) -> tuple[Joinable, ...]: ...
    @property
    def process_group(self) -> Any: ...
    @property
    def device(self) -> Any: ...
    @property
    def heartbeat_handle(self) -> Any: ...
    @property
    def fuses_heartbeat(self) -> bool: ...
    @property
    def heartbeat(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def state(self) -> JoinState | None: ...
    @property
    def on_rank_loss(self) -> str: ...
    @property
    def report(self) -> JoinReport | None: ...
    def before_next_heartbeat(self, check: Callable[[], None]) -> bool: ...
    def gather_report(self, dst: int = 0) -> list[JoinReport] | None: ...


class JoinHook:
    """The two entry points a joinable gives the Join context manager.

    Subclass it and override what you need; both default to doing nothing.

    Attributes:
        main_hook_is_local: ``True`` declares that :meth:`main_hook` issues no
            collective on the Join's group (it only checks or updates this
            rank's own state). A joinable whose hook has no main hook of its
            own, or declares this, leaves the first joinable free to carry the
            heartbeat in its rounds (``Join.heartbeat == "round"``): a joined
            rank then meets only the first joinable's collectives. Declaring it
            for a main hook that does issue collectives desynchronises the
            ranks' collectives; the default, ``False``, is always safe.
    """

    main_hook_is_local: bool = False

    def main_hook(self) -> None:
        """Shadow the collectives of one training iteration on a joined rank.

        Called repeatedly while some rank has not joined yet.
        """

    def post_hook(self, is_last_joiner: bool) -> None:
        """Run once after every rank has joined.

        Args:
            is_last_joiner: ``True`` if this rank was one of the last to join.
        """

    def fused_shadow(self, heartbeat: float) -> float:
        """Shadow a fused joinable's first collective; return its heartbeat slot's sum.

        Only for joinables with ``join_fuses_heartbeat = True``: put ``heartbeat``
        in the heartbeat slot of the shadow. ``main_hook`` then shadows only the
        rest of the iteration.
        """
        raise NotImplementedError(
            f"{type(self).__qualname__} must implement fused_shadow(heartbeat) -> float"
        )


@attrs.frozen(kw_only=True)
class JoinConfig:
    """What a joinable reads (``joinable._join_config``) to know whether and how
    it is inside a Join.

    The Join sets one on each of its joinables on entry and the disabled one,
    ``JoinConfig()``, on exit; ``Joinable.__init__`` installs the disabled one.
    An adapter (a joinable standing for a framework object) may intercept the
    assignment to mirror it onto the object it wraps.

    Attributes:
        enable: whether the joinable is inside an enabled Join.
        throw_on_early_termination: the Join's throw mode.
        is_first_joinable: whether it is the Join's first joinable (the one
            whose notify sends the heartbeat).
        join: the Join it is inside, or ``None``.
    """

    enable: bool = False
    throw_on_early_termination: bool = False
    is_first_joinable: bool = False
    join: JoinContext | None = None


_DISABLED = JoinConfig()


class Joinable(abc.ABC):
    """Base class of objects that take part in a Join.

    A joinable implements :meth:`join_hook`, :attr:`join_device` and
    :attr:`join_process_group`, calls ``Joinable.__init__`` from its
    constructor (it installs a disabled join config) and calls
    :meth:`Join.notify_join_context` before its per-iteration collectives.

    A joinable may instead carry the heartbeat inside its own first collective
    of each iteration (a *fused heartbeat*, no extra collective): set
    ``join_fuses_heartbeat = True``, add one element to that collective holding
    :meth:`Join.fused_heartbeat`'s value (a float32-exact slot), optionally hand
    the slot's sum to :meth:`Join.record_heartbeat_total`, and give the hook a
    ``fused_shadow(heartbeat) -> float``.

    *A heartbeat in a round.* A fused joinable whose collectives come in
    *rounds* (the collectives of one synchronising step, which an active rank
    may issue after several inputs or after none, e.g. DDP's gradient
    all-reduce under ``no_sync()`` accumulation or a forward without a
    backward) may carry the heartbeat in every collective of its rounds and
    send nothing per input: set ``join_heartbeat_in_round = True`` too. Its
    notify calls :meth:`Join.fused_heartbeat` (which counts the input) and
    keeps the value for its next round; every collective of the round
    carries it in one more element. A joined rank's round is the same
    collectives from zeros: the hook's ``fused_shadow(heartbeat)`` issues the
    round's first collective and returns its heartbeat sum, ``main_hook`` the
    rest; when every rank has joined they all issue that first collective,
    read a sum with nobody active and stop. ``join_round_open()`` says whether
    this rank is midway through a round (some of its collectives sent, not
    all): a rank that fails there then runs one ``main_hook`` first, which
    must complete the round. The Join uses it only where every other joinable
    has no collectives of its own (its main hook is :class:`JoinHook`'s) and the
    heartbeat may fuse at all (``Join.heartbeat`` says which way it went).

    A joinable whose per-iteration collectives bypass its join backend (MPI:
    calls on the communicator itself while ``join_process_group`` is an
    ``MPIGroup``) sets ``join_raw_collectives = True``: the backend's
    ``collectives_issued`` cannot count them, so the Join cannot tell where in
    an iteration a failure struck, and fails fast instead (see :class:`Join`).
    A raw communicator as ``join_process_group`` needs no flag: its backend
    counts nothing.

    *Announced iterations.* A joined rank runs every main hook once per
    heartbeat, so a joinable after the first one must see a heartbeat between
    two of its notifies (the first joinable's notify, before that joinable's
    own collectives). A later joinable's notify with no heartbeat since its
    previous one (or since entry) raises :class:`~joinkit.LocalProtocolError`
    naming the first joinable, before any of its collectives can mismatch. A
    later joinable whose main hook shadows several notifies per iteration sets
    ``join_notifies_per_iteration = None`` to turn the check off for itself.

    *Leaving the loop.* A joinable may define ``join_leave_loop()``: the Join
    calls it on a rank that leaves its loop body without an exception, before
    the rank joins, so the joinable can finish (or refuse) an iteration it
    announced; an exception from it is handled as the loop body's own.

    *Leaving, whatever the way.* A joinable may define ``join_loop_exited()``:
    the Join calls it on every rank as it leaves its loop body, however it
    leaves (inputs exhausted, an exception, a peer's failure), after
    ``join_leave_loop()`` and before the rank's first join collective after the
    loop; it must issue no collective on the Join's group (``SideChannel``
    starts its service thread there).
    """

    #: Opt in to the fused heartbeat (see the class docstring).
    join_fuses_heartbeat: bool = False
    #: Carry the fused heartbeat in every collective of the joinable's rounds
    #: (see "A heartbeat in a round" in the class docstring).
    join_heartbeat_in_round: bool = False
    #: The joinable's collectives bypass the join backend (see the class docstring).
    join_raw_collectives: bool = False
    #: The joinable has no process group of its own and takes the Join's (the
    #: group and device of the first joinable that has one; ``SideCollective``
    #: without ``process_group``): the Join does not read its
    #: ``join_process_group`` and ``join_device`` to choose or compare groups.
    join_follows_group: bool = False
    #: How many notifies of this joinable one heartbeat covers: 1, or ``None``
    #: for any number (see "Announced iterations" in the class docstring).
    join_notifies_per_iteration: int | None = 1

    @abc.abstractmethod
    def __init__(self) -> None:
        super().__init__()
        self._join_config = _DISABLED

    @abc.abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Return the :class:`JoinHook` for this joinable.

        Args:
            **kwargs: the keyword arguments given to ``Join``; every joinable of
                one Join receives the same ones.
        """

    @property
    @abc.abstractmethod
    def join_device(self) -> Any:
        """The device for the Join's own collectives (e.g. ``"cpu"``)."""

    @property
    @abc.abstractmethod
    def join_process_group(self) -> Any:
        """The process group (or communicator) for the Join's own collectives."""
