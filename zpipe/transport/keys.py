"""Key files: CURVE key pairs in pyzmq's certificate format, one pair a participant.

::

    DIR/NAME.key          public key  (safe to copy anywhere)
    DIR/NAME.key_secret   public + secret key (mode 0600, stays on device NAME)

Loading checks names, file modes and key lengths and says how to make a missing
key; :mod:`zpipe.transport.security` uses the keys, :mod:`zpipe.transport.roles`
records what each may send.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import zmq.auth
from zmq.utils import z85

from zpipe._errors import ConfigError, SecurityError

log = structlog.get_logger("zpipe.security")

COORDINATOR_KEY_NAME = "coordinator"
CLIENT_KEY_NAME = "client"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"

# A leading dot is refused because zmq.auth.load_certificates (glob) skips hidden
# files, so such a key would silently be missing from an allow-list.
_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
Z85_KEY_LEN = 40  # a 32-byte CURVE key in Z85 text
_KEYS_HINT = "python -m zpipe keys --dir {dir} {name}"


def validate_key_name(name: str) -> str:
    """Return ``name`` if it can name a key pair, else raise :class:`ConfigError`."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(
            f"invalid key name {name!r}: use letters, digits, '-', '_' and '.', "
            "not starting with '.' (it names the files NAME.key and NAME.key_secret)"
        )
    return name


def key_prefix(key: bytes) -> str:
    """First characters of a Z85 public key: enough to tell keys apart in logs."""
    return key[:8].decode("ascii", "replace")


def check_z85_key(key: bytes, what: str) -> bytes:
    """Return ``key`` if it is a Z85-encoded 32-byte CURVE key, else raise SecurityError."""
    if isinstance(key, str):
        key = key.encode("ascii", "replace")
    if not isinstance(key, bytes) or len(key) != Z85_KEY_LEN:
        raise SecurityError(
            f"{what} is not a CURVE key ({Z85_KEY_LEN} Z85 characters); "
            "regenerate it with `python -m zpipe keys`"
        )
    try:
        z85.decode(key)
    except (ValueError, KeyError, IndexError, struct.error) as exc:
        raise SecurityError(
            f"{what} is not valid Z85 text; regenerate it with `python -m zpipe keys`"
        ) from exc
    return key


# --------------------------------------------------------------------------- key files


@dataclass(frozen=True)
class KeyPair:
    """A participant's CURVE key pair, both keys Z85-encoded (40 bytes)."""

    name: str
    public: bytes
    secret: bytes = field(repr=False)  # never end up in a log line or traceback


def _key_files(keys_dir: Path, name: str) -> tuple[Path, Path]:
    return keys_dir / f"{name}{PUBLIC_SUFFIX}", keys_dir / f"{name}{SECRET_SUFFIX}"


def generate_keys(keys_dir: Path, names: Iterable[str], *, overwrite: bool = False) -> list[Path]:
    """Create a key pair per name in ``keys_dir`` and return the files written.

    ``keys_dir`` is created with mode 0700 when missing; secret files get mode 0600.
    Nothing is written unless every name is valid and, without ``overwrite``, none of
    them has a key file yet: replacing a key locks out every device still using it.
    """
    keys_dir = Path(keys_dir)
    name_list = [validate_key_name(n) for n in names]
    if not name_list:
        raise ConfigError("no key names given: name at least one participant")
    seen: set[str] = set()
    for name in name_list:
        if name in seen:
            raise ConfigError(f"key name {name!r} given twice")
        seen.add(name)
    if keys_dir.exists() and not keys_dir.is_dir():
        raise ConfigError(f"{keys_dir} exists and is not a directory; pick another --dir")

    if not overwrite and keys_dir.is_dir():
        existing = [
            str(path) for name in name_list for path in _key_files(keys_dir, name) if path.exists()
        ]
        if existing:
            raise ConfigError(
                "refusing to replace existing keys: " + ", ".join(existing) + "; "
                "pass --overwrite (overwrite=True) to replace them, then copy the new "
                "keys to every device that uses them"
            )

    if not keys_dir.exists():
        keys_dir.mkdir(mode=0o700, parents=True)
        # mkdir's mode is filtered by the umask; set it exactly.
        keys_dir.chmod(0o700)

    written: list[Path] = []
    for name in name_list:
        public_path, secret_path = _key_files(keys_dir, name)
        # Create each pair in a private (0700) scratch directory and move it in, so a
        # secret is never visible with pyzmq's default (umask) permissions and an
        # overwrite replaces a whole file atomically.
        scratch = Path(tempfile.mkdtemp(prefix=".zpipe-keys-", dir=keys_dir))
        try:
            zmq.auth.create_certificates(scratch, name)
            new_public, new_secret = _key_files(scratch, name)
            new_secret.chmod(0o600)
            new_public.chmod(0o644)  # public keys are meant to be copied around
            os.replace(new_secret, secret_path)
            os.replace(new_public, public_path)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        written += [public_path, secret_path]
    return written


