"""joinkit's own import-linter contract: private names stay in their package.

import-linter's ``private_modules`` contract keeps a private *module*
(``pkg._mod``) inside its package; this one does the same for the private
names a module defines (``from joinkit.backends.torch_dist._board import
_store``, ``torch_dist._store()`` on a module alias), and keeps plug-ins off
the core's private modules (``from joinkit import _ports``), which
``private_modules`` allows because ``joinkit.backends`` lies inside ``joinkit``:

- a module's private name (``_x``, not a dunder) may be used by modules of the
  module's own package (the package itself, or its parent package for a plain
  module) and their descendants;
- the sub-packages listed in ``plug_ins`` (``joinkit.backends``,
  ``joinkit.adapters``) see only the public names of their parent (the core),
  as a third party's plug-in would.

It reads the sources with ``ast``: ``from M import _x`` (absolute or relative),
``import M`` / ``from P import M`` followed by ``M._x``. ``pyproject.toml``
declares it (``contract_types``) and ``make lint`` runs it with the others.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck

__all__ = ["PrivateNamesContract", "violations"]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_of(module: str, is_package: bool) -> str:
    return module if is_package else module.rpartition(".")[0]


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _absolute(importer: str, importer_is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = _package_of(importer, importer_is_package).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _uses(tree: ast.AST, importer: str, is_package: bool,
          modules: set[str]) -> Iterator[tuple[str, str, int]]:
    """(module, private name, line) for every private name of ``modules`` used."""
    aliases: dict[str, str] = {}  # local name -> a module of ``modules``
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parent, _, leaf = alias.name.rpartition(".")
                if parent in modules and _private(leaf):  # import pkg._mod
                    yield parent, leaf, node.lineno
                if alias.name in modules and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(importer, is_package, node)
            if source in modules:
                parent, _, leaf = source.rpartition(".")
                if parent in modules and _private(leaf):  # from pkg._mod import x
                    yield parent, leaf, node.lineno
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if _private(alias.name) and source in modules:
                    yield source, alias.name, node.lineno  # a name or a module
                if full in modules:  # a module: its private names through the alias
                    aliases[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and _private(node.attr)):
            yield aliases[node.value.id], node.attr, node.lineno


def violations(modules: dict[str, tuple[Path, bool]],
               plug_ins: tuple[str, ...] = ()) -> list[tuple[str, str, str, int]]:
    """Every private name used outside its package.

    Args:
        modules: module name -> (its source file, whether it is a package).
        plug_ins: sub-packages that see only their parent's public names.

    Returns:
        ``(importer, module, name, line)``, sorted.
    """
    known = set(modules)
    found = []
    for importer, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for module, name, line in _uses(tree, importer, is_package, known):
            owner = _package_of(module, modules[module][1])
            legal = _inside(importer, owner) and not any(
                _inside(importer, plug_in) and not _inside(module, plug_in)
                for plug_in in plug_ins)
            if not legal:
                found.append((importer, module, name, line))
    return sorted(set(found))


def _sources(graph_modules: set[str], packages: set[str]) -> dict[str, tuple[Path, bool]]:
    out = {}
    for module in graph_modules:
        if not any(_inside(module, package) for package in packages):
            continue
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        out[module] = (Path(spec.origin), spec.submodule_search_locations is not None)
    return out


class PrivateNamesContract(Contract):
    """A module's private names are used from inside its package only (module doc).

    Configuration options:
        - packages: the packages whose modules are checked (and whose private
          names are protected).
        - plug_ins: sub-packages that see only the public names of their parent.
    """

    type_name = "private_names"

    packages = fields.SetField(subfield=fields.StringField())
    plug_ins = fields.SetField(subfield=fields.StringField(), required=False)

    def check(self, graph, verbose: bool) -> ContractCheck:  # type: ignore[no-untyped-def]
        packages = set(self.packages)  # type: ignore[call-overload]
        plug_ins = tuple(sorted(self.plug_ins or ()))  # type: ignore[call-overload]
        found = violations(_sources(set(graph.modules), packages), plug_ins)
        return ContractCheck(kept=not found, metadata={"violations": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        output.print_error(
            "Private names may only be used from inside their module's package:", bold=False)
        output.new_line()
        for importer, module, name, line in check.metadata["violations"]:
            output.print_error(f"- {importer} (l.{line}) uses {module}.{name}", bold=False)
            output.new_line()
