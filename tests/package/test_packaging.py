"""The wheel and the sdist, installed the way a user installs them.

One build (``python -m build``: the sdist, then the wheel built from it) and one
clean virtual environment serve every test here. The environment holds the
joinkit wheel next to a distribution that owns a top-level ``adapters`` package
(as AdapterHub's does), and the programs run from a folder with the user's own
``backends/`` and ``adapters/`` packages, which must not shadow joinkit's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"

pytestmark = [pytest.mark.timeout(600), pytest.mark.launches]


def run(*args: str | Path, cwd: Path = Path("/"), timeout: float = 300) -> str:
    """Run a command (from ``/`` unless told: the checkout's folders must not be on the path)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--outdir", out, ROOT, timeout=600)
    (wheel,) = out.glob("joinkit-*.whl")
    (sdist,) = out.glob("joinkit-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, dists: dict[str, Path]) -> Path:
    """A clean venv with another distribution's top-level ``adapters``, then joinkit."""
    base = tmp_path_factory.mktemp("venv")
    other = base / "other-adapters"
    (other / "adapters").mkdir(parents=True)
    (other / "adapters" / "__init__.py").write_text('WHO = "another library"\n')
    (other / "pyproject.toml").write_text(textwrap.dedent(
        """
        [build-system]
        requires = ["setuptools>=77"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "other-adapters"
        version = "1.0"
        [tool.setuptools]
        packages = ["adapters"]
        """
    ))
    env = base / "env"
    run(sys.executable, "-m", "venv", env)
    python = env / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "-c", CONSTRAINTS, other)
    run(python, "-m", "pip", "install", "-q", "-c", CONSTRAINTS, dists["wheel"])
    return python


def test_wheel_installs_one_top_level_name_with_license_and_types(
    dists: dict[str, Path],
) -> None:
    names = zipfile.ZipFile(dists["wheel"]).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"joinkit"}
    for typed in ("joinkit/py.typed", "joinkit/backends/py.typed", "joinkit/adapters/py.typed"):
        assert typed in names
    assert any(re.fullmatch(r"joinkit-[^/]+\.dist-info/licenses/LICENSE", n) for n in names)
    metadata = zipfile.ZipFile(dists["wheel"]).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))
    ).decode()
    assert "License-Expression: BSD-3-Clause" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    entry_points = zipfile.ZipFile(dists["wheel"]).read(
        next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    ).decode()
    assert "[joinkit.backends]" in entry_points and "[joinkit.adapters]" in entry_points


def test_sdist_carries_license_tests_and_examples(dists: dict[str, Path]) -> None:
    with tarfile.open(dists["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    for needed in (
        "LICENSE",
        "README.md",
        "pyproject.toml",
        "constraints.txt",
        "tests/conftest.py",
        "tests/core/test_machine.py",
        "tests/backends/mpi/programs/mpi_scenarios.py",
        "examples/counter.py",
        "join_core/_machine.py",
        "backends/threads/_world.py",
        "adapters/torch/_joinables.py",
    ):
        assert needed in names, needed
    assert not any("__pycache__" in name for name in names)


def test_another_top_level_adapters_package_is_left_alone(venv: Path) -> None:
    out = run(venv, "-c", textwrap.dedent(
        """
        import adapters, joinkit.adapters, joinkit.backends
        print(adapters.WHO, joinkit.adapters.__name__, joinkit.backends.__name__)
        """
    ))
    assert out.split() == ["another", "library", "joinkit.adapters", "joinkit.backends"]


def _users_folder(base: Path) -> Path:
    """A training script's folder with its own ``backends`` and ``adapters`` packages."""
    folder = base / "project"
    for name in ("backends", "adapters"):
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "__init__.py").write_text(f'MINE = "{name} of the user"\n')
    return folder


def _readme_quick_start() -> str:
    """The README quick start's threads Counter (the block that prints ``[10, 11]``)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    blocks = [b.split("```", 1)[0] for b in section.split("```python\n")[1:]]
    return next(b for b in blocks if "spawn(worker, 2)" in b)


def test_readme_quick_start_and_counter_run_next_to_users_own_packages(
    venv: Path, tmp_path: Path
) -> None:
    folder = _users_folder(tmp_path)
    (folder / "quick_start.py").write_text(
        _readme_quick_start() + "\nimport backends, adapters; print(backends.MINE, adapters.MINE)\n"
    )
    out = run(venv, "quick_start.py", cwd=folder)
    assert out.splitlines() == ["[10, 11]", "backends of the user adapters of the user"]
    (folder / "counter.py").write_text((ROOT / "examples" / "counter.py").read_text())
    out = run(venv, "counter.py", cwd=folder)
    assert sorted(out.splitlines()) == [
        "10 inputs processed before rank 0 joined!",
        "11 inputs processed across all ranks!",
        "11 inputs processed across all ranks!",
        "11 inputs processed before rank 1 joined!",
    ]


def test_uninstalling_joinkit_keeps_the_other_adapters(
    venv: Path, dists: dict[str, Path]
) -> None:
    run(venv, "-m", "pip", "uninstall", "-q", "-y", "joinkit")
    try:
        assert run(venv, "-c", "import adapters; print(adapters.WHO)").strip() == "another library"
    finally:
        run(venv, "-m", "pip", "install", "-q", "-c", CONSTRAINTS, dists["wheel"])


def test_sdist_tests_run_against_the_installed_wheel(
    venv: Path, dists: dict[str, Path], tmp_path: Path
) -> None:
    with tarfile.open(dists["sdist"]) as sdist:
        sdist.extractall(tmp_path, filter="data")
    (unpacked,) = tmp_path.glob("joinkit-*")
    run(venv, "-m", "pip", "install", "-q", "-c", CONSTRAINTS, "pytest", "pytest-timeout",
        "hypothesis")
    # The pure core and the threads backend: torch and MPI are not in this venv.
    out = run(venv, "-m", "pytest", "-q", "-p", "no:cacheprovider",
              "tests/core/test_machine.py", "tests/core/test_join_threads.py", cwd=unpacked,
              timeout=600)
    assert re.search(r"\d+ passed", out) and "failed" not in out, out
