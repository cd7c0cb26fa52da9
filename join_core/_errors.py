"""The errors joinkit raises, split by who is at fault.

``LocalProtocolError`` means this rank used joinkit wrongly (bad arguments, a
notify outside any Join, an observation the state machine cannot accept).
``PeerError`` means the trouble came from another rank: collectives that
disagree, a rank that never arrives, a rank that failed. Every class derives
from ``RuntimeError`` so code written against torch's Join (which raises
``RuntimeError``) keeps catching them.
"""

from __future__ import annotations

__all__ = [
    "JoinError",
    "LocalProtocolError",
    "PeerError",
    "EarlyTermination",
    "CollectiveMismatch",
    "RankTimeout",
    "PeerFailure",
    "PeerAborted",
    "AgreementError",
]


class JoinError(RuntimeError):
    """Base class of every error joinkit raises on purpose."""


class LocalProtocolError(JoinError):
    """This rank used the join protocol wrongly; the message says how to fix it."""


class PeerError(JoinError):
    """Another rank caused the trouble (it disagrees, is missing, or failed)."""


class EarlyTermination(JoinError):
    """``throw_on_early_termination=True`` and uneven inputs were detected.

    The message is torch's, word for word: ``"Rank {r} exhausted all inputs."``
    on a joined rank, ``"Detected at least one rank that exhausted inputs.
    Throwing across all ranks."`` on the others.
    """


class CollectiveMismatch(PeerError):
    """Ranks called different collectives at the same point of their sequence."""


class RankTimeout(PeerError):
    """Some ranks did not reach a collective in time; the message names them."""


class PeerFailure(PeerError):
    """Another rank raised inside the Join context.

    Attributes:
        rank: the failing rank.
        exc_type: the name of its exception type.
        exc_message: its exception message.
    """

    def __init__(self, rank: int, exc_type: str, exc_message: str) -> None:
        super().__init__(
            f"rank {rank} failed inside the Join context with "
            f"{exc_type}: {exc_message}"
        )
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message

    def __reduce__(self) -> tuple[type[PeerFailure], tuple[int, str, str]]:
        # args holds only the message; pickle must rebuild from the fields.
        return (type(self), (self.rank, self.exc_type, self.exc_message))


class PeerAborted(PeerError):
    """Raised inside the loop when a heartbeat shows that another rank failed.

    Let it propagate out of the ``with Join(...)`` block: on the way out the
    rank shadows with the others until everyone has stopped, then raises a
    :class:`PeerFailure` naming the failing rank and its exception.
    """


class AgreementError(PeerError):
    """Ranks entered a Join with different settings (see the message's table)."""
