"""FSDP2 in ``Join([model, optimizer], on_rank_loss="finish")`` (gloo, CPU).

Theory of operation
-------------------
FSDP2's per-unit all-gathers (forward, backward prefetch) and reduce-scatters
(backward) run on FSDP's own process group, not through the elastic
TorchGroup's units (``backends._torch_elastic``), so a death inside one could
not be recovered; and each rank holds the only copy of its parameter shard.
While a finish-mode Join lasts, this module takes FSDP's collectives away
instead, exactly, for any optimizer whose state is per-parameter tensors
shaped like the parameter plus scalars (SGD with or without momentum, Adam,
AdamW): the model and its optimizer state are *full while the Join lasts*.

- *Entry* (every rank, before the loop): one unit (a SUM of "this rank has
  gradients") refuses a model that still holds sharded gradients (their other
  shards would be lost); then every ``fully_shard`` unit is unsharded with
  FSDP's own all-gather (``FSDPModule.unshard``), resharding after forward
  and gradient reduction are switched off in every parameter group
  (``post_forward_mesh_info = None``, ``reduce_grads = False``,
  ``reshard_after_backward = False``), and the optimizer's parameter groups
  hold the *unsharded* parameters instead of the sharded ones. The optimizer's
  state becomes full state for them (``ElasticFSDP._gather_state``): each
  rank writes its shard of every ``Shard(0)`` state tensor at the shard's
  offset into zeros, plus a flag at its rank, and ONE float64 SUM unit
  through the Join's TorchGroup gives every rank the full tensors exactly
  (each element has one writer); scalars (``step``) stay as they are. A rank
  that died in that unit before any survivor received its part leaves its
  flag at 0 on every survivor alike: each raises ``LocalProtocolError``
  before the loop (the optimizer gets its shards' state back). From then on a
  forward and a backward send no FSDP collective at all: FSDP finds its
  parameters unsharded and leaves the unsharded gradients in place.
- *One iteration is a heartbeat and one gradient unit*, as with DDP
  (``adapters._ddp_elastic``). The root's forward pre-hook sends the
  heartbeat (``Join.notify_join_context``); a forward with gradients puts an
  autograd pre-hook on its outputs' nodes, which moves this rank's earlier
  gradients aside and queues an end-of-backward callback; the callback
  all-reduces every unsharded gradient (zeros where none), one "has a
  gradient" element per parameter and a 1, as ONE unit through the Join's
  TorchGroup, divides by the world size at entry
  (``divide_by_initial_world_size=True``) or by the ranks that contributed,
  and puts ``earlier + average`` back (``None`` where no rank had a
  gradient). A forward without gradients sends a zero unit at once; a forward
  with gradients and no backward is found before the next heartbeat (the zero
  unit is sent, then ``LocalProtocolError``). A rank that dies between its
  heartbeat and its unit has not consumed that input; one that dies after
  the unit has (the survivors applied its gradient).
- *Every active rank steps every full parameter.* The averaged gradient is the
  same, bit for bit, on every active rank, and so are the parameters and the
  full optimizer state, so ``optimizer.step()`` gives every rank the same
  full parameters and state. A joined rank's shadow sends the zero unit and
  steps nothing; the post hook gives every survivor the last joiners' model
  and optimizer state, as DDP's does for the model: one
  ``all_gather_object`` of each rank's state layout (every rank takes the
  first last joiner's, or rank 0's if none survived, with zeros for an entry
  it lacked), then one unit of the last joiners' parameters, state tensors
  and a count, summed in float64.
- *Exit without a loss*: each rank copies its own slice of every full
  parameter (and gradient, and optimizer state tensor, as a ``Shard(0)``
  DTensor of the parameter's spec) into its shard, the optimizer gets the sharded
  parameters back, FSDP's settings come back and every unit reshards. *After
  a loss*: every survivor holds the full parameters, so FSDP is re-sharded
  over the survivors: a ``DeviceMesh.from_group`` over the rebuilt group
  (``adapters._ddp_elastic.c10d_group``), new ``FSDPParam`` objects in every
  parameter group built from the full parameters, and each new sharded
  parameter swapped into the old parameter object
  (``torch.utils.swap_tensors``), so the optimizer and the user's references
  go on holding the model's parameters; the optimizer state is sliced as the
  parameters are, into DTensors of the new mesh. Steps after the Join are
  FSDP again, over the survivors.
- *Refused on entry* (a ``ValueError`` on every rank, before any collective):
  an optimizer state entry that is a tensor but neither a ``Shard(0)``
  DTensor shaped like its parameter nor a 0-dim plain tensor,
  an optimizer over parameters the model does not hold, any joinable but
  ``[model]`` or ``[model, optimizer]``, HSDP or a 2-D mesh, a shard placement
  other than ``Shard(0)``, ``reshard_after_forward`` given as an int, mixed
  precision or CPU offload, a CUDA model, parameters of more than one dtype,
  gradient sync switched off at entry (``set_requires_gradient_sync(False)``).

The memory while the Join lasts: the full parameters, gradients and optimizer
state on every rank, as DDP (not FSDP's shards); the entry's state unit is
float64, the state's full size.

Standard library, torch and joinkit; imported by ``adapters.fsdp`` only in
finish mode. Every FSDP member it uses is listed in ``adapters._torch_private``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from . import _compat
from ._ddp_elastic import take_last_joiners
from ._fsdp_state import param_groups as _param_groups

__all__ = ["ElasticFSDP", "refusal"]

_HEAD = "Join(on_rank_loss='finish') with an FSDP2 model: "
_FULLY_SHARD = "torch.distributed.fsdp._fully_shard"




def _odd_state(model: Any, optimizer: Any) -> str | None:
    """The first optimizer state entry that cannot be gathered, or ``None``.

    Gathered: a DTensor shaped like its parameter, sharded ``Shard(0)`` on the
    parameter's mesh (Adam's moments, SGD's momentum buffer). Kept as it is: a
    0-dim tensor (``step``) and any non-tensor value. The same on every rank
    (global shapes and placements agree across ranks).

    Args:
        model: the root ``fully_shard`` module.
        optimizer: the optimizer listed after it.

    Returns:
        ``"'key' of parameter NAME (...)"``, or ``None``.
    """
    from torch.distributed.tensor import DTensor

    names = {id(p): name for name, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if not isinstance(value, torch.Tensor) or (
                        value.dim() == 0 and not isinstance(value, DTensor)):
                    continue
                if (isinstance(value, DTensor) and isinstance(param, DTensor)
                        and value.shape == param.shape
                        and value.placements == param.placements
                        and value.device_mesh == param.device_mesh):
                    continue
                what = (f"a DTensor {tuple(value.shape)} {value.placements}"
                        if isinstance(value, DTensor) else
                        f"a plain tensor {tuple(value.shape)}")
                return f"{key!r} of parameter {names.get(id(param), '?')} ({what})"
    return None


def refusal(model: Any, joinables: list[Any], adapter: Any) -> str | None:
    """Why this Join cannot hold the FSDP2 ``model`` in finish mode, or ``None``.

    The same on every rank (the model's and the optimizer's settings agree).

    Args:
        model: the root ``fully_shard`` module.
        joinables: the Join's joinables (adapters), in order.
        adapter: the model's adapter (``adapters.fsdp.FSDPJoinable``).

    Returns:
        The message (what is wrong and how to fix it), or ``None``.
    """
    from .optim import OptimizerJoinable

    works = ("What works: Join([model, optimizer], on_rank_loss='finish') with a "
             "fully_shard model over a 1-D CPU mesh (gloo) and an optimizer whose state "
             "is per-parameter tensors shaped like the parameter plus scalars (SGD, "
             "SGD with momentum, Adam, AdamW); or use on_rank_loss='raise' (the default) "
             "and restart from a checkpoint")
    if not joinables or joinables[0] is not adapter or len(joinables) > 2 or (
            len(joinables) == 2 and not isinstance(joinables[1], OptimizerJoinable)):
        return (_HEAD + "the Join must be exactly [model] or [model, optimizer] in this "
                "version (no GradScaler, LR scheduler or other joinable). " + works)
    groups = _param_groups(model)
    for group in groups:
        info = group.mesh_info
        if type(info).__name__ != "FSDPMeshInfo" or info.mesh.ndim != 1:
            return (_HEAD + "HSDP and 2-D meshes are not in this version (a dead rank's "
                    "replica group would need rebuilding too). " + works)
        if group.post_forward_mesh_info not in (None, info):
            return (_HEAD + "reshard_after_forward given as an int is not in this "
                    "version: pass True or False. " + works)
        if group.device.type != "cpu":
            return (_HEAD + "the model is on a CUDA device; finish mode is gloo on the "
                    "CPU only (docs/elastic-torch.md). " + works)
        if not group.reduce_grads:
            return (_HEAD + "gradient sync is off at the Join's entry "
                    "(set_requires_gradient_sync(False)): call "
                    "model.set_requires_gradient_sync(True) before the Join. " + works)
        for fsdp_param in group.fsdp_params:
            if fsdp_param.fsdp_placement.dim != 0:
                return (_HEAD + f"a parameter is sharded as {fsdp_param.fsdp_placement}; "
                        "only Shard(0) (fully_shard's default) is in this version. " + works)
            if fsdp_param.offload_to_cpu:
                return _HEAD + "CPU offload is not in this version. " + works
            policy = fsdp_param.mp_policy  # each parameter's (2.15 keeps no group's)
            if policy.param_dtype is not None or policy.reduce_dtype is not None:
                return _HEAD + "mixed precision is not in this version. " + works
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if len(dtypes) > 1:
        return (_HEAD + f"the parameters have {len(dtypes)} dtypes: one unit per backward "
                "needs one dtype. " + works)
    if len(joinables) == 2:
        optimizer = joinables[1].obj
        odd = _odd_state(model, optimizer)
        if odd is not None:
            return (_HEAD + f"its optimizer's state entry {odd} is neither a tensor "
                    "sharded like its parameter (Shard(0), the parameter's shape) nor a "
                    "scalar: it cannot be gathered into the full state the Join steps. "
                    + works)
        mine = {id(p) for p in model.parameters()}
        if any(id(p) not in mine for g in optimizer.param_groups for p in g["params"]):
            return (_HEAD + "the optimizer steps parameters the model does not hold "
                    "(no unit averages their gradients). Build it over "
                    "model.parameters(). " + works)
    return None


class ElasticFSDP:
    """One FSDP2 model inside one finish-mode Join (module doc).

    Args:
        adapter: the model's ``FSDPJoinable`` (checked by :func:`refusal`).
        join: the Join (its backend is the elastic TorchGroup).
        optimizer: the optimizer listed after the model, or ``None``.
        divide_by_initial_world_size: the Join's argument.
        in_hook: whether the adapter is running a shadow round now.

    Raises:
        ValueError: the model holds gradients at entry (on every rank alike,
            after one unit).
    """

    def __init__(self, adapter: Any, join: Any, optimizer: Any,
                 divide_by_initial_world_size: bool, in_hook: Callable[[], bool]) -> None:
        model = adapter.model
        self.adapter = adapter
        self.model = model
        self.join = join
        self.group = join.backend
        self.world = self.group.world_size  # at the Join's entry
        self.backend = self.group.process_group
        self.entry_process_group = adapter.join_process_group
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.in_hook = in_hook
        self.optimizer = optimizer
        self.groups = _param_groups(model)
        self.fsdp_params = [p for g in self.groups for p in g.fsdp_params]
        self.expecting = False  # a forward announced a backward that has not come yet
        self.queued = False  # this backward's end-of-backward unit is queued
        self.earlier: list[torch.Tensor | None] = []
        self.handles: list[Any] = []
        # Gradients left in the shards would lose their other shards: refuse, everywhere.
        held = any(p.sharded_param.grad is not None for p in self.fsdp_params)
        flag = torch.tensor([1.0 if held else 0.0], dtype=torch.float64)
        self.group.all_reduce(flag)
        if float(flag[0].item()) > 0:
            raise ValueError(
                _HEAD + f"{int(flag[0].item())} rank(s) hold gradients at the Join's entry; "
                "a finish-mode Join starts from none (a dead rank's gradient shards would "
                "be lost). Call optimizer.zero_grad() (set_to_none=True, the default) "
                "before the Join, or use on_rank_loss='raise'")
        model._get_fsdp_state()._lazy_init()
        self.saved = [(g, g.reduce_grads, g.reshard_after_backward, g.post_forward_mesh_info)
                      for g in self.groups]
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.unshard()  # FSDP's all-gather on its group, every rank alike
        for group in self.groups:
            group.reduce_grads = False
            group.reshard_after_backward = False
            group.post_forward_mesh_info = None  # no reshard after forward
        # The parameters of the Join: unsharded, the same objects FSDP's forward uses.
        self.full = {id(p.sharded_param): p._unsharded_param for p in self.fsdp_params}
        self.params = [p._unsharded_param for p in self.fsdp_params
                       if p._unsharded_param.requires_grad]
        self.saved_optimizer: list[list[Any]] = []
        if optimizer is not None:
            for param_group in optimizer.param_groups:
                self.saved_optimizer.append(list(param_group["params"]))
                param_group["params"] = [self.full.get(id(p), p)
                                         for p in param_group["params"]]
            try:
                self._gather_state()
            except BaseException:
                self._undo_entry()
                raise
        self.handles = [
            model.register_forward_pre_hook(self.pre_forward, prepend=True),
            model.register_forward_hook(self.post_forward),
        ]

    def _gather_state(self) -> None:
        """Each sharded parameter's optimizer state becomes full state: ONE unit.

        Every rank writes its shard of every gathered entry (``_odd_state``)
        into zeros at the shard's offset and one flag at its entry rank; a
        SUM in float64 gives the full tensors exactly (each element has one
        writer). A rank that died in the unit before any survivor received its
        part leaves its flag at 0 on every survivor alike: the Join is left
        with a ``LocalProtocolError`` before its loop.
        """
        from torch.distributed.tensor import DTensor

        state = self.optimizer.state
        moved: list[tuple[Any, Any, dict[str, Any]]] = []
        for fsdp_param in self.fsdp_params:
            sharded = fsdp_param.sharded_param
            if sharded in state:
                moved.append((fsdp_param, self.full[id(sharded)], state.pop(sharded)))
        parts: list[torch.Tensor] = []
        slots: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        for fsdp_param, full, entries in moved:
            for key, value in entries.items():
                if not isinstance(value, DTensor):
                    continue
                local = value.to_local()
                buffer = torch.zeros(full.shape, dtype=torch.float64)
                if local.numel() > 0:
                    start = fsdp_param.mesh_info.shard_mesh_rank * \
                        fsdp_param.padded_sharded_param_size[0]
                    buffer.narrow(0, start, local.shape[0]).copy_(local.detach())
                parts.append(buffer.reshape(-1))
                slots.append((entries, key, value))
        # The ranks must hold state of the same layout (the unit's size follows
        # from it): one agreement first, so that a difference is an error on
        # every rank, not a collective of mismatched sizes.
        layout = repr([(index, key, tuple(value.shape))
                       for index, (entries, key, value) in enumerate(slots)]).encode()
        digest = int.from_bytes(hashlib.blake2b(layout, digest_size=8).digest(), "big") >> 1
        if not self.group.all_agree(digest):
            self._restore_optimizer(moved)
            raise ValueError(
                _HEAD + "the ranks' optimizers hold state for different parameters or of "
                "different shapes at the Join's entry (one rank stepped parameters another "
                "did not): step the optimizer alike on every rank before the Join (e.g. a "
                "step on every rank, or none)")
        flags = torch.zeros(self.world, dtype=torch.float64)
        flags[self.fsdp_params[0].mesh_info.shard_mesh_rank] = 1.0
        flat = torch.cat([*parts, flags])
        self.group.all_reduce(flat)
        missing = [r for r in range(self.world) if float(flat[-self.world + r].item()) < 1]
        if missing:
            from joinkit import LocalProtocolError

            self._restore_optimizer(moved)
            raise LocalProtocolError(
                _HEAD + f"rank(s) {missing} died while the optimizer state's shards were "
                "gathered at the Join's entry, before any survivor received them: that "
                "state is lost. Restart from a checkpoint")
        start = 0
        for entries, key, value in slots:
            full_shape = value.shape
            n = full_shape.numel()
            entries[key] = flat[start:start + n].view(full_shape).to(value.dtype).clone()
            start += n
        for _, full, entries in moved:
            state[full] = entries

    def _restore_optimizer(self, moved: list[tuple[Any, Any, dict[str, Any]]]) -> None:
        """The optimizer's state as it was before :meth:`_gather_state` (its shards')."""
        state = self.optimizer.state
        for fsdp_param, _, entries in moved:
            state[fsdp_param.sharded_param] = entries

    def _undo_entry(self) -> None:
        """The entry failed before the loop: the optimizer's sharded parameters and
        FSDP's settings back, every unit resharded (local: no collective), so that
        FSDP outside the Join reduces its gradients as before."""
        self._restore_settings()
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    # -- an active rank's iteration --------------------------------------------------

    def pre_forward(self, module: Any, args: Any) -> None:
        """The root's forward pre-hook: settle the last forward, send the heartbeat."""
        if self.in_hook():
            return None
        self.settle()
        from joinkit import Join

        Join.notify_join_context(self.adapter)
        return None

    def post_forward(self, module: Any, args: Any, output: Any) -> None:
        """After an active rank's forward: announce its backward, or send a zero unit."""
        if self.in_hook():
            return None
        nodes: list[Any] = []
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            for tensor in _tensors(output):
                node = tensor.grad_fn
                if node is not None and all(node is not n for n in nodes):
                    nodes.append(node)
        if not nodes:
            self.unit(contributes=False)  # a forward-only iteration: the joined ranks' unit
            return None
        self.expecting = True
        self.queued = False
        for node in nodes:
            node.register_prehook(self._backward_starts)
        return None

    def _backward_starts(self, grad_outputs: Any) -> None:
        if self.queued or not self.expecting:
            return None
        self.queued = True
        # This backward's own gradients, apart from the earlier ones (accumulation).
        self.earlier = [p.grad for p in self.params]
        for param in self.params:
            param.grad = None
        engine: Any = torch.autograd.Variable._execution_engine
        engine.queue_callback(self._backward_ends)
        return None

    def _backward_ends(self) -> None:
        self.expecting = False
        self.queued = False
        earlier, self.earlier = self.earlier, []
        self.unit(contributes=True, earlier=earlier)

    def unit(self, contributes: bool, earlier: list[torch.Tensor | None] | None = None,
             ) -> None:
        """The gradient unit: every gradient, a has-gradient flag each, and a count."""
        params = self.params
        if not params:
            return
        dtype = params[0].dtype
        parts = []
        flags = torch.zeros(len(params) + 1, dtype=dtype)
        for index, param in enumerate(params):
            grad = param.grad if contributes else None
            if grad is None:
                parts.append(torch.zeros(param.numel(), dtype=dtype))
            else:
                parts.append(grad.detach().reshape(-1).to(dtype))
                flags[index] = 1.0
        flags[-1] = 1.0 if contributes else 0.0
        flat = torch.cat([*parts, flags])
        self.group.all_reduce(flat)
        if not contributes:
            return
        count = float(flat[-1].item())
        divisor = float(self.world) if self.divide_by_initial_world_size else max(count, 1.0)
        start = 0
        total = sum(p.numel() for p in params)
        for index, param in enumerate(params):
            n = param.numel()
            before = earlier[index] if earlier else None
            if float(flat[total + index].item()) > 0:
                average = flat[start:start + n].view_as(param).div(divisor)
                param.grad = average if before is None else before.add_(average)
            else:
                param.grad = before
            start += n

    def settle(self) -> None:
        """Before this rank's next heartbeat: refuse a forward that got no backward.

        Raises:
            LocalProtocolError: the last forward had gradients enabled and no
                backward followed (the joined ranks' unit was matched first).
        """
        if not self.expecting:
            return
        self.expecting = False
        self.queued = False
        self.unit(contributes=False)
        from joinkit import LocalProtocolError

        raise LocalProtocolError(
            "an FSDP2 model ran a forward with gradients enabled and no backward after "
            "it inside Join(on_rank_loss='finish'): joined ranks shadow one gradient "
            "all-reduce per forward. Run forward-only iterations under `with "
            "torch.no_grad():` and follow every other forward by a backward. (joinkit "
            "matched the all-reduce the joined ranks were in.)")

    # -- a joined rank ---------------------------------------------------------------

    def shadow(self) -> None:
        """A joined rank's shadow round: the zero unit (it steps nothing)."""
        self.unit(contributes=False)

    def sync_final_model(self, is_last_joiner: bool) -> None:
        """The post hook as one unit: every survivor takes the last joiners' model.

        The last joiners hold the same full parameters; a float64 SUM of theirs
        with a count gives them exactly. If none survived, the survivors take
        the model of the lowest rank of the rebuilt group (as DDP's).
        """
        tensors = [p._unsharded_param.data for p in self.fsdp_params]
        if self.optimizer is not None:
            tensors += self._agree_state(is_last_joiner)
        take_last_joiners(self.group, tensors, is_last_joiner)

    def _agree_state(self, is_last_joiner: bool) -> list[torch.Tensor]:
        """Every survivor's optimizer state laid out as the last joiners': one unit.

        A joined rank's state is as of its join (it steps nothing); the last
        joiners' may have more entries (a parameter's first gradient came
        later). Every rank sends its layout; every rank takes the layout (and
        non-tensor values) of the first last joiner, or of rank 0 of the group
        if none survived (as :func:`take_last_joiners`), with zeros where it
        lacked a tensor; the tensors' values come in the post hook's unit.

        Returns:
            The state tensors, in the agreed order.
        """
        state = self.optimizer.state
        layout: list[tuple[int, Any, tuple[int, ...] | None, str | None, Any]] = []
        for index, fsdp_param in enumerate(self.fsdp_params):
            for key, value in state.get(fsdp_param._unsharded_param, {}).items():
                if isinstance(value, torch.Tensor):
                    layout.append((index, key, tuple(value.shape), str(value.dtype), None))
                else:
                    layout.append((index, key, None, None, value))
        parts = self.group.all_gather_object((is_last_joiner, layout))
        chosen = next((lay for last, lay in parts if last), parts[0][1])
        tensors = []
        fresh: dict[int, dict[str, Any]] = {}
        for index, key, shape, dtype, value in chosen:
            full = self.fsdp_params[index]._unsharded_param
            mine = state.get(full, {}).get(key)
            entries = fresh.setdefault(index, {})
            if shape is None:
                entries[key] = value
                continue
            if not (isinstance(mine, torch.Tensor) and tuple(mine.shape) == shape
                    and str(mine.dtype) == dtype):
                mine = torch.zeros(shape, dtype=getattr(torch, dtype.split(".")[-1]))
            entries[key] = mine
            tensors.append(mine)
        for fsdp_param in self.fsdp_params:
            state.pop(fsdp_param._unsharded_param, None)
        for index, entries in fresh.items():
            state[self.fsdp_params[index]._unsharded_param] = entries
        return tensors

    # -- exit ------------------------------------------------------------------------

    def _restore_settings(self) -> None:
        """The optimizer's sharded parameters and FSDP's settings, as at entry."""
        if self.optimizer is not None:
            for param_group, params in zip(self.optimizer.param_groups,
                                           self.saved_optimizer, strict=True):
                param_group["params"] = params
        for group, reduce_grads, after_backward, post_forward in self.saved:
            group.reduce_grads = reduce_grads
            group.reshard_after_backward = after_backward
            group.post_forward_mesh_info = post_forward

    def close(self) -> None:
        """The Join is over: shard again, over the entry group or the survivors."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self._restore_settings()
        if self.group.process_group is self.backend:
            self._shard_in_place()
        else:
            from ._ddp_elastic import c10d_group

            self._shard_over(c10d_group(self.group, self.entry_process_group))

    def _shard_in_place(self) -> None:
        """No loss: each rank's slice of every full parameter and gradient into its shard."""
        with torch.no_grad():
            for fsdp_param in self.fsdp_params:
                _write_shard(fsdp_param, fsdp_param.sharded_param,
                             fsdp_param.mesh_info.shard_mesh_rank)
                self._shard_state(fsdp_param, fsdp_param.sharded_param,
                                  fsdp_param.mesh_info.shard_mesh_rank,
                                  fsdp_param._unsharded_param)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _shard_over(self, process_group: Any) -> None:
        """After a loss: FSDP re-sharded over the survivors (module doc)."""
        import importlib

        from torch.distributed.device_mesh import DeviceMesh

        common = importlib.import_module(f"{_FULLY_SHARD}._fsdp_common")
        param_module = importlib.import_module(f"{_FULLY_SHARD}._fsdp_param")
        c10d: Any = torch.distributed.distributed_c10d
        name = f"joinkit_elastic_fsdp_{id(process_group)}"
        process_group._set_group_name(name)
        c10d._register_process_group(name, process_group)  # DeviceMesh resolves it by name
        mesh = DeviceMesh.from_group(process_group, "cpu")
        info = common.FSDPMeshInfo(mesh, shard_mesh_dim=0)
        for group, _, _, post_forward in self.saved:
            post = None if post_forward is None else info
            fresh = []
            for old in group.fsdp_params:
                full = old._unsharded_param
                grad = full.grad
                old._post_load_hook_handle.remove()
                with torch.no_grad():
                    data = nn.Parameter(full.detach().clone(),
                                        requires_grad=old.sharded_param.requires_grad)
                new = param_module.FSDPParam(data, old._module_info, info, post,
                                             group.device, None, old.mp_policy,
                                             group.offload_policy)
                new._param_fqn = old._param_fqn
                # The old parameter object takes the new shard: the optimizer's and
                # the user's references stay the model's parameters.
                param = old.sharded_param
                swap: Any = torch.utils.swap_tensors
                swap(param, new.sharded_param)
                new.sharded_param = param
                new._setattr_on_modules(param)
                with torch.no_grad():
                    full.grad = grad
                    _write_shard(new, param, info.shard_mesh_rank, full=full)
                    self._shard_state(new, param, info.shard_mesh_rank, full)
                fresh.append(new)
            group.fsdp_params = fresh
            group.mesh_info = info
            group.post_forward_mesh_info = post
            buffer = _compat.fsdp_all_gather_buffer()
            if buffer is not None:
                setattr(group, buffer, torch.empty(0, device=group.device))
            group._all_gather_result = None
            group._sharded_state = param_module.ShardedState.SHARDED
            group._reset_sharded_params = False
            group.lazy_init()
        self.adapter._group = None  # the Join's group is the new mesh's from now on


    def _shard_state(self, fsdp_param: Any, param: Any, rank: int, full: Any) -> None:
        """``rank``'s slice of ``full``'s optimizer state, as DTensor shards of ``param``."""
        if self.optimizer is None or full not in self.optimizer.state:
            return
        entries = self.optimizer.state.pop(full)
        local = param.to_local()
        rows = local.shape[0] if local.dim() else 0
        start = rank * fsdp_param.padded_sharded_param_size[0]
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 \
                    and value.shape == full.shape:
                piece = (value.detach().narrow(0, start, rows).clone() if local.numel() > 0
                         else value.new_empty(local.shape))
                entries[key] = fsdp_param.to_sharded_dtensor(piece)
        self.optimizer.state[param] = entries


def _write_shard(fsdp_param: Any, param: Any, rank: int, full: Any = None) -> None:
    """``rank``'s slice of the full parameter (and its gradient) into ``param``'s shard."""
    if full is None:
        full = fsdp_param._unsharded_param
    local = param.to_local()  # a view of the shard: copy_ writes it
    rows = local.shape[0] if local.dim() else 0
    start = rank * fsdp_param.padded_sharded_param_size[0]
    if local.numel() > 0:
        local.copy_(full.detach().narrow(0, start, rows))
    grad = full.grad
    if grad is None:
        param.grad = None
    else:
        piece = (grad.detach().narrow(0, start, rows).clone() if local.numel() > 0
                 else grad.new_empty(local.shape))
        param.grad = fsdp_param.to_sharded_dtensor(piece)
    full.grad = None


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output (tensors, tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []
