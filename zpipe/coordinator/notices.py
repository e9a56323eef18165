"""Notices to a run's client, kept until it acknowledges them. Pure.

``stage_failed`` and ``run_replanned`` are sent unasked. One sent while the
client was cut off is lost (a ROUTER drops what it cannot deliver, a
reconnection drops what was queued), and the client would wait for results
that never come. So each notice gets a number within its run (``seq``) and is
sent again every ``resend_s`` until the client answers ``notice_ack`` with
that number, for as long as the run is the current one and at most
``keep_s`` (the client gives up on a silent run by then). The client drops a
number it has seen, so a notice sent twice acts once.

With a state directory the current run's unacknowledged notices and its last
number are saved with the rest of the state (:meth:`NoticeOutbox.saved`, written
before the notice is first sent) and taken back by a restarted coordinator
(:meth:`NoticeOutbox.restore`): a client that reconnects to it still gets a
notice it had not acknowledged, and the run's next notice gets a new number
(numbering again from 1 would repeat a number the client has seen, and it would
drop that notice as a repeat).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zpipe.coordinator.commands import Command, Log, Persist, Send
from zpipe.coordinator.records import SavedNotices
from zpipe.coordinator.state import CLIENT_NAME
from zpipe.protocol.client_control import RunReplanned, StageFailed

# What the coordinator sends a client unasked, about a run that goes on.
Notice = StageFailed | RunReplanned
NOTICES = (StageFailed, RunReplanned)


@dataclass
class _Kept:
    to: bytes
    message: Notice
    first_sent: float
    last_sent: float


class NoticeOutbox:
    """Every run's notices not yet acknowledged, by (run, seq)."""

    def __init__(self, *, resend_s: float, keep_s: float) -> None:
        self.resend_s = resend_s
        self.keep_s = keep_s
        self._kept: dict[tuple[int, int], _Kept] = {}
        self._last_seq: dict[int, int] = {}

    def post(self, to: bytes, message: Notice, now: float) -> Notice:
        """``message`` numbered within its run, kept until acknowledged; send what this returns."""
        run = message.run
        seq = self._last_seq.get(run, 0) + 1
        self._last_seq[run] = seq
        numbered = replace(message, seq=seq)
        self._kept[(run, seq)] = _Kept(to, numbered, now, now)
        return numbered

    def acknowledged(self, run: int, seq: int) -> bool:
        """The client has notice ``seq`` of ``run``; False if it was not kept (a repeat)."""
        return self._kept.pop((run, seq), None) is not None

    def due(self, current_run: int | None, now: float) -> list[tuple[bytes, Notice]]:
        """The notices to send again now, oldest first; those of a run that is no longer
        current, or older than ``keep_s``, are forgotten."""
        out = []
        for key, kept in list(self._kept.items()):
            if key[0] != current_run or now - kept.first_sent >= self.keep_s:
                del self._kept[key]
            elif now - kept.last_sent >= self.resend_s:
                kept.last_sent = now
                out.append((kept.to, kept.message))
        return out

    def unacknowledged(self, run: int) -> list[int]:
        return sorted(seq for r, seq in self._kept if r == run)

    def saved(self, run: int | None) -> SavedNotices | None:
        """What a restarted coordinator needs of ``run``'s notices (those of other runs
        would be forgotten at the next tick anyway); None if it gave none."""
        if run is None or run not in self._last_seq:
            return None
        kept = tuple((k.to, k.message) for (r, _), k in sorted(self._kept.items()) if r == run)
        return SavedNotices(run, self._last_seq[run], kept)

    def restore(self, saved: SavedNotices, now: float) -> None:
        """Take over the notices a previous coordinator saved: each is sent again at the
        next tick (the client may have missed it while neither could reach the other),
        and kept for ``keep_s`` from now; the run's numbering goes on after them."""
        self._last_seq[saved.run] = max(self._last_seq.get(saved.run, 0), saved.last_seq)
        for to, message in saved.kept:
            assert message.seq is not None  # the state file's reader checks it
            self._kept[(message.run, message.seq)] = _Kept(to, message, now, now - self.resend_s)


def number_notices(outbox: NoticeOutbox, commands: list[Command], now: float) -> list[Command]:
    """Every notice to a client (whichever run's flow sent it) numbered and kept in
    ``outbox`` until the client acknowledges it, and saved before it is sent (the
    shell carries out a ``Persist`` before the sends of the same batch)."""
    out: list[Command] = []
    numbered_any = False
    for command in commands:
        if (
            isinstance(command, Send)
            and command.peer == CLIENT_NAME
            and isinstance(command.message, NOTICES)
            and command.message.seq is None
        ):
            numbered = outbox.post(command.to, command.message, now)
            command = replace(command, message=numbered)
            numbered_any = True
        out.append(command)
    if numbered_any and not any(isinstance(c, Persist) and not c.soon for c in out):
        out.append(Persist())  # one save covers the batch: it is written after all of it
    return out


def notices_due(
    outbox: NoticeOutbox, run: int | None, now: float, *, reply_s: float
) -> list[Command]:
    """The notices of ``run`` to send again now, each with a log line."""
    out: list[Command] = []
    for to, message in outbox.due(run, now):
        fields = {"run": message.run, "kind": message.KIND, "seq": message.seq}
        out.append(Log("info", "notice_sent_again", fields))
        out.append(Send(to, message, CLIENT_NAME, reply_s))
    return out
