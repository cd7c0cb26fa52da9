"""Shared test settings."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Open MPI refuses to run as root without these; CI runs as root.
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")

HAVE_TORCH = importlib.util.find_spec("torch") is not None


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
