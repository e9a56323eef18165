"""The options of replication without draining (``live_copies``), checked before
anything is sent, and what the run request carries to the stages."""

from __future__ import annotations

import pytest

from zpipe._errors import ConfigError
from zpipe.client.options import TrainOptions
from zpipe.client.runs.fit import training_request
from zpipe.models import ModelSpec
from zpipe.planner.async_schedule import AsyncSettings

SGD = {"name": "sgd", "lr": 0.1}
ASYNC = dict(optimizer=SGD, num_microbatches=1, schedule="async-1f1b")
SPEC = ModelSpec("mlp", {"dims": [4, 4, 2]}, seed=1)


def test_live_copies_take_ftpipehds_periods_unless_told_otherwise() -> None:
    options = TrainOptions(**ASYNC, live_copies=True)  # type: ignore[arg-type]
    assert options.live_copy_periods == (50, 100)
    assert options.replica_period is None  # no recover: no flush replicas at all
    given = TrainOptions(**ASYNC, live_copies=True, chain_every=5, global_every=20)  # type: ignore[arg-type]
    assert given.live_copy_periods == (5, 20)
    request = training_request(SPEC, given, 4, "tcp://client:9")
    assert request.train is not None
    assert AsyncSettings.from_dict(request.train["async"]) == AsyncSettings(
        chain_every=5, global_every=20
    )
    # without them the request says nothing new (an older coordinator understands it)
    plain = training_request(SPEC, TrainOptions(**ASYNC), 4, "tcp://client:9")  # type: ignore[arg-type]
    assert plain.train is not None and "chain_every" not in plain.train["async"]


def test_a_recovering_run_keeps_its_flush_replicas_beside_the_copies() -> None:
    options = TrainOptions(  # type: ignore[arg-type]
        **ASYNC, live_copies=True, recover=True, replicate_every=8, chain_every=2
    )
    # exact rollback still resumes from global replicas at flushes, every 8
    assert (options.replica_period, options.global_period) == (8, None)
    assert options.live_copy_periods == (2, 100)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"schedule": "1f1b", "num_microbatches": 2}, "live_copies is for async-1f1b"),
        ({"recover": True, "replication": "chain"}, "leave replication at 'global'"),
        ({"chain_every": 0}, "chain_every must be >= 1"),
        ({"global_every": 2.5}, "global_every must be >= 1"),
        ({"live_copies": "yes"}, "live_copies must be True or False"),
    ],
)
def test_live_copy_options_that_do_not_fit_are_refused(change: dict, error: str) -> None:
    settings = {**ASYNC, "live_copies": True, **change}
    with pytest.raises(ConfigError, match=error):
        TrainOptions(**settings)  # type: ignore[arg-type]


def test_the_stages_refuse_periods_that_are_not_whole_numbers() -> None:
    with pytest.raises(ConfigError, match="chain_every must be a whole number"):
        AsyncSettings(chain_every=0)
    with pytest.raises(ConfigError, match="malformed asynchronous settings"):
        AsyncSettings.from_dict({"global_every": "often"})
    with pytest.raises(ConfigError, match="global_every must be a whole number"):
        AsyncSettings.from_dict({"global_every": True})
    assert not AsyncSettings().live_copies and AsyncSettings(global_every=3).live_copies
