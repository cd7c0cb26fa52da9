"""What an exact epoch must consume, worked out independently of ``ShardSampler``'s code.

The tests of resume and take-over (``test_resume.py``) compare what the
ranks really trained on with this module's plan, which follows the rules as
docs/resume.md states them, and compare their parameters with a float64
single-process run over exactly that plan (:func:`reference`):

- an epoch's order is ``torch.randperm(n)`` from a generator seeded with
  ``seed + epoch``; a pass divides its *pending* positions of that order over
  its *members*: member ``i`` of ``W`` reads ``pending[i::W]``, a batch of
  ``b`` per iteration;
- a survivor consumes its whole share (or, when every rank stops after ``K``
  iterations, its first ``K`` batches); a lost rank its first ``c`` batches,
  ``c`` the iterations it completed: killed in the loop body or between its
  forward (the heartbeat) and its backward at input ``t``: ``t``; between its
  backward (the gradient all-reduce) and its step: ``t + 1``; while draining
  (it had joined): all of them;
- what a lost rank left is the next pass's (``take_over=True``), divided
  over the survivors; a resume divides what the state left over the new world.

Each iteration of the reference is a divisor (the world size when its Join
was entered: DDP divides by it) and the batches of the ranks that took part.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DIM = 4
LR = 0.05


def sample(index: int) -> tuple[np.ndarray, float]:
    """Sample ``index`` of the dataset: a deterministic (x, y)."""
    rng = np.random.default_rng(10_000 + index)
    x = rng.standard_normal(DIM)
    return x, float(x.sum() * 0.5 + rng.standard_normal() * 0.1)


def order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's order (DistributedSampler's permutation)."""
    import torch

    if not shuffle:
        return np.arange(n)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator).numpy()


@dataclass
class Pass:
    """One pass: who read what, and what each consumed."""

    members: list[int]
    shares: dict[int, list[int]]  # member -> dataset ids, in order
    consumed: dict[int, int]  # member -> batches consumed
    batch: int
    divisor: int

    def batches(self, member: int) -> list[list[int]]:
        share = self.shares[member]
        return [share[i:i + self.batch] for i in range(0, len(share), self.batch)]

    def consumed_ids(self, member: int) -> list[int]:
        return [i for batch in self.batches(member)[: self.consumed[member]] for i in batch]

    def iterations(self) -> list[tuple[int, list[list[int]]]]:
        """(divisor, the batches that took part) per iteration of the pass."""
        rounds = max((self.consumed[m] for m in self.members), default=0)
        out = []
        for t in range(rounds):
            parts = [self.batches(m)[t] for m in self.members if t < self.consumed[m]]
            out.append((self.divisor, parts))
        return out


@dataclass
class Epoch:
    passes: list[Pass] = field(default_factory=list)


def completed(point: str, at: int, batches: int) -> int:
    """The iterations a rank killed at ``point`` of input ``at`` completed."""
    if point in ("body", "beat"):
        return min(at, batches)
    if point == "step":
        return min(at + 1, batches)
    if point == "drain":
        return batches
    raise ValueError(point)


