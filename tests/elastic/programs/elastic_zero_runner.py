"""Run elastic DDP + ZeroRedundancyOptimizer kill cells on gloo (forked ranks).

Theory of operation
-------------------
``python elastic_zero_runner.py --out DIR CELL [CELL ...]``: as
``elastic_ddp_runner.py`` (whose inputs, cell syntax and death helper this
reuses), this process hosts a ``TCPStore`` and forks each cell's ranks
(``elastic_fork.fork_ranks``), which train ``DDP(Split())`` with a
``ZeroRedundancyOptimizer(SGD, lr=LR, weight_decay=DECAY)`` in one
``Join([model, zero], on_rank_loss="finish")``: rank ``r`` has ``INPUTS + r``
inputs. ``Split`` is the linear model of the DDP runner with its weight in
three parameters (so every rank of a world of 4 owns a shard). After the
Join every survivor takes ``AFTER`` more ZeRO steps on the survivors' group
(proving the rebuild): outside any Join, and the last in a later default-mode
Join over the rebuilt group.

A ``CELL`` is ``W:KILLS[~OPTION]`` as in the DDP runner, with one more point:
``step`` (after input ``at``'s backward, whose gradient unit completed, before
``zero.step()``), and ``entry`` (at the Join's entry, as the shards' state is
gathered: the survivors must refuse to start, :func:`entry_cell`).
``OPTION``, comma-separated: ``raise`` (the default ``on_rank_loss``),
``adam`` or ``momentum`` (ZeRO's optimizer: ``Adam``, or ``SGD`` with
``momentum=MOMENTUM``, each with ``weight_decay=DECAY``; else ``SGD``
without momentum).
``W:refusals`` runs the refused configurations. Each rank writes
``DIR/cell{C}-rank{R}.json`` (initial parameters, parameters and its shard
of the optimizer state at the Join's exit and after the later steps, the
report's lost ranks, ZeRO's group size and rank after the Join); the parent
appends the exit statuses to ``DIR/cells.jsonl``. With ``--mpirun`` each cell runs under
``mpirun --with-ft ulfm``.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from elastic_ddp_runner import DIM, INPUTS, LR, _die, arm_model_kills, init_cell, sample
from support.fork import cells_main, parse_cell

DECAY = 0.01
AFTER = 2  # ZeRO steps after the Join, on the survivors
POINTS = ("body", "beat", "step", "drain", "post", "entry")
#: The cell options that pick ZeRO's optimizer (default: SGD without momentum).
OPTIMIZERS = ("sgd", "adam", "momentum")
MOMENTUM = 0.9
BETAS = (0.9, 0.999)
EPS = 1e-8


def options(option: str) -> tuple[str, bool]:
    """A cell's ``OPTION`` (comma-separated): ZeRO's optimizer, and whether on_rank_loss='raise'."""
    names = set(filter(None, option.split(",")))
    chosen = [name for name in OPTIMIZERS if name in names]
    assert names <= {*OPTIMIZERS, "raise"} and len(chosen) <= 1, option
    return (chosen[0] if chosen else "sgd"), "raise" in names


def parse(cell: str) -> tuple[int, list[tuple[int, str, int]], str]:
    return parse_cell(cell, POINTS)


#: float32's machine epsilon: the spacing of float32 numbers at 1.
FLOAT32_EPS = float(np.finfo(np.float32).eps)


def reference(init: list[float], world: int, consumed: dict[int, int],
              after: Sequence[int] = (), optimizer: str = "sgd",
              ) -> tuple[np.ndarray, np.ndarray, dict[str, Any], dict[str, Any],
                         dict[str, Any], dict[str, Any]]:
    """The single-process run (float64) over exactly the consumed inputs, then the later steps.

    torch's single-tensor ``SGD`` (``momentum`` 0 or ``MOMENTUM``) or ``Adam``
    (``BETAS``, ``EPS``), each with ``weight_decay=DECAY``, written out in NumPy.

    With it, how far a float32 run's ``momentum_buffer`` may lie from it (the
    *bound*): each step rounds each term it adds to the buffer (every rank's
    gradient over the world, the decay term, the decayed buffer) and the new
    buffer once, each within float32's epsilon of its magnitude, in whatever
    order the ranks' reduction sums them; the buffer keeps those errors, so the
    bound of an element is ``FLOAT32_EPS`` times the sum, over every step so far,
    of those magnitudes. (Checked against float32 NumPy runs of the cells'
    shapes, both summation orders, 600 random inits: the error stayed under 0.43
    of this bound.) Two float32 runs lie within twice the bound of each other.

    Args:
        init: the initial parameters, weight then bias.
        world: the initial world size (the Join's divisor).
        consumed: rank -> how many of its inputs were consumed (its first ones).
        after: the survivors, which take ``AFTER`` steps after the Join
            (dividing by their number, DDP's group size then).
        optimizer: one of ``OPTIMIZERS``.

    Returns:
        The parameters at the Join's exit and after the later steps, the
        optimizer state at both (``state_of``'s layout), and the bound of that
        state at both (``momentum_buffer`` only; empty for the others).
    """
    p = np.array(init, dtype=np.float64)
    state: dict[str, Any] = {}
    rounded = np.zeros_like(p)  # the sum of the magnitudes the buffer's steps rounded

    def step(grads: list[np.ndarray], divisor: int) -> None:
        g = sum(grads, np.zeros_like(p)) / divisor + DECAY * p
        if optimizer == "sgd":
            p[:] = p - LR * g
        elif optimizer == "momentum":
            old = state.get("momentum_buffer", np.zeros_like(p))
            buf = g.copy() if "momentum_buffer" not in state else MOMENTUM * old + g
            rounded[:] += (sum(np.abs(grad) for grad in grads) / divisor + DECAY * np.abs(p)
                           + MOMENTUM * np.abs(old) + np.abs(buf))
            state["momentum_buffer"] = buf
            p[:] = p - LR * buf
        else:
            t = state.get("step", 0.0) + 1.0
            m = BETAS[0] * state.get("exp_avg", 0.0) + (1 - BETAS[0]) * g
            v = BETAS[1] * state.get("exp_avg_sq", 0.0) + (1 - BETAS[1]) * g * g
            state.update(step=t, exp_avg=m, exp_avg_sq=v)
            denom = np.sqrt(v) / np.sqrt(1 - BETAS[1] ** t) + EPS
            p[:] = p - (LR / (1 - BETAS[0] ** t)) * m / denom

    def grad_of(rank: int, index: int) -> np.ndarray:
        x, y = sample(rank, index)
        xb = np.concatenate([x, [1.0]])
        return 2.0 * (p @ xb - y) * xb

    def snapshot() -> dict[str, Any]:
        return {k: (v.tolist() if isinstance(v, np.ndarray) else [v] * len(p))
                for k, v in state.items()}

    def bound() -> dict[str, Any]:
        return {"momentum_buffer": (FLOAT32_EPS * rounded).tolist()} if (
            "momentum_buffer" in state) else {}

    for t in range(max(consumed.values(), default=0)):
        step([grad_of(r, t) for r, n in consumed.items() if t < n], world)
    at_exit, state_at_exit, bound_at_exit = p.copy(), snapshot(), bound()
    for k in range(AFTER):
        step([grad_of(r, 100 + k) for r in after], len(after))
    return at_exit, p, state_at_exit, snapshot(), bound_at_exit, bound()


def optimizer_of(optimizer: str, params: Any) -> Any:
    """The cell's optimizer (``OPTIMIZERS``) over ``params``, without ZeRO."""
    import torch

    if optimizer == "adam":
        return torch.optim.Adam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)
    momentum = MOMENTUM if optimizer == "momentum" else 0.0
    return torch.optim.SGD(params, lr=LR, momentum=momentum, weight_decay=DECAY)


def make_zero(params: Any, optimizer: str, **kwargs: Any) -> Any:
    """``ZeroRedundancyOptimizer`` over ``params`` with the cell's optimizer (``OPTIMIZERS``)."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if optimizer == "adam":
        return ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=LR, betas=BETAS,
                                       eps=EPS, weight_decay=DECAY, **kwargs)
    momentum = MOMENTUM if optimizer == "momentum" else 0.0
    return ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=LR, momentum=momentum,
                                   weight_decay=DECAY, **kwargs)


def state_of(zero: Any, model: Any) -> dict[str, dict[str, float]]:
    """This rank's shard of ZeRO's optimizer state: element of ``Split.flat()`` -> key -> value.

    A scalar entry (Adam's ``step``) is given for every element of its parameter.
    """
    import torch

    offsets, start = {}, 0
    for param in model.parameters():
        offsets[id(param)] = start
        start += param.numel()
    out: dict[str, dict[str, float]] = {}
    for group in zero.optim.param_groups:
        for param in group["params"]:
            for key, value in zero.optim.state.get(param, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                values = value.detach().reshape(-1).tolist()
                if len(values) == 1 and param.numel() > 1:
                    values = values * param.numel()
                for i, v in enumerate(values):
                    out.setdefault(str(offsets[id(param)] + i), {})[key] = float(v)
    return out


def _split() -> Any:
    import torch

    class Split(torch.nn.Module):
        """``Linear(4, 1)`` with its weight in three parameters (1, 1 and 2 columns)."""

        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.randn(1, 1))
            self.b = torch.nn.Parameter(torch.randn(1, 1))
            self.c = torch.nn.Parameter(torch.randn(2, 1))
            self.bias = torch.nn.Parameter(torch.randn(1))

        def forward(self, x: Any) -> Any:
            return x[:, :1] @ self.a + x[:, 1:2] @ self.b + x[:, 2:] @ self.c + self.bias

        def flat(self) -> list[float]:
            return torch.cat([self.a.detach().reshape(-1), self.b.detach().reshape(-1),
                              self.c.detach().reshape(-1), self.bias.detach()]).tolist()

    return Split()


def _iterate(model: Any, zero: Any, rank: int, index: int) -> None:
    import torch

    x, y = sample(rank, index)
    pred = model(torch.tensor(x, dtype=torch.float32).reshape(1, DIM))
    ((pred - y) ** 2).sum().backward()
    zero.step()
    zero.zero_grad()


def run_rank(rank: int, world: int, kills: list[tuple[int, str, int]], option: str,
             port: int, cell: int, out: Path) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from joinkit import Join

    path = out / f"cell{cell}-rank{rank}.json"
    mine = {point: at for r, point, at in kills if r == rank}
    init_cell(rank, world, port, cell)
    torch.manual_seed(0)
    model = DDP(_split())
    optimizer, raising = options(option)
    zero = make_zero(model.parameters(), optimizer)
    init = model.module.flat()
    owned = sum(p.numel() for g in zero.optim.param_groups for p in g["params"])
    arm_model_kills(mine, path)
    mode = "raise" if raising else "finish"
    if any(point == "entry" for _, point, _ in kills):
        entry_cell(model, zero, rank, mine, path)
        return
    times: list[float] = []  # when each of this rank's iterations completed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Join([model, zero], on_rank_loss=mode, store_outlives_ranks=True) as join:
            for index in range(INPUTS + rank):
                if mine.get("body") == index:
                    _die(path)
                x, y = sample(rank, index)
                pred = model(torch.tensor(x, dtype=torch.float32).reshape(1, DIM))
                if mine.get("beat") == index:
                    _die(path)
                ((pred - y) ** 2).sum().backward()
                if mine.get("step") == index:
                    _die(path)
                zero.step()
                zero.zero_grad()
                times.append(time.time())
    at_exit = model.module.flat()
    state_at_exit = state_of(zero, model)
    shadowing = "_sync_params" in zero.__dict__ or zero.optim is None
    # ZeRO over the survivors: its own broadcasts on the new group, outside any
    # Join, then in a later (default-mode) Join over the rebuilt group.
    for k in range(AFTER - 1):
        _iterate(model, zero, rank, 100 + k)
    with Join([model, zero]):
        _iterate(model, zero, rank, 100 + AFTER - 1)
    lost = [{"rank": x.rank, "iterations": x.iterations, "survivors": list(x.survivors)}
            for x in join.report.lost_ranks]
    path.write_text(json.dumps({
        "rank": rank, "init": init, "at_exit": at_exit, "final": model.module.flat(),
        "optimizer": optimizer, "state_at_exit": state_at_exit,
        "state_final": state_of(zero, model),
        "lost": lost, "zero_world": zero.world_size, "zero_rank": zero.rank,
        "zero_group": zero.process_group.size(), "same_group": zero.process_group is
        model.process_group, "owned_before": owned,
        "owned_after": sum(p.numel() for g in zero.optim.param_groups for p in g["params"]),
        "left_patched": shadowing, "times": times,
        "warnings": [str(w.message) for w in caught if "joinkit" in str(w.message)],
    }))


def entry_cell(model: Any, zero: Any, rank: int, mine: dict[str, int], path: Path) -> None:
    """A rank dies at the Join's entry, before it hands over its shard of the state.

    One ZeRO step first (every shard has state); the dying rank is SIGKILLed
    as it would gather the shards. The survivors' Join must refuse to start,
    each with the same ``LocalProtocolError``, and leave ZeRO as it was.
    """
    from joinkit import Join
    from joinkit.adapters.torch import _zero_elastic

    _iterate(model, zero, rank, 50)
    if "entry" in mine:
        def gather(self: Any, params: Any) -> Any:
            _die(path)

        _zero_elastic.ElasticZeRO._gather = gather  # type: ignore[method-assign]
    shard = zero.optim
    try:
        with Join([model, zero], on_rank_loss="finish", store_outlives_ranks=True):
            error = "(entered)"
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
    path.write_text(json.dumps({
        "rank": rank, "entry_error": error, "shard_back": zero.optim is shard,
        "left_patched": "_sync_params" in zero.__dict__,
        "state_kept": bool(shard.state), "ddp_group": model.process_group.size()}))


def run_refusals(rank: int, world: int, port: int, cell: int, out: Path) -> None:
    """Each refused configuration, on every rank; then a Join that works (no mismatch)."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from joinkit import Join

    init_cell(rank, world, port, cell)
    torch.manual_seed(0)
    model = DDP(_split())

    def zero(cls: Any = torch.optim.SGD, params: Any = None, **kwargs: Any) -> Any:
        return ZeroRedundancyOptimizer(model.parameters() if params is None else params,
                                       cls, lr=LR, **kwargs)

    cases = {
        "overlap": lambda: [model, zero(overlap_with_ddp=True)],
        "bucket_view": lambda: [model, zero(parameters_as_bucket_view=True)],
        "foreign": lambda: [model, zero(params=torch.nn.Linear(2, 1).parameters())],
        "alone": lambda: [zero(torch.optim.Adam)],
        "three": lambda: [model, zero(), zero()],
    }
    found: dict[str, Any] = {}
    for name, make in cases.items():
        joinables = make()
        try:
            with Join(joinables, on_rank_loss="finish", store_outlives_ranks=True):
                pass
        except ValueError as exc:
            found[name] = str(exc)
        else:
            found[name] = "(not refused)"
    # Refused before DDP registered its comm hook (DDP allows one, for good).
    found["hooked_by_refusals"] = bool(getattr(model, "_comm_hooks", None))
    # The group still matches: a Join that works, uneven inputs, momentum
    # switched on inside it (the state is replicated: nothing to refuse).
    # A scheduler stepped on every rank alike reaches the optimizer that steps
    # every parameter during the Join (ZeRO syncs the hyper-parameters into it).
    optimizer = zero()
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    with Join([model, optimizer], on_rank_loss="finish", store_outlives_ranks=True):
        optimizer.param_groups[0]["momentum"] = 0.9
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
            scheduler.step()
        for index in range(1 + rank):
            _iterate(model, optimizer, rank, index)
        inside = optimizer.optim.param_groups[0]
        found["inside"] = {"lr": inside["lr"], "momentum": inside["momentum"],
                           "params": len(inside["params"])}
    found["shard_state"] = len(optimizer.optim.state)
    (out / f"cell{cell}-rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "refusals": found, "after": "ok", "params": model.module.flat(),
         "owned_params": sum(len(g["params"]) for g in optimizer.optim.param_groups)}))


def main() -> None:
    cells_main(__file__, parse, run_rank, run_refusals)


if __name__ == "__main__":
    main()
