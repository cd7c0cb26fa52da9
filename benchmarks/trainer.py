"""The Hugging Face Trainer (and TRL's SFTTrainer) with ``uneven_inputs`` and without.

    torchrun --standalone --nproc-per-node 2 benchmarks/trainer.py [steps [repeats [which]]]

``which`` is ``trainer`` (default) or ``sft``. Even data on 2 ranks, gloo, CPU;
each variant is its own Trainer, and a repeat is one ``trainer.train()`` of
``steps`` optimizer steps (what a user pays, the epoch's Join entry and exit
included), timed on the slowest rank.

- ``trainer``: a GPT-2 built from a config in code (2 layers, 128 wide, 4
  heads, sequence 64, GPT-2's vocabulary; random token ids, no tokenizer, no
  download), batch 4 per rank, AdamW. Variants: the plain Trainer with
  ``logging_steps=1`` (and the same again: an A/A pair, the run's scatter),
  ``uneven_inputs(trainer)`` with ``logging_steps=1``, and both with the
  default logging (every 500 steps: never in a run).
- ``sft``: TRL's ``SFTTrainer`` with ``packing=True`` (BFD, sequence 64) over
  a tiny text dataset built in code (a word-level tokenizer over 20 letters)
  on a Llama of 2 layers, 128 wide; ``logging_steps=1``.

After the timing, each variant trains once more with its collectives counted
(``_collectives``: every collective started through a torch ProcessGroup, by
method): per step in the steady state (from the end of the first step to the
end of the last), and per ``train()`` call. The difference between a variant
and its plain Trainer is joinkit's own.
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import _bench
import _collectives

SEQUENCE = 64
BATCH = 4


def main() -> None:
    steps = _bench.int_arg(1, 20)
    repeats = _bench.int_arg(2, 7)
    which = _bench.str_arg(3, "trainer")
    if which not in ("trainer", "sft"):
        raise SystemExit(f"trainer.py: which is 'trainer' or 'sft', not {which!r}")
    _collectives.install()  # before any process group (module doc of _collectives)
    import datasets
    import torch
    import torch.distributed as dist
    import transformers

    from joinkit import backends

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    backends.init_torch("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = tempfile.mkdtemp(prefix="joinkit-bench-trainer-")
    slowest = _bench.slowest_rank()

    make = gpt2_trainer if which == "trainer" else sft_trainer
    trainers: list[Any] = []  # in the order of the variants

    def variant(joinkit: bool, logging_steps: int | None = 1) -> Callable[[int], None]:
        trainer = make(folder, steps, world, logging_steps)
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # no log lines
        if joinkit:
            from joinkit.adapters.transformers import uneven_inputs

            uneven_inputs(trainer)
        trainers.append(trainer)
        return lambda n: trainer.train() and None

    if which == "trainer":
        variants = {
            "Trainer, logging_steps=1": variant(False),
            "Trainer, logging_steps=1, again": variant(False),
            "uneven_inputs, logging_steps=1": variant(True),
            "Trainer, default logging": variant(False, None),
            "uneven_inputs, default logging": variant(True, None),
        }
        ratios: list[_bench.Ratio] = [
            ("uneven_inputs, logging_steps=1", "Trainer, logging_steps=1", 1.03),
            ("uneven_inputs, default logging", "Trainer, default logging", 1.03),
            ("Trainer, logging_steps=1, again", "Trainer, logging_steps=1", None),
            ("Trainer, logging_steps=1", "Trainer, default logging", None),
        ]
        bench = "HF Trainer, GPT-2 2x128, seq 64, batch 4, gloo (torchrun)"
    else:
        variants = {
            "SFTTrainer packing": variant(False),
            "SFTTrainer packing, again": variant(False),
            "uneven_inputs, SFTTrainer packing": variant(True),
        }
        ratios = [
            ("uneven_inputs, SFTTrainer packing", "SFTTrainer packing", 1.03),
            ("SFTTrainer packing, again", "SFTTrainer packing", None),
        ]
        bench = "TRL SFTTrainer, packing, Llama 2x128, seq 64, batch 4, gloo (torchrun)"
    times = _bench.timed(variants, steps, repeats, slowest, dist.barrier, warmup=1)
    counted = {name: count(loop, trainer, steps)
               for (name, loop), trainer in zip(variants.items(), trainers, strict=True)}
    info = {"ranks": world, "steps per train()": steps, "repeats": repeats}
    if rank == 0:
        _bench.report(bench, times, ratios, info)
        for name, (step, whole) in counted.items():
            print(f"  collectives, {name}: per step {_collectives.per_step(step, steps - 1)}"
                  f"; per train() {_collectives.per_step(whole, 1)}", flush=True)
        for top, bottom, target in ratios:
            if target is None:
                continue
            own = (_collectives.own(counted[top][0])
                   - _collectives.own(counted[bottom][0])) / (steps - 1)
            _bench.record_value(bench, f"{top}: collectives of joinkit's own per step", own,
                                "per step", 0.0, info)
    dist.barrier()
    dist.destroy_process_group()


def count(loop: Callable[[int], None], trainer: Any, steps: int
          ) -> tuple[Counter[str], Counter[str]]:
    """One more ``train()``: its collectives from the end of step 1 to the end of the
    last step (``steps - 1`` steps), and in the whole call."""
    from transformers import TrainerCallback

    stack = contextlib.ExitStack()
    steady: list[Counter[str]] = []

    class Steps(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 1:
                steady.append(stack.enter_context(_collectives.counting()))
            elif state.global_step == steps:
                stack.close()

    callback = Steps()
    trainer.add_callback(callback)
    try:
        with _collectives.counting() as whole:
            loop(steps)
    finally:
        stack.close()
        trainer.remove_callback(callback)
    return (steady[0] if steady else Counter()), whole


def arguments(kind: Any, folder: str, steps: int, logging_steps: int | None,
              **settings: Any) -> Any:
    if logging_steps is not None:
        settings["logging_steps"] = logging_steps
    return kind(output_dir=folder, use_cpu=True, report_to=[], disable_tqdm=True,
                save_strategy="no", seed=0, max_steps=steps,
                per_device_train_batch_size=BATCH, dataloader_num_workers=0,
                remove_unused_columns=False, **settings)


def gpt2_trainer(folder: str, steps: int, world: int, logging_steps: int | None) -> Any:
    """A Trainer of a small GPT-2 on ``steps`` batches per rank of random token ids."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_positions=SEQUENCE, n_embd=128, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (world * steps * BATCH, SEQUENCE),
                        generator=generator)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = arguments(transformers.TrainingArguments, folder, steps, logging_steps)
    return transformers.Trainer(model=model, args=args, train_dataset=data)


def sft_trainer(folder: str, steps: int, world: int, logging_steps: int | None) -> Any:
    """TRL's SFTTrainer packing a tiny text dataset (BFD) for a small Llama."""
    import torch
    import transformers
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trl import SFTConfig, SFTTrainer

    letters = [chr(ord("a") + i) for i in range(20)]
    words = ["<pad>", "<eos>", "<unk>", "<bos>", *letters]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        bos_token="<bos>")
    generator = torch.Generator().manual_seed(1)
    texts = []
    # About 40 tokens a text: more packed rows than the steps take, on every rank.
    for _ in range(world * steps * BATCH * 2):
        length = int(torch.randint(10, 70, (1,), generator=generator))
        picks = torch.randint(0, len(letters), (length,), generator=generator).tolist()
        texts.append({"text": " ".join(letters[i] for i in picks)})
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(words), hidden_size=128,
                                      intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=SEQUENCE)
    model = transformers.LlamaForCausalLM(config)
    args = arguments(SFTConfig, folder, steps, logging_steps, packing=True,
                     max_length=SEQUENCE, bf16=False)
    return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(texts),
                      processing_class=tokenizer)


if __name__ == "__main__":
    main()
