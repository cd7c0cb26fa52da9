"""Exact shards (``joinkit.adapters.torch.data``): every sample once, nothing padded or dropped.

- In one process, each rank's sampler built with its rank: ``ShardSampler``
  against torch's own ``DistributedSampler`` (the same order minus the
  padding), and ``ShardSampler`` / ``ShardedIterable`` in real DataLoaders
  with 0 and 2 worker processes, worlds 2, 3, 4 and 0, 1, 13, 1000 samples:
  the union over ranks is the dataset with no duplicates, rank shards differ
  by at most one. Hugging Face's ``split_dataset_by_node`` and webdataset tar
  shards likewise.
- On real gloo ranks (``programs/data_scenarios.py``, one launch per world for
  every scenario): DDP under ``Join([model])`` over each kind of shard, every
  sample consumed once, the parameters equal a single-process reference.
- Under a real ``mpirun -n 2``: ``ShardSampler(group=MPI.COMM_WORLD)``
  without torch.distributed (``programs/data_shards.py``).
"""

from __future__ import annotations

import io
import os
import re
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from support import launch_ranks, run_scenarios, scenario_names, scenario_records  # noqa: E402
from support.mpi import explain, run_mpi, tagged  # noqa: E402
from torch.utils.data import (  # noqa: E402
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
)

from joinkit.adapters.torch.data import ShardedIterable, ShardSampler, shard_size  # noqa: E402
from joinkit.backends.threads import spawn  # noqa: E402

WORLDS = (2, 3, 4)
LENGTHS = (0, 1, 13, 1000)
WORKER = Path(__file__).parent / "programs" / "data_scenarios.py"
SHARD_SIZES = [4, 1, 3, 0, 5]  # 13 samples in uneven webdataset-style shards
# One launch of real processes runs many cases; a hung one is killed at this
# deadline (the tests that start a launch get a pytest timeout above it).
LAUNCH_TIMEOUT = 180.0
launching = pytest.mark.timeout(240)


def assert_exact(shards: list[list[int]], length: int) -> None:
    """The ranks' shards together are ``range(length)``, each index once,
    and their lengths differ by at most one."""
    everything = [i for shard in shards for i in shard]
    assert sorted(everything) == list(range(length))
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1, sizes


class Ids(Dataset[tuple[int, int]]):
    """Sample ``i`` is ``(i, pid of the process that loaded it)``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, os.getpid()


class Stream(IterableDataset[tuple[int, int]]):
    """``range(n)`` as a stream, each element tagged with the reading pid."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((i, os.getpid()) for i in range(self.n))


def load(loader: DataLoader[Any]) -> tuple[list[int], set[int]]:
    """The ids a DataLoader yields, in order, and the pids that loaded them."""
    ids: list[int] = []
    pids: set[int] = set()
    for batch_ids, batch_pids in loader:
        ids += batch_ids.tolist()
        pids.update(batch_pids.tolist())
    return ids, pids


# -- ShardSampler against torch's DistributedSampler -------------------------------------


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("world", WORLDS)
def test_shard_sampler_is_distributed_samplers_order_minus_the_padding(
    world: int, length: int
) -> None:
    data = range(length)
    for shuffle in (True, False):
        orders = []
        for seed, epoch in ((0, 0), (0, 1), (7, 3)):
            shards = []
            padding = 0
            for rank in range(world):
                ours = ShardSampler(data, world, rank, shuffle=shuffle, seed=seed)
                theirs = DistributedSampler(data, world, rank, shuffle=shuffle, seed=seed)
                ours.set_epoch(epoch)
                theirs.set_epoch(epoch)
                got, padded = list(ours), list(theirs)
                assert got == padded[: len(got)]  # the same order, a prefix
                assert len(ours) == ours.num_samples == len(got) == shard_size(length, world, rank)
                padding += len(padded) - len(got)
                shards.append(got)
            assert_exact(shards, length)
            # What is left out is exactly DistributedSampler's padding.
            assert padding == theirs.total_size - length
            orders.append(shards)
        if shuffle and length == 1000:
            assert orders[0] != orders[1] != orders[2]  # set_epoch and seed reshuffle


