"""Accelerate's ``prepare`` on 2 CPU processes with uneven data: joinkit's way and Accelerate's.

Run by ``test_accelerate.py`` as ``torchrun --nproc-per-node 2
accelerate_program.py MODE OUT`` (MODE ``ddp`` or ``fsdp2``). One
process runs, in order, each case with a fresh model and a fresh prepare:

- ``joinkit``: 2 epochs of ``join_uneven_inputs(accelerator, [model,
  optimizer], even_batches=False)`` over a prepared loader of 7 batches (rank 0
  gets 4 per epoch, rank 1 gets 3): the full parameters after each epoch;
- ``padded``: Accelerate's default, ``even_batches=True`` and no Join: rank 1
  gets batch 0 again, so both run 4 steps (the full parameters);
- ``accumulate`` (DDP): ``accelerator.accumulate(model)`` with windows of
  ``ACCUMULATE`` batches inside joinkit's ``join_uneven_inputs``: rank 1's last
  window ends at its own last batch (the full parameters after one epoch);
- ``accelerate_join``: Accelerate's own ``accelerator.join_uneven_inputs([model],
  even_batches=False)``: the warning it gives, and what happens (rank 0's
  fourth backward waits for rank 1, which left: the error, after how long).

MODE ``fsdp2``: Accelerate 1.15 sets ``DistributedType.FSDP`` only for GPU-like
devices; with ``cpu=True`` it is ``MULTI_CPU`` and the FSDP plugin is ignored
(the model comes back DDP-wrapped; recorded as ``ignored_plugin``). To run
Accelerate's own FSDP2 ``prepare`` (``fully_shard`` via its plugin) on CPU,
the state's ``distributed_type`` is set to ``FSDP`` after construction, a
test-only override of what a GPU machine gets.

Each rank writes ``OUT/MODE-CASE-RANK.json`` as soon as a case ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

BATCHES = 7  # in the dataset: rank 0 gets 4 per epoch, rank 1 gets 3
BATCH = 2
EPOCHS = 2
LR = 0.1
ACCUMULATE = 2  # the accumulate case's gradient_accumulation_steps
CLIP = 0.05  # the clipping cases' max norm (it bites: the norms are about 0.1 to 1)
PG_TIMEOUT_S = 30


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(BATCHES * BATCH, 3, generator=generator)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.3 - 0.2)


def full_params(model: torch.nn.Module) -> list[list[float]]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):  # FSDP1: a collective of every rank
        with FullyShardedDataParallel.summon_full_params(model):
            return [p.detach().flatten().tolist() for p in model.parameters()]
    out = []
    for p in model.parameters():
        data = p.detach()
        if hasattr(data, "full_tensor"):  # an FSDP2 shard (DTensor)
            data = data.full_tensor()
        out.append(data.flatten().tolist())
    return out


def make_accelerator(mode: str) -> tuple[Any, dict[str, Any]]:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import (
        DataLoaderConfiguration,
        DistributedType,
        FullyShardedDataParallelPlugin,
        InitProcessGroupKwargs,
    )

    plugin = None
    if mode == "fsdp2":
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    elif mode == "fsdp1":  # the plugin's default version; sync_module_states looks for a GPU
        plugin = FullyShardedDataParallelPlugin(sync_module_states=False)
    accelerator = Accelerator(
        cpu=True, fsdp_plugin=plugin,
        dataloader_config=DataLoaderConfiguration(even_batches=False),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=PG_TIMEOUT_S))],
    )
    facts = {"distributed_type": str(accelerator.distributed_type),
             "num_processes": accelerator.num_processes}
    if plugin is not None:
        facts["ignored_plugin"] = accelerator.distributed_type != DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP  # test-only: see the doc
        # Every AcceleratorState() built later (a data loader's prepare) copies
        # PartialState's shared state over its own: set there too, or the type goes
        # back to MULTI_CPU after the first prepare (no_sync, clipping: not FSDP's).
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        # MULTI_CPU's device is cpu:<local rank>, which FSDP1 refuses as its device_id
        # for a model on "cpu" (a GPU machine's is cuda:<local rank>).
        accelerator.state.device = PartialState._shared_state["device"] = torch.device("cpu")
    return accelerator, facts


def prepared(accelerator: Any, batches: int = BATCHES) -> tuple[Any, Any, Any]:
    from accelerate.utils import DistributedType

    # A fresh start for each case: Accelerate's FSDP clip_grad_norm_ looks for the
    # model among every one prepared before (comparing parameter lists).
    accelerator.free_memory()
    model = make_model()
    data = torch.utils.data.Subset(dataset(), range(batches * BATCH))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    if (accelerator.distributed_type == DistributedType.FSDP
            and not accelerator.is_fsdp2):
        # FSDP1 flattens the parameters, and Accelerate does not give an optimizer
        # built before the model's prepare the flat ones: the model first (Accelerate's
        # FSDP1 advice; the Trainer does the same).
        model = accelerator.prepare(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        optimizer, loader = accelerator.prepare(optimizer, loader)
        return model, optimizer, loader
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return accelerator.prepare(model, optimizer, loader)


def step(accelerator: Any, model: Any, optimizer: Any, x: Any, y: Any) -> None:
    optimizer.zero_grad()
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()


def accumulated(accelerator: Any, gas: int, clip: bool = False, batches: int = BATCHES,
                bf16: bool = False, zero_padded: bool = False,
                scheduler: bool = False) -> dict[str, Any]:
    """``accelerator.accumulate(model)`` in windows of ``gas`` batches inside
    ``join_uneven_inputs``, clipping (``CLIP``) at each window's end when ``clip``: a
    joined process clips in its shadow step (``shadow_step``), as the loop does.
    ``scheduler``: a StepLR (halving every step) that Accelerate wraps, stepped after
    each optimizer step (the wrapper steps it once per process).

    ``bf16``: FSDP's mixed precision (the plugin's bf16 policy: parameters and
    reductions in bfloat16). ``zero_padded``: no Join, the reference computed the same
    way: Accelerate's padding (``even_batches=True``) with the padded batches' loss
    times zero, so a short process runs the same collectives with zero contributions
    through FSDP itself."""
    from joinkit.adapters.accelerate import join_uneven_inputs

    plugin = getattr(accelerator.state, "fsdp_plugin", None) if bf16 else None
    if bf16:
        plugin.set_mixed_precision("bf16", override=True)
    model, optimizer, loader = prepared(accelerator, batches)
    if bf16:
        plugin.mixed_precision_policy = None
    accelerator.gradient_accumulation_steps = gas
    joinables = [model, optimizer]
    if scheduler:
        lr_scheduler = accelerator.prepare(
            torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1, gamma=0.5))
        joinables.append(lr_scheduler)
    kwargs: dict[str, Any] = {}
    if clip:
        def shadow_step() -> None:
            accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.optimizer.step()

        kwargs["shadow_step"] = shadow_step
    steps = 0
    own = len(range(accelerator.process_index, batches, accelerator.num_processes))
    block: Any = join_uneven_inputs(accelerator, joinables, even_batches=False, **kwargs)
    if zero_padded:
        loader.batch_sampler.even_batches = True
        block = contextlib.nullcontext()
    with block:
        for x, y in loader:
            with accelerator.accumulate(model):
                weight = 0.0 if steps >= own else 1.0  # a padded batch (zero_padded)
                loss = torch.nn.functional.mse_loss(model(x).float(), y) * weight
                accelerator.backward(loss)
                if clip and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), CLIP)
                optimizer.step()
                if scheduler:
                    lr_scheduler.step()
                optimizer.zero_grad()
            steps += 1
    accelerator.gradient_accumulation_steps = 1
    return {"params": [full_params(model)], "steps": steps, "model": type(model).__name__,
            "distributed_type": str(accelerator.distributed_type),
            "grads": [p.grad is None for p in model.parameters()]}


def write(out: Path, mode: str, case: str, rank: int, record: dict[str, Any]) -> None:
    Path(out, f"{mode}-{case}-{rank}.json").write_text(json.dumps(record))


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    from joinkit.adapters.accelerate import join_uneven_inputs

    accelerator, facts = make_accelerator(mode)
    rank = accelerator.process_index
    if accelerator.num_processes == 3:  # FSDP's accumulation on 3 processes, then done
        # 7 batches: 3, 2 and 2, rank 0's last window half full (closed at the end);
        # 2 batches: 1, 1 and none, the one window closed at the end.
        write(out, mode, "accumulate", rank, accumulated(accelerator, ACCUMULATE))
        write(out, mode, "no_data_clip", rank,
              accumulated(accelerator, ACCUMULATE, clip=True, batches=2))
        # An LR scheduler Accelerate wrapped, clipping, 7 batches (the last window open).
        write(out, mode, "scheduler_clip", rank,
              accumulated(accelerator, ACCUMULATE, clip=True, scheduler=True))
        sys.stdout.flush()
        os._exit(0)

    model, optimizer, loader = prepared(accelerator)
    per_epoch, steps = [], 0
    for _ in range(EPOCHS):
        with join_uneven_inputs(accelerator, [model, optimizer], even_batches=False):
            for x, y in loader:
                step(accelerator, model, optimizer, x, y)
                steps += 1
        per_epoch.append(full_params(model))
    write(out, mode, "joinkit", rank, {**facts, "model": type(model).__name__,
                                      "params": per_epoch, "steps": steps})

    model, optimizer, loader = prepared(accelerator)
    steps = 0
    with join_uneven_inputs(accelerator, [model, optimizer], even_batches=True):
        for x, y in loader:
            step(accelerator, model, optimizer, x, y)
            steps += 1
    write(out, mode, "padded", rank, {"params": [full_params(model)], "steps": steps})

    # accelerator.accumulate: windows of 2 batches, rank 1's last one short.
    write(out, mode, "accumulate", rank, accumulated(accelerator, ACCUMULATE))
    if mode != "ddp":
        # Windows of 3 with clipping: rank 0's second window (one batch) is still open
        # when both have run out, and the Join's post hooks close it.
        write(out, mode, "accumulate3_clip", rank, accumulated(accelerator, 3, clip=True))
        # bfloat16 parameters and reductions (FSDP's mixed precision), windows of 2,
        # with the Join and with zero-weight padding (the same casts and collectives).
        write(out, mode, "bf16", rank, accumulated(accelerator, ACCUMULATE, bf16=True))
        write(out, mode, "bf16_zero_padded", rank,
              accumulated(accelerator, ACCUMULATE, bf16=True, zero_padded=True))

    model, optimizer, loader = prepared(accelerator)
    steps, error = 0, None
    began = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with accelerator.join_uneven_inputs([model], even_batches=False) as inside:
                for x, y in loader:
                    step(accelerator, model, optimizer, x, y)
                    steps += 1
        except Exception as exc:  # rank 0: the collective its peer never joins
            error = f"{type(exc).__name__}: {exc}"[:600]
    write(out, mode, "accelerate_join", rank, {
        "steps": steps, "error": error, "seconds": time.monotonic() - began,
        "context": type(inside).__name__ if error is None else None,
        "warnings": [str(w.message) for w in caught],
    })
    sys.stdout.flush()
    os._exit(0)  # rank 0's group is broken: no teardown


if __name__ == "__main__":
    main()
