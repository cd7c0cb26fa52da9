"""The Trainer with FSDP (``TrainingArguments(fsdp=...)``, FSDP1 or FSDP2): its epoch's Join.

Theory of operation
-------------------
Under FSDP the Trainer trains the root FSDP module Accelerate built
(``model_wrapped``: a ``FullyShardedDataParallel`` for FSDP1, the model itself
made ``fully_shard`` for FSDP2), whose collectives run inside its forward and
backward, and every rank owns parameter and optimizer shards. So the epoch's
Join takes the FSDP model (``joinkit.adapters.torch.fsdp1`` / ``fsdp``: a
joined rank replays its forward and backward) and the Trainer's torch
optimizer, whose shadow runs :func:`shadow_step` after every shadow round in
which the active ranks' backward synced gradients: the Trainer's own gradient
clipping (``_clip_grad_norm``, Accelerate's ``clip_grad_norm_``: FSDP1's
``model.clip_grad_norm_`` or FSDP2's norm over DTensors, an all-reduce either
way; with ``max_grad_norm=0`` the norm the Trainer logs, ``_get_grad_norm``,
the same all-reduce), the optimizer's step on this rank's shards, and the LR
scheduler's step, as ``_run_epoch`` does after each optimizer step.

*The replay's input* is one token of ``input_ids``, as under DeepSpeed (a
Hugging Face model's attention does not take a batch of 0 rows, and a rank
without data has no batch): its logits times zero give every parameter a zero
gradient.

*Gradient accumulation* keeps FSDP's own ``no_sync`` (Accelerate's
``no_sync``: FSDP1's ``no_sync()``, FSDP2's ``set_requires_gradient_sync``)
inside the Join: every rank runs whole windows (the session pads a rank's last
window with empty micro-batches), the step check tells joined ranks which
micro-batch syncs, and FSDP accumulates the window itself (no gradient is set
aside, unlike DDP's).

*Checkpoints and evaluation in the middle of an epoch* (``save_strategy="steps"``
or ``"best"``, ``eval_strategy="steps"``): an FSDP checkpoint gathers or writes
every rank's shards, and every FSDP forward all-gathers. After every optimizer
step of a Join the active ranks tell the joined ones what follows
(``Session.agree``): an evaluation forward, which the FSDP model's joinable
shadows as a round of the Join (the session's forward hooks announce it), a
checkpoint, whose collectives a joined rank runs with the Trainer's own calls
(``Session.save_as_joined``), or nothing. :func:`shadow_step` calls the session
back after the step, for that agreement.

*Resuming FSDP1's sharded checkpoints.* Accelerate's ``load_fsdp_optimizer``
loads an FSDP1 ``SHARDED_STATE_DICT`` (or ``LOCAL_STATE_DICT``) optimizer with
``torch.distributed.checkpoint`` into the template ``FSDP.optim_state_dict``
gives of the Trainer's new optimizer, whose state is still empty (torch's
optimizers create it at their first step): it reads the parameter groups and
none of the state (SGD's momentum, Adam's moments), the Trainer alone too.
FSDP2's path (``get_optimizer_state_dict``) first steps the optimizer once with
zero gradients and a zero learning rate (torch's ``_init_optim_state``), which
creates the state without changing a parameter; :func:`init_optimizer_state`
does the same before the Trainer's load, so a resumed run under
``uneven_inputs`` has the saved state.

*Refused* by ``uneven_inputs`` (on every rank, before any collective): an
``IterableDataset`` evaluation set (uneven evaluation forwards, each a collective
of every rank); a model whose main input is not ``input_ids`` (the replay's
input), FSDP1's parameter CPU offload (``joinkit.adapters.torch.fsdp1``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["refuse", "epoch_joinables", "shadow_step", "is_fsdp2", "init_optimizer_state"]


def is_fsdp2(trainer: Any) -> bool:
    """Whether Accelerate's FSDP plugin builds FSDP2 (``fsdp_version=2``)."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return int(getattr(plugin, "fsdp_version", 1) or 1) == 2


def refuse(trainer: Any) -> None:
    """Raise for an FSDP setting the Join cannot shadow (module doc; local checks only;
    evaluation: ``uneven_inputs``, as ZeRO-3's).

    Raises:
        NotImplementedError: the setting, why, and what to use instead.
    """
    plugin = trainer.accelerator.state.fsdp_plugin
    offload = getattr(plugin, "cpu_offload", None)
    if not is_fsdp2(trainer) and bool(getattr(offload, "offload_params", False)):
        raise NotImplementedError(
            "uneven_inputs with FSDP1 and CPU offload (fsdp='... offload'): FSDP1 keeps each "
            "sharded gradient in a CPU buffer of its own that a joined rank's replayed "
            "reduction overwrites in place, so that rank's own gradient cannot be set aside "
            "(joinkit.adapters.torch.fsdp1). Leave offload out, or use FSDP2 "
            "(fsdp_config={'fsdp_version': 2})"
        )


def epoch_joinables(trainer: Any, model: Any) -> list[Any]:
    """The FSDP model and the Trainer's torch optimizer, for the epoch's Join.

    FSDP2 units that do not reshard after forward (the root; Accelerate's unit of a
    tied embedding and the head) keep their unsharded parameters registered after a
    forward without a backward (the evaluation at the last epoch's end): ``reshard()``
    on every unit (local) registers the sharded ones again, which the optimizer steps
    and the Join links it to.
    """
    if is_fsdp2(trainer):
        from torch.distributed.fsdp import FSDPModule

        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()
    return [model, trainer.optimizer.optimizer]


def shadow_step(trainer: Any, stepped: Callable[[], None]) -> Callable[[], None]:
    """A joined rank's step after a shadow round that synced (module doc); then
    ``stepped`` (the session's agreement on what follows the step)."""

    def step() -> None:
        stepped()
        model = trainer.model_wrapped
        norm = None
        if trainer.args.max_grad_norm > 0:
            norm = trainer._clip_grad_norm(model)
        trainer._get_grad_norm(model, grad_norm=norm)  # the same all-reduce when not clipping
        trainer.optimizer.optimizer.step()
        if trainer.accelerator.optimizer_step_was_skipped:
            return
        if type(trainer.lr_scheduler).__name__ not in ("ReduceLROnPlateau", "GreedyLR"):
            trainer.lr_scheduler.step()

    return step


def init_optimizer_state(trainer: Any, checkpoint: str) -> None:
    """Create the Trainer's optimizer state before it loads an FSDP1 sharded
    ``checkpoint`` (module doc: *Resuming FSDP1's sharded checkpoints*); nothing
    otherwise.

    A step with zero gradients at a zero learning rate: no parameter changes (weight
    decay is scaled by the rate too), and the load then replaces the state it made. Only
    where the Trainer loads one (Accelerate's ``optimizer_0`` folder and the scheduler's
    file): a state made and not replaced would change the first step (Adam's count).
    """
    import os

    from torch.distributed.fsdp import StateDictType

    plugin = trainer.accelerator.state.fsdp_plugin
    optimizer = trainer.optimizer.optimizer
    if is_fsdp2(trainer) or plugin.state_dict_type == StateDictType.FULL_STATE_DICT:
        return
    if not (os.path.isdir(os.path.join(checkpoint, "optimizer_0"))
            and os.path.isfile(os.path.join(checkpoint, "scheduler.pt"))):
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return
    import torch

    for param in params:
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)
