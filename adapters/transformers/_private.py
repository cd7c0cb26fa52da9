"""The Hugging Face internals ``joinkit.adapters.transformers`` relies on, and their check.

Theory of operation
-------------------
``uneven_inputs(trainer)`` wraps methods of one ``transformers.Trainer`` (on the
instance), of its ``accelerate.Accelerator`` (on the instance), and three
module names of ``transformers.trainer`` (process-wide dispatchers that defer to
the originals outside joinkit's Joins). Several of them are private and may
change in any release; some changes would be *silent*: a ``_run_epoch`` that no
longer takes ``steps_in_epoch`` would run the global number of steps on a rank
with fewer batches; a ``_maybe_log_save_evaluate`` that gathers through another
function would hang in its loss gather once a rank joined.

So every member is listed here, in :data:`GROUPS` (with those of the training
loop the installed Trainer runs, :data:`LOOPS`, and of its loss gather,
:data:`LOSS_GATHERS`: the release's code picks them, not its version), in the format of
``adapters._guards`` (whose checker this module reuses): that it exists,
the parameters joinkit calls it with, and for a method joinkit wraps, the
Trainer code that must still call it by its name. :func:`check` runs in
``uneven_inputs``, on every rank, before any collective, and raises
:class:`UnsupportedTransformersError` naming the versions and each member that
changed. The table decides what runs, not the version numbers: the
``[transformers]`` extra says :data:`SUPPORTED`, each release current a year
before this joinkit and up, with no upper bound (docs/compat.md).
"""

from __future__ import annotations

import importlib
from typing import Any

from .._guards import Member, Need, problems, refusal, supported_spec

__all__ = ["SUPPORTED", "TESTED", "GROUPS", "LOOPS", "LOSS_GATHERS", "UnsupportedTransformersError",
           "check", "loop", "loss_gather"]

#: The releases this module's tests passed on: the oldest supported of each and its
#: dev pin (``constraints.txt``); docs/guide/install.md says why transformers starts
#: there (5.0, the oldest 5.x release; 5.0 to 5.2 run the older loop of :data:`LOOPS`,
#: docs/design/transformers-legacy-loop.md) and trl at the release current a year ago.
TESTED = {"transformers": ("5.0.0", "5.24.0"), "accelerate": ("1.12.0", "1.15.0"),
          "trl": ("0.25.1", "1.16.0")}
#: The ``[transformers]`` extra's ranges (no upper bound: :data:`GROUPS` decides).
SUPPORTED = {name: supported_spec(tested) for name, tested in TESTED.items()}


class UnsupportedTransformersError(RuntimeError):
    """This transformers, Accelerate or TRL lacks or changed an internal joinkit relies on."""


_T = "transformers.trainer"
_ACC = "accelerate.accelerator"
_TRAINER = f"{_T}:Trainer"


def _m(module: str, name: str, need: Need, why: str, params: tuple[str, ...] = (),
       called_by: tuple[str, ...] = ()) -> Member:
    return Member(module=module, name=name, need=need, params=params, called_by=called_by,
                  why=why)


_CALL, _ATTR, _EXISTS = Need.CALLABLE, Need.ATTRIBUTE, Need.EXISTS

