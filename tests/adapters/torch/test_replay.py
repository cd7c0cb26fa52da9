"""The replay's pieces in one process: the step check's encoding, input specs,
the zero loss, buffers kept and restored, and which models replay."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch import nn

from joinkit import AgreementError
from joinkit import _machine as m
from joinkit.adapters.torch import _replay
from joinkit.adapters.torch.fsdp import _SLOT, GRAD, SYNC, _StepCheck

pytestmark = pytest.mark.needs_torch


@pytest.mark.parametrize("active", [1, 2, 7, 4095])
@pytest.mark.parametrize("flags", [0, SYNC, GRAD, SYNC | GRAD, 7])
@pytest.mark.parametrize("slots", [(0, 0, 0), (1, 0, 0), (4095, 0, 0), (3, 2, 0), (0, 4095, 0),
                                   (3, 0, 1), (0, 2, 5), (7, 0, 4095)])
def test_step_check_sums_split_exactly(active: int, flags: int,
                                       slots: tuple[int, int, int]) -> None:
    """``active`` ranks send slot + 2**24 (1 + 4096 flags); joined and failed ranks
    send only their slot (1 per active heartbeat; a failed rank 2**-100, or
    2**53 in the round it fails: the heartbeat sum is then an alarm)."""
    heartbeats, failed, failing = slots
    payload = active * _SLOT * (1 + 4096 * flags)
    total = (heartbeats + failed * m.FAILED) + failing * m.FAILING + payload
    slot, got_active, got_flags = _StepCheck._decode(total)
    assert (got_active, got_flags) == (active, flags)
    if failing:
        assert slot >= m.ALARM
    else:
        assert slot == heartbeats  # FAILED weights round away beside the active ranks


def test_no_active_rank_shows_the_failed_weights() -> None:
    assert _StepCheck._decode(3 * m.FAILED) == (3 * m.FAILED, 0, 0)


def test_step_check_refuses_ranks_that_disagree() -> None:
    total = _SLOT * ((1 + 4096 * SYNC) + (1 + 4096 * 0))  # one rank syncs, one does not
    with pytest.raises(AgreementError, match="set_requires_gradient_sync"):
        _StepCheck._decode(total)


def test_no_active_rank_decodes_to_nothing() -> None:
    assert _StepCheck._decode(4096.0) == (4096.0, 0, 0)


def test_input_spec_empties_dim_0_and_survives_pickle() -> None:
    x = torch.randn(5, 3, 2, dtype=torch.float64)
    ids = torch.arange(5)
    scale = torch.tensor(2.0)
    spec = _replay.InputSpec.of((x, [ids, "tag"]), {"scale": scale, "mode": 3}, "cpu")
    spec = pickle.loads(pickle.dumps(spec))
    args, kwargs = spec.materialize(torch.device("cpu"))
    (ex, (eids, tag)) = args
    assert ex.shape == (0, 3, 2) and ex.dtype == torch.float64
    assert eids.shape == (0,) and eids.dtype == torch.int64
    assert tag == "tag" and kwargs["mode"] == 3
    assert kwargs["scale"].shape == () and float(kwargs["scale"]) == 0.0  # 0-dim: a zero
    assert spec.autocast is None


def test_input_spec_records_autocast() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        spec = _replay.InputSpec.of((torch.ones(2, 2),), {}, "cpu")
    assert spec.autocast == ("cpu", torch.bfloat16)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("x", (("x",), {})),
        (("x", "y"), (("x", "y"), {})),
        ((("x",), {"k": 1}), (("x",), {"k": 1})),
    ],
)
def test_shadow_input_forms(given: Any, expected: Any) -> None:
    assert _replay._as_call(given) == expected


def test_zero_loss_sums_every_output_that_requires_grad() -> None:
    w = torch.ones(3, requires_grad=True)
    out = {"a": w * 2, "b": (w.sum(), torch.zeros(2))}
    loss = _replay.zero_loss(out)
    assert loss is not None and float(loss.detach()) == 0.0
    loss.backward()
    assert w.grad is not None and torch.equal(w.grad, torch.zeros(3))
    assert _replay.zero_loss((torch.zeros(2), 3)) is None


class Declares(nn.BatchNorm1d):
    join_forward_collectives = True


def test_buffers_restored_except_for_modules_with_forward_collectives() -> None:
    model = nn.Sequential(nn.BatchNorm1d(2), Declares(2))
    before = [b.clone() for b in model[0].buffers()]
    with _replay.kept_buffers(model):
        model(torch.randn(4, 2))
    assert all(torch.equal(a, b) for a, b in zip(model[0].buffers(), before, strict=True))
    assert int(model[1].num_batches_tracked) == 1  # its (global) update is kept


def test_replay_of_an_empty_batch_leaves_zero_gradients_and_no_nan() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    spec = _replay.InputSpec.of((torch.randn(6, 3),), {}, "cpu")
    args, kwargs = spec.materialize(torch.device("cpu"))
    _replay.replay(model, args, kwargs, backward=True)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    assert torch.isfinite(model[1].running_mean).all()


def test_replay_without_an_output_that_requires_grad_says_so() -> None:
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(RuntimeError, match="no output that requires grad"):
        _replay.replay(model, (torch.zeros(0, 2),), {}, backward=True)


def test_which_models_replay() -> None:
    assert _replay.has_forward_collectives(nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2)))
    assert _replay.has_forward_collectives(nn.Sequential(Declares(2)))
    assert not _replay.has_forward_collectives(nn.Sequential(nn.BatchNorm1d(2)))
