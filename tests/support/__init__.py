"""What many tests share: the joinables, rank processes, their JSON lines.

- :class:`Counter` (the tutorial's) and :class:`AllReducer` (torch's test
  joinable): joinables over any joinkit group, for the Join scenarios of
  every backend;
- :class:`Ctx`, :func:`scenario_registry` and :func:`recording`: the
  plumbing of the worker programs that run many scenarios per process
  (:func:`recording` notes each scenario before it runs, and
  :func:`report_crashes` makes a native crash print its Python and C++ stacks);
- :func:`launch_ranks` starts one process per command, each in its own
  session, waits for all of them until one shared deadline and kills the
  process group of any that overruns, so a hung rank fails its test instead
  of stalling the suite (and, for the ranks of one job, ends the others soon
  after one died);
- :func:`read_jsonl` reads the JSON lines a rank wrote, and
  :func:`records_by_name` those of every rank of a worker program;
- :func:`run_scenarios` runs a worker program on every rank and
  :func:`scenario_records` checks what each rank recorded of a scenario;
  :func:`run_scenario_jobs`, under it, makes one crash fail one scenario: a
  job whose rank died fails the scenario it died in, and the scenarios after
  it run again in a fresh job;
- :func:`scenario_names` lists the ``@scenario`` functions of a worker file
  without importing it (importing would import torch into the test process);
  :func:`selected_scenarios` keeps those the session's selected tests read
  (``@pytest.mark.scenarios``), so a run of a few chosen tests launches only
  what they need.

This module imports neither torch nor mpi4py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from joinkit import Join, Joinable, JoinHook

ROOT = Path(__file__).resolve().parents[2]
#: The test tree; on every test process's PYTHONPATH (tests/conftest.py).
TESTS = ROOT / "tests"


def program(name: str, tests: Path = TESTS) -> Path:
    """Where the program ``name`` (``"fsdp_scenarios.py"``) of a test tree lies.

    Args:
        name: a program's file name; names are unique across the tree.
        tests: a test tree: this checkout's, or an older checkout's (whose
            tests/ may still be flat), for the benchmarks that measure one.

    Raises:
        FileNotFoundError: no program of that name in ``tests``.
    """
    if (tests / name).is_file():
        return tests / name
    for found in sorted(tests.glob(f"**/programs/{name}")):
        return found
    raise FileNotFoundError(f"no program {name} under {tests}")


def programs_env(env: dict[str, str], tests: Path = TESTS) -> dict[str, str]:
    """``env`` with ``tests`` first on PYTHONPATH: a program started outside pytest
    (a benchmark's) imports the support package as under pytest."""
    path = [str(tests), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**env, "PYTHONPATH": os.pathsep.join(path)}

# -- joinables over any joinkit group ---------------------------------------------------


class CounterHook(JoinHook):
    """A joined rank shadows the Counter's all-reduce with a 0."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    def main_hook(self) -> None:
        if not self.counter.forgetful:
            self.counter.group.all_reduce(np.zeros(1, dtype=np.float32))


class Counter(Joinable):
    """The tutorial's counter: per input, one all-reduce of a 1 (float32).

    So ``count`` sums, over the iterations this rank took part in, the ranks
    that were active.

    Args:
        group: a joinkit group (threads, torch, MPI).
        forgetful: its hook does not shadow the all-reduce (a bug the
            threads harness must report).
    """

    def __init__(self, group: Any, forgetful: bool = False) -> None:
        super().__init__()
        self.group = group
        self.forgetful = forgetful
        self.count = 0.0

    def __call__(self) -> None:
        Join.notify_join_context(self)
        self.collective()

    def collective(self) -> None:
        t = np.ones(1, dtype=np.float32)
        self.group.all_reduce(t)
        self.count += float(t[0])

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return CounterHook(self)

    @property
    def join_device(self) -> Any:
        return self.group.device

    @property
    def join_process_group(self) -> Any:
        return self.group


def count_inputs(group: Any, inputs: int) -> float:
    """Run a :class:`Counter` over ``inputs`` inputs in a Join; return its count."""
    counter = Counter(group)
    with Join([counter]):
        for _ in range(inputs):
            counter()
    return counter.count


#: What AllReducer.post_value is before and after the post hook names the last joiner.
BEFORE, AFTER = 41.0, 42.0


class AllReducerJoinHook(JoinHook):
    def __init__(self, allreducer: AllReducer, num_allreduces: int) -> None:
        self.allreducer = allreducer
        self.num_allreduces = num_allreduces

    def main_hook(self) -> None:
        self.allreducer.events.append("main")
        for _ in range(self.num_allreduces):
            self.allreducer.reduce_sum(0.0)

    def post_hook(self, is_last_joiner: bool) -> None:
        owner = self.allreducer
        owner.events.append(("post", is_last_joiner))
        candidate = np.array([owner.rank if is_last_joiner else -1], dtype=np.int64)
        owner.collective("all_reduce", candidate, "max")
        value = np.array([AFTER if owner.rank == candidate[0] else BEFORE], np.float64)
        owner.collective("broadcast", value, int(candidate[0]))
        owner.post_value = float(value[0])


class AllReducer(Joinable):
    """torch's test joinable: ``num_allreduces`` all-reduces of a 1 per iteration.

    The post hook broadcasts the last joiner's ``AFTER`` into ``post_value``;
    ``events`` logs the hooks that ran. A subclass may override
    :meth:`collective` (e.g. to call a library directly).
    """

    def __init__(self, group: Any, name: str = "r", log: list[Any] | None = None) -> None:
        super().__init__()
        self.group = group
        self.name = name
        self.total = 0.0
        self.post_value = BEFORE
        self.events: list[Any] = [] if log is None else log
        self.kwargs: dict[str, Any] | None = None

    @property
    def rank(self) -> int:
        group = self.group
        return int(group.rank if hasattr(group, "rank") else group.Get_rank())

    def collective(self, kind: str, buf: np.ndarray, arg: Any) -> None:
        """``all_reduce`` with op ``arg``, or ``broadcast`` from ``arg``."""
        if kind == "all_reduce":
            self.group.all_reduce(buf, op=arg)
        else:
            self.group.broadcast(buf, src=arg)

    def reduce_sum(self, value: float) -> float:
        t = np.array([value], dtype=np.float32)
        self.collective("all_reduce", t, "sum")
        return float(t[0])

    def __call__(self, num_allreduces: int = 1) -> Any:
        handle = Join.notify_join_context(self)
        for _ in range(num_allreduces):
            self.total += self.reduce_sum(1.0)
        return handle

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self.kwargs = kwargs
        return AllReducerJoinHook(self, kwargs.get("num_allreduces", 1))

    @property
    def join_device(self) -> Any:
        return getattr(self.group, "device", "cpu")

    @property
    def join_process_group(self) -> Any:
        return self.group


def expected_total(inputs: list[int], rank: int, per_iteration: int = 1) -> float:
    """Sum over the iterations ``rank`` took part in of the number of active ranks."""
    return float(
        per_iteration * sum(sum(1 for n in inputs if n > t) for t in range(inputs[rank]))
    )


# -- worker programs: many scenarios per process ----------------------------------------


class Ctx:
    """One rank's view of a scenario."""

    def __init__(self, rank: int, world: int, group: Any) -> None:
        self.rank = rank
        self.world = world
        self.group = group


Scenario = Callable[[Ctx], Any]


def scenario_registry() -> tuple[dict[str, Scenario], Callable[[Scenario], Scenario]]:
    """A worker's scenarios by name, and the ``@scenario`` decorator that fills it."""
    scenarios: dict[str, Scenario] = {}

    def scenario(fn: Scenario) -> Scenario:
        scenarios[fn.__name__] = fn
        return fn

    return scenarios, scenario


def report_crashes() -> None:
    """Make a native crash of this process leave a report in its output.

    Python's ``faulthandler`` prints every thread's Python stack on a fatal
    signal (glibc aborts with SIGABRT on a corrupted heap), and torch's
    ``c10::FatalSignalHandler``, once torch is imported, every thread's native
    stack too. Idempotent; called by :func:`recording`.
    """
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable()
    torch = sys.modules.get("torch")
    if torch is not None and not getattr(report_crashes, "native", False):
        torch._C._set_print_stack_traces_on_fatal_signal(True)
        report_crashes.native = True  # type: ignore[attr-defined]


@contextmanager
def recording(out: Path, name: str) -> Iterator[dict[str, Any]]:
    """Append ``{"name", "ok", ...}`` to ``out`` however the block ends.

    The block fills the record (``record["result"] = ...``); an exception is
    recorded as ``ok: False`` with its traceback in ``error``, not raised.
    ``name`` goes to :func:`started_path` first, so a process that dies in
    the block leaves which scenario it was in.
    """
    record: dict[str, Any] = {"name": name, "ok": True}
    report_crashes()
    # Before the scenario runs: if this process dies in it, the harness knows
    # which scenario it died in (run_scenario_jobs).
    with started_path(out).open("a") as f:
        f.write(name + "\n")
    try:
        yield record
    except BaseException as exc:
        record["ok"] = False
        record["error"] = "".join(traceback.format_exception(exc))
    with out.open("a") as f:
        f.write(json.dumps(record) + "\n")


# -- rank processes ---------------------------------------------------------------------


def launch_ranks(
    commands: Sequence[Sequence[str]],
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    merge_stderr: bool = True,
    stop_after_death: float | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``commands`` at once; wait for all until ``timeout`` seconds from now.

    A command still running at the deadline has its process group killed and
    ``[test] killed after ... s`` appended to its ``stderr`` (or to its
    ``stdout`` where ``merge_stderr``: then ``stderr`` is empty).

    Args:
        stop_after_death: for the ranks of one job: once a process has died
            (ended by a signal, or with a non-zero status), the others get
            this many seconds more and are then killed, with a note that
            names the dead one (they would wait for it until their own
            timeouts). ``None``: every command runs until it ends or the
            deadline.

    Returns:
        One ``CompletedProcess`` per command, in order.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if env is None else env
    # Output goes to files, not pipes: every process is polled, none can block
    # on a full pipe that nobody reads yet.
    outputs = [tempfile.TemporaryFile() for _ in commands]
    errors = [None if merge_stderr else tempfile.TemporaryFile() for _ in commands]
    procs = [
        subprocess.Popen(
            list(command), env=env, cwd=cwd, stdout=out,
            stderr=subprocess.STDOUT if err is None else err,
            start_new_session=True,  # so a hung rank can be killed with its children
        )
        for command, out, err in zip(commands, outputs, errors, strict=True)
    ]
    deadline = time.monotonic() + timeout
    why = f"\n[test] killed after {timeout} s"
    notes = [""] * len(procs)
    while None in (codes := [proc.poll() for proc in procs]):  # polls every one
        if stop_after_death is not None:
            dead = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
            if dead is not None:
                if time.monotonic() + stop_after_death < deadline:
                    deadline = time.monotonic() + stop_after_death
                    why = (f"\n[test] killed {stop_after_death} s after process {dead} died "
                           f"({describe_exit(procs[dead].returncode)})")
                stop_after_death = None
        if time.monotonic() >= deadline:
            for i, proc in enumerate(procs):
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    notes[i] = why
            break
        time.sleep(0.02)
    done = []
    for proc, out, err, note in zip(procs, outputs, errors, notes, strict=True):
        proc.wait()
        text = _read_back(out)
        err_text = "" if err is None else _read_back(err)
        if merge_stderr:
            text += note
        else:
            err_text += note
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, text, err_text))
    return done


