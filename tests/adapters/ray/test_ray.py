"""Ray Train's TorchTrainer on a local Ray cluster (2 CPU workers, gloo).

One Ray cluster for the module (``ray.init(num_cpus=4)``, shut down at the
end); one fixture runs every trainer once and the tests read what each left:

- ``joinkit``: ``examples/ray_train.py``'s training function (per-worker data
  of 4 and 7 batches per epoch, 2 epochs, ``Join([model, report])`` with a
  report per step), after ``python -m joinkit doctor`` on both workers: exact
  against the single-process reference, every worker reports as often, the
  doctor names Ray and builds its world of 2 without touching the port Ray's
  store holds;
- ``naive``: the same loop with ``ray.train.report`` itself inside
  ``Join([model])`` (the issue's case): the worker that joins shadows DDP's
  all-reduce while the other waits for it in the report's barrier, so the run
  fails at the process group's timeout (10 s here; 30 minutes by default);
- in the ``joinkit`` run too, first: ``report`` inside a Join that does not
  list it, a ``LocalProtocolError`` on every worker before anything collective;
  last: a Join over each worker's ``ray.data`` shard from
  ``streaming_split(2, equal=False)`` (split while read: every row once, exact
  against a replay of the recorded batches).

The cluster has 4 logical CPUs: 2 for the workers, 2 for ray.data's tasks.

Without a cluster, ``report`` is also checked on the threads backend against a
fake ``ray.train`` whose report is a barrier (the shadow rounds line up).
Takes about 1 to 3 minutes on 2 busy cores (Ray's start-up ~15 s, each
trainer ~20-60 s).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("ray.train")

import torch  # noqa: E402

from joinkit import Join, LocalProtocolError  # noqa: E402
from joinkit.adapters import ray as ray_adapter  # noqa: E402
from joinkit.backends.threads import ThreadGroup, spawn  # noqa: E402

pytestmark = pytest.mark.needs_torch

ROOT = Path(__file__).resolve().parents[3]
CLUSTER_TIMEOUT = 600  # the fixture: Ray's start and three trainers on 2 busy cores
NAIVE_PG_TIMEOUT_S = 10
# The ray.data phase: rows 0..DATA_ROWS-1, split while read (equal=False).
DATA_ROWS = 23  # odd, with batches of one row: the workers' step counts must differ
DATA_BATCH = 1
DATA_LR = 0.5


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("ray_train_example",
                                                  ROOT / "examples" / "ray_train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


example = _example()


def train_with_doctor(config: dict[str, Any]) -> None:
    """The doctor on every worker, ``report`` in a Join that does not list it, then
    the example's training function (one trainer run for the three)."""
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    env = {**os.environ, "JOINKIT_DOCTOR_TIMEOUT": "60"}
    done = subprocess.run([sys.executable, "-m", "joinkit", "doctor"], capture_output=True,
                          text=True, timeout=120, env=env)
    Path(config["out"], f"doctor{rank}.json").write_text(json.dumps(
        {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr[-3000:]}))
    train_unlisted(config)
    example.train_func(config)
    train_on_a_data_shard(config)


def train_on_a_data_shard(config: dict[str, Any]) -> None:
    """A Join over this worker's ``streaming_split(equal=False)`` shard (no row dropped).

    Which rows each worker gets is decided while they read; each records its
    batches, and the reference replays them.
    """
    import ray.train
    import ray.train.torch

    from joinkit.adapters.ray import report

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=DATA_LR)
    rows, before = [], report.reports  # the same report object as the example's
    with Join([model, report]):
        for batch in config["shards"][rank].iter_torch_batches(batch_size=DATA_BATCH):
            ids = batch["id"]
            rows.append(ids.tolist())
            x = ids.float().unsqueeze(1) / DATA_ROWS
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), 0.5 * x + 1.0).backward()
            optimizer.step()
            report({"rows": sum(len(r) for r in rows)})
    Path(config["out"], f"shard{rank}.json").write_text(json.dumps({
        "rows": rows, "reports": report.reports - before,
        "weights": [p.detach().flatten().tolist() for p in model.parameters()]}))


def shard_reference(per_rank: list[list[list[int]]]) -> list[list[float]]:
    """One process replaying the workers' recorded batches, step by step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=DATA_LR)
    for step in range(max(len(rows) for rows in per_rank)):
        optimizer.zero_grad()
        for rows in per_rank:
            if step < len(rows):
                x = torch.tensor(rows[step]).float().unsqueeze(1) / DATA_ROWS
                (torch.nn.functional.mse_loss(model(x), 0.5 * x + 1.0) / 2).backward()
        optimizer.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def train_naive(config: dict[str, Any]) -> None:
    """The issue's loop: ``ray.train.report`` itself inside ``Join([model])``."""
    import ray.train
    import ray.train.torch

    rank = ray.train.get_context().get_world_rank()
    model = ray.train.torch.prepare_model(example.make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=example.LR)
    with Join([model]):
        for step in range(example.batch_count(rank)):
            x, y = example.make_batch(rank, 0, step)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            ray.train.report({"loss": loss.item()})


