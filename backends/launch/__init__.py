"""Starting a world: which launcher started this process, which backend fits it,
the rendezvous, and ``python -m joinkit doctor``.

joinkit's own code, not an outside library's: it calls the torch and MPI
backends' public functions (``joinkit.backends.torch_dist``,
``joinkit.backends.mpi``) and never imports torch or mpi4py itself.

The room: ``_plan`` (the launch plan from the environment, :func:`init` and
:func:`init_torch`), ``_network`` (the rendezvous address, gloo's network
interface, host facts) and ``_doctor`` (the ``doctor`` command); the ``run``
command's parser is here, its agent in ``joinkit.backends.torch_dist``.
"""

from __future__ import annotations

from typing import Any

from ._doctor import add_command as add_doctor_command
from ._network import gloo_interface
from ._plan import init, init_torch

__all__ = ["init", "init_torch", "gloo_interface", "add_doctor_command", "add_run_command"]


def add_run_command(commands: Any) -> None:
    """The ``joinkit.commands`` entry point: add ``run`` to ``python -m joinkit``.

    ``run`` takes torchrun's arguments as they are (its parser, torch's, reads
    them when the command runs: building this parser imports no torch).
    """
    import argparse

    run = commands.add_parser(
        "run", prefix_chars="+", add_help=False,
        help="torchrun, keeping the survivors of a worker that dies in "
        "Join(on_rank_loss='finish') (docs/elastic-torch.md)",
        description="torchrun's launcher (the same arguments) with an elastic agent that "
        "keeps the surviving workers running when one dies inside Join(..., "
        "on_rank_loss='finish'), and exits 0 when they finished.",
    )
    run.add_argument("argv", nargs=argparse.REMAINDER)
    run.set_defaults(run=_run)


def _run(args: Any) -> int:
    from joinkit.backends import torch_dist

    return torch_dist.run_command(list(args.argv))
