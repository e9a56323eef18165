"""Model aggregation rules, pure functions over flat weight vectors.

- FedAvg / intra-group synchronous aggregation (Eco-FL section 5.1): the
  average of the members' models weighted by their sample counts |D_c^g|.
- FedProx's proximal term mu/2 ||w - w^g||^2, added to each client's loss.
- FedAsync (Xie et al., used by Eco-FL between groups):
  w(k) = (1 - alpha_t) w(k-1) + alpha_t w_new with alpha_t = alpha * s(staleness),
  s a staleness function (polynomial (1 + t)^-a, hinge, or constant).
- FedAT's cross-tier weights: tier i's model weighs the update count of
  its mirror tier (fastest <-> slowest), so slow tiers are not drowned out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError

FloatArray = npt.NDArray[np.float64]

STALENESS_FUNCTIONS = ("polynomial", "hinge", "constant")


def weighted_average(models: Sequence[FloatArray], weights: Sequence[float]) -> FloatArray:
    """sum_i weights_i * models_i / sum_i weights_i (FedAvg's rule with sample counts)."""
    if not models or len(models) != len(weights):
        raise ConfigError("weighted_average needs as many weights as models, at least one")
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w < 0) or w.sum() <= 0:
        raise ConfigError("aggregation weights must be non-negative with a positive sum")
    stacked = np.stack([np.asarray(m, dtype=np.float64) for m in models])
    return np.asarray(np.tensordot(w / w.sum(), stacked, axes=1), dtype=np.float64)


def staleness_factor(
    staleness: int, *, function: str = "polynomial", a: float = 0.5, b: int = 4
) -> float:
    """s(t) of FedAsync: polynomial (1 + t)^-a; hinge 1 for t <= b else 1 / (a (t - b) + 1)."""
    if staleness < 0:
        raise ConfigError(f"staleness must be >= 0, not {staleness}")
    if function == "polynomial":
        return float((1.0 + staleness) ** (-a))
    if function == "hinge":
        return 1.0 if staleness <= b else float(1.0 / (a * (staleness - b) + 1.0))
    if function == "constant":
        return 1.0
    raise ConfigError(f"staleness function {function!r} is not one of {STALENESS_FUNCTIONS}")


def fedasync_mix(
    global_weights: FloatArray, new_weights: FloatArray, alpha: float, factor: float = 1.0
) -> FloatArray:
    """(1 - alpha_t) * global + alpha_t * new with alpha_t = alpha * factor."""
    if not 0 < alpha <= 1:
        raise ConfigError(f"alpha must lie in (0, 1], not {alpha}")
    alpha_t = alpha * factor
    return np.asarray((1.0 - alpha_t) * global_weights + alpha_t * new_weights, dtype=np.float64)


def proximal_gradient(weights: FloatArray, anchor: FloatArray, mu: float) -> FloatArray:
    """Gradient of FedProx's mu/2 ||weights - anchor||^2 with respect to ``weights``."""
    return np.asarray(mu * (weights - anchor), dtype=np.float64)


def fedat_tier_weights(update_counts: Sequence[int]) -> FloatArray:
    """FedAT's cross-tier weights: tiers ranked fastest (most updates) to slowest, the
    k-th gets the count of the (M-1-k)-th over the total; uniform before any update."""
    counts = np.asarray(update_counts, dtype=np.float64)
    if len(counts) == 0 or np.any(counts < 0):
        raise ConfigError("FedAT needs a non-negative update count per tier")
    if counts.sum() <= 0:
        return np.full(len(counts), 1.0 / len(counts))
    order = np.argsort(-counts, kind="stable")  # fastest tier first
    weights = np.empty_like(counts)
    weights[order] = counts[order[::-1]]
    return np.asarray(weights / weights.sum(), dtype=np.float64)
