"""Helpers shared by tests (moved from test_coordinator_restore.py)."""

from __future__ import annotations

from typing import Any

import torch

from tests._support.coordinator_harness import SPEC, Harness
from zpipe.transport.codec import Message

TRAIN = {"num_microbatches": 3, "optimizer": {"name": "sgd", "lr": 0.1}}
NAMES = ["a", "b", "c"]
PARTITION = [[0, 2], [2, 4], [4, 6]]
UNITS = {"a": range(0, 2), "b": range(2, 4), "c": range(4, 6)}


def _request(h: Harness, **request: Any) -> None:
    h.client(
        "run_request", model=SPEC.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, mode="train", train=TRAIN, recover=True, **request,
    )  # fmt: skip


def _start_chain_run(h: Harness) -> int:
    for name in NAMES:
        h.register(name)
    _request(h, stage_names=NAMES, partition=PARTITION, replication="chain")
    run = h.core.run
    assert run is not None
    h.answer_all("ready", list(run.devices), run=run.run, build_s=0.01)
    h.client("run_go", run=run.run)
    h.answer_all("connected", list(run.devices), run=run.run)
    return run.run


def _state(name: str, units: range, value: float) -> tuple[list[str], tuple[torch.Tensor, ...]]:
    keys = [f"units.{u}.weight" for u in units]
    return keys, tuple(torch.full((2,), value + u) for u in units)


def _replicate(h: Harness, run: int, step: int, *, global_copy: bool) -> Message:
    before = {n: len(h.to(n, "weights_request")) for n in NAMES}
    h.client("replicate", run=run, step=step, **({"global": True} if global_copy else {}))
    for name in NAMES:
        # c backs up to the coordinator: its units come in the reply
        keys, tensors = _state(name, UNITS[name], step) if name == "c" else ([], ())
        body = {"name": name, "keys": keys, "error": "", "step": step, "run": run}
        body.update(holder="", bytes=0)
        h.feed_message(name, Message("backed_up", body, tensors=tensors))
    asked = {n: len(h.to(n, "weights_request")) - before[n] for n in NAMES}
    assert asked == {n: int(global_copy) for n in NAMES}
    if global_copy:
        for name in NAMES:
            keys, tensors = _state(name, UNITS[name], step)
            body = {"name": name, "keys": keys, "error": "", "step": step, "run": run}
            h.feed_message(name, Message("weights", body, tensors=tensors))
    return h.to_client("replicated")[-1]
