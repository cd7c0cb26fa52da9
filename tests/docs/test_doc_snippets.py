"""Every code block of README.md and docs/ runs (tests/support/doc_snippets.py says how).

One case per block, named by file and line. Plain Python blocks run on the
threads backend in a subprocess each; a block marked ``<!-- run: torchrun-2 -->``
or ``mpirun-2`` is one launch of two processes; shell blocks run from the
repository root. A block the runner cannot run and that the source does not
mark with a reason fails here.

The blocks run two at a time in a module fixture, in file order, while the
tests read their results in the same order: a launch mostly waits for torch
to import, and one at a time left a core idle a third of the time. The shell
blocks run one at a time (two of them start ``torchrun`` on its default port).
"""

from __future__ import annotations

import importlib.util
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from support import doc_snippets as ds

pytestmark = pytest.mark.launches

BLOCKS = [b for path in ds.markdown_files() for b in ds.parse(path)]
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _needs_missing_torch(block: ds.Block, kind: str) -> bool:
    """Only a job without torch lacks it (the no-torch CI job)."""
    return kind in ("torchrun-2", "mpirun-2") and "torch" in ds.program(block) and not HAVE_TORCH


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """Every block to run, started two at a time in file order: id -> its run."""
    shell = threading.Lock()

    def run(block: ds.Block, kind: str) -> subprocess.CompletedProcess[str]:
        if kind != "shell":
            return ds.run(block)
        with shell:
            return ds.run(block)

    with ThreadPoolExecutor(max_workers=2) as pool:
        started = {}
        for block in BLOCKS:
            kind, _ = ds.how(block)
            if kind in ds.RUNNERS and not _needs_missing_torch(block, kind):
                started[block.id] = pool.submit(run, block, kind)
        yield started
        for future in started.values():
            future.cancel()  # a test that failed early leaves the rest unread


def test_the_markdown_has_blocks_to_run() -> None:
    runnable = [b for b in BLOCKS if ds.how(b)[0] in ds.RUNNERS]
    assert len(runnable) >= 3, [b.id for b in BLOCKS]


# A block's run may wait for the one before it (two run at once): two launches' guard.
@pytest.mark.timeout(2 * ds.LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block(block: ds.Block,
               runs: dict[str, Future[subprocess.CompletedProcess[str]]]) -> None:
    kind, why = ds.how(block)
    if kind == "error":
        pytest.fail(f"{block.id}: {why}")
    if kind == "skip":
        return  # marked in the source, with its reason
    if kind == "compile":
        compile(ds.program(block), block.id, "exec")
        return
    if _needs_missing_torch(block, kind):
        pytest.skip("needs torch")
    done = runs[block.id].result()
    assert done.returncode == 0, (
        f"{block.id} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    if block.output is not None:
        assert ds.same_output(done.stdout, block.output), (
            f"{block.id}: stdout differs from the output shown\n--- shown\n{block.output}"
            f"--- got\n{done.stdout}"
        )
