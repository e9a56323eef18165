"""A live re-partition that fails because a stage died ends the attempt with that
death whenever the fit recovers, a fast recovery (no replica period) included
(zpipe.client.runs.async_repartition.repartition_before); without recovery the
failure is the fit's. In-process: a stub run whose coordinator answers the look
with an error."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from zpipe._errors import PipelineError, StageFailedError
from zpipe.client.runs.async_repartition import repartition_before
from zpipe.protocol.repartition import Repartitioned


def _run(*, recovers: bool, replicate_every: int | None, died: bool) -> Any:
    async def ask(*_args: Any, **_kw: Any) -> Repartitioned:
        return Repartitioned(run=1, step=8, error="StageLostError: b is gone")

    async def stage_failure_within(_timeout_s: float) -> StageFailedError | None:
        return StageFailedError("b", "gone") if died else None

    session = SimpleNamespace(
        control=SimpleNamespace(ask=ask), stage_failure_within=stage_failure_within
    )
    return SimpleNamespace(
        run=1,
        offset=0,
        session=session,
        timeouts=SimpleNamespace(result_s=1.0, reply_s=0.1),
        replicate_every=replicate_every,
        attempts=SimpleNamespace(recovers=recovers),
    )


def test_a_fast_recovering_fit_ends_the_attempt_with_the_death() -> None:
    run = _run(recovers=True, replicate_every=None, died=True)  # fast: no replica period
    with pytest.raises(StageFailedError):
        asyncio.run(repartition_before(run, 8))


def test_an_exact_recovering_fit_ends_the_attempt_with_the_death() -> None:
    run = _run(recovers=True, replicate_every=4, died=True)
    with pytest.raises(StageFailedError):
        asyncio.run(repartition_before(run, 8))


def test_without_recovery_or_without_a_death_the_failure_is_the_fits() -> None:
    for run in (
        _run(recovers=False, replicate_every=None, died=True),
        _run(recovers=True, replicate_every=None, died=False),
    ):
        with pytest.raises(PipelineError, match="re-partition before mini-batch 8 failed"):
            asyncio.run(repartition_before(run, 8))
