"""CurveZMQ security: only devices holding an allowed key can join or send data.

With ``--keys DIR`` every participant (the coordinator, each stage by name and the
``client`` that embeds the API) owns a CURVE key pair in DIR, in pyzmq's certificate
format::

    DIR/NAME.key          public key  (safe to copy anywhere)
    DIR/NAME.key_secret   public + secret key (mode 0600, stays on device NAME)

plus ``DIR/roles.txt``, each key's role (client, stage or coordinator; see
:mod:`zpipe.transport.roles`).

The coordinator's allow-list is every ``NAME.key`` in its DIR, so an administrator
removes a device by deleting its ``NAME.key`` (and restarting the coordinator). A
device needs only its own ``NAME.key_secret`` plus ``coordinator.key``; a stage learns
the public keys of the peers it must accept from the coordinator's assignment and
swaps them into its :class:`PeerAllowList` with :meth:`PeerAllowList.replace`.

How the pieces fit (one process)::

    allow = PeerAllowList(load_public_keys(keys_dir))      # or: from the assignment
    auth = CurveAuthenticator(ctx, allow)                  # ONE per zmq context
    auth.start()
    secure_server(router, load_keypair(keys_dir, "coordinator"))   # before bind
    router.bind(...)
    ...
    auth.stop()                                            # before ctx.term()

ZAP, and why there is one authenticator per context: libzmq asks the ZAP handler bound
at ``inproc://zeromq.zap.01`` of the socket's own context to approve each CURVE
handshake. One :class:`CurveAuthenticator` therefore serves every server socket of
its context; a second one on the same context cannot bind and raises
:class:`SecurityError`. Sockets that need different allow-lists need different
contexts (or one allow-list holding the union).

Behaviour of libzmq 4.3.5 / pyzmq 27 that this module works around or relies on:

* A CURVE server socket with an empty ZAP domain accepts *any* client that knows the
  server's public key when no authenticator runs on its context. :func:`secure_server`
  therefore sets ``ZAP_DOMAIN`` and ``ZAP_ENFORCE_DOMAIN``: without a running
  authenticator the socket refuses everyone instead (fail closed). Setting
  ``ZAP_ENFORCE_DOMAIN`` while leaving the domain empty would skip ZAP entirely.
* ZAP is consulted only during the handshake. :meth:`PeerAllowList.replace` decides
  every *new* connection; a connection that was accepted before a key was removed stays
  up. Receivers that must drop such data check :func:`sender_public_key` of the first
  frame against the allow-list.
* A refused client sees ``zmq.EVENT_HANDSHAKE_FAILED_AUTH`` (value 400, the ZAP status
  code) within milliseconds, then ``EVENT_DISCONNECTED``, and libzmq never reconnects
  that socket: its sends are queued and silently go nowhere. A key allowed later takes
  effect only when the client opens a new connection.
* pyzmq's ``AsyncioAuthenticator.stop()`` closes the ZAP socket before its poll task
  has unregistered the file descriptor; the next authenticator started in the same
  event loop may get the same descriptor number and never see a ZAP request (clients
  then hang in the handshake). :class:`CurveAuthenticator` runs its own receive task
  and clears the descriptor before closing, so start/stop cycles are safe.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import structlog
import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.base import Authenticator

from zpipe._errors import SecurityError
from zpipe.transport.keys import (
    CLIENT_KEY_NAME,
    COORDINATOR_KEY_NAME,
    PUBLIC_SUFFIX,
    SECRET_SUFFIX,
    Z85_KEY_LEN,
    KeyPair,
    check_z85_key,
    generate_keys,
    key_prefix,
    load_keypair,
    load_keypair_public,
    load_public_keys,
    validate_key_name,
)

__all__ = [
    "CLIENT_KEY_NAME",
    "COORDINATOR_KEY_NAME",
    "PUBLIC_SUFFIX",
    "SECRET_SUFFIX",
    "ZAP_DOMAIN",
    "CurveAuthenticator",
    "KeyPair",
    "PeerAllowList",
    "generate_keys",
    "key_prefix",
    "load_keypair",
    "load_keypair_public",
    "load_public_keys",
    "secure_client",
    "secure_server",
    "sender_public_key",
    "validate_key_name",
    "warn_open_cluster",
]

log = structlog.get_logger("zpipe.security")

# Set on every server socket so that ZAP is mandatory for it (see the module notes).
ZAP_DOMAIN = "zpipe"


class PeerAllowList:
    """The public keys (Z85 bytes) allowed to complete a handshake, with names for logs.

    Mutable while sockets run: the authenticator consults it on every new connection.
    All changes happen on the event loop thread, so no lock is needed.
    """

    def __init__(self, peers: Mapping[str, bytes] | Iterable[bytes] = ()) -> None:
        self._names: dict[bytes, str | None] = {}
        self.replace(peers)

    @classmethod
    def from_dir(cls, keys_dir: Path) -> PeerAllowList:
        """Every public key in ``keys_dir`` (the coordinator's allow-list)."""
        return cls(load_public_keys(keys_dir))

    def allow(self, key: bytes, name: str | None = None) -> None:
        """Allow ``key`` (Z85) from now on; ``name`` is only used in log lines."""
        key = check_z85_key(key, f"public key for {name or 'peer'!r}")
        self._names[key] = name

    def replace(self, peers: Mapping[str, bytes] | Iterable[bytes]) -> None:
        """Allow exactly ``peers`` (a name->key mapping or bare keys) from now on.

        Connections that already completed their handshake are not dropped.
        """
        # Validate everything first so a bad key leaves the old list in force.
        if isinstance(peers, Mapping):
            new = {
                check_z85_key(key, f"public key for {name!r}"): name for name, key in peers.items()
            }
        else:
            new = {check_z85_key(key, "public key"): None for key in peers}
        self._names = dict(new)

    def discard(self, key: bytes) -> None:
        """Stop allowing ``key``; unknown keys are ignored."""
        self._names.pop(key, None)

    def name_of(self, key: bytes) -> str | None:
        """The name ``key`` was allowed under, or None if unnamed or not allowed."""
        return self._names.get(key)

    def describe(self, key: bytes) -> str:
        """A log-friendly label: the name if known, else the key prefix."""
        name = self._names.get(key)
        return name if name is not None else key_prefix(key) + "..."

    def __contains__(self, key: object) -> bool:
        return key in self._names

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._names))

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"PeerAllowList({sorted(self.describe(k) for k in self._names)})"


