"""One rank of torch's own DDP join tests, on CPU/gloo, with torch's Join or joinkit's.

Theory of operation
-------------------
The installed wheel ships torch's distributed test suite
(``torch/testing/_internal/distributed/distributed_test.py`` and
``ddp_under_dist_autograd_test.py``). Its DDP join tests are gated on CUDA and
written for one GPU per rank. ``test_torch_suite.py`` runs them here,
unchanged, twice in this one harness: ``MODE=torch`` (baseline) and
``MODE=joinkit``, where ``torch.nn.parallel.distributed.Join`` (the name
``DistributedDataParallel.join()`` and DDP's forward use) is joinkit's
``Join``, exactly what a user who switches DDP over does::

    python torch_suite_runner.py MODE SUITE RANK WORLD STORE OUT_DIR TEST [TEST ...]

``SUITE`` is ``ddp`` (``_DistTestBase``'s tests on ``WORLD`` ranks),
``rpc_comparison`` (``DdpComparisonTest``'s, ``WORLD`` trainers) or ``rpc``
(``DdpUnderDistAutogradTest``'s, ``WORLD - 2`` trainers); the tests run in the
order given. An RPC test gets processes of its own, as in torch's harness: the
TensorPipe agent does not reliably start again in a process that ran RPC (or
the gloo tests) before (one launch in about five hung at shutdown, in both
modes).

*The shims* (the same in both modes; each is the smallest that lets the test
run on CPU):

- ``Module.cuda()`` and ``Tensor.cuda()`` return their receiver;
  ``torch.cuda.set_device`` and ``torch.cuda.synchronize`` do nothing and
  ``torch.cuda.current_device()`` is 0.
- A ``TorchFunctionMode`` maps an explicit CUDA device (``device=rank``) of a
  tensor factory to the CPU, and shrinks the one 1×1×1000×1000 input
  (``test_ddp_uneven_inputs``'s large conv model: 2·10^11 FLOPs a forward on
  one CPU core) to 1×1×S×S (``CONV_SIDE``); the model itself is unchanged.
- ``DistributedDataParallel(..., device_ids=[rank])`` of a CPU module drops
  ``device_ids`` (DDP refuses them for CPU modules).
- ``SyncBatchNorm`` on CPU: DDP refuses it and its kernels are CUDA-only; the
  stand-in normalises with the global batch statistics, all-reduced with
  ``torch.distributed.nn.functional.all_reduce`` (one collective forward, one
  backward, as SyncBatchNorm's own), and updates the running statistics as
  SyncBatchNorm does.
- The test methods run without their ``skip_if_lt_x_gpu`` wrapper (checked to
  be exactly that wrapper, nothing else is unwrapped).

*One launch per suite and world size.* Each rank imports torch and the test
modules once and runs every test in order, each on a fresh default process
group (so a test that fails cannot strand the next one in a half-done
collective), with torch's own timeout for these tests (60 s). After each test a
rank appends one JSON line to ``OUT_DIR/rank{RANK}.jsonl``: the test, whether it
passed, the traceback, its seconds, how many ``test_ddp_uneven_inputs``
sub-cases ran, and which Join classes were entered (and joinkit's shadow
rounds), which is how the test proves the substitution in every rank.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

MODE, SUITE, RANK, WORLD, STORE, OUT_DIR, *TESTS = sys.argv[1:]
os.environ["BACKEND"] = "gloo"  # read by distributed_test.py at import
os.environ["WORLD_SIZE"] = WORLD

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.algorithms.join as torch_join  # noqa: E402
import torch.nn.parallel.distributed as ddp_module  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.testing._internal import common_distributed, common_utils  # noqa: E402

import joinkit  # noqa: E402

# torch's own process-group timeout for these tests (CUSTOM_PG_TIMEOUT gives
# test_ddp_uneven_inputs 300 s for GPUs; on CPU with small inputs 60 s is ample).
PG_TIMEOUT = datetime.timedelta(seconds=60)
CONV_SIDE = 24  # the large conv model's input side (torch: 1000)


# -- the shims ---------------------------------------------------------------------


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CpuDevices(TorchFunctionMode):
    """Explicit CUDA devices of tensor factories become the CPU; the large conv
    model's 1000×1000 input becomes ``CONV_SIDE``×``CONV_SIDE``."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.ones and tuple(args) == (1, 1, 1000, 1000):
            args = (1, 1, CONV_SIDE, CONV_SIDE)
        return func(*args, **kwargs)


