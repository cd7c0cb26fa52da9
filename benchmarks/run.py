"""Run every benchmark and write ``benchmarks/RESULTS.md``.

    python benchmarks/run.py            # ~6 minutes on 2 cores; writes benchmarks/RESULTS.md
    python benchmarks/run.py --quick --output /tmp/R.md   # tiny counts (smoke test)

Each benchmark runs as its own program (under ``torchrun`` or ``mpirun`` where
it needs several processes), with a timeout, one after the other so they do not
compete for the CPU, each once the machine's load average has dropped (or
after ``--quiet-wait`` seconds; ``--quick`` runs them all at once and its
numbers mean nothing). They report through a JSON-lines file (``JOINKIT_BENCH_OUT``); this
script turns the records into Markdown tables: per-iteration medians, the
ratios against their targets, the machine and versions, and the load average
around each run (a busy machine makes every number noisier). The hand-written
analysis in ``benchmarks/notes.md`` is appended verbatim.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable


def _torchrun() -> list[str]:
    script = Path(PY).with_name("torchrun")
    if script.exists():
        return [str(script)]
    return [PY, "-m", "torch.distributed.run"]


def _mpirun() -> list[str]:
    beside = Path(PY).with_name("mpirun")
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    if found is None:
        raise RuntimeError("no mpirun next to the interpreter or on PATH: make setup")
    return [found]


def jobs(quick: bool) -> list[tuple[str, list[str], float]]:
    """(name, command, timeout in seconds) of every benchmark."""
    torchrun = [*_torchrun(), "--standalone", "--nproc-per-node", "2"]
    mpirun = [*_mpirun(), "-n", "2"]
    if "Open MPI" in _mpi_library():
        # The ranks share 2 cores with gloo's threads and other jobs: let the
        # kernel schedule them rather than pinning each to one core.
        mpirun += ["--bind-to", "none"]
    b = HERE
    if quick:
        counter, counter_mpi, ddp, threads, step = ["30", "2"], ["200", "2"], ["4", "2"], \
            ["4", "20", "1"], ["2000"]
        heartbeat, fsdp, metrics = ["200"], ["3", "2"], ["4", "2"]
        world = ["128", "1", "64"]
        evaluation = ["1", "2"]
        shapes = {"1 bucket": ["4", "1"], "2 buckets": ["2", "1"], "24 buckets": ["2", "1"],
                  "25 MB buckets": ["1", "1"]}
        trainer, sft, zero2 = ["3", "1"], ["3", "1"], ["4", "2"]
    else:
        counter, counter_mpi, ddp, threads, step = ["400", "21"], ["10000", "15"], \
            ["100", "21"], ["64", "1000", "3"], ["50000"]
        heartbeat, fsdp, metrics = ["50000"], ["60", "21"], ["200", "21"]
        world = ["4096", "3", "512"]
        evaluation = ["3", "21"]
        shapes = {"1 bucket": ["200", "15"], "2 buckets": ["40", "15"],
                  "24 buckets": ["15", "15"], "25 MB buckets": ["3", "11"]}
        # ~2 minutes each on a quiet machine (a Trainer step ~65 ms, an SFT step less).
        trainer, sft, zero2 = ["20", "7"], ["30", "9"], ["100", "15"]
    return [
        ("core step", [PY, str(b / "core_step.py"), *step], 120),
        # One rank: joinkit's own CPU cost per heartbeat on MPI (item 3).
        ("MPI heartbeat", [*_mpirun(), "-n", "1", PY, str(b / "mpi_heartbeat.py"), *heartbeat],
         120),
        ("Counter, gloo (torchrun)", [*torchrun, str(b / "counter_torch.py"), *counter], 400),
        ("Counter, MPI", [*mpirun, PY, str(b / "counter_mpi.py"), *counter_mpi], 400),
        ("DDP, gloo (torchrun)", [*torchrun, str(b / "ddp.py"), *ddp], 400),
        ("DDP, gloo (mpirun)", [*mpirun, PY, str(b / "ddp.py"), *ddp], 400),
        # DDP models of 1, 2, 24 and ~25 MB buckets, each launcher (issue 50).
        *[(f"DDP {shape}, gloo ({name})", [*launch, str(b / "ddp_shapes.py"), shape, *counts],
           900)
          for shape, counts in shapes.items()
          for name, launch in (("torchrun", torchrun), ("mpirun", [*mpirun, PY]))],
        ("FSDP2, gloo (torchrun)", [*torchrun, str(b / "fsdp.py"), *fsdp], 600),
        # The Trainer, TRL's SFTTrainer and DeepSpeed ZeRO-2 with joinkit and alone (issue 50).
        ("HF Trainer, gloo (torchrun)", [*torchrun, str(b / "trainer.py"), *trainer, "trainer"],
         600),
        ("TRL SFTTrainer packing, gloo (torchrun)",
         [*torchrun, str(b / "trainer.py"), *sft, "sft"], 600),
        ("DeepSpeed ZeRO-2, gloo (torchrun)", [*torchrun, str(b / "deepspeed_zero.py"), *zero2],
         600),
        # torchmetrics' per-step sync inside Join versus without (issue 18, Speed).
        ("torchmetrics sync, gloo (torchrun)",
         [*torchrun, str(b / "metrics_sync.py"), *metrics], 400),
        ("threads", [PY, str(b / "threads_scale.py"), *threads], 400),
        # Entry, report and stall diagnostic versus world size (issue 12, part 5).
        ("world scale (threads)", [PY, str(b / "world_scale.py"), *world], 900),
        # Exact evaluation (Gather in a Join) versus padded (issue 18, Speed).
        ("Exact evaluation, gloo (torchrun)",
         [*torchrun, str(b / "eval_gather.py"), *evaluation], 400),
        ("Exact evaluation, MPI", [*mpirun, PY, str(b / "eval_gather.py"), *evaluation], 400),
        # Death to the survivors' next iteration, mpirun --with-ft ulfm (issue 20, Speed).
        ("Elastic finish, MPI (ULFM)",
         [PY, str(b / "elastic.py"), *(["2"] if quick else ["9"])], 600),
        # Elastic finish on gloo: death -> survivors' next iteration (issue 20, Speed).
        ("Elastic finish, gloo (forked ranks)",
         [PY, str(b / "elastic_gloo.py"), *(["4", "40"] if quick else ["12", "400"])], 600),
        # Under python -m joinkit run, beside mpirun --with-ft ulfm (issue 33, Bench).
        ("Elastic finish, gloo (joinkit run)",
         [PY, str(b / "elastic_run.py"), *(["1"] if quick else ["4"])], 1800),
    ]


def child_env(out: Path) -> dict[str, str]:
    env = {
        key: value for key, value in os.environ.items()
        # An outer launcher's variables would confuse torchrun's and mpirun's children.
        if not key.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_",
                               "JOINKIT_"))
        and key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        OMP_NUM_THREADS="1",
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        PYTHONWARNINGS="ignore",
        JOINKIT_BENCH_OUT=str(out),
    )
    return env


def run_job(name: str, command: list[str], timeout: float, env: dict[str, str]
            ) -> dict[str, Any]:
    """Start one benchmark; returns its running state (see :func:`finish`)."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return {"name": name, "proc": proc, "timeout": timeout, "started": time.monotonic(),
            "load_before": os.getloadavg()[0]}


