"""Helpers shared by the test lanes (``from tests._support.X import ...``).

Test modules are imported with ``--import-mode=importlib`` and cannot import one
another: whatever two test files share lives here.
"""

from pathlib import Path

# the folder of this package: golden files (protocol_v1.json) lie beside the helpers
SUPPORT_DIR = Path(__file__).resolve().parent
# the repository root (bench/, zpipe/, pyproject.toml), wherever a test file lies
REPO_ROOT = SUPPORT_DIR.parents[1]
