"""What a generation stage sends and whom it lets send to it, built from its set-up.

Pure (no sockets, no asyncio), so that
:class:`~zpipe.stage.executors.generation.GenerationExecutor` only moves these
messages and each can be checked alone: the keys a stage allows before any peer
connects, the first stage's scheduler, what goes downstream after a step, and what a
failed step becomes at the stage that failed it and at the first stage.
"""

from __future__ import annotations

from zpipe._errors import ProtocolError
from zpipe.generation.refusals import STAGE_FAILED
from zpipe.generation.sequences import SchedulerLimits, SequenceScheduler
from zpipe.generation.stopping import Detokenizer, eos_ids_from
from zpipe.protocol.generation import GenRefused, GenSetup, GenStep, GenStepFailed, GenTokens
from zpipe.stage.executors.generation_steps import StepOut

CLIENT = "client"  # the run's name for the client (its ``src`` and its sink's key)


def sender_keys(setup: GenSetup) -> dict[str, bytes]:
    """The CURVE keys of whoever sends to this stage, by their name in the run: its
    upstream, and at the first stage the client too. A set-up that leaves one out is
    refused (a refused CURVE handshake is not retried, so none may be missing)."""
    keys: dict[str, bytes] = {}
    if setup.upstream:
        if not setup.upstream_key:
            raise ProtocolError(f"gen_setup: no key for upstream {setup.upstream!r}")
        keys[setup.upstream] = setup.upstream_key.encode()
    if setup.index == 0:
        if not setup.client_key:
            raise ProtocolError("gen_setup: no key for the client")
        keys[CLIENT] = setup.client_key.encode()
    return keys


def first_stage_scheduler(
    setup: GenSetup, detokenizer: Detokenizer | None = None
) -> SequenceScheduler:
    """The run's scheduler, which the first stage runs: the set-up's limits, and the
    model's end-of-sequence ids (a sequence that asks stops at one)."""
    limits = SchedulerLimits(
        steps_in_flight=setup.steps_in_flight,
        max_sequences=setup.max_sequences,
        chunk_tokens=setup.chunk_tokens,
        kv_budget=setup.kv_budget_tokens,
        max_context=setup.max_context,
    )
    eos = eos_ids_from(setup.model.get("config", {}).get("eos_token_id"))
    return SequenceScheduler(limits, eos_ids=eos, detokenizer=detokenizer)


def after_step(setup: GenSetup, step: GenStep, out: StepOut, src: str) -> GenStep | GenTokens:
    """What a stage that is not alone in the ring sends after ``step``: its hidden
    states to the next stage, or at the last stage the sampled tokens round the ring
    to the first."""
    if setup.index < setup.num_stages - 1:
        assert out.values is not None
        return GenStep(
            run=setup.run,
            step=step.step,
            src=src,
            rows=step.rows,
            sampling=step.sampling,
            tensors=(out.values,),
            epoch=setup.epoch,
        )
    return GenTokens(
        run=setup.run, step=step.step, src=src, tokens=list(out.tokens), epoch=setup.epoch
    )


def failed_step(setup: GenSetup, step: GenStep, src: str, error: str) -> GenStepFailed:
    """A step this stage could not compute, to pass round the ring: its sequences end,
    the run's others go on."""
    sequences = [row[0] for row in step.rows if isinstance(row, list) and row]
    return GenStepFailed(
        run=setup.run,
        step=step.step,
        src=src,
        stage=src,
        error=error,
        sequences=sequences,
        epoch=setup.epoch,
    )


def refusals_for(
    setup: GenSetup, failed: GenStepFailed, sequences: list[int], src: str
) -> list[GenRefused]:
    """The first stage's word to the client for each of a failed step's ``sequences``."""
    return [
        GenRefused(
            run=setup.run,
            sequence=sequence,
            src=src,
            error=f"step {failed.step} failed at stage {failed.stage}: {failed.error}",
            kind=STAGE_FAILED,
            epoch=setup.epoch,
        )
        for sequence in sequences
    ]
