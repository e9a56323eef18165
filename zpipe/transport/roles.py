"""Roles of keys: which participant may send which kind of message.

An allowed key proves *who* connects, not *what* it may do: without roles any
stage key could start a run or read the cluster. So a key directory records
each key's role (client, stage or coordinator) in ``DIR/roles.txt``, next to the
key files::

    # zpipe key roles: NAME ROLE, one key per line
    coordinator coordinator
    client client
    jetson-1 stage

``zpipe keys`` writes it (``record_roles``) when it makes keys; an operator may
edit it (a second client key: ``alice client``). :class:`KeyRoles` maps public
keys to roles, and :func:`check_role` says whether a role may send a kind
(:data:`ROLE_KINDS`: only clients start, steer and end runs and read the
cluster; only the coordinator assigns, connects and probes stages; stages
register, heartbeat and reply, and talk to each other on data and probe
sockets). A violation raises :class:`RoleError`.

Deny by default: a key that ``roles.txt`` does not list has no role and may
send nothing (``check_role(kind, None)`` raises). A key directory without
``roles.txt`` gives each key the role its name implies (:func:`default_role`:
``coordinator`` and ``client`` by name, every other key a stage; fl-server
passes its own rule, under which every other key is a client), never every
role.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Literal, cast

from zpipe._errors import ConfigError, RoleError, SecurityError
from zpipe.transport.keys import generate_keys, load_public_keys, validate_key_name

Role = Literal["client", "stage", "coordinator"]
ROLES: tuple[Role, ...] = ("client", "stage", "coordinator")
ROLES_FILE = "roles.txt"

# What each role may send. fl-server checks what fl-clients send on its
# socket (zpipe.protocol.federated) against the client role, and fl-server's own kinds
# are not listed (a client pins the server's key). A kind listed nowhere is refused
# for every known role (fail closed): add new kinds here.
ROLE_KINDS: dict[Role, frozenset[str]] = {
    "client": frozenset(
        {
            # to the coordinator: start, steer and end runs, read the cluster
            "run_request",
            "run_go",
            "run_end",
            "cluster_request",
            "weights_request",
            "replicate",
            "stalled",
            "notice_ack",
            "lossy_run_request",
            "repartition",
            "gen_run_request",
            # to the first and last stages: inputs and labels
            "data",
            "labels",
            # to an fl-server, as a federated client (a portal of its own pipeline)
            "fl_register",
            "fl_update",
            "fl_probe_reply",
            # to a generation run's first stage: sequences, cancels, the run's end
            "gen_submit",
            "gen_cancel",
            "gen_close",
        }
    ),
    "coordinator": frozenset(
        {
            # to stages
            "registered",
            "refused",
            "heartbeat_ack",
            "register_again",
            "probe",
            "assign",
            "connect",
            "profile_request",
            "metrics_request",
            "weights_request",
            "backup_request",
            "link_peers",
            "link_probe_request",
            "shutdown",
            "lossy_setup",
            "lossy_go",
            "lossy_dead",
            "lossy_remap",
            "lossy_probe_request",
            "repartition_request",
            "gen_setup",
            # to stages, on their bulk connections
            "bulk_opened",
            "bulk_chunk",
            "bulk_done",
            "bulk_refused",
            # to clients
            "run_ready",
            "run_failed",
            "run_started",
            "run_report",
            "stage_failed",
            "run_replanned",
            "cluster_state",
            "weights",
            "replicated",
            "checkpoint",
            "progress",
            "lossy_run_report",
            "repartitioned",
            # a stage's speed verdict, relayed (zpipe.protocol.repartition)
            "speed_changed",
            "gen_run_ready",
        }
    ),
    "stage": frozenset(
        {
            # to the coordinator: membership and replies
            "register",
            "heartbeat",
            "probe_ack",
            "ready",
            "connected",
            "assign_failed",
            "profile_reply",
            "metrics",
            "link_peers_ok",
            "link_probe_reply",
            "weights",
            "backed_up",
            "async_copy",
            "lossy_ready",
            "lossy_result",
            "lossy_hold",
            "lossy_replica",
            "lossy_probe_report",
            "repartition_reply",
            "speed_changed",
            "gen_ready",
            # to the coordinator, on the bulk connection
            "bulk_open",
            "bulk_chunk",
            # on data sockets, to stages and the client's sink
            "data",
            "grad",
            "labels",
            "loss",
            "error",
            "allreduce",
            "lossy_partial",
            "lossy_ack",
            "lossy_probe",
            "lossy_probe_end",
            # a generation run: steps, frees and the run's end down the pipeline, tokens
            # around the ring, the first stage's stream to the client's sink
            "gen_step",
            "gen_free",
            "gen_close",
            "gen_tokens",
            "gen_step_failed",
            "gen_token",
            "gen_token_batch",
            "gen_refused",
            # on probe sockets, stage to stage
            "link_ping",
            "link_pong",
            "link_burst",
            "link_burst_end",
            "link_burst_report",
            "backup",
            "backup_ok",
            "fetch_units",
            "units",
            "state_chunk",
            "state_chunk_ok",
        }
    ),
}


def check_role(kind: str, role: Role | None) -> None:
    """RoleError unless `role` may send `kind`; a key without a role (None) may
    send nothing."""
    if role is None:
        raise RoleError(
            f"a key without a role may not send {kind!r}: give it one in roles.txt "
            "('NAME ROLE', or python -m zpipe keys --role ROLE NAME); the message was refused"
        )
    allowed = ROLE_KINDS.get(role)
    if allowed is None:
        raise RoleError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    if kind not in allowed:
        senders = [r for r, kinds in ROLE_KINDS.items() if kind in kinds]
        who = " or ".join(senders) if senders else "no participant"
        raise RoleError(
            f"a {role} key may not send {kind!r} (only {who} may); the message was refused"
        )


def default_role(name: str) -> Role:
    """The role a new key of this name gets: its own name for the coordinator and the
    client (``fl-client`` too, fl-client's default key), else stage (give other client
    keys their role with record_roles)."""
    if name == "coordinator":
        return "coordinator"
    if name in ("client", "fl-client"):
        return "client"
    return "stage"


def _roles_path(keys_dir: Path) -> Path:
    return Path(keys_dir) / ROLES_FILE


def _parse_role(text: str, where: str) -> Role:
    if text not in ROLES:
        raise SecurityError(f"{where}: unknown role {text!r}; use one of {', '.join(ROLES)}")
    return cast(Role, text)


def load_roles(keys_dir: str | os.PathLike[str]) -> dict[str, Role]:
    """NAME -> role from ``DIR/roles.txt``; empty when there is no such file."""
    path = _roles_path(Path(keys_dir))
    if not path.is_file():
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SecurityError(f"cannot read {path}: {exc}") from None
    roles: dict[str, Role] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.split("#", 1)[0].split()
        if not entry:
            continue
        where = f"{path}:{number}"
        if len(entry) != 2:
            raise SecurityError(f"{where}: expected 'NAME ROLE', got {line.strip()!r}")
        name, role = entry
        if name in roles:
            raise SecurityError(f"{where}: key {name!r} is given a role twice")
        roles[name] = _parse_role(role, where)
    return roles


def record_roles(keys_dir: str | os.PathLike[str], roles: Mapping[str, str]) -> Path:
    """Add or change the roles of these key names in ``DIR/roles.txt``; returns its path.

    ``zpipe keys`` calls it after making keys, e.g.
    ``record_roles(dir, {name: default_role(name) for name in names})``. Other
    names in the file keep their roles; the file is replaced atomically.
    """
    keys_dir = Path(keys_dir)
    updates = {
        validate_key_name(name): _parse_role(role, f"role of {name!r}")
        for name, role in roles.items()
    }
    merged = {**load_roles(keys_dir), **updates}
    lines = ["# zpipe key roles: NAME ROLE (client, stage or coordinator), one key per line"]
    lines += [f"{name} {role}" for name, role in sorted(merged.items())]
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(prefix=".roles-", dir=keys_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write("\n".join(lines) + "\n")
        os.chmod(scratch, 0o644)  # like the public keys: not a secret
        os.replace(scratch, _roles_path(keys_dir))
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise
    return _roles_path(keys_dir)


class KeyRoles:
    """Public key (Z85 bytes) -> role, for the keys of one key directory."""

    def __init__(self, keys: Mapping[str, bytes], roles: Mapping[str, Role]) -> None:
        unknown = sorted(set(roles) - set(keys))
        self.unlisted_roles = unknown  # roles of names with no NAME.key here (harmless)
        self._by_key: dict[bytes, tuple[str, Role | None]] = {
            key: (name, roles.get(name)) for name, key in keys.items()
        }

    @classmethod
    def from_dir(
        cls,
        keys_dir: str | os.PathLike[str],
        *,
        implied: Callable[[str], Role] = default_role,
    ) -> KeyRoles:
        """Every ``NAME.key`` of the directory with its role from ``roles.txt``; without
        that file, the role ``implied`` by each key's name (never every role)."""
        keys = load_public_keys(Path(keys_dir))
        if _roles_path(Path(keys_dir)).is_file():
            return cls(keys, load_roles(keys_dir))
        return cls(keys, {name: implied(name) for name in keys})

    def role_of(self, public_key: bytes | str | None) -> Role | None:
        """The role of a Z85 public key; None for a key without a recorded role (or an
        unknown key, or no key: an open cluster)."""
        if public_key is None:
            return None
        if isinstance(public_key, str):
            public_key = public_key.encode("ascii", "replace")
        entry = self._by_key.get(public_key)
        return None if entry is None else entry[1]

    def name_of(self, public_key: bytes) -> str | None:
        entry = self._by_key.get(public_key)
        return None if entry is None else entry[0]

    def without_role(self) -> list[str]:
        """Names of keys that ``roles.txt`` does not list: they may send nothing."""
        return sorted(name for name, role in self._by_key.values() if role is None)

    def check(self, kind: str, public_key: bytes | str | None) -> None:
        """check_role for the sender of `public_key` (see check_role)."""
        check_role(kind, self.role_of(public_key))

    def keys_with_role(self, role: Role) -> Iterable[bytes]:
        return [key for key, (_, r) in self._by_key.items() if r == role]


def generate_keys_with_roles(
    keys_dir: Path, names: Iterable[str], *, role: Role | None = None, overwrite: bool = False
) -> list[Path]:
    """generate_keys, then record each new key's role in ``DIR/roles.txt``.

    ``role``: the role of every name (e.g. "client" for a second client key);
    None gives each its default (``coordinator`` and ``client`` by name, else
    ``stage``). Returns the files written, the roles file last.
    """
    name_list = list(names)
    if role is not None and role not in ROLES:
        raise ConfigError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
    written = generate_keys(keys_dir, name_list, overwrite=overwrite)
    roles = {name: role or default_role(name) for name in name_list}
    return [*written, record_roles(keys_dir, roles)]
