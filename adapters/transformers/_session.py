"""What ``uneven_inputs`` installs on one Trainer: its data, its Joins, its collectives.

Theory of operation
-------------------
One :class:`Session` per Trainer. It wraps methods of the Trainer and of its
Accelerator on the *instances* (each wrapper calls the original it replaced,
so a subclass's override, TRL's included, still runs), and it installs three
process-wide dispatchers in ``transformers.trainer`` that defer to the
originals unless a session's Join is open on the calling thread. Every member
is checked by ``_private.check`` first.

*Data.* Each rank reads its own data: the Trainer's data loaders are built as
the Trainer builds them, but where the Trainer hands its loader to
``accelerator.prepare`` (which would shard it again, dispatch it from rank 0,
or pad it to even lengths) the session builds its own: a map-style training
set gets ``ShardSampler`` (every sample once per epoch, no padding), shuffled
as the Trainer would (``seed + epoch``); an ``IterableDataset`` is this rank's
own stream, used as it is; an evaluation set is cut into the Trainer's
batches, batch ``b`` going to the ``b % k``-th of the ``k`` ranks evaluating,
so the gathered predictions come in dataset order.

*Steps.* ``set_initial_training_values`` sees the epoch length of the rank
with the most batches (one all-gather of the ranks' lengths before training),
so every rank agrees on ``max_steps``, the number of epochs and the LR
schedule. A *step* is one optimizer step of the ranks still training: all of
them step together, whatever their number, so ``global_step``, ``max_steps``,
``logging_steps``, ``eval_steps`` and ``save_steps`` count steps as a single
process training on the union of the ranks' batches would. Each epoch runs in
a :class:`joinkit.Join` of the DDP model, the session's side channel and its
state sync, entered in ``_run_epoch`` (which gets this rank's own number of
batches) and left in the first ``on_epoch_end`` callback: a rank whose batches
ran out shadows the others until every rank has finished the epoch.

*Two loops.* From transformers 5.3 the Trainer runs each epoch in ``_run_epoch``,
which the session wraps as above. Transformers 5.0 to 5.2 write the epoch loop out
in ``_inner_training_loop``; the session hooks the points that loop calls instead
(``_private.LOOPS`` lists them, and the table's check picks the loop the installed
Trainer has): the loop takes an epoch's length from ``len(train_dataloader)``, so
once ``set_initial_training_values`` has read the loaders' true lengths, joinkit's
own loader reports this rank's padded length (the ``steps_in_epoch`` 5.3's
``_run_epoch`` is given); the epoch's Join is entered in joinkit's callback's
``on_epoch_begin`` (which the loop calls after reading that length) and left in its
``on_epoch_end``, or by the ``_inner_training_loop`` wrapper when the loop raises.
What that loop cannot give without a copy of it is refused by name in
``uneven_inputs`` (its inline token count, DeepSpeed, FSDP) and when ``train()``
starts (a checkpoint in the middle of an epoch, or of another world size).

*Gradient accumulation.* A window of ``gradient_accumulation_steps``
micro-batches ends in an optimizer step; a rank whose data ends inside a
window pads it with *empty micro-batches* (its last batch, with the loss
multiplied by zero and every side collective contributing no rows), so every
rank steps at the same micro-batch and logs the same step. During a Join
every backward syncs its gradient (``no_sync`` is off; the gradient
accumulated since the window began is set aside around each backward and
added back), since ranks that join mid-window would otherwise pair DDP's
all-reduces wrongly.

*Collectives.* While a session's Join is open on the thread (and during its
evaluation), ``accelerator.gather``/``gather_for_metrics``/``reduce``/
``pad_across_processes``/``wait_for_everyone``, the Trainer's loss gather
(``nested_gather``; before transformers 5.2 its own ``_nested_gather``),
``store_flos``'s all-gather and its barrier go through the session's
:class:`joinkit.SideChannel`: gathers return only the rows of the ranks still
training (an empty micro-batch adds none), so any number of them per step is
answered by the joined ranks' service threads. With
``average_tokens_across_devices`` the token count of a window is the active
ranks' and the loss is scaled by the world size for DDP's divisor (gradients
are then exactly the token mean over the window's batches); the *reported*
loss is scaled back to the number of ranks that trained, so the logged loss
(the mean over those ranks) is that token mean.

*After a Join.* The post hooks give every rank the last joiner's parameters
(DDP), optimizer and scheduler state, ``TrainerState`` (``global_step``,
``log_history``, best metric, flos...), control flags and loss bookkeeping (the
optimizer state only when some rank missed optimizer steps: ranks that took the
same steps hold the same state already); a rank that missed log entries while
it was joined calls its ``on_log`` callbacks for them (with ``global_step`` as
at the entry), so rank 0's reporting integrations see every entry.

*DeepSpeed* (``TrainingArguments(deepspeed=...)``; what it cannot replay is
refused in ``uneven_inputs``). The epoch's Join takes the engine
(``model_wrapped``) where it takes the DDP model, as a
``joinkit.adapters.deepspeed.DeepSpeedJoinable`` on the Trainer's windows
(``_window_end``: the Trainer sets the engine's boundary itself and steps it at a
window's end only; the windows are padded alike on every rank, see *Gradient
accumulation*). A joined rank replays the engine's micro-steps on one token of
``input_ids`` (a Hugging Face model's attention does not take 0 rows, and a rank
without data has no batch), and after each window's step the Trainer's LR
scheduler steps as ``_run_epoch`` steps it (``_engine_stepped``). The engine
accumulates itself: no gradient is set aside around its backward. The engine's
collectives run on its ZeRO group, a group of its own: inside the epoch's Join the
session's calls go through a second side channel that follows it. The post hook
sends no optimizer state (each rank's is its own partition, stepped by the replay).
A DeepSpeed checkpoint is a collective of every rank (each writes its partition):
after every optimizer step of a Join the ranks agree whether the Trainer saves
(:meth:`Session.agree`: the active ranks in ``_maybe_log_save_evaluate``, a
joined rank in the sync's main hook, after its replay and scheduler step), and a
joined rank then runs the Trainer's own saving calls for its part.

*FSDP* (``TrainingArguments(fsdp=...)``, FSDP2 or FSDP1; ``_fsdp`` says how). The
epoch's Join takes the FSDP model and the Trainer's torch optimizer: a joined rank
replays the model's forward and backward on the DeepSpeed path's one token, then
the Trainer's clipping, optimizer step and scheduler step (``shadow_step``) after
each micro-batch that synced. ``no_sync`` stays FSDP's own (its windows end on every
rank together) and no gradient is set aside; the post hook sends no optimizer state
(each rank's shards are its own). Checkpoints are collective as DeepSpeed's, and so
are evaluation forwards in the middle of an epoch: the same agreement after every
optimizer step also announces each evaluation forward, which the joined ranks shadow
as a round of the Join (:meth:`Session.agree`).

*Evaluation* (``evaluate``, ``predict``, ``eval_strategy``, also in the middle
of an epoch after a rank joined): the ranks evaluating (every rank, or inside
a training Join the active ones, found with one side call) split the batches
and the ranks with one batch fewer add an *empty batch* (no rows in any
gather), so every sample is seen exactly once and every rank runs the same
number of steps. A partial batch's loss, which ``evaluation_loop`` repeats
``eval_batch_size`` times, is cut to the batch's rows in ``gather_for_metrics``
(as Accelerate cuts the last batch), so ``eval_loss`` counts each sample once.
An ``IterableDataset`` evaluation set (each rank's own
stream) is evaluated inside a Join of the side channel instead, outside
training only. While rank 0 has joined, the lowest active rank writes a
checkpoint (``save_steps``), with joinkit's record of what the data consumed, from
which ``train(resume_from_checkpoint=...)`` resumes in the middle of an epoch on
any number of ranks (``_resume``).
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import importlib
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from joinkit import Join, Joinable, JoinHook, SideChannel
from joinkit.adapters.torch.data import ShardSampler
from joinkit.adapters.torch.optim import gradients_set_aside

from . import _fsdp, _private, _resume

__all__ = ["Session", "current", "END", "FORWARD", "SAVE"]

#: What follows an optimizer step of a Join, as the active ranks tell the joined ones
#: (:meth:`Session.agree`): nothing, an evaluation forward (FSDP), a checkpoint.
END, FORWARD, SAVE = 0, 1, 2

_local = threading.local()


def current() -> Session | None:
    """The session whose Join (or evaluation) is open on this thread, if any."""
    return getattr(_local, "session", None)


class _Phantom(dict):  # type: ignore[type-arg]
    """An empty micro-batch (or evaluation batch): a real batch that counts for nothing."""


class Session:
    """The state ``uneven_inputs`` keeps for one Trainer (module doc)."""

    def __init__(self, trainer: Any, join_kwargs: dict[str, Any]) -> None:
        self.trainer = trainer
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.join_kwargs = join_kwargs
        self.channel = SideChannel(dist.group.WORLD, name="transformers side channel")
        #: The Trainer runs a DeepSpeed engine (``model_wrapped``), not DDP.
        self.deepspeed = bool(getattr(trainer, "is_deepspeed_enabled", False))
        #: The Trainer runs an FSDP1 or FSDP2 model (``_fsdp``), not DDP.
        self.fsdp = bool(getattr(trainer, "is_fsdp_enabled", False))
        #: The Trainer's epoch loop is written out in ``_inner_training_loop``
        #: (transformers 5.0 to 5.2), not in ``_run_epoch`` (module doc, *Two loops*).
        self.inline = _private.loop() == "_inner_training_loop"
        # The channel outside the epochs' Joins, and the one in them: a DeepSpeed
        # engine's Join runs on its own (ZeRO) group, which the channel then follows.
        self.world_channel = self.channel
        self.epoch_channel = (SideChannel(name="transformers side channel (DeepSpeed)")
                              if self.deepspeed else self.channel)
        self.sync = _TrainerSync(self)
        self.join: Join | None = None
        self.role: str | None = None
        self.eval_ranks: tuple[int, ...] | None = None
        self.phantom = False
        self.window_ranks = self.world
        self.window = 0
        self.epoch = 0
        self.local_len: int | None = None
        self.global_len: int | None = None
        self.global_updates = 0
        self.predicting = False
        self.local_count = False
        #: An active rank owes the joined ranks the agreement on what follows this
        #: optimizer step or evaluation forward (DeepSpeed, FSDP: :meth:`agree`).
        self.owed = False
        #: Inside ``_maybe_log_save_evaluate`` of a Join (FSDP: its forwards evaluate).
        self.step_tail = False
        #: A joined rank's replay ended a window (DeepSpeed's _engine_stepped, FSDP's
        #: shadow step), or the last agreement announced a forward: its sync hook agrees.
        self.replayed_window_end = False
        #: The forward hooks of an FSDP epoch's Join (_agreement_hooks).
        self.hooks: list[Any] = []
        #: The rows of the evaluation batch in hand when it is partial (_partial_rows).
        self.partial_rows: int | None = None
        #: The training set's sampler (a map-style set), whose state a checkpoint keeps.
        self.train_sampler: ShardSampler | None = None
        #: The checkpoint train() resumes from, its record (_resume) and where it starts.
        self.resume_from: str | None = None
        self.saved: _resume.Saved | None = None
        #: The pass of per-rank streams a run resumed into (until it ran).
        self.resumed_pass: int | None = None
        self.start: _resume.Plan | None = None
        #: A full epoch's (local, global) batches and global steps, and the resumed
        #: epoch's (local, global) batches.
        self.full_lengths: tuple[int | None, int | None, int] = (None, None, 0)
        self.resumed_lengths: tuple[int | None, int | None] = (None, None)
        #: The batches of the current epoch done before this run (a resumed epoch's).
        self.epoch_offset = 0
        #: The epoch the Trainer runs next (counted by the callback, as the loop counts).
        self.next_epoch = 0

    # -- installing ----------------------------------------------------------------

    def install(self) -> None:
        trainer = self.trainer
        accelerator = trainer.accelerator
        names = ["get_train_dataloader", "get_eval_dataloader", "get_test_dataloader",
                 "_inner_training_loop", "set_initial_training_values", "get_batch_samples",
                 "_get_num_items_in_batch", "training_step", "floating_point_ops",
                 "_save_checkpoint", "prediction_step", "evaluation_loop",
                 "_maybe_log_save_evaluate"]
        if not self.inline:
            names += ["_init_training_state", "_run_epoch", "_track_num_input_tokens",
                      "_load_optimizer_and_scheduler"]
        if _private.loss_gather() == "Trainer._nested_gather":
            names.append("_nested_gather")
        for name in names:
            _wrap(trainer, name, getattr(self, f"_t_{name.lstrip('_')}"))
        for name in ("prepare", "gather", "gather_for_metrics", "reduce",
                     "pad_across_processes", "wait_for_everyone", "no_sync", "backward"):
            _wrap(accelerator, name, getattr(self, f"_a_{name}"))
        # gather_for_metrics, as the Trainer took it at construction.
        trainer.gather_function = accelerator.gather_for_metrics
        trainer.callback_handler.callbacks.insert(0, _callback_class()(self))
        _install_dispatchers()

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        before = current()
        _local.session = self
        try:
            yield
        finally:
            _local.session = before

    # -- data loaders --------------------------------------------------------------

    @contextlib.contextmanager
    def _building(self, role: str) -> Iterator[None]:
        before, self.role = self.role, role
        try:
            yield
        finally:
            self.role = before

    def _t_get_train_dataloader(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def get_train_dataloader() -> Any:
            with self._building("train"):
                return original()
        return get_train_dataloader

    def _eval_loader(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def get_dataloader(*args: Any, **kwargs: Any) -> Any:
            # Inside a training Join the active ranks evaluate (one side call
            # finds them); elsewhere every rank does.
            self.eval_ranks = (self.channel.active_ranks() if self.join is not None
                               else tuple(range(self.world)))
            with self._building("eval"):
                return original(*args, **kwargs)
        return get_dataloader

    _t_get_eval_dataloader = _eval_loader
    _t_get_test_dataloader = _eval_loader

    def _a_prepare(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def prepare(*args: Any, device_placement: Any = None) -> Any:
            if self.role is not None and len(args) == 1 and isinstance(args[0], DataLoader):
                return self._own_loader(args[0], self.role)
            return original(*args, device_placement=device_placement)
        return prepare

    def _own_loader(self, loader: DataLoader[Any], role: str) -> Any:
        """This rank's loader for the Trainer's ``loader`` (module doc, *Data*)."""
        dataset: Any = loader.dataset
        params = _loader_params(loader)
        if isinstance(dataset, IterableDataset):
            return _OwnLoader(dataset, batch_size=loader.batch_size, drop_last=loader.drop_last,
                              **params)
        if role == "train":
            args = self.trainer.args
            seed = args.data_seed if args.data_seed is not None else args.seed
            sampler = ShardSampler(dataset, num_replicas=self.world, rank=self.rank,
                                   # (5.0, 5.1: random; group_by_length refused)
                                   shuffle=getattr(args, "train_sampling_strategy",
                                                   "random") != "sequential",
                                   seed=seed, batch_size=loader.batch_size or 1)
            self.train_sampler = sampler
            return _OwnLoader(dataset, batch_size=loader.batch_size, sampler=sampler,
                              drop_last=loader.drop_last, **params)
        ranks = self.eval_ranks or tuple(range(self.world))
        batches = _BatchShard(len(dataset), loader.batch_size or 1, ranks.index(self.rank),
                              len(ranks), loader.drop_last)
        inner = _OwnLoader(dataset, batch_sampler=batches, **params)
        return _PaddedEval(inner, batches)

    # -- training values, epochs, windows ----------------------------------------------

    def _t_set_initial_training_values(self, original: Callable[..., Any]
                                       ) -> Callable[..., Any]:
        def set_initial_training_values(args: Any, dataloader: Any, *rest: Any) -> Any:
            if isinstance(dataloader, _OwnLoader):
                dataloader.reported_length = None  # its own length, from here
            try:
                local: int | None = len(dataloader)
            except TypeError:
                local = None
            lengths = self.channel.all_gather_object(local)  # every rank, before training
            known = [n for n in lengths if n is not None]
            if known and len(known) != len(lengths):
                raise ValueError(
                    "joinkit.adapters.transformers: some ranks' training data loaders have a "
                    f"length and others not ({lengths}): give every rank the same kind of "
                    "dataset (an IterableDataset without __len__ needs max_steps)"
                )
            self.local_len = local
            self.global_len = max(known) if known else None
            values = original(args, dataloader if self.global_len is None
                              else _Sized(self.global_len, dataloader), *rest)
            self.global_updates = int(values[1])
            self.full_lengths = (self.local_len, self.global_len, self.global_updates)
            if self.inline and self.global_len is not None and isinstance(dataloader,
                                                                           _OwnLoader):
                # The loop reads an epoch's length from the loader (module doc).
                dataloader.reported_length = lambda: self._epoch_steps(0, 0)[0]
            if self.resume_from is not None:
                resumed = self._resumed_values(args, dataloader, values)
                if self.inline:  # (after _resumed_values' own refusals)
                    self._refuse_inline_resume(args, values)
                values = resumed
            return values
        return set_initial_training_values

    def _refuse_inline_resume(self, args: Any, values: tuple[Any, ...]) -> None:
        """The loop of transformers 5.0 to 5.2 resumes at an epoch's start only.

        It counts the epochs and batches done from ``global_step`` with no hook
        between (``_init_training_state`` came in 5.3), and skips batches of
        joinkit's uneven loaders as if they were even: a checkpoint in the middle of
        an epoch (or saved on another number of ranks, whose epochs have other
        lengths) is refused, on every rank alike (each reads the same files).

        Raises:
            NotImplementedError: such a checkpoint.
        """
        from transformers.trainer import TRAINER_STATE_NAME
        from transformers.trainer_callback import TrainerState

        assert self.resume_from is not None
        path = os.path.join(self.resume_from, TRAINER_STATE_NAME)
        if not os.path.isfile(path):
            return
        step = TrainerState.load_from_json(path).global_step
        saved = _resume.read(self.resume_from)
        other_world = saved is not None and saved.world != self.world
        if other_world or (step % max(int(values[1]), 1) and not args.ignore_data_skip):
            where = (f"saved on {saved.world} ranks (this run has {self.world})"
                     if other_world and saved is not None
                     else f"in the middle of an epoch (step {step})")
            raise NotImplementedError(
                f"joinkit.adapters.transformers: the checkpoint {self.resume_from} is "
                f"{where}, and transformers {_version()}'s Trainer resumes only at an "
                "epoch's start on the ranks that saved it (its epoch loop skips batches as "
                "if every rank had the same; transformers 5.3 and later resume such "
                "checkpoints). Upgrade transformers, resume from a checkpoint saved at an "
                "epoch's end on the same number of ranks, or set ignore_data_skip=True on "
                "that number (the epoch's data starts over)")

    # -- resuming in the middle of an epoch (_resume) ------------------------------------

    def _t_inner_training_loop(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def inner_training_loop(*args: Any, **kwargs: Any) -> Any:
            self.resume_from = kwargs.get("resume_from_checkpoint")
            self.saved = self.start = None
            try:
                return original(*args, **kwargs)
            except BaseException as error:
                if self.join is not None:  # (the loop's own epochs: module doc)
                    self.leave(error)
                raise
            finally:
                self.resume_from = None
        return inner_training_loop

    def _resumed_values(self, args: Any, dataloader: Any, values: tuple[Any, ...]
                        ) -> tuple[Any, ...]:
        """Load the sampler's state of the checkpoint; the training values of the run."""
        assert self.resume_from is not None
        saved = self.saved = _resume.read(self.resume_from)
        if (saved is not None and self.deepspeed and saved.world != self.world
                and not _loads_universal(self)):
            # DeepSpeed's optimizer state is partitioned over the saving world,
            # wherever in an epoch the checkpoint was written (and data skipped or not).
            raise ValueError(
                f"joinkit.adapters.transformers: the checkpoint {self.resume_from} was saved "
                f"on {saved.world} ranks, and DeepSpeed's optimizer state in it is "
                f"partitioned over them; this run has {self.world}. Resume on {saved.world} "
                "ranks, or convert it to a universal checkpoint (DeepSpeed's "
                "ds_to_universal.py) and set \"checkpoint\": {\"load_universal\": true}")
        sampler = self.train_sampler
        if getattr(dataloader, "sampler", None) is not sampler or sampler is None:
            return values  # streams: the Trainer's own resume (_t_init_training_state)
        if saved is None or args.ignore_data_skip or (saved.sampler is None
                                                       and not saved.epoch_done):
            return values  # no record, or a stream's: refused (_t_init_training_state)
        start = self.start = _resume.plan(saved)
        local = None
        if start.mid_epoch:
            sampler.load_state_dict(saved.sampler or {})
            local = len(dataloader)
        # Every rank read the same record: all gather here, or none.
        longest = max(self.channel.all_gather_object(local)) if start.mid_epoch else None
        self.resumed_lengths = (local, longest)
        gas = args.gradient_accumulation_steps
        return _resume.training_values(
            values, saved=saved, start=start, world=self.world,
            resumed_updates=max(math.ceil(longest / gas), 1) if longest else 0,
            max_steps=args.max_steps, num_train_epochs=args.num_train_epochs)

    def _t_init_training_state(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def init_training_state(*args: Any, **kwargs: Any) -> tuple[int, int]:
            epochs, steps = original(*args, **kwargs)
            trainer_args = self.trainer.args
            if self.start is not None:
                return self.start.epoch, 0  # the sampler holds what is left of it
            saved = self.saved
            if (saved is not None and saved.sampler is None and self.train_sampler is None
                    and not trainer_args.ignore_data_skip):  # per-rank streams
                epochs, steps = _resume.stream_start(
                    saved, world=self.world, gas=trainer_args.gradient_accumulation_steps)
                self.resumed_pass = epochs if steps else None
                return epochs, steps
            if steps > 0 and not trainer_args.ignore_data_skip:
                raise NotImplementedError(_mid_epoch_refusal(self))
            return epochs, steps
        return init_training_state

    def _t_load_optimizer_and_scheduler(self, original: Callable[..., Any]
                                        ) -> Callable[..., Any]:
        def load_optimizer_and_scheduler(checkpoint: Any) -> Any:
            if checkpoint is not None and self.fsdp:
                _fsdp.init_optimizer_state(self.trainer, checkpoint)  # FSDP1, sharded
            return original(checkpoint)

        return load_optimizer_and_scheduler

    def _set_epoch_lengths(self, epoch: int) -> None:
        """This epoch's batch counts: a resumed epoch's are what its sampler left."""
        self.local_len, self.global_len, self.global_updates = self.full_lengths
        self.epoch_offset = 0
        start = self.start
        if start is None or not start.mid_epoch or epoch != start.epoch:
            return
        self.local_len, self.global_len = self.resumed_lengths
        gas = self.trainer.args.gradient_accumulation_steps
        self.global_updates = max(math.ceil((self.global_len or 0) / gas), 1)
        self.epoch_offset = max((self.full_lengths[1] or 0) - (self.global_len or 0), 0)

    def _position_saved(self, result: Any, trial: Any) -> Any:
        """The checkpoint writer adds what the data consumed (``_resume.write``)."""
        trainer = self.trainer
        if not trainer.args.should_save:
            return result
        in_epoch = self.join is not None
        sampler = self.train_sampler if in_epoch else None
        step = trainer.state.global_step
        _resume.write(self._checkpoint_folder(trial), world=self.world, global_step=step,
                      epoch=self.epoch, steps=self.window, epoch_done=not in_epoch,
                      sampler=None if sampler is None else sampler.state_dict())
        return result

    def _t_run_epoch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def run_epoch(**kwargs: Any) -> Any:
            self._set_epoch_lengths(int(kwargs["epoch"]))
            first_step = self.trainer.state.global_step
            steps, updates = self._epoch_steps(kwargs["steps_in_epoch"],
                                               kwargs["num_update_steps_per_epoch"])
            before = current()
            join = self.enter_epoch(int(kwargs["epoch"]), kwargs["model"])
            try:
                result = original(**{**kwargs, "steps_in_epoch": steps,
                                     "num_update_steps_per_epoch": updates})
            except BaseException as error:
                if self.join is join:
                    self.leave(error)
                raise
            finally:
                _local.session = before
            if self.join is join:  # no on_epoch_end (a subclass's own _run_epoch)
                self.leave()
            self._go_on_after_an_empty_resumed_pass(int(kwargs["epoch"]), first_step)
            return result
        return run_epoch

    def _epoch_steps(self, steps: int, updates: int) -> tuple[int, int]:
        """This epoch's batches and optimizer steps on this rank: its own number of
        windows, the last one padded to the longest rank's (``get_batch_samples``);
        ``steps``, ``updates`` where the loaders have no length."""
        if self.global_len is not None and self.local_len is not None:
            local = self.local_len
            gas = self.trainer.args.gradient_accumulation_steps
            updates = max(local // gas + int(local % gas > 0), 1)
            steps = min(updates * gas, self.global_len) if local else 0
        return steps, updates

    def enter_epoch(self, epoch: int, model: Any) -> Join:
        """Enter epoch ``epoch``'s Join of ``model`` (the DDP model, the DeepSpeed
        engine or the FSDP model); the session's collectives are routed from here."""
        self.window, self.epoch, self.phantom = 0, epoch, False
        # The DDP model, or the DeepSpeed engine (joinkit.adapters.deepspeed: a
        # joined rank replays its step; the sync's main hook then steps the
        # Trainer's scheduler as the loop does).
        self.channel = self.epoch_channel
        try:
            join = Join([*self._epoch_models(model), self.channel, self.sync],
                        **self._epoch_join_kwargs())
            join.__enter__()
        except BaseException:
            self.channel = self.world_channel
            raise
        self.join = join
        if self.fsdp:
            self.hooks = self._agreement_hooks(model)
        _local.session = self
        return join

    def _go_on_after_an_empty_resumed_pass(self, epoch: int, first_step: int) -> None:
        """A stream checkpoint saved at its pass's last step resumes into an empty pass.

        The Trainer stops training after an epoch without a batch on this rank;
        when the resumed pass was empty on every rank (the streams had ended at
        the checkpoint's step; the state sync gave every rank the last joiner's
        flags), the next pass is still to train.
        """
        if self.resumed_pass != epoch:
            return
        self.resumed_pass = None
        if self.trainer.state.global_step == first_step:
            self.trainer.control.should_training_stop = False

    def _epoch_models(self, model: Any) -> list[Any]:
        """What the epoch's Join takes for the model: DDP as it is; for a DeepSpeed
        engine its joinable on the Trainer's windows (module doc, *DeepSpeed*); for
        FSDP the model and the Trainer's optimizer (``_fsdp``)."""
        if self.fsdp:
            return _fsdp.epoch_joinables(self.trainer, model)
        if not self.deepspeed:
            return [model]
        from joinkit.adapters.deepspeed import DeepSpeedJoinable

        return [DeepSpeedJoinable(model, boundaries=self._window_end,
                                  after_step=self._engine_stepped)]

    def _window_end(self, micro_step: int) -> bool:
        """Whether the epoch's micro-step ``micro_step`` ends a window, on every rank:
        every ``gradient_accumulation_steps``, and at the longest rank's last batch
        (the ranks' windows are padded alike, ``get_batch_samples``)."""
        done = micro_step + 1
        gas = self.trainer.args.gradient_accumulation_steps
        return done % gas == 0 or done == self.global_len

    def _engine_stepped(self, window_end: bool) -> None:
        """After a joined rank's replay of the engine's micro-step: the Trainer's LR
        scheduler steps after each optimizer step, as ``_run_epoch`` steps it."""
        self.replayed_window_end = window_end  # for the sync hook's checkpoint agreement
        trainer = self.trainer
        if not window_end or trainer.accelerator.optimizer_step_was_skipped:
            return
        if type(trainer.lr_scheduler).__name__ not in ("ReduceLROnPlateau", "GreedyLR"):
            trainer.lr_scheduler.step()

    def _fsdp_stepped(self) -> None:
        """After a joined rank's shadow step (FSDP): the sync hook's agreement."""
        self.replayed_window_end = True

    def _epoch_join_kwargs(self) -> dict[str, Any]:
        if self.fsdp:  # the same replay input; the Trainer's step after a synced round
            return {**self._one_token(),
                    "shadow_step": _fsdp.shadow_step(self.trainer, self._fsdp_stepped),
                    **self.join_kwargs}
        if not self.deepspeed:
            return self.join_kwargs
        return {**self._one_token(), **self.join_kwargs}

    def _one_token(self) -> dict[str, Any]:
        # A joined rank replays the engine's step on this input: one token and no
        # labels, whose logits (times zero) give every parameter a zero gradient. The
        # empty batch joinkit's replay would build otherwise does not go through a
        # Hugging Face model's attention (a view of 0 elements), and a rank without
        # data has no batch of its own.
        token = torch.zeros((1, 1), dtype=torch.long, device=self.trainer.args.device)
        return {"shadow_input": ((), {"input_ids": token})}

    def leave(self, error: BaseException | None = None) -> None:
        """Leave the epoch's Join: shadow until every rank finished it, then sync."""
        join, self.join = self.join, None
        _local.session = None
        self.phantom = self.owed = self.replayed_window_end = False
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if join is None:
            return
        try:
            if error is None:
                join.__exit__(None, None, None)
            else:
                join.__exit__(type(error), error, error.__traceback__)
        finally:
            self.channel = self.world_channel

    def _t_get_batch_samples(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def get_batch_samples(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            if self.join is None:
                return original(epoch_iterator, num_batches, device)
            gas = self.trainer.args.gradient_accumulation_steps
            target = gas
            if self.global_len is not None and self.window >= self.global_updates - 1:
                target = self.global_len - (self.global_updates - 1) * gas
            self.window += 1
            batches, items = original(epoch_iterator, target, device)
            if batches and len(batches) < target:
                batches = list(batches) + [_Phantom(batches[-1])
                                           for _ in range(target - len(batches))]
            return batches, items
        return get_batch_samples

    def _t_get_num_items_in_batch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def get_num_items_in_batch(batch_samples: Any, device: Any) -> Any:
            if self.predicting:
                # An evaluation batch's loss is its own token mean, as in one process:
                # the count is this batch's, times the world size the loss multiplies by.
                self.local_count = True
                try:
                    return original(batch_samples, device)
                finally:
                    self.local_count = False
            items = original(batch_samples, device)
            if self.join is not None and items is not None:
                self.window_ranks = len(self.channel.last_active) or self.world
            return items
        return get_num_items_in_batch

    def _t_training_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            if self.join is None:
                return original(model, inputs, num_items_in_batch)
            self.phantom = isinstance(inputs, _Phantom)
            loss = original(model, inputs, num_items_in_batch)
            if self.phantom:
                return torch.zeros_like(loss)
            if num_items_in_batch is not None and self.trainer.args.average_tokens_across_devices:
                # The loss carries the world size for DDP's divisor; report the
                # share of the ranks that trained (module doc, *Collectives*).
                loss = loss * (self.window_ranks / self.world)
            return loss
        return training_step

    def _t_floating_point_ops(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def floating_point_ops(inputs: Any) -> Any:
            return 0 if isinstance(inputs, _Phantom) else original(inputs)
        return floating_point_ops

    def _t_track_num_input_tokens(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def track_num_input_tokens(inputs: Any) -> Any:
            before, self.phantom = self.phantom, isinstance(inputs, _Phantom) or self.phantom
            try:
                return original(inputs)
            finally:
                self.phantom = before
        return track_num_input_tokens

    def _a_no_sync(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def no_sync(model: Any) -> Any:
            if self.join is not None and not self.fsdp:  # FSDP's windows stay (_fsdp)
                return contextlib.nullcontext()
            return original(model)
        return no_sync

    def _a_backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def backward(loss: Any, **kwargs: Any) -> Any:
            if self.join is None:
                return original(loss, **kwargs)
            if self.phantom:
                if not bool(torch.isfinite(loss.detach()).all()):
                    raise FloatingPointError(
                        "joinkit.adapters.transformers: the loss of a rank's last batch is not "
                        "finite, so its empty micro-batch (that batch with the loss times "
                        "zero) would not give a zero gradient")
                loss = loss * 0.0
            if self.trainer.args.gradient_accumulation_steps == 1 or self.deepspeed or self.fsdp:
                # (A DeepSpeed engine accumulates itself: every rank's micro-steps are
                # the same window's, _window_end; FSDP keeps its own no_sync windows.)
                return original(loss, **kwargs)
            # Every backward syncs during a Join: set the accumulated gradient
            # aside (DDP all-reduces a parameter's whole .grad) and add it back.
            with gradients_set_aside(self.trainer.model_wrapped.parameters()):
                return original(loss, **kwargs)
        return backward

    # -- checkpoints -------------------------------------------------------------------

    def _t_save_checkpoint(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def save_checkpoint(model: Any, trial: Any) -> Any:
            if self.join is None:
                return self._position_saved(original(model, trial), trial)
            if self.owed:  # DeepSpeed, FSDP: the joined ranks save their parts with us
                self.owed = False
                self.agree(SAVE, self._checkpoint_folder(trial))
            active = self.channel.active_ranks()
            if 0 in active or self.rank != min(active):
                return self._position_saved(original(model, trial), trial)
            trainer = self.trainer
            args = trainer.args
            trainer.args = _writer_args(args)
            # save_pretrained writes the model files on torch rank 0 only.
            inner = trainer.accelerator.unwrap_model(trainer.model)
            rank_rule = _private.has_save_rank_rule(inner)
            if rank_rule:
                inner.should_save_on_this_rank = _writes
            try:
                with self._model_files_by_rank_0(args):
                    return self._position_saved(original(model, trial), trial)
            finally:
                trainer.args = args
                if rank_rule:
                    del inner.should_save_on_this_rank
        return save_checkpoint

    def _checkpoint_folder(self, trial: Any) -> str:
        """The folder ``_save_checkpoint`` writes at this step."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        trainer = self.trainer
        return os.path.join(trainer._get_output_dir(trial=trial),
                            f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")

    # -- collective checkpoints and evaluations in the middle of an epoch -------------

    def _t_maybe_log_save_evaluate(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def maybe_log_save_evaluate(*args: Any, **kwargs: Any) -> Any:
            if not ((self.deepspeed or self.fsdp) and self.join is not None):
                return original(*args, **kwargs)
            self.after_step()  # (on_step_end did, unless a subclass's loop skipped it)
            try:
                result = original(*args, **kwargs)
            finally:
                self.step_tail = False
            if self.owed:  # no save at this step (_t_save_checkpoint)
                self.owed = False
                self.agree(END)
            return result
        return maybe_log_save_evaluate

    def after_step(self) -> None:
        """After an optimizer step of a Join (DeepSpeed, FSDP; first thing in the
        callbacks' ``on_step_end``, so a forward a later callback runs is announced
        too): the joined ranks wait for the agreement on what follows (:meth:`agree`)."""
        if self.join is not None and (self.deepspeed or self.fsdp):
            self.owed = self.step_tail = True

    def _agreement_hooks(self, model: Any) -> list[Any]:
        """FSDP: an evaluation forward after an optimizer step (eval_strategy="steps")
        is a shadow round of the Join (the model's joinable shadows every forward);
        before it the active ranks announce it (:data:`FORWARD`), after it they owe
        the next agreement. Prepended after the Join's own hooks, so they run first."""
        def before(module: Any, args: Any) -> None:
            if self.step_tail and self.owed:
                self.owed = False
                self.agree(FORWARD)

        def after(module: Any, args: Any, output: Any) -> None:
            if self.step_tail:
                self.owed = True
                self.forward_without_batch()

        return [model.register_forward_pre_hook(before, prepend=True),
                model.register_forward_hook(after)]

    def forward_without_batch(self) -> None:
        """An evaluation forward's round of the Join takes no training batch: the
        training sampler (one batch a round) does not count it."""
        if self.train_sampler is not None:
            self.train_sampler.skip_rounds(1)

    def agree(self, code: int, folder: str | None = None) -> tuple[int, str | None]:
        """What follows this optimizer step (or evaluation forward) of a Join.

        A DeepSpeed checkpoint (and ZeRO-3's gathered model) and an FSDP one (its
        sharded or gathered state dicts) are collectives of every rank, and so is an
        FSDP forward. So after every optimizer step of a Join the active ranks tell
        the joined ones what comes next, in ``_maybe_log_save_evaluate``: an
        evaluation forward (:data:`FORWARD`, FSDP: the joined ranks shadow it as a
        round of the Join and agree again after it), a checkpoint in ``folder``
        (:data:`SAVE`: the joined ranks save their part, :meth:`save_as_joined`), or
        nothing (:data:`END`). A joined rank calls it with :data:`END` in the state
        sync's main hook, after its replay of that step or forward. One MAX
        all-reduce of the code on the Join's group (the engine's for DeepSpeed), and
        a gather of the folder after a save.

        Returns:
            The active ranks' code, and the folder of a save.
        """
        if self.deepspeed:
            engine = self.trainer.model_wrapped
            group, device = _deepspeed_group(engine), engine.device
        else:
            group, device = None, self.trainer.args.device
        flag = torch.tensor([code], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        agreed = int(flag.item())
        if agreed != SAVE:
            return agreed, None
        folders: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(folders, folder, group=group)
        return agreed, str(next(f for f in folders if f is not None))

    def save_as_joined(self, folder: str) -> None:
        """A joined rank's part of a DeepSpeed checkpoint: the Trainer's own calls.

        ``save_model`` (ZeRO-3's gather of the model, whose files rank 0 writes when
        it holds the gathered weights), ``_save_optimizer_and_scheduler`` (the
        engine's ``save_checkpoint``: this rank's partition) and its RNG state; the
        Trainer's files are the writer's (an active rank's).
        """
        trainer = self.trainer
        args = trainer.args
        try:
            trainer.args = _writer_args(args, self.rank == 0 and _gathers_model(self))
            trainer.save_model(folder, _internal_call=True)
            trainer.args = _writer_args(args, False)
            if not args.save_only_model:
                trainer._save_optimizer_and_scheduler(folder)
                trainer._save_rng_state(folder)
        finally:
            trainer.args = args

    @contextlib.contextmanager
    def _model_files_by_rank_0(self, args: Any) -> Iterator[None]:
        """While rank 0 has joined, its ``save_model`` writes ZeRO-3's gathered model.

        ``_zero3_consolidated_16bit_state_dict`` gives the weights to torch rank 0
        alone: the writer gathers with it but writes no model files (``args``, whose
        ``should_save`` is false here).
        """
        trainer = self.trainer
        if not _gathers_model(self):
            yield
            return
        save_model = trainer.save_model

        def gathering_only(*call_args: Any, **kwargs: Any) -> Any:
            writer, trainer.args = trainer.args, args
            try:
                return save_model(*call_args, **kwargs)
            finally:
                trainer.args = writer

        trainer.save_model = gathering_only
        try:
            yield
        finally:
            del trainer.save_model

    # -- evaluation --------------------------------------------------------------------

    def _t_prediction_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def prediction_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            self.phantom = isinstance(inputs, _Phantom)
            self.partial_rows = self._partial_rows(inputs)
            before, self.predicting = self.predicting, True
            try:
                return original(model, inputs, *args, **kwargs)
            finally:
                self.predicting = before
        return prediction_step

    def _t_evaluation_loop(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def evaluation_loop(dataloader: Any, *args: Any, **kwargs: Any) -> Any:
            phantom, self.phantom = self.phantom, False
            try:
                with self._current():
                    if self.join is None and not isinstance(dataloader, _PaddedEval):
                        # Each rank's own stream: uneven, so inside a Join of the channel.
                        with Join([self.channel], **self.join_kwargs):
                            return original(dataloader, *args, **kwargs)
                    return original(dataloader, *args, **kwargs)
            finally:
                self.phantom = phantom
                self.partial_rows = None
        return evaluation_loop

    def _partial_rows(self, inputs: Any) -> int | None:
        """The rows of an evaluation batch smaller than the Trainer's, else ``None``.

        ``evaluation_loop`` gathers a batch's loss repeated ``eval_batch_size``
        times and leaves it to ``gather_for_metrics`` to drop what a partial
        batch does not have (Accelerate drops it from the last batch): the
        session's ``gather_for_metrics`` keeps the first ``rows`` of each tensor
        of such a batch, so each sample's loss counts once.
        """
        if isinstance(inputs, _Phantom):
            return None
        from transformers import trainer_pt_utils

        rows = trainer_pt_utils.find_batch_size(inputs)  # type: ignore[no-untyped-call]
        if rows is None or rows >= self.trainer.args.eval_batch_size:
            return None
        return int(rows)

    # -- the routed collectives ----------------------------------------------------------

    def _t_nested_gather(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def nested_gather(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            # The Trainer's own loss gather (before transformers 5.2).
            if not self._routing() or tensors is None:
                return original(tensors, *args, **kwargs)
            return self.gather(tensors)
        return nested_gather

    def _routing(self) -> bool:
        return current() is self

    def gather(self, data: Any) -> Any:
        """Concatenate along dim 0 the active ranks' tensors (nested), as ``accelerate.gather``."""
        def one(tensor: torch.Tensor) -> torch.Tensor:
            tensor = tensor.detach()
            if tensor.ndim == 0:
                tensor = tensor.reshape(1)
            if self.local_count:
                return tensor.expand(self.world, *tensor.shape[1:])
            if self.phantom:
                tensor = tensor[:0]
            return torch.cat(self.channel.all_gather(tensor), dim=0)
        return _apply(one, data)

    def gather_objects(self, data: Any) -> list[Any]:
        """The active ranks' lists of objects, flattened, as ``accelerate.gather_object``."""
        mine = [] if self.phantom else data
        parts = self.channel.all_gather_object(mine)
        return [item for part in parts for item in part]

    def _a_gather(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def gather(tensor: Any) -> Any:
            return self.gather(tensor) if self._routing() else original(tensor)
        return gather

    def _a_gather_for_metrics(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def gather_for_metrics(input_data: Any, use_gather_object: bool = False) -> Any:
            if not self._routing():
                return original(input_data, use_gather_object=use_gather_object)
            if use_gather_object or not _all_tensors(input_data):
                return self.gather_objects(input_data)
            rows = self.partial_rows
            if rows is not None:  # a partial evaluation batch (_partial_rows)
                input_data = _apply(lambda t: t[:rows] if t.ndim else t, input_data)
            return self.gather(input_data)
        return gather_for_metrics

    def _a_reduce(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def reduce(tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
            if not self._routing() or reduction == "none":
                return original(tensor, reduction, scale)

            def one(t: torch.Tensor) -> torch.Tensor:
                rows = torch.cat(self.channel.all_gather(t.detach()[None][:0] if self.phantom
                                                         else t.detach()[None]), dim=0)
                if reduction == "sum":
                    return rows.sum(dim=0) * scale
                if reduction == "mean":
                    return rows.mean(dim=0) * scale
                if reduction == "max":
                    return rows.max(dim=0).values * scale
                raise ValueError(f"unknown reduction {reduction!r}: sum, mean, max or none")
            return _apply(one, tensor)
        return reduce

    def _a_pad_across_processes(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0,
                                 pad_first: bool = False) -> Any:
            if not self._routing():
                return original(tensor, dim, pad_index, pad_first)

            def one(t: torch.Tensor) -> torch.Tensor:
                if dim >= t.ndim or dim < -t.ndim:
                    return t
                sizes = self.channel.all_gather(torch.tensor([t.shape[dim]], dtype=torch.int64))
                largest = int(max(int(s[0]) for s in sizes))
                if largest == t.shape[dim]:
                    return t
                shape = list(t.shape)
                shape[dim] = largest
                out = t.new_zeros(shape) + pad_index
                index = [slice(None)] * t.ndim
                index[dim] = (slice(largest - t.shape[dim], largest) if pad_first
                              else slice(0, t.shape[dim]))
                out[tuple(index)] = t
                return out
            return _apply(one, tensor)
        return pad_across_processes

    def _a_wait_for_everyone(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wait_for_everyone() -> None:
            if self._routing():
                self.channel.barrier()
            else:
                original()
        return wait_for_everyone


# -- the state sync: the post hook of each epoch's Join ----------------------------------

#: Trainer attributes (the Trainer's and TRL's) that are the same on every rank
#: outside a Join: the last joiner's go to every rank.
_BOOKKEEPING = ("_total_loss_scalar", "_globalstep_last_logged", "_total_train_tokens")
_STATE = ("epoch", "global_step", "num_input_tokens_seen", "total_flos", "log_history",
          "best_metric", "best_global_step", "best_model_checkpoint")
_CONTROL = ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate",
            "should_log")


class _TrainerSync(Joinable):
    """Its post hook gives every rank one last joiner's training state (module doc)."""

    join_follows_group = True

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session

    def __repr__(self) -> str:
        return "TrainerStateSync"

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _SyncHook(self.session)

    @property
    def join_device(self) -> Any:
        join = self._join_config.join
        return None if join is None else join.device

    @property
    def join_process_group(self) -> Any:
        join = self._join_config.join
        return None if join is None else join.process_group


class _SyncHook(JoinHook):
    def __init__(self, session: Session) -> None:
        self.session = session
        # Its main hook agrees on the Join's group only after a replayed window end
        # (DeepSpeed, FSDP); with DDP it never does, so DDP's gradient all-reduces
        # may carry the heartbeat (Join.heartbeat == "round").
        self.main_hook_is_local = not (session.deepspeed or session.fsdp)

    def main_hook(self) -> None:
        session = self.session
        if not session.replayed_window_end:
            return
        # After the replay of a window's end (DeepSpeed: the engine's optimizer step,
        # then the Trainer's scheduler step, Session._engine_stepped; FSDP: the
        # Trainer's step, _fsdp.shadow_step) or of an evaluation forward the active
        # ranks announced, as they agree in _maybe_log_save_evaluate (Session.agree).
        code, folder = session.agree(END)
        session.replayed_window_end = code == FORWARD  # agree again after that round
        if code == FORWARD:
            session.forward_without_batch()
        if folder is not None:
            session.save_as_joined(folder)

    def post_hook(self, is_last_joiner: bool) -> None:
        session = self.session
        trainer = session.trainer
        channel = session.channel
        ranks = channel.all_gather_object((is_last_joiner, trainer.state.global_step))
        source = [last for last, _ in ranks].index(True)
        # Ranks that took the same optimizer steps (no rank joined before the last
        # step: even data) stepped the same optimizer on the same all-reduced
        # gradients, so their optimizer states are equal already: not sent (an
        # AdamW state is twice the model, pickled, sent and loaded once per epoch).
        stepped_alike = len({steps for _, steps in ranks}) == 1
        payload = None
        if session.rank == source:
            payload = {
                # A DeepSpeed or FSDP optimizer's state is this rank's partition or
                # shards, which every rank stepped itself (the replay): not sent.
                "optimizer": (None if session.deepspeed or session.fsdp or stepped_alike
                              else trainer.optimizer.state_dict()),
                "scheduler": trainer.lr_scheduler.state_dict(),
                "state": {name: getattr(trainer.state, name) for name in _STATE},
                "control": {name: getattr(trainer.control, name) for name in _CONTROL},
                "trainer": {name: getattr(trainer, name) for name in _BOOKKEEPING
                            if hasattr(trainer, name)},
            }
        payload = channel.broadcast_object(payload, source)
        if session.rank == source:
            return
        seen = len(trainer.state.log_history)
        if payload["optimizer"] is not None:
            trainer.optimizer.load_state_dict(payload["optimizer"])
        trainer.lr_scheduler.load_state_dict(payload["scheduler"])
        for name, value in payload["state"].items():
            setattr(trainer.state, name, value)
        for name, value in payload["control"].items():
            setattr(trainer.control, name, value)
        for name, value in payload["trainer"].items():
            setattr(trainer, name, value)
        _replay_logs(trainer, seen)


def _replay_logs(trainer: Any, seen: int) -> None:
    """Call the ``on_log`` callbacks for the log entries this rank missed while joined."""
    state = trainer.state
    missed = state.log_history[seen:]
    if not missed:
        return
    step = state.global_step
    try:
        for entry in missed:
            state.global_step = int(entry.get("step", step))
            logs = {k: v for k, v in entry.items() if k != "step"}
            trainer.control = trainer.callback_handler.on_log(trainer.args, state,
                                                              trainer.control, logs)
    finally:
        state.global_step = step


# -- the callback ------------------------------------------------------------------------

_CALLBACK: type | None = None


def _callback_class() -> type:
    """The session's ``TrainerCallback`` (made once transformers is imported)."""
    global _CALLBACK
    if _CALLBACK is None:
        from transformers import TrainerCallback

        class JoinkitCallback(TrainerCallback):
            """Leaves each epoch's Join first thing at ``on_epoch_end`` (and enters it at
            ``on_epoch_begin`` in the loop of transformers 5.0 to 5.2)."""

            def __init__(self, session: Session) -> None:
                self.session = session

            def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.session.phantom = False

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                session = self.session
                session.phantom = False
                session.after_step()
                if session.join is not None and session.global_len:
                    # Every rank's epoch fraction is the longest rank's.
                    gas = args.gradient_accumulation_steps
                    done = min(session.window * gas, session.global_len)
                    # A resumed epoch counts on from the batches done before it.
                    full = session.full_lengths[1] or session.global_len
                    state.epoch = session.epoch + min(session.epoch_offset + done, full) / full

            def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                session = self.session
                # The loop's first epoch (its own count: module doc, *Two loops*).
                session.next_epoch = state.global_step // max(session.global_updates, 1)

            def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                session = self.session
                if session.inline:  # (_run_epoch enters it otherwise)
                    session.enter_epoch(session.next_epoch, session.trainer.model_wrapped)

            def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.session.leave()
                self.session.next_epoch += 1

        _CALLBACK = JoinkitCallback
    return _CALLBACK


# -- process-wide dispatchers in transformers.trainer -------------------------------------

_installed = False


def _install_dispatchers() -> None:
    global _installed
    if _installed:
        return
    module: Any = importlib.import_module("transformers.trainer")

    nested_gather = getattr(module, "nested_gather", None)  # (before 5.2: Trainer's own)
    broadcast_scalars = module.distributed_broadcast_scalars

    def dispatch_nested_gather(tensors: Any, parallel_mode: Any, name: Any = None) -> Any:
        session = current()
        if session is None or tensors is None:
            assert nested_gather is not None
            return nested_gather(tensors, parallel_mode, name)
        return session.gather(tensors)

    def dispatch_broadcast_scalars(scalars: Any, num_total_examples: Any = None,
                                   device: Any = None) -> Any:
        session = current()
        if session is None:
            return broadcast_scalars(scalars, num_total_examples, device=device)
        gathered = session.gather(torch.tensor(scalars, device=device))
        return gathered if num_total_examples is None else gathered[:num_total_examples]

    if nested_gather is not None:
        module.nested_gather = dispatch_nested_gather
    module.distributed_broadcast_scalars = dispatch_broadcast_scalars
    module.dist = _DistProxy(module.dist)
    _installed = True


class _DistProxy:
    """``torch.distributed`` for ``transformers.trainer``, whose barrier a session answers."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)

    def barrier(self, *args: Any, **kwargs: Any) -> Any:
        session = current()
        if session is None:
            return self._target.barrier(*args, **kwargs)
        session.channel.barrier()
        return None


# -- small helpers ------------------------------------------------------------------------


def _wrap(obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    setattr(obj, name, make(getattr(obj, name)))


def _apply(function: Callable[[torch.Tensor], torch.Tensor], data: Any) -> Any:
    """``function`` on every tensor of a nested list/tuple/dict (accelerate's rule)."""
    if isinstance(data, torch.Tensor):
        return function(data)
    kind: Any = type(data)
    if isinstance(data, (list, tuple)):
        return kind(_apply(function, item) for item in data)
    if isinstance(data, Mapping):
        return kind({key: _apply(function, value) for key, value in data.items()})
    raise TypeError(
        f"joinkit's gather takes tensors (nested in lists, tuples and dicts), not "
        f"{type(data).__qualname__}; use gather_for_metrics(..., use_gather_object=True)"
    )


def _all_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return all(_all_tensors(item) for item in data)
    if isinstance(data, Mapping):
        return all(_all_tensors(item) for item in data.values())
    return False


def _loader_params(loader: DataLoader[Any]) -> dict[str, Any]:
    params: dict[str, Any] = {
        "collate_fn": loader.collate_fn,
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "timeout": loader.timeout,
    }
    if loader.num_workers > 0:
        params["persistent_workers"] = loader.persistent_workers
        params["prefetch_factor"] = loader.prefetch_factor
    return params


class _OwnLoader(DataLoader):  # type: ignore[type-arg]
    """A rank's own loader; ``set_epoch`` reaches its sampler and its dataset.

    ``reported_length`` (set by the session for the epoch loop of transformers 5.0 to
    5.2, which reads an epoch's length from the loader): its length, if set.
    """

    reported_length: Callable[[], int] | None = None

    def __len__(self) -> int:
        if self.reported_length is not None:
            return self.reported_length()
        return super().__len__()

    def set_epoch(self, epoch: int) -> None:
        for target in (self.sampler, getattr(self.batch_sampler, "sampler", None),
                       self.dataset):
            set_epoch = getattr(target, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)


class _Sized:
    """A stand-in loader of ``length`` batches over ``loader``'s dataset (training values)."""

    def __init__(self, length: int, loader: Any) -> None:
        self._length = length
        self.dataset = loader.dataset

    def __len__(self) -> int:
        return self._length


class _BatchShard:
    """The Trainer's sequential batches ``b`` with ``b % count == index`` (a batch sampler)."""

    def __init__(self, samples: int, batch_size: int, index: int, count: int,
                 drop_last: bool) -> None:
        self.samples = samples
        self.batch_size = batch_size
        self.index = index
        self.count = count
        full, rest = divmod(samples, batch_size)
        self.batches = full + int(rest > 0 and not drop_last)
        self.steps = math.ceil(self.batches / count) if self.batches else 0

    def __iter__(self) -> Iterator[list[int]]:
        for batch in range(self.index, self.batches, self.count):
            start = batch * self.batch_size
            yield list(range(start, min(start + self.batch_size, self.samples)))

    def __len__(self) -> int:
        return len(range(self.index, self.batches, self.count))


class _PaddedEval:
    """An evaluation loader padded with empty batches to the ranks' common number of steps."""

    def __init__(self, inner: DataLoader[Any], batches: _BatchShard) -> None:
        self.inner = inner
        self.dataset = inner.dataset
        self.batch_size = batches.batch_size
        self.sampler = inner.sampler
        self._steps = batches.steps
        self._batches = batches

    def __len__(self) -> int:
        return self._steps

    def __iter__(self) -> Iterator[Any]:
        last = None
        count = 0
        for batch in self.inner:
            last = batch
            count += 1
            yield batch
        if count < self._steps:
            if last is None:  # no batch of its own: any batch will do, it adds no rows
                first = _BatchShard(self._batches.samples, self._batches.batch_size, 0, 1,
                                    False)
                last = self.inner.collate_fn([self.dataset[i] for i in next(iter(first))])
            for _ in range(self._steps - count):
                yield _Phantom(last)


def _version() -> str:
    import transformers

    return str(transformers.__version__)


def _loads_universal(session: Session) -> bool:
    """The DeepSpeed config loads universal checkpoints (any world size)."""
    plugin = session.trainer.accelerator.state.deepspeed_plugin
    config = dict(getattr(plugin, "deepspeed_config", None) or {})
    return bool(dict(config.get("checkpoint") or {}).get("load_universal", False))


def _mid_epoch_refusal(session: Session) -> str:
    if session.saved is None:
        why = (f"has no {_resume.FILE}, joinkit's record of what every rank's data consumed "
               "(the checkpoints written under uneven_inputs have it)")
    else:
        why = ("its data is not of this run's kind (a map-style training set's position, "
               "from its ShardSampler, or per-rank IterableDataset streams', in steps)")
    return (
        f"joinkit.adapters.transformers: the checkpoint {session.resume_from} is in the "
        f"middle of an epoch, and {why}. Resume from a checkpoint saved at an epoch's end, "
        "or set ignore_data_skip=True (the epoch's data starts over)"
    )


def _deepspeed_group(engine: Any) -> Any:
    from joinkit.adapters.deepspeed import collectives_group

    return collectives_group(engine)


def _gathers_model(session: Session) -> bool:
    """The model files come from a state dict gathered on torch rank 0 alone: ZeRO-3's
    (``stage3_gather_16bit...``), FSDP's full state dict (Accelerate's
    ``get_state_dict``: FSDP1's ``rank0_only``, FSDP2's ``cpu_offload``)."""
    if session.fsdp:
        plugin = session.trainer.accelerator.state.fsdp_plugin
        return "FULL_STATE_DICT" in str(plugin.state_dict_type)
    if not session.deepspeed:
        return False
    engine = session.trainer.model_wrapped
    return bool(engine.zero_optimization_stage() == 3
                and engine.zero_gather_16bit_weights_on_model_save())


def _writes(is_main_process: bool) -> bool:
    """The checkpoint writer's ``PreTrainedModel.should_save_on_this_rank``."""
    return is_main_process


def _writer_args(args: Any, writes: bool = True) -> Any:
    """A copy of ``args`` whose ``should_save`` is ``writes`` (true: the checkpoint
    writer's)."""
    base = type(args)
    writer = copy.copy(args)

    def reduce_ex(self: Any, protocol: Any) -> Any:
        # Pickled (torch.save of the training arguments) as the original class.
        reconstructor = getattr(copyreg, "_reconstructor")  # noqa: B009 - private in typeshed
        return (reconstructor, (base, object, None), dict(self.__dict__))

    writer.__class__ = type(f"Writer{base.__name__}", (base,), {
        "should_save": property(lambda self: writes),
        "__reduce_ex__": reduce_ex,
        "__module__": base.__module__,
    })
    return writer
