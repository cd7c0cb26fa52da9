"""Every example runs unchanged under ``torchrun --nproc-per-node 2`` and under
``mpirun -n 2`` and prints the tutorial's lines.

The launches of one launcher start at once (each is mostly waiting for torch to
import) and are collected by one module fixture. ``--standalone`` makes torchrun's
rendezvous store listen on a port the kernel picks, so concurrent launches (and
other jobs on the machine) cannot clash over a port. The two ranks print
concurrently, so a rank's line may be split by the other's; the test extracts
the tutorial's sentences, compares them as a multiset, and requires that
nothing else was printed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import launch_ranks
from support.mpi import mpirun

ROOT = Path(__file__).resolve().parents[2]
# The venv's torchrun script; `python -m torch.distributed.run` is the same program.
_SCRIPT = Path(sys.executable).with_name("torchrun")
TORCHRUN = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "torch.distributed.run"]
LAUNCH_TIMEOUT = 150.0  # seconds, for all launches together

DDP_LINES = [
    "Rank 0 has exhausted all 5 of its inputs!",
    "Rank 1 has exhausted all 6 of its inputs!",
]
COUNTER_LINES = [
    "10 inputs processed before rank 0 joined!",
    "11 inputs processed across all ranks!",
    "11 inputs processed before rank 1 joined!",
    "11 inputs processed across all ranks!",
]
EVAL_LINES = [
    "exact (Gather in a Join): accuracy 0.5385 on 13 samples",
    "padded (DistributedSampler): accuracy 0.5000 on 14 samples",
]
EXPECTED = {
    "ddp.py": DDP_LINES,
    "ddp_zero.py": DDP_LINES,
    "ddp_kwargs.py": DDP_LINES,
    "fsdp.py": DDP_LINES,
    "counter.py": COUNTER_LINES,
    "custom_backend.py": COUNTER_LINES,
    "eval.py": EVAL_LINES,
}
LAUNCHERS = {
    "torchrun": [*TORCHRUN, "--standalone", "--nproc-per-node", "2"],
    "mpirun": [mpirun(), "-n", "2", sys.executable],
}
SENTENCE = re.compile(
    r"Rank \d+ has exhausted all \d+ of its inputs!"
    r"|\d+ inputs processed before rank \d+ joined!"
    r"|\d+ inputs processed across all ranks!"
    r"|(?:exact \(Gather in a Join\)|padded \(DistributedSampler\)): accuracy [\d.]+ on \d+ "
    r"samples"
)


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    # A launcher's variables from an outer job would confuse torchrun's workers.
    for key in list(env):
        if key.startswith(("TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "SLURM_")) or key in {
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "JOINKIT_BACKEND",
        }:
            del env[key]
    env["OMP_NUM_THREADS"] = "1"
    return env


#: Examples with a launcher of their own, run by their own test module.
OWN_TESTS = {
    "fabric.py": "tests/adapters/lightning/test_lightning_fabric.py",
    "lightning_trainer.py": "tests/adapters/lightning/test_lightning_trainer.py",
    "ray_train.py": "tests/adapters/ray/test_ray.py",
    "accelerate_uneven.py": "tests/adapters/accelerate/test_accelerate.py",
    "deepspeed_uneven.py": "tests/adapters/deepspeed/test_deepspeed.py",
    "hf_trainer.py": "tests/adapters/transformers/test_transformers.py",
    "elastic.py": "tests/elastic/test_elastic_mpi.py",
    "elastic_run.py": "tests/elastic/test_joinkit_run.py",
}


def test_every_example_is_covered() -> None:
    assert sorted([*EXPECTED, *OWN_TESTS]) == sorted(
        p.name for p in (ROOT / "examples").glob("*.py"))
    for example, test in OWN_TESTS.items():
        assert example in (ROOT / test).read_text(), (example, test)


@pytest.fixture(scope="module", params=list(LAUNCHERS))
def launches(request: pytest.FixtureRequest) -> dict[str, subprocess.CompletedProcess[str]]:
    env = _environment()
    env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    names = list(EXPECTED)
    runs = launch_ranks([[*LAUNCHERS[request.param], str(ROOT / "examples" / name)]
                         for name in names],
                        LAUNCH_TIMEOUT, env=env, cwd=ROOT, merge_stderr=False)
    done = dict(zip(names, runs, strict=True))
    return done


@pytest.mark.launches
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
@pytest.mark.parametrize("program", list(EXPECTED))
def test_prints_the_tutorial_lines(
    launches: dict[str, subprocess.CompletedProcess[str]], program: str
) -> None:
    run = launches[program]
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(SENTENCE.findall(run.stdout)) == sorted(EXPECTED[program]), run.stdout
    assert SENTENCE.sub("", run.stdout).strip() == "", run.stdout
