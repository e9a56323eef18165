"""Radio model: placement, path loss and reception ratios (EdgePipe Table I)."""

from __future__ import annotations

import numpy as np
import pytest

from zpipe._errors import ConfigError
from zpipe.lossy.radio import (
    RadioModel,
    link_prr,
    make_topology,
    measure_prr,
    path_loss_db,
    prr_from_snr,
    uniform_topology,
)


def test_six_devices_over_50m_average_about_81_percent() -> None:
    # Section VI: "resulting in an average PRR of 80.9 % between devices".
    means = [make_topology(6, 50.0, seed=s).mean_prr for s in range(400)]
    assert np.mean(means) == pytest.approx(0.809, abs=0.02)


def test_reception_falls_with_region_and_exponent() -> None:
    def avg(region: float, exponent: float = 3.1) -> float:
        model = RadioModel().with_exponent(exponent)
        return float(
            np.mean([make_topology(6, region, seed=s, model=model).mean_prr for s in range(60)])
        )

    assert avg(25.0) > avg(50.0) > avg(100.0)
    assert avg(50.0, 2.9) > avg(50.0, 3.1) > avg(50.0, 3.7)


def test_path_loss_is_log_distance() -> None:
    model = RadioModel()
    d = np.array([0.5, 1.0, 10.0, 100.0])
    pl = path_loss_db(d, model, np.zeros(4))
    assert pl[0] == pl[1] == pytest.approx(46.68)  # below d0 counts as d0
    assert pl[2] - pl[1] == pytest.approx(31.0)  # 10 n per decade, n = 3.1
    assert pl[3] - pl[2] == pytest.approx(31.0)


def test_reception_curves_are_monotone_probabilities() -> None:
    snr = np.linspace(-20, 20, 81)
    for curve in (prr_from_snr(snr, 40), link_prr(snr, RadioModel())):
        assert np.all((curve >= 0) & (curve <= 1))
        assert np.all(np.diff(curve) >= -1e-12)
    assert prr_from_snr(np.array([-10.0]), 40)[0] < 1e-6
    assert prr_from_snr(np.array([10.0]), 40)[0] > 0.999
    # the per-packet 8 dB term widens the transition: a fractional ratio mid-way
    assert 0.2 < link_prr(np.array([0.0]), RadioModel())[0] < 0.8


def test_topology_is_seeded_and_well_formed() -> None:
    a = make_topology(6, 50.0, seed=11)
    b = make_topology(6, 50.0, seed=11)
    np.testing.assert_array_equal(a.prr, b.prr)
    np.testing.assert_array_equal(a.prr_measured, b.prr_measured)
    assert not np.array_equal(a.positions, make_topology(6, 50.0, seed=12).positions)
    assert np.all((a.positions >= 0) & (a.positions <= 50))
    np.testing.assert_allclose(a.prr, a.prr.T)  # same path loss both ways
    assert np.all(np.diag(a.prr) == 1.0)
    # measured ratios are whole packets out of 50
    assert np.allclose(a.prr_measured * 50, np.round(a.prr_measured * 50))
    # changing the exponent keeps the placement (Fig. 9(a): same topology)
    c = make_topology(6, 50.0, seed=11, model=RadioModel().with_exponent(3.5))
    np.testing.assert_array_equal(a.positions, c.positions)
    assert c.mean_prr < a.mean_prr


def test_measure_prr_estimates_the_ratio() -> None:
    prr = uniform_topology(3, 0.7)
    measured = measure_prr(prr, packets=20000, rng=np.random.default_rng(0))
    assert measured[0, 1] == pytest.approx(0.7, abs=0.02)


@pytest.mark.parametrize(
    "kwargs",
    [{"path_loss_exponent": 0.0}, {"shadowing_sigma_db": -1.0}, {"frame_bytes": 0}],
)
def test_bad_radio_parameters(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        RadioModel(**kwargs)  # type: ignore[arg-type]


def test_bad_topology_arguments() -> None:
    with pytest.raises(ConfigError, match="positive"):
        make_topology(6, 0.0, seed=0)
    with pytest.raises(ConfigError, match="at least one device"):
        make_topology(0, 50.0, seed=0)
    with pytest.raises(ConfigError, match="probe"):
        make_topology(3, 50.0, seed=0, probe_packets=0)
    with pytest.raises(ConfigError):
        uniform_topology(3, 1.5)
