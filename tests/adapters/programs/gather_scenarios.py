"""Multi-rank scenarios of ``joinkit.adapters.gather.Gather``, on any backend.

Each scenario takes a :class:`support.Ctx` whose ``group`` is a joinkit group
(threads, gloo ``TorchGroup``, ``MPIGroup``), checks every result it can on
its own rank against a plain concatenation (every rank derives every rank's
batches, :func:`batch_of`), and returns a JSON-able summary that the tests
compare across ranks. ``test_gather.py`` runs them on threads in its own
process, and launches this file as a program for real processes::

    python gather_scenarios.py gloo RANK WORLD STORE_FILE OUT_DIR NAME [NAME ...]
    mpirun -n WORLD python gather_scenarios.py mpi OUT_DIR NAME [NAME ...]
    python gather_scenarios.py nccl RANK WORLD STORE_FILE OUT_DIR cuda_tensors

Each rank appends one JSON line per scenario to ``OUT_DIR/rank{RANK}.jsonl``
(:func:`support.recording`). On gloo each scenario gets a fresh subgroup with
a short timeout, so a scenario that hangs fails alone.

The evaluation scenarios are the issue's "test against code nobody here
wrote": an eval loop over 13 samples on 2 ranks, and the scenario of
Accelerate's ``gather_for_metrics`` test script
(``accelerate/test_utils/scripts/external_deps/test_metrics.py``: a regression
set of 82 and 99 samples in batches of 16, the gathered predictions must
number exactly the samples and the metrics equal one process's), each done
joinkit's way (exact shards, ``Gather``, ``Join``) and the padded way
(``torch.utils.data.DistributedSampler``'s shards and a plain all-gather),
side by side against one process.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any

import numpy as np
from support import Counter, Ctx, recording, scenario_registry  # noqa: E402

from joinkit import Join, PeerFailure  # noqa: E402
from joinkit.adapters.gather import Gather, GatherMismatch  # noqa: E402

SCENARIOS, scenario = scenario_registry()


# -- data every rank can derive -----------------------------------------------------------


def batch_of(rank: int, call: int, rows: int, kind: str = "numpy") -> tuple[Any, Any]:
    """Rank ``rank``'s arrays of call ``call``: float32 features (rows, 2, 3) and
    int64 labels (rows,), values that name their rank, call and row."""
    base = 1000.0 * rank + 100.0 * call
    x = (base + np.arange(rows * 6, dtype=np.float32)).reshape(rows, 2, 3)
    y = (1000 * rank + 100 * call + np.arange(rows)).astype(np.int64)
    if kind in ("torch", "cuda"):
        import torch

        tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        if kind == "cuda":
            device = f"cuda:{rank % torch.cuda.device_count()}"
            tx, ty = tx.to(device), ty.to(device)
        return tx, ty
    return x, y


def rows_of(rank: int, call: int) -> int:
    """Rows of rank ``rank`` in call ``call``: 0 to 4, differing by rank and call."""
    return (3 * rank + 2 * call + rank * call) % 5


def as_numpy(value: Any) -> np.ndarray:
    return value.cpu().numpy() if hasattr(value, "numpy") else np.asarray(value)


def run_gather_loop(group: Any, inputs: list[int], *, kind: str = "numpy",
                    dst: int | None = None, first: bool = True,
                    rows: Any = rows_of, keep: bool = False) -> dict[str, Any]:
    """A Join over a Gather (first, or after a Counter) where rank r makes
    ``inputs[r]`` calls; checks each call against the plain concatenation,
    and with ``keep`` what ``collected()`` returns against every call's."""
    rank, world = group.rank, group.world_size
    gather = Gather(group, dst=dst, keep=keep)
    joinables: list[Any] = [gather]
    counter = None
    if not first:
        counter = Counter(group)
        joinables = [counter, gather]
    checked = 0
    with Join(joinables):
        for call in range(inputs[rank]):
            if counter is not None:
                counter()
            x, y = batch_of(rank, call, rows(rank, call), kind)
            got = gather(x, y)
            active = [r for r in range(world) if inputs[r] > call]
            if dst is not None and rank != dst:
                assert got is None, got
                continue
            gx, gy = got
            assert type(gx) is type(x) and type(gy) is type(y), (type(gx), type(x))
            assert getattr(gx, "device", None) == getattr(x, "device", None), gx.device
            want = [batch_of(r, call, rows(r, call)) for r in active]
            want_x = np.concatenate([w[0] for w in want])
            want_y = np.concatenate([w[1] for w in want])
            assert as_numpy(gx).dtype == want_x.dtype and as_numpy(gx).shape == want_x.shape
            np.testing.assert_array_equal(as_numpy(gx), want_x)
            np.testing.assert_array_equal(as_numpy(gy), want_y)
            checked += 1
    if keep:
        kept = gather.collected()
        calls = range(max(inputs))
        every = [batch_of(r, c, rows(r, c)) for c in calls for r in range(world) if inputs[r] > c]
        if dst is not None and rank != dst or not every:
            assert kept is None, kept
        else:
            assert type(kept[0]).__module__.split(".")[0] == {"cuda": "torch"}.get(kind, kind)
            if kind != "numpy":  # on this rank's inputs' device; no call made: the group's
                device = (batch_of(rank, 0, 1, kind)[0].device if inputs[rank]
                          else getattr(group, "device", "cpu"))
                assert str(kept[0].device) == str(device), (kept[0], device)
            np.testing.assert_array_equal(as_numpy(kept[0]),
                                          np.concatenate([e[0] for e in every]))
            np.testing.assert_array_equal(as_numpy(kept[1]),
                                          np.concatenate([e[1] for e in every]))
            checked += 1000
    return {"checked": checked, "capacity": gather._capacity}


