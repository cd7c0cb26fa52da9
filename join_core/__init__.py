"""joinkit: a framework-agnostic Join for data-parallel training with uneven inputs.

This package is the core (the folder ``join_core/`` in the repository): a pure
join state machine, the torch-compatible shell (``Join``, ``Joinable``,
``JoinHook``) and the ports that backends (``joinkit.backends``) and adapters
(``joinkit.adapters``) plug into. Importing it imports the standard library and
attrs only.
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
from ._join import Join, Joinable, JoinConfig, JoinHook
from ._ports import Adapter, JoinBackend, register_adapter
from ._reports import JoinReport, LostRank, format_reports, write_chart
from ._side import SideCollective
from ._side_channel import SideChannel
from ._wire import HEARTBEAT_FLAG, split_heartbeat_flags

__all__ = [
    "Join",
    "Joinable",
    "JoinHook",
    "JoinConfig",
    "SideCollective",
    "SideChannel",
    "JoinReport",
    "LostRank",
    "JoinBackend",
    "Adapter",
    "register_adapter",
    "format_reports",
    "write_chart",
    "HEARTBEAT_FLAG",
    "split_heartbeat_flags",
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
