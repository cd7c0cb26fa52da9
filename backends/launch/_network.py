"""Which address of this machine the other nodes of a world can reach.

Theory of operation
-------------------
Two things in a torch world that spans nodes depend on this machine's
addresses, and both fail silently when they pick loopback or a name the
other nodes cannot resolve.

1. **gloo** binds one address per process and tells its peers (through the
   store) to connect to it. torch picks it as follows: the interfaces named in
   ``GLOO_SOCKET_IFNAME`` (comma-separated; torch ignores a value of one
   character), else the first address the host name resolves to that this
   process can bind, else ``127.0.0.1``. Debian and Ubuntu put
   ``127.0.1.1 <hostname>`` into ``/etc/hosts``, so there gloo binds
   loopback, and a peer on another node connects to *its own* loopback: the
   rank that connects fails with "Connection refused", the other waits for
   the process group's timeout (30 minutes by default).
   :func:`gloo_interface` says which interface and address gloo will use and
   why, and carries a warning when that is loopback while the world spans
   nodes.
2. **init_torch under mpirun**: rank 0 tells the others where its
   rendezvous store listens. :func:`rendezvous_address` picks an address the
   others can reach: ``MASTER_ADDR``; else loopback when every rank runs on
   this node; else the address gloo binds, when that is not loopback (the
   interface the user or the host name chose for this network); else the
   source address of the default route; else any other address of this
   machine; else, with nothing better, the host name.

Both are pure functions of a :class:`HostFacts`: the host name, what it
resolves to, the interfaces with their addresses, and the default route's
source address. :func:`host_facts` gathers them from the operating system
(and :func:`probe_tcp` connects to a port); nothing else here does I/O, so
every case is unit tested with made-up facts.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import time
from collections.abc import Iterable, Mapping

import attrs

__all__ = [
    "InterfaceAddress",
    "HostFacts",
    "GlooInterface",
    "RendezvousAddress",
    "host_facts",
    "gloo_interface",
    "world_spans_nodes",
    "rendezvous_address",
    "probe_tcp",
    "DEFAULT_RENDEZVOUS_TIMEOUT",
]

#: Seconds a rank tries to reach the rendezvous store before it gives up
#: (``JOINKIT_RENDEZVOUS_TIMEOUT`` overrides it).
DEFAULT_RENDEZVOUS_TIMEOUT = 30.0

LOOPBACK = "127.0.0.1"
# Destinations for the route lookup behind HostFacts.route_address: documentation
# ranges (RFC 5737, RFC 3849). A UDP connect() only looks up the route and
# sends nothing.
_ROUTE_PROBES = (("198.51.100.1", socket.AF_INET), ("2001:db8::1", socket.AF_INET6))


@attrs.frozen(kw_only=True)
class InterfaceAddress:
    """One address of one network interface.

    Attributes:
        name: the interface, e.g. ``"eth0"``, ``"lo"``.
        address: the address, e.g. ``"10.1.2.3"`` or ``"fe80::1"``.
        prefixlen: the length of its network prefix (``24`` for a /24).
    """

    name: str
    address: str
    prefixlen: int


@attrs.frozen(kw_only=True)
class HostFacts:
    """What this machine says about its own names and addresses.

    Attributes:
        hostname: ``socket.gethostname()``.
        resolved: the addresses the host name resolves to, in the resolver's
            order (empty when it does not resolve).
        resolve_error: why it does not resolve, else ``None``.
        bindable: those of ``resolved`` this process can bind a socket to,
            in order: the ones torch's gloo considers.
        interfaces: every interface address (IPv4 and IPv6).
        route_address: the source address of the default route (what this
            machine sends from to a destination it has no specific route
            for), or ``None`` when there is no default route.
    """

    hostname: str
    resolved: tuple[str, ...] = ()
    resolve_error: str | None = None
    bindable: tuple[str, ...] = ()
    interfaces: tuple[InterfaceAddress, ...] = ()
    route_address: str | None = None


@attrs.frozen(kw_only=True)
class GlooInterface:
    """Which interface and address torch's gloo binds in this process, and why.

    Attributes:
        interface: the interface (``"eth0"``; ``"lo"`` for loopback), or
            ``None`` when no interface holds the address.
        address: the address gloo binds, or ``None`` when gloo will fail to
            start (``GLOO_SOCKET_IFNAME`` names an interface without one).
        reason: why, in words: ``"GLOO_SOCKET_IFNAME=eth0"``, ``"the host
            name 'node1' resolves to 127.0.1.1"``, ...
        loopback: whether ``address`` is a loopback address (no other node
            can connect to it).
        spans_nodes: whether the world spans several nodes (``None``: unknown).
        warning: what will go wrong and how to fix it, when something will:
            loopback on a world that spans nodes, or an interface that does
            not exist. ``None`` otherwise.
    """

    interface: str | None
    address: str | None
    reason: str
    loopback: bool
    spans_nodes: bool | None = None
    warning: str | None = None

    def __str__(self) -> str:
        where = self.address if self.interface is None else f"{self.address} ({self.interface})"
        if self.address is None:
            where = "no address"
        return f"gloo binds {where}: {self.reason}"


@attrs.frozen(kw_only=True)
class RendezvousAddress:
    """The address rank 0 gives its peers for the rendezvous store.

    Attributes:
        address: a host name or an IP address.
        chosen_because: why this one, in words (for error messages).
        from_master_addr: whether it is ``MASTER_ADDR`` (the user's choice).
    """

    address: str
    chosen_because: str
    from_master_addr: bool = False


# -- the pure part ----------------------------------------------------------------


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return address == "localhost"


def _is_link_local(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_link_local
    except ValueError:
        return False


def interface_of(address: str, interfaces: Iterable[InterfaceAddress]) -> str | None:
    """The interface that holds ``address``, or whose network contains it.

    ``127.0.1.1`` is nobody's address, but it is in ``lo``'s ``127.0.0.0/8``.

    Args:
        address: an IP address.
        interfaces: this machine's interface addresses.

    Returns:
        The interface name, or ``None``.
    """
    try:
        wanted = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None
    containing = None
    for item in interfaces:
        held = ipaddress.ip_address(item.address.split("%")[0])
        if held == wanted:
            return item.name
        if containing is None and held.version == wanted.version:
            network = ipaddress.ip_network(f"{held}/{item.prefixlen}", strict=False)
            # Only loopback networks count as "holding" every address in them
            # (the kernel answers for all of 127.0.0.0/8 on lo).
            if wanted in network and held.is_loopback:
                containing = item.name
    return containing


def world_spans_nodes(environ: Mapping[str, str] | None = None) -> bool | None:
    """Whether the launcher's world spans more than one node, from its variables.

    Args:
        environ: the environment; ``None`` means ``os.environ``.

    Returns:
        ``True`` or ``False`` when a launcher says (torchrun:
        ``LOCAL_WORLD_SIZE`` < ``WORLD_SIZE``; Slurm: ``SLURM_STEP_NUM_NODES``
        or ``SLURM_NNODES``; Open MPI: ``OMPI_COMM_WORLD_LOCAL_SIZE`` <
        ``OMPI_COMM_WORLD_SIZE``; MPICH/Hydra: ``MPI_LOCALNRANKS`` <
        ``PMI_SIZE``), else ``None``.
    """
    env = os.environ if environ is None else environ

    def number(name: str) -> int | None:
        try:
            return int(env[name])
        except (KeyError, ValueError):
            return None

    for nodes in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        count = number(nodes)
        if count is not None and "SLURM_PROCID" in env:
            return count > 1
    for local, world in (("LOCAL_WORLD_SIZE", "WORLD_SIZE"),
                         ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"),
                         ("MPI_LOCALNRANKS", "PMI_SIZE")):
        here, everywhere = number(local), number(world)
        if here is not None and everywhere is not None:
            return here < everywhere
    return None


def _interface_names(interfaces: Iterable[InterfaceAddress], *, loopback: bool) -> list[str]:
    names: list[str] = []
    for item in interfaces:
        if _is_loopback(item.address) == loopback and item.name not in names:
            names.append(item.name)
    return names


def _suggestion(facts: HostFacts) -> str:
    """Which GLOO_SOCKET_IFNAME to suggest: the default route's interface, if any."""
    if facts.route_address is not None and not _is_loopback(facts.route_address):
        name = interface_of(facts.route_address, facts.interfaces)
        if name is not None:
            return (f"GLOO_SOCKET_IFNAME={name} (the interface of this machine's "
                    f"default route, {facts.route_address})")
    others = _interface_names(facts.interfaces, loopback=False)
    if others:
        return f"GLOO_SOCKET_IFNAME to one of {', '.join(others)}"
    return "GLOO_SOCKET_IFNAME to the interface on the network between the nodes"


def gloo_interface(
    environ: Mapping[str, str] | None = None,
    facts: HostFacts | None = None,
    *,
    spans_nodes: bool | None = None,
) -> GlooInterface:
    """Say which interface and address torch's gloo will bind here, and why.

    It follows torch's own choice (``ProcessGroupGloo``): the interfaces in
    ``GLOO_SOCKET_IFNAME`` (the first one's address is reported); else the
    first address the host name resolves to that this process can bind; else
    loopback. When the world spans nodes and that address is loopback, peers
    on other nodes cannot connect, and the result carries a warning that says
    so and what to set.

    Args:
        environ: the environment (``GLOO_SOCKET_IFNAME`` and the launcher's
            variables); ``None`` means ``os.environ``.
        facts: this machine's names and addresses; ``None`` gathers them
            (:func:`host_facts`: resolves the host name, lists interfaces).
        spans_nodes: whether the world spans several nodes; ``None`` asks the
            launcher's variables (:func:`world_spans_nodes`).

    Returns:
        A :class:`GlooInterface`; ``str()`` of it is one line for a report.
    """
    env = os.environ if environ is None else environ
    if facts is None:
        facts = host_facts()
    if spans_nodes is None:
        spans_nodes = world_spans_nodes(env)
    setting = env.get("GLOO_SOCKET_IFNAME", "")
    if len(setting) > 1:  # torch reads the variable only when it is longer than 1
        first = setting.split(",")[0]
        held = [item for item in facts.interfaces if item.name == first]
        # gloo takes the interface's first address from getifaddrs: IPv4 first.
        held.sort(key=lambda item: ":" in item.address)
        if not held:
            known = ", ".join(_interface_names(facts.interfaces, loopback=False)
                              + _interface_names(facts.interfaces, loopback=True))
            return GlooInterface(
                interface=first, address=None, reason=f"GLOO_SOCKET_IFNAME={setting}",
                loopback=False, spans_nodes=spans_nodes,
                warning=(f"GLOO_SOCKET_IFNAME={setting} names {first!r}, which is not an "
                         f"interface of this machine with an address (here: {known or 'none'}): "
                         f"gloo fails to start (\"Unable to find address for: {first}\")"),
            )
        address = held[0].address
        return _checked(GlooInterface(interface=first, address=address,
                                      reason=f"GLOO_SOCKET_IFNAME={setting}",
                                      loopback=_is_loopback(address), spans_nodes=spans_nodes),
                        facts)
    ignored = f" (GLOO_SOCKET_IFNAME={setting!r} is ignored: torch reads it only when it is " \
              "longer than one character)" if setting else ""
    if facts.bindable:
        address = facts.bindable[0]
        reason = f"the host name {facts.hostname!r} resolves to {address}{ignored}"
    else:
        address = LOOPBACK
        if facts.resolve_error is not None:
            why = f"does not resolve ({facts.resolve_error})"
        else:
            why = f"resolves to {', '.join(facts.resolved) or 'nothing'}, not an address " \
                  "of this machine"
        reason = (f"the host name {facts.hostname!r} {why}, so gloo falls back to "
                  f"loopback{ignored}")
    return _checked(GlooInterface(interface=interface_of(address, facts.interfaces),
                                  address=address, reason=reason,
                                  loopback=_is_loopback(address), spans_nodes=spans_nodes),
                    facts)


def _checked(found: GlooInterface, facts: HostFacts) -> GlooInterface:
    if not (found.loopback and found.spans_nodes):
        return found
    return attrs.evolve(found, warning=(
        f"{found}; but the world spans several nodes, and no other node can connect "
        "to a loopback address: the first collective fails on one side (\"Connection "
        "refused\") and waits for the process group's timeout on the other. Set "
        f"{_suggestion(facts)}, and on each other node the interface that reaches "
        f"this one; or make {facts.hostname!r} resolve to this node's address on "
        "that network (/etc/hosts or DNS)."
    ))


def rendezvous_address(
    master_addr: str | None,
    one_node: bool,
    facts: HostFacts,
    environ: Mapping[str, str] | None = None,
) -> RendezvousAddress:
    """The address rank 0 should give the other ranks for its rendezvous store.

    In order: ``master_addr`` (``MASTER_ADDR``); loopback when every rank runs
    on this node; the address gloo binds (:func:`gloo_interface`) unless it is
    loopback; the default route's source address; another address of this
    machine (not loopback or link-local); the host name.

    Args:
        master_addr: ``MASTER_ADDR``, or ``None``.
        one_node: whether every rank runs on this node.
        facts: this machine's names and addresses (:func:`host_facts`).
        environ: for ``GLOO_SOCKET_IFNAME``; ``None`` means ``os.environ``.

    Returns:
        The :class:`RendezvousAddress`.
    """
    if master_addr:
        return RendezvousAddress(address=master_addr, chosen_because="MASTER_ADDR is set",
                                 from_master_addr=True)
    if one_node:
        return RendezvousAddress(address=LOOPBACK,
                                 chosen_because="every rank runs on this node")
    gloo = gloo_interface(environ, facts, spans_nodes=True)
    if gloo.address is not None and not gloo.loopback:
        return RendezvousAddress(address=gloo.address,
                                 chosen_because=f"it is the address gloo binds ({gloo.reason})")
    route = facts.route_address
    if route is not None and not _is_loopback(route):
        name = interface_of(route, facts.interfaces) or "?"
        return RendezvousAddress(
            address=route,
            chosen_because=f"it is the address of the default route's interface {name}")
    for item in facts.interfaces:
        if not _is_loopback(item.address) and not _is_link_local(item.address):
            return RendezvousAddress(
                address=item.address,
                chosen_because=f"it is the address of interface {item.name} (no default route)")
    return RendezvousAddress(address=facts.hostname,
                             chosen_because="this machine has no address but loopback")


# -- asking the operating system --------------------------------------------------


def host_facts() -> HostFacts:
    """Gather this machine's :class:`HostFacts` (resolves names; sends nothing).

    Returns:
        The facts; interfaces are listed on Linux (``ioctl`` for IPv4,
        ``/proc/net/if_inet6`` for IPv6) and left empty elsewhere.
    """
    hostname = socket.gethostname()
    resolved: list[str] = []
    bindable: list[str] = []
    error = None
    try:
        infos = socket.getaddrinfo(hostname, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except OSError as exc:
        infos, error = [], str(exc)
    for family, kind, proto, _, sockaddr in infos:
        address = str(sockaddr[0])
        if address in resolved:
            continue
        resolved.append(address)
        try:  # torch's test: can this process bind the address?
            with socket.socket(family, kind, proto) as probe:
                probe.bind(sockaddr)
            bindable.append(address)
        except OSError:
            pass
    return HostFacts(hostname=hostname, resolved=tuple(resolved), resolve_error=error,
                     bindable=tuple(bindable), interfaces=_interfaces(),
                     route_address=_route_address())


def _route_address() -> str | None:
    for destination, family in _ROUTE_PROBES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((destination, 9))
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return None


_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B


def _interfaces() -> tuple[InterfaceAddress, ...]:
    try:
        import fcntl
    except ImportError:  # not a Unix
        return ()
    found: list[InterfaceAddress] = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            request = struct.pack("256s", name.encode()[:15])
            try:
                address = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                                       request)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFNETMASK,
                                                    request)[20:24])
            except OSError:  # no IPv4 address (or not Linux)
                continue
            prefix = ipaddress.ip_network(f"0.0.0.0/{mask}").prefixlen
            found.append(InterfaceAddress(name=name, address=address, prefixlen=prefix))
    try:
        with open("/proc/net/if_inet6") as table:
            rows = table.read().split("\n")
    except OSError:
        rows = []
    for row in rows:
        fields = row.split()
        if len(fields) != 6:
            continue
        hexaddr, _index, prefix_hex, _scope, _flags, name = fields
        address = str(ipaddress.IPv6Address(bytes.fromhex(hexaddr)))
        found.append(InterfaceAddress(name=name, address=address, prefixlen=int(prefix_hex, 16)))
    return tuple(found)


def probe_tcp(address: str, port: int, timeout: float) -> str | None:
    """Try to open a TCP connection to ``address:port`` until ``timeout`` runs out.

    The connection is closed at once; torch's store drops a client that says
    nothing.

    Args:
        address: a host name or IP address.
        port: the port.
        timeout: seconds to keep trying (a name that does not resolve, a
            refused or unanswered connection are all retried).

    Returns:
        ``None`` once a connection opened; else why the last try failed, in
        words (``"the name 'node1' does not resolve here ([Errno -3] ...)"``).
    """
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((address, port), timeout=max(1.0, min(remaining, 10))):
                return None
        except socket.gaierror as exc:
            why = f"the name {address!r} does not resolve here ({exc})"
        except ConnectionRefusedError as exc:
            why = f"the connection was refused ({exc}): nothing listens there on this port"
        except OSError as exc:  # timeouts, unreachable networks
            why = f"no connection ({exc})"
        if time.monotonic() + 0.5 >= deadline:
            return why
        time.sleep(0.5)