#: Members by what needs them.
#: Members by what needs them ("Trainer": with those of the installed loop, :data:`LOOPS`,
#: and of its loss gather, :data:`LOSS_GATHERS`).
GROUPS: dict[str, tuple[Member, ...]] = {
    "Trainer": (
        _m(_T, "Trainer._inner_training_loop", _CALL,
           "wrapped: the checkpoint a run resumes from; an epoch's Join left on an error",
           ("self", "batch_size", "args", "resume_from_checkpoint", "trial",
            "ignore_keys_for_eval"), (f"{_TRAINER}.train",)),
        _m(_T, "Trainer._get_output_dir", _CALL,
           "the checkpoint folder joinkit's record of the data's position goes into",
           ("self", "trial"), (f"{_TRAINER}._save_checkpoint",)),
        _m("transformers.trainer_utils", "PREFIX_CHECKPOINT_DIR", _EXISTS,
           "the checkpoint folder's name"),
        *(_m(_T, f"Trainer.{size}", _CALL,
             "uneven_inputs refuses tensor, context and sequence parallelism (a size "
             "above 1): it shards the data by rank", ("self",))
          for size in ("get_tp_size", "get_cp_size", "get_sp_size")),
        _m(_T, "Trainer._get_num_items_in_batch", _CALL,
           "wrapped: how many ranks counted the window's tokens",
           ("self", "batch_samples", "device"), (f"{_TRAINER}.get_batch_samples",)),
        _m(_T, "Trainer._save_checkpoint", _CALL,
           "wrapped: while rank 0 has joined, the lowest active rank writes the checkpoint",
           ("self", "model", "trial"), (f"{_TRAINER}._maybe_log_save_evaluate",)),
        _m(_T, "Trainer.save_model", _CALL,
           "a joined DeepSpeed rank's part of a checkpoint (ZeRO-3's gather)",
           ("self", "output_dir", "_internal_call"), (f"{_TRAINER}._save_checkpoint",)),
        _m(_T, "Trainer._save_optimizer_and_scheduler", _CALL,
           "a joined DeepSpeed rank's part of a checkpoint (the engine's save_checkpoint)",
           ("self", "output_dir"), (f"{_TRAINER}._save_checkpoint",)),
        _m(_T, "Trainer._save_rng_state", _CALL, "a joined DeepSpeed rank's RNG state",
           ("self", "output_dir"), (f"{_TRAINER}._save_checkpoint",)),
        _m(_T, "Trainer.get_train_dataloader", _CALL,
           "wrapped: this rank's own data loader (ShardSampler, or its own stream)",
           ("self",), (f"{_TRAINER}._inner_training_loop",)),
        _m(_T, "Trainer.get_eval_dataloader", _CALL,
           "wrapped: each evaluation batch on exactly one rank", ("self", "eval_dataset"),
           (f"{_TRAINER}.evaluate",)),
        _m(_T, "Trainer.get_test_dataloader", _CALL,
           "wrapped: each prediction batch on exactly one rank", ("self", "test_dataset"),
           (f"{_TRAINER}.predict",)),
        _m(_T, "Trainer._get_dataloader", _CALL,
           "builds the data loaders through accelerator.prepare, which joinkit intercepts",
           ("self", "dataset", "description", "batch_size", "sampler_fn"),
           (f"{_TRAINER}.get_train_dataloader", f"{_TRAINER}.get_eval_dataloader")),
        _m(_T, "Trainer.prediction_step", _CALL,
           "wrapped: an empty evaluation batch adds no rows",
           ("self", "model", "inputs", "prediction_loss_only"), (f"{_TRAINER}.evaluation_loop",)),
        _m("transformers.trainer_pt_utils", "find_batch_size", _CALL,
           "an evaluation batch's rows: a partial batch's loss, repeated eval_batch_size "
           "times, is cut to them in gather_for_metrics", ("tensors",)),
        _m(_T, "Trainer.evaluation_loop", _CALL,
           "wrapped: run inside a Join of the side channel (uneven evaluation shards)",
           ("self", "dataloader", "description"), (f"{_TRAINER}.evaluate", f"{_TRAINER}.predict")),
        _m(_T, "distributed_broadcast_scalars", _CALL,
           "replaced by a dispatcher: store_flos's gather", ("scalars",),
           (f"{_TRAINER}.store_flos",)),
        _m(_T, "dist", _EXISTS, "replaced by a proxy whose barrier a joined rank answers"),
        _m(_T, "Trainer._total_loss_scalar", _ATTR, "given the last joiner's value after a Join"),
        _m(_T, "Trainer._globalstep_last_logged", _ATTR,
           "given the last joiner's value after a Join"),
        _m(_T, "Trainer.callback_handler", _ATTR, "joinkit's callback goes first in it"),
        _m("transformers.trainer_callback", "TrainerState.log_history", _ATTR,
           "the last joiner's log is replayed where a rank missed entries"),
        _m("transformers.training_args", "TrainingArguments.should_save", _EXISTS,
           "swapped for the checkpoint writer while rank 0 has joined"),
    ),
    "Accelerator": (
        _m(_ACC, "Accelerator.gather", _CALL, "routed through the side channel",
           ("self", "tensor")),
        _m(_ACC, "Accelerator.gather_for_metrics", _CALL, "routed through the side channel",
           ("self", "input_data")),
        _m(_ACC, "Accelerator.reduce", _CALL, "routed through the side channel",
           ("self", "tensor", "reduction")),
        _m(_ACC, "Accelerator.pad_across_processes", _CALL, "routed through the side channel",
           ("self", "tensor", "dim", "pad_index", "pad_first")),
        _m(_ACC, "Accelerator.wait_for_everyone", _CALL, "routed through the side channel",
           ("self",)),
        _m(_ACC, "Accelerator.no_sync", _CALL,
           "off during a Join (every micro-batch syncs its gradient)", ("self", "model")),
        _m(_ACC, "Accelerator.backward", _CALL,
           "wrapped: the accumulated gradient set aside around each synced backward",
           ("self", "loss")),
        _m(_ACC, "Accelerator.prepare", _CALL,
           "intercepted for the Trainer's data loaders", ("self",)),
        _m(_ACC, "Accelerator.optimizer_step_was_skipped", _EXISTS,
           "a joined DeepSpeed rank steps the Trainer's scheduler after a replayed step, "
           "as _run_epoch does, unless the step was skipped"),
    ),
}

