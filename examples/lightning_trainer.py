"""Lightning's Trainer with per-rank uneven train dataloaders: ``callbacks=[UnevenInputs()]``.

Rank r trains on ``5 + 3 * r`` batches per epoch (its own DataLoader, so
``use_distributed_sampler=False``), for 2 epochs with validation, logging the
loss per step with ``sync_dist=True``. Without the callback such a run pairs
one rank's next-epoch collectives with the other's leftovers and trains wrongly;
with it every epoch ends on both ranks together and the replicas stay equal to
a single process. Run it with Lightning's own launcher (2 CPU processes, gloo)
or under torchrun:

    python examples/lightning_trainer.py
    torchrun --nproc-per-node 2 examples/lightning_trainer.py

It prints, from each rank (in either order):

    Rank 0 trained on 10 batches; val_loss 1.234567; parameters checksum 1.234567
    Rank 1 trained on 16 batches; val_loss 1.234567; parameters checksum 1.234567
"""

from __future__ import annotations

import os
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from joinkit.adapters.lightning import UnevenInputs


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 1)
        self.batches = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_step=True, sync_dist=True)
        self.batches += 1
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader(rank: int, batches: int, salt: int) -> DataLoader:
    g = torch.Generator().manual_seed(100 * salt + rank)
    rows = TensorDataset(torch.randn(4 * batches, 3, generator=g),
                         torch.randn(4 * batches, 1, generator=g))
    return DataLoader(rows, batch_size=4)


def main() -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "2")), strategy="ddp",
        max_epochs=2, callbacks=[UnevenInputs()], use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    model = Regression()
    # Lightning starts the other process inside Trainer; each rank then builds its data.
    rank = trainer.global_rank
    trainer.fit(model, train_dataloaders=loader(rank, 5 + 3 * rank, 1),
                val_dataloaders=loader(rank, 2, 2))
    checksum = sum(float(p.detach().sum()) for p in model.parameters())
    val_loss = float(trainer.callback_metrics["val_loss"])
    # One write per line, so the ranks' lines never interleave.
    print(f"Rank {rank} trained on {model.batches} batches; val_loss {val_loss:.6f}; "
          f"parameters checksum {checksum:.6f}\n", end="", flush=True)


if __name__ == "__main__":
    main()