# -- scenarios ------------------------------------------------------------------------


def uneven_inputs(world: int) -> list[list[int]]:
    """Input counts per rank: uneven, one rank with none, all even."""
    if world == 1:
        return [[3], [0]]
    if world == 2:
        return [[3, 5], [0, 4], [4, 4], [6, 1]]
    return [[3, 5, 0], [0, 4, 2], [2, 2, 2], [1, 6, 3]]


@scenario
def uneven(ctx: Ctx) -> Any:
    """Rows differ by rank and call (0 included), inputs are uneven (0 included):
    every call returns exactly the active ranks' rows in rank order; NumPy and
    torch, on every rank and to one dst, Gather first and after a Counter."""
    out = []
    kinds = ["numpy", "torch"] if _has_torch() else ["numpy"]
    for inputs in uneven_inputs(ctx.world):
        for kind in kinds:
            for dst in (None, ctx.world - 1):
                for first in (True, False):
                    result = run_gather_loop(ctx.group, inputs, kind=kind, dst=dst,
                                             first=first, keep=first)
                    out.append([inputs, kind, dst, first, result["checked"]])
    return out


@scenario
def unfused(ctx: Ctx) -> Any:
    """Join(check_agreement=False) sends the classic heartbeat (no fused slot):
    the same exact rows, and keep's collected() has every call's."""
    inputs = uneven_inputs(ctx.world)[0]
    gather = Gather(ctx.group, keep=True)
    with Join([gather], check_agreement=False):
        for call in range(inputs[ctx.rank]):
            gather(*batch_of(ctx.rank, call, rows_of(ctx.rank, call)))
    x, y = gather.collected()
    every = [batch_of(r, c, rows_of(r, c)) for c in range(max(inputs))
             for r in range(ctx.world) if inputs[r] > c]
    np.testing.assert_array_equal(x, np.concatenate([e[0] for e in every]))
    np.testing.assert_array_equal(y, np.concatenate([e[1] for e in every]))
    return int(y.shape[0])


@scenario
def peer_failure(ctx: Ctx) -> Any:
    """The last rank raises in its loop body (before its third call): it leaves
    with its own error, every other rank with PeerFailure naming it; no hang."""
    failing = ctx.world - 1
    gather = Gather(ctx.group)
    try:
        with Join([gather]):
            for call in range(3 + ctx.rank):
                if ctx.rank == failing and call == 2:
                    raise RuntimeError("the model failed")
                gather(np.zeros((2, 3)))
    except PeerFailure as exc:
        return {"error": "PeerFailure", "message": str(exc)}
    except RuntimeError as exc:
        return {"error": "own", "message": str(exc)}
    return {"error": None, "message": ""}


@scenario
def outside_join(ctx: Ctx) -> Any:
    """Without a Join it is a plain exact gather (every rank calls)."""
    gather = Gather(ctx.group)
    got = []
    for call in range(3):
        x, _ = batch_of(ctx.rank, call, rows_of(ctx.rank, call))
        gx = gather(x)
        want = np.concatenate([batch_of(r, call, rows_of(r, call))[0] for r in range(ctx.world)])
        np.testing.assert_array_equal(gx, want)
        got.append(int(gx.shape[0]))
    return got


