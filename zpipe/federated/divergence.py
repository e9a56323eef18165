"""Label distributions and the Jensen-Shannon divergence of eq. 4 (Eco-FL, section 5.2).

A client reports only its label counts (never samples); the server turns
them into distributions. JS divergence uses base-2 logarithms so that it lies
in [0, 1], as the paper states, and it is vectorised over rows because the
association step scores every client of the pool against a group at once.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError

FloatArray = npt.NDArray[np.float64]


def label_distribution(counts: npt.ArrayLike) -> FloatArray:
    """Counts (one per class, or one row per client) normalised to proportions."""
    array = np.asarray(counts, dtype=np.float64)
    if array.size == 0 or np.any(array < 0):
        raise ConfigError("label counts must be a non-empty array of non-negative numbers")
    totals = array.sum(axis=-1, keepdims=True)
    if np.any(totals <= 0):
        raise ConfigError("label counts must not all be zero (a client with no samples)")
    return np.asarray(array / totals, dtype=np.float64)


def _kl_base2(p: FloatArray, q: FloatArray) -> FloatArray:
    # 0 * log(0 / x) is 0 by convention; q > 0 wherever p > 0 inside JS (q is a mixture)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log2(np.where(p > 0, p, 1.0) / np.where(q > 0, q, 1.0)), 0.0)
    return np.asarray(terms.sum(axis=-1), dtype=np.float64)


def js_divergence_rows(p: npt.ArrayLike, q: npt.ArrayLike) -> FloatArray:
    """JS divergence (base 2) between each row of ``p`` and ``q`` (rows or one vector)."""
    pp = label_distribution(p)
    qq = label_distribution(q)
    mixture = 0.5 * (pp + qq)
    js = 0.5 * _kl_base2(pp, mixture) + 0.5 * _kl_base2(qq, mixture)
    # rounding can leave tiny negatives or values just above 1
    return np.asarray(np.clip(js, 0.0, 1.0), dtype=np.float64)


def js_divergence(p: npt.ArrayLike, q: npt.ArrayLike) -> float:
    """JS divergence (base 2, in [0, 1]) between two label distributions or count vectors."""
    return float(js_divergence_rows(np.asarray(p, dtype=np.float64)[None, :], q)[0])
