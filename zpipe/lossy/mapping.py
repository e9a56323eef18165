"""Neuron-to-device mapping (EdgePipe section IV-B, Algorithm 2).

Two directed graphs over ``N`` nodes:

- the super-neuron graph ``SNN[i, j]``: how many training passes go from super
  neuron ``i`` to super neuron ``j`` (forward between adjacent layers,
  backward between adjacent layers whose lower one computes, and the output
  layer's result sharing), divided by the largest count, so in ``[0, 1]``;
- the device graph ``PRR[a, b]``: packet reception ratio from device ``a`` to
  device ``b``.

A mapping ``order`` puts super neuron ``k`` on device ``order[k]``; its score
is the element sum of the Hadamard product ``SNN * PRR[order][:, order]``.
The paper's search (:func:`map_genetic`) is a seeded random search that keeps
the best of a random re-ordering and a rotation ("swipe") each generation;
:func:`map_exhaustive` tries every permutation (the paper's *Upper*) and
:func:`map_random` is the *Random* baseline.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError
from zpipe.lossy.cnn import CnnSpec, partition_cnn
from zpipe.lossy.partition import Allocation, partition

FloatArray = npt.NDArray[np.float64]

#: Above this many devices :func:`map_exhaustive` refuses (9! = 362880 permutations).
EXHAUSTIVE_MAX_DEVICES = 8


def pass_counts(alloc: Allocation) -> npt.NDArray[np.int64]:
    """Training passes from super neuron ``i`` to super neuron ``j`` (unnormalised)."""
    n = alloc.n_devices
    counts = np.zeros((n, n), dtype=np.int64)
    owners = [
        [k for k, sn in enumerate(alloc.super_neurons) if sn.slice_of(layer) is not None]
        for layer in range(alloc.n_layers)
    ]
    last = alloc.n_layers - 1
    for layer in range(last):
        for i in owners[layer]:
            for j in owners[layer + 1]:
                if i != j:
                    counts[i, j] += 1  # forward: layer -> layer + 1
                    if layer >= 1:  # the input layer computes nothing in backward
                        counts[j, i] += 1
    for i in owners[last]:
        for j in owners[last]:
            if i != j:
                counts[i, j] += 1  # output sharing: softmax needs every logit
    return counts


def connectivity(alloc: Allocation) -> FloatArray:
    """The paper's super-neuron topology: pass counts normalised by their maximum."""
    counts = pass_counts(alloc).astype(np.float64)
    top = counts.max() if counts.size else 0.0
    return counts / top if top > 0 else counts


def mapping_score(
    snn: FloatArray, prr: FloatArray, order: Sequence[int] | npt.NDArray[np.intp]
) -> float:
    """Element sum of ``SNN * PRR`` with super neuron ``k`` on device ``order[k]``."""
    idx = np.asarray(order, dtype=np.intp)
    return float(np.sum(snn * prr[np.ix_(idx, idx)]))


def map_genetic(
    snn: FloatArray, prr: FloatArray, *, generations: int | None = None, seed: int = 0
) -> tuple[int, ...]:
    """Algorithm 2, literally: per generation compare the best, a random re-ordering
    of it and its rotation by one, and keep the largest (ties favour the random one,
    then the rotation, as the pseudo-code's if/else-if does).

    ``generations`` defaults to the paper's 1000 for up to six devices and
    10000 above.
    """
    n = _check_graphs(snn, prr)
    if generations is None:
        generations = 1000 if n <= 6 else 10000
    if generations < 0:
        raise ConfigError(f"generations must be >= 0, got {generations}")
    rng = np.random.default_rng(seed)
    best = np.arange(n)
    best_score = mapping_score(snn, prr, best)
    swipe_order = np.r_[np.arange(1, n), 0]
    for _ in range(generations):
        rand = best[rng.permutation(n)]
        rand_score = mapping_score(snn, prr, rand)
        swipe = best[swipe_order]
        swipe_score = mapping_score(snn, prr, swipe)
        top = max(rand_score, swipe_score, best_score)
        if rand_score == top:
            best, best_score = rand, rand_score
        elif swipe_score == top:
            best, best_score = swipe, swipe_score
    return tuple(int(d) for d in best)


