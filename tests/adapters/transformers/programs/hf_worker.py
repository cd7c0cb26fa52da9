"""The Hugging Face Trainer and TRL's SFTTrainer under ``uneven_inputs``, many cells per launch.

Run by ``test_transformers.py`` as ``torchrun --nproc-per-node W
hf_worker.py OUT CELL...`` or ``accelerate launch --cpu --num_processes W
hf_worker.py OUT CELL...``: one process per rank imports transformers once
and runs every cell in turn, each with a fresh tiny model (float64, built from a
config in code) and fresh data; a tokenizer is built in code too (no downloads).

Each rank of each cell writes ``OUT/CELL/rankR.pt``: the cell's result (final
parameters, ``log_history``, evaluation metrics, errors) and *what it trained
on*: every real micro-batch it fed ``training_step`` with the global step it
belonged to (recorded by the Trainer subclasses below; the empty micro-batches
that pad a rank's last window are not recorded). ``hf_reference.py``
checks the recorded data (every sample once per epoch) and trains a float64
single-process reference on it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WIDTH = 8  # tokens per training sequence (map-style cells)
VOCAB = 24


def tiny_model(kind: str) -> Any:
    """A tiny causal LM in float64, the same on every rank (seeded)."""
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=16, n_layer=2,
                                         n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=2, num_attention_heads=2,
                                          num_key_value_heads=2, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(config)
    return model.double()


def tokenizer() -> Any:
    """A word-level tokenizer over the letters a-t, built in code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", "<bos>"] + [chr(ord("a") + i) for i in range(VOCAB - 4)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", bos_token="<bos>")


def sequences(count: int, seed: int, width: int = WIDTH) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(4, VOCAB, (count, width), generator=generator).tolist()
    return [{"input_ids": row, "labels": row} for row in rows]


def texts(count: int, seed: int) -> list[dict[str, str]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        length = int(torch.randint(2, 7, (1,), generator=generator))
        letters = torch.randint(0, VOCAB - 4, (length,), generator=generator).tolist()
        out.append({"text": " ".join(chr(ord("a") + i) for i in letters)})
    return out


def rows_dataset(rows: list[dict[str, Any]]) -> Any:
    """A ``datasets.Dataset`` of token rows (also of none)."""
    from datasets import Dataset, Features, Sequence, Value

    ids = [row["input_ids"] for row in rows]
    features = Features({"input_ids": Sequence(Value("int64")),
                         "labels": Sequence(Value("int64"))})
    return Dataset.from_dict({"input_ids": ids, "labels": ids}, features=features)


def stream(count: int, seed: int) -> Any:
    """A rank's own stream of token rows (``IterableDataset.from_generator``; maybe empty)."""
    yield from sequences(count, seed)


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {key: torch.tensor([row[key] for row in rows]) for key in ("input_ids", "labels")}


class Recording:
    """Mixed into a Trainer class: records every real micro-batch and evaluation batch."""

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        if type(inputs).__name__ != "_Phantom":
            self.recorded.append((int(self.state.global_step),  # type: ignore[attr-defined]
                                  {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor)
                                   else v for k, v in inputs.items()}))
            # The epoch the batch belongs to (state.epoch: its integer part).
            getattr(self, "epochs", []).append(int(self.state.epoch + 1e-9))  # type: ignore[attr-defined]
            self.items.append(None if num_items_in_batch is None  # type: ignore[attr-defined]
                              else float(num_items_in_batch))
        return super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]


def trainer_class(base: type) -> type:
    return type(f"Recording{base.__name__}", (Recording, base), {})


def optimizer_name() -> str:
    """AdamW on 2 ranks; SGD on 3, where gloo's float64 all-reduce differs from a
    single process's sum by about 1e-8 (plain DDP too), which Adam's normalization
    would blow up on gradients near its eps."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return "adamw_torch_fused" if world % 2 == 0 else "sgd"


def args(out: Path, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    settings: dict[str, Any] = {"optim": optimizer_name(),
        "output_dir": str(out), "use_cpu": True, "report_to": [], "disable_tqdm": True,
        "logging_steps": 1, "save_strategy": "no", "seed": 0, "learning_rate": 5e-2,
        "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2,
        "num_train_epochs": 2, "dataloader_num_workers": 0, "remove_unused_columns": False,
        "ddp_broadcast_buffers": False,
    }
    settings.update(overrides)
    return TrainingArguments(**settings)


def metrics(prediction: Any) -> dict[str, float]:
    """Token accuracy and counts over every evaluation sample (predictions are logits)."""
    import numpy as np

    logits, labels = prediction.predictions, prediction.label_ids
    guess = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    mask = target != -100
    return {"rows": float(labels.shape[0]), "tokens": float(mask.sum()),
            "correct": float(((guess == target) & mask).sum()),
            "label_sum": float(np.where(labels == -100, 0, labels).sum())}


def meta(trainer: Any) -> dict[str, Any]:
    """What the reference needs to know of the run."""
    optimizer = trainer.optimizer.optimizer
    engine = trainer.model_wrapped
    if getattr(trainer, "is_deepspeed_enabled", False):  # the client torch optimizer
        optimizer = engine.basic_optimizer
    return {"optimizer": type(optimizer).__name__,
            "defaults": {k: v for k, v in optimizer.defaults.items()
                         if isinstance(v, (int, float, bool, tuple, list, type(None)))},
            "max_steps": trainer.state.max_steps, "world": dist.get_world_size(),
            "gas": trainer.args.gradient_accumulation_steps,
            "average_tokens": trainer.args.average_tokens_across_devices,
            "max_grad_norm": trainer.args.max_grad_norm,
            "eval_batch": trainer.args.per_device_eval_batch_size,
            "weight_decay": trainer.args.weight_decay,
            "label_count": label_count(trainer),
            "scheduler": str(trainer.args.lr_scheduler_type),
            # TRL's SFTConfig: "chunked_nll" (its default in 1.8 to 1.14) patches the model's
            # forward with a float32 chunked cross-entropy, which the reference then uses.
            "loss_type": getattr(trainer.args, "loss_type", None),
            "backward_divisor": backward_divisor(trainer),
            # The Trainer logs the gradient norm without clipping too (_get_grad_norm, 5.3
            # and later); before, only where it clips (max_grad_norm > 0).
            "norm_unclipped": hasattr(trainer, "_get_grad_norm")}


def backward_divisor(trainer: Any) -> int:
    """What ``Accelerator.backward`` divides each micro-batch's loss by (not DeepSpeed's:
    the Trainer turns it off there): the Trainer's ``gradient_accumulation_steps`` in the
    releases that give it to Accelerate (5.3 among them: the loss normalized by the window's
    tokens is divided again), 1 in those that give Accelerate 1."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        return 1
    return int(trainer.accelerator.gradient_accumulation_steps)


def label_count(trainer: Any) -> str:
    """How this Trainer counts a window's label tokens (``_get_num_items_in_batch``), for
    ``hf_reference.tokens``: from transformers 5.10, ``"shifted"`` (``labels[..., 1:]``,
    where the model's loss shifts them: ``_loss_shifts_labels``) or ``"unshifted"``, a
    collator's ``shift_labels`` as given; before, ``"labels"``: every label, and
    ``shift_labels`` not read."""
    if not hasattr(trainer, "_loss_shifts_labels"):
        return "labels"
    return "shifted" if trainer._loss_shifts_labels else "unshifted"


def params(model: Any) -> dict[str, torch.Tensor]:
    inner = getattr(model, "module", model)
    return {name: p.detach().cpu().clone() for name, p in inner.named_parameters()}


# -- cells -------------------------------------------------------------------------------