#: Members the Trainer under FSDP relies on (``_fsdp``): a joined rank's step.
GROUPS["FSDP"] = (
    _m(_T, "Trainer._clip_grad_norm", _CALL,
       "a joined FSDP rank clips as the Trainer does (a norm all-reduce)", ("self", "model"),
       (f"{_TRAINER}._run_epoch",)),
    _m(_T, "Trainer._get_grad_norm", _CALL,
       "a joined FSDP rank takes the Trainer's gradient norm (a norm all-reduce)",
       ("self", "model", "grad_norm"), (f"{_TRAINER}._run_epoch",)),
    _m(_T, "Trainer.model_wrapped", _ATTR, "the FSDP model a joined rank clips"),
    _m(_ACC, "Accelerator.optimizer_step_was_skipped", _EXISTS,
       "a joined FSDP rank steps the Trainer's scheduler unless the step was skipped"),
)

def _per_step(loop: str) -> tuple[Member, ...]:
    """The members a training loop (``loop``: the Trainer function that holds it) calls
    for each micro-batch and optimizer step, by their names."""
    by = (f"{_TRAINER}.{loop}",)
    return (
        _m(_T, "Trainer.get_batch_samples", _CALL,
           "wrapped: a rank's last window of gradient accumulation is padded with empty "
           "micro-batches so that every rank steps at the same micro-batch",
           ("self", "epoch_iterator", "num_batches", "device"), by),
        _m(_T, "Trainer.training_step", _CALL,
           "wrapped: an empty micro-batch's zero loss; the reported loss of the ranks that "
           "trained", ("self", "model", "inputs", "num_items_in_batch"), by),
        _m(_T, "Trainer.floating_point_ops", _CALL, "wrapped: no flops for an empty micro-batch",
           ("self", "inputs"), by),
        _m(_T, "Trainer._maybe_log_save_evaluate", _CALL,
           "wrapped: under DeepSpeed the ranks agree after each optimizer step whether a "
           "checkpoint is saved (a joined rank saves its partition with them)",
           ("self", "tr_loss", "grad_norm", "model", "trial", "epoch", "ignore_keys_for_eval",
            "start_time"), by),
    )


_CALLBACKS = "transformers.trainer_callback:CallbackHandler"

#: The two training loops joinkit hooks, by the Trainer function that runs an epoch
#: (:func:`loop` says which one the installed Trainer has; their members are checked
#: with the "Trainer" group).
#:
#: ``_run_epoch`` (transformers 5.3 and later): one call per epoch, which joinkit wraps
#: (the epoch's Join, this rank's own number of batches).
#:
#: ``_inner_training_loop`` (transformers 5.0 to 5.2: the epoch loop written out in
#: it): the loop takes an epoch's length from ``len(train_dataloader)`` before
#: ``on_epoch_begin``, so joinkit's own loader reports this rank's padded length, and
#: the epoch's Join is entered in joinkit's ``on_epoch_begin`` and left in its
#: ``on_epoch_end`` (``_session``). What this loop cannot give (its inline token count,
#: a resume in the middle of an epoch, FSDP's clipping) is refused by name.
LOOPS: dict[str, tuple[Member, ...]] = {
    "_run_epoch": (
        _m(_T, "Trainer._run_epoch", _CALL,
           "wrapped: one Join per epoch, with this rank's own number of batches",
           ("self", "model", "epoch", "train_dataloader", "steps_in_epoch",
            "num_update_steps_per_epoch", "trial", "ignore_keys_for_eval", "start_time",
            "resume_from_checkpoint", "epochs_trained", "steps_trained_in_current_epoch"),
           (f"{_TRAINER}._inner_training_loop",)),
        _m(_T, "Trainer._init_training_state", _CALL,
           "wrapped: a run resumed in the middle of an epoch starts at that epoch, on the "
           "samples its ShardSampler left, with nothing to skip",
           ("self", "max_steps", "num_update_steps_per_epoch", "num_train_epochs",
            "resume_from_checkpoint", "trial"), (f"{_TRAINER}._inner_training_loop",)),
        _m(_T, "Trainer._load_optimizer_and_scheduler", _CALL,
           "wrapped: under FSDP1 with sharded checkpoints the optimizer's state is created "
           "before Accelerate's load, which reads only the state its template has",
           ("self", "checkpoint"), (f"{_TRAINER}._prepare_for_training",)),
        _m(_T, "Trainer.set_initial_training_values", _CALL,
           "wrapped: the epoch length and max_steps of the rank with the most batches",
           ("self", "args", "dataloader"), (f"{_TRAINER}._inner_training_loop",)),
        _m(_T, "Trainer._track_num_input_tokens", _CALL,
           "wrapped: an empty micro-batch counts no tokens", ("self", "inputs"),
           (f"{_TRAINER}._run_epoch",)),
        *_per_step("_run_epoch"),
    ),
    "_inner_training_loop": (
        _m(_T, "Trainer.set_initial_training_values", _CALL,
           "wrapped: the epoch length and max_steps of the rank with the most batches; "
           "then joinkit's loader reports this rank's padded epoch length",
           ("self", "args", "dataloader", "total_train_batch_size"),
           (f"{_TRAINER}._inner_training_loop",)),
        _m(_T, "TRAINER_STATE_NAME", _EXISTS,
           "the checkpoint's state, whose global_step says where in an epoch it was saved"),
        _m("transformers.trainer_callback", "CallbackHandler.on_epoch_begin", _CALL,
           "joinkit's callback enters the epoch's Join there (after the loop read the "
           "epoch's length)", ("self", "args", "state", "control"),
           (f"{_TRAINER}._inner_training_loop",)),
        _m("transformers.trainer_callback", "CallbackHandler.on_epoch_end", _CALL,
           "joinkit's callback leaves the epoch's Join there", ("self", "args", "state",
                                                               "control"),
           (f"{_TRAINER}._inner_training_loop",)),
        *_per_step("_inner_training_loop"),
    ),
}

