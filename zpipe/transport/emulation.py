"""Emulated devices and links for experiments on one machine.

A :class:`LinkModel` turns a message size into when it leaves and arrives on a
link of given bandwidth and latency, and decides (seeded) whether it is lost.
It is pure; :class:`EmulatedLink` applies it to real sends.

A link's loss is either random (``LinkSpec.loss``: a seeded stream, one draw per
message) or *keyed*: a pure decision over each transmission's identity
(:class:`LossKey`), which a lossy run's links are given
(:func:`zpipe.lossy.links.seeded_link_loss`). A keyed decision does not depend on
the order messages are sent in, so the in-process simulation, which asks the same
decision, drops exactly what the stages' emulated links drop.
:class:`KeyedLinks` are those links as a stage's senders use them: every copy of
a partial or probe is handed to its link, and the link decides whether it
arrives; the sender no longer decides. Serialisation time
is paid by the sender (so a slow link throttles the pipeline, as a real one
does) while latency is paid in flight (so a long link does not lower the
throughput of a pipeline that keeps several messages in flight).

:func:`emulate_slowdown` stretches a compute step to ``factor`` times the
CPU time it needed, which is how a stage plays a slower device.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from zpipe._errors import ConfigError


@dataclass(frozen=True)
class LinkSpec:
    """An emulated link: ``None`` bandwidth means unlimited."""

    bandwidth_mbps: float | None = None
    latency_ms: float = 0.0
    loss: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.bandwidth_mbps is not None and not self.bandwidth_mbps > 0:
            raise ConfigError(f"link bandwidth must be > 0 Mbit/s, got {self.bandwidth_mbps}")
        if not self.latency_ms >= 0:
            raise ConfigError(f"link latency must be >= 0 ms, got {self.latency_ms}")
        if not 0.0 <= self.loss < 1.0:
            raise ConfigError(f"link loss must be in [0, 1), got {self.loss}")

    @property
    def is_ideal(self) -> bool:
        return self.bandwidth_mbps is None and self.latency_ms == 0 and self.loss == 0

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            "bandwidth_mbps": self.bandwidth_mbps,
            "latency_ms": self.latency_ms,
            "loss": self.loss,
            "seed": self.seed,
        }


class LossKey(NamedTuple):
    """The identity of one transmission on a keyed-loss link: the sender and receiver,
    the layer and step (mini-batch, test step or timeslot) it belongs to, what it
    carries (``kind``) and which copy (attempt, or probe index) it is. All
    non-negative. A named tuple, not a dataclass: a simulation sweep makes millions."""

    src: int
    dst: int
    layer: int
    step: int
    kind: int
    copy: int = 0


#: A keyed loss decision: True when the transmission ``key`` names is lost. Must be
#: pure (the same key, the same answer), so every process that asks agrees.
KeyedLoss = Callable[[LossKey], bool]


@dataclass
class LinkModel:
    """When each message leaves and arrives, and whether it is lost (pure, seeded).

    With ``keyed_loss``, a message sent with a :class:`LossKey` is lost as that
    decision says; messages without a key still draw from the seeded stream
    (``spec.loss``), whose draws a keyed message does not consume.
    """

    spec: LinkSpec
    _busy_until: float = 0.0
    _rng: random.Random = field(init=False)
    keyed_loss: KeyedLoss | None = None

    def __post_init__(self) -> None:
        self._rng = random.Random(self.spec.seed)

    def schedule(
        self, nbytes: int, now: float, key: LossKey | None = None
    ) -> tuple[float, float, bool]:
        """(sender free at, delivered at, lost) for a message of ``nbytes`` sent at ``now``;
        ``key``: its identity, for a link with a keyed loss decision."""
        start = max(now, self._busy_until)
        tx = 0.0
        if self.spec.bandwidth_mbps is not None:
            tx = nbytes * 8.0 / (self.spec.bandwidth_mbps * 1e6)
        self._busy_until = start + tx
        if key is not None and self.keyed_loss is not None:
            lost = self.keyed_loss(key)
        else:
            lost = self.spec.loss > 0 and self._rng.random() < self.spec.loss
        return self._busy_until, self._busy_until + self.spec.latency_ms / 1e3, lost

    def occupy(self, nbytes: int, now: float) -> float:
        """When the link is free again after also carrying ``nbytes`` sent at ``now``
        through another socket. Draws no loss, so the seeded losses of the messages
        :meth:`schedule` sees stay the same."""
        start = max(now, self._busy_until)
        if self.spec.bandwidth_mbps is not None:
            start += nbytes * 8.0 / (self.spec.bandwidth_mbps * 1e6)
        self._busy_until = start
        return start


class EmulatedLink:
    """Applies a :class:`LinkModel` in front of a real send coroutine, in order."""

    def __init__(
        self,
        spec: LinkSpec,
        deliver: Callable[[object], Awaitable[None]],
        *,
        max_in_flight: int = 64,
        clock: Callable[[], float] = time.monotonic,
        keyed_loss: KeyedLoss | None = None,
    ) -> None:
        self.model = LinkModel(spec, keyed_loss=keyed_loss)
        self._deliver = deliver
        self._clock = clock
        self._queue: asyncio.Queue[tuple[float, object]] = asyncio.Queue(max_in_flight)
        self._task: asyncio.Task[None] | None = None
        self.lost = 0
        self._error: BaseException | None = None

    async def submit(self, item: object, nbytes: int, key: LossKey | None = None) -> bool:
        """Pay the serialisation time, then hand ``item`` to the in-flight queue.

        Returns False when the emulated link lost the message; ``key``: its identity,
        for a link given a keyed loss decision.
        """
        if self._error is not None:
            raise self._error
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        free_at, deliver_at, lost = self.model.schedule(nbytes, self._clock(), key)
        await asyncio.sleep(max(0.0, free_at - self._clock()))
        if lost:
            self.lost += 1
            return False
        await self._queue.put((deliver_at, item))
        return True

    async def pace(self, nbytes: int) -> None:
        """Pay the serialisation time of ``nbytes`` that another socket sends (a ring
        all-reduce shares the device's one radio with its activations). No loss and no
        latency: the ring has no way to recover a lost message, and its window already
        keeps messages in flight."""
        free_at = self.model.occupy(nbytes, self._clock())
        await asyncio.sleep(max(0.0, free_at - self._clock()))

    async def _run(self) -> None:
        try:
            while True:
                deliver_at, item = await self._queue.get()
                delay = deliver_at - self._clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self._deliver(item)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced to the next submit()
            self._error = exc

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None


class KeyedLinks:
    """A sender's emulated links with a keyed loss decision, one per directed link.

    :meth:`transmit` puts one copy of a message on the link ``key.src -> key.dst``
    and says whether it arrives; the sender puts each copy that arrives on the wire
    (a lossy run's receiver keeps the first and discards the others, as an 802.15.4
    MAC discards a repeated sequence number: zpipe.stage.executors.lossy_recovery). Per-link
    counts of copies sent and lost are kept. Synchronous and
    without timing (a lossy run's timeslots are its clock), so the compute thread
    that runs a stage's passes and the event loop that sends its probes both use
    it; each instance belongs to one thread.
    """

    def __init__(self, keyed_loss: KeyedLoss, spec: LinkSpec = LinkSpec()) -> None:
        self._keyed_loss = keyed_loss
        self._spec = spec
        self._models: dict[tuple[int, int], LinkModel] = {}
        self.sent: dict[tuple[int, int], int] = {}
        self.lost: dict[tuple[int, int], int] = {}

    def transmit(self, key: LossKey) -> bool:
        """One copy over ``key``'s link: True when it arrives."""
        link = (key.src, key.dst)
        model = self._models.get(link)
        if model is None:
            model = self._models[link] = LinkModel(self._spec, keyed_loss=self._keyed_loss)
        _, _, lost = model.schedule(0, 0.0, key)
        self.sent[link] = self.sent.get(link, 0) + 1
        if lost:
            self.lost[link] = self.lost.get(link, 0) + 1
        return not lost


_T = TypeVar("_T")

# What a shared uplink carries at a time: a few dozen packets, about what a real
# link's queue holds of one connection before another's packets get their turn.
UPLINK_SLICE_BYTES = 64 * 1024


class SharedUplink:
    """One device's emulated uplink, shared by several connections (to the coordinator:
    the control one and the bulk one), each of which keeps its own order.

    A connection's messages leave one after another, as on one TCP connection: a
    heartbeat queued behind a 30 MB message on the same connection waits for all of
    it. Connections share the link slice by slice (:data:`UPLINK_SLICE_BYTES`), as
    packets of two TCP connections share a real link's queue, so a heartbeat on its
    own connection waits for one slice of someone else's transfer, not the whole.
    """

    def __init__(self, spec: LinkSpec, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = LinkModel(spec)
        self._clock = clock

    @property
    def is_ideal(self) -> bool:
        return self.model.spec.bandwidth_mbps is None

    def connection(self) -> UplinkConnection:
        return UplinkConnection(self)

    async def carry(self, nbytes: int) -> None:
        """Wait while the link carries ``nbytes``, a slice at a time."""
        left = nbytes
        while True:
            piece = min(left, UPLINK_SLICE_BYTES)
            free_at = self.model.occupy(piece, self._clock())
            await asyncio.sleep(max(0.0, free_at - self._clock()))
            left -= piece
            if left <= 0:
                return


class UplinkConnection:
    """One connection over a :class:`SharedUplink`: its sends in order, each paying
    its bytes' time on the link before it is handed to the socket."""

    def __init__(self, uplink: SharedUplink) -> None:
        self._uplink = uplink
        self._lock = asyncio.Lock()

    async def send(self, nbytes: int, send: Callable[[], Awaitable[_T]]) -> _T:
        if self._uplink.is_ideal:
            return await send()
        async with self._lock:
            await self._uplink.carry(nbytes)
            return await send()


def emulate_slowdown(factor: float, elapsed_s: float, cpu_s: float | None = None) -> float:
    """Sleep (in the compute thread) so a step takes as long as on a device ``factor``
    times slower.

    The work is ``cpu_s`` when given: the compute thread's CPU time, which is
    what the step costs on an idle core. A slower device does ``factor`` times
    that work, so the step is held for the extra ``(factor - 1) * cpu_s`` on top
    of what it took. Stretching the wall time instead would multiply whatever
    time the step spent waiting for a core that other stages on the same
    machine were using (a 4x slower device would turn its share of that
    contention into four times as much); stretching only to ``factor * cpu_s``
    would hide the slower device entirely once waits for a core exceed its
    extra work, and every stage of a loaded machine would measure alike.
    Without a CPU time the wall time is the work. Returns how long the step
    took in the end.
    """
    if factor <= 1.0:
        return elapsed_s
    if cpu_s is None:
        extra = (factor - 1.0) * elapsed_s
    else:
        extra = (factor - 1.0) * cpu_s
    if extra > 0:
        time.sleep(extra)
    return elapsed_s + extra


def compute_cpu_s(thread_cpu_s: float) -> float | None:
    """The compute thread's CPU time, where it is all of a step's work.

    With one torch thread every kernel runs on the calling thread; with more,
    torch's pool threads do part of the work out of this thread's sight, and
    wall time is the better measure (``None``).
    """
    import torch  # the emulation module itself stays free of torch

    return thread_cpu_s if torch.get_num_threads() == 1 else None
