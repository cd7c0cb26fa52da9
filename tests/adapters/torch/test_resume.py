"""Exact resume and take-over: ``ShardSampler.state_dict`` / ``load_state_dict`` / ``take_over``.

In this process (cheap, many cells):

- real Joins on the threads backend (a Counter, one batch per iteration, a
  real DataLoader): an epoch stopped after ``K`` iterations on ``W1`` ranks,
  every rank's ``state_dict()`` the same, resumed on ``W2`` ranks to the end:
  every sample exactly once, and exactly the samples ``exact_plan`` says;
  chains of resumes; a state taken after the Join, where a rank that ran out
  early counts the others' rounds from its shadow rounds;
- the take-over bookkeeping over many worlds and kill points, with a Join
  that reports a lost rank (the threads backend cannot lose one), against
  ``exact_plan``;
- every refusal (bad input).

On real gloo ranks (``programs/exact_runner.py``, one launch for many cells):
the resume matrix (3->2, 2->3, 2->4; DataLoader with 0 and 2 workers;
torchdata's StatefulDataLoader), and the take-over matrix (kills in the loop
body, after the heartbeat, after the gradient all-reduce, while draining;
worlds 3 and 4); forked ranks, ``mpirun --with-ft ulfm`` and
``python -m joinkit run``. Each cell checks exactly-once by sample ids and
the parameters against a float64 reference over exactly that sequence.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import exact_plan as plan  # noqa: E402
from support import Counter  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from joinkit import Join, JoinReport, LostRank  # noqa: E402
from joinkit.adapters.torch import data as data_module  # noqa: E402
from joinkit.adapters.torch.data import ShardSampler  # noqa: E402
from joinkit.backends.threads import spawn  # noqa: E402

PROGRAMS = Path(__file__).resolve().parent / "programs"
RUNNER = PROGRAMS / "exact_runner.py"
SEED = 7


class Ids(torch.utils.data.Dataset):  # type: ignore[misc]
    """Sample ``i`` is ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


# -- real Joins on the threads backend ---------------------------------------------------


def _first(group: Any, n: int, batch: int, stop: int | None, shuffle: bool,
           state: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[int],
                                                        dict[str, Any]]:
    """One rank: (load ``state``,) train until ``stop`` iterations (or the end);
    return the state taken in the loop after ``stop``, the ids trained, and the
    state taken after the Join."""
    sampler = ShardSampler(Ids(n), group=group, seed=SEED, shuffle=shuffle, batch_size=batch)
    if state is not None:
        sampler.load_state_dict(state)
    loader = DataLoader(Ids(n), sampler=sampler, batch_size=batch)
    counter = Counter(group)
    trained: list[int] = []
    inside: dict[str, Any] = {}
    with Join([counter]):
        for index, ids in enumerate(loader):
            counter()
            trained += ids.tolist()
            if stop is not None and index + 1 == stop:
                inside = sampler.state_dict()
                break
    return inside, trained, sampler.state_dict()


def _run(world: int, *args: Any) -> list[Any]:
    return spawn(_first, world, args, timeout=60)


WORLDS = [(3, 2), (2, 3), (2, 4), (4, 1), (1, 3)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("before", "after"), WORLDS)
def test_resume_on_another_world_is_exact(before: int, after: int) -> None:
    for n, batch, stop, shuffle in itertools.product((13, 29), (1, 2, 3), (1, 2),
                                                     (True, False)):
        first = _run(before, n, batch, stop, shuffle)
        # In the loop on the ranks that got that far; after the Join on all.
        states = [inside or end for inside, _, end in first]
        assert all(state == states[0] for state in states), (n, batch, stop)
        state = states[0]
        assert all(end == state for _, _, end in first)  # broke right after
        second = _run(after, n, batch, None, shuffle, state)
        trained_first = [i for _, ids, _ in first for i in ids]
        trained_second = [i for _, ids, _ in second for i in ids]
        assert sorted(trained_first + trained_second) == list(range(n)), (n, batch, stop)
        # Exactly the plan: each rank's samples, in order.
        if shuffle:
            epoch = plan.resume_epoch(n, SEED, 0, batch, before, after, stop)
            for rank, (_, ids, _) in enumerate(first):
                assert ids == epoch.passes[0].consumed_ids(rank)
            for rank, (_, ids, _) in enumerate(second):
                assert ids == epoch.passes[1].consumed_ids(rank)
        for _, _, end in second:  # the epoch is done
            assert end["remaining"] == [] and end["epoch"] == 0


