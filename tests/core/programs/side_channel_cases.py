"""``SideChannel`` cases that run on any backend: threads, gloo (torch) and MPI.

Each case is ``case(group) -> result`` for one rank; :func:`expected` computes
what every rank must return from the inputs alone (plain Python, no
collectives). ``test_side_channel.py`` runs them on the threads harness
for worlds of 1 to 4 ranks; ``side_channel_worker.py`` runs them on gloo and
under ``mpirun`` (``test_side_channel_dist.py``). NumPy and joinkit only.

Rank ``r`` of a world of ``W`` has ``INPUTS[W][r]`` iterations (a rank with none
in worlds of 3 and 4). In iteration ``t`` every active rank makes the same side
calls, their number depending on ``t`` (the data): some before the model's
collective (an all-reduce joinable, ``support.AllReducer``), some after.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from support import AllReducer

from joinkit import (
    CollectiveMismatch,
    Join,
    Joinable,
    JoinHook,
    LocalProtocolError,
    PeerFailure,
    SideChannel,
)

INPUTS = {1: [3], 2: [2, 5], 3: [4, 0, 6], 4: [3, 1, 0, 5]}


def _inputs(group: Any) -> int:
    return INPUTS[group.world_size][group.rank]


def _active(world: int, step: int) -> list[int]:
    return [r for r, n in enumerate(INPUTS[world]) if n > step]


def mixed(group: Any) -> list[Any]:
    """Every kind of call, a data-dependent number of times per iteration."""
    rank = group.rank
    side = SideChannel()
    model = AllReducer(group)
    log: list[Any] = []
    with Join([model, side]):
        for step in range(_inputs(group)):
            count = side.all_reduce(np.array([1.0]))  # before the model's collective
            log.append(("count", float(count[0]), side.last_active))
            model()
            for k in range(step % 3 + 1):  # data-dependent: 1, 2 or 3 gathers
                rows = np.full((rank % 3, 2), 10 * rank + k, dtype=np.int64)
                log.append(("gather", [part.tolist() for part in side.all_gather(rows)]))
            scalar = side.all_gather(np.array(rank + 0.5))
            log.append(("scalars", [float(s) for s in scalar]))
            maximum = side.all_reduce(np.array([rank, -rank], dtype=np.int32), "max")
            minimum = side.all_reduce(np.array([rank + 1.5]), "min")
            product = side.all_reduce(np.array([2], dtype=np.int64), "prod")
            both = side.all_reduce(np.array([True, rank % 2 == 0]), "band")
            log.append(("ops", maximum.tolist(), minimum.tolist(), product.tolist(),
                        both.tolist()))
            log.append(("mean", float(side.mean(np.array([float(rank)]))[0])))
            if step % 2 == 0:
                log.append(("objects", side.all_gather_object({"rank": rank, "step": step})))
            root = side.active_ranks()[0]
            sent = side.broadcast(np.array([100 * rank + step], dtype=np.int64), root)
            log.append(("broadcast", int(sent[0]), side.broadcast_object(("from", rank), root)))
            side.barrier()
    log.append(("served", side.served > 0))
    return log


def expected_mixed(world: int, rank: int) -> list[Any]:
    log: list[Any] = []
    for step in range(INPUTS[world][rank]):
        active = _active(world, step)
        log.append(("count", float(len(active)), tuple(active)))
        for k in range(step % 3 + 1):
            log.append(("gather", [[[10 * r + k] * 2] * (r % 3) for r in active]))
        log.append(("scalars", [r + 0.5 for r in active]))
        log.append(("ops", [max(active), -min(active)], [min(active) + 1.5],
                    [2 ** len(active)], [True, all(r % 2 == 0 for r in active)]))
        log.append(("mean", sum(active) / len(active)))
        if step % 2 == 0:
            log.append(("objects", [{"rank": r, "step": step} for r in active]))
        log.append(("broadcast", 100 * active[0] + step, ("from", active[0])))
    joined_some = any(INPUTS[world][rank] <= step < max(INPUTS[world])
                      for step in range(max(INPUTS[world])))
    log.append(("served", joined_some and rank < len(INPUTS[world])
                and INPUTS[world][rank] < max(INPUTS[world])))
    return log


class _PostCall(Joinable):
    """A joinable whose post hook makes a side call (every rank is present there)."""

    join_follows_group = True

    def __init__(self, side: SideChannel) -> None:
        super().__init__()
        self.side = side
        self.result: Any = None

    def join_hook(self, **kwargs: Any) -> JoinHook:
        owner = self

        class Hook(JoinHook):
            def post_hook(self, is_last_joiner: bool) -> None:
                owner.result = owner.side.all_gather_object(is_last_joiner)

        return Hook()

    @property
    def join_device(self) -> Any:
        join = self._join_config.join
        return None if join is None else join.device

    @property
    def join_process_group(self) -> Any:
        join = self._join_config.join
        return None if join is None else join.process_group


def epochs(group: Any) -> list[Any]:
    """Joins in a row, calls outside them, and a call from a post hook."""
    rank = group.rank
    side = SideChannel(group)
    log: list[Any] = [("before", side.all_gather_object(rank))]
    for epoch in range(2):
        model = AllReducer(group)
        post = _PostCall(side)
        with Join([model, post, side]):
            for step in range(_inputs(group) + epoch):
                model()
                side.all_reduce(np.array([step]))
        log.append(("post", post.result))
        log.append(("between", side.active_ranks()))
    return log


def expected_epochs(world: int, rank: int) -> list[Any]:
    log: list[Any] = [("before", list(range(world)))]
    for epoch in range(2):
        most = max(INPUTS[world]) + epoch
        log.append(("post", [n + epoch == most for n in INPUTS[world]]))
        log.append(("between", tuple(range(world))))
    return log


def _outcome(fn: Any) -> Any:
    try:
        fn()
    except PeerFailure:
        return "PeerFailure"  # SpawnAborted too: a hook failed midway, the group aborted
    except (CollectiveMismatch, LocalProtocolError) as error:
        return type(error).__name__
    return None


def mismatch(group: Any) -> Any:
    """Active ranks disagree on a call's dtype: every one raises, nobody hangs."""
    side = SideChannel()
    model = AllReducer(group)
    rank = group.rank

    def run() -> None:
        with Join([model, side]):
            for step in range(_inputs(group)):
                model()
                dtype = np.float64 if (rank % 2 or step == 0) else np.float32
                side.all_reduce(np.ones(2, dtype=dtype))
    return _outcome(run)


