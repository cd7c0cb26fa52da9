"""Lightning's Trainer with per-rank uneven train dataloaders: the :class:`UnevenInputs` callback.

Theory of operation
-------------------
``Trainer(callbacks=[UnevenInputs()])`` runs every training epoch inside a
:class:`joinkit.Join`: entered at ``on_train_epoch_start``, left after the
LightningModule's ``on_train_batch_end`` of the rank's own last batch (the
callback wraps that hook on the module object; there a rank that ran out
first shadows the others until every rank has finished the epoch). So an epoch
boundary is a Join boundary: a rank's next epoch, and the validation that
Lightning runs right after a rank's last batch, start on every rank together
(without it, a 5-vs-8-batch run pairs rank 0's next-epoch collectives with rank
1's leftovers, and trains wrongly with exit code 0).

*One training batch, as Lightning 2.6 runs it* (``loops/training_epoch_loop.py``,
``loops/optimization/automatic.py``), and its place in the Join's list, which
is the order of a joined rank's shadow round:

1. ``_broadcast_sigterm_tensor``: Lightning's per-batch SIGTERM check, before
   the batch is fetched. It stays on and becomes the Join's first joinable, a
   :class:`~joinkit.SideCollective` whose call sends the heartbeat; its
   collective is a MAX all-reduce of "this rank got SIGTERM" instead of
   Lightning's broadcast from rank 0, and a joined rank's shadow round runs the
   same all-reduce, so every rank, active or joined, learns of a SIGTERM to any
   rank at the same batch. Then every rank raises Lightning's
   ``SIGTERMException`` there: an active rank from the check, a joined rank
   from its shadow round; a ``SystemExit`` leaves a Join at once, with no more
   collectives, so no rank waits for another. Lightning's SIGTERM *handler*
   broadcasts from rank 0 wherever the signal lands (nothing pairs it during
   the Join) and sets ``trainer.received_sigterm``, which Lightning checks on
   that rank alone after the batch; so from the first epoch's start to
   ``teardown`` the callback swaps it for one that only records the signal
   (and, as Lightning's does, passes it on to the processes Lightning's
   launcher started). ``trainer.received_sigterm`` turns true when the ranks
   agree: at the next batch's check, or, for a signal after a rank's last
   check of the epoch, in one all-reduce when the epoch's Join ends (then
   Lightning's own end-of-batch check stops every rank together).
2. The DDP forward (training_step runs inside it): DDP's gradient-sync check;
   then the backward pass: DDP's gradient all-reduce. The DDP model
   (``strategy.model``), adapted by ``adapters.torch``. For FSDP2 and FSDP1
   (``strategy="fsdp"``) see below.
3. ``self.log(..., sync_dist=True)`` of a step value would all-reduce *inside*
   the forward, between DDP's collectives, where no shadow can sit. While the
   Join lasts, ``strategy.reduce`` (what ``self.log`` syncs with) defers the
   sync: it returns the local value's clone at once and records it; after the
   optimizer step, ``on_train_batch_end`` syncs every value recorded in the
   batch in place, before Lightning reads them: one all-reduce of a header
   (how many values of each op), then one per op present (``mean`` and
   ``sum`` in one, with a count of active ranks, so a mean is over the ranks
   that still had a batch, as a single process over their batches; ``max``,
   ``min``). This is the third joinable, a ``SideCollective`` called once per
   batch. Epoch-level values sync at ``compute`` after the Join, unchanged.
4. Your own per-batch collectives after the backward pass (in
   ``on_after_backward``, ``on_before_optimizer_step``, or the
   ``on_train_batch_end`` of a Callback listed *before* ``UnevenInputs``): pass
   them as ``UnevenInputs(side_collectives=[...])``, ``SideCollective``
   objects, listed in that order before step 3's joinable, which runs in
   the wrapped ``on_train_batch_end`` of the LightningModule, after the
   module's own.
5. Collectives in any number and order per batch, anywhere from the epoch's
   start to the end of the LightningModule's ``on_train_batch_end`` (the
   module's hooks, ``training_step``, any Callback): through a
   :class:`joinkit.SideChannel` (``UnevenInputs(side_channel=...)``), listed in
   every epoch's Join; a joined rank's service thread answers them on the
   channel's own communicator. torchmetrics metrics of the module with
   ``dist_sync_on_step=True`` sync in their ``forward``: while the Join lasts
   their ``dist_sync_fn`` is the channel's ``all_gather`` (the callback makes a
   channel of its own if none was given), so a step's value is the metric over
   the active ranks' batches.

*A rank with no training batch.* Lightning skips the fit loop of a rank whose
loader is empty (and raises there alone unless the module allows it). After
Lightning (re)loads the training data, the ranks agree (one all-reduce) whether
some rank has none; such a rank counts one stand-in batch, so Lightning runs
its epochs, and in that batch's SIGTERM-check slot it leaves the Join (it
shadows every round of the others' epoch), then validates as the others do
after their last batch; its empty fetch ends the epoch loop. Epoch-level
training values Lightning syncs at the epoch's end (``on_epoch=True`` with
``sync_dist=True``, torchmetrics objects) would wait for that rank, which
logged none: the ranks compare them after each epoch's Join and refuse them
on every rank (``LocalProtocolError``). Under FSDP2 that rank replays the root
module's forward on the input spec the active ranks publish
(``adapters.torch._replay``); under FSDP1, whose replay input is the
LightningModule's forward input, on the module's ``example_input_array``
(emptied), as it has no input of its own (without one: ``TypeError``).

*Mid-epoch events* (DDP, FSDP2, FSDP1). Validation inside an epoch
(``val_check_interval`` an int, or a fraction, reckoned on every rank from the
longest rank's number of batches, as a single process over the rounds) and step
checkpoints
(``ModelCheckpoint(every_n_train_steps=...)``, ``train_time_interval``) are
collectives of every rank, which Lightning starts on the ranks still training.
Each is a ``SideCollective`` of the Join, called once per batch where it runs:
the checkpoint event in the first step-saving ``ModelCheckpoint``'s
``on_train_batch_end`` (Lightning calls checkpoint callbacks last, so it sits
after the user's side collectives and channel, before step 3's), the
validation event after step 3, in the module's wrapped ``on_train_batch_end``.
An event is one all-gather (each rank's "active", vote, ``global_step``,
``is_last_batch``, batch index), then Lightning's own code on every rank as
outside a Join (no deferred ``self.log``): a joined rank takes the *source*'s
(the lowest active rank's) ``global_step`` and ``is_last_batch`` for the
event. The checkpoint event runs the ``ModelCheckpoint``s' own
``on_train_batch_end`` on every rank (they decide alike); the validation event
validates when every active rank's ``_should_check_val_fx`` says so (at a
rank's own last batch only Lightning's end-of-epoch check differs between
ranks, and the epoch's last round is where all remaining ranks agree), and
then every validation of the epoch is the event's (``_skip_next_val``). Before
validating, a joined DDP rank takes the source's parameters and buffers (a
broadcast; the Join's post hook would have given them at the end), and the
validation forward skips DDP's wrapper (its join collectives are not this
round's). A save's contents are the source's: rank 0, if joined, receives the
source's ``dump_checkpoint`` (parameters, optimizer and scheduler state, loop
progress, loader state), and each ``ModelCheckpoint`` decides on the source's
``_monitor_candidates``. *Resuming* from a mid-epoch checkpoint: Lightning
skips ``on_train_epoch_start``, so the Join is entered at the first batch
check; every rank restored the source's batch count, and a rank whose own
batches were all trained before the save (found in ``setup_data``) shadows the
rest of the epoch as a rank with no batch does. *Under FSDP* each rank's
shards are its own and current (a joined rank stepped them in every shadow
round), so nothing is broadcast: the validation event's forwards, which
all-gather on every rank, run in a Join of the model of its own (entered at
``on_validation_epoch_start`` as after an epoch: uneven validation batches)
over a second adapter of the root, while the training Join's adapter is
``paused()`` (those forwards are no round of the training Join, as the DDP
path's skip DDP's wrapper); FSDP2's root is resharded after it (local). A
checkpoint's state dict is a collective of shards: every rank dumps and saves
its own model and optimizer parts, in the same order, and rank 0, if joined,
takes only the rest of the source's ``dump_checkpoint`` (loops, loader,
callbacks, schedulers, ``global_step``), never another rank's shards.

*After each epoch's Join* every rank runs one MAX all-reduce: a SIGTERM after
its last check (below), whether ``max_steps`` ended some rank's epoch with
batches left (then no rank validates, as a single process would not reach the
epoch's end: a rank that ran out earlier skips its validation), and
``trainer.global_step``: a joined DDP rank did not step in its shadow rounds,
so every rank takes the last joiner's count, one optimizer step per round as a
single process, and ``max_steps`` stops every rank at the same batch.

*Gradient accumulation.* Lightning skips DDP's gradient sync (``no_sync``)
while it accumulates, and always steps on a rank's last batch; with uneven
ranks those decisions differ between ranks and the collectives would pair
wrongly. While the Join lasts ``strategy.block_backward_sync`` syncs every
backward instead, and around each backward the gradient accumulated since the
window began is set aside (DDP all-reduces a parameter's whole ``.grad``, and a
joined rank's zeros would halve that already-averaged part) and added back
after it, so the optimizer steps with the sum over the window of each batch's
gradient averaged over the ranks, as a single process would; a rank that steps alone on
its last batch gets the last joiner's parameters (DDP's post hook) and
optimizer and LR scheduler state (below) when the epoch's Join ends.

*Optimizer and scheduler state beside DDP.* A joined DDP rank does not step;
its optimizer state (momentum, Adam's moments) and step-interval LR schedulers
would lag the last joiner's and the next epoch would differ between ranks. Each
optimizer and scheduler is an ``adapters.fabric.OptimizerStateSync``, whose post
hook broadcasts the last joiner's ``state_dict``.

*Epoch means over uneven ranks.* An epoch-level ``mean`` divides the synced
sum of values by the synced number of samples, both "mean"-reduced; Lightning
reduces the integer sample count in integers and truncates (11 samples on 2
ranks count as 5), which only uneven ranks reach. Outside the Join the
patched ``strategy.reduce`` reduces integer means in float64.

*FSDP2 (ModelParallelStrategy).* Lightning calls ``training_step`` on the
LightningModule itself, while joinkit's FSDP2 adapter hooks the forward of the
root ``fully_shard`` module. So the callback finds the one root ``fully_shard``
module inside the LightningModule (``configure_model`` made it; found at
``on_fit_start``) and joins it in step 2's place: its step check rides that
module's forward, which ``training_step`` calls once per batch, and a joined
rank replays its forward and backward. Every rank owns parameter shards, so
the optimizer and step-interval LR schedulers join as ``adapters.optim``
joinables (the joined rank steps its shards each round) instead of the state
syncs below. Each validation forward all-gathers parameters, so validation
runs in a Join of the model too (entered at ``on_validation_epoch_start``,
left at the rank's last validation batch). A forward without a backward leaves
the root's parameters unsharded; ``reshard()`` at each epoch start puts back
the sharded parameters that the optimizer steps (and the Join links to it).
Gradient accumulation (``accumulate_grad_batches > 1``) under FSDP2 keeps
FSDP2's own windows: while the Join lasts a batch that does not end a window
(counted from the epoch's start, the same batches on every rank) runs its
backward under ``set_requires_gradient_sync(False)`` (``block_backward_sync``),
and a rank's own last batch does not step unless it ends a window (the epoch
loop's ``_should_accumulate``), since the others are still inside it. The
epoch's Join has shared windows (``Join(..., shared_windows=True)``,
``joinkit.adapters.torch.fsdp``): a rank that ran out inside a window keeps its
part for the window's step, which it replays with the others, and a window
still open when every rank has run out (Lightning steps at the end of the
data) is closed in the Join's post hooks on every rank (one synced replay, the
optimizer's and step-interval schedulers' step); that step counts in
``trainer.global_step``. Refused at ``setup``/``on_fit_start``: tensor
parallelism, no or several root ``fully_shard`` modules.

*What it patches.* Instance attributes only, set in ``setup`` and removed in
``teardown``: the epoch loop's ``_broadcast_sigterm_tensor`` and the fit loop's
``setup_data`` (private: checked by ``_private``), the strategy's ``reduce`` and
``block_backward_sync`` (public methods; each defers to the original outside
the Join), and the LightningModule's ``on_train_batch_end`` (a hook; the
wrapper calls the module's own first). While a Join lasts, the
``dist_sync_fn`` of per-step-syncing metrics. And the process's SIGTERM handler (Lightning's,
with its ``_sigterm_notifier_fn`` swapped; the members are checked), put back
in ``teardown``. With mid-epoch events: each step-saving ``ModelCheckpoint``'s
``on_train_batch_end`` (a hook), each ``ModelCheckpoint``'s
``_monitor_candidates`` and the checkpoint connector's ``dump_checkpoint``
(private, checked; each the original outside an event where some rank joined);
during a validation event, ``strategy.model`` is the module inside DDP (under
FSDP, the training Join's adapter of the root is paused instead).
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

try:
    import pytorch_lightning as pl
    import torch
    import torch.distributed as dist
    from pytorch_lightning.callbacks import Callback
    from pytorch_lightning.utilities.exceptions import SIGTERMException
except ImportError as error:  # pragma: no cover - the lightning extra is missing
    raise ImportError(
        "Could not find pytorch_lightning: joinkit.adapters.lightning needs it. Please run "
        "`pip install 'joinkit[lightning]'`"
    ) from error

from joinkit import Join, LocalProtocolError, SideChannel, SideCollective

from . import _private
from .fabric import OptimizerStateSync

__all__ = ["UnevenInputs"]

_log = logging.getLogger(__name__)

_SUM_OPS = {"mean": "mean", "avg": "mean", "sum": "sum"}
_OTHER_OPS = ("max", "min")


class UnevenInputs(Callback):
    """Makes ``Trainer.fit`` correct when ranks have different numbers of training batches.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp",
                          callbacks=[UnevenInputs()])
        trainer.fit(model, train_dataloaders=per_rank_loader)

    Args:
        side_collectives: per-batch collectives of your own hooks, as
            :class:`joinkit.SideCollective` objects, in the order they run between
            the backward pass and the end of the LightningModule's
            ``on_train_batch_end`` (the module doc's step 4).
        timeout: the Join's ``timeout`` (default: joinkit's).
        side_channel: a :class:`joinkit.SideChannel` listed in every epoch's
            Join: your hooks' collectives in any number and order per batch go
            through it (step 5), and so do the per-step syncs of torchmetrics
            metrics with ``dist_sync_on_step=True``. ``None``: the callback makes
            one when the module has such a metric (attribute ``side_channel``).

    Raises:
        TypeError: a ``side_collectives`` element is not a ``SideCollective``,
            ``side_channel`` is not a ``SideChannel``; at an epoch start, a
            per-step-syncing metric with a ``process_group`` of its own; at
            ``fit``, the strategy is neither one of Lightning's DDP strategies nor
            ``ModelParallelStrategy``, or uses what the FSDP2 path does not support
            (module doc); under ``FSDPStrategy``, a rank with no training batch
            (or none left in a resumed epoch) and no ``example_input_array`` on
            the module.
        ValueError (at ``fit``, every rank): ``val_check_interval`` as a
            duration (each rank's clock decides); an int ``val_check_interval``
            above the longest rank's number of batches.
        UnsupportedLightningError (at ``fit``): this Lightning changed a member
            joinkit relies on.
        LocalProtocolError: ``self.log(..., sync_dist=True, sync_dist_group=...)``
            with a group other than the default one, during a training batch; on
            every rank after an epoch's Join, a rank had no training batch and the
            others logged epoch-level values Lightning syncs at the epoch's end.
    """

    def __init__(self, side_collectives: Sequence[SideCollective] = (),
                 timeout: float | None = None, side_channel: SideChannel | None = None) -> None:
        if side_channel is not None and not isinstance(side_channel, SideChannel):
            raise TypeError(
                f"UnevenInputs(side_channel=...) takes a joinkit.SideChannel, not "
                f"{type(side_channel).__qualname__}"
            )
        for side in side_collectives:
            if not isinstance(side, SideCollective):
                raise TypeError(
                    f"UnevenInputs(side_collectives=...) takes joinkit.SideCollective objects, "
                    f"not {type(side).__qualname__}: wrap the call, SideCollective(fn, shadow=...)"
                )
        self._extra = list(side_collectives)
        self._timeout = timeout
        self._user_channel = side_channel
        #: The side channel of the epoch Joins: ``side_channel``, or one of the
        #: callback's own when the LightningModule holds a torchmetrics metric
        #: with ``dist_sync_on_step=True`` (``None``: neither).
        self.side_channel: SideChannel | None = side_channel
        self._synced_metrics: list[tuple[Any, Any]] = []  # (metric, its dist_sync_fn)
        self._empty = False  # this rank has no training batch (a stand-in count of 1)
        # A resumed epoch in which this rank's batches were all trained before the save.
        self._out_epoch: int | None = None
        self._entered: int | None = None  # the epoch whose Join was entered last
        self._mid_val = False  # val_check_interval validates mid-epoch: validation events
        self._val_event: SideCollective | None = None
        self._ckpt_event: SideCollective | None = None
        self._step_saves: list[Callable[..., Any]] = []  # the step ModelCheckpoints' own
        self._event_state: _EventState | None = None  # while an event runs
        self._any_empty = False  # some rank has none (agreed in setup_data)
        self._cut = False  # the epoch's Join ended by max_steps before some rank's last batch
        self._join: Join | None = None
        self._log_sync: SideCollective | None = None
        self._sigterm: SideCollective | None = None
        self._deferred: list[tuple[torch.Tensor, str]] = []
        self._stash: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._patched: list[tuple[Any, str]] = []
        self._active = False
        self._fsdp = False  # ModelParallelStrategy (FSDP2) or FSDPStrategy (FSDP1)
        self._fsdp1 = False  # FSDPStrategy
        self._fsdp_root: Any = None  # its root FSDP module, from on_fit_start
        # FSDP1: the LightningModule's latest forward input (the replay's), and the hook.
        self._forward_input: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._forward_hook: Any = None
        self._val_join: Join | None = None
        self._val_target: Any = None  # a validation event's adapter of the FSDP root
        self._trainer: pl.Trainer | None = None
        self._sigterm_seen = False  # this rank got SIGTERM (the swapped handler)
        self._handlers: tuple[Any, Any] | None = None  # (Lightning's, ours)
        #: The Join of each finished epoch's training, for reports (``join.report``).
        self.joins: list[Join] = []

    # -- set-up and tear-down -------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or trainer.world_size < 2:
            return
        _private.check("Trainer")
        strategy = trainer.strategy
        self._fsdp_root, self._fsdp, self._fsdp1 = None, False, False
        if _is_model_parallel(strategy):
            _check_model_parallel(trainer)
            self._fsdp = True  # its root module exists after configure_model: on_fit_start
        elif _is_fsdp1(strategy):
            self._fsdp = self._fsdp1 = True  # wrapped in strategy.setup: on_fit_start
        elif not _is_ddp(strategy):
            raise TypeError(
                f"UnevenInputs supports Lightning's DDP strategies ('ddp', 'ddp_spawn', ...), "
                f"FSDPStrategy ('fsdp', FSDP1) and ModelParallelStrategy (FSDP2, "
                f"fully_shard), not {type(strategy).__qualname__}"
            )
        refusal = _mid_epoch_refusal(trainer)
        if refusal is not None:  # every rank alike, before Lightning's post-setup barrier
            raise ValueError(refusal)
        epoch_loop = trainer.fit_loop.epoch_loop
        self._trainer, self._sigterm_seen = trainer, False
        self._sigterm = SideCollective(self._sigterm_check, shadow=self._sigterm_check,
                                       name="Lightning's SIGTERM check")
        self._log_sync = SideCollective(self._sync_deferred, shadow=self._shadow_deferred,
                                        name="self.log(sync_dist=True) of the batch")
        self._set_up_mid_epoch(trainer)
        self._patch(epoch_loop, "_broadcast_sigterm_tensor", self._batch_check)
        self._patch(trainer.fit_loop, "setup_data",
                    _agreeing_setup_data(self, trainer, trainer.fit_loop.setup_data))
        # Leave the epoch's Join after the LightningModule's own on_train_batch_end
        # (Lightning calls it after the callbacks'), so its collectives, through the
        # side channel, and its sync_dist values are still inside the Join.
        self._patch(pl_module, "on_train_batch_end",
                    _leaving_batch_end(self, trainer, pl_module.on_train_batch_end))
        self._patch(strategy, "reduce", _deferring_reduce(self, strategy.reduce))
        block: Any = getattr(strategy, "block_backward_sync")  # ParallelStrategy's  # noqa: B009
        self._patch(strategy, "block_backward_sync", _syncing_block(self, block))
        if self._fsdp and trainer.accumulate_grad_batches > 1:
            # Every training batch of a world of 2 or more is in a Join.
            self._patch(epoch_loop, "_should_accumulate", _windowed_accumulation(epoch_loop))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._leave_validation(None)
        self._leave(None)
        self._restore_handler()
        if self._sigterm_seen and self._trainer is not None:
            self._trainer._signal_connector.received_sigterm = True
        self._trainer = None
        self._fsdp_root, self._fsdp, self._fsdp1 = None, False, False
        if self._forward_hook is not None:
            self._forward_hook.remove()
        self._forward_hook = self._forward_input = None
        self._empty = self._any_empty = self._cut = False
        self._out_epoch, self._event_state, self._entered = None, None, None
        for obj, name in reversed(self._patched):
            with contextlib.suppress(AttributeError):
                delattr(obj, name)
        self._patched.clear()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._fsdp1:
            self._fsdp_root = _fsdp1_root(trainer)
            self._forward_hook = pl_module.register_forward_pre_hook(
                self._record_forward, with_kwargs=True)
        elif self._fsdp:
            self._fsdp_root = _fsdp2_root(pl_module)

    # -- FSDP1: the replay's input --------------------------------------------------------

    def _record_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        """The LightningModule's forward input (FSDP1's replay input, module doc)."""
        self._forward_input = (tuple(args), dict(kwargs))

    def _shadow_input(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """FSDP1: a joined rank replays the LightningModule's forward on an empty batch
        shaped as its own latest forward input (``Join(shadow_input=...)``).

        Raises:
            LocalProtocolError: the LightningModule's forward never ran on this rank.
        """
        if self._forward_input is None and self._trainer is not None:
            # A rank with no training batch: the module's example_input_array.
            self._forward_input = _example_input(self._trainer.lightning_module)
        if self._forward_input is None:
            raise LocalProtocolError(
                "UnevenInputs with FSDPStrategy (FSDP1) replays the LightningModule's "
                "forward on a joined rank, and this rank's training_step never called it: "
                "call self(...) in training_step (FSDP1 wraps the whole LightningModule, "
                "whose forward is what a joined rank can replay)"
            )
        args, kwargs = self._forward_input

        def empty(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                return value[:0]
            return value

        return (tuple(empty(a) for a in args), {k: empty(v) for k, v in kwargs.items()})

    def _join_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the Joins of the model (training and validation)."""
        kwargs: dict[str, Any] = {} if self._timeout is None else {"timeout": self._timeout}
        if self._fsdp1:
            kwargs["shadow_input"] = self._shadow_input
        return kwargs

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        setattr(obj, name, value)
        self._patched.append((obj, name))

    # -- mid-epoch validation and step checkpoints -------------------------------------

    def _set_up_mid_epoch(self, trainer: pl.Trainer) -> None:
        """Make mid-epoch validation and step checkpoints events of the epoch's Join.

        A step-saving ``ModelCheckpoint`` (``every_n_train_steps``,
        ``train_time_interval``) gets an ``on_train_batch_end`` that, while the Join
        lasts, runs the checkpoint event (one side collective for all of them, in
        their place in the batch); ``val_check_interval`` an int or below 1 makes
        every validation of an epoch the validation event, after the batch's
        ``self.log`` sync (module doc). The checkpoint connector's
        ``dump_checkpoint`` and each ``ModelCheckpoint``'s ``_monitor_candidates``
        take an active rank's when rank 0 has joined.
        """
        from pytorch_lightning.callbacks import ModelCheckpoint

        self._mid_val = _validates_mid_epoch(trainer)
        self._val_event = (SideCollective(self._validation_round, shadow=self._validation_shadow,
                                          name="mid-epoch validation")
                           if self._mid_val else None)
        savers = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        steps = [c for c in savers
                 if c._every_n_train_steps > 0 or c._train_time_interval is not None]
        self._step_saves = [c.on_train_batch_end for c in steps]
        self._ckpt_event = (SideCollective(self._checkpoint_round, shadow=self._checkpoint_shadow,
                                           name="ModelCheckpoint's step save")
                            if steps else None)
        for index, checkpoint in enumerate(steps):
            self._patch(checkpoint, "on_train_batch_end",
                        _step_save(self, checkpoint.on_train_batch_end, first=index == 0))
        if not (steps or self._mid_val):
            return
        connector = trainer._checkpoint_connector
        self._patch(connector, "dump_checkpoint",
                    _writer_dump(self, connector.dump_checkpoint))
        for checkpoint in savers:
            self._patch(checkpoint, "_monitor_candidates",
                        _writer_candidates(self, checkpoint._monitor_candidates))

    def _checkpoint_round(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """An active rank's checkpoint event: the step-saving ModelCheckpoints' own
        ``on_train_batch_end``, on every rank at once (they decide; module doc)."""
        with self._event(True):
            self._run_step_saves(outputs, batch, batch_idx)

    def _checkpoint_shadow(self) -> None:
        """A joined rank's checkpoint event: the same hooks, with the source's batch
        index (``ModelCheckpoint`` reads neither the outputs nor the batch)."""
        with self._event(True) as (_, source_batch_idx):
            self._run_step_saves(None, None, source_batch_idx)

    def _run_step_saves(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer = self._trainer
        assert trainer is not None
        for save in self._step_saves:
            save(trainer, trainer.lightning_module, outputs, batch, batch_idx)

    def _validation_round(self) -> None:
        """An active rank's validation event, after the batch's ``self.log`` sync:
        the ranks validate now if Lightning would on every active rank (module doc)."""
        trainer = self._trainer
        assert trainer is not None
        epoch_loop = trainer.fit_loop.epoch_loop
        fetcher = trainer.fit_loop._data_fetcher
        assert fetcher is not None  # a training batch is running
        vote = epoch_loop._should_check_val_fx(fetcher) and not epoch_loop._skip_next_val
        with self._event(vote) as (agreed, _):
            epoch_loop._skip_next_val = True  # this batch's validation is the event's
            if agreed:
                self._validate(joined=False)

    def _validation_shadow(self) -> None:
        with self._event(True) as (agreed, _):
            if agreed:
                self._validate(joined=True)

    @contextlib.contextmanager
    def _event(self, vote: bool) -> Iterator[tuple[bool, int]]:
        """One agreement of every rank (an all-gather), then Lightning's own code
        on every rank as outside a Join (module doc).

        Yields whether every active rank voted yes, and the batch index of the
        lowest active rank (the *source*). While it lasts a joined rank has the
        source's ``global_step`` and ``is_last_batch``; ``self.log`` syncs and
        the validation forward are Lightning's own (no deferral, no DDP join
        collectives); where rank 0 has joined, the checkpoint it writes and its
        ``ModelCheckpoint`` decisions are the source's.
        """
        trainer = self._trainer
        assert trainer is not None
        group = self._group()
        epoch_loop = trainer.fit_loop.epoch_loop
        progress = epoch_loop.batch_progress
        mine = torch.tensor([1 if self._active else 0, 1 if vote else 0, trainer.global_step,
                             1 if progress.is_last_batch else 0, epoch_loop.batch_idx],
                            dtype=torch.int64, device=trainer.strategy.root_device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, mine, group=group)
        table = [[int(v) for v in row.tolist()] for row in rows]
        actives = [rank for rank, row in enumerate(table) if row[0]]
        if not actives:
            raise LocalProtocolError(
                "UnevenInputs: a mid-epoch event with no active rank (a joinkit bug)")
        source = actives[0]
        agreed = all(table[rank][1] for rank in actives)
        joined, last = not self._active, progress.is_last_batch
        if joined:
            _set_global_step(trainer, table[source][2])
            progress.is_last_batch = bool(table[source][3])
        some_joined = len(actives) < len(table)
        self._event_state = _EventState(
            group=group, source=_global_rank(group, source),
            some_joined=some_joined)
        active, self._active = self._active, False
        try:
            yield agreed, table[source][4]
        finally:
            self._active, self._event_state = active, None
            if joined:
                progress.is_last_batch = last

    def _validate(self, joined: bool) -> None:
        """Lightning's validation after a batch (``on_advance_end``), on every rank,
        its forwards outside the training Join's model (:meth:`_event_forwards`)."""
        trainer = self._trainer
        state = self._event_state
        assert trainer is not None and state is not None
        module = trainer.lightning_module
        if state.some_joined and not self._fsdp:
            # A joined DDP rank did not step since it joined: the source's.
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=state.source, group=state.group)
        epoch_loop = trainer.fit_loop.epoch_loop
        trainer.validating = True
        first_loop_iter = trainer._logger_connector._first_loop_iter
        if not joined and not epoch_loop._should_accumulate():
            module.on_validation_model_zero_grad()
        with self._event_forwards():
            epoch_loop.val_loop.run()
        trainer.training = True
        trainer._logger_connector._first_loop_iter = first_loop_iter

    @contextlib.contextmanager
    def _event_forwards(self) -> Iterator[None]:
        """The validation event's forwards, which every rank runs, are not the
        training Join's rounds.

        DDP: they skip DDP's wrapper (nothing in it is a collective without
        gradients; its join collectives are not this round's). FSDP: each
        rank's shards are its own and current (a joined rank replayed every
        step), and each forward all-gathers, so the ranks validate as after an
        epoch, in a Join of the model of its own (uneven validation batches),
        over a second adapter of the root, while the training Join's adapter
        is paused. FSDP2's root keeps what a forward without a backward
        unsharded: resharded after it (local), so the optimizer steps the shards.
        """
        trainer = self._trainer
        assert trainer is not None
        strategy = trainer.strategy
        root = self._fsdp_root
        if root is not None:
            training = _fsdp_adapter(root)
            self._val_target = type(training)(root)
            try:
                with training.paused():
                    yield None
            finally:
                self._val_target = None
                if not self._fsdp1:
                    root.reshard()
            return
        wrapped = strategy.model
        if not (_is_ddp(strategy)
                and isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)):
            yield None
            return
        strategy.model = wrapped.module
        try:
            yield None
        finally:
            strategy.model = wrapped

    # -- SIGTERM ------------------------------------------------------------------------

    def _swap_handler(self, trainer: pl.Trainer) -> None:
        """Swap Lightning's SIGTERM notifier (a broadcast) for :meth:`_on_sigterm`.

        Lightning registers its handler after ``on_fit_start``; called at each
        epoch start, it swaps once. Where the handler is not Lightning's (not
        the main thread, Windows, a user's own), it does nothing.
        """
        current = signal.getsignal(signal.SIGTERM)
        if self._handlers is not None and current is self._handlers[1]:
            return
        if threading.current_thread() is not threading.main_thread():
            return
        from pytorch_lightning.trainer.connectors.signal_connector import _HandlersCompose

        notifier = trainer._signal_connector._sigterm_notifier_fn
        if not isinstance(current, _HandlersCompose) or notifier not in current.signal_handlers:
            return
        ours = _HandlersCompose([self._on_sigterm if handler == notifier else handler
                                 for handler in current.signal_handlers])
        signal.signal(signal.SIGTERM, ours)  # type: ignore[arg-type]  # a callable object
        self._handlers = (current, ours)

    def _restore_handler(self) -> None:
        handlers, self._handlers = self._handlers, None
        if handlers is None or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is handlers[1]:
            signal.signal(signal.SIGTERM, handlers[0])

    def _on_sigterm(self, signum: Any, frame: Any) -> None:
        """Lightning's notifier without its broadcast: record the signal (no collective)."""
        _log.info("joinkit UnevenInputs: received SIGTERM (%s); every rank stops at the next "
                  "batch's SIGTERM check", signum)
        trainer = self._trainer
        if not self._sigterm_seen and trainer is not None:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # as Lightning's handler: its launcher's processes
        self._sigterm_seen = True

    def _sigterm_flag(self, group: Any) -> bool:
        """Whether some rank got SIGTERM: a MAX all-reduce over ``group`` (every rank)."""
        trainer = self._trainer
        assert trainer is not None
        seen = self._sigterm_seen or trainer.received_sigterm
        flag = torch.tensor([1 if seen else 0], device=trainer.strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag.item()) == 0:
            return False
        trainer._signal_connector.received_sigterm = True
        return True

    def _sigterm_check(self) -> None:
        """The per-batch SIGTERM check: on every rank (an active rank's call, a
        joined rank's shadow round), raise ``SIGTERMException`` if any rank got SIGTERM."""
        if self._sigterm_flag(self._group()):
            raise SIGTERMException()

    # -- the Join of an epoch ---------------------------------------------------------

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._sigterm is None or self._log_sync is None:
            return
        self._swap_handler(trainer)
        strategy = trainer.strategy
        joinables: list[Any]
        if self._fsdp_root is not None:
            # FSDP2: every rank owns shards, so a joined rank steps its optimizer
            # (and step-interval schedulers) in each shadow round (adapters.optim).
            for config in trainer.lr_scheduler_configs:
                if config.interval == "step" and config.frequency != 1:
                    raise TypeError(
                        "UnevenInputs with ModelParallelStrategy shadows step-interval LR "
                        f"schedulers of frequency 1, got frequency={config.frequency}"
                    )
            # The root keeps its unsharded parameters after a forward without a
            # backward (validation); reshard (local) so it holds the sharded
            # parameters the optimizer steps, which the Join links to it (FSDP2).
            if not self._fsdp1:
                self._fsdp_root.reshard()
            joinables = [self._sigterm, self._fsdp_root, *trainer.optimizers]
            joinables += [config.scheduler for config in trainer.lr_scheduler_configs
                          if config.interval == "step"]
        else:
            joinables = [self._sigterm, strategy.model]
            joinables += [OptimizerStateSync(o) for o in trainer.optimizers]
            joinables += [OptimizerStateSync(config.scheduler)
                          for config in trainer.lr_scheduler_configs]
        joinables += self._extra
        metrics = _per_step_metrics(pl_module)
        if metrics and self.side_channel is None:
            self.side_channel = SideChannel(name="UnevenInputs side channel")
        if self.side_channel is not None:
            joinables.append(self.side_channel)
        if self._ckpt_event is not None:  # ModelCheckpoint runs after the other callbacks
            joinables.append(self._ckpt_event)
        joinables.append(self._log_sync)
        if self._val_event is not None:
            joinables.append(self._val_event)
        kwargs: dict[str, Any] = self._join_kwargs() if self._fsdp_root is not None else (
            {} if self._timeout is None else {"timeout": self._timeout})
        if self._fsdp_root is not None and trainer.accumulate_grad_batches > 1:
            kwargs["shared_windows"] = True  # FSDP's windows (module doc)
        if self._fsdp_root is not None and trainer.gradient_clip_val:
            kwargs["shadow_step"] = _clipping_step(trainer, pl_module)
        join = Join(joinables, **kwargs)
        join.__enter__()
        self._join, self._active, self._cut = join, True, False
        self._entered = trainer.current_epoch
        self._route_metric_syncs(metrics)

    def _route_metric_syncs(self, metrics: list[Any]) -> None:
        """Send the per-step syncs of ``metrics`` through the side channel while the Join lasts.

        torchmetrics syncs a ``dist_sync_on_step=True`` metric inside its
        ``forward`` (inside ``training_step``, between DDP's collectives), with
        ``dist_sync_fn(state, group=...)`` returning every rank's state; the side
        channel's ``all_gather`` returns the active ranks' alone, so the step's
        value is the metric over their batches, while a joined rank's service
        thread answers for it.
        """
        channel = self.side_channel
        assert channel is not None or not metrics

        def gather(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
            assert channel is not None
            return [t.to(tensor.device) for t in channel.all_gather(tensor)]

        for metric in metrics:
            self._synced_metrics.append((metric, metric.dist_sync_fn))
            metric.dist_sync_fn = gather

    def _restore_metric_syncs(self) -> None:
        synced, self._synced_metrics = self._synced_metrics, []
        for metric, original in synced:
            metric.dist_sync_fn = original

    def _after_batch(self, trainer: pl.Trainer) -> None:
        """After the LightningModule's ``on_train_batch_end``: sync the batch's
        ``self.log`` values; after this rank's last batch, leave the epoch's Join."""
        if self._join is None or self._log_sync is None:
            return
        self._log_sync()
        if self._val_event is not None:
            self._val_event()
        epoch_loop = trainer.fit_loop.epoch_loop
        progress = epoch_loop.batch_progress
        if progress.is_last_batch or progress.current.ready == trainer.num_training_batches:
            self._leave(None)
            if self._cut:
                # Another rank's epoch ended by max_steps: a single process would not
                # reach the end of the epoch, so no rank validates (as a single process).
                epoch_loop._skip_next_val = True

    def _batch_check(self) -> None:
        """Lightning's per-batch SIGTERM check, before each batch is fetched.

        On an active rank, the SIGTERM side collective (the Join's heartbeat). On
        a rank with no training batch (a stand-in count of 1), or none left in
        an epoch resumed from a mid-epoch checkpoint, this is where its next
        batch would start: it leaves the Join (shadowing every round of the
        others' epoch, validation events included), validates when the others
        do at the epoch's end (no validation events), and ends the epoch loop
        (``StopIteration``, as Lightning's empty fetch).
        """
        trainer = self._trainer
        if (trainer is not None and self._join is None and self._entered != trainer.current_epoch
                and trainer.fit_loop.restarted_mid_epoch):
            # Resumed from a mid-epoch checkpoint: Lightning skips on_train_epoch_start.
            self.on_train_epoch_start(trainer, trainer.lightning_module)
        if not self._no_batch_left() or self._join is None or trainer is None:
            assert self._sigterm is not None
            self._sigterm()
            return
        epoch_loop = trainer.fit_loop.epoch_loop
        self._leave(None)
        # As after a last batch: the epoch's plateau schedulers step in the fit
        # loop (its other schedulers came with the last joiner's state).
        epoch_loop.batch_progress.is_last_batch = True
        if not self._cut and not self._mid_val and epoch_loop._should_check_val_epoch():
            # What Lightning runs after a last batch (training_epoch_loop.on_advance_end).
            trainer.validating = True
            trainer.lightning_module.on_validation_model_zero_grad()
            epoch_loop.val_loop.run()
            trainer.training = True
        raise StopIteration  # the epoch loop's end, with nothing fetched

    def _no_batch_left(self) -> bool:
        """Whether this rank has no training batch in this epoch (module doc)."""
        trainer = self._trainer
        return self._empty or (trainer is not None and self._out_epoch == trainer.current_epoch)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           loss: torch.Tensor) -> None:
        # DDP all-reduces a parameter's whole .grad: with gradients accumulated
        # since the window began (already averaged) and a joined rank adding 0,
        # that part would be halved. So the backward sees a zero .grad, and the
        # window's part goes back after it (module doc).
        if not self._active or trainer.accumulate_grad_batches == 1 or not _is_ddp(
                trainer.strategy):
            return
        stash: list[tuple[torch.Tensor, torch.Tensor]] = []
        for param in pl_module.parameters():
            if param.grad is not None:
                stash.append((param, param.grad.detach().clone()))
                param.grad.zero_()
        self._stash = stash

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stash, self._stash = self._stash, []
        for param, grad in stash:
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave(None)  # an epoch ended before its last batch (max_steps, a -1 hook)

    # -- validation with FSDP2 ----------------------------------------------------------

    def on_validation_epoch_start(self, trainer: pl.Trainer,
                                  pl_module: pl.LightningModule) -> None:
        # Under FSDP2 every validation forward all-gathers parameters, so uneven
        # validation batches are joined too: a rank that ran out replays the
        # forward (no backward: gradients are off) until every rank has finished.
        if self._fsdp_root is None or trainer.world_size < 2:
            return
        # In a validation event: the second adapter (_event_forwards).
        target = self._fsdp_root if self._val_target is None else self._val_target
        join = Join([target], **self._join_kwargs())
        join.__enter__()
        self._val_join = join

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if self._val_join is None:
            return
        counts = (trainer.num_sanity_val_batches if trainer.sanity_checking
                  else trainer.num_val_batches)
        last = len(counts) - 1
        while last > 0 and counts[last] == 0:
            last -= 1
        if dataloader_idx == last and batch_idx + 1 >= counts[last]:
            self._leave_validation(None)

    def on_validation_epoch_end(self, trainer: pl.Trainer,
                                pl_module: pl.LightningModule) -> None:
        self._leave_validation(None)

    def _leave_validation(self, exception: BaseException | None) -> None:
        join, self._val_join = self._val_join, None
        if join is None:
            return
        if exception is None:
            join.__exit__(None, None, None)
        else:
            join.__exit__(type(exception), exception, exception.__traceback__)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._leave_validation(exception)
        self._leave(exception)

    def _leave(self, exception: BaseException | None) -> None:
        join, self._join = self._join, None
        self._active = False
        self._deferred.clear()
        self._restore_metric_syncs()
        if join is None:
            return
        self.joins.append(join)
        if exception is None:
            cut = self._cut_by_max_steps()
            join.__exit__(None, None, None)
            if self._trainer is not None:
                self._agree(join.process_group, cut)
        else:
            join.__exit__(type(exception), exception, exception.__traceback__)

    def _cut_by_max_steps(self) -> bool:
        """Whether this rank's epoch ends by ``max_steps`` with batches left."""
        trainer = self._trainer
        if trainer is None or self._no_batch_left():
            return False
        epoch_loop = trainer.fit_loop.epoch_loop
        progress = epoch_loop.batch_progress
        left = not progress.is_last_batch and progress.current.ready < trainer.num_training_batches
        return left and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps

    def _agree(self, group: Any, cut: bool) -> None:
        """After an epoch's Join, on every rank: one MAX all-reduce of what the ranks
        must agree on before Lightning goes on.

        - a SIGTERM after this rank's last check of the epoch (Lightning's own
          end-of-batch check then stops each rank);
        - whether some rank's epoch ended by ``max_steps`` with batches left (then
          no rank validates, as a single process would not reach the epoch's end);
        - ``trainer.global_step``: a joined DDP rank did not step in its shadow
          rounds, so every rank takes the last joiner's count (one optimizer step
          per round, as a single process), and ``max_steps`` stops every rank at
          the same batch of a later epoch; and the count of training batches
          across epochs, likewise (one per round).
        """
        trainer = self._trainer
        assert trainer is not None
        seen = self._sigterm_seen or trainer.received_sigterm
        total: Any = trainer.fit_loop.epoch_loop.batch_progress.total  # a _ProcessedTracker
        flags = torch.tensor([1 if seen else 0, 1 if cut else 0, trainer.global_step,
                              total.ready], dtype=torch.int64,
                             device=trainer.strategy.root_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        sigterm, any_cut, steps, batches = (int(v) for v in flags.tolist())
        if batches > total.ready:
            # The batch count across epochs (val_check_interval with
            # check_val_every_n_epoch=None counts it) as the last joiner's.
            behind = batches - total.ready
            total.ready += behind
            total.started += behind
            total.processed += behind
            total.completed += behind
        if self._fsdp_root is not None and _closed_a_window(self._fsdp_root):
            steps += 1  # the post hooks' step of the last window, on every rank
        if sigterm:
            trainer._signal_connector.received_sigterm = True
        self._cut = bool(any_cut)
        _set_global_step(trainer, steps)
        if self._any_empty:
            _check_epoch_logs(trainer, group)

    # -- self.log(sync_dist=True) during the Join -----------------------------------

    def defer(self, tensor: torch.Tensor, group: Any, reduce_op: Any) -> torch.Tensor:
        """``strategy.reduce`` during the Join: record ``tensor``, sync it after the step."""
        if group is not None and group is not dist.group.WORLD:
            raise LocalProtocolError(
                "self.log(..., sync_dist=True, sync_dist_group=...) with a group of its own "
                "cannot be shadowed by UnevenInputs during training batches: log with the "
                "default group, or on_epoch only"
            )
        op = _op_name(reduce_op)
        if tensor.numel() != 1:
            raise LocalProtocolError(
                f"UnevenInputs syncs one-element values logged with sync_dist=True, got a "
                f"tensor of shape {tuple(tensor.shape)}"
            )
        out = tensor.detach().clone()
        self._deferred.append((out, op))
        return out

    def _sync_deferred(self) -> None:
        """Sync the batch's deferred values in place (an active rank, once per batch)."""
        deferred, self._deferred = self._deferred, []
        sums = [t for t, op in deferred if op in ("mean", "sum")]
        counts = [sum(1 for _, op in deferred if op == name) for name in _OTHER_OPS]
        sizes = self._header([len(sums), *counts])
        if sizes[0]:
            buf = torch.tensor([float(t) for t in sums] + [1.0], dtype=torch.float64)
            self._all_reduce(buf, dist.ReduceOp.SUM, sizes[0] + 1)
            means = iter(buf[:-1].tolist())
            for tensor, op in deferred:
                if op in ("mean", "sum"):
                    value = next(means)
                    tensor.fill_(value / float(buf[-1]) if op == "mean" else value)
        for name, size in zip(_OTHER_OPS, sizes[1:], strict=True):
            if size:
                values = [t for t, op in deferred if op == name]
                buf = torch.tensor([float(t) for t in values], dtype=torch.float64)
                self._all_reduce(buf, _REDUCE_OPS[name], size)
                for tensor, value in zip(values, buf.tolist(), strict=True):
                    tensor.fill_(value)

    def _shadow_deferred(self) -> None:
        """A joined rank's side of :meth:`_sync_deferred`: the header, then neutral values."""
        sizes = self._header([0, 0, 0])
        if sizes[0]:
            self._all_reduce(torch.zeros(sizes[0] + 1, dtype=torch.float64),
                             dist.ReduceOp.SUM, sizes[0] + 1)
        for name, size in zip(_OTHER_OPS, sizes[1:], strict=True):
            if size:
                fill = -math.inf if name == "max" else math.inf
                self._all_reduce(torch.full((size,), fill, dtype=torch.float64),
                                 _REDUCE_OPS[name], size)

    def _header(self, counts: list[int]) -> list[int]:
        header = torch.tensor(counts, dtype=torch.float64)
        dist.all_reduce(header, op=dist.ReduceOp.MAX, group=self._group())
        return [int(v) for v in header.tolist()]

    def _all_reduce(self, buf: torch.Tensor, op: Any, size: int) -> None:
        if buf.numel() != size:
            raise LocalProtocolError(
                f"the ranks logged different numbers of sync_dist values in one batch ({size} "
                f"on some rank, {buf.numel()} here): log the same names on every rank"
            )
        dist.all_reduce(buf, op=op, group=self._group())

    def _group(self) -> Any:
        join = self._join
        return None if join is None else join.process_group


_REDUCE_OPS = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _op_name(reduce_op: Any) -> str:
    if reduce_op is None:
        return "sum"
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        if name in _SUM_OPS:
            return _SUM_OPS[name]
        if name in _OTHER_OPS:
            return name
    else:
        for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX),
                         ("min", dist.ReduceOp.MIN), ("mean", dist.ReduceOp.AVG)):
            if reduce_op == op:
                return name
    raise LocalProtocolError(
        f"UnevenInputs cannot shadow self.log(..., reduce_fx={reduce_op!r}, sync_dist=True) "
        "during training batches: use mean, sum, max or min"
    )


