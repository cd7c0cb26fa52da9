"""Ready-made :class:`joinkit.SideCollective` wrappers for torch.distributed calls.

Theory of operation
-------------------
A side collective's shadow must issue, on a joined rank, the same collective
as the active ranks' call, with a contribution that leaves their result as it
would be without that rank. For the common calls that is known from the op and
the tensor's shape, so one line builds the wrapper:

- :func:`all_reduce`: ``dist.all_reduce``; a joined rank contributes the op's
  identity (0 for a sum, 1 for a product, the lowest value for a max, the
  highest for a min) in a tensor shaped like ``like``;
- :func:`mean`: the mean over the *active* ranks (one all-reduce of the
  values and a count), which a plain ``AVG`` cannot give: a joined rank would
  count in its divisor;
- :func:`barrier`: ``dist.barrier``, shadowed by a barrier;
- :func:`broadcast`: ``dist.broadcast`` from ``src``; a joined ``src`` sends
  ``like`` (so pick a ``like`` whose value means "nothing new", e.g. a zero
  flag), any other joined rank receives into a scratch tensor.

An active rank's tensor must have ``like``'s shape and dtype (a joined rank
cannot know another): a different one raises ``ValueError`` before any
collective. With ``group=None`` the wrapper follows the Join's process group,
as any :class:`~joinkit.SideCollective` without one; pass the group the call
uses when it is not the default one, so the Join checks it matches.

Layouts: a tensor whose elements share memory (``expand()``, ``as_strided``)
raises ``ValueError`` before any collective too: no result can be written
into it, and gloo, handed one, writes past its storage (a heap corruption,
``double free or corruption``). A tensor that is only not contiguous (a
column, a slice) goes out as a contiguous copy whose result is written back:
gloo, handed a strided tensor, reads and writes ``numel`` elements from its
first one, a wrong result and its neighbours overwritten (torch 2.13). A
joined rank's scratch tensor is contiguous whatever ``like``'s layout, so its
elements go out in the order of the active ranks' copies.
"""

from __future__ import annotations

from typing import Any

from joinkit import SideCollective
from joinkit.backends import shares_elements

try:
    import torch
    import torch.distributed as dist
except ImportError as error:  # pragma: no cover - the torch extra is missing
    raise ImportError(
        "joinkit.adapters.torch.collectives needs torch: pip install 'joinkit[torch]'"
    ) from error

__all__ = ["all_reduce", "mean", "barrier", "broadcast"]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "product": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def all_reduce(like: torch.Tensor, op: Any = "sum", group: Any = None,
               *, name: str | None = None) -> SideCollective:
    """A side collective for ``dist.all_reduce(tensor, op, group)``.

    Calling it reduces ``tensor`` in place and returns it.

    Args:
        like: a tensor of the shape, dtype and device every call reduces.
        op: ``"sum"``, ``"product"``, ``"max"``, ``"min"`` or the
            ``dist.ReduceOp`` of one of them.
        group: the process group of the call (``None``: the default group,
            following the Join's).
        name: for messages (default ``"all_reduce"``).

    Returns:
        The :class:`~joinkit.SideCollective`.

    Raises:
        ValueError: ``op`` has no identity a joined rank could contribute
            (``AVG``: use :func:`mean`), or is unknown.
    """
    reduce_op = _reduce_op(op)
    identity = _identity(reduce_op, like.dtype)
    template = like.detach()
    scratch = torch.full(template.shape, identity, dtype=template.dtype, device=template.device)

    def fn(tensor: torch.Tensor) -> torch.Tensor:
        _check_like(tensor, template, name or "all_reduce")
        wire = _wire(tensor, name or "all_reduce")
        dist.all_reduce(wire, op=reduce_op, group=group)
        _write_back(tensor, wire)
        return tensor

    def shadow() -> None:
        scratch.fill_(identity)
        dist.all_reduce(scratch, op=reduce_op, group=group)

    return SideCollective(fn, shadow=shadow, process_group=group, device=_device(template, group),
                          name=name or "all_reduce")


def mean(like: torch.Tensor, group: Any = None, *, name: str | None = None) -> SideCollective:
    """A side collective for the mean of a tensor over the ranks that have not joined.

    Calling it with ``tensor`` returns a new tensor: the element-wise mean of
    the active ranks' tensors (one all-reduce of the values and a count, in
    float64; a joined rank contributes zeros and a zero count).

    Args:
        like: a tensor of the shape, dtype and device every call averages.
        group: the process group (``None``: the default group, following the Join's).
        name: for messages (default ``"mean"``).

    Returns:
        The :class:`~joinkit.SideCollective`.
    """
    template = like.detach()
    scratch = torch.zeros(template.numel() + 1, dtype=torch.float64, device=template.device)

    def fn(tensor: torch.Tensor) -> torch.Tensor:
        _check_like(tensor, template, name or "mean")
        buf = torch.cat([tensor.detach().reshape(-1).to(torch.float64),
                         torch.ones(1, dtype=torch.float64, device=tensor.device)])
        dist.all_reduce(buf, group=group)
        return (buf[:-1] / buf[-1]).reshape(tensor.shape).to(tensor.dtype)

    def shadow() -> None:
        scratch.zero_()
        dist.all_reduce(scratch, group=group)

    return SideCollective(fn, shadow=shadow, process_group=group, device=_device(template, group),
                          name=name or "mean")


