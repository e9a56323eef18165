"""Standard logging controls zpipe's output; a local cluster runs inside an event loop."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from zpipe._errors import PipelineError
from zpipe.cluster import AsyncLocalCluster, DeviceSpec, LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence


def _run(script: str) -> subprocess.CompletedProcess[str]:
    # a fresh interpreter: logging and structlog are configured once per process
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_an_embedding_program_controls_zpipe_through_the_zpipe_logger() -> None:
    done = _run(
        """
        import json, logging, sys
        from zpipe.log import get_logger
        log = get_logger("zpipe.client")
        log.info("shown_by_default", n=1)
        logging.getLogger("zpipe").setLevel(logging.WARNING)
        log.info("hidden_by_level")
        log.warning("warned", n=2)
        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append([record.name, record.levelname, record.getMessage()])

        logging.getLogger("zpipe").addHandler(Keep())
        log.warning("to_the_programs_handler", n=3)
        logging.getLogger("zpipe").setLevel(logging.DEBUG)
        log.debug("debug_when_asked")
        print(json.dumps(records))
        """
    )
    err = done.stderr
    assert "shown_by_default" in err and "n=1" in err
    assert "hidden_by_level" not in err
    assert "warned" in err and "[WARNING] zpipe.client" in err
    # once the program has a handler of its own, zpipe's stderr default steps aside
    assert "to_the_programs_handler" not in err and "debug_when_asked" not in err
    records = json.loads(done.stdout)
    assert [r[:2] for r in records] == [["zpipe.client", "WARNING"], ["zpipe.client", "DEBUG"]]
    assert "to_the_programs_handler" in records[0][2] and "n=3" in records[0][2]


def test_a_root_handler_gets_zpipe_events_once() -> None:
    done = _run(
        """
        import logging, sys
        logging.basicConfig(stream=sys.stdout, format="ROOT %(name)s %(message)s")
        from zpipe.log import get_logger
        get_logger("zpipe.stage").info("through_the_root", x=1)
        """
    )
    assert done.stdout.count("through_the_root") == 1
    assert done.stdout.startswith("ROOT zpipe.stage through_the_root")
    assert "through_the_root" not in done.stderr


def test_a_zpipe_process_logs_json_lines_at_its_level() -> None:
    done = _run(
        """
        import logging
        from zpipe.log import configure_logging, get_logger
        configure_logging(log_format="json", level="info", stage="s0")
        log = get_logger("zpipe.stage")
        log.info("kept", mb=3)
        log.debug("below_the_level")
        logging.getLogger("zpipe").setLevel(logging.ERROR)
        log.warning("silenced")
        """
    )
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["event"] == "kept" and event["mb"] == 3 and event["stage"] == "s0"
    assert event["level"] == "info" and "timestamp" in event


def test_a_flood_of_drops_writes_a_few_lines_and_counts_the_rest() -> None:
    done = _run(
        """
        from zpipe.log import configure_logging, get_logger
        configure_logging(log_format="json", level="info")
        log = get_logger("zpipe.coordinator")
        for i in range(5000):
            log.warning("dropped_message", peer="mallory", error="junk")
        log.warning("dropped_message", peer="honest", error="junk")
        log.info("stage_registered", name="s0")
        """
    )
    events = [json.loads(line) for line in done.stderr.strip().splitlines()]
    mallory = [e for e in events if e.get("peer") == "mallory"]
    assert 1 <= len(mallory) <= 200  # a burst, then a few a second: not 5,000
    assert [e["peer"] for e in events if e["event"] == "dropped_message"][-1] == "honest"
    assert events[-1]["event"] == "stage_registered"


async def test_the_synchronous_cluster_says_what_to_use_inside_a_running_loop() -> None:
    cluster = LocalCluster(1)  # nothing is started: the call is refused first
    spec = ModelSpec("mlp", {"dims": [4, 4]}, seed=0)
    with pytest.raises(PipelineError, match="AsyncLocalCluster"):
        cluster.infer(spec, [(torch.zeros(1, 4),)])
    with pytest.raises(PipelineError, match="AsyncLocalCluster"):
        cluster.start()
    assert cluster.processes == {}


@pytest.mark.timeout(240)
async def test_an_async_cluster_runs_inside_the_running_loop() -> None:
    spec = ModelSpec("mlp", {"dims": [8, 16, 4]}, seed=4)
    sequence = load_layer_sequence(spec)
    batches = [sequence.example_input(4, seed=i) for i in range(2)]
    devices = [DeviceSpec("a"), DeviceSpec("b")]
    async with AsyncLocalCluster(devices, log_level="warning", measure_links=False) as cluster:
        outputs, report = await cluster.infer(spec, batches, microbatch_size=2, planner="even")
        train = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(2)]
        trained = await cluster.fit(
            spec,
            train,
            optimizer={"name": "sgd", "lr": 0.1},
            num_microbatches=2,
            partition=[[0, 1], [1, 2]],  # no planning: the test is about the loop
            progress=False,
        )
        processes = list(cluster.processes.values())
    assert report.microbatches == 4 and trained.steps == 2
    reference = build_full_model(spec)
    with torch.inference_mode():
        for batch, got in zip(batches, outputs, strict=True):
            torch.testing.assert_close(got[0], reference(*batch)[0], atol=1e-5, rtol=1e-4)
    # leaving the block stopped every process
    assert all(p.poll() is not None for p in processes)