def map_cell(ctx: dict[str, Any], *, samples: int, gas: int = 1, eval_steps: int | None = None,
             model: str = "gpt2", epochs: int = 2, max_steps: int = -1,
             average_tokens: bool = True, save_steps: int | None = None,
             eval_size: int = 7, eval_batch: int = 2) -> dict[str, Any]:
    """A map-style dataset (the same on every rank); joinkit shards it exactly."""
    from transformers import Trainer

    from joinkit.adapters.transformers import uneven_inputs

    train = rows_dataset(sequences(samples, seed=1))
    evaluation = rows_dataset(sequences(eval_size, seed=2))
    extra: dict[str, Any] = {"per_device_eval_batch_size": eval_batch}
    if eval_steps is not None:
        extra.update(eval_strategy="steps", eval_steps=eval_steps)
    if save_steps is not None:
        extra.update(save_strategy="steps", save_steps=save_steps)
    trainer = trainer_class(Trainer)(
        model=tiny_model(model),
        args=args(ctx["dir"], gradient_accumulation_steps=gas, num_train_epochs=epochs,
                  max_steps=max_steps, average_tokens_across_devices=average_tokens, **extra),
        train_dataset=train, eval_dataset=evaluation, data_collator=collate,
        compute_metrics=metrics)
    trainer.recorded = []
    trainer.items = []
    uneven_inputs(trainer)
    output = trainer.train()
    final = trainer.evaluate()
    return {"recorded": trainer.recorded, "items": trainer.items, "params": params(trainer.model),
            "log_history": trainer.state.log_history, "final_eval": final,
            "global_step": output.global_step, "train_loss": output.training_loss,
            "checkpoints": sorted(p.name for p in Path(ctx["dir"]).glob("checkpoint-*")),
            "eval_size": eval_size, "meta": meta(trainer)}


def stop_after(step: int) -> Any:
    """A callback that stops training after ``step`` (an interrupted run)."""
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step >= step:
                control.should_training_stop = True

    return StopAfter()


def resume_cell(ctx: dict[str, Any], *, samples: int, save_steps: int, gas: int = 1,
                stop: int | None = None, source: str | None = None) -> dict[str, Any]:
    """A run stopped after ``stop`` steps (a checkpoint every ``save_steps``), or one that
    resumes from ``source`` (``ROOT/launch/cell/run/checkpoint-N``), maybe on another
    number of ranks. SGD with momentum on every world size (the same optimizer in both
    runs), no evaluation."""
    from transformers import Trainer

    from joinkit.adapters.transformers import uneven_inputs

    trainer = trainer_class(Trainer)(
        model=tiny_model("gpt2"),
        args=args(ctx["dir"], gradient_accumulation_steps=gas, save_strategy="steps",
                  save_steps=save_steps, optim="sgd", optim_args="momentum=0.9"),
        train_dataset=rows_dataset(sequences(samples, seed=1)), data_collator=collate,
        callbacks=[] if stop is None else [stop_after(stop)])
    trainer.recorded = []
    trainer.items = []
    trainer.epochs = []
    uneven_inputs(trainer)
    output = trainer.train(resume_from_checkpoint=None if source is None
                           else str(Path(ctx["root"]) / source))
    return {"recorded": trainer.recorded, "epochs": trainer.epochs, "items": trainer.items,
            "params": params(trainer.model), "log_history": trainer.state.log_history,
            "global_step": output.global_step,
            "checkpoints": sorted(p.name for p in Path(ctx["dir"]).glob("checkpoint-*")),
            "meta": meta(trainer)}


def refusal(trainer: Any) -> str | None:
    """``uneven_inputs(trainer)``: the error it raised (type and text), if any."""
    from joinkit.adapters.transformers import uneven_inputs

    try:
        uneven_inputs(trainer)
    except Exception as error:  # noqa: BLE001 - recorded for the test
        return f"{type(error).__name__}: {error}"
    return None


def group_after() -> list[Any]:
    """Every rank's rank, gathered: the group still works (nothing was left unmatched)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [dist.get_rank()])
    return gathered


def stream_resume_refused(ctx: dict[str, Any]) -> dict[str, Any]:
    """Per-rank streams saved on 2 ranks, resumed on this world (3): refused on every
    rank alike when train() starts; the group works after."""
    try:
        stream_cell(ctx, rows=[4, 11, 3][: ctx["world"]], max_steps=9, save_steps=3,
                    source="t2/stream_resume_a/run/checkpoint-3")
    except Exception as error:  # noqa: BLE001 - recorded for the test
        message: str | None = f"{type(error).__name__}: {error}"
    else:
        message = None
    gathered = group_after()
    return {"messages": {"stream_other_world": message}, "after": gathered}


def stream_cell(ctx: dict[str, Any], *, rows: list[int], max_steps: int, gas: int = 1,
                save_steps: int | None = None, model: str = "llama", stop: int | None = None,
                source: str | None = None) -> dict[str, Any]:
    """Each rank's own IterableDataset (as split_dataset_by_node gives), uneven lengths;
    stopped after ``stop`` steps, or resumed from ``source`` (as ``resume_cell``)."""
    from datasets import IterableDataset
    from transformers import Trainer

    from joinkit.adapters.transformers import uneven_inputs

    rank = dist.get_rank()
    own = IterableDataset.from_generator(stream, gen_kwargs={"count": rows[rank],
                                                             "seed": 10 + rank})
    extra: dict[str, Any] = {}
    if save_steps is not None:
        extra.update(save_strategy="steps", save_steps=save_steps)
    trainer = trainer_class(Trainer)(
        model=tiny_model(model),
        args=args(ctx["dir"], gradient_accumulation_steps=gas, max_steps=max_steps, **extra),
        train_dataset=own, data_collator=collate,
        callbacks=[] if stop is None else [stop_after(stop)])
    trainer.recorded = []
    trainer.items = []
    uneven_inputs(trainer)
    output = trainer.train(resume_from_checkpoint=None if source is None
                           else str(Path(ctx["root"]) / source))
    return {"recorded": trainer.recorded, "items": trainer.items, "params": params(trainer.model),
            "log_history": trainer.state.log_history, "global_step": output.global_step,
            "checkpoints": sorted(p.name for p in Path(ctx["dir"]).glob("checkpoint-*")),
            "checkpoint_files": sorted(str(p.relative_to(ctx["dir"]))
                                       for p in Path(ctx["dir"]).glob("checkpoint-*/*")),
            "meta": meta(trainer)}


def sft_cell(ctx: dict[str, Any], *, counts: list[int], max_steps: int, gas: int = 1,
             **settings: Any) -> dict[str, Any]:
    """TRL's SFTTrainer, packing each rank's own text stream (different amounts of text)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from joinkit.adapters.transformers import uneven_inputs

    rank = dist.get_rank()
    data = Dataset.from_list(texts(counts[rank], seed=20 + rank)).to_iterable_dataset()
    config = SFTConfig(output_dir=str(ctx["dir"]), use_cpu=True, report_to=[], disable_tqdm=True,
                       optim=optimizer_name(),
                       logging_steps=1, save_strategy="no", seed=0, learning_rate=5e-2,
                       per_device_train_batch_size=2, max_steps=max_steps,
                       gradient_accumulation_steps=gas, dataloader_num_workers=0,
                       packing=True, max_length=12, ddp_broadcast_buffers=False,
                       bf16=False,  # SFTConfig's default bf16 autocast: float64 math here
                       **settings)
    trainer = trainer_class(SFTTrainer)(model=tiny_model("llama"), args=config,
                                        train_dataset=data, processing_class=tokenizer())
    trainer.recorded = []
    trainer.items = []
    uneven_inputs(trainer)
    output = trainer.train()
    return {"recorded": trainer.recorded, "items": trainer.items, "params": params(trainer.model),
            "log_history": trainer.state.log_history, "global_step": output.global_step,
            "meta": meta(trainer)}


