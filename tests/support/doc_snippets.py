"""Find and run the code blocks of README.md and docs/ (tests/docs/test_doc_snippets.py).

Theory of operation. Every fenced block of the Markdown files is a test case.
What to do with a block is said by an HTML comment on the line before it (it
renders as nothing, on GitHub and on the site), or, without one, by its
language:

    (nothing), ```python        run with the venv's Python, from a temporary folder
    <!-- run: torchrun-2 -->    the Python block under torchrun --standalone --nproc-per-node 2
    <!-- run: mpirun-2 -->      the Python block under mpirun -n 2
    <!-- run: mpirun-ulfm-3 --> the Python block under mpirun --with-ft ulfm -n 3 (MPI's
                                fault tolerance: the survivors of a dead rank go on)
    <!-- run: shell -->         a ```sh block, with bash -e from the repository root,
                                the venv's bin/ first on PATH
    <!-- run: continues -->     a Python block that continues the previous Python block
                                of the same file: the two (or more) run as one program
    <!-- compile only: WHY -->  a Python fragment: compiled, not run (WHY says why)
    <!-- not run: WHY -->       not run at all; WHY is required
    <!-- output -->             the stdout of the block before it, compared exactly
                                (trailing whitespace aside)

A block that is none of these and that the runner cannot run by its language
(sh, text, toml, no language) is an error naming its file and line: the
source must say how to run it or why it is not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
#: A hang guard per launched block, not a speed limit: a multi-rank FSDP2 block took over
#: 120 s with the machine's 2 cores under a load of 15.
LAUNCH_TIMEOUT = 300.0

_FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>`{3,})(?P<info>[^`]*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*(?P<word>[a-z -]+?)\s*(?::\s*(?P<arg>.*?))?\s*-->\s*$")
RUNNERS = ("python", "torchrun-2", "mpirun-2", "shell", "mpirun-ulfm-3")


@dataclass
class Block:
    path: Path
    line: int  # 1-based, the opening fence
    lang: str
    code: str
    directive: str = ""  # run / not run / compile only / output / continues / ""
    arg: str = ""
    output: str | None = None  # the expected stdout, from a following output block
    prelude: list[Block] = field(default_factory=list)  # blocks this one continues

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markdown_files() -> list[Path]:
    """README.md and every page under docs/ (the build hooks' folder aside)."""
    files = [ROOT / "README.md"]
    files += sorted(p for p in (ROOT / "docs").rglob("*.md") if "_hooks" not in p.parts)
    return files


def parse(path: Path) -> list[Block]:
    """The blocks of one file, with their directives; output blocks folded in."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks = len(fence["indent"]), fence["ticks"]
        lang = fence["info"].strip().split(" ")[0] if fence["info"].strip() else ""
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^ {{0,{indent}}}{ticks}\s*$", lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: a code block that is never closed")
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        directive = _DIRECTIVE.match(lines[k]) if k >= 0 else None
        blocks.append(Block(
            path=path, line=i + 1, lang=lang, code="\n".join(body) + "\n",
            directive=directive["word"] if directive else "",
            arg=(directive["arg"] or "") if directive else "",
        ))
        i = j + 1
    return _fold(blocks)


def _fold(blocks: list[Block]) -> list[Block]:
    kept: list[Block] = []
    for block in blocks:
        if block.directive == "output":
            if not kept or kept[-1].output is not None:
                raise ValueError(f"{block.id}: an output block must follow a block that runs")
            kept[-1].output = block.code
            continue
        if block.directive == "run" and block.arg == "continues":
            before = [b for b in kept if b.lang == "python"]
            if not before:
                raise ValueError(f"{block.id}: 'continues', but no Python block comes before it")
            block.prelude = before[-1].prelude + [before[-1]]
        kept.append(block)
    return kept


def how(block: Block) -> tuple[str, str]:
    """(what to do, why) for a block: one of RUNNERS, 'compile', 'skip', or 'error'."""
    if block.directive == "not run":
        return ("skip", block.arg) if block.arg else ("error", "'not run' needs a reason")
    if block.directive == "compile only":
        if not block.arg:
            return ("error", "'compile only' needs a reason")
        return ("compile", block.arg) if block.lang == "python" else (
            "error", "'compile only' is for Python blocks")
    if block.directive == "run":
        if block.arg == "continues":
            return ("python", "") if block.lang == "python" else (
                "error", "'continues' is for Python blocks")
        if block.arg in ("torchrun-2", "mpirun-2", "mpirun-ulfm-3"):
            return (block.arg, "") if block.lang == "python" else (
                "error", f"{block.arg} runs Python blocks")
        if block.arg == "shell":
            return ("shell", "") if block.lang in ("sh", "bash", "shell") else (
                "error", "'run: shell' is for sh blocks")
        return ("error", f"unknown runner {block.arg!r}; known: {', '.join(RUNNERS)}")
    if block.directive:
        return ("error", f"unknown directive {block.directive!r}")
    if block.lang == "python":
        return ("python", "")
    return ("error", (
        f"a ```{block.lang or '(no language)'} block with no directive: say how to run it "
        "(<!-- run: shell -->, <!-- output --> after a block that runs) or why it is not "
        "run (<!-- not run: REASON -->)"
    ))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    env.pop("JOINKIT_BACKEND", None)
    return env


def program(block: Block) -> str:
    return "".join(b.code for b in block.prelude) + block.code


def run(block: Block) -> subprocess.CompletedProcess[str]:
    """Run a block as its directive says; returns the finished process."""
    kind, _ = how(block)
    if kind == "shell":
        return subprocess.run(
            ["bash", "-e", "-c", block.code], cwd=ROOT, env=_env(), capture_output=True,
            text=True, timeout=LAUNCH_TIMEOUT,
        )
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "snippet.py"
        script.write_text(program(block), encoding="utf-8")
        if kind == "python":
            argv = [sys.executable, str(script)]
        elif kind == "torchrun-2":
            argv = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                    str(script)]
        elif kind == "mpirun-2":
            argv = [str(VENV_BIN / "mpirun"), "-n", "2", "--oversubscribe",
                    sys.executable, str(script)]
        elif kind == "mpirun-ulfm-3":
            argv = [str(VENV_BIN / "mpirun"), "--with-ft", "ulfm", "-n", "3", "--oversubscribe",
                    sys.executable, str(script)]
        else:
            raise ValueError(f"{block.id}: {kind} blocks are not run")
        return subprocess.run(argv, cwd=tmp, env=_env(), capture_output=True, text=True,
                              timeout=LAUNCH_TIMEOUT)


def same_output(got: str, want: str) -> bool:
    def norm(s: str) -> list[str]:
        return [line.rstrip() for line in s.strip("\n").splitlines()]
    return norm(got) == norm(want)
