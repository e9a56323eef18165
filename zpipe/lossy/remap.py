"""Re-mapping a dead device's super neurons onto the survivors (EdgePipe's device
malfunction case, when the run asks for it: ``on_death="remap"``).

The survivors keep the neurons they own: moving them would cost each a weight
transfer for nothing. Only the dead device's super neurons are placed again, each on
the survivor that maximises Algorithm 2's objective (the element sum of
``SNN * PRR``, :func:`zpipe.lossy.mapping.mapping_score`) over the measured
reception ratios. One super neuron over ``N - 1`` candidates is small enough to try
every placement, so the search is exact rather than genetic, and deterministic
(ties go to the lowest device index).

A survivor can take a super neuron only where the two stay one contiguous neuron
range per layer (the shards hold one slice per layer): a super neuron of another
layer group (no layer in common), or its neighbour in the same group (adjacent
ranges, merged into one). The taker then runs both super neurons' passes.

Where the taken-over neurons' weights come from: the dead device's trained values
died with it, so from the coordinator's copy. When the run asks for replicas, each
stage sends the coordinator its slices after every ``replica_every``-th mini-batch
(right after its last pass of it, a fixed point of its pass sequence: deterministic),
and the neurons resume from the dead device's latest replica; otherwise from their
values at the run's start (the initial weights the client sent, which every party
holds). Either keeps a remapped run deterministic, so its simulation
(:mod:`zpipe.lossy.death_sim`) reproduces it exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from zpipe._errors import ConfigError
from zpipe.lossy.mapping import mapping_score, pass_counts
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import Allocation, NeuronSlice, SuperNeuron

#: a taken-over piece of one layer: ``(layer, start, stop, W rows, b rows)``
Piece = tuple[int, int, int, FloatArray, FloatArray]


def remap_dead(alloc: Allocation, prr: FloatArray, dead: int) -> Allocation | None:
    """``alloc`` with ``dead``'s super neurons placed on survivors (see the module
    docstring); None when no survivor can take one (the run null-fills instead)."""
    if dead not in alloc.device_of:
        raise ConfigError(f"device {dead} runs no super neuron of this allocation")
    if prr.ndim != 2 or prr.shape[0] != prr.shape[1] or prr.shape[0] <= max(alloc.device_of):
        raise ConfigError(f"reception ratios {prr.shape} do not cover the run's devices")
    current = alloc
    while dead in current.device_of:
        orphan = current.device_of.index(dead)
        best: tuple[float, int, Allocation] | None = None
        for k, device in enumerate(current.device_of):
            if k == orphan:
                continue
            merged = merge_super_neurons(current.super_neurons[k], current.super_neurons[orphan])
            if merged is None:
                continue
            candidate = _with_merged(current, keep=k, drop=orphan, merged=merged)
            counts = pass_counts(candidate).astype(np.float64)
            score = mapping_score(counts, prr, candidate.device_of)
            if best is None or score > best[0] or (score == best[0] and device < best[1]):
                best = (score, device, candidate)
        if best is None:
            return None
        current = best[2]
    return current


def merge_super_neurons(keep: SuperNeuron, other: SuperNeuron) -> SuperNeuron | None:
    """``keep`` extended by ``other``'s ranges, if every layer stays one contiguous
    range (None otherwise)."""
    slices: dict[int, NeuronSlice] = {s.layer: s for s in keep.slices}
    for s in other.slices:
        mine = slices.get(s.layer)
        if mine is None:
            slices[s.layer] = s
        elif mine.stop == s.start or s.stop == mine.start:
            slices[s.layer] = NeuronSlice(s.layer, min(mine.start, s.start), max(mine.stop, s.stop))
        else:
            return None
    return SuperNeuron(keep.group, keep.slot, tuple(slices[layer] for layer in sorted(slices)))


def _with_merged(alloc: Allocation, *, keep: int, drop: int, merged: SuperNeuron) -> Allocation:
    sns = list(alloc.super_neurons)
    devices = list(alloc.device_of)
    sns[keep] = merged
    del sns[drop], devices[drop]
    return Allocation(
        kind=alloc.kind,
        layer_sizes=alloc.layer_sizes,
        groups=alloc.groups,
        super_neurons=tuple(sns),
        device_of=tuple(devices),
    )


def taken_over(before: Allocation, after: Allocation, device: int) -> list[tuple[int, int, int]]:
    """``(layer, start, stop)``: the neurons ``device`` owns after a remap and not before
    (the rows its new shard needs from elsewhere), dense layers only."""
    out = []
    for layer in range(1, after.n_layers):
        new = _slice(after, layer, device)
        if new is None:
            continue
        old = _slice(before, layer, device)
        if old is None:
            out.append((layer, new.start, new.stop))
            continue
        if new.start < old.start:
            out.append((layer, new.start, old.start))
        if old.stop < new.stop:
            out.append((layer, old.stop, new.stop))
    return out


def initial_pieces(
    before: Allocation,
    after: Allocation,
    device: int,
    params: Sequence[tuple[FloatArray, FloatArray]],
    replica: Mapping[int, tuple[int, int, FloatArray, FloatArray]] | None = None,
) -> list[Piece]:
    """The rows ``device`` takes over: from ``replica`` (the dead device's slices by layer,
    ``(start, stop, W, b)``, from its latest replica) where it holds them, else at their
    run-start values (``params``: the run's initial ``(W, b)`` per dense layer)."""
    out: list[Piece] = []
    for layer, a, b in taken_over(before, after, device):
        kept = (replica or {}).get(layer)
        if kept is not None and kept[:2] == (a, b):
            out.append((layer, a, b, kept[2].copy(), kept[3].copy()))
        else:
            out.append((layer, a, b, params[layer - 1][0][a:b].copy(),
                        params[layer - 1][1][a:b].copy()))  # fmt: skip
    return out


def replica_covers(
    alloc: Allocation, device: int, replica: Mapping[int, tuple[int, int, FloatArray, FloatArray]]
) -> bool:
    """Whether ``replica`` holds every dense slice ``device`` owns under ``alloc``."""
    mine = {
        layer: (sl.start, sl.stop)
        for layer in range(1, alloc.n_layers)
        if (sl := _slice(alloc, layer, device)) is not None
    }
    return mine == {layer: rows[:2] for layer, rows in replica.items()}


def assemble_slices(
    after: Allocation,
    device: int,
    own: Mapping[int, tuple[NeuronSlice, FloatArray, FloatArray]],
    pieces: Sequence[Piece],
) -> dict[int, tuple[FloatArray, FloatArray]]:
    """``device``'s weights under ``after``: its own rows (``own``: layer -> (the slice
    it owned, W, b)) and the ``pieces`` it took over, stacked in neuron order;
    :class:`ConfigError` if they do not cover its new slices exactly."""
    parts: dict[int, list[tuple[int, int, FloatArray, FloatArray]]] = {}
    for layer, (had, w, b) in own.items():
        parts.setdefault(layer, []).append((had.start, had.stop, w, b))
    for layer, a, z, w, b in pieces:
        parts.setdefault(layer, []).append((a, z, w, b))
    out: dict[int, tuple[FloatArray, FloatArray]] = {}
    for layer in range(1, after.n_layers):
        sl = _slice(after, layer, device)
        if sl is None:
            continue
        got = sorted(parts.get(layer, []), key=lambda p: p[0])
        pos = sl.start
        for a, z, w, b in got:
            if a != pos or w.shape[0] != z - a or b.shape[0] != z - a:
                raise ConfigError(f"layer {layer}: the rows of device {device} do not fit")
            pos = z
        if pos != sl.stop:
            raise ConfigError(f"layer {layer}: rows {pos}..{sl.stop} of device {device} missing")
        out[layer] = (
            np.vstack([p[2] for p in got]),
            np.concatenate([p[3] for p in got]),
        )
    return out


def _slice(alloc: Allocation, layer: int, device: int) -> NeuronSlice | None:
    for d, sl in alloc.owners(layer):
        if d == device:
            return sl
    return None
