"""``python -m joinkit run``: torchrun's launcher with an agent that keeps the survivors.

Launches (all started at once, each bounded; standalone rendezvous, one node):

- the kill matrix of the elastic-finish issue (``test_elastic_torch.py``)
  under ``joinkit run``, three launches of 4 workers, each running its cells
  one after the other over the survivors of the one before
  (``programs/elastic_run_program.py``): deaths in the loop body, after the
  heartbeat, while draining, in the post hook, two deaths in one cell, a
  death during the recovery from another, the last active rank, a rank
  before its first input. Every survivor must leave normally with the
  reference's numbers and the report's lost ranks; the agent must exit 0 and
  name the lost ranks;
- the take-over matrix's cells under ``joinkit run`` (DDP, ``take_over=True``,
  ``tests/adapters/torch/programs/exact_runner.py --as-worker``);
- ``examples/elastic_run.py`` (DDP, ``take_over=True``, rank 1 killed);
- without ``on_rank_loss="finish"``, torchrun's behaviour: a death stops every
  worker and the launcher exits 1.

The loss of a whole node is in ``test_joinkit_run_two_nodes.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch.distributed")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
#: The take-over cells of the resume tests, run here under ``joinkit run``: their
#: runner, plan and check live with those tests (tests/adapters/torch/programs/).
EXACT = ROOT / "tests" / "adapters" / "torch" / "programs"
sys.path.insert(0, str(EXACT))
from exact_plan import check_take_over, record_error  # noqa: E402
from run_checks import check_cells, death_to_next_iteration, parse_cell  # noqa: E402
from support import selected_scenarios  # noqa: E402

PROGRAM = HERE / "programs" / "elastic_run_program.py"
TIMEOUT = 480.0  # all launches together, on a loaded 2-core machine

#: launch -> (world, its cells in order); ranks are global (original).
KILL_LAUNCHES = {
    "a": (4, ["3/body/2", "0/beat/2", "2/body/9"]),  # ... the last active rank
    "b": (4, ["1/body/2+2/beat/5", "0/drain/0"]),  # two deaths; then a joined rank
    "c": (4, ["3/body/2+1/recovery/0", "0/post/0", "-"]),  # a death during recovery
}
#: (exact_runner.py) every kill point in a world of 4 or 3; 31 samples: 11, 10, 10 on
#: ranks 0, 1, 2, so rank 1 joins early and dies draining.
TAKEOVER_LAUNCHES = ["takeover:4:1/body/2,2/beat/1", "takeover:4:3/step/0,1/drain/0:31"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "JOINKIT_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _joinkit_run(world: int, *argv: str) -> list[str]:
    return [sys.executable, "-m", "joinkit", "run", "--standalone", "--nproc-per-node",
            str(world), "--monitor-interval", "0.1", *argv]


@pytest.fixture(scope="module")
def launched(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("joinkit_run")
    # The launches the selected tests read (support.selected_scenarios): all, for the module.
    wanted = set(selected_scenarios(request, [*KILL_LAUNCHES, *TAKEOVER_LAUNCHES, "example",
                                              "raise"]))
    procs: dict[str, Any] = {}
    for name, (world, cells) in KILL_LAUNCHES.items():
        if name not in wanted:
            continue
        out = root / name
        out.mkdir()
        procs[name] = (out, subprocess.Popen(
            _joinkit_run(world, str(PROGRAM), str(out), *cells), env=_env(), cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for index, spec in enumerate(TAKEOVER_LAUNCHES):
        if spec not in wanted:
            continue
        out = root / f"takeover{index}"
        out.mkdir()
        procs[spec] = (out, subprocess.Popen(
            _joinkit_run(4, str(EXACT / "exact_runner.py"), "--as-worker", "--out", str(out),
                         "--cell", "0", spec),
            env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    if "example" in wanted:
        procs["example"] = (root, subprocess.Popen(
            _joinkit_run(3, str(ROOT / "examples" / "elastic_run.py")), env=_env(),
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    if "raise" in wanted:
        out = root / "raise"
        out.mkdir()
        procs["raise"] = (out, subprocess.Popen(
            _joinkit_run(3, str(PROGRAM), str(out), "1/body/2"),
            env={**_env(), "ELASTIC_RUN_MODE": "raise"}, cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    started = time.monotonic()
    done = {}
    for name, (out, proc) in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, TIMEOUT - (time.monotonic()
                                                                         - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            stderr += f"\n[test] killed after {TIMEOUT:.0f} s"
        done[name] = {"out": out, "code": proc.returncode, "stdout": stdout, "stderr": stderr,
                      "seconds": time.monotonic() - started}
    return done


def _explain(run: dict[str, Any]) -> str:
    return f"exit {run['code']}\n--- stderr ---\n{run['stderr'][-5000:]}"


def _lost_line(stderr: str) -> str:
    found = re.findall(r"joinkit run: lost rank\(s\) .*; the survivors finished", stderr)
    assert found, stderr[-3000:]
    return str(found[-1])


@pytest.mark.launches
@pytest.mark.timeout(int(TIMEOUT) + 120)
@pytest.mark.parametrize("name", list(KILL_LAUNCHES))
@pytest.mark.scenarios()
def test_kill_matrix_under_joinkit_run(launched: dict[str, Any], name: str) -> None:
    run = launched[name]
    world, cells = KILL_LAUNCHES[name]
    assert run["code"] == 0, _explain(run)
    ranks = {}
    for path in run["out"].glob("rank*.json"):
        data = json.loads(path.read_text())
        ranks[data["rank"]] = data
    dead = {r for cell in cells for r, _, _ in parse_cell(cell)}
    assert set(ranks) == set(range(world)) - dead, _explain(run)
    check_cells(name, world, cells, ranks)
    line = _lost_line(run["stderr"])
    for rank in sorted(dead):
        assert f"{rank} (SIGKILL, exit code -9)" in line, line
    # Every death was announced as it happened, naming the rank.
    for rank in dead:
        assert re.search(rf"joinkit run: rank {rank} \(pid \d+\) was lost \(SIGKILL",
                         run["stderr"]), _explain(run)
    # No torchrun warning: joinkit run keeps the survivors.
    assert "torchrun's agent kills every worker" not in run["stderr"], _explain(run)
    recovery = death_to_next_iteration(run["out"], ranks)
    print(f"{name}: death -> survivors' next completed iteration: "
          + ", ".join(f"{1000 * s:.0f} ms" for s in recovery))
    assert recovery and max(recovery) < 15.0


@pytest.mark.launches
@pytest.mark.timeout(int(TIMEOUT) + 120)
@pytest.mark.parametrize("spec", TAKEOVER_LAUNCHES)
@pytest.mark.scenarios()
def test_take_over_under_joinkit_run(launched: dict[str, Any], spec: str) -> None:
    import exact_runner as runner

    run = launched[spec]
    assert run["code"] == 0, _explain(run)
    s = runner.parse(spec)
    dead = {r for kills in s["epochs"] for r in kills}
    ranks = {}
    for rank in set(range(s["world"])) - dead:
        ranks[rank] = json.loads((run["out"] / f"cell0-rank{rank}.json").read_text())
    record_error(f"{spec} (joinkit run)", check_take_over(run["out"], 0, spec, ranks))
    _lost_line(run["stderr"])


@pytest.mark.launches
@pytest.mark.timeout(int(TIMEOUT) + 120)
@pytest.mark.scenarios("raise")
def test_without_finish_mode_it_is_torchrun(launched: dict[str, Any]) -> None:
    run = launched["raise"]
    assert run["code"] == 1, _explain(run)
    assert "was lost" not in run["stderr"], _explain(run)
    assert "the survivors finished" not in run["stderr"], _explain(run)
    # torchrun's failure summary, naming the dead worker's signal.
    assert "Signal 9 (SIGKILL) received by PID" in run["stderr"], _explain(run)
    assert not list(run["out"].glob("rank*.json"))  # nobody finished


@pytest.mark.launches
@pytest.mark.timeout(int(TIMEOUT) + 120)
@pytest.mark.scenarios("example")
def test_the_example_trains_every_sample_once(launched: dict[str, Any]) -> None:
    # examples/elastic_run.py, as docs/elastic-torch.md runs it.
    run = launched["example"]
    assert run["code"] == 0, _explain(run)
    # (gloo's own connection lines, which some torch releases print, e.g. 2.10, aside)
    said = [line for line in run["stdout"].splitlines() if not line.startswith("[Gloo] ")]
    assert said == [
        "rank 1 consumed 4 samples; its other 6 went to ranks 0, 2",
        "every sample of the epoch trained once: True"], run["stdout"]
    assert _lost_line(run["stderr"]) == (
        "joinkit run: lost rank(s) 1 (SIGKILL, exit code -9); the survivors finished"), (
        _explain(run))


@pytest.mark.launches
@pytest.mark.timeout(120)
def test_help_is_torchruns_under_its_own_name() -> None:
    done = subprocess.run([sys.executable, "-m", "joinkit", "run", "--help"],
                          capture_output=True, text=True, timeout=110, env=_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m joinkit run"), done.stdout[:300]
    assert "--nproc-per-node" in done.stdout and "--rdzv-backend" in done.stdout
    # The console script is the same command; a bad argument is torchrun's error.
    script = Path(sys.executable).with_name("joinkit")
    bad = subprocess.run([str(script), "run", "--nproc-per-node"], capture_output=True,
                         text=True, timeout=110, env=_env())
    assert bad.returncode == 2, bad.stderr
    assert "python -m joinkit run: error: argument --nproc-per-node" in bad.stderr, bad.stderr


def test_the_doctor_and_the_warning_know_joinkit_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from joinkit.backends.launch._doctor import collect
    from joinkit.backends.torch_dist import _elastic as _torch_elastic

    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2"}

    def rank_loss(env: dict[str, str]) -> Any:
        return {(f.section, f.name): f for f in collect(env)}[("launch", "rank loss")]

    plain = rank_loss(torchrun)
    assert plain.level == "note" and "python -m joinkit run" in plain.value
    ours = rank_loss({**torchrun, "JOINKIT_RUN": "1"})
    assert ours.level != "note" and "keeps the survivors" in ours.value
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.delenv("JOINKIT_RUN", raising=False)
    assert "python -m joinkit run" in (_torch_elastic.torchrun_warning() or "")
    monkeypatch.setenv("JOINKIT_RUN", "1")
    assert _torch_elastic.torchrun_warning() is None


def test_a_finish_mode_worker_announces_itself(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from joinkit.backends.torch_dist import _elastic as _torch_elastic

    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("JOINKIT_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("JOINKIT_RUN", raising=False)
    _torch_elastic.announce_finish_mode()  # not under joinkit run: nothing
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("JOINKIT_RUN", "1")
    _torch_elastic.announce_finish_mode()
    assert [p.name for p in tmp_path.iterdir()] == ["finish-5"]


def test_the_agent_checks_the_torch_internals_it_overrides() -> None:
    from joinkit.backends.torch_dist import _run

    _run.check_torch()  # torch 2.13 has them
    import torch.distributed.launcher.api as launcher

    assert launcher.LocalElasticAgent is not _run.JoinkitAgent  # only during a launch
