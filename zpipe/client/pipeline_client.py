"""The embedded API's client: asks the coordinator for runs and streams data through them.

The client is the data source and the sink of every run it starts: inference
streams (:meth:`PipelineClient.infer_stream`) and training runs
(:meth:`PipelineClient.fit`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import zmq

from zpipe._errors import PipelineError, TransportTimeout
from zpipe.client.batches import Batch, Outputs, TrainBatch
from zpipe.client.connection import CLIENT_NAME, ClientConnection
from zpipe.client.options import InferOptions, TrainOptions
from zpipe.client.reports import InferenceReport, TrainReport
from zpipe.client.runs.fit import fit
from zpipe.client.runs.generation import GenerateOptions, generate
from zpipe.client.runs.inference import InferenceRun
from zpipe.config import Timeouts
from zpipe.generation.params import SamplingParams, TokenEvent
from zpipe.models import ModelSpec
from zpipe.protocol.client_control import ClusterRequest, ClusterState, RunEnd, RunReport
from zpipe.transport.codec import Message
from zpipe.transport.sockets import SocketOptions


class PipelineClient:
    """Connects to a coordinator and runs inference streams and training on its stages.

    Use as ``async with PipelineClient(endpoint) as client: ...``.
    """

    def __init__(
        self,
        coordinator: str,
        *,
        keys_dir: Path | None = None,
        key_name: str = CLIENT_NAME,
        sink_bind: str = "tcp://0.0.0.0:0",
        advertise_host: str | None = None,
        timeouts: Timeouts | None = None,
        socket_options: SocketOptions | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.keys_dir = keys_dir
        self.key_name = key_name
        self.sink_bind = sink_bind
        self.advertise_host = advertise_host
        self.timeouts = timeouts or Timeouts()
        self.options = socket_options or SocketOptions()
        self._connection: ClientConnection | None = None
        self.sink_endpoint = ""
        self.last_report: InferenceReport | None = None

    async def __aenter__(self) -> PipelineClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        self._connection = ClientConnection.open(
            self.coordinator,
            keys_dir=self.keys_dir,
            key_name=self.key_name,
            sink_bind=self.sink_bind,
            advertise_host=self.advertise_host,
            timeouts=self.timeouts,
            options=self.options,
        )
        self.sink_endpoint = self._connection.sink_endpoint

    async def close(self) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            await connection.close()

    @property
    def connection(self) -> ClientConnection:
        """The open connection (sockets, keys) runs use; :class:`PipelineError` if the
        client is not open."""
        if self._connection is None:
            raise PipelineError("open() the client first")
        return self._connection

    def decode_sink_message(self, frames: Sequence[zmq.Frame]) -> Message:
        """A message that reached the sink, decoded (see
        :meth:`ClientConnection.decode_sink_message`)."""
        return self.connection.decode_sink_message(frames)

    async def cluster_state(self) -> list[dict[str, Any]]:
        """The coordinator's view of every stage: name, state, endpoint, device info."""
        reply = await self.connection.control.ask(
            ClusterRequest(),
            expect=(ClusterState,),
            timeout_s=self.timeouts.reply_s,
            awaited="cluster state",
        )
        return list(reply.members)

    async def end_run(self, run: int) -> dict[str, Any]:
        """End run ``run``, whatever client started it: the coordinator holds one run
        at a time and refuses other clients' runs while it is in flight
        (:class:`~zpipe.RunRefusedError` names it). For a run whose client died
        without ending it. Returns each stage's counters (none for a run that is
        not the coordinator's current one)."""
        report = await self.connection.control.ask(
            RunEnd(run=run),
            expect=(RunReport,),
            timeout_s=self.timeouts.reply_s * 2,
            awaited=f"the end of run {run}",
            resend_on_reconnect=True,
        )
        return dict(report.stages)

    async def wait_for_stages(
        self,
        count: int,
        *,
        timeout_s: float,
        on_alive: Callable[[int], None] | None = None,
        accept: Callable[[list[dict[str, Any]]], bool] | None = None,
    ) -> list[dict[str, Any]]:
        """Poll until ``count`` stages are alive; ``TransportTimeout`` past the deadline.
        ``on_alive(n)`` hears how many are alive after each poll (a progress bar);
        ``accept(members)``, when given, must hold of the live members too (a local
        cluster waits for the processes it started, not for a count a killed stage
        not yet declared dead still fills)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                state = await self.cluster_state()
            except TransportTimeout:
                # A coordinator still starting (import torch on a loaded machine) answers
                # late; keep asking until the caller's deadline, not just one reply_s.
                if time.monotonic() > deadline:
                    raise
                continue
            members = [m for m in state if m["state"] == "alive"]
            if on_alive is not None:
                on_alive(len(members))
            if len(members) >= count and (accept is None or accept(members)):
                return members
            if time.monotonic() > deadline:
                raise TransportTimeout("coordinator", f"{count} registered stages", timeout_s)
            await asyncio.sleep(0.1)

    async def infer_stream(
        self,
        model: ModelSpec,
        batches: Iterable[Batch] | AsyncIterable[Batch],
        *,
        options: InferOptions | None = None,
        **keywords: Any,
    ) -> AsyncIterator[Outputs]:
        """Yield the outputs of each input batch, in input order.

        The run's settings are ``options`` or the keywords of :class:`InferOptions`
        (``microbatch_size``, ``partition``, ``stages``, ``stage_names``, ``dtype``,
        ``planner``, ``profile``, ``max_in_flight``, ``wait_for_stages_s``,
        ``progress``, ``recover``, ``recovery``, ``stall_deadline``; keywords given
        with ``options`` replace its fields). They are checked before anything is sent.

        The run's report (plan, throughput, per-stage counters, recoveries) is in
        :attr:`last_report` once the stream is exhausted.
        """
        settings = InferOptions.from_keywords(options, keywords)
        run = InferenceRun(self.connection, model, settings)
        async for outputs in run.outputs(batches):
            yield outputs
        self.last_report = run.report

    async def infer(
        self,
        model: ModelSpec,
        batches: Iterable[Batch] | AsyncIterable[Batch],
        *,
        options: InferOptions | None = None,
        **keywords: Any,
    ) -> list[Outputs]:
        """All outputs of :meth:`infer_stream` as a list."""
        stream = self.infer_stream(model, batches, options=options, **keywords)
        return [outputs async for outputs in stream]

    async def fit(
        self,
        model: ModelSpec,
        batches: Iterable[TrainBatch] | AsyncIterable[TrainBatch],
        *,
        options: TrainOptions | None = None,
        **keywords: Any,
    ) -> TrainReport:
        """Train ``model`` across the cluster; see :func:`zpipe.client.fit`."""
        return await fit(self, model, batches, options, **keywords)

    async def generate(
        self,
        model: ModelSpec,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        options: GenerateOptions | None = None,
        **keywords: Any,
    ) -> AsyncIterator[TokenEvent]:
        """Generate from each prompt (token ids; sequence ``i`` is ``prompts[i]``) with a
        causal LM pipelined over the cluster's stages, yielding every token event as
        the first stage streams it (sequences interleave; an event's ``finish_reason``
        marks its sequence's last).

        ``params``: one SamplingParams for all, or one per prompt (default: greedy,
        16 tokens). The run's settings are ``options`` or the keywords of
        :class:`~zpipe.client.runs.generation.GenerateOptions` (``stages``,
        ``stage_names``, ``partition``, ``max_context``, ``max_sequences``,
        ``steps_in_flight``, ``chunk_tokens``, ``kv_budget_bytes``, ``dtype``,
        ``wait_for_stages_s``, ``token_timeout_s``), checked before anything is sent.
        """
        settings = GenerateOptions.from_keywords(options, keywords)
        async for event in generate(self.connection, model, prompts, params, settings):
            yield event
