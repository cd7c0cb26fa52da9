"""Which address reaches the other nodes: ``backends._network`` with made-up hosts.

``gloo_interface`` and ``rendezvous_address`` are pure functions of a
``HostFacts``; each case below is a machine described by its facts. The
two-node job (``test_two_nodes.py``) checks the same answers on real
namespaces, and that gloo really fails where they say it will.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import attrs
import pytest

from joinkit import backends
from joinkit.backends.launch import _plan as _launch
from joinkit.backends.launch._network import (
    GlooInterface,
    HostFacts,
    InterfaceAddress,
    gloo_interface,
    host_facts,
    interface_of,
    probe_tcp,
    rendezvous_address,
    world_spans_nodes,
)

LO = (InterfaceAddress(name="lo", address="127.0.0.1", prefixlen=8),
      InterfaceAddress(name="lo", address="::1", prefixlen=128))
ETH0 = InterfaceAddress(name="eth0", address="10.1.0.7", prefixlen=16)
ETH0_V6 = InterfaceAddress(name="eth0", address="fe80::1", prefixlen=64)
IB0 = InterfaceAddress(name="ib0", address="192.168.7.7", prefixlen=24)
# A Debian/Ubuntu workstation: the installer maps the host name to 127.0.1.1.
DEBIAN = HostFacts(hostname="node1", resolved=("127.0.1.1",), bindable=("127.0.1.1",),
                   interfaces=(*LO, ETH0, ETH0_V6), route_address="10.1.0.7")
# A cluster node: DNS gives the name the address on the cluster network (ib0),
# the default route goes out of eth0.
CLUSTER = HostFacts(hostname="c042", resolved=("192.168.7.7",), bindable=("192.168.7.7",),
                    interfaces=(*LO, ETH0, IB0), route_address="10.1.0.7")
SPANS = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}


# -- gloo_interface ------------------------------------------------------------------


def test_debian_host_name_is_loopback_and_warned_when_the_world_spans_nodes() -> None:
    found = gloo_interface({}, DEBIAN, spans_nodes=True)
    assert (found.interface, found.address, found.loopback) == ("lo", "127.0.1.1", True)
    assert found.reason == "the host name 'node1' resolves to 127.0.1.1"
    assert str(found) == "gloo binds 127.0.1.1 (lo): the host name 'node1' resolves to 127.0.1.1"
    assert found.warning is not None
    assert found.warning.startswith(str(found) + "; but the world spans several nodes")
    assert "Set GLOO_SOCKET_IFNAME=eth0 (the interface of this machine's default route, " \
           "10.1.0.7)" in found.warning
    assert "make 'node1' resolve to this node's address" in found.warning


def test_loopback_on_one_node_is_fine() -> None:
    assert gloo_interface({}, DEBIAN, spans_nodes=False).warning is None
    # Nobody says: no warning either (a doctor prints the reason, which says loopback).
    assert gloo_interface({}, DEBIAN).warning is None


def test_spans_nodes_is_read_from_the_launcher_when_not_given() -> None:
    found = gloo_interface(SPANS, DEBIAN)
    assert found.spans_nodes is True and found.warning is not None


def test_cluster_host_name_gives_the_cluster_interface() -> None:
    found = gloo_interface({}, CLUSTER, spans_nodes=True)
    assert found == GlooInterface(interface="ib0", address="192.168.7.7",
                                  reason="the host name 'c042' resolves to 192.168.7.7",
                                  loopback=False, spans_nodes=True, warning=None)


def test_gloo_socket_ifname_wins_and_takes_the_ipv4_address_first() -> None:
    found = gloo_interface({"GLOO_SOCKET_IFNAME": "eth0"}, DEBIAN, spans_nodes=True)
    assert (found.interface, found.address, found.loopback, found.warning) == (
        "eth0", "10.1.0.7", False, None)
    assert str(found) == "gloo binds 10.1.0.7 (eth0): GLOO_SOCKET_IFNAME=eth0"


def test_gloo_socket_ifname_list_reports_the_first() -> None:
    found = gloo_interface({"GLOO_SOCKET_IFNAME": "ib0,eth0"}, CLUSTER)
    assert (found.interface, found.address) == ("ib0", "192.168.7.7")
    assert found.reason == "GLOO_SOCKET_IFNAME=ib0,eth0"


def test_gloo_socket_ifname_of_an_ipv6_only_interface() -> None:
    facts = attrs.evolve(DEBIAN, interfaces=(*LO, ETH0_V6))
    found = gloo_interface({"GLOO_SOCKET_IFNAME": "eth0"}, facts)
    assert (found.interface, found.address, found.loopback) == ("eth0", "fe80::1", False)


def test_gloo_socket_ifname_lo_on_a_world_that_spans_nodes_is_warned() -> None:
    found = gloo_interface({"GLOO_SOCKET_IFNAME": "lo"}, CLUSTER, spans_nodes=True)
    assert found.loopback and found.warning is not None
    assert found.warning.startswith("gloo binds 127.0.0.1 (lo): GLOO_SOCKET_IFNAME=lo; but")


def test_gloo_socket_ifname_naming_no_interface_says_gloo_will_fail() -> None:
    found = gloo_interface({"GLOO_SOCKET_IFNAME": "eth9"}, DEBIAN)
    assert found.address is None and found.interface == "eth9"
    assert str(found) == "gloo binds no address: GLOO_SOCKET_IFNAME=eth9"
    assert found.warning == (
        "GLOO_SOCKET_IFNAME=eth9 names 'eth9', which is not an interface of this machine "
        "with an address (here: eth0, lo): gloo fails to start (\"Unable to find address "
        "for: eth9\")")


def test_a_one_character_gloo_socket_ifname_is_ignored_as_torch_does() -> None:
    found = gloo_interface({"GLOO_SOCKET_IFNAME": "e"}, CLUSTER)
    assert found.address == "192.168.7.7"
    assert found.reason.endswith("(GLOO_SOCKET_IFNAME='e' is ignored: torch reads it only "
                                 "when it is longer than one character)")


def test_a_host_name_that_does_not_resolve_falls_back_to_loopback() -> None:
    facts = HostFacts(hostname="lost", resolve_error="[Errno -2] Name or service not known",
                      interfaces=(*LO, ETH0), route_address="10.1.0.7")
    found = gloo_interface({}, facts, spans_nodes=True)
    assert (found.interface, found.address, found.loopback) == ("lo", "127.0.0.1", True)
    assert found.reason == ("the host name 'lost' does not resolve ([Errno -2] Name or "
                            "service not known), so gloo falls back to loopback")
    assert found.warning is not None and "GLOO_SOCKET_IFNAME=eth0" in found.warning


def test_a_host_name_that_resolves_elsewhere_falls_back_to_loopback() -> None:
    facts = HostFacts(hostname="moved", resolved=("10.9.9.9",), interfaces=(*LO, ETH0))
    found = gloo_interface({}, facts)
    assert found.address == "127.0.0.1"
    assert found.reason == ("the host name 'moved' resolves to 10.9.9.9, not an address of "
                            "this machine, so gloo falls back to loopback")


def test_without_a_default_route_the_warning_lists_the_interfaces() -> None:
    facts = attrs.evolve(DEBIAN, route_address=None, interfaces=(*LO, ETH0, IB0))
    found = gloo_interface({}, facts, spans_nodes=True)
    assert found.warning is not None
    assert "Set GLOO_SOCKET_IFNAME to one of eth0, ib0, and on each other node" in found.warning


def test_gloo_interface_is_exported_by_backends() -> None:
    assert backends.gloo_interface is gloo_interface
    assert "gloo_interface" in backends.__all__


def test_gloo_interface_on_this_machine() -> None:
    # Whatever this machine is, the answer is consistent with its facts.
    facts = host_facts()
    found = gloo_interface({}, facts, spans_nodes=False)
    assert found.address in (*facts.bindable[:1], "127.0.0.1")
    assert found.warning is None


# -- world_spans_nodes -----------------------------------------------------------------


@pytest.mark.parametrize("env,spans", [
    ({}, None),
    (SPANS, True),
    ({**SPANS, "LOCAL_WORLD_SIZE": "4"}, False),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "1"}, True),
    ({"SLURM_PROCID": "0", "SLURM_NNODES": "1"}, False),
    ({"SLURM_NNODES": "3"}, None),  # the batch script, not a task
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, False),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, True),
    ({"PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"}, True),
    ({"WORLD_SIZE": "x", "LOCAL_WORLD_SIZE": "1"}, None),
])
def test_world_spans_nodes(env: dict[str, str], spans: bool | None) -> None:
    assert world_spans_nodes(env) is spans


# -- interface_of ------------------------------------------------------------------------


@pytest.mark.parametrize("address,name", [
    ("10.1.0.7", "eth0"), ("127.0.0.1", "lo"), ("127.0.1.1", "lo"), ("::1", "lo"),
    ("fe80::1", "eth0"), ("10.1.0.8", None), ("node1", None),
])
def test_interface_of(address: str, name: str | None) -> None:
    assert interface_of(address, (*LO, ETH0, ETH0_V6)) == name


# -- rendezvous_address ------------------------------------------------------------------


def test_master_addr_wins() -> None:
    chosen = rendezvous_address("head", False, DEBIAN, {})
    assert (chosen.address, chosen.from_master_addr) == ("head", True)
    assert chosen.chosen_because == "MASTER_ADDR is set"


def test_one_node_is_loopback() -> None:
    chosen = rendezvous_address(None, True, DEBIAN, {})
    assert chosen.address == "127.0.0.1" and not chosen.from_master_addr


def test_the_address_gloo_binds_when_it_is_not_loopback() -> None:
    chosen = rendezvous_address(None, False, CLUSTER, {})
    assert chosen.address == "192.168.7.7"
    assert chosen.chosen_because == ("it is the address gloo binds (the host name 'c042' "
                                     "resolves to 192.168.7.7)")
    chosen = rendezvous_address(None, False, CLUSTER, {"GLOO_SOCKET_IFNAME": "eth0"})
    assert chosen.address == "10.1.0.7"


def test_the_default_route_when_the_host_name_is_loopback() -> None:
    # What the old code broadcast here was "node1": no other node resolves it.
    chosen = rendezvous_address(None, False, DEBIAN, {})
    assert chosen.address == "10.1.0.7"
    assert chosen.chosen_because == "it is the address of the default route's interface eth0"


def test_another_interface_without_a_default_route() -> None:
    facts = attrs.evolve(DEBIAN, route_address=None, interfaces=(*LO, ETH0_V6, IB0))
    chosen = rendezvous_address(None, False, facts, {})
    assert chosen.address == "192.168.7.7"  # not the link-local fe80::1
    assert chosen.chosen_because == "it is the address of interface ib0 (no default route)"


def test_the_host_name_as_a_last_resort() -> None:
    facts = HostFacts(hostname="alone", resolved=("127.0.1.1",), bindable=("127.0.1.1",),
                      interfaces=LO)
    assert rendezvous_address(None, False, facts, {}).address == "alone"


# -- probe_tcp ---------------------------------------------------------------------------


def test_probe_tcp_connects_to_a_listener() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        accepted = threading.Thread(target=lambda: server.accept()[0].close(), daemon=True)
        accepted.start()
        assert probe_tcp("127.0.0.1", server.getsockname()[1], 5.0) is None
        accepted.join(5)


def test_probe_tcp_says_why_it_failed() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    why = probe_tcp("127.0.0.1", port, 0.1)  # nothing listens any more
    assert why is not None and why.startswith("the connection was refused")


def test_probe_tcp_names_an_unresolvable_name(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(-3, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    assert probe_tcp("node1", 1234, 0.1) == (
        "the name 'node1' does not resolve here ([Errno -3] Temporary failure in name "
        "resolution)")


# -- what init_torch does with them -------------------------------------------------------


def test_rendezvous_timeout_comes_from_the_environment() -> None:
    mpirun = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
    assert _launch.plan_launch(mpirun, "torch").rendezvous_timeout == 30.0
    plan = _launch.plan_launch({**mpirun, "JOINKIT_RENDEZVOUS_TIMEOUT": "2.5"}, "torch")
    assert plan.rendezvous_timeout == 2.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        with pytest.raises(ValueError, match=rf"^JOINKIT_RENDEZVOUS_TIMEOUT='{bad}' is not a "
                                             r"number of seconds greater than 0$"):
            _launch.plan_launch({**mpirun, "JOINKIT_RENDEZVOUS_TIMEOUT": bad}, "torch")


def test_the_unreachable_error_names_the_address_the_reason_and_the_fix() -> None:
    message = _launch._unreachable(
        "10.1.0.7", 4242, "it is the address of the default route's interface eth0", False,
        ["node1", "node2", "node3", "node4"],
        [None, "the connection was refused", None, "no connection"], 30.0)
    assert message == (
        "init_torch under mpirun: rank 1 (on node2) and 1 more (rank 3) cannot reach the "
        "rendezvous store of rank 0 (on node1) at 10.1.0.7:4242 within 30 s: the connection "
        "was refused. Rank 0 chose '10.1.0.7' because it is the address of the default "
        "route's interface eth0. Set MASTER_ADDR to an address of node1 that every node "
        "reaches, or GLOO_SOCKET_IFNAME to the interface on the network between the nodes "
        "(rank 0 then offers its address); JOINKIT_RENDEZVOUS_TIMEOUT=<seconds> gives a "
        "slow network longer.")
    message = _launch._unreachable("node1", 4242, "MASTER_ADDR is set", True,
                                   ["node1", "node2"], [None, "x"], 5.0)
    assert "or unset it (rank 0 then offers the address gloo binds" in message


def test_srun_names_a_first_node_that_does_not_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    plan = _launch.LaunchPlan(launcher="srun", backend="torch", chosen_by="launcher",
                              rendezvous_timeout=0.5)
    with pytest.raises(RuntimeError, match=(
            r"^cannot initialise torch.distributed under srun: the rendezvous address "
            r"'gpu07' \(from the step's first node \(SLURM_STEP_NODELIST\)\) does not "
            r"resolve on .* after 0.5 s \(\[Errno -2\] Name or service not known\)\. Set "
            r"MASTER_ADDR to an address of the node of rank 0 that every node resolves")):
        _launch._require_resolvable("gpu07", 29500, plan)
