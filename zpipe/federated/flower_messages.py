"""What zpipe's Eco-FL ServerApp and ClientApp say to each other, as typed classes.

Flower carries a message's content as a ``RecordDict`` of records (arrays,
configs, metrics); each class here converts itself to one and parses one
back, once, at the edge of the app, with a clear :class:`ProtocolError` when
a field is missing or of the wrong kind. Nothing is pickled: weights travel
as one float64 array in an ``ArrayRecord``, the rest as config values.

- :class:`FlowerProfileRequest` / :class:`FlowerProfileReply` (message type ``query``):
  Eco-FL's profiling, the client's response latency at a latency tick and its
  label counts (counts only, never samples);
- :class:`TrainRequest` / :class:`TrainReply` (message type ``train``): one
  :class:`~zpipe.federated.server.TrainTask` and the weights it trained.

Flower is imported lazily: these functions are called only by the apps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from zpipe._errors import ProtocolError

FloatArray = npt.NDArray[np.float64]

PROFILE = "query"
TRAIN = "train"


def _config(content: Any, kind: str) -> Any:
    try:
        return content.config_records["zpipe"]
    except KeyError:
        raise ProtocolError(f"a {kind} message carries no 'zpipe' config record") from None


def _field(config: Any, name: str, kind: str, types: tuple[type, ...]) -> Any:
    value = config.get(name)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ProtocolError(f"a {kind} message's {name!r} is {value!r}")
    return value


def _weights(content: Any, kind: str) -> FloatArray:
    try:
        arrays = content.array_records["weights"].to_numpy_ndarrays()
    except KeyError:
        raise ProtocolError(f"a {kind} message carries no weights") from None
    if len(arrays) != 1 or arrays[0].ndim != 1:
        raise ProtocolError(f"a {kind} message's weights are not one flat array")
    return np.asarray(arrays[0], dtype=np.float64)


@dataclass(frozen=True)
class FlowerProfileRequest:
    tick: int  # 0: before the run; k: after the k-th latency change

    def to_content(self) -> Any:
        from flwr.app import ConfigRecord, RecordDict

        return RecordDict({"zpipe": ConfigRecord({"tick": self.tick})})

    @classmethod
    def from_content(cls, content: Any) -> FlowerProfileRequest:
        tick = _field(_config(content, "profile"), "tick", "profile", (int,))
        if tick < 0:
            raise ProtocolError(f"a profile request's tick is {tick}")
        return cls(tick)


@dataclass(frozen=True)
class FlowerProfileReply:
    client_id: int
    latency_s: float
    label_counts: tuple[int, ...]

    def to_content(self) -> Any:
        from flwr.app import ConfigRecord, RecordDict

        return RecordDict(
            {
                "zpipe": ConfigRecord(
                    {
                        "client_id": self.client_id,
                        "latency_s": float(self.latency_s),
                        "label_counts": [int(c) for c in self.label_counts],
                    }
                )
            }
        )

    @classmethod
    def from_content(cls, content: Any) -> FlowerProfileReply:
        config = _config(content, "profile reply")
        counts = _field(config, "label_counts", "profile reply", (list,))
        if not counts or not all(isinstance(c, int) and c >= 0 for c in counts):
            raise ProtocolError(f"a profile reply's label counts are {counts!r}")
        latency = float(_field(config, "latency_s", "profile reply", (float, int)))
        if not (latency >= 0 and np.isfinite(latency)):
            raise ProtocolError(f"a profile reply's latency is {latency!r}")
        client = _field(config, "client_id", "profile reply", (int,))
        return cls(client, latency, tuple(counts))


@dataclass(frozen=True)
class TrainRequest:
    task_id: int
    client_id: int
    weights: FloatArray

    def to_content(self) -> Any:
        from flwr.app import ArrayRecord, ConfigRecord, RecordDict

        return RecordDict(
            {
                "weights": ArrayRecord([np.asarray(self.weights, dtype=np.float64)]),
                "zpipe": ConfigRecord({"task_id": self.task_id, "client_id": self.client_id}),
            }
        )

    @classmethod
    def from_content(cls, content: Any) -> TrainRequest:
        config = _config(content, "train")
        return cls(
            _field(config, "task_id", "train", (int,)),
            _field(config, "client_id", "train", (int,)),
            _weights(content, "train"),
        )


@dataclass(frozen=True)
class TrainReply:
    task_id: int
    weights: FloatArray
    n_samples: int
    train_s: float  # wall time of the local training (Flower's engine, not simulated)

    def to_content(self) -> Any:
        from flwr.app import ArrayRecord, ConfigRecord, RecordDict

        return RecordDict(
            {
                "weights": ArrayRecord([np.asarray(self.weights, dtype=np.float64)]),
                "zpipe": ConfigRecord(
                    {
                        "task_id": self.task_id,
                        "n_samples": self.n_samples,
                        "train_s": float(self.train_s),
                    }
                ),
            }
        )

    @classmethod
    def from_content(cls, content: Any) -> TrainReply:
        config = _config(content, "train reply")
        n = _field(config, "n_samples", "train reply", (int,))
        if n <= 0:
            raise ProtocolError(f"a train reply counts {n} samples")
        return cls(
            _field(config, "task_id", "train reply", (int,)),
            _weights(content, "train reply"),
            n,
            float(_field(config, "train_s", "train reply", (float, int))),
        )
