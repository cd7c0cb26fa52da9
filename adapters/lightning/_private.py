"""The Lightning internals joinkit's Lightning adapters rely on, and their check.

Theory of operation
-------------------
``fabric`` and ``_trainer`` (``UnevenInputs``) use a few members Lightning does
not promise to keep: Fabric's wrapper classes and the attribute holding the
wrapped (DDP or ``fully_shard``) module; the Trainer's per-batch SIGTERM
check, which ``UnevenInputs`` replaces with a :class:`joinkit.SideCollective`
on the epoch loop object, and the SIGTERM handler whose broadcast it swaps out;
the fit loop's data set-up and batch count (a rank with no training batch), the
epoch loop's validation switches and logged results, and the optimizer-step
count behind ``trainer.global_step``. A release that
renamed one would make joinkit miss a collective (a hang) or unwrap nothing,
so each is listed here, in the format of ``adapters._guards`` (whose
checker this module uses), and :func:`check` runs once per group and process
when an adapter first needs the group, raising
:class:`UnsupportedLightningError` with this Lightning's version, each member
that changed, and the releases tested. Nothing is checked per iteration.

The table decides what runs, not the version number: the ``[lightning]``
extra says :data:`SUPPORTED_LIGHTNING`, the release current a year before this
joinkit and up, with no upper bound (docs/compat.md).
"""

from __future__ import annotations

from .._guards import Member, Need, problems, refusal, supported_spec

__all__ = ["SUPPORTED_LIGHTNING", "TESTED_LIGHTNING", "GROUPS", "UnsupportedLightningError",
           "check"]

#: The pytorch-lightning releases joinkit's tests ran on: the oldest supported
#: and the dev pin (``constraints.txt``).
TESTED_LIGHTNING = ("2.6.0", "2.6.6")
#: The ``[lightning]`` extra's range (no upper bound: :data:`GROUPS` decides).
SUPPORTED_LIGHTNING = supported_spec(TESTED_LIGHTNING)


class UnsupportedLightningError(RuntimeError):
    """This Lightning lacks or changed an internal that joinkit's adapter relies on."""


_WRAPPERS = "lightning_fabric.wrappers"
_EPOCH_LOOP = "pytorch_lightning.loops.training_epoch_loop"
_SIGNALS = "pytorch_lightning.trainer.connectors.signal_connector"
_TRAINER = "pytorch_lightning.trainer.trainer"
_FIT_LOOP = "pytorch_lightning.loops.fit_loop"
_AUTOMATIC = "pytorch_lightning.loops.optimization.automatic"
_CHECKPOINT = "pytorch_lightning.callbacks.model_checkpoint"
_CONNECTOR = "pytorch_lightning.trainer.connectors.checkpoint_connector"
_LOGGER_CONNECTOR = "pytorch_lightning.trainer.connectors.logger_connector.logger_connector"


def _m(module: str, name: str, need: Need, why: str, params: tuple[str, ...] = (),
       called_by: tuple[str, ...] = ()) -> Member:
    return Member(module=module, name=name, need=need, params=params, called_by=called_by,
                  why=why)


