"""Every bench runs both as ``python bench/NAME.py`` and as ``python -m bench.NAME``.

An entry is a ``bench/*.py`` with a ``__main__`` block; it is run with
``--help`` (which imports the whole module, then exits 0) both ways. Every
other module of ``bench/`` (the ``_private`` helpers and the sections that
entries import) must import as ``bench.NAME``.

Importing torch dominates the cost, so one fresh interpreter (this file, run as
a script) does every check, with :mod:`runpy` and the ``sys.path`` each way of
running gives: ``python bench/NAME.py`` puts ``bench/`` first and not the
repository, so ``bench`` is importable only if the entry makes it so; ``python
-m bench.NAME`` puts the current directory (the repository) first. ``zpipe``
stays importable either way, as an installed package is, through a directory
that holds only a link to it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

# the repository: the folder above this file that holds pyproject.toml (this file also
# runs as a script, without tests/ importable)
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
BENCH = ROOT / "bench"


def bench_modules() -> tuple[list[str], list[str]]:
    """(entries, the other modules) of bench/, by name."""
    entries: list[str] = []
    others: list[str] = []
    for path in sorted(BENCH.glob("*.py")):
        if path.stem == "__init__":
            continue
        is_entry = 'if __name__ == "__main__":' in path.read_text()
        (entries if is_entry else others).append(path.stem)
    return entries, others


def _forget_bench() -> None:
    for name in [m for m in sys.modules if m == "bench" or m.startswith("bench.")]:
        del sys.modules[name]


def _run_help(name: str, mode: str, base_path: list[str]) -> str | None:
    """Why ``--help`` failed, run the ``mode`` way; None when it exited 0."""
    saved_path, saved_argv = sys.path[:], sys.argv[:]
    _forget_bench()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if mode == "script":
                sys.path[:] = [str(BENCH), *base_path]
                sys.argv = [str(BENCH / f"{name}.py"), "--help"]
                runpy.run_path(sys.argv[0], run_name="__main__")
            else:
                sys.path[:] = [str(ROOT), *base_path]
                sys.argv = ["-m", "--help"]  # runpy puts the module's path first
                runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return None if exc.code in (0, None) else f"exit status {exc.code}"
    except BaseException:
        return traceback.format_exc(limit=-4)
    finally:
        sys.path[:], sys.argv = saved_path, saved_argv
    return "--help returned instead of exiting"


def check_all() -> dict[str, str]:
    """Every failure, as 'how name' -> why (empty: every bench runs both ways)."""
    import zpipe  # noqa: F401  (through PYTHONPATH: the link, never the repository)

    base_path = [p for p in sys.path if p and Path(p).resolve() != ROOT]
    entries, others = bench_modules()
    failures: dict[str, str] = {}
    for name in entries:
        for mode, how in (("script", f"bench/{name}.py"), ("module", f"-m bench.{name}")):
            why = _run_help(name, mode, base_path)
            if why is not None:
                failures[f"python {how}"] = why
    for name in others:
        _forget_bench()
        sys.path[:] = [str(ROOT), *base_path]
        try:
            importlib.import_module(f"bench.{name}")
        except BaseException:
            failures[f"import bench.{name}"] = traceback.format_exc(limit=-4)
    return failures


def test_every_bench_runs_as_a_script_and_as_a_module(tmp_path: Path) -> None:
    entries, _ = bench_modules()
    assert "training_async" in entries and "inference" in entries
    (tmp_path / "zpipe").symlink_to(ROOT / "zpipe", target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    failures = json.loads(result.stdout.strip().splitlines()[-1])
    assert failures == {}, "\n".join(f"{how}:\n{why}" for how, why in failures.items())


if __name__ == "__main__":
    print(json.dumps(check_all()))
