"""Which launcher started this process (:func:`detect_launcher`), from its environment.

Below the package and the ``launch`` package, which take it from here (the
package's ``__init__`` re-exports it). Standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["detect_launcher"]

# Variables only an MPI launcher sets: Open MPI's mpirun, MPICH's Hydra (also
# Intel MPI), MVAPICH's mpirun_rsh.
_MPIRUN_MARKERS = ("OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")
# Set by any PMI/PMIx process manager, srun's MPI plugins included.
_PMI_MARKERS = ("PMI_SIZE", "PMIX_RANK")
# Set for the tasks of an srun step, not for the batch script itself (whose
# SLURM_NTASKS would describe tasks that do not exist as processes yet).
_SRUN_STEP_MARKERS = ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS")
# Set by Ray in every process of a Ray worker (and inherited by its
# subprocesses); a Ray Train worker (TorchTrainer) also has torchrun's
# RANK/WORLD_SIZE/LOCAL_RANK and MASTER_ADDR/MASTER_PORT, but no
# TORCHELASTIC_RUN_ID: its rank 0 *process* serves the store at MASTER_PORT.
_RAY_WORKER_MARKERS = ("RAY_RAYLET_PID",)
_RAY_TRAIN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def detect_launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """Name the launcher that started this process, from its environment.

    The checks go from the most to the least specific variable, because
    launchers nest: ``srun torchrun ...`` sets Slurm's variables as well as
    torchrun's, an ``mpirun`` inside an sbatch script inherits Slurm's, srun
    with an MPI plugin sets PMI variables, and ``init_torch`` under mpirun
    exports torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``.

    Args:
        environ: the environment to inspect; ``None`` means ``os.environ``.

    A Ray Train worker (``ray.train.torch.TorchTrainer``; ``RAY_RAYLET_PID``
    with torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``, which Ray
    Train sets, and no ``TORCHELASTIC_RUN_ID``) and any subprocess of one is
    ``"ray"``; a torchrun or mpirun started inside a Ray task is still that
    launcher.

    Returns:
        ``"torchrun"``, ``"mpirun"`` (Open MPI, MPICH/Hydra, MVAPICH or a
        PMI/PMIx process manager), ``"srun"`` (Slurm), ``"ray"`` (a Ray Train
        worker or its subprocess), or ``None`` when no launcher is detected.
    """
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if any(key in env for key in _MPIRUN_MARKERS):
        return "mpirun"
    if (
        "SLURM_PROCID" in env
        and ("SLURM_NTASKS" in env or "SLURM_STEP_NUM_TASKS" in env)
        and any(key in env for key in _SRUN_STEP_MARKERS)
    ):
        return "srun"
    if any(key in env for key in _PMI_MARKERS):
        return "mpirun"
    if any(key in env for key in _RAY_WORKER_MARKERS) and all(
        key in env for key in _RAY_TRAIN_VARIABLES
    ):
        return "ray"
    if "LOCAL_RANK" in env and "WORLD_SIZE" in env:
        # torch.distributed.launch or a hand-made torchrun environment.
        return "torchrun"
    return None
