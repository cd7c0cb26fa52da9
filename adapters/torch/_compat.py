"""The torch internals that differ between the releases joinkit supports, resolved once.

Rules of this room: this module is the one place that knows a torch internal
has more than one spelling (or none) across torch 2.6 and later; the rest of
``adapters.torch`` uses the names and answers resolved here, never a version
number of its own. Each answer asks torch's objects, not ``torch.__version__``
(does the class's code name the member, does its property have a setter), and
is computed once per process (``functools.cache``). ``_private``'s guard table
lists the spelling resolved here, so a torch that has neither spelling, or
whose chosen member cannot be used as joinkit uses it, is refused by the table
with the member it would have used.

==================================  ==========================================
What                                Spellings, newest first (releases seen)
==================================  ==========================================
DDP: "sync buffers in forward"      ``forward_sync_buffers`` (2.13 and later);
                                    ``broadcast_buffers`` (2.6 to 2.12)
FSDP2: a state's parameter groups   ``_fsdp_param_groups``, a list (2.12 and
                                    later); ``_fsdp_param_group``, one or
                                    ``None`` (2.6 to 2.11)
FSDP2: a parameter's gradient kept  ``unsharded_accumulated_grad``, an attribute
across backwards without sync       of its own (2.6 to 2.14); none: 2.15's
                                    read-only property reads the unsharded
                                    parameter's ``.grad`` (joinkit takes that
                                    gradient already)
FSDP2: reset after an exception     ``FSDPModule.reset_iter_state`` (2.13 and
mid-iteration                       later); before, joinkit resets the one state
                                    it can know is clean (the root's pre-forward
                                    ran, nothing issued) and refuses the rest
                                    (:func:`fsdp_reset`)
FSDP2: a group's all-gather buffer  ``_all_gather_output`` (2.9 and later);
(finish mode empties it)            none before (:func:`fsdp_all_gather_buffer`)
FSDP2: reductions that sum          ``gradient_divide_factor`` and
(``divide_by_initial_world_size=    ``force_sum_reduction_for_comms`` (2.8 and
False``)                            later); none before: that feature is refused
                                    (``_private``'s group for it)
gloo's reduce_scatter with          the average (2.9 and later); the *sum*,
``ReduceOp.AVG`` (FSDP2's default   silently (2.6 to 2.8): FSDP2 over gloo trains
for float32)                        wrong there with or without joinkit, so
                                    joinkit refuses it in every Join mode
                                    (nccl is unaffected). The one answer read
                                    from the version
                                    (:func:`gloo_reduce_scatter_averages`)
DDP: copying synced buffers         ``torch.autograd._unsafe_preserve_version_counter``
without bumping their version       (DDP's ``_sync_buffers`` uses it); where torch
counters                            lacks it, a plain copy
                                    (:func:`preserve_version_counter`)
FSDP2 on the CPU                    torch.cpu.Stream.record_event (2.7 and
                                    later); none in 2.6, whose FSDP2 cannot run
                                    on the CPU: refused (:func:`fsdp_runs_on_cpu`)
==================================  ==========================================
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from typing import Any

from .._guards import class_names, names_in, read_only_property

__all__ = [
    "ddp_buffer_sync_flag",
    "preserve_version_counter",
    "ddp_syncs_buffers_in_forward",
    "fsdp_param_groups_attribute",
    "fsdp_param_groups",
    "fsdp_accumulated_grad",
    "fsdp_can_reset",
    "fsdp_reset",
    "fsdp_all_gather_buffer",
    "fsdp_runs_on_cpu",
    "gloo_reduce_scatter_averages",
]

_DDP = "torch.nn.parallel.distributed"
_FSDP = "torch.distributed.fsdp._fully_shard"


def _cls(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


@functools.cache
def ddp_buffer_sync_flag() -> str:
    """DDP's attribute that says whether its forward broadcasts the buffers.

    torch 2.13 renamed ``broadcast_buffers`` (still accepted, deprecated, by the
    constructor) to ``forward_sync_buffers``.
    """
    ddp = _cls(_DDP, "DistributedDataParallel")
    return "forward_sync_buffers" if "forward_sync_buffers" in class_names(ddp) \
        else "broadcast_buffers"


def ddp_syncs_buffers_in_forward(ddp: Any) -> bool:
    """Whether ``ddp``'s forward broadcasts its buffers on DDP's group."""
    return bool(getattr(ddp, ddp_buffer_sync_flag())) and \
        len(getattr(ddp, "modules_buffers", [])) > 0


def preserve_version_counter(tensors: tuple[Any, ...]) -> Any:
    """A context in which copying into ``tensors`` keeps their version counters,
    as DDP's buffer sync copies (a plain context where torch has no such one).

    torch 2.6's ``_unsafe_preserve_version_counter`` takes one tensor, 2.7 and
    later a tensor or a tuple: on 2.6 one context per tensor.
    """
    found = _version_keeper()
    if found is None:
        return contextlib.nullcontext()
    keep, takes_tuple = found
    if takes_tuple:
        return keep(tensors)
    stack = contextlib.ExitStack()
    for tensor in tensors:
        stack.enter_context(keep(tensor))
    return stack


@functools.cache
def _version_keeper() -> tuple[Any, bool] | None:
    """torch's ``_unsafe_preserve_version_counter`` and whether it takes a tuple."""
    import torch

    keep = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
    if keep is None:
        return None
    return keep, "tensors" in inspect.signature(keep.__init__).parameters