@scenario
def dtypes(ctx: Ctx) -> Any:
    """Every dtype crosses as bytes: bool, uint8, int32, float64, complex64 (NumPy),
    and bfloat16, float16, bool (torch), scalars per row and wide rows."""
    gather = Gather(ctx.group)
    rows = ctx.rank + 1
    arrays = [
        np.arange(rows) % 2 == 0,
        np.arange(rows, dtype=np.uint8) + ctx.rank,
        np.full((rows, 5), ctx.rank, dtype=np.int32),
        np.linspace(0, 1, rows * 4).reshape(rows, 2, 2) + ctx.rank,
        (np.arange(rows) + 1j * ctx.rank).astype(np.complex64),
    ]
    got = gather(*arrays)
    for index, g in enumerate(got):
        want = np.concatenate([_dtype_arrays(r)[index] for r in range(ctx.world)])
        assert g.dtype == want.dtype, (g.dtype, want.dtype)
        np.testing.assert_array_equal(g, want)
    result: dict[str, Any] = {"numpy": [str(g.dtype) for g in got]}
    if _has_torch():
        import torch

        t = [torch.arange(rows, dtype=torch.float32).to(torch.bfloat16) + ctx.rank,
             torch.full((rows, 3), float(ctx.rank), dtype=torch.float16),
             torch.arange(rows) % 2 == 1]
        gt = gather(*t)
        for index, g in enumerate(gt):
            want_t = torch.cat([_torch_arrays(r)[index] for r in range(ctx.world)])
            assert g.dtype == want_t.dtype and torch.equal(g, want_t), (g, want_t)
        result["torch"] = [str(g.dtype) for g in gt]
    return result


def _dtype_arrays(rank: int) -> list[np.ndarray]:
    rows = rank + 1
    return [
        np.arange(rows) % 2 == 0,
        np.arange(rows, dtype=np.uint8) + rank,
        np.full((rows, 5), rank, dtype=np.int32),
        np.linspace(0, 1, rows * 4).reshape(rows, 2, 2) + rank,
        (np.arange(rows) + 1j * rank).astype(np.complex64),
    ]


def _torch_arrays(rank: int) -> list[Any]:
    import torch

    rows = rank + 1
    return [torch.arange(rows, dtype=torch.float32).to(torch.bfloat16) + rank,
            torch.full((rows, 3), float(rank), dtype=torch.float16),
            torch.arange(rows) % 2 == 1]


@scenario
def big_rows(ctx: Ctx) -> Any:
    """Data above the inline limit takes the second collective, and a later
    smaller call goes back to one collective; results exact throughout."""
    gather = Gather(ctx.group)
    sizes = [10, 3000, 5, 20000, 7]  # rows of 8 float64 = 64 bytes
    capacities = []
    with Join([gather]):
        for call, n in enumerate(sizes):
            x = np.full((n + ctx.rank, 8), 10.0 * call + ctx.rank)
            got = gather(x)
            want = np.concatenate([np.full((n + r, 8), 10.0 * call + r)
                                   for r in range(ctx.world)])
            np.testing.assert_array_equal(got, want)
            capacities.append(gather._capacity)
    return capacities


@scenario
def mismatch(ctx: Ctx) -> Any:
    """Rank 1's second call gives float64 where the others give float32, and the
    last rank gives a different trailing shape: every active rank raises the
    same GatherMismatch (naming every rank) before any data moves; a rank
    joined from the start (rank 0 on 3 ranks) leaves with PeerFailure."""
    world, rank = ctx.world, ctx.rank
    inputs = [2] * world
    if world >= 3:
        inputs[0] = 0
    gather = Gather(ctx.group)
    try:
        with Join([gather]):
            for call in range(inputs[rank]):
                dtype = np.float64 if (rank == 1 and call == 1) else np.float32
                width = 4 if (rank == world - 1 and call == 1 and world >= 3) else 3
                gather(np.zeros((rank + 1, width), dtype=dtype))
    except GatherMismatch as exc:
        return {"error": "GatherMismatch", "message": str(exc)}
    except PeerFailure as exc:
        return {"error": "PeerFailure", "message": str(exc)}
    return {"error": None, "message": ""}


