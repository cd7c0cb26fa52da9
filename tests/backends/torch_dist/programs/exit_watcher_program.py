"""A finish-mode Join's process that leaves while its elastic watcher reads the store.

Run as ``python exit_watcher_program.py`` (``test_exit_torch.py``):
one gloo rank over a ``TCPStore`` it hosts, one ``Join(..., on_rank_loss="finish")``
over a Counter, so the group's elastic watcher thread runs (``_elastic``). An
object that Python frees while it finalizes then posts the failure key the watcher
looks for and waits a moment, the GIL released: a watcher still running then (one
that blocked in ``store.wait`` for the key, as before the fix) comes back from the
store, takes the GIL back and is ended by ``pthread_exit`` inside pybind11's GIL
release, which aborts the process ("terminate called without an active
exception", SIGABRT). The exit guard stops and joins the watcher first, so the
process exits 0. Prints the watcher threads alive once the exit guard ran.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support import Counter  # noqa: E402

from joinkit import Join  # noqa: E402
from joinkit.backends.torch_dist import TorchGroup  # noqa: E402


class PostAtFinalization:
    """Frees last: posts the key and gives the watcher the GIL for a moment."""

    def __init__(self, store: dist.Store, key: str) -> None:  # type: ignore[name-defined]
        self.store, self.key, self.cycle = store, key, self
        self.sleep, self.write = time.sleep, os.write  # module globals may be gone then

    def __del__(self) -> None:
        self.store.set(self.key, "rank 0: posted while Python finalizes")
        self.sleep(0.5)
        self.write(1, b"posted the key while Python finalized\n")


def main() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True,  # type: ignore[attr-defined]
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = TorchGroup(store_outlives_ranks=True)
    counter = Counter(group)
    with Join([counter], on_rank_loss="finish"):
        for _ in range(3):
            counter()
    elastic = group._elastic
    assert elastic is not None
    time.sleep(0.3)  # the watcher is reading the store (before the fix: blocked in it)
    # A reference cycle in __main__: freed while Python finalizes, after the exit guard.
    globals()["poster"] = PostAtFinalization(elastic.store,
                                             elastic.key(elastic.generation, "failed"))

    def report() -> None:  # registered first: runs after the exit guard
        alive = [t.name for t in threading.enumerate() if t.name == "joinkit-elastic"]
        print(f"watchers alive after the exit guard: {alive}", flush=True)

    atexit.register(report)
    from joinkit.backends.torch_dist import _exit  # noqa: PLC0415 - its guard: registered late

    atexit.unregister(_exit.settle_at_exit)
    atexit.register(_exit.settle_at_exit)


if __name__ == "__main__":
    main()
