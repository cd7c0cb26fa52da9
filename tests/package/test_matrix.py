"""The torch compatibility matrix's script (``.ci/matrix.py``): its tests exist, its cells
say what the runs said, its page says it (issue 48).

The venvs and the runs themselves are ``make matrix``'s (and CI's edge columns); here,
what can go wrong without a run: a renamed test dropping out of a row unnoticed, a
failure read as a pass, a refusal read as a pass.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from support import ROOT


def _matrix() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_matrix", ROOT / ".ci" / "matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ci_matrix"] = module
    spec.loader.exec_module(module)
    return module


matrix = _matrix()


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


@pytest.mark.parametrize("selector", matrix.selected("all"))
def test_every_test_a_row_names_exists(selector: str) -> None:
    path, _, name = selector.partition("::")
    assert (ROOT / path).is_file(), selector
    if name:
        assert name.split("[")[0] in _test_names(ROOT / path), selector


@pytest.mark.parametrize("feature", list(matrix.FEATURES))
def test_a_rows_edge_tests_are_among_its_tests(feature: str) -> None:
    tests = matrix.FEATURES[feature][0]
    for selector in matrix.edge_tests(feature):
        assert any(selector == t or selector.startswith((t + "::", t + "["))
                   for t in tests), selector


def test_the_edge_part_is_part_of_the_whole() -> None:
    whole = matrix.selected("all")
    for selector in matrix.selected("edge"):
        assert any(selector == t or selector.startswith((t + "::", t + "[")) for t in whole)
    assert len(matrix.selected("edge")) < len(whole)


@pytest.mark.needs_torch
def test_the_releases_are_the_adapters_tested_ones() -> None:
    from joinkit.adapters.torch import _private

    releases = matrix.tested_releases()
    assert list(releases.values()) == list(_private.TESTED_TORCH)
    assert list(releases)[0] == "2.6"


def _results(outcome: dict[str, str]) -> dict[str, str]:
    """Every test of every row passed, but those in ``outcome``."""
    results = {}
    for selector in matrix.selected("all"):
        node = selector if "::" in selector else f"{selector}::test_x"
        results[node + "[a]"] = "passed"
    results.update(outcome)
    return results


def test_a_cell_is_failed_refused_passed_or_not_run() -> None:
    fsdp = "tests/adapters/torch/test_fsdp.py::test_fsdp_equals_the_reference[a]"
    ddp = "tests/adapters/torch/test_ddp_round.py::test_x[a]"
    results = _results({fsdp: "failed", ddp: "skipped"})
    cells = matrix.cells(results, {"ZeroRedundancyOptimizer": "torch 9.9 lacks it"}, "all")
    assert cells["FSDP2"] == {"result": "failed", "detail": "1 of 10 failed"}
    assert cells["ZeroRedundancyOptimizer"]["result"] == "refused"
    assert cells["ZeroRedundancyOptimizer"]["detail"] == "torch 9.9 lacks it"
    assert cells["DDP"]["result"] == "passed"  # one skipped, the rest ran
    only_skipped = {k: "skipped" for k in results if "test_replay.py" in k}
    assert matrix.cells({**results, **only_skipped}, {}, "all")["replayed step"]["result"] \
        == "not run"
    assert set(matrix.cells(results, {}, "edge")) == {
        feature for feature, (_, edge) in matrix.FEATURES.items() if edge}


def test_a_junit_report_is_read_by_node_id(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.adapters.torch.test_fsdp" name="test_a[2]"/>'
        '<testcase classname="tests.adapters.torch.test_fsdp" name="test_b">'
        '<failure message="x"/></testcase>'
        '<testcase classname="tests.elastic.test_elastic_torch.Cells" name="test_c">'
        '<skipped/></testcase>'
        '</testsuite></testsuites>')
    assert matrix.outcomes(report) == {
        "tests/adapters/torch/test_fsdp.py::test_a[2]": "passed",
        "tests/adapters/torch/test_fsdp.py::test_b": "failed",
        "tests/elastic/test_elastic_torch.py::test_c": "skipped",
    }
    assert matrix.outcomes(tmp_path / "missing.xml") == {}


def test_the_page_shows_every_row_and_explains_each_refusal_and_failure() -> None:
    run = {"date": "2026-11-28", "commit": "abc1234", "part": "all", "seconds": 60.0,
           "partial": {"FSDP2 with divide_by_initial_world_size=False": "needs torch 2.8"}}
    data = {
        "2.6.0": {**run, "cells": {"FSDP2": {"result": "refused", "detail": "no CPU streams"},
                                   "DDP": {"result": "passed", "detail": "9 tests"}}},
        "2.15.0": {**run, "partial": {}, "cells": {
            "FSDP2": {"result": "failed", "detail": "2 of 10 failed"},
            "DDP": {"result": "passed", "detail": "9 tests"}}},
    }
    page = matrix.render(data)
    assert "| feature | 2.6.0 | 2.15.0 |" in page  # releases in version order, not text order
    assert "| FSDP2 | refused (1) | **failed** (2) |" in page
    assert "| DDP | passed | passed |" in page
    for feature in matrix.FEATURES:
        assert f"| {feature} |" in page
    assert "1. 2.6.0, FSDP2: no CPU streams" in page
    assert "2. 2.15.0, FSDP2: 2 of 10 failed" in page
    assert "2.6.0: FSDP2 with divide_by_initial_world_size=False is refused" in page
    assert "torch 2.6.0: 2026-11-28, commit `abc1234`" in page


@pytest.mark.needs_torch
def test_the_adapters_refusals_use_the_rows_names() -> None:
    """``refused_features()`` names a whole feature by its row here, so its cell reads
    *refused*; any other name is a part of a row (a note on the page)."""
    from joinkit.adapters.torch import _private

    assert {"FSDP2", *_private._FEATURE_OF_GROUP.values()} <= set(matrix.FEATURES)
    # A group not mapped to a row is a part of one: its name is no row's.
    for group in set(_private.GROUPS) - set(_private._FEATURE_OF_GROUP):
        assert group not in matrix.FEATURES, group


def test_a_tested_release_without_a_run_is_a_column_not_run() -> None:
    run = {"date": "2026-11-28", "commit": "abc1234", "part": "edge", "seconds": 60.0,
           "partial": {}, "cells": {"DDP": {"result": "passed", "detail": "6 tests"}}}
    page = matrix.render({"2.6.0": run}, ["2.6.0", "2.7.1"])
    assert "| feature | 2.6.0 | 2.7.1 |" in page
    assert "| DDP | passed | not run |" in page
    assert "| torchmetrics | not run | not run |" in page  # no cell of it in the run
    assert "- torch 2.7.1: not run yet (`make matrix TORCH=2.7`)" in page


# -- the integrations' oldest releases (.ci/integrations.py, --integrations) -------------------

integrations = matrix.integrations


@pytest.mark.parametrize("selector", [t for i in integrations.INTEGRATIONS.values()
                                      for t in i.tests])
def test_every_integration_test_named_exists(selector: str) -> None:
    path, _, name = selector.partition("::")
    assert (ROOT / path).exists(), selector
    if name:
        assert name.split("[")[0] in _test_names(ROOT / path), selector


@pytest.mark.parametrize("name", list(integrations.INTEGRATIONS))
def test_each_oldest_release_is_its_extras_lower_bound(name: str) -> None:
    """The release the venv pins is the extra's ``>=`` (read from the adapter's
    ``TESTED_...``, one place), and nothing caps the extra from above."""
    integration = integrations.INTEGRATIONS[name]
    extras = (ROOT / "pyproject.toml").read_text()
    for distribution, release in integrations.oldest(integration).items():
        assert f'{distribution}>={release}"' in extras or \
            f'{distribution}[train]>={release}"' in extras, (distribution, release)
        pins = integrations.constraints(integration, integrations.oldest(integration))
        assert f"{distribution}=={release}" in pins
        assert sum(line.lower().startswith(f"{distribution}==") for line in pins) == 1
    assert not [line for line in extras.splitlines()
                if any(f'"{d}' in line for d in integration.releases) and ",<" in line]


def test_an_integration_cell_reads_its_report(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text('<testsuites><testsuite><testcase classname="a" name="t1"/>'
                      '<testcase classname="a" name="t2"><error message="x"/></testcase>'
                      '<testcase classname="a" name="t3"><skipped/></testcase>'
                      '</testsuite></testsuites>')
    assert integrations.cell(report) == {"result": "failed", "detail": "1 of 3 failed"}
    report.write_text('<testsuites><testsuite><testcase classname="a" name="t1"/>'
                      '<testcase classname="a" name="t3"><skipped/></testcase>'
                      '</testsuite></testsuites>')
    assert integrations.cell(report) == {"result": "passed", "detail": "1 tests"}
    assert integrations.cell(tmp_path / "none.xml")["result"] == "not run"


def test_the_page_has_a_row_per_integration() -> None:
    run = {"result": "passed", "detail": "14 tests", "releases": {"accelerate": "1.12.0"},
           "date": "2026-11-29", "commit": "abc1234", "seconds": 60.0,
           "tests": ["tests/adapters/accelerate"]}
    page = matrix.render({"integrations": {"accelerate": run}})
    assert "| accelerate | accelerate 1.12.0 | passed (14 tests) | `accelerate` |" in page
    for name in integrations.INTEGRATIONS:
        assert f"\n| {name} | " in page