def train_unlisted(config: dict[str, Any]) -> None:
    """``report`` in a Join that does not list it: an error before any collective."""
    import ray.train
    import ray.train.torch

    from joinkit.adapters.ray import report

    rank = ray.train.get_context().get_world_rank()
    model = ray.train.torch.prepare_model(example.make_model())
    error = ""
    try:
        with Join([model]):
            report({"loss": 0.0})
    except LocalProtocolError as caught:
        error = str(caught)
    Path(config["out"], f"unlisted{rank}.json").write_text(json.dumps(
        {"error": error, "reports": report.reports}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import ray
    import ray.cloudpickle
    import ray.data

    # The workers cannot import this file or the example: ship them by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(example)
    # Ray Train's controller polls its workers every 2 s by default: a report
    # waits for the previous one to be taken, and a failure is seen late.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    started = time.monotonic()
    # 2 CPUs for the 2 workers, 2 more (logical) for ray.data's split coordinator
    # and read tasks: with 2 in all they wait for a CPU forever.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    out: dict[str, Any] = {"start_s": time.monotonic() - started}
    try:
        shards = ray.data.range(DATA_ROWS).streaming_split(2, equal=False)
        for name, function, timeout_s, config in [
            ("joinkit", train_with_doctor, 1800, {"shards": shards}),
            ("naive", train_naive, NAIVE_PG_TIMEOUT_S, {}),
        ]:
            folder = tmp_path_factory.mktemp(name)
            began = time.monotonic()
            try:
                result: Any = example.fit(str(folder), timeout_s=timeout_s, function=function,
                                          config=config)
            except Exception as error:  # the naive run fails; fit raises its error
                result = error
            out[name] = {"folder": folder, "result": result,
                         "seconds": time.monotonic() - began}
    finally:
        ray.shutdown()
    print(f"ray start {out['start_s']:.1f} s, " + ", ".join(
        f"{name} {out[name]['seconds']:.1f} s" for name in ("joinkit", "naive") if name in out),
        file=sys.stderr)
    return out


@pytest.mark.launches
@pytest.mark.timeout(CLUSTER_TIMEOUT)
def test_torchtrainer_with_report_in_the_join_is_exact(runs: dict[str, Any]) -> None:
    run = runs["joinkit"]
    result = run["result"]
    assert not isinstance(result, Exception), result
    workers = [json.loads((run["folder"] / f"worker{r}.json").read_text()) for r in range(2)]
    longest = max(example.batch_count(r) for r in range(2)) * example.EPOCHS
    assert [w["batches"] for w in workers] == [
        example.batch_count(r) * example.EPOCHS for r in range(2)]
    # Every worker reported once per step of the longest worker, shadows included.
    assert [w["reports"] for w in workers] == [longest, longest]
    want = example.reference()
    for worker in workers:
        for got, expected in zip(worker["weights"], want, strict=True):
            assert got == pytest.approx(expected, abs=1e-6)
    assert example.summary(str(run["folder"])) == [
        "worker 0: 8 batches, 14 reports",
        "worker 1: 14 batches, 14 reports",
        "weights equal the single-process reference",
    ]
    # Ray Train's own result: rank 0's metrics of the last report, with its checkpoint.
    assert result.metrics == {"batches": 8, "reports": longest, "rank": 0}
    with result.checkpoint.as_directory() as folder:
        saved = json.loads(Path(folder, "weights.json").read_text())
    assert saved == workers[0]["weights"]


@pytest.mark.launches
@pytest.mark.timeout(CLUSTER_TIMEOUT)
def test_a_streaming_split_shard_without_equal_loses_no_row_and_is_exact(
    runs: dict[str, Any],
) -> None:
    folder = runs["joinkit"]["folder"]
    workers = [json.loads((folder / f"shard{r}.json").read_text()) for r in range(2)]
    per_rank = [w["rows"] for w in workers]
    # Every row once (Ray Train's own split, equal=True, would drop rows to even it).
    assert sorted(i for rows in per_rank for batch in rows for i in batch) == list(
        range(DATA_ROWS))
    longest = max(len(rows) for rows in per_rank)
    assert min(len(rows) for rows in per_rank) < longest  # a worker joined
    assert [w["reports"] for w in workers] == [longest, longest]
    want = shard_reference(per_rank)
    for worker in workers:
        for got, expected in zip(worker["weights"], want, strict=True):
            assert got == pytest.approx(expected, abs=1e-6)


@pytest.mark.launches
@pytest.mark.timeout(CLUSTER_TIMEOUT)
def test_doctor_in_a_ray_train_worker_names_ray_and_builds_the_world(
    runs: dict[str, Any],
) -> None:
    folder = runs["joinkit"]["folder"]
    doctors = [json.loads((folder / f"doctor{r}.json").read_text()) for r in range(2)]
    assert [d["rc"] for d in doctors] == [0, 0], doctors
    text = doctors[0]["stdout"]
    assert text.startswith("joinkit doctor: 2 ranks\n"), text
    flat = " ".join(text.split())  # the columns' alignment aside
    assert "launcher ray (a Ray Train worker, or a subprocess of one)" in flat
    assert "backend torch (ray's usual backend)" in flat
    assert "built 2 ranks (TorchGroup)" in flat
    assert "EADDRINUSE" not in text + doctors[0]["stderr"]
    assert doctors[1]["stdout"] == ""


@pytest.mark.launches
@pytest.mark.timeout(CLUSTER_TIMEOUT)
def test_report_missing_from_the_join_is_an_error_on_every_worker(
    runs: dict[str, Any],
) -> None:
    folder = runs["joinkit"]["folder"]
    for rank in range(2):
        got = json.loads((folder / f"unlisted{rank}.json").read_text())
        assert got["reports"] == 0
        assert "inside a `with Join(...)` block that does not list it" in got["error"]


@pytest.mark.launches
@pytest.mark.timeout(CLUSTER_TIMEOUT)
def test_naive_report_inside_join_deadlocks_until_the_process_group_timeout(
    runs: dict[str, Any],
) -> None:
    import ray.train

    run = runs["naive"]
    error = run["result"]
    assert isinstance(error, ray.train.WorkerGroupError), error
    # The joined worker's count all-reduce times out in gloo: a timeout naming
    # nothing of Ray's report.
    assert "timed out" in str(error).lower() or "timeout" in str(error).lower(), str(error)
    assert run["seconds"] >= NAIVE_PG_TIMEOUT_S


# -- without a cluster: report's shadow rounds against a fake ray.train ---------------


class _FakeRayTrain:
    """``ray.train.report`` as Ray Train 2.x makes it: a barrier of all workers."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=20)
        self.reports: list[tuple[int, dict[str, Any], Any]] = []
        self.lock = threading.Lock()
        self.rank = threading.local()

    def report(self, metrics: dict[str, Any], checkpoint: Any = None, **kwargs: Any) -> None:
        with self.lock:
            self.reports.append((self.rank.value, dict(metrics), checkpoint))
        self.barrier.wait()


SHADOW_METRICS: dict[str, Any] = {
    "last": None,
    "dict": {"loss": -1.0},
    "callable": lambda last: {**last, "joined": True},
}


def _shadowed(kind: str, last: dict[str, Any]) -> dict[str, Any]:
    return {"last": last, "dict": {"loss": -1.0}, "callable": {**last, "joined": True}}[kind]


@pytest.mark.parametrize("kind", list(SHADOW_METRICS))
def test_joined_workers_report_once_per_shadow_round(
    monkeypatch: pytest.MonkeyPatch, kind: str,
) -> None:
    from support import Counter

    inputs = [2, 5, 0]
    fake = _FakeRayTrain(len(inputs))
    monkeypatch.setattr(ray_adapter, "_ray_train", lambda: fake)

    def rank_fn(group: ThreadGroup) -> int:
        fake.rank.value = group.rank
        report = ray_adapter.Report(shadow_metrics=SHADOW_METRICS[kind])
        counter = Counter(group)
        with Join([counter, report]):
            for step in range(inputs[group.rank]):
                counter()
                report({"loss": float(step), "rank": group.rank}, checkpoint=f"c{step}")
        return int(report.reports)

    longest = max(inputs)
    assert spawn(rank_fn, len(inputs), timeout=30) == [longest] * len(inputs)
    for rank, n in enumerate(inputs):
        mine = [(metrics, checkpoint) for r, metrics, checkpoint in fake.reports if r == rank]
        assert mine[:n] == [({"loss": float(s), "rank": rank}, f"c{s}") for s in range(n)]
        last = {"loss": float(n - 1), "rank": rank} if n else {}
        assert mine[n:] == [(_shadowed(kind, last), None)] * (longest - n)


def test_report_in_a_join_that_does_not_list_it_raises_before_reporting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from support import Counter

    fake = _FakeRayTrain(1)
    monkeypatch.setattr(ray_adapter, "_ray_train", lambda: fake)

    def rank_fn(group: ThreadGroup) -> None:
        fake.rank.value = group.rank
        report = ray_adapter.Report()
        with Join([Counter(group)]):
            report({"loss": 1.0})

    with pytest.raises(LocalProtocolError, match="does not list it"):
        spawn(rank_fn, 1, timeout=30)
    assert fake.reports == []


def test_bad_shadow_metrics_are_refused() -> None:
    with pytest.raises(TypeError, match="shadow_metrics"):
        ray_adapter.Report(shadow_metrics=3)  # type: ignore[arg-type]


def test_the_docs_show_the_example_as_it_is() -> None:
    import re

    page = (ROOT / "docs" / "ray.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert blocks and all(block in (ROOT / "examples" / "ray_train.py").read_text()
                          for block in blocks)


def test_the_range_is_the_extras_with_no_upper_bound() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("ray = "))
    assert f'"ray[train]{ray_adapter.SUPPORTED_RAY}"' in line
    assert ray_adapter.SUPPORTED_RAY == f">={ray_adapter.TESTED_RAY[0]}"
    pin = f"ray=={ray_adapter.TESTED_RAY[-1]}"
    assert pin in (ROOT / "constraints.txt").read_text().splitlines()
