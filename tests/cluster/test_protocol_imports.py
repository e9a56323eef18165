"""The protocol's registry in a fresh interpreter: every message kind is registered by
importing the codec alone (split from tests/unit/protocol/test_protocol.py, which starts
no process)."""

from __future__ import annotations

import subprocess
import sys


def test_kinds_are_registered_without_importing_their_users() -> None:
    # The lossy kinds once appeared only after zpipe.lossy.wire was imported.
    script = (
        "import sys; from zpipe.transport import codec; "
        "assert 'lossy_partial' in codec.SCHEMAS and 'lossy_setup' in codec.TENSOR_KINDS; "
        "assert 'zpipe.lossy' not in sys.modules, 'the codec imported zpipe.lossy'"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
