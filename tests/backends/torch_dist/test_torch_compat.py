"""``torch_dist._compat``: what differs between torch releases, resolved on every release.

The store's own connection is the one a recovery's gloo rendezvous blocks on
while a rank that died during the recovery never posts its address
(``tests/elastic/test_elastic_torch.py``, the ``+1/recovery/0`` cells): a
request that waits there must not hold the other threads' requests. Both
forms are tested on every torch: ``Store.clone()`` where torch has it, and the
new client that torch 2.6 and 2.7 get.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

dist = pytest.importorskip("torch.distributed")

from joinkit.backends.torch_dist import _compat  # noqa: E402

#: How long the blocked request waits (the store's timeout, as gloo's get would).
BLOCKED = 3.0


@pytest.fixture
def store() -> Iterator[Any]:
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=BLOCKED))
    client = dist.TCPStore("127.0.0.1", server.port, None, False,
                           datetime.timedelta(seconds=BLOCKED))
    yield dist.PrefixStore("cell/", dist.PrefixStore("default_pg/", client))


def _blocked_while(connection: Any, store: Any) -> float:
    """Seconds ``store.set``/``check`` take while ``connection`` waits for a missing key."""
    waiting = threading.Event()

    def wait() -> None:
        waiting.set()
        try:
            connection.get("never-posted")  # gloo's rendezvous, for a dead rank
        except Exception:  # noqa: BLE001 - the store's timeout: expected
            pass

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    waiting.wait()
    time.sleep(0.2)  # the get is on the wire
    start = time.monotonic()
    store.set("alive/1", "1")
    assert store.check(["alive/1"])
    took = time.monotonic() - start
    thread.join(BLOCKED + 5)
    return took


@pytest.mark.slow  # the blocked request waits out the store's timeout
@pytest.mark.parametrize("form", ["as this torch has it", "new client (torch 2.6, 2.7)"])
def test_a_request_on_its_own_connection_holds_no_other(store: Any, form: str) -> None:
    scope = "joinkit/elastic-scope/t/"
    connection = (_compat.own_connection(store, lambda: scope) if form.startswith("as")
                  else _compat._new_client(store, lambda: scope))
    connection.set("k", "v")  # its keys are its own, and reach the same server
    assert connection.get("k") == b"v"
    assert _blocked_while(connection, store) < BLOCKED / 2


@pytest.mark.slow
def test_a_shared_connection_would_hold_them(store: Any) -> None:
    """Why the connection matters: the same client holds the request behind the wait."""
    assert _blocked_while(store, store) > BLOCKED / 2


def test_a_store_without_a_tcp_store_beneath_is_shared() -> None:
    hashed = dist.HashStore()
    assert _compat._new_client(hashed, lambda: "x/") is hashed


def test_abort_and_backend_name_of_a_raw_group() -> None:
    class Raw:  # a group torch does not map, without abort() (torch 2.6)
        pass

    _compat.abort_group(Raw())  # nothing to call: no error
    assert _compat.backend_name(Raw()) == "?"
