"""The Hugging Face Trainer and TRL's SFTTrainer under ``uneven_inputs``, against one process.

One module fixture starts three launches at once: ``programs/hf_worker.py`` under
``torchrun`` with 2 ranks and under ``accelerate launch --multi_gpu`` with 3 CPU ranks
(every cell in one process per rank: transformers is imported once per rank), and
``examples/hf_trainer.py`` under ``torchrun`` with 2 ranks. Each cell's ranks are
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

pytestmark = pytest.mark.needs_torch

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).parent / "programs" / "hf_worker.py"
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
DOC = ROOT / "docs" / "transformers.md"
BIN = Path(sys.executable).parent
LAUNCH_TIMEOUT = 480.0
CELLS = ["map_gas1", "map_gas2", "map_gas2_plain", "map_max_steps", "stream_zero",
         "stream_gas3", "sft_packing", "refusals", "fsdp2_map", "fsdp2_gas2",
         "fsdp2_stream_zero", "fsdp1_map", "fsdp1_gas2_stream_zero", "fsdp1_even",
         "fsdp_refusals"]
LAUNCHES = {"torchrun-2": 2, "accelerate-3": 3, "deepspeed-2": 2}
#: The DeepSpeed cells, launched apart (only that launch imports DeepSpeed).
DS_CELLS = ["ds_map_s2", "ds_map_s3", "ds_map_s1", "ds_stream_s2", "ds_stream_s3",
            "ds_even_s2", "ds_refusals"]
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

pytestmark = [pytest.mark.needs_torch, pytest.mark.timeout(2 * LAUNCH_TIMEOUT)]


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


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("transformers")
    torchrun = [*_tool("torchrun", "torch.distributed.run"), "--standalone"]
    # Accelerate launches CPU processes with torch's launcher under --multi_gpu (its
    # --cpu flag alone starts one process); the worker's use_cpu=True does the rest.
    accelerate = [*_tool("accelerate", "accelerate.commands.accelerate_cli"), "launch",
                  "--multi_gpu", "--main_process_port", "0"]
    commands = {
        "torchrun-2": [*torchrun, "--nproc-per-node", "2", str(WORKER), str(out / "t2"),
                       *CELLS],
        "accelerate-3": [*accelerate, "--num_processes", "3", str(WORKER),
                         str(out / "a3"), *CELLS],
        "example": [*torchrun, "--nproc-per-node", "2", str(EXAMPLE)],
        "deepspeed-2": [*torchrun, "--nproc-per-node", "2", str(WORKER), str(out / "d2"),
                        *DS_CELLS],
    }
    runs = launch_ranks(list(commands.values()), LAUNCH_TIMEOUT, env=_environment(), cwd=ROOT)
    return {"out": out, "runs": dict(zip(commands, runs, strict=True)),
            "dirs": {"torchrun-2": out / "t2", "accelerate-3": out / "a3",
                     "deepspeed-2": out / "d2"}}


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
        run = launches["runs"][launch]
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
             tolerance: float | None = None, norm_relative: float = 1e-6) -> dict[str, Any]:
    import hf_reference as ref
    import hf_worker as w

    world = len(records)
    history = records[0]["log_history"]
    for record in records[1:]:  # every rank ends with the same log
        assert _clean(record["log_history"]) == _clean(history)
    evaluation = w.sequences(7, seed=2)
    evals = {entry["step"]: evaluation for entry in history if "eval_loss" in entry}
    want = ref.train(records, model, evals=evals, sft=sft)
    if tolerance is None:
        tolerance = SFT_PARAM_TOLERANCE if sft else PARAM_TOLERANCE[world]
    for record in records:
        assert ref.max_param_error(record["params"], want["params"]) < tolerance
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert losses == pytest.approx(want["losses"], abs=LOG_TOLERANCE)
    lrs = [entry["learning_rate"] for entry in history if "learning_rate" in entry]
    assert lrs == pytest.approx(want["lrs"], abs=1e-12)
    norms = [entry["grad_norm"] for entry in history if "grad_norm" in entry]
    assert norms == pytest.approx(want["norms"], rel=norm_relative)
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
        assert "'group_by_length'" in messages["group_by_length"]
        assert "split_batches" in messages["split_batches"]
        assert messages["not_a_trainer"].startswith("TypeError")
        assert record["after"] == [[r] for r in range(len(records))]


@pytest.mark.launches
@pytest.mark.parametrize("launch", DDP_LAUNCHES)
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
@pytest.mark.parametrize("launch", DDP_LAUNCHES)
def test_fsdp2_gradient_accumulation_with_a_half_empty_last_window(
        launches: dict[str, Any], launch: str) -> None:
    records = _records(launches, launch, "fsdp2_gas2")
    assert {r["wrapped"] for r in records} == {"FSDP2"}
    world = len(records)
    _check_shards(records, 13, math.ceil(_batches(13, world) / 2), epochs=2)
    _compare(records, "llama")


@pytest.mark.launches
@pytest.mark.parametrize("launch", DDP_LAUNCHES)
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
@pytest.mark.parametrize("launch", DDP_LAUNCHES)
def test_fsdp_settings_it_cannot_shadow_raise_on_every_rank_before_any_collective(
        launches: dict[str, Any], launch: str) -> None:
    records = _records(launches, launch, "fsdp_refusals")
    for record in records:
        messages = record["messages"]
        assert messages["save_steps"].startswith("NotImplementedError")
        assert "save_strategy='epoch'" in messages["save_steps"]
        assert "eval_strategy='epoch'" in messages["eval_steps"]
        assert "IterableDataset evaluation set" in messages["stream_eval"]
        # FSDP settings Accelerate ignored (use_cpu=True): said, not trained as DDP.
        assert messages["ignored"].startswith("RuntimeError")
        assert "is_fsdp_enabled is False" in messages["ignored"]
        assert record["after"] == [[r] for r in range(len(records))]


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


@pytest.mark.launches
def test_deepspeed_settings_it_cannot_replay_raise_on_every_rank_before_any_collective(
        launches: dict[str, Any]) -> None:
    records = _records(launches, "deepspeed-2", "ds_refusals")
    for record in records:
        messages = record["messages"]
        assert all(m is not None and m.startswith("NotImplementedError")
                   for m in messages.values()), messages
        assert "gradient_accumulation_steps=1" in messages["gas2"]
        assert "offload_optimizer" in messages["offload"]
        assert "save_strategy='epoch'" in messages["save_steps"]
        assert "ZeRO-3" in messages["zero3_eval_steps"]
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
    with pytest.raises(UnsupportedTransformersError, match="Trainer.get_batch_samples"):
        _private.check("Trainer")
