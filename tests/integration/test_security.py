"""CurveZMQ security: key files, the keys CLI, and real CURVE sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from zpipe._errors import ConfigError, SecurityError
from zpipe.cli.keys import main as keys_main
from zpipe.transport.security import (
    CurveAuthenticator,
    KeyPair,
    PeerAllowList,
    generate_keys,
    load_keypair,
    load_keypair_public,
    load_public_keys,
    secure_client,
    secure_server,
    sender_public_key,
    warn_open_cluster,
)

# Long enough for a handshake on loopback (about 2 ms), short enough to keep tests fast.
REFUSAL_WAIT_S = 1.0
EVENT_WAIT_S = 5.0
RECV_WAIT_S = 5.0


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys"
    generate_keys(path, ["coordinator", "stage-a", "stage-b", "intruder"])
    return path


@pytest.fixture(scope="module")
def pairs(keys_dir: Path) -> dict[str, KeyPair]:
    return {n: load_keypair(keys_dir, n) for n in ["coordinator", "stage-a", "stage-b", "intruder"]}


class Net:
    """A context plus every socket a test opens, all closed with linger 0 at the end."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sockets: list[zmq.asyncio.Socket] = []
        self.monitored: list[zmq.asyncio.Socket] = []
        self.auth: CurveAuthenticator | None = None

    def socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.sockets.append(sock)
        return sock

    def monitor(self, sock: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
        mon = sock.get_monitor_socket()
        mon.setsockopt(zmq.LINGER, 0)
        self.monitored.append(sock)
        self.sockets.append(mon)
        return mon

    def server(self, kind: int, pair: KeyPair) -> tuple[zmq.asyncio.Socket, str]:
        sock = self.socket(kind)
        secure_server(sock, pair)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        return sock, f"tcp://127.0.0.1:{port}"

    def client(
        self, kind: int, pair: KeyPair, server: KeyPair, endpoint: str
    ) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        sock = self.socket(kind)
        secure_client(sock, pair, server.public)
        mon = self.monitor(sock)
        sock.connect(endpoint)
        return sock, mon

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        for sock in self.monitored:
            if not sock.closed:
                sock.disable_monitor()
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
async def net() -> AsyncIterator[Net]:
    n = Net()
    try:
        yield n
    finally:
        n.close()


def start_auth(net: Net, allow: PeerAllowList) -> CurveAuthenticator:
    net.auth = CurveAuthenticator(net.ctx, allow)
    net.auth.start()
    return net.auth


async def handshake_outcome(mon: zmq.asyncio.Socket) -> tuple[int, int]:
    """(event, value) of the first handshake result the client's monitor reports."""
    wanted = (
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + EVENT_WAIT_S
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise AssertionError("no handshake event within the timeout")
        event = await asyncio.wait_for(recv_monitor_message(mon), remaining)
        if event["event"] & wanted:
            return int(event["event"]), int(event["value"])


async def recv_within(sock: zmq.asyncio.Socket, timeout_s: float) -> list[bytes] | None:
    """The next multipart message, or None if none arrives within ``timeout_s``."""
    if not await sock.poll(int(timeout_s * 1000)):
        return None
    return await asyncio.wait_for(sock.recv_multipart(), RECV_WAIT_S)


async def send(sock: zmq.asyncio.Socket, *frames: bytes) -> None:
    await asyncio.wait_for(sock.send_multipart(list(frames)), RECV_WAIT_S)


# ---------------------------------------------------------------------- CURVE sockets


async def test_allowed_client_reaches_pull_server(net: Net, pairs: dict[str, KeyPair]) -> None:
    allow = PeerAllowList({"stage-a": pairs["stage-a"].public})
    start_auth(net, allow)
    pull, endpoint = net.server(zmq.PULL, pairs["coordinator"])
    push, mon = net.client(zmq.PUSH, pairs["stage-a"], pairs["coordinator"], endpoint)

    await send(push, b"activations")
    assert await handshake_outcome(mon) == (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
    frame = await asyncio.wait_for(pull.recv(copy=False), RECV_WAIT_S)
    assert frame.bytes == b"activations"
    # The receiver can tell who sent it, to re-check against a changed allow-list.
    assert sender_public_key(frame) == pairs["stage-a"].public


async def test_allowed_client_round_trips_with_router_server(
    net: Net, pairs: dict[str, KeyPair]
) -> None:
    start_auth(net, PeerAllowList({"stage-a": pairs["stage-a"].public}))
    router, endpoint = net.server(zmq.ROUTER, pairs["coordinator"])
    dealer, _ = net.client(zmq.DEALER, pairs["stage-a"], pairs["coordinator"], endpoint)

    await send(dealer, b"register", b"stage-a")
    got = await recv_within(router, RECV_WAIT_S)
    assert got is not None and got[1:] == [b"register", b"stage-a"]
    await send(router, got[0], b"welcome")
    assert await recv_within(dealer, RECV_WAIT_S) == [b"welcome"]


async def test_client_with_unknown_key_is_refused(net: Net, pairs: dict[str, KeyPair]) -> None:
    start_auth(net, PeerAllowList({"stage-a": pairs["stage-a"].public}))
    pull, endpoint = net.server(zmq.PULL, pairs["coordinator"])

    with structlog.testing.capture_logs() as logs:
        push, mon = net.client(zmq.PUSH, pairs["intruder"], pairs["coordinator"], endpoint)
        # The send succeeds locally: libzmq queues it on the client, which never
        # learns (except through its monitor) that the server refused it.
        await send(push, b"injected")
        event, value = await handshake_outcome(mon)
        assert await recv_within(pull, REFUSAL_WAIT_S) is None

    assert event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    assert value == 400  # the ZAP status code
    refused = [e for e in logs if e["event"] == "peer_refused"]
    assert len(refused) == 1
    assert refused[0]["log_level"] == "warning"
    assert refused[0]["address"] == "127.0.0.1"
    intruder_key = pairs["intruder"].public.decode()
    assert intruder_key.startswith(refused[0]["key_prefix"])
    # Only a prefix is logged, never the whole key.
    assert all(intruder_key not in str(e) for e in logs)


async def test_client_without_curve_cannot_inject(net: Net, pairs: dict[str, KeyPair]) -> None:
    start_auth(net, PeerAllowList({"stage-a": pairs["stage-a"].public}))
    pull, endpoint = net.server(zmq.PULL, pairs["coordinator"])
    plain = net.socket(zmq.PUSH)
    mon = net.monitor(plain)
    plain.connect(endpoint)

    await send(plain, b"injected")
    event, _ = await handshake_outcome(mon)
    assert event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    assert await recv_within(pull, REFUSAL_WAIT_S) is None


async def test_secure_server_refuses_everyone_without_authenticator(
    net: Net, pairs: dict[str, KeyPair]
) -> None:
    # Fail closed: libzmq would accept any client here unless ZAP is enforced.
    pull, endpoint = net.server(zmq.PULL, pairs["coordinator"])
    push, mon = net.client(zmq.PUSH, pairs["stage-a"], pairs["coordinator"], endpoint)

    await send(push, b"data")
    event, _ = await handshake_outcome(mon)
    assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert await recv_within(pull, REFUSAL_WAIT_S) is None


async def test_replacing_allow_list_takes_effect_on_new_connections(
    net: Net, pairs: dict[str, KeyPair]
) -> None:
    coord, a, b = pairs["coordinator"], pairs["stage-a"], pairs["stage-b"]
    allow = PeerAllowList({"stage-a": a.public})
    start_auth(net, allow)
    pull, endpoint = net.server(zmq.PULL, coord)

    kept, kept_mon = net.client(zmq.PUSH, a, coord, endpoint)
    assert (await handshake_outcome(kept_mon))[0] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    _, b_mon = net.client(zmq.PUSH, b, coord, endpoint)
    assert (await handshake_outcome(b_mon))[0] == zmq.EVENT_HANDSHAKE_FAILED_AUTH

    # The coordinator reassigns: stage-b is now the upstream peer, stage-a is not.
    allow.replace({"stage-b": b.public})

    b_again, b_again_mon = net.client(zmq.PUSH, b, coord, endpoint)
    assert (await handshake_outcome(b_again_mon))[0] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    await send(b_again, b"from-b")
    frame = await asyncio.wait_for(pull.recv(copy=False), RECV_WAIT_S)
    assert frame.bytes == b"from-b"
    assert sender_public_key(frame) == b.public

    _, a_again_mon = net.client(zmq.PUSH, a, coord, endpoint)
    assert (await handshake_outcome(a_again_mon))[0] == zmq.EVENT_HANDSHAKE_FAILED_AUTH

    # ZAP runs only at handshake time: stage-a's old connection still delivers, and
    # the receiver must use the sender key to drop it.
    await send(kept, b"stale-a")
    frame = await asyncio.wait_for(pull.recv(copy=False), RECV_WAIT_S)
    assert frame.bytes == b"stale-a"
    stale_key = sender_public_key(frame)
    assert stale_key == a.public
    assert stale_key not in allow


async def test_authenticator_restarts_cleanly_in_one_event_loop(
    pairs: dict[str, KeyPair],
) -> None:
    # pyzmq's AsyncioAuthenticator goes deaf after a stop/start cycle in one loop
    # (stale descriptor registration); every cycle here must still decide handshakes.
    for _ in range(3):
        net = Net()
        try:
            start_auth(net, PeerAllowList({"stage-a": pairs["stage-a"].public}))
            pull, endpoint = net.server(zmq.PULL, pairs["coordinator"])
            _, bad_mon = net.client(zmq.PUSH, pairs["intruder"], pairs["coordinator"], endpoint)
            assert (await handshake_outcome(bad_mon))[0] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            push, _ = net.client(zmq.PUSH, pairs["stage-a"], pairs["coordinator"], endpoint)
            await send(push, b"ok")
            assert await recv_within(pull, RECV_WAIT_S) == [b"ok"]
        finally:
            net.close()


async def test_second_authenticator_on_a_context_is_refused(net: Net) -> None:
    allow = PeerAllowList()
    async with CurveAuthenticator(net.ctx, allow) as first:
        assert first.running
        with pytest.raises(SecurityError, match="one CurveAuthenticator per context"):
            CurveAuthenticator(net.ctx, allow).start()
    assert not first.running


async def test_security_options_after_bind_are_refused(net: Net, pairs: dict[str, KeyPair]) -> None:
    server = net.socket(zmq.PULL)
    server.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(SecurityError, match="before bind"):
        secure_server(server, pairs["coordinator"])
    client = net.socket(zmq.PUSH)
    client.connect("tcp://127.0.0.1:9")
    with pytest.raises(SecurityError, match="before connect"):
        secure_client(client, pairs["stage-a"], pairs["coordinator"].public)


def test_secure_client_rejects_malformed_server_key(pairs: dict[str, KeyPair]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        with pytest.raises(SecurityError, match="server public key"):
            secure_client(sock, pairs["stage-a"], b"too-short")
    finally:
        sock.close(linger=0)
        ctx.term()


# ------------------------------------------------------------------------- allow-list


def test_allow_list_membership_names_and_replace(pairs: dict[str, KeyPair]) -> None:
    a, b = pairs["stage-a"].public, pairs["stage-b"].public
    allow = PeerAllowList({"stage-a": a})
    assert a in allow and b not in allow
    assert allow.name_of(a) == "stage-a"
    assert allow.name_of(b) is None

    allow.allow(b, "stage-b")
    assert b in allow and allow.name_of(b) == "stage-b" and len(allow) == 2

    allow.replace([b])
    assert a not in allow and b in allow
    assert allow.name_of(b) is None
    assert allow.describe(b) == b[:8].decode() + "..."

    allow.discard(b)
    assert len(allow) == 0


def test_allow_list_rejects_malformed_keys_and_keeps_old_entries(
    pairs: dict[str, KeyPair],
) -> None:
    a = pairs["stage-a"].public
    allow = PeerAllowList({"stage-a": a})
    with pytest.raises(SecurityError, match="stage-x"):
        allow.replace({"stage-b": pairs["stage-b"].public, "stage-x": b"not-a-key"})
    assert a in allow and len(allow) == 1
    with pytest.raises(SecurityError):
        allow.allow(b"~" * 40)  # right length, not Z85


# ------------------------------------------------------------------------- key files


def test_generate_and_load_round_trip(tmp_path: Path) -> None:
    keys = tmp_path / "new" / "keys"
    written = generate_keys(keys, ["coordinator", "stage.0"])

    assert written == [
        keys / "coordinator.key",
        keys / "coordinator.key_secret",
        keys / "stage.0.key",
        keys / "stage.0.key_secret",
    ]
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for path in written:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o600 if path.name.endswith("_secret") else 0o644), path
    assert sorted(p.name for p in keys.iterdir()) == sorted(p.name for p in written)

    pair = load_keypair(keys, "stage.0")
    assert pair.name == "stage.0"
    assert zmq.curve_public(pair.secret) == pair.public
    assert pair.secret.decode() not in repr(pair)

    public = load_public_keys(keys)
    assert public == {
        "coordinator": load_keypair(keys, "coordinator").public,
        "stage.0": pair.public,
    }
    assert public["coordinator"] != pair.public

    # Deleting NAME.key is how an administrator removes a device.
    (keys / "stage.0.key").unlink()
    assert set(load_public_keys(keys)) == {"coordinator"}


def test_generate_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    generate_keys(tmp_path, ["stage-a"])
    before = load_keypair(tmp_path, "stage-a")

    with pytest.raises(ConfigError, match=r"stage-a\.key.*--overwrite"):
        generate_keys(tmp_path, ["stage-b", "stage-a"])
    # All or nothing: stage-b was not written either.
    assert not (tmp_path / "stage-b.key").exists()
    assert load_keypair(tmp_path, "stage-a") == before

    generate_keys(tmp_path, ["stage-a"], overwrite=True)
    after = load_keypair(tmp_path, "stage-a")
    assert after.public != before.public
    assert stat.S_IMODE((tmp_path / "stage-a.key_secret").stat().st_mode) == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch left


@pytest.mark.parametrize(
    "names",
    [[""], ["a/b"], ["../evil"], [".hidden"], ["with space"], ["ok", "ok"], [], ["tab\t"]],
)
def test_generate_rejects_bad_names(tmp_path: Path, names: list[str]) -> None:
    with pytest.raises(ConfigError):
        generate_keys(tmp_path / "keys", names)
    assert not (tmp_path / "keys").exists()


def test_missing_secret_key_names_the_file_and_the_fix(tmp_path: Path) -> None:
    generate_keys(tmp_path, ["coordinator"])
    (tmp_path / "stage-a.key").write_text("left over public key file\n")
    with pytest.raises(SecurityError) as info:
        load_keypair(tmp_path, "stage-a")
    message = str(info.value)
    assert str(tmp_path / "stage-a.key_secret") in message
    assert f"python -m zpipe keys --dir {tmp_path} stage-a" in message


def test_load_keypair_public_reads_the_public_file(tmp_path: Path) -> None:
    generate_keys(tmp_path, ["coordinator"])
    pair = load_keypair(tmp_path, "coordinator")
    device = tmp_path / "device"
    device.mkdir()
    # A device holds only the coordinator's public file...
    (device / "coordinator.key").write_bytes((tmp_path / "coordinator.key").read_bytes())
    assert load_keypair_public(device, "coordinator") == pair.public
    # ...the coordinator's own machine may hold only the secret file.
    (tmp_path / "coordinator.key").unlink()
    assert load_keypair_public(tmp_path, "coordinator") == pair.public
    with pytest.raises(SecurityError, match=r"stage-a\.key"):
        load_keypair_public(device, "stage-a")


def test_public_key_file_is_not_a_key_pair(tmp_path: Path) -> None:
    generate_keys(tmp_path, ["coordinator"])
    (tmp_path / "coordinator.key_secret").write_text((tmp_path / "coordinator.key").read_text())
    with pytest.raises(SecurityError, match="no secret-key"):
        load_keypair(tmp_path, "coordinator")


def test_mismatched_key_pair_is_refused(tmp_path: Path) -> None:
    generate_keys(tmp_path, ["a", "b"])
    text_a = (tmp_path / "a.key_secret").read_text()
    public_b = load_keypair(tmp_path, "b").public.decode()
    public_a = load_keypair(tmp_path, "a").public.decode()
    (tmp_path / "a.key_secret").write_text(text_a.replace(public_a, public_b))
    with pytest.raises(SecurityError, match="does not belong"):
        load_keypair(tmp_path, "a")


def test_malformed_public_key_file_is_named(tmp_path: Path) -> None:
    generate_keys(tmp_path, ["coordinator"])
    (tmp_path / "broken.key").write_text("curve\n    nothing here\n")
    with pytest.raises(SecurityError, match=r"broken\.key"):
        load_public_keys(tmp_path)


def test_missing_key_directory(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="does not exist"):
        load_public_keys(tmp_path / "absent")


def test_group_readable_secret_is_reported(tmp_path: Path) -> None:
    generate_keys(tmp_path, ["stage-a"])
    (tmp_path / "stage-a.key_secret").chmod(0o644)
    with structlog.testing.capture_logs() as logs:
        load_keypair(tmp_path, "stage-a")
    assert [e["event"] for e in logs] == ["secret_key_exposed"]
    assert "chmod 600" in logs[0]["fix"]


def test_warn_open_cluster_logs_a_warning() -> None:
    with structlog.testing.capture_logs() as logs:
        warn_open_cluster(structlog.get_logger("zpipe.test"), "coordinator")
    assert len(logs) == 1
    assert logs[0]["log_level"] == "warning"
    assert logs[0]["role"] == "coordinator"
    assert "--keys" in logs[0]["detail"]


# ----------------------------------------------------------------------------- CLI


def test_keys_cli_writes_and_lists_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys"
    assert keys_main(["--dir", str(keys), "coordinator", "client"]) == 0
    out = capsys.readouterr().out
    for name in ["coordinator.key", "coordinator.key_secret", "client.key", "client.key_secret"]:
        assert (keys / name).is_file()
        assert str(keys / name) in out
    assert set(load_public_keys(keys)) == {"coordinator", "client"}


def test_keys_cli_refuses_overwrite_without_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert keys_main(["--dir", str(tmp_path), "coordinator"]) == 0
    before = load_keypair(tmp_path, "coordinator")
    capsys.readouterr()
    assert keys_main(["--dir", str(tmp_path), "coordinator"]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert load_keypair(tmp_path, "coordinator") == before
    assert keys_main(["--dir", str(tmp_path), "--overwrite", "coordinator"]) == 0
    assert load_keypair(tmp_path, "coordinator") != before


def test_keys_cli_bad_name_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert keys_main(["--dir", str(tmp_path / "k"), "../up"]) == 1
    assert "invalid key name" in capsys.readouterr().err


def test_keys_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        keys_main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "NAME.key_secret" in out
    assert "allow-list" in out
    assert "coordinator.key" in out


@pytest.mark.parametrize("argv", [["--dir", "x"], ["coordinator"], ["--dir", "x", "a", "--bogus"]])
def test_keys_cli_usage_errors_exit_2(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        keys_main(argv)
    assert info.value.code == 2
    assert not (tmp_path / "x").exists()
