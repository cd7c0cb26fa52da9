"""The fault matrix, written once against the framework-agnostic collectives.

Theory of operation
-------------------
Every scenario is a function of a :class:`backends.CollectiveGroup` (threads,
MPI, torch) that runs one rank's part and returns a JSON-able dict of what the
rank saw. The threads tests call them under ``backends.threads.spawn``; the
MPI and torch runners (``fault_runner.py``) call them in real processes
and print one ``JOINKIT-FAULT {...}`` line per rank and case; the pytest files
turn the dicts into assertions with :func:`check_case`, so the expectations
are written once too. This module imports numpy and joinkit only.

The joinable is a :class:`Counter`: per iteration it sends the Join's
heartbeat, then all-reduces a 1 (a joined rank's main hook shadows it with a
0); its post hook all-reduces the counts with ``max``. Rank ``r`` has
``INPUTS + r`` inputs, except where a case says otherwise.

The cases (``failing_rank`` is the rank that misbehaves):

=====================  ============================================================
``before_heartbeat``   (a) raises at iteration ``FAIL_AT`` before its heartbeat
``after_heartbeat``    (b) raises right after that heartbeat, before its all-reduce
``main_hook``          (c) has 1 input, so it joins first; its main hook raises in
                       shadow round 1 (the collective of that round is never sent)
``post_hook``          (d) its post hook raises before the post hook's all-reduce
``stall``              sleeps ``STALL_FACTOR`` x the Join timeout in its loop body
                       at iteration ``FAIL_AT``, where the others have joined: their
                       watchdog must report the stall
``kill``               (e) SIGKILLs itself at iteration ``FAIL_AT`` (launchers only)
``raw_before_heartbeat`` (a) and (b) with a :class:`RawCounter`: the joinable's
``raw_after_heartbeat``  collectives go to a raw mpi4py communicator, which the
                       join backend cannot count (MPI only)
=====================  ============================================================

(a) and (b) leave the group usable: after the Join every rank all-reduces once
more (``group_after``) and must get the world size. (c) and (d) abort the group,
so on the process backends each needs a launch of its own (MPI's abort ends the
job) or a fresh group.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from typing import Any

import numpy as np
import support

from joinkit import (
    AgreementError,
    Join,
    JoinHook,
    LocalProtocolError,
    PeerFailure,
    RankTimeout,
    format_reports,
)

#: (a) and (b) on a raw communicator (MPI only): the Join cannot tell whether
#: the peers wait in the failing rank's last iteration, so it fails fast.
RAW = ("raw_before_heartbeat", "raw_after_heartbeat")
#: The matrix's cases, in the order of the issue's list.
CASES = ("before_heartbeat", "after_heartbeat", "main_hook", "post_hook", "stall", "kill", *RAW)
#: Cases after which the group is still usable (so a launch may run several).
SURVIVABLE = ("before_heartbeat", "after_heartbeat")
#: Cases that abort the group (MPI: the job); one launch (or group) each.
ABORTING = ("main_hook", "post_hook", "stall")

INPUTS = 4  # rank r has INPUTS + r inputs
FAIL_AT = 2  # the iteration at which (a), (b) and (e) strike
STALL_FACTOR = 3.0  # the stalling rank sleeps this many Join timeouts
AGREEMENT_VARIANTS = ("joinables", "throw", "joinables_unchecked_ok")

TAG = "JOINKIT-FAULT"


class InjectedFault(Exception):
    """The exception a failing rank raises on purpose."""


def fault_message(case: str, rank: int) -> str:
    return f"injected {case} fault on rank {rank}"


# -- the joinable ----------------------------------------------------------------------


class CounterHook(JoinHook):
    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    def main_hook(self) -> None:
        counter = self.counter
        counter.shadow_rounds += 1
        if counter.fail_in == "main_hook" and counter.shadow_rounds == 1:
            raise InjectedFault(fault_message("main_hook", counter.group.rank))
        counter.group.all_reduce(np.zeros(1, dtype=np.float32))

    def post_hook(self, is_last_joiner: bool) -> None:
        counter = self.counter
        counter.post_hook_ran = True
        if counter.fail_in == "post_hook":
            raise InjectedFault(fault_message("post_hook", counter.group.rank))
        total = np.array([counter.count], dtype=np.float32)
        counter.group.all_reduce(total, op="max")
        counter.max_count = float(total[0])


class Counter(support.Counter):
    """Counts, per iteration, the ranks that processed an input (``support.Counter``
    whose hooks can fail, with a heartbeat apart from the collective).

    Args:
        group: the rank's collective group.
        fail_in: ``"main_hook"`` or ``"post_hook"`` to make that hook raise.
    """

    def __init__(self, group: Any, fail_in: str | None = None) -> None:
        super().__init__(group)
        self.fail_in = fail_in
        self.max_count = -1.0
        self.shadow_rounds = 0
        self.post_hook_ran = False

    def heartbeat(self) -> None:
        Join.notify_join_context(self)

    def step(self) -> None:
        self.heartbeat()
        self.collective()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return CounterHook(self)


class RawCounter(Counter):
    """A :class:`Counter` whose joinable uses a raw mpi4py communicator.

    ``join_process_group`` is the communicator itself (an ``MPIGroup``'s
    ``comm``), and the per-iteration all-reduce and its shadow are the
    communicator's own blocking ``Allreduce``: the join backend never sees them.
    """

    def __init__(self, group: Any) -> None:
        super().__init__(group)
        self.comm = group.comm

    def collective(self) -> None:
        out = np.zeros(1, dtype=np.float32)
        self.comm.Allreduce(np.ones(1, dtype=np.float32), out)
        self.count += float(out[0])

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return RawCounterHook(self)

    @property
    def join_device(self) -> Any:
        return "cpu"

    @property
    def join_process_group(self) -> Any:
        return self.comm


class RawCounterHook(CounterHook):
    def main_hook(self) -> None:
        counter = self.counter
        counter.shadow_rounds += 1
        out = np.zeros(1, dtype=np.float32)
        counter.comm.Allreduce(np.zeros(1, dtype=np.float32), out)


# -- recording what a rank saw ---------------------------------------------------------


def describe_error(exc: BaseException | None) -> dict[str, Any] | None:
    """An exception as data: type, message, notes, PeerFailure fields, cause chain."""
    if exc is None:
        return None
    out: dict[str, Any] = {
        "type": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc),
        "notes": [str(n) for n in getattr(exc, "__notes__", [])],
    }
    if isinstance(exc, PeerFailure):
        out["peer"] = {"rank": exc.rank, "exc_type": exc.exc_type, "message": exc.exc_message}
    chain = []
    current = exc.__cause__ or exc.__context__
    while current is not None and len(chain) < 5:
        chain.append(f"{type(current).__name__}: {current}")
        current = current.__cause__ or current.__context__
    out["chain"] = chain
    return out


def _report(join: Join) -> dict[str, Any] | None:
    report = join.report
    return None if report is None else report.to_dict()


def inputs_for(case: str, rank: int, failing_rank: int) -> int:
    if case == "main_hook" and rank == failing_rank:
        return 1  # joins first, so its main hook runs while the others are active
    if case == "stall":
        # The others join after FAIL_AT inputs and count while it sleeps.
        return INPUTS + 100 if rank == failing_rank else FAIL_AT
    return INPUTS + rank


# -- the fault matrix ----------------------------------------------------------------------


def run_case(
    group: Any,
    case: str,
    failing_rank: int,
    world_size: int,
    timeout: float = 20.0,
    stall_timeout: float = 2.0,
) -> dict[str, Any]:
    """Run one rank's part of one fault case; return what it saw.

    Args:
        group: this rank's collective group.
        case: one of :data:`CASES`.
        failing_rank: the rank that misbehaves.
        world_size: the number of ranks.
        timeout: the Join's watchdog timeout (``stall`` uses ``stall_timeout``).
        stall_timeout: the Join timeout of the ``stall`` case.

    Returns:
        A JSON-able dict: the error (if any), the join report, what the
        joinable did, the follow-up all-reduce (survivable cases) and the time.
    """
    rank = group.rank
    assert group.world_size == world_size, (group.world_size, world_size)
    failing = rank == failing_rank
    counter = Counter(group, fail_in=case if failing and case in ("main_hook", "post_hook")
                      else None)
    fault = case
    if case in RAW:
        counter = RawCounter(group)
        fault = case.removeprefix("raw_")
    inputs = inputs_for(case, rank, failing_rank)
    join_timeout = stall_timeout if case == "stall" else timeout
    if case == "stall":
        # Enter together: the short timeout must time the stall, not how much
        # later a loaded machine started one rank than the others.
        group.barrier()
    started = time.monotonic()  # the Join's time, not the wait for the others
    error: BaseException | None = None
    iterations = 0
    join = Join([counter], timeout=join_timeout)
    try:
        with join:
            for i in range(inputs):
                if failing and i == FAIL_AT:
                    if fault == "before_heartbeat":
                        raise InjectedFault(fault_message(case, rank))
                    if case == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    if case == "stall":
                        time.sleep(STALL_FACTOR * join_timeout)
                counter.heartbeat()
                if failing and i == FAIL_AT and fault == "after_heartbeat":
                    raise InjectedFault(fault_message(case, rank))
                counter.collective()
                iterations += 1
    except Exception as exc:  # noqa: BLE001 - recorded and asserted on by the tests
        error = exc
    elapsed = time.monotonic() - started
    result: dict[str, Any] = {
        "case": case,
        "rank": rank,
        "world_size": world_size,
        "failing_rank": failing_rank,
        "error": describe_error(error),
        "traceback": "".join(traceback.format_exception(error)) if error else "",
        "iterations": iterations,
        "count": counter.count,
        "max_count": counter.max_count,
        "post_hook_ran": counter.post_hook_ran,
        "shadow_rounds": counter.shadow_rounds,
        "report": _report(join),
        "seconds": elapsed,
        "join_timeout": join_timeout,
    }
    if case in SURVIVABLE:
        result["group_after"] = _group_after(group)
    return result


def _group_after(group: Any) -> float | str:
    """One more all-reduce of a 1: the world size if the ranks are still in step."""
    try:
        t = np.ones(1, dtype=np.float32)
        group.all_reduce(t)
        return float(t[0])
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


# -- what every cell must show -----------------------------------------------------------------


def check_case(
    case: str,
    failing_rank: int,
    world_size: int,
    results: dict[int, dict[str, Any]],
    peers_report: str = "peer_failure",
    deadline: float | None = None,
) -> list[str]:
    """The problems with one cell's per-rank results (empty: the cell passed).

    Args:
        case: the case.
        failing_rank: the rank that misbehaved.
        world_size: the number of ranks.
        results: rank -> what :func:`run_case` returned (ranks that did not
            report are missing).
        peers_report: how the hook cases reach the other ranks on this
            backend: ``"peer_failure"`` (an error derived from PeerFailure that
            names the failing rank, like threads' SpawnAborted).
        deadline: seconds within which every rank must have left the Join.

    Returns:
        A list of human-readable problems.
    """
    problems: list[str] = []
    missing = sorted(set(range(world_size)) - set(results))
    if missing:
        problems.append(f"ranks {missing} did not report")
    message = fault_message(case, failing_rank)
    for rank, result in sorted(results.items()):
        error = result["error"]
        where = f"rank {rank}"
        if deadline is not None and result["seconds"] > deadline:
            problems.append(f"{where} took {result['seconds']:.1f} s (> {deadline} s)")
        if result["post_hook_ran"] and case != "post_hook":
            problems.append(f"{where} ran its post hook after a failure")
        if error is None:
            problems.append(f"{where} left the Join without an error")
            continue
        if case == "stall":
            continue  # checked by check_stall: who times out first varies
        if rank == failing_rank:
            if error["type"] != "InjectedFault" or error["message"] != message:
                problems.append(f"{where} (failing) raised {error['type']}: "
                                f"{error['message']} instead of its own InjectedFault")
            continue
        peer = error.get("peer")
        if peer is None:
            problems.append(f"{where} raised {error['type']}: {error['message']} "
                            f"(not a PeerFailure)")
            continue
        if peer["rank"] != failing_rank:
            problems.append(f"{where}'s {error['type']} names rank {peer['rank']}, "
                            f"not {failing_rank}")
        if case in SURVIVABLE:
            if error["type"] != "PeerFailure":
                problems.append(f"{where} raised {error['type']}, not PeerFailure")
            if peer["exc_type"] != "InjectedFault" or peer["message"] != message:
                problems.append(f"{where}'s PeerFailure says {peer['exc_type']}: "
                                f"{peer['message']}")
        elif message not in error["message"] or "InjectedFault" not in error["message"]:
            problems.append(f"{where}'s {error['type']} does not carry the failing "
                            f"rank's exception: {error['message']}")
    if case in SURVIVABLE:
        for rank, result in sorted(results.items()):
            if result.get("group_after") != float(world_size):
                problems.append(f"rank {rank}: group unusable after the Join: "
                                f"{result.get('group_after')}")
            report = result["report"]
            if report is None or report["phase"] != "DONE":
                problems.append(f"rank {rank}: report {report}")
            elif rank == failing_rank and (report["failure"] or {}).get("rank") != rank:
                problems.append(f"rank {rank}: its report has no failure: {report}")
            elif rank != failing_rank and (
                report["stopped_by"] != [failing_rank] or report["is_last_joiner"]
                or report["failure"] is not None
            ):
                problems.append(f"rank {rank}: its report does not say that rank "
                                f"{failing_rank}'s failure stopped it: {report}")
    return problems


def check_stall(
    failing_rank: int, world_size: int, results: dict[int, dict[str, Any]],
    deadline: float,
) -> list[str]:
    """The problems with a ``stall`` cell: some joined rank must report a RankTimeout
    that says phase, round and where the ranks were; every rank leaves with an error."""
    problems = check_case("stall", failing_rank, world_size, results, deadline=deadline)
    timeouts = [r for r in results.values()
                if r["error"] is not None and "RankTimeout" in r["error"]["mro"]
                or r["error"] is not None and any("RankTimeout" in c for c in r["error"]["chain"])]
    if not timeouts:
        problems.append("no rank raised RankTimeout")
    # The others learn of the abort that the first timed-out rank caused: an
    # error derived from PeerFailure naming a rank that timed out.
    timed_out = {r["rank"] for r in timeouts}
    for rank, result in sorted(results.items()):
        error = result["error"]
        if error is None or rank in timed_out:
            continue
        peer = error.get("peer")
        if peer is None or peer["rank"] == failing_rank:
            problems.append(f"rank {rank} raised {error['type']}: {error['message']} "
                            "(not a PeerFailure naming a rank that timed out)")
    for result in timeouts:
        text = result["error"]["message"]
        for needle in ("DRAINING", "shadow round", "made no progress"):
            if needle not in text:
                problems.append(f"rank {result['rank']}'s RankTimeout lacks {needle!r}: {text}")
    return problems


# -- the agreement check -----------------------------------------------------------------------


def run_agreement(group: Any, variant: str) -> dict[str, Any]:
    """Ranks disagree on their Join's settings; every rank must raise AgreementError.

    Variants: ``joinables`` (rank 0 passes two Counters, the others one),
    ``throw`` (rank 0 sets throw_on_early_termination), and
    ``joinables_unchecked_ok`` (even settings with check_agreement=False: works).
    """
    rank = group.rank
    error: BaseException | None = None
    counters = [Counter(group)]
    throw = False
    check = True
    if variant == "joinables" and rank == 0:
        counters.append(Counter(group))
    if variant == "throw" and rank == 0:
        throw = True
    if variant == "joinables_unchecked_ok":
        check = False
    started = time.monotonic()
    try:
        with Join(counters, throw_on_early_termination=throw, check_agreement=check,
                  timeout=20.0):
            for _ in range(2 + rank):
                for counter in counters:
                    counter.step()
    except Exception as exc:  # noqa: BLE001
        error = exc
    return {
        "variant": variant,
        "rank": rank,
        "error": describe_error(error),
        "count": counters[0].count,
        "max_count": counters[0].max_count,
        "seconds": time.monotonic() - started,
        "group_after": _group_after(group),
    }


def check_agreement(variant: str, world_size: int,
                    results: dict[int, dict[str, Any]]) -> list[str]:
    problems = []
    if sorted(results) != list(range(world_size)):
        problems.append(f"ranks reporting: {sorted(results)}")
    for rank, result in sorted(results.items()):
        error = result["error"]
        if variant == "joinables_unchecked_ok":
            most = 2 + world_size - 1
            if error is not None or result["max_count"] != float(
                sum(min(2 + r, most) for r in range(world_size))
            ):
                problems.append(f"rank {rank}: {error} / max_count {result['max_count']}")
            continue
        if error is None or error["type"] != "AgreementError":
            problems.append(f"rank {rank} raised {error} instead of AgreementError")
            continue
        name = "joinables" if variant == "joinables" else "throw_on_early_termination"
        if name not in error["message"] or "rank |" not in error["message"]:
            problems.append(f"rank {rank}'s AgreementError has no table naming {name}: "
                            f"{error['message']}")
        if result["group_after"] != float(world_size):
            problems.append(f"rank {rank}: group unusable after: {result['group_after']}")
    return problems


# -- bad input ---------------------------------------------------------------------------------


class _NotAHook(Counter):
    def join_hook(self, **kwargs: Any) -> Any:
        return 42


class _NoInit(Counter):
    def __init__(self, group: Any) -> None:  # skips Joinable.__init__
        self.group = group


class _Strict(Counter):
    """A joinable whose hook accepts no keyword arguments at all."""

    def join_hook(self, *, sync_max_count: bool = False) -> JoinHook:  # type: ignore[override]
        return CounterHook(self)


class _OnDevice(Counter):
    def __init__(self, group: Any, device: Any) -> None:
        super().__init__(group)
        self._device = device

    @property
    def join_device(self) -> Any:
        return self._device


class _RawGroup(Counter):
    """A joinable on a raw process group object (communicator, ProcessGroup, None)."""

    @property
    def join_device(self) -> Any:
        return "cpu"


def _outcome(fn: Any) -> dict[str, Any] | None:
    """The error ``fn()`` raised (``None``: it returned)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return describe_error(exc)
    return None


def run_bad_inputs(group: Any, dead_group: Any = None,
                   device: Any = "tpu:0") -> dict[str, Any]:
    """Every bad input of the issue on this rank's group; each must be a clear error.

    Every case fails before its first collective (or is collective and fails on
    every rank alike), so the ranks stay in step; a final all-reduce proves it.

    Args:
        group: a live group.
        dead_group: a group of a destroyed / uninitialised backend, or ``None``
            to skip that case (the caller tests it where it can make one).
        device: a device this backend does not support.
    """
    out: dict[str, Any] = {"rank": group.rank}
    out["not_a_joinable"] = _outcome(lambda: Join([object()]))
    out["not_a_list"] = _outcome(lambda: Join(Counter(group)))  # type: ignore[arg-type]
    out["hook_not_a_join_hook"] = _outcome(lambda: Join([_NotAHook(group)]))
    no_init = _NoInit(group)
    out["notify_no_init_outside"] = _outcome(lambda: Join.notify_join_context(no_init))
    out["enter_no_init"] = _outcome(lambda: Join([no_init]).__enter__())
    # A joinable that did call Joinable.__init__ may notify outside a Join: a
    # no-op that sends nothing (torch's DDP notifies in every forward).
    plain = Counter(group)
    calls = getattr(group, "collectives_issued", None)
    out["notify_outside_returns"] = repr(Join.notify_join_context(plain))
    out["notify_outside_sent"] = (
        None if calls is None else getattr(group, "collectives_issued", None) != calls
    )

    def nested() -> None:
        counter = Counter(group)
        with Join([counter], timeout=20.0):
            try:
                with Join([counter], timeout=20.0):
                    pass
            finally:
                counter.step()  # keep the ranks in step, then leave normally

    out["nested"] = _outcome(nested)
    out["kwargs_rejected"] = _outcome(lambda: Join([_Strict(group)], bad_kwarg=1))
    out["unsupported_device"] = _outcome(lambda: Join([_OnDevice(group, device)]))
    if dead_group is not None:
        out["dead_group"] = _outcome(lambda: Join([_RawGroup(dead_group)], timeout=20.0)
                                     .__enter__())
    out["group_after"] = _group_after(group)
    return out


def check_bad_inputs(result: dict[str, Any], world_size: int,
                     dead_group_tested: bool = True) -> list[str]:
    """The problems with one rank's :func:`run_bad_inputs` result."""
    expected = {
        "not_a_joinable": ("TypeError", "expects Joinable objects"),
        "not_a_list": ("TypeError", "list of Joinables"),
        "hook_not_a_join_hook": ("TypeError", "not a JoinHook"),
        "notify_no_init_outside": ("LocalProtocolError", "Joinable.__init__"),
        "enter_no_init": ("LocalProtocolError", "Joinable.__init__"),
        "nested": ("LocalProtocolError", "cannot be nested"),
        "kwargs_rejected": ("TypeError", "bad_kwarg"),
        "unsupported_device": ("TypeError", "join_device"),
    }
    if dead_group_tested:
        expected["dead_group"] = (None, "")
    problems = []
    for key, (kind, needle) in expected.items():
        error = result.get(key)
        if error is None:
            problems.append(f"{key}: no error")
            continue
        if kind is not None and kind not in error["mro"]:
            problems.append(f"{key}: {error['type']} is not a {kind}: {error['message']}")
        text = error["message"] + " ".join(error["notes"])
        if needle.lower() not in text.lower():
            problems.append(f"{key}: {needle!r} not in {text!r}")
    if result["notify_outside_returns"] != "None" or result["notify_outside_sent"]:
        problems.append(f"notify outside a Join: returned {result['notify_outside_returns']}, "
                        f"sent a collective: {result['notify_outside_sent']}")
    if result["group_after"] != float(world_size):
        problems.append(f"group unusable after the bad inputs: {result['group_after']}")
    return problems


# -- world size one, and the report -------------------------------------------------------------


# Ranks that are threads of one process share the "joinkit" logger: the first
# to start turns DEBUG on and the last to finish restores the level (each rank
# saving and restoring it raced: a rank could save a peer's DEBUG and leave it
# on, which turns off the batched drain in every later test of the process).
_debug_lock = threading.Lock()
_debug_ranks = 0
_debug_saved_level = logging.NOTSET


def _debug_logging(delta: int) -> None:
    global _debug_ranks, _debug_saved_level
    logger = logging.getLogger("joinkit")
    with _debug_lock:
        if delta > 0 and _debug_ranks == 0:
            _debug_saved_level = logger.level
            logger.setLevel(logging.DEBUG)
        _debug_ranks += delta
        if delta < 0 and _debug_ranks == 0:
            logger.setLevel(_debug_saved_level)


def run_report(group: Any) -> dict[str, Any]:
    """Uneven inputs without faults; the report, gathered report and DEBUG log."""
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("joinkit")
    handler = Capture(level=logging.DEBUG)
    logger.addHandler(handler)
    _debug_logging(+1)
    counter = Counter(group)
    try:
        with Join([counter], timeout=20.0) as join:
            for _ in range(INPUTS + group.rank):
                counter.step()
        gathered = join.gather_report()
    finally:
        logger.removeHandler(handler)
        _debug_logging(-1)
    return {
        "rank": group.rank,
        "report": _report(join),
        "table": None if gathered is None else format_reports(gathered),
        "gathered": None if gathered is None else [r.rank for r in gathered],
        "log": [r for r in records if f"rank {group.rank}:" in r],
        "count": counter.count,
        "max_count": counter.max_count,
    }


def check_report(world_size: int, results: dict[int, dict[str, Any]]) -> list[str]:
    problems = []
    most = INPUTS + world_size - 1
    for rank, result in sorted(results.items()):
        report = result["report"]
        inputs = INPUTS + rank
        want = {"inputs": inputs, "joined_at_round": inputs, "shadow_rounds": most - inputs,
                "is_last_joiner": inputs == most, "phase": "DONE", "failure": None}
        got = {k: report[k] for k in want}
        if got != want:
            problems.append(f"rank {rank}: report {got} != {want}")
        if report["seconds_shadowing"] < 0:
            problems.append(f"rank {rank}: negative seconds_shadowing")
        if result["max_count"] != float(sum(INPUTS + r for r in range(world_size))):
            problems.append(f"rank {rank}: max_count {result['max_count']}")
        if not any("ACTIVE -> DRAINING" in line for line in result["log"]):
            problems.append(f"rank {rank}: no DEBUG phase change logged: {result['log']}")
        if rank == 0:
            table = result["table"] or ""
            if result["gathered"] != list(range(world_size)):
                problems.append(f"gathered reports of ranks {result['gathered']}")
            if f"{world_size} ranks" not in table or f"skew {world_size - 1}" not in table:
                problems.append(f"report table: {table}")
        elif result["table"] is not None:
            problems.append(f"rank {rank} got the gathered reports")
    return problems


__all__ = [
    "CASES", "SURVIVABLE", "ABORTING", "RAW", "AGREEMENT_VARIANTS", "TAG", "InjectedFault",
    "Counter", "RawCounter", "run_case", "check_case", "check_stall", "run_agreement",
    "check_agreement", "run_bad_inputs", "check_bad_inputs", "run_report", "check_report",
    "describe_error", "AgreementError", "LocalProtocolError", "RankTimeout",
]