def _deferring_reduce(callback: UnevenInputs, original: Callable[..., Any]) -> Callable[..., Any]:
    def reduce(tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if callback._active and isinstance(tensor, torch.Tensor):
            return callback.defer(tensor, group, reduce_op)
        if (isinstance(tensor, torch.Tensor) and not tensor.is_floating_point()
                and isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")):
            # An epoch mean divides the synced sum of values by the synced
            # count of samples, each "mean"-reduced; Lightning's integer mean
            # truncates (11 samples on 2 ranks: 5), which uneven ranks hit.
            return original(tensor.to(torch.float64), group=group, reduce_op=reduce_op)
        return original(tensor, group=group, reduce_op=reduce_op)

    return reduce


def _syncing_block(callback: UnevenInputs,
                   original: Callable[[], Any]) -> Callable[[], Any]:
    @contextlib.contextmanager
    def block_backward_sync() -> Iterator[None]:
        root = callback._fsdp_root
        if callback._active and root is not None:
            # FSDP's own window (module doc): Lightning blocks nothing for it.
            if callback._fsdp1:
                with root.no_sync():
                    yield None
                return
            root.set_requires_gradient_sync(False)
            try:
                yield None
            finally:
                root.set_requires_gradient_sync(True)
            return
        if callback._active:
            yield None  # every backward syncs while the Join lasts (module doc)
            return
        with original():
            yield None

    return block_backward_sync


def _clipping_step(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Callable[[], None]:
    """Under FSDP with ``gradient_clip_val``: a joined rank's step clips as the active
    ranks' optimizer step does (the module's ``configure_gradient_clipping``: by norm a
    norm all-reduce over the shards, by value each rank's own shard), then steps.

    Raises:
        TypeError: several optimizers (the Join's one step would step each).
    """
    if len(trainer.optimizers) != 1:
        raise TypeError(
            "UnevenInputs under FSDP with gradient_clip_val clips in a joined rank's step, "
            f"which steps one optimizer; this module has {len(trainer.optimizers)}"
        )
    optimizer = trainer.optimizers[0]

    def step() -> None:
        pl_module.configure_gradient_clipping(optimizer, trainer.gradient_clip_val,
                                              trainer.gradient_clip_algorithm)
        optimizer.step()

    return step


def _windowed_accumulation(epoch_loop: Any) -> Callable[[], bool]:
    """The epoch loop's ``_should_accumulate`` under FSDP2 accumulation: a batch steps
    only where it ends a window, not at the rank's own last batch (module doc). Also
    after the rank left the Join at that batch (Lightning asks again for the LR
    schedulers and the logging step): the window's step is the post hooks'."""

    def should_accumulate() -> bool:
        return not epoch_loop._accumulated_batches_reached()

    return should_accumulate


def _closed_a_window(root: Any) -> bool:
    """Whether the epoch's Join closed an open FSDP window in its post hooks."""
    return bool(_fsdp_adapter(root).closed_window)


def _fsdp_adapter(root: Any) -> Any:
    """joinkit's adapter of the FSDP root (FSDP1 or FSDP2), the training Join's."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from joinkit.adapters.torch import fsdp, fsdp1

    return fsdp1.adapt(root) if isinstance(root, FullyShardedDataParallel) else (
        fsdp.adapt(root))


def _is_fsdp1(strategy: Any) -> bool:
    from pytorch_lightning.strategies import FSDPStrategy

    return isinstance(strategy, FSDPStrategy)


def _fsdp1_root(trainer: pl.Trainer) -> Any:
    """FSDPStrategy's root ``FullyShardedDataParallel`` (the wrapped LightningModule)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    root = trainer.strategy.model
    if not isinstance(root, FullyShardedDataParallel):
        raise TypeError(
            "UnevenInputs with FSDPStrategy expects the strategy's model to be the root "
            f"FullyShardedDataParallel, got {type(root).__qualname__}"
        )
    return root


def _agreeing_setup_data(callback: UnevenInputs, trainer: pl.Trainer,
                         original: Callable[[], None]) -> Callable[[], None]:
    """The fit loop's ``setup_data``, with ranks that have no training batch.

    Lightning skips the whole fit loop of a rank whose training loader is empty
    (and by default raises there alone), while the other ranks train. After
    Lightning (re)loads the training data (every rank together), the ranks agree
    in one MAX all-reduce whether some rank has none and some rank has some; an
    empty rank then counts one stand-in batch, so Lightning runs its epochs
    (hooks, validation) and :meth:`UnevenInputs._batch_check` shadows the others'
    batches in that batch's place. The same all-reduce finds, in an epoch
    resumed from a mid-epoch checkpoint (every rank restores the batch count of
    the rank that wrote it), the ranks whose batches were all trained before
    the save, and the longest epoch, from which ``val_check_interval`` is
    reckoned on every rank (module doc).
    """
    def setup_data() -> None:
        fit_loop = trainer.fit_loop
        before = fit_loop._combined_loader
        module = trainer.lightning_module
        allow = module.allow_zero_length_dataloader_with_multiple_devices
        module.allow_zero_length_dataloader_with_multiple_devices = True
        every_n = trainer.check_val_every_n_epoch
        if isinstance(trainer.val_check_interval, int):
            # Lightning refuses an interval above the rank's own batch count, on
            # that rank alone: checked below against the longest rank's.
            trainer.check_val_every_n_epoch = None
        try:
            original()
        finally:
            module.allow_zero_length_dataloader_with_multiple_devices = allow
            trainer.check_val_every_n_epoch = every_n
        if fit_loop._combined_loader is None or fit_loop._combined_loader is before:
            return  # not (re)loaded now: on every rank alike
        batches = fit_loop.max_batches
        count = _BIG if math.isinf(batches) else int(batches)
        epoch_loop = fit_loop.epoch_loop
        trained = epoch_loop.batch_progress.current.ready if epoch_loop.restarting else 0
        empty = count == 0
        out = not empty and trained >= count  # resumed after its last batch
        flags = torch.tensor([1 if empty else 0, 0 if empty or out else 1, count,
                              1 if out else 0],
                             dtype=torch.int64, device=trainer.strategy.root_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        any_empty, any_batches, longest, any_out = (int(v) for v in flags.tolist())
        callback._any_empty = bool(any_empty or any_out) and bool(any_batches)
        callback._empty = empty and bool(any_batches)
        callback._out_epoch = trainer.current_epoch if out and any_batches else None
        if callback._any_empty and callback._fsdp1 and _example_input(module) is None:
            raise TypeError(
                "UnevenInputs under FSDPStrategy (FSDP1): some rank's training loader is "
                "empty, and that rank replays the LightningModule's forward on an empty batch "
                "shaped as an input it never had: set the module's example_input_array (one "
                "input of forward, e.g. torch.zeros(1, 3)), or give every rank a batch"
            )
        if callback._empty:
            fit_loop.max_batches = 1  # one stand-in batch; the fetch finds none
            fit_loop._last_train_dl_reload_epoch = trainer.current_epoch
        if (callback._mid_val or callback._empty) and longest < _BIG:
            # An empty rank's is unset (Lightning returned before it).
            _agree_val_check_batch(trainer, longest)

    return setup_data


_BIG = 2**62  # an unsized training loader's batch count, in the all-reduce


def _agree_val_check_batch(trainer: pl.Trainer, longest: int) -> None:
    """``trainer.val_check_batch`` as a single process over the longest rank's epoch.

    Raises:
        ValueError: (every rank) an int ``val_check_interval`` above the longest
            rank's number of batches, as Lightning alone (with its advice).
    """
    interval = trainer.val_check_interval
    if isinstance(interval, int):
        if (interval > longest and trainer.check_val_every_n_epoch is not None
                and trainer.limit_val_batches > 0):
            raise ValueError(
                f" `val_check_interval` ({interval}) must be less than or equal to the number "
                f"of the training batches ({longest}, the most any rank has). If you want to "
                "disable validation set `limit_val_batches` to 0.0 instead. If you want to "
                "validate based on the total training batches, set "
                "`check_val_every_n_epoch=None`.")
        trainer.val_check_batch = interval
    else:
        trainer.val_check_batch = max(1, int(longest * interval))


def _example_input(module: pl.LightningModule) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The LightningModule's ``example_input_array`` as forward's ``(args, kwargs)``
    (Lightning's convention: a tuple is the positional arguments, a dict the keyword
    arguments), or ``None``."""
    example = module.example_input_array
    if example is None:
        return None
    if isinstance(example, dict):
        return (), dict(example)
    if isinstance(example, tuple):
        return example, {}
    return (example,), {}


def _leaving_batch_end(callback: UnevenInputs, trainer: pl.Trainer,
                       original: Callable[..., Any]) -> Callable[..., Any]:
    def on_train_batch_end(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        callback._after_batch(trainer)
        return result

    return on_train_batch_end


def _per_step_metrics(pl_module: pl.LightningModule) -> list[Any]:
    """The torchmetrics metrics in ``pl_module`` that sync in every ``forward``."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency of Lightning
        return []
    found = []
    for name, module in pl_module.named_modules():
        if isinstance(module, Metric) and module.dist_sync_on_step:
            if module.process_group not in (None, dist.group.WORLD):
                raise TypeError(
                    f"UnevenInputs routes the per-step sync of torchmetrics metrics "
                    f"(dist_sync_on_step=True) over the Join's ranks; {name!r} has a "
                    "process_group of its own: drop it, or dist_sync_on_step"
                )
            found.append(module)
    return found


def _set_global_step(trainer: pl.Trainer, steps: int) -> None:
    """Set ``trainer.global_step`` (automatic optimization: its optimizer-step count)."""
    if not trainer.lightning_module.automatic_optimization:
        return
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
    total = progress.optimizer.step.total
    if steps > total.completed:
        total.ready = total.ready + steps - total.completed
        total.completed = steps


def _check_epoch_logs(trainer: pl.Trainer, group: Any) -> None:
    """Refuse, on every rank, epoch-level training values a rank with no batch lacks.

    Lightning syncs each ``self.log(..., on_epoch=True)`` value with
    ``sync_dist=True`` (and each logged torchmetrics object, at ``compute``) at
    the epoch's end, on the ranks that logged it; a rank without a training
    batch logged none, so the others' syncs would wait for it.
    """
    results = trainer.fit_loop.epoch_loop._results
    mine = sorted(key for key, result in results.items()
                  if result.meta.on_epoch and (not result.is_tensor or result.meta.sync.should))
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if any(keys != every[0] for keys in every):
        raise LocalProtocolError(
            "UnevenInputs: a rank had no training batch this epoch, and the others logged "
            "epoch-level training values that Lightning syncs at the epoch's end "
            f"({sorted({k for keys in every for k in keys})}: self.log(..., on_epoch=True, "
            "sync_dist=True) or a torchmetrics object), which that rank cannot take part "
            "in: log them on_step only, without sync_dist, or compute the metric in "
            "on_train_epoch_end yourself"
        )


def _is_ddp(strategy: Any) -> bool:
    from pytorch_lightning.strategies import DDPStrategy

    return isinstance(strategy, DDPStrategy)




def _validates_mid_epoch(trainer: pl.Trainer) -> bool:
    """Whether ``val_check_interval`` validates in the middle of an epoch (an int
    number of batches, or a fraction below 1)."""
    interval = getattr(trainer, "val_check_interval", None)  # unset: a duration
    return isinstance(interval, int) or (isinstance(interval, float) and interval < 1.0)


def _mid_epoch_refusal(trainer: pl.Trainer) -> str | None:
    """Why the Trainer's mid-epoch validation cannot run under the callback, or ``None``.

    Time-based validation (``val_check_interval`` a duration) is decided by each
    rank's clock, which the ranks do not share.
    """
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return (
            "UnevenInputs: Trainer(val_check_interval=...) as a duration validates by each "
            "rank's clock, which the ranks do not share, so a rank that ran out of "
            "training batches cannot tell when the others validate: give "
            "val_check_interval as a number of batches (an int) or a fraction of the epoch")
    return None


def _global_rank(group: Any, rank: int) -> int:
    """The global rank of ``rank`` in ``group`` (``None``: the default group)."""
    return rank if group is None else dist.get_global_rank(group, rank)


@attrs.frozen(kw_only=True)
class _EventState:
    """A mid-epoch event while it runs (``UnevenInputs._event``)."""

    group: Any  # the Join's process group (None: the default group)
    source: int  # the global rank whose state a joined rank takes and rank 0 writes
    some_joined: bool  # some rank has joined (else the event is Lightning's alone)


def _step_save(callback: UnevenInputs, original: Callable[..., Any],
               first: bool) -> Callable[..., Any]:
    """A step-saving ModelCheckpoint's ``on_train_batch_end``: during the Join, the
    first one runs the checkpoint event (every step-saving one, on every rank)."""
    def on_train_batch_end(trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> Any:
        if not callback._active or callback._ckpt_event is None:
            return original(trainer, pl_module, outputs, batch, batch_idx)
        if first:
            callback._ckpt_event(outputs, batch, batch_idx)
        return None

    return on_train_batch_end


#: A checkpoint's parts that are each rank's own shards under FSDP (every rank
#: dumps and saves its own, in the same order: a collective of shards).
_SHARDED_PARTS = ("state_dict", "optimizer_states")


def _writer_dump(callback: UnevenInputs, original: Callable[..., Any]) -> Callable[..., Any]:
    """The checkpoint connector's ``dump_checkpoint``: in an event where rank 0 (the
    writer) has joined, rank 0 gets the source's checkpoint (its parameters,
    optimizer, loops and loader states are the active ranks'). Under FSDP every
    rank keeps its own model and optimizer parts (its shards, current on a joined
    rank, which stepped in every round; a full state dict is gathered from every
    rank's), and rank 0 takes the rest from the source (loops, loader, callbacks,
    schedulers, ``global_step``): never another rank's shards."""
    def dump_checkpoint(weights_only: bool | None = False) -> dict[str, Any]:
        checkpoint: dict[str, Any] = original(weights_only)
        state = callback._event_state
        if state is None or not state.some_joined or state.source == 0:
            return checkpoint
        rank = dist.get_rank()
        sent = checkpoint if not callback._fsdp else {
            key: value for key, value in checkpoint.items() if key not in _SHARDED_PARTS}
        if rank == state.source:
            dist.send_object_list([sent], dst=0, group=state.group)
        elif rank == 0:
            received: list[Any] = [None]
            dist.recv_object_list(received, src=state.source, group=state.group)
            if not callback._fsdp:
                return dict(received[0])
            checkpoint.update(received[0])
        return checkpoint

    return dump_checkpoint


def _writer_candidates(callback: UnevenInputs,
                       original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A ModelCheckpoint's ``_monitor_candidates``: in an event where some rank has
    joined, the source's (a joined rank's logged training values are older)."""
    def monitor_candidates(trainer: Any) -> Any:
        candidates = original(trainer)
        state = callback._event_state
        if state is None or not state.some_joined:
            return candidates
        shared = [candidates]
        dist.broadcast_object_list(shared, src=state.source, group=state.group)
        return shared[0]

    return monitor_candidates


def _is_model_parallel(strategy: Any) -> bool:
    from pytorch_lightning.strategies import ModelParallelStrategy

    return isinstance(strategy, ModelParallelStrategy)


def _check_model_parallel(trainer: pl.Trainer) -> None:
    """What UnevenInputs supports of ModelParallelStrategy, checked in ``setup``."""
    strategy: Any = trainer.strategy
    if int(strategy._tensor_parallel_size) != 1:  # set by setup_environment, before setup
        raise TypeError(
            "UnevenInputs with ModelParallelStrategy supports data parallelism only "
            f"(tensor_parallel_size=1), got tensor_parallel_size="
            f"{strategy._tensor_parallel_size}: tensor-parallel ranks share their batches"
        )


def _fsdp2_root(pl_module: pl.LightningModule) -> Any:
    """The one root ``fully_shard`` module inside the LightningModule (checked).

    Lightning calls ``training_step`` on the LightningModule itself; the FSDP2
    adapter hooks the forward of the root ``fully_shard`` module, which
    ``training_step`` calls once per batch.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(pl_module, FSDPModule):
        raise TypeError(
            "UnevenInputs needs fully_shard applied to a submodule that training_step calls "
            "(e.g. fully_shard(self.net, mesh=...) in configure_model), not to the "
            "LightningModule itself: joinkit's FSDP2 adapter hooks the forward of the root "
            "fully_shard module, and Lightning calls training_step, not forward"
        )
    roots = [module for name, module in pl_module.named_modules()
             if isinstance(module, FSDPModule) and not any(
                 isinstance(parent, FSDPModule)
                 for parent in _parents(pl_module, name))]
    if len(roots) != 1:
        raise TypeError(
            f"UnevenInputs with ModelParallelStrategy needs exactly one root fully_shard "
            f"module in the LightningModule (the one training_step calls once per batch), "
            f"found {len(roots)}: apply fully_shard to the layers and then to one module "
            "around them in configure_model"
        )
    return roots[0]


def _parents(root: Any, name: str) -> Iterator[Any]:
    """The modules strictly between ``root`` and the submodule ``name``."""
    parts = name.split(".") if name else []
    module = root
    for part in parts[:-1]:
        module = getattr(module, part)
        yield module
