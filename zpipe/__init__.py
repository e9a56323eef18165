"""zpipe: one deep network as a pipeline across heterogeneous, unreliable devices."""

from __future__ import annotations

from zpipe._errors import (
    ConfigError,
    ModelSpecError,
    PeerGoneError,
    PipelineError,
    ProtocolError,
    RemoteStageError,
    SecurityError,
    StageFailedError,
    TransportTimeout,
    ZpipeError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "ModelSpecError",
    "PeerGoneError",
    "PipelineError",
    "ProtocolError",
    "RemoteStageError",
    "SecurityError",
    "StageFailedError",
    "TransportTimeout",
    "ZpipeError",
    "__version__",
]
