"""The DeepSpeed cells: model, data, configurations, and the float64 reference.

Shared by ``deepspeed_runner.py`` (which trains each cell with a real
DeepSpeed engine inside ``Join([engine])`` on gloo) and ``test_deepspeed.py``
(which computes the reference in its own process, without DeepSpeed). Imports
torch only.

The reference is one process in float64 that steps the way the documented
divisor says (``adapters/deepspeed/_engine.py``): at micro-step ``t`` every rank
``r`` that still has a batch adds ``grad(loss[r, t]) / (gas * D[t])`` to the
window's gradient, ``D[t] = W`` (``divide_by_initial_world_size=True``, the
default) or the number of ranks active at ``t``; at each boundary
(``(t + 1) % gas == 0``) the gradient is clipped to ``clip`` by the global norm
as DeepSpeed clips (``min(1, clip / (norm + 1e-6))``), the optimizer steps and
the LR scheduler steps. A trailing partial window is not stepped (nobody
reaches its boundary).
"""

from __future__ import annotations

from typing import Any

import torch

BATCH = 3
IN, HIDDEN, OUT = 5, 8, 2
LR = 0.02


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.LayerNorm(HIDDEN),
        torch.nn.Linear(HIDDEN, OUT))


def batch(rank: int, index: int, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Rank ``rank``'s batch number ``index``."""
    generator = torch.Generator().manual_seed(1000 * rank + index)
    x = torch.randn(BATCH, IN, generator=generator, dtype=torch.float64)
    y = torch.stack([x[:, :3].sum(dim=1), x[:, 3:].prod(dim=1)], dim=1) * 0.5
    return x.to(dtype), y.to(dtype)


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.3 * step)


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.05)
    if kind == "adam":
        return torch.optim.Adam(params, lr=LR)
    if kind == "sgd":  # scale-sensitive, unlike Adam: shows the divisor
        return torch.optim.SGD(params, lr=10 * LR, momentum=0.5)
    raise ValueError(kind)


def cell(name: str, *, stage: int, plan: list[int], gas: int = 1, clip: float = 0.0,
         optimizer: str = "adamw", divide: bool = True,
         scheduler_steps: int = 1) -> dict[str, Any]:
    """One training cell: a ZeRO stage, each rank's number of batches, the settings
    (``scheduler_steps``: LR scheduler steps per optimizer step)."""
    return {"name": name, "stage": stage, "plan": plan, "gas": gas, "clip": clip,
            "optimizer": optimizer, "divide": divide, "scheduler_steps": scheduler_steps}


def cells(world: int) -> list[dict[str, Any]]:
    """Every training cell one launched job of ``world`` ranks runs."""
    plans = {1: ([4],), 2: ([3, 7], [0, 5]), 3: ([5, 2, 0], [1, 6, 4])}[world]
    out = []
    for stage in (0, 1, 2, 3):
        for index, plan in enumerate(plans):
            # gas 1 with clipping that bites and AdamW; gas 3 with Adam; gas 2
            # with the active-rank divisor and SGD (whose steps scale with it).
            out.append(cell(f"s{stage}-p{index}-gas1-clip-adamw", stage=stage, plan=plan,
                            clip=0.05))
            out.append(cell(f"s{stage}-p{index}-gas3-adam", stage=stage, plan=plan, gas=3,
                            clip=1.0, optimizer="adam"))
            out.append(cell(f"s{stage}-p{index}-gas2-active-sgd", stage=stage, plan=plan,
                            gas=2, optimizer="sgd", divide=False))
    return out


def launcher_cells(world: int) -> list[dict[str, Any]]:
    """A cell per stage and setting pair for a second launcher (every stage, both plans)."""
    return [spec for spec in cells(world)
            if spec["name"].endswith(("p0-gas3-adam", "p1-gas2-active-sgd"))]


def ds_config(spec: dict[str, Any], world: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": spec["gas"],
        "train_batch_size": BATCH * spec["gas"] * world,
        "gradient_clipping": spec["clip"],
        "zero_optimization": {"stage": spec["stage"]},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def reference(spec: dict[str, Any], world: int) -> list[list[float]]:
    """The full parameters after one process trains the cell in float64 (module doc)."""
    model = make_model().double()
    optimizer = make_optimizer(spec["optimizer"], model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    plan, gas = spec["plan"], spec["gas"]
    params = list(model.parameters())
    for t in range(max(plan)):
        active = [r for r in range(world) if t < plan[r]]
        divisor = gas * (world if spec["divide"] else len(active))
        for rank in active:
            x, y = batch(rank, t, torch.float64)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / divisor).backward()
        if (t + 1) % gas == 0:
            if spec["clip"] > 0:
                grads = [p.grad for p in params if p.grad is not None]
                norm = torch.sqrt(sum((g * g).sum() for g in grads))
                coef = min(1.0, spec["clip"] / (float(norm) + 1e-6))
                for g in grads:
                    g.mul_(coef)
            optimizer.step()
            for _ in range(spec["scheduler_steps"]):
                scheduler.step()
            optimizer.zero_grad()
    return [p.detach().flatten().tolist() for p in params]


def max_error(got: list[list[float]], want: list[list[float]]) -> float:
    assert len(got) == len(want)
    return max(abs(a - b) for g, w in zip(got, want, strict=True)
               for a, b in zip(g, w, strict=True))


# -- StepReplay: a user's step with collectives in forward, backward and step ----------


class _GlobalCentering(torch.autograd.Function):
    """``x - mean(x over every rank's batch)``: an all-reduce in forward and in backward.

    A Megatron-style layer in miniature: its collectives run inside the
    model, and a rank with an empty batch contributes a count of 0 (and a sum
    of 0) to both, so the active ranks' result is that of their union batch.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        stats = torch.cat([x.sum(dim=0), x.new_tensor([x.shape[0]])])
        dist.all_reduce(stats)
        count = stats[-1]
        ctx.count = count
        return x - stats[:-1] / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        total = grad.sum(dim=0)
        dist.all_reduce(total)
        return grad - total / ctx.count


class CenteredNet(torch.nn.Module):
    """Linear, global centering (collectives), Tanh, Linear."""

    def __init__(self, distributed: bool = True) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, OUT)
        self.distributed = distributed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(x)
        if self.distributed:
            hidden = _GlobalCentering.apply(hidden)
        else:  # the reference: x is the union batch
            hidden = hidden - hidden.mean(dim=0)
        return self.out(torch.tanh(hidden))


STEP_PLANS = {1: [3], 2: [2, 5], 3: [4, 0, 2]}


def step_reference(world: int) -> list[list[float]]:
    """One process: at each step the active ranks' batches as one union batch
    (centered together), each rank's mean loss over the world size (the user's
    step sums gradients and divides by ``world``), SGD with momentum."""
    model = CenteredNet(distributed=False).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=10 * LR, momentum=0.5)
    plan = STEP_PLANS[world]
    for t in range(max(plan)):
        active = [r for r in range(world) if t < plan[r]]
        xs, ys = zip(*(batch(r, t, torch.float64) for r in active), strict=True)
        out = model(torch.cat(xs))
        loss = sum(torch.nn.functional.mse_loss(part, y)
                   for part, y in zip(out.split(BATCH), ys, strict=True))
        (loss / world).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().flatten().tolist() for p in model.parameters()]
