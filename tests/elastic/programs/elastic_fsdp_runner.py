"""Run elastic FSDP2 kill cells on gloo: ranks forked from a parent that hosts the store.

Theory of operation
-------------------
``python elastic_fsdp_runner.py --out DIR CELL [CELL ...]`` (the command
line of ``elastic_fork.cells_main``): for each ``CELL`` the parent forks its
ranks, which build a gloo group over the parent's store
(``elastic_ddp_runner.init_cell``), a 1-D CPU ``DeviceMesh`` over it and a
2-layer MLP (``Linear(4, 8)``, tanh, ``Linear(8, 1)``) with ``fully_shard`` on
each layer and on the root, and train it with ``SGD(lr=0.05,
weight_decay=0.01)`` (momentum 0) in ONE ``Join([model, optimizer],
on_rank_loss="finish")``: rank ``r`` has ``INPUTS + r`` inputs
(``elastic_ddp_runner.sample``), one per iteration (forward, squared error,
backward, step, zero_grad). After the Join every survivor takes ``AFTER``
more steps with plain FSDP (no Join) over the survivors: FSDP's own
all-gathers and reduce-scatters on the rebuilt group.

A ``CELL`` is ``W:KILLS[~OPTION]``, ``KILLS`` a ``+``-joined list of
``rank/point/at``: ``body`` (in the loop body before input ``at``'s forward),
``beat`` (after input ``at``'s forward, whose heartbeat went out, before its
backward's gradient unit), ``step`` (after input ``at``'s gradient unit,
before the optimizer's step), ``drain`` (in the joined rank's shadow round
``at``), ``post`` (in the post hook) or ``entry`` (in the entry's
optimizer-state unit: every survivor's Join raises, recorded as
``entry_error``); ``OPTION`` a ``.``-joined set of ``raise`` (the default
``on_rank_loss``: joinkit's FSDP replay), ``count``
(``divide_by_initial_world_size=False``), ``accum`` (two forwards and
backwards per input, accumulated before the step), ``adam`` or ``momentum``
(the optimizer: ``Adam`` or ``SGD(momentum=0.9)``, with one zero-gradient step
before the Join so that it starts from sharded state; also recorded: the
full optimizer state after the Join and after the plain steps). ``W:refusals`` runs the refused
configurations. Each rank writes ``DIR/cell{C}-rank{R}.json``: the initial
full parameters, the full parameters right after the Join and after the
steps that follow, the report's lost ranks, the mesh size after. The
reference is :func:`reference`.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from elastic_ddp_runner import DIM, INPUTS, _die, init_cell, sample
from support.fork import cells_main, parse_cell
from support.refusals import fsdp_refusal

LR = 0.05
WEIGHT_DECAY = 0.01
HIDDEN = 8
AFTER = 2  # plain FSDP steps after the Join, on every survivor
LATER = 1  # then a default-mode Join over the survivors: LATER inputs each, one more on
#            the lowest survivor; then a finish-mode Join, one input each
POINTS = ("body", "beat", "step", "drain", "post", "entry")


def parse(cell: str) -> tuple[int, list[tuple[int, str, int]], str]:
    return parse_cell(cell, POINTS)


def _mlp() -> Any:
    import torch

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Linear(DIM, HIDDEN)
            self.second = torch.nn.Linear(HIDDEN, 1)

        def forward(self, x: Any) -> Any:
            return self.second(torch.tanh(self.first(x)))

    return MLP()


def _loss(model: Any, rank: int, index: int, dtype: Any) -> Any:
    import torch

    x, y = sample(rank, index)
    pred = model(torch.tensor(x, dtype=dtype).reshape(1, DIM))
    return ((pred - y) ** 2).sum()


def reference(init: list[list[float]], world: int, consumed: dict[int, int],
              after: list[int], divide_by_initial_world_size: bool = True,
              repeat: int = 1, optim: str = "sgd", states: list[Any] | None = None,
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The single-process run (float64) over exactly the consumed inputs, then ``AFTER``.

    Args:
        init: the initial full parameters, in ``model.parameters()`` order.
        world: the initial world size (the Join's divisor by default).
        consumed: rank -> how many of its inputs were consumed (its first ones).
        after: the survivors, who then take ``AFTER`` plain FSDP steps (inputs
            ``INPUTS + rank + k``), divided by their number.
        divide_by_initial_world_size: else the Join divides by the ranks that
            contributed.
        repeat: backward passes per input in the Join (``~accum``: 2, accumulated).
        optim: ``"sgd"``, ``"adam"`` or ``"momentum"`` (:func:`make_optimizer`,
            torch's own optimizer over the float64 model).
        states: if a list, the optimizer state (:func:`state_of`) at the Join's
            exit and after the plain steps are appended to it.

    Returns:
        The flat parameters at the Join's exit, after the plain steps that
        follow, after the later default-mode Join (``LATER`` inputs per
        survivor, one more on the lowest), and after a later finish-mode Join
        (one input per survivor).
    """
    import torch

    model = _mlp().double()
    with torch.no_grad():
        for param, values in zip(model.parameters(), init, strict=True):
            param.copy_(torch.tensor(values, dtype=torch.float64).reshape(param.shape))

    optimizer = make_optimizer(model, optim)
    if optim != "sgd":  # the runner's step before the Join, zero gradients
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()

    def step(items: list[tuple[int, int]], divisor: float, repeat: int = 1) -> None:
        optimizer.zero_grad()
        for rank, index in items:
            for _ in range(repeat):
                _loss(model, rank, index, torch.float64).backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.grad /= divisor
        optimizer.step()

    def flat() -> np.ndarray:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()

    for t in range(max(consumed.values(), default=0)):
        active = [r for r, n in consumed.items() if t < n]
        step([(r, t) for r in active],
             float(world if divide_by_initial_world_size else len(active)), repeat)
    at_exit = flat()
    if states is not None:
        states.append(state_of(model, optimizer))
    for k in range(AFTER):
        step([(r, INPUTS + r + k) for r in after], float(len(after)))
    plain = flat()
    if states is not None:
        states.append(state_of(model, optimizer))
    for k in range(LATER + 1):
        active = [r for r in after if k < LATER + (r == min(after))]
        step([(r, INPUTS + r + AFTER + k) for r in active], float(len(after)))
    later = flat()
    step([(r, INPUTS + r + AFTER + LATER + 1) for r in after], float(len(after)))
    return at_exit, plain, later, flat()


