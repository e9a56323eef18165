"""The Eco-FL ServerApp's and ClientApp's messages: typed classes that round-trip
through Flower's RecordDict, and bad content refused with a ProtocolError."""

from __future__ import annotations

import numpy as np
import pytest

from zpipe._errors import ProtocolError
from zpipe.federated.flower_messages import (
    FlowerProfileReply,
    FlowerProfileRequest,
    TrainReply,
    TrainRequest,
)

flwr_app = pytest.importorskip("flwr.app")


def test_messages_round_trip_through_flower_records() -> None:
    weights = np.linspace(-1.0, 1.0, 2410)
    assert FlowerProfileRequest.from_content(
        FlowerProfileRequest(3).to_content()
    ) == FlowerProfileRequest(3)
    reply = FlowerProfileReply(7, 4.25, (0, 20, 20, 0))
    assert FlowerProfileReply.from_content(reply.to_content()) == reply
    request = TrainRequest.from_content(TrainRequest(11, 7, weights).to_content())
    assert (request.task_id, request.client_id) == (11, 7)
    assert np.array_equal(request.weights, weights)  # bit-exact: float64 on the wire
    trained = TrainReply.from_content(TrainReply(11, weights * 2, 40, 0.01).to_content())
    assert trained.task_id == 11 and trained.n_samples == 40
    assert np.array_equal(trained.weights, weights * 2)


def test_bad_content_is_refused_with_a_protocol_error() -> None:
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    with pytest.raises(ProtocolError, match="no 'zpipe' config record"):
        FlowerProfileRequest.from_content(RecordDict({}))
    with pytest.raises(ProtocolError, match="'tick'"):
        FlowerProfileRequest.from_content(RecordDict({"zpipe": ConfigRecord({"tick": "3"})}))
    bad_latency = {"client_id": 1, "latency_s": -1.0, "label_counts": [1, 2]}
    with pytest.raises(ProtocolError, match="latency"):
        FlowerProfileReply.from_content(RecordDict({"zpipe": ConfigRecord(bad_latency)}))
    bad_counts = {"client_id": 1, "latency_s": 1.0, "label_counts": [1, -2]}
    with pytest.raises(ProtocolError, match="label counts"):
        FlowerProfileReply.from_content(RecordDict({"zpipe": ConfigRecord(bad_counts)}))
    no_weights = RecordDict({"zpipe": ConfigRecord({"task_id": 1, "client_id": 2})})
    with pytest.raises(ProtocolError, match="no weights"):
        TrainRequest.from_content(no_weights)
    two_d = RecordDict(
        {
            "weights": ArrayRecord([np.zeros((2, 2))]),
            "zpipe": ConfigRecord({"task_id": 1, "n_samples": 4, "train_s": 0.0}),
        }
    )
    with pytest.raises(ProtocolError, match="one flat array"):
        TrainReply.from_content(two_d)
    zero = TrainReply(1, np.zeros(3), 1, 0.0).to_content()
    zero.config_records["zpipe"]["n_samples"] = 0
    with pytest.raises(ProtocolError, match="0 samples"):
        TrainReply.from_content(zero)
