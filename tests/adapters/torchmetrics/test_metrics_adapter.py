"""The torchmetrics adapter in one process: registration, lazy import, the version guard.

The multi-rank behaviour is ``test_metrics_dist.py``'s.
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from typing import Any

import pytest

torchmetrics = pytest.importorskip("torchmetrics")

from joinkit.adapters import METRICS, UnsupportedTorchmetricsError  # noqa: E402
from joinkit.adapters.torchmetrics import _private as private  # noqa: E402

pytestmark = pytest.mark.needs_torch


def test_registered_through_the_entry_point() -> None:
    found = {ep.name: ep.value for ep in entry_points(group="joinkit.adapters")}
    assert found["torchmetrics"] == "joinkit.adapters:METRICS"


@pytest.mark.launches
def test_matching_imports_nothing() -> None:
    code = ("import sys, joinkit.adapters as a; "
            "assert not a.METRICS.matches(object()); "
            "assert 'torchmetrics' not in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_matches_metrics_and_collections() -> None:
    from torchmetrics import MeanSquaredError, MetricCollection

    metric = MeanSquaredError()
    assert METRICS.matches(metric) and METRICS.matches(MetricCollection([metric]))
    assert not METRICS.matches(torchmetrics)


@pytest.mark.launches
def test_missing_torchmetrics_names_the_extra() -> None:
    code = ("import sys; sys.modules['torchmetrics'] = None\n"
            "try:\n    import joinkit.adapters.torchmetrics\n"
            "except ImportError as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert "pip install 'joinkit[metrics]'" in run.stdout


def test_this_torchmetrics_passes_the_guard() -> None:
    assert private.problems(private.MEMBERS) == []
    private.check()


def test_extra_and_guard_agree() -> None:
    from pathlib import Path

    root = Path(__file__).parents[3]
    line = next(ln for ln in (root / "pyproject.toml").read_text().splitlines()
                if ln.startswith("metrics = "))
    assert f'"torchmetrics{private.SUPPORTED_TORCHMETRICS}"' in line
    assert private.SUPPORTED_TORCHMETRICS == f">={private.TESTED_TORCHMETRICS[0]}"
    pin = f"torchmetrics=={private.TESTED_TORCHMETRICS[-1]}"
    assert pin in (root / "constraints.txt").read_text().splitlines()


@pytest.mark.parametrize("version", ["1.8.2", "2.0.0", "3.1.0", "garbage"])
def test_the_guard_table_decides_not_the_version(monkeypatch: Any, version: str) -> None:
    """Any version number whose members are as listed passes (no range check)."""
    monkeypatch.setattr(private, "_checked", False)
    monkeypatch.setattr(torchmetrics, "__version__", version)
    private.check()


def test_a_changed_member_is_a_loud_error(monkeypatch: Any) -> None:
    from torchmetrics import Metric

    def _sync_dist(self: Any, fn: Any) -> None: ...

    monkeypatch.setattr(private, "_checked", False)
    monkeypatch.setattr(Metric, "_sync_dist", _sync_dist)
    with pytest.raises(UnsupportedTorchmetricsError, match="Metric._sync_dist has the param") as e:
        private.check()
    assert f"found torchmetrics {torchmetrics.__version__}; joinkit's torchmetrics" in str(e.value)
    assert f"torchmetrics{private.SUPPORTED_TORCHMETRICS} wherever" in str(e.value)