def arm_fsdp_kills(mine: dict[str, int], path: Path) -> None:
    """Make this rank die at its ``"drain"`` shadow round or in its ``"post"`` hook."""
    from joinkit.adapters.torch import _fsdp_elastic

    if "drain" in mine:
        original = _fsdp_elastic.ElasticFSDP.shadow
        rounds = [0]

        def shadow(self: Any) -> None:
            if rounds[0] == mine["drain"]:
                _die(path)
            rounds[0] += 1
            original(self)

        _fsdp_elastic.ElasticFSDP.shadow = shadow  # type: ignore[method-assign]
    if "entry" in mine:  # in the entry's optimizer-state unit, before sending its part
        def gather_state(self: Any) -> None:
            _die(path)

        _fsdp_elastic.ElasticFSDP._gather_state = gather_state  # type: ignore[method-assign]
    if "post" in mine:
        def sync_final_model(self: Any, is_last_joiner: bool) -> None:
            _die(path)

        _fsdp_elastic.ElasticFSDP.sync_final_model = sync_final_model  # type: ignore[method-assign]


def make_optimizer(model: Any, optim: str) -> Any:
    """``SGD(lr, weight_decay)`` (``"sgd"``), with ``momentum=0.9`` (``"momentum"``), or
    ``Adam(lr, weight_decay)`` (``"adam"``)."""
    import torch

    if optim == "adam":
        return torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    momentum = 0.9 if optim == "momentum" else 0.0
    return torch.optim.SGD(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                           momentum=momentum)


def state_of(model: Any, optimizer: Any) -> list[list[float]]:
    """The optimizer's state, full: per parameter, its entries by sorted key, flat.

    A DTensor entry is gathered (``full_tensor``: an all-gather on FSDP's group).
    """
    from torch.distributed.tensor import DTensor

    out = []
    for param in model.parameters():
        entries = optimizer.state.get(param, {})
        values: list[float] = []
        for key in sorted(entries):
            value = entries[key]
            if isinstance(value, DTensor):
                value = value.full_tensor()
            values += [float(v) for v in value.detach().reshape(-1).tolist()]
        out.append(values)
    return out


