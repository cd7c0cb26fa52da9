"""Lightning Fabric with joinkit's Join, one rank of a torchrun launch.

Run as ``torchrun --nproc-per-node 2 fabric_worker.py OUT_DIR``; each rank
writes ``OUT_DIR/rank{r}.json``: per scenario its final parameters (full, also
for FSDP2), its Adam state where there is one, and its losses.
``test_lightning_fabric.py`` compares them with a single-process reference.

Rank r has ``INPUTS[r]`` batches per epoch; two epochs, one Join per epoch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy

from joinkit import Join, JoinError, SideCollective

INPUTS = [3, 6]
EPOCHS = 2
LR = 0.05


def batches(rank: int, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 * epoch + rank)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g))
            for _ in range(INPUTS[rank])]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def full_params(model: torch.nn.Module) -> list[float]:
    out = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out += [float(v) for v in full.detach().reshape(-1).tolist()]
    return out


def train(fabric: Fabric, model: Any, optimizer: Any, log: Any = None) -> dict[str, Any]:
    losses = []
    for epoch in range(EPOCHS):
        joinables = [model, optimizer] + ([log] if log is not None else [])
        with Join(joinables):
            for x, y in batches(fabric.global_rank, epoch):
                loss = torch.nn.functional.mse_loss(model(x), y)
                fabric.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                if log is not None:
                    losses.append(float(log(loss.detach().clone())))
    return {"params": full_params(model), "losses": losses}


def ddp_adam(fabric: Fabric) -> dict[str, Any]:
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    # fabric.all_reduce (a barrier and an all-reduce) as a per-step side collective
    log = SideCollective(lambda t: fabric.all_reduce(t, reduce_op="sum"),
                         shadow=lambda: fabric.all_reduce(torch.zeros(()), reduce_op="sum"),
                         name="fabric.all_reduce")
    result = train(fabric, model, optimizer, log)
    state = optimizer.state_dict()["state"]
    result["adam"] = [[float(v) for v in s["exp_avg"].reshape(-1).tolist()] + [float(s["step"])]
                      for _, s in sorted(state.items())]
    return result


def torch_join_adam(fabric: Fabric) -> dict[str, Any]:
    """The issue's workaround, side by side: torch's own Join on the DDP dug out of the
    Fabric model. Parameters agree at each Join's end (DDP's post hook), but a joined
    rank's Adam state stays behind, so the next epoch trains on different models."""
    import torch.distributed.algorithms.join as torch_join
    from torch.nn.parallel import DistributedDataParallel

    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    ddp = next(m for m in model.modules() if isinstance(m, DistributedDataParallel))
    for epoch in range(EPOCHS):
        with torch_join.Join([ddp]):
            for x, y in batches(fabric.global_rank, epoch):
                fabric.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
    return {"params": full_params(model)}


def fsdp2_sgd(fabric_ddp: Fabric) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    def parallelize(module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
        return fully_shard(module, mesh=mesh["data_parallel"])

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2,
                                     tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(make_model())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    return train(fabric, model, optimizer)


def main(out: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    results: dict[str, Any] = {}
    for name, fn in (("ddp_adam", ddp_adam), ("torch_join_adam", torch_join_adam),
                     ("fsdp2_sgd", fsdp2_sgd)):
        try:
            results[name] = {"ok": True, "result": fn(fabric)}
        except (JoinError, RuntimeError, TypeError, ValueError) as error:
            import traceback

            results[name] = {"ok": False, "error": traceback.format_exc()}
            if isinstance(error, JoinError):
                break
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
