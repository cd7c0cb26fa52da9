"""2-rank gloo proof that the audit (sitecustomize.py) sees a bad layout.

    .venv/bin/python benchmarks/layout_audit/proof.py strided OUT
    .venv/bin/python benchmarks/layout_audit/proof.py contiguous OUT

Launches both ranks of CASE, each with this directory on PYTHONPATH and
AUDIT_LAYOUT_DIR=OUT (OUT must be absent or empty; it gets the audit's files
and each rank's output as stdout.<rank>), over a FileStore in a temporary
directory. Then prints the findings per layer and exits 1 unless they are what
CASE expects: "strided" hands strided views (and a stride-0 tensor) to the
collectives, which must be reported at each of the py, pg and op layers;
"contiguous" hands only contiguous tensors (plain, functional and DDP
collectives), which must not be reported at all, though every layer saw calls.
Details: analyze.py OUT.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WORLD = 2
LAYERS = ("py", "pg", "op")


def contiguous(rank: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    t = torch.ones(4, 3)
    dist.all_reduce(t)
    print(rank, "contiguous ok", t.sum().item())
    r = fc.all_reduce(torch.ones(5), "sum", dist.group.WORLD)
    print("funcol", r.sum().item())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
    model(torch.ones(2, 3)).sum().backward()
    print("ddp ok")


def strided(rank: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    base = torch.arange(12.0).reshape(4, 3)
    v = base[:, 1]  # stride (3,), non-contiguous
    dist.all_reduce(v)
    correct = [2.0 * x for x in (1, 4, 7, 10)]
    print(rank, "strided view after all_reduce:", v.tolist(), "(correct would be", correct, ")")
    pg = dist.group.WORLD  # the ProcessGroup method directly
    assert pg is not None
    pg.allreduce([torch.ones(4, 3)[:, 0]]).wait()
    # a small stride-0 tensor, broadcast from rank 0 (small: stays inside the allocation's slack)
    e = torch.ones(1).expand(2)
    dist.broadcast(e, 0)
    with torch.inference_mode():  # inference tensors: seen at the op layer too
        pg.allreduce([torch.ones(4, 3)[:, 2]]).wait()
    r = fc.all_reduce(torch.ones(4, 3)[:, 1], "sum", dist.group.WORLD)
    print("funcol on a strided view:", r.tolist())


CASES = {"contiguous": contiguous, "strided": strided}


def rank_main(case: str, rank: int, world: int, store: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    CASES[case](rank)
    dist.destroy_process_group()


def launch(case: str, out: Path, timeout: float) -> list[int | None]:
    """Run the ranks of ``case``; their exit codes (None: killed at the timeout)."""
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": str(HERE),
        "AUDIT_LAYOUT_DIR": str(out),
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",  # no __pycache__ for sitecustomize in the repo
    })
    with tempfile.TemporaryDirectory(prefix="layout_audit_store_") as tmp:
        store = os.path.join(tmp, "store")
        procs = []
        for rank in range(WORLD):
            command = [sys.executable, str(Path(__file__).resolve()), case, str(out),
                       "--rank", str(rank), "--world", str(WORLD), "--store", store]
            with open(out / f"stdout.{rank}", "w") as log:
                procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                              stderr=subprocess.STDOUT))
        codes: list[int | None] = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return codes


def check(case: str, out: Path, codes: list[int | None]) -> list[str]:
    """Print what the audit saw; the ways it is not what ``case`` expects."""
    sys.dont_write_bytecode = True  # no __pycache__ for analyze in the repo
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from analyze import per_layer, read_calls, read_jsonl

    total: Counter[str] = Counter()
    for counts in read_calls(str(out)).values():
        total.update(counts)
    calls = per_layer(total)
    findings = read_jsonl(str(out), "findings")
    found = {layer: sum(1 for r in findings if r["layer"] == layer) for layer in LAYERS}
    errors = list(out.glob("errors.*"))
    print(f"{case}: rank exit codes {codes}")
    print(f"{case}: calls per layer: " + ", ".join(f"{x} {calls[x]}" for x in LAYERS))
    print(f"{case}: findings per layer: " + ", ".join(f"{x} {found[x]}" for x in LAYERS)
          + f" (total {len(findings)})")
    failures = [f"rank {rank} exited with {code}" for rank, code in enumerate(codes) if code != 0]
    if errors:
        failures.append(f"hook errors in {[p.name for p in errors]}")
    for layer in LAYERS:
        if calls[layer] == 0:
            failures.append(f"no call seen at the {layer} layer")
        if case == "strided" and found[layer] == 0:
            failures.append(f"no finding at the {layer} layer")
    if case == "contiguous" and findings:
        failures.append(f"{len(findings)} findings, expected none")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("out", type=Path, help="the AUDIT_LAYOUT_DIR (absent or empty)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per rank")
    # internal: run one rank (what the launch below starts)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=WORLD, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.case, args.rank, args.world, args.store)
        return 0

    out = args.out.resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        parser.error(f"{out} exists and is not an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    codes = launch(args.case, out, args.timeout)
    failures = check(args.case, out, codes)
    for failure in failures:
        print(f"{args.case}: FAILED: {failure}")
    if failures:
        for rank in range(WORLD):
            print(f"--- stdout.{rank} (tail)")
            print((out / f"stdout.{rank}").read_text()[-3000:])
        return 1
    print(f"{args.case}: as expected; details: {sys.executable} {HERE / 'analyze.py'} {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
