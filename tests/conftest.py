"""Shared test settings, and how the test tree's modules find each other.

The tree mirrors the package (``tests/core``, ``tests/backends/<library>``,
``tests/adapters/<library>``, plus ``tests/elastic``, ``tests/faults``,
``tests/docs`` and ``tests/package`` for concerns that span rooms). A folder's
tests sit beside a ``programs/`` folder holding what they launch (rank
programs, scenario files, runners) and the modules they share with those
programs; what several folders share is the ``support`` package here.

- ``tests/`` is on ``sys.path`` of the test process *and*, through
  ``PYTHONPATH``, of every process a test starts, so any test or program
  imports ``support``. (To run a program by hand: ``PYTHONPATH=tests python
  tests/<folder>/programs/<program>.py ...``.)
- A test module imports its folder's programs by name: the folder's
  ``programs/`` goes on ``sys.path`` when the module is collected. Program
  and test file names are unique across the tree
  (``tests/package/test_layout.py``), so no name is ambiguous.

Tiers: ``make test-fast`` runs what is marked neither ``launches`` (it
starts a process: a rank, a launcher, a framework's runtime) nor ``slow``
(in-process but more than a few seconds): the pure core, the threads backend
and every room's unit tests, in under two minutes; ``make test`` runs
everything. The marks are kept honest here: a test not marked ``launches``
that starts a process (``subprocess``, ``os.fork``, ``multiprocessing``), in
its body or in a fixture it sets up, fails with :class:`UnmarkedLaunch`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Open MPI refuses to run as root without these; CI runs as root.
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(TESTS), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)])

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def pytest_configure(config: pytest.Config) -> None:
    # Registered here, not in pyproject.toml: a mark only the test tree reads.
    config.addinivalue_line(
        "markers", "scenarios(*names): the launched scenarios or cells a test reads, so a "
        "run of chosen tests launches only those (support.selected_scenarios)")


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> None:
    """Put a test module's ``programs/`` on ``sys.path`` before the module is imported."""
    programs = file_path.parent / "programs"
    if file_path.name.startswith("test_") and programs.is_dir() and str(programs) not in sys.path:
        sys.path.insert(0, str(programs))


def _needs_torch(item: pytest.Item) -> bool:
    if item.get_closest_marker("needs_torch") is not None:
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return False
    # The MPI scenario cases name their buffer kind: "all_reduce/sum/float32/torch/sync",
    # "buffers/torch-in-place".
    cases = [v for v in callspec.params.values() if isinstance(v, str)]
    return any("/torch/" in case or case.startswith("buffers/torch") for case in cases)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The no-torch CI job (.ci/notorch.sh) runs the MPI tests without torch.
    # The torch cases ran in the main environment; here they are deselected,
    # not skipped, so no run on this machine reports a skip.
    if HAVE_TORCH:
        return
    dropped = [item for item in items if _needs_torch(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not _needs_torch(item)]


class UnmarkedLaunch(RuntimeError):
    """A test that is not marked ``launches`` started a process."""


@contextlib.contextmanager
def _no_launches(item: pytest.Item) -> Iterator[None]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UnmarkedLaunch(
            f"{item.nodeid} starts a process but is not marked launches: add "
            "@pytest.mark.launches (or pytestmark = pytest.mark.launches in its module) "
            "so that make test-fast leaves it out (tests/conftest.py)")

    patches = [(subprocess.Popen, "_execute_child"), (os, "fork"), (os, "posix_spawn"),
               (os, "posix_spawnp"), (multiprocessing.util, "spawnv_passfds")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patches]
    for owner, name, _ in saved:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    if item.get_closest_marker("launches") is not None:
        return (yield)
    with _no_launches(item):  # the fixtures this test sets up, of any scope
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    if item.get_closest_marker("launches") is not None:
        return (yield)
    with _no_launches(item):
        return (yield)
