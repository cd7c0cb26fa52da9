"""A first joinable that never (or not always) notifies: the same cases on every backend.

Each function runs on one rank of any joinkit group (threads, MPI, torch) and
returns what the rank saw; the tests assert on it. ``Silent`` is the mistake:
the first joinable of the Join, whose loop code forgot
``Join.notify_join_context(self)``; ``support.AllReducer`` after it notifies
every iteration. The rank that runs the later notify must raise
``LocalProtocolError`` naming ``Silent`` before the later joinable's
collectives, and every other rank must leave with a clear error too.
"""

from __future__ import annotations

from typing import Any

from joinkit import Join, JoinHook, LocalProtocolError, PeerFailure
from support import AllReducer

SILENT = "the Join's first joinable, Silent, must call Join.notify_join_context(self)"


class Silent(AllReducer):
    """Notifies at its first call and every ``every``-th after (never, by default);
    all-reduces nothing."""

    def __init__(self, group: Any, every: int = 0) -> None:
        super().__init__(group)
        self.every = every
        self.calls = 0

    def __call__(self, num_allreduces: int = 1) -> Any:
        self.calls += 1
        if self.every and (self.calls - 1) % self.every == 0:  # calls 1, 1 + every, ...
            return Join.notify_join_context(self)
        return None

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return JoinHook()


class Twice(AllReducer):
    """A later joinable that notifies before each of two all-reduces per iteration;
    its hook shadows both, and it says so (``join_notifies_per_iteration = None``)."""

    join_notifies_per_iteration = None

    def __call__(self, num_allreduces: int = 1) -> Any:
        for _ in range(2):
            Join.notify_join_context(self)
            self.total += self.reduce_sum(1.0)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return super().join_hook(num_allreduces=2)


class NotifiesInHook(AllReducer):
    """A later joinable whose main hook notifies (a shadow round's own notify)."""

    def join_hook(self, **kwargs: Any) -> JoinHook:
        owner = self
        hook = super().join_hook(**kwargs)

        class Hook(JoinHook):
            def main_hook(self) -> None:
                Join.notify_join_context(owner)
                hook.main_hook()

        return Hook()


def error_of(run: Any) -> dict[str, str] | None:
    try:
        run()
    except (LocalProtocolError, PeerFailure) as error:
        return {"type": type(error).__name__, "message": str(error)}
    return None


def silent_first(group: Any, counts: list[int], every: int = 0,
                 **options: Any) -> dict[str, str] | None:
    """Join([Silent, AllReducer]) over ``counts[rank]`` iterations."""
    silent, later = Silent(group, every), AllReducer(group)

    def run() -> None:
        with Join([silent, later], **options):
            for _ in range(counts[group.rank]):
                silent()
                later()

    return error_of(run)


def legitimate(group: Any, counts: list[int]) -> dict[str, float]:
    """Patterns that must stay quiet: several notifies per heartbeat with the
    opt-out, a hook that notifies, a first joinable that notifies per iteration."""
    first, twice, in_hook = AllReducer(group), Twice(group), NotifiesInHook(group)
    with Join([first, twice, in_hook]):
        for _ in range(counts[group.rank]):
            first()
            twice()
            in_hook()
    return {"first": first.total, "twice": twice.total, "in_hook": in_hook.total}


def check_rank(error: dict[str, str] | None) -> None:
    """Every rank leaves with the mistake's error, its own or a peer's."""
    assert error is not None, "no error"
    assert error["type"] in ("LocalProtocolError", "PeerFailure"), error
    assert SILENT in error["message"], error
    assert "AllReducer" in error["message"], error
