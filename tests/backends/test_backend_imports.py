"""Each library is imported by its backend's package only (style: tiny backends).

Only the torch backend's package (``backends/torch_dist/``) imports torch and
only the MPI backend's (``backends/mpi/``) imports mpi4py, at module level or
inside a function; the launcher and the doctor (``backends/launch/``) call
functions those packages export instead. A scan of the source, so the rule
holds whatever is installed here; ``make lint`` checks the same walls (and
more) with import-linter's contracts in ``pyproject.toml``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BACKENDS = Path(__file__).resolve().parents[2] / "backends"
#: library -> the one backend package that may import it
OWNER = {"torch": "torch_dist", "mpi4py": "mpi"}


def _owns(library: str, path: Path) -> bool:
    return OWNER[library] in path.relative_to(BACKENDS).parts[:-1]


def _imported(path: Path) -> set[str]:
    """The top-level names of every absolute import in ``path``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


@pytest.mark.parametrize("path", sorted(BACKENDS.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(BACKENDS)))
def test_only_the_backend_package_imports_its_library(path: Path) -> None:
    strays = {library for library in OWNER
              if library in _imported(path) and not _owns(library, path)}
    assert not strays, f"{path.relative_to(BACKENDS)} imports {sorted(strays)}: move that " \
        "code into " + ", ".join(f"backends/{OWNER[library]}/" for library in sorted(strays))


def test_each_owner_is_a_package_that_imports_its_library() -> None:
    for library, package in OWNER.items():
        modules = sorted((BACKENDS / package).glob("*.py"))
        assert modules, f"backends/{package}/ has no modules"
        assert any(library in _imported(path) for path in modules)


def test_the_scan_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "x.py"
    source.write_text("def f():\n    import torch.distributed as dist\n"
                      "    from mpi4py import MPI\n")
    assert _imported(source) == {"torch", "mpi4py"}
