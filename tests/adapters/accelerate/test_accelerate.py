"""Accelerate's ``prepare`` on 2 CPU processes (gloo), DDP and FSDP2, with uneven data.

One module fixture starts three ``torchrun --nproc-per-node 2`` launches at
once: ``programs/accelerate_program.py ddp``, ``... fsdp2`` (each runs joinkit's
``join_uneven_inputs``, Accelerate's padding default and Accelerate's own
``join_uneven_inputs`` in one process) and ``examples/accelerate_uneven.py``.
The reference trains the same model in this process: at each step the
batches of the ranks that still have one, each loss divided by the world size
(DDP's and FSDP's averaging), as a single SGD step.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from support import launch_ranks  # noqa: E402

pytestmark = pytest.mark.needs_torch

ROOT = Path(__file__).resolve().parents[3]
PROGRAM = Path(__file__).parent / "programs" / "accelerate_program.py"
EXAMPLE = ROOT / "examples" / "accelerate_uneven.py"
_SCRIPT = Path(sys.executable).with_name("torchrun")
TORCHRUN = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "torch.distributed.run"]
LAUNCH_TIMEOUT = 240.0
WORLD = 2
MODES = ["ddp", "fsdp2", "fsdp1"]
FSDP_MODES = ["fsdp2", "fsdp1"]


def _environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "SLURM_",
                                  "ACCELERATE_"))
           and key not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                           "JOINKIT_BACKEND"}}
    env["OMP_NUM_THREADS"] = "1"
    # The program's folder, then the tests' (tests/conftest.py: the support package).
    env["PYTHONPATH"] = os.pathsep.join([str(PROGRAM.parent), os.environ["PYTHONPATH"]])
    return env


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("accelerate")
    base = [*TORCHRUN, "--standalone", "--nproc-per-node", str(WORLD)]
    commands = [[*base, str(PROGRAM), mode, str(out)] for mode in MODES]
    three = [*TORCHRUN, "--standalone", "--nproc-per-node", "3"]
    (out / "three").mkdir()
    commands += [[*three, str(PROGRAM), mode, str(out / "three")] for mode in FSDP_MODES]
    commands.append([*base, str(EXAMPLE)])
    names = [*MODES, *(f"{mode}-3" for mode in FSDP_MODES), "example"]
    runs = launch_ranks(commands, LAUNCH_TIMEOUT, env=_environment(), cwd=ROOT)
    return {"out": out, "runs": dict(zip(names, runs, strict=True))}


def _records(launches: dict[str, Any], mode: str, case: str,
             world: int = WORLD) -> list[dict[str, Any]]:
    """The records of a launch (``fsdp2-3``: the 3-process launch, in a folder of its
    own, whose files are named by the mode)."""
    launch, mode = mode, mode.removesuffix("-3")
    folder = launches["out"] / "three" if launch != mode else launches["out"]
    files = [folder / f"{mode}-{case}-{rank}.json" for rank in range(world)]
    if not all(f.exists() for f in files):
        pytest.fail(f"{launch} did not finish {case}:\n"
                    f"{launches['runs'][launch].stdout[-4000:]}")
    return [json.loads(f.read_text()) for f in files]


def _reference(padded: bool) -> list[list[list[float]]]:
    """Full parameters after each epoch of one process stepping like the ranks together."""
    import accelerate_program as p

    model = p.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=p.LR)
    x, y = p.dataset().tensors
    per_rank = [list(range(r, p.BATCHES, WORLD)) for r in range(WORLD)]
    if padded:  # Accelerate's even_batches: the short ranks start over from batch 0
        longest = max(len(b) for b in per_rank)
        per_rank = [b + list(range(longest - len(b))) for b in per_rank]
    epochs = 1 if padded else p.EPOCHS
    out = []
    for _ in range(epochs):
        for step in range(max(len(b) for b in per_rank)):
            optimizer.zero_grad()
            for batches in per_rank:
                if step < len(batches):
                    rows = slice(batches[step] * p.BATCH, (batches[step] + 1) * p.BATCH)
                    loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
                    (loss / WORLD).backward()
            optimizer.step()
        out.append(p.full_params(model))
    return out


def _assert_params(got: list[list[list[float]]], want: list[list[list[float]]]) -> None:
    assert len(got) == len(want)
    for epoch_got, epoch_want in zip(got, want, strict=True):
        for g, w in zip(epoch_got, epoch_want, strict=True):
            assert g == pytest.approx(w, abs=1e-6)


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("mode", MODES)
def test_join_uneven_inputs_on_prepared_objects_is_exact(launches: Any, mode: str) -> None:
    ranks = _records(launches, mode, "joinkit")
    assert [r["num_processes"] for r in ranks] == [WORLD, WORLD]
    assert [r["steps"] for r in ranks] == [8, 6]  # 4 and 3 batches per epoch, 2 epochs
    assert ranks[0]["model"] == _MODELS[mode]
    want = _reference(padded=False)
    for rank in ranks:
        _assert_params(rank["params"], want)


_MODELS = {"ddp": "DistributedDataParallel", "fsdp2": "FSDPSequential",
           "fsdp1": "FullyShardedDataParallel"}


def _assert_trained_by(ranks: list[dict[str, Any]], mode: str) -> None:
    """The model is what ``mode`` says, and Accelerate ran it as such to the end (its
    no_sync and clipping follow ``distributed_type``)."""
    kind = "MULTI_CPU" if mode == "ddp" else "FSDP"
    assert {(r["model"], r["distributed_type"]) for r in ranks} == {
        (_MODELS[mode], f"DistributedType.{kind}")}


def _accumulated_reference(world: int, gas: int, clip: bool = False,
                           batches: int | None = None,
                           scheduler: bool = False) -> list[list[float]]:
    """One process: a step per window of ``gas`` batch positions, each batch's loss
    divided by the accumulation steps (Accelerate's backward) and the world (DDP's and
    FSDP's averaging), the window's gradient clipped to ``CLIP`` when ``clip``; the last
    window steps however full (Accelerate steps at the end of the data). ``scheduler``:
    the rate halves ``world`` times after each step (Accelerate's wrapper steps a
    StepLR of one step once per process)."""
    import accelerate_program as p

    model = p.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=p.LR)
    x, y = p.dataset().tensors
    total = p.BATCHES if batches is None else batches
    per_rank = [list(range(r, total, world)) for r in range(world)]
    longest = max(len(b) for b in per_rank)
    for start in range(0, longest, gas):
        optimizer.zero_grad()
        for ranks_batches in per_rank:
            for batch in ranks_batches[start:start + gas]:
                rows = slice(batch * p.BATCH, (batch + 1) * p.BATCH)
                loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
                (loss / gas / world).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), p.CLIP)
        optimizer.step()
        if scheduler:
            for group in optimizer.param_groups:
                group["lr"] *= 0.5 ** world
    return p.full_params(model)


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("mode", MODES)
def test_accumulate_under_join_uneven_inputs_is_exact(launches: Any, mode: str) -> None:
    """Windows of 2: rank 1's last window ends at its own last batch, half full (DDP:
    every backward syncs; FSDP: rank 1 keeps its half for the window's step)."""
    import accelerate_program as p

    ranks = _records(launches, mode, "accumulate")
    assert [r["steps"] for r in ranks] == [4, 3]
    _assert_trained_by(ranks, mode)
    for rank in ranks:
        _assert_params(rank["params"], [_accumulated_reference(WORLD, p.ACCUMULATE)])


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("mode", FSDP_MODES)
def test_fsdp_accumulate_with_clipping_closes_the_last_window(launches: Any,
                                                              mode: str) -> None:
    """Windows of 3 with clipping that bites: rank 0's second window (one batch) is open
    when both ran out; the Join's post hooks close it (a synced replay, the shadow step's
    clipping and step, on both). No gradient is left behind."""
    ranks = _records(launches, mode, "accumulate3_clip")
    assert [r["steps"] for r in ranks] == [4, 3]
    _assert_trained_by(ranks, mode)
    want = _accumulated_reference(WORLD, 3, clip=True)
    for rank in ranks:
        _assert_params(rank["params"], [want])
        assert all(rank["grads"])


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("mode", FSDP_MODES)
def test_fsdp_mixed_precision_equals_zero_weight_padding(launches: Any, mode: str) -> None:
    """FSDP's bf16 mixed precision (the plugin's policy: bfloat16 parameters and
    reductions), windows of 2, rank 1 running out inside one: bit for bit the run
    without joinkit where rank 1 is padded (even_batches=True) with zero-weight
    batches, the same casts and collectives; both 3.0e-4 from the float32 reference
    (measured; bfloat16's rounding), which the bound checks really is bf16."""
    import accelerate_program as p

    joined = _records(launches, mode, "bf16")
    padded = _records(launches, mode, "bf16_zero_padded")
    assert [r["steps"] for r in joined] == [4, 3]
    assert [r["steps"] for r in padded] == [4, 4]
    _assert_trained_by(joined, mode)
    want = _accumulated_reference(WORLD, p.ACCUMULATE)
    for got, same in zip(joined, padded, strict=True):
        assert got["params"] == same["params"]
        error = max(abs(a - b) for g, w in zip(got["params"][0], want, strict=True)
                    for a, b in zip(g, w, strict=True))
        assert 1e-5 < error < 1e-3


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("mode", FSDP_MODES)
@pytest.mark.parametrize(("case", "batches", "clip", "steps"), [
    ("accumulate", 7, False, [3, 2, 2]), ("no_data_clip", 2, True, [1, 1, 0]),
    ("scheduler_clip", 7, True, [3, 2, 2])])
def test_fsdp_accumulate_on_three_processes(launches: Any, mode: str, case: str,
                                            batches: int, clip: bool,
                                            steps: list[int]) -> None:
    """3 processes: rank 0's last window open at the end (closed by the post hooks); a
    process with no data at all, which replays every micro-step and the closing one; an
    LR scheduler Accelerate wrapped (stepped by a joined process as the wrapper steps
    it: once per process per optimizer step)."""
    import accelerate_program as p

    ranks = _records(launches, f"{mode}-3", case, world=3)
    assert [r["steps"] for r in ranks] == steps
    _assert_trained_by(ranks, mode)
    want = _accumulated_reference(3, p.ACCUMULATE, clip=clip, batches=batches,
                                  scheduler=case.startswith("scheduler"))
    for rank in ranks:
        _assert_params(rank["params"], [want])


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_accelerate_ignores_the_fsdp_plugin_on_cpu(launches: Any) -> None:
    # Why the FSDP2 runs force the distributed type (accelerate_program's doc).
    for rank in _records(launches, "fsdp2", "joinkit"):
        assert rank["distributed_type"] == "DistributedType.MULTI_CPU"
        assert rank["ignored_plugin"] is True


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("mode", MODES)
def test_accelerates_padding_trains_on_duplicated_samples(launches: Any, mode: str) -> None:
    ranks = _records(launches, mode, "padded")
    assert [r["steps"] for r in ranks] == [4, 4]
    padded, exact = _reference(padded=True)[0], _reference(padded=False)[0]
    for rank in ranks:
        _assert_params(rank["params"], [padded])
        # ...which is not one epoch over the data: batch 0 counted twice.
        assert max(abs(a - b) for g, w in zip(rank["params"][0], exact, strict=True)
                   for a, b in zip(g, w, strict=True)) > 1e-3


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("mode", MODES)
def test_accelerates_own_join_uneven_inputs_does_nothing_here(launches: Any, mode: str) -> None:
    rank0, rank1 = _records(launches, mode, "accelerate_join")
    for rank in (rank0, rank1):
        assert any("will have no effect" in w for w in rank["warnings"]), rank["warnings"]
    # Rank 1 finished its 3 batches inside a context that is no Join at all...
    assert (rank1["steps"], rank1["error"], rank1["context"]) == (3, None, "NoneType")
    # ...and rank 0's 4th step waited in a collective nobody else ran.
    assert rank0["steps"] == 3
    assert rank0["error"] is not None and "gloo" in rank0["error"], rank0["error"]


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_the_example_runs(launches: Any) -> None:
    run = launches["runs"]["example"]
    assert run.returncode == 0, run.stdout[-4000:]
    lines = sorted(re.findall(r"Process \d trained on all \d+ of its batches!", run.stdout))
    assert lines == ["Process 0 trained on all 4 of its batches!",
                     "Process 1 trained on all 3 of its batches!"]


def test_a_world_of_one_that_should_be_two_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from joinkit.adapters.accelerate import join_uneven_inputs

    class OneProcess:  # what Accelerator() is on a CPU machine without cpu=True
        num_processes = 1
        distributed_type = "DistributedType.NO"

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"Accelerator\(cpu=True\)"):
        with join_uneven_inputs(OneProcess(), [torch.nn.Linear(1, 1)]):
            pass
    monkeypatch.setenv("WORLD_SIZE", "1")
    with join_uneven_inputs(OneProcess(), [torch.nn.Linear(1, 1)]) as join:
        assert join is None


