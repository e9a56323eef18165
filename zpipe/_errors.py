"""Every error zpipe raises on purpose.

    ZpipeError
    ├── ConfigError            bad user input: flags, files, model specs, partitions
    │   └── ModelSpecError     a model spec or weights file that cannot be built
    ├── ProtocolError          a message from a peer that fails validation (dropped, logged)
    ├── SecurityError          keys missing or malformed, a peer that is not allowed
    ├── TransportTimeout       a network await ran past its deadline (names peer + what)
    │   └── PeerGoneError      a peer whose connection is gone: nothing was awaited
    └── PipelineError          a run that cannot go on
        ├── StageFailedError   the coordinator declared a stage dead during a run
        └── RemoteStageError   a stage raised while computing a micro-batch

A receive loop catches ProtocolError, logs it and keeps serving; everything
else reaches the user with a message that says what to do.
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
