"""Processes launched from a zygote are this process's own: it reads their exit
status (a code, argparse's error, a signal), their output goes to their log, they
run in the environment and folder they were launched with, and they watch this
process as their parent. A cluster launched that way runs exactly."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from zpipe.cluster import LocalCluster
from zpipe.cluster.forked import ForkedStage
from zpipe.cluster.zygote import Zygote, zygote_available
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence

pytestmark = pytest.mark.skipif(not zygote_available(), reason="needs Linux's child subreapers")
SPEC = ModelSpec("mlp", {"dims": [8, 16, 4]}, seed=3)


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    made = Zygote()
    yield made
    made.close()


def test_a_launched_command_exits_with_its_own_status_and_writes_its_log(
    zygote: Zygote, tmp_path: Path
) -> None:
    log = tmp_path / "bad.log"
    process = zygote.launch("zpipe.stage", ["--coordinator", "not-an-endpoint"], log,
                            env=dict(os.environ))  # fmt: skip
    assert process.wait(timeout=120) == 2  # argparse's usage error, in the child
    assert "--coordinator" in log.read_text()
    helped = zygote.launch("zpipe.coordinator", ["--help"], tmp_path / "help.log",
                           env=dict(os.environ))  # fmt: skip
    assert helped.wait(timeout=120) == 0
    assert "--bind" in (tmp_path / "help.log").read_text()


def test_a_launched_stage_is_ours_to_signal_and_watches_us_as_its_parent(
    zygote: Zygote, tmp_path: Path
) -> None:
    # a stage that waits for a coordinator nobody runs; its parent watch names us: were
    # it still the zygote's middle process's child, it would leave at once (exit 0)
    log = tmp_path / "stage.log"
    env = dict(os.environ)
    process = zygote.launch(
        "zpipe.stage",
        ["--coordinator", "tcp://127.0.0.1:9", "--name", "s", "--parent-pid", str(os.getpid())],
        log,
        env=env,
        cwd=str(tmp_path),
    )
    # it moves to its folder as it starts (a poll with a deadline: a loaded machine
    # may take a while to schedule it)
    deadline = time.monotonic() + 60
    while os.readlink(f"/proc/{process.pid}/cwd") != str(tmp_path):
        assert time.monotonic() < deadline, "the launched stage never moved to its folder"
        threading.Event().wait(0.05)
    assert process.poll() is None
    assert int(Path(f"/proc/{process.pid}/stat").read_text().split()[3]) == os.getpid()
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL


def test_a_cluster_from_a_zygote_infers_exactly(tmp_path: Path) -> None:
    batches = [load_layer_sequence(SPEC).example_input(4, seed=i) for i in range(3)]
    with LocalCluster(2, zygote=True, log_dir=tmp_path) as cluster:
        assert all(isinstance(p, ForkedStage) for p in cluster.processes.values())
        outputs, _ = cluster.infer(SPEC, batches, partition=[[0, 1], [1, 2]])
        stage = cluster.processes["stage0"]
        assert int(Path(f"/proc/{stage.pid}/stat").read_text().split()[3]) == os.getpid()
    with torch.inference_mode():
        model = build_full_model(SPEC)
        for got, inputs in zip(outputs, batches, strict=True):
            torch.testing.assert_close(got[0], model(*inputs)[0])
