"""The Hugging Face Trainer with uneven data on the ranks: one line, ``uneven_inputs(trainer)``.

Run it with ``torchrun --nproc-per-node 2 examples/hf_trainer.py`` or
``accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer.py`` (CPU
processes, gloo). 13 training rows of batch 2 on 2 ranks: rank 0 reads 7 of
them (4 batches), rank 1 reads 6 (3 batches), each exactly once per epoch; 7
evaluation rows, each evaluated exactly once. A tiny GPT-2 and its data are
built in code: nothing is downloaded. ``pip install 'joinkit[transformers]'``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from joinkit.adapters.transformers import uneven_inputs


def rows(count: int, seed: int) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 24, (count, 8), generator=generator).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def collate(batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    return {key: torch.tensor([row[key] for row in batch]) for key in ("input_ids", "labels")}


def main() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=24, n_positions=16, n_embd=16, n_layer=2,
                                       n_head=2))
    args = TrainingArguments(
        output_dir="/tmp/joinkit-hf-trainer", use_cpu=True, report_to=[], disable_tqdm=True,
        per_device_train_batch_size=2, per_device_eval_batch_size=2, num_train_epochs=2,
        logging_steps=1, eval_strategy="steps", eval_steps=3, save_strategy="no",
        learning_rate=1e-2,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows(13, seed=1),
                      eval_dataset=rows(7, seed=2), data_collator=collate)
    uneven_inputs(trainer)  # on every rank, before train()
    trainer.train()
    metrics = trainer.evaluate()

    rank = dist.get_rank()
    steps = trainer.state.global_step
    print(f"rank {rank}: {steps} optimizer steps, eval_loss {metrics['eval_loss']:.4f}")


if __name__ == "__main__":
    main()