def load_keypair(keys_dir: Path, name: str) -> KeyPair:
    """Load ``NAME.key_secret`` from ``keys_dir``; raise SecurityError if it is unusable."""
    keys_dir = Path(keys_dir)
    validate_key_name(name)
    _, secret_path = _key_files(keys_dir, name)
    hint = _KEYS_HINT.format(dir=keys_dir, name=name)
    if not secret_path.is_file():
        raise SecurityError(
            f"no secret key for {name!r}: {secret_path} does not exist; create it with "
            f"`{hint}` (or copy it from the machine where the keys were made)"
        )
    try:
        public, secret = zmq.auth.load_certificate(secret_path)
    except (OSError, ValueError) as exc:
        raise SecurityError(
            f"cannot read key file {secret_path}: {exc}; regenerate it with `{hint} --overwrite`"
        ) from exc
    if not secret:
        raise SecurityError(
            f"{secret_path} holds no secret-key line; regenerate it with `{hint} --overwrite`"
        )
    public = check_z85_key(public, f"public key in {secret_path}")
    secret = check_z85_key(secret, f"secret key in {secret_path}")
    if zmq.curve_public(secret) != public:
        raise SecurityError(
            f"{secret_path}: the public key does not belong to the secret key (edited or "
            f"corrupted file); regenerate it with `{hint} --overwrite`"
        )
    mode = secret_path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # Warn rather than refuse: some filesystems (FAT on SD cards) cannot hold modes.
        log.warning(
            "secret_key_exposed",
            path=str(secret_path),
            mode=oct(stat.S_IMODE(mode)),
            fix=f"chmod 600 {secret_path}",
        )
    return KeyPair(name=name, public=public, secret=secret)


def load_keypair_public(keys_dir: Path, name: str) -> bytes:
    """The Z85 public key of participant ``name``: what a client needs of its server.

    Reads ``NAME.key``; on the machine that owns the pair, ``NAME.key_secret`` (which
    holds the public key too) is used when ``NAME.key`` is absent.
    """
    keys_dir = Path(keys_dir)
    validate_key_name(name)
    public_path, secret_path = _key_files(keys_dir, name)
    path = public_path if public_path.is_file() or not secret_path.is_file() else secret_path
    if not path.is_file():
        raise SecurityError(
            f"no public key for {name!r}: {public_path} does not exist; copy {public_path.name} "
            "from the key directory where it was made "
            f"(`{_KEYS_HINT.format(dir='DIR', name=name)}`)"
        )
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SecurityError(
            f"cannot read public key file {path}: {exc}; copy a fresh {public_path.name} "
            "from the key directory where it was made"
        ) from exc
    return check_z85_key(public, f"public key in {path}")


def load_public_keys(keys_dir: Path) -> dict[str, bytes]:
    """Map NAME to the public key of every ``NAME.key`` in ``keys_dir``.

    This is the coordinator's allow-list: every public key in the directory is trusted,
    so an administrator removes a device by deleting its ``NAME.key``. Secret files
    are not needed here. An empty directory gives an empty dict (nobody may connect).
    """
    keys_dir = Path(keys_dir)
    if not keys_dir.is_dir():
        raise SecurityError(
            f"key directory {keys_dir} does not exist; create keys with "
            f"`{_KEYS_HINT.format(dir=keys_dir, name='coordinator client STAGE ...')}`"
        )
    keys: dict[str, bytes] = {}
    for path in sorted(keys_dir.glob(f"*{PUBLIC_SUFFIX}")):
        # Same rule as zmq.auth.load_certificates: hidden files are not keys.
        if path.name.startswith(".") or not path.is_file():
            continue
        name = path.name[: -len(PUBLIC_SUFFIX)]
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise SecurityError(
                f"cannot read public key file {path}: {exc}; delete it or regenerate it "
                f"with `{_KEYS_HINT.format(dir=keys_dir, name=name)} --overwrite`"
            ) from exc
        keys[name] = check_z85_key(public, f"public key in {path}")
    return keys


# ------------------------------------------------------------------------- allow-list
