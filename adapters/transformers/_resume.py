"""Resuming the Trainer in the middle of an epoch: what joinkit adds to a checkpoint.

Theory of operation
-------------------
The Trainer resumes by skipping, on every rank, the batches of the epoch it
had trained (``steps_trained_in_current_epoch``), counted from
``global_step`` and the epoch's number of steps. Under ``uneven_inputs`` the
ranks' batches differ, and after a change of world size the epoch's steps do
too, so the Trainer's count is wrong. What every rank consumed is known
exactly, though: the training set's ``ShardSampler`` counts it from the
epoch's Join (``ShardSampler.state_dict``: the positions of the epoch's order
not yet consumed, the same on every rank, loadable on any world size).

*Saving.* The rank that writes the Trainer's checkpoint files (``should_save``:
rank 0, or while rank 0 has joined the lowest active rank) also writes
:data:`FILE` into the checkpoint folder: the world size, ``global_step``, the
epoch, the optimizer steps taken in it, whether that epoch had ended (a save
after its Join), and in the middle of an epoch the sampler's state
(:func:`write`).

*Resuming* (``train(resume_from_checkpoint=...)``, on any number of ranks):
:func:`read` gives a :class:`Saved`; the session loads the sampler's state,
so the resumed epoch divides exactly the samples not yet consumed over the
new ranks, and the Trainer starts at that epoch with nothing to skip.
:func:`plan` says which epoch that is and, on another world size, the
``max_steps`` and number of epochs the Trainer should count with: the steps
done, the resumed epoch's (from the ranks' new batch counts), and the new
world's steps per epoch for the epochs after it. On the same world size the
Trainer's own values are kept (they are the same).

*Streams.* With each rank's own ``IterableDataset`` an epoch is one pass over
every rank's stream, and after ``k`` steps of a pass rank ``r`` has consumed
``min(k * gradient_accumulation_steps, its batches)``: the Trainer's own skip
of ``k * gradient_accumulation_steps`` batches in pass ``epoch`` is exact, on
the same world size (on another, the streams are other ones: refused).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import attrs

__all__ = ["FILE", "Saved", "Plan", "read", "write", "plan", "stream_start",
           "training_values"]

#: The file joinkit adds to a Trainer checkpoint folder.
FILE = "joinkit_trainer.json"
FORMAT = "joinkit.transformers.Trainer"
VERSION = 1


@attrs.frozen(kw_only=True)
class Saved:
    """What a checkpoint written under ``uneven_inputs`` says of the data (module doc).

    Attributes:
        world: the number of ranks that wrote it.
        global_step: the Trainer's ``global_step`` at the save.
        epoch: the epoch the save was made in.
        steps: the optimizer steps taken in that epoch by this run.
        epoch_done: the save came after that epoch's end.
        sampler: the training set's ``ShardSampler.state_dict()`` in the middle
            of an epoch (a map-style training set), else ``None``.
    """

    world: int
    global_step: int
    epoch: int
    steps: int
    epoch_done: bool
    sampler: dict[str, Any] | None


@attrs.frozen(kw_only=True)
class Plan:
    """Where a resumed run starts (module doc).

    Attributes:
        epoch: the epoch the run starts in.
        mid_epoch: it starts inside that epoch, on the samples the sampler left.
    """

    epoch: int
    mid_epoch: bool


def write(folder: str, *, world: int, global_step: int, epoch: int, steps: int,
          epoch_done: bool, sampler: dict[str, Any] | None) -> None:
    """Write :data:`FILE` into the checkpoint ``folder``."""
    record = {"format": FORMAT, "version": VERSION, "world": world,
              "global_step": global_step, "epoch": epoch, "steps": steps,
              "epoch_done": epoch_done, "sampler": sampler}
    with open(os.path.join(folder, FILE), "w", encoding="utf-8") as out:
        json.dump(record, out)


def read(checkpoint: str) -> Saved | None:
    """The :class:`Saved` of a checkpoint folder, or ``None`` where joinkit wrote none.

    Raises:
        ValueError: the file is not joinkit's, or of a newer format.
    """
    path = os.path.join(checkpoint, FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as source:
        record = json.load(source)
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{path} is not a joinkit Trainer state ({FORMAT!r} expected)")
    if record.get("version") != VERSION:
        raise ValueError(
            f"{path} is of version {record.get('version')!r}; this joinkit reads version "
            f"{VERSION}: resume with the joinkit release that wrote it")
    try:
        return Saved(world=int(record["world"]), global_step=int(record["global_step"]),
                     epoch=int(record["epoch"]), steps=int(record["steps"]),
                     epoch_done=bool(record["epoch_done"]), sampler=record["sampler"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path} is not a whole joinkit Trainer state: {error!r}") from error


def plan(saved: Saved) -> Plan:
    """Where the run resumed from ``saved`` starts."""
    sampler = saved.sampler
    if saved.epoch_done or sampler is None or not sampler["remaining"]:
        return Plan(epoch=saved.epoch + 1, mid_epoch=False)
    return Plan(epoch=saved.epoch, mid_epoch=True)


def stream_start(saved: Saved, *, world: int, gas: int) -> tuple[int, int]:
    """The Trainer's ``(epochs_trained, steps_trained_in_current_epoch)`` for per-rank
    streams (module doc).

    Raises:
        ValueError: another world size than the checkpoint's.
    """
    if world != saved.world:
        raise ValueError(
            f"joinkit.adapters.transformers: resuming on {world} ranks a run of per-rank "
            f"IterableDataset streams saved on {saved.world}: each rank's stream is its own, "
            "and what the new ranks' streams hold of the old ones is not known. Resume on "
            f"{saved.world} ranks, or set ignore_data_skip=True (the streams start over)")
    if saved.epoch_done:
        return saved.epoch + 1, 0
    return saved.epoch, saved.steps * gas


def training_values(values: tuple[Any, ...], *, saved: Saved, start: Plan, world: int,
                    resumed_updates: int, max_steps: int,
                    num_train_epochs: float) -> tuple[Any, ...]:
    """``set_initial_training_values``'s values for a run resumed from ``saved``.

    Args:
        values: the Trainer's values for this world (full epochs).
        saved: the checkpoint's record.
        start: :func:`plan` of it.
        world: this run's number of ranks.
        resumed_updates: the optimizer steps of the resumed epoch on this world.
        max_steps: ``TrainingArguments.max_steps`` (``<= 0``: count in epochs).
        num_train_epochs: ``TrainingArguments.num_train_epochs``.

    Raises:
        ValueError: a world-size change with a fractional ``num_train_epochs``.
    """
    if world == saved.world:
        return values  # the Trainer's own count is the same (module doc)
    per_epoch = int(values[1])
    done = saved.global_step + (resumed_updates if start.mid_epoch else 0)
    after = start.epoch + int(start.mid_epoch)  # the first full epoch still to run
    if max_steps > 0:
        epochs = after + math.ceil(max(0, max_steps - done) / per_epoch)
        return (max(epochs, start.epoch + 1), *values[1:6], max_steps)
    if num_train_epochs != int(num_train_epochs):
        raise ValueError(
            f"joinkit.adapters.transformers: resuming on {world} ranks a run saved on "
            f"{saved.world} with num_train_epochs={num_train_epochs}: the last, partial "
            "epoch is counted in steps of the world that trains it, which the two worlds do "
            "not share. Resume on the same number of ranks, or give max_steps")
    steps = done + (int(num_train_epochs) - after) * per_epoch
    return (values[0], *values[1:6], steps)
