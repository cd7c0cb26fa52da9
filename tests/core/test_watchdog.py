"""The watchdog on its own: the Watch's stall policy, the thread, and no Join in sight."""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

import attrs

from joinkit import _watchdog
from joinkit._watchdog import LEFT, LOOP_BODY, Entry, Peer, Stall, Waiting, judge


def _stalled(watch: _watchdog.Watch, now: float) -> tuple[str | None, int, float] | None:
    """One look of the thread without a board: the stall's (what, ticks, idle)."""
    watch.due(now)
    verdict = watch.verdict(now)
    assert not isinstance(verdict, Waiting)
    return None if verdict is None else (verdict.what, verdict.ticks, verdict.idle)


def test_idle_runs_from_the_activity_or_the_last_tick_the_thread_saw() -> None:
    watch = _watchdog.Watch(2.0, lambda stall: None)
    assert _stalled(watch, 100.0) is None  # not blocked in anything
    watch.begin("exchanging failures", 10.0)
    assert _stalled(watch, 11.0) is None
    assert _stalled(watch, 12.5) == ("exchanging failures", 0, 2.5)
    # A drain: every tick the thread notices is progress, from when it noticed.
    watch.begin("counting non-joined ranks (shadow round 0)", 20.0)
    watch.ticks += 3  # before the thread's first look
    assert _stalled(watch, 30.0) is None  # progress, seen now
    assert _stalled(watch, 31.9) is None
    assert _stalled(watch, 32.0) == ("counting non-joined ranks (shadow round 0)", 3, 2.0)
    watch.ticks += 1
    assert _stalled(watch, 33.0) is None
    assert _stalled(watch, 36.0) == ("counting non-joined ranks (shadow round 0)", 4, 3.0)
    # A new activity starts afresh, its ticks too.
    watch.begin("post hooks", 40.0)
    assert watch.ticks == 0 and _stalled(watch, 41.0) is None
    watch.end()
    assert _stalled(watch, 99.0) is None


def test_the_thread_fires_once_and_forgets_unwatched() -> None:
    fired: list[Stall] = []
    done = threading.Event()

    def on_stall(stall: Stall) -> None:
        fired.append(stall)
        done.set()

    watch = _watchdog.Watch(0.05, on_stall)
    watch.begin("the agreement check at entry", time.monotonic())
    _watchdog.watch(watch)
    try:
        assert done.wait(5.0)
        time.sleep(0.2)  # a second look must not fire again
    finally:
        _watchdog.unwatch(watch)
    assert len(fired) == 1 and watch.fired
    assert fired[0].what == "the agreement check at entry" and fired[0].idle >= 0.05


