"""A DeepSpeed ZeRO-2 engine on gloo and the CPU: alone, and in ``Join([engine])``.

    torchrun --standalone --nproc-per-node 2 benchmarks/deepspeed_zero.py [iterations [repeats]]

``DS_ACCELERATOR=cpu``, torch.distributed on gloo (DeepSpeed's shared-memory
all-reduce op is marked incompatible, as in the tests: its JIT build takes
minutes). The model is an MLP 128-512-512-10 (ReLU) trained with a torch AdamW
on a fixed batch of 64 per rank, ZeRO stage 2 (gradients reduced in buckets
during backward, optimizer state partitioned, the updated partitions
all-gathered after the step); an iteration is ``engine(x)``, cross-entropy,
``engine.backward(loss)`` and ``engine.step()``. Variants, each with its own
engine: ``engine alone`` (and again: an A/A pair, the run's scatter) and
``Join([engine])`` on even inputs (joinkit's ``DeepSpeedJoinable``: the
heartbeat goes out in a forward pre-hook; the time counts the ``with`` block).

After the timing each variant runs once more with its loop's collectives
counted (``_collectives``, per iteration by ProcessGroup method; inside the
``with`` block, so the Join's entry and exit are not in them): the difference
is joinkit's own per iteration.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import _bench
import _collectives

BATCH = 64


def main() -> None:
    iterations = _bench.int_arg(1, 100)
    repeats = _bench.int_arg(2, 15)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _collectives.install()  # before any process group (module doc of _collectives)
    warnings.simplefilter("ignore")
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist
    from torch import nn

    from joinkit import Join, backends

    # DeepSpeed's CPU accelerator would JIT-build a shared-memory all-reduce first
    # (minutes on 2 cores, a lock file a killed build leaves): gloo's collectives.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.utils.logger.setLevel("ERROR")
    torch.set_num_threads(1)
    backends.init_torch("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, 128, generator=generator)
    y = torch.randint(0, 10, (BATCH,), generator=generator)
    slowest = _bench.slowest_rank()

    def engine() -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                              nn.Linear(512, 10))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                  "train_batch_size": BATCH * world, "zero_optimization": {"stage": 2},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
                  "wall_clock_breakdown": False}
        made, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return made

    counting: list[Counter[str]] = []  # the count pass: the loop's collectives go here

    def train(made: Any, n: int) -> None:
        with _collectives.counting() if counting else contextlib.nullcontext() as counts:
            for _ in range(n):
                loss = nn.functional.cross_entropy(made(x), y)
                made.backward(loss)
                made.step()
        if counts is not None:
            counting[0].update(counts)

    def alone() -> Callable[[int], None]:
        made = engine()
        return lambda n: train(made, n)

    def joined() -> Callable[[int], float]:
        made = engine()

        def loop(n: int) -> float:
            start = time.perf_counter()
            with Join([made]):
                train(made, n)
            return time.perf_counter() - start
        return loop

    variants = {"engine alone": alone(), "engine alone, again": alone(),
                "Join([engine])": joined()}
    times = _bench.timed(variants, iterations, repeats, slowest, dist.barrier)
    counted = {}
    for name, loop in variants.items():
        counting[:] = [Counter()]
        loop(iterations)
        counted[name] = counting.pop()
    info = {"ranks": world, "iterations": iterations, "repeats": repeats,
            "deepspeed": deepspeed.__version__}
    bench = "DeepSpeed ZeRO-2, MLP 128-512-512-10, batch 64, gloo (torchrun)"
    if rank == 0:
        _bench.report(bench, times, [
            ("Join([engine])", "engine alone", 1.03),
            ("engine alone, again", "engine alone", None),
        ], info)
        for name, counts in counted.items():
            print(f"  collectives, {name}: per iteration "
                  f"{_collectives.per_step(counts, iterations)}", flush=True)
        own = (_collectives.own(counted["Join([engine])"])
               - _collectives.own(counted["engine alone"])) / iterations
        _bench.record_value(bench, "Join([engine]): collectives of joinkit's own per iteration",
                            own, "per iteration", 0.0, info)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
