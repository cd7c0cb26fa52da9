"""The Lightning adapters' checks that need no launch: guard table, bad arguments."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

from joinkit import LocalProtocolError, SideChannel, SideCollective  # noqa: E402
from joinkit.adapters._guards import Member, Need  # noqa: E402
from joinkit.adapters.lightning import UnevenInputs  # noqa: E402
from joinkit.adapters.lightning import _private as private  # noqa: E402
from joinkit.adapters.lightning._trainer import _op_name  # noqa: E402


def test_the_guard_table_matches_this_lightning() -> None:
    for group, members in private.GROUPS.items():
        assert private.problems(members) == [], group


def test_a_changed_lightning_member_is_a_loud_error(monkeypatch: pytest.MonkeyPatch) -> None:
    gone = Member(module="pytorch_lightning.loops.training_epoch_loop",
                  name="_TrainingEpochLoop._broadcast_sigterm_tensor_renamed",
                  need=Need.CALLABLE, params=("self",), why="the per-batch SIGTERM broadcast")
    monkeypatch.setitem(private.GROUPS, "Trainer", (gone,))
    monkeypatch.setattr(private, "_checked", set())
    with pytest.raises(private.UnsupportedLightningError,
                       match=rf"(?s)^found pytorch-lightning {re.escape(pl.__version__)}; "
                             r"joinkit's Trainer adapter needs.*"
                             r"_broadcast_sigterm_tensor_renamed is missing.*"
                             r"supports pytorch-lightning>=2\.6\.0 wherever"):
        private.check("Trainer")


def test_the_pyproject_extra_pins_the_guarded_range() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    assert f'"pytorch-lightning{private.SUPPORTED_LIGHTNING}"' in text
    assert private.SUPPORTED_LIGHTNING == f">={private.TESTED_LIGHTNING[0]}"
    constraints = (Path(__file__).resolve().parents[3] / "constraints.txt").read_text()
    assert f"pytorch-lightning=={private.TESTED_LIGHTNING[-1]}" in constraints.splitlines()


def test_side_collectives_must_be_side_collectives() -> None:
    with pytest.raises(TypeError, match="takes joinkit.SideCollective objects"):
        UnevenInputs(side_collectives=[print])  # type: ignore[list-item]
    UnevenInputs(side_collectives=[SideCollective(print)])


def test_the_side_channel_must_be_a_side_channel() -> None:
    with pytest.raises(TypeError, match="takes a joinkit.SideChannel"):
        UnevenInputs(side_channel=SideCollective(print))  # type: ignore[arg-type]
    side = SideChannel()
    assert UnevenInputs(side_channel=side).side_channel is side
    assert UnevenInputs().side_channel is None  # made at an epoch start only if needed


def test_a_per_step_metric_with_a_group_of_its_own_is_refused() -> None:
    import torchmetrics

    from joinkit.adapters.lightning._trainer import _per_step_metrics

    class Module(pl.LightningModule):
        def __init__(self, group: object) -> None:
            super().__init__()
            self.plain = torchmetrics.MeanSquaredError()
            self.stepped = torchmetrics.MeanSquaredError(dist_sync_on_step=True,
                                                         process_group=group)

    module = Module(None)
    assert _per_step_metrics(module) == [module.stepped]
    with pytest.raises(TypeError, match="'stepped' has a process_group of its own"):
        _per_step_metrics(Module(object()))


def test_reduce_ops_it_can_and_cannot_shadow() -> None:
    assert [_op_name(op) for op in ("mean", "avg", "sum", "max", "min", None)] == [
        "mean", "mean", "sum", "max", "min", "sum"]
    with pytest.raises(LocalProtocolError, match="use mean, sum, max or min"):
        _op_name("prod")


def test_a_logged_value_with_a_group_of_its_own_is_refused() -> None:
    callback = UnevenInputs()
    with pytest.raises(LocalProtocolError, match="sync_dist_group"):
        callback.defer(torch.ones(()), group=object(), reduce_op="mean")
    with pytest.raises(LocalProtocolError, match="one-element values"):
        callback.defer(torch.ones(2), group=None, reduce_op="mean")


def test_a_strategy_other_than_ddp_is_refused_at_fit() -> None:
    class Strategy:
        pass

    class Trainer:
        world_size = 2
        strategy = Strategy()

    with pytest.raises(TypeError, match="supports Lightning's DDP strategies.*FSDP1"):
        UnevenInputs().setup(Trainer(), None, "fit")  # type: ignore[arg-type]


@pytest.mark.launches
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="Lightning's FSDP (FSDP1) runs on CUDA only")
def test_fabric_fsdp1_is_refused_with_the_way_out() -> None:
    from lightning_fabric import Fabric

    from joinkit import Join

    fabric = Fabric(accelerator="cuda", devices=1, strategy="fsdp")
    fabric.launch()
    model = fabric.setup_module(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="FSDP1.*ModelParallelStrategy"):
        Join([model])


@pytest.mark.launches
def test_joinkit_imports_no_lightning_until_an_adapter_needs_it() -> None:
    import subprocess
    import sys

    code = (
        "import sys, torch, joinkit, joinkit.adapters\n"
        "from joinkit import Join, SideCollective\n"
        "from joinkit.adapters.torch import collectives\n"
        "import joinkit._ports as ports\n"
        "sgd = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1)\n"
        "assert ports.adapt(sgd) is not None\n"
        "bad = [m for m in ('pytorch_lightning', 'lightning_fabric', 'torchmetrics')"
        " if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr


def test_model_parallel_strategy_limits_are_refused_before_any_collective() -> None:
    from joinkit.adapters.lightning import _trainer as lightning

    class Strategy:
        _tensor_parallel_size = 2

    class Trainer:
        strategy = Strategy()
        accumulate_grad_batches = 1

    with pytest.raises(TypeError, match="data parallelism only.*tensor_parallel_size=2"):
        lightning._check_model_parallel(Trainer())  # type: ignore[arg-type]
    Strategy._tensor_parallel_size = 1
    lightning._check_model_parallel(Trainer())  # type: ignore[arg-type]
    # Accumulation is FSDP's own windows now (test_lightning_trainer.py runs it).
    Trainer.accumulate_grad_batches = 2
    lightning._check_model_parallel(Trainer())  # type: ignore[arg-type]


def test_model_parallel_needs_one_root_fully_shard_module() -> None:
    import pytorch_lightning as pl

    from joinkit.adapters.lightning import _trainer as lightning

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 2)

    with pytest.raises(TypeError, match="exactly one root fully_shard module.*found 0"):
        lightning._fsdp2_root(Module())


def test_what_mid_epoch_validation_refuses() -> None:
    """A duration is refused (each rank's clock); batches, a fraction and step
    checkpoints run, under DDP and FSDP alike."""
    from joinkit.adapters.lightning._trainer import _mid_epoch_refusal

    timed = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                       val_check_interval="00:00:00:05")
    refusal = _mid_epoch_refusal(timed)
    assert refusal is not None
    assert "validates by each rank's clock, which the ranks do not share" in refusal
    for kwargs in ({"val_check_interval": 0.5}, {"val_check_interval": 2},
                   {"callbacks": [pl.callbacks.ModelCheckpoint(every_n_train_steps=2)]}):
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False,
                             enable_progress_bar=False, **kwargs)  # type: ignore[arg-type]
        assert _mid_epoch_refusal(trainer) is None


def test_example_input_array_as_forward_arguments() -> None:
    """FSDP1's replay input for a rank with no batch: Lightning's convention (a tuple is
    the positional arguments, a dict the keyword arguments, else one argument)."""
    from joinkit.adapters.lightning._trainer import _example_input

    module = pl.LightningModule()
    assert _example_input(module) is None
    x = torch.zeros(1, 3)
    module.example_input_array = x
    assert _example_input(module) == ((x,), {})
    module.example_input_array = (x, x)
    assert _example_input(module) == ((x, x), {})
    module.example_input_array = {"x": x}
    assert _example_input(module) == ((), {"x": x})