def expected_mismatch(world: int, rank: int) -> Any:
    active_at_1 = _active(world, 1)
    if len({r % 2 for r in active_at_1}) < 2:
        return None  # the active ranks agree at every step
    return "CollectiveMismatch" if rank in active_at_1 else "PeerFailure"


def broadcast_joined(group: Any) -> Any:
    """A broadcast from a rank that joined: the active ranks get a clear error."""
    side = SideChannel()
    model = AllReducer(group)
    first_out = min(range(group.world_size), key=lambda r: INPUTS[group.world_size][r])

    def run() -> None:
        with Join([model, side]):
            for _ in range(_inputs(group)):
                model()
                side.broadcast(np.zeros(1), first_out)
    return _outcome(run)


def expected_broadcast_joined(world: int, rank: int) -> Any:
    inputs = INPUTS[world]
    least = min(inputs)
    if least == max(inputs):
        return None
    # At iteration `least` the rank with the fewest inputs has left.
    return "LocalProtocolError" if inputs[rank] > least else "PeerFailure"


def not_listed(group: Any) -> Any:
    """A side call inside a Join that does not list the channel."""
    side = SideChannel(group)
    model = AllReducer(group)

    def run() -> None:
        with Join([model]):
            side.barrier()
    return _outcome(run)


class _ShadowCaller(Joinable):
    """A joinable whose main hook (a joined rank's shadow round) calls the channel."""

    join_follows_group = True

    def __init__(self, side: SideChannel) -> None:
        super().__init__()
        self.side = side

    def join_hook(self, **kwargs: Any) -> JoinHook:
        side = self.side

        class Hook(JoinHook):
            def main_hook(self) -> None:
                side.barrier()

        return Hook()

    @property
    def join_device(self) -> Any:
        join = self._join_config.join
        return None if join is None else join.device

    @property
    def join_process_group(self) -> Any:
        join = self._join_config.join
        return None if join is None else join.process_group


def main_hook_call(group: Any) -> Any:
    """A joined rank calling the channel from a shadow round: refused there."""
    side = SideChannel()
    model = AllReducer(group)

    def run() -> None:
        with Join([model, _ShadowCaller(side), side]):
            for _ in range(_inputs(group)):
                model()
    return _outcome(run)


def expected_main_hook_call(world: int, rank: int) -> Any:
    inputs = INPUTS[world]
    if min(inputs) == max(inputs):
        return None
    # The first ranks to join refuse in their first shadow round; the others
    # learn of it (PeerFailure), the refusing ranks re-raise their own error.
    return "LocalProtocolError" if inputs[rank] == min(inputs) else "PeerFailure"


def failure(group: Any) -> Any:
    """A rank raises between side calls: every rank leaves with an error, none hangs."""
    side = SideChannel()
    model = AllReducer(group)
    rank = group.rank

    def run() -> None:
        with Join([model, side]):
            for step in range(_inputs(group)):
                model()
                side.all_reduce(np.ones(1))
                if rank == 0 and step == 1:
                    raise ValueError("rank 0 fails")
                side.all_gather(np.ones((rank, 1)))
    try:
        run()
    except ValueError:
        return "own"
    except PeerFailure as error:
        return f"peer {error.rank}"
    return None


def expected_failure(world: int, rank: int) -> Any:
    if INPUTS[world][0] <= 1:
        return None
    return "own" if rank == 0 else "peer 0"


CASES = {
    "mixed": (mixed, expected_mixed),
    "epochs": (epochs, expected_epochs),
    "mismatch": (mismatch, expected_mismatch),
    "broadcast_joined": (broadcast_joined, expected_broadcast_joined),
    "not_listed": (not_listed, lambda world, rank: "LocalProtocolError"),
    "main_hook_call": (main_hook_call, expected_main_hook_call),
    "failure": (failure, expected_failure),
}


def normalize(value: Any) -> Any:
    """Tuples as lists (a result that crossed a process boundary as JSON)."""
    if isinstance(value, (list, tuple)):
        return [normalize(v) for v in value]
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items()}
    return value