@scenario
def bad_inputs(ctx: Ctx) -> Any:
    """Wrong inputs raise before any collective, with what to fix."""
    gather = Gather(ctx.group)
    errors = {}
    for name, args in (
        ("no_arrays", ()),
        ("a_list", ([1, 2, 3],)),
        ("scalar", (np.float32(1.0),)),
        ("zero_dim", (np.array(1.0),)),
        ("rows_differ", (np.zeros(3), np.zeros(4))),
        ("objects", (np.array([object()] * 2),)),
    ):
        try:
            gather(*args)
        except (TypeError, ValueError) as exc:
            errors[name] = [type(exc).__name__, str(exc)]
    if _has_torch():
        import torch

        try:
            gather(np.zeros(2), torch.zeros(2))
        except TypeError as exc:
            errors["mixed"] = [type(exc).__name__, str(exc)]
    try:
        Gather(ctx.group, dst=ctx.world)
    except ValueError as exc:
        errors["bad_dst"] = [type(exc).__name__, str(exc)]
    # Nothing above issued a collective: the group still pairs up.
    got = gather(np.array([ctx.rank]))
    assert got.tolist() == list(range(ctx.world))
    return errors


# -- exact evaluation versus padded evaluation ----------------------------------------------


def exact_shard(n: int, rank: int, world: int) -> list[int]:
    """Exact shards: each index on exactly one rank (ShardSampler(shuffle=False))."""
    return list(range(rank, n, world))


def padded_shard(n: int, rank: int, world: int) -> list[int]:
    """torch's DistributedSampler(shuffle=False): pads by repeating the first indices."""
    from torch.utils.data import DistributedSampler

    return list(DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False))


def classify(x: np.ndarray) -> np.ndarray:
    """A fixed linear classifier: class 1 where the feature is above 0.5."""
    return (x[:, 0] > 0.5).astype(np.int64)


def thirteen() -> tuple[np.ndarray, np.ndarray]:
    """13 samples; the classifier gets 7 right (7/13 = 0.5385), sample 0 wrong,
    so a sampler that repeats sample 0 reports 7/14 = 0.5000."""
    x = ((np.arange(13) * 7) % 13 / 13.0).astype(np.float32).reshape(13, 1)
    y = classify(x)
    wrong = [0, 1, 2, 4, 5, 8]
    y[wrong] = 1 - y[wrong]
    return x, y


def evaluate(group: Any, x: np.ndarray, y: np.ndarray, batch_size: int,
             predict: Any, padded: bool) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's predictions and labels, gathered per batch.

    ``padded``: DistributedSampler's shards and a plain all-gather of each
    batch (every rank has as many batches, all but possibly the last full);
    else exact shards, ``Gather`` and ``Join``.
    """
    rank, world = group.rank, group.world_size
    shard = (padded_shard if padded else exact_shard)(len(x), rank, world)
    batches = [shard[i:i + batch_size] for i in range(0, len(shard), batch_size)]
    preds, labels = [], []
    if padded:
        for index in batches:
            p, t = predict(x[index]), y[index]
            preds += group.all_gather(p)
            labels += group.all_gather(t)
    else:
        # keep=True: every rank also keeps the calls it shadowed after it joined.
        gather = Gather(group, keep=True)
        with Join([gather]):
            for index in batches:
                gather(predict(x[index]), y[index])
        return gather.collected()  # type: ignore[no-any-return]
    return np.concatenate(preds), np.concatenate(labels)


@scenario
def thirteen_samples(ctx: Ctx) -> Any:
    """13 samples, batch 4: the exact accuracy equals one process's; the padded
    one (DistributedSampler) counts a repeated sample."""
    x, y = thirteen()
    single = float(np.mean(classify(x) == y))
    out: dict[str, Any] = {"single": single}
    for padded in (False, True):
        p, t = evaluate(ctx.group, x, y, 4, classify, padded)
        out["padded" if padded else "exact"] = {"samples": len(p),
                                                "accuracy": float(np.mean(p == t))}
    return out


def regression_set(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Accelerate's scenario: y = 2 x + 3 plus noise, from a fixed seed."""
    rng = np.random.default_rng(42)
    x = rng.normal(size=(n, 1)).astype(np.float32)
    y = (2.0 * x[:, 0] + 3.0 + 0.1 * rng.normal(size=n)).astype(np.float32)
    return x, y


