"""The pure half of a network lab: names, addresses, caps and every ``ip``/``tc`` command.

Nothing here runs a command or touches the system; :mod:`zpipe.cluster.netlab`
carries the commands out. See there for the lab's picture.
"""

from __future__ import annotations

import ipaddress
import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

PREFIX = "zpl"
# five hex digits: short enough that "zpl" + id + "br" fits an interface name (15 bytes)
LAB_ID = re.compile(r"^[0-9a-f]{5}$")
NODE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
# a name in the root namespace (a namespace, the bridge, an outer veth end) of some lab
_LAB_OBJECT = re.compile(rf"^{PREFIX}([0-9a-f]{{5}})(?:-|br$|v\d+$)")
INNER_LINK = "eth0"
MAX_NODES = 200  # addresses .2 to .201 of the lab's /24

# The token bucket's shape (see TbfCap.at).
BURST_S = 0.004
MIN_BURST_BYTES = 32 * 1024
QUEUE_LATENCY_MS = 100.0


class LayoutError(ValueError):
    """No lab can be laid out so (a bad name, cap or subnet, or no free subnet)."""


def _check_rate(rate_mbit: float) -> None:
    if not (math.isfinite(rate_mbit) and 0.001 <= rate_mbit <= 100_000):
        raise LayoutError(f"rate_mbit must lie in [0.001, 100000], got {rate_mbit}")


@dataclass(frozen=True)
class TbfCap:
    """A ``tc tbf`` cap on one direction of a link.

    ``rate_mbit``: the cap. ``burst_bytes``: the bucket, bytes that may leave at line
    speed after an idle spell. ``latency_ms``: the longest a packet may wait in the
    qdisc's queue; one that would wait longer is dropped (TCP then backs off, as on
    a real uplink whose buffer is full).
    """

    rate_mbit: float
    burst_bytes: int
    latency_ms: float

    def __post_init__(self) -> None:
        _check_rate(self.rate_mbit)
        if not 1500 <= self.burst_bytes <= 1 << 30:
            raise LayoutError(f"burst_bytes must lie in [1500, 2**30], got {self.burst_bytes}")
        if not (math.isfinite(self.latency_ms) and 1 <= self.latency_ms <= 10_000):
            raise LayoutError(f"latency_ms must lie in [1, 10000], got {self.latency_ms}")

    @classmethod
    def at(cls, rate_mbit: float, *, latency_ms: float = QUEUE_LATENCY_MS) -> TbfCap:
        """A cap of ``rate_mbit`` shaped as a modest uplink.

        The bucket holds 4 ms of the rate, at least 32 KiB: enough that a 250 Hz
        kernel timer keeps the rate and that TCP's segments pass whole, small enough
        that the cap holds over a few milliseconds (measured: TCP gets 95-96 % of
        it, the rest is headers). The queue holds 100 ms of the rate (a home
        router's buffer): a heartbeat that leaves the same host as a bulk transfer
        waits at most that long in the kernel, so any longer delay is the
        application's own queueing.
        """
        _check_rate(rate_mbit)
        burst = max(MIN_BURST_BYTES, int(rate_mbit * 1e6 / 8 * BURST_S))
        return cls(rate_mbit=rate_mbit, burst_bytes=burst, latency_ms=latency_ms)

    def tc_args(self) -> list[str]:
        """``tbf ...`` as ``tc qdisc replace dev X root`` takes it."""
        return [
            "tbf",
            "rate",
            f"{round(self.rate_mbit * 1000)}kbit",
            "burst",
            str(self.burst_bytes),
            "latency",
            f"{self.latency_ms:g}ms",
        ]


@dataclass(frozen=True)
class Node:
    """One namespace of a lab: its name, and the caps of its link to the bridge."""

    name: str
    uplink: TbfCap | None = None  # what leaves the node
    downlink: TbfCap | None = None  # what reaches it

    def __post_init__(self) -> None:
        if not NODE_NAME.match(self.name):
            raise LayoutError(f"{self.name!r}: a node name is 1-32 letters, digits, '.', '_', '-'")