def _sync_batch_norm_cpu(
    module: nn.SyncBatchNorm, input: torch.Tensor, factor: float, group: Any
) -> torch.Tensor:
    """SyncBatchNorm's training forward on CPU: normalise with the global batch
    statistics; the all-reduce's backward all-reduces the statistics' gradients."""
    from torch.distributed.nn.functional import all_reduce

    channels = input.shape[1]
    dims = [d for d in range(input.dim()) if d != 1]
    count = torch.tensor([input.numel() / channels], dtype=input.dtype)
    local = torch.cat([input.sum(dims), (input * input).sum(dims), count])
    total = all_reduce(local, group=group)
    n = total[-1]
    mean = total[:channels] / n
    var = total[channels:2 * channels] / n - mean * mean
    shape = [1, channels] + [1] * (input.dim() - 2)
    out = (input - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + module.eps)
    if module.weight is not None:
        out = out * module.weight.reshape(shape) + module.bias.reshape(shape)
    if module.running_mean is not None and module.track_running_stats:
        with torch.no_grad():
            module.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
            unbiased = var.detach() * n.detach() / (n.detach() - 1)
            module.running_var.mul_(1 - factor).add_(unbiased * factor)
    return out


_sync_bn_forward = nn.SyncBatchNorm.forward


def _sync_bn_forward_cpu(self: nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
    group = self.process_group or dist.group.WORLD
    if (input.device.type != "cpu" or not self.training or not dist.is_initialized()
            or dist.get_world_size(group) == 1):
        return _sync_bn_forward(self, input)
    self._check_input_dim(input)
    factor = 0.0 if self.momentum is None else self.momentum
    if self.track_running_stats:
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            factor = 1.0 / float(self.num_batches_tracked.item())
    return _sync_batch_norm_cpu(self, input, factor, group)


def _without_cpu_device_ids(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        devices = {p.device.type for p in module.parameters()}
        if devices == {"cpu"}:
            kwargs.pop("device_ids", None)
            kwargs.pop("output_device", None)
            if args:  # DDP(module, device_ids, output_device, ...)
                args = (None, None, *args[2:])
        init(self, module, *args, **kwargs)

    return __init__


def install_shims() -> None:
    nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: 0
    DistributedDataParallel.__init__ = _without_cpu_device_ids(
        DistributedDataParallel.__init__
    )
    nn.SyncBatchNorm.forward = _sync_bn_forward_cpu
    # DDP refuses SyncBatchNorm in a CPU module; the stand-in above handles it.
    DistributedDataParallel._passing_sync_batchnorm_handle = (
        lambda self, module: None
    )
    CpuDevices().__enter__()


_GPU_GATE = common_distributed.skip_if_lt_x_gpu(2)(lambda: None).__code__


def without_gpu_gate(method: Any) -> Any:
    """The test method inside its ``skip_if_lt_x_gpu`` wrapper (and only that)."""
    if getattr(method, "__code__", None) is _GPU_GATE:
        return method.__wrapped__
    return method


# -- which Join ran -------------------------------------------------------------------

entered: list[str] = []
shadow_rounds = [0]
subcases = [0]


def _recording_enter(cls: type, name: str) -> None:
    enter = cls.__enter__
    exit_ = cls.__exit__

    def __enter__(self: Any) -> Any:
        entered.append(name)
        return enter(self)

    def __exit__(self: Any, *exc: Any) -> Any:
        try:
            return exit_(self, *exc)
        finally:
            report = getattr(self, "report", None)
            if report is not None:
                shadow_rounds[0] += report.shadow_rounds

    cls.__enter__ = __enter__
    cls.__exit__ = __exit__


def install_mode() -> None:
    _recording_enter(torch_join.Join, "torch")
    _recording_enter(joinkit.Join, "joinkit")
    if MODE == "joinkit":
        # What DDP.join() builds, and what DDP's forward notifies.
        ddp_module.Join = joinkit.Join
    elif MODE != "torch":
        raise SystemExit(f"unknown mode {MODE!r}")


# -- running the tests ----------------------------------------------------------------


def run(name: str, call: Any, record_extra: dict[str, Any] | None = None) -> None:
    entered.clear()
    shadow_rounds[0] = 0
    subcases[0] = 0
    record: dict[str, Any] = {"test": name, "ok": True, **(record_extra or {})}
    common_utils.set_rng_seed(common_utils.SEED)  # as torch's harness does before each test
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - recorded, the test reports it
        record["ok"] = False
        record["error"] = "".join(traceback.format_exception(exc))
    record.update(
        seconds=round(time.monotonic() - start, 2),
        entered=sorted(set(entered)),
        enters=len(entered),
        shadow_rounds=shadow_rounds[0],
        subcases=subcases[0],
        join_class=f"{ddp_module.Join.__module__}.{ddp_module.Join.__qualname__}",
    )
    with (Path(OUT_DIR) / f"rank{RANK}.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


def dist_test_case() -> type:
    """``_DistTestBase`` as a TestCase, counting ``test_ddp_uneven_inputs``' sub-cases."""
    from torch.testing._internal.distributed.distributed_test import DistributedTest

    class Case(DistributedTest._DistTestBase, common_utils.TestCase):
        def _run_uneven_inputs_test(self, *args: Any, **kwargs: Any) -> Any:
            subcases[0] += 1
            return super()._run_uneven_inputs_test(*args, **kwargs)

    return Case


#: Every test's default group, kept alive until the process ends (``os._exit``). A gloo
#: group destroyed mid-run can deadlock inside torch (seen on torch 2.6, torch's own
#: Join, after test_ddp_join_model_equivalence; gdb: the main thread, holding the GIL,
#: in ~ProcessGroupGloo joining a worker thread that waits for the GIL to drop a
#: tensor's Python object). The same teardown deadlock as test_torch_suite.py's
#: RPC_LAUNCH_TIMEOUT note; torch's own harness never meets it (a process per test).
_KEPT_GROUPS: list[Any] = []


def _leave_group() -> None:
    """``destroy_process_group()`` with the group itself kept alive (``_KEPT_GROUPS``)."""
    _KEPT_GROUPS.append(dist.group.WORLD)
    dist.destroy_process_group()


def run_dist_test(case_class: type, name: str, index: int, rank: int, world: int) -> None:
    """One ``_DistTestBase`` test on a fresh default group, as torch's harness runs it."""
    dist.init_process_group(
        "gloo", init_method=f"file://{STORE}.{index}", rank=rank, world_size=world,
        timeout=PG_TIMEOUT,
    )
    try:
        case = case_class(name)
        case.rank = rank
        without_gpu_gate(getattr(case_class, name))(case)
        dist.barrier()
    finally:
        _leave_group()


def check_sync_batch_norm_stand_in(rank: int, world: int) -> None:
    """The SyncBatchNorm stand-in is BatchNorm over the whole world's batch:
    the same output, input gradient, summed weight and bias gradients, and
    running statistics (uneven batch sizes, a 3-d input)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{STORE}.sync_bn", rank=rank, world_size=world,
        timeout=PG_TIMEOUT,
    )
    try:
        torch.manual_seed(0)
        inputs = [torch.randn(2 + r, 3, 5) for r in range(world)]
        weights = [torch.randn(2 + r, 3, 5) for r in range(world)]
        stand_in, reference = nn.SyncBatchNorm(3, momentum=0.3), nn.BatchNorm1d(3, momentum=0.3)
        with torch.no_grad():
            for bn in (stand_in, reference):
                bn.weight.copy_(torch.arange(1.0, 4.0))
                bn.bias.copy_(torch.arange(3.0))
        x = inputs[rank].clone().requires_grad_()
        out = stand_in(x)
        (out * weights[rank]).sum().backward()
        full = torch.cat(inputs).requires_grad_()
        y = reference(full)
        (y * torch.cat(weights)).sum().backward()
        start = sum(2 + r for r in range(rank))
        rows = slice(start, start + 2 + rank)
        torch.testing.assert_close(out.detach(), y[rows].detach())
        torch.testing.assert_close(x.grad, full.grad[rows])
        for name in ("weight", "bias"):
            grad = getattr(stand_in, name).grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, getattr(reference, name).grad)
        torch.testing.assert_close(stand_in.running_mean, reference.running_mean)
        torch.testing.assert_close(stand_in.running_var, reference.running_var)
    finally:
        _leave_group()


def rpc_test_case(base_name: str, trainers: int, world: int) -> type:
    """An RPC test class of ddp_under_dist_autograd_test on the TensorPipe agent.

    The module's layout constants are set for ``trainers`` trainers (the DDP
    world), then the remote worker and the master where the test has them.
    """
    from torch.testing._internal.distributed import ddp_under_dist_autograd_test as rpc_tests
    from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
        TensorPipeRpcAgentTestFixture,
    )

    rpc_tests.NUM_TRAINERS = trainers
    rpc_tests.WORLD_SIZE = world
    rpc_tests.TRAINER_RANKS = list(range(trainers))
    rpc_tests.REMOTE_WORKER_RANK = trainers
    rpc_tests.MASTER_RANK = trainers + 1

    class Case(TensorPipeRpcAgentTestFixture, getattr(rpc_tests, base_name),
               common_utils.TestCase):
        pass

    return Case


def run_rpc_test(case_class: type, name: str, rank: int) -> None:
    case = case_class(name)
    case.rank = rank
    case.file_name = f"{STORE}.{name}"
    getattr(case, name)()  # dist_init: RPC up, the test, RPC down


def main() -> None:
    install_shims()
    install_mode()
    rank, world = int(RANK), int(WORLD)
    if SUITE == "ddp":
        dist_case = dist_test_case()
        for index, name in enumerate(TESTS):
            if name == "check_sync_batch_norm_stand_in":
                run(name, lambda: check_sync_batch_norm_stand_in(rank, world))
            else:
                run(name, lambda name=name, index=index: run_dist_test(
                    dist_case, name, index, rank, world))
        # The kept groups are never destroyed (``_KEPT_GROUPS``): every record is
        # written; the process ends without finalizing them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    elif SUITE == "rpc_comparison":
        comparison = rpc_test_case("DdpComparisonTest", world, world)
        for name in TESTS:
            run(name, lambda name=name: run_rpc_test(comparison, name, rank))
    elif SUITE == "rpc":
        autograd = rpc_test_case("DdpUnderDistAutogradTest", world - 2, world)
        for name in TESTS:
            run(name, lambda name=name: run_rpc_test(autograd, name, rank))
    else:
        raise SystemExit(f"unknown suite {SUITE!r}")


if __name__ == "__main__":
    main()
