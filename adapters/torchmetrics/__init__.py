"""torchmetrics ``Metric`` and ``MetricCollection`` inside joinkit's ``Join``.

Theory of operation
-------------------
``Join([metric])`` or ``Join([model, metric])`` (a DDP model first) takes a
torchmetrics ``Metric`` or ``MetricCollection`` as it is: the ``METRICS``
adapter (``joinkit.adapters``) gives it a :class:`MetricJoinable`.

*What a metric sends.* torchmetrics 1.9 sends collectives in two places:
``compute()`` (and ``sync()``), which gathers the *accumulated* state from
every rank of the metric's process group, and, with ``dist_sync_on_step=True``,
every ``forward`` (``metric(preds, target)``): forward updates the
accumulated local state, then resets, updates with the batch alone and calls
``compute()``, which gathers the *batch* state of every rank, and finally puts
the local accumulated state back. ``update()`` sends nothing. Each gather is
torchmetrics' ``gather_all_tensors`` once per state (a barrier, a shape
all-gather, an all-gather padded to the largest shape).

*Default (``dist_sync_on_step=False``).* Nothing inside the Join sends a
collective, so a joined rank has nothing to shadow; each rank's accumulated
state holds exactly its own batches, and ``compute()`` after the Join gathers
them all: the value of one process over the union. ``compute()`` inside the
Join is refused (below).

*Per-step sync.* While the Join lasts the adapter replaces two members on the
object (instance attributes, removed on exit): ``forward`` of the Metric or
collection, which sends the heartbeat (``Join.notify_join_context``; only the
first joinable's is sent, so with DDP first DDP sends it) and marks a
per-step sync; and ``sync`` of each member metric, which routes that sync
through :func:`gather_states` instead of ``gather_all_tensors``: one
all-gather of a small header per state (active flag, dtype, shape), then one
all-gather of every state's bytes padded to the largest rank's, two
collectives per metric per step where torchmetrics sends two or three per
state. A joined rank's shadow round calls the same function with no states
for every member with ``dist_sync_on_step`` (header: "joined"; bytes:
padding), and every rank keeps only the active ranks' rows. So the per-step
value on an active rank is the metric over that step's batches of the ranks
still active, exactly what one process computes over their union; a joined
rank contributes nothing, its accumulated state is untouched (forward puts
the local state back, and a joined rank's holds its own batches), and
``compute()`` after the Join is the union of every rank's batches.

*What a joined rank must know.* One sync gathers one tensor per state, in the
order of ``Metric._reductions`` (a ``cat`` list state is concatenated first),
so a joined rank's shadow needs only the metric's structure; what it gathers
(dtype, shapes) comes in the headers. Those internals are checked once per
process (``adapters._torchmetrics_private``), and a torchmetrics outside the
supported range fails loudly.

*Refused, before any collective.* :func:`check` (when the Join is built)
refuses, with ``dist_sync_on_step=True``: a list state whose reduction is
not ``cat`` (its number of gathers depends on the data); a metric class that
overrides ``forward``, ``sync`` or ``_sync_dist``, or a per-step-syncing
metric nested in a wrapper (the adapter cannot see its syncs); members that
sync over different process groups; and the same metric given twice. The
Join itself refuses a metric whose process group differs from the other
joinables'. Inside the Join, a sync outside a forward (``compute()``,
``sync()``) raises ``LocalProtocolError`` on the rank that calls it: call
``compute()`` after the ``with`` block. The metric must be called once per
iteration, at the point of the loop that its place in the Join's list says
(after ``loss.backward()`` / ``optimizer.step()``: ``Join([model, metric])``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

try:
    import torch
    import torch.distributed as dist
    from torchmetrics import Metric, MetricCollection
    from torchmetrics.utilities.data import dim_zero_cat
except ImportError as _error:  # pragma: no cover - the message is the point
    raise ImportError(
        "joinkit.adapters.torchmetrics needs torchmetrics and torch: "
        "pip install 'joinkit[metrics]'"
    ) from _error

from joinkit import Join, Joinable, JoinConfig, JoinHook, LocalProtocolError
from joinkit.lowlevel import AdapterCache, AdapterJoinable

from .._errors import UnsupportedTorchmetricsError
from . import _private

__all__ = ["adapt", "check", "gather_states", "MetricJoinable"]

#: Most dimensions of one metric state (a header has room for that many sizes).
MAX_DIMS = 8
_HEADER = 3 + MAX_DIMS  # active, dtype code, ndim, sizes
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_DISABLED = JoinConfig()


def adapt(obj: Any) -> Joinable:
    """The joinable standing for a torchmetrics ``Metric`` or ``MetricCollection``.

    The same object always gets the same adapter.

    Args:
        obj: the metric or collection.

    Returns:
        Its :class:`MetricJoinable`.

    Raises:
        TypeError: ``obj`` is neither.
        joinkit.adapters.UnsupportedTorchmetricsError: this torchmetrics is
            not one the adapter supports (checked once per process).
    """
    if not isinstance(obj, (Metric, MetricCollection)):
        raise TypeError(
            "joinkit.adapters.torchmetrics.adapt expects a torchmetrics Metric or "
            f"MetricCollection, got {type(obj).__qualname__}"
        )
    _private.check()
    return _adapters.get(obj, MetricJoinable)


_adapters: AdapterCache[MetricJoinable] = AdapterCache()


class MetricJoinable(AdapterJoinable):
    """A torchmetrics Metric or MetricCollection in a Join (module doc).

    ``obj`` is the metric or collection it stands for.
    """

    describes = "metric"

    def __init__(self, obj: Any) -> None:
        super().__init__(obj)
        #: How deep this rank is in the object's forward (a per-step sync may run).
        self._forwarding = 0

    def members(self) -> list[Any]:
        """The metrics whose forward the object's forward calls, in that order."""
        obj = self.obj
        if isinstance(obj, MetricCollection):
            # ModuleDict's own values(): MetricCollection's re-links compute groups.
            return list(torch.nn.ModuleDict.values(obj))
        return [obj]

    def syncing_members(self) -> list[Any]:
        """The members that sync per step (``dist_sync_on_step`` and distributed)."""
        return [m for m in self.members() if m.dist_sync_on_step and _distributed(m)]

    # -- the Joinable ------------------------------------------------------------

    def join_entered(self, join: Join) -> None:
        self._install()

    def join_left(self) -> None:
        self._uninstall()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _MetricShadow(self)

    @property
    def join_device(self) -> Any:
        return self.members()[0].device if self.members() else torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        members = self.syncing_members() or self.members()
        return _group(members[0].process_group) if members else _group(None)

    # -- while inside the Join ---------------------------------------------------

    def _install(self) -> None:
        obj = self.obj
        forward = obj.forward

        @functools.wraps(forward)
        def joined_forward(*args: Any, **kwargs: Any) -> Any:
            Join.notify_join_context(self)  # the heartbeat, when this joinable is first
            self._forwarding += 1
            try:
                return forward(*args, **kwargs)
            finally:
                self._forwarding -= 1

        obj.forward = joined_forward
        for metric in self.members():
            metric.sync = functools.partial(_joined_sync, self, metric, metric.sync)

    def _uninstall(self) -> None:
        obj = self.obj
        obj.__dict__.pop("forward", None)
        for metric in self.members():
            metric.__dict__.pop("sync", None)
        self._forwarding = 0

    def shadow(self) -> None:
        """One shadow round: every per-step sync of one forward, contributing nothing."""
        for metric in self.syncing_members():
            gather_states(None, len(metric._reductions), _group(metric.process_group),
                          metric.device)

    def align_empty_lists(self) -> None:
        """Give an empty ``cat`` list state the dtype and shape the other ranks' have.

        A rank that never updated a metric (no batches) holds an empty list;
        torchmetrics' ``compute()`` then gathers ``tensor([], dtype=metric.dtype)``
        from it, which mismatches (a gloo abort) a peer whose state is int64 or
        2-D. So once every rank has joined, the ranks swap each list state's
        dtype and trailing shape (one ``all_gather_object`` per Join, only for
        metrics with list states), and an empty list gets one empty tensor of
        that kind: the same values, a gather that matches.
        """
        lists = [(m, attr) for m in self.members() if _distributed(m)
                 for attr in m._reductions if isinstance(getattr(m, attr), list)]
        if not lists:
            return
        mine = [_list_kind(getattr(m, attr)) for m, attr in lists]
        group = self.join_process_group
        kinds: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(kinds, mine, group=group)
        for index, (metric, attr) in enumerate(lists):
            if getattr(metric, attr):
                continue
            found = next((k[index] for k in kinds if k[index] is not None), None)
            if found is not None:
                dtype, trailing = found
                # Where the metric keeps its list states (compute_on_cpu moves them).
                device = torch.device("cpu") if metric.compute_on_cpu else metric.device
                getattr(metric, attr).append(
                    torch.empty((0, *trailing), dtype=_DTYPES[dtype], device=device))


