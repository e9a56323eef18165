"""Without keys: a listener that admits only the IP addresses a plan names.

A cluster started without ``--keys`` cannot tell devices apart by key, but it can
still refuse a connection from a host that the running plan does not name. libzmq
asks the ZAP handler of a socket's context about every NULL-mechanism connection
too, as soon as the socket has a ZAP domain (and, with ``ZAP_ENFORCE_DOMAIN``,
refuses everyone while no handler runs: fail closed). The handler gets the peer's
IP address before a single message of it is read, so a refused peer costs one
handshake and no decoding, no queue and no memory.

- :class:`AddressAllowList`: the addresses admitted now (the hosts of the peers
  an assignment names, resolved to IP addresses); empty admits nobody, and
  :meth:`AddressAllowList.admit_any` admits everyone (a run kind that names no
  addresses).
- :class:`AddressAuthenticator`: the context's ZAP handler for one domain; it
  counts refusals by address and logs them through the flood limit
  (:mod:`zpipe.log_limits`).
- :func:`address_checked_server`: set a listener's ZAP domain; call before bind.

What this does not do: an address is not an identity. Every process on an
admitted host, and anyone able to spoof or take over an admitted address, is
admitted; only ``--keys`` tells devices apart (docs/security.md). A connection
admitted under one plan stays up under the next (ZAP decides only the handshake),
which keeps a re-planned upstream's traffic flowing; the data port's own checks
(sender and plan epoch) still drop what a stale peer sends.

libzmq 4.3.5 behaviour relied on: a refused NULL client sees
``EVENT_HANDSHAKE_FAILED_AUTH`` and does not reconnect that socket (as with CURVE),
so addresses are admitted before the peers are told to connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket as pysocket
from collections import Counter
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import structlog
import zmq
import zmq.asyncio

from zpipe._errors import SecurityError

log = structlog.get_logger("zpipe.security")

# the ZAP domain of a stage's data port without keys (CURVE sockets use zpipe's own)
DATA_ADDRESS_DOMAIN = "zpipe-data-addr"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
LOOPBACK = frozenset({"127.0.0.1", "::1"})


def endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://host:port`` endpoint, None for another transport."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname:
        return None
    return parts.hostname


def host_addresses(host: str) -> set[str]:
    """The IP addresses of ``host``: itself if it is one, else what it resolves to.

    A name is resolved here, once per assignment (the system resolver: /etc/hosts or
    DNS); a name that does not resolve admits nothing."""
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        infos = pysocket.getaddrinfo(host, None, proto=pysocket.IPPROTO_TCP)
    except OSError as exc:
        log.warning("peer_host_unresolved", host=host, error=str(exc))
        return set()
    return {str(info[4][0]) for info in infos}


def peer_addresses(peer_endpoints: Iterable[str | None], own_endpoint: str = "") -> set[str]:
    """The IP addresses to admit for peers at ``peer_endpoints`` (the data endpoints
    an assignment names for its senders; None or empty ones are skipped).

    A peer that advertises a loopback address runs on this host, and reaches this
    port at the address this port advertises (``own_endpoint``): that one too."""
    out: set[str] = set()
    for endpoint in peer_endpoints:
        host = endpoint_host(endpoint) if endpoint else None
        if host is not None:
            out |= host_addresses(host)
    if out & LOOPBACK and own_endpoint:
        own = endpoint_host(own_endpoint)
        if own is not None:
            out |= host_addresses(own)
    return out


class AddressAllowList:
    """The IP addresses a listener admits now; empty admits nobody.

    Changed on the event loop thread only (the handler runs there too)."""

    def __init__(self, addresses: Iterable[str] = ()) -> None:
        self._addresses: frozenset[str] = frozenset()
        self._any = False
        self.replace(addresses)

    def replace(self, addresses: Iterable[str]) -> None:
        """Admit exactly ``addresses`` (IP address strings) from now on."""
        self._addresses = frozenset(str(ipaddress.ip_address(a)) for a in addresses)
        self._any = False

    def admit(self, addresses: Iterable[str]) -> None:
        """Admit ``addresses`` too, besides those admitted now."""
        self._addresses |= frozenset(str(ipaddress.ip_address(a)) for a in addresses)

    def admit_any(self) -> None:
        """Admit every address (a run whose set-up names no addresses)."""
        self._addresses, self._any = frozenset(), True

    @property
    def admits_any(self) -> bool:
        return self._any

    def __contains__(self, address: object) -> bool:
        if self._any:
            return True
        if not isinstance(address, str):
            return False
        if address.startswith("::ffff:"):  # an IPv4 peer on a dual-stack listener
            address = address[len("::ffff:") :]
        return address in self._addresses

    def __len__(self) -> int:
        return len(self._addresses)

    def __repr__(self) -> str:
        return (
            "AddressAllowList(any)" if self._any else f"AddressAllowList({sorted(self._addresses)})"
        )


def zap_reply(request: list[bytes], allowed: AddressAllowList) -> tuple[list[bytes], str, bool]:
    """The ZAP reply to ``request`` (a ZAP 1.0 request's frames), the peer's address
    and whether it is admitted. Pure: the handler's whole decision."""
    if len(request) < 6 or request[0] != ZAP_VERSION:
        request_id = request[1] if len(request) > 1 else b""
        return [ZAP_VERSION, request_id, b"400", b"Malformed ZAP request", b"", b""], "", False
    request_id, address = request[1], request[3].decode("utf-8", "replace")
    mechanism = request[5]
    if mechanism != b"NULL":
        # this handler judges addresses only; a CURVE socket needs CurveAuthenticator
        return [ZAP_VERSION, request_id, b"400", b"Mechanism not handled", b"", b""], address, False
    if address in allowed:
        return [ZAP_VERSION, request_id, b"200", b"OK", b"anonymous", b""], address, True
    return [ZAP_VERSION, request_id, b"400", b"Address not in the plan", b"", b""], address, False


class AddressAuthenticator:
    """The ZAP handler of one zmq context, for listeners without keys.

    Admits a NULL connection to a socket of ``domain`` when its address is in
    ``allow_list``; refuses everything else (another domain, another mechanism).
    ``refused``: refusals by address, since start. Start it inside the running
    event loop, stop it before ``context.term()``."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        allow_list: AddressAllowList,
        *,
        domain: str = DATA_ADDRESS_DOMAIN,
        label: str = "data port",
    ) -> None:
        self._context = context
        self.allow_list = allow_list
        self.domain = domain
        self._label = label
        self.refused: Counter[str] = Counter()
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("AddressAuthenticator.start() called twice; call stop() first")
        loop = asyncio.get_running_loop()
        sock = self._context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            if exc.errno == zmq.EADDRINUSE:
                raise SecurityError(
                    "another ZAP handler already runs on this zmq context; one per context"
                ) from exc
            raise
        self._socket = sock
        self._task = loop.create_task(self._serve(sock), name="zpipe-zap-address")

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            request = await sock.recv_multipart()  # in-process: no network wait
            try:
                reply = self.decide(request)[0]
            except Exception:
                # keep serving: a dead handler would stall every later handshake
                log.exception("zap_request_failed")
                request_id = request[1] if len(request) > 1 else b""
                reply = [ZAP_VERSION, request_id, b"500", b"Internal error", b"", b""]
            with contextlib.suppress(zmq.ZMQError):
                await sock.send_multipart(reply)

    def decide(self, request: list[bytes]) -> tuple[list[bytes], str, bool]:
        """Judge one ZAP request; count and log a refusal."""
        domain = request[2].decode("utf-8", "replace") if len(request) > 2 else ""
        if domain != self.domain:
            request_id = request[1] if len(request) > 1 else b""
            reply = [ZAP_VERSION, request_id, b"400", b"Unknown domain", b"", b""]
            address = request[3].decode("utf-8", "replace") if len(request) > 3 else ""
            ok = False
        else:
            reply, address, ok = zap_reply(request, self.allow_list)
        if not ok:
            self.refused[address] += 1
            # peer=: the flood limit keeps one line per address and rate (log_limits)
            log.warning(
                "peer_refused",
                peer=address,
                port=self._label,
                refused=self.refused[address],
                reason=reply[3].decode(),
                hint="without --keys a stage admits only the hosts its assignment names",
            )
        return reply, address, ok

    def stop(self) -> None:
        """Stop serving and close the ZAP socket; safe to call twice."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None


def address_checked_server(socket: zmq.Socket[Any], domain: str = DATA_ADDRESS_DOMAIN) -> None:
    """Make ``socket`` (NULL mechanism) ask the context's ZAP handler about each peer's
    address; with no handler running it refuses everyone. Call before bind()."""
    if socket.getsockopt(zmq.LAST_ENDPOINT):
        raise SecurityError("address_checked_server() must be called before bind()")
    socket.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
