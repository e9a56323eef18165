"""A live re-partition of an asynchronous training run (FTPipeHD III-D, III-F).

    client -> coordinator   repartition -> repartitioned
    coordinator -> stage    repartition_request (phase) -> repartition_reply

First the client asks with ``look`` and goes on feeding: the coordinator asks
every stage for its counters as they are (phase ``profile``, no flush) and
decides. When the cuts stay, that is all (the reply carries the decision). When
they move (the reply says ``pause``), or from a client that does not look first,
the client pauses its feed after mini-batch ``step - 1`` (the feed's ``end``
marker, so every stage finishes every batch before it) and asks again without
``look``; the coordinator then carries the decision out, asking every stage in
three phases:

- ``prepare``: once flushed at ``step``, keep a snapshot of your units (with their
  weight versions and optimizer state) and answer with your counters (``metrics``);
- ``fetch`` (when the cuts move): fetch the units of ``bounds`` you lack, from the
  snapshots of the stages that held them (``fetch``: entries as an assignment's),
  straight from their probe sockets;
- ``commit``: every stage has fetched; switch to ``bounds`` (plan epoch
  ``plan_epoch``) and go on from batch ``step``. A look that keeps the cuts sends
  only this phase, with the current ones. A move that leaves a device out
  (``leave_out``) also sends each stage kept its place in the shorter chain
  (``chain``); the device left out gets no commit and stays paused, idle.

And a hint that makes a look due sooner:

    stage -> coordinator -> client   speed_changed

A stage whose own passes (forwards and backwards) changed speed for good
(:class:`~zpipe.training.forward_watch.ForwardWatch`) tells the coordinator, which
relays it to the run's client (the same class both ways); the client then looks
before its next mini-batch instead of at the next scheduled look. ``plan_epoch`` is
the cuts' epoch the passes ran on: a verdict about cuts that have moved since says
nothing about the new ones and is dropped.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from zpipe._errors import ProtocolError
from zpipe.protocol._schema import (
    INT,
    NUM,
    OPT_BOOL,
    OPT_INT,
    OPT_LIST,
    OPT_MAP,
    STR,
    WireMessage,
    wire,
    wire_message,
)

PHASES = ("profile", "prepare", "fetch", "commit")


@wire_message
class Repartition(WireMessage):
    KIND: ClassVar[str] = "repartition"
    run: int = wire(INT)
    step: int = wire(INT)
    # look first, with no pause: the client pauses only if the reply says ``pause``
    look: bool | None = wire(OPT_BOOL, default=None, omit_if_none=True)


@wire_message
class Repartitioned(WireMessage):
    """``decision``: what the look found (:class:`~zpipe.training.repartition.
    RepartitionDecision`'s map); ``bounds``: the cuts from ``step`` on."""

    KIND: ClassVar[str] = "repartitioned"
    run: int = wire(INT)
    step: int = wire(INT)
    error: str = wire(STR)
    bounds: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)
    plan_epoch: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    decision: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    # to a look: the cuts move (or the stages could not profile); pause, then ask again
    pause: bool | None = wire(OPT_BOOL, default=None, omit_if_none=True)


@wire_message
class RepartitionRequest(WireMessage):
    KIND: ClassVar[str] = "repartition_request"
    run: int = wire(INT)
    step: int = wire(INT)
    phase: str = wire(STR)
    bounds: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)
    fetch: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)
    plan_epoch: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    # a commit that leaves a device out: this stage's place in the shorter chain
    # (``index``, ``num_stages``, ``upstream`` and ``downstream`` as an assignment's)
    chain: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)


@wire_message
class RepartitionReply(WireMessage):
    KIND: ClassVar[str] = "repartition_reply"
    run: int = wire(INT)
    name: str = wire(STR)
    step: int = wire(INT)
    phase: str = wire(STR)
    error: str = wire(STR)
    metrics: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)


@wire_message
class SpeedChanged(WireMessage):
    """Stage ``name``'s passes of run ``run`` changed speed for good at mini-batch
    ``step`` (the stage's count, of this attempt: the mini-batch of the forward or
    backward that completed the verdict), on the cuts of ``plan_epoch``: ``ratio`` is
    the new compute time over the old (> 1: slower; each pass over its own kind's
    median), ``baseline_s`` and ``now_s`` the forward time before and after (the
    forwards' median, and that times ``ratio``)."""

    KIND: ClassVar[str] = "speed_changed"
    run: int = wire(INT)
    name: str = wire(STR)
    step: int = wire(INT)
    plan_epoch: int = wire(INT)
    ratio: float = wire(NUM)
    baseline_s: float = wire(NUM)
    now_s: float = wire(NUM)

    def checked(self) -> SpeedChanged:
        """This verdict, if its values mean one (the schema checks only their types);
        :class:`ProtocolError` naming the misfit otherwise."""
        if self.step < 0 or self.plan_epoch < 0:
            raise ProtocolError(
                f"speed_changed: step and plan_epoch must be >= 0, got "
                f"{self.step} and {self.plan_epoch}"
            )
        for field in ("ratio", "baseline_s", "now_s"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value > 0):
                raise ProtocolError(f"speed_changed: {field} must be finite and > 0, got {value}")
        return self


MESSAGES: tuple[type[WireMessage], ...] = (
    Repartition,
    Repartitioned,
    RepartitionRequest,
    RepartitionReply,
    SpeedChanged,
)