# ---------------------------------------------------------------------- authenticator


class _AllowListProvider:
    """pyzmq credentials provider: ``callback(domain, z85_key)`` decides a handshake."""

    def __init__(self, owner: CurveAuthenticator, domain: str = ZAP_DOMAIN) -> None:
        self._owner = owner
        self._domain = domain

    def callback(self, domain: str, key: bytes) -> bool:
        # An exception here would kill pyzmq's ZAP handling; refuse instead (fail closed).
        try:
            allowed = key in self._owner.allow_list_of(self._domain)
        except Exception:
            log.exception("allow_list_error", key_prefix=key_prefix(key))
            return False
        if allowed:
            log.debug(
                "peer_accepted",
                peer=self._owner.allow_list_of(self._domain).describe(key),
                address=self._owner.current_address,
            )
        else:
            # Key prefix only: full keys in logs invite copy-pasting them into allow-lists.
            # peer=: the flood limit keeps a few lines per address (zpipe.log_limits),
            # whatever keys a peer makes up.
            address = self._owner.current_address or ""
            self._owner.refused[address] += 1
            log.warning(
                "peer_refused",
                peer=address,
                refused=self._owner.refused[address],
                key_prefix=key_prefix(key),
                address=self._owner.current_address,
                domain=domain,
                hint=(
                    "if the device is trusted, add its NAME.key to the coordinator's key "
                    "directory; stages accept only the peers the coordinator assigned"
                ),
            )
        return allowed