def wait_for_quiet(load: float, patience: float) -> float:
    """Wait until the 1-minute load average is below ``load``; return the seconds waited.

    Other jobs on a shared machine make every number noisier; gives up after
    ``patience`` seconds (the load is reported with the results either way).
    """
    start = time.monotonic()
    while os.getloadavg()[0] >= load and time.monotonic() - start < patience:
        time.sleep(5)
    return time.monotonic() - start


def finish(job: dict[str, Any]) -> dict[str, Any]:
    proc = job["proc"]
    left = job["timeout"] - (time.monotonic() - job["started"])
    try:
        output, _ = proc.communicate(timeout=max(1.0, left))
        status = "ok" if proc.returncode == 0 else f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        status = f"killed after {job['timeout']:g} s"
    return {"name": job["name"], "status": status, "output": output,
            "seconds": time.monotonic() - job["started"], "load_before": job["load_before"],
            "load_after": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny iteration counts, all at once (a smoke test)")
    parser.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--only", action="append", default=[],
                        help="run only benchmarks whose name contains this (repeatable)")
    parser.add_argument("--quiet-load", type=float, default=1.0,
                        help="before each benchmark, wait until the 1-minute load average "
                             "is below this (default 1.0)...")
    parser.add_argument("--quiet-wait", type=float, default=180.0,
                        help="...but at most this many seconds (default 180; 0: never wait)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.jsonl"
        out.touch()
        env = child_env(out)
        selected = [j for j in jobs(args.quick)
                    if not args.only or any(o.lower() in j[0].lower() for o in args.only)]
        started = datetime.datetime.now().astimezone()
        if args.quick:
            running = [run_job(*job, env) for job in selected]
            runs = [finish(job) for job in running]
        else:
            runs = []
            for job in selected:
                waited = wait_for_quiet(args.quiet_load, args.quiet_wait)
                print(f"-- {job[0]} (load {os.getloadavg()[0]:.2f}, waited {waited:.0f} s)",
                      flush=True)
                result = finish(run_job(*job, env))
                result["waited"] = waited
                print(result["output"], end="", flush=True)
                runs.append(result)
        records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    text = render(records, runs, started, args.quick)
    args.output.write_text(text)
    print(f"wrote {args.output}")
    failed = [r for r in runs if r["status"] != "ok"]
    for run in failed:
        print(f"!! {run['name']}: {run['status']}\n{run['output'][-3000:]}", file=sys.stderr)
    if failed:
        sys.exit(1)


# -- the report -------------------------------------------------------------------------


def render(records: list[dict[str, Any]], runs: list[dict[str, Any]],
           started: datetime.datetime, quick: bool) -> str:
    lines = [
        "# joinkit benchmark results",
        "",
        f"Written by `python benchmarks/run.py{' --quick' if quick else ''}` on "
        f"{started:%Y-%m-%d %H:%M %Z}" + (f" at commit `{_commit()}`" if _commit() else "")
        + ". Times are medians over repeats (after warm-up) of the slowest rank's "
        "time per iteration; variants of one benchmark take turns in every repeat; a ratio "
        "is the median of per-repeat ratios. IQR: interquartile range over repeats.",
        "",
    ]
    if quick:
        lines += ["**Smoke run (`--quick`): tiny counts, all benchmarks at once; the numbers "
                  "mean nothing.**", ""]
    lines += ["## Machine", ""] + [f"- {item}" for item in _machine()] + [""]
    lines += ["## Targets", "", "Ratios are medians of per-repeat ratios, with their IQR.", "",
              "| target | measured | verdict |", "|---|---|---|"]
    for r in records:
        if r.get("target") is None:
            continue
        if r["kind"] == "ratio":
            what = f"{r['bench']}: {r['top']} / {r['bottom']} <= {r['target']:g}"
            measured = f"{r['ratio']:.3f} (IQR {r['q1']:.2f} - {r['q3']:.2f})"
            ok = r["ratio"] <= r["target"]
        else:
            what = f"{r['bench']}: {r['name']} <= {r['target']:g} {r['unit']}"
            measured = f"{r['value']:.3g} {r['unit']}"
            ok = r["value"] <= r["target"]
        lines.append(f"| {what} | {measured} | {'met' if ok else '**missed**'} |")
    lines.append("")
    lines += ["## Results", ""]
    benches: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        benches.setdefault(r["bench"], []).append(r)
    for bench, rows in benches.items():
        lines += [f"### {bench}", ""]
        info = next((r.get("info") for r in rows if r.get("info")), None)
        if info:
            lines += [", ".join(f"{k} {v}" for k, v in info.items()), ""]
        times = [r for r in rows if r["kind"] == "time"]
        if times:
            lines += ["| variant | us / iteration | IQR |", "|---|---:|---:|"]
            lines += [f"| {r['variant']} | {r['us']:.1f} | {r['q1']:.1f} - {r['q3']:.1f} |"
                      for r in times]
            lines.append("")
        ratios = [r for r in rows if r["kind"] == "ratio"]
        if ratios:
            lines += ["| ratio | median | IQR | target |", "|---|---:|---:|---:|"]
            lines += [f"| {r['top']} / {r['bottom']} | {r['ratio']:.3f} | "
                      f"{r['q1']:.2f} - {r['q3']:.2f} | {_target(r)} |" for r in ratios]
            lines.append("")
        values = [r for r in rows if r["kind"] == "value"]
        if values:
            lines += ["| measurement | value | target |", "|---|---:|---:|"]
            lines += [f"| {r['name']} | {r['value']:.3g} {r['unit']} | {_target(r)} |"
                      for r in values]
            lines.append("")
    lines += ["## Runs", "", f"Load average (1 min) before and after each benchmark, and how "
              f"long run.py waited for it to drop first; the machine has {os.cpu_count()} "
              "cores, so a load above that means other work competed with the benchmark.", "",
              "| benchmark | status | seconds | waited s | load before | load after |",
              "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['name']} | {r['status']} | {r['seconds']:.0f} | {r.get('waited', 0):.0f} | "
              f"{r['load_before']:.2f} | {r['load_after']:.2f} |" for r in runs]
    lines.append("")
    notes = HERE / "notes.md"
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    return "\n".join(lines)


def _target(record: dict[str, Any]) -> str:
    target = record.get("target")
    return "-" if target is None else f"<= {target:g}"


def _machine() -> list[str]:
    items = [f"{_cpu()}, {os.cpu_count()} cores, {_memory()}",
             f"{platform.system()} {platform.release()}, Python {platform.python_version()}"]
    versions = []
    for module in ("torch", "numpy", "mpi4py", "attrs"):
        try:
            versions.append(f"{module} {__import__(module).__version__}")
        except Exception:  # noqa: BLE001 - report what is there
            versions.append(f"{module} (not installed)")
    items.append(", ".join(versions))
    items.append(f"MPI: {_mpi_library()}")
    return items


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _memory() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 2**20:.0f} GiB RAM"
    except OSError:
        pass
    return "? RAM"


def _mpi_library() -> str:
    # In a child: importing mpi4py.MPI here would initialise MPI in this process.
    code = "from mpi4py import MPI; print(MPI.Get_library_version().split(',')[0].strip())"
    try:
        found = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return "(unknown)"
    return found.stdout.strip() or "(mpi4py not available)"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


if __name__ == "__main__":
    main()
