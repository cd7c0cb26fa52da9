"""DeepSpeed under Join, on CPU processes with gloo, against a float64 reference.

DeepSpeed's import is slow, so one module fixture starts three launched jobs
at once, each importing DeepSpeed once per process and running many cells
(``programs/deepspeed_runner.py``, the cells in ``programs/deepspeed_cells.py``):

- ``torchrun-2``: ``torchrun --nproc-per-node 2``: every training cell (ZeRO
  stages 0-3, uneven plans including a rank with none, gradient accumulation
  1/2/3, clipping, AdamW/Adam/SGD, an LR scheduler, both divisors),
  ``StepReplay`` over a user's step, an evaluation Join, the refusals, loop
  mistakes;
- ``torchrun-3``: the training cells, ``StepReplay``, evaluation and Accelerate's
  DeepSpeed plugin on 3 ranks;
- ``deepspeed-2``: the ``deepspeed`` launcher, 2 ranks: a training cell per
  stage and plan, Accelerate's DeepSpeed plugin through ``join_uneven_inputs``
  (gradient accumulation in ``accelerator.accumulate``), and
  ``examples/deepspeed_uneven.py``.

The training cells include ZeRO-Offload (optimizer to the CPU under ZeRO 2 and
3, parameters too under ZeRO 3) with a torch optimizer and with DeepSpeed's
``DeepSpeedCPUAdam``, whose C++ op the fixture builds first (minutes, once per
machine: DeepSpeed JIT-compiles it into ``~/.cache/torch_extensions``).

The reference (``deepspeed_cells.reference``) trains one float64 model in this
process, without DeepSpeed: each micro-step's gradient over the documented
divisor, clipped and stepped at each accumulation boundary.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
if importlib.util.find_spec("deepspeed") is None:  # the no-torch CI job; `make setup` has it
    pytest.skip("needs the deepspeed extra", allow_module_level=True)

import deepspeed_cells as c  # noqa: E402
import torch  # noqa: E402
from support import launch_ranks, records_by_name  # noqa: E402
from support.deepspeed_ops import build_cpu_adam  # noqa: E402

pytestmark = pytest.mark.needs_torch

ROOT = Path(__file__).resolve().parents[3]
RUNNER = Path(__file__).parent / "programs" / "deepspeed_runner.py"
EXAMPLE = ROOT / "examples" / "deepspeed_uneven.py"
BIN = Path(sys.executable).parent
LAUNCH_TIMEOUT = 480.0
#: float32 training against the float64 reference (measured: below 3e-7).
TOLERANCE = 2e-6

JOBS: dict[str, tuple[str, int, str]] = {
    "torchrun-2": ("torchrun", 2, "train_cells,step_replay,eval_cells,refusals,mistakes,"
                                  "parallel_refusals"),
    "torchrun-3": ("torchrun", 3, "train_cells,step_replay,eval_cells,accelerate"),
    "deepspeed-2": ("deepspeed", 2, "launcher_cells,accelerate,example"),
}
#: The training cells each job runs.
CELLS = {"torchrun-2": c.cells(2), "torchrun-3": c.cells(3),
         "deepspeed-2": c.launcher_cells(2)}


def _environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "SLURM_",
                                  "ACCELERATE_"))
           and key not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                           "JOINKIT_BACKEND", "JOINKIT_DS_BACKEND", "CUDA_VISIBLE_DEVICES"}}
    # The programs' folder first, then the caller's path: the tests' support package
    # (tests/conftest.py), joinkit from a wheel on a GPU machine.
    path = os.pathsep.join(p for p in (str(RUNNER.parent), os.environ.get("PYTHONPATH")) if p)
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=path)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _command(launcher: str, world: int, out: Path, groups: str) -> list[str]:
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(world),
                str(RUNNER), str(out), groups]
    return [str(BIN / "deepspeed"), "--num_gpus", str(world), "--master_port",
            str(_free_port()), str(RUNNER), str(out), groups]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """The references are tiny float64 models: one thread is ten times faster
    beside the launched jobs than torch's default (its thread pool contends)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference(spec: dict[str, Any], world: int) -> list[list[float]]:
    """``deepspeed_cells.reference``, once per cell (the jobs share cells)."""
    key = (world, tuple(sorted((k, str(v)) for k, v in spec.items() if k != "name")))
    if key not in _REFERENCES:
        _REFERENCES[key] = c.reference(spec, world)
    return _REFERENCES[key]


