"""Ray Train's TorchTrainer with uneven per-worker data and a per-step report.

Worker r has ``4 + 3 * r`` batches per epoch (2 workers: 4 and 7), trains a
DDP model (``ray.train.torch.prepare_model``) inside ``Join([model, report])``
and calls ``report`` (``joinkit.adapters.ray.report``, a drop-in for
``ray.train.report``) after every step. A worker that runs out of batches
shadows the others' all-reduces and reports, so every worker reports 7 times
per epoch and nobody deadlocks; DDP's post hook then gives every worker the
last joiner's weights, which equal a single process that averages the active
workers' gradients over the world size.
Run it (it starts a local Ray cluster of 2 CPUs, about 20 s)::

    python examples/ray_train.py

and it prints::

    worker 0: 8 batches, 14 reports
    worker 1: 14 batches, 14 reports
    weights equal the single-process reference
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

EPOCHS = 2
LR = 0.1
WORKERS = 2


def batch_count(rank: int) -> int:
    """How many batches worker ``rank`` has per epoch."""
    return 4 + 3 * rank


def make_model() -> torch.nn.Module:
    """The same initial model on every worker and in the reference."""
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def make_batch(rank: int, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s batch ``step`` of ``epoch`` (deterministic)."""
    generator = torch.Generator().manual_seed(1000 * epoch + 100 * rank + step)
    x = torch.randn(4, 3, generator=generator)
    return x, x.sum(dim=1, keepdim=True) * 0.5 + 1.0


def train_func(config: dict[str, Any]) -> None:
    """Ray Train's training function: runs on every worker."""
    import ray.train
    import ray.train.torch

    from joinkit import Join
    from joinkit.adapters.ray import report

    rank = ray.train.get_context().get_world_rank()
    model = ray.train.torch.prepare_model(make_model())  # DDP over Ray's gloo group
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches = 0
    for epoch in range(EPOCHS):
        with Join([model, report]):
            for step in range(batch_count(rank)):
                x, y = make_batch(rank, epoch, step)
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                report({"loss": loss.item(), "epoch": epoch})
                batches += 1
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    # One more report, outside the Join: every worker is there.
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "weights.json").write_text(json.dumps(weights))
        checkpoint = ray.train.Checkpoint.from_directory(folder) if rank == 0 else None
        ray.train.report({"batches": batches, "reports": report.reports, "rank": rank},
                         checkpoint=checkpoint)
    Path(config["out"], f"worker{rank}.json").write_text(
        json.dumps({"batches": batches, "reports": report.reports, "weights": weights}))


def reference() -> list[list[float]]:
    """One process: at each step the active workers' gradients, summed over the world size."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for epoch in range(EPOCHS):
        for step in range(max(batch_count(r) for r in range(WORKERS))):
            optimizer.zero_grad()
            for rank in range(WORKERS):
                if step < batch_count(rank):
                    x, y = make_batch(rank, epoch, step)
                    (torch.nn.functional.mse_loss(model(x), y) / WORKERS).backward()
            optimizer.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def fit(out: str, *, timeout_s: int = 1800, function: Any = train_func,
        config: dict[str, Any] | None = None) -> Any:
    """Run ``function`` under a TorchTrainer of :data:`WORKERS` CPU workers (gloo).

    Starts a local Ray cluster of 2 CPUs unless Ray is initialised already.
    ``function`` gets ``{"out": out, **config}``.

    Returns:
        Ray Train's ``Result``.
    """
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    if not ray.is_initialized():
        ray.init(num_cpus=WORKERS, include_dashboard=False, log_to_driver=False)
    trainer = TorchTrainer(
        function,
        train_loop_config={"out": out, **(config or {})},
        torch_config=TorchConfig(backend="gloo", timeout_s=timeout_s),
        scaling_config=ray.train.ScalingConfig(num_workers=WORKERS, use_gpu=False),
        run_config=ray.train.RunConfig(storage_path=os.path.join(out, "ray"), name="run",
                                       failure_config=ray.train.FailureConfig(max_failures=0)),
    )
    return trainer.fit()


def summary(out: str) -> list[str]:
    """What :func:`main` prints, from the files the workers wrote to ``out``."""
    workers = [json.loads(Path(out, f"worker{r}.json").read_text()) for r in range(WORKERS)]
    lines = [f"worker {rank}: {worker['batches']} batches, {worker['reports']} reports"
             for rank, worker in enumerate(workers)]
    want = reference()
    same = all(
        torch.allclose(torch.tensor(w), torch.tensor(r), atol=1e-6)
        for worker in workers for w, r in zip(worker["weights"], want, strict=True)
    )
    lines.append("weights equal the single-process reference" if same else
                 "weights DIFFER from the single-process reference")
    return lines


def main() -> int:
    with tempfile.TemporaryDirectory() as out:
        fit(out)
        lines = summary(out)
    print("\n".join(lines))
    return 0 if lines[-1].startswith("weights equal") else 1


if __name__ == "__main__":
    sys.exit(main())
