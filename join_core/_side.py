"""``SideCollective``: one line to make any per-iteration collective part of a Join.

Theory of operation
-------------------
A training iteration often runs collectives that belong to no model or
optimizer: a logging all-reduce, a barrier, a metric sync, a framework's
per-batch broadcast, a report to a cluster manager. Once a rank joins, nobody
issues them for it, and the active ranks hang in them. A
:class:`SideCollective` wraps such a call:

- *on an active rank*, calling the wrapper tells the Join that this rank has not
  joined (``Join.notify_join_context``: the first joinable of a Join sends the
  heartbeat, any other sends nothing) and then calls the wrapped function;
- *on a joined rank*, its ``main_hook`` runs the *shadow* once per shadow
  round: the same collective with a neutral contribution (zeros for a sum, a
  plain barrier for a barrier).

The Join's list is the order of one iteration's collectives, so the wrapper is
listed where its collective runs: ``Join([model, log_sync])`` when the logging
all-reduce follows the backward pass. It must be called exactly once per
iteration on every active rank (a call every k-th step cannot be shadowed: a
joined rank cannot tell which rounds have it).

*Its process group.* With ``process_group=None`` it *follows* the Join: it
has no group of its own (``join_follows_group``), and the Join takes the
group and device of its other joinables; alone in a Join it needs one
(``Join`` raises ``ValueError``). With a group it is an ordinary joinable of
that group.

*Misuse is an error before any collective.* Called inside an enabled Join (on
this thread) that does not list it, a joined peer would never shadow its
collective: :class:`LocalProtocolError` saying to list it. Called with
arguments when no shadow was given, the default shadow (``fn()``, no
arguments) could not match the call: the same error, saying to pass
``shadow=``. A call made by its own shadow (``shadow=lambda: log_sync(zero)``)
runs ``fn`` without a heartbeat. Outside any Join the wrapper just calls ``fn``.

Standard library only; ``joinkit.adapters.torch.collectives`` builds torch shadows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _join
from ._errors import LocalProtocolError
from ._join import Join, Joinable, JoinHook

__all__ = ["SideCollective"]


class SideCollective(Joinable):
    """A per-iteration collective that no model or optimizer owns, made joinable.

    Example::

        log_sync = SideCollective(
            lambda t: dist.all_reduce(t),             # what active ranks run
            shadow=lambda: dist.all_reduce(torch.zeros(())),  # a joined rank's part
        )
        with Join([model, log_sync]):
            for batch in data:
                loss = model(batch).sum()
                loss.backward()
                log_sync(loss.detach().clone())

    Args:
        fn: the collective call, ``fn(*args, **kwargs)``; calling the wrapper
            returns its result.
        shadow: a joined rank's side of one call, ``shadow()`` (no arguments),
            run once per shadow round: the same collective with a neutral
            contribution. Default: ``fn()`` with no arguments, which suits a
            collective that takes none (a barrier); a call with arguments then
            raises ``LocalProtocolError``, so pass ``shadow=`` for anything
            that carries data.
        process_group: the group of ``fn``'s collective (for the Join's own
            collectives); ``None`` follows the other joinables of the Join.
        device: the device for the Join's collectives on ``process_group``
            (``None``: the group's default); unused when following.
        name: what messages and ``repr`` call it (default: ``fn``'s name).

    Raises:
        TypeError: ``fn`` or ``shadow`` is not callable.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        shadow: Callable[[], Any] | None = None,
        *,
        process_group: Any = None,
        device: Any = None,
        name: str | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"SideCollective(fn): fn must be callable, not {type(fn).__qualname__}")
        if shadow is not None and not callable(shadow):
            raise TypeError(
                f"SideCollective(shadow=...) must be callable (a joined rank calls shadow() "
                f"once per shadow round), not {type(shadow).__qualname__}"
            )
        super().__init__()
        self._fn = fn
        self._shadow = shadow
        self._group = process_group
        self._device = device
        self._shadowing = False
        #: Whether it takes the Join's process group (``process_group=None``).
        self.join_follows_group = process_group is None
        self.name = name if name is not None else _callable_name(fn)
        #: How many shadow rounds this object ran (over every Join it was in).
        self.shadow_rounds = 0

    def __repr__(self) -> str:
        return f"SideCollective({self.name!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the collective: notify the Join (if inside one), then ``fn``.

        Returns:
            What ``fn(*args, **kwargs)`` returns.

        Raises:
            LocalProtocolError: inside an enabled Join that does not list this
                wrapper, or with arguments when no ``shadow`` was given.
            RuntimeError: throw mode, and some rank exhausted its inputs.
            PeerAborted: another rank failed; let it leave the Join block.
        """
        config = self._join_config
        if config.enable:
            if not self._shadowing:
                if self._shadow is None and (args or kwargs):
                    raise LocalProtocolError(
                        f"{self!r} was called with arguments but has no shadow: a joined "
                        "rank would shadow it with fn() and no arguments, which cannot "
                        "match this call. Pass SideCollective(fn, shadow=...), a no-argument "
                        "callable issuing the same collective with a neutral contribution "
                        "(joinkit.adapters.torch.collectives builds them for torch)"
                    )
                Join.notify_join_context(self)
        elif config.join is None and _join._enabled_joins() > 0:
            raise LocalProtocolError(
                f"{self!r} was called inside a `with Join(...)` block that does not list "
                "it: a rank that joins would never shadow its collective, and the others "
                "would hang in it. Add it to the Join's list where its collective runs in "
                "an iteration, e.g. Join([model, side_collective])"
            )
        return self._fn(*args, **kwargs)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook whose ``main_hook`` runs the shadow once per shadow round."""
        return _SideShadow(self)

    @property
    def join_device(self) -> Any:
        """The device given, or the Join's device while following one."""
        if self.join_follows_group:
            join = self._join_config.join
            return None if join is None else join.device
        return self._device

    @property
    def join_process_group(self) -> Any:
        """The group given, or the Join's group while following one (else ``None``)."""
        if self.join_follows_group:
            join = self._join_config.join
            return None if join is None else join.process_group
        return self._group

    def run_shadow(self) -> Any:
        """A joined rank's side of one call: ``shadow()``, or ``fn()`` without one.

        Calls of the wrapper made by the shadow itself send no heartbeat.

        Returns:
            What the shadow returns.
        """
        self._shadowing = True
        try:
            result = self._shadow() if self._shadow is not None else self._fn()
        finally:
            self._shadowing = False
        self.shadow_rounds += 1
        return result


class _SideShadow(JoinHook):
    def __init__(self, side: SideCollective) -> None:
        self.side = side

    def main_hook(self) -> None:
        self.side.run_shadow()


def _callable_name(fn: Any) -> str:
    for attribute in ("__qualname__", "__name__"):
        value = getattr(fn, attribute, None)
        if isinstance(value, str):
            return value
    return type(fn).__qualname__
