"""Summarize an AUDIT_LAYOUT_DIR (see sitecustomize.py): per-process call counts and findings.

    .venv/bin/python benchmarks/layout_audit/analyze.py OUT_DIR
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import Counter, defaultdict
from typing import Any

LAYERS = ("py", "pg", "op")


def read_jsonl(directory: str, prefix: str) -> list[dict[str, Any]]:
    """Every record of the ``<prefix>.<pid>.jsonl`` files in ``directory``."""
    records = []
    for path in sorted(glob.glob(os.path.join(directory, f"{prefix}.*.jsonl"))):
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


def read_metas(directory: str) -> dict[int, dict[str, Any]]:
    metas = {}
    for path in glob.glob(os.path.join(directory, "meta.*.json")):
        with open(path) as f:
            meta = json.load(f)
        metas[meta["pid"]] = meta
    return metas


def read_calls(directory: str) -> dict[int, Counter[str]]:
    """Per process id, how often each ``"<layer> <name>"`` was called."""
    per_process = {}
    for path in sorted(glob.glob(os.path.join(directory, "calls.*.log"))):
        pid = int(path.split(".")[-2])
        with open(path) as f:
            per_process[pid] = Counter(line.strip() for line in f if line.strip())
    return per_process


def per_layer(keys: Counter[str]) -> Counter[str]:
    """Sum a ``"<layer> <name>"`` counter by layer."""
    layers: Counter[str] = Counter()
    for key, count in keys.items():
        layers[key.split(" ", 1)[0]] += count
    return layers


def _layers_line(counts: Counter[str]) -> str:
    return ", ".join(f"{layer} {counts[layer]}" for layer in LAYERS)


def report(directory: str) -> None:
    metas = read_metas(directory)
    calls = read_calls(directory)
    total: Counter[str] = Counter()
    for counts in calls.values():
        total.update(counts)
    summaries = glob.glob(os.path.join(directory, "summary.*"))
    print(f"processes with calls: {len(calls)}; meta files: {len(metas)}; "
          f"summaries: {len(summaries)}")
    for pid, counts in sorted(calls.items()):
        argv = metas.get(pid, {}).get("argv", [])
        shown = " ".join(os.path.basename(a) for a in argv[:3])
        print(f"  pid {pid}: {sum(counts.values())} calls; argv {shown} ... ({len(argv)} args)")
    print("total calls per function (all processes):")
    for key, count in sorted(total.items()):
        print(f"  {count:7d}  {key}")
    print(f"calls per layer: {_layers_line(per_layer(total))}")

    findings = read_jsonl(directory, "findings")
    print(f"findings: {len(findings)}")
    print(f"findings per layer: {_layers_line(Counter(r['layer'] for r in findings))}")
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in findings:
        key = (r["layer"], r["function"], tuple(r["why"]), tuple(r.get("shape", ())),
               tuple(r.get("stride", ())), tuple(r["callers"][-6:]))
        groups[key].append(r)
    for records in groups.values():
        r = records[0]
        pids = sorted({x["pid"] for x in records})
        print(f"--- x{len(records)} pids {pids}: {r['layer']} {r['function']} {r['why']} "
              f"shape {r.get('shape')} stride {r.get('stride')} "
              f"offset {r.get('storage_offset')} storage_nbytes {r.get('storage_nbytes')} "
              f"past_end {r.get('bytes_past_storage_end')}")
        if "error" in r:
            print(f"    error: {r['error']}")
        print(r["stack"])
        print("    callers:", " <- ".join(reversed(r["callers"][-20:])))

    errors = sorted(glob.glob(os.path.join(directory, "errors.*")))
    texts = []
    for path in errors:
        with open(path) as f:
            texts.append(f.read())
    print("hook errors:", sum(len(text.splitlines()) for text in texts))
    for text in texts:
        print(text[:2000])

    shared = read_jsonl(directory, "xoverlap")
    print(f"calls whose distinct tensors share memory (info, first 5 per process): "
          f"{len(shared)}")
    seen = set()
    for r in shared:
        key = (r["layer"], r["function"], tuple(r["callers"][-4:]))
        if key in seen:
            continue
        seen.add(key)
        print("  ", r["layer"], r["function"], r["tensors"],
              " <- ".join(reversed(r["callers"][-6:])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="the AUDIT_LAYOUT_DIR of a run")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.directory):
        parser.error(f"no such directory: {args.directory}")
    report(args.directory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
