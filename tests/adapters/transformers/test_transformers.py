"""The Hugging Face Trainer and TRL's SFTTrainer under ``uneven_inputs``, against one process.

One module fixture starts the launches at once: ``programs/hf_worker.py`` under
``torchrun`` with 2 ranks, under ``accelerate launch --multi_gpu`` with 3 CPU ranks
(every cell in one process per rank: transformers is imported once per rank), its
DeepSpeed cells under ``torchrun`` with 2 and with 3 ranks (only those import
DeepSpeed; DeepSpeed's CPU Adam op is built first), and ``examples/hf_trainer.py``
under ``torchrun`` with 2 ranks; then a second round resumes, on 3 and on 2 ranks,
checkpoints the first round's runs wrote. Only the launches the selected tests read
are started. Each cell's ranks are
compared with a float64 single-process reference trained on the batches they
recorded (``programs/hf_reference.py``), and the recorded batches with the data: every
sample once per epoch (map-style sets, in ``ShardSampler``'s order), each rank's
own stream in order (streams).
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")

import torch  # noqa: E402
from support import launch_ranks  # noqa: E402
from support.deepspeed_ops import build_cpu_adam  # noqa: E402

pytestmark = pytest.mark.needs_torch

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).parent / "programs" / "hf_worker.py"
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
DOC = ROOT / "docs" / "transformers.md"
BIN = Path(sys.executable).parent
LAUNCH_TIMEOUT = 480.0
CELLS = ["map_gas1", "map_gas2", "map_gas2_plain", "map_max_steps", "map_eval", "stream_zero",
         "stream_gas3", "sft_packing", "refusals"]
#: The first runs of the resumed cells (RESUMES), by launch.
FIRST_RUNS = {"torchrun-2": ["resume23_a", "stream_resume_a"], "accelerate-3": ["resume32_a"]}
LAUNCHES = {"torchrun-2": 2, "accelerate-3": 3, "deepspeed-2": 2, "deepspeed-3": 3,
            "resume-3": 3, "resume-2": 2, "fsdp-2": 2, "fsdp-3": 3, "fsdp-resume-3": 3,
            "fsdp-resume-2": 2}
#: The second round: launch -> (ranks, cells, the first-round launches they resume).
RESUMES = {"resume-3": (3, ["resume23_b", "stream_resume_refused"], ["torchrun-2"]),
           "resume-2": (2, ["resume32_b", "resume22_b", "stream_resume3_b", "stream_resume6_b"],
                        ["accelerate-3", "torchrun-2"]),
           # FSDP checkpoints of the fsdp-2 (fsdp-3) launch resumed on 3 (2) ranks.
           "fsdp-resume-3": (3, ["fsdp1_world_b", "fsdp2_world_b", "fsdp2_sharded_world_b"],
                             ["fsdp-2"]),
           "fsdp-resume-2": (2, ["fsdp1_world_b", "fsdp2_world_b", "fsdp2_sharded_world_b"],
                             ["fsdp-3"])}
RESUME_TIMEOUT = 300.0
#: The DeepSpeed cells, launched apart (only those launches import DeepSpeed).
DS_CELLS = ["ds_map_s2", "ds_map_s3", "ds_map_s1", "ds_resume_s2", "ds_resume_s3",
            "ds_stream_s2", "ds_stream_s3", "ds_even_s2", "ds_refusals", "ds_gas2_s1",
            "ds_gas3_s2", "ds_gas2_s3", "ds_offload_s2", "ds_offload_s3", "ds_cpu_adam_s2"]
DS3_CELLS = ["ds3_gas2_s2", "ds3_gas3_s1", "ds3_gas2_s3", "ds3_offload_s3"]
#: The Trainer with FSDP (FSDP1 and FSDP2), launched apart on 2 and 3 ranks.
FSDP_CELLS = ["fsdp2_map", "fsdp2_gas2", "fsdp2_stream_zero", "fsdp1_map",
              "fsdp1_gas2_stream_zero", "fsdp1_even", "fsdp_refusals", "fsdp2_bf16",
              "fsdp2_bf16_even", "fsdp1_bf16", "fsdp1_bf16_even", "fsdp2_save", "fsdp2_resume",
              "fsdp1_save", "fsdp1_resume", "fsdp2_zero_save", "fsdp1_zero_save",
              "fsdp2_stream_save", "fsdp2_best", "plain_fsdp1_sgd", "plain_fsdp1_adamw",
              "plain_fsdp2_sgd", "joinkit_fsdp1_sgd", "fsdp1_world_a", "fsdp2_world_a",
              "fsdp2_sharded_world_a",
              "fsdp1_load_best", "fsdp2_load_best"]
#: bf16=True under FSDP (bfloat16 parameters, reductions and autocast; float32 models
#: and master weights, SGD) against the float64 reference: measured 2.0e-4 (FSDP2) and
#: 6.1e-6 (FSDP1) on 2 and 3 ranks, and 1.9e-4 and 4.3e-6 for the control where nobody
#: joins; the bound, and at most BF16_CONTROL_FACTOR times the control's error.
BF16_PARAM_TOLERANCE = 1e-3
BF16_CONTROL_FACTOR = 3.0
FSDP_LAUNCHES = ["fsdp-2", "fsdp-3"]
#: DeepSpeed's ZeRO optimizer steps float32 master weights (its flat partitions are
#: ``.float()``) and sums the gradient norm in float32, so a float64 model trains in
#: float32 under it: measured at most 1.5e-6 from the float64 reference (norms 6.4e-7
#: relative), and 8.0e-7 with even data where nobody joins (``ds_even_s2``, the control).
DS_PARAM_TOLERANCE = 1e-5
DS_NORM_RELATIVE = 1e-5
#: Parameters: exact on 2 ranks (float64); on 3, gloo's float64 all-reduce differs
#: from one process's sum by about 1e-8 (plain DDP too), so the cells use SGD there.
PARAM_TOLERANCE = {2: 1e-9, 3: 1e-6}
#: SFTTrainer on 2 ranks (AdamW) ends 1.5e-7 from the reference: the gradient norms
#: agree to 1e-11 (relative) after the first step, where they are equal, and Adam's
#: normalization grows that on small gradients. Not pinned down (one process is exact).
SFT_PARAM_TOLERANCE = 1e-6
#: FSDP1 trains float32 here (its clip_grad_norm_, which the Trainer calls every step,
#: refuses float64 gradients), with SGD: measured at most 2e-7 from the float64
#: reference, and the same where nobody joins (``fsdp1_even``, the control).
FSDP1_PARAM_TOLERANCE = 1e-6
FSDP1_NORM_RELATIVE = 1e-5
#: The Trainer logs float32 values.
LOG_TOLERANCE = 2e-6
RUNTIME = ("runtime", "per_second", "model_preparation_time")

pytestmark = [pytest.mark.needs_torch,
              pytest.mark.timeout(2 * LAUNCH_TIMEOUT + RESUME_TIMEOUT)]


def _environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "SLURM_",
                                  "ACCELERATE_"))
           and key not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                           "JOINKIT_BACKEND"}}
    # The programs' folder, then the tests' (tests/conftest.py: the support package).
    path = os.pathsep.join([str(WORKER.parent), os.environ["PYTHONPATH"]])
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=path,
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _tool(name: str, module: str) -> list[str]:
    script = BIN / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def _needed(request: pytest.FixtureRequest) -> set[str]:
    """The launches the selected tests of this module read (every one if none says)."""
    needed: set[str] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        name = getattr(item, "originalname", item.name)
        callspec = getattr(item, "callspec", None)
        launch = callspec.params.get("launch") if callspec is not None else None
        if launch is not None:
            needed.add(launch)
        elif name.startswith("test_deepspeed"):
            needed.add("deepspeed-2")
        elif name.startswith("test_the_example_runs"):
            needed.add("example")
        elif name.startswith("test_own_streams_resumed_on_another"):
            needed.add("resume-3")
    for launch in list(needed):
        needed.update(RESUMES.get(launch, ((), (), ()))[2])
    return needed or {*LAUNCHES, "example"}


@pytest.fixture(scope="module")
def launches(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("transformers")
    torchrun = [*_tool("torchrun", "torch.distributed.run"), "--standalone"]
    # Accelerate launches CPU processes with torch's launcher under --multi_gpu (its
    # --cpu flag alone starts one process); the worker's use_cpu=True does the rest.
    accelerate = [*_tool("accelerate", "accelerate.commands.accelerate_cli"), "launch",
                  "--multi_gpu", "--main_process_port", "0"]
    dirs = {"torchrun-2": out / "t2", "accelerate-3": out / "a3", "deepspeed-2": out / "d2",
            "deepspeed-3": out / "d3", "resume-3": out / "r3", "resume-2": out / "r2",
            "fsdp-2": out / "f2", "fsdp-3": out / "f3", "fsdp-resume-3": out / "fr3",
            "fsdp-resume-2": out / "fr2"}
    first = {
        "torchrun-2": [*torchrun, "--nproc-per-node", "2", str(WORKER), str(dirs["torchrun-2"]),
                       *CELLS, *FIRST_RUNS["torchrun-2"]],
        "accelerate-3": [*accelerate, "--num_processes", "3", str(WORKER),
                         str(dirs["accelerate-3"]), *CELLS, *FIRST_RUNS["accelerate-3"]],
        "example": [*torchrun, "--nproc-per-node", "2", str(EXAMPLE)],
        "deepspeed-2": [*torchrun, "--nproc-per-node", "2", str(WORKER),
                        str(dirs["deepspeed-2"]), *DS_CELLS],
        "deepspeed-3": [*torchrun, "--nproc-per-node", "3", str(WORKER),
                        str(dirs["deepspeed-3"]), *DS3_CELLS],
        "fsdp-2": [*torchrun, "--nproc-per-node", "2", str(WORKER), str(dirs["fsdp-2"]),
                   *FSDP_CELLS],
        "fsdp-3": [*accelerate, "--num_processes", "3", str(WORKER), str(dirs["fsdp-3"]),
                   *FSDP_CELLS],
    }
    # The resumed runs find the first round's checkpoints under --root (hf_worker's CELLS).
    second = {launch: [*torchrun, "--nproc-per-node", str(world), str(WORKER),
                       str(dirs[launch]), f"--root={out}", *cells]
              for launch, (world, cells, _) in RESUMES.items()}
    needed = _needed(request)
    if needed & {"deepspeed-2", "deepspeed-3"}:
        # DeepSpeed's CPU Adam op, built once before the launches (minutes, once per machine).
        build_cpu_adam({**_environment(), "DS_ACCELERATOR": "cpu"}, ROOT)
    runs: dict[str, Any] = {}
    for commands, timeout in ((first, LAUNCH_TIMEOUT), (second, RESUME_TIMEOUT)):
        chosen = {name: command for name, command in commands.items() if name in needed}
        if chosen:
            done = launch_ranks(list(chosen.values()), timeout, env=_environment(), cwd=ROOT)
            runs.update(zip(chosen, done, strict=True))
    return {"out": out, "runs": runs, "dirs": dirs}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """The references are tiny models: one thread, so a loaded machine's cores go to
    the launched ranks (and to the other references)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _records(launches: dict[str, Any], launch: str, cell: str) -> list[dict[str, Any]]:
    world = LAUNCHES[launch]
    directory = launches["dirs"][launch] / cell
    paths = [directory / f"rank{rank}.pt" for rank in range(world)]
    if not all(path.exists() for path in paths):
        run = launches["runs"].get(launch)
        if run is None:
            pytest.fail(f"{launch} was not launched (a first-round launch of a resumed one "
                        "failed, or _needed missed it)")
        pytest.fail(f"{launch}: cell {cell} did not finish on every rank:\n"
                    f"{run.stdout[-4000:]}\n{run.stderr[-2000:]}")
    records = [torch.load(path, weights_only=False) for path in paths]
    errors = [r["error"] for r in records if not r["ok"]]
    assert not errors, "\n".join(errors)
    return records


