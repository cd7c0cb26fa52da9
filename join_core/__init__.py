"""joinery's core: a pure join state machine and the torch-compatible shell.

Importing this package imports the standard library and attrs only.
"""

from ._errors import (
    AgreementError,
    CollectiveMismatch,
    EarlyTermination,
    JoinError,
    LocalProtocolError,
    PeerAborted,
    PeerError,
    PeerFailure,
    RankTimeout,
)
from ._join import Join, Joinable, JoinHook, format_reports
from ._machine import JoinReport

__all__ = [
    "Join",
    "Joinable",
    "JoinHook",
    "JoinReport",
    "format_reports",
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
