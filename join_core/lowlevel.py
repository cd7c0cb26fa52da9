"""joinkit's plug-in surface: what a backend or adapter author needs.

Everything here is public, documented and stable in the same way as
``joinkit`` itself; a plug-in (joinkit's own backends and adapters included)
imports these names from here and never a ``joinkit._name``. The import
contracts in ``pyproject.toml`` (``make lint``) check that.

The backend side (docs/guide/writing-a-backend.md):

- :class:`JoinBackend`, :class:`Handle`: the required members of a join backend;
- the optional members, one typed protocol each (``SupportsHeartbeatTotal``,
  ``SupportsCollectiveCount``, ``SupportsAbort``, ``SupportsWait``,
  ``SupportsStatusBoard``, ``SupportsLivenessBeat``, ``SupportsGonePeers``,
  ``SupportsObjectCollectives``,
  ``SupportsRankLossRecovery``), which the Join looks up once, when it is built,
  into a :class:`BackendCapabilities` (:func:`capabilities`);
- :class:`RankLossConfig`: what ``start_rank_loss_recovery`` receives;
- the registry: :func:`register_backend`, :func:`resolve_backend`,
  :func:`find_registered_backend`, and the entry point groups
  :data:`BACKEND_ENTRY_POINTS` and :data:`ADAPTER_ENTRY_POINTS`;
- the wire values of the join collectives and their reading
  (:data:`ACTIVE`, :data:`JOINED`, :data:`FAILING`, :data:`FAILED`,
  :data:`ALARM`, :data:`NOBODY_ACTIVE_BELOW`, :data:`MAX_WORLD_SIZE`,
  :func:`decode_tally`), for a backend that reads a heartbeat's sum itself
  (a group that rebuilds itself after a rank dies).

The adapter side (docs/guide/testing-joinables.md, the adapters' module docs):

- :class:`Adapter`, :func:`register_adapter`, :func:`adapt`: the adapter registry;
- :class:`AdapterJoinable`: the base of a Joinable standing for a framework
  object (held weakly; the Join's config seen as entry and exit hooks);
- :class:`AdapterCache`: one adapter per live framework object;
- :class:`JoinContext`: the Join a joinable's config names (``JoinConfig.join``),
  as the joinable sees it, for the annotations of code that receives it.
"""

from __future__ import annotations

from ._adapting import AdapterCache, AdapterJoinable
from ._joinable import JoinContext
from ._ports import (
    ADAPTER_ENTRY_POINTS,
    BACKEND_ENTRY_POINTS,
    Adapter,
    BackendCapabilities,
    Handle,
    JoinBackend,
    RankLossConfig,
    SupportsAbort,
    SupportsCollectiveCount,
    SupportsGonePeers,
    SupportsHeartbeatTotal,
    SupportsLivenessBeat,
    SupportsObjectCollectives,
    SupportsRankLossRecovery,
    SupportsSideWire,
    SupportsStatusBoard,
    SupportsWait,
    adapt,
    capabilities,
    register_adapter,
)
from ._ports import find_registered as find_registered_backend
from ._ports import register as register_backend
from ._ports import resolve as resolve_backend
from ._side_protocol import BroadcastPlan, GatherPlan, Neutral, ReducePlan, SideWire
from ._wire import (
    ACTIVE,
    ALARM,
    FAILED,
    FAILING,
    JOINED,
    MAX_WORLD_SIZE,
    NOBODY_ACTIVE_BELOW,
    decode_tally,
)

__all__ = [
    "JoinBackend",
    "Handle",
    "BackendCapabilities",
    "capabilities",
    "SupportsHeartbeatTotal",
    "SupportsCollectiveCount",
    "SupportsAbort",
    "SupportsWait",
    "SupportsStatusBoard",
    "SupportsLivenessBeat",
    "SupportsGonePeers",
    "SupportsObjectCollectives",
    "SupportsRankLossRecovery",
    "SupportsSideWire",
    "RankLossConfig",
    "register_backend",
    "resolve_backend",
    "find_registered_backend",
    "BACKEND_ENTRY_POINTS",
    "ADAPTER_ENTRY_POINTS",
    "Adapter",
    "register_adapter",
    "adapt",
    "AdapterJoinable",
    "AdapterCache",
    "JoinContext",
    "ACTIVE",
    "JOINED",
    "FAILING",
    "FAILED",
    "ALARM",
    "NOBODY_ACTIVE_BELOW",
    "MAX_WORLD_SIZE",
    "decode_tally",
    "SideWire",
    "ReducePlan",
    "GatherPlan",
    "BroadcastPlan",
    "Neutral",
]
