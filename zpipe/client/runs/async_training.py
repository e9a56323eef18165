"""One attempt of an asynchronous 1F1B run on the client side.

As a synchronous attempt (:class:`~zpipe.client.runs.sync_training.TrainingRun`): feed
each mini-batch to the first stage and its labels to the last, one loss back per
mini-batch, at most ``max_steps_in_flight`` mini-batches in flight (FTPipeHD's
semaphore; by default the number of stages). The stages do not know how long the
run is, so the feed ends with a ``data`` message that carries ``end`` and no rows
(:mod:`zpipe.stage.executors.async_training`); the final weights are gathered once every
stage has backwarded every mini-batch.

With ``repartition`` (FTPipeHD's live re-partitioning), the feed pauses before
each mini-batch the settings name (:mod:`zpipe.client.runs.async_repartition`): the same
``end`` marker flushes the stages there. With ``recover``, it pauses before every
replica too, and the coordinator keeps one at the flush
(:mod:`zpipe.coordinator.runs.async_replicas`).
"""

from __future__ import annotations

from zpipe.client.connection import CLIENT_NAME
from zpipe.client.runs.sync_training import TrainingRun
from zpipe.planner.training_plan import TrainingPlan
from zpipe.protocol.data_plane import Data


class AsyncTrainingRun(TrainingRun):
    def default_window(self, plan: TrainingPlan) -> int:
        # stage 0 forwards n mini-batches before its first backward
        return len(plan.stages)

    async def feed_ended(self) -> None:
        message = Data(run=self.run, mb=self.sent_steps, src=CLIENT_NAME, rows=[0, 0], total=0,
                       end=True, epoch=self.session.epoch)  # fmt: skip
        for name, sock in self.first_group:
            await self._send(sock, message, name)

    async def pause_feed(self) -> None:
        await self.feed_ended()  # the stages finish every mini-batch before the pause