def _batches(samples: int, world: int, size: int = 2) -> int:
    """Rank 0's batches of ``samples`` split exactly over ``world`` ranks (the most)."""
    return math.ceil(math.ceil(samples / world) / size)


def _clean(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in entry.items() if not any(word in k for word in RUNTIME)}
            for entry in history]


def _compare(records: list[dict[str, Any]], model: str, sft: bool = False,
             tolerance: float | None = None, norm_relative: float = 1e-6,
             trained: list[dict[str, Any]] | None = None,
             totals: dict[int, int] | None = None,
             lr_after_step: bool = False) -> dict[str, Any]:
    """Every rank against the float64 reference trained on the batches of ``trained``
    (default: ``records``; a resumed run's and its first run's): parameters, logged
    losses, learning rates (``lr_after_step``: the rate after each step's, as the
    Trainer logs it when DeepSpeed's engine steps the scheduler inside its step, before
    the Trainer reads it: its optimizer section), gradient norms, evaluations."""
    import hf_reference as ref
    import hf_worker as w

    world = len(records)
    history = records[0]["log_history"]
    for record in records[1:]:  # every rank ends with the same log
        assert _clean(record["log_history"]) == _clean(history)
    evaluation = w.sequences(records[0].get("eval_size", 7), seed=2)
    evals = {entry["step"]: evaluation for entry in history if "eval_loss" in entry}
    want = ref.train(trained or records, model, evals=evals, sft=sft, totals=totals)
    if tolerance is None:
        tolerance = SFT_PARAM_TOLERANCE if sft else PARAM_TOLERANCE[world]
    for record in records:
        assert ref.max_param_error(record["params"], want["params"]) < tolerance
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert losses == pytest.approx(want["losses"], abs=LOG_TOLERANCE)
    lrs = [entry["learning_rate"] for entry in history if "learning_rate" in entry]
    # The linear schedule reaches 0 at max_steps, the rate after the last step.
    assert lrs == pytest.approx([*want["lrs"][1:], 0.0] if lr_after_step else want["lrs"],
                                abs=1e-12)
    norms = [entry["grad_norm"] for entry in history if "grad_norm" in entry]
    meta = records[0]["meta"]
    if meta.get("norm_unclipped", True) or meta["max_grad_norm"]:
        assert norms == pytest.approx(want["norms"], rel=norm_relative)
    else:  # transformers 5.0 to 5.2 take no norm where they do not clip
        assert norms == []
    for entry in history:
        if "eval_loss" in entry:
            for key, value in want["evals"][entry["step"]].items():
                assert entry[key] == pytest.approx(value, abs=LOG_TOLERANCE), key
    return want


def _rows(batches: list[dict[str, Any]]) -> list[list[int]]:
    return [row for batch in batches for row in batch["input_ids"].tolist()]


def _check_shards(records: list[dict[str, Any]], samples: int, steps_per_epoch: int,
                  epochs: int) -> None:
    """Every sample once per epoch, each rank in ShardSampler's order (seed + epoch)."""
    import hf_worker as w

    data = [row["input_ids"] for row in w.sequences(samples, seed=1)]
    world = len(records)
    for epoch in range(epochs):
        steps = range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch)
        seen = []
        for rank, record in enumerate(records):
            own = _rows([b for s, b in record["recorded"] if s in steps])
            order = torch.randperm(samples, generator=torch.Generator().manual_seed(epoch))
            assert own == [data[i] for i in order.tolist()[rank::world]]
            seen += own
        assert sorted(seen) == sorted(data)


