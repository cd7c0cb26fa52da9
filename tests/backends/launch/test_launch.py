"""Launcher detection and the launch plan, with each launcher's faked environment.

The environments below are what each launcher really sets (trimmed to the
variables that matter); ``available`` fakes which libraries are installed.
Nothing here imports torch or mpi4py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
import pytest

from joinkit import backends
from joinkit.backends.launch._plan import (
    LaunchPlan,
    first_host,
    plan_launch,
    solo_group,
    verify_world,
)

TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "none", "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "29500",
}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "PMIX_RANK": "2", "PMIX_NAMESPACE": "prterun-host-1@1",
}
HYDRA = {  # MPICH's mpiexec (and Intel MPI's)
    "PMI_RANK": "3", "PMI_SIZE": "4", "PMI_FD": "6", "MPI_LOCALNRANKS": "2",
    "MPI_LOCALRANKID": "1",
}
MVAPICH = {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2",
           "MV2_COMM_WORLD_LOCAL_RANK": "1"}
PMIX_ONLY = {"PMIX_RANK": "0", "PMIX_NAMESPACE": "ns"}  # e.g. prun, or a bare PMIx server
SRUN = {
    "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "2", "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
    "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3",
}
# A Ray Train worker (TorchTrainer, 2 CPU workers, Ray 2.60): what Ray and Ray
# Train set (recorded from a real worker), and no TORCHELASTIC_RUN_ID.
RAY_TRAIN = {
    "RAY_RAYLET_PID": "12147", "RAY_JOB_ID": "01000000", "RAY_CLIENT_MODE": "0",
    "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    "NODE_RANK": "0", "MASTER_ADDR": "192.0.2.2", "MASTER_PORT": "43105",
    "ACCELERATE_TORCH_DEVICE": "cpu",
}
RAY_TASK = {"RAY_RAYLET_PID": "12147", "RAY_JOB_ID": "01000000"}  # not a Train worker
SBATCH_SCRIPT = {  # the batch script itself: no step variables
    "SLURM_JOB_ID": "123456", "SLURM_PROCID": "0", "SLURM_NTASKS": "8",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}


def have(*modules: str) -> Callable[[str], bool]:
    return lambda module: module in modules


EVERYTHING = have("torch", "mpi4py")
LAUNCHER_PREFIXES = ("OMPI_COMM_WORLD", "PMI", "MPI_LOCAL", "MV2_", "SLURM_", "JOINKIT_")
TORCH_VARIABLES = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.mark.parametrize(
    ("env", "launcher"),
    [
        ({}, None),
        (TORCHRUN, "torchrun"),
        (OPEN_MPI, "mpirun"),
        (HYDRA, "mpirun"),
        (MVAPICH, "mpirun"),
        (PMIX_ONLY, "mpirun"),
        (SRUN, "srun"),
        (SBATCH_SCRIPT, None),
        # Nesting: the most specific launcher wins.
        ({**SRUN, **TORCHRUN}, "torchrun"),  # srun torchrun ...
        ({**SBATCH_SCRIPT, **OPEN_MPI}, "mpirun"),  # mpirun in an sbatch script
        ({**SBATCH_SCRIPT, **HYDRA}, "mpirun"),
        ({**SRUN, "PMIX_RANK": "5"}, "srun"),  # srun --mpi=pmix
        ({**SRUN, "PMI_SIZE": "8", "PMI_RANK": "5"}, "srun"),  # srun --mpi=pmi2
        # init_torch under mpirun exports torchrun's variables: still mpirun.
        ({**OPEN_MPI, "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "mpirun"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "torchrun"),
        (RAY_TRAIN, "ray"),
        (RAY_TASK, None),
        ({**RAY_TASK, **TORCHRUN}, "torchrun"),  # torchrun inside a Ray task
        ({**RAY_TASK, **OPEN_MPI}, "mpirun"),  # mpirun inside a Ray task
    ],
    ids=lambda value: "" if isinstance(value, dict) else str(value),
)
def test_detect_launcher(env: dict[str, str], launcher: str | None) -> None:
    assert backends.detect_launcher(env) == launcher


@pytest.mark.parametrize(
    ("env", "available", "backend"),
    [
        ({}, EVERYTHING, "threads"),
        (TORCHRUN, EVERYTHING, "torch"),
        (OPEN_MPI, EVERYTHING, "mpi"),
        (HYDRA, have("mpi4py"), "mpi"),
        (SRUN, EVERYTHING, "mpi"),
        (SRUN, have("torch"), "torch"),
        (SBATCH_SCRIPT, EVERYTHING, "threads"),
    ],
)
def test_natural_backend_of_each_launcher(
    env: dict[str, str], available: Callable[[str], bool], backend: str
) -> None:
    plan = plan_launch(env, available=available)
    assert plan.backend == backend
    assert plan.chosen_by == "launcher"


def test_torchrun_plan_reads_its_variables() -> None:
    assert plan_launch(TORCHRUN, available=EVERYTHING) == LaunchPlan(
        launcher="torchrun", backend="torch", chosen_by="launcher", rank=1, world_size=4,
        local_rank=1, master_addr="10.0.0.5", master_port=29500, launched_size=4,
        launched_size_from="WORLD_SIZE",
    )


@pytest.mark.parametrize(
    ("env", "rank", "size", "local"),
    [(OPEN_MPI, 2, 4, 0), (HYDRA, 3, 4, 1), (MVAPICH, 1, 2, 1), (PMIX_ONLY, 0, None, None)],
)
def test_mpirun_plan_reads_rank_from_any_mpi(
    env: dict[str, str], rank: int, size: int | None, local: int | None
) -> None:
    for backend in ("mpi", "torch"):
        plan = plan_launch(env, backend, available=EVERYTHING)
        assert (plan.launcher, plan.backend) == ("mpirun", backend)
        assert (plan.rank, plan.world_size, plan.local_rank) == (rank, size, local)
        # Under mpirun the rendezvous is agreed over MPI at init time.
        assert (plan.master_addr, plan.master_port) == (None, None)


def test_srun_torch_plan_from_slurm_variables() -> None:
    plan = plan_launch(SRUN, available=have("torch"))
    assert (plan.rank, plan.world_size, plan.local_rank) == (5, 8, 1)
    # Task 0 runs on the step's first node, not on the node srun ran from.
    assert plan.master_addr == "gpu07"
    assert plan.master_port is not None and 20000 <= plan.master_port < 60000
    # Every task derives the same port; another step of the job another one.
    assert plan_launch({**SRUN, "SLURM_PROCID": "0"}, available=have("torch")).master_port \
        == plan.master_port
    assert plan_launch({**SRUN, "SLURM_STEP_ID": "3"}, available=have("torch")).master_port \
        != plan.master_port


def test_srun_master_falls_back_to_launch_node_and_obeys_overrides() -> None:
    bare = {k: v for k, v in SRUN.items() if "NODELIST" not in k}
    assert plan_launch(bare, available=have("torch")).master_addr == "10.1.2.3"
    env = {**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "4242"}
    plan = plan_launch(env, available=have("torch"))
    assert (plan.master_addr, plan.master_port) == ("head", 4242)
    # SLURM_NTASKS when the step's own count is missing
    env = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_NUM_TASKS"}
    assert plan_launch(env, available=have("torch")).world_size == 8


def test_no_launcher_torch_plan_is_a_world_of_one() -> None:
    plan = plan_launch({}, "torch", available=EVERYTHING)
    assert (plan.launcher, plan.rank, plan.world_size, plan.local_rank) == (None, 0, 1, 0)


@pytest.mark.parametrize(
    ("env", "launcher"), [({}, None), (TORCHRUN, "torchrun"), (OPEN_MPI, "mpirun"),
                          (SRUN, "srun")],
)
@pytest.mark.parametrize("backend", ["torch", "mpi", "threads"])
def test_override_by_env_var_and_argument(
    env: dict[str, str], launcher: str | None, backend: str
) -> None:
    by_env = plan_launch({**env, "JOINKIT_BACKEND": backend}, available=EVERYTHING)
    assert (by_env.launcher, by_env.backend, by_env.chosen_by) == (
        launcher, backend, "JOINKIT_BACKEND")
    # The argument wins over the variable; both are case- and space-tolerant.
    other = next(b for b in ("torch", "mpi", "threads") if b != backend)
    by_arg = plan_launch({**env, "JOINKIT_BACKEND": other}, f" {backend.upper()} ",
                         available=EVERYTHING)
    assert (by_arg.backend, by_arg.chosen_by) == (backend, "argument")


def test_empty_env_var_means_unset() -> None:
    assert plan_launch({**OPEN_MPI, "JOINKIT_BACKEND": " "}, available=EVERYTHING).backend \
        == "mpi"


def test_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"JOINKIT_BACKEND='nccl' is not a joinkit backend: "
                                         r"use one of torch, mpi, threads"):
        plan_launch({"JOINKIT_BACKEND": "nccl"}, available=EVERYTHING)
    with pytest.raises(ValueError, match=r"backend='gloo' is not a joinkit backend"):
        plan_launch({}, "gloo", available=EVERYTHING)


@pytest.mark.parametrize(
    ("backend", "module", "extra"), [("mpi", "mpi4py", "mpi"), ("torch", "torch", "torch")]
)
def test_missing_library_says_what_to_install(backend: str, module: str, extra: str) -> None:
    nothing = have()
    with pytest.raises(ModuleNotFoundError) as caught:
        plan_launch({"JOINKIT_BACKEND": backend}, available=nothing)
    assert str(caught.value) == (
        f"JOINKIT_BACKEND={backend} but {module} is not installed: "
        f"pip install 'joinkit[{extra}]'"
    )
    assert caught.value.name == module
    with pytest.raises(ModuleNotFoundError, match=rf"backend='{backend}' but {module} is not "
                                                 rf"installed: pip install 'joinkit\[{extra}\]'"):
        plan_launch({}, backend, available=nothing)


def test_missing_library_of_the_launchers_choice() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"launched by mpirun.*mpi4py is not "
                                                 r"installed.*joinkit\[mpi\]"):
        plan_launch(OPEN_MPI, available=have("torch"))
    with pytest.raises(ModuleNotFoundError, match=r"launched by torchrun.*joinkit\[torch\]"):
        plan_launch(TORCHRUN, available=have("mpi4py"))
    with pytest.raises(ModuleNotFoundError, match=r"srun, and neither mpi4py nor torch"):
        plan_launch(SRUN, available=have())
    # threads needs nothing
    assert plan_launch({}, available=have()).backend == "threads"


def test_malformed_variables() -> None:
    with pytest.raises(ValueError, match=r"SLURM_PROCID='x' is not an integer"):
        plan_launch({**SRUN, "SLURM_PROCID": "x"}, available=have("torch"))


# -- the world that was built against the launcher's count ---------------------------

STEP_OF_ONE = {**SRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"}


@pytest.mark.parametrize(
    ("env", "size", "variable"),
    [
        ({}, None, None),
        (TORCHRUN, 4, "WORLD_SIZE"),
        (OPEN_MPI, 4, "OMPI_COMM_WORLD_SIZE"),
        (HYDRA, 4, "PMI_SIZE"),
        (MVAPICH, 2, "MV2_COMM_WORLD_SIZE"),
        (PMIX_ONLY, None, None),  # PMIx exports no size
        (SRUN, 8, "SLURM_STEP_NUM_TASKS"),
        ({k: v for k, v in SRUN.items() if k != "SLURM_STEP_NUM_TASKS"}, 8, "SLURM_NTASKS"),
        ({**SRUN, "SLURM_NTASKS": "16"}, 8, "SLURM_STEP_NUM_TASKS"),  # a step of the job
        (SBATCH_SCRIPT, None, None),  # the batch script is one process
        # Nested launchers: the innermost one's count.
        ({**SRUN, **TORCHRUN}, 4, "WORLD_SIZE"),
        ({**SBATCH_SCRIPT, **HYDRA}, 4, "PMI_SIZE"),
        ({**SRUN, "PMI_SIZE": "8", "PMI_RANK": "5"}, 8, "SLURM_STEP_NUM_TASKS"),
    ],
    ids=lambda value: "" if isinstance(value, dict) else str(value),
)
@pytest.mark.parametrize("backend", [None, "torch", "mpi", "threads"])
def test_launched_size_whatever_the_backend(
    env: dict[str, str], size: int | None, variable: str | None, backend: str | None
) -> None:
    plan = plan_launch(env, backend, available=EVERYTHING)
    assert (plan.launched_size, plan.launched_size_from) == (size, variable)


def test_launched_size_must_be_an_integer() -> None:
    with pytest.raises(ValueError, match=r"WORLD_SIZE='two' is not an integer"):
        plan_launch({**TORCHRUN, "WORLD_SIZE": "two"}, "mpi", available=EVERYTHING)


@pytest.mark.parametrize(
    ("env", "backend", "size"),
    [
        ({}, None, 1),
        ({}, "torch", 1),
        (SRUN, None, 8),  # srun --mpi=pmix: MPI sees every task
        (STEP_OF_ONE, None, 1),  # srun -n 1: a singleton is right
        (TORCHRUN, None, 4),
        (OPEN_MPI, None, 4),
        (HYDRA, "torch", 4),
        (PMIX_ONLY, None, 1),  # nothing to compare with
        # threads is a world of one by request, under any launcher
        (SRUN, "threads", 1),
        (TORCHRUN, "threads", 1),
        (OPEN_MPI, "threads", 1),
    ],
    ids=lambda value: "" if isinstance(value, dict) else str(value),
)
def test_a_world_that_matches_the_launcher_passes(
    env: dict[str, str], backend: str | None, size: int
) -> None:
    plan = plan_launch(env, backend, available=EVERYTHING)
    assert verify_world(plan, size, "the world", env, available=EVERYTHING) is None


def test_under_srun_an_mpi_world_of_one_falls_back_to_torch_from_slurm() -> None:
    # srun --mpi=none with mpi4py installed: MPI is a singleton on every task.
    plan = plan_launch(SRUN, available=EVERYTHING)
    assert (plan.backend, plan.chosen_by) == ("mpi", "launcher")
    fallback = verify_world(plan, 1, "MPI's COMM_WORLD", SRUN, available=EVERYTHING)
    assert fallback == attrs.evolve(plan_launch(SRUN, "torch", available=EVERYTHING),
                                    chosen_by="fallback")
    assert fallback is not None
    assert (fallback.backend, fallback.rank, fallback.world_size, fallback.local_rank) == (
        "torch", 5, 8, 1)
    assert (fallback.master_addr, fallback.launched_size) == ("gpu07", 8)
    # The fallback's own world is checked like any other.
    assert verify_world(fallback, 8, "torch", SRUN, available=EVERYTHING) is None


def _srun_mpi_fix() -> str:
    return (r"MPI is not wired to Slurm \(srun --mpi=none, or an MPI built without Slurm's "
            r"PMI support\), so every process is an MPI singleton\. Run srun --mpi=pmix \(or "
            r"--mpi=pmi2; srun --mpi=list shows what your Slurm offers\), or build the world "
            r"with torch\.distributed from the Slurm variables: JOINKIT_BACKEND=torch")


_OTHER_MPI = (r"the MPI library mpi4py uses is not the one whose launcher started this "
              r"process, so every process is an MPI singleton\. Launch with the mpiexec of "
              r"mpi4py's MPI")


@pytest.mark.parametrize(
    ("env", "backend", "available", "size", "message"),
    [
        # srun, but the user forced MPI: never swapped.
        ({**SRUN, "JOINKIT_BACKEND": "mpi"}, None, EVERYTHING, 1,
         r"^JOINKIT_BACKEND=mpi: MPI's COMM_WORLD has 1 rank, but srun started 8 tasks "
         r"\(SLURM_STEP_NUM_TASKS=8\): " + _srun_mpi_fix() + r"\.$"),
        (SRUN, "mpi", EVERYTHING, 1,
         r"^backend='mpi': MPI's COMM_WORLD has 1 rank, but srun started 8 tasks"),
        # joinkit chose MPI, but torch is not there to fall back to
        (SRUN, None, have("mpi4py"), 1,
         r"^MPI's COMM_WORLD has 1 rank, but srun started 8 tasks \(SLURM_STEP_NUM_TASKS=8\): "
         + _srun_mpi_fix() + r" \(torch is not installed: pip install 'joinkit\[torch\]'\)\.$"),
        # more than one rank but not all: not a missing PMI, so no guess
        (SRUN, None, EVERYTHING, 4,
         r"^MPI's COMM_WORLD has 4 ranks, but srun started 8 tasks \(SLURM_STEP_NUM_TASKS=8\)"),
        ({k: v for k, v in SRUN.items() if k != "SLURM_STEP_NUM_TASKS"}, "mpi", EVERYTHING, 1,
         r"but srun started 8 tasks \(SLURM_NTASKS=8\)"),
        # JOINKIT_BACKEND=mpi under torchrun
        ({**TORCHRUN, "JOINKIT_BACKEND": "mpi"}, None, EVERYTHING, 1,
         r"^JOINKIT_BACKEND=mpi: MPI's COMM_WORLD has 1 rank, but torchrun started 4 "
         r"processes \(WORLD_SIZE=4\): torchrun starts no MPI job, so every process is an "
         r"MPI singleton\. Unset JOINKIT_BACKEND \(torchrun's backend is torch\), or launch "
         r"with mpirun\.$"),
        # another MPI's launcher: Open MPI's, MPICH's/Intel's Hydra, MVAPICH's
        (OPEN_MPI, None, EVERYTHING, 1,
         r"^MPI's COMM_WORLD has 1 rank, but mpirun started 4 processes "
         r"\(OMPI_COMM_WORLD_SIZE=4\): " + _OTHER_MPI),
        (HYDRA, None, EVERYTHING, 1, r"started 4 processes \(PMI_SIZE=4\): " + _OTHER_MPI),
        (MVAPICH, None, EVERYTHING, 1,
         r"started 2 processes \(MV2_COMM_WORLD_SIZE=2\): " + _OTHER_MPI),
        (HYDRA, "torch", EVERYTHING, 1,
         r"^backend='torch': MPI's COMM_WORLD has 1 rank, but mpirun started 4 processes "
         r"\(PMI_SIZE=4\): under mpirun torch's rendezvous takes rank and size from MPI, "
         r"but the MPI library .* or set MASTER_ADDR and MASTER_PORT, and it takes "
         r"them from the launcher's variables instead\.$"),
        # torch.distributed initialised beforehand with another world
        (TORCHRUN, None, EVERYTHING, 1,
         r"^torch\.distributed's default group has 1 rank, but torchrun started 4 processes "
         r"\(WORLD_SIZE=4\): torch\.distributed was initialised before, with another world"),
        (STEP_OF_ONE, "torch", EVERYTHING, 2,
         r"has 2 ranks, but srun started 1 task \(SLURM_STEP_NUM_TASKS=1\)"),
    ],
    ids=lambda value: "" if isinstance(value, (dict, str)) or callable(value) else str(value),
)
def test_a_world_that_disagrees_with_the_launcher_names_both_sizes_and_the_fix(
    env: dict[str, str], backend: str | None, available: Callable[[str], bool], size: int,
    message: str,
) -> None:
    plan = plan_launch(env, backend, available=available)
    built = "MPI's COMM_WORLD" if plan.backend == "mpi" or plan.launcher == "mpirun" \
        else "torch.distributed's default group"
    with pytest.raises(RuntimeError, match=message):
        verify_world(plan, size, built, env, available=available)


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node01", "node01"),
        ("node01,node02", "node01"),
        ("node[07-09,12]", "node07"),
        ("node[007-009]", "node007"),
        ("gpu[3,5-6],cpu[1-2]", "gpu3"),
        ("rack[1-2]-node[01-04]", "rack1-node01"),
        ("node[01-04]-ib,login1", "node01-ib"),
    ],
)
def test_first_host(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


# -- the world of one ----------------------------------------------------------------


def test_init_without_launcher_is_a_world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # Even when the test suite itself runs under a launcher.
    for key in list(os.environ):
        if key.startswith(LAUNCHER_PREFIXES) or key in TORCH_VARIABLES:
            monkeypatch.delenv(key)
    group = backends.init()
    assert (group.rank, group.world_size) == (0, 1)
    assert isinstance(group, backends.CollectiveGroup)
    assert backends.resolve(group) is group
    monkeypatch.setenv("JOINKIT_BACKEND", "threads")
    assert backends.init().world_size == 1


def test_solo_group_collectives() -> None:
    group = solo_group()
    buf = np.arange(3)
    for op in backends.REDUCE_OPS:
        assert group.all_reduce(buf, op) is buf
        assert group.reduce(buf, 0, op, async_op=True).wait() is buf
    with pytest.raises(ValueError, match="unknown reduce op"):
        group.all_reduce(buf, "mean")
    # The checks of every backend (backends._checks):
    with pytest.raises(TypeError, match="op 'band' is not defined for dtype float64"):
        group.all_reduce(np.ones(3), "band")
    with pytest.raises(ValueError, match="scatter: needs 1 chunks"):
        group.scatter(np.ones(3), 0, chunks=[np.ones(3)] * 2)
    buf = np.arange(3.0)
    assert group.broadcast(buf, 0) is buf
    with pytest.raises(ValueError, match="not a rank"):
        group.broadcast(buf, 1)
    (part,) = group.all_gather(buf)
    assert part is not buf and np.array_equal(part, buf)
    (part,) = group.gather(buf, 0, async_op=True).wait()
    assert np.array_equal(part, buf)
    out = np.zeros(3)
    assert group.scatter(out, 0, chunks=[np.ones(3)]) is out
    assert np.array_equal(out, np.ones(3))
    assert group.scatter(out, 0, chunks=np.full((1, 3), 2.0)) is out
    assert np.array_equal(out, np.full(3, 2.0))
    group.barrier()
    assert group.heartbeat(1.0).wait() == 1.0
    assert group.count(0.0) == 0.0
    assert group.all_gather_object("x") == ["x"]


def test_solo_group_runs_a_join() -> None:
    from joinkit import Join

    examples = str(Path(__file__).resolve().parents[3] / "examples")
    sys.path.insert(0, examples)
    try:
        import counter
    finally:
        sys.path.remove(examples)

    group = solo_group()
    c = counter.Counter(group)
    with Join([c], sync_max_count=True):
        for _ in range(3):
            c()
    assert (c.count[0], c.max_count[0]) == (3.0, 3.0)


def test_plan_is_frozen() -> None:
    plan = plan_launch({}, available=EVERYTHING)
    with pytest.raises(AttributeError):
        plan.backend = "mpi"  # type: ignore[misc]


def test_a_ray_train_worker_plans_torch_from_ray_trains_variables() -> None:
    plan = plan_launch(RAY_TRAIN, available=EVERYTHING)
    assert (plan.launcher, plan.backend, plan.chosen_by) == ("ray", "torch", "launcher")
    assert (plan.rank, plan.world_size, plan.local_rank) == (1, 2, 1)
    assert (plan.master_addr, plan.master_port) == ("192.0.2.2", 43105)
    assert (plan.launched_size, plan.launched_size_from) == (2, "WORLD_SIZE")


def test_mpi_forced_in_a_ray_train_worker_names_the_fix() -> None:
    plan = plan_launch({**RAY_TRAIN, "JOINKIT_BACKEND": "mpi"}, available=EVERYTHING)
    with pytest.raises(RuntimeError, match="Ray Train starts no MPI job"):
        verify_world(plan, 1, "MPI's COMM_WORLD")