# -- DeepSpeed cells (their own launch: DeepSpeed is imported only there) -----------------


def import_deepspeed() -> Any:
    """DeepSpeed on CPU processes (gloo), without its shared-memory op's JIT build.

    As ``tests/adapters/deepspeed/programs/deepspeed_runner.py``: DeepSpeed's CPU
    accelerator would compile a
    shared-memory all-reduce (minutes, behind a lock file a killed build leaves
    behind); marking the op incompatible makes it use torch.distributed's.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    _zero3_converts_float64_on_every_cpu()
    return deepspeed


def _zero3_converts_float64_on_every_cpu() -> None:
    """The same ZeRO-3 conversion of a float64 model on every CPU (a test-only override).

    A model not built under ``zero.Init`` (these cells' float64 models: ``zero.Init``
    builds in float32 at most) is converted by the engine with ``zero.Init(module=...,
    dtype=<its first parameter's dtype>)``, and DeepSpeed 0.19.8 picks that Init's dtype
    with ``dtype or torch.float16 if accelerator.is_fp16_supported() else torch.bfloat16``.
    By operator precedence, on a CPU whose oneDNN has float16 (avx512_fp16, AMX-FP16) it
    keeps float64, which its own check then refuses ("Invalid data type torch.float64");
    on any other CPU it takes bfloat16, which converting an existing module reads only to
    keep a model's ``_keep_in_fp32_modules_strict`` buffers in float32 (these models have
    none). The cells never use float16, so DeepSpeed's CPU accelerator says it has none:
    every CPU takes the second path, the float64 parameters are partitioned as they are.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: False


def deepspeed_trainer_class(base: type) -> type:
    """``base`` whose Accelerator runs DeepSpeed on this CPU machine (a test-only override).

    Accelerate 1.15 runs DeepSpeed on GPU-like devices only: with ``use_cpu=True`` it
    ignores the Trainer's DeepSpeed plugin (``MULTI_CPU``). So, as the Accelerate
    DeepSpeed cells of ``tests/adapters/deepspeed/programs/deepspeed_runner.py`` do, the
    state is set to what a GPU
    machine gets, ``DistributedType.DEEPSPEED`` with the plugin selected, right after the
    Trainer built its Accelerator; the rest is the Trainer's and Accelerate's own.
    """
    def create_accelerator_and_postprocess(self: Any) -> None:
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        base.create_accelerator_and_postprocess(self)
        plugin = self.args.deepspeed_plugin
        state = self.accelerator.state
        state.distributed_type = DistributedType.DEEPSPEED
        PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
        plugin.set_mixed_precision("no")
        plugin.select(_from_accelerator_state=True)
        state.deepspeed_plugins = plugin
        self.is_deepspeed_enabled = True

    return type(f"DeepSpeed{base.__name__}", (base,),
                {"create_accelerator_and_postprocess": create_accelerator_and_postprocess})


def fsdp_trainer_class(base: type) -> type:
    """``base`` whose Accelerator runs FSDP on this CPU machine (a test-only override).

    As :func:`deepspeed_trainer_class`: with ``use_cpu=True`` Accelerate 1.15 ignores
    the Trainer's FSDP plugin (``MULTI_CPU``, the model DDP-wrapped). So right after the
    Trainer built its Accelerator, the state is set to what a GPU machine gets,
    ``DistributedType.FSDP`` with the plugin the Trainer's arguments describe (FSDP1 or
    FSDP2) and the device ``cpu``; Accelerate's own ``prepare`` then wraps the model.
    The cells check that the model really is FSDP1's ``FullyShardedDataParallel`` or an
    FSDP2 ``FSDPModule``.
    """
    def create_accelerator_and_postprocess(self: Any) -> None:
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        base.create_accelerator_and_postprocess(self)
        plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        state = self.accelerator.state
        state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        if self.accelerator.mixed_precision != "no":
            plugin.set_mixed_precision(self.accelerator.mixed_precision)
        state.fsdp_plugin = plugin
        # MULTI_CPU's device is cpu:<local rank>, which FSDP1 refuses as a device_id on
        # a model on "cpu" (a GPU machine's is cuda:<local rank>).
        state.device = PartialState._shared_state["device"] = torch.device("cpu")
        self.is_fsdp_enabled = True

    return type(f"FSDP{base.__name__}", (base,),
                {"create_accelerator_and_postprocess": create_accelerator_and_postprocess})