def test_the_watchdog_imports_nothing_of_the_join() -> None:
    source = Path(_watchdog.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    allowed = {"__future__", "atexit", "threading", "time", "weakref", "collections.abc",
               "attrs"}
    assert imported <= allowed, imported


# -- the policy, pure -------------------------------------------------------------------

COUNTING = "counting non-joined ranks (shadow round 0)"


def test_a_peer_in_its_loop_body_is_waited_for_however_long() -> None:
    peers = {1: Peer(what=LOOP_BODY, age=330.0, silent=10.0)}
    for idle in (300.0, 330.0, 10_000.0):
        verdict = judge(blocked=(COUNTING, 1, idle), peers=peers, timeout=300.0, hard=False)
        assert verdict == Waiting(what=COUNTING, idle=idle, ranks=((1, LOOP_BODY, 330.0),))
    # Peers outside the Join, or that posted nothing yet, are waited for too.
    peers = {1: Peer(what=LEFT, age=5.0), 2: Peer(what=None), 3: Peer(what=COUNTING)}
    verdict = judge(blocked=(COUNTING, 0, 400.0), peers=peers, timeout=300.0, hard=False)
    assert isinstance(verdict, Waiting)
    assert [rank for rank, _, _ in verdict.ranks] == [1, 2]


def test_every_rank_in_a_join_collective_without_progress_is_a_stall() -> None:
    peers = {1: Peer(what=COUNTING, silent=1.0), 2: Peer(what="post hooks", silent=2.0)}
    assert judge(blocked=(COUNTING, 0, 299.0), peers=peers, timeout=300.0, hard=False) is None
    assert judge(blocked=(COUNTING, 4, 300.0), peers=peers, timeout=300.0,
                 hard=False) == Stall(what=COUNTING, ticks=4, idle=300.0)


def test_an_unreadable_board_cannot_show_a_peer_alive() -> None:
    peers = {1: Peer(what=LOOP_BODY, silent=None)}
    assert judge(blocked=(COUNTING, 0, 300.0), peers=peers, timeout=300.0, hard=False,
                 board_error="TimeoutError: no store") == Stall(
        what=COUNTING, idle=300.0, board_error="TimeoutError: no store")


def test_an_explicit_timeout_is_a_hard_limit() -> None:
    peers = {1: Peer(what=LOOP_BODY, silent=1.0)}
    assert judge(blocked=(COUNTING, 0, 10.0), peers=peers, timeout=10.0,
                 hard=True) == Stall(what=COUNTING, idle=10.0)


def test_a_silent_peer_inside_the_join_is_a_stall_in_the_loop_body_too() -> None:
    peers = {1: Peer(what=LOOP_BODY, silent=5.0), 2: Peer(what=LOOP_BODY, silent=1.0)}
    for hard in (True, False):
        assert judge(blocked=None, peers=peers, timeout=10.0, hard=hard) == Stall(
            what=None, silent=((1, 5.0, LOOP_BODY),))
    assert judge(blocked=(COUNTING, 2, 8.0), peers=peers, timeout=10.0, hard=False) == Stall(
        what=COUNTING, ticks=2, idle=8.0, silent=((1, 5.0, LOOP_BODY),))
    # Below the silent fraction of the timeout, and a peer that left the
    # Join (it beats no more) or keeps no beat: not silent.
    quiet = {1: Peer(what=LOOP_BODY, silent=4.9), 2: Peer(what=LEFT, silent=99.0),
             3: Peer(what=LOOP_BODY, silent=None)}
    assert judge(blocked=None, peers=quiet, timeout=10.0, hard=False) is None


class _Board:
    """A fake status board: what each rank posted and its beat, read with fake times."""

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}
        self.reads: list[list[int]] = []
        self.fail: str | None = None

    def read(self, ranks: list[int]) -> dict[int, Entry]:
        self.reads.append(list(ranks))
        if self.fail is not None:
            raise TimeoutError(self.fail)
        return {rank: self.entries[rank] for rank in ranks if rank in self.entries}


def _look(watch: _watchdog.Watch, board: _Board, now: float) -> Stall | Waiting | None:
    """What the thread does at one look, with a fake clock."""
    ranks = watch.due(now)
    if ranks:
        try:
            watch.seen(now, ranks, board.read(list(ranks)))
        except TimeoutError as exc:
            watch.seen(now, ranks, {}, f"TimeoutError: {exc}")
    return watch.verdict(now)


def test_the_watch_reads_its_ring_neighbour_and_finds_it_silent_within_the_timeout() -> None:
    board = _Board()
    watch = _watchdog.Watch(10.0, lambda stall: None, hard=False, rank=3, world_size=4,
                            read=board.read)
    assert watch.look_every == 1.0  # a tenth of the timeout
    for beat, now in enumerate((0.0, 1.0, 2.0, 3.0)):  # rank 0 beats once a second
        board.entries[0] = Entry(what=LOOP_BODY, age=now, beat=beat)
        assert _look(watch, board, now) is None
    # The first look only beats; then only the neighbour, once per look_every.
    assert board.reads == [[0], [0], [0]]
    assert _look(watch, board, 3.5) is None and len(board.reads) == 3  # no look due
    # Rank 0 freezes after its beat at 3.0: silent for half the timeout at 8.0.
    for now in (4.0, 5.0, 6.0, 7.0):
        assert _look(watch, board, now) is None
    assert _look(watch, board, 8.0) == Stall(what=None, silent=((0, 5.0, LOOP_BODY),))


