"""Endpoints as users and peers write them: checked early, resolved, advertised.

Plain address logic (no ZeroMQ socket): :func:`validate_endpoint` and
:func:`check_resolvable` refuse a typo or an unknown host by the flag's name before
anything starts; :func:`advertised_endpoint` is the address peers should connect to
for a socket bound on a wildcard; :func:`this_host_addresses` tells whether an
advertised address is this host.
"""

from __future__ import annotations

import ipaddress
import socket as pysocket
from urllib.parse import urlsplit

from zpipe._errors import ConfigError


def advertised_endpoint(bound: str, *, advertise_host: str | None, toward: str | None) -> str:
    """The address peers should connect to for a socket bound at ``bound``.

    A socket bound on 0.0.0.0 is reachable at the address this host uses to
    reach ``toward`` (the coordinator); found with a UDP "connect", which sends
    nothing.
    """
    parts = urlsplit(bound)
    if parts.scheme != "tcp":
        return bound
    host, port = parts.hostname or "", parts.port
    if advertise_host:
        host = advertise_host
    elif host in ("0.0.0.0", "::", ""):
        host = _local_address_toward(toward)
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def _local_address_toward(endpoint: str | None) -> str:
    if not endpoint:
        return "127.0.0.1"
    parts = urlsplit(endpoint)
    target = parts.hostname
    if not target or parts.scheme != "tcp":
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(target).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass  # a host name: resolve it through the routing table below
    probe = pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM)
    try:
        probe.connect((target, parts.port or 9))
        return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def check_resolvable(endpoint: str, *, flag: str) -> None:
    """Refuse a tcp endpoint whose host name does not resolve, at once and by name:
    ZeroMQ would retry it silently for ever, which looks like a peer that is not running."""
    parts = urlsplit(endpoint)
    host = parts.hostname
    if parts.scheme != "tcp" or not host or host == "*":
        return
    try:
        ipaddress.ip_address(host)
        return  # an address: nothing to resolve
    except ValueError:
        pass
    try:
        pysocket.getaddrinfo(host, None, proto=pysocket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        detail = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(
            f"{flag}: the host {host!r} of {endpoint} cannot be resolved ({detail}); "
            "check its spelling and this machine's name service, or give an IP address"
        ) from None


def this_host_addresses(bound: str | None = None) -> frozenset[str]:
    """This host's names and addresses, as far as its resolver and ``bound`` tell (best
    effort, no packets sent): whether a peer's advertised address is this host."""
    found: set[str] = set()
    host = (urlsplit(bound).hostname or "") if bound else ""
    if host:
        found.add(host)
    for name in {pysocket.gethostname(), pysocket.getfqdn()}:
        if not name:
            continue
        found.add(name)
        try:
            infos = pysocket.getaddrinfo(name, None, proto=pysocket.IPPROTO_TCP)
        except OSError:
            continue
        found.update(str(info[4][0]) for info in infos)
    return frozenset(found)


def validate_endpoint(endpoint: str, *, flag: str) -> str:
    """Check a user-given endpoint early, so a typo fails with the flag's name."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("tcp", "ipc", "inproc"):
        raise ConfigError(f"{flag}: {endpoint!r} must look like tcp://HOST:PORT")
    if parts.scheme == "tcp":
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise ConfigError(f"{flag}: {endpoint!r} must look like tcp://HOST:PORT")
    return endpoint
