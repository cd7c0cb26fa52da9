"""The backend registry: types, predicates, precedence, entry points, errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from joinkit import _ports, backends

ROOT = Path(__file__).resolve().parents[2]


class FakeBackend:
    def __init__(self, group: Any, device: Any) -> None:
        self.group, self.device = group, device
        self.rank, self.world_size = 0, 1


class GroupA:
    pass


class GroupB(GroupA):
    pass


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each test starts from the registry as it is and leaves it unchanged.
    monkeypatch.setattr(_ports, "_registered", list(_ports._registered))


@pytest.mark.usefixtures("registry")
def test_register_a_type_and_resolve_instances_and_subclasses() -> None:
    backends.register(GroupA, FakeBackend)
    group = GroupB()
    backend = backends.resolve(group, "cpu")
    assert isinstance(backend, FakeBackend)
    assert backend.group is group and backend.device == "cpu"


@pytest.mark.usefixtures("registry")
def test_later_registration_wins_and_predicates_match() -> None:
    backends.register(GroupA, FakeBackend)

    class Special(FakeBackend):
        pass

    backends.register(lambda group: isinstance(group, GroupB), Special)
    assert type(backends.resolve(GroupB())) is Special
    assert type(backends.resolve(GroupA())) is FakeBackend


@pytest.mark.usefixtures("registry")
def test_unknown_group_says_how_to_register() -> None:
    with pytest.raises(TypeError) as caught:
        backends.resolve(object())
    message = str(caught.value)
    assert "builtins.object" in message
    assert "backends.register" in message and "joinkit.backends" in message


def run_python(code: str, extra_path: Path | None = None) -> str:
    env_path = [str(extra_path)] if extra_path else []
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={"PYTHONPATH": ":".join(env_path), "PATH": "/usr/bin:/bin"},
    ).stdout.strip()


@pytest.mark.launches
def test_entry_point_group_resolves_a_third_party_backend(tmp_path: Path) -> None:
    # A minimal installed distribution: a module and its entry point metadata.
    (tmp_path / "pipes_backend.py").write_text(
        textwrap.dedent(
            """
            class PipeGroup:
                rank, world_size = 0, 1

            def resolve(process_group, device):
                return process_group if isinstance(process_group, PipeGroup) else None
            """
        )
    )
    dist_info = tmp_path / "joinkit_pipes-0.1.dist-info"
    dist_info.mkdir()
    metadata = "Metadata-Version: 2.1\nName: joinkit-pipes\nVersion: 0.1\n"
    (dist_info / "METADATA").write_text(metadata)
    entry_points = "[joinkit.backends]\npipes = pipes_backend:resolve\n"
    (dist_info / "entry_points.txt").write_text(entry_points)
    out = run_python(
        """
        import backends, pipes_backend
        group = pipes_backend.PipeGroup()
        assert backends.resolve(group, "cpu") is group
        try:
            backends.resolve(object())
        except TypeError:
            print("ok")
        """,
        extra_path=tmp_path,
    )
    assert out == "ok"


@pytest.mark.launches
def test_resolving_never_imports_a_framework_by_itself() -> None:
    out = run_python(
        """
        import sys
        from joinkit import backends
        from joinkit.backends.threads import spawn
        spawn(lambda group: backends.resolve(group), 2)
        print(sorted({"torch", "mpi4py"} & set(sys.modules)))
        """
    )
    assert out == "[]"