def map_exhaustive(snn: FloatArray, prr: FloatArray) -> tuple[int, ...]:
    """The best mapping over all ``N!`` permutations (the paper's *Upper*)."""
    n = _check_graphs(snn, prr)
    if n > EXHAUSTIVE_MAX_DEVICES:
        raise ConfigError(
            f"exhaustive mapping over {n} devices tries {n}! permutations; "
            f"use the genetic search above {EXHAUSTIVE_MAX_DEVICES} devices"
        )
    perms = np.array(list(itertools.permutations(range(n))), dtype=np.intp)
    # score[p] = sum_ij snn[i, j] * prr[perm_p[i], perm_p[j]], vectorised over p
    scores = np.einsum("ij,pij->p", snn, prr[perms[:, :, None], perms[:, None, :]])
    # first maximum, so ties resolve to the lexicographically smallest order
    return tuple(int(d) for d in perms[int(np.argmax(scores))])


def map_random(n_devices: int, *, seed: int = 0) -> tuple[int, ...]:
    """A seeded uniformly random mapping (the paper's *Random* baseline)."""
    if n_devices < 1:
        raise ConfigError(f"need at least one device, got {n_devices}")
    return tuple(int(d) for d in np.random.default_rng(seed).permutation(n_devices))


def map_devices(
    alloc: Allocation,
    prr: FloatArray,
    *,
    method: str = "genetic",
    seed: int = 0,
    generations: int | None = None,
) -> Allocation:
    """``alloc`` with its super neurons placed on devices by ``method``."""
    snn = connectivity(alloc)
    if prr.shape != snn.shape:
        raise ConfigError(
            f"link matrix is {prr.shape[0]}x{prr.shape[1]} but the allocation has "
            f"{alloc.n_devices} devices"
        )
    if method == "genetic":
        order = map_genetic(snn, prr, generations=generations, seed=seed)
    elif method == "exhaustive":
        order = map_exhaustive(snn, prr)
    elif method == "random":
        order = map_random(alloc.n_devices, seed=seed)
    elif method == "identity":
        order = tuple(range(alloc.n_devices))
    else:
        raise ConfigError(
            f"unknown mapping {method!r}; choose genetic, exhaustive, random or identity"
        )
    return alloc.with_devices(order)


def _check_graphs(snn: FloatArray, prr: FloatArray) -> int:
    if snn.ndim != 2 or snn.shape[0] != snn.shape[1]:
        raise ConfigError(f"super-neuron graph must be square, got shape {snn.shape}")
    if prr.shape != snn.shape:
        raise ConfigError(
            f"device graph shape {prr.shape} differs from super-neuron graph {snn.shape}"
        )
    if snn.shape[0] < 1:
        raise ConfigError("need at least one device")
    return int(snn.shape[0])


def partition_and_map(
    layer_sizes: Sequence[int],
    allocation: str,
    n_devices: int,
    prr: FloatArray,
    *,
    mapping: str,
    seed: int,
    cnn: CnnSpec | None = None,
    conv_devices: int = 0,
) -> Allocation:
    """Algorithm 1, then Algorithm 2 on ``prr`` (naive: everything on device 0).

    ``cnn``: the layers are that CNN's, its convolution layers allocated layer-wise
    on ``conv_devices`` devices (:func:`zpipe.lossy.cnn.partition_cnn`)."""
    if cnn is not None:
        if list(layer_sizes) != cnn.layer_sizes:
            raise ConfigError(f"layers {list(layer_sizes)} are not the CNN's {cnn.layer_sizes}")
        alloc = partition_cnn(allocation, cnn, n_devices, conv_devices=conv_devices)
        if allocation == "naive":
            return alloc
        return map_devices(alloc, prr, method=mapping, seed=seed)
    if allocation == "naive":
        return partition("naive", layer_sizes, 1)
    return map_devices(
        partition(allocation, layer_sizes, n_devices), prr, method=mapping, seed=seed
    )
