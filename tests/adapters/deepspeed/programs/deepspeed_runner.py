"""One launched DeepSpeed job: many cells in one process, so DeepSpeed imports once.

Run by ``test_deepspeed.py`` under ``torchrun`` or the ``deepspeed``
launcher (which appends ``--local_rank=N``)::

    python deepspeed_runner.py OUT GROUP[,GROUP...]

with ``DS_ACCELERATOR=cpu`` and gloo (``JOINKIT_DS_BACKEND=nccl``: CUDA and nccl,
each rank on its ``LOCAL_RANK``'s device). GROUPs, run in the order given:

- ``train_cells``: every cell of ``deepspeed_cells.cells(world)`` (ZeRO-Offload's
  among them: ``DeepSpeedCPUAdam`` needs its C++ op built, ``test_deepspeed.py``
  builds it first)
  (``launcher_cells``: ``deepspeed_cells.launcher_cells(world)``): a fresh engine
  (``deepspeed.initialize`` with a client torch optimizer and LR scheduler),
  each rank's batches of the cell's plan under ``Join([engine])``; records the
  full parameters after the Join (ZeRO-3's gathered), the micro-steps and
  optimizer steps the engine counted, and the Join's report;
- ``step_replay``: ``StepReplay`` over a user's step whose layer all-reduces
  in forward and backward and whose step all-reduces the gradients;
- ``eval_cells``: ``Join([evaluation(engine)])`` over ZeRO-3, uneven batches: each
  rank's summed loss;
- ``refusals``: what ``Join`` refuses on entry (each rank records the error);
  ``parallel_refusals``: MoE and pipeline engines, last (they change
  DeepSpeed's global process groups);
- ``accelerate``: Accelerate's DeepSpeed plugin through joinkit's
  ``join_uneven_inputs`` (``deepspeed_cells.accelerate_cells``: gradient
  accumulation in ``accelerator.accumulate``, ZeRO 1-3), and a loop that
  accumulates without ``accumulate()`` (refused at its first micro-step);
- ``mistakes``: loop mistakes caught on the rank that makes them
  (``LocalProtocolError`` there, ``PeerFailure`` on its peers, no hang);
- ``example``: ``examples/deepspeed_uneven.py`` run in this process (its output
  recorded).

Each rank appends one JSON line per cell to ``OUT/rank{r}.jsonl``
(``support.recording``); an exception is recorded, not raised.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deepspeed_cells as c
import torch
import torch.distributed as dist
from support import recording

warnings.filterwarnings("ignore")
if os.environ.get("JOINKIT_DS_BACKEND", "gloo") == "gloo":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import deepspeed.runtime.zero.partitioned_param_coordinator  # noqa: E402

if os.environ.get("JOINKIT_DS_BACKEND", "gloo") == "gloo":
    # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce (a C++
    # extension, ~3 min on 2 loaded cores) in ``init_distributed``, behind a lock file
    # in ~/.cache/torch_extensions that a killed build leaves behind, so every later run
    # waits on it forever. The tests need gloo's collectives, not that speed-up:
    # marking the op incompatible (the dict DeepSpeed documents as editable) makes
    # DeepSpeed use torch.distributed's, as on a machine without a compiler.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

from joinkit import Join, LocalProtocolError, PeerFailure  # noqa: E402
from joinkit.adapters.deepspeed import _private, evaluation  # noqa: E402

ROOT = Path(__file__).resolve().parents[4]
#: The stage of the accumulating cells that test another refusal or mistake: ZeRO-2,
#: except on a DeepSpeed whose accumulation Join refuses first there (0.18.2: its ZeRO-2
#: drops a window's earlier micro-steps, and its no_sync() leaves them undivided on
#: ZeRO 0 and 1; test_deepspeed's refusal cells assert both), where they take ZeRO-3.
ACCUMULATING_STAGE = 3 if _private.zero2_keeps_last_micro_step() else 2
#: The stage of the mistakes that want ZeRO-3's gathers in forward: ZeRO-2 where Join
#: refuses to train ZeRO-3 on the CPU (0.18.2 to 0.19.7 read their gathered parameters
#: before the gathers end; test_deepspeed's training cells assert that refusal).
GATHERING_STAGE = (2 if os.environ.get("JOINKIT_DS_BACKEND", "gloo") == "gloo"
                   and _private.zero3_gather_races_on_cpu() else 3)
#: Whether this DeepSpeed's ZeRO-3 releases, at a backward's end, the parameters whose
#: post-backward hook never fired (``full_params``).
_RELEASES_BACKWARD_LEFTOVERS = hasattr(
    deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator,
    "release_backward_leftovers")
GROUPS: dict[str, Callable[[Path, int, int], None]] = {}


def group(fn: Callable[[Path, int, int], None]) -> Callable[[Path, int, int], None]:
    GROUPS[fn.__name__] = fn
    return fn


def engine_for(spec: dict[str, Any], world: int, **config: Any) -> Any:
    model = c.make_model()
    optimizer = c.make_optimizer(spec["optimizer"], model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, c.lr_lambda)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config={**c.ds_config(spec, world), **config})
    return engine


def full_params(engine: Any) -> list[list[float]]:
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() != 3:
        return [p.detach().double().flatten().tolist() for p in params]
    values: list[list[float]] | None = None
    try:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            values = [p.detach().double().flatten().tolist() for p in params]
    except AssertionError:
        # DeepSpeed 0.18.2's ZeRO-3 leaves the first layer's parameters marked in use
        # after a backward whose input needs no gradient (its post-backward hook never
        # fires), so GatheredParameters' exit fails on them after a micro-step that left
        # a window open, with or without a Join (a later release clears them at each
        # backward's end); the gathered values were read before it.
        if _RELEASES_BACKWARD_LEFTOVERS or values is None:
            raise
    assert values is not None
    return values


def offload_devices(engine: Any) -> dict[str, str]:
    """Where the engine keeps its optimizer state and parameters (``none``, ``cpu``)."""
    devices = {}
    for what, offload in (("optimizer", engine.zero_offload_optimizer()),
                          ("param", engine.zero_offload_param())):
        device = getattr(offload, "device", "none")
        devices[what] = str(getattr(device, "value", device))
    return devices


def train(engine: Any, batches: list[tuple[Any, Any]]) -> None:
    for x, y in batches:
        x, y = x.to(engine.device), y.to(engine.device)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()


@group
def train_cells(out: Path, rank: int, world: int) -> None:
    _train(out, rank, world, c.cells(world))


@group
def launcher_cells(out: Path, rank: int, world: int) -> None:
    _train(out, rank, world, c.launcher_cells(world))


def _train(out: Path, rank: int, world: int, specs: list[dict[str, Any]]) -> None:
    for spec in specs:
        with recording(out, spec["name"]) as record:
            began = time.monotonic()
            engine = engine_for(spec, world)
            batches = [c.batch(rank, i) for i in range(spec["plan"][rank])]
            with Join([engine], divide_by_initial_world_size=spec["divide"]) as join:
                train(engine, batches)
            report = join.report
            assert report is not None
            record.update(
                offload=offload_devices(engine),
                optimizer=type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
                params=full_params(engine), micro_steps=engine.micro_steps,
                global_steps=engine.global_steps, inputs=report.inputs,
                shadow_rounds=report.shadow_rounds, lr=engine.get_lr()[0],
                seconds=time.monotonic() - began)


@group
def step_replay(out: Path, rank: int, world: int) -> None:
    """StepReplay over a user's step: a layer with all-reduces in forward and
    backward (``deepspeed_cells.CenteredNet``), then the user's own gradient
    all-reduce and an SGD step."""
    from joinkit.adapters.torch.step_replay import StepReplay

    with recording(out, "step-replay") as record:
        model = c.CenteredNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=10 * c.LR, momentum=0.5)

        def step() -> None:
            for param in model.parameters():
                dist.all_reduce(param.grad)
                param.grad /= world
            optimizer.step()
            optimizer.zero_grad()

        with Join([StepReplay(model, step=step)]) as join:
            for i in range(c.STEP_PLANS[world][rank]):
                x, y = c.batch(rank, i)
                torch.nn.functional.mse_loss(model(x), y).backward()
                step()
        assert join.report is not None
        record.update(params=[p.detach().double().flatten().tolist() for p in model.parameters()],
                      shadow_rounds=join.report.shadow_rounds)


@group
def eval_cells(out: Path, rank: int, world: int) -> None:
    with recording(out, "eval-s3") as record:
        spec = c.cell("eval", stage=3, plan=[3, 5, 1][:world])
        engine = engine_for(spec, world)
        engine.eval()
        total = torch.zeros(())
        with Join([evaluation(engine)]) as join, torch.no_grad():
            for i in range(spec["plan"][rank]):
                x, y = c.batch(rank, i)
                total += torch.nn.functional.mse_loss(engine(x), y, reduction="sum")
        dist.all_reduce(total)
        assert join.report is not None
        record.update(total=float(total), shadow_rounds=join.report.shadow_rounds)


def refused(make: Callable[[], Any]) -> str:
    """The error ``make()`` raised (it must raise), as ``Type: message``."""
    try:
        joined = make()
    except Exception as error:  # noqa: BLE001 - recorded for the test to read
        return f"{type(error).__name__}: {error}"
    raise AssertionError(f"not refused: {joined!r}")


def _absent(out: Path, case: str, setting: str) -> None:
    """Record that this DeepSpeed has no ``setting``, so ``case`` cannot be built."""
    with recording(out, f"refuse-{case}") as record:
        record["error"] = f"absent: this DeepSpeed has no {setting} setting"


@group
def refusals(out: Path, rank: int, world: int) -> None:
    spec = c.cell("refusal", stage=2, plan=[2] * world)
    engine = engine_for(spec, world)
    cases: dict[str, Callable[[], Any]] = {
        "optimizer": lambda: Join([engine, engine.optimizer]),
        "torch-optimizer": lambda: Join([engine, engine.basic_optimizer]),
        "scheduler": lambda: Join([engine, engine.lr_scheduler]),
        "optimizer-first": lambda: Join([engine.optimizer, engine]),
        "sum-active": lambda: Join([engine], divide_by_initial_world_size=False),
        "finish": lambda: Join([engine], on_rank_loss="finish").__enter__(),
    }
    # Settings DeepSpeed 0.18.2 (the oldest supported) does not have: there every
    # engine averages and manages its accumulation, so there is nothing to refuse.
    if hasattr(engine._config, "gradient_allreduce_op"):
        summing = engine_for(spec, world, gradient_allreduce_op="sum")
        cases["sum-active"] = lambda: Join([summing], divide_by_initial_world_size=False)
    else:
        del cases["sum-active"]
        _absent(out, "sum-active", "gradient_allreduce_op")
    if hasattr(engine, "managed_gradient_accumulation"):
        unmanaged = engine_for(spec, world, managed_gradient_accumulation=False)
        cases["unmanaged"] = lambda: Join([unmanaged])
    else:
        _absent(out, "unmanaged", "managed_gradient_accumulation")
    for name, make in cases.items():
        with recording(out, f"refuse-{name}") as record:
            record["error"] = refused(make)
    with recording(out, "refuse-nvme") as record:
        nvme = _nvme_engine(world)
        record["error"] = refused(lambda: Join([nvme]))
    # A Join that refused leaves the engine as it was: it trains in the next one.
    with recording(out, "after-refusals") as record:
        with Join([engine]):
            train(engine, [c.batch(rank, i) for i in range(rank + 1)])
        record["params"] = full_params(engine)


@group
def parallel_refusals(out: Path, rank: int, world: int) -> None:
    """MoE, then pipeline parallelism: last in a job (they change DeepSpeed's global groups)."""
    for name, build in (("moe", _moe_engine), ("pipeline", _pipeline_engine)):
        with recording(out, f"refuse-{name}") as record:
            built = build(world)
            record["error"] = refused(lambda built=built: Join([built]))


def _nvme_engine(world: int) -> Any:
    """An engine whose config reads ``offload_param`` to NVMe (ZeRO-Infinity).

    DeepSpeed cannot build such an engine here (its async I/O op needs libaio,
    which this machine lacks), so a ZeRO-3 engine's config accessor answers
    as that config's would: the refusal reads the config only.
    """
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadParamConfig

    spec = c.cell("nvme", stage=3, plan=[1] * world)
    engine = engine_for(spec, world)
    nvme = DeepSpeedZeroOffloadParamConfig(device="nvme", nvme_path="/tmp")
    engine.zero_offload_param = lambda: nvme
    return engine


def _pipeline_engine(world: int) -> Any:
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    layers = [torch.nn.Linear(c.IN, c.HIDDEN), torch.nn.Tanh(), torch.nn.Linear(c.HIDDEN, c.OUT)]
    module = PipelineModule(layers=layers, num_stages=world,
                            loss_fn=torch.nn.functional.mse_loss)
    spec = c.cell("pipe", stage=0, plan=[1] * world)
    engine, *_ = deepspeed.initialize(
        model=module, model_parameters=list(module.parameters()),
        config={**c.ds_config(spec, 1), "train_batch_size": c.BATCH,
                "optimizer": {"type": "Adam", "params": {"lr": c.LR, "torch_adam": True}}})
    return engine


def _moe_engine(world: int) -> Any:
    from deepspeed.moe.layer import MoE

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(c.IN, c.HIDDEN)
            self.moe = MoE(hidden_size=c.HIDDEN, expert=torch.nn.Linear(c.HIDDEN, c.HIDDEN),
                           num_experts=world, ep_size=world, k=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden, _, _ = self.moe(self.inp(x))
            return hidden

    torch.manual_seed(0)
    model = Experts()
    spec = c.cell("moe", stage=0, plan=[1] * world)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=list(model.parameters()),
        config={**c.ds_config(spec, world),
                "optimizer": {"type": "Adam", "params": {"lr": c.LR, "torch_adam": True}}})
    return engine


def deepspeed_accelerator(config: dict[str, Any]) -> tuple[Any, str]:
    """An Accelerator with DeepSpeed's plugin on this CPU machine, and the type it chose.

    Accelerate 1.15 runs DeepSpeed on GPU-like devices only: with ``cpu=True``
    it ignores the plugin (``MULTI_CPU``), without it a CPU process is a world
    of one. So, as the FSDP2 runs do
    (``tests/adapters/accelerate/programs/accelerate_program.py``), the state is
    set to what a GPU machine gets: ``DistributedType.DEEPSPEED`` with the
    plugin selected (a test-only override; the rest is Accelerate's own).
    Accelerate keeps one accelerator state per process: it is reset first.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DataLoaderConfiguration, DeepSpeedPlugin, DistributedType

    AcceleratorState._reset_state()
    GradientState._reset_state()
    if PartialState._shared_state:  # undo the previous cell's override (below)
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU
    plugin = DeepSpeedPlugin(hf_ds_config=config)
    accelerator = Accelerator(cpu=True, deepspeed_plugin=plugin,
                              dataloader_config=DataLoaderConfiguration(even_batches=False))
    chosen = str(accelerator.distributed_type)
    state = accelerator.state
    # Both states: AcceleratorState() copies PartialState's type whenever built.
    state.distributed_type = DistributedType.DEEPSPEED
    PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
    plugin.set_mixed_precision("no")
    plugin.select(_from_accelerator_state=True)
    state.deepspeed_plugins = plugin
    return accelerator, chosen


@group
def accelerate(out: Path, rank: int, world: int) -> None:
    from joinkit.adapters.accelerate import join_uneven_inputs

    for spec in c.accelerate_cells(world):
        with recording(out, spec["name"]) as record:
            accelerator, record["distributed_type"] = deepspeed_accelerator(
                c.ds_config(spec, world))
            model = c.make_model()
            optimizer = c.make_optimizer(spec["optimizer"], model.parameters())
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, c.lr_lambda)
            plan = spec["plan"]
            if spec["prepared"]:
                # Accelerate deals batch i to rank i % world: rank r's j-th batch is
                # batch j * world + r, so the dataset lists them in that order.
                xs, ys = zip(*(c.batch(r, j) for j in range(max(plan)) for r in range(world)
                               if j < plan[r]), strict=True)
                data = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
                loader: Any = torch.utils.data.DataLoader(data, batch_size=c.BATCH)
                engine, optimizer, loader, scheduler = accelerator.prepare(
                    model, optimizer, loader, scheduler)
            else:  # each rank's own batches (a rank may have none)
                engine, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
                loader = [c.batch(rank, j) for j in range(plan[rank])]
            record["engine"] = type(engine).__name__
            record["stage"] = engine.zero_optimization_stage()
            steps, losses = 0, []
            with join_uneven_inputs(accelerator, [engine, optimizer, scheduler],
                                    even_batches=False):
                for x, y in loader:
                    with accelerator.accumulate(engine):
                        loss = torch.nn.functional.mse_loss(engine(x), y)
                        accelerator.backward(loss)
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad()
                    losses.append(float(loss))
                    steps += 1
            record.update(params=full_params(engine), steps=steps, losses=losses,
                          global_steps=engine.global_steps, accelerator_step=accelerator.step,
                          sync_gradients=accelerator.sync_gradients,
                          lr=scheduler.get_last_lr()[0])
    with recording(out, "accelerate-no-accumulate") as record:
        # Accumulation in the DeepSpeed config without accelerator.accumulate(): each
        # micro-step would end a window (Accelerate's sync_gradients stays True).
        spec = c.cell("accelerate-plain-gas", stage=ACCUMULATING_STAGE, plan=[3] * world,
                      gas=2)
        accelerator, _ = deepspeed_accelerator(c.ds_config(spec, world))
        model = c.make_model()
        optimizer = c.make_optimizer("adamw", model.parameters())
        engine, optimizer = accelerator.prepare(model, optimizer)
        began = time.monotonic()
        try:
            with join_uneven_inputs(accelerator, [engine, optimizer]):
                for x, y in [c.batch(rank, j) for j in range(3)]:
                    accelerator.backward(torch.nn.functional.mse_loss(engine(x), y))
            record["error"] = None
        except (LocalProtocolError, PeerFailure) as error:
            record["error"] = f"{type(error).__name__}: {error}"
        record["seconds"] = time.monotonic() - began


def _mistake(out: Path, name: str, stage: int, world: int, rank: int,
             loop: Callable[[Any, list[Any]], None], gas: int = 1,
             windows: bool = False) -> None:
    """``loop`` under ``Join([engine])`` (``windows``: on the loop's windows of ``gas``
    micro-steps, ``DeepSpeedJoinable(engine, boundaries=...)``)."""
    from joinkit.adapters.deepspeed import DeepSpeedJoinable

    with recording(out, f"mistake-{name}") as record:
        spec = c.cell(name, stage=stage, plan=[3] * world, gas=gas)
        engine = engine_for(spec, world)
        joinable = (DeepSpeedJoinable(engine, boundaries=lambda i: (i + 1) % gas == 0)
                    if windows else engine)
        batches = [c.batch(rank, i) for i in range(3)]
        began = time.monotonic()
        try:
            with Join([joinable]):
                loop(engine, batches)
            record["error"] = None
        except (LocalProtocolError, PeerFailure) as error:
            record["error"] = f"{type(error).__name__}: {error}"
        record["seconds"] = time.monotonic() - began


@group
def mistakes(out: Path, rank: int, world: int) -> None:
    def eval_forward(engine: Any, batches: list[Any]) -> None:
        for i, (x, y) in enumerate(batches):
            if rank == 0 and i == 1:
                with torch.no_grad():
                    engine(x)
            train(engine, [(x, y)])

    def no_step(engine: Any, batches: list[Any]) -> None:
        for i, (x, y) in enumerate(batches):
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            if not (rank == 0 and i == 1):
                engine.step()

    def no_backward_at_the_end(engine: Any, batches: list[Any]) -> None:
        train(engine, batches[:-1])
        x, y = batches[-1]
        loss = torch.nn.functional.mse_loss(engine(x), y)
        if rank != 0:
            engine.backward(loss)
            engine.step()

    def outside_boundary(engine: Any, batches: list[Any]) -> None:
        for i, (x, y) in enumerate(batches):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.set_gradient_accumulation_boundary(not (rank == 0 and i == 1))
            engine.backward(loss)
            engine.step()

    _mistake(out, "eval-forward", GATHERING_STAGE, world, rank, eval_forward)
    _mistake(out, "no-step", 2, world, rank, no_step)
    _mistake(out, "no-backward", GATHERING_STAGE, world, rank, no_backward_at_the_end)
    _mistake(out, "boundary", 0, world, rank, outside_boundary)

    # On the loop's windows (the loop sets the boundary and steps at a window's end):
    def step_inside_a_window(engine: Any, batches: list[Any]) -> None:
        for i, (x, y) in enumerate(batches):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.set_gradient_accumulation_boundary((i + 1) % 2 == 0)
            engine.backward(loss)
            if (i + 1) % 2 == 0 or (rank == 0 and i == 0):
                engine.step()

    def no_sync_at_a_window_end(engine: Any, batches: list[Any]) -> None:
        for i, (x, y) in enumerate(batches):
            end = (i + 1) % 2 == 0
            with engine.no_sync() if not end or rank == 0 else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.set_gradient_accumulation_boundary(end)
                engine.backward(loss)
            if end:
                engine.step()

    _mistake(out, "window-step", ACCUMULATING_STAGE, world, rank, step_inside_a_window,
             gas=2, windows=True)
    _mistake(out, "window-no-sync", 1, world, rank, no_sync_at_a_window_end, gas=2,
             windows=True)
    # The group still works after them: a collective every rank takes part in.
    with recording(out, "mistakes-then-all-reduce") as record:
        value = torch.ones(())
        dist.all_reduce(value)
        record["sum"] = float(value)


@group
def example(out: Path, rank: int, world: int) -> None:
    with recording(out, "example") as record:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(ROOT / "examples" / "deepspeed_uneven.py"), run_name="__main__")
        record["stdout"] = printed.getvalue()


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out, names = Path(args[0]), args[1].split(",")
    backend = os.environ.get("JOINKIT_DS_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    record_file = out / f"rank{rank}.jsonl"
    seconds = {}
    for name in names:
        began = time.monotonic()
        GROUPS[name](record_file, rank, world)
        seconds[name] = time.monotonic() - began
    with recording(record_file, "done") as record:
        record.update(world=world, seconds=seconds)
    dist.barrier()
    dist.destroy_process_group()
    # Every record is written: skip the interpreter's finalization, where
    # DeepSpeed's C++ state takes seconds (10-30 on a loaded 2-core machine).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
