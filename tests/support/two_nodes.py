"""Two network namespaces joined by a veth pair: two hosts on one machine.

Each *node* is a network namespace with its own loopback and one end of a
veth pair (``jk0``, the only other interface, also its default route), and
every command run on it gets its own host name and hosts file (``unshare
--uts --mount``, then a bind mount over ``/etc/hosts``). Addresses exist only
inside the namespaces, and nothing routes out of them: the nodes reach each
other and nothing else (name lookups go to a resolver on the node's own
loopback, where none listens, so they fail at once instead of timing out).

Two hosts files, chosen per command:

``isolated``
    what a Debian/Ubuntu workstation has: the node's own name maps to
    ``127.0.1.1``, the other node's name does not resolve.
``cluster``
    what a cluster's DNS gives: both names resolve to the nodes' addresses.

Open MPI reaches the other node through an rsh agent (``--mca
plm_ssh_agent``): a script that runs its command line on the named node,
with the hosts file named by ``TWO_NODES_HOSTS`` in its environment.

``TwoNodes.run_all`` starts launches (each a list of :class:`Task`, one
process per node) at once and returns a :class:`Ran` for each.

Cleanup kills every process in either namespace (``ip netns pids``), then
deletes the namespaces (which deletes the veth pair). A namespace left by a
test run that was killed is named after its dead pid and swept by the next.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

NODES = ("node1", "node2")
ADDRESSES = {"node1": "10.77.0.1", "node2": "10.77.0.2"}
IFNAME = "jk0"
HOSTS = {
    "isolated": {node: f"127.0.0.1 localhost\n127.0.1.1 {node}\n" for node in NODES},
    "cluster": {
        node: "127.0.0.1 localhost\n" + "".join(f"{ADDRESSES[n]} {n}\n" for n in NODES)
        for node in NODES
    },
}
PREFIX = "jkn"  # namespaces: jkn<pid>[suffix]-node1, jkn<pid>[suffix]-node2
_STALE = re.compile(rf"^{PREFIX}(\d+)[a-z]*-node[12]$")

# Runs "$@" on a node: sh -c WRAP wrap HOSTS_FILE RESOLV_CONF NODE COMMAND...
_WRAP = ('mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/resolv.conf && '
         'hostname "$3" && shift 3 && exec "$@"')


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60,
                          check=check)


def unavailable() -> str | None:
    """Why two nodes cannot be made here, or ``None`` when they can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    for tool in ("ip", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (ip: apt-get install iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        with tempfile.NamedTemporaryFile("w", suffix="-hosts") as hosts:
            hosts.write("127.0.0.1 localhost\n")
            hosts.flush()
            entered = subprocess.run(
                ["ip", "netns", "exec", probe, "unshare", "--uts", "--mount", "sh", "-c",
                 'mount --bind "$1" /etc/hosts && hostname probe', "probe", hosts.name],
                capture_output=True, text=True, timeout=60)
    finally:
        _ip("netns", "del", probe, check=False)
    if entered.returncode != 0:
        return ("a node's own host name and hosts file (unshare --uts --mount, mount "
                f"--bind) cannot be made: {entered.stderr.strip()}")
    return None


def _kill_namespace_processes(namespace: str) -> None:
    for _ in range(10):
        listed = _ip("netns", "pids", namespace, check=False)
        pids = [int(pid) for pid in listed.stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def _delete(namespace: str) -> None:
    _kill_namespace_processes(namespace)
    _ip("netns", "del", namespace, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces of test runs whose process is gone; return their names."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    swept = []
    for line in listed:
        name = line.split(" ")[0]
        match = _STALE.match(name)
        if match and not _alive(int(match.group(1))):
            _delete(name)
            swept.append(name)
    return swept


@dataclass
class Task:
    """One process of a launch: ``argv`` on ``node`` with a hosts file and variables."""

    node: str
    argv: list[str]
    hosts: str = "isolated"
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Ran:
    """What the processes of one launch did."""

    returncodes: list[int | None]
    stdout: str
    stderr: str
    seconds: float  # from the start of all launches to the end of its last process

    def explain(self, limit: int = 4000) -> str:
        return (f"exit codes {self.returncodes} after {self.seconds:.0f} s\n--- stdout ---\n"
                f"{self.stdout[-limit:]}\n--- stderr (tail) ---\n{self.stderr[-limit:]}")


class TwoNodes:
    """Two nodes (network namespaces) for the length of a ``with`` block.

    Args:
        suffix: a few lowercase letters that tell this pair from another of the
            same process (each test module makes its own).
    """

    def __init__(self, suffix: str = "") -> None:
        self.tag = f"{PREFIX}{os.getpid()}{suffix}"
        self.namespaces = {node: f"{self.tag}-{node}" for node in NODES}
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.agent = self.dir / "rsh-agent"
        self.resolv = self.dir / "resolv.conf"
        self._procs: list[subprocess.Popen[str]] = []

    def __enter__(self) -> TwoNodes:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        sweep_stale()
        ends = {"node1": f"{self.tag}a", "node2": f"{self.tag}b"}
        for namespace in self.namespaces.values():
            _ip("netns", "add", namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("link", "add", ends["node1"], "type", "veth", "peer", "name", ends["node2"])
        for node, namespace in self.namespaces.items():
            _ip("link", "set", ends[node], "netns", namespace)
            _ip("-n", namespace, "link", "set", ends[node], "name", IFNAME)
            _ip("-n", namespace, "addr", "add", f"{ADDRESSES[node]}/24", "dev", IFNAME)
            _ip("-n", namespace, "link", "set", IFNAME, "up")
            _ip("-n", namespace, "route", "add", "default", "dev", IFNAME)
        for variant, files in HOSTS.items():
            for node, text in files.items():
                self.hosts_file(variant, node).write_text(text)
        self.resolv.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        self._write_agent()

    def hosts_file(self, variant: str, node: str) -> Path:
        return self.dir / f"hosts-{variant}-{node}"

    def _write_agent(self) -> None:
        cases = "\n".join(f"    {node}) ns={self.namespaces[node]} ;;" for node in NODES)
        self.agent.write_text(f"""#!/bin/sh
# rsh agent for Open MPI: rsh-agent NODE COMMAND-LINE... runs the command line
# (a shell command, as ssh would run it) on NODE, with the hosts file named by
# TWO_NODES_HOSTS (isolated or cluster).
node=$1; shift
case "$node" in
{cases}
    *) echo "rsh-agent: no node $node" >&2; exit 255 ;;
esac
hosts={self.dir}/hosts-${{TWO_NODES_HOSTS:-isolated}}-$node
exec ip netns exec "$ns" unshare --uts --mount sh -c '{_WRAP}' wrap \\
    "$hosts" {self.resolv} "$node" sh -c "$*"
""")
        self.agent.chmod(0o755)

    def command(self, node: str, argv: list[str], hosts: str = "isolated") -> list[str]:
        """The command line that runs ``argv`` on ``node`` with the given hosts file."""
        return ["ip", "netns", "exec", self.namespaces[node], "unshare", "--uts", "--mount",
                "sh", "-c", _WRAP, "wrap", str(self.hosts_file(hosts, node)), str(self.resolv),
                node, *argv]

    def popen(self, node: str, argv: list[str], env: dict[str, str], cwd: Path,
              hosts: str = "isolated") -> subprocess.Popen[str]:
        """Start ``argv`` on ``node`` (its own session, output captured)."""
        env = {**env, "TWO_NODES_HOSTS": hosts}
        proc = subprocess.Popen(self.command(node, argv, hosts), env=env, cwd=cwd, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        self._procs.append(proc)
        return proc

    def run_all(self, launches: dict[str, list[Task]], env: dict[str, str], cwd: Path,
                timeout: float, grace: float) -> dict[str, Ran]:
        """Start every launch's tasks at once; wait for all; return each launch's result.

        Args:
            launches: name -> the processes of that launch.
            env: the environment of every task (a task's own variables on top).
            cwd: where the tasks run.
            timeout: seconds for all launches together; a process still running
                then is killed (and, if its pipes stay open, everything on the nodes).
            grace: once a process of a launch failed, seconds its other
                processes get before they are killed (as ``srun
                --kill-on-bad-exit`` would do).
        """
        start = time.monotonic()
        deadline = start + timeout
        outputs: dict[str, list[tuple[int | None, str, str, float]]] = {}
        lock = threading.Lock()
        cut_short: set[int] = set()  # pids killed because another process of the launch failed

        def reap(procs: list[subprocess.Popen[str]]) -> None:
            while any(proc.poll() is None for proc in procs):
                if any(proc.poll() not in (None, 0) for proc in procs):
                    end = time.monotonic() + grace
                    while time.monotonic() < end and any(p.poll() is None for p in procs):
                        time.sleep(0.5)
                    for proc in procs:
                        if proc.poll() is None:
                            cut_short.add(proc.pid)
                            os.killpg(proc.pid, signal.SIGKILL)
                    return
                time.sleep(0.5)

        def collect(name: str, proc: subprocess.Popen[str]) -> None:
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                try:
                    out, err = proc.communicate(timeout=15)
                except subprocess.TimeoutExpired:
                    # A process outside the group holds the pipes: past the deadline
                    # every launch is over, so end everything on the nodes.
                    self.kill_all()
                    out, err = proc.communicate()
                err += f"\n[two nodes] killed after {timeout:.0f} s"
            if proc.pid in cut_short:
                err += f"\n[two nodes] killed {grace:.0f} s after another process of this " \
                       "launch failed"
            with lock:
                outputs.setdefault(name, []).append(
                    (proc.returncode, out, err, time.monotonic() - start))

        threads = []
        for name, tasks in launches.items():
            procs = []
            for task in tasks:
                proc = self.popen(task.node, task.argv, {**env, **task.env}, cwd, task.hosts)
                procs.append(proc)
                threads.append(threading.Thread(target=collect, args=(name, proc), daemon=True))
                threads[-1].start()
            if len(procs) > 1:
                threading.Thread(target=reap, args=(procs,), daemon=True).start()
        for thread in threads:
            thread.join()
        return {
            name: Ran(returncodes=[code for code, _, _, _ in done],
                      stdout="".join(out for _, out, _, _ in done),
                      stderr="".join(err for _, _, err, _ in done),
                      seconds=max(seconds for _, _, _, seconds in done))
            for name, done in outputs.items()
        }

    def kill_all(self) -> None:
        """Kill every process started here and every process in the namespaces."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for namespace in self.namespaces.values():
            _kill_namespace_processes(namespace)

    def close(self) -> None:
        """Kill every process started here, delete the namespaces and files."""
        self.kill_all()
        for namespace in self.namespaces.values():
            _delete(namespace)
        for end in ("a", "b"):  # only if _make stopped before moving them
            _ip("link", "del", f"{self.tag}{end}", check=False)
        for proc in self._procs:
            try:
                proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
