"""Deprecated: training from Python lives in :mod:`zpipe.client` now.

``from zpipe.fit import fit, TrainReport, CONSISTENCIES`` keeps working for one
release; new code imports the same names from :mod:`zpipe.client`.
"""

from __future__ import annotations

from zpipe.client import (
    CONSISTENCIES,
    DEFAULT_REPLICATE_EVERY,
    TrainBatch,
    TrainOptions,
    TrainReport,
    fit,
    split_minibatch,
)

Batch = TrainBatch

__all__ = [
    "CONSISTENCIES",
    "DEFAULT_REPLICATE_EVERY",
    "Batch",
    "TrainOptions",
    "TrainReport",
    "fit",
    "split_minibatch",
]
