"""Test hosts in network namespaces: each namespace is a node with its own address, joined to the
root namespace by a veth pair on a bridge. Root and iproute2 are needed; `available()` says why not.
Only addresses of these hosts are ever used (a 10.77.x.0/24 that exists inside this machine alone).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network-namespace tests need root (ip netns add)"
    if shutil.which("ip") is None:
        return "network-namespace tests need iproute2 (apt-get install iproute2); .ci/run installs it"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str
    netns: str
    address: str
    veth_root: str  # the root-namespace end: setting it down cuts the host off


@dataclass
class Cluster:
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    subnet: int = field(default_factory=lambda: 100 + int(uuid.uuid4().hex[:2], 16) % 100)
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"phb{self.tag}"

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge: where the control plane listens."""
        return f"10.77.{self.subnet}.1"

    def up(self, names: list[str]) -> Cluster:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for index, name in enumerate(names):
            netns, root_end, host_end = f"phx{self.tag}{name}", f"pr{self.tag}{index}", f"ph{self.tag}{index}"
            address = f"10.77.{self.subnet}.{10 + index}"
            _ip("netns", "add", netns)
            _ip("link", "add", root_end, "type", "veth", "peer", "name", host_end)
            _ip("link", "set", root_end, "master", self.bridge)
            _ip("link", "set", root_end, "up")
            _ip("link", "set", host_end, "netns", netns)
            _ip("-n", netns, "addr", "add", f"{address}/24", "dev", host_end)
            _ip("-n", netns, "link", "set", host_end, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            self.hosts[name] = Host(name, netns, address, root_end)
        return self

    def cut(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].veth_root, "down")

    def restore(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].veth_root, "up")

    def down(self) -> None:
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", host.veth_root], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