def _list_kind(states: list[Any]) -> tuple[int, tuple[int, ...]] | None:
    """(dtype code, trailing shape) of a non-empty list state, else ``None``."""
    if not states:
        return None
    first = states[0]
    return _CODES.get(first.dtype, 0), tuple(first.shape[1:])


class _MetricShadow(JoinHook):
    def __init__(self, adapter: MetricJoinable) -> None:
        self.adapter = adapter

    def main_hook(self) -> None:
        self.adapter.shadow()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.adapter.align_empty_lists()


def _joined_sync(adapter: MetricJoinable, metric: Any, sync: Callable[..., None],
                 dist_sync_fn: Callable[..., Any] | None = None,
                 process_group: Any | None = None, should_sync: bool = True,
                 distributed_available: Callable[[], bool] | None = None) -> None:
    """``metric.sync`` inside a Join: a per-step sync through :func:`gather_states`."""
    available = distributed_available or metric.distributed_available_fn
    if not should_sync or not (callable(available) and available()):
        return sync(dist_sync_fn, process_group, should_sync, distributed_available)
    name = type(metric).__qualname__
    if adapter._forwarding == 0:
        raise LocalProtocolError(
            f"{name}.compute() (or sync()) inside a Join gathers the metric's state from "
            "every rank, and a rank that has joined cannot take part in it: call "
            "compute() after the `with Join(...)` block (every rank), or read the "
            "per-step value that metric(preds, target) returns"
        )
    group = _group(process_group or metric.process_group)
    if group != adapter.join_process_group:
        raise ValueError(
            f"{name} syncs over a different process group than its Join: build the metric "
            "with process_group= the Join's group, or leave it out of the Join"
        )
    states = [_sync_input(metric, attr) for attr in metric._reductions]
    gathered = gather_states(states, len(states), group, metric.device)
    position = iter(range(len(states)))

    def serve(tensor: Any, group: Any = None) -> list[Any]:
        # torchmetrics' _sync_dist asks once per state, in _reductions order.
        index = next(position, None)
        if index is None or tuple(tensor.shape) != tuple(states[index].shape):
            raise UnsupportedTorchmetricsError(
                f"{name}'s sync gathered a state joinkit did not expect (torchmetrics "
                f"{_private._version()} changed how it syncs); joinkit was tested with "
                f"torchmetrics {' and '.join(_private.TESTED_TORCHMETRICS)}"
            )
        return gathered[index]

    return sync(serve, process_group, should_sync, distributed_available)


