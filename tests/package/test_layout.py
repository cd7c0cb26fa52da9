"""The test tree mirrors the package (issue 47), and its names are unambiguous.

``tests/conftest.py`` says how the tree works: ``tests/core``,
``tests/backends/<library>`` and ``tests/adapters/<library>`` hold the tests of
those rooms, each folder's launched programs sit in its ``programs/``, and what
several folders share is the ``support`` package. Test modules import their
folder's programs by name, so a name must not mean two files.
"""

from __future__ import annotations

from pathlib import Path

from support import ROOT, TESTS

#: Folders for concerns that span rooms (beside core, backends and adapters).
SPANNING = {"elastic", "faults", "docs", "package"}


def _subpackages(folder: str) -> set[str]:
    return {p.parent.name for p in (ROOT / folder).glob("*/__init__.py")}


def _python_files() -> list[Path]:
    return [p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts]


def test_every_room_of_the_package_has_its_test_folder() -> None:
    for room in ("backends", "adapters"):
        folders = {p.name for p in (TESTS / room).iterdir() if p.is_dir()} - {"programs"}
        assert folders == _subpackages(room), room


def test_the_top_level_holds_only_the_rooms_and_support() -> None:
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {"core", "backends", "adapters", "support"} | SPANNING
    assert [p.name for p in TESTS.glob("*.py")] == ["conftest.py"]


def test_a_module_is_a_test_a_program_or_support() -> None:
    for path in _python_files():
        kind = path.parent.name
        if path.name.startswith("test_"):
            assert kind not in ("programs", "support"), path
        elif path.name != "conftest.py":
            assert kind in ("programs", "support"), \
                f"{path.relative_to(TESTS)}: not a test; put it in its folder's programs/"


def test_names_are_unique_across_the_tree() -> None:
    seen: dict[str, Path] = {}
    for path in _python_files():
        if path.parent.name == "support" or path.name in ("conftest.py", "__init__.py"):
            continue
        assert path.name not in seen, f"{path} and {seen[path.name]}"
        seen[path.name] = path
