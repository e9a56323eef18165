"""How big a model is before it is built, and the bound on what a peer may ask for.

A built-in family's config is a handful of integers, so a peer can ask for a
model of any size: an MLP with ``dims [10**9, 10**9]`` is 10**18 parameters,
and building it, or even counting its units and parameters by building them,
would exhaust the memory of whoever tries. So every built-in family counts its
parameters (and buffers) from the config alone, in time that does not grow
with the size asked for (:meth:`parameter_elements`), and a process checks
that count against its limit before it builds units of a peer's spec:

- a stage builds at most its limit (``--max-model-mb``, else its ``--memory-mb``,
  else the machine's memory; :func:`set_peer_build_limit`);
- the coordinator counts units of a peer's spec only for a model of at most
  :data:`DEFAULT_PEER_MODEL_BYTES` in all (:func:`check_model_size`).

A spec the process wrote itself (``ModelSpec(...)`` in the embedding program) is
its own choice and is not bounded here. User-code families are built by a
factory the operator allowed (zpipe.models.trust), but a peer chooses its
kwargs: for a peer's spec the module is built on the meta device first and
counted (:func:`check_peer_module`); a factory that cannot run on the meta
device is counted right after its real build, so its peak is not bounded but
nothing over the limit is kept.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from zpipe._errors import ModelSpecError

if TYPE_CHECKING:  # counting calls methods only: size.py stays importable without torch
    from torch import nn

# Parameters are built in float32: four bytes an element (buffers such as a
# BatchNorm's step counter are counted the same, close enough for a bound).
BYTES_PER_ELEMENT = 4
# The whole model a peer may ask any process to count or plan: far above every
# edge model (ViT-Huge is 2.5 GB), far below what a hostile config can name.
DEFAULT_PEER_MODEL_BYTES = 1 << 40
MIB = 1 << 20


@runtime_checkable
class SizedSequence(Protocol):
    """A layer sequence that counts its units' parameters without building them."""

    @property
    def num_units(self) -> int: ...

    def parameter_elements(self, start: int, end: int) -> int:
        """Elements of the parameters and buffers of units ``[start, end)``."""
        ...


def machine_memory_bytes() -> int | None:
    """Physical memory of this machine, or None where the OS does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def default_build_limit(memory_mb: float | None = None) -> int:
    """A device's limit: its declared memory, else the machine's, else the whole-model bound."""
    if memory_mb is not None:
        return int(memory_mb * MIB)
    return machine_memory_bytes() or DEFAULT_PEER_MODEL_BYTES


_peer_build_limit: int = default_build_limit()


def set_peer_build_limit(limit_bytes: int) -> int:
    """The most parameter bytes this process builds for a peer's spec; returns the
    previous limit. A stage calls it once at start-up."""
    global _peer_build_limit
    if limit_bytes < 1:
        raise ModelSpecError(f"a model size limit must be positive, got {limit_bytes}")
    previous, _peer_build_limit = _peer_build_limit, int(limit_bytes)
    return previous


def peer_build_limit() -> int:
    return _peer_build_limit


def parameter_bytes(sequence: object, start: int = 0, end: int | None = None) -> int | None:
    """Bytes of the parameters of units ``[start, end)`` (all units by default), or
    None for a sequence that cannot count them without building (user code)."""
    if not isinstance(sequence, SizedSequence):
        return None
    stop = sequence.num_units if end is None else end
    return sequence.parameter_elements(start, stop) * BYTES_PER_ELEMENT


def check_model_size(
    sequence: object,
    start: int = 0,
    end: int | None = None,
    *,
    limit_bytes: int,
    what: str = "this process",
) -> None:
    """Raise :class:`ModelSpecError` when units ``[start, end)`` hold more than
    ``limit_bytes`` of parameters; nothing is allocated to find out."""
    nbytes = parameter_bytes(sequence, start, end)
    if nbytes is None or nbytes <= limit_bytes:
        return
    stop = getattr(sequence, "num_units", "?") if end is None else end
    raise ModelSpecError(
        f"units [{start}, {stop}) of this model hold {_human(nbytes)} of parameters, more "
        f"than {what} builds for a peer ({_human(limit_bytes)}); nothing was built. Use a "
        "smaller model or more stages, or raise the limit (--max-model-mb on a stage)"
    )


def check_peer_build(sequence: object, start: int, end: int) -> None:
    """The check a process makes before building units of a peer's spec."""
    check_model_size(sequence, start, end, limit_bytes=_peer_build_limit, what="this device")


def module_elements(module: nn.Module) -> int:
    """Elements of a module's parameters and buffers (works on the meta device)."""
    return sum(tensor.numel() for tensor in [*module.parameters(), *module.buffers()])


def check_peer_module(module: nn.Module, *, factory: str) -> None:
    """The check before building a user factory's module for a peer's spec: its
    kwargs can name any size (a width of 16,384 squares into gigabytes), so the
    module is first built on the meta device and counted here."""
    nbytes = module_elements(module) * BYTES_PER_ELEMENT
    if nbytes <= _peer_build_limit:
        return
    raise ModelSpecError(
        f"factory {factory!r} with these kwargs builds {_human(nbytes)} of parameters, "
        f"more than this device builds for a peer ({_human(_peer_build_limit)}); nothing "
        "was kept. Use smaller kwargs or raise the limit (--max-model-mb on a stage)"
    )


def _human(nbytes: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", MIB)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes} bytes"


def count_in_phase(start: int, end: int, *, offset: int, period: int, phase: int) -> int:
    """How many ``i`` in ``[start, end)`` have ``(i - offset) % period == phase``
    (units of one kind in a repeated block), without a loop over the range."""
    if end <= start:
        return 0

    def below(n: int) -> int:  # count of i in [offset, n) with the phase
        span = n - offset - phase
        return 0 if span <= 0 else (span + period - 1) // period

    return below(end) - below(start)


@runtime_checkable
class BoundarySizedSequence(Protocol):
    """A layer sequence that knows, from its config, its largest boundary tensor."""

    def largest_boundary_bytes(self) -> int:
        """Bytes per sample of the largest tensor that crosses any unit boundary (the
        inputs, every unit's outputs; a gradient has its activation's size)."""
        ...


def largest_tensor_bytes_per_sample(sequence: object) -> int | None:
    """Bytes per sample of the largest tensor any cut of the model sends, from the
    config alone (no torch, nothing built); None for a sequence that cannot say
    without building its units (user code)."""
    if not isinstance(sequence, BoundarySizedSequence):
        return None
    return sequence.largest_boundary_bytes()
