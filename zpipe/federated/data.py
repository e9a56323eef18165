"""Client data for federated simulations: non-IID shards of scikit-learn's digits.

Nothing is downloaded. The digits' fixed 80/20 split (:mod:`zpipe.lossy.data`)
gives the test set; each client's shard is ``samples_per_client`` training
images of its classes, drawn from the training split and augmented (a random
shift of up to one pixel and a little noise), so 300 clients each hold their
own samples although digits has only 1437 training images.

Label layouts (Eco-FL section 6.1, Fig. 8):

- ``niid``: every client holds two random classes;
- ``rlg-iid``: clients of each response-latency group (RLG, K-means on the
  initial latencies) hold two classes each, dealt so that the RLG as a whole
  covers all ten classes evenly;
- ``rlg-niid``: RLG r holds three classes only ({3r, 3r+1, 3r+2} mod 10); each
  of its clients holds two of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError
from zpipe.federated.grouping import kmeans_latency_clusters
from zpipe.lossy.data import Dataset

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

PARTITIONS = ("niid", "rlg-iid", "rlg-niid")


@dataclass(frozen=True)
class ClientShard:
    x: FloatArray
    y: IntArray
    classes: tuple[int, ...]

    def label_counts(self, n_classes: int) -> tuple[int, ...]:
        return tuple(int(c) for c in np.bincount(self.y, minlength=n_classes))


def client_classes(
    partition: str,
    latencies: Sequence[float],
    *,
    n_classes: int,
    n_rlg: int,
    rng: np.random.Generator,
    seed: int,
) -> list[tuple[int, int]]:
    """The two classes of each client under ``partition``."""
    if partition not in PARTITIONS:
        raise ConfigError(f"partition {partition!r} is not one of {PARTITIONS}")
    n = len(latencies)
    if partition == "niid":
        return [_pair(rng.choice(n_classes, size=2, replace=False)) for _ in range(n)]
    _, rlg = kmeans_latency_clusters(latencies, n_rlg, seed=seed)
    classes: list[tuple[int, int]] = [(0, 0)] * n
    for r in range(int(rlg.max()) + 1):
        members = np.flatnonzero(rlg == r)
        rng.shuffle(members)
        if partition == "rlg-iid":
            perm = rng.permutation(n_classes)
            for j, client in enumerate(members):
                classes[int(client)] = _pair(
                    [perm[(2 * j) % n_classes], perm[(2 * j + 1) % n_classes]]
                )
        else:
            allowed = [(3 * r + k) % n_classes for k in range(3)]
            for client in members:
                classes[int(client)] = _pair(rng.choice(allowed, size=2, replace=False))
    return classes


def _pair(values: Sequence[int] | IntArray) -> tuple[int, int]:
    a, b = sorted(int(v) for v in values)
    return a, b


def augment(images: FloatArray, rng: np.random.Generator, *, noise: float = 0.05) -> FloatArray:
    """Shift each 8 x 8 image by up to one pixel (zero fill) and add Gaussian noise."""
    out = np.empty_like(images)
    for i, flat in enumerate(images):
        image = flat.reshape(8, 8)
        dy, dx = rng.integers(-1, 2, size=2)
        shifted = np.zeros_like(image)
        ys = slice(max(dy, 0), 8 + min(dy, 0))
        yd = slice(max(-dy, 0), 8 + min(-dy, 0))
        xs = slice(max(dx, 0), 8 + min(dx, 0))
        xd = slice(max(-dx, 0), 8 + min(-dx, 0))
        shifted[ys, xs] = image[yd, xd]
        out[i] = shifted.ravel()
    out += rng.normal(0.0, noise, out.shape)
    return np.asarray(np.clip(out, 0.0, 1.0), dtype=np.float64)


def make_shards(
    dataset: Dataset,
    classes: Sequence[tuple[int, ...]],
    *,
    samples_per_client: int,
    rng: np.random.Generator,
) -> list[ClientShard]:
    """One augmented shard per client, split evenly over its classes."""
    if samples_per_client < 2:
        raise ConfigError("each client needs at least 2 samples")
    by_class = {int(c): np.flatnonzero(dataset.y_train == c) for c in np.unique(dataset.y_train)}
    shards = []
    for client_classes_ in classes:
        per_class = np.array_split(np.arange(samples_per_client), len(client_classes_))
        xs, ys = [], []
        for label, part in zip(client_classes_, per_class, strict=True):
            if label not in by_class:
                raise ConfigError(f"class {label} has no training samples")
            idx = rng.choice(by_class[label], size=len(part), replace=True)
            xs.append(augment(dataset.x_train[idx], rng))
            ys.append(np.full(len(part), label, dtype=np.int64))
        shards.append(ClientShard(np.concatenate(xs), np.concatenate(ys), tuple(client_classes_)))
    return shards