@functools.cache
def fsdp_param_groups_attribute() -> str:
    """FSDPState's attribute for its parameter groups (a list, or one group or None)."""
    state = _cls(f"{_FSDP}._fsdp_state", "FSDPState")
    return "_fsdp_param_groups" if "_fsdp_param_groups" in class_names(state) \
        else "_fsdp_param_group"


def fsdp_param_groups(state: Any) -> list[Any]:
    """The parameter groups of one FSDP state, as a list on every release."""
    groups = getattr(state, fsdp_param_groups_attribute())
    if isinstance(groups, (list, tuple)):
        return list(groups)
    return [] if groups is None else [groups]


@functools.cache
def fsdp_accumulated_grad() -> str | None:
    """FSDPParam's own attribute for the gradient it keeps across backwards, or ``None``.

    ``None`` where the name is a read-only property over the unsharded
    parameter's ``.grad`` (torch 2.15): that gradient is the only one, and the
    adapter takes it with the parameter's. Any other read-only property keeps
    the name: the guard table (``Need.SETTABLE``) then refuses it.
    """
    name = "unsharded_accumulated_grad"
    param = _cls(f"{_FSDP}._fsdp_param", "FSDPParam")
    if read_only_property(param, name):
        getter = _property(param, name).fget
        # 2.15 reads it with getattr(self, "_unsharded_param", None): a string.
        code = getattr(getter, "__code__", None)
        strings = {c for c in (code.co_consts if code else ()) if isinstance(c, str)}
        if {"_unsharded_param", "grad"} <= names_in(getter) | strings:
            return None
    return name


def _property(cls: type, name: str) -> property:
    """The property ``name`` of ``cls`` or a base."""
    for klass in cls.__mro__:
        value = vars(klass).get(name)
        if isinstance(value, property):
            return value
    raise LookupError(f"{cls.__name__} has no property {name}")


@functools.cache
def fsdp_can_reset() -> bool:
    """Whether FSDP2 can reset an iteration that an exception left mid-flight.

    ``FSDPModule.reset_iter_state`` (torch 2.13); a rank whose loop raised
    inside an FSDP forward or backward is then shadowed like a joined rank.
    Without it that one case is refused (``fsdp``'s ``_reset_if_mid_iteration``).
    """
    return hasattr(_cls(f"{_FSDP}._fully_shard", "FSDPModule"), "reset_iter_state")


@functools.cache
def fsdp_all_gather_buffer() -> str | None:
    """FSDPParamGroup's all-gather output buffer, kept across all-gathers, or ``None``.

    Finish mode empties it on the groups it rebuilds; releases without it
    allocate each all-gather's output afresh, and there is nothing to empty.
    """
    group = _cls(f"{_FSDP}._fsdp_param_group", "FSDPParamGroup")
    return "_all_gather_output" if "_all_gather_output" in class_names(group) else None


@functools.cache
def fsdp_runs_on_cpu() -> bool:
    """Whether FSDP2 can run on the CPU: its collectives record events on CPU streams.

    torch 2.6's ``torch.cpu.Stream`` has no ``record_event``, which FSDP2's
    all-gather calls; the adapter refuses a CPU model there (torch's own
    forward would fail on every rank).
    """
    cpu = importlib.import_module("torch.cpu")
    return hasattr(cpu.Stream, "record_event")


def fsdp_reset(model: Any, states: list[Any]) -> bool:
    """Reset FSDP's iteration that an exception left mid-flight; ``False`` where it cannot.

    With ``reset_iter_state`` (2.13 and later) torch resets any state. Before,
    the reset joinkit can do is the state an exception right after the root's
    pre-forward leaves (the documented case: right after joinkit's step check,
    before FSDP issued anything): the root state in FORWARD as the iteration's
    root, every other state and every parameter group idle, no all-gather
    pending. That state is put back as a forward finds it.

    Args:
        model: the root ``fully_shard`` module.
        states: its FSDP states, the root's first (``_fsdp_state.states``).
    """
    if fsdp_can_reset():
        model.reset_iter_state()
        return True
    root, *others = states
    idle = type(root._training_state).IDLE
    groups = [group for state in states for group in fsdp_param_groups(state)]
    clean = (root._training_state.name == "FORWARD"
             and root._state_ctx.iter_forward_root is root
             and all(state._training_state == idle for state in others)
             and all(group._training_state.name == "IDLE"
                     and getattr(group, "_all_gather_result", None) is None
                     for group in groups))
    if not clean:
        return False
    root._training_state = idle
    root._state_ctx.iter_forward_root = None
    return True


@functools.cache
def gloo_reduce_scatter_averages() -> bool:
    """Whether gloo's ``reduce_scatter_tensor`` honours ``ReduceOp.AVG``.

    torch 2.6's to 2.8's return the sum, silently (2.9 fixed it); FSDP2 asks
    for AVG for float32 gradients. No object says so short of a collective
    between two ranks, so this one answer is read from the version.
    """
    torch = importlib.import_module("torch")
    major, minor = (int(part) for part in str(torch.__version__).split(".")[:2])
    return (major, minor) >= (2, 9)
