"""Radio model for lossy-link experiments (EdgePipe section VI, Table I).

Devices are placed uniformly at random in a square region. A packet's path
loss follows the combined log-distance path-loss / shadowing model the paper
cites ([52], the model TOSSIM's link-layer generator uses)::

    PL(d) = PL(d0) + 10 n log10(d / d0) + X,   X ~ N(0, sigma^2) dB

with Table I's ``n = 3.1``, ``PL(d0) = 46.68 dB`` at ``d0 = 1 m`` and
``sigma = 8 dB``, which Table I calls *additive white Gaussian noise*.

The paper does not say how path loss becomes a packet reception ratio. We use
the standard mapping for its IEEE 802.15.4 radio (Zuniga and Krishnamachari,
the one TOSSIM uses): SNR = P_tx - PL - noise floor; O-QPSK bit error rate

    BER = 8/15 * 1/16 * sum_{k=2..16} (-1)^k C(16, k) exp(20 SNR (1/k - 1))

(SNR linear) and ``PRR = (1 - BER)^(8 f)`` for an ``f``-byte frame. That
curve goes from nothing to everything within about 3 dB, so if the 8 dB term
were drawn once per link every link would be either perfect or dead, and
measuring a link's ratio with 50 packets (as the paper does) and drawing
fractional ratios (Fig. 3(a)) would make no sense. So we read the 8 dB term
as *white*, drawn afresh for every packet: a link's reception ratio is the
802.15.4 curve averaged over ``X`` (Gauss-Hermite quadrature), a smooth
function of distance. A static per-link term is available
(``static_shadowing_sigma_db``, default 0) for whoever wants both.

With the transmit power fixed at the CC2420's 0 dBm and a 40-byte frame, the
one free constant is the noise floor; -97.2 dBm makes six devices over
50 x 50 m average 0.81 reception over random placements, the paper's 80.9 %
(``tests/unit/lossy/test_lossy_radio.py`` checks it over many seeds).

Like the paper, the ratio the mapping sees is *measured* by sending 50
packets over each directed link (:func:`measure_prr`); the simulation drops
messages with the model ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError

FloatArray = npt.NDArray[np.float64]

_K = np.arange(2, 17, dtype=np.float64)
_HERMITE_X, _HERMITE_W = np.polynomial.hermite.hermgauss(60)
_BINOM_SIGNED = np.array([(-1) ** k * math.comb(16, k) for k in range(2, 17)], dtype=np.float64)


@dataclass(frozen=True)
class RadioModel:
    """Constants of the path-loss and reception model (defaults: EdgePipe Table I)."""

    path_loss_exponent: float = 3.1
    reference_loss_db: float = 46.68
    reference_distance_m: float = 1.0
    shadowing_sigma_db: float = 8.0
    static_shadowing_sigma_db: float = 0.0
    tx_power_dbm: float = 0.0
    noise_floor_dbm: float = -97.2
    frame_bytes: int = 40

    def __post_init__(self) -> None:
        if self.path_loss_exponent <= 0:
            raise ConfigError(f"path-loss exponent must be positive, got {self.path_loss_exponent}")
        if self.reference_distance_m <= 0:
            raise ConfigError(
                f"reference distance must be positive, got {self.reference_distance_m}"
            )
        if self.shadowing_sigma_db < 0 or self.static_shadowing_sigma_db < 0:
            raise ConfigError("shadowing sigmas must be >= 0")
        if self.frame_bytes < 1:
            raise ConfigError(f"frame must be at least 1 byte, got {self.frame_bytes}")

    def with_exponent(self, exponent: float) -> RadioModel:
        return replace(self, path_loss_exponent=exponent)


@dataclass(frozen=True)
class LinkTopology:
    """Device positions and per-link quality; ``prr[a, b]`` is device a to device b."""

    region_m: float
    positions: FloatArray
    path_loss_db: FloatArray
    prr: FloatArray
    prr_measured: FloatArray
    model: RadioModel = field(default_factory=RadioModel)

    @property
    def n_devices(self) -> int:
        return int(self.positions.shape[0])

    @property
    def mean_prr(self) -> float:
        """Average model reception over ordered device pairs (self-links excluded)."""
        return mean_offdiagonal(self.prr)

    def to_dict(self) -> dict[str, Any]:
        return {
            "region_m": self.region_m,
            "positions": self.positions.tolist(),
            "prr": self.prr.tolist(),
            "prr_measured": self.prr_measured.tolist(),
            "mean_prr": self.mean_prr,
            "mean_prr_measured": mean_offdiagonal(self.prr_measured),
            "path_loss_exponent": self.model.path_loss_exponent,
        }


def path_loss_db(distance_m: FloatArray, model: RadioModel, shadowing_db: FloatArray) -> FloatArray:
    """Mean log-distance path loss plus a static shadowing term; distances below
    d0 count as d0."""
    d = np.maximum(distance_m, model.reference_distance_m)
    return (
        model.reference_loss_db
        + 10.0 * model.path_loss_exponent * np.log10(d / model.reference_distance_m)
        + shadowing_db
    )


def link_prr(mean_snr_db: FloatArray, model: RadioModel) -> FloatArray:
    """Reception ratio at a mean SNR when each packet's SNR varies by N(0, sigma^2) dB."""
    snr = np.asarray(mean_snr_db, dtype=np.float64)
    if model.shadowing_sigma_db == 0:
        return prr_from_snr(snr, model.frame_bytes)
    # E[f(mu + sigma Z)] = sum_i w_i f(mu + sqrt(2) sigma x_i) / sqrt(pi)
    offsets = np.sqrt(2.0) * model.shadowing_sigma_db * _HERMITE_X
    per_node = prr_from_snr(snr[..., None] + offsets, model.frame_bytes)
    return np.asarray((per_node * _HERMITE_W).sum(axis=-1) / np.sqrt(np.pi), dtype=np.float64)


