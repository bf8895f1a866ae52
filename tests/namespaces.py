"""Several hosts on one machine for the tests: network namespaces joined by a bridge, one IPv4 address each.

Each namespace has its own interfaces and loopback, so a service bound to one host's address or to 127.0.0.1 there is
reachable only as it would be across real hosts; the bridge's own address lets the test process (in the machine's
namespace) reach every host. Namespaces isolate the network only: files and process ids are shared. Needs root
(`ip netns add`); `Hosts.create` raises Unavailable with the reason where it is not permitted.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from dataclasses import dataclass, field

SUBNETS = ipaddress.IPv4Network("10.231.0.0/16")  # one /24 of it per Hosts, picked among those not routed here
BRIDGE_HOST = 254  # the bridge's (the test process's) address in the /24


class Unavailable(Exception):
    """Network namespaces cannot be made here (not root, or no `ip`)."""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Hosts:
    """`count` namespaces h3-<pid>-<i> with addresses <subnet>.1, .2, ... on bridge h3b-<pid>."""

    count: int
    tag: str = field(default_factory=lambda: str(os.getpid()))
    subnet: ipaddress.IPv4Network | None = None
    made: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"h3b-{self.tag}"[:15]  # an interface name has at most 15 characters

    def name(self, index: int) -> str:
        return f"h3-{self.tag}-{index}"

    def address(self, index: int) -> str:
        assert self.subnet is not None
        return str(self.subnet[index + 1])

    def run(self, index: int, argv: list[str]) -> list[str]:
        """`argv` run inside host `index`."""
        return ["ip", "netns", "exec", self.name(index), *argv]

    def create(self) -> Hosts:
        try:
            self.subnet = free_subnet()
            ip("link", "add", self.bridge, "type", "bridge")
        except (OSError, subprocess.CalledProcessError) as exc:
            raise Unavailable(f"cannot make network namespaces here: {getattr(exc, 'stderr', '') or exc}") from exc
        try:
            ip("addr", "add", f"{self.subnet[BRIDGE_HOST]}/{self.subnet.prefixlen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for index in range(self.count):
                self.add_host(index)
        except BaseException:
            self.remove()
            raise
        return self

    def add_host(self, index: int) -> None:
        name, veth = self.name(index), f"h3v-{self.tag}-{index}"[:15]
        ip("netns", "add", name)
        self.made.append(name)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
        ip("link", "set", veth, "master", self.bridge, "up")
        ip("-n", name, "addr", "add", f"{self.address(index)}/{self.subnet.prefixlen}", "dev", "eth0")  # type: ignore[union-attr]
        ip("-n", name, "link", "set", "eth0", "up")
        ip("-n", name, "link", "set", "lo", "up")

    def remove(self) -> None:
        """Every namespace (their veth ends go with them) and the bridge; what is already gone is skipped."""
        for name in self.made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.made.clear()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def __enter__(self) -> Hosts:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.remove()


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 of SUBNETS that no route here uses (another test's hosts, or the machine's own networks)."""
    routes = subprocess.run(["ip", "-4", "route"], check=True, capture_output=True, text=True).stdout
    used = {
        ipaddress.ip_network(line.split()[0], strict=False) for line in routes.splitlines() if "/" in line.split()[0]
    }
    start = os.getpid() % 256  # tests of other sessions start elsewhere in the range
    subnets = list(SUBNETS.subnets(new_prefix=24))
    for subnet in subnets[start:] + subnets[:start]:
        if not any(subnet.overlaps(route) for route in used):
            return subnet
    raise Unavailable(f"no free /24 in {SUBNETS}")
