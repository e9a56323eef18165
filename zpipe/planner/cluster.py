"""The devices a planner may use: memory, relative speed, and the links between them.

A cluster spec is plain data, like a plan and a profile. The planners read it;
nothing here runs anything.

File format (JSON)::

    {"format": "zpipe-cluster/1",
     "devices": [
       {"name": "rcc", "count": 8, "memory_mb": 8192, "speed": 1.0,
        "bandwidth_mbps": 1000, "latency_ms": 0.5},
       {"name": "minnow", "count": 8, "memory_mb": 2048, "speed": 0.5,
        "bandwidth_mbps": 1000, "profile": "minnow-profile.json"}
     ],
     "links": [{"a": "rcc0", "b": "minnow3", "bandwidth_mbps": 40, "latency_ms": 2.0}],
     "client": {"bandwidth_mbps": 1000, "latency_ms": 0.5}}

``devices`` (required, at least one entry):

- ``name``: the device's name; with ``count`` the entry stands for ``count``
  devices named ``NAME0`` .. ``NAME{count-1}``, without it for one device
  named ``NAME``. ``client`` is reserved for the data source/sink.
- ``memory_mb``: memory the device gives the model, in MiB (2**20 bytes), at
  most 2**33 (2**53 bytes); omitted or ``null`` means unlimited.
- ``speed``: compute speed relative to the device the model profile was
  measured on: 1.0 is as fast, 0.25 four times slower (PipeEdge's "CPU 25%").
  Default 1.0; within 1e-6 .. 1e6.
- ``bandwidth_mbps``: the device's access link in Mbit/s (10**6 bit/s),
  within 1e-6 .. 1e9; omitted or ``null`` means unlimited.
- ``latency_ms``: the device's access-link latency, 0 .. 1e6. Default 0.
- ``profile``: a profile measured on this device (a ``zpipe-profile/1`` file
  path, relative to the cluster file, or the profile object inline); its
  unit times are used instead of scaling the model profile by ``speed``.

``links`` (optional) overrides the bandwidth and/or latency between two
devices (or a device and ``client``). An entry applies in both directions
unless it says ``"directed": true``, in which case it applies from ``a`` to
``b`` only. A field it leaves out falls back to the default rule.

``client`` (optional) is the access link of whoever feeds inputs to the first
stage and receives results from the last: ``bandwidth_mbps`` (default
unlimited) and ``latency_ms`` (default 0).

Default rule for a pair without an entry (PipeEdge's): the bandwidth is the
smaller of the two access links and the latency the sum of the two.

Limits, so that no file can exhaust the planner's memory or stack: a cluster
holds at most :data:`MAX_CLUSTER_DEVICES` devices (``count`` included), a
cluster or profile file is at most :data:`MAX_FILE_BYTES` long and nests
objects and lists at most :data:`MAX_JSON_DEPTH` deep. Anything malformed is a
:class:`ConfigError` that names the file and the entry.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zpipe._errors import ConfigError
from zpipe.planner.profile import ModelProfile

CLUSTER_FORMAT = "zpipe-cluster/1"
CLIENT = "client"
MIB = 1 << 20
# Far above any edge cluster a planner can search (PipeEdge's largest has 32
# devices), far below what would exhaust memory while expanding ``count``.
MAX_CLUSTER_DEVICES = 4096
# Cluster and profile files are small; a profile of a 1,000-unit model is ~1 MB.
MAX_FILE_BYTES = 64 * MIB
# The formats nest 4 deep (a profile inline in a device entry: 6); json's
# recursive decoder would hit Python's recursion limit near 1,000.
MAX_JSON_DEPTH = 32

_DEVICE_KEYS = frozenset(
    {"name", "count", "memory_mb", "speed", "bandwidth_mbps", "latency_ms", "profile"}
)
_LINK_KEYS = frozenset({"a", "b", "bandwidth_mbps", "latency_ms", "directed"})
_CLIENT_KEYS = frozenset({"bandwidth_mbps", "latency_ms"})
_TOP_KEYS = frozenset({"format", "devices", "links", "client"})


# Sane ranges, so that no time a planner derives from them overflows to inf (a speed
# of 1e-320 made every stage "take forever" and the plan read as out of memory) and
# no memory size leaves int64: a relative speed within 10**-6..10**6, a bandwidth
# within 10**-6..10**9 Mbit/s (1 bit/s to 1 Pbit/s), a latency up to 10**6 ms, a
# device's memory up to 2**53 bytes (8 PiB).
MIN_SPEED, MAX_SPEED = 1e-6, 1e6
MIN_BANDWIDTH_MBPS, MAX_BANDWIDTH_MBPS = 1e-6, 1e9
MAX_LATENCY_MS = 1e6
MAX_MEMORY_BYTES = 2**53


def _check_range(what: str, value: float | None, low: float, high: float) -> None:
    if value is not None and not (math.isfinite(value) and low <= value <= high):
        raise ConfigError(
            f"{what} must be a positive number between {low:g} and {high:g}, got {value!r}"
        )


def _check_positive(what: str, value: float | None) -> None:
    """A bandwidth: positive, within the sane range."""
    _check_range(what, value, MIN_BANDWIDTH_MBPS, MAX_BANDWIDTH_MBPS)


def _check_latency(what: str, value: float) -> None:
    if not (math.isfinite(value) and 0 <= value <= MAX_LATENCY_MS):
        raise ConfigError(
            f"{what} must be a number >= 0 and at most {MAX_LATENCY_MS:g}, got {value!r}"
        )


@dataclass(frozen=True)
class ClusterDevice:
    """One device a planner may use."""

    name: str
    memory_bytes: int | None = None  # None: unlimited
    speed: float = 1.0
    bandwidth_mbps: float | None = None  # None: unlimited
    latency_ms: float = 0.0
    profile: ModelProfile | None = None

    def __post_init__(self) -> None:
        where = f"device {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a device name must be a non-empty string, got {self.name!r}")
        if self.name == CLIENT:
            raise ConfigError(f"{CLIENT!r} is reserved for the data source/sink; rename the device")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ConfigError(f"{where}: memory must be positive, got {self.memory_bytes} bytes")
        if self.memory_bytes is not None and self.memory_bytes > MAX_MEMORY_BYTES:
            raise ConfigError(
                f"{where}: memory must be at most 2**53 bytes, got {self.memory_bytes} bytes"
            )
        _check_range(f"{where}: speed", self.speed, MIN_SPEED, MAX_SPEED)
        _check_positive(f"{where}: bandwidth_mbps", self.bandwidth_mbps)
        _check_latency(f"{where}: latency_ms", self.latency_ms)


@dataclass(frozen=True)
class ClusterLink:
    """Bandwidth and latency of one link; a ``None`` field defers to the default rule."""

    bandwidth_mbps: float | None = None
    latency_ms: float | None = None

    def __post_init__(self) -> None:
        _check_positive("link bandwidth_mbps", self.bandwidth_mbps)
        if self.latency_ms is not None:
            _check_latency("link latency_ms", self.latency_ms)


@dataclass(frozen=True)
class ClusterSpec:
    """Devices in a given order, per-pair link overrides, and the client's access link.

    ``links`` maps an ordered pair ``(sender, receiver)`` to its override; the
    loader enters an undirected file entry under both orders.
    """

    devices: tuple[ClusterDevice, ...]
    links: Mapping[tuple[str, str], ClusterLink] = field(default_factory=dict)
    client: ClusterLink = field(default_factory=ClusterLink)
    # name -> device, so that link lookups do not scan the device list
    _by_name: Mapping[str, ClusterDevice] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        if not self.devices:
            raise ConfigError("a cluster needs at least one device")
        seen: dict[str, ClusterDevice] = {}
        for d in self.devices:
            if d.name in seen:
                raise ConfigError(
                    f"device name {d.name!r} appears more than once; names must be unique"
                )
            seen[d.name] = d
        object.__setattr__(self, "_by_name", seen)
        for a, b in self.links:
            for end in (a, b):
                if end != CLIENT and end not in seen:
                    raise ConfigError(
                        f"link {a!r} -> {b!r} names unknown device {end!r}; known: "
                        f"{_few(seen)} and {CLIENT!r}"
                    )
            if a == b:
                raise ConfigError(f"link {a!r} -> {b!r} connects a device to itself; remove it")

    # -- lookups ---------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.devices]

    def device(self, name: str) -> ClusterDevice:
        try:
            return self._by_name[name]
        except KeyError:
            raise ConfigError(
                f"the cluster has no device {name!r}; known: {_few(self.names)}"
            ) from None

    def _access(self, name: str) -> tuple[float | None, float]:
        """(bandwidth Mbit/s or None, latency ms) of ``name``'s access link."""
        if name == CLIENT:
            return self.client.bandwidth_mbps, self.client.latency_ms or 0.0
        d = self.device(name)
        return d.bandwidth_mbps, d.latency_ms

    def bandwidth_bps(self, u: str, v: str) -> float:
        """Bits per second from ``u`` to ``v`` (``math.inf`` when nothing limits it)."""
        link = self.links.get((u, v))
        if link is not None and link.bandwidth_mbps is not None:
            return link.bandwidth_mbps * 1e6
        bu, bv = self._access(u)[0], self._access(v)[0]
        limits = [b for b in (bu, bv) if b is not None]
        return min(limits) * 1e6 if limits else math.inf

    def latency_s(self, u: str, v: str) -> float:
        """One-way latency from ``u`` to ``v`` in seconds."""
        link = self.links.get((u, v))
        if link is not None and link.latency_ms is not None:
            return link.latency_ms / 1e3
        return (self._access(u)[1] + self._access(v)[1]) / 1e3

    def comm_time_s(self, u: str, v: str, nbytes: int) -> float:
        """How long sending ``nbytes`` from ``u`` to ``v`` occupies the link: serialisation.

        Latency is left out on purpose: with several micro-batches in flight (as
        zpipe always keeps) it delays each one but does not lower throughput, so
        it belongs to a plan's latency (:meth:`latency_s`), not to its period.
        """
        bw = self.bandwidth_bps(u, v)
        return nbytes * 8.0 / bw if bw != math.inf else 0.0

    # -- (de)serialisation -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The file form, one entry per device (``count`` is not re-derived); profiles inline."""
        devices = []
        for d in self.devices:
            entry: dict[str, Any] = {"name": d.name}
            if d.memory_bytes is not None:
                entry["memory_mb"] = (
                    d.memory_bytes // MIB if d.memory_bytes % MIB == 0 else d.memory_bytes / MIB
                )
            entry["speed"] = d.speed
            if d.bandwidth_mbps is not None:
                entry["bandwidth_mbps"] = d.bandwidth_mbps
            entry["latency_ms"] = d.latency_ms
            if d.profile is not None:
                entry["profile"] = d.profile.to_dict()
            devices.append(entry)
        links = []
        done: set[tuple[str, str]] = set()
        for (a, b), link in self.links.items():
            if (a, b) in done:
                continue
            entry = {"a": a, "b": b}
            if link.bandwidth_mbps is not None:
                entry["bandwidth_mbps"] = link.bandwidth_mbps
            if link.latency_ms is not None:
                entry["latency_ms"] = link.latency_ms
            if self.links.get((b, a)) == link:
                done.add((b, a))
            else:
                entry["directed"] = True
            done.add((a, b))
            links.append(entry)
        client: dict[str, Any] = {}
        if self.client.bandwidth_mbps is not None:
            client["bandwidth_mbps"] = self.client.bandwidth_mbps
        if self.client.latency_ms is not None:
            client["latency_ms"] = self.client.latency_ms
        return {"format": CLUSTER_FORMAT, "devices": devices, "links": links, "client": client}

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], base_dir: Path | None = None, *, source: str = "cluster"
    ) -> ClusterSpec:
        """Parse the file form; ``profile`` paths are relative to ``base_dir`` (default: cwd)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: must hold a JSON object")
        if data.get("format") != CLUSTER_FORMAT:
            raise ConfigError(
                f"{source}: format must be {CLUSTER_FORMAT!r}, got {data.get('format')!r}"
            )
        _no_unknown_keys(f"{source}", data, _TOP_KEYS)
        base = base_dir if base_dir is not None else Path(".")
        entries = data.get("devices")
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"{source}: 'devices' must be a non-empty list")
        devices: list[ClusterDevice] = []
        origin: dict[str, str] = {}
        for k, entry in enumerate(entries):
            made = _parse_device(f"{source}: devices[{k}]", entry, base)
            if len(devices) + len(made) > MAX_CLUSTER_DEVICES:
                raise ConfigError(
                    f"{source}: devices[{k}] takes the cluster past {MAX_CLUSTER_DEVICES} "
                    "devices, the most a cluster file may hold"
                )
            for device in made:
                where = f"devices[{k}]"
                if device.name in origin:
                    raise ConfigError(
                        f"{source}: {where} makes a device named {device.name!r}, which "
                        f"{origin[device.name]} already made; names must be unique"
                    )
                origin[device.name] = where
                devices.append(device)
        links: dict[tuple[str, str], ClusterLink] = {}
        raw_links = data.get("links", [])
        if not isinstance(raw_links, list):
            raise ConfigError(f"{source}: 'links' must be a list")
        for k, entry in enumerate(raw_links):
            where = f"{source}: links[{k}]"
            for pair, link in _parse_link(where, entry, origin):
                if pair in links:
                    raise ConfigError(
                        f"{where} sets link {pair[0]!r} -> {pair[1]!r} a second time; "
                        "give each pair (and direction) once"
                    )
                links[pair] = link
        raw_client = data.get("client", {})
        if not isinstance(raw_client, Mapping):
            raise ConfigError(f"{source}: 'client' must be an object")
        _no_unknown_keys(f"{source}: client", raw_client, _CLIENT_KEYS)
        try:
            client = ClusterLink(
                bandwidth_mbps=_opt_float(raw_client, "bandwidth_mbps"),
                latency_ms=_opt_float(raw_client, "latency_ms"),
            )
        except (ConfigError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: client: {exc}") from None
        try:
            return cls(devices=tuple(devices), links=links, client=client)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None


def load_cluster(path: Path | str) -> ClusterSpec:
    """Read a ``zpipe-cluster/1`` file; ``profile`` paths are relative to its folder."""
    p = Path(path)
    data = read_json_file(p, what="cluster file")
    return ClusterSpec.from_dict(data, p.parent, source=str(p))


def read_json_file(path: Path, *, what: str) -> Any:
    """The JSON document in ``path``, within :data:`MAX_FILE_BYTES` and :data:`MAX_JSON_DEPTH`.

    Every failure (unreadable, too large, too deep, not JSON) is a ConfigError
    that names ``what`` and the path.
    """
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"{what} {path} is larger than {MAX_FILE_BYTES // MIB} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 text: {exc}") from None
    too_deep = f"the format nests lists and objects at most {MAX_JSON_DEPTH} deep"
    try:
        # json's decoder recurses; past Python's limit it raises RecursionError cleanly
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} {path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{what} {path} nests too deep for JSON here; {too_deep}") from None
    depth = _json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise ConfigError(f"{what} {path} nests {depth} deep; {too_deep}")
    return data


def _json_depth(data: Any) -> int:
    """How deep lists and objects nest in ``data`` (iterative: no recursion limit)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Iterable[Any] = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def read_profile_file(path: Path) -> ModelProfile:
    """A ``zpipe-profile/1`` file, with the same limits and errors as a cluster file."""
    return profile_from_data(read_json_file(path, what="profile"), source=f"profile {path}")


