"""torch's gloo on non-contiguous tensors, beside joinkit's side collectives (issue 30).

gloo (torch 2.13.0) sends and receives ``numel`` elements from a tensor's
first address, whatever its strides. A strided tensor (a column, a slice) is
then reduced or received as the wrong elements, and its neighbours are
overwritten: a silently wrong result. A tensor whose elements share memory
(``expand()``: a stride of 0) is written past its storage: a heap corruption,
and glibc ends the process with ``double free or corruption (out)``, the line
of issue 30's crash, or a segmentation fault. NCCL refuses both ("Tensors
must be contiguous").

Each case runs twice on 2 gloo ranks (one pair of processes per case and
side): ``dist.all_reduce``/``dist.broadcast`` as a user calls them, and
joinkit's ``collectives.all_reduce``/``collectives.broadcast`` (which send a
contiguous copy of a strided tensor and refuse one whose elements share
memory, before anything is sent). Each rank's outcome is compared with the
result computed in one process. Not a test and not in ``benchmarks/run.py``::

    python benchmarks/gloo_tensor_layouts.py          # prints a Markdown table

Measured 2026-11-28 (2 cores, torch 2.13.0+cpu, glibc 2.36): see
``docs/reliability.md``, "A heap corruption in a test job".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

CASES = {
    "all_reduce, a column (4, 2)[:, 1]": "reduce_column",
    "broadcast, a column (4, 2)[:, 1]": "broadcast_column",
    "all_reduce, expand()ed (1,) to (4096,)": "reduce_expanded",
    "broadcast, expand()ed (1,) to (4096,)": "broadcast_expanded",
}
WORLD = 2


def worker(rank: int, case: str, side: str, store: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    if side == "joinkit":
        from joinkit.adapters.torch import collectives

        def all_reduce(t: Any) -> None:
            collectives.all_reduce(t)(t)

        def broadcast(t: Any) -> None:
            collectives.broadcast(t, src=0)(t)
    else:
        def all_reduce(t: Any) -> None:
            dist.all_reduce(t)

        def broadcast(t: Any) -> None:
            dist.broadcast(t, src=0)

    base = torch.arange(8.0).reshape(4, 2) * (rank + 1)
    try:
        if case == "reduce_column":
            all_reduce(base[:, 1])
            want = torch.arange(8.0).reshape(4, 2) * (rank + 1)
            want[:, 1] = torch.arange(8.0).reshape(4, 2)[:, 1] * 3  # 1 + 2: both ranks
            got, want = base.tolist(), want.tolist()
        elif case == "broadcast_column":
            broadcast(base[:, 1])
            want = torch.arange(8.0).reshape(4, 2) * (rank + 1)
            want[:, 1] = torch.arange(8.0).reshape(4, 2)[:, 1]  # rank 0's
            got, want = base.tolist(), want.tolist()
        elif case == "reduce_expanded":
            t = torch.full((1,), rank + 1.0).expand(4096)
            all_reduce(t)
            got, want = t[:4].tolist(), "no result can be written into it"
        else:
            t = torch.full((1,), 1.0 - rank).expand(4096)  # rank 0 sends 1s
            broadcast(t)
            got, want = t[:4].tolist(), "no result can be written into it"
        outcome = {"got": got, "want": want}
    except Exception as error:  # noqa: BLE001 - reported
        outcome = {"raised": f"{type(error).__name__}: {str(error)[:160]}"}
    # Churn the heap: a corrupted one shows at the next frees.
    junk = [torch.zeros(n) for n in (16, 1000, 4000, 100_000) for _ in range(50)]
    del junk
    dist.destroy_process_group()
    return outcome


def run(case: str, side: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = []
        for rank in range(WORLD):
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", str(rank), case, side, store],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        cells = []
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                cells.append(f"rank {rank}: hung (killed after 120 s)")
                continue
            line = next((x for x in out.splitlines() if x.startswith("{")), None)
            if proc.returncode != 0:
                # glibc's own line, where it printed one (an abort: exit -6)
                glibc = [x for x in err.splitlines()
                         if x.startswith(("double free", "free()", "malloc", "corrupted"))]
                cells.append(f"rank {rank}: exit {proc.returncode}"
                             + (f" `{glibc[-1].strip()}`" if glibc else ""))
            elif line is None:
                cells.append(f"rank {rank}: no outcome")
            else:
                cells.append(f"rank {rank}: {describe(json.loads(line))}")
        return "; ".join(cells)


def describe(outcome: dict[str, Any]) -> str:
    if "raised" in outcome:
        return f"raised {outcome['raised'].split(':')[0]}"
    if outcome["want"] == "no result can be written into it":
        return f"returned, its 4096 elements at one address ({outcome['got'][0]})"
    return "right" if outcome["got"] == outcome["want"] else (
        f"**wrong**: {outcome['got']}, want {outcome['want']}")


def main() -> None:
    import torch

    print(f"torch {torch.__version__}, gloo, {WORLD} ranks\n")
    print("| case | `dist.*` (torch alone) | joinkit's `collectives.*` |")
    print("|---|---|---|")
    for title, case in CASES.items():
        print(f"| {title} | {run(case, 'torch')} | {run(case, 'joinkit')} |", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        rank, case, side, store = sys.argv[2:6]
        print(json.dumps(worker(int(rank), case, side, store)), flush=True)
    else:
        main()
