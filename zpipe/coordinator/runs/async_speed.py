"""A stage's speed verdict, relayed to the run's client: an early look (FTPipeHD III-D).

FTPipeHD looks at the stages every ``every`` mini-batches; a device that slows
right after a look runs slow until the next one. A stage of an asynchronous run
that re-partitions with ``forward_watch`` watches its own forwards
(:mod:`zpipe.stage.speed_watch`) and tells the coordinator when their time changed
for good (``speed_changed``). Only the client decides when to look (it pauses its
feed for a move), so the coordinator relays the verdict to it, unchanged, and the
client looks before its next mini-batch (:mod:`zpipe.client.runs.training_attempts`):
at once, even while its feed waits for room in its window
(:func:`zpipe.client.runs.async_repartition.room_or_verdict`).

Pure: :func:`relay_speed_change` takes the verdict and returns commands. What it
drops, and why (each a ``Log``, never an error: a verdict is a hint, the
scheduled looks still come):

- a verdict whose values mean none (:meth:`SpeedChanged.checked`);
- a verdict of a run that is not the current one, or that does not re-partition
  with a forward watch, or from a stage that is not in the run;
- one about cuts that have moved since (its ``plan_epoch`` older than the
  controller's): the forwards it measured ran on other units;
- one that comes while a look or a move is in progress, or while the client is
  pausing for a move a look decided, is not dropped but deferred (a look that
  took counters before the device slowed measured it at its old speed, and the
  watch, having fired, starts again from the new level: a verdict dropped there
  was never sent again, and the device ran slow until the next scheduled look).
  It is kept for the look: the one in progress takes it if it has not decided
  yet, and then it is not relayed; otherwise it is relayed when the look ends
  (:mod:`zpipe.coordinator.runs.deferred_verdicts`), and the client's next look
  takes it. A look that ends with a move drops it (``older cuts``: it measured
  the units the stage ran before);
- a second verdict from the same stage about the same cuts and mini-batch (a
  resend).

A verdict relayed is also kept for the look it asks for (the latest per stage,
``LiveRepartitioning.verdicts``): that look comes two mini-batches after the
change, when its window holds 0-1 of the device's slow forwards, too few to show
the change, and it measured the device at its old speed (a bench run kept the cuts
and moved 7 mini-batches late). Given the verdict, it measures the device at its
new speed (:func:`zpipe.training.repartition_window.verdict_time`). The next look
takes it, whichever it is, and no later one; one about older cuts, or from a
device a move left out, is ignored there.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from zpipe._errors import ConfigError, ProtocolError
from zpipe.coordinator.commands import Command, Log, Send
from zpipe.coordinator.runs.async_repartition import live_repartitioning, repartition_settings
from zpipe.coordinator.runs.deferred_verdicts import verdict_fields
from zpipe.coordinator.state import CLIENT_NAME
from zpipe.protocol.client_control import RunRequest
from zpipe.protocol.repartition import SpeedChanged
from zpipe.training.repartition_window import SpeedVerdict

if TYPE_CHECKING:
    from zpipe.coordinator.state import ControlState


def forward_watch_of(request: RunRequest | None) -> float | None:
    """The forward watch's factor a run's stages are told (``train["forward_watch"]``),
    None when the run does not re-partition or does not watch its forwards."""
    try:
        settings = repartition_settings(request)
    except ConfigError:
        return None  # the run is refused elsewhere, with the reason
    if settings is None or not settings.forward_watch:
        return None
    return float(settings.forward_watch)


def relay_speed_change(
    state: ControlState, stage: str, message: SpeedChanged, now: float
) -> list[Command]:
    """Stage ``stage``'s verdict: to the run's client, or dropped (see the module notes)."""
    fields = verdict_fields(stage, message)
    try:
        message.checked()
    except ProtocolError as exc:  # a peer's bad values: dropped, the coordinator serves on
        return [Log("warning", "dropped_message", {"peer": stage, "error": str(exc)})]
    current = state.current
    run = None if current is None else current.run
    if run is None or current is None or run.run != message.run:
        return [Log("debug", "speed_change_dropped", {**fields, "why": "not the current run"})]
    if stage != message.name or stage not in run.devices:
        return [Log("warning", "speed_change_dropped", {**fields, "why": "not a stage of the run"})]
    if forward_watch_of(run.request) is None:
        return [Log("debug", "speed_change_dropped", {**fields, "why": "no forward watch"})]
    live = live_repartitioning(current)
    plan_epoch = run.repartition_epoch
    if live is not None and live.controller is not None:
        plan_epoch = live.controller.plan_epoch
    if message.plan_epoch < plan_epoch:
        return [Log("info", "speed_change_dropped", {**fields, "why": "older cuts"})]
    key = (stage, message.plan_epoch, message.step)
    relayed = replace(message, epoch=run.epoch)
    if live is not None:
        if key in live.relayed:
            return [Log("debug", "speed_change_dropped", {**fields, "why": "relayed already"})]
        live.relayed.add(key)
        live.verdicts[stage] = SpeedVerdict(
            message.step, message.ratio, message.baseline_s, message.now_s, message.plan_epoch
        )
        if live.looking or live.pending is not None:
            # kept for the look in progress (when it has not decided yet) or the next
            # one; told to the client when this one ends (LiveRepartitioning.deferred)
            live.deferred.keep(stage, relayed)
            return [Log("info", "speed_change_deferred", {**fields, "why": "a look in progress"})]
    return [
        Log("info", "speed_change_relayed", fields),
        Send(run.client, relayed, CLIENT_NAME, state.timeouts.reply_s),
    ]
