"""The protocol diagram, generated from ``joinkit._machine.TRANSITIONS``.

The documentation's protocol page does not hold a hand-drawn diagram: the
MkDocs hook (``hooks.py``) replaces the marker ``<!-- protocol-diagram -->``
with :func:`render` at build time, so the picture is the table itself and
cannot drift from it. ``tests/docs/test_docs.py`` parses the picture back and
compares it with the table.

What the picture shows, per phase: each observation the phase accepts, the
handler that the core runs for it, the phases it may lead to, and the commands
that handler (or a module-level function it calls) can emit. The commands are
found by reading the handlers' source (``ast``): a command class named in a
handler's body, or in a function of ``_machine`` the handler calls.
"""

from __future__ import annotations

import ast
import inspect
import typing

MARKER = "<!-- protocol-diagram -->"


def _command_names(machine: typing.Any) -> set[str]:
    return {cls.__name__ for cls in typing.get_args(machine.Command)}


def _commands_of(machine: typing.Any, handler: typing.Any) -> list[str]:
    """The command classes a handler can emit (itself and the functions it calls)."""
    commands = _command_names(machine)
    tree = ast.parse(inspect.getsource(machine))
    # Module-level functions and constants (e.g. a tuple of ready-made commands).
    functions: dict[str, ast.AST] = {
        n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)
    }
    for n in tree.body:
        if isinstance(n, ast.Assign):
            for target in n.targets:
                if isinstance(target, ast.Name):
                    functions[target.id] = n
        elif (
            isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Name)
            and ast.unparse(n.annotation) != "TypeAlias"  # Command, Observation: unions
        ):
            functions[n.target.id] = n
    functions.pop("TRANSITIONS", None)
    functions.pop("_HANDLERS", None)
    found: set[str] = set()
    seen: set[str] = set()
    todo = [handler.__name__]
    while todo:
        name = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        for node in ast.walk(functions[name]):
            if isinstance(node, ast.Name):
                if node.id in commands:
                    found.add(node.id)
                elif node.id in functions:
                    todo.append(node.id)
    return sorted(found)


Row = tuple[str, str, str, tuple[str, ...], list[str]]


def rows(machine: typing.Any | None = None) -> list[Row]:
    """(phase, observation, handler, next phases, commands) per row of TRANSITIONS, in order."""
    if machine is None:
        from joinkit import _machine as machine
    return [
        (
            phase.name,
            observation.__name__,
            handler.__name__,
            tuple(p.name for p in targets),
            _commands_of(machine, handler),
        )
        for (phase, observation), (handler, targets) in machine.TRANSITIONS.items()
    ]


def render(machine: typing.Any | None = None) -> str:
    """The diagram as Markdown: a text picture per phase, then the full table."""
    if machine is None:
        from joinkit import _machine as machine
    table = rows(machine)
    phases = [p.name for p in machine.Phase]
    out = ["```text"]
    for phase in phases:
        mine = [r for r in table if r[0] == phase]
        out.append(phase)
        if not mine:
            out.append("  (final: accepts no observation)")
        for i, (_, observation, _handler, targets, _cmds) in enumerate(mine):
            branch = "└─" if i == len(mine) - 1 else "├─"
            out.append(f"  {branch} {observation} ──▶ {' | '.join(targets)}")
        out.append("")
    out[-1] = "```"
    out += [
        "",
        "| phase | observation | handler | may lead to | commands it can emit |",
        "| --- | --- | --- | --- | --- |",
    ]
    for phase, observation, handler, targets, cmds in table:
        out.append(
            f"| {phase} | `{observation}` | `{handler}` | {', '.join(targets)} "
            f"| {', '.join(f'`{c}`' for c in cmds) or '—'} |"
        )
    return "\n".join(out) + "\n"


def parse(text: str) -> dict[tuple[str, str], tuple[str, ...]]:
    """Read (phase, observation) -> next phases back from :func:`render`'s picture."""
    picture = text.split("```text\n", 1)[1].split("```", 1)[0]
    found: dict[tuple[str, str], tuple[str, ...]] = {}
    phase = ""
    for line in picture.splitlines():
        if line and not line.startswith(" "):
            phase = line.strip()
        elif "──▶" in line:
            left, right = line.split("──▶")
            observation = left.replace("├─", "").replace("└─", "").strip()
            found[(phase, observation)] = tuple(t.strip() for t in right.split("|"))
    return found
