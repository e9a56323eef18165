"""fl-sim with --pipeline-latency: a client's latency is its home's planned period."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zpipe._errors import ConfigError
from zpipe.cli.fl_sim import build_parser, config_from_args
from zpipe.federated.home_plan import home_period_s
from zpipe.federated.model import MLPShape
from zpipe.federated.simulate import (
    PipelineFederation,
    SimConfig,
    build_federation,
    config_record,
    run_simulation,
)
from zpipe.lossy.data import Dataset, load_digits_dataset

PIPED = SimConfig(
    n_clients=30,
    max_concurrent=8,
    budget_s=300.0,
    more_hidden=(32, 32),
    pipeline_latency=True,
    seed=2,
)


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_digits_dataset()


def test_latencies_are_the_homes_planned_periods_not_draws(digits: Dataset) -> None:
    federation = build_federation(PIPED, digits)
    assert isinstance(federation, PipelineFederation)
    shape = MLPShape(64, 32, 10, (32, 32))
    reference = home_period_s(shape, ["nx"], 10)
    sizes = {len(h) for h in federation.homes}
    assert sizes <= {1, 2, 3, 4} and len(sizes) > 1
    for c, home in enumerate(federation.homes):
        want = PIPED.delay_mean_s * home_period_s(shape, home, 10) / reference
        assert federation.latency(c) == pytest.approx(want)
    # the base-delay draw plays no part: another spread, the same latencies
    other = build_federation(replace(PIPED, delay_std_s=9.0), digits)
    assert [other.latency(c) for c in range(30)] == [federation.latency(c) for c in range(30)]
    # a home of one Nano is three times one NX's (the time unit); more devices are faster
    by_home = {tuple(sorted(h)): federation.latency(c) for c, h in enumerate(federation.homes)}
    if ("nano",) in by_home:
        assert by_home[("nano",)] == pytest.approx(3 * PIPED.delay_mean_s)
    assert min(by_home.values()) < PIPED.delay_mean_s


def test_the_dynamic_setting_redraws_homes(digits: Dataset) -> None:
    federation = build_federation(PIPED, digits)
    assert isinstance(federation, PipelineFederation)
    before = list(federation.homes)
    federation.change_degrees(PIPED.degrees, 1.0)
    assert federation.homes != before and len(federation.homes) == len(before)
    federation.change_degrees(PIPED.degrees, 0.0)
    after = list(federation.homes)
    federation.change_degrees(PIPED.degrees, 0.0)
    assert federation.homes == after


def test_a_pipeline_latency_run_learns_and_reports_its_homes(digits: Dataset) -> None:
    run = run_simulation(PIPED, digits)
    homes = run["pipeline_homes"]
    assert 1 <= homes["mean_devices"] <= 4
    assert homes["latency_s"]["max"] <= 3 * PIPED.delay_mean_s + 1e-9
    assert run["config"]["pipeline_latency"] is True and run["config"]["more_hidden"] == (32, 32)
    assert run["client_tasks"] > 30
    assert run_simulation(PIPED, digits)["curve"] == run["curve"]


def test_the_default_run_records_no_new_fields(digits: Dataset) -> None:
    record = config_record(SimConfig())
    assert not {"more_hidden", "pipeline_latency", "home_sizes"} & set(record)
    assert "pipeline_homes" not in run_simulation(SimConfig(n_clients=10, budget_s=60.0), digits)
    assert not isinstance(build_federation(SimConfig(n_clients=10), digits), PipelineFederation)


def test_the_flags_reach_the_config() -> None:
    args = build_parser().parse_args(
        ["--out", "x", "--hidden", "32,24,16", "--pipeline-latency", "--home-devices", "2-3"]
    )
    config = config_from_args(args, "ecofl", 0)
    assert (config.hidden, config.more_hidden) == (32, (24, 16))
    assert config.pipeline_latency and config.home_sizes == (2, 3)
    default = config_from_args(build_parser().parse_args(["--out", "x"]), "ecofl", 0)
    assert (default.hidden, default.more_hidden, default.pipeline_latency) == (32, (), False)
    for bad in (["--home-devices", "3-2"], ["--home-devices", "1-9"], ["--hidden", "32,0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--out", "x", *bad])
    with pytest.raises(ConfigError, match="home sizes"):
        SimConfig(home_sizes=(0, 2))


def test_homes_may_be_drawn_from_some_classes_only(digits: Dataset) -> None:
    paper = replace(PIPED, home_classes=("tx2", "nano"), home_sizes=(1, 3))
    federation = build_federation(paper, digits)
    assert isinstance(federation, PipelineFederation)
    assert {d for h in federation.homes for d in h} == {"tx2", "nano"}
    assert {len(h) for h in federation.homes} <= {1, 2, 3}
    federation.change_degrees(paper.degrees, 1.0)  # every home redrawn: still of those
    assert {d for h in federation.homes for d in h} <= {"tx2", "nano"}
    assert config_record(paper)["home_classes"] == ("tx2", "nano")
    # every class named: the same draws as the default (earlier runs unchanged)
    every = build_federation(replace(PIPED, home_classes=("nx", "tx2", "nano")), digits)
    assert isinstance(every, PipelineFederation)
    assert every.homes == build_federation(PIPED, digits).homes  # type: ignore[attr-defined]
    assert "home_classes" not in config_record(PIPED)
    with pytest.raises(ConfigError, match="unknown device classes"):
        replace(PIPED, home_classes=("orin",))


def test_the_server_is_handed_over_with_every_merge_and_its_weight(digits: Dataset) -> None:
    for method in ("ecofl", "fedasync", "fedavg"):
        servers: list = []
        config = replace(PIPED, method=method, budget_s=100.0, n_groups=3)
        run = run_simulation(config, digits, on_server=servers.append)
        (server,) = servers
        assert len(server.merges) == run["stats"]["global_updates"] > 0
        assert all(0 < w <= 1 for _, w in server.merges)
        groups = {g for g, _ in server.merges}
        assert groups == {-1} if method != "ecofl" else groups <= {0, 1, 2}