def regression_model(x: np.ndarray) -> np.ndarray:
    """A fixed, slightly wrong regression model (a = 1.9, b = 3.1)."""
    return (1.9 * x[:, 0] + 3.1).astype(np.float32)


def metrics(pred: np.ndarray, target: np.ndarray) -> dict[str, float]:
    """MSE, and accuracy and F1 of "above 3" as a binary label (MRPC's metrics)."""
    p, t = pred > 3.0, target > 3.0
    tp = float(np.sum(p & t))
    f1 = 2 * tp / (2 * tp + float(np.sum(p & ~t)) + float(np.sum(~p & t)))
    return {"mse": float(np.mean((pred.astype(np.float64) - target) ** 2)),
            "accuracy": float(np.mean(p == t)), "f1": f1}


@scenario
def accelerate_metrics(ctx: Ctx) -> Any:
    """Accelerate's gather_for_metrics scenario (82 and 99 samples, batch 16):
    exact shards + Gather + Join give exactly the samples and one process's
    metrics; DistributedSampler's padded shards do not."""
    out = {}
    for n in (82, 99):
        x, y = regression_set(n)
        single = metrics(regression_model(x), y)
        runs: dict[str, Any] = {"single": single}
        for padded in (False, True):
            p, t = evaluate(ctx.group, x, y, 16, regression_model, padded)
            runs["padded" if padded else "exact"] = {"samples": len(p), **metrics(p, t)}
        out[str(n)] = runs
    return out


@scenario
def fresh_results(ctx: Ctx) -> Any:
    """Each call returns arrays of its own (NumPy, and torch where it is), with
    uneven calls, calls where one rank alone gives rows, and the capacity
    growing: the results of every call, held to the end, still hold that call's
    rows, and so does collected() (on a TorchGroup the header collective reuses
    two buffers, through all_gather_into)."""
    group = ctx.group
    into = getattr(group, "all_gather_into", None)
    used = []
    if into is not None:
        def counted(buf: Any, out: Any) -> Any:
            used.append(1)
            return into(buf, out)
        group.all_gather_into = counted
    sizes = [[4, 1, 2, 0, 6, 1], [4, 0, 3, 2, 0, 2], [2, 0, 0, 1, 0, 3]]
    calls = [6, 5, 4][:ctx.world]

    def rows(rank: int, call: int, kind: str) -> Any:
        return batch_of(rank, call, sizes[rank % 3][call], kind)[0]

    checked = 0
    for kind in ("numpy", "torch") if _has_torch() else ("numpy",):
        gather = Gather(group, keep=True)
        held = []
        with Join([gather]):
            for call in range(calls[ctx.rank]):
                held.append(gather(rows(ctx.rank, call, kind)))
        for call, got in enumerate(held):
            want = [as_numpy(rows(r, call, "numpy")) for r in range(ctx.world) if calls[r] > call]
            np.testing.assert_array_equal(as_numpy(got), np.concatenate(want))
            checked += 1
        every = [as_numpy(rows(r, c, "numpy")) for c in range(max(calls))
                 for r in range(ctx.world) if calls[r] > c]
        np.testing.assert_array_equal(as_numpy(gather.collected()), np.concatenate(every))
    return {"checked": checked, "into": into is not None, "into_calls": len(used)}


