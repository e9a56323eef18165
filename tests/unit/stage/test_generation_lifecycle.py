"""The stage's lifecycle hands a generation run's set-up to the generation executor,
and only the coordinator's set-up: the run's data kinds never reach it."""

from __future__ import annotations

from zpipe.models import ModelSpec
from zpipe.protocol.generation import GenSetup, GenStep
from zpipe.protocol.stage_control import Register, Registered
from zpipe.stage.commands import DropMessage, GenerationControl
from zpipe.stage.lifecycle import StageLifecycle


def _registered() -> StageLifecycle:
    stage = StageLifecycle(
        name="s0",
        coordinator="tcp://127.0.0.1:4000",
        registration=Register(name="s0", data_endpoint="tcp://127.0.0.1:5000", info={}),
        connect_s=15.0,
        silence_limit_s=10.0,
        now=0.0,
    )
    stage.registration_reply(Registered(name="s0", heartbeat_interval=1.0), 0.0)
    return stage


def test_a_generation_setup_goes_to_the_generation_executor() -> None:
    setup = GenSetup(
        run=3, model=ModelSpec.preset("gpt2-tiny").to_dict(), start=0, end=2, index=0,
        num_stages=2, upstream="s1", downstream="s1", max_context=32, max_sequences=2,
        steps_in_flight=2, chunk_tokens=8, sink_endpoint="tcp://client:9", epoch=4,
    )  # fmt: skip
    assert _registered().control_message(setup, 1.0) == [GenerationControl(setup)]


def test_a_step_on_the_control_socket_is_dropped() -> None:
    step = GenStep(run=3, step=0, src="s1", rows=[[1, 0, 1, 0, 4]], sampling=[[0.0, 0, 1.0, 0]])
    (command,) = _registered().control_message(step, 1.0)
    assert isinstance(command, DropMessage) and "gen_step" in command.reason
