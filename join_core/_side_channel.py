"""``SideChannel``: any number of side collectives per iteration, shadowed by joined ranks.

Theory of operation
-------------------
A :class:`~joinkit.SideCollective` stands for exactly one collective per
iteration, shadowed in a fixed place of the Join's round. Many loops issue
collectives whose number and order change with the data: a metric gather
after some batches and not others, a token count before the forward, a trainer's
logging gather every k steps. A :class:`SideChannel` takes any number of them:

- its calls (:meth:`~SideChannel.all_reduce`, :meth:`~SideChannel.all_gather`,
  ...) go to a *second communicator* over the Join's ranks, the backend's
  side wire (``joinkit._side_protocol.SideWire``; created on Join entry, when
  every rank is there, since creating a communicator is collective; cached
  per group). Each call is a header all-gather and the data collective the
  headers call for (``_side_protocol``; a gather of at most ``INLINE_BYTES``
  per rank is all in the headers);
- a rank that leaves its loop body (however it leaves: its inputs ran out, it
  raised, a peer failed) starts a *service thread* (the Join calls
  :meth:`SideChannel.join_loop_exited` before its first join collective after
  the loop). The thread answers every call of the ranks still training with
  an absent header and the neutral element, so a result is the active ranks'
  alone. Meanwhile the rank's main thread shadows the joinables' collectives
  on the Join's own group, as ever: the two communicators never pair;
- when every rank has left its loop, every rank's service thread is in the
  same header all-gather and every header is absent: that is the stop
  (``_side_protocol.Stop``). Each rank issued exactly one collective for it,
  and the thread ends by itself; the channel's post hook waits for it;
- a call from a rank's main thread while its own service thread runs (from
  another joinable's main hook) would put two threads of one rank on the
  wire: :class:`~joinkit.LocalProtocolError`, before any collective. In the
  post hooks, and outside any Join, every rank is present and a call is an
  ordinary collective.

*Errors.* A call whose headers disagree raises
:class:`~joinkit.CollectiveMismatch` on every present rank, with a table of
the ranks (no data moves); a broadcast from a joined rank raises
:class:`~joinkit.LocalProtocolError`. The service thread never raises on its
own: it records what stopped it; the rank's main thread raises it at its next
main hook (a hook failure, which the Join's failure protocol reports to every
rank), or at the post hook. A service thread that fails other than by a
mismatch its peers saw too aborts the Join's backend where the backend can, so
an active rank waiting for it in a call fails instead of hanging; a peer's
failure or abort ends the thread's wait (the side wire of a torch group reads
the Join group's abort, the threads harness aborts both worlds together).

Standard library only; the arrays are handled by the backend's side wire.
"""

from __future__ import annotations

import functools
import pickle
import threading
from collections.abc import Callable
from typing import Any, cast

from . import _join, _ports
from . import _machine as m
from . import _side_protocol as p
from ._errors import CollectiveMismatch, LocalProtocolError, RankTimeout
from ._join import Join, Joinable, JoinHook
from ._joinable import _DISABLED, JoinConfig

__all__ = ["SideChannel"]

#: The dtypes a reduction may use (every backend sends them).
_REDUCIBLE = frozenset({"bool", "int8", "uint8", "int16", "int32", "int64", "float32",
                        "float64", "complex64", "complex128"})
#: The Join phases in which a main-thread call of a joined rank is refused.
_SHADOWING = frozenset({m.Phase.DRAINING, m.Phase.SHADOWING, m.Phase.EXCHANGING})