def _sync_input(metric: Any, attr: str) -> Any:
    """The one tensor torchmetrics' ``_sync_dist`` gathers for the state ``attr``."""
    value = getattr(metric, attr)
    if isinstance(value, list):  # a cat list state (check refuses others)
        if len(value) == 0:
            return torch.tensor([], device=metric.device, dtype=metric.dtype)
        return dim_zero_cat(value) if len(value) > 1 else value[0]
    return value


def gather_states(states: Sequence[Any] | None, count: int, group: Any,
                  device: Any) -> list[list[Any]]:
    """Gather ``count`` tensors from every active rank, in two all-gathers.

    The collective behind a per-step sync inside a Join. An active rank passes
    its states; a joined rank passes ``None`` and contributes nothing. For each
    state it returns the active ranks' tensors in rank order (this rank's own
    tensor as given, so autograd sees it), unpadded, as torchmetrics'
    ``gather_all_tensors`` returns every rank's.

    Args:
        states: this rank's tensors (``count`` of them), or ``None`` on a joined rank.
        count: how many tensors every rank gathers.
        group: the process group.
        device: where the headers and bytes travel (the metric's device).

    Returns:
        One list per state: the active ranks' tensors.

    Raises:
        ValueError: a state has more than :data:`MAX_DIMS` dimensions.
        TypeError: the active ranks' tensors for one state differ in dtype or
            number of dimensions (raised on every rank, before the bytes travel).
    """
    world = dist.get_world_size(group)
    header = torch.zeros(count, _HEADER, dtype=torch.int64)
    flat: list[Any] = []
    if states is not None:
        if len(states) != count:
            raise ValueError(f"gather_states got {len(states)} states, expected {count}")
        for index, state in enumerate(states):
            shape = tuple(state.shape)
            if len(shape) > MAX_DIMS:
                raise ValueError(f"a metric state has {len(shape)} dimensions; joinkit "
                                 f"gathers at most {MAX_DIMS}")
            code = _CODES.get(state.dtype)
            if code is None:
                raise TypeError(f"joinkit cannot gather a metric state of dtype {state.dtype}")
            header[index, :3] = torch.tensor([1, code, len(shape)])
            header[index, 3:3 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
            flat.append(state.detach().contiguous().reshape(-1).view(torch.uint8))
    header = header.to(device)
    headers = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(headers, header, group=group)
    rows = torch.stack(headers).tolist()  # [rank][state][field]
    active = [rank for rank in range(world) if rows[rank] and rows[rank][0][0] == 1]
    layouts: list[tuple[Any, list[tuple[int, ...]]]] = []
    for index in range(count):
        # An empty state (a cat list no batch added to) takes any dtype.
        filled = [r for r in active if math.prod(_shape(rows[r][index])) > 0] or active
        kinds = {(rows[r][index][1], rows[r][index][2]) for r in filled}
        if len(kinds) > 1:
            found = ", ".join(f"rank {r}: {_DTYPES[rows[r][index][1]]} with "
                              f"{rows[r][index][2]} dims" for r in filled)
            raise TypeError(f"the ranks' metric state {index} differs in dtype or "
                            f"dimensions ({found}); every rank must update the metric "
                            "with inputs of the same dtype and rank")
        dtype = _DTYPES[rows[filled[0]][index][1]] if filled else torch.uint8
        shapes = [_shape(rows[r][index]) for r in active]
        layouts.append((dtype, shapes))
    sizes = [[math.prod(shape) * _itemsize(dtype) for shape in shapes]
             for dtype, shapes in layouts]  # [state][active rank] bytes
    totals = [sum(sizes[i][k] for i in range(count)) for k in range(len(active))]
    width = max(totals, default=0)
    payloads: list[Any] = []
    if width:
        mine = torch.zeros(width, dtype=torch.uint8, device=device)
        if flat:
            joined = torch.cat(flat).to(device)
            mine[: joined.numel()] = joined
        payloads = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(payloads, mine, group=group)
    me = dist.get_rank(group)
    result: list[list[Any]] = []
    offsets = [0] * len(active)
    for index, (dtype, shapes) in enumerate(layouts):
        out = []
        for k, rank in enumerate(active):
            if rank == me and states is not None and sizes[index][k]:
                out.append(states[index])
            elif sizes[index][k] == 0:
                out.append(torch.empty(shapes[k], dtype=dtype, device=device))
            else:
                raw = payloads[rank][offsets[k]: offsets[k] + sizes[index][k]]
                out.append(raw.clone().view(dtype).reshape(shapes[k]))  # aligned
            offsets[k] += sizes[index][k]
        result.append(out)
    return result


def _shape(row: list[int]) -> tuple[int, ...]:
    return tuple(row[3:3 + row[2]])


def _itemsize(dtype: Any) -> int:
    return int(torch.empty((), dtype=dtype).element_size())


def _distributed(metric: Any) -> bool:
    available = metric.distributed_available_fn
    return bool(callable(available) and available())


def _group(group: Any) -> Any:
    """The group a metric syncs over (``None``: the default group)."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_group()
    return group


# -- checks when the Join is built ---------------------------------------------------


def check(joinables: Sequence[Joinable]) -> None:
    """Refuse metrics a joined rank cannot shadow correctly (module doc).

    Args:
        joinables: a Join's whole list.

    Raises:
        ValueError: the message says what is wrong and what to write instead.
    """
    seen: dict[int, str] = {}
    for joinable in joinables:
        if not isinstance(joinable, MetricJoinable):
            continue
        members = joinable.members()
        for metric in members:
            name = type(metric).__qualname__
            if id(metric) in seen:
                raise ValueError(f"Join got the metric {name} twice (alone and in a "
                                 "MetricCollection?): pass it once")
            seen[id(metric)] = name
        direct = {id(m) for m in members}
        for metric in members:
            for inner in metric.modules():
                if (inner is not metric and isinstance(inner, Metric)
                        and id(inner) not in direct and inner.dist_sync_on_step):
                    raise ValueError(
                        f"{type(metric).__qualname__} wraps the metric "
                        f"{type(inner).__qualname__}, which has dist_sync_on_step=True: "
                        "joinkit cannot shadow a wrapped metric's per-step sync; build it "
                        "with dist_sync_on_step=False (the value after compute() is the "
                        "same)"
                    )
        groups = []
        for metric in joinable.syncing_members():
            _check_syncing(metric)
            groups.append(_group(metric.process_group))
        if any(group != groups[0] for group in groups[1:]):
            raise ValueError(
                "the metrics of one MetricCollection with dist_sync_on_step=True sync "
                "over different process groups: a Join has one; give them the same "
                "process_group"
            )


def _check_syncing(metric: Any) -> None:
    name = type(metric).__qualname__
    cls = type(metric)
    for member in ("forward", "sync", "_sync_dist"):
        if getattr(cls, member) is not getattr(Metric, member):
            raise ValueError(
                f"{name} overrides Metric.{member}, so joinkit cannot know which "
                "collectives its per-step sync sends: build it with "
                "dist_sync_on_step=False (compute() after the Join is the same), or "
                "leave it out of the Join"
            )
    for attr, reduction in metric._reductions.items():
        if isinstance(getattr(metric, attr), list) and reduction is not dim_zero_cat:
            raise ValueError(
                f"{name}'s list state {attr!r} is reduced with {reduction!r}, not cat: "
                "its per-step sync gathers one tensor per list element, which a joined "
                "rank cannot know; build it with dist_sync_on_step=False"
            )
