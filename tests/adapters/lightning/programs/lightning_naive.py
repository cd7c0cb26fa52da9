"""``examples/lightning_trainer.py`` the way Lightning alone runs it: no ``UnevenInputs``.

Run as ``python lightning_naive.py`` (Lightning's own launcher starts the
second process). Rank r has ``5 + 3 * r`` training batches for 2 epochs, as in
the example; without a Join rank 0's second-epoch collectives pair with rank
1's first-epoch leftovers, so the run either trains wrongly (and exits 0) or
hangs. ``test_lightning_trainer.py`` bounds it with a timeout and checks
which, side by side with the example run with the callback. Once both ranks
are set up, the group's timeout is :data:`HANG_SECONDS` (Lightning's default is
30 minutes), so a hang ends as gloo's timeout error instead of waiting for the
test's timeout. The rendezvous keeps Lightning's default: the second process
may take longer than that to start on a loaded machine, and a start-up timeout
would end the run before it showed anything (the test's own timeout bounds it).
"""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path

import pytorch_lightning as pl
import torch.distributed as dist

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "lightning_trainer.py"
#: A collective that waited this long for its peer has hung: the run's steps are
#: milliseconds apart. One that times out in a healthy phase (a peer slowed down
#: between two steps on a loaded machine) reads as a hang too, which the test accepts: this run is
#: the wrong way, bounded, not a run that must finish.
HANG_SECONDS = 15


class HangBound(pl.Callback):
    """Bounds the group's collectives by :data:`HANG_SECONDS` once it is set up."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=HANG_SECONDS))


def main() -> None:
    spec = importlib.util.spec_from_file_location("lightning_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_epochs=2,
        strategy="ddp", callbacks=[HangBound()],
        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    model = example.Regression()
    rank = trainer.global_rank
    trainer.fit(model, train_dataloaders=example.loader(rank, 5 + 3 * rank, 1),
                val_dataloaders=example.loader(rank, 2, 2))
    checksum = sum(float(p.detach().sum()) for p in model.parameters())
    print(f"Rank {rank} trained on {model.batches} batches; parameters checksum "
          f"{checksum:.6f}\n", end="", flush=True)


if __name__ == "__main__":
    main()
