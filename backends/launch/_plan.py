"""From "whatever launched this process" to a world group.

Theory of operation
-------------------
:func:`init` answers one question per process: which collective library
connects me to my peers, and who are they? It does so in three steps.

1. :func:`plan_launch` is pure: from an environment mapping, the requested
   backend and a way to ask whether a library is importable, it returns a
   frozen :class:`LaunchPlan`: the launcher, the backend and, when the
   environment tells them, rank, world size, local rank and the torch
   rendezvous address. It reads no global state, so every launcher is unit
   tested with a faked environment.
2. :func:`init` and :func:`init_torch` carry the plan out: build an
   ``MPIGroup`` over ``COMM_WORLD``, initialise ``torch.distributed`` and wrap
   it in a ``TorchGroup``, or return a world of one.
3. :func:`verify_world` (pure) compares the size of the world that was built
   with the number of processes the launcher says it started
   (``LaunchPlan.launched_size``: ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``,
   ``WORLD_SIZE``, ``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE``,
   ``MV2_COMM_WORLD_SIZE``). They disagree when a library cannot see the
   launcher: mpi4py under ``srun --mpi=none`` or under torchrun, or under
   another MPI's mpirun, is an MPI *singleton* on every process, and each
   process would train alone and exit 0. One disagreement has a remedy that
   is certainly right, and is taken unless the user forced the backend:
   under srun, MPI's world of one is replaced by torch.distributed built from
   the Slurm variables. Every other one is a ``RuntimeError`` naming both
   sizes and the fix (``_WORLD_FIXES``). ``threads`` is a world of one by
   request and is not compared.

The backend is, first match wins: the ``backend=`` argument, the
``JOINKIT_BACKEND`` environment variable (``torch``, ``mpi``, ``threads``), or
the launcher's natural choice::

    torchrun          -> torch (env:// rendezvous, set up by torchrun)
    mpirun / mpiexec  -> mpi   (Open MPI, MPICH/Hydra, MVAPICH, PMIx)
    srun (Slurm)      -> mpi if mpi4py is importable, else torch from the
                         Slurm variables
    ray (Ray Train)   -> torch: a TorchTrainer's training function already
                         has its default group; a subprocess of a worker
                         joins the other workers' subprocesses through the
                         store the rank-0 worker serves at MASTER_PORT
    nothing           -> threads: a world of one in this process

A requested backend whose library is missing is an ``ImportError`` that says
what to install; nothing is silently swapped for something else (the srun
fallback above is announced with a ``RuntimeWarning`` on task 0).

torch under mpirun: MPI already knows rank and world size, so
:func:`init_torch` takes them from ``COMM_WORLD``; rank 0 opens torch's
``TCPStore`` on a port the kernel picks (no race between choosing a free port
and binding it) and broadcasts ``(address, port)`` over MPI; the other ranks
connect to it. The address is one the other nodes can reach
(``_network.rendezvous_address``: ``MASTER_ADDR``, loopback on one node, else
the address gloo binds or the default route's, not the host name, which
another node may not resolve), and every rank checks that it connects within
``JOINKIT_RENDEZVOUS_TIMEOUT`` (30 s) before torch retries for minutes: if one
cannot, every rank raises an error naming the address and why it was chosen.
Under Slurm without MPI there is nobody to ask, so the address
is the first host of the step (where task 0 runs) and the port is derived from
the job and step ids, unless ``MASTER_ADDR``/``MASTER_PORT`` are set; in a
subprocess of a Ray Train worker the port is taken (the rank-0 worker's own
process group store listens there), so every rank connects to that store as a
client and builds its world under a fresh key prefix (``_ray_worker_store``);
a rank 0 that cannot listen on a taken ``MASTER_PORT`` raises an error saying
so (``_port_taken``), not torch's bare ``EADDRINUSE``; a first
host that does not resolve is an error after that timeout too. Before gloo
starts on a world that spans nodes, a ``RuntimeWarning`` says so if gloo would
bind loopback (``_network.gloo_interface``). After
initialising, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` are exported when absent, so scripts written for torchrun (a
``LOCAL_RANK`` lookup for the device) run unchanged under mpirun and srun.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import re
import socket
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import attrs

from joinkit.lowlevel import register_backend as register

from .._checks import Checks, host_array, write_back
from .._detect import detect_launcher
from ._network import (
    DEFAULT_RENDEZVOUS_TIMEOUT,
    HostFacts,
    gloo_interface,
    host_facts,
    probe_tcp,
    rendezvous_address,
    world_spans_nodes,
)

__all__ = [
    "BACKENDS",
    "LaunchPlan",
    "plan_launch",
    "verify_world",
    "init",
    "init_torch",
    "abort_on_unhandled_exception",
    "first_host",
    "solo_group",
]

#: The values ``JOINKIT_BACKEND`` and ``backend=`` accept.
BACKENDS = ("torch", "mpi", "threads")

ENV_VAR = "JOINKIT_BACKEND"
RENDEZVOUS_TIMEOUT_VAR = "JOINKIT_RENDEZVOUS_TIMEOUT"

# backend -> (module that must be importable, pip extra)
_LIBRARIES = {"torch": ("torch", "torch"), "mpi": ("mpi4py", "mpi")}

# Rank / size / local rank variables of MPI launchers, in lookup order.
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "PMIX_RANK")
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
# Where each launcher says how many processes it started, in lookup order
# (a PMIx-only launcher exports no size: nothing to compare with).
_LAUNCHED_SIZE_VARS: dict[str | None, tuple[str, ...]] = {
    "torchrun": ("WORLD_SIZE",),
    "mpirun": _MPI_SIZE_VARS,
    "srun": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
    "ray": ("WORLD_SIZE",),
    None: (),
}
_MPI_LOCAL_RANK_VARS = (
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
)

_DEFAULT_STORE_TIMEOUT = timedelta(minutes=5)


@attrs.frozen(kw_only=True)
class LaunchPlan:
    """What this process should do to join its world.

    Attributes:
        launcher: what :func:`backends.detect_launcher` found (``None``: nothing).
        backend: one of :data:`BACKENDS`.
        chosen_by: ``"argument"``, ``"JOINKIT_BACKEND"``, ``"launcher"``,
            ``"init_torch"`` (:func:`init_torch`'s plan), or ``"fallback"``
            (the launcher's choice built a world that disagreed with the
            launcher, and this plan replaces it; see :func:`verify_world`).
        rank, world_size, local_rank: from the environment when it tells them
            (``None`` otherwise; MPI then knows them).
        master_addr, master_port: the torch rendezvous, when the environment
            fixes it.
        launched_size: how many processes the launcher says it started
            (``None``: it does not say), whatever the backend; the world
            that is built must have this size.
        launched_size_from: the variable that said so, e.g. ``"SLURM_NTASKS"``.
        rendezvous_timeout: seconds a rank tries to reach (under srun: to
            resolve) the torch rendezvous address before it raises an error
            naming it; ``JOINKIT_RENDEZVOUS_TIMEOUT``, default 30.
    """

    launcher: str | None
    backend: str
    chosen_by: str
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    launched_size: int | None = None
    launched_size_from: str | None = None
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def plan_launch(
    environ: Mapping[str, str] | None = None,
    backend: str | None = None,
    available: Callable[[str], bool] = _importable,
) -> LaunchPlan:
    """Decide the backend and read the world from the environment (pure).

    Args:
        environ: the environment; ``None`` means ``os.environ``.
        backend: the explicitly requested backend, or ``None``.
        available: ``available(module)`` tells whether a library is importable.

    Returns:
        The :class:`LaunchPlan`.

    Raises:
        ValueError: the requested backend is not one of :data:`BACKENDS`, or
            the launcher's variables are malformed.
        ModuleNotFoundError: the backend's library is not installed.
    """
    env = os.environ if environ is None else environ
    launcher = detect_launcher(env)
    requested, chosen_by = backend, "argument"
    if requested is None and env.get(ENV_VAR, "").strip():
        requested, chosen_by = env[ENV_VAR], ENV_VAR
    if requested is not None:
        choice = requested.strip().lower()
        if choice not in BACKENDS:
            where = f"{ENV_VAR}={requested!r}" if chosen_by == ENV_VAR else f"backend={requested!r}"
            raise ValueError(
                f"{where} is not a joinkit backend: use one of {', '.join(BACKENDS)}"
            )
    else:
        chosen_by = "launcher"
        choice = _natural_backend(launcher, available)
    _require_library(choice, chosen_by, launcher, available)

    fields: dict[str, Any] = {}
    if choice == "torch":
        fields = _torch_world(env, launcher)
    elif choice == "mpi" and launcher == "mpirun":
        fields = _mpi_world(env)
    for name in _LAUNCHED_SIZE_VARS[launcher]:
        if name in env:
            fields.update(launched_size=_int(env, name), launched_size_from=name)
            break
    if env.get(RENDEZVOUS_TIMEOUT_VAR, "").strip():
        fields["rendezvous_timeout"] = _seconds(env, RENDEZVOUS_TIMEOUT_VAR)
    return LaunchPlan(launcher=launcher, backend=choice, chosen_by=chosen_by, **fields)


def _natural_backend(launcher: str | None, available: Callable[[str], bool]) -> str:
    if launcher in ("torchrun", "ray"):
        return "torch"
    if launcher == "mpirun":
        return "mpi"
    if launcher == "srun":
        # An MPI library under srun (PMI/PMIx) needs no rendezvous address.
        return "mpi" if available("mpi4py") else "torch"
    return "threads"


def _require_library(
    choice: str, chosen_by: str, launcher: str | None, available: Callable[[str], bool]
) -> None:
    if choice not in _LIBRARIES:
        return
    module, extra = _LIBRARIES[choice]
    if available(module):
        return
    install = f"pip install 'joinkit[{extra}]'"
    if chosen_by == ENV_VAR:
        message = f"{ENV_VAR}={choice} but {module} is not installed: {install}"
    elif chosen_by == "argument":
        message = f"backend={choice!r} but {module} is not installed: {install}"
    else:
        message = (
            f"this process was launched by {launcher}, which joinkit runs on "
            f"{module}, but {module} is not installed: {install}, or choose "
            f"another backend with {ENV_VAR}"
        )
        if launcher == "srun":
            message = (
                "this process was launched by srun, and neither mpi4py nor torch "
                "is installed: pip install 'joinkit[mpi]' or 'joinkit[torch]'"
            )
    raise ModuleNotFoundError(message, name=module)


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not an integer") from None


def _seconds(env: Mapping[str, str], name: str) -> float:
    try:
        value = float(env[name])
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}={env[name]!r} is not a number of seconds greater than 0")
    return value


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if name in env:
            return _int(env, name)
    return None


def _torch_world(env: Mapping[str, str], launcher: str | None) -> dict[str, Any]:
    """The torch rendezvous fields the environment fixes, per launcher."""
    fields: dict[str, Any] = {}
    if launcher in ("torchrun", "ray"):
        fields = {
            "rank": _first_int(env, ("RANK",)),
            "world_size": _first_int(env, ("WORLD_SIZE",)),
            "local_rank": _first_int(env, ("LOCAL_RANK",)),
        }
    elif launcher == "srun":
        job = env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", "0"))
        step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))
        fields = {
            "rank": _int(env, "SLURM_PROCID"),
            "world_size": _first_int(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")),
            "local_rank": _first_int(env, ("SLURM_LOCALID",)) or 0,
            "master_addr": _slurm_master_addr(env),
            "master_port": _slurm_port(job, step),
        }
    elif launcher == "mpirun":
        fields = _mpi_world(env)
    elif launcher is None:
        fields = {"rank": 0, "world_size": 1, "local_rank": 0}
    # Explicit settings win over what the launcher implies.
    if "MASTER_ADDR" in env:
        fields["master_addr"] = env["MASTER_ADDR"]
    if "MASTER_PORT" in env:
        fields["master_port"] = _int(env, "MASTER_PORT")
    return fields


def _mpi_world(env: Mapping[str, str]) -> dict[str, Any]:
    return {
        "rank": _first_int(env, _MPI_RANK_VARS),
        "world_size": _first_int(env, _MPI_SIZE_VARS),
        "local_rank": _first_int(env, _MPI_LOCAL_RANK_VARS),
    }


def _slurm_master_addr(env: Mapping[str, str]) -> str | None:
    # Task 0 runs on the first node of the step. SLURM_LAUNCH_NODE_IPADDR is
    # where srun ran: the same node inside sbatch, but a login node (where no
    # task runs) for an interactive srun, so it is only the last resort.
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            return first_host(env[name])
    return env.get("SLURM_LAUNCH_NODE_IPADDR")


def _slurm_port(job: str, step: str) -> int:
    # Both ends derive the same port with no communication; the job and step
    # ids spread concurrent steps on one node over 20000..59999.
    try:
        return 20000 + (int(job) * 97 + int(step)) % 40000
    except ValueError:
        return 29500


_BRACKET = re.compile(r"\[([^\]]*)\]")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist such as ``"node[07-09,12],gpu1"``.

    Args:
        nodelist: a (possibly compressed) Slurm hostlist.

    Returns:
        Its first host name (``"node07"``); zero padding is kept.
    """
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    # In each bracket keep the first item, and of a range its start.
    return _BRACKET.sub(lambda m: m.group(1).split(",")[0].split("-")[0], first)


# -- the world that was built against the launcher's -----------------------------

_SINGLETONS = "so every process is an MPI singleton"
_OTHER_MPI = (
    "the MPI library mpi4py uses is not the one whose launcher started this "
    f"process, {_SINGLETONS}. Launch with the mpiexec of mpi4py's MPI (python -c "
    "'import mpi4py; print(mpi4py.get_config())' names it), or install an mpi4py "
    "built against this launcher's MPI"
)
# (launcher, backend) -> the fix an error names when the world that was built
# disagrees with the launcher's count. A pair not listed disagrees only when
# torch.distributed was initialised beforehand with another world.
_WORLD_FIXES: dict[tuple[str | None, str], str] = {
    ("srun", "mpi"): (
        "MPI is not wired to Slurm (srun --mpi=none, or an MPI built without "
        f"Slurm's PMI support), {_SINGLETONS}. Run srun --mpi=pmix (or "
        "--mpi=pmi2; srun --mpi=list shows what your Slurm offers), or build the "
        f"world with torch.distributed from the Slurm variables: {ENV_VAR}=torch"
    ),
    ("torchrun", "mpi"): (
        f"torchrun starts no MPI job, {_SINGLETONS}. Unset {ENV_VAR} (torchrun's "
        "backend is torch), or launch with mpirun"
    ),
    ("ray", "mpi"): (
        f"Ray Train starts no MPI job, {_SINGLETONS}. Unset {ENV_VAR} (a Ray Train "
        "worker's backend is torch: TorchTrainer initialises torch.distributed)"
    ),
    ("mpirun", "mpi"): _OTHER_MPI,
    ("mpirun", "torch"): (
        f"under mpirun torch's rendezvous takes rank and size from MPI, but "
        f"{_OTHER_MPI}; or set MASTER_ADDR and MASTER_PORT, and it takes them "
        "from the launcher's variables instead"
    ),
}
_TORCH_INITIALISED_BEFORE = (
    "torch.distributed was initialised before, with another world: initialise it "
    "for the launcher's world, or leave it to backends.init()/init_torch()"
)
# (launcher, backend the launcher chose) -> the backend that matches the
# launcher when the choice built a world of one.
_FALLBACKS: dict[tuple[str | None, str], str] = {("srun", "mpi"): "torch"}


def verify_world(
    plan: LaunchPlan,
    size: int,
    built: str,
    environ: Mapping[str, str] | None = None,
    available: Callable[[str], bool] = _importable,
) -> LaunchPlan | None:
    """Compare the world that was built with the launcher's count (pure).

    Under srun, when joinkit chose MPI and MPI built a world of one while
    Slurm started more tasks, the answer is the plan that builds the world
    with torch.distributed from the Slurm variables instead. A backend the
    user forced is never replaced.

    Args:
        plan: the plan that was carried out.
        size: the world size of what it built.
        built: what it built, for the message (``"MPI's COMM_WORLD"``).
        environ: the environment a fallback plan is read from; ``None`` means
            ``os.environ``.
        available: ``available(module)`` tells whether a library is importable.

    Returns:
        ``None`` when the sizes agree, the launcher gives no count, or the
        backend is ``threads`` (a world of one by request); else the plan to
        carry out instead.

    Raises:
        RuntimeError: the sizes disagree and nothing else matches; the message
            names both sizes, the variable that gave the launcher's, and the fix.
    """
    expected = plan.launched_size
    if plan.backend == "threads" or expected is None or size == expected:
        return None
    key = (plan.launcher, plan.backend)
    fallback = _FALLBACKS.get(key)
    fallback_installed = fallback is not None and available(_LIBRARIES[fallback][0])
    if fallback is not None and fallback_installed and plan.chosen_by == "launcher" \
            and size == 1:
        env = os.environ if environ is None else environ
        return attrs.evolve(plan_launch(env, fallback, available), chosen_by="fallback")
    forced = {ENV_VAR: f"{ENV_VAR}={plan.backend}: ",
              "argument": f"backend={plan.backend!r}: "}.get(plan.chosen_by, "")
    fix = _WORLD_FIXES.get(key, _TORCH_INITIALISED_BEFORE)
    if fallback is not None and not fallback_installed:
        module, extra = _LIBRARIES[fallback]
        fix += f" ({module} is not installed: pip install 'joinkit[{extra}]')"
    ranks = "rank" if size == 1 else "ranks"
    if plan.launcher == "srun":
        processes = "task" if expected == 1 else "tasks"
    else:
        processes = "process" if expected == 1 else "processes"
    raise RuntimeError(
        f"{forced}{built} has {size} {ranks}, but {plan.launcher} started {expected} "
        f"{processes} ({plan.launched_size_from}={expected}): {fix}."
    )


# -- carrying the plan out ------------------------------------------------------


def init(backend: str | None = None) -> Any:
    """The world group of whatever launched this process.

    Args:
        backend: ``"torch"``, ``"mpi"`` or ``"threads"`` to override the
            launcher's choice (so does the ``JOINKIT_BACKEND`` variable; the
            argument wins). ``"threads"`` gives a world of one.

    For the MPI backend it also makes an unhandled exception abort the MPI
    job (see :func:`abort_on_unhandled_exception`), so one failing rank does
    not leave the others hanging.

    The world that is built must have as many ranks as the launcher started
    processes (see :func:`verify_world`). Under srun, if joinkit chose MPI
    and MPI sees a world of one (no PMI: ``srun --mpi=none``), the world is
    built with torch.distributed from the Slurm variables instead, with a
    ``RuntimeWarning`` on task 0.

    Returns:
        A :class:`backends.CollectiveGroup`: a ``TorchGroup`` over the default
        process group (initialised if needed), an ``MPIGroup`` over
        ``COMM_WORLD``, or a single-rank group.

    Raises:
        ValueError: unknown backend name.
        ModuleNotFoundError: the backend's library is not installed.
        RuntimeError: the torch rendezvous failed, or the world that was built
            disagrees with the launcher (the message names both sizes and the
            fix).
    """
    plan = plan_launch(os.environ, backend)
    if plan.backend == "mpi":
        from ..mpi import MPIGroup

        group = MPIGroup()
        fallback = verify_world(plan, group.world_size, "MPI's COMM_WORLD")
        if fallback is None:
            abort_on_unhandled_exception()
            return group
        if fallback.rank == 0:
            warnings.warn(
                f"{plan.launcher} started {plan.launched_size} tasks "
                f"({plan.launched_size_from}={plan.launched_size}), but MPI's "
                "COMM_WORLD has 1 rank: MPI is not wired to Slurm (srun "
                "--mpi=none?). joinkit builds the world with torch.distributed "
                "from the Slurm variables instead. srun --mpi=pmix (or pmi2) gives "
                f"MPI; {ENV_VAR}=torch chooses torch without this warning.",
                RuntimeWarning,
                stacklevel=2,
            )
        plan = fallback
    if plan.backend == "torch":
        return _init_torch(plan, None, None)
    return solo_group()


def init_torch(
    dist_backend: str | None = None, timeout: timedelta | None = None
) -> Any:
    """Initialise ``torch.distributed`` from any launcher; return the world group.

    Under torchrun this is ``env://``; under mpirun rank and world size come
    from MPI and rank 0 broadcasts the rendezvous address over MPI (an
    address the other nodes reach: ``MASTER_ADDR``, else the address gloo
    binds or the default route's); under srun they come from the Slurm
    variables; without a launcher the world is this one process. Already
    initialised: just wrap the default group.

    With gloo on a world that spans nodes, a ``RuntimeWarning`` comes first
    when gloo would bind a loopback address, which no other node can reach
    (see :func:`joinkit.backends.gloo_interface`; set ``GLOO_SOCKET_IFNAME``).

    Args:
        dist_backend: torch's backend name; default ``"nccl"`` when CUDA is
            available, else ``"gloo"``.
        timeout: the process group's (and rendezvous store's) timeout.

    Returns:
        A ``backends.torch_dist.TorchGroup`` over the default process group.

    Raises:
        ModuleNotFoundError: torch (or, under mpirun without
            ``MASTER_ADDR``/``MASTER_PORT``, mpi4py) is not installed.
        RuntimeError: the rendezvous failed (under mpirun: a rank cannot
            connect to rank 0's store within ``JOINKIT_RENDEZVOUS_TIMEOUT``
            seconds, default 30; under srun: the address does not resolve
            within it; the message names the address), or the world disagrees
            with the launcher (under mpirun: MPI sees another world size than
            the launcher's variables, and ``MASTER_ADDR``/``MASTER_PORT`` are
            not set; or torch.distributed was initialised before with another
            world).
    """
    plan = attrs.evolve(plan_launch(os.environ, "torch"), chosen_by="init_torch")
    return _init_torch(plan, dist_backend, timeout)


def _init_torch(plan: LaunchPlan, dist_backend: str | None, timeout: timedelta | None) -> Any:
    from .. import torch_dist

    if torch_dist.is_initialized():
        group = torch_dist.TorchGroup()
        verify_world(plan, group.world_size, "torch.distributed's default group")
        return group
    if dist_backend is None:
        dist_backend = torch_dist.default_backend_name()
    store_timeout = timeout or _DEFAULT_STORE_TIMEOUT

    if plan.launcher == "mpirun" and _importable("mpi4py"):
        # Before the rendezvous: a rank that fails there must end the job,
        # not leave the others waiting for it.
        abort_on_unhandled_exception()
    try:
        where = _rendezvous(plan, store_timeout)
        if dist_backend == "gloo":
            _warn_if_gloo_cannot_reach_other_nodes(where.spans_nodes)
        # A store of None: torchrun's agent already serves the store at MASTER_PORT.
        torch_dist.init_default_group(dist_backend, where.rank, where.world_size,
                                      where.local_rank, where.store, timeout)
    except RuntimeError as error:  # torch's DistNetworkError is one
        if not _is_port_taken(error):
            raise
        raise RuntimeError(_port_taken(plan)) from error
    # We created the group, so we tear it down at exit, once the torch
    # backend's exit guard has settled its collectives (torch_dist's module doc).
    atexit.register(torch_dist.destroy_default_group)
    if plan.launcher in ("mpirun", "srun"):
        _export_torchrun_env(where)
    return torch_dist.TorchGroup()


def _warn_if_gloo_cannot_reach_other_nodes(spans_nodes: bool | None) -> None:
    """Warn before gloo binds loopback in a world that spans nodes (it then hangs)."""
    if spans_nodes is None:
        spans_nodes = world_spans_nodes(os.environ)
    if not spans_nodes:
        return  # one node: loopback is fine, and nothing to look up
    found = gloo_interface(os.environ, spans_nodes=True)
    if found.warning is not None:
        warnings.warn(found.warning, RuntimeWarning, stacklevel=4)


@attrs.frozen(kw_only=True)
class _Rendezvous:
    """Where this rank meets the others; ``store`` is ``None`` for ``env://``.

    ``spans_nodes``: whether the ranks run on more than one node, when the
    rendezvous learnt it (under mpirun: the ranks' host names); ``None``: ask
    the launcher's variables.
    """

    rank: int
    world_size: int
    local_rank: int
    addr: str | None = None
    port: int | None = None
    store: Any = None
    spans_nodes: bool | None = None


def _rendezvous(plan: LaunchPlan, store_timeout: timedelta) -> _Rendezvous:
    """Carry out the plan's torch rendezvous (opening stores: not pure)."""
    from .. import torch_dist

    if plan.launcher == "mpirun" and _importable("mpi4py"):
        from .. import mpi

        size = mpi.world_size()
        if size == (plan.launched_size or size):
            return _mpi_rendezvous(plan, store_timeout)
        if plan.master_addr is None or plan.master_port is None or plan.rank is None:
            verify_world(plan, size, "MPI's COMM_WORLD")  # raises: no fallback
        # Else MPI cannot see this launcher, but its variables and
        # MASTER_ADDR/MASTER_PORT give the whole rendezvous (below).
    if plan.launcher == "mpirun" and (plan.master_addr is None or plan.master_port is None):
        raise ModuleNotFoundError(
            "init_torch under mpirun agrees on the rendezvous through MPI, but "
            "mpi4py is not installed: pip install 'joinkit[mpi]', or set "
            "MASTER_ADDR and MASTER_PORT",
            name="mpi4py",
        )
    if plan.launcher is None:
        return _Rendezvous(rank=0, world_size=1, local_rank=0, store=torch_dist.hash_store())
    rank, world_size = plan.rank, plan.world_size
    addr, port = plan.master_addr, plan.master_port
    missing = [name for name, value in (("rank", rank), ("world size", world_size),
                                        ("MASTER_ADDR", addr), ("MASTER_PORT", port))
               if value is None]
    if missing or rank is None or world_size is None or addr is None or port is None:
        raise RuntimeError(
            f"cannot initialise torch.distributed under {plan.launcher}: the "
            f"environment does not give {', '.join(missing)}"
        )
    where = _Rendezvous(rank=rank, world_size=world_size, local_rank=plan.local_rank or 0,
                        addr=addr, port=port)
    if plan.launcher == "torchrun":
        return where
    if plan.launcher == "ray":
        return attrs.evolve(where, store=_ray_worker_store(where, plan, store_timeout))
    if rank != 0:
        # Rank 0 may still be starting, so a refused connection is no error yet
        # (the store's timeout covers it); but a name that does not resolve
        # would be retried with a warning every few seconds until then.
        _require_resolvable(addr, port, plan)
    store = torch_dist.tcp_store(addr, port, world_size, rank == 0, store_timeout,
                                 wait_for_workers=False)
    return attrs.evolve(where, store=store)


#: The key prefix under which subprocesses of Ray Train workers build their worlds
#: in the rank-0 worker's store; a counter per rank numbers the worlds.
_RAY_SUBPROCESS_PREFIX = "joinkit/ray-worker-subprocess"


def _ray_worker_store(where: _Rendezvous, plan: LaunchPlan, store_timeout: timedelta) -> Any:
    """A world for subprocesses of Ray Train workers, in the store Ray Train opened.

    Ray Train's rank-0 worker process serves its process group's TCPStore at
    ``MASTER_ADDR:MASTER_PORT`` while the training function runs, so the port
    cannot be bound again (torch's ``env://`` would fail with ``EADDRINUSE`` on
    rank 0 and leave the others waiting). Every rank connects as a client
    instead, within ``plan.rendezvous_timeout``, and the world lives under a
    prefix numbered by how many such worlds this rank made before: the n-th
    subprocess world of each rank meets the n-th of the others, and never a
    stale one's keys.
    """
    from .. import torch_dist

    assert where.addr is not None and where.port is not None
    failure = probe_tcp(where.addr, where.port, plan.rendezvous_timeout)
    if failure is not None:
        raise RuntimeError(
            "cannot initialise torch.distributed in this subprocess of a Ray Train "
            f"worker (rank {where.rank}): the store of the workers' process group at "
            f"MASTER_ADDR:MASTER_PORT={where.addr}:{where.port}, which Ray Train's rank-0 "
            f"worker serves while its training function runs, does not answer within "
            f"{plan.rendezvous_timeout:g} s: {failure}. Call it from the training function "
            "(torch.distributed is initialised there), or while it runs "
            f"({RENDEZVOUS_TIMEOUT_VAR} sets how long to try)."
        )
    store = torch_dist.tcp_store(where.addr, where.port, where.world_size, False, store_timeout)
    number = int(store.add(f"{_RAY_SUBPROCESS_PREFIX}/rank{where.rank}", 1))
    return torch_dist.prefix_store(f"{_RAY_SUBPROCESS_PREFIX}/{number}/", store)


_PORT_TAKEN = ("EADDRINUSE", "address already in use")


def _is_port_taken(error: BaseException) -> bool:
    text = str(error).lower()
    return any(marker.lower() in text for marker in _PORT_TAKEN)


def _port_taken(plan: LaunchPlan) -> str:
    """The error rank 0 raises when it cannot listen on the rendezvous port."""
    port = plan.master_port if plan.master_port is not None else "?"
    addr = plan.master_addr if plan.master_addr is not None else "?"
    ray = (" This process runs under Ray (RAY_RAYLET_PID is set): Ray Train's rank-0 "
           "worker serves its own process group's store on MASTER_PORT; call "
           "backends.init_torch() inside the training function, where torch.distributed "
           "is initialised already.") if "RAY_RAYLET_PID" in os.environ else ""
    return (
        f"cannot initialise torch.distributed under {plan.launcher or 'no launcher'}: rank "
        f"{plan.rank if plan.rank is not None else '?'} must listen for the rendezvous on "
        f"MASTER_PORT={port} "
        f"(MASTER_ADDR={addr}), but another process already holds that port "
        f"(EADDRINUSE).{ray} Set MASTER_PORT to a free port, or end the process that "
        "holds it."
    )


def _require_resolvable(addr: str, port: int, plan: LaunchPlan) -> None:
    deadline = time.monotonic() + plan.rendezvous_timeout
    while True:
        try:
            socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
            return
        except OSError as exc:
            error = exc
        if time.monotonic() + 1 >= deadline:
            break
        time.sleep(1)
    source = "MASTER_ADDR" if "MASTER_ADDR" in os.environ else (
        "the step's first node (SLURM_STEP_NODELIST)" if plan.launcher == "srun"
        else "the launcher")
    raise RuntimeError(
        f"cannot initialise torch.distributed under {plan.launcher}: the rendezvous "
        f"address {addr!r} (from {source}) does not resolve on {socket.gethostname()} "
        f"after {plan.rendezvous_timeout:g} s ({error}). Set MASTER_ADDR to an address "
        f"of the node of rank 0 that every node resolves ({RENDEZVOUS_TIMEOUT_VAR} "
        "sets how long to try)."
    )


# rendezvous_address needs no facts when MASTER_ADDR is set or all ranks share a node.
_NO_FACTS = HostFacts(hostname="")


def _mpi_rendezvous(plan: LaunchPlan, store_timeout: timedelta) -> _Rendezvous:
    """Rank, size and local rank from MPI; a TCPStore whose address rank 0 sent.

    Rank 0 opens the store (it listens on every interface) and broadcasts an
    address the others can reach (:func:`rendezvous_address`: ``MASTER_ADDR``,
    loopback on one node, else the address gloo binds or the default route's);
    every other rank first checks that it can connect there within
    ``plan.rendezvous_timeout``. If one cannot, every rank raises the same
    error, naming the address, why it was chosen and what failed, instead of
    retrying until the store's timeout.
    """
    from .. import mpi, torch_dist

    rank, world_size, local_rank, hosts = mpi.world_layout(socket.gethostname())
    one_node = len(set(hosts)) == 1
    store = None
    answer: tuple[str | None, int | None, str, bool, str | None] = (None, None, "", False, None)
    if rank == 0:
        try:
            chosen = rendezvous_address(
                plan.master_addr, one_node,
                host_facts() if not (plan.master_addr or one_node) else _NO_FACTS,
            )
            # The store listens on every interface whatever its host argument,
            # which only says where rank 0's own client connects: loopback
            # always works for that, even where MASTER_ADDR is a name that
            # resolves for the others only.
            store = torch_dist.tcp_store("127.0.0.1", plan.master_port or 0, world_size,
                                         True, store_timeout, wait_for_workers=False)
            answer = (chosen.address, int(store.port), chosen.chosen_because,
                      chosen.from_master_addr, None)
        except Exception as exc:  # every rank must hear of it, or they hang in bcast
            answer = (None, None, "", False, f"{type(exc).__name__}: {exc}")
    addr, port, because, from_master_addr, error = mpi.broadcast_object(answer)
    if error is not None:
        raise RuntimeError(f"rank 0 could not open the torch rendezvous store: {error}")
    assert addr is not None and port is not None
    failure = None if rank == 0 else probe_tcp(addr, port, plan.rendezvous_timeout)
    # A flag first (O(log W)); the reasons travel only when some rank failed.
    if mpi.any_rank(failure is not None):
        failures = mpi.gather_objects(failure)
        raise RuntimeError(_unreachable(addr, port, because, from_master_addr, hosts,
                                        failures, plan.rendezvous_timeout))
    if store is None:
        store = torch_dist.tcp_store(addr, port, world_size, False, store_timeout)
    return _Rendezvous(rank=rank, world_size=world_size, local_rank=local_rank, addr=addr,
                       port=port, store=store, spans_nodes=not one_node)


def _unreachable(addr: str, port: int, because: str, from_master_addr: bool,
                 hosts: list[str], failures: list[str | None], timeout: float) -> str:
    """The error every rank raises when some rank cannot reach rank 0's store."""
    failed = [rank for rank, failure in enumerate(failures) if failure]
    first = failed[0]
    who = f"rank {first} (on {hosts[first]})"
    if len(failed) > 1:
        others = ", ".join(str(rank) for rank in failed[1:])
        who += f" and {len(failed) - 1} more (rank{'s' if len(failed) > 2 else ''} {others})"
    if from_master_addr:
        fix = (f"Set MASTER_ADDR to an address of {hosts[0]} that every node reaches, or "
               "unset it (rank 0 then offers the address gloo binds, or its default "
               "route's)")
    else:
        fix = (f"Set MASTER_ADDR to an address of {hosts[0]} that every node reaches, or "
               "GLOO_SOCKET_IFNAME to the interface on the network between the nodes "
               "(rank 0 then offers its address)")
    return (
        f"init_torch under mpirun: {who} cannot reach the rendezvous store of rank 0 "
        f"(on {hosts[0]}) at {addr}:{port} within {timeout:g} s: {failures[first]}. "
        f"Rank 0 chose {addr!r} because {because}. {fix}; "
        f"{RENDEZVOUS_TIMEOUT_VAR}=<seconds> gives a slow network longer."
    )


def abort_on_unhandled_exception() -> None:
    """Make an unhandled exception end the whole MPI job, not just this rank.

    Without it, a rank that dies of an exception leaves its peers waiting in
    their next collective, and the job hangs (Open MPI 5 and MPICH both; the
    dying rank's ``MPI_Finalize`` at exit waits as well). The hook prints the
    traceback as usual, then calls ``MPI_Abort`` on ``COMM_WORLD``, which is
    what ``python -m mpi4py script.py`` does. :func:`init` installs it for the
    MPI backend and :func:`init_torch` under mpirun; installing it twice is
    harmless, and a hook installed before is still called first.
    """
    previous = sys.excepthook
    if getattr(previous, "joinkit_aborts_mpi", False):
        return

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)
        from .. import mpi

        mpi.abort_world()

    excepthook.joinkit_aborts_mpi = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


