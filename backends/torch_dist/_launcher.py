"""What joinkit's launcher and doctor need of torch.distributed.

Rules of this room: only the torch backend's package imports torch (the import
contracts in ``pyproject.toml``); ``joinkit.backends.launch`` calls these
functions, which ``joinkit.backends.torch_dist`` exports, instead.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from ._exit import settle_at_exit

__all__ = [
    "library_facts",
    "is_initialized",
    "default_backend_name",
    "hash_store",
    "tcp_store",
    "prefix_store",
    "init_default_group",
    "destroy_default_group",
]

def library_facts() -> dict[str, Any]:
    """What ``python -m joinkit doctor`` reports of torch.distributed here."""
    return {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def is_initialized() -> bool:
    """Whether torch.distributed's default group exists."""
    return dist.is_initialized()


def default_backend_name() -> str:
    """``"nccl"`` where CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def hash_store() -> Any:
    """An in-process store, for a world of one."""
    return dist.HashStore()  # type: ignore[attr-defined]


def tcp_store(host: str, port: int, world_size: int, is_master: bool,
              timeout: datetime.timedelta, wait_for_workers: bool = True) -> Any:
    """A ``TCPStore`` (rank 0's listens on every interface whatever ``host``)."""
    return dist.TCPStore(  # type: ignore[attr-defined]
        host, port, world_size, is_master, timeout, wait_for_workers=wait_for_workers
    )


def prefix_store(prefix: str, store: Any) -> Any:
    """``store`` with every key under ``prefix`` (a world of its own in a shared store)."""
    return dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]


def init_default_group(dist_backend: str, rank: int, world_size: int, local_rank: int,
                       store: Any, timeout: datetime.timedelta | None) -> None:
    """``init_process_group`` over ``store`` (``None``: ``env://``, torchrun's)."""
    kwargs: dict[str, Any] = {"backend": dist_backend, "rank": rank, "world_size": world_size}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if store is None:
        kwargs["init_method"] = "env://"
    else:
        kwargs["store"] = store
    if dist_backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(**kwargs)


def destroy_default_group() -> None:
    """Destroy the default group, once the exit guard has settled its collectives.

    Destroying the group while a gloo worker thread still holds a finished
    collective can deadlock or abort the process; with a collective still
    pending (a frozen peer) the guard keeps the group alive instead.
    """
    if settle_at_exit() and dist.is_initialized():
        dist.destroy_process_group()
