"""zpipe: one deep network as a pipeline across heterogeneous, unreliable devices."""

from __future__ import annotations

from zpipe._errors import (
    ConfigError,
    CoordinatorLostError,
    InfeasiblePlanError,
    ModelSpecError,
    PeerGoneError,
    PipelineError,
    ProtocolError,
    RemoteStageError,
    RoleError,
    RunRefusedError,
    SecurityError,
    StageFailedError,
    StageLostError,
    StateFileError,
    TransportTimeout,
    UnitsLostError,
    UntrustedCodeError,
    ZpipeError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "CoordinatorLostError",
    "InfeasiblePlanError",
    "ModelSpecError",
    "PeerGoneError",
    "PipelineError",
    "ProtocolError",
    "RemoteStageError",
    "RoleError",
    "RunRefusedError",
    "SecurityError",
    "StageFailedError",
    "StageLostError",
    "StateFileError",
    "TransportTimeout",
    "UnitsLostError",
    "UntrustedCodeError",
    "ZpipeError",
    "__version__",
]
