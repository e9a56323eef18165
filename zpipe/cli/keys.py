"""``python -m zpipe keys``: create the CURVE key pairs that admit devices to a cluster."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zpipe._errors import ConfigError
from zpipe.transport.roles import ROLES, ROLES_FILE, generate_keys_with_roles
from zpipe.transport.security import (
    CLIENT_KEY_NAME,
    COORDINATOR_KEY_NAME,
    PUBLIC_SUFFIX,
    SECRET_SUFFIX,
)

_DESCRIPTION = f"""\
Create a CURVE key pair for each NAME in DIR, for use with --keys DIR.

For every NAME two files are written:
  DIR/NAME{PUBLIC_SUFFIX}          the public key; safe to copy anywhere
  DIR/NAME{SECRET_SUFFIX}   public and secret key (mode 0600); keep it on device NAME only

Name the coordinator '{COORDINATOR_KEY_NAME}', the program that embeds the zpipe API
'{CLIENT_KEY_NAME}', and each stage by its stage name.

The coordinator trusts every NAME{PUBLIC_SUFFIX} file in its DIR: that directory is the
allow-list. To admit a device, put its public key there; to remove one, delete its
NAME{PUBLIC_SUFFIX} and restart the coordinator.

A device needs only its own NAME{SECRET_SUFFIX} plus {COORDINATOR_KEY_NAME}{PUBLIC_SUFFIX}
in its DIR; the coordinator tells each stage which peers to accept.

Each key's role is recorded in DIR/{ROLES_FILE} ('NAME ROLE' lines): '{COORDINATOR_KEY_NAME}'
and '{CLIENT_KEY_NAME}' (and 'fl-client') by name, every other NAME a stage, unless --role
says otherwise (a second client key: --role client). The coordinator lets only client keys
start runs and read the cluster, and only stage keys register; fl-server lets only client
keys act as federated clients; a key the file does not list may send nothing (a DIR
without the file: each key has the role its name implies, never every role).
"""

_EPILOG = f"""\
example:
  python -m zpipe keys --dir ./keys {COORDINATOR_KEY_NAME} {CLIENT_KEY_NAME} stage0 stage1
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zpipe keys",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dir",
        required=True,
        type=Path,
        metavar="DIR",
        help="key directory (created with mode 0700 if missing)",
    )
    parser.add_argument(
        "names",
        nargs="+",
        metavar="NAME",
        help="participant names: letters, digits, '-', '_' and '.'",
    )
    parser.add_argument(
        "--role",
        choices=ROLES,
        default=None,
        help="the role of every NAME (default: coordinator and client by name, else stage)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace existing key pairs (devices still holding the old keys are locked out)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the keys command; returns the exit status (argparse exits 2 on bad flags)."""
    args = _parser().parse_args(argv)
    try:
        written = generate_keys_with_roles(
            args.dir, args.names, role=args.role, overwrite=args.overwrite
        )
    except ConfigError as exc:
        print(f"zpipe keys: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"zpipe keys: error: cannot write keys to {args.dir}: {exc}", file=sys.stderr)
        return 1
    for path in written:
        if path.name.endswith(SECRET_SUFFIX):
            name = path.name[: -len(SECRET_SUFFIX)]
            print(f"wrote {path}  (secret: copy only to device {name!r})")
        elif path.name == ROLES_FILE:
            print(f"wrote {path}  (roles: {args.role or 'by name'})")
        else:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
