"""Starting a world: which launcher started this process, which backend fits it,
the rendezvous, and ``python -m joinkit doctor``.

joinkit's own code, not an outside library's: it calls the torch and MPI
backends' public functions (``joinkit.backends.torch_dist``,
``joinkit.backends.mpi``) and never imports torch or mpi4py itself.

The room: ``_plan`` (the launch plan from the environment, :func:`init` and
:func:`init_torch`), ``_network`` (the rendezvous address, gloo's network
interface, host facts) and ``_doctor`` (the ``doctor`` command).
"""

from __future__ import annotations

from ._doctor import add_command as add_doctor_command
from ._network import gloo_interface
from ._plan import init, init_torch

__all__ = ["init", "init_torch", "gloo_interface", "add_doctor_command"]
