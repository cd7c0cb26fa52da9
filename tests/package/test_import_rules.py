"""The walls of the house (issue 29): the import contracts and the public surface.

- ``import_rules.py`` (the private-names contract) finds what it must and
  nothing else, on small trees written here;
- its import-cycle contract finds every cycle, those made only of imports for
  type checking too, and ``lint-imports`` under the project's configuration
  fails on a package planted with one; the real package has none;
- ``pyproject.toml``'s core contracts list every module of ``join_core/``;
- ``joinkit.lowlevel`` and the other public surfaces export what they say;
- every module path the README and the docs name imports (the paths before
  the one-room-per-library layout are gone: issue 47).

``make lint`` runs the contracts themselves (``lint-imports``).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter depends on tomli there
    import tomli as tomllib

from support import ROOT
from support.import_rules import import_cycles, violations

PLUG_INS = ("pkg.backends", "pkg.adapters")


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, tuple[Path, bool]]:
    modules = {}
    for name, text in files.items():
        is_package = name.endswith(".__init__")
        module = name.removesuffix(".__init__")
        path = tmp_path / (name.replace(".", "_") + ".py")
        path.write_text(text)
        modules[module] = (path, is_package)
    return modules


BASE = {
    "pkg.__init__": "",
    "pkg._core": "_SECRET = 1\nPUBLIC = 2\n",
    "pkg.backends.__init__": "",
    "pkg.backends.lib.__init__": "",
    "pkg.backends.lib._board": "def _store(): ...\ndef store(): ...\n",
    "pkg.adapters.__init__": "",
    "pkg.adapters._guards": "def _version(): ...\ndef version(): ...\n",
    "pkg.adapters.fw.__init__": "",
    "pkg.adapters.fw._private": "_checked = set()\n",
}


@pytest.mark.parametrize(("importer", "source", "expected"), [
    # inside the package: fine
    ("pkg.backends.lib._group", "from ._board import _store\n", []),
    ("pkg.backends.lib._group", "from . import _board\n_board._store()\n", []),
    ("pkg.adapters.fw._x", "from .._guards import version\nfrom . import _private\n", []),
    ("pkg.adapters.fw._x", "from pkg.adapters import _guards\n", []),
    ("pkg.adapters.fw._x", "import pkg.backends.lib as lib\nlib.store\n", []),
    # another package's private names and modules
    ("pkg.adapters.fw._x", "from pkg.backends.lib._board import _store\n",
     [("pkg.backends.lib", "_board"), ("pkg.backends.lib._board", "_store")]),
    ("pkg.adapters.fw._x", "from pkg.backends.lib import _board\n_board._store()\n",
     [("pkg.backends.lib", "_board"), ("pkg.backends.lib._board", "_store")]),
    ("pkg.adapters.fw._x", "import pkg.backends.lib._board as b\nb._store\n",
     [("pkg.backends.lib", "_board"), ("pkg.backends.lib._board", "_store")]),
    ("pkg.adapters.other._x", "from ..fw._private import _checked\n",
     [("pkg.adapters.fw", "_private"), ("pkg.adapters.fw._private", "_checked")]),
    # a parent package's private module is its sub-packages' too
    ("pkg.adapters.other._x", "from pkg.adapters._guards import _version\n", []),
    # the core's privates, from a plug-in: refused although pkg contains it
    ("pkg.backends.lib._group", "from pkg import _core\n", [("pkg", "_core")]),
    ("pkg.adapters.fw._x", "from pkg._core import PUBLIC\n", [("pkg", "_core")]),
    ("pkg.adapters.fw._x", "from pkg._core import _SECRET\n",
     [("pkg", "_core"), ("pkg._core", "_SECRET")]),
    # the core's own modules may use each other's privates
    ("pkg._other", "from ._core import _SECRET\n", []),
])
def test_private_names(tmp_path: Path, importer: str, source: str,
                       expected: list[tuple[str, str]]) -> None:
    modules = _tree(tmp_path, {**BASE, importer: source})
    found = violations(modules, PLUG_INS)
    assert [(module, name) for who, module, name, _ in found if who == importer] == expected
    assert all(who == importer for who, _, _, _ in found)


def _write_package(root: Path, name: str, files: dict[str, str]) -> None:
    for module, text in files.items():
        path = root / name / module
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _cycles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
            files: dict[str, str]) -> list[list[tuple[str, str]]]:
    import grimp

    _write_package(tmp_path, name, files)
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph(name, include_external_packages=False,
                              exclude_type_checking_imports=False, cache_dir=None)
    return [[(importer, imported) for importer, imported, _ in cycle]
            for cycle in import_cycles(graph, {name})]


_PACKAGE_NUMBERS = itertools.count()
TYPING = "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
#: Two modules that import each other only for type checking.
TYPE_CHECKING_CYCLE = {
    "__init__.py": "",
    "_low.py": TYPING + "if TYPE_CHECKING:\n    from ._high import High\n\n"
               "def use(high: High) -> None: ...\n",
    "_high.py": TYPING + "if TYPE_CHECKING:\n    from ._low import use\n\nclass High: ...\n",
}
#: A package's __init__ that loads its module in a function; the module takes
#: a light name from the __init__: still a cycle (the light name belongs in a
#: lower module of its own).
LAZY_FACADE = {
    "__init__.py": "LIGHT = 1\n\ndef __getattr__(name):\n    from . import _heavy\n\n"
                   "    return getattr(_heavy, name)\n",
    "_heavy.py": "from . import LIGHT\n\nHEAVY = LIGHT\n",
}


@pytest.mark.parametrize(("files", "expected"), [
    (TYPE_CHECKING_CYCLE, [[("_high", "_low"), ("_low", "_high")]]),
    # one way only: a hierarchy
    ({**TYPE_CHECKING_CYCLE, "_high.py": "class High: ...\n"}, []),
    # an import inside a function counts
    ({"__init__.py": "", "_a.py": "def f():\n    from . import _b\n",
      "_b.py": "from . import _a\n"}, [[("_a", "_b"), ("_b", "_a")]]),
    # three modules, sub-packages included
    ({"__init__.py": "", "_a.py": "from .sub import _b\n", "sub/__init__.py": "",
      "sub/_b.py": "from .. import _c\n", "_c.py": TYPING + "if TYPE_CHECKING:\n"
      "    from . import _a\n"}, [[("_a", "sub._b"), ("_c", "_a"), ("sub._b", "_c")]]),
    # a lazy facade whose module takes a name from the facade is a cycle ...
    (LAZY_FACADE, [[("", "_heavy"), ("_heavy", "")]]),
    # ... not once the name lives below both
    ({"__init__.py": "from ._light import LIGHT\n\ndef __getattr__(name):\n"
      "    from . import _heavy\n\n    return getattr(_heavy, name)\n",
      "_light.py": "LIGHT = 1\n", "_heavy.py": "from ._light import LIGHT\n\nHEAVY = LIGHT\n"},
     []),
    # the same import at module level or for type checking counts too
    ({**LAZY_FACADE, "__init__.py": "LIGHT = 1\nfrom ._heavy import HEAVY\n"},
     [[("", "_heavy"), ("_heavy", "")]]),
    ({**LAZY_FACADE, "__init__.py": TYPING + "LIGHT = 1\nif TYPE_CHECKING:\n"
      "    from ._heavy import HEAVY\n"}, [[("", "_heavy"), ("_heavy", "")]]),
])
def test_import_cycles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       files: dict[str, str], expected: list[list[tuple[str, str]]]) -> None:
    name = f"cycles{next(_PACKAGE_NUMBERS)}"  # a fresh name: nothing imported or cached

    def full(module: str) -> str:
        return f"{name}.{module}" if module else name

    found = _cycles(tmp_path, monkeypatch, name, files)
    assert found == [[(full(a), full(b)) for a, b in cycle] for cycle in expected]


def _lint(tmp_path: Path, name: str, files: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on a package written here, under the project's own
    settings and acyclic contract."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    [contract] = [c for c in config["contracts"] if c["type"] == "acyclic"]
    _write_package(tmp_path / "src", name, files)
    (tmp_path / "lint.toml").write_text("\n".join([
        "[tool.importlinter]",
        f"root_packages = [{json.dumps(name)}]",
        f"exclude_type_checking_imports = {json.dumps(config['exclude_type_checking_imports'])}",
        f"contract_types = {json.dumps(config['contract_types'])}",
        "[[tool.importlinter.contracts]]",
        f"name = {json.dumps(contract['name'])}",
        'type = "acyclic"',
        f"packages = [{json.dumps(name)}]",
        "",
    ]))
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), str(tmp_path / "lint.toml"), "--no-cache", "--no-logo"], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "src"), str(ROOT)])},
        capture_output=True, text=True, timeout=300)


@pytest.mark.launches
def test_lint_fails_on_a_cycle_made_only_of_imports_for_type_checking(tmp_path: Path) -> None:
    broken = _lint(tmp_path / "broken", "planted", TYPE_CHECKING_CYCLE)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "planted._high -> planted._low (l.4)" in broken.stdout
    assert "planted._low -> planted._high (l.4)" in broken.stdout
    kept = _lint(tmp_path / "kept", "planted",
                 {**TYPE_CHECKING_CYCLE, "_high.py": "class High: ...\n"})
    assert kept.returncode == 0, kept.stdout + kept.stderr


def test_the_package_has_no_import_cycle() -> None:
    import grimp

    graph = grimp.build_graph("joinkit", include_external_packages=False,
                              exclude_type_checking_imports=False, cache_dir=None)
    assert import_cycles(graph, {"joinkit"}) == []
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert config["exclude_type_checking_imports"] is False
    assert [c["packages"] for c in config["contracts"] if c["type"] == "acyclic"] == [["joinkit"]]


def _contracts() -> list[dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts: list[dict[str, object]] = config["tool"]["importlinter"]["contracts"]
    return contracts


def test_the_core_contracts_list_every_core_module() -> None:
    core = {f"joinkit.{path.stem}" for path in (ROOT / "join_core").glob("*.py")
            if path.stem != "__init__"}
    listed = [set(c["source_modules"]) for c in _contracts()  # type: ignore[call-overload]
              if c["type"] == "forbidden" and str(c["name"]).startswith("The core ")
              and "joinkit" not in c["source_modules"]]  # type: ignore[operator]
    assert len(listed) == 2
    for modules in listed:
        assert modules == core, f"add {sorted(core - modules)}, drop {sorted(modules - core)}"


def test_every_package_folder_is_a_package_in_pyproject() -> None:
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
                   ["tool"]["setuptools"]["packages"])
    names = {"join_core": "joinkit", "backends": "joinkit.backends",
             "adapters": "joinkit.adapters"}
    found = set()
    for folder, package in names.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *parts)))
    assert found == packages


def test_lowlevel_exports_what_it_lists() -> None:
    import joinkit
    import joinkit.backends
    import joinkit.lowlevel as lowlevel

    for name in lowlevel.__all__:
        assert getattr(lowlevel, name) is not None, name
    assert lowlevel.register_backend is joinkit.backends.register
    assert lowlevel.resolve_backend is joinkit.backends.resolve
    assert lowlevel.ALARM == 2.0**52 and lowlevel.decode_tally(3.0) == (3, False)
    assert set(joinkit.__all__) <= set(dir(joinkit))


def test_capabilities_are_looked_up_once_into_one_value() -> None:
    from joinkit.backends.threads import spawn
    from joinkit.lowlevel import BackendCapabilities, SupportsStatusBoard, capabilities

    class Bare:
        rank, world_size = 0, 1

        def heartbeat(self, value: float) -> None: ...
        def count(self, value: float) -> float: return value
        def all_gather_object(self, obj: object) -> list[object]: return [obj]

    bare = capabilities(Bare())  # type: ignore[arg-type]
    assert bare == BackendCapabilities()
    def look(group: object) -> tuple[BackendCapabilities, bool]:
        return capabilities(group), isinstance(group, SupportsStatusBoard)  # type: ignore[arg-type]

    [(caps, has_board)] = spawn(look, 1)
    assert caps.abort is not None and caps.peer_status is not None and has_board
    assert caps.counts_collectives and caps.start_rank_loss_recovery is None


#: Modules the README and the docs name, all of which must import (torch's
#: rooms need torch, which the test environment has).
DOCUMENTED = re.compile(r"\bjoinkit(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _documented_modules() -> set[str]:
    import importlib

    names = set()
    for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        names.update(DOCUMENTED.findall(path.read_text()))
    modules = set()
    for name in names:
        parts = name.split(".")
        for end in range(len(parts), 0, -1):  # the longest prefix that is a module
            candidate = ".".join(parts[:end])
            try:
                importlib.util.find_spec(candidate)
            except (ImportError, ValueError):
                continue
            if importlib.util.find_spec(candidate) is not None:
                modules.add(candidate)
                break
    return modules


@pytest.mark.launches
def test_every_documented_module_path_imports() -> None:
    modules = sorted(_documented_modules())
    assert "joinkit.adapters.torch.data" in modules and "joinkit.lowlevel" in modules
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\n"
    run = subprocess.run([sys.executable, "-W", "error::DeprecationWarning:joinkit",
                          "-c", code, *modules], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