def prr_from_snr(snr_db: FloatArray, frame_bytes: int) -> FloatArray:
    """802.15.4 O-QPSK packet reception ratio for a frame of ``frame_bytes``."""
    snr = 10.0 ** (np.asarray(snr_db, dtype=np.float64) / 10.0)
    terms = _BINOM_SIGNED * np.exp(20.0 * snr[..., None] * (1.0 / _K - 1.0))
    ber = np.clip((8.0 / 15.0) * (1.0 / 16.0) * terms.sum(axis=-1), 0.0, 0.5)
    return np.asarray((1.0 - ber) ** (8 * frame_bytes), dtype=np.float64)


def place_devices(n_devices: int, region_m: float, rng: np.random.Generator) -> FloatArray:
    """Uniform random positions in a ``region_m`` x ``region_m`` square."""
    if n_devices < 1:
        raise ConfigError(f"need at least one device, got {n_devices}")
    if not region_m > 0:
        raise ConfigError(f"region side must be positive metres, got {region_m}")
    return rng.uniform(0.0, region_m, size=(n_devices, 2))


def make_topology(
    n_devices: int,
    region_m: float,
    *,
    seed: int,
    model: RadioModel | None = None,
    probe_packets: int = 50,
) -> LinkTopology:
    """A seeded random placement with model and 50-packet measured reception ratios.

    The placement and shadowing use one stream and the probes another, so the
    same seed gives the same devices whatever ``probe_packets`` is; changing
    only the path-loss exponent keeps the placement and shadowing too (Fig. 9a).
    """
    model = model or RadioModel()
    if probe_packets < 1:
        raise ConfigError(f"probe_packets must be >= 1, got {probe_packets}")
    place_rng, shadow_rng, probe_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)
    )
    positions = place_devices(n_devices, region_m, place_rng)
    diff = positions[:, None, :] - positions[None, :, :]
    distance = np.sqrt((diff**2).sum(axis=-1))
    # A static term is the same both ways; the per-packet term is averaged in link_prr.
    upper = np.triu(
        shadow_rng.normal(0.0, model.static_shadowing_sigma_db, size=(n_devices, n_devices)), 1
    )
    loss = path_loss_db(distance, model, upper + upper.T)
    prr = link_prr(model.tx_power_dbm - loss - model.noise_floor_dbm, model)
    np.fill_diagonal(prr, 1.0)
    measured = measure_prr(prr, packets=probe_packets, rng=probe_rng)
    return LinkTopology(
        region_m=float(region_m),
        positions=positions,
        path_loss_db=loss,
        prr=prr,
        prr_measured=measured,
        model=model,
    )


def measure_prr(prr: FloatArray, *, packets: int, rng: np.random.Generator) -> FloatArray:
    """Reception ratio as the paper measures it: received out of ``packets`` probes."""
    received = rng.binomial(packets, np.clip(prr, 0.0, 1.0))
    measured = received.astype(np.float64) / packets
    np.fill_diagonal(measured, 1.0)
    return measured


def uniform_topology(n_devices: int, prr: float) -> FloatArray:
    """Every link with the same reception ratio (for tests and ablations)."""
    if not 0.0 <= prr <= 1.0:
        raise ConfigError(f"reception ratio must be in [0, 1], got {prr}")
    out = np.full((n_devices, n_devices), float(prr))
    np.fill_diagonal(out, 1.0)
    return out


def mean_offdiagonal(matrix: FloatArray) -> float:
    n = matrix.shape[0]
    if n < 2:
        return 1.0
    mask = ~np.eye(n, dtype=bool)
    return float(matrix[mask].mean())