@dataclass(frozen=True)
class LabLayout:
    """Every name, address and command of one lab (pure: nothing here runs)."""

    lab_id: str
    subnet: ipaddress.IPv4Network
    nodes: tuple[Node, ...]
    _index: Mapping[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not LAB_ID.match(self.lab_id):
            raise LayoutError(f"a lab id is five hex digits, got {self.lab_id!r}")
        if self.subnet.prefixlen != 24:
            raise LayoutError(f"a lab's subnet is a /24, got {self.subnet}")
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise LayoutError(f"node names must be unique, got {names}")
        if not 1 <= len(names) <= MAX_NODES:
            raise LayoutError(f"a lab has 1 to {MAX_NODES} nodes, got {len(names)}")
        object.__setattr__(self, "_index", {name: i for i, name in enumerate(names)})

    def node(self, name: str) -> Node:
        return self.nodes[self._position(name)]

    def _position(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"no node {name!r} in this lab (nodes: {list(self._index)})") from None

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.lab_id}br"

    def namespace(self, name: str) -> str:
        self._position(name)
        return f"{PREFIX}{self.lab_id}-{name}"

    def outer_link(self, name: str) -> str:
        """The veth end in the root namespace, on the bridge: down cuts the node off."""
        return f"{PREFIX}{self.lab_id}v{self._position(name)}"

    @property
    def host_address(self) -> str:
        """The root namespace's address on the bridge (where the client runs)."""
        return str(self.subnet[1])

    def address(self, name: str) -> str:
        return str(self.subnet[2 + self._position(name)])

    def setup_commands(self) -> list[list[str]]:
        """Bridge first, then each node: namespace, veth pair, addresses, caps, links up."""
        commands = [
            ["ip", "link", "add", self.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge],
            ["ip", "link", "set", self.bridge, "up"],
        ]
        for node in self.nodes:
            ns, outer = self.namespace(node.name), self.outer_link(node.name)
            peer = ["peer", "name", INNER_LINK, "netns", ns]  # made inside the namespace
            commands += [
                ["ip", "netns", "add", ns],
                ["ip", "link", "add", outer, "type", "veth", *peer],
                ["ip", "link", "set", outer, "master", self.bridge],
                ["ip", "-n", ns, "addr", "add", f"{self.address(node.name)}/24", "dev", INNER_LINK],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "-n", ns, "link", "set", INNER_LINK, "up"],
            ]
            if node.uplink is not None:
                commands.append(
                    ["tc", "-n", ns, "qdisc", "replace", "dev", INNER_LINK, "root",
                     *node.uplink.tc_args()]
                )  # fmt: skip
            if node.downlink is not None:
                commands.append(
                    ["tc", "qdisc", "replace", "dev", outer, "root", *node.downlink.tc_args()]
                )
            commands.append(["ip", "link", "set", outer, "up"])
        return commands

    def teardown_commands(self) -> list[list[str]]:
        """Each veth pair (deleted at once; a deleted namespace's links go only when the
        kernel gets round to it), each namespace, the bridge last."""
        commands = []
        for node in self.nodes:
            commands += [
                ["ip", "link", "delete", self.outer_link(node.name)],
                ["ip", "netns", "delete", self.namespace(node.name)],
            ]
        return [*commands, ["ip", "link", "delete", self.bridge]]

    def link_command(self, name: str, *, up: bool) -> list[str]:
        """Set the node's outer veth end down (its inner end loses carrier: a pulled
        cable, nothing the node's own configuration shows) or up again."""
        return ["ip", "link", "set", self.outer_link(name), "up" if up else "down"]

    def exec_command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the node's namespace (``ip netns exec`` execs it: the
        process id is the command's own)."""
        return ["ip", "netns", "exec", self.namespace(name), *argv]


def lab_id_of(name: str) -> str | None:
    """The lab id in a namespace or link name of some lab, None for any other name."""
    match = _LAB_OBJECT.match(name)
    return match.group(1) if match else None


def stale_objects(
    namespaces: Iterable[str], links: Iterable[str], live_ids: Iterable[str]
) -> tuple[list[str], list[str]]:
    """The namespaces and root-namespace links of labs whose owner is not alive.

    List the objects before reading the registry: a lab writes its registry entry
    before it makes anything, so an object listed first whose entry is then missing
    or dead belongs to no running lab.
    """
    live = set(live_ids)

    def stale(name: str) -> bool:
        lab = lab_id_of(name)
        return lab is not None and lab not in live

    return [n for n in namespaces if stale(n)], [n for n in links if stale(n)]


def choose_subnet(
    rng: random.Random, taken: Iterable[ipaddress.IPv4Network]
) -> ipaddress.IPv4Network:
    """A random 10.x.y.0/24 that overlaps no network in ``taken``."""
    used = list(taken)
    for _ in range(1000):
        candidate = ipaddress.IPv4Network(f"10.{rng.randrange(256)}.{rng.randrange(256)}.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise LayoutError("no free 10.x.y.0/24 for a lab: every one tried is in use")
