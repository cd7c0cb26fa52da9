"""Every code block of README.md and docs/ runs (tests/doc_snippets.py says how).

One case per block, named by file and line. Plain Python blocks run on the
threads backend in a subprocess each; a block marked ``<!-- run: torchrun-2 -->``
or ``mpirun-2`` is one launch of two processes; shell blocks run from the
repository root. A block the runner cannot run and that the source does not
mark with a reason fails here.
"""

from __future__ import annotations

import doc_snippets as ds
import pytest

BLOCKS = [b for path in ds.markdown_files() for b in ds.parse(path)]


def test_the_markdown_has_blocks_to_run() -> None:
    runnable = [b for b in BLOCKS if ds.how(b)[0] in ds.RUNNERS]
    assert len(runnable) >= 3, [b.id for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block(block: ds.Block) -> None:
    kind, why = ds.how(block)
    if kind == "error":
        pytest.fail(f"{block.id}: {why}")
    if kind == "skip":
        return  # marked in the source, with its reason
    if kind == "compile":
        compile(ds.program(block), block.id, "exec")
        return
    if kind in ("torchrun-2", "mpirun-2") and "torch" in ds.program(block):
        pytest.importorskip("torch")  # only a job without torch lacks it
    done = ds.run(block)
    assert done.returncode == 0, (
        f"{block.id} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    if block.output is not None:
        assert ds.same_output(done.stdout, block.output), (
            f"{block.id}: stdout differs from the output shown\n--- shown\n{block.output}"
            f"--- got\n{done.stdout}"
        )