def profile_from_data(data: Any, *, source: str) -> ModelProfile:
    """:meth:`ModelProfile.from_dict` for data read from a file: anything malformed
    (a unit that is not an object, a number too large for an integer) is a ConfigError."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: must hold a JSON object")
    units = data.get("units")
    if units is not None and not (
        isinstance(units, list) and all(isinstance(u, Mapping) for u in units)
    ):
        raise ConfigError(f"{source}: 'units' must be a list of objects")
    try:
        return ModelProfile.from_dict(data, source=source)
    except (AttributeError, OverflowError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{source}: malformed profile ({type(exc).__name__}: {exc})") from None


def _few(names: Iterable[str], shown: int = 12) -> str:
    """Names for a message: sorted, and cut short, so 4,096 devices make one readable line."""
    ordered = sorted(names)
    if len(ordered) <= shown:
        return str(ordered)
    return f"{ordered[:shown]} and {len(ordered) - shown} more"


def _no_unknown_keys(where: str, entry: Mapping[str, Any], known: Iterable[str]) -> None:
    unknown = sorted(set(entry) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")


def _opt_float(entry: Mapping[str, Any], key: str) -> float | None:
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    return float(value)


def _parse_device(where: str, entry: Any, base: Path) -> list[ClusterDevice]:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: must be an object, got {entry!r}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: 'name' must be a non-empty string, got {name!r}")
    where = f"{where} ({name})"
    _no_unknown_keys(where, entry, _DEVICE_KEYS)
    count = entry.get("count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ConfigError(f"{where}: count must be an integer >= 1, got {count!r}")
    if count is not None and count > MAX_CLUSTER_DEVICES:
        raise ConfigError(
            f"{where}: count {count} is above {MAX_CLUSTER_DEVICES}, the most devices a "
            "cluster file may hold"
        )
    try:
        memory_mb = _opt_float(entry, "memory_mb")
        speed = _opt_float(entry, "speed")
        bandwidth = _opt_float(entry, "bandwidth_mbps")
        latency = _opt_float(entry, "latency_ms")
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    # the product is checked too: 1e308 MiB is finite, its bytes are not; and past 2**63
    # bytes no int64 holds them
    if memory_mb is not None and not (
        math.isfinite(memory_mb * MIB) and 0 < memory_mb * MIB <= MAX_MEMORY_BYTES
    ):
        raise ConfigError(
            f"{where}: memory_mb must be a positive number of at most {MAX_MEMORY_BYTES // MIB} "
            f"(2**53 bytes), got {memory_mb!r}"
        )
    profile = _parse_profile(where, entry.get("profile"), base)
    names = [name] if count is None else [f"{name}{i}" for i in range(count)]
    try:
        return [
            ClusterDevice(
                name=n,
                memory_bytes=None if memory_mb is None else round(memory_mb * MIB),
                speed=1.0 if speed is None else speed,
                bandwidth_mbps=bandwidth,
                latency_ms=0.0 if latency is None else latency,
                profile=profile,
            )
            for n in names
        ]
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _parse_profile(where: str, value: Any, base: Path) -> ModelProfile | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return read_profile_file(base / value)
        except ConfigError as exc:
            raise ConfigError(f"{where}: profile: {exc}") from None
    if isinstance(value, Mapping):
        return profile_from_data(value, source=f"{where}: profile")
    raise ConfigError(f"{where}: profile must be a file path or a profile object, got {value!r}")


def _parse_link(
    where: str, entry: Any, known: Mapping[str, str]
) -> Sequence[tuple[tuple[str, str], ClusterLink]]:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: must be an object, got {entry!r}")
    _no_unknown_keys(where, entry, _LINK_KEYS)
    a, b = entry.get("a"), entry.get("b")
    for key, end in (("a", a), ("b", b)):
        if not isinstance(end, str):
            raise ConfigError(f"{where}: {key!r} must be a device name, got {end!r}")
        if end != CLIENT and end not in known:
            raise ConfigError(
                f"{where}: {key!r} names unknown device {end!r}; known: {_few(known)} and "
                f"{CLIENT!r}"
            )
    assert isinstance(a, str) and isinstance(b, str)
    where = f"{where} ({a} - {b})"
    if a == b:
        raise ConfigError(f"{where}: a link must join two different devices")
    directed = entry.get("directed", False)
    if not isinstance(directed, bool):
        raise ConfigError(f"{where}: directed must be true or false, got {directed!r}")
    try:
        link = ClusterLink(
            bandwidth_mbps=_opt_float(entry, "bandwidth_mbps"),
            latency_ms=_opt_float(entry, "latency_ms"),
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if link.bandwidth_mbps is None and link.latency_ms is None:
        raise ConfigError(f"{where}: give bandwidth_mbps, latency_ms or both")
    pairs = [((a, b), link)]
    if not directed:
        pairs.append(((b, a), link))
    return pairs