#: Members by the adapter that needs them.
GROUPS: dict[str, tuple[Member, ...]] = {
    "Fabric": (
        _m(_WRAPPERS, "_FabricModule", Need.EXISTS,
           "what fabric.setup returns for a model; joinkit unwraps it"),
        _m(_WRAPPERS, "_FabricModule._forward_module", Need.ATTRIBUTE,
           "the DDP or fully_shard module inside, which Join adapts"),
        _m(_WRAPPERS, "_FabricOptimizer", Need.EXISTS,
           "what fabric.setup returns for an optimizer; joinkit unwraps it"),
    ),
    "Trainer": (
        _m(_EPOCH_LOOP, "_TrainingEpochLoop._broadcast_sigterm_tensor", Need.CALLABLE,
           "the per-batch SIGTERM check, which UnevenInputs replaces with an all-reduce "
           "that a joined rank shadows",
           ("self",), (f"{_EPOCH_LOOP}:_TrainingEpochLoop.advance",)),
        _m(_TRAINER, "Trainer._signal_connector", Need.ATTRIBUTE,
           "the Trainer's signal connector, whose SIGTERM notifier UnevenInputs swaps"),
        _m(_SIGNALS, "_SignalConnector._sigterm_notifier_fn", Need.CALLABLE,
           "Lightning's SIGTERM handler, whose broadcast nothing pairs inside a Join",
           ("self", "signum", "_"), (f"{_SIGNALS}:_SignalConnector.register_signal_handlers",)),
        _m(_SIGNALS, "_SignalConnector.received_sigterm", Need.ATTRIBUTE,
           "the flag behind trainer.received_sigterm, set once every rank knows"),
        _m(_SIGNALS, "_HandlersCompose", Need.EXISTS,
           "the SIGTERM handler Lightning registers, rebuilt with the notifier swapped"),
        _m(_SIGNALS, "_HandlersCompose.signal_handlers", Need.ATTRIBUTE,
           "the handlers it calls in turn"),
        _m(_FIT_LOOP, "_FitLoop.setup_data", Need.CALLABLE,
           "loads the training data; UnevenInputs wraps it to find ranks with none",
           ("self",), (f"{_FIT_LOOP}:_FitLoop.run",)),
        _m(_FIT_LOOP, "_FitLoop.max_batches", Need.ATTRIBUTE,
           "the rank's training batch count; 0 makes Lightning skip the fit loop"),
        _m(_FIT_LOOP, "_FitLoop._combined_loader", Need.ATTRIBUTE,
           "the training loader, new when setup_data (re)loaded it"),
        _m(_FIT_LOOP, "_FitLoop._last_train_dl_reload_epoch", Need.ATTRIBUTE,
           "when the training data was loaded (setup_data skips it for an empty rank)"),
        _m(_EPOCH_LOOP, "_TrainingEpochLoop._skip_next_val", Need.ATTRIBUTE,
           "skips the validation after a rank's last batch when max_steps ended the epoch"),
        _m(_EPOCH_LOOP, "_TrainingEpochLoop._should_check_val_epoch", Need.CALLABLE,
           "whether an epoch validates, for a rank without a training batch", ("self",)),
        _m(_EPOCH_LOOP, "_TrainingEpochLoop.val_loop", Need.ATTRIBUTE,
           "the validation loop a rank without a training batch runs"),
        _m(_EPOCH_LOOP, "_TrainingEpochLoop._results", Need.ATTRIBUTE,
           "the epoch's logged training values, compared when a rank had no batch"),
        _m(_EPOCH_LOOP, "_TrainingEpochLoop.automatic_optimization", Need.ATTRIBUTE,
           "holds the optimizer-step count behind trainer.global_step"),
        _m(_AUTOMATIC, "_AutomaticOptimization.optim_progress", Need.ATTRIBUTE,
           "the optimizer-step count set to the last joiner's after each epoch"),
        _m(_EPOCH_LOOP, "_TrainingEpochLoop._should_accumulate", Need.CALLABLE,
           "whether a batch steps; under FSDP2 accumulation not at a rank's own last batch "
           "while the Join lasts", ("self",)),
        _m(_EPOCH_LOOP, "_TrainingEpochLoop._accumulated_batches_reached", Need.CALLABLE,
           "whether a batch ends an accumulation window (counted from the epoch's start)",
           ("self",)),
        _m(_CHECKPOINT, "ModelCheckpoint._every_n_train_steps", Need.ATTRIBUTE,
           "a checkpoint every N training steps (a mid-epoch event)"),
        _m(_CHECKPOINT, "ModelCheckpoint._train_time_interval", Need.ATTRIBUTE,
           "a checkpoint after a training time (a mid-epoch event)"),
        _m(_CHECKPOINT, "ModelCheckpoint._monitor_candidates", Need.CALLABLE,
           "what a ModelCheckpoint decides on; in an event a joined rank takes the source's",
           ("self", "trainer")),
        _m(_EPOCH_LOOP, "_TrainingEpochLoop._should_check_val_fx", Need.CALLABLE,
           "whether a rank validates after a batch, its vote in the validation event",
           ("self", "data_fetcher"), (f"{_EPOCH_LOOP}:_TrainingEpochLoop.on_advance_end",)),
        _m(_FIT_LOOP, "_FitLoop.restarted_mid_epoch", Need.ATTRIBUTE,
           "a fit resumed mid-epoch, where Lightning skips on_train_epoch_start (the Join's "
           "entry)"),
        _m(_FIT_LOOP, "_FitLoop._data_fetcher", Need.ATTRIBUTE,
           "the training fetcher, which _should_check_val_fx takes"),
        _m(_TRAINER, "Trainer._checkpoint_connector", Need.ATTRIBUTE,
           "whose dump_checkpoint rank 0 takes from an active rank when it has joined"),
        _m(_CONNECTOR, "_CheckpointConnector.dump_checkpoint", Need.CALLABLE,
           "the checkpoint's contents, from an active rank when rank 0 has joined",
           ("self", "weights_only")),
        _m(_LOGGER_CONNECTOR, "_LoggerConnector._first_loop_iter", Need.ATTRIBUTE,
           "kept around a mid-epoch validation, as Lightning's on_advance_end does"),
    ),
}

_checked: set[str] = set()


def check(group: str) -> None:
    """Check the members of ``group`` (a key of :data:`GROUPS`), once per process.

    Raises:
        UnsupportedLightningError: a member is missing or changed.
    """
    if group in _checked:
        return
    found = problems(GROUPS[group])
    if found:
        raise UnsupportedLightningError(refusal(
            "pytorch-lightning", group, found, TESTED_LIGHTNING,
            "Going on could hang or train wrongly"))
    _checked.add(group)