@pytest.mark.launches
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("world", WORLDS)
def test_shard_sampler_in_a_dataloader(world: int, num_workers: int) -> None:
    for length in LENGTHS:
        for shuffle in (True, False) if num_workers == 0 else (True,):
            shards = []
            for rank in range(world):
                sampler = ShardSampler(Ids(length), world, rank, shuffle=shuffle, seed=length)
                sampler.set_epoch(1)
                loader = DataLoader(Ids(length), batch_size=8, sampler=sampler,
                                    num_workers=num_workers)
                ids, pids = load(loader)
                assert ids == list(sampler)
                if ids and num_workers:  # loaded by worker processes
                    assert os.getpid() not in pids
                shards.append(ids)
            assert_exact(shards, length)


# -- ShardedIterable: rank x DataLoader worker --------------------------------------------


@pytest.mark.launches
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("world", WORLDS)
def test_sharded_iterable_reads_each_element_on_one_worker_of_one_rank(
    world: int, num_workers: int
) -> None:
    for length in LENGTHS:
        # A stream (every reader skips what is not its own) and a map-style
        # dataset (a reader loads only its own elements).
        sources: list[Any] = [Stream(length)]
        if num_workers == 0 or length == 13:  # (worker processes cost seconds)
            sources.append(Ids(length))
        for source in sources:
            shards = []
            for rank in range(world):
                dataset = ShardedIterable(source, world, rank)
                ids, pids = load(DataLoader(dataset, batch_size=4, num_workers=num_workers))
                if isinstance(source, Ids):
                    assert len(dataset) == len(ids)
                # Rank r holds elements r, r + W, ...: ShardSampler's without shuffling.
                assert sorted(ids) == list(ShardSampler(range(length), world, rank,
                                                        shuffle=False))
                if num_workers and len(ids) >= 2:  # both workers read
                    assert len(pids) == 2 and os.getpid() not in pids
                shards.append(ids)
            assert_exact(shards, length)


def test_sharded_iterable_loads_only_its_own_elements() -> None:
    loaded: list[int] = []

    class Counting(Ids):
        def __getitem__(self, i: int) -> tuple[int, int]:
            loaded.append(i)
            return super().__getitem__(i)

    assert [i for i, _ in ShardedIterable(Counting(13), 3, 1)] == [1, 4, 7, 10]
    assert loaded == [1, 4, 7, 10]


