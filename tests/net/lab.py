"""Hosts on one machine: network namespaces on a bridge, with silent cuts between them.

Each host is a namespace with one interface (``eth0``) on a bridge in a switch namespace
of its own, an address on a private /24 the lab picks, and a permanent neighbour entry for
every other host. A cut between two hosts points each one's entry for the other at a MAC
address no one has: their packets leave and are dropped by the bridge, silently, in both
directions (no reset, no "unreachable": connects and replies time out, as across a real
partition); a heal restores the entries and TCP's retransmissions carry on. This kernel has
no netem or tc actions and the machine no nftables, so this is done with iproute2 alone.

Nothing touches the root namespace. Every namespace is named ``dgn<pid>-...``: the lab
removes its own on close, and, on start, those of earlier labs whose process is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cli.stack import Process
from datagen.redis_server import redis_binary

PREFIX = "dgn"
NOWHERE_MAC = "02:00:00:00:00:{:02x}"  # locally administered, never on the bridge


def unavailable_reason() -> str:
    """Why namespaces cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on the PATH"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _ip(*args: str, ns: str | None = None) -> str:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


def remove_stale() -> None:
    """Namespaces of labs whose process is gone (a run killed before its cleanup)."""
    for line in _ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        found = re.fullmatch(rf"{PREFIX}(\d+)-.+", name)
        if found and not Path(f"/proc/{found.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    mac: str


class Lab:
    """``with Lab(workdir) as lab``: ``lab.host("redis")`` makes a host, ``lab.cut(a, b)``
    drops everything between two hosts until ``lab.heal(a, b)``."""

    def __init__(self, workdir: Path, subnet_index: int = 0):
        self.workdir = workdir
        self.tag = f"{PREFIX}{os.getpid()}"
        # 10.<200 + xdist worker>.<pid % 250>.0/24: apart from any other lab running now
        self.net = f"10.{200 + subnet_index % 50}.{os.getpid() % 250}"
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self.procs: list[Process] = []
        self._cut: set[frozenset[str]] = set()

    def __enter__(self) -> Lab:
        remove_stale()
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout_s=10)
        for ns in [h.ns for h in self.hosts.values()] + [self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.hosts.clear()

    def host(self, name: str) -> Host:
        """A new host on the bridge, in touch with every other."""
        index = len(self.hosts) + 1
        ns, port = f"{self.tag}-{name}", f"p{index}"
        _ip("netns", "add", ns)
        _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
            "netns", self.switch)
        _ip("link", "set", port, "master", "br0", ns=self.switch)
        _ip("link", "set", port, "up", ns=self.switch)
        ip = f"{self.net}.{index}"
        _ip("addr", "add", f"{ip}/24", "dev", "eth0", ns=ns)
        for link in ("lo", "eth0"):
            _ip("link", "set", link, "up", ns=ns)
        mac = _ip("-br", "link", "show", "eth0", ns=ns).split()[2]
        host = Host(name, ns, ip, mac)
        for other in self.hosts.values():
            self._neighbour(host, other, other.mac)
            self._neighbour(other, host, host.mac)
        self.hosts[name] = host
        return host

    def _neighbour(self, on: Host, of: Host, mac: str) -> None:
        _ip("neigh", "replace", of.ip, "lladdr", mac, "dev", "eth0", "nud", "permanent",
            ns=on.ns)

    def cut(self, a: str, b: str) -> None:
        """Drop every packet between hosts a and b, both ways, silently."""
        ha, hb = self.hosts[a], self.hosts[b]
        self._neighbour(ha, hb, NOWHERE_MAC.format(len(self._cut) % 250 + 1))
        self._neighbour(hb, ha, NOWHERE_MAC.format(len(self._cut) % 250 + 1))
        self._cut.add(frozenset((a, b)))

    def heal(self, a: str, b: str) -> None:
        ha, hb = self.hosts[a], self.hosts[b]
        self._neighbour(ha, hb, hb.mac)
        self._neighbour(hb, ha, ha.mac)
        self._cut.discard(frozenset((a, b)))

    def cut_from(self, a: str, others: Sequence[str]) -> None:
        for b in others:
            self.cut(a, b)

    def heal_from(self, a: str, others: Sequence[str]) -> None:
        for b in others:
            self.heal(a, b)

    def spawn(self, host: str, name: str, argv: Sequence[str],
              env: Mapping[str, str] | None = None) -> Process:
        """A process of the project's, run inside a host, with its log under workdir."""
        proc = Process(name, ["ip", "netns", "exec", self.hosts[host].ns, *argv],
                       self.workdir / "logs" / f"{name}.log", env)
        self.procs.append(proc)
        return proc

    def start_redis(self, host: str, port: int) -> Path:
        """A Redis on ``host`` at ``port``, also on a unix socket (returned) through which the
        test itself reads the ledger without a network."""
        sock = self.workdir / "redis.sock"
        self.spawn(host, "redis", [
            redis_binary(), "--bind", self.hosts[host].ip, "--port", str(port),
            "--unixsocket", str(sock), "--unixsocketperm", "700", "--save", "",
            "--appendonly", "no", "--protected-mode", "no", "--dir", str(self.workdir)])
        return sock

    def wait_log(self, proc: Process, text: str, timeout_s: float = 600.0) -> str:
        """The first log line holding ``text``; fails at once when the process exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in proc.log_text().splitlines():
                if text in line:
                    return line
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.log_text()[-3000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"{proc.name}: no {text!r} after {timeout_s}s")
