"""Data sets for lossy-link experiments, all local: nothing is ever downloaded.

- ``digits``: scikit-learn's 8 x 8 handwritten digits (1797 images shipped
  inside the package), pixels scaled to [0, 1], a fixed stratified 80/20
  split so every run and seed sees the same test set;
- ``generated``: a seeded synthetic 8-class set (:func:`load_generated_dataset`),
  for checking that a result does not hold for digits alone;
- Fashion-MNIST (or MNIST) from the four IDX files in a directory the user
  names (``train-images-idx3-ubyte`` etc., optionally ``.gz``).
"""

from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

_IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


@dataclass(frozen=True)
class Dataset:
    name: str
    x_train: FloatArray
    y_train: IntArray
    x_test: FloatArray
    y_test: IntArray

    @property
    def n_features(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def n_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max()) + 1)

    def limit(self, n_train: int | None = None, n_test: int | None = None) -> Dataset:
        """The first ``n_train`` / ``n_test`` examples (quick runs on big sets)."""
        return Dataset(
            self.name,
            self.x_train[:n_train],
            self.y_train[:n_train],
            self.x_test[:n_test],
            self.y_test[:n_test],
        )


def load_digits_dataset(*, test_fraction: float = 0.2, split_seed: int = 0) -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "the digits data set needs scikit-learn: pip install 'zpipe[lossy]'"
        ) from exc
    bunch = load_digits()
    x = np.asarray(bunch.data, dtype=np.float64) / 16.0
    y = np.asarray(bunch.target, dtype=np.int64)
    rng = np.random.default_rng(split_seed)
    test_idx: list[int] = []
    for label in np.unique(y):
        idx = np.flatnonzero(y == label)
        rng.shuffle(idx)
        test_idx.extend(idx[: round(len(idx) * test_fraction)].tolist())
    is_test = np.zeros(len(y), dtype=bool)
    is_test[test_idx] = True
    return Dataset("digits", x[~is_test], y[~is_test], x[is_test], y[is_test])


def load_generated_dataset(
    *,
    n_classes: int = 8,
    n_features: int = 32,
    n_informative: int = 12,
    per_class: int = 225,
    separation: float = 1.2,
    seed: int = 0,
) -> Dataset:
    """A synthetic classification set in the manner of scikit-learn's
    ``make_classification``: two Gaussian clusters per class around vertices
    of a hypercube in ``n_informative`` dimensions, the informative features
    mixed by a random linear map, plus pure-noise features; standardised, and
    split 80/20 per class. Fixed by ``seed``, so every run sees the same data."""
    rng = np.random.default_rng([seed, 0x6E4])
    n_clusters = 2 * n_classes
    signs = rng.choice([-1.0, 1.0], size=(n_clusters, n_informative))
    centres = separation * signs
    per_cluster = per_class // 2
    parts = []
    labels = []
    for k in range(n_clusters):
        scale = rng.uniform(0.6, 1.4, size=n_informative)
        parts.append(centres[k] + rng.normal(size=(per_cluster, n_informative)) * scale)
        labels.append(np.full(per_cluster, k % n_classes, dtype=np.int64))
    informative = np.vstack(parts) @ rng.normal(size=(n_informative, n_informative))
    noise = rng.normal(size=(len(informative), n_features - n_informative))
    x = np.hstack([informative, noise])
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    y = np.concatenate(labels)
    is_test = np.zeros(len(y), dtype=bool)
    for label in range(n_classes):
        idx = np.flatnonzero(y == label)
        rng.shuffle(idx)
        is_test[idx[: round(len(idx) * 0.2)]] = True
    order = rng.permutation(len(y))
    x, y, is_test = x[order], y[order], is_test[order]
    return Dataset("generated", x[~is_test], y[~is_test], x[is_test], y[is_test])


def load_idx_dataset(directory: str | Path, *, name: str = "fashion-mnist") -> Dataset:
    """MNIST-format IDX files from ``directory``; pixels scaled to [0, 1]."""
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(f"IDX data directory {str(root)!r} does not exist")
    arrays = {key: _read_idx(_find(root, stem)) for key, stem in _IDX_FILES.items()}
    x_train = arrays["x_train"].reshape(len(arrays["x_train"]), -1).astype(np.float64) / 255.0
    x_test = arrays["x_test"].reshape(len(arrays["x_test"]), -1).astype(np.float64) / 255.0
    y_train = arrays["y_train"].astype(np.int64)
    y_test = arrays["y_test"].astype(np.int64)
    if len(x_train) != len(y_train) or len(x_test) != len(y_test):
        raise ConfigError(f"IDX files in {str(root)!r}: image and label counts differ")
    return Dataset(name, x_train, y_train, x_test, y_test)


def load_dataset(name: str, *, idx_dir: str | Path | None = None) -> Dataset:
    if idx_dir is not None:
        return load_idx_dataset(idx_dir, name=name if name != "digits" else "fashion-mnist")
    if name == "digits":
        return load_digits_dataset()
    if name == "generated":
        return load_generated_dataset()
    raise ConfigError(
        f"data set {name!r} needs local IDX files: pass --idx-dir DIR (nothing is downloaded)"
    )


def _find(root: Path, stem: str) -> Path:
    for candidate in (
        stem,
        stem + ".gz",
        stem.replace("-idx", ".idx"),
        stem.replace("-idx", ".idx") + ".gz",
    ):
        path = root / candidate
        if path.is_file():
            return path
    raise ConfigError(f"missing IDX file {stem}[.gz] in {str(root)!r}")


def _read_idx(path: Path) -> npt.NDArray[np.uint8]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4:
        raise ConfigError(f"{path}: too short for an IDX header")
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ConfigError(f"{path}: not an unsigned-byte IDX file (magic {raw[:4].hex()})")
    header_end = 4 + 4 * ndim
    if ndim < 1 or len(raw) < header_end:
        raise ConfigError(f"{path}: malformed IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4:header_end])
    count = int(np.prod(shape))
    if len(raw) - header_end != count:
        raise ConfigError(
            f"{path}: header says {count} bytes of data, file has {len(raw) - header_end}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header_end).reshape(shape)
