"""Key roles: which participant may send which kind (issue 19, item 6)."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from zpipe._errors import ConfigError, RoleError, SecurityError
from zpipe.federated.net_admission import fl_implied_role
from zpipe.transport import security
from zpipe.transport.codec import SCHEMAS
from zpipe.transport.roles import (
    ROLE_KINDS,
    ROLES_FILE,
    KeyRoles,
    check_role,
    generate_keys_with_roles,
    load_roles,
    record_roles,
)
from zpipe.transport.security import generate_keys, load_keypair_public

CLIENT_ONLY = ("run_request", "run_go", "run_end", "cluster_request", "replicate", "stalled")
COORDINATOR_ONLY = ("assign", "connect", "probe", "profile_request", "backup_request")
STAGE_ONLY = ("register", "heartbeat", "ready", "probe_ack", "backup", "fetch_units")


@pytest.mark.parametrize("kind", CLIENT_ONLY)
def test_only_clients_start_steer_and_end_runs_and_read_the_cluster(kind: str) -> None:
    check_role(kind, "client")  # allowed: no RoleError
    for role in ("stage", "coordinator"):
        with pytest.raises(RoleError, match=f"a {role} key may not send '{kind}'"):
            check_role(kind, role)


@pytest.mark.parametrize("kind", COORDINATOR_ONLY)
def test_only_the_coordinator_assigns_connects_and_probes(kind: str) -> None:
    check_role(kind, "coordinator")  # allowed: no RoleError
    for role in ("client", "stage"):
        with pytest.raises(RoleError, match="only coordinator may"):
            check_role(kind, role)


@pytest.mark.parametrize("kind", STAGE_ONLY)
def test_stages_register_heartbeat_and_reply(kind: str) -> None:
    check_role(kind, "stage")  # allowed: no RoleError
    for role in ("client", "coordinator"):
        with pytest.raises(RoleError):
            check_role(kind, role)


def test_weights_requests_come_from_clients_to_the_coordinator_and_from_it_to_stages() -> None:
    check_role("weights_request", "client")
    check_role("weights_request", "coordinator")
    with pytest.raises(RoleError):
        check_role("weights_request", "stage")


def test_unknown_kinds_are_refused_and_keys_without_roles_may_send_nothing() -> None:
    for role in ("client", "stage", "coordinator"):
        with pytest.raises(RoleError, match="no participant"):
            check_role("no_such_kind", role)
    # Issue 33: deny by default (it was: allowed, and logged as role_unchecked).
    for kind in (*CLIENT_ONLY, *COORDINATOR_ONLY, *STAGE_ONLY, "data", "no_such_kind"):
        with pytest.raises(RoleError, match="a key without a role may not send"):
            check_role(kind, None)
    with pytest.raises(RoleError, match="unknown role"):
        check_role("data", "admin")  # type: ignore[arg-type]


def test_every_wire_kind_has_a_sender() -> None:
    on_disk_only = {"coordinator_state", "replica_file", "copy_file"}
    # fl-server's and fl-client's kinds travel on their own sockets
    # (zpipe.protocol.federated); a lossy run's go through the cluster's, so a
    # secure cluster with roles must know who sends each of them
    federated = {kind for kind in SCHEMAS if kind.startswith("fl_")}
    senders = set().union(*ROLE_KINDS.values())
    assert set(SCHEMAS) - on_disk_only - federated <= senders
    assert senders <= set(SCHEMAS)


def test_generated_keys_record_their_roles(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    written = generate_keys_with_roles(keys, ["coordinator", "client", "a", "b"])
    assert written[-1] == keys / ROLES_FILE
    generate_keys_with_roles(keys, ["alice"], role="client")
    assert load_roles(keys) == {
        "a": "stage",
        "alice": "client",
        "b": "stage",
        "client": "client",
        "coordinator": "coordinator",
    }
    roles = KeyRoles.from_dir(keys)
    for name, role in load_roles(keys).items():
        key = load_keypair_public(keys, name)
        assert roles.role_of(key) == role
        assert roles.role_of(key.decode()) == role  # as the coordinator's user_key str
        assert roles.name_of(key) == name
    stage_key = load_keypair_public(keys, "a")
    with pytest.raises(RoleError):
        roles.check("run_request", stage_key)
    roles.check("run_request", load_keypair_public(keys, "alice"))  # a client: allowed
    assert roles.role_of(zmq.curve_keypair()[0]) is None  # a key not in the directory
    assert roles.role_of(None) is None
    assert roles.without_role() == []
    with pytest.raises(ConfigError, match="unknown role"):
        generate_keys_with_roles(keys, ["x"], role="root")  # type: ignore[arg-type]


def test_a_key_directory_without_roles_gives_the_roles_names_imply(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys, ["coordinator", "client", "a"])
    assert not (keys / ROLES_FILE).exists()
    assert set(security.load_public_keys(keys)) == {"coordinator", "client", "a"}
    roles = KeyRoles.from_dir(keys)
    assert roles.without_role() == []
    stage, client = (load_keypair_public(keys, name) for name in ("a", "client"))
    assert (roles.role_of(stage), roles.role_of(client)) == ("stage", "client")
    with pytest.raises(RoleError, match="a stage key may not send 'run_request'"):
        roles.check("run_request", stage)  # it was allowed every kind before issue 33
    roles.check("run_request", client)
    roles.check("register", stage)
    # fl-server's rule for the same layout: every key but the server's is a client
    generate_keys(keys, ["fl-server"])
    fl_roles = KeyRoles.from_dir(keys, implied=fl_implied_role)
    fl_roles.check("fl_register", stage)
    with pytest.raises(RoleError):
        fl_roles.check("fl_register", load_keypair_public(keys, "fl-server"))


def test_a_key_that_roles_txt_does_not_list_is_refused_every_kind(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys_with_roles(keys, ["coordinator", "client", "a"])
    generate_keys(keys, ["mallory"])  # a key file added by hand, no line in roles.txt
    roles = KeyRoles.from_dir(keys)
    assert roles.without_role() == ["mallory"]
    mallory = load_keypair_public(keys, "mallory")
    every_kind = sorted(set().union(*ROLE_KINDS.values()))
    for kind in every_kind:
        with pytest.raises(RoleError, match="without a role"):
            roles.check(kind, mallory)
    assert not KeyRoles.from_dir(keys, implied=fl_implied_role).role_of(mallory)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("a stage\nb admin\n", r"roles.txt:2: unknown role 'admin'"),
        ("a stage\na client\n", r"roles.txt:2: key 'a' is given a role twice"),
        ("a\n", r"roles.txt:1: expected 'NAME ROLE'"),
        ("a stage extra\n", r"roles.txt:1: expected 'NAME ROLE'"),
    ],
)
def test_malformed_roles_files_name_the_line(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / ROLES_FILE).write_text(text)
    with pytest.raises(SecurityError, match=match):
        load_roles(tmp_path)


def test_roles_file_comments_and_names(tmp_path: Path) -> None:
    (tmp_path / ROLES_FILE).write_text("# header\n\na stage  # the first device\n")
    assert load_roles(tmp_path) == {"a": "stage"}
    with pytest.raises(ConfigError, match="invalid key name"):
        record_roles(tmp_path, {"../evil": "client"})
    with pytest.raises(SecurityError, match="unknown role"):
        record_roles(tmp_path, {"b": "admin"})
    assert load_roles(tmp_path) == {"a": "stage"}  # nothing written on a bad update


def test_the_keys_command_records_roles(tmp_path: Path) -> None:
    from zpipe.cli.keys import main as keys_main

    keys = tmp_path / "keys"
    assert keys_main(["--dir", str(keys), "coordinator", "client", "phone"]) == 0
    assert keys_main(["--dir", str(keys), "--role", "client", "dashboard"]) == 0
    roles = KeyRoles.from_dir(keys)
    public = security.load_public_keys(keys)
    by_name = {name: roles.role_of(key) for name, key in public.items()}
    assert by_name == {
        "coordinator": "coordinator",
        "client": "client",
        "phone": "stage",
        "dashboard": "client",
    }