#: The logged loss's gather, by where ``_maybe_log_save_evaluate`` takes it from (the
#: module's ``nested_gather`` from transformers 5.2 on, the Trainer's own method before).
LOSS_GATHERS: dict[str, Member] = {
    "nested_gather": _m(_T, "nested_gather", _CALL,
                        "replaced by a dispatcher: the logged loss's gather",
                        ("tensors", "parallel_mode"),
                        (f"{_TRAINER}._maybe_log_save_evaluate",)),
    "Trainer._nested_gather": _m(_T, "Trainer._nested_gather", _CALL,
                                 "wrapped: the logged loss's gather", ("self", "tensors"),
                                 (f"{_TRAINER}._maybe_log_save_evaluate",)),
}


def loop() -> str:
    """The installed Trainer's training loop: a key of :data:`LOOPS`."""
    trainer = importlib.import_module(_T).Trainer
    return "_run_epoch" if hasattr(trainer, "_run_epoch") else "_inner_training_loop"


def loss_gather() -> str:
    """The installed Trainer's loss gather: a key of :data:`LOSS_GATHERS`."""
    module = importlib.import_module(_T)
    return "nested_gather" if hasattr(module, "nested_gather") else "Trainer._nested_gather"


def _members(group: str) -> tuple[Member, ...]:
    """``group``'s members on the installed release (module doc)."""
    if group != "Trainer":
        return GROUPS[group]
    return (*GROUPS[group], *LOOPS[loop()], LOSS_GATHERS[loss_gather()])


#: Members that only some supported releases have: checked where present (with the
#: group that needs them); :func:`has_save_rank_rule` says what the absence means.
OPTIONAL: dict[str, tuple[Member, ...]] = {
    "Trainer": (
        _m("transformers.modeling_utils", "PreTrainedModel.should_save_on_this_rank", _CALL,
           "replaced on the model while the checkpoint writer (not torch rank 0) saves it",
           ("self", "is_main_process"), ("transformers.modeling_utils:"
                                          "PreTrainedModel.save_pretrained",)),
    ),
}


def has_save_rank_rule(model: Any) -> bool:
    """Whether ``model.save_pretrained`` asks ``should_save_on_this_rank`` (transformers
    5.15 and later: torch rank 0 only). Before it, ``is_main_process`` alone decides,
    which is what the checkpoint writer passes: nothing to replace."""
    return hasattr(type(model), "should_save_on_this_rank")

_checked: set[str] = set()
#: The distribution whose internals a group lists (transformers' unless said).
_DISTRIBUTIONS = {"Accelerator": "accelerate"}


def check(group: str) -> None:
    """Check the members of ``group`` (a key of :data:`GROUPS`), once per process.

    Raises:
        UnsupportedTransformersError: a member is missing or changed.
    """
    if group in _checked:
        return
    present = [m for m in OPTIONAL.get(group, ()) if _exists(m)]
    found = problems((*_members(group), *present))
    if found:
        distribution = _DISTRIBUTIONS.get(group, "transformers")
        raise UnsupportedTransformersError(refusal(
            distribution, f"Hugging Face ({group})", found, TESTED[distribution],
            "Going on could hang or train wrongly"))
    _checked.add(group)


def _exists(member: Member) -> bool:
    """Whether ``member``'s owner has it (an optional member, checked only then)."""
    *path, leaf = member.name.split(".")
    owner: Any = importlib.import_module(member.module)
    for part in path:
        owner = getattr(owner, part, None)
    return hasattr(owner, leaf)