def test_the_watch_reads_every_peer_once_blocked_for_the_timeout_and_waits() -> None:
    board = _Board()
    waits: list[Waiting] = []
    watch = _watchdog.Watch(10.0, lambda stall: None, hard=False, rank=0, world_size=3,
                            read=board.read, on_wait=waits.append)
    board.entries = {1: Entry(what=COUNTING, age=0.0, beat=0),
                     2: Entry(what=LOOP_BODY, age=0.0, beat=0)}
    watch.begin(COUNTING, 0.0)
    beat = 0
    verdicts = []
    for now in range(0, 40):
        beat += 1  # both peers alive
        board.entries = {rank: attrs.evolve(entry, beat=beat)
                         for rank, entry in board.entries.items()}
        verdicts.append(_look(watch, board, float(now)))
    # Rank 2 is in its loop body: waited for, reported once per timeout.
    assert [v for v in verdicts if v is not None] == [
        Waiting(what=COUNTING, idle=float(t), ranks=((2, LOOP_BODY, 0.0),))
        for t in (10, 20, 30)
    ]
    # Every peer read at most every timeout / 2 while blocked, else the neighbour.
    assert board.reads.count([1, 2]) == 6 and [1, 2] == board.reads[9]
    # Rank 2 enters the count and nothing moves: a stall.
    board.entries[2] = attrs.evolve(board.entries[2], what=COUNTING)
    verdict = None
    now = 40.0
    while verdict is None or isinstance(verdict, Waiting):
        verdict = _look(watch, board, now)
        now += 1.0
    assert verdict == Stall(what=COUNTING, idle=now - 1.0) and now <= 40.0 + 10.0


def test_an_unreadable_board_makes_the_peers_silent_and_says_why() -> None:
    board = _Board()
    watch = _watchdog.Watch(4.0, lambda stall: None, hard=True, rank=1, world_size=2,
                            read=board.read)
    board.entries[0] = Entry(what=LOOP_BODY, age=0.0, beat=1)
    assert _look(watch, board, -1.0) is None  # the first look only beats
    assert _look(watch, board, 0.0) is None
    board.fail = "the store did not answer"
    verdicts = [_look(watch, board, t / 2) for t in range(1, 5)]
    assert verdicts[:3] == [None] * 3
    assert verdicts[3] == Stall(what=None, silent=((0, 2.0, LOOP_BODY),),
                                board_error="TimeoutError: the store did not answer")


def test_the_thread_beats_and_reports_a_silent_peer_once() -> None:
    beats: list[int] = []
    fired: list[Stall] = []
    done = threading.Event()
    board = {1: Entry(what=LOOP_BODY, age=0.0, beat=7)}  # never changes: silent

    def on_stall(stall: Stall) -> None:
        fired.append(stall)
        done.set()

    watch = _watchdog.Watch(0.4, on_stall, hard=False, rank=0, world_size=2,
                            read=lambda ranks: board, beat=lambda: beats.append(1))
    _watchdog.watch(watch)
    try:
        assert done.wait(30.0)
        time.sleep(0.2)
    finally:
        _watchdog.unwatch(watch)
    assert len(fired) == 1 and fired[0].what is None and fired[0].silent[0][0] == 1
    assert len(beats) >= 2


def test_a_peer_that_froze_before_its_first_post_is_silent_once_all_entered() -> None:
    board = _Board()  # rank 1 never posts
    watch = _watchdog.Watch(10.0, lambda stall: None, hard=False, rank=0, world_size=2,
                            read=board.read, beat=lambda: None)
    assert all(_look(watch, board, float(t)) is None for t in range(20))  # not known inside
    watch.peers_inside = True  # the agreement check at entry passed
    verdicts = [_look(watch, board, float(t)) for t in range(20, 30)]
    assert verdicts[:5] == [None] * 5
    assert verdicts[5] == Stall(what=None, silent=((1, 5.0, _watchdog.NO_ENTRY),))


def test_no_silence_once_every_rank_has_finished_the_protocol() -> None:
    board = _Board()
    watch = _watchdog.Watch(10.0, lambda stall: None, hard=False, rank=0, world_size=2,
                            read=board.read, beat=lambda: None)
    board.entries[1] = Entry(what="post hooks", age=0.0, beat=3)  # then it exits
    watch.silence = False  # this rank runs its post hooks
    assert all(_look(watch, board, float(t)) is None for t in range(20))
    watch.silence = True
    # Seen from the second look on (at 1.0).
    assert _look(watch, board, 20.0) == Stall(what=None, silent=((1, 19.0, "post hooks"),))
