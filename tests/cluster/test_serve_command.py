"""``python -m zpipe serve`` as a process: it loads a checkpoint directory, reports
its URL, answers the official openai client and exits cleanly on SIGTERM (what
it refuses is checked in-process: tests/unit/cli/test_serve_cli.py)."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")

from tests._support.serve import tiny_lm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _read_url(proc: subprocess.Popen[str], timeout: float) -> str:
    """The URL from the line the command prints once it listens."""
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        if not selector.select(timeout=1.0):
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if " at http://" in line:
            return line.rsplit(" at ", 1)[1].strip()
    raise AssertionError(f"zpipe serve printed no URL within {timeout} s: {seen!r}")


def test_serve_answers_the_openai_client_and_stops_on_sigterm(tmp_path) -> None:
    checkpoint = tiny_lm(tmp_path / "tiny-lm", family="llama")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zpipe",
            "serve",
            "--model",
            str(checkpoint),
            "--port",
            "0",
            "--model-name",
            "home-lm",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
    )
    try:
        url = _read_url(proc, timeout=120)
        with openai.OpenAI(base_url=url, api_key="unused", timeout=60, max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == ["home-lm"]
            messages = [{"role": "user", "content": "hello"}]
            whole = client.chat.completions.create(
                model="home-lm", messages=messages, max_tokens=12, temperature=0
            )
            stream = client.chat.completions.create(
                model="home-lm", messages=messages, max_tokens=12, temperature=0, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text == whole.choices[0].message.content
            assert whole.usage.completion_tokens >= 1
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model="other", messages=messages)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_serve_through_a_cluster_answers_and_closes_its_run_on_sigterm(
    tmp_path: Path, cluster: Any
) -> None:
    """``--coordinator``: the command starts the run on the session cluster's three
    stages before it prints its URL, answers the client, and on SIGTERM closes
    the run (every stage logs its close) and exits 0."""
    checkpoint = tiny_lm(tmp_path / "tiny-lm")
    closed_before = {s: _closes(cluster, s) for s in STAGES}
    errors_path = tmp_path / "serve.err"  # read when serve does not answer
    errors = errors_path.open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zpipe",
            "serve",
            "--model",
            str(checkpoint),
            "--port",
            "0",
            "--coordinator",
            cluster.coordinator_endpoint,
            "--stages",
            "3",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
        env=_env(),
    )
    try:
        url = _read_url(proc, timeout=300)
        with openai.OpenAI(base_url=url, api_key="unused", timeout=120, max_retries=0) as client:
            messages = [{"role": "user", "content": "hello"}]
            try:
                whole = client.chat.completions.create(
                    model="tiny-lm", messages=messages, max_tokens=12, temperature=0
                )
            except openai.APIConnectionError as exc:  # say why serve is not there
                raise AssertionError(
                    f"serve (exit {proc.poll()}) did not answer: {errors_path.read_text()[-4000:]}"
                ) from exc
            stream = client.chat.completions.create(
                model="tiny-lm", messages=messages, max_tokens=12, temperature=0, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text == whole.choices[0].message.content
            assert whole.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        errors.close()
    deadline = time.monotonic() + 60
    while any(_closes(cluster, s) == closed_before[s] for s in STAGES):
        assert time.monotonic() < deadline, "the stages did not close the run"
        time.sleep(0.2)


STAGES = ["s0", "s1", "s2"]


def _closes(cluster: Any, stage: str) -> int:
    return cluster.logs(stage).count('"event": "generation_closed"')