def write_shards(folder: Path, sizes: list[int]) -> list[str]:
    """webdataset-style tar shards of ``sizes`` samples (``KEY.id`` members)."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = iter(range(sum(sizes)))
    paths = []
    for number, size in enumerate(sizes):
        path = folder / f"shard-{number:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for _ in range(size):
                data = str(next(ids)).encode()
                member = tarfile.TarInfo(f"sample{data.decode():0>6}.id")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
        paths.append(str(path))
    return paths


def read_shard(path: str) -> Iterator[tuple[int, str, int]]:
    """A shard's samples as ``(id, shard, pid)``, read with webdataset's own reader."""
    import webdataset as wds

    for sample in wds.tarfile_to_samples()(iter([{"url": path}])):
        yield int(sample["id"]), sample["__url__"], os.getpid()


@pytest.mark.launches
@pytest.mark.parametrize("world", WORLDS)
def test_webdataset_shards_are_each_read_by_one_reader(world: int, tmp_path: Path) -> None:
    sizes = SHARD_SIZES + [2, 6, 1]  # 8 shards: some readers get two, some none
    paths = write_shards(tmp_path, sizes)
    readers: dict[str, set[tuple[int, int]]] = {}
    everything = []
    for rank in range(world):
        dataset = ShardedIterable(paths, world, rank, expand=read_shard)
        loader = DataLoader(dataset, batch_size=3, num_workers=2)
        for ids, shards, pids in loader:
            everything += ids.tolist()
            for shard, pid in zip(shards, pids.tolist(), strict=True):
                readers.setdefault(shard, set()).add((rank, pid))
        with pytest.raises(TypeError, match="expand= makes the number"):
            len(dataset)
    assert sorted(everything) == list(range(sum(sizes)))
    # Every non-empty shard was read by exactly one worker of one rank, rank i % W.
    assert set(readers) == {p for p, n in zip(paths, sizes, strict=True) if n}
    for shard, who in readers.items():
        assert len(who) == 1, (shard, who)
        assert next(iter(who))[0] == paths.index(shard) % world


# -- Hugging Face datasets -------------------------------------------------------------


@pytest.mark.launches
@pytest.mark.parametrize("world", WORLDS)
def test_hf_split_dataset_by_node_is_exact(world: int) -> None:
    from datasets import Dataset as HFDataset
    from datasets.distributed import split_dataset_by_node

    for length in LENGTHS:
        table = HFDataset.from_dict({"id": list(range(length))})
        if 0 < length < world:
            # datasets 5.2.0 cannot split fewer rows than ranks (its shard()
            # indexes past the end); ShardSampler can (docs/data.md, limits).
            with pytest.raises(IndexError, match="out of range"):
                split_dataset_by_node(table, rank=world - 1, world_size=world)
            continue
        shards = [list(split_dataset_by_node(table, rank=r, world_size=world)["id"])
                  for r in range(world)]
        assert_exact(shards, length)
        if not length:
            continue  # (an empty table has no iterable form)
        # Its iterable form, through real DataLoader workers.
        stream = table.to_iterable_dataset(num_shards=min(2, length)).with_format("torch")
        shards = []
        for rank in range(world):
            part = split_dataset_by_node(stream, rank=rank, world_size=world)
            shards.append([int(i) for b in DataLoader(part, batch_size=4, num_workers=2)
                           for i in b["id"]])
        everything = sorted(i for shard in shards for i in shard)
        assert everything == list(range(length))


# -- rank and world size ---------------------------------------------------------------


def test_group_gives_rank_and_world_size() -> None:
    def rank_fn(group: Any) -> Any:
        sampler = ShardSampler(range(13), group=group, shuffle=False)
        iterable = ShardedIterable(list(range(13)), group=group)
        return sampler.rank, sampler.num_replicas, list(sampler), list(iterable)

    results = spawn(rank_fn, 3, timeout=60)
    assert [r[:2] for r in results] == [(rank, 3) for rank in range(3)]
    assert [r[2] for r in results] == [r[3] for r in results] == [
        list(range(rank, 13, 3)) for rank in range(3)]


def test_errors_say_what_was_wrong_and_what_to_do() -> None:
    data = range(13)
    with pytest.raises(ValueError) as drop:
        ShardSampler(data, 2, 0, drop_last=True)
    assert "never drops a sample" in str(drop.value)
    assert "pass drop_last=True to the DataLoader" in str(drop.value)
    assert "DistributedSampler(drop_last=True)" in str(drop.value)
    for rank in (2, -1):
        with pytest.raises(ValueError) as bad:
            ShardSampler(data, 2, rank)
        assert str(bad.value).startswith(
            f"Invalid rank {rank}, rank should be in the interval [0, 1] (num_replicas=2)")
        with pytest.raises(ValueError, match=f"Invalid rank {rank}"):
            ShardedIterable(list(data), 2, rank)
    with pytest.raises(ValueError, match="Invalid num_replicas 0"):
        ShardSampler(data, 0, 0)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        ShardSampler(data)  # no process group in this process
    with pytest.raises(ValueError, match="either group= or num_replicas=/rank="):
        ShardSampler(data, 2, 0, group=object())
    with pytest.raises(TypeError, match="no backend for a join_process_group"):
        ShardSampler(data, group=object())
    with pytest.raises(TypeError, match="one-shot iterator"):
        ShardedIterable((i for i in data), 2, 0)
    with pytest.raises(ValueError, match="length must be >= 0"):
        shard_size(-1, 2, 0)


def test_without_torch_the_import_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    monkeypatch.delitem(sys.modules, "joinkit.adapters.torch.data")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'joinkit\[torch\]'"):
        importlib.import_module("joinkit.adapters.torch.data")


# -- under Join with DDP, real gloo ranks ----------------------------------------------


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every scenario of ``programs/data_scenarios.py`` on ``world`` gloo ranks."""
    world = request.param
    out = tmp_path_factory.mktemp(f"data_world{world}")
    write_shards(out / "shards", SHARD_SIZES)
    return run_scenarios(WORKER, world, out, scenario_names(WORKER), LAUNCH_TIMEOUT)


SCENARIOS = scenario_names(WORKER)


