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

    pyproject = (Path(__file__).parents[3] / "pyproject.toml").read_text()
    line = next(ln for ln in pyproject.splitlines() if ln.startswith("metrics = "))
    assert f'"torchmetrics{private._spec()}"' in line


@pytest.mark.parametrize("version", ["1.8.2", "2.0.0", "garbage"])
def test_an_unsupported_version_is_a_loud_error(monkeypatch: Any, version: str) -> None:
    monkeypatch.setattr(private, "_checked", False)
    monkeypatch.setattr(torchmetrics, "__version__", version)
    with pytest.raises(UnsupportedTorchmetricsError, match="outside the supported range") as e:
        private.check()
    assert "pip install 'torchmetrics>=1.9,<2'" in str(e.value)


def test_a_changed_member_is_a_loud_error(monkeypatch: Any) -> None:
    from torchmetrics import Metric

    def _sync_dist(self: Any, fn: Any) -> None: ...

    monkeypatch.setattr(private, "_checked", False)
    monkeypatch.setattr(Metric, "_sync_dist", _sync_dist)
    with pytest.raises(UnsupportedTorchmetricsError, match="Metric._sync_dist has the param"):
        private.check()
