"""Hugging Face ``Trainer`` (and TRL's trainers) with uneven per-rank data, exact, in one line.

Example::

    trainer = SFTTrainer(model=model, args=args, train_dataset=data, ...)
    uneven_inputs(trainer)      # on every rank, before train()
    trainer.train()

After :func:`uneven_inputs`, ``trainer.train()``, ``evaluate()`` and
``predict()`` take ranks with different amounts of data (a map-style dataset's
exact shards, or each rank's own ``IterableDataset`` stream, packed sequences
of different counts, a rank with none) and give what a single process would:
every sample once per epoch, each optimizer step the step of the ranks that
still have data, the logged loss their mean, evaluation over every sample
exactly once. ``_session`` says how; docs/transformers.md what is supported.

Tested with transformers 5.24, accelerate 1.15 and TRL 1.16
(``pip install 'joinkit[transformers]'``); every Trainer internal used is
checked first (``_private``).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["uneven_inputs", "UnsupportedTransformersError"]

from ._private import UnsupportedTransformersError

#: The integration whose engine joinable the Trainer's DeepSpeed path puts in its Joins.
DEEPSPEED_PATH = "joinkit.adapters.deepspeed"


def _imports() -> tuple[Any, Any]:
    try:
        import transformers
        from accelerate.utils import DistributedType  # type: ignore[import-untyped]
    except ModuleNotFoundError as error:
        if error.name is not None and error.name.split(".")[0] not in ("transformers",
                                                                        "accelerate"):
            raise
        raise ModuleNotFoundError(
            "Could not find transformers/accelerate: joinkit.adapters.transformers needs "
            "them. Please run `pip install 'joinkit[transformers]'`",
            name=error.name,
        ) from error
    return transformers, DistributedType


def uneven_inputs(trainer: Any, *, timeout: float | None = None) -> Any:
    """Make ``trainer.train()`` (and its evaluation) exact with uneven data on the ranks.

    Call it on every rank, after building the trainer and before ``train()``.
    Nothing is sent: every check below runs on each rank alone, so a refusal
    raises on every rank before any collective.

    Args:
        trainer: a ``transformers.Trainer`` or a subclass (TRL's ``SFTTrainer``...),
            under DDP (``torchrun``, ``accelerate launch``), CPU or GPU, with a
            DeepSpeed config (ZeRO 1-3, gradient accumulation, offload to the CPU;
            a joined rank replays the engine's micro-steps on the Trainer's
            windows, :data:`DEEPSPEED_PATH`), or with FSDP (FSDP2 or FSDP1: a
            joined rank replays the model's forward and backward and runs the
            Trainer's clipping and step, ``_fsdp``).
        timeout: the Joins' watchdog (``joinkit.Join(timeout=...)``); ``None``
            keeps joinkit's default.

    Returns:
        ``trainer`` (in a world of one process, untouched).

    Raises:
        TypeError: ``trainer`` is not a ``transformers.Trainer``.
        RuntimeError: the trainer is training already; or the launcher started
            several processes and Accelerate sees one; or a DeepSpeed or FSDP config
            that Accelerate does not run (``use_cpu=True``).
        NotImplementedError: DataParallel, tensor, context or sequence
            parallelism; under DeepSpeed offloading to NVMe, ZeRO++, ZeRO-3 mid-epoch
            or stream evaluation; under FSDP stream evaluation, FSDP1's CPU
            offload; a model whose main input is not
            ``input_ids`` (DeepSpeed, FSDP).
        ValueError: a setting this adapter does not handle (the message says
            which, and what to use instead).
        UnsupportedTransformersError: this transformers/Accelerate changed an
            internal the adapter relies on.
        ModuleNotFoundError: transformers or Accelerate is not installed.
    """
    transformers, distributed_type = _imports()
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(
            "uneven_inputs(trainer) takes a transformers.Trainer (or a subclass such as TRL's "
            f"SFTTrainer), not {type(trainer).__qualname__}"
        )
    from . import _private

    _private.check("Trainer")
    _private.check("Accelerator")
    if getattr(trainer, "_joinkit_session", None) is not None:
        return trainer
    if trainer.is_in_train:
        raise RuntimeError(
            "uneven_inputs(trainer) was called while the trainer is training: call it on every "
            "rank before trainer.train()"
        )
    _refuse(trainer, distributed_type)
    accelerator = trainer.accelerator
    launched = _launched()
    if accelerator.num_processes == 1:
        if launched is not None and launched > 1:
            raise RuntimeError(
                f"Accelerate sees one process but the launcher started {launched} "
                f"(WORLD_SIZE={launched}): every process would train alone. On a machine "
                "without GPUs pass TrainingArguments(use_cpu=True) under torchrun, or "
                "`accelerate launch --cpu`"
            )
        return trainer  # nothing to join
    if accelerator.distributed_type not in (distributed_type.MULTI_CPU,
                                            distributed_type.MULTI_GPU,
                                            distributed_type.DEEPSPEED,
                                            distributed_type.FSDP):
        raise NotImplementedError(
            f"uneven_inputs handles DDP (Accelerate's MULTI_CPU and MULTI_GPU), DeepSpeed and "
            f"FSDP, not {accelerator.distributed_type}"
        )
    from ._session import Session

    session = Session(trainer, {} if timeout is None else {"timeout": timeout})
    session.install()
    trainer._joinkit_session = session
    return trainer


def _refuse(trainer: Any, distributed_type: Any) -> None:
    """Raise for a configuration the adapter does not handle (local checks only)."""
    args = trainer.args
    from . import _private

    if _private.loop() == "_inner_training_loop":
        _refuse_in_the_inline_loop(trainer)
    if getattr(trainer, "is_deepspeed_enabled", False):
        _refuse_deepspeed(trainer)
    elif getattr(args, "deepspeed", None):
        raise RuntimeError(
            "uneven_inputs: TrainingArguments(deepspeed=...) is set but the Trainer's "
            "Accelerator does not run DeepSpeed (trainer.is_deepspeed_enabled is False: "
            "with use_cpu=True Accelerate ignores the DeepSpeed config and trains with DDP). "
            "Launch on the accelerators DeepSpeed is to use, or drop the deepspeed setting"
        )
    if getattr(trainer, "is_fsdp_enabled", False):
        _private.check("FSDP")
        _refuse_replayed_input(trainer, "FSDP")
        from . import _fsdp

        _fsdp.refuse(trainer)
        _refuse_stream_evaluation(trainer, "FSDP", "FSDP's forward all-gathers the "
                                                  "parameters")
    elif getattr(args, "fsdp", None):
        raise RuntimeError(
            "uneven_inputs: TrainingArguments(fsdp=...) is set but the Trainer's Accelerator "
            "does not run FSDP (trainer.is_fsdp_enabled is False: with use_cpu=True "
            "Accelerate ignores the FSDP settings and trains with DDP). Launch on the "
            "accelerators FSDP is to use, or drop the fsdp setting"
        )
    if getattr(args, "n_gpu", 1) > 1:
        raise NotImplementedError(
            "uneven_inputs handles one device per process (DDP); this process drives "
            f"{args.n_gpu} GPUs with DataParallel: launch one process per GPU (torchrun)"
        )
    for size in ("get_tp_size", "get_cp_size", "get_sp_size"):
        if getattr(trainer, size)() > 1:
            raise NotImplementedError(
                "uneven_inputs handles data parallelism only (tensor, context and sequence "
                f"parallel sizes of 1); {size[4:6].upper()} size is {getattr(trainer, size)()}"
            )
    if getattr(args, "group_by_length", False) is True:  # (transformers 5.0 and 5.1)
        raise ValueError(
            "uneven_inputs: group_by_length=True is not handled (its sampler shards by "
            "itself); leave it False")
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in ("random", "sequential"):
        raise ValueError(
            f"uneven_inputs: train_sampling_strategy={strategy!r} is not handled (its sampler "
            "shards by itself); use 'random' (the default) or 'sequential'"
        )
    config = args.accelerator_config
    if getattr(config, "split_batches", False):
        raise ValueError(
            "uneven_inputs: accelerator_config split_batches=True splits one batch over the "
            "ranks; each rank reads its own batches here: leave it False"
        )
    if getattr(config, "dispatch_batches", None):
        raise ValueError(
            "uneven_inputs: accelerator_config dispatch_batches=True has rank 0 read every "
            "batch and send them out; each rank reads its own data here: leave it unset"
        )
    if getattr(args, "auto_find_batch_size", False):
        raise ValueError("uneven_inputs: auto_find_batch_size=True is not handled; set it False")
    if args.dataloader_persistent_workers and args.dataloader_num_workers > 0:
        raise ValueError(
            "uneven_inputs: dataloader_persistent_workers=True keeps evaluation loaders built "
            "for the ranks of one evaluation; set it False"
        )
    import torch

    eval_data = trainer.eval_dataset
    datasets = eval_data.values() if isinstance(eval_data, dict) else [eval_data]
    strategy_name = str(getattr(args.eval_strategy, "value", args.eval_strategy))
    if strategy_name == "steps" and any(
            isinstance(d, torch.utils.data.IterableDataset) for d in datasets):
        raise ValueError(
            "uneven_inputs: eval_strategy='steps' with an IterableDataset evaluation set: an "
            "evaluation in the middle of an epoch runs on the ranks still training, and a "
            "joined rank's own stream cannot be read by another. Use a map-style evaluation "
            "set (every rank the same; joinkit splits it), or eval_strategy='epoch'"
        )
    del distributed_type


def _refuse_in_the_inline_loop(trainer: Any) -> None:
    """Raise for what the epoch loop of transformers 5.0 to 5.2 (written out in
    ``_inner_training_loop``, no ``_run_epoch``) cannot give under a Join.

    Raises:
        NotImplementedError: ``include_num_input_tokens_seen`` (the loop gathers each
            micro-batch's token count inline, before ``training_step``: an empty
            micro-batch would count its tokens), FSDP (a joined rank's clipping is the
            Trainer's ``_clip_grad_norm``), DeepSpeed (joinkit has not run its replay
            under this loop).
    """
    import transformers

    args = trainer.args
    found = (f"transformers {transformers.__version__}'s Trainer (its epoch loop is "
             "written out in _inner_training_loop)")
    upgrade = "; transformers 5.3 and later handle it"
    counting = getattr(args, "include_num_input_tokens_seen", "no")
    if counting not in ("no", False, None):
        raise NotImplementedError(
            f"uneven_inputs: include_num_input_tokens_seen={counting!r} with {found}: the "
            "loop gathers each micro-batch's token count itself, before training_step, so "
            "a rank's empty micro-batches (the padding of its last window) would count "
            f"tokens. Set include_num_input_tokens_seen='no'{upgrade}")
    for enabled, what, why in (
            ("is_fsdp_enabled", "FSDP", "a joined rank clips as the Trainer's _clip_grad_norm "
                                        "does, which this release lacks"),):
        if getattr(trainer, enabled, False):
            raise NotImplementedError(
                f"uneven_inputs with {what} and {found}: {why}. Upgrade transformers, or "
                f"train with DDP{upgrade}")


def _refuse_replayed_input(trainer: Any, what: str) -> None:
    """Raise for a model a joined rank cannot replay on one token of ``input_ids``.

    Raises:
        NotImplementedError: the model's main input is not ``input_ids``.
    """
    main_input = getattr(trainer.model, "main_input_name", None)
    if main_input != "input_ids":
        raise NotImplementedError(
            f"uneven_inputs with {what} replays a joined rank's step on one token of "
            f"input_ids, and this model's main input is {main_input!r}: only language models "
            f"that take input_ids are handled under {what}"
        )


def _refuse_deepspeed(trainer: Any) -> None:
    """Raise for a DeepSpeed setting the Join cannot replay exactly (local checks only).

    The engine's own refusals (``joinkit.adapters.deepspeed``) would come at the
    first epoch's Join, after the Trainer's first collectives: the settings
    they read are checked here first, from the configuration alone.
    """
    _refuse_replayed_input(trainer, "DeepSpeed")
    plugin = trainer.accelerator.state.deepspeed_plugin
    config = dict(getattr(plugin, "deepspeed_config", None) or {})
    zero = dict(config.get("zero_optimization") or {})
    stage = int(zero.get("stage", 0))
    for what in ("offload_optimizer", "offload_param"):
        device = str(dict(zero.get(what) or {}).get("device", "none")).lower()
        if device == "nvme":
            raise NotImplementedError(
                f"uneven_inputs does not handle DeepSpeed's zero_optimization.{what} to "
                "'nvme' (ZeRO-Infinity): joinkit's tests have no NVMe device with "
                "DeepSpeed's async I/O op to run a joined rank's replay on. Offload to "
                "'cpu' (ZeRO-Offload, supported) or leave offloading out"
            )
    if (int(zero.get("zero_hpz_partition_size", 1) or 1) > 1
            or zero.get("zero_quantized_weights") or zero.get("zero_quantized_gradients")):
        raise NotImplementedError(
            "uneven_inputs does not handle ZeRO++ (zero_hpz_partition_size, "
            "zero_quantized_weights, zero_quantized_gradients): joinkit has not run it"
        )
    if stage == 3:
        _refuse_gathering_evaluation(trainer, "DeepSpeed ZeRO-3",
                                     "ZeRO-3's forward gathers the parameters",
                                     ", or ZeRO stage 0-2")


def _refuse_gathering_evaluation(trainer: Any, what: str, gathers: str,
                                 instead: str = "") -> None:
    """Raise for evaluation that runs a forward gathering from every rank unevenly
    (ZeRO-3: its evaluation forwards are no rounds of the Join, unlike FSDP's).

    Raises:
        NotImplementedError: ``eval_strategy='steps'`` (the ranks still training
            evaluate) or an ``IterableDataset`` evaluation set (uneven forwards).
    """
    args = trainer.args
    evaluating = str(getattr(args.eval_strategy, "value", args.eval_strategy))
    if evaluating == "steps":
        raise NotImplementedError(
            f"uneven_inputs with {what}: eval_strategy='steps' evaluates in the middle of "
            f"an epoch on the ranks still training, and {gathers} from every rank. Use "
            f"eval_strategy='epoch' (every rank evaluates){instead}"
        )
    _refuse_stream_evaluation(trainer, what, gathers, instead)


def _refuse_stream_evaluation(trainer: Any, what: str, gathers: str,
                              instead: str = "") -> None:
    """Raise for an ``IterableDataset`` evaluation set where a forward gathers.

    Raises:
        NotImplementedError: each rank's own stream runs uneven forwards.
    """
    import torch

    eval_data = trainer.eval_dataset
    datasets = eval_data.values() if isinstance(eval_data, dict) else [eval_data]
    if any(isinstance(d, torch.utils.data.IterableDataset) for d in datasets):
        raise NotImplementedError(
            f"uneven_inputs with {what}: an IterableDataset evaluation set (each rank its "
            f"own stream, uneven) runs different numbers of forwards on the ranks, and "
            f"{gathers} from every rank. Use a map-style evaluation set (joinkit splits it "
            f"evenly){instead}"
        )


def _launched() -> int | None:
    try:
        return int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