@pytest.mark.timeout(120)
def test_a_chain_of_resumes_on_changing_worlds() -> None:
    n, batch = 41, 2
    state = None
    trained: list[int] = []
    for world, stop in ((3, 2), (2, 3), (4, 1), (1, None)):
        results = _run(world, n, batch, stop, True, state)
        trained += [i for _, ids, _ in results for i in ids]
        states = [inside or end for inside, _, end in results]
        assert all(s == states[0] for s in states)
        state = states[0]
    assert sorted(trained) == list(range(n))
    assert state is not None and state["remaining"] == []


def _uneven(group: Any) -> tuple[dict[str, Any], list[int], int, int]:
    """n=32 on 3 ranks, batch 1: shares 11, 11, 10; the long ranks stop after 11
    iterations (their end), rank 2 runs out after 10 and shadows one round."""
    sampler = ShardSampler(Ids(32), group=group, seed=SEED, batch_size=1)
    loader = DataLoader(Ids(32), sampler=sampler, batch_size=1, num_workers=0)
    counter = Counter(group)
    trained: list[int] = []
    with Join([counter]) as join:
        for ids in loader:
            counter()
            trained += ids.tolist()
    report = join.report
    return sampler.state_dict(), trained, report.inputs, report.shadow_rounds


def test_after_the_join_a_rank_that_ran_out_counts_its_shadow_rounds() -> None:
    results = spawn(_uneven, 3, timeout=60)
    assert [(inputs, shadow) for _, _, inputs, shadow in results] == [(11, 0), (11, 0), (10, 1)]
    states = [state for state, _, _, _ in results]
    assert states[0] == states[1] == states[2]
    assert states[0]["remaining"] == []
    assert states[0]["consumed"] == [[0, 11], [1, 11], [2, 10]]


def _stopped_by_some(group: Any) -> dict[str, Any]:
    """Ranks 0 and 1 stop after 4 iterations; rank 2 (fewer samples) after 3."""
    sampler = ShardSampler(Ids(14), group=group, seed=SEED, batch_size=1)
    loader = DataLoader(Ids(14), sampler=sampler, batch_size=1)
    counter = Counter(group)
    with Join([counter]):
        for index, _ in enumerate(loader):
            counter()
            if index + 1 == (3 if group.rank == 2 else 4):
                break
    return sampler.state_dict()


def test_a_state_after_ranks_stopped_at_different_iterations_names_the_rounds() -> None:
    # Rank 2 stopped early by its own choice: the state counts the rounds the
    # others ran (its shadow round) for every rank, as the lockstep rule says.
    # That is the documented limit: a loop must stop at the same iteration
    # on every rank (or run out).
    states = spawn(_stopped_by_some, 3, timeout=60)
    assert states[0] == states[1] == states[2]
    assert states[0]["consumed"] == [[0, 4], [1, 4], [2, 4]]


# -- StatefulDataLoader in one process (threads) ------------------------------------------


def _stateful(group: Any, n: int, stop: int, saved: Any, world_of_state: int) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = ShardSampler(Ids(n), group=group, seed=SEED, batch_size=2)
    loader = StatefulDataLoader(Ids(n), sampler=sampler, batch_size=2)
    counter = Counter(group)
    trained: list[int] = []
    if saved is not None:
        loader.load_state_dict(saved[group.rank if world_of_state == group.world_size else 0])
    state = None
    with Join([counter]):
        for index, ids in enumerate(loader):
            counter()
            trained += ids.tolist()
            if saved is None and index + 1 == stop:
                state = (loader.state_dict(), sampler.state_dict())
                break
    return state, trained


@pytest.mark.timeout(120)
def test_stateful_dataloaders_own_state_resumes_on_its_world_only() -> None:
    n = 23
    first = spawn(_stateful, 3, (n, 2, None, 3), timeout=60)
    # The sampler's state is inside the loader's, and is every rank's same state.
    sampler_states = [state[1] for state, _ in first]
    assert sampler_states[0] == sampler_states[1] == sampler_states[2]
    loader_states = [state[0] for state, _ in first]
    second = spawn(_stateful, 3, (n, 0, loader_states, 3), timeout=60)
    trained = [i for _, ids in first for i in ids] + [i for _, ids in second for i in ids]
    assert sorted(trained) == list(range(n))
    with pytest.raises(ValueError, match="resumes only on the world it was taken on"):
        spawn(_stateful, 2, (n, 0, loader_states, 3), timeout=60)