def _export_torchrun_env(where: _Rendezvous) -> None:
    values = {"RANK": where.rank, "WORLD_SIZE": where.world_size,
              "LOCAL_RANK": where.local_rank, "MASTER_ADDR": where.addr,
              "MASTER_PORT": where.port}
    for name, value in values.items():
        if value is not None:
            os.environ.setdefault(name, str(value))


# -- a world of one ---------------------------------------------------------------


def solo_group() -> Any:
    """A :class:`backends.CollectiveGroup` whose world is this process alone.

    Returns:
        A group of rank 0 and world size 1.
    """
    return _SoloGroup()


class _Done:
    """The handle of a collective that completed when it was called."""

    __slots__ = ("_result",)

    def __init__(self, result: Any) -> None:
        self._result = result

    def wait(self) -> Any:
        return self._result


def _copy(buf: Any) -> Any:
    # torch tensors have clone(), arrays copy(); both give a new buffer.
    clone = getattr(buf, "clone", None)
    return clone() if clone is not None else buf.copy()


class _SoloGroup:
    """Every collective over a world of one: the result is the input.

    Arguments are still checked, by the checks of every backend
    (``backends._checks``), so code that runs here is not wrong on a larger
    world for those reasons.
    """

    rank = 0
    world_size = 1
    device = "cpu"
    _checks = Checks(0, 1)

    def __repr__(self) -> str:
        return "SoloGroup(rank=0, world_size=1)"

    def heartbeat(self, value: float) -> _Done:
        return _Done(float(value))

    def count(self, value: float) -> float:
        return float(value)

    def heartbeat_total(self, handle: _Done) -> float:
        return float(handle.wait())

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def _done(self, result: Any, async_op: bool) -> Any:
        return _Done(result) if async_op else result

    def all_reduce(self, buf: Any, op: str = "sum", async_op: bool = False) -> Any:
        self._checks.all_reduce(buf, op)
        return self._done(buf, async_op)

    def broadcast(self, buf: Any, src: int, async_op: bool = False) -> Any:
        self._checks.broadcast(buf, src)
        return self._done(buf, async_op)

    def all_gather(self, buf: Any, async_op: bool = False) -> Any:
        self._checks.all_gather(buf)
        return self._done([_copy(buf)], async_op)

    def reduce(self, buf: Any, dst: int, op: str = "sum", async_op: bool = False) -> Any:
        self._checks.reduce(buf, dst, op)
        return self._done(buf, async_op)

    def gather(self, buf: Any, dst: int, async_op: bool = False) -> Any:
        self._checks.gather(buf, dst)
        return self._done([_copy(buf)], async_op)

    def scatter(self, buf: Any, src: int, chunks: Any = None, async_op: bool = False) -> Any:
        _, parts = self._checks.scatter(buf, src, chunks)
        assert parts is not None  # the source is the only rank
        write_back(buf, host_array(parts[0])[0])
        return self._done(buf, async_op)

    def barrier(self) -> None:
        return None


def _solo_backend(group: _SoloGroup, device: Any) -> _SoloGroup:
    return group


register(_SoloGroup, _solo_backend)
