"""Every error zpipe raises on purpose.

    ZpipeError
    ├── ConfigError            bad user input: flags, files, model specs, partitions
    │   ├── ModelSpecError     a model spec or weights file that cannot be built
    │   └── InfeasiblePlanError  no plan fits the devices (memory, count, partition)
    ├── ProtocolError          a message from a peer that fails validation (dropped, logged)
    │   └── MessageLimitError  a multipart message past its socket's frame or byte bound
    ├── SecurityError          keys missing or malformed, a peer that is not allowed
    │   ├── UntrustedCodeError a peer named code (a model factory) this process does not allow
    │   └── RoleError          a peer sent what its role may not (a stage starting a run)
    ├── StateFileError         a coordinator state file that cannot be written or read back
    ├── TransportTimeout       a network await ran past its deadline (names peer + what)
    │   ├── PeerGoneError      a peer whose connection is gone: nothing was awaited
    │   └── CoordinatorLostError  the coordinator's connection stayed gone too long
    └── PipelineError          a run that cannot go on
        ├── StageFailedError   the coordinator declared a stage dead during a run
        │   └── StageLostError a stage died while the coordinator awaited its reply
        ├── UnitsLostError     units whose weights, snapshot and backup are all gone
        ├── RemoteStageError   a stage raised while computing a micro-batch
        ├── KvCacheFullError   a sequence refused: its KV cache would exceed the stage's budget
        ├── SequenceStateError a step for a sequence the stage does not hold, or out of place
        └── SequenceRefused    a generation run's first stage refused or ended one sequence

A receive loop catches every exception one message causes, logs it and keeps
serving; everything else reaches the user with a message that says what to do.
"""

from __future__ import annotations


class ZpipeError(Exception):
    """Base class of every error zpipe raises on purpose."""


class ConfigError(ZpipeError, ValueError):
    """Bad user input: a flag, a file, a partition or a model spec."""


class ModelSpecError(ConfigError):
    """A model spec, preset or weights file that cannot be built."""


class ProtocolError(ZpipeError):
    """A message that fails validation; the receiver drops it and keeps serving."""


class MessageLimitError(ProtocolError):
    """A received multipart message with more frames or bytes than anything its
    socket may legally carry: the receive kept none of it past the bound, read and
    discarded the rest, and goes on with the next message."""

    def __init__(self, detail: str, *, frames: int, nbytes: int) -> None:
        super().__init__(detail)
        self.frames = frames
        self.nbytes = nbytes


class TransferBudgetError(ProtocolError):
    """A bulk transfer refused at its first chunk: what it announces, with what its
    sender already has half-sent here, is past the bytes one sender may hold in
    open transfers. Nothing of it was kept; the receiver serves on."""

    def __init__(self, detail: str, *, announced: int, held: int, budget: int) -> None:
        super().__init__(detail)
        self.announced = announced
        self.held = held
        self.budget = budget


class SecurityError(ZpipeError):
    """Missing or malformed keys, or a peer that is not on the allow-list."""


class TransportTimeout(ZpipeError, TimeoutError):
    """A network await ran past its deadline."""

    def __init__(self, peer: str, awaited: str, timeout_s: float) -> None:
        super().__init__(f"timed out after {timeout_s:g} s waiting for {awaited} from {peer}")
        self.peer = peer
        self.awaited = awaited
        self.timeout_s = timeout_s


class PeerGoneError(TransportTimeout):
    """A message could not be sent because the peer's connection is gone (a killed
    process drops it at once); a TransportTimeout, so callers treat both alike."""

    def __init__(self, peer: str, sending: str) -> None:
        super().__init__(peer, f"a connection to send {sending}", 0.0)
        self.args = (f"{peer} is not connected: could not send {sending}",)


class CoordinatorLostError(TransportTimeout):
    """The client's connection to the coordinator stayed gone for the coordinator's
    silence timeout: a run cannot end without it (commits, replicas, recovery)."""

    def __init__(self, awaited: str, silence_s: float) -> None:
        super().__init__("coordinator", awaited, silence_s)
        self.args = (
            f"lost the coordinator: its connection has been gone for {silence_s:g} s while "
            f"waiting for {awaited} (it died and was not restarted); start the run again "
            "once it is back",
        )


class PipelineError(ZpipeError):
    """A run that cannot go on."""


class StageFailedError(PipelineError):
    """The coordinator declared a stage of the running pipeline dead."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(f"stage {stage!r} failed: {reason}")
        self.stage = stage
        self.reason = reason


class RemoteStageError(PipelineError):
    """A stage raised while computing a micro-batch; the message is the stage's."""

    def __init__(self, stage: str, microbatch: int, message: str) -> None:
        super().__init__(f"stage {stage!r} failed on micro-batch {microbatch}: {message}")
        self.stage = stage
        self.microbatch = microbatch
        self.remote_message = message


class RunRefusedError(PipelineError):
    """The coordinator did not start the run: another client's run ``run`` is in
    flight, and a coordinator holds one run at a time. Nothing was started or
    stopped; ask again once that run ended (or end it, if its client is gone)."""

    def __init__(self, run: int, detail: str) -> None:
        super().__init__(detail)
        self.run = run


class InfeasiblePlanError(ConfigError):
    """No plan fits: too few live devices, units that fit no device's memory, a
    partition that does not cover the model."""


class UntrustedCodeError(SecurityError):
    """A peer named code to import or run (a model factory) that this process's
    operator did not allow; nothing was imported."""


class RoleError(SecurityError):
    """A peer sent a message its role may not send (a stage key starting a run)."""


class StateFileError(ZpipeError):
    """A coordinator state file that cannot be written, or whose contents are not a
    valid state (bad checksum, bad schema)."""


class StageLostError(StageFailedError):
    """A stage died (or restarted) while the coordinator awaited its reply."""


class UnitsLostError(PipelineError):
    """Units whose weights are gone: every holder of them, their snapshot and their
    backup are lost, so the run cannot resume from the replica."""

    def __init__(self, units: tuple[int, int], detail: str) -> None:
        super().__init__(f"units [{units[0]}, {units[1]}) are lost: {detail}")
        self.units = units


class KvCacheFullError(PipelineError):
    """A sequence refused before anything is computed: its KV cache (reserved for its
    whole length) would exceed the stage's budget, or the model's context. The stage
    keeps serving the sequences it holds. ``free_bytes`` is None for a stage
    without a budget (only the context refused it)."""

    def __init__(
        self, sequence_id: int, *, needed_bytes: int, free_bytes: int | None, detail: str
    ) -> None:
        super().__init__(f"sequence {sequence_id} refused: {detail}")
        self.sequence_id = sequence_id
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class SequenceStateError(PipelineError):
    """A step for a sequence this stage holds no cache for (never opened, freed, or
    lost with a restart), or whose positions do not continue its cache."""

    def __init__(self, sequence_id: int, detail: str) -> None:
        super().__init__(f"sequence {sequence_id}: {detail}")
        self.sequence_id = sequence_id


class SequenceRefused(PipelineError):
    """A generation run's first stage refused one sequence (``gen_refused``: a bad
    prompt or settings, a sequence its KV cache can never hold, or a step that
    failed at a stage); the run goes on serving its other sequences."""

    def __init__(self, sequence: int, error: str, *, kind: str | None = None) -> None:
        super().__init__(f"sequence {sequence} was refused: {error}")
        self.sequence = sequence
        self.error = error
        # why, for a program (zpipe.generation.refusals: capacity, context_length,
        # bad_request, stage_failed); None from a first stage that does not say
        self.kind = kind
