"""The torchmetrics internals the metrics adapter relies on, and the check that they are there.

Theory of operation
-------------------
To shadow a metric's per-step sync (``dist_sync_on_step=True``) on a joined
rank, ``adapters.torchmetrics`` must know how many tensors one sync gathers
and in which order, and it must route that sync through its own gather. It
relies on torchmetrics 1.9's shape of the code, which torchmetrics does not
promise to keep:

- ``Metric.forward`` takes the full-state path when ``dist_sync_on_step`` is
  set, whose ``compute()`` syncs the *batch* state through ``self.sync`` (so
  the adapter, which replaces ``sync`` on the object for the Join's length,
  sees every per-step sync) and then restores the accumulated local state;
- ``Metric._sync_dist`` calls ``dist_sync_fn`` once per state, in the order of
  ``Metric._reductions``, a ``dim_zero_cat`` list state pre-concatenated into
  one tensor (an empty one into an empty tensor);
- ``MetricCollection.forward`` calls each member's forward, in order.

A release that changes any of these could make a joined rank shadow the wrong
number of gathers: silently wrong numbers, or a mismatch. So the members in
:data:`MEMBERS` (the same :class:`~joinkit.adapters._guards.Member` records and
checks as torch's, with ``called_by`` for the call chain above) are checked once
per process, when the first torchmetrics object is adapted; a problem raises
:class:`joinkit.adapters.UnsupportedTorchmetricsError` naming the version found
and each member. The table decides, not the version number: the ``metrics``
extra's range (:data:`SUPPORTED_TORCHMETRICS`) has no upper bound, and its
lower bound is the release that was current a year before this joinkit
(:data:`TESTED_TORCHMETRICS`' first; docs/compat.md). Nothing is checked per
iteration.
"""

from __future__ import annotations

import sys
from typing import Any

from .._errors import UnsupportedTorchmetricsError
from .._guards import Member, Need, problems, refusal, supported_spec

__all__ = ["SUPPORTED_TORCHMETRICS", "TESTED_TORCHMETRICS", "MEMBERS", "check"]

#: The torchmetrics releases joinkit's tests ran on: the oldest supported (the
#: ``metrics`` extra's lower bound) and the dev pin (``constraints.txt``).
TESTED_TORCHMETRICS = ("1.8.2", "1.9.0")
#: The ``metrics`` extra's range (no upper bound: :data:`MEMBERS` decides).
SUPPORTED_TORCHMETRICS = supported_spec(TESTED_TORCHMETRICS)

_METRIC = "torchmetrics.metric"
_COLLECTION = "torchmetrics.collections"
_CALL, _ATTR = Need.CALLABLE, Need.ATTRIBUTE


def _m(module: str, name: str, need: Need, why: str, params: tuple[str, ...] = (),
       called_by: tuple[str, ...] = ()) -> Member:
    return Member(module=module, name=name, need=need, params=params, called_by=called_by,
                  why=why)


#: What ``adapters.torchmetrics`` relies on.
MEMBERS = (
    _m(_METRIC, "Metric.forward", _CALL,
       "replaced on the object inside a Join (heartbeat, per-step sync marker)",
       ("self",)),
    _m(_METRIC, "Metric._forward_full_state_update", _CALL,
       "the forward path that syncs per step with dist_sync_on_step",
       ("self",), called_by=(f"{_METRIC}:Metric.forward",)),
    _m(_METRIC, "Metric.sync", _CALL,
       "replaced on the object inside a Join: routes each sync through joinkit's gather",
       ("self", "dist_sync_fn", "process_group", "should_sync", "distributed_available"),
       called_by=(f"{_METRIC}:Metric.sync_context",)),
    _m(_METRIC, "Metric._sync_dist", _CALL,
       "one dist_sync_fn call per state, in _reductions order: what a joined rank shadows",
       ("self", "dist_sync_fn", "process_group"), called_by=(f"{_METRIC}:Metric.sync",)),
    _m(_METRIC, "Metric._reductions", _ATTR,
       "the states a sync gathers and their reductions (a joined rank's shadow)"),
    _m(_METRIC, "Metric.dist_sync_on_step", _ATTR, "whether forward syncs per step"),
    _m(_METRIC, "Metric.process_group", _ATTR, "the group a metric syncs over"),
    _m("torchmetrics.utilities.data", "dim_zero_cat", Need.EXISTS,
       "the reduction of list states that one gather per state covers"),
    _m(_COLLECTION, "MetricCollection._compute_and_reduce", _CALL,
       "MetricCollection.forward calls each member's forward through it",
       ("self", "method_name"), called_by=(f"{_COLLECTION}:MetricCollection.forward",)),
)

_checked = False


def check() -> None:
    """Check :data:`MEMBERS` in this torchmetrics; once per process.

    Raises:
        UnsupportedTorchmetricsError: a member is missing or changed; the message
            names the version found and each problem.
    """
    global _checked
    if _checked:
        return
    found = problems(MEMBERS)
    if found:
        raise UnsupportedTorchmetricsError(refusal(
            "torchmetrics", "torchmetrics", found, TESTED_TORCHMETRICS,
            "Going on could shadow the wrong collectives on a joined rank (wrong metric "
            "values or a hang)"))
    _checked = True


def _version() -> str:
    module: Any = sys.modules.get("torchmetrics")
    return str(getattr(module, "__version__", "(unknown version)"))
