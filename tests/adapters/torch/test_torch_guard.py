"""The check of the torch internals the adapters rely on, in one process.

``joinkit.adapters.torch._private`` lists them; here: all are present in the
torch the project pins, the declared range is the one checked, and each kind
of change (a member deleted, its parameters changed, a torch caller that no
longer calls it, a namedtuple's fields, a static method, an instance attribute
the class no longer names) is reported by name with the torch version. The
adapters themselves meet changed members on real process groups in
``test_fsdp.py`` (``torch_guard``).
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.algorithms.join as torch_join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.parallel import distributed as ddp_module

from joinkit import Join
from joinkit.adapters import UnsupportedTorchError, _guards
from joinkit.adapters._guards import Member, Need, problems
from joinkit.adapters.torch import _compat
from joinkit.adapters.torch import _private as _torch_private
from joinkit.adapters.torch._private import GROUPS, check

pytestmark = pytest.mark.needs_torch
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts as a process that checked nothing yet."""
    monkeypatch.setattr(_torch_private, "_checked", set())


def bare(cls: type) -> Any:
    """An instance of ``cls`` that skipped its constructor: enough for isinstance."""
    return cls.__new__(cls)


# Features a torch release truly lacks: refused by design there (the group says why).
LACKING = {f"FSDP2 {_torch_private.SUM_REDUCTIONS}": (2, 8)}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_member_is_there_in_this_torch(group: str) -> None:
    since = LACKING.get(group)
    if since is not None and tuple(map(int, torch.__version__.split(".")[:2])) < since:
        # This torch lacks it: the group is refused by design, naming what is missing.
        assert problems(GROUPS[group]) != []
        assert group in _torch_private.refused_features()
        return
    assert problems(GROUPS[group]) == []


def test_pyproject_declares_the_range_that_is_checked() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r'^torch = \["torch([^"]*)"\]', pyproject, re.M)
    assert extra is not None and extra.group(1) == _torch_private.SUPPORTED_TORCH
    constraints = (ROOT / "constraints.txt").read_text().split()
    assert any(f"torch=={tested}" in constraints for tested in _torch_private.TESTED_TORCH)


def test_the_readme_states_the_range() -> None:
    readme = (ROOT / "README.md").read_text()
    def minor(version: str) -> str:
        return ".".join(version.split(".")[:2])

    oldest, newest = (minor(v) for v in (_torch_private.TESTED_TORCH[0],
                                         _torch_private.TESTED_TORCH[-1]))
    assert f">={oldest}" == _torch_private.SUPPORTED_TORCH
    assert f"Supported torch: {oldest} to {newest}" in readme


def test_join_refuses_a_ddp_whose_join_method_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(DDP, "_match_all_reduce_for_bwd_pass")
    with pytest.raises(UnsupportedTorchError) as caught:
        Join([bare(DDP)])
    message = str(caught.value)
    assert isinstance(caught.value, RuntimeError)
    assert "DistributedDataParallel._match_all_reduce_for_bwd_pass is missing" in message
    assert f"this process runs torch {torch.__version__}" in message
    assert "supports torch >=2.6 (tested with 2.6.0, 2.7.1, " in message
    assert "joinkit needs for: DistributedDataParallel." in message
    assert "pip install" not in message


def test_changed_parameters_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def changed(self: Any, joined: bool) -> bool:
        return joined

    monkeypatch.setattr(DDP, "_check_global_requires_backward_grad_sync", changed)
    with pytest.raises(UnsupportedTorchError, match=re.escape(
            "_check_global_requires_backward_grad_sync has the parameters (self, joined), "
            "joinkit expects (self, is_joined_rank)")):
        check(bare(DDP))


def test_extra_parameters_need_defaults() -> None:
    def with_default(self: Any, input_rank: int, rank_cond: bool, extra: int = 0) -> None: ...

    def without(self: Any, input_rank: int, rank_cond: bool, extra: int) -> None: ...

    expected = ("self", "input_rank", "rank_cond")
    assert _guards._params_mismatch(with_default, expected) is None
    assert "joinkit expects" in str(_guards._params_mismatch(without, expected))