class SideChannel(Joinable):
    """Collectives in any number per iteration that a joined rank shadows exactly.

    List it in the Join (anywhere: it sends no heartbeat and runs nothing in a
    shadow round), then make its calls instead of the group's own, as often as
    the data says, before or after the model's collectives::

        side = SideChannel()                          # follows the Join's group
        with Join([model, side]):
            for batch in data:
                loss = model(batch).mean()
                loss.backward()
                optimizer.step()
                if wants_metrics(batch):              # data-dependent
                    preds = side.all_gather(model_out)  # rows of the active ranks
                n = side.all_reduce(torch.ones(()))   # the ranks still training

    Every active rank must make the same calls in the same order in each
    iteration (as without a Join); ranks that have joined take no part in the
    results: a reduction is over the active ranks, a gather holds only their
    rows, a mean divides by their number.

    Args:
        process_group: the group whose ranks the channel spans; ``None``
            (default) follows the Join's group (as ``SideCollective``; outside
            a Join, the group of the last Join it was in). Give it to call the
            channel before any Join, or when it is alone in one.
        device: the device of the Join's collectives on ``process_group``.
        name: what messages and ``repr`` call it.

    Raises:
        TypeError: on ``Join(...)`` entry, the Join's backend has no side
            communicator (no ``side_wire``; joinkit's threads, torch and MPI
            backends have one).
    """

    def __init__(self, process_group: Any = None, *, device: Any = None,
                 name: str = "side channel") -> None:
        self._config: JoinConfig = _DISABLED
        super().__init__()
        self._group = process_group
        self._device = device
        self.name = name
        #: Whether it takes the Join's process group (``process_group=None``).
        self.join_follows_group = process_group is None
        self._wire: Any = None
        self._outside_wire: Any = None
        self._service: threading.Thread | None = None
        self._service_error: BaseException | None = None
        self._reported: BaseException | None = None
        #: Calls this rank made (present) and calls its service threads answered.
        self.calls = 0
        self.served = 0
        #: The ranks that took part in this rank's latest call (in rank order).
        self.last_active: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"SideChannel({self.name!r})"

    # -- the Join's side -----------------------------------------------------------

    @property
    def _join_config(self) -> JoinConfig:
        return self._config

    @_join_config.setter
    def _join_config(self, config: JoinConfig) -> None:
        # Entry (every rank is here, past the agreement check): find the side
        # wire, which may create a communicator (collective, so here and not at
        # the first call, which a joined rank never makes). Exit: forget it.
        if config.join is not None and config.enable:
            self._settle_service()
            self._wire = _wire_of(config.join.backend, self)
            if self.join_follows_group:
                self._outside_wire = self._wire  # outside, the group of its last Join
        elif config is _DISABLED:
            self._wire = None
        self._config = config

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook: its main hook reports a failed service thread, its post hook waits for it."""
        return _ChannelHook(self)

    @property
    def join_device(self) -> Any:
        """The device given, or the Join's device while following one."""
        if self.join_follows_group:
            join = self._config.join
            return None if join is None else join.device
        return self._device

    @property
    def join_process_group(self) -> Any:
        """The group given, or the Join's group while following one (else ``None``)."""
        if self.join_follows_group:
            join = self._config.join
            return None if join is None else join.process_group
        return self._group

    def join_loop_exited(self) -> None:
        """Start this rank's service thread (the Join calls it as the rank leaves its loop)."""
        config = self._config
        join = cast("Join | None", config.join)  # a config names the Join that set it
        if not config.enable or join is None or self._wire is None:
            return
        inputs = _inputs(join)
        wire = self._wire
        timeout = join._setup.timeout
        abort = join._setup.caps.abort
        self._service_error = None
        thread = threading.Thread(target=self._serve, args=(wire, inputs, abort),
                                  name=f"joinkit-side-channel-{wire.rank}", daemon=True)
        self._service = thread
        self._service_timeout = timeout
        thread.start()

    def _serve(self, wire: Any, inputs: int, abort: Callable[[str], None] | None) -> None:
        header = p.absent_header(inputs).encode()
        try:
            while True:
                plan = p.decide_encoded(wire.exchange(header))
                if isinstance(plan, p.Stop):
                    return
                if isinstance(plan, (p.Mismatch, p.Refused, p.BarrierPlan)):
                    continue  # the present ranks raise, or the headers were all of it
                if isinstance(plan, p.ReducePlan):
                    wire.reduce(plan, None)
                elif isinstance(plan, p.GatherPlan):
                    if plan.padded:
                        wire.gather_bytes(plan, None)
                else:
                    wire.broadcast_bytes(plan, None)
                self.served += 1
        except BaseException as error:  # noqa: BLE001 - raised on the main thread
            self._service_error = error
            if abort is not None and not isinstance(error, CollectiveMismatch):
                # An active rank may wait in a call this thread will never answer.
                try:
                    abort(f"rank {wire.rank}'s side channel service failed: {error!r}")
                except Exception:  # noqa: BLE001 - the error above is the news
                    pass

    def _check_service(self) -> None:
        """Raise what stopped this rank's service thread, once (main thread)."""
        error = self._service_error
        if error is not None and error is not self._reported:
            self._reported = error
            raise error

    def _settle_service(self, timeout: float | None = None) -> None:
        """Wait for this rank's service thread to end (it ends at the stop)."""
        thread = self._service
        if thread is None:
            return
        if timeout is None:
            timeout = getattr(self, "_service_timeout", None)
        thread.join(timeout)
        if thread.is_alive():
            raise RankTimeout(
                f"{self!r}: this rank's service thread did not stop within {timeout} s after "
                "the Join: some rank never left its loop (it is stuck, or died), so the "
                "side channel cannot be used any more"
            )
        self._service = None
        self._check_service()

    # -- the calls -------------------------------------------------------------------

    def _begin(self) -> tuple[Any, int]:
        """The wire and this rank's window for a call, after the misuse checks."""
        config = self._config
        join = cast("Join | None", config.join)  # a config names the Join that set it
        if config.enable and join is not None:
            thread = self._service
            if thread is not None and thread is not threading.current_thread():
                state = join._drive.state
                if state is not None and state.phase in _SHADOWING and thread.is_alive():
                    raise LocalProtocolError(
                        f"{self!r} was called while this rank shadows the others (from a "
                        "joinable's main hook): a joined rank's side channel is answered by "
                        "its service thread, and a call from the shadow round would put a "
                        "second thread of this rank on the channel. Make side calls only "
                        "in the loop body (or in post hooks)"
                    )
                self._settle_service()
            state = join._drive.state
            window = _inputs(join) if state is not None and state.phase is m.Phase.ACTIVE else -1
            return self._wire, window
        if join is None and _join._enabled_joins() > 0:
            raise LocalProtocolError(
                f"{self!r} was called inside a `with Join(...)` block that does not list it: a "
                "rank that joins would never answer its calls, and the others would hang in "
                "them. Add it to the Join's list, e.g. Join([model, side_channel])"
            )
        return self._outside(), 0

    def _outside(self) -> Any:
        """The wire for a call outside any enabled Join (every rank calls)."""
        if self._outside_wire is None:
            group = self._group
            device = self._device
            join = self._config.join
            if group is None and join is not None:
                group, device = join.process_group, join.device
            if group is None:
                raise LocalProtocolError(
                    f"{self!r} was called outside a Join before any Join: it follows the "
                    "group of the Join it is in (outside, of its last one). Give it a group, "
                    "SideChannel(group), to use it before any Join"
                )
            self._outside_wire = _wire_of(_ports.resolve(group, device), self)
        return self._outside_wire

    def _plan(self, wire: Any, header: p.Header) -> p.Plan:
        self._check_service()
        plan = p.decide_encoded(wire.exchange(header.encode()))
        self.calls += 1
        self.last_active = getattr(plan, "present", ())
        if isinstance(plan, p.Mismatch):
            raise CollectiveMismatch(plan.message)
        if isinstance(plan, p.Refused):
            raise LocalProtocolError(plan.message)
        return plan

    def all_reduce(self, buf: Any, op: str = "sum") -> Any:
        """Reduce ``buf`` over the active ranks, in place.

        Args:
            buf: a NumPy array or torch tensor, the same shape and dtype on every
                active rank (a dtype every backend sends: no float16).
            op: ``"sum"``, ``"prod"``, ``"min"``, ``"max"``, ``"band"``,
                ``"bor"`` or ``"bxor"``; joined ranks contribute its identity.

        Returns:
            ``buf``, holding the result.

        Raises:
            ValueError: unknown ``op`` (before any collective).
            TypeError: ``buf`` is not an array or tensor, or its dtype cannot be
                reduced (before any collective).
            CollectiveMismatch: the active ranks' calls differ (every one raises).
        """
        if op not in p.OPS:
            raise ValueError(f"{self!r}.all_reduce: unknown op {op!r}; one of {', '.join(p.OPS)}")
        wire, window = self._begin()
        dtype, shape, _ = wire.layout(buf)
        if dtype not in _REDUCIBLE:
            raise TypeError(
                f"{self!r}.all_reduce: a {dtype} buffer cannot be reduced on every backend; "
                f"use one of {', '.join(sorted(_REDUCIBLE))} (or all_gather, which moves raw bytes)"
            )
        size = _numel(shape)
        header = p.Header(present=True, window=window, kind=p.Kind.ALL_REDUCE,
                          op=p.OPS.index(op), dtype=_dtype_code(dtype), size=size,
                          fingerprint=p.fingerprint("reduce", shape))
        plan = self._plan(wire, header)
        assert isinstance(plan, p.ReducePlan)
        return wire.reduce(plan, buf)

    def mean(self, buf: Any) -> Any:
        """The mean of ``buf`` over the active ranks, in place (a sum, divided by their number).

        Args:
            buf: a floating-point NumPy array or torch tensor.

        Returns:
            ``buf``, holding the mean.

        Raises:
            TypeError: ``buf`` is not floating point (before any collective).
        """
        wire, window = self._begin()
        dtype, shape, _ = wire.layout(buf)
        if dtype not in ("float32", "float64", "complex64", "complex128"):
            raise TypeError(f"{self!r}.mean needs a float32 or float64 buffer, not {dtype}")
        header = p.Header(present=True, window=window, kind=p.Kind.ALL_REDUCE,
                          op=p.OPS.index("sum"), dtype=_dtype_code(dtype), size=_numel(shape),
                          fingerprint=p.fingerprint("reduce", shape))
        plan = self._plan(wire, header)
        assert isinstance(plan, p.ReducePlan)
        wire.reduce(plan, buf)
        buf /= len(plan.present)
        return buf

    def all_gather(self, buf: Any) -> list[Any]:
        """Every active rank's ``buf``, in rank order; their first dimensions may differ.

        Args:
            buf: a NumPy array or torch tensor; the dtype and every dimension
                but the first must agree between the active ranks (a 0-d buffer
                is one row).

        Returns:
            The active ranks' buffers (new arrays of ``buf``'s kind and device),
            in rank order; joined ranks have none.

        Raises:
            TypeError: ``buf`` is not an array or tensor (before any collective).
            CollectiveMismatch: the active ranks' dtypes or trailing shapes differ.
        """
        wire, window = self._begin()
        dtype, shape, nbytes = wire.layout(buf)
        rows = shape[0] if shape else 1
        header = p.Header(present=True, window=window, kind=p.Kind.ALL_GATHER,
                          dtype=_dtype_code(dtype), size=nbytes, rows=rows,
                          fingerprint=_gather_fingerprint(dtype, shape[1:], len(shape) == 0),
                          inline=_inline(nbytes, lambda: wire.bytes_of(buf)))
        plan = self._plan(wire, header)
        assert isinstance(plan, p.GatherPlan)
        result: list[Any] | None = wire.gather(plan, buf)
        assert result is not None
        return result

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every active rank's picklable ``obj``, in rank order.

        Raises:
            pickle.PicklingError, TypeError, AttributeError: ``obj`` cannot be
                pickled (before any collective).
        """
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        wire, window = self._begin()
        header = p.Header(present=True, window=window, kind=p.Kind.ALL_GATHER, size=len(data),
                          rows=len(data), fingerprint=p.fingerprint("object"),
                          inline=_inline(len(data), lambda: data))
        plan = self._plan(wire, header)
        assert isinstance(plan, p.GatherPlan)
        parts = wire.gather_bytes(plan, data)
        assert parts is not None
        return [pickle.loads(part) for part in parts]

    def broadcast(self, buf: Any, src: int) -> Any:
        """Copy ``buf`` of rank ``src`` (an active rank) into ``buf`` of every active rank.

        Raises:
            LocalProtocolError: ``src`` has joined (every active rank raises).
        """
        wire, window = self._begin()
        dtype, shape, nbytes = wire.layout(buf)
        header = p.Header(present=True, window=window, kind=p.Kind.BROADCAST,
                          dtype=_dtype_code(dtype), size=nbytes, root=_root(src, wire),
                          fingerprint=p.fingerprint("broadcast", dtype, shape))
        plan = self._plan(wire, header)
        assert isinstance(plan, p.BroadcastPlan)
        return wire.broadcast(plan, buf)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s picklable ``obj`` (``src`` an active rank), on every active rank."""
        wire, window = self._begin()
        root = _root(src, wire)
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if wire.rank == root else b""
        header = p.Header(present=True, window=window, kind=p.Kind.BROADCAST, size=len(data),
                          root=root, fingerprint=p.fingerprint("object"))
        plan = self._plan(wire, header)
        assert isinstance(plan, p.BroadcastPlan)
        received = wire.broadcast_bytes(plan, data)
        return obj if wire.rank == root else pickle.loads(received)

    def barrier(self) -> None:
        """Return once every active rank has called it (joined ranks do not hold it up)."""
        self.active_ranks()

    def active_ranks(self) -> tuple[int, ...]:
        """The ranks still in their loop (every rank outside a Join): a barrier of theirs.

        Returns:
            The active ranks, in order (this rank is one of them).
        """
        wire, window = self._begin()
        header = p.Header(present=True, window=window, kind=p.Kind.BARRIER,
                          fingerprint=p.fingerprint("barrier"))
        return self._plan(wire, header).present  # type: ignore[union-attr]