def wrapped_kind(trainer: Any) -> str:
    """What Accelerate wrapped the model in: FSDP1, FSDP2, DDP or nothing."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    model = trainer.model_wrapped
    if isinstance(model, FullyShardedDataParallel):
        return "FSDP1"
    if isinstance(model, FSDPModule):
        return "FSDP2"
    return type(model).__name__


def fsdp_cell(ctx: dict[str, Any], *, version: int, samples: int | None = None,
              rows: list[int] | None = None, max_steps: int = -1, gas: int = 1,
              clip: float = 1.0, model: str = "gpt2", dtype: Any = torch.float64,
              eval_steps: int | None = None, save_steps: int | None = None,
              source: str | None = None, state_dict_type: str | None = None,
              stop: int | None = None, **overrides: Any) -> dict[str, Any]:
    """The Trainer with ``fsdp="full_shard"`` (FSDP1 or FSDP2) on a map-style dataset
    (evaluation each epoch, or every ``eval_steps``, and after training) or on each
    rank's own stream; checkpoints every ``save_steps``; stopped after ``stop`` steps,
    or resumed from ``source`` (``OUT/cell/run/checkpoint-N`` of this launch, or
    ``ROOT/launch/cell/run/checkpoint-N`` with ``--root``) if given."""
    from datasets import IterableDataset
    from transformers import Trainer

    from joinkit.adapters.transformers import uneven_inputs

    extra: dict[str, Any] = {}
    if eval_steps is not None:
        overrides.update(eval_strategy="steps", eval_steps=eval_steps)
    if save_steps is not None:
        overrides.update(save_strategy="steps", save_steps=save_steps)
    if rows is not None:
        rank = dist.get_rank()
        train = IterableDataset.from_generator(stream, gen_kwargs={"count": rows[rank],
                                                                   "seed": 10 + rank})
        if eval_steps is not None:
            extra.update(eval_dataset=rows_dataset(sequences(7, seed=2)),
                         compute_metrics=metrics)
    else:
        train = rows_dataset(sequences(samples or 0, seed=1))
        extra.update(eval_dataset=rows_dataset(sequences(7, seed=2)), compute_metrics=metrics)
    trainer = fsdp_trainer_class(trainer_class(Trainer))(
        model=tiny_model(model).to(dtype),
        args=args(ctx["dir"], max_steps=max_steps, gradient_accumulation_steps=gas,
                  max_grad_norm=clip, fsdp="full_shard",
                  fsdp_config=fsdp_config(version, state_dict_type),
                  **{"eval_strategy": "no" if rows is not None else "epoch", **overrides}),
        train_dataset=train, data_collator=collate,
        callbacks=[] if stop is None else [stop_after(stop)], **extra)
    trainer.recorded = []
    trainer.items = []
    trainer.epochs = []
    uneven_inputs(trainer)
    output = trainer.train(resume_from_checkpoint=None if source is None
                           else str(Path(ctx["root"] or ctx["out"]) / source))
    final = trainer.evaluate() if "eval_dataset" in extra else None
    return {"recorded": trainer.recorded, "items": trainer.items, "epochs": trainer.epochs,
            "best": trainer.state.best_model_checkpoint,
            "params": fsdp_params(trainer), "log_history": trainer.state.log_history,
            "final_eval": final, "global_step": output.global_step,
            "wrapped": wrapped_kind(trainer), "meta": meta(trainer),
            "state_dict_type": str(trainer.accelerator.state.fsdp_plugin.state_dict_type),
            "param_dtype": str(getattr(trainer.accelerator.state.fsdp_plugin
                                       .mixed_precision_policy, "param_dtype", None)),
            **checkpoints(ctx)}


def fsdp_config(version: int, state_dict_type: str | None = None) -> dict[str, Any]:
    """The Trainer's ``fsdp_config`` for FSDP ``version`` (checkpoints of
    ``state_dict_type``: Accelerate's default, ``FULL_STATE_DICT``, if not given).

    FSDP1's ``sync_module_states`` (the Trainer's default for FSDP1) makes Accelerate's
    plugin look for a GPU in its constructor (it builds a ``param_init_fn`` on the
    current GPU): off on this CPU machine, where every rank builds the same seeded model.
    """
    config: dict[str, Any] = ({"fsdp_version": 1, "sync_module_states": False}
                              if version == 1 else {"fsdp_version": 2})
    if state_dict_type is not None:
        config["state_dict_type"] = state_dict_type
    return config


#: The FSDP checkpoint cells' save_steps, and the steps they resume from, by world.
FSDP_SAVE_STEPS = {2: 2, 3: 3}
FSDP_RESUMED_AT = {"fsdp2": {2: 4, 3: 3}, "fsdp1": {2: 2, 3: 3}}
#: Their optimizer: optimizer_name()'s, but SGD with momentum where that is SGD (torch's
#: set_optimizer_state_dict cannot load the empty state of SGD without momentum:
#: "Expected device to be set", the Trainer alone too).
SGD_MOMENTUM = {"optim": "sgd", "optim_args": "momentum=0.9"}
FSDP_SAVE_OPTIMIZER: dict[int, dict[str, Any]] = {2: {}, 3: SGD_MOMENTUM}


def optimizer_state(optimizer: Any) -> dict[int, dict[str, Any]]:
    """This rank's optimizer state (its shards; FSDP2's DTensors' local ones), by
    parameter index."""
    from torch.distributed.tensor import DTensor

    def local(value: Any) -> Any:
        if isinstance(value, DTensor):
            value = value.to_local()
        return value.detach().clone() if isinstance(value, torch.Tensor) else value

    index = {id(p): i for i, p in enumerate(
        p for group in optimizer.param_groups for p in group["params"])}
    return {index[id(p)]: {k: local(v) for k, v in state.items()}
            for p, state in optimizer.state.items()}


def plain_fsdp_resume(ctx: dict[str, Any], *, version: int, state_dict_type: str,
                      optim: str = "sgd", optim_args: str | None = "momentum=0.9",
                      dtype: Any = torch.float32, joinkit: bool = False) -> dict[str, Any]:
    """The Trainer alone (no joinkit unless ``joinkit``; even data, nobody joins) with
    FSDP ``version``:
    2 steps and a checkpoint of ``state_dict_type``, then a new Trainer resumed from it;
    this rank's optimizer state after the first run and as the resumed one loaded it
    (at ``on_train_begin``, after ``_load_optimizer_and_scheduler``)."""
    from transformers import Trainer, TrainerCallback

    loaded: dict[str, Any] = {}

    class Loaded(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            loaded["state"] = optimizer_state(kwargs["optimizer"].optimizer)

    def run(source: str | None) -> Any:
        trainer = fsdp_trainer_class(Trainer)(
            model=tiny_model("gpt2").to(dtype),
            args=args(ctx["dir"], max_steps=2, save_strategy="steps", save_steps=2,
                      fsdp="full_shard", fsdp_config=fsdp_config(version, state_dict_type),
                      optim=optim, optim_args=optim_args),
            train_dataset=rows_dataset(sequences(4 * ctx["world"], seed=1)),
            data_collator=collate, callbacks=[Loaded()])
        if joinkit:
            from joinkit.adapters.transformers import uneven_inputs

            uneven_inputs(trainer)
        trainer.train(resume_from_checkpoint=source)
        return trainer

    first = run(None)
    saved = optimizer_state(first.optimizer.optimizer)
    run(str(Path(ctx["dir"]) / "checkpoint-2"))
    return {"saved": saved, "loaded": loaded["state"], "wrapped": wrapped_kind(first)}


#: The load_best_model_at_end cells' learning rate.
BEST_LR = 2.0
#: The world-size change cells (by name): FSDP1 float32 (its clip_grad_norm_ refuses
#: float64) with sharded state dicts (torch.distributed.checkpoint), FSDP2 float64 with
#: full ones and with sharded ones.
FSDP_WORLD: dict[str, dict[str, Any]] = {
    "fsdp1": {"version": 1, "dtype": torch.float32, "state_dict_type": "SHARDED_STATE_DICT"},
    "fsdp2": {"version": 2},
    "fsdp2_sharded": {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}}


def fsdp_refusals(ctx: dict[str, Any]) -> dict[str, Any]:
    """What ``uneven_inputs`` refuses under FSDP: on every rank, before any collective."""
    from datasets import IterableDataset
    from transformers import Trainer


    data = rows_dataset(sequences(6, seed=1))
    stream_eval = IterableDataset.from_generator(stream, gen_kwargs={"count": 3, "seed": 5})
    messages = {}
    cases: dict[str, tuple[type, dict[str, Any], Any]] = {
        "stream_eval": (fsdp_trainer_class(Trainer), {"eval_strategy": "epoch"},
                        stream_eval),
        # Without the test's override: Accelerate ignores FSDP under use_cpu=True.
        "ignored": (Trainer, {}, data),
    }
    for name, (kind, overrides, evaluation) in cases.items():
        trainer = kind(model=tiny_model("gpt2"),
                       args=args(ctx["dir"], fsdp="full_shard", fsdp_config=fsdp_config(2),
                                 **overrides),
                       train_dataset=data, eval_dataset=evaluation, data_collator=collate)
        messages[name] = refusal(trainer)
    gathered = group_after()
    return {"messages": messages, "after": gathered}


def fsdp_params(trainer: Any) -> dict[str, torch.Tensor]:
    """The full parameters of the Trainer's FSDP model (a collective: every rank)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    model = trainer.model_wrapped
    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model):
            return {name.replace("_fsdp_wrapped_module.", ""): p.detach().cpu().clone()
                    for name, p in model.named_parameters()}
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in model.named_parameters()}


def ds_config(stage: int, *, settings: dict[str, Any] | None = None,
              **zero: Any) -> dict[str, Any]:
    """A DeepSpeed config whose batch, accumulation and clipping the Trainer fills in
    (``zero``: more of ``zero_optimization``; ``settings``: more of the config)."""
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "zero_optimization": {"stage": stage, **zero}, **(settings or {})}


def ds_facts(trainer: Any) -> dict[str, Any]:
    """What trained: the engine, its ZeRO stage, its offload devices, its optimizers."""
    engine = trainer.model_wrapped
    devices = {}
    for what, offload in (("optimizer", engine.zero_offload_optimizer()),
                          ("param", engine.zero_offload_param())):
        device = getattr(offload, "device", None)
        devices[what] = str(getattr(device, "value", device))
    inner = getattr(engine.optimizer, "optimizer", None)
    return {"engine": type(engine).__name__, "stage": engine.zero_optimization_stage(),
            "offload": devices, "zero_optimizer": type(engine.optimizer).__name__,
            "torch_optimizer": type(inner).__name__,
            "engine_gas": engine.gradient_accumulation_steps(),
            "engine_global_steps": engine.global_steps}