def _read_back(file: Any) -> str:
    file.seek(0)
    text = file.read().decode(errors="replace")
    file.close()
    return str(text)


def describe_exit(code: int | None) -> str:
    """A process's exit status in words: ``"exit code 1"``, ``"SIGABRT"``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, one a line; none where it does not exist."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def records_by_name(out: Path, world: int) -> dict[str, list[dict[str, Any]]]:
    """The records of ``out/rank{r}.jsonl`` (see :func:`recording`) by scenario
    name, each name's in rank order."""
    records: dict[str, list[dict[str, Any]]] = {}
    for rank in range(world):
        for record in read_jsonl(out / f"rank{rank}.jsonl"):
            records.setdefault(record["name"], []).append(record)
    return records


def started_path(out: Path) -> Path:
    """Where :func:`recording` notes each scenario it starts, next to its records:
    ``rank0.jsonl`` -> ``rank0.started``, one name a line."""
    return out.with_suffix(".started")


def started_names(out: Path, world: int) -> list[list[str]]:
    """Each rank's scenarios, in the order it started them (:func:`started_path`)."""
    names = []
    for rank in range(world):
        path = started_path(out / f"rank{rank}.jsonl")
        names.append(path.read_text().split() if path.exists() else [])
    return names


#: Seconds a job's other ranks get once one rank's process died; then they are
#: killed (they would wait for the dead rank until their collectives time out).
DEATH_GRACE = 3.0