def test_a_torch_caller_that_no_longer_calls_the_replaced_method(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP's join hook calling another name would skip joinkit's replacement."""

    def main_hook(self: Any) -> None:
        if self.ddp._check_global_requires_backward_grad_sync(is_joined_rank=True):
            self.ddp._match_all_reduce_for_bwd_pass_v2()

    monkeypatch.setattr(ddp_module._DDPJoinHook, "main_hook", main_hook)
    with pytest.raises(UnsupportedTorchError, match=re.escape(
            "_DDPJoinHook.main_hook no longer calls _match_all_reduce_for_bwd_pass;")):
        check(bare(DDP))


def test_bindings_are_checked_by_their_number_of_parameters() -> None:
    reducer = torch._C._distributed_c10d.Reducer
    assert _guards._binding_params(reducer._set_forward_pass_work_handle) == [
        "self", "arg0", "arg1"]

    class Binding:
        """f(self: A, arg0: dict[str, tuple[int, int]]) -> list[int]"""

        __signature__ = "none: a C++ binding"

        def __call__(self) -> None: ...

    assert _guards._params_mismatch(Binding(), ("self", "mapping")) is None
    assert _guards._params_mismatch(Binding(), ("self", "a", "b")) == (
        "takes 2 parameters (self, arg0), joinkit passes 3 (self, a, b)")


def test_join_config_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    fewer = collections.namedtuple("_JoinConfig", "enable throw_on_early_termination")
    monkeypatch.setattr(torch_join, "_JoinConfig", fewer)
    found = problems(_torch_private.JOIN_MEMBERS)
    assert len(found) == 1 and "_JoinConfig has the fields ('enable', " in found[0]


def test_notify_must_stay_a_static_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_join.Join, "notify_join_context", lambda joinable: None)
    found = problems(_torch_private.JOIN_MEMBERS)
    assert len(found) == 1 and "notify_join_context is not a staticmethod" in found[0]


def test_instance_attributes_are_found_in_the_class_code() -> None:
    """An attribute set in a method (FSDP's, DDP's) is checked by name in the code."""

    def attribute(name: str) -> Member:
        return Member(module="torch.nn.parallel.distributed", name=name,
                      need=Need.ATTRIBUTE, why="a test")

    assert problems([attribute("DistributedDataParallel.reducer")]) == []
    assert "is missing" in problems([attribute("DistributedDataParallel.reducer_v2")])[0]


def test_checked_once_per_kind_and_process(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []

    def counting(members: Any) -> list[str]:
        ran.append(next(name for name, group in GROUPS.items() if group is members))
        return []

    monkeypatch.setattr(_torch_private, "problems", counting)
    for _ in range(3):
        check(bare(DDP))
    assert sorted(ran) == ["DistributedDataParallel", "replay", "torch Joinable"]
    check(bare(ZeroRedundancyOptimizer))
    assert sorted(ran) == ["DistributedDataParallel", "ZeroRedundancyOptimizer", "replay",
                           "torch Joinable"]


def test_a_group_that_failed_is_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.delattr(DDP, "_find_common_rank")
        with pytest.raises(UnsupportedTorchError, match="_find_common_rank is missing"):
            check(bare(DDP))
    check(bare(DDP))  # torch as it is again: passes


def test_a_finish_mode_member_missing_refuses_finish_mode_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A member only Join(on_rank_loss="finish") uses never refuses plain DDP."""
    monkeypatch.delattr(DDP, "_update_process_group")
    check(bare(DDP))  # plain DDP: its groups pass
    with pytest.raises(UnsupportedTorchError) as caught:
        check(bare(DDP), _torch_private.FINISH)
    message = str(caught.value)
    assert "joinkit needs for: DistributedDataParallel in finish mode" in message
    assert "_update_process_group is missing" in message
    assert f"runs torch {torch.__version__}" in message


def test_a_property_without_a_setter_is_refused_where_joinkit_sets_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Need.SETTABLE: torch 2.15 made FSDPParam.unsharded_accumulated_grad such a property."""

    class Param:
        def __init__(self) -> None:
            self.plain = None

        @property
        def derived(self) -> None:
            return None

    module = type(sys)("guard_settable_test")
    module.Param = Param  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)

    def settable(name: str) -> Member:
        return Member(module=module.__name__, name=f"Param.{name}", need=Need.SETTABLE,
                      why="a test")

    assert problems([settable("plain")]) == []
    assert problems([settable("derived")]) == [
        "guard_settable_test.Param.derived is a property without a setter; joinkit sets "
        "it: a test"]
    assert "is missing" in problems([settable("gone")])[0]


# -- what this torch refuses by design: the compatibility matrix asks each venv --------


def _minor() -> tuple[int, int]:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return major, minor


def test_refused_features_on_this_torch() -> None:
    """What the matrix's column of this torch says it refuses (docs/compat.md), as
    ``_compat``'s table has it: FSDP2 on the CPU before 2.7, over gloo before 2.9;
    FSDP2's summed reductions before 2.8; FSDP2's reset mid-iteration before 2.13."""
    refused = _torch_private.refused_features()
    version = torch.__version__
    expected = set()
    if _minor() < (2, 9):
        expected.add("FSDP2")
        assert f"on torch {version}: " in refused["FSDP2"], refused
        assert ("FSDP2 on the CPU" in refused["FSDP2"]) == (_minor() < (2, 7)), refused
        assert "FSDP2 over gloo" in refused["FSDP2"], refused
    if _minor() < (2, 8):
        expected.add(f"FSDP2 {_torch_private.SUM_REDUCTIONS}")
    if _minor() < (2, 13):
        expected.add("FSDP2: a rank that failed mid-iteration, shadowed")
    assert set(refused) == expected, refused
    for why in refused.values():
        assert f"torch {version}" in why, why


def test_a_feature_this_torch_cannot_do_is_refused_by_its_matrix_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from joinkit.adapters.torch import _compat

    monkeypatch.setattr(_compat, "fsdp_runs_on_cpu", lambda: False)
    monkeypatch.setattr(_compat, "gloo_reduce_scatter_averages", lambda: True)
    why = _torch_private.refused_features()["FSDP2"]
    assert why == _torch_private.fsdp_cpu_refusal()
    assert why.startswith(f"joinkit refuses FSDP2 on the CPU on torch {torch.__version__}: ")
    assert "torch.cpu.Stream, which has no record_event" in why
    monkeypatch.setattr(_compat, "fsdp_runs_on_cpu", lambda: True)
    monkeypatch.setattr(_compat, "gloo_reduce_scatter_averages", lambda: False)
    why = _torch_private.refused_features()["FSDP2"]
    assert why.startswith(f"joinkit refuses FSDP2 over gloo on torch {torch.__version__}: ")
    assert "ReduceOp.AVG" in why


def test_a_member_missing_is_refused_under_its_feature_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole feature's group under the matrix's row (DDP); a part of one (DDP's
    finish mode) under its group's name, refusing nothing else."""
    before = _torch_private.refused_features()
    monkeypatch.delattr(DDP, "_update_process_group")
    refused = _torch_private.refused_features()
    part = f"DistributedDataParallel {_torch_private.FINISH}"
    assert set(refused) == set(before) | {part}, refused
    assert "_update_process_group is missing" in refused[part]
    assert refused[part].startswith(f"torch {torch.__version__} lacks or changed ")
    monkeypatch.delattr(DDP, "_find_common_rank")
    refused = _torch_private.refused_features()
    assert "_find_common_rank is missing" in refused["DDP"], refused
    assert "DistributedDataParallel" not in refused


def test_a_torch_without_what_fsdp1_needs_refuses_fsdp1_by_its_matrix_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP1's guard group refuses FSDP1 alone, under the matrix's row ("FSDP1"), and
    its Join names the member: before any collective (``fsdp1.py`` checks first)."""
    from support.refusals import fsdp1_refusal
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    before = _torch_private.refused_features()
    assert "FSDP1" not in before and fsdp1_refusal() is None
    monkeypatch.delattr(FSDP1, "fsdp_modules")
    refused = _torch_private.refused_features()
    assert set(refused) == set(before) | {"FSDP1"}, refused
    assert refused["FSDP1"].startswith(f"torch {torch.__version__} lacks or changed what "
                                       "joinkit needs for FSDP1: ")
    words = fsdp1_refusal()
    assert words is not None and "FullyShardedDataParallel.fsdp_modules is missing" in words
    assert words in refused["FSDP1"]
    with pytest.raises(UnsupportedTorchError) as caught:
        check(bare(FSDP1))
    assert "joinkit needs for: FSDP1." in str(caught.value)
    assert words in str(caught.value)
    check(bare(DDP))  # DDP does not use FSDP1's members


def test_copies_into_buffers_keep_their_version_counters() -> None:
    # The elastic buffer unit copies a peer's buffers in as DDP's broadcast does,
    # keeping autograd's version counters (on this torch's own context).
    buffers = (torch.zeros(3), torch.zeros(2, dtype=torch.int64))
    before = [b._version for b in buffers]
    with torch.no_grad(), _compat.preserve_version_counter(buffers):
        for buffer in buffers:
            buffer.copy_(torch.ones_like(buffer))
    assert [b._version for b in buffers] == before
    assert all(bool((b == 1).all()) for b in buffers)


def test_a_version_keeper_of_one_tensor_is_entered_per_tensor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.6's _unsafe_preserve_version_counter takes one tensor (2.7 and later
    # a tuple): one context per tensor there, resolved once per process.
    entered: list[torch.Tensor] = []
    left: list[torch.Tensor] = []

    class OneTensor:
        def __init__(self, tensor: torch.Tensor) -> None:
            assert isinstance(tensor, torch.Tensor)
            entered.append(tensor)
            self.tensor = tensor

        def __enter__(self) -> None:
            pass

        def __exit__(self, *args: Any) -> None:
            left.append(self.tensor)

    monkeypatch.setattr(torch.autograd, "_unsafe_preserve_version_counter", OneTensor)
    _compat._version_keeper.cache_clear()
    try:
        buffers = (torch.zeros(3), torch.zeros(1))
        with _compat.preserve_version_counter(buffers):
            buffers[0].add_(1)
            buffers[1].add_(1)
        assert entered == list(buffers)
        assert left == list(reversed(buffers))
    finally:
        _compat._version_keeper.cache_clear()
