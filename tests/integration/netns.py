"""Several hosts on one machine, for the multi-host tests: one network namespace per host, each with one veth
link to a bridge in a namespace of its own (the switch), and an address ``SUBNET.(i+1)/24``. A process runs on
host ``i`` under ``ip netns exec`` (:meth:`Host.argv`); its files and the machine's other namespaces are shared,
as they would be over a shared file system. Needs root and iproute2: :func:`netns_hosts` skips the test
otherwise (CI runs as root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

IP = shutil.which("ip") or "ip"  # by path: a process's PATH may be cut down


@dataclass(frozen=True, slots=True)
class Host:
    ns: str  # the network namespace
    addr: str  # its IPv4 address
    dev: str  # its link, inside ns (set it down to cut the host off)

    def argv(self, *cmd: str) -> list[str]:
        """``cmd`` run on this host."""
        return [IP, "netns", "exec", self.ns, *cmd]


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@contextmanager
def netns_hosts(n: int, subnet: str) -> Iterator[list[Host]]:
    """``n`` hosts on ``subnet`` (three octets, e.g. ``"10.231.7"``), removed on exit."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for network namespaces")
    tag = uuid.uuid4().hex[:6]
    switch = f"lsw-{tag}"
    try:
        sh(IP, "netns", "add", switch)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode(errors='replace').strip()}")
    made = [switch]
    try:
        br = f"br{tag}"
        sh(IP, "-n", switch, "link", "add", br, "type", "bridge")
        sh(IP, "-n", switch, "link", "set", br, "up")
        hosts = []
        for i in range(n):
            host = Host(f"lh{i}-{tag}", f"{subnet}.{i + 1}", f"v{i}{tag}")
            sh(IP, "netns", "add", host.ns)
            made.append(host.ns)
            peer = f"{host.dev}s"
            sh(IP, "link", "add", host.dev, "type", "veth", "peer", "name", peer)
            sh(IP, "link", "set", host.dev, "netns", host.ns)
            sh(IP, "link", "set", peer, "netns", switch)
            sh(IP, "-n", switch, "link", "set", peer, "master", br)
            sh(IP, "-n", switch, "link", "set", peer, "up")
            sh(IP, "-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", host.dev)
            sh(IP, "-n", host.ns, "link", "set", host.dev, "up")
            sh(IP, "-n", host.ns, "link", "set", "lo", "up")
            hosts.append(host)
        yield hosts
    finally:
        for ns in made:
            subprocess.run([IP, "netns", "del", ns], capture_output=True, timeout=30)
