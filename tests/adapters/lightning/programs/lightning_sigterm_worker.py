"""A real SIGTERM to one rank during ``Trainer.fit`` with ``UnevenInputs``: scenarios in one launch.

Run as ``torchrun --nproc-per-node 2 lightning_sigterm_worker.py OUT_DIR NAME...``.
Rank r has ``INPUTS[r]`` training batches. A scenario ``"<rank>@<batch>"`` sends
SIGTERM (``os.kill``, to this process only) to that rank at the start of its
training batch of that index, in the first epoch; the fit should end on every
rank with Lightning's ``SIGTERMException`` at the same point, and the next
scenario runs in the same processes (the group is still healthy). Each rank
writes ``OUT_DIR/rank{r}.json``: per scenario the batches it ran, whether the
fit ended with ``SIGTERMException``, and ``trainer.received_sigterm``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, TensorDataset

from joinkit.adapters.lightning import UnevenInputs

INPUTS = [5, 8]
BATCH = 4


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_step=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Signal(pl.Callback):
    """Sends SIGTERM to this process at one batch start; records the batches run."""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.batches: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self.batches.append((trainer.current_epoch, batch_idx))
        if trainer.current_epoch == 0 and batch_idx == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def fit(rank: int, signalled: int, at: int) -> dict[str, Any]:
    sig = Signal(at if rank == signalled else None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
        callbacks=[sig, UnevenInputs(timeout=60.0)],
    )
    g = torch.Generator().manual_seed(rank)
    n = INPUTS[rank] * BATCH
    data = DataLoader(TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)),
                      batch_size=BATCH)
    stopped = False
    try:
        trainer.fit(Model(), train_dataloaders=data)
    except SIGTERMException:
        stopped = True
    return {"batches": sig.batches, "sigterm_exception": stopped,
            "received_sigterm": trainer.received_sigterm,
            "handler_restored": signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)}


def main(out: Path, names: list[str]) -> None:
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for name in names:
        signalled, at = (int(v) for v in name.split("@"))
        try:
            results[name] = {"ok": True, "result": fit(rank, signalled, at)}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()}
            break
        finally:
            (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