Results = dict[str, list[dict[str, Any]]]
#: ``run_job(names, out)``: runs ``names`` in one job of fresh processes whose
#: ranks write ``out/rank{r}.jsonl`` (:func:`recording`); returns each
#: process's ``(exit status, output)``.
JobRunner = Callable[[list[str], Path], list[tuple[int | None, str]]]


def run_scenario_jobs(names: Sequence[str], world: int, out: Path, run_job: JobRunner
                      ) -> Results:
    """Run ``names`` in jobs of ``world`` ranks: one crash fails one scenario.

    The first job runs every name in ``out``. If a rank's process dies in a
    scenario (a native crash, a kill) or the job overruns its deadline, the
    scenario it was in (the first one, in a rank's start order, that not
    every rank finished) fails with the job's output, and the scenarios the
    job did not finish run again in a fresh job (``out/job1``, ...). A
    job that finished no scenario at all (an import error, a failed
    rendezvous) fails all of its scenarios with its output, with no retry.

    Returns:
        :func:`records_by_name` of every scenario that every rank finished,
        plus ``"_world"`` (``[{"world": world}]``), ``"_logs"`` (every
        process's output, job by job) and ``"_failed"`` (``{"name", "why"}``
        for each scenario a dead or overrunning job ended), for
        :func:`scenario_records`.
    """
    results: Results = {"_world": [{"world": world}], "_logs": [], "_failed": []}
    todo = list(names)
    job = 0
    while todo:
        job_out = out if job == 0 else out / f"job{job}"
        job_out.mkdir(parents=True, exist_ok=True)
        ran = run_job(todo, job_out)
        results["_logs"] += [{"log": log, "job": job} for _, log in ran]
        records = records_by_name(job_out, world)
        done = [name for name in todo if len(records.get(name, [])) == world]
        for name in done:
            results[name] = records[name]
        left = [name for name in todo if name not in done]
        if not left:
            break
        culprits: list[str] = []
        for started in started_names(job_out, world):
            first = next((name for name in started if name in left), None)
            if first is not None and first not in culprits:
                culprits.append(first)
        stuck = not done and not culprits
        if stuck:
            culprits = left  # nothing ran: a retry would fail the same way
        exits = ", ".join(f"rank {rank}: {describe_exit(code)}"
                          for rank, (code, _) in enumerate(ran))
        logs = "\n".join(_output_of(i, code, log) for i, (code, log) in enumerate(ran))
        for name in culprits:
            results["_failed"].append({"name": name, "why": (
                f"scenario {name} did not finish on every rank: its job ended in it "
                f"({exits}); the scenarios after it ran again in a fresh job\n{logs}")})
        todo = [name for name in left if name not in culprits]
        job += 1
    return results


