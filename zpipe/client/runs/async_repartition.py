"""The client's part in a live re-partition (FTPipeHD III-D): pause, ask, go on.

Before each mini-batch the run's :class:`~zpipe.training.repartition.
RepartitionSettings` name, the coordinator looks first while the pipeline runs
(``look``: the stages' counters as they are). Only when the cuts move does the
feed stop: the run kind's ``pause_feed`` (an asynchronous run sends its ``end``
marker, so the stages flush), then every loss in flight comes back, then the
coordinator has the stages move units between them and commit
(:mod:`zpipe.coordinator.runs.async_repartition`). The feed goes on from the same
mini-batch; what the look found is kept in ``TrainReport.repartitions``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from zpipe._errors import PipelineError, ProtocolError, TransportTimeout
from zpipe.client.runs.training_events import SpeedNoticed
from zpipe.log import get_logger
from zpipe.protocol.repartition import Repartition, Repartitioned, SpeedChanged

if TYPE_CHECKING:
    from zpipe.client.runs.sync_training import TrainingRun

log = get_logger("zpipe.client")


async def repartition_before(run: TrainingRun, step: int) -> bool:
    """Have the coordinator look before mini-batch ``step`` (of the whole fit), pausing
    ``run`` only when the cuts move: the look itself reads the stages' counters while
    the pipeline runs, so a look that keeps the cuts costs no flush (the pipeline's
    drain and fill, most of a look's pause). Whether units moved.

    With recovery on, a re-partition that fails because a stage died ends the attempt
    with that death (the run recovers from its last replica, or fast from the live
    copies), not with the failure."""
    try:
        reply = await _ask(run, step, look=True)
        if not reply.pause:
            return _record(run, step, reply)
        await run.pause_feed()
        await run.drain_losses("a re-partition")
        return _record(run, step, await _ask(run, step, look=False))
    except (PipelineError, TransportTimeout):
        # a fast recovery keeps no replica (replicate_every None) but recovers too
        if not run.attempts.recovers:
            raise
        # the coordinator's word of a death may follow the failed phase it caused
        failure = await run.session.stage_failure_within(run.timeouts.reply_s)
        if failure is None:
            raise
        raise failure from None


async def _ask(run: TrainingRun, step: int, *, look: bool) -> Repartitioned:
    # the stages number the mini-batches of this attempt from 0 (a resumed run's too)
    local = step - run.offset
    reply = await run.session.control.ask(
        Repartition(run=run.run, step=local, look=True if look else None),
        expect=(Repartitioned,),
        # a flush, the stages' fetches and the commit, each within result_s
        timeout_s=3 * run.timeouts.result_s + run.timeouts.reply_s,
        awaited="the re-partition's look" if look else "the re-partition",
        resend_on_reconnect=True,
        progress_run=run.run,
    )
    if reply.error:
        # the stages may be paused at a cut they cannot leave: the run ends here
        raise PipelineError(f"the re-partition before mini-batch {step} failed: {reply.error}")
    return reply


def predicted_period(looks: list[dict[str, Any]]) -> float | None:
    """The period per mini-batch the newest look predicted for the cuts it moved to
    (its ``new_period_s``); None when it did not move or did not say."""
    if not looks or not looks[-1].get("moved"):
        return None
    value = looks[-1].get("new_period_s")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def looked_epoch(looks: list[dict[str, Any]]) -> int | None:
    """The cuts' plan epoch after the newest look (None: not said)."""
    value = looks[-1].get("plan_epoch") if looks else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def room_or_verdict(run: TrainingRun) -> list[SpeedNoticed]:
    """Wait until ``run``'s window has room for the next mini-batch or a stage's speed
    verdict comes, whichever first; the verdicts so far, as events.

    The feed waits here before it decides what comes next (a look, a replica, the
    mini-batch), not after: a decision made before the wait acted on what was known
    a period earlier, so the loss that showed a device slowing (the loss watch's
    evidence) or a verdict that came during the wait let one more mini-batch into
    the pipeline before the look, and a move must drain it through the slow device
    (in ``bench/training_async.py``'s ``r24_middle`` the look came right after the
    slow loss that freed the window, with four mini-batches in flight where three
    were needed). Room is taken and given back at once: only the feed takes it, so
    the send's own take then returns at once."""
    window = run.window
    if not window.locked():
        return speed_notices(run)
    queue = run.session.control.speed_changes
    room = asyncio.ensure_future(window.acquire())
    verdict = asyncio.ensure_future(queue.get())
    try:
        # no deadline of its own: room comes with a loss, and the session's watch
        # ends the run when the losses stop (its idle timeout)
        await asyncio.wait({room, verdict}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # not awaited: a cancelled acquire that had been granted gives its room back
        # itself, and a cancelled get leaves its item in the queue
        for waiter in (room, verdict):
            waiter.cancel()
    if room.done() and not room.cancelled():
        window.release()
    first = [verdict.result()] if verdict.done() and not verdict.cancelled() else []
    return speed_notices(run, first)


def speed_notices(run: TrainingRun, first: list[SpeedChanged] | None = None) -> list[SpeedNoticed]:
    """The stages' speed verdicts the coordinator relayed for this attempt's run since
    the last call (``first``: those already taken off the queue), as events (a verdict
    of another run is dropped: it is about stages this attempt no longer feeds)."""
    queue = run.session.control.speed_changes
    taken = list(first or [])
    while not queue.empty():
        taken.append(queue.get_nowait())
    out = []
    for verdict in taken:
        try:
            verdict.checked()
        except ProtocolError as exc:
            log.warning("dropped_message", peer="coordinator", error=str(exc))
            continue
        if verdict.run != run.run:
            log.debug("speed_change_dropped", run=verdict.run, current=run.run)
            continue
        log.info("speed_change_noticed", run=run.run, stage=verdict.name,
                 ratio=round(verdict.ratio, 3), plan_epoch=verdict.plan_epoch)  # fmt: skip
        out.append(SpeedNoticed(verdict.name, verdict.plan_epoch, verdict.ratio))
    return out


def _record(run: TrainingRun, step: int, reply: Repartitioned) -> bool:
    decision = dict(reply.decision or {})
    moved = decision.get("bounds") is not None
    run.report.repartitions.append(
        # bounds: the cuts from ``at`` on (the same as before when it did not move);
        # at: the mini-batch of the whole fit (the coordinator's counts this attempt's)
        {
            **decision,
            "at": step,
            "moved": moved,
            "bounds": reply.bounds,
            "plan_epoch": reply.plan_epoch,
        }
    )
    log.info("repartition_looked", run=run.run, step=step, bounds=reply.bounds,
             moved=moved)  # fmt: skip
    return moved