def ds_map_cell(ctx: dict[str, Any], *, stage: int, samples: int, model: str = "gpt2",
                epochs: int = 2, eval_steps: int | None = None, clip: float = 0.05,
                average_tokens: bool = True, gas: int = 1, save: dict[str, Any] | None = None,
                zero: dict[str, Any] | None = None, source: str | None = None,
                **settings: Any) -> dict[str, Any]:
    """A map-style dataset under DeepSpeed ZeRO ``stage``; evaluation each epoch (or
    every ``eval_steps``); checkpoints as ``save`` says (TrainingArguments); resumed
    from ``source`` (``OUT/cell/run/checkpoint-N`` of this launch) if given; ``zero``:
    more of the config's ``zero_optimization``, ``settings``: more of the config."""
    import_deepspeed()
    from transformers import Trainer

    from joinkit.adapters.transformers import uneven_inputs

    trainer = deepspeed_trainer_class(trainer_class(Trainer))(
        model=tiny_model(model),
        args=args(ctx["dir"], num_train_epochs=epochs,
                  eval_strategy="epoch" if eval_steps is None else "steps",
                  eval_steps=eval_steps, gradient_accumulation_steps=gas,
                  average_tokens_across_devices=average_tokens, max_grad_norm=clip,
                  deepspeed=ds_config(stage, settings=settings, **(zero or {})),
                  **(save or {})),
        train_dataset=rows_dataset(sequences(samples, seed=1)),
        eval_dataset=rows_dataset(sequences(7, seed=2)), data_collator=collate,
        compute_metrics=metrics)
    trainer.recorded = []
    trainer.items = []
    uneven_inputs(trainer)
    output = trainer.train(resume_from_checkpoint=None if source is None
                           else str(Path(ctx["out"]) / source))
    final = trainer.evaluate()
    return {"recorded": trainer.recorded, "items": trainer.items,
            "params": ds_params(trainer), "log_history": trainer.state.log_history,
            "final_eval": final, "global_step": output.global_step, **ds_facts(trainer),
            "meta": meta(trainer), **checkpoints(ctx)}


def ds_stream_cell(ctx: dict[str, Any], *, stage: int, rows: list[int], max_steps: int,
                   save_steps: int | None = None, gas: int = 1,
                   zero: dict[str, Any] | None = None, **settings: Any) -> dict[str, Any]:
    """Each rank's own stream under DeepSpeed ZeRO ``stage``; one rank may have none."""
    import_deepspeed()
    from datasets import IterableDataset
    from transformers import Trainer

    from joinkit.adapters.transformers import uneven_inputs

    rank = dist.get_rank()
    own = IterableDataset.from_generator(stream, gen_kwargs={"count": rows[rank],
                                                             "seed": 10 + rank})
    trainer = deepspeed_trainer_class(trainer_class(Trainer))(
        model=tiny_model("llama"),
        args=args(ctx["dir"], max_steps=max_steps, gradient_accumulation_steps=gas,
                  deepspeed=ds_config(stage, settings=settings, **(zero or {})),
                  **({} if save_steps is None else {"save_strategy": "steps",
                                                    "save_steps": save_steps})),
        train_dataset=own, data_collator=collate)
    trainer.recorded = []
    trainer.items = []
    uneven_inputs(trainer)
    output = trainer.train()
    return {"recorded": trainer.recorded, "items": trainer.items,
            "params": ds_params(trainer), "log_history": trainer.state.log_history,
            "global_step": output.global_step, **ds_facts(trainer), "meta": meta(trainer),
            **checkpoints(ctx)}


