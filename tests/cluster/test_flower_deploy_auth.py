"""An unlisted client is refused: Flower's SuperNode authentication on loopback.

Flower 1.42 authenticates SuperNodes only over TLS (``--enable-supernode-auth``
with ``--insecure`` is refused), so the test makes a CA and a certificate for
127.0.0.1 with ``cryptography``, and an EC key pair (OpenSSH format, NIST P-384)
for each of two SuperNodes. One public key is registered with ``flwr supernode
register``; the SuperNode holding the other key is refused at activation (the
SuperLink knows no node of its key) and exits, while the listed one comes online
under the node id its registration created. ``flwr supernode list`` then shows
that one node only, and an Eco-FL run over this SuperLink (TLS end to end) starts
with the listed client alone and trains it on its pipeline."""

from __future__ import annotations

import datetime
import ipaddress
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._support.flower_processes import FlowerProcesses, listening
from zpipe.federated.flower_deploy import write_app
from zpipe.federated.flower_deploy_control import DeploySettings
from zpipe.transport.ports import free_tcp_port

pytest.importorskip("flwr.serverapp")

pytestmark = pytest.mark.timeout(900)

DEADLINE_S = 180.0
EXIT_CONNECTION_ERROR = 305  # Flower's SUPERNODE_CONNECTION_ERROR


def _make_keys(directory: Path) -> None:
    """A CA, a server certificate for 127.0.0.1, and two SuperNode key pairs."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject: str, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    pem = serialization.Encoding.PEM
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        certificate("zpipe test CA", ca_key)
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "zpipe test CA")]))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP384R1())
    names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    server = (
        certificate("127.0.0.1", server_key)
        .issuer_name(ca.subject)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    (directory / "ca.pem").write_bytes(ca.public_bytes(pem))
    (directory / "server.pem").write_bytes(server.public_bytes(pem))
    plain = serialization.NoEncryption()
    server_pkcs8 = server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, plain)
    (directory / "server.key").write_bytes(server_pkcs8)
    for name in ("listed", "unlisted"):
        key = ec.generate_private_key(ec.SECP384R1())
        (directory / name).write_bytes(
            key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, plain)
        )
        (directory / f"{name}.pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
        )


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[FlowerProcesses]:
    running = FlowerProcesses(tmp_path)
    try:
        yield running
    finally:
        running.close()


def test_an_unlisted_supernode_is_refused(processes: FlowerProcesses, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    _make_keys(keys)
    port = free_tcp_port()
    superlink = processes.start(
        "superlink",
        [
            "flower-superlink",
            "--port",
            str(port),
            "--disable-runtime-dependency-installation",
            "--enable-supernode-auth",
            "--ssl-certfile",
            str(keys / "server.pem"),
            "--ssl-keyfile",
            str(keys / "server.key"),
            "--ssl-ca-certfile",
            str(keys / "ca.pem"),
        ],
    )
    assert listening(port, superlink, DEADLINE_S), processes.log("superlink")
    flwr_home = tmp_path / "flwr"
    flwr_home.mkdir(exist_ok=True)  # the SuperLink may have made it
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{keys / "ca.pem"}"\n',
        encoding="utf-8",
    )
    registered = processes.flwr(
        "supernode", "register", str(keys / "listed.pub"), "local", "--format", "json"
    )
    assert registered.returncode == 0, registered.stdout + registered.stderr
    node_id = str(json.loads(registered.stdout)["node-id"])

    def supernode(name: str, partition: int) -> subprocess.Popen[bytes]:
        return processes.start(
            name,
            [
                "flower-supernode",
                "--superlink",
                f"127.0.0.1:{port}",
                "--root-certificates",
                str(keys / "ca.pem"),
                "--auth-supernode-private-key",
                str(keys / name),
                "--port",
                str(free_tcp_port()),
                "--node-config",
                f"partition-id={partition}",
            ],
        )

    supernode("listed", 0)
    unlisted = supernode("unlisted", 1)
    # Flower logs its exit code (the process itself exits with 1 after its HTTP
    # server's shutdown)
    assert unlisted.wait(timeout=DEADLINE_S) != 0, processes.log("unlisted")
    refusal = processes.log("unlisted")
    assert f"Exit Code: {EXIT_CONNECTION_ERROR}" in refusal, refusal
    assert "Failed to activate SuperNode" in refusal
    assert "No SuperNode found with the given public key" in processes.log("superlink")

    deadline = time.monotonic() + DEADLINE_S
    nodes: list[dict[str, str]] = []
    while time.monotonic() < deadline:
        listed = processes.flwr("supernode", "list", "local", "--format", "json")
        assert listed.returncode == 0, listed.stdout + listed.stderr
        nodes = json.loads(listed.stdout)["nodes"]
        if any(n["status"] == "online" for n in nodes):
            break
        time.sleep(1.0)
    assert [(n["node-id"], n["status"]) for n in nodes] == [(node_id, "online")], nodes

    # Eco-FL over the authenticated SuperLink (TLS end to end): the run waits for two
    # clients, gets only the listed one, starts with it and trains on its pipeline
    result_path = tmp_path / "result.json"
    settings = DeploySettings(
        clients=2,
        max_concurrent=2,
        max_updates=1,
        # from the first node seen: the unlisted one has exited already, so this is
        # only waited out (a run starts once its one node is profiled, never sooner)
        nodes_timeout_s=5.0,
        task_timeout_s=DEADLINE_S,
        profile_timeout_s=DEADLINE_S,
        events_path=str(tmp_path / "events.jsonl"),
        result_path=str(result_path),
    )
    app = write_app(tmp_path / "app", settings)
    submitted = processes.flwr("run", str(app), "local")
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    deadline = time.monotonic() + 2 * DEADLINE_S
    while not result_path.exists() and time.monotonic() < deadline:
        time.sleep(1.0)
    events = (tmp_path / "events.jsonl").read_text(encoding="utf-8").splitlines()
    assert result_path.exists(), events
    result = json.loads(result_path.read_text(encoding="utf-8"))
    assert result["reason"] == "updates" and result["version"] == 1
    registered = [json.loads(line) for line in events if '"registered"' in line]
    assert [e["client"] for e in registered] == [0]
    assert [e["node"] for e in registered] == [int(node_id)]