_REFERENCES: dict[Any, list[list[float]]] = {}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    build_cpu_adam(_environment(), ROOT)
    outs = {name: tmp_path_factory.mktemp(name) for name in JOBS}
    runs = launch_ranks([_command(launcher, world, outs[name], groups)
                         for name, (launcher, world, groups) in JOBS.items()],
                        LAUNCH_TIMEOUT, env=_environment(), cwd=ROOT)
    return {name: {"records": records_by_name(outs[name], JOBS[name][1]), "run": run,
                   "world": JOBS[name][1]}
            for (name, run) in zip(JOBS, runs, strict=True)}


def refused_here(spec: dict[str, Any], windows: bool = False) -> tuple[str, str] | None:
    """Why this DeepSpeed's engine for ``spec`` is refused on entry, as (the DeepSpeed
    release that fixed it, what the message names), or ``None``: ZeRO-3 on the CPU on
    a release that reads its gathered parameters before the gathers end (0.18.3 to
    0.19.7, fixed in 0.19.8; the launched jobs run on the CPU); ZeRO-2 with
    accumulation on a release that steps on a window's last micro-step alone, and
    (``windows``: Accelerate's cells) ZeRO 0 or 1 with accumulation on a release whose
    ``no_sync()`` leaves a micro-step undivided (both 0.18.2, fixed in 0.18.3); ZeRO-2
    with optimizer offload and more than 2 accumulation steps on a release that drops
    a window's middle micro-steps there (0.18.3 to 0.18.9, fixed in 0.19.0); ZeRO-1 and
    2 on a release whose first optimizer step raises on the CPU (0.18.7 to 0.18.9, fixed
    in 0.19.0; every launched job has 2 ranks or more)."""
    from joinkit.adapters.deepspeed import _private

    if spec["stage"] == 3 and _private.zero3_gather_races_on_cpu():
        return "0.19.8", "ZeRO-3 on the CPU (gloo)"
    if spec["stage"] in (1, 2) and _private.zero12_step_raises_on_cpu():
        return "0.19.0", "Output 0 of Split is a view"
    if spec["gas"] == 1:
        return None
    accumulation = f"gradient_accumulation_steps={spec['gas']}"
    offload = spec.get("offload", "none")
    if spec["stage"] == 2 and offload == "none" and _private.zero2_keeps_last_micro_step():
        return "0.18.3", accumulation
    if (spec["stage"] == 2 and offload != "none" and spec["gas"] > 2
            and _private.zero2_offload_drops_middle_micro_steps()):
        return "0.19.0", accumulation
    if windows and spec["stage"] < 2 and _private.no_sync_skips_accumulation_scaling():
        return "0.18.3", accumulation
    return None


def _assert_refused(jobs: dict[str, Any], job: str, spec: dict[str, Any],
                    why: tuple[str, str]) -> None:
    """Every rank recorded the refusal of ``spec`` (:func:`refused_here`), before training."""
    fixed, named = why
    found = jobs[job]["records"].get(spec["name"], [])
    assert len(found) == jobs[job]["world"], f"{job} did not finish {spec['name']}"
    for record in found:
        assert not record["ok"], spec["name"]
        assert "ValueError: found deepspeed " in record["error"], record["error"]
        assert (named in record["error"]
                and f"fixed it in {fixed}" in record["error"]), record["error"]


def _records(jobs: dict[str, Any], job: str, name: str) -> list[dict[str, Any]]:
    """Every rank's record of ``name`` in ``job``; fails with the output if one is missing."""
    found = jobs[job]["records"].get(name, [])
    if len(found) != jobs[job]["world"]:
        pytest.fail(f"{job} did not finish {name}:\n{jobs[job]['run'].stdout[-6000:]}")
    errors = [r["error"] for r in found if not r["ok"]]
    assert not errors, "\n".join(errors)
    return found


