"""A joined rank's shadow of a model's iteration: the model's own forward and
backward, replayed on an empty batch.

Theory of operation
-------------------
A joined rank must issue the collectives of an active rank's iteration, in the
same order (gloo pairs collectives in issue order), and contribute nothing to
their results. When those collectives run *inside* the model — FSDP2's
parameter all-gathers (prefetched in backward) and gradient reduce-scatters,
SyncBatchNorm's statistics exchange in forward and its all-reduce in backward,
a tensor-parallel layer, a user's own all-reduce — the one program that issues
exactly that sequence is the model itself. So the joined rank *replays* the
iteration:

- forward on an **empty batch**: every input tensor with 0 rows along dim 0
  (same dtype, device and other dims as a real input). Layers that exchange
  statistics then contribute a count of 0 (torch's SyncBatchNorm filters
  zero-count entries out, by design), so the active ranks' statistics are
  exactly what they would be without this rank;
- backward from a **zero loss**, ``sum(outputs) * 0``: every gradient this rank
  feeds into a reduction is zero, so sums and averages over the active ranks
  are unchanged, while the reductions themselves (and FSDP's backward
  all-gathers) run as on an active rank.

*Buffers.* A replay must not move this rank's buffers: BatchNorm's running
statistics over an empty batch would become NaN. Every buffer is saved before
the replay and restored after it, except those of modules whose forward
exchanges statistics with the other ranks (``torch.nn.SyncBatchNorm``, or any
module with ``join_forward_collectives = True``): their update uses the global
statistics of the active ranks' union batch, which is the update the active
ranks apply too, so keeping it keeps this rank's buffers equal to theirs.

*The input.* A rank that had inputs replays with the shape of its own first
input in the Join. A rank that had none gets a peer's: the first forward of
every rank in a Join publishes its input's *spec* (the structure of the
arguments, each tensor's trailing shape, dtype and device type, non-tensor
arguments as they are) to the c10d store under a key every rank derives the
same way (the process group's name and a per-group count of Joins), *before*
it sends that iteration's heartbeat. A joined rank only shadows once a count
has shown an active rank, whose heartbeat went out after its spec, so the
store read never waits. ``Join(..., shadow_input=x)`` overrides all of this:
``x`` (a tensor, a tuple of positional arguments, or ``(args, kwargs)``) is
used *as given* — pass an empty batch (``batch[:0]``), or any batch for a model
without statistics-exchanging layers, whose contribution the zero loss cancels;
a callable ``x`` is called at each replay and returns such an ``x`` (for an
input known only once the loop ran: Lightning's FSDP1, whose root module's
forward is not the step's).
The autocast state of the first forward travels with the spec, so the replay
runs under the same autocast as the active ranks.

Requirements on the model (docs/guide/forward-collectives.md lists them):

1. the collectives of an iteration do not depend on the input's values or its
   batch size (no data-dependent control flow around collectives);
2. it accepts a batch of 0 samples (or pass ``shadow_input``);
3. dim 0 of every input tensor is the batch dimension;
4. one forward per iteration, and one backward after each forward that runs
   with gradients enabled;
5. every output tensor that requires grad feeds the loss (the zero loss sums
   them all; a collective reached only from an unused output would be extra).
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from joinkit import LocalProtocolError

__all__ = [
    "TensorSpec",
    "InputSpec",
    "InputSource",
    "has_forward_collectives",
    "replay",
]

#: What ``Join(..., shadow_input=...)`` accepts: see :func:`_as_call`.
SHADOW_INPUT = "shadow_input"

_HINT = (
    "joinkit replays the model's forward and backward on a joined rank with an "
    "empty batch (0 rows along dim 0 of every input tensor) and a zero loss; if "
    "the model cannot take such a batch, pass Join(..., shadow_input=...) with an "
    "input it accepts (see docs/guide/forward-collectives.md)"
)


def syncs_in_forward(module: nn.Module) -> bool:
    """Whether ``module`` itself exchanges data with other ranks in its forward."""
    return isinstance(module, nn.SyncBatchNorm) or getattr(
        module, "join_forward_collectives", False
    ) is True


def has_forward_collectives(module: nn.Module) -> bool:
    """Whether any submodule of ``module`` runs collectives in its forward.

    ``torch.nn.SyncBatchNorm``, or a module that declares
    ``join_forward_collectives = True``.
    """
    return any(syncs_in_forward(m) for m in module.modules())


# -- the input ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TensorSpec:
    """One input tensor, without its data: what a replay needs to build it empty.

    Attributes:
        shape: the dims after dim 0 (the whole shape of a 0-dim tensor).
        batched: whether the tensor has a dim 0 to empty.
        dtype: its dtype.
        device_type: ``"cpu"``, ``"cuda"``, ...; the replaying rank uses its own
            device of that type.
        requires_grad: whether the input required grad.
    """

    shape: tuple[int, ...]
    batched: bool
    dtype: torch.dtype
    device_type: str
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        batched = tensor.dim() > 0
        return cls(
            shape=tuple(tensor.shape[1:] if batched else tensor.shape),
            batched=batched,
            dtype=tensor.dtype,
            device_type=tensor.device.type,
            requires_grad=tensor.requires_grad,
        )

    def empty(self, device: torch.device) -> torch.Tensor:
        """The tensor with 0 rows (a 0-dim tensor: zero), on ``device`` if types match."""
        where = device if device.type == self.device_type else torch.device(self.device_type)
        if self.batched:
            tensor = torch.empty((0, *self.shape), dtype=self.dtype, device=where)
        else:
            tensor = torch.zeros(self.shape, dtype=self.dtype, device=where)
        if self.requires_grad and (tensor.is_floating_point() or tensor.is_complex()):
            tensor.requires_grad_(True)
        return tensor


@attrs.frozen(kw_only=True)
class InputSpec:
    """A forward's arguments with every tensor replaced by its :class:`TensorSpec`.

    Attributes:
        args: the positional arguments.
        kwargs: the keyword arguments.
        autocast: ``(device_type, dtype)`` of the autocast the forward ran under,
            or ``None``.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    autocast: tuple[str, torch.dtype] | None = None

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str) -> InputSpec:
        def spec(leaf: Any) -> Any:
            return TensorSpec.of(leaf) if isinstance(leaf, torch.Tensor) else leaf

        autocast = None
        if torch.is_autocast_enabled(device_type):
            autocast = (device_type, torch.get_autocast_dtype(device_type))
        return cls(
            args=tuple(pytree.tree_map(spec, list(args))),
            kwargs=dict(pytree.tree_map(spec, dict(kwargs))),
            autocast=autocast,
        )

    def materialize(self, device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Fresh arguments: every tensor empty along dim 0, on ``device``."""

        def build(leaf: Any) -> Any:
            return leaf.empty(device) if isinstance(leaf, TensorSpec) else leaf

        return (
            tuple(pytree.tree_map(build, list(self.args))),
            dict(pytree.tree_map(build, dict(self.kwargs))),
        )


def _as_call(shadow_input: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``shadow_input`` as (args, kwargs): a tensor, a tuple of args, or (args, kwargs)."""
    if isinstance(shadow_input, tuple) and len(shadow_input) == 2 and isinstance(
        shadow_input[1], dict
    ) and isinstance(shadow_input[0], (tuple, list)):
        return tuple(shadow_input[0]), dict(shadow_input[1])
    if isinstance(shadow_input, (tuple, list)):
        return tuple(shadow_input), {}
    return (shadow_input,), {}


# Per process group name, how many replaying joinables have been given hooks:
# every rank builds the same Joins in the same order (the agreement check makes
# sure of the count), so the n-th one's key is the same on every rank.
_serials: dict[str, int] = {}


class InputSource:
    """Where one Join's replays on this rank get their input (module doc).

    Args:
        group: the process group of the model's collectives (names the key).
        shadow_input: ``Join``'s ``shadow_input`` keyword, or ``None``.
    """

    def __init__(self, group: Any, shadow_input: Any = None) -> None:
        name = str(getattr(group, "group_name", "") or "default")
        serial = _serials.get(name, 0)
        _serials[name] = serial + 1
        self.key = f"joinkit/shadow_input/{name}/{serial}"
        # A callable is asked at each replay (an input known only once the loop ran).
        self.given: Any = (None if shadow_input is None else
                           shadow_input if callable(shadow_input) else _as_call(shadow_input))
        self.spec: InputSpec | None = None
        self.published = False

    @property
    def needs_record(self) -> bool:
        """Whether the next forward's input should be recorded (the first one)."""
        return self.spec is None and self.given is None

    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str) -> None:
        """Remember this rank's first input of the Join and publish it for the peers."""
        spec = InputSpec.of(args, kwargs, device_type)
        self.spec = spec
        store = _store()
        if store is None:
            return  # a single process group without a store: nobody to tell
        try:
            payload = pickle.dumps(spec)
        except Exception as error:
            raise LocalProtocolError(
                "joinkit could not publish this rank's input spec for ranks that have no "
                f"inputs (a non-tensor argument does not pickle: {error!r}); pass "
                "Join(..., shadow_input=...)"
            ) from error
        store.set(self.key, payload)
        self.published = True

    def close(self) -> None:
        """Delete the published spec once the Join is over.

        Safe once this rank has left the Join: a rank reads the key before its
        first replay, whose collectives every active rank must match before
        it can finish its loop.
        """
        if not self.published:
            return
        self.published = False
        store = _store()
        try:
            if store is not None:
                store.delete_key(self.key)
        except (RuntimeError, NotImplementedError):
            pass  # a store without deletion keeps one small key

    def inputs(self, device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """Arguments for one replay, and the autocast it runs under (or ``None``)."""
        if callable(self.given):
            args, kwargs = _as_call(self.given())
            return args, kwargs, None
        if self.given is not None:
            return self.given[0], self.given[1], None
        if self.spec is None:
            store = _store()
            if store is None:
                raise LocalProtocolError(
                    "this rank had no inputs in the Join and there is no c10d store to "
                    "read a peer's input spec from: pass Join(..., shadow_input=...)"
                )
            self.spec = pickle.loads(store.get(self.key))  # published before a heartbeat
        args, kwargs = self.spec.materialize(device)
        return args, kwargs, self.spec.autocast


def _store() -> Any:
    """The default process group's store, or ``None`` without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


# -- the replay ----------------------------------------------------------------------


def zero_loss(output: Any) -> torch.Tensor | None:
    """``sum(outputs) * 0`` over every output tensor that requires grad, or ``None``."""
    tensors = [
        leaf for leaf in pytree.tree_leaves(output)
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad
    ]
    if not tensors:
        return None
    total = tensors[0].sum()
    for tensor in tensors[1:]:
        total = total + tensor.sum().to(total.device)
    return total * 0.0


@contextlib.contextmanager
def kept_buffers(module: nn.Module) -> Iterator[None]:
    """Restore every buffer the body changes, except those of statistics-exchanging modules."""
    saved = [
        (owner, name, buffer, buffer.detach().clone())
        for owner in module.modules() if not syncs_in_forward(owner)
        for name, buffer in owner._buffers.items() if buffer is not None
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, name, buffer, value in saved:
                owner._buffers[name] = buffer
                buffer.copy_(value)


def replay(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    backward: bool,
    autocast: tuple[str, torch.dtype] | None = None,
    inference: bool = False,
) -> None:
    """Run ``module``'s forward (and backward from a zero loss) as a joined rank's shadow.

    Args:
        module: the model, called as in the training loop.
        args: positional arguments (usually an empty batch).
        kwargs: keyword arguments.
        backward: run backward; also decides whether forward records a graph
            (the active ranks' ``torch.is_grad_enabled()``).
        autocast: ``(device_type, dtype)`` to run forward under, or ``None``.
        inference: run forward under ``torch.inference_mode()`` (as the active
            ranks did; implies no backward).

    Raises:
        LocalProtocolError: backward was expected but no output requires grad.
    """
    amp = (torch.autocast(autocast[0], dtype=autocast[1]) if autocast is not None
           else contextlib.nullcontext())
    try:
        with kept_buffers(module):
            mode = (torch.inference_mode() if inference and not backward
                    else torch.set_grad_enabled(backward))
            with mode, amp:
                output = module(*args, **kwargs)
            if backward:
                loss = zero_loss(output)
                if loss is None:
                    raise LocalProtocolError(
                        f"a joined rank's replay of {type(module).__qualname__} gave no "
                        "output that requires grad, so it cannot shadow the backward pass"
                    )
                torch.autograd.backward(loss)
    except Exception as error:
        if hasattr(error, "add_note"):
            error.add_note(_HINT)
        raise