@scenario
def even_batches(ctx: Ctx) -> Any:
    """An evaluation loop's calls: full batches of the same rows on every rank
    (each call's data inline once the capacity is known), then each rank's own
    last batch, and one rank with a batch more; two arrays of rows that name
    their rank, call and row, also given as views that are not contiguous.
    Every call's result, held to the end, and collected() are the active
    ranks' rows in rank order (NumPy and torch; with and without keep)."""
    full = 4
    calls = [5 + (r == 1) for r in range(ctx.world)]

    def rows(rank: int, call: int) -> int:
        return full if call < 4 else [3, 1, 2][rank % 3] if call == 4 else 2

    def arrays(rank: int, call: int, kind: str) -> tuple[Any, Any]:
        x, y = batch_of(rank, call, rows(rank, call))
        if call % 2:  # views with other strides: the same rows
            x = np.ascontiguousarray(x.transpose(0, 2, 1)).transpose(0, 2, 1)
            y = (np.ascontiguousarray(y[::-1])[::-1] if kind == "numpy"  # negative stride
                 else np.stack([y, y], 1)[:, 0])  # (torch has none)
        if kind == "torch":
            import torch
            return torch.from_numpy(x), torch.from_numpy(y)
        return x, y

    checked = 0
    for kind in ("numpy", "torch") if _has_torch() else ("numpy",):
        for keep in (True, False):
            gather = Gather(ctx.group, keep=keep)
            held = []
            with Join([gather]):
                for call in range(calls[ctx.rank]):
                    held.append(gather(*arrays(ctx.rank, call, kind)))
            every: list[tuple[np.ndarray, ...]] = []
            for call, got in enumerate(held):
                want = [batch_of(r, call, rows(r, call)) for r in range(ctx.world)
                        if calls[r] > call]
                every += want
                for index, array in enumerate(got):
                    assert type(array).__module__.split(".")[0] == kind, type(array)
                    np.testing.assert_array_equal(
                        as_numpy(array), np.concatenate([w[index] for w in want]))
                    checked += 1
            if keep:  # and the calls this rank shadowed: the last one of rank 1
                every += [batch_of(r, c, rows(r, c)) for c in range(calls[ctx.rank], max(calls))
                          for r in range(ctx.world) if calls[r] > c]
                for index, array in enumerate(gather.collected()):
                    np.testing.assert_array_equal(
                        as_numpy(array), np.concatenate([w[index] for w in every]))
                    checked += 1
    return {"checked": checked}


@scenario
def cuda_tensors(ctx: Ctx) -> Any:
    """CUDA tensors (on the group's GPU for nccl, moved through the CPU for
    gloo): results are CUDA tensors on the input's device, exact, with keep."""
    out = []
    for inputs in uneven_inputs(ctx.world):
        for dst in (None, ctx.world - 1):
            result = run_gather_loop(ctx.group, inputs, kind="cuda", dst=dst, keep=True)
            out.append([inputs, "cuda", dst, True, result["checked"]])
    return out


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


