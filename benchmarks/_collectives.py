"""Count the collectives a loop starts on torch ProcessGroups (a debug run, not a timing).

    _collectives.install()          # first thing, before any process group exists
    ...
    with _collectives.counting() as counts:
        train()
    print(counts)   # {"allreduce": 40, "allgather [other group]": 20, ...}

``install`` wraps the collective methods of ``torch``'s ``ProcessGroup`` class,
through which ``torch.distributed``'s functions, DeepSpeed's and Accelerate's
collectives, a Python DDP comm hook and joinkit's torch backend (which keeps a
group's bound methods from its construction on, hence ``install`` before any
group is made) all go; a DDP model's own gradient all-reduces run in C++ (the
reducer) and are not counted. While a ``counting()`` block is open, every call
on any thread (a side channel's service thread included) adds one to its
method's count; ``[other group]`` marks a group that is not the default
(world) group, such as a side channel's own. A DDP gradient all-reduce that
joinkit's comm hook starts (``adapters/torch/_ddp_round.py``,
``_ddp_hook.py``: a bucket, which DDP alone all-reduces in C++ uncounted) is
marked ``[DDP's buckets]``, and :func:`own` leaves those out. The benchmarks
count the same loop with and without the Join: the difference of :func:`own`
is joinkit's own.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

#: The ProcessGroup methods counted.
METHODS = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base",
           "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single",
           "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
           "reduce_scatter_single", "broadcast", "reduce", "barrier", "gather", "scatter",
           "alltoall", "alltoall_base", "all_to_all_single", "send", "recv")

_lock = threading.Lock()
_open: list[Counter[str]] = []
_installed = False


def install() -> None:
    """Wrap the collective methods of ``ProcessGroup`` (once; they count inside ``counting``)."""
    global _installed
    if _installed:
        return
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup

    def wrapped(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _open:
                key = name if self is dist.group.WORLD else f"{name} [other group]"
                if _from_ddp_hook():
                    key = f"{key} {BUCKETS}"
                with _lock:
                    for counts in _open:
                        counts[key] += 1
            return method(self, *args, **kwargs)
        return call

    for name in METHODS:
        method = getattr(ProcessGroup, name, None)
        if method is not None:
            setattr(ProcessGroup, name, wrapped(name, method))
    _installed = True


#: The mark of a DDP bucket's all-reduce started by joinkit's comm hook.
BUCKETS = "[DDP's buckets]"
_HOOK_FILES = ("_ddp_round.py", "_ddp_hook.py")


def _from_ddp_hook() -> bool:
    """Whether the caller is joinkit's DDP comm hook (a few frames up)."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(_HOOK_FILES):
            return True
        frame = frame.f_back
    return False


def own(counts: Counter[str]) -> int:
    """The collectives in ``counts`` but DDP's buckets (``BUCKETS``): a loop's own."""
    return sum(n for name, n in counts.items() if BUCKETS not in name)


@contextlib.contextmanager
def counting() -> Iterator[Counter[str]]:
    """Count the collectives started inside the block (``install`` first)."""
    if not _installed:
        raise RuntimeError("_collectives.install() first, before any process group exists")
    counts: Counter[str] = Counter()
    with _lock:
        _open.append(counts)
    try:
        yield counts
    finally:
        with _lock:
            _open.remove(counts)


def per_step(counts: Counter[str], steps: int) -> str:
    """``counts`` divided by ``steps``, as ``name x.xx`` items (for a report)."""
    return ", ".join(f"{name} {n / steps:.2f}" for name, n in sorted(counts.items())) or "none"