def take_over_epoch(n: int, seed: int, epoch: int, batch: int, members: list[int],
                    kills: dict[int, tuple[str, int]], pending: np.ndarray | None = None
                    ) -> tuple[Epoch, list[int]]:
    """One epoch with ``take_over=True``: the kills in its first pass, then the
    survivors' pass over what the dead left. Returns the epoch and the survivors."""
    perm = order(n, seed, epoch)
    pending = np.arange(n) if pending is None else pending
    result = Epoch()
    first = True
    while True:
        world = len(members)
        shares = {m: pending[i::world] for i, m in enumerate(members)}
        nb = {m: -(-len(shares[m]) // batch) for m in members}
        consumed = dict(nb)
        if first:
            for rank, (point, at) in kills.items():
                consumed[rank] = completed(point, at, nb[rank])
        result.passes.append(Pass(members=list(members),
                                  shares={m: perm[s].tolist() for m, s in shares.items()},
                                  consumed=consumed, batch=batch, divisor=world))
        left = []
        for m in members:
            left += shares[m][consumed[m] * batch:].tolist()
        dead = set(kills) if first else set()
        first = False
        members = [m for m in members if m not in dead]
        if not left:
            return result, members
        pending = np.array(sorted(left))


def resume_epoch(n: int, seed: int, epoch: int, batch: int, before: int, after: int,
                 stop: int) -> Epoch:
    """An epoch run for ``stop`` iterations on ``before`` ranks, then resumed on
    ``after`` ranks to its end."""
    perm = order(n, seed, epoch)
    pending = np.arange(n)
    result = Epoch()
    shares = {m: pending[m::before] for m in range(before)}
    nb = {m: -(-len(shares[m]) // batch) for m in range(before)}
    consumed = {m: min(stop, nb[m]) for m in range(before)}
    result.passes.append(Pass(members=list(range(before)),
                              shares={m: perm[s].tolist() for m, s in shares.items()},
                              consumed=consumed, batch=batch, divisor=before))
    left = sorted(p for m in range(before) for p in shares[m][consumed[m] * batch:].tolist())
    pending = np.array(left, dtype=np.int64)
    shares = {m: pending[m::after] for m in range(after)}
    result.passes.append(Pass(members=list(range(after)),
                              shares={m: perm[s].tolist() for m, s in shares.items()},
                              consumed={m: -(-len(shares[m]) // batch) for m in range(after)},
                              batch=batch, divisor=after))
    return result


def all_consumed(epoch: Epoch) -> list[int]:
    """Every id the epoch consumed, over its passes (with repeats, if any)."""
    return [i for p in epoch.passes for m in p.members for i in p.consumed_ids(m)]


def reference(init: list[float], iterations: list[tuple[int, list[list[int]]]],
              lr: float = LR) -> np.ndarray:
    """float64 SGD on ``Linear(DIM, 1)`` with MSE (mean over a batch), DDP's way:
    each iteration the sum of the batches' gradients over the divisor."""
    p = np.array(init, dtype=np.float64)  # weight then bias
    for divisor, batches in iterations:
        grad = np.zeros_like(p)
        for ids in batches:
            g = np.zeros_like(p)
            for i in ids:
                x, y = sample(i)
                xb = np.concatenate([x, [1.0]])
                g += 2.0 * (p @ xb - y) * xb
            grad += g / len(ids)
        p = p - lr * grad / divisor
    return p


# -- the checks the resume and take-over tests share (test_resume.py,
# tests/elastic/test_joinkit_run.py) ------------------------------------------------


def record_error(spec: str, error: float) -> None:
    """Append a cell's largest error to ``$JOINKIT_EXACT_RECORD`` (JSON lines), if set."""
    path = os.environ.get("JOINKIT_EXACT_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"cell": spec, "max_abs_error": error}) + "\n")


def check_take_over(out: Path, cell: int, spec: str, ranks: dict[int, Any]) -> float:
    """Every survivor of a take-over cell: exactly once, the plan, the reference."""
    import exact_runner as runner

    s = runner.parse(spec)
    members = list(range(s["world"]))
    iterations: list[Any] = []
    consumed: list[int] = []
    for number, kills in enumerate(s["epochs"]):
        epoch, survivors = take_over_epoch(s["n"], runner.SEED, number, runner.BATCH,
                                                members, kills)
        for rank in survivors:
            if rank not in ranks:
                continue  # it died in a later epoch
            got = ranks[rank]["epochs"][number]
            assert len(got["passes"]) == len(epoch.passes), (spec, rank, number)
            for seen, want in zip(got["passes"], epoch.passes, strict=True):
                assert [i for b in seen["trained"] for i in b] == want.consumed_ids(rank), \
                    (spec, rank, number)
            assert got["world"] == survivors
            assert got["state"]["remaining"] == []
            # The report numbers ranks as its Join's group does: DDP runs on a group
            # rebuilt over the epoch's members (numbered 0, 1, ... in their order).
            lost = {members[r]: c for r, c, _ in got["passes"][0]["lost"]}
            assert lost == {r: epoch.passes[0].consumed[r] for r in kills}, (spec, lost)
            takes = got["take_overs"]
            assert [t["rank"] for t in takes] == ([] if len(epoch.passes) == 1 else
                                                  sorted(kills))
            for take in takes:
                assert take["consumed"] == epoch.passes[0].consumed_ids(take["rank"])
        ids = all_consumed(epoch)
        assert sorted(ids) == list(range(s["n"])), (spec, number)  # exactly once
        consumed += ids
        iterations += [it for p in epoch.passes for it in p.iterations()]
        members = survivors
    want = reference(ranks[members[0]]["init"], iterations)
    error = 0.0
    for rank in members:
        np.testing.assert_allclose(ranks[rank]["params"], want, rtol=0, atol=1e-5,
                                   err_msg=f"{spec} rank {rank}")
        error = max(error, float(np.abs(np.array(ranks[rank]["params"]) - want).max()))
        assert ranks[rank]["group_size"] == len(members)
    return error