def _output_of(process: int, code: int | None, log: str) -> str:
    """A job's process's output for a failure message: its crash report (from
    ``Fatal Python error``, :func:`report_crashes`) if it has one, else its end."""
    crash = log.find("Fatal Python error")
    if crash >= 0:
        return (f"-- process {process} ({describe_exit(code)}), its crash report:\n"
                f"{log[max(0, crash - 2000):crash + 20000]}")
    return f"-- process {process} ({describe_exit(code)}), the end of its output:\n{log[-3000:]}"


def run_scenarios(worker: Path, world: int, out: Path, names: Sequence[str],
                  timeout: float, before: Sequence[str] = ()) -> Results:
    """Run ``python WORKER [BEFORE...] RANK WORLD STORE OUT NAME...`` on ``world`` ranks.

    Arguments in ``names`` that start with ``--`` are flags for the worker,
    passed to every job before the names. The job is run by
    :func:`run_scenario_jobs`: a crash fails the scenario it happened in, and
    the rest run again in a fresh job; each job has ``timeout`` seconds, and
    once a rank's process died the others get :data:`DEATH_GRACE` seconds.

    Returns:
        :func:`run_scenario_jobs`'s results, for :func:`scenario_records`.
    """
    flags = [name for name in names if name.startswith("--")]

    def run_job(todo: list[str], job_out: Path) -> list[tuple[int | None, str]]:
        runs = launch_ranks(
            [[sys.executable, str(worker), *before, str(rank), str(world), str(job_out / "store"),
              str(job_out), *flags, *todo] for rank in range(world)],
            timeout, stop_after_death=DEATH_GRACE,
        )
        return [(run.returncode, run.stdout) for run in runs]

    return run_scenario_jobs([n for n in names if not n.startswith("--")], world, out, run_job)