@pytest.mark.launches
@launching
@pytest.mark.parametrize("name", SCENARIOS)
def test_ddp_under_join_consumes_every_sample_once_and_matches_one_process(
    ranks: Any, name: str
) -> None:
    results = [r["result"] for r in scenario_records(ranks, name)]
    world = len(results)
    epochs = results[0]["epochs"]
    for epoch, per_rank in enumerate(epochs):
        ids = [i for batches in per_rank for batch in batches for i in batch]
        length = 1 if name == "ddp_shard_sampler_group_workers" and epoch == 1 else 13
        assert sorted(ids) == list(range(length)), (epoch, per_rank)
        counts = [sum(len(b) for b in batches) for batches in per_rank]
        if name != "ddp_webdataset_shards":  # whole shards go to one reader
            assert max(counts) - min(counts) <= 1, counts
    if name == "ddp_webdataset_shards":
        # shard i on rank i % W: world 2 holds 4+3+5 vs 1+0, world 3 4+0, 1+5, 3
        per_rank = [sum(n for i, n in enumerate(SHARD_SIZES) if i % world == r)
                    for r in range(world)]
        assert [sum(len(b) for b in batches) for batches in epochs[0]] == per_rank
        # A rank whose two readers both hold samples read with two real workers.
        assert [0, 1] in [result["workers"] for result in results]
    if name in ("ddp_shard_sampler", "ddp_shard_sampler_active_ranks"):
        assert epochs[0] != epochs[1]  # set_epoch reshuffled
    for result in results:
        assert result["epochs"] == epochs
        assert result["params"] == results[0]["params"]
        assert result["params"] == pytest.approx(result["reference"], abs=1e-12)
        assert result["params"] != pytest.approx(result["other_divisor"], abs=1e-6)


def test_every_scenario_is_collected() -> None:
    assert SCENARIOS == [
        "ddp_shard_sampler", "ddp_shard_sampler_active_ranks", "ddp_shard_sampler_group_workers",
        "ddp_hf_split_dataset_by_node", "ddp_webdataset_shards",
    ]


# -- under mpirun ----------------------------------------------------------------------


@pytest.mark.launches
@launching
def test_shard_sampler_group_under_mpirun() -> None:
    program = Path(__file__).parent / "programs" / "data_shards.py"
    result = run_mpi(program, 2, timeout=LAUNCH_TIMEOUT)
    lines = sorted(tagged(result.stdout, "JOINKIT-DATA"), key=lambda line: line["rank"])
    assert result.returncode == 0 and len(lines) == 2, explain(result)
    assert [line["sampler"] for line in lines] == [[0, 2], [1, 2]]
    # DistributedSampler's order minus its padding: 7 + 6, not 7 + 7.
    for line in lines:
        assert line["ids"] == line["distributed_sampler"][: len(line["ids"])]
    assert [len(line["ids"]) for line in lines] == [7, 6]
    assert sorted(lines[0]["ids"] + lines[1]["ids"]) == list(range(13))
    # The last joiner's all-reduces summed every batch of both ranks.
    assert lines[0]["totals"] == [float(sum(range(13))), 13.0]


# -- docs/data.md's examples run -------------------------------------------------------

DOC = Path(__file__).resolve().parents[3] / "docs" / "data.md"


def doc_blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.S)


@pytest.mark.launches
@launching
def test_the_docs_examples_run(tmp_path: Path) -> None:
    """The first block prints what the page says; the second trains under torchrun."""
    from support.mpi import child_env

    first, second = doc_blocks("python")[:2]
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    (tmp_path / "compare.py").write_text(first)
    (tmp_path / "train.py").write_text(second)
    torchrun = Path(sys.executable).with_name("torchrun")
    compare, train = launch_ranks(
        [[sys.executable, str(tmp_path / "compare.py")],
         # Each rank's stdout to its own file (the ranks' lines interleave on one pipe).
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "--redirects", "1",
         "--log-dir", str(tmp_path / "logs"), str(tmp_path / "train.py")]],
        timeout=LAUNCH_TIMEOUT, env=env, cwd=tmp_path,
    )
    assert compare.returncode == 0, compare.stdout
    assert compare.stdout == doc_blocks("text")[0]
    assert train.returncode == 0, train.stdout
    logs = sorted((tmp_path / "logs").rglob("stdout.log"), key=lambda p: p.parent.name)
    assert [log.read_text().splitlines() for log in logs] == [
        [f"rank {rank} epoch {epoch}: {7 - rank} samples" for epoch in range(2)]
        for rank in range(2)], train.stdout
