"""Ray Train: ``report``, a drop-in for ``ray.train.report`` inside a Join.

Theory of operation
-------------------
``ray.train.report`` is a barrier across the workers of a Ray Train run: Ray
Train 2.x (its "v2" controller, the default since 2.5x) has every worker agree
on the checkpoint's directory with rank 0 before any worker's report is
queued, and requires that "all workers call it the same number of times". A
per-step report inside ``Join([model])`` therefore deadlocks as soon as a
worker runs out of data: the joined worker shadows DDP's all-reduces while the
others wait for it in the report's barrier (until the process group's
timeout, 30 minutes by default, with a raw gloo timeout naming nothing).

:data:`report` (a :class:`Report`) is a :class:`joinkit.SideCollective` over
``ray.train.report``: list it in the Join where it is called in an iteration
(``Join([model, report])``, the report after the backward pass) and call it
exactly like ``ray.train.report``. On an active worker a call notifies the Join
and reports what it was given; on a joined worker each shadow round calls
``ray.train.report`` once too, so every worker reports the same number of
times, and the run's report count is the longest worker's step count:

- *metrics*: the worker's last reported metrics (``{}`` before its first), so
  the keys a ``CheckpointConfig`` scores on are still there; or what
  ``shadow_metrics`` gives (a dict, or a callable of the last metrics).
  Ray Train attaches rank 0's metrics to a checkpoint; while rank 0 is joined
  those are its last ones (report the checkpoints you score after the Join to
  have fresh ones).
- *checkpoint*: none. Ray Train registers a checkpoint when at least one
  worker reports one, so the active workers' checkpoints are kept; rank 0 names
  the checkpoint's directory (Ray's default name when rank 0 is joined, also
  where the active workers passed ``checkpoint_dir_name``).
- nothing else is forwarded (no ``validation``: Ray requires a checkpoint for it).

Like every side collective it must be called once per iteration on every
active worker (a report every k-th step cannot be shadowed: a joined worker
cannot tell which rounds have one); report less often outside the Join, e.g.
once per epoch after it. Called inside an enabled Join that does not list it,
it raises ``LocalProtocolError`` before anything collective happens; outside
any Join it is ``ray.train.report``.

Ray is imported only when a report is made (``pip install 'joinkit[ray]'``);
only public Ray Train API is used. Tested with ray 2.52.1 (the oldest supported:
current a year before this joinkit) and 2.60 (constraints.txt).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from joinkit import SideCollective

from .._guards import supported_spec

__all__ = ["Report", "report", "SUPPORTED_RAY", "TESTED_RAY"]

#: The Ray releases this module's tests ran on: the oldest supported and the dev pin.
TESTED_RAY = ("2.52.1", "2.60.0")
#: The ``ray`` extra's range: no upper bound (only public Ray Train API is used).
SUPPORTED_RAY = supported_spec(TESTED_RAY)

ShadowMetrics = Mapping[str, Any] | Callable[[Mapping[str, Any]], Mapping[str, Any]] | None


def _ray_train() -> Any:
    try:
        import ray.train
    except ModuleNotFoundError as error:
        if error.name is not None and error.name.split(".")[0] != "ray":
            raise
        raise ModuleNotFoundError(
            "joinkit.adapters.ray needs Ray Train, which could not be imported: "
            "pip install 'joinkit[ray]' (ray[train] " + SUPPORTED_RAY + ")",
            name="ray",
        ) from error
    return ray.train


class Report(SideCollective):
    """``ray.train.report`` as a side collective of a Join.

    Use the ready instance :data:`report`; make another one only for other
    ``shadow_metrics``. Call it as ``ray.train.report``: ``report(metrics,
    checkpoint=None, **kwargs)``, and list it in the Join where it is called
    (``Join([model, report])``).

    Args:
        shadow_metrics: what a joined worker reports per shadow round: ``None``
            (default) for its last reported metrics (``{}`` before any), a dict
            to report always, or a callable taking the last metrics (``{}``
            before any) and returning the dict.
        name: what messages call it.

    Raises:
        TypeError: ``shadow_metrics`` is neither ``None``, a mapping, nor callable.
    """

    def __init__(self, *, shadow_metrics: ShadowMetrics = None,
                 name: str = "joinkit.adapters.ray.report") -> None:
        if shadow_metrics is not None and not (
            isinstance(shadow_metrics, Mapping) or callable(shadow_metrics)
        ):
            raise TypeError(
                "Report(shadow_metrics=...) must be None (the last metrics), a dict, or a "
                f"callable of the last metrics, not {type(shadow_metrics).__qualname__}"
            )
        super().__init__(self._report, shadow=self._shadow_report, name=name)
        self._shadow_metrics = shadow_metrics
        #: The metrics this worker reported last (a copy), ``None`` before any.
        self.last_metrics: dict[str, Any] | None = None
        #: How many reports this object made on this worker, shadows included.
        self.reports = 0

    def __repr__(self) -> str:
        return f"Report({self.name!r})"

    def _report(self, metrics: Mapping[str, Any], checkpoint: Any = None,
                **kwargs: Any) -> None:
        _ray_train().report(metrics, checkpoint=checkpoint, **kwargs)
        self.last_metrics = dict(metrics)
        self.reports += 1

    def shadow_metrics(self) -> dict[str, Any]:
        """What a joined worker reports in its next shadow round.

        Returns:
            A new dict.
        """
        last = dict(self.last_metrics or {})
        chosen = self._shadow_metrics
        if chosen is None:
            return last
        if isinstance(chosen, Mapping):
            return dict(chosen)
        made = chosen(last)
        if not isinstance(made, Mapping):
            raise TypeError(
                f"{self!r}: shadow_metrics returned {type(made).__qualname__}, not a dict "
                "of metrics"
            )
        return dict(made)

    def _shadow_report(self) -> None:
        _ray_train().report(self.shadow_metrics(), checkpoint=None)
        self.reports += 1


#: The drop-in for ``ray.train.report``: ``Join([model, report])``, then
#: ``report(metrics, checkpoint=...)`` once per iteration.
report = Report()