def checkpoints(ctx: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint folders a cell wrote, their files, and their model files' tensors'
    shapes (a ZeRO-3 gathered model: full ones)."""
    from safetensors import safe_open

    folder = Path(ctx["dir"])
    found = sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    shapes = {}
    for checkpoint in found:
        weights = checkpoint / "model.safetensors"
        if weights.exists():
            with safe_open(str(weights), framework="pt") as model_file:
                shapes[checkpoint.name] = {name: tuple(model_file.get_slice(name).get_shape())
                                           for name in model_file.keys()}  # noqa: SIM118
    return {"checkpoints": [p.name for p in found],
            "checkpoint_files": sorted(str(p.relative_to(folder))
                                       for p in folder.glob("checkpoint-*/**/*")
                                       if p.is_file()),
            "model_shapes": shapes}


def ds_params(trainer: Any) -> dict[str, torch.Tensor]:
    """The full parameters of the Trainer's DeepSpeed engine (ZeRO-3's gathered)."""
    import deepspeed

    engine = trainer.model_wrapped
    module = engine.module
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return params(module)
    return params(module)


OFFLOAD_OPTIMIZER = {"offload_optimizer": {"device": "cpu"}}
OFFLOAD_PARAM = {"offload_param": {"device": "cpu"}}
#: DeepSpeed's optimizer section: with the optimizer offloaded, DeepSpeed builds its
#: ``DeepSpeedCPUAdam`` (AdamW mode), the Trainer fills in the values.
DS_ADAMW = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                        "weight_decay": "auto"}}


def ds_refusals(ctx: dict[str, Any]) -> dict[str, Any]:
    """What ``uneven_inputs`` refuses under DeepSpeed: on every rank, before any collective."""
    import_deepspeed()
    from transformers import Trainer


    data = rows_dataset(sequences(6, seed=1))
    messages = {}
    cases = {
        "nvme": {"deepspeed": ds_config(3, offload_param={"device": "nvme",
                                                          "nvme_path": str(ctx["dir"])})},
        "zero3_eval_steps": {"eval_strategy": "steps", "eval_steps": 2,
                             "deepspeed": ds_config(3)},
    }
    for name, overrides in cases.items():
        trainer = deepspeed_trainer_class(Trainer)(
            model=tiny_model("gpt2"), args=args(ctx["dir"], **overrides), train_dataset=data,
            eval_dataset=data, data_collator=collate)
        messages[name] = refusal(trainer)
    # Resuming on 2 ranks a checkpoint written on 3: DeepSpeed's optimizer state is
    # partitioned over 3 (refused when train() starts, before DeepSpeed is set up).
    trainer = deepspeed_trainer_class(Trainer)(
        model=tiny_model("gpt2"), args=args(ctx["dir"], deepspeed=ds_config(2)),
        train_dataset=data, data_collator=collate)
    checkpoint = Path(ctx["dir"]) / "checkpoint-1"
    if dist.get_rank() == 0:
        checkpoint.mkdir(parents=True, exist_ok=True)
        trainer.state.global_step, trainer.state.train_batch_size = 1, 2
        trainer.state.save_to_json(str(checkpoint / "trainer_state.json"))
        record = {"format": "joinkit.transformers.Trainer", "version": 1, "world": 3,
                  "global_step": 1, "epoch": 0, "steps": 1, "epoch_done": False,
                  "sampler": None}
        (checkpoint / "joinkit_trainer.json").write_text(json.dumps(record))
    messages["resume_other_world"] = refused_resume(trainer, checkpoint)
    gathered = group_after()
    return {"messages": messages, "after": gathered}


def refused_resume(trainer: Any, checkpoint: Path) -> str | None:
    """``train(resume_from_checkpoint=checkpoint)`` under ``uneven_inputs`` on every rank
    (after rank 0 wrote the checkpoint): the error it raised, if any."""
    from joinkit.adapters.transformers import uneven_inputs

    dist.barrier()
    uneven_inputs(trainer)
    try:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    except Exception as error:  # noqa: BLE001 - recorded for the test
        return f"{type(error).__name__}: {error}"
    return None


def refusals(ctx: dict[str, Any]) -> dict[str, Any]:
    """Bad input raises on every rank before any collective, with what to do."""
    from transformers import Trainer, TrainingArguments

    from joinkit.adapters.transformers import _private


    data = rows_dataset(sequences(6, seed=1))
    messages = {}

    def attempt(name: str, trainer: Any) -> None:
        messages[name] = refusal(trainer)

    def make(**overrides: Any) -> Any:
        return Trainer(model=tiny_model("gpt2"), args=args(ctx["dir"], **overrides),
                       train_dataset=data, data_collator=collate)

    busy = make()
    busy.is_in_train = True
    attempt("already_training", busy)
    deep = make()
    deep.args.deepspeed = {"zero_optimization": {"stage": 2}}
    attempt("deepspeed", deep)
    # (transformers 5.0 and 5.1: group_by_length=True)
    grouped = ({"train_sampling_strategy": "group_by_length"}
               if hasattr(TrainingArguments, "train_sampling_strategy")
               else {"group_by_length": True})
    attempt("group_by_length", make(**grouped))
    attempt("split_batches", make(accelerator_config={"split_batches": True}))
    attempt("not_a_trainer", object())
    if _private.loop() == "_inner_training_loop":
        # The epoch loop of transformers 5.0 to 5.2 gathers the token count inline.
        attempt("tokens_seen", make(include_num_input_tokens_seen="all"))
    # Resuming in the middle of an epoch from a checkpoint joinkit did not write (no
    # record of what each rank's data consumed): refused when train() starts.
    trainer = Trainer(model=tiny_model("gpt2"), args=args(ctx["dir"]),
                      train_dataset=rows_dataset(sequences(12, seed=1)), data_collator=collate)
    checkpoint = Path(ctx["dir"]) / "checkpoint-1"
    if dist.get_rank() == 0:
        trainer.save_model(str(checkpoint))
        trainer.state.global_step = 1  # 12 samples: 3 or 2 steps per epoch on 2 or 3 ranks
        trainer.state.train_batch_size = 2
        trainer.state.save_to_json(str(checkpoint / "trainer_state.json"))
    messages["resume_mid_epoch"] = refused_resume(trainer, checkpoint)
    # The group still works: nothing was sent.
    gathered = group_after()
    return {"messages": messages, "after": gathered, "loop": _private.loop()}


CELLS = {
    # 13 samples of batch 2 on 2 ranks: 4 and 3 batches; an evaluation at step 4, after
    # rank 1 joined (rank 0 evaluates alone), and a checkpoint there.
    "map_gas1": lambda ctx: map_cell(ctx, samples=13, eval_steps=4, save_steps=4),
    # Gradient accumulation 2: rank 1's last window is half empty; plain-mean losses.
    "map_gas2": lambda ctx: map_cell(ctx, samples=13, gas=2, eval_steps=3, model="llama"),
    "map_gas2_plain": lambda ctx: map_cell(ctx, samples=11, gas=2, average_tokens=False),
    # max_steps ending in the middle of the second epoch.
    "map_max_steps": lambda ctx: map_cell(ctx, samples=13, max_steps=6, epochs=3),
    # One training sample per rank but the last, which has none; 9 evaluation samples
    # in batches of 4 (the last of 1), evaluated in training by the ranks with data
    # (after each step) and by every rank after it.
    "map_eval": lambda ctx: map_cell(ctx, samples=ctx["world"] - 1, eval_steps=1,
                                     eval_size=9, eval_batch=4),
    # Each rank's own stream; rank 1 has none; a checkpoint after rank 0 joined.
    "stream_zero": lambda ctx: stream_cell(ctx, rows=[6, 0, 14] if ctx["world"] == 3
                                           else [4, 11], max_steps=9, save_steps=5),
    "stream_gas3": lambda ctx: stream_cell(ctx, rows=[7, 12, 3][: ctx["world"]], max_steps=7,
                                           gas=3),
    "sft_packing": lambda ctx: sft_cell(ctx, counts=[5, 14, 9][: ctx["world"]], max_steps=6),
    "refusals": refusals,
    # Resumed in the middle of an epoch, on another number of ranks (and the same): the
    # first runs in the torchrun-2 and accelerate-3 launches, the resumed ones after
    # them (test_transformers.py's second round, ROOT = the first round's folder).
    # 13 samples on 2 ranks, stopped after step 2 of epoch 0 (8 samples consumed).
    "resume23_a": lambda ctx: resume_cell(ctx, samples=13, save_steps=2, stop=2),
    # ... resumed on 3 ranks (5 samples left: one batch each, one of 1 sample) and on 2.
    "resume23_b": lambda ctx: resume_cell(ctx, samples=13, save_steps=2,
                                          source="t2/resume23_a/run/checkpoint-2"),
    "resume22_b": lambda ctx: resume_cell(ctx, samples=13, save_steps=2,
                                          source="t2/resume23_a/run/checkpoint-2"),
    # 13 samples on 3 ranks with accumulation 2 (3, 2 and 2 batches: one window each
    # but rank 0's second, half empty), stopped after step 3, the first of epoch 1:
    # 1 sample left, which 2 ranks resume (rank 1 has none).
    "resume32_a": lambda ctx: resume_cell(ctx, samples=13, save_steps=3, gas=2, stop=3),
    "resume32_b": lambda ctx: resume_cell(ctx, samples=13, save_steps=3, gas=2,
                                          source="a3/resume32_a/run/checkpoint-3"),
    # Each rank's own stream (2 and 6 batches a pass), stopped after step 6 (the first
    # pass's last), with checkpoints at 3 (rank 0 had joined: rank 1 wrote it) and 6.
    "stream_resume_a": lambda ctx: stream_cell(ctx, rows=[4, 11], max_steps=9, save_steps=3,
                                               stop=6),
    # Resumed on 2 ranks from step 3 (rank 0's stream is done, rank 1 skips 3 batches)
    # and from step 6 (the pass was over: the next one starts).
    "stream_resume3_b": lambda ctx: stream_cell(ctx, rows=[4, 11], max_steps=9, save_steps=3,
                                                source="t2/stream_resume_a/run/checkpoint-3"),
    "stream_resume6_b": lambda ctx: stream_cell(ctx, rows=[4, 11], max_steps=9, save_steps=3,
                                                source="t2/stream_resume_a/run/checkpoint-6"),
    "stream_resume_refused": stream_resume_refused,
    # DeepSpeed (launched apart): 13 samples of batch 2 on 2 ranks, 4 and 3 batches.
    # Without clipping here, with clipping that bites in the others.
    # Checkpoints every 2 steps: at steps 2 and 6 in the middle of an epoch, at 4 and 8
    # at an epoch's last step, which rank 0 takes alone (rank 1 has joined: it saves its
    # partition with rank 0). ZeRO-3 gathers the model to save it (rank 0's files).
    "ds_map_s2": lambda ctx: ds_map_cell(ctx, stage=2, samples=13, clip=0.0,
                                         save={"save_strategy": "steps", "save_steps": 2}),
    "ds_map_s3": lambda ctx: ds_map_cell(
        ctx, stage=3, samples=13, model="llama",
        save={"save_strategy": "steps", "save_steps": 2},
        zero={"stage3_gather_16bit_weights_on_model_save": True}),
    # Resumed from those checkpoints: ZeRO-2 from step 4 (saved while rank 1 had
    # joined), ZeRO-3 from step 2 (in the middle of epoch 0).
    "ds_resume_s2": lambda ctx: ds_map_cell(ctx, stage=2, samples=13, clip=0.0,
                                            save={"save_strategy": "steps", "save_steps": 2},
                                            source="ds_map_s2/run/checkpoint-4"),
    "ds_resume_s3": lambda ctx: ds_map_cell(
        ctx, stage=3, samples=13, model="llama",
        save={"save_strategy": "steps", "save_steps": 2},
        zero={"stage3_gather_16bit_weights_on_model_save": True},
        source="ds_map_s3/run/checkpoint-2"),
    # ZeRO-1, plain-mean losses, evaluations at steps 4 and 8, after rank 1 joined
    # (rank 0 evaluates alone). (Stage 0 is not run: its gradient all-reduce refuses
    # the float64 gradients of these models, "unsupported grad type".)
    # save_strategy="best" (of eval_loss): a checkpoint at each evaluation that improves.
    "ds_map_s1": lambda ctx: ds_map_cell(ctx, stage=1, samples=13, eval_steps=4,
                                         save={"save_strategy": "best",
                                               "metric_for_best_model": "eval_loss"},
                                         average_tokens=False),
    # Each rank's own stream, rank 1 with none.
    # Checkpoints every 2 steps with a rank that has no data (joined at once): rank 1
    # (ZeRO-2); rank 0 (ZeRO-3: rank 1 writes the Trainer's files, rank 0 the gathered
    # model's).
    "ds_stream_s2": lambda ctx: ds_stream_cell(ctx, stage=2, rows=[5, 0], max_steps=5,
                                               save_steps=2),
    "ds_stream_s3": lambda ctx: ds_stream_cell(
        ctx, stage=3, rows=[0, 9], max_steps=6, save_steps=2,
        zero={"stage3_gather_16bit_weights_on_model_save": True}),
    # The control: even streams, nobody joins (DeepSpeed's own float32 error).
    "ds_even_s2": lambda ctx: ds_stream_cell(ctx, stage=2, rows=[5, 5], max_steps=5),
    "ds_refusals": ds_refusals,
    # Gradient accumulation under DeepSpeed (the Trainer's windows, padded alike on every
    # rank): rank 1's data ends inside a window (13 samples: 4 and 3 batches).
    "ds_gas2_s1": lambda ctx: ds_map_cell(ctx, stage=1, samples=13, gas=2,
                                          average_tokens=False),
    # Rank 0's stream ends inside its first window, then it replays the second.
    "ds_gas3_s2": lambda ctx: ds_stream_cell(ctx, stage=2, rows=[3, 12], max_steps=2, gas=3),
    # A rank without data replays every window.
    "ds_gas2_s3": lambda ctx: ds_stream_cell(ctx, stage=3, rows=[0, 9], max_steps=3, gas=2),
    # ZeRO-Offload: the optimizer on the CPU (a torch optimizer), a rank without data.
    "ds_offload_s2": lambda ctx: ds_stream_cell(
        ctx, stage=2, rows=[5, 0], max_steps=3, gas=2, zero=OFFLOAD_OPTIMIZER,
        zero_force_ds_cpu_optimizer=False),
    # ZeRO-3 with the optimizer and the parameters on the CPU, evaluation each epoch.
    "ds_offload_s3": lambda ctx: ds_map_cell(
        ctx, stage=3, samples=13, model="llama",
        zero={**OFFLOAD_OPTIMIZER, **OFFLOAD_PARAM}, zero_force_ds_cpu_optimizer=False),
    # DeepSpeed's own CPU Adam (its optimizer section, offload): rank 1 replays a window.
    "ds_cpu_adam_s2": lambda ctx: ds_stream_cell(
        ctx, stage=2, rows=[9, 4], max_steps=2, gas=3, zero=OFFLOAD_OPTIMIZER,
        optimizer=DS_ADAMW),
    # 3 ranks (SGD, optimizer_name).
    "ds3_gas2_s2": lambda ctx: ds_stream_cell(ctx, stage=2, rows=[6, 0, 11], max_steps=3,
                                              gas=2),
    "ds3_gas3_s1": lambda ctx: ds_map_cell(ctx, stage=1, samples=13, gas=3),
    "ds3_gas2_s3": lambda ctx: ds_stream_cell(ctx, stage=3, rows=[3, 9, 5], max_steps=3,
                                              gas=2),
    "ds3_offload_s3": lambda ctx: ds_stream_cell(
        ctx, stage=3, rows=[4, 0, 7], max_steps=4,
        zero={**OFFLOAD_OPTIMIZER, **OFFLOAD_PARAM}, zero_force_ds_cpu_optimizer=False),
    # FSDP2 and FSDP1 (fsdp="full_shard"): 13 samples of batch 2 (4 and 3 batches on 2
    # ranks, 3, 2 and 2 on 3), clipping that bites, evaluation each epoch and after
    # training; gradient accumulation 2 with a half-empty last window; each rank's own
    # stream with a rank that has none. FSDP1's clip_grad_norm_ (the Trainer takes the
    # norm with it every step, clipping or not) computes in float32 and refuses float64
    # gradients: FSDP1 cells train float32 (with SGD, whose float32 error Adam's
    # normalization would grow), with a control where nobody joins.
    "fsdp2_map": lambda ctx: fsdp_cell(ctx, version=2, samples=13, clip=0.05),
    "fsdp2_gas2": lambda ctx: fsdp_cell(ctx, version=2, samples=13, gas=2, model="llama"),
    "fsdp2_stream_zero": lambda ctx: fsdp_cell(ctx, version=2, max_steps=7, model="llama",
                                               rows=[5, 0, 12][: ctx["world"]]),
    "fsdp1_map": lambda ctx: fsdp_cell(ctx, version=1, samples=13, clip=0.05,
                                       dtype=torch.float32, optim="sgd"),
    "fsdp1_gas2_stream_zero": lambda ctx: fsdp_cell(
        ctx, version=1, max_steps=4, gas=2, model="llama", dtype=torch.float32, optim="sgd",
        rows=[0, 13, 7][: ctx["world"]]),
    "fsdp1_even": lambda ctx: fsdp_cell(ctx, version=1, samples=12, clip=0.05,
                                        dtype=torch.float32, optim="sgd"),
    "fsdp_refusals": lambda ctx: fsdp_refusals(ctx),
    # The Trainer alone (no joinkit): a sharded FSDP checkpoint's optimizer state as
    # saved and as a resumed Trainer loads it (SGD with momentum, AdamW).
    "plain_fsdp1_sgd": lambda ctx: plain_fsdp_resume(ctx, version=1,
                                                     state_dict_type="SHARDED_STATE_DICT"),
    "plain_fsdp1_adamw": lambda ctx: plain_fsdp_resume(
        ctx, version=1, state_dict_type="SHARDED_STATE_DICT", optim="adamw_torch",
        optim_args=None),
    "plain_fsdp2_sgd": lambda ctx: plain_fsdp_resume(ctx, version=2,
                                                     state_dict_type="SHARDED_STATE_DICT"),
    # ... and under uneven_inputs, which creates the optimizer's state before the load.
    "joinkit_fsdp1_sgd": lambda ctx: plain_fsdp_resume(
        ctx, version=1, state_dict_type="SHARDED_STATE_DICT", joinkit=True),
    # bf16=True: Accelerate's bf16 autocast and FSDP's bfloat16 parameters and
    # reductions (float32 models), uneven (13 samples) and a control where nobody joins
    # (12), against the float64 reference: a measured bound. SGD: Adam's normalization
    # grows bfloat16's rounding to 0.2 at this learning rate, control or not.
    "fsdp2_bf16": lambda ctx: fsdp_cell(ctx, version=2, samples=13, clip=0.05,
                                        dtype=torch.float32, optim="sgd", bf16=True),
    "fsdp2_bf16_even": lambda ctx: fsdp_cell(ctx, version=2, samples=12, clip=0.05,
                                             dtype=torch.float32, optim="sgd", bf16=True),
    "fsdp1_bf16": lambda ctx: fsdp_cell(ctx, version=1, samples=13, clip=0.05,
                                        dtype=torch.float32, optim="sgd", bf16=True),
    "fsdp1_bf16_even": lambda ctx: fsdp_cell(ctx, version=1, samples=12, clip=0.05,
                                             dtype=torch.float32, optim="sgd", bf16=True),
    # Checkpoints (save_strategy="steps") and evaluations (eval_strategy="steps") in the
    # middle of an epoch: 13 samples (2 ranks: 4 and 3 batches an epoch, a checkpoint
    # every 2 steps, rank 1 joined at steps 4 and 8; 3 ranks: 3, 2 and 2, every 3 steps,
    # ranks 1 and 2 joined at 3 and 6), an evaluation after every step; resumed from
    # the checkpoint of FSDP_RESUMED_AT (FSDP2: a rank had joined; FSDP1 on 2 ranks: in
    # the middle of epoch 0). FSDP2 saves full state dicts (Accelerate's default), FSDP1
    # sharded ones (torch.distributed.checkpoint); SGD with momentum, whose buffers the
    # resumed run must load (the Trainer alone loses them under FSDP1: plain_fsdp1_sgd).
    "fsdp2_save": lambda ctx: fsdp_cell(ctx, version=2, samples=13, clip=0.05, eval_steps=1,
                                        save_steps=FSDP_SAVE_STEPS[ctx["world"]],
                                        **SGD_MOMENTUM),
    "fsdp2_resume": lambda ctx: fsdp_cell(
        ctx, version=2, samples=13, clip=0.05, eval_steps=1,
        save_steps=FSDP_SAVE_STEPS[ctx["world"]], **SGD_MOMENTUM,
        source=f"fsdp2_save/run/checkpoint-{FSDP_RESUMED_AT['fsdp2'][ctx['world']]}"),
    "fsdp1_save": lambda ctx: fsdp_cell(ctx, version=1, samples=13, clip=0.05, eval_steps=1,
                                        save_steps=FSDP_SAVE_STEPS[ctx["world"]],
                                        dtype=torch.float32, **SGD_MOMENTUM,
                                        state_dict_type="SHARDED_STATE_DICT"),
    "fsdp1_resume": lambda ctx: fsdp_cell(
        ctx, version=1, samples=13, clip=0.05, eval_steps=1,
        save_steps=FSDP_SAVE_STEPS[ctx["world"]], dtype=torch.float32, **SGD_MOMENTUM,
        state_dict_type="SHARDED_STATE_DICT",
        source=f"fsdp1_save/run/checkpoint-{FSDP_RESUMED_AT['fsdp1'][ctx['world']]}"),
    # Resumed on another number of ranks: 13 samples, SGD with momentum, stopped after
    # step 3 with a checkpoint there (FSDP_WORLD). On 3 ranks (3, 2 and 2 batches) step
    # 3 is epoch 0's last, which rank 0 takes alone (ranks 1 and 2 are out of data, saving with it),
    # resumed on 2 ranks (test_transformers' second round, ROOT = the first round's
    # folder) from epoch 1; on 2 ranks (4 and 3 batches) it leaves 1 sample of epoch 0,
    # which 3 ranks resume (ranks 1 and 2 have none of it).
    **{f"{name}_world_{part}": (
        lambda ctx, name=name, part=part: fsdp_cell(
            ctx, samples=13, clip=0.05, save_steps=3, **SGD_MOMENTUM, **FSDP_WORLD[name],
            **({"stop": 3} if part == "a" else
               {"source": f"f{5 - ctx['world']}/{name}_world_a/run/checkpoint-3"})))
       for name in FSDP_WORLD for part in ("a", "b")},
    # load_best_model_at_end: an evaluation and a checkpoint every step, the best of
    # eval_loss loaded after training (on every rank: FSDP's load is a collective); a
    # learning rate at which the evaluation loss rises again before the end.
    **{f"fsdp{version}_load_best": (
        lambda ctx, version=version: fsdp_cell(
            ctx, samples=13, clip=0.05, eval_steps=1, save_steps=1,
            load_best_model_at_end=True, metric_for_best_model="eval_loss",
            learning_rate=BEST_LR, **SGD_MOMENTUM, **FSDP_WORLD[f"fsdp{version}"]))
       for version in (1, 2)},
    # save_strategy="best" (of eval_loss): a checkpoint at each evaluation (every step)
    # that improves, decided after the evaluation (SGD with momentum: the evaluation
    # loss improves at steps where a rank had joined).
    "fsdp2_best": lambda ctx: fsdp_cell(ctx, version=2, samples=13, clip=0.05, eval_steps=1,
                                        save_strategy="best",
                                        metric_for_best_model="eval_loss", **SGD_MOMENTUM),
    # A rank without data (one sample on every other rank), joined all along: an
    # evaluation and a sharded checkpoint at every step. (FSDP1's full state dict
    # segfaults on this CPU machine in torch's clone of a gathered parameter, the
    # Trainer alone, without joinkit: its FSDP1 cells save sharded state dicts.)
    "fsdp2_zero_save": lambda ctx: fsdp_cell(ctx, version=2, samples=ctx["world"] - 1,
                                             model="llama", eval_steps=1, save_steps=1,
                                             **FSDP_SAVE_OPTIMIZER[ctx["world"]],
                                             state_dict_type="SHARDED_STATE_DICT"),
    "fsdp1_zero_save": lambda ctx: fsdp_cell(ctx, version=1, samples=ctx["world"] - 1,
                                             model="llama", eval_steps=1, save_steps=1,
                                             dtype=torch.float32, optim="sgd",
                                             state_dict_type="SHARDED_STATE_DICT"),
    # Rank 0 without data (each rank's own stream): the lowest active rank writes the
    # Trainer's files, rank 0 the model gathered on it (a full state dict).
    "fsdp2_stream_save": lambda ctx: fsdp_cell(ctx, version=2, rows=[0, 9, 5][: ctx["world"]],
                                               max_steps=5, model="llama", eval_steps=2,
                                               save_steps=2,
                                               **FSDP_SAVE_OPTIMIZER[ctx["world"]]),
}


def main(argv: list[str]) -> None:
    """``OUT [--root=DIR] CELL...``: ``--root`` is where resumed cells find checkpoints."""
    options = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith("--")}
    out, *names = [a for a in argv if not a.startswith("--")]
    from accelerate import PartialState

    state = PartialState(cpu=True)  # initializes gloo under torchrun and accelerate launch
    rank, world = state.process_index, state.num_processes
    for name in names:
        cell_dir = Path(out) / name
        ctx = {"dir": cell_dir / "run", "world": world, "rank": rank, "out": out,
               "root": options.get("--root", "")}
        if rank == 0:
            shutil.rmtree(cell_dir, ignore_errors=True)
        dist.barrier()
        cell_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            result = CELLS[name](ctx)
            record = {"ok": True, **result}
        except BaseException as error:  # noqa: BLE001 - reported by the test
            record = {"ok": False, "error": "".join(traceback.format_exception(error))}
        record["seconds"] = time.monotonic() - started
        torch.save(record, cell_dir / f"rank{rank}.pt")
        if not record["ok"]:
            print(f"[rank {rank}] cell {name} failed:\n{record['error']}", flush=True)
            os._exit(1)  # the ranks may disagree on where they are: stop the launch
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