# -- the take-over bookkeeping, with a Join that reports a lost rank ----------------------


class FakeGroup:
    """What the sampler reads of a Join's group: its size and the ranks it lost
    (numbered as the group was built: here, the sampler's own numbers)."""

    def __init__(self, alive: list[int], history: list[LostRank]) -> None:
        self.world_size = len(alive)
        self.history = tuple(history)

    def lost_ranks(self) -> tuple[LostRank, ...]:
        return self.history


class FakeJoin:
    """What the sampler reads of a Join: ``report``, ``backend`` and ``on_rank_loss``."""

    def __init__(self, rank: int, alive: list[int] | None = None,
                 history: list[LostRank] | None = None) -> None:
        self.on_rank_loss = "finish"
        self.rank = rank
        self.backend = FakeGroup(alive or [], history or [])
        self._report = JoinReport(rank=rank, inputs=0, joined_at_round=None, shadow_rounds=0,
                                  seconds_shadowing=0.0, is_last_joiner=False, phase="ACTIVE")
        self.notes: list[str] = []

    def note_rank_loss(self, note: str) -> None:
        self.notes.append(note)

    @property
    def report(self) -> JoinReport:
        return self._report

    def finish(self, inputs: int, rounds: int, lost: tuple[LostRank, ...]) -> None:
        self._report = JoinReport(rank=self.rank, inputs=inputs, joined_at_round=inputs,
                                  shadow_rounds=rounds - inputs, seconds_shadowing=0.0,
                                  is_last_joiner=inputs == rounds, phase="DONE",
                                  lost_ranks=lost)


