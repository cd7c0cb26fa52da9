"""Where this torch refuses what a test exercises, the test asserts the refusal instead.

joinkit refuses a feature, on every rank before any collective, where a torch
release cannot do it right; the tests of that feature then check the refusal
(its words, on every rank of every scenario) rather than numbers that cannot
be had. Each test still asserts something on every torch; nothing is skipped.

- :func:`fsdp_refusal`: how this torch refuses FSDP2 on the CPU over gloo,
  which is how every FSDP2 test here runs (``None`` where it runs), and
  :func:`fsdp_cpu_refusal`, the part of it raised as early as ``Join(...)``;
- :func:`or_refused`: a decorator for such a test: where the feature is
  refused it calls the module's check of the refusal with the test's
  arguments instead of the test; :func:`fsdp2_scenarios` is the one for
  the FSDP2 scenarios of a ``support.run_scenarios`` worker;
- :func:`fsdp1_refusal` and :func:`fsdp1_scenarios`: the same for FSDP1, which
  joinkit refuses where this torch lacks a member of its guard group
  (``_private``'s ``FSDP1``; none of 2.6 to 2.15 does).

Importing this module imports nothing of torch; :func:`fsdp_refusal` does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["fsdp_refusal", "fsdp_cpu_refusal", "fsdp1_refusal", "or_refused",
           "scenario_refused", "fsdp2_scenarios", "fsdp1_scenarios"]

Test = TypeVar("Test", bound=Callable[..., Any])


def fsdp_refusal() -> str | None:
    """joinkit's refusal of FSDP2 on the CPU over gloo on this torch, word for word
    (it names the torch version and what is missing), or ``None`` where it runs:
    torch 2.6 (its FSDP2 cannot run on the CPU: refused when the model is adapted),
    2.7 and 2.8 (gloo's reduce_scatter sums where FSDP2 asks for the average:
    refused as the Join enters)."""
    from joinkit.adapters.torch import _private

    return _private.fsdp_cpu_refusal() or _private.fsdp_gloo_refusal()


def fsdp_cpu_refusal() -> str | None:
    """joinkit's refusal of FSDP2 on the CPU on this torch (torch 2.6), raised where a
    CPU model is adapted (``Join(...)``), or ``None`` where it runs on the CPU."""
    from joinkit.adapters.torch import _private

    return _private.fsdp_cpu_refusal()


def fsdp1_refusal() -> str | None:
    """What this torch lacks of FSDP1's guard group, as joinkit's refusal names it
    (its first problem, word for word), or ``None`` where FSDP1 runs."""
    from joinkit.adapters._guards import problems
    from joinkit.adapters.torch import _private

    found = problems(_private.GROUPS["FSDP1"])
    return found[0] if found else None


def or_refused(refusal: Callable[[], str | None],
               check: Callable[[str, dict[str, Any]], None]) -> Callable[[Test], Test]:
    """Decorate a test of a feature that ``refusal()`` says this torch may refuse.

    Where ``refusal()`` gives words, the test runs ``check(words, arguments)``
    instead (``arguments``: the test's fixtures and parameters by name), which
    asserts that every rank was refused with those words.
    """
    def wrap(test: Test) -> Test:
        @functools.wraps(test)
        def run(**arguments: Any) -> Any:
            words = refusal()
            if words is None:
                return test(**arguments)
            check(words, arguments)
            return None

        return run  # type: ignore[return-value]

    return wrap


def scenario_refused(results: dict[str, Any], name: str, words: str) -> None:
    """Every rank of scenario ``name`` (``support.run_scenarios``'s results) was
    refused with ``words``: its error, or the error its result recorded."""
    failed = [f["why"] for f in results.get("_failed", []) if f["name"] == name]
    assert not failed, failed
    records = results.get(name, [])
    assert len(records) == results["_world"][0]["world"], (name, records)
    for record in records:
        text = (record.get("error") or "") if not record["ok"] else repr(record["result"])
        assert words in text, (name, record)


def fsdp2_scenarios(*names: str) -> Callable[[Test], Test]:
    """Decorate a test of the FSDP2 scenarios ``names`` (or of its ``name``
    parameter) in its ``results`` fixture (``support.run_scenarios``'s): where
    this torch refuses FSDP2 on the CPU over gloo (:func:`fsdp_refusal`) it
    asserts that every rank of each was refused by name instead."""
    return _scenarios(fsdp_refusal, names)


def fsdp1_scenarios(*names: str) -> Callable[[Test], Test]:
    """:func:`fsdp2_scenarios` for FSDP1's scenarios and :func:`fsdp1_refusal`."""
    return _scenarios(fsdp1_refusal, names)


def _scenarios(refusal: Callable[[], str | None],
               names: tuple[str, ...]) -> Callable[[Test], Test]:
    import pytest

    def check(words: str, arguments: dict[str, Any]) -> None:
        for name in names or (arguments["name"],):
            scenario_refused(arguments["results"], name, words)

    def wrap(test: Test) -> Test:
        # What the test reads, for a run of chosen tests (support.selected_scenarios).
        marked: Test = pytest.mark.scenarios(*names)(or_refused(refusal, check)(test))
        return marked

    return wrap