class _ChannelHook(JoinHook):
    # The main hook only reads this rank's service thread's outcome: a joined rank's
    # side calls are the thread's, on the side wire, never on the Join's group.
    main_hook_is_local = True

    def __init__(self, channel: SideChannel) -> None:
        self.channel = channel

    def main_hook(self) -> None:
        self.channel._check_service()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.channel._settle_service()


def _inputs(join: Join) -> int:
    """The heartbeats this rank sent in ``join`` (reported and not yet reported)."""
    drive = join._drive
    state = drive.state
    return 0 if state is None else state.heartbeats + drive.beats


def _wire_of(backend: Any, channel: SideChannel) -> Any:
    side_wire = _ports.capabilities(backend).side_wire
    if side_wire is None:
        kind = type(backend)
        raise TypeError(
            f"{channel!r} needs a second communicator over the Join's ranks, and the join "
            f"backend {kind.__module__}.{kind.__qualname__} has none (no side_wire()); "
            "joinkit's threads, torch.distributed and MPI backends have one "
            "(docs/guide/writing-a-backend.md)"
        )
    return side_wire()


@functools.lru_cache(maxsize=256)
def _gather_fingerprint(dtype: str, trailing: tuple[int, ...], scalar: bool) -> int:
    """A gather's fingerprint (a digest per call: cached, a loop gathers few layouts)."""
    return p.fingerprint("gather", dtype, trailing, scalar)


def _dtype_code(dtype: str) -> int:
    try:
        return p.DTYPES.index(dtype) + 1
    except ValueError:
        raise TypeError(f"a side channel cannot send {dtype} buffers") from None


def _inline(nbytes: int, data: Callable[[], bytes]) -> tuple[int, ...]:
    """A header's ``inline`` words: a small gather's bytes, else zeros (``_side_protocol``)."""
    if not 0 < nbytes <= p.INLINE_BYTES:
        return (0,) * p.INLINE_WORDS
    return p.pack_inline(data())


def _numel(shape: tuple[int, ...]) -> int:
    size = 1
    for extent in shape:
        size *= extent
    return size


def _root(src: Any, wire: Any) -> int:
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < wire.world_size:
        raise ValueError(f"src must be a rank from 0 to {wire.world_size - 1}, not {src!r}")
    return src
