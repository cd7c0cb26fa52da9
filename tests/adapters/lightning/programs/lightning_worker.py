"""Lightning's Trainer with ``UnevenInputs``: scenarios in one launch of 2 ranks.

Run as ``torchrun --nproc-per-node 2 lightning_worker.py OUT_DIR NAME...``
(each scenario is one ``trainer.fit``); each rank writes
``OUT_DIR/rank{r}.json``: per scenario its final parameters, the loss it logged
per step (``self.log(..., sync_dist=True)``), the epoch values of the
validation loss and of a torchmetrics metric. ``test_lightning_trainer.py``
computes the single-process reference.

Rank r has ``INPUTS[r]`` training batches of 4 rows (the mid-epoch cells:
``MID_INPUTS``, also on 3 ranks) and ``val_inputs()[r]`` validation batches.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torchmetrics
from pytorch_lightning.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset

from joinkit import SideChannel, SideCollective
from joinkit.adapters.lightning import UnevenInputs

INPUTS = [5, 8]
VAL_INPUTS = [3, 2, 1]  # each rank's validation batches (the first 2 on 2 ranks)
EPOCHS = 2
LR = 0.1
MOMENTUM = 0.9
BATCH = 4


def rows(rank: int, n_batches: int, salt: int) -> TensorDataset:
    g = torch.Generator().manual_seed(100 * salt + rank)
    return TensorDataset(torch.randn(n_batches * BATCH, 3, generator=g),
                         torch.randn(n_batches * BATCH, 1, generator=g))


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


class Model(pl.LightningModule):
    def __init__(self, scheduler: bool, epoch_metric: bool = True) -> None:
        super().__init__()
        self.net = make_net()
        self.train_mse = torchmetrics.MeanSquaredError()
        self.use_scheduler = scheduler
        self.epoch_metric = epoch_metric

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        pred = self(x)
        loss = torch.nn.functional.mse_loss(pred, y)
        self.log("loss", loss, on_step=True, on_epoch=False, sync_dist=True)
        self.log("loss_max", loss, on_step=True, on_epoch=False, sync_dist=True, reduce_fx="max")
        if self.epoch_metric:
            self.train_mse(pred.detach(), y)
            self.log("train_mse", self.train_mse, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), on_epoch=True,
                 sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)
        if not self.use_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SideModel(Model):
    """Collectives of the LightningModule's own, in a number that depends on the data:
    ``batch_idx % 3 + 1`` all-reduces through the callback's side channel in its
    ``on_train_batch_end`` (the ranks still training), and a torchmetrics metric
    with ``dist_sync_on_step=True`` logged per step."""

    def __init__(self, side: SideChannel) -> None:
        super().__init__(scheduler=True, epoch_metric=False)
        self.side = side
        self.step_mse = torchmetrics.MeanSquaredError(dist_sync_on_step=True)
        self.counts: list[list[float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        x, y = batch
        self.log("step_mse", self.step_mse(self(x).detach(), y), on_step=True, on_epoch=False)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.counts.append([float(self.side.all_reduce(torch.ones(1))[0])
                            for _ in range(batch_idx % 3 + 1)])


class FSDPModel(Model):
    """The same model under ModelParallelStrategy: ``fully_shard`` on ``self.net``, the
    module training_step calls (Lightning's FSDP2)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


class FSDPBF16Model(Model):
    """FSDP2 with bfloat16 parameters and gradient reductions (``MixedPrecisionPolicy``;
    float32 outputs for the loss), the mixed precision FSDP2 gives Lightning."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                      reduce_dtype=torch.bfloat16,
                                      output_dtype=torch.float32)
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"], mp_policy=policy)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)  # a DTensor shard (FSDP2): all-gathered
    return full() if full is not None else tensor


class ListLogger(Logger):
    """Every rank's logged metrics, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "list"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append({k: float(v) for k, v in metrics.items()})

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def shard_loaders(rank: int) -> tuple[DataLoader, DataLoader]:
    """One dataset split exactly by joinkit's ShardSampler (no padding): 37 training rows
    (19 and 18, so 10 and 9 batches of 2, shuffled per epoch) and 11 validation rows."""
    from joinkit.adapters.torch.data import ShardSampler

    train = TensorDataset(*(t[:SHARD_ROWS[0]] for t in rows(0, 10, 3).tensors))
    val = TensorDataset(*(t[:SHARD_ROWS[1]] for t in rows(0, 3, 4).tensors))
    return (DataLoader(train, batch_size=2, sampler=ShardSampler(
                train, num_replicas=2, rank=rank, shuffle=True, seed=SHARD_SEED)),
            DataLoader(val, batch_size=2, sampler=ShardSampler(
                val, num_replicas=2, rank=rank, shuffle=False)))


SHARD_ROWS = (37, 11)
SHARD_SEED = 5


class ActiveRanks(pl.Callback):
    """A per-batch collective of the user's own, listed before UnevenInputs: an
    all-reduce of 1 per batch (the number of ranks still training), shadowed with 0."""

    def __init__(self) -> None:
        def count(value: float) -> float:
            t = torch.tensor([value])
            torch.distributed.all_reduce(t)
            return float(t[0])

        self.side = SideCollective(count, shadow=lambda: count(0.0), name="active ranks")
        self.counts: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.counts.append(self.side(1.0))


class ResumableLoader(DataLoader):
    """A training loader that resumes in the middle of an epoch: Lightning saves its
    ``state_dict`` in a checkpoint and loads it on resume (a ``_Stateful`` loader);
    its state is the number of batches it gave in the epoch (Lightning fetches a
    sized loader's batches without prefetching)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.given = 0
        self.skip = 0

    def __iter__(self) -> Any:
        skip, self.skip = self.skip, 0
        self.given = skip
        return self._batches(skip)

    def _batches(self, skip: int) -> Any:
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self.given = index + 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"given": self.given}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["given"]


def world() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "2"))


def val_inputs() -> list[int]:
    return VAL_INPUTS[:world()]


def fit(rank: int, accumulate: int = 1, scheduler: bool = False,
        validate: bool = True, shards: bool = False, fsdp: bool | str = False,
        inputs: list[int] = INPUTS, max_steps: int = -1, epochs: int = EPOCHS,
        epoch_metric: bool = True, side_model: bool = False,
        clip: float | None = None, bf16: bool = False, val_check: float | None = None,
        save_every: int = 0, resume: str | None = None,
        save_timed: bool = False, example: bool = True,
        full_state: bool = False) -> dict[str, Any]:
    logger = ListLogger()
    active = ActiveRanks()
    side = SideChannel() if side_model else None
    uneven = UnevenInputs(side_collectives=[active.side], side_channel=side)
    callbacks: list[Any] = [active, uneven]
    if save_every:  # ModelCheckpoint(every_n_train_steps=...), each save kept
        callbacks.append(pl.callbacks.ModelCheckpoint(
            dirpath=str(OUT / checkpoints(fsdp, full_state)), filename="{step}",
            every_n_train_steps=save_every, save_top_k=-1))
    if save_timed:  # train_time_interval=0: rank 0's clock says "save" after every batch
        import datetime

        callbacks.append(pl.callbacks.ModelCheckpoint(
            dirpath=str(OUT / f"timed{world()}"), filename="{step}",
            train_time_interval=datetime.timedelta(0), save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world(),
        strategy=_strategy(fsdp, sharded=bool(save_every or resume), full_state=full_state),
        max_epochs=epochs,
        max_steps=max_steps, logger=logger,
        log_every_n_steps=1, enable_checkpointing=bool(save_every or save_timed),
        enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate, gradient_clip_val=clip,
        callbacks=callbacks,
        limit_val_batches=1.0 if validate else 0,
        val_check_interval=1.0 if val_check is None else val_check,
    )
    model: Model
    if side is not None:
        model = SideModel(side)
    else:
        kind = FSDPBF16Model if bf16 else FSDPModel if fsdp is True else Model
        model = kind(scheduler and not shards, epoch_metric)
        # What a rank with no batch (or none left after the resumed save) replays.
        if fsdp == "fsdp1" and (0 in inputs or resume) and example:
            model.example_input_array = torch.zeros(1, 3)
    loader = ResumableLoader if save_every or resume or save_timed else DataLoader
    train = loader(rows(rank, inputs[rank], 1), batch_size=BATCH)
    val = DataLoader(rows(rank, val_inputs()[rank], 2), batch_size=BATCH)
    if shards:
        train, val = shard_loaders(rank)
    folder = OUT / checkpoints(fsdp, full_state)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val if validate else None,
                ckpt_path=None if resume is None else str(folder / resume))
    if hasattr(model.net, "reshard"):  # FSDP2: the float32 shards, not what the last
        model.net.reshard()             # forward (validation) left unsharded
    with _full_parameters(trainer):
        params = [float(v) for p in model.net.parameters() for v in _full(p.detach()).reshape(-1)]
    momentum = ([] if fsdp == "fsdp1" else  # FSDP1: each rank's flat shard of it
                [float(v) for s in trainer.optimizers[0].state.values()
                 for v in _full(s["momentum_buffer"]).reshape(-1)])
    return {
        "params": params,
        "fsdp1": isinstance(trainer.strategy.model,
                            torch.distributed.fsdp.FullyShardedDataParallel),
        "loss": [r["loss"] for r in logger.records if "loss" in r],
        "loss_max": [r["loss_max"] for r in logger.records if "loss_max" in r],
        "val_loss": [r["val_loss"] for r in logger.records if "val_loss" in r],
        "train_mse": [r["train_mse"] for r in logger.records if "train_mse" in r],
        "momentum": momentum,
        "global_step": trainer.global_step,
        "active_ranks": active.counts,
        # Each epoch's Join: this rank's shadow rounds; and how many of them ran the
        # shadow of Lightning's SIGTERM broadcast (kept on, not turned off).
        "shadow_rounds": [join.report.shadow_rounds for join in uneven.joins],
        "sigterm_shadows": uneven._sigterm.shadow_rounds if uneven._sigterm else None,
        "step_mse": [r["step_mse"] for r in logger.records if "step_mse" in r],
        "side_counts": model.counts if isinstance(model, SideModel) else None,
    }


def checkpoints(fsdp: bool | str, full_state: bool = False) -> str:
    """The step checkpoints' folder of a scenario (by world size and strategy)."""
    return f"ckpt{world()}" + ("" if not fsdp else "_fsdp2" if fsdp is True else
                               f"_{fsdp}") + ("_full" if full_state else "")


def _full_parameters(trainer: Any) -> Any:
    """FSDP1 (use_orig_params): the full parameters while it lasts (every rank)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(trainer.strategy.model, FullyShardedDataParallel):
        return FullyShardedDataParallel.summon_full_params(trainer.strategy.model)
    return contextlib.nullcontext()


def _strategy(fsdp: bool | str, sharded: bool = False, full_state: bool = False) -> Any:
    """Lightning's strategy of a scenario; ``sharded``: FSDP1 saves sharded checkpoints
    (its full state dict of a CPU model segfaults in torch, docs/lightning.md);
    ``full_state``: FSDP2 saves one file of full state dicts (rank 0 writes)."""
    if not fsdp:
        return "ddp"
    if fsdp == "fsdp1":
        from pytorch_lightning.strategies import FSDPStrategy

        # Lightning's strategy="fsdp" (FSDP1), made to run on this CPU machine (test-only):
        # Lightning refuses FSDPStrategy itself (the exact type) with accelerator="cpu",
        # and its wrapping passes device_id=None, with which FSDP1 looks for a GPU.
        class CPUFSDPStrategy(FSDPStrategy):
            def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
                from torch.distributed import fsdp

                original = fsdp.FullyShardedDataParallel

                class OnCPU(original):  # type: ignore[misc, valid-type]
                    def __init__(self, *args: Any, device_id: Any = None,
                                 **kwargs: Any) -> None:
                        super().__init__(*args, device_id=torch.device("cpu"), **kwargs)

                fsdp.FullyShardedDataParallel = OnCPU  # type: ignore[misc]
                try:
                    return super()._setup_model(model)
                finally:
                    fsdp.FullyShardedDataParallel = original  # type: ignore[misc]

        return CPUFSDPStrategy(state_dict_type="sharded" if sharded else "full")
    from pytorch_lightning.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=world(), tensor_parallel_size=1,
                                 save_distributed_checkpoint=not full_state)


SCENARIOS = {
    "fsdp2": lambda rank: fit(rank, scheduler=True, fsdp=True),
    # FSDP2 with windows of 3: rank 0 (5 batches) runs out inside its second window;
    # rank 1's third (2 batches of 8) is still open at the end, closed by the Join.
    "fsdp2_accumulate": lambda rank: fit(rank, accumulate=3, scheduler=True, fsdp=True),
    # Lightning's strategy="fsdp" (FSDP1, the whole LightningModule wrapped): the same.
    "fsdp1": lambda rank: fit(rank, scheduler=True, fsdp="fsdp1"),
    # FSDP2 with clipping by norm that bites (a norm all-reduce in every step).
    "fsdp2_clip": lambda rank: fit(rank, accumulate=3, scheduler=True, fsdp=True, clip=CLIP),
    # FSDP2's bfloat16 mixed precision, uneven and a control where nobody joins (8 and 8).
    "fsdp2_bf16": lambda rank: fit(rank, accumulate=3, scheduler=True, fsdp=True, bf16=True),
    "fsdp2_bf16_even": lambda rank: fit(rank, accumulate=3, scheduler=True, fsdp=True,
                                        bf16=True, inputs=[8, 8]),
    "fsdp1_accumulate": lambda rank: fit(rank, accumulate=3, scheduler=True, fsdp="fsdp1"),
    "ddp": lambda rank: fit(rank, scheduler=True),
    "ddp_accumulate": lambda rank: fit(rank, accumulate=2, validate=False),
    "ddp_shard_sampler": lambda rank: fit(rank, shards=True),
    # Rank 0 has no training batch (issue 31 item 6a).
    "ddp_empty_rank": lambda rank: fit(rank, scheduler=True, inputs=EMPTY_INPUTS,
                                       epoch_metric=False),
    # max_steps ends the second epoch at batch 7 of rank 1's 8; rank 0 (5) joined before.
    "ddp_max_steps": lambda rank: fit(rank, scheduler=True, max_steps=MAX_STEPS, epochs=3),
    # The LightningModule's own side-channel collectives and a per-step-syncing metric.
    "ddp_side_channel": lambda rank: fit(rank, side_model=True),
    # Mid-epoch validation (issue 49): every 3 batches, and every half epoch (4 of 8).
    "ddp_val_int": lambda rank: fit(rank, scheduler=True, val_check=3,
                                    inputs=MID_INPUTS[world()], epoch_metric=False),
    "ddp_val_float": lambda rank: fit(rank, scheduler=True, val_check=0.5,
                                      inputs=MID_INPUTS[world()], epoch_metric=False),
    # ModelCheckpoint(every_n_train_steps=6): step 6 is after rank 0 (5 batches) joined;
    # then a fit resumed from it (ckpt_path=) to the end.
    "ddp_save_steps": lambda rank: fit(rank, scheduler=True, save_every=SAVE_EVERY,
                                       inputs=MID_INPUTS[world()], epoch_metric=False),
    "ddp_resume": lambda rank: fit(rank, scheduler=True, resume=f"step={SAVE_EVERY}.ckpt",
                                   inputs=MID_INPUTS[world()], epoch_metric=False),
    # FSDP1 (strategy="fsdp") on 3 ranks: uneven with windows of 3, and a rank with no
    # training batch (it replays forward on the module's example_input_array, emptied).
    "fsdp1_3ranks": lambda rank: fit(rank, accumulate=3, scheduler=True, fsdp="fsdp1",
                                     inputs=[5, 8, 3]),
    "fsdp1_empty_rank": lambda rank: fit(rank, scheduler=True, fsdp="fsdp1",
                                         inputs=MID_INPUTS[3], epoch_metric=False),
    # ModelCheckpoint(train_time_interval=0): a save after every batch, decided by rank 0.
    "ddp_save_timed": lambda rank: fit(rank, scheduler=True, save_timed=True, epochs=1,
                                       inputs=MID_INPUTS[world()], epoch_metric=False),
    # FSDP2 on 3 ranks, rank 0 with no training batch (it replays on the others' spec).
    "fsdp2_empty_rank": lambda rank: fit(rank, scheduler=True, fsdp=True,
                                         inputs=MID_INPUTS[3], epoch_metric=False),
    # The mid-epoch cells under FSDP2 (ModelParallelStrategy) and FSDP1 (strategy="fsdp").
    "fsdp2_val_int": lambda rank: fit(rank, scheduler=True, val_check=3, fsdp=True,
                                      inputs=MID_INPUTS[world()], epoch_metric=False),
    "fsdp2_save_steps": lambda rank: fit(rank, scheduler=True, save_every=SAVE_EVERY,
                                         fsdp=True, inputs=MID_INPUTS[world()],
                                         epoch_metric=False),
    "fsdp2_resume": lambda rank: fit(rank, scheduler=True, resume=f"step={SAVE_EVERY}.ckpt",
                                     fsdp=True, inputs=MID_INPUTS[world()],
                                     epoch_metric=False),
    # The same with one file of full state dicts (gathered from every rank's shards).
    "fsdp2_full_save_steps": lambda rank: fit(rank, scheduler=True, save_every=SAVE_EVERY,
                                              fsdp=True, inputs=MID_INPUTS[world()],
                                              epoch_metric=False, full_state=True),
    "fsdp2_full_resume": lambda rank: fit(rank, scheduler=True,
                                          resume=f"step={SAVE_EVERY}.ckpt", fsdp=True,
                                          inputs=MID_INPUTS[world()], epoch_metric=False,
                                          full_state=True),
    "fsdp1_val_int": lambda rank: fit(rank, scheduler=True, val_check=3, fsdp="fsdp1",
                                      inputs=MID_INPUTS[world()], epoch_metric=False),
    "fsdp1_save_steps": lambda rank: fit(rank, scheduler=True, save_every=SAVE_EVERY,
                                         fsdp="fsdp1", inputs=MID_INPUTS[world()],
                                         epoch_metric=False),
    "fsdp1_resume": lambda rank: fit(rank, scheduler=True, resume=f"step={SAVE_EVERY}.ckpt",
                                     fsdp="fsdp1", inputs=MID_INPUTS[world()],
                                     epoch_metric=False),
    # Refused on every rank: FSDP1, a rank with no batch, no example_input_array.
    "fsdp1_empty_rank_no_example": lambda rank: fit(rank, fsdp="fsdp1", inputs=MID_INPUTS[3],
                                                    epoch_metric=False, example=False),
    # Refused on every rank: an empty rank, and an epoch-level metric synced at the end.
    "ddp_empty_rank_epoch_metric": lambda rank: fit(rank, scheduler=True, inputs=EMPTY_INPUTS),
}

EMPTY_INPUTS = [0, 8]
#: The mid-epoch cells' training batches by world size: a rank with none on 3 ranks.
MID_INPUTS = {2: [5, 8], 3: [0, 5, 8]}
SAVE_EVERY = 6
OUT = Path(".")
CLIP = 0.05
MAX_STEPS = 15


def main(out: Path, names: list[str]) -> None:
    import os

    global OUT
    rank = int(os.environ["RANK"])
    OUT = out
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = {"ok": True, "result": SCENARIOS[name](rank)}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()}
            break
        (out / f"rank{rank}.json").write_text(json.dumps(results))
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