def scenario_records(results: Results, name: str) -> list[dict[str, Any]]:
    """Every rank's record of scenario ``name``; fails the test with the ranks'
    output if a rank did not finish it (its job died or overran in it, see
    :func:`run_scenario_jobs`), or with their errors if it raised."""
    import pytest

    for failed in results.get("_failed", []):
        if failed["name"] == name:
            pytest.fail(failed["why"], pytrace=False)
    records = results.get(name, [])
    if len(records) != results["_world"][0]["world"]:
        logs = "\n".join(r["log"][-2000:] for r in results["_logs"])
        pytest.fail(f"scenario {name} did not finish on every rank:\n{logs}")
    errors = [r["error"] for r in records if not r["ok"]]
    assert not errors, "\n".join(errors)
    return records


def selected_scenarios(request: Any, every: Sequence[str]) -> list[str]:
    """The scenarios (or cells) of ``every`` that this session's selected tests of the
    requesting module fixture's module read, in ``every``'s order.

    A test says what it reads with ``@pytest.mark.scenarios(name, ...)``, or, with
    the mark and no names, through its ``name`` or ``spec`` parameter. A selected
    test of the module without the mark reads them all, so running a whole module
    launches everything as before; a run of chosen tests (the compatibility
    matrix's ``edge`` part, ``.ci/matrix.py``) launches only what they read.

    Args:
        request: the module fixture's ``request``.
        every: the scenarios the fixture would run for the whole module.
    """
    wanted: set[str] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        marker = item.get_closest_marker("scenarios")
        if marker is None:
            return list(every)
        params = getattr(getattr(item, "callspec", None), "params", {})
        wanted.update(marker.args or [params.get("name", params.get("spec"))])
    return [name for name in every if name in wanted]


def scenario_names(worker: Path) -> list[str]:
    """The functions of ``worker`` decorated with a bare ``@scenario``, in order."""
    lines = worker.read_text().splitlines()
    return [
        line.split("def ", 1)[1].split("(", 1)[0]
        for previous, line in zip(lines, lines[1:], strict=False)
        if previous.strip() == "@scenario"
    ]