def test_unwrap_gives_the_torch_objects() -> None:
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    from joinkit.adapters.accelerate import unwrap

    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    # Built without an Accelerator (whose state the constructors require).
    wrapped = object.__new__(AcceleratedOptimizer)
    wrapped.optimizer = optimizer
    wrapped_scheduler = object.__new__(AcceleratedScheduler)
    wrapped_scheduler.scheduler = scheduler
    assert unwrap(wrapped) is optimizer
    assert unwrap(wrapped_scheduler) is scheduler
    assert unwrap(model) is model


def test_the_docs_show_the_example_as_it_is() -> None:
    page = (ROOT / "docs" / "accelerate.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert blocks and all(block in EXAMPLE.read_text() for block in blocks)


def test_a_missing_accelerate_internal_is_a_loud_error() -> None:
    """Each member of Accelerate read that it does not document (``_PRIVATE``) is
    refused by name, with what joinkit reads it for, when a release lacks it."""
    from joinkit.adapters import accelerate

    class Accelerator:  # an Accelerate whose Accelerator has neither member
        pass

    import accelerate as hf_accelerate

    for name in ("step", "_dataloaders"):
        with pytest.raises(accelerate.UnsupportedAccelerateError,
                           match=rf"^found accelerate {re.escape(hf_accelerate.__version__)}; "
                                 rf"joinkit needs Accelerator\.{name}, which this release "
                                 r"lacks \("):
            accelerate._private(Accelerator(), name)
    assert {(cls, attr) for cls, attr, _ in accelerate._PRIVATE} == {
        ("Accelerator", "_dataloaders"), ("Accelerator", "step"),
        ("GradientState", "plugin_kwargs"), ("GradientState", "_set_sync_gradients")}


def test_the_range_is_the_extras_with_no_upper_bound() -> None:
    """The extras say the oldest tested release, with no upper bound (issue 48);
    the dev pin is the newest tested."""
    from joinkit.adapters import accelerate

    text = (ROOT / "pyproject.toml").read_text()
    assert accelerate.SUPPORTED_ACCELERATE == f">={accelerate.TESTED_ACCELERATE[0]}"
    for extra in ("accelerate", "transformers"):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"{extra} = "))
        assert f'"accelerate{accelerate.SUPPORTED_ACCELERATE}"' in line
    pin = f"accelerate=={accelerate.TESTED_ACCELERATE[-1]}"
    assert pin in (ROOT / "constraints.txt").read_text().splitlines()