class CurveAuthenticator(Authenticator):
    """ZAP handler for one zmq context that accepts CURVE clients on a PeerAllowList.

    One instance serves every server socket of ``context`` (libzmq routes all ZAP
    requests of a context to one handler); a second one on the same context raises
    :class:`SecurityError` on :meth:`start`. Change ``allow_list`` (or call its
    ``replace``) at any time: the next handshake sees the change.

    pyzmq's own ZAP logic (``handle_zap_message``, ``configure_curve_callback``) does
    the protocol work; this class replaces only ``AsyncioAuthenticator``'s event loop
    glue, whose ``stop()`` leaves a stale file descriptor registration behind (see
    the module notes). Call :meth:`start` inside a running event loop and
    :meth:`stop` before ``context.term()``, or use ``async with``.
    """

    def __init__(self, context: zmq.Context[Any], allow_list: PeerAllowList) -> None:
        super().__init__(context, log=_StdlibToStructlog())
        self.allow_list = allow_list
        # Address of the handshake being decided, for log lines; requests are handled
        # one at a time, so a single slot is enough.
        self.current_address: str | None = None
        # refused handshakes by the peer's address, since start
        self.refused: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None
        self._async_zap: zmq.asyncio.Socket | None = None
        provider = _AllowListProvider(self)
        # ZAP_DOMAIN covers sockets set up by secure_server; '*' covers CURVE server
        # sockets set up by hand with no domain (pyzmq maps an empty domain to '*').
        self.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=provider)
        self.configure_curve_callback(domain="*", credentials_provider=provider)
        # Further ZAP domains, each with its own allow-list (see add_domain).
        self._domain_lists: dict[str, PeerAllowList] = {}

    def add_domain(self, domain: str, allow_list: PeerAllowList) -> None:
        """Decide handshakes of server sockets made with ``secure_server(..., domain=)``.

        One context has one ZAP handler, so sockets that admit different peers
        (a stage's data socket admits its upstream only, its probe socket every
        cluster member) share this authenticator and differ by ZAP domain.
        """
        if domain in (ZAP_DOMAIN, "*"):
            raise ValueError(f"domain {domain!r} is the default one; pass another name")
        self._domain_lists[domain] = allow_list
        self.configure_curve_callback(
            domain=domain, credentials_provider=_AllowListProvider(self, domain)
        )

    def allow_list_of(self, domain: str) -> PeerAllowList:
        if domain == ZAP_DOMAIN:
            return self.allow_list
        return self._domain_lists[domain]

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Bind the context's ZAP endpoint and serve requests on the running loop."""
        if self._task is not None:
            raise RuntimeError("CurveAuthenticator.start() called twice; call stop() first")
        loop = asyncio.get_running_loop()  # fail here, not later, outside a loop
        try:
            super().start()
        except zmq.ZMQError as exc:
            if self.zap_socket is not None:
                self.zap_socket.close(linger=0)
                self.zap_socket = None  # type: ignore[assignment]
            if exc.errno == zmq.EADDRINUSE:
                raise SecurityError(
                    "another ZAP authenticator already runs on this zmq context; use one "
                    "CurveAuthenticator per context and share its PeerAllowList"
                ) from exc
            raise
        # An asyncio shadow of the ZAP socket: awaiting it registers the descriptor
        # with the loop, and closing it unregisters synchronously.
        self._async_zap = zmq.asyncio.Socket.from_socket(self.zap_socket)
        self._task = loop.create_task(self._serve(self._async_zap), name="zpipe-zap")
        log.debug("authenticator_started", allowed=len(self.allow_list))

    async def _serve(self, zap: zmq.asyncio.Socket) -> None:
        while True:
            msg = await zap.recv_multipart()
            self.current_address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else None
            try:
                await self.handle_zap_message(msg)
            except Exception:
                # Keep serving: a dead handler would stall every later handshake.
                log.exception("zap_request_failed", address=self.current_address)
                with contextlib.suppress(zmq.ZMQError):
                    if len(msg) > 1:
                        self._send_zap_reply(msg[1], b"500", b"Internal error")
            finally:
                self.current_address = None

    def stop(self) -> None:
        """Stop serving and close the ZAP socket; safe to call twice."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._async_zap is not None:
            # Closing the asyncio shadow removes the loop's reader for the descriptor
            # before libzmq frees it (closes the underlying socket too).
            self._async_zap.close(linger=0)
            self._async_zap = None
        super().stop()

    async def __aenter__(self) -> CurveAuthenticator:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.stop()


class _StdlibToStructlog:
    """pyzmq logs through a stdlib-style logger; forward what matters to structlog.

    pyzmq's debug lines carry full client keys and duplicate our own peer_accepted /
    peer_refused events, so they are dropped.
    """

    def debug(self, msg: str, *args: Any) -> None:
        pass

    def info(self, msg: str, *args: Any) -> None:
        pass

    def warning(self, msg: str, *args: Any) -> None:
        log.warning("zap_warning", detail=msg % args if args else msg)

    def error(self, msg: str, *args: Any) -> None:
        log.error("zap_error", detail=msg % args if args else msg)


# ---------------------------------------------------------------------- socket set-up


def _check_not_attached(socket: zmq.Socket[Any], call: str, before: str) -> None:
    # Security options are copied when an endpoint is created; set later, they would
    # leave the existing endpoint open.
    if socket.getsockopt(zmq.LAST_ENDPOINT):
        raise SecurityError(
            f"{call}() must be called before {before}(): this socket already has an "
            "endpoint that would stay unencrypted; create a new socket"
        )


def secure_server(socket: zmq.Socket[Any], keypair: KeyPair, *, domain: str = ZAP_DOMAIN) -> None:
    """Make ``socket`` a CURVE server whose clients must pass ZAP; call before bind().

    The socket refuses every client unless a :class:`CurveAuthenticator` runs on its
    context (ZAP is enforced through the domain, ``ZAP_DOMAIN`` unless one added
    with :meth:`CurveAuthenticator.add_domain` is named).
    """
    _check_not_attached(socket, "secure_server", "bind")
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keypair.secret)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keypair.public)
    socket.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    try:
        socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    except zmq.ZMQError:
        # Older libzmq builds lack the option; a running authenticator still protects.
        log.warning(
            "zap_enforce_unavailable",
            libzmq=zmq.zmq_version(),
            consequence="this socket accepts any key if no CurveAuthenticator runs",
        )


def secure_client(socket: zmq.Socket[Any], keypair: KeyPair, server_public_key: bytes) -> None:
    """Make ``socket`` a CURVE client of the server owning ``server_public_key``.

    Call before connect(). A wrong server key makes the handshake fail over and over
    (the client retries) without reaching the server's authenticator.
    """
    _check_not_attached(socket, "secure_client", "connect")
    server_public_key = check_z85_key(server_public_key, "server public key")
    socket.setsockopt(zmq.CURVE_SERVERKEY, server_public_key)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keypair.public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keypair.secret)


def sender_public_key(frame: zmq.Frame) -> bytes | None:
    """Z85 public key of the peer that sent ``frame`` (from ``recv(copy=False)``).

    None when the connection was not authenticated by CURVE. Use it to drop messages
    from a peer removed from the allow-list after its connection was accepted.
    """
    try:
        user_id = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    if not isinstance(user_id, str) or len(user_id) != Z85_KEY_LEN:
        return None
    return user_id.encode("ascii")


class _WarningLogger(Protocol):
    def warning(self, event: str, *args: Any, **kw: Any) -> Any: ...


def warn_open_cluster(logger: _WarningLogger, role: str) -> None:
    """Log that ``role`` accepts any peer because ``--keys`` was not given."""
    logger.warning(
        "cluster_open",
        role=role,
        detail=(
            f"the {role} runs without --keys: any device that can reach its ports can "
            "join the cluster, read activations and inject data"
        ),
        fix=(
            "create keys with `python -m zpipe keys --dir DIR coordinator client STAGE...` "
            "and pass --keys DIR to every participant"
        ),
    )
