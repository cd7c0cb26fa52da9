"""joinery's core: a pure join state machine and the torch-compatible shell.

Importing this package imports the standard library and attrs only.
"""

from ._errors import (
    CollectiveMismatch,
    EarlyTermination,
    JoinError,
    LocalProtocolError,
    PeerError,
    PeerFailure,
    RankTimeout,
)
from ._join import Join, JoinHook, Joinable

__all__ = [
    "Join",
    "Joinable",
    "JoinHook",
    "JoinError",
    "LocalProtocolError",
    "PeerError",
    "EarlyTermination",
    "CollectiveMismatch",
    "RankTimeout",
    "PeerFailure",
]