# -- training: Join([engine]) against the float64 reference --------------------------------


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("job", list(JOBS))
def test_every_cell_equals_the_float64_reference(jobs: dict[str, Any], job: str) -> None:
    world = jobs[job]["world"]
    cells = CELLS[job]
    assert {s["stage"] for s in cells} == {0, 1, 2, 3}
    assert {0 in s["plan"] for s in cells} == {True, False}  # a rank with no batch
    for spec in cells:
        why = refused_here(spec)
        if why is not None:
            _assert_refused(jobs, job, spec, why)
            continue
        ranks = _records(jobs, job, spec["name"])
        want = reference(spec, world)
        errors = [c.max_error(r["params"], want) for r in ranks]
        assert max(errors) < TOLERANCE, (spec["name"], errors)
        # What trained: ZeRO-Offload where the cell says so, DeepSpeed's CPU Adam.
        offload = spec["offload"]
        for record in ranks:
            assert record["offload"] == {
                "optimizer": "cpu" if offload in ("optimizer", "both") else "none",
                "param": "cpu" if offload == "both" else "none"}, spec["name"]
            if spec["optimizer"] == "cpu_adam":
                assert record["optimizer"] == "DeepSpeedCPUAdam"
        # Every rank holds the same model after the Join (no post hook needed).
        assert all(r["params"] == ranks[0]["params"] for r in ranks), spec["name"]
        longest = max(spec["plan"])
        for rank, record in enumerate(ranks):
            # A joined rank replayed every micro-step it lacked, so its engine
            # counted as many micro-steps and optimizer steps as the others.
            assert record["inputs"] == spec["plan"][rank]
            assert record["shadow_rounds"] == longest - spec["plan"][rank]
            assert (record["micro_steps"], record["global_steps"]) == (
                longest, longest // spec["gas"]), spec["name"]


@pytest.mark.parametrize("world", [2, 3])
def test_the_cells_cover_zero_offload(world: int) -> None:
    """The training cells include ZeRO-Offload (``test_every_cell_equals_the_float64_reference``
    checks each, and that the engine offloaded): ZeRO 2 and 3 with the optimizer on the
    CPU, ZeRO 3 with the parameters too, a torch optimizer and DeepSpeed's CPU Adam,
    accumulation, clipping, a rank with no batch."""
    cells = c.offload_cells(world)
    assert {(s["stage"], s["offload"], s["optimizer"]) for s in cells} == {
        (2, "optimizer", "adam"), (3, "both", "adamw"), (2, "optimizer", "cpu_adam"),
        (3, "both", "cpu_adam")}
    assert any(0 in s["plan"] for s in cells) and {s["gas"] for s in cells} == {1, 2, 3}
    assert any(s["clip"] == 0.05 for s in cells)
    assert all(s in c.cells(world) for s in cells)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_the_cells_tell_the_settings_apart() -> None:
    """The controls: the other divisor, or no clipping, misses the reference by far;
    so does Accelerate's last window left open."""
    for world in (2, 3):
        for spec in c.accelerate_cells(world):
            if max(spec["plan"]) % spec["gas"]:
                unclosed = reference({**spec, "close": False}, world)
                assert c.max_error(unclosed, reference(spec, world)) > 1e-3, spec["name"]
        for spec in c.cells(world):
            want = reference(spec, world)
            if not spec["divide"]:
                flipped = reference({**spec, "divide": True}, world)
                assert c.max_error(flipped, want) > 1e-2, spec["name"]
            if spec["clip"] == 0.05:
                unclipped = reference({**spec, "clip": 0.0}, world)
                assert c.max_error(unclipped, want) > 1e-3, spec["name"]


# -- the generic joinable, evaluation ----------------------------------------------------------


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("job", ["torchrun-2", "torchrun-3"])
def test_step_replay_of_a_users_step_is_exact(jobs: dict[str, Any], job: str) -> None:
    world = jobs[job]["world"]
    ranks = _records(jobs, job, "step-replay")
    want = c.step_reference(world)
    plan = c.STEP_PLANS[world]
    for rank, record in enumerate(ranks):
        assert c.max_error(record["params"], want) < TOLERANCE
        assert record["shadow_rounds"] == max(plan) - plan[rank]
    # Without the centering layer's collectives the model would differ.
    solo = c.CenteredNet(distributed=False).double()
    first = [p.detach().flatten().tolist() for p in solo.parameters()]
    assert c.max_error(first, want) > 1e-2


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("job", ["torchrun-2", "torchrun-3"])
def test_evaluation_over_zero3_sums_every_batch_once(jobs: dict[str, Any], job: str) -> None:
    world = jobs[job]["world"]
    ranks = _records(jobs, job, "eval-s3")
    plan = [3, 5, 1][:world]
    model = c.make_model().double()
    with torch.no_grad():
        want = sum(float(torch.nn.functional.mse_loss(model(x), y, reduction="sum"))
                   for r in range(world) for x, y in
                   (c.batch(r, i, torch.float64) for i in range(plan[r])))
    for rank, record in enumerate(ranks):
        assert record["total"] == pytest.approx(want, rel=1e-6)
        assert record["shadow_rounds"] == max(plan) - plan[rank]


# -- Accelerate's DeepSpeed plugin ---------------------------------------------------------------


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("job", ["deepspeed-2", "torchrun-3"])
def test_accelerates_deepspeed_plugin_is_exact(jobs: dict[str, Any], job: str) -> None:
    """Accelerate's loop with ``accelerator.accumulate``: windows of ``gas`` micro-steps
    (a rank's own end of data does not end one; a joined rank's rest contributes zero),
    the last one closed when every rank ran out, as Accelerate steps at the end of the
    data. Accelerate's LambdaLR wrapper steps ``num_processes`` times per optimizer step,
    on a joined rank too. Parameters and every micro-step's loss equal the reference."""
    world = jobs[job]["world"]
    cells = c.accelerate_cells(world)
    if world == 2:
        assert {s["stage"] for s in cells} == {1, 2, 3} and {s["gas"] for s in cells} == {
            1, 2, 3}
    assert any(0 in s["plan"] for s in cells)
    for spec in cells:
        why = refused_here(spec, windows=True)
        if why is not None:
            _assert_refused(jobs, job, spec, why)
            continue
        ranks = _records(jobs, job, spec["name"])
        losses: dict[tuple[int, int], float] = {}
        want = c.reference(spec, world, losses)
        windows = -(-max(spec["plan"]) // spec["gas"])
        assert [r["steps"] for r in ranks] == spec["plan"], spec["name"]
        for rank, record in enumerate(ranks):
            # DeepSpeed trained (Accelerate chose MULTI_CPU with cpu=True: the override).
            assert (record["engine"], record["stage"]) == ("DeepSpeedEngine", spec["stage"])
            assert record["distributed_type"] == "DistributedType.MULTI_CPU"
            assert c.max_error(record["params"], want) < TOLERANCE, spec["name"]
            assert record["losses"] == pytest.approx(
                [losses[rank, t] for t in range(spec["plan"][rank])], abs=1e-6)
            assert record["global_steps"] == windows, spec["name"]
            # Accelerate's count starts again, as at the end of its data.
            assert (record["accelerator_step"], record["sync_gradients"]) == (0, True)


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("job", ["deepspeed-2", "torchrun-3"])
def test_accumulation_without_accelerates_accumulate_is_refused_at_once(
        jobs: dict[str, Any], job: str) -> None:
    """Gradient accumulation in the DeepSpeed config, ``accelerator.backward`` outside
    ``accumulate()``: each micro-step would end a window; refused on the first."""
    for record in _records(jobs, job, "accelerate-no-accumulate"):
        assert record["error"].split(":")[0] in ("LocalProtocolError", "PeerFailure")
        assert "accelerator.accumulate(model)" in record["error"]
        assert record["seconds"] < 60


# -- bad input ----------------------------------------------------------------------------------

REFUSALS = {
    "optimizer": "Join got DeepSpeedZeroOptimizer, which a DeepSpeed engine steps itself",
    "torch-optimizer": "Join got AdamW, which a DeepSpeed engine steps itself",
    "scheduler": "Join got LambdaLR, which a DeepSpeed engine steps itself",
    "optimizer-first": "Join got DeepSpeedZeroOptimizer, which a DeepSpeed engine steps",
    "sum-active": "sums gradients",
    "finish": "on_rank_loss='finish'",
    "unmanaged": "managed gradient accumulation",
    "nvme": "offload_param to 'nvme'",
    "moe": "MoE layers",
    "pipeline": "pipeline parallelism",
}


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_cannot_be_replayed_is_refused_on_entry(jobs: dict[str, Any], case: str) -> None:
    records = _records(jobs, "torchrun-2", f"refuse-{case}")
    if case in ("unmanaged", "sum-active") and records[0]["error"].startswith("absent:"):
        # DeepSpeed 0.18.2 has neither setting: every engine averages and manages its
        # accumulation, so there is nothing to refuse (the runner asked the engine).
        from importlib.metadata import version

        assert version("deepspeed").startswith("0.18.")
        return
    for record in records:
        assert REFUSALS[case] in record["error"], record["error"]
        assert record["error"].split(":")[0] in ("ValueError", "ElasticUnavailable")


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_a_refused_join_leaves_the_engine_trainable(jobs: dict[str, Any]) -> None:
    ranks = _records(jobs, "torchrun-2", "after-refusals")
    spec = c.cell("after", stage=2, plan=[1, 2])
    want = reference(spec, 2)
    for record in ranks:
        assert c.max_error(record["params"], want) < TOLERANCE


MISTAKES = {
    "eval-forward": "a forward without gradients",
    "no-step": "an iteration without its step",
    "no-backward": "an iteration without its backward",
    "boundary": "gradient accumulation boundary was set to False",
    "window-step": "which does not end an accumulation window",
    "window-no-sync": "inside engine.no_sync() at a micro-step that ends",
}


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("case", list(MISTAKES))
def test_a_loop_mistake_fails_every_rank_promptly(jobs: dict[str, Any], case: str) -> None:
    why = refused_here({"stage": 1, "gas": 2}, windows=True)
    if case == "window-no-sync" and why is not None:
        # no_sync() needs ZeRO 0 or 1, whose accumulation on the loop's windows this
        # DeepSpeed trains wrongly (0.18.2): Join refuses it on entry, on every rank.
        _assert_refused(jobs, "torchrun-2", {"name": "mistake-window-no-sync", "gas": 2},
                        why)
        return
    rank0, *others = _records(jobs, "torchrun-2", f"mistake-{case}")
    assert rank0["error"].startswith("LocalProtocolError: ")
    assert MISTAKES[case] in rank0["error"]
    for record in others:
        assert record["error"].startswith("PeerFailure: rank 0 failed"), record["error"]
        assert MISTAKES[case] in record["error"]
    # No rank waited for a watchdog (its default is minutes).
    assert max(r["seconds"] for r in [rank0, *others]) < 60
    # And the group works afterwards: nothing was left unmatched.
    assert [r["sum"] for r in _records(jobs, "torchrun-2", "mistakes-then-all-reduce")] == [
        2.0, 2.0]


# -- the example, the deepspeed launcher -----------------------------------------------------------


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_the_example_runs_under_the_deepspeed_launcher(jobs: dict[str, Any]) -> None:
    # Each rank's last line is the example's (DeepSpeed 0.18.x prints its memory use on
    # rank 0 at ZeRO-2's initialization, see_memory_usage(..., force=True), before it).
    lines = sorted(r["stdout"].strip().splitlines()[-1]
                   for r in _records(jobs, "deepspeed-2", "example"))
    assert lines == ["Rank 0 trained on all 5 of its batches!",
                     "Rank 1 trained on all 3 of its batches!"]


def test_the_docs_show_the_example_as_it_is() -> None:
    page = (ROOT / "docs" / "deepspeed.md").read_text()
    blocks = re.findall(r"<!-- not run: the body of main\(\).*?```python\n(.*?)```", page,
                        flags=re.S)
    assert blocks and all(block in EXAMPLE.read_text() for block in blocks)


# -- in this process: the guard and the package ------------------------------------------------


def test_the_supported_range_is_the_extras() -> None:
    """The extra says the oldest tested release with no upper bound (issue 48); the
    dev pin is the newest tested."""
    from joinkit.adapters import deepspeed
    from joinkit.adapters.deepspeed import _private

    extra = re.search(r"^deepspeed = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(),
                      flags=re.M)
    assert extra is not None
    assert f'"deepspeed{deepspeed.SUPPORTED_DEEPSPEED}"' in extra.group(1)
    pin = f"deepspeed=={_private.TESTED_DEEPSPEED[-1]}"
    assert pin in (ROOT / "constraints.txt").read_text().splitlines()
    assert deepspeed.SUPPORTED_DEEPSPEED == f">={_private.TESTED_DEEPSPEED[0]}"


@pytest.mark.parametrize("release", ["0.18.2", "0.20.1", "1.0.0"])
def test_the_guard_table_decides_not_the_version(monkeypatch: pytest.MonkeyPatch,
                                                 release: str) -> None:
    """Any release whose members are as listed passes; one that lacks a member is
    refused with the version found and the member."""
    from importlib import metadata

    from joinkit.adapters.deepspeed import UnsupportedDeepSpeedError, _private

    monkeypatch.setattr(metadata, "version", lambda name: release)
    monkeypatch.setattr(_private, "_checked", [])
    _private.check()
    gone = _private.Member(module=_private._ENGINE, name="DeepSpeedEngine.micro_steps_renamed",
                           need=_private.Need.ATTRIBUTE, why="the micro-step counter")
    monkeypatch.setattr(_private, "ENGINE_MEMBERS", (*_private.ENGINE_MEMBERS, gone))
    monkeypatch.setattr(_private, "_checked", [])
    message = (rf"(?s)^found deepspeed {re.escape(release)}; joinkit's DeepSpeed adapter needs "
               r".*DeepSpeedEngine\.micro_steps_renamed is missing.*the micro-step counter")
    with pytest.raises(UnsupportedDeepSpeedError, match=message):
        _private.check()


class _Epilogue0182:
    def independent_gradient_partition_epilogue(self) -> None:  # DeepSpeed 0.18.2's test
        for i in range(1):
            if not i in self.averaged_gradients or self.averaged_gradients[i] is None:  # noqa: E713
                self.all_grad_tensors[i] = []


class _Epilogue0183:
    def independent_gradient_partition_epilogue(self) -> None:  # DeepSpeed 0.18.3's test
        for i in range(1):
            if i not in self.all_grad_tensors or self.all_grad_tensors[i] is None:
                self.all_grad_tensors[i] = []


class _Prologue0182:
    def _backward_prologue(self, loss: Any, scale_wrt_gas: bool = True) -> Any:  # 0.18.2's
        do_gradient_reduction = self.enable_backward_allreduce and not self.inside_no_sync_ctxt
        if do_gradient_reduction and self.gradient_accumulation_steps() > 1 and scale_wrt_gas:
            loss = self._scale_loss_by_gas(loss.float())
        return loss


class _Prologue0183:
    def _backward_prologue(self) -> None:  # 0.18.3 divides each gradient, no_sync or not
        self.optimizer.backward_prologue()


class _OffloadAccumulation0183:
    def async_accumulate_grad_in_cpu_via_gpu(self) -> None:  # 0.18.3-0.18.9's branch
        def accumulate_gradients() -> None: ...

        def copy_gradients_to_cpu() -> None: ...

        if self.micro_step_id > 0:
            accumulate_gradients()
        else:
            copy_gradients_to_cpu()


class _OffloadAccumulation0190:
    def async_accumulate_grad_in_cpu_via_gpu(self) -> None:  # 0.19.0 saves every sum
        def accumulate_gradients() -> None: ...

        def copy_gradients_to_cpu() -> None: ...

        if self.micro_step_id > 0:
            accumulate_gradients()
        copy_gradients_to_cpu()


class _FlatBuffer0189:
    def __init__(self) -> None:  # 0.18.7-0.18.9 keep the flattened buffer in autograd
        self.bit16_groups_flat: list[Any] = []
        flattened_buffer = self.flatten_dense_tensors_aligned([],
                                                              1,
                                                              use_cpu_data=False)
        self.bit16_groups_flat.append(flattened_buffer)

    def flatten_dense_tensors_aligned(self, tensors: Any, alignment: int,
                                      use_cpu_data: bool = False) -> Any: ...


class _FlatBuffer0190(_FlatBuffer0189):
    def __init__(self) -> None:  # 0.19.0 detaches it
        self.bit16_groups_flat: list[Any] = []
        flattened_buffer = self.flatten_dense_tensors_aligned([],
                                                              1,
                                                              use_cpu_data=False).detach()
        self.bit16_groups_flat.append(flattened_buffer)


class _CoalescedGather0183:
    def _allgather_params_coalesced(self) -> None:  # 0.18.3-0.19.7's wait
        launch_handles = [self]
        launch_handles[-1].wait()


class _CoalescedGather0198:
    def _allgather_params_coalesced(self) -> None:  # 0.19.8 waits on every gather
        for handle in [self]:
            handle.wait()


#: Each bug the compat layer reads from DeepSpeed's code: (its detector,
#: the module and class whose method it reads) -> the method with the bug and with its
#: fix, and the releases that have it (from the first, where it is in the range, to
#: the one that fixed it, excluded).
_BUGS = {("zero2_keeps_last_micro_step", "_STAGE12", "DeepSpeedZeroOptimizer"):
         (_Epilogue0182, _Epilogue0183, ((0, 0, 0), (0, 18, 3))),
         ("no_sync_skips_accumulation_scaling", "_ENGINE", "DeepSpeedEngine"):
         (_Prologue0182, _Prologue0183, ((0, 0, 0), (0, 18, 3))),
         ("zero2_offload_drops_middle_micro_steps", "_STAGE12", "DeepSpeedZeroOptimizer"):
         (_OffloadAccumulation0183, _OffloadAccumulation0190, ((0, 0, 0), (0, 19, 0))),
         ("zero12_step_raises_on_cpu", "_STAGE12", "DeepSpeedZeroOptimizer"):
         (_FlatBuffer0189, _FlatBuffer0190, ((0, 18, 7), (0, 19, 0))),
         ("zero3_gather_races_on_cpu", "_PARTITION", "Init"):
         (_CoalescedGather0183, _CoalescedGather0198, ((0, 0, 0), (0, 19, 8)))}


@pytest.mark.parametrize(("bug", "owner", "found"), [
    (bug, owner, found) for bug, (old, new, _) in _BUGS.items()
    for owner, found in ((old, True), (new, False), (object, False))])
def test_a_deepspeed_bug_is_read_from_deepspeeds_code(
        monkeypatch: pytest.MonkeyPatch, bug: tuple[str, str, str], owner: type,
        found: bool) -> None:
    """The compat layer finds each bug in DeepSpeed's own code (not the version
    number): 0.18.2's ZeRO-2 epilogue line that restarts the window's sum, and its
    engine's backward that divides the loss by the accumulation steps only when it
    reduces (not under ``no_sync()``); 0.18.3-0.18.9's ZeRO-2 offload branch that saves
    a window's CPU sum on its first micro-step only; 0.18.7-0.18.9's ZeRO-1/2 constructor
    that keeps its flattened parameters in autograd (no ``.detach()``); 0.18.3-0.19.7's
    ZeRO-3 gather that waits on its last all-gather alone. The fixed method, or one it
    cannot read, has none. On the DeepSpeed installed here each agrees with DeepSpeed's
    history."""
    import types

    from joinkit.adapters._guards import version
    from joinkit.adapters.deepspeed import _private

    detector, module_name, class_name = bug
    detect = getattr(_private, detector)
    release = tuple(int(part) for part in version("deepspeed").split(".")[:3])
    first, fixed = _BUGS[bug][2]
    assert detect() == (first <= release < fixed)
    module = types.ModuleType(getattr(_private, module_name))
    setattr(module, class_name, owner)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    detect.cache_clear()
    try:
        assert detect() is found
    finally:
        detect.cache_clear()


def test_zero2_accumulation_on_such_a_release_is_refused_with_its_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where this DeepSpeed steps on a window's last micro-step alone, ZeRO-2 with
    accumulation and without optimizer offload is refused (the message names the version,
    the accumulation and the ways out); ZeRO-1, offload or one micro-step still run.
    Likewise the loop's windows on ZeRO 0/1 where ``no_sync()`` leaves a micro-step
    undivided, and ZeRO-2 offload past 2 accumulation steps where it drops the middle
    ones."""
    import types

    from joinkit.adapters._guards import version
    from joinkit.adapters.deepspeed import _engine, _private

    monkeypatch.setattr(_private, "zero2_keeps_last_micro_step", lambda: True)
    monkeypatch.setattr(_private, "zero2_offload_drops_middle_micro_steps", lambda: False)
    monkeypatch.setattr(_private, "zero3_gather_races_on_cpu", lambda: False)
    monkeypatch.setattr(_private, "zero12_step_raises_on_cpu", lambda: False)

    def engine(stage: int, gas: int, offload: str = "none", device: str = "cpu",
               optimizer: Any = None, world: int = 2) -> Any:
        where = None if offload == "none" else types.SimpleNamespace(device=offload)
        return types.SimpleNamespace(zero_offload_optimizer=lambda: where,
                                     gradient_accumulation_steps=lambda: gas,
                                     zero_optimization_stage=lambda: stage,
                                     device=torch.device(device), optimizer=optimizer,
                                     dp_world_size=world)

    message = _engine._training_refusal(engine(2, 3))
    assert message is not None and message.startswith(
        f"found deepspeed {version('deepspeed')}, whose ZeRO-2 steps on the last ")
    assert "gradient_accumulation_steps=3: the other 2 are dropped" in message
    assert "pip install 'deepspeed>=0.18.3'" in message
    for stage, gas, offload in ((2, 1, "none"), (1, 3, "none"), (3, 3, "none"),
                                (2, 3, "cpu")):
        assert _engine._training_refusal(engine(stage, gas, offload)) is None

    # The loop's windows (Accelerate's accumulate()) on ZeRO 0 and 1 where no_sync()
    # leaves a micro-step undivided; the engine's own loop (no no_sync()) still runs.
    monkeypatch.setattr(_private, "zero2_keeps_last_micro_step", lambda: False)
    monkeypatch.setattr(_private, "no_sync_skips_accumulation_scaling", lambda: True)
    for stage in (0, 1):
        message = _engine._training_refusal(engine(stage, 2), windows=True)
        assert message is not None and message.startswith(
            f"found deepspeed {version('deepspeed')}, whose engine.no_sync() leaves a ")
        assert f"on ZeRO-{stage}" in message and "would count 2 times" in message
        assert "pip install 'deepspeed>=0.18.3'" in message
        assert _engine._training_refusal(engine(stage, 2)) is None
    for stage, gas in ((1, 1), (2, 2), (3, 2)):
        assert _engine._training_refusal(engine(stage, gas), windows=True) is None

    # ZeRO-2 with optimizer offload where the CPU sum keeps a window's first micro-step
    # only: more than 2 accumulation steps are refused; ZeRO-1 and 3, or 2 steps, run.
    monkeypatch.setattr(_private, "no_sync_skips_accumulation_scaling", lambda: False)
    monkeypatch.setattr(_private, "zero2_offload_drops_middle_micro_steps", lambda: True)
    message = _engine._training_refusal(engine(2, 4, "cpu"))
    assert message is not None and message.startswith(
        f"found deepspeed {version('deepspeed')}, whose ZeRO-2 with offload_optimizer ")
    assert "gradient_accumulation_steps=4" in message and "the other 2 are dropped" in message
    assert "pip install 'deepspeed>=0.19.0'" in message
    for stage, gas, offload in ((2, 2, "cpu"), (2, 3, "none"), (1, 3, "cpu"), (3, 3, "cpu")):
        assert _engine._training_refusal(engine(stage, gas, offload)) is None

    # ZeRO-3 on the CPU where its gathers are read before they end: refused with or
    # without accumulation, the loop's windows or not; on a GPU, and ZeRO 0-2, it runs.
    monkeypatch.setattr(_private, "zero2_offload_drops_middle_micro_steps", lambda: False)
    monkeypatch.setattr(_private, "zero3_gather_races_on_cpu", lambda: True)
    for gas, offload, windows in ((1, "none", False), (2, "cpu", True)):
        message = _engine._training_refusal(engine(3, gas, offload), windows=windows)
        assert message is not None and message.startswith(
            f"found deepspeed {version('deepspeed')}, whose ZeRO-3 on the CPU (gloo) ")
        assert "pip install 'deepspeed>=0.19.8'" in message
        assert "or use ZeRO-1 or ZeRO-2, or a GPU" in message
    assert _engine._training_refusal(engine(3, 2, device="cuda")) is None
    for stage in (0, 1, 2):
        assert _engine._training_refusal(engine(stage, 1)) is None

    # ZeRO-1/2 on the CPU where the first optimizer step raises (the flat parameters kept
    # in autograd): refused for ZeRO-1/2's optimizer on 2 ranks or more, with or without
    # accumulation or offload; on a GPU, one rank, or another optimizer (bf16's at
    # stage 1), it runs.
    monkeypatch.setattr(_private, "zero3_gather_races_on_cpu", lambda: False)
    monkeypatch.setattr(_private, "zero12_step_raises_on_cpu", lambda: True)
    zero = types.new_class("DeepSpeedZeroOptimizer")
    monkeypatch.setitem(sys.modules, _private._STAGE12,
                        types.SimpleNamespace(DeepSpeedZeroOptimizer=zero))
    for stage, gas, offload, windows in ((1, 1, "none", False), (2, 3, "cpu", True)):
        message = _engine._training_refusal(engine(stage, gas, offload, optimizer=zero()),
                                            windows=windows)
        assert message is not None and message.startswith(
            f"found deepspeed {version('deepspeed')}, whose ZeRO-{stage} keeps its ")
        assert "Output 0 of Split is a view" in message and "on every rank" in message
        assert "fixed it in 0.19.0" in message
        assert "pip install 'deepspeed>=0.19.0'" in message
    # ZeRO-3's refusal then names ZeRO-0 as the CPU's way out, not ZeRO-1/2.
    monkeypatch.setattr(_private, "zero3_gather_races_on_cpu", lambda: True)
    assert "or use ZeRO-0, or a GPU" in str(_engine._training_refusal(engine(3, 1)))
    monkeypatch.setattr(_private, "zero3_gather_races_on_cpu", lambda: False)
    for runs in (engine(2, 1, device="cuda", optimizer=zero()),
                 engine(2, 1, optimizer=zero(), world=1), engine(1, 1, optimizer=object()),
                 engine(0, 1)):
        assert _engine._training_refusal(runs) is None


@pytest.mark.launches
def test_importing_the_adapter_imports_neither_torch_nor_deepspeed() -> None:
    import subprocess

    code = ("import sys, joinkit.adapters.deepspeed as d; "
            "print(d.DEEPSPEED.name, 'torch' in sys.modules, 'deepspeed' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.split() == ["deepspeed", "False", "False"]


def test_a_deepspeed_joinable_refuses_wrong_arguments() -> None:
    from joinkit.adapters.deepspeed import DeepSpeedJoinable

    for name in ("boundaries", "after_step"):
        with pytest.raises(TypeError, match=f"{name} must be callable or None"):
            DeepSpeedJoinable(object(), **{name: 3})


def test_step_replay_refuses_wrong_arguments() -> None:
    from joinkit.adapters.torch.step_replay import StepReplay

    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        StepReplay(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step must be callable"):
        StepReplay(model, step=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a step without a backward"):
        StepReplay(model, backward=None, step=lambda: None)
    assert StepReplay(model, backward=None).trains is False


# -- nccl: written for GPUs, skipped without CUDA -------------------------------------------------


@pytest.mark.launches
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_training_cells_on_nccl(tmp_path: Path) -> None:
    world = 2 if torch.cuda.device_count() >= 2 else 1
    env = _environment()
    env.pop("DS_ACCELERATOR")
    env["JOINKIT_DS_BACKEND"] = "nccl"
    build_cpu_adam(env, ROOT)
    run, = launch_ranks([_command("torchrun", world, tmp_path, "train_cells")], LAUNCH_TIMEOUT,
                        env=env, cwd=ROOT)
    records = records_by_name(tmp_path, world)
    for spec in c.cells(world):
        ranks = records.get(spec["name"], [])
        assert len(ranks) == world and all(r["ok"] for r in ranks), run.stdout[-6000:]
        want = reference(spec, world)
        assert max(c.max_error(r["params"], want) for r in ranks) < 1e-5, spec["name"]
