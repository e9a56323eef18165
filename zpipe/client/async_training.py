"""One attempt of an asynchronous 1F1B run on the client side.

As a synchronous attempt (:class:`~zpipe.client.training_run.TrainingRun`): feed
each mini-batch to the first stage and its labels to the last, one loss back per
mini-batch, at most ``max_steps_in_flight`` mini-batches in flight (FTPipeHD's
semaphore; by default the number of stages). The stages do not know how long the
run is, so the feed ends with a ``data`` message that carries ``end`` and no rows
(:mod:`zpipe.stage.async_trainer`); the final weights are gathered once every
stage has backwarded every mini-batch.

With ``repartition`` (FTPipeHD's live re-partitioning), the feed pauses before
each mini-batch the settings name: the same ``end`` marker flushes the stages
there, then the coordinator looks and moves units between them
(:mod:`zpipe.coordinator.async_repartition`), and the feed goes on.
"""

from __future__ import annotations

import asyncio

from zpipe._errors import PipelineError, TransportTimeout
from zpipe.client.batches import BatchSource
from zpipe.client.connection import CLIENT_NAME
from zpipe.client.training_run import TrainingRun
from zpipe.log import get_logger
from zpipe.planner.training_plan import TrainingPlan
from zpipe.training.repartition import RepartitionSettings
from zpipe.transport.codec import Message

log = get_logger("zpipe.client")


class AsyncTrainingRun(TrainingRun):
    repartition: RepartitionSettings | None = None

    def default_window(self, plan: TrainingPlan) -> int:
        # stage 0 forwards n mini-batches before its first backward
        return len(plan.stages)

    async def feed_ended(self) -> None:
        body = {"run": self.run, "mb": self.sent_steps, "src": CLIENT_NAME}
        body.update(rows=[0, 0], total=0, end=True)
        message = Message("data", body, epoch=self.session.epoch)
        for name, sock in self.first_group:
            await self._send(sock, message, name)

    async def _feed(self, source: BatchSource) -> None:
        async for batch in source.iterate():
            step = self.offset + self.sent_steps
            if self.repartition is not None and self.repartition.due(step):
                await self._repartition(step)
            await self._send_minibatch(batch)
        await self.feed_ended()
        self.all_sent.set()
        if self.done_steps == self.sent_steps:
            self.finished.set()

    async def _repartition(self, step: int) -> None:
        """Flush the stages before mini-batch ``step`` and have the coordinator look."""
        await self.feed_ended()  # the stages finish every mini-batch before ``step``
        timeout = self.timeouts.result_s
        while self.done_steps < self.sent_steps:
            self.step_finished.clear()
            try:
                await asyncio.wait_for(self.step_finished.wait(), timeout)
            except asyncio.TimeoutError:
                raise TransportTimeout(
                    self.session.last_stage, "the losses before a re-partition", timeout
                ) from None
        reply = await self.session.control.request(
            Message("repartition", {"run": self.run, "step": step}),
            expect=("repartitioned",),
            # a flush, the stages' fetches and the commit, each within result_s
            timeout_s=3 * timeout + self.timeouts.reply_s,
            awaited="the re-partition",
            resend_on_reconnect=True,
            progress_run=self.run,
        )
        if reply["error"]:
            # the stages may be flushed at a cut they cannot leave: the run ends here
            raise PipelineError(f"the re-partition before mini-batch {step} failed: "
                                f"{reply['error']}")  # fmt: skip
        decision = dict(reply.get("decision") or {})
        moved = decision.get("bounds") is not None
        self.report.repartitions.append(
            # bounds: the cuts from ``at`` on (the same as before when it did not move)
            {
                **decision,
                "moved": moved,
                "bounds": reply.get("bounds"),
                "plan_epoch": reply.get("plan_epoch"),
            }
        )
        log.info("repartition_looked", run=self.run, step=step, bounds=reply.get("bounds"),
                 moved=moved)  # fmt: skip
