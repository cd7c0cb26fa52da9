"""The status board's library-independent part (``backends._status``).

The transports (torch's store, MPI's listener, the threads' shared dict) are
tested through ``peer_status``/``peer_board`` in each backend's tests; these
pin the entry, its encoding and its texts, with times passed in.
"""

from __future__ import annotations

import io
import itertools
import os
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from joinkit.backends._status import (
    NO_STATUS,
    Post,
    Posted,
    age,
    board_entry,
    decode,
    encode,
    gone_text,
    status_text,
    this_process,
)
from joinkit.backends.threads._board import ThreadsBoard


def test_an_entry_survives_the_store_encoding() -> None:
    for posted in (Posted(what="in its loop body", at=1700000000.25, beat=7),
                   Posted(what="counting non-joined ranks (shadow round 3)", at=2.5)):
        assert decode(encode(posted)) == posted
        assert decode(encode(posted).encode()) == posted  # a store hands back bytes


def test_texts_and_board_entries_give_the_age_never_negative() -> None:
    posted = Posted(what="joined", at=100.0, beat=3)
    assert status_text(posted, now=101.54) == "joined (1.5 s ago)"
    assert board_entry(posted, now=102.0) == ("joined", 2.0, 3)
    # Another host's clock a little ahead: the age is 0, not negative.
    assert age(posted, now=99.0) == 0.0
    assert status_text(posted, now=99.0) == "joined (0.0 s ago)"
    assert status_text(None, now=5.0) == NO_STATUS == "no status posted"


def test_a_post_shows_nothing_before_a_status_and_stamps_by_its_clock() -> None:
    times = itertools.count(10.0)
    post = Post(lambda: next(times))
    post.beat()  # the watchdog may beat before the Join posts
    assert post.read() is None
    post.status("entering")
    first = post.read()
    assert first is not None and (first.what, first.at) == ("entering", 10.0)
    assert first.beat is not None
    post.beat()
    second = post.read()
    assert second is not None and second.beat is not None and second.beat > first.beat


def test_a_post_is_published_again_only_when_it_changed() -> None:
    times = itertools.count(0.0)
    post = Post(lambda: next(times))
    assert post.unpublished() is None  # nothing posted yet
    post.status("in its loop body")
    posted = post.unpublished()
    assert posted is not None
    post.published(posted)
    assert post.unpublished() is None
    post.status("in its loop body")  # the same text again: a new time, so news
    again = post.unpublished()
    assert again is not None and again.at > posted.at
    post.published(again)
    post.beat()
    beaten = post.unpublished()
    assert beaten is not None and beaten.beat != again.beat


def test_two_posts_never_share_a_beat_number() -> None:
    one, other = Post(float), Post(float)
    one.status("a")
    other.status("b")
    one.beat()
    other.beat()
    a, b = one.read(), other.read()
    assert a is not None and b is not None and a.beat != b.beat


def test_the_threads_board_notes_and_reads_the_ranks_that_posted() -> None:
    board = ThreadsBoard()
    board.post(1, "counting non-joined ranks (shadow round 3)")
    assert board.note(0, now=0.0) == ""
    entries = board.entries([0, 1, 2])
    assert list(entries) == [1]
    what, seconds, beat = entries[1]
    assert what == "counting non-joined ranks (shadow round 3)"
    assert seconds >= 0.0 and beat is None
    note = board.note(1, now=time.monotonic())
    assert note.startswith("; its Join: counting non-joined ranks (shadow round 3) (")
    assert note.endswith(" s ago)")


@pytest.mark.launches
def test_a_killed_process_is_gone_once_killed_reaped_or_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        process = {"pid": child.pid, "host": socket.gethostname(), "started": None}
        if sys.platform == "linux":  # its start time, as it would post it
            stat = open(f"/proc/{child.pid}/stat", "rb").read()  # noqa: SIM115 - read at once
            process["started"] = int(stat.rpartition(b")")[2].split()[19])
        assert gone_text(process) is None  # it runs
        assert gone_text({**process, "host": "elsewhere"}) is None  # cannot look
        child.kill()
        # Until its parent reaps it, a killed process is a zombie: gone already.
        deadline = time.monotonic() + 60.0
        while gone_text(process) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gone_text(process) == f"pid {child.pid} on {socket.gethostname()}"
    finally:
        child.kill()
        child.wait()
    assert gone_text(process) == f"pid {child.pid} on {socket.gethostname()}"


def test_a_process_in_exit_is_gone_before_it_is_a_zombie(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGKILLed rank's sockets close in its exit(), before it is a zombie: its
    peers, woken by the reset at once, must already see it gone (under load they ran
    while it was still tearing down, and the note was missing). The kernel marks a
    task in exit() with PF_EXITING (0x4) in field 9 of /proc/PID/stat."""
    from joinkit.backends import _status

    me = this_process()
    if me["started"] is None:
        pytest.skip("no /proc")  # never on Linux: this machine has it
    real = open(f"/proc/{os.getpid()}/stat", "rb").read()  # noqa: SIM115 - read at once
    head, _, tail = real.rpartition(b")")
    fields = tail.split()

    def stat_with(state: bytes, flags: int) -> bytes:
        changed = [state, *fields[1:6], str(flags).encode(), *fields[7:]]
        return head + b") " + b" ".join(changed) + b"\n"

    def fake_open(stat: bytes) -> Any:
        return lambda path, mode="r", *args, **kwargs: io.BytesIO(stat)

    running = int(fields[6])
    monkeypatch.setattr(_status, "open", fake_open(stat_with(b"R", running)), raising=False)
    assert gone_text(me) is None  # the same stat, as read: it runs
    monkeypatch.setattr(_status, "open", fake_open(stat_with(b"R", running | 0x4)),
                        raising=False)
    assert gone_text(me) == f"pid {me['pid']} on {socket.gethostname()}"
    monkeypatch.setattr(_status, "open", fake_open(stat_with(b"D", running | 0x4)),
                        raising=False)
    assert gone_text(me) is not None


def test_this_process_is_not_gone_and_a_reused_pid_is() -> None:
    me = this_process()
    assert me["pid"] == os.getpid() and me["host"] == socket.gethostname()
    assert gone_text(me) is None
    if me["started"] is not None:  # /proc: another start time is another process
        assert gone_text({**me, "started": int(str(me["started"])) + 1}) is not None
    assert gone_text({"pid": "4242", "host": me["host"]}) is None  # malformed: not told