@pytest.fixture
def current(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    holder: dict[str, Any] = {"join": None}
    monkeypatch.setattr(data_module, "_current_join", lambda: holder["join"])
    yield holder


def _take_over_epochs(current: dict[str, Any], n: int, batch: int, world: int,
                      epochs: list[dict[int, tuple[str, int]]]) -> tuple[list[Any], list[Any]]:
    """Every rank's sampler through ``epochs`` (each with its kills); returns each
    epoch's consumed ids per pass per rank, and the survivors' take-over reports."""
    samplers = {r: ShardSampler(Ids(n), world, r, seed=SEED, batch_size=batch,
                                take_over=True) for r in range(world)}
    alive = list(range(world))
    history: list[LostRank] = []
    seen: list[Any] = []
    reports: list[Any] = []
    for epoch, kills in enumerate(epochs):
        passes: list[dict[int, list[int]]] = []
        for sampler in (samplers[r] for r in alive):
            sampler.set_epoch(epoch)
        runs = {r: samplers[r].passes() for r in alive}
        for r in alive:
            next(runs[r])
        first = True
        while True:
            joins = {r: FakeJoin(r, alive, history) for r in alive}
            shares: dict[int, list[int]] = {}
            for r in alive:
                current["join"] = joins[r]
                shares[r] = list(iter(samplers[r]))
            current["join"] = None
            nb = {r: -(-len(s) // batch) for r, s in shares.items()}
            done = dict(nb)
            lost = []
            if first:
                for r, (point, at) in kills.items():
                    done[r] = plan.completed(point, at, nb[r])
                    lost.append(LostRank(rank=r, iterations=done[r],
                                         survivors=tuple(x for x in alive if x not in kills),
                                         detected="test"))
            rounds = max(done.values(), default=0)
            passes.append({r: shares[r][: done[r] * batch] for r in alive})
            survivors = [r for r in alive if r not in (kills if first else {})]
            for r in survivors:
                joins[r].finish(nb[r], rounds, tuple(lost))
            history += lost
            first = False
            alive = survivors
            more = {r: next(runs[r], None) is not None for r in alive}
            assert len(set(more.values())) <= 1, more  # every survivor agrees
            if not any(more.values()):
                break
        seen.append(passes)
        reports.append([samplers[r].take_overs for r in alive])
    return seen, reports


KILLS = [("body", 0), ("body", 2), ("beat", 1), ("step", 1), ("step", 0), ("drain", 0)]


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_take_over_bookkeeping_matches_the_plan(current: dict[str, Any], world: int) -> None:
    for n, batch, (point, at), victim in itertools.product(
            (13, 30), (1, 2, 3), KILLS, range(world)):
        kills = {victim: (point, at)}
        seen, reports = _take_over_epochs(current, n, batch, world, [kills, {}])
        epoch, survivors = plan.take_over_epoch(n, SEED, 0, batch, list(range(world)), kills)
        assert len(seen[0]) == len(epoch.passes), (n, batch, point, victim)
        for got, want in zip(seen[0], epoch.passes, strict=True):
            assert got == {m: want.consumed_ids(m) for m in want.members}
        ids = [i for p in seen[0] for v in p.values() for i in v]
        assert sorted(ids) == list(range(n))  # exactly once in the epoch
        # The next epoch: the survivors share all of it.
        assert sorted(i for p in seen[1] for v in p.values() for i in v) == list(range(n))
        assert sorted(seen[1][0]) == survivors
        # The report: what the lost rank consumed, and who reads the rest.
        first_pass = epoch.passes[0]
        for takes in reports[0]:
            assert takes == reports[0][0]
        if len(epoch.passes) > 1:
            (take,) = reports[0][0]
            assert take.rank == victim
            assert list(take.consumed) == first_pass.consumed_ids(victim)
            moved = sorted(i for v in take.moved.values() for i in v)
            assert moved == sorted(set(first_pass.shares[victim])
                                   - set(first_pass.consumed_ids(victim)))
            for survivor, indices in take.moved.items():
                assert set(indices) <= set(epoch.passes[1].shares[survivor])
        else:
            assert reports[0][0] == ()


def test_two_deaths_in_one_pass_and_one_in_the_take_over_pass(current: dict[str, Any]) -> None:
    n, batch, world = 40, 2, 4
    samplers = {r: ShardSampler(Ids(n), world, r, seed=SEED, batch_size=batch,
                                take_over=True) for r in range(world)}
    seen: list[int] = []
    history: list[LostRank] = []

    def run(alive: list[int], lost: list[tuple[int, int]]) -> None:
        joins = {r: FakeJoin(r, alive, history) for r in alive}
        shares = {}
        for r in alive:
            current["join"] = joins[r]
            shares[r] = list(iter(samplers[r]))
        current["join"] = None
        dead = dict(lost)
        done = {r: (dead[r] if r in dead else -(-len(shares[r]) // batch)) for r in alive}
        rounds = max(done.values())
        survivors = tuple(r for r in alive if r not in dead)
        losses = tuple(LostRank(rank=r, iterations=c, survivors=survivors, detected="t")
                       for r, c in lost)
        for r in alive:
            seen.extend(shares[r][: done[r] * batch])
            if r not in dead:
                joins[r].finish(-(-len(shares[r]) // batch), rounds, losses)
        history.extend(losses)

    runs = {r: samplers[r].passes() for r in range(world)}
    for r in range(world):
        next(runs[r])
    run([0, 1, 2, 3], [(1, 2), (3, 4)])
    assert all(next(runs[r], None) == 1 for r in (0, 2))
    run([0, 2], [(2, 1)])
    assert next(runs[0], None) == 2
    run([0], [])
    assert next(runs[0], None) is None
    assert sorted(seen) == list(range(n))
    takes = samplers[0].take_overs
    assert [t.rank for t in takes] == [1, 3, 2]
    assert samplers[0].world == (0,)


def test_take_over_notes_the_loss_warning_with_where_the_samples_go(
        current: dict[str, Any]) -> None:
    # A loop that iterates the sampler once: the loss warning says the samples
    # are not trained and shows the loop over passes(); inside passes(): where
    # they go. A sampler without take_over adds nothing.
    plain = ShardSampler(Ids(8), 2, 0, batch_size=2, take_over=True)
    current["join"] = join = FakeJoin(0, [0, 1])
    iter(plain)
    assert join.notes == [data_module.TAKE_OVER_PLAIN_LOOP]
    note = join.notes[0]
    assert "not trained this epoch" in note
    assert ("loop over sampler.passes() around the Join:\n"
            "    for _ in sampler.passes():\n"
            "        with Join([model], on_rank_loss=\"finish\"):\n"
            "            for batch in loader:\n") in note
    looped = ShardSampler(Ids(8), 2, 0, batch_size=2, take_over=True)
    runs = looped.passes()
    next(runs)
    current["join"] = join = FakeJoin(0, [0, 1])
    iter(looped)
    assert join.notes == [data_module.TAKE_OVER_NEXT_PASS]
    assert next(runs, None) is None  # nothing lost: the generator ends
    current["join"] = join = FakeJoin(0, [0, 1])
    iter(looped)  # after passes() ended, a plain pass again
    assert join.notes == [data_module.TAKE_OVER_PLAIN_LOOP]
    current["join"] = join = FakeJoin(0, [0, 1])
    iter(ShardSampler(Ids(8), 2, 0, batch_size=2))
    assert join.notes == []


# -- refusals ----------------------------------------------------------------------------


def _state(n: int = 13, **kwargs: Any) -> dict[str, Any]:
    return ShardSampler(Ids(n), 2, 0, seed=SEED, batch_size=2, **kwargs).state_dict()


@pytest.mark.parametrize(("change", "words"), [
    ({"n": 12}, "the dataset's length: 13 in the state, 12 here"),
    ({"seed": 8}, "seed: 7 in the state, 8 here"),
    ({"shuffle": False}, "shuffle: True in the state, False here"),
])
def test_a_state_that_does_not_fit_is_refused_naming_the_difference(
        change: dict[str, Any], words: str) -> None:
    state = _state()
    n = change.pop("n", 13)
    sampler = ShardSampler(Ids(n), 3, 1, seed=change.pop("seed", SEED), batch_size=2, **change)
    with pytest.raises(ValueError, match="does not fit this sampler") as error:
        sampler.load_state_dict(state)
    assert words in str(error.value)


def test_a_state_of_another_order_is_refused() -> None:
    state = _state()
    state["order"] = "sha256:0000000000000000"  # another torch's randperm, say
    with pytest.raises(ValueError, match="the order of epoch 0 differs"):
        ShardSampler(Ids(13), 3, 1, seed=SEED).load_state_dict(state)


@pytest.mark.parametrize(("edit", "words"), [
    ({"format": "torchdata"}, "not a ShardSampler state"),
    ({"version": 99}, "state version 99"),
    ({"remaining": [[3, 2]]}, "run \\[3, 2\\] is not inside"),
    ({"remaining": [[0, 14]]}, "run \\[0, 14\\] is not inside"),
    ({"remaining": [[5, 7], [1, 2]]}, "sorted and disjoint"),
    ({"remaining": "all"}, "must be a list"),
    ({"epoch": -1}, "is not an epoch number"),
])
def test_a_damaged_state_is_refused(edit: dict[str, Any], words: str) -> None:
    state = {**_state(), **edit}
    with pytest.raises(ValueError, match=words):
        ShardSampler(Ids(13), 3, 1, seed=SEED).load_state_dict(state)
    with pytest.raises(ValueError, match="not a ShardSampler state"):
        ShardSampler(Ids(13), 3, 1).load_state_dict(["not", "a", "dict"])  # type: ignore[arg-type]


def _take_over_without_finish(group: Any) -> str:
    sampler = ShardSampler(Ids(8), group=group, batch_size=2, take_over=True)
    counter = Counter(group)
    try:
        with Join([counter]):
            iter(sampler)
    except ValueError as exc:
        return str(exc)
    return "(not refused)"


def test_take_over_without_finish_mode_is_refused_on_entry() -> None:
    for text in spawn(_take_over_without_finish, 2, timeout=60):
        assert "take_over=True) is iterated inside a Join with on_rank_loss='raise'" in text
    with pytest.raises(ValueError, match="is iterated outside any Join"):
        iter(ShardSampler(Ids(8), 2, 0, batch_size=2, take_over=True))
    with pytest.raises(ValueError, match="needs batch_size="):
        ShardSampler(Ids(8), 2, 0, take_over=True)
    with pytest.raises(ValueError, match="pass the DataLoader's batch size"):
        ShardSampler(Ids(8), 2, 0, batch_size=0)


def test_counting_needs_a_join_and_a_batch_size() -> None:
    sampler = ShardSampler(Ids(8), 2, 0, batch_size=2)
    assert sampler.state_dict()["remaining"] == [[0, 8]]  # nothing iterated yet
    next(iter(sampler))
    with pytest.raises(ValueError, match="iterated outside any joinkit Join"):
        sampler.state_dict()
    plain = ShardSampler(Ids(8), 2, 0)
    next(iter(plain))
    with pytest.raises(ValueError, match="needs batch_size="):
        plain.state_dict()


def test_the_plain_sampler_still_repeats_its_shard_each_pass() -> None:
    # Without a loss to take over, iterating again in an epoch starts the epoch
    # over (as DistributedSampler does): an evaluation loop run twice sees its
    # shard twice. set_epoch with the current epoch keeps the progress.
    sampler = ShardSampler(Ids(13), 2, 1, seed=SEED)
    assert list(sampler) == list(sampler) == plan.order(13, SEED, 0)[1::2].tolist()
    sampler.set_epoch(0)
    assert len(sampler) == 6


# -- real gloo ranks ---------------------------------------------------------------------

#: W1>W2:K:num_workers:loader (exact_runner.py): every world change and loader
#: kind with 0 and 2 workers, without running each product.
RESUME_CELLS = [
    "resume:3>2:2:0:dl", "resume:2>3:3:2:dl", "resume:2>4:2:0:dl", "resume:2>4:3:2:dl",
    "resume:3>2:2:2:sdl", "resume:2>3:2:0:sdl", "resume:3>3:2:0:sdl-own",
]
#: Two epochs each, a world of 4 then its 3 survivors: every kill point in each
#: world (rank/point/at, exact_runner.py).
TAKEOVER_CELLS = [
    "takeover:4:3/body/1,1/beat/2", "takeover:4:1/beat/2,3/body/1",
    # 31 samples: 11, 10, 10 on the 3 survivors (6, 5, 5 batches): rank 2 joins early.
    "takeover:4:0/step/0,2/drain/0:31",
    # 33: 9, 8, 8, 8 on 4 ranks (5, 4, 4, 4 batches): rank 2 joins early.
    "takeover:4:2/drain/0,3/step/1:33",
]
#: Under mpirun --with-ft ulfm (gloo ranks over the runner's store).
MPIRUN_CELLS = ["takeover:4:2/beat/1,0/step/1", "takeover:4:1/body/2,2/drain/0:31"]


@pytest.fixture(scope="module")
def forked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("exact")
    cells = RESUME_CELLS + TAKEOVER_CELLS
    done = subprocess.run([sys.executable, str(RUNNER), "--out", str(out), "--deadline", "90",
                           *cells], capture_output=True, text=True,
                          timeout=120 * len(cells) + 60)
    assert done.returncode == 0, done.stderr[-4000:]
    records = {r["spec"]: r for r in map(json.loads, (out / "cells.jsonl").read_text()
                                          .splitlines())}
    assert list(records) == cells, done.stderr[-4000:]
    return out, records


def _read(out: Path, name: str) -> dict[str, Any]:
    return json.loads((out / name).read_text())  # type: ignore[no-any-return]


@pytest.mark.launches
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("spec", RESUME_CELLS)
def test_resume_matrix(forked: tuple[Path, dict[str, Any]], spec: str) -> None:
    out, records = forked
    record = records[spec]
    cell = record["cell"]
    import exact_runner as runner

    s = runner.parse(spec)
    assert set(record["exit"]["a"].values()) == {0} and set(record["exit"]["b"].values()) == {0}, \
        record
    first = [_read(out, f"cell{cell}-a-rank{r}.json") for r in range(s["before"])]
    second = [_read(out, f"cell{cell}-b-rank{r}.json") for r in range(s["after"])]
    states = [f["state"] for f in first]
    assert all(state == states[0] for state in states), "the ranks' states differ"
    epoch = plan.resume_epoch(runner.N, runner.SEED, 0, runner.BATCH, s["before"], s["after"],
                              s["stop"])
    for rank, f in enumerate(first):
        assert [i for b in f["trained"] for i in b] == epoch.passes[0].consumed_ids(rank)
    for rank, f in enumerate(second):
        assert [i for b in f["trained"] for i in b] == epoch.passes[1].consumed_ids(rank)
        assert f["end_state"]["remaining"] == []
    ids = [i for f in first + second for b in f["trained"] for i in b]
    assert sorted(ids) == list(range(runner.N))  # exactly once
    want = plan.reference(first[0]["init"], [it for p in epoch.passes for it in p.iterations()])
    for f in second:
        np.testing.assert_allclose(f["params"], want, rtol=0, atol=1e-5)
    plan.record_error(spec, max(float(np.abs(np.array(f["params"]) - want).max()) for f in second))


@pytest.mark.launches
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("spec", TAKEOVER_CELLS)
def test_take_over_matrix_forked(forked: tuple[Path, dict[str, Any]], spec: str) -> None:
    out, records = forked
    record = records[spec]
    import exact_runner as runner

    s = runner.parse(spec)
    dead = {r for kills in s["epochs"] for r in kills}
    assert record["exit"]["t"] == {str(r): (-9 if r in dead else 0)
                                   for r in range(s["world"])}, record
    ranks = {r: _read(out, f"cell{record['cell']}-rank{r}.json") for r in range(s["world"])
             if r not in dead}
    plan.record_error(spec, plan.check_take_over(out, record["cell"], spec, ranks))


#: The loss warning of take_over=True (exact_runner.py): a loop that iterates the
#: sampler once (``plain``) on 3 ranks, on 2, and on 3 with 2 samples (rank 2 has
#: none; rank 0 dies before its only batch), then the same kill under passes().
WARNING_CELLS = ["takeover:3:1/body/1::plain", "takeover:2:0/beat/2:13:plain",
                 "takeover:3:0/body/0:2:plain", "takeover:3:1/body/1"]


@pytest.mark.launches
@pytest.mark.timeout(600)
def test_take_over_loss_warning_says_to_loop_over_passes(tmp_path: Path) -> None:
    import exact_runner as runner

    done = subprocess.run([sys.executable, str(RUNNER), "--out", str(tmp_path), "--deadline",
                           "90", *WARNING_CELLS], capture_output=True, text=True,
                          timeout=120 * len(WARNING_CELLS) + 60)
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert [r["spec"] for r in records] == WARNING_CELLS
    for record in records:
        spec = record["spec"]
        s = runner.parse(spec)
        (kills,) = s["epochs"]
        assert record["exit"]["t"] == {str(r): (-9 if r in kills else 0)
                                       for r in range(s["world"])}, record
        ranks = {r: _read(tmp_path, f"cell{record['cell']}-rank{r}.json")
                 for r in range(s["world"]) if r not in kills}
        for got in ranks.values():
            (warning,) = got["warnings"]  # one loss, one warning on each survivor
            assert "remaining inputs were not seen" in warning, warning
            if s["loop"] == "plain":
                assert warning.endswith(data_module.TAKE_OVER_PLAIN_LOOP), warning
            else:
                assert warning.endswith(data_module.TAKE_OVER_NEXT_PASS), warning
                assert "for _ in sampler.passes()" not in warning
        if s["loop"] == "passes":
            plan.record_error(spec, plan.check_take_over(tmp_path, record["cell"], spec, ranks))
            continue
        # The plain loop leaves the dead rank's unconsumed samples untrained, as
        # the warning says; the survivors trained exactly the first pass.
        epoch, survivors = plan.take_over_epoch(s["n"], runner.SEED, 0, runner.BATCH,
                                                list(range(s["world"])), kills)
        first = epoch.passes[0]
        untrained = sorted(set(range(s["n"])) - set(
            i for m in first.members for i in first.consumed_ids(m)))
        assert untrained, spec  # each cell's death leaves samples
        for rank in survivors:
            (seen,) = ranks[rank]["epochs"][0]["passes"]
            assert [i for b in seen["trained"] for i in b] == first.consumed_ids(rank)
            assert ranks[rank]["epochs"][0]["remaining"] == len(untrained)
        want = plan.reference(ranks[survivors[0]]["init"], first.iterations())
        for rank in survivors:
            np.testing.assert_allclose(ranks[rank]["params"], want, rtol=0, atol=1e-5)
        plan.record_error(spec, max(float(np.abs(np.array(ranks[r]["params"]) - want).max())
                                    for r in survivors))


@pytest.mark.launches
@pytest.mark.timeout(900)
def test_take_over_under_mpirun_with_ft_ulfm(tmp_path: Path) -> None:
    import exact_runner as runner

    done = subprocess.run([sys.executable, str(RUNNER), "--mpirun", "--out", str(tmp_path),
                           "--deadline", "240", *MPIRUN_CELLS], capture_output=True, text=True,
                          timeout=300 * len(MPIRUN_CELLS) + 60)
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert [r["spec"] for r in records] == MPIRUN_CELLS
    for record in records:
        assert record["mpirun"] == 0, record
        s = runner.parse(record["spec"])
        dead = {r for kills in s["epochs"] for r in kills}
        ranks = {r: _read(tmp_path, f"cell{record['cell']}-rank{r}.json")
                 for r in range(s["world"]) if r not in dead}
        for rank in dead:
            assert (tmp_path / f"cell{record['cell']}-rank{rank}.died").exists()
        plan.record_error(f"{record['spec']} (mpirun --with-ft ulfm)",
                     plan.check_take_over(tmp_path, record["cell"], record["spec"], ranks))


def test_a_group_rebuilt_for_a_later_join_numbers_its_ranks_afresh(
        current: dict[str, Any]) -> None:
    # After rank 1 of 4 died, DDP runs on the survivors' group: a later Join's
    # group numbers ranks 0, 2, 3 as 0, 1, 2, and its LostRank says 1 for rank 2.
    n, batch = 20, 2
    samplers = {r: ShardSampler(Ids(n), 4, r, seed=SEED, batch_size=batch, take_over=True)
                for r in range(4)}
    first_loss = LostRank(rank=1, iterations=5, survivors=(0, 2, 3), detected="t")
    for r in (0, 2, 3):  # epoch 0: rank 1 died after its whole share (5 batches)
        current["join"] = FakeJoin(r, [0, 1, 2, 3])
        list(iter(samplers[r]))
        current["join"].finish(3, 3, (first_loss,))
    current["join"] = None
    for r in (0, 2, 3):
        samplers[r].set_epoch(1)
        assert samplers[r].world == (0, 2, 3)
    shares = {}
    for new_rank, r in enumerate((0, 2, 3)):
        current["join"] = FakeJoin(new_rank, [0, 1, 2])  # a fresh group: 0, 1, 2
        shares[r] = list(iter(samplers[r]))
        # Rank 2 (the group's 1) completes 1 iteration and dies.
        loss = LostRank(rank=1, iterations=1, survivors=(0, 2), detected="t")
        if r != 2:
            current["join"].finish(-(-len(shares[r]) // batch), 4, (loss,))
    current["join"] = None
    assert samplers[0].take_overs == samplers[3].take_overs
    (take,) = samplers[0].take_overs
    assert take.rank == 2 and list(take.consumed) == shares[2][:batch]
    assert sorted(i for v in take.moved.values() for i in v) == sorted(shares[2][batch:])
    assert set(take.moved) == {0, 3}


def _with_rounds_without_batches(group: Any, skip: bool) -> dict[str, Any]:
    """After each of 3 training iterations, one more round of the Join that takes no
    batch (an evaluation forward of a model that makes every forward a round)."""
    sampler = ShardSampler(Ids(20), group=group, seed=SEED, batch_size=2)
    loader = DataLoader(Ids(20), sampler=sampler, batch_size=2)
    counter = Counter(group)
    with Join([counter]):
        for index, _ in enumerate(loader):
            counter()
            counter()  # the round without a batch
            if skip:
                sampler.skip_rounds(1)
            if index + 1 == 3:
                return sampler.state_dict()
    raise AssertionError("the loop ended before its third iteration")


@pytest.mark.timeout(120)
def test_rounds_without_a_batch_are_not_counted_as_consumed_once_skipped() -> None:
    skipped = spawn(_with_rounds_without_batches, 2, (True,), timeout=60)
    counted = spawn(_with_rounds_without_batches, 2, (False,), timeout=60)
    assert skipped[0] == skipped[1]
    assert skipped[0]["consumed"] == [[0, 6], [1, 6]]  # 3 batches of 2 each
    assert counted[0]["consumed"] == [[0, 10], [1, 10]]  # what skip_rounds corrects
    with pytest.raises(ValueError, match="count must be >= 0"):
        ShardSampler(Ids(4), 2, 0, batch_size=2).skip_rounds(-1)
