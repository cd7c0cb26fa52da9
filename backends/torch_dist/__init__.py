"""The torch.distributed backend (gloo, nccl): joinkit's only door to torch.distributed.

Importing this package registers its kinds of group with the backend registry
(a ``torch.distributed.ProcessGroup``, ``None`` for the default group, and a
:class:`TorchGroup`); ``joinkit.backends.resolve_builtin`` imports it once the
program has imported ``torch.distributed``.

The room (each module's doc says more):

- ``_group``: :class:`TorchGroup`, the collectives over a torch process group
  (waits in slices, the board's and the abort's methods) and the registry's
  factories;
- ``_board``: the threads beside a group over the c10d store (the status
  publisher, the abort watcher, bounded store access);
- ``_exit``: the exit guard that keeps gloo's tensors owned by Python and
  settles its worker threads at exit (:func:`settle_at_exit`);
- ``_elastic``: the group rebuilt over the survivors of a lost rank
  (``Join(on_rank_loss="finish")``);
- ``_launcher``: what ``joinkit.backends.launch`` and the doctor need of torch;
- ``_compat``: the torch.distributed members that differ between the torch
  releases joinkit supports (a store's own connection, a group's abort);
- ``_run``: ``python -m joinkit run``, torchrun's launcher with an agent that
  keeps the survivors of a finish-mode worker's death (:func:`run_command`).
"""

from __future__ import annotations

from ._exit import settle_at_exit
from ._group import GroupAborted, TorchGroup, elastic_raw_groups
from ._launcher import (
    default_backend_name,
    destroy_default_group,
    hash_store,
    init_default_group,
    is_initialized,
    library_facts,
    prefix_store,
    tcp_store,
)

__all__ = [
    "run_command",
    "TorchGroup",
    "GroupAborted",
    "settle_at_exit",
    "elastic_raw_groups",
    "library_facts",
    "is_initialized",
    "default_backend_name",
    "hash_store",
    "tcp_store",
    "prefix_store",
    "init_default_group",
    "destroy_default_group",
]


def run_command(argv: list[str], prog: str = "python -m joinkit run") -> int:
    """``python -m joinkit run``: torchrun with an agent that keeps the survivors.

    Args:
        argv: torchrun's arguments, then the training script and its arguments.
        prog: the program name for the help and errors.

    Returns:
        The exit status: 0 when every worker, or after the loss of workers in
        ``Join(..., on_rank_loss="finish")`` every survivor, exited 0.
    """
    from ._run import main  # torch.distributed.elastic: only for this command

    return main(argv, prog)
