"""Each library is imported by its backend module only (style: tiny backends).

Only the torch backend imports torch (``backends/torch_dist.py`` and its
private parts ``backends/_torch_*.py``: the store side and the exit guard) and
only ``backends/mpi.py`` imports mpi4py, at module level or inside a function;
the launcher and the doctor call functions of those modules instead. A scan of the source, so the
rule holds whatever is installed here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BACKENDS = Path(__file__).resolve().parents[1] / "backends"
#: library -> the one backend module that may import it
OWNER = {"torch": "torch_dist.py", "mpi4py": "mpi.py"}
#: library -> the prefix of that backend's private parts, which may import it too
PARTS = {"torch": "_torch_"}


def _owns(library: str, path: Path) -> bool:
    prefix = PARTS.get(library)
    return path.name == OWNER[library] or (prefix is not None and path.name.startswith(prefix))


def _imported(path: Path) -> set[str]:
    """The top-level names of every absolute import in ``path``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


@pytest.mark.parametrize("path", sorted(BACKENDS.glob("*.py")), ids=lambda p: p.name)
def test_only_the_backend_module_imports_its_library(path: Path) -> None:
    strays = {library for library in OWNER
              if library in _imported(path) and not _owns(library, path)}
    assert not strays, f"{path.name} imports {sorted(strays)}: move that code into " + \
        ", ".join(f"backends/{OWNER[library]}" for library in sorted(strays))


def test_the_scan_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "x.py"
    source.write_text("def f():\n    import torch.distributed as dist\n"
                      "    from mpi4py import MPI\n")
    assert _imported(source) == {"torch", "mpi4py"}