def barrier(group: Any = None, *, name: str | None = None) -> SideCollective:
    """A side collective for ``dist.barrier(group)``, shadowed by a barrier.

    Args:
        group: the process group (``None``: the default group, following the Join's).
        name: for messages (default ``"barrier"``).

    Returns:
        The :class:`~joinkit.SideCollective`; call it with no arguments.
    """

    def fn() -> None:
        dist.barrier(group=group)

    return SideCollective(fn, shadow=fn, process_group=group, name=name or "barrier")


def broadcast(like: torch.Tensor, src: int = 0, group: Any = None,
              *, name: str | None = None) -> SideCollective:
    """A side collective for ``dist.broadcast(tensor, src, group)``.

    Calling it broadcasts in place and returns ``tensor``. A joined ``src``
    broadcasts ``like`` as it is then (module doc).

    Args:
        like: a tensor of the shape, dtype and device every call broadcasts;
            also what a joined ``src`` sends.
        src: the sending rank (global rank, as ``dist.broadcast`` takes).
        group: the process group (``None``: the default group, following the Join's).
        name: for messages (default ``"broadcast"``).

    Returns:
        The :class:`~joinkit.SideCollective`.
    """
    template = like.detach()
    scratch = torch.empty(template.shape, dtype=template.dtype, device=template.device)

    def fn(tensor: torch.Tensor) -> torch.Tensor:
        _check_like(tensor, template, name or "broadcast")
        wire = _wire(tensor, name or "broadcast")
        dist.broadcast(wire, src=src, group=group)
        _write_back(tensor, wire)
        return tensor

    def shadow() -> None:
        scratch.copy_(template)
        dist.broadcast(scratch, src=src, group=group)

    return SideCollective(fn, shadow=shadow, process_group=group, device=_device(template, group),
                          name=name or "broadcast")


def _reduce_op(op: Any) -> Any:
    if isinstance(op, str):
        found = _OPS.get(op.lower())
        if found is None:
            raise ValueError(f"all_reduce(op={op!r}): use one of {sorted(_OPS)}")
        return found
    if op in _OPS.values():
        return op
    if op == dist.ReduceOp.AVG:
        raise ValueError(
            "all_reduce(op=AVG) cannot be shadowed: a joined rank would count in the "
            "divisor. Use joinkit.adapters.torch.collectives.mean(like), the mean over the "
            "ranks that have not joined"
        )
    raise ValueError(f"all_reduce(op={op!r}) has no identity a joined rank could contribute; "
                     f"use one of {sorted(_OPS)}")


def _identity(op: Any, dtype: torch.dtype) -> float | int | bool:
    if op == dist.ReduceOp.SUM:
        return 0
    if op == dist.ReduceOp.PRODUCT:
        return 1
    lowest = op == dist.ReduceOp.MAX
    if dtype == torch.bool:
        return not lowest
    if dtype.is_floating_point:
        return float("-inf") if lowest else float("inf")
    info = torch.iinfo(dtype)
    return info.min if lowest else info.max


def _check_like(tensor: Any, like: torch.Tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}(tensor): expected a torch.Tensor, got {type(tensor).__qualname__}")
    if tensor.shape != like.shape or tensor.dtype != like.dtype or tensor.device != like.device:
        raise ValueError(
            f"{name} was built for {tuple(like.shape)} {like.dtype} tensors on {like.device} "
            f"(its like=), but got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}: a "
            "joined rank shadows with like's shape, which must match every call; build it "
            "with like= a tensor of the call's shape"
        )


def _wire(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """What goes to the library for ``tensor``: itself if contiguous, else a copy (module doc)."""
    wire = tensor.detach()
    if wire.is_contiguous():
        return wire
    if shares_elements(wire):
        raise ValueError(
            f"{name}(tensor): the tensor's elements share memory (shape {tuple(wire.shape)}, "
            f"strides {wire.stride()}: an expand()ed or as_strided view), but {name} writes "
            "a result into each element; pass a tensor of its own, e.g. tensor.clone()"
        )
    return wire.contiguous()


def _write_back(tensor: torch.Tensor, wire: torch.Tensor) -> None:
    if not tensor.is_contiguous():  # then wire is _wire's copy
        tensor.detach().copy_(wire)


def _device(like: torch.Tensor, group: Any) -> Any:
    return None if group is None else like.device
