"""torchmetrics with ``dist_sync_on_step=True``: without Join and inside joinkit's Join.

    torchrun --standalone --nproc-per-node 2 benchmarks/metrics_sync.py [iterations [repeats]]

Even data (every rank the same number of batches of 64 rows), gloo on the
CPU; an iteration is one ``metric(preds, target)``, which syncs that batch's
state across the ranks. Two metrics: ``MeanSquaredError`` (two scalar states:
torchmetrics sends a barrier and an all-gather per state) and a
``MetricCollection`` of ``BinaryAccuracy`` and ``BinaryAUROC`` (four scalar
states and two concatenated list states, whose gather adds a shape
all-gather). Variants, each with its own metric:

- ``no Join``: torchmetrics' own per-step sync (``gather_all_tensors``);
- ``joinkit Join``: ``Join([metric])``: the metric sends the heartbeat, and
  each per-step sync is joinkit's two all-gathers per metric (a header, then
  every state's bytes), which a joined rank could shadow;
- ``no Join, joinkit's gather``: no Join, with joinkit's gather as the
  metric's ``dist_sync_fn`` (two all-gathers per *state*): what the Join's
  ratio owes to the gather rather than to the Join (heartbeat, wrappers).

Target (issue 18): joinkit Join / no Join <= 1.05.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import _bench
import torch
import torch.distributed as dist
from torchmetrics import MeanSquaredError, MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

from joinkit import Join, backends
from joinkit.adapters.torchmetrics import gather_states


def _members(metric: Any) -> list[Any]:
    return list(metric.values()) if isinstance(metric, MetricCollection) else [metric]


def _gather_one(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """joinkit's per-step gather as a plain ``dist_sync_fn``: one state, all ranks."""
    return gather_states([tensor], 1, group, tensor.device)[0]


def main() -> None:
    iterations = _bench.int_arg(1, 200)
    repeats = _bench.int_arg(2, 15)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    backends.init_torch("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    slowest = _bench.slowest_rank()

    cases: list[tuple[str, Callable[[], Any], tuple[torch.Tensor, torch.Tensor]]] = [
        ("MeanSquaredError", lambda: MeanSquaredError(dist_sync_on_step=True),
         (torch.randn(64, generator=generator), torch.randn(64, generator=generator))),
        ("MetricCollection(BinaryAccuracy, BinaryAUROC)",
         lambda: MetricCollection([BinaryAccuracy(dist_sync_on_step=True),
                                   BinaryAUROC(dist_sync_on_step=True)]),
         (torch.rand(64, generator=generator), torch.randint(2, (64,), generator=generator))),
    ]
    info = {"ranks": world, "iterations": iterations, "repeats": repeats, "batch": 64}
    for name, make, data in cases:

        def plain(make: Callable[[], Any] = make, data: Any = data) -> Callable[[int], None]:
            metric = make()

            def loop(n: int) -> None:
                metric.reset()
                for _ in range(n):
                    metric(*data)
            return loop

        def joined(make: Callable[[], Any] = make, data: Any = data) -> Callable[[int], None]:
            metric = make()

            def loop(n: int) -> None:
                metric.reset()
                with Join([metric]):
                    for _ in range(n):
                        metric(*data)
            return loop

        def own_gather(make: Callable[[], Any] = make, data: Any = data
                       ) -> Callable[[int], None]:
            metric = make()
            for member in _members(metric):
                member.dist_sync_fn = _gather_one

            def loop(n: int) -> None:
                metric.reset()
                for _ in range(n):
                    metric(*data)
            return loop

        times = _bench.timed({"no Join": plain(), "joinkit Join": joined(),
                              "no Join, joinkit's gather": own_gather()},
                             iterations, repeats, slowest, dist.barrier)
        if rank == 0:
            _bench.report(f"torchmetrics {name}, dist_sync_on_step=True, gloo", times,
                          [("joinkit Join", "no Join", 1.05),
                           ("joinkit Join", "no Join, joinkit's gather", None),
                           ("no Join, joinkit's gather", "no Join", None)], info)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
