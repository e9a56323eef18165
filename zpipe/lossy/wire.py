"""What a lossy run's stages put in their messages, beyond the messages themselves.

The kinds are typed classes in :mod:`zpipe.protocol.lossy` (registered with
every other kind in :data:`zpipe.protocol.REGISTRY`; nothing is pickled). This
module holds what they carry: the run spec, peer maps and tensors as arrays.

msgpack map keys must be strings, so device indices appear as strings in maps.
A :class:`RunSpec` is what every device of a run must agree on; it crosses
the wire as plain data (the allocation's own ``to_dict``, the reception
ratios as a list of float64 lists, which msgpack carries exactly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from zpipe._errors import ConfigError, ProtocolError
from zpipe.lossy.cnn import CnnSpec
from zpipe.lossy.evaluation import EvalSpec
from zpipe.lossy.linkmodes import WAIT_MODES, WaitMode
from zpipe.lossy.links import Recovery, RecoveryScheme
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import Allocation
from zpipe.protocol import Message
from zpipe.protocol.lossy import (
    LossyCnnMap,
    LossyEvalMap,
    LossyPartial,
    LossyRecoveryMap,
    LossyRunSpecMap,
)


@dataclass(frozen=True)
class RunSpec:
    """What every device of one multi-process run agrees on."""

    alloc: Allocation
    prr: FloatArray
    seed: int
    recovery: Recovery
    lossless: bool
    lr: float
    n_data: int
    batch: int
    mode: WaitMode
    slot_s: float
    wait_s: float
    #: the test passes under loss after training (None: none)
    test: EvalSpec | None = None
    #: the CNN whose layers these are (None: an MLP); optional on the wire ("cnn")
    cnn: CnnSpec | None = None

    def to_body(self) -> dict[str, Any]:
        recovery = self.recovery
        return LossyRunSpecMap(
            alloc=self.alloc.to_dict(),
            prr=[[float(v) for v in row] for row in self.prr],
            seed=self.seed,
            recovery=LossyRecoveryMap(
                scheme=recovery.scheme, copies=recovery.copies, max_attempts=recovery.max_attempts
            ).body(),
            lossless=self.lossless,
            lr=self.lr,
            n_data=self.n_data,
            batch=self.batch,
            mode=self.mode,
            slot_s=self.slot_s,
            wait_s=self.wait_s,
            test=None if self.test is None else eval_body(self.test),
            cnn=None if self.cnn is None else self.cnn.to_dict(),
        ).body()

    @classmethod
    def from_body(cls, body: Any) -> RunSpec:
        """The spec a setup message carries; :class:`ProtocolError` if malformed."""
        try:
            fields = LossyRunSpecMap.from_map(body)
            if fields.alloc is None:
                raise ProtocolError("a run spec without its allocation")
            alloc = Allocation.from_dict(fields.alloc)
            rec = LossyRecoveryMap.from_map(fields.recovery)
            spec = cls(
                alloc=alloc,
                prr=np.asarray(fields.prr, dtype=np.float64),
                seed=fields.seed,
                # Recovery refuses an unknown scheme
                recovery=Recovery(cast(RecoveryScheme, rec.scheme), rec.copies, rec.max_attempts),
                lossless=fields.lossless,
                lr=float(fields.lr),
                n_data=fields.n_data,
                batch=fields.batch,
                mode=cast(WaitMode, fields.mode),  # checked below
                slot_s=float(fields.slot_s),
                wait_s=float(fields.wait_s),
                test=eval_from_body(fields.test),
                cnn=None if fields.cnn is None else cnn_from_map(fields.cnn),
            )
        except (ProtocolError, KeyError, TypeError, ValueError) as exc:  # ConfigError: ValueError
            raise ProtocolError(f"lossy_setup: malformed run spec: {exc!r}") from None
        n = len(spec.prr)
        if spec.prr.shape != (n, n) or n <= max(alloc.device_of):
            raise ProtocolError(
                f"lossy_setup: reception ratios of shape {spec.prr.shape} do not cover devices "
                f"{sorted(alloc.device_of)}"
            )
        if spec.cnn is not None and list(alloc.layer_sizes) != spec.cnn.layer_sizes:
            raise ProtocolError(
                f"lossy_setup: the CNN's layers {spec.cnn.layer_sizes} are not the "
                f"allocation's {list(alloc.layer_sizes)}"
            )
        if spec.mode not in WAIT_MODES:
            raise ProtocolError(f"lossy_setup: wait mode must be one of {WAIT_MODES}")
        if spec.n_data < 1 or spec.batch < 1 or not spec.slot_s > 0 or not spec.wait_s > 0:
            raise ProtocolError("lossy_setup: n_data, batch, slot_s and wait_s must be positive")
        return spec


def eval_body(spec: EvalSpec) -> dict[str, Any]:
    return LossyEvalMap(
        n_test=spec.n_test, batch=spec.batch, repeats=spec.repeats, eval_index=spec.eval_index
    ).body()


def eval_from_body(value: Any) -> EvalSpec | None:
    """A run's test passes as the wire carries them (:class:`ProtocolError` or
    ValueError if malformed)."""
    if value is None:
        return None
    fields = LossyEvalMap.from_map(value)
    return EvalSpec(
        n_test=fields.n_test,
        batch=fields.batch,
        repeats=fields.repeats,
        eval_index=fields.eval_index,
    )


def cnn_from_map(value: Any) -> CnnSpec:
    """A CNN as :meth:`CnnSpec.to_dict` wrote it; :class:`ConfigError` if malformed."""
    try:
        fields = LossyCnnMap.from_map(value)
        image = _ints(fields.image)
        if len(image) != 3:
            raise TypeError(f"an image is (channels, height, width), got {image}")
        return CnnSpec(
            image=(image[0], image[1], image[2]),
            channels=_ints(fields.channels),
            hidden=_ints(fields.hidden),
            n_classes=fields.n_classes,
        )
    except (ProtocolError, TypeError) as exc:
        raise ConfigError(f"malformed CNN spec: {exc!r}") from None


def _ints(values: list[Any]) -> tuple[int, ...]:
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise TypeError(f"expected a list of integers, got {values!r}")
    return tuple(values)


def to_tensor(array: np.ndarray) -> torch.Tensor:
    """A numpy array as a tensor for the codec, without a copy where contiguous.

    The array must not be modified afterwards: a zero-copy send only queues it.
    """
    return torch.from_numpy(np.ascontiguousarray(array))


def to_array(tensor: torch.Tensor, *, shape: tuple[int, ...], dtype: Any, what: str) -> Any:
    """A received tensor as a numpy array, checked against what was expected."""
    if tensor.dtype != dtype:
        raise ProtocolError(f"{what}: dtype {tensor.dtype}, expected {dtype}")
    if tuple(tensor.shape) != shape:
        raise ProtocolError(f"{what}: shape {tuple(tensor.shape)}, expected {shape}")
    return tensor.numpy()


def partial_message(
    run: int,
    data: int,
    kind: str,
    layer: int,
    src: int,
    values: FloatArray,
    *,
    copy: int | None = None,
    link_layer: int | None = None,
    direction: int | None = None,
    epoch: int = 0,
) -> Message:
    """A partial's message; ``copy`` (r-TX, ACK) numbers it, ``link_layer`` and
    ``direction`` (ACK) key its acknowledgement's fate."""
    return LossyPartial(
        run=run, data=data, kind=kind, layer=layer, src=src, copy=copy, link_layer=link_layer,
        direction=direction, tensors=(to_tensor(values),), epoch=epoch,
    ).to_message()  # fmt: skip


def peers_from_body(body: Any, what: str) -> dict[int, str]:
    if not isinstance(body, dict):
        raise ProtocolError(f"{what}: peers must be a map")
    try:
        out = {int(k): str(v) for k, v in body.items()}
    except ValueError:
        raise ProtocolError(f"{what}: peer keys must be device indices") from None
    if any(not v.startswith("tcp://") for v in out.values()):
        raise ProtocolError(f"{what}: peer endpoints must be tcp:// addresses")
    return out
