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
reaches its boundary), except in the cells that say ``close`` (Accelerate's, which
steps at the end of its data).
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


def make_optimizer(kind: str, params: Any, reference: bool = False) -> torch.optim.Optimizer:
    """``kind``'s optimizer; ``"cpu_adam"`` is DeepSpeed's ``DeepSpeedCPUAdam`` in AdamW
    mode (ZeRO-Offload's own; its JIT-built C++ op), torch's AdamW in the reference."""
    if kind == "cpu_adam" and not reference:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=LR, weight_decay=0.05, adamw_mode=True)
    if kind in ("adamw", "cpu_adam"):
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.05)
    if kind == "adam":
        return torch.optim.Adam(params, lr=LR)
    if kind == "sgd":  # scale-sensitive, unlike Adam: shows the divisor
        return torch.optim.SGD(params, lr=10 * LR, momentum=0.5)
    raise ValueError(kind)


def cell(name: str, *, stage: int, plan: list[int], gas: int = 1, clip: float = 0.0,
         optimizer: str = "adamw", divide: bool = True, scheduler_steps: int = 1,
         offload: str = "none", close: bool = False) -> dict[str, Any]:
    """One training cell: a ZeRO stage, each rank's number of batches, the settings
    (``scheduler_steps``: LR scheduler steps per optimizer step; ``offload``: ZeRO-Offload
    of ``"optimizer"`` or of ``"both"`` optimizer and parameters to the CPU; ``close``: a
    trailing partial window is stepped at the end, as Accelerate steps at the end of
    its data)."""
    return {"name": name, "stage": stage, "plan": plan, "gas": gas, "clip": clip,
            "optimizer": optimizer, "divide": divide, "scheduler_steps": scheduler_steps,
            "offload": offload, "close": close}


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
    return out + offload_cells(world)


def offload_cells(world: int) -> list[dict[str, Any]]:
    """ZeRO-Offload: the optimizer (ZeRO 2, 3) and the parameters (ZeRO 3) on the CPU,
    with a torch optimizer and with DeepSpeed's own ``DeepSpeedCPUAdam``."""
    first, second = {2: ([3, 7], [0, 5]), 3: ([5, 2, 0], [1, 6, 4])}[world]
    return [
        cell("off-s2-opt-p1-gas2-adam", stage=2, plan=second, gas=2, optimizer="adam",
             offload="optimizer"),
        cell("off-s3-both-p0-gas1-clip-adamw", stage=3, plan=first, clip=0.05,
             offload="both"),
        cell("off-s2-opt-p0-gas3-cpuadam", stage=2, plan=first, gas=3, clip=1.0,
             optimizer="cpu_adam", offload="optimizer"),
        cell("off-s3-both-p1-gas2-clip-cpuadam", stage=3, plan=second, gas=2, clip=0.05,
             optimizer="cpu_adam", offload="both"),
    ]


def launcher_cells(world: int) -> list[dict[str, Any]]:
    """A cell per stage and setting pair for a second launcher (every stage, both plans)."""
    return [spec for spec in cells(world)
            if spec["name"].endswith(("p0-gas3-adam", "p1-gas2-active-sgd"))]


def accelerate_cells(world: int) -> list[dict[str, Any]]:
    """Accelerate's DeepSpeed cells (``deepspeed_runner.accelerate``).

    Accelerate steps the loop's scheduler ``num_processes`` times per optimizer
    step; its windows end every ``gas`` micro-steps and at the end of the data
    (``close``). ``prepared``: the batches come from a data loader Accelerate
    prepared, which deals them round-robin (the ranks' counts differ by one at
    most, and a rank's data may end inside a window, where Accelerate would end
    it); else each rank has its own (a rank may have none).
    """
    def spec(stage: int, plan: list[int], gas: int, prepared: bool,
             clip: float = 0.05) -> dict[str, Any]:
        made = cell(f"accelerate-s{stage}-gas{gas}-{'-'.join(map(str, plan))}", stage=stage,
                    plan=plan, gas=gas, clip=clip, scheduler_steps=world, close=True)
        return {**made, "prepared": prepared}

    if world == 2:
        return [spec(2, [4, 3], 1, True), spec(3, [4, 3], 1, True),
                spec(1, [4, 3], 2, True),  # rank 1's data ends inside a window
                spec(2, [5, 4], 3, True, clip=0.0),  # the last window closed at the end
                spec(3, [0, 5], 2, False)]  # a rank without data
    return [spec(2, [5, 0, 3], 2, False, clip=0.0), spec(3, [3, 3, 2], 3, True),
            spec(1, [4, 4, 3], 2, True)]


def ds_config(spec: dict[str, Any], world: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": spec["stage"]}
    offload = spec.get("offload", "none")
    if offload in ("optimizer", "both"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload == "both":
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": spec["gas"],
        "train_batch_size": BATCH * spec["gas"] * world,
        "gradient_clipping": spec["clip"],
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if offload != "none" and spec["optimizer"] != "cpu_adam":
        # ZeRO-Offload with a torch optimizer (DeepSpeed asks for its CPU Adam by default).
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def reference(spec: dict[str, Any], world: int,
              losses: dict[tuple[int, int], float] | None = None) -> list[list[float]]:
    """The full parameters after one process trains the cell in float64 (module doc);
    ``losses`` gets each rank's loss at each micro-step, ``(rank, t)``."""
    model = make_model().double()
    optimizer = make_optimizer(spec["optimizer"], model.parameters(), reference=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    plan, gas = spec["plan"], spec["gas"]
    params = list(model.parameters())
    last = max(plan) - 1
    for t in range(max(plan)):
        active = [r for r in range(world) if t < plan[r]]
        divisor = gas * (world if spec["divide"] else len(active))
        for rank in active:
            x, y = batch(rank, t, torch.float64)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / divisor).backward()
            if losses is not None:
                losses[rank, t] = float(loss.detach())
        if (t + 1) % gas == 0 or (spec.get("close") and t == last):
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