def build(world: int, optim: str = "sgd") -> tuple[Any, Any]:
    """The FSDP2 MLP over a 1-D CPU mesh of the default group, and its optimizer."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = _mlp()
    fully_shard(model.first, mesh=mesh)
    fully_shard(model.second, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, make_optimizer(model, optim)


def full_parameters(model: Any) -> list[list[float]]:
    """Every parameter, gathered (an all-gather on FSDP's current group)."""
    return [p.full_tensor().detach().reshape(-1).tolist() for p in model.parameters()]


def run_rank(rank: int, world: int, kills: list[tuple[int, str, int]], option: str,
             port: int, cell: int, out: Path) -> None:
    import torch

    from joinkit import Join

    path = out / f"cell{cell}-rank{rank}.json"
    mine = {point: at for r, point, at in kills if r == rank}
    init_cell(rank, world, port, cell)
    options = set(option.split("."))
    optim = "adam" if "adam" in options else "momentum" if "momentum" in options else "sgd"
    model, optimizer = build(world, optim)
    init = full_parameters(model)
    if optim != "sgd":  # a step (zero gradients) before the Join: sharded state at entry
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()
        optimizer.zero_grad()
    mode = "raise" if "raise" in options else "finish"
    kwargs = {"divide_by_initial_world_size": False} if "count" in options else {}
    if fsdp_refusal() is not None:  # this torch refuses FSDP2 over gloo: the test checks
        record_refusal(path, rank, lambda: Join([model, optimizer], on_rank_loss=mode,
                                                store_outlives_ranks=True, **kwargs))
        return
    arm_fsdp_kills(mine, path)
    times: list[float] = []
    if any(point == "entry" for _, point, _ in kills):
        try:  # every survivor: a clear error before the loop, no hang
            with Join([model, optimizer], on_rank_loss=mode, store_outlives_ranks=True):
                times.append(time.time())
        except Exception as exc:  # noqa: BLE001 - recorded and checked by the test
            path.write_text(json.dumps({"rank": rank, "entry_error":
                                        f"{type(exc).__name__}: {exc}", "looped": times}))
            return
        path.write_text(json.dumps({"rank": rank, "entry_error": "(not raised)"}))
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Join([model, optimizer], on_rank_loss=mode, store_outlives_ranks=True,
                  **kwargs) as join:
            for index in range(INPUTS + rank):
                if mine.get("body") == index:
                    _die(path)
                x, y = sample(rank, index)
                pred = model(torch.tensor(x, dtype=torch.float32).reshape(1, DIM))
                if mine.get("beat") == index:
                    _die(path)
                ((pred - y) ** 2).sum().backward()
                if "accum" in options:  # a second forward and backward, accumulated
                    _loss(model, rank, index, torch.float32).backward()
                if mine.get("step") == index:
                    _die(path)
                optimizer.step()
                optimizer.zero_grad()
                times.append(time.time())
    final = full_parameters(model)
    state_final = state_of(model, optimizer)
    same = all(a is b for a, b in zip(optimizer.param_groups[0]["params"],
                                      model.parameters(), strict=True))
    # Plain FSDP over the survivors: its all-gathers and reduce-scatters.
    for k in range(AFTER):
        _loss(model, rank, INPUTS + rank + k, torch.float32).backward()
        optimizer.step()
        optimizer.zero_grad()
    after = full_parameters(model)
    state_after = state_of(model, optimizer)
    size = model.first.weight.device_mesh.size()
    # A later default-mode Join over the survivors (joinkit's FSDP replay on the
    # new group), uneven: the lowest survivor has one input more.
    lowest = min(r for r in range(world) if r not in {k for k, _, _ in kills})
    with Join([model, optimizer]):
        for k in range(LATER + (rank == lowest)):
            _loss(model, rank, INPUTS + rank + AFTER + k, torch.float32).backward()
            optimizer.step()
            optimizer.zero_grad()
    later = full_parameters(model)
    # And a later finish-mode Join over the survivors (no death): one input each.
    with Join([model, optimizer], on_rank_loss="finish", store_outlives_ranks=True):
        _loss(model, rank, INPUTS + rank + AFTER + LATER + 1, torch.float32).backward()
        optimizer.step()
        optimizer.zero_grad()
    again = full_parameters(model)
    lost = [{"rank": x.rank, "iterations": x.iterations, "survivors": list(x.survivors)}
            for x in join.report.lost_ranks]
    path.write_text(json.dumps({
        "rank": rank, "init": init, "final": final, "after": after, "later": later,
        "again": again, "state_final": state_final, "state_after": state_after,
        "lost": lost,
        "size_after": size, "same_objects": same, "times": times, "ended": time.time(),
        "warnings": [str(w.message) for w in caught if "joinkit" in str(w.message)],
    }))


def record_refusal(path: Path, rank: int, join: Any) -> None:
    """Enter ``join()`` where this torch refuses FSDP2 over gloo; record its refusal."""
    from joinkit.adapters import UnsupportedTorchError

    try:
        with join():
            refused = "(not refused)"
    except UnsupportedTorchError as exc:
        refused = str(exc)
    path.write_text(json.dumps({"rank": rank, "refused": refused}))


def run_refusals(rank: int, world: int, port: int, cell: int, out: Path) -> None:
    """Each refused configuration, on every rank; then a Join that works (no mismatch)."""
    import torch

    from joinkit import Join

    init_cell(rank, world, port, cell)
    model, optimizer = build(world)
    if fsdp_refusal() is not None:  # this torch refuses FSDP2 over gloo: the test checks
        record_refusal(out / f"cell{cell}-rank{rank}.json", rank, lambda: Join(
            [model, optimizer], on_rank_loss="finish", store_outlives_ranks=True))
        return
    # An optimizer state entry that is neither sharded like its parameter nor a scalar.
    odd = torch.optim.SGD(model.parameters(), lr=LR)
    odd.state[model.first.weight]["odd"] = torch.zeros(3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    found: dict[str, str] = {}

    def attempt(name: str, joinables: list[Any]) -> None:
        try:
            with Join(joinables, on_rank_loss="finish", store_outlives_ranks=True):
                pass
        except ValueError as exc:
            found[name] = str(exc)
        else:
            found[name] = "(not refused)"

    if world % 2 == 0:  # HSDP: a 2-D mesh (replicate, shard)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        hsdp = _mlp()
        fully_shard(hsdp, mesh=init_device_mesh("cpu", (2, world // 2),
                                                mesh_dim_names=("replicate", "shard")))
        attempt("hsdp", [hsdp, torch.optim.SGD(hsdp.parameters(), lr=LR)])
    attempt("odd_state", [model, odd])
    # Optimizer state on rank 0 only (one Adam step of zero gradients there): the
    # ranks' entry units would differ in size; refused on every rank instead, and
    # FSDP is left as it was: a plain step after it reduces gradients again.
    adam = torch.optim.Adam(model.parameters(), lr=LR)
    if rank == 0:
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        adam.step()
        adam.zero_grad()
    attempt("uneven_state", [model, adam])
    found["before_uneven_state"] = json.dumps(full_parameters(model))
    _loss(model, rank, 0, torch.float32).backward()  # uneven data: reduced, or not
    optimizer.step()
    optimizer.zero_grad()
    found["after_uneven_state"] = json.dumps(full_parameters(model))
    attempt("scheduler", [model, optimizer, scheduler])
    # Gradients held at entry (on rank 0 only): refused on every rank.
    if rank == 0:
        first = next(iter(model.parameters()))
        first.grad = torch.zeros_like(first)
    attempt("gradients", [model, optimizer])
    optimizer.zero_grad()
    model.set_requires_gradient_sync(False)
    attempt("no_sync", [model, optimizer])
    model.set_requires_gradient_sync(True)
    # The group still matches: a Join that works, uneven, with forward-only inputs.
    with Join([model, optimizer], on_rank_loss="finish", store_outlives_ranks=True):
        for index in range(2 + rank):
            if index % 2 == 0:
                with torch.no_grad():
                    model(torch.ones(1, DIM))
                continue
            _loss(model, rank, index, torch.float32).backward()
            optimizer.step()
            optimizer.zero_grad()
    params = [p for values in full_parameters(model) for p in values]
    # A forward with gradients and no backward (an evaluation without no_grad), on
    # every rank as its last input: each raises, no collective mismatched.
    try:
        with Join([model, optimizer], on_rank_loss="finish", store_outlives_ranks=True):
            for index in range(1 + rank):
                loss = _loss(model, rank, index, torch.float32)
                if index < rank:
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
    except Exception as exc:  # noqa: BLE001 - recorded and checked by the test
        found["no_backward"] = f"{type(exc).__name__}: {exc}"
    else:
        found["no_backward"] = "(not raised)"
    # An error is not a death: rank 1 raises between a forward and its backward.
    try:
        with Join([model, optimizer], on_rank_loss="finish", store_outlives_ranks=True):
            for index in range(3 + rank):
                loss = _loss(model, rank, index, torch.float32)
                if rank == 1 and index == 1:
                    raise KeyError("raised between a forward and its backward")
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    except Exception as exc:  # noqa: BLE001 - recorded and checked by the test
        found["raised"] = f"{type(exc).__name__}: {exc}"
    else:
        found["raised"] = "(not raised)"
    (out / f"cell{cell}-rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "refusals": found, "after": "ok", "params": params}))


def main() -> None:
    cells_main(__file__, parse, run_rank, run_refusals)


if __name__ == "__main__":
    main()