# -- the runner ------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    kind, *rest = argv
    if kind in ("gloo", "nccl"):
        import torch
        import torch.distributed as dist

        from joinkit.backends.torch_dist import TorchGroup

        rank, world, store, out_dir, *names = rest
        device = None
        if kind == "nccl":
            device = torch.device("cuda", int(rank) % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group(kind, init_method=f"file://{store}", rank=int(rank),
                                world_size=int(world), timeout=datetime.timedelta(seconds=30))
        out = Path(out_dir) / f"rank{rank}.jsonl"
        for name in names:
            with recording(out, name) as record:
                group = TorchGroup(dist.new_group(backend=kind,
                                                  timeout=datetime.timedelta(seconds=20)),
                                   device)
                record["result"] = SCENARIOS[name](Ctx(int(rank), int(world), group))
        dist.destroy_process_group()
    elif kind == "mpi":
        from joinkit.backends.mpi import MPIGroup

        out_dir, *names = rest
        group = MPIGroup()
        out = Path(out_dir) / f"rank{group.rank}.jsonl"
        for name in names:
            with recording(out, name) as record:
                record["result"] = SCENARIOS[name](Ctx(group.rank, group.world_size, group))
            group.barrier()
    else:
        raise SystemExit(f"unknown backend {kind!r}: gloo or mpi")


# -- the checks of the scenarios' results (tests/adapters/test_gather.py, test_gather_cuda.py)


def check_mismatch(results: list[dict[str, Any]], world: int) -> None:
    joined = [0] if world >= 3 else []
    active = [r for r in range(world) if r not in joined]
    errors = [results[r]["error"] for r in active]
    assert errors == ["GatherMismatch"] * len(active), results
    messages = {results[r]["message"] for r in active}
    assert len(messages) == 1, messages  # the same error on every active rank
    message = messages.pop()
    assert "different dtypes or trailing shapes" in message
    assert "rank 1: float64[rows, 3]" in message
    if world >= 3:
        assert "rank 0: (joined: gives nothing)" in message
        assert f"rank {world - 1}: float32[rows, 4]" in message
    else:
        assert "rank 0: float32[rows, 3]" in message
    for rank in joined:
        assert results[rank]["error"] == "PeerFailure", results[rank]
        assert "GatherMismatch" in results[rank]["message"]


def check_bad_inputs(errors: dict[str, list[str]], world: int) -> None:
    assert errors["no_arrays"][0] == "ValueError"
    assert errors["a_list"] == ["TypeError", errors["a_list"][1]]
    assert "argument 0 is a list, not a NumPy array or torch tensor" in errors["a_list"][1]
    assert "float32, not a NumPy array" in errors["scalar"][1]
    assert "0-dimensional" in errors["zero_dim"][1]
    assert "different numbers of rows [3, 4]" in errors["rows_differ"][1]
    assert "not plain numbers" in errors["objects"][1]
    assert "mixes NumPy arrays and torch tensors" in errors["mixed"][1]
    assert f"an int from 0 to {world - 1}" in errors["bad_dst"][1]


def check_thirteen(results: list[dict[str, Any]], world: int) -> None:
    single = 7 / 13
    padded_samples = -(-13 // world) * world
    for r in results:
        assert r["single"] == single
        assert r["exact"] == {"samples": 13, "accuracy": single}  # exactly, not approx
        assert r["padded"]["samples"] == padded_samples
        if world > 1:
            assert r["padded"]["accuracy"] != single
    if world == 2:
        assert round(results[0]["exact"]["accuracy"], 4) == 0.5385
        assert results[0]["padded"]["accuracy"] == 0.5


def check_accelerate(results: list[dict[str, Any]], world: int) -> None:
    import pytest

    for r in results:
        for n in (82, 99):
            runs = r[str(n)]
            # Accelerate's assertion: as many gathered predictions as samples...
            assert runs["exact"]["samples"] == n
            # ...and the metrics of one process.
            for key in ("mse", "accuracy", "f1"):
                assert runs["exact"][key] == pytest.approx(runs["single"][key], rel=1e-12)
            padded = -(-n // world) * world
            assert runs["padded"]["samples"] == padded
            if padded != n:
                assert runs["padded"]["mse"] != pytest.approx(runs["single"]["mse"], rel=1e-9)


def check(name: str, results: list[Any], world: int) -> None:
    """Assert scenario ``name``'s per-rank results (the checks every backend shares)."""
    assert len(results) == world
    if name in ("uneven", "cuda_tensors"):
        for rank, rows in enumerate(results):
            for inputs, _kind, dst, first, checked in rows:
                receives = dst is None or rank == dst
                want = inputs[rank] if receives else 0
                # keep (with Gather first): collected() had every call's rows.
                want += 1000 if first and receives and any(inputs) else 0
                assert checked == want, (rank, inputs, dst)
    elif name == "fresh_results":
        assert [r["checked"] for r in results] == [2 * c for c in [6, 5, 4][:world]]
        for result in results:  # TorchGroup's per-call path was taken
            assert not result["into"] or result["into_calls"] > 0, result
    elif name == "even_batches":
        calls = [5 + (r == 1) for r in range(world)]
        kinds = 2  # numpy, torch
        # Each call's two arrays, with and without keep; collected()'s two.
        assert [r["checked"] for r in results] == [kinds * (2 * 2 * c + 2) for c in calls]
    elif name == "unfused":
        inputs = uneven_inputs(world)[0]
        rows = sum(rows_of(r, c) for r in range(world) for c in range(inputs[r]))
        assert results == [rows] * world
    elif name == "peer_failure":
        failing = world - 1
        assert results[failing] == {"error": "own", "message": "the model failed"}
        for rank in range(failing):
            assert results[rank]["error"] == "PeerFailure", results[rank]
            assert f"rank {failing} failed" in results[rank]["message"]
            assert "the model failed" in results[rank]["message"]
    elif name == "outside_join":
        sizes = [sum(rows_of(r, c) for r in range(world)) for c in range(3)]
        assert results == [sizes] * world
    elif name == "dtypes":
        assert all(r == results[0] for r in results)
        assert results[0]["numpy"] == ["bool", "uint8", "int32", "float64", "complex64"]
        assert results[0]["torch"] == ["torch.bfloat16", "torch.float16", "torch.bool"]
    elif name == "big_rows":
        assert all(r == results[0] for r in results)
        # The inline capacity follows the largest data under the limit.
        assert results[0][0] == 8 * 8 * (10 + world - 1)
        assert max(results[0]) <= 1 << 16
    elif name == "mismatch":
        check_mismatch(results, world)
    elif name == "bad_inputs":
        check_bad_inputs(results[0], world)
        assert all(r == results[0] for r in results)
    elif name == "thirteen_samples":
        check_thirteen(results, world)
    elif name == "accelerate_metrics":
        check_accelerate(results, world)
    else:  # pragma: no cover - a scenario without a check
        raise AssertionError(f"no check for scenario {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