def _check_streams(records: list[dict[str, Any]], rows: list[int]) -> None:
    """Each rank trained on its own stream, in order, from the start of each pass."""
    import hf_worker as w

    for rank, record in enumerate(records):
        stream = [row["input_ids"] for row in w.sequences(rows[rank], seed=10 + rank)]
        own = _rows([b for _, b in record["recorded"]])
        assert own == (stream * (len(own) // max(len(stream), 1) + 1))[: len(own)]


DDP_LAUNCHES = ["torchrun-2", "accelerate-3"]


@pytest.mark.launches
@pytest.mark.parametrize(("launch", "cell", "first", "first_cell"), [
    ("resume-3", "resume23_b", "torchrun-2", "resume23_a"),
    ("resume-2", "resume32_b", "accelerate-3", "resume32_a"),
    ("resume-2", "resume22_b", "torchrun-2", "resume23_a")])
def test_resuming_in_the_middle_of_an_epoch_on_any_number_of_ranks(
        launches: dict[str, Any], launch: str, cell: str, first: str, first_cell: str) -> None:
    """A run stopped in the middle of an epoch resumes from its checkpoint (on 2 -> 3,
    3 -> 2 and 2 -> 2 ranks): every sample once per epoch over both runs, and the whole
    run equal to one float64 reference (the first run's steps, then the resumed ones)."""
    before, after = _records(launches, first, first_cell), _records(launches, launch, cell)
    worlds = {len(before), len(after)}
    _check_resumed(before, after, tolerance=PARAM_TOLERANCE[max(worlds)])
    if worlds == {2}:
        # The same world: each rank goes on with the rest of its own shard, as if the run
        # had not stopped (ShardSampler's order, 4 steps per epoch).
        _check_shards([{"recorded": b["recorded"] + a["recorded"]}
                       for b, a in zip(before, after, strict=True)], 13, 4, epochs=2)
        assert after[0]["meta"]["max_steps"] == before[0]["meta"]["max_steps"]


def _check_resumed(before: list[dict[str, Any]], after: list[dict[str, Any]],
                   **tolerances: float) -> None:
    """A run stopped (``before``) and resumed from its last checkpoint (``after``, maybe
    on another number of ranks): every sample of the 13 once per epoch over both runs,
    and the whole run equal to one float64 reference (the first run's steps, then the
    resumed ones)."""
    import hf_worker as w

    stop = before[0]["global_step"]
    assert {r["global_step"] for r in before} == {stop}
    assert after[0]["checkpoints"][0] > f"checkpoint-{stop}"  # it saved on after the resume
    assert all(step < stop for r in before for step, _ in r["recorded"])
    data = [row["input_ids"] for row in w.sequences(13, seed=1)]
    for epoch in range(2):  # every sample once per epoch, over both runs
        seen = [row for record in before + after
                for (_, batch), e in zip(record["recorded"], record["epochs"], strict=True)
                if e == epoch for row in batch["input_ids"].tolist()]
        assert sorted(seen) == sorted(data), epoch
    # The first run's linear schedule counts its own max_steps, and so does the resumed
    # one's from its second step on; its first step has the learning rate the checkpoint
    # saved (the optimizer's and scheduler's state), as the Trainer resumes.
    _compare(after, "gpt2", trained=after + before,
             totals={0: before[0]["meta"]["max_steps"],
                     stop + 1: after[0]["meta"]["max_steps"]}, **tolerances)


@pytest.mark.launches
@pytest.mark.parametrize("launch", DDP_LAUNCHES)
def test_map_style_dataset_evaluation_and_checkpoint_after_a_rank_joined(
        launches: dict[str, Any], launch: str) -> None:
    records = _records(launches, launch, "map_gas1")
    world = len(records)
    batches = _batches(13, world)  # the epoch's steps
    _check_shards(records, 13, batches, epochs=2)
    _compare(records, "gpt2")
    history = records[0]["log_history"]
    assert [e["step"] for e in history if "eval_loss" in e][0] == 4  # after rank 1 joined
    assert all(e["eval_rows"] == 7 for e in history if "eval_rows" in e)
    assert records[0]["checkpoints"][0] == "checkpoint-4"
    assert all(r["global_step"] == 2 * batches for r in records)


@pytest.mark.launches
@pytest.mark.parametrize(("launch", "cell", "step"), [("resume-2", "stream_resume3_b", 3),
                                                      ("resume-2", "stream_resume6_b", 6)])
def test_resuming_own_streams_in_the_middle_of_a_pass(launches: dict[str, Any], launch: str,
                                                      cell: str, step: int) -> None:
    """Per-rank streams resumed from step 3 (rank 0 had joined; rank 1 wrote the
    checkpoint) and from step 6 (the last of the first pass: the resumed pass is empty on
    every rank and the next one trains): each rank reads its stream on from where it
    was, and the whole run equals one float64 reference."""
    before = _records(launches, "torchrun-2", "stream_resume_a")
    after = _records(launches, launch, cell)
    assert {r["global_step"] for r in after} == {9}
    first = [{**r, "recorded": [(s, b) for s, b in r["recorded"] if s < step]} for r in before]
    _check_streams([{"recorded": b["recorded"] + a["recorded"]}
                    for b, a in zip(first, after, strict=True)], [4, 11])
    _compare(after, "llama", trained=after + first)


@pytest.mark.launches
def test_own_streams_resumed_on_another_number_of_ranks_are_refused(
        launches: dict[str, Any]) -> None:
    for record in _records(launches, "resume-3", "stream_resume_refused"):
        message = record["messages"]["stream_other_world"]
        assert message.startswith("ValueError") and "saved on 2" in message, message
        assert record["after"] == [[0], [1], [2]]


@pytest.mark.launches
@pytest.mark.parametrize("launch", DDP_LAUNCHES)
def test_evaluation_counts_every_sample_once_with_partial_batches_and_a_rank_without_data(
        launches: dict[str, Any], launch: str) -> None:
    """9 evaluation samples in batches of 4: the last batch (1 sample) is evaluated by
    one rank, the others add an empty batch; the rank without training data joins at
    once, and the ranks with data evaluate in training (eval_steps=1)."""
    records = _records(launches, launch, "map_eval")
    world = len(records)
    assert [len(r["recorded"]) for r in records] == [2] * (world - 1) + [0]
    _check_shards(records, world - 1, 1, epochs=2)
    want = _compare(records, "gpt2")
    history = records[0]["log_history"]
    evaluated = [e["step"] for e in history if "eval_loss" in e]
    assert evaluated == [1, 2, 2]  # after each step (inside the Join), and evaluate()
    assert all(e["eval_rows"] == 9 for e in history if "eval_rows" in e)
    # eval_loss counts each sample once: not each batch once (the mean of 3 batch
    # means), nor the last batch's loss 4 times (what was gathered).
    final = want["evals"][2]
    assert records[0]["final_eval"]["eval_loss"] == pytest.approx(final["eval_loss"],
                                                                  abs=LOG_TOLERANCE)


@pytest.mark.launches
@pytest.mark.parametrize("launch", DDP_LAUNCHES)
@pytest.mark.parametrize(("cell", "samples", "model"), [("map_gas2", 13, "llama"),
                                                         ("map_gas2_plain", 11, "gpt2")])
def test_gradient_accumulation_with_a_half_empty_last_window(
        launches: dict[str, Any], launch: str, cell: str, samples: int, model: str) -> None:
    records = _records(launches, launch, cell)
    world = len(records)
    _check_shards(records, samples, math.ceil(_batches(samples, world) / 2), epochs=2)
    _compare(records, model)


@pytest.mark.launches
@pytest.mark.parametrize("launch", DDP_LAUNCHES)
def test_max_steps_ending_in_the_middle_of_an_epoch(launches: dict[str, Any],
                                                    launch: str) -> None:
    records = _records(launches, launch, "map_max_steps")
    assert all(r["global_step"] == 6 for r in records)
    world = len(records)
    batches = _batches(13, world)
    _check_shards(records, 13, batches, epochs=6 // batches)
    _compare(records, "gpt2")


@pytest.mark.launches
@pytest.mark.parametrize("launch", DDP_LAUNCHES)
def test_own_streams_a_rank_with_none_and_a_checkpoint_by_another_rank(
        launches: dict[str, Any], launch: str) -> None:
    records = _records(launches, launch, "stream_zero")
    rows = [6, 0, 14] if len(records) == 3 else [4, 11]
    _check_streams(records, rows)
    _compare(records, "llama")
    assert records[0]["checkpoints"] == ["checkpoint-5", "checkpoint-9"]
    files = records[-1]["checkpoint_files"]
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        assert f"checkpoint-5/{name}" in files, files  # rank 0 had joined at step 5


@pytest.mark.launches
@pytest.mark.parametrize("launch", DDP_LAUNCHES)
def test_own_streams_with_gradient_accumulation_3(launches: dict[str, Any],
                                                  launch: str) -> None:
    records = _records(launches, launch, "stream_gas3")
    _check_streams(records, [7, 12, 3][: len(records)])
    _compare(records, "llama")


@pytest.mark.launches
@pytest.mark.parametrize("launch", DDP_LAUNCHES)
def test_sft_trainer_packing_own_text_streams(launches: dict[str, Any], launch: str) -> None:
    records = _records(launches, launch, "sft_packing")
    want = _compare(records, "llama", sft=True)
    assert len(want["losses"]) == 6
    counts = [len(r["recorded"]) for r in records]
    assert len(set(counts)) > 1  # the ranks packed different numbers of rows


@pytest.mark.launches
@pytest.mark.parametrize("launch", DDP_LAUNCHES)
def test_bad_input_raises_on_every_rank_before_any_collective(
        launches: dict[str, Any], launch: str) -> None:
    records = _records(launches, launch, "refusals")
    for record in records:
        messages = record["messages"]
        assert messages["already_training"].startswith("RuntimeError")
        # A DeepSpeed config that Accelerate ignored (use_cpu=True): said, not trained as DDP.
        assert messages["deepspeed"].startswith("RuntimeError")
        assert "is_deepspeed_enabled is False" in messages["deepspeed"]
        assert ("'group_by_length'" in messages["group_by_length"]
                or "group_by_length=True" in messages["group_by_length"])  # (5.0, 5.1)
        assert "split_batches" in messages["split_batches"]
        assert messages["not_a_trainer"].startswith("TypeError")
        assert messages["resume_mid_epoch"].startswith("NotImplementedError")
        if record["loop"] == "_run_epoch":
            assert "joinkit_trainer.json" in messages["resume_mid_epoch"]
        else:  # transformers 5.0 to 5.2: the epoch loop in _inner_training_loop
            assert "resumes only at an epoch's start" in messages["resume_mid_epoch"]
            assert messages["tokens_seen"].startswith("NotImplementedError")
            assert "include_num_input_tokens_seen='all'" in messages["tokens_seen"]
        assert record["after"] == [[r] for r in range(len(records))]


@pytest.mark.launches
@pytest.mark.parametrize("launch", FSDP_LAUNCHES)
@pytest.mark.parametrize(("cell", "kind"), [("fsdp2_map", "FSDP2"), ("fsdp1_map", "FSDP1"),
                                            ("fsdp1_even", "FSDP1")])
def test_fsdp_map_style_dataset_clipping_and_evaluation(
        launches: dict[str, Any], launch: str, cell: str, kind: str) -> None:
    """fsdp="full_shard", FSDP2 (float64) and FSDP1 (float32): the model really is
    FSDP-wrapped, a joined rank replays its forward and backward and steps its shards
    (clipping that bites), and evaluation each epoch and after training is exact."""
    records = _records(launches, launch, cell)
    world = len(records)
    assert {r["wrapped"] for r in records} == {kind}
    samples = 12 if cell == "fsdp1_even" else 13
    batches = _batches(samples, world)
    _check_shards(records, samples, batches, epochs=2)
    if kind == "FSDP1":
        _compare(records, "gpt2", tolerance=FSDP1_PARAM_TOLERANCE,
                 norm_relative=FSDP1_NORM_RELATIVE)
    else:
        _compare(records, "gpt2")
    history = records[0]["log_history"]
    assert [e["step"] for e in history if "eval_loss" in e] == [batches, 2 * batches,
                                                                2 * batches]
    assert all(e["eval_rows"] == 7 for e in history if "eval_rows" in e)
    assert all(r["global_step"] == 2 * batches for r in records)
    counts = {len(r["recorded"]) for r in records}
    assert len(counts) == (1 if cell == "fsdp1_even" else 2)  # uneven, but for the control


@pytest.mark.launches
@pytest.mark.parametrize("launch", FSDP_LAUNCHES)
def test_fsdp2_gradient_accumulation_with_a_half_empty_last_window(
        launches: dict[str, Any], launch: str) -> None:
    records = _records(launches, launch, "fsdp2_gas2")
    assert {r["wrapped"] for r in records} == {"FSDP2"}
    world = len(records)
    _check_shards(records, 13, math.ceil(_batches(13, world) / 2), epochs=2)
    _compare(records, "llama")


@pytest.mark.launches
@pytest.mark.parametrize("launch", FSDP_LAUNCHES)
@pytest.mark.parametrize(("cell", "kind", "rows"), [
    ("fsdp2_stream_zero", "FSDP2", [5, 0, 12]),
    ("fsdp1_gas2_stream_zero", "FSDP1", [0, 13, 7])])
def test_fsdp_own_streams_a_rank_with_none(launches: dict[str, Any], launch: str, cell: str,
                                          kind: str, rows: list[int]) -> None:
    """Each rank's own stream, one rank with none (it replays every step); FSDP1 with
    gradient accumulation 2 (FSDP1's no_sync windows inside the Join)."""
    records = _records(launches, launch, cell)
    rows = rows[: len(records)]
    assert {r["wrapped"] for r in records} == {kind}
    _check_streams(records, rows)
    assert [bool(r["recorded"]) for r in records] == [n > 0 for n in rows]
    if kind == "FSDP1":
        _compare(records, "llama", tolerance=FSDP1_PARAM_TOLERANCE,
                 norm_relative=FSDP1_NORM_RELATIVE)
    else:
        _compare(records, "llama")


@pytest.mark.launches
@pytest.mark.parametrize("launch", FSDP_LAUNCHES)
@pytest.mark.parametrize(("cell", "kind"), [("fsdp2_bf16", "FSDP2"), ("fsdp1_bf16", "FSDP1")])
def test_fsdp_mixed_precision_within_the_bound_of_a_run_where_nobody_joins(
        launches: dict[str, Any], launch: str, cell: str, kind: str) -> None:
    """bf16=True: the plugin's bfloat16 policy really applied, parameters within the
    measured bound of the float64 reference, and no further from it than a control
    where nobody joins (12 samples: even) is from its own."""
    import hf_reference as ref

    errors = []
    for name in (cell, f"{cell}_even"):
        records = _records(launches, launch, name)
        assert {(r["wrapped"], r["param_dtype"]) for r in records} == {
            (kind, "torch.bfloat16")}
        want = ref.train(records, "gpt2")
        errors.append(max(ref.max_param_error(r["params"], want["params"])
                          for r in records))
    print(f"{launch} {cell}: {errors[0]:.2e} (control {errors[1]:.2e})")  # measured
    assert 1e-6 < errors[0] < BF16_PARAM_TOLERANCE  # bfloat16 rounding, really
    assert errors[0] < BF16_CONTROL_FACTOR * errors[1]


@pytest.mark.launches
@pytest.mark.parametrize("launch", FSDP_LAUNCHES)
def test_fsdp_settings_it_cannot_shadow_raise_on_every_rank_before_any_collective(
        launches: dict[str, Any], launch: str) -> None:
    records = _records(launches, launch, "fsdp_refusals")
    for record in records:
        messages = record["messages"]
        assert "IterableDataset evaluation set" in messages["stream_eval"]
        # FSDP settings Accelerate ignored (use_cpu=True): said, not trained as DDP.
        assert messages["ignored"].startswith("RuntimeError")
        assert "is_fsdp_enabled is False" in messages["ignored"]
        assert record["after"] == [[r] for r in range(len(records))]


def _resumed_as_uninterrupted(records: list[dict[str, Any]],
                              uninterrupted: list[dict[str, Any]],
                              step: int) -> list[dict[str, Any]]:
    """A run resumed from the checkpoint of ``step`` trained the uninterrupted run's
    batches from there and ended with its exact parameters and logs (every step's,
    and the evaluations after the checkpoint: one at that step came before it, not in
    the resumed log). Returns the uninterrupted run's part before ``step``."""
    import hf_reference as ref

    for resumed, full in zip(records, uninterrupted, strict=True):
        assert [(s, b["input_ids"].tolist()) for s, b in resumed["recorded"]] == [
            (s, b["input_ids"].tolist()) for s, b in full["recorded"] if s >= step]
        assert ref.max_param_error(resumed["params"], full["params"]) == 0.0
        logged, logged_full = ([_clean([e])[0] for e in run["log_history"]
                                if "loss" in e or ("eval_loss" in e and e["step"] > step)]
                               for run in (resumed, full))
        assert logged == logged_full
    return [{**r, "recorded": [(s, b) for s, b in r["recorded"] if s < step]}
            for r in uninterrupted]


def _fsdp_tolerances(kind: str) -> dict[str, float]:
    """FSDP1 trains float32 here (FSDP1_PARAM_TOLERANCE); FSDP2 float64."""
    if kind == "FSDP1":
        return {"tolerance": FSDP1_PARAM_TOLERANCE, "norm_relative": FSDP1_NORM_RELATIVE}
    return {}


def _check_fsdp_checkpoint(records: list[dict[str, Any]], name: str, sharded: bool) -> None:
    """Every rank's RNG state, the Trainer's files and joinkit's record; the model and
    optimizer as ``torch.distributed.checkpoint`` shards of every rank (``sharded``), or
    gathered whole on rank 0 (the model files too: full shapes)."""
    files = records[0]["checkpoint_files"]
    for rank in range(len(records)):
        assert f"{name}/rng_state_{rank}.pth" in files
        if sharded:
            for part in ("pytorch_model_fsdp_0", "optimizer_0"):
                assert f"{name}/{part}/__{rank}_0.distcp" in files, (name, part, rank)
    wanted = ["trainer_state.json", "joinkit_trainer.json", "scheduler.pt"]
    wanted += (["pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"] if sharded else
               ["pytorch_model_fsdp.bin", "optimizer.bin", "model.safetensors", "config.json"])
    for file in wanted:
        assert f"{name}/{file}" in files, (name, file)
    if not sharded:  # (a tied head is saved, not a parameter of its own)
        shapes = records[0]["model_shapes"][name]
        params = {n: tuple(p.shape) for n, p in records[0]["params"].items()}
        assert set(params) <= set(shapes)
        assert all(params.get(n, shape) == shape and all(shape) for n, shape in shapes.items())


@pytest.mark.launches
@pytest.mark.parametrize("launch", FSDP_LAUNCHES)
@pytest.mark.parametrize(("cell", "kind"), [("fsdp2_save", "FSDP2"), ("fsdp1_save", "FSDP1")])
def test_fsdp_checkpoints_and_evaluations_in_the_middle_of_an_epoch(
        launches: dict[str, Any], launch: str, cell: str, kind: str) -> None:
    """save_strategy="steps" and eval_strategy="steps" (every step) under FSDP: at the
    steps after a rank joined, it takes part in the evaluation's forwards and in the
    checkpoint's gathers (FSDP2: full state dicts; FSDP1: sharded ones); parameters,
    logged losses and every evaluation equal the float64 reference."""
    import hf_worker as w

    records = _records(launches, launch, cell)
    world = len(records)
    assert {(r["wrapped"], r["state_dict_type"]) for r in records} == {
        (kind, "StateDictType.FULL_STATE_DICT" if kind == "FSDP2"
         else "StateDictType.SHARDED_STATE_DICT")}
    batches = _batches(13, world)
    _check_shards(records, 13, batches, epochs=2)
    _compare(records, "gpt2", **_fsdp_tolerances(kind))
    history = records[0]["log_history"]
    # After every step (in the Join: the last rank had joined at each epoch's last
    # step), and evaluate() after training.
    assert [e["step"] for e in history if "eval_loss" in e] == [*range(1, 2 * batches + 1),
                                                                2 * batches]
    assert all(e["eval_rows"] == 7 for e in history if "eval_rows" in e)
    assert len(records[-1]["recorded"]) < 2 * batches  # the last rank joined
    every = w.FSDP_SAVE_STEPS[world]
    steps = list(range(every, 2 * batches + 1, every))
    assert records[0]["checkpoints"] == [f"checkpoint-{n}" for n in steps]
    assert batches in steps  # a checkpoint while the last rank had joined
    for name in records[0]["checkpoints"]:
        _check_fsdp_checkpoint(records, name, sharded=kind == "FSDP1")


@pytest.mark.launches
@pytest.mark.parametrize("launch", FSDP_LAUNCHES)
def test_fsdp_save_strategy_best_saves_where_the_evaluation_improved(
        launches: dict[str, Any], launch: str) -> None:
    """save_strategy="best": the save is decided after each step's evaluation, the
    joined rank told then; a checkpoint at each evaluation whose eval_loss is the best
    so far (a rank had joined at each epoch's last step)."""
    records = _records(launches, launch, "fsdp2_best")
    assert {r["wrapped"] for r in records} == {"FSDP2"}
    _compare(records, "gpt2")
    history = records[0]["log_history"]
    losses = [(e["step"], e["eval_loss"]) for e in history if "eval_loss" in e][:-1]
    assert len(losses) == 2 * _batches(13, len(records))  # after every step
    best = [s for i, (s, loss) in enumerate(losses)
            if all(loss < before for _, before in losses[:i])]
    assert records[0]["checkpoints"] == [f"checkpoint-{s}" for s in best]
    assert _batches(13, len(records)) in best  # the last rank had joined
    for name in records[0]["checkpoints"]:
        _check_fsdp_checkpoint(records, name, sharded=False)


@pytest.mark.launches
@pytest.mark.parametrize("launch", FSDP_LAUNCHES)
@pytest.mark.parametrize(("cell", "whole", "kind"), [("fsdp2_resume", "fsdp2_save", "FSDP2"),
                                                     ("fsdp1_resume", "fsdp1_save", "FSDP1")])
def test_fsdp_resumes_a_checkpoint_to_the_uninterrupted_runs_numbers(
        launches: dict[str, Any], launch: str, cell: str, whole: str, kind: str) -> None:
    """train(resume_from_checkpoint=...) from a checkpoint saved while a rank had joined
    (FSDP2; FSDP1 on 3 ranks) or in the middle of epoch 0 (FSDP1 on 2 ranks): the
    resumed run trains the uninterrupted run's batches and ends with its exact numbers
    (parameters, logged losses, evaluations), equal to the float64 reference."""
    import hf_worker as w

    records = _records(launches, launch, cell)
    uninterrupted = _records(launches, launch, whole)
    step = w.FSDP_RESUMED_AT[kind.lower()][len(records)]
    assert {r["wrapped"] for r in records} == {kind}
    first_part = _resumed_as_uninterrupted(records, uninterrupted, step)
    assert records[0]["checkpoints"][-1] == uninterrupted[0]["checkpoints"][-1]
    _compare(records, "gpt2", trained=records + first_part, **_fsdp_tolerances(kind))


@pytest.mark.launches
@pytest.mark.parametrize(("launch", "first"), [("fsdp-resume-3", "fsdp-2"),
                                              ("fsdp-resume-2", "fsdp-3")])
@pytest.mark.parametrize(("name", "kind"), [("fsdp1", "FSDP1"), ("fsdp2", "FSDP2"),
                                            ("fsdp2_sharded", "FSDP2")])
def test_fsdp_resumes_on_another_number_of_ranks(launches: dict[str, Any], launch: str,
                                                 first: str, name: str, kind: str) -> None:
    """An FSDP checkpoint (FSDP1: sharded, torch.distributed.checkpoint; FSDP2: full state
    dicts, and sharded ones) saved on 2 ranks in the middle of epoch 0 resumes on 3,
    where ranks 1 and 2 have none of the epoch's last sample; one saved on 3 at epoch 0's
    last step, which ranks 1 and 2 (out of data) take part in, resumes on 2: every sample
    once per epoch over both runs, the whole run equal to the float64 reference (SGD with
    momentum)."""
    before = _records(launches, first, f"{name}_world_a")
    after = _records(launches, launch, f"{name}_world_b")
    assert {r["wrapped"] for r in before + after} == {kind}
    sharded = "sharded" in name or kind == "FSDP1"
    assert {r["state_dict_type"] for r in before + after} == {
        f"StateDictType.{'SHARDED' if sharded else 'FULL'}_STATE_DICT"}
    _check_resumed(before, after, **(_fsdp_tolerances(kind) or
                                     {"tolerance": PARAM_TOLERANCE[3]}))
    if len(before) == 3:  # ranks 1 and 2 were out of data at the checkpoint's step
        assert [max(s for s, _ in r["recorded"]) for r in before] == [2, 1, 1]
    else:  # the resumed epoch 0: rank 0's one sample
        assert [[s for s, _ in r["recorded"] if s == 3] for r in after] == [[3], [], []]


@pytest.mark.launches
@pytest.mark.parametrize("launch", FSDP_LAUNCHES)
@pytest.mark.parametrize(("version", "kind"), [(1, "FSDP1"), (2, "FSDP2")])
def test_fsdp_load_best_model_at_end_loads_the_best_checkpoint_on_every_rank(
        launches: dict[str, Any], launch: str, version: int, kind: str) -> None:
    """load_best_model_at_end=True, an evaluation and a checkpoint after every step (the
    last rank had joined at each epoch's last step): the best checkpoint is the step whose
    exact (float64 reference) eval_loss is the lowest, not the last one, and every rank
    ends with its parameters (the reference's after that step) and evaluates as there."""
    import hf_reference as ref
    import hf_worker as w

    records = _records(launches, launch, f"fsdp{version}_load_best")
    world = len(records)
    assert {r["wrapped"] for r in records} == {kind}
    steps = 2 * _batches(13, world)
    assert len(records[-1]["recorded"]) < steps  # the last rank joined
    history = records[0]["log_history"]
    for record in records[1:]:
        assert _clean(record["log_history"]) == _clean(history)
    evaluation = w.sequences(7, seed=2)
    want = ref.train(records, "gpt2", evals=dict.fromkeys(range(1, steps + 1), evaluation))
    exact = {step: metrics["eval_loss"] for step, metrics in want["evals"].items()}
    logged = [(e["step"], e["eval_loss"]) for e in history if "eval_loss" in e]
    assert [s for s, _ in logged[:-1]] == list(range(1, steps + 1))
    assert [loss for _, loss in logged[:-1]] == pytest.approx(
        [exact[s] for s in range(1, steps + 1)], abs=LOG_TOLERANCE)
    best = min(exact, key=exact.__getitem__)
    assert best < steps  # the loss rose again: the last checkpoint is not the best
    assert {Path(r["best"]).name for r in records} == {f"checkpoint-{best}"}
    assert records[0]["checkpoints"] == [f"checkpoint-{s}" for s in range(1, steps + 1)]
    at_best = ref.train([{**r, "recorded": [(s, b) for s, b in r["recorded"] if s < best]}
                         for r in records], "gpt2")
    tolerance = _fsdp_tolerances(kind).get("tolerance", PARAM_TOLERANCE[world])
    for record in records:  # loaded on every rank
        assert ref.max_param_error(record["params"], at_best["params"]) < tolerance
        assert record["final_eval"]["eval_loss"] == pytest.approx(exact[best],
                                                                  abs=LOG_TOLERANCE)


@pytest.mark.launches
@pytest.mark.timeout(2 * 120 + 30)
def test_fsdp1_full_state_dict_with_cpu_offload_crashes_in_torch_on_a_cpu_model() -> None:
    """torch alone (programs/fsdp1_full_state_dict.py): FSDP1's full state dict of a CPU
    model with offload_to_cpu=True, which Accelerate's get_state_dict always asks for
    (the Trainer's save_model under FSDP1), ends its ranks with a segmentation fault;
    without the offload it returns every parameter (docs/transformers.md, Limits). Once
    this fails, torch fixed it: run the FSDP1 cells with full state dicts."""
    program = WORKER.parent / "fsdp1_full_state_dict.py"
    torchrun = [*_tool("torchrun", "torch.distributed.run"), "--standalone",
                "--nproc-per-node", "2", str(program)]
    for offload in ("1", "0"):
        [run] = launch_ranks([[*torchrun, offload]], 120.0, env=_environment(), cwd=ROOT)
        if offload == "1":
            assert run.returncode != 0
            assert "SIGSEGV" in run.stdout, run.stdout[-3000:]
        else:
            assert run.returncode == 0, run.stdout[-3000:]
            for rank in range(2):
                assert (f"rank {rank} state dict: ['0.bias', '0.weight', '1.bias', "
                        "'1.weight']") in run.stdout


def _same_state(saved: dict[int, dict[str, Any]], loaded: dict[int, dict[str, Any]]) -> bool:
    """Two of ``hf_worker.optimizer_state``'s: the same keys and exactly the same values."""
    if {i: set(state) for i, state in saved.items()} != {
            i: set(state) for i, state in loaded.items()}:
        return False
    return all(torch.equal(torch.as_tensor(value), torch.as_tensor(loaded[i][key]))
               for i, state in saved.items() for key, value in state.items())


@pytest.mark.launches
@pytest.mark.parametrize("launch", FSDP_LAUNCHES)
def test_fsdp1_sharded_checkpoint_resumes_the_optimizer_state_the_trainer_alone_loses(
        launches: dict[str, Any], launch: str) -> None:
    """The Trainer alone (no joinkit, nobody joins) resuming an FSDP1 sharded checkpoint
    loads none of the optimizer's state (SGD's momentum, AdamW's moments: Accelerate's
    load_fsdp_optimizer reads into the template of the new, stateless optimizer), where
    FSDP2's loads it whole; under uneven_inputs FSDP1's is loaded whole too
    (docs/transformers.md, FSDP). Each rank's own shards, saved and loaded."""
    for cell, kind in (("plain_fsdp1_sgd", "FSDP1"), ("plain_fsdp1_adamw", "FSDP1"),
                       ("plain_fsdp2_sgd", "FSDP2"), ("joinkit_fsdp1_sgd", "FSDP1")):
        for record in _records(launches, launch, cell):
            assert record["wrapped"] == kind
            assert record["saved"] and all(record["saved"].values())
            if cell.startswith("plain_fsdp1"):
                # Accelerate's bug; once this fails, it is fixed: update the docs.
                assert record["loaded"] == {}, cell
            else:
                assert _same_state(record["saved"], record["loaded"]), cell


@pytest.mark.launches
@pytest.mark.parametrize("launch", FSDP_LAUNCHES)
@pytest.mark.parametrize(("cell", "kind", "rows"), [("fsdp2_zero_save", "FSDP2", None),
                                                    ("fsdp1_zero_save", "FSDP1", None),
                                                    ("fsdp2_stream_save", "FSDP2", [0, 9, 5])])
def test_fsdp_a_rank_without_data_takes_part_in_every_checkpoint_and_evaluation(
        launches: dict[str, Any], launch: str, cell: str, kind: str,
        rows: list[int] | None) -> None:
    """A rank with no training data, joined from the start: an evaluation and a checkpoint
    at every step (sharded state dicts), or every 2 steps with rank 0 the one without
    data (full state dicts: rank 0 writes the gathered model, rank 1 the Trainer's
    files); equal to the float64 reference."""
    records = _records(launches, launch, cell)
    world = len(records)
    assert {r["wrapped"] for r in records} == {kind}
    history = records[0]["log_history"]
    evaluated = [e["step"] for e in history if "eval_loss" in e]
    if rows is None:
        assert [len(r["recorded"]) for r in records] == [2] * (world - 1) + [0]
        _check_shards(records, world - 1, 1, epochs=2)
        assert evaluated == [1, 2, 2]  # after each step, and evaluate()
        saved = [1, 2]
    else:
        rows = rows[:world]
        _check_streams(records, rows)
        assert [bool(r["recorded"]) for r in records] == [n > 0 for n in rows]
        assert evaluated == [2, 4, 5, 5]  # every 2 steps, at max_steps, and evaluate()
        saved = [2, 4, 5]
    assert all(e["eval_rows"] == 7 for e in history if "eval_rows" in e)
    _compare(records, "llama", **_fsdp_tolerances(kind))
    assert records[0]["checkpoints"] == [f"checkpoint-{n}" for n in saved]
    for name in records[0]["checkpoints"]:
        _check_fsdp_checkpoint(records, name, sharded=rows is None)


@pytest.mark.launches
@pytest.mark.parametrize(("cell", "samples", "model", "stage"), [
    ("ds_map_s2", 13, "gpt2", 2), ("ds_map_s3", 13, "llama", 3), ("ds_map_s1", 13, "gpt2", 1)])
def test_deepspeed_zero_map_style_dataset_and_evaluation(
        launches: dict[str, Any], cell: str, samples: int, model: str, stage: int) -> None:
    """The Trainer with a DeepSpeed config: the engine joins, a joined rank replays its step."""
    records = _records(launches, "deepspeed-2", cell)
    assert {(r["engine"], r["stage"]) for r in records} == {("DeepSpeedEngine", stage)}
    batches = _batches(samples, 2)
    _check_shards(records, samples, batches, epochs=2)
    # Every rank its own share of each epoch: 13 samples are 4 and 3 batches of 2.
    assert [len(r["recorded"]) for r in records] == [
        2 * math.ceil(len(range(rank, samples, 2)) / 2) for rank in range(2)]
    _compare(records, model, tolerance=DS_PARAM_TOLERANCE, norm_relative=DS_NORM_RELATIVE)
    history = records[0]["log_history"]
    assert all(e["eval_rows"] == 7 for e in history if "eval_rows" in e)
    assert records[0]["final_eval"]["eval_rows"] == 7
    assert all(r["global_step"] == 2 * batches for r in records)
    evaluated = [e["step"] for e in history if "eval_loss" in e]
    assert evaluated == [4, 8, 8]  # each epoch's end (ZeRO-1: eval_steps=4), and evaluate()
    # Checkpoints in the middle of an epoch and at steps rank 0 took alone (rank 1 had
    # joined and saved its partition with it); ZeRO-1: save_strategy="best".
    saved = records[0]["checkpoints"]
    if stage > 1:
        assert saved == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    else:  # at each evaluation in training whose eval_loss is the best so far
        losses = [(e["step"], e["eval_loss"]) for e in history if "eval_loss" in e][:2]
        assert saved == [f"checkpoint-{s}" for i, (s, loss) in enumerate(losses)
                         if all(loss < before for _, before in losses[:i])]
    for name in saved:
        _check_deepspeed_checkpoint(records, name, gathered=stage == 3)


def _check_deepspeed_checkpoint(records: list[dict[str, Any]], name: str,
                                gathered: bool) -> None:
    """Every rank's optimizer partition and RNG state, the Trainer's files and joinkit's
    record; a ZeRO-3 model gathered to save it (``gathered``) whole."""
    files = records[0]["checkpoint_files"]
    step = name.split("-")[1]
    for rank in range(len(records)):
        assert f"{name}/global_step{step}/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in files
        assert f"{name}/rng_state_{rank}.pth" in files
    for file in ("trainer_state.json", "joinkit_trainer.json", "latest", "scheduler.pt",
                 "config.json"):
        assert f"{name}/{file}" in files, (name, file)
    if gathered:
        shapes = records[0]["model_shapes"][name]
        params = {n: tuple(p.shape) for n, p in records[0]["params"].items()}
        assert shapes and all(params[n] == shape and all(shape) for n, shape in shapes.items())


@pytest.mark.launches
@pytest.mark.parametrize(("cell", "whole", "model", "stage", "step"), [
    ("ds_resume_s2", "ds_map_s2", "gpt2", 2, 4), ("ds_resume_s3", "ds_map_s3", "llama", 3, 2)])
def test_deepspeed_resumes_a_checkpoint_to_the_uninterrupted_runs_numbers(
        launches: dict[str, Any], cell: str, whole: str, model: str, stage: int,
        step: int) -> None:
    """ZeRO-2 from the checkpoint of step 4 (rank 1 had joined: its partition was saved by
    its shadow of the step), ZeRO-3 from step 2 (in the middle of epoch 0): the resumed
    run trains the uninterrupted run's batches and ends with its exact numbers."""

    records = _records(launches, "deepspeed-2", cell)
    uninterrupted = _records(launches, "deepspeed-2", whole)
    assert {(r["engine"], r["stage"]) for r in records} == {("DeepSpeedEngine", stage)}
    first_part = _resumed_as_uninterrupted(records, uninterrupted, step)
    _compare(records, model, tolerance=DS_PARAM_TOLERANCE, norm_relative=DS_NORM_RELATIVE,
             trained=records + first_part)


@pytest.mark.launches
@pytest.mark.parametrize(("cell", "rows", "stage", "steps"), [("ds_stream_s2", [5, 0], 2, 5),
                                                               ("ds_stream_s3", [0, 9], 3, 6)])
def test_deepspeed_own_streams_a_rank_with_none(launches: dict[str, Any], cell: str,
                                               rows: list[int], stage: int, steps: int) -> None:
    records = _records(launches, "deepspeed-2", cell)
    assert {(r["stage"], r["global_step"]) for r in records} == {(stage, steps)}
    _check_streams(records, rows)
    # The rank without data replayed every step and trained on nothing.
    assert [bool(r["recorded"]) for r in records] == [n > 0 for n in rows]
    _compare(records, "llama", tolerance=DS_PARAM_TOLERANCE, norm_relative=DS_NORM_RELATIVE)
    # A checkpoint every 2 steps, the rank without data taking part (ZeRO-3: it is rank
    # 0, which writes the gathered model; rank 1 the Trainer's files).
    # (and one at max_steps, the Trainer's last)
    assert records[0]["checkpoints"] == [f"checkpoint-{n}"
                                         for n in sorted({*range(2, steps + 1, 2), steps})]
    for name in records[0]["checkpoints"]:
        _check_deepspeed_checkpoint(records, name, gathered=stage == 3)


@pytest.mark.launches
def test_deepspeed_control_even_streams_show_deepspeeds_own_float32_error(
        launches: dict[str, Any]) -> None:
    """Nobody joins: the distance to the float64 reference is DeepSpeed's float32 master
    weights, of the size the uneven cells are allowed (DS_PARAM_TOLERANCE)."""
    import hf_reference as ref

    records = _records(launches, "deepspeed-2", "ds_even_s2")
    want = _compare(records, "llama", tolerance=DS_PARAM_TOLERANCE,
                    norm_relative=DS_NORM_RELATIVE)
    error = max(ref.max_param_error(r["params"], want["params"]) for r in records)
    assert 1e-8 < error < DS_PARAM_TOLERANCE


#: The DeepSpeed cells with gradient accumulation: (launch, cell, stage, gas, model,
#: each rank's rows of its own stream, or None for the 13-sample map-style set).
DS_GAS_CELLS = [
    ("deepspeed-2", "ds_gas2_s1", 1, 2, "gpt2", None),  # rank 1 ends inside a window
    ("deepspeed-2", "ds_gas3_s2", 2, 3, "llama", [3, 12]),  # rank 0 ends inside one, joins
    ("deepspeed-2", "ds_gas2_s3", 3, 2, "llama", [0, 9]),  # a rank without data
    ("deepspeed-3", "ds3_gas2_s2", 2, 2, "llama", [6, 0, 11]),
    ("deepspeed-3", "ds3_gas3_s1", 1, 3, "gpt2", None),
    ("deepspeed-3", "ds3_gas2_s3", 3, 2, "llama", [3, 9, 5]),
]


def _windows(batches: int, gas: int) -> int:
    return -(-batches // gas)


@pytest.mark.launches
@pytest.mark.parametrize(("launch", "cell", "stage", "gas", "model", "rows"), DS_GAS_CELLS,
                         ids=[c[1] for c in DS_GAS_CELLS])
def test_deepspeed_gradient_accumulation(launches: dict[str, Any], launch: str, cell: str,
                                         stage: int, gas: int, model: str,
                                         rows: list[int] | None) -> None:
    """The Trainer's windows under DeepSpeed: a rank whose data ends inside a window pads
    it with empty micro-batches, a rank that ran out replays the others' whole windows
    (its micro-steps contribute zero; DeepSpeed divides by the world size), the engine
    steps once per window on every rank; parameters, logged losses, gradient norms and
    evaluations equal the float64 reference that averages each window's batches."""
    records = _records(launches, launch, cell)
    world = len(records)
    for record in records:  # DeepSpeed trained, with the Trainer's accumulation
        assert (record["engine"], record["stage"], record["engine_gas"]) == (
            "DeepSpeedEngine", stage, gas)
        assert record["engine_global_steps"] == record["global_step"]
    if rows is None:
        per_epoch = _windows(_batches(13, world), gas)
        _check_shards(records, 13, per_epoch, epochs=2)
        assert all(r["global_step"] == 2 * per_epoch for r in records)
        batches = [len(r["recorded"]) // 2 for r in records]
    else:
        _check_streams(records, rows)
        batches = [len(r["recorded"]) for r in records]
        steps = records[0]["global_step"]
        # Some rank ran out windows before the end: it replayed the others' micro-steps.
        assert min(_windows(b, gas) for b in batches) < steps
    assert any(b % gas for b in batches)  # a rank's data ended inside a window
    _compare(records, model, tolerance=DS_PARAM_TOLERANCE, norm_relative=DS_NORM_RELATIVE)


#: The ZeRO-Offload cells: (launch, cell, stage, where to, optimizer, gradient
#: accumulation, each rank's rows of its own stream or None for the map-style set).
DS_OFFLOAD_CELLS = [
    ("deepspeed-2", "ds_offload_s2", 2, {"optimizer": "cpu", "param": "None"}, "AdamW", 2,
     [5, 0]),
    ("deepspeed-2", "ds_offload_s3", 3, {"optimizer": "cpu", "param": "cpu"}, "AdamW", 1,
     None),
    ("deepspeed-2", "ds_cpu_adam_s2", 2, {"optimizer": "cpu", "param": "None"},
     "DeepSpeedCPUAdam", 3, [9, 4]),
    ("deepspeed-3", "ds3_offload_s3", 3, {"optimizer": "cpu", "param": "cpu"}, "SGD", 1,
     [4, 0, 7]),
]


@pytest.mark.launches
@pytest.mark.parametrize(("launch", "cell", "stage", "offload", "optimizer", "gas", "rows"),
                         DS_OFFLOAD_CELLS, ids=[c[1] for c in DS_OFFLOAD_CELLS])
def test_deepspeed_zero_offload(launches: dict[str, Any], launch: str, cell: str, stage: int,
                                offload: dict[str, str], optimizer: str, gas: int,
                                rows: list[int] | None) -> None:
    """ZeRO-Offload under the Trainer: the optimizer (ZeRO 2, 3) and the parameters
    (ZeRO 3) on the CPU, a torch optimizer and DeepSpeed's own CPU Adam (the config's
    optimizer section); a rank without data, a rank that replays whole windows,
    evaluation each epoch; equal to the float64 reference."""
    records = _records(launches, launch, cell)
    for record in records:
        assert (record["engine"], record["stage"], record["offload"]) == (
            "DeepSpeedEngine", stage, offload)
        assert (record["torch_optimizer"], record["engine_gas"]) == (optimizer, gas)
    if rows is None:
        _check_shards(records, 13, _batches(13, len(records)), epochs=2)
        assert records[0]["final_eval"]["eval_rows"] == 7
    else:
        _check_streams(records, rows)
        # A rank ran out before the end and replayed the others' micro-steps.
        steps = records[0]["global_step"]
        assert min(_windows(len(r["recorded"]), gas) for r in records) < steps
    _compare(records, "llama", tolerance=DS_PARAM_TOLERANCE, norm_relative=DS_NORM_RELATIVE,
             lr_after_step=optimizer == "DeepSpeedCPUAdam")


@pytest.mark.launches
def test_deepspeed_settings_it_cannot_replay_raise_on_every_rank_before_any_collective(
        launches: dict[str, Any]) -> None:
    records = _records(launches, "deepspeed-2", "ds_refusals")
    for record in records:
        messages = record["messages"]
        other_world = messages.pop("resume_other_world")
        assert all(m is not None and m.startswith("NotImplementedError")
                   for m in messages.values()), messages
        assert "offload_param to 'nvme'" in messages["nvme"]
        assert "ZeRO-3" in messages["zero3_eval_steps"]
        assert other_world.startswith("ValueError") and "saved on 3 ranks" in other_world
        assert record["after"] == [[0], [1]]


@pytest.mark.launches
def test_the_example_runs_and_its_ranks_agree(launches: dict[str, Any]) -> None:
    run = launches["runs"]["example"]
    assert run.returncode == 0, run.stdout[-4000:]
    # The loss as the example prints it (4 decimals): the ranks share stdout,
    # and another rank's line may follow it before its newline (CI once read
    # "2.7601{'eval_loss': ...").
    lines = re.findall(r"rank (\d): (\d+) optimizer steps, eval_loss (-?\d+\.\d{4})",
                       run.stdout)
    assert sorted(rank for rank, _, _ in lines) == ["0", "1"]
    assert {(steps, loss) for _, steps, loss in lines} == {("8", lines[0][2])}


def test_the_docs_show_the_example() -> None:
    text = DOC.read_text()
    block = text.split("<!-- not run: the body of examples/hf_trainer.py", 1)[1]
    block = block.split("```python\n", 1)[1].split("```", 1)[0]
    assert block.strip() and block in EXAMPLE.read_text()


def test_batch_shards_cover_the_trainers_batches_once() -> None:
    from joinkit.adapters.transformers._session import _BatchShard

    for samples, size, count in [(7, 2, 2), (7, 2, 3), (1, 4, 3), (0, 2, 2), (9, 3, 1)]:
        shards = [_BatchShard(samples, size, index, count, False) for index in range(count)]
        batches = sorted((b for shard in shards for b in shard), key=lambda b: b[0])
        assert [i for b in batches for i in b] == list(range(samples))
        assert {s.steps for s in shards} == {max(len(s) for s in shards)}


def test_the_checkpoint_writers_arguments_pickle_as_the_original_class(
        tmp_path: Path) -> None:
    from transformers import TrainingArguments

    from joinkit.adapters.transformers._session import _writer_args

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    writer = _writer_args(args)
    assert writer.should_save and writer.output_dir == args.output_dir
    torch.save(writer, tmp_path / "args.bin")
    loaded = torch.load(tmp_path / "args.bin", weights_only=False)
    assert type(loaded) is TrainingArguments and loaded.output_dir == args.output_dir


def test_a_changed_internal_is_a_loud_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from joinkit.adapters.transformers import UnsupportedTransformersError, _private

    monkeypatch.delattr(transformers.Trainer, "get_batch_samples")
    monkeypatch.setattr(_private, "_checked", set())
    message = (rf"(?s)^found transformers {re.escape(transformers.__version__)}; joinkit's "
               r"Hugging Face \(Trainer\) adapter needs .*Trainer\.get_batch_samples is missing")
    with pytest.raises(UnsupportedTransformersError, match=message):
        _private.check("Trainer")


def test_a_trainer_without_the_parallel_sizes_is_refused_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """uneven_inputs asks the Trainer's tensor, context and sequence parallel sizes
    (refusing any above 1); transformers 4.57 has no get_cp_size nor get_sp_size, so
    such a Trainer is refused by the table, naming them, not by an AttributeError."""
    import transformers

    from joinkit.adapters.transformers import UnsupportedTransformersError, _private

    monkeypatch.delattr(transformers.Trainer, "get_cp_size")
    monkeypatch.delattr(transformers.Trainer, "get_sp_size")
    monkeypatch.setattr(_private, "_checked", set())  # (checked once per process)
    with pytest.raises(UnsupportedTransformersError) as raised:
        _private.check("Trainer")
    message = str(raised.value)
    assert "Trainer.get_cp_size is missing" in message
    assert "Trainer.get_sp_size is missing" in message
    assert "tensor, context and sequence parallelism" in message


def test_the_installed_trainers_loop_decides_which_members_are_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The table lists two training loops (``_run_epoch``, 5.3 and later; the epoch loop
    inline in ``_inner_training_loop``, 5.0 to 5.2) and two loss gathers; what the
    installed Trainer has picks one of each. A Trainer with neither loop is refused by
    name: the inline loop's members are checked, and this release's differ."""
    import transformers
    import transformers.trainer

    from joinkit.adapters.transformers import UnsupportedTransformersError, _private

    if not hasattr(transformers.Trainer, "_run_epoch"):  # 5.0 to 5.2: that loop checks
        monkeypatch.setattr(_private, "_checked", set())
        _private.check("Trainer")
        monkeypatch.delattr(transformers.Trainer, "get_batch_samples")
        monkeypatch.setattr(_private, "_checked", set())  # (checked once per process)
        with pytest.raises(UnsupportedTransformersError, match="get_batch_samples is missing"):
            _private.check("Trainer")
        return
    assert _private.loop() == "_run_epoch"
    assert _private.loss_gather() == "nested_gather"
    monkeypatch.delattr(transformers.Trainer, "_run_epoch")
    monkeypatch.setattr(_private, "_checked", set())
    assert _private.loop() == "_inner_training_loop"
    with pytest.raises(UnsupportedTransformersError) as raised:
        _private.check("Trainer")
    message = str(raised.value)
    assert "Trainer.set_initial_training_values has the parameters" in message
    assert "total_train_batch_size" in message
    assert "_inner_training_loop no longer calls get_batch_samples" in message
    monkeypatch.undo()
    monkeypatch.delattr(transformers.trainer, "nested_gather")
    monkeypatch.setattr(_private, "_checked", set())
    assert _private.loss_gather() == "Trainer._nested_gather"
    with pytest.raises(UnsupportedTransformersError, match=r"Trainer\._nested_gather is missing"):
        _private.check("Trainer")


def test_what_the_inline_loop_cannot_give_is_refused_by_name(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Under the loop of transformers 5.0 to 5.2 (simulated here: the table's choice),
    its inline token count and FSDP are refused, naming the setting and the release."""
    import transformers
    from transformers import Trainer, TrainingArguments

    from joinkit.adapters import transformers as adapter
    from joinkit.adapters.transformers import _private

    monkeypatch.setattr(_private, "loop", lambda: "_inner_training_loop")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             include_num_input_tokens_seen="all")
    trainer = Trainer(model=torch.nn.Linear(2, 2), args=args)
    with pytest.raises(NotImplementedError,
                       match=rf"include_num_input_tokens_seen='all' with transformers "
                             rf"{re.escape(transformers.__version__)}'s Trainer"):
        adapter._refuse(trainer, None)
    trainer.args.include_num_input_tokens_seen = "no"
    adapter._refuse_in_the_inline_loop(trainer)  # DDP: nothing refused
    trainer.is_fsdp_enabled = True
    with pytest.raises(NotImplementedError, match="uneven_inputs with FSDP and transformers"):
        adapter._refuse_in_the_inline_loop(trainer)


def test_a_member_older_releases_lack_is_checked_only_where_present(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``should_save_on_this_rank`` came in transformers 5.15: where it is missing the
    check passes and nothing is replaced (``is_main_process`` alone decides there)."""
    from transformers import PreTrainedModel

    from joinkit.adapters.transformers import _private

    class Model(PreTrainedModel):  # never instantiated: the rule is asked of the type
        pass

    assert _private.has_save_rank_rule(object.__new__(Model))
    owner = next(k for k in PreTrainedModel.__mro__ if "should_save_on_this_rank" in vars(k))
    monkeypatch.delattr(owner, "should_save_on_this_rank")
    monkeypatch.setattr(_private, "_checked", set())
    _private.check("Trainer")
    assert not _private.has_save_rank_rule(object.__new__(Model))


def test_the_ranges_are_the_extras_with_no_upper_bound() -> None:
    """Each distribution's range is ``>=`` its oldest tested release (issue 48); the dev
    pins are the newest tested."""
    from joinkit.adapters.transformers import _private

    line = next(ln for ln in (ROOT / "pyproject.toml").read_text().splitlines()
                if ln.startswith("transformers = "))
    pins = (ROOT / "constraints.txt").read_text().splitlines()
    for name, (oldest, newest) in _private.TESTED.items():
        assert _private.SUPPORTED[name] == f">={oldest}"
        assert f'"{name}>={oldest}"' in line
        assert f"{name}=={newest}" in pins


@pytest.mark.slow
@pytest.mark.parametrize(("samples", "batch"), [(7, 2), (9, 4), (1, 3)])
def test_the_references_evaluation_is_the_single_process_trainers(
        tmp_path: Path, samples: int, batch: int) -> None:
    """Checked against its peer: ``hf_reference.evaluate`` gives what ``Trainer.evaluate``
    gives in one process (no joinkit), a partial last batch counting its samples once."""
    import hf_reference as ref
    import hf_worker as w
    from transformers import Trainer

    rows = w.sequences(samples, seed=2)
    trainer = Trainer(model=w.tiny_model("gpt2"),
                      args=w.args(tmp_path, per_device_eval_batch_size=batch),
                      eval_dataset=w.rows_dataset(rows), data_collator=w.collate,
                      compute_metrics=w.metrics)
    got = trainer.evaluate()
    # These models' loss_type is unset: the Trainer counts unshifted labels (meta()).
    want = ref.evaluate(w.tiny_model("gpt2"), rows, rule=w.label_count(trainer),
                        batch_size=batch)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=LOG_TOLERANCE), key


def test_joinkits_checkpoint_record_round_trips_and_plans_the_resume(tmp_path: Path) -> None:
    from joinkit.adapters.transformers import _resume

    sampler = {"remaining": [[8, 13]], "dataset_length": 13}
    _resume.write(str(tmp_path), world=2, global_step=2, epoch=0, steps=2, epoch_done=False,
                  sampler=sampler)
    saved = _resume.read(str(tmp_path))
    assert saved == _resume.Saved(world=2, global_step=2, epoch=0, steps=2, epoch_done=False,
                                  sampler=sampler)
    assert _resume.plan(saved) == _resume.Plan(epoch=0, mid_epoch=True)
    ended = _resume.Saved(world=2, global_step=4, epoch=0, steps=4, epoch_done=True,
                          sampler=None)
    assert _resume.plan(ended) == _resume.Plan(epoch=1, mid_epoch=False)
    emptied = _resume.Saved(world=2, global_step=4, epoch=0, steps=4, epoch_done=False,
                            sampler={"remaining": [], "dataset_length": 13})
    assert _resume.plan(emptied) == _resume.Plan(epoch=1, mid_epoch=False)
    assert _resume.read(str(tmp_path / "none")) is None
    (tmp_path / _resume.FILE).write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a joinkit Trainer state"):
        _resume.read(str(tmp_path))
    (tmp_path / _resume.FILE).write_text('{"format": "joinkit.transformers.Trainer", '
                                         '"version": 1}')
    with pytest.raises(ValueError, match="not a whole joinkit Trainer state"):
        _resume.read(str(tmp_path))


def test_a_resume_on_another_world_counts_the_steps_that_world_takes() -> None:
    from joinkit.adapters.transformers import _resume

    # 13 samples, batches of 2: 4 steps an epoch on 2 ranks, 3 on 3; 2 epochs.
    values = (2, 3, 13, 26, 6, 3, 6)  # the Trainer's, for 3 ranks
    saved = _resume.Saved(world=2, global_step=2, epoch=0, steps=2, epoch_done=False,
                          sampler={"remaining": [[8, 13]], "dataset_length": 13})
    start = _resume.plan(saved)
    same = _resume.training_values(values, saved=saved, start=start, world=2,
                                   resumed_updates=1, max_steps=-1, num_train_epochs=2)
    assert same is values
    # 2 steps done, 1 for the 5 samples left, 3 for epoch 1: 6.
    other = _resume.training_values(values, saved=saved, start=start, world=3,
                                    resumed_updates=1, max_steps=-1, num_train_epochs=2)
    assert other == (2, 3, 13, 26, 6, 3, 6)
    longer = _resume.training_values(values, saved=saved, start=start, world=3,
                                     resumed_updates=1, max_steps=-1, num_train_epochs=3)
    assert longer[-1] == 9
    # max_steps given: kept, with enough epochs to reach it.
    stepped = _resume.training_values(values, saved=saved, start=start, world=3,
                                      resumed_updates=1, max_steps=10, num_train_epochs=3)
    assert stepped[0] == 4 and stepped[-1] == 10  # epoch 0, then 3 + 3 + 1 steps
    with pytest.raises(ValueError, match="num_train_epochs=2.5"):
        _resume.training_values(values, saved=saved, start=start, world=3,
                                resumed_updates=1, max_steps=-1, num_train_epochs=2.5)
    # Streams: the pass and its steps, on the same world only.
    assert _resume.stream_start(saved, world=2, gas=3) == (0, 6)
    assert _resume.stream_start(_resume.Saved(world=2, global_step=4, epoch=1, steps=0,
                                              epoch_done=True, sampler=None),
                                world=2, gas=1) == (2, 0)
    with pytest.raises(ValueError, match="saved on 2"):
        _resume.stream_start(saved, world=3, gas=1)
